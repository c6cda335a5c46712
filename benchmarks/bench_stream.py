"""Out-of-core ECC benchmark: streaming throughput against the host-to-device copy bandwidth, and
the overhead of cutopo.dask against the single-array call on one GPU.

    python benchmarks/bench_stream.py [--quick] [--only NAME] [--reps N] [--json FILE]

Copy bandwidth (measured first, same run): a 1 GiB cudaMemcpyAsync host-to-device from pinned
memory (``cupyx.empty_pinned``) and from pageable memory (a NumPy array), median of --reps.
Streaming rows: ``cutopo.ecc(host_volume, thresholds, device="cuda")`` on a uint8 or float32
volume in host memory (pageable NumPy array, or pinned), default slab size (512 MiB), 256
thresholds; GB/s = input bytes / wall time of the whole call (median of --reps, first call
excluded); "of pinned H2D" = that throughput over the pinned copy bandwidth (target >= 80 %).
Every row checks the result against the in-memory GPU call on the same volume where it fits.
Dask rows: ``cutopo.dask.ecc(darr, t).compute()`` (threaded scheduler) on a CuPy-chunked Dask
array already in GPU memory, against ``cutopo.ecc(cupy_volume, t)`` (both: wall time, device
synchronised, median of --reps); ratio = Dask / single (target <= 1.3x at 1024^3).
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

import cutopo

T = 256


def wall_ms(cp, fn, reps, warmup=1):
    """Median wall milliseconds of ``fn()`` with the device synchronised before and after."""
    for _ in range(warmup):
        fn()
    cp.cuda.Device().synchronize()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        cp.cuda.Device().synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return float(np.median(times))


def h2d_bandwidth(cp, host, reps):
    """GB/s of one cudaMemcpyAsync of ``host`` to a device buffer (median of ``reps``)."""
    dev = cp.empty(host.nbytes, dtype=cp.uint8)
    stream = cp.cuda.Stream(non_blocking=True)

    def copy():
        cp.cuda.runtime.memcpyAsync(dev.data.ptr, host.ctypes.data, host.nbytes,
                                    cp.cuda.runtime.memcpyHostToDevice, stream.ptr)
        stream.synchronize()

    ms = wall_ms(cp, copy, reps)
    return host.nbytes / ms / 1e6


def stream_cases(quick):
    if quick:
        return [("1024^3 uint8", (1024,) * 3, "uint8", "pageable"),
                ("1024^3 uint8 pinned", (1024,) * 3, "uint8", "pinned")]
    return [("1024^3 uint8", (1024,) * 3, "uint8", "pageable"),
            ("1024^3 uint8 pinned", (1024,) * 3, "uint8", "pinned"),
            ("1024^3 float32", (1024,) * 3, "float32", "pageable"),
            ("1024^3 float32 pinned", (1024,) * 3, "float32", "pinned"),
            ("2048^3 uint8", (2048,) * 3, "uint8", "pageable"),
            ("2048^3 uint8 pinned", (2048,) * 3, "uint8", "pinned")]


def dask_cases(quick):
    cases = [("1024^3 float32, chunks 256x1024x1024", (1024,) * 3, "float32", (256, 1024, 1024)),
             ("1024^3 uint8, chunks 256x1024x1024", (1024,) * 3, "uint8", (256, 1024, 1024))]
    if not quick:
        cases += [("1024^3 float32, chunks 512^3", (1024,) * 3, "float32", (512, 512, 512)),
                  ("1024^3 float32, chunks 256^3", (1024,) * 3, "float32", (256, 256, 256)),
                  ("512^3 float32, chunks 128x512x512", (512,) * 3, "float32", (128, 512, 512))]
    return cases


def device_volume(cp, shape, dtype, seed):
    rs = cp.random.default_rng(seed)
    if dtype == "uint8":
        return rs.integers(0, 256, size=shape, dtype=cp.uint8)
    return rs.random(shape, dtype=cp.float32)


def thresholds_for(dtype):
    return np.arange(T, dtype=np.float64) if dtype == "uint8" else np.linspace(0, 1, T).astype(np.float32)


def print_row(cells):
    print("| " + " | ".join(cells) + " |", flush=True)


def main(argv=None):
    lines = __doc__.splitlines()
    p = argparse.ArgumentParser(description=lines[0], epilog="\n".join(lines[3:]),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="1024^3 uint8 streaming and 1024^3 Dask rows only")
    p.add_argument("--only", help="run the rows whose name contains this")
    p.add_argument("--reps", type=int, default=0, help="timed repetitions (default 5, 3 with --quick)")
    p.add_argument("--json", help="also write the rows and targets to this file")
    args = p.parse_args(argv)
    if not cutopo.gpu_available():
        print("# no GPU: nothing to measure")
        return 0
    import cupy as cp
    import cupyx

    reps = args.reps or (3 if args.quick else 5)
    only = (lambda name: args.only in name) if args.only else (lambda name: True)
    dev = cp.cuda.runtime.getDeviceProperties(0)
    name = dev["name"].decode() if isinstance(dev["name"], bytes) else dev["name"]
    pinned_probe = cupyx.empty_pinned(1 << 30, dtype=np.uint8)
    pinned_probe[:] = 1
    pageable_probe = np.ones(1 << 30, dtype=np.uint8)
    bw_pinned = h2d_bandwidth(cp, pinned_probe, reps)
    bw_pageable = h2d_bandwidth(cp, pageable_probe, reps)
    del pinned_probe, pageable_probe
    cp.get_default_memory_pool().free_all_blocks()
    print(f"# GPU: {name}; host-to-device copy bandwidth {bw_pinned:.1f} GB/s pinned, "
          f"{bw_pageable:.1f} GB/s pageable (1 GiB, median of {reps})")
    report = {"device": name, "h2d_pinned_gbs": bw_pinned, "h2d_pageable_gbs": bw_pageable,
              "stream": [], "dask": []}
    targets = []

    print("\n# Streaming from host memory (cutopo.ecc(host, t, device='cuda'), default slabs)")
    header = ("case", "GB", "call ms", "GB/s", "of pinned H2D", "equal")
    print_row(header)
    print("|" + "---|" * len(header))
    for case, shape, dtype, kind in stream_cases(args.quick):
        if not only(case):
            continue
        g = device_volume(cp, shape, dtype, seed=len(case))
        t = thresholds_for(dtype)
        want = cutopo.ecc(g, cp.asarray(t)).get()
        host = cupyx.empty_pinned(shape, dtype=dtype) if kind == "pinned" else np.empty(shape, dtype=dtype)
        g.get(out=host)
        del g
        cp.get_default_memory_pool().free_all_blocks()
        got = cutopo.ecc(host, t, device="cuda")
        ms = wall_ms(cp, lambda: cutopo.ecc(host, t, device="cuda"), reps, warmup=0)
        gbs = host.nbytes / ms / 1e6
        equal = "yes" if np.array_equal(got, want) else "NO"
        print_row((case, f"{host.nbytes / 1e9:.2f}", f"{ms:.1f}", f"{gbs:.1f}", f"{gbs / bw_pinned:.0%}",
                   equal))
        report["stream"].append(dict(case=case, ms=ms, gbs=gbs, fraction=gbs / bw_pinned, equal=equal))
        if shape[0] == 1024 and dtype == "uint8":
            targets.append((f"streaming >= 80% of pinned H2D ({case})", f"{gbs / bw_pinned:.0%}",
                            "MET" if gbs >= 0.8 * bw_pinned else "MISSED"))
        del host
        cp.get_default_memory_pool().free_all_blocks()

    try:
        import dask
        import dask.array as da

        import cutopo.dask as cd
    except ImportError:
        print("\n# dask is not installed: Dask rows skipped (pip install 'cutopo[dask]')")
        da = None
    if da is not None:
        print("\n# Dask overhead on one GPU (CuPy chunks, threaded scheduler)")
        header = ("case", "single ms", "dask ms", "ratio", "tasks", "equal")
        print_row(header)
        print("|" + "---|" * len(header))
        for case, shape, dtype, chunks in dask_cases(args.quick):
            if not only(case):
                continue
            g = device_volume(cp, shape, dtype, seed=3)
            t = thresholds_for(dtype)
            d = da.from_array(g, chunks=chunks, asarray=False)
            lazy = cd.ecc(d, t)
            single = wall_ms(cp, lambda: cutopo.ecc(g, t), reps)
            with dask.config.set(scheduler="threads"):
                dms = wall_ms(cp, lambda: cd.ecc(d, t).compute(), reps)
                got = lazy.compute()
            equal = "yes" if bool(cp.all(got == cutopo.ecc(g, t))) else "NO"
            ntasks = len(lazy.__dask_graph__())
            print_row((case, f"{single:.2f}", f"{dms:.2f}", f"{dms / single:.2f}x", str(ntasks), equal))
            report["dask"].append(dict(case=case, single_ms=single, dask_ms=dms, ratio=dms / single,
                                       tasks=ntasks, equal=equal))
            if shape[0] == 1024 and "256x1024" in case:
                targets.append((f"Dask <= 1.3x single call ({case})", f"{dms / single:.2f}x",
                                "MET" if dms <= 1.3 * single else "MISSED"))
            del g, d, lazy, got
            cp.get_default_memory_pool().free_all_blocks()

    print("\n# Targets")
    print("| target | measured | status |\n|---|---|---|")
    for row in targets:
        print_row(row)
    report["targets"] = [dict(zip(("target", "measured", "status"), row)) for row in targets]
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=1)
        print(f"\n# results written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
