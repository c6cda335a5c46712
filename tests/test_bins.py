"""cutopo._bins.threshold_bins against numpy.searchsorted(t, v, side), the definition (both sides):
every dtype the NumPy paths compare in, ties with the thresholds, duplicated thresholds, NaN,
infinities, thresholds crowded into a few buckets (the searchsorted fallback), any shape."""
from __future__ import annotations

import numpy as np
import pytest

from cutopo import _bins
from cutopo._bins import threshold_bins

FLOATS = ["float16", "float32", "float64"]
INTS = ["uint8", "int16", "int32", "int64", "uint64"]


def _float_thresholds(rng, dtype, T, kind):
    if kind == "linear":
        t = np.linspace(rng.uniform(-5, 0), rng.uniform(0.5, 5), T)
    elif kind == "normal":
        t = rng.normal(size=T) * 10
    elif kind == "duplicates":
        t = np.r_[rng.normal(size=T - 6), [0.0] * 3, [1.0] * 3]
    else:  # "crowded": a few distinct values, many copies each, and a wide log range
        t = np.r_[rng.choice(np.linspace(0, 1, 5), T // 2), np.geomspace(1e-6, 1e6, T - T // 2)]
    with np.errstate(over="ignore"):  # float16 overflows to inf, which is then dropped
        t = np.sort(t.astype(dtype))
    return t[np.isfinite(t)]


def _values(rng, t, n):
    """Values around and on the thresholds, plus the extremes of the dtype."""
    dtype = t.dtype
    if dtype.kind == "f":
        spread = float(np.abs(t.astype(np.float64)).max()) + 1.0
        with np.errstate(over="ignore"):  # float16: +-inf, as the extremes below
            v = (rng.normal(size=n) * spread).astype(dtype)
        v[rng.random(n) < 0.02] = np.nan
        v[:4] = [np.inf, -np.inf, -0.0, 0.0]
    else:
        info = np.iinfo(dtype)
        v = rng.integers(info.min, info.max, n, endpoint=True, dtype=dtype)
        v[:2] = [info.min, info.max]
    on = rng.random(n) < 0.3
    v[on] = rng.choice(t, int(on.sum()))
    return v


@pytest.mark.parametrize("kind", ["linear", "normal", "duplicates", "crowded"])
@pytest.mark.parametrize("dtype", FLOATS)
def test_float_values_equal_searchsorted(rng, dtype, kind):
    for _ in range(6):
        t = _float_thresholds(rng, dtype, int(rng.integers(16, 700)), kind)
        if t.size < 2:
            continue
        v = _values(rng, t, int(rng.integers(_bins.MIN_VALUES, 3 * _bins.CHUNK)))
        for side in ("left", "right"):
            np.testing.assert_array_equal(threshold_bins(t, v, side=side),
                                          np.searchsorted(t, v, side=side))


@pytest.mark.parametrize("dtype", INTS)
def test_integer_values_equal_searchsorted(rng, dtype):
    info = np.iinfo(dtype)
    for narrow in (True, False):
        lo, hi = (max(info.min, -1000), min(info.max, 1000)) if narrow else (info.min, info.max)
        t = np.sort(rng.integers(lo, hi, int(rng.integers(16, 300)), endpoint=True, dtype=dtype))
        v = _values(rng, t, int(rng.integers(_bins.MIN_VALUES, 2 * _bins.CHUNK)))
        for side in ("left", "right"):
            np.testing.assert_array_equal(threshold_bins(t, v, side=side),
                                          np.searchsorted(t, v, side=side))


def test_shapes_small_inputs_and_fallbacks(rng):
    t = np.linspace(0, 1, 64)
    v = rng.random((3, 50, 70))
    got = threshold_bins(t, v)
    assert got.shape == v.shape and got.dtype == np.intp
    small = threshold_bins(t, v, np.uint16, side="right")
    assert small.dtype == np.uint16
    np.testing.assert_array_equal(small, np.searchsorted(t, v, side="right"))
    np.testing.assert_array_equal(got, np.searchsorted(t, v, side="left"))
    for t_, v_ in [(t[:5], v), (t, v[0, 0]), (t.astype(np.float32), v),   # searchsorted itself
                   (np.full(40, 0.5), v)]:                               # one bucket: no grid
        np.testing.assert_array_equal(threshold_bins(t_, v_), np.searchsorted(t_, v_, side="left"))
    assert _bins._grid(np.full(40, 0.5)) is None
    crowded = np.sort(np.r_[np.zeros(30), np.linspace(0, 1, 20)])
    assert _bins._grid(crowded) is None  # 31 thresholds in the first bucket
    assert _bins._grid(np.linspace(0, 1, 64)) is not None


@pytest.mark.parametrize("side", ["left", "right"])
def test_values_far_outside_the_thresholds_warn_nothing(rng, side):
    """Values whose distance to the range overflows float64 in the bucket arithmetic (near the
    largest floats, infinities) land in the first or last bin, without a RuntimeWarning."""
    import warnings

    t = np.sort(rng.uniform(-1.0, 1.0, 300))
    v = rng.choice([1.7e308, -1.7e308, np.inf, -np.inf, 0.25, np.nan], size=_bins.MIN_VALUES * 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = threshold_bins(t, v, side=side)
    np.testing.assert_array_equal(got, np.searchsorted(t, v, side=side))


@pytest.mark.parametrize("vdtype", ["bool", "int8", "uint8", "int16", "uint16"])
@pytest.mark.parametrize("tdtype", ["float16", "float32", "float64", "int64", "uint64"])
@pytest.mark.parametrize("table", [True, False])
def test_value_bins_of_small_integer_images(rng, monkeypatch, vdtype, tdtype, table):
    """value_bins(t, v) is numpy.searchsorted(t, v.astype(t.dtype), "left"): through the table
    of every value's bin (bool and 1-2 byte integers) or without it, for thresholds in each
    comparison dtype numpy.result_type gives such images (ties, duplicates, values past both
    ends), C-order, strided and byte-swapped images."""
    monkeypatch.setattr(_bins, "TABLE_MIN_VALUES_PER_ENTRY", 0 if table else 10**12)
    vd = np.dtype(vdtype)
    cmp = np.result_type(vd, np.dtype(tdtype))
    if vd.kind == "b":
        v = rng.random((37, 41)) < 0.4
        t = np.array([-1, 0, 0, 1, 2]) if np.dtype(tdtype).kind != "u" else np.array([0, 0, 1, 2])
    else:
        info = np.iinfo(vd)
        v = rng.integers(info.min, info.max, (37, 41), endpoint=True).astype(vd)
        v[0, :2] = [info.min, info.max]
        floor = 0.0 if np.dtype(tdtype).kind == "u" else -1e9
        lo, hi = max(float(info.min) - 40, floor), float(info.max) + 40
        t = np.concatenate([rng.uniform(lo, hi, 60), rng.choice(v.ravel(), 20), [lo, hi]])
        if np.dtype(tdtype).kind == "f":  # float16 ends at 65504
            t = np.clip(t, -float(np.finfo(tdtype).max), float(np.finfo(tdtype).max))
    t = np.sort(t.astype(tdtype)).astype(cmp)
    for image in (v, v[::2, 1::3], v.astype(vd.newbyteorder())):
        want = np.searchsorted(t, image.astype(cmp), side="left")
        got = _bins.value_bins(t, image, np.uint16)
        assert got.dtype == np.uint16 and got.shape == image.shape
        np.testing.assert_array_equal(got, want)
