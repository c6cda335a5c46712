"""The soft ECT's CUDA kernels (ecc_band.cuh) run on the CPU through tests/ecc_host_build.py's
emulation, against the NumPy path: no GPU needed.

The kernels of ``_band_cupy.SoftEctPlan`` (the argument check, the orthant maps with their
tile counts, the compaction, the band forward and backward, the finalisation and the
cotangents' conversion) are compiled into one host program, and the plan's own methods run
with CuPy replaced by NumPy and every launch by a run of that program (the stand-in device of
tests/test_soft_ecc_kernels_host.py).
"""
from __future__ import annotations

import contextlib
import sys

import numpy as np
import pytest

import cutopo
from cutopo import _array, _band_cupy, _band_numpy, _ecc_cupy
from cutopo._band_numpy import band_halfwidth
from ecc_host_build import build
from test_soft_ecc_kernels_host import _close, _driver, _fake_cupy, _launch_class, _poisoned

from cutopo._cuda.workspace import MemsetWorkspaces


class _HostMemsetWorkspaces(MemsetWorkspaces):
    """MemsetWorkspaces on NumPy arrays: the memset a fill (the workspaces are kept and zeroed
    again at each call, as on the device)."""

    @staticmethod
    def zero(ws) -> None:
        ws.fill(0)

REALS = (np.dtype(np.float32), np.dtype(np.float64))


def _instances():
    """The kernels a SoftEctPlan launches, for both computation dtypes, both ranks and the
    cotangent dtypes the soft ECT asks for."""
    names = {_band_cupy.WRITE_ENTRIES_SCANNED.name}
    for ndim in (2, 3):
        names.add(_band_cupy._orthant_counted_sig(ndim).name)
        for real in REALS:
            names.add(_band_cupy._ect_sig("forward", real, ndim).name)
            names.add(_band_cupy._ect_sig("backward", real, ndim).name)
            for dirs in _band_cupy.DIRECTION_DTYPES:
                names.add(_band_cupy._check_arguments_sig(real, dirs, ndim).name)
    for real in REALS:
        names.add(_band_cupy._finalize_sig(real).name)
        for dirs in _band_cupy.DIRECTION_DTYPES:
            for other in (real, np.dtype(np.float64)):
                names.add(_band_cupy._finish_sig(dirs, other, other).name)
    return sorted(names)


INSTANCES = _instances()


@pytest.fixture(scope="module")
def emulator(tmp_path_factory):
    return build(tmp_path_factory, "ect_emulated", _driver(INSTANCES), soft=True)


class _Status:
    """PinnedStatus' stand-in: the device counters, and the two host words that the check's
    last block writes (flags in word 1, then the token in word 0)."""

    def __init__(self):
        self.counters = np.zeros(3, np.uint64)
        self.host = np.zeros(2, np.uint64)
        self.token = 0

    def arm(self) -> int:
        self.token += 1
        return self.token

    def read_status(self):
        word = int(self.host[0])
        assert word == self.token << 2, f"the check left host word 0 at {word:#x}"
        assert not self.counters.any(), "the check left its counters set"
        return 0, int(self.host[1])


@contextlib.contextmanager
def _emulated_device(emulator, resident):
    """Within: _band_cupy's SoftEctPlan runs on NumPy arrays, its launches in the emulator, on a
    device where ``resident`` blocks of any kernel run at once."""
    _array._cupy()  # the real CuPy (or None) memoized before the stand-in goes in
    log = []
    with pytest.MonkeyPatch.context() as m:
        m.setitem(sys.modules, "cupy", _fake_cupy())
        fixed = lambda sig, block, shared_mem=0, options=(): resident  # noqa: E731
        m.setattr(_ecc_cupy, "resident_blocks", fixed)
        m.setattr(_band_cupy, "resident_blocks", fixed)
        m.setattr(_band_cupy, "PreparedLaunch", _launch_class(emulator, log, INSTANCES))
        m.setattr(_band_cupy, "device_table", lambda host: np.ascontiguousarray(host))
        m.setattr(_band_cupy, "device_empty", _poisoned)
        m.setattr(_band_cupy, "MemsetWorkspaces", _HostMemsetWorkspaces)
        status = _Status()
        m.setattr(_band_cupy, "thread_status", lambda kind: status)
        yield log


def _mask(rng, shape):
    """Blobs with holes: thresholded smooth noise (critical pixels on curved boundaries)."""
    v = rng.standard_normal(shape)
    for a in range(len(shape) - 1, len(shape) - 1 - min(3, len(shape)), -1):
        for _ in range(3):
            v = v + np.roll(v, 1, axis=a) + np.roll(v, -1, axis=a)
    return v > np.quantile(v, rng.uniform(0.3, 0.7))


def _directions(rng, D, ndim, dtype):
    """Unit directions of every orthant, some on the axes (zero components: ties of heights)."""
    d = rng.standard_normal((D, ndim))
    d[: min(D, ndim)] = np.eye(ndim)[: min(D, ndim)]
    if D > ndim:
        d[ndim] = -1.0
    return (d / np.linalg.norm(d, axis=1, keepdims=True)).astype(dtype)


# (spatial shape, batch, D, T, thresholds per band, real dtype): bands of ~8 thresholds (two
# entries a pass), of ~20 (one entry a pass), wider than 32 (the accumulators' path), one threshold
CASES = [
    ((40, 37), 1, 12, 64, 8, "float32"),
    ((33, 70), 2, 9, 48, 20, "float32"),
    ((25, 31), 1, 7, 80, 45, "float64"),
    ((12, 14, 11), 1, 10, 40, 8, "float32"),
    ((9, 16, 13), 2, 6, 30, 12, "float64"),
    ((30, 30), 1, 5, 1, 4, "float32"),
    ((96, 90), 1, 2, 40, 8, "float32"),        # hundreds of entries a block: several rounds
    ((24, 26, 22), 1, 3, 30, 10, "float64"),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{'x'.join(map(str, c[0]))}-B{c[1]}-D{c[2]}-"
                                                     f"T{c[3]}-band{c[4]}-{c[5]}")
@pytest.mark.parametrize("resident", [1, 3, 40])
def test_emulated_soft_ect_equals_numpy(emulator, case, resident, rng):
    """SoftEctPlan's forward and backward (every cotangent) on the emulated kernels equal the
    NumPy path's soft_ect and its pullback, to the computation dtype's rounding; ``resident``
    blocks per device set how many blocks share each (image, direction)."""
    spatial, B, D, T, per_band, real = case
    real = np.dtype(real)
    ndim = len(spatial)
    mask = _mask(rng, (B,) + spatial)
    dirs = _directions(rng, D, ndim, real)
    reach = float(np.abs(dirs).sum(axis=1).max())
    t = np.sort(rng.uniform(-reach, reach, T)).astype(real)
    spacing = 2 * reach / max(T - 1, 1)
    scale = float(_band_numpy._BAND[real] / (per_band * spacing / 2))  # bands of ~per_band
    lam = real.type(scale)
    w = band_halfwidth(real, lam)
    out_np, pullback = cutopo.vjp(cutopo.soft_ect, mask, dirs, t, lam)
    g = rng.standard_normal(out_np.shape).astype(real)
    _, d_dirs_np, d_t_np, d_s_np = pullback(g)

    with _emulated_device(emulator, resident) as log:
        plan = _band_cupy.SoftEctPlan(B, spatial, D, T, real, dirs.dtype)
        results = []
        for _ in range(2):  # the second call on the workspaces the first left dirty
            workspace, dirs64, codes, flags = plan.arguments(t, dirs)
            assert int(flags.read()[0]) == 0, "the argument check failed"
            out, kept = plan.forward(np.ascontiguousarray(mask), workspace, dirs64, codes, t, lam, w)
            results.append((out,) + plan.backward(kept, t, g, lam, w, (True, True, True), real, real))
    names = [name for name, _, _ in log]
    assert names.count(_band_cupy._ect_sig("forward", real, ndim).name) == 2
    assert names.count(_band_cupy._ect_sig("backward", real, ndim).name) == 2
    for first, again in zip(*results):  # the same sums, in the same order
        np.testing.assert_array_equal(again, first)
    out, d_dirs, d_t, d_s = results[1]

    # bounds: each output a sum over the critical pixels of a direction (|c| <= ndim + 1 each)
    n_crit = float(np.abs(cutopo.euler_contributions(mask.astype(np.uint8), ndim=ndim)).sum()) * (1 << ndim)
    _close(out.reshape(out_np.shape), out_np, n_crit, real, "forward")
    g_sum = float(np.abs(g).sum()) * float(lam)
    _close(d_dirs, d_dirs_np, g_sum * n_crit, real, "directions' cotangent")
    _close(d_t, d_t_np, g_sum * n_crit, real, "thresholds' cotangent")
    _close(d_s, d_s_np, float(np.abs(g).sum()) * n_crit * (reach + w) * 4, real, "scale's cotangent")


@pytest.mark.parametrize("resident", [1, 40])
def test_emulated_argument_check_publishes_its_flags(emulator, resident, rng):
    """check_ect_arguments' last block stores the flags of every block in the host word and
    zeroes its counters, call after call on one status: unsorted and non-finite thresholds,
    a zero and a non-finite direction, then clean arguments again (~800 thresholds and
    directions: several blocks)."""
    T = D = 800
    t = np.sort(rng.uniform(-1, 1, T))
    dirs = _directions(rng, D, 2, np.float64)
    bad_order, bad_value = t.copy(), t.copy()
    bad_order[700], bad_order[701] = t[701], t[700]  # in the last block
    bad_value[5] = np.nan
    zero_dir, inf_dir = dirs.copy(), dirs.copy()
    zero_dir[650] = 0.0
    inf_dir[3, 1] = np.inf
    calls = [(bad_order, dirs, 2), (bad_value, dirs, 1), (t, zero_dir, 8), (t, inf_dir, 4 | 16),
             (t, dirs, 0)]
    with _emulated_device(emulator, resident):
        plan = _band_cupy.SoftEctPlan(1, (20, 20), D, T, np.dtype(np.float64), dirs.dtype)
        for thresholds, directions, expected in calls:
            *_, flags = plan.arguments(thresholds, directions)
            assert int(flags.read()[0]) == expected, (expected, int(flags.read()[0]))
