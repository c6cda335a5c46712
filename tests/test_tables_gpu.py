"""GPU tests of cutopo._cuda.tables: memoized device arrays are ready for every stream at once,
and memory retired while a kernel on another stream still reads it is not handed out again
before that kernel is done."""
from __future__ import annotations

import numpy as np
import pytest

from gpu_support import busy, cupy_module

pytestmark = pytest.mark.gpu


def test_tables_made_on_a_busy_stream_are_ready_for_another(rng):
    """Measured before the module existed: 4 of 5 tables made by cupy.asarray on a stream with
    a 50 ms backlog read wrong from a second stream."""
    cp = cupy_module()
    from cutopo._cuda import tables

    slow, other = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
    for make in (tables.memoized, tables.upload,
                 lambda h: tables.made_ready(lambda: cp.asarray(h) * 1.0)):
        for _ in range(3):
            host = rng.random(300)
            busy(cp, slow)
            with slow:
                table = make(host)
            with other:
                copy = table * 1.0
                other.synchronize()
            np.testing.assert_array_equal(copy.get(), host)
            slow.synchronize()
    host = rng.random(7)
    assert tables.memoized(host) is tables.memoized(host.copy())


def test_retired_memory_waits_for_kernels_still_reading_it(rng):
    """A table retired while a kernel queued behind a backlog will read it: uploads of the same
    size that follow (which would reuse its block from the pool at once) must not change what
    that kernel reads."""
    cp = cupy_module()
    from cutopo._cuda import tables

    slow = cp.cuda.Stream(non_blocking=True)
    host = rng.random(4096)
    table = tables.upload(host)
    busy(cp, slow, 100)
    with slow:
        copy = table * 1.0                     # runs after the backlog
    tables.retire(table)
    del table
    for _ in range(tables.RETIRE_COUNT + 2):   # the pool's block of that size, over and over
        tables.retire(tables.upload(np.full(4096, -1.0)))
    slow.synchronize()
    np.testing.assert_array_equal(copy.get(), host)
