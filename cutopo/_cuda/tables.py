"""Small device arrays that kernels on any stream read: lookup tables, masks, coordinates.

Such arrays are made once and kept (memoized) while the op that needs them runs on whatever
stream is current, call after call. Two rules keep that safe across streams:

* *Ready for every stream.* An array made on the current stream is complete only in that
  stream's order (``cupy.asarray`` of host data stages it through pinned memory and copies it
  asynchronously), so a kernel on another stream could read it first: measured on the H200,
  4 of 5 tables read at once from a second stream were wrong. :func:`upload` and
  :func:`made_ready` make the array on a private non-blocking stream of the device and wait
  for it there, which waits for that work alone, not for what the caller's stream has queued.
* *Freed only when no stream can still read it.* Memory returns to the pool of the stream that
  allocated it, which may hand it out again while a kernel on another stream still reads the
  old contents. :func:`retire` keeps an array until a batch of them has gathered, then
  synchronises the device once and lets the batch go.

:func:`memoized` combines both for host tables: a bounded cache keyed by the bytes.
"""
from __future__ import annotations

import collections
import threading
import weakref

import numpy as np

MAX_MEMOIZED = 1024            # host tables kept per device (small: at most tens of KiB)
# Retired arrays are freed together after one device synchronisation, once this many have
# gathered or they hold this many bytes. The synchronisation drains every stream (a streamed
# ECT retires a coordinate table or two per slab), so batches are large and the arrays small.
RETIRE_COUNT = 256
RETIRE_BYTES = 64 << 20

_lock = threading.Lock()
_streams: dict = {}
_memo: "collections.OrderedDict" = collections.OrderedDict()
_retired: dict = collections.defaultdict(list)


def _private_stream():
    import cupy

    device = cupy.cuda.runtime.getDevice()
    stream = _streams.get(device)
    if stream is None:
        with _lock:
            stream = _streams.setdefault(device, cupy.cuda.Stream(non_blocking=True))
    return stream


def made_ready(make):
    """``make()`` (CuPy work that returns a device array, reading no arrays of the caller's
    streams) run on the device's private stream and waited for: its result may be read by any
    stream at once."""
    stream = _private_stream()
    with stream:
        out = make()
    stream.synchronize()
    return out


def upload(host):
    """A device copy of the host array ``host`` on the current device, ready for every stream."""
    import cupy

    host = np.ascontiguousarray(host)
    return made_ready(lambda: cupy.asarray(host))


def retire(*arrays):
    """Let go of device arrays that kernels on other streams may still be reading: they are kept
    until RETIRE_COUNT of them (or RETIRE_BYTES) have gathered on their device, which is then
    synchronised once before they are freed together."""
    import cupy

    for a in arrays:
        if a is None:
            continue
        device = a.device.id
        with _lock:
            batch = _retired[device]
            batch.append(a)
            if len(batch) < RETIRE_COUNT and sum(b.nbytes for b in batch) < RETIRE_BYTES:
                continue
            _retired[device] = []
        with cupy.cuda.Device(device):
            cupy.cuda.runtime.deviceSynchronize()
        del batch  # freed here: nothing queued before the synchronisation can still read it


def retire_with(owner, *arrays):
    """Retire ``arrays`` when ``owner`` (a plan, a tessellation that holds them) is collected."""
    weakref.finalize(owner, retire, *arrays).atexit = False  # at exit the device may be gone


def memoized(host):
    """The device copy of the small host array ``host``, made by :func:`upload` once per
    (device, dtype, shape, contents) and kept among the last MAX_MEMOIZED; read-only by
    convention (never write into it)."""
    import cupy

    host = np.ascontiguousarray(host)
    key = (cupy.cuda.runtime.getDevice(), host.dtype.str, host.shape, host.tobytes())
    with _lock:
        hit = _memo.get(key)
        if hit is not None:
            _memo.move_to_end(key)
            return hit
    dev = upload(host)
    evicted = []
    with _lock:
        dev = _memo.setdefault(key, dev)  # another thread may have made the same meanwhile
        _memo.move_to_end(key)
        while len(_memo) > MAX_MEMOIZED * max(1, len(_streams)):
            evicted.append(_memo.popitem(last=False)[1])
    retire(*evicted)
    return dev
