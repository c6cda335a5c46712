"""CUDA kernels of the CPA ops (cuda_src/cpab.cu) against the NumPy path.

The NumPy path is the oracle here (it is tested against closed forms, an ODE solver, finite
differences and forward sensitivities in test_cpab_integrate.py). Point location is exact, so
cells must be equal; with the NumPy step matrices substituted the trajectories must be equal
bit for bit; otherwise results agree to the rounding of E_c. Outputs come from a NaN-poisoned
pool, so an element a kernel forgets to write shows up as NaN.
"""
from __future__ import annotations

import functools

import numpy as np
import pytest

import cutopo
from cutopo._cuda.launch import KeptLaunches
from cutopo.cpab import Tessellation, integrate, log_jacobian, velocity
from cutopo.cpab import _integrate_cupy
from cutopo.cpab.integrate import _setup
from cutopo.cpab.tessellation import cell_index
from gpu_support import busy, cupy_module as _cp, poison_pool

pytestmark = pytest.mark.gpu

SHAPES = [(7,), (3, 4), (4, 4), (2, 3, 2), (3, 3, 3)]
BOUNDARIES = ["noslip", "slip", None]
RTOL = {np.dtype(np.float32): 2e-5, np.dtype(np.float64): 1e-11}


@pytest.fixture
def rng():
    return np.random.default_rng()


def on_faces(rng, shape, n, dtype):
    """Points on box faces, diagonals and simplex faces (local coordinates with x == y,
    x + y == 1, and the 3D tests' planes), plus some outside the box."""
    K = len(shape)
    nn = np.array(shape, dtype=np.float64)
    box = rng.integers(0, nn, size=(n, K))
    local = rng.random((n, K))
    kind = rng.integers(0, 5, size=n)
    local[kind == 0, 0] = 0.0                                             # a box face
    if K >= 2:
        local[kind == 1, 1] = local[kind == 1, 0]                         # x == y
        local[kind == 2, 1] = 1.0 - local[kind == 2, 0]                   # x + y == 1
    if K == 3:
        sel = kind == 3
        local[sel, 2] = local[sel, 0] + local[sel, 1] - 1.0               # a corner-tet plane
        local[sel, 2] = np.abs(local[sel, 2])
    pts = (box + local) / nn
    pts[kind == 4] = rng.uniform(-0.3, 1.3, size=(int((kind == 4).sum()), K))
    return pts.astype(dtype)


def draw_theta(tess, rng, n=None, largest=4.0):
    theta = tess.sample(1 if n is None else n, length_scale=0.3, rng=rng)
    A = tess.affine_maps(theta)
    norm = float(np.sqrt((A[..., :tess.ndim] ** 2).sum(axis=(-1, -2))).max(initial=0.0))
    theta = theta * (largest / max(norm, 1e-12))
    return theta[0] if n is None else theta


# ---------------------------------------------------------------------------------------------
# Point location and the field


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", SHAPES)
def test_cell_index_equals_numpy_exactly(shape, dtype, rng):
    cp = _cp()
    poison_pool()
    pts = np.concatenate([on_faces(rng, shape, 4000, dtype),
                          rng.random((4000, len(shape))).astype(dtype)])
    got = cell_index(cp.asarray(pts), shape)
    assert isinstance(got, cp.ndarray) and got.dtype == np.int64
    np.testing.assert_array_equal(got.get(), cell_index(pts, shape))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", SHAPES)
def test_velocity_matches_numpy(shape, dtype, rng):
    cp = _cp()
    poison_pool()
    tess = Tessellation(shape, zero_boundary=None)
    theta = draw_theta(tess, rng, n=3).astype(dtype)
    pts = on_faces(rng, shape, 2000, dtype)
    for p, t in [(pts, theta), (pts, theta[0]), (np.stack([pts] * 3), theta[1])]:
        want = velocity(p, t, tess)
        got = velocity(cp.asarray(p), cp.asarray(t), tess)
        assert got.shape == want.shape and got.dtype == want.dtype
        np.testing.assert_allclose(got.get(), want, rtol=RTOL[want.dtype], atol=RTOL[want.dtype])


# ---------------------------------------------------------------------------------------------
# Step matrices and trajectories


@pytest.mark.parametrize("shape", SHAPES)
def test_step_matrices_match_numpy_expm(shape, rng):
    cp = _cp()
    tess = Tessellation(shape)
    theta = draw_theta(tess, rng, n=2, largest=20.0)
    pts = rng.random((5, len(shape)))
    plan = _integrate_cupy.setup(cp.asarray(pts), cp.asarray(theta), tess, 50, "integrate",
                                 np.dtype(np.float64))
    s = _setup(pts, theta, tess, 50, "integrate")
    np.testing.assert_allclose(plan.A.get(), s.A_aug[:, :tess.ndim, :], rtol=1e-13, atol=1e-15)
    np.testing.assert_allclose(plan.E.get(), s.E, rtol=1e-14, atol=1e-15)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("zb", BOUNDARIES)
@pytest.mark.parametrize("shape", SHAPES)
def test_trajectories_are_numpys_bit_for_bit_with_numpys_step_matrices(shape, zb, dtype, rng):
    cp = _cp()
    poison_pool()
    tess = Tessellation(shape, zero_boundary=zb)
    theta = draw_theta(tess, rng, n=2, largest=6.0).astype(dtype)
    pts = np.concatenate([on_faces(rng, shape, 1500, dtype),
                          rng.random((1500, len(shape))).astype(dtype)])
    T = 16
    s = _setup(pts, theta, tess, T, "integrate")
    plan = _integrate_cupy.setup(cp.asarray(pts), cp.asarray(theta), tess, T, "integrate",
                                 np.dtype(dtype))
    plan.E = cp.asarray(s.E)                                             # NumPy's rounding of E
    out, _, _ = _integrate_cupy.integrate(plan)
    np.testing.assert_array_equal(out.get(), integrate(pts, theta, tess, n_steps=T))
    _, _, ld = _integrate_cupy.integrate(plan, log_det=True)
    # same cells; the traces come from the device's A (cupyx.scipy.sparse: float64 rounding)
    np.testing.assert_allclose(ld.get(), log_jacobian(pts, theta, tess, n_steps=T),
                               rtol=RTOL[np.dtype(dtype)], atol=RTOL[np.dtype(dtype)])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("zb", BOUNDARIES)
@pytest.mark.parametrize("shape", SHAPES)
def test_integrate_and_log_jacobian_match_numpy(shape, zb, dtype, rng):
    cp = _cp()
    poison_pool()
    tess = Tessellation(shape, zero_boundary=zb)
    theta = draw_theta(tess, rng, n=3).astype(dtype)
    pts = rng.random((3000, len(shape))).astype(dtype)
    for p, t in [(pts, theta), (pts, theta[2]), (np.stack([pts] * 3), theta),
                 (np.stack([pts] * 3), theta[0]), (pts[None], theta)]:
        for fn in (integrate, log_jacobian):
            want = fn(p, t, tess, n_steps=20)
            got = fn(cp.asarray(p), cp.asarray(t), tess, n_steps=20)
            assert isinstance(got, cp.ndarray)
            assert got.shape == want.shape and got.dtype == want.dtype
            # E_c differs from NumPy's by float64 rounding: a point that starts a step within
            # that distance of a face may take the other cell's step (an O(h^2) difference)
            diff = np.abs(got.get() - want)
            tol = 10 * RTOL[want.dtype]
            assert np.mean(diff > tol) < 1e-3, (fn.__name__, float(diff.max()))


def test_no_slip_trajectories_stay_in_the_box(rng):
    cp = _cp()
    tess = Tessellation((5, 5))
    theta = cp.asarray(draw_theta(tess, rng, largest=20.0))             # h ||A|| = 0.4
    pts = cp.asarray(rng.random((20000, 2)))
    out = integrate(pts, theta, tess, n_steps=50)
    assert bool(((out >= 0) & (out <= 1)).all())
    # phi_{-theta} inverts only up to the frozen-cell scheme's error, which at h ||A|| = 0.4
    # reached 0.24 for some seeds: compare the round trip with the NumPy path's instead. The
    # step matrices of -theta agree with NumPy's to float64 rounding only, and the backward
    # trajectories pass close to faces: on the H200, 40 seeds, 0.5-9 % of the points differed
    # by more than 1e-9, by at most 3.2e-7 (a bound of 1e-9 on 0.1 % of them failed 1 seed in 4)
    back = integrate(out, -theta, tess, n_steps=50)
    want = integrate(integrate(pts.get(), theta.get(), tess, n_steps=50), -theta.get(), tess,
                     n_steps=50)
    assert float(np.abs(back.get() - want).max()) < 1e-5
    # and with small steps the round trip is the identity to O(h^2)
    back = integrate(integrate(pts, theta / 4, tess, n_steps=200), -theta / 4, tess, n_steps=200)
    assert float(cp.median(cp.abs(back - pts))) < 1e-4


# ---------------------------------------------------------------------------------------------
# The VJP


@pytest.mark.parametrize("zb", BOUNDARIES)
@pytest.mark.parametrize("shape", SHAPES)
def test_vjp_matches_numpy(shape, zb, rng):
    cp = _cp()
    poison_pool()
    tess = Tessellation(shape, zero_boundary=zb)
    theta = draw_theta(tess, rng, n=2, largest=6.0)
    pts = rng.uniform(-0.05, 1.05, size=(2000, len(shape)))               # some clipped
    for p, t in [(pts, theta), (np.stack([pts, pts[::-1]]), theta), (pts, theta[0]),
                 (np.stack([pts, pts[::-1]]), theta[1]), (pts[None], theta)]:
        for S in (1, 3, 4, 16):
            out_np, pb_np = cutopo.vjp(integrate, p, t, tess, n_steps=20, checkpoint_every=S)
            cot = rng.standard_normal(out_np.shape)
            want = pb_np(cot)
            out_gpu, pb_gpu = cutopo.vjp(integrate, cp.asarray(p), cp.asarray(t), tess, n_steps=20,
                                         checkpoint_every=S)
            got = pb_gpu(cp.asarray(cot))
            assert got[2] is None and want[2] is None
            for g, w, name in zip(got[:2], want[:2], ("points", "theta")):
                assert isinstance(g, cp.ndarray) and g.shape == w.shape and g.dtype == w.dtype
                np.testing.assert_allclose(g.get(), w, rtol=1e-9, atol=1e-9 * np.abs(w).max(),
                                           err_msg=f"{name} S={S}")


@pytest.mark.parametrize("mode", ["sparse", "recompute", "device"])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("shape", [(4, 4), (2, 3, 2)])
def test_vjp_with_recomputed_checkpoints(monkeypatch, rng, shape, dtype, mode):
    """CHECKPOINTS = "recompute": no checkpoint array (the backward kernel reruns each
    trajectory into local memory), the same cotangents as NumPy; S raised where T / S would
    exceed the local checkpoints (T = 100, S = 1 -> 7), the device array kept past T = 272.
    "device": always the forward's checkpoint array, the same cotangents. "sparse" (the
    default): the forward's array with at most 3 copies (T = 20: S = 7, or the 16 asked for),
    recomputed at T = 100 (S = 34 would exceed 17), the device array past T = 272."""
    cp = _cp()
    monkeypatch.setattr(_integrate_cupy, "CHECKPOINTS", mode)
    tess = Tessellation(shape)
    theta = draw_theta(tess, rng, n=2, largest=6.0).astype(dtype)
    pts = rng.random((3000, len(shape))).astype(dtype)
    rtol = 1e-9 if dtype == np.float64 else 1e-3
    for n_steps, S, own, own_sparse, copies in ((20, 4, True, False, 3), (20, 16, True, False, 2),
                                                (100, 1, True, True, 0), (300, 4, False, False, 75)):
        out_np, pb_np = cutopo.vjp(integrate, pts, theta, tess, n_steps=n_steps, checkpoint_every=S)
        cot = rng.standard_normal(out_np.shape).astype(dtype)
        want = pb_np(cot)
        out, residuals = integrate.__cutopo_op__.forward(cp.asarray(pts), cp.asarray(theta), tess,
                                                          n_steps=n_steps, checkpoint_every=S)
        recomputed = own if mode == "recompute" else own_sparse if mode == "sparse" else False
        assert (residuals.checkpoints is None) == recomputed
        if mode == "sparse" and not recomputed:
            assert residuals.checkpoints.shape[0] == copies
        _, pb = cutopo.vjp(integrate, cp.asarray(pts), cp.asarray(theta), tess, n_steps=n_steps,
                           checkpoint_every=S)
        got = pb(cp.asarray(cot))
        for g, w, name in zip(got[:2], want[:2], ("points", "theta")):
            np.testing.assert_allclose(g.get(), w, rtol=rtol, atol=rtol * np.abs(w).max(),
                                       err_msg=f"{name} T={n_steps} S={S}")


def test_vjp_float32_matches_numpy(rng):
    cp = _cp()
    tess = Tessellation((4, 4))
    theta = draw_theta(tess, rng, n=2).astype(np.float32)
    pts = rng.random((5000, 2)).astype(np.float32)
    out_np, pb_np = cutopo.vjp(integrate, pts, theta, tess, n_steps=30)
    cot = rng.standard_normal(out_np.shape).astype(np.float32)
    want = pb_np(cot)
    _, pb = cutopo.vjp(integrate, cp.asarray(pts), cp.asarray(theta), tess, n_steps=30)
    got = pb(cp.asarray(cot))
    for g, w in zip(got[:2], want[:2]):
        assert g.dtype == np.float32
        np.testing.assert_allclose(g.get(), w, rtol=1e-3, atol=1e-4 * np.abs(w).max())


@pytest.fixture(params=list(_integrate_cupy.MOMENT_MODES))
def moments(request):
    """Each way of summing the backward's per-cell moments (_integrate_cupy.MOMENTS)."""
    old = _integrate_cupy.MOMENTS
    _integrate_cupy.MOMENTS = request.param
    yield request.param
    _integrate_cupy.MOMENTS = old


@pytest.mark.parametrize("shape", [(8, 8), (4, 4, 4)])
def test_vjp_pools_a_warp_in_one_cell(rng, moments, shape):
    """Every point of a warp in the same cell (the warp-pooled flush path; in the queue's
    drains, the lanes add each cell's few entries), and every point in a different cell (the
    scattered path; in 3D, leader lanes add the many cells' entries), with and without
    pooling."""
    cp = _cp()
    tess = Tessellation(shape)
    K = tess.ndim
    theta = draw_theta(tess, rng, largest=3.0)
    same = np.repeat(rng.random((40, K)), 32, axis=0) + rng.random((1280, K)) * 1e-4
    spread = rng.random((1280, K))
    for pts in (same, spread):
        out_np, pb_np = cutopo.vjp(integrate, pts, theta, tess, n_steps=25)
        cot = rng.standard_normal(out_np.shape)
        want = pb_np(cot)
        _, pb = cutopo.vjp(integrate, cp.asarray(pts), cp.asarray(theta), tess, n_steps=25)
        got = pb(cp.asarray(cot))
        np.testing.assert_allclose(got[1].get(), want[1], rtol=1e-9, atol=1e-9 * np.abs(want[1]).max())


@pytest.mark.parametrize("shape,batch", [((16, 16), 1), ((12, 20), 3), ((4, 4, 4), 1),
                                         ((3, 5, 4), 2)])
def test_vjp_many_cells(rng, moments, shape, batch):
    """Many cells (2D 1024 and 960, 3D 320 and 300), points scattered over all of them and, with
    a batch, per-item cells (offset indices): every mode of summing the moments equals the
    NumPy path."""
    cp = _cp()
    tess = Tessellation(shape)
    theta = draw_theta(tess, rng, n=batch, largest=3.0)
    pts = rng.random((batch, 2000, tess.ndim))
    out_np, pb_np = cutopo.vjp(integrate, pts, theta, tess, n_steps=20)
    cot = rng.standard_normal(out_np.shape)
    want = pb_np(cot)
    _, pb = cutopo.vjp(integrate, cp.asarray(pts), cp.asarray(theta), tess, n_steps=20)
    got = pb(cp.asarray(cot))
    np.testing.assert_allclose(got[1].get(), want[1], rtol=1e-9, atol=1e-9 * np.abs(want[1]).max())
    np.testing.assert_allclose(got[0].get(), want[0], rtol=1e-9, atol=1e-9 * np.abs(want[0]).max())


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("K", [1, 2, 3])
def test_backward_carveout_keeps_the_occupancy(K, dtype):
    """The backward asks for only the shared memory its resident blocks use (the rest is L1 for
    its local arrays): as many blocks per multiprocessor as with all of it, and at least one
    more than with none (so the occupancy query does see the carveout)."""
    cp = _cp()
    from cutopo._cuda import launch

    occupancy = cp.cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor
    sig = _integrate_cupy._backward_sig(np.dtype(dtype).name, K, True, _integrate_cupy.MOMENTS)
    kernel = launch._kernel(cp.cuda.Device().id, sig, ())
    blocks = {}
    for percent in (100, 0):
        kernel.preferred_shared_memory_carveout = percent
        blocks[percent] = occupancy(kernel.kernel.ptr, _integrate_cupy.THREADS, 0)
    launch._fit_shared_carveout.cache_clear()
    fitted = launch._fit_shared_carveout(cp.cuda.Device().id, sig, (), _integrate_cupy.THREADS, 0)
    assert 0 < fitted < 100 and kernel.preferred_shared_memory_carveout == fitted
    assert occupancy(kernel.kernel.ptr, _integrate_cupy.THREADS, 0) == blocks[100]
    assert blocks[0] < blocks[100]


def test_vjp_matches_central_differences_on_the_gpu(rng):
    cp = _cp()
    tess = Tessellation((3, 3))
    theta = cp.asarray(draw_theta(tess, rng, largest=3.0))
    pts = cp.asarray(rng.random((200, 2)) * 0.9 + 0.05)
    out, pb = cutopo.vjp(integrate, pts, theta, tess, n_steps=20)
    cot = cp.asarray(rng.standard_normal(out.shape))
    _, d_theta, _ = pb(cot)
    direction = cp.asarray(rng.standard_normal(theta.shape))
    # A trajectory that the perturbation moves across a face makes the difference quotient
    # jump, with a chance that grows with eps (at eps = 1e-6, 1 of 40 random cases failed in
    # every mode of the moments alike while all agreed with the NumPy path to 1e-14); float64
    # rounding adds only ~1e-6 relative error at eps = 1e-8.
    eps = 1e-8
    plus = integrate(pts, theta + eps * direction, tess, n_steps=20)
    minus = integrate(pts, theta - eps * direction, tess, n_steps=20)
    fd = float(((plus - minus) * cot).sum()) / (2 * eps)
    an = float((d_theta * direction).sum())
    assert abs(fd - an) <= 1e-4 * max(1.0, abs(an)), (fd, an)


def test_vjp_wrt_one_argument(rng):
    cp = _cp()
    tess = Tessellation((3, 2))
    theta = cp.asarray(draw_theta(tess, rng))
    pts = cp.asarray(rng.random((100, 2)))
    out, pb = cutopo.vjp(integrate, pts, theta, tess, wrt="theta")
    d_points, d_theta, _ = pb(cp.ones_like(out))
    assert d_points is None and d_theta.shape == theta.shape
    out, pb = cutopo.vjp(integrate, pts, theta, tess, wrt="points")
    d_points, d_theta, _ = pb(cp.ones_like(out))
    assert d_theta is None and d_points.shape == pts.shape


# ---------------------------------------------------------------------------------------------
# Errors


def test_errors(rng):
    cp = _cp()
    tess = Tessellation((2, 2))
    theta = draw_theta(tess, rng)
    pts = rng.random((5, 2))
    for fn in (integrate, log_jacobian, velocity):
        with pytest.raises(TypeError, match="points is a CuPy array but theta is not"):
            fn(cp.asarray(pts), theta, tess)
        with pytest.raises(TypeError, match="theta is a CuPy array but points is not"):
            fn(pts, cp.asarray(theta), tess)
        bad = pts.copy()
        bad[2, 1] = np.nan
        with pytest.raises(ValueError, match="points must be finite"):
            fn(cp.asarray(bad), cp.asarray(theta), tess)
        with pytest.raises(ValueError, match="theta must have shape"):
            fn(cp.asarray(pts), cp.asarray(theta[:-1]), tess)
    with pytest.raises(ValueError, match="checkpoint_every must be <= 17"):
        cutopo.vjp(integrate, cp.asarray(pts), cp.asarray(theta), tess, checkpoint_every=18)
    with pytest.raises(ValueError, match="n_steps=2 is too coarse"):
        integrate(cp.asarray(pts), cp.asarray(theta * 100), tess, n_steps=2)
    with pytest.raises(TypeError, match="float16"):
        cell_index(cp.asarray(pts, dtype=np.float16), (2, 2))


def test_batch_beyond_the_kernels_cell_numbers(rng, monkeypatch):
    """A theta batch with more cells in all than the backward's queue numbers (32-bit keys;
    lowered here to two items' worth) is refused, naming theta, before any launch; one item
    fewer runs."""
    cp = _cp()
    tess = Tessellation((2, 3))
    monkeypatch.setattr(_integrate_cupy, "MAX_CELL_ROWS", 2 * tess.n_cells)
    pts = cp.asarray(rng.random((7, 2)))
    theta = draw_theta(tess, rng, n=3)
    for fn in (integrate, log_jacobian):
        with pytest.raises(ValueError, match="theta's batch of 3 items on 24 cells"):
            fn(pts, cp.asarray(theta), tess)
    out = integrate(pts, cp.asarray(theta[:2]), tess)
    np.testing.assert_allclose(out.get(), integrate(pts.get(), theta[:2], tess), rtol=1e-12, atol=1e-12)


def test_affine_maps_keep_float32_denormals(rng):
    """A = B theta reads float32 theta through convert<double, float> (common.cuh): denormal
    entries must reach A exactly, although CuPy compiles with -ftz=true (a plain cast would
    flush them to 0)."""
    cp = _cp()
    tess = Tessellation((3, 2))
    tiny = np.finfo(np.float32).smallest_subnormal
    k = rng.integers(1, 1 << 22, size=(2, tess.n_params)) * rng.choice([-1, 1], size=(2, tess.n_params))
    theta = (k * np.float64(tiny)).astype(np.float32)                  # exact: k < 2^23
    assert np.all(theta != 0) and np.all(np.abs(theta) < np.finfo(np.float32).tiny)
    got = _integrate_cupy.affine_maps(tess, cp.asarray(theta)).get()
    want = tess.affine_maps(theta.astype(np.float64)).reshape(got.shape)
    assert np.abs(want).max() > 0
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-12 * np.abs(want).max())


@pytest.mark.parametrize("K", [1, 2, 3])
@pytest.mark.parametrize("theta_dtype", [np.float16, np.float32, np.float64, np.int32])
def test_prepare_cells_against_numpy(rng, K, theta_dtype):
    """A call's set-up kernel against NumPy: A = B theta (as tess.affine_maps), which of points
    and theta hold a non-finite value (one planted at a random place, or none), max_c
    ||A_c,lin||_F, and the caller's own flags passed through."""
    cp = _cp()
    for case in range(6):
        bad_points, bad_theta = case & 1, (case >> 1) & 1
        dtype = np.dtype(np.float32 if case < 4 else np.float64)
        tess = Tessellation(tuple(int(n) for n in rng.integers(1, 6, size=K)),
                            zero_boundary=[None, "noslip", "slip"][case % 3])
        points = rng.random((int(rng.integers(1, 4)), int(rng.integers(1, 3000)), K)).astype(dtype)
        theta = (rng.standard_normal((int(rng.integers(1, 4)), tess.n_params)) * 50).astype(theta_dtype)
        if bad_points:
            points.reshape(-1)[rng.integers(points.size)] = rng.choice([np.nan, np.inf, -np.inf])
        expect_theta_bad = bad_theta and theta.dtype.kind == "f" and theta.size > 0
        if expect_theta_bad:
            theta.reshape(-1)[rng.integers(theta.size)] = rng.choice([np.nan, np.inf, -np.inf])
        poison_pool()
        A, E, flags = _integrate_cupy._prepare(cp.asarray(points), cp.asarray(theta), tess, 0.02,
                                               dtype, (cp.ones(1), cp.zeros(1)))
        values = flags.read()
        flag_bits, largest, extra = int(values[0]), float(values[1:2].view(np.float64)[0]), values[2:]
        assert flag_bits == (1 if bad_points else 0) | (2 if expect_theta_bad else 0)
        assert list(extra) == [1, 0]
        assert A.shape == (len(theta) * tess.n_cells, K, K + 1) and E.dtype == dtype
        if expect_theta_bad:
            continue
        want = np.asarray(tess.affine_maps(theta.astype(np.float64))).reshape(A.shape)
        np.testing.assert_allclose(A.get(), want, rtol=1e-13, atol=1e-13 * np.abs(want).max())
        norm = np.sqrt((want[:, :, :K] ** 2).sum(axis=(1, 2))).max(initial=0.0)
        assert largest == pytest.approx(norm, rel=1e-12, abs=0.0)
        assert bool(cp.isfinite(E).all())


@pytest.mark.parametrize("shape", [(1,), (2, 1, 1)])
def test_no_free_parameters_is_the_identity(shape, rng):
    """A no-slip tessellation without interior vertices has no parameters (theta (0,)): the
    field is zero, every point stays put, and the kernels read no theta entry."""
    cp = _cp()
    tess = Tessellation(shape)
    assert tess.n_params == 0
    pts = rng.random((500, len(shape)))
    theta = cp.zeros((2, 0))
    np.testing.assert_array_equal(integrate(cp.asarray(pts), theta, tess).get(),
                                  np.broadcast_to(pts, (2,) + pts.shape))
    out, pullback = cutopo.vjp(integrate, cp.asarray(pts), theta, tess)
    grad_points, grad_theta, _ = pullback(cp.ones_like(out))
    np.testing.assert_array_equal(grad_points.get(), np.full(pts.shape, 2.0))
    assert grad_theta.shape == (2, 0)


def test_theta_not_finite_is_refused(rng):
    cp = _cp()
    tess = Tessellation((3, 2))
    theta = draw_theta(tess, rng)
    theta[int(rng.integers(theta.size))] = np.inf
    pts = cp.asarray(rng.random((9, 2)))
    for fn in (integrate, log_jacobian):
        with pytest.raises(ValueError, match="theta must be finite"):
            fn(pts, cp.asarray(theta), tess)
        with pytest.raises(ValueError, match="theta must be finite"):
            fn(pts.astype(cp.float32), cp.asarray(theta, dtype=cp.float16), tess)


def test_checks_read_after_the_kernels(monkeypatch, rng):
    """The device checks of a call are read once its kernels are queued (checked_plan): the
    forward kernel is launched before the flags are read, a failed check still raises at the
    call, also for values whose kernels ran on them (NaN, inf, a theta whose A overflows), and
    later calls are unaffected."""
    from cutopo.cpab import _warp_cupy, transform_image

    cp = _cp()
    events = []
    real_read = _integrate_cupy._CellFlags.read

    def read(self):
        events.append("read")
        return real_read(self)

    def logged(launch):
        def wrapper(sig, *args, **kwargs):
            events.append(sig.name.split("<")[0].rsplit("::", 1)[-1])
            return launch(sig, *args, **kwargs)
        return wrapper

    monkeypatch.setattr(_integrate_cupy._CellFlags, "read", read)
    monkeypatch.setattr(_integrate_cupy, "launch", logged(_integrate_cupy.launch))
    monkeypatch.setattr(_warp_cupy, "launch", logged(_warp_cupy.launch))
    kept_call = KeptLaunches.__call__                    # a repeated call's launches
    monkeypatch.setattr(KeptLaunches, "__call__",
                        lambda self, sig, *args: logged(functools.partial(kept_call, self))(sig, *args))
    tess = Tessellation((3, 2))
    theta = draw_theta(tess, rng, largest=3.0)
    pts = rng.random((40, 2))
    image = rng.random((1, 2, 9, 7))
    cases = [
        ("integrate", lambda p, t: integrate(p, t, tess), "integrate_forward"),
        ("log_jacobian", lambda p, t: log_jacobian(p, t, tess), "integrate_forward"),
        ("vjp", lambda p, t: cutopo.vjp(integrate, p, t, tess)[0], "integrate_forward"),
        ("transform_image", lambda p, t: transform_image(cp.asarray(image), t, tess),
         "warp_forward"),
    ]
    for name, fn, kernel in cases:
        events.clear()
        got = fn(cp.asarray(pts), cp.asarray(theta))
        order = [e for e in events if e in ("prepare_cells", kernel, "read")]
        assert order == ["prepare_cells", kernel, "read"], (name, events)
        want = fn(pts, theta) if name != "transform_image" else transform_image(image, theta, tess)
        np.testing.assert_allclose(got.get(), want, rtol=1e-10, atol=1e-12)
        for bad_theta, message in ((np.where(np.arange(theta.size) == 3, np.nan, theta),
                                    "theta must be finite"),
                                   (theta * 1e300, "theta is too large"),  # the norm overflows
                                   (theta * 1e150, "too coarse")):     # ~500 expm squarings
            events.clear()
            with pytest.raises(ValueError, match=message):
                fn(cp.asarray(pts), cp.asarray(bad_theta))
            assert kernel in events and events[-1] == "read", (name, events)
        if name != "transform_image":
            bad = pts.copy()
            bad[int(rng.integers(len(bad))), 1] = rng.choice([np.nan, np.inf, -np.inf])
            with pytest.raises(ValueError, match="points must be finite"):
                fn(cp.asarray(bad), cp.asarray(theta))
    bad = image.copy()
    bad[0, 1, 4, 2] = np.inf
    with pytest.raises(ValueError, match="image must be finite"):
        transform_image(cp.asarray(bad), cp.asarray(theta), tess)
    again = integrate(cp.asarray(pts), cp.asarray(theta), tess)
    np.testing.assert_allclose(again.get(), integrate(pts, theta, tess), rtol=1e-10, atol=1e-12)


def test_prepare_status_is_zero_between_calls(rng):
    """prepare_cells' device counters (a PinnedStatus per thread and device) are zeroed by the
    last block of every launch: calls after a failed check, on another stream, after a launch
    whose flags were never read (an interrupted call) and with one block or thousands get their
    own flags and norm."""
    cp = _cp()
    tess = Tessellation((4, 3))
    theta = draw_theta(tess, rng, largest=2.0)
    status = _integrate_cupy._cell_status()
    assert _integrate_cupy._cell_status() is status

    def flags_of(points, th, stream=None):
        with stream or cp.cuda.Stream.null:
            _, _, flags = _integrate_cupy._prepare(cp.asarray(points)[None], cp.asarray(th)[None],
                                                   tess, 0.02, np.dtype(np.float64), ())
            values = flags.read()
        assert not status.counters.get().any()
        return int(values[0]), float(values[1:2].view(np.float64)[0])

    want = np.sqrt((tess.affine_maps(theta)[:, :, :2] ** 2).sum(axis=(1, 2))).max()
    bad_theta = theta.copy()
    bad_theta[int(rng.integers(theta.size))] = np.nan
    for n in (3, 4000, 300000):                               # 1 check block to CHECK_BLOCKS
        pts = rng.random((n, 2))
        bad_pts = pts.copy()
        bad_pts[int(rng.integers(n)), 0] = np.inf
        assert flags_of(bad_pts, theta) == (1, pytest.approx(want, rel=1e-12))
        assert flags_of(pts, bad_theta)[0] == 2
        assert flags_of(pts, theta) == (0, pytest.approx(want, rel=1e-12))
        assert flags_of(pts, theta * 0.5, cp.cuda.Stream(non_blocking=True)) == \
            (0, pytest.approx(want * 0.5, rel=1e-12))
    # an interrupted call: launched, its flags never read; the next arm waits for it
    busy(cp, cp.cuda.get_current_stream(), ms=20.0)
    _integrate_cupy._prepare(cp.asarray(bad_pts)[None], cp.asarray(theta)[None], tess, 0.02,
                             np.dtype(np.float64), ())
    assert flags_of(pts, theta, cp.cuda.Stream(non_blocking=True)) == \
        (0, pytest.approx(want, rel=1e-12))


@pytest.mark.parametrize("K", [1, 2, 3])
def test_frechet_cells_equals_scipy(rng, K):
    """frechet_cells (Taylor series of the block exponential, scaling and squaring) against
    scipy.linalg.expm_frechet, an independent implementation: dL/dA_c = h L(h A~_c^T, [G_c;
    0])[:K], over norms from 1e-3 to ~10 (up to five squarings), G over ten decades, zero G;
    and in place (dA over G, as theta_cotangent runs it), bit for bit the same."""
    from scipy.linalg import expm_frechet

    from cutopo._cuda.launch import launch

    cp = _cp()
    cells, h = 300, 1.0 / 7
    A = rng.standard_normal((cells, K, K + 1))
    A *= (10 ** rng.uniform(-3, 2.4, cells) / np.abs(A).sum(axis=(1, 2)))[:, None, None]
    G = rng.standard_normal((cells, K, K + 1)) * 10 ** rng.uniform(-5, 5, (cells, 1, 1))
    G[::17] = 0
    d_A, d_G = cp.asarray(A.reshape(cells, -1)), cp.asarray(G.reshape(cells, -1))
    out = cp.full(d_A.shape, np.nan)
    launch(_integrate_cupy._frechet_sig(K), -(-cells // 64), 64, (d_A, d_G, out, cells, h))
    got = out.get().reshape(cells, K, K + 1)
    launch(_integrate_cupy._frechet_sig(K), -(-cells // 64), 64, (d_A, d_G, d_G, cells, h))
    np.testing.assert_array_equal(d_G.get(), out.get())
    for c in range(cells):
        Y = np.zeros((K + 1, K + 1))
        Y[:, :K] = (h * A[c]).T                               # (h A~)^T: zero last column
        Z = np.zeros((K + 1, K + 1))
        Z[:K] = G[c]
        want = h * expm_frechet(Y, Z, compute_expm=False)[:K]
        np.testing.assert_allclose(got[c], want, rtol=0, atol=1e-12 * np.abs(want).max() + 1e-300,
                                   err_msg=f"cell {c}, ||h A||_1 {np.abs(Y).sum(0).max():.3g}")


def test_repeated_calls_keep_their_checks_and_launches(rng, monkeypatch):
    """A repeated CuPy call (same shapes, dtypes, n_steps, op and tessellation) skips the
    argument checks and launches through the kept launches of its kind: fresh values on every
    call still give the NumPy path's results and VJPs, bad values still raise, tessellations
    never share an entry (even under one id: the entry holds its tessellation weakly), and a
    strided argument takes the checked path."""
    import sys

    cp = _cp()
    module = sys.modules["cutopo.cpab.integrate"]
    monkeypatch.setattr(module, "_DEVICE_CALLS", type(module._DEVICE_CALLS)())
    monkeypatch.setattr(module, "id", lambda obj: 0, raising=False)   # every tessellation one id
    tessellations = [Tessellation((4, 3)), Tessellation((3, 4)), Tessellation((4, 3), zero_boundary=None)]
    assert len({t.n_params for t in tessellations[:2]}) == 1

    def close(got, want, steps_near_faces=False):
        """float64 maps to rounding; float32 maps and every log-Jacobian (piecewise constant)
        up to the few points that took another cell's step near a face (as in
        test_integrate_and_log_jacobian_match_numpy)"""
        if want.dtype == np.float64 and not steps_near_faces:
            np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-12)
        else:
            assert np.mean(np.abs(got - want) > 10 * RTOL[want.dtype]) < 0.02

    def check(tess, dtype, batch):
        theta = draw_theta(tess, rng, n=batch, largest=3.0).astype(dtype)
        pts = rng.uniform(-0.05, 1.05, size=(300, 2)).astype(dtype)
        out_np, pb_np = cutopo.vjp(integrate, pts, theta, tess, n_steps=12)
        cot = rng.standard_normal(out_np.shape).astype(dtype)
        want = pb_np(cot)
        out, pb = cutopo.vjp(integrate, cp.asarray(pts), cp.asarray(theta), tess, n_steps=12)
        got = pb(cp.asarray(cot))
        close(out.get(), out_np)
        rtol, atol = (1e-9, 1e-9) if dtype == np.float64 else (1e-3, 1e-4)
        for g, w in zip(got[:2], want[:2]):
            assert g.dtype == dtype
            np.testing.assert_allclose(g.get(), w, rtol=rtol, atol=atol * np.abs(w).max())
        plain = integrate(cp.asarray(pts), cp.asarray(theta), tess, n_steps=12)
        np.testing.assert_array_equal(plain.get(), out.get())       # the same kernel and input
        lj = log_jacobian(cp.asarray(pts), cp.asarray(theta), tess, n_steps=12)
        close(lj.get(), log_jacobian(pts, theta, tess, n_steps=12), steps_near_faces=True)

    for rep in range(3):
        for tess in tessellations:
            for dtype in (np.float64, np.float32):
                check(tess, dtype, batch=2)
    entries = list(module._DEVICE_CALLS.values())
    # (integrate, log_jacobian) x (float64, float32) x (36 parameters: the first two, which
    # take turns in one entry; 64: the free boundary)
    assert len(entries) == 2 * 2 * 2
    assert all(entry.launches._table for entry in entries)
    # bad values on a repeated call still raise, and the next call is right
    tess = tessellations[0]
    theta = draw_theta(tess, rng, n=2, largest=3.0)
    pts = rng.random((300, 2))
    for bad, message in ((np.where(np.arange(theta.size).reshape(theta.shape) == 5, np.nan, theta),
                          "theta must be finite"), (theta * 1e150, "too coarse")):
        with pytest.raises(ValueError, match=message):
            cutopo.vjp(integrate, cp.asarray(pts), cp.asarray(bad), tess, n_steps=12)
    bad_pts = pts.copy()
    bad_pts[7, 1] = np.inf
    with pytest.raises(ValueError, match="points must be finite"):
        integrate(cp.asarray(bad_pts), cp.asarray(theta), tess, n_steps=12)
    check(tess, np.float64, batch=2)
    # strided points: no key, the checked launches
    wide = cp.asarray(rng.random((300, 4)))
    got = integrate(wide[:, ::2], cp.asarray(theta), tess, n_steps=12)
    np.testing.assert_allclose(got.get(), integrate(wide[:, ::2].get(), theta, tess, n_steps=12),
                               rtol=1e-10, atol=1e-12)
    # a pullback on a side stream
    out, pb = cutopo.vjp(integrate, cp.asarray(pts), cp.asarray(theta), tess, n_steps=12)
    cot = rng.standard_normal(out.shape)
    with cp.cuda.Stream(non_blocking=True) as side:
        got = pb(cp.asarray(cot))
        side.synchronize()
    want = cutopo.vjp(integrate, pts, theta, tess, n_steps=12)[1](cot)
    for g, w in zip(got[:2], want[:2]):
        np.testing.assert_allclose(g.get(), w, rtol=1e-9, atol=1e-9 * np.abs(w).max())
