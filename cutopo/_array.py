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


def as_array(x, name: str):
    """A NumPy or CuPy array from ``x``; other array-likes become NumPy arrays."""
    if isinstance(x, np.ndarray) or is_cupy_array(x):
        return x
    try:
        return np.asarray(x)
    except Exception as exc:
        raise TypeError(f"{name} must be an array, got {type(x).__name__}") from exc


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
