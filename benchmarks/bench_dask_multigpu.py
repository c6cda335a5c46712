"""Multi-GPU exact ECC: cutopo.dask.ecc on a dask_cuda.LocalCUDACluster, one worker per GPU.

    python benchmarks/bench_dask_multigpu.py [--size 2048] [--planes 128] [--workers 1,2]
                                             [--reps 5] [--json FILE]

The volume (size^3 float32, quantised to 1/64 so that values tie across chunk seams) is made on
the workers, slab by slab (--planes planes a chunk, each slab from its own seed), and kept there:
slab i lives on worker i * n // n_slabs, so consecutive slabs share a GPU and only the n - 1
seams between workers cross the network (two planes each). Rows:

* "single GPU": ``cutopo.ecc(volume, t)`` on one CuPy array in this process (the same slabs
  assembled on GPU 0), wall time with the device synchronised, median of --reps. Its result is
  the reference: every Dask row must equal it exactly.
* "dask, n workers": ``client.compute(cutopo.dask.ecc(darr, t)).result()``, wall time from the
  call to the result on the client (graph construction, scheduling, the seam transfers, the
  tree sum and the result's transfer included), median of --reps after one warm-up (which
  compiles the kernels in each worker).

Columns: GB/s = volume bytes / wall time; "per GPU" = that over the number of GPUs used;
"of single" = per-GPU throughput over the single-GPU call's; "of copy BW" = GB/s over the
device-to-device copy bandwidth of GPU 0 measured in the same run (bytes read + written).
Speed-up = one worker's wall time over n workers'. Needs cupy, dask[array], distributed and
dask-cuda; NVLink multicast stays off (NCCL_NVLS_ENABLE=0 is set for the workers).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

T = 256
SEED = 20261129


def make_slab(i, planes, size, seed=SEED):
    """Slab i of the volume, on the current device: uniform values quantised to k/64."""
    import cupy as cp

    x = cp.random.default_rng(seed * 1000 + i).random((planes, size, size), dtype=cp.float32)
    x *= 64
    cp.floor(x, out=x)
    x *= 1 / 64
    return x


def median_wall_ms(fn, reps, sync):
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        out = fn()
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return float(np.median(times)), out


def single_gpu(cp, cutopo, size, planes, t, reps):
    """(milliseconds, result) of cutopo.ecc on the whole volume on GPU 0."""
    vol = cp.empty((size, size, size), dtype=cp.float32)
    for i in range(size // planes):
        vol[i * planes:(i + 1) * planes] = make_slab(i, planes, size)
    sync = cp.cuda.Device().synchronize
    cutopo.ecc(vol, t)  # warm-up (compile)
    ms, curve = median_wall_ms(lambda: cutopo.ecc(vol, t), reps, sync)
    curve = cp.asnumpy(curve)
    vol = None  # frees the volume before the pool is emptied
    cp.get_default_memory_pool().free_all_blocks()
    return ms, curve


def on_cluster(n, size, planes, t, reps, profile=False):
    """(median ms, warm-up ms, graph-build ms, slabs per worker, result) with n workers."""
    import cupy as cp
    import dask.array as da
    import distributed
    from dask_cuda import LocalCUDACluster

    import cutopo.dask as cd

    n_slabs = size // planes
    with LocalCUDACluster(n_workers=n, CUDA_VISIBLE_DEVICES=",".join(map(str, range(n))),
                          dashboard_address=None, threads_per_worker=1) as cluster, \
            distributed.Client(cluster) as client:
        workers = sorted(client.scheduler_info()["workers"])
        futures = [client.submit(make_slab, i, planes, size, workers=[workers[i * n // n_slabs]],
                                 allow_other_workers=False, pure=False) for i in range(n_slabs)]
        distributed.wait(futures)
        meta = cp.empty((0, 0, 0), dtype=cp.float32)
        darr = da.concatenate([da.from_delayed(f, (planes, size, size), dtype=np.float32, meta=meta)
                               for f in futures], axis=0)
        # Persisted: the chunks' keys are the futures' data (no from_delayed or concatenate tasks
        # in each call's graph, as a user's persisted volume).
        darr = client.persist(darr)
        distributed.wait(darr)
        keys = {f.key for f in distributed.futures_of(darr)}
        placement = [len(set(v) & keys) for v in client.has_what().values()]

        def run():
            return cp.asnumpy(client.compute(cd.ecc(darr, t)).result())

        t0 = time.perf_counter()
        run()
        warm = (time.perf_counter() - t0) * 1e3
        t0 = time.perf_counter()
        for _ in range(reps):
            cd.ecc(darr, t)
        build = (time.perf_counter() - t0) * 1e3 / reps
        ms, curve = median_wall_ms(run, reps, lambda: None)
        if profile:
            print_profile(client, darr, t, n)
        darr = futures = None
    return ms, warm, build, placement, curve


def _noop():
    return 0


def print_profile(client, darr, t, n):
    """Where one call's wall time goes: the scheduler's round trip for a no-op task, the client's
    submission / wait / copy of the result, and each task kind's compute and transfer times
    with its span (first start, last stop) from the task stream, relative to the call."""
    import cupy as cp
    import distributed
    from dask.utils import key_split

    import cutopo.dask as cd

    trips = []
    for _ in range(10):
        t0 = time.perf_counter()
        client.submit(_noop, pure=False).result()
        trips.append((time.perf_counter() - t0) * 1e3)
    print(f"#   [{n}] no-op task round trip: median {np.median(trips):.1f} ms", flush=True)
    with distributed.get_task_stream(client) as stream:
        t0 = time.time()
        future = client.compute(cd.ecc(darr, t))
        t1 = time.time()
        res = future.result()
        t2 = time.time()
        cp.asnumpy(res)
        t3 = time.time()
    print(f"#   [{n}] client: compute() {1e3 * (t1 - t0):.1f} ms, result() {1e3 * (t2 - t1):.1f} ms, "
          f"asnumpy {1e3 * (t3 - t2):.1f} ms", flush=True)
    kinds = {}
    for rec in stream.data:
        k = kinds.setdefault(key_split(rec["key"]), dict(n=0, compute=0.0, transfer=0.0, first=1e9, last=-1e9))
        k["n"] += 1
        for ss in rec["startstops"]:
            dt = (ss["stop"] - ss["start"]) * 1e3
            k["compute" if ss["action"] == "compute" else "transfer"] += dt
            k["first"] = min(k["first"], (ss["start"] - t0) * 1e3)
            k["last"] = max(k["last"], (ss["stop"] - t0) * 1e3)
    for name, k in sorted(kinds.items(), key=lambda kv: kv[1]["first"]):
        print(f"#   [{n}] {name}: {k['n']} tasks, compute {k['compute']:.1f} ms, transfer/other "
              f"{k['transfer']:.1f} ms, span {k['first']:.1f} .. {k['last']:.1f} ms", flush=True)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", type=int, default=2048, help="edge of the cubic volume (default 2048)")
    p.add_argument("--planes", type=int, default=128, help="planes per chunk (default 128)")
    p.add_argument("--workers", default="", help="worker counts, e.g. 1,2 (default: 1 and all GPUs)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--json")
    p.add_argument("--profile", action="store_true",
                   help="also print where one call's time goes (task stream, client, no-op round trip)")
    args = p.parse_args(argv)
    if args.size % args.planes:
        p.error("--planes must divide --size")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

    import cupy as cp

    import cutopo
    from _bench_common import device_and_bandwidth

    n_gpus = cp.cuda.runtime.getDeviceCount()
    counts = [int(c) for c in args.workers.split(",")] if args.workers else sorted({1, n_gpus})
    if max(counts) > n_gpus:
        p.error(f"--workers: this machine has {n_gpus} GPU(s)")
    name, bw = device_and_bandwidth(cp)
    t = np.linspace(0.0, 1.0, T)
    nbytes = args.size ** 3 * 4
    print(f"# {name} x{n_gpus}, D2D copy {bw:.0f} GB/s; volume {args.size}^3 float32 "
          f"({nbytes / 2**30:.0f} GiB) in {args.size // args.planes} slabs of {args.planes} planes; "
          f"{T} thresholds", flush=True)

    single_ms, ref = single_gpu(cp, cutopo, args.size, args.planes, t, args.reps)
    rows = [dict(case="single GPU (cutopo.ecc)", gpus=1, ms=single_ms, equal=True)]
    print(f"# single GPU: {single_ms:.1f} ms", flush=True)
    for n in counts:
        ms, warm, build, placement, curve = on_cluster(n, args.size, args.planes, t, args.reps, args.profile)
        equal = bool(np.array_equal(curve, ref))
        rows.append(dict(case=f"dask, {n} worker(s)", gpus=n, ms=ms, equal=equal, warmup_ms=warm,
                         build_ms=build, slabs_per_worker=placement))
        print(f"# {n} worker(s): {ms:.1f} ms (warm-up {warm:.0f} ms, graph {build:.1f} ms, "
              f"slabs per worker {placement}), equal to single GPU: {equal}", flush=True)

    one = next((r["ms"] for r in rows if r["case"].startswith("dask, 1 ")), None)
    print("\n| case | GPUs | wall ms | GB/s | per GPU GB/s | of single | of copy BW | speed-up vs 1 worker | equal |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        gbs = nbytes / r["ms"] / 1e6
        r.update(gbs=gbs, per_gpu_of_single=(gbs / r["gpus"]) / (nbytes / single_ms / 1e6),
                 speedup=(one / r["ms"]) if one and r["case"].startswith("dask") else None)
        print(f"| {r['case']} | {r['gpus']} | {r['ms']:.1f} | {gbs:.0f} | {gbs / r['gpus']:.0f} | "
              f"{r['per_gpu_of_single']:.2f} | {gbs / bw:.1%} | "
              f"{'-' if r['speedup'] is None else format(r['speedup'], '.2f') + 'x'} | "
              f"{'yes' if r['equal'] else 'NO'} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=name, gpus=n_gpus, copy_gbs=bw, size=args.size, planes=args.planes,
                           thresholds=T, rows=rows), f, indent=1)
    return 0 if all(r["equal"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
