"""The soft ECC kernels run whole on the CPU: ecc_soft.cuh compiled for the host, a block's
threads as fibers of one host thread (tests/ecc_host_build.py, ``soft=True``).

The GPU tests (test_band_gpu.py) check the soft ECC on the device; CI has no GPU. Here the
CuPy path itself runs: cutopo._soft_ecc_cupy's SoftEccPlan, soft_ecc_forward and
soft_ecc_backward are called on NumPy arrays, with stand-ins for CuPy (allocations: NumPy
arrays, those of ``cupy.empty`` poisoned), for the device's size (``resident_blocks``: the
blocks per image and 3D chunks that _ecc_cupy._plan then picks), for the pinned check word
and for PreparedLaunch, which runs each launch's kernel in the emulator with the launch's own
signature, grid, dynamic shared memory and arguments (the call-time ones in its slots,
scalars converted as a launch converts them). So the kernels get exactly what the module
gives them on a GPU: the forward instance (packed or not), the workspaces, the kept entries
and the two backward launches, shared or global accumulators; and a drift between the
module and the kernels (an argument's order, type or count, too little shared memory, a
workspace too small) fails here: the driver checks every argument against the kernel's
parameter types and every write against the arrays' and the shared memory's ends. The
results are compared with the NumPy path (the op's forward and backward that cutopo.vjp runs)
to the rounding of the computation dtype relative to the size of the sums, as
test_band_gpu.py does on the device.

What only a GPU shows stays with the GPU tests: CUDA's expf/exp (within 2 ulps) against the
host's, fused multiply-adds, -ftz=true, warp timing, blocks that run together (here one
block runs at a time, so the last block of an image to finish is the last one launched) and
the static shared memory's limit (test_module_sizes_match_the_kernels checks the module's
reserve against the kernels' structures).
"""
from __future__ import annotations

import contextlib
import math
import re
import subprocess
import sys
import types

import numpy as np
import pytest

import cutopo
from cutopo import _array, _band_numpy, _ecc_cupy, _ecc_numpy, _soft_ecc, _soft_ecc_cupy
from cutopo._checks import THRESHOLDS_NOT_FINITE, THRESHOLDS_NOT_SORTED
from cutopo._cuda.launch import HOST_WORD, NULL, _convert
from cutopo._cuda.workspace import made_ahead
from ecc_host_build import build

CASES = [
    # shape, image dtype, thresholds dtype, ndim, connectivity, boundary, T, thresholds per
    # band (about: the scale is chosen for it; above 32 the bands wider than a warp's window),
    # resident blocks of the stand-in device (_ecc_cupy._plan's blocks per image and 3D chunks
    # follow; test_cases_cover_the_launches checks what the list covers). Odd images of a
    # batch are noise, whose kept entries overflow; rows and planes end mid-tile.
    # 2D float32, box: the packed forward; a tile away from every edge (x0 = 64, y0 = 32) with
    # 16-byte rows (its vector reads), one tile per block
    ((2, 70, 136), "float32", "float32", 2, 1, "box", 40, 12, 64),
    ((3, 45, 77), "float32", "float32", 2, 2, "box", 60, 45, 1),      # 4 tiles per block
    ((100, 200), "float32", "float32", 2, 2, "box", 50, 16, 3),       # 16 tiles, 6 blocks
    ((2, 35, 70), "float32", "float32", 2, 1, "box", 1, 1, 4),        # one threshold: all tie
    ((2, 40, 50), "float32", "float64", 2, 1, "periodic", 30, 8, 3),  # float64 sums
    ((3, 33, 34), "float64", "float64", 2, 2, "periodic", 30, 10, 2),
    ((2, 9, 35, 40), "float32", "float32", 3, 1, "box", 20, 10, 16),  # 2-plane chunks
    ((7, 34, 33), "float32", "float32", 3, 3, "periodic", 40, 36, 2),
    ((2, 3, 34, 5), "float32", "float64", 3, 1, "periodic", 20, 8, 4),  # wraps on both sides
    ((70, 136), "float64", "float64", 2, 2, "box", 30, 10, 64),       # packed, double keys
    ((2, 6, 33, 40), "float64", "float64", 3, 3, "box", 20, 6, 3),    # 64-bit keys
    ((2, 40, 70), "uint8", "float32", 2, 1, "box", 30, 10, 3),        # packed, exact keys
    ((2, 33, 64), "bool", "float32", 2, 2, "box", 5, 3, 2),
    ((40, 70), "int16", "float32", 2, 2, "box", 16, 5, 64),           # 2D box, scalar sweep
    ((3, 4, 33, 35), "uint16", "float32", 3, 3, "box", 24, 8, 8),
    ((5, 20, 35), "int32", "float64", 3, 1, "box", 20, 10, 2),        # 64-bit keys
    ((2, 40, 66), "float16", "float32", 2, 1, "box", 20, 12, 4),      # packed, float16
    ((30, 40), "float32", "float32", 2, 1, "box", 2000, 60, 4),       # global accumulators
    ((2, 5, 12, 20), "float64", "float64", 3, 1, "box", 1500, 40, 2),
]


def _case(dtype, ndim, boundary="box"):
    """The first of CASES with that image dtype, rank and boundary."""
    return next(c for c in CASES if c[1] == dtype and c[3] == ndim and c[5] == boundary)


def _config(shape, dtype, t_dtype, ndim, connectivity, boundary, scale=1.0):
    """The NumPy path's _Config of such a call (the computation dtype, lambda, w, ...)."""
    image = np.zeros(shape, dtype)
    return _soft_ecc._prepare(image, np.zeros(1, t_dtype), scale, ndim, connectivity, boundary)


def _instances():
    """The kernel instances (Signature names) that SoftEccPlan launches for CASES."""
    names = set()
    for shape, dtype, t_dtype, ndim, conn, boundary, *_ in CASES:
        cfg = _config(shape, dtype, t_dtype, ndim, conn, boundary)
        for kind, listed in (("forward", False), ("backward", False), ("backward", True)):
            names.add(_soft_ecc_cupy._sweep_sig(kind, np.dtype(dtype), cfg.dtype, ndim, cfg.tconn,
                                                cfg.periodic, listed).name)
        if ndim == 3:  # the listed forward's (LISTED_FORWARD_MIN_VOXELS)
            names |= {_soft_ecc_cupy._sweep_sig("list", np.dtype(dtype), cfg.dtype, ndim, cfg.tconn,
                                                cfg.periodic).name,
                      _soft_ecc_cupy._listed_forward_sig(np.dtype(dtype), cfg.dtype).name}
    return sorted(names)


INSTANCES = _instances()

_DRIVER = r"""
#include <string>
#include <tuple>
#include <type_traits>

// Bytes past a launch's dynamic shared memory, and past each of its arrays, that the kernel
// must leave as they were poisoned: a write there is out of bounds (a launch that asked for
// too little shared memory, an array too small).
constexpr size_t GUARD = 4096;

// Runs a kernel's grid, block after block, each block as THREADS fibers (emu::Fibers); the
// error, if a block deadlocked or wrote past its ``shared`` bytes of dynamic shared memory.
template <class Launch>
std::string run_grid(unsigned blocks, size_t shared, Launch launch) {
    blockDim = {(unsigned)emu::THREADS, 1, 1};
    gridDim = {blocks, 1, 1};
    const std::function<void()> body = launch;
    for (unsigned b = 0; b < blocks; ++b) {
        blockIdx = {b, 0, 0};
        std::memset(emu::dynamic_smem, 0xA5, sizeof emu::dynamic_smem);  // poisoned
        if (!emu::run_block_fibers(body))
            return "block " + std::to_string(b) + ": its threads deadlocked at a barrier";
        for (size_t i = shared; i < shared + GUARD; ++i)
            if (emu::dynamic_smem[i] != 0xA5)
                return "block " + std::to_string(b) + " wrote past its " + std::to_string(shared) +
                       " bytes of dynamic shared memory";
    }
    return "";
}

// A launch's arguments, read from stdin in the kernel's parameter order: per parameter a
// record of three int64 (tag: 0 null pointer, 1 array, 2 integer, 3 real; the size of an
// element or of the value as the Signature declares it; the element count), then the array's
// elements, or the value as one int64 (integer) or float64 (real). Each record must match the
// parameter's C++ type (integer or real, its size, the value exact in it): a signature that
// drifted from the kernel fails here instead of running on garbage.
struct Arguments {
    struct Buffer {
        std::vector<uint4> data;  // 16-byte aligned, as device allocations (vector reads)
        size_t bytes = 0;
        bool null = true, writable = false;
        std::vector<unsigned char> sent;  // a read-only array's bytes, checked after the launch
    };
    std::vector<Buffer> buffers;  // the pointer parameters, in order
    std::string error;

    bool fail(const std::string& why) {
        if (error.empty()) error = why;
        return false;
    }

    template <class P>
    P get(int index) {
        int64_t rec[3];
        if (fread(rec, 8, 3, stdin) != 3) return fail("stdin ended"), P();
        const std::string at = "parameter " + std::to_string(index) + ": ";
        if constexpr (std::is_pointer_v<P>) {
            using E = std::remove_pointer_t<P>;
            Buffer b;
            if (rec[0] == 0) {
                buffers.push_back(std::move(b));
                return nullptr;
            }
            if (rec[0] != 1 || rec[1] != (int64_t)sizeof(E))
                return fail(at + "an array of " + std::to_string(sizeof(E)) + "-byte elements expected"), P();
            b.null = false;
            b.writable = !std::is_const_v<E>;
            b.bytes = (size_t)rec[1] * (size_t)rec[2];
            b.data.resize((b.bytes + GUARD) / 16 + 1);
            unsigned char* bytes = reinterpret_cast<unsigned char*>(b.data.data());
            std::memset(bytes + b.bytes, 0xA5, GUARD);  // past the end: checked after the launch
            if (fread(bytes, 1, b.bytes, stdin) != b.bytes) return fail("stdin ended"), P();
            if (!b.writable) {
                const unsigned char* p = reinterpret_cast<const unsigned char*>(b.data.data());
                b.sent.assign(p, p + b.bytes);
            }
            buffers.push_back(std::move(b));
            return reinterpret_cast<P>(buffers.back().data.data());
        } else if constexpr (std::is_integral_v<P>) {
            int64_t v;
            if (fread(&v, 8, 1, stdin) != 1) return fail("stdin ended"), P();
            if (rec[0] != 2 || rec[1] != (int64_t)sizeof(P) || (int64_t)(P)v != v)
                return fail(at + "a " + std::to_string(sizeof(P)) + "-byte integer expected"), P();
            return (P)v;
        } else {
            double v;
            if (fread(&v, 8, 1, stdin) != 1) return fail("stdin ended"), P();
            if (rec[0] != 3 || rec[1] != (int64_t)sizeof(P) || !((double)(P)v == v || v != v))
                return fail(at + "a " + std::to_string(sizeof(P)) + "-byte real expected"), P();
            return (P)v;
        }
    }
};

// Reads the arguments of ``kernel``, runs its grid and writes back, per pointer parameter, the
// count of bytes that follow (0 for a null or read-only one) and the array's bytes.
template <class... P, size_t... I>
int run(unsigned grid, size_t shared, void (*kernel)(P...), std::index_sequence<I...>) {
    Arguments a;
    a.buffers.reserve(sizeof...(P));
    std::tuple<P...> args{a.get<P>((int)I)...};  // a braced list: read in parameter order
    if (!a.error.empty()) {
        fprintf(stderr, "%%s\n", a.error.c_str());
        return 4;
    }
    const std::string error = run_grid(grid, shared, [&] { std::apply(kernel, args); });
    if (!error.empty()) {
        fprintf(stderr, "%%s\n", error.c_str());
        return 5;
    }
    for (size_t i = 0; i < a.buffers.size(); ++i) {
        const auto& b = a.buffers[i];
        const unsigned char* bytes = reinterpret_cast<const unsigned char*>(b.data.data());
        if (!b.null && !b.writable && std::memcmp(bytes, b.sent.data(), b.bytes) != 0) {
            fprintf(stderr, "the kernel wrote into its read-only array %%zu\n", i);
            return 6;
        }
        for (size_t k = b.bytes; !b.null && k < b.bytes + GUARD; ++k)
            if (bytes[k] != 0xA5) {
                fprintf(stderr, "the kernel wrote past the end of its array %%zu\n", i);
                return 6;
            }
        const int64_t n = b.writable ? (int64_t)b.bytes : 0;
        fwrite(&n, 8, 1, stdout);
        fwrite(b.data.data(), 1, n, stdout);
    }
    return 0;
}

template <class... P>
int run(unsigned grid, size_t shared, void (*kernel)(P...)) {
    return run(grid, shared, kernel, std::index_sequence_for<P...>());
}

// The sizes that cutopo/_soft_ecc_cupy.py sizes shared memory and workspaces with, as int64
// (see test_module_sizes_match_the_kernels).
int sizes() {
    using namespace cutopo::ecc;
    using namespace cutopo::ecc::band;
    const int64_t v[] = {
        band::THREADS, band::WARPS, ROW_SLOTS, PACKED_SLOTS, PLANE, packed::PLANEW, TX, TY,
        packed::TXP, BACKWARD_COPIES, (int64_t)sizeof(RowQueues), (int64_t)sizeof(PackedQueues),
        (int64_t)sizeof(Window<float, SOFT_PAIRS>), (int64_t)sizeof(Window<double, SOFT_PAIRS>),
        (int64_t)sizeof(ForwardWork<float>), (int64_t)sizeof(ForwardWork<double>),
        (int64_t)sizeof(KeptSink), forward_workspace_words(5, 37), forward_workspace_words(6, 1000),
        backward_workspace_words(37),
        (int64_t)sizeof(BlockQueue<block_queue_cap<unsigned>()>),
        (int64_t)sizeof(BlockQueue<block_queue_cap<unsigned long long>()>), TRANSPOSED_BAND,
        transposed_warp_words<float>(), transposed_warp_words<double>()};
    fwrite(v, 8, sizeof v / 8, stdout);
    return 0;
}

// stdin: the instance (its index in the test's INSTANCES; -1: sizes()), grid, block, dynamic
// shared bytes (int64 each), then the arguments (Arguments).
int main() {
    int64_t head[4];
    if (fread(head, 8, 4, stdin) != 4) return 2;
    if (head[0] == -1) return sizes();
    if (head[2] != emu::THREADS || head[3] < 0 || head[3] + GUARD > sizeof emu::dynamic_smem) return 3;
    const unsigned grid = (unsigned)head[1];
    const size_t shared = (size_t)head[3];
    switch (head[0]) {
%(instances)s
    }
    return 3;
}
"""


def _driver(instances=None) -> str:
    """The emulator's main for ``instances`` (kernel names; default this module's INSTANCES),
    launched by their index in that list."""
    cases = "\n".join(f"        case {i}: return run(grid, shared, &{name});"
                      for i, name in enumerate(INSTANCES if instances is None else instances))
    return _DRIVER % {"instances": cases}


@pytest.fixture(scope="module")
def emulator(tmp_path_factory):
    return build(tmp_path_factory, "soft_ecc_emulated", _driver(), soft=True)


# ---------------------------------------------------------------------------------------------
# The stand-in device


def _poisoned(shape, dtype=np.float64):
    """cupy.empty's stand-in: NaN (floats) or 0xA5 bytes, so that an element the kernels
    should write and do not shows."""
    a = np.empty(shape, dtype)
    if a.dtype.kind == "f":
        a.fill(np.nan)
    else:
        a.reshape(-1).view(np.uint8).fill(0xA5)
    return a


class _Word:
    """PinnedWord's stand-in: the host word that the forward's block 0 writes (token << 2) |
    flags into."""

    def __init__(self):
        self.host = np.zeros(1, np.uint64)
        self.token = 0

    def arm(self, stream=None) -> int:
        self.token += 1
        return self.token

    def read(self) -> int:
        word = int(self.host[0])
        assert word >> 2 == self.token, f"the forward left the check word at {word:#x}"
        return word & 3


def _launch_class(emulator, log, instances=None):
    """PreparedLaunch's stand-in, running every launch in ``emulator`` (``log``: the
    (signature name, grid, dynamic shared bytes) of each launch, in order; ``instances``: the
    emulator's kernels, default INSTANCES)."""
    instances = INSTANCES if instances is None else instances

    class EmulatedLaunch:
        def __init__(self, sig, grid, block, args, *, shared_mem=0, options=()):
            assert len(args) == len(sig.params), sig.name
            assert sig.name in instances, f"{sig.name} is not compiled into the emulator"
            self.sig, self.grid, self.block, self.shared_mem = sig, int(grid), int(block), int(shared_mem)
            self.args = list(args)
            self.slots = [i for i, a in enumerate(args) if a is None]

        def __call__(self, *values):
            assert len(values) == len(self.slots), self.sig.name
            args = list(self.args)
            for i, v in zip(self.slots, values):
                args[i] = v
            log.append((self.sig.name, self.grid, self.shared_mem))
            _run(emulator, self.sig, self.grid, self.block, self.shared_mem, args, instances)

        def call_checked_once(self, *values, stream=None):
            # a stream read by the caller is the current one (the stand-in's pointer, 0)
            assert stream in (None, 0), (self.sig.name, stream)
            self(*values)

    return EmulatedLaunch


def _run(emulator, sig, grid, block, shared_mem, args, instances=None):
    """Runs ``sig``'s kernel on ``args`` (NumPy arrays, NULL, _Word, scalars) in the emulator
    (its kernels: ``instances``, default INSTANCES) and copies what it wrote back into the
    arrays."""
    index = (INSTANCES if instances is None else instances).index(sig.name)
    parts = [np.array([index, grid, block, shared_mem], np.int64).tobytes()]
    arrays = []
    for i, (kind, a) in enumerate(zip(sig.params, args)):
        if kind.startswith("ptr:") or kind == HOST_WORD:
            if a is NULL:
                parts.append(np.zeros(3, np.int64).tobytes())
                arrays.append(None)
                continue
            if kind == HOST_WORD:
                a = a.host
            else:  # what the launch checks of an array (_check_array)
                assert isinstance(a, np.ndarray) and a.dtype == np.dtype(kind[4:]), (sig.name, i, kind)
                assert a.flags.c_contiguous, (sig.name, i)
            parts += [np.array([1, a.itemsize, a.size], np.int64).tobytes(), a.tobytes()]
            arrays.append(a)
        else:
            v = _convert(a, kind, i, sig)  # the launch's conversion to the declared C type
            integer = v.dtype.kind == "i"
            parts += [np.array([2 if integer else 3, v.itemsize, 1], np.int64).tobytes(),
                      (np.int64(v) if integer else np.float64(v)).tobytes()]
    run = subprocess.run([str(emulator)], input=b"".join(parts), capture_output=True, timeout=300)
    assert run.returncode == 0, (sig.name, run.returncode, run.stderr[-2000:])
    out, offset = run.stdout, 0
    for a in arrays:  # per pointer: the bytes that follow (none for NULL or a const array)
        n = int(np.frombuffer(out, np.int64, 1, offset)[0])
        offset += 8
        if n:
            assert n == a.nbytes, (sig.name, n, a.shape, a.dtype)
            a.reshape(-1).view(np.uint8)[:] = np.frombuffer(out, np.uint8, n, offset)
            offset += n
    assert offset == len(out)


def _fake_cupy():
    return types.SimpleNamespace(
        ndarray=np.ndarray, empty=_poisoned, zeros=np.zeros, ascontiguousarray=np.ascontiguousarray,
        cuda=types.SimpleNamespace(get_current_stream=lambda: types.SimpleNamespace(ptr=0)))


@contextlib.contextmanager
def _emulated_device(emulator, resident, capacity=None):
    """Within: _soft_ecc_cupy's functions run on NumPy arrays, their launches in the emulator,
    on a device where ``resident`` blocks of any kernel run at once (and plans keep
    ``capacity`` entries per image, if given). Yields (the launch log, the check word)."""
    _array._cupy()  # the real CuPy (or None) memoized before the stand-in goes in
    log, word = [], _Word()
    made_ahead.drop()  # (arrays of a real CuPy call)
    with pytest.MonkeyPatch.context() as m:
        m.setitem(sys.modules, "cupy", _fake_cupy())
        m.setattr(_ecc_cupy, "resident_blocks", lambda sig, block, shared_mem=0, options=(): resident)
        m.setattr(_soft_ecc_cupy, "PreparedLaunch", _launch_class(emulator, log))
        m.setattr(_soft_ecc_cupy, "device_empty", _poisoned)
        m.setattr(_soft_ecc_cupy, "_on_device_of", lambda array: contextlib.nullcontext())
        m.setattr(_soft_ecc_cupy, "check_word", lambda: word)
        if capacity is not None:
            m.setattr(_soft_ecc_cupy, "kept_capacity", lambda nimg, pixels: capacity)
        yield log, word
    made_ahead.drop()  # the emulated arrays made for a next call


# ---------------------------------------------------------------------------------------------
# Inputs and the NumPy path


def _values(rng, spatial, noisy):
    """Values in [0, 1]: white noise (most pixels critical: a kept list that overflows) or a
    smooth field (few critical pixels: the list fits), rounded to few levels (many ties)."""
    if noisy:
        v = rng.random(spatial)
    else:
        axes = np.indices(spatial, dtype=np.float64)
        v = sum(np.sin(2 * np.pi * rng.uniform(0.3, 1.5) * a / n + rng.uniform(0, 6.3))
                for a, n in zip(axes, spatial))
        v = v + 0.3 * rng.random(spatial)
        v = (v - v.min()) / (v.max() - v.min())
    return np.round(v * rng.integers(12, 40)) / 40


def _image(rng, shape, dtype, ndim, noise=True):
    """A batch whose odd images are noise (with ``noise``), the others smooth; in float dtypes
    some pixels one ulp above their left neighbour (distinct values that tie in the packed
    sweep's 15-bit keys: their exact contributions) and NaN, +inf and -inf."""
    dtype = np.dtype(dtype)
    batch, spatial = shape[:len(shape) - ndim], shape[len(shape) - ndim:]
    v = np.stack([_values(rng, spatial, noise and k % 2 == 1) for k in range(math.prod(batch))])
    if dtype == np.bool_:
        img = v > np.median(v, axis=tuple(range(1, v.ndim)), keepdims=True)  # both values in each
    elif dtype.kind == "f":
        img = (v * 4 - 1).astype(dtype).reshape(-1)
        near = rng.choice(np.arange(1, img.size), size=img.size // 20, replace=False)
        img[near] = np.nextafter(img[near - 1], dtype.type(np.inf))
        img[rng.choice(img.size, size=3, replace=False)] = [np.nan, np.inf, -np.inf]
    elif dtype == np.int32:
        img = np.round(v * 4e9 - 2e9).astype(dtype)  # beyond float32's integers
    else:
        info = np.iinfo(dtype)
        img = np.round(v * min(info.max, 200) + max(info.min, -50) * (info.min < 0)).astype(dtype)
    return img.reshape(shape)


def _thresholds(rng, image, T, dtype):
    """T sorted thresholds over the middle of the values (some pixels below and above every
    one), with two equal ones and two equal to pixel values (a sigmoid at 1/2)."""
    finite = image[np.isfinite(image)].astype(np.float64).reshape(-1)
    lo, hi = np.quantile(finite, [0.05, 0.95])
    t = rng.uniform(lo, hi, T)
    t[:2] = rng.choice(finite[(finite >= lo) & (finite <= hi)], size=2)[:T]
    t = np.sort(t.astype(dtype))
    if T > 1:
        k = int(rng.integers(0, T - 1))
        t[k + 1] = t[k]
    return t


def _scale(dtype, image, t, per_band):
    """A scale whose bands hold about ``per_band`` of the thresholds (one threshold, or equal
    ones: a band an eighth of the values' range wide), in computation dtype ``dtype``."""
    finite = image[np.isfinite(image)].astype(np.float64)
    span = float(t[-1]) - float(t[0])
    if span == 0:
        span = (finite.max() - finite.min()) / 8
    spacing = span / max(t.size - 1, 1)
    return float(_band_numpy._BAND[dtype] / (per_band * spacing / 2))  # a Python float: no dtype


def _numpy_soft_ecc(image, t, scale, g, ndim, connectivity, boundary):
    """(curve, (d_image, d_t, d_scale)) of the NumPy path, through the op's registered forward
    and backward (cutopo.vjp's, before its cast of each cotangent to its argument's dtype: the
    kernels write theirs in the computation dtype or in float64)."""
    spec = cutopo.soft_ecc.__cutopo_op__
    out, residuals = spec.forward(image, t, scale, ndim=ndim, connectivity=connectivity,
                                  boundary=boundary)
    return out, spec.backward(residuals, g, (True, True, True))


RTOL = {np.dtype(np.float32): 2e-6, np.dtype(np.float64): 1e-12}


def _close(got, want, size, dtype, what):
    """|got - want| <= rtol(dtype) (size + 1): the rounding of the computation dtype relative
    to the size of the sums (as tests/test_band_gpu.py on the device)."""
    got = np.asarray(got, dtype=np.float64)
    want = np.asarray(want, dtype=np.float64)
    assert got.shape == want.shape, what
    assert np.all(np.isfinite(got)), f"{what}: not finite (an element not written?)"
    err = np.abs(got - want)
    tol = RTOL[np.dtype(dtype)] * (np.asarray(size, dtype=np.float64) + 1.0)
    assert np.all(err <= tol), f"{what}: max error {err.max():.3g}, tolerance {np.min(tol):.3g}"


def _sum_abs_c(image, ndim, tconn, periodic):
    c = _ecc_numpy.euler_contributions(image, ndim, tconn, periodic)
    return np.abs(c.reshape(c.shape[:c.ndim - ndim] + (-1,))).sum(axis=-1).astype(np.float64)


def _kept_entries(cfg, every=False):
    """Per image, the entries a forward keeps (flat index << 8 | c & 0xff): the critical pixels
    with a non-empty band, as the NumPy path finds them; ``every``: band or not (the listed
    forward's list)."""
    index, px = _soft_ecc._pixels(cfg)
    banded = np.ones(index.size, bool) if every else px.lo < px.hi
    packed = (index[banded].astype(np.uint64) << np.uint64(8)) | (px.c[banded].astype(np.int64)
                                                                   & 0xFF).astype(np.uint64)
    rows = px.row[banded]
    return [np.sort(packed[rows == r]) for r in range(math.prod(_batch(cfg)))]


def _batch(cfg):
    return cfg.image.shape[:cfg.image.ndim - cfg.ndim]


def _plan(cfg):
    spatial = cfg.image.shape[cfg.image.ndim - cfg.ndim:]
    return _soft_ecc_cupy.SoftEccPlan(cfg.image.dtype, math.prod(_batch(cfg)), spatial, cfg.tconn,
                                      cfg.periodic, cfg.t.size, cfg.dtype)


def _workspaces_zeroed(plan):
    return all(not ws.any() for ws in plan._workspaces.kept())


# ---------------------------------------------------------------------------------------------
# Tests


# soft_ecc_backward's calls: (needs, with the forward's kept entries, d_t's dtype, d_scale's;
# "real": the computation dtype, as _soft_ecc._backward asks for an argument of that dtype)
BACKWARDS = [((True, True, True), True, "real", "real"),
             ((True, True, True), False, "float64", "float64"),
             ((False, True, False), True, "float64", None),
             ((True, False, False), False, None, None),
             ((False, False, True), True, None, "real"),
             # again with d_image and the kept entries: the listed forward's zeroed d_image went
             # to the first such backward, this one zeroes its own
             ((True, False, True), True, None, "real")]


def _scale_terms(cfg, g):
    """sum |g_k c sigma'(lambda (t_k - f)) (t_k - f)| over every entry's band: the size of
    d_scale's sum (its terms' rounding is relative to each), in float64."""
    _, px = _soft_ecc._pixels(cfg)
    n = px.hi - px.lo
    e = np.repeat(np.arange(n.size), n)
    k = px.lo[e] + (np.arange(e.size) - np.repeat(np.cumsum(n) - n, n))
    diff = cfg.t[k].astype(np.float64) - px.f[e].astype(np.float64)
    u = float(cfg.scale) * diff
    s = 1.0 / (1.0 + np.exp(-np.abs(u)))
    return float(np.sum(np.abs(g.reshape(-1, cfg.t.size)[px.row[e], k] * px.c[e] * s * (1.0 - s) * diff)))


def _held():
    """This thread's arrays made ahead: ((plan, kind, stream), arrays), or None."""
    return getattr(made_ahead._local, "held", None)


def _check_soft_ecc(emulator, rng, image, t, scale, ndim, connectivity, boundary, resident,
                    capacity=None):
    """Runs soft_ecc_forward (checking the thresholds, keeping the entries), a plain forward
    and soft_ecc_backward (BACKWARDS) on the emulated kernels of one plan, and checks them
    against the NumPy path (see test_emulated_soft_ecc_equals_numpy); the first curve and the
    kept entries' counts."""
    cfg = _soft_ecc._prepare(image, t, scale, ndim, connectivity, boundary)
    real, batch, T = cfg.dtype, _batch(cfg), cfg.t.size
    nimg = math.prod(batch)
    g = rng.standard_normal(batch + (T,)).astype(real)
    want, wanted = _numpy_soft_ecc(image, t, scale, g, ndim, connectivity, boundary)
    S = _sum_abs_c(image, ndim, cfg.tconn, cfg.periodic)
    lam_g = float(cfg.scale) * np.abs(g).sum()
    bounds = (lam_g, lam_g * S.sum() / T, _scale_terms(cfg, g))

    with _emulated_device(emulator, resident, capacity) as (log, word):
        plan = _plan(cfg)
        args = (cfg.image, cfg.t, cfg.scale, cfg.w, cfg.ndim, cfg.tconn)
        out, residual = _soft_ecc_cupy.soft_ecc_forward(*args, cfg.periodic, check=True, plan=plan,
                                                        keep=True)
        assert word.read() == 0, "the thresholds' check failed"
        assert _workspaces_zeroed(plan), "the forward left its workspace dirty"
        assert _held() is None, "a forward with a backward made the next call's arrays"
        # the backward's outputs made by the forward (poisoned allocations), d_image zeroed
        # by the listed forward's list sweep
        made = residual._outputs[0]
        zeroed = made[0] if made[3] else None
        assert made[0] is not None and made[1].dtype == made[2].dtype == real
        assert (zeroed is not None) == plan.zeroes_d_image == (plan._list is not None)
        if zeroed is not None:
            assert not zeroed.any(), "the list sweep left d_image unzeroed"
        again, none = _soft_ecc_cupy.soft_ecc_forward(*args, cfg.periodic, plan=plan)
        assert none is None and _workspaces_zeroed(plan)
        assert _held()[0][:2] == (plan, (image.shape, False)), "the plain forward's next arrays"
        results = []
        for needs, with_kept, t_out, s_out in BACKWARDS:
            dtypes = [real if d == "real" else np.dtype(d or "float64") for d in (t_out, s_out)]
            results.append(_soft_ecc_cupy.soft_ecc_backward(
                *args, g, needs, cfg.periodic, *dtypes, plan=plan, kept=residual if with_kept else None))
            assert _workspaces_zeroed(plan), f"the backward {needs} left its workspace dirty"
            if len(results) == 1:
                first_d_image = results[0][0].copy()
                # the first backward with the Residual made its forward's next arrays, once
                next_arrays = _held()
                assert next_arrays[0][:2] == (plan, (image.shape, True))
        assert _held() is next_arrays, "a later backward made the next call's arrays again"
        # the first backward (all three, with the entries) wrote into the forward's outputs,
        # and no later one into the arrays it returned
        assert all(r is m for r, m in zip(results[0], made[:3]))
        assert not any(r is m for later in results[1:] for r, m in zip(later, made[:3]))
        np.testing.assert_array_equal(results[0][0], first_d_image)
        kept = residual.kept
    # the launches: one per forward (the listed forward: its list, its band work, the fused
    # forward of the lists that overflowed); per backward the sweep, and with kept entries the
    # listed
    sigs = [_soft_ecc_cupy._sweep_sig(kind, cfg.image.dtype, real, ndim, cfg.tconn, cfg.periodic,
                                      listed).name
            for kind, listed in (("forward", False), ("backward", False), ("backward", True))]
    listed_forward = plan._list is not None
    forward = sigs[:1]
    if listed_forward:
        forward = [_soft_ecc_cupy._sweep_sig("list", cfg.image.dtype, real, ndim, cfg.tconn,
                                             cfg.periodic).name,
                   _soft_ecc_cupy._listed_forward_sig(cfg.image.dtype, real).name] + forward
    assert [name for name, _, _ in log] == 2 * forward + [
        name for _, with_kept, _, _ in BACKWARDS for name in sigs[1:2 + with_kept]]

    assert out.dtype == real and out.shape == want.shape
    _close(out, want, S[..., None], real, "forward")
    _close(again, want, S[..., None], real, "forward again")  # sums in another order
    assert kept is not None and kept.size == nimg * (1 + plan.kept_cap)
    for r, entries in enumerate(_kept_entries(cfg, every=listed_forward)):
        if listed_forward and entries.size > plan.kept_cap:  # listing stopped once overflowed
            assert plan.kept_cap < kept[r] <= entries.size, f"image {r}: {kept[r]} entries met"
            continue
        assert kept[r] == entries.size, f"image {r}: {kept[r]} entries met, {entries.size} expected"
        if entries.size <= plan.kept_cap:
            slots = kept[nimg + r * plan.kept_cap:][:entries.size]
            np.testing.assert_array_equal(np.sort(slots), entries, f"image {r}'s kept entries")
    c = _ecc_numpy.euler_contributions(image, ndim, cfg.tconn, cfg.periodic)
    for (needs, with_kept, t_out, s_out), got in zip(BACKWARDS, results):
        dtypes = (real,) + tuple(real if d == "real" else np.dtype(d or "float64") for d in (t_out, s_out))
        for k, (d, expected, bound, dtype) in enumerate(zip(got, wanted, bounds, dtypes)):
            what = f"cotangent {k} of needs {needs}, kept {with_kept}"
            if not needs[k]:
                assert d is None, what
                continue
            assert d.dtype == dtype, what
            _close(d, expected, bound, real, what)
        if needs[0]:
            assert np.all(got[0][c == 0] == 0), "d_image: a pixel without a contribution"
    return out, kept[:nimg]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[1]}-{'x'.join(map(str, c[0]))}-{c[3]}d-"
                                                     f"conn{c[4]}-{c[5]}-T{c[6]}")
def test_emulated_soft_ecc_equals_numpy(emulator, case, rng):
    """soft_ecc_forward and soft_ecc_backward (every cotangent subset and output dtype, with
    and without the forward's kept entries) on the emulated kernels against the NumPy path
    (the op's registered forward and backward): the curve to the rounding of the computation
    dtype relative to sum |c|, the cotangents relative to their sums (lambda sum |g|, that
    times sum |c| / T, and sum |g| sum |c| (1 + w), w the band's half-width). Also: the
    launches the module makes, the check word written with its token, the kept entries
    (their counts; every critical pixel with a band, for the images whose list fits), every
    d_image element written (0 where c = 0), the workspaces zeroed again after each launch,
    and a second, plain forward (no check, nothing kept) on the same workspace."""
    shape, dtype, t_dtype, ndim, conn, boundary, T, per_band, resident = case
    image = _image(rng, shape, dtype, ndim)
    t = _thresholds(rng, image, T, np.dtype(t_dtype))
    real = _config(shape, dtype, t_dtype, ndim, conn, boundary).dtype
    scale = _scale(real, image, t, per_band)
    if per_band > 32:  # the case is there for the bands wider than a warp's window
        _, px = _soft_ecc._pixels(_soft_ecc._prepare(image, t, scale, ndim, conn, boundary))
        assert np.max(px.hi - px.lo) > 32
    _check_soft_ecc(emulator, rng, image, t, scale, ndim, conn, boundary, resident)


@pytest.mark.parametrize("case", [c for c in CASES if c[3] == 3],
                         ids=lambda c: f"{c[1]}-{'x'.join(map(str, c[0]))}-conn{c[4]}-{c[5]}-T{c[6]}")
@pytest.mark.parametrize("noise", [False, True], ids=["smooth", "noise"])
def test_emulated_listed_forward_equals_numpy(emulator, case, noise, rng, force_listed_forward):
    """The listed 3D forward (LISTED_FORWARD_MIN_VOXELS: the list sweep, the band work of the lists
    that fit, the fused forward of the images whose list overflowed; noise overflows the
    default capacity, smooth volumes fit it) as test_emulated_soft_ecc_equals_numpy checks the
    fused one, its list (every critical pixel, band or not) the backward's kept entries."""
    force_listed_forward(True)
    shape, dtype, t_dtype, ndim, conn, boundary, T, per_band, resident = case
    image = _image(rng, shape, dtype, ndim, noise=noise)
    t = _thresholds(rng, image, T, np.dtype(t_dtype))
    real = _config(shape, dtype, t_dtype, ndim, conn, boundary).dtype
    _check_soft_ecc(emulator, rng, image, t, _scale(real, image, t, per_band), ndim, conn, boundary,
                    resident)


@pytest.mark.parametrize("case, listed", [(CASES[2], False), (CASES[6], True), (CASES[6], False)],
                         ids=["2d", "3d-listed", "3d"])
def test_emulated_kernels_over_entries_with_one_block_per_image(emulator, case, listed, rng, monkeypatch,
                                                                 force_listed_forward):
    """The kernels over kept entries (the listed backward; the listed forward's band work) on
    their own grid (LISTED_WAVES), here one block per image: its warps take their entries in
    several rounds of 32. Checked as test_emulated_soft_ecc_equals_numpy checks the default."""
    monkeypatch.setattr(_soft_ecc_cupy, "LISTED_WAVES", 1e-9)
    monkeypatch.setattr(_soft_ecc_cupy, "LISTED_MIN_BLOCKS_PER_IMAGE", 1)
    monkeypatch.setattr(_soft_ecc_cupy, "LISTED_PIXELS_PER_BLOCK", 1 << 40)
    force_listed_forward(listed)
    shape, dtype, t_dtype, ndim, conn, boundary, T, per_band, resident = case
    image = _image(rng, shape, dtype, ndim)
    t = _thresholds(rng, image, T, np.dtype(t_dtype))
    cfg = _config(shape, dtype, t_dtype, ndim, conn, boundary)
    with _emulated_device(None, resident):
        plan = _plan(cfg)
        grids = [plan.backward_launch(True, cfg.dtype, None, True).grid,
                 plan.backward_launch(True, cfg.dtype, None).grid]
        if listed:
            grids += [plan._listed.grid, plan._list.grid]
    assert grids[0::2] == [plan.nimg] * len(grids[0::2]) and min(grids[1::2]) > plan.nimg
    _, kept = _check_soft_ecc(emulator, rng, image, t, _scale(cfg.dtype, image, t, per_band), ndim, conn,
                              boundary, resident)
    assert np.max(kept) > 8 * 32 * 2  # a third round for some warp of the image


def test_listed_forward_where_it_pays():
    """The listed 3D forward (listed_forward): 3D calls of LISTED_FORWARD_MIN_VOXELS or more
    whose kept slots (KEPT_MAX_BYTES a call) hold a slot per LISTED_FORWARD_VOXELS_PER_SLOT
    voxels; never in 2D."""
    listed = _soft_ecc_cupy.listed_forward
    assert listed(np.float32, 3, False, 1, 256**3) and listed(np.float64, 3, True, 1, 256**3)
    assert listed(np.uint8, 3, False, 1, 512**3)  # a slot per 16 voxels
    assert listed(np.float32, 3, False, 64, 64**3)  # 2^24 voxels in all
    assert not listed(np.float32, 3, False, 1, 192**3)  # below 2^23
    assert listed(np.float32, 3, False, 1, 1024**3) and listed(np.float32, 3, False, 16, 256**3)  # per 16
    # a slot per 32 voxels, less the counts' words
    assert listed(np.float32, 3, False, 2, 1000**3) and not listed(np.float32, 3, False, 2, 1024**3)
    assert not listed(np.float32, 3, False, 1, 2048**3)  # a slot per 128 voxels
    assert not listed(np.float32, 3, False, 32, 512**3)  # per 64
    assert not listed(np.float32, 2, False, 1, 8192**2) and not listed(np.int16, 2, False, 1, 8192**2)


@pytest.mark.parametrize("case", [_case("float64", 2), _case("float32", 3)], ids=["float64-2d", "float32-3d"])
def test_emulated_soft_ecc_at_extreme_scales(emulator, case, rng):
    """A huge scale empties every band (only the exact steps: the curve is cutopo.ecc's, the
    cotangents zero); a tiny one puts every threshold in every band (the sigmoid everywhere)."""
    shape, dtype, t_dtype, ndim, conn, boundary, _, _, resident = case
    image = _image(rng, shape, dtype, ndim)
    # the values are multiples of 1/10 (or one ulp above): halfway between, no threshold is one
    t = ((np.arange(-9.5, 30, 1.0)[rng.random(40) < 0.8]) / 10).astype(t_dtype)
    huge, _ = _check_soft_ecc(emulator, rng, image, t, 1e9, ndim, conn, boundary, resident)
    np.testing.assert_array_equal(huge, cutopo.ecc(image, t, ndim=ndim, connectivity=conn))
    _check_soft_ecc(emulator, rng, image, t, 1e-3, ndim, conn, boundary, resident)


@pytest.mark.parametrize("case, listed", [(_case("float32", 2), False), (_case("float64", 3), False),
                                          (_case("float64", 3), True)], ids=["2d-packed", "3d", "3d-listed"])
def test_emulated_kept_entries_at_their_capacity(emulator, case, listed, rng, force_listed_forward):
    """Kept entries that exactly fill an image's slots (read by the listed backward) and one
    more than its slots (that image swept again), with a capacity set per test: the forward
    writes no slot past its image's and counts every entry, the backward takes the list or the
    sweep by those counts. ``listed``: the listed 3D forward, whose band work takes the list
    or (one more) the fused forward the image, and which may stop counting an image that
    overflowed by more."""
    force_listed_forward(listed)
    shape, dtype, t_dtype, ndim, conn, boundary, T, per_band, resident = case
    image = _image(rng, shape, dtype, ndim, noise=False)  # lists that can fit
    t = _thresholds(rng, image, T, np.dtype(t_dtype))
    scale = _scale(np.dtype(t_dtype), image, t, per_band)
    counts = [e.size for e in _kept_entries(_soft_ecc._prepare(image, t, scale, ndim, conn, boundary),
                                            every=listed)]
    assert min(counts) > 1
    for capacity in (counts[0], counts[0] - 1):
        _, met = _check_soft_ecc(emulator, rng, image, t, scale, ndim, conn, boundary, resident,
                                 capacity)
        met, want = met.astype(np.int64), np.asarray(counts)
        # the listed forward stops listing an image once its list overflowed: its count is then
        # only past the capacity (exact where one entry overflows: every entry was met by then)
        loose = listed & (want > capacity + 1)
        np.testing.assert_array_equal(met[~loose], want[~loose])
        assert np.all((met[loose] > capacity) & (met[loose] <= want[loose])), (met, want, capacity)


@pytest.mark.parametrize("case", [_case("float32", 2), _case("float32", 3, "periodic")],
                         ids=["float32-2d-packed", "float32-3d-torus"])
def test_emulated_forward_checks_device_thresholds(emulator, case, rng):
    """With device thresholds the forward's block 0 checks them (report_thresholds): a NaN or
    an infinity raises the host check's error for non-finite thresholds, a descent the one for
    unsorted thresholds. The kernel runs on to its end on them (its workspace zeroed again):
    the next call on the same plan is right."""
    shape, dtype, t_dtype, ndim, conn, boundary, T, per_band, resident = case
    image = _image(rng, shape, dtype, ndim)
    t = _thresholds(rng, image, T, np.dtype(t_dtype))
    cfg = _soft_ecc._prepare(image, t, _scale(np.dtype(t_dtype), image, t, per_band), ndim, conn,
                             boundary)
    want = _numpy_soft_ecc(image, t, cfg.scale, np.zeros(_batch(cfg) + (T,)), ndim, conn, boundary)[0]
    k = int(rng.integers(1, T - 1))
    bad = {THRESHOLDS_NOT_FINITE: [np.nan, np.inf, -np.inf], THRESHOLDS_NOT_SORTED: [t[k - 1] - 1]}
    with _emulated_device(emulator, resident):
        plan = _plan(cfg)
        for message, values in bad.items():
            for v in values:
                wrong = cfg.t.copy()
                wrong[k] = v
                with pytest.raises(ValueError, match=re.escape(message)):
                    _soft_ecc_cupy.soft_ecc_forward(cfg.image, wrong, cfg.scale, cfg.w, ndim, cfg.tconn,
                                                    cfg.periodic, check=True, plan=plan, keep=True)
                assert _workspaces_zeroed(plan)
        out, _ = _soft_ecc_cupy.soft_ecc_forward(cfg.image, cfg.t, cfg.scale, cfg.w, ndim, cfg.tconn,
                                                 cfg.periodic, check=True, plan=plan)
    _close(out, want, _sum_abs_c(image, ndim, cfg.tconn, cfg.periodic)[..., None], cfg.dtype, "forward")


def test_cases_cover_the_launches():
    """CASES make every kind of launch the soft ECC makes (as SoftEccPlan plans them; no kernel
    runs here): the packed and the scalar forward, shared and global accumulators in the
    forward and the backward, blocks of one tile and of several, 3D chunks of several planes,
    batches, every input dtype, both computation dtypes, V and T, box and torus in 2D and 3D."""
    seen = set()
    for shape, dtype, t_dtype, ndim, conn, boundary, T, _, resident in CASES:
        cfg = _config(shape, dtype, t_dtype, ndim, conn, boundary)
        with _emulated_device(None, resident):
            plan = _soft_ecc_cupy.SoftEccPlan(np.dtype(dtype), math.prod(_batch(cfg)),
                                              shape[len(shape) - ndim:], cfg.tconn, cfg.periodic, T,
                                              cfg.dtype)
            launches = {"forward": plan._forward, "backward": plan.backward_launch(True, cfg.dtype, None)}
        packed = _soft_ecc_cupy.packed_forward(np.dtype(dtype), ndim, cfg.periodic)
        seen |= {("dtype", dtype), ("real", cfg.dtype.name), ("packed", packed),
                 ("construction", ndim, cfg.tconn, cfg.periodic), ("batch", plan.nimg > 1)}
        for kind, launch in launches.items():
            args = launch.args[:-1]  # (the forward's list, the backward's zeroed)
            nz, ny, nx, zchunk, per_image, _, _, _, shared = args[-9:]
            tile_x = _ecc_cupy.TILE_X["unsigned short" if kind == "forward" and packed else "unsigned int"]
            tiles = math.ceil(nz / zchunk) * math.ceil(ny / _ecc_cupy.TILE_Y) * math.ceil(nx / tile_x)
            assert launch.grid == plan.nimg * per_image
            seen |= {(kind, "shared", shared), (kind, "tiles per block", min(2, math.ceil(tiles / per_image))),
                     (kind, "chunks", min(2, math.ceil(nz / zchunk)) if ndim == 3 else 0)}
    wanted = {("dtype", d.name) for d in _ecc_cupy._INPUT_CTYPE} | {
        ("real", "float32"), ("real", "float64"), ("packed", True), ("packed", False), ("batch", True),
        *[("construction", n, tc, p) for n in (2, 3) for tc in (False, True) for p in (False, True)],
        *[(kind, what, v) for kind in ("forward", "backward") for what, v in
          (("shared", 1), ("shared", 0), ("tiles per block", 1), ("tiles per block", 2), ("chunks", 2))]}
    assert wanted <= seen, wanted - seen


def test_module_sizes_match_the_kernels(emulator):
    """The numbers _soft_ecc_cupy plans with are the kernels' (as compiled here): threads,
    slots and tile planes, the tiles' width and height (_ecc_cupy), the workspaces' words, and
    the static shared memory it reserves beside the dynamic part (QUEUE_BYTES, the 3D forward's
    ring BLOCK_QUEUE_CAP, PACKED_QUEUE_BYTES) covers the kernels' __shared__ queues, windows and words. On a GPU a
    short reserve would leave a launch over the 48 KiB without opting in, which fails there."""
    run = subprocess.run([str(emulator)], input=np.array([-1, 0, 256, 0], np.int64).tobytes(),
                         capture_output=True, timeout=60)
    assert run.returncode == 0, run.stderr
    (threads, warps, row_slots, packed_slots, plane, planew, tx, ty, txp, copies, row_queues,
     packed_queues, window32, window64, work32, work64, kept_sink, fws_5_37, fws_6_1000,
     bws_37, ring32, ring64, transposed_band, transposed32, transposed64) = (
        int(v) for v in np.frombuffer(run.stdout, np.int64))
    m = _soft_ecc_cupy
    assert (threads, warps, row_slots, packed_slots, plane, planew, copies) == (
        m.THREADS, m.WARPS, m.ROW_SLOTS, m.PACKED_SLOTS, m.PLANE, m.PACKED_PLANE_WORDS, m.BACKWARD_COPIES)
    assert (tx, txp, ty) == (_ecc_cupy.TILE_X["unsigned int"], _ecc_cupy.TILE_X["unsigned short"],
                             _ecc_cupy.TILE_Y)
    assert (fws_5_37, fws_6_1000, bws_37) == (m.forward_workspace_words(5, 37),
                                              m.forward_workspace_words(6, 1000),
                                              m.backward_workspace_words(37))
    # besides the tile planes (which _dynamic_shared counts itself): the scalar sweep's queues,
    # is_last, forward_kept and report_thresholds' flags; the backward's scratch doubles
    assert row_queues + 4 + kept_sink + 4 * warps <= m.QUEUE_BYTES
    assert row_queues + 8 * warps + 4 <= m.QUEUE_BYTES
    # the float32 kernels over kept entries' transposed rows (a warp's), counted apart
    assert transposed_band == m.TRANSPOSED_BAND and transposed64 == 1
    assert transposed32 * 4 * warps == m.TRANSPOSED_BYTES
    # the listed forward's rows (its only static part) under the 3D fused forward's static
    # part, which sizes the dynamic part they share
    assert m.TRANSPOSED_BYTES + 64 <= 3 * plane * 4 + m.QUEUE_BYTES + ring32
    # the 3D forward's ring of entries, counted apart
    assert (ring32, ring64) == (m.BLOCK_QUEUE_CAP[4] * 8 + 8, m.BLOCK_QUEUE_CAP[8] * 8 + 8)
    # the packed forward's queues, ForwardWork and windows (raw bytes, 16-aligned), the same words
    for window, work in ((window32, work32), (window64, work64)):
        packed = packed_queues + -(-work // 16) * 16 + threads * window + 4 + kept_sink + 4 * warps
        assert packed <= m.PACKED_QUEUE_BYTES, (packed, m.PACKED_QUEUE_BYTES)
