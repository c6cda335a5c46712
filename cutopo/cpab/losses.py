"""Image similarity losses for registration, each with its gradient written out: MSE and local NCC.

Both take the warped image and the fixed image, arrays of one array type (NumPy or CuPy) and
shape (N, C, *spatial), and return ``(value, gradient)``: the loss as a 0-d array of that
array type (no host synchronisation) and its gradient with respect to the warped image. They
are the first link of the registration's chain rule, feeding the cotangent to the VJP of the
warp.
"""
from __future__ import annotations

import numpy as np

from .._array import array_module

__all__ = ["mse", "local_ncc", "box_sum", "NCC_EPS"]

# VoxelMorph's stabiliser of the local NCC's denominator (voxelmorph/torch/losses.py, NCC).
NCC_EPS = 1e-5


def mse(warped, fixed):
    """Mean squared error ``mean((warped - fixed)**2)`` and its gradient in ``warped``.

    Parameters
    ----------
    warped, fixed : ndarray, same shape
        NumPy or CuPy arrays of one array type.

    Returns
    -------
    value : 0-d ndarray (float64 for float64 input, else the input's float dtype)
    gradient : ndarray, shape of warped
        ``2 (warped - fixed) / warped.size``.

    Examples
    --------
    >>> import numpy as np
    >>> from cutopo.cpab.losses import mse
    >>> value, grad = mse(np.array([1.0, 2.0]), np.array([0.0, 0.0]))
    >>> float(value), grad
    (2.5, array([1., 2.]))
    """
    diff = warped - fixed
    return (diff * diff).mean(), diff * (2.0 / diff.size)


def box_sum(x, window, axes):
    """Sums of ``x`` over a ``window``-wide box centred at every point, zero outside.

    Parameters
    ----------
    x : ndarray
    window : int
        Odd box width (the same on every axis of ``axes``).
    axes : sequence of int
        The axes to sum over.

    Returns
    -------
    sums : ndarray, shape and dtype of x
        ``sums[p] = sum of x[q]`` over ``|q_a - p_a| <= window // 2`` on the axes given.

    Notes
    -----
    One cumulative sum per axis (O(size), independent of the window). The operator is
    symmetric (its own transpose), which the NCC gradient relies on.
    """
    xp = array_module(x)
    r = window // 2
    for axis in axes:
        n = x.shape[axis]
        pad = [(0, 0)] * x.ndim
        pad[axis] = (r + 1, r)
        c = xp.cumsum(xp.pad(x, pad), axis=axis)
        hi = [slice(None)] * x.ndim
        lo = [slice(None)] * x.ndim
        hi[axis] = slice(2 * r + 1, 2 * r + 1 + n)
        lo[axis] = slice(0, n)
        x = c[tuple(hi)] - c[tuple(lo)]
    return x


def local_ncc(warped, fixed, window=9, eps=NCC_EPS):
    """Negative local normalised cross-correlation (VoxelMorph's NCC loss) and its gradient.

    With box sums S over the ``window``^K neighbourhood of every pixel (K spatial axes),
    cut off at the image's border, and n the number of pixels in it::

        cross = S[I J] - S[I] S[J] / n,   var_I = S[I^2] - S[I]^2 / n,   var_J likewise,
        cc = cross^2 / (var_I var_J + eps),   loss = -mean(cc),

    I the fixed image and J the warped one, the mean taken over pixels, channels and the batch.
    cc is the squared local correlation, in [0, 1); the loss is -1 for a perfect local linear
    match.

    Parameters
    ----------
    warped, fixed : ndarray, shape (N, C, *spatial)
        NumPy or CuPy arrays of one array type and one shape; 2 or 3 spatial axes.
    window : int, optional
        Odd box width in pixels (default 9, VoxelMorph's).
    eps : float, optional
        Added to the denominator (default 1e-5, VoxelMorph's).

    Returns
    -------
    value : 0-d ndarray, float64
    gradient : ndarray, float64, shape of warped
        d loss / d warped, written out (the transpose of the box sums is the box sums):
        ``S[g_IJ] I + 2 S[g_JJ] J + S[g_J]`` with the per-pixel derivatives of -cc/M by
        S[IJ], S[J^2] and S[J] (see the code).

    Notes
    -----
    Computed in float64 (the box sums are differences of cumulative sums, which float32 would
    round too coarsely on large images). Unlike VoxelMorph, whose n is the full window size
    everywhere (so that next to the border, where the box holds fewer pixels, an affine
    intensity change no longer gives cc = 1), n counts the pixels the box holds.

    Examples
    --------
    >>> import numpy as np
    >>> from cutopo.cpab.losses import local_ncc
    >>> fixed = np.random.default_rng(0).random((1, 1, 16, 16))
    >>> value, grad = local_ncc(2 * fixed + 1, fixed, window=5)        # an affine relation
    >>> bool(float(value) < -0.9999), grad.shape
    (True, (1, 1, 16, 16))

    References
    ----------
    .. [1] G. Balakrishnan, A. Zhao, M. R. Sabuncu, J. Guttag, A. V. Dalca, "VoxelMorph: a
       learning framework for deformable medical image registration", IEEE TMI 38(8), 2019
       (``voxelmorph/torch/losses.py``, class NCC).
    .. [2] B. B. Avants, C. L. Epstein, M. Grossman, J. C. Gee, "Symmetric diffeomorphic image
       registration with cross-correlation", Medical Image Analysis 12(1), 2008.
    """
    I = fixed.astype(np.float64)
    J = warped.astype(np.float64)
    axes = tuple(range(2, J.ndim))
    xp = array_module(J)
    n = box_sum(xp.ones((1, 1) + J.shape[2:]), window, axes)         # pixels in each box
    S_I, S_J = box_sum(I, window, axes), box_sum(J, window, axes)
    S_II, S_JJ, S_IJ = (box_sum(I * I, window, axes), box_sum(J * J, window, axes),
                        box_sum(I * J, window, axes))
    cross = S_IJ - S_I * S_J / n
    var_I = S_II - S_I * S_I / n
    var_J = S_JJ - S_J * S_J / n
    denominator = var_I * var_J + eps
    cc = cross * cross / denominator
    # d loss / d cc = -1 / M; then through cross (S_IJ, S_J) and var_J (S_JJ, S_J)
    scale = -1.0 / cc.size
    g_cross = scale * 2 * cross / denominator
    g_var_J = scale * (-cross * cross * var_I / (denominator * denominator))
    g_IJ = g_cross
    g_JJ = g_var_J
    g_J = g_cross * (-S_I / n) + g_var_J * (-2 * S_J / n)
    gradient = (box_sum(g_IJ, window, axes) * I + 2 * box_sum(g_JJ, window, axes) * J
                + box_sum(g_J, window, axes))
    return -cc.mean(), gradient
