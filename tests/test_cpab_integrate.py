"""CPU tests of cutopo.cpab.integrate and log_jacobian, and of the integrate VJP.

Oracles, none of them cutopo.cpab.integrate itself: closed forms (theta = 0, globally affine
fields), a loop re-implementation of the scheme with scipy.linalg.expm per cell, an ODE solver
(scipy.integrate.solve_ivp) on the velocity field, central finite differences of the forward,
and forward-mode sensitivities propagated with scipy.linalg.expm_frechet (a second, independent
derivative of the same scheme).
"""
from __future__ import annotations

import doctest
import importlib
import math

import numpy as np
import pytest
import scipy.linalg
from scipy.integrate import solve_ivp

import cutopo
from cutopo.cpab import Tessellation, integrate, log_jacobian, velocity
from cutopo.cpab.basis import barycentric_coefficients
from cutopo.cpab.integrate import MAX_STEP_NORM, _expm, _expm_frechet_adjoint
from cutopo.cpab.tessellation import cell_index

# (shape, zero_boundary) of the small tessellations the derivative checks run on
GRAD_CASES = [((5,), "noslip"), ((4,), None), ((3, 3), "noslip"), ((2, 3), "slip"),
              ((2, 2), None), ((2, 2, 2), "slip"), ((2, 1, 2), None)]


# ---------------------------------------------------------------------------------------------
# Helpers and oracles


def lin_norm_max(tess, theta):
    """max over cells (and batch) of ||A_c,lin||_F."""
    A = tess.affine_maps(theta)
    return float(np.sqrt((A[..., :tess.ndim] ** 2).sum(axis=(-1, -2))).max(initial=0.0))


def theta_with_norm(tess, rng, largest, *, n=None, length_scale=0.3):
    """A prior draw rescaled so that max_c ||A_c,lin||_F == largest."""
    theta = tess.sample(1 if n is None else n, length_scale=length_scale, rng=rng)
    theta = theta * (largest * (1 - 1e-9) / lin_norm_max(tess, theta))   # rounding: not above
    return theta[0] if n is None else theta


def reference_trajectory(points, theta, tess, n_steps, *, project=None):
    """The scheme written out: per step and cell, scipy.linalg.expm of the augmented map.

    Returns (states (T+1, N, K), cells (T, N), unprojected step results (T, N, K))."""
    K = tess.ndim
    if project is None:
        project = tess.zero_boundary in ("noslip", "slip")
    A = tess.affine_maps(theta)
    h = 1.0 / n_steps
    cache = {}

    def E(c):
        if c not in cache:
            aug = np.zeros((K + 1, K + 1))
            aug[:K] = A[c]
            cache[c] = scipy.linalg.expm(h * aug)[:K]
        return cache[c]

    x = np.clip(points, 0, 1) if project else np.array(points, dtype=np.float64)
    states, cells, raw = [x], [], []
    for _ in range(n_steps):
        c = cell_index(x, tess.shape)
        y = np.empty_like(x)
        for cc in np.unique(c):
            sel = c == cc
            y[sel] = np.c_[x[sel], np.ones(sel.sum())] @ E(int(cc)).T
        raw.append(y)
        x = np.clip(y, 0, 1) if project else y
        states.append(x)
        cells.append(c)
    return np.array(states), np.array(cells), np.array(raw)


def box_faces(tess):
    """(C, K+1) bool: the face of cell c opposite its vertex l lies on the box boundary."""
    V = tess.vertices[tess.cells]                                       # (C, K+1, K)
    out = np.zeros(V.shape[:2], dtype=bool)
    for l in range(tess.ndim + 1):
        others = np.delete(V, l, axis=1)                                # (C, K, K)
        out[:, l] = ((others == 0).all(axis=1) | (others == 1).all(axis=1)).any(axis=1)
    return out


def face_margin(points, theta, tess, n_steps):
    """Per point, the smallest distance along its trajectory to a kink of the scheme: of a
    step start (clamped into the box, as cell_index does) to the inner faces of its cell (a
    barycentric coordinate), and, under noslip/slip, of a step result to the box faces (where
    the projection switches). Faces on the box boundary are no kinks: the same cell's map
    holds on both sides. Finite differences keep clear of every kink."""
    states, cells, raw = reference_trajectory(points, theta, tess, n_steps)
    coef = barycentric_coefficients(tess)
    x = np.clip(states[:-1], 0, 1)
    x_aug = np.concatenate([x, np.ones(x.shape[:-1] + (1,))], axis=-1)
    bary = np.einsum("tnlq,tnq->tnl", coef[cells], x_aug)
    bary = np.where(box_faces(tess)[cells], np.inf, bary)
    margin = bary.min(axis=(0, 2))
    if tess.zero_boundary in ("noslip", "slip"):
        margin = np.minimum(margin, np.minimum(np.abs(raw), np.abs(1 - raw)).min(axis=(0, 2)))
    return margin


def points_off_faces(rng, tess, theta, n_steps, n, *, margin=1e-4):
    """n random points of the box whose trajectories keep ``margin`` from every kink."""
    for _ in range(20):
        cand = rng.uniform(0.02, 0.98, (8 * n, tess.ndim))
        keep = cand[face_margin(cand, theta, tess, n_steps) > margin]
        if len(keep) >= n:
            return keep[:n]
    raise AssertionError("no points away from the faces found")  # pragma: no cover


def forward_sensitivities(points, theta, tess, n_steps):
    """Forward mode: (x_T (N, K), dx_T/dtheta (N, K, d), dx_T/dx_0 (N, K, K)), O(d T N), with
    the step derivatives from scipy.linalg.expm_frechet."""
    K, d = tess.ndim, tess.n_params
    A = tess.affine_maps(theta)
    columns = tess.basis.toarray().reshape(tess.n_cells, K, K + 1, d)
    h = 1.0 / n_steps
    project = tess.zero_boundary in ("noslip", "slip")
    cache = {}

    def step_maps(c):
        if c not in cache:
            aug = np.zeros((K + 1, K + 1))
            aug[:K] = A[c]
            dE = np.empty((d, K, K + 1))
            for j in range(d):
                daug = np.zeros((K + 1, K + 1))
                daug[:K] = columns[c, :, :, j]
                E, L = scipy.linalg.expm_frechet(h * aug, h * daug)
                dE[j] = L[:K]
            cache[c] = (E[:K] if d else scipy.linalg.expm(h * aug)[:K], dE)
        return cache[c]

    x = np.array(points, dtype=np.float64)
    inside = (x >= 0) & (x <= 1) if project else np.ones(x.shape, bool)
    x = np.clip(x, 0, 1) if project else x
    N = len(x)
    S_theta = np.zeros((N, K, d))
    S_x = np.eye(K)[None] * inside[:, :, None]
    for _ in range(n_steps):
        c = cell_index(x, tess.shape)
        y = np.empty_like(x)
        for n in range(N):
            E, dE = step_maps(int(c[n]))
            xt = np.append(x[n], 1.0)
            y[n] = E @ xt
            S_theta[n] = E[:, :K] @ S_theta[n] + (dE @ xt).T
            S_x[n] = E[:, :K] @ S_x[n]
        if project:
            m = (y >= 0) & (y <= 1)
            S_theta *= m[:, :, None]
            S_x *= m[:, :, None]
            y = np.clip(y, 0, 1)
        x = y
    return x, S_theta, S_x


def central_differences(f, x, eps):
    """The gradient of the scalar f at the array x by central differences."""
    g = np.zeros(x.shape)
    for i in np.ndindex(x.shape):
        e = np.zeros(x.shape)
        e[i] = eps
        g[i] = (f(x + e) - f(x - e)) / (2 * eps)
    return g


def rel_err(a, b, floor=1e-300):
    """||a - b|| / max(||b||, floor)."""
    return np.linalg.norm(np.ravel(a - b)) / max(np.linalg.norm(np.ravel(b)), floor)


# ---------------------------------------------------------------------------------------------
# The vectorised matrix exponential and its adjoint Frechet derivative


def expm_long(M):
    """expm in extended precision (numpy.longdouble): Taylor series after scaling to norm
    1/4, then squaring."""
    M = np.asarray(M, dtype=np.longdouble)
    norm = float(np.abs(M).sum(axis=0).max())
    s = max(0, math.ceil(math.log2(norm / 0.25))) if norm > 0 else 0
    X = M / 2**s
    R = term = np.eye(len(M), dtype=np.longdouble)
    for k in range(1, 30):
        term = term @ X / k
        R = R + term
    for _ in range(s):
        R = R @ R
    return R


@pytest.mark.parametrize("m", [2, 3, 4, 8])
def test_expm_and_frechet_adjoint_match_an_extended_precision_reference(m, rng):
    M = rng.normal(size=(40, m, m)) * rng.choice([0.0, 1e-4, 0.05, 0.5, 2.0], size=(40, 1, 1))
    G = rng.normal(size=(40, m, m)) * rng.choice([1e-8, 1.0, 1e6], size=(40, 1, 1))
    E = _expm(M)
    F = _expm_frechet_adjoint(M, G)
    for i in range(len(M)):
        tol = 1e-14 * max(1.0, np.abs(M[i]).sum(axis=0).max())         # u times the 1-norm
        ref = expm_long(M[i])
        assert np.abs(E[i] - ref).max() <= tol * np.abs(ref).max()
        # the adjoint of L(X, .) is L(X^T, .): the top-right block of expm([[X^T, G], [0, X^T]])
        block = np.zeros((2 * m, 2 * m))
        block[:m, :m] = block[m:, m:] = M[i].T
        g = np.abs(G[i]).max()
        block[:m, m:] = G[i] / g                                      # L is linear in G
        ref = expm_long(block)[:m, m:] * g
        assert np.abs(F[i] - ref).max() <= 10 * tol * np.abs(ref).max()
        ref = scipy.linalg.expm_frechet(M[i].T, G[i], compute_expm=False)
        np.testing.assert_allclose(F[i], ref, rtol=0, atol=1e-11 * np.abs(ref).max())
    assert (_expm(np.zeros((3, m, m))) == np.eye(m)).all()              # exactly I at 0


def test_expm_large_batches_are_chunked(rng):
    M = rng.normal(size=(40000, 3, 3)) * 0.3
    E = _expm(M)
    for i in rng.integers(0, len(M), 5):
        np.testing.assert_allclose(E[i], scipy.linalg.expm(M[i]), rtol=1e-13, atol=1e-15)


# ---------------------------------------------------------------------------------------------
# Forward


@pytest.mark.parametrize("shape,zb", [((4,), "noslip"), ((3, 2), "slip"), ((2, 2, 2), None)])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_zero_theta_is_the_identity(shape, zb, dtype, rng):
    tess = Tessellation(shape, zero_boundary=zb)
    x = rng.random((20, len(shape))).astype(dtype)
    out = integrate(x, np.zeros(tess.n_params, dtype), tess, n_steps=7)
    assert out.dtype == dtype and (out == x).all()
    assert (log_jacobian(x, np.zeros((2, tess.n_params)), tess) == 0).all()


@pytest.mark.parametrize("shape,zb", [((6,), "noslip"), ((3, 4), "noslip"), ((2, 3), None),
                                      ((3, 2), "slip"), ((2, 2, 3), "noslip"), ((2, 2, 2), None)])
def test_matches_the_scheme_written_out(shape, zb, rng):
    """Against per-cell scipy.linalg.expm steps, with a batch of fields and of point sets."""
    tess = Tessellation(shape, zero_boundary=zb)
    T = 12
    theta = theta_with_norm(tess, rng, 0.45 * T, n=2)
    x = rng.random((2, 30, tess.ndim))
    out = integrate(x, theta, tess, n_steps=T)
    assert out.shape == (2, 30, tess.ndim)
    for b in range(2):
        ref = reference_trajectory(x[b], theta[b], tess, T)[0][-1]
        np.testing.assert_allclose(out[b], ref, rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("K", [1, 2, 3])
def test_globally_affine_field_is_integrated_exactly(K, rng):
    """Vertex velocities v = M x + b make every A_c = [M b]: no step error, phi = expm."""
    tess = Tessellation((2, 3, 2)[:K], zero_boundary=None)
    M, b = rng.normal(size=(K, K)), rng.normal(size=K)
    theta = (tess.vertices @ M.T + b)[tess.dof_vertex, tess.dof_axis]
    aug = np.zeros((K + 1, K + 1))
    aug[:K, :K], aug[:K, K] = M, b
    x = rng.random((10, K))
    expected = (np.c_[x, np.ones(len(x))] @ scipy.linalg.expm(aug).T)[:, :K]
    for T in (math.ceil(np.linalg.norm(M) / MAX_STEP_NORM), 40):
        np.testing.assert_allclose(integrate(x, theta, tess, n_steps=T), expected,
                                   rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(log_jacobian(x, theta, tess, n_steps=40), np.trace(M), rtol=1e-12)


def test_1d_matches_an_ode_solution(rng):
    """The scheme errs only at cell crossings, O(h^2) each: <= 4 h^2 against a tight RK solve
    (measured with max |a_c| = 4 over 120 fields: median 0.2 h^2, worst 1.4 h^2)."""
    tess = Tessellation((6,))
    theta = theta_with_norm(tess, rng, 4.0)
    x = rng.uniform(0, 1, (8, 1))
    ref = np.array([solve_ivp(lambda t, y: velocity(y[None], theta, tess)[0], (0, 1), xi,
                              method="DOP853", rtol=1e-12, atol=1e-14).y[:, -1] for xi in x])
    for T in (20, 50, 200):          # a bound, not monotone: it depends on where crossings fall
        err = np.abs(integrate(x, theta, tess, n_steps=T) - ref).max()
        assert err <= 4.0 / T**2, (T, err)


@pytest.mark.parametrize("shape,T", [((4, 4), 50), ((3, 3, 3), 40), ((8,), 50)])
def test_negative_theta_inverts(shape, T, rng):
    """phi_{-theta}(phi_theta(x)) = x up to the discretisation error: <= 10 h^2 over 200
    points (measured with max ||A_c,lin||_F = 3, 150 fields per case: median 0.4-0.6 h^2,
    99th percentile 0.9-1.5 h^2, worst 4.4 h^2, on a trajectory past a saddle)."""
    tess = Tessellation(shape)
    theta = theta_with_norm(tess, rng, 3.0)
    x = rng.random((200, len(shape)))
    back = integrate(integrate(x, theta, tess, n_steps=T), -theta, tess, n_steps=T)
    assert np.abs(back - x).max() <= 10.0 / T**2


@pytest.mark.parametrize("shape", [(5,), (3, 3), (2, 2, 2)])
def test_noslip_trajectories_stay_in_the_box_without_projection(shape, rng):
    """The proof in integrate's Notes: at the guard's limit h max ||A_c,lin||_F = 0.5, the
    unprojected scheme keeps every trajectory in the box up to rounding, and boundary points
    stay put; the projected result is in [0, 1]^K, float32 and float64."""
    tess = Tessellation(shape)
    K, T = tess.ndim, 8
    theta = theta_with_norm(tess, rng, MAX_STEP_NORM * T * (1 - 1e-6), length_scale=0.15)
    near = rng.choice([0.0, 1e-300, 1e-12, 1e-6, 1 - 1e-12, 1.0], size=(60, K))
    mixed = np.where(rng.random((60, K)) < 0.5, near, rng.random((60, K)))
    x = np.concatenate([mixed, rng.random((60, K))])
    states, _, raw = reference_trajectory(x, theta, tess, T, project=False)
    assert raw.min() >= -1e-13 and raw.max() <= 1 + 1e-13                 # rounding only
    for dtype in (np.float64, np.float32):
        out = integrate(x.astype(dtype), theta.astype(dtype), tess, n_steps=T)
        assert out.dtype == dtype and out.min() >= 0 and out.max() <= 1
    on_face = ((x == 0) | (x == 1)).any(axis=1)
    np.testing.assert_allclose(integrate(x[on_face], theta, tess, n_steps=T), x[on_face],
                               rtol=0, atol=1e-13)


def test_slip_results_are_projected_into_the_box(rng):
    tess = Tessellation((3, 3), zero_boundary="slip")
    T = 6
    theta = theta_with_norm(tess, rng, MAX_STEP_NORM * T, n=3, length_scale=0.2)
    x = np.concatenate([rng.random((100, 2)), rng.choice([0.0, 1e-9, 1.0], size=(40, 2))])
    out = integrate(x, theta, tess, n_steps=T)
    assert out.min() >= 0 and out.max() <= 1


def test_points_outside_the_box(rng):
    """noslip/slip: projected first; None: the affine extension of the nearest box cell."""
    x = np.array([[-0.3, 0.5], [0.4, 1.2], [1.5, -0.1], [0.3, 0.6]])
    for zb in ("noslip", "slip"):
        tess = Tessellation((3, 2), zero_boundary=zb)
        theta = theta_with_norm(tess, rng, 3.0)
        np.testing.assert_array_equal(integrate(x, theta, tess, n_steps=10),
                                      integrate(np.clip(x, 0, 1), theta, tess, n_steps=10))
        out, pullback = cutopo.vjp(integrate, x, theta, tess, n_steps=10)
        d_points = pullback(np.ones_like(out))[0]
        assert (d_points[(x < 0) | (x > 1)] == 0).all()
    tess = Tessellation((3, 2), zero_boundary=None)
    theta = theta_with_norm(tess, rng, 3.0)
    np.testing.assert_allclose(integrate(x, theta, tess, n_steps=10),
                               reference_trajectory(x, theta, tess, 10)[0][-1],
                               rtol=1e-13, atol=1e-13)


def test_batch_shapes_and_broadcasting(rng):
    tess = Tessellation((3, 2))
    K, d = 2, tess.n_params
    theta = theta_with_norm(tess, rng, 3.0, n=3)
    pts = rng.random((3, 7, K))
    single = np.array([integrate(pts[b], theta[b], tess, n_steps=10) for b in range(3)])
    assert single.shape == (3, 7, K)
    np.testing.assert_array_equal(integrate(pts, theta, tess, n_steps=10), single)
    shared = integrate(pts[0], theta, tess, n_steps=10)                  # (N, K) x (B, d)
    np.testing.assert_array_equal(shared[1], integrate(pts[0], theta[1], tess, n_steps=10))
    out = integrate(pts, theta[0], tess, n_steps=10)                    # (B, N, K) x (d,)
    np.testing.assert_array_equal(out[2], integrate(pts[2], theta[0], tess, n_steps=10))
    assert integrate(pts[:1], theta, tess, n_steps=10).shape == (3, 7, K)
    assert integrate(pts, theta[:1], tess, n_steps=10).shape == (3, 7, K)
    assert log_jacobian(pts[0], theta[0], tess, n_steps=10).shape == (7,)
    assert log_jacobian(pts, theta[0], tess, n_steps=10).shape == (3, 7)
    assert integrate(np.zeros((0, K)), theta, tess).shape == (3, 0, K)
    assert integrate(pts[:1], np.zeros((0, d)), tess).shape == (0, 7, K)


def test_float32(rng):
    tess = Tessellation((3, 3))
    theta = theta_with_norm(tess, rng, 3.0)
    # The scheme jumps by O(h^2) where a step start crosses a face, and float32 rounding can
    # move one across: compare on trajectories that keep off the faces.
    x = points_off_faces(rng, tess, theta, 20, 50, margin=1e-5)
    out64 = integrate(x, theta, tess, n_steps=20)
    out32 = integrate(x.astype(np.float32), theta.astype(np.float32), tess, n_steps=20)
    assert out32.dtype == np.float32
    np.testing.assert_allclose(out32, out64, rtol=0, atol=2e-5)
    lj = log_jacobian(x.astype(np.float32), theta, tess, n_steps=20)
    assert lj.dtype == np.float64                    # float32 points, float64 theta -> float64
    out, pullback = cutopo.vjp(integrate, x.astype(np.float32), theta.astype(np.float32), tess,
                               n_steps=20)
    d_points, d_theta, _ = pullback(np.ones_like(out))
    assert d_points.dtype == np.float32 and d_theta.dtype == np.float32
    _, pullback64 = cutopo.vjp(integrate, x, theta, tess, n_steps=20)
    ref_points, ref_theta, _ = pullback64(np.ones_like(out64))
    assert rel_err(d_theta, ref_theta) < 1e-3 and rel_err(d_points, ref_points) < 1e-3


def test_no_parameters(rng):
    tess = Tessellation((1, 1, 1))                                     # no-slip: d = 0
    x = rng.random((5, 3))
    np.testing.assert_array_equal(integrate(x, np.zeros(0), tess), x)
    out, pullback = cutopo.vjp(integrate, x, np.zeros(0), tess)
    d_points, d_theta, _ = pullback(np.ones_like(out))
    assert d_theta.shape == (0,)
    np.testing.assert_array_equal(d_points, np.ones_like(x))


# ---------------------------------------------------------------------------------------------
# log-Jacobian


@pytest.mark.parametrize("shape,zb", [((5,), "noslip"), ((3, 3), "noslip"), ((2, 2), None),
                                      ((2, 2, 2), "noslip"), ((2, 1, 2), None)])
def test_log_jacobian_matches_finite_differences(shape, zb, rng):
    tess = Tessellation(shape, zero_boundary=zb)
    K, T = tess.ndim, 10
    theta = theta_with_norm(tess, rng, 0.35 * T)
    x = points_off_faces(rng, tess, theta, T, 4)
    lj = log_jacobian(x, theta, tess, n_steps=T)
    eps = 1e-6
    for n in range(len(x)):
        J = np.empty((K, K))
        for q in range(K):
            e = np.zeros(K)
            e[q] = eps
            J[:, q] = (integrate((x[n] + e)[None], theta, tess, n_steps=T)[0]
                       - integrate((x[n] - e)[None], theta, tess, n_steps=T)[0]) / (2 * eps)
        assert abs(lj[n] - np.log(np.linalg.det(J))) < 1e-6
    # and exactly the log det of the forward-mode Jacobian
    _, _, S_x = forward_sensitivities(x, theta, tess, T)
    np.testing.assert_allclose(lj, np.log(np.linalg.det(S_x)), rtol=0, atol=1e-12)


# ---------------------------------------------------------------------------------------------
# VJP


@pytest.mark.parametrize("shape,zb", GRAD_CASES)
def test_vjp_matches_central_differences(shape, zb, rng):
    """float64, eps = 1e-7, trajectories kept 1e-4 off every face: relative error < 1e-6, with
    checkpoint segments of 1, 4 and 3 steps (3 does not divide T = 10). The relative error is
    taken to at least 1e-2 ||w||: central differences carry a rounding noise of about
    u |f| / eps ~ 1e-9 ||w||, which a gradient that happens to be tiny cannot beat."""
    tess = Tessellation(shape, zero_boundary=zb)
    T = 10
    theta = theta_with_norm(tess, rng, 0.35 * T)
    x = points_off_faces(rng, tess, theta, T, 3)
    w = rng.normal(size=x.shape)

    def f_theta(th):
        return float((w * integrate(x, th, tess, n_steps=T)).sum())

    def f_points(p):
        return float((w * integrate(p, theta, tess, n_steps=T)).sum())

    fd_theta = central_differences(f_theta, theta, 1e-7)
    fd_points = central_differences(f_points, x, 1e-7)
    for S in (1, 4, 3):
        out, pullback = cutopo.vjp(integrate, x, theta, tess, n_steps=T, checkpoint_every=S)
        d_points, d_theta, d_tess = pullback(w)
        assert d_tess is None and d_theta.shape == theta.shape and d_points.shape == x.shape
        floor = 1e-2 * np.linalg.norm(w)
        assert rel_err(d_theta, fd_theta, floor) < 1e-6, S
        assert rel_err(d_points, fd_points, floor) < 1e-6, S


@pytest.mark.parametrize("shape,zb", GRAD_CASES)
def test_vjp_matches_forward_sensitivities(shape, zb, rng):
    """A second oracle, exact for the same scheme: d x_T / d theta_j propagated forwards."""
    tess = Tessellation(shape, zero_boundary=zb)
    T = 10
    theta = theta_with_norm(tess, rng, 0.45 * T)
    x = rng.random((6, tess.ndim))
    x_T, S_theta, S_x = forward_sensitivities(x, theta, tess, T)
    out, pullback = cutopo.vjp(integrate, x, theta, tess, n_steps=T, checkpoint_every=4)
    np.testing.assert_allclose(out, x_T, rtol=1e-13, atol=1e-13)
    w = rng.normal(size=out.shape)
    d_points, d_theta, _ = pullback(w)
    floor = 1e-3 * np.linalg.norm(w)
    assert rel_err(d_theta, np.einsum("nk,nkj->j", w, S_theta), floor) < 1e-11
    assert rel_err(d_points, np.einsum("nk,nkq->nq", w, S_x), floor) < 1e-11


def test_vjp_checkpoint_segments_agree(rng):
    tess = Tessellation((3, 3), zero_boundary="slip")
    T = 10
    theta = theta_with_norm(tess, rng, 0.45 * T, n=2)
    x = rng.random((2, 40, 2))
    w = rng.normal(size=x.shape)
    grads = [cutopo.vjp(integrate, x, theta, tess, n_steps=T, checkpoint_every=S)[1](w)
             for S in (1, 2, 3, 7, 10, 25)]
    for g in grads[1:]:
        assert rel_err(g[0], grads[0][0]) < 1e-13 and rel_err(g[1], grads[0][1]) < 1e-13


def test_vjp_batches_sum_over_shared_arguments(rng):
    tess = Tessellation((2, 3))
    T = 10
    theta = theta_with_norm(tess, rng, 3.0, n=3)
    pts = rng.random((3, 6, 2))
    w = rng.normal(size=(3, 6, 2))
    per_item = [cutopo.vjp(integrate, pts[b], theta[b], tess, n_steps=T)[1](w[b]) for b in range(3)]
    # one field per set of points
    d_points, d_theta, _ = cutopo.vjp(integrate, pts, theta, tess, n_steps=T)[1](w)
    for b in range(3):
        np.testing.assert_allclose(d_points[b], per_item[b][0], rtol=1e-12, atol=1e-14)
        np.testing.assert_allclose(d_theta[b], per_item[b][1], rtol=1e-12, atol=1e-14)
    # shared points (N, K) and (1, N, K): summed over the batch
    for shared in (pts[0], pts[:1]):
        ref = [cutopo.vjp(integrate, pts[0], theta[b], tess, n_steps=T)[1](w[b]) for b in range(3)]
        d_points, d_theta, _ = cutopo.vjp(integrate, shared, theta, tess, n_steps=T)[1](w)
        assert d_points.shape == shared.shape
        np.testing.assert_allclose(d_points.reshape(6, 2), sum(r[0] for r in ref),
                                   rtol=1e-12, atol=1e-14)
        np.testing.assert_allclose(d_theta, np.array([r[1] for r in ref]), rtol=1e-12, atol=1e-14)
    # shared theta (d,) and (1, d)
    for shared in (theta[0], theta[:1]):
        ref = [cutopo.vjp(integrate, pts[b], theta[0], tess, n_steps=T)[1](w[b]) for b in range(3)]
        d_points, d_theta, _ = cutopo.vjp(integrate, pts, shared, tess, n_steps=T)[1](w)
        assert d_theta.shape == shared.shape
        np.testing.assert_allclose(d_theta.reshape(-1), sum(r[1] for r in ref),
                                   rtol=1e-12, atol=1e-14)
        np.testing.assert_allclose(d_points, np.array([r[0] for r in ref]), rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("points_shape,theta_shape", [((4, 2), (0,)), ((1, 4, 2), (0,)),
                                                       ((0, 4, 2), (1,)), ((0, 4, 2), ()),
                                                       ((0, 4, 2), (0,)), ((3, 0, 2), (3,))])
def test_vjp_of_empty_batches(points_shape, theta_shape, rng):
    """An empty batch has an empty output and zero cotangents of the arguments' shapes (an
    empty theta batch used to fail reshaping the per-cell moments)."""
    from cutopo.cpab import compose

    tess = Tessellation((2, 2))
    points = rng.random(points_shape)
    theta = theta_with_norm(tess, rng, 3.0, n=1)[0] * np.ones(theta_shape + (1,))
    out, pullback = cutopo.vjp(integrate, points, theta, tess, n_steps=10)
    assert out.size == 0
    d_points, d_theta, d_tess = pullback(np.zeros(out.shape))
    assert d_points.shape == points.shape and d_theta.shape == theta.shape and d_tess is None
    assert not d_points.any() and not d_theta.any()
    out, pullback = cutopo.vjp(compose, points, np.stack([theta, -theta]), tess, n_steps=10)
    d_points, d_thetas, _ = pullback(np.zeros(out.shape))
    assert d_points.shape == points.shape and d_thetas.shape == (2,) + theta.shape
    assert not d_points.any() and not d_thetas.any()


@pytest.mark.gpu
def test_vjp_of_an_empty_theta_batch_on_the_device(rng):
    """The device backward's theta cotangent of an empty batch (no -1 to infer there either)."""
    import cupy as cp

    tess = Tessellation((2, 2))
    points = cp.asarray(rng.random((4, 2)))
    out, pullback = cutopo.vjp(integrate, points, cp.zeros((0, tess.n_params)), tess, n_steps=10)
    assert out.shape == (0, 4, 2)
    d_points, d_theta, _ = pullback(cp.zeros(out.shape))
    assert d_points.shape == (4, 2) and d_theta.shape == (0, tess.n_params)
    assert not bool(d_points.any())


def test_vjp_wrt_one_argument(rng):
    tess = Tessellation((4,))
    theta = theta_with_norm(tess, rng, 3.0)
    x = rng.random((5, 1))
    out, pullback = cutopo.vjp(integrate, x, theta, tess, wrt="theta", n_steps=10)
    d_points, d_theta, d_tess = pullback(np.ones_like(out))
    assert d_points is None and d_theta.shape == (3,) and d_tess is None
    out, pullback = cutopo.vjp(integrate, x, theta, tess, wrt="points", n_steps=10)
    d_points, d_theta, _ = pullback(np.ones_like(out))
    assert d_theta is None and d_points.shape == (5, 1)
    full = cutopo.vjp(integrate, x, theta, tess, n_steps=10)[1](np.ones_like(out))
    np.testing.assert_array_equal(d_points, full[0])
    from cutopo.vjp import REGISTRY

    spec = REGISTRY["cpab_integrate"]
    assert spec.arg_names == ("points", "theta", "tess")
    assert spec.differentiable == {"points", "theta"}


# ---------------------------------------------------------------------------------------------
# Errors, exports, docstrings


def test_errors(rng):
    tess = Tessellation((3, 3))
    theta = np.zeros(tess.n_params)
    x = rng.random((4, 2))
    for fn in (integrate, log_jacobian):
        with pytest.raises(ValueError, match="theta must have shape"):
            fn(x, np.zeros(tess.n_params + 1), tess)
        with pytest.raises(ValueError, match="points must have shape"):
            fn(rng.random((4, 3)), theta, tess)
        with pytest.raises(ValueError, match="points must have shape"):
            fn(rng.random(4), theta, tess)
        with pytest.raises(ValueError, match="n_steps must be >= 1"):
            fn(x, theta, tess, n_steps=0)
        # past the kernels' 32-bit step counter: refused at once (ran without end on NumPy)
        with pytest.raises(ValueError, match="n_steps must be <= 2147483647"):
            fn(x, theta, tess, n_steps=2 ** 31)
        with pytest.raises(TypeError, match="n_steps must be an int"):
            fn(x, theta, tess, n_steps=10.0)
        with pytest.raises(TypeError, match="n_steps must be an int"):
            fn(x, theta, tess, n_steps=True)
        with pytest.raises(ValueError, match="batch sizes 2 and 3"):
            fn(rng.random((2, 4, 2)), np.zeros((3, tess.n_params)), tess)
        with pytest.raises(ValueError, match="theta must be finite"):
            fn(x, np.full(tess.n_params, np.nan), tess)
        with pytest.raises(ValueError, match="points must be finite"):
            fn(np.full((2, 2), np.inf), theta, tess)
        with pytest.raises(TypeError, match="Tessellation"):
            fn(x, theta, (3, 3))
        with pytest.raises(TypeError, match="real numbers"):
            fn(x.astype(complex), theta, tess)
    with pytest.raises(ValueError, match="checkpoint_every must be >= 1"):
        integrate(x, theta, tess, checkpoint_every=0)
    with pytest.raises(ValueError, match="checkpoint_every must be >= 1"):
        cutopo.vjp(integrate, x, theta, tess, checkpoint_every=0)


def test_step_size_guard(rng):
    tess = Tessellation((3, 3))
    theta = theta_with_norm(tess, rng, 7.3)                             # needs n_steps >= 15
    x = rng.random((4, 2))
    for fn in (integrate, log_jacobian):
        with pytest.raises(ValueError, match=r"n_steps=14 .*use n_steps >= 15"):
            fn(x, theta, tess, n_steps=14)
        fn(x, theta, tess, n_steps=15)
    with pytest.raises(ValueError, match=r"n_steps=10 .*use n_steps >= 15"):
        cutopo.vjp(integrate, x, np.stack([theta / 10, theta]), tess, n_steps=10)


def test_step_size_guard_on_huge_theta(rng):
    """A finite theta too large for any practical step count: a ValueError saying so (the
    guard's norm overflowed to inf and raised OverflowError from math.ceil before)."""
    tess = Tessellation((3, 3))
    x = rng.random((4, 2))
    theta = theta_with_norm(tess, rng, 1.0)
    for fn in (integrate, log_jacobian):
        with pytest.raises(ValueError, match="theta is too large: .* overflows float64"):
            fn(x, theta * 1e300, tess)
        with pytest.raises(ValueError, match=r"too coarse .*needs n_steps >= 2e\+150: scale theta"):
            fn(x, theta * 1e150, tess)


@pytest.mark.parametrize("shape", [(4,), (2, 2)])
def test_step_size_guard_when_the_affine_maps_overflow(shape, rng):
    """theta = 1e308 everywhere: B theta adds +inf and -inf, so A_c holds NaN and so does the
    guard's norm, which slipped past a ``largest > limit`` test (NaN results at n_steps=1, and
    an error blaming ``points`` at 3). The guard's overflow error instead, at any n_steps."""
    tess = Tessellation(shape)
    theta = np.full(tess.n_params, 1e308)
    assert np.isnan(tess.affine_maps(theta)).any()  # the case this test is about
    x = rng.random((3, tess.ndim))
    for n_steps in (1, 3):
        for fn in (integrate, log_jacobian):
            with pytest.raises(ValueError, match="theta is too large: .* overflows float64"):
                fn(x, theta, tess, n_steps=n_steps)
        with pytest.raises(ValueError, match="theta is too large"):
            cutopo.vjp(integrate, x, theta, tess, n_steps=n_steps)


def test_exports():
    import cutopo.cpab as cpab

    assert {"integrate", "log_jacobian"} <= set(cpab.__all__)
    assert cpab.integrate is integrate and cpab.log_jacobian is log_jacobian


def test_docstring_examples():
    result = doctest.testmod(importlib.import_module("cutopo.cpab.integrate"), verbose=False,
                             report=True)
    assert result.attempted > 0
    assert result.failed == 0


def test_recomputed_checkpoint_segments(monkeypatch):
    """The segment length of a backward that recomputes its checkpoints (CuPy path): the
    requested S where ceil(T / S) fits the threads' 16 local checkpoints, else the smallest S
    that fits, and None (the forward's device array) past 16 x 17 steps (segments of at most
    17) or in "device" mode. "sparse": the forward's array with at most 3 copies (S raised to
    ceil(T / 3)) while that S is at most 17, then as "recompute"."""
    from cutopo.cpab import _integrate_cupy as icp

    def recompute_segment(T, S):
        segment, recompute = icp.checkpoint_segment(T, S)
        return segment if recompute else None

    monkeypatch.setattr(icp, "CHECKPOINTS", "device")
    assert recompute_segment(50, 4) is None
    assert icp.checkpoint_segment(50, 4) == (4, False)
    monkeypatch.setattr(icp, "CHECKPOINTS", "recompute")
    assert [recompute_segment(T, S) for T, S in ((50, 4), (64, 4), (65, 4), (100, 1),
                                                  (256, 1), (257, 1), (272, 1), (273, 1),
                                                  (20, 16))] == \
        [4, 4, 5, 7, 16, 17, 17, None, 16]
    monkeypatch.setattr(icp, "CHECKPOINTS", "sparse")
    cases = ((50, 4), (51, 4), (52, 4), (20, 4), (20, 16), (100, 1), (300, 4), (3, 1))
    assert [icp.checkpoint_segment(T, S) for T, S in cases] == \
        [(17, False), (17, False), (4, True), (7, False), (16, False), (7, True), (4, False),
         (1, False)]
