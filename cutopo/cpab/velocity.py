"""The CPA velocity field v(x) = A_c(x) [x; 1] of a tessellation at given points."""
from __future__ import annotations

import numpy as np

from .._array import array_module, as_array, is_cupy_array
from ._checks import broadcast_batch
from .tessellation import Tessellation, cell_index

__all__ = ["velocity"]


def _real_array(x, name, xp):
    x = x if xp is not np else as_array(x, name)  # NumPy arrays in native byte order
    if x.dtype.kind not in "fiu":
        raise TypeError(f"{name} must hold real numbers, got dtype {x.dtype}")
    return x


def check_points_theta(points, theta, tess, name, *, defer_finite=False):
    """Validate the (points, theta, tess) arguments of a CPA op; return points and theta as
    real arrays of one array type (NumPy, or CuPy when either is a CuPy array: then both must
    be) and the computation dtype. points: (N, K) or (B, N, K); theta: (d,) or (B, d); batch
    sizes equal or one of them 1 (broadcast as NumPy's: 1 with 0 is an empty batch).

    On the device the finiteness of both is one reduction read on the host, unless
    ``defer_finite``: then the caller must hand both to ``_integrate_cupy.checked_plan``,
    whose one check kernel tests them together with the step-size guard, read once the call's
    kernels are queued."""
    on_device = is_cupy_array(points) or is_cupy_array(theta)
    if on_device and not (is_cupy_array(points) and is_cupy_array(theta)):
        which = "points" if is_cupy_array(points) else "theta"
        other = "theta" if which == "points" else "points"
        raise TypeError(f"cpab.{name}: {which} is a CuPy array but {other} is not: move both "
                        "to one device")
    xp = array_module(points) if on_device else np
    if not isinstance(tess, Tessellation):
        raise TypeError(f"tess must be a cutopo.cpab.Tessellation, got {type(tess).__name__}")
    K, d = tess.ndim, tess.n_params
    points = _real_array(points, "points", xp)
    theta = _real_array(theta, "theta", xp)
    if points.ndim not in (2, 3) or points.shape[-1] != K:
        raise ValueError(f"points must have shape (N, {K}) or (B, N, {K}) for a {K}-D "
                         f"tessellation, got {points.shape}")
    if theta.ndim not in (1, 2) or theta.shape[-1] != d:
        raise ValueError(f"theta must have shape ({d},) or (B, {d}) (n_params={d}), got {theta.shape}")
    if points.ndim == 3 and theta.ndim == 2:
        broadcast_batch(len(points), len(theta), ("points", "theta"), name)
    # float32 only when both are (at most) float32; everything else computes in float64
    dtype = np.result_type(points.dtype, theta.dtype, np.float32)
    if dtype not in (np.float32, np.float64):
        dtype = np.dtype(np.float64)
    points = points.astype(dtype, copy=False)
    # NaN or inf refused before the NumPy path and velocity's kernel; integrate's kernels are
    # safe on them and their checks deferred (checked_plan)
    if xp is np:
        raise_not_finite((np.isfinite(points).all(), np.isfinite(theta).all()))
    elif not defer_finite:
        finite = xp.stack([xp.isfinite(points).all(), xp.isfinite(theta).all()])
        raise_not_finite(finite.get())                                  # one host sync
    return points, theta, dtype


def raise_not_finite(finite):
    """ValueError unless ``finite`` (points finite, theta finite) holds."""
    if not finite[0]:
        raise ValueError("points must be finite")
    if not finite[1]:
        raise ValueError("theta must be finite")


def velocity(points, theta, tess):
    """The continuous piecewise-affine velocity field of ``theta`` at ``points``.

    Parameters
    ----------
    points : ndarray, shape (N, K) or (B, N, K)
        Coordinates in [0, 1]^K, shared by the batch (N, K) or one set per batch item. Points
        outside the box take the velocity of their nearest point of the box (coordinates
        clamped to [0, 1]), a continuous extension, constant along the normal: zero outside
        under no-slip. This is not the field :func:`~cutopo.cpab.integrate` follows outside
        the box under ``zero_boundary=None`` (see Convention). NumPy or CuPy; CuPy points and
        theta (both) run the CUDA kernel.
    theta : ndarray, shape (n_params,) or (B, n_params)
        Vertex velocities at the free components, as laid out by ``tess`` (see
        :class:`Tessellation`).
    tess : Tessellation

    Returns
    -------
    v : ndarray, shape (B, N, K), or (N, K) when neither input has a batch axis
        The array type of the inputs. dtype ``numpy.result_type(points, theta, float32)``
        (float64 if that is neither float32 nor float64): float32 inputs give float32. Batch
        axes of size 1 broadcast. The maps A_c are formed in float64 and rounded to that dtype;
        the points are located and evaluated in it, with the same roundings on both backends.

    Convention
    ----------
    Domain [0, 1]^K, coordinate k of a point is array axis k. ``theta[j]`` is the velocity
    component ``tess.dof_axis[j]`` at vertex ``tess.dof_vertex[j]`` (vertex-major,
    component-minor, vertices in FG-CPAB's order). Each point x is clamped to the box, x' =
    clip(x, 0, 1), and evaluated there with the affine map of the cell
    :func:`~cutopo.cpab.tessellation.cell_index` gives it: ``v(x) = A_c(x') [x'; 1]``. In the
    box the field is continuous, so on a face either side's map gives the same value up to
    rounding. Outside the box (where only ``zero_boundary=None`` trajectories go) the scheme
    of :func:`~cutopo.cpab.integrate` steps instead with ``A_c(x') [x; 1]``, the boundary
    cell's affine extension at x itself, which is discontinuous in 2-D and 3-D (see its Notes,
    "Outside the box"); the two agree on the box.

    Examples
    --------
    >>> import numpy as np
    >>> from cutopo.cpab import Tessellation, velocity
    >>> tess = Tessellation((4,))                  # vertices 0.25, 0.5, 0.75 are free
    >>> velocity(np.array([[0.25], [0.375], [0.875]]), np.array([1.0, 0.0, -1.0]), tess)
    array([[ 1. ],
           [ 0.5],
           [-0.5]])
    >>> tess = Tessellation((2, 2))                # 1 interior corner and 4 centres
    >>> theta = np.zeros(tess.n_params); theta[:2] = (0.1, 0.2)   # the centre of box (0, 0)
    >>> velocity(np.array([[0.25, 0.25], [0.25, 0.0]]), theta[None], tess)
    array([[[0.1, 0.2],
            [0. , 0. ]]])

    References
    ----------
    .. [1] O. Freifeld, S. Hauberg, K. Batmanghelich, J. W. Fisher III, "Transformations based on
       continuous piecewise-affine velocity fields", IEEE TPAMI 39(12), 2017.
    .. [2] N. S. Detlefsen, libcpab, https://github.com/SkafteNicki/libcpab, 2018
       (``calc_vectorfield``).
    """
    points, theta, dtype = check_points_theta(points, theta, tess, "velocity")
    K = tess.ndim
    batched = points.ndim == 3 or theta.ndim == 2
    if is_cupy_array(points):
        from . import _integrate_cupy

        v = _integrate_cupy.velocity(points, theta, tess, dtype)
        return v if batched else v[0]

    P = points if points.ndim == 3 else points[None]                     # (Bp, N, K)
    A = tess.affine_maps(theta if theta.ndim == 2 else theta[None])      # (Bt, C, K, K+1)
    A = A.astype(dtype, copy=False)
    x = np.clip(P, 0, 1)                                                 # the nearest domain point
    cells = cell_index(x, tess.shape)                                    # (Bp, N)
    batch = np.arange(len(A))[:, None]                                   # broadcasts against cells
    # v = A[:, :, K] + sum_q A[:, :, q] x_q, gathered one column at a time (no (B, N, K, K+1) copy)
    v = A[batch, cells, :, K]
    for q in range(K):
        v = v + A[batch, cells, :, q] * x[..., q, None]
    return v if batched else v[0]
