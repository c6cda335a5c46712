"""GPU tests of the out-of-core path and of cutopo.dask with CuPy chunks: every result must equal
the in-memory one exactly (integers).

    pytest -m gpu tests/test_stream_gpu.py                 # all but the 8 GiB volume
    pytest -m "gpu and slow" tests/test_stream_gpu.py      # the 2048^3 uint8 (8 GiB) volume alone

The 8 GiB case needs about 17 GiB of host memory and 10 GiB of device memory.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

import cutopo
from cutopo import _ecc_cupy, _ecc_numpy, _stream
from gpu_support import cupy_module

pytestmark = pytest.mark.gpu

DTYPES = ["bool", "uint8", "uint16", "int16", "int32", "float16", "float32", "float64"]


def image_of(rng, shape, dtype, levels=5):
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return rng.random(shape) < 0.5
    img = rng.integers(0, levels, size=shape).astype(dtype)
    if dtype.kind == "f":
        img[rng.random(shape) < 0.02] = np.nan
    return img


def plane_bytes(shape, ndim, itemsize):
    return math.prod(shape[len(shape) - ndim + 1:]) * itemsize


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ndim,shape", [(3, (37, 45, 70)), (2, (300, 130)), (2, (6, 40, 33))])
@pytest.mark.parametrize("conn", ["V", "T"])
def test_streamed_from_host_equals_in_memory(rng, dtype, ndim, shape, conn):
    connectivity = 1 if conn == "V" else ndim
    img = image_of(rng, shape, dtype)
    t = np.array([0, 1, 2, 3]) if dtype != "bool" else np.array([0, 1])
    want = cutopo.ecc(img, t, ndim=ndim, connectivity=connectivity)
    plane = plane_bytes(shape, ndim, img.itemsize)
    for slab in (3 * plane, 8 * plane, 1 << 26):  # a slab per plane, a few planes, whole images
        got = cutopo.ecc(img, t, ndim=ndim, connectivity=connectivity, device="cuda",
                         max_slab_bytes=slab)
        assert isinstance(got, np.ndarray) and got.dtype == np.int64
        np.testing.assert_array_equal(got, want)


def test_memmap_zarr_and_pinned_sources(tmp_path, rng):
    cp = cupy_module()
    import cupyx

    img = image_of(rng, (64, 96, 80), "float32", levels=50)
    t = np.linspace(0, 49, 64).astype(np.float32)
    want = cutopo.ecc(cp.asarray(img), cp.asarray(t)).get()
    mm = np.memmap(tmp_path / "v.f4", dtype=img.dtype, mode="w+", shape=img.shape)
    mm[:] = img
    slab = plane_bytes(img.shape, 3, 4) * 10
    np.testing.assert_array_equal(cutopo.ecc(mm, t, device="cuda", max_slab_bytes=slab), want)
    pinned = cupyx.empty_pinned(img.shape, dtype=img.dtype)
    pinned[:] = img
    assert _stream.pinned_pointer(pinned) and not _stream.pinned_pointer(img)
    np.testing.assert_array_equal(cutopo.ecc(pinned, t, device="cuda", max_slab_bytes=slab), want)
    zarr = pytest.importorskip("zarr")
    z = zarr.open_array(str(tmp_path / "v.zarr"), mode="w", shape=img.shape, chunks=(16, 96, 80),
                        dtype=img.dtype)
    z[:] = img
    np.testing.assert_array_equal(cutopo.ecc(z, t, device="cuda", max_slab_bytes=slab), want)
    np.testing.assert_array_equal(cutopo.ecc(z, 64, device="cuda", max_slab_bytes=slab),
                                  cutopo.ecc(img, 64))


@pytest.mark.parametrize("dtype", ["uint16", "float32", "float64"])
def test_big_endian_sources_stream_through_the_gpu(monkeypatch, tmp_path, rng, dtype):
    """A volume stored big-endian (a FITS cube, a '>f4' Zarr array) is staged and converted on
    the host: its raw bytes never reach the GPU, even from pinned memory or with register-in-
    place switched on, and the curve is the native one's."""
    cp = cupy_module()
    import cupyx

    small_registration(monkeypatch)
    img = image_of(rng, (40, 96, 80), dtype, levels=50)
    t = np.linspace(0, 49, 64)
    want = cutopo.ecc(img, t)
    big = np.dtype(dtype).newbyteorder(">")
    mm = np.memmap(tmp_path / "v.be", dtype=big, mode="w+", shape=img.shape)
    mm[:] = img
    slab = plane_bytes(img.shape, 3, img.itemsize) * 6
    record = RecordRegistrations(monkeypatch)
    pinned = cupyx.empty_pinned(img.shape, dtype=big)
    pinned[:] = img
    assert _stream.pinned_pointer(pinned)
    for source in (mm, np.array(mm), pinned):
        _stream.last_pipeline.clear()
        got = cutopo.ecc(source, t, device="cuda", max_slab_bytes=slab)
        np.testing.assert_array_equal(got, want)
        assert _stream.last_pipeline["direct"] == 0 and not record.made
    np.testing.assert_array_equal(cutopo.ecc(mm, 33, device="cuda", max_slab_bytes=slab),
                                  cutopo.ecc(img, 33))
    dirs = np.array([[1.0, 0.0, 0.0], [0.0, 0.6, 0.8]])
    np.testing.assert_array_equal(
        cutopo.ect((img > 20).astype(">u2"), dirs, np.linspace(-1, 1, 7), device="cuda",
                   max_slab_bytes=48 * 96 * 80 * 6),
        cutopo.ect(img > 20, dirs, np.linspace(-1, 1, 7)))


class RecordRegistrations:
    """Wraps _stream._cuda_registration: keeps every HostRegistration a call makes, and counts
    the slabs that were ready for a direct copy."""

    def __init__(self, monkeypatch, register=None):
        self.made, self.direct = [], 0
        real = _stream._cuda_registration

        def make(array, ahead):
            reg = real(array, ahead)
            if reg is not None:
                if register is not None:
                    reg._register = register
                ready = reg.ready

                def counting(ptr, nbytes):
                    runs = ready(ptr, nbytes)
                    self.direct += runs is not None
                    return runs

                reg.ready = counting
                self.made.append(reg)
            return reg

        monkeypatch.setattr(_stream, "_cuda_registration", make)


def small_registration(monkeypatch):
    """Register-in-place switched on (the opt-in), with thresholds small enough for a few-MiB
    test volume."""
    monkeypatch.setattr(_stream, "HOST_REGISTER", True)
    monkeypatch.setattr(_stream, "REGISTER_MIN_BYTES", 1 << 20)
    monkeypatch.setattr(_stream, "REGISTER_CHUNK_BYTES", 256 << 10)


@pytest.mark.parametrize("dtype", ["uint8", "float32"])
@pytest.mark.parametrize("batch", [(), (3,)])
def test_pageable_source_registered_in_place(monkeypatch, rng, dtype, batch):
    """A pageable NumPy source is page-locked in chunks and its registered slabs are copied
    directly; the result is exact, and nothing stays registered after the call."""
    cp = cupy_module()
    small_registration(monkeypatch)
    rec = RecordRegistrations(monkeypatch)
    img = image_of(rng, batch + (150, 96, 80), dtype, levels=40)
    t = np.arange(0, 40, 3).astype(dtype)
    want = cutopo.ecc(cp.asarray(img), cp.asarray(t), ndim=3).get()
    slab = plane_bytes(img.shape, 3, img.itemsize) * 12
    got = cutopo.ecc(img, t, ndim=3, device="cuda", max_slab_bytes=slab)
    np.testing.assert_array_equal(got, want)
    (reg,) = rec.made
    assert reg.registered_chunks > 0 and rec.direct > 0
    assert _stream._REGISTERED not in reg.state and not reg.thread.is_alive()
    flat = img.reshape(-1).view(np.uint8)
    for offset in (0, img.nbytes // 2, img.nbytes - 1):  # pageable again
        assert not _stream.pinned_pointer(flat[offset:])
    assert _stream.last_pipeline["direct"] == rec.direct > 0
    # the same call staged only, read-only, and with every registration failing: equal
    monkeypatch.setattr(_stream, "HOST_REGISTER", False)
    np.testing.assert_array_equal(cutopo.ecc(img, t, ndim=3, device="cuda", max_slab_bytes=slab), want)
    monkeypatch.setattr(_stream, "HOST_REGISTER", True)
    img.setflags(write=False)
    np.testing.assert_array_equal(cutopo.ecc(img, t, ndim=3, device="cuda", max_slab_bytes=slab), want)

    def refuse(ptr, size):
        raise RuntimeError("refused")

    RecordRegistrations(monkeypatch, register=refuse)
    np.testing.assert_array_equal(cutopo.ecc(img, t, ndim=3, device="cuda", max_slab_bytes=slab), want)
    assert _stream.last_pipeline["direct"] == 0


def test_registration_is_released_as_the_copies_progress(monkeypatch, rng):
    """A long pipeline never holds the whole source page-locked: chunks are registered at most
    REGISTER_AHEAD_SLABS slabs ahead and released behind the copies."""
    cp = cupy_module()
    small_registration(monkeypatch)
    monkeypatch.setattr(_stream, "REGISTER_CHUNK_BYTES", 64 << 10)
    monkeypatch.setattr(_stream, "REGISTER_AHEAD_SLABS", 2)
    peak = [0]

    def register(ptr, size):
        reg = rec.made[-1]
        live = sum(reg.bounds[j + 1] - reg.bounds[j] for j, st in enumerate(reg.state)
                   if st in (_stream._REGISTERED, _stream._BUSY))
        peak[0] = max(peak[0], live)
        cp.cuda.runtime.hostRegister(ptr, size, 1)

    rec = RecordRegistrations(monkeypatch, register=register)
    img = image_of(rng, (2000, 64, 64), "uint8", levels=30)  # 8 MiB in slabs of 40 KiB
    got = cutopo.ecc(img, np.arange(30), device="cuda", max_slab_bytes=64 * 64 * 10)
    np.testing.assert_array_equal(got, cutopo.ecc(cp.asarray(img), cp.asarray(np.arange(30))).get())
    (reg,) = rec.made
    assert rec.direct > 0 and peak[0] < img.nbytes // 2
    assert _stream._REGISTERED not in reg.state


@pytest.mark.parametrize("T", [7, 300, 40000])  # 40000 bins: 32-bit keys, the scalar sweep
@pytest.mark.parametrize("ndim", [2, 3])
@pytest.mark.parametrize("conn", ["V", "T"])
def test_masked_kernel_matches_numpy(rng, T, ndim, conn):
    """ecc_histogram_masked counts exactly the marked pixels, as owned_histogram does."""
    cp = cupy_module()
    tconn = conn == "T"
    shape = (2, 21, 70, 67) if ndim == 3 else (2, 150, 133)
    img = rng.standard_normal(shape).astype(np.float32)
    img[:, 5] = img[:, 4]  # ties across a plane
    t = np.sort(rng.standard_normal(T).astype(np.float32))
    own = [rng.random(n) < 0.7 for n in shape[1:]]
    want = _ecc_numpy.owned_histogram(img, t, ndim, tconn, own)
    hist = cp.zeros((2, T), dtype=np.int64)
    _ecc_cupy.masked_histogram(cp.asarray(img), t, ndim, tconn, own, hist)
    np.testing.assert_array_equal(hist.get(), want)


def test_moderately_large_volume_streams_through_bounded_buffers(rng):
    """512^3 uint8 (128 MiB) in 8 MiB slabs (about 17 slabs) equals the in-memory result."""
    cp = cupy_module()
    g = cp.random.default_rng(7).integers(0, 256, size=(512, 512, 512), dtype=cp.uint8)
    t = np.arange(0, 256, 2)
    for connectivity in (1, 3):
        want = cutopo.ecc(g, cp.asarray(t), connectivity=connectivity).get()
        host = g.get()
        got = cutopo.ecc(host, t, connectivity=connectivity, device="cuda", max_slab_bytes=8 << 20)
        np.testing.assert_array_equal(got, want)


@pytest.mark.slow
def test_2048_cubed_uint8_streamed_from_host():
    """The 8 GiB volume of the issue: streamed from host memory through 512 MiB device buffers;
    the device memory the call takes stays within the bound of the docstring."""
    cp = cupy_module()
    n, slab = 2048, 512 << 20
    pool = cp.get_default_memory_pool()
    g = cp.random.default_rng(11).integers(0, 256, size=(n, n, n), dtype=cp.uint8)
    t = np.arange(256)
    want = cutopo.ecc(g, cp.asarray(t)).get()
    host = np.empty((n, n, n), dtype=np.uint8)
    g.get(out=host)
    del g
    pool.free_all_blocks()
    before = pool.total_bytes()
    got = cutopo.ecc(host, t, device="cuda", max_slab_bytes=slab)
    used = pool.total_bytes() - before  # the pool keeps every block the call allocated
    np.testing.assert_array_equal(got, want)
    assert used <= 2 * slab + (64 << 20), f"{used / 2**20:.0f} MiB of device memory"


@pytest.mark.parametrize("conn", ["V", "T"])
def test_streamed_ect_on_the_gpu(tmp_path, rng, conn):
    mask = rng.random((30, 40, 35)) < 0.6
    dirs = np.concatenate([[[1.0, 0.0, 0.0]], rng.normal(size=(5, 3))])
    connectivity = 1 if conn == "V" else 3
    want = cutopo.ect(mask, dirs, 17, connectivity=connectivity)
    mm = np.memmap(tmp_path / "m.u1", dtype=np.uint8, mode="w+", shape=mask.shape)
    mm[:] = mask
    got = cutopo.ect(mm, dirs, 17, connectivity=connectivity, device="cuda",
                     max_slab_bytes=plane_bytes(mask.shape, 3, _stream.ECT_GPU_BYTES_PER_PIXEL) * 6)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("dtype", ["uint8", "float32", "int16"])
@pytest.mark.parametrize("ndim,shape", [(3, (37, 45, 70)), (2, (300, 130)), (2, (2, 40, 33))])
@pytest.mark.parametrize("conn", ["V", "T"])
def test_streamed_periodic_equals_in_memory(tmp_path, rng, dtype, ndim, shape, conn):
    """The torus streamed through the GPU (halo planes modulo n0, slabs padded on the device)
    equals the NumPy torus exactly: slabs of one plane (the first slab's halo is the last
    plane), of a few planes and of whole images; pageable, memmap and pinned sources."""
    import cupyx

    connectivity = 1 if conn == "V" else ndim
    img = image_of(rng, shape, dtype)
    img[..., 0, :] = img[..., -1, :]  # ties across the wrap of the first axis
    t = np.array([0, 1, 2, 3])
    want = cutopo.ecc(img, t, ndim=ndim, connectivity=connectivity, boundary="periodic")
    plane = plane_bytes(shape, ndim, img.itemsize)
    for slab in (2 * 3 * plane, 2 * 8 * plane, 1 << 26):
        got = cutopo.ecc(img, t, ndim=ndim, connectivity=connectivity, boundary="periodic",
                         device="cuda", max_slab_bytes=slab)
        assert isinstance(got, np.ndarray) and got.dtype == np.int64
        np.testing.assert_array_equal(got, want, err_msg=f"slab {slab}")
    mm = np.memmap(tmp_path / "v.raw", dtype=img.dtype, mode="w+", shape=img.shape)
    mm[:] = img
    pinned = cupyx.empty_pinned(img.shape, dtype=img.dtype)
    pinned[:] = img
    for src in (mm, pinned):
        got = cutopo.ecc(src, t, ndim=ndim, connectivity=connectivity, boundary="periodic",
                         device="cuda", max_slab_bytes=2 * 5 * plane)
        np.testing.assert_array_equal(got, want)
    with pytest.raises(ValueError, match="too small"):
        cutopo.ecc(img, t, ndim=ndim, boundary="periodic", device="cuda", max_slab_bytes=plane)


@pytest.mark.parametrize("conn", ["V", "T"])
def test_streamed_periodic_ect_on_the_gpu(tmp_path, rng, conn):
    """The torus ECT streamed through the GPU equals the NumPy torus (and so the enumeration
    that tests/test_stream.py checks it against)."""
    mask = rng.random((30, 40, 35)) < 0.6
    mask[0] = mask[-1]
    dirs = np.concatenate([[[1.0, 0.0, 0.0]], rng.normal(size=(5, 3))])
    connectivity = 1 if conn == "V" else 3
    want = cutopo.ect(mask, dirs, 17, connectivity=connectivity, boundary="periodic")
    mm = np.memmap(tmp_path / "m.u1", dtype=np.uint8, mode="w+", shape=mask.shape)
    mm[:] = mask
    got = cutopo.ect(mm, dirs, 17, connectivity=connectivity, boundary="periodic", device="cuda",
                     max_slab_bytes=plane_bytes(mask.shape, 3, _stream.ECT_GPU_BYTES_PER_PIXEL) * 6)
    np.testing.assert_array_equal(got, want)


# ---------------------------------------------------------------------------------------------
# cutopo.dask with CuPy chunks on one GPU


@pytest.mark.parametrize("interior", ["plain", "masked"])
@pytest.mark.parametrize("conn", ["V", "T"])
def test_dask_cupy_chunks(monkeypatch, rng, conn, interior):
    cp = cupy_module()
    da = pytest.importorskip("dask.array")
    import cutopo.dask as cd

    monkeypatch.setitem(cd.INTERIOR, "cupy", interior)

    img = image_of(rng, (70, 90, 100), "float32", levels=4)
    img[30] = img[29]  # ties across a chunk face
    g = cp.asarray(img)
    d = da.from_array(g, chunks=((30, 40), (45, 45), 100), asarray=False)
    connectivity = 1 if conn == "V" else 3
    t = np.array([0.0, 1.0, 2.0, 3.0])
    got = cd.ecc(d, t, connectivity=connectivity).compute()
    assert isinstance(got, cp.ndarray)
    np.testing.assert_array_equal(got.get(), cutopo.ecc(img, t, connectivity=connectivity))
    mask = d > 1
    dirs = rng.normal(size=(4, 3))
    gm = cd.ect(mask, dirs, 9, connectivity=connectivity).compute()
    np.testing.assert_array_equal(cp.asnumpy(gm), cutopo.ect(img > 1, dirs, 9, connectivity=connectivity))


@pytest.mark.parametrize("interior", ["plain", "masked"])
@pytest.mark.parametrize("ndim,shape,chunks", [
    (3, (80, 50, 60), ((20, 1, 2, 17, 40), 50, 60)),         # slabs: faces merged into chunks
    (3, (2, 60, 40, 50), (1, (30, 30), 40, 50)),             # a batch of volumes
    (2, (3, 90, 70), (2, 90, (30, 1, 39))),                  # 2D, chunked along the last axis
    (3, (40, 45, 70), ((20, 20), (18, 27), (35, 35))),       # every axis chunked: face tasks
])
@pytest.mark.parametrize("conn", ["V", "T"])
def test_dask_cupy_layouts(monkeypatch, rng, interior, ndim, shape, chunks, conn):
    """Every layout and both ways of counting interiors on the GPU equal the single array."""
    cp = cupy_module()
    da = pytest.importorskip("dask.array")
    import cutopo.dask as cd

    monkeypatch.setitem(cd.INTERIOR, "cupy", interior)
    monkeypatch.setattr(cd, "PLAIN_MIN_LENGTH", 2)  # also two-plane chunks unmasked
    img = image_of(rng, shape, "float32", levels=4)
    connectivity = 1 if conn == "V" else ndim
    t = np.array([0.0, 1.0, 2.0, 3.0])
    g = cp.asarray(img)
    got = cd.ecc(da.from_array(g, chunks=chunks, asarray=False), t, ndim=ndim,
                 connectivity=connectivity).compute()
    assert isinstance(got, cp.ndarray)
    np.testing.assert_array_equal(got.get(), cutopo.ecc(img, t, ndim=ndim, connectivity=connectivity))
    np.testing.assert_array_equal(got.get(), cutopo.ecc(g, t, ndim=ndim, connectivity=connectivity).get())


@pytest.mark.parametrize("interior", ["plain", "masked"])
@pytest.mark.parametrize("conn", ["V", "T"])
def test_dask_cupy_periodic(monkeypatch, rng, conn, interior):
    """boundary="periodic" with CuPy chunks (the wrapped pads are made by dask.array.pad on the
    device): the torus's ECC of the whole array, ties across the wrap included."""
    cp = cupy_module()
    da = pytest.importorskip("dask.array")
    import cutopo.dask as cd

    monkeypatch.setitem(cd.INTERIOR, "cupy", interior)
    monkeypatch.setattr(cd, "PLAIN_MIN_LENGTH", 2)
    img = image_of(rng, (40, 30, 50), "float32", levels=4)
    img[0] = img[-1]                                  # ties across the wrap
    img[:, :, 24] = img[:, :, 25]                     # and across a chunk face
    g = cp.asarray(img)
    d = da.from_array(g, chunks=((1, 19, 20), 30, (25, 25)), asarray=False)
    connectivity = 1 if conn == "V" else 3
    t = np.array([0.0, 1.0, 2.0, 3.0])
    got = cd.ecc(d, t, connectivity=connectivity, boundary="periodic").compute()
    assert isinstance(got, cp.ndarray)
    np.testing.assert_array_equal(got.get(), cutopo.ecc(img, t, connectivity=connectivity,
                                                        boundary="periodic"))
    dirs = rng.normal(size=(4, 3))
    gm = cd.ect(d > 1, dirs, 9, connectivity=connectivity, boundary="periodic").compute()
    assert isinstance(gm, cp.ndarray)
    np.testing.assert_array_equal(gm.get(), cutopo.ect(img > 1, dirs, 9, connectivity=connectivity,
                                                       boundary="periodic"))


@pytest.mark.parametrize("scheduler", ["sync", "threads"])
@pytest.mark.parametrize("side_streams", [0, 4])
def test_dask_side_streams_with_chunks_made_in_the_graph(monkeypatch, rng, scheduler,
                                                          side_streams):
    """Chunks made by CuPy inside the graph (freed, and their memory reused, while the side
    streams may still read them), three times as many chunks as side streams, ties across the
    faces: equal to the single array, with side streams and without."""
    cp = cupy_module()
    da = pytest.importorskip("dask.array")
    import cutopo.dask as cd

    monkeypatch.setattr(cd, "SIDE_STREAMS", side_streams)
    monkeypatch.setattr(cd, "_SIDES", {})
    img = image_of(rng, (96, 64, 80), "float32", levels=5)
    img[8::8] = img[7:-1:8]
    g = cp.asarray(img)
    d = da.from_array(g, chunks=(8, 64, 80), asarray=False).map_blocks(
        lambda b: cp.negative(cp.negative(b)), dtype=g.dtype)
    for connectivity in (1, 3):
        want = cutopo.ecc(img, 11, connectivity=connectivity)
        for _ in range(3):
            got = cd.ecc(d, 11, connectivity=connectivity).compute(scheduler=scheduler)
            np.testing.assert_array_equal(got.get(), want)
    dirs = rng.normal(size=(5, 3))
    got = cd.ect(d > 2, dirs, 7).compute(scheduler=scheduler)
    np.testing.assert_array_equal(got.get(), cutopo.ect(img > 2, dirs, 7))
    assert all(side.keep is None for sides in cd._SIDES.values() for side in sides)


def test_dask_side_streams_on_a_user_stream(rng):
    """Computed on a non-default stream, the result is ready for that stream's next kernel
    (the sum waits for every side stream), and a pending histogram pickles to its values."""
    import pickle

    cp = cupy_module()
    da = pytest.importorskip("dask.array")
    import cutopo.dask as cd

    img = image_of(rng, (80, 70, 60), "uint8", levels=7)
    want = cutopo.ecc(img, np.arange(7))
    with cp.cuda.Stream(non_blocking=True) as stream:
        d = da.from_array(cp.asarray(img), chunks=(10, 70, 60), asarray=False)
        got = cd.ecc(d, np.arange(7)).compute(scheduler="sync")
        copy = got * 1                                # queued on the user stream
        stream.synchronize()
    np.testing.assert_array_equal(copy.get(), want)
    hist = cp.zeros(4, dtype=np.int64)
    with cd._side_stream(cp, hist, None, cd._EccCounter(np.arange(4.0), 3, False)) as task:
        hist += cp.arange(4)
    pending = task.result
    assert isinstance(pending, cd._Pending)
    np.testing.assert_array_equal(cp.asnumpy(pickle.loads(pickle.dumps(pending))), np.arange(4))
    np.testing.assert_array_equal(pending.result().get(), np.arange(4))


def test_dask_cuda_cluster(rng):
    """One worker per GPU (dask_cuda.LocalCUDACluster), CuPy chunks made on the workers."""
    cp = cupy_module()
    dask_cuda = pytest.importorskip("dask_cuda")
    distributed = pytest.importorskip("distributed")
    da = pytest.importorskip("dask.array")
    import cutopo.dask as cd

    img = image_of(rng, (64, 80, 72), "uint8", levels=6)
    t = np.arange(6)
    with dask_cuda.LocalCUDACluster(n_workers=1) as cluster, distributed.Client(cluster) as client:
        d = da.from_array(img, chunks=(20, 40, 72)).map_blocks(cp.asarray)
        got = client.compute(cd.ecc(d, t, connectivity=3)).result()
    np.testing.assert_array_equal(cp.asnumpy(got), cutopo.ecc(img, t, connectivity=3))
