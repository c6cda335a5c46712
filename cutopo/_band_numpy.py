"""Band-limited sigmoid sums on the CPU, shared by soft_ecc and soft_ect (their NumPy paths).

Both relax a step curve into rows of curve[row, k] = sum_p c_p sigmoid(scale (t_k - f_p)) over
pixels p (a row is an image, or an (image, direction) pair; f_p a value or a height). Only the
thresholds inside a band around each f_p are evaluated: outside it sigmoid is exactly 0 or 1 in
the computation dtype, and the saturated ones are added exactly through a difference array
over the thresholds (ecc.md 5.8), as the CUDA kernels of ``cuda_src/ecc_band.cuh`` do.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ._bins import threshold_bins

# Band half-width B in units of scale * (t - f). sigma(B) rounds to exactly 1 in the dtype
# (e^-B is below half the machine epsilon: e^-37 = 8.5e-17 < 1.1e-16, e^-17 = 4.1e-8 < 6.0e-8),
# so treating |u| >= B as saturated is invisible at the dtype's resolution near 1.
_BAND = {np.dtype(np.float64): 37.0, np.dtype(np.float32): 17.0}

# Band entries (pixel, threshold) evaluated per chunk; about ten temporaries of 8 bytes each.
_CHUNK_ENTRIES = 1 << 19


def band_halfwidth(dtype, scale) -> float:
    """w = B / scale widened by 2^-40 (past the rounding of the division), inf on overflow.

    Every backend of the soft ops takes its band edges f -+ w from this value.
    """
    # Python floats are IEEE doubles, as np.float64 is (the same result, bit for bit), and
    # overflow to inf without a warning; numpy scalars cost microseconds per call here.
    return float(_BAND[np.dtype(dtype)]) / float(scale) * (1.0 + 2.0 ** -40)


class Bands(NamedTuple):
    """The pixels that matter (c != 0, f neither NaN nor +inf) and their bands."""
    row: np.ndarray     # curve row of each pixel, non-decreasing
    c: np.ndarray       # contribution, float64
    f: np.ndarray       # value, computation dtype
    lo: np.ndarray      # first threshold index inside the band
    hi: np.ndarray      # first threshold index above the band (sigmoid counted as 1 from here)


def _outward(x, direction, steps=2):
    for _ in range(steps):
        x = np.nextafter(x, direction)
    return x


def bands(row, c, f, t, w) -> Bands:
    """The band edges [lo, hi) of pixels with contributions ``c`` (float64) and values ``f``
    (the computation dtype, finite or -inf) against thresholds ``t``, half-width ``w``."""
    # Band edges in float64, where t, f and scale are exact. Exactly, u = scale * (t - f) >= B
    # iff t >= f + B / scale; the edges are pushed outwards past the rounding of B / scale and
    # of the sum, so every threshold left out of [lo, hi) has |u| >= B exactly.
    T = t.size
    f64 = f.astype(np.float64)
    t64 = t.astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):  # an edge past +-max is +-inf: outward still
        lo_edge = _outward(f64 - w, -np.inf)
        hi_edge = _outward(f64 + w, np.inf)
    lo = threshold_bins(t64, lo_edge, side="right")  # t_k <= lo_edge  =>  u <= -B
    hi = threshold_bins(t64, hi_edge, side="left")   # t_k >= hi_edge  =>  u >= B
    neg_inf = f64 == -np.inf                          # sigmoid(+inf) = 1 at every threshold
    lo[neg_inf] = 0
    hi[neg_inf] = 0
    hi = np.minimum(hi, T)
    lo = np.minimum(lo, hi)
    return Bands(row, c, f, lo, hi)


class _Chunk(NamedTuple):
    """Band entries (pixel, threshold) of a run of consecutive pixels, pixel-major.

    ``sel`` indexes the pixels (into :class:`Bands`), ``ln`` their band lengths (all > 0),
    ``starts`` the first entry of each pixel, ``k`` the threshold index of every entry and
    ``arange`` the entry numbers 0, 1, ..., total - 1.
    """
    sel: np.ndarray
    ln: np.ndarray
    starts: np.ndarray
    k: np.ndarray
    arange: np.ndarray

    def expand(self, per_pixel):
        """A per-pixel array (already restricted to ``sel``) repeated over the entries."""
        return np.repeat(per_pixel, self.ln)


def _chunks(b: Bands, limit: int):
    """Yield the band entries as :class:`_Chunk` of about ``limit`` entries (at least one band).

    A pixel's band is never split, so every pixel of a chunk appears in no other chunk.
    """
    lens = b.hi - b.lo
    banded = np.flatnonzero(lens)
    if banded.size == 0:
        return
    cum = np.cumsum(lens[banded])
    a, n = 0, banded.size
    while a < n:
        base = cum[a - 1] if a else 0
        e = max(a + 1, int(np.searchsorted(cum, base + limit, side="right")))
        sel = banded[a:e]
        ln = lens[sel]
        total = int(cum[e - 1] - base)
        starts = np.cumsum(ln) - ln
        arange = np.arange(total)
        k = arange + np.repeat(b.lo[sel] - starts, ln)
        yield _Chunk(sel, ln, starts, k, arange)
        a = e


def _sigmoid_parts(u, derivative):
    """sigmoid(u), or sigmoid'(u) = s (1 - s) when ``derivative``, without cancellation."""
    e = np.exp(-np.abs(u))
    r = 1 / (1 + e)
    if derivative:
        e *= r
        e *= r
        return e
    return np.where(u >= 0, r, e * r)


def forward(b: Bands, t, scale, rows) -> np.ndarray:
    """The (rows, T) float64 curves: saturated part, then the band entries."""
    T = t.size
    # Saturated part: c counts as 1 from threshold hi on (difference array + prefix sum).
    diff = np.bincount(b.row * (T + 1) + b.hi, weights=b.c, minlength=rows * (T + 1))
    out = np.cumsum(diff.reshape(rows, T + 1)[:, :T], axis=1)
    # Band part: the true sigmoid on [lo, hi), accumulated over the rows the chunk touches.
    for ch in _chunks(b, _CHUNK_ENTRIES):
        row = b.row[ch.sel]
        row0, n = int(row[0]), int(row[-1] - row[0]) + 1
        u = t[ch.k]
        u -= ch.expand(b.f[ch.sel])
        u *= scale
        weights = _sigmoid_parts(u, False) * ch.expand(b.c[ch.sel])
        where = ch.arange + ch.expand((row - row0) * T + b.lo[ch.sel] - ch.starts)
        acc = np.bincount(where, weights=weights, minlength=n * T)
        out[row0:row0 + n] += acc.reshape(n, T)
    return out


def backward(b: Bands, t, scale, g, need_f, need_t, need_scale):
    """(d_f per pixel float64 or None, d_t (T,) float64 or None, d_scale float) of the curves
    of :func:`forward` against their cotangent ``g`` (rows * T, flat, computation dtype). The
    saturated part depends on nothing continuous: only band entries contribute."""
    T = t.size
    lam = float(scale)
    d_f = np.zeros(b.f.size, dtype=np.float64) if need_f else None
    d_t = np.zeros(T, dtype=np.float64) if need_t else None
    d_scale = 0.0
    for ch in _chunks(b, _CHUNK_ENTRIES):
        diff_tf = t[ch.k]
        diff_tf -= ch.expand(b.f[ch.sel])          # t_k - f(p)
        w = _sigmoid_parts(scale * diff_tf, True)  # sigma'_pk
        w = w * ch.expand(b.c[ch.sel])             # float64 from here
        w *= g[ch.arange + ch.expand(b.row[ch.sel] * T + b.lo[ch.sel] - ch.starts)]
        if need_f:  # every band of the chunk is non-empty and contiguous
            d_f[ch.sel] = -lam * np.add.reduceat(w, ch.starts)
        if need_t:
            d_t += lam * np.bincount(ch.k, weights=w, minlength=T)
        if need_scale:
            d_scale += float(np.dot(w, diff_tf))
    return d_f, d_t, d_scale
