"""Device workspaces kept from one call to the next.

A kernel that gathers into a zeroed workspace (counters, per-row sums) and whose last block
zeroes it again lets its plan keep the workspace: a call then launches on it without a memset
first (:class:`ZeroedWorkspaces`). A plan whose kernels leave theirs dirty keeps it all the
same and zeroes it with one memset a call (:class:`MemsetWorkspaces`), together with the views
its launches take. Kernels on one stream run in order, so one workspace per stream serves them
all; two threads may interleave their launches on one stream, so each thread keeps its own.
"""
from __future__ import annotations

import threading

import numpy as np


class _KeptPerStream:
    """Workspaces kept per (kind, thread, stream) up to ``keep_bytes`` each."""

    def __init__(self, keep_bytes: int):
        self.keep_bytes = keep_bytes
        self._local = threading.local()

    def _slot(self, kind: str, stream: int | None = None):
        """(this thread's kept workspaces, the key of ``kind`` on the current stream, whose
        pointer the caller may have read: ``stream``)."""
        import cupy

        kept = getattr(self._local, "workspaces", None)
        if kept is None:
            kept = self._local.workspaces = {}
        return kept, (kind, cupy.cuda.get_current_stream().ptr if stream is None else stream)


class ZeroedWorkspaces(_KeptPerStream):
    """A plan's zeroed workspaces, one per (kind, thread, stream); those above ``keep_bytes``
    are made zeroed at every call instead (a large batch's would stay allocated)."""

    def get(self, kind: str, words: int, dtype, stream: int | None = None):
        """A zeroed device array of ``words`` elements of ``dtype`` for ``kind``, on the
        current device and stream (``stream``: its pointer, if the caller has read it); the
        caller's kernels must leave it zeroed. A kind has one size and dtype (a plan's
        workspaces are the same call after call)."""
        import cupy

        kept, key = self._slot(kind, stream)
        ws = kept.get(key)
        if ws is not None and ws.size == words:  # kept, so within keep_bytes: the usual case
            return ws
        if words * np.dtype(dtype).itemsize > self.keep_bytes:
            return cupy.zeros(words, dtype=dtype)
        ws = kept[key] = cupy.zeros(words, dtype=dtype)
        return ws

    def kept(self) -> list:
        """This thread's kept workspaces (the tests check that the kernels left them zeroed)."""
        return list(getattr(self._local, "workspaces", {}).values())


class MemsetWorkspaces(_KeptPerStream):
    """A plan's workspaces that each call zeroes (one memset on the current stream, before its
    launches), kept per (kind, thread, stream) up to ``keep_bytes`` with the views of them that
    the launches take: the soft ECT's forward made a zeroed workspace and four views of it per
    call, ~15 us of host time on the H100 machines (forty-second session), where this costs a
    memset. Larger ones are made zeroed at every call, with their views."""

    def get(self, kind: str, words: int, dtype, views):
        """``views(workspace)`` of a workspace of ``words`` elements of ``dtype`` for ``kind``,
        zeroed on the current stream (so after the earlier calls' kernels that used it)."""
        import cupy

        if words * np.dtype(dtype).itemsize > self.keep_bytes:
            return views(cupy.zeros(words, dtype=dtype))
        kept, key = self._slot(kind)
        entry = kept.get(key)
        if entry is None:
            ws = cupy.zeros(words, dtype=dtype)
            entry = kept[key] = (ws, views(ws))
        else:
            self.zero(entry[0])
        return entry[1]

    @staticmethod
    def zero(ws) -> None:
        """Zeroes a kept workspace on the current stream."""
        ws.data.memset_async(0, ws.nbytes)


class MadeAhead:
    """Arrays made for the next call of a plan while this call's kernels run.

    What a call does before its first launch is host time that a per-call timing (and a
    training step) pays in full; each array made there cost ~2-5 us on the device machines'
    hosts (``cupy.ndarray``, a pool allocation). A plan whose calls make the same arrays call
    after call makes the next call's right after queueing launches (this call's, or those of
    the backward that follows it), while the GPU works (:meth:`make_next`), and the next call
    of the same kind on the same thread and stream takes them (:meth:`take`) instead of
    making its own. Only one set is held per thread (a call of another plan or kind replaces
    it) and only up to ``max_bytes``, so what stays allocated between calls is at most one
    call's arrays, made on the stream that will use them (the memory pool orders their reuse
    by that stream). The arrays are what ``make`` returns: unwritten ones (``cupy.ndarray``)
    that the caller's kernels write in full, or objects it keeps anyway (the soft ECC passes its
    zeroed workspace of that stream along, so that its next call skips the lookup).
    """

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._local = threading.local()

    @staticmethod
    def _stream() -> int:
        import cupy

        return cupy.cuda.get_current_stream().ptr

    def take(self, owner, kind, stream: int | None = None):
        """The arrays made for ``owner``'s call of ``kind`` (hashable, compared with ==) on the
        current stream (``stream``: its pointer, if the caller has read it), or None (then the
        caller makes them); handed out once."""
        held = getattr(self._local, "held", None)
        if held is None:
            return None
        self._local.held = None
        key, arrays = held
        return arrays if key == (owner, kind, self._stream() if stream is None else stream) else None

    def make_next(self, owner, kind, make) -> None:
        """Make ``make()`` (a tuple of arrays, None where there is none) for the next call of
        ``kind`` and hold it, unless it takes more than ``max_bytes`` or the device is out of
        memory (the next call then makes its own, and raises there if it must)."""
        import cupy

        self._local.held = None  # this thread's earlier set goes back to the pool first
        try:
            arrays = make()
        except cupy.cuda.memory.OutOfMemoryError:
            return
        if sum(a.nbytes for a in arrays if a is not None) <= self.max_bytes:
            self._local.held = ((owner, kind, self._stream()), arrays)

    def drop(self) -> None:
        """Let go of this thread's arrays (tests, and a caller about to need the memory)."""
        self._local.held = None


# The one MadeAhead of every op that makes its arrays ahead: one set per thread in all. 256 MiB:
# bench_soft's 256^3 cutopo.vjp soft_ecc forward makes 80 MB (16 MB of kept entries, 64 MB of
# d_image); a 512^3 volume's (640 MB) is made at its call.
made_ahead = MadeAhead(256 << 20)
