"""Host timeline of one cutopo.vjp(op) + pullback call: when each launch and probed function is reached.

    python benchmarks/host_timeline.py [CASE ...] [--detailed] [--calls N]

For each case (bench_soft's inputs: soft_ecc on a smooth 256^3 volume or 1024^2 image, T = 256;
soft_ect on the 512^2 mask with D = 256, T = 128; expected_euler on the same smooth images as
probabilities; cutopo.ecc alone, no VJP, on the 1024^2 image with 256 host thresholds; and
cutopo.cpab.integrate on bench_cpab.py's two main cases, 2D and 3D, with respect to theta),
runs N calls from an idle GPU (synchronised before each) and prints the median microseconds
from the call's start to every probe: each kernel launch (PreparedLaunch._launch), the
forward's return, the pullback's return and the synchronisation after it. ``--detailed`` also probes the entry (``name>``) and exit (``<name``)
of the functions along the path, array allocations included (a probe costs ~0.3 us, so the
detailed times run later). What lies before the first launch is host time that a per-call
timing pays in full; bench_soft's "call ms" minus "GPU ms" is about that plus the launches'
gaps. (benchmarks/RESULTS.md, forty-second session.)
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import cutopo  # noqa: E402

CASES = ("soft_ecc_3d", "soft_ecc_2d", "soft_ect", "expected_2d", "expected_3d", "ecc_2d", "cpab_2d",
         "cpab_3d")


class Probes:
    """Time marks of one call, and the wrappers that make them."""

    def __init__(self):
        self.marks = []

    def mark(self, name):
        self.marks.append((name, time.perf_counter()))

    def wrap(self, owner, attr, name):
        fn = getattr(owner, attr)

        def probed(*args, **kwargs):
            self.mark(name + ">")
            result = fn(*args, **kwargs)
            self.mark("<" + name)
            return result

        setattr(owner, attr, probed)


def install(probes, cp, detailed):
    from cutopo import _band_cupy, _ecc_cupy, _ect, _expected_euler_cupy, _soft_ecc, _soft_ecc_cupy
    from cutopo._cuda import launch
    from cutopo.cpab import _integrate_cupy

    cpab_integrate = sys.modules["cutopo.cpab.integrate"]  # the attribute is the function

    launch_kernel = launch.PreparedLaunch._launch

    def probed_launch(self, block, *stream):
        probes.mark("launch " + self.sig.name.split("<")[0].split("::")[-1])
        return launch_kernel(self, block, *stream)

    launch.PreparedLaunch._launch = probed_launch
    if not detailed:
        return
    for module, names in ((_soft_ecc, ("_first_device_call",)),
                          (_soft_ecc_cupy, ("soft_ecc_forward", "soft_ecc_backward", "_plan_and_view",
                                            "device_empty")),
                          (_ect, ("_device_arguments", "_soft_forward_device", "_soft_backward_cupy")),
                          (_band_cupy, ("soft_ect_plan", "device_empty")),
                          (_ecc_cupy, ("repeated_ecc", "ecc", "histogram_plan")),
                          (_expected_euler_cupy, ("expected", "gradient", "_plan_of")),
                          (_integrate_cupy, ("checked_plan", "_prepare", "integrate", "backward",
                                             "theta_cotangent", "_ell_product", "launch")),
                          (cpab_integrate, ("check_points_theta", "_points_cotangent"))):
        for name in names:
            if hasattr(module, name):  # (an older tree's functions may differ)
                probes.wrap(module, name, name)
    for cls, names in ((_soft_ecc_cupy.SoftEccPlan, ("launch_forward", "backward")),
                       (_band_cupy.SoftEctPlan, ("arguments", "forward", "backward"))):
        for name in names:
            probes.wrap(cls, name, f"{cls.__name__}.{name}")
    probes.wrap(type(_soft_ecc_cupy.check_word()), "read", "check word read")
    probes.wrap(_band_cupy._ArgumentFlags, "read", "argument flags read")
    if hasattr(launch, "KeptLaunches"):  # (older trees: none)
        probes.wrap(launch.KeptLaunches, "__call__", "kept launch")
    probes.wrap(cp, "zeros", "cupy.zeros")
    probes.wrap(cp, "empty", "cupy.empty")


def inputs(cp, case):
    """(op, positional arguments, keyword arguments, whether the case runs cutopo.vjp)."""
    from bench_soft import SoftEcc, SoftEct

    if case.startswith("cpab"):
        from bench_cpab import T_STEPS, cases

        tess, points, theta = cases(False)[0 if case == "cpab_2d" else 1].inputs(cp, 0)
        return cutopo.cpab.integrate, (points, theta, tess), {"n_steps": T_STEPS, "wrt": "theta"}, True

    if case == "soft_ect":
        args, _ = SoftEct("soft_ect", 512, 256, 128).inputs(cp, 0, seed=0)
        return cutopo.soft_ect, args, {}, True
    shape, ndim = ((256, 256, 256), 3) if case.endswith("_3d") else ((1024, 1024), 2)
    args, _ = SoftEcc("soft_ecc", shape, ndim, 256).inputs(cp, 2.0, 0)
    if case.startswith("expected"):
        return cutopo.expected_euler, args[:1], {"ndim": ndim}, True
    if case == "ecc_2d":
        return cutopo.ecc, (args[0], np.linspace(0, 1, 256, dtype=np.float32)), {"ndim": ndim}, False
    return cutopo.soft_ecc, args, {"ndim": ndim}, True


def timeline(cp, probes, case, calls):
    op, args, kwargs, differentiable = inputs(cp, case)
    g = None
    runs = []
    for rep in range(calls + 10):
        cp.cuda.Device().synchronize()
        probes.marks.clear()
        probes.mark("start")
        if not differentiable:
            op(*args, **kwargs)
            probes.mark("returned")
        else:
            out, pullback = cutopo.vjp(op, *args, **kwargs)
            probes.mark("forward returned")
            if g is None:
                g = cp.ones_like(out)
            pullback(g)
            probes.mark("pullback returned")
        cp.cuda.Device().synchronize()
        probes.mark("synchronized")
        if rep >= 10:  # warm: compiles, plans, pools
            runs.append(list(probes.marks))
    names = [n for n, _ in runs[0]]
    if any([n for n, _ in r] != names for r in runs):
        raise RuntimeError("the calls reached different probes")
    us = np.median(np.array([[(t - r[0][1]) * 1e6 for _, t in r] for r in runs]), axis=0)
    return list(zip(names, us))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("cases", nargs="*", help=f"of {', '.join(CASES)} (default: all)")
    p.add_argument("--detailed", action="store_true", help="also probe the functions along the path")
    p.add_argument("--calls", type=int, default=100)
    args = p.parse_args(argv)
    unknown = set(args.cases) - set(CASES)
    if unknown:
        p.error(f"unknown cases {sorted(unknown)}; choose from {', '.join(CASES)}")
    if not cutopo.gpu_available():
        print("host_timeline: no CUDA device visible to CuPy")
        return 0
    import cupy as cp

    probes = Probes()
    install(probes, cp, args.detailed)
    for case in args.cases or CASES:
        rows = timeline(cp, probes, case, args.calls)
        print(f"## {case}{' (detailed)' if args.detailed else ''}: median us from the call's start")
        print("  ".join(f"{name} {us:.1f}" for name, us in rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
