"""CPU tests of ``boundary="periodic"`` (the cubical complex of the torus) in cutopo.ecc,
cutopo.euler_contributions and cutopo.soft_ecc.

Expected values come from the torus-cell enumerations of ``oracles.py`` (``periodic_ecc_oracle``,
``periodic_contributions_oracle``, ``periodic_cells``), from the box oracle and skimage on images
whose last slice along every axis is NaN (then the wrap adds nothing), and from closed forms
(Euler characteristics of circles, tori, wedges and punctured tori), never from cutopo itself.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import cutopo
from cutopo import _checks
from cutopo import _ecc_numpy
from oracles import (oracle_ecc, periodic_cells, periodic_contributions_oracle,
                     periodic_ecc_oracle, skimage_ecc, torus_cells)

DTYPES = ["bool", "uint8", "uint16", "int16", "int32", "float16", "float32", "float64"]
FLOATS = ["float16", "float32", "float64"]
RANGES = {(2, False): (-3, 1), (2, True): (-3, 1), (3, False): (-5, 7), (3, True): (-7, 5)}
P = "periodic"


# ---------------------------------------------------------------------------------------------
# Random inputs


def random_shape(rng, ndim, lo=3, hi=7):
    return tuple(int(s) for s in rng.integers(lo, hi, size=ndim, endpoint=True))


def random_image(rng, shape, dtype, *, ties=False, nan=0.0):
    """A random image; ``ties``: 2-4 distinct levels only; ``nan``: fraction of NaN pixels."""
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return rng.random(shape) < rng.uniform(0.25, 0.75)
    if ties:
        levels = rng.integers(0, 100, size=int(rng.integers(2, 5)))
        img = rng.choice(levels, size=shape).astype(dtype)
    elif dtype.kind in "iu":
        info = np.iinfo(dtype)
        img = rng.integers(info.min, info.max, size=shape, endpoint=True, dtype=dtype)
    else:
        img = (rng.normal(size=shape) * 10.0).astype(dtype)
    if nan and dtype.kind == "f":
        img[rng.random(shape) < nan] = np.nan
    return img


def random_thresholds(rng, image):
    """Sorted thresholds: pixel values, midpoints, and values below/above every pixel."""
    image = np.asarray(image)
    if image.dtype == np.bool_:
        return np.array([-1, 0, 1])
    vals = np.unique(image[~np.isnan(image)] if image.dtype.kind == "f" else image).astype(np.float64)
    if vals.size == 0:
        return np.array([-1.0, 0.0, 1.0])
    mids = (vals[:-1] + vals[1:]) / 2
    t = np.concatenate([rng.choice(vals, size=min(8, vals.size), replace=False),
                        rng.choice(mids, size=min(3, mids.size), replace=False),
                        [vals[0] - 1.0 - abs(vals[0]), vals[-1] + 1.0 + abs(vals[-1])]])
    t = np.sort(t)
    if image.dtype.kind in "iu":
        return t if rng.random() < 0.5 else np.unique(np.floor(t).astype(np.int64))
    if rng.random() < 0.5:  # thresholds of the image's own dtype (comparison in that dtype)
        t = np.sort(t.astype(image.dtype))
        t = t[np.isfinite(t)]
    return t


def nan_framed(rng, shape, dtype):
    """(image with NaN on the last slice along every axis, its NaN-free inner block)."""
    img = random_image(rng, shape, dtype, ties=rng.random() < 0.5)
    inner = img[tuple(slice(0, s - 1) for s in shape)].copy()
    for a in range(len(shape)):
        idx = [slice(None)] * len(shape)
        idx[a] = -1
        img[tuple(idx)] = np.nan
    return img, inner


def sigmoid(u):
    return np.where(u >= 0, 1 / (1 + np.exp(-np.abs(u))), np.exp(-np.abs(u)) / (1 + np.exp(-np.abs(u))))


def dense_soft(image, t, scale, connectivity):
    """Per-cell relaxation: sum over torus cells of (-1)^dim sigmoid(scale (t - f(cell)))."""
    values, present, dims = periodic_cells(image, np.float64, connectivity)
    sign = np.where(dims % 2 == 1, -1.0, 1.0)[present]
    u = scale * (np.asarray(t, np.float64)[None, :] - values[present][:, None])
    return (sign[:, None] * sigmoid(u)).sum(axis=0)


# ---------------------------------------------------------------------------------------------
# The periodic oracles themselves


@pytest.mark.parametrize("shape", [(3, 3), (3, 5), (4, 7), (3, 3, 3), (3, 4, 5)])
def test_oracle_cell_counts(shape):
    ndim = len(shape)
    N = math.prod(shape)
    for conn in (1, ndim):
        dims = np.array([d for _, d in torus_cells(shape, conn)])
        # dim-k cells: an axis subset of size k per base point, on both constructions.
        assert np.bincount(dims, minlength=ndim + 1).tolist() == [
            math.comb(ndim, k) * N for k in range(ndim + 1)]
        assert int(np.sum((-1) ** dims)) == 0
        # Every cell is distinct (no two share the same pixels and dimension).
        keys = {(tuple(p), d) for p, d in torus_cells(shape, conn)}
        assert len(keys) == dims.size


@pytest.mark.parametrize("ndim", [2, 3])
def test_oracle_with_nan_frame_equals_box_oracle(rng, ndim):
    """A NaN last slice along every axis: the torus complex minus the cells it kills is the
    box complex of the inner block, in both constructions (V: every wrapping cell has a NaN
    vertex; T: the wrap faces keep the values of the inner pixels)."""
    for _ in range(6):
        shape = random_shape(rng, ndim, 3, 7 if ndim == 2 else 5)
        img, inner = nan_framed(rng, shape, "float64")
        t = random_thresholds(rng, inner)
        for conn in (1, ndim):
            want = skimage_ecc(inner, t, conn)
            np.testing.assert_array_equal(oracle_ecc(inner, t, conn), want)
            np.testing.assert_array_equal(periodic_ecc_oracle(img, t, conn), want)


def test_oracle_rejects_short_axes():
    for shape in [(2, 5), (5, 1), (3, 3, 2)]:
        with pytest.raises(ValueError):
            periodic_ecc_oracle(np.zeros(shape), [0.0])


# ---------------------------------------------------------------------------------------------
# ecc and euler_contributions against the oracles


@pytest.mark.parametrize("connectivity", ["V", "T"])
@pytest.mark.parametrize("ndim", [2, 3])
@pytest.mark.parametrize("dtype", DTYPES)
def test_ecc_matches_periodic_oracle(rng, dtype, ndim, connectivity):
    conn = 1 if connectivity == "V" else ndim
    for trial in range(6 if ndim == 2 else 3):
        shape = random_shape(rng, ndim)
        image = random_image(rng, shape, dtype, ties=trial % 2 == 1,
                             nan=0.2 if trial % 3 == 2 else 0.0)
        t = random_thresholds(rng, image)
        got = cutopo.ecc(image, t, connectivity=conn, boundary=P)
        assert isinstance(got, np.ndarray) and got.dtype == np.int64 and got.shape == (len(t),)
        np.testing.assert_array_equal(got, periodic_ecc_oracle(image, t, conn),
                                      err_msg=f"shape={shape} thresholds={t!r}")
        np.testing.assert_array_equal(cutopo.ecc(image, t, ndim=ndim, connectivity=conn, boundary=P),
                                      got)


@pytest.mark.parametrize("connectivity", ["V", "T"])
@pytest.mark.parametrize("ndim", [2, 3])
def test_contributions_follow_the_real_linear_index(rng, ndim, connectivity):
    """c equals the ownership rule with the order (value, real C-order index): on a wrapping
    neighbour the tie-break is not the sign of the offset (a constant image shows it)."""
    conn = 1 if connectivity == "V" else ndim
    for trial in range(8 if ndim == 2 else 4):
        shape = random_shape(rng, ndim, 3, 6 if ndim == 2 else 4)
        dtype = ["uint8", "float32", "float64", "int16"][trial % 4]
        if trial == 0:
            image = np.full(shape, 7, dtype=dtype)
        else:
            image = random_image(rng, shape, dtype, ties=trial % 2 == 1, nan=0.15 * (trial % 3 == 0))
        c = cutopo.euler_contributions(image, connectivity=conn, boundary=P)
        assert c.dtype == np.int8 and c.shape == image.shape
        np.testing.assert_array_equal(c, periodic_contributions_oracle(image, conn),
                                      err_msg=f"{dtype} {shape}\n{image!r}")


def test_contributions_of_a_constant_torus_are_not_translation_invariant():
    """The documented tie-break: the first pixel owns nothing but itself (c = 1 in V)."""
    c = cutopo.euler_contributions(np.zeros((3, 4)), boundary=P)
    np.testing.assert_array_equal(c, [[1, 0, 0, -1], [0, 0, 0, 0], [-1, 0, 0, 1]])
    np.testing.assert_array_equal(c, periodic_contributions_oracle(np.zeros((3, 4)), 1))


@pytest.mark.parametrize("ndim", [2, 3])
def test_ecc_with_nan_frame_equals_box_on_inner_block(rng, ndim):
    """Larger images than the oracle can enumerate, against skimage on the inner block."""
    shapes = [(40, 57), (3, 90), (64, 3)] if ndim == 2 else [(9, 14, 11), (3, 20, 4)]
    for shape in shapes:
        for dtype in ("float32", "float64", "float16"):
            img, inner = nan_framed(rng, shape, dtype)
            t = random_thresholds(rng, inner)
            for conn in (1, ndim):
                want = skimage_ecc(inner, t, conn)
                np.testing.assert_array_equal(cutopo.ecc(img, t, connectivity=conn, boundary=P), want)
                np.testing.assert_array_equal(cutopo.ecc(inner, t, connectivity=conn), want)


# ---------------------------------------------------------------------------------------------
# Invariants


@pytest.mark.parametrize("connectivity", ["V", "T"])
def test_contributions_sum_to_zero_and_stay_in_range(rng, connectivity):
    cases = [((5, 7, 9), 2), ((2, 3, 6, 5), 2), ((3, 4, 5, 6), 3), ((1, 3, 3), 2), ((2, 3, 3, 3), 3),
             ((17, 23), 2), ((8, 9, 10), 3)]
    for shape, ndim in cases:
        conn = 1 if connectivity == "V" else ndim
        for dtype in ("uint8", "float32"):
            image = random_image(rng, shape, dtype, ties=rng.random() < 0.5, nan=0.1)
            c = cutopo.euler_contributions(image, ndim=ndim, connectivity=conn, boundary=P)
            sums = c.reshape(shape[:len(shape) - ndim] + (-1,)).sum(axis=-1, dtype=np.int64)
            assert (sums == 0).all(), sums
            lo, hi = RANGES[(ndim, conn != 1)]
            assert lo <= c.min() and c.max() <= hi


@pytest.mark.parametrize("connectivity", ["V", "T"])
@pytest.mark.parametrize("ndim", [2, 3])
def test_cumulative_histogram_equals_ecc(rng, ndim, connectivity):
    conn = 1 if connectivity == "V" else ndim
    for dtype in ("uint16", "float32", "float64", "bool"):
        shape = (2,) + random_shape(rng, ndim, 3, 12 if ndim == 2 else 6)
        image = random_image(rng, shape, dtype, ties=True, nan=0.1)
        t = random_thresholds(rng, image)
        got = cutopo.ecc(image, t, ndim=ndim, connectivity=conn, boundary=P)
        c = cutopo.euler_contributions(image, ndim=ndim, connectivity=conn, boundary=P)
        img, tt = image.astype(np.result_type(image, t)), np.asarray(t).astype(np.result_type(image, t))
        for b in range(2):
            want = [int(c[b][img[b] <= tk].sum(dtype=np.int64)) for tk in tt]
            np.testing.assert_array_equal(got[b], want)


@pytest.mark.parametrize("dtype", DTYPES)
def test_constant_image_is_a_torus(dtype):
    for shape in [(3, 3), (4, 9), (3, 3, 3), (5, 4, 3)]:
        image = np.ones(shape, dtype=dtype)
        for conn in (1, len(shape)):
            # Empty below the value, the whole torus (chi = 0) from it on.
            np.testing.assert_array_equal(cutopo.ecc(image, [-1, 0, 1, 2], connectivity=conn, boundary=P),
                                          [0, 0, 0, 0])
            np.testing.assert_array_equal(cutopo.ecc(image, [-1, 0, 1, 2], connectivity=conn),
                                          [0, 0, 1, 1])
            assert int(cutopo.euler_contributions(image, connectivity=conn, boundary=P).sum()) == 0


@pytest.mark.parametrize("ndim", [2, 3])
def test_ecc_invariant_under_torus_symmetries(rng, ndim):
    """Cyclic shifts, flips and axis permutations are automorphisms of the torus complex."""
    for _ in range(4):
        shape = random_shape(rng, ndim, 3, 8 if ndim == 2 else 5)
        image = random_image(rng, shape, "float32", ties=True, nan=0.1)
        t = random_thresholds(rng, image)
        for conn in (1, ndim):
            ref = cutopo.ecc(image, t, connectivity=conn, boundary=P)
            shifted = np.roll(image, tuple(int(s) for s in rng.integers(0, 5, size=ndim)),
                              axis=tuple(range(ndim)))
            for variant in (shifted, np.flip(image, axis=int(rng.integers(ndim))),
                            np.transpose(image, rng.permutation(ndim))):
                np.testing.assert_array_equal(cutopo.ecc(variant, t, connectivity=conn, boundary=P), ref)


@given(hnp.arrays(np.uint8, hnp.array_shapes(min_dims=2, max_dims=3, min_side=3, max_side=5),
                  elements=st.integers(0, 3)))
def test_hypothesis_periodic_ecc_matches_oracle(image):
    t = np.arange(-1, 5)
    for conn in (1, image.ndim):
        np.testing.assert_array_equal(cutopo.ecc(image, t, connectivity=conn, boundary=P),
                                      periodic_ecc_oracle(image, t, conn))
        c = cutopo.euler_contributions(image, connectivity=conn, boundary=P)
        assert int(c.sum()) == 0


# ---------------------------------------------------------------------------------------------
# Closed forms


def _mask_ecc(mask, conn):
    """chi of the sublevel set {image <= 0} where image = 0 on ``mask`` and 1 elsewhere."""
    image = np.where(mask, 0, 1).astype(np.uint8)
    got = cutopo.ecc(image, [0], connectivity=conn, boundary=P)[0]
    assert got == periodic_ecc_oracle(image, [0], conn)[0]
    return got


@pytest.mark.parametrize("shape", [(3, 3), (5, 7), (6, 4)])
def test_closed_forms_2d(shape):
    H, W = shape
    row = np.zeros(shape, bool)
    row[1] = True
    col = np.zeros(shape, bool)
    col[:, 2] = True
    pixel = np.zeros(shape, bool)
    pixel[H - 1, W - 1] = True
    everything_but_one = ~pixel
    for conn in (1, 2):
        assert _mask_ecc(row, conn) == 0            # a circle (V) / an annulus (T)
        assert _mask_ecc(col, conn) == 0
        assert _mask_ecc(pixel, conn) == 1          # a point / a square
        assert _mask_ecc(everything_but_one, conn) == -1   # a punctured torus
        assert _mask_ecc(row | col, conn) == -1     # two circles (annuli) meeting once
        assert _mask_ecc(np.ones(shape, bool), conn) == 0   # the torus


@pytest.mark.parametrize("shape", [(3, 3, 3), (4, 5, 3)])
def test_closed_forms_3d(shape):
    H = shape[1]
    line = np.zeros(shape, bool)
    line[1, 2, :] = True
    plane = np.zeros(shape, bool)
    plane[:, 1, :] = True
    column = np.zeros(shape, bool)
    column[0, :, 0] = True
    pixel = np.zeros(shape, bool)
    pixel[0, H - 1, 0] = True
    for conn in (1, 3):
        assert _mask_ecc(line, conn) == 0     # a circle (or a solid torus)
        assert _mask_ecc(plane, conn) == 0    # a 2-torus (or a thickened one)
        assert _mask_ecc(pixel, conn) == 1
        # The 3-torus minus an open cube (T) or a vertex star (V): chi = 0 - (-1) = 1.
        assert _mask_ecc(~pixel, conn) == 1
        # A 2-torus and a circle crossing it once (a wedge up to homotopy): 0 + 0 - 1.
        assert _mask_ecc(plane | column, conn) == -1
        assert _mask_ecc(np.ones(shape, bool), conn) == 0


def test_full_row_in_periodic_v_is_a_circle_but_a_segment_in_the_box():
    image = np.ones((4, 6), np.float32)
    image[2] = 0.0
    np.testing.assert_array_equal(cutopo.ecc(image, [0.0, 1.0], boundary=P), [0, 0])
    np.testing.assert_array_equal(cutopo.ecc(image, [0.0, 1.0]), [1, 1])


# ---------------------------------------------------------------------------------------------
# Batches, slabs, layouts


@pytest.mark.parametrize("connectivity", ["V", "T"])
def test_batches_equal_per_image(rng, connectivity):
    # Batch axes may be short; only the spatial axes must have length >= 3.
    cases = [((5, 7, 9), 2), ((2, 1, 6, 5), 2), ((2, 4, 5, 3), 3), ((1, 3, 3), 2)]
    for shape, ndim in cases:
        conn = 1 if connectivity == "V" else ndim
        image = random_image(rng, shape, "float32", ties=True, nan=0.1)
        t = random_thresholds(rng, image)
        got = cutopo.ecc(image, t, ndim=ndim, connectivity=conn, boundary=P)
        c = cutopo.euler_contributions(image, ndim=ndim, connectivity=conn, boundary=P)
        assert got.shape == shape[:-ndim] + (len(t),) and c.shape == shape
        for idx in np.ndindex(shape[:-ndim]):
            np.testing.assert_array_equal(got[idx], periodic_ecc_oracle(image[idx], t, conn))
            np.testing.assert_array_equal(c[idx], periodic_contributions_oracle(image[idx], conn))


@pytest.mark.parametrize("ndim", [2, 3])
def test_slabs_split_the_first_axis(rng, monkeypatch, ndim):
    """With tiny slabs the wrap rows of the first axis land in different slabs."""
    shape = (7, 5) if ndim == 2 else (6, 4, 3)
    image = random_image(rng, (2,) + shape, "uint8", ties=True)
    t = random_thresholds(rng, image)
    for conn in (1, ndim):
        want_c = [periodic_contributions_oracle(image[b], conn) for b in range(2)]
        want_e = [periodic_ecc_oracle(image[b], t, conn) for b in range(2)]
        for slab in (1, 2, 3, 1 << 21):
            monkeypatch.setattr(_ecc_numpy, "_SLAB_ELEMENTS", slab)
            c = cutopo.euler_contributions(image, ndim=ndim, connectivity=conn, boundary=P)
            e = cutopo.ecc(image, t, ndim=ndim, connectivity=conn, boundary=P)
            for b in range(2):
                np.testing.assert_array_equal(c[b], want_c[b], err_msg=f"slab={slab}")
                np.testing.assert_array_equal(e[b], want_e[b], err_msg=f"slab={slab}")


def test_large_volume_in_slabs(rng):
    vol = rng.normal(size=(40, 200, 300)).astype(np.float32)
    for conn in (1, 3):
        c = cutopo.euler_contributions(vol, connectivity=conn, boundary=P)
        assert int(c.sum(dtype=np.int64)) == 0
    t = np.array([-1.0, 0.0, 0.5, 10.0])
    got = cutopo.ecc(vol, t, boundary=P)
    assert got[-1] == 0
    np.testing.assert_array_equal(cutopo.ecc(np.roll(vol, (17, 101, 5), axis=(0, 1, 2)), t, boundary=P),
                                  got)


def test_non_contiguous_inputs(rng):
    base = random_image(rng, (9, 12, 10), "float32", ties=True, nan=0.1)
    for view in [base[:, ::2, 1::3], base.transpose(2, 0, 1), np.asfortranarray(base),
                 base[::-1, :, ::-1]]:
        t = random_thresholds(rng, view)
        for conn in (1, 3):
            np.testing.assert_array_equal(cutopo.ecc(view, t, connectivity=conn, boundary=P),
                                          periodic_ecc_oracle(view, t, conn))


# ---------------------------------------------------------------------------------------------
# The box default is unchanged


def test_box_is_the_default(rng):
    for shape in [(1, 1), (2, 5), (4, 6), (3, 4, 5), (1, 2, 2)]:
        image = random_image(rng, shape, "float32", ties=True, nan=0.1)
        t = random_thresholds(rng, image)
        for conn in (1, len(shape)):
            want = oracle_ecc(image, t, conn)
            np.testing.assert_array_equal(cutopo.ecc(image, t, connectivity=conn), want)
            np.testing.assert_array_equal(cutopo.ecc(image, t, connectivity=conn, boundary="box"), want)
            c = cutopo.euler_contributions(image, connectivity=conn, boundary="box")
            np.testing.assert_array_equal(c, cutopo.euler_contributions(image, connectivity=conn))
            assert int(c.sum()) == 1
            soft = cutopo.soft_ecc(image, t.astype(np.float64), 3.0, connectivity=conn, boundary="box")
            np.testing.assert_array_equal(soft, cutopo.soft_ecc(image, t.astype(np.float64), 3.0,
                                                                connectivity=conn))


# ---------------------------------------------------------------------------------------------
# Gaussian random fields: the kinematic formula (an independent, statistical oracle)


def _gaussian_fields(rng, n, size, ndim, correlation):
    """n periodic unit-variance Gaussian fields (power spectrum exp(-|k|^2 correlation^2), k in
    radians per pixel) and their second spectral moment lam = Var(df/dx)."""
    k = 2 * np.pi * np.fft.fftfreq(size)
    ks = np.meshgrid(*([k] * ndim), indexing="ij")
    power = np.exp(-sum(q ** 2 for q in ks) * correlation ** 2)
    power[(0,) * ndim] = 0.0
    lam = float((ks[0] ** 2 * power).sum() / power.sum())
    amplitude = np.sqrt(power) * size ** (ndim / 2) / math.sqrt(power.sum())
    axes = tuple(range(1, ndim + 1))
    noise = np.fft.fftn(rng.standard_normal((n,) + (size,) * ndim), axes=axes)
    return np.fft.ifftn(noise * amplitude, axes=axes).real, lam


@pytest.mark.parametrize("connectivity", ["V", "T"])
@pytest.mark.parametrize("ndim", [2, 3])
def test_gaussian_random_fields_follow_the_kinematic_formula(rng, ndim, connectivity):
    """The mean periodic ECC of smooth Gaussian fields is the Gaussian kinematic formula's
    E[chi(f <= t)] on the torus, which has no boundary terms: A lam (-t) e^{-t^2/2} / (2 pi)^{3/2}
    in 2D, V lam^{3/2} (t^2 - 1) e^{-t^2/2} / (2 pi)^2 in 3D. Over 30 seeds the largest
    difference was 11-13 % of the peak (sampling and lattice); the box ECC, whose boundary
    terms add ~35 % of the peak in 2D, must miss the torus formula by more than the tolerance."""
    conn = 1 if connectivity == "V" else ndim
    size, n, corr = (128, 16, 4.0) if ndim == 2 else (48, 12, 3.0)
    fields, lam = _gaussian_fields(rng, n, size, ndim, corr)
    t = np.linspace(-3.0, 3.0, 25)
    e = np.exp(-t ** 2 / 2)
    if ndim == 2:
        want = size ** 2 * lam * (-t) * e / (2 * np.pi) ** 1.5
    else:
        want = size ** 3 * lam ** 1.5 * (t ** 2 - 1) * e / (2 * np.pi) ** 2
    peak = np.abs(want).max()
    got = cutopo.ecc(fields, t, ndim=ndim, connectivity=conn, boundary=P).mean(axis=0)
    assert np.abs(got - want).max() <= 0.25 * peak
    if ndim == 2:
        box = cutopo.ecc(fields, t, ndim=ndim, connectivity=conn).mean(axis=0)
        assert np.abs(box - want).max() > 0.25 * peak


# ---------------------------------------------------------------------------------------------
# Validation


@pytest.mark.parametrize("op", ["ecc", "euler_contributions", "soft_ecc"])
def test_validation(op):
    def call(image, **kw):
        if op == "ecc":
            return cutopo.ecc(image, [0.0, 1.0], **kw)
        if op == "euler_contributions":
            return cutopo.euler_contributions(image, **kw)
        return cutopo.soft_ecc(image, [0.0, 1.0], 2.0, **kw)

    for shape, kw in [((2, 5), {}), ((5, 1), {}), ((3, 3, 2), {}), ((1, 4, 4), {}),
                      ((4, 2, 3), {"ndim": 2}), ((7, 3, 1), {"ndim": 2})]:
        with pytest.raises(ValueError, match="image"):
            call(np.zeros(shape), boundary=P, **kw)
        call(np.zeros(shape), boundary="box", **kw)  # fine on a box
    for bad in ["wrap", "Periodic", "", "torus"]:
        with pytest.raises(ValueError, match="boundary"):
            call(np.zeros((3, 3)), boundary=bad)
    for bad in [None, 1, True, ("periodic",)]:
        with pytest.raises(TypeError, match="boundary"):
            call(np.zeros((3, 3)), boundary=bad)


def test_cupy_inputs_with_periodic(monkeypatch):
    """Without a GPU here: pretend the image is a CuPy array where the boundary is checked.
    Every op has a periodic CUDA path now, so the check accepts it; the shape rule still holds."""
    monkeypatch.setattr(_checks, "is_cupy_array", lambda x: True)
    assert _checks.check_boundary(P, np.zeros((3, 4)), 2) is True
    with pytest.raises(ValueError, match="image"):  # the shape error comes first
        cutopo.ecc(np.zeros((2, 3)), [0.0], boundary=P)


@pytest.mark.gpu
@pytest.mark.parametrize("connectivity", ["V", "T"])
@pytest.mark.parametrize("ndim", [2, 3])
def test_cupy_periodic_ecc_equals_numpy_and_oracle(rng, ndim, connectivity):
    """The CUDA path (box kernel on a wrapped copy, original pixels owned) equals the NumPy
    torus and the cell enumeration exactly: every dtype, ties across the wrap, NaN, axes of
    length 3, batches; box results unchanged."""
    import cupy as cp

    conn = 1 if connectivity == "V" else ndim
    for k, dtype in enumerate(DTYPES):
        shape = (3,) + random_shape(rng, ndim - 1) if k % 3 == 0 else random_shape(rng, ndim)
        image = random_image(rng, shape, dtype, ties=k % 2 == 0, nan=0.1 * (k % 4 == 1))
        t = random_thresholds(rng, image)
        got = cutopo.ecc(cp.asarray(image), cp.asarray(t), connectivity=conn, boundary=P)
        assert isinstance(got, cp.ndarray) and got.dtype == np.int64
        np.testing.assert_array_equal(got.get(), cutopo.ecc(image, t, connectivity=conn, boundary=P))
        np.testing.assert_array_equal(got.get(), periodic_ecc_oracle(image, t, conn))
    batch = random_image(rng, (2, 3) + random_shape(rng, ndim), "float32", ties=True)
    t = random_thresholds(rng, batch)
    got = cutopo.ecc(cp.asarray(batch), cp.asarray(t), ndim=ndim, connectivity=conn, boundary=P)
    np.testing.assert_array_equal(got.get(), cutopo.ecc(batch, t, ndim=ndim, connectivity=conn,
                                                        boundary=P))
    box = cutopo.ecc(cp.asarray(batch), cp.asarray(t), ndim=ndim, connectivity=conn)
    np.testing.assert_array_equal(box.get(), cutopo.ecc(batch, t, ndim=ndim, connectivity=conn))


@pytest.mark.gpu
def test_cupy_periodic_constant_and_errors(rng):
    """A constant torus has Euler characteristic 0 (every op); short axes are refused."""
    import cupy as cp

    for shape in ((3, 3), (4, 5), (3, 4, 5)):
        got = cutopo.ecc(cp.full(shape, 2.0, dtype=cp.float32), [1.0, 2.0], boundary=P)
        np.testing.assert_array_equal(got.get(), [0, 0])
        c = cutopo.euler_contributions(cp.full(shape, 2.0, dtype=cp.float32), boundary=P)
        assert int(c.sum()) == 0
        soft = cutopo.soft_ecc(cp.full(shape, 2.0), cp.asarray([1.0, 2.0, 40.0]), 3.0, boundary=P)
        np.testing.assert_allclose(soft.get(), 0.0, atol=1e-12)
    for call in (lambda: cutopo.ecc(cp.zeros((2, 5)), [0.0], boundary=P),
                 lambda: cutopo.euler_contributions(cp.zeros((5, 2, 4)), boundary=P),
                 lambda: cutopo.soft_ecc(cp.zeros((4, 2)), cp.asarray([0.0, 1.0]), 2.0, boundary=P)):
        with pytest.raises(ValueError, match="image"):
            call()


# Shapes that cross the contribution kernel's tiles (32 x 32 pixels, z runs of several
# planes) so that the wrapped halo is read at tile edges and overhangs, and tiny tori.
GPU_SHAPES = {2: [(3, 3), (3, 40), (33, 5), (35, 70), (64, 32)],
              3: [(3, 3, 3), (70, 5, 4), (5, 33, 34), (9, 3, 65)]}


@pytest.mark.gpu
@pytest.mark.parametrize("connectivity", ["V", "T"])
@pytest.mark.parametrize("ndim", [2, 3])
def test_cupy_periodic_contributions_equal_numpy(rng, ndim, connectivity):
    """The contribution-map kernel's torus rule equals the NumPy path's exactly, ties across
    the wrap (few grey levels, constant images), NaN and every dtype included."""
    import cupy as cp

    conn = 1 if connectivity == "V" else ndim
    for k, dtype in enumerate(DTYPES):
        for j, shape in enumerate(GPU_SHAPES[ndim]):
            if (k + j) % 2:  # half of the pairs keeps the test short
                continue
            image = random_image(rng, shape, dtype, ties=(k + j) % 4 == 0,
                                 nan=0.1 * (dtype in FLOATS and j % 2 == 0))
            if j == 0 and k % 4 == 0:
                image = np.full(shape, image.flat[0])
            got = cutopo.euler_contributions(cp.asarray(image), connectivity=conn, boundary=P)
            assert isinstance(got, cp.ndarray) and got.dtype == np.int8
            want = cutopo.euler_contributions(image, connectivity=conn, boundary=P)
            np.testing.assert_array_equal(got.get(), want, err_msg=f"{dtype} {shape}")
            if k == 0 and j == 0:
                np.testing.assert_array_equal(want, periodic_contributions_oracle(image, conn))
    # A poisoned output: the kernel writes every pixel (a batch, the launch called directly).
    from cutopo import _ecc_cupy

    batch = random_image(rng, (2, 3) + GPU_SHAPES[ndim][3], "float32", ties=True)
    dev = cp.asarray(batch).reshape((6,) + batch.shape[2:])
    out = cp.full(dev.shape, 99, dtype=cp.int8)
    _ecc_cupy._contributions_launch(cp.cuda.Device().id, dev.dtype, 6, dev.shape[1:], ndim,
                                    conn != 1, True)(dev, out)
    want = cutopo.euler_contributions(batch, ndim=ndim, connectivity=conn, boundary=P)
    np.testing.assert_array_equal(out.get().reshape(batch.shape), want)
    got = cutopo.euler_contributions(cp.asarray(batch), ndim=ndim, connectivity=conn, boundary=P)
    np.testing.assert_array_equal(got.get(), want)


@pytest.mark.gpu
@pytest.mark.parametrize("connectivity", ["V", "T"])
@pytest.mark.parametrize("ndim", [2, 3])
def test_cupy_periodic_soft_ecc_equals_numpy(rng, ndim, connectivity):
    """soft_ecc on the torus: the GPU forward and every cotangent equal the NumPy path's (to
    float32 rounding; float64 to 1e-10) and the forward the per-cell relaxation of the torus."""
    import cupy as cp

    conn = 1 if connectivity == "V" else ndim
    for j, shape in enumerate(GPU_SHAPES[ndim][:4]):
        dtype = np.float64 if j % 2 else np.float32
        image = random_image(rng, shape, dtype, ties=j == 1)
        t = np.sort(rng.uniform(np.nanmin(image) - 1, np.nanmax(image) + 1, 24)).astype(dtype)
        scale = dtype(rng.uniform(0.3, 3.0))
        out, pb = cutopo.vjp(cutopo.soft_ecc, image, t, scale, connectivity=conn, boundary=P)
        g = rng.standard_normal(out.shape).astype(dtype)
        want = pb(g)
        dout, dpb = cutopo.vjp(cutopo.soft_ecc, cp.asarray(image), cp.asarray(t), cp.asarray(scale),
                               connectivity=conn, boundary=P)
        got = dpb(cp.asarray(g))
        rtol = 1e-10 if dtype == np.float64 else 2e-5
        scale_out = max(1.0, float(np.abs(out).max()))
        np.testing.assert_allclose(dout.get(), out, rtol=rtol, atol=rtol * scale_out)
        if j < 2:
            np.testing.assert_allclose(out, dense_soft(image, t, float(scale), conn),
                                       rtol=1e-4, atol=1e-4 * scale_out)
        for name, a, b in zip(("image", "thresholds", "scale"), got, want):
            b = np.asarray(b)
            tol = rtol * max(1.0, float(np.abs(b).max()))
            np.testing.assert_allclose(a.get(), b, rtol=rtol, atol=tol, err_msg=name)


@pytest.mark.gpu
@pytest.mark.parametrize("connectivity", ["V", "T"])
@pytest.mark.parametrize("ndim", [2, 3])
def test_cupy_periodic_ect_equals_numpy(rng, ndim, connectivity):
    """The exact ECT of the torus on the GPU equals the NumPy path's, and for each direction
    the periodic ECC of the height image (the definition)."""
    import cupy as cp

    conn = 1 if connectivity == "V" else ndim
    for j, shape in enumerate(GPU_SHAPES[ndim][1:4]):
        mask = rng.random((2,) + shape) < 0.6
        if j == 0:
            mask[1] = True  # the whole torus: curve ends at 0
        dirs = rng.standard_normal((5, ndim))
        dirs[0] = 0.0
        dirs[0, -1] = 1.0  # an axis direction: heights tie along the other axes
        got = cutopo.ect(cp.asarray(mask), cp.asarray(dirs), 12, connectivity=conn, boundary=P)
        want = cutopo.ect(mask, dirs, 12, connectivity=conn, boundary=P)
        assert isinstance(got, cp.ndarray) and got.dtype == np.int64
        np.testing.assert_array_equal(got.get(), want, err_msg=f"{shape}")
        box = cutopo.ect(cp.asarray(mask), cp.asarray(dirs), 12, connectivity=conn)
        np.testing.assert_array_equal(box.get(), cutopo.ect(mask, dirs, 12, connectivity=conn))


# ---------------------------------------------------------------------------------------------
# soft_ecc


@pytest.mark.parametrize("ndim", [2, 3])
def test_soft_ecc_matches_dense_per_cell_relaxation(rng, ndim):
    for trial in range(4):
        shape = random_shape(rng, ndim, 3, 6 if ndim == 2 else 4)
        image = random_image(rng, shape, "float64", ties=trial % 2 == 1, nan=0.15 * (trial >= 2))
        finite = image[np.isfinite(image)]
        t = np.linspace(finite.min() - 2, finite.max() + 2, 15)
        for conn in (1, ndim):
            for scale in (0.3, 2.0):
                got = cutopo.soft_ecc(image, t, scale, connectivity=conn, boundary=P)
                assert got.dtype == np.float64 and got.shape == t.shape
                np.testing.assert_allclose(got, dense_soft(image, t, scale, conn), rtol=1e-10, atol=1e-9)
            # float32 computation
            got32 = cutopo.soft_ecc(image.astype(np.float32), t.astype(np.float32), 2.0,
                                    connectivity=conn, boundary=P)
            assert got32.dtype == np.float32
            np.testing.assert_allclose(got32, dense_soft(image.astype(np.float32), t.astype(np.float32),
                                                         2.0, conn), rtol=1e-4, atol=1e-3)


def test_soft_ecc_periodic_tends_to_ecc(rng):
    image = rng.integers(0, 5, size=(2, 5, 6)).astype(np.float64)
    t = np.array([-0.5, 0.5, 1.5, 2.5, 3.5, 4.5])  # between the levels
    for conn in (1, 2):
        soft = cutopo.soft_ecc(image, t, 200.0, ndim=2, connectivity=conn, boundary=P)
        np.testing.assert_allclose(soft, cutopo.ecc(image, t, ndim=2, connectivity=conn, boundary=P),
                                   atol=1e-9)
        assert np.allclose(soft[..., -1], 0.0)


def test_soft_ecc_periodic_vjp_against_finite_differences(rng):
    """The boundary keyword reaches the backward pass: d/dimage of the dense per-cell relaxation."""
    image = rng.permutation(20).reshape(4, 5).astype(np.float64) * 0.5  # distinct values
    t = np.linspace(-1.0, 10.5, 9)
    g = rng.normal(size=t.size)
    scale, eps = 1.3, 1e-6
    for conn in (1, 2):
        out, pullback = cutopo.vjp(cutopo.soft_ecc, image, t, scale, wrt="image",
                                   connectivity=conn, boundary=P)
        np.testing.assert_allclose(out, dense_soft(image, t, scale, conn), rtol=1e-12, atol=1e-12)
        d_image = pullback(g)[0]
        fd = np.empty_like(image)
        for idx in np.ndindex(image.shape):
            up, down = image.copy(), image.copy()
            up[idx] += eps
            down[idx] -= eps
            fd[idx] = g @ (dense_soft(up, t, scale, conn) - dense_soft(down, t, scale, conn)) / (2 * eps)
        np.testing.assert_allclose(d_image, fd, rtol=1e-6, atol=1e-7)
        _, pb_box = cutopo.vjp(cutopo.soft_ecc, image, t, scale, wrt="image", connectivity=conn)
        assert not np.allclose(pb_box(g)[0], d_image)
