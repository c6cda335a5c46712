"""The histogram kernels' packed word logic (ecc.cu, namespace packed), run on the CPU.

``packed::word_counts`` forms the contributions of two pixels per 32-bit word with SWAR
arithmetic (15-bit keys, bit 15 of each lane a comparison) and counts cells in pairs (a cube
with one of its squares). Its functions are plain integer code, so this test cuts them out of
``cuda_src/ecc.cu``, compiles them with the host's C++ compiler and checks them against an
ownership oracle written here from the definition, on random neighbourhoods with heavy ties
and pixels outside the image. The GPU tests check the same code inside the kernels.
"""
from __future__ import annotations

import itertools
import shutil
import subprocess

import numpy as np
import pytest

from cutopo._cuda.source import source_dir

OUTSIDE = 0x7FFF
CXX = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")

# The source between these markers is device code without CUDA intrinsics.
_SPANS = [("__host__ __device__ constexpr int pow3", "// The torus complex"),
          ("template <int NDIM>\n__device__ constexpr int level",
           "// Sweep the tiles [first, first + step, ...) of one image (64"),
          ("template <int NDIM>\nstruct TileWalk {",
           "template <int NDIM, bool TCONN, typename K, class KeyOf")]

_HARNESS = r"""
#include <cstdio>
#include <cstdint>
#include <vector>
#define __device__
#define __host__
#define __forceinline__ inline
typedef long long i64;
namespace cutopo { namespace ecc {
%(scalar)s
%(walk)s
namespace packed {
constexpr unsigned H = 0x80008000u;
%(packed)s
}
}}
using namespace cutopo::ecc;

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
        int32_t out[8] = {
            BASE + (int)(pos & 0xffffu) - (int)(neg & 0xffffu),
            BASE + (int)(pos >> 16) - (int)(neg >> 16),
            BASE + (int)(tpos & 0xffffu) - (int)(tneg & 0xffffu),
            BASE + (int)(tpos >> 16) - (int)(tneg >> 16),
            (int)((tties >> 15) & 1u), (int)((tties >> 31) & 1u),
            contribution<NDIM, TCONN>(s0), contribution<NDIM, TCONN>(s1)};
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

int main(int argc, char** argv) {
    if (argv[1][0] == 'w') return argv[2][0] == '2' ? walk<2>() : walk<3>();
    const int ndim = argv[1][0] - '0', tconn = argv[2][0] - '0';
    if (ndim == 2) return tconn ? run<2, true>() : run<2, false>();
    return tconn ? run<3, true>() : run<3, false>();
}
"""


def _cut(source: str, start: str, end: str) -> str:
    i, j = source.find(start), source.find(end)
    assert 0 <= i < j, f"ecc.cu no longer has the span {start!r} .. {end!r}: update this test"
    return source[i:j]


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    if CXX is None:
        pytest.skip("no host C++ compiler (c++, g++ or clang++) on PATH")
    source = (source_dir() / "ecc.cu").read_text()
    code = _HARNESS % {"scalar": _cut(source, *_SPANS[0]), "packed": _cut(source, *_SPANS[1]),
                       "walk": _cut(source, *_SPANS[2])}
    tmp = tmp_path_factory.mktemp("packed")
    (tmp / "harness.cpp").write_text(code)
    exe = tmp / "harness"
    subprocess.run([CXX, "-std=c++17", "-O1", "-o", str(exe), str(tmp / "harness.cpp")], check=True,
                   capture_output=True, text=True)
    return exe


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
    out = np.frombuffer(run.stdout, np.int32).reshape(-1, 8)
    want = _oracle(keys, ndim, tconn)  # (n, 2)
    assert np.any(want != (1 if not tconn else (-1) ** ndim)), "degenerate data"
    np.testing.assert_array_equal(out[:, 0:2], want)
    np.testing.assert_array_equal(out[:, 2:4], want)
    np.testing.assert_array_equal(out[:, 6:8], want)
    tied = (keys == keys[..., centre:centre + 1]).sum(axis=-1) > 1
    np.testing.assert_array_equal(out[:, 4:6].astype(bool), tied)


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
