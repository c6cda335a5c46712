"""Argument validation shared by the Euler-characteristic ops.

Every check raises TypeError (wrong type or dtype) or ValueError (wrong shape or value) with
the argument's name in the message, before any kernel runs (float CuPy thresholds of soft_ecc
and soft_ect are the exception: a kernel checks their values, read before the call returns,
see cutopo._soft_ecc_cupy and cutopo._band_cupy.SoftEctPlan).
"""
from __future__ import annotations

import functools
import math
import operator

import numpy as np

from ._array import array_module, as_array, is_cupy_array, to_numpy

IMAGE_DTYPES = tuple(np.dtype(d) for d in
                     ("bool", "uint8", "uint16", "int16", "int32", "float16", "float32", "float64"))


def check_image(image, ndim):
    """Validate ``image`` of shape (*batch, *spatial); return (image, ndim)."""
    image = as_array(image, "image")  # native byte order (big-endian data from a file)
    if image.dtype not in IMAGE_DTYPES:
        names = ", ".join(d.name for d in IMAGE_DTYPES)
        raise TypeError(f"image: dtype {image.dtype} is not supported (use one of {names})")
    return image, check_spatial_ndim(image.shape, ndim, "image")


def check_spatial_ndim(shape, ndim, name="image") -> int:
    """The number of spatial axes of an image of ``shape`` (*batch, *spatial): ``ndim`` (2 or 3)
    checked against it, or the image's own 2 or 3 axes when None; no zero-length spatial axis."""
    shape = tuple(shape)
    if ndim is None:
        if len(shape) not in (2, 3):
            raise ValueError(f"{name}: with ndim=None the image must be 2-D or 3-D, got shape "
                             f"{shape}; pass ndim=2 or ndim=3 for batches")
        ndim = len(shape)
    else:
        try:
            ndim = operator.index(ndim)
        except TypeError:
            raise TypeError(f"ndim must be None, 2 or 3, got {ndim!r}") from None
        if ndim not in (2, 3):
            raise ValueError(f"ndim must be None, 2 or 3, got {ndim}")
        if len(shape) < ndim:
            raise ValueError(f"{name}: ndim={ndim} spatial axes asked for, but {name} has shape {shape}")
    if any(s == 0 for s in shape[len(shape) - ndim:]):
        raise ValueError(f"{name}: spatial shape {shape[len(shape) - ndim:]} has a zero-length axis")
    return ndim


def check_connectivity(connectivity, ndim) -> bool:
    """True for the T construction (connectivity == ndim), False for V (connectivity == 1)."""
    if isinstance(connectivity, (bool, np.bool_)) or not isinstance(connectivity, (int, np.integer)):
        raise TypeError(f"connectivity must be 1 or {ndim}, got {connectivity!r}")
    if connectivity not in (1, ndim):
        raise ValueError(f"connectivity must be 1 or ndim={ndim}, got {connectivity}")
    return connectivity == ndim


def is_count(thresholds) -> bool:
    """Whether ``thresholds`` is a count of thresholds (an int, not a bool) rather than values."""
    return isinstance(thresholds, (int, np.integer)) and not isinstance(thresholds, (bool, np.bool_))


# The most thresholds of one call: the kernels index thresholds with 32-bit ints (and the
# curves of T thresholds take 8 T bytes per image).
MAX_THRESHOLDS = 2 ** 31 - 1


def check_count(n) -> int:
    """A threshold count: an int (not a bool), at least 1 and at most MAX_THRESHOLDS."""
    if not is_count(n):
        raise TypeError(f"thresholds: a count must be an int, got {n!r}")
    if n < 1:
        raise ValueError(f"thresholds: the count must be at least 1, got {n}")
    if n > MAX_THRESHOLDS:
        raise ValueError(f"thresholds: a count of {n} exceeds the limit of {MAX_THRESHOLDS} "
                         "(2**31 - 1) thresholds")
    return int(n)


def linear_thresholds(image, n):
    """``n`` evenly spaced thresholds from the image's finite minimum to its finite maximum
    (``n = 1``: the minimum alone, as ``numpy.linspace``).

    Floating images get thresholds of their own dtype (both ends then equal pixel values
    exactly); integer and boolean images get float64 thresholds.

    Parameters
    ----------
    image : ndarray (NumPy or CuPy)
    n : int, at least 1

    Returns
    -------
    thresholds : 1-D ndarray of the image's array type

    Examples
    --------
    >>> import numpy as np, cutopo
    >>> cutopo.linear_thresholds(np.array([[0.5, np.nan], [2.5, 1.0]], dtype=np.float32), 3)
    array([0.5, 1.5, 2.5], dtype=float32)
    >>> cutopo.linear_thresholds(np.array([[3, 7]], dtype=np.uint8), 2)
    array([3., 7.])
    """
    image = as_array(image, "image")
    return array_module(image).asarray(_linear_threshold_values(image, n))


def _linear_threshold_values(image, n):
    """linear_thresholds as a NumPy array (the host values that check_thresholds needs)."""
    n = check_count(n)
    if image.size == 0:
        raise ValueError("image: cannot derive thresholds from an empty image")
    return thresholds_over_range(finite_range(image), n, image.dtype)


def thresholds_over_range(span, n: int, dtype, name: str = "image") -> np.ndarray:
    """linear_thresholds' values from a finite range ``span`` = (lo, hi) of an array of
    ``dtype`` (in that dtype when it is floating, float64 else): the ValueError of ``name``
    when ``span`` is None (no finite value). Shared by the in-memory, streamed and Dask paths."""
    if span is None:
        raise ValueError(f"{name}: no finite pixel to derive thresholds from; pass explicit thresholds")
    values = evenly_spaced(float(span[0]), float(span[1]), n)
    return values.astype(dtype) if np.dtype(dtype).kind == "f" else values


def finite_range(image):
    """(lo, hi): the smallest and largest finite value of a NumPy or CuPy array (Python
    numbers), or None when none is finite (or the array is empty). One pass, and no
    temporaries the size of the image: a CUDA kernel for CuPy images of the ECC's dtypes,
    tiles on the CPU."""
    if image.size == 0:
        return None
    if is_cupy_array(image):
        if image.dtype in IMAGE_DTYPES:
            from . import _ecc_cupy

            return _ecc_cupy.finite_range(image)
        # other dtypes (linear_thresholds is public): integers, whose values are all finite
        return image.min().item(), image.max().item()
    from . import _ecc_numpy

    return _ecc_numpy.finite_range(image)


def evenly_spaced(lo: float, hi: float, n: int) -> np.ndarray:
    """``numpy.linspace(lo, hi, n)`` in float64, also where ``hi - lo`` overflows (a range
    wider than the largest float64, e.g. -1e308 to 1e308): then as lo (1 - s) + hi s."""
    # the values, their cast to the comparison dtype and the checks' temporaries
    check_host_memory(24 * n, "thresholds", f"a count of {n} thresholds")
    with np.errstate(over="ignore"):
        if math.isfinite(hi - lo):
            return np.linspace(lo, hi, n)
    s = np.linspace(0.0, 1.0, n)
    return lo * (1 - s) + hi * s


def available_host_bytes():
    """The host memory available to new allocations (MemAvailable of /proc/meminfo), or None
    where it cannot be read (not Linux)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


# Host arrays smaller than this are not checked against the memory available (reading
# /proc/meminfo costs ~20 us, as much as a small call).
MEMORY_CHECK_MIN_BYTES = 256 << 20


def check_host_memory(nbytes, name, what):
    """A ValueError naming ``name`` when ``what`` (host arrays of ``nbytes`` in all, at least
    MEMORY_CHECK_MIN_BYTES) cannot fit in the host memory available now. NumPy allocates
    lazily, so an oversized result (a typo in a threshold count, a huge batch) would otherwise
    be killed by the OS part-way through instead of raising."""
    if nbytes < MEMORY_CHECK_MIN_BYTES:
        return
    avail = available_host_bytes()
    if avail is not None and nbytes > avail:
        raise ValueError(f"{name}: {what} need {nbytes / 2**30:.1f} GiB of host memory, more than "
                         f"the {avail / 2**30:.1f} GiB available")


def check_result_memory(batch, tail, itemsize_total, name="thresholds"):
    """check_host_memory for a NumPy path's result of shape (*batch, *tail), counting
    ``itemsize_total`` bytes per entry (the result and its temporaries)."""
    entries = math.prod(batch) * math.prod(tail)
    check_host_memory(entries * itemsize_total, name,
                      f"the result of shape {tuple(batch) + tuple(tail)} and its temporaries")


# The errors of the checks of threshold values (also raised by the device-side checks,
# cutopo._band_cupy.raise_failed_thresholds)
THRESHOLDS_NOT_FINITE = "thresholds must be finite (found NaN or inf)"
THRESHOLDS_NOT_SORTED = "thresholds must be sorted in non-decreasing order"


def check_threshold_array(thresholds):
    """The checks of threshold values that need no values: a non-empty 1-D array (NumPy or
    CuPy, returned as such) of a real number type."""
    if isinstance(thresholds, (float, np.floating)):
        raise TypeError("thresholds must be an int count or a 1-D array of values, got a float")
    t = as_array(thresholds, "thresholds")
    if t.dtype.kind not in "biuf":
        raise TypeError(f"thresholds: dtype {t.dtype} is not a real number type")
    if t.ndim != 1:
        raise ValueError(f"thresholds must be 1-D, got shape {t.shape}")
    if t.size == 0:
        raise ValueError("thresholds must not be empty")
    if t.size > MAX_THRESHOLDS:
        raise ValueError(f"thresholds: {t.size} values exceed the limit of {MAX_THRESHOLDS} "
                         "(2**31 - 1)")
    return t


def check_thresholds(thresholds, image):
    """Validate thresholds; return (host copy in the comparison dtype, comparison dtype).

    The comparison dtype is ``numpy.result_type(image, thresholds)``: both backends compare
    ``f <= t`` in it, which makes their results equal exactly.
    """
    if is_count(thresholds):
        thresholds = _linear_threshold_values(image, thresholds)
    host = to_numpy(check_threshold_array(thresholds))
    # One pass proves both (a call's host time matters for small images): a NaN fails every
    # comparison, and in a sorted array an inf must be an end point.
    if host.size > 1 and not (host[1:] >= host[:-1]).all():
        if host.dtype.kind == "f" and not np.isfinite(host).all():
            raise ValueError(THRESHOLDS_NOT_FINITE)
        raise ValueError(THRESHOLDS_NOT_SORTED)
    if host.dtype.kind == "f" and not (math.isfinite(host[0]) and math.isfinite(host[-1])):
        raise ValueError(THRESHOLDS_NOT_FINITE)
    dtype = np.result_type(image.dtype, host.dtype)
    return host.astype(dtype), dtype


def same_array_type(anchor, others, *, anchor_name="image", op=None) -> None:
    """Reject device arguments of an op whose ``anchor`` array (the one that picks the backend)
    is on the host: that would hide a transfer. ``others`` is a sequence of (name, value)."""
    if is_cupy_array(anchor):
        return
    prefix = f"{op}: " if op else ""
    for name, value in others:
        if is_cupy_array(value):
            raise TypeError(f"{prefix}{name} is a CuPy array but {anchor_name} is not: move both "
                            "to one device")


@functools.lru_cache(maxsize=256)
def scale_lambda(dtype: np.dtype, value: float):
    """Lambda, a positive finite scale value (check_scale's) in the computation dtype, where
    it may still overflow or underflow (memoized: the rounding check costs microseconds, and a
    loop usually has one scale)."""
    with np.errstate(over="ignore", under="ignore"):
        lam = dtype.type(value)
    if not (np.isfinite(lam) and lam > 0):
        raise ValueError(f"scale={value!r} is not a positive finite {dtype.name}")
    return lam


def check_scale(scale):
    """Validate a sigmoid scale; return (value as float, True when the argument forces float64).

    A plain Python float is weakly typed (it does not make a float32 computation float64); a
    NumPy float64 scalar or 0-d array is not.
    """
    if isinstance(scale, (bool, np.bool_)):
        raise TypeError(f"scale must be a positive real number, got {scale!r}")
    if isinstance(scale, (int, float, np.integer, np.floating)):
        strong64 = isinstance(scale, np.float64)  # a plain Python float is weakly typed
        value = float(scale)
    elif isinstance(scale, np.ndarray) or is_cupy_array(scale):
        scale = as_array(scale, "scale")  # native byte order: '>f8' is float64 too
        if scale.dtype.kind not in "iuf":
            raise TypeError(f"scale: dtype {scale.dtype} is not a real number type")
        if scale.ndim != 0:
            raise ValueError(f"scale must be a scalar (0-d array), got shape {scale.shape}")
        strong64 = scale.dtype == np.float64
        value = float(scale)  # one device-to-host copy for a CuPy scalar
    else:
        raise TypeError(f"scale must be a positive real number, got {type(scale).__name__}")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"scale must be positive and finite, got {value!r}")
    return value, strong64


BOUNDARIES = ("box", "periodic")


def check_boundary(boundary, image, ndim) -> bool:
    """Validate ``boundary``; return True for "periodic" (every spatial axis must be >= 3)."""
    if not isinstance(boundary, str):
        raise TypeError(f"boundary must be 'box' or 'periodic', got {boundary!r}")
    if boundary not in BOUNDARIES:
        raise ValueError(f"boundary must be 'box' or 'periodic', got {boundary!r}")
    if boundary == "box":
        return False
    spatial = tuple(image.shape[image.ndim - ndim:])
    if any(s < 3 for s in spatial):
        raise ValueError(f"image: boundary='periodic' needs every spatial axis to have length >= 3 "
                         f"(with 1 or 2 the torus complex degenerates), got spatial shape {spatial}")
    return True
