"""Exact prolongation of theta from a coarse tessellation to a nested finer one (coarse to fine).

A CPA field is affine on every coarse simplex. When every fine simplex lies inside one coarse
simplex (the fine mesh *nests* in the coarse one), the coarse field is also affine on every
fine simplex, so it is a CPA field of the fine tessellation: its fine nodal values are the
coarse field at the fine vertices, and nothing is lost. Which refinements nest:

* 1D: any integer factor per axis.
* 2D (4 triangles around each box centre): the same integer factor r on both axes. In box
  units the triangle edges lie on the box lines and on the diagonals ``x - y = m`` and
  ``x + y = m`` (m integer: box (i, j)'s diagonals are ``x - y = i - j`` and
  ``x + y = i + j + 1``); scaling by r sends them to ``... = r m``, fine diagonals. Different
  factors per axis tilt the coarse diagonals across fine triangles.
* 3D (5 tetrahedra per box, corner labels rotated in odd boxes): the same integer factor r on
  all axes, even or odd. In box units the faces of the tetrahedra are the box faces and the
  planes ``+-x +-y +-z = m`` with m **even** (an even box's four corner-cutting planes are
  ``x + y + z = 2`` and ``x - y - z = 0`` up to the signs, shifted by the box index; the
  rotated labels of an odd box keep the constant even). Scaling by r sends a coarse plane
  ``... = m`` to ``... = r m``, still even: every coarse face is a union of fine faces. (The
  research notes, cpab.md 3, expected even factors to break the parity pattern; the plane
  description shows they do not, and the tests confirm it.) Different factors per axis tilt
  those planes across fine tetrahedra.

The tests check these rules by comparing the two fields at random points.
"""
from __future__ import annotations

import numpy as np
import scipy.sparse

from .._array import array_module, is_cupy_array
from .basis import barycentric_coefficients
from .tessellation import Tessellation, cell_index

__all__ = ["prolong", "prolongation_matrix", "refinement_factor"]


def refinement_factor(coarse, fine):
    """The per-axis factors ``fine.shape / coarse.shape`` of a nesting refinement.

    Parameters
    ----------
    coarse, fine : Tessellation

    Returns
    -------
    factors : tuple of int

    Raises
    ------
    TypeError
        Arguments that are not :class:`Tessellation` objects.
    ValueError
        Tessellations of different dimensions or boundary conditions, or a refinement that does
        not nest (see the module docstring): factors that are not integers, or factors that
        differ between axes in 2D and 3D.

    Examples
    --------
    >>> from cutopo.cpab import Tessellation
    >>> from cutopo.cpab.prolong import refinement_factor
    >>> refinement_factor(Tessellation((2, 3)), Tessellation((4, 6)))
    (2, 2)
    >>> refinement_factor(Tessellation((2, 2, 2)), Tessellation((4, 4, 4)))
    (2, 2, 2)
    """
    for name, t in (("coarse", coarse), ("fine", fine)):
        if not isinstance(t, Tessellation):
            raise TypeError(f"{name} must be a cutopo.cpab.Tessellation, got {type(t).__name__}")
    if coarse.ndim != fine.ndim:
        raise ValueError(f"coarse is {coarse.ndim}-D and fine {fine.ndim}-D")
    if coarse.zero_boundary != fine.zero_boundary:
        raise ValueError(f"coarse and fine have different boundary conditions "
                         f"({coarse.zero_boundary!r} and {fine.zero_boundary!r})")
    if any(f % c for c, f in zip(coarse.shape, fine.shape)):
        raise ValueError(f"fine shape {fine.shape} is not an integer multiple of the coarse shape "
                         f"{coarse.shape} on every axis")
    factors = tuple(f // c for c, f in zip(coarse.shape, fine.shape))
    if fine.ndim >= 2 and len(set(factors)) > 1:
        raise ValueError(f"coarse {coarse.shape} -> fine {fine.shape}: the factors {factors} must "
                         f"be equal on every axis in {fine.ndim}-D (otherwise the diagonal faces "
                         f"of the coarse cells cut through fine cells)")
    return factors


def prolongation_matrix(coarse, fine):
    """The sparse matrix P with ``theta_fine = P @ theta_coarse`` (exact for nesting refinements).

    Row j of P (fine parameter j: component k of fine vertex v) holds the barycentric weights
    of v in the coarse cell that contains it, in the columns of that cell's vertices'
    component k (fixed components drop out: they are zero).

    Parameters
    ----------
    coarse, fine : Tessellation
        A nesting pair (checked by :func:`refinement_factor`).

    Returns
    -------
    P : scipy.sparse.csr_matrix, shape (fine.n_params, coarse.n_params), float64
    """
    refinement_factor(coarse, fine)
    K = fine.ndim
    # Fine vertices as exact rationals of the coarse grid: the cell lookup sees exact positions
    # for vertices on coarse faces, and either neighbour's map gives the same (continuous) field.
    x = fine.vertices[fine.dof_vertex]                                  # (d_f, K)
    cells = cell_index(x, coarse.shape)                                 # (d_f,)
    coef = barycentric_coefficients(coarse)[cells]                      # (d_f, K+1, K+1)
    weights = np.einsum("jlq,jq->jl", coef[:, :, :K], x) + coef[:, :, K]   # lambda_l(x_v)
    weights[np.abs(weights) < 1e-12] = 0.0                              # rounding of exact zeros
    columns = coarse.dof_index[coarse.cells[cells], fine.dof_axis[:, None]]  # (d_f, K+1)
    keep = (columns >= 0) & (weights != 0)
    rows = np.broadcast_to(np.arange(len(x))[:, None], keep.shape)
    P = scipy.sparse.csr_matrix((weights[keep], (rows[keep], columns[keep])),
                                shape=(fine.n_params, coarse.n_params))
    P.sum_duplicates()
    return P


def prolong(theta, coarse, fine):
    """theta of ``coarse`` as a parameter vector of the nested finer ``fine``: the same field.

    Parameters
    ----------
    theta : ndarray, shape (coarse.n_params,) or (B, coarse.n_params)
        NumPy or CuPy; the result has the same array type.
    coarse, fine : Tessellation
        ``fine`` must nest in ``coarse``: the same dimension and boundary condition, and
        ``fine.shape = r * coarse.shape`` with an integer r per axis in 1D, and one integer r
        for all axes in 2D and 3D (see :func:`refinement_factor`).

    Returns
    -------
    theta_fine : ndarray, shape (fine.n_params,) or (B, fine.n_params)
        ``velocity(x, theta_fine, fine) == velocity(x, theta, coarse)`` for every x (up to
        rounding). dtype ``result_type(theta, float32)`` restricted to float32/float64.

    Raises
    ------
    ValueError
        A pair that does not nest, or theta of the wrong shape or not finite.
    TypeError
        Non-real theta, arguments that are not tessellations.

    Convention
    ----------
    As :class:`Tessellation`: theta holds the free vertex velocity components, vertex-major;
    coordinates are in the unit box [0, 1]^K, coordinate k along array axis k.

    Examples
    --------
    >>> import numpy as np
    >>> from cutopo.cpab import Tessellation, velocity
    >>> from cutopo.cpab.prolong import prolong
    >>> coarse, fine = Tessellation((2, 2)), Tessellation((4, 4))
    >>> theta = coarse.sample(1, length_scale=0.5, rng=0)[0]
    >>> theta_fine = prolong(theta, coarse, fine)
    >>> theta.shape, theta_fine.shape
    ((10,), (50,))
    >>> x = np.random.default_rng(1).random((100, 2))
    >>> bool(np.allclose(velocity(x, theta_fine, fine), velocity(x, theta, coarse), atol=1e-12))
    True

    References
    ----------
    .. [1] O. Freifeld, S. Hauberg, K. Batmanghelich, J. W. Fisher III, "Transformations based on
       continuous piecewise-affine velocity fields", IEEE TPAMI 39(12), 2017 (CPA fields as P1
       finite-element fields on the tessellation).
    """
    P = prolongation_matrix(coarse, fine)
    xp = array_module(theta)
    theta = xp.asarray(theta)
    if theta.dtype.kind not in "fiu":
        raise TypeError(f"theta must hold real numbers, got dtype {theta.dtype}")
    if theta.ndim not in (1, 2) or theta.shape[-1] != coarse.n_params:
        raise ValueError(f"theta must have shape ({coarse.n_params},) or (B, {coarse.n_params}) "
                         f"for the coarse tessellation, got {theta.shape}")
    if not bool(xp.isfinite(theta).all()):
        raise ValueError("theta must be finite")
    dtype = np.result_type(theta.dtype, np.float32)
    dtype = dtype if dtype in (np.float32, np.float64) else np.dtype(np.float64)
    if is_cupy_array(theta):
        import cupyx.scipy.sparse

        P = cupyx.scipy.sparse.csr_matrix(P)
    batch = theta.shape[0] if theta.ndim == 2 else 1
    columns = xp.ascontiguousarray(theta.reshape(batch, coarse.n_params).T.astype(np.float64))
    out = (P @ columns).T.astype(dtype)
    return out.reshape(theta.shape[:-1] + (fine.n_params,))
