"""Host/GPU timeline of CPAB forward+VJP calls on bench_cpab.py's cases: when each launch of
``cutopo.cpab._integrate_cupy`` is made on the host and when its kernel ends on the GPU, in us
from a CUDA event recorded just before the call.

    python benchmarks/timeline_cpab.py [--reps N] [--show N]

GPU time that a kernel's "gpu ends" gap exceeds its own duration by is time the GPU waited for
the host: before the first kernel (the call's checks and set-up) and between the set-up kernel
and the forward (twenty-seventh session: ~0.12-0.17 ms of a 2D call's ~1.05-1.1 ms). Compare
trees with ab_trees.sh (the host's speed varies ~2x between device calls). Each launch here
also records an event (a few us). Without a GPU: nothing measured, exit 0.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_cpab import T_STEPS, cases  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=12, help="timed calls per case (after 5 warm-up calls)")
    p.add_argument("--show", type=int, default=3, help="print the timelines of the last N calls")
    args = p.parse_args(argv)
    import cupy as cp

    if not cp.cuda.is_available():
        print("# no GPU: nothing measured")
        return 0
    import cutopo
    from cutopo._cuda.launch import KeptLaunches
    from cutopo.cpab import _integrate_cupy as icp, integrate

    launches = []
    original, original_kept = icp.launch, KeptLaunches.__call__

    def timed(launch_fn):
        def launch(sig, *a, **kw):
            t0 = time.perf_counter()
            launch_fn(sig, *a, **kw)
            t1 = time.perf_counter()
            event = cp.cuda.Event()
            event.record()
            launches.append((sig.name.split("<")[0].rsplit("::", 1)[-1], t0, t1, event))
        return launch

    # a call's kernels go through launch() or, once its kind repeats, its KeptLaunches
    icp.launch = timed(original)
    KeptLaunches.__call__ = lambda kept, sig, *a: timed(original_kept.__get__(kept))(sig, *a)
    try:
        for case in cases(False)[:2]:
            tess, points, theta = case.inputs(cp, 0)
            out = integrate(points, theta, tess, n_steps=T_STEPS)
            cot = cp.random.default_rng(1).standard_normal(out.shape, dtype=cp.float32)

            def call():
                return cutopo.vjp(integrate, points, theta, tess, wrt="theta", n_steps=T_STEPS)[1](cot)

            for _ in range(5):
                call()
            totals = []
            for rep in range(args.reps):
                launches.clear()
                cp.cuda.Device().synchronize()
                start = cp.cuda.Event()
                start.record()
                h0 = time.perf_counter()
                call()
                h1 = time.perf_counter()
                stop = cp.cuda.Event()
                stop.record()
                stop.synchronize()
                totals.append(cp.cuda.get_elapsed_time(start, stop) * 1e3)
                if rep >= args.reps - args.show:
                    print(f"\n{case.name}, call {rep}: {totals[-1]:.0f} us, the call returns at "
                          f"{(h1 - h0) * 1e6:.0f} us (host)")
                    previous = 0.0
                    for name, t0, t1, event in launches:
                        ends = cp.cuda.get_elapsed_time(start, event) * 1e3
                        print(f"  {name:20s} launched {1e6 * (t0 - h0):6.0f} -> {1e6 * (t1 - h0):6.0f} us,"
                              f" gpu ends {ends:6.0f} us (+{ends - previous:5.0f})")
                        previous = ends
            print(f"{case.name}: median {np.median(totals):.0f} us, min {min(totals):.0f} us")
    finally:
        icp.launch, KeptLaunches.__call__ = original, original_kept
    return 0


if __name__ == "__main__":
    sys.exit(main())
