"""Logic of the ECC histogram kernels (cuda_src/ecc.cu), compiled for the host and run on the CPU.

Much of ecc.cu is plain integer and float code: ``packed::word_counts`` (the contributions
of two pixels per 32-bit word with SWAR arithmetic: 15-bit keys, bit 15 of each lane a
comparison, a cube counted with one of its squares), the scalar ``contribution`` and the
torus' ``torus_flips``, ``TileWalk`` (a block's tiles) and ``ThresholdBins`` (a value's
threshold bin: an estimate checked against a table of bin bounds). This test compiles ecc.cu
for the host (tests/ecc_host_build.py) with a driver that calls them directly, and checks them
against oracles: cell ownership from its definition (here
and tests/oracles.py's torus), the divided tile numbers, ``numpy.searchsorted``. The GPU tests
check the same code inside the kernels.
"""
from __future__ import annotations

import itertools
import subprocess

import numpy as np
import pytest

from ecc_host_build import build

OUTSIDE = 0x7FFF

_DRIVER = r"""
using namespace cutopo;
using namespace cutopo::ecc;
constexpr unsigned OUTSIDE = 0x7FFF;  // the test's outside key: above every level

// stdin: n, then n x 2 x 3^NDIM uint16 keys (pixel 0 then pixel 1 of each word); stdout: per
// word the contributions from word_counts without and with TIES, the tie bits, and the scalar
// contribution of each pixel, as int32.
template <int NDIM, bool TCONN>
int run() {
    constexpr int N = pow3(NDIM);
    int64_t n;
    if (fread(&n, sizeof n, 1, stdin) != 1) return 1;
    std::vector<uint16_t> keys(n * 2 * N);
    if (fread(keys.data(), 2, keys.size(), stdin) != keys.size()) return 1;
    constexpr int BASE = cell_sign<NDIM, TCONN>((N - 1) / 2);
    for (int64_t i = 0; i < n; ++i) {
        const uint16_t* k0 = &keys[i * 2 * N];
        const uint16_t* k1 = k0 + N;
        unsigned W[N];
        for (int j = 0; j < N; ++j) W[j] = k0[j] | ((unsigned)k1[j] << 16);
        unsigned pos, neg, ties = 0, tpos, tneg, tties;
        packed::word_counts<NDIM, TCONN, false>(W, pos, neg, ties);
        packed::word_counts<NDIM, TCONN, true>(W, tpos, tneg, tties);
        unsigned short s0[N], s1[N];
        for (int j = 0; j < N; ++j) { s0[j] = k0[j]; s1[j] = k1[j]; }
        // the same order as 32-bit keys (the box's carry-chain comparisons): spread over the
        // range from 0 up, and packed just below the outside key
        unsigned w0[N], w1[N], u0[N], u1[N];
        for (int j = 0; j < N; ++j) {
            w0[j] = k0[j] == OUTSIDE ? ~0u : k0[j] * 0x20003u;
            w1[j] = k1[j] == OUTSIDE ? ~0u : k1[j] * 0x20003u;
            u0[j] = k0[j] == OUTSIDE ? ~0u : k0[j] + 0xFFFF8000u;
            u1[j] = k1[j] == OUTSIDE ? ~0u : k1[j] + 0xFFFF8000u;
        }
        int32_t out[12] = {
            BASE + (int)(pos & 0xffffu) - (int)(neg & 0xffffu),
            BASE + (int)(pos >> 16) - (int)(neg >> 16),
            BASE + (int)(tpos & 0xffffu) - (int)(tneg & 0xffffu),
            BASE + (int)(tpos >> 16) - (int)(tneg >> 16),
            (int)((tties >> 15) & 1u), (int)((tties >> 31) & 1u),
            contribution<NDIM, TCONN>(s0), contribution<NDIM, TCONN>(s1),
            contribution<NDIM, TCONN>(w0), contribution<NDIM, TCONN>(w1),
            contribution<NDIM, TCONN>(u0), contribution<NDIM, TCONN>(u1)};
        fwrite(out, sizeof out, 1, stdout);
    }
    return 0;
}

// stdin: n, then n x (ntx, nty, ntz, first, step) int64 (ntz = 1 for NDIM 2); stdout: per
// case the count of tiles visited, then their (x, y, z), int64.
template <int NDIM>
int walk() {
    int64_t n, c[5];
    if (fread(&n, sizeof n, 1, stdin) != 1) return 1;
    for (int64_t i = 0; i < n; ++i) {
        if (fread(c, sizeof c, 1, stdin) != 1) return 1;
        std::vector<int64_t> seen;
        for (TileWalk<NDIM> w(c[0], c[1], c[2], c[3], c[4]); w.valid(); w.next()) {
            seen.push_back(w.x());
            seen.push_back(w.y());
            seen.push_back(w.z());
        }
        const int64_t count = seen.size() / 3;
        fwrite(&count, sizeof count, 1, stdout);
        fwrite(seen.data(), sizeof(int64_t), seen.size(), stdout);
    }
    return 0;
}

// stdin: T, estimate, t0, inv_dt (int64, int64, float64, float64), the (T + 1) x 2 table in
// Cmp, n (int64), n values in Cmp; stdout: their bins, int32.
template <typename Cmp>
int bins() {
    int64_t T, estimate, n;
    double t0, inv_dt;
    if (fread(&T, 8, 1, stdin) != 1 || fread(&estimate, 8, 1, stdin) != 1 || fread(&t0, 8, 1, stdin) != 1 ||
        fread(&inv_dt, 8, 1, stdin) != 1) return 1;
    std::vector<Bounds<Cmp>> table(T + 1);
    if (fread(table.data(), sizeof(Bounds<Cmp>), T + 1, stdin) != (size_t)(T + 1)) return 1;
    if (fread(&n, 8, 1, stdin) != 1) return 1;
    std::vector<Cmp> v(n);
    if (fread(v.data(), sizeof(Cmp), n, stdin) != (size_t)n) return 1;
    const ThresholdBins<Cmp> b(table.data(), (int)T, (int)estimate, t0, inv_dt);
    std::vector<int32_t> out(n);
    for (int64_t i = 0; i < n; ++i) out[i] = b(v[i]);
    fwrite(out.data(), 4, n, stdout);
    return 0;
}

// stdin: the torus image's shape (NDIM int64), then its keys (uint32, C order); stdout: every
// pixel's contribution, int32, as the periodic sweeps form it (neighbours wrapped, the index
// tie-break flipped across the wrap by torus_flips).
template <int NDIM, bool TCONN>
int torus() {
    constexpr int N = pow3(NDIM);
    int64_t n[NDIM], size = 1;
    if (fread(n, 8, NDIM, stdin) != NDIM) return 1;
    for (int a = 0; a < NDIM; ++a) size *= n[a];
    std::vector<uint32_t> key(size);
    if (fread(key.data(), 4, size, stdin) != (size_t)size) return 1;
    std::vector<int32_t> out(size);
    for (int64_t i = 0; i < size; ++i) {
        i64 p[NDIM], nn[NDIM];
        int64_t r = i;
        for (int a = NDIM - 1; a >= 0; --a) { p[a] = r % n[a]; r /= n[a]; nn[a] = n[a]; }
        unsigned nb[N];
        for (int j = 0; j < N; ++j) {
            int64_t q = 0;
            for (int a = 0; a < NDIM; ++a) q = q * n[a] + (p[a] + digit<NDIM>(j, a) + n[a]) % n[a];
            nb[j] = key[q];
        }
        out[i] = contribution<NDIM, TCONN>(nb, torus_flips<NDIM>(p, nn));
    }
    fwrite(out.data(), 4, size, stdout);
    return 0;
}

int main(int argc, char** argv) {
    if (argv[1][0] == 'w') return argv[2][0] == '2' ? walk<2>() : walk<3>();
    if (argv[1][0] == 't') {
        const int ndim = argv[2][0] - '0', tconn = argv[3][0] - '0';
        if (ndim == 2) return tconn ? torus<2, true>() : torus<2, false>();
        return tconn ? torus<3, true>() : torus<3, false>();
    }
    if (argv[1][0] == 'b') {
        switch (argv[2][0]) {
            case 'f': return bins<float>();
            case 'd': return bins<double>();
            case 'i': return bins<int>();
            default: return bins<long long>();
        }
    }
    const int ndim = argv[1][0] - '0', tconn = argv[2][0] - '0';
    if (ndim == 2) return tconn ? run<2, true>() : run<2, false>();
    return tconn ? run<3, true>() : run<3, false>();
}
"""


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    return build(tmp_path_factory, "ecc_logic", _DRIVER)


def _oracle(keys: np.ndarray, ndim: int, tconn: bool) -> np.ndarray:
    """c of the centre of each neighbourhood keys[..., 3^ndim] (neighbour j at offset digits of
    j - 1 per axis, C order), from the definition: a cell is owned by its latest vertex (V) or
    its earliest adjacent pixel (T) in the order (key, position in C order)."""
    rank = keys.astype(np.int64) * 27 + np.arange(keys.shape[-1])  # C order breaks key ties
    centre = (3 ** ndim - 1) // 2
    c = np.zeros(keys.shape[:-1], np.int64)
    for o in itertools.product((-1, 0, 1), repeat=ndim):
        # the pixels of the cell (V) / sharing the face (T) that offset o stands for
        members = [sum((s + 1) * 3 ** (ndim - 1 - a) for a, s in enumerate(sub))
                   for sub in itertools.product(*[(0, d) if d else (0,) for d in o])]
        group = rank[..., members]
        owner = group.min(axis=-1) if tconn else group.max(axis=-1)
        k = sum(d != 0 for d in o)
        dim = ndim - k if tconn else k
        c += np.where(owner == rank[..., centre], (-1) ** dim, 0)
    return c


@pytest.mark.parametrize("ndim", [2, 3])
@pytest.mark.parametrize("tconn", [False, True])
def test_word_counts_equal_the_ownership_oracle(harness, ndim, tconn, rng):
    N = 3 ** ndim
    parts = []
    for levels in (2, 3, 5, 40, 4097):  # heavy ties to nearly distinct keys
        k = rng.integers(0, levels, size=(6000, 2, N)).astype(np.uint16)
        k[rng.random(k.shape) < 0.15] = OUTSIDE  # neighbours outside the image
        parts.append(k)
    keys = np.concatenate(parts)
    centre = (N - 1) // 2
    keys[..., centre] = np.where(keys[..., centre] == OUTSIDE, 7, keys[..., centre])
    stdin = np.int64(keys.shape[0]).tobytes() + keys.tobytes()
    run = subprocess.run([str(harness), str(ndim), str(int(tconn))], input=stdin, capture_output=True,
                         check=True, timeout=120)
    out = np.frombuffer(run.stdout, np.int32).reshape(-1, 12)
    want = _oracle(keys, ndim, tconn)  # (n, 2)
    assert np.any(want != (1 if not tconn else (-1) ** ndim)), "degenerate data"
    np.testing.assert_array_equal(out[:, 0:2], want)
    np.testing.assert_array_equal(out[:, 2:4], want)
    np.testing.assert_array_equal(out[:, 6:8], want)
    np.testing.assert_array_equal(out[:, 8:10], want)  # 32-bit keys from 0
    np.testing.assert_array_equal(out[:, 10:12], want)  # 32-bit keys up to 2^32 - 2
    assert np.any(keys[..., centre] == 0), "no centre of key 0"
    tied = (keys == keys[..., centre:centre + 1]).sum(axis=-1) > 1
    np.testing.assert_array_equal(out[:, 4:6].astype(bool), tied)


@pytest.mark.parametrize("shape", [(3, 3), (4, 7), (5, 3), (3, 3, 3), (3, 4, 5)])
@pytest.mark.parametrize("tconn", [False, True])
def test_torus_contributions_equal_the_periodic_oracle(harness, shape, tconn, rng):
    """The periodic sweeps' contribution (neighbours wrapped, torus_flips reversing the index
    tie-break across the wrap) against tests/oracles.py's torus ownership, with ties."""
    from oracles import periodic_contributions_oracle

    for levels in (2, 4, 1000):
        keys = rng.integers(0, levels, size=shape).astype(np.uint32)
        stdin = np.asarray(shape, np.int64).tobytes() + keys.tobytes()
        run = subprocess.run([str(harness), "t", str(len(shape)), str(int(tconn))], input=stdin,
                             capture_output=True, check=True, timeout=120)
        got = np.frombuffer(run.stdout, np.int32).reshape(shape)
        want = periodic_contributions_oracle(keys, connectivity=len(shape) if tconn else 1)
        np.testing.assert_array_equal(got, want)
        assert got.sum() == 0  # the Euler characteristic of a torus


@pytest.mark.parametrize("ndim", [2, 3])
def test_tile_walk_visits_the_tiles_of_the_division(harness, ndim, rng):
    """The sweeps' TileWalk (a block's tiles first, first + step, ...; in 2D as a column and row
    advanced with a carry) against the tile numbers divided out, on grids and steps of every
    relation (a step below one row of tiles, past a plane, past the grid; a first tile past the
    end)."""
    cases = [(1, 1, 1, 0, 1), (5, 1, 1, 7, 3), (3, 4, 5, 0, 1), (3, 4, 5, 59, 1), (3, 4, 5, 60, 1),
             (7, 1, 9, 2, 7), (2, 3, 1, 1, 6), (4, 4, 4, 5, 17), (1, 9, 2, 0, 5)]
    for _ in range(300):
        ntx, nty, ntz = (int(v) for v in rng.integers(1, 12, 3))
        n = ntx * nty * ntz
        cases.append((ntx, nty, ntz, int(rng.integers(0, n + 3)), int(rng.integers(1, 2 * n + 2))))
    big = 3 * 2**31  # coordinates past 32 bits
    cases += [(big, 2, 1, big - 1, big + 5), (2, big, 2, 1, 2 * big - 1)]
    if ndim == 2:  # one plane
        cases = [(ntx, nty, 1, first, step) for ntx, nty, _, first, step in cases]
    stdin = np.int64(len(cases)).tobytes() + np.asarray(cases, np.int64).tobytes()
    out = np.frombuffer(subprocess.run([str(harness), "w", str(ndim)], input=stdin, capture_output=True,
                                       check=True, timeout=120).stdout, np.int64)
    at = 0
    for ntx, nty, ntz, first, step in cases:
        want = [(t % ntx, t // ntx % nty, t // (ntx * nty)) for t in range(first, ntx * nty * ntz, step)]
        count = int(out[at])
        got = out[at + 1:at + 1 + 3 * count].reshape(-1, 3)
        at += 1 + 3 * count
        assert [tuple(int(v) for v in row) for row in got] == want, (ntx, nty, ntz, first, step)
    assert at == out.size


def _off(estimate, rng):
    """A wrong estimate (t0 a few bins off, 1/dt scaled): for 8-byte integer comparisons the
    kernel checks every guess against the table and walks to the right bin, so any guess gives
    the same bins. (Float and 16-bit integer bins take one step from the guess, which the
    host's conditions keep within one bin: only its own estimate is theirs.)"""
    if estimate is None:
        return None
    t0, inv_dt = estimate
    return t0 + rng.uniform(-7, 7) / inv_dt, inv_dt * rng.uniform(0.8, 1.25)


def _run_bins(harness, code, cmp_dtype, table, estimate, values):
    t0, inv_dt = estimate if estimate is not None else (0.0, 0.0)
    stdin = (np.array([table.shape[0] - 1, estimate is not None], np.int64).tobytes()
             + np.array([t0, inv_dt], np.float64).tobytes()
             + np.ascontiguousarray(table, cmp_dtype).tobytes()
             + np.int64(values.size).tobytes() + np.ascontiguousarray(values, cmp_dtype).tobytes())
    run = subprocess.run([str(harness), "b", code], input=stdin, capture_output=True, check=True,
                         timeout=120)
    return np.frombuffer(run.stdout, np.int32)


def _threshold_sets(rng, dtype, lo=None, hi=None):
    """Sorted thresholds of ``dtype`` (within [lo, hi] when given): evenly spaced at random
    offsets and spans (the estimate's case), jittered, random, with repeats, tiny sets."""
    sets = []
    for _ in range(60):
        T = int(rng.choice([1, 2, 3, 5, 17, 256, 1000]))
        if lo is None:
            scale = 10.0 ** rng.integers(-4, 5)
            far = rng.uniform(-1, 1) * 10.0 ** rng.integers(-4, 5)
            t0 = float(rng.choice([0.0, scale * rng.uniform(-3, 3), far]))
        else:
            t0, scale = sorted(rng.uniform(lo, hi, 2))
            scale -= t0
        t = t0 + np.linspace(0.0, scale, T)
        kind = rng.choice(5, p=[0.35, 0.25, 0.15, 0.15, 0.1])
        if kind == 4 and lo is None and dtype.kind == "f" and T >= 3:
            # At the host's limits for the estimate: t_0 so far from 0 that
            # (|t_0| + |t_{T-1}|) / dt + T is just under 2^21 (float32) or 2^50 (float64), and
            # every t_k up to dt/4 off the line.
            dt = scale / (T - 1)
            limit = 2.0 ** (21 if dtype.itemsize <= 4 else 50)
            t0 = rng.choice([-1, 1]) * (limit * rng.uniform(0.97, 0.995) - 2 * T) * dt / 2
            t = t0 + dt * np.arange(T)
            kind = 1
        if kind == 1:
            t = t + rng.uniform(-0.25, 0.25, T) * scale / max(T - 1, 1)
        elif kind == 2:
            t = t0 + rng.uniform(0, scale, T)
        elif kind == 3:
            t = np.repeat(t[: (T + 1) // 2], 2)[:T]
        if dtype.kind in "iu":
            t = np.round(t if lo is not None else t * (1000 / scale))
            t = np.clip(t, np.iinfo(dtype).min, np.iinfo(dtype).max)
        sets.append(np.sort(t.astype(dtype)))
    return sets


def _probe_values(rng, t, dtype):
    """Every threshold and its neighbours, special and extreme values, random ones."""
    if dtype.kind == "f":
        info = np.finfo(dtype)
        special = np.array([np.nan, -np.nan, np.inf, -np.inf, 0.0, -0.0, info.smallest_subnormal,
                            -info.smallest_subnormal, info.tiny / 3, info.max, -info.max], dtype)
        near = np.concatenate([t, np.nextafter(t, dtype.type(np.inf)), np.nextafter(t, dtype.type(-np.inf))])
        span = float(t[-1]) - float(t[0]) + 1.0
        spread = (float(t[0]) + rng.uniform(-0.5, 1.5, 3000) * span).astype(dtype)
        bits = rng.integers(0, 2**(8 * dtype.itemsize), 300, dtype=np.uint64, endpoint=False)
        raw = bits.astype(np.dtype(f"u{dtype.itemsize}")).view(dtype)
        return np.concatenate([special, near, spread, raw])
    info = np.iinfo(dtype)
    return np.concatenate([np.array([info.min, info.max, 0, -1], dtype), t, t + 1, t - 1,
                           rng.integers(int(t[0]) - 50, int(t[-1]) + 50, 3000).astype(dtype)])


@pytest.mark.parametrize("dtype, code", [("float32", "f"), ("float64", "d"), ("int64", "l")])
def test_threshold_bins_equal_searchsorted(harness, dtype, code, rng):
    """ThresholdBins with the host's table (_ecc_cupy._threshold_table) and estimate
    (_uniform_estimate) gives the first k with v <= t_k (T where none, NaN included) for the
    comparison types of float32, float64 and integer images."""
    from cutopo._ecc_cupy import _threshold_table, _uniform_estimate

    dtype = np.dtype(dtype)
    estimated = 0
    for t in _threshold_sets(rng, dtype):
        values = _probe_values(rng, t, dtype)
        estimate = _uniform_estimate(t)
        estimated += estimate is not None
        want = np.searchsorted(t, values, side="left")  # NaN sorts last: T
        guesses = (estimate, _off(estimate, rng)) if dtype.kind in "iu" else (estimate,)
        for guess in guesses:  # 8-byte integers: the walk from a guess bins away, too
            got = _run_bins(harness, code, dtype, _threshold_table(t, dtype), guess, values)
            bad = np.flatnonzero(got != want)
            assert bad.size == 0, (t[:5], t.size, guess, values[bad[:5]], got[bad[:5]], want[bad[:5]])
    assert estimated >= 10, "too few threshold sets took the estimate"


@pytest.mark.parametrize("image_dtype", ["uint16", "int16"])
@pytest.mark.parametrize("t_dtype", ["float32", "float64", "int64", "uint16"])
def test_16bit_image_bins_on_integer_bounds(harness, image_dtype, t_dtype, rng):
    """16-bit images bin in int32 against floor(t) clipped (_integer_threshold_table) with the
    float32 estimate, for every value of the dtype: the bins NumPy's comparison in
    result_type(image, thresholds) gives."""
    from cutopo._ecc_cupy import _integer_threshold_table, _uniform_estimate

    image_dtype, t_dtype = np.dtype(image_dtype), np.dtype(t_dtype)
    info = np.iinfo(image_dtype)
    values = np.arange(info.min, info.max + 1)
    estimated = 0
    span = float(info.max) - float(info.min)
    lo, hi = info.min - 0.2 * span, info.max + 0.2 * span
    if t_dtype.kind in "iu":
        lo, hi = max(lo, np.iinfo(t_dtype).min), min(hi, np.iinfo(t_dtype).max)
    for t in _threshold_sets(rng, t_dtype, lo, hi):
        rt = np.result_type(image_dtype, t_dtype)
        tc = t.astype(rt)
        estimate = _uniform_estimate(tc, float_guess=True)
        estimated += estimate is not None
        want = np.searchsorted(tc, values.astype(image_dtype).astype(rt), side="left")
        got = _run_bins(harness, "i", np.dtype("int32"), _integer_threshold_table(tc), estimate, values)
        bad = np.flatnonzero(got != want)
        assert bad.size == 0, (tc[:5], tc.size, estimate, values[bad[:5]], got[bad[:5]], want[bad[:5]])
    assert estimated >= 5, "too few threshold sets took the estimate"
