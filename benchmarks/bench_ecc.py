"""Exact ECC benchmark: cutopo's kernel vs a straightforward CuPy version, and the CPU paths.

    python benchmarks/bench_ecc.py [--quick] [--only NAME] [--reps N] [--md FILE]

GPU rows: our time per ``cutopo.ecc`` call (median of CUDA-event timings: the whole call with
NumPy thresholds, Python overhead included), the GPU time (median of CUDA-graph replays of the
call's device work: output memset, histogram kernel, prefix-sum kernel), the baseline's time on
the same run (max of shifted slices + searchsorted + bincount per cell type, CuPy array ops),
the ratio baseline / call, the effective bandwidth of the GPU time (input bytes / time) and its
fraction of the device-to-device copy bandwidth measured in the same run (bytes read + written
/ time). Every row checks that our result equals the baseline's.
CPU rows: the NumPy path vs a loop of skimage.measure.euler_number over the thresholds.
"""
from __future__ import annotations

import argparse
import math
import sys
import time

import numpy as np

import cutopo

T = 256


def gpu_cases(quick):
    sizes2 = [128, 256, 512, 1024, 2048, 4096, 8192]
    sizes3 = [128, 256, 512, 1024]
    if quick:
        sizes2, sizes3 = [1024, 8192], [256, 512]
    cases = []
    for dtype in ("float32", "uint8"):
        cases += [(f"2d {n}^2 {dtype}", (n, n), 2, dtype) for n in sizes2]
        cases.append((f"2d 64x1024^2 {dtype}", (64, 1024, 1024), 2, dtype))
        cases += [(f"3d {n}^3 {dtype}", (n, n, n), 3, dtype) for n in sizes3]
    return cases


def make_image(cp, shape, dtype, seed):
    rs = cp.random.default_rng(seed)
    if dtype == "uint8":
        return rs.integers(0, 256, size=shape, dtype=cp.uint8)
    return rs.random(shape, dtype=cp.float32)


def time_gpu(cp, fn, reps, warmup=2):
    """Median milliseconds of ``fn()`` over ``reps`` CUDA-event-timed runs."""
    for _ in range(warmup):
        fn()
    cp.cuda.Device().synchronize()
    times = []
    for _ in range(reps):
        start, stop = cp.cuda.Event(), cp.cuda.Event()
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, stop))
    return float(np.median(times))


def time_graph_or_none(cp, fn, reps):
    """(median ms of a CUDA-graph replay of ``fn()``, None) or (None, why capture failed).

    An op that synchronises with the host (or launches on another stream) invalidates the
    capture; the capture is then closed so the stream stays usable, and the caller can fall back
    to event timing of whole calls.
    """
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        fn()  # warm: compile, and leave the pool a free block of each size fn allocates
        stream.synchronize()
        error = None
        stream.begin_capture()
        try:
            fn()
        except Exception as exc:
            error = exc
        try:
            graph = stream.end_capture()  # raises when the capture was invalidated
        except Exception as exc:
            error = error or exc
        if error is not None:
            stream.synchronize()
            return None, f"{type(error).__name__}: {str(error).splitlines()[0][:100] if str(error) else ''}"
    return replay_ms(cp, graph, stream, reps), None


def replay_ms(cp, graph, stream, reps):
    """Median milliseconds of one replay of ``graph`` on ``stream`` between two events (after
    one untimed replay)."""
    with stream:
        graph.launch(stream)
        stream.synchronize()
        times = []
        for _ in range(reps):
            start, stop = cp.cuda.Event(), cp.cuda.Event()
            start.record(stream)
            graph.launch(stream)
            stop.record(stream)
            stop.synchronize()
            times.append(cp.cuda.get_elapsed_time(start, stop))
    return float(np.median(times))


def time_graph(cp, fn, reps):
    """Median milliseconds of one replay of a CUDA graph capturing ``fn()`` (no Python overhead)."""
    ms, why = time_graph_or_none(cp, fn, reps)
    if why is not None:
        raise RuntimeError(f"CUDA graph capture failed: {why}")
    return ms


def copy_bandwidth(cp):
    """Device-to-device copy bandwidth in GB/s, counting bytes read plus bytes written."""
    a = cp.random.default_rng(1).random(1 << 28, dtype=cp.float32)  # 1 GiB
    b = cp.empty_like(a)
    ms = time_gpu(cp, lambda: cp.copyto(b, a), 20)
    return 2 * a.nbytes / ms / 1e6


def baseline_ecc(cp, image, thresholds, ndim):
    """Straightforward CuPy ECC (V construction): every cell type's values by max of shifted
    slices, binned with searchsorted, counted with bincount, summed with its sign."""
    batch = image.shape[:-ndim]
    nimg = math.prod(batch)
    x = image.reshape((nimg,) + image.shape[-ndim:])
    nb = thresholds.size + 1
    hist = cp.zeros(nimg * nb, dtype=cp.int64)
    offsets = (cp.arange(nimg, dtype=cp.int64) * nb).reshape((nimg,) + (1,) * ndim)
    import itertools
    for cell in itertools.product((0, 1), repeat=ndim):  # which axes the cell spans
        vals = None
        for corner in itertools.product(*[(0, 1) if s else (0,) for s in cell]):
            sl = (slice(None),) + tuple(slice(c, x.shape[1 + a] - s + c) for a, (c, s) in
                                        enumerate(zip(corner, cell)))
            vals = x[sl] if vals is None else cp.maximum(vals, x[sl])
        bins = cp.searchsorted(thresholds, vals, side="left") + offsets
        counts = cp.bincount(bins.ravel(), minlength=nimg * nb)
        hist += counts if sum(cell) % 2 == 0 else -counts
    return cp.cumsum(hist.reshape(nimg, nb)[:, :-1], axis=1).reshape(batch + (nb - 1,))


def run_gpu(args, out_rows):
    import cupy as cp
    from cutopo import _ecc_cupy

    dev = cp.cuda.runtime.getDeviceProperties(0)
    name = dev["name"].decode() if isinstance(dev["name"], bytes) else dev["name"]
    bw = copy_bandwidth(cp)
    print(f"# GPU: {name}; device-to-device copy bandwidth {bw:.0f} GB/s (read + write)")
    header = ("case", "MB", "call ms", "GPU ms", "baseline ms", "ratio", "GB/s", "of copy BW", "equal")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for name, shape, ndim, dtype in gpu_cases(args.quick):
        if args.only and args.only not in name:
            continue
        image = make_image(cp, shape, dtype, seed=abs(hash(name)) % 2**32)
        # The thresholds ``ecc(image, T)`` would use: float64 for integer images, the image's own dtype else.
        thresholds = cp.asarray(np.linspace(0, 255, T) if dtype == "uint8" else np.linspace(0, 1, T, dtype=np.float32))
        mb = image.nbytes / 1e6
        reps = args.reps or (50 if image.nbytes < 1e9 else 10)
        host_t = thresholds.get()
        ours = time_gpu(cp, lambda: cutopo.ecc(image, host_t, ndim=ndim), reps)
        plan = _ecc_cupy.histogram_plan(image, host_t, ndim, False)
        flat = _ecc_cupy._image_view(image).reshape((-1,) + image.shape[-ndim:])
        kernel = time_graph(cp, lambda: plan(flat), reps)
        result = cutopo.ecc(image, thresholds, ndim=ndim)
        base_ms, equal = float("nan"), "n/a"
        if image.nbytes <= args.baseline_max_mb * 1e6:
            base_ms = time_gpu(cp, lambda: baseline_ecc(cp, image, thresholds, ndim), 3, warmup=1)
            equal = "yes" if bool(cp.all(baseline_ecc(cp, image, thresholds, ndim) == result)) else "NO"
        gbs = image.nbytes / kernel / 1e6
        row = (name, f"{mb:.1f}", f"{ours:.4f}", f"{kernel:.4f}", f"{base_ms:.3f}",
               f"{base_ms / ours:.0f}x" if base_ms == base_ms else "-", f"{gbs:.0f}", f"{gbs / bw:.0%}", equal)
        print("| " + " | ".join(row) + " |", flush=True)
        out_rows.append(row)
        image = flat = plan = result = None  # release this case's arrays before the next one
        cp.get_default_memory_pool().free_all_blocks()


VARIANTS = {
    "full": (),
    "no histogram updates": ("-DCUTOPO_PROFILE_NO_SINK",),
    "tile loads only": ("-DCUTOPO_PROFILE_NO_SINK", "-DCUTOPO_PROFILE_LOAD_ONLY"),
    "registers for 2 blocks/SM": ("-DCUTOPO_ECC_MIN_BLOCKS=2",),
    "registers for 3 blocks/SM": ("-DCUTOPO_ECC_MIN_BLOCKS=3",),
}


def run_variants(args):
    """Stage costs by subtraction: the same kernel with stages compiled out (METHOD.md)."""
    import cupy as cp
    from cutopo import _ecc_cupy

    print("\n# Profiling variants (GPU ms of the histogram plan; stages compiled out)")
    print("| case | " + " | ".join(VARIANTS) + " |")
    print("|---|" + "---|" * len(VARIANTS))
    for name, shape, ndim, dtype in gpu_cases(quick=True):
        if "8192^2" not in name and "512^3" not in name:
            continue
        image = make_image(cp, shape, dtype, seed=7)
        t = np.linspace(0, 255, T) if dtype == "uint8" else np.linspace(0, 1, T, dtype=np.float32)
        flat = _ecc_cupy._image_view(image).reshape((-1,) + image.shape[-ndim:])
        cells = []
        for options in VARIANTS.values():
            _ecc_cupy.PROFILE_OPTIONS = options
            _ecc_cupy.clear_plans()
            plan = _ecc_cupy.histogram_plan(image, t, ndim, False)
            cells.append(f"{time_graph(cp, lambda: plan(flat), 20):.4f}")
        _ecc_cupy.PROFILE_OPTIONS = ()
        _ecc_cupy.clear_plans()
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)


def run_cpu(args, out_rows):
    from skimage.measure import euler_number

    print("\n# CPU (one process): NumPy path vs a loop of skimage.measure.euler_number over thresholds")
    print("| case | ours ms | skimage loop ms | ratio |")
    print("|---|---|---|---|")
    rng = np.random.default_rng()
    for n in ([256, 1024] if not args.quick else [1024]):
        img = rng.random((n, n), dtype=np.float32)
        t = np.linspace(0, 1, T).astype(np.float32)
        t0 = time.perf_counter()
        ours = cutopo.ecc(img, t)
        ours_ms = (time.perf_counter() - t0) * 1e3
        t0 = time.perf_counter()
        ref = np.array([euler_number(img <= v, connectivity=1) for v in t])
        sk_ms = (time.perf_counter() - t0) * 1e3
        assert np.array_equal(ours, ref)
        row = (f"2d {n}^2 float32, {T} thresholds", f"{ours_ms:.1f}", f"{sk_ms:.1f}", f"{sk_ms / ours_ms:.1f}x")
        print("| " + " | ".join(row) + " |", flush=True)
        out_rows.append(row)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--only", help="run the GPU cases whose name contains this")
    p.add_argument("--reps", type=int, default=0)
    p.add_argument("--baseline-max-mb", type=float, default=1100.0)
    p.add_argument("--no-cpu", action="store_true")
    p.add_argument("--variants", action="store_true", help="also time profiling variants")
    args = p.parse_args(argv)
    rows = []
    if cutopo.gpu_available():
        run_gpu(args, rows)
        if args.variants:
            run_variants(args)
    else:
        print("# no GPU: GPU rows skipped")
    if not args.no_cpu and not args.only:
        run_cpu(args, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
