"""The fused CuPy transform_image (one kernel integrates and samples; cutopo.cpab._warp_cupy)
against two oracles: the composed CuPy path (integrate's and grid_sample's kernels, FUSED =
False), which it must equal bit for bit in the forward, and the NumPy path."""
from __future__ import annotations

import numpy as np
import pytest

import cutopo
from cutopo.cpab import Tessellation, transform_image
from cutopo.cpab import _warp_cupy
from cutopo.cpab import transform as transform_module

gpu = pytest.mark.gpu
_OP = transform_image.__cutopo_op__


def _cp():
    cp = pytest.importorskip("cupy")
    if not cp.cuda.is_available():
        pytest.skip("gpu: CuPy sees no CUDA device")
    return cp


def _run(monkeypatch, fused, image, theta, tess, cotangent, **kwargs):
    """(out, d_image, d_theta) of one path, with every cotangent asked for."""
    monkeypatch.setattr(transform_module, "FUSED", fused)
    out, residuals = _OP.forward(image, theta, tess, **kwargs)
    assert isinstance(residuals, _warp_cupy.Residuals) == fused
    d_image, d_theta, d_tess = _OP.backward(residuals, cotangent, (True, True, False))
    assert d_tess is None
    return out, d_image, d_theta


def _smooth_image(rng, shape):
    """Random content smooth at the pixel scale, so sample values vary between neighbours."""
    from scipy.ndimage import gaussian_filter

    noise = rng.standard_normal(shape)
    sigma = (0, 0) + (1.0,) * (len(shape) - 2)
    return gaussian_filter(noise, sigma) + 0.5


# (spatial, tess shape, zero_boundary, mode, padding, image dtype, theta dtype, N, Bt):
# 2D and 3D, P on and off, every mode and padding, every image dtype, both trajectory dtypes,
# broadcast on either side.
CASES = [
    ((33, 29), (3, 4), "noslip", "bilinear", "border", np.float32, np.float32, 2, 2),
    ((20, 24), (2, 2), None, "bilinear", "zeros", np.float64, np.float64, 1, 3),
    ((21, 18), (3, 3), "slip", "bilinear", "reflection", np.float16, np.float32, 3, 1),
    ((17, 15), (2, 3), "noslip", "nearest", "border", np.float32, np.float64, 2, 2),
    ((9, 10, 11), (2, 2, 2), "noslip", "bilinear", "border", np.float32, np.float32, 1, 2),
    ((8, 7, 9), (1, 2, 2), None, "bilinear", "reflection", np.float64, np.float64, 2, 1),
    ((6, 8, 7), (2, 1, 2), "slip", "nearest", "zeros", np.float64, np.float32, 2, 2),
]


@gpu
@pytest.mark.parametrize("case", CASES, ids=[f"{len(c[0])}d-{c[2]}-{c[3]}-{c[4]}-"
                                             f"{np.dtype(c[5]).name}-{np.dtype(c[6]).name}"
                                             for c in CASES])
def test_fused_equals_the_composed_path(monkeypatch, rng, case):
    """Forward: bit for bit the composed kernels' output (same trajectories, same sampling
    arithmetic). VJP: the same cotangents up to the order of the atomic and batch sums."""
    cp = _cp()
    spatial, shape, zb, mode, padding, image_dtype, theta_dtype, N, Bt = case
    tess = Tessellation(shape, zero_boundary=zb)
    theta = tess.sample(Bt, length_scale=0.4, scale=0.15, rng=rng).astype(theta_dtype)
    image = _smooth_image(rng, (N, 2) + spatial).astype(image_dtype)
    kwargs = dict(n_steps=20, mode=mode, padding_mode=padding)
    g_image, g_theta = cp.asarray(image), cp.asarray(theta)
    B = max(N, Bt)
    cot = cp.asarray(rng.standard_normal((B, 2) + spatial))
    fused = _run(monkeypatch, True, g_image, g_theta, tess, cot, **kwargs)
    composed = _run(monkeypatch, False, g_image, g_theta, tess, cot, **kwargs)
    out, d_image, d_theta = fused
    assert out.dtype == composed[0].dtype and out.shape == composed[0].shape == (B, 2) + spatial
    cp.testing.assert_array_equal(out, composed[0])
    assert d_image.shape == composed[1].shape == image.shape and d_image.dtype == composed[1].dtype
    assert d_theta.shape == composed[2].shape == theta.shape
    tol = 1e-12 if out.dtype == np.float64 else 2e-5
    scale = float(cp.abs(composed[1]).max())
    np.testing.assert_allclose(d_image.get(), composed[1].get(), rtol=0, atol=tol * scale)
    if mode == "nearest":                      # piecewise constant in theta
        assert not cp.any(d_theta) and not cp.any(composed[2])
        return
    scale = float(cp.abs(composed[2]).max())
    assert scale > 0
    tol = 1e-9 if theta_dtype == np.float64 and image_dtype == np.float64 else 1e-4
    np.testing.assert_allclose(d_theta.get(), composed[2].get(), rtol=0, atol=tol * scale)


@gpu
@pytest.mark.parametrize("spatial,shape", [((23, 19), (3, 3)), ((7, 9, 8), (2, 2, 2))])
def test_fused_matches_numpy(rng, spatial, shape):
    """The NumPy path (integrate + grid_sample in NumPy) as the independent oracle, float64."""
    cp = _cp()
    tess = Tessellation(shape)
    theta = tess.sample(2, length_scale=0.4, scale=0.15, rng=rng)
    image = _smooth_image(rng, (2, 3) + spatial)
    out, pullback = cutopo.vjp(transform_image, image, theta, tess, n_steps=30)
    w = rng.standard_normal(out.shape)
    d_image, d_theta, _ = pullback(w)
    g_out, g_pullback = cutopo.vjp(transform_image, cp.asarray(image), cp.asarray(theta), tess,
                                   n_steps=30)
    g_image, g_theta, _ = g_pullback(cp.asarray(w))
    np.testing.assert_allclose(g_out.get(), out, rtol=0, atol=1e-9)
    np.testing.assert_allclose(g_image.get(), d_image, rtol=0, atol=1e-9 * np.abs(d_image).max())
    np.testing.assert_allclose(g_theta.get(), d_theta, rtol=0, atol=1e-7 * np.abs(d_theta).max())
    # theta only (the registration step) and image only: the same cotangents
    _, pb_theta = cutopo.vjp(transform_image, cp.asarray(image), cp.asarray(theta), tess,
                             n_steps=30, wrt="theta")
    np.testing.assert_allclose(pb_theta(cp.asarray(w))[1].get(), d_theta, rtol=0,
                               atol=1e-7 * np.abs(d_theta).max())
    _, pb_image = cutopo.vjp(transform_image, cp.asarray(image), cp.asarray(theta), tess,
                             n_steps=30, wrt="image")
    np.testing.assert_allclose(pb_image(cp.asarray(w))[0].get(), d_image, rtol=0,
                               atol=1e-9 * np.abs(d_image).max())


@gpu
def test_long_integrations_take_the_composed_path(rng):
    """n_steps > 256 does not fit the backward's local checkpoints: the composed kernels run,
    with the same result as NumPy."""
    cp = _cp()
    tess = Tessellation((2, 2))
    theta = tess.sample(1, length_scale=0.4, scale=0.1, rng=rng)
    image = rng.random((1, 1, 12, 10))
    out, residuals = _OP.forward(cp.asarray(image), cp.asarray(theta), tess, n_steps=300)
    assert not isinstance(residuals, _warp_cupy.Residuals)
    np.testing.assert_allclose(out.get(), transform_image(image, theta, tess, n_steps=300),
                               rtol=0, atol=1e-9)
    _, residuals = _OP.forward(cp.asarray(image), cp.asarray(theta), tess, n_steps=256)
    assert isinstance(residuals, _warp_cupy.Residuals)


@gpu
def test_fused_errors(rng):
    cp = _cp()
    tess = Tessellation((2, 2))
    theta = cp.asarray(tess.sample(1, length_scale=0.4, scale=0.1, rng=rng))
    image = cp.asarray(rng.random((1, 1, 8, 8)))
    bad = image.copy()
    bad[0, 0, 3, 4] = np.nan
    with pytest.raises(ValueError, match="image must be finite"):
        transform_image(bad, theta, tess)
    bad_theta = theta.copy()
    bad_theta[0, 1] = np.inf
    with pytest.raises(ValueError, match="theta must be finite"):
        transform_image(image, bad_theta, tess)
    with pytest.raises(ValueError, match="mode"):
        transform_image(image, theta, tess, mode="bicubic")
    with pytest.raises(ValueError, match="padding_mode"):
        transform_image(image, theta, tess, padding_mode="wrap")
    with pytest.raises(TypeError, match="image"):
        transform_image(image.astype(cp.int32), theta, tess)
    with pytest.raises(ValueError, match="n_steps"):
        transform_image(image, theta * 1e3, tess, n_steps=2)   # the step-size guard


def test_fused_switch_and_limits():
    """No GPU needed: the switch's default and the longest fused integration."""
    assert transform_module.FUSED is True
    assert _warp_cupy.supports(50) and _warp_cupy.supports(272)  # 16 segments of 17 steps
    assert not _warp_cupy.supports(273)
