"""NumPy path of the exact ECC: the CPU fallback and the oracle the CUDA kernels are tested against.

Pixels are ordered by (key, linear index); every cell is owned by one pixel (its latest vertex
in the V construction, its earliest adjacent pixel in the T construction) and c(p) sums
(-1)^dim over the cells p owns. The work is vectorised over shifted views of a padded key
array and done in tiles of at most _SLAB_ELEMENTS pixels (images, planes, and row ranges of a
plane when planes are larger; each tile with its one-pixel halo), so memory stays bounded.

Boundaries: "box" pads with an outside key that precedes no pixel; "periodic" (the cubical
complex of the torus) pads with the wrapped-around pixels. There the index tie-break of a
neighbour q = p + o is decided by the first axis a with o_a != 0 (every other earlier axis
agrees), and q's real coordinate along a is (p_a + o_a) mod n_a: q comes before p when o_a < 0,
except at p_a = 0 where q wraps to n_a - 1; and after p when o_a > 0, except at p_a = n_a - 1
where q wraps to 0. So the constant rule of the box holds everywhere but on one hyperplane
per offset, where it flips; that hyperplane is recomputed with the opposite comparison.
Every axis needs n_a >= 3 (then the 3^d neighbours of a pixel are distinct pixels and every
torus cell has distinct vertices).
"""
from __future__ import annotations

import itertools
import math

import numpy as np

from ._bins import value_bins

# Elements per tile of the contribution pass (see _tiles): at most about 60 bytes of temporaries
# per element live at once (bool arrays of the tile's size), and staying in the caches pays
# (3D 256^3: 1.2 s with 2^21, 0.63 s with 2^17).
_SLAB_ELEMENTS = 1 << 17
# Elements binned per pass of the in-memory ECC (whole images; its keys, 2 bytes each, are then
# swept in tiles of _SLAB_ELEMENTS).
_PASS_ELEMENTS = 1 << 24


def _bin_key_dtype(T):
    """Keys of threshold bins 0..T plus the outside key T + 1: 2 bytes where they fit (every
    contribution pass reads them 3^ndim - 1 times)."""
    return np.uint16 if T + 1 <= np.iinfo(np.uint16).max else np.int32


def _offset_order(ndim):
    """Non-zero offsets in {-1,0,1}^ndim, sorted by the number of non-zero components."""
    offsets = [o for o in itertools.product((-1, 0, 1), repeat=ndim) if any(o)]
    return sorted(offsets, key=lambda o: sum(v != 0 for v in o))


def _tiles(shape, step):
    """Boxes tiling an array of ``shape``, each a tuple of (start, stop) per axis, of at most
    ``max(step, 1)`` elements: whole trailing axes, a range along one axis and single indices
    along the axes before it. Planes (and rows) larger than ``step`` are split too, so the
    temporaries of a pass over a tile are bounded whatever the image shape."""
    shape = tuple(int(n) for n in shape)
    if 0 in shape:
        return
    inner = 1
    for k in range(len(shape) - 1, -1, -1):
        if inner * shape[k] > step:
            break
        inner *= shape[k]
    else:
        yield tuple((0, n) for n in shape)
        return
    per = max(1, step // inner)
    parts = -(-shape[k] // per)
    cuts = [shape[k] * i // parts for i in range(parts + 1)]  # balanced, each <= per
    tail = tuple((0, n) for n in shape[k + 1:])
    for idx in np.ndindex(*shape[:k]):
        head = tuple((i, i + 1) for i in idx)
        for a, b in zip(cuts[:-1], cuts[1:]):
            yield head + ((a, b),) + tail


def finite_range(image, step=_SLAB_ELEMENTS):
    """(lo, hi): the smallest and largest finite value of a non-empty NumPy array (Python
    numbers, exact), or None when no value is finite. Floating arrays are scanned in tiles of
    at most ``step`` elements, so the finiteness mask never takes more than a tile."""
    if image.dtype.kind != "f":
        return image.min().item(), image.max().item()

    def tile_range(box):
        part = image[tuple(slice(a, b) for a, b in box)]
        ok = np.isfinite(part)
        if not ok.any():
            return None
        return float(np.min(part, where=ok, initial=np.inf)), float(np.max(part, where=ok, initial=-np.inf))

    return merge_ranges(map(tile_range, _tiles(image.shape, step)))


def merge_ranges(spans):
    """The (lo, hi) covering every (lo, hi) of ``spans`` that is not None (the finite ranges of
    an array's parts), as floats; None when all are None."""
    lo = hi = None
    for span in spans:
        if span is not None:
            lo = float(span[0]) if lo is None else min(lo, float(span[0]))
            hi = float(span[1]) if hi is None else max(hi, float(span[1]))
    return None if lo is None else (lo, hi)


def _halo_view(padded, box):
    """The part of ``padded`` (images, *spatial + 2) that a tile ``box`` of the unpadded array
    (images, *spatial) needs: its pixels and their one-pixel halo."""
    return padded[(slice(*box[0]),) + tuple(slice(a, b + 2) for a, b in box[1:])]


def _tile_wrap(box, lengths, start0=0):
    """The ``wrap`` of _slab_contributions for a tile: (global start, torus length) per spatial
    axis; ``start0`` is the global index of the array's first plane along axis 0."""
    return tuple(((start0 if a == 0 else 0) + lo, n)
                 for a, ((lo, _), n) in enumerate(zip(box[1:], lengths)))


def _slab_contributions(padded, ndim, tconn, wrap=None):
    """c for the centre of ``padded`` (batch, *spatial + 2), whose border holds the halo.

    ``wrap``: None (box), or for a periodic complex one ``(start, n)`` per spatial axis: the
    global index of the centre's first pixel along the axis (a tile of a larger block) and the
    torus' length along it.
    """
    centre = padded[(slice(None),) + (slice(1, -1),) * ndim]
    lead = (slice(None),)
    c = np.full(centre.shape, (-1) ** ndim if tconn else 1, dtype=np.int8)
    owner = {}
    for o in _offset_order(ndim):
        view = padded[lead + tuple(slice(1 + v, padded.shape[1 + a] - 1 + v) for a, v in enumerate(o))]
        earlier = next(v for v in o if v) < 0  # q = p + o comes first in C order
        precedes = (view <= centre) if earlier else (view < centre)
        if wrap is not None:
            # On the torus the rule flips where q wraps around its first non-zero axis a.
            a = next(i for i, v in enumerate(o) if v)
            start, n = wrap[a]
            pos = (0 if o[a] < 0 else n - 1) - start
            if 0 <= pos < centre.shape[1 + a]:
                plane = lead + (slice(None),) * a + (pos,)
                precedes[plane] = ((view[plane] < centre[plane]) if earlier
                                   else (view[plane] <= centre[plane]))
        # V: p owns the cell {p + o' : o' in {0, o}} when every other vertex precedes it.
        # T: p owns the face towards o when it precedes every other pixel sharing the face.
        own = ~precedes if tconn else precedes
        for a, v in enumerate(o):
            if v:
                child = o[:a] + (0,) + o[a + 1:]
                if any(child):
                    own &= owner[child]
        owner[o] = own
        k = sum(v != 0 for v in o)
        dim = ndim - k if tconn else k
        if dim % 2:
            np.subtract(c, own, out=c, casting="unsafe")
        else:
            np.add(c, own, out=c, casting="unsafe")
    return c


def contributions_from_keys(keys, ndim, tconn, outside, periodic=False, wrap0=None):
    """int8 c(p) for keys of shape (batch, *spatial); ``outside`` must never precede a key:
    above every key, or NaN with float keys (every comparison with it is false).

    ``periodic``: the torus complex (``outside`` is then unused; every spatial axis >= 3).
    ``wrap0`` (periodic only): ``(start, n0)`` when axis 0 of ``keys`` is the block of planes
    ``start, start + 1, ...`` of a torus of ``n0`` planes read with its halo planes (a streamed
    slab): axis 0 then does not wrap within the block, and the c of its first and last planes
    are not meaningful (their neighbours lie outside the block).
    """
    pad = [(0, 0)] + [(1, 1)] * ndim
    if periodic and wrap0 is not None:
        padded = np.pad(keys, [(0, 0), (0, 0)] + [(1, 1)] * (ndim - 1), mode="wrap")
        padded = np.pad(padded, [(0, 0), (1, 1)] + [(0, 0)] * (ndim - 1), mode="edge")
    elif periodic:
        padded = np.pad(keys, pad, mode="wrap")
    else:
        padded = np.pad(keys, pad, constant_values=outside)
    out = np.empty(keys.shape, dtype=np.int8)
    start, n_total = wrap0 if wrap0 is not None else (0, keys.shape[1])
    lengths = (n_total,) + tuple(keys.shape[2:])
    for box in _tiles(keys.shape, _SLAB_ELEMENTS):
        wrap = _tile_wrap(box, lengths, start) if periodic else None
        out[tuple(slice(a, b) for a, b in box)] = _slab_contributions(
            _halo_view(padded, box), ndim, tconn, wrap)
    return out


def order_keys(values):
    """Keys with the order of ``values`` (NaN as +inf, -0.0 == 0.0) and an outside key that
    never precedes a pixel, as narrow as the values allow (the contribution passes read every
    key 3^ndim - 1 times). Floats compare as themselves (float16 widened to float32): NaN
    pixels become +inf and the outside key is NaN, for which every <, <= is false, as for a key
    above all others. Integers of up to 2 bytes get int32 keys, wider ones int64."""
    if values.dtype.kind == "f":
        keys = values.astype(np.float32 if values.dtype.itemsize <= 4 else np.float64, copy=False)
        nan = np.isnan(keys)
        if nan.any():
            keys = np.where(nan, np.inf, keys).astype(keys.dtype, copy=False)
        return keys, keys.dtype.type(np.nan)
    if values.dtype.kind in "biu" and values.dtype.itemsize <= 2:
        return values.astype(np.int32), np.int32(np.iinfo(np.int32).max)
    keys = values.astype(np.int64)
    return keys, np.int64(np.iinfo(np.int64).max)


def euler_contributions(image, ndim, tconn, periodic=False):
    batch = image.shape[:-ndim]
    x = image.reshape((-1,) + image.shape[-ndim:])
    keys, outside = order_keys(x)
    c = contributions_from_keys(keys, ndim, tconn, outside, periodic)
    return c.reshape(batch + image.shape[-ndim:])


def ecc(image, thresholds, ndim, tconn, periodic=False):
    """int64 (*batch, T) ECC; ``thresholds`` is sorted and already in the comparison dtype."""
    batch = image.shape[:-ndim]
    spatial = image.shape[-ndim:]
    T = thresholds.size
    x = image.reshape((-1,) + spatial)
    nimg = x.shape[0]
    hist = np.zeros((nimg, T + 1), dtype=np.float64)
    per_image = math.prod(spatial)
    chunk = max(1, _PASS_ELEMENTS // per_image)  # images per pass
    key_dtype = _bin_key_dtype(T)
    for b0 in range(0, nimg, chunk):
        part = x[b0:b0 + chunk]
        # bin = first k with f <= t_k, T when none (NaN sorts last in searchsorted).
        bins = value_bins(thresholds, part, key_dtype)
        c = contributions_from_keys(bins, ndim, tconn, outside=key_dtype(T + 1), periodic=periodic)
        nonzero = np.flatnonzero(c)
        rows = nonzero // per_image
        counts = np.bincount(rows * (T + 1) + bins.ravel()[nonzero].astype(np.int64),
                             weights=c.ravel()[nonzero],
                             minlength=part.shape[0] * (T + 1))
        hist[b0:b0 + part.shape[0]] += counts.reshape(part.shape[0], T + 1)
    curve = np.cumsum(np.rint(hist[:, :T]).astype(np.int64), axis=1)
    return curve.reshape(batch + (T,))


def owned_histogram(block, thresholds, ndim, tconn, own=None, periodic=False, start=0, n0=None,
                    step_elements=_SLAB_ELEMENTS):
    """int64 (nimg, T) histogram (not cumulated) of c over the owned pixels of a block.

    The blocks of a volume too large to handle at once (an out-of-core slab, a Dask chunk) are
    read with a one-pixel halo: the halo pixels are neighbours of owned pixels but are counted
    by the block that owns them. c(p) depends only on the keys of p's 3^ndim neighbourhood and on
    the direction of each neighbour (the index tie-break), so the sum over blocks of their
    owned histograms is the histogram of the whole volume, exactly.

    ``block``: host array (*batch, *spatial) (a NumPy array or memmap view; it is read in
    tiles of at most ``step_elements`` elements, so it need not be in memory). ``own``: None
    (every pixel) or one 1-D bool mask per spatial axis of the block; every owned pixel must have
    its whole neighbourhood inside the block or beyond the volume's border, where positions are
    outside. ``periodic``: the torus complex; axis 0 of the block then carries halo planes taken
    from the wrapped volume (``start``: global index of the block's plane 0, ``n0``: the
    volume's length along axis 0) and the other spatial axes are whole and wrap within the block.
    Memory: keys of 2 bytes per pixel (4 with 65535 thresholds or more) for the block (with a
    one-pixel border), plus about 60 bytes per element of one tile (:func:`_tiles`: images,
    planes and rows of a plane are all split, so a tile never exceeds ``step_elements``), plus
    the (nimg, T + 1) histogram.
    """
    spatial = tuple(block.shape[-ndim:])
    nimg = math.prod(block.shape[:-ndim])
    T = int(thresholds.size)
    hist = np.zeros((nimg, T + 1), dtype=np.int64)
    if nimg == 0:
        return hist[:, :T]
    x = block.reshape((nimg,) + spatial)
    if own is None:
        own = [np.ones(n, dtype=bool) for n in spatial]
    own = [np.asarray(m, dtype=bool) for m in own]
    # The bounding range [lo, hi) of the owned pixels along each axis (periodic: the axes after
    # the first are whole, they wrap within the block): only tiles of it are counted, and only
    # its keys and their one-pixel halo [lo - 1, hi + 1) are binned, into ``padded`` (index i + 1
    # holds block index lo + i; the positions beyond the block keep the outside key).
    ranges = []
    for a, m in enumerate(own):
        idx = np.flatnonzero(m)
        if idx.size == 0:
            return hist[:, :T]
        ranges.append((0, spatial[a]) if periodic and a else (int(idx[0]), int(idx[-1]) + 1))
    need = [(max(lo - 1, 0), min(hi + 1, n)) for (lo, hi), n in zip(ranges, spatial)]
    key_dtype = _bin_key_dtype(T)
    outside = key_dtype(T + 1)
    padded = np.full((nimg,) + tuple(hi - lo + 2 for lo, hi in ranges), outside, dtype=key_dtype)
    for box in _tiles((nimg,) + tuple(b - a for a, b in need), step_elements):
        src = tuple(slice(a + n0_, b + n0_) for (a, b), (n0_, _) in zip(box[1:], need))
        part = np.asarray(x[(slice(*box[0]),) + src])
        dst = tuple(slice(s.start - lo + 1, s.stop - lo + 1) for s, (lo, _) in zip(src, ranges))
        padded[(slice(*box[0]),) + dst] = value_bins(thresholds, part, key_dtype)
        del part
    if periodic:
        # The axes after the first wrap within the block (they are whole); axis 0 has its halo.
        for a in range(2, ndim + 1):
            n = spatial[a - 1]
            lead = (slice(None),) * a
            padded[lead + (0,)] = padded[lead + (n,)]
            padded[lead + (n + 1,)] = padded[lead + (1,)]
    lengths = (spatial[0] if n0 is None else n0,) + spatial[1:]
    for tile in _tiles((nimg,) + tuple(hi - lo for lo, hi in ranges), step_elements):
        # The tile in block coordinates.
        box = (tile[0],) + tuple((a + lo, b + lo) for (a, b), (lo, _) in zip(tile[1:], ranges))
        wrap = _tile_wrap(box, lengths, start) if periodic else None
        c = _slab_contributions(_halo_view(padded, tile), ndim, tconn, wrap)
        mask = None
        for a, ((lo, hi), m) in enumerate(zip(box[1:], own)):
            part = m[lo:hi]
            if part.all():
                continue
            part = part.reshape((1,) * (a + 1) + (-1,) + (1,) * (ndim - 1 - a))
            mask = part if mask is None else mask & part
        if mask is not None:
            c *= mask
        nonzero = np.flatnonzero(c)
        if nonzero.size == 0:
            continue
        i0, i1 = box[0]
        keys = padded[(slice(i0, i1),) + tuple(slice(a + 1, b + 1) for a, b in tile[1:])]
        weights = c.reshape(-1)[nonzero]
        bins = keys.reshape(-1)[nonzero]
        del c
        if i1 - i0 > 1:  # the bin of (image, key), in place: few temporaries per entry
            np.floor_divide(nonzero, math.prod(keys.shape[1:]), out=nonzero)
            nonzero *= T + 1
            nonzero += bins
        else:
            nonzero = bins.astype(np.intp)
        del bins
        counts = np.bincount(nonzero, weights=weights, minlength=(i1 - i0) * (T + 1))
        hist[i0:i1] += counts.round().astype(np.int64).reshape(i1 - i0, T + 1)
    return hist[:, :T]
