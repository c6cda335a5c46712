"""A/B of CPAB kernel variants in one process: the forward and backward kernels under -D flags.

    python benchmarks/ab_cpab.py [--variant NAME=FLAGS ...] [--case 2d,3d] [--dtype float32]
                                 [--rounds N] [--reps N]

Host and device speed move between processes on the device machines (up to 2x on the host,
~10 % on the GPU), so kernel variants are compared here in one process: every variant's
kernels are compiled with its own -D options of cpab.cu (e.g. --variant
"adjoint64=-DCUTOPO_CPAB_ADJOINT_DOUBLE=1"), and the stages below are timed for each variant
in turn, --rounds rounds of CUDA-event medians of --reps launches, on profile_cpab.py's cases
(bench_cpab.py's inputs, T = 50, the VJP's checkpoints as the library keeps them):

* forward: integrate_forward without checkpoints;
* backward: integrate_backward with point and theta cotangents (frechet_cells and B^T
  included, as a VJP runs them), and with point cotangents only.

A row prints each variant's per-round times, its median and ratio to "base" (this tree, no
flags), and how far its results are from base's: max |difference| / max |base| of the forward's
points, the point cotangents and the theta cotangents. Without a GPU: nothing compared, exit 0.
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_cpab import T_STEPS  # noqa: E402
from bench_ecc import time_gpu  # noqa: E402
from profile_cpab import CASES  # noqa: E402
from cutopo._cuda.launch import KeptLaunches  # noqa: E402


def parse_variants(items):
    """{"base": ()} and one entry per NAME=FLAGS (space-separated -D options)."""
    variants = {"base": ()}
    for item in items:
        name, sep, flags = item.partition("=")
        if not sep or not name or name in variants:
            raise SystemExit(f"--variant {item!r}: NAME=FLAGS with a new NAME")
        variants[name] = tuple(flags.split())
    return variants


class KernelOptions:
    """Launches of the CPAB family with the current variant's -D options (the module's own
    ``launch`` wrapped: the plan and the ops stay the library's)."""

    def __init__(self, icp):
        self.icp, self.original, self.options = icp, icp.launch, ()

    def __enter__(self):
        def launch(sig, grid, block, args, **kw):
            if sig.family == self.icp.FAMILY:
                kw["options"] = tuple(kw.get("options", ())) + self.options
            return self.original(sig, grid, block, args, **kw)

        self.icp.launch = launch
        # a repeated call's kept launches take no options: its kernels go through the wrapper
        self.kept = KeptLaunches.__call__
        KeptLaunches.__call__ = lambda kept, sig, grid, block, args: launch(sig, grid, block, args)
        return self

    def __exit__(self, *exc):
        self.icp.launch = self.original
        KeptLaunches.__call__ = self.kept


def relative(a, b):
    """max |a - b| / max |b| on the host (0 for an all-zero b equal to a)."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    scale = np.abs(b).max()
    diff = np.abs(a - b).max()
    return float(diff / scale) if scale else float(diff)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variant", action="append", default=[], help="NAME=FLAGS (space-separated -D options)")
    p.add_argument("--case", default="2d,3d", help=f"comma-separated, of {', '.join(CASES)}")
    p.add_argument("--dtype", default="float32", choices=("float32", "float64"))
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--reps", type=int, default=20)
    args = p.parse_args(argv)
    variants = parse_variants(args.variant)
    cases = [c for c in args.case.split(",") if c]
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        raise SystemExit(f"--case: unknown {unknown}, known {sorted(CASES)}")

    import cupy as cp

    if not cp.cuda.is_available():
        print("# no GPU: nothing to compare")
        return 0
    from cutopo.cpab import _integrate_cupy as icp

    dtype = np.dtype(args.dtype)
    with KernelOptions(icp) as kernels:
        for key in cases:
            case = CASES[key]
            tess, points, theta = case.inputs(cp, 0)
            points, theta = points.astype(dtype), theta.astype(dtype)
            plan = icp.setup(points, theta, tess, T_STEPS, "integrate", dtype)
            S, recompute = icp.checkpoint_segment(T_STEPS, 4)
            S = 4 if recompute else S
            cot = cp.random.default_rng(1).standard_normal((plan.B, plan.N, plan.K)).astype(dtype)
            stages = {
                "forward": lambda: icp.integrate(plan),
                "backward, points and theta": lambda: icp.backward(plan, chk, S, cot, True, True),
                "backward, points only": lambda: icp.backward(plan, chk, S, cot, True, False),
            }
            results, times = {}, {(v, s): [] for v in variants for s in stages}
            for v, flags in variants.items():
                kernels.options = flags
                _, chk, _ = icp.integrate(plan, checkpoint_every=S)
                out = icp.integrate(plan)[0]
                grads = icp.backward(plan, chk, S, cot, True, True)
                results[v] = (out.get(), grads[0].get(), grads[1].get())
            for _ in range(args.rounds):
                for v, flags in variants.items():
                    kernels.options = flags
                    _, chk, _ = icp.integrate(plan, checkpoint_every=S)
                    for s, fn in stages.items():
                        times[(v, s)].append(time_gpu(cp, fn, args.reps))
            print(f"\n## {case.name}, {dtype.name}, checkpoints every {S}")
            print("| stage | variant | ms per round | median ms | / base | points | point cot. | theta cot. |")
            print("|---|---|---|---|---|---|---|---|")
            for s in stages:
                base = float(np.median(times[("base", s)]))
                for v in variants:
                    ts = times[(v, s)]
                    med = float(np.median(ts))
                    diffs = [relative(a, b) for a, b in zip(results[v], results["base"])]
                    print(f"| {s} | {v} | {' '.join(f'{t:.3f}' for t in ts)} | {med:.3f} | "
                          f"{med / base:.3f} | " + " | ".join(f"{d:.1e}" for d in diffs) + " |",
                          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
