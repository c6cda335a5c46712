"""cutopo._cuda.repeated on the host: which calls get a key, and the table's bound; and the
bounded tables of cutopo._cuda.launch, filled from threads.

The ops that use it (soft_ecc, soft_ect) are tested on the device (test_band_gpu.py's
``*_repeated_calls_keep_every_check``); here CuPy's array type and the current device are
stood in by a small class, so every rule of the key runs without a GPU.
"""
from __future__ import annotations

import sys
import types

import numpy as np
import pytest

from cutopo._cuda import repeated
from cutopo._cuda.repeated import RepeatedCalls


class _FakeArray:
    def __init__(self, shape, dtype=np.float32, device=0, contiguous=True):
        self.shape, self.dtype = shape, np.dtype(dtype)
        self.data = types.SimpleNamespace(device_id=device)
        self._c_contiguous = contiguous


class _Subclass(_FakeArray):
    pass


@pytest.fixture
def fake_cupy(monkeypatch):
    monkeypatch.setattr(repeated, "_cupy", lambda: types.SimpleNamespace(ndarray=_FakeArray))
    monkeypatch.setattr(repeated, "_current_device", lambda: 1)


def test_key_of_a_repeated_call_is_equal(fake_cupy, rng):
    shape = tuple(int(n) for n in rng.integers(2, 40, 3))
    a = RepeatedCalls.key((_FakeArray(shape, device=1), _FakeArray((7,), np.float64, 1)),
                          (None, 1, "box"), 2.5)
    b = RepeatedCalls.key((_FakeArray(shape, device=1), _FakeArray((7,), np.float64, 1)),
                          (None, 1, "box"), 9.0)
    assert a is not None and a == b and hash(a) == hash(b)
    # every part of the key tells calls apart
    others = [
        ((_FakeArray(shape[:2], device=1), _FakeArray((7,), np.float64, 1)), 2.5, (None, 1, "box")),
        ((_FakeArray(shape, np.float64, 1), _FakeArray((7,), np.float64, 1)), 2.5, (None, 1, "box")),
        ((_FakeArray(shape, device=1), _FakeArray((8,), np.float64, 1)), 2.5, (None, 1, "box")),
        ((_FakeArray(shape, device=1), _FakeArray((7,), np.float32, 1)), 2.5, (None, 1, "box")),
        ((_FakeArray(shape, device=1), _FakeArray((7,), np.float64, 1)), np.float32(2.5),
         (None, 1, "box")),
        ((_FakeArray(shape, device=1), _FakeArray((7,), np.float64, 1)), 2.5, (2, 1, "box")),
        ((_FakeArray(shape, device=1), _FakeArray((7,), np.float64, 1)), 2.5, (None, 2, "box")),
        ((_FakeArray(shape, device=1), _FakeArray((7,), np.float64, 1)), 2.5,
         (None, 1, "periodic")),
    ]
    keys = [RepeatedCalls.key(arrays, static, scale) for arrays, scale, static in others]
    assert None not in keys
    assert len(set(keys + [a])) == len(keys) + 1


@pytest.mark.parametrize("case", ["subclass", "numpy", "strided", "other device", "int scale",
                                  "0-d scale", "None scale", "bool static", "float static",
                                  "tuple static"])
def test_no_key_for_calls_whose_checks_read_more(fake_cupy, case):
    arrays = [_FakeArray((5, 6), device=1), _FakeArray((3,), device=1)]
    scale, static = 4.0, (None, 1, "box")
    assert RepeatedCalls.key(tuple(arrays), static, scale) is not None
    if case == "subclass":
        arrays[0] = _Subclass((5, 6), device=1)
    elif case == "numpy":
        arrays[1] = np.zeros(3, np.float32)
    elif case == "strided":
        arrays[0] = _FakeArray((5, 6), device=1, contiguous=False)
    elif case == "other device":
        arrays[1] = _FakeArray((3,), device=0)
    elif case == "int scale":
        scale = 4
    elif case == "0-d scale":
        scale = np.array(4.0)
    elif case == "None scale":
        scale = None
    elif case == "bool static":
        static = (None, True, "box")
    elif case == "float static":
        static = (2.0, 1, "box")
    else:
        static = (None, (1,), "box")
    assert RepeatedCalls.key(tuple(arrays), static, scale) is None


def test_key_of_an_op_without_a_scale(fake_cupy):
    arrays = (_FakeArray((5, 6), device=1),)
    plain = RepeatedCalls.key(arrays, (None, 1, "box"))
    assert plain is not None and plain == RepeatedCalls.key(arrays, (None, 1, "box"))
    assert plain != RepeatedCalls.key(arrays, (None, 1, "box"), 1.0)


def test_no_key_without_cupy(monkeypatch):
    monkeypatch.setattr(repeated, "_cupy", lambda: None)
    assert RepeatedCalls.key((), (), 1.0) is None


def test_host_arrays_never_ask_for_the_device(monkeypatch):
    """A NumPy call gets no key before anything reads CUDA's current device (on a machine with
    CuPy and no GPU that read raises)."""
    def no_device():
        raise AssertionError("read the current device")

    monkeypatch.setattr(repeated, "_cupy", lambda: types.SimpleNamespace(ndarray=_FakeArray))
    monkeypatch.setattr(repeated, "_current_device", no_device)
    assert RepeatedCalls.key((np.zeros((4, 4)), np.zeros(3)), (None, 1, "box"), 2.0) is None
    assert RepeatedCalls.key((_FakeArray((4, 4)), np.zeros(3)), (None, 1, "box")) is None


def test_table_drops_the_oldest_entry_when_full(rng):
    capacity = int(rng.integers(3, 9))
    table = RepeatedCalls(capacity)
    for i in range(capacity):
        table.keep(("k", i), i)
    table.keep(("k", 0), "again")  # a kept key is replaced, nothing dropped
    assert len(table) == capacity and table[("k", 0)] == "again"
    table.keep(("k", capacity), capacity)
    assert len(table) == capacity and ("k", 0) not in table
    assert list(table) == [("k", i) for i in range(1, capacity + 1)]


def _run_threads(work, n):
    """work(0), ..., work(n - 1) on n threads at once, switching between any two bytecodes."""
    import threading

    threads = [threading.Thread(target=work, args=(t,)) for t in range(n)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    finally:
        sys.setswitchinterval(interval)


def test_table_kept_from_many_threads(rng):
    """keep() from threads at once (a threaded Dask scheduler's tasks): no error, the bound
    holds, every value kept last under its key is the one a thread wrote."""
    capacity = int(rng.integers(5, 20))
    table = RepeatedCalls(capacity)
    errors = []

    def work(t):
        try:
            for i in range(2000):
                table.keep((i % 37, t % 3), (t, i))
        except Exception as exc:  # pragma: no cover - the failure this test looks for
            errors.append(exc)

    _run_threads(work, 8)
    assert not errors and len(table) <= capacity
    for (k, m), (t, i) in table.items():
        assert t % 3 == m and i % 37 == k


def test_launch_tables_remembered_from_many_threads(monkeypatch):
    """cutopo._cuda.launch keeps its prepared launches in bounded tables that threads fill
    at once (the launches of a threaded Dask scheduler's tasks): the same eviction, locked."""
    from cutopo._cuda import launch

    monkeypatch.setattr(launch, "PREPARED_CAPACITY", 7)
    table, errors = {}, []

    def work(t):
        try:
            for i in range(2000):
                launch._remember(table, (t, i), i)
        except Exception as exc:  # pragma: no cover - the failure this test looks for
            errors.append(exc)

    _run_threads(work, 8)
    assert not errors and len(table) <= 7
