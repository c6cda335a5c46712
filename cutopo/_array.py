"""Array-type dispatch: NumPy arrays take the NumPy path, CuPy arrays the CUDA kernels."""
from __future__ import annotations

import functools

import numpy as np


@functools.lru_cache(maxsize=None)
def _cupy():
    try:
        import cupy
    except ImportError:
        return None
    return cupy


def gpu_available() -> bool:
    """True when CuPy is installed and sees a CUDA device (``import cupy`` alone proves nothing)."""
    cupy = _cupy()
    if cupy is None:
        return False
    try:
        return bool(cupy.cuda.is_available())
    except Exception:  # pragma: no cover - broken driver installs
        return False


def is_cupy_array(x) -> bool:
    cupy = _cupy()
    return cupy is not None and isinstance(x, cupy.ndarray)


def array_module(x):
    """``cupy`` for CuPy arrays, else ``numpy``."""
    return _cupy() if is_cupy_array(x) else np


def native_byte_order(x):
    """``x``, or a copy in the machine's byte order of a NumPy array stored in the other one
    (big-endian data from FITS, HDF5 or Zarr files): the dtype rules (``dtype == float64``),
    CuPy and the kernels all work in native byte order."""
    if isinstance(x, np.ndarray) and not x.dtype.isnative:
        return x.astype(native_dtype(x.dtype))
    return x


def native_dtype(dtype) -> np.dtype:
    """``dtype`` in the machine's byte order."""
    dtype = np.dtype(dtype)
    return dtype if dtype.isnative else dtype.newbyteorder("=")


def as_array(x, name: str):
    """A NumPy or CuPy array from ``x``, in native byte order; other array-likes become NumPy
    arrays."""
    if is_cupy_array(x):
        return x
    if isinstance(x, np.ma.MaskedArray):
        # its mask would be dropped silently: every op reads the data underneath
        raise TypeError(f"{name} is a numpy.ma.MaskedArray, whose mask cutopo would ignore: pass "
                        f"{name}.filled(value), with the value its masked entries should take "
                        "(numpy.nan keeps pixels out of every sublevel set of the ECC ops)")
    if not isinstance(x, np.ndarray):
        try:
            x = np.asarray(x)
        except Exception as exc:
            raise TypeError(f"{name} must be an array, got {type(x).__name__}") from exc
    return native_byte_order(x)


def to_device(x, device: str):
    """Move an array to ``"cpu"`` (NumPy) or ``"gpu"`` (CuPy)."""
    if device == "cpu":
        return x.get() if is_cupy_array(x) else np.asarray(x)
    if device == "gpu":
        if not gpu_available():
            raise RuntimeError("device='gpu' was asked for, but CuPy sees no CUDA device")
        return _cupy().asarray(x)
    raise ValueError(f"device must be 'cpu' or 'gpu', got {device!r}")


def to_numpy(x):
    return x.get() if is_cupy_array(x) else np.asarray(x)
