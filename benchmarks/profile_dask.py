"""Where a ``cutopo.dask.ecc`` compute's time goes on one GPU (issue 8's overhead target).

    python benchmarks/profile_dask.py [--dtype float32|uint8 ...] [--reps N] [--profile]

For 1024^3 chunked 256 x 1024 x 1024 (bench_stream.py's Dask case), CuPy chunks, the
synchronous scheduler with side streams:

* the single call: wall ms (device synchronised) and GPU ms (CUDA events);
* ``cutopo.dask.ecc(...).compute()`` with the graph built in the call, the build alone, a
  prebuilt graph's compute, with and without Dask's graph optimisation;
* one compute's timeline (medians): host ms from the call to the first chunk task, to the
  last task's return, to compute()'s return, to the device being idle; and the GPU's span from
  the first chunk task's entry (an event on the current stream) to the end;
* the histogram kernel alone over the whole volume and over the four chunks (one stream, and
  one side stream each), with the chunk geometry at HIST_WAVES_3D = 16 / 8 / 4 / 2;
* with ``--profile``: cProfile of computes, the largest own times.
"""
from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_ecc import make_image, time_gpu  # noqa: E402
from bench_stream import thresholds_for, wall_ms  # noqa: E402


def timeline(cp, cd, lazy, reps):
    """Median (first task, last task end, compute return, idle) host ms and the GPU span of
    ``lazy.compute()`` (whose graph keeps the tracing wrapper afterwards: time a fresh one)."""
    stamps = []
    original = cd._chunk_task

    def traced(*args):
        if not stamps[-1]["first"]:
            stamps[-1]["first"] = time.perf_counter()
            ev = cp.cuda.Event()
            ev.record()
            stamps[-1]["ev"] = ev
        out = original(*args)
        stamps[-1]["last"] = time.perf_counter()
        return out

    rows = []
    cd._chunk_task = traced
    try:
        graph = lazy.__dask_graph__()
        # the graph holds the function object: swap it in the chunk tasks' tuples
        for layer in graph.layers.values():
            mapping = getattr(layer, "mapping", None)
            if mapping is None:
                continue
            for k, v in list(mapping.items()):
                if isinstance(v, tuple) and v and v[0] is original:
                    mapping[k] = (traced,) + v[1:]
        for rep in range(reps + 1):
            cp.cuda.Device().synchronize()
            stamps.append(dict(first=None, last=None, ev=None))
            t0 = time.perf_counter()
            lazy.compute()
            t_ret = time.perf_counter()
            end = cp.cuda.Event()
            end.record()
            cp.cuda.Device().synchronize()
            t_idle = time.perf_counter()
            s = stamps[-1]
            if rep and s["ev"] is not None:
                rows.append(((s["first"] - t0) * 1e3, (s["last"] - t0) * 1e3, (t_ret - t0) * 1e3,
                             (t_idle - t0) * 1e3, cp.cuda.get_elapsed_time(s["ev"], end)))
    finally:
        cd._chunk_task = original
    if not rows:
        return None
    return tuple(float(np.median([r[i] for r in rows])) for i in range(5))


def kernel_rows(cp, g, t, reps):
    """The plain histogram kernel over the whole volume and over its 4 chunks."""
    from cutopo import _ecc_cupy
    from cutopo._checks import check_thresholds

    t, _ = check_thresholds(t, np.empty(0, dtype=g.dtype))
    hist = cp.zeros((1, t.size), dtype=np.int64)
    chunks = [g[i:i + 256] for i in range(0, g.shape[0], 256)]
    streams = [cp.cuda.Stream(non_blocking=True) for _ in chunks]
    out = []
    saved = _ecc_cupy.HIST_WAVES_3D
    try:
        for waves in (16, 8, 4, 2):
            _ecc_cupy.HIST_WAVES_3D = waves
            _ecc_cupy.clear_plans()
            whole = _ecc_cupy.histogram_plan(g, t, 3, False)
            part = _ecc_cupy.histogram_plan(chunks[0], t, 3, False)
            view = _ecc_cupy._image_view(g)
            views = [_ecc_cupy._image_view(c) for c in chunks]

            def one_stream():
                for v in views:
                    part.add(v, hist)

            def side_streams():
                here = cp.cuda.get_current_stream()
                go = here.record()
                for v, s in zip(views, streams):
                    s.wait_event(go)
                    with s:
                        part.add(v, hist)
                    here.wait_event(s.record())

            out.append((waves, time_gpu(cp, lambda: whole.add(view, hist), reps),
                        time_gpu(cp, one_stream, reps), time_gpu(cp, side_streams, reps),
                        _ecc_cupy._histogram_geometry(part.sig, 1, chunks[0].shape, 3, part.shared_mem,
                                                      _ecc_cupy.TILE_X["unsigned short"])))
    finally:
        _ecc_cupy.HIST_WAVES_3D = saved
        _ecc_cupy.clear_plans()
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", nargs="+", default=["float32", "uint8"])
    p.add_argument("--reps", type=int, default=9)
    p.add_argument("--profile", action="store_true")
    args = p.parse_args(argv)

    import cupy as cp
    import dask
    import dask.array as da

    import cutopo
    import cutopo.dask as cd

    print(f"# dask {dask.__version__}, cupy {cp.__version__}, "
          f"{cp.cuda.runtime.getDeviceProperties(0)['name'].decode()}")
    for dtype in args.dtype:
        g = make_image(cp, (1024,) * 3, dtype, seed=3)
        t = thresholds_for(dtype)
        d = da.from_array(g, chunks=(256, 1024, 1024), asarray=False)
        single_wall = wall_ms(cp, lambda: cutopo.ecc(g, t), args.reps)
        single_gpu = time_gpu(cp, lambda: cutopo.ecc(g, t), args.reps)
        full = wall_ms(cp, lambda: cd.ecc(d, t).compute(scheduler="sync"), args.reps)
        build = wall_ms(cp, lambda: cd.ecc(d, t), args.reps)
        with dask.config.set(scheduler="sync"):
            lazy = cd.ecc(d, t)
            prebuilt = wall_ms(cp, lambda: lazy.compute(), args.reps)
            unopt = wall_ms(cp, lambda: dask.compute(lazy, optimize_graph=False), args.reps)
            tl = timeline(cp, cd, cd.ecc(d, t), args.reps)
        print(f"\n## 1024^3 {dtype}, chunks 256 x 1024 x 1024, sync scheduler, "
              f"{cd.SIDE_STREAMS} side streams")
        print(f"single call: wall {single_wall:.3f} ms, GPU {single_gpu:.3f} ms")
        print(f"dask (build + compute) {full:.3f} ms ({full / single_wall:.3f}x); build alone "
              f"{build:.3f}; prebuilt {prebuilt:.3f}; prebuilt, optimize_graph=False {unopt:.3f}")
        if tl:
            print(f"timeline (host ms from compute()): first chunk task {tl[0]:.3f}, last task "
                  f"returns {tl[1]:.3f}, compute returns {tl[2]:.3f}, device idle {tl[3]:.3f}; "
                  f"GPU span from the first task {tl[4]:.3f} ms (single call's GPU "
                  f"{single_gpu:.3f})")
        print("\n| HIST_WAVES_3D | whole volume GPU ms | 4 chunks, one stream | 4 chunks, 4 streams | "
              "chunk geometry |")
        print("|---|---|---|---|---|")
        for waves, whole, one, four, geo in kernel_rows(cp, g, t, args.reps):
            print(f"| {waves} | {whole:.3f} | {one:.3f} | {four:.3f} | {geo} |")
        if args.profile:
            with dask.config.set(scheduler="sync"):
                prof = cProfile.Profile()
                prof.enable()
                for _ in range(20):
                    cd.ecc(d, t).compute()
                prof.disable()
            cp.cuda.Device().synchronize()
            print("\ncProfile of 20 computes (build included), by own time:")
            pstats.Stats(prof).sort_stats("tottime").print_stats(30)
        g = d = lazy = None
        cp.get_default_memory_pool().free_all_blocks()


if __name__ == "__main__":
    main()
