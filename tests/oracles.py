"""Independent reference implementations for the ECC tests (no cutopo code is used here).

``oracle_ecc`` enumerates every cell of the cubical complex of an image on the doubled grid
(coordinate 2i along an axis is pixel-aligned, 2i+1 lies between pixels) straight from the
definitions:

* V construction (``connectivity=1``): pixels are vertices; every elementary box spanned by
  pixels of the image is a cell, and its value is the max of its vertices.
* T construction (``connectivity=ndim``): pixels are closed unit squares/cubes (top cells);
  every face of a pixel is a cell, and its value is the min of the pixels it bounds.

NaN acts as +inf. ECC(t) = sum over cells of (-1)^dim [value <= t], with the comparison made in
``numpy.result_type(image, thresholds)``, as NumPy's ``image <= t`` does.

``skimage_ecc`` thresholds the image at every t and asks ``skimage.measure.euler_number``.
"""
from __future__ import annotations

import itertools

import numpy as np
from skimage.measure import euler_number


def comparison_arrays(image, thresholds):
    """(image, thresholds) cast to ``numpy.result_type(image, thresholds)``."""
    image = np.asarray(image)
    thresholds = np.atleast_1d(np.asarray(thresholds))
    dt = np.result_type(image.dtype, thresholds.dtype)
    return image.astype(dt), thresholds.astype(dt)


def _pair(va, ma, vb, mb, tconn):
    """Combine two (value, present) operands: max of both (V) or min of the present ones (T)."""
    if tconn:
        both = ma & mb
        value = np.where(both, np.minimum(va, vb), np.where(ma, va, vb))
        return value, ma | mb
    return np.maximum(va, vb), ma & mb


def _double_axis(values, present, axis, tconn):
    """Refine one axis of the grid: n entries -> 2n-1 (V) or 2n+1 (T) cells along it."""
    v = np.moveaxis(values, axis, 0)
    m = np.moveaxis(present, axis, 0)
    n = v.shape[0]
    if tconn:
        # Cells 2i (between pixels i-1 and i, the image border included) and 2i+1 (pixel i).
        pad_v = np.concatenate([v[:1], v, v[:1]])
        pad_m = np.concatenate([np.zeros_like(m[:1]), m, np.zeros_like(m[:1])])
        out_v = np.empty((2 * n + 1,) + v.shape[1:], dtype=v.dtype)
        out_m = np.empty((2 * n + 1,) + m.shape[1:], dtype=bool)
        out_v[1::2], out_m[1::2] = v, m
        out_v[0::2], out_m[0::2] = _pair(pad_v[:-1], pad_m[:-1], pad_v[1:], pad_m[1:], True)
    else:
        # Cells 2i (pixel i) and 2i+1 (the edge direction between pixels i and i+1).
        out_v = np.empty((2 * n - 1,) + v.shape[1:], dtype=v.dtype)
        out_m = np.empty((2 * n - 1,) + m.shape[1:], dtype=bool)
        out_v[0::2], out_m[0::2] = v, m
        out_v[1::2], out_m[1::2] = _pair(v[:-1], m[:-1], v[1:], m[1:], False)
    return np.moveaxis(out_v, 0, axis), np.moveaxis(out_m, 0, axis)


def cells(image, dtype, connectivity):
    """(values, present, dims) of every cell on the doubled grid, values in ``dtype``.

    ``present`` is False for cells whose value is +inf because of NaN pixels (V: a NaN vertex;
    T: every adjacent pixel NaN).
    """
    f = np.asarray(image).astype(dtype)
    ndim = f.ndim
    if ndim not in (2, 3):
        raise ValueError("oracle: 2-D or 3-D images only")
    if connectivity not in (1, ndim):
        raise ValueError("oracle: connectivity must be 1 or ndim")
    tconn = connectivity == ndim
    present = ~np.isnan(f) if f.dtype.kind == "f" else np.ones(f.shape, dtype=bool)
    values = f
    for axis in range(ndim):
        values, present = _double_axis(values, present, axis, tconn)
    # On both grids a cell has extent along an axis exactly where its coordinate is odd (V: an
    # edge direction between two pixels; T: the width of a pixel), so dim = number of odd axes.
    dims = sum((g % 2 == 1).astype(np.int64) for g in np.indices(values.shape))
    return values, present, dims


def oracle_ecc(image, thresholds, connectivity=1):
    """ECC by cell enumeration; int64 array of length len(thresholds)."""
    img, t = comparison_arrays(image, thresholds)
    values, present, dims = cells(img, img.dtype, connectivity)
    sign = np.where(dims % 2 == 1, -1, 1).ravel()
    values = values.ravel()
    present = present.ravel()
    out = np.empty(t.size, dtype=np.int64)
    for k, tk in enumerate(t):
        inside = present & (values <= tk)
        out[k] = int(sign[inside].sum())
    return out


def cell_count_check(image, connectivity):
    """Cell counts of the full complex (no NaN), for the oracle's own sanity test."""
    shape = np.asarray(image).shape
    values, present, dims = cells(np.zeros(shape), np.float64, connectivity)
    return np.bincount(dims.ravel(), minlength=len(shape) + 1)


def skimage_ecc(image, thresholds, connectivity=1):
    """[euler_number(image <= t, connectivity) for t], compared in the result type."""
    img, t = comparison_arrays(image, thresholds)
    return np.array([euler_number(img <= tk, connectivity=connectivity) for tk in t], dtype=np.int64)


# ---------------------------------------------------------------------------------------------
# Periodic boundaries: the cubical complex of the torus (every spatial axis wraps around)


def torus_cells(shape, connectivity):
    """Yield (pixels, dim) for every cell of the torus complex of an image of ``shape``.

    Every axis must have length >= 3. A cell is a base lattice point p (mod n) and a set S of
    axes along which it has extent, so dim = |S| and there are prod(n) * 2^d cells:

    * V (``connectivity=1``): ``pixels`` are its vertices, p + e_T (mod n) for every T within S.
    * T (``connectivity=ndim``): ``pixels`` are the pixels containing it (the pixel q is the
      unit cube from q to q + 1): the q with q_a = p_a on the axes of S and
      q_a in {p_a - 1, p_a} (mod n) on the others.
    """
    n = tuple(int(s) for s in shape)
    ndim = len(n)
    if ndim not in (2, 3):
        raise ValueError("oracle: 2-D or 3-D images only")
    if connectivity not in (1, ndim):
        raise ValueError("oracle: connectivity must be 1 or ndim")
    if min(n) < 3:
        raise ValueError("oracle: every axis of a torus image must have length >= 3")
    tconn = connectivity == ndim
    for p in itertools.product(*(range(s) for s in n)):
        for S in itertools.product((False, True), repeat=ndim):
            if tconn:
                choices = [(p[a],) if S[a] else (p[a] - 1, p[a]) for a in range(ndim)]
            else:
                choices = [(p[a], p[a] + 1) if S[a] else (p[a],) for a in range(ndim)]
            pixels = sorted({tuple(q[a] % n[a] for a in range(ndim))
                             for q in itertools.product(*choices)})
            # n >= 3: the pixels of a cell are distinct (2^|S| vertices, 2^(d-|S|) pixels).
            assert len(pixels) == 2 ** (ndim - sum(S) if tconn else sum(S))
            yield pixels, sum(S)


def periodic_cells(image, dtype, connectivity):
    """(values, present, dims) of every torus cell, as flat arrays, values in ``dtype``.

    V: value = max of the vertices, present when none is NaN. T: value = min of the non-NaN
    pixels containing the cell, present when there is one.
    """
    f = np.asarray(image).astype(dtype)
    tconn = connectivity == f.ndim
    nan = np.isnan(f) if f.dtype.kind == "f" else np.zeros(f.shape, dtype=bool)
    values, present, dims = [], [], []
    for pixels, dim in torus_cells(f.shape, connectivity):
        vals = [f[q] for q in pixels if not nan[q]]
        ok = bool(vals) if tconn else len(vals) == len(pixels)
        values.append((min(vals) if tconn else max(vals)) if ok else f.dtype.type(0))
        present.append(ok)
        dims.append(dim)
    return np.array(values, dtype=f.dtype), np.array(present, dtype=bool), np.array(dims, dtype=np.int64)


def periodic_ecc_oracle(image, thresholds, connectivity=1):
    """ECC of the torus complex by cell enumeration; int64 array of length len(thresholds)."""
    img, t = comparison_arrays(image, thresholds)
    values, present, dims = periodic_cells(img, img.dtype, connectivity)
    sign = np.where(dims % 2 == 1, -1, 1)
    out = np.empty(t.size, dtype=np.int64)
    for k, tk in enumerate(t):
        out[k] = int(sign[present & (values <= tk)].sum())
    return out


def periodic_contributions_oracle(image, connectivity=1):
    """int64 contribution map of the torus complex, from the ownership rule of ecc.md 5.2.

    Pixels are ordered by (value, real C-order linear index), NaN as +inf; every V cell goes to
    its latest vertex, every T cell to its earliest pixel; c(p) = sum of (-1)^dim over them.
    """
    f = np.asarray(image)
    tconn = connectivity == f.ndim

    def key(q):
        v = f[q]
        v = np.inf if (f.dtype.kind == "f" and np.isnan(v)) else float(v)
        return v, int(np.ravel_multi_index(q, f.shape))

    c = np.zeros(f.shape, dtype=np.int64)
    for pixels, dim in torus_cells(f.shape, connectivity):
        owner = min(pixels, key=key) if tconn else max(pixels, key=key)
        c[owner] += (-1) ** dim
    return c


def extreme_even_thresholds():
    """Evenly spaced thresholds at the ends of their dtype's range, (name, thresholds): where a
    guess of the bin in float arithmetic breaks (an infinite or denormal 1/dt or 1/(T dt), or
    denormal values, which -ftz=true flushes to zero, a bin or more from the thresholds).
    Curves against them must still be exact: binned by search, not by a guess."""
    f32 = np.finfo(np.float32)
    return [
        ("float32 spaced by denormals", (7 * np.arange(9) * float(f32.smallest_subnormal)).astype(np.float32)),
        ("float32 around zero, spaced by 1.5 FLT_MIN", np.linspace(-6, 6, 9).astype(np.float32) * f32.tiny * np.float32(1.5)),
        ("float32 over its whole range", np.linspace(-3e38, 3e38, 7).astype(np.float32)),
        ("float64 spaced by denormals", 3 * np.arange(9) * np.finfo(np.float64).smallest_subnormal),
    ]


def values_near(rng, t, shape):
    """Values of t's dtype on every threshold, one step either side, between, denormal, +-0,
    +-inf and NaN."""
    dtype = t.dtype
    tiny = np.finfo(dtype).smallest_subnormal
    pool = np.concatenate([t, np.nextafter(t, dtype.type(-np.inf)), np.nextafter(t, dtype.type(np.inf)),
                           np.array([np.inf, -np.inf, np.nan, 0.0, -0.0, tiny, -tiny, 5 * tiny], dtype),
                           (float(t[0]) + rng.uniform(0, 1, t.size) * (float(t[-1]) - float(t[0]))).astype(dtype),
                           (rng.uniform(-1, 1, t.size) * np.finfo(np.float32).tiny).astype(dtype)])
    return rng.choice(pool, size=shape).astype(dtype)
