"""Where the time of a CPAB integrate call goes: each stage of the CuPy path timed alone.

    python benchmarks/profile_cpab.py [--case 2d,3d,2d64,3d30] [--reps N] [--all-moments]

Stages: the argument checks with CuPy reductions (check_points_theta alone: a finiteness
reduction read on the host), A = B theta (ELL product), the step-size guard by CuPy
reductions, expm_cells, the call's set-up in one kernel as the ops run it (prepare_cells: A,
the checks, the guard's norm and expm, its flags read), the forward kernel with and without
checkpoints, the backward kernel, frechet_cells, B^T (ELL), and the whole forward and VJP
calls. Kernel rows time the launch alone (CUDA events around repeated
launches on prepared arrays); host rows time the Python call including its synchronisations.
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_cpab import LARGEST, T_STEPS, Case  # noqa: E402
from bench_ecc import time_gpu  # noqa: E402

import cutopo  # noqa: E402
from cutopo.cpab import _integrate_cupy as icp  # noqa: E402
from cutopo.cpab.integrate import integrate  # noqa: E402
from cutopo.cpab.velocity import check_points_theta  # noqa: E402

CASES = {"2d": Case("2d b32 256^2 tess 16", 32, (256, 256), (16, 16)),
         "3d": Case("3d 128^3 tess 10", 1, (128, 128, 128), (10, 10, 10)),
         # bench_cpab's smallest and largest tessellations of the scaling cases
         "2d64": Case("2d b32 256^2 tess 64", 32, (256, 256), (64, 64)),
         "3d2": Case("3d 128^3 tess 2", 1, (128, 128, 128), (2, 2, 2)),
         "3d30": Case("3d 128^3 tess 30", 1, (128, 128, 128), (30, 30, 30))}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--case", default="2d,3d")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--all-moments", action="store_true",
                   help="time the backward under every moment mode (default: the library's)")
    args = p.parse_args(argv)
    if not cutopo.gpu_available():
        print("profile_cpab: no CUDA device visible to CuPy")
        return 0
    import cupy as cp

    for key in args.case.split(","):
        case = CASES[key]
        tess, points, theta = case.inputs(cp, seed=1)
        K = tess.ndim
        dt = np.dtype(np.float32)
        plan = icp.setup(points, theta, tess, T_STEPS, "integrate", dt)
        rows = []

        def row(name, fn, reps=args.reps):
            rows.append((name, time_gpu(cp, fn, reps)))

        row("checks (host, 1 sync)", lambda: check_points_theta(points, theta, tess, "integrate"))
        row("A = B theta (ELL)", lambda: icp.affine_maps(tess, theta[None] if theta.ndim == 1 else theta))
        A = plan.A
        row("guard (1 sync)", lambda: float(cp.sqrt((A[:, :, :K] ** 2).sum(axis=(1, 2))).max()))
        theta2 = theta[None] if theta.ndim == 1 else theta
        E = cp.empty(A.shape, dtype=dt)
        row("expm_cells", lambda: icp.launch(icp._expm_sig(dt.name, K), icp._blocks(len(A), 128), 128,
                                             (A, E, len(A), plan.h)))
        row("prepare_cells: A, finiteness, guard, expm in one kernel (flags read)",
            lambda: icp._prepare(plan.points, theta2, tess, plan.h, dt, ())[2].read())
        row("setup (prepare_cells, checks read)",
            lambda: icp.setup(points, theta, tess, T_STEPS, "integrate", dt))
        row("forward kernel", lambda: icp.integrate(plan))
        # the VJP's segment under the library's CHECKPOINTS (S = 17 at T = 50 for "sparse")
        S, recompute = icp.checkpoint_segment(T_STEPS, 4)
        S_dev = 4 if recompute else S
        row(f"forward kernel + checkpoints every {S_dev}",
            lambda: icp.integrate(plan, checkpoint_every=S_dev))
        _, chk, _ = icp.integrate(plan, checkpoint_every=S_dev)
        out = icp.integrate(plan)[0]
        cot = cp.ones(out.shape, dtype=cp.float64)
        default = icp.MOMENTS
        for moments in icp.MOMENT_MODES if args.all_moments else (default,):
            icp.MOMENTS = moments
            row(f"backward kernel + frechet + B^T, moments per {moments}, checkpoints every {S_dev}",
                lambda: icp.backward(plan, chk, S_dev, cot, False, True))
            S_own = icp.local_segment(T_STEPS, 4)
            row(f"backward kernel + frechet + B^T, moments per {moments}, checkpoints recomputed",
                lambda: icp.backward(plan, None, S_own, cot, False, True))
        icp.MOMENTS = default
        row("backward, points only", lambda: icp.backward(plan, chk, S_dev, cot, True, False))
        G = cp.random.default_rng(0).random((len(A), K * (K + 1)))
        dA = cp.empty_like(G)
        row("frechet_cells", lambda: icp.launch(icp._frechet_sig(K), icp._blocks(len(A), 64), 64,
                                                (A, G, dA, len(A), plan.h)))
        _, basis_t = icp._basis_tables(tess)
        row("B^T dA (ELL)", lambda: icp._ell_product(basis_t, dA.reshape(plan.n_theta, -1), tess.n_params))
        row("integrate call", lambda: integrate(points, theta, tess, n_steps=T_STEPS))
        row("VJP forward call (keeps the residuals)",
            lambda: cutopo.vjp(integrate, points, theta, tess, wrt="theta", n_steps=T_STEPS))
        _, pb = cutopo.vjp(integrate, points, theta, tess, wrt="theta", n_steps=T_STEPS)
        cot32 = cp.ones(out.shape, dtype=cp.float32)
        row("pullback call", lambda: pb(cot32))
        print(f"\n## {case.name}: {tess.n_cells} cells, batch {case.batch}, {points.shape[0]} points, "
              f"T = {T_STEPS}, max ||A|| = {LARGEST}")
        print("| stage | ms |\n|---|---|")
        for name, ms in rows:
            print(f"| {name} | {ms:.4f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
