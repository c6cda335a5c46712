"""What bounds streaming from pageable host memory: host copies, page-locking, and both at once.

    python benchmarks/probe_host_copy.py [--gib N] [--reps N]

Prints, for a pageable NumPy source of --gib GiB (default 1):
* the rate of copying it into a 128 MiB pinned buffer (``cupyx.empty_pinned``), slab after slab,
  each slab split across 1, 2, 4, 8 and 16 threads (NumPy copies release the GIL), with and
  without a host-to-device copy of another pinned buffer running at the same time on a copy
  stream (the two share the host's memory bandwidth, as in the staged pipeline);
* the rate of page-locking it in place (cudaHostRegister) and of unlocking it
  (cudaHostUnregister) in 32 MiB chunks, on 1, 2 and 4 threads, and the pinned host-to-device
  copy rate for reference.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import os
import time

import numpy as np


def _median(fn, reps):
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def copy_rate(src, dst, threads, pool, reps):
    """GB/s of copying ``src`` (1-D uint8) into ``dst`` slab by slab, each split over threads."""
    slab = dst.size

    def run():
        for s0 in range(0, src.size, slab):
            part = src[s0:s0 + slab]
            cuts = np.linspace(0, part.size, threads + 1).astype(np.int64)
            jobs = [(int(a), int(b)) for a, b in zip(cuts[:-1], cuts[1:])]
            if threads == 1:
                np.copyto(dst[:part.size], part)
            else:
                list(pool.map(lambda j: np.copyto(dst[j[0]:j[1]], part[j[0]:j[1]]), jobs))

    return src.nbytes / _median(run, reps) / 1e9


def chunk_rates(cp, src, chunk, threads, reps):
    """(register GB/s, unregister GB/s) of page-locking ``src`` in chunks on ``threads`` threads."""
    rt = cp.cuda.runtime
    base = src.ctypes.data
    page = os.sysconf("SC_PAGE_SIZE")
    lo = -(-base // page) * page
    ptrs = list(range(lo, base + src.nbytes - chunk, chunk))
    nbytes = len(ptrs) * chunk
    device = cp.cuda.Device()

    def reg(p):
        with device:
            rt.hostRegister(p, chunk, 1)

    def unreg(p):
        with device:
            rt.hostUnregister(p)

    rows = []
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        for _ in range(reps):
            t0 = time.perf_counter()
            list(pool.map(reg, ptrs))
            t1 = time.perf_counter()
            list(pool.map(unreg, ptrs))
            t2 = time.perf_counter()
            rows.append((nbytes / (t1 - t0) / 1e9, nbytes / (t2 - t1) / 1e9))
    return tuple(float(np.median([r[i] for r in rows])) for i in range(2))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gib", type=float, default=1.0)
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args(argv)

    import cupy as cp
    import cupyx

    n = int(args.gib * (1 << 30))
    src = np.random.default_rng(0).integers(0, 255, n, dtype=np.uint8)
    pinned = cupyx.empty_pinned(128 << 20, dtype=np.uint8)
    pageable = np.empty(128 << 20, dtype=np.uint8)
    other = cupyx.empty_pinned(256 << 20, dtype=np.uint8)
    dev = cp.empty(other.size, dtype=cp.uint8)
    stream = cp.cuda.Stream(non_blocking=True)
    print(f"cpus {os.cpu_count()}, affinity {len(os.sched_getaffinity(0))}, source {args.gib} GiB")

    def h2d_once():
        cp.cuda.runtime.memcpyAsync(dev.data.ptr, other.ctypes.data, other.nbytes,
                                    cp.cuda.runtime.memcpyHostToDevice, stream.ptr)
        stream.synchronize()

    h2d_once()
    print(f"pinned H2D alone: {other.nbytes / _median(h2d_once, args.reps) / 1e9:.1f} GB/s")

    print("| threads | into pinned GB/s | into pageable GB/s | into pinned, H2D running GB/s |")
    print("|---|---|---|---|")
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        for threads in (1, 2, 4, 8, 16):
            a = copy_rate(src, pinned, threads, pool, args.reps)
            b = copy_rate(src, pageable, threads, pool, args.reps)
            # Back-to-back H2D copies in a thread while the host copies run.
            stop = [False]
            count = [0]

            def h2d_loop():
                while not stop[0]:
                    h2d_once()
                    count[0] += 1

            with concurrent.futures.ThreadPoolExecutor(1) as side:
                fut = side.submit(h2d_loop)
                time.sleep(0.05)
                t0 = time.perf_counter()
                c0 = count[0]
                c = copy_rate(src, pinned, threads, pool, args.reps)
                t1 = time.perf_counter()
                c1 = count[0]
                stop[0] = True
                fut.result()
            h2d = (c1 - c0) * other.nbytes / (t1 - t0) / 1e9
            print(f"| {threads} | {a:.1f} | {b:.1f} | {c:.1f} (H2D meanwhile {h2d:.1f}) |")

    print("| threads | register GB/s (32 MiB chunks) | unregister GB/s |")
    print("|---|---|---|")
    for threads in (1, 2, 4):
        r, u = chunk_rates(cp, src, 32 << 20, threads, args.reps)
        print(f"| {threads} | {r:.1f} | {u:.1f} |")
    for chunk_mib in (8, 128):
        r, u = chunk_rates(cp, src, chunk_mib << 20, 1, args.reps)
        print(f"| 1 ({chunk_mib} MiB chunks) | {r:.1f} | {u:.1f} |")


if __name__ == "__main__":
    main()
