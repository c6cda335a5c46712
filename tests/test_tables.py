"""CPU tests of the bookkeeping of cutopo._cuda.tables on a fake CuPy (host arrays, recorded
stream calls): uploads happen on the private stream and are waited for there, the memo keeps
the newest tables, and retired arrays are freed only after a device synchronisation. What the
GPU does with it is tested in test_tables_gpu.py."""
from __future__ import annotations

import contextlib
import sys
import types

import numpy as np
import pytest

from cutopo._cuda import tables


class FakeArray(np.ndarray):
    @property
    def device(self):
        return types.SimpleNamespace(id=0)


@pytest.fixture
def fake(monkeypatch):
    log = []

    class Stream:
        def __init__(self, non_blocking=False):
            assert non_blocking  # never implicitly ordered after the legacy default stream
            self.current = False

        def __enter__(self):
            self.current = True
            log.append("enter private")
            return self

        def __exit__(self, *exc):
            self.current = False

        def synchronize(self):
            log.append("synchronize private")

    streams = []

    def make_stream(non_blocking=False):
        streams.append(Stream(non_blocking))
        return streams[-1]

    def asarray(host):
        assert streams and streams[0].current, "an upload outside the private stream"
        log.append("upload")
        return np.array(host).view(FakeArray)

    runtime = types.SimpleNamespace(getDevice=lambda: 0,
                                    deviceSynchronize=lambda: log.append("device synchronize"))
    cuda = types.SimpleNamespace(runtime=runtime, Stream=make_stream,
                                 Device=lambda i: contextlib.nullcontext())
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(cuda=cuda, asarray=asarray))
    monkeypatch.setattr(tables, "_streams", {})
    monkeypatch.setattr(tables, "_memo", type(tables._memo)())
    monkeypatch.setattr(tables, "_retired", type(tables._retired)(list))
    return log


def test_uploads_are_waited_for_on_the_private_stream(fake):
    host = np.arange(5.0)
    dev = tables.upload(host)
    np.testing.assert_array_equal(dev, host)
    assert fake == ["enter private", "upload", "synchronize private"]
    assert len(tables._streams) == 1  # one private stream per device, made once
    tables.upload(host)
    assert len(tables._streams) == 1


def test_memo_keeps_the_newest_and_retires_the_rest(fake, monkeypatch):
    monkeypatch.setattr(tables, "MAX_MEMOIZED", 3)
    monkeypatch.setattr(tables, "RETIRE_COUNT", 2)
    a = tables.memoized(np.arange(3.0))
    assert tables.memoized(np.arange(3.0)) is a              # same bytes: the same array
    assert tables.memoized(np.arange(3)) is not a            # same values, other dtype
    assert tables.memoized(np.arange(3.0).reshape(3, 1)) is not a   # other shape
    assert fake.count("upload") == 3
    tables.memoized(np.arange(3.0))                          # a hit makes it the newest
    tables.memoized(np.ones(2))                              # evicts the oldest: np.arange(3)
    assert len(tables._memo) == 3 and len(tables._retired[0]) == 1
    assert "device synchronize" not in fake
    tables.memoized(np.zeros(2))                             # a second eviction fills the batch
    assert fake[-1] == "device synchronize" and tables._retired[0] == []
    assert tables.memoized(np.arange(3.0)) is a              # still held by the memo


def test_retire_batches_by_count_and_bytes(fake, monkeypatch):
    monkeypatch.setattr(tables, "RETIRE_COUNT", 3)
    monkeypatch.setattr(tables, "RETIRE_BYTES", 1000)
    small = [np.zeros(4).view(FakeArray) for _ in range(3)]
    tables.retire(small[0], None, small[1])
    assert fake.count("device synchronize") == 0 and len(tables._retired[0]) == 2
    tables.retire(small[2])                                  # the third: freed together
    assert fake.count("device synchronize") == 1 and tables._retired[0] == []
    tables.retire(np.zeros(200).view(FakeArray))             # 1600 bytes: at once
    assert fake.count("device synchronize") == 2


def test_retire_with_an_owner(fake, monkeypatch):
    monkeypatch.setattr(tables, "RETIRE_COUNT", 1)

    class Owner:
        pass

    owner = Owner()
    tables.retire_with(owner, np.zeros(3).view(FakeArray))
    assert "device synchronize" not in fake
    del owner                                                # collected: its arrays retire
    assert fake[-1] == "device synchronize"
