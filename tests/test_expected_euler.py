"""Tests of expected_euler: the exact expected Euler characteristic of a random binary image."""
from __future__ import annotations

import doctest
import importlib
import itertools

import numpy as np
import pytest
from skimage.measure import euler_number

import cutopo
from cutopo._expected_euler import expected_euler

CASES = [(2, 1), (2, 2), (3, 1), (3, 3)]  # (ndim, connectivity)


def _random_prob(rng, shape, *, with_extremes=False):
    """Probabilities strictly inside (0, 1), optionally with some exact 0 and 1 entries."""
    p = rng.uniform(0.05, 0.95, size=shape)
    if with_extremes:
        flat = p.reshape(-1)
        idx = rng.choice(flat.size, size=max(2, flat.size // 4), replace=False)
        flat[idx[: len(idx) // 2]] = 0.0
        flat[idx[len(idx) // 2:]] = 1.0
    return p


def _random_shape(rng, ndim, batch=()):
    hi = 7 if ndim == 2 else 5
    return tuple(batch) + tuple(int(n) for n in rng.integers(1, hi, size=ndim))


# ----------------------------------------------------------------------------- binary input

@pytest.mark.parametrize("ndim,connectivity", CASES)
def test_binary_equals_skimage(rng, ndim, connectivity):
    for _ in range(15):
        shape = _random_shape(rng, ndim)
        mask = rng.random(shape) < rng.uniform(0.2, 0.8)
        mask.reshape(-1)[rng.integers(mask.size)] = True  # never all-zero
        for dtype in (np.float64, np.float32):
            got = expected_euler(mask.astype(dtype), connectivity=connectivity)
            assert got.shape == ()
            assert got.dtype == dtype
            assert got == pytest.approx(euler_number(mask, connectivity=connectivity), abs=1e-9)


@pytest.mark.parametrize("ndim,connectivity", CASES)
def test_binary_batch_equals_skimage(rng, ndim, connectivity):
    batch = (2, 3) if ndim == 2 else (4,)
    shape = _random_shape(rng, ndim, batch)
    mask = rng.random(shape) < 0.5
    mask.reshape(-1)[0] = True
    got = expected_euler(mask.astype(np.float64), ndim=ndim, connectivity=connectivity)
    assert got.shape == batch
    want = np.array([euler_number(m, connectivity=connectivity)
                     for m in mask.reshape((-1,) + shape[-ndim:])]).reshape(batch)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-9)


def test_binary_large_image_matches_skimage(rng):
    mask = rng.random((40, 50)) < 0.55
    for connectivity in (1, 2):
        assert expected_euler(mask.astype(np.float64), connectivity=connectivity) == pytest.approx(
            euler_number(mask, connectivity=connectivity), abs=1e-8)
    mask = rng.random((12, 13, 14)) < 0.4
    for connectivity in (1, 3):
        assert expected_euler(mask.astype(np.float64), connectivity=connectivity) == pytest.approx(
            euler_number(mask, connectivity=connectivity), abs=1e-8)


# ----------------------------------------------------------------------------- exact enumeration

@pytest.mark.parametrize("shape", [(2, 3), (3, 3), (2, 2, 2), (1, 2, 3)])
def test_exact_enumeration(rng, shape):
    ndim = len(shape)
    p = _random_prob(rng, shape)
    n = p.size
    flat = p.reshape(-1)
    for connectivity in (1, ndim):
        total = 0.0
        for bits in itertools.product((False, True), repeat=n):
            b = np.array(bits)
            weight = np.prod(np.where(b, flat, 1 - flat))
            total += weight * euler_number(b.reshape(shape), connectivity=connectivity)
        assert expected_euler(p, connectivity=connectivity) == pytest.approx(total, rel=1e-12, abs=1e-12)


# ----------------------------------------------------------------------------- Monte Carlo

@pytest.mark.parametrize("shape", [(6, 7), (4, 4, 4)])
def test_monte_carlo(rng, shape):
    ndim = len(shape)
    p = _random_prob(rng, shape)
    samples = rng.random((3000,) + shape) < p
    for connectivity in (1, ndim):
        chi = np.array([euler_number(s, connectivity=connectivity) for s in samples], dtype=np.float64)
        mean, se = chi.mean(), chi.std(ddof=1) / np.sqrt(chi.size)
        expected = float(expected_euler(p, connectivity=connectivity))
        assert abs(mean - expected) < 4 * se + 1e-12, (connectivity, mean, expected, se)


# ----------------------------------------------------------------------------- gradient

def _shape_for(rng, ndim, batch):
    hi = 6 if ndim == 2 else 4
    return tuple(batch) + tuple(int(n) for n in rng.integers(2, hi + 1, size=ndim))


@pytest.mark.parametrize("ndim,connectivity", CASES)
@pytest.mark.parametrize("batch", [(), (2,), (2, 2)])
def test_pullback_central_differences(rng, ndim, connectivity, batch):
    shape = _shape_for(rng, ndim, batch)
    p = _random_prob(rng, shape)
    out, pullback = cutopo.vjp(expected_euler, p, ndim=ndim, connectivity=connectivity)
    assert out.shape == batch and out.dtype == np.float64
    g = rng.standard_normal(out.shape)
    (d,) = pullback(g)
    assert d.shape == p.shape and d.dtype == np.float64

    eps = 1e-6
    num = np.empty_like(p)
    for i in range(p.size):
        hi, lo = p.copy(), p.copy()
        hi.reshape(-1)[i] += eps
        lo.reshape(-1)[i] -= eps
        diff = (expected_euler(hi, ndim=ndim, connectivity=connectivity)
                - expected_euler(lo, ndim=ndim, connectivity=connectivity))
        num.reshape(-1)[i] = np.sum(g * diff) / (2 * eps)
    # E is affine in each pixel, so the difference has no truncation error; what remains is
    # rounding, about ulp(|E|) / eps per entry (E is a few units here), allowed for absolutely.
    assert np.linalg.norm(num - d) <= 1e-6 * np.linalg.norm(d) + _fd_floor(g, p)


def _fd_floor(g, p):
    return 1e-8 * np.linalg.norm(g) * np.sqrt(p.size)


@pytest.mark.parametrize("ndim,connectivity", CASES)
def test_pullback_with_exact_zeros_and_ones(rng, ndim, connectivity):
    """E is affine in each pixel, so dE/dp_x = E(p_x=1) - E(p_x=0) exactly, also at 0 and 1;
    one-sided differences into [0, 1] agree too."""
    shape = _shape_for(rng, ndim, (2,))
    p = _random_prob(rng, shape, with_extremes=True)
    assert np.any(p == 0) and np.any(p == 1)
    out, pullback = cutopo.vjp(expected_euler, p, ndim=ndim, connectivity=connectivity)
    g = rng.standard_normal(out.shape)
    (d,) = pullback(g)

    def f(x):
        return np.sum(g * expected_euler(x, ndim=ndim, connectivity=connectivity))

    secant = np.empty_like(p)
    one_sided = np.empty_like(p)
    eps = 1e-6
    for i in range(p.size):
        hi, lo = p.copy(), p.copy()
        hi.reshape(-1)[i], lo.reshape(-1)[i] = 1.0, 0.0
        secant.reshape(-1)[i] = f(hi) - f(lo)
        step = p.copy()
        s = -eps if p.reshape(-1)[i] > 0.5 else eps  # step away from the boundary
        step.reshape(-1)[i] += s
        one_sided.reshape(-1)[i] = (f(step) - f(p)) / s
    np.testing.assert_allclose(d, secant, rtol=1e-12, atol=1e-12)
    assert np.linalg.norm(one_sided - d) <= 1e-6 * np.linalg.norm(d) + 2 * _fd_floor(g, p)


def test_pullback_binary_image_is_finite_and_exact(rng):
    """At a 0/1 image the derivative is the change of chi when flipping one pixel."""
    mask = rng.random((5, 6)) < 0.5
    mask[0, 0] = True
    p = mask.astype(np.float64)
    for connectivity in (1, 2):
        _, pullback = cutopo.vjp(expected_euler, p, connectivity=connectivity)
        (d,) = pullback(np.array(1.0))
        want = np.empty_like(p)
        for idx in np.ndindex(p.shape):
            on, off = mask.copy(), mask.copy()
            on[idx], off[idx] = True, False
            want[idx] = (euler_number(on, connectivity=connectivity)
                         - euler_number(off, connectivity=connectivity))
        np.testing.assert_array_equal(d, want)


# ----------------------------------------------------------------------------- dtypes

@pytest.mark.parametrize("ndim,connectivity", CASES)
def test_low_precision_dtypes(rng, ndim, connectivity):
    shape = _shape_for(rng, ndim, (3,))
    p64 = _random_prob(rng, shape, with_extremes=True)
    for dtype in (np.float32, np.float16):
        p = p64.astype(dtype)
        ref = expected_euler(p.astype(np.float64), ndim=ndim, connectivity=connectivity)
        got = expected_euler(p, ndim=ndim, connectivity=connectivity)
        assert got.dtype == np.float32 and got.shape == (3,)
        # Every cell's probability is a float32 product of at most 2**ndim factors in [0, 1].
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6 * np.prod(shape[1:]))

        out, pullback = cutopo.vjp(expected_euler, p, ndim=ndim, connectivity=connectivity)
        assert out.dtype == np.float32
        g = rng.standard_normal(out.shape).astype(np.float32)
        (d,) = pullback(g)
        assert d.dtype == dtype and d.shape == p.shape
        _, pb64 = cutopo.vjp(expected_euler, p.astype(np.float64), ndim=ndim, connectivity=connectivity)
        (d64,) = pb64(g.astype(np.float64))
        # d is a signed sum of 3**ndim products in [0, 1] (cancellation: absolute error), and
        # float16 rounds the result once more.
        rtol = 1e-5 if dtype == np.float32 else 2e-3
        np.testing.assert_allclose(d.astype(np.float64), d64, rtol=rtol, atol=1e-5 * np.abs(g).max())


# ----------------------------------------------------------------------------- shapes and vjp

def test_output_shapes(rng):
    p = _random_prob(rng, (4, 5))
    assert expected_euler(p).shape == ()
    assert isinstance(expected_euler(p), np.ndarray)
    assert expected_euler(np.stack([p, p]), ndim=2).shape == (2,)
    assert expected_euler(_random_prob(rng, (2, 3, 4, 5)), ndim=3).shape == (2,)
    assert expected_euler(_random_prob(rng, (2, 3, 4, 5)), ndim=2).shape == (2, 3)
    assert expected_euler(np.zeros((0, 3, 3)), ndim=2).shape == (0,)


def test_batch_matches_single_images(rng):
    p = _random_prob(rng, (3, 4, 5, 6))
    for connectivity in (1, 3):
        batched = expected_euler(p, ndim=3, connectivity=connectivity)
        single = [expected_euler(x, connectivity=connectivity) for x in p]
        np.testing.assert_allclose(batched, single, rtol=1e-13, atol=1e-13)


def test_vjp_interface(rng):
    p = _random_prob(rng, (2, 5, 6))
    out, pullback = cutopo.vjp(expected_euler, p, ndim=2, connectivity=2)
    np.testing.assert_array_equal(out, expected_euler(p, ndim=2, connectivity=2))
    grads = pullback(np.ones_like(out))
    assert isinstance(grads, tuple) and len(grads) == 1
    assert grads[0].shape == p.shape and grads[0].dtype == p.dtype
    _, pb_none = cutopo.vjp(expected_euler, p, ndim=2, wrt=())
    assert pb_none(np.ones(2)) == (None,)
    _, pb_name = cutopo.vjp(expected_euler, p, ndim=2, wrt="prob")
    assert pb_name(np.ones(2))[0].shape == p.shape
    # No batch: a 0-d output and cotangent.
    out0, pb0 = cutopo.vjp(expected_euler, p[0])
    assert out0.shape == ()
    assert pb0(np.float64(2.0))[0].shape == (5, 6)
    np.testing.assert_allclose(pb0(np.float64(2.0))[0], 2 * pb0(np.float64(1.0))[0])


def test_registered():
    from cutopo.vjp import REGISTRY

    spec = REGISTRY["expected_euler"]
    assert spec.arg_names == ("prob",) and spec.differentiable == frozenset({"prob"})
    assert expected_euler.__cutopo_op__ is spec


def test_cuda_instances_are_registered():
    """Every kernel the CuPy path launches is one the offline NVRTC check compiles."""
    from cutopo import _expected_euler_cupy as cuda_path
    from cutopo._cuda.compile import registered_instances

    names = set(registered_instances()["ecc"])
    for dtype in (np.float32, np.float64):
        for ndim in (2, 3):
            for tconn in (False, True):
                assert cuda_path.forward_signature(dtype, ndim, tconn).name in names
                assert cuda_path.backward_signature(dtype, ndim, tconn).name in names


# ----------------------------------------------------------------------------- bad input

def test_rejects_values_outside_unit_interval(rng):
    p = _random_prob(rng, (4, 4))
    for bad in (-1e-3, 1.0 + 1e-6, np.inf, -np.inf):
        q = p.copy()
        q[1, 2] = bad
        with pytest.raises(ValueError, match="prob"):
            expected_euler(q)


def test_rejects_nan(rng):
    p = _random_prob(rng, (3, 4, 4))
    p[1, 2, 3] = np.nan
    with pytest.raises(ValueError, match="prob.*NaN"):
        expected_euler(p, ndim=2)


@pytest.mark.parametrize("dtype", [np.int32, np.uint8, np.int64, bool, np.complex128])
def test_rejects_non_float_dtypes(rng, dtype):
    p = (rng.random((4, 4)) < 0.5).astype(dtype)
    with pytest.raises(TypeError, match="prob"):
        expected_euler(p)


def test_rejects_wrong_ndim(rng):
    with pytest.raises(ValueError, match="prob"):
        expected_euler(_random_prob(rng, (5,)))
    with pytest.raises(ValueError, match="prob"):
        expected_euler(_random_prob(rng, (2, 3, 4, 5)))
    with pytest.raises(ValueError, match="prob"):
        expected_euler(_random_prob(rng, (4, 5)), ndim=3)
    with pytest.raises(ValueError, match="ndim"):
        expected_euler(_random_prob(rng, (4, 5)), ndim=4)
    with pytest.raises(ValueError, match="prob"):
        expected_euler(np.zeros((3, 0)))


def test_rejects_bad_connectivity(rng):
    with pytest.raises(ValueError, match="connectivity"):
        expected_euler(_random_prob(rng, (3, 4, 4)), connectivity=2)
    with pytest.raises(ValueError, match="connectivity"):
        expected_euler(_random_prob(rng, (4, 4)), connectivity=3)
    with pytest.raises(TypeError, match="connectivity"):
        expected_euler(_random_prob(rng, (4, 4)), connectivity=1.0)


# ----------------------------------------------------------------------------- docs

def test_docstring_examples():
    module = importlib.import_module("cutopo._expected_euler")
    result = doctest.testmod(module, verbose=False, report=True)
    assert result.attempted > 0 and result.failed == 0
