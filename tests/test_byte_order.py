"""Arrays stored in the other byte order (big-endian data from FITS, HDF5 or Zarr files) give
the results, dtypes and precision of the same data in native order, on every op (CPU)."""
import numpy as np
import pytest

import cutopo
from cutopo import sampling
from cutopo.cpab import Tessellation, integrate

from deformable_cases import map_layout


def swapped(x):
    """The same values stored in the other byte order."""
    x = np.asarray(x)
    return x.astype(x.dtype.newbyteorder("S"))


def same(got, want):
    assert got.dtype == want.dtype and got.dtype.isnative, (got.dtype, want.dtype)
    np.testing.assert_array_equal(got, want)


@pytest.fixture
def image(rng):
    return rng.random((2, 23, 31)).astype(np.float32)


def test_swapped_helper_changes_storage_only(rng):
    x = rng.random(5)
    assert not swapped(x).dtype.isnative and np.array_equal(swapped(x), x)


@pytest.mark.parametrize("dtype", ["uint16", "int16", "int32", "float16", "float32", "float64"])
def test_ecc_and_contributions(rng, dtype):
    img = (rng.random((19, 27)) * 100).astype(dtype)
    t = np.linspace(0, 100, 17)
    same(cutopo.ecc(swapped(img), swapped(t)), cutopo.ecc(img, t))
    same(cutopo.ecc(swapped(img), 9), cutopo.ecc(img, 9))
    same(cutopo.euler_contributions(swapped(img)), cutopo.euler_contributions(img))
    same(cutopo.linear_thresholds(swapped(img), 5), cutopo.linear_thresholds(img, 5))


def test_soft_ecc_keeps_float64_thresholds_and_scale(image):
    """'>f8' thresholds or a '>f8' scale make the computation float64, as native float64 does
    (they used to compare unequal to float64 and compute in float32)."""
    t = np.linspace(0, 1, 12)
    want = cutopo.soft_ecc(image, t, 8.0, ndim=2)
    assert want.dtype == np.float64
    same(cutopo.soft_ecc(swapped(image), swapped(t), 8.0, ndim=2), want)
    t32 = t.astype(np.float32)
    want = cutopo.soft_ecc(image, t32, np.array(8.0), ndim=2)
    assert want.dtype == np.float64
    same(cutopo.soft_ecc(image, t32, swapped(np.array(8.0)), ndim=2), want)
    out, pullback = cutopo.vjp(cutopo.soft_ecc, swapped(image), swapped(t), 8.0, ndim=2)
    g = np.ones_like(out)
    d_want = cutopo.vjp(cutopo.soft_ecc, image, t, 8.0, ndim=2)[1](g)
    for got, want in zip(pullback(g), d_want):
        np.testing.assert_array_equal(got, want)


def test_ect_and_soft_ect(image):
    mask = image[0] > 0.5
    dirs = np.array([[1.0, 0.0], [0.6, 0.8], [-0.8, 0.6]])
    t = np.linspace(-1, 1, 9)
    same(cutopo.ect(swapped(mask.astype(np.uint16)), swapped(dirs), swapped(t)), cutopo.ect(mask, dirs, t))
    want = cutopo.soft_ect(mask, dirs, t, 5.0)
    assert want.dtype == np.float64
    same(cutopo.soft_ect(mask, swapped(dirs), swapped(t), 5.0), want)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_expected_euler(image, dtype):
    p = image.astype(dtype)
    same(cutopo.expected_euler(swapped(p), ndim=2), cutopo.expected_euler(p, ndim=2))


def test_grid_sample(rng):
    x = rng.standard_normal((1, 2, 9, 8))
    grid = rng.uniform(-1.1, 1.1, (1, 5, 6, 2))
    want = sampling.grid_sample(x, grid)
    assert want.dtype == np.float64
    same(sampling.grid_sample(swapped(x), swapped(grid)), want)


def test_deformable_aggregation(rng):
    shapes, starts, rows = map_layout([(5, 7), (3, 4)], 2)
    feats = rng.standard_normal((1, rows, 8))
    loc = rng.uniform(-0.1, 1.1, (1, 3, 4, 2, 2))
    w = rng.standard_normal((1, 3, 4, 2, 2, 2))
    want = cutopo.deformable_aggregation(feats, shapes, starts, loc, w)
    got = cutopo.deformable_aggregation(swapped(feats), swapped(shapes), swapped(starts),
                                        swapped(loc), swapped(w))
    same(got, want)


def test_cpab_integrate(rng):
    tess = Tessellation((3, 2))
    theta = tess.sample(2, rng=1)
    points = rng.random((20, 2))
    same(integrate(swapped(points), swapped(theta), tess), integrate(points, theta, tess))
    p32, t32 = points.astype(np.float32), theta.astype(np.float32)
    same(integrate(swapped(p32), swapped(t32), tess), integrate(p32, t32, tess))


def test_streamed_big_endian_memmap(tmp_path, rng):
    """A big-endian volume on disk (a FITS cube, say) streamed in slabs equals the in-memory
    result; the ECT of a big-endian mask too."""
    vol = rng.random((24, 17, 13)).astype(np.float32)
    path = tmp_path / "cube.dat"
    mm = np.memmap(path, dtype=">f4", mode="w+", shape=vol.shape)
    mm[:] = vol
    mm.flush()
    src = np.memmap(path, dtype=">f4", mode="r", shape=vol.shape)
    t = np.linspace(0, 1, 11, dtype=np.float32)
    want = cutopo.ecc(vol, t)
    same(cutopo.ecc(src, t, max_slab_bytes=4 * 17 * 13 * 5), want)
    same(cutopo.ecc(src, 7, max_slab_bytes=4 * 17 * 13 * 5), cutopo.ecc(vol, 7))
    dirs = np.array([[1.0, 0.0, 0.0], [0.0, 0.6, 0.8]])
    mask = swapped((vol > 0.4).astype(np.uint16))
    same(cutopo.ect(mask, dirs, np.linspace(-1, 1, 5), max_slab_bytes=48 * 17 * 13 * 6),
         cutopo.ect(vol > 0.4, dirs, np.linspace(-1, 1, 5)))


def test_dask_big_endian_chunks(rng):
    da = pytest.importorskip("dask.array")
    import cutopo.dask as cd

    vol = rng.random((20, 15, 12)).astype(np.float32)
    darr = da.from_array(swapped(vol), chunks=(7, 15, 12))
    t = np.linspace(0, 1, 9, dtype=np.float32)
    same(cd.ecc(darr, t).compute(scheduler="sync"), cutopo.ecc(vol, t))
    dirs = np.array([[1.0, 0.0, 0.0], [0.0, 0.6, 0.8]])
    dmask = da.from_array(swapped((vol > 0.5).astype(np.uint16)), chunks=(7, 15, 12))
    same(cd.ect(dmask, dirs, np.linspace(-1, 1, 5)).compute(scheduler="sync"),
         cutopo.ect(vol > 0.5, dirs, np.linspace(-1, 1, 5)))
