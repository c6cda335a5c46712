"""CPU tests of cutopo.dask: chunked ECC and ECT equal the single-array results exactly (uneven
chunks, ties across chunk faces, batches), under the threaded scheduler and dask.distributed."""
from __future__ import annotations

import subprocess
import sys
import threading

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
    # one chunked axis (faces merged into chunk tasks), faces crossing 1- and 2-plane chunks
    (3, (15, 12, 11), ((3, 1, 2, 1, 8), 12, 11)),
    (3, (12, 13, 11), (12, (1, 5, 2, 5), 11)),   # the chunked axis is not the first
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


def test_count_thresholds_over_a_range_wider_than_float64(rng):
    """A count of thresholds over pixels from -1e308 to 1e308 (max - min overflows float64):
    the Dask thresholds equal cutopo.linear_thresholds' (finite, not linspace's NaN), so the
    curves agree."""
    img = rng.standard_normal((2, 17, 19))
    img[0, 3, 4], img[1, 10, 2] = -1e308, 1e308
    got = cd.ecc(da.from_array(img, chunks=(1, 9, 10)), 6, ndim=2).compute()
    np.testing.assert_array_equal(got, cutopo.ecc(img, 6, ndim=2))
    assert np.isfinite(cutopo.linear_thresholds(img, 6)).all()


@pytest.mark.parametrize("dtype", ["float32", "float16", "int16"])
def test_count_thresholds_from_chunk_ranges(rng, dtype):
    """A count's thresholds from every chunk's finite range: chunks of NaN and inf only (no
    range of their own), the extremes in different chunks; equal to the single array's; an
    array with no finite value raises."""
    img = (rng.standard_normal((23, 19)) * 50).astype(dtype)
    if img.dtype.kind == "f":
        img[:8, :7] = np.nan
        img[8:16, :7] = np.inf
        img[rng.random(img.shape) < 0.1] = -np.inf
    img[20, 3], img[2, 15] = -300, 250
    d = da.from_array(img, chunks=(8, 7))
    for n in (1, 5, 40):
        np.testing.assert_array_equal(cd.ecc(d, n).compute(), cutopo.ecc(img, n))
        np.testing.assert_array_equal(cd._linear_thresholds(d, n), cutopo.linear_thresholds(img, n))
    if img.dtype.kind == "f":
        with pytest.raises(ValueError, match="no finite pixel"):
            cd.ecc(da.from_array(np.full((6, 6), np.nan, dtype=dtype), chunks=3), 4)


@pytest.mark.parametrize("ndim,shape,chunks", CASES[:3] + CASES[4:])
@pytest.mark.parametrize("conn", ["V", "T"])
def test_ect_equals_single_array(rng, ndim, shape, chunks, conn):
    connectivity = 1 if conn == "V" else ndim
    mask = rng.random(shape) < 0.6
    dirs = np.concatenate([np.eye(ndim)[:1], rng.normal(size=(3, ndim))])  # (1, 0..): plane ties
    got = cd.ect(da.from_array(mask.astype(np.uint8), chunks=chunks), dirs, 9,
                 connectivity=connectivity).compute()
    np.testing.assert_array_equal(got, cutopo.ect(mask, dirs, 9, connectivity=connectivity))


@pytest.mark.parametrize("ndim,shape,chunks", CASES)
@pytest.mark.parametrize("conn", ["V", "T"])
def test_plain_interiors_equal_masked(rng, monkeypatch, ndim, shape, chunks, conn):
    """The "plain" interior (whole chunk unmasked, minus its seam planes as the chunk alone sees
    them), the CuPy default, run with the NumPy kernels: equal to the single-array result, down
    to chunks of two planes."""
    monkeypatch.setitem(cd.INTERIOR, "numpy", "plain")
    monkeypatch.setattr(cd, "PLAIN_MIN_LENGTH", 2)
    calls = []
    real = cd._ecc_numpy.owned_histogram
    monkeypatch.setattr(cd._ecc_numpy, "owned_histogram",
                        lambda *a, **k: calls.append(a[4] is None) or real(*a, **k))
    connectivity = 1 if conn == "V" else ndim
    img = tied_across_faces(rng, shape, chunks, ndim)
    img[rng.random(shape) < 0.03] = np.nan
    t = np.array([-1.0, 0.0, 0.5, 1.0, 2.0])
    got = cd.ecc(da.from_array(img, chunks=chunks), t, connectivity=connectivity).compute(
        scheduler="sync")
    np.testing.assert_array_equal(got, cutopo.ecc(img, t, connectivity=connectivity))
    assert any(calls)  # some chunk was counted unmasked


def graph_tasks(lazy):
    """{kind: count} of the tasks of a lazy result (data nodes and from_array getters apart)."""
    counts = {}
    for key in dict(lazy.__dask_graph__()):
        name = key[0] if isinstance(key, tuple) else key
        kind = name.rsplit("-", 1)[-1] if name.startswith("cutopo-") else "input"
        kind = "final" if len(kind) == 32 else kind  # the result's own name ends with the token
        counts[kind] = counts.get(kind, 0) + 1
    return counts


def test_task_counts():
    """One task per chunk; slabs along one axis: one getitem per boundary and no face task;
    several chunked axes: an edges task per chunk and a face task per boundary; one tree-sum
    task per batch chunk."""
    img = np.zeros((4, 64, 30, 20), dtype=np.uint8)
    lazy = cd.ecc(da.from_array(img, chunks=(2, 16, 30, 20)), 4, ndim=3)
    assert graph_tasks(lazy) == {"input": 8, "part": 8, "piece": 6, "final": 2}
    lazy = cd.ecc(da.from_array(img[0], chunks=(16, 15, 20)), [0, 1])
    assert graph_tasks(lazy) == {"input": 8, "part": 8, "edges": 8, "face": 4, "final": 1}


class Sliced(np.ndarray):
    """An array type that from_array slices in tasks (as it does CuPy arrays), not eagerly."""


def test_graph_optimisation_only_for_inputs_that_need_it(rng):
    """Dask's array optimisation (seen through its ``array_optimize`` hook) is skipped for a
    graph whose counting tasks read arrays in memory (from_array of a NumPy array or, sliced in
    tasks, of another array type; a persisted array; one element-wise map over those) and
    applied when the input needs it (slicing, a chain of operations); the curves are exact
    either way, and what is derived from a result is a plain Array."""
    import pickle

    import dask
    from dask.array.optimization import optimize

    calls = []

    def spy(dsk, keys, **kwargs):
        calls.append(len(dict(dsk)))
        return optimize(dsk, keys, **kwargs)

    img = tied_across_faces(rng, (30, 12, 10), (8, 12, 10), 3, levels=4)
    t = [0.0, 1.0, 2.0, 3.0]
    want = cutopo.ecc(img, t)
    d = da.from_array(img, chunks=(8, 12, 10))
    in_tasks = da.from_array(img.view(Sliced), chunks=(8, 12, 10), asarray=False)
    persisted = d.persist(scheduler="sync")
    with dask.config.set(array_optimize=spy, scheduler="sync"):
        for source, expected in ((d, want), (in_tasks, want), (persisted, want),
                                 (d + 1, cutopo.ecc(img + 1, t))):
            lazy = cd.ecc(source, t)
            graph = lazy.__dask_graph__()
            assert lazy.__dask_optimize__(graph, lazy.__dask_keys__()) is graph
            np.testing.assert_array_equal(lazy.compute(), expected)
        assert calls == []
        for source, expected in ((d[2:], cutopo.ecc(img[2:], t)),
                                 ((d + 1) * 2, cutopo.ecc((img + 1) * 2, t))):
            np.testing.assert_array_equal(cd.ecc(source, t).compute(), expected)
            assert len(calls) == 1
            calls.clear()
        lazy = cd.ecc(d, t)
        derived = lazy * 2
        assert type(derived) is da.Array
        np.testing.assert_array_equal(derived.compute(), 2 * want)
        assert calls  # a derived Array is optimised as any other
        both = dask.compute(lazy, cd.ect(d > 1, [[1.0, 0.0, 0.0]], 4), d.sum())
    np.testing.assert_array_equal(both[0], want)
    np.testing.assert_array_equal(both[1], cutopo.ect(img > 1, [[1.0, 0.0, 0.0]], 4))
    np.testing.assert_array_equal(pickle.loads(pickle.dumps(lazy)).compute(), want)
    np.testing.assert_array_equal(lazy.to_delayed().ravel()[0].compute(), want)
    (kept,) = dask.persist(lazy, scheduler="sync")
    np.testing.assert_array_equal(kept.compute(), want)


def test_compute_goes_straight_to_the_local_schedulers(rng, monkeypatch):
    """A result's own compute() under the synchronous or threaded scheduler (named, from the
    config or the default) skips Dask's expression layer and still runs every task through
    that scheduler (its callbacks see them) and optimises an input that needs it; any other
    scheduler and dask.compute take Dask's usual route. The curves are exact every way."""
    import dask
    import dask.base
    from dask.callbacks import Callback

    layers = []
    to_expr = dask.base.collections_to_expr
    monkeypatch.setattr(dask.base, "collections_to_expr",
                        lambda *a, **k: layers.append(1) or to_expr(*a, **k))
    img = tied_across_faces(rng, (2, 26, 11, 9), (1, (7, 9, 10), 11, 9), 3, levels=4)
    t = [0.0, 1.0, 2.0, 3.0]
    want = cutopo.ecc(img, t, ndim=3)
    d = da.from_array(img, chunks=(1, (7, 9, 10), 11, 9))

    class Seen(Callback):
        def __init__(self):
            super().__init__()
            self.keys = []

        def _pretask(self, key, dsk, state):
            self.keys.append(key)

    for kwargs in ({"scheduler": "sync"}, {"scheduler": "threads", "num_workers": 2},
                   {"scheduler": "synchronous", "optimize_graph": False}, {}):
        lazy = cd.ecc(d, t, ndim=3)
        with Seen() as seen:
            np.testing.assert_array_equal(lazy.compute(**kwargs), want)
        ours = {k for k in dict(lazy.__dask_graph__()) if k[0].startswith("cutopo-")}
        assert ours and ours <= set(seen.keys)  # (the chunks themselves are data, not tasks)
    with dask.config.set(scheduler="sync"):
        np.testing.assert_array_equal(cd.ecc(d[:, 3:], t, ndim=3).compute(),
                                      cutopo.ecc(img[:, 3:], t, ndim=3))
        np.testing.assert_array_equal(cd.ect(d > 1, [[1.0, 0.0, 0.0]], 4).compute(),
                                      cutopo.ect(img > 1, [[1.0, 0.0, 0.0]], 4))
    assert layers == []
    np.testing.assert_array_equal(dask.compute(lazy, scheduler="sync")[0], want)
    assert layers == [1]
    own = []  # a scheduler of the caller's own: dask.compute's route, with it

    def get(dsk, keys, **kwargs):
        own.append(1)
        return dask.local.get_sync(dsk, keys, **kwargs)

    np.testing.assert_array_equal(lazy.compute(scheduler=get), want)
    assert layers == [1, 1] and own == [1]


@pytest.mark.parametrize("interior", ["masked", "plain"])
def test_tree_sum(rng, monkeypatch, interior):
    """Several levels of the tree sum, batch chunks, both ways of counting chunk interiors."""
    monkeypatch.setattr(cd, "SPLIT_EVERY", 2)
    monkeypatch.setitem(cd.INTERIOR, "numpy", interior)
    monkeypatch.setattr(cd, "PLAIN_MIN_LENGTH", 2)
    img = tied_across_faces(rng, (2, 24, 21), (1, 3, (5, 6, 10)), 2, levels=4)
    d = da.from_array(img, chunks=(1, 3, (5, 6, 10)))
    lazy = cd.ecc(d, [0.0, 1.0, 2.0, 3.0], ndim=2, connectivity=2)
    assert graph_tasks(lazy)["sum"] > 2
    np.testing.assert_array_equal(lazy.compute(), cutopo.ecc(img, [0.0, 1.0, 2.0, 3.0], ndim=2,
                                                             connectivity=2))


def test_distributed(rng):
    distributed = pytest.importorskip("distributed")
    img = tied_across_faces(rng, (16, 15, 14), (6, 15, (5, 9)), 3)
    d = da.from_array(img, chunks=(6, 15, (5, 9)))
    t = np.array([0.0, 1.0, 2.0])
    with distributed.Client(processes=False, n_workers=1, threads_per_worker=2,
                            dashboard_address=None) as client:
        curve = client.compute(cd.ecc(d, t, connectivity=3)).result()
        transform = client.compute(cd.ect(d > 0, [[0.0, 1.0, 0.5]], 5)).result()
        by_default = cd.ecc(d, t, connectivity=3).compute()  # the client is the default scheduler
    np.testing.assert_array_equal(by_default, cutopo.ecc(img, t, connectivity=3))
    np.testing.assert_array_equal(curve, cutopo.ecc(img, t, connectivity=3))
    np.testing.assert_array_equal(transform, cutopo.ect(img > 0, [[0.0, 1.0, 0.5]], 5))


def test_validation(rng):
    img = rng.random((8, 8)).astype(np.float32)
    d = da.from_array(img, chunks=4)
    with pytest.raises(TypeError, match="dask.array"):
        cd.ecc(img, 3)
    with pytest.raises(ValueError, match="length >= 3"):
        cd.ecc(da.from_array(img[:2]), 3, boundary="periodic")
    with pytest.raises(TypeError, match="boundary"):
        cd.ecc(d, 3, boundary=1)
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


def test_unknown_chunk_sizes_are_named(rng):
    """NaN chunk sizes (after boolean indexing) raise a ValueError that names the argument and
    the fix, not a failure deep in the planning."""
    x = da.from_array(rng.random((12, 9)).astype(np.float32), chunks=4)
    unknown = x[x[:, 0] >= 0]
    assert np.isnan(unknown.shape[0])
    with pytest.raises(ValueError, match=r"darr has unknown \(NaN\) chunk sizes.*"
                                         r"darr\.compute_chunk_sizes\(\)"):
        cd.ecc(unknown, [0.5])
    with pytest.raises(ValueError, match=r"darr .*compute_chunk_sizes"):
        cd.ecc(unknown, 4, boundary="periodic")
    with pytest.raises(ValueError, match=r"dmask has unknown \(NaN\) chunk sizes.*"
                                         r"dmask\.compute_chunk_sizes\(\)"):
        cd.ect(unknown > 0.5, [[1.0, 0.0]], 3)
    known = unknown.compute_chunk_sizes()
    np.testing.assert_array_equal(cd.ecc(known, [0.5]).compute(),
                                  cutopo.ecc(x.compute(), [0.5]))


def test_imports():
    """import cutopo never imports dask; without dask, cutopo.dask says what to install."""
    code = ("import sys, cutopo; assert 'dask' not in sys.modules\n"
            "sys.modules['dask'] = None; sys.modules['dask.array'] = None\n"
            "try:\n    import cutopo.dask\nexcept ImportError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "pip install 'cutopo[dask]'" in out.stdout


# ---------------------------------------------------------------------------------------------
# The CuPy branch of the chunk tasks, on a fake device (host arrays posing as CuPy arrays)


class FakeDeviceArray(np.ndarray):
    @property
    def device(self):
        import contextlib

        return contextlib.nullcontext()


def fake_cupy(monkeypatch, launches):
    """cutopo.dask's CuPy calls on the host: arrays are FakeDeviceArray, the histogram plans
    are owned_histogram (checking that masked plans get masks and plain ones none)."""
    import functools
    import types

    from cutopo import _band_cupy, _ecc_cupy, _ect

    # counters keep their plans: the fake ones stay in a cache of this test's own
    monkeypatch.setattr(cd, "_ecc_counter", functools.lru_cache(maxsize=16)(cd._ecc_counter.__wrapped__))

    def dev(a):
        return np.asarray(a).view(FakeDeviceArray)

    class Plan:
        def __init__(self, img, t, ndim, tconn, masked):
            self.t, self.ndim, self.tconn, self.masked = t, ndim, tconn, masked

        def add(self, view, hist):
            assert not self.masked
            self.launch(view, hist)

        def add_masked(self, view, hist, *masks):
            assert self.masked
            self.launch(view, hist, *masks)

        def launch(self, view, hist, *masks):
            assert isinstance(view, FakeDeviceArray) and view.flags.c_contiguous
            assert isinstance(hist, FakeDeviceArray) and hist.dtype == np.int64
            assert len(masks) == (3 if self.masked else 0)
            assert all(isinstance(m, FakeDeviceArray) and m.dtype == np.uint8 for m in masks)
            own = [np.asarray(m, dtype=bool) for m in masks][3 - self.ndim:] or None
            if own is not None:
                assert [m.size for m in own] == list(view.shape[1:])
            launches.append(self.masked)
            assert cuda.get_current_stream().name == "side"  # chunk kernels go to side streams
            hist += _ecc_numpy_owned(np.asarray(view), self.t, self.ndim, self.tconn, own)

    local = threading.local()  # as CuPy's current stream: one per thread

    def current():
        if not hasattr(local, "stack"):
            local.stack = [FakeStream("task", local)]
        return local.stack

    def side_stream(non_blocking):
        assert non_blocking  # never implicitly synchronised with the legacy default stream
        return FakeStream("side", local)

    cuda = types.SimpleNamespace(runtime=types.SimpleNamespace(getDevice=lambda: 0),
                                 get_current_stream=lambda: current()[-1], Stream=side_stream)
    cupy = types.SimpleNamespace(
        cuda=cuda, ndarray=FakeDeviceArray,
        zeros=lambda *a, **k: dev(np.zeros(*a, **k)), empty=lambda *a, **k: dev(np.empty(*a, **k)),
        asarray=dev, ascontiguousarray=lambda a: dev(np.ascontiguousarray(a)),
        concatenate=lambda arrays, axis: dev(np.concatenate([np.asarray(a) for a in arrays], axis)))
    monkeypatch.setattr(cd, "_cupy", lambda: cupy)
    monkeypatch.setattr(cd, "is_cupy_array", lambda a: isinstance(a, FakeDeviceArray))
    from cutopo._cuda import tables

    monkeypatch.setattr(tables, "memoized", lambda host: dev(np.ascontiguousarray(host)))
    monkeypatch.setattr(cd, "_SIDES", {})  # the fake device's side streams stay in this test
    monkeypatch.setattr(_ecc_cupy, "histogram_plan", Plan)
    def ect_forward(mask_b, dirs, coords, t, tconn, soft, own, general=False):
        assert cuda.get_current_stream().name == "task"  # the ECT stays off the side streams
        return dev(_ect.curves(np.asarray(mask_b), dirs, coords, t, tconn, own,
                               general=general)), None

    monkeypatch.setattr(_band_cupy, "ect_forward", ect_forward)
    return dev


class FakeStream:
    """A stream that checks the side streams' ordering: a side stream's work must come after
    the task stream's (wait_event on an event of it) before it runs, and the task stream must
    wait for a side event before it reads the result."""

    def __init__(self, name, local):
        self.name, self.local, self.waited, self.synchronized = name, local, [], False

    def record(self):
        return ("event", self.name, id(self))

    def wait_event(self, event):
        assert event[0] == "event" and event[2] != id(self)
        self.waited.append(event)

    def synchronize(self):
        self.synchronized = True

    def __enter__(self):
        assert self.waited, "a side stream ran before waiting for the task stream"
        self.local.stack.append(self)
        return self

    def __exit__(self, *exc):
        assert self.local.stack.pop() is self


def _ecc_numpy_owned(*args):
    from cutopo import _ecc_numpy

    return _ecc_numpy.owned_histogram(*args)


@pytest.mark.parametrize("interior", ["plain", "masked"])
@pytest.mark.parametrize("ndim,shape,chunks", [
    (3, (30, 12, 11), ((9, 1, 2, 18), 12, 11)),
    (3, (2, 20, 18, 17), (1, 20, (9, 9), 17)),
    (2, (3, 40, 33), (2, (20, 20), (10, 1, 22))),
    (3, (24, 20, 19), ((12, 12), (10, 10), (9, 10))),
])
def test_cupy_branch_on_a_fake_device(monkeypatch, rng, interior, ndim, shape, chunks):
    launches = []
    dev = fake_cupy(monkeypatch, launches)
    monkeypatch.setitem(cd.INTERIOR, "cupy", interior)
    monkeypatch.setattr(cd, "PLAIN_MIN_LENGTH", 2)
    img = tied_across_faces(rng, shape, chunks, ndim)
    t = np.array([-1.0, 0.0, 0.5, 1.0, 2.0])
    d = da.from_array(dev(img), chunks=chunks, asarray=False)
    for conn in (1, ndim):
        got = cd.ecc(d, t, ndim=ndim, connectivity=conn).compute(scheduler="threads")
        assert isinstance(got, FakeDeviceArray) or len(shape) > ndim  # (batches: dask concatenates)
        np.testing.assert_array_equal(got, cutopo.ecc(img, t, ndim=ndim, connectivity=conn))
    assert (False in launches) == (interior == "plain") and True in launches
    dirs = rng.normal(size=(3, ndim))
    got = cd.ect(d > 1, dirs, 7, connectivity=ndim).compute()
    np.testing.assert_array_equal(got, cutopo.ect(img > 1, dirs, 7, connectivity=ndim))
    # every side stream's inputs were let go once the sum had waited for its kernels
    assert cd._SIDES and all(side.keep is None for sides in cd._SIDES.values() for side in sides)


def test_a_failing_task_waits_for_its_side_stream(monkeypatch):
    """A task that raises on its side stream synchronises it before its histogram (memory of
    the task's stream) is dropped, and keeps none of its inputs."""
    dev = fake_cupy(monkeypatch, [])
    hist = dev(np.zeros(3, dtype=np.int64))
    with pytest.raises(RuntimeError, match="a kernel failed"):
        with cd._side_stream(cd._cupy(), hist, ("the chunk",), cd._EccCounter(np.arange(3.0), 3,
                                                                              False)):
            raise RuntimeError("a kernel failed")
    sides = [side for group in cd._SIDES.values() for side in group]
    assert [side.stream.synchronized for side in sides].count(True) == 1
    assert all(side.keep is None for side in sides)


PERIODIC_CASES = [
    (2, (17, 13), ((5, 7, 5), (3, 10))),         # chunked along both axes: face tasks
    (2, (12, 15), (12, 15)),                     # one chunk: the wrap inside one chunk
    (2, (20, 9), ((1, 6, 12, 1), 9)),            # slabs, one-plane chunks at both ends
    (3, (7, 6, 8), ((3, 4), 6, (2, 5, 1))),
    (3, (9, 5, 6), (9, (1, 2, 2), 6)),           # the chunked axis is not the first
    (3, (3, 3, 4), (3, 3, (2, 2))),              # the smallest torus
]


@pytest.mark.parametrize("interior", ["masked", "plain"])
@pytest.mark.parametrize("ndim,shape,chunks", PERIODIC_CASES)
@pytest.mark.parametrize("conn", ["V", "T"])
def test_periodic_ecc_equals_single_array_and_enumeration(monkeypatch, rng, ndim, shape, chunks,
                                                          conn, interior):
    """boundary="periodic": the torus, exactly: equal to cutopo.ecc of the whole array and to
    the cell enumeration of the torus, with ties across chunk faces and across the wrap (each
    axis's first plane a copy of its last) and NaN pixels; chunk interiors counted masked or
    "plain" (the whole chunk minus its seam planes: the CuPy default, here on NumPy chunks)."""
    from oracles import periodic_ecc_oracle

    monkeypatch.setitem(cd.INTERIOR, "numpy", interior)
    monkeypatch.setattr(cd, "PLAIN_MIN_LENGTH", 2)
    connectivity = 1 if conn == "V" else ndim
    img = tied_across_faces(rng, shape, chunks, ndim)
    for a in range(ndim):
        first, last = [slice(None)] * ndim, [slice(None)] * ndim
        first[a], last[a] = 0, -1
        img[tuple(first)] = img[tuple(last)]
    img[rng.random(shape) < 0.03] = np.nan
    t = np.array([-1.0, 0.0, 0.5, 1.0, 2.0])
    lazy = cd.ecc(da.from_array(img, chunks=chunks), t, connectivity=connectivity,
                  boundary="periodic")
    got = lazy.compute()
    np.testing.assert_array_equal(got, cutopo.ecc(img, t, connectivity=connectivity,
                                                  boundary="periodic"))
    np.testing.assert_array_equal(got, periodic_ecc_oracle(img, t, connectivity))


@pytest.mark.parametrize("conn", [1, 2])
def test_periodic_batches_and_counts(rng, conn):
    img = rng.integers(0, 4, (3, 14, 11)).astype(np.uint8)
    d = da.from_array(img, chunks=(2, (5, 9), (4, 7)))
    got = cd.ecc(d, 4, ndim=2, connectivity=conn, boundary="periodic").compute()
    np.testing.assert_array_equal(got, cutopo.ecc(img, 4, ndim=2, connectivity=conn,
                                                  boundary="periodic"))


@pytest.mark.parametrize("ndim,shape,chunks", [
    (2, (17, 13), ((5, 7, 5), (3, 10))),
    (2, (20, 9), ((1, 6, 12, 1), 9)),
    (3, (7, 6, 8), ((3, 4), 6, (2, 5, 1))),
    (3, (5, 4, 6), (5, (1, 3), 6)),
])
@pytest.mark.parametrize("conn", ["V", "T"])
def test_periodic_ect_equals_single_array(rng, ndim, shape, chunks, conn):
    """boundary="periodic" ECT of NumPy chunks: equal to cutopo.ect's torus, with foreground
    touching every face (cells across the wrap) and axis-aligned directions (tied heights)."""
    connectivity = 1 if conn == "V" else ndim
    mask = rng.random(shape) < 0.55
    for a in range(ndim):
        first, last = [slice(None)] * ndim, [slice(None)] * ndim
        first[a], last[a] = 0, -1
        mask[tuple(first)] |= mask[tuple(last)]
    dirs = np.concatenate([np.eye(ndim), -np.eye(ndim)[:1], rng.normal(size=(3, ndim))])
    lazy = cd.ect(da.from_array(mask, chunks=chunks), dirs, 11, connectivity=connectivity,
                  boundary="periodic")
    want = cutopo.ect(mask, dirs, 11, connectivity=connectivity, boundary="periodic")
    np.testing.assert_array_equal(lazy.compute(), want)


def test_profile_dask_traces_the_chunk_tasks(monkeypatch):
    """benchmarks/profile_dask.py's timeline swaps a tracing wrapper into the graph's chunk
    tasks (the installed Dask's graph layout): on NumPy chunks, with device events stubbed,
    every compute's first chunk task is stamped after compute() starts and before it returns,
    the curves stay exact, and the library's task function is put back."""
    import pathlib
    import types

    root = pathlib.Path(__file__).resolve().parents[1]
    monkeypatch.syspath_prepend(str(root / "benchmarks"))
    import profile_dask

    class Event:
        def record(self):
            pass

    cuda = types.SimpleNamespace(Event=Event, Device=lambda: types.SimpleNamespace(synchronize=lambda: None),
                                 get_elapsed_time=lambda start, end: 0.0)
    fake_cp = types.SimpleNamespace(cuda=cuda)
    rng = np.random.default_rng(5)
    x = rng.random((64, 24, 20)).astype(np.float32)
    t = np.linspace(0, 1, 9).astype(np.float32)
    lazy = cd.ecc(da.from_array(x, chunks=(16, 24, 20)), t)
    original = cd._chunk_task
    import dask

    with dask.config.set(scheduler="sync"):
        first, last, returned, idle, span = profile_dask.timeline(fake_cp, cd, lazy, 3)
        np.testing.assert_array_equal(lazy.compute(), cutopo.ecc(x, t))
    assert 0 < first <= last <= returned <= idle and span == 0.0
    assert cd._chunk_task is original
    sys.modules.pop("profile_dask", None)
