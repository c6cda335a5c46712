"""CPU tests of cutopo.dask: chunked ECC and ECT equal the single-array results exactly (uneven
chunks, ties across chunk faces, batches), under the threaded scheduler and dask.distributed."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

import cutopo

da = pytest.importorskip("dask.array")
import cutopo.dask as cd  # noqa: E402


def tied_across_faces(rng, shape, chunks, ndim, dtype="float32", levels=3):
    """Few levels, and the two planes on either side of every internal chunk boundary equal (so
    the C-order tie-break decides ownership right at the faces)."""
    img = rng.integers(0, levels, size=shape).astype(dtype)
    lead = len(shape) - ndim
    for a in range(ndim):
        c = chunks[lead + a]
        c = (c,) * -(-shape[lead + a] // c) if isinstance(c, int) else c
        for s in np.cumsum(c)[:-1]:
            index = [slice(None)] * len(shape)
            index[lead + a] = s
            src = list(index)
            src[lead + a] = s - 1
            img[tuple(index)] = img[tuple(src)]
    return img


CASES = [
    (2, (41, 37), ((9, 17, 15), (5, 20, 12))),
    (2, (33, 29), (8, 29)),                      # chunks along the first axis only
    (3, (13, 12, 11), ((1, 4, 8), 5, (2, 9))),   # a chunk of one plane: seams on both sides
    (3, (10, 9, 14), (10, (4, 5), 6)),
]


@pytest.mark.parametrize("ndim,shape,chunks", CASES)
@pytest.mark.parametrize("conn", ["V", "T"])
def test_ecc_equals_single_array(rng, ndim, shape, chunks, conn):
    connectivity = 1 if conn == "V" else ndim
    img = tied_across_faces(rng, shape, chunks, ndim)
    img[rng.random(shape) < 0.03] = np.nan
    d = da.from_array(img, chunks=chunks)
    t = np.array([-1.0, 0.0, 0.5, 1.0, 2.0])
    lazy = cd.ecc(d, t, connectivity=connectivity)
    assert isinstance(lazy, da.Array) and lazy.shape == (5,) and lazy.dtype == np.int64
    np.testing.assert_array_equal(lazy.compute(), cutopo.ecc(img, t, connectivity=connectivity))


@pytest.mark.parametrize("conn", [1, 2])
def test_batch_chunks_and_counts(rng, conn):
    img = tied_across_faces(rng, (5, 19, 23), (2, (7, 12), 10), 2, dtype="uint8", levels=5)
    d = da.from_array(img, chunks=(2, (7, 12), 10))
    got = cd.ecc(d, 16, ndim=2, connectivity=conn).compute()
    np.testing.assert_array_equal(got, cutopo.ecc(img, 16, ndim=2, connectivity=conn))


@pytest.mark.parametrize("ndim,shape,chunks", CASES[:3])
@pytest.mark.parametrize("conn", ["V", "T"])
def test_ect_equals_single_array(rng, ndim, shape, chunks, conn):
    connectivity = 1 if conn == "V" else ndim
    mask = rng.random(shape) < 0.6
    dirs = np.concatenate([np.eye(ndim)[:1], rng.normal(size=(3, ndim))])  # (1, 0..): plane ties
    got = cd.ect(da.from_array(mask.astype(np.uint8), chunks=chunks), dirs, 9,
                 connectivity=connectivity).compute()
    np.testing.assert_array_equal(got, cutopo.ect(mask, dirs, 9, connectivity=connectivity))


def test_distributed(rng):
    distributed = pytest.importorskip("distributed")
    img = tied_across_faces(rng, (16, 15, 14), (6, 15, (5, 9)), 3)
    d = da.from_array(img, chunks=(6, 15, (5, 9)))
    t = np.array([0.0, 1.0, 2.0])
    with distributed.Client(processes=False, n_workers=1, threads_per_worker=2,
                            dashboard_address=None) as client:
        curve = client.compute(cd.ecc(d, t, connectivity=3)).result()
        transform = client.compute(cd.ect(d > 0, [[0.0, 1.0, 0.5]], 5)).result()
    np.testing.assert_array_equal(curve, cutopo.ecc(img, t, connectivity=3))
    np.testing.assert_array_equal(transform, cutopo.ect(img > 0, [[0.0, 1.0, 0.5]], 5))


def test_validation(rng):
    img = rng.random((8, 8)).astype(np.float32)
    d = da.from_array(img, chunks=4)
    with pytest.raises(TypeError, match="dask.array"):
        cd.ecc(img, 3)
    with pytest.raises(NotImplementedError, match="periodic"):
        cd.ecc(d, 3, boundary="periodic")
    with pytest.raises(ValueError, match="boundary"):
        cd.ecc(d, 3, boundary="torus")
    with pytest.raises(TypeError, match="dtype int64"):
        cd.ecc(d.astype(np.int64), 3)
    with pytest.raises(ValueError, match="connectivity"):
        cd.ecc(d, 3, connectivity=3)
    with pytest.raises(ValueError, match="sorted"):
        cd.ecc(d, [2.0, 1.0])
    with pytest.raises(TypeError, match="dmask: dtype float32"):
        cd.ect(d, [[1.0, 0.0]], 3)


def test_imports():
    """import cutopo never imports dask; without dask, cutopo.dask says what to install."""
    code = ("import sys, cutopo; assert 'dask' not in sys.modules\n"
            "sys.modules['dask'] = None; sys.modules['dask.array'] = None\n"
            "try:\n    import cutopo.dask\nexcept ImportError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "pip install 'cutopo[dask]'" in out.stdout
