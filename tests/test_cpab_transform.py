"""CPU tests of cutopo.cpab.transform_grid and transform_image, and of their VJPs.

Oracles: closed forms (theta = 0 is the identity, a constant velocity field a translation by
whole pixels), the direct composition integrate + grid_sample written out here, and central
finite differences of the forward in float64. The finite-difference checks use a fixed seed:
the maps have kinks (pixel boundaries, cell faces) that a random draw could straddle.
"""
from __future__ import annotations

import numpy as np
import pytest

import cutopo
from adapter_cases import run_docstring_examples
from cutopo.cpab import Tessellation, integrate, transform_grid, transform_image
from test_cpab_integrate import central_differences, rel_err


def centres(shape):
    """Pixel centres of a grid in the unit box, (prod(shape), K), C order."""
    axes = [(np.arange(n) + 0.5) / n for n in shape]
    return np.stack([m.ravel() for m in np.meshgrid(*axes, indexing="ij")], axis=-1)


def direct_warp(image, theta, tess, n_steps, **kwargs):
    """integrate at the pixel centres, then grid_sample (x first, align_corners=False)."""
    spatial = image.shape[2:]
    theta2 = np.atleast_2d(theta)
    phi = integrate(centres(spatial), theta2, tess, n_steps=n_steps)        # (Bt, P, K)
    grid = (2 * phi[..., ::-1] - 1).reshape((len(theta2),) + spatial + (len(spatial),))
    B = max(len(image), len(theta2))
    grid = np.broadcast_to(grid, (B,) + grid.shape[1:])
    image = np.broadcast_to(image, (B,) + image.shape[1:])
    return cutopo.grid_sample(image, grid, align_corners=False, **kwargs)


def constant_field(tess, c):
    """theta of the constant velocity field c (zero_boundary=None): phi(x) = x + c exactly."""
    return np.asarray(c, dtype=np.float64)[tess.dof_axis]


# ---------------------------------------------------------------------------------------------
# Forward


@pytest.mark.parametrize("spatial,tess_shape", [((12, 10), (2, 2)), ((4, 5, 6), (1, 2, 1))])
def test_zero_theta_is_the_identity(spatial, tess_shape, rng):
    tess = Tessellation(tess_shape)
    image = rng.random((2, 3) + spatial)
    out = transform_image(image, np.zeros(tess.n_params), tess, n_steps=5)
    assert out.shape == image.shape and out.dtype == np.float64
    np.testing.assert_allclose(out, image, rtol=0, atol=1e-12)
    phi = transform_grid(np.zeros(tess.n_params), tess, spatial, n_steps=5)
    assert phi.shape == spatial + (len(spatial),)
    np.testing.assert_array_equal(phi.reshape(-1, len(spatial)), centres(spatial))


def test_transform_grid_is_integrate_at_the_pixel_centres(rng):
    tess = Tessellation((2, 3), zero_boundary="slip")
    theta = tess.sample(3, length_scale=0.3, rng=rng)
    phi = transform_grid(theta, tess, (7, 5), n_steps=20)
    assert phi.shape == (3, 7, 5, 2)
    np.testing.assert_array_equal(phi.reshape(3, 35, 2),
                                  integrate(centres((7, 5)), theta, tess, n_steps=20))
    assert transform_grid(theta[0], tess, [7, 5], n_steps=20).shape == (7, 5, 2)
    tess1 = Tessellation((4,))
    assert transform_grid(np.zeros(tess1.n_params), tess1, (6,)).shape == (6, 1)


def test_translation_by_whole_pixels(rng):
    """A constant field (1/H, -2/W) moves every pixel centre by one row and minus two columns:
    out[i, j] = image[i + 1, j - 2], border pixels where that leaves the image."""
    H, W = 12, 10
    tess = Tessellation((2, 2), zero_boundary=None)
    theta = constant_field(tess, (1 / H, -2 / W))
    image = rng.random((1, 2, H, W))
    out = transform_image(image, theta, tess, n_steps=4)
    rows = np.minimum(np.arange(H) + 1, H - 1)
    cols = np.maximum(np.arange(W) - 2, 0)
    np.testing.assert_allclose(out, image[:, :, rows][:, :, :, cols], rtol=0, atol=1e-12)
    zeros = transform_image(image, theta, tess, n_steps=4, padding_mode="zeros")
    np.testing.assert_allclose(zeros[:, :, :-1, 2:], image[:, :, 1:, :-2], rtol=0, atol=1e-12)
    assert np.abs(zeros[:, :, -1]).max() < 1e-12 and np.abs(zeros[:, :, :, :2]).max() < 1e-12


@pytest.mark.parametrize("zb", ["noslip", "slip", None])
@pytest.mark.parametrize("mode,padding", [("bilinear", "border"), ("nearest", "zeros"),
                                          ("bilinear", "reflection")])
def test_matches_integrate_then_grid_sample(zb, mode, padding, rng):
    tess = Tessellation((2, 3), zero_boundary=zb)
    theta = tess.sample(2, length_scale=0.3, rng=rng)
    image = rng.random((2, 3, 9, 11))
    out = transform_image(image, theta, tess, n_steps=15, mode=mode, padding_mode=padding)
    ref = direct_warp(image, theta, tess, 15, mode=mode, padding_mode=padding)
    np.testing.assert_array_equal(out, ref)


def test_3d_matches_integrate_then_grid_sample(rng):
    tess = Tessellation((2, 1, 2))
    theta = tess.sample(1, length_scale=0.4, rng=rng)[0]
    image = rng.random((1, 2, 4, 5, 6))
    np.testing.assert_array_equal(transform_image(image, theta, tess, n_steps=10),
                                  direct_warp(image, theta, tess, 10, padding_mode="border"))


def test_batch_broadcasting(rng):
    tess = Tessellation((2, 2))
    theta = tess.sample(3, length_scale=0.3, rng=rng)
    images = rng.random((3, 2, 6, 7))
    out = transform_image(images, theta, tess, n_steps=10)
    for b in range(3):
        np.testing.assert_array_equal(out[b:b + 1], transform_image(images[b:b + 1], theta[b],
                                                                    tess, n_steps=10))
    shared_image = transform_image(images[:1], theta, tess, n_steps=10)            # (1, ...) x (3, d)
    assert shared_image.shape == (3, 2, 6, 7)
    np.testing.assert_array_equal(shared_image[2], transform_image(images[:1], theta[2], tess,
                                                                   n_steps=10)[0])
    shared_theta = transform_image(images, theta[0], tess, n_steps=10)            # (3, ...) x (d,)
    np.testing.assert_array_equal(shared_theta, transform_image(images, theta[:1], tess,
                                                                n_steps=10))


def test_dtypes(rng):
    tess = Tessellation((2, 2))
    theta = tess.sample(1, length_scale=0.3, rng=rng)[0]
    image = rng.random((1, 1, 6, 5))
    f32 = transform_image(image.astype(np.float32), theta.astype(np.float32), tess, n_steps=10)
    assert f32.dtype == np.float32
    assert transform_image(image.astype(np.float32), theta, tess, n_steps=10).dtype == np.float64
    assert transform_image(image, theta.astype(np.float32), tess, n_steps=10).dtype == np.float64
    np.testing.assert_allclose(f32, transform_image(image, theta, tess, n_steps=10), atol=1e-4)
    assert transform_grid(theta.astype(np.float32), tess, (3, 4)).dtype == np.float32
    assert transform_grid(theta, tess, (3, 4)).dtype == np.float64


def test_meta_rules_match_the_results(rng):
    from cutopo.vjp import REGISTRY

    tess = Tessellation((2, 2))
    theta = tess.sample(2, length_scale=0.3, rng=rng).astype(np.float32)
    image = rng.random((1, 3, 5, 4))
    for name, fn, args in [("cpab_transform_grid", transform_grid, (theta, tess, (5, 4))),
                           ("cpab_transform_grid", transform_grid, (theta[0], tess, (5, 4))),
                           ("cpab_transform_image", transform_image, (image, theta, tess)),
                           ("cpab_transform_image", transform_image,
                            (image.astype(np.float32), theta[0], tess))]:
        out = fn(*args, n_steps=10)
        assert REGISTRY[name].meta(*args, n_steps=10) == (out.shape, out.dtype), name


# ---------------------------------------------------------------------------------------------
# VJP


@pytest.mark.parametrize("zb", ["noslip", None])
def test_vjp_2d_matches_central_differences(zb):
    rng = np.random.default_rng(20240611)                  # fixed: clear of the kinks
    tess = Tessellation((2, 2), zero_boundary=zb)
    T = 8
    theta = tess.sample(1, length_scale=0.4, rng=rng)[0] * 1.5
    image = rng.random((1, 2, 12, 10))
    out, pullback = cutopo.vjp(transform_image, image, theta, tess, n_steps=T)
    w = rng.normal(size=out.shape)
    d_image, d_theta, d_tess = pullback(w)
    assert d_tess is None and d_image.shape == image.shape and d_theta.shape == theta.shape

    def f_theta(th):
        return float((w * transform_image(image, th, tess, n_steps=T)).sum())

    def f_image(im):
        return float((w * transform_image(im, theta, tess, n_steps=T)).sum())

    floor = 1e-2 * np.linalg.norm(w)
    assert rel_err(d_theta, central_differences(f_theta, theta, 1e-7), floor) < 1e-6
    assert rel_err(d_image, central_differences(f_image, image, 1e-3), floor) < 1e-9


def test_vjp_3d_theta_matches_central_differences():
    rng = np.random.default_rng(7)
    tess = Tessellation((1, 1, 1), zero_boundary=None)
    theta = tess.sample(1, length_scale=0.5, rng=rng)[0] * 0.5
    image = rng.random((1, 1, 4, 5, 6))
    out, pullback = cutopo.vjp(transform_image, image, theta, tess, wrt="theta", n_steps=6)
    w = rng.normal(size=out.shape)
    d_image, d_theta, _ = pullback(w)
    assert d_image is None

    def f_theta(th):
        return float((w * transform_image(image, th, tess, n_steps=6)).sum())

    fd = central_differences(f_theta, theta, 1e-7)
    assert rel_err(d_theta, fd, 1e-2 * np.linalg.norm(w)) < 1e-6


def test_vjp_transform_grid_is_integrates(rng):
    tess = Tessellation((2, 3))
    theta = tess.sample(2, length_scale=0.3, rng=rng)
    out, pullback = cutopo.vjp(transform_grid, theta, tess, (5, 4), n_steps=12)
    w = rng.normal(size=out.shape)
    d_theta, d_tess, d_shape = pullback(w)
    assert d_tess is None and d_shape is None
    ref = cutopo.vjp(integrate, centres((5, 4)), theta, tess, wrt="theta",
                     n_steps=12)[1](w.reshape(2, 20, 2))[1]
    np.testing.assert_array_equal(d_theta, ref)


def test_vjp_batches_sum_over_shared_arguments(rng):
    tess = Tessellation((2, 2))
    T = 10
    theta = tess.sample(3, length_scale=0.3, rng=rng)
    images = rng.random((3, 2, 6, 5))
    w = rng.normal(size=images.shape)
    per_item = [cutopo.vjp(transform_image, images[b:b + 1], theta[b], tess, n_steps=T)[1](w[b:b + 1])
                for b in range(3)]
    d_image, d_theta, _ = cutopo.vjp(transform_image, images, theta, tess, n_steps=T)[1](w)
    for b in range(3):
        np.testing.assert_allclose(d_image[b:b + 1], per_item[b][0], rtol=1e-12, atol=1e-14)
        np.testing.assert_allclose(d_theta[b], per_item[b][1], rtol=1e-12, atol=1e-14)
    # a shared image (1, C, H, W): summed over the batch
    ref = [cutopo.vjp(transform_image, images[:1], theta[b], tess, n_steps=T)[1](w[b:b + 1])
           for b in range(3)]
    d_image, d_theta, _ = cutopo.vjp(transform_image, images[:1], theta, tess, n_steps=T)[1](w)
    np.testing.assert_allclose(d_image, sum(r[0] for r in ref), rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(d_theta, np.array([r[1] for r in ref]), rtol=1e-12, atol=1e-14)
    # a shared theta (d,): summed over the batch
    d_image, d_theta, _ = cutopo.vjp(transform_image, images, theta[0], tess, n_steps=T)[1](w)
    ref = [cutopo.vjp(transform_image, images[b:b + 1], theta[0], tess, n_steps=T)[1](w[b:b + 1])
           for b in range(3)]
    assert d_theta.shape == theta[0].shape
    want = sum(r[1] for r in ref)
    # summed in another order: rounding relative to the largest entry (a small entry is a
    # cancellation of large terms; seed 1437062427029246327 gave 1.8e-14 off -3e-3, entries ~9)
    np.testing.assert_allclose(d_theta, want, rtol=1e-12, atol=1e-13 * np.abs(want).max())


def _no_computation(monkeypatch):
    """Make any integration or sampling fail: an empty batch must need neither."""
    import importlib
    import types

    # the modules (cutopo.cpab.compose is also the function's name)
    transform, compose = (importlib.import_module(f"cutopo.cpab.{m}") for m in ("transform",
                                                                              "compose"))

    def refuse(*args, **kwargs):
        raise AssertionError("an empty batch integrated or sampled")

    stand_in = types.SimpleNamespace(forward=refuse, backward=refuse)
    for module, names in ((transform, ("_INTEGRATE", "_GRID_SAMPLE")),
                          (compose, ("_INTEGRATE", "_COMPOSE", "_GRID_SAMPLE"))):
        for name in names:
            monkeypatch.setattr(module, name, stand_in)


@pytest.mark.parametrize("n_image,theta_shape", [(0, ()), (0, (1,)), (0, (0,)), (1, (0,))])
def test_empty_batches_broadcast_as_numpy(n_image, theta_shape, rng, monkeypatch):
    """Batch sizes broadcast as NumPy's (0 with 1 is 0): an empty result and zero cotangents of
    the arguments' shapes, without integrating (0 with 1 used to make a batch of 1)."""
    from cutopo.cpab import compose_image
    from cutopo.vjp import REGISTRY

    tess = Tessellation((2, 2))
    image = rng.random((n_image, 2, 6, 5)).astype(np.float32)
    theta = np.zeros(theta_shape + (tess.n_params,))
    _no_computation(monkeypatch)
    for name, fn, th in (("cpab_transform_image", transform_image, theta),
                         ("cpab_compose_image", compose_image, np.stack([theta, theta]))):
        out, pullback = cutopo.vjp(fn, image, th, tess, n_steps=10)
        assert type(out) is np.ndarray and out.shape == (0, 2, 6, 5), name
        assert (out.shape, out.dtype) == REGISTRY[name].meta(image, th, tess, n_steps=10), name
        assert out.dtype == np.float64                     # float32 image, float64 theta
        d_image, d_theta, d_tess = pullback(np.zeros(out.shape))
        assert d_image.shape == image.shape and d_theta.shape == th.shape and d_tess is None
        assert not d_image.any() and not d_theta.any()
    assert transform_image(image, theta.astype(np.float32), tess).dtype == np.float32


def test_empty_batches_are_checked(rng):
    tess = Tessellation((2, 2))
    d = tess.n_params
    empty = rng.random((0, 1, 6, 5))
    with pytest.raises(ValueError, match="image and theta have batch sizes 0 and 3"):
        transform_image(empty, np.zeros((3, d)), tess)
    with pytest.raises(ValueError, match="image and theta have batch sizes 3 and 0"):
        transform_image(rng.random((3, 1, 6, 5)), np.zeros((0, d)), tess)
    with pytest.raises(ValueError, match="theta must have shape"):
        transform_image(empty, np.zeros(d + 1), tess)
    with pytest.raises(ValueError, match="mode must be one of"):
        transform_image(empty, np.zeros(d), tess, mode="bicubic")
    with pytest.raises(TypeError, match="not supported"):
        transform_image(empty.astype(np.int64), np.zeros(d), tess)
    with pytest.raises(ValueError, match="n_steps must be >= 1"):
        transform_image(empty, np.zeros(d), tess, n_steps=0)


def test_vjp_transform_grid_of_an_empty_batch(rng):
    tess = Tessellation((2, 3))
    out, pullback = cutopo.vjp(transform_grid, np.zeros((0, tess.n_params)), tess, (5, 4))
    assert out.shape == (0, 5, 4, 2)
    assert pullback(np.zeros(out.shape))[0].shape == (0, tess.n_params)


@pytest.mark.gpu
def test_empty_batches_on_the_device_launch_nothing(rng, monkeypatch):
    """CuPy: the fused warp of an empty batch used to launch B = 1 on a 0-row image (an
    out-of-bounds read); now nothing is launched and the result is an empty CuPy array."""
    import cupy as cp

    from cutopo._cuda.launch import KeptLaunches
    from cutopo.cpab import _integrate_cupy, _warp_cupy, compose_image

    def refuse(*args, **kwargs):
        raise AssertionError("a kernel was launched for an empty batch")

    for module in (_warp_cupy, _integrate_cupy):
        monkeypatch.setattr(module, "launch", refuse)
    monkeypatch.setattr(KeptLaunches, "__call__", refuse)         # a repeated call's launches
    tess = Tessellation((2, 2))
    d = tess.n_params
    for n_image, theta_shape in ((0, ()), (0, (1,)), (1, (0,))):
        image = cp.asarray(rng.random((n_image, 2, 6, 5)))
        theta = cp.zeros(theta_shape + (d,), dtype=cp.float32)
        for fn, th in ((transform_image, theta), (compose_image, cp.stack([theta, theta]))):
            out, pullback = cutopo.vjp(fn, image, th, tess, n_steps=10)
            assert isinstance(out, cp.ndarray) and out.shape == (0, 2, 6, 5)
            assert out.dtype == np.float64
            d_image, d_theta, _ = pullback(cp.zeros(out.shape))
            assert isinstance(d_image, cp.ndarray) and d_image.shape == image.shape
            assert isinstance(d_theta, cp.ndarray) and d_theta.shape == th.shape
            assert not bool(d_image.any()) and not bool(d_theta.any())


def test_registry_entries():
    from cutopo.vjp import REGISTRY

    spec = REGISTRY["cpab_transform_image"]
    assert spec.arg_names == ("image", "theta", "tess")
    assert spec.differentiable == {"image", "theta"} and spec.meta is not None
    spec = REGISTRY["cpab_transform_grid"]
    assert spec.arg_names == ("theta", "tess", "shape")
    assert spec.differentiable == {"theta"} and spec.meta is not None


# ---------------------------------------------------------------------------------------------
# Errors, adapters, exports, docstrings


def test_errors(rng):
    tess = Tessellation((2, 2))
    theta = np.zeros(tess.n_params)
    image = rng.random((2, 1, 6, 5))
    with pytest.raises(ValueError, match="image must have shape"):
        transform_image(image[0], theta, tess)
    with pytest.raises(ValueError, match="image must have shape"):
        transform_image(rng.random((1, 1, 3, 4, 5)), theta, tess)
    with pytest.raises(ValueError, match="batch sizes 2 and 3"):
        transform_image(image, np.zeros((3, tess.n_params)), tess)
    with pytest.raises(ValueError, match="theta must have shape"):
        transform_image(image, np.zeros(tess.n_params + 1), tess)
    with pytest.raises(ValueError, match="images are 2-D or 3-D"):
        transform_image(rng.random((1, 1, 6)), np.zeros(Tessellation((3,)).n_params),
                        Tessellation((3,)))
    with pytest.raises(ValueError, match="mode must be one of"):
        transform_image(image, theta, tess, mode="bicubic")
    with pytest.raises(ValueError, match="image must be finite"):
        transform_image(np.full((1, 1, 3, 3), np.nan), theta, tess)
    with pytest.raises(ValueError, match="theta must be finite"):
        transform_image(image, np.full(tess.n_params, np.inf), tess)
    with pytest.raises(TypeError, match="not supported"):
        transform_image(image.astype(np.int64), theta, tess)
    with pytest.raises(TypeError, match="Tessellation"):
        transform_image(image, theta, (2, 2))
    with pytest.raises(ValueError, match="n_steps must be >= 1"):
        transform_image(image, theta, tess, n_steps=0)
    with pytest.raises(ValueError, match="n_steps must be <= 2147483647"):
        transform_image(image, theta, tess, n_steps=2 ** 31)
    with pytest.raises(ValueError, match="shape .* has 3 axes"):
        transform_grid(theta, tess, (3, 4, 5))
    with pytest.raises(ValueError, match="shape must be >= 1"):
        transform_grid(theta, tess, (3, 0))
    with pytest.raises(TypeError, match="shape must be an int"):
        transform_grid(theta, tess, (3, 4.0))
    with pytest.raises(TypeError, match="shape must be a tuple"):
        transform_grid(theta, tess, 3)
    with pytest.raises(TypeError, match="Tessellation"):
        transform_grid(theta, None, (3, 4))
    with pytest.raises(TypeError, match="real numbers"):
        transform_grid(theta.astype(complex), tess, (3, 4))


def test_pixel_centres_are_shared_and_read_only():
    """transform_grid's centres are made once per (shape, dtype, device), equal to the
    direct construction here, and cannot be written (every call shares them)."""
    from cutopo.cpab.transform import centres_like

    a = centres_like(np.zeros(3), (7, 5), np.float32)
    assert a is centres_like(np.zeros(2, dtype=np.float32), [7, 5], "float32")
    assert a.dtype == np.float32 and not a.flags.writeable
    np.testing.assert_array_equal(a, centres((7, 5)).astype(np.float32))
    b = centres_like([0.0], (3, 4, 2), np.float64)
    np.testing.assert_array_equal(b, centres((3, 4, 2)))
    with pytest.raises(ValueError, match="read-only"):
        a[0, 0] = 1


@pytest.mark.gpu
def test_pixel_centres_on_the_device():
    """The device-made centres equal the host construction bit for bit, per device."""
    import cupy as cp

    from cutopo.cpab.transform import centres_like, pixel_centres

    for shape, dtype in (((33, 17), np.float32), ((5, 9, 7), np.float64), ((300, 7), np.float32)):
        got = centres_like(cp.zeros(1), shape, dtype)
        assert isinstance(got, cp.ndarray) and got.dtype == dtype
        np.testing.assert_array_equal(got.get(), pixel_centres(shape, dtype))
        np.testing.assert_array_equal(got.get(), centres(shape).astype(dtype))
        assert centres_like(cp.ones(2), shape, dtype) is got


@pytest.mark.gpu
def test_cupy_matches_numpy(rng):
    """CuPy image and theta run integrate's and grid_sample's kernels: the NumPy results (float64
    trajectories agree to the rounding of the step matrices; atomics reorder the sums)."""
    import cupy as cp

    for spatial, shape in (((9, 7), (2, 2)), ((5, 6, 4), (2, 2, 2))):
        tess = Tessellation(shape)
        theta = tess.sample(2, length_scale=0.4, scale=0.1, rng=rng)
        image = rng.random((2, 2) + spatial)
        out, pullback = cutopo.vjp(transform_image, image, theta, tess, n_steps=10)
        w = rng.normal(size=out.shape)
        d_image, d_theta, _ = pullback(w)
        g_out, g_pullback = cutopo.vjp(transform_image, cp.asarray(image), cp.asarray(theta), tess,
                                       n_steps=10)
        g_image, g_theta, _ = g_pullback(cp.asarray(w))
        assert isinstance(g_out, cp.ndarray) and isinstance(g_theta, cp.ndarray)
        np.testing.assert_allclose(g_out.get(), out, rtol=0, atol=1e-9)
        np.testing.assert_allclose(g_image.get(), d_image, rtol=0, atol=1e-9)
        np.testing.assert_allclose(g_theta.get(), d_theta, rtol=0, atol=1e-7 * np.abs(d_theta).max())
        phi = transform_grid(cp.asarray(theta[0]), tess, spatial, n_steps=10)
        np.testing.assert_allclose(phi.get(), transform_grid(theta[0], tess, spatial, n_steps=10),
                                   rtol=0, atol=1e-12)
    tess = Tessellation((2, 2))
    with pytest.raises(TypeError, match="image is a CuPy array but theta is not"):
        transform_image(cp.zeros((1, 1, 3, 4)), np.zeros(tess.n_params), tess)
    with pytest.raises(TypeError, match="theta is a CuPy array but image is not"):
        transform_image(np.zeros((1, 1, 3, 4)), cp.zeros(tess.n_params), tess)


def test_torch_adapter(rng):
    torch = pytest.importorskip("torch")
    import cutopo.torch as ct

    tess = Tessellation((2, 2))
    theta = tess.sample(2, length_scale=0.3, rng=rng)
    image = rng.random((2, 1, 6, 5))
    t_image = torch.tensor(image, requires_grad=True)
    t_theta = torch.tensor(theta, requires_grad=True)
    out = ct.cpab.transform_image(t_image, t_theta, tess, n_steps=10)
    ref, pullback = cutopo.vjp(transform_image, image, theta, tess, n_steps=10)
    np.testing.assert_array_equal(out.detach().numpy(), ref)
    w = rng.normal(size=ref.shape)
    out.backward(torch.tensor(w))
    d_image, d_theta, _ = pullback(w)
    np.testing.assert_allclose(t_image.grad.numpy(), d_image, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(t_theta.grad.numpy(), d_theta, rtol=1e-12, atol=1e-14)
    grid = ct.cpab.transform_grid(torch.tensor(theta), tess, (4, 3), n_steps=10)
    np.testing.assert_array_equal(grid.numpy(), transform_grid(theta, tess, (4, 3), n_steps=10))


def test_exports_and_docstring_examples():
    import cutopo.cpab as cpab

    assert {"transform_grid", "transform_image"} <= set(cpab.__all__)
    for name, fn in (("transform_grid", transform_grid), ("transform_image", transform_image)):
        assert getattr(cpab, name) is fn
        run_docstring_examples(fn)
