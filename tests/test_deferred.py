"""The control flow of deferred device checks (cutopo._cuda.deferred.reading), without a GPU:
the flags are read after the body on every path, and a failed check wins over the body's own
error. (The device copies themselves are exercised by the GPU tests of soft_ecc and CPAB.)"""
from __future__ import annotations

import numpy as np
import pytest

from cutopo._cuda.deferred import reading


class FakeFlags:
    def __init__(self, values):
        self.values, self.reads = np.asarray(values), 0

    def read(self):
        self.reads += 1
        return self.values


def raise_failed(values):
    if values[0]:
        raise ValueError(f"check {int(values[0])} failed")


def test_success_reads_once_after_the_body():
    flags, order = FakeFlags([0]), []
    with reading(flags, raise_failed) as f:
        assert f is flags and flags.reads == 0
        order.append("body")
    assert flags.reads == 1 and order == ["body"]


def test_a_failed_check_raises_after_the_body():
    flags, order = FakeFlags([3]), []
    with pytest.raises(ValueError, match="check 3 failed"):
        with reading(flags, raise_failed):
            order.append("body")
    assert order == ["body"] and flags.reads == 1


@pytest.mark.parametrize("error", [RuntimeError, ValueError, KeyboardInterrupt])
def test_the_body_error_propagates_when_the_checks_pass(error):
    flags = FakeFlags([0])
    with pytest.raises(error, match="from the body"):
        with reading(flags, raise_failed):
            raise error("from the body")
    assert flags.reads == 1


def test_a_failed_check_replaces_the_body_error():
    flags = FakeFlags([2])
    with pytest.raises(ValueError, match="check 2 failed") as info:
        with reading(flags, raise_failed):
            raise RuntimeError("a launch failed on bad input")
    assert isinstance(info.value.__cause__, RuntimeError)
    assert flags.reads == 1
