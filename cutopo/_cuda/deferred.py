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

Where the op's own first kernel can do the check (one of its blocks), it writes the flags
straight into a :class:`PinnedWord` in page-locked host memory, which the host reads as soon
as they land: no check kernel, copy or event at all; a check reduced over all of a kernel's
blocks goes the same way through a :class:`PinnedStatus` (its last block stores it).
"""
from __future__ import annotations

import contextlib
import threading

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
    :class:`DeferredFlags`), which raises the
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
    """A page-locked host word that a kernel writes its check flags into directly, reused call
    after call by one thread (keep one per thread: ``threading.local``).

    Under unified addressing (every 64-bit CUDA platform) page-locked memory is mapped into each
    device's address space, so the kernel stores ``(token << 2) | flags`` into it and the host
    reads it as soon as that store lands, while the rest of the kernel still runs: no check
    kernel, copy or event per call (together ~20 us of host time on the H200 machines). Per
    call: :meth:`arm` returns a fresh token, the launch passes this word (launch kind
    ``host:uint64``) and the token, and :meth:`read` waits for the word to carry that token.
    A late store of an abandoned earlier launch (an interrupted call) has an older token and is
    not taken for this one's.
    """

    # Polls of the word before read() falls back to waiting for the stream: a few hundred us,
    # so that a kernel queued behind long work does not keep a host core spinning.
    SPINS = 4000
    _TOKENS = (1 << 62) - 1

    def __init__(self, words: int = 1):
        import cupy

        runtime = cupy.cuda.runtime
        memory = cupy.cuda.PinnedMemory(8 * words, runtime.hostAllocPortable | runtime.hostAllocMapped)
        self._memory = cupy.cuda.PinnedMemoryPointer(memory, 0)  # the buffer NumPy reads
        self._host = np.frombuffer(self._memory, dtype=np.uint64, count=words)
        self._host[:] = 0
        self.device_ptr = int(runtime.pointerGetAttributes(self._memory.ptr).devicePointer)
        self._token = 0
        self._stream = None

    def arm(self, stream=None) -> int:
        """The token of the next launch that writes this word (on the current stream; ``stream``:
        that ``cupy.cuda.Stream``, if the caller has it)."""
        if stream is None:
            import cupy

            stream = cupy.cuda.get_current_stream()
        self._token = self._token % self._TOKENS + 1
        self._stream = stream
        return self._token

    def read(self) -> int:
        """The flags (the word's low two bits) written with the armed token; waits for them."""
        host, token = self._host, self._token
        for _ in range(self.SPINS):
            word = int(host[0])
            if word >> 2 == token:
                return word & 3
        stream = self._stream
        if stream.is_capturing():
            raise RuntimeError("a kernel's argument check cannot be read inside a CUDA graph "
                               "capture (the kernel does not run there); pass the checked "
                               "arguments from the host")
        stream.synchronize()  # the kernel has run (or its failure raises here)
        word = int(host[0])
        if word >> 2 != token:
            raise RuntimeError("internal: a kernel finished without writing its check word")
        return word & 3


class PinnedStatus(PinnedWord):
    """A :class:`PinnedWord` with a second word, and three device counters, for a kernel whose
    blocks reduce check flags and a maximum into device memory and whose last block publishes
    them (``cpab::prepare_cells``): it stores the maximum's 64 bits in word 1, then word 0 as a
    PinnedWord's, and zeroes the counters for the next launch. So a call needs no memset, copy
    or event for its checks (~25 us of host time on the H200 machines).

    One object serves one thread's launches on one device, one after another, on any stream;
    keep one per thread and device. A launch whose flags were never read (an interrupted call)
    may still be reducing into the counters: :meth:`arm` waits for it first.
    """

    def __init__(self):
        import cupy

        super().__init__(words=2)
        self.counters = cupy.zeros(3, dtype=np.uint64)   # flags, maximum, finished blocks
        self._unread = False

    def arm(self) -> int:
        if self._unread and not self._stream.is_capturing():   # nothing of a capture runs
            self._stream.synchronize()
        token = super().arm()
        self._unread = True
        return token

    def read_status(self) -> tuple[int, int]:
        """(flags, the maximum's 64 bits) of the armed launch; waits for them."""
        flags = self.read()
        self._unread = False
        return flags, int(self._host[1])


_STATUSES = threading.local()


def thread_status(kind: str) -> PinnedStatus:
    """This thread's :class:`PinnedStatus` for the kernel ``kind`` on the current device (one
    per thread, device and kernel: a PinnedStatus serves one launch after the other)."""
    import cupy

    table = getattr(_STATUSES, "table", None)
    if table is None:
        table = _STATUSES.table = {}
    key = (kind, cupy.cuda.runtime.getDevice())
    status = table.get(key)
    if status is None:
        status = table[key] = PinnedStatus()
    return status
