"""CPU tests of the out-of-core path (cutopo._stream): memmaps, Zarr arrays and other array-likes
read in slabs with a one-plane halo give exactly the in-memory ECC and ECT, in bounded memory;
periodic ECT against the torus enumeration oracle (oracles.periodic_ecc_oracle)."""
from __future__ import annotations

import math
import tracemalloc

import numpy as np
import pytest

import cutopo
from cutopo import _stream
from cutopo._ect import _axis_coordinates, _check_thresholds, heights
from oracles import periodic_ecc_oracle


def tied_image(rng, shape, dtype="float32", levels=4, nan=0.0):
    """Few levels (many ties, also across slab faces), optionally NaN pixels."""
    img = rng.integers(0, levels, size=shape).astype(dtype)
    if nan:
        img[rng.random(shape) < nan] = np.nan
    return img


def memmap_of(tmp_path, array, name="vol.dat"):
    mm = np.memmap(tmp_path / name, dtype=array.dtype, mode="w+", shape=array.shape)
    mm[:] = array
    mm.flush()
    return np.memmap(tmp_path / name, dtype=array.dtype, mode="r", shape=array.shape)


def plane_bytes(shape, ndim, per_voxel):
    return math.prod(shape[len(shape) - ndim + 1:]) * per_voxel


class ArrayLike:
    """The minimal protocol a streamed source needs: shape, dtype and slicing."""

    def __init__(self, data):
        self._data = data
        self.shape = data.shape
        self.dtype = data.dtype
        self.reads = 0

    def __getitem__(self, key):
        self.reads += 1
        return self._data[key].copy()


@pytest.mark.parametrize("ndim,shape", [(3, (23, 14, 13)), (2, (90, 31)), (2, (4, 19, 17)),
                                        (3, (2, 9, 8, 7))])
@pytest.mark.parametrize("conn", ["V", "T"])
def test_memmap_streaming_equals_in_memory(tmp_path, rng, ndim, shape, conn):
    connectivity = 1 if conn == "V" else ndim
    img = tied_image(rng, shape, nan=0.05)
    mm = memmap_of(tmp_path, img)
    t = np.array([-1.0, 0.0, 0.5, 1.0, 2.0, 3.0])
    ref = cutopo.ecc(img, t, ndim=ndim, connectivity=connectivity)
    plane = plane_bytes(shape, ndim, img.itemsize + 2)
    # 3 planes per slab (one owned plane: a slab per plane), a few planes, one slab per image.
    for slab in (3 * plane, 7 * plane, 1 << 24):
        got = cutopo.ecc(mm, t, ndim=ndim, connectivity=connectivity, max_slab_bytes=slab)
        assert isinstance(got, np.ndarray) and got.dtype == np.int64
        np.testing.assert_array_equal(got, ref)
    # a count: thresholds from a streamed min/max pass
    np.testing.assert_array_equal(
        cutopo.ecc(mm, 9, ndim=ndim, connectivity=connectivity, max_slab_bytes=4 * plane),
        cutopo.ecc(img, 9, ndim=ndim, connectivity=connectivity))


@pytest.mark.parametrize("dtype", ["bool", "uint8", "uint16", "int16", "int32", "float16", "float64"])
def test_dtypes_and_default_slab(tmp_path, rng, dtype):
    img = rng.integers(0, 3, size=(12, 10, 9)).astype(dtype)
    mm = memmap_of(tmp_path, img)
    t = np.array([0, 1, 2])
    np.testing.assert_array_equal(cutopo.ecc(mm, t), cutopo.ecc(img, t))     # memmaps stream
    np.testing.assert_array_equal(cutopo.ecc(mm, t, connectivity=3), cutopo.ecc(img, t, connectivity=3))


@pytest.mark.parametrize("conn", [1, 3])
def test_periodic_streaming_equals_in_memory(tmp_path, rng, conn):
    img = tied_image(rng, (11, 6, 5), levels=3)
    mm = memmap_of(tmp_path, img)
    t = np.array([0.0, 1.0, 2.0])
    ref = cutopo.ecc(img, t, connectivity=conn, boundary="periodic")
    plane = plane_bytes(img.shape, 3, img.itemsize + 2)
    for slab in (3 * plane, 5 * plane, 1 << 20):
        np.testing.assert_array_equal(
            cutopo.ecc(mm, t, connectivity=conn, boundary="periodic", max_slab_bytes=slab), ref)


def test_in_memory_array_with_max_slab_bytes_streams(rng):
    img = tied_image(rng, (40, 33))
    t = np.linspace(0, 3, 7)
    np.testing.assert_array_equal(cutopo.ecc(img, t, max_slab_bytes=33 * 6 * 4), cutopo.ecc(img, t))


def test_generic_array_like_is_read_in_slabs(rng):
    img = tied_image(rng, (30, 12, 11))
    src = ArrayLike(img)
    t = np.array([0.0, 1.0, 2.0, 3.0])
    got = cutopo.ecc(src, t, connectivity=3, max_slab_bytes=plane_bytes(img.shape, 3, 6) * 6)
    np.testing.assert_array_equal(got, cutopo.ecc(img, t, connectivity=3))
    assert src.reads >= 7  # 30 planes, 4 owned per slab


def test_zarr_source(tmp_path, rng):
    zarr = pytest.importorskip("zarr")
    img = tied_image(rng, (25, 16, 15))
    z = zarr.open_array(str(tmp_path / "vol.zarr"), mode="w", shape=img.shape, chunks=(5, 16, 15),
                        dtype=img.dtype)
    z[:] = img
    t = np.array([0.0, 1.0, 2.0, 3.0])
    for conn in (1, 3):
        got = cutopo.ecc(z, t, connectivity=conn, max_slab_bytes=plane_bytes(img.shape, 3, 6) * 5)
        np.testing.assert_array_equal(got, cutopo.ecc(img, t, connectivity=conn))
    dirs = rng.normal(size=(3, 3))
    mask = zarr.open_array(str(tmp_path / "mask.zarr"), mode="w", shape=img.shape, chunks=(5, 16, 15),
                           dtype=bool)
    mask[:] = img > 1
    np.testing.assert_array_equal(cutopo.ect(mask, dirs, 8, max_slab_bytes=16 * 15 * 48 * 4),
                                  cutopo.ect(img > 1, dirs, 8))


def test_memory_stays_bounded(tmp_path, rng):
    """The traced host allocations of a streamed call do not grow with the volume."""
    slab = 1 << 20
    peaks = []
    for n in (64, 160):  # 1 MiB and 16 MiB of float32
        img = rng.random((n, 64, 64), dtype=np.float32)
        mm = memmap_of(tmp_path, img, f"v{n}.dat")
        del img
        tracemalloc.start()
        cutopo.ecc(mm, np.linspace(0, 1, 64), max_slab_bytes=slab)
        peaks.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()
    # The bound of the docstring: the slab (input + keys) plus about 64 MiB of sub-slab temporaries.
    assert max(peaks) <= slab + (64 << 20)
    assert peaks[1] <= 1.25 * peaks[0] + (1 << 20)


@pytest.mark.parametrize("ndim,shape", [(3, (15, 8, 7)), (2, (50, 12)), (2, (3, 11, 10))])
@pytest.mark.parametrize("conn", ["V", "T"])
def test_ect_streaming_equals_in_memory(tmp_path, rng, ndim, shape, conn):
    connectivity = 1 if conn == "V" else ndim
    mask = rng.random(shape) < 0.55
    mm = memmap_of(tmp_path, mask.astype(np.uint8))
    dirs = rng.normal(size=(4, ndim))
    dirs[0] = 0.0
    dirs[0, 0] = 1.0  # ties: every pixel of a plane at one height, across slab faces
    ref = cutopo.ect(mask, dirs, 11, connectivity=connectivity)
    plane = plane_bytes(shape, ndim, _stream.ECT_CPU_BYTES_PER_PIXEL)
    for slab in (3 * plane, 6 * plane):
        np.testing.assert_array_equal(
            cutopo.ect(mm, dirs, 11, connectivity=connectivity, max_slab_bytes=slab), ref)


# ---------------------------------------------------------------------------------------------
# Periodic ECT: in memory and streamed, against the torus enumeration


@pytest.mark.parametrize("ndim,shape", [(2, (5, 4)), (2, (3, 6)), (3, (3, 4, 3))])
@pytest.mark.parametrize("conn", ["V", "T"])
def test_periodic_ect_matches_enumeration(tmp_path, rng, ndim, shape, conn):
    connectivity = 1 if conn == "V" else ndim
    mask = rng.random(shape) < 0.6
    dirs = np.concatenate([np.eye(ndim), -np.eye(ndim)[:1], rng.normal(size=(2, ndim))])
    got = cutopo.ect(mask, dirs, 9, connectivity=connectivity, boundary="periodic")
    t, _ = _check_thresholds(9, _axis_coordinates(shape), dirs)
    for d, v in enumerate(dirs):
        vals = np.where(mask, heights(shape, v), np.nan)  # NaN: never in a sublevel set
        np.testing.assert_array_equal(got[d], periodic_ecc_oracle(vals, t, connectivity))
    # the last threshold holds every pixel: a full mask gives the torus (chi 0)
    full = cutopo.ect(np.ones(shape, bool), dirs, 5, connectivity=connectivity, boundary="periodic")
    assert (full[:, -1] == 0).all()
    mm = memmap_of(tmp_path, mask)
    np.testing.assert_array_equal(
        cutopo.ect(mm, dirs, 9, connectivity=connectivity, boundary="periodic",
                   max_slab_bytes=plane_bytes(shape, ndim, 48) * 3), got)


def test_periodic_ect_batch_and_validation(rng):
    mask = rng.random((2, 5, 6)) < 0.5
    dirs = [[1.0, 0.3]]
    both = cutopo.ect(mask, dirs, 6, boundary="periodic")
    for b in range(2):
        np.testing.assert_array_equal(both[b], cutopo.ect(mask[b], dirs, 6, boundary="periodic"))
    with pytest.raises(ValueError, match="length >= 3"):
        cutopo.ect(np.ones((2, 5), bool), dirs, 4, boundary="periodic")
    with pytest.raises(ValueError, match="boundary"):
        cutopo.ect(mask, dirs, 4, boundary="torus")


# ---------------------------------------------------------------------------------------------
# Validation


def test_validation(tmp_path, rng):
    img = tied_image(rng, (10, 9, 8))
    mm = memmap_of(tmp_path, img)
    with pytest.raises(ValueError, match="device"):
        cutopo.ecc(mm, 3, device="gpu")
    with pytest.raises(TypeError, match="device"):
        cutopo.ecc(mm, 3, device=0)
    with pytest.raises(TypeError, match="max_slab_bytes"):
        cutopo.ecc(mm, 3, max_slab_bytes=1.5)
    with pytest.raises(ValueError, match="max_slab_bytes"):
        cutopo.ecc(mm, 3, max_slab_bytes=0)
    with pytest.raises(ValueError, match="max_slab_bytes=100 is too small"):
        cutopo.ecc(mm, 3, max_slab_bytes=100)
    with pytest.raises(TypeError, match="image: dtype int64"):
        cutopo.ecc(memmap_of(tmp_path, img.astype(np.int64), "i8.dat"), 3)
    with pytest.raises(ValueError, match="ndim"):
        cutopo.ecc(mm, 3, ndim=4)
    with pytest.raises(ValueError, match="connectivity"):
        cutopo.ecc(mm, 3, connectivity=2)
    with pytest.raises(TypeError, match="mask: dtype float32"):
        cutopo.ect(mm, [[1.0, 0, 0]], 3)
    if not cutopo.gpu_available():
        with pytest.raises(RuntimeError, match="device='cuda'"):
            cutopo.ecc(mm, 3, device="cuda")


def test_route():
    assert _stream.route(np.zeros((3, 3)), None, None, op="ecc") == (False, None, None)
    assert _stream.route(np.zeros((3, 3)), "cpu", None, op="ecc") == (False, None, None)
    assert _stream.route(np.zeros((3, 3)), None, 4096, op="ecc") == (True, "cpu", 4096)
    assert _stream.is_out_of_core(ArrayLike(np.zeros((3, 3))))
    assert not _stream.is_out_of_core([[1, 2], [3, 4]])


# ---------------------------------------------------------------------------------------------
# The command line: stacks read in slabs, and a dask.distributed scheduler


def test_cli_streams_npy_tiff_and_zarr(tmp_path, rng):
    from cutopo.cli import main

    tifffile = pytest.importorskip("tifffile")
    zarr = pytest.importorskip("zarr")
    img = rng.integers(0, 9, size=(20, 30, 40)).astype(np.uint8)
    np.save(tmp_path / "a.npy", img)
    tifffile.imwrite(tmp_path / "b.tif", img, compression="zlib")  # read page by page
    z = zarr.open_array(str(tmp_path / "c.zarr"), mode="w", shape=img.shape, dtype=img.dtype,
                        chunks=(5, 30, 40))
    z[:] = img
    paths = [str(tmp_path / n) for n in ("a.npy", "b.tif", "c.zarr")]
    out = tmp_path / "curves.npy"
    assert main(["ecc", *paths, "--stream", "--range", "0", "8", "--thresholds", "9",
                 "--connectivity", "full", "--npy", str(out), "--no-plot", "--quiet"]) == 0
    want = cutopo.ecc(img, np.linspace(0, 8, 9), connectivity=3)
    np.testing.assert_array_equal(np.load(out), np.stack([want] * 3))
    csv = tmp_path / "per_file.csv"  # a .zarr folder streams without --stream; its own thresholds
    assert main(["ecc", paths[2], "--thresholds", "5", "--csv", str(csv), "--no-plot", "--quiet"]) == 0
    rows = csv.read_text().splitlines()
    assert rows[2].split(",")[4:] == [str(v) for v in cutopo.ecc(img, 5)]


def test_cli_scheduler(tmp_path, rng):
    from cutopo.cli import main

    distributed = pytest.importorskip("distributed")
    pytest.importorskip("dask.array")
    img = rng.integers(0, 5, size=(24, 16, 18)).astype(np.uint16)
    np.save(tmp_path / "a.npy", img)
    out = tmp_path / "c.npy"
    with distributed.LocalCluster(n_workers=1, processes=False, threads_per_worker=2,
                                  dashboard_address=None) as cluster:
        assert main(["ecc", str(tmp_path / "a.npy"), "--scheduler", cluster.scheduler_address,
                     "--range", "0", "4", "--thresholds", "5", "--npy", str(out), "--no-plot",
                     "--quiet", "--device", "cpu"]) == 0
    np.testing.assert_array_equal(np.load(out)[0], cutopo.ecc(img, np.linspace(0, 4, 5)))



def test_cli_scheduler_unreachable(tmp_path, rng, monkeypatch, capsys):
    from cutopo.cli import main

    distributed = pytest.importorskip("distributed")
    pytest.importorskip("dask.array")

    def refuse(address, timeout=None):
        raise OSError(f"Timed out trying to connect to {address}")

    monkeypatch.setattr(distributed, "Client", refuse)
    np.save(tmp_path / "a.npy", rng.integers(0, 5, size=(6, 7, 8)).astype(np.uint8))
    assert main(["ecc", str(tmp_path / "a.npy"), "--scheduler", "tcp://127.0.0.1:1", "--no-plot",
                 "--quiet"]) == 2
    assert "--scheduler tcp://127.0.0.1:1: cannot connect" in capsys.readouterr().err
