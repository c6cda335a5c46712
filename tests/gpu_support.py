"""Helpers of the GPU test modules (test_*_gpu.py): CuPy on demand, a NaN-poisoned memory pool."""
from __future__ import annotations

import numpy as np


def cupy_module():
    """CuPy, imported when a test runs (the GPU modules are collected without it)."""
    import cupy

    return cupy


def poison_pool(nbytes=64 << 20):
    """Fill and free device memory so that later cupy.empty arrays start out as NaN bits."""
    cp = cupy_module()
    junk = cp.full(nbytes // 8, np.nan)
    del junk
