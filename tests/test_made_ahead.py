"""cutopo._cuda.workspace.MadeAhead on the host: which call takes the arrays made for it, and
what is held between calls. The current stream is stood in by a settable value and the arrays
by NumPy arrays, so every rule runs without a GPU; the soft ECC's use of it is tested on the
device (test_band_gpu.py's ``test_soft_ecc_made_ahead_arrays_are_fresh``)."""
from __future__ import annotations

import threading

import numpy as np
import pytest

from cutopo._cuda import workspace
from cutopo._cuda.workspace import MadeAhead

cupy = pytest.importorskip("cupy")  # imports without a GPU (CI installs it: the nvrtc extra)


@pytest.fixture
def stream(monkeypatch):
    """The current stream's pointer, as a one-element list the test sets."""
    current = [int(np.random.default_rng().integers(1, 1 << 40))]
    monkeypatch.setattr(MadeAhead, "_stream", staticmethod(lambda: current[0]))
    return current


def _maker(rng, made):
    def make():
        arrays = (rng.random(int(rng.integers(1, 50))), None, rng.random(3))
        made.append(arrays)
        return arrays
    return make


def test_the_next_call_of_the_same_kind_takes_them_once(stream, rng):
    ahead, owner, made = MadeAhead(1 << 20), object(), []
    assert ahead.take(owner, "kind") is None  # nothing made yet
    ahead.make_next(owner, ("kind", 1), _maker(rng, made))
    got = ahead.take(owner, ("kind", 1))
    assert got is made[0]
    assert ahead.take(owner, ("kind", 1)) is None  # handed out once


@pytest.mark.parametrize("other", ["owner", "kind", "stream"])
def test_another_call_gets_none_and_the_set_is_let_go(stream, rng, other):
    ahead, owner, made = MadeAhead(1 << 20), object(), []
    ahead.make_next(owner, "a", _maker(rng, made))
    if other == "owner":
        assert ahead.take(object(), "a") is None
    elif other == "kind":
        assert ahead.take(owner, "b") is None
    else:
        stream[0] += 1
        assert ahead.take(owner, "a") is None
        stream[0] -= 1
    assert ahead.take(owner, "a") is None  # not held for later: one set, let go


def test_one_set_per_thread_the_last_one_made(stream, rng):
    ahead, made = MadeAhead(1 << 20), []
    owners = [object() for _ in range(3)]
    for owner in owners:
        ahead.make_next(owner, "k", _maker(rng, made))
    assert ahead.take(owners[0], "k") is None
    ahead.make_next(owners[1], "k", _maker(rng, made))
    assert ahead.take(owners[1], "k") is made[-1]


def test_sets_above_the_bound_are_not_held(stream, rng):
    ahead, owner = MadeAhead(800), object()
    ahead.make_next(owner, "k", lambda: (np.zeros(100), None))     # 800 bytes: held
    assert ahead.take(owner, "k") is not None
    ahead.make_next(owner, "k", lambda: (np.zeros(100), np.zeros(1)))  # 808: made, not held
    assert ahead.take(owner, "k") is None


def test_out_of_memory_holds_nothing_and_raises_nothing(stream, rng):
    ahead, owner, made = MadeAhead(1 << 20), object(), []
    ahead.make_next(owner, "k", _maker(rng, made))

    def no_memory():
        raise cupy.cuda.memory.OutOfMemoryError(1 << 40, 0, 0)

    ahead.make_next(owner, "k", no_memory)
    assert ahead.take(owner, "k") is None  # the earlier set was let go too
    with pytest.raises(ValueError):  # any other error of make() is the caller's
        ahead.make_next(owner, "k", lambda: (_ for _ in ()).throw(ValueError("bug")))


def test_drop_lets_go(stream, rng):
    ahead, owner, made = MadeAhead(1 << 20), object(), []
    ahead.make_next(owner, "k", _maker(rng, made))
    ahead.drop()
    assert ahead.take(owner, "k") is None


def test_each_thread_takes_its_own(stream, rng):
    ahead, owner = MadeAhead(1 << 20), object()
    mine = (np.arange(4.0),)
    ahead.make_next(owner, "k", lambda: mine)
    seen = {}

    def other_thread():
        seen["before"] = ahead.take(owner, "k")
        theirs = (np.ones(2),)
        ahead.make_next(owner, "k", lambda: theirs)
        seen["theirs"] = ahead.take(owner, "k") is theirs

    t = threading.Thread(target=other_thread)
    t.start()
    t.join()
    assert seen == {"before": None, "theirs": True}
    assert ahead.take(owner, "k") is mine


def test_the_shared_instance_is_bounded():
    assert isinstance(workspace.made_ahead, MadeAhead)
    assert 0 < workspace.made_ahead.max_bytes <= 1 << 30
