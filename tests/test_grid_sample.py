"""CPU tests of cutopo.grid_sample (the NumPy path) and its VJP.

The reference is torch.nn.functional.grid_sample on the CPU (values and autograd), plus central
finite differences in float64 and the PyTorch adapter (cutopo.torch.grid_sample).
"""
from __future__ import annotations

import itertools
import warnings

import numpy as np
import pytest

import cutopo
from adapter_cases import run_docstring_examples
from cutopo import sampling

torch = pytest.importorskip("torch", reason="PyTorch is not installed (pip install 'cutopo[torch]')")
F = torch.nn.functional

MODES = ("bilinear", "nearest")
PADDINGS = ("zeros", "border", "reflection")
COMBOS = list(itertools.product(MODES, PADDINGS, (False, True)))


def _spatial(ndim, align_corners):
    # Sizes for which multiples of 1/8 map to exact pixel coordinates (pixel centres and the
    # edges between pixels): size / 2 or (size - 1) / 2 a small power of two times an integer.
    if ndim == 2:
        return (5, 9) if align_corners else (4, 8)
    return (3, 5, 9) if align_corners else (2, 4, 8)


def _grid(rng, N, out, ndim, dyadic=True, spread=1.4):
    """Random points in [-spread, spread], half of the coordinates replaced (with ``dyadic``) by
    multiples of 1/8 in [-1.5, 1.5]: pixel centres and edges, inside and outside the image."""
    g = rng.uniform(-spread, spread, (N, *out, ndim))
    if dyadic:
        exact = rng.integers(-12, 13, g.shape) / 8
        g = np.where(rng.random(g.shape) < 0.5, exact, g)
    return g


def _case(rng, ndim, align_corners, dtype=np.float64, dyadic=True):
    spatial = _spatial(ndim, align_corners)
    image = rng.standard_normal((2, 3, *spatial)).astype(dtype)
    out = (6, 7) if ndim == 2 else (3, 4, 5)
    return image, _grid(rng, 2, out, ndim, dyadic).astype(dtype)


def _grid_off_kinks(rng, N, out, spatial, align_corners):
    """Random points whose pixel coordinates stay 0.05 away from integers and half-integers:
    off pixel boundaries, clamps and reflection edges, so that finite differences see no kink."""
    ndim = len(spatial)
    size = np.array(spatial[::-1], dtype=np.float64)  # grid component j runs along axis ndim - 1 - j
    whole = rng.integers(-2, size.astype(int) + 2, (N, *out, ndim))
    frac = rng.uniform(0.05, 0.45, whole.shape) + 0.5 * rng.integers(0, 2, whole.shape)
    x = whole + frac
    return 2 * x / (size - 1) - 1 if align_corners else (2 * x + 1) / size - 1


def _torch(image, grid, **kw):
    return F.grid_sample(torch.from_numpy(image), torch.from_numpy(grid), **kw).numpy()


# ---------------------------------------------------------------------------------------------
# Values


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("ndim", [2, 3])
@pytest.mark.parametrize("mode,padding_mode,align_corners", COMBOS)
def test_forward_equals_torch(rng, mode, padding_mode, align_corners, ndim, dtype):
    image, grid = _case(rng, ndim, align_corners, dtype)
    kw = dict(mode=mode, padding_mode=padding_mode, align_corners=align_corners)
    out = cutopo.grid_sample(image, grid, **kw)
    expected = _torch(image, grid, **kw)
    assert out.dtype == dtype and out.shape == expected.shape
    tol = 1e-12 if dtype == np.float64 else 2e-5
    np.testing.assert_allclose(out, expected, rtol=tol, atol=tol)


def test_nearest_rounds_half_to_even():
    image = np.arange(4.0).reshape(1, 1, 1, 4)
    # align_corners=False, W = 4: x = 2 (g + 1) - 1/2, so g = -1/2, 0, 1/2 fall on x = 0.5, 1.5, 2.5
    grid = np.array([[-0.5, 0.0], [0.0, 0.0], [0.5, 0.0]]).reshape(1, 1, 3, 2)
    out = cutopo.grid_sample(image, grid, mode="nearest")
    np.testing.assert_array_equal(out, [[[[0.0, 2.0, 2.0]]]])
    np.testing.assert_array_equal(out, _torch(image, grid, mode="nearest", align_corners=False))


def test_dtypes(rng):
    image, grid = _case(rng, 2, False)
    f16 = cutopo.grid_sample(image.astype(np.float16), grid.astype(np.float16))
    assert f16.dtype == np.float16
    ref32 = cutopo.grid_sample(image.astype(np.float16).astype(np.float32),
                               grid.astype(np.float16).astype(np.float32))
    np.testing.assert_array_equal(f16, ref32.astype(np.float16))  # computed in float32
    assert cutopo.grid_sample(image.astype(np.float32), grid).dtype == np.float64
    assert cutopo.grid_sample(image.astype(np.float16), grid.astype(np.float32)).dtype == np.float32


def test_chunking_changes_nothing(rng, monkeypatch):
    image, grid = _case(rng, 3, False, dyadic=False)
    cot = rng.standard_normal((2, 3, 3, 4, 5))
    whole, pb = cutopo.vjp(cutopo.grid_sample, image, grid, padding_mode="reflection")
    grads = pb(cot)
    monkeypatch.setattr(sampling, "_CHUNK_VALUES", 7)  # 2 points per chunk with C = 3
    chunked, pb = cutopo.vjp(cutopo.grid_sample, image, grid, padding_mode="reflection")
    np.testing.assert_array_equal(chunked, whole)
    for a, b in zip(pb(cot), grads):
        np.testing.assert_allclose(a, b, rtol=1e-13, atol=1e-13)


def test_empty_outputs(rng):
    image = rng.random((2, 3, 4, 5))
    assert cutopo.grid_sample(image, np.zeros((2, 0, 3, 2))).shape == (2, 3, 0, 3)
    out, pb = cutopo.vjp(cutopo.grid_sample, image[:0], np.zeros((0, 2, 3, 2)))
    assert out.shape == (0, 3, 2, 3)
    d_image, d_grid = pb(out)
    assert d_image.shape == (0, 3, 4, 5) and d_grid.shape == (0, 2, 3, 2)


def test_huge_grid_values_read_padding():
    image = np.ones((1, 1, 3, 3))
    grid = np.array([1e30, -1e300, 5e15, 0.0]).reshape(1, 1, 2, 2)
    np.testing.assert_array_equal(cutopo.grid_sample(image, grid), [[[[0.0, 0.0]]]])
    np.testing.assert_array_equal(cutopo.grid_sample(image, grid, padding_mode="border"), [[[[1.0, 1.0]]]])
    np.testing.assert_allclose(cutopo.grid_sample(image, grid, padding_mode="reflection"),
                               _torch(image, grid, padding_mode="reflection", align_corners=False))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("align_corners", [False, True])
@pytest.mark.parametrize("padding_mode", PADDINGS)
def test_grid_values_whose_pixel_coordinate_overflows(rng, dtype, align_corners, padding_mode):
    """|g| so large that (g + 1) size / 2 overflows the dtype: zeros reads nothing, border the
    edge pixel, reflection pixel 0 (the reflection of +-inf is undefined; the CUDA kernels'
    clamp sends its NaN there too), each with a zero grid derivative; no NaN, no warning."""
    big = np.finfo(dtype).max
    image = rng.random((1, 2, 4, 5)).astype(dtype)
    grid = rng.uniform(-1, 1, (1, 3, 2, 2)).astype(dtype)
    which = rng.random(grid.shape) < 0.5
    sign = rng.choice([-1, 1], size=grid.shape).astype(dtype)
    huge = np.where(which, sign * big, grid)
    # where each huge coordinate lands instead: far outside, on the edge, or on pixel 0
    sizes = np.array([5, 4], dtype=dtype)                     # x (width) first, then y
    if padding_mode == "zeros":
        far = 10 * sign
    elif padding_mode == "border":
        far = sign * (1 if align_corners else 1 - 1 / sizes)
    else:
        far = np.broadcast_to(-1 if align_corners else -1 + 1 / sizes, grid.shape).astype(dtype)
    landed = np.where(which, far, grid).astype(dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, pullback = cutopo.vjp(cutopo.grid_sample, image, huge, padding_mode=padding_mode,
                                   align_corners=align_corners)
        cot = rng.standard_normal(out.shape).astype(dtype)
        d_image, d_grid = pullback(cot)
    want, want_pullback = cutopo.vjp(cutopo.grid_sample, image, landed, padding_mode=padding_mode,
                                     align_corners=align_corners)
    want_image, _ = want_pullback(cot)
    tol = 1e-6 if dtype == np.float32 else 1e-12
    np.testing.assert_allclose(out, want, rtol=tol, atol=tol)
    np.testing.assert_allclose(d_image, want_image, rtol=tol, atol=tol)
    assert np.all(np.isfinite(d_grid)) and np.all(d_grid[which] == 0)


# ---------------------------------------------------------------------------------------------
# VJP


def _check_vjp_against_torch(rng, image, grid, **kw):
    """Output and both cotangents of a random cotangent equal torch's autograd (float64);
    returns the grid's cotangent."""
    out, pullback = cutopo.vjp(cutopo.grid_sample, image, grid, **kw)
    cot = rng.standard_normal(out.shape)
    d_image, d_grid = pullback(cot)
    ti = torch.from_numpy(image).requires_grad_()
    tg = torch.from_numpy(grid).requires_grad_()
    F.grid_sample(ti, tg, **kw).backward(torch.from_numpy(cot))
    np.testing.assert_allclose(out, _torch(image, grid, **kw), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(d_image, ti.grad.numpy(), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(d_grid, tg.grad.numpy(), rtol=1e-10, atol=1e-12)
    return d_grid



@pytest.mark.parametrize("ndim", [2, 3])
@pytest.mark.parametrize("mode,padding_mode,align_corners", COMBOS)
def test_vjp_equals_torch_autograd(rng, mode, padding_mode, align_corners, ndim):
    # Random points (no dyadic ones): off the kinks, where one-sided derivatives could differ.
    image, grid = _case(rng, ndim, align_corners, dyadic=False)
    d_grid = _check_vjp_against_torch(rng, image, grid, mode=mode, padding_mode=padding_mode,
                                      align_corners=align_corners)
    if mode == "nearest":
        assert not d_grid.any()


@pytest.mark.parametrize("ndim", [2, 3])
@pytest.mark.parametrize("padding_mode", ["border", "reflection"])
@pytest.mark.parametrize("align_corners", [False, True])
def test_vjp_on_the_clamp_ends_equals_torch(rng, padding_mode, align_corners, ndim):
    # Points whose pixel coordinates lie exactly on 0 or size - 1, where the clamp has a kink:
    # torch's derivative there is 0 (the clamp's flat side). Keeping the inner derivative on
    # the upper end read the missing pixel past the edge as 0 (a gradient of -image[last]).
    spatial = _spatial(ndim, align_corners)
    image = rng.standard_normal((2, 3, *spatial))
    size = np.array(spatial[::-1], dtype=np.float64)
    ends = np.stack([np.zeros_like(size), size - 1])                     # (2, ndim)
    pick = rng.integers(0, 2, (2, 4, 5, ndim))
    x = np.where(rng.random(pick.shape) < 0.7, ends[pick, np.arange(ndim)],
                 rng.uniform(0.2, 0.8, pick.shape) * (size - 1))
    grid = 2 * x / (size - 1) - 1 if align_corners else (2 * x + 1) / size - 1
    if ndim == 3:
        grid = grid[:, :, :, None].repeat(2, axis=3)
    _check_vjp_against_torch(rng, image, grid, mode="bilinear", padding_mode=padding_mode,
                             align_corners=align_corners)


def test_vjp_float32_equals_torch(rng):
    image, grid = _case(rng, 2, False, np.float32, dyadic=False)
    out, pullback = cutopo.vjp(cutopo.grid_sample, image, grid, padding_mode="reflection")
    cot = rng.standard_normal(out.shape).astype(np.float32)
    d_image, d_grid = pullback(cot)
    assert d_image.dtype == d_grid.dtype == np.float32
    ti = torch.from_numpy(image).requires_grad_()
    tg = torch.from_numpy(grid).requires_grad_()
    F.grid_sample(ti, tg, padding_mode="reflection", align_corners=False).backward(torch.from_numpy(cot))
    np.testing.assert_allclose(d_image, ti.grad.numpy(), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(d_grid, tg.grad.numpy(), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("ndim", [2, 3])
@pytest.mark.parametrize("padding_mode,align_corners", list(itertools.product(PADDINGS, (False, True))))
def test_vjp_equals_finite_differences(rng, padding_mode, align_corners, ndim):
    image, _ = _case(rng, ndim, align_corners)
    grid = _grid_off_kinks(rng, 2, (3, 4) if ndim == 2 else (2, 3, 4), image.shape[2:], align_corners)
    kw = dict(padding_mode=padding_mode, align_corners=align_corners)
    out, pullback = cutopo.vjp(cutopo.grid_sample, image, grid, **kw)
    cot = rng.standard_normal(out.shape)
    d_image, d_grid = pullback(cot)
    eps = 1e-6
    for i, (arg, grad) in enumerate(((image, d_image), (grid, d_grid))):
        v = rng.standard_normal(arg.shape)
        args_p = [image, grid]
        args_m = [image, grid]
        args_p[i], args_m[i] = arg + eps * v, arg - eps * v
        fd = np.sum(cot * (cutopo.grid_sample(*args_p, **kw) - cutopo.grid_sample(*args_m, **kw))) / (2 * eps)
        np.testing.assert_allclose(np.sum(grad * v), fd, rtol=1e-6, atol=1e-7)


def test_vjp_only_what_is_asked(rng):
    image, grid = _case(rng, 2, True, dyadic=False)
    out, pullback = cutopo.vjp(cutopo.grid_sample, image, grid, wrt="grid")
    d_image, d_grid = pullback(np.ones_like(out))
    assert d_image is None and d_grid.shape == grid.shape


# ---------------------------------------------------------------------------------------------
# Bad input


def test_validation_errors():
    image = np.zeros((2, 3, 4, 5))
    grid = np.zeros((2, 6, 7, 2))
    cases = [
        (ValueError, "mode", dict(mode="bicubic")),
        (TypeError, "mode", dict(mode=None)),
        (ValueError, "padding_mode", dict(padding_mode="wrap")),
        (TypeError, "padding_mode", dict(padding_mode=0)),
        (TypeError, "align_corners", dict(align_corners=1)),
    ]
    for exc, match, kw in cases:
        with pytest.raises(exc, match=match):
            cutopo.grid_sample(image, grid, **kw)
    with pytest.raises(ValueError, match="batch"):
        cutopo.grid_sample(image, grid[:1])
    with pytest.raises(ValueError, match="grid must have shape"):
        cutopo.grid_sample(image, np.zeros((2, 6, 7, 3)))
    with pytest.raises(ValueError, match="grid must have shape"):
        cutopo.grid_sample(image, np.zeros((2, 6, 2)))
    with pytest.raises(ValueError, match="image must have shape"):
        cutopo.grid_sample(image[0], grid)
    with pytest.raises(ValueError, match="zero-length"):
        cutopo.grid_sample(np.zeros((2, 3, 0, 5)), grid)
    with pytest.raises(TypeError, match="image: dtype"):
        cutopo.grid_sample(image.astype(np.int32), grid)
    with pytest.raises(TypeError, match="grid: dtype"):
        cutopo.grid_sample(image, grid.astype(np.complex128))
    for bad in (np.nan, np.inf, -np.inf):
        g = grid.copy()
        g[1, 2, 3, 0] = bad
        with pytest.raises(ValueError, match="grid must be finite"):
            cutopo.grid_sample(image, g)
        im = image.copy()
        im[0, 1, 2, 3] = bad
        with pytest.raises(ValueError, match="image must be finite"):
            cutopo.grid_sample(im, grid)


# ---------------------------------------------------------------------------------------------
# The PyTorch adapter and the docstring


def test_torch_adapter_values_and_gradients(rng):
    import cutopo.torch as ct

    image, grid = _case(rng, 3, True, dyadic=False)
    kw = dict(padding_mode="border", align_corners=True)
    ti = torch.from_numpy(image).requires_grad_()
    tg = torch.from_numpy(grid).requires_grad_()
    out = ct.grid_sample(ti, tg, **kw)
    np.testing.assert_array_equal(out.detach().numpy(), cutopo.grid_sample(image, grid, **kw))
    cot = rng.standard_normal(out.shape)
    out.backward(torch.from_numpy(cot))
    d_image, d_grid = cutopo.vjp(cutopo.grid_sample, image, grid, **kw)[1](cot)
    np.testing.assert_array_equal(ti.grad.numpy(), d_image)
    np.testing.assert_array_equal(tg.grad.numpy(), d_grid)


@pytest.mark.parametrize("padding_mode", PADDINGS)
def test_torch_adapter_gradcheck(padding_mode):
    import cutopo.torch as ct

    rng = np.random.default_rng(7)  # fixed: finite differences need points off the kinks
    image = torch.from_numpy(rng.standard_normal((1, 2, 3, 4))).requires_grad_()
    grid = torch.from_numpy(rng.uniform(-1.3, 1.3, (1, 2, 3, 2))).requires_grad_()
    assert torch.autograd.gradcheck(
        lambda i, g: ct.grid_sample(i, g, padding_mode=padding_mode), (image, grid))


def test_docstring_examples():
    run_docstring_examples(cutopo.grid_sample)


def test_index_width_decision(monkeypatch):
    """The CUDA forward/backward index with int32 only when every flattened index of the launch
    (thread, image, output, grid) stays below 2^31."""
    import types

    from cutopo import _sampling_cupy as sc

    def cfg(N, C, spatial, P):
        image = types.SimpleNamespace(shape=(N, C, int(np.prod(spatial))))
        return types.SimpleNamespace(N=N, C=C, P=P, spatial=spatial, image=image)

    assert sc._narrow(8 * 65536, cfg(8, 16, (256, 256), 65536)) == 1
    assert sc._narrow(1, cfg(1, 520, (2048, 2048), 42)) == 0        # C S > 2^31
    assert sc._narrow(1, cfg(1, 2, (4, 4), 2**30 + 1)) == 0          # C P > 2^31
    assert sc._narrow(2**31, cfg(1, 1, (4, 4), 2**30)) == 0          # threads
    assert sc._narrow(3, cfg(1, 1, (8, 8, 8), 2**29 + 2**28)) == 0   # N P ndim grid entries
    assert sc._narrow(3, cfg(1, 1, (2**15, 2**15), 2)) == 1         # S = 2^30 fits
    monkeypatch.setattr(sc, "FORCE_WIDE_INDEX", True)
    assert sc._narrow(8, cfg(1, 1, (4, 4), 8)) == 0
