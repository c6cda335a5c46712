"""The finite-difference Jacobian determinant of a sampled map and its folding fraction.

This is the diagnostic that VoxelMorph and TransMorph report for deformation fields (the share
of voxels with det <= 0), kept here so that CPAB maps and other maps (the dense-field baseline
of the benchmarks) are judged by the same rule. For CPAB maps the exact log-Jacobian,
:func:`cutopo.cpab.log_jacobian`, is the better certificate: it cannot be wrong about folding.
"""
from __future__ import annotations

from .._array import array_module

__all__ = ["jacobian_determinant", "folding_fraction"]


def jacobian_determinant(phi):
    """det of the Jacobian of a map sampled on a pixel grid, by central differences.

    Parameters
    ----------
    phi : ndarray, shape (*spatial, K) or (B, *spatial, K), K = 2 or 3
        The map at the pixel centres (as :func:`~cutopo.cpab.transform_grid` returns it), in
        any coordinates proportional to the pixel grid per axis (unit-box or pixel units; the
        sign of the determinant does not depend on positive per-axis scales). NumPy or CuPy.

    Returns
    -------
    det : ndarray, shape phi.shape[:-1]
        ``det(d phi_k / d i_a)``, the derivative along pixel axis a taken as
        ``numpy.gradient`` does: central differences inside, one-sided at the border. In the
        units of ``phi`` per pixel (multiply by ``prod(spatial)`` for unit-box phi to get the
        volume ratio). A spatial axis of size 1 holds no difference: it is left out, i.e.
        column a of the Jacobian is taken as the unit vector e_a, so that det is the
        determinant of the block of the other axes (rows and columns), exactly what the
        samples determine (the map restricted to the grid's plane or line, in the
        coordinates along its axes). With every axis of size 1, det = 1.

    Raises
    ------
    ValueError
        ``phi`` whose last axis is not 2 or 3, or does not match its number of spatial axes.

    Convention
    ----------
    ``phi[..., k]`` is the coordinate along array axis k (the convention of
    :mod:`cutopo.cpab`); spatial axes are the K axes before the last one.

    Examples
    --------
    >>> import numpy as np
    >>> from cutopo.cpab.folding import jacobian_determinant
    >>> i, j = np.meshgrid(np.arange(4.0), np.arange(5.0), indexing="ij")
    >>> phi = np.stack([2 * i, j + 0.5 * i], axis=-1)                  # a shear and a stretch
    >>> np.unique(jacobian_determinant(phi))
    array([2.])
    """
    xp = array_module(phi)
    K = phi.shape[-1] if phi.ndim else 0
    if K not in (2, 3) or phi.ndim not in (K + 1, K + 2):
        raise ValueError(f"phi must have shape (*spatial, K) or (B, *spatial, K) with K = 2 or 3 "
                         f"spatial axes, got {phi.shape}")
    first = phi.ndim - 1 - K                                               # the first spatial axis
    # a size-1 axis gives no difference; a zero column there would make every det 0 ("folded"),
    # the unit column e_a leaves the determinant of the other axes' block
    J = [[xp.gradient(phi[..., k], axis=first + a) if phi.shape[first + a] > 1
          else xp.full(phi.shape[:-1], float(k == a), dtype=phi.dtype) for a in range(K)]
         for k in range(K)]
    if K == 2:
        return J[0][0] * J[1][1] - J[0][1] * J[1][0]
    return (J[0][0] * (J[1][1] * J[2][2] - J[1][2] * J[2][1])
            - J[0][1] * (J[1][0] * J[2][2] - J[1][2] * J[2][0])
            + J[0][2] * (J[1][0] * J[2][1] - J[1][1] * J[2][0]))


def folding_fraction(phi):
    """The share of pixels whose finite-difference Jacobian determinant is <= 0.

    Parameters
    ----------
    phi : ndarray, shape (*spatial, K) or (B, *spatial, K)
        As for :func:`jacobian_determinant`.

    Returns
    -------
    fraction : float
        In [0, 1], over all pixels (and batch items). VoxelMorph and TransMorph report it as a
        percentage ("% of |J| <= 0"). Spatial axes of size 1 are left out of the determinant
        (see :func:`jacobian_determinant`), so a one-pixel-thick volume is judged by the
        Jacobian of its slice.

    Examples
    --------
    >>> import numpy as np
    >>> from cutopo.cpab import Tessellation, transform_grid
    >>> from cutopo.cpab.folding import folding_fraction
    >>> tess = Tessellation((3, 3))
    >>> phi = transform_grid(tess.sample(1, length_scale=0.3, rng=0)[0], tess, (16, 16))
    >>> folding_fraction(phi)                                           # a CPAB map never folds
    0.0

    References
    ----------
    .. [1] G. Balakrishnan, A. Zhao, M. R. Sabuncu, J. Guttag, A. V. Dalca, "VoxelMorph: a
       learning framework for deformable medical image registration", IEEE TMI 38(8), 2019
       (``voxelmorph/py/utils.py``, ``jacobian_determinant``).
    .. [2] J. Chen, E. C. Frey, Y. He, W. P. Segars, Y. Li, Y. Du, "TransMorph: Transformer for
       unsupervised medical image registration", Medical Image Analysis 82, 2022.
    """
    det = jacobian_determinant(phi)
    return float((det <= 0).sum()) / det.size
