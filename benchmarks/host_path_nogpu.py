"""Host time of a repeated cutopo.vjp(soft_ecc) call, on a machine without a GPU.

    python benchmarks/host_path_nogpu.py [2d|3d] [--calls N] [--profile]

What a per-call timing pays beyond the GPU time is mostly host time before the first launch
(and in 2D before the pullback's), cutopo's Python and CuPy's host-side objects. This runs that
path with the CUDA calls that need a device stood in: CuPy arrays over host memory that is
never touched (a CuPy allocator handing out one NumPy arena), the current device and stream,
the kernel launches (no-ops), the compiled kernels, the device's size and the thresholds'
check word. It prints the median microseconds from the call's start to its first launch, to
the forward's return, to the pullback's return, and from the pullback's start to its first
launch, for bench_soft's shapes (T = 256); ``--profile`` adds cProfile's top functions.

The build machine's host is not the device machine's (and is noisy: compare trees in
alternating processes, several rounds, and take the minimum); a change it shows must still be
measured on the device (host_timeline.py, bench_soft.py). Nothing here checks results.
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import time
import types

import numpy as np


def stand_in_device():
    """Replace what needs a GPU; returns ``make(shape, dtype)`` for CuPy arrays."""
    import cupy
    from cupy.cuda.memory import MemoryPointer, UnownedMemory

    arena = np.empty(1 << 31, np.uint8)  # never written: every array aliases it
    base = (arena.ctypes.data + 255) // 256 * 256
    cupy.cuda.set_allocator(lambda size: MemoryPointer(UnownedMemory(base, size, arena, device_id=0), 0))
    cupy.cuda.runtime.getDevice = lambda: 0
    stream = types.SimpleNamespace(ptr=0, synchronize=lambda: None)
    cupy.cuda.get_current_stream = lambda: stream
    cupy.cuda.driver.launchKernel = lambda *args: None
    cupy.zeros = lambda shape, dtype=float, order="C": cupy.ndarray(shape, dtype)

    from cutopo import _ecc_cupy, _soft_ecc_cupy
    from cutopo._cuda import launch
    from cutopo._cuda.deferred import PinnedWord

    kernel = types.SimpleNamespace(kernel=types.SimpleNamespace(ptr=1))
    launch._checked_kernel = lambda *args, **kwargs: kernel
    _ecc_cupy.resident_blocks = lambda sig, block, shared_mem=0, options=(): 132 * 4  # an H100's

    class Word(PinnedWord):  # the thresholds' check word, always passed
        def __init__(self):
            self.device_ptr = 0

        def arm(self, stream=None):
            return 1

        def read(self):
            return 0

    word = Word()
    _soft_ecc_cupy.check_word = lambda: word
    return lambda shape, dtype: cupy.ndarray(shape, dtype)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("case", nargs="?", default="3d", choices=("2d", "3d"))
    p.add_argument("--calls", type=int, default=20000)
    p.add_argument("--profile", action="store_true")
    args = p.parse_args(argv)
    make = stand_in_device()
    import cutopo
    from cutopo._cuda import launch

    shape = (256, 256, 256) if args.case == "3d" else (1024, 1024)
    image, t = make(shape, np.float32), make((256,), np.float32)
    out, pullback = cutopo.vjp(cutopo.soft_ecc, image, t, 40.0, ndim=len(shape))
    g = make(out.shape, out.dtype)
    pullback(g)  # plans, prepared launches, the arrays made ahead

    def call():
        _, pb = cutopo.vjp(cutopo.soft_ecc, image, t, 40.0, ndim=len(shape))
        pb(g)

    marks = []
    launch_kernel = launch.PreparedLaunch._launch

    def probed(self, block, *stream):
        marks.append(time.perf_counter())
        return launch_kernel(self, block, *stream)

    launch.PreparedLaunch._launch = probed
    rows = []
    for _ in range(args.calls):
        marks.clear()
        t0 = time.perf_counter()
        _, pb = cutopo.vjp(cutopo.soft_ecc, image, t, 40.0, ndim=len(shape))
        t1 = time.perf_counter()
        pb(g)
        t2 = time.perf_counter()
        rows.append((marks[0] - t0, t1 - t0, t2 - t0, next(m for m in marks if m > t1) - t1))
    launch.PreparedLaunch._launch = launch_kernel
    us = np.median(np.array(rows), axis=0) * 1e6
    print(f"soft_ecc {args.case}: first launch {us[0]:.2f} us, forward {us[1]:.2f}, forward+pullback "
          f"{us[2]:.2f}, pullback to its first launch {us[3]:.2f} ({len(marks)} launches a call)")
    if args.profile:
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(args.calls):
            call()
        profile.disable()
        pstats.Stats(profile).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
