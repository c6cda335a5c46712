"""Where a registration step's time goes on the GPU: register's device steps, kernel by kernel.

    python benchmarks/profile_register_step.py [--quick]

For bench_register.py's cases (2D 512^2 tess 15^2, 3D 128^3 tess 15^3, float32 blobs, its
theta_true), one level of ``cutopo.cpab._register_cupy.Level`` (with the Dirichlet term) is built and every
launch of its step is timed alone (CUDA events, median of 20; small kernels include the
launch's host time), then the whole step four ways: one call (events), 100 steps launched one
by one (the host's launch rate against the GPU's), 100 replays of the level's captured graph
(register's steps), and a CUDA-graph replay of one step timed alone (the GPU time).
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_ecc import time_gpu, time_graph_or_none  # noqa: E402
from bench_register import Case  # noqa: E402


def profile(cp, case, n_steps=50, reps=20):
    from cutopo._adam import Adam
    from cutopo.cpab import _register_cupy

    fixed, moving, tess, _ = case.inputs(cp, n_steps, seed=sum(map(ord, case.name)))
    theta = cp.zeros(tess.n_params, dtype=np.float32)
    optimiser = Adam(theta, 1e-3)
    level = _register_cupy.Level(moving, fixed, optimiser, tess, n_steps, "bilinear", "border",
                                 2e-4)
    names = ["A = B theta (ELL)", "step guard", "expm_cells", "warp_forward", "mse_gradient",
             "G = 0", "warp_backward", "frechet_cells", "B^T dA (ELL)", "Q theta (ELL)",
             "theta gradient", "Adam (scheduled)", "advance the step counter"]
    steps = 100
    level.steps.fill(1e-3)
    level.invs.fill(1.0)

    def one_launch(launch):
        def fn():
            level.counter.fill(0)
            launch() if hasattr(launch, "sig") else launch(0)
        return fn

    with level.stream:
        # a few steps first, so that theta (and the trajectories) are not the identity's
        level.counter.fill(0)
        for _ in range(5):
            level._step()
        rows = [(name, time_gpu(cp, one_launch(launch), reps))
                for name, launch in zip(names, level._launches)]
        kernels = sum(ms for _, ms in rows)

        def step():
            level.counter.fill(0)
            level._step()

        def hundred():
            level.counter.fill(0)
            for _ in range(steps):
                level._step()

        def hundred_graph():
            level.counter.fill(0)
            for _ in range(steps):
                level._replay()

        one = time_gpu(cp, step, reps)
        per_step = time_gpu(cp, hundred, 3) / steps
        per_graph = time_gpu(cp, hundred_graph, 3) / steps
        graph, why = time_graph_or_none(cp, step, reps)
    print(f"\n## {case.name}: {tess.n_cells} cells, {tess.n_params} params, "
          f"{int(np.prod(fixed.shape))} pixels, T = {n_steps}")
    print("| stage | ms |\n|---|---|")
    for name, ms in rows:
        print(f"| {name} | {ms:.4f} |")
    print(f"| sum of the kernels timed alone | {kernels:.4f} |")
    print(f"| one step, events around the call | {one:.4f} |")
    print(f"| per step, 100 steps back to back | {per_step:.4f} |")
    print(f"| per step, 100 replays of the level's captured graph | {per_graph:.4f} |")
    print(f"| one step, CUDA-graph replay | "
          f"{'%.4f' % graph if graph is not None else 'not capturable: ' + str(why)[:80]} |")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small sizes (a smoke run)")
    args = p.parse_args(argv)
    import cupy as cp

    if not cp.cuda.is_available():
        print("profile_register_step: no CUDA device visible to CuPy; nothing to measure")
        return 0
    cases = ([Case("2d 128", 128, 2, 5, 50), Case("3d 32", 32, 3, 3, 50)] if args.quick else
             [Case("2d 512", 512, 2, 15, 1000), Case("3d 128", 128, 3, 15, 1000)])
    print(f"# {cp.cuda.runtime.getDeviceProperties(0)['name'].decode()}")
    for case in cases:
        profile(cp, case)
    return 0


if __name__ == "__main__":
    sys.exit(main())
