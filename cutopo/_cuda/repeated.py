"""What an op planned for a CuPy call, kept for the next call of the same kind.

A training loop calls an op again and again on arguments of the same shapes, dtypes and
layouts, on the same device. The checks and the planning that read nothing but those cost
~7-30 us of host time a call on the device machines' hosts, as much as the kernels of a small
call. An op keeps their result in a :class:`RepeatedCalls` under :meth:`RepeatedCalls.key`
and skips them when the key comes again; it still runs, at every call, the checks that read
values (the scale on the host, the arrays' values in its kernels).
"""
from __future__ import annotations

import threading

import numpy as np

from .._array import _cupy
from .launch import _current_device

# the scales whose check is their value's alone (float(scale) is exact)
FLOAT_SCALES = (float, np.float32, np.float64)
NO_SCALE = object()  # RepeatedCalls.key of an op without a scale


class RepeatedCalls(dict):
    """A bounded table, key -> what an op planned (holding no array of the call), the oldest
    entry dropped first when full."""

    def __init__(self, capacity: int = 256):
        super().__init__()
        self.capacity = capacity
        self._lock = threading.Lock()  # keep() from threads: its eviction iterates the table

    @staticmethod
    def key(arrays, static, scale=NO_SCALE):
        """The key of a call whose checks read nothing but what the key holds, or None.

        ``arrays``: the call's arrays, each a C-contiguous ``cupy.ndarray`` (no subclass) on
        the current device; ``static`` a tuple of the other arguments, each None, an int or a
        str (exact types: ``True`` or ``2.0`` would compare equal to another call's ``1`` or
        ``2``); ``scale``, where the op has one, a Python or NumPy float32/float64 float (its
        value is the op's to check at every call). An entry is kept only after the op's own
        checks passed on a call with this key, so equal keys pass them too.
        """
        cupy = _cupy()
        scale_type = type(scale)
        if cupy is None or not (scale is NO_SCALE or scale_type in FLOAT_SCALES):
            return None
        for value in static:
            if not (value is None or type(value) is int or type(value) is str):
                return None
        ndarray = cupy.ndarray
        for a in arrays:  # types first: a NumPy call must not ask CUDA for the current device
            if type(a) is not ndarray:
                return None
        device = _current_device()
        parts = [device, scale_type, static]
        for a in arrays:
            # (launch._c_contiguous inline: this runs before a repeated call's first launch,
            # where each Python call costs more than its time in a loop)
            flag = getattr(a, "_c_contiguous", None)
            if a.data.device_id != device or not (a.flags.c_contiguous if flag is None else flag):
                return None
            parts.append(a.shape)
            parts.append(a.dtype)
        return tuple(parts)

    def keep(self, key, value) -> None:
        """Keep ``value`` under ``key`` (a first call's: lookups stay lock-free)."""
        with self._lock:
            if key not in self and len(self) >= self.capacity:
                del self[next(iter(self))]
            self[key] = value
