"""The packed launch of cutopo._cuda.launch on a device: every parameter kind arrives intact."""
from __future__ import annotations

import numpy as np
import pytest

from gpu_support import cupy_module as _cp

pytestmark = pytest.mark.gpu

_SOURCE = r'''
extern "C" __global__ void echo(const double* a, int i32, float f32, long long i64, double f64,
                                const int* b, int last, double* out) {
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    out[0] = a[1]; out[1] = (double)i32; out[2] = (double)f32; out[3] = (double)i64;
    out[4] = f64; out[5] = (double)b[2]; out[6] = (double)last; out[7] = (double)gridDim.x;
}'''


def test_parameter_block_launch_delivers_every_kind(rng):
    cp = _cp()
    from cutopo._cuda.launch import ParameterBlock

    kernel = cp.RawKernel(_SOURCE, "echo")
    kinds = ("ptr:float64", "int32", "float32", "int64", "float64", "ptr:int32", "int32",
             "ptr:float64")
    for _ in range(3):
        a = cp.asarray(rng.standard_normal(4))
        b = cp.asarray(rng.integers(-1000, 1000, 5).astype(np.int32))
        out = cp.full(8, np.nan)
        scalars = (np.int32(rng.integers(-2**31, 2**31)), np.float32(rng.standard_normal()),
                   np.int64(rng.integers(-2**62, 2**62)), np.float64(rng.standard_normal()),
                   np.int32(rng.integers(-2**31, 2**31)))
        values = (a,) + scalars[:4] + (b, scalars[4], out)
        block = ParameterBlock(np.zeros(len(kinds), dtype=np.uint64))
        for i, (k, v) in enumerate(zip(kinds, values)):
            block.write(i, k, v)
        grid = int(rng.integers(1, 5))
        cp.cuda.driver.launchKernel(kernel.kernel.ptr, grid, 1, 1, 32, 1, 1, 0,
                                    cp.cuda.get_current_stream().ptr, block.address, 0)
        got = out.get()
        want = [float(a[1]), float(scalars[0]), float(scalars[1]), float(scalars[2]),
                float(scalars[3]), float(b[2]), float(scalars[4]), float(grid)]
        np.testing.assert_array_equal(got, np.array(want))
