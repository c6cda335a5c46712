"""Threshold bins on the CPU: ``numpy.searchsorted(t, v, side)``, exactly, faster.

The NumPy paths bin every pixel against the sorted thresholds (the sublevel set at t_k is
{bin <= k}). ``searchsorted`` with unsorted needles does a binary search per value, one
mispredicted branch per level: about 50 ns per value for 256 thresholds, most of the NumPy
ECC's time. Here a uniform grid of buckets over [t_0, t_{T-1}] is computed with the same
float64 operations for the thresholds and for the values, so the bucket map b is
non-decreasing; a value v in bucket b then lies above every threshold of a lower bucket and
below every threshold of a higher one (v's bucket only ties with thresholds of its own), so
its bin is the first threshold of bucket b plus the number of bucket-b thresholds below v
(side "left"; at or below v for "right"): a few comparisons, vectorised. Thresholds crowded
into a few buckets (more than MAX_PER_BUCKET in one) fall back to ``searchsorted``.

Images of bool and 1- or 2-byte integers bin faster still (``value_bins``): a table of the bin
of every value of their dtype, made once per thresholds, then one gather per pixel (~8x less
time than converting the pixels to the thresholds' dtype and searching, on the build machine).
"""
from __future__ import annotations

import functools

import numpy as np

BUCKETS_PER_THRESHOLD = 4
MAX_PER_BUCKET = 8
CHUNK = 1 << 16        # values per pass: the temporaries stay in cache
MIN_THRESHOLDS = 16    # below this (or below MIN_VALUES values) searchsorted is as fast
MIN_VALUES = 1 << 12
# Images of 1- and 2-byte integers (and bool) bin through a table of the bin of every value of
# their dtype once they hold this many values (per table entry: 256 or 65536): a gather per
# pixel instead of a conversion to the thresholds' dtype and a search.
TABLE_MIN_VALUES_PER_ENTRY = 4


def threshold_bins(t: np.ndarray, v: np.ndarray, dtype=np.intp, side="left") -> np.ndarray:
    """``numpy.searchsorted(t, v, side=side)`` (v's shape) for thresholds ``t`` (1-D, sorted
    non-decreasing, finite) and values ``v`` of t's dtype (NaN allowed: bin t.size, as
    searchsorted sorts NaN last), as ``dtype`` (an integer type that holds t.size).
    side "left": the number of thresholds below each value; "right": at or below it."""
    T = t.size
    if T < MIN_THRESHOLDS or v.size < MIN_VALUES or t.dtype.kind not in "fiu" or v.dtype != t.dtype:
        return np.searchsorted(t, v, side=side).astype(dtype, copy=False)
    grid = _grid(t)
    if grid is None:
        return np.searchsorted(t, v, side=side).astype(dtype, copy=False)
    below = np.less if side == "left" else np.less_equal
    lo, scale, n_buckets, first, count, rounds = grid
    flat = v.reshape(-1)
    out = np.empty(flat.size, dtype=dtype)
    buf = np.empty(min(CHUNK, flat.size), dtype=np.float64)
    floating = t.dtype.kind == "f"
    for a in range(0, flat.size, CHUNK):
        part = flat[a:a + CHUNK]
        n = part.size
        x = buf[:n]
        x[...] = part                     # float64: exact for float32, monotone for the rest
        nan = np.isnan(x) if floating else None
        if nan is not None and nan.any():
            x[nan] = lo
        # Values far outside the thresholds' range may overflow to +-inf here: harmless, the
        # clip below sends them to the first or last bucket.
        with np.errstate(over="ignore"):
            np.subtract(x, lo, out=x)
            np.multiply(x, scale, out=x)
        np.floor(x, out=x)
        np.clip(x, 0, n_buckets - 1, out=x)
        b = x.astype(np.intp)
        k = first[b]
        end = k + count[b]
        for _ in range(rounds):           # thresholds of the bucket are sorted: k stops at the
            step = k < end                # first one not below the value
            step &= below(t[np.minimum(k, T - 1)], part)
            k += step
        if nan is not None:
            k[nan] = T
        out[a:a + n] = k
    return out.reshape(v.shape)


def _grid(t):
    """(lo, scale, buckets, first threshold per bucket, thresholds per bucket, most per
    bucket) of the thresholds' bucket grid, or None when searchsorted should do."""
    t64 = t.astype(np.float64)
    lo, hi = float(t64[0]), float(t64[-1])
    if not (np.isfinite(lo) and np.isfinite(hi)) or not hi > lo:
        return None
    n_buckets = BUCKETS_PER_THRESHOLD * t.size
    with np.errstate(over="ignore"):
        scale = n_buckets / (hi - lo)
    if not (np.isfinite(scale) and scale > 0):
        return None
    x = np.floor((t64 - lo) * scale)
    tb = np.clip(x, 0, n_buckets - 1).astype(np.intp)   # the values' map, term by term
    edges = np.arange(n_buckets)
    first = np.searchsorted(tb, edges, side="left")
    count = np.searchsorted(tb, edges, side="right") - first
    rounds = int(count.max())
    if rounds > MAX_PER_BUCKET:
        return None
    return lo, scale, n_buckets, first, count, rounds


def value_bins(t: np.ndarray, v: np.ndarray, dtype=np.intp) -> np.ndarray:
    """``numpy.searchsorted(t, v.astype(t.dtype), "left")`` (v's shape) as ``dtype``: the bins
    of image values ``v`` against thresholds ``t`` in the comparison dtype (sorted, finite).

    bool and 1- or 2-byte integer values (native byte order), when there are at least
    TABLE_MIN_VALUES_PER_ENTRY per possible value, index a table of every value's bin (made by
    threshold_bins, memoized for the last few thresholds); the rest go through threshold_bins."""
    kind, size = v.dtype.kind, v.dtype.itemsize
    if kind in "biu" and size <= 2 and v.dtype.isnative:
        unsigned = np.dtype(f"u{size}")
        entries = 2 if kind == "b" else 1 << (8 * size)
        if v.size >= TABLE_MIN_VALUES_PER_ENTRY * entries:
            table = _value_table(t.tobytes(), t.dtype.str, v.dtype.str, np.dtype(dtype).str)
            return np.take(table, v.view(unsigned))
    return threshold_bins(t, v.astype(t.dtype, copy=False), dtype)


@functools.lru_cache(maxsize=8)
def _value_table(t_bytes: bytes, t_dtype: str, v_dtype: str, dtype: str) -> np.ndarray:
    """The bin of every value of ``v_dtype``, indexed by its bits read as unsigned (bool: 0, 1;
    int8 / int16: the two's-complement bits); read-only."""
    t = np.frombuffer(t_bytes, dtype=t_dtype)
    vd = np.dtype(v_dtype)
    every = (np.array([False, True]) if vd.kind == "b"
             else np.arange(1 << (8 * vd.itemsize), dtype=f"u{vd.itemsize}").view(vd))
    table = threshold_bins(t, every.astype(t.dtype), np.dtype(dtype))
    table.flags.writeable = False
    return table
