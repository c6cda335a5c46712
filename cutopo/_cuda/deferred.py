"""Argument checks that run on the device and are read once the op's work is queued.

Some checks need the values of device arrays (finiteness, order, a norm). Reading them with
``.get()`` before launching the op's kernels makes the host wait for everything already queued
on the stream, then leaves the GPU idle while the host launches the rest. Instead a check
kernel writes its flags into a small device array, :class:`DeferredFlags` queues their copy
into page-locked host memory behind it, the op queues its own kernels, and only then waits
for the copy (an event recorded after it) and raises if a check failed. The op's kernels must
therefore be safe on the bad input they may run on (bounded loops, clamped indices); their
output is never returned, since the error is raised before the call returns.

The rule "bad input raises at the call" holds: :meth:`DeferredFlags.read` runs before the op
returns, on the success path and on the error path alike (:func:`reading`).
"""
from __future__ import annotations

import contextlib

import numpy as np


class DeferredFlags:
    """A copy of the C-contiguous CuPy array ``values`` on its way to page-locked host memory,
    queued on the current stream behind the kernels that wrote it."""

    def __init__(self, values):
        import cupy

        self._shape, self._dtype, self._size = values.shape, values.dtype, values.size
        nbytes = max(values.nbytes, 1)
        self._memory = cupy.cuda.alloc_pinned_memory(nbytes)   # from CuPy's pinned pool
        stream = cupy.cuda.get_current_stream()
        if values.nbytes:
            cupy.cuda.runtime.memcpyAsync(self._memory.ptr, values.data.ptr, values.nbytes,
                                          cupy.cuda.runtime.memcpyDeviceToHost, stream.ptr)
        self._event = cupy.cuda.Event(block=False, disable_timing=True)
        self._event.record(stream)
        self._source = values      # alive until the copy is done
        self._values = None

    def read(self) -> np.ndarray:
        """The values (a NumPy array), after waiting for the copy (once; later calls return the
        same array). The page-locked memory goes back to CuPy's pool only after that wait."""
        if self._values is None:
            self._event.synchronize()
            host = np.frombuffer(self._memory, dtype=self._dtype, count=self._size)
            self._values = host.reshape(self._shape).copy()
            self._memory = self._source = None
        return self._values


@contextlib.contextmanager
def reading(flags, raise_failed):
    """Run the body (the op's launches), then ``raise_failed(flags.read())`` (``flags``: a
    :class:`DeferredFlags` or a queued :class:`PinnedWord`), which raises the
    checks' error if one failed. If the body itself raises, the flags are read all the same:
    a failed check is raised in its place (bad input is the likelier cause), else the body's
    error propagates."""
    try:
        yield flags
    except BaseException as exc:
        try:
            raise_failed(flags.read())
        except ValueError as check_error:
            raise check_error from exc
        raise
    raise_failed(flags.read())


class PinnedWord:
    """A page-locked slot for one 8-byte flags word, reused call after call by one thread: a
    memoized plan's call then allocates no pinned memory and creates no event (each of those
    costs microseconds per call). :meth:`queue` copies the word behind the kernel that wrote
    it, on the current stream; :meth:`read` waits for that copy, as :class:`DeferredFlags`
    does. Keep one per thread (``threading.local``): a copy queued by another thread between a
    queue and its read would overwrite the slot."""

    def __init__(self):
        import cupy

        self._memory = cupy.cuda.alloc_pinned_memory(8)
        self._host = np.frombuffer(self._memory, dtype=np.uint64, count=1)
        self._event = cupy.cuda.Event(block=False, disable_timing=True)
        self._queued = False

    def queue(self, word) -> "PinnedWord":
        """Queue the copy of ``word[0]`` (a CuPy array of 8-byte words) into the slot."""
        import cupy

        if self._queued:  # a copy that was never read (an interrupted call) must land first
            self._wait()
        stream = cupy.cuda.get_current_stream()
        cupy.cuda.runtime.memcpyAsync(self._memory.ptr, word.data.ptr, 8,
                                      cupy.cuda.runtime.memcpyDeviceToHost, stream.ptr)
        self._event.record(stream)
        self._queued = True
        return self

    def _wait(self) -> None:
        import cupy

        try:
            self._event.synchronize()
        except BaseException:
            # e.g. the event was recorded inside a stream capture that the wait invalidated:
            # a fresh event for the next call (no captured copy will run, the capture failed)
            self._event = cupy.cuda.Event(block=False, disable_timing=True)
            raise
        finally:
            self._queued = False

    def read(self) -> np.ndarray:
        """The word (a 1-element uint64 array) once its copy is done; zero if none was queued."""
        if not self._queued:
            return np.zeros(1, dtype=np.uint64)
        self._wait()
        return self._host.copy()
