"""CPU tests of the soft (sigmoid-relaxed) ECC, cutopo._soft_ecc.soft_ecc, and its VJP.

Expected values come from a dense per-cell evaluation written here from the cell definitions
(the cell enumeration of ``oracles.py``: V cells take the max of their vertices, T lower cells
the min of the pixels around them), from the exact ``cutopo.ecc`` (the limit scale -> inf) and
from central finite differences of the forward.
"""
from __future__ import annotations

import doctest
import importlib
import math

import numpy as np
import pytest

import cutopo
from cutopo import _band_numpy, _checks
from cutopo._soft_ecc import soft_ecc
from oracles import cells

CASES = [(2, 1), (2, 2), (3, 1), (3, 3)]  # (ndim, connectivity)
B64 = 37.0  # documented band half-width in float64
B32 = 17.0


# ---------------------------------------------------------------------------------------------
# Independent reference


def sigmoid(u):
    """Logistic function in float64, without overflow; sigmoid(+-inf) = 1 / 0."""
    u = np.asarray(u, dtype=np.float64)
    out = np.empty_like(u)
    pos = u >= 0
    out[pos] = 1.0 / (1.0 + np.exp(-u[pos]))
    e = np.exp(u[~pos])
    out[~pos] = e / (1.0 + e)
    return out


def dense_soft_single(image, t, scale, connectivity):
    """sum over all cells of (-1)^dim sigmoid(scale (t - f(cell))), float64, shape (T,)."""
    values, present, dims = cells(image, np.float64, connectivity)
    v = values[present]
    sign = np.where(dims[present] % 2 == 1, -1.0, 1.0)
    t = np.asarray(t, dtype=np.float64)
    return (sign[:, None] * sigmoid(float(scale) * (t[None, :] - v[:, None]))).sum(axis=0)


def dense_soft(image, t, scale, ndim, connectivity):
    image = np.asarray(image)
    batch = image.shape[:image.ndim - ndim]
    flat = image.reshape((-1,) + image.shape[image.ndim - ndim:])
    out = np.stack([dense_soft_single(x, t, scale, connectivity) for x in flat])
    return out.reshape(batch + (np.asarray(t).size,))


def n_cells(shape, ndim):
    spatial = shape[len(shape) - ndim:]
    return math.prod(shape[:len(shape) - ndim]) * math.prod(2 * s + 1 for s in spatial)


def abs_c_sum(image, ndim, connectivity):
    """sum_p |c(p)| per image of the batch, shape (*batch, 1): the factor of the error bound."""
    c = cutopo.euler_contributions(image, ndim=ndim, connectivity=connectivity).astype(np.int64)
    axes = tuple(range(c.ndim - ndim, c.ndim))
    return np.abs(c).sum(axis=axes)[..., None].astype(np.float64)


def random_image(rng, shape, *, ties=False):
    if ties:
        levels = rng.normal(size=int(rng.integers(2, 6)))
        return rng.choice(levels, size=shape)
    return rng.normal(size=shape) * rng.uniform(0.5, 3.0) + rng.uniform(-2, 2)


def threshold_sets(rng, image):
    finite = image[np.isfinite(image)]
    lo, hi = float(finite.min()), float(finite.max())
    return {
        "linspace": np.linspace(lo - 0.5, hi + 0.5, 23),
        "random_with_duplicates": np.sort(np.repeat(rng.uniform(lo - 1, hi + 1, 9), rng.integers(1, 3, 9))),
        "at_pixel_values": np.sort(rng.choice(finite, size=min(8, finite.size), replace=False)),
        "single": np.array([rng.uniform(lo, hi)]),
        "count": 17,
    }


def thresholds_array(image, thresholds):
    if isinstance(thresholds, int):
        return cutopo.linear_thresholds(image, thresholds).astype(np.float64)
    return thresholds


def shape_for(rng, ndim, batched):
    spatial = tuple(int(s) for s in rng.integers(3, 8 if ndim == 2 else 5, size=ndim))
    return ((2,) if batched else ()) + spatial


# ---------------------------------------------------------------------------------------------
# Forward


@pytest.mark.parametrize("ndim,conn", CASES)
@pytest.mark.parametrize("scale", [0.5, 5.0, 50.0, 500.0])
@pytest.mark.parametrize("batched", [False, True])
def test_equals_dense_per_cell_relaxation(rng, ndim, conn, scale, batched):
    shape = shape_for(rng, ndim, batched)
    for ties in (False, True):
        image = random_image(rng, shape, ties=ties)
        bound = np.exp(-B64) * abs_c_sum(image, ndim, conn) + 64 * np.finfo(float).eps * n_cells(shape, ndim)
        for name, thresholds in threshold_sets(rng, image).items():
            got = soft_ecc(image, thresholds, scale, ndim=ndim, connectivity=conn)
            t = thresholds_array(image, thresholds)
            want = dense_soft(image, t, scale, ndim, conn)
            assert got.dtype == np.float64 and got.shape == shape[:len(shape) - ndim] + (t.size,)
            err = np.abs(got - want)
            assert np.all(err <= bound), (name, ties, float(err.max()))


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_extreme_values_warn_nothing_and_equal_dense(rng, dtype):
    """Pixels and thresholds at +-the dtype's largest value (band edges past it are +-inf):
    no floating-point warning, the forward equals the dense relaxation and the pullback is
    finite."""
    import warnings

    big = np.finfo(dtype).max
    image = rng.choice(np.array([-big, big, 0.0, 1.0, -1.0], dtype), size=(2, 9, 11))
    for t in (np.array([-big, 0.0, big], dtype), np.linspace(-1, 1, 5).astype(dtype)):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            got, pull = cutopo.vjp(soft_ecc, image, t, 0.5, ndim=2)
            grads = pull(np.ones_like(got))
        with np.errstate(over="ignore"):  # the oracle's t - f past +-max: +-inf, sigmoid 1 or 0
            want = dense_soft(image, t, 0.5, 2, 1)
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
        assert all(g is None or np.all(np.isfinite(g)) for g in grads)


@pytest.mark.parametrize("ndim,conn", CASES)
@pytest.mark.parametrize("band", [1.5, 4.0])
def test_documented_error_bound_with_a_narrow_band(rng, monkeypatch, ndim, conn, band):
    """With a small B the truncation error is visible and stays within e^-B sum |c|."""
    monkeypatch.setitem(_band_numpy._BAND, np.dtype(np.float64), band)
    shape = shape_for(rng, ndim, True)
    image = random_image(rng, shape)
    t = np.sort(rng.uniform(image.min() - 1, image.max() + 1, 40))
    scale = 3.0
    got = soft_ecc(image, t, scale, ndim=ndim, connectivity=conn)
    want = dense_soft(image, t, scale, ndim, conn)
    err = np.abs(got - want)
    bound = np.exp(-band) * abs_c_sum(image, ndim, conn)
    assert np.all(err <= bound + 1e-12)
    assert err.max() > 1e-6  # the band really truncated something


def test_chunking_does_not_change_results(rng, monkeypatch):
    image = random_image(rng, (3, 6, 7))
    t = np.linspace(image.min(), image.max(), 13)
    g = rng.standard_normal((3, 13))
    for scale in (0.5, 20.0):
        out, pullback = cutopo.vjp(soft_ecc, image, t, scale, ndim=2)
        grads = pullback(g)
        monkeypatch.setattr(_band_numpy, "_CHUNK_ENTRIES", 5)
        out_c, pullback_c = cutopo.vjp(soft_ecc, image, t, scale, ndim=2)
        grads_c = pullback_c(g)
        monkeypatch.undo()
        np.testing.assert_allclose(out_c, out, rtol=0, atol=1e-12)
        for a, b in zip(grads_c, grads):
            np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("ndim,conn", CASES)
def test_tends_to_exact_ecc(rng, ndim, conn):
    """Thresholds away from every pixel value: |soft - ecc| <= sum|c| sigmoid(-scale * gap)."""
    image = random_image(rng, shape_for(rng, ndim, False))
    vals = np.unique(image)
    mids = (vals[:-1] + vals[1:]) / 2
    t = np.concatenate([[vals[0] - 1.0], np.sort(rng.choice(mids, size=min(10, mids.size), replace=False)),
                        [vals[-1] + 1.0]])
    gap = float(np.min(np.abs(t[:, None] - vals[None, :])))
    exact = cutopo.ecc(image, t, connectivity=conn)
    sum_c = float(abs_c_sum(image, ndim, conn)[0])
    errors = []
    for scale in (1.0 / gap, 4.0 / gap, 16.0 / gap, 64.0 / gap):
        soft = soft_ecc(image, t, scale, connectivity=conn)
        err = float(np.max(np.abs(soft - exact)))
        assert err <= sum_c * sigmoid(-scale * gap) + 1e-9
        errors.append(err)
    assert errors[-1] < 1e-9
    np.testing.assert_allclose(soft_ecc(image, t, 100.0 / gap, connectivity=conn), exact, atol=1e-9)


def test_ecc_limit_integer_image(rng):
    image = rng.integers(0, 6, size=(9, 8)).astype(np.uint8)
    t = np.arange(6) + rng.uniform(0.2, 0.8)
    np.testing.assert_allclose(soft_ecc(image, t, 300.0, connectivity=2), cutopo.ecc(image, t, connectivity=2),
                               atol=1e-5)


def test_count_thresholds(rng):
    image = random_image(rng, (6, 7))
    got = soft_ecc(image, 11, 4.0)
    np.testing.assert_allclose(got, soft_ecc(image, cutopo.linear_thresholds(image, 11), 4.0), rtol=0, atol=0)
    out, pullback = cutopo.vjp(soft_ecc, image, 11, 4.0)
    d_image, d_t, d_scale = pullback(np.ones_like(out))
    assert d_t is None and d_image.shape == image.shape and d_scale.shape == ()


# ---------------------------------------------------------------------------------------------
# Pullback


def distinct_image(rng, shape):
    """Values (a permutation of 0..N-1 plus jitter) / N: every gap is at least 0.5 / N."""
    n = math.prod(shape)
    return ((rng.permutation(n) + 0.5 * rng.random(n)) / n).reshape(shape)


def relative_error(fd, an):
    return float(np.linalg.norm(np.ravel(fd - an)) / np.linalg.norm(np.ravel(an)))


@pytest.mark.parametrize("ndim,conn", CASES)
@pytest.mark.parametrize("scale", [3.0, 40.0, 400.0])
def test_pullback_matches_finite_differences(rng, ndim, conn, scale):
    shape = (2, 5, 6) if ndim == 2 else (3, 4, 4)
    image = distinct_image(rng, shape)
    T = 11
    t = np.linspace(-0.1, 1.1, T) + rng.uniform(-0.02, 0.02, T)  # gaps >= 0.08
    g = rng.standard_normal(shape[:len(shape) - ndim] + (T,))
    kw = dict(ndim=ndim, connectivity=conn)
    out, pullback = cutopo.vjp(soft_ecc, image, t, scale, **kw)
    d_image, d_t, d_scale = pullback(g)
    assert d_image.shape == image.shape and d_image.dtype == np.float64
    assert d_t.shape == t.shape and d_scale.shape == () and d_scale.dtype == np.float64

    def loss(img=image, th=t, s=scale):
        return float(np.sum(g * soft_ecc(img, th, s, **kw)))

    eps = 1e-4 / scale  # far below every gap of image and thresholds: no order changes
    fd = np.zeros(image.size)
    for i in range(image.size):
        e = np.zeros(image.size)
        e[i] = eps
        fd[i] = (loss(img=image + e.reshape(shape)) - loss(img=image - e.reshape(shape))) / (2 * eps)
    assert relative_error(fd, d_image.ravel()) < 1e-6

    fd_t = np.array([(loss(th=t + eps * np.eye(T)[k]) - loss(th=t - eps * np.eye(T)[k])) / (2 * eps)
                     for k in range(T)])
    assert relative_error(fd_t, d_t) < 1e-6

    h = 1e-5 * scale
    fd_s = (loss(s=scale + h) - loss(s=scale - h)) / (2 * h)
    assert relative_error(np.array([fd_s]), np.array([float(d_scale)])) < 1e-6


def test_pullback_with_0d_array_scale(rng):
    image = distinct_image(rng, (5, 5))
    t = np.linspace(0, 1, 7)
    scale = np.array(6.0)
    out, pullback = cutopo.vjp(soft_ecc, image, t, scale)
    _, _, d_scale = pullback(np.ones_like(out))
    h = 1e-6
    fd = (soft_ecc(image, t, 6.0 + h).sum() - soft_ecc(image, t, 6.0 - h).sum()) / (2 * h)
    assert isinstance(d_scale, np.ndarray) and d_scale.shape == () and d_scale.dtype == np.float64
    assert abs(float(d_scale) - fd) <= 1e-6 * max(1.0, abs(fd))


def test_wrt_restricts_computation(rng):
    image = distinct_image(rng, (6, 6))
    t = np.linspace(0, 1, 9)
    out, pullback = cutopo.vjp(soft_ecc, image, t, 5.0, wrt="image")
    g = rng.standard_normal(out.shape)
    d_image, d_t, d_scale = pullback(g)
    assert isinstance(d_image, np.ndarray) and d_t is None and d_scale is None
    full = cutopo.vjp(soft_ecc, image, t, 5.0)[1](g)
    np.testing.assert_allclose(d_image, full[0], rtol=0, atol=0)
    # the backward itself leaves out what it is not asked for
    spec = soft_ecc.__cutopo_op__
    _, residuals = spec.forward(image, t, 5.0)
    assert spec.backward(residuals, g, (False, True, False))[0::2] == (None, None)
    assert spec.backward(residuals, g, (False, False, False)) == (None, None, None)
    d = spec.backward(residuals, g, (False, False, True))
    assert d[0] is None and d[1] is None and np.isfinite(d[2])


def test_integer_image_gets_no_image_cotangent(rng):
    image = rng.integers(0, 5, size=(6, 6)).astype(np.uint8)
    t = np.array([0.5, 1.5, 2.5, 3.5])
    out, pullback = cutopo.vjp(soft_ecc, image, t, 4.0)
    d_image, d_t, d_scale = pullback(np.ones_like(out))
    assert d_image is None and d_t.shape == (4,) and np.isfinite(d_scale)


# ---------------------------------------------------------------------------------------------
# Pullback with a count: the thresholds move with the image's finite min and max


def central_differences(loss, image, eps):
    """d loss / d image by central differences, pixel by pixel (float64)."""
    fd = np.zeros(image.size)
    for i in range(image.size):
        e = np.zeros(image.size)
        e[i] = eps
        e = e.reshape(image.shape)
        fd[i] = (loss(image + e) - loss(image - e)) / (2 * eps)
    return fd.reshape(image.shape)


def count_shape(ndim, batched):
    return ((2,) if batched else ()) + ((4, 5) if ndim == 2 else (3, 4, 3))


def assert_matches_differences(rng, image, n, scale, kw):
    out, pullback = cutopo.vjp(soft_ecc, image, n, scale, **kw)
    g = rng.standard_normal(out.shape)
    d_image, d_t, d_scale = pullback(g)
    assert d_t is None and d_image.dtype == np.float64 and d_image.shape == image.shape
    # eps far below every gap of distinct_image: no pixel changes places, c stays put
    fd = central_differences(lambda x: float(np.sum(g * soft_ecc(x, n, scale, **kw))), image, 1e-6)
    np.testing.assert_allclose(d_image, fd, rtol=0, atol=1e-6 * max(1.0, np.abs(fd).max()))
    return d_image, g


@pytest.mark.parametrize("ndim,conn", CASES)
@pytest.mark.parametrize("batched", [False, True])
@pytest.mark.parametrize("boundary", ["box", "periodic"])
@pytest.mark.parametrize("n", [1, 2, 9])
def test_count_thresholds_pullback_matches_finite_differences(rng, ndim, conn, batched,
                                                               boundary, n):
    """Every pixel, the min and max included. A batch shares one range (linear_thresholds
    takes the min and max of the whole array), so its cotangent goes to one image."""
    image = distinct_image(rng, count_shape(ndim, batched))
    kw = dict(ndim=ndim, connectivity=conn, boundary=boundary)
    d_image, g = assert_matches_differences(rng, image, n, 6.0, kw)
    # only the min and max pixels differ from the pullback of the same thresholds held fixed
    fixed = cutopo.vjp(soft_ecc, image, cutopo.linear_thresholds(image, n), 6.0, **kw)[1](g)[0]
    extremes = [np.argmin(image), np.argmax(image)]
    extra = (d_image - fixed).reshape(-1)
    assert np.any(extra[extremes] != 0)
    extra[extremes] = 0
    assert np.all(extra == 0)


@pytest.mark.parametrize("ndim,conn", CASES)
def test_count_thresholds_pullback_leaves_out_nan_and_inf(rng, ndim, conn):
    """The range is that of the finite pixels, as in linear_thresholds: the extreme values
    made NaN, +inf and -inf move the range to the next pixels, which get its cotangent."""
    image = distinct_image(rng, count_shape(ndim, True))
    order = np.argsort(image, axis=None)
    image.reshape(-1)[order[[-1, -2, 0]]] = [np.nan, np.inf, -np.inf]
    kw = dict(ndim=ndim, connectivity=conn)
    d_image, _ = assert_matches_differences(rng, image, 9, 4.0, kw)
    assert np.all(d_image.reshape(-1)[order[[-1, -2, 0]]] == 0)


@pytest.mark.parametrize("ndim,conn", CASES)
def test_count_thresholds_pullback_with_ties(rng, ndim, conn):
    """Tied min and max pixels have no two-sided derivative there, but two identities hold
    whatever the tie rule: the count's curve does not change under
    image + a (the thresholds shift along) and image * a equals scale * a, so
    sum(d_image) = 0 and <image, d_image> = scale * d_scale. The range's cotangent goes to the
    first pixel (C order) attaining the min and the first attaining the max."""
    shape = count_shape(ndim, True)
    image = random_image(rng, shape, ties=True)
    free = np.setdiff1d(np.arange(image.size), [np.argmin(image), np.argmax(image)])[-2:]
    image.flat[free] = [image.min(), image.max()]  # surely tied at both ends
    n, scale = 9, 3.0
    kw = dict(ndim=ndim, connectivity=conn)
    out, pullback = cutopo.vjp(soft_ecc, image, n, scale, **kw)
    g = rng.standard_normal(out.shape)
    d_image, _, d_scale = pullback(g)
    size = np.abs(d_image).sum()
    assert abs(d_image.sum()) <= 1e-12 * size
    assert abs(np.sum(image * d_image) - scale * d_scale) <= 1e-12 * size * np.abs(image).max()

    t = cutopo.linear_thresholds(image, n)  # fixed thresholds: the same numbers otherwise
    fixed, d_t, _ = cutopo.vjp(soft_ecc, image, t, scale, **kw)[1](g)
    i_lo, i_hi = np.argmin(image), np.argmax(image)
    assert np.sum(image == image.flat[i_lo]) > 1 and np.sum(image == image.flat[i_hi]) > 1
    extra = (d_image - fixed).reshape(-1)
    slope = np.arange(n) / (n - 1)
    np.testing.assert_allclose(extra[[i_lo, i_hi]], [d_t @ (1 - slope), d_t @ slope], rtol=1e-12)
    extra[[i_lo, i_hi]] = 0
    assert np.all(extra == 0)


@pytest.mark.parametrize("ndim,conn", CASES)
def test_explicit_thresholds_image_cotangent_is_unchanged(rng, ndim, conn):
    """Explicit thresholds do not move with the image: its cotangent stays
    -scale c(p) sum_k g_k sigma'(scale (t_k - f(p))), at the min and max pixels too."""
    image = distinct_image(rng, count_shape(ndim, True))
    t = cutopo.linear_thresholds(image, 9)  # the count's thresholds, held fixed
    scale = 5.0
    out, pullback = cutopo.vjp(soft_ecc, image, t, scale, ndim=ndim, connectivity=conn)
    g = rng.standard_normal(out.shape)
    d_image = pullback(g)[0]
    c = cutopo.euler_contributions(image, ndim=ndim, connectivity=conn).astype(np.float64)
    s = sigmoid(scale * (t - image[..., None]))
    g_pixel = g.reshape(g.shape[:1] + (1,) * ndim + g.shape[1:])
    want = -scale * c * np.sum(g_pixel * s * (1 - s), axis=-1)
    np.testing.assert_allclose(d_image, want, rtol=0, atol=1e-12 * np.abs(want).max())


@pytest.mark.gpu
@pytest.mark.parametrize("boundary", ["box", "periodic"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_count_thresholds_pullback_on_gpu_matches_numpy(rng, boundary, dtype):
    """The CuPy path adds the range's cotangent on the device, as the NumPy path does."""
    import cupy as cp

    image = distinct_image(rng, (2, 6, 7))
    order = np.argsort(image, axis=None)
    image.reshape(-1)[order[[-1, 0]]] = np.nan  # the range is that of the finite pixels
    image = image.astype(dtype)
    kw = dict(ndim=2, boundary=boundary)
    out, pullback = cutopo.vjp(soft_ecc, image, 9, 5.0, **kw)
    _, pullback_g = cutopo.vjp(soft_ecc, cp.asarray(image), 9, 5.0, **kw)
    g = rng.standard_normal(out.shape).astype(out.dtype)
    want = pullback(g)[0]
    got = pullback_g(cp.asarray(g))[0]
    assert isinstance(got, cp.ndarray) and got.dtype == dtype
    tol = (1e-10 if dtype == np.float64 else 1e-4) * max(1.0, float(np.abs(want).max()))
    np.testing.assert_allclose(cp.asnumpy(got), want, rtol=0, atol=tol)


# ---------------------------------------------------------------------------------------------
# NaN / inf pixels


@pytest.mark.parametrize("ndim,conn", CASES)
def test_nan_and_inf_pixels(rng, ndim, conn):
    shape = shape_for(rng, ndim, True)
    image = random_image(rng, shape)
    mask = rng.random(shape)
    image[mask < 0.15] = np.nan
    image[(mask >= 0.15) & (mask < 0.2)] = np.inf
    image[(mask >= 0.2) & (mask < 0.25)] = -np.inf
    image.reshape(-1)[0] = np.nan  # at least one of each
    image.reshape(-1)[1] = np.inf
    image.reshape(-1)[2] = -np.inf
    finite = image[np.isfinite(image)]
    t = np.linspace(finite.min() - 0.5, finite.max() + 0.5, 15)
    for scale in (0.5, 8.0, 200.0):
        out, pullback = cutopo.vjp(soft_ecc, image, t, scale, ndim=ndim, connectivity=conn)
        assert np.all(np.isfinite(out))
        want = dense_soft(image, t, scale, ndim, conn)
        np.testing.assert_allclose(out, want, rtol=0, atol=1e-10)
        d_image, d_t, d_scale = pullback(rng.standard_normal(out.shape))
        assert np.all(np.isfinite(d_image)) and np.all(np.isfinite(d_t)) and np.isfinite(d_scale)
        assert np.all(d_image[~np.isfinite(image)] == 0)
    # count thresholds ignore NaN/inf too
    assert np.all(np.isfinite(soft_ecc(image, 9, 2.0, ndim=ndim, connectivity=conn)))


def test_all_nan_image_is_zero():
    image = np.full((4, 5), np.nan)
    np.testing.assert_array_equal(soft_ecc(image, np.array([0.0, 1.0]), 3.0), [0.0, 0.0])


# ---------------------------------------------------------------------------------------------
# Dtypes


@pytest.mark.parametrize("ndim,conn", CASES)
def test_float32_close_to_float64(rng, ndim, conn):
    shape = shape_for(rng, ndim, True)
    image = random_image(rng, shape).astype(np.float32)
    t = np.linspace(image.min(), image.max(), 12).astype(np.float32)
    g = rng.standard_normal(shape[:len(shape) - ndim] + (12,)).astype(np.float32)
    sum_c = abs_c_sum(image, ndim, conn)
    for scale in (0.5, 5.0, 50.0, 500.0):
        out32, pb32 = cutopo.vjp(soft_ecc, image, t, scale, ndim=ndim, connectivity=conn)
        out64, pb64 = cutopo.vjp(soft_ecc, image.astype(np.float64), t.astype(np.float64), scale,
                                 ndim=ndim, connectivity=conn)
        assert out32.dtype == np.float32 and out64.dtype == np.float64
        assert np.all(np.abs(out32 - out64) <= 1e-6 * sum_c + 1e-6)
        g32, g64 = pb32(g), pb64(g.astype(np.float64))
        # d_scale is one sum of terms of both signs: allow it more cancellation error
        for a, b, rtol in zip(g32, g64, (1e-4, 1e-4, 1e-3)):
            assert a.dtype == np.float32
            assert np.linalg.norm(np.ravel(a - b)) <= rtol * np.linalg.norm(np.ravel(b)) + 1e-6


def test_computation_dtype_rules(rng):
    f64 = random_image(rng, (5, 6))
    f32, f16 = f64.astype(np.float32), f64.astype(np.float16)
    u8 = rng.integers(0, 9, size=(5, 6)).astype(np.uint8)
    t32 = np.linspace(-1, 1, 5).astype(np.float32)
    t64 = t32.astype(np.float64)
    assert soft_ecc(f32, t32, 2.0).dtype == np.float32
    assert soft_ecc(f16, t32, 2.0).dtype == np.float32
    assert soft_ecc(u8, 4, 2.0).dtype == np.float32
    assert soft_ecc(np.ones((3, 3), bool), 2, 2.0).dtype == np.float32
    assert soft_ecc(f32, 5, 2.0).dtype == np.float32
    assert soft_ecc(f64, t32, 2.0).dtype == np.float64
    assert soft_ecc(f32, t64, 2.0).dtype == np.float64
    assert soft_ecc(f32, t32, np.float64(2.0)).dtype == np.float64
    assert soft_ecc(f32, t32, np.array(2.0)).dtype == np.float64
    assert soft_ecc(f32, t32, np.float32(2.0)).dtype == np.float32
    assert soft_ecc(f32, t32, 2).dtype == np.float32
    # cotangents take their argument's dtype
    out, pullback = cutopo.vjp(soft_ecc, f16, t32, np.float32(2.0))
    d_image, d_t, d_scale = pullback(np.ones_like(out))
    assert d_image.dtype == np.float16 and d_t.dtype == np.float32 and d_scale.dtype == np.float32


# ---------------------------------------------------------------------------------------------
# Errors


def test_bad_scale(rng):
    image = random_image(rng, (4, 4))
    t = np.linspace(-1, 1, 5)
    for bad in (0.0, -1.0, float("nan"), float("inf"), -np.inf, np.array(0.0), -2):
        with pytest.raises(ValueError, match="scale"):
            soft_ecc(image, t, bad)
    with pytest.raises(ValueError, match="scale"):
        soft_ecc(image.astype(np.float32), t.astype(np.float32), 1e300)  # overflows float32
    for bad in ("2.0", 1j, None, True, [2.0], np.array(2 + 0j)):
        with pytest.raises(TypeError, match="scale"):
            soft_ecc(image, t, bad)
    with pytest.raises(ValueError, match="scale"):
        soft_ecc(image, t, np.array([2.0]))


def test_bad_thresholds(rng):
    image = random_image(rng, (4, 4))
    for bad in (np.array([1.0, 0.0]), np.array([0.0, np.nan]), np.array([0.0, np.inf]),
                np.zeros((2, 2)), np.array([]), 0):
        with pytest.raises(ValueError, match="thresholds"):
            soft_ecc(image, bad, 1.0)
    with pytest.raises(TypeError, match="thresholds"):
        soft_ecc(image, 0.5, 1.0)
    with pytest.raises(TypeError, match="thresholds"):
        soft_ecc(image, np.array(["a", "b"]), 1.0)


def test_bad_image_and_connectivity(rng):
    with pytest.raises(ValueError, match="image"):
        soft_ecc(np.zeros(5), np.array([0.0]), 1.0)
    with pytest.raises(TypeError, match="image"):
        soft_ecc(np.zeros((3, 3), dtype=np.int64), np.array([0.0]), 1.0)
    with pytest.raises(ValueError, match="connectivity"):
        soft_ecc(random_image(rng, (3, 3)), np.array([0.0]), 1.0, connectivity=3)


def test_device_scale_with_host_image_is_refused(monkeypatch, rng):
    image = random_image(rng, (4, 4))
    scale = np.array(2.0)
    monkeypatch.setattr(_checks, "is_cupy_array", lambda x: x is scale)  # stands for a CuPy scalar
    with pytest.raises(TypeError, match="scale is a CuPy array but image is not"):
        soft_ecc(image, np.array([0.0]), scale)


# ---------------------------------------------------------------------------------------------
# Documentation


def test_docstring_examples():
    result = doctest.testmod(importlib.import_module("cutopo._soft_ecc"), verbose=False, report=True)
    assert result.attempted > 0
    assert result.failed == 0


def test_registered():
    from cutopo.vjp import REGISTRY

    spec = REGISTRY["soft_ecc"]
    assert spec is soft_ecc.__cutopo_op__
    assert spec.arg_names == ("image", "thresholds", "scale")
    assert spec.differentiable == {"image", "thresholds", "scale"}

