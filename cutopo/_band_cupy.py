"""CuPy path of the exact and soft ECT (kernels of ``cuda_src/ecc_band.cuh``; the soft ECC's are in
:mod:`cutopo._soft_ecc_cupy`).

The Python side validates and plans; the kernels evaluate the band-limited sigmoid sums
(soft ops) or the threshold histograms (exact ECT) described in ``ecc_band.cuh``. Entries of the
ECT are the critical pixels of the masks, found by the contribution-map kernel of ``ecc.cu``
and compacted by three kernels (``count_nonzero``, ``scan_counts``, ``write_entries``).
"""
from __future__ import annotations

import functools
import math
from typing import NamedTuple

import numpy as np

from . import _ecc_cupy
from ._checks import THRESHOLDS_NOT_FINITE, THRESHOLDS_NOT_SORTED
from ._cuda import tables
from ._cuda.compile import register_instances
from ._cuda.deferred import thread_status
from ._cuda.launch import (CALL_INT64, HOST_WORD, NULL, PreparedLaunch, Signature, as_c_contiguous,
                           device_empty, launch, resident_blocks)
from ._cuda.workspace import MemsetWorkspaces

FAMILY = "ecc"
THREADS = 256                   # band::THREADS
WARPS = THREADS // 32
SHARED_MAX = 48 * 1024          # per-block accumulators in shared memory up to this size
# Critical pixels per block of the ECT kernels (one per lane) below which the block's set-up and
# flush (T entries each) outweigh its work.
MIN_ENTRIES_PER_BLOCK = 1024
# Height images (directions x images x pixels, float64) per T-construction pass of the ECT, by
# default; a streamed slab passes a bound scaled with its budget (cutopo._stream.ect).
T_PASS_ELEMENTS = 1 << 25
# The soft ECT keeps its entries (critical pixels, 9 bytes each) for the backward up to this
# many; beyond, the backward recomputes them.
KEEP_ENTRIES = 1 << 24

_REAL = {np.dtype(np.float32): "float", np.dtype(np.float64): "double"}


def _cbool(x: bool) -> int:
    return 1 if x else 0


# ---------------------------------------------------------------------------------------------
# Instances and signatures


def _ect_sig(kind, real_dtype, ndim):
    r = real_dtype.name
    name = f"cutopo::ecc::band::ect_{kind}<{_REAL[real_dtype]}, {ndim}>"
    head = ("ptr:int64", "ptr:int8", "ptr:int64", "ptr:int32", "ptr:float64", "ptr:float64",
            f"ptr:{r}")
    if kind == "forward":  # (..., acc, sat, out, done, n0, ...)
        params = head + ("ptr:float64", "ptr:int64", f"ptr:{r}", "ptr:uint32", "int64", "int64",
                         "int64", "int32", "int32", "int32", "int32", r, "float64", "int32",
                         "int32")
    else:
        params = head + (f"ptr:{r}", "ptr:float64", "ptr:float64", "ptr:float64", "int64",
                         "int64", "int64", "int32", "int32", "int32", "int32", r, "float64",
                         "int32", "int32", "int32", "int32")
    return Signature(FAMILY, name, params)


def _finalize_sig(real_dtype):
    r = real_dtype.name
    return Signature(FAMILY, f"cutopo::ecc::band::soft_finalize<{_REAL[real_dtype]}>",
                     ("ptr:int64", "ptr:float64", f"ptr:{r}", "int64", "int32"))


COMPACT_TILE = THREADS * 16    # band::COMPACT_TILE: pixels of a row per compaction block
COUNT_NONZERO = Signature(FAMILY, "cutopo::ecc::band::count_nonzero",
                          ("ptr:int8", "ptr:int64", "int64", "int64"))
SCAN_COUNTS = Signature(FAMILY, "cutopo::ecc::band::scan_counts",
                        ("ptr:int64", "ptr:int64", "int64", "int64"))
WRITE_ENTRIES = Signature(FAMILY, "cutopo::ecc::band::write_entries",
                          ("ptr:int8", "ptr:int64", "ptr:int64", "ptr:int8", "int64", "int64"))
WRITE_ENTRIES_SCANNED = Signature(FAMILY, "cutopo::ecc::band::write_entries_scanned",
                                  ("ptr:int8", "ptr:int64", "ptr:int64", "ptr:int8", "ptr:int64",
                                   "int64", "int64"))


def _check_arguments_sig(real_dtype, dir_dtype, ndim):
    return Signature(FAMILY, "cutopo::ecc::band::check_ect_arguments"
                             f"<{_REAL[real_dtype]}, {_REAL[dir_dtype]}, {ndim}>",
                     (f"ptr:{real_dtype.name}", "int64", f"ptr:{dir_dtype.name}", "int64",
                      "ptr:float64", "ptr:int32", "ptr:uint64", HOST_WORD, CALL_INT64))


# Directions that SoftEctPlan reads on the device (others are read on the host).
DIRECTION_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


def _finish_sig(dir_dtype, t_dtype, s_dtype):
    return Signature(FAMILY, "cutopo::ecc::band::ect_finish_cotangents"
                             f"<{_REAL[dir_dtype]}, {_REAL[t_dtype]}, {_REAL[s_dtype]}>",
                     ("ptr:float64", "int64", "int64", "float64", f"ptr:{dir_dtype.name}",
                      f"ptr:{t_dtype.name}", f"ptr:{s_dtype.name}"))


def _instances():
    yield COUNT_NONZERO.name
    for ndim in (2, 3):
        yield _orthant_sig(ndim).name
        yield _orthant_counted_sig(ndim).name
    yield SCAN_COUNTS.name
    yield WRITE_ENTRIES.name
    yield WRITE_ENTRIES_SCANNED.name
    for real in (np.dtype(np.float32), np.dtype(np.float64)):
        yield _finalize_sig(real).name
        for ndim in (2, 3):
            for kind in ("forward", "backward"):
                yield _ect_sig(kind, real, ndim).name
            for dirs in DIRECTION_DTYPES:
                yield _check_arguments_sig(real, dirs, ndim).name
        for dirs in DIRECTION_DTYPES:
            for s_dtype in DIRECTION_DTYPES:
                yield _finish_sig(dirs, real, s_dtype).name


register_instances(FAMILY, _instances)


# ---------------------------------------------------------------------------------------------
# Shared helpers


def _smem_bytes(T, real_dtype, with_g, with_sat):
    def a16(n):
        return (n + 15) // 16 * 16
    r = real_dtype.itemsize
    return a16(T * r) + (a16(T * r) if with_g else 0) + a16(T * 8) + (a16(T * 4) if with_sat else 0)


def _shared_plan(T, real_dtype, with_g, with_sat, static=0):
    """(use shared accumulators, dynamic shared bytes), for a kernel with ``static`` bytes of
    static shared memory (a block takes at most SHARED_MAX in all without opting in)."""
    smem = _smem_bytes(T, np.dtype(real_dtype), with_g, with_sat)
    return (True, smem) if static + smem <= SHARED_MAX else (False, 0)


def _blocks_per_row(sig, rows, work, T, smem, min_work):
    """Blocks per row: enough to fill the device, not so many that set-up and flush dominate."""
    target = 2 * resident_blocks(sig, THREADS, smem)
    most = max(1, math.ceil(work / max(min_work, 2 * T)))
    return int(max(1, min(math.ceil(target / max(rows, 1)), most)))


# Blocks of the argument checks: a grid-stride pass over at most a few thousand thresholds.
CHECK_BLOCKS = 64


def raise_failed_thresholds(flags: int):
    """The ValueError of a failed device check of thresholds (bits 0 and 1 of ``flags``, as
    check_ect_arguments and ecc_soft.cuh's report_thresholds write them): the host check's
    message."""
    if flags & 1:
        raise ValueError(THRESHOLDS_NOT_FINITE)
    if flags & 2:
        raise ValueError(THRESHOLDS_NOT_SORTED)


def _thresholds_on_device(t):
    """Device thresholds: host ones through the memoized table, device ones as they are."""
    import cupy

    return t if isinstance(t, cupy.ndarray) else device_table(t)


def device_table(host):
    """A device copy of a small host array, memoized: a repeated call (a training loop, a CUDA
    graph capture) then makes no host-to-device copy. Ready for kernels on any stream
    (:mod:`cutopo._cuda.tables`). Read-only by convention: never write into the result."""
    return tables.memoized(host)


def _finalize(sat, acc, real_dtype):
    import cupy

    rows, T = sat.shape
    out = cupy.empty((rows, T), dtype=real_dtype)
    launch(_finalize_sig(real_dtype), math.ceil(rows / WARPS), THREADS, (sat, acc, out, rows, T))
    return out


# ---------------------------------------------------------------------------------------------
# ECT entries: the critical pixels of the masks


class Entries(NamedTuple):
    """Critical pixels of a group of directions, listed per segment.

    Direction d (local to the group) of image b reads segment ``seg_of_dir[d] * B + b``,
    entries ``seg[s] .. seg[s + 1] - 1`` of ``lin`` (pixel index in the image) and ``c``.
    """
    lin: object         # cupy int64
    c: object           # cupy int8
    seg: object         # cupy int64, n_segments * B + 1
    seg_of_dir: object  # cupy int32, one per direction of the group
    per_segment: int    # mean entries per segment, rounded up (sizes the grid; no host copy)


def _compact(c, B, N, nseg):
    """Entries of c (int8, C-contiguous, nseg * B rows of N pixels): (lin, c, seg,
    per_segment), in row-major order. Three kernels (count per tile, scan, write); the one host
    synchronisation reads the total, which sizes lin and c."""
    import cupy

    rows = nseg * B
    tiles = -(-N // COMPACT_TILE)
    first = cupy.empty(rows * tiles, dtype=np.int64)
    seg = cupy.empty(rows + 1, dtype=np.int64)
    c = c.reshape(-1)
    launch(COUNT_NONZERO, rows * tiles, THREADS, (c, first, N, tiles))
    launch(SCAN_COUNTS, 1, THREADS, (first, seg, rows, tiles))
    n = int(seg[rows])
    lin = cupy.empty(n, dtype=np.int64)
    cc = cupy.empty(n, dtype=np.int8)
    launch(WRITE_ENTRIES, rows * tiles, THREADS, (c, first, lin, cc, N, tiles))
    per_segment = -(-n // rows) if rows else 0
    return lin, cc, seg, per_segment


def _owned(mask_b, own):
    """The masks, cleared outside the pixels that ``own`` marks (one 1-D bool mask per spatial
    axis, or None): the halo pixels of a block of a larger volume are neighbours only."""
    import cupy

    if own is None:
        return mask_b
    ndim = mask_b.ndim - 1
    out = mask_b
    for a, m in enumerate(own):
        m = cupy.asarray(np.asarray(m, dtype=bool))
        out = out & m.reshape((1,) * (a + 1) + (-1,) + (1,) * (ndim - 1 - a))
    return out


def _orthant_sig(ndim):
    return Signature(FAMILY, f"cutopo::ecc::band::orthant_contributions<{ndim}>",
                     ("ptr:bool", "ptr:int32", "ptr:int8", "int64", "int64", "int64", "int64",
                      "int32", "int32"))


def _orthant_counted_sig(ndim):
    return Signature(FAMILY, f"cutopo::ecc::band::orthant_contributions_counted<{ndim}>",
                     ("ptr:bool", "ptr:int32", "ptr:int8", "ptr:int64", "int64", "int64",
                      "int64", "int64", "int32", "int32", "int64"))


@functools.lru_cache(maxsize=64)
def _orthant_launch(device_id, B, n_orthants, spatial) -> PreparedLaunch:
    """The launch of orthant_contributions for one geometry (called with (masks, codes, out))."""
    ndim = len(spatial)
    sig = _orthant_sig(ndim)
    (nz, ny, nx), zchunk, per_image = _ecc_cupy.sweep_geometry(sig, n_orthants * B, spatial, ndim, 0,
                                                               _ecc_cupy.TILE_X["unsigned int"])
    return PreparedLaunch(sig, n_orthants * B * per_image, THREADS,
                          (None, None, None, B, nz, ny, nx, zchunk, per_image))


def orthant_contributions(mask_b, codes):
    """(len(codes), B, N) int8: the V-construction contribution maps of the masks (B, *spatial)
    for the orthants ``codes`` (bit a: v_a >= 0), zero outside the masks; one kernel."""
    import cupy

    B = mask_b.shape[0]
    spatial = tuple(mask_b.shape[1:])
    out = cupy.empty((len(codes), B, math.prod(spatial)), dtype=np.int8)
    if out.size:
        _orthant_launch(cupy.cuda.Device().id, B, len(codes), spatial)(
            mask_b, device_table(np.asarray(codes, dtype=np.int32)), out)
    return out


def entries_v(mask_b, dirs64, own=None):
    """Entries of every direction, V construction: one contribution pass per orthant, all
    orthants batched into one launch.

    Same keys as the NumPy path (_ect._orthant_contributions): the corner matching sign(v) is the
    strict key maximum of each cell, and non-mask pixels get a key above every mask key (one
    kernel, orthant_contributions); with ``own``, only the owned pixels are kept after it.
    """
    B = mask_b.shape[0]
    spatial = tuple(mask_b.shape[1:])
    ndim, N = len(spatial), math.prod(spatial)
    codes = (dirs64 >= 0).astype(np.int64) @ (1 << np.arange(ndim, dtype=np.int64))
    unique = np.unique(codes)
    c = orthant_contributions(mask_b, unique)
    if own is not None:
        c *= _owned(mask_b, own).reshape(1, B, N)
    lin, cc, seg, per_segment = _compact(c, B, N, unique.size)
    seg_of_dir = device_table(np.searchsorted(unique, codes).astype(np.int32))
    return Entries(lin, cc, seg, seg_of_dir, per_segment)


def _heights(coords_dev, spatial, dirs):
    """(D, *spatial) float64 heights, one rounding per operation, as _ect._height_sum."""
    ndim = len(spatial)
    h = None
    for a in range(ndim):
        x = coords_dev[a].reshape((1,) + (-1,) + (1,) * (ndim - 1 - a))
        term = x * dirs[:, a].reshape((-1,) + (1,) * ndim)
        h = term if h is None else h + term
    return h


def entries_t(mask_b, dirs_dev, coords_dev, own=None, tconn=True, periodic=False):
    """Entries of the directions ``dirs_dev`` (a group): one contribution pass per direction
    under the value order of the heights. The T construction always takes it; the V
    construction on the torus (``periodic``) or at positions that do not increase along their
    axes (a block padded with wrapped copies), where no corner is the highest of every cell."""
    import cupy

    B = mask_b.shape[0]
    spatial = mask_b.shape[1:]
    ndim, N = len(spatial), math.prod(spatial)
    D = dirs_dev.shape[0]
    H = _heights(coords_dev, spatial, dirs_dev)                       # (D, *spatial)
    vals = cupy.where(mask_b[None], H[:, None], np.inf).reshape((D * B,) + spatial)
    del H
    c = _ecc_cupy.euler_contributions(vals, ndim, tconn, periodic).reshape(D, B, N)
    del vals
    c *= _owned(mask_b, own).reshape(1, B, N)
    lin, cc, seg, per_segment = _compact(c, B, N, D)
    return Entries(lin, cc, seg, cupy.arange(D, dtype=np.int32), per_segment)


def direction_groups(mask_b, D, per_direction, pass_elements=None):
    """Direction ranges processed together: all for the orthant passes, bounded height images
    for the per-direction passes (at most ``pass_elements``, default T_PASS_ELEMENTS, elements
    of directions x images x pixels; one direction at least)."""
    if not per_direction:
        return [(0, D)]
    per = math.prod(mask_b.shape)
    step = max(1, (pass_elements or T_PASS_ELEMENTS) // max(per, 1))
    return [(d0, min(D, d0 + step)) for d0 in range(0, D, step)]


def group_entries(mask_b, dirs64, d0, d1, dirs_dev, coords_dev, tconn, own=None, periodic=False,
                  general=False):
    """Entries of directions [d0, d1): see entries_t (``general``: positions that do not
    increase along their axes) and entries_v."""
    if tconn or periodic or general:
        return entries_t(mask_b, dirs_dev[d0:d1], coords_dev, own, tconn, periodic)
    return entries_v(mask_b, dirs64, own)


# ---------------------------------------------------------------------------------------------
# ECT kernels


def _ect_plan(kind, ent, B, ndim, D, T, real):
    """(signature, shared accumulators?, shared bytes, blocks per row)."""
    sig = _ect_sig(kind, real, ndim)
    shared, smem = _shared_plan(T, real, kind == "backward", kind == "forward")
    chunks = 1
    if ent.per_segment:
        chunks = _blocks_per_row(sig, B * D, ent.per_segment, T, smem, MIN_ENTRIES_PER_BLOCK)
    return sig, shared, smem, chunks


class _EctGeometry(NamedTuple):
    B: int
    D: int
    ndim: int
    T: int
    n: tuple            # grid shape padded to 3 axes (n0, n1, n2)
    real: np.dtype      # computation dtype (the thresholds')
    dirs: object        # device float64 (D, ndim)
    coords: list        # device float64 positions per axis
    coords_cat: object  # the same, concatenated (what the kernels read)
    t: object           # device thresholds


def _ect_geometry(mask_b, dirs64, coords, t) -> _EctGeometry:
    D, ndim = dirs64.shape
    spatial = tuple(mask_b.shape[1:])
    return _EctGeometry(mask_b.shape[0], D, ndim, t.size, spatial + (1,) * (3 - len(spatial)),
                        t.dtype, device_table(dirs64), [device_table(c) for c in coords],
                        device_table(np.concatenate(coords)), device_table(t))


def ect_forward(mask_b, dirs64, coords, t, tconn, soft, lam=None, w=0.0, keep=False, own=None,
                periodic=False, general=False, pass_elements=None):
    """((B, D, T) result, entries): int64 ECT (soft False, t float64) or the soft ECT in t's
    dtype, and (with ``keep``) the [(d0, d1, Entries)] of every direction group for the backward,
    or None when they are too large to keep (more than KEEP_ENTRIES). ``own``: count only the
    pixels these per-axis bool masks mark (a block of a larger volume with its halo; ``coords``
    are then the block's positions in the volume). ``periodic``: the torus complex;
    ``general``: ``coords`` need not increase along their axes (see group_entries).
    ``pass_elements``: the bound of a per-direction pass (see direction_groups)."""
    import cupy

    geo = _ect_geometry(mask_b, dirs64, coords, t)
    B, D, ndim, T, n, real = geo.B, geo.D, geo.ndim, geo.T, geo.n, geo.real
    lam = real.type(0) if lam is None else lam
    out = None
    kept, total = ([] if keep else None), 0
    for d0, d1 in direction_groups(mask_b, D, tconn or periodic or general, pass_elements):
        Dg = d1 - d0
        ent = group_entries(mask_b, dirs64, d0, d1, geo.dirs, geo.coords, tconn, own, periodic,
                            general)
        total += int(ent.lin.size)
        if kept is not None:  # kept until they grow past KEEP_ENTRIES
            kept = kept + [(d0, d1, ent)] if total <= KEEP_ENTRIES else None
        sat = cupy.zeros((B * Dg, T), dtype=np.int64)
        acc = cupy.zeros((B * Dg, T) if soft else (1,), dtype=np.float64)
        if ent.lin.size:
            sig, shared, smem, chunks = _ect_plan("forward", ent, B, ndim, Dg, T, real)
            launch(sig, B * Dg * chunks, THREADS,
                   (ent.lin, ent.c, ent.seg, ent.seg_of_dir, geo.coords_cat,
                    cupy.ascontiguousarray(geo.dirs[d0:d1]), geo.t, acc, sat, NULL, NULL) + n
                   + (B, Dg, chunks, T, lam, w, _cbool(soft), _cbool(shared)), shared_mem=smem)
        if soft:
            part = _finalize(sat, acc, real)
        else:
            launch(_ecc_cupy.CUMSUM, math.ceil(B * Dg / WARPS), THREADS, (sat, B * Dg, T))
            part = sat
        if Dg == D:  # one group: no copy
            return part.reshape(B, D, T), kept
        if out is None:
            out = cupy.empty((B, D, T), dtype=part.dtype)
        out[:, d0:d1] = part.reshape(B, Dg, T)
    return out, kept


def ect_backward(mask_b, dirs64, coords, t, tconn, lam, w, g, needs, kept=None):
    """(d_dirs (D, ndim), d_t (T,) without the factor lam, d_scale 0-d), float64 CuPy arrays."""
    import cupy

    need_dirs, need_t, need_scale = needs
    geo = _ect_geometry(mask_b, dirs64, coords, t)
    B, D, ndim, T, n, real = geo.B, geo.D, geo.ndim, geo.T, geo.n, geo.real
    g = g.reshape(B, D, T).astype(real, copy=False)
    d_dirs = cupy.zeros((D, ndim), dtype=np.float64)
    dt = cupy.zeros(T, dtype=np.float64)
    dscale = cupy.zeros(1, dtype=np.float64)
    groups = kept if kept is not None else [
        (d0, d1, None) for d0, d1 in direction_groups(mask_b, D, tconn)]
    for d0, d1, ent in groups:
        Dg = d1 - d0
        if ent is None:
            ent = group_entries(mask_b, dirs64, d0, d1, geo.dirs, geo.coords, tconn)
        if not ent.lin.size:
            continue
        g_part = cupy.ascontiguousarray(g[:, d0:d1]).reshape(B * Dg, T)
        sig, shared, smem, chunks = _ect_plan("backward", ent, B, ndim, Dg, T, real)
        # d_dirs[d0:d1] is a C-contiguous block of rows: the kernel adds into it in place.
        launch(sig, B * Dg * chunks, THREADS,
               (ent.lin, ent.c, ent.seg, ent.seg_of_dir, geo.coords_cat,
                cupy.ascontiguousarray(geo.dirs[d0:d1]), geo.t, g_part, d_dirs[d0:d1], dt, dscale)
               + n + (B, Dg, chunks, T, lam, w, _cbool(shared), _cbool(need_dirs), _cbool(need_t),
                      _cbool(need_scale)), shared_mem=smem)
    return d_dirs, dt, dscale.reshape(())


# ---------------------------------------------------------------------------------------------
# Soft ECT with device-resident arguments

# SoftEctPlan sizes its entries for the worst case (every pixel of every orthant map critical),
# so that a call needs no host read of their count: up to this many slots (2^ndim x images x
# pixels, 9 bytes each: 19 MB, kept for the backward while the pullback lives). Larger calls
# take ect_forward (one 8-byte read, exact sizes), where the reads cost relatively little.
DEVICE_SLOTS = 1 << 21
DEVICE_TILES = 4096
# A SoftEctPlan keeps its forward's and backward's workspaces (zeroed by a memset at every
# call: MemsetWorkspaces) up to this size each, per thread and stream; larger ones are made
# per call. bench_soft's 512^2 image with 256 directions and 128 thresholds takes 0.5 MiB.
KEEP_WORKSPACE_BYTES = 2 << 20


class DeviceEntries(NamedTuple):
    """What a SoftEctPlan forward leaves for its backward: the critical pixels of every orthant
    (as Entries, segment u * B + b for orthant u of image b; ``codes`` maps each direction to
    its orthant) and the directions in float64, all on the device; and the dtypes in which the
    backward returns the thresholds' and the scale's cotangents (set by the caller)."""
    plan: object
    lin: object
    c: object
    seg: object
    codes: object
    dirs64: object
    t_dtype: object = None
    s_dtype: object = None


class _ArgumentFlags:
    """check_ect_arguments' flags from its PinnedStatus, as the one-value array that
    ``_ect._raise_failed_arguments`` reads (``cutopo._cuda.deferred.reading``)."""

    def __init__(self, status):
        self._status, self._values = status, None

    def read(self) -> np.ndarray:
        if self._values is None:
            self._values = np.array([self._status.read_status()[1]], dtype=np.uint64)
        return self._values


class SoftEctPlan:
    """The soft ECT (V construction, box) of one geometry when the directions and thresholds
    are device arrays, planned once (memoized by :func:`soft_ect_plan`): a call reads nothing
    on the host before it returns, and launches a fixed sequence of kernels.

    * :meth:`arguments`: one kernel (check_ect_arguments) converts the directions to float64,
      finds their orthant codes and checks directions and thresholds into flags, which its
      last block stores in page-locked host memory (a ``PinnedStatus``: no copy or event).
    * :meth:`forward`: the contribution maps of all 2^ndim orthants, with the count of their
      non-zero pixels per compaction tile (one kernel; which orthants the directions use is not
      known on the host, and for a full set of directions every one is), their compaction into
      entries sized for the worst case (one kernel, each block summing the counts before its
      tile: there are few; no read of the total), the band kernel over every (image,
      direction), whose last block of each row also writes that row of the result.
    * :meth:`backward`: one kernel over the kept entries.

    The entries equal those of :func:`entries_v` (same maps, same order per orthant), so the
    results equal that path's.

    The arrays of every launch are made here or by ``_ect._soft_forward_device`` on the
    plan's device (the current one: the plan is memoized per device, and that path takes only
    mask, directions and thresholds on one device), C contiguous and of the plan's dtypes (bool
    mask, ``dir_dtype`` directions, ``real`` thresholds and scale), except the backward's
    cotangent, which comes through ``cutopo.vjp`` (on the output's device, refused elsewhere)
    cast to ``real`` and made contiguous. So the launches check every argument at the first
    call only (``PreparedLaunch.call_checked_once``), as the soft ECC plan's do.
    """

    def __init__(self, B, spatial, D, T, real, dir_dtype):
        from ._ect import _axis_coordinates  # (an import cycle at module level)

        ndim, N = len(spatial), math.prod(spatial)
        n_orthants = 1 << ndim
        self.B, self.D, self.T, self.ndim, self.N, self.real = B, D, T, ndim, N, real
        self.rows = n_orthants * B
        self.tiles = -(-N // COMPACT_TILE)
        self._orthant_codes = device_table(np.arange(n_orthants, dtype=np.int32))
        osig = _orthant_counted_sig(ndim)
        (nz, ny, nx), zchunk, per_image = _ecc_cupy.sweep_geometry(
            osig, self.rows, tuple(spatial), ndim, 0, _ecc_cupy.TILE_X["unsigned int"])
        # (masks, codes, maps, counts): the maps and the tiles' counts of their non-zero pixels
        self._orthants = PreparedLaunch(osig, self.rows * per_image, THREADS,
                                        (None, None, None, None, B, nz, ny, nx, zchunk,
                                         per_image, self.tiles))
        # (maps, counts, lin, c, seg): each block sums the counts before its tile itself
        self._write = PreparedLaunch(WRITE_ENTRIES_SCANNED, self.rows * self.tiles, THREADS,
                                     (None, None, None, None, None, N, self.tiles))
        self._check = PreparedLaunch(
            _check_arguments_sig(real, dir_dtype, ndim),
            max(1, min(-(-max(T, D) // THREADS), CHECK_BLOCKS)), THREADS,
            (None, T, None, D, None, None, None, None, None))
        coords = device_table(np.concatenate(_axis_coordinates(spatial)))
        n = tuple(spatial) + (1,) * (3 - ndim)
        # Blocks per (image, direction) from a guess of the critical pixels per direction (an
        # eighth of the pixels; only the split of each segment's range depends on it).
        per_segment = max(1, N // 8)
        sig = _ect_sig("forward", real, ndim)
        shared, smem = _shared_plan(T, real, False, True)
        chunks = _blocks_per_row(sig, B * D, per_segment, T, smem, MIN_ENTRIES_PER_BLOCK)
        # (lin, c, seg, codes, coords, dirs, t, acc, sat, out, done, n0, n1, n2, B, D, chunks,
        #  T, lam, w, soft, shared): the arrays of a call, its scale and band per call; the
        #  last block of each row writes its out row (no finalisation launch)
        self._forward = PreparedLaunch(
            sig, B * D * chunks, THREADS,
            (None, None, None, None, coords) + (None,) * 6 + n
            + (B, D, chunks, T, None, None, 1, _cbool(shared)), shared_mem=smem)
        bsig = _ect_sig("backward", real, ndim)
        bshared, bsmem = _shared_plan(T, real, True, False)
        bchunks = _blocks_per_row(bsig, B * D, per_segment, T, bsmem, MIN_ENTRIES_PER_BLOCK)
        self._backward_fixed = (bsig, B * D * bchunks, bsmem,
                                (None,) * 4 + (coords,) + (None,) * 6 + n
                                + (B, D, bchunks, T, None, None, _cbool(bshared)))
        self._backward = {}
        self._finish = {}
        self.dir_dtype = dir_dtype
        self._workspaces = MemsetWorkspaces(KEEP_WORKSPACE_BYTES)

    def _forward_views(self, workspace):
        """(the tiles' counts, saturated counts, sums, the rows' finished-block counters) of a
        forward workspace."""
        M, k = self.B * self.D * self.T, self.rows * self.tiles
        return (workspace[:k].view(np.int64), workspace[k:k + M].view(np.int64),
                workspace[k + M:k + 2 * M].view(np.float64), workspace[k + 2 * M:].view(np.uint32))

    def _backward_views(self, workspace):
        """(the workspace, the directions', thresholds' and scale's cotangents in it)."""
        k = self.D * self.ndim
        return (workspace, workspace[:k].reshape(self.D, self.ndim), workspace[k:k + self.T],
                workspace[k + self.T:])

    def arguments(self, t, directions):
        """(workspace, dirs64, codes, flags): the zeroed accumulators of :meth:`forward` (the
        views of this plan's workspace that its launches take), the directions in float64,
        their orthant codes, and the pending flags of the checks (read them with
        ``cutopo._cuda.deferred.reading``)."""
        status = thread_status("ecc.check_ect_arguments")
        workspace, dirs64, codes = self.checked_arguments(t, directions, status, status.arm())
        return workspace, dirs64, codes, _ArgumentFlags(status)

    def checked_arguments(self, t, directions, host=NULL, token=0):
        """:meth:`arguments`' launches, the flags stored in ``host`` (a ``PinnedStatus`` armed
        with ``token``) or, with NULL, nowhere: reading them is what keeps a call out of a
        CUDA graph, so benchmarks time the kernels this way."""
        M = self.B * self.D * self.T
        # the tiles' counts, saturated counts, sums, the rows' finished-block counters (uint32,
        # two a word): one memset
        words = self.rows * self.tiles + 2 * M + -(-self.B * self.D // 2)
        workspace = self._workspaces.get("forward", words, np.uint64, self._forward_views)
        dirs64 = device_empty((self.D, self.ndim), np.float64)
        codes = device_empty(self.D, np.int32)
        counters = thread_status("ecc.check_ect_arguments").counters
        self._check.call_checked_once(t, directions, dirs64, codes, counters, host, token)
        return workspace, dirs64, codes

    def forward(self, mask_b, workspace, dirs64, codes, t, lam, w, t_dtype=None, s_dtype=None):
        """((B * D, T) soft ECT in the dtype of t, the DeviceEntries for the backward, whose
        cotangents of the thresholds and the scale come in ``t_dtype`` and ``s_dtype``).
        ``workspace``: :meth:`arguments`' views."""
        counts, sat, acc, done = workspace
        maps = device_empty((self.rows, self.N), np.int8)
        self._orthants.call_checked_once(mask_b, self._orthant_codes, maps, counts)
        seg = device_empty(self.rows + 1, np.int64)
        lin = device_empty(self.rows * self.N, np.int64)
        c = device_empty(self.rows * self.N, np.int8)
        self._write.call_checked_once(maps, counts, lin, c, seg)
        del maps
        out = device_empty((self.B * self.D, self.T), self.real)
        self._forward.call_checked_once(lin, c, seg, codes, dirs64, t, acc, sat, out, done, lam, w)
        return out, DeviceEntries(self, lin, c, seg, codes, dirs64, t_dtype, s_dtype)

    def _finish_launch(self, t_dtype, s_dtype) -> PreparedLaunch:
        launch_ = self._finish.get((t_dtype, s_dtype))
        if launch_ is None:
            k = self.D * self.ndim
            launch_ = PreparedLaunch(_finish_sig(self.dir_dtype, t_dtype, s_dtype),
                                     max(1, min(-(-(k + self.T + 1) // THREADS), CHECK_BLOCKS)),
                                     THREADS, (None, k, self.T, None, None, None, None))
            self._finish[(t_dtype, s_dtype)] = launch_
        return launch_

    def backward(self, kept: DeviceEntries, t, g, lam, w, needs, t_dtype, s_dtype):
        """(d_dirs (D, ndim) in the directions' dtype, d_t (T,) with the factor lam in
        ``t_dtype``, d_scale 0-d in ``s_dtype``), summed in one zeroed float64 workspace and
        converted by one kernel (ect_finish_cotangents). ``needs``: (directions, thresholds,
        scale); ``t_dtype``, ``s_dtype``: float64 or the dtype of t."""
        needs = tuple(bool(n) for n in needs)
        launch_ = self._backward.get(needs)
        if launch_ is None:
            sig, grid, smem, args = self._backward_fixed
            launch_ = PreparedLaunch(sig, grid, THREADS, args + tuple(_cbool(n) for n in needs),
                                     shared_mem=smem)
            self._backward[needs] = launch_
        workspace, d_dirs, dt, dscale = self._workspaces.get(
            "backward", self.D * self.ndim + self.T + 1, np.float64, self._backward_views)
        g = as_c_contiguous(g.reshape(self.B * self.D, self.T).astype(self.real, copy=False))
        launch_.call_checked_once(kept.lin, kept.c, kept.seg, kept.codes, kept.dirs64, t, g,
                                  d_dirs, dt, dscale, lam, w)
        out_dirs = device_empty((self.D, self.ndim), self.dir_dtype)
        out_t = device_empty(self.T, t_dtype)
        out_scale = device_empty((), s_dtype)
        self._finish_launch(t_dtype, s_dtype).call_checked_once(workspace, float(lam), out_dirs,
                                                                out_t, out_scale)
        return out_dirs, out_t, out_scale


@functools.lru_cache(maxsize=64)
def soft_ect_plan(device_id, B, spatial, D, T, real, dir_dtype) -> SoftEctPlan:
    """The SoftEctPlan of a geometry on a device (``real``, ``dir_dtype``: NumPy dtypes)."""
    return SoftEctPlan(B, spatial, D, T, real, dir_dtype)


def fits_device_plan(B, spatial) -> bool:
    """Whether a SoftEctPlan takes B images of this spatial shape: at most DEVICE_SLOTS entry
    slots and DEVICE_TILES compaction tiles (each block of write_entries_scanned sums the
    counts of the tiles before it: quadratic in their number)."""
    rows = (1 << len(spatial)) * B
    N = math.prod(spatial)
    return 0 < rows * N <= DEVICE_SLOTS and rows * -(-N // COMPACT_TILE) <= DEVICE_TILES
