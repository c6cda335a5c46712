"""CuPy path of the exact ECC: plans and launches the kernels of ``cuda_src/ecc.cu``."""
from __future__ import annotations

import functools
import math

import numpy as np

from ._cuda import tables
from ._cuda.compile import register_instances
from ._cuda.launch import (PreparedLaunch, Signature, as_c_contiguous, device_attribute, device_zeros,
                           launch, on_device_of, resident_blocks, static_shared_bytes)
from ._cuda.repeated import RepeatedCalls
from ._cuda.workspace import ZeroedWorkspaces

FAMILY = "ecc"
THREADS = 256                # ecc::THREADS
TILE_Y = 32                  # ecc::TY, and the packed sweep's tiles at packed::PY rows per thread
TILE_X = {"unsigned short": 64, "unsigned int": 32}  # packed::TXP for 16-bit keys, ecc::TX else
TABLE_SMEM_MAX = 16 * 1024   # threshold table in shared memory up to this many bytes
HIST_SMEM_MAX_BINS = 4096    # per-block shared histogram up to this many bins
HIST_COPIES_MAX = 4          # its interleaved copies, at most (histogram_copies, measured)
# The packed sweep (15-bit keys, below packed::OUTSIDE = 0x7fff) adds into the shared
# histogram only (ecc.cu's HistSink): it takes T <= HIST_SMEM_MAX_BINS, more bins the scalar one.
PACKED_MAX_BINS = HIST_SMEM_MAX_BINS
PACKED_STATIC_SMEM = 16 * 1024  # the packed sweep's static shared memory (14.9 KB in 3D), at most
PACKED_SHARED_TABLE_CMP = ("float", "int")  # its tables always in shared memory (4-byte values)
MAX_PIXELS_PER_BLOCK = 1 << 27  # keeps each block's int32 shared histogram from overflowing
# How a call makes its histogram rows cumulative. By default every block adds its own prefix
# sums (one atomic per bin from the block's first non-zero bin on): no block waits for another,
# and the launch has no tail, 0.7-1.6 us less per call on the H200 from 128^2 to 4096^2 and in
# 3D (benchmarks/RESULTS.md, fourteenth session). Else the last block of each image cumulates
# its row (one atomic per non-zero bin and block): bool images, whose blocks have at most two
# non-zero bins (dense prefix sums cost 1.3 us more at 1024^2, all at the end of the wave), and
# launches with more than 1 / BLOCK_PREFIX_MIN_PIXELS bins per pixel of a block.
BLOCK_PREFIX_MIN_PIXELS = 4
KEEP_COUNTER_BYTES = 1 << 20  # a plan's kept per-image counters up to this size (per stream)
PROFILE_OPTIONS: tuple[str, ...] = ()  # extra -D flags for profiling variants (benchmarks only)
# The histogram kernel's launch geometry (_histogram_geometry, measured on the H200).
HIST_WAVES_2D = 3        # 2D blocks: up to this many times the resident ones,
HIST_MIN_TILES_2D = 2    # with at least this many tiles per block
HIST_WAVES_3D = 16       # 3D blocks: up to this many times the resident ones (~1 tile each)
HIST_BLOCK_PLANES = 2    # a 3D block's fixed cost, in plane loads (the chunk-length model)
HIST_ZCHUNK_MAX = 64     # planes per 3D tile at most
# 2D histograms of 16-bit keys take tall tiles, HIST_TALL_ROWS[itemsize] rows per thread (80
# rows for 2- and 4-byte images, 96 for 1-byte ones, 64 for 8-byte ones: the fixed work per
# tile of 32 rows, ecc.cu's packed::sweep, spread over more rows; measured against 64, 80, 96
# and 128 rows on the H100, benchmarks/RESULTS.md, fifty-seventh session) where the image has
# at least HIST_TALL_MIN_TILES such tiles per resident block; smaller images keep 32 rows,
# which give their one wave more blocks (at 1 rather than 2, 2048^2 float32 and 2048 x 8192
# float32 ran 15 % faster, 2048 x 4096 uint8 20 %; nothing slower).
HIST_TALL_ROWS = {1: 12, 2: 10, 4: 10, 8: 8}
HIST_TALL_MIN_TILES = 1

# Storage dtype -> C type of the kernel's input (bool is one byte, read as unsigned char).
_INPUT_CTYPE = {
    np.dtype("bool"): "unsigned char", np.dtype("uint8"): "unsigned char",
    np.dtype("uint16"): "unsigned short", np.dtype("int16"): "short", np.dtype("int32"): "int",
    np.dtype("float16"): "cutopo::half", np.dtype("float32"): "float", np.dtype("float64"): "double",
}
_INPUT_VIEW = {np.dtype("bool"): np.dtype("uint8"), np.dtype("float16"): np.dtype("uint16")}
# Value-order keys of the contribution map (common.cuh order_key): 64-bit where 32 cannot hold them.
_VALUE_KEY = {"int": "unsigned long long", "double": "unsigned long long"}


def _compare_type(dtype: np.dtype) -> tuple[str, np.dtype]:
    """C type and NumPy dtype in which ``f <= t`` is evaluated exactly as NumPy does in ``dtype``."""
    if dtype.kind == "f":  # float16 compares exactly in float32
        return ("double", np.dtype("float64")) if dtype.itemsize == 8 else ("float", np.dtype("float32"))
    if dtype == np.dtype("uint64"):
        return "unsigned long long", dtype
    return "long long", np.dtype("int64")


def _threshold_table(t: np.ndarray, cmp_dtype: np.dtype) -> np.ndarray:
    """(T + 1, 2) bounds of the bins in the comparison type (ecc.cu's Bounds): row k is
    (t_{k-1}, t_k); rows 0 and T are (NaN, t_0) and (t_{T-1}, NaN) in float types (no value
    is > NaN: the estimate's step up from a guess of T stays there), (t_0, t_0) and
    (t_{T-1}, t_{T-1}) in integer ones."""
    keys = t.astype(cmp_dtype)
    if cmp_dtype.kind == "f":
        return _bounds(keys, np.nan, np.nan)
    return _bounds(keys, keys[0], keys[-1])


def _bounds(keys, first, last):
    """The (T + 1, 2) rows (t_{k-1}, t_k) of ``keys``, with ``first`` before t_0 and ``last``
    after t_{T-1}, in keys' dtype."""
    lo = np.concatenate([np.array([first], dtype=keys.dtype), keys])
    hi = np.concatenate([keys, np.array([last], dtype=keys.dtype)])
    return np.stack([lo, hi], axis=1)


# Images of 16-bit integers compare in int32 against integer bounds (_integer_threshold_table):
# their bins then take integer comparisons and a float32 estimate, where float thresholds would
# take float64 ones and three slow conversions per pixel.
_INT16_IMAGES = (np.dtype("uint16"), np.dtype("int16"))
_INT16_BEYOND = 65537  # bounds clipped to [-65537, 65536]: past every 16-bit value either side


def _integer_threshold_table(t: np.ndarray) -> np.ndarray:
    """(T + 1, 2) int32 bounds of the bins for images of 16-bit integers, thresholds ``t`` in
    their comparison dtype (numpy.result_type with the image's, which holds every 16-bit value
    exactly). An integer v satisfies v <= t exactly when v <= floor(t), and clipping floor(t)
    to just past the 16-bit range keeps every such comparison: row k is (floor t_{k-1},
    floor t_k) clipped, rows 0 and T (INT32_MIN, t_0) and (t_{T-1}, INT32_MAX) (ecc.cu's
    Bounds)."""
    # float16/32/64 values are exact in float64; 64-bit integers past 2^53 round, far past the clip
    f = np.floor(t.astype(np.float64))
    keys = np.clip(f, -_INT16_BEYOND, _INT16_BEYOND - 1).astype(np.int32)
    info = np.iinfo(np.int32)
    return _bounds(keys, info.min, info.max)


def histogram_key_ctype(T: int, cmp_ctype: str | None = None, table_bytes: int = 0,
                        smem_optin: int | None = None) -> str:
    """The histogram kernels' key type: 16-bit keys (the packed sweep) up to PACKED_MAX_BINS,
    where the packed sweep's shared memory fits a block of the device (``smem_optin``: the
    bytes a block may take). Its tables of 4-byte comparison values are always in shared memory
    (threshold_table_in_shared): with the histogram and the planes, ~64 KB at PACKED_MAX_BINS,
    more than the 48 KB of a block on devices before Volta."""
    if T > PACKED_MAX_BINS:
        return "unsigned int"
    if smem_optin is not None:
        key = "unsigned short"
        in_smem = threshold_table_in_shared(table_bytes, key, cmp_ctype)
        dynamic = histogram_shared_bytes(T, table_bytes, in_smem)
        if PACKED_STATIC_SMEM + dynamic > smem_optin:
            return "unsigned int"
    return "unsigned short"


def histogram_shared_bytes(T: int, table_bytes: int, table_in_smem: bool, copies: int = 1) -> int:
    """The histogram kernels' dynamic shared memory: the threshold table where it is there
    (16-byte aligned), then the per-block histogram (T <= HIST_SMEM_MAX_BINS) in ``copies``
    interleaved copies, each with two slots more, where ecc.cu's HistSink adds the pixels past
    every threshold and those outside the image."""
    return (((table_bytes + 15) // 16 * 16 if table_in_smem else 0)
            + 4 * (T + 2) * copies)


def histogram_copies(sig: Signature, T: int, table_bytes: int, table_in_smem: bool) -> int:
    """The copies of the shared histogram that the packed sweep's ecc_histogram ``sig`` adds
    into (its ``hist_copies``): the most, a power of two up to HIST_COPIES_MAX, that leave as
    many blocks resident as one copy. A warp's lanes then add to different copies (lane l to
    copy l % R), so that neighbours' equal keys, zero contributions included (added like the
    others, without a select: ecc.cu's HistSink), meet at one address R times less often. On
    the H100 4 copies measured fastest: 2D 8192^2 1-3 % faster than 1 on white noise, 13-20 %
    on smooth images, 1024^2 bool 10 %; 2 copies 0-5 % slower than 4, 8 copies 1-7 %, 16
    copies 4-27 % (more shared memory a block, though 16 copies spread a warp's lanes over the
    banks best; why is not measured) (benchmarks/RESULTS.md, fifty-ninth session)."""
    room = device_attribute("MaxSharedMemoryPerBlockOptin") - static_shared_bytes(sig, PROFILE_OPTIONS)
    one = resident_blocks(sig, THREADS, histogram_shared_bytes(T, table_bytes, table_in_smem), PROFILE_OPTIONS)
    copies = HIST_COPIES_MAX
    while copies > 1:
        shared = histogram_shared_bytes(T, table_bytes, table_in_smem, copies)
        if shared <= room and resident_blocks(sig, THREADS, shared, PROFILE_OPTIONS) >= one:
            break
        copies //= 2
    return copies


def histogram_cumulation(copies: int, dtype, T: int, block_pixels: float) -> int:
    """ecc_histogram's ``cumulate`` (BLOCK_PREFIX_MIN_PIXELS): 2, every block adds its own
    prefix sums, where its shared histogram holds its counts (``copies`` >= 1), more than
    1 / BLOCK_PREFIX_MIN_PIXELS bins a pixel and the image is not bool; else 1, the last block
    of each image cumulates its row. The scalar sweep (32-bit keys, no copies) adds straight
    into the global rows: its blocks have no prefix sums of their own (taking 2 there left the
    rows uncumulated, where 16-bit keys did not fit a block's shared memory, e.g. 4096 float32
    bins in Turing's 64 KB)."""
    if copies and np.dtype(dtype) != np.bool_ and T * BLOCK_PREFIX_MIN_PIXELS <= block_pixels:
        return 2
    return 1


def threshold_table_in_shared(table_bytes: int, key_ctype: str, cmp_ctype: str) -> bool:
    """Whether ecc_histogram reads the threshold table from shared memory: up to
    TABLE_SMEM_MAX bytes, and always for the packed sweep's (16-bit keys) tables of 4-byte
    comparison values, which the kernel takes there at compile time (32 KB at most, at
    PACKED_MAX_BINS)."""
    always = key_ctype == "unsigned short" and cmp_ctype in PACKED_SHARED_TABLE_CMP
    return always or table_bytes <= TABLE_SMEM_MAX


def histogram_bin_arguments(dtype: np.dtype, thresholds: np.ndarray):
    """(comparison C type, (T + 1, 2) table of bin bounds, estimate (t0, 1/dt) or None) with
    which ecc_histogram bins images of ``dtype`` against ``thresholds`` (in the comparison
    dtype numpy.result_type(image, thresholds))."""
    if dtype in _INT16_IMAGES:
        estimate = _uniform_estimate(thresholds, float_guess=True)
        return "int", _integer_threshold_table(thresholds), estimate
    cmp_ctype, cmp_dtype = _compare_type(thresholds.dtype)
    return cmp_ctype, _threshold_table(thresholds, cmp_dtype), _uniform_estimate(thresholds)


def histogram_instance(in_ctype, cmp_ctype, key_ctype, ndim, tconn, rows=None) -> str:
    """The histogram kernel; ``rows``: rows per thread of the packed sweep's tiles (16-bit keys)
    where not the kernel's default (TILE_Y / 8)."""
    tail = "" if rows is None else f", {int(rows)}"
    return (f"cutopo::ecc::ecc_histogram<{in_ctype}, {cmp_ctype}, {key_ctype}, {ndim}, "
            f"{'true' if tconn else 'false'}{tail}>")


def tall_rows(dtype) -> int:
    """Rows per thread of the 2D histograms' tall tiles for an image of ``dtype`` (0: none)."""
    return HIST_TALL_ROWS.get(np.dtype(dtype).itemsize, 0)


def masked_histogram_instance(in_ctype, cmp_ctype, key_ctype, ndim, tconn) -> str:
    """The histogram kernel that counts only the pixels marked in per-axis masks (blocks of a
    larger volume swept with their halo: cutopo/_stream.py, cutopo/dask.py)."""
    return histogram_instance(in_ctype, cmp_ctype, key_ctype, ndim, tconn).replace(
        "ecc_histogram<", "ecc_histogram_masked<")


def contributions_instance(in_ctype, ndim, tconn, periodic=False) -> str:
    """The contribution-map kernel; ``periodic``: of the torus complex (the NumPy path's rule)."""
    key = _VALUE_KEY.get(in_ctype, "unsigned int")
    torus = ", true" if periodic else ""
    return (f"cutopo::ecc::ecc_contributions<{in_ctype}, {key}, {ndim}, "
            f"{'true' if tconn else 'false'}{torus}>")


CUMSUM = Signature(FAMILY, "cutopo::ecc::ecc_cumsum", ("ptr:int64", "int64", "int32"))


def _range_sig(dtype: np.dtype) -> Signature:
    view = _INPUT_VIEW.get(dtype, dtype)
    return Signature(FAMILY, f"cutopo::ecc::finite_range<{_INPUT_CTYPE[dtype]}>",
                     (f"ptr:{view}", "int64", "ptr:uint64"))


def _instances():
    """Instances the offline compile check builds: every input type, both ranks and constructions."""
    natural_cmp = {"unsigned char": "long long", "unsigned short": "int", "short": "int",
                   "int": "long long", "cutopo::half": "float", "float": "float", "double": "double"}
    for in_ctype in sorted(set(_INPUT_CTYPE.values())):
        for ndim in (2, 3):
            for tconn in (False, True):
                yield histogram_instance(in_ctype, natural_cmp[in_ctype], "unsigned short", ndim, tconn)
                if ndim == 2:
                    rows = {tall_rows(d) for d, c in _INPUT_CTYPE.items() if c == in_ctype}
                    for r in sorted(rows - {0}):
                        yield histogram_instance(in_ctype, natural_cmp[in_ctype], "unsigned short", ndim,
                                                 tconn, r)
                yield contributions_instance(in_ctype, ndim, tconn)
                yield contributions_instance(in_ctype, ndim, tconn, periodic=True)
    yield histogram_instance("float", "double", "unsigned int", 3, False)
    yield histogram_instance("unsigned char", "unsigned long long", "unsigned short", 2, True)
    yield histogram_instance("unsigned short", "int", "unsigned int", 3, False)
    # The masked variant shares the sweeps above; one instance per sweep (packed 16-bit keys in
    # 2D and 3D, V and T; scalar 32-bit keys) keeps the compile check short.
    yield masked_histogram_instance("unsigned char", "long long", "unsigned short", 3, False)
    yield masked_histogram_instance("float", "float", "unsigned short", 3, True)
    yield masked_histogram_instance("float", "double", "unsigned int", 3, False)
    yield masked_histogram_instance("unsigned short", "int", "unsigned short", 2, True)
    yield CUMSUM.name
    for dtype in _INPUT_CTYPE:
        yield _range_sig(dtype).name


register_instances(FAMILY, _instances)


def _image_view(x):
    view = _INPUT_VIEW.get(x.dtype)
    return x.view(view) if view is not None else x


def _plan(sig, nimg, spatial, ndim, shared_mem, tile_x, tile_y=TILE_Y):
    """(zchunk, blocks_per_image): enough tiles to fill the device, bounded pixels per block."""
    nz, ny, nx = (1,) + tuple(spatial) if ndim == 2 else tuple(spatial)
    target = 2 * resident_blocks(sig, THREADS, shared_mem)
    tiles_yx = math.ceil(ny / tile_y) * math.ceil(nx / tile_x)
    zchunk = 1
    if ndim == 3:
        zchunk = int(np.clip((nz * tiles_yx * nimg) // target, 2, 64))
    tiles = tiles_yx * math.ceil(nz / zchunk)
    pixels = nz * ny * nx
    blocks = max(math.ceil(target / nimg), math.ceil(pixels / MAX_PIXELS_PER_BLOCK))
    return (nz, ny, nx), zchunk, max(1, min(tiles, blocks))


def chunk_length(cols, nz, slots, shortest=1):
    """Planes per 3D tile (at least ``shortest``) that minimise the sweep's cost in plane loads:
    (tiles x the planes each loads, two of them halo, plus a block's fixed cost of
    HIST_BLOCK_PLANES) / resident blocks, plus one tile's for the last wave's tail. ``cols``:
    tile columns (y-x tiles) over the batch."""
    per_tile = 2 + HIST_BLOCK_PLANES

    def cost(z):
        return cols * math.ceil(nz / z) * (z + per_tile) / slots + z + per_tile

    return min(range(shortest, max(shortest, min(HIST_ZCHUNK_MAX, nz)) + 1), key=cost)


def sweep_geometry(sig, nimg, spatial, ndim, shared_mem, tile_x, tile_y=TILE_Y):
    """A scalar sweep's ((nz, ny, nx), zchunk, blocks_per_image) (the soft ECC's, the ECT's
    orthant maps). 2D: _plan's. 3D: the chunk length of the histogram's cost model
    (chunk_length) and one tile per block up to HIST_WAVES_3D waves, so that the hardware
    balances the blocks, with enough blocks to keep each under MAX_PIXELS_PER_BLOCK pixels of
    whole tiles. _plan's two waves of blocks, each sweeping its tiles in turn, ran the soft
    ECC forward 9-15 % slower on smooth float32 volumes from 64^3 to 512^3 (2 planes per tile
    at 128^3 and 4 x 96^3, where the halo doubled the loads; 12 at 256^3, where 6 % of the
    blocks swept a second tile), 2 % in float64, the same on white noise; the soft backward's
    sweep 6 % slower, the 3D ECT 5-7 % and the soft ECT 1-4 % (H100, benchmarks/RESULTS.md,
    thirty-fifth session)."""
    if ndim == 2:
        return _plan(sig, nimg, spatial, ndim, shared_mem, tile_x, tile_y)
    nz, ny, nx = spatial
    slots = resident_blocks(sig, THREADS, shared_mem)
    cols = math.ceil(ny / tile_y) * math.ceil(nx / tile_x)
    zchunk = chunk_length(cols * nimg, nz, slots)
    tiles = cols * math.ceil(nz / zchunk)
    tiles_per_block = MAX_PIXELS_PER_BLOCK // (zchunk * tile_y * tile_x)
    blocks = max(math.ceil(HIST_WAVES_3D * slots / nimg), math.ceil(tiles / tiles_per_block))
    return (nz, ny, nx), zchunk, max(1, min(tiles, blocks))


def _histogram_geometry(sig, nimg, spatial, ndim, shared_mem, tile_x, tile_y=TILE_Y, itemsize=4):
    """The histogram kernel's ((nz, ny, nx), zchunk, blocks_per_image), as _plan's.

    Measured on the H200 (benchmarks/RESULTS.md, twenty-fourth session; 7-22 % less than
    _plan's two waves from 4096^2 and 512^3 up). 2D: up to HIST_WAVES_2D waves of blocks, but
    at least HIST_MIN_TILES_2D tiles per block (of 32 rows; of the tall tiles, 64-96 rows, one
    for images of ``itemsize`` 2 or more): every block ends with up to T global atomics, which
    one 32-row tile per block did not repay (2048^2). 3D: the chunk length z (planes per tile)
    that minimises (tiles x the planes each loads) / resident blocks + one tile's planes, a
    balance between the two planes of halo that every chunk loads (and a block's fixed cost,
    HIST_BLOCK_PLANES) and the last wave's tail; then about one tile per block, so that the
    hardware balances the blocks (the kernel's static tile-stride split left 5-10 % idle).
    """
    nz, ny, nx = (1,) + tuple(spatial) if ndim == 2 else tuple(spatial)
    slots = resident_blocks(sig, THREADS, shared_mem, PROFILE_OPTIONS)
    tiles_yx = math.ceil(ny / tile_y) * math.ceil(nx / tile_x)
    pixels = nz * ny * nx
    zchunk = 1
    if ndim == 2:
        # HIST_MIN_TILES_2D counts tiles of TILE_Y rows: a block of an image of 2 bytes or more
        # per pixel takes one tall tile (64 rows then, 80 now) where it took two of 32 (3-12 %
        # faster from 2048 x 4096 to 4096^2 and at 8 x 1024^2, float32 on the H100, thirty-third
        # session); one-byte images keep two tall tiles (96 rows now; one 64-row tile was 6-7 %
        # slower at 2048 x 4096 uint8, the fixed work of a block weighing more beside their
        # cheaper reads), and 32-row tiles keep two (one was 19-32 % slower at 2048^2).
        min_tiles = HIST_MIN_TILES_2D * TILE_Y // tile_y if itemsize > 1 else HIST_MIN_TILES_2D
        min_tiles = max(1, min_tiles)
        blocks = max(math.ceil(slots / nimg),
                     min(math.ceil(HIST_WAVES_2D * slots / nimg), tiles_yx // min_tiles))
    else:
        cols = tiles_yx * nimg
        zchunk = chunk_length(cols, nz, slots, 2)
        if cols * math.ceil(nz / zchunk) < 2 * slots:
            # Under two waves of such tiles (up to 256^3 here) the balance is another one: two
            # waves of shorter chunks measured 2-5 % faster (128^3, 300 x 200 x 100).
            return _plan(sig, nimg, spatial, ndim, shared_mem, tile_x, tile_y)
        blocks = math.ceil(HIST_WAVES_3D * slots / nimg)
    tiles = tiles_yx * math.ceil(nz / zchunk)
    blocks = max(blocks, math.ceil(pixels / MAX_PIXELS_PER_BLOCK))
    return (nz, ny, nx), zchunk, max(1, min(tiles, blocks))


def _uniform_estimate(t: np.ndarray, float_guess: bool | None = None):
    """(t0, 1/dt) when thresholds are close enough to evenly spaced for the O(1) bin guess:
    every t_k within dt/4 of t_0 + k dt.

    Guesses in float32 (``float_guess``; by default for float16 and float32 thresholds, which
    compare in float32) also need (|t_0| + |t_{T-1}|) / dt + T <= 2^21, those in float64
    <= 2^50: the guess's rounding errors (about 2^-24, 2^-53 times those magnitudes each)
    then stay below 1/4 bin, and the guess within one bin below the answer, which ecc.cu's
    ThresholdBins takes in one step, without a loop, for float32 and float64 comparisons:
    these conditions are what makes its bins exact. Float32 guesses also need dt >= 2^-100,
    so that a denormal value, which -ftz=true flushes to zero in the guess's arithmetic, moves
    it by far less than a bin, and their scale 1 / (T dt) a normal float32 (-ftz=true would
    flush it too: every guess 0); float64 guesses 1/dt a normal float64."""
    T = t.size
    if T < 3:
        return None
    tt = t.astype(np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        dt = (tt[-1] - tt[0]) / (T - 1)
        if not (dt > 0 and math.isfinite(dt)):  # a span beyond float64: no estimate
            return None
        if not np.max(np.abs(tt - (tt[0] + dt * np.arange(T)))) <= 0.25 * dt:
            return None
        in_float32 = (t.dtype.kind == "f" and t.dtype.itemsize <= 4) if float_guess is None else float_guess
        if (abs(tt[0]) + abs(tt[-1])) / dt + T > 2.0 ** (21 if in_float32 else 50):
            return None
        inv_dt = 1.0 / float(dt)  # a Python float: inf past the float64 range (a denormal dt)
        if not (math.isfinite(inv_dt) and inv_dt >= np.finfo(np.float64).tiny):
            return None
        if in_float32:
            scale = np.float32(inv_dt / T)
            if not (dt >= 2.0 ** -100 and np.isfinite(scale) and scale >= np.finfo(np.float32).tiny):
                return None
    return float(tt[0]), inv_dt


class HistogramPlan:
    """Everything one ECC launch needs that does not depend on the pixel values.

    Built once per (device, shape, dtype, thresholds, ndim, connectivity) and memoized, so a
    repeated call (a training loop, a benchmark) only allocates the output and launches.
    """

    def __init__(self, spatial, nimg, dtype, thresholds, ndim, tconn, masked=False):
        self.nimg, self.T = nimg, int(thresholds.size)
        T = self.T
        in_ctype = _INPUT_CTYPE[dtype]
        view = _INPUT_VIEW.get(dtype, dtype)
        cmp_ctype, table, estimate = histogram_bin_arguments(dtype, thresholds)
        key_ctype = histogram_key_ctype(T, cmp_ctype, table.nbytes,
                                        device_attribute("MaxSharedMemoryPerBlockOptin"))
        self.table = tables.upload(table)  # any stream reads it
        table_bytes = self.table.nbytes
        table_in_smem = threshold_table_in_shared(table_bytes, key_ctype, cmp_ctype)
        # The packed sweep adds into a shared histogram (one copy until its kernel is chosen,
        # then histogram_copies), the scalar one into the global histogram.
        packed = key_ctype == "unsigned short"
        copies = int(packed)
        self.shared_mem = histogram_shared_bytes(T, table_bytes, table_in_smem, copies)
        # masked: the per-axis masks; else the per-image counters and the cumulate flag
        tail = ("ptr:uint8",) * 3 if masked else ("ptr:uint32", "int32")
        params = ((f"ptr:{view}", f"ptr:{self.table.dtype}", "ptr:int64", "int64", "int64", "int64",
                   "int32", "int32", "int32", "int32", "float64", "float64", "int32", "int32") + tail)
        instance = masked_histogram_instance if masked else histogram_instance
        self.sig = Signature(FAMILY, instance(in_ctype, cmp_ctype, key_ctype, ndim, tconn), params)
        tile_y = TILE_Y
        rows = tall_rows(dtype)
        if not masked and ndim == 2 and key_ctype == "unsigned short" and rows:
            tall_y = rows * (THREADS // 32)
            tall_tiles = nimg * math.ceil(spatial[0] / tall_y) * math.ceil(spatial[1] / TILE_X[key_ctype])
            if tall_tiles >= HIST_TALL_MIN_TILES * resident_blocks(self.sig, THREADS, self.shared_mem,
                                                                  PROFILE_OPTIONS):
                tile_y = tall_y
                self.sig = Signature(FAMILY, histogram_instance(in_ctype, cmp_ctype, key_ctype, ndim, tconn,
                                                                rows), params)
        if packed:
            copies = histogram_copies(self.sig, T, table_bytes, table_in_smem)
            self.shared_mem = histogram_shared_bytes(T, table_bytes, table_in_smem, copies)
        self.copies = copies
        (nz, ny, nx), zchunk, per_image = _histogram_geometry(
            self.sig, nimg, spatial, ndim, self.shared_mem, TILE_X[key_ctype], tile_y,
            np.dtype(dtype).itemsize)
        block_pixels = nz * ny * nx / per_image
        self.cumulate = histogram_cumulation(copies, dtype, T, block_pixels)
        t0, inv_dt = estimate if estimate else (0.0, 0.0)
        self.histogram = PreparedLaunch(
            self.sig, nimg * per_image, THREADS,
            (None, self.table, None, nz, ny, nx, zchunk, per_image, T, int(estimate is not None), t0,
             inv_dt, int(table_in_smem), copies) + (None,) * len(tail),
            shared_mem=self.shared_mem, options=PROFILE_OPTIONS)
        self._cumulate = np.int32(self.cumulate)
        # per image, the counter of its blocks done (cumulate 1), kept per thread and stream
        self._counters = ZeroedWorkspaces(KEEP_COUNTER_BYTES)
        # add() passes no counters (the kernel does not touch them without cumulate)
        self._no_counters = None if masked else tables.upload(np.zeros(1, dtype=np.uint32))
        tables.retire_with(self, self.table, self._no_counters)  # its kernels may outlive it

    def __call__(self, x):
        """The ECC curves (nimg, T) int64 of the contiguous (nimg, *spatial) input ``x`` on the
        current device (ecc's, made there): one launch, whose blocks add their prefix sums, or
        whose last block per image makes that image's row cumulative (``self.cumulate`` 2 or 1,
        see BLOCK_PREFIX_MIN_PIXELS) with the plan's counters, which it leaves zeroed. The
        launch checks its arguments at its first call alone (call_checked_once): ``x`` has the
        plan's dtype and device, the rest is made here."""
        out = device_zeros((self.nimg, self.T), np.int64)
        counters = (self._counters.get("done", self.nimg, np.uint32) if self.cumulate == 1
                    else self._no_counters)
        self.histogram.call_checked_once(x, out, counters, self._cumulate)
        return out

    def add(self, x, hist):
        """Add the histogram (not cumulated) of the contiguous (nimg, *spatial) input ``x`` to
        ``hist`` (nimg, T) int64, on the current stream (plans built without ``masked``)."""
        self.histogram(x, hist, self._no_counters, 0)

    def add_masked(self, x, hist, own_z, own_y, own_x):
        """Add the contributions of the marked pixels of ``x`` to ``hist`` (nimg, T), on the
        current stream (plans built with ``masked=True``). own_*: uint8 device masks of lengths
        nz (1 in 2D), ny and nx; the histogram is not cumulated."""
        self.histogram(x, hist, own_z, own_y, own_x)


@functools.lru_cache(maxsize=64)
def _histogram_plan(device_id, spatial, nimg, dtype, thresholds_bytes, thresholds_dtype, ndim, tconn,
                    masked=False):
    thresholds = np.frombuffer(thresholds_bytes, dtype=thresholds_dtype)
    return HistogramPlan(spatial, nimg, dtype, thresholds, ndim, tconn, masked)


def histogram_plan(image, thresholds, ndim, tconn, masked=False) -> HistogramPlan:
    """The memoized plan for ``image``'s geometry (any object with shape and dtype)."""
    import cupy

    spatial = tuple(image.shape[-ndim:])
    nimg = math.prod(image.shape[:-ndim])
    return _histogram_plan(cupy.cuda.Device().id, spatial, nimg, np.dtype(image.dtype),
                           np.ascontiguousarray(thresholds).tobytes(), thresholds.dtype, ndim, tconn,
                           masked)


def masked_histogram(x, thresholds, ndim, tconn, own, hist) -> None:
    """Add the contributions of the owned pixels of the CuPy block ``x`` (*batch, *spatial) to
    ``hist`` (nimg, T) int64, on the current stream.

    ``own``: one 1-D bool/uint8 host or device mask per spatial axis; pixel p counts when every
    axis' mask is true at p's coordinate. The caller makes sure that every owned pixel has its
    whole 3^ndim neighbourhood inside ``x`` or beyond the volume's border (a one-pixel halo).
    """
    import cupy

    nimg = math.prod(x.shape[:-ndim])
    if nimg == 0 or any(not bool(np.any(m)) for m in own if isinstance(m, np.ndarray)):
        return
    view = _image_view(cupy.ascontiguousarray(x)).reshape((nimg,) + tuple(x.shape[-ndim:]))
    masks = [cupy.asarray(m).astype(np.uint8, copy=False) for m in own]
    if ndim == 2:
        masks = [cupy.ones(1, dtype=np.uint8)] + masks
    histogram_plan(x, thresholds, ndim, tconn, masked=True).add_masked(view, hist, *masks)


def _wrapped(image, ndim):
    """The torus complex's ECC through the box kernels: ``image`` padded by one wrapped pixel on
    each side of every spatial axis, and per axis the mask of the original pixels. A pixel's
    contribution depends only on its 3^ndim neighbourhood, which the padding gives it as the
    torus does. Each cell of the torus has copies in the padded box that differ by whole
    periods; the box's owner rule (value, then position in the padded array) is translation
    invariant, so it picks the same torus vertex in every copy, and exactly one copy has that
    vertex among the original pixels: every torus cell counts once. (Which pixel owns a cell
    whose vertices tie across the wrap can differ from the NumPy torus rule, which orders by
    the real linear index: the ECC agrees, the per-pixel contributions need not; the
    contribution-map kernel implements the torus rule itself.) Costs a copy of the image,
    ((n + 2) / n)^ndim times its size."""
    import cupy

    lead = image.ndim - ndim
    padded = cupy.pad(image, [(0, 0)] * lead + [(1, 1)] * ndim, mode="wrap")
    own = [np.r_[False, np.ones(n, dtype=bool), False] for n in image.shape[lead:]]
    return padded, own


def _key_value(key: int, dtype: np.dtype):
    """The value of an order key of finite_range (common.cuh order_key), a Python number."""
    if dtype.kind == "f":
        if dtype.itemsize == 8:
            bits = key & 0x7FFFFFFFFFFFFFFF if key >> 63 else ~key & 0xFFFFFFFFFFFFFFFF
            return float(np.uint64(bits).view(np.float64))
        bits = key & 0x7FFFFFFF if key >> 31 else ~key & 0xFFFFFFFF  # float16: as float32
        return float(np.uint32(bits).view(np.float32))
    offset = {np.dtype("int16"): 1 << 15, np.dtype("int32"): 1 << 31}.get(dtype, 0)
    value = key - offset
    return bool(value) if dtype == np.bool_ else value


def finite_range(image):
    """(lo, hi): the smallest and largest finite value of a non-empty CuPy image (a dtype of
    _INPUT_CTYPE), Python numbers, or None when no value is finite: one kernel over the image
    and one 16-byte read, no temporaries (ecc.cu, finite_range)."""
    import cupy

    with image.device:
        x = _image_view(cupy.ascontiguousarray(image)).reshape(-1)
        keys = cupy.zeros(2, dtype=np.uint64)
        sig = _range_sig(image.dtype)
        blocks = max(1, min(-(-x.nbytes // (THREADS * 32)), resident_blocks(sig, THREADS)))
        launch(sig, blocks, THREADS, (x, x.size, keys))
        not_lo, hi = (int(k) for k in keys.get())
    if not_lo == 0:
        return None
    return _key_value(~not_lo & 0xFFFFFFFFFFFFFFFF, image.dtype), _key_value(hi, image.dtype)


# A repeated call's plan (cutopo._cuda.repeated) by the image's shape and dtype on the current
# device, the static arguments and the thresholds as given (dtype and bytes: the plan's bins
# and the checks of cutopo.ecc depend on nothing else): a loop over images of one shape then
# skips ~10 us of checks and planning, most of a 1024^2 call's host time. Host thresholds of
# up to REPEATED_MAX_THRESHOLDS values only (their bytes are the key).
_REPEATED = RepeatedCalls()
REPEATED_MAX_THRESHOLDS = 4096


def clear_plans() -> None:
    """Forget every memoized histogram plan (tests and benchmarks that change how plans are
    made), those kept for repeated calls included."""
    _histogram_plan.cache_clear()
    _REPEATED.clear()


def repeated_key(image, thresholds, ndim, connectivity, boundary):
    """The key of an ecc call that _REPEATED may serve (a C-contiguous CuPy image on the
    current device, host thresholds given as a 1-D NumPy array, box boundary), or None."""
    if type(thresholds) is not np.ndarray or not 0 < thresholds.size <= REPEATED_MAX_THRESHOLDS:
        return None
    key = _REPEATED.key((image,), (ndim, connectivity, boundary))
    return None if key is None else key + (thresholds.dtype, thresholds.tobytes())


def repeated_ecc(key, image):
    """The curves of a call whose key a checked call kept (see ecc), or None."""
    planned = _REPEATED.get(key)
    if planned is None:
        return None
    plan, flat, shape = planned
    x = _image_view(image)
    out = plan(x if x.shape == flat else x.reshape(flat))
    return out if out.shape == shape else out.reshape(shape)


def ecc(image, thresholds, ndim, tconn, periodic=False, key=None):
    """The ECC curves of a checked CuPy image; ``key``: the call's repeated_key (or None),
    under which its plan is kept."""
    import cupy

    batch = image.shape[:-ndim]
    nimg = math.prod(batch)
    T = int(thresholds.size)
    with on_device_of(image):
        if nimg == 0:
            return cupy.zeros(batch + (T,), dtype=np.int64)
        if periodic:
            padded, own = _wrapped(image, ndim)
            hist = cupy.zeros((nimg, T), dtype=np.int64)
            masked_histogram(padded, thresholds, ndim, tconn, own, hist)
            return cupy.cumsum(hist, axis=1).reshape(batch + (T,))
        x = _image_view(as_c_contiguous(image))
        flat = (nimg,) + image.shape[-ndim:]
        plan = histogram_plan(image, thresholds, ndim, tconn)
        out = plan(x if x.shape == flat else x.reshape(flat))
    if key is not None and not periodic:
        _REPEATED.keep(key, (plan, flat, batch + (T,)))
    return out if out.shape == batch + (T,) else out.reshape(batch + (T,))


@functools.lru_cache(maxsize=64)
def _contributions_launch(device_id, dtype, nimg, spatial, ndim, tconn, periodic) -> PreparedLaunch:
    """The contribution-map launch for one geometry, planned once (called with (x, out))."""
    view = _INPUT_VIEW.get(dtype, dtype)
    sig = Signature(FAMILY, contributions_instance(_INPUT_CTYPE[dtype], ndim, tconn, periodic),
                    (f"ptr:{view}", "ptr:int8", "int64", "int64", "int64", "int32", "int32"))
    (nz, ny, nx), zchunk, per_image = _plan(sig, nimg, spatial, ndim, 0, TILE_X["unsigned int"])
    return PreparedLaunch(sig, nimg * per_image, THREADS,
                          (None, None, nz, ny, nx, zchunk, per_image))


def euler_contributions(image, ndim, tconn, periodic=False):
    """int8 c(p) of a CuPy image, equal to the NumPy path's (``periodic``: the torus complex,
    the same index tie-break across the wrap, every spatial axis >= 3)."""
    import cupy

    batch = image.shape[:-ndim]
    spatial = tuple(image.shape[-ndim:])
    nimg = math.prod(batch)
    with image.device:
        out = cupy.empty(image.shape, dtype=np.int8)
        if nimg == 0:
            return out
        x = _image_view(cupy.ascontiguousarray(image)).reshape((nimg,) + spatial)
        _contributions_launch(cupy.cuda.Device().id, image.dtype, nimg, spatial, ndim, tconn,
                              bool(periodic))(x, out)
    return out
