"""Probe: the 3D soft ECC's first launch after different waits (device machine).

    python3 benchmarks/wip/cold_probe.py [--calls N]

bench_soft's per-call timing waits for each call's end (an event's synchronize) before the
next; the next call's host time before its first launch (~12-18 us on the device machines'
hosts) is ~3x the same path's in a hot loop on the build machine (~5 us), though each step
times alike on both hosts in a loop (benchmarks/wip/host_parts.py). This times cutopo.vjp(soft_ecc)
+ pullback on bench_soft's 256^3 volume from the call's start to its first launch, after: the
device synchronised (as host_timeline.py), then also 300 us of a Python loop (a hot
interpreter), or 300 us asleep. Median of N calls each, modes interleaved.
"""
import argparse
import sys
import os
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import cupy as cp  # noqa: E402

import cutopo  # noqa: E402
from cutopo._cuda import launch  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--calls", type=int, default=300)
    args = p.parse_args()
    from bench_soft import SoftEcc

    (image, t, scale), _ = SoftEcc("soft_ecc", (256, 256, 256), 3, 256).inputs(cp, 2.0, 0)
    marks = []
    real = launch.PreparedLaunch._launch

    def probed(self, block, *stream):
        marks.append(time.perf_counter())
        return real(self, block, *stream)

    launch.PreparedLaunch._launch = probed
    out, pb = cutopo.vjp(cutopo.soft_ecc, image, t, scale, ndim=3)
    g = cp.ones_like(out)
    modes = ("sync", "sync+spin", "sync+sleep")
    rows = {m: [] for m in modes}
    for k in range(args.calls + 10):
        for mode in modes:
            cp.cuda.Device().synchronize()
            if mode == "sync+spin":
                end = time.perf_counter() + 3e-4
                while time.perf_counter() < end:
                    pass
            elif mode == "sync+sleep":
                time.sleep(3e-4)
            marks.clear()
            t0 = time.perf_counter()
            _, pb = cutopo.vjp(cutopo.soft_ecc, image, t, scale, ndim=3)
            pb(g)
            if k >= 10:
                rows[mode].append((marks[0] - t0) * 1e6)
    cp.cuda.Device().synchronize()
    print("first launch, median us: " + ", ".join(f"{m} {np.median(v):.1f}" for m, v in rows.items()))


if __name__ == "__main__":
    main()
