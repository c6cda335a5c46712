"""Device arrays past 2^31 and 2^32 elements: the kernels' 64-bit indexing, op by op.

    pytest -m "gpu and slow" tests/test_large_gpu.py   # up to ~120 GB of device memory

Each test first skips, saying why, on a device with less free memory than its peak.

Each input is a large constant background with a few small random blocks, some of them at the
far end of the array (linear indices past 2^31 or 2^32), some across tile and plane boundaries.
The background is chosen so that it adds nothing the blocks do not determine, and blocks are at
least two pixels apart, so the expected values come from the NumPy path (or a closed form) on
each block padded by one background pixel: an oracle that never sees an index past 2^31.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

import cutopo
from cutopo import _ect
from gpu_support import cupy_module, poison_pool

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

CONNECTIVITY = {"V": 1, "T": None}  # T: connectivity = ndim


@pytest.fixture(autouse=True)
def _free_device_memory():
    yield
    cp = cupy_module()
    cp.get_default_memory_pool().free_all_blocks()


def _needs_device_memory(gb):
    """Skip (with the reason) on a device with less free memory than the test's peak: these
    sizes are about indexing, and a smaller card cannot hold them."""
    free, _ = cupy_module().cuda.Device().mem_info
    if free < gb * 1e9:
        pytest.skip(f"needs ~{gb} GB of free device memory, {free / 1e9:.0f} GB free")


def _conn(conn, ndim):
    return CONNECTIVITY[conn] or ndim


def _slices(corner, shape):
    return tuple(slice(c, c + s) for c, s in zip(corner, shape))


def _check_layout(shape, blocks):
    """Every block inside the array and at least two pixels from every other one (so no cell
    touches two blocks, and each block's one-pixel padding sees only background)."""
    for corner, b in blocks:
        assert all(0 <= c and c + s <= n for c, s, n in zip(corner, b.shape, shape)), corner
    for i, (ci, bi) in enumerate(blocks):
        for cj, bj in blocks[i + 1:]:
            apart = any(a0 + an + 2 <= b0 or b0 + bn + 2 <= a0
                        for a0, an, b0, bn in zip(ci, bi.shape, cj, bj.shape))
            assert apart, (ci, cj)


def _volume(cp, shape, dtype, background, blocks):
    _check_layout(shape, blocks)
    vol = cp.full(shape, background, dtype=dtype)
    for corner, b in blocks:
        vol[_slices(corner, b.shape)] = cp.asarray(b)
    return vol


def _padded(b, background):
    return np.pad(b, 1, constant_values=background)


def _past(shape, corner, size, limit):
    """Whether the block's last element lies past linear index ``limit`` (C order)."""
    last = [c + s - 1 for c, s in zip(corner, size)]
    return int(np.ravel_multi_index(last, shape)) >= limit


def _uint8_blocks(rng, corners, size):
    return [(c, rng.integers(0, 255, size).astype(np.uint8)) for c in corners]


# ---------------------------------------------------------------------------------------------
# Exact ECC and the contribution map


SHAPE_3D = (1025, 2048, 2048)  # 4.3e9 voxels: plane 1024 starts at 2^32, plane 512 at 2^31
CORNERS_3D = [(0, 0, 0), (509, 0, 60), (700, 1500, 300), (1019, 1000, 1000), (1019, 2041, 2039)]
SIZE_3D = (6, 7, 9)


@pytest.fixture
def uint8_volume_blocks(rng):
    blocks = _uint8_blocks(rng, CORNERS_3D, SIZE_3D)
    assert _past(SHAPE_3D, CORNERS_3D[-1], SIZE_3D, 2**32)
    assert _past(SHAPE_3D, CORNERS_3D[-2], SIZE_3D, 2**32)
    return blocks


@pytest.mark.parametrize("conn", ["V", "T"])
def test_ecc_of_a_volume_past_2_32_voxels(uint8_volume_blocks, conn):
    """uint8 (1025, 2048, 2048), background 255: below 255 the curve is the sum of the blocks'
    curves, at 255 the whole box (chi = 1)."""
    _needs_device_memory(8)
    cp = cupy_module()
    connectivity = _conn(conn, 3)
    vol = _volume(cp, SHAPE_3D, np.uint8, 255, uint8_volume_blocks)
    t = np.arange(256)
    got = cutopo.ecc(vol, t, connectivity=connectivity).get()
    want = sum(cutopo.ecc(_padded(b, 255), t, connectivity=connectivity)
               for _, b in uint8_volume_blocks)
    want[-1] = 1
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("conn", ["V", "T"])
def test_euler_contributions_of_a_volume_past_2_32_voxels(uint8_volume_blocks, conn):
    """The int8 map (4.3 GB): at every block voxel what the NumPy path gives the padded block
    (its cells are owned by the same voxels: the order (value, index) of the voxels around it is
    the same in both arrays), zero inside the flat background, and chi = 1 in all."""
    _needs_device_memory(12)
    cp = cupy_module()
    connectivity = _conn(conn, 3)
    vol = _volume(cp, SHAPE_3D, np.uint8, 255, uint8_volume_blocks)
    poison_pool(vol.size + (1 << 20))
    c = cutopo.euler_contributions(vol, connectivity=connectivity)
    assert c.dtype == np.int8 and c.shape == SHAPE_3D
    assert int(c.sum(dtype=np.int64)) == 1
    for corner, b in uint8_volume_blocks:
        want = cutopo.euler_contributions(_padded(b, 255), connectivity=connectivity)[1:-1, 1:-1, 1:-1]
        np.testing.assert_array_equal(c[_slices(corner, b.shape)].get(), want)
    assert not bool(c[800:803, 100:120, 1500:1600].any())      # interior of the flat background
    assert not bool(c[1022:1025, 10:20, 1200:1300].any())      # past 2^32


def test_finite_range_past_2_32_elements(rng):
    """linear_thresholds' range kernel over 4.3e9 uint8 voxels and 2.1e9 float32 ones: the
    extremes planted past 2^32 (and past 2^31), where 32-bit indices would wrap."""
    _needs_device_memory(14)
    cp = cupy_module()
    from cutopo import _checks

    vol = cp.full(SHAPE_3D, 100, dtype=np.uint8)
    low, high = 2**32 + int(rng.integers(0, 2**20)), vol.size - 1 - int(rng.integers(0, 100))
    vol.ravel()[low], vol.ravel()[high] = 3, 250
    assert _checks.finite_range(vol) == (3, 250)
    np.testing.assert_array_equal(cutopo.linear_thresholds(vol, 3).get(), [3.0, 126.5, 250.0])
    del vol
    flat = cp.full(2**31 + 1000, 0.5, dtype=np.float32)
    flat[2**31 + 7], flat[-1], flat[5] = -2.5, np.nan, np.inf
    flat[2**31 + 999 - int(rng.integers(0, 500))] = 9.0
    assert _checks.finite_range(flat) == (-2.5, 9.0)


@pytest.mark.parametrize("conn", ["V", "T"])
def test_ecc_of_float32_past_2_31_elements(rng, conn):
    """float32 (1025, 1024, 2048) (8.6 GB; plane 1024 starts at 2^31), background 2 above every
    threshold, blocks in [0, 1) with NaN pixels; float32 thresholds (the bin estimate)."""
    _needs_device_memory(12)
    cp = cupy_module()
    shape, size = (1025, 1024, 2048), (6, 7, 9)
    corners = [(0, 31, 62), (512, 0, 2039), (300, 500, 1000), (1019, 1017, 2039)]
    blocks = [(c, rng.random(size).astype(np.float32)) for c in corners]
    blocks[1][1][rng.random(size) < 0.1] = np.nan
    assert _past(shape, corners[-1], size, 2**31)
    connectivity = _conn(conn, 3)
    vol = _volume(cp, shape, np.float32, 2.0, blocks)
    t = np.linspace(0, 1, 256, dtype=np.float32)
    got = cutopo.ecc(vol, t, connectivity=connectivity).get()
    want = sum(cutopo.ecc(_padded(b, 2.0), t, connectivity=connectivity) for _, b in blocks)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("conn", ["V", "T"])
def test_ecc_of_2d_images_past_2_31_pixels(rng, conn):
    """One (32769, 65536) uint8 image (row 32768 starts at 2^31) and a batch (2049, 1024, 1024)
    (image 2048 starts at 2^31): per image, the sum of its blocks' curves below 255, 1 at 255."""
    _needs_device_memory(6)
    cp = cupy_module()
    connectivity = _conn(conn, 2)
    t = np.arange(256)

    shape, size = (32769, 65536), (4, 9)
    corners = [(0, 0), (16000, 61), (32765, 100), (32765, 65527)]
    assert _past(shape, corners[-1], size, 2**31)
    blocks = _uint8_blocks(rng, corners, size)
    img = _volume(cp, shape, np.uint8, 255, blocks)
    got = cutopo.ecc(img, t, connectivity=connectivity).get()
    want = sum(cutopo.ecc(_padded(b, 255), t, connectivity=connectivity) for _, b in blocks)
    want[-1] = 1
    np.testing.assert_array_equal(got, want)
    del img

    shape, size = (2049, 1024, 1024), (1, 5, 7)
    corners = [(0, 0, 0), (2047, 500, 60), (2048, 30, 200), (2048, 1019, 1017)]
    blocks = _uint8_blocks(rng, corners, size)
    batch = _volume(cp, shape, np.uint8, 255, blocks)
    got = cutopo.ecc(batch, t, ndim=2, connectivity=connectivity).get()
    want = np.zeros((shape[0], t.size), dtype=np.int64)
    for (k, y, x), b in blocks:
        want[k] += cutopo.ecc(_padded(b[0], 255), t, connectivity=connectivity)
    want[:, -1] = 1
    np.testing.assert_array_equal(got, want)


# ---------------------------------------------------------------------------------------------
# Soft ECC and its VJP


def _band_sigmoid(u, band=17.0):
    """sigmoid(u) with the float32 band rule of the soft ops: exactly 0 / 1 once |u| >= 17."""
    s = 1.0 / (1.0 + np.exp(-u))
    return np.where(u >= band, 1.0, np.where(u <= -band, 0.0, s)), np.where(np.abs(u) >= band, 0.0, s * (1 - s))


def test_soft_ecc_and_pullback_past_2_31_pixels(rng):
    """float32 (32769, 65536) image, background 1e4 (saturated at 0 for every threshold), blocks
    in [0, 1): the curve and the cotangents of image, thresholds and scale against their closed
    forms over the blocks' pixels (contributions from the NumPy map of each padded block)."""
    _needs_device_memory(30)
    cp = cupy_module()
    shape, size = (32769, 65536), (4, 9)
    corners = [(0, 0), (16000, 61), (32765, 100), (32765, 65527)]
    blocks = [(c, rng.random(size).astype(np.float32)) for c in corners]
    img = _volume(cp, shape, np.float32, 1e4, blocks)
    t = np.linspace(0, 1, 64, dtype=np.float32)
    lam = 20.0
    g = rng.normal(size=t.size).astype(np.float32)

    curve, pullback = cutopo.vjp(cutopo.soft_ecc, img, t, lam)
    poison_pool(4 * img.size + (1 << 20))
    d_img, d_t, d_scale = pullback(cp.asarray(g))

    want_curve = np.zeros(t.size)
    want_dt = np.zeros(t.size)
    want_dscale = 0.0
    total_abs = 0.0
    for corner, b in blocks:
        c = cutopo.euler_contributions(_padded(b, np.float32(1e4)))[1:-1, 1:-1].astype(np.float64)
        f = b.astype(np.float64)[..., None]
        u = lam * (t.astype(np.float64) - f)
        s, ds = _band_sigmoid(u)
        want_curve += (c[..., None] * s).sum(axis=(0, 1))
        want_dt += g * lam * (c[..., None] * ds).sum(axis=(0, 1))
        want_dscale += float((g * c[..., None] * ds * (t - f)).sum())
        want_di = -lam * (c[..., None] * ds * g).sum(axis=-1)
        got_di = d_img[_slices(corner, b.shape)].get()
        np.testing.assert_allclose(got_di, want_di, rtol=2e-5, atol=1e-4)
        total_abs += float(np.abs(got_di).astype(np.float64).sum())
    np.testing.assert_allclose(curve.get(), want_curve, rtol=1e-5, atol=1e-4)
    assert isinstance(d_t, np.ndarray) and d_t.dtype == np.float32  # like the NumPy thresholds
    np.testing.assert_allclose(d_t, want_dt, rtol=1e-4, atol=1e-3)
    np.testing.assert_allclose(float(cp.asnumpy(d_scale)), want_dscale, rtol=1e-4, atol=1e-5)
    # nothing outside the blocks: the background is saturated
    assert d_img.shape == shape and d_img.dtype == np.float32
    assert float(cp.abs(d_img).sum(dtype=np.float64)) == pytest.approx(total_abs, rel=1e-6)


# ---------------------------------------------------------------------------------------------
# ECT


@pytest.mark.parametrize("conn", ["V", "T"])
def test_ect_of_a_mask_past_2_31_voxels(rng, conn):
    """bool (1025, 2048, 1024) (plane 1024 starts at 2^31), random masks in a few blocks: the ECT
    is the sum over blocks of the ECC of their masked heights (positions of the whole array),
    padded by +inf."""
    _needs_device_memory(30)
    cp = cupy_module()
    shape, size = (1025, 2048, 1024), (6, 7, 9)
    corners = [(0, 0, 0), (511, 1000, 60), (1019, 2041, 1015), (1019, 30, 500)]
    assert _past(shape, corners[-1], size, 2**31)
    blocks = [(c, rng.random(size) < 0.6) for c in corners]
    mask = _volume(cp, shape, np.bool_, False, blocks)
    dirs = np.array([[1.0, 0.0, 0.0], [0.3, -0.5, 0.8], [-0.6, 0.6, -0.5]])
    t = np.linspace(-1.5, 1.5, 33)
    connectivity = _conn(conn, 3)
    got = cutopo.ect(mask, dirs, t, connectivity=connectivity).get()
    coords = _ect._axis_coordinates(shape)
    want = np.zeros((len(dirs), t.size), dtype=np.int64)
    for corner, b in blocks:
        local = [x[s] for x, s in zip(coords, _slices(corner, b.shape))]
        for d, v in enumerate(dirs):
            h = np.where(b, _ect._heights_from_coordinates(local, v), np.inf)
            want[d] += cutopo.ecc(_padded(h, np.inf), t, connectivity=connectivity)
    np.testing.assert_array_equal(got, want)


# ---------------------------------------------------------------------------------------------
# Expected Euler characteristic and its VJP


@pytest.mark.parametrize("conn", ["V", "T"])
def test_expected_euler_and_pullback_past_2_31_pixels(rng, conn):
    """float32 probabilities (32770, 65536), background 0 (never foreground): the expectation is
    the sum of the padded blocks' (NumPy path), and the cotangent over each padded block equals
    the NumPy pullback's (the cells reaching past the padding meet only probability 0)."""
    _needs_device_memory(35)
    cp = cupy_module()
    shape, size = (32770, 65536), (4, 9)  # row 32768 starts at 2^31
    corners = [(1, 1), (16000, 61), (32765, 100), (32765, 65526)]  # one pixel of padding fits
    assert _past(shape, corners[-1], size, 2**31)
    blocks = [(c, rng.random(size).astype(np.float32)) for c in corners]
    prob = _volume(cp, shape, np.float32, 0.0, blocks)
    connectivity = _conn(conn, 2)
    e, pullback = cutopo.vjp(cutopo.expected_euler, prob, connectivity=connectivity)
    poison_pool(4 * prob.size + (1 << 20))
    (d_prob,) = pullback(cp.asarray(np.float32(1.0)))
    want = 0.0
    not_one = 0
    for (y, x), b in blocks:
        padded = _padded(b, np.float32(0.0))
        e_b, pb = cutopo.vjp(cutopo.expected_euler, padded, connectivity=connectivity)
        want += float(e_b)
        (want_d,) = pb(np.float32(1.0))
        got_d = d_prob[y - 1:y + size[0] + 1, x - 1:x + size[1] + 1].get()
        np.testing.assert_allclose(got_d, want_d, rtol=1e-5, atol=1e-6)
        not_one += int(np.count_nonzero(got_d != 1))
    np.testing.assert_allclose(float(e.get()), want, rtol=1e-5, atol=1e-5)
    # A pixel whose neighbours all have probability 0 has cotangent 1 in either construction
    # (V: its vertex alone; T: its square, minus its 4 edges, plus its 4 vertices): elsewhere
    # than around the blocks every entry is 1.
    assert int(cp.count_nonzero(d_prob != 1)) == not_one


# ---------------------------------------------------------------------------------------------
# CPAB


def test_cpab_integrate_and_pullback_past_2_31_points(rng):
    """Batch 33 x 2^26 shared points (2.2e9 trajectories; batch item 32 starts at 2^31): the
    points are M unique ones tiled 2^26 / M times, so every trajectory, log-Jacobian and
    cotangent equals the small call's on the unique points (theta's cotangent: the tiles' sum)."""
    _needs_device_memory(120)
    cp = cupy_module()
    from cutopo.cpab import Tessellation, integrate, log_jacobian

    tess = Tessellation((4, 4))
    B, M, reps = 33, 1024, 2**16
    N = M * reps
    assert B * N > 2**31
    theta = cp.asarray(tess.sample(B, length_scale=0.3, rng=rng).astype(np.float32))
    unique = cp.asarray(rng.uniform(0.01, 0.99, (M, 2)).astype(np.float32))
    points = cp.tile(unique, (reps, 1))
    n_steps = 20

    small = integrate(unique, theta, tess, n_steps=n_steps)
    poison_pool(4 * B * N * 2 + (1 << 20))
    big = integrate(points, theta, tess, n_steps=n_steps)
    assert big.shape == (B, N, 2)
    for b in (0, 31, 32):
        for r in (0, reps // 2, reps - 1):
            np.testing.assert_array_equal(big[b, r * M:(r + 1) * M].get(), small[b].get())
    del big

    np.testing.assert_array_equal(log_jacobian(points, theta, tess, n_steps=n_steps)[32, -M:].get(),
                                  log_jacobian(unique, theta, tess, n_steps=n_steps)[32].get())

    # Device memory of the VJP: the forward's 3 checkpoint copies (53 GB), the cotangent
    # (17.7 GB, read as it is) and m_0 lambda_0 in float64 (35 GB); the output is dropped.
    g_small = cp.asarray(rng.normal(size=(B, M, 2)).astype(np.float32))
    _, pb_small = cutopo.vjp(integrate, unique, theta, tess, n_steps=n_steps)
    d_unique, d_theta_small, _ = pb_small(g_small)
    cp.get_default_memory_pool().free_all_blocks()
    out, pb = cutopo.vjp(integrate, points, theta, tess, n_steps=n_steps)
    del out
    d_points, d_theta, _ = pb(cp.tile(g_small, (1, reps, 1)))
    np.testing.assert_allclose(d_theta.get(), reps * d_theta_small.get().astype(np.float64), rtol=1e-5,
                               atol=1e-6 * reps * float(cp.abs(d_theta_small).max()))
    for r in (0, reps - 1):
        np.testing.assert_allclose(d_points[r * M:(r + 1) * M].get(), d_unique.get(), rtol=1e-5, atol=1e-6)
    assert math.prod(d_points.shape) == N * 2


# ---------------------------------------------------------------------------------------------
# grid_sample and the fused CPAB warp: images that are linear in the pixel coordinates, which
# bilinear interpolation reproduces exactly, so every sample has a closed form


def _linear_volume(cp, shape, slopes):
    """float32 image sum_a slopes[a] * (index along axis a): small integers, exact in float32."""
    out = cp.zeros(shape, dtype=np.float32)
    for a, s in enumerate(slopes):
        idx = cp.arange(shape[a], dtype=np.float32).reshape((-1,) + (1,) * (len(shape) - 1 - a))
        out += np.float32(s) * idx
    return out


def test_grid_sample_of_an_image_past_2_31_pixels(rng):
    """A (1, 1, 1025, 1024, 2048) float32 volume (plane 1024 starts at 2^31) equal to
    3 z + 2 y + x, sampled at random interior points and at points of the last planes: the
    trilinear value is the linear function at the points' pixel coordinates."""
    _needs_device_memory(12)
    cp = cupy_module()
    D, H, W = 1025, 1024, 2048
    image = _linear_volume(cp, (D, H, W), (3, 2, 1)).reshape(1, 1, D, H, W)
    pix = np.stack([rng.uniform(0, n - 1, 4000) for n in (D, H, W)], axis=-1)
    pix[:1000, 0] = rng.uniform(D - 2, D - 1, 1000)                      # past 2^31
    pix[:10] = [D - 1, H - 1, W - 1]                                     # the last pixel
    g = (pix + 0.5) / np.array([D, H, W]) * 2 - 1                        # align_corners=False
    grid = cp.asarray(g[:, ::-1].astype(np.float32).reshape(1, 1, 1, -1, 3))
    # border padding: a point on the last pixel centre may round a hair past it
    got = cutopo.grid_sample(image, grid, padding_mode="border").get().reshape(-1)
    gf = g.astype(np.float32).astype(np.float64)                         # the points as sampled
    at = np.clip((gf + 1) * np.array([D, H, W]) / 2 - 0.5, 0, np.array([D, H, W]) - 1)
    np.testing.assert_allclose(got, at @ np.array([3.0, 2.0, 1.0]), rtol=0, atol=2e-2)


def test_grid_sample_and_grid_cotangent_past_2_31_points(rng):
    """A small linear image sampled at a (1, 32769, 65536, 2) grid (2.15e9 points, row 32768
    starts at 2^31): every output is the linear function of its point, and with a cotangent of
    ones every grid cotangent is the function's slope in normalised coordinates."""
    _needs_device_memory(60)
    cp = cupy_module()
    H, W = 5, 6
    image = _linear_volume(cp, (H, W), (2, 1)).reshape(1, 1, H, W)
    shape = (1, 32769, 65536)
    g = cp.random.default_rng(int(rng.integers(2**63))).uniform(-1 + 1.01 / W, 1 - 1.01 / W,
                                                                 shape + (2,), dtype=cp.float32)
    g[..., 1] *= np.float32((1 - 1.01 / H) / (1 - 1.01 / W))            # y inside as well
    out, pullback = cutopo.vjp(cutopo.grid_sample, image, g, wrt="grid")
    assert out.shape == (1, 1) + shape[1:]
    rows = 4096  # the checks in slabs of rows: float32 temporaries of 1 GiB, not 8.6 GB
    for r in range(0, shape[1], rows):
        gr = g[0, r:r + rows]
        want = ((gr[..., 1] + 1) * np.float32(H / 2) - np.float32(0.5)) * 2 + (
            (gr[..., 0] + 1) * np.float32(W / 2) - np.float32(0.5))
        assert float(cp.abs(out[0, 0, r:r + rows] - want).max()) < 1e-4, r
    del want, out
    _, d_grid = pullback(cp.ones((1, 1) + shape[1:], dtype=np.float32))
    assert d_grid.shape == g.shape
    for r in range(0, shape[1], rows):
        dr = d_grid[0, r:r + rows]
        assert float(cp.abs(dr[..., 0] - W / 2).max()) < 1e-4, r          # d out / d g_x = W / 2
        assert float(cp.abs(dr[..., 1] - 2 * H / 2).max()) < 1e-4, r      # d out / d g_y = 2 H / 2


def test_cpab_transform_image_past_2_31_voxels(rng):
    """The fused warp of a (1, 1, 1025, 1024, 2048) float32 volume 3 i + 2 j + k: at sampled
    voxels (some past 2^31) the output is that function at the pixel coordinates of phi(x) (an
    integrate call on those centres; border padding clamps); the image cotangent of a cotangent
    of ones spreads weight 1 per output voxel (its sum is the voxel count)."""
    _needs_device_memory(45)
    cp = cupy_module()
    from cutopo.cpab import Tessellation, integrate, transform_image

    D, H, W = 1025, 1024, 2048
    n = np.array([D, H, W])
    tess = Tessellation((3, 3, 3))
    theta = cp.asarray(tess.sample(1, length_scale=0.5, rng=rng)[0].astype(np.float32))
    image = _linear_volume(cp, (D, H, W), (3, 2, 1)).reshape(1, 1, D, H, W)
    out, pullback = cutopo.vjp(transform_image, image, theta, tess, n_steps=20)
    vox = np.stack([rng.integers(0, m, 3000) for m in n], axis=-1)
    vox[:1000, 0] = rng.integers(1024, D, 1000)                         # past 2^31
    vox[0] = n - 1
    got = out[0, 0][tuple(cp.asarray(vox.T))].get()
    centres = cp.asarray(((vox + 0.5) / n).astype(np.float32))
    phi = integrate(centres, theta, tess, n_steps=20).get().astype(np.float64)
    at = np.clip(phi * n - 0.5, 0, n - 1)
    np.testing.assert_allclose(got, at @ np.array([3.0, 2.0, 1.0]), rtol=0, atol=2e-2)
    del out
    d_image, d_theta, _ = pullback(cp.ones((1, 1, D, H, W), dtype=np.float32))
    assert d_image.shape == image.shape
    assert float(d_image.sum(dtype=np.float64)) == pytest.approx(D * H * W, rel=1e-6)
    assert bool(cp.isfinite(d_theta).all())
