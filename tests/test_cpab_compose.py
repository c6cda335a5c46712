"""CPU tests of cutopo.cpab.compose, compose_grid and compose_image (cascades of CPAB maps).

Oracles: the stages written out with integrate / transform_grid / transform_image, the inverse
flow (phi_{-theta} o phi_theta = id up to the scheme's error), and central finite differences
of the forward in float64. Random inputs are fresh per run; the finite differences use eps =
1e-7, far below the distance at which a perturbed trajectory would change cell.
"""
from __future__ import annotations

import numpy as np
import pytest

import cutopo
from adapter_cases import run_docstring_examples
from cutopo.cpab import (Tessellation, compose, compose_grid, compose_image, integrate,
                         transform_grid, transform_image)
from test_cpab_integrate import central_differences, rel_err

T = 8


def _inputs(rng, shape, m, batch=None, n=6):
    tess = Tessellation(shape)
    thetas = tess.sample(m * (batch or 1), length_scale=0.4, scale=0.15, rng=rng)
    thetas = thetas.reshape((m, batch, tess.n_params) if batch else (m, tess.n_params))
    points = rng.uniform(0.1, 0.9, size=(n, tess.ndim))
    return tess, thetas, points


@pytest.mark.parametrize("shape", [(4,), (2, 3), (2, 1, 2)])
def test_equals_the_stages(shape, rng):
    tess, thetas, points = _inputs(rng, shape, 3)
    x = points
    for theta in thetas:
        x = integrate(x, theta, tess, n_steps=T)
    np.testing.assert_array_equal(compose(points, thetas, tess, n_steps=T), x)
    out, _ = cutopo.vjp(compose, points, thetas, tess, n_steps=T)
    np.testing.assert_array_equal(out, x)


def test_inverse_cascade_is_the_identity(rng):
    """phi_{-theta} o phi_theta = id up to the scheme's O(h^2) error: it shrinks ~4x per
    doubling of n_steps."""
    tess, thetas, points = _inputs(rng, (3, 3), 1, n=50)
    pair = np.concatenate([thetas, -thetas])
    errors = [np.abs(compose(points, pair, tess, n_steps=n) - points).max() for n in (25, 100)]
    assert errors[1] < 2e-4
    assert errors[1] < errors[0] / 2
    tess3 = Tessellation((2, 2, 2))
    theta3 = tess3.sample(1, length_scale=0.4, scale=0.15, rng=rng)
    p3 = rng.uniform(0.05, 0.95, size=(40, 3))
    back = compose(p3, np.concatenate([theta3, -theta3]), tess3, n_steps=100)
    assert np.abs(back - p3).max() < 2e-4


@pytest.mark.parametrize("shape,batch", [((4,), None), ((2, 2), 2), ((1, 2, 1), None)])
def test_vjp_matches_central_differences(shape, batch, rng):
    tess, thetas, points = _inputs(rng, shape, 2, batch=batch, n=5)
    out, pullback = cutopo.vjp(compose, points, thetas, tess, n_steps=T)
    w = rng.normal(size=out.shape)
    d_points, d_thetas, d_tess = pullback(w)
    assert d_tess is None and d_points.shape == points.shape and d_thetas.shape == thetas.shape
    f_thetas = lambda th: float((compose(points, th, tess, n_steps=T) * w).sum())  # noqa: E731
    f_points = lambda p: float((compose(p, thetas, tess, n_steps=T) * w).sum())  # noqa: E731
    assert rel_err(d_thetas, central_differences(f_thetas, thetas, 1e-7)) < 1e-6
    assert rel_err(d_points, central_differences(f_points, points, 1e-7)) < 1e-6
    # asking for fewer cotangents gives the same ones
    only = cutopo.vjp(compose, points, thetas, tess, wrt="thetas", n_steps=T)[1](w)
    assert only[0] is None
    np.testing.assert_array_equal(only[1], d_thetas)


def test_batched_points_and_shapes(rng):
    tess, thetas, _ = _inputs(rng, (2, 2), 2, batch=3)
    points = rng.uniform(0.1, 0.9, size=(3, 4, 2))
    out = compose(points, thetas, tess, n_steps=T)
    assert out.shape == (3, 4, 2)
    spec = compose.__cutopo_op__
    for p, th in ((points, thetas), (points[0], thetas), (points, thetas[:, 0]),
                  (points[0], thetas[:, 0])):
        got = compose(p, th, tess, n_steps=T)
        assert spec.meta(p, th, tess, n_steps=T) == (got.shape, got.dtype)
    f32 = compose(points.astype(np.float32), thetas.astype(np.float32), tess, n_steps=T)
    assert f32.dtype == np.float32


def test_grid_and_image_forms(rng):
    tess = Tessellation((2, 2))
    thetas = tess.sample(2, length_scale=0.4, scale=0.15, rng=rng)
    phi = compose_grid(thetas, tess, (5, 4), n_steps=T)
    centres = transform_grid(np.zeros(tess.n_params), tess, (5, 4)).reshape(-1, 2)
    np.testing.assert_array_equal(phi.reshape(-1, 2), compose(centres, thetas, tess, n_steps=T))
    np.testing.assert_array_equal(compose_grid(thetas[:1], tess, (5, 4), n_steps=T),
                                  transform_grid(thetas[0], tess, (5, 4), n_steps=T))
    image = rng.random((1, 2, 6, 5))
    np.testing.assert_array_equal(compose_image(image, thetas[:1], tess, n_steps=T),
                                  transform_image(image, thetas[0], tess, n_steps=T))
    batched = tess.sample(4, length_scale=0.4, scale=0.15, rng=rng).reshape(2, 2, -1)
    assert compose_image(image, batched, tess, n_steps=T).shape == (2, 2, 6, 5)
    assert compose_grid(batched, tess, (3, 4), n_steps=T).shape == (2, 3, 4, 2)
    spec = compose_image.__cutopo_op__
    out = compose_image(image, batched, tess, n_steps=T)
    assert spec.meta(image, batched, tess) == (out.shape, out.dtype)
    spec = compose_grid.__cutopo_op__
    assert spec.meta(batched, tess, (3, 4)) == ((2, 3, 4, 2), np.dtype(np.float64))


def test_image_vjp_matches_central_differences(rng):
    tess = Tessellation((2, 2))
    thetas = tess.sample(2, length_scale=0.4, scale=0.15, rng=rng)
    image = rng.random((1, 1, 7, 6))
    out, pullback = cutopo.vjp(compose_image, image, thetas, tess, n_steps=T)
    w = rng.normal(size=out.shape)
    d_image, d_thetas, _ = pullback(w)
    f = lambda th: float((compose_image(image, th, tess, n_steps=T) * w).sum())  # noqa: E731
    assert rel_err(d_thetas, central_differences(f, thetas, 1e-7)) < 1e-5
    g = lambda im: float((compose_image(im, thetas, tess, n_steps=T) * w).sum())  # noqa: E731
    assert rel_err(d_image, central_differences(g, image, 1e-6)) < 1e-8
    grid_out, grid_pullback = cutopo.vjp(compose_grid, thetas, tess, (4, 5), n_steps=T)
    wg = rng.normal(size=grid_out.shape)
    h = lambda th: float((compose_grid(th, tess, (4, 5), n_steps=T) * wg).sum())  # noqa: E731
    assert rel_err(grid_pullback(wg)[0], central_differences(h, thetas, 1e-7)) < 1e-6


def test_errors(rng):
    tess = Tessellation((2, 2))
    theta = np.zeros(tess.n_params)
    points = rng.random((3, 2))
    with pytest.raises(TypeError, match="thetas must be one array.*stack"):
        compose(points, [theta, theta], tess)
    with pytest.raises(ValueError, match=r"thetas must have shape \(m, 10\)"):
        compose(points, theta, tess)
    with pytest.raises(ValueError, match="thetas must have shape"):
        compose(points, np.zeros((0, tess.n_params)), tess)
    with pytest.raises(ValueError, match="thetas must have shape"):
        compose(points, np.zeros((2, tess.n_params + 1)), tess)
    with pytest.raises(TypeError, match="Tessellation"):
        compose(points, theta[None], (2, 2))
    with pytest.raises(ValueError, match="points must have shape"):
        compose(rng.random((3, 3)), theta[None], tess)
    with pytest.raises(ValueError, match="theta must be finite"):
        compose(points, np.full((1, tess.n_params), np.nan), tess)
    with pytest.raises(ValueError, match="batch sizes"):
        compose(rng.random((2, 3, 2)), np.zeros((1, 3, tess.n_params)), tess)
    with pytest.raises(ValueError, match="checkpoint_every must be >= 1"):
        compose(points, theta[None], tess, checkpoint_every=0)
    with pytest.raises(ValueError, match="image must have shape"):
        compose_image(rng.random((6, 5)), theta[None], tess)
    with pytest.raises(ValueError, match="shape .* has 3 axes"):
        compose_grid(theta[None], tess, (3, 4, 5))


def test_registry_adapter_and_docstrings(rng):
    from cutopo.vjp import REGISTRY

    assert REGISTRY["cpab_compose"].arg_names == ("points", "thetas", "tess")
    assert REGISTRY["cpab_compose"].differentiable == {"points", "thetas"}
    assert REGISTRY["cpab_compose_image"].differentiable == {"image", "thetas"}
    assert REGISTRY["cpab_compose_grid"].differentiable == {"thetas"}
    for fn in (compose, compose_grid, compose_image):
        assert getattr(cutopo.cpab, fn.__name__) is fn
        run_docstring_examples(fn)
    torch = pytest.importorskip("torch")
    import cutopo.torch as ct

    tess, thetas, points = _inputs(rng, (2, 2), 2)
    t_thetas = torch.tensor(thetas, requires_grad=True)
    out = ct.cpab.compose(torch.tensor(points), t_thetas, tess, n_steps=T)
    ref, pullback = cutopo.vjp(compose, points, thetas, tess, n_steps=T)
    np.testing.assert_array_equal(out.detach().numpy(), ref)
    w = rng.normal(size=ref.shape)
    out.backward(torch.tensor(w))
    np.testing.assert_allclose(t_thetas.grad.numpy(), pullback(w)[1], rtol=1e-12, atol=1e-14)


def test_compose_grid_under_jax_jit_and_grad(rng):
    """compose_grid's shape is a static argument of the JAX adapter (it sets the output shape)."""
    jax = pytest.importorskip("jax")
    import cutopo.jax as cj

    tess, thetas, _ = _inputs(rng, (2, 2), 2)
    shape = (5, 6)
    previous = jax.config.jax_enable_x64            # a global flag: restored afterwards
    jax.config.update("jax_enable_x64", True)
    try:
        f = jax.jit(lambda t: (cj.cpab.compose_grid(t, tess, shape, n_steps=T) ** 2).sum())
        value, grad = jax.value_and_grad(f)(jax.numpy.asarray(thetas))
        ref, pullback = cutopo.vjp(compose_grid, thetas, tess, shape, n_steps=T)
        np.testing.assert_allclose(float(value), (ref ** 2).sum(), rtol=1e-12)
        np.testing.assert_allclose(np.asarray(grad), pullback(2 * ref)[0], rtol=1e-10, atol=1e-13)
    finally:
        jax.config.update("jax_enable_x64", previous)


@pytest.mark.gpu
def test_cupy_matches_numpy(rng):
    """CuPy points, thetas and images run integrate's and grid_sample's kernels stage by stage:
    the NumPy results up to the rounding of the step matrices and the atomics' order."""
    import cupy as cp

    tess, thetas, points = _inputs(rng, (2, 2), 2, batch=2)
    out, pullback = cutopo.vjp(compose, points, thetas, tess, n_steps=T)
    w = rng.normal(size=out.shape)
    d_points, d_thetas, _ = pullback(w)
    g_out, g_pullback = cutopo.vjp(compose, cp.asarray(points), cp.asarray(thetas), tess, n_steps=T)
    g_points, g_thetas, _ = g_pullback(cp.asarray(w))
    assert isinstance(g_out, cp.ndarray) and isinstance(g_thetas, cp.ndarray)
    np.testing.assert_allclose(g_out.get(), out, rtol=0, atol=1e-12)
    np.testing.assert_allclose(g_points.get(), d_points, rtol=0, atol=1e-9 * np.abs(d_points).max())
    np.testing.assert_allclose(g_thetas.get(), d_thetas, rtol=0, atol=1e-9 * np.abs(d_thetas).max())
    image = rng.random((2, 1, 7, 6))
    ref = compose_image(image, thetas, tess, n_steps=T)
    got = compose_image(cp.asarray(image), cp.asarray(thetas), tess, n_steps=T)
    np.testing.assert_allclose(got.get(), ref, rtol=0, atol=1e-9)
