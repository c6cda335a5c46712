"""Out-of-core ECC and ECT: a volume read in slabs along its first spatial axis.

The exact ECC is a sum of per-pixel contributions c(p), and c(p) depends only on the keys of
p's 3^ndim neighbourhood and on the direction of each neighbour (the C-order tie-break). A slab
of planes [z0, z1) read together with the planes z0 - 1 and z1 (its one-plane halo) therefore
gives the contributions of its own planes exactly; the halo planes are counted by the slabs
that own them. Every slab's histogram is added into one integer histogram, whose cumulative sum
is the curve: equal to the in-memory result, bit for bit.

Sources (:func:`is_out_of_core`): a ``numpy.memmap``, or any object with ``shape``, ``dtype``
and NumPy-style ``__getitem__`` slicing that is not an in-memory NumPy or CuPy array (a Zarr
array, an h5py dataset, ...). Small images of a batch are read whole, several per slab, without
a halo.

Backends: the NumPy path (:func:`cutopo._ecc_numpy.owned_histogram`), or the GPU: two pinned
host buffers and two device buffers, a copy stream and a compute stream, so that reading slab
k + 1 into pinned memory (host threads), copying slab k to the device and the histogram kernel
on slab k - 1 overlap (``ecc_histogram_masked`` of ``cuda_src/ecc.cu`` counts only the owned
planes and adds into the shared histogram). The slabs ramp up and down in size at both ends of
a volume (:data:`RAMP`). A source in page-locked memory is copied to the device directly; a
pageable one is staged through the pinned buffers. Page-locking a large pageable NumPy array in
place, chunk by chunk, by a background thread (:class:`HostRegistration`) is an opt-in
(:data:`HOST_REGISTER`): it was slower than staging on every measurement.

The streamed ECT on the GPU (:func:`ect`) reads and copies slabs the same way, through two
pinned and two device buffers (:func:`_device_slabs`), one slab ahead of the kernels.

Periodic boundaries (the torus): a slab's halo planes are read modulo the first axis' length;
on the CPU the NumPy torus rule counts the slab, on the GPU the slab is padded by wrapping
along the other axes on the device and the box kernel counts its own planes without the pads
(see :func:`_gpu_histogram`).
"""
from __future__ import annotations

import bisect
import collections
import concurrent.futures
import math
import mmap
import operator
import os
import threading
from typing import NamedTuple

import numpy as np

from . import _ecc_numpy
from ._array import is_cupy_array, native_dtype
from ._checks import IMAGE_DTYPES, check_count, check_spatial_ndim, thresholds_over_range

# Default slab bounds. On the GPU several slabs keep the pipeline busy: the first slab's read
# is not overlapped with anything, so it should be a small part of the volume.
DEFAULT_CPU_SLAB_BYTES = 256 << 20
DEFAULT_GPU_SLAB_BYTES = 128 << 20
# ... unless a plane is so large that a slab would hold few: then at least this many planes.
DEFAULT_MIN_PLANES = 8
DEVICES = ("cpu", "cuda")
# Tile of the NumPy path (elements; images, planes and row ranges of a plane, so a tile never
# exceeds it, see cutopo._ecc_numpy._tiles): its temporaries take at most about 60 bytes per
# element (8 MiB), and staying in the caches pays (a 256^3 float32 memmap: 427 ms with 2^20,
# 382 ms with 2^17).
CPU_STEP_ELEMENTS = 1 << 17
# Host threads that fill a pinned buffer (NumPy copies release the GIL).
READ_THREADS = min(8, os.cpu_count() or 1)
# GPU pipeline ramp: a volume split into slabs starts and ends with slabs of 1/8, 1/4 and 1/2
# of the slab size, so that what nothing overlaps (reading the first slab; copying and
# counting the last) is short.
RAMP = (8, 4, 2)
# Pageable NumPy sources on the GPU (a C-contiguous in-memory array, not a memmap, of at least
# REGISTER_MIN_BYTES) with HOST_REGISTER = True: page-locked in place with cudaHostRegister, in
# chunks of REGISTER_CHUNK_BYTES, by a background thread that stays at most REGISTER_AHEAD_SLABS
# slabs ahead of the pipeline; a slab whose chunks are registered is copied to the device
# directly (as from pinned memory), any other slab through the pinned staging buffers. Chunks
# are unregistered once copied (all before the call returns).
# Off by default: on the H200 machines it was slower than staging in every run (1024^3 uint8:
# 65.7 vs 61.3 ms, 58.5 vs 55.5, 65-71 vs 43-53; benchmarks/RESULTS.md). Registering and
# unregistering cost about as much as the copy they save (37 and 47 GB/s for one thread, at
# most 41 and 57 on more), and while a register or unregister call runs the driver holds back the
# other threads' CUDA calls: a memcpyAsync issued meanwhile waited up to 89 ms, so page-locking
# also stalls the pipeline's own copies and any other CUDA work of the process.
HOST_REGISTER = False
REGISTER_CHUNK_BYTES = 32 << 20
REGISTER_MIN_BYTES = 64 << 20
REGISTER_AHEAD_SLABS = 4


def is_out_of_core(x) -> bool:
    """True for a ``numpy.memmap`` and for array-likes that are not NumPy or CuPy arrays but have
    ``shape``, ``dtype`` and ``__getitem__`` (Zarr arrays, h5py datasets, ...)."""
    if isinstance(x, np.memmap):
        return True
    if isinstance(x, np.ndarray) or is_cupy_array(x):
        return False
    return all(hasattr(x, a) for a in ("shape", "dtype", "__getitem__"))


def check_device(device):
    """None, "cpu" or "cuda"."""
    if device is None:
        return None
    if not isinstance(device, str):
        raise TypeError(f"device must be None, 'cpu' or 'cuda', got {device!r}")
    if device not in DEVICES:
        raise ValueError(f"device must be None, 'cpu' or 'cuda', got {device!r}")
    return device


def check_max_slab_bytes(value):
    """None or a positive int."""
    if value is None:
        return None
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"max_slab_bytes must be a positive int or None, got {value!r}")
    if value < 1:
        raise ValueError(f"max_slab_bytes must be positive, got {value}")
    return int(value)


def route(image, device, max_slab_bytes, *, op):
    """Whether a call streams: (stream?, backend "cpu"/"cuda"/None, max_slab_bytes).

    CuPy arrays never stream (they are already on the device); host arrays stream when they are
    out of core, when ``device="cuda"`` (the GPU computes, the data stay on the host) or when a
    ``max_slab_bytes`` bound is asked for.
    """
    device = check_device(device)
    max_slab_bytes = check_max_slab_bytes(max_slab_bytes)
    if is_cupy_array(image):
        if device == "cpu":
            raise TypeError(f"{op}: device='cpu' but the input is a CuPy array: move it to the host "
                            "first (cutopo never copies between devices on its own)")
        if max_slab_bytes is not None:
            raise ValueError(f"{op}: max_slab_bytes applies to host inputs that are streamed; the "
                             "input is already a CuPy array")
        return False, None, None
    stream = is_out_of_core(image) or device == "cuda" or max_slab_bytes is not None
    if not stream:
        return False, None, None
    backend = device or "cpu"
    if backend == "cuda":
        from ._array import gpu_available

        if not gpu_available():
            raise RuntimeError(f"{op}: device='cuda' was asked for, but CuPy sees no CUDA device")
    return True, backend, max_slab_bytes


def slab_bytes(max_slab_bytes, backend, src, bytes_per_voxel):
    """The slab bound of a call: the one given, or the backend's default (at least
    DEFAULT_MIN_PLANES planes of ``bytes_per_voxel``)."""
    if max_slab_bytes is not None:
        return max_slab_bytes
    default = DEFAULT_GPU_SLAB_BYTES if backend == "cuda" else DEFAULT_CPU_SLAB_BYTES
    plane = math.prod(src.spatial[1:]) * bytes_per_voxel
    return int(max(default, DEFAULT_MIN_PLANES * plane))


def ecc_slab_bytes(max_slab_bytes, backend, src):
    """The slab bound of a streamed ECC call and of its min/max pass (a threshold count)."""
    return slab_bytes(max_slab_bytes, backend, src, src.dtype.itemsize + 4)


# ---------------------------------------------------------------------------------------------
# Sources


class Source(NamedTuple):
    """A validated host source of shape (*batch, *spatial). ``dtype`` is in native byte order;
    blocks read from a source stored in the other one are converted (read_piece)."""
    data: object
    shape: tuple
    dtype: np.dtype
    ndim: int

    @property
    def native(self) -> bool:
        """Whether the stored data are in native byte order (raw bytes can go to the GPU)."""
        return np.dtype(self.data.dtype).isnative

    @property
    def batch(self):
        return self.shape[:len(self.shape) - self.ndim]

    @property
    def spatial(self):
        return self.shape[len(self.shape) - self.ndim:]


def check_source(image, ndim, *, name="image", dtypes=IMAGE_DTYPES, mask=False) -> Source:
    """Validate a host source without reading its data (as check_image does for arrays)."""
    try:
        shape = tuple(operator.index(s) for s in image.shape)
        dtype = native_dtype(image.dtype)  # a big-endian FITS or Zarr volume reads as native
    except Exception as exc:
        raise TypeError(f"{name}: an out-of-core input needs integer shape and a NumPy dtype, got "
                        f"{type(image).__name__}") from exc
    if mask:
        if dtype.kind not in "biu":
            raise TypeError(f"{name}: dtype {dtype} is not bool or integer")
    elif dtype not in dtypes:
        names = ", ".join(d.name for d in dtypes)
        raise TypeError(f"{name}: dtype {dtype} is not supported (use one of {names})")
    return Source(image, shape, dtype, check_spatial_ndim(shape, ndim, name))


class Piece(NamedTuple):
    """One read: images [f0, f1) of the flattened batch, planes ``ranges`` (contiguous (a, b)
    ranges along the first spatial axis, concatenated; more than one only for periodic halos),
    ``own0`` the owned planes of the read block and ``start`` its first plane's global index."""
    lead: tuple        # batch index of the images (all batch axes but the last)
    f0: int            # flattened image range
    f1: int
    b0: int            # range along the last batch axis (== f0, f1 without batch axes)
    b1: int
    ranges: tuple
    own0: np.ndarray
    start: int

    @property
    def planes(self):
        return sum(b - a for a, b in self.ranges)


def plan_pieces(src: Source, bytes_per_voxel: float, max_slab_bytes: int, periodic=False,
                what="max_slab_bytes", ramp=()):
    """The reads of a streamed pass, each at most ``max_slab_bytes`` (``bytes_per_voxel`` counts
    what a voxel costs in memory: its input and keys). Whole images are grouped when they fit.
    ``ramp``: divisors of the slab size for the first slabs of an image split in slabs, and
    mirrored for its last ones (see :data:`RAMP`; not with ``periodic``)."""
    batch, spatial = src.batch, src.spatial
    n0 = spatial[0]
    plane = math.prod(spatial[1:])
    image_bytes = bytes_per_voxel * n0 * plane
    last = batch[-1] if batch else 1
    leads = list(np.ndindex(*batch[:-1])) if batch else [()]
    pieces = []
    per_group = int(max_slab_bytes // image_bytes) if image_bytes > 0 else last
    if per_group >= 1 and not periodic:
        for li, lead in enumerate(leads):
            for b0 in range(0, last, per_group):
                b1 = min(last, b0 + per_group)
                pieces.append(Piece(lead, li * last + b0, li * last + b1, b0, b1, ((0, n0),),
                                    np.ones(n0, dtype=bool), 0))
        return pieces
    rows = int(max_slab_bytes // (bytes_per_voxel * plane)) - 2
    if rows < 1:
        need = math.ceil(3 * bytes_per_voxel * plane)
        raise ValueError(f"{what}={max_slab_bytes} is too small: a slab needs at least one plane and "
                         f"its two halo planes, {need} bytes here (spatial shape {spatial})")
    sizes = slab_rows(n0, rows, () if periodic else ramp)
    for li, lead in enumerate(leads):
        for b in range(last):
            f = li * last + b
            for z0, z1 in zip(sizes[:-1], sizes[1:]):
                if periodic:
                    # Halo planes z0 - 1 and z1 taken modulo n0 (n0 >= 3 on the torus).
                    planes = [(z % n0) for z in range(z0 - 1, z1 + 1)]
                    ranges = _runs(planes)
                    own0 = np.zeros(len(planes), dtype=bool)
                    own0[1:-1] = True
                    start = z0 - 1
                else:
                    a, c = max(z0 - 1, 0), min(z1 + 1, n0)
                    ranges = ((a, c),)
                    own0 = np.zeros(c - a, dtype=bool)
                    own0[z0 - a:z1 - a] = True
                    start = a
                pieces.append(Piece(lead, f, f + 1, b, b + 1, ranges, own0, start))
    return pieces


def slab_rows(n0, rows, ramp=()):
    """Plane boundaries [0, ..., n0] of slabs of at most ``rows`` planes: equal slabs, or with a
    ``ramp`` of divisors, slabs of rows // d planes first (in the order given) and last (in
    reverse order), when the image holds them and at least one full slab besides."""
    head = [max(1, rows // d) for d in ramp]
    if head and n0 >= 2 * sum(head) + rows:
        middle = n0 - 2 * sum(head)
        parts = math.ceil(middle / rows)
        sizes = head + [middle // parts + (i < middle % parts) for i in range(parts)] + head[::-1]
    else:
        sizes = [rows] * (n0 // rows) + ([n0 % rows] if n0 % rows else [])
    return [0] + [int(z) for z in np.cumsum(sizes)]


def _runs(planes):
    """Contiguous (a, b) ranges covering the list of plane indices in order."""
    runs = []
    for z in planes:
        if runs and runs[-1][1] == z:
            runs[-1][1] = z + 1
        else:
            runs.append([z, z + 1])
    return tuple((a, b) for a, b in runs)


def _index(src: Source, piece: Piece, a, b):
    """The __getitem__ key of planes [a, b) of a piece's images."""
    if src.batch:
        head = piece.lead + (slice(piece.b0, piece.b1),)
    else:
        head = ()
    return head + (slice(a, b),) + (slice(None),) * (src.ndim - 1)


def piece_shape(src: Source, piece: Piece):
    """(images, planes, *spatial[1:]) of a piece's block."""
    return (piece.f1 - piece.f0, piece.planes) + tuple(src.spatial[1:])


def read_piece(src: Source, piece: Piece, out=None, pool=None):
    """The block of a piece as a host array of shape :func:`piece_shape` (into ``out`` when
    given, split across ``pool``'s threads); without ``out`` a single memmap or array range is
    returned as the source's own view where it has one."""
    shape = piece_shape(src, piece)
    if out is None and len(piece.ranges) == 1:
        a, b = piece.ranges[0]
        block = src.data[_index(src, piece, a, b)]
        block = block if isinstance(block, np.ndarray) else np.asarray(block)
        return block.astype(src.dtype, copy=False).reshape(shape)  # native byte order
    if out is None:
        out = np.empty(shape, dtype=src.dtype)
    else:
        out = out.reshape(shape)
    jobs = []
    offset = 0
    for a, b in piece.ranges:
        # Split each range into parts of about equal size, one per thread.
        parts = max(1, min(READ_THREADS if pool is not None else 1, b - a))
        cuts = np.linspace(a, b, parts + 1).astype(int)
        for c0, c1 in zip(cuts[:-1], cuts[1:]):
            if c1 > c0:
                jobs.append((offset + c0 - a, offset + c1 - a, c0, c1))
        offset += b - a
    flat_out = out.reshape((-1,) + shape[1:]) if shape[0] else out

    def copy(job):
        o0, o1, c0, c1 = job
        part = np.asarray(src.data[_index(src, piece, c0, c1)])
        flat_out[:, o0:o1] = part.reshape((shape[0], c1 - c0) + shape[2:])

    if pool is None or len(jobs) == 1:
        for job in jobs:
            copy(job)
    else:
        list(pool.map(copy, jobs))
    return out


# ---------------------------------------------------------------------------------------------
# Thresholds of a streamed source


def stream_min_max(src: Source, max_slab_bytes: int):
    """(min, max) over the finite values of a source, read slab by slab (None when none is).

    The slabs are planned at the source's itemsize per voxel, the least that any ECC pass
    counts (:func:`ecc`), and their owned planes are scanned in tiles of CPU_STEP_ELEMENTS
    elements (the finite mask is per tile), so a threshold count never needs a larger
    ``max_slab_bytes`` than explicit thresholds."""
    def slab_range(piece):
        owned = np.flatnonzero(piece.own0)  # one run of planes (no periodic pieces here)
        block = read_piece(src, piece)[:, owned[0]:owned[-1] + 1]
        return _ecc_numpy.finite_range(block, CPU_STEP_ELEMENTS)

    pieces = plan_pieces(src, src.dtype.itemsize, max_slab_bytes)
    span = _ecc_numpy.merge_ranges(map(slab_range, pieces))
    return (None, None) if span is None else span


def linear_thresholds(src: Source, n: int, max_slab_bytes: int):
    """cutopo.linear_thresholds of a streamed source (one extra pass over it)."""
    n = check_count(n)
    lo, hi = stream_min_max(src, max_slab_bytes)
    return thresholds_over_range(None if lo is None else (lo, hi), n, src.dtype)


# ---------------------------------------------------------------------------------------------
# ECC


def ecc(src: Source, t, tconn, periodic, backend, max_slab_bytes):
    """int64 (*batch, T) ECC of a streamed source; ``t`` sorted, in the comparison dtype."""
    T = int(t.size)
    nimg = math.prod(src.batch)
    if nimg == 0:
        return np.zeros(src.batch + (T,), dtype=np.int64)
    max_slab_bytes = ecc_slab_bytes(max_slab_bytes, backend, src)
    if backend == "cuda":
        hist = _gpu_histogram(src, t, tconn, max_slab_bytes, periodic)
    else:
        hist = _cpu_histogram(src, t, tconn, periodic, max_slab_bytes)
    return np.cumsum(hist, axis=1).reshape(src.batch + (T,))


def _cpu_histogram(src: Source, t, tconn, periodic, max_slab_bytes):
    T = int(t.size)
    key_bytes = np.dtype(_ecc_numpy._bin_key_dtype(T)).itemsize
    pieces = plan_pieces(src, src.dtype.itemsize + key_bytes, max_slab_bytes, periodic)
    hist = np.zeros((math.prod(src.batch), T), dtype=np.int64)
    n0 = src.spatial[0]
    for piece in pieces:
        block = read_piece(src, piece)
        own = [piece.own0] + [np.ones(n, dtype=bool) for n in src.spatial[1:]]
        hist[piece.f0:piece.f1] += _ecc_numpy.owned_histogram(
            block, t, src.ndim, tconn, own, periodic=periodic, start=piece.start, n0=n0,
            step_elements=CPU_STEP_ELEMENTS)
    return hist


def pinned_pointer(array) -> bool:
    """True when a host NumPy array lives in page-locked memory that CUDA knows (then it is
    copied to the device directly, without a staging copy)."""
    import cupy

    if not isinstance(array, np.ndarray) or isinstance(array, np.memmap) or array.size == 0:
        return False
    try:
        attrs = cupy.cuda.runtime.pointerGetAttributes(array.ctypes.data)
    except Exception:  # pageable memory on old drivers raises
        return False
    return getattr(attrs, "type", 0) in (1, 3)  # cudaMemoryTypeHost, cudaMemoryTypeManaged


class _DeviceMasks:
    """uint8 device masks per (length, owned range), uploaded once per call."""

    def __init__(self):
        self.cache = {}

    def get(self, own):
        import cupy

        key = (own.size, own.tobytes())
        m = self.cache.get(key)
        if m is None:
            m = self.cache[key] = cupy.asarray(own.astype(np.uint8))
        return m


def registrable(array) -> bool:
    """True for a host array that the GPU pipeline page-locks in place (:data:`HOST_REGISTER`):
    an in-memory C-contiguous NumPy array (not a memmap) of at least REGISTER_MIN_BYTES."""
    return (HOST_REGISTER and type(array) is np.ndarray and array.flags.c_contiguous
            and array.nbytes >= REGISTER_MIN_BYTES)


# cudaHostRegister flags
_REGISTER_PORTABLE, _REGISTER_READ_ONLY = 0x01, 0x08
# Chunk states of a HostRegistration
_PENDING, _BUSY, _REGISTERED, _FAILED, _SKIPPED, _RELEASED = range(6)


class HostRegistration:
    """Page-locks the bytes [base, base + nbytes) of a host array in place, chunk by chunk, on a
    background thread, ahead of a pipeline that reads them in order.

    The range is cut into page-aligned chunks of about ``chunk_bytes``. The thread registers
    them in order (``register(ptr, size)``), never more than ``ahead_bytes`` past the pipeline's
    cursor, and skips those the pipeline has already passed. :meth:`ready` says whether a range
    lies in registered chunks (and cuts it at chunk boundaries: one copy per chunk, each from a
    single registration). :meth:`advance` moves the cursor and hands over an event after which
    the chunks below it are no longer read: the thread unregisters them once that event is
    done. :meth:`close` stops the thread and unregisters whatever is left; call it after the
    last copy has completed. After ``max_failures`` failed registrations the thread stops
    registering (the pipeline then stages every further slab).
    """

    def __init__(self, base, nbytes, chunk_bytes, ahead_bytes, *, register, unregister,
                 device=None, max_failures=2, poll_s=0.002):
        page = mmap.PAGESIZE
        chunk = max(page, int(chunk_bytes) // page * page)
        lo = int(base) // page * page
        hi = -(-(int(base) + int(nbytes)) // page) * page
        self.bounds = list(range(lo, hi, chunk)) + [hi]
        self.state = [_PENDING] * (len(self.bounds) - 1)
        self.cursor = lo
        self.ahead = int(ahead_bytes)
        self.retire = collections.deque()  # (event, cursor): chunks below cursor, after event
        self.cond = threading.Condition()
        self.closed = False
        self.failures = 0
        self.max_failures = max_failures
        self.poll_s = poll_s
        self._register, self._unregister, self.device = register, unregister, device
        self.thread = threading.Thread(target=self._run, name="cutopo-host-register", daemon=True)

    def start(self):
        self.thread.start()
        return self

    # -- the pipeline's side

    def ready(self, ptr, nbytes):
        """[(ptr, size)] cutting [ptr, ptr + nbytes) at chunk boundaries when every chunk it
        touches is registered, else None."""
        end = ptr + nbytes
        j0 = bisect.bisect_right(self.bounds, ptr) - 1
        j1 = bisect.bisect_right(self.bounds, end - 1) - 1
        if j0 < 0 or j1 >= len(self.state):
            return None
        if any(self.state[j] != _REGISTERED for j in range(j0, j1 + 1)):
            return None
        return [(max(ptr, self.bounds[j]), min(end, self.bounds[j + 1]) - max(ptr, self.bounds[j]))
                for j in range(j0, j1 + 1)]

    def advance(self, cursor, event=None):
        """Bytes below ``cursor`` will not be read again once ``event`` (None: now) is done."""
        with self.cond:
            self.cursor = max(self.cursor, int(cursor))
            self.retire.append((event, self.cursor))
            self.cond.notify_all()

    def close(self):
        """Stop the thread and unregister every chunk still registered (the caller makes sure
        no copy from them is in flight)."""
        with self.cond:
            self.closed = True
            self.cond.notify_all()
        if self.thread.is_alive() or self.thread.ident is not None:
            self.thread.join()
        for j, st in enumerate(self.state):
            if st == _REGISTERED:
                self._release(j)

    @property
    def registered_chunks(self):
        return sum(st in (_REGISTERED, _RELEASED) for st in self.state)

    # -- the thread

    def _release(self, j):
        self.state[j] = _RELEASED
        try:
            self._unregister(self.bounds[j])
        except Exception:  # pragma: no cover - nothing to do but go on
            pass

    def _retire_done(self):
        """Unregister the chunks whose last copies are done (non-blocking)."""
        while True:
            with self.cond:
                if not self.retire:
                    return
                event, cursor = self.retire[0]
                if event is not None and not event.done:
                    return
                self.retire.popleft()
                done = [j for j in range(len(self.state))
                        if self.bounds[j + 1] <= cursor and self.state[j] == _REGISTERED]
                for j in done:
                    self.state[j] = _BUSY
            for j in done:
                self._release(j)

    def _run(self):
        if self.device is not None:
            self.device.use()
        j, n = 0, len(self.state)
        while True:
            self._retire_done()
            with self.cond:
                if self.closed:
                    return
                while j < n and self.bounds[j + 1] <= self.cursor:
                    if self.state[j] == _PENDING:
                        self.state[j] = _SKIPPED
                    j += 1
                if (j >= n or self.failures >= self.max_failures
                        or self.bounds[j] >= self.cursor + self.ahead):
                    self.cond.wait(self.poll_s)
                    continue
                self.state[j] = _BUSY
            try:
                self._register(self.bounds[j], self.bounds[j + 1] - self.bounds[j])
                ok = True
            except Exception:
                ok = False
            with self.cond:
                self.state[j] = _REGISTERED if ok else _FAILED
                self.failures += not ok
            j += 1


def _cuda_registration(array, ahead_bytes):
    """A started HostRegistration of ``array``'s bytes on the current device, or None where the
    device cannot register host memory."""
    import cupy

    rt = cupy.cuda.runtime
    device = cupy.cuda.Device()
    try:
        if not rt.deviceGetAttribute(rt.cudaDevAttrHostRegisterSupported, device.id):
            return None
        read_only = (not array.flags.writeable and rt.deviceGetAttribute(
            rt.cudaDevAttrHostRegisterReadOnlySupported, device.id))
    except Exception:  # pragma: no cover - old CuPy or driver
        return None
    flags = _REGISTER_PORTABLE | (_REGISTER_READ_ONLY if read_only else 0)
    return HostRegistration(array.ctypes.data, array.nbytes, REGISTER_CHUNK_BYTES, ahead_bytes,
                            register=lambda ptr, size: rt.hostRegister(ptr, size, flags),
                            unregister=rt.hostUnregister, device=device)


def _gpu_histogram(src: Source, t, tconn, max_slab_bytes, periodic=False):
    """The streamed histogram on the current GPU (see the module docstring), as a host array.

    ``periodic``: the torus. Each slab is read with its halo planes taken modulo n0 and padded
    on the device by one wrapped pixel on both sides of every other axis (what the slab
    bound counts twice); the box kernel then counts the slab's own planes without the pads.
    Each slab is a window of the image repeated periodically, whose owner rule (value, then
    position) is the same in every period, so every cell of the torus is counted once (see
    cutopo._ecc_cupy._wrapped). The halo planes are not adjacent to the slab in the source,
    so such sources are not page-locked in place (staged, or copied directly from pinned
    memory)."""
    from . import _ecc_cupy

    itemsize = src.dtype.itemsize
    pieces = plan_pieces(src, itemsize * (2 if periodic else 1), max_slab_bytes, periodic,
                         ramp=RAMP)
    cap = max(math.prod(piece_shape(src, p)) for p in pieces)
    view_dtype = _ecc_cupy._INPUT_VIEW.get(src.dtype, src.dtype)
    # raw bytes of the source may go to the GPU only in native byte order; else staged (read_piece
    # converts into the pinned buffers)
    contiguous = isinstance(src.data, np.ndarray) and src.data.flags.c_contiguous and src.native
    direct = contiguous and pinned_pointer(src.data)
    # Page-locking in place starts first, so that it gets ahead while plans are built.
    reg = None
    if not direct and not periodic and len(pieces) > 2 and src.native and registrable(src.data):
        reg = _cuda_registration(src.data, REGISTER_AHEAD_SLABS * cap * itemsize)
        if reg is not None:
            reg.advance(src.data.ctypes.data + _piece_offset(src, pieces[1]))  # 1st is staged
            reg.start()
    try:
        return _gpu_pipeline(src, t, tconn, pieces, cap, view_dtype, contiguous, direct, reg,
                             periodic)
    finally:
        if reg is not None:
            reg.close()


def _piece_offset(src: Source, piece: Piece):
    """Byte offset of a (single-range) piece's first element in a C-contiguous source."""
    plane = math.prod(src.spatial[1:])
    return (piece.f0 * src.spatial[0] + piece.ranges[0][0]) * plane * src.dtype.itemsize


def _piece_runs(src: Source, piece: Piece):
    """(byte offset, bytes) of each contiguous run of a piece in a C-contiguous source: one,
    or one per plane range of a periodic slab (whose pieces hold one image)."""
    if len(piece.ranges) == 1:
        return [(_piece_offset(src, piece), math.prod(piece_shape(src, piece)) * src.dtype.itemsize)]
    plane_bytes = math.prod(src.spatial[1:]) * src.dtype.itemsize
    return [((piece.f0 * src.spatial[0] + a) * plane_bytes, (b - a) * plane_bytes)
            for a, b in piece.ranges]


def _wrap_pad(block, ndim):
    """A device block (images, planes, *rest) padded by one wrapped pixel on both sides of
    every spatial axis but the first (the torus' other axes)."""
    import cupy

    return cupy.pad(block, [(0, 0), (0, 0)] + [(1, 1)] * (ndim - 1), mode="wrap")


def _inner(n):
    """The mask of the n original pixels of an axis padded by one pixel on both sides."""
    return np.r_[False, np.ones(n, dtype=bool), False]


# What the last GPU pipeline did (for benchmarks and tests): slabs, how many were copied
# directly (pinned or registered source) and how many staged, registered chunks.
last_pipeline: dict = {}


def _gpu_pipeline(src, t, tconn, pieces, cap, view_dtype, contiguous, direct, reg, periodic):
    import cupy
    import cupyx

    from . import _ecc_cupy

    ndim, itemsize = src.ndim, src.dtype.itemsize
    T = int(t.size)
    nimg = math.prod(src.batch)
    masks = _DeviceMasks()
    copy_stream = cupy.cuda.Stream(non_blocking=True)
    comp_stream = cupy.cuda.Stream(non_blocking=True)
    # Plans (and kernel compiles) before the pipeline starts: a compile mid-stream would stall it.
    # Periodic slabs are counted padded by one pixel on both sides of the other axes.
    pad = (2,) * (ndim - 1) if periodic else (0,) * (ndim - 1)
    plans = {}
    for p in pieces:
        shape = piece_shape(src, p)
        counted = shape[:2] + tuple(n + d for n, d in zip(shape[2:], pad))
        if shape not in plans:
            plans[shape] = _ecc_cupy.histogram_plan(_Shape(counted, src.dtype), t, ndim, tconn,
                                                    masked=True)
    with comp_stream:
        hist = cupy.zeros((nimg, T), dtype=np.int64)
        ones = [masks.get(_inner(n) if periodic else np.ones(n, dtype=bool))
                for n in src.spatial[1:]]
        unit = masks.get(np.ones(1, dtype=bool))
        bufs = [cupy.empty(cap, dtype=view_dtype) for _ in range(2)]
        for p in pieces:  # every owned-plane pattern uploaded before the pipeline starts
            masks.get(p.own0)
    # The plans' threshold tables were copied on the default stream, which the non-blocking
    # streams do not wait for.
    cupy.cuda.Device().synchronize()
    host = None if direct else [cupyx.empty_pinned(cap, dtype=src.dtype) for _ in range(2)]
    staged = [None, None]    # copy events of the last copy out of host[h]
    copied = [None, None]    # copy events of the last copy into bufs[i]
    computed = [None, None]  # kernel events of the last kernel on bufs[i]
    h = 0
    stats = {"slabs": len(pieces), "direct": 0, "staged": 0}
    base = src.data.ctypes.data if contiguous else 0
    pool = concurrent.futures.ThreadPoolExecutor(READ_THREADS) if READ_THREADS > 1 else None
    try:
        for k, piece in enumerate(pieces):
            i = k % 2
            shape = piece_shape(src, piece)
            n = math.prod(shape)
            nbytes = n * itemsize
            if copied[i] is not None:
                # The host stays at most two slabs ahead of the copies (no cost: the copy into
                # bufs[i] waits for the kernel of step k - 2 anyway), so registered chunks are
                # released as the copies progress, and registration gets time to get ahead.
                copied[i].synchronize()
            runs, hh = None, None
            if direct:
                runs = [(base + offset, size) for offset, size in _piece_runs(src, piece)]
            elif reg is not None:
                runs = reg.ready(base + _piece_offset(src, piece), nbytes)
            if runs is None:  # through a pinned staging buffer
                if staged[h] is not None:
                    staged[h].synchronize()  # the copy out of host[h] two staged slabs ago
                read_piece(src, piece, out=host[h][:n], pool=pool)
                runs = [(host[h].ctypes.data, nbytes)]
                hh, h = h, h ^ 1
                stats["staged"] += 1
            else:
                stats["direct"] += 1
            if computed[i] is not None:
                copy_stream.wait_event(computed[i])  # the kernel of step k - 2 is done with bufs[i]
            offset = 0
            for ptr, size in runs:
                cupy.cuda.runtime.memcpyAsync(bufs[i].data.ptr + offset, ptr, size,
                                              cupy.cuda.runtime.memcpyHostToDevice,
                                              copy_stream.ptr)
                offset += size
            copied[i] = event = copy_stream.record()
            if hh is not None:
                staged[hh] = event
            if reg is not None:  # the bytes before the next piece are not read again
                nxt = (base + _piece_offset(src, pieces[k + 1]) if k + 1 < len(pieces)
                       else base + src.data.nbytes)
                reg.advance(nxt, event)
            comp_stream.wait_event(event)
            with comp_stream:
                own0 = masks.get(piece.own0)
                axis_masks = ([unit, own0] + ones) if ndim == 2 else ([own0] + ones)
                block = bufs[i][:n].reshape((shape[0],) + shape[1:])
                if periodic:  # a new array: bufs[i] is free once the pad has read it
                    block = _wrap_pad(block, ndim)
                plans[shape].add_masked(block, hist[piece.f0:piece.f1], *axis_masks)
            computed[i] = comp_stream.record()
        with comp_stream:
            out = hist.get(stream=comp_stream)
        comp_stream.synchronize()
        stats["registered_chunks"] = reg.registered_chunks if reg is not None else 0
        last_pipeline.clear()
        last_pipeline.update(stats)
    finally:
        if pool is not None:
            pool.shutdown(wait=True)
        copy_stream.synchronize()
        comp_stream.synchronize()
    return out


class _Shape(NamedTuple):
    """What histogram_plan reads of an array: shape and dtype."""
    shape: tuple
    dtype: np.dtype


def _device_slabs(src: Source, pieces):
    """(piece, device block) of every piece in turn, the next one on its way while the caller
    computes on this one: a host thread reads it into one of two pinned buffers and copies it
    on a copy stream into one of two device buffers (after the caller's work on the block two
    steps back, which the current stream records when the caller asks for the next block), so
    reading, copying and the caller's kernels overlap. Blocks are views of the device buffers
    in the source's dtype, valid until the caller asks for the block after next."""
    import cupy
    import cupyx

    if not pieces:
        return
    device = cupy.cuda.Device()
    compute = cupy.cuda.get_current_stream()
    copy_stream = cupy.cuda.Stream(non_blocking=True)
    shapes = [piece_shape(src, p) for p in pieces]
    cap = max(math.prod(s) for s in shapes)
    host = [cupyx.empty_pinned(cap, dtype=src.dtype) for _ in range(2)]
    bufs = [cupy.empty(cap, dtype=src.dtype) for _ in range(2)]
    used = [None, None]    # the caller's work on bufs[i] done (an event on the compute stream)
    nbytes = [math.prod(s) * src.dtype.itemsize for s in shapes]

    def load(k, last_copy):
        """Read piece k into host[k % 2] once the copy out of it (piece k - 2) is done, then
        copy it to bufs[k % 2] once the caller is done with that buffer."""
        i = k % 2
        with device:
            if last_copy is not None:
                last_copy.synchronize()
            read_piece(src, pieces[k], out=host[i][:math.prod(shapes[k])])
            if used[i] is not None:
                copy_stream.wait_event(used[i])
            cupy.cuda.runtime.memcpyAsync(bufs[i].data.ptr, host[i].ctypes.data, nbytes[k],
                                          cupy.cuda.runtime.memcpyHostToDevice, copy_stream.ptr)
            return copy_stream.record()

    copies = [None, None]
    pool = concurrent.futures.ThreadPoolExecutor(1)
    try:
        pending = pool.submit(load, 0, None)
        for k, piece in enumerate(pieces):
            i = k % 2
            copies[i] = pending.result()
            if k + 1 < len(pieces):  # needs used[(k + 1) % 2], recorded after step k - 1
                pending = pool.submit(load, k + 1, copies[i ^ 1])
            compute.wait_event(copies[i])
            yield piece, bufs[i][:math.prod(shapes[k])].reshape(shapes[k])
            used[i] = compute.record()
    finally:
        pool.shutdown(wait=True)
        copy_stream.synchronize()


# ---------------------------------------------------------------------------------------------
# ECT

# Memory per pixel of a slab that the ECT's contribution passes take (keys, contributions and,
# per direction, float64 heights; see cutopo._ect and cutopo._band_cupy).
ECT_CPU_BYTES_PER_PIXEL = 48
ECT_GPU_BYTES_PER_PIXEL = 64
# ... and per element of one pass (pixels x images x directions, or critical pixels x
# directions): a slab's passes work on at most max_slab_bytes // this many elements, but on at
# least one direction of one image of the slab.
ECT_CPU_PASS_BYTES = 96
ECT_GPU_PASS_BYTES = 64


def ect(mask, directions, thresholds, connectivity, boundary, backend, max_slab_bytes):
    """int64 (*batch, D, T) exact ECT of a streamed host mask (arguments as for cutopo.ect)."""
    import types

    from . import _ect
    from ._checks import check_boundary, check_connectivity, same_array_type

    same_array_type(mask, [("directions", directions), ("thresholds", thresholds)],
                    anchor_name="mask", op="ect")
    directions, dirs64 = _ect._check_directions(directions)
    ndim = dirs64.shape[1]
    src = check_source(mask, ndim, name="mask", mask=True)
    tconn = check_connectivity(connectivity, ndim)
    periodic = check_boundary(boundary, types.SimpleNamespace(shape=src.shape, ndim=len(src.shape)),
                              ndim)
    coords = _ect._axis_coordinates(src.spatial)
    _ect.check_heights_finite(coords, dirs64)
    t, _ = _ect._check_thresholds(thresholds, coords, dirs64)
    D, T = dirs64.shape[0], t.size
    nimg = math.prod(src.batch)
    out = np.zeros((nimg, D, T), dtype=np.int64)
    per_pixel = ECT_GPU_BYTES_PER_PIXEL if backend == "cuda" else ECT_CPU_BYTES_PER_PIXEL
    max_slab_bytes = slab_bytes(max_slab_bytes, backend, src, per_pixel)
    cpu_pass = max(1, max_slab_bytes // ECT_CPU_PASS_BYTES)
    gpu_pass = max(1, max_slab_bytes // ECT_GPU_PASS_BYTES)
    n0 = src.spatial[0]
    pieces = plan_pieces(src, per_pixel, max_slab_bytes, periodic)
    blocks = (_device_slabs(src, pieces) if backend == "cuda" else
              ((p, np.asarray(read_piece(src, p))) for p in pieces))
    try:  # close the reader (its thread, pinned buffers) also when a slab fails
        for piece, block in blocks:
            block = block if block.dtype == np.bool_ else block != 0
            planes = np.concatenate([np.arange(a, b) for a, b in piece.ranges])
            block_coords = [coords[0][planes]] + list(coords[1:])
            own = [piece.own0] + [np.ones(n, dtype=bool) for n in src.spatial[1:]]
            if backend == "cuda":
                from . import _band_cupy

                if periodic:
                    # The slab as a window of the periodically repeated mask, at the positions of
                    # the pixels it copies (see _gpu_histogram): the box rule counts the torus.
                    block = _wrap_pad(block, ndim)
                    wrapped = [np.r_[n - 1, np.arange(n), 0] for n in src.spatial[1:]]
                    block_coords = block_coords[:1] + [c[w] for c, w in zip(coords[1:], wrapped)]
                    own = own[:1] + [_inner(n) for n in src.spatial[1:]]
                part, _ = _band_cupy.ect_forward(block, dirs64, block_coords, t, tconn, soft=False,
                                                 own=own, general=periodic,
                                                 pass_elements=gpu_pass)
                out[piece.f0:piece.f1] += part.get()
            else:
                out[piece.f0:piece.f1] += _ect.curves(
                    block, dirs64, block_coords, t, tconn, own, periodic,
                    (piece.start, n0) if periodic else None, pass_elements=cpu_pass)
    finally:
        blocks.close()
    return out.reshape(src.batch + (D, T))
