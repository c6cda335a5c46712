"""Exact expected Euler characteristic of a random binary image with independent pixels.

Both cubical complexes of :func:`cutopo.ecc` are handled by one mechanism. A cell is a box
spanned by a set S of axes over a *base* array B: its ``2**len(S)`` corners are entries of B
and its box product is the product of B over them.

* V construction (``connectivity=1``): B = p, the pixels are the vertices; a cell of type S is
  present with probability ``prod_{corners} p`` and has dimension ``len(S)``.
* T construction (``connectivity=ndim``): B = q = 1 - p padded by one outside ring of ones
  (pixels outside the image are never 1). A lower cell of the pixel grid whose *vertex* axes
  are S and whose interval axes are the others is adjacent to a box of type S of pixels; it is
  absent with probability ``prod_{adjacent} q`` and has dimension ``ndim - len(S)``. Along the
  interval axes only the image's own positions count (not the outside ring).

The derivative of a box product with respect to one corner is the product of the *other*
corners, formed exactly (no division) as a product of ``len(S)`` sub-box products: ordering S
increasingly, the other corners are split by the first axis on which they differ from the
chosen corner, and each part is a box over the later axes of S.

This module is the NumPy path (CPU fallback and test oracle); CuPy arrays run the kernels of
``cuda_src/ecc_expected.cuh`` through :mod:`cutopo._expected_euler_cupy`, which form the same
products directly per cell.
"""
from __future__ import annotations

import itertools

import numpy as np

from . import _expected_euler_cupy
from ._array import array_module, as_array, is_cupy_array
from ._checks import check_connectivity, check_image
from ._cuda.launch import on_device_of
from ._cuda.repeated import RepeatedCalls
from .vjp import register

__all__ = ["expected_euler"]

_FLOAT_DTYPES = (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64))


# ----------------------------------------------------------------------------- validation

def _validate(prob, ndim, connectivity):
    """Checked (prob, ndim, tconn, compute dtype); prob keeps its own dtype."""
    prob = as_array(prob, "prob")
    if prob.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"prob: dtype {prob.dtype} is not supported; probabilities must be "
                        f"float16, float32 or float64")
    try:
        prob, ndim = check_image(prob, ndim)
    except ValueError as exc:
        raise ValueError(str(exc).replace("the image", "prob").replace("image", "prob")) from None
    tconn = check_connectivity(connectivity, ndim)
    if prob.size and not is_cupy_array(prob):  # CuPy: the forward kernel checks the values
        _check_unit_interval(prob)
    cdtype = np.dtype(np.float64) if prob.dtype == np.float64 else np.dtype(np.float32)
    return prob, ndim, tconn, cdtype


def _check_unit_interval(prob) -> None:
    """Raise the ValueError of values outside [0, 1] or NaN in ``prob`` (a NumPy array, or a
    CuPy one whose forward kernel flagged them)."""
    xp = array_module(prob)
    lo, hi = float(xp.min(prob)), float(xp.max(prob))
    # NumPy's min/max propagate NaN; CuPy's depend on the reduction backend, so a CuPy array
    # is searched for NaN explicitly.
    if lo != lo or hi != hi or (xp is not np and bool(xp.isnan(prob).any())):
        raise ValueError("prob: contains NaN; probabilities must lie in [0, 1]")
    if lo < 0 or hi > 1:
        raise ValueError(f"prob: values must lie in [0, 1], found range [{lo}, {hi}]")


# ----------------------------------------------------------------------------- cell geometry

def _spatial(ndim, per_axis):
    """Index tuple: all batch axes, then ``per_axis[a]`` (a slice) for each spatial axis."""
    return (Ellipsis,) + tuple(per_axis)


def _base(p, ndim, tconn):
    """The base array B and the trim along non-box axes (0 for V, 1 for T)."""
    if not tconn:
        return p, 0
    pad = [(0, 0)] * (p.ndim - ndim) + [(1, 1)] * ndim
    return np.pad(1 - p, pad, constant_values=1), 1


def _box_step(w, ndim, axis):
    """Box products one axis longer: pair products of neighbours along spatial ``axis``."""
    n = w.shape[w.ndim - ndim + axis]
    lo = [slice(None)] * ndim
    hi = [slice(None)] * ndim
    lo[axis] = slice(0, n - 1)
    hi[axis] = slice(1, n)
    return w[_spatial(ndim, lo)] * w[_spatial(ndim, hi)]


def _trimmed(w, ndim, box_axes, trim):
    """Restrict ``w`` to the image's own positions along the axes outside the box."""
    if not trim:
        return w
    return w[_spatial(ndim, [slice(None) if a in box_axes else slice(trim, -trim)
                             for a in range(ndim)])]


def _sign(ndim, tconn, k):
    """(-1)^dim of a cell of box type with k axes."""
    dim = ndim - k if tconn else k
    return -1.0 if dim % 2 else 1.0


# ----------------------------------------------------------------------------- forward

def _expected(p, ndim, tconn):
    """E[chi], shape batch; p is in the compute dtype."""
    base, trim = _base(p, ndim, tconn)
    axes = tuple(range(-ndim, 0))
    total = np.zeros(p.shape[:p.ndim - ndim], dtype=np.float64)

    # Depth-first over box types, each one axis larger than its parent (its largest axis is
    # new), so at most ndim + 1 box-product arrays are alive at once.
    def visit(w, box_axes):
        cells = _trimmed(w, ndim, box_axes, trim)
        s = cells.sum(axis=axes, dtype=np.float64)
        if tconn:  # P(cell present) = 1 - P(all adjacent pixels are 0)
            s = float(np.prod(cells.shape[cells.ndim - ndim:])) - s
        total[...] += _sign(ndim, tconn, len(box_axes)) * s
        start = box_axes[-1] + 1 if box_axes else 0
        for a in range(start, ndim):
            visit(_box_step(w, ndim, a), box_axes + (a,))

    visit(base, ())
    return total.astype(p.dtype)


# _validate's result for a CuPy call by what it reads (cutopo._cuda.repeated): prob's shape and
# dtype on the current device, ndim and connectivity (its values are the forward kernel's to
# check, at every call), so a loss in a training loop skips those checks.
_DEVICE_CALLS = RepeatedCalls()


def _forward(prob, *, ndim=None, connectivity=1):
    key = _DEVICE_CALLS.key((prob,), (ndim, connectivity))
    checked = _DEVICE_CALLS.get(key) if key is not None else None
    if checked is None:
        prob, ndim, tconn, cdtype = _validate(prob, ndim, connectivity)
        if key is not None:
            _DEVICE_CALLS.keep(key, (ndim, tconn, cdtype))
    else:
        ndim, tconn, cdtype = checked
    if is_cupy_array(prob):
        with on_device_of(prob):
            out, flagged = _expected_euler_cupy.expected(prob, ndim, tconn)  # in cdtype
            if flagged:
                _check_unit_interval(prob)
                raise AssertionError("internal: the kernel flagged prob, the host check passed")
    else:
        out = _expected(prob.astype(cdtype, copy=False), ndim, tconn)
    return out, (prob, ndim, tconn)


# ----------------------------------------------------------------------------- backward

def _gradient(p, ndim, tconn):
    """dE[chi]/dp (shape and dtype of p): sum over cells containing each pixel of
    (-1)^dim times the product of the other factors of the cell."""
    base, trim = _base(p, ndim, tconn)
    L = base.shape[base.ndim - ndim:]
    # Box products over every set of axes that excludes axis 0: the "later axes" sub-boxes.
    boxes = {(): base}
    for T in sorted((t for k in range(1, ndim) for t in itertools.combinations(range(1, ndim), k)),
                    key=len):
        boxes[T] = _box_step(boxes[T[:-1]], ndim, T[-1])
    grad = np.zeros_like(base)
    inner = [slice(trim, L[a] - trim) for a in range(ndim)]

    for k in range(ndim + 1):
        sign = _sign(ndim, tconn, k)
        for S in itertools.combinations(range(ndim), k):
            for delta in itertools.product((0, 1), repeat=k):
                d = dict(zip(S, delta))
                # Where the chosen corner lies, for every cell (lower corner y) of type S.
                target = [slice(d[a], d[a] + L[a] - 1) if a in d else inner[a] for a in range(ndim)]
                view = grad[_spatial(ndim, target)]
                if k == 0:
                    view += sign
                    continue
                q = None
                for j, s in enumerate(S):
                    later = S[j + 1:]
                    # Corners equal to delta on S[:j], opposite on S[j], free on the later axes.
                    shift = {a: d[a] for a in S[:j]}
                    shift[s] = 1 - d[s]
                    idx = [slice(None) if a in later
                           else slice(shift[a], shift[a] + L[a] - 1) if a in shift
                           else inner[a] for a in range(ndim)]
                    part = boxes[later][_spatial(ndim, idx)]
                    q = part.copy() if q is None else np.multiply(q, part, out=q)
                if sign > 0:
                    view += q
                else:
                    view -= q
    return grad[_spatial(ndim, inner)] if trim else grad


def _backward(residuals, cotangent, needs):
    prob, ndim, tconn = residuals
    if not needs[0]:
        return (None,)
    if is_cupy_array(prob):
        with on_device_of(prob):
            return (_expected_euler_cupy.gradient(prob, ndim, tconn, cotangent),)
    cdtype = np.dtype(np.float64) if prob.dtype == np.float64 else np.dtype(np.float32)
    cotangent = np.asarray(cotangent, dtype=cdtype)
    g = _gradient(prob.astype(cdtype, copy=False), ndim, tconn)
    g *= cotangent.reshape(cotangent.shape + (1,) * ndim)
    return (g.astype(prob.dtype, copy=False),)


def _meta(prob, *, ndim=None, connectivity=1):
    """Output (shape, dtype) from the argument's shape and dtype (see cutopo.vjp.OpSpec).

    First the op's checks (_validate: dtype, rank, ndim, connectivity) on a data-free stand-in
    of zeros, so that a bad argument raises the op's own error before the op runs; its check of
    the values reads the stand-in (one pass over a broadcast 0), never the data."""
    from ._adapters import stand_in

    _validate(stand_in(prob), ndim, connectivity)
    spatial = prob.ndim if ndim is None else ndim
    wide = prob.dtype == np.float64
    return tuple(prob.shape[:prob.ndim - spatial]), np.dtype(np.float64 if wide else np.float32)


# ----------------------------------------------------------------------------- public op

@register(name="expected_euler", forward=_forward, backward=_backward,
          arg_names=("prob",), differentiable=("prob",), meta=_meta)
def expected_euler(prob, *, ndim=None, connectivity=1):
    """Exact expected Euler characteristic of a random binary image with independent pixels.

    Pixel x of the random image is 1 (foreground) with probability ``prob[x]``, independently
    of the others. The Euler characteristic of the foreground is the alternating count of the
    cells of a cubical complex, so by linearity of expectation its mean is exact and
    multilinear in ``prob``:

    * ``connectivity=1`` (V construction: pixels are vertices, a cell is present iff all its
      vertices are 1): ``E[chi] = sum_cells (-1)^dim prod_{vertices v} prob[v]``.
    * ``connectivity=ndim`` (T construction: pixels are closed unit squares/cubes, a lower cell
      is present iff at least one adjacent pixel is 1):
      ``E[chi] = sum_cells (-1)^dim (1 - prod_{adjacent pixels x} (1 - prob[x]))``.

    For a 0/1 ``prob`` this is ``skimage.measure.euler_number(prob > 0.5, connectivity)``. The
    function is smooth (a polynomial), needs no temperature, and is differentiable through
    :func:`cutopo.vjp`: the derivative with respect to ``prob[x]`` is the sum, over the cells
    involving x, of (-1)^dim times the product of the cell's other factors (formed exactly,
    without dividing by ``prob``).

    Parameters
    ----------
    prob : ndarray, shape (*batch, *spatial)
        NumPy or CuPy array of dtype float16, float32 or float64 with values in [0, 1] (NaN is
        rejected). The last ``ndim`` axes are spatial; leading axes are a batch. float16 is
        computed in float32. CuPy arrays run CUDA kernels on the array's device, NumPy arrays
        the vectorised NumPy path.
    ndim : {None, 2, 3}, optional
        Number of trailing spatial axes. ``None`` means ``prob.ndim``, which must be 2 or 3.
    connectivity : {1, ndim}, optional
        ``1``: V construction (4-connected foreground in 2D, 6-connected in 3D). ``ndim``: T
        construction (8- / 26-connected), as in :func:`cutopo.ecc`.

    Returns
    -------
    chi : ndarray of float32 or float64, shape (*batch,)
        The expected Euler characteristic of every image of the batch (a 0-d array when there
        is no batch), of the array type of ``prob``, float64 for float64 input and float32
        otherwise. Cell terms are accumulated in float64 (per cell type on the CPU, per thread
        and block on the GPU, so the two agree to rounding, not bit for bit). The cotangent of
        ``prob`` has its dtype (float16 included).

    Raises
    ------
    TypeError
        ``prob`` is not a floating array (integer and bool arrays are refused).
    ValueError
        Wrong shape or ``ndim``, values outside [0, 1] or NaN, or a connectivity other than
        1 or ``ndim``. For a CuPy array the forward kernel checks the values as it reads them
        and stores its flag in page-locked host memory, which the call reads (waiting for
        that kernel) before it returns; only a failed check reads the array's range for the
        message.

    Notes
    -----
    NumPy: O(3^ndim) vectorised passes over the image: the forward forms the box products
    of every cell type (at most ndim + 1 of them alive at once); the backward recomputes
    the box products over the axes other than the first (2^(ndim-1) arrays) and adds the
    products of the other factors of every (cell type, corner) pair at the corner's pixel.
    CUDA: one pass each, no temporary arrays. The forward sums the cells of every type by
    their anchor (the lowest corner), reduced per block into one atomic add per image; the
    backward gathers for each pixel the 3^ndim cells through it (no atomics). In 2D a thread
    takes one anchor or pixel; in 3D one walks a column of 16 along the first axis, loading
    each plane of the neighbourhood once.

    Convention: array axes are spatial axes in C order (``(rows, cols)`` in 2D,
    ``(planes, rows, cols)`` in 3D); positions outside the image are empty (probability 0).
    In the V construction only cells whose vertices all lie inside the image exist; in the
    T construction the faces, edges and vertices on the image border are included.

    Examples
    --------
    >>> import numpy as np, cutopo
    >>> ring = np.array([[1.0, 1.0, 1.0],
    ...                  [1.0, 0.0, 1.0],
    ...                  [1.0, 1.0, 1.0]])
    >>> cutopo.expected_euler(ring)                       # one component, one hole
    array(0.)
    >>> diagonal = np.array([[1.0, 0.0], [0.0, 1.0]])
    >>> cutopo.expected_euler(diagonal), cutopo.expected_euler(diagonal, connectivity=2)
    (array(2.), array(1.))
    >>> half = np.full((2, 2), 0.5)                       # 4/2 - 4/4 + 1/16
    >>> cutopo.expected_euler(half)
    array(1.0625)
    >>> out, pullback = cutopo.vjp(cutopo.expected_euler, half)
    >>> pullback(np.ones_like(out))[0]                    # 1 - 2 * 0.5 + 0.125 per pixel
    array([[0.125, 0.125],
           [0.125, 0.125]])

    References
    ----------
    .. [1] R. A. Neher, K. Mecke, H. Wagner, "Topological estimation of percolation
       thresholds", arXiv:0708.3250 (mean Euler characteristic of Bernoulli site percolation
       patterns on lattices, as an alternating sum over cells).
    .. [2] O. Bobrowski, P. Skraba, "Homological percolation and the Euler characteristic",
       arXiv:1910.10146 (expected Euler characteristic curves of site percolation on cubical
       lattices).
    .. [3] The "chi" variant of the ECT loss in ScrollPrize/villa
       (``vesuvius/src/vesuvius/models/training/loss/ect_loss.py``, PR #519), which uses the
       T-construction cell probability ``1 - prod (1 - q)`` of a voxel probability map.
    """
    return _forward(prob, ndim=ndim, connectivity=connectivity)[0]
