"""Exact ECC and ECT of Dask arrays (NumPy or CuPy chunks), chunk by chunk, exactly.

``cutopo.dask.ecc(darr, thresholds)`` and ``cutopo.dask.ect(dmask, directions, thresholds)``
return lazy Dask arrays equal to :func:`cutopo.ecc` / :func:`cutopo.ect` of the whole array.
They run under any Dask scheduler: the threaded default, ``dask.distributed`` and
``dask_cuda.LocalCUDACluster`` (one worker per GPU, CuPy chunks on each worker's device).
Install with ``pip install 'cutopo[dask]'``; ``import cutopo`` does not import Dask.

How the chunks split the work without counting a cell twice. Each pixel p contributes c(p),
the signed count of the cells it owns, and c(p) depends only on p's 3^ndim neighbourhood. Along
every chunked spatial axis, call a coordinate a *seam* coordinate when it is next to an
internal chunk boundary s (it is s - 1 or s). Then:

* every chunk task histograms, from the chunk alone (no copy, no halo), the pixels none of whose
  coordinates is a seam coordinate: their whole neighbourhood is in the chunk (or beyond the
  volume's border);
* for each axis a and internal boundary s along a, a *face* task reads the thin slab of planes
  [s - 2, s + 2) along a (the full extent of the other axes, a few planes) and histograms the
  pixels whose first seam axis is a and whose seam coordinate along a belongs to s.

So every pixel is counted by exactly one task, with its whole neighbourhood at hand, and only
the seams (four planes per internal boundary) are copied. The per-task histograms (int64,
shape (*batch, T)) are added by Dask's tree reduction, then cumulated. The kernels are those of
the out-of-core path: ``ecc_histogram_masked`` (CuPy chunks) and
:func:`cutopo._ecc_numpy.owned_histogram` (NumPy chunks).
"""
from __future__ import annotations

import math

import numpy as np

try:
    import dask.array as da
except ImportError as exc:  # pragma: no cover - exercised in a process without dask
    raise ImportError("cutopo.dask needs Dask: install it with pip install 'cutopo[dask]' (or "
                      "pip install 'dask[array]'; add 'distributed' for clusters)") from exc

from . import _ecc_numpy
from ._array import is_cupy_array, to_numpy
from ._checks import IMAGE_DTYPES, check_connectivity, check_thresholds

__all__ = ["ecc", "ect"]


# ---------------------------------------------------------------------------------------------
# Validation and the seam bookkeeping


def _check_dask(x, name):
    if not isinstance(x, da.Array):
        raise TypeError(f"{name} must be a dask.array.Array, got {type(x).__name__} (use cutopo.ecc "
                        "for NumPy and CuPy arrays)")
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


def _check_boundary(boundary):
    if not isinstance(boundary, str):
        raise TypeError(f"boundary must be 'box' or 'periodic', got {boundary!r}")
    if boundary == "periodic":
        raise NotImplementedError("cutopo.dask: periodic boundaries are not supported yet (the "
                                  "streamed path supports them: cutopo.ecc(memmap_or_zarr, ..., "
                                  "boundary='periodic'))")
    if boundary != "box":
        raise ValueError(f"boundary must be 'box' or 'periodic', got {boundary!r}")


class _Axis:
    """The seams of one spatial axis: its chunk starts, seam coordinates and their owners."""

    def __init__(self, chunks):
        self.chunks = tuple(int(c) for c in chunks)
        self.starts = np.concatenate([[0], np.cumsum(self.chunks)]).astype(int)
        self.n = int(self.starts[-1])
        self.boundaries = [int(s) for s in self.starts[1:-1]]
        self.seam = np.zeros(self.n, dtype=bool)
        # owner[i]: the boundary that counts seam coordinate i (the first one it is next to).
        self.owner = np.full(self.n, -1, dtype=np.int64)
        for s in self.boundaries:
            for i in (s - 1, s):
                self.seam[i] = True
                if self.owner[i] < 0:
                    self.owner[i] = s


def _axes(x, ndim):
    return [_Axis(c) for c in x.chunks[x.ndim - ndim:]]


def _face_arrays(x, ndim, axes):
    """[(axis a, boundary s, first plane r0, the thin dask array)] of every internal boundary:
    planes [s - 2, s + 2) along a, every spatial axis in one chunk (batch chunks kept)."""
    lead = x.ndim - ndim
    faces = []
    for a, ax in enumerate(axes):
        for s in ax.boundaries:
            r0, r1 = max(s - 2, 0), min(s + 2, ax.n)
            index = [slice(None)] * x.ndim
            index[lead + a] = slice(r0, r1)
            thin = x[tuple(index)].rechunk({lead + b: -1 for b in range(ndim)})
            faces.append((a, s, r0, thin))
    return faces


def _chunk_masks(axes, block_id, lead):
    """Owned masks of a chunk: the coordinates that are no seam coordinate, per axis
    (``block_id``: the chunk's index, ``lead`` batch axes first; trailing output axes ignored)."""
    masks = []
    for a, ax in enumerate(axes):
        i = block_id[lead + a]
        c0, c1 = ax.starts[i], ax.starts[i + 1]
        masks.append(~ax.seam[c0:c1])
    return masks


def _face_masks(axes, a, s, r0, r1):
    """Owned masks of face (a, s), planes [r0, r1) along a: its own seam coordinates along a,
    the non-seam coordinates of the axes before a, everything along the axes after a."""
    masks = []
    for b, ax in enumerate(axes):
        if b < a:
            masks.append(~ax.seam)
        elif b == a:
            masks.append(ax.owner[r0:r1] == s)
        else:
            masks.append(np.ones(ax.n, dtype=bool))
    return masks


def _per_block(x, ndim, fn, tail, dtype, meta, *, offsets=None):
    """``fn(block, block_id)`` on every block -> arrays (*batch_block, 1 per spatial axis,
    *tail), summed over the spatial block axes by Dask's tree reduction: (*batch, *tail)."""
    lead = x.ndim - ndim
    chunks = tuple(x.chunks[:lead]) + tuple((1,) * len(c) for c in x.chunks[lead:]) + tuple(
        (n,) for n in tail)
    per = x.map_blocks(fn, chunks=chunks, dtype=dtype, meta=meta,
                       new_axis=list(range(x.ndim, x.ndim + len(tail))))
    return per.sum(axis=tuple(range(lead, x.ndim)), dtype=dtype)


def _meta(x, ndim_out):
    if is_cupy_array(getattr(x, "_meta", None)):
        import cupy

        return cupy.empty((0,) * ndim_out, dtype=np.int64)
    return np.empty((0,) * ndim_out, dtype=np.int64)


def _cumsum(total):
    return total.map_blocks(_cumsum_last, dtype=np.int64)


def _cumsum_last(h):
    return h.cumsum(axis=-1)


# ---------------------------------------------------------------------------------------------
# ECC


def _ecc_block(block, t, ndim, tconn, masks, out_shape):
    """(*batch, 1, ..., 1, T) int64 histogram of the owned pixels of one block."""
    T = int(t.size)
    if not all(m.any() for m in masks):
        xp = np if not is_cupy_array(block) else _cupy()
        return xp.zeros(out_shape, dtype=np.int64)
    if is_cupy_array(block):
        cupy = _cupy()
        from . import _ecc_cupy

        nimg = math.prod(block.shape[:block.ndim - ndim])
        with block.device:
            hist = cupy.zeros((nimg, T), dtype=np.int64)
            _ecc_cupy.masked_histogram(block, t, ndim, tconn, masks, hist)
        return hist.reshape(out_shape)
    return _ecc_numpy.owned_histogram(np.asarray(block), t, ndim, tconn, masks).reshape(out_shape)


def _cupy():
    import cupy

    return cupy


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
    boundary : {"box"}, optional
        ``"periodic"`` raises NotImplementedError here (the streamed path of :func:`cutopo.ecc`
        supports it).

    Returns
    -------
    curve : dask.array.Array of int64, shape (*batch, T)
        Lazy, in one chunk along T, with chunks of the input's type (NumPy or CuPy); call
        ``.compute()`` (or ``dask.compute`` on many curves at once).

    Examples
    --------
    >>> import numpy as np, dask.array as da, cutopo, cutopo.dask
    >>> image = np.random.default_rng(0).integers(0, 8, (60, 50)).astype(np.uint8)
    >>> darr = da.from_array(image, chunks=(17, (20, 30)))
    >>> curve = cutopo.dask.ecc(darr, [1, 3, 5, 7])
    >>> bool((curve.compute() == cutopo.ecc(image, [1, 3, 5, 7])).all())
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
    _check_boundary(boundary)
    probe = np.empty(0, dtype=x.dtype)
    if isinstance(thresholds, (int, np.integer)) and not isinstance(thresholds, (bool, np.bool_)):
        thresholds = _linear_thresholds(x, thresholds)
    elif is_cupy_array(thresholds):
        thresholds = to_numpy(thresholds)
    t, _ = check_thresholds(thresholds, probe)
    T = int(t.size)
    lead = x.ndim - ndim
    axes = _axes(x, ndim)
    meta = _meta(x, lead + ndim + 1)

    def chunk_task(block, block_id=None):
        masks = _chunk_masks(axes, block_id, lead)
        return _ecc_block(block, t, ndim, tconn, masks, block.shape[:lead] + (1,) * ndim + (T,))

    total = _per_block(x, ndim, chunk_task, (T,), np.int64, meta)
    for a, s, r0, thin in _face_arrays(x, ndim, axes):
        r1 = r0 + thin.shape[lead + a]
        masks = _face_masks(axes, a, s, r0, r1)

        def face_task(block, masks=masks):
            return _ecc_block(block, t, ndim, tconn, masks, block.shape[:lead] + (1,) * ndim + (T,))

        total = total + _per_block(thin, ndim, face_task, (T,), np.int64, meta)
    return _cumsum(total)


def _linear_thresholds(x, n):
    """cutopo.linear_thresholds of a Dask array (computed now: one pass)."""
    import dask

    if n < 1:
        raise ValueError(f"thresholds: the count must be at least 1, got {n}")
    if x.dtype.kind == "f":
        finite = da.isfinite(x)
        lo, hi = dask.compute(da.where(finite, x, np.inf).min(), da.where(finite, x, -np.inf).max())
        lo, hi = float(to_numpy(lo)), float(to_numpy(hi))
        if not lo <= hi:
            raise ValueError("darr: no finite pixel to derive thresholds from; pass explicit "
                             "thresholds")
        return np.linspace(lo, hi, int(n)).astype(x.dtype)
    lo, hi = dask.compute(x.min(), x.max())
    return np.linspace(float(to_numpy(lo)), float(to_numpy(hi)), int(n))


# ---------------------------------------------------------------------------------------------
# ECT


def _ect_block(block, dirs64, coords, t, tconn, masks, out_shape):
    """(*batch, 1, ..., 1, D, T) int64 ECT curves of the owned pixels of one block, at the
    block's positions ``coords`` in the volume."""
    spatial = tuple(block.shape[len(block.shape) - len(coords):])
    if not all(m.any() for m in masks):
        xp = _cupy() if is_cupy_array(block) else np
        return xp.zeros(out_shape, dtype=np.int64)
    mask_b = block.reshape((-1,) + spatial)
    mask_b = mask_b if mask_b.dtype == np.bool_ else mask_b != 0
    if is_cupy_array(block):
        from . import _band_cupy

        cupy = _cupy()
        with block.device:
            out, _ = _band_cupy.ect_forward(cupy.ascontiguousarray(mask_b), dirs64, coords, t,
                                            tconn, soft=False, own=masks)
        return out.reshape(out_shape)
    from . import _ect

    return _ect.curves(np.asarray(mask_b), dirs64, coords, t, tconn, masks).reshape(out_shape)


def ect(dmask, directions, thresholds, *, connectivity=1, boundary="box"):
    """Exact Euler characteristic transform of a Dask mask, chunk by chunk (lazy).

    Equal, exactly, to ``cutopo.ect(dmask.compute(), directions, thresholds, ...)``: every
    chunk and face task works at its pixels' positions in the whole volume.

    Parameters
    ----------
    dmask : dask.array.Array, shape (*batch, *spatial)
        NumPy or CuPy chunks of dtype bool or integer (non-zero is foreground), chunked any way;
        ``ndim = directions.shape[1]`` trailing spatial axes.
    directions : array-like, shape (D, ndim)
    thresholds : int or 1-D array
    connectivity : {1, ndim}, optional
        As for :func:`cutopo.ect` (host values; a count needs no pass over the data).
    boundary : {"box"}, optional
        ``"periodic"`` raises NotImplementedError here.

    Returns
    -------
    transform : dask.array.Array of int64, shape (*batch, D, T)
        Lazy; chunks of the input's type.

    Examples
    --------
    >>> import numpy as np, dask.array as da, cutopo, cutopo.dask
    >>> mask = np.random.default_rng(1).random((40, 30)) < 0.6
    >>> dirs = [[1.0, 0.0], [0.6, 0.8]]
    >>> lazy = cutopo.dask.ect(da.from_array(mask, chunks=(15, 12)), dirs, 16)
    >>> bool((lazy.compute() == cutopo.ect(mask, dirs, 16)).all())
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
    _check_boundary(boundary)
    coords = _ect._axis_coordinates(spatial)
    reach, _, _ = _ect._reach(coords, dirs64)
    if not math.isfinite(reach):
        raise ValueError("directions: too large, the pixel heights overflow float64")
    t, _ = _ect._check_thresholds(thresholds, coords, dirs64)
    D, T = dirs64.shape[0], int(t.size)
    lead = x.ndim - ndim
    axes = _axes(x, ndim)
    meta = _meta(x, lead + ndim + 2)

    def chunk_task(block, block_id=None):
        masks = _chunk_masks(axes, block_id, lead)
        block_coords = []
        for a, ax in enumerate(axes):
            i = block_id[lead + a]
            block_coords.append(coords[a][ax.starts[i]:ax.starts[i + 1]])
        return _ect_block(block, dirs64, block_coords, t, tconn, masks,
                          block.shape[:lead] + (1,) * ndim + (D, T))

    total = _per_block(x, ndim, chunk_task, (D, T), np.int64, meta)
    for a, s, r0, thin in _face_arrays(x, ndim, axes):
        r1 = r0 + thin.shape[lead + a]
        masks = _face_masks(axes, a, s, r0, r1)
        face_coords = [c if b != a else c[r0:r1] for b, c in enumerate(coords)]

        def face_task(block, masks=masks, face_coords=face_coords):
            return _ect_block(block, dirs64, face_coords, t, tconn, masks,
                              block.shape[:lead] + (1,) * ndim + (D, T))

        total = total + _per_block(thin, ndim, face_task, (D, T), np.int64, meta)
    return total
