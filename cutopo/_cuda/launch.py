"""The one launch path of every cutopo kernel.

A RawKernel receives raw pointers and raw bytes: CuPy does no type checking, a Python float
reaches a ``float`` parameter as the first half of a double, and views/strides are ignored.
So every kernel declares its signature (:class:`Signature`) and every launch goes through
:func:`launch`, which checks each array (type, dtype, C-contiguity, device) and converts each
scalar to the declared C type (range-checked), then launches on CuPy's current stream.
"""
from __future__ import annotations

import dataclasses
import functools
import os

import numpy as np

from .._array import _cupy
from .compile import get_function

# Declared parameter kinds: "ptr:<numpy dtype>" for arrays, a numpy dtype name for scalars.
_SCALAR_KINDS = {"int32", "int64", "float32", "float64"}


@dataclasses.dataclass(frozen=True)
class Signature:
    """A kernel instance and the kinds of its parameters, in order."""

    family: str
    name: str                # C++ name expression, e.g. "cutopo::ecc::ecc_cumsum"
    params: tuple[str, ...]  # e.g. ("ptr:int64", "int64", "int32")


class LaunchError(RuntimeError):
    pass


@functools.lru_cache(maxsize=None)
def _device_attributes(device_id: int) -> dict:
    import cupy

    return dict(cupy.cuda.Device(device_id).attributes)


def device_attribute(name: str) -> int:
    """An attribute of the current device (names as in cudaDevAttr*, without the prefix)."""
    import cupy

    return _device_attributes(cupy.cuda.Device().id)[name]


@functools.lru_cache(maxsize=None)
def _pointer_dtype(kind: str):
    """The NumPy dtype of a "ptr:<dtype>" parameter kind, None for a scalar kind (memoized:
    parsing a dtype name at every launch is measurable at small sizes)."""
    return np.dtype(kind[4:]) if kind.startswith("ptr:") else None


def _check_array(value, dtype, index: int, sig: Signature, device=None):
    """``value`` if it is a C-contiguous CuPy array of ``dtype`` on the current device
    (``device``, read here when None), else a LaunchError."""
    if not isinstance(value, _cupy().ndarray):
        raise LaunchError(f"{sig.name}: argument {index} must be a cupy.ndarray, got {type(value)}")
    if value.dtype != dtype:
        raise LaunchError(f"{sig.name}: argument {index} has dtype {value.dtype}, kernel expects {dtype}")
    if not value.flags.c_contiguous:
        raise LaunchError(f"{sig.name}: argument {index} is not C-contiguous; kernels ignore strides")
    if value.size:
        if device is None:
            device = _current_device()
        if value.device.id != device:
            raise LaunchError(f"{sig.name}: argument {index} lives on device {value.device.id}, "
                              f"launching on device {device}")
    return value


def _current_device() -> int:
    return _cupy().cuda.runtime.getDevice()


@functools.lru_cache(maxsize=None)
def _scalar_kind(kind: str):
    """(dtype, smallest, largest) of a scalar parameter kind (None, None for floats); memoized,
    as np.iinfo costs microseconds per launch argument."""
    if kind not in _SCALAR_KINDS:
        return None
    dtype = np.dtype(kind)
    if dtype.kind == "i":
        info = np.iinfo(dtype)
        return dtype, int(info.min), int(info.max)
    return dtype, None, None


def _convert(value, kind: str, index: int, sig: Signature, device=None):
    dtype = _pointer_dtype(kind)
    if dtype is not None:
        return _check_array(value, dtype, index, sig, device)
    scalar = _scalar_kind(kind)
    if scalar is None:
        raise LaunchError(f"{sig.name}: unknown parameter kind {kind!r}")
    dtype, lo, hi = scalar
    if lo is not None:
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
            raise LaunchError(f"{sig.name}: argument {index} must be an integer, got {value!r}")
        if not lo <= int(value) <= hi:
            raise LaunchError(f"{sig.name}: argument {index} = {value} overflows {kind}")
        return dtype.type(int(value))
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise LaunchError(f"{sig.name}: argument {index} must be a real number, got {value!r}")
    return dtype.type(value)


def _checked_kernel(sig: Signature, grid: int, shared_mem: int, options: tuple[str, ...],
                    device=None):
    device = _current_device() if device is None else device
    if grid > _device_attributes(device)["MaxGridDimX"]:
        raise LaunchError(f"{sig.name}: grid of {grid} blocks exceeds the device limit")
    if shared_mem <= 48 * 1024:
        return _kernel(device, sig, options)
    if shared_mem > _device_attributes(device)["MaxSharedMemoryPerBlockOptin"]:
        raise LaunchError(f"{sig.name}: {shared_mem} bytes of shared memory exceed the device limit")
    kernel = _kernel(device, sig, options)
    kernel.max_dynamic_shared_size_bytes = shared_mem
    return kernel


@functools.lru_cache(maxsize=None)
def _kernel(device_id: int, sig: Signature, options: tuple[str, ...]):
    """The compiled kernel of ``sig`` on a device (memoized: a launch then costs a lookup)."""
    return get_function(sig.family, sig.name, options)


# Debugging: CUTOPO_SYNC=1 (read when cutopo is imported) synchronises after every launch, so
# that a fault surfaces at the launch that caused it. Read once: an environment lookup costs
# microseconds at every launch.
SYNC = os.environ.get("CUTOPO_SYNC") == "1"


def _after_launch(sig: Signature) -> None:
    if SYNC:
        import cupy

        try:
            cupy.cuda.get_current_stream().synchronize()
        except Exception as exc:  # pragma: no cover - needs a faulting kernel
            raise LaunchError(f"{sig.name} failed: {exc}") from exc


def launch(sig: Signature, grid: int, block: int, args: tuple, *, shared_mem: int = 0,
           options: tuple[str, ...] = ()) -> None:
    """Check and convert ``args`` against ``sig``, then launch a 1-D grid on the current stream."""
    if len(args) != len(sig.params):
        raise LaunchError(f"{sig.name}: {len(args)} arguments given, signature has {len(sig.params)}")
    device = _current_device()
    converted = tuple(_convert(a, k, i, sig, device) for i, (a, k) in enumerate(zip(args, sig.params)))
    if grid <= 0:
        return  # nothing to do; CuPy would clamp the grid to 1 block
    kernel = _checked_kernel(sig, grid, shared_mem, options, device)
    kernel((int(grid),), (int(block),), converted, shared_mem=int(shared_mem))
    _after_launch(sig)


class PreparedLaunch:
    """A launch whose geometry and most arguments are fixed: per call only a few change.

    ``args`` holds every argument, with ``None`` where one is passed at call time (typically
    the arrays, and scalars such as a learnable scale); the fixed ones are converted once here,
    the call-time ones are checked and converted at every call, like :func:`launch` does.
    """

    def __init__(self, sig: Signature, grid: int, block: int, args: tuple, *, shared_mem: int = 0,
                 options: tuple[str, ...] = ()):
        if len(args) != len(sig.params):
            raise LaunchError(f"{sig.name}: {len(args)} arguments given, signature has {len(sig.params)}")
        self.sig, self.grid, self.block, self.shared_mem = sig, int(grid), int(block), int(shared_mem)
        self.slots = [i for i, a in enumerate(args) if a is None]
        # per call-time slot: (index, array dtype or None for a scalar); the checks at call
        # time are _convert's, with the dtypes parsed once and the current device read once
        # per call (a PreparedLaunch exists only where a device does)
        self._slot_kinds = [(i, _pointer_dtype(sig.params[i])) for i in self.slots]
        self._has_arrays = any(d is not None for _, d in self._slot_kinds)
        self.args = [a if a is None else _convert(a, k, i, sig) for i, (a, k) in enumerate(zip(args, sig.params))]
        self.kernel = _checked_kernel(sig, self.grid, self.shared_mem, options) if self.grid > 0 else None

    def __call__(self, *values) -> None:
        if len(values) != len(self.slots):
            raise LaunchError(f"{self.sig.name}: {len(values)} arguments given, {len(self.slots)} expected")
        args = list(self.args)
        sig = self.sig
        device = _current_device() if self._has_arrays else None
        for (i, dtype), a in zip(self._slot_kinds, values):
            args[i] = (_check_array(a, dtype, i, sig, device) if dtype is not None
                       else _convert(a, sig.params[i], i, sig))
        if self.kernel is None:
            return
        self.kernel((self.grid,), (self.block,), tuple(args), shared_mem=self.shared_mem)
        _after_launch(self.sig)

    def call_prechecked(self, *values) -> None:
        """Launch like ``__call__``, without checking ``values`` again.

        Only for a caller that passed arguments of the same kinds through ``__call__`` before
        and has proved that these match them in everything the checks look at: array dtype,
        C-contiguity and device (the current one), scalars already of their C types. A plan
        memoized on exactly those properties is such a caller; anything else uses
        ``__call__``.
        """
        args = list(self.args)
        for i, a in zip(self.slots, values):
            args[i] = a
        if self.kernel is None:
            return
        self.kernel((self.grid,), (self.block,), tuple(args), shared_mem=self.shared_mem)
        _after_launch(self.sig)


def resident_blocks(sig: Signature, block: int, shared_mem: int = 0,
                    options: tuple[str, ...] = ()) -> int:
    """How many blocks of this kernel the whole device runs at once (memoized per device)."""
    import cupy

    return _resident_blocks(cupy.cuda.Device().id, sig, int(block), int(shared_mem), tuple(options))


@functools.lru_cache(maxsize=1024)
def _resident_blocks(device_id, sig, block, shared_mem, options):
    import cupy

    kernel = get_function(sig.family, sig.name, options)
    per_sm = cupy.cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor(
        kernel.kernel.ptr, block, shared_mem)
    return max(1, per_sm) * device_attribute("MultiProcessorCount")
