"""CUDA path of expected_euler (forward and pullback) against the NumPy path, the oracle."""
from __future__ import annotations

import math

import numpy as np
import pytest

import cutopo
from cutopo._expected_euler import expected_euler

pytestmark = pytest.mark.gpu

CASES = [(2, 1), (2, 2), (3, 1), (3, 3)]  # (ndim, connectivity)
# 1-pixel-wide axes, and sizes that are not multiples of the 256-thread block.
SPATIAL = {2: [(1, 1), (1, 7), (7, 1), (5, 6), (17, 300), (257, 33)],
           3: [(1, 1, 1), (5, 1, 7), (1, 9, 1), (4, 5, 6), (9, 17, 33), (3, 70, 41),
               # around the 3D kernels' column segments of 16 positions along axis 0 (V: the
               # planes, T: the planes and the ring's one)
               (15, 6, 2), (16, 3, 4), (17, 4, 3), (33, 2, 5)]}
BATCHES = [(), (2, 3)]


def _cp():
    import cupy

    return cupy


def _prob(rng, shape, dtype=np.float64):
    """Probabilities strictly inside (0, 1), rounded to ``dtype`` (both paths see these values)."""
    return rng.uniform(0.05, 0.95, size=shape).astype(dtype)


def _cells(spatial):
    """More than the number of cells of either construction: the scale of E's rounding error."""
    return math.prod(2 * n + 1 for n in spatial)


def _reference(p, **kw):
    """E[chi] of the (rounded) probabilities, computed in float64 by the NumPy path."""
    return expected_euler(p.astype(np.float64), **kw)


def _assert_forward_close(got, p, spatial, **kw):
    ref = _reference(p, **kw)
    if p.dtype == np.float64:
        # Sums of about _cells() terms in [-1, 1], in a different order than NumPy's.
        np.testing.assert_allclose(got, ref, rtol=1e-12, atol=1e-12 * _cells(spatial))
    else:
        # Each cell term is a float32 product of at most 8 factors (relative error below 1e-6),
        # and the result is rounded to float32 once.
        np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-6 * _cells(spatial))


def _pullback(p, g, **kw):
    """(output, cotangent of p) through cutopo.vjp, on p's array type."""
    out, pullback = cutopo.vjp(expected_euler, p, **kw)
    (d,) = pullback(g)
    return out, d


# ----------------------------------------------------------------------------- forward

@pytest.mark.parametrize("ndim,connectivity", CASES)
@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.float16])
def test_forward_matches_numpy(rng, ndim, connectivity, dtype):
    cp = _cp()
    kw = dict(ndim=ndim, connectivity=connectivity)
    for spatial in SPATIAL[ndim]:
        for batch in BATCHES:
            p = _prob(rng, batch + spatial, dtype)
            want = expected_euler(p, **kw)
            got = expected_euler(cp.asarray(p), **kw)
            assert isinstance(got, cp.ndarray)
            assert got.shape == want.shape == batch
            assert got.dtype == want.dtype == (np.float64 if dtype == np.float64 else np.float32)
            _assert_forward_close(got.get(), p, spatial, **kw)


@pytest.mark.parametrize("ndim,connectivity", CASES)
def test_forward_binary_is_exact(rng, ndim, connectivity):
    """0/1 probabilities make every cell term 0 or 1: the sums are exact integers."""
    cp = _cp()
    spatial = (37, 41) if ndim == 2 else (9, 11, 13)
    mask = rng.random((3,) + spatial) < 0.5
    for dtype in (np.float64, np.float32):
        p = mask.astype(dtype)
        want = expected_euler(p, ndim=ndim, connectivity=connectivity)
        got = expected_euler(cp.asarray(p), ndim=ndim, connectivity=connectivity)
        np.testing.assert_array_equal(got.get(), want)


@pytest.mark.parametrize("ndim,connectivity", CASES)
def test_forward_many_small_images(rng, ndim, connectivity):
    """More images than blocks: each block strides over several images."""
    cp = _cp()
    spatial = (3, 4) if ndim == 2 else (2, 3, 2)
    p = _prob(rng, (5000,) + spatial)
    got = expected_euler(cp.asarray(p), ndim=ndim, connectivity=connectivity)
    _assert_forward_close(got.get(), p, spatial, ndim=ndim, connectivity=connectivity)


@pytest.mark.parametrize("ndim,connectivity", CASES)
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_forward_large_image(rng, ndim, connectivity, dtype):
    """One image spread over many blocks, each striding over its anchors."""
    cp = _cp()
    spatial = (1031, 1029) if ndim == 2 else (70, 81, 90)
    p = _prob(rng, spatial, dtype)
    got = expected_euler(cp.asarray(p), connectivity=connectivity)
    assert got.shape == ()
    _assert_forward_close(got.get(), p, spatial, connectivity=connectivity)


def test_forward_non_contiguous_input(rng):
    cp = _cp()
    dev = cp.asarray(_prob(rng, (4, 9, 12)))[:, ::2, 1:].transpose(0, 2, 1)
    assert not dev.flags.c_contiguous
    host = dev.get()
    for connectivity in (1, 2):
        got = expected_euler(dev, ndim=2, connectivity=connectivity)
        _assert_forward_close(got.get(), host, host.shape[1:], ndim=2, connectivity=connectivity)


# ----------------------------------------------------------------------------- pullback

@pytest.mark.parametrize("ndim,connectivity", CASES)
def test_pullback_matches_numpy(rng, ndim, connectivity):
    cp = _cp()
    kw = dict(ndim=ndim, connectivity=connectivity)
    for spatial in SPATIAL[ndim]:
        for batch in BATCHES:
            p = _prob(rng, batch + spatial)
            g = rng.standard_normal(batch)
            out, d = _pullback(cp.asarray(p), cp.asarray(g), **kw)
            _, want = _pullback(p, g, **kw)
            assert isinstance(out, cp.ndarray) and isinstance(d, cp.ndarray)
            assert d.shape == p.shape and d.dtype == np.float64
            # Per pixel: a signed sum of 3**ndim products in [0, 1], times the cotangent.
            np.testing.assert_allclose(d.get(), want, rtol=1e-12, atol=1e-12 * np.abs(g).max())


@pytest.mark.parametrize("ndim,connectivity", CASES)
def test_pullback_with_exact_zeros_and_ones(rng, ndim, connectivity):
    """No division by p: exact 0 and 1 entries give the same finite cotangents as NumPy."""
    cp = _cp()
    spatial = (13, 17) if ndim == 2 else (5, 6, 7)
    p = _prob(rng, (2,) + spatial)
    flat = p.reshape(-1)
    idx = rng.choice(flat.size, size=flat.size // 3, replace=False)
    flat[idx[: len(idx) // 2]] = 0.0
    flat[idx[len(idx) // 2:]] = 1.0
    g = rng.standard_normal(2)
    _, d = _pullback(cp.asarray(p), cp.asarray(g), ndim=ndim, connectivity=connectivity)
    _, want = _pullback(p, g, ndim=ndim, connectivity=connectivity)
    assert bool(cp.all(cp.isfinite(d)))
    np.testing.assert_allclose(d.get(), want, rtol=1e-12, atol=1e-12 * np.abs(g).max())


@pytest.mark.parametrize("ndim,connectivity", CASES)
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_pullback_low_precision(rng, ndim, connectivity, dtype):
    cp = _cp()
    kw = dict(ndim=ndim, connectivity=connectivity)
    for spatial in SPATIAL[ndim]:
        p = _prob(rng, (2, 3) + spatial, dtype)
        g = rng.standard_normal((2, 3)).astype(np.float32)
        out, d = _pullback(cp.asarray(p), cp.asarray(g), **kw)
        out_np, d_np = _pullback(p, g, **kw)
        assert out.dtype == out_np.dtype == np.float32
        assert d.dtype == d_np.dtype == dtype and d.shape == p.shape
        _, ref = _pullback(p.astype(np.float64), g.astype(np.float64), **kw)
        # float32 products and sums of 3**ndim terms in [-1, 1] (absolute error), and float16
        # rounds the result once more (relative error).
        rtol = 1e-5 if dtype == np.float32 else 2e-3
        np.testing.assert_allclose(d.get().astype(np.float64), ref, rtol=rtol,
                                   atol=1e-4 * np.abs(g).max())


@pytest.mark.parametrize("ndim,connectivity", CASES)
def test_pullback_grid_stride(rng, ndim, connectivity):
    """More pixels than threads in the grid: each thread handles several pixels."""
    cp = _cp()
    shape = (1, 1031, 1029) if ndim == 2 else (2, 70, 81, 90)
    p = _prob(rng, shape)
    g = rng.standard_normal(shape[:1])
    _, d = _pullback(cp.asarray(p), cp.asarray(g), ndim=ndim, connectivity=connectivity)
    _, want = _pullback(p, g, ndim=ndim, connectivity=connectivity)
    np.testing.assert_allclose(d.get(), want, rtol=1e-12, atol=1e-12 * np.abs(g).max())


def test_pullback_many_small_images(rng):
    cp = _cp()
    p = _prob(rng, (5000, 3, 4))
    g = rng.standard_normal(5000)
    for connectivity in (1, 2):
        _, d = _pullback(cp.asarray(p), cp.asarray(g), ndim=2, connectivity=connectivity)
        _, want = _pullback(p, g, ndim=2, connectivity=connectivity)
        np.testing.assert_allclose(d.get(), want, rtol=1e-12, atol=1e-12 * np.abs(g).max())


def test_pullback_without_batch_and_wrt(rng):
    cp = _cp()
    p = cp.asarray(_prob(rng, (6, 7)))
    out, pullback = cutopo.vjp(expected_euler, p, connectivity=2)
    assert out.shape == ()
    d1, d2 = pullback(cp.asarray(1.0))[0], pullback(cp.asarray(2.0))[0]
    assert isinstance(d1, cp.ndarray) and d1.shape == (6, 7)
    np.testing.assert_allclose(d2.get(), 2 * d1.get(), rtol=1e-15, atol=0)
    _, pb_none = cutopo.vjp(expected_euler, p, wrt=())
    assert pb_none(cp.asarray(1.0)) == (None,)


# ----------------------------------------------------------------------------- edge cases

@pytest.mark.parametrize("ndim,connectivity", CASES)
@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.float16])
def test_empty_batch(ndim, connectivity, dtype):
    cp = _cp()
    p = cp.zeros((0,) + (3,) * ndim, dtype=dtype)
    out, pullback = cutopo.vjp(expected_euler, p, ndim=ndim, connectivity=connectivity)
    assert isinstance(out, cp.ndarray) and out.shape == (0,)
    assert out.dtype == (np.float64 if dtype == np.float64 else np.float32)
    (d,) = pullback(cp.zeros((0,), dtype=out.dtype))
    assert isinstance(d, cp.ndarray) and d.shape == p.shape and d.dtype == dtype


@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.float16])
def test_rejects_values_outside_unit_interval(rng, dtype):
    cp = _cp()
    p = _prob(rng, (3, 4, 4), dtype)
    for bad in (-1e-3, 1.01, np.inf, -np.inf):
        q = p.copy()
        q[1, 2, 3] = bad
        with pytest.raises(ValueError, match="prob"):
            expected_euler(cp.asarray(q), ndim=2)


@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.float16])
def test_rejects_nan(rng, dtype):
    cp = _cp()
    p = _prob(rng, (3, 4, 4), dtype)
    p[2, 0, 1] = np.nan
    with pytest.raises(ValueError, match="prob.*NaN"):
        expected_euler(cp.asarray(p), ndim=2)
    p[0, 0, 0] = -0.5  # NaN is reported even next to an out-of-range value
    with pytest.raises(ValueError, match="prob.*NaN"):
        expected_euler(cp.asarray(p), ndim=2)


@pytest.mark.parametrize("ndim,connectivity", CASES)
def test_values_checked_by_the_forward_kernel(rng, monkeypatch, ndim, connectivity):
    """The forward kernel checks prob as it reads it (no range read on the host unless it
    flags a value): a bad value anywhere (corners, the last image, T's border) raises at the
    call, and the calls after it (same thread, another stream) are unaffected: the flags'
    counters are left zeroed."""
    from cutopo import _expected_euler

    cp = _cp()
    shape = (3,) + (7,) * ndim
    real_check = _expected_euler._check_unit_interval
    calls = []

    def counted(prob):
        calls.append(prob.shape)
        return real_check(prob)

    monkeypatch.setattr(_expected_euler, "_check_unit_interval", counted)
    p = _prob(rng, shape, np.float32)
    want = expected_euler(p, ndim=ndim, connectivity=connectivity)
    calls.clear()
    for _ in range(2):
        got = expected_euler(cp.asarray(p), ndim=ndim, connectivity=connectivity)
        np.testing.assert_allclose(got.get(), want, rtol=1e-5, atol=1e-5)
    assert calls == []  # valid values: the host read nothing
    for where in (0, p.size - 1, int(rng.integers(p.size))):
        for bad in (-0.5, 1.5, np.nan):
            q = p.copy()
            q.flat[where] = bad
            with pytest.raises(ValueError, match="prob"):
                expected_euler(cp.asarray(q), ndim=ndim, connectivity=connectivity)
            got = expected_euler(cp.asarray(p), ndim=ndim, connectivity=connectivity)
            np.testing.assert_allclose(got.get(), want, rtol=1e-5, atol=1e-5)
    with cp.cuda.Stream(non_blocking=True) as s:
        got = expected_euler(cp.asarray(p), ndim=ndim, connectivity=connectivity)
        s.synchronize()
    np.testing.assert_allclose(got.get(), want, rtol=1e-5, atol=1e-5)
    # after the repeated calls (_expected_euler._DEVICE_CALLS): other layouts and dtypes of
    # the same values, and another batch shape, take their own checks and plans
    dev = cp.asarray(p)
    strided = cp.asarray(np.repeat(p, 2, axis=-1))[..., ::2]
    for other in (strided, dev.astype(cp.float64), dev.astype(cp.float16), dev[None]):
        got = expected_euler(other, ndim=ndim, connectivity=connectivity)
        want_other = expected_euler(other.get(), ndim=ndim, connectivity=connectivity)
        np.testing.assert_allclose(got.get(), want_other, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="connectivity"):
        expected_euler(dev, ndim=ndim, connectivity=5)
    # the plan's kept per-image sums are left zeroed by the kernel's last block
    from cutopo import _expected_euler_cupy

    plan = _expected_euler_cupy._plan_of(dev, ndim, connectivity == ndim)
    kept = plan.sums.kept()
    assert kept and not any(bool(ws.any()) for ws in kept)
