"""ecc.cu compiled for the host: the source and the build the host-side ECC tests share.

``host_source()`` is the text the loader compiles for the ECC family (common.cuh, ecc.cu up to
the soft ECC's headers, ecc_expected.cuh; with ``soft=True`` also ecc_band.cuh and
ecc_soft.cuh, where ecc.cu includes them) preceded by a small emulation of what it uses from
CUDA, so that a host C++ compiler builds it: each block runs as 256 host threads, or as 256
fibers of one host thread (``emu::run_block_fibers``, much faster where warps synchronise
often); ``threadIdx`` is thread-local (a fiber's is set when it runs), ``__syncthreads`` a
barrier, a warp's shuffles, votes and reductions an exchange between its 32 threads and
``__syncwarp`` their barrier (full masks only, every lane calling), ``__shared__`` variables
statics (one block at a time), atomics host atomics, and the inline PTX of common.cuh is
replaced by its host forms (shared addresses as pointers; IEEE comparisons and conversions:
the host flushes no denormals, as the kernels' non-.ftz instructions do not; float arithmetic
elsewhere differs from the kernels' -ftz=true only for denormal operands). The soft kernels'
``expf``/``exp`` are the host's (glibc's, within an ulp; CUDA's are within 2) and the host
makes no fused multiply-adds where nvcc contracts: their results differ from the GPU's in
the last bits of the computation dtype, as the GPU's differ from the NumPy path's. A test
appends its driver (a ``main``) and builds with ``build``.
"""
from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from cutopo._cuda.source import source_dir

CXX = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
EMULATED_SMEM = 1 << 17  # bytes of a block's dynamic shared memory in the emulation

# common.cuh's inline PTX, in its host form: the same values without the GPU's instructions.
_PTX = {
    'asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h.bits));': "f = emu::half_bits_to_float(h.bits);",
    'asm("cvt.f64.f32 %0, %1;" : "=d"(d) : "f"(v));': "d = (double)v;",
    'asm("{.reg .pred p; setp.le.f32 p, %1, %2; selp.u32 %0, 1, 0, p;}" : "=r"(r) : "f"(a), "f"(b));':
        "r = a <= b;",
    'asm("{.reg .pred p; setp.gt.f32 p, %1, %2; selp.u32 %0, 1, 0, p;}" : "=r"(r) : "f"(a), "f"(b));':
        "r = a > b;",
    'asm("{.reg .pred p; setp.gt.f32 p, %1, %2; @p add.s32 %0, %0, 1;}" : "+r"(k) : "f"(v), "f"(hi));':
        "k += v > hi;",
    'asm("{.reg .pred p; setp.gt.f64 p, %1, %2; @p add.s32 %0, %0, 1;}" : "+r"(k) : "d"(v), "d"(hi));':
        "k += v > hi;",
    # FFMA.SAT: NaN to 0 (PTX's saturation), else clamped to [0, 1]
    'asm("fma.rn.ftz.sat.f32 %0, %1, %2, %3;" : "=f"(r) : "f"(a), "f"(b), "f"(c));':
        "r = std::fma(a, b, c); r = r > 0.0f ? (r < 1.0f ? r : 1.0f) : 0.0f;",
    'typedef unsigned smem_addr;': "typedef unsigned long long smem_addr;",
    'return (smem_addr)__cvta_generic_to_shared(p);': "return (smem_addr)p;",
    'asm("ld.shared.u32 %0, [%1];" : "=r"(r) : "r"(a));': "std::memcpy(&r, (const void*)a, 4);",
    'asm("sub.u32 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));': "r = a - b;",
    'asm volatile("red.shared.add.s32 [%0], %1;" :: "r"(a), "r"(v) : "memory");':
        "atomicAdd((int*)a, v);",
    'asm("{.reg .u32 s; add.cc.u32 s, %1, %2; addc.u32 %0, %3, %3;}" : "=r"(r) : "r"(a), "r"(b), "r"(acc));':
        "r = acc + acc + (unsigned)(a + b < a);",
}

_EMULATION = r"""
// Fibers switch stacks with _longjmp, which _FORTIFY_SOURCE (on by default in some
// distributions' compilers) checks against jumps to another stack.
#undef _FORTIFY_SOURCE
#include <atomic>
#include <barrier>
#include <cmath>
#include <csetjmp>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <thread>
#include <ucontext.h>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__ __attribute__((noinline))
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
// A warp's exchanges go through two banks of slots, taken in turn by each lane (bank: the
// lane's next), so that one barrier per exchange suffices: a lane that writes the other bank
// cannot come back to this one before every lane has passed the next exchange's barrier, so
// after every read of this one.
struct Warp {
    std::barrier<> barrier{32};
    unsigned long long slot[2][32];
    unsigned char bank[32] = {};
};
Warp* warps;
alignas(16) unsigned char dynamic_smem[@SMEM@];  // EMULATED_SMEM

// A block's threads as fibers of one host thread (run_block_fibers), the other way to run a
// block: host threads wait for each other at every barrier through the kernel (futexes and the
// scheduler: some 100 us per warp barrier on a busy machine), fibers switch in user space
// (_setjmp/_longjmp, which keep the signal mask: tens of ns; a fiber's first entry is
// setcontext's). The soft ECC kernels, whose warps take a dozen barriers per band entry
// (shuffles and ballots), would take minutes as host threads. Each fiber runs until it waits
// at a barrier; the last one to arrive releases the others, alternately in the order they
// arrived and in reverse (so that a read of another lane's write that misses its barrier
// sees the write in one order and not in the other, whichever lane comes first).
struct Fibers {
    static constexpr size_t STACK = 1 << 18;
    struct Barrier {
        int expected, arrived = 0;
        unsigned generation = 0;
        int waiting[THREADS];
    };
    jmp_buf scheduler;
    jmp_buf saved[THREADS];
    ucontext_t fresh[THREADS];  // a fiber's first entry
    std::unique_ptr<char[]> stacks{new char[STACK * THREADS]};  // not zeroed: touched as used
    bool started[THREADS], done[THREADS];
    int ready[THREADS], head = 0, count = 0;  // a ring of the fibers ready to run
    int current = 0;
    Barrier block{THREADS}, warp[THREADS / 32];
    std::vector<Warp> slots{THREADS / 32};
    const std::function<void()>* body = nullptr;

    Fibers() {
        for (auto& w : warp) w.expected = 32;
    }
    void push(int f) { ready[(head + count++) % THREADS] = f; }
    int pop() {
        const int f = ready[head];
        head = (head + 1) % THREADS;
        --count;
        return f;
    }
    [[noreturn]] void resume(int f) {  // f runs (this context was saved, or is abandoned)
        current = f;
        threadIdx = {(unsigned)f, 0u, 0u};
        if (started[f]) _longjmp(saved[f], 1);
        started[f] = true;
        setcontext(&fresh[f]);
        std::abort();
    }
    void arrive(Barrier& b) {
        const int me = current;
        if (++b.arrived < b.expected) {
            b.waiting[b.arrived - 1] = me;
            if (_setjmp(saved[me]) == 0) {
                if (count == 0) _longjmp(scheduler, 1);  // all others wait too: a deadlock
                resume(pop());
            }
            return;  // released, and resumed by another fiber
        }
        const int n = b.arrived - 1;
        b.arrived = 0;
        const bool reverse = b.generation++ & 1u;
        for (int i = 0; i < n; ++i) push(b.waiting[reverse ? n - 1 - i : i]);
    }
    static void entry();
    // Runs one block: false if its fibers deadlocked (some wait at a barrier that the others
    // never reach: a barrier in divergent code, which hangs or is undefined on the GPU).
    bool run(const std::function<void()>& launch) {
        body = &launch;
        block.arrived = 0;
        for (auto& w : warp) w.arrived = 0;
        for (auto& w : slots) std::memset(w.bank, 0, sizeof w.bank);
        head = count = 0;
        for (int t = 0; t < THREADS; ++t) {
            getcontext(&fresh[t]);
            fresh[t].uc_stack.ss_sp = stacks.get() + t * STACK;
            fresh[t].uc_stack.ss_size = STACK;
            fresh[t].uc_link = nullptr;  // entry never returns: it jumps to the scheduler
            makecontext(&fresh[t], entry, 0);
            started[t] = done[t] = false;
            push(t);
        }
        while (count > 0)
            if (_setjmp(scheduler) == 0) resume(pop());
        for (int t = 0; t < THREADS; ++t)
            if (!done[t]) return false;
        return true;
    }
};
Fibers* fibers = nullptr;  // the running block's, while it runs as fibers
void Fibers::entry() {
    (*fibers->body)();
    fibers->done[fibers->current] = true;
    _longjmp(fibers->scheduler, 1);
}

// Runs launch() as one block of THREADS fibers (see Fibers); false on a deadlock.
inline bool run_block_fibers(const std::function<void()>& launch) {
    static Fibers* f = new Fibers();  // stacks and contexts for every block of the process
    fibers = f;
    warps = f->slots.data();
    const bool ok = f->run(launch);
    fibers = nullptr;
    return ok;
}

inline void warp_sync() {
    if (fibers) fibers->arrive(fibers->warp[threadIdx.x / 32]);
    else warps[threadIdx.x / 32].barrier.arrive_and_wait();
}
inline void block_sync() {
    if (fibers) fibers->arrive(fibers->block);
    else block_barrier->arrive_and_wait();
}

template <class T>
T exchange(T v, int from) {  // every lane of the warp calls it together (full masks only)
    Warp& w = warps[threadIdx.x / 32];
    const int lane = threadIdx.x % 32, bank = w.bank[lane];
    w.bank[lane] ^= 1;
    std::memcpy(&w.slot[bank][lane], &v, sizeof(T));
    warp_sync();
    T r;
    std::memcpy(&r, &w.slot[bank][from], sizeof(T));
    return r;
}

// The bits of a warp's 32 words (v of every lane, lane i's value in word i) combined by the
// lanes together: votes and reductions, called by all 32 lanes (full masks only).
template <class Combine>
unsigned combine(unsigned v, Combine f) {
    Warp& w = warps[threadIdx.x / 32];
    const int lane = threadIdx.x % 32, bank = w.bank[lane];
    w.bank[lane] ^= 1;
    w.slot[bank][lane] = v;
    warp_sync();
    unsigned r = 0;
    for (int i = 0; i < 32; ++i) r = f(r, (unsigned)w.slot[bank][i], i);
    return r;
}

// The kernels pass 0xffffffff to every *_sync: a partial mask is beyond this emulation.
inline void full_mask(unsigned mask) {
    if (mask != 0xffffffffu) {
        std::fprintf(stderr, "emulation: a warp operation with mask %08x (full masks only)\n", mask);
        std::abort();
    }
}

inline float half_bits_to_float(unsigned short h) {
    const unsigned s = (h >> 15) & 1u, e = (h >> 10) & 31u, m = h & 1023u;
    float f = e == 0 ? std::ldexp((float)m, -24) : e == 31 ? (m ? NAN : INFINITY)
                                                           : std::ldexp((float)(m | 1024u), (int)e - 25);
    return s ? -f : f;
}
}  // namespace emu

inline void __syncthreads() { emu::block_sync(); }
inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline void __threadfence_system() { std::atomic_thread_fence(std::memory_order_seq_cst); }
template <class T> T __ldg(const T* p) { return *p; }
template <class T> T __ldcg(const T* p) {
    T r;
    __atomic_load(p, &r, __ATOMIC_SEQ_CST);
    return r;
}
template <class T> T atomicAdd(T* p, T v) { return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }
inline double atomicAdd(double* p, double v) { return std::atomic_ref<double>(*p).fetch_add(v); }
inline float atomicAdd(float* p, float v) { return std::atomic_ref<float>(*p).fetch_add(v); }
template <class T> T atomicOr(T* p, T v) { return __atomic_fetch_or(p, v, __ATOMIC_SEQ_CST); }
template <class T> T atomicExch(T* p, T v) { return __atomic_exchange_n(p, v, __ATOMIC_SEQ_CST); }
template <class T> T atomicCAS(T* p, T compare, T v) {  // the old value, as on the GPU
    __atomic_compare_exchange_n(p, &compare, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
    return compare;
}
template <class T> T atomicMax(T* p, T v) {
    T old = __atomic_load_n(p, __ATOMIC_SEQ_CST);
    while (old < v && !__atomic_compare_exchange_n(p, &old, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {}
    return old;
}
template <class T> T __shfl_up_sync(unsigned mask, T v, int d) {
    emu::full_mask(mask);
    const int lane = threadIdx.x % 32;
    return emu::exchange(v, lane >= d ? lane - d : lane);
}
template <class T> T __shfl_down_sync(unsigned mask, T v, int d) {
    emu::full_mask(mask);
    const int lane = threadIdx.x % 32;
    return emu::exchange(v, lane + d < 32 ? lane + d : lane);
}
template <class T> T __shfl_xor_sync(unsigned mask, T v, int d) {
    emu::full_mask(mask);
    return emu::exchange(v, (int)(threadIdx.x % 32) ^ d);
}
template <class T> T __shfl_sync(unsigned mask, T v, int src) {
    emu::full_mask(mask);
    return emu::exchange(v, src);
}
inline unsigned __ballot_sync(unsigned mask, int p) {
    emu::full_mask(mask);
    return emu::combine(p != 0, [](unsigned r, unsigned v, int i) { return r | (v << i); });
}
inline int __any_sync(unsigned mask, int p) { return __ballot_sync(mask, p) != 0u; }
inline unsigned __reduce_or_sync(unsigned mask, unsigned v) {
    emu::full_mask(mask);
    return emu::combine(v, [](unsigned r, unsigned x, int) { return r | x; });
}
inline int __reduce_min_sync(unsigned mask, int v) {
    emu::full_mask(mask);
    return (int)emu::combine((unsigned)v, [](unsigned r, unsigned x, int i) {
        return i == 0 || (int)x < (int)r ? x : r;
    });
}
inline int __reduce_max_sync(unsigned mask, int v) {
    emu::full_mask(mask);
    return (int)emu::combine((unsigned)v, [](unsigned r, unsigned x, int i) {
        return i == 0 || (int)x > (int)r ? x : r;
    });
}
inline void __syncwarp(unsigned mask = 0xffffffffu) {
    emu::full_mask(mask);
    emu::warp_sync();
}
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __ffs(int x) { return __builtin_ffs(x); }
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
inline double __fma_rn(double a, double b, double c) { return std::fma(a, b, c); }
inline double __dsub_rn(double a, double b) { return a - b; }
inline double __dmul_rn(double a, double b) { return a * b; }
inline double __ddiv_rn(double a, double b) { return a / b; }
inline double __dsqrt_rn(double a) { return std::sqrt(a); }
inline float __frcp_rn(float a) { return 1.0f / a; }
inline double __drcp_rn(double a) { return 1.0 / a; }
using std::isfinite;
using std::isnan;
inline int __float_as_int(float f) { int i; std::memcpy(&i, &f, 4); return i; }
inline unsigned __float_as_uint(float f) { unsigned i; std::memcpy(&i, &f, 4); return i; }
inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
inline long long __double_as_longlong(double d) { long long i; std::memcpy(&i, &d, 8); return i; }
inline double __longlong_as_double(long long i) { double d; std::memcpy(&d, &i, 8); return d; }
inline int __double2loint(double d) { return (int)(unsigned)__double_as_longlong(d); }
template <class T> T min(T a, T b) { return a < b ? a : b; }
template <class T> T max(T a, T b) { return a > b ? a : b; }
"""


# What ecc.cu includes after its own kernels, in this order (host_source(soft=True) takes them all).
_TAIL = ["ecc_band.cuh", "ecc_soft.cuh", "ecc_expected.cuh"]
# Dynamic shared memory: ecc.cu's (histogram) and the band and soft kernels' declarations.
_DYNAMIC_SMEM = {"extern __shared__ __align__(16) unsigned char dynamic_smem[];":
                 "unsigned char* dynamic_smem = emu::dynamic_smem;",
                 "extern __shared__ __align__(16) unsigned char smem[];":
                 "unsigned char* smem = emu::dynamic_smem;"}


def _header(src, name: str) -> str:
    """A header of the family without its include of common.cuh (already in the text), its
    dynamic shared memory the emulation's block-wide buffer."""
    text = (src / name).read_text().replace('#include "common.cuh"', "")
    assert "#include" not in re.sub(r"//.*", "", text), f"{name} includes a header ecc_host_build.py misses"
    for device, host in _DYNAMIC_SMEM.items():
        text = text.replace(device, host)
    assert "extern __shared__" not in text, f"{name}: dynamic shared memory ecc_host_build.py misses"
    assert "asm" not in re.sub(r"//.*", "", text), f"{name}: inline PTX ecc_host_build.py misses"
    return text


def host_source(soft: bool = False) -> str:
    """The emulation and the ECC family's kernels, ready for a driver. ``soft``: with the band
    and soft ECC kernels (ecc_band.cuh, ecc_soft.cuh) too, which the other drivers need not
    compile."""
    src = source_dir()
    common = (src / "common.cuh").read_text()
    for ptx, host in _PTX.items():
        assert ptx in common, f"common.cuh no longer has {ptx!r}: update tests/ecc_host_build.py"
        common = common.replace(ptx, host)
    assert "asm" not in re.sub(r"//.*", "", common), "common.cuh: inline PTX ecc_host_build.py misses"
    ecc = (src / "ecc.cu").read_text()
    ecc = ecc.replace('#include "common.cuh"', "")
    tail = ecc.index('#include "ecc_band.cuh"')
    included = re.findall(r'#include "([^"]+)"', re.sub(r"//.*", "", ecc[tail:]))
    assert included == _TAIL, f"ecc.cu now includes {included}: update tests/ecc_host_build.py"
    ecc = ecc[:tail]
    smem = "extern __shared__ __align__(16) unsigned char dynamic_smem[];"
    assert smem in ecc, "ecc.cu's dynamic shared memory changed: update tests/ecc_host_build.py"
    ecc = ecc.replace(smem, _DYNAMIC_SMEM[smem])
    headers = _TAIL if soft else _TAIL[2:]  # without soft: the soft ECC and ECT kernels left out
    return (_EMULATION.replace("@SMEM@", str(EMULATED_SMEM)) + common + ecc
            + "".join(_header(src, name) for name in headers))


def build(tmp_path_factory, name: str, driver: str, *defines: str, soft: bool = False):
    """Compile host_source(soft) + ``driver`` (with -D ``defines``); the executable's path.
    Skips where no host C++ compiler is on PATH."""
    if CXX is None:
        pytest.skip("no host C++ compiler (c++, g++ or clang++) on PATH")
    tmp = tmp_path_factory.mktemp(name)
    (tmp / f"{name}.cpp").write_text(host_source(soft) + driver)
    exe = tmp / name
    run = subprocess.run([CXX, "-std=c++20", "-O1", "-pthread", "-w", *defines, "-o", str(exe),
                          str(tmp / f"{name}.cpp")], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-4000:]
    return exe
