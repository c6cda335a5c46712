"""NumPy path of the exact ECC: the CPU fallback and the oracle the CUDA kernels are tested against.

Pixels are ordered by (key, linear index); every cell is owned by one pixel (its latest vertex
in the V construction, its earliest adjacent pixel in the T construction) and c(p) sums
(-1)^dim over the cells p owns. The work is vectorised over shifted views of a padded key
array and done in slabs along the first spatial axis, so memory stays bounded.

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

_SLAB_ELEMENTS = 1 << 21  # elements per slab: about 50 bool temporaries of this size live at once


def _offset_order(ndim):
    """Non-zero offsets in {-1,0,1}^ndim, sorted by the number of non-zero components."""
    offsets = [o for o in itertools.product((-1, 0, 1), repeat=ndim) if any(o)]
    return sorted(offsets, key=lambda o: sum(v != 0 for v in o))


def _slab_contributions(padded, ndim, tconn, wrap=None):
    """c for the centre of ``padded`` (batch, *spatial + 2), whose border holds the halo.

    ``wrap``: None (box), or ``(z0, n0)`` for a periodic complex whose slab starts at row z0
    of n0 along the first spatial axis (the other axes are whole).
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
            if a == 0:
                z0, n0 = wrap
                pos = (0 if o[0] < 0 else n0 - 1) - z0
                inside = 0 <= pos < centre.shape[1]
            else:
                pos = 0 if o[a] < 0 else centre.shape[1 + a] - 1
                inside = True
            if inside:
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


def contributions_from_keys(keys, ndim, tconn, outside, periodic=False):
    """int8 c(p) for keys of shape (batch, *spatial); ``outside`` must exceed every key.

    ``periodic``: the torus complex (``outside`` is then unused; every spatial axis >= 3).
    """
    pad = [(0, 0)] + [(1, 1)] * ndim
    if periodic:
        padded = np.pad(keys, pad, mode="wrap")
    else:
        padded = np.pad(keys, pad, constant_values=outside)
    out = np.empty(keys.shape, dtype=np.int8)
    n0 = keys.shape[1]
    per_row = max(1, math.prod(keys.shape) // max(n0, 1))
    step = max(1, _SLAB_ELEMENTS // per_row)
    for z0 in range(0, n0, step):
        z1 = min(n0, z0 + step)
        out[:, z0:z1] = _slab_contributions(padded[:, z0:z1 + 2], ndim, tconn,
                                            (z0, n0) if periodic else None)
    return out


def order_keys(values):
    """Integer keys with the order of ``values`` (NaN as +inf, -0.0 == 0.0) and an outside key."""
    if values.dtype.kind == "f":
        v = values.astype(np.float64)
        v[np.isnan(v)] = np.inf
        v += 0.0  # -0.0 -> +0.0
        bits = v.view(np.uint64)
        sign = np.uint64(1 << 63)
        keys = np.where(bits & sign, ~bits, bits | sign)
        return keys, np.uint64(np.iinfo(np.uint64).max)  # +inf maps below all-ones
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
    chunk = max(1, (8 * _SLAB_ELEMENTS) // per_image)  # images per pass
    for b0 in range(0, nimg, chunk):
        part = x[b0:b0 + chunk]
        # bin = first k with f <= t_k, T when none (NaN sorts last in searchsorted).
        bins = np.searchsorted(thresholds, part.astype(thresholds.dtype, copy=False).ravel(), side="left")
        bins = bins.reshape(part.shape)
        c = contributions_from_keys(bins, ndim, tconn, outside=T + 1, periodic=periodic)
        nonzero = np.flatnonzero(c)
        rows = nonzero // per_image
        counts = np.bincount(rows * (T + 1) + bins.ravel()[nonzero], weights=c.ravel()[nonzero],
                             minlength=part.shape[0] * (T + 1))
        hist[b0:b0 + part.shape[0]] += counts.reshape(part.shape[0], T + 1)
    curve = np.cumsum(np.rint(hist[:, :T]).astype(np.int64), axis=1)
    return curve.reshape(batch + (T,))
