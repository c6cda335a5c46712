"""GPU ms (CUDA graph) of the soft ECC forward kernel alone, 3D float32 and float64, and a few
values of its output (two trees' outputs compare line by line).

    bash benchmarks/ab_trees.sh ab/old . 2 -- python3 benchmarks/ab_soft_forward.py
"""
import sys
sys.path.insert(0, "benchmarks")
import numpy as np
import cupy as cp
from bench_ecc import time_graph
from bench_soft import smooth_image
from cutopo import _soft_ecc_cupy as S
from cutopo._band_numpy import band_halfwidth
T = 256
for name, img in [("3d smooth 256^3 f32", smooth_image(cp, (256, 256, 256), 3, 2.0, 7)),
                  ("3d smooth 128^3 f32", smooth_image(cp, (128, 128, 128), 3, 2.0, 7)),
                  ("3d smooth 4x96^3 f32", smooth_image(cp, (4, 96, 96, 96), 3, 2.0, 7)),
                  ("3d smooth 128^3 f64", smooth_image(cp, (128, 128, 128), 3, 2.0, 7).astype(np.float64)),
                  ("3d noise 96^3 f32", cp.asarray(np.random.default_rng(5).random((96, 96, 96), dtype=np.float32)))]:
    dt = np.float64 if img.dtype == np.float64 else np.float32
    t = cp.asarray(np.linspace(0, 1, T).astype(dt))
    lam = dt(4.0 * (T - 1))
    w = band_halfwidth(np.dtype(dt), lam)
    plain = lambda: S.soft_ecc_forward(img, t, lam, w, 3, False)
    kept = lambda: S.soft_ecc_forward(img, t, lam, w, 3, False, keep=True)
    out, k = kept()
    o = out.astype(np.float64).reshape(-1, T)
    print(f"OUT {name}: sum {float(o.sum()):.10e} k100 {float(o[-1, 100]):.10e} k128 {float(o[0, 128]):.10e}")
    n = int(k[0].get()) if k is not None else -1
    print(f"FWD {name}: plain {time_graph(cp, plain, 30):.4f} ms, keep {time_graph(cp, kept, 30):.4f} ms, kept entries {n}")
