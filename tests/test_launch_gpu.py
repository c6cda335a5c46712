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


def test_launch_prepares_repeated_launches(rng, monkeypatch):
    """launch() runs a kernel the plain way the first time, prepares it the second (same
    geometry and scalars) and reuses that launch after: every call delivers its own arrays and
    scalars, a new scalar value (or -0.0 after 0.0) makes a launch of its own, and a bad scalar
    raises the same LaunchError on every path."""
    cp = _cp()
    from cutopo._cuda import launch as launch_mod

    kernel = cp.RawKernel(_SOURCE, "echo")
    monkeypatch.setattr(launch_mod, "_kernel", lambda device, sig, options: kernel)
    monkeypatch.setattr(launch_mod, "_PREPARED", {})
    monkeypatch.setattr(launch_mod, "_SEEN", {})
    sig = launch_mod.Signature("test", "echo", ("ptr:float64", "int32", "float32", "int64", "float64",
                                                "ptr:int32", "int32", "ptr:float64"))
    scalars = [(int(rng.integers(-2**31, 2**31)), float(rng.standard_normal()),
                int(rng.integers(-2**62, 2**62)), float(rng.standard_normal()), 3)]
    scalars.append(scalars[0][:3] + (0.0,) + scalars[0][4:])
    scalars.append(scalars[0][:3] + (-0.0,) + scalars[0][4:])
    calls = [scalars[0]] * 4 + [scalars[1]] * 3 + [scalars[2]] * 3 + [scalars[0]]
    for n, (i32, f32, i64, f64, last) in enumerate(calls):
        a = cp.asarray(rng.standard_normal(4))
        b = cp.asarray(rng.integers(-1000, 1000, 5).astype(np.int32))
        out = cp.full(8, np.nan)
        launch_mod.launch(sig, 2, 32, (a, i32, f32, i64, f64, b, last, out))
        got = out.get()
        want = [float(a[1]), i32, float(np.float32(f32)), i64, f64, float(b[2]), last, 2.0]
        np.testing.assert_array_equal(got, np.array(want), err_msg=f"call {n}")
        assert np.signbit(got[4]) == np.signbit(f64), f"call {n}"
    assert len(launch_mod._PREPARED) == 3
    for _ in range(3):
        with pytest.raises(launch_mod.LaunchError, match="argument 6 = 4294967296 overflows int32"):
            launch_mod.launch(sig, 2, 32, (a, 1, 0.5, 2, 0.5, b, 2**32, out))
        with pytest.raises(launch_mod.LaunchError, match="argument 0 has dtype float32"):
            launch_mod.launch(sig, 2, 32, (a.astype(np.float32), *calls[0][:4], b, 3, out))


def test_kept_launches_check_each_kind_once(rng, monkeypatch):
    """KeptLaunches checks every argument at the first launch of a kind (signature, geometry,
    scalars) and writes later calls' arrays unchecked: every call delivers its own arrays and
    scalars, a new scalar value or grid makes a kind of its own (checked again: a bad array
    raises there), a bad scalar raises on every call, and past CAPACITY kinds the checked
    launch() runs."""
    cp = _cp()
    from cutopo._cuda import launch as launch_mod

    kernel = cp.RawKernel(_SOURCE, "echo")
    monkeypatch.setattr(launch_mod, "_kernel", lambda device, sig, options: kernel)
    monkeypatch.setattr(launch_mod, "_PREPARED", {})
    monkeypatch.setattr(launch_mod, "_SEEN", {})
    checked = []
    real_check = launch_mod._check_array

    def counting_check(value, *args, **kwargs):
        checked.append(value)
        return real_check(value, *args, **kwargs)

    monkeypatch.setattr(launch_mod, "_check_array", counting_check)
    sig = launch_mod.Signature("test", "echo", ("ptr:float64", "int32", "float32", "int64", "float64",
                                                "ptr:int32", "int32", "ptr:float64"))
    kept = launch_mod.KeptLaunches()
    assert kept.device == cp.cuda.Device().id

    def call(i32, f64, grid=2):
        a = cp.asarray(rng.standard_normal(4))
        b = cp.asarray(rng.integers(-1000, 1000, 5).astype(np.int32))
        out = cp.full(8, np.nan)
        kept(sig, grid, 32, (a, i32, 0.25, 7, f64, b, 3, out))
        want = [float(a[1]), i32, 0.25, 7.0, f64, float(b[2]), 3.0, float(grid)]
        np.testing.assert_array_equal(out.get(), np.array(want))

    for n in range(4):
        checked.clear()
        call(5, 1.5)
        assert len(checked) == (3 if n == 0 else 0), n   # a, b and out, at the first call alone
    for i32, f64, grid in ((6, 1.5, 2), (5, -2.0, 2), (5, 1.5, 3)):
        checked.clear()
        call(i32, f64, grid)
        assert len(checked) == 3
        call(i32, f64, grid)
        assert len(checked) == 3
    a, b, out = cp.zeros(4), cp.zeros(5, dtype=np.int32), cp.zeros(8)
    with pytest.raises(launch_mod.LaunchError, match="argument 0 has dtype float32"):
        kept(sig, 2, 32, (a.astype(np.float32), 9, 0.25, 7, 1.5, b, 3, out))  # a new kind
    for _ in range(2):
        with pytest.raises(launch_mod.LaunchError, match="argument 6 = 4294967296 overflows int32"):
            kept(sig, 2, 32, (a, 1, 0.25, 7, 1.5, b, 2**32, out))
    monkeypatch.setattr(launch_mod.KeptLaunches, "CAPACITY", len(kept._table))
    checked.clear()
    call(11, 0.5)                                          # a kind past the capacity: checked
    call(11, 0.5)
    assert len(checked) == 6
