"""CPU tests of the Euler characteristic transform (cutopo._ect: ect, soft_ect, heights).

Expected values come from cutopo.ecc applied to ``where(mask, heights, inf)`` (the definition
of the ECT, tested on its own in test_ecc.py), from skimage.measure.euler_number, from closed
forms (solid boxes) and from central finite differences, never from the ops under test.
"""
from __future__ import annotations

import doctest
import importlib
import warnings

import numpy as np
import pytest
from skimage.measure import euler_number

import cutopo
from cutopo import _band_numpy, _checks, _ect
from cutopo._ect import ect, heights, soft_ect

CONNS = [(2, 1), (2, 2), (3, 1), (3, 3)]


# ---------------------------------------------------------------------------------------------
# Random inputs and the reference


def random_mask(rng, batch, spatial):
    """Random foreground; every image of the batch gets at least one foreground pixel."""
    shape = tuple(batch) + tuple(spatial)
    mask = rng.random(shape) < rng.uniform(0.3, 0.8)
    flat = mask.reshape((-1, int(np.prod(spatial))))
    flat[np.arange(flat.shape[0]), rng.integers(0, flat.shape[1], size=flat.shape[0])] = True
    return flat.reshape(shape)


def random_directions(rng, count, ndim):
    """A mix of generic, axis-aligned, zero-component (also -0.0), diagonal and integer rows."""
    rows = []
    for _ in range(count):
        kind = rng.integers(0, 5)
        if kind == 0:
            v = rng.normal(size=ndim)
        elif kind == 1:  # axis-aligned, either sign
            v = np.zeros(ndim)
            v[rng.integers(ndim)] = rng.choice([-1.0, 1.0]) * rng.uniform(0.2, 3.0)
        elif kind == 2:  # some zero components, some -0.0
            v = rng.normal(size=ndim)
            zero = rng.random(ndim) < 0.5
            zero[rng.integers(ndim)] = False
            v[zero] = rng.choice([0.0, -0.0], size=int(zero.sum()))
        elif kind == 3:  # diagonals: many tied heights
            v = rng.choice([-1.0, 1.0], size=ndim)
        else:  # small integers: ties too
            v = rng.integers(-3, 4, size=ndim).astype(float)
            if not v.any():
                v[0] = 1.0
        rows.append(v)
    return np.array(rows)


def reference(mask, directions, thresholds, connectivity):
    """cutopo.ecc of where(mask, h, inf) for every direction, stacked as (*batch, D, T)."""
    ndim = directions.shape[1]
    spatial = mask.shape[mask.ndim - ndim:]
    curves = [cutopo.ecc(np.where(mask, heights(spatial, v), np.inf), thresholds, ndim=ndim,
                         connectivity=connectivity) for v in directions]
    return np.stack(curves, axis=-2)


def random_thresholds(rng, mask, directions, count):
    """Sorted thresholds: half of them equal to computed pixel heights, the rest random."""
    ndim = directions.shape[1]
    spatial = mask.shape[mask.ndim - ndim:]
    hs = np.concatenate([heights(spatial, v).ravel() for v in directions])
    r = float(np.max(np.abs(hs)))
    exact = rng.choice(hs, size=count // 2)
    free = rng.uniform(-1.2 * r - 0.1, 1.2 * r + 0.1, size=count - count // 2)
    return np.sort(np.concatenate([exact, free]))


def random_spatial(rng, ndim):
    hi = 12 if ndim == 2 else 6
    return tuple(int(n) for n in rng.integers(1, hi, size=ndim))


# ---------------------------------------------------------------------------------------------
# heights and the position convention


def test_heights_convention(rng):
    for ndim in (2, 3):
        for _ in range(5):
            spatial = random_spatial(rng, ndim)
            v = rng.normal(size=ndim)
            h = heights(spatial, v)
            assert h.shape == spatial and h.dtype == np.float64
            m = max(spatial)
            s = 2.0 / (m - 1) if m > 1 else 1.0
            idx = np.indices(spatial, dtype=np.float64)
            expected = sum((idx[a] - (spatial[a] - 1) / 2) * s * v[a] for a in range(ndim))
            np.testing.assert_allclose(h, expected, rtol=1e-13, atol=1e-13)
    # the longest axis spans [-1, 1] exactly; a single pixel sits at 0
    h = heights((5, 3), [1.0, 0.0])
    assert h[0, 0] == -1.0 and h[-1, 0] == 1.0 and h[2, 1] == 0.0
    np.testing.assert_array_equal(heights((3, 5), [0.0, 1.0])[:, 0], [-1.0, -1.0, -1.0])
    assert heights((1, 1), [2.0, 3.0]).tolist() == [[0.0]]


# ---------------------------------------------------------------------------------------------
# ect: exact equality with the ECC of the masked heights


@pytest.mark.parametrize("ndim,conn", CONNS)
def test_ect_equals_ecc_of_masked_heights(rng, ndim, conn):
    for trial in range(6):
        batch = [(), (3,), (2, 2)][trial % 3]
        spatial = random_spatial(rng, ndim)
        mask = random_mask(rng, batch, spatial)
        directions = random_directions(rng, int(rng.integers(1, 10)), ndim)
        t = random_thresholds(rng, mask, directions, int(rng.integers(1, 14)))
        out = ect(mask, directions, t, connectivity=conn)
        assert out.dtype == np.int64
        assert out.shape == tuple(batch) + (directions.shape[0], t.size)
        np.testing.assert_array_equal(out, reference(mask, directions, t, conn))


@pytest.mark.parametrize("ndim,conn", CONNS)
def test_ect_matches_skimage(rng, ndim, conn):
    spatial = (9, 11) if ndim == 2 else (5, 6, 4)
    mask = random_mask(rng, (), spatial)
    directions = random_directions(rng, 4, ndim)
    t = random_thresholds(rng, mask, directions, 6)
    out = ect(mask, directions, t, connectivity=conn)
    for d, v in enumerate(directions):
        h = heights(spatial, v)
        expected = [euler_number(np.pad(mask & (h <= tk), 1), connectivity=conn) for tk in t]
        np.testing.assert_array_equal(out[d], expected)


@pytest.mark.parametrize("ndim,conn", CONNS)
def test_ect_count_thresholds(rng, ndim, conn):
    spatial = random_spatial(rng, ndim)
    mask = random_mask(rng, (2,), spatial)
    directions = random_directions(rng, 5, ndim)
    n = int(rng.integers(1, 12))
    reach = max(float(np.max(np.abs(heights(spatial, v)))) for v in directions)
    t = np.linspace(-reach, reach, n)
    out = ect(mask, directions, n, connectivity=conn)
    np.testing.assert_array_equal(out, reference(mask, directions, t, conn))
    np.testing.assert_array_equal(out, ect(mask, directions, np.int64(n), connectivity=conn))
    # the last threshold, R (n >= 2), reaches every pixel: the Euler characteristic of the mask
    for b in range(2 if n > 1 else 0):
        chi = euler_number(np.pad(mask[b], 1), connectivity=conn)
        np.testing.assert_array_equal(out[b, :, -1], chi)


def test_ect_threshold_dtypes_and_integer_mask(rng):
    mask = random_mask(rng, (), (7, 8))
    directions = random_directions(rng, 4, 2)
    t = random_thresholds(rng, mask, directions, 8)
    expected = ect(mask, directions, t)
    np.testing.assert_array_equal(ect(mask, directions, list(t)), expected)
    t32 = t.astype(np.float32)
    np.testing.assert_array_equal(ect(mask, directions, t32), reference(mask, directions, t32, 1))
    ti = np.array([-2, -1, 0, 0, 1, 2])
    np.testing.assert_array_equal(ect(mask, directions, ti), reference(mask, directions, ti, 1))
    as_int = mask.astype(np.uint8) * rng.integers(1, 5, size=mask.shape).astype(np.uint8)
    np.testing.assert_array_equal(ect(as_int, directions, t), expected)
    np.testing.assert_array_equal(ect(as_int.astype(np.int32), directions.tolist(), t), expected)


@pytest.mark.parametrize("ndim,conn", CONNS)
def test_ect_directions_within_one_orthant_scale(rng, ndim, conn):
    """Scaling a direction by 4 scales its heights (up to rounding): same ECT at 4 t."""
    spatial = random_spatial(rng, ndim)
    mask = random_mask(rng, (), spatial)
    v = rng.integers(-3, 4, size=(1, ndim)).astype(float)
    v[0, 0] = 1.0
    # heights are integer multiples of 1 / (max n - 1): thresholds half way between them
    unit = 1.0 / max(max(spatial) - 1, 1)
    t = (np.arange(-80, 81) + 0.5) * unit
    np.testing.assert_array_equal(ect(mask, v, t, connectivity=conn),
                                  ect(mask, 4.0 * v, 4.0 * t, connectivity=conn))


@pytest.mark.parametrize("ndim,conn", CONNS)
def test_ect_solid_box(rng, ndim, conn):
    for _ in range(5):
        spatial = random_spatial(rng, ndim)
        mask = np.ones(spatial, dtype=bool)
        directions = random_directions(rng, 6, ndim)
        for d, v in enumerate(directions):
            h = heights(spatial, v)
            lo, hi = float(h.min()), float(h.max())
            t = np.array([lo - 1.0, np.nextafter(lo, -np.inf), lo, (lo + hi) / 2,
                          np.nextafter(hi, -np.inf), hi, hi + 1.0])
            out = ect(mask, v[None], np.sort(t), connectivity=conn)[0]
            expected = (np.sort(t) >= lo).astype(np.int64)
            np.testing.assert_array_equal(out, expected)
            assert out[-2] == 1 and out[-1] == 1  # from the max corner height on
            # and the max height sits at the corner matching sign(v) (0 counts as +)
            corner = tuple(n - 1 if c >= 0 else 0 for n, c in zip(spatial, v))
            assert h[corner] == hi


@pytest.mark.parametrize("ndim,conn", CONNS)
def test_ect_chunking(rng, monkeypatch, ndim, conn):
    """Tiny chunk sizes (images, directions, entries, blocks) give the same results."""
    spatial = random_spatial(rng, ndim)
    mask = random_mask(rng, (3,), spatial)
    directions = random_directions(rng, 7, ndim)
    t = random_thresholds(rng, mask, directions, 9)
    hard = ect(mask, directions, t, connectivity=conn)
    soft, pull = cutopo.vjp(soft_ect, mask, directions, t, 3.0, connectivity=conn)
    g = rng.normal(size=soft.shape)
    grads = pull(g)
    monkeypatch.setattr(_ect, "_PASS_ELEMENTS", 5)
    monkeypatch.setattr(_ect, "_ENTRIES", 3)
    monkeypatch.setattr(_band_numpy, "_CHUNK_ENTRIES", 7)
    np.testing.assert_array_equal(ect(mask, directions, t, connectivity=conn), hard)
    soft2, pull2 = cutopo.vjp(soft_ect, mask, directions, t, 3.0, connectivity=conn)
    np.testing.assert_allclose(soft2, soft, rtol=1e-12, atol=1e-12)
    for a, b in zip(pull2(g)[1:], grads[1:]):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)


def test_ect_empty_batch():
    out = ect(np.zeros((0, 4, 4), dtype=bool), [[1.0, 0.0]], [0.0, 1.0])
    assert out.shape == (0, 1, 2) and out.dtype == np.int64


# ---------------------------------------------------------------------------------------------
# soft_ect


@pytest.mark.parametrize("ndim,conn", CONNS)
def test_soft_ect_tends_to_ect(rng, ndim, conn):
    spatial = random_spatial(rng, ndim)
    mask = random_mask(rng, (2,), spatial)
    directions = random_directions(rng, 5, ndim)
    hs = np.unique(np.concatenate([heights(spatial, v).ravel() for v in directions]))
    # thresholds half way between consecutive heights at least 1e-6 apart (and beyond both ends)
    wide = np.flatnonzero(np.diff(hs) > 1e-6)
    mids = np.concatenate([[hs[0] - 1.0], (hs[wide] + hs[wide + 1]) / 2, [hs[-1] + 1.0]])
    t = np.sort(rng.choice(mids, size=min(10, mids.size), replace=False))
    gap = float(np.min(np.abs(t[:, None] - hs[None, :])))
    assert gap > 0
    hard = ect(mask, directions, t, connectivity=conn)
    errors = []
    for u in (2.0, 10.0, 40.0):
        soft = soft_ect(mask, directions, t, u / gap, connectivity=conn)
        assert soft.dtype == np.float64 and soft.shape == hard.shape
        errors.append(float(np.max(np.abs(soft - hard))))
    assert errors[-1] < 1e-9
    assert errors[0] > errors[-1] or errors[0] < 1e-9


@pytest.mark.parametrize("ndim,conn", CONNS)
def test_soft_ect_equals_the_per_cell_relaxation(rng, ndim, conn):
    """Each direction's curve is the sum over the cells of the height image where(mask, h,
    inf) of (-1)^dim sigmoid(scale (t - h(cell))) (oracles.cells), at small, moderate and
    large scales: the band-limited evaluation loses nothing visible in float64."""
    from oracles import cells

    spatial = random_spatial(rng, ndim)
    mask = random_mask(rng, (2,), spatial)
    directions = random_directions(rng, 4, ndim)
    t = random_thresholds(rng, mask, directions, 12)
    for scale in (0.7, 5.0, 60.0):
        got = soft_ect(mask, directions, t, scale, connectivity=conn)
        assert got.dtype == np.float64
        for b in range(2):
            for d, v in enumerate(directions):
                values, present, dims = cells(np.where(mask[b], heights(spatial, v), np.inf),
                                              np.float64, conn)
                sign = np.where(dims[present] % 2 == 1, -1.0, 1.0)
                u = scale * (np.asarray(t, np.float64)[None, :] - values[present][:, None])
                e = np.exp(-np.abs(u))
                s = np.where(u >= 0, 1 / (1 + e), e / (1 + e))
                want = (sign[:, None] * s).sum(axis=0)
                np.testing.assert_allclose(got[b, d], want, rtol=1e-9, atol=1e-9)


def _fd_setup(rng, ndim, conn, count_thresholds=False):
    """Generic inputs whose contribution maps do not change when a direction moves by +-EPS_V or
    +-EPS_V / 2 along one component (so the finite differences see a smooth function)."""
    spatial = (7, 6) if ndim == 2 else (4, 5, 3)
    mask = random_mask(rng, (2,), spatial)
    for _ in range(50):
        directions = rng.normal(size=(3, ndim))
        if np.min(np.abs(directions)) < 1e-2:
            continue
        maps = [cutopo.euler_contributions(np.where(mask, heights(spatial, v), np.inf), ndim=ndim,
                                           connectivity=conn) for v in directions]
        stable = True
        for d in range(3):
            for a in range(ndim):
                for s in (-EPS_V, -EPS_V / 2, EPS_V / 2, EPS_V):
                    w = directions[d].copy()
                    w[a] += s
                    c = cutopo.euler_contributions(np.where(mask, heights(spatial, w), np.inf),
                                                   ndim=ndim, connectivity=conn)
                    stable &= np.array_equal(c, maps[d])
        if count_thresholds:
            reach = [float(np.max(np.abs(heights(spatial, v)))) for v in directions]
            top = np.sort(reach)
            stable &= top[-1] - top[-2] > 1e-3
        if stable:
            break
    else:  # pragma: no cover - vanishingly unlikely
        pytest.skip("no direction set with stable contribution maps found")
    return mask, directions


EPS_V = 1e-5   # direction steps: small, so that no height order changes
EPS_T = 1e-3   # threshold and scale steps: nothing discontinuous depends on them


def _fd(f, x, eps):
    """Richardson-extrapolated central differences of the scalar f at the array x: O(eps^4)."""
    x = np.asarray(x, dtype=np.float64)
    out = np.zeros(x.shape)
    for idx in np.ndindex(*x.shape):
        def cd(h):
            e = np.zeros(x.shape)
            e[idx] = h
            return (f(x + e) - f(x - e)) / (2 * h)
        out[idx] = (4 * cd(eps / 2) - cd(eps)) / 3
    return out


def _rel_err(a, b):
    return float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), 1e-8))


@pytest.mark.parametrize("ndim,conn", CONNS)
def test_soft_ect_vjp_matches_finite_differences(rng, ndim, conn):
    mask, directions = _fd_setup(rng, ndim, conn)
    spatial = mask.shape[1:]
    reach = max(float(np.max(np.abs(heights(spatial, v)))) for v in directions)
    t = np.sort(rng.uniform(-reach, reach, size=7))
    while np.min(np.diff(t)) < 2 * EPS_T:  # the moved thresholds must stay sorted
        t = np.sort(rng.uniform(-reach, reach, size=7))
    scale = float(rng.uniform(2.0, 8.0))
    out, pullback = cutopo.vjp(soft_ect, mask, directions, t, scale, connectivity=conn)
    g = rng.normal(size=out.shape)
    d_mask, d_dirs, d_t, d_scale = pullback(g)
    assert d_mask is None
    assert d_dirs.shape == directions.shape and d_t.shape == t.shape and d_scale.shape == ()

    def f(dirs, tt, sc):
        return float(np.sum(g * soft_ect(mask, dirs, tt, float(sc), connectivity=conn)))

    fd_dirs = _fd(lambda x: f(x, t, scale), directions, EPS_V)
    fd_t = _fd(lambda x: f(directions, x, scale), t, EPS_T)
    fd_scale = _fd(lambda x: f(directions, t, x), scale, EPS_T)
    assert _rel_err(d_dirs, fd_dirs) < 1e-6
    assert _rel_err(d_t, fd_t) < 1e-6
    assert _rel_err(np.asarray(d_scale), fd_scale) < 1e-6


@pytest.mark.parametrize("ndim,conn", [(2, 1), (3, 3)])
def test_soft_ect_vjp_count_thresholds_move_with_directions(rng, ndim, conn):
    mask, directions = _fd_setup(rng, ndim, conn, count_thresholds=True)
    scale = float(rng.uniform(2.0, 6.0))
    out, pullback = cutopo.vjp(soft_ect, mask, directions, 6, scale, connectivity=conn)
    g = rng.normal(size=out.shape)
    _, d_dirs, d_t, _ = pullback(g)
    assert d_t is None  # a count is not differentiable

    def f(dirs):
        return float(np.sum(g * soft_ect(mask, dirs, 6, scale, connectivity=conn)))

    assert _rel_err(d_dirs, _fd(f, directions, EPS_V)) < 1e-6


def test_soft_ect_vjp_wrt_and_dtypes(rng):
    mask = random_mask(rng, (), (6, 7))
    directions = rng.normal(size=(3, 2))
    t = np.sort(rng.uniform(-1, 1, size=5))
    out, pullback = cutopo.vjp(soft_ect, mask, directions, t, 4.0, wrt="scale")
    d = pullback(np.ones_like(out))
    assert d[0] is None and d[1] is None and d[2] is None and d[3].shape == ()
    _, full = cutopo.vjp(soft_ect, mask, directions, t, 4.0)
    np.testing.assert_allclose(d[3], full(np.ones_like(out))[3])
    # computation dtype
    d32, t32 = directions.astype(np.float32), t.astype(np.float32)
    assert soft_ect(mask, d32, t32, 4.0).dtype == np.float32
    assert soft_ect(mask, d32, t32, np.float32(4.0)).dtype == np.float32
    assert soft_ect(mask, d32, 5, 4.0).dtype == np.float32
    assert soft_ect(mask, d32, t32, np.float64(4.0)).dtype == np.float64
    assert soft_ect(mask, directions, t32, 4.0).dtype == np.float64
    assert soft_ect(mask, d32, t, 4.0).dtype == np.float64
    np.testing.assert_allclose(soft_ect(mask, d32, t32, 4.0),
                               soft_ect(mask, d32.astype(np.float64), t32.astype(np.float64), 4.0),
                               rtol=1e-5, atol=1e-5)
    out32, pull32 = cutopo.vjp(soft_ect, mask, d32, t32, np.array(4.0, dtype=np.float32))
    g32 = pull32(np.ones_like(out32))
    assert g32[1].dtype == np.float32 and g32[2].dtype == np.float32 and g32[3].shape == ()


def test_soft_ect_registered():
    from cutopo.vjp import REGISTRY
    spec = REGISTRY["soft_ect"]
    assert spec.arg_names == ("mask", "directions", "thresholds", "scale")
    assert spec.differentiable == frozenset({"directions", "thresholds", "scale"})
    assert soft_ect.__cutopo_op__ is spec
    assert not hasattr(ect, "__cutopo_op__")


# ---------------------------------------------------------------------------------------------
# Errors


def _both(fn):
    """Run a check on ect and soft_ect."""
    fn(lambda m, d, t, **kw: ect(m, d, t, **kw))
    fn(lambda m, d, t, **kw: soft_ect(m, d, t, 2.0, **kw))


def test_errors_directions():
    mask = np.ones((4, 4), dtype=bool)

    def check(op):
        for bad, exc in [([[1.0, 0.0], [0.0, 0.0]], ValueError),   # zero row
                         ([[1.0, 0.0, 0.0, 1.0]], ValueError),     # wrong width
                         ([[1.0]], ValueError),
                         ([1.0, 0.0], ValueError),                 # 1-D
                         (np.zeros((0, 2)), ValueError),           # no direction
                         ([[np.nan, 1.0]], ValueError),
                         ([[np.inf, 1.0]], ValueError),
                         ([[1e308, 1e308]], ValueError),           # heights overflow
                         (np.array([[True, False]]), TypeError),
                         ([["a", "b"]], TypeError)]:
            with pytest.raises(exc, match="directions"):
                op(mask, bad, [0.0])

    _both(check)


def test_directions_near_the_overflow_bound(rng):
    """Directions whose sum of |v_a| exceeds the cheap bound (1e300) take the exact overflow
    check: finite heights pass, and scaling directions and thresholds by 2^1000 (exact in
    float64) leaves the ECT unchanged."""
    mask = rng.random((2, 9, 11)) < 0.6
    t = np.linspace(-1.5, 1.5, 13)
    want = ect(mask, [[1.0, -0.5], [0.25, 1.0]], t)
    got = ect(mask, [[2.0 ** 1000, -(2.0 ** 999)], [2.0 ** 998, 2.0 ** 1000]], t * 2.0 ** 1000)
    np.testing.assert_array_equal(got, want)
    # |h| up to R = 1.5 * 2^1023 = 1.35e308: finite, so accepted (1e308, 1e308 is refused:
    # test_errors_directions); a count of thresholds then spans [-R, R] although 2 R
    # overflows: finite thresholds, the whole mask's Euler number at t = R
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        curve = ect(mask, [[2.0 ** 1023, 2.0 ** 1022]], 3)
    np.testing.assert_array_equal(curve[:, 0, 2], [euler_number(np.pad(m, 1), connectivity=1)
                                                   for m in mask])


def test_errors_thresholds():
    mask = np.ones((4, 4), dtype=bool)

    def check(op):
        for bad, exc in [([1.0, 0.0], ValueError),        # unsorted
                         ([0.0, np.nan], ValueError),
                         ([0.0, np.inf], ValueError),
                         ([[0.0, 1.0]], ValueError),       # 2-D
                         ([], ValueError),
                         (0, ValueError),                  # count < 1
                         (1.5, TypeError),                 # a float is neither
                         (["a"], TypeError)]:
            with pytest.raises(exc, match="thresholds"):
                op(mask, [[1.0, 0.0]], bad)

    _both(check)


def test_errors_mask_and_connectivity():
    def check(op):
        with pytest.raises(ValueError, match="mask"):
            op(np.ones(5, dtype=bool), [[1.0, 0.0]], [0.0])
        with pytest.raises(ValueError, match="mask"):
            op(np.ones((4, 4), dtype=bool), [[1.0, 0.0, 0.0]], [0.0])
        with pytest.raises(ValueError, match="mask"):
            op(np.ones((4, 0), dtype=bool), [[1.0, 0.0]], [0.0])
        with pytest.raises(TypeError, match="mask"):
            op(np.ones((4, 4)), [[1.0, 0.0]], [0.0])
        with pytest.raises(ValueError, match="connectivity"):
            op(np.ones((4, 4), dtype=bool), [[1.0, 0.0]], [0.0], connectivity=3)
        with pytest.raises(TypeError, match="connectivity"):
            op(np.ones((4, 4), dtype=bool), [[1.0, 0.0]], [0.0], connectivity=1.0)

    _both(check)


def test_errors_scale():
    mask = np.ones((4, 4), dtype=bool)
    for bad in (0.0, -1.0, np.nan, np.inf, np.float32(0.0)):
        with pytest.raises(ValueError, match="scale"):
            soft_ect(mask, [[1.0, 0.0]], [0.0], bad)
    with pytest.raises(ValueError, match="scale"):
        soft_ect(mask, [[1.0, 0.0]], [0.0], np.array([1.0, 2.0]))
    with pytest.raises(ValueError, match="scale"):
        soft_ect(mask, np.float32([[1.0, 0.0]]), np.float32([0.0]), 1e39)  # inf in float32
    for bad in (True, "1", None):
        with pytest.raises(TypeError, match="scale"):
            soft_ect(mask, [[1.0, 0.0]], [0.0], bad)


def test_device_arguments_with_a_host_mask_are_refused(monkeypatch):
    """Without a GPU: pretend that one of directions, thresholds, scale is a CuPy array."""
    mask, dirs = np.ones((4, 4), dtype=bool), np.array([[1.0, 0.0]])
    t, scale = np.array([0.0]), np.array(2.0)
    names = ("mask", "directions", "thresholds", "scale")
    for i in (1, 2, 3):
        args = [mask, dirs, t, scale]
        fake = args[i]
        monkeypatch.setattr(_checks, "is_cupy_array", lambda x, fake=fake: x is fake)
        with pytest.raises(TypeError, match=f"soft_ect: {names[i]} is a CuPy array but mask is not"):
            soft_ect(*args)
        if i < 3:
            with pytest.raises(TypeError, match=f"ect: {names[i]} is a CuPy array but mask"):
                ect(*args[:3])


def test_doctests():
    result = doctest.testmod(importlib.import_module("cutopo._ect"), verbose=False, report=True)
    assert result.attempted > 0
    assert result.failed == 0


def test_device_plan_size_limits():
    """SoftEctPlan (the soft ECT's device-argument path) takes small calls only: its entries are
    sized for the worst case and its compaction sums tile counts per block."""
    from cutopo import _band_cupy

    assert _band_cupy.fits_device_plan(1, (512, 512))
    assert _band_cupy.fits_device_plan(2, (512, 512))        # 8 maps of 2^18: the slot bound
    assert not _band_cupy.fits_device_plan(1, (1024, 1024))
    assert _band_cupy.fits_device_plan(1, (64, 64, 64))
    assert not _band_cupy.fits_device_plan(60000, (4, 4))    # few slots, too many tiles
    assert not _band_cupy.fits_device_plan(0, (8, 8))
