"""GPU time of expected_euler's 3D forward and pullback: V and T, float32 and float64, three shapes.

    python benchmarks/probe_expected_3d.py [--reps N]

Each row: the median of N calls timed with CUDA events around the call (a pullback of a
kept ``cutopo.vjp``, or the plain forward), after 5 warm-up calls. At these sizes the calls
are bound by their kernels, so the rows compare kernel variants; run two trees with
``ab_trees.sh`` (the forty-fourth session's column walks, benchmarks/RESULTS.md).
bench_soft.py times the float32 V case against its CuPy baseline. Without a GPU: nothing
measured, exit 0.
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_ecc import time_gpu  # noqa: E402

SHAPES = ((256, 256, 256), (4, 128, 128, 128), (1, 512, 512, 64))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=40)
    args = p.parse_args(argv)
    import cutopo

    if not cutopo.gpu_available():
        print("probe_expected_3d: no CUDA device visible to CuPy")
        return 0
    import cupy as cp

    rng = np.random.default_rng(0)
    print("| shape | dtype | connectivity | pullback us | forward us |")
    print("|---|---|---|---|---|")
    for shape in SHAPES:
        for dtype in (np.float32, np.float64):
            prob = cp.asarray(rng.random(shape).astype(dtype))
            for connectivity in (1, 3):
                out, pullback = cutopo.vjp(cutopo.expected_euler, prob, ndim=3,
                                           connectivity=connectivity)
                g = cp.ones_like(out)
                back = 1e3 * time_gpu(cp, lambda: pullback(g), args.reps, warmup=5)
                fwd = 1e3 * time_gpu(cp, lambda: cutopo.expected_euler(prob, ndim=3,
                                                                       connectivity=connectivity),
                                     args.reps, warmup=5)
                print(f"| {shape} | {np.dtype(dtype).name} | {connectivity} | {back:.1f} | {fwd:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
