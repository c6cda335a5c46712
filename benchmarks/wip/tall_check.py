"""Fifty-seventh session: cutopo.ecc(image, 256) GPU time (CUDA events around 50 calls, median
of 5) for 2D sizes near the tall tiles' threshold, with _ecc_cupy.HIST_TALL_MIN_TILES = argv[1]."""
import sys

import cupy as cp
import numpy as np

import cutopo
from cutopo import _ecc_cupy

_ecc_cupy.HIST_TALL_MIN_TILES = float(sys.argv[1])
for shape, dtype in [((2048, 2048), "float32"), ((2048, 8192), "float32"), ((2048, 4096), "uint8"),
                     ((4096, 4096), "float32")]:
    rs = cp.random.default_rng(1)
    img = rs.random(shape, dtype=cp.float32) if dtype == "float32" else rs.integers(0, 256, shape, dtype=cp.uint8)
    t = cp.asarray(np.linspace(0, 1 if dtype == "float32" else 255, 256).astype(dtype if dtype == "float32" else "float64"))
    for _ in range(3):
        cutopo.ecc(img, t)
    times = []
    for _ in range(5):
        a, b = cp.cuda.Event(), cp.cuda.Event()
        a.record()
        for _ in range(50):
            cutopo.ecc(img, t)
        b.record()
        b.synchronize()
        times.append(cp.cuda.get_elapsed_time(a, b) / 50 * 1e3)
    print(f"min_tiles {sys.argv[1]} {shape} {dtype}: {np.median(times):.1f} us per call")
