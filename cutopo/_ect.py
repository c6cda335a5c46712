"""Euler characteristic transform (ECT) of binary 2D/3D images: exact, and soft (differentiable).

The ECT of a mask in direction v is the Euler characteristic curve of the mask's foreground
filtered by the height h_v(p) = <x_p, v> of its pixel positions. Both ops decompose it into
per-pixel contributions (ecc.md 5.2, 5.3): ECT(v, t) = sum_p c_v(p) [h_v(p) <= t].

* V construction (``connectivity=1``): a cell's height is the max over its vertices, which is
  attained at the corner that matches sign(v), so c_v depends only on the orthant of v (the
  Eucalc precomputation, ecc.md 5.7). One contribution pass per orthant serves every direction
  in it; per direction only the pixels with c != 0 (boundary pixels) are histogrammed.
* T construction (``connectivity=ndim``): the owner of a lower cell is its lowest adjacent
  pixel, which depends on the magnitudes of v, so c_v is recomputed for every direction.

NumPy path here; CuPy masks go to :mod:`cutopo._band_cupy` (the same contribution maps, computed
by the kernels of ``cuda_src/ecc.cu``, then per-direction kernels over the critical pixels).
"""
from __future__ import annotations

import functools
import math
import operator
from typing import NamedTuple

import numpy as np

from . import _band_cupy, _band_numpy, _stream
from ._array import as_array, is_cupy_array, to_numpy
from ._band_numpy import band_halfwidth
from ._bins import threshold_bins
from ._checks import (check_boundary, check_connectivity, check_count, check_result_memory,
                      check_scale, check_threshold_array, check_thresholds, evenly_spaced,
                      is_count, same_array_type, scale_lambda)
from ._cuda.deferred import reading
from ._cuda.launch import as_c_contiguous, on_device_of
from ._cuda.repeated import RepeatedCalls
from ._ecc_numpy import contributions_from_keys, order_keys
from .vjp import register

__all__ = ["ect", "soft_ect", "heights"]

# Elements per contribution pass (mask pixels x images x directions) by default; bounds the
# memory of contributions_from_keys' inputs and of the entries (it tiles its own temporaries).
# A streamed slab passes a smaller bound, scaled with its budget (see cutopo._stream.ect).
_PASS_ELEMENTS = 1 << 21
# Entries (critical pixel x direction) per step (soft_ect's band entries are chunked by
# cutopo._band_numpy).
_ENTRIES = 1 << 20

_FLOAT64_PROBE = np.empty(0, dtype=np.float64)


# ---------------------------------------------------------------------------------------------
# Positions and heights


def _axis_coordinates(shape):
    """See _coordinates_of (memoized per shape)."""
    return _coordinates_of(tuple(int(n) for n in shape))


@functools.lru_cache(maxsize=64)
def _coordinates_of(shape):
    """Per-axis float64 positions: x_a(i) = (2 i - (n_a - 1)) / (max_b n_b - 1), 0 if all n are 1.

    Numerator and denominator are exact integers, so each coordinate is one correctly rounded
    division: non-decreasing in i, exactly antisymmetric (x(n - 1 - i) = -x(i)), and +-1 at
    both ends of the longest axis. Memoized per shape (a tuple of read-only arrays): every
    call of an ECT op needs them.
    """
    m = max(shape)
    out = []
    for n in shape:
        num = 2.0 * np.arange(n, dtype=np.float64) - float(n - 1)
        x = num / float(m - 1) if m > 1 else num
        x.flags.writeable = False
        out.append(x)
    return tuple(out)


def _height_sum(xs, vs):
    """x_0 * v_0 + x_1 * v_1 (+ x_2 * v_2) in float64, left to right (broadcasting)."""
    h = xs[0] * vs[0]
    for x, v in zip(xs[1:], vs[1:]):
        h = h + x * v
    return h


def _heights_from_coordinates(coords, v):
    ndim = len(coords)
    xs = [c.reshape((-1,) + (1,) * (ndim - 1 - a)) for a, c in enumerate(coords)]
    return _height_sum(xs, [v[a] for a in range(ndim)])


def heights(shape, v):
    """Height h(p) = <x_p, v> of every pixel position of a grid, as :func:`ect` computes it.

    Parameters
    ----------
    shape : tuple of 2 or 3 positive ints
        Spatial shape of the grid.
    v : array-like, shape (len(shape),)
        Direction, components in array-axis order (not normalised).

    Returns
    -------
    h : ndarray of float64, shape ``shape``
        ``x_0 * v_0 + x_1 * v_1 (+ x_2 * v_2)`` evaluated in float64, left to right, with the
        positions x of the Convention of :func:`ect`.

    Examples
    --------
    >>> from cutopo._ect import heights
    >>> heights((3, 2), [1.0, 0.0])
    array([[-1., -1.],
           [ 0.,  0.],
           [ 1.,  1.]])
    >>> heights((3, 2), [0.0, 1.0])
    array([[-0.5,  0.5],
           [-0.5,  0.5],
           [-0.5,  0.5]])
    """
    shape = tuple(operator.index(n) for n in shape)
    if len(shape) not in (2, 3) or any(n < 1 for n in shape):
        raise ValueError(f"shape must hold 2 or 3 positive lengths, got {shape}")
    v = np.asarray(v, dtype=np.float64)
    if v.shape != (len(shape),):
        raise ValueError(f"v must have shape ({len(shape)},), got {v.shape}")
    return _heights_from_coordinates(_axis_coordinates(shape), v)


def check_heights_finite(coords, dirs):
    """ValueError when a pixel height <x_p, v> of some direction overflows float64.

    Every position lies in [-1, 1], so |h| <= sum_a |v_a| (plus the roundings of at most three
    products and two sums): below 1e300 nothing overflows and the exact search (_reach) is
    skipped."""
    with np.errstate(over="ignore", invalid="ignore"):
        bound = float(np.abs(dirs).sum(axis=1).max())
    if bound <= 1e300:
        return
    reach, _, _ = _reach(coords, dirs)
    if not math.isfinite(reach):
        raise ValueError("directions: too large, the pixel heights overflow float64")


def _reach(coords, dirs):
    """(R, d, dR/dv_d): R = max over directions and pixel positions of |h|, d the first direction
    where it is attained.

    By the monotonicity of the computed heights (see _orthant_contributions) the maximum of h over
    the grid is at the corner matching sign(v) and the minimum at the opposite corner.
    """
    ndim = len(coords)
    pos = dirs >= 0
    hi = [np.where(pos[:, a], coords[a][-1], coords[a][0]) for a in range(ndim)]
    lo = [np.where(pos[:, a], coords[a][0], coords[a][-1]) for a in range(ndim)]
    vs = [dirs[:, a] for a in range(ndim)]
    with np.errstate(over="ignore", invalid="ignore"):
        hmax = _height_sum(hi, vs)
        hmin = _height_sum(lo, vs)
        r = np.maximum(hmax, -hmin)
    d = int(np.argmax(r))
    corner = hi if hmax[d] >= -hmin[d] else [-x for x in lo]
    return float(r[d]), d, np.array([x[d] for x in corner], dtype=np.float64)


# ---------------------------------------------------------------------------------------------
# Validation


def _check_directions(directions):
    if is_cupy_array(directions):
        d = directions
        host = to_numpy(directions)
    else:
        d = host = as_array(directions, "directions")  # NumPy, native byte order
    if d.dtype.kind not in "iuf":
        raise TypeError(f"directions: dtype {d.dtype} is not a real number type")
    if d.ndim != 2 or d.shape[1] not in (2, 3):
        raise ValueError("directions must have shape (D, ndim) with ndim 2 or 3, got shape "
                         f"{d.shape}")
    if d.shape[0] == 0:
        raise ValueError(f"directions must hold at least one direction (got shape {d.shape})")
    d64 = host.astype(np.float64)
    if not np.all(np.isfinite(d64)):
        raise ValueError("directions must be finite (found NaN or inf)")
    zero = np.flatnonzero(~np.any(d64 != 0, axis=1))
    if zero.size:
        raise ValueError(f"directions: row {int(zero[0])} is zero; every direction needs a "
                         "non-zero component")
    return d, d64


def _check_mask(mask, ndim):
    mask = as_array(mask, "mask")
    if mask.dtype.kind in "iu":
        mask = mask != 0
    elif mask.dtype.kind != "b":
        raise TypeError(f"mask: dtype {mask.dtype} is not bool or integer")
    if mask.ndim < ndim:
        raise ValueError(f"mask: directions have {ndim} components, so mask needs {ndim} spatial "
                         f"axes (shape (*batch, *spatial)), got shape {mask.shape}")
    spatial = mask.shape[mask.ndim - ndim:]
    if any(n == 0 for n in spatial):
        raise ValueError(f"mask: spatial shape {spatial} has a zero-length axis")
    return mask


def _check_thresholds(thresholds, coords, dirs64):
    """(float64 thresholds, count or None)."""
    if is_count(thresholds):
        n = check_count(thresholds)
        reach, _, _ = _reach(coords, dirs64)
        return evenly_spaced(-reach, reach, n), n  # linspace, also where 2 R overflows
    t, _ = check_thresholds(thresholds, _FLOAT64_PROBE)
    return t, None


def _prepare(op, mask, directions, thresholds, connectivity):
    same_array_type(mask, [("directions", directions), ("thresholds", thresholds)],
                    anchor_name="mask", op=op)
    directions, dirs64 = _check_directions(directions)
    ndim = dirs64.shape[1]
    mask = _check_mask(mask, ndim)
    tconn = check_connectivity(connectivity, ndim)
    spatial = mask.shape[mask.ndim - ndim:]
    batch = mask.shape[:mask.ndim - ndim]
    coords = _axis_coordinates(spatial)
    check_heights_finite(coords, dirs64)
    t, count = _check_thresholds(thresholds, coords, dirs64)
    mask_b = mask.reshape((math.prod(batch),) + spatial)
    if is_cupy_array(mask_b):
        import cupy

        mask_b = cupy.ascontiguousarray(mask_b)
    return directions, dirs64, mask_b, batch, spatial, coords, tconn, t, count


# ---------------------------------------------------------------------------------------------
# Contribution maps and the entries (critical pixel, direction) they produce


class _Chunk(NamedTuple):
    """Entries of the directions ``ids`` on the images b0 .. b0 + nb - 1 of the batch.

    Entry e belongs to direction ids[row // nb] and image b0 + row % nb; ``row`` is
    non-decreasing. ``c`` is the (non-zero) contribution, ``h`` the float64 height and ``x``
    the position (one array per axis) of the entry's pixel.
    """
    b0: int
    nb: int
    ids: np.ndarray
    row: np.ndarray
    c: np.ndarray
    h: np.ndarray
    x: tuple


def _orthant_contributions(part, positive):
    """c_o of the V construction for the orthant ``positive`` (bool per axis: v_a >= 0).

    Why c_o serves every direction v of the orthant *exactly*: the computed height of a pixel is
    fl(fl(x_0 v_0) + fl(x_1 v_1)) (+ fl(x_2 v_2) in 3D), and every step is monotone, because
    rounding to nearest is monotone: x_a(i) is non-decreasing in i (_axis_coordinates),
    fl(x v_a) is non-decreasing in x for v_a >= 0 (including -0.0, where all products are zero)
    and non-increasing for v_a < 0, and fl(a + b) is non-decreasing in a and in b. Hence among
    the vertices of a cell, the corner that takes the upper end of every axis where v_a >= 0 and
    the lower end where v_a < 0 has a computed height >= that of every other vertex (ties
    allowed). The height of the cell in the V construction of where(mask, h, inf), the max over
    its vertices, is therefore the computed height of that corner, and summing (-1)^dim over the
    cells by their corner gives ecc(where(mask, h, inf))(t) = sum_p c_o(p) [h(p) <= t] with the
    same float64 h, exactly.

    The keys below make that corner the strict key-maximum of every cell (key differences along
    a cell are sums of +1 steps), so it owns the cell; non-mask pixels get a key above all mask
    keys, so cells touching them are owned by non-mask pixels, whose c is then discarded.
    """
    spatial = part.shape[1:]
    ndim = len(spatial)
    big = sum(n - 1 for n in spatial) + 1
    kt = np.int32 if big + 1 <= np.iinfo(np.int32).max else np.int64  # narrow keys: less memory
    key = np.zeros(spatial, dtype=kt)
    for a, n in enumerate(spatial):
        i = np.arange(n, dtype=kt)
        if not positive[a]:
            i = (n - 1) - i
        key = key + i.reshape((-1,) + (1,) * (ndim - 1 - a))
    keys = np.where(part, key, kt(big))
    del key
    c = contributions_from_keys(keys, ndim, False, kt(big + 1))
    c *= part
    return c


def _owned(part, own):
    """``part`` (nb, *spatial) bool, cleared outside the pixels that ``own`` (one bool mask per
    spatial axis, or None) marks: a block's halo pixels are neighbours only."""
    if own is None:
        return part
    ndim = part.ndim - 1
    out = part
    for a, m in enumerate(own):
        out = out & np.asarray(m, dtype=bool).reshape((1,) * (a + 1) + (-1,) + (1,) * (ndim - 1 - a))
    return out


def _entries_v(part, b0, dirs, coords, own=None, pass_elements=None):
    nb = part.shape[0]
    spatial = part.shape[1:]
    ndim = len(spatial)
    N = math.prod(spatial)
    positive = dirs >= 0  # v_a = 0 (and -0.0) counts as +
    codes = positive.astype(np.int64) @ (1 << np.arange(ndim, dtype=np.int64))
    for code in np.unique(codes):
        dir_ids = np.flatnonzero(codes == code)
        c = _orthant_contributions(part, positive[dir_ids[0]])
        if own is not None:
            c *= _owned(part, own)
        c = c.reshape(-1)
        flat = np.flatnonzero(c)
        if flat.size == 0:
            continue
        cval = c[flat]
        del c
        b_local, lin = np.divmod(flat, N)
        del flat
        idx = np.unravel_index(lin, spatial)
        del lin
        xs = [coords[a][idx[a]] for a in range(ndim)]
        del idx
        n0 = cval.size
        limit = min(_ENTRIES, pass_elements or _ENTRIES)
        step = max(1, limit // n0)
        # With a pass bound (a streamed slab), the entries of one direction are split too.
        span = min(n0, limit) if pass_elements else n0
        for j in range(0, dir_ids.size, step):
            ids = dir_ids[j:j + step]
            k = ids.size
            v = dirs[ids]
            for p0 in range(0, n0, span):
                sel = slice(p0, p0 + span)
                xp = [x[sel] for x in xs]
                # Same float64 operations, in the same order, as heights(): equal bits.
                h = _height_sum([x[None, :] for x in xp], [v[:, a, None] for a in range(ndim)])
                row = (np.arange(k, dtype=np.int64)[:, None] * nb + b_local[None, sel]).reshape(-1)
                yield _Chunk(b0, nb, ids, row, np.tile(cval[sel], k), h.reshape(-1),
                             tuple(np.tile(x, k) for x in xp))
        cval = b_local = xs = xp = h = row = None  # freed before the next orthant's pass


def _entries_t(part, b0, dirs, coords, own=None, periodic=False, tconn=True, wrap0=None,
               pass_elements=None):
    """Entries from one contribution pass per direction, under the value order of the heights
    (T construction; also the V construction on the torus, where no corner is the maximum of
    every cell)."""
    nb = part.shape[0]
    spatial = part.shape[1:]
    ndim = len(spatial)
    N = math.prod(spatial)
    D = dirs.shape[0]
    step = max(1, (pass_elements or _PASS_ELEMENTS) // (nb * N))
    for j in range(0, D, step):
        ids = np.arange(j, min(D, j + step))
        k = ids.size
        H = np.stack([_heights_from_coordinates(coords, dirs[d]) for d in ids])
        vals = np.where(part[None], H[:, None], np.inf).reshape((k * nb,) + spatial)
        keys, outside = order_keys(vals)
        del vals
        c = contributions_from_keys(keys, ndim, tconn, outside, periodic, wrap0).reshape(k, nb, N)
        del keys
        c *= _owned(part, own).reshape(1, nb, N)  # non-mask pixels (h = inf) never enter
        c = c.reshape(-1)
        flat = np.flatnonzero(c)
        cval = c[flat]
        del c
        row, lin = np.divmod(flat, N)
        del flat
        h = H.reshape(k, N)[row // nb, lin]
        del H
        idx = np.unravel_index(lin, spatial)
        del lin
        x = tuple(coords[a][idx[a]] for a in range(ndim))
        del idx
        yield _Chunk(b0, nb, ids, row, cval, h, x)
        row = cval = h = x = None  # freed before the next pass


def _entries(mask_b, dirs, coords, tconn, own=None, periodic=False, wrap0=None, general=False,
             pass_elements=None):
    """All entries, chunked over images and directions so that memory stays bounded.

    ``own``: count only the pixels marked by these per-axis masks (a block with its halo).
    ``periodic``: the torus complex (every construction then takes the per-direction pass);
    ``wrap0``: see :func:`cutopo._ecc_numpy.contributions_from_keys` (streamed slabs).
    ``general``: ``coords`` are not increasing along their axes (a block padded with wrapped
    copies carries the coordinates of the pixels it copies), so no corner of a cell is known
    to be its highest: the V construction takes the per-direction pass too.
    ``pass_elements``: the bound of a pass (images x pixels x directions, and entries per
    chunk; at least one image and one direction), default :data:`_PASS_ELEMENTS`.
    """
    B = mask_b.shape[0]
    N = math.prod(mask_b.shape[1:])
    step = max(1, (pass_elements or _PASS_ELEMENTS) // N)
    for b0 in range(0, B, step):
        part = mask_b[b0:b0 + step]
        if tconn or periodic or general:
            yield from _entries_t(part, b0, dirs, coords, own, periodic, tconn, wrap0,
                                  pass_elements)
        else:
            yield from _entries_v(part, b0, dirs, coords, own, pass_elements)


def curves(mask_b, dirs64, coords, t, tconn, own=None, periodic=False, wrap0=None, general=False,
           pass_elements=None):
    """int64 (B, D, T) exact ECT of the NumPy masks ``mask_b`` (B, *spatial) at the positions
    ``coords`` (one array per axis), counting only the pixels that ``own`` marks (``general``,
    ``pass_elements``: see :func:`_entries`).

    The ECT is linear in the contributions, so the curves of the blocks of a volume (each with
    its halo, owning disjoint pixels, at the volume's positions) add up to the volume's.
    """
    B, D, T = mask_b.shape[0], dirs64.shape[0], t.size
    check_result_memory((B, D), (T,), 16)  # histograms, curves
    hist = np.zeros((B, D, T + 1), dtype=np.int64)
    for ch in _entries(mask_b, dirs64, coords, tconn, own, periodic, wrap0, general,
                       pass_elements):
        k = ch.ids.size
        # bin = first k with h <= t_k (T when none): the pixel counts from threshold k on.
        bins = threshold_bins(t, ch.h)
        local = np.bincount(ch.row * (T + 1) + bins, weights=ch.c, minlength=k * ch.nb * (T + 1))
        local = np.rint(local).astype(np.int64).reshape(k, ch.nb, T + 1)
        hist[ch.b0:ch.b0 + ch.nb, ch.ids] += local.transpose(1, 0, 2)
    return np.cumsum(hist[..., :T], axis=-1)


# ---------------------------------------------------------------------------------------------
# Exact ECT


def ect(mask, directions, thresholds, *, connectivity=1, boundary="box", device=None,
        max_slab_bytes=None):
    """Exact Euler characteristic transform of the foreground of binary 2D/3D images.

    Entry (d, k) of the result is the Euler characteristic of
    ``{p in mask : h_d(p) <= thresholds[k]}`` with the height ``h_d(p) = <x_p, directions[d]>``
    of the pixel position x_p (see Convention), for every image of the batch. It equals
    ``cutopo.ecc(numpy.where(mask, heights(spatial, v), numpy.inf), thresholds, ndim=ndim,
    connectivity=connectivity)`` for every direction v, exactly.

    Parameters
    ----------
    mask : ndarray, shape (*batch, *spatial)
        NumPy or CuPy array of dtype bool, or integer (non-zero is foreground). The last
        ``ndim`` axes are spatial, where ``ndim = directions.shape[1]``; leading axes are a
        batch. A CuPy mask runs on its GPU (``directions`` and ``thresholds`` may then be
        host or device arrays; with a NumPy mask they must be host arrays).
    directions : array-like, shape (D, ndim)
        Finite, real directions with no zero row, ndim 2 or 3, components in array-axis
        order. Used as given, not normalised: unit rows give the usual ECT; the scale of a row
        scales its heights.
    thresholds : int or 1-D array
        Sorted (non-decreasing), finite threshold values (compared as ``h <= t`` in float64),
        or a count ``n`` meaning ``numpy.linspace(-R, R, n)``, where R is the largest ``|h|``
        that any pixel position of the grid (foreground or not) reaches over the given
        directions (so for n >= 2 the last threshold counts every foreground pixel; n = 1 gives
        ``[-R]``, as ``linspace`` does). One threshold array serves every direction and image.
    connectivity : {1, ndim}, optional
        ``1``: V construction, pixels are vertices and a cell's height is the max of its
        vertices' heights (4-connected foreground in 2D, 6-connected in 3D). ``ndim``: T
        construction, pixels are closed squares/cubes and a lower cell takes the min over the
        pixels around it (8- / 26-connected). As for :func:`cutopo.ecc`.
    boundary : {"box", "periodic"}, optional
        ``"box"`` (default): positions outside the image are empty. ``"periodic"``: the
        cubical complex of the torus, as for :func:`cutopo.ecc` (every spatial axis >= 3): the
        result equals ``cutopo.ecc(numpy.where(mask, heights(spatial,
        v), numpy.inf), thresholds, ndim=ndim, connectivity=connectivity, boundary="periodic")``
        for every direction v. The pixel positions (and so the heights) are those of the box;
        a cell that spans the wrap takes the max (V) or min (T) of its pixels' heights. Every
        direction then takes a full contribution pass (no corner is the maximum of every
        cell on the torus).
    device : {None, "cpu", "cuda"}, optional
        As for :func:`cutopo.ecc`: ``"cuda"`` streams a host mask through the current GPU.
    max_slab_bytes : int, optional
        As for :func:`cutopo.ecc`: streamed host masks (``numpy.memmap``, Zarr arrays and
        other array-likes with ``shape``, ``dtype`` and slicing; NumPy arrays with
        ``device="cuda"`` or with this bound) are read in slabs of planes along the first
        spatial axis with a one-plane halo, and every slab's positions are its positions in
        the volume, so the result equals the in-memory one exactly. A slab takes at most
        this many bytes, counted as 48 bytes per pixel on the CPU and 64 on the GPU (the
        contribution passes' temporaries), and each of its contribution passes works on at
        most ``max_slab_bytes / 96`` (CPU) or ``/ 64`` (GPU) elements (pixels x images x
        directions, or critical pixels x directions; one direction of the slab at least), so
        the call's working memory stays within about this bound (plus the (*batch, D, T)
        result; on the GPU also two slabs of the raw mask in pinned host memory and two on
        the device, through which the next slab is read and copied while this one is
        counted); default 256 MiB (CPU) or 128 MiB (GPU), or 8 planes if that is more.

    Returns
    -------
    transform : ndarray of int64, shape (*batch, D, T)
        Of the mask's array type (NumPy for streamed host masks).

    Notes
    -----
    The ECT is the cumulative histogram over the thresholds of a per-pixel contribution map
    c_v (ecc.md 5.2, 5.3). With ``connectivity=1`` the height of a cell is attained at the
    corner that matches sign(v) (v_a = 0 counts as +), so c_v only depends on the orthant of v:
    it is computed once per orthant present among the directions (at most 2^ndim passes over
    the mask, as in Eucalc [3]_), and each direction then costs O(N_crit) histogramming, with
    N_crit the number of pixels with c != 0 (boundary pixels). With ``connectivity=ndim`` the
    owner of a lower cell is its lowest adjacent pixel, which depends on the magnitudes of v,
    so a full contribution pass, O(N), is made for every direction: expect that construction
    to be several times slower when there are many directions.

    The heights are computed in float64 as ``x_0 v_0 + x_1 v_1 (+ x_2 v_2)``, left to right,
    exactly as :func:`cutopo._ect.heights`; the comparisons ``h <= t`` are made in float64.

    Convention: array axes are spatial axes in C order (``(rows, cols)`` in 2D,
    ``(planes, rows, cols)`` in 3D), and ``directions[d, a]`` is the component along array
    axis a (in 2D, ``(1, 0)`` points along increasing row index). Pixel index i has position
    ``x_a = (i_a - (n_a - 1) / 2) * s`` with ``s = 2 / (max_b n_b - 1)`` (``s = 1`` when every
    n_b is 1): positions are centred on the image centre, isotropic, and the longest axis spans
    [-1, 1]. (Computed as ``(2 i_a - (n_a - 1)) / (max_b n_b - 1)``, one rounding.)
    Positions outside the image are empty.

    Examples
    --------
    >>> import numpy as np
    >>> from cutopo import ect
    >>> ring = np.ones((3, 3), dtype=bool)
    >>> ring[1, 1] = False
    >>> directions = [[1.0, 0.0], [-1.0, 0.0]]    # down the rows, up the rows
    >>> ect(ring, directions, [-1.0, 0.0, 1.0])   # a row, an arch (no hole yet), the ring
    array([[1, 1, 0],
           [1, 1, 0]])
    >>> cube = np.ones((2, 3, 4), dtype=bool)
    >>> ect(cube, [[0.0, 0.0, 1.0]], [-1.5, -1.0, 1.0])   # longest axis: positions -1 .. 1
    array([[0, 1, 1]])
    >>> ect(cube, [[0.0, 0.0, 1.0], [0.0, 1.0, 1.0]], 4)  # linspace(-R, R, 4), R = 5/3
    array([[0, 1, 1, 1],
           [1, 1, 1, 1]])

    References
    ----------
    .. [1] K. Turner, S. Mukherjee, D. M. Boyer, "Persistent homology transform for modeling
       shapes and surfaces", Information and Inference 3(4), 2014.
    .. [2] E. Röell, B. Rieck, "Differentiable Euler Characteristic Transforms for Shape
       Classification", ICLR 2024.
    .. [3] V. Lebovici, S. Oudot, H. Passe, "Efficient computation of topological integral
       transforms", SEA 2024 (LIPIcs 301), arXiv:2405.02256; the Eucalc library
       (per-orthant precomputation of the critical vertices).
    """
    streamed, backend, slab = _stream.route(mask, device, max_slab_bytes, op="ect")
    if streamed:
        return _stream.ect(mask, directions, thresholds, connectivity, boundary, backend, slab)
    _, dirs64, mask_b, batch, spatial, coords, tconn, t, _ = _prepare(
        "ect", mask, directions, thresholds, connectivity)
    periodic = check_boundary(boundary, mask_b, len(spatial))
    D, T = dirs64.shape[0], t.size
    if is_cupy_array(mask_b):
        with mask_b.device:
            out, _ = _band_cupy.ect_forward(mask_b, dirs64, coords, t, tconn, soft=False,
                                            periodic=periodic)
        return out.reshape(batch + (D, T))
    return curves(mask_b, dirs64, coords, t, tconn, periodic=periodic).reshape(batch + (D, T))


# ---------------------------------------------------------------------------------------------
# Soft ECT


class _Residuals(NamedTuple):
    mask_b: np.ndarray
    dirs64: np.ndarray
    coords: tuple
    tconn: bool
    t: np.ndarray          # computation dtype
    count: int | None      # thresholds given as a count (they then move with the directions)
    scale: np.generic      # computation dtype
    batch: tuple
    dtype: np.dtype
    entries: object = None  # GPU: the critical pixels found by the forward (_band_cupy.Entries)


def _soft_forward(mask, directions, thresholds, scale, *, connectivity=1):
    key = _DEVICE_CALLS.key((mask, directions, thresholds), (connectivity,), scale)
    if key is not None and mask.dtype != np.bool_:
        key = None  # _check_mask converts other masks: plans are for bool masks as they are
    planned = _DEVICE_CALLS.get(key) if key is not None else None
    if planned is not None:
        return _soft_forward_device(mask, directions, thresholds, scale, planned)
    same_array_type(mask, [("scale", scale)], anchor_name="mask", op="soft_ect")
    if _device_arguments(mask, directions, thresholds, connectivity):
        return _soft_forward_device(mask, directions, thresholds, scale, key=key)
    directions, dirs64, mask_b, batch, spatial, coords, tconn, t64, count = _prepare(
        "soft_ect", mask, directions, thresholds, connectivity)
    scale_value, scale64 = check_scale(scale)
    strong64 = scale64 or directions.dtype == np.float64
    if count is None:
        strong64 = strong64 or as_array(thresholds, "thresholds").dtype == np.float64
    dtype = np.dtype(np.float64 if strong64 else np.float32)
    lam = scale_lambda(dtype, scale_value)
    t = t64.astype(dtype)
    B, D, T = mask_b.shape[0], dirs64.shape[0], t.size
    res = _Residuals(mask_b, dirs64, coords, tconn, t, count, lam, batch, dtype)
    if is_cupy_array(mask_b):
        with mask_b.device:
            out, entries = _band_cupy.ect_forward(mask_b, dirs64, coords, t, tconn, soft=True,
                                                  lam=lam, w=band_halfwidth(dtype, lam), keep=True)
        return out.reshape(batch + (D, T)), res._replace(entries=entries)
    check_result_memory(batch + (D,), (T,), 24)  # float64 sums, saturated counts, result
    out = np.zeros((B, D, T), dtype=np.float64)
    # Band-limited, as soft_ecc (cutopo._band_numpy) and the CUDA kernels: per direction the
    # pixels with c != 0 at their heights, the thresholds outside each band saturated exactly.
    w = band_halfwidth(dtype, lam)
    for ch in _entries(mask_b, dirs64, coords, tconn):
        k = ch.ids.size
        bands = _band_numpy.bands(ch.row, ch.c.astype(np.float64), ch.h.astype(dtype), t, w)
        local = _band_numpy.forward(bands, t, lam, k * ch.nb)
        out[ch.b0:ch.b0 + ch.nb, ch.ids] += local.reshape(k, ch.nb, T).transpose(1, 0, 2)
    return out.astype(dtype).reshape(batch + (D, T)), res


def _device_arguments(mask, directions, thresholds, connectivity) -> bool:
    """Whether a soft ECT call takes _band_cupy.SoftEctPlan, which reads no argument on the
    host: a CuPy mask with float32/float64 CuPy directions and float CuPy thresholds (not a
    count) on its device, the V construction, and a size that fits (fits_device_plan). Every
    other call takes _prepare, which reads directions and thresholds on the host (its checks
    then raise before any kernel runs)."""
    if not (is_cupy_array(mask) and is_cupy_array(directions) and is_cupy_array(thresholds)):
        return False
    if directions.dtype not in _band_cupy.DIRECTION_DTYPES or thresholds.dtype.kind != "f":
        return False
    if directions.ndim != 2 or directions.shape[1] not in (2, 3) or directions.shape[0] == 0:
        return False  # _prepare raises the error
    ndim = directions.shape[1]
    try:
        if mask.ndim < ndim or check_connectivity(connectivity, ndim):
            return False  # too few axes (_prepare raises), or the T construction
    except (TypeError, ValueError):
        return False      # _prepare raises the error
    device = mask.device.id
    if directions.device.id != device or thresholds.device.id != device:
        return False
    spatial = mask.shape[mask.ndim - ndim:]
    if any(n == 0 for n in spatial):
        return False
    B = math.prod(mask.shape[:mask.ndim - ndim])
    return _band_cupy.fits_device_plan(B, spatial)


# The plan of a repeated soft ECT call on device arguments (_soft_forward_device), by
# everything its checks read but the scale's value (checked at every call; cutopo._cuda.repeated):
# a training loop's call then skips ~25 us of checks and planning on the H100 machines' hosts
# (forty-second session). Only calls whose checks depend on nothing else are kept: a bool CuPy
# mask with CuPy directions and thresholds, all C-contiguous on the current device, a float
# scale and an int connectivity; the kernels check the values of directions and thresholds at
# every call.
_DEVICE_CALLS = RepeatedCalls()


class _DevicePlan(NamedTuple):
    """What _soft_forward_device plans from its arguments' shapes and types."""
    plan: object        # _band_cupy.SoftEctPlan
    dtype: np.dtype     # computation dtype
    batch: tuple
    spatial: tuple
    coords: object      # _axis_coordinates(spatial)
    t_dtype: np.dtype   # the dtypes of the thresholds' and the scale's cotangents
    s_dtype: np.dtype


def _device_plan(mask, directions, t_in, scale64, scale_dtype) -> _DevicePlan:
    """The plan of _soft_forward_device, from the shapes and dtypes of its checked arguments
    (``mask`` bool, on the current device; ``t_in`` the thresholds)."""
    D, ndim = directions.shape
    strong64 = scale64 or directions.dtype == np.float64 or t_in.dtype == np.float64
    dtype = np.dtype(np.float64 if strong64 else np.float32)
    spatial = tuple(mask.shape[mask.ndim - ndim:])
    batch = mask.shape[:mask.ndim - ndim]
    plan = _band_cupy.soft_ect_plan(mask.device.id, math.prod(batch), spatial, D, t_in.size, dtype,
                                    directions.dtype)
    # The backward returns each cotangent in its argument's dtype where that is the computation
    # dtype (cutopo.vjp then casts nothing), else in float64 (rounded once, by cutopo.vjp); a
    # Python float scale's cotangent is the output's.
    t_dtype = dtype if t_in.dtype == dtype else np.dtype(np.float64)
    s_dtype = dtype if (scale_dtype is None or scale_dtype == dtype) else np.dtype(np.float64)
    return _DevicePlan(plan, dtype, batch, spatial, _axis_coordinates(spatial), t_dtype, s_dtype)


def _soft_forward_device(mask, directions, thresholds, scale, planned=None, key=None):
    """soft_ect's forward through _band_cupy.SoftEctPlan (see _device_arguments): the checks of
    the argument values (directions finite and non-zero, heights finite, thresholds finite and
    sorted) run in a kernel whose flags are read once the op's kernels are queued; a failed
    one raises the host path's error before the call returns. ``planned``: the call's plan
    from _DEVICE_CALLS (its arguments then are as _device_key requires); else it is made, and
    kept under ``key`` if not None."""
    if planned is None:  # the checks that need no values, in _prepare's order
        with mask.device:
            mask = _check_mask(mask, directions.shape[1])
            t_in = check_threshold_array(thresholds)
            scale_value, scale64 = check_scale(scale)
            planned = _device_plan(mask, directions, t_in, scale64, getattr(scale, "dtype", None))
        if key is not None:
            _DEVICE_CALLS.keep(key, planned)
    else:
        t_in = thresholds
        scale_value = float(scale)
        if not 0.0 < scale_value < math.inf:
            check_scale(scale)  # raises its error (NaN too)
    plan, dtype, batch = planned.plan, planned.dtype, planned.batch
    lam = scale_lambda(dtype, scale_value)
    w = band_halfwidth(dtype, lam)
    with on_device_of(mask):
        # (as_c_contiguous: CuPy's ascontiguousarray costs host time on a contiguous array too)
        flat = (plan.B,) + planned.spatial
        mask_b = as_c_contiguous(mask if mask.shape == flat else mask.reshape(flat))
        t = as_c_contiguous(t_in.astype(dtype, copy=False))  # exact: a wider float
        dirs = as_c_contiguous(directions)
        workspace, dirs64, codes, flags = plan.arguments(t, dirs)
        with reading(flags, functools.partial(_raise_failed_arguments, dirs, planned.coords)):
            out, kept = plan.forward(mask_b, workspace, dirs64, codes, t, lam, w, planned.t_dtype,
                                     planned.s_dtype)
    res = _Residuals(mask_b, dirs64, planned.coords, False, t, None, lam, batch, dtype, kept)
    return out.reshape(batch + (plan.D, plan.T)), res


def _raise_failed_arguments(directions, coords, values):
    """The error of a failed check of SoftEctPlan.arguments: the host path's own checks, run on
    a host copy of the directions (only then), or the thresholds' error."""
    flags = int(values[0])
    if flags & (4 | 8):
        _check_directions(directions)
        raise AssertionError("internal: the device flagged the directions, the host check passed")
    if flags & 16:  # sum |v_a| > 1e300: overflow is possible, the exact check decides
        check_heights_finite(coords, to_numpy(directions).astype(np.float64))
    _band_cupy.raise_failed_thresholds(flags)


def _soft_backward(res: _Residuals, g, needs):
    _, need_v, need_t, need_scale = needs
    if not (need_v or need_t or need_scale):
        return None, None, None, None
    dtype, t, lam = res.dtype, res.t, res.scale
    B, D, T = res.mask_b.shape[0], res.dirs64.shape[0], t.size
    ndim = res.dirs64.shape[1]
    chain = need_v and res.count is not None  # the count's thresholds +-R move with the directions
    if is_cupy_array(res.mask_b):
        return _soft_backward_cupy(res, g, needs, chain)
    g = np.asarray(g, dtype=dtype).reshape(B, D, T)
    d_v = np.zeros((D, ndim), dtype=np.float64) if need_v else None
    d_t = np.zeros(T, dtype=np.float64) if (need_t or chain) else None
    d_scale = 0.0
    w = band_halfwidth(dtype, lam)
    for ch in _entries(res.mask_b, res.dirs64, res.coords, res.tconn):
        k = ch.ids.size
        gl = g[ch.b0:ch.b0 + ch.nb][:, ch.ids].transpose(1, 0, 2).reshape(-1)
        bands = _band_numpy.bands(ch.row, ch.c.astype(np.float64), ch.h.astype(dtype), t, w)
        d_h, dt_part, ds = _band_numpy.backward(bands, t, lam, gl, need_v, d_t is not None,
                                                need_scale)
        if d_t is not None:
            d_t += dt_part
        d_scale += ds
        if need_v:  # h = <x, v>: dh/dv_a = x_a, summed per direction
            dl = ch.row // ch.nb
            for a in range(ndim):
                d_v[ch.ids, a] += np.bincount(dl, weights=d_h * ch.x[a], minlength=k)
    if chain:
        d_star, step = _threshold_motion(res, float(np.dot(d_t, _count_slope(res.count))))
        d_v[d_star] += step
    return (None, d_v, d_t if need_t else None,
            np.asarray(d_scale) if need_scale else None)


def _count_slope(n):
    """d t_k / d R for the count's thresholds t_k = -R + 2 R k / (n - 1) (t = [-R] when n = 1)."""
    return -1.0 + 2.0 * np.arange(n) / (n - 1) if n > 1 else np.array([-1.0])


def _threshold_motion(res, dt_dot_slope):
    """(direction, its added cotangent) from thresholds that move with R. R = |h| at one grid
    corner for one direction (the first where the maximum is attained): dR/dv = +-(corner)."""
    _, d_star, grad_r = _reach(res.coords, res.dirs64)
    return d_star, dt_dot_slope * grad_r


def _soft_backward_cupy(res: _Residuals, g, needs, chain):
    import cupy

    _, need_v, need_t, need_scale = needs
    lam = res.scale
    w = band_halfwidth(res.dtype, lam)
    if isinstance(res.entries, _band_cupy.DeviceEntries):  # d_t includes the factor lam
        with on_device_of(res.mask_b):
            kept = res.entries
            d_v, d_t, d_scale = kept.plan.backward(kept, res.t, g, lam, w,
                                                   (need_v, need_t, need_scale), kept.t_dtype,
                                                   kept.s_dtype)
        return (None, d_v if need_v else None, d_t if need_t else None,
                d_scale if need_scale else None)
    with res.mask_b.device:
        d_v, d_t, d_scale = _band_cupy.ect_backward(
            res.mask_b, res.dirs64, res.coords, res.t, res.tconn, lam, w, g,
            (need_v, need_t or chain, need_scale),
            kept=res.entries)
        d_t *= float(lam)
        if chain:
            slope = cupy.asarray(_count_slope(res.count))
            d_star, step = _threshold_motion(res, float(cupy.dot(d_t, slope)))
            d_v[d_star] += cupy.asarray(step)
    return (None, d_v if need_v else None, d_t if need_t else None,
            d_scale if need_scale else None)


def _soft_meta(mask, directions, thresholds, scale, *, connectivity=1):
    """Output (shape, dtype) from the arguments' shapes and dtypes (see cutopo.vjp.OpSpec).

    First _soft_forward's checks, in its order, on data-free stand-ins (directions and scale
    of ones, which pass the checks of values): a bad argument raises the op's own error before
    the op runs."""
    from ._adapters import stand_in

    _prepare("soft_ect", stand_in(mask), stand_in(directions, 1), stand_in(thresholds),
             connectivity)
    check_scale(stand_in(scale, 1))
    count = is_count(thresholds)
    D, ndim = directions.shape
    T = int(thresholds) if count else thresholds.shape[0]
    wide = (directions.dtype == np.float64 or getattr(scale, "dtype", None) == np.float64
            or (not count and thresholds.dtype == np.float64))
    return (tuple(mask.shape[:mask.ndim - ndim]) + (D, T),
            np.dtype(np.float64 if wide else np.float32))


@register(name="soft_ect", forward=_soft_forward, backward=_soft_backward,
          arg_names=("mask", "directions", "thresholds", "scale"),
          differentiable=("directions", "thresholds", "scale"), meta=_soft_meta)
def soft_ect(mask, directions, thresholds, scale, *, connectivity=1):
    r"""Soft Euler characteristic transform: the ECT with every step relaxed to a sigmoid.

    Entry (d, k) of the result is

        sum_p c_d(p) * sigmoid(scale * (thresholds[k] - h_d(p))),

    with h_d(p) = <x_p, directions[d]> and c_d the contribution map that :func:`ect` uses
    (same construction). It is differentiable in ``directions``, ``thresholds`` and ``scale``
    through :func:`cutopo.vjp`, and tends to :func:`ect` as ``scale`` grows.

    Parameters
    ----------
    mask : ndarray, shape (*batch, *spatial)
        As for :func:`ect` (bool, or integer with non-zero as foreground); not differentiable.
    directions : array-like, shape (D, ndim)
        As for :func:`ect`: finite, no zero row, not normalised.
    thresholds : int or 1-D array
        As for :func:`ect`. A count n means ``linspace(-R, R, n)`` with R the largest ``|h|``
        over the grid and the directions; those thresholds then move with the directions, and
        the derivative with respect to ``directions`` includes that dependence (R is piecewise
        linear in the directions; at a tie the first maximising direction takes it). The count
        itself gets no cotangent and does not affect the computation dtype.
    scale : float or 0-d array
        The positive, finite sharpness of the sigmoid, in inverse height units.
    connectivity : {1, ndim}, optional
        As for :func:`ect`.

    Returns
    -------
    transform : ndarray of float32 or float64, shape (*batch, D, T)
        float64 when ``directions``, ``thresholds`` or ``scale`` is float64 (a NumPy float64
        array or scalar, or a list of Python floats; a plain Python float ``scale`` does not
        count), else float32. The heights and contribution maps are always computed in
        float64; the sigmoids in the computation dtype, summed in float64.

    Notes
    -----
    Every cell's height is the height of the pixel that owns it, so the result equals the
    per-cell relaxation of Röell & Rieck [2]_, ``sum over cells of (-1)^dim
    sigmoid(scale (t - h(cell)))``, on the cubical complex of the mask. As ``scale -> inf``
    each sigmoid tends to ``[h(p) < t]`` (1/2 at ``h(p) == t``), so the result tends to
    :func:`ect` at every threshold that equals no pixel height.

    The vector-Jacobian product, for a cotangent g (sigma' = s (1 - s); the contribution maps
    are piecewise constant in the directions, so their derivative is zero almost everywhere):

    * directions: ``-scale * sum_{batch, k, p} g c_d(p) sigma'_pk x_p`` (plus the motion of the
      thresholds when they are given as a count);
    * thresholds: ``scale * sum_{batch, d, p} g c_d(p) sigma'_pk``;
    * scale: ``sum g c_d(p) (t_k - h_d(p)) sigma'_pk``.

    The backward recomputes the contribution maps and heights instead of storing them.

    Cost: as for :func:`ect`, plus, for every direction and pixel with c != 0, one sigmoid per
    threshold in its band ``|scale (t - h)| < B``, as :func:`soft_ecc` does (B = 37 in float64,
    17 in float32; outside it the sigmoid is 0 or 1 to the dtype's resolution and is added
    exactly, the terms left out below ``e^-B |c|`` each), summed in float64; the same bands,
    heights and contribution maps on the CPU and the GPU.

    *GPU.* With a CuPy mask, float32/float64 CuPy directions and float CuPy thresholds (not a
    count), ``connectivity=1`` and a small call (at most 2^21 entry slots, 2^ndim x images x
    pixels), the call reads none of its arguments on the host: a kernel converts and checks
    the directions and thresholds (finite, no zero row, heights within float64, sorted), its
    flags are read once the op's kernels are queued, and a failed check raises the host
    path's error before the call returns; the contribution maps of every orthant are
    computed, whichever the directions use. Other GPU calls read directions and thresholds on
    the host first (one synchronisation each), then run the same kernels.

    Convention: as for :func:`ect` (positions centred, isotropic, longest axis spanning
    [-1, 1]; direction components in array-axis order).

    Examples
    --------
    >>> import numpy as np
    >>> from cutopo import ect, soft_ect
    >>> ring = np.ones((3, 3), dtype=bool)
    >>> ring[1, 1] = False
    >>> directions = [[1.0, 0.0]]
    >>> ect(ring, directions, [-0.5, 0.5, 1.5])
    array([[1, 1, 0]])
    >>> soft_ect(ring, directions, [-0.5, 0.5, 1.5], 50.0).round(6)
    array([[1., 1., 0.]])
    >>> soft_ect(ring, directions, [-0.5, 0.5, 1.5], 4.0).round(3)
    array([[0.878, 0.878, 0.119]])

    References
    ----------
    .. [1] K. Turner, S. Mukherjee, D. M. Boyer, "Persistent homology transform for modeling
       shapes and surfaces", Information and Inference 3(4), 2014.
    .. [2] E. Röell, B. Rieck, "Differentiable Euler Characteristic Transforms for Shape
       Classification", ICLR 2024.
    .. [3] V. Lebovici, S. Oudot, H. Passe, "Efficient computation of topological integral
       transforms", SEA 2024 (LIPIcs 301), arXiv:2405.02256; the Eucalc library
       (per-orthant precomputation of the critical vertices).
    """
    return _soft_forward(mask, directions, thresholds, scale, connectivity=connectivity)[0]
