"""Helpers of the GPU test modules (test_*_gpu.py): CuPy on demand, a NaN-poisoned memory pool."""
from __future__ import annotations

import gc

import numpy as np


def cupy_module():
    """CuPy, imported when a test runs (the GPU modules are collected without it)."""
    import cupy

    return cupy


def poison_pool(nbytes=64 << 20):
    """Fill and free device memory so that later cupy.empty arrays start out as NaN bits; the
    arrays that an op made ahead for its next call (cutopo._cuda.workspace.made_ahead) are let go
    first, so that the next call makes its own from the poisoned memory."""
    from cutopo._cuda.workspace import made_ahead

    made_ahead.drop()
    cp = cupy_module()
    junk = cp.full(nbytes // 8, np.nan)
    del junk


def busy(cp, stream, ms=50.0):
    """Queue about ``ms`` of one spinning thread on ``stream``: a backlog that later work on
    that stream waits for."""
    spin = cp.RawKernel(r'''extern "C" __global__ void spin(long long cycles) {
        const long long t0 = clock64(); while (clock64() - t0 < cycles) {} }''', "spin")
    rate = cp.cuda.Device().attributes["ClockRate"]  # kHz
    with stream:
        spin((1,), (1,), (np.int64(rate * ms),))


def begin_capture(stream):
    """``stream.begin_capture()`` after a garbage collection: an object of an earlier test
    freed during the capture (pinned host memory, a stream) makes a CUDA call that conflicts
    with it (cudaFreeHost synchronises the device) and invalidates the capture, a failure of
    whichever test happens to capture then (as PyTorch's graph capture collects first)."""
    gc.collect()
    stream.begin_capture()
