"""ecc.cu compiled for the host: the source and the build the host-side ECC tests share.

``host_source()`` is the text the loader compiles for the ECC family (common.cuh, ecc.cu up to
the soft ECC's headers, ecc_expected.cuh) preceded by a small emulation of what it uses from
CUDA, so that a host C++ compiler builds it: each block runs as 256 host threads
(``threadIdx`` thread-local, ``__syncthreads`` a barrier, a warp's shuffles an exchange between
its 32 threads), ``__shared__`` variables are statics (one block at a time), atomics are host
atomics, and the four inline-PTX statements of common.cuh are replaced by their host forms
(IEEE comparisons and conversions: the host flushes no denormals, as the kernels' non-.ftz
instructions do not; float arithmetic elsewhere differs from the kernels' -ftz=true only for
denormal operands). A test appends its driver (a ``main``) and builds with ``build``.
"""
from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from cutopo._cuda.source import source_dir

CXX = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")

# common.cuh's inline PTX, in its host form: the same values without the GPU's instructions.
_PTX = {
    'asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h.bits));': "f = emu::half_bits_to_float(h.bits);",
    'asm("cvt.f64.f32 %0, %1;" : "=d"(d) : "f"(v));': "d = (double)v;",
    'asm("{.reg .pred p; setp.le.f32 p, %1, %2; selp.u32 %0, 1, 0, p;}" : "=r"(r) : "f"(a), "f"(b));':
        "r = a <= b;",
    'asm("{.reg .pred p; setp.gt.f32 p, %1, %2; selp.u32 %0, 1, 0, p;}" : "=r"(r) : "f"(a), "f"(b));':
        "r = a > b;",
}

_EMULATION = r"""
#include <atomic>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <thread>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __restrict__ __restrict
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
#define __shared__ static  // one block at a time: a static is the block's

struct uint3 { unsigned x, y, z; };
struct uint2 { unsigned x, y; };
struct alignas(16) uint4 { unsigned x, y, z, w; };
inline uint2 make_uint2(unsigned x, unsigned y) { return {x, y}; }
thread_local uint3 threadIdx;
uint3 blockIdx, blockDim, gridDim;

namespace emu {
constexpr int THREADS = 256;
std::barrier<>* block_barrier;
struct Warp {
    std::barrier<> barrier{32};
    unsigned long long slot[32];
};
Warp* warps;
alignas(16) unsigned char dynamic_smem[1 << 17];

template <class T>
T exchange(T v, int from) {  // every lane of the warp calls it together (full masks only)
    Warp& w = warps[threadIdx.x / 32];
    std::memcpy(&w.slot[threadIdx.x % 32], &v, sizeof(T));
    w.barrier.arrive_and_wait();
    T r;
    std::memcpy(&r, &w.slot[from], sizeof(T));
    w.barrier.arrive_and_wait();
    return r;
}

inline float half_bits_to_float(unsigned short h) {
    const unsigned s = (h >> 15) & 1u, e = (h >> 10) & 31u, m = h & 1023u;
    float f = e == 0 ? std::ldexp((float)m, -24) : e == 31 ? (m ? NAN : INFINITY)
                                                           : std::ldexp((float)(m | 1024u), (int)e - 25);
    return s ? -f : f;
}
}  // namespace emu

inline void __syncthreads() { emu::block_barrier->arrive_and_wait(); }
inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
template <class T> T __ldg(const T* p) { return *p; }
template <class T> T __ldcg(const T* p) { return __atomic_load_n(p, __ATOMIC_SEQ_CST); }
template <class T> T atomicAdd(T* p, T v) { return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }
inline double atomicAdd(double* p, double v) { return std::atomic_ref<double>(*p).fetch_add(v); }
template <class T> T atomicMax(T* p, T v) {
    T old = __atomic_load_n(p, __ATOMIC_SEQ_CST);
    while (old < v && !__atomic_compare_exchange_n(p, &old, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {}
    return old;
}
template <class T> T __shfl_up_sync(unsigned, T v, int d) {
    const int lane = threadIdx.x % 32;
    return emu::exchange(v, lane >= d ? lane - d : lane);
}
template <class T> T __shfl_down_sync(unsigned, T v, int d) {
    const int lane = threadIdx.x % 32;
    return emu::exchange(v, lane + d < 32 ? lane + d : lane);
}
template <class T> T __shfl_xor_sync(unsigned, T v, int d) {
    return emu::exchange(v, (int)(threadIdx.x % 32) ^ d);
}
template <class T> T __shfl_sync(unsigned, T v, int src) { return emu::exchange(v, src); }
inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
    const unsigned long long v = ((unsigned long long)y << 32) | x;
    unsigned r = 0;
    for (int i = 0; i < 4; ++i) r |= (unsigned)((v >> (8 * ((s >> (4 * i)) & 7u))) & 0xffu) << (8 * i);
    return r;
}
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fsqrt_rn(float a) { return std::sqrt(a); }
inline float __fmaf_rn(float a, float b, float c) { return std::fmaf(a, b, c); }
inline double __dadd_rn(double a, double b) { return a + b; }
inline double __dsub_rn(double a, double b) { return a - b; }
inline double __dmul_rn(double a, double b) { return a * b; }
inline double __ddiv_rn(double a, double b) { return a / b; }
inline double __dsqrt_rn(double a) { return std::sqrt(a); }
inline int __float_as_int(float f) { int i; std::memcpy(&i, &f, 4); return i; }
inline unsigned __float_as_uint(float f) { unsigned i; std::memcpy(&i, &f, 4); return i; }
inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
inline long long __double_as_longlong(double d) { long long i; std::memcpy(&i, &d, 8); return i; }
template <class T> T min(T a, T b) { return a < b ? a : b; }
template <class T> T max(T a, T b) { return a > b ? a : b; }
"""


def host_source() -> str:
    """The emulation and the ECC family's kernels, ready for a driver."""
    src = source_dir()
    common = (src / "common.cuh").read_text()
    for ptx, host in _PTX.items():
        assert ptx in common, f"common.cuh no longer has {ptx!r}: update tests/ecc_host_build.py"
        common = common.replace(ptx, host)
    assert "asm" not in re.sub(r"//.*", "", common), "common.cuh: inline PTX ecc_host_build.py misses"
    ecc = (src / "ecc.cu").read_text()
    ecc = ecc.replace('#include "common.cuh"', "")
    ecc = ecc[:ecc.index('#include "ecc_band.cuh"')]  # the soft ECC and ECT kernels: not here
    smem = "extern __shared__ __align__(16) unsigned char dynamic_smem[];"
    assert smem in ecc, "ecc.cu's dynamic shared memory changed: update tests/ecc_host_build.py"
    ecc = ecc.replace(smem, "unsigned char* dynamic_smem = emu::dynamic_smem;")
    expected = (src / "ecc_expected.cuh").read_text().replace('#include "common.cuh"', "")
    return _EMULATION + common + ecc + expected


def build(tmp_path_factory, name: str, driver: str, *defines: str):
    """Compile host_source() + ``driver`` (with -D ``defines``); the executable's path. Skips
    where no host C++ compiler is on PATH."""
    if CXX is None:
        pytest.skip("no host C++ compiler (c++, g++ or clang++) on PATH")
    tmp = tmp_path_factory.mktemp(name)
    (tmp / f"{name}.cpp").write_text(host_source() + driver)
    exe = tmp / name
    run = subprocess.run([CXX, "-std=c++20", "-O1", "-pthread", "-w", *defines, "-o", str(exe),
                          str(tmp / f"{name}.cpp")], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-4000:]
    return exe
