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
    # The bound of the docstring: the slab (input + keys) plus about 8 MiB of sub-slab temporaries.
    assert max(peaks) <= slab + (10 << 20), peaks
    assert peaks[1] <= 1.25 * peaks[0] + (1 << 20)


def traced_peak(fn):
    """(result, peak traced host bytes) of fn(); what the first call imports is not counted."""
    tracemalloc.start()
    try:
        out = fn()
        return out, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def random_memmap(tmp_path, shape, name, make):
    """A memmap filled plane by plane (no whole-volume temporary)."""
    mm = np.memmap(tmp_path / name, dtype=make(shape[1:]).dtype, mode="w+", shape=shape)
    for z in range(shape[0]):
        mm[z] = make(shape[1:])
    mm.flush()
    return np.memmap(tmp_path / name, dtype=mm.dtype, mode="r", shape=shape)


def test_ecc_memory_bound_with_large_planes(tmp_path, rng):
    """Planes of 2^20 pixels (8 tiles each): the input plus keys within S, the temporaries within
    the documented 8 MiB (the input, a memmap, is not traced). A sub-slab of one whole plane
    took about 60 bytes per pixel: 68 MiB for S = 16 MiB."""
    mm = random_memmap(tmp_path, (8, 1024, 1024), "big.u8",
                       lambda s: rng.integers(0, 4, s, dtype=np.uint8))
    t = [0, 1, 2, 3]
    cutopo.ecc(mm[:4, :8, :8], t, max_slab_bytes=1 << 20)  # imports, first-call caches
    slab = 16 << 20
    for kw in ({}, {"connectivity": 3, "boundary": "periodic"}):
        got, peak = traced_peak(lambda: cutopo.ecc(mm, t, max_slab_bytes=slab, **kw))
        assert peak <= slab + (8 << 20), (kw, peak / 2**20)
        np.testing.assert_array_equal(got, cutopo.ecc(np.asarray(mm), t, **kw))


def test_ect_memory_bound_with_large_planes(tmp_path, rng):
    """The ECT's contribution passes scale with S (they took up to 2^21 elements, about 100 MiB,
    whatever S): the traced peak stays within S."""
    mm = random_memmap(tmp_path, (5, 512, 512), "big.b1", lambda s: rng.random(s) < 0.5)
    dirs = rng.normal(size=(6, 3))
    cutopo.ect(mm[:3, :8, :8], dirs, 5, max_slab_bytes=1 << 20)
    slab = 40 << 20  # 3 planes of 512 x 512 at 48 bytes per pixel: 36 MiB
    for conn in (1, 3):
        _, peak = traced_peak(lambda: cutopo.ect(mm, dirs, 16, connectivity=conn,
                                                 max_slab_bytes=slab))
        assert peak <= slab, (conn, peak / 2**20)


def tied_across_rows(rng, shape, ndim, nan=0.1):
    """Few levels; every row equal to the one before it in half the places (ties between the
    rows of a plane, which tiles split), NaN pixels."""
    img = rng.integers(0, 3, size=shape).astype(np.float32)
    axis = len(shape) - ndim + (1 if ndim == 3 else 0)  # the rows of a plane (2D: the plane)
    same = rng.random(shape) < 0.5
    prev = np.roll(img, 1, axis=axis)
    img = np.where(same, prev, img)
    img[rng.random(shape) < nan] = np.nan
    return img


@pytest.mark.parametrize("ndim,shape", [(3, (9, 8, 7)), (3, (2, 6, 5, 9)), (2, (13, 11)),
                                        (2, (3, 7, 12))])
@pytest.mark.parametrize("periodic", [False, True])
def test_planes_split_in_tiles_equal_in_memory(tmp_path, monkeypatch, rng, ndim, shape, periodic):
    """Tiles smaller than a plane or a row (the ranges split planes, rows, pixels of a row, and
    the images of a batch) give the in-memory ECC exactly: ties across the split rows, NaN, both
    connectivities, the torus, batches; slabs of one plane and whole images."""
    img = tied_across_rows(rng, shape, ndim)
    mm = memmap_of(tmp_path, img)
    t = np.array([0.0, 1.0, 2.0])
    boundary = "periodic" if periodic else "box"
    plane = plane_bytes(shape, ndim, img.itemsize + 2)
    for conn in (1, ndim):
        want = cutopo.ecc(img, t, ndim=ndim, connectivity=conn, boundary=boundary)
        for step in (1, 5, 17, 64, 300):
            monkeypatch.setattr(_stream, "CPU_STEP_ELEMENTS", step)
            for slab in ((6 if periodic else 3) * plane, 1 << 20):
                got = cutopo.ecc(mm, t, ndim=ndim, connectivity=conn, boundary=boundary,
                                 max_slab_bytes=slab)
                np.testing.assert_array_equal(got, want, err_msg=f"step={step} slab={slab}")


@pytest.mark.parametrize("ndim", [2, 3])
def test_owned_histograms_of_a_partition_add_up(rng, ndim):
    """owned_histogram with arbitrary per-axis masks (as Dask's seams give) and tiles smaller
    than a row: the histograms of the 2^ndim products of each mask and its complement add up to
    the whole image's."""
    from cutopo import _ecc_numpy

    shape = (2,) + ((12, 10) if ndim == 2 else (7, 6, 9))
    img = tied_across_rows(rng, shape, ndim, nan=0.05)
    t = np.array([0.0, 1.0, 2.0], dtype=np.float32)
    masks = [rng.random(n) < 0.5 for n in shape[1:]]
    for tconn in (False, True):
        whole = _ecc_numpy.owned_histogram(img, t, ndim, tconn)
        assert (np.cumsum(whole, axis=1) == cutopo.ecc(img, t, ndim=ndim,
                                                      connectivity=ndim if tconn else 1)).all()
        for step in (1, 4, 23):
            total = sum(_ecc_numpy.owned_histogram(
                img, t, ndim, tconn, [m if keep else ~m for m, keep in zip(masks, signs)],
                step_elements=step) for signs in np.ndindex(*(2,) * ndim))
            np.testing.assert_array_equal(total, whole, err_msg=f"step={step}")


def test_threshold_count_needs_no_larger_slab(tmp_path, rng):
    """float64: explicit thresholds need 3 planes of 8 + 2 bytes per voxel; the count's min/max
    pass used to plan 16 bytes per voxel and refused that bound."""
    img = tied_image(rng, (9, 12, 10), dtype="float64", nan=0.1)
    img[4, 3, 2] = -7.5  # the extremes in an owned plane of a middle slab
    img[6, 0, 9] = 11.25
    mm = memmap_of(tmp_path, img)
    slab = 3 * plane_bytes(img.shape, 3, img.itemsize + 2)
    t = np.linspace(0, 3, 4)
    np.testing.assert_array_equal(cutopo.ecc(mm, t, max_slab_bytes=slab), cutopo.ecc(img, t))
    for conn in (1, 3):
        np.testing.assert_array_equal(cutopo.ecc(mm, 7, connectivity=conn, max_slab_bytes=slab),
                                      cutopo.ecc(img, 7, connectivity=conn))
    src = _stream.check_source(mm, None)
    assert _stream.stream_min_max(src, slab) == (-7.5, 11.25)
    with pytest.raises(ValueError, match="too small"):
        cutopo.ecc(mm, 7, max_slab_bytes=slab - 1)


@pytest.mark.parametrize("ndim,shape", [(3, (9, 6, 5)), (2, (3, 14, 9))])
@pytest.mark.parametrize("periodic", [False, True])
def test_ect_small_passes_equal_in_memory(tmp_path, monkeypatch, rng, ndim, shape, periodic):
    """Contribution passes of a few elements (one direction, entries split within a
    direction) give the in-memory ECT exactly."""
    mask = rng.random(shape) < 0.55
    mm = memmap_of(tmp_path, mask)
    dirs = np.concatenate([np.eye(ndim)[:1], rng.normal(size=(3, ndim))])
    boundary = "periodic" if periodic else "box"
    slab = 4 * plane_bytes(shape, ndim, _stream.ECT_CPU_BYTES_PER_PIXEL)
    for conn in (1, ndim):
        want = cutopo.ect(mask, dirs, 9, connectivity=conn, boundary=boundary)
        for per_element in (slab // 7, slab // 100):
            monkeypatch.setattr(_stream, "ECT_CPU_PASS_BYTES", per_element)
            got = cutopo.ect(mm, dirs, 9, connectivity=conn, boundary=boundary, max_slab_bytes=slab)
            np.testing.assert_array_equal(got, want)


def test_gpu_ect_passes_scale_with_the_slab(tmp_path, monkeypatch, rng):
    """The streamed ECT hands the GPU a pass bound of S / ECT_GPU_PASS_BYTES elements, which
    direction_groups honours (one direction at least). CPU stand-ins for CuPy and the kernels;
    tests/test_stream_gpu.py::test_streamed_ect_on_the_gpu and
    ::test_streamed_periodic_ect_on_the_gpu run the real ones."""
    import types

    from cutopo import _band_cupy, _ect

    mask = rng.random((12, 9, 8)) < 0.5
    mm = memmap_of(tmp_path, mask)
    dirs = rng.normal(size=(7, 3))
    slab = 4 * plane_bytes(mask.shape, 3, _stream.ECT_GPU_BYTES_PER_PIXEL)
    seen = []

    def forward(block, dirs64, coords, t, tconn, soft, own=None, general=False,
                pass_elements=None):
        per = math.prod(block.shape)
        groups = _band_cupy.direction_groups(block, len(dirs64), True, pass_elements)
        assert all((d1 - d0) * per <= max(pass_elements, per) for d0, d1 in groups)
        seen.append((pass_elements, len(groups)))
        out = _ect.curves(np.asarray(block), dirs64, coords, t, tconn, own, general=general)
        return types.SimpleNamespace(get=lambda: out), None

    install_fake_device(monkeypatch, False)
    monkeypatch.setattr(_band_cupy, "ect_forward", forward)
    got = _stream.ect(mm, dirs, 9, 3, "box", "cuda", slab)
    np.testing.assert_array_equal(got, cutopo.ect(mask, dirs, 9, connectivity=3))
    assert {p for p, _ in seen} == {slab // _stream.ECT_GPU_PASS_BYTES}
    assert max(n for _, n in seen) > 1  # the directions were split
    assert _band_cupy.direction_groups(np.zeros((2, 10, 10)), 16, True) == [(0, 16)]
    assert _band_cupy.direction_groups(np.zeros((2, 10, 10)), 5, True, 450) == [
        (0, 2), (2, 4), (4, 5)]
    assert _band_cupy.direction_groups(np.zeros((2, 10, 10)), 3, True, 1) == [
        (0, 1), (1, 2), (2, 3)]


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
# The GPU pipeline's plan and its page-locking of pageable sources, without a GPU


def test_slab_rows_ramp():
    for n0, rows in [(1024, 126), (700, 50), (37, 5), (1000, 999)]:
        z = _stream.slab_rows(n0, rows, _stream.RAMP)
        sizes = np.diff(z)
        assert z[0] == 0 and z[-1] == n0 and sizes.min() >= 1 and sizes.max() <= rows
        if n0 >= 2 * sum(max(1, rows // d) for d in _stream.RAMP) + rows:
            head = [max(1, rows // d) for d in _stream.RAMP]
            assert list(sizes[:3]) == head and list(sizes[-3:]) == head[::-1]
    assert _stream.slab_rows(10, 3) == [0, 3, 6, 9, 10]
    assert _stream.slab_rows(20, 8, _stream.RAMP) == [0, 8, 16, 20]  # too short for a ramp


@pytest.mark.parametrize("shape,ndim", [((300, 6, 5), 3), ((2, 90, 7), 2), ((4, 3, 5), 2)])
def test_ramped_pieces_own_every_plane_once(shape, ndim):
    src = _stream.check_source(np.zeros(shape, dtype=np.uint8), ndim)
    plane = math.prod(src.spatial[1:])
    pieces = _stream.plan_pieces(src, 1, 12 * plane, ramp=_stream.RAMP)
    owned = np.zeros((math.prod(src.batch), src.spatial[0]), dtype=int)
    for p in pieces:
        (a, b), = p.ranges
        assert b - a <= 12 and p.own0.size == b - a
        owned[p.f0:p.f1, a:b] += p.own0
    assert (owned == 1).all()


class FakeEvent:
    def __init__(self, done=True):
        self.done = done

    def synchronize(self):
        assert self.done


class Registrar:
    """register/unregister of a fake driver: records calls, checks that ranges are page-aligned,
    disjoint and never registered twice, optionally slow or failing."""

    def __init__(self, delay=0.0, fail=False):
        self.delay, self.fail = delay, fail
        self.live, self.calls, self.released, self.errors = {}, [], [], []
        self.reg = None

    def register(self, ptr, size):
        import time

        page = _stream.mmap.PAGESIZE
        if ptr % page or size % page:
            self.errors.append(("unaligned", ptr, size))
        if ptr >= self.reg.cursor + self.reg.ahead:
            self.errors.append(("beyond the look-ahead", ptr))
        if any(not (ptr + size <= p or p + s <= ptr) for p, s in self.live.items()):
            self.errors.append(("overlap", ptr))
        time.sleep(self.delay)
        if self.fail:
            raise RuntimeError("cudaErrorHostMemoryAlreadyRegistered")
        self.live[ptr] = size
        self.calls.append(ptr)

    def unregister(self, ptr):
        if ptr not in self.live:
            self.errors.append(("unregistered twice", ptr))
        self.released.append(ptr)
        self.live.pop(ptr, None)


def run_pipeline(reg, base, slabs, halo, step_s=0.0):
    """Walk ``slabs`` (byte ranges relative to base, overlapping by ``halo``) like the GPU
    pipeline: direct when ready, else staged; returns the kinds."""
    import time

    kinds = []
    for k, (lo, hi) in enumerate(slabs):
        runs = reg.ready(base + lo, hi - lo)
        if runs is None:
            kinds.append("staged")
        else:
            kinds.append("direct")
            assert runs[0][0] == base + lo and sum(n for _, n in runs) == hi - lo
            for (p, n), (q, _) in zip(runs, runs[1:]):
                assert p + n == q
            for p, n in runs:  # each run lies in one registered chunk
                j = next(j for j in range(len(reg.bounds) - 1) if reg.bounds[j] <= p < reg.bounds[j + 1])
                assert p + n <= reg.bounds[j + 1] and reg.state[j] == _stream._REGISTERED
        nxt = base + (slabs[k + 1][0] if k + 1 < len(slabs) else slabs[-1][1])
        reg.advance(nxt, FakeEvent())
        time.sleep(step_s)
    return kinds


@pytest.mark.parametrize("delay,step_s,fail", [(0.0, 0.01, False), (0.02, 0.0, False),
                                               (0.0, 0.002, True)])
def test_host_registration(delay, step_s, fail):
    page = _stream.mmap.PAGESIZE
    base, nbytes, chunk = 5 * page + 16, 40 * page + 100, 3 * page
    rows = 4 * page
    cuts = list(range(0, nbytes, rows)) + [nbytes]
    slabs = [(max(a - 64, 0), min(b + 64, nbytes)) for a, b in zip(cuts[:-1], cuts[1:])]
    fake = Registrar(delay, fail)
    reg = _stream.HostRegistration(base, nbytes, chunk, 2 * rows, register=fake.register,
                                   unregister=fake.unregister, poll_s=0.001)
    fake.reg = reg
    assert reg.bounds[0] == 5 * page and reg.bounds[-1] >= base + nbytes
    reg.start()
    kinds = run_pipeline(reg, base, slabs, 64, step_s)
    reg.close()
    assert not reg.thread.is_alive() and not fake.errors
    assert not fake.live and sorted(fake.released) == sorted(fake.calls)  # all released once
    if fail:
        assert set(kinds) == {"staged"} and reg.failures == reg.max_failures and not fake.calls
    elif delay == 0.0:
        assert kinds.count("direct") >= len(slabs) // 2  # the thread keeps ahead
    else:  # slow registration: the pipeline does not wait for it
        assert "staged" in kinds


def test_host_registration_waits_for_copies():
    """Chunks are released only after the copies that read them are done."""
    import time

    page = _stream.mmap.PAGESIZE
    fake = Registrar()
    reg = _stream.HostRegistration(0, 8 * page, page, 8 * page, register=fake.register,
                                   unregister=fake.unregister, poll_s=0.001)
    fake.reg = reg
    reg.start()
    deadline = time.time() + 5
    while reg.ready(0, 8 * page) is None and time.time() < deadline:
        time.sleep(0.001)
    assert reg.ready(0, 8 * page) is not None
    event = FakeEvent(done=False)
    reg.advance(4 * page, event)
    time.sleep(0.02)
    assert not fake.released  # the copy is still in flight
    event.done = True
    while len(fake.released) < 4 and time.time() < deadline:
        time.sleep(0.001)
    assert sorted(fake.released) == [0, page, 2 * page, 3 * page]
    assert reg.ready(4 * page, 4 * page) is not None
    reg.close()
    assert not fake.live and not fake.errors


def test_piece_offsets_match_the_views(rng):
    img = np.zeros((2, 3, 40, 6, 5), dtype=np.float32)
    for max_rows in (4, 40 * 3):  # slabs of images, and groups of whole images
        src = _stream.check_source(img, 3)
        for p in _stream.plan_pieces(src, 4, max_rows * 30 * 4, ramp=_stream.RAMP):
            (a, b), = p.ranges
            view = img[_stream._index(src, p, a, b)]
            assert view.ctypes.data == img.ctypes.data + _stream._piece_offset(src, p)
            assert view.nbytes == math.prod(_stream.piece_shape(src, p)) * 4


class FakeDeviceArray(np.ndarray):
    """A host array that answers what the pipeline asks of a CuPy array."""

    @property
    def data(self):
        import types

        return types.SimpleNamespace(ptr=self.ctypes.data)

    def get(self, stream=None):
        return np.array(self)


def fake_cupy(log):
    """Enough of CuPy for cutopo._stream._gpu_pipeline and _device_slabs, on the host: copies
    are memmoves done at once, events always done, kernels are owned_histogram (see test
    below)."""
    import ctypes
    import types

    class Context:  # a stream or device: a context manager that changes nothing
        def __init__(self, *args, **kwargs):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def synchronize(self):
            pass

    class Stream(Context):
        ptr = 0

        def record(self):
            return FakeEvent()

        def wait_event(self, event):
            pass

    def memcpy(dst, src, n, kind, stream):
        log.append((src, n))
        ctypes.memmove(dst, src, n)

    def dev(a):
        return np.asarray(a).view(FakeDeviceArray)

    class Device(Context):
        id = 0

    runtime = types.SimpleNamespace(memcpyAsync=memcpy, memcpyHostToDevice=1)
    cuda = types.SimpleNamespace(Stream=Stream, runtime=runtime, Device=Device,
                                 get_current_stream=lambda: Stream())
    class NotADeviceArray:  # nothing on the host is a fake CuPy array
        pass

    cupy = types.SimpleNamespace(cuda=cuda, ndarray=NotADeviceArray,
                                 zeros=lambda *a, **k: dev(np.zeros(*a, **k)),
                                 empty=lambda *a, **k: dev(np.empty(*a, **k)),
                                 asarray=lambda a: dev(np.array(a)),
                                 pad=lambda a, width, mode: dev(np.pad(np.asarray(a), width, mode=mode)))
    cupyx = types.SimpleNamespace(empty_pinned=lambda *a, **k: np.empty(*a, **k))
    return cupy, cupyx


class FakePlan:
    def __init__(self, t, ndim, tconn):
        self.t, self.ndim, self.tconn = t, ndim, tconn

    def add_masked(self, x, hist, *masks):
        from cutopo import _ecc_numpy

        own = [np.asarray(m, dtype=bool) for m in masks][3 - self.ndim:]
        hist += _ecc_numpy.owned_histogram(np.asarray(x), self.t, self.ndim, self.tconn, own)


def install_fake_device(monkeypatch, pinned):
    """Put the fake CuPy (and FakePlan as the kernel) in place for _stream's GPU pipeline;
    ``pinned``: whether the source counts as page-locked. Returns the copy log."""
    import sys

    from cutopo import _ecc_cupy

    log = []
    cupy, cupyx = fake_cupy(log)
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setitem(sys.modules, "cupyx", cupyx)
    monkeypatch.setattr(_ecc_cupy, "histogram_plan",
                        lambda img, t, ndim, tconn, masked: FakePlan(t, ndim, tconn))
    monkeypatch.setattr(_stream, "pinned_pointer", lambda a: pinned)
    monkeypatch.setattr(_stream, "REGISTER_MIN_BYTES", 0)
    return log


@pytest.mark.parametrize("mode", ["staged", "registered", "mixed", "pinned"])
@pytest.mark.parametrize("dtype,shape,ndim", [("uint8", (150, 9, 8), 3), ("float32", (2, 70, 13), 2),
                                              ("uint8", (5, 6, 7), 3)])
def test_gpu_pipeline_logic_on_a_fake_device(monkeypatch, rng, mode, dtype, shape, ndim):
    """The GPU pipeline's bookkeeping (ramped slabs, staged and direct copies mixed, byte
    offsets, copies cut at registration chunks, owned planes) with a fake CuPy whose copies are
    memmoves and whose kernel is owned_histogram: the exact in-memory result."""
    log = install_fake_device(monkeypatch, mode == "pinned")
    page = _stream.mmap.PAGESIZE
    monkeypatch.setattr(_stream, "REGISTER_CHUNK_BYTES", page)
    registered = []

    def registration(array, ahead):
        flaky = iter(rng.random(10 ** 6) < (0.5 if mode == "mixed" else 0.0))

        def register(ptr, size):
            if next(flaky):
                raise RuntimeError("refused")
            registered.append(size)

        reg = _stream.HostRegistration(array.ctypes.data, array.nbytes, page, ahead,
                                       register=register, unregister=lambda ptr: None,
                                       max_failures=10 ** 6, poll_s=0.0005)
        ready = reg.ready

        def wait_then_ready(ptr, nbytes):  # give the thread time to get ahead (or fail)
            import time

            deadline = time.time() + 1
            while time.time() < deadline and any(
                    st in (_stream._PENDING, _stream._BUSY) for st in
                    reg.state[bisect_lo(reg, ptr):bisect_lo(reg, ptr + nbytes - 1) + 1]):
                time.sleep(0.0005)
            return ready(ptr, nbytes)

        reg.ready = wait_then_ready
        return reg

    monkeypatch.setattr(_stream, "_cuda_registration", registration)
    monkeypatch.setattr(_stream, "HOST_REGISTER", mode != "staged")
    from cutopo._checks import check_thresholds

    img = tied_image(rng, shape, dtype=dtype, levels=6)
    t, _ = check_thresholds(np.arange(6).astype(dtype), np.empty(0, dtype=img.dtype))
    src = _stream.check_source(img, ndim)
    plane = plane_bytes(shape, ndim, img.itemsize)
    for slab in (3 * plane, 11 * plane, 1 << 20):
        got = _stream.ecc(src, t, True, False, "cuda", slab)  # cutopo.ecc(img, device="cuda")
        np.testing.assert_array_equal(got, cutopo.ecc(img, t, ndim=ndim, connectivity=ndim))
    assert sum(n for _, n in log) >= 3 * img.nbytes  # every slab was copied
    direct = [n for p, n in log if img.ctypes.data <= p < img.ctypes.data + img.nbytes]
    if mode == "registered":
        assert registered and len(direct) > 3
    stats = _stream.last_pipeline
    assert stats["direct"] + stats["staged"] == stats["slabs"]
    if mode == "pinned":
        assert sum(direct) == sum(n for _, n in log) and stats["staged"] == 0
    if mode == "staged":
        assert not direct and stats["direct"] == 0


@pytest.mark.parametrize("boundary", ["box", "periodic"])
@pytest.mark.parametrize("dtype,shape", [(bool, (13, 9, 8)), (np.uint8, (3, 11, 10))])
def test_gpu_ect_slab_pipeline_on_a_fake_device(tmp_path, monkeypatch, rng, boundary, dtype,
                                                shape):
    """The streamed ECT's GPU slab pipeline (_device_slabs: a reader thread, two pinned and two
    device buffers used in turn) with the fake CuPy and _ect.curves as the kernel: every slab
    copied once, the exact in-memory ECT; tests/test_stream_gpu.py runs the real one."""
    import types

    from cutopo import _band_cupy, _ect

    log = install_fake_device(monkeypatch, False)
    ndim = 3 if len(shape) == 3 and dtype is bool else 2
    mask = rng.random(shape) < 0.5
    mask = mask if dtype is bool else mask.astype(dtype) * dtype(7)
    mm = memmap_of(tmp_path, mask)
    dirs = rng.normal(size=(5, ndim))
    buffers = set()

    def forward(block, dirs64, coords, t, tconn, soft, own=None, general=False,
                pass_elements=None):
        buffers.add(np.asarray(block).__array_interface__["data"][0])
        out = _ect.curves(np.asarray(block), dirs64, coords, t, tconn,
                          [np.asarray(o, dtype=bool) for o in own], general=general)
        return types.SimpleNamespace(get=lambda: out), None

    monkeypatch.setattr(_band_cupy, "ect_forward", forward)
    slab = 3 * plane_bytes(shape, ndim, _stream.ECT_GPU_BYTES_PER_PIXEL)
    got = _stream.ect(mm, dirs, 7, 1, boundary, "cuda", slab)
    np.testing.assert_array_equal(got, cutopo.ect(mask != 0, dirs, 7, boundary=boundary))
    pieces = _stream.plan_pieces(_stream.check_source(mm, ndim, mask=True),
                                 _stream.ECT_GPU_BYTES_PER_PIXEL, slab, boundary == "periodic")
    assert len(pieces) > 2 and len(log) == len(pieces)
    assert [n for _, n in log] == [math.prod(_stream.piece_shape(
        _stream.check_source(mm, ndim, mask=True), p)) * mask.itemsize for p in pieces]
    assert len({p for p, _ in log}) == 2  # two pinned buffers, in turn
    if boundary == "box" and dtype is bool:
        assert len(buffers) == 2          # the kernel read the two device buffers in turn


def test_gpu_ect_slab_reader_is_closed_when_a_slab_fails(tmp_path, monkeypatch, rng):
    """A kernel error mid-stream closes the slab reader at once (its thread ends, the error is
    the kernel's), not when the traceback is dropped."""
    import threading
    import types

    from cutopo import _band_cupy

    install_fake_device(monkeypatch, False)
    mask = rng.random((12, 9, 8)) < 0.5
    mm = memmap_of(tmp_path, mask)
    calls = []

    def forward(block, dirs64, coords, t, *args, **kwargs):
        calls.append(block.shape)
        if len(calls) == 2:
            raise RuntimeError("kernel failed")
        out = np.zeros((block.shape[0], len(dirs64), t.size), dtype=np.int64)
        return types.SimpleNamespace(get=lambda: out), None

    monkeypatch.setattr(_band_cupy, "ect_forward", forward)
    before = threading.active_count()
    try:
        _stream.ect(mm, rng.normal(size=(3, 3)), 4, 1, "box", "cuda",
                    3 * plane_bytes(mask.shape, 3, _stream.ECT_GPU_BYTES_PER_PIXEL))
    except RuntimeError as exc:  # asserted while the traceback (and ect's frame) is alive
        assert str(exc) == "kernel failed" and len(calls) == 2
        assert threading.active_count() == before  # the reader's thread has ended
    else:
        raise AssertionError("the kernel's error was not raised")


@pytest.mark.parametrize("pinned", [False, True])
@pytest.mark.parametrize("dtype,shape,ndim", [("uint8", (40, 9, 8), 3), ("float32", (2, 30, 13), 2),
                                              ("int16", (5, 6, 7), 3)])
def test_gpu_pipeline_periodic_on_a_fake_device(monkeypatch, rng, pinned, dtype, shape, ndim):
    """The torus through the GPU pipeline's bookkeeping: halo planes modulo n0 (two copies per
    wrapped slab when the source is copied directly), each slab padded by wrapping on the
    "device" and counted by the box rule without the pads: the NumPy torus, exactly."""
    log = install_fake_device(monkeypatch, pinned)
    # periodic sources are never page-locked in place
    monkeypatch.setattr(_stream, "_cuda_registration", lambda *a: pytest.fail("registered"))
    from cutopo._checks import check_thresholds

    img = tied_image(rng, shape, dtype=dtype, levels=4)
    img[..., 0, :] = img[..., -1, :]  # ties across a wrap
    t, _ = check_thresholds(np.arange(4).astype(dtype), np.empty(0, dtype=img.dtype))
    src = _stream.check_source(img, ndim)
    plane = plane_bytes(shape, ndim, img.itemsize)
    for conn in (1, ndim):
        want = cutopo.ecc(img, t, ndim=ndim, connectivity=conn, boundary="periodic")
        for slab in (2 * 3 * plane, 2 * 7 * plane, 1 << 20):
            log.clear()
            got = _stream.ecc(src, t, conn != 1, True, "cuda", slab)
            np.testing.assert_array_equal(got, want, err_msg=f"slab {slab}")
            direct = [n for p, n in log if img.ctypes.data <= p < img.ctypes.data + img.nbytes]
            assert bool(direct) == pinned
            assert sum(n for _, n in log) >= img.nbytes
    with pytest.raises(ValueError, match="too small"):
        _stream.ecc(src, t, False, True, "cuda", plane)


def bisect_lo(reg, ptr):
    import bisect

    return bisect.bisect_right(reg.bounds, ptr) - 1


def test_registrable(monkeypatch):
    big = np.zeros(_stream.REGISTER_MIN_BYTES, dtype=np.uint8)
    assert not _stream.registrable(big)  # an opt-in: pageable sources are staged by default
    monkeypatch.setattr(_stream, "HOST_REGISTER", True)
    assert not _stream.registrable(np.zeros(10))  # small arrays are staged
    assert _stream.registrable(big) and not _stream.registrable(big[::2])
    assert not _stream.registrable(big.view(np.memmap))


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
        assert main(["ecc", str(tmp_path / "a.npy"), "--scheduler", cluster.scheduler_address,
                     "--range", "0", "4", "--thresholds", "5", "--npy", str(out), "--no-plot",
                     "--quiet", "--device", "cpu", "--boundary", "periodic"]) == 0
    np.testing.assert_array_equal(np.load(out)[0], cutopo.ecc(img, np.linspace(0, 4, 5),
                                                              boundary="periodic"))



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


def test_count_over_a_range_wider_than_float64_streamed(tmp_path):
    image = np.zeros((6, 5, 4))
    image[1, 2, 3], image[4, 0, 0] = -1e308, 1e308
    mm = memmap_of(tmp_path, image)
    np.testing.assert_array_equal(cutopo.ecc(mm, 5), cutopo.ecc(image, 5))
    assert np.isfinite(cutopo.linear_thresholds(image, 5)).all()
