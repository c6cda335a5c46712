"""A smooth Gaussian-process prior on the vertex velocities of a tessellation, drawn matrix-free.

The squared-exponential kernel is a product over axes, and the vertices lie on a regular grid
(with the 2D centre vertices, the half-cell grid). So the process on the whole grid is
``(S_0 x S_1 x ... ) z`` for white noise z and the symmetric square roots S_k of the small 1-D
kernel matrices, applied one axis at a time; the vertices pick their grid points from it.
"""
from __future__ import annotations

import math

import numpy as np

from ._checks import check_count

__all__ = ["sample_vertex_prior", "MAX_GRID_POINTS_PER_AXIS"]

# The per-axis square root is a dense eigendecomposition: keep it below a second or so.
MAX_GRID_POINTS_PER_AXIS = 4097


def _axis_square_root(m, spacing, length_scale):
    """Symmetric square root of the m x m kernel matrix of a grid of the given spacing."""
    t = np.arange(m) * spacing
    kernel = np.exp(-0.5 * ((t[:, None] - t[None, :]) / length_scale) ** 2)
    w, V = np.linalg.eigh(kernel)
    return (V * np.sqrt(np.clip(w, 0.0, None))) @ V.T                   # clip: rounding below 0


def _check_positive_float(value, name, *, allow_zero=False):
    try:
        value = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a number, got {value!r}") from None
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name} must be finite and {bound}, got {value}")
    return value


def sample_vertex_prior(tess, n, *, length_scale, scale, rng):
    """theta of shape (n, tess.n_params), float64; see :meth:`Tessellation.sample`."""
    n = check_count(n, "n", minimum=0)
    length_scale = _check_positive_float(length_scale, "length_scale")
    scale = _check_positive_float(scale, "scale", allow_zero=True)
    try:
        rng = np.random.default_rng(rng)
    except (TypeError, ValueError) as exc:  # the same kind of error, with the argument named
        kind = ValueError if isinstance(exc, ValueError) else TypeError
        raise kind(f"Tessellation.sample: rng must be None, a non-negative int or a "
                   f"numpy.random.Generator, got {rng!r}") from exc

    den = tess.grid_denominator
    points = tuple(den * s + 1 for s in tess.shape)                       # grid points per axis
    if max(points) > MAX_GRID_POINTS_PER_AXIS:
        raise ValueError(f"sample: the tessellation shape={tess.shape} has {max(points)} vertex "
                         f"grid points on an axis, more than the {MAX_GRID_POINTS_PER_AXIS} "
                         f"this sampler supports")
    K = tess.ndim
    # Only the components that are free somewhere need noise.
    axes_used = np.unique(tess.dof_axis)
    try:
        field = rng.standard_normal((n, len(axes_used)) + points)
        for k in range(K):
            root = _axis_square_root(points[k], 1.0 / (den * tess.shape[k]), length_scale)
            field = np.moveaxis(np.tensordot(root, field, axes=(1, 2 + k)), 0, 2 + k)
    except MemoryError:
        nbytes = 8 * n * len(axes_used) * math.prod(points)
        raise ValueError(f"sample: n={n} draws need {nbytes / 2 ** 30:.3g} GiB of noise on the "
                         "vertex grid, more than can be allocated; draw them in smaller "
                         "batches") from None
    slot = np.searchsorted(axes_used, tess.dof_axis)
    grid = tess.vertex_grid[tess.dof_vertex]                             # (d, K)
    # C order: the gather leaves the batch axis innermost, and every op would copy it first
    return np.ascontiguousarray(scale * field[(slice(None), slot) + tuple(grid.T)])
