"""Exact ECC and ECT of Dask arrays (NumPy or CuPy chunks), chunk by chunk, exactly.

``cutopo.dask.ecc(darr, thresholds)`` and ``cutopo.dask.ect(dmask, directions, thresholds)``
return lazy Dask arrays equal to :func:`cutopo.ecc` / :func:`cutopo.ect` of the whole array.
They run under any Dask scheduler: the threaded default, ``dask.distributed`` and
``dask_cuda.LocalCUDACluster`` (one worker per GPU, CuPy chunks on each worker's device).
With CuPy chunks on a single GPU, prefer ``.compute(scheduler="sync")``: the tasks only queue
kernels, so the threaded scheduler adds its overhead (0.9-1.8 ms per 1024^3 call on the H200's
host, see benchmarks/RESULTS.md) and no parallelism. Install with
``pip install 'cutopo[dask]'``; ``import cutopo`` does not import Dask.

How the chunks split the work without counting a cell twice. Each pixel p contributes c(p),
the signed count of the cells it owns, and c(p) depends only on p's 3^ndim neighbourhood. Along
every chunked spatial axis, call a coordinate a *seam* coordinate when it is next to an
internal chunk boundary s (it is s - 1 or s). Then:

* every chunk histograms, from the chunk alone (no copy, no halo), its pixels none of whose
  coordinates is a seam coordinate (the *interior*): their whole neighbourhood is in the chunk
  (or beyond the volume's border);
* for each axis a and internal boundary s along a, the *face* (a, s) is the thin slab of planes
  [s - 2, s + 2) along a (the full extent of the other axes, a few planes); it histograms the
  pixels whose first seam axis is a and whose seam coordinate along a belongs to s.

So every pixel is counted exactly once, with its whole neighbourhood at hand, and only the
seams (four planes per internal boundary) are copied. Periodic boundaries pad the array by one
wrapped pixel per side and make the pads seam coordinates that nothing counts (see
``_wrapped``; for the ECT the pads carry the positions of the pixels they copy). The histograms (int64, shape
(*batch, T)) are added by a tree sum, then cumulated.

The task graph is built directly (no map_blocks/rechunk/reduction layers), one task per chunk:

* when at most one spatial axis has several chunks (a volume cut in slabs, the usual layout),
  the face (a, s) is counted by the task of the chunk that starts at s, which also receives the
  planes [s - 2, s) of the chunk(s) before it (a thin getitem task, so that a cluster moves two
  planes, not a chunk): no face task, no concatenation of a face from many chunks;
* otherwise every face is a task of its own, which reads the thin pieces of the chunks it
  crosses from one "edges" task per chunk (a tuple of views: the planes that faces need of it);
* the graph is minimal as built, so the result (an Array subclass) skips Dask's array
  optimisation when the input needs none either (chunks in memory, or one element-wise map
  over them: :func:`_optimize`), ~0.3-0.45 ms per compute on the H200's host; and its own
  ``compute()`` hands the graph straight to Dask's synchronous or threaded scheduler, without
  Dask's expression layer (:meth:`_Counts.compute`);
* the per-task histograms stay where they were computed (device arrays for CuPy chunks, no
  host synchronisation in any task) and are added by a tree sum of fan-in :data:`SPLIT_EVERY`,
  whose last task also cumulates: one task per batch chunk of the result;
* with CuPy chunks, an ECC chunk or face task queues its kernels on the next of
  :data:`SIDE_STREAMS` side streams of its device, after the work queued on the task's own
  stream (an event), so that consecutive chunks' kernels overlap; the sum makes its stream
  wait for the side streams' events before it reads the histograms. Memory the side kernels
  use comes from the pool of the stream that frees it: the histograms are allocated on the
  task's stream, temporaries on the side stream, and the chunk's inputs are kept until the
  task's stream has waited for the kernels that read them (one task's inputs per side stream
  at most). The tasks of one compute are assumed to share a stream, as CuPy's default stream
  is shared by Dask's threads.

On the GPU a chunk's interior is counted either by the masked kernel over the chunk
(``ecc_histogram_masked``, a per-pixel mask test) or, by default for large chunks (see
:data:`INTERIOR`), by the plain kernel over the whole chunk minus the chunk's seam planes as the
chunk alone sees them (two-plane masked launches): both give the same integers. Device masks
and kernel plans are kept per shape and device, uploaded once per process. NumPy chunks use
:func:`cutopo._ecc_numpy.owned_histogram`.
"""
from __future__ import annotations

import bisect
import contextlib
import functools
import itertools
import math
import operator
import threading

import numpy as np

try:
    import dask.array as da
    from dask import local, threaded
    from dask.base import get_scheduler, tokenize
    from dask.blockwise import Blockwise
    from dask.highlevelgraph import HighLevelGraph, MaterializedLayer
    from dask.sizeof import sizeof
except ImportError as exc:  # pragma: no cover - exercised in a process without dask
    raise ImportError("cutopo.dask needs Dask: install it with pip install 'cutopo[dask]' (or "
                      "pip install 'dask[array]'; add 'distributed' for clusters)") from exc

from . import _ecc_numpy
from ._array import is_cupy_array, native_dtype, to_numpy
from ._checks import IMAGE_DTYPES, check_connectivity, check_thresholds, finite_range, thresholds_over_range
from ._cuda import tables

__all__ = ["ecc", "ect"]

# Fan-in of the tree sum of the per-task histograms (one level for up to this many tasks).
SPLIT_EVERY = 32
# How a chunk task counts its interior, by chunk type. "masked": one masked launch over the
# chunk, seam coordinates masked out. "plain": the unmasked histogram of the whole chunk, minus
# its seam planes as the chunk alone sees them (thin masked launches); exact as well, and the
# bulk of the chunk runs without the per-pixel mask test. ECT always masks.
INTERIOR = {"numpy": "masked", "cupy": "plain"}
# "plain" is used only when every axis with seams in the chunk is at least this long (and 2).
PLAIN_MIN_LENGTH = 16
# Side streams per device on which the CuPy ECC chunk and face tasks queue their kernels, in
# turn: one chunk's seam launches and its histogram's tail then overlap the next chunk's
# histogram (on the H200, 1024^3 in four chunks, 0.5-0.8 ms of a 7-10 ms compute;
# benchmarks/RESULTS.md). 0 or 1: every task on the stream current in its thread.
SIDE_STREAMS = 4


# ---------------------------------------------------------------------------------------------
# Validation and the seam bookkeeping


def _check_dask(x, name):
    """``x`` checked, with chunks in native byte order (a big-endian FITS or Zarr source is
    converted chunk by chunk, lazily)."""
    if not isinstance(x, da.Array):
        raise TypeError(f"{name} must be a dask.array.Array, got {type(x).__name__} (use cutopo.ecc "
                        "for NumPy and CuPy arrays)")
    if any(math.isnan(c) for chunks in x.chunks for c in chunks):
        raise ValueError(f"{name} has unknown (NaN) chunk sizes, shape {x.shape} (as after boolean "
                         f"indexing): call {name}.compute_chunk_sizes() first")
    if not np.dtype(x.dtype).isnative:
        x = x.astype(native_dtype(x.dtype))
    return x


def _check_ndim(x, ndim, name):
    if ndim is None:
        if x.ndim not in (2, 3):
            raise ValueError(f"{name}: with ndim=None the array must be 2-D or 3-D, got shape "
                             f"{x.shape}; pass ndim=2 or ndim=3 for batches")
        return x.ndim
    if isinstance(ndim, (bool, np.bool_)) or not isinstance(ndim, (int, np.integer)):
        raise TypeError(f"ndim must be None, 2 or 3, got {ndim!r}")
    if ndim not in (2, 3):
        raise ValueError(f"ndim must be None, 2 or 3, got {ndim}")
    if x.ndim < ndim:
        raise ValueError(f"{name}: ndim={ndim} spatial axes asked for, but it has shape {x.shape}")
    return int(ndim)


def _check_boundary(boundary, spatial, name):
    """True for "periodic" (every spatial axis must then be at least 3 long), False for "box"."""
    if not isinstance(boundary, str):
        raise TypeError(f"boundary must be 'box' or 'periodic', got {boundary!r}")
    if boundary not in ("box", "periodic"):
        raise ValueError(f"boundary must be 'box' or 'periodic', got {boundary!r}")
    if boundary == "periodic" and min(spatial) < 3:
        raise ValueError(f"{name}: boundary='periodic' needs every spatial axis to have length "
                         f">= 3, got spatial shape {tuple(spatial)}")
    return boundary == "periodic"


class _Axis:
    """The seams of one spatial axis: its chunk starts, seam coordinates and their owners.

    ``halo``: the axis's first and last coordinates are a wrapped copy (the periodic case,
    see :func:`ecc`): they are neighbours, never counted. They count as seam coordinates that
    no face owns, so no interior and no face counts them, and ``counted`` leaves them out of
    the faces of the other axes."""

    def __init__(self, chunks, halo=False):
        self.chunks = tuple(int(c) for c in chunks)
        self.starts = (0, *itertools.accumulate(self.chunks))
        self.n = self.starts[-1]
        self.boundaries = list(self.starts[1:-1])
        self.seam = np.zeros(self.n, dtype=bool)
        # owner[i]: the boundary that counts seam coordinate i (the first one it is next to).
        self.owner = np.full(self.n, -1, dtype=np.int64)
        for s in self.boundaries:
            for i in (s - 1, s):
                self.seam[i] = True
                if self.owner[i] < 0:
                    self.owner[i] = s
        self.counted = np.ones(self.n, dtype=bool)
        if halo:
            self.counted[[0, -1]] = False
            self.seam[[0, -1]] = True
            self.owner[[0, -1]] = -1

    def span(self, j):
        return self.starts[j], self.starts[j + 1]

    def blocks_of(self, r0, r1):
        """Indices of the chunks that planes [r0, r1) cross."""
        first = bisect.bisect_right(self.starts, r0) - 1
        last = bisect.bisect_right(self.starts, r1 - 1) - 1
        return range(first, last + 1)


@functools.lru_cache(maxsize=16)
def _layout(chunks, halo):
    """What the task graph of the spatial chunking ``chunks`` needs, computed once per chunking
    (building it took ~0.2 ms of a graph build on the H200's host, four chunks): the axes, the
    faces ``{(a, s): (r0, r1, masks, origin)}`` that own pixels, and per chunk index J how its
    task counts its interior (:class:`_Interior`, one per distinct seam pattern: a regular
    chunking has at most 3^ndim) and its origin. The arrays are shared by every graph of this
    chunking, so they are read-only."""
    axes = [_Axis(c, halo) for c in chunks]
    ndim = len(axes)
    faces = {}
    for a in range(ndim):
        for s in axes[a].boundaries:
            r0, r1 = max(s - 2, 0), min(s + 2, axes[a].n)
            masks = _face_masks(axes, a, s, r0, r1)
            if all(m.any() for m in masks):
                faces[(a, s)] = (r0, r1, [_frozen(m) for m in masks],
                                 tuple(r0 if b == a else 0 for b in range(ndim)))
    spans = [[ax.span(j) for j in range(len(ax.chunks))] for ax in axes]
    seams = [[_frozen(ax.seam[c0:c1]) if ax.seam[c0:c1].any() else None for c0, c1 in spans[b]]
             for b, ax in enumerate(axes)]
    # chunks j, j' of an axis with equal lengths and seams are alike for their interiors
    kinds = [[(c1 - c0, None if m is None else m.tobytes()) for (c0, c1), m in zip(spans[b], seams[b])]
             for b in range(ndim)]
    interiors, chunk_interiors = {}, {}
    for J in itertools.product(*(range(len(ax.chunks)) for ax in axes)):
        kind = tuple(kinds[b][j] for b, j in enumerate(J))
        if kind not in interiors:
            interiors[kind] = _Interior(tuple(seams[b][j] for b, j in enumerate(J)),
                                        [n for n, _ in kind])
        chunk_interiors[J] = (interiors[kind], tuple(spans[b][j][0] for b, j in enumerate(J)))
    for ax in axes:
        for m in (ax.seam, ax.owner, ax.counted):
            _frozen(m)
    return axes, faces, chunk_interiors


def _frozen(m):
    """``m``, made read-only (it is shared by every graph of a chunking)."""
    m.flags.writeable = False
    return m


def _face_masks(axes, a, s, r0, r1):
    """Owned masks of face (a, s), planes [r0, r1) along a: its own seam coordinates along a,
    the non-seam coordinates of the axes before a, every counted coordinate along the axes
    after a."""
    masks = []
    for b, ax in enumerate(axes):
        if b < a:
            masks.append(~ax.seam)
        elif b == a:
            masks.append(ax.owner[r0:r1] == s)
        else:
            masks.append(ax.counted.copy())
    return masks


def _meta(x, ndim_out):
    xp = _cupy() if is_cupy_array(getattr(x, "_meta", None)) else np
    return xp.empty((0,) * ndim_out, dtype=np.int64)


def _cupy():
    import cupy

    return cupy


# ---------------------------------------------------------------------------------------------
# The task graph


class _Interior:
    """How a chunk task counts the chunk's interior (its pixels without a seam coordinate),
    worked out once per chunking (a task's host time before its first launch delays the GPU):

    * ``seam``: per spatial axis, the chunk's seam coordinates as a local bool array, or None
      where it has none;
    * ``own``: per axis, the coordinates to count (None when the chunk has no seam at all);
      ``empty``: some axis has none; ``shortest``: the shortest axis with seams (the plain way
      needs PLAIN_MIN_LENGTH);
    * ``planes``: the plain way's corrections, the chunk's seam pixels as the chunk alone sees
      them (truncated at its faces), split by their first seam axis a: coordinates before a not
      seam, the chunk's first or last plane along a (distinct planes when the chunk is at least
      2 long), anything after a. A two-plane slab at that face holds every neighbour they have
      in the chunk, with the same truncation, so it gives the same contributions. Each entry
      (a, take, masks): planes [take, take + 2) along a, counted where ``masks``."""

    __slots__ = ("seam", "own", "empty", "shortest", "planes")

    def __init__(self, seam, lengths):
        self.seam = seam
        self.own, self.empty, self.shortest, self.planes = None, False, math.inf, ()
        if all(s is None for s in seam):
            return
        self.own = own = tuple(_frozen(np.ones(n, dtype=bool) if s is None else ~s)
                               for s, n in zip(seam, lengths))
        self.empty = not all(m.any() for m in own)
        self.shortest = min(s.size for s in seam if s is not None)
        if self.empty or self.shortest < 2:
            return
        planes = []
        for a, s in enumerate(seam):
            if s is None:
                continue
            for take, upper in ((0, False), (s.size - 2, True)):
                if s[-1 if upper else 0]:
                    masks = [own[b] if b < a else np.ones(lengths[b], dtype=bool)
                             for b in range(len(seam))]
                    masks[a] = np.array([not upper, upper])
                    planes.append((a, take, tuple(_frozen(m) for m in masks)))
        self.planes = tuple(planes)

    def __getstate__(self):
        return (self.seam, self.own, self.empty, self.shortest, self.planes)

    def __setstate__(self, state):
        self.seam, self.own, self.empty, self.shortest, self.planes = state


class _ChunkSpec:
    """What a chunk task counts: ``interior`` (:class:`_Interior`), ``origin`` (the chunk's
    first coordinate per spatial axis) and ``face`` (None, or the merged face: axis a, the
    chunk's own planes [lo, hi) of it, the face's masks and origin)."""

    __slots__ = ("interior", "origin", "face")

    def __init__(self, interior, origin, face=None):
        self.interior, self.origin, self.face = interior, origin, face

    def __getstate__(self):
        return (self.interior, self.origin, self.face)

    def __setstate__(self, state):
        self.interior, self.origin, self.face = state


class _FaceSpec:
    """A separate face task: the masks and origin of its slab."""

    __slots__ = ("masks", "origin")

    def __init__(self, masks, origin):
        self.masks, self.origin = masks, origin

    def __getstate__(self):
        return (self.masks, self.origin)

    def __setstate__(self, state):
        self.masks, self.origin = state


def _graph(x, ndim, counter, prefix, halo=False):
    """The lazy (*batch, *counter.tail) int64 result of ``counter`` over the chunks of ``x``
    (see the module docstring); ``halo``: the outermost coordinates of every spatial axis are
    a wrapped copy, not counted (:func:`ecc`'s periodic case)."""
    lead = x.ndim - ndim
    axes, faces, chunk_interiors = _layout(tuple(x.chunks[lead:]), halo)
    nblocks = [len(ax.chunks) for ax in axes]
    chunked = [a for a in range(ndim) if nblocks[a] > 1]
    merge = len(chunked) <= 1
    name = f"{prefix}-{tokenize(x.name, counter.token(), halo)}"
    part_name, piece_name, edge_name, face_name, sum_name = (
        name + "-part", name + "-piece", name + "-edges", name + "-face", name + "-sum")

    dsk = {}
    for B in itertools.product(*(range(len(c)) for c in x.chunks[:lead])):
        pieces = itertools.count()

        def planes_of(J, a, r0, r1):
            """Key of planes [r0, r1) along a of chunk J (the chunk itself when it is all of
            it, else a getitem task)."""
            c0, c1 = axes[a].span(J[a])
            lo, hi = max(r0, c0), min(r1, c1)
            if (lo, hi) == (c0, c1):
                return (x.name, *B, *J)
            key = (piece_name, *B, next(pieces))
            index = (slice(None),) * (lead + a) + (slice(lo - c0, hi - c0),)
            dsk[key] = (operator.getitem, (x.name, *B, *J), index)
            return key

        parts = []
        for J in itertools.product(*(range(n) for n in nblocks)):
            interior, origin = chunk_interiors[J]
            face, before, after = None, [], []
            if merge and chunked:
                a = chunked[0]
                c0, c1 = axes[a].span(J[a])
                if (a, c0) in faces:
                    r0, r1, masks, face_origin = faces[(a, c0)]
                    for j in axes[a].blocks_of(r0, r1):
                        if j != J[a]:
                            K = J[:a] + (j,) + J[a + 1:]
                            (before if j < J[a] else after).append(planes_of(K, a, r0, r1))
                    face = (a, max(r0, c0) - c0, min(r1, c1) - c0, masks, face_origin)
            key = (part_name, *B, *J)
            dsk[key] = (_chunk_task, (x.name, *B, *J), counter, _ChunkSpec(interior, origin, face),
                        before, after)
            parts.append(key)
        if not merge:
            # A face crosses many chunks; each chunk hands all the thin pieces that faces need
            # of it in one "edges" task (a tuple of views), which the face tasks index inline.
            needs = {}

            def edge_of(J, a, r0, r1):
                c0, c1 = axes[a].span(J[a])
                lo, hi = max(r0, c0), min(r1, c1)
                if (lo, hi) == (c0, c1):
                    return (x.name, *B, *J)
                wanted = needs.setdefault(J, [])
                wanted.append((slice(None),) * (lead + a) + (slice(lo - c0, hi - c0),))
                return (operator.getitem, (edge_name, *B, *J), len(wanted) - 1)

            for (a, s), (r0, r1, masks, face_origin) in faces.items():

                def nested(b, J):
                    if b == ndim:
                        return edge_of(J, a, r0, r1)
                    js = axes[a].blocks_of(r0, r1) if b == a else range(nblocks[b])
                    return [nested(b + 1, J + (j,)) for j in js]

                key = (face_name, *B, a, s)
                dsk[key] = (_face_task, nested(0, ()), counter, _FaceSpec(masks, face_origin))
                parts.append(key)
            for J, wanted in needs.items():
                dsk[(edge_name, *B, *J)] = (_edges, (x.name, *B, *J), wanted)
        level = 0
        while len(parts) > SPLIT_EVERY:
            grouped = []
            for g in range(0, len(parts), SPLIT_EVERY):
                key = (sum_name, *B, level, g // SPLIT_EVERY)
                dsk[key] = (_sum_parts, parts[g:g + SPLIT_EVERY])
                grouped.append(key)
            parts, level = grouped, level + 1
        shape = tuple(x.chunks[b][B[b]] for b in range(lead)) + counter.tail
        dsk[(name, *B) + (0,) * len(counter.tail)] = (_finish, parts, counter, shape)

    graph = HighLevelGraph.from_collections(name, _CountLayer(dsk), dependencies=[x])
    chunks = tuple(x.chunks[:lead]) + tuple((n,) for n in counter.tail)
    return _Counts(graph, name, chunks, meta=_meta(x, lead + len(counter.tail)))


class _CountLayer(MaterializedLayer):
    """The tasks of :func:`_graph`: minimal as built (nothing to cull, no chain to fuse)."""


def _in_memory(layer):
    """Whether a layer only holds arrays (NumPy or CuPy): a from_array of a NumPy array, the
    array that from_array of a CuPy array slices, a persisted array."""
    return type(layer) is MaterializedLayer and all(
        isinstance(v, np.ndarray) or is_cupy_array(v) for v in layer.mapping.values())


def _optimize(dsk, keys, **kwargs):
    """Dask's array optimisation, skipped when it has nothing to do.

    Our counting tasks are minimal as built; what the optimisation would fuse or cull is the
    input's. It is skipped when every layer our tasks read from, directly or not, holds arrays
    in memory or is one element-wise map (Blockwise: from_array's slicing of a CuPy array,
    ``x + 1``) over such layers only; what comes after our tasks is Dask's finalisation. It
    costs ~0.3-0.45 ms per compute of a 1024^3 volume in four chunks on the H200's host
    (benchmarks/RESULTS.md), a twentieth of the GPU work. Any other input (a Zarr or file read,
    slicing, chains of operations) goes through it as usual."""
    ours = [n for n, layer in dsk.layers.items() if isinstance(layer, _CountLayer)]
    upstream, todo = set(), [d for n in ours for d in dsk.dependencies[n]]
    while todo:
        n = todo.pop()
        if n not in upstream:
            upstream.add(n)
            todo.extend(dsk.dependencies[n])

    def needless(n):
        layer = dsk.layers[n]
        if _in_memory(layer):
            return True
        return isinstance(layer, Blockwise) and all(_in_memory(dsk.layers[d])
                                                    for d in dsk.dependencies[n])

    if ours and all(needless(n) for n in upstream):
        return dsk
    return da.Array.__dask_optimize__(dsk, keys, **kwargs)


# Dask's schedulers that run the graph in this process: get_scheduler's results for "sync"
# and "threads" (_Counts.compute hands its graph straight to them)
_LOCAL_SCHEDULERS = (local.get_sync, threaded.get)


class _Counts(da.Array):
    """The lazy result of :func:`ecc` and :func:`ect`: a ``dask.array.Array`` in every respect
    but its graph optimisation (:func:`_optimize`) and the way its own ``compute()`` reaches
    Dask's synchronous and threaded schedulers (:meth:`compute`). What is derived from it is a
    plain Array."""

    __dask_optimize__ = staticmethod(_optimize)

    def compute(self, **kwargs):
        """``dask.array.Array.compute``; under Dask's synchronous or threaded scheduler, the
        graph (optimised by :func:`_optimize` unless ``optimize_graph=False``) goes to that
        scheduler straight, as ``dask.compute`` did before Dask's expression layer. That layer
        (the collection wrapped into expressions, tokenised and optimised, a finalising task
        added) reorders nothing in a graph that is minimal as built, and costs ~0.4 ms a compute
        on the build machine, 0.45-1 ms on an H100 machine's host, where a 1024^3 uint8 ECC in
        four chunks went from 1.31-1.49x to 1.23-1.25x of the single call's time
        (benchmarks/RESULTS.md, fifty-first session). Any other scheduler (a dask.distributed client,
        processes) goes through ``dask.compute`` as usual; so does ``dask.compute(result)``."""
        if "get" not in kwargs and "traverse" not in kwargs:  # (errors of dask.compute's)
            schedule = get_scheduler(scheduler=kwargs.get("scheduler"), collections=[self])
            if schedule in _LOCAL_SCHEDULERS:
                rest = {k: v for k, v in kwargs.items() if k not in ("scheduler", "optimize_graph")}
                keys = self.__dask_keys__()
                graph = self.__dask_graph__()
                if kwargs.get("optimize_graph", True):
                    graph = self.__dask_optimize__(graph, keys)
                finalize, args = self.__dask_postcompute__()
                return finalize(schedule(graph, keys, **rest), *args)
        return super().compute(**kwargs)


def _nimg(block, ndim):
    return math.prod(block.shape[:block.ndim - ndim])


def _device_of(block):
    return block.device if is_cupy_array(block) else contextlib.nullcontext()


def _xp(block):
    return _cupy() if is_cupy_array(block) else np


def _chunk_task(block, counter, spec, before, after):
    """(nimg, *tail) histogram of a chunk's interior, plus its merged face when it has one."""
    xp = _xp(block)
    with _device_of(block):
        hist = counter.zeros(xp, _nimg(block, counter.ndim))
        if hist.shape[0] == 0:
            return hist
        with _side_stream(xp, hist, (block, before, after), counter) as side:
            _add_interior(counter, xp, hist, block, spec.interior, spec.origin)
            if spec.face is not None:
                a, lo, hi, masks, origin = spec.face
                axis = block.ndim - counter.ndim + a
                own = block[(slice(None),) * axis + (slice(lo, hi),)]
                slab = xp.concatenate(list(before) + [own] + list(after), axis=axis)
                counter.add(hist, slab, masks, origin)
    return side.result


def _edges(block, indices):
    """The thin pieces (views) of a chunk that the face tasks read."""
    return tuple(block[index] for index in indices)


def _face_task(pieces, counter, spec):
    """(nimg, *tail) histogram of a face assembled from the pieces of the chunks it crosses."""

    def concat(p, level):
        if not isinstance(p, list):
            return p
        parts = [concat(q, level + 1) for q in p]
        if len(parts) == 1:
            return parts[0]
        return _xp(parts[0]).concatenate(parts, axis=parts[0].ndim - counter.ndim + level)

    first = pieces
    while isinstance(first, list):
        first = first[0]
    xp = _xp(first)
    with _device_of(first):
        hist = counter.zeros(xp, _nimg(first, counter.ndim))
        if hist.shape[0] == 0:
            return hist
        with _side_stream(xp, hist, pieces, counter) as side:
            slab = concat(pieces, 0)
            counter.add(hist, slab, spec.masks, spec.origin)
    return side.result


def _add_interior(counter, xp, hist, block, inner, origin):
    """Add the histogram of the pixels of ``block`` without a seam coordinate (``inner``, an
    :class:`_Interior`) to ``hist``."""
    if inner.own is None:
        counter.add(hist, block, None, origin)
        return
    if inner.empty:
        return
    lead = block.ndim - counter.ndim
    kind = "cupy" if xp is not np else "numpy"
    if (not counter.plain_ok or INTERIOR.get(kind) != "plain"
            or inner.shortest < max(PLAIN_MIN_LENGTH, 2)):
        counter.add(hist, block, list(inner.own), origin)
        return
    # The whole chunk unmasked, minus its seam pixels as the chunk alone sees them (see
    # _Interior.planes).
    counter.add(hist, block, None, origin)
    neg = counter.zeros(xp, hist.shape[0])
    for a, take, masks in inner.planes:
        sub = block[(slice(None),) * (lead + a) + (slice(take, take + 2),)]
        counter.add(neg, sub, list(masks),
                    tuple(o + take if b == a else o for b, o in enumerate(origin)))
    hist -= neg


def _sum_parts(parts):
    """The sum of the histograms (never written into: a new array, or the only one)."""
    parts = [p.result() if isinstance(p, _Pending) else p for p in parts]
    if len(parts) == 1:
        return parts[0]
    total = parts[0] + parts[1]
    for p in parts[2:]:
        total += p
    return total


def _finish(parts, counter, shape):
    first = parts[0].hist if isinstance(parts[0], _Pending) else parts[0]
    with _device_of(first):
        return counter.finish(_sum_parts(parts)).reshape(shape)


# ---------------------------------------------------------------------------------------------
# Side streams


class _Side:
    """One side stream of a device, and what its newest task's kernels still read: the inputs
    (``keep``, allocated on the task's own stream) and the event that ends those kernels."""

    def __init__(self, stream):
        self.stream, self.event, self.keep = stream, None, None
        self.lock = threading.Lock()

    def release(self, stream):
        """Order ``stream`` after this side's last task and let go of its inputs: their memory
        returns to ``stream``'s pool only once nothing queued there can overtake the kernels
        reading it."""
        if self.keep is not None:
            stream.wait_event(self.event)
            self.keep = None


_SIDES: dict = {}
_SIDE_TURN = itertools.count()
_SIDES_LOCK = threading.Lock()


def _side_of_device(cupy):
    """The next side stream of the current device, in turn (SIDE_STREAMS of them)."""
    key = (cupy.cuda.runtime.getDevice(), SIDE_STREAMS)
    sides = _SIDES.get(key)
    if sides is None:
        with _SIDES_LOCK:
            sides = _SIDES.get(key)
            if sides is None:
                sides = [_Side(cupy.cuda.Stream(non_blocking=True)) for _ in range(key[1])]
                _SIDES[key] = sides
    return sides[next(_SIDE_TURN) % len(sides)]


class _Pending:
    """A task's device histogram ``hist`` whose kernels were queued on a side stream, finished
    at ``event``. Its consumer (the sum) takes it through :meth:`result`. ``hist`` itself was
    allocated on the consumer's stream, so its memory is reused there only after that wait."""

    __slots__ = ("hist", "event", "side", "taken")

    def __init__(self, hist, event, side):
        self.hist, self.event, self.side, self.taken = hist, event, side, False

    def result(self):
        """``hist``, with the current stream ordered after the kernels that wrote it."""
        stream = _cupy().cuda.get_current_stream()
        stream.wait_event(self.event)
        with self.side.lock:
            if self.side.event is self.event:
                self.side.release(stream)
        self.taken = True
        return self.hist

    def __reduce__(self):
        # Sent to another process (a distributed worker): the finished histogram alone.
        self.event.synchronize()
        return (_identity, (self.hist,))

    def __del__(self):
        # Dropped untaken (a failed compute): hist's memory must not be reused while the side
        # stream may still write it.
        if not self.taken:
            with contextlib.suppress(Exception):  # (at interpreter exit CUDA may be gone)
                self.event.synchronize()


def _identity(x):
    return x


@sizeof.register(_Pending)
def _sizeof_pending(p):
    return sizeof(p.hist)  # what a distributed worker counts against its memory limit


class _SideTask:
    """What ``with _side_stream(...)`` yields; ``result``: the task's result once it is left."""

    result = None


@contextlib.contextmanager
def _side_stream(xp, hist, keep, counter):
    """Queue the block's kernels on a side stream (CuPy, SIDE_STREAMS > 1, a counter whose
    kernels may run there), after the current stream's work; ``hist`` (allocated on the current
    stream) is the task's result and ``keep`` the inputs its kernels read. Else on the current
    stream, as they come."""
    task = _SideTask()
    if xp is np or SIDE_STREAMS <= 1 or not counter.side_streams:
        yield task
        task.result = hist
        return
    cupy = _cupy()
    here = cupy.cuda.get_current_stream()
    side = _side_of_device(cupy)
    with side.lock:
        side.release(here)              # at most one task's inputs held per side stream
        side.stream.wait_event(here.record())
        try:
            with side.stream:
                yield task
        except BaseException:
            side.stream.synchronize()   # hist is dropped: nothing queued may still write it
            raise
        side.event, side.keep = side.stream.record(), keep
        task.result = _Pending(hist, side.event, side)


# ---------------------------------------------------------------------------------------------
# Device masks


_UNIT = np.ones(1, dtype=bool)


def _device_mask(m):
    """The uint8 device copy of the host bool mask ``m`` on the current device, memoized and
    ready for any stream of any thread (cutopo._cuda.tables)."""
    return tables.memoized(m.astype(np.uint8))


class _EccCounter:
    """Histograms of owned pixels for the ECC: (nimg, T) int64, cumulated at the end."""

    plain_ok = True
    # (what its kernels read beyond the chunk, the plans' tables and the masks, is ready for
    # every stream: cutopo._cuda.tables)
    side_streams = True

    def __init__(self, t, ndim, tconn):
        self.t, self.ndim, self.tconn = t, ndim, tconn
        self.tail = (int(t.size),)
        self._plans = {}
        self._token = None

    @classmethod
    def of(cls, t, ndim, tconn):
        """The counter of these thresholds, shared by the graphs that count with them, so that
        its token and plans (the kernels' tables on each device) are made once."""
        return _ecc_counter(t.tobytes(), t.dtype.str, ndim, tconn)

    def __getstate__(self):
        return (self.t, self.ndim, self.tconn)

    def __setstate__(self, state):
        self.__init__(*state)

    def token(self):
        if self._token is None:
            self._token = tokenize("ecc", self.t, self.ndim, self.tconn)
        return self._token

    def zeros(self, xp, nimg):
        return xp.zeros((nimg,) + self.tail, dtype=np.int64)

    def add(self, hist, slab, masks, origin):
        """Add the histogram of the pixels of ``slab`` (*batch, *spatial) that ``masks`` (one
        host bool array per spatial axis, or None: every pixel) mark to ``hist``."""
        if masks is not None and not all(m.any() for m in masks):
            return
        if not is_cupy_array(slab):
            hist += _ecc_numpy.owned_histogram(np.asarray(slab), self.t, self.ndim, self.tconn,
                                               masks)
            return
        from . import _ecc_cupy

        cupy = _cupy()
        nimg = hist.shape[0]
        spatial = tuple(slab.shape[slab.ndim - self.ndim:])
        view = _ecc_cupy._image_view(cupy.ascontiguousarray(slab)).reshape((nimg,) + spatial)
        plan = self._plan(slab, masks is not None)
        if masks is None:
            plan.add(view, hist)
            return
        dev = [_device_mask(m) for m in masks]
        if self.ndim == 2:
            dev = [_device_mask(_UNIT)] + dev
        plan.add_masked(view, hist, *dev)

    def _plan(self, slab, masked):
        from . import _ecc_cupy

        key = (_cupy().cuda.runtime.getDevice(), slab.shape, slab.dtype, masked)
        plan = self._plans.get(key)
        if plan is None:
            # (its tables are ready for every stream: cutopo._cuda.tables)
            plan = _ecc_cupy.histogram_plan(slab, self.t, self.ndim, self.tconn, masked=masked)
            self._plans[key] = plan
        return plan

    def finish(self, total):
        return total.cumsum(axis=-1)


@functools.lru_cache(maxsize=16)
def _ecc_counter(t_bytes, dtype, ndim, tconn):
    t = np.frombuffer(t_bytes, dtype=dtype)  # read-only, as the counter's thresholds stay
    return _EccCounter(t, ndim, tconn)


class _EctCounter:
    """ECT curves of owned pixels: (nimg, D, T) int64, already cumulated per block (linear)."""

    plain_ok = False
    # Not on side streams: each ECT task reads a count back to the host (the compaction of its
    # critical pixels), which leaves its kernels little to overlap (not measured).
    side_streams = False

    def __init__(self, dirs64, coords, t, tconn, wrapped=False):
        self.dirs64, self.coords, self.t, self.tconn = dirs64, coords, t, tconn
        self.wrapped = wrapped  # coords of a padded volume: its pads carry the copied pixels'
        self.ndim = dirs64.shape[1]
        self.tail = (dirs64.shape[0], int(t.size))

    def token(self):
        return ("ect", self.dirs64, self.t, self.tconn, tuple(c.size for c in self.coords),
                self.wrapped)

    def zeros(self, xp, nimg):
        return xp.zeros((nimg,) + self.tail, dtype=np.int64)

    def add(self, hist, slab, masks, origin):
        if masks is not None and not all(m.any() for m in masks):
            return
        spatial = tuple(slab.shape[slab.ndim - self.ndim:])
        mask_b = slab.reshape((-1,) + spatial)
        mask_b = mask_b if mask_b.dtype == np.bool_ else mask_b != 0
        coords = [c[o:o + n] for c, o, n in zip(self.coords, origin, spatial)]
        if is_cupy_array(slab):
            from . import _band_cupy

            out, _ = _band_cupy.ect_forward(_cupy().ascontiguousarray(mask_b), self.dirs64, coords,
                                            self.t, self.tconn, soft=False, own=masks,
                                            general=self.wrapped)
        else:
            from . import _ect

            out = _ect.curves(np.asarray(mask_b), self.dirs64, coords, self.t, self.tconn, masks,
                              general=self.wrapped)
        hist += out.reshape(hist.shape)

    def finish(self, total):
        return total


# ---------------------------------------------------------------------------------------------
# ECC


def ecc(darr, thresholds, *, ndim=None, connectivity=1, boundary="box"):
    """Exact Euler characteristic curve of a Dask array, chunk by chunk (lazy).

    Equal, exactly, to ``cutopo.ecc(darr.compute(), thresholds, ...)``; see the module
    docstring for how chunks share the work without counting a cell twice.

    Parameters
    ----------
    darr : dask.array.Array, shape (*batch, *spatial)
        NumPy or CuPy chunks of a dtype :func:`cutopo.ecc` accepts, chunked any way (uneven
        chunks included). The last ``ndim`` axes are spatial.
    thresholds : int or 1-D array
        As for :func:`cutopo.ecc` (host or CuPy values). A count ``n`` needs the array's finite
        minimum and maximum: they are computed here, eagerly (one pass over ``darr``).
    ndim : {None, 2, 3}, optional
    connectivity : {1, ndim}, optional
        As for :func:`cutopo.ecc`.
    boundary : {"box", "periodic"}, optional
        As for :func:`cutopo.ecc`: ``"periodic"`` is the cubical complex of the torus (every
        spatial axis at least 3 long). The array is then padded by one wrapped pixel on each
        side of every spatial axis (``dask.array.pad``, the pads merged into the outer chunks)
        and the pads are neighbours only, never counted; NumPy and CuPy chunks alike.

    Returns
    -------
    curve : dask.array.Array of int64, shape (*batch, T)
        Lazy, in one chunk along T, with chunks of the input's type (NumPy or CuPy); call
        ``.compute()`` (or ``dask.compute`` on many curves at once).

    Notes
    -----
    Tasks: one per chunk; with one chunked spatial axis, one getitem per internal boundary;
    with several, one "edges" task per chunk and one task per face; one tree-sum task per batch
    chunk of the result (more levels beyond :data:`SPLIT_EVERY` parts). No task synchronises
    with the device.

    Convention: as for :func:`cutopo.ecc` (the last ``ndim`` axes are spatial, in C order);
    the chunking never changes the result.

    References
    ----------
    .. [1] Dask Development Team, "Dask: library for dynamic task scheduling", 2016,
       https://dask.org (the task graph and schedulers this builds on).

    Examples
    --------
    >>> import numpy as np, dask.array as da, cutopo, cutopo.dask
    >>> image = np.random.default_rng(0).integers(0, 8, (60, 50)).astype(np.uint8)
    >>> darr = da.from_array(image, chunks=(17, (20, 30)))
    >>> curve = cutopo.dask.ecc(darr, [1, 3, 5, 7])
    >>> bool((curve.compute() == cutopo.ecc(image, [1, 3, 5, 7])).all())
    True
    >>> torus = cutopo.dask.ecc(darr, [1, 3, 5, 7], boundary="periodic")
    >>> bool((torus.compute() == cutopo.ecc(image, [1, 3, 5, 7], boundary="periodic")).all())
    True
    """
    x = _check_dask(darr, "darr")
    ndim = _check_ndim(x, ndim, "darr")
    if np.dtype(x.dtype) not in IMAGE_DTYPES:
        names = ", ".join(d.name for d in IMAGE_DTYPES)
        raise TypeError(f"darr: dtype {x.dtype} is not supported (use one of {names})")
    if any(s == 0 for s in x.shape[x.ndim - ndim:]):
        raise ValueError(f"darr: spatial shape {x.shape[x.ndim - ndim:]} has a zero-length axis")
    tconn = check_connectivity(connectivity, ndim)
    periodic = _check_boundary(boundary, x.shape[x.ndim - ndim:], "darr")
    probe = np.empty(0, dtype=x.dtype)
    if isinstance(thresholds, (int, np.integer)) and not isinstance(thresholds, (bool, np.bool_)):
        thresholds = _linear_thresholds(x, thresholds)
    elif is_cupy_array(thresholds):
        thresholds = to_numpy(thresholds)
    t, _ = check_thresholds(thresholds, probe)
    if periodic:
        x = _wrapped(x, ndim)
    return _graph(x, ndim, _EccCounter.of(t, ndim, tconn), "cutopo-ecc", halo=periodic)


def _wrapped(x, ndim):
    """``x`` with one wrapped pixel on each side of every spatial axis, the pads merged into the
    outermost chunks (a volume cut in slabs stays cut in slabs: no chunk of one plane).

    The torus's ECC is the box rule's count over the original pixels of this array: a pixel's
    contribution depends only on its 3^ndim neighbourhood, which the pads give it as the torus
    does, and the box rule's owner of a cell (by value, then by direction) is translation
    invariant, so of the copies of a torus cell exactly one has its owner among the original
    pixels (as for the CUDA path of :func:`cutopo.ecc`)."""
    lead = x.ndim - ndim
    padded = da.pad(x, [(0, 0)] * lead + [(1, 1)] * ndim, mode="wrap")
    chunks = list(x.chunks[:lead])
    for c in x.chunks[lead:]:
        c = list(c)
        c[0] += 1
        c[-1] += 1
        chunks.append(tuple(c))
    return padded.rechunk(tuple(chunks))


def _linear_thresholds(x, n):
    """cutopo.linear_thresholds of a Dask array (computed now: one pass, each chunk's finite
    range by cutopo's one-pass scan, no temporaries of a chunk's size)."""
    import dask

    if n < 1:
        raise ValueError(f"thresholds: the count must be at least 1, got {n}")
    span = _ecc_numpy.merge_ranges(
        dask.compute(*map(dask.delayed(finite_range), x.to_delayed().ravel())))
    return thresholds_over_range(span, int(n), x.dtype, "darr")


# ---------------------------------------------------------------------------------------------
# ECT


def ect(dmask, directions, thresholds, *, connectivity=1, boundary="box"):
    """Exact Euler characteristic transform of a Dask mask, chunk by chunk (lazy).

    Equal, exactly, to ``cutopo.ect(dmask.compute(), directions, thresholds, ...)``: every
    chunk and face is counted at its pixels' positions in the whole volume.

    Parameters
    ----------
    dmask : dask.array.Array, shape (*batch, *spatial)
        NumPy or CuPy chunks of dtype bool or integer (non-zero is foreground), chunked any way;
        ``ndim = directions.shape[1]`` trailing spatial axes.
    directions : array-like, shape (D, ndim)
    thresholds : int or 1-D array
    connectivity : {1, ndim}, optional
        As for :func:`cutopo.ect` (host values; a count needs no pass over the data).
    boundary : {"box", "periodic"}, optional
        As for :func:`cutopo.ect`; ``"periodic"`` (the torus; NumPy or CuPy chunks) pads as
        :func:`ecc` does, the pads carrying the positions of the pixels they copy.

    Returns
    -------
    transform : dask.array.Array of int64, shape (*batch, D, T)
        Lazy; chunks of the input's type.

    Convention: as for :func:`cutopo.ect` (heights from the centred, isotropic positions of the
    whole array, not of a chunk; directions in array-axis order).

    References
    ----------
    .. [1] Dask Development Team, "Dask: library for dynamic task scheduling", 2016,
       https://dask.org.

    Examples
    --------
    >>> import numpy as np, dask.array as da, cutopo, cutopo.dask
    >>> mask = np.random.default_rng(1).random((40, 30)) < 0.6
    >>> dirs = [[1.0, 0.0], [0.6, 0.8]]
    >>> lazy = cutopo.dask.ect(da.from_array(mask, chunks=(15, 12)), dirs, 16)
    >>> bool((lazy.compute() == cutopo.ect(mask, dirs, 16)).all())
    True
    >>> torus = cutopo.dask.ect(da.from_array(mask, chunks=(15, 12)), dirs, 16, boundary="periodic")
    >>> bool((torus.compute() == cutopo.ect(mask, dirs, 16, boundary="periodic")).all())
    True
    """
    from . import _ect

    x = _check_dask(dmask, "dmask")
    directions = to_numpy(directions) if is_cupy_array(directions) else directions
    thresholds = to_numpy(thresholds) if is_cupy_array(thresholds) else thresholds
    _, dirs64 = _ect._check_directions(directions)
    ndim = dirs64.shape[1]
    if x.ndim < ndim:
        raise ValueError(f"dmask: directions have {ndim} components, so dmask needs {ndim} spatial "
                         f"axes (shape (*batch, *spatial)), got shape {x.shape}")
    if np.dtype(x.dtype).kind not in "biu":
        raise TypeError(f"dmask: dtype {x.dtype} is not bool or integer")
    spatial = tuple(x.shape[x.ndim - ndim:])
    if any(n == 0 for n in spatial):
        raise ValueError(f"dmask: spatial shape {spatial} has a zero-length axis")
    tconn = check_connectivity(connectivity, ndim)
    periodic = _check_boundary(boundary, spatial, "dmask")
    coords = _ect._axis_coordinates(spatial)
    _ect.check_heights_finite(coords, dirs64)
    t, _ = _ect._check_thresholds(thresholds, coords, dirs64)
    if periodic:
        # the pads are copies: they carry the positions (heights) of the pixels they copy
        x = _wrapped(x, ndim)
        coords = [np.concatenate([c[-1:], c, c[:1]]) for c in coords]
    return _graph(x, ndim, _EctCounter(dirs64, coords, t, tconn, wrapped=periodic), "cutopo-ect",
                  halo=periodic)
