"""CPU tests of cutopo.ecc, cutopo.euler_contributions and cutopo.linear_thresholds.

Expected values come from skimage.measure.euler_number, from the cell-enumerating oracle of
``oracles.py``, from a slow re-implementation of the ownership rule (ecc.md 5.2/5.3) written
below with explicit loops, or from closed forms, never from cutopo itself.
"""
from __future__ import annotations

import doctest
import importlib
import itertools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from skimage.measure import euler_number

import cutopo
from oracles import oracle_ecc, skimage_ecc

DTYPES = ["bool", "uint8", "uint16", "int16", "int32", "float16", "float32", "float64"]
FLOATS = ["float16", "float32", "float64"]
RANGES = {(2, False): (-3, 1), (2, True): (-3, 1), (3, False): (-5, 7), (3, True): (-7, 5)}


# ---------------------------------------------------------------------------------------------
# Random inputs


def random_image(rng, shape, dtype, *, ties=False, specials=False):
    """A random image; ``ties``: only a few distinct levels; ``specials``: NaN/inf/-0/subnormals."""
    dtype = np.dtype(dtype)
    shape = tuple(int(s) for s in shape)
    if dtype == np.bool_:
        return rng.random(shape) < rng.uniform(0.25, 0.75)
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        if ties:
            levels = rng.integers(info.min, info.max, size=int(rng.integers(2, 5)), endpoint=True)
            return rng.choice(levels, size=shape).astype(dtype)
        if rng.random() < 0.5:  # a narrow band somewhere in the range: some ties
            lo = int(rng.integers(info.min, max(info.min + 1, info.max - 20)))
            return rng.integers(lo, lo + 20, size=shape, endpoint=True).astype(dtype)
        return rng.integers(info.min, info.max, size=shape, endpoint=True, dtype=dtype)
    if ties:
        levels = rng.normal(scale=10.0, size=int(rng.integers(2, 5)))
        img = rng.choice(levels, size=shape).astype(dtype)
    else:
        img = (rng.normal(size=shape) * 10.0 ** rng.uniform(-2, 3)).astype(dtype)
    if specials:
        tiny = np.finfo(dtype).smallest_subnormal
        pool = np.array([np.nan, np.inf, -np.inf, -0.0, 0.0, tiny, -tiny], dtype=dtype)
        mask = rng.random(shape) < 0.2
        img[mask] = rng.choice(pool, size=int(mask.sum()))
    return img


def random_thresholds(rng, image, count=12):
    """Sorted thresholds: some pixel values, midpoints, and values below/above every pixel."""
    image = np.asarray(image)
    if image.dtype == np.bool_:
        return [np.array([False, True]), np.array([-1, 0, 1]), np.array([-0.5, 0.25, 1.0, 2.0])][
            int(rng.integers(3))]
    if image.dtype.kind == "f":
        vals = np.unique(image[np.isfinite(image)].astype(np.float64))
    else:
        vals = np.unique(image.astype(np.int64))
    if vals.size == 0:
        return np.array([-1.0, 0.0, 1.0])
    pick = rng.choice(vals, size=min(count, vals.size), replace=False)
    lo, hi = vals[0], vals[-1]
    if image.dtype.kind == "f":
        mids = (vals[:-1] + vals[1:]) / 2 if vals.size > 1 else vals
        mids = rng.choice(mids, size=min(4, mids.size), replace=False)
        extra = [lo - 1.0 - abs(lo), hi + 1.0 + abs(hi)]
        t = np.sort(np.concatenate([pick, mids, extra]))
        if rng.random() < 0.5:  # thresholds of the image's own dtype (comparison in that dtype)
            t = np.sort(t.astype(image.dtype))
            t = t[np.isfinite(t)]
        return t
    extra = np.array([lo - 1, hi + 1], dtype=np.int64)
    t = np.sort(np.concatenate([pick, extra]))
    if rng.random() < 0.5:  # float thresholds between the integer levels
        t = np.sort(np.concatenate([t.astype(np.float64), t[:-1] + 0.5]))
    return t


def random_shape(rng, ndim, lo=1, hi=8):
    return tuple(int(s) for s in rng.integers(lo, hi, size=ndim, endpoint=True))


def expected_ecc(image, thresholds, connectivity):
    """The oracle's answer, after checking that skimage agrees with it."""
    a = oracle_ecc(image, thresholds, connectivity)
    b = skimage_ecc(image, thresholds, connectivity)
    np.testing.assert_array_equal(a, b, err_msg="oracle and skimage disagree (test bug)")
    return a


# ---------------------------------------------------------------------------------------------
# The oracle itself


@pytest.mark.parametrize("ndim", [2, 3])
def test_oracle_agrees_with_skimage_on_masks(rng, ndim):
    for _ in range(20):
        shape = random_shape(rng, ndim, 1, 6)
        mask = rng.random(shape) < rng.uniform(0.2, 0.8)
        for conn in (1, ndim):
            # {image <= 0} is the mask; {image <= 1} is the whole box (chi = 1).
            assert oracle_ecc((~mask).astype(np.uint8), [0, 1], conn).tolist() == [
                euler_number(mask, conn), 1]
            assert oracle_ecc(mask.astype(np.uint8), [0], conn)[0] == euler_number(~mask, conn)


# ---------------------------------------------------------------------------------------------
# ecc against skimage and the oracle


@pytest.mark.parametrize("connectivity", ["V", "T"])
@pytest.mark.parametrize("ndim", [2, 3])
@pytest.mark.parametrize("dtype", DTYPES)
def test_ecc_matches_oracle(rng, dtype, ndim, connectivity):
    conn = 1 if connectivity == "V" else ndim
    for trial in range(8):
        shape = random_shape(rng, ndim, 1, 9 if ndim == 2 else 6)
        image = random_image(rng, shape, dtype, ties=trial % 2 == 1,
                             specials=np.dtype(dtype).kind == "f" and trial % 4 >= 2)
        t = random_thresholds(rng, image)
        got = cutopo.ecc(image, t, connectivity=conn)
        assert isinstance(got, np.ndarray) and got.dtype == np.int64 and got.shape == (len(t),)
        np.testing.assert_array_equal(got, expected_ecc(image, t, conn),
                                      err_msg=f"shape={shape} thresholds={t!r}")
        np.testing.assert_array_equal(cutopo.ecc(image, t, ndim=ndim, connectivity=conn), got)


@pytest.mark.parametrize("shape", [(1, 1), (1, 9), (9, 1), (2, 1), (1, 1, 1), (1, 1, 7), (1, 6, 1),
                                   (5, 1, 1), (2, 1, 3), (1, 4, 5), (3, 4, 1), (1, 2)])
def test_ecc_thin_shapes(rng, shape):
    ndim = len(shape)
    for dtype in ("uint8", "float32", "int16"):
        image = random_image(rng, shape, dtype, ties=True)
        t = random_thresholds(rng, image)
        for conn in (1, ndim):
            np.testing.assert_array_equal(cutopo.ecc(image, t, connectivity=conn),
                                          expected_ecc(image, t, conn))


@pytest.mark.parametrize("dtype", ["float32", "uint16", "bool", "float16"])
def test_ecc_larger_random_images(rng, dtype):
    """Bigger images than the oracle tests, against skimage only."""
    for shape in [(64, 97), (31, 7, 45), (129, 3)]:
        image = random_image(rng, shape, dtype, ties=rng.random() < 0.5)
        t = random_thresholds(rng, image, count=6)
        for conn in (1, len(shape)):
            np.testing.assert_array_equal(cutopo.ecc(image, t, connectivity=conn),
                                          skimage_ecc(image, t, conn))


def test_ecc_slab_and_chunk_boundaries(rng):
    """Inputs large enough that the NumPy path works in several slabs / several image chunks."""
    # 17 images of 1000 x 1000 with ndim=2: 17M pixels, more than one pass of images, and
    # each pass sliced along the first spatial axis.
    image = rng.integers(0, 6, size=(17, 1000, 1000), dtype=np.uint8)
    t = np.array([0, 2, 5])
    got = cutopo.ecc(image, t, ndim=2)
    for b in range(image.shape[0]):
        np.testing.assert_array_equal(got[b], skimage_ecc(image[b], t, 1), err_msg=f"image {b}")
    del image
    vol = rng.normal(size=(40, 200, 300)).astype(np.float32)
    t = np.array([-1.0, 0.0, 0.5])
    np.testing.assert_array_equal(cutopo.ecc(vol, t, connectivity=3), skimage_ecc(vol, t, 3))
    c = cutopo.euler_contributions(vol, connectivity=3)
    assert int(c.sum(dtype=np.int64)) == 1


# ---------------------------------------------------------------------------------------------
# Batches and memory layouts


@pytest.mark.parametrize("connectivity", ["V", "T"])
def test_batches_equal_per_image(rng, connectivity):
    cases = [((5, 7, 9), 2), ((2, 3, 6, 5), 2), ((3, 4, 5, 6), 3), ((1, 1, 3, 3), 2),
             ((2, 1, 4, 3, 2), 3)]
    for shape, ndim in cases:
        conn = 1 if connectivity == "V" else ndim
        dtype = DTYPES[int(rng.integers(len(DTYPES)))]
        image = random_image(rng, shape, dtype, ties=True, specials=np.dtype(dtype).kind == "f")
        t = random_thresholds(rng, image)
        got = cutopo.ecc(image, t, ndim=ndim, connectivity=conn)
        assert got.shape == shape[:-ndim] + (len(t),)
        c = cutopo.euler_contributions(image, ndim=ndim, connectivity=conn)
        assert c.shape == shape and c.dtype == np.int8
        for idx in np.ndindex(shape[:-ndim]):
            np.testing.assert_array_equal(got[idx], expected_ecc(image[idx], t, conn),
                                          err_msg=f"{dtype} {shape} batch index {idx}")
            np.testing.assert_array_equal(got[idx], cutopo.ecc(image[idx], t, connectivity=conn))
            np.testing.assert_array_equal(c[idx], cutopo.euler_contributions(image[idx],
                                                                             connectivity=conn))


def test_batch_axis_interpretation(rng):
    """A (B, H, W) array is one 3D image by default and B 2D images with ndim=2."""
    image = random_image(rng, (3, 5, 6), "uint8", ties=True)
    t = random_thresholds(rng, image)
    np.testing.assert_array_equal(cutopo.ecc(image, t), expected_ecc(image, t, 1))
    per_image = np.stack([expected_ecc(image[b], t, 1) for b in range(3)])
    np.testing.assert_array_equal(cutopo.ecc(image, t, ndim=2), per_image)


def test_non_contiguous_inputs(rng):
    base = random_image(rng, (9, 12, 10), "float32", ties=True, specials=True)
    views = [base[:, ::2, 1::3], base.transpose(2, 0, 1), np.asfortranarray(base), base[::-1, :, ::-1]]
    for view in views:
        t = random_thresholds(rng, view)
        for conn in (1, 3):
            np.testing.assert_array_equal(cutopo.ecc(view, t, connectivity=conn),
                                          expected_ecc(view, t, conn))
            np.testing.assert_array_equal(cutopo.euler_contributions(view, connectivity=conn),
                                          slow_contributions(view, conn))


def test_array_likes(rng):
    # Nested lists of floats become float64 (nested ints would be int64, which is rejected).
    image = random_image(rng, (4, 5), "float64", ties=True)
    t = sorted(int(v) for v in rng.integers(-20, 20, size=3))
    expected = expected_ecc(image, np.array(t), 1)
    np.testing.assert_array_equal(cutopo.ecc(image.tolist(), t), expected)
    np.testing.assert_array_equal(cutopo.ecc(image, tuple(t)), expected)
    mask = rng.random((5, 4)) < 0.5
    np.testing.assert_array_equal(cutopo.ecc(mask.tolist(), [False, True], connectivity=2),
                                  [euler_number(~mask, 2), 1])


# ---------------------------------------------------------------------------------------------
# Special values and threshold edge cases


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("ndim", [2, 3])
def test_nan_pixels_are_never_included(rng, dtype, ndim):
    shape = random_shape(rng, ndim, 2, 6)
    image = random_image(rng, shape, dtype, ties=True)
    image[rng.random(shape) < 0.3] = np.nan
    finite = image[np.isfinite(image)]
    t = np.array([-1e30, float(finite.max()) if finite.size else 0.0, 1e30])
    for conn in (1, ndim):
        got = cutopo.ecc(image, t, connectivity=conn)
        np.testing.assert_array_equal(got, expected_ecc(image, t, conn))
        assert got[-1] == euler_number(~np.isnan(image), conn)
    all_nan = np.full(shape, np.nan, dtype=dtype)
    np.testing.assert_array_equal(cutopo.ecc(all_nan, t), [0, 0, 0])


@pytest.mark.parametrize("dtype", FLOATS)
def test_inf_pixels(rng, dtype):
    image = random_image(rng, (6, 7), dtype, ties=True)
    image[rng.random(image.shape) < 0.2] = np.inf
    image[rng.random(image.shape) < 0.2] = -np.inf
    t = np.array([-1e300, -1.0, 0.0, 1e300])
    for conn in (1, 2):
        got = cutopo.ecc(image, t, connectivity=conn)
        np.testing.assert_array_equal(got, expected_ecc(image, t, conn))
        assert got[0] == euler_number(image == -np.inf, conn)   # -inf is in every sublevel set
        assert got[-1] == euler_number(image < np.inf, conn)    # +inf is in none
    np.testing.assert_array_equal(cutopo.ecc(np.full((3, 3), -np.inf, dtype), [-1e300]), [1])
    np.testing.assert_array_equal(cutopo.ecc(np.full((3, 3), np.inf, dtype), [1e300]), [0])


@pytest.mark.parametrize("dtype", DTYPES)
def test_thresholds_below_and_above_everything(rng, dtype):
    for ndim in (2, 3):
        image = random_image(rng, random_shape(rng, ndim, 1, 6), dtype)
        lo = float(image.min()) if image.dtype != np.bool_ else 0.0
        hi = float(image.max()) if image.dtype != np.bool_ else 1.0
        t = np.array([lo - 1e6, lo - 0.5, hi + 0.5, hi + 1e6])
        for conn in (1, ndim):
            np.testing.assert_array_equal(cutopo.ecc(image, t, connectivity=conn), [0, 0, 1, 1])


def test_duplicate_thresholds(rng):
    image = random_image(rng, (7, 8), "uint8", ties=True)
    vals = np.unique(image)
    t = np.sort(np.concatenate([vals, vals, vals[:1], [int(vals[-1]) + 3] * 3]))
    for conn in (1, 2):
        got = cutopo.ecc(image, t, connectivity=conn)
        np.testing.assert_array_equal(got, expected_ecc(image, t, conn))
        for a, b in itertools.combinations(range(len(t)), 2):
            if t[a] == t[b]:
                assert got[a] == got[b]
    # One threshold, repeated only.
    np.testing.assert_array_equal(cutopo.ecc(image, [int(vals[0])] * 4),
                                  [expected_ecc(image, [int(vals[0])], 1)[0]] * 4)


@pytest.mark.parametrize("dtype", ["bool", "uint8", "uint16", "int16", "int32"])
def test_integer_thresholds_with_integer_images(rng, dtype):
    image = random_image(rng, (6, 5, 4), dtype, ties=True)
    vals = np.unique(image.astype(np.int64))
    for t in (list(map(int, vals)),                                  # Python ints
              np.concatenate([[vals[0] - 1], vals]).astype(np.int64),  # int64, below the minimum
              vals.astype(np.int32) if dtype != "uint16" else vals.astype(np.uint32)):
        for conn in (1, 3):
            np.testing.assert_array_equal(cutopo.ecc(image, t, connectivity=conn),
                                          expected_ecc(image, np.asarray(t), conn))


def test_negative_thresholds_with_unsigned_images(rng):
    image = random_image(rng, (5, 6), "uint8")
    np.testing.assert_array_equal(cutopo.ecc(image, [-300, -1]), [0, 0])
    np.testing.assert_array_equal(cutopo.ecc(image, np.array([-1, 255], dtype=np.int16)), [0, 1])


def test_uint64_thresholds(rng):
    """uint64 thresholds with unsigned images compare in uint64 (no float rounding)."""
    image = random_image(rng, (5, 6), "uint16", ties=True)
    vals = np.unique(image).astype(np.uint64)
    t = np.concatenate([vals, np.array([2**63 + 1, 2**64 - 1], dtype=np.uint64)])
    assert np.result_type(image, t) == np.uint64
    np.testing.assert_array_equal(cutopo.ecc(image, t), expected_ecc(image, t, 1))
    # int16 with uint64 compares in float64
    image = random_image(rng, (5, 6), "int16", ties=True)
    t = np.array([0, 5, 2**64 - 1], dtype=np.uint64)
    np.testing.assert_array_equal(cutopo.ecc(image, t, connectivity=2), expected_ecc(image, t, 2))


# ---------------------------------------------------------------------------------------------
# The comparison dtype rule: f <= t is evaluated in numpy.result_type(image, thresholds)


def _comparison_case(rng, levels, t, wrong_dtype, shape):
    """Random images over ``levels``: cutopo must equal NumPy's ``image <= t`` (in the result
    type), on an image where comparing in ``wrong_dtype`` would give another curve."""
    for _ in range(200):
        image = rng.choice(levels, size=shape)
        expected = expected_ecc(image, t, 1)
        wrong = skimage_ecc(image.astype(wrong_dtype), t.astype(wrong_dtype), 1)
        if not np.array_equal(expected, wrong):
            break
    else:
        pytest.fail("no discriminating image found (test bug)")
    for conn in (1, image.ndim):
        np.testing.assert_array_equal(cutopo.ecc(image, t, connectivity=conn),
                                      expected_ecc(image, t, conn), err_msg=repr(image))


def test_comparison_dtype_float32_image_float64_thresholds(rng):
    base = np.float32(rng.uniform(1, 2))
    up = np.nextafter(base, np.float32(np.inf))
    # Between the two float32 values: float32(t) rounds to one of them.
    t_hi = float(base) + (float(up) - float(base)) * 0.75   # rounds up to `up` in float32
    t_lo = float(base) - (float(up) - float(base)) * 0.25   # rounds to `base` in float32
    t = np.array([t_lo, t_hi])
    assert np.float32(t_hi) == up and np.float32(t_lo) == base
    assert np.result_type(np.float32, t) == np.float64
    _comparison_case(rng, np.array([base, up], dtype=np.float32), t, np.float32, (6, 7))


def test_comparison_dtype_int32_image_float32_thresholds(rng):
    # int32 and float32 compare in float64: 2**24 + 1 is not <= 2**24, though float32 says so.
    t = np.array([2**24, 2**24 + 2], dtype=np.float32)
    assert np.result_type(np.int32, t) == np.float64
    _comparison_case(rng, np.array([2**24 - 1, 2**24 + 1, 2**24 + 3], dtype=np.int32), t,
                     np.float32, (5, 6))


def test_comparison_dtype_uint16_image_float16_thresholds(rng):
    # uint16 and float16 compare in float32; in float16, 2049 would round to 2048.
    t = np.array([2048, 4096], dtype=np.float16)
    assert np.result_type(np.uint16, t) == np.float32
    _comparison_case(rng, np.array([2047, 2049, 4097], dtype=np.uint16), t, np.float16, (5, 6, 3))


def test_comparison_dtype_float64_image_float32_thresholds(rng):
    t32 = np.float32(rng.uniform(0.1, 0.9))
    above = float(t32) + float(np.spacing(t32)) / 4          # rounds to t32 in float32
    t = np.array([t32], dtype=np.float32)
    _comparison_case(rng, np.array([float(t32), above, float(t32) - 1.0]), t, np.float32, (6, 6))


def test_comparison_dtype_float16_image(rng):
    image = random_image(rng, (6, 7), "float16", ties=True, specials=True)
    for tdtype in (np.float16, np.float32, np.float64, np.int64):
        t = np.sort(np.concatenate([np.unique(image[np.isfinite(image)]).astype(np.float64),
                                    [-2.0, 0.0, 3.0]])).astype(tdtype)
        t = np.unique(t)
        for conn in (1, 2):
            np.testing.assert_array_equal(cutopo.ecc(image, t, connectivity=conn),
                                          expected_ecc(image, t, conn))


# ---------------------------------------------------------------------------------------------
# Threshold counts and linear_thresholds


def _independent_linear(image, n):
    image = np.asarray(image)
    if image.dtype.kind == "f":
        finite = image[np.isfinite(image)].astype(np.float64)
        return np.linspace(finite.min(), finite.max(), n).astype(image.dtype)
    return np.linspace(float(image.astype(np.float64).min()), float(image.astype(np.float64).max()), n)


@pytest.mark.parametrize("dtype", DTYPES)
def test_int_count_thresholds(rng, dtype):
    for ndim in (2, 3):
        image = random_image(rng, random_shape(rng, ndim, 2, 6), dtype,
                             specials=np.dtype(dtype).kind == "f")
        if np.dtype(dtype).kind == "f" and not np.isfinite(image).any():
            image.flat[0] = 1.0
        n = int(rng.integers(1, 30))
        t = _independent_linear(image, n)
        for conn in (1, ndim):
            got = cutopo.ecc(image, n, connectivity=conn)
            assert got.shape == (n,)
            np.testing.assert_array_equal(got, expected_ecc(image, t, conn))
            np.testing.assert_array_equal(got, cutopo.ecc(image, cutopo.linear_thresholds(image, n),
                                                          connectivity=conn))
        np.testing.assert_array_equal(cutopo.ecc(image, np.int64(n)), cutopo.ecc(image, n))


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_thresholds_endpoints(rng, dtype):
    image = random_image(rng, (7, 9), dtype, specials=np.dtype(dtype).kind == "f")
    image.flat[3] = 1  # at least one finite pixel
    if np.dtype(dtype).kind == "f":
        finite = image[np.isfinite(image)]
        lo, hi = finite.min(), finite.max()
    else:
        lo, hi = image.min(), image.max()
    for n in (2, 3, 17):
        t = cutopo.linear_thresholds(image, n)
        assert isinstance(t, np.ndarray) and t.shape == (n,)
        assert t.dtype == (image.dtype if np.dtype(dtype).kind == "f" else np.float64)
        assert t[0] == lo and t[-1] == hi
        assert np.all(np.diff(t.astype(np.float64)) >= 0)
    t = cutopo.linear_thresholds(image, 1)
    assert t.shape == (1,) and t[0] == lo
    np.testing.assert_array_equal(cutopo.ecc(image, 1), expected_ecc(image, t, 1))


@pytest.mark.parametrize("dtype", DTYPES)
def test_finite_range_in_tiles(rng, dtype):
    """The NumPy finite range (linear_thresholds' ends) scanned in tiles of a few elements (every
    tile shape of _tiles: whole images, planes, row ranges) equals the minimum and maximum of the
    finite values; tiles with no finite value are skipped; None when no value is finite."""
    from cutopo import _ecc_numpy

    for shape in ((1,), (5, 7), (3, 4, 9), (2, 3, 5, 6)):
        image = random_image(rng, shape, dtype, specials=np.dtype(dtype).kind == "f")
        finite = image[np.isfinite(image)] if image.dtype.kind == "f" else image.ravel()
        want = (finite.min().item(), finite.max().item()) if finite.size else None
        for step in (1, 2, 5, 13, 10**6):
            assert _ecc_numpy.finite_range(image, step) == want, (shape, step)
    if np.dtype(dtype).kind == "f":
        junk = np.full((4, 6), np.nan, dtype=dtype)
        junk[1, 2], junk[3, 5] = np.inf, -np.inf
        assert _ecc_numpy.finite_range(junk, 5) is None
        junk[2, 2] = -0.0
        assert _ecc_numpy.finite_range(junk, 5) == (0.0, 0.0)


def test_linear_thresholds_constant_image():
    image = np.full((3, 4), 7, dtype=np.int16)
    np.testing.assert_array_equal(cutopo.linear_thresholds(image, 3), [7.0, 7.0, 7.0])
    np.testing.assert_array_equal(cutopo.ecc(image, 3), [1, 1, 1])


# ---------------------------------------------------------------------------------------------
# euler_contributions


def slow_contributions(image, connectivity):
    """c(p) from the ownership rule of ecc.md 5.2/5.3, one pixel and one neighbour at a time.

    Order: p < q iff (value, linear C index) of p is smaller, with NaN as +inf and -0.0 == 0.0;
    positions outside the image never precede anything.
    V: p owns the box spanned by p and p + o (all its vertices inside the image) when every
       other vertex of the box precedes p; the box has dimension |o|.
    T: p owns its face towards o (dimension ndim - |o|; o = 0 is the pixel itself) when p
       precedes every other pixel of the image that contains the face.
    """
    f = np.asarray(image)
    ndim, shape = f.ndim, f.shape
    tconn = connectivity == ndim

    def key(idx):
        v = float(f[idx])
        if math.isnan(v):
            v = math.inf
        return (v + 0.0, np.ravel_multi_index(idx, shape))

    out = np.zeros(shape, dtype=np.int64)
    for p in np.ndindex(shape):
        kp = key(p)
        c = 0
        for o in itertools.product((-1, 0, 1), repeat=ndim):
            k = sum(1 for v in o if v)
            others, outside = [], False
            for sub in itertools.product(*[(0, v) if v else (0,) for v in o]):
                if not any(sub):
                    continue
                q = tuple(p[a] + sub[a] for a in range(ndim))
                if all(0 <= q[a] < shape[a] for a in range(ndim)):
                    others.append(key(q))
                else:
                    outside = True
            if tconn:
                if all(kp < kq for kq in others):
                    c += (-1) ** (ndim - k)
            elif not outside and all(kq < kp for kq in others):
                c += (-1) ** k
        out[p] = c
    return out


@pytest.mark.parametrize("connectivity", ["V", "T"])
@pytest.mark.parametrize("ndim", [2, 3])
@pytest.mark.parametrize("dtype", DTYPES)
def test_contributions_match_slow_ownership(rng, dtype, ndim, connectivity):
    conn = 1 if connectivity == "V" else ndim
    for trial in range(3):
        shape = random_shape(rng, ndim, 1, 7 if ndim == 2 else 4)
        image = random_image(rng, shape, dtype, ties=trial != 1,
                             specials=np.dtype(dtype).kind == "f" and trial == 2)
        c = cutopo.euler_contributions(image, connectivity=conn)
        assert c.dtype == np.int8 and c.shape == shape and isinstance(c, np.ndarray)
        np.testing.assert_array_equal(c, slow_contributions(image, conn), err_msg=repr(image))


def test_contributions_negative_zero():
    """-0.0 and 0.0 are tied: ownership goes by linear index only."""
    image = np.array([[0.0, -0.0, 0.0], [-0.0, -0.0, 0.0]], dtype=np.float32)
    for conn in (1, 2):
        np.testing.assert_array_equal(cutopo.euler_contributions(image, connectivity=conn),
                                      slow_contributions(np.zeros_like(image), conn))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ndim", [2, 3])
def test_contributions_invariants(rng, dtype, ndim):
    for trial in range(4):
        shape = random_shape(rng, ndim, 1, 12 if ndim == 2 else 7)
        image = random_image(rng, shape, dtype, ties=trial % 2 == 0,
                             specials=np.dtype(dtype).kind == "f" and trial >= 2)
        for conn in (1, ndim):
            c = cutopo.euler_contributions(image, connectivity=conn)
            lo, hi = RANGES[(ndim, conn == ndim)]
            assert c.dtype == np.int8
            assert int(c.astype(np.int64).sum()) == 1
            assert c.min() >= lo and c.max() <= hi, (c.min(), c.max())
            # The cumulative histogram of c over the pixel values is the ECC.
            if image.dtype.kind == "f":  # thresholds are finite: so are the values tested
                vals = np.unique(image[np.isfinite(image)])
                key = np.where(np.isnan(image), np.inf, image)
            else:
                vals = np.unique(image)
                key = image
            if vals.size == 0:
                continue
            curve = np.array([int(c[key <= v].astype(np.int64).sum()) for v in vals])
            np.testing.assert_array_equal(curve, skimage_ecc(image, vals, conn))


# (ndim, construction, which neighbours are set apart) -> c at the centre, by hand:
# V: 1 - #edges owned + #squares owned - #cubes owned; T: (-1)^d + faces - edges + vertices owned.
_EXTREMES = {
    (2, "V", "faces precede"): 1 - 4,                    # -3
    (2, "V", "faces+diagonals precede"): 1 - 4 + 4,      # 1
    (2, "T", "faces later"): 1 - 4,                      # -3
    (2, "T", "faces+diagonals later"): 1 - 4 + 4,        # 1
    (3, "V", "faces precede"): 1 - 6,                    # -5
    (3, "V", "faces+diagonals precede"): 1 - 6 + 12,     # 7
    (3, "V", "all precede"): 1 - 6 + 12 - 8,             # -1
    (3, "T", "faces later"): -1 + 6,                     # 5
    (3, "T", "faces+diagonals later"): -1 + 6 - 12,      # -7
    (3, "T", "all later"): -1 + 6 - 12 + 8,              # 1
}


@pytest.mark.parametrize("case", sorted(_EXTREMES, key=str))
def test_contributions_range_extremes(case):
    """The documented extremes of c (ecc.md 5.4) are attained, with hand-computed values."""
    ndim, construction, what = case
    kinds = {"faces": {1}, "faces+diagonals": {1, 2}, "all": set(range(1, ndim + 1))}[what.split()[0]]
    # V: preceding neighbours are smaller (0 < 1), the rest larger (2). T: "later" ones are
    # larger (2), the rest smaller (0).
    inside, outside = (0, 2) if construction == "V" else (2, 0)
    block = np.empty((3,) * ndim, dtype=np.int16)
    for o in itertools.product((-1, 0, 1), repeat=ndim):
        k = sum(1 for v in o if v)
        block[tuple(v + 1 for v in o)] = 1 if k == 0 else (inside if k in kinds else outside)
    conn = 1 if construction == "V" else ndim
    centre = (1,) * ndim
    expected = _EXTREMES[case]
    assert slow_contributions(block, conn)[centre] == expected
    assert cutopo.euler_contributions(block, connectivity=conn)[centre] == expected
    lo, hi = RANGES[(ndim, construction == "T")]
    assert lo <= expected <= hi


def test_contributions_extremes_cover_the_ranges():
    for (ndim, tconn), (lo, hi) in RANGES.items():
        vals = {v for (d, c, _), v in _EXTREMES.items() if d == ndim and (c == "T") == tconn}
        assert min(vals) == lo and max(vals) == hi


# ---------------------------------------------------------------------------------------------
# Duality (ecc.md 5.6): an independent second oracle through skimage on the complement


@pytest.mark.parametrize("ndim", [2, 3])
def test_duality(rng, ndim):
    for _ in range(5):
        image = random_image(rng, random_shape(rng, ndim, 1, 8 if ndim == 2 else 6), "float32",
                             ties=True, specials=True)
        t = random_thresholds(rng, image)
        sign = (-1) ** (ndim + 1)
        b = [np.pad(~(image <= tk), 1, constant_values=True) for tk in t]
        dual_v = [sign * (euler_number(bk, connectivity=ndim) - 1) for bk in b]
        dual_t = [sign * (euler_number(bk, connectivity=1) - 1) for bk in b]
        np.testing.assert_array_equal(cutopo.ecc(image, t, connectivity=1), dual_v)
        np.testing.assert_array_equal(cutopo.ecc(image, t, connectivity=ndim), dual_t)


# ---------------------------------------------------------------------------------------------
# Hypothesis properties


@st.composite
def images(draw, dtypes=tuple(DTYPES), allow_posinf=True):
    dtype = np.dtype(draw(st.sampled_from(dtypes)))
    shape = draw(hnp.array_shapes(min_dims=2, max_dims=3, min_side=1, max_side=5))
    if dtype == np.bool_:
        elements = st.booleans()
    elif dtype.kind in "iu":
        info = np.iinfo(dtype)
        pool = draw(st.lists(st.integers(int(info.min), int(info.max)), min_size=1, max_size=4))
        elements = st.one_of(st.sampled_from(pool), st.integers(int(info.min), int(info.max)))
    else:
        width = dtype.itemsize * 8
        floats = st.floats(width=width, allow_nan=True, allow_infinity=allow_posinf,
                           allow_subnormal=True)
        if not allow_posinf:
            floats = st.floats(width=width, allow_nan=True, allow_infinity=False,
                               allow_subnormal=True) | st.sampled_from([-np.inf, np.nan])
        pool = draw(st.lists(st.floats(width=width, allow_nan=False, allow_infinity=False),
                             min_size=1, max_size=3))
        elements = st.one_of(st.sampled_from(pool), floats)
    return draw(hnp.arrays(dtype, shape, elements=elements))


@settings(deadline=None, max_examples=50)
@given(image=images(), data=st.data())
def test_property_contributions_sum_to_one(image, data):
    conn = data.draw(st.sampled_from([1, image.ndim]))
    c = cutopo.euler_contributions(image, connectivity=conn)
    assert int(c.astype(np.int64).sum()) == 1
    lo, hi = RANGES[(image.ndim, conn == image.ndim)]
    assert lo <= c.min() and c.max() <= hi


@settings(deadline=None, max_examples=50)
@given(dtype=st.sampled_from(DTYPES), data=st.data())
def test_property_constant_image(dtype, data):
    dtype = np.dtype(dtype)
    shape = data.draw(hnp.array_shapes(min_dims=2, max_dims=3, min_side=1, max_side=6))
    value = data.draw(hnp.from_dtype(dtype, allow_nan=False, allow_infinity=False))
    image = np.full(shape, value, dtype=dtype)
    v = float(value)
    below, above = np.nextafter(v, -np.inf), np.nextafter(v, np.inf)
    t = [(x, e) for x, e in ((below, 0), (v, 1), (above, 1)) if np.isfinite(x)]  # +-max float
    conn = data.draw(st.sampled_from([1, len(shape)]))
    np.testing.assert_array_equal(cutopo.ecc(image, np.array([x for x, _ in t]), connectivity=conn),
                                  [e for _, e in t])
    if dtype.kind in "biu":
        ti = np.array([int(value) - 1, int(value), int(value) + 1], dtype=np.int64)
        np.testing.assert_array_equal(cutopo.ecc(image, ti, connectivity=conn), [0, 1, 1])


@settings(deadline=None, max_examples=50)
@given(image=images(allow_posinf=False), data=st.data())
def test_property_top_threshold_is_chi_of_non_nan_set(image, data):
    conn = data.draw(st.sampled_from([1, image.ndim]))
    if image.dtype.kind == "f":
        finite = image[np.isfinite(image)]
        top = float(finite.max()) if finite.size else 0.0
        present = ~np.isnan(image)
    else:
        top = float(image.max())
        present = np.ones(image.shape, dtype=bool)
    # any threshold at or above the largest finite value (1e300 alone can be below it)
    top = data.draw(st.sampled_from([top, top + 1.0, max(top, 1e300)]))
    got = cutopo.ecc(image, np.array([top]), connectivity=conn)
    assert got.tolist() == [euler_number(present, connectivity=conn)]


@settings(deadline=None, max_examples=50)
@given(image=images(), data=st.data())
def test_property_matches_skimage(image, data):
    conn = data.draw(st.sampled_from([1, image.ndim]))
    vals = image.astype(np.float64)
    big = np.finfo(np.float64).max
    t = np.unique(np.concatenate([[-big], vals[np.isfinite(vals)], [big]]))
    np.testing.assert_array_equal(cutopo.ecc(image, t, connectivity=conn),
                                  skimage_ecc(image, t, conn))


# ---------------------------------------------------------------------------------------------
# Documentation


def test_docstring_examples():
    result = doctest.testmod(importlib.import_module("cutopo.ecc"), verbose=False, report=True)
    assert result.attempted > 0
    assert result.failed == 0


@pytest.mark.parametrize("slots", [1, 132, 792])
@pytest.mark.parametrize("tile_y", [32, 64, 80, 96])
def test_histogram_geometry_covers_every_image_within_the_kernels_bounds(monkeypatch, slots, tile_y):
    """The launch geometry (no GPU: the device's resident blocks are stubbed): at least one
    block per image and at most one per tile, chunks of 2..64 planes, and few enough pixels per
    block for its int32 shared histogram; 3D volumes of under two waves take _plan's geometry.
    Tiles of 32 rows and of 64 to 96 (2D histograms of many tiles, _ecc_cupy.tall_rows)."""
    from cutopo import _ecc_cupy

    monkeypatch.setattr(_ecc_cupy, "resident_blocks", lambda *args, **kw: slots)
    cases = [((5, 7), 1, 2), ((1024, 1024), 1, 2), ((8192, 8192), 1, 2), ((1024, 1024), 64, 2),
             ((65536, 40000), 1, 2), ((3, 4, 5), 1, 3), ((128, 128, 128), 1, 3),
             ((1024, 1024, 1024), 1, 3), ((300, 200, 100), 4, 3), ((2049, 1024, 1024), 1, 3)]
    for spatial, nimg, ndim in cases:
        (nz, ny, nx), zchunk, blocks = _ecc_cupy._histogram_geometry(None, nimg, spatial, ndim, 0, 64, tile_y)
        assert (nz, ny, nx) == ((1,) + spatial if ndim == 2 else spatial)
        tiles_yx = -(-ny // tile_y) * -(-nx // 64)
        assert (zchunk == 1) if ndim == 2 else (2 <= zchunk <= 64), (spatial, zchunk)
        tiles = tiles_yx * -(-nz // zchunk)
        assert 1 <= blocks <= tiles, (spatial, blocks, tiles)
        # the kernel's blocks each sweep at most ceil(tiles / blocks) tiles of one image
        assert -(-tiles // blocks) * zchunk * tile_y * 64 <= _ecc_cupy.MAX_PIXELS_PER_BLOCK \
            or blocks == tiles, (spatial, blocks)
        if ndim == 3 and slots > 1:
            planned = _ecc_cupy._plan(None, nimg, spatial, ndim, 0, 64, tile_y)
            if tiles_yx * nimg * -(-nz // zchunk) < 2 * slots:
                assert (zchunk, blocks) == planned[1:]


@pytest.mark.parametrize("slots", [1, 264, 660])
def test_3d_sweep_geometry_takes_one_tile_per_block(monkeypatch, slots):
    """The launch geometry of the 3D scalar sweeps (_ecc_cupy.sweep_geometry: the soft ECC's,
    the ECT's orthant maps; no GPU: the device's resident blocks are stubbed): chunks of 1..64 planes, one tile per block up to HIST_WAVES_3D waves, at least
    one block per image, few enough pixels per block; at the H100/H200's 660 resident blocks
    the chunk lengths that measured fastest for the soft ECC's forward (benchmarks/RESULTS.md,
    thirty-fifth session)."""
    from cutopo import _ecc_cupy

    monkeypatch.setattr(_ecc_cupy, "resident_blocks", lambda *args, **kw: slots)
    fastest = {(1, 256, 256, 256): 8, (1, 128, 128, 128): 4, (4, 96, 96, 96): 4, (1, 96, 96, 96): 2,
               (1, 64, 64, 64): 1}
    cases = list(fastest) + [(1, 3, 4, 5), (2, 1, 40, 70), (1, 1024, 1024, 1024), (3, 300, 200, 100),
                             (1, 4097, 4096, 4096)]
    for nimg, *spatial in cases:
        (nz, ny, nx), zchunk, blocks = _ecc_cupy.sweep_geometry(None, nimg, tuple(spatial), 3, 0, 32)
        assert (nz, ny, nx) == tuple(spatial)
        assert 1 <= zchunk <= 64, (spatial, zchunk)
        tiles = -(-ny // 32) * -(-nx // 32) * -(-nz // zchunk)
        assert 1 <= blocks <= tiles, (spatial, blocks, tiles)
        if tiles * nimg <= _ecc_cupy.HIST_WAVES_3D * slots:
            assert blocks == tiles, (spatial, blocks, tiles)
        assert -(-tiles // blocks) * zchunk * 32 * 32 <= _ecc_cupy.MAX_PIXELS_PER_BLOCK, (spatial, blocks)
        if slots == 660 and (nimg, *spatial) in fastest:
            assert zchunk == fastest[(nimg, *spatial)], (spatial, zchunk)


@pytest.mark.parametrize("itemsize, blocks_64, blocks_32", [(4, 2048, 2048), (2, 2048, 2048), (1, 1024, 2048)])
def test_2d_histogram_blocks_take_one_tall_tile_of_wider_pixels(monkeypatch, itemsize, blocks_64, blocks_32):
    """2D blocks take at least two 32-row tiles, or one of 64 rows (two of 64 for one-byte
    images): the blocks of a 2048 x 4096 image at 792 resident blocks (the H100/H200 at 6 per
    multiprocessor), where that bound decides."""
    from cutopo import _ecc_cupy

    monkeypatch.setattr(_ecc_cupy, "resident_blocks", lambda *args, **kw: 792)
    for tile_y, expected in ((64, blocks_64), (32, blocks_32)):
        blocks = _ecc_cupy._histogram_geometry(None, 1, (2048, 4096), 2, 0, 64, tile_y, itemsize)[2]
        assert blocks == expected, (tile_y, blocks)
