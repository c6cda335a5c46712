"""CUDA kernels of grid_sample (cuda_src/sampling.cu) against the NumPy path.

The NumPy path is the oracle (tested against torch.nn.functional.grid_sample and finite
differences in test_grid_sample.py). Every GPU output and cotangent must equal it to the
rounding of the computation dtype; outputs are allocated from a NaN-poisoned pool, so an
element a kernel forgets to write shows up as NaN. Grids mix random points, points outside
[-1, 1] and points exactly on pixel centres and pixel edges (where the cell, hence the
one-sided grid cotangent, depends on the last bit of the coordinate map: both backends must
round it alike).

Run on a GPU machine: ``pytest -m gpu tests/test_grid_sample_gpu.py`` (skipped without one).
"""
from __future__ import annotations

import itertools

import numpy as np
import pytest

import cutopo
from cutopo import _sampling_cupy
from gpu_support import cupy_module as _cp, poison_pool

pytestmark = pytest.mark.gpu

MODES = ("bilinear", "nearest")
PADDINGS = ("zeros", "border", "reflection")
COMBOS = list(itertools.product(MODES, PADDINGS, (False, True)))
TOL = {np.dtype(np.float32): 2e-5, np.dtype(np.float64): 1e-11, np.dtype(np.float16): 2e-3}


@pytest.fixture
def per_group(request):
    """Sets _sampling_cupy.FORCE_PER_GROUP (channels per thread) for the test, restores it."""
    old = _sampling_cupy.FORCE_PER_GROUP
    _sampling_cupy.FORCE_PER_GROUP = getattr(request, "param", None)
    yield _sampling_cupy.FORCE_PER_GROUP
    _sampling_cupy.FORCE_PER_GROUP = old


@pytest.fixture(params=[False, True], ids=["narrow", "wide"])
def wide_index(request):
    """Runs the test with 32-bit indices where they fit (the default) and with 64-bit ones
    forced (_sampling_cupy.FORCE_WIDE_INDEX): the two instantiations must agree."""
    old = _sampling_cupy.FORCE_WIDE_INDEX
    _sampling_cupy.FORCE_WIDE_INDEX = request.param
    yield request.param
    _sampling_cupy.FORCE_WIDE_INDEX = old


def _spatial(ndim, align_corners):
    # Sizes for which multiples of 1/8 are exact pixel centres or edges in every dtype:
    # size / 2 or (size - 1) / 2 a small power of two times an integer.
    if ndim == 2:
        return (5, 9) if align_corners else (4, 8)
    return (3, 5, 9) if align_corners else (2, 4, 8)


def _grid(rng, N, out, ndim, spread=1.4):
    """Points uniform in [-spread, spread]; half of the coordinates replaced by multiples of 1/8
    in [-1.5, 1.5]: pixel centres and edges, inside and outside the image."""
    g = rng.uniform(-spread, spread, (N, *out, ndim))
    exact = rng.integers(-12, 13, g.shape) / 8
    return np.where(rng.random(g.shape) < 0.5, exact, g)


def _case(rng, ndim, align_corners, dtype=np.float64, N=2, C=5):
    image = rng.standard_normal((N, C, *_spatial(ndim, align_corners))).astype(dtype)
    out = (6, 7) if ndim == 2 else (3, 4, 5)
    return image, _grid(rng, N, out, ndim).astype(dtype)


def assert_close(gpu, ref, dtype, what, rtol=None):
    cp = _cp()
    assert isinstance(gpu, cp.ndarray), f"{what}: not a CuPy array"
    got = cp.asnumpy(gpu).astype(np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    assert got.shape == ref.shape, f"{what}: shape {got.shape}, expected {ref.shape}"
    assert np.all(np.isfinite(got)), f"{what}: non-finite values (an unwritten output?)"
    tol = (rtol or TOL[np.dtype(dtype)]) * max(1.0, float(np.max(np.abs(ref), initial=0.0)))
    err = np.abs(got - ref)
    assert np.all(err <= tol), (f"{what}: max error {err.max():.3g} at "
                                f"{np.unravel_index(err.argmax(), err.shape)}, tol {tol:.3g}")


def run_both(image, grid, kw, cot, wrt=None):
    """(out, cotangents) of the NumPy path and of the GPU path on copies of the same inputs, the
    GPU outputs allocated from a NaN-poisoned pool."""
    cp = _cp()
    out_c, pb_c = cutopo.vjp(cutopo.grid_sample, image, grid, wrt=wrt, **kw)
    cots_c = pb_c(cot)
    ig, gg = cp.asarray(image), cp.asarray(grid)
    poison_pool()
    out_g, pb_g = cutopo.vjp(cutopo.grid_sample, ig, gg, wrt=wrt, **kw)
    poison_pool()
    cots_g = pb_g(cp.asarray(cot))
    return (out_c, cots_c), (out_g, cots_g)


def check_against_numpy(image, grid, kw, rng, wrt=None, rtol=None):
    dtype = np.result_type(image.dtype, grid.dtype)
    cot = rng.standard_normal(image.shape[:2] + grid.shape[1:-1]).astype(dtype)
    (out_c, cots_c), (out_g, cots_g) = run_both(image, grid, kw, cot, wrt)
    assert out_g.dtype == out_c.dtype and out_g.shape == out_c.shape
    assert_close(out_g, out_c, dtype, "out", rtol)
    for name, a, b in zip(("d_image", "d_grid"), cots_g, cots_c):
        assert (a is None) == (b is None), name
        if a is not None:
            assert a.dtype == b.dtype and a.shape == b.shape, name
            # a float16 cotangent is rounded from float32 (GPU) or float64 (NumPy) sums: one
            # float16 rounding apart at most
            assert_close(a, b, dtype, name, max(rtol or TOL[np.dtype(dtype)], TOL[a.dtype]))
    return out_g, cots_g


# ---------------------------------------------------------------------------------------------
# GPU equals NumPy


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("ndim", [2, 3])
@pytest.mark.parametrize("mode,padding_mode,align_corners", COMBOS)
def test_forward_matches_numpy(rng, mode, padding_mode, align_corners, ndim, dtype):
    cp = _cp()
    image, grid = _case(rng, ndim, align_corners, dtype)
    kw = dict(mode=mode, padding_mode=padding_mode, align_corners=align_corners)
    ref = cutopo.grid_sample(image, grid, **kw)
    poison_pool()
    out = cutopo.grid_sample(cp.asarray(image), cp.asarray(grid), **kw)
    assert out.dtype == ref.dtype == dtype
    assert_close(out, ref, dtype, "out")


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("ndim", [2, 3])
@pytest.mark.parametrize("mode,padding_mode,align_corners", COMBOS)
def test_vjp_matches_numpy(rng, mode, padding_mode, align_corners, ndim, dtype, deterministic):
    image, grid = _case(rng, ndim, align_corners, dtype)
    kw = dict(mode=mode, padding_mode=padding_mode, align_corners=align_corners,
              deterministic=deterministic)
    _, (d_image, d_grid) = check_against_numpy(image, grid, kw, rng)
    if mode == "nearest":
        assert not bool(_cp().any(d_grid))


@pytest.mark.parametrize("per_group", [None, 1, 2, 3, 8], indirect=True)
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("ndim", [2, 3])
def test_channel_groups(rng, per_group, deterministic, ndim, wide_index):
    """Channels split over threads (forward; image cotangent alone) or not: same results."""
    image, grid = _case(rng, ndim, False, np.float32, N=3, C=11)
    kw = dict(padding_mode="reflection", deterministic=deterministic)
    check_against_numpy(image, grid, kw, rng)
    check_against_numpy(image, grid, kw, rng, wrt="image")


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("ndim", [2, 3])
def test_random_larger_problems(rng, dtype, ndim, wide_index):
    """Sizes that are no powers of two, more points than one block, points off the dyadic
    lattice, warps that straddle channel planes and batch elements."""
    spatial = (33, 47) if ndim == 2 else (9, 13, 17)
    out = (40, 50) if ndim == 2 else (11, 12, 13)
    image = rng.standard_normal((3, 7, *spatial)).astype(dtype)
    grid = rng.uniform(-1.3, 1.3, (3, *out, ndim)).astype(dtype)
    for mode, padding_mode, align_corners in COMBOS:
        kw = dict(mode=mode, padding_mode=padding_mode, align_corners=align_corners)
        check_against_numpy(image, grid, kw, rng)


@pytest.mark.parametrize("wrt", ["image", "grid"])
@pytest.mark.parametrize("deterministic", [False, True])
def test_only_requested_cotangents(rng, wrt, deterministic):
    image, grid = _case(rng, 2, True, np.float32)
    _, cots = check_against_numpy(image, grid, dict(deterministic=deterministic), rng, wrt=wrt)
    assert [c is not None for c in cots] == [wrt == "image", wrt == "grid"]


def test_nearest_rounds_half_to_even():
    cp = _cp()
    image = cp.arange(4.0).reshape(1, 1, 1, 4)
    # align_corners=False, W = 4: x = 2 (g + 1) - 1/2, so g = -1/2, 0, 1/2 fall on x = 0.5, 1.5, 2.5
    grid = cp.asarray(np.array([[-0.5, 0.0], [0.0, 0.0], [0.5, 0.0]]).reshape(1, 1, 3, 2))
    for dtype in (np.float32, np.float64):
        out = cutopo.grid_sample(image.astype(dtype), grid.astype(dtype), mode="nearest")
        np.testing.assert_array_equal(cp.asnumpy(out), [[[[0.0, 2.0, 2.0]]]])


# ---------------------------------------------------------------------------------------------
# Determinism


@pytest.mark.parametrize("ndim", [2, 3])
def test_deterministic_mode_is_bitwise_reproducible(rng, ndim):
    """Heavy contention: a fine grid over a coarse image (about 64 or 128 entries per pixel)."""
    cp = _cp()
    spatial, out = ((16, 16), (128, 128)) if ndim == 2 else ((6, 6, 6), (24, 24, 24))
    image = cp.asarray(rng.standard_normal((2, 8, *spatial)).astype(np.float32))
    grid = cp.asarray(rng.uniform(-1.05, 1.05, (2, *out, ndim)).astype(np.float32))
    g = cp.asarray(rng.standard_normal((2, 8, *out)).astype(np.float32))
    runs = []
    for _ in range(3):
        out_, pb = cutopo.vjp(cutopo.grid_sample, image, grid, deterministic=True)
        runs.append([cp.asnumpy(x).view(np.uint32) for x in (out_,) + pb(g)])
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            np.testing.assert_array_equal(a, b)
    # ... equal to the atomic version up to rounding, and to the NumPy path
    _, pb = cutopo.vjp(cutopo.grid_sample, image, grid, deterministic=False)
    d_atomic, d_grid = pb(g)
    assert_close(d_atomic, runs[0][1].view(np.float32), np.float32, "atomic vs sorted d_image")
    np.testing.assert_array_equal(cp.asnumpy(d_grid).view(np.uint32), runs[0][2])
    _, pb_c = cutopo.vjp(cutopo.grid_sample, cp.asnumpy(image), cp.asnumpy(grid))
    assert_close(d_atomic, pb_c(cp.asnumpy(g))[0], np.float32, "atomic d_image vs NumPy")


@pytest.mark.parametrize("mode", MODES)
def test_int64_keys(rng, monkeypatch, mode):
    """The deterministic path with 64-bit sort keys (taken for more than 2^31 - 2 image rows)."""
    monkeypatch.setattr(_sampling_cupy, "KEY32_MAX_ROWS", 0)
    for ndim in (2, 3):
        image, grid = _case(rng, ndim, False, np.float32)
        check_against_numpy(image, grid, dict(mode=mode, deterministic=True), rng, wrt="image")


# ---------------------------------------------------------------------------------------------
# Dtypes, layouts, sizes


@pytest.mark.parametrize("image_dtype,grid_dtype", [
    ("float16", "float16"), ("float16", "float32"), ("float32", "float16"), ("float16", "float64"),
    ("float32", "float64"), ("float64", "float32")])
def test_mixed_and_half_dtypes(rng, image_dtype, grid_dtype):
    """Output dtype numpy.result_type(image, grid); float16 computed in float32 (float16 images
    read as stored, by the kernels), equal to the NumPy path."""
    image, grid = _case(rng, 2, False)
    image, grid = image.astype(image_dtype), grid.astype(grid_dtype)
    dtype = np.result_type(image.dtype, grid.dtype)
    rtol = {np.dtype(np.float16): 2e-3, np.dtype(np.float32): 1e-4, np.dtype(np.float64): 1e-11}[dtype]
    for kw in (dict(), dict(mode="nearest", padding_mode="border"),
               dict(padding_mode="reflection", align_corners=True, deterministic=True)):
        out, cots = check_against_numpy(image, grid, kw, rng, rtol=rtol)
        assert out.dtype == dtype
        assert cots[0].dtype == image.dtype and cots[1].dtype == grid.dtype


def test_float16_output_rounding(rng):
    """float16 inputs: the kernel rounds its float32 result to float16 itself, to nearest even,
    as NumPy's astype does."""
    cp = _cp()
    image, grid = _case(rng, 3, True)
    image, grid = image.astype(np.float16), grid.astype(np.float16)
    ref = cutopo.grid_sample(image, grid, padding_mode="border", align_corners=True)
    out = cutopo.grid_sample(cp.asarray(image), cp.asarray(grid), padding_mode="border",
                             align_corners=True)
    assert out.dtype == np.float16
    np.testing.assert_array_equal(cp.asnumpy(out).view(np.uint16), ref.view(np.uint16))


def test_non_contiguous_inputs(rng):
    cp = _cp()
    image, grid = _case(rng, 3, False, np.float32)
    ref = cutopo.grid_sample(image, grid, padding_mode="border")
    ig = cp.asfortranarray(cp.asarray(image))
    gg = cp.asarray(np.ascontiguousarray(np.moveaxis(grid, -1, 0)))
    gg = cp.moveaxis(gg, 0, -1)  # a strided view
    assert not ig.flags.c_contiguous and not gg.flags.c_contiguous
    out = cutopo.grid_sample(ig, gg, padding_mode="border")
    assert_close(out, ref, np.float32, "out")
    # a broadcast image (stride 0 over the batch)
    one = cp.asarray(image[:1])
    out = cutopo.grid_sample(cp.broadcast_to(one, image.shape), cp.asarray(grid))
    ref = cutopo.grid_sample(np.broadcast_to(image[:1], image.shape), grid)
    assert_close(out, ref, np.float32, "out (broadcast image)")


def test_empty_on_device(rng):
    cp = _cp()
    image = cp.asarray(rng.random((2, 3, 4, 5)))
    out = cutopo.grid_sample(image, cp.zeros((2, 0, 3, 2)))
    assert isinstance(out, cp.ndarray) and out.shape == (2, 3, 0, 3)
    for det in (False, True):
        out, pb = cutopo.vjp(cutopo.grid_sample, image[:0], cp.zeros((0, 2, 3, 2)), deterministic=det)
        assert out.shape == (0, 3, 2, 3)
        d_image, d_grid = pb(out)
        assert d_image.shape == (0, 3, 4, 5) and d_grid.shape == (0, 2, 3, 2)
        # no output points: the image cotangent is zero (written, not left uninitialised)
        poison_pool()
        out, pb = cutopo.vjp(cutopo.grid_sample, image, cp.zeros((2, 0, 3, 2)), deterministic=det)
        d_image, d_grid = pb(out)
        assert d_image.shape == image.shape and not bool(cp.any(d_image != 0))
        # no channels: the grid cotangent is zero
        poison_pool()
        out, pb = cutopo.vjp(cutopo.grid_sample, image[:, :0], cp.asarray(rng.random((2, 3, 3, 2))),
                             deterministic=det)
        d_image, d_grid = pb(out)
        assert out.shape == (2, 0, 3, 3) and d_image.shape == (2, 0, 4, 5)
        assert d_grid.shape == (2, 3, 3, 2) and not bool(cp.any(d_grid != 0))


def test_huge_grid_values(rng):
    """Coordinates far outside (float64), and float32 ones whose pixel coordinate overflows to
    inf: padding as on the NumPy path (reflection: pixel 0), never a read outside the image."""
    cp = _cp()
    image = np.ones((1, 2, 3, 3))
    grid = np.array([1e30, -1e300, 5e15, 0.0]).reshape(1, 1, 2, 2)
    for pad in PADDINGS:
        ref = cutopo.grid_sample(image, grid, padding_mode=pad)
        assert_close(cutopo.grid_sample(cp.asarray(image), cp.asarray(grid), padding_mode=pad),
                     ref, np.float64, pad)
    g32 = np.array([3e38, -3e38, 0.0, 3e38], dtype=np.float32).reshape(1, 1, 2, 2)
    im32 = image.astype(np.float32)
    im32 = rng.random((1, 2, 3, 4)).astype(np.float32)
    for pad in PADDINGS:
        for align in (False, True):
            out, pullback = cutopo.vjp(cutopo.grid_sample, im32, g32, padding_mode=pad,
                                       align_corners=align)
            g_out, g_pullback = cutopo.vjp(cutopo.grid_sample, cp.asarray(im32), cp.asarray(g32),
                                           padding_mode=pad, align_corners=align)
            assert np.all(np.isfinite(out))
            assert_close(g_out, out, np.float32, pad)
            cot = rng.standard_normal(out.shape).astype(np.float32)
            for got, want in zip(g_pullback(cp.asarray(cot)), pullback(cot)):
                assert_close(got, want, np.float32, f"{pad} cotangent")


def test_large_index_64bit(rng):
    """C S > 2^31 elements: channel planes past the 32-bit range, forward and VJP (atomic and
    deterministic), and the finiteness check of the image reaching its last element."""
    cp = _cp()
    free, _ = cp.cuda.Device().mem_info
    C, H, W = 520, 2048, 2048                     # C H W = 2.18e9 > 2^31
    # the float16 image, the float32 image cotangent and its float16 copy for the argument
    need = C * H * W * (2 + 4 + 2) + (2 << 30)
    if free < need:
        pytest.skip(f"needs {need / 2**30:.0f} GiB of free device memory, {free / 2**30:.0f} GiB free")
    image = cp.ones((1, C, H, W), dtype=cp.float16)
    probe = [0, C - 3, C - 2, C - 1]               # channels checked against the NumPy path
    for c in probe:
        image[0, c] = cp.asarray(rng.standard_normal((H, W)).astype(np.float16))
    grid = rng.uniform(-1.0, 1.0, (1, 6, 7, 2)).astype(np.float32)
    grid[0, 0, :4] = [[-1, -1], [1, 1], [-1, 1], [1, -1]]   # the corners
    host = cp.asnumpy(image[:, probe])
    kw = dict(padding_mode="border")
    out_c, pb_c = cutopo.vjp(cutopo.grid_sample, host, grid, **kw)
    cot = rng.standard_normal((1, C, 6, 7)).astype(np.float32)
    d_ref = pb_c(cot[:, probe])
    for det in (False, True):
        out, pb = cutopo.vjp(cutopo.grid_sample, image, cp.asarray(grid), deterministic=det, **kw)
        assert_close(out[:, probe], out_c, np.float32, f"out (deterministic={det})")
        d_image, d_grid = pb(cp.asarray(cot))
        assert_close(d_image[:, probe], d_ref[0], np.float32, f"d_image (deterministic={det})",
                     rtol=2e-3)  # float16 cotangent
        del d_image, d_grid
    image[0, C - 1, H - 1, W - 1] = np.inf         # element 2^31 + ...: the check must reach it
    with pytest.raises(ValueError, match="image must be finite"):
        cutopo.grid_sample(image, cp.asarray(grid))


# ---------------------------------------------------------------------------------------------
# Bad input on the device


def test_validation_errors_on_device():
    cp = _cp()
    image = cp.zeros((2, 3, 4, 5))
    grid = cp.zeros((2, 6, 7, 2))
    for exc, match, kw in [(ValueError, "mode", dict(mode="bicubic")),
                           (ValueError, "padding_mode", dict(padding_mode="wrap")),
                           (TypeError, "align_corners", dict(align_corners=1)),
                           (TypeError, "deterministic", dict(deterministic=None))]:
        with pytest.raises(exc, match=match):
            cutopo.grid_sample(image, grid, **kw)
    with pytest.raises(ValueError, match="batch"):
        cutopo.grid_sample(image, grid[:1])
    with pytest.raises(ValueError, match="grid must have shape"):
        cutopo.grid_sample(image, cp.zeros((2, 6, 7, 3)))
    with pytest.raises(ValueError, match="zero-length"):
        cutopo.grid_sample(cp.zeros((2, 3, 0, 5)), grid)
    with pytest.raises(TypeError, match="image: dtype"):
        cutopo.grid_sample(image.astype(cp.int32), grid)
    with pytest.raises(TypeError, match="both be NumPy or both CuPy"):
        cutopo.grid_sample(image, cp.asnumpy(grid))
    with pytest.raises(TypeError, match="both be NumPy or both CuPy"):
        cutopo.grid_sample(cp.asnumpy(image), grid)


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_non_finite_inputs_on_device(dtype):
    cp = _cp()
    image = cp.zeros((2, 3, 4, 5), dtype=dtype)
    grid = cp.zeros((2, 6, 7, 2), dtype=dtype)
    for bad in (np.nan, np.inf, -np.inf):
        g = grid.copy()
        g[1, 5, 6, 1] = bad                       # the last point
        with pytest.raises(ValueError, match="grid must be finite"):
            cutopo.grid_sample(image, g)
        im = image.copy()
        im[1, 2, 3, 4] = bad                      # the last pixel
        with pytest.raises(ValueError, match="image must be finite"):
            cutopo.grid_sample(im, grid)
        with pytest.raises(ValueError, match="grid must be finite"):  # the grid is checked first
            cutopo.grid_sample(im, g)
        with pytest.raises(ValueError, match="grid must be finite"):  # as in a vjp
            cutopo.vjp(cutopo.grid_sample, image, g)
    # a non-finite image is refused even when the output has no points or no channels read it
    im = image.copy()
    im[0, 0, 0, 0] = np.nan
    with pytest.raises(ValueError, match="image must be finite"):
        cutopo.grid_sample(im, grid[:, :0])
    with pytest.raises(ValueError, match="grid must be finite"):
        cutopo.grid_sample(image[:, :0], cp.full((2, 1, 1, 2), np.nan, dtype=dtype))
