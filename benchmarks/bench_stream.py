"""Out-of-core ECC benchmark: streaming throughput against the host-to-device copy bandwidth, and
the overhead of cutopo.dask against the single-array call on one GPU.

    python benchmarks/bench_stream.py [--quick] [--only NAME] [--reps N] [--json FILE]

Copy bandwidth (measured first, same run): a 1 GiB cudaMemcpyAsync host-to-device from pinned
memory (``cupyx.empty_pinned``) and from pageable memory (a NumPy array), median of --reps; and
what page-locking that pageable GiB in place costs (cudaHostRegister, then the copy, then
cudaHostUnregister), which bounds the registered streaming rows; and the rate of the host copy
that staging a pageable source needs (into pinned memory, on cutopo's READ_THREADS threads).
Streaming rows: ``cutopo.ecc(host_volume, thresholds, device="cuda")`` on a uint8 or float32
volume in host memory (pageable NumPy array, or pinned), default slab size (128 MiB), 256
thresholds; GB/s = input bytes / wall time of the whole call (median of --reps, first call
excluded); "of pinned H2D" = that throughput over the pinned copy bandwidth (target >= 80 %);
"of host copy" (staged rows) = over the host copy rate above, the most that staging can reach.
A pageable volume is staged through the pinned buffers (the default); the "registered" rows
page-lock it in place chunk by chunk instead (the opt-in cutopo._stream.HOST_REGISTER) and copy
its registered slabs directly; "direct/staged" counts the slabs of the last call.
The "periodic" rows stream the torus (``boundary="periodic"``: halo planes modulo n0, each slab
padded on the device; pageable sources are staged) and check it against the in-memory CuPy
torus.
Every row checks the result against the in-memory GPU call on the same volume where it fits.
Dask rows: ``cutopo.dask.ecc(darr, t).compute(scheduler=...)`` on a CuPy-chunked Dask array
already in GPU memory, against ``cutopo.ecc(cupy_volume, t)`` (both: wall time, device
synchronised, median of --reps, graph construction included); ratio = Dask / single (target
<= 1.3x at 1024^3, judged on the synchronous scheduler with side streams, which the README
recommends for CuPy chunks on one GPU); "of copy BW": the volume's bytes over the compute's
time, against the device-to-device copy bandwidth measured in the same run (bytes read plus
written); "side streams": cutopo.dask.SIDE_STREAMS (0: every task
on the current stream); "prebuilt ms": computing a lazy result built once; "build ms":
constructing the lazy graph alone. The "masked" rows count the chunk interiors with the masked
kernel instead of the plain one (cutopo.dask.INTERIOR), and the kernel rows time one masked
launch over the whole volume (all-ones masks) against the plain single call: the per-pixel cost
of the mask test.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import sys
import time

import numpy as np

import cutopo
from cutopo import _stream

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_ecc import copy_bandwidth, make_image  # noqa: E402  (the ECC benchmark's volumes)
from probe_host_copy import copy_rate  # noqa: E402

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
                ("1024^3 uint8 registered", (1024,) * 3, "uint8", "registered"),
                ("1024^3 uint8 pinned", (1024,) * 3, "uint8", "pinned"),
                ("1024^3 uint8 periodic", (1024,) * 3, "uint8", "periodic"),
                ("1024^3 uint8 pinned periodic", (1024,) * 3, "uint8", "pinned periodic")]
    return [("1024^3 uint8", (1024,) * 3, "uint8", "pageable"),
            ("1024^3 uint8 registered", (1024,) * 3, "uint8", "registered"),
            ("1024^3 uint8 pinned", (1024,) * 3, "uint8", "pinned"),
            ("1024^3 uint8 periodic", (1024,) * 3, "uint8", "periodic"),
            ("1024^3 uint8 pinned periodic", (1024,) * 3, "uint8", "pinned periodic"),
            ("1024^3 float32", (1024,) * 3, "float32", "pageable"),
            ("1024^3 float32 registered", (1024,) * 3, "float32", "registered"),
            ("1024^3 float32 pinned", (1024,) * 3, "float32", "pinned"),
            ("2048^3 uint8", (2048,) * 3, "uint8", "pageable"),
            ("2048^3 uint8 registered", (2048,) * 3, "uint8", "registered"),
            ("2048^3 uint8 pinned", (2048,) * 3, "uint8", "pinned")]


def dask_cases(quick):
    cases = [("1024^3 float32, chunks 256x1024x1024", (1024,) * 3, "float32", (256, 1024, 1024)),
             ("1024^3 uint8, chunks 256x1024x1024", (1024,) * 3, "uint8", (256, 1024, 1024))]
    if not quick:
        cases += [("1024^3 float32, chunks 512^3", (1024,) * 3, "float32", (512, 512, 512)),
                  ("1024^3 float32, chunks 256^3", (1024,) * 3, "float32", (256, 256, 256)),
                  ("512^3 float32, chunks 128x512x512", (512,) * 3, "float32", (128, 512, 512))]
    return cases


def register_cost(cp, host, reps):
    """(register ms, copy ms, unregister ms) of page-locking ``host`` in place (median)."""
    dev = cp.empty(host.nbytes, dtype=cp.uint8)
    stream = cp.cuda.Stream(non_blocking=True)
    rows = []
    for _ in range(reps):
        t0 = time.perf_counter()
        cp.cuda.runtime.hostRegister(host.ctypes.data, host.nbytes, 1)
        t1 = time.perf_counter()
        cp.cuda.runtime.memcpyAsync(dev.data.ptr, host.ctypes.data, host.nbytes,
                                    cp.cuda.runtime.memcpyHostToDevice, stream.ptr)
        stream.synchronize()
        t2 = time.perf_counter()
        cp.cuda.runtime.hostUnregister(host.ctypes.data)
        t3 = time.perf_counter()
        rows.append(((t1 - t0) * 1e3, (t2 - t1) * 1e3, (t3 - t2) * 1e3))
    return tuple(float(np.median([r[i] for r in rows])) for i in range(3))


def masked_kernel_ms(cp, g, t, reps):
    """One ecc_histogram_masked launch over the whole volume, all-ones masks (device ms)."""
    from cutopo import _ecc_cupy
    from cutopo._checks import check_thresholds

    t, _ = check_thresholds(t, np.empty(0, dtype=g.dtype))  # as cutopo.ecc compares
    hist = cp.zeros((1, t.size), dtype=np.int64)
    own = [cp.ones(n, dtype=cp.uint8) for n in g.shape]
    return wall_ms(cp, lambda: _ecc_cupy.masked_histogram(g, t, 3, False, own, hist), reps)


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
    report = {"device": name, "stream": [], "dask": []}
    # The host-copy probes only serve the streaming rows: skipped when none is selected (they
    # take ~10 s and pin and register GiBs of host memory).
    if any(only(case) for case, *_ in stream_cases(args.quick)):
        pinned_probe = cupyx.empty_pinned(1 << 30, dtype=np.uint8)
        pinned_probe[:] = 1
        pageable_probe = np.ones(1 << 30, dtype=np.uint8)
        bw_pinned = h2d_bandwidth(cp, pinned_probe, reps)
        bw_pageable = h2d_bandwidth(cp, pageable_probe, reps)
        reg_ms, reg_copy_ms, unreg_ms = register_cost(cp, pageable_probe, reps)
        # What staging a pageable source can reach: the pageable -> pinned copy on cutopo's threads.
        with concurrent.futures.ThreadPoolExecutor(_stream.READ_THREADS) as pool:
            bw_host = copy_rate(pageable_probe, pinned_probe[:128 << 20], _stream.READ_THREADS, pool,
                                reps)
        del pinned_probe, pageable_probe
        cp.get_default_memory_pool().free_all_blocks()
        print(f"# GPU: {name}; host-to-device copy bandwidth {bw_pinned:.1f} GB/s pinned, "
              f"{bw_pageable:.1f} GB/s pageable (1 GiB, median of {reps})")
        print(f"# page-locking 1 GiB of pageable memory in place: cudaHostRegister {reg_ms:.1f} ms "
              f"({1.074 / reg_ms * 1e3:.0f} GB/s), copy {reg_copy_ms:.1f} ms "
              f"({1.074 / reg_copy_ms * 1e3:.1f} GB/s), cudaHostUnregister {unreg_ms:.1f} ms")
        print(f"# host copy of 1 GiB pageable -> pinned on {_stream.READ_THREADS} threads (what "
              f"staging can reach): {bw_host:.1f} GB/s")
        report.update(h2d_pinned_gbs=bw_pinned, h2d_pageable_gbs=bw_pageable,
                      host_register_ms=reg_ms, host_registered_copy_ms=reg_copy_ms,
                      host_unregister_ms=unreg_ms, host_copy_gbs=bw_host)
    else:
        print(f"# GPU: {name}; no streaming row selected: host-copy probes skipped")
    targets = []

    print("\n# Streaming from host memory (cutopo.ecc(host, t, device='cuda'), default slabs)")
    header = ("case", "GB", "call ms", "GB/s", "of pinned H2D", "of host copy", "direct/staged",
              "equal")
    print_row(header)
    print("|" + "---|" * len(header))
    for case, shape, dtype, kind in stream_cases(args.quick):
        if not only(case):
            continue
        g = make_image(cp, shape, dtype, seed=len(case))
        t = thresholds_for(dtype)
        boundary = "periodic" if kind.endswith("periodic") else "box"
        want = cutopo.ecc(g, cp.asarray(t), boundary=boundary).get()
        pinned = kind.startswith("pinned")
        host = cupyx.empty_pinned(shape, dtype=dtype) if pinned else np.empty(shape, dtype=dtype)
        g.get(out=host)
        del g
        cp.get_default_memory_pool().free_all_blocks()
        default_register = _stream.HOST_REGISTER
        _stream.HOST_REGISTER = kind == "registered"
        try:
            got = cutopo.ecc(host, t, device="cuda", boundary=boundary)
            ms = wall_ms(cp, lambda h=host: cutopo.ecc(h, t, device="cuda", boundary=boundary), reps,
                         warmup=0)
        finally:
            _stream.HOST_REGISTER = default_register
        last = dict(_stream.last_pipeline)
        gbs = host.nbytes / ms / 1e6
        equal = "yes" if np.array_equal(got, want) else "NO"
        staged_rows = last.get("staged", 0) > 0
        print_row((case, f"{host.nbytes / 1e9:.2f}", f"{ms:.1f}", f"{gbs:.1f}", f"{gbs / bw_pinned:.0%}",
                   f"{gbs / bw_host:.0%}" if staged_rows else "-",
                   f"{last.get('direct')}/{last.get('staged')}", equal))
        report["stream"].append(dict(case=case, ms=ms, gbs=gbs, fraction=gbs / bw_pinned, equal=equal,
                                     pipeline=last))
        if shape[0] == 1024 and dtype == "uint8" and kind in ("pageable", "pinned"):
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
        bw_copy = copy_bandwidth(cp)  # device-to-device, bytes read plus written
        cp.get_default_memory_pool().free_all_blocks()
        report["d2d_copy_gbs"] = bw_copy
        print(f"\n# Dask overhead on one GPU (CuPy chunks); device-to-device copy bandwidth "
              f"{bw_copy:.0f} GB/s")
        header = ("case", "interiors", "scheduler", "side streams", "single ms", "dask ms", "ratio",
                  "of copy BW", "prebuilt ms", "build ms", "tasks", "equal")
        print_row(header)
        print("|" + "---|" * len(header))
        kernel_rows = []
        variants = [("plain", "sync", cd.SIDE_STREAMS), ("plain", "sync", 0),
                    ("plain", "threads", cd.SIDE_STREAMS), ("plain", "threads", 0),
                    ("masked", "sync", cd.SIDE_STREAMS)]
        for case, shape, dtype, chunks in dask_cases(args.quick):
            if not only(case):
                continue
            g = make_image(cp, shape, dtype, seed=3)
            t = thresholds_for(dtype)
            d = da.from_array(g, chunks=chunks, asarray=False)
            single = wall_ms(cp, lambda: cutopo.ecc(g, t), reps)
            want = cutopo.ecc(g, t)
            streams = cd.SIDE_STREAMS
            for interior, scheduler, side in variants:
                cd.INTERIOR["cupy"], cd.SIDE_STREAMS = interior, side
                try:
                    lazy = cd.ecc(d, t)
                    with dask.config.set(scheduler=scheduler):
                        dms = wall_ms(cp, lambda: cd.ecc(d, t).compute(), reps)
                        prebuilt = wall_ms(cp, lambda: lazy.compute(), reps)
                        got = lazy.compute()
                    build = wall_ms(cp, lambda: cd.ecc(d, t), reps)
                finally:
                    cd.INTERIOR["cupy"], cd.SIDE_STREAMS = "plain", streams
                equal = "yes" if bool(cp.all(got == want)) else "NO"
                ntasks = len(lazy.__dask_graph__())
                of_bw = g.nbytes / (dms * 1e6) / bw_copy  # the volume read once per compute
                print_row((case, interior, scheduler, str(side), f"{single:.2f}", f"{dms:.2f}",
                           f"{dms / single:.2f}x", f"{of_bw:.1%}", f"{prebuilt:.2f}",
                           f"{build:.2f}", str(ntasks), equal))
                report["dask"].append(dict(case=case, interiors=interior, scheduler=scheduler,
                                           side_streams=side, single_ms=single, dask_ms=dms,
                                           ratio=dms / single, of_copy_bw=of_bw,
                                           prebuilt_ms=prebuilt, build_ms=build, tasks=ntasks,
                                           equal=equal))
                if (shape[0] == 1024 and "256x1024" in case and interior == "plain"
                        and scheduler == "sync" and side == streams):
                    targets.append((f"Dask <= 1.3x single call ({case}, sync, side streams)",
                                    f"{dms / single:.2f}x",
                                    "MET" if dms <= 1.3 * single else "MISSED"))
            if dtype == "uint8" or "256x1024" in case:
                kernel_rows.append((case.split(",")[0], single, masked_kernel_ms(cp, g, t, reps)))
            del g, d, lazy, got, want
            cp.get_default_memory_pool().free_all_blocks()
        print("\n# The mask test's cost: one masked launch over the whole volume vs the single call")
        print_row(("volume", "single ms", "masked kernel ms", "ratio"))
        print("|---|---|---|---|")
        seen = set()
        for vol, single, masked in kernel_rows:
            if vol not in seen:
                seen.add(vol)
                print_row((vol, f"{single:.2f}", f"{masked:.2f}", f"{masked / single:.2f}x"))
                report.setdefault("masked_kernel", []).append(dict(volume=vol, single_ms=single,
                                                                   masked_ms=masked))

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
