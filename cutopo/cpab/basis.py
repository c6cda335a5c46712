"""The sparse nodal basis B of a CPAB tessellation: theta -> per-cell affine maps A_c.

On a simplex c with vertices x_0..x_K, the affine field that takes the value u_l at x_l is

    A_c = U_c inv(X~_c),   X~_c = [[x_0 ... x_K], [1 ... 1]],   U_c = [u_0 ... u_K],

and row l of inv(X~_c) is (grad lambda_l, lambda_l(0)), the barycentric hat function of vertex
l. So entry (k, q) of A_c is sum_l u_l[k] inv(X~_c)[l, q]: B has, in row (c, k, q) and in the
column of (vertex l of c, component k), the number inv(X~_c)[l, q], when that component is
free. This is FG-CPAB's prolongation N without its column normalisation; a nodal field is
continuous on the conforming mesh by construction, so no null space (SVD) is needed.

The inverses are exact: every simplex is a box-sized copy of one of a few reference simplices
(whose inverses are multiples of 1/2), shifted by integers, so inv(X~_c) follows from the
reference inverse with products of halves and integers.
"""
from __future__ import annotations

import numpy as np
import scipy.sparse

__all__ = ["barycentric_coefficients", "nodal_basis", "affine_maps"]


def _reference_inverses(xi):
    """inv([[xi_0 ... xi_K], [1 ... 1]]) of every reference simplex xi (T, K+1, K), box units."""
    T, K = len(xi), xi.shape[-1]
    homogeneous = np.concatenate([np.swapaxes(xi, 1, 2), np.ones((T, 1, K + 1))], axis=1)
    inv = np.linalg.inv(homogeneous)
    exact = np.round(inv * 2) / 2               # the entries are multiples of 1/2: remove rounding
    if not np.allclose(inv, exact, rtol=0, atol=1e-9):  # pragma: no cover - a layout bug
        raise RuntimeError("reference simplex inverses are not multiples of 1/2")
    return exact


def barycentric_coefficients(tess):
    """(n_cells, K+1, K+1): row l of cell c holds (grad lambda_l, lambda_l(0)) in global coordinates.

    With local coordinates xi_k = n_k x_k - i_k in box (i_0, ..., i_{K-1}), lambda_l(x) =
    M[l, :K] . xi + M[l, K] for the reference inverse M, hence gradient M[l, k] n_k and
    offset M[l, K] - sum_k M[l, k] i_k.
    """
    M = _reference_inverses(tess.reference_vertices)[tess.cell_type]     # (C, K+1, K+1)
    n = np.array(tess.shape, dtype=np.float64)
    box = tess.cell_box.astype(np.float64)                               # (C, K)
    coef = np.empty_like(M)
    coef[:, :, :-1] = M[:, :, :-1] * n
    coef[:, :, -1] = M[:, :, -1] - np.einsum("clk,ck->cl", M[:, :, :-1], box)
    return coef


def nodal_basis(tess) -> scipy.sparse.csr_matrix:
    """B, shape (n_cells * K * (K+1), n_params), CSR, float64, built in O(n_cells) memory."""
    K, C, d = tess.ndim, tess.n_cells, tess.n_params
    coef = barycentric_coefficients(tess)                                # (C, l, q)
    column = tess.dof_index[tess.cells]                                  # (C, l, k); -1 = fixed
    # Entry (c, k, q, l): value coef[c, l, q], column column[c, l, k]; rows are (c, k, q).
    values = np.broadcast_to(coef.transpose(0, 2, 1)[:, None, :, :], (C, K, K + 1, K + 1))
    columns = np.broadcast_to(column.transpose(0, 2, 1)[:, :, None, :], (C, K, K + 1, K + 1))
    keep = (columns >= 0) & (values != 0)                                # drop fixed and exact zeros
    n_rows = C * K * (K + 1)
    indptr = np.zeros(n_rows + 1, dtype=np.int64)
    np.cumsum(keep.reshape(n_rows, K + 1).sum(axis=1), out=indptr[1:])
    index_dtype = np.int32 if max(n_rows, d, int(indptr[-1])) < 2**31 - 1 else np.int64
    B = scipy.sparse.csr_matrix((values[keep], columns[keep].astype(index_dtype),
                                 indptr.astype(index_dtype)), shape=(n_rows, d))
    B.sort_indices()
    return B


def affine_maps(tess, theta):
    """A = B theta, shape (*batch, n_cells, K, K+1), float64 (theta of shape (*batch, n_params))."""
    theta = np.asarray(theta)
    if theta.ndim == 0 or theta.shape[-1] != tess.n_params:
        raise ValueError(f"theta must have n_params={tess.n_params} entries on its last axis, "
                         f"got shape {theta.shape}")
    batch = theta.shape[:-1]
    flat = theta.reshape(int(np.prod(batch)), tess.n_params).astype(np.float64, copy=False)
    A = np.asarray(tess.basis @ flat.T).T                                # (n_batch, D)
    return A.reshape(batch + (tess.n_cells, tess.ndim, tess.ndim + 1))
