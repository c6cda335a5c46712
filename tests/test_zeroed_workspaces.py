"""cutopo._cuda.workspace.ZeroedWorkspaces on the host: which call gets a kept workspace and
which a fresh one. The current stream is stood in by a settable value and the device arrays by
NumPy arrays, so every rule runs without a GPU; the kernels that leave the workspaces zeroed
are tested on the device (test_band_gpu.py) and in the emulator
(test_soft_ecc_kernels_host.py's ``_workspaces_zeroed``)."""
from __future__ import annotations

import threading
import types

import numpy as np
import pytest

from cutopo._cuda.workspace import ZeroedWorkspaces

cupy = pytest.importorskip("cupy")  # imports without a GPU (CI installs it: the nvrtc extra)


@pytest.fixture
def stream(monkeypatch):
    """The current stream's pointer, as a one-element list the test sets; cupy.zeros made of
    NumPy's."""
    current = [int(np.random.default_rng().integers(1, 1 << 40))]
    monkeypatch.setattr(cupy.cuda, "get_current_stream", lambda: types.SimpleNamespace(ptr=current[0]))
    monkeypatch.setattr(cupy, "zeros", lambda n, dtype=float: np.zeros(n, dtype))
    return current


def test_a_kind_keeps_one_per_stream(stream, rng):
    ws = ZeroedWorkspaces(1 << 20)
    words = int(rng.integers(1, 100))
    a = ws.get("forward", words, np.uint64)
    assert a.shape == (words,) and a.dtype == np.uint64 and not a.any()
    assert ws.get("forward", words, np.uint64) is a
    b = ws.get("backward", words, np.uint64)
    assert b is not a
    stream[0] += 1
    c = ws.get("forward", words, np.uint64)
    assert c is not a and c is not b
    stream[0] -= 1
    assert ws.get("forward", words, np.uint64) is a
    assert sorted(map(id, ws.kept())) == sorted(map(id, (a, b, c)))


def test_above_the_bound_each_call_gets_a_fresh_one(stream, rng):
    ws = ZeroedWorkspaces(64)
    a = ws.get("forward", 9, np.float64)  # 72 bytes
    assert a.shape == (9,) and not a.any()
    assert ws.get("forward", 9, np.float64) is not a
    assert ws.kept() == []
    assert ws.get("forward", 8, np.float64) is ws.get("forward", 8, np.float64)  # 64: kept


def test_a_kind_asked_for_another_size_gets_that_size(stream, rng):
    ws = ZeroedWorkspaces(1 << 20)
    a = ws.get("sums", 10, np.float64)
    b = ws.get("sums", 12, np.float64)
    assert b.shape == (12,) and b is not a
    assert ws.get("sums", 12, np.float64) is b
    assert ws.get("sums", 200_000, np.float64).shape == (200_000,)  # above: not kept
    assert ws.get("sums", 12, np.float64) is b


def test_each_thread_keeps_its_own(stream):
    ws = ZeroedWorkspaces(1 << 20)
    mine = ws.get("forward", 5, np.uint64)
    theirs = []
    t = threading.Thread(target=lambda: theirs.append(ws.get("forward", 5, np.uint64)))
    t.start()
    t.join()
    assert theirs[0] is not mine
    assert ws.get("forward", 5, np.uint64) is mine
