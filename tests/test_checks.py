"""Argument validation: bad input raises TypeError/ValueError naming the argument, before any work."""
from __future__ import annotations

import re

import numpy as np
import pytest

import cutopo


@pytest.fixture
def image(rng):
    return rng.normal(size=(5, 6)).astype(np.float32)


# ---------------------------------------------------------------------------------------------
# thresholds


@pytest.mark.parametrize("thresholds, exc", [
    (np.array([0.0, 2.0, 1.0]), ValueError),          # unsorted
    (np.array([3, 2]), ValueError),                   # unsorted ints
    (np.array([0.0, np.nan, 1.0]), ValueError),       # NaN
    (np.array([np.nan]), ValueError),
    (np.array([0.0, np.inf]), ValueError),            # inf
    (np.array([-np.inf, 0.0]), ValueError),
    (np.zeros((2, 2)), ValueError),                   # 2-D
    (np.zeros((1, 3)), ValueError),
    (np.array([]), ValueError),                       # empty
    ([], ValueError),
    (np.float64(0.5), TypeError),                     # a scalar that is not a count
    (2.5, TypeError),
    (0, ValueError),                                  # counts
    (-3, ValueError),
    (np.int64(0), ValueError),
    (2 ** 31, ValueError),                            # past the kernels' 32-bit index
    (2 ** 40, ValueError),                            # 8 TiB of thresholds: not a MemoryError
    (True, ValueError),                               # a bool is not a count
    (np.array([1 + 2j, 3 + 0j]), TypeError),          # not real numbers
    (np.array(["a", "b"]), TypeError),
    (np.array([object(), object()]), TypeError),
])
def test_bad_thresholds(image, thresholds, exc):
    with pytest.raises(exc, match="thresholds"):
        cutopo.ecc(image, thresholds)


def test_bool_count_is_rejected_for_float16_too(rng):
    image = rng.normal(size=(4, 4)).astype(np.float16)
    for bad in (True, False, np.bool_(True)):
        with pytest.raises((TypeError, ValueError), match="thresholds"):
            cutopo.ecc(image, bad)


@pytest.mark.parametrize("n", [0, -3, 2.5, True, "4", None])
def test_linear_thresholds_bad_count(image, n):
    with pytest.raises((TypeError, ValueError), match="thresholds|count"):
        cutopo.linear_thresholds(image, n)


@pytest.mark.parametrize("fill", [np.nan, np.inf, -np.inf])
def test_count_on_image_without_finite_pixels(fill):
    image = np.full((4, 5), fill, dtype=np.float32)
    with pytest.raises(ValueError, match="image"):
        cutopo.ecc(image, 5)
    with pytest.raises(ValueError, match="image"):
        cutopo.linear_thresholds(image, 5)
    # explicit thresholds are fine: nothing but -inf pixels ever enters a sublevel set
    expected = 1 if fill == -np.inf else 0
    np.testing.assert_array_equal(cutopo.ecc(image, [0.0, 1.0]), [expected, expected])


def test_count_on_empty_batch():
    with pytest.raises(ValueError, match="image"):
        cutopo.ecc(np.zeros((0, 5, 5), np.float32), 3, ndim=2)


# ---------------------------------------------------------------------------------------------
# image


@pytest.mark.parametrize("dtype", [np.complex64, np.complex128, object, np.int64, np.uint32,
                                   np.uint64, np.int8, np.float128 if hasattr(np, "float128") else np.longdouble,
                                   "U1", "datetime64[s]"])
@pytest.mark.parametrize("func", ["ecc", "euler_contributions", "linear_thresholds"])
def test_bad_image_dtype(dtype, func):
    image = np.zeros((4, 5), dtype=dtype) if dtype != "datetime64[s]" else np.zeros((4, 5), dtype)
    with pytest.raises(TypeError, match="image"):
        if func == "ecc":
            cutopo.ecc(image, [0.0])
        elif func == "euler_contributions":
            cutopo.euler_contributions(image)
        else:
            cutopo.ecc(image, 3)


@pytest.mark.parametrize("shape, ndim, match", [
    ((7,), None, "image"),
    ((2, 3, 4, 5), None, "image"),
    ((), None, "image"),
    ((2, 3, 4, 5), 4, "ndim"),
    ((4, 5), 1, "ndim"),
    ((4, 5), 0, "ndim"),
    ((5,), 2, "image"),
    ((4, 5), 3, "image"),
    ((0, 5), None, "image"),
    ((5, 0), None, "image"),
    ((3, 0, 4), None, "image"),
    ((2, 4, 0), 2, "image"),
    ((2, 0, 4, 4), 3, "image"),
])
def test_bad_image_shape(shape, ndim, match):
    image = np.zeros(shape, np.float32)
    with pytest.raises(ValueError, match=match):
        cutopo.ecc(image, [0.0], ndim=ndim)
    with pytest.raises(ValueError, match=match):
        cutopo.euler_contributions(image, ndim=ndim)


@pytest.mark.parametrize("ndim", [2.0, "2", True])
def test_bad_ndim_type(image, ndim):
    # True is an int subclass that operator.index accepts as 1: it must not pass as ndim
    with pytest.raises((TypeError, ValueError), match="ndim"):
        cutopo.ecc(image, [0.0], ndim=ndim)


@pytest.mark.parametrize("shape, connectivity, exc", [
    ((4, 5), 0, ValueError),
    ((4, 5), 3, ValueError),
    ((4, 5), 4, ValueError),
    ((4, 5, 6), 2, ValueError),
    ((4, 5, 6), 4, ValueError),
    ((4, 5, 6), -1, ValueError),
    ((4, 5), True, TypeError),
    ((4, 5, 6), True, TypeError),
    ((4, 5), "full", TypeError),
    ((4, 5), 1.0, TypeError),
    ((4, 5), None, TypeError),
])
def test_bad_connectivity(shape, connectivity, exc):
    image = np.zeros(shape, np.uint8)
    with pytest.raises(exc, match="connectivity"):
        cutopo.ecc(image, [0], connectivity=connectivity)
    with pytest.raises(exc, match="connectivity"):
        cutopo.euler_contributions(image, connectivity=connectivity)


def test_numpy_integer_arguments_are_accepted(rng):
    image = (rng.random((3, 4, 5)) < 0.5).astype(np.uint8)
    ref = cutopo.ecc(image, [0, 1], ndim=2, connectivity=2)
    np.testing.assert_array_equal(cutopo.ecc(image, [0, 1], ndim=np.int64(2), connectivity=np.int32(2)), ref)


def test_checks_run_before_work_and_name_the_argument(image):
    # Several things wrong at once: the image is checked first.
    with pytest.raises(TypeError, match=re.escape("image")):
        cutopo.ecc(image.astype(np.int64), np.array([2.0, 1.0]), connectivity="full")


# ---------------------------------------------------------------------------------------------
# Degenerate but valid


def test_zero_size_batch():
    for shape, ndim in (((0, 5, 5), 2), ((3, 0, 5, 5), 2), ((0, 2, 3, 4), 3)):
        image = np.zeros(shape, np.float32)
        out = cutopo.ecc(image, [0.0, 1.0, 2.0], ndim=ndim)
        assert isinstance(out, np.ndarray) and out.dtype == np.int64
        assert out.shape == shape[:-ndim] + (3,)
        c = cutopo.euler_contributions(image, ndim=ndim)
        assert c.shape == shape and c.dtype == np.int8


@pytest.mark.gpu
def test_cupy_thresholds_with_numpy_image(image):
    import cupy

    with pytest.raises(TypeError, match="thresholds"):
        cutopo.ecc(image, cupy.asarray([0.0, 1.0]))


def test_count_over_a_range_wider_than_float64():
    # hi - lo overflows: numpy.linspace would give NaN and inf thresholds.
    image = np.array([[-1e308, 0.0, 1e308], [0.0, 5.0, -3.0]])
    t = cutopo.linear_thresholds(image, 5)
    assert np.isfinite(t).all() and (np.diff(t) > 0).all()
    assert t[0] == -1e308 and t[-1] == 1e308
    from skimage.measure import euler_number

    expected = [euler_number(image <= v, connectivity=1) for v in t]
    np.testing.assert_array_equal(cutopo.ecc(image, 5), expected)
    # ordinary ranges keep numpy.linspace's values exactly
    np.testing.assert_array_equal(cutopo.linear_thresholds(image[1:], 7), np.linspace(-3.0, 5.0, 7))


@pytest.mark.parametrize("dtype", [">f4", ">f8", ">u2", ">i2", ">i4"])
def test_non_native_byte_order_is_accepted(rng, dtype):
    image = (rng.random((2, 6, 7)) * 50).astype(dtype)
    native = image.astype(np.dtype(dtype).newbyteorder("="))
    t = np.array([5.0, 20.0, 33.0])
    np.testing.assert_array_equal(cutopo.ecc(image, t, ndim=2), cutopo.ecc(native, t, ndim=2))
    np.testing.assert_array_equal(cutopo.euler_contributions(image, ndim=2),
                                  cutopo.euler_contributions(native, ndim=2))


def test_host_memory_guard(monkeypatch, rng):
    """A threshold count or a batch whose host arrays cannot fit in the memory available
    raises a ValueError naming thresholds before anything is allocated (NumPy allocates
    lazily: the OS would kill the process part-way instead)."""
    from cutopo import _checks

    image = rng.random((3, 20, 20)).astype(np.float32)
    mask = image > 0.5
    dirs = np.array([[1.0, 0.0], [0.0, 1.0]])
    monkeypatch.setattr(_checks, "available_host_bytes", lambda: 1 << 20)  # 1 MiB left
    monkeypatch.setattr(_checks, "MEMORY_CHECK_MIN_BYTES", 0)
    calls = [lambda: cutopo.ecc(image, 10**6, ndim=2),                    # the count's values
             lambda: cutopo.linear_thresholds(image, 10**6),
             lambda: cutopo.ecc(image, np.linspace(0, 1, 30000), ndim=2),  # the (3, T) curves
             lambda: cutopo.soft_ecc(image, np.linspace(0, 1, 20000), 5.0, ndim=2),
             lambda: cutopo.ect(mask, dirs, np.linspace(-1, 1, 20000)),
             lambda: cutopo.soft_ect(mask, dirs, np.linspace(-1, 1, 10000), 5.0),
             lambda: cutopo.ect(mask, dirs, 10**6)]
    for call in calls:
        with pytest.raises(ValueError, match="thresholds: .* GiB of host memory"):
            call()
    assert cutopo.ecc(image, 64, ndim=2).shape == (3, 64)  # what fits still runs
    monkeypatch.setattr(_checks, "available_host_bytes", lambda: None)  # unknown: no guard
    assert cutopo.ecc(image, 30000, ndim=2).shape == (3, 30000)
    monkeypatch.setattr(_checks, "available_host_bytes", lambda: 1 << 20)
    monkeypatch.setattr(_checks, "MEMORY_CHECK_MIN_BYTES", 256 << 20)  # small arrays: no check
    assert cutopo.ecc(image, 30000, ndim=2).shape == (3, 30000)


def test_available_host_bytes_reads_meminfo():
    from cutopo import _checks

    avail = _checks.available_host_bytes()
    assert avail is None or 1 << 20 < avail < 1 << 50


def test_as_c_contiguous_keeps_contiguous_arrays():
    """as_c_contiguous returns a C-contiguous array itself (no copy, no call into the array
    library) and a C-contiguous copy of anything else, with the same values."""
    from cutopo._cuda.launch import as_c_contiguous

    a = np.arange(24.0).reshape(2, 3, 4)
    assert as_c_contiguous(a) is a
    for view in (a[:, ::2], a.transpose(2, 0, 1), a[..., 1]):
        got = as_c_contiguous(view)
        assert got.flags.c_contiguous and got is not view
        np.testing.assert_array_equal(got, view)


def test_masked_arrays_are_refused(rng):
    """A numpy.ma.MaskedArray is an ndarray whose mask every op would drop silently (the ECC of
    a masked image counted its masked pixels): a TypeError naming the argument instead."""
    image = np.ma.array(rng.random((5, 6)), mask=rng.random((5, 6)) < 0.3)
    calls = {"image": [lambda: cutopo.ecc(image, [0.5]), lambda: cutopo.euler_contributions(image),
                       lambda: cutopo.soft_ecc(image, [0.5], 4.0)],
             "prob": [lambda: cutopo.expected_euler(image)],
             "mask": [lambda: cutopo.ect(image > 0.5, np.eye(2), [0.0])]}
    for name, fns in calls.items():
        for fn in fns:
            with pytest.raises(TypeError, match=rf"^{name} is a numpy.ma.MaskedArray.*{name}.filled"):
                fn()
    # its filled data is what to pass: NaN pixels never enter a sublevel set
    filled = image.filled(np.nan)
    assert cutopo.ecc(filled, [0.5])[0] == cutopo.ecc(np.where(image.mask, np.inf, image.data), [0.5])[0]
