"""CPU tests of cutopo.deformable.deformable_aggregation (the NumPy path) and its VJP.

Expected values come from a straightforward loop over (b, a, p, k, s, c) written here from the
contract (cutopo/deformable.py, research/deformable.md 1.1), and from central finite
differences of the forward in float64.
"""
from __future__ import annotations

import doctest
import importlib
import math

import numpy as np
import pytest

import cutopo
from cutopo._cuda.repeated import RepeatedCalls
from cutopo.deformable import deformable_aggregation
from deformable_cases import map_layout

# ---------------------------------------------------------------------------------------------
# Independent reference


def loop_reference(features, shapes, starts, loc, weights, boundary):
    """The op by the formula, one output element at a time, in float64."""
    features = np.asarray(features, dtype=np.float64)
    bs, num_feat, C = features.shape
    _, A, P, K, _ = loc.shape
    S, G = weights.shape[4], weights.shape[5]
    out = np.zeros((bs, A, C))
    for b in range(bs):
        for a in range(A):
            for p in range(P):
                for k in range(K):
                    u, v = float(loc[b, a, p, k, 0]), float(loc[b, a, p, k, 1])
                    if boundary == "sparse4d" and not (0 < u < 1 and 0 < v < 1):
                        continue
                    for s in range(S):
                        H, W = int(shapes[k, s, 0]), int(shapes[k, s, 1])

                        def pixel(yy, xx, c):
                            if 0 <= yy < H and 0 <= xx < W:
                                return features[b, starts[k, s] + yy * W + xx, c]
                            return 0.0

                        x, y = u * W - 0.5, v * H - 0.5
                        if not (x > -1 and x < W and y > -1 and y < H):
                            continue  # all four corners outside: zero padding reads 0
                        x0, y0 = math.floor(x), math.floor(y)
                        lx, ly = x - x0, y - y0
                        for c in range(C):
                            g = c // (C // G)
                            val = ((1 - ly) * (1 - lx) * pixel(y0, x0, c) + (1 - ly) * lx * pixel(y0, x0 + 1, c)
                                   + ly * (1 - lx) * pixel(y0 + 1, x0, c) + ly * lx * pixel(y0 + 1, x0 + 1, c))
                            out[b, a, c] += float(weights[b, a, p, k, s, g]) * val
    return out


def make_problem(rng, bs=2, A=3, P=4, K=2, shapes=((5, 7), (3, 4)), C=8, G=2, dtype=np.float64,
                 spread=(-0.15, 1.15), gap=0):
    """Flattened features with camera-major maps (optionally ``gap`` unused rows between maps),
    locations in ``spread`` (some outside the image), random weights."""
    S = len(shapes)
    sh, starts, num_feat = map_layout(shapes, K, gap, other=1)  # cameras of different sizes
    feats = rng.standard_normal((bs, num_feat, C)).astype(dtype)
    loc = rng.uniform(*spread, size=(bs, A, P, K, 2)).astype(dtype)
    w = rng.standard_normal((bs, A, P, K, S, G)).astype(dtype)
    return feats, sh, starts, loc, w


def safe_locations(rng, shape, shapes, margin=0.08):
    """Locations whose x = u W - 1/2 (y likewise) stay ``margin`` pixels away from every integer
    (pixel centres: kinks of the bilinear interpolant) at every scale, and inside (0, 1) away
    from the image edges: finite differences there see one smooth (bilinear) piece."""
    K = shapes.shape[0]
    out = np.empty(shape)
    flat = out.reshape(-1, K, 2)
    for i in range(flat.shape[0]):
        for k in range(K):
            for axis, dim in ((0, 1), (1, 0)):  # u against W, v against H
                while True:
                    t = rng.uniform(0.05, 0.95)
                    frac = [((t * n - 0.5) % 1.0) for n in shapes[k, :, dim]]
                    if all(margin < f < 1 - margin for f in frac):
                        break
                flat[i, k, axis] = t
    return out


# ---------------------------------------------------------------------------------------------
# Forward against the loop


@pytest.mark.parametrize("boundary", ["sparse4d", "zeros"])
@pytest.mark.parametrize("C,G", [(8, 2), (6, 3), (4, 1), (5, 5)])
def test_forward_matches_loop(rng, boundary, C, G):
    feats, sh, starts, loc, w = make_problem(rng, C=C, G=G, gap=1)
    # Points exactly on the edges and half a pixel outside: the two modes differ there.
    loc[0, 0, 0, 0] = (0.0, 0.5)
    loc[0, 0, 1, 0] = (1.0, 0.3)
    loc[0, 1, 0, 0] = (-0.5 / sh[0, 0, 1], 0.5)   # x = -1 at scale 0 exactly
    loc[1, 2, 3, 1] = (1.02, 0.99)
    out = deformable_aggregation(feats, sh, starts, loc, w, boundary=boundary)
    ref = loop_reference(feats, sh, starts, loc, w, boundary)
    assert out.shape == ref.shape and out.dtype == np.float64
    np.testing.assert_allclose(out, ref, rtol=1e-12, atol=1e-12)


def test_boundary_modes_differ_only_outside(rng):
    feats, sh, starts, loc, w = make_problem(rng, spread=(0.02, 0.98))
    # every coordinate strictly inside: the two modes agree
    a = deformable_aggregation(feats, sh, starts, loc, w, boundary="sparse4d")
    b = deformable_aggregation(feats, sh, starts, loc, w, boundary="zeros")
    np.testing.assert_allclose(a, b, rtol=1e-13, atol=1e-13)
    loc2 = loc.copy()
    loc2[:, :, :, 0, 0] = -0.01  # camera 0 just left of the image: only "zeros" still samples it
    a = deformable_aggregation(feats, sh, starts, loc2, w, boundary="sparse4d")
    b = deformable_aggregation(feats, sh, starts, loc2, w, boundary="zeros")
    assert not np.allclose(a, b)
    np.testing.assert_allclose(b, loop_reference(feats, sh, starts, loc2, w, "zeros"), rtol=1e-12, atol=1e-12)


def test_float32_and_float16(rng):
    feats, sh, starts, loc, w = make_problem(rng, dtype=np.float32, spread=(0.02, 0.98))
    ref = loop_reference(feats, sh, starts, loc, w, "sparse4d")
    out = deformable_aggregation(feats, sh, starts, loc, w)
    assert out.dtype == np.float32
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
    # float16 storage: computed in float32, returned as float16 when every input is float16
    f16, l16, w16 = feats.astype(np.float16), loc.astype(np.float16), w.astype(np.float16)
    out16 = deformable_aggregation(f16, sh, starts, l16, w16)
    assert out16.dtype == np.float16
    ref16 = loop_reference(f16, sh, starts, l16.astype(np.float32), w16, "sparse4d")
    np.testing.assert_allclose(out16.astype(np.float64), ref16, rtol=2e-2, atol=2e-2)
    # mixed: float16 features, float32 locations and weights -> float32
    out_mixed = deformable_aggregation(f16, sh, starts, loc, w)
    assert out_mixed.dtype == np.float32
    np.testing.assert_allclose(out_mixed, loop_reference(f16, sh, starts, loc, w, "sparse4d"),
                               rtol=1e-5, atol=1e-5)


def test_bfloat16_if_available(rng):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    feats, sh, starts, loc, w = make_problem(rng, dtype=np.float32, spread=(0.02, 0.98))
    fb = feats.astype(ml_dtypes.bfloat16)
    out = deformable_aggregation(fb, sh, starts, loc, w)
    assert out.dtype == np.float32
    ref = loop_reference(fb.astype(np.float64), sh, starts, loc, w, "sparse4d")
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)


def test_nan_and_inf_locations_contribute_nothing(rng):
    feats, sh, starts, loc, w = make_problem(rng, spread=(0.05, 0.95))
    bad = loc.copy()
    bad[0, 1, 2, 0, 0] = np.nan
    bad[1, 0, 0, 1, 1] = np.nan
    bad[1, 2, 1, 0, 0] = np.inf
    bad[0, 0, 3, 1, 1] = -np.inf
    cleaned = bad.copy()
    for idx in [(0, 1, 2, 0), (1, 0, 0, 1), (1, 2, 1, 0), (0, 0, 3, 1)]:
        cleaned[idx] = (-5.0, -5.0)  # far outside: contributes nothing
    for boundary in ("sparse4d", "zeros"):
        out, pullback = cutopo.vjp(deformable_aggregation, feats, sh, starts, bad, w, boundary=boundary)
        assert np.all(np.isfinite(out))
        np.testing.assert_array_equal(out, deformable_aggregation(feats, sh, starts, cleaned, w, boundary=boundary))
        d_f, _, _, d_loc, d_w = pullback(np.ones_like(out))
        assert np.all(np.isfinite(d_loc)) and np.all(np.isfinite(d_f)) and np.all(np.isfinite(d_w))
        assert np.all(d_loc[0, 1, 2, 0] == 0) and np.all(d_w[0, 1, 2, 0] == 0)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_locations_whose_pixel_coordinate_overflows_contribute_nothing(rng, dtype):
    """Finite locations near the dtype's largest value (u W overflows to +-inf): outside the
    map, as infinite ones, without an overflow warning."""
    import warnings

    feats, sh, starts, loc, w = make_problem(rng, spread=(0.05, 0.95), dtype=dtype)
    big = np.finfo(dtype).max
    bad, cleaned = loc.copy(), loc.copy()
    for idx, value in [((0, 1, 2, 0, 0), big), ((1, 0, 0, 1, 1), -big), ((1, 2, 1, 0, 1), big / 3)]:
        bad[idx] = value
        cleaned[idx[:4]] = (-5.0, -5.0)
    for boundary in ("sparse4d", "zeros"):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            out, pullback = cutopo.vjp(deformable_aggregation, feats, sh, starts, bad, w,
                                       boundary=boundary)
            d_f, _, _, d_loc, d_w = pullback(np.ones_like(out))
        np.testing.assert_array_equal(out, deformable_aggregation(feats, sh, starts, cleaned, w,
                                                                  boundary=boundary))
        assert np.all(np.isfinite(d_loc)) and np.all(d_loc[0, 1, 2, 0] == 0)


def test_nan_features_away_from_samples_do_not_leak(rng):
    """Zero padding skips corners instead of multiplying them by 0 (0 * NaN = NaN)."""
    feats, sh, starts, loc, w = make_problem(rng, spread=(0.05, 0.95))
    out = deformable_aggregation(feats, sh, starts, loc, w)
    _, pullback = cutopo.vjp(deformable_aggregation, feats, sh, starts, loc, w, wrt="features")
    used = np.any(pullback(np.ones_like(out))[0] != 0, axis=(0, 2))  # rows some sample reads
    assert 0 < used.sum() < used.size
    poisoned = feats.copy()
    poisoned[:, ~used] = np.nan
    np.testing.assert_array_equal(deformable_aggregation(poisoned, sh, starts, loc, w), out)


# ---------------------------------------------------------------------------------------------
# Per-level (list) form


def _levels(feats, sh, starts, layout):
    """The per-level arrays of a flattened problem whose cameras share each level's shape."""
    bs, _, C = feats.shape
    K, S = sh.shape[:2]
    levels = []
    for s in range(S):
        H, W = sh[0, s]
        lv = np.stack([feats[:, starts[k, s]:starts[k, s] + H * W].reshape(bs, H, W, C) for k in range(K)], axis=1)
        levels.append(np.ascontiguousarray(lv if layout == "channels_last" else lv.transpose(0, 1, 4, 2, 3)))
    return levels


@pytest.mark.parametrize("layout", ["channels_first", "channels_last"])
@pytest.mark.parametrize("boundary", ["sparse4d", "zeros"])
def test_level_list_matches_flattened(rng, layout, boundary):
    K, shapes = 3, ((6, 5), (3, 3), (2, 1))
    S = len(shapes)
    sh = np.array([[list(hw) for hw in shapes]] * K, dtype=np.int64)
    pix = sh[..., 0] * sh[..., 1]
    starts = (np.arange(K)[:, None] * pix.sum(1)[:, None] + np.cumsum(pix, 1) - pix).astype(np.int64)
    bs, A, P, C, G = 2, 3, 2, 6, 3
    feats = rng.standard_normal((bs, int(pix.sum()), C))
    loc = rng.uniform(-0.1, 1.1, (bs, A, P, K, 2))
    w = rng.standard_normal((bs, A, P, K, S, G))
    levels = _levels(feats, sh, starts, layout)
    ref = deformable_aggregation(feats, sh, starts, loc, w, boundary=boundary)
    for sh_arg, st_arg in ((None, None), (sh, starts)):
        out = deformable_aggregation(levels, sh_arg, st_arg, loc, w, boundary=boundary, level_layout=layout)
        np.testing.assert_allclose(out, ref, rtol=1e-13, atol=1e-13)
    # the cotangents of the list form equal the flattened form's; the feature cotangent is a
    # list of per-level arrays in the levels' layout
    g = rng.standard_normal(ref.shape)
    _, pb = cutopo.vjp(deformable_aggregation, levels, None, None, loc, w, boundary=boundary, level_layout=layout)
    _, pb_flat = cutopo.vjp(deformable_aggregation, feats, sh, starts, loc, w, boundary=boundary)
    got, want = pb(g), pb_flat(g)
    assert isinstance(got[0], list) and len(got[0]) == S
    for d, lv, want_lv in zip(got[0], levels, _levels(want[0], sh, starts, layout)):
        assert d.shape == lv.shape and d.dtype == lv.dtype and d.flags.c_contiguous
        np.testing.assert_allclose(d, want_lv, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(got[3], want[3], rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(got[4], want[4], rtol=1e-12, atol=1e-12)
    # only the feature cotangent, and a tuple of levels: a tuple back
    _, pb = cutopo.vjp(deformable_aggregation, tuple(levels), None, None, loc, w, boundary=boundary,
                       level_layout=layout, wrt="features")
    got = pb(g)
    assert isinstance(got[0], tuple) and got[3] is None and got[4] is None


@pytest.mark.parametrize("layout", ["channels_first", "channels_last"])
def test_level_list_feature_cotangent_matches_finite_differences(rng, layout):
    """The per-level feature cotangent against central differences of the list-form op
    (linear in the features: exact up to rounding), float32 levels rounded once at the end."""
    K, shapes = 2, ((4, 5), (2, 3))
    S = len(shapes)
    bs, A, P, C, G = 2, 3, 2, 4, 2
    levels = [rng.standard_normal((bs, K, C, H, W) if layout == "channels_first" else (bs, K, H, W, C))
              for H, W in shapes]
    loc = rng.uniform(0.05, 0.95, (bs, A, P, K, 2))
    w = rng.standard_normal((bs, A, P, K, S, G))
    g = rng.standard_normal((bs, A, C))
    _, pb = cutopo.vjp(deformable_aggregation, levels, None, None, loc, w, level_layout=layout,
                       wrt="features")
    d = pb(g)[0]
    for s in range(S):
        for i in rng.choice(levels[s].size, size=10, replace=False):
            e = np.zeros(levels[s].size)
            e[i] = 1.0
            moved = [lv + (e.reshape(lv.shape) if j == s else 0) for j, lv in enumerate(levels)]
            fd = float(np.sum((deformable_aggregation(moved, None, None, loc, w, level_layout=layout)
                               - deformable_aggregation(levels, None, None, loc, w, level_layout=layout)) * g))
            assert abs(fd - d[s].reshape(-1)[i]) <= 1e-9 * (1 + abs(fd))
    levels32 = [lv.astype(np.float32) for lv in levels]
    _, pb = cutopo.vjp(deformable_aggregation, levels32, None, None, loc, w, level_layout=layout,
                       wrt="features")
    for a, b in zip(pb(g)[0], d):
        assert a.dtype == np.float32
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


def test_level_list_checks(rng):
    levels = [np.zeros((1, 2, 4, 3, 5)), np.zeros((1, 2, 4, 2, 2))]
    loc = np.full((1, 1, 1, 2, 2), 0.5)
    w = np.ones((1, 1, 1, 2, 2, 2))
    deformable_aggregation(levels, None, None, loc, w)
    with pytest.raises(ValueError, match="spatial_shapes"):
        deformable_aggregation(levels, np.array([[[3, 5], [2, 3]]] * 2), None, loc, w)
    with pytest.raises(ValueError, match="level_start_index"):
        deformable_aggregation(levels, None, np.array([[0, 15], [20, 35]]), loc, w)
    deformable_aggregation(levels, None, np.array([[0, 15], [19, 34]]), loc, w)  # the right one
    with pytest.raises(ValueError, match=r"features\[1\]"):
        deformable_aggregation([levels[0], np.zeros((1, 2, 3, 2, 2))], None, None, loc, w)
    with pytest.raises(TypeError, match=r"features\[1\]"):
        deformable_aggregation([levels[0], levels[1].astype(np.float32)], None, None, loc, w)
    with pytest.raises(ValueError, match="features"):
        deformable_aggregation([], None, None, loc, w)
    # without tables, the cameras are the feature levels', and the message says so
    with pytest.raises(ValueError, match="1 cameras, the feature levels 2"):
        deformable_aggregation(levels, None, None, loc[:, :, :, :1], w[:, :, :, :1])


# ---------------------------------------------------------------------------------------------
# VJP against finite differences (float64, locations away from pixel centres and edges)


def _fd_check(rng, boundary, C, G):
    feats, sh, starts, loc, w = make_problem(rng, C=C, G=G, gap=2)
    loc = safe_locations(rng, loc.shape, sh)
    loc[1, 0, 0, 1] = (-0.3, 0.5)  # one invisible (point, camera) pair: zero cotangents
    g = rng.standard_normal((feats.shape[0], loc.shape[1], C))

    def f(fe, lo, we):
        return float(np.sum(deformable_aggregation(fe, sh, starts, lo, we, boundary=boundary) * g))

    out, pullback = cutopo.vjp(deformable_aggregation, feats, sh, starts, loc, w, boundary=boundary)
    d_feat, d_sh, d_st, d_loc, d_w = pullback(g)
    assert d_sh is None and d_st is None
    assert d_feat.shape == feats.shape and d_loc.shape == loc.shape and d_w.shape == w.shape
    base = {"features": feats, "locations": loc, "weights": w}

    def moved(name, delta):
        args = dict(base)
        args[name] = base[name] + delta
        return f(args["features"], args["locations"], args["weights"])

    # The op is linear in features and weights and, within one pixel cell, in each location
    # coordinate: central differences are exact up to rounding.
    for name, d in (("features", d_feat), ("weights", d_w), ("locations", d_loc)):
        x = base[name]
        h = 1e-6 if name == "locations" else 1e-3
        for i in rng.choice(x.size, size=min(x.size, 40), replace=False):
            e = np.zeros(x.size)
            e[i] = h
            e = e.reshape(x.shape)
            fd = (moved(name, e) - moved(name, -e)) / (2 * h)
            assert abs(fd - d.reshape(-1)[i]) <= 1e-6 * (1 + abs(fd)), (name, i, fd, d.reshape(-1)[i])
        direction = rng.standard_normal(x.shape)  # and every coordinate at once
        fd = (moved(name, h * direction) - moved(name, -h * direction)) / (2 * h)
        assert abs(fd - float(np.sum(d * direction))) <= 1e-6 * (1 + abs(fd)), name
    assert np.all(d_loc[1, 0, 0, 1] == 0) and np.all(d_w[1, 0, 0, 1] == 0)


@pytest.mark.parametrize("boundary", ["sparse4d", "zeros"])
@pytest.mark.parametrize("C,G", [(8, 2), (6, 3)])
def test_vjp_matches_finite_differences(rng, boundary, C, G):
    _fd_check(rng, boundary, C, G)


def test_vjp_zeros_mode_outside_band(rng):
    """'zeros' samples the half-pixel band outside the image: its location cotangent there is
    the derivative of the zero-padded interpolant."""
    feats, sh, starts, loc, w = make_problem(rng, K=1, shapes=((4, 6),))
    W = sh[0, 0, 1]
    loc[:] = 0.5
    loc[0, 0, 0, 0] = (-0.3 / W, 0.37)   # x = -0.8: only the corners at x0 + 1 = 0 are inside
    g = rng.standard_normal((feats.shape[0], loc.shape[1], feats.shape[2]))
    _, pb = cutopo.vjp(deformable_aggregation, feats, sh, starts, loc, w, boundary="zeros")
    d_loc = pb(g)[3]
    h = 1e-7
    for axis in (0, 1):
        lp, lm = loc.copy(), loc.copy()
        lp[0, 0, 0, 0, axis] += h
        lm[0, 0, 0, 0, axis] -= h
        fd = (np.sum(deformable_aggregation(feats, sh, starts, lp, w, boundary="zeros") * g)
              - np.sum(deformable_aggregation(feats, sh, starts, lm, w, boundary="zeros") * g)) / (2 * h)
        assert abs(fd - d_loc[0, 0, 0, 0, axis]) <= 1e-6 * (1 + abs(fd))
    # "sparse4d" cuts the same point: zero cotangent
    _, pb = cutopo.vjp(deformable_aggregation, feats, sh, starts, loc, w)
    assert np.all(pb(g)[3][0, 0, 0, 0] == 0)


def test_wrt_computes_only_the_requested(rng, monkeypatch):
    feats, sh, starts, loc, w = make_problem(rng)
    out, pb_all = cutopo.vjp(deformable_aggregation, feats, sh, starts, loc, w)
    g = rng.standard_normal(out.shape)
    full = pb_all(g)
    from cutopo import deformable as mod

    seen = []
    original = mod._backward_numpy

    def spy(cfg, gg, needs):
        seen.append(needs)
        return original(cfg, gg, needs)

    monkeypatch.setattr(mod, "_backward_numpy", spy)
    for wrt, idx in (("features", 0), ("sampling_locations", 3), ("weights", 4)):
        _, pb = cutopo.vjp(deformable_aggregation, feats, sh, starts, loc, w, wrt=wrt)
        got = pb(g)
        assert [i for i, x in enumerate(got) if x is not None] == [idx]
        np.testing.assert_array_equal(got[idx], full[idx])
        assert seen[-1] == tuple(i == idx for i in range(5))


def test_cotangent_dtypes_follow_arguments(rng):
    feats, sh, starts, loc, w = make_problem(rng, dtype=np.float32, spread=(0.05, 0.95))
    f16 = feats.astype(np.float16)
    out, pb = cutopo.vjp(deformable_aggregation, f16, sh, starts, loc, w)
    d_f, _, _, d_l, d_w = pb(np.ones_like(out))
    assert d_f.dtype == np.float16 and d_l.dtype == np.float32 and d_w.dtype == np.float32


def _half_dtypes():
    out = [np.dtype(np.float16)]
    try:
        import ml_dtypes
    except ImportError:  # pragma: no cover - ml_dtypes comes with JAX
        return out
    return out + [np.dtype(ml_dtypes.bfloat16)]


@pytest.mark.parametrize("half", _half_dtypes(), ids=lambda d: d.name)
@pytest.mark.parametrize("which", ["all", "features", "locations_weights"])
def test_half_precision_cotangents(rng, half, which):
    """float16 and bfloat16 arguments get cotangents of their own dtype: the float32 cotangents
    of the same (rounded) values, accumulated in float32 and rounded once, at the end."""
    feats, sh, starts, loc, w = make_problem(rng, dtype=np.float32, spread=(0.05, 0.95))
    # locations on a 2^-8 grid: exact in both half formats and in float32, so both see the
    # same pixel cells
    loc = (np.round(loc * 256) / 256).astype(np.float32)
    cast = {"all": (0, 3, 4), "features": (0,), "locations_weights": (3, 4)}[which]
    args = [feats, sh, starts, loc, w]
    for i in cast:
        args[i] = args[i].astype(half)
    ref_args = [a.astype(np.float32) if i in cast else a for i, a in enumerate(args)]
    out, pb = cutopo.vjp(deformable_aggregation, *args)
    assert out.dtype == (half if which == "all" else np.float32)
    g = rng.standard_normal(out.shape).astype(out.dtype)    # a half cotangent for a half output
    got = pb(g)
    out32, pb32 = cutopo.vjp(deformable_aggregation, *ref_args)
    want = pb32(g.astype(np.float32))
    np.testing.assert_allclose(out.astype(np.float32), out32.astype(out.dtype).astype(np.float32),
                               rtol=0, atol=0)
    for i in (0, 3, 4):
        assert got[i].dtype == args[i].dtype and got[i].shape == args[i].shape
        # rounding the float32 result once gives exactly what cutopo returns
        np.testing.assert_array_equal(got[i].astype(np.float32),
                                      want[i].astype(args[i].dtype).astype(np.float32))


def test_bfloat16_cotangent_of_a_float32_output(rng):
    """A bfloat16 cotangent is accepted for any floating output (cast to the output's dtype)."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    feats, sh, starts, loc, w = make_problem(rng, dtype=np.float32, spread=(0.05, 0.95))
    out, pb = cutopo.vjp(deformable_aggregation, feats, sh, starts, loc, w)
    g = rng.standard_normal(out.shape).astype(ml_dtypes.bfloat16)
    for a, b in zip(pb(g), pb(g.astype(np.float32))):
        assert (a is None) == (b is None)
        if a is not None:
            np.testing.assert_array_equal(a, b)


def test_empty_sizes(rng):
    feats, sh, starts, loc, w = make_problem(rng)
    out = deformable_aggregation(feats, sh, starts, loc[:, :, :0], w[:, :, :0])
    assert out.shape == (2, 3, 8) and np.all(out == 0)
    out = deformable_aggregation(feats[:0], sh, starts, loc[:0], w[:0])
    assert out.shape == (0, 3, 8)
    out, pb = cutopo.vjp(deformable_aggregation, feats, sh, starts, loc[:, :0], w[:, :0])
    assert out.shape == (2, 0, 8)
    d = pb(out)
    assert d[0].shape == feats.shape and np.all(d[0] == 0) and d[3].shape == (2, 0, 4, 2, 2)


# ---------------------------------------------------------------------------------------------
# Bad input


def test_bad_input_names_the_argument(rng):
    feats, sh, starts, loc, w = make_problem(rng)
    op = deformable_aggregation
    with pytest.raises(ValueError, match="weights.*divide"):
        op(feats, sh, starts, loc, w[..., :1].repeat(3, axis=-1))       # G = 3, C = 8
    with pytest.raises(ValueError, match="level_start_index"):
        op(feats, sh, starts + 1000, loc, w)
    with pytest.raises(ValueError, match="level_start_index"):
        op(feats, sh, starts - 50, loc, w)
    bigger = sh.copy()
    bigger[1, 1] = (50, 50)
    with pytest.raises(ValueError, match="spatial_shapes"):
        op(feats, bigger, starts, loc, w)
    with pytest.raises(ValueError, match="spatial_shapes"):
        op(feats, np.zeros_like(sh), starts, loc, w)
    with pytest.raises(ValueError, match="spatial_shapes"):
        op(feats, sh[..., :1], starts, loc, w)
    with pytest.raises(ValueError, match="level_start_index"):
        op(feats, sh, starts[:, :1], loc, w)
    with pytest.raises(ValueError, match="sampling_locations"):
        op(feats, sh, starts, loc[:1], w)                                 # batch mismatch
    with pytest.raises(ValueError, match="sampling_locations"):
        op(feats, sh, starts, loc[:, :, :, :1], w)                        # cameras
    with pytest.raises(ValueError, match="sampling_locations"):
        op(feats, sh, starts, loc[..., :1], w)
    with pytest.raises(ValueError, match="weights"):
        op(feats, sh, starts, loc, w[:, :2])                              # anchors
    with pytest.raises(ValueError, match="weights"):
        op(feats, sh, starts, loc, w[:, :, :, :, :1])                     # scales
    with pytest.raises(ValueError, match="weights"):
        op(feats, sh, starts, loc, w[..., 0])
    with pytest.raises(ValueError, match="weights"):
        op(feats, sh, starts, loc, w[..., :0])
    with pytest.raises(ValueError, match="features"):
        op(feats[0], sh, starts, loc, w)
    with pytest.raises(TypeError, match="features"):
        op(feats.astype(np.int32), sh, starts, loc, w)
    with pytest.raises(TypeError, match="sampling_locations"):
        op(feats, sh, starts, loc.astype(np.complex128), w)
    with pytest.raises(TypeError, match="spatial_shapes"):
        op(feats, sh.astype(np.float64), starts, loc, w)
    with pytest.raises(TypeError, match="level_start_index"):
        op(feats, sh, starts.astype(np.float32), loc, w)
    with pytest.raises(ValueError, match="level_start_index"):
        op(feats, sh, None, loc, w)
    with pytest.raises(ValueError, match="boundary"):
        op(feats, sh, starts, loc, w, boundary="border")
    with pytest.raises(TypeError, match="deterministic"):
        op(feats, sh, starts, loc, w, deterministic=1)
    with pytest.raises(ValueError, match="level_layout"):
        op(feats, sh, starts, loc, w, level_layout="nchw")


def test_overlapping_maps_are_allowed(rng):
    """Maps may share rows (nothing reads outside features); the cotangent then sums."""
    feats, sh, starts, loc, w = make_problem(rng, K=1, shapes=((3, 4), (3, 4)))
    same = starts.copy()
    same[0, 1] = 0
    out = deformable_aggregation(feats, sh, same, loc, w)
    np.testing.assert_allclose(out, loop_reference(feats, sh, same, loc, w, "sparse4d"), rtol=1e-12, atol=1e-12)


def test_chunked_numpy_path_matches(rng, monkeypatch):
    from cutopo import deformable as mod

    feats, sh, starts, loc, w = make_problem(rng, A=7, P=5)
    out, pb = cutopo.vjp(deformable_aggregation, feats, sh, starts, loc, w)
    g = rng.standard_normal(out.shape)
    full = pb(g)
    monkeypatch.setattr(mod, "_CHUNK_VALUES", 3 * feats.shape[2])  # chunks of 3 (b, a, p)
    out2, pb2 = cutopo.vjp(deformable_aggregation, feats, sh, starts, loc, w)
    np.testing.assert_allclose(out2, out, rtol=1e-13, atol=1e-13)
    for a, b in zip(pb2(g), full):
        if a is not None:
            np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------------------------------------
# Memoized validation (the per-call host cost at small sizes)


def test_repeated_calls_validate_once(rng, monkeypatch):
    from cutopo import deformable as mod

    feats, sh, starts, loc, w = make_problem(rng)
    seen = []
    original = mod._prepare

    def spy(*args):
        seen.append(1)
        return original(*args)

    monkeypatch.setattr(mod, "_prepare", spy)
    monkeypatch.setattr(mod, "_MEMO", RepeatedCalls())
    first = deformable_aggregation(feats, sh, starts, loc, w)
    for _ in range(3):  # same kind of call, other arrays: no new validation, same results
        loc2, w2 = loc.copy(), w.copy()
        np.testing.assert_array_equal(deformable_aggregation(feats, sh, starts, loc2, w2), first)
        _, pb = cutopo.vjp(deformable_aggregation, feats.copy(), sh.copy(), starts.copy(), loc2, w2)
    assert len(seen) == 1
    # each of these is another kind of call, validated anew
    others = [dict(boundary="zeros"), dict(deterministic=True), dict(level_layout="channels_last")]
    for kw in others:
        deformable_aggregation(feats, sh, starts, loc, w, **kw)
    deformable_aggregation(feats.astype(np.float32), sh, starts, loc, w)
    deformable_aggregation(feats[:1], sh, starts, loc[:1], w[:1])
    deformable_aggregation(feats, sh.astype(np.int32), starts, loc, w)
    assert len(seen) == 1 + len(others) + 3
    # array-likes, NumPy booleans and subclasses take the full checks every time
    n = len(seen)
    deformable_aggregation(feats, sh.tolist(), starts, loc, w)
    deformable_aggregation(feats, sh, starts, loc, w, deterministic=np.bool_(False))
    deformable_aggregation(feats, sh, starts, loc, w, deterministic=np.bool_(False))
    assert len(seen) == n + 3
    cfg = mod._configure(feats, sh, starts, loc, w, "sparse4d", False, "channels_first")
    assert cfg.features is feats and cfg.loc is loc and cfg.weights is w
    assert not cfg.shapes.flags.writeable  # shared by the later calls of this kind


def test_memoized_validation_sees_new_table_values_and_keeps_failing(rng, monkeypatch):
    from cutopo import deformable as mod

    monkeypatch.setattr(mod, "_MEMO", RepeatedCalls())
    feats, sh, starts, loc, w = make_problem(rng)
    deformable_aggregation(feats, sh, starts, loc, w)
    bad = starts.copy()
    bad[1, 1] += 1000
    for _ in range(2):  # a failing call is never remembered
        with pytest.raises(ValueError, match="level_start_index"):
            deformable_aggregation(feats, sh, bad, loc, w)
    starts[1, 1] += 1000  # the same table object, modified in place: its values are the key
    with pytest.raises(ValueError, match="level_start_index"):
        deformable_aggregation(feats, sh, starts, loc, w)
    starts[1, 1] -= 1000
    deformable_aggregation(feats, sh, starts, loc, w)
    for _ in range(2):
        with pytest.raises(ValueError, match="weights"):
            deformable_aggregation(feats, sh, starts, loc, w[..., :1].repeat(3, axis=-1))


def test_memo_is_bounded_and_holds_no_arrays(rng, monkeypatch):
    import gc
    import weakref

    from cutopo import deformable as mod

    monkeypatch.setattr(mod, "_MEMO", RepeatedCalls(3))
    feats, sh, starts, loc, w = make_problem(rng)
    for A in range(1, 6):
        deformable_aggregation(feats, sh, starts, loc[:, :A], w[:, :A])
    assert len(mod._MEMO) == 3
    f2, l2, w2 = feats.copy(), loc.copy(), w.copy()
    refs = [weakref.ref(a) for a in (f2, l2, w2)]
    deformable_aggregation(f2, sh, starts, l2, w2)
    del f2, l2, w2
    gc.collect()
    assert all(r() is None for r in refs)


def test_doctests():
    mod = importlib.import_module("cutopo.deformable")
    failures, _ = doctest.testmod(mod, optionflags=doctest.ELLIPSIS)
    assert failures == 0


@pytest.mark.parametrize("units,items,sms,parts", [
    (1800, 312, 132, 2),     # Sparse4D batch 1 on an H200
    (10800, 312, 132, 2),    # batch 6: full, but 312 items are two chains
    (2400, 7200, 132, 8),    # SparseDrive map head: long chains
    (2112, 256, 132, 1), (2111, 256, 132, 2), (2112, 257, 132, 2),
    (1, 10, 132, 8), (0, 10, 132, 8), (900, 100, 8, 1)])
def test_forward_parts(monkeypatch, units, items, sms, parts):
    """The forward's warps per output unit: the fewest powers of two (at most the 8 warps of a
    block) giving 16 warps per multiprocessor and at most 256 items per warp."""
    from cutopo import _deformable_cupy

    monkeypatch.setattr(_deformable_cupy, "device_attribute",
                        lambda name: {"MultiProcessorCount": sms}[name])
    assert _deformable_cupy.forward_parts(units, items) == parts
