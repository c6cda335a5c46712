"""Integration of a CPA velocity field: the transformation phi_theta, its log-Jacobian and its VJP.

The scheme is libcpab's and FG-CPAB's closed-form step with the cell frozen at the step start:
with h = 1/T and E_c = expm(h A~_c), A~_c = [[A_c], [0 ... 0]] the augmented affine map of cell c,

    x_{t+1} = P(E_c(t) [x_t; 1]),   c(t) = cell_index(x_t),   t = 0 .. T-1,   x_0 = P(x),

where P is the projection onto [0, 1]^K under the "noslip" and "slip" boundaries and the identity
without a zero boundary. Within one cell this is the exact affine flow for time h; a step that
crosses a face keeps the start cell's map for the whole step (the scheme's only error).

The VJP is the discrete adjoint of exactly this map (research notes cpab.md 6.5.3): a backward
sweep lambda_t = E_lin^T (m_{t+1} * lambda_{t+1}) over segment-checkpointed trajectories that
accumulates one outer product per (point, step) into per-cell matrices G_c, then one adjoint
Frechet derivative of expm per visited cell turns G_c into dL/dA_c, and the sparse basis gives
dL/dtheta = B^T vec(dL/dA): O(T N + d C) work, no [d, N] Jacobian.
"""
from __future__ import annotations

import contextlib
import dataclasses
import weakref

import numpy as np

from .._array import is_cupy_array
from .._cuda.launch import KeptLaunches
from .._cuda.repeated import RepeatedCalls
from ..vjp import register
from .tessellation import cell_index
from ._checks import MAX_STEP_NORM, check_count, check_n_steps, check_step_size
from .velocity import check_points_theta

__all__ = ["integrate", "log_jacobian", "MAX_STEP_NORM"]

# -- the matrix exponential and its adjoint Frechet derivative, vectorised over matrices -------

_THETA_13 = 5.371920351148152               # Higham (2005): Pade 13 is accurate to u below this
# Pade(13, 13) numerator coefficients, divided by the first: a zero matrix then gives exactly I
_PADE_13 = tuple(c / 64764752532480000.0 for c in (
    64764752532480000.0, 32382376266240000.0, 7771770303897600.0, 1187353796428800.0,
    129060195264000.0, 10559470521600.0, 670442572800.0, 33522128640.0, 1323241920.0,
    40840800.0, 960960.0, 16380.0, 182.0, 1.0))


_EXPM_CHUNK = 16384                         # matrices per vectorised pass (bounds the temporaries)


def _expm(M):
    """exp of every matrix of ``M`` (n, m, m), float64: Pade(13, 13) with scaling and squaring
    (Higham 2005, the degree-13 branch for every matrix), vectorised over n."""
    M = np.asarray(M, dtype=np.float64)
    if len(M) <= _EXPM_CHUNK:
        return _expm_chunk(M)
    return np.concatenate([_expm_chunk(M[i:i + _EXPM_CHUNK])
                           for i in range(0, len(M), _EXPM_CHUNK)])


def _expm_chunk(M):
    n, m = M.shape[0], M.shape[-1]
    if n == 0:
        return M.copy()
    norm1 = np.abs(M).sum(axis=1).max(axis=1)                            # 1-norm of each matrix
    with np.errstate(divide="ignore"):
        s = np.ceil(np.log2(norm1 / _THETA_13))
    s = np.where(norm1 > 0, np.maximum(s, 0), 0).astype(np.int64)
    X = M * np.ldexp(1.0, -s)[:, None, None]
    b = _PADE_13
    eye = np.eye(m)
    X2 = X @ X
    X4 = X2 @ X2
    X6 = X4 @ X2
    U = X @ (X6 @ (b[13] * X6 + b[11] * X4 + b[9] * X2) + b[7] * X6 + b[5] * X4 + b[3] * X2
             + b[1] * eye)
    V = X6 @ (b[12] * X6 + b[10] * X4 + b[8] * X2) + b[6] * X6 + b[4] * X4 + b[2] * X2 + b[0] * eye
    R = np.linalg.solve(V - U, V + U)
    for i in range(int(s.max())):                                        # undo the scaling
        sel = np.flatnonzero(s > i)
        R[sel] = R[sel] @ R[sel]
    return R


def _expm_frechet_adjoint(X, G):
    """L(X^T, G) for every pair of (n, m, m) matrices, where L(X, E) is the Frechet derivative
    of expm at X in direction E, so that <G, L(X, E)> = <L(X^T, G), E>. Van Loan's block
    exponential: expm([[Y, Z], [0, Y]]) holds L(Y, Z) in its top-right block. G is scaled to a
    unit largest entry (L is linear in it) so that it does not drive the squaring."""
    n, m = X.shape[0], X.shape[-1]
    scale = np.abs(G).reshape(n, -1).max(axis=1)
    scale = np.where(scale > 0, scale, 1.0)
    block = np.zeros((n, 2 * m, 2 * m))
    Y = np.swapaxes(X, 1, 2)
    block[:, :m, :m] = Y
    block[:, m:, m:] = Y
    block[:, :m, m:] = G / scale[:, None, None]
    return _expm(block)[:, :m, m:] * scale[:, None, None]


# -- argument checks and the per-call set-up ----------------------------------------------------

@dataclasses.dataclass
class _Setup:
    """Everything the steps need, shared by the forward, log_jacobian and the backward."""

    shape: tuple            # cells per axis
    K: int
    n_cells: int
    n_steps: int
    h: float
    dtype: np.dtype
    project: bool           # P = clip to [0, 1]^K ("noslip", "slip")
    batched: bool           # the output keeps its batch axis
    x0: np.ndarray          # (B, N, K) dtype: P(points), broadcast over the batch (read-only)
    inside0: np.ndarray     # (Bp, N, K) bool: where P(points) == points (None if not project)
    boff: np.ndarray        # (B,) int64: offset of each batch item's cells in the flat tables
    A_aug: np.ndarray       # (Bt*C, K+1, K+1) float64: A~_c
    E: np.ndarray           # (Bt*C, K, K+1) dtype: top K rows of expm(h A~_c), as applied
    columns: list           # E[:, :, q] contiguous, q = 0..K (gathered one column at a time)
    basis: object           # the tessellation's sparse B
    points_ndim: int
    theta_ndim: int
    n_points: int           # Bp
    n_theta: int            # Bt


def _setup(points, theta, tess, n_steps, name):
    points, theta, dtype = check_points_theta(points, theta, tess, name)
    n_steps = check_n_steps(n_steps)
    K, C = tess.ndim, tess.n_cells
    P = points if points.ndim == 3 else points[None]                     # (Bp, N, K)
    T2 = theta if theta.ndim == 2 else theta[None]                       # (Bt, d)
    Bp, Bt = len(P), len(T2)
    B = Bt if Bp == 1 else Bp

    A = tess.affine_maps(T2).reshape(Bt * C, K, K + 1)                  # float64
    with np.errstate(over="ignore"):                                     # +inf: check_step_size
        largest = float(np.sqrt((A[:, :, :K] ** 2).sum(axis=(1, 2))).max(initial=0.0))
    check_step_size(largest, n_steps, name)
    h = 1.0 / n_steps
    A_aug = np.zeros((Bt * C, K + 1, K + 1))
    A_aug[:, :K, :] = A
    E = _expm(h * A_aug)[:, :K, :].astype(dtype)
    project = tess.zero_boundary in ("noslip", "slip")
    if project:
        inside0 = (P >= 0) & (P <= 1)
        x0 = np.clip(P, 0, 1)
    else:
        inside0, x0 = None, P
    x0 = np.broadcast_to(x0, (B,) + P.shape[1:])
    boff = (np.arange(B, dtype=np.int64) if Bt > 1 else np.zeros(B, dtype=np.int64)) * C
    return _Setup(shape=tess.shape, K=K, n_cells=C, n_steps=n_steps, h=h, dtype=dtype,
                  project=project, batched=points.ndim == 3 or theta.ndim == 2, x0=x0,
                  inside0=inside0, boff=boff, A_aug=A_aug, E=E,
                  columns=[np.ascontiguousarray(E[:, :, q]) for q in range(K + 1)],
                  basis=tess.basis, points_ndim=points.ndim, theta_ndim=theta.ndim,
                  n_points=Bp, n_theta=Bt)


def _step(s, x):
    """One step from x (B, N, K): (x_next, flat cell ids (B, N), inside mask or None)."""
    flat = s.boff[:, None] + cell_index(x, s.shape)
    y = s.columns[s.K][flat]
    for q in range(s.K):
        y = y + s.columns[q][flat] * x[..., q, None]
    if not s.project:
        return y, flat, None
    inside = (y >= 0) & (y <= 1)
    return np.clip(y, 0, 1), flat, inside


# -- the ops -------------------------------------------------------------------------------------

@dataclasses.dataclass
class _DeviceResiduals:
    """The CuPy forward's residuals: its plan and the checkpoints every S steps (None: the
    backward kernel recomputes them, _integrate_cupy.CHECKPOINTS)."""

    plan: object            # _integrate_cupy.Plan
    checkpoints: object     # (ceil(T/S), B, N, K), or None
    S: int
    points_ndim: int
    theta_ndim: int


@dataclasses.dataclass
class _CheckedCall:
    """What the checks of a CuPy call found (kept by _DEVICE_CALLS): the computation dtype, the
    tessellation checked (weakly: an id may be reused once it is gone) and the call's launches."""

    dtype: np.dtype
    tess: weakref.ref
    launches: object        # cutopo._cuda.launch.KeptLaunches


# Repeated CuPy calls (a training loop's) by their arguments' shapes, dtypes and device, n_steps,
# the op and the tessellation: they skip the argument checks that read nothing else, and launch
# through the kept launches of their kind (the values are still checked: checked_plan)
_DEVICE_CALLS = RepeatedCalls()


@contextlib.contextmanager
def _device_plan(points, theta, tess, n_steps, name):
    """Checked arguments and the CuPy plan, (plan, batched, points.ndim, theta.ndim), for the
    launches of the ``with`` body; the device checks raise at its end (checked_plan)."""
    from . import _integrate_cupy

    key = _DEVICE_CALLS.key((points, theta), (n_steps, name, id(tess)))
    checked = _DEVICE_CALLS.get(key) if key is not None else None
    if checked is not None and checked.tess() is tess:
        dtype, launches = checked.dtype, checked.launches
    else:
        # the finiteness checks run in checked_plan's check kernel, read with the guard
        points, theta, dtype = check_points_theta(points, theta, tess, name, defer_finite=True)
        n_steps = check_n_steps(n_steps)
        launches = None
        if key is not None:
            launches = KeptLaunches()
            _DEVICE_CALLS.keep(key, _CheckedCall(dtype, weakref.ref(tess), launches))
    with _integrate_cupy.checked_plan(points, theta, tess, n_steps, name, dtype,
                                      launches=launches) as plan:
        yield plan, points.ndim == 3 or theta.ndim == 2, points.ndim, theta.ndim


def _points_cotangent(lam, points_ndim, n_points):
    """dL/dpoints from the per-item m_0 lambda_0 (B, N, K): summed over a shared batch."""
    if points_ndim == 2:                                                 # shared by the batch
        return lam.sum(axis=0)
    if n_points == 1 != len(lam):                                        # a broadcast batch of 1
        return lam.sum(axis=0, keepdims=True)
    return lam


def _integrate_forward(points, theta, tess, *, n_steps=50, checkpoint_every=4):
    """``(integrate(...), residuals)``: the trajectory is kept every ``checkpoint_every`` steps."""
    S = check_count(checkpoint_every, "checkpoint_every")
    if is_cupy_array(points) or is_cupy_array(theta):
        from . import _integrate_cupy

        if S > _integrate_cupy.MAX_SEGMENT:
            raise ValueError(f"checkpoint_every must be <= {_integrate_cupy.MAX_SEGMENT} for CuPy "
                             f"inputs (the kernel keeps one segment in local memory), got {S}")
        with _device_plan(points, theta, tess, n_steps, "integrate") as (plan, batched, pn, tn):
            segment, recompute = _integrate_cupy.checkpoint_segment(plan.n_steps, S)
            if recompute:                 # the backward recomputes the checkpoints itself
                x, checkpoints = _integrate_cupy.integrate(plan)[0], None
            else:
                x, checkpoints, _ = _integrate_cupy.integrate(plan, checkpoint_every=segment)
        return (x if batched else x[0]), _DeviceResiduals(plan, checkpoints, segment, pn, tn)
    s = _setup(points, theta, tess, n_steps, "integrate")
    checkpoints, x = [], s.x0
    for t in range(s.n_steps):
        if t % S == 0:
            checkpoints.append(x)
        x, _, _ = _step(s, x)
    return (x if s.batched else x[0]), (s, checkpoints, S)


def _integrate_backward(residuals, cotangent, needs):
    """The discrete adjoint of the scheme, segment by segment from the last checkpoint."""
    need_points, need_theta = needs[0], needs[1]
    if not (need_points or need_theta):
        return None, None, None
    if isinstance(residuals, _DeviceResiduals):
        from . import _integrate_cupy

        r = residuals
        lam, grad_theta = _integrate_cupy.backward(r.plan, r.checkpoints, r.S, cotangent,
                                                   need_points, need_theta)
        grad_points = _points_cotangent(lam, r.points_ndim, r.plan.n_points) if need_points else None
        if need_theta and r.theta_ndim == 1:
            grad_theta = grad_theta[0]
        return grad_points, grad_theta, None
    s, checkpoints, S = residuals
    K, C, T = s.K, s.n_cells, s.n_steps
    B, N = s.x0.shape[:2]
    lam = np.asarray(cotangent, dtype=np.float64).reshape(B, N, K)
    E_lin = s.E[:, :, :K].astype(np.float64)                             # the maps as applied
    n_flat = s.n_theta * C
    G = np.zeros((n_flat, K * (K + 1))) if need_theta else None
    for j in range(len(checkpoints) - 1, -1, -1):
        L = min(S, T - j * S)
        xs, flats, insides = [checkpoints[j]], [], []
        for _ in range(L):                                               # recompute the segment
            y, flat, inside = _step(s, xs[-1])
            xs.append(y)
            flats.append(flat)
            insides.append(inside)
        mus = [None] * L
        for i in range(L - 1, -1, -1):                                   # sweep it backwards
            mu = lam * insides[i] if s.project else lam                  # through P
            mus[i] = mu
            lam = np.einsum("bnkq,bnk->bnq", E_lin[flats[i]], mu)        # through E_lin^T
        if need_theta:                                                   # G_c += mu [x; 1]^T
            flat = np.stack(flats).ravel()
            mu = np.stack(mus).reshape(-1, K)
            x = np.stack(xs[:L]).reshape(-1, K).astype(np.float64)
            for k in range(K):
                for q in range(K + 1):
                    w = mu[:, k] * x[:, q] if q < K else mu[:, k]
                    G[:, k * (K + 1) + q] += np.bincount(flat, weights=w, minlength=n_flat)

    grad_points = None
    if need_points:
        if s.project:
            lam = lam * s.inside0                                        # through P(points)
        grad_points = _points_cotangent(lam, s.points_ndim, s.n_points)

    grad_theta = None
    if need_theta:
        moments = np.zeros((n_flat, K, K + 1))
        visited = np.flatnonzero(G.any(axis=1))
        if len(visited):
            G_aug = np.zeros((len(visited), K + 1, K + 1))
            G_aug[:, :K, :] = G[visited].reshape(-1, K, K + 1)
            F = _expm_frechet_adjoint(s.h * s.A_aug[visited], G_aug)
            moments[visited] = s.h * F[:, :K, :]                         # dL/dA_c
        # the row length spelled out: an empty batch (n_theta = 0) leaves no -1 to infer
        rows = moments.reshape(s.n_theta, C * K * (K + 1))
        grad_theta = np.asarray(s.basis.T @ rows.T).T
        if s.theta_ndim == 1:
            grad_theta = grad_theta[0]
    return grad_points, grad_theta, None


def _integrate_meta(points, theta, tess, *, n_steps=50, checkpoint_every=4):
    """Output (shape, dtype) from the arguments' shapes and dtypes (see cutopo.vjp.OpSpec).

    First integrate's checks, in its order, on data-free stand-ins of zeros: a bad argument
    raises the op's own error before the op runs (the finiteness checks pass over the
    stand-ins, never the data; the step-size guard, which reads theta, is left to the op)."""
    from .._adapters import stand_in

    check_count(checkpoint_every, "checkpoint_every")
    check_points_theta(stand_in(points), stand_in(theta), tess, "integrate")
    check_n_steps(n_steps)
    Bp = points.shape[0] if points.ndim == 3 else 1
    Bt = theta.shape[0] if theta.ndim == 2 else 1
    shape = tuple(points.shape[-2:])
    if points.ndim == 3 or theta.ndim == 2:
        shape = (Bt if Bp == 1 else Bp,) + shape
    dtype = np.result_type(points.dtype, theta.dtype, np.float32)
    return shape, (dtype if dtype in (np.float32, np.float64) else np.dtype(np.float64))


@register(name="cpab_integrate", forward=_integrate_forward, backward=_integrate_backward,
          arg_names=("points", "theta", "tess"), differentiable=("points", "theta"),
          meta=_integrate_meta)
def integrate(points, theta, tess, *, n_steps=50, checkpoint_every=4):
    """The CPAB transformation phi_theta(points): the flow of the CPA velocity field for unit time.

    Parameters
    ----------
    points : ndarray, shape (N, K) or (B, N, K)
        Start points, shared by the batch (N, K) or one set per batch item; NumPy or CuPy
        (then theta must be CuPy too, and the CUDA kernels run). Under the
        ``"noslip"`` and ``"slip"`` boundaries points outside [0, 1]^K are first moved to their
        nearest point of the box (see Notes).
    theta : ndarray, shape (n_params,) or (B, n_params)
        Vertex velocities at the free components, as laid out by ``tess``.
    tess : Tessellation
    n_steps : int, optional
        T, the number of steps of size h = 1/T (default 50, libcpab's and FG-CPAB's
        ``nstepsolver``). It must pass the step-size guard ``h * max_c ||A_c,lin||_F <=
        MAX_STEP_NORM`` (0.5), the maximum over cells and batch items of the Frobenius norm of
        the linear part of A_c; otherwise a ValueError says which n_steps would do. At most
        2**31 - 1 (the kernels' step counter is 32-bit).
    checkpoint_every : int, optional
        S, the segment length of the VJP (:func:`cutopo.vjp`): its forward keeps the trajectory
        every S steps and its backward recomputes one segment at a time, so a point holds
        ceil(T/S) + S + 1 positions instead of T + 1. Default 4. The plain call only checks it.

    Returns
    -------
    phi : ndarray, shape (B, N, K), or (N, K) when neither input has a batch axis
        The points moved for unit time. dtype ``numpy.result_type(points, theta, float32)``
        (float64 if that is neither float32 nor float64); batch axes of size 1 broadcast. The
        step matrices are formed in float64 and rounded to that dtype; the points are located
        and stepped in it.

    Raises
    ------
    ValueError
        Shapes that do not fit ``tess`` or each other, non-finite points or theta, ``n_steps``
        or ``checkpoint_every`` below 1, ``n_steps`` too small for ``theta`` (the guard), or
        (CuPy inputs) ``checkpoint_every`` above 17 for the VJP, a theta batch of 2**31 cells
        or more in all (``len(theta) * tess.n_cells``: the backward numbers them in 32 bits).
    TypeError
        ``tess`` not a :class:`Tessellation`, non-real dtypes, ``n_steps`` or
        ``checkpoint_every`` not an int, one of points and theta a CuPy array and the other not.

    Notes
    -----
    **Scheme.** With h = 1/T, A~_c = [[A_c], [0 ... 0]] and E_c = expm(h A~_c)::

        x_0 = P(points),   x_{t+1} = P(E_c(t) [x_t; 1]),   c(t) = cell_index(x_t),

    for t = 0 .. T-1: each step is the exact affine flow of the cell holding the step's start
    point, for time h, ignoring any cell change within the step (libcpab's and FG-CPAB's
    closed-form step, without FG-CPAB's optional Heun correction; research notes cpab.md 5).
    Inside one cell it is exact; a step that crosses a face keeps the start cell's map for the
    rest of the step, an error of O(h^2) per crossing, so with finitely many crossings the
    transformation converges as O(h^2) (errors up to about 1.4 h^2 in 1D against an ODE
    solver in the tests, and cpab.md 5.5 against RK4 in 2D; trajectories that run along a
    face can lose an order). ``phi_{-theta}`` is the inverse flow, so it inverts
    ``phi_theta`` up to that discretisation error. The scheme's map is discontinuous
    where a step starts on a face (the two cells' steps differ by O(h^2) there), so nearby
    points, or float32 and float64 runs, can differ by that much. E_c is computed once per
    call and cell (Pade(13) with scaling and squaring, vectorised over cells).

    **GPU.** CuPy points and theta run ``cuda_src/cpab.cu``: E_c by a per-cell Pade(13) kernel
    (equal to the NumPy E_c up to float64 rounding), then one thread per point and batch item
    whose steps use NumPy's roundings in NumPy's order, so with equal E_c the trajectories are
    the NumPy trajectories bit for bit. The VJP's forward keeps at most three copies of the
    points there (``checkpoint_every`` raised to ceil(T / 3) when that is at most 17; longer
    runs recompute the checkpoints in the backward), the backward keeps one segment per thread
    in local memory, sums the outer products in registers while a point stays in one cell,
    pools them per warp and adds them to G_c with float64 atomics (so the theta cotangent is
    reproducible only to rounding); the adjoint Frechet derivatives and B^T run on the device
    too. Float32 denormal coordinates count as 0 there (CuPy's -ftz=true).

    **Boundary.** P is the projection onto [0, 1]^K (coordinate-wise clipping) under
    ``"noslip"`` and ``"slip"``, whose exact flows keep the box invariant, and the identity
    under ``zero_boundary=None``. Under no-slip the guard makes P a no-op in exact arithmetic:
    the field vanishes on the boundary and is Lipschitz with constant L <= max_c
    ||A_c,lin||_F, so ``|v(x)| <= L dist(x, boundary)``; a frozen-cell step moves x by at most
    ``|v(x)| (e^{hL} - 1) / L <= dist(x, boundary) (e^{hL} - 1)``, less than the distance to
    the boundary because hL <= 0.5 < log 2. Trajectories therefore stay in the open box
    (boundary points stay put) and P only removes rounding excursions. Under slip the
    frozen-cell steps can overshoot the boundary near it, and P pulls them back.

    **Outside the box** (``zero_boundary=None`` only: the other boundaries never leave it).
    Points may leave the box, and a point x outside steps with ``A_c [x; 1]``, c the cell of
    its clamped position (:func:`~cutopo.cpab.tessellation.cell_index` clamps each coordinate
    to [0, 1]): the affine extension of that boundary cell's map, evaluated at x itself. No
    constraint makes these extensions agree: libcpab's ``zero_boundary=False`` adds "valid
    outside" constraints that make its outside field continuous (and its lookup splits the
    corner regions at 45 degrees; research notes cpab.md 3 and 4.1), cutopo imposes none
    (see :class:`Tessellation`). So in 2-D and 3-D the field that outside trajectories follow
    is discontinuous: it jumps across the lines (planes) normal to a face through its boundary
    vertices, and at the edges of the corner regions (where one cell's extension takes over),
    by amounts that grow with the distance from the box; only in 1-D (one cell per end) is it
    continuous. Consequences: on trajectories that leave the box the map is not a
    diffeomorphism of R^K (trajectories that meet a jump can merge or part, so it need not be
    injective or continuous there), and :func:`log_jacobian`, finite there as everywhere,
    no longer certifies that the map does not fold. Trajectories that stay in the box follow
    the continuous CPA field. :func:`~cutopo.cpab.velocity` evaluates a different, continuous
    extension outside the box (the velocity at the clamped point: constant along the normal),
    so it is not the field that this scheme integrates there.

    **VJP** (registered as ``"cpab_integrate"``; points and theta are differentiable, tess
    gets None): the exact derivative of the scheme above, almost everywhere (cell indices are
    piecewise constant in x, P piecewise linear; their jumps are ignored). Backwards from
    lambda_T = cotangent, ``mu_{t+1} = m_{t+1} * lambda_{t+1}`` (m the mask of coordinates
    that P left alone) and ``lambda_t = E_c(t),lin^T mu_{t+1}``, while every step adds
    ``mu_{t+1} [x_t; 1]^T`` to a K x (K+1) matrix G_c of its cell. Then per visited cell
    ``dL/dA_c = h [L(h A~_c^T, [G_c; 0])]_{:K}``, L the Frechet derivative of expm (whose
    adjoint is L(X^T, .)), computed as Van Loan's block exponential, and ``dL/dtheta = B^T
    vec(dL/dA)``, ``dL/dpoints = m_0 * lambda_0`` (summed over the batch when shared). Work
    O(T N + d C), no [d, N] Jacobian; the trajectory is recomputed from checkpoints every S
    steps, so the backward costs one more forward plus the sweep. G is accumulated in
    float64; lambda in float64 on NumPy inputs, and on CuPy inputs in the points' dtype (with
    the sums of a run of steps in one cell: float32 arithmetic for float32 points, the theta
    cotangent then within ~1e-5 of its largest entry of a float64 adjoint's). On CuPy inputs
    the backward kernel also recomputes the checkpoints themselves (kept in each thread's
    local memory, for T <= 256): the VJP then holds no (T / S, B, N, K) array and its memory
    is that of the forward.

    Convention
    ----------
    Domain [0, 1]^K; coordinate k of a point is array axis k, points are (N, K) in that order.
    ``theta[j]`` is the velocity component ``tess.dof_axis[j]`` at vertex
    ``tess.dof_vertex[j]`` (see :class:`Tessellation`). The flow runs for unit time; the
    inverse transformation is ``integrate(points, -theta, tess)``.

    Examples
    --------
    >>> import numpy as np
    >>> from cutopo.cpab import Tessellation, integrate
    >>> tess = Tessellation((4,))                      # no-slip: the ends stay put
    >>> theta = np.array([0.2, 0.3, 0.1])              # velocities at 0.25, 0.5, 0.75
    >>> x = np.array([[0.0], [0.25], [0.5], [0.9], [1.0]])
    >>> phi = integrate(x, theta, tess)
    >>> np.round(phi, 4)
    array([[0.    ],
           [0.4959],
           [0.7065],
           [0.933 ],
           [1.    ]])
    >>> bool(np.abs(integrate(phi, -theta, tess) - x).max() < 1e-6)      # the inverse flow
    True
    >>> bool((integrate(x, np.zeros(3), tess) == x).all())                # theta = 0: identity
    True

    A batch of fields in 2D, and the VJP:

    >>> import cutopo
    >>> tess = Tessellation((3, 3))
    >>> theta = tess.sample(2, length_scale=0.3, rng=0)                  # (2, 26)
    >>> points = np.random.default_rng(0).random((5, 2))
    >>> out, pullback = cutopo.vjp(integrate, points, theta, tess, n_steps=20)
    >>> out.shape
    (2, 5, 2)
    >>> d_points, d_theta, d_tess = pullback(np.ones_like(out))
    >>> d_points.shape, d_theta.shape, d_tess                            # points shared: summed
    ((5, 2), (2, 26), None)

    References
    ----------
    .. [1] O. Freifeld, S. Hauberg, K. Batmanghelich, J. W. Fisher III, "Transformations based on
       continuous piecewise-affine velocity fields", IEEE TPAMI 39(12), 2017.
    .. [2] N. S. Detlefsen, libcpab, https://github.com/SkafteNicki/libcpab, 2018 (the
       expm-per-step integrator, ``nstepsolver``).
    .. [3] A. Aflalo, E. Treister, C. Baskin, O. Freifeld, FG-CPAB, https://github.com/BGU-CS-VIL/FG-CPAB
       (the discrete adjoint with per-cell moments and segment checkpointing).
    .. [4] N. J. Higham, "The scaling and squaring method for the matrix exponential
       revisited", SIAM J. Matrix Anal. Appl. 26(4), 2005.
    .. [5] C. F. Van Loan, "Computing integrals involving the matrix exponential", IEEE Trans.
       Automatic Control 23(3), 1978 (the block form of the Frechet derivative).
    """
    check_count(checkpoint_every, "checkpoint_every")
    if is_cupy_array(points) or is_cupy_array(theta):
        from . import _integrate_cupy

        with _device_plan(points, theta, tess, n_steps, "integrate") as (plan, batched, _, _):
            x, _, _ = _integrate_cupy.integrate(plan)
        return x if batched else x[0]
    s = _setup(points, theta, tess, n_steps, "integrate")
    x = s.x0
    for _ in range(s.n_steps):
        x, _, _ = _step(s, x)
    return x if s.batched else x[0]


def log_jacobian(points, theta, tess, *, n_steps=50):
    """log det D phi_theta at the points: the log-Jacobian of :func:`integrate`'s scheme.

    Each step multiplies the Jacobian by E_c,lin = expm(h A_c,lin), whose determinant is
    exp(h tr A_c,lin) (tr A_c,lin is the divergence of the field on cell c), so

        log det D phi(x) = h * sum_t tr A_c(t),lin

    along the trajectory of x, exactly for the scheme (almost everywhere) and without
    differencing. Positive values mean expansion, negative compression. Under ``"noslip"``
    and ``"slip"`` the map never folds; under ``zero_boundary=None`` that holds for
    trajectories that stay in the box, while those that leave it follow a discontinuous field
    and this value, still finite, certifies nothing (see :func:`integrate`'s Notes, "Outside
    the box").

    Parameters
    ----------
    points, theta, tess, n_steps
        As for :func:`integrate` (same checks, same step-size guard, same trajectories).

    Returns
    -------
    log_det : ndarray, shape (B, N), or (N,) when neither input has a batch axis
        dtype as :func:`integrate`'s result; accumulated in float64.

    Notes
    -----
    The trajectories are :func:`integrate`'s, projection included, but the projection's own
    factor is left out of the sum: where P clips a coordinate the scheme's Jacobian is
    singular (log det = -inf). Under no-slip P only ever undoes rounding (see
    :func:`integrate`), so this is the log-Jacobian of the map; under slip, at points whose
    trajectory was clipped, it is the volume change of the unclipped steps. This op has no
    VJP yet: it is piecewise constant in the points, and its theta-derivative (h times the
    visits of each cell, on the diagonal of the per-cell moments) is not registered.

    Convention
    ----------
    As for :func:`integrate`: domain [0, 1]^K, coordinate k of a point is array axis k.

    Examples
    --------
    >>> import numpy as np
    >>> from cutopo.cpab import Tessellation, log_jacobian
    >>> tess = Tessellation((4,))
    >>> theta = np.array([0.2, 0.3, 0.1])
    >>> x = np.array([[0.0], [0.25], [0.5], [0.9], [1.0]])
    >>> np.round(log_jacobian(x, theta, tess), 4)       # x = 0 stays in cell 0: slope 0.8
    array([ 0.8,  0.4, -0.8, -0.4, -0.4])

    References
    ----------
    .. [1] O. Freifeld, S. Hauberg, K. Batmanghelich, J. W. Fisher III, "Transformations based on
       continuous piecewise-affine velocity fields", IEEE TPAMI 39(12), 2017.
    """
    if is_cupy_array(points) or is_cupy_array(theta):
        from . import _integrate_cupy

        with _device_plan(points, theta, tess, n_steps, "log_jacobian") as (plan, batched, _, _):
            _, _, out = _integrate_cupy.integrate(plan, log_det=True)
        return out if batched else out[0]
    s = _setup(points, theta, tess, n_steps, "log_jacobian")
    trace = np.trace(s.A_aug[:, :s.K, :s.K], axis1=1, axis2=2)          # div v on each cell
    total, x = np.zeros(s.x0.shape[:2]), s.x0
    for _ in range(s.n_steps):
        x, flat, _ = _step(s, x)
        total += trace[flat]
    out = (s.h * total).astype(s.dtype)
    return out if s.batched else out[0]
