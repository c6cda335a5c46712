// Shared device helpers for every cutopo kernel family.
// Header-free on purpose: NVRTC then needs no include paths, so the offline compile check
// (no GPU, no CUDA toolkit headers) compiles exactly the text the runtime compiles.
#pragma once

namespace cutopo {

typedef long long i64;
typedef unsigned long long u64;

// float16 storage without <cuda_fp16.h>: the bits, converted with one PTX instruction.
struct half {
    unsigned short bits;
};

__device__ __forceinline__ float half_to_float(half h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h.bits));
    return f;
}

// Arithmetic rounded once per operation, as NumPy rounds it: the intrinsics keep the compiler
// from contracting a product and a sum into one fused multiply-add, so a kernel that repeats a
// NumPy expression operation by operation gets NumPy's values.
__device__ __forceinline__ float add_rn(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ double add_rn(double a, double b) { return __dadd_rn(a, b); }
__device__ __forceinline__ float sub_rn(float a, float b) { return __fsub_rn(a, b); }
__device__ __forceinline__ double sub_rn(double a, double b) { return __dsub_rn(a, b); }
__device__ __forceinline__ float mul_rn(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ double mul_rn(double a, double b) { return __dmul_rn(a, b); }
__device__ __forceinline__ float div_rn(float a, float b) { return __fdiv_rn(a, b); }
__device__ __forceinline__ double div_rn(double a, double b) { return __ddiv_rn(a, b); }
__device__ __forceinline__ float sqrt_rn(float a) { return __fsqrt_rn(a); }
__device__ __forceinline__ double sqrt_rn(double a) { return __dsqrt_rn(a); }

// Read an element of a storage type as the type comparisons are made in.
template <typename To, typename From>
__device__ __forceinline__ To convert(From v) { return static_cast<To>(v); }
// float32 -> float64 without the denormal flush that -ftz=true applies to a cast (the compiler
// flushes the input with a multiplication by 1 before F2F.F64.F32): cvt without .ftz is one
// F2F, exact for denormals too. The earlier version (a denormal test, then the mantissa times
// 2^-149; both paths predicated) took ~10 instructions per conversion, most of the CPAB adjoint
// step: the integrate backward ran 1.40 -> 1.04 ms (2D) and 2.41 -> 1.87 ms (3D) with this
// (benchmarks/RESULTS.md, ninth session).
template <>
__device__ __forceinline__ double convert<double, float>(float v) {
    double d;
    asm("cvt.f64.f32 %0, %1;" : "=d"(d) : "f"(v));
    return d;
}
template <>
__device__ __forceinline__ float convert<float, half>(half v) { return half_to_float(v); }
template <>
__device__ __forceinline__ double convert<double, half>(half v) { return (double)half_to_float(v); }
template <>
__device__ __forceinline__ long long convert<long long, half>(half v) { return (long long)half_to_float(v); }

// Order-preserving unsigned keys: a < b  <=>  key(a) < key(b), with NaN ordered as +inf and
// -0.0 equal to +0.0 (as the comparison operators see them). Integer operations only: CuPy
// compiles with -ftz=true, under which float32 arithmetic and comparisons treat denormals as
// zero, while NumPy does not. The all-ones key is never produced, so it can stand for
// "outside the image".
__device__ __forceinline__ unsigned int order_key(float v) {
    unsigned int u = __float_as_uint(v);
    const unsigned int mag = u & 0x7fffffffu;
    if (mag > 0x7f800000u) u = 0x7f800000u;  // NaN -> +inf
    else if (mag == 0) u = 0;                 // -0.0 -> +0.0
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
__device__ __forceinline__ u64 order_key(double v) {
    u64 u = (u64)__double_as_longlong(v);
    const u64 mag = u & 0x7fffffffffffffffULL;
    if (mag > 0x7ff0000000000000ULL) u = 0x7ff0000000000000ULL;
    else if (mag == 0) u = 0;
    return (u & 0x8000000000000000ULL) ? ~u : (u | 0x8000000000000000ULL);
}
__device__ __forceinline__ unsigned int order_key(half v) { return order_key(half_to_float(v)); }
__device__ __forceinline__ unsigned int order_key(unsigned char v) { return v; }
__device__ __forceinline__ unsigned int order_key(unsigned short v) { return v; }
__device__ __forceinline__ unsigned int order_key(short v) { return (unsigned int)((int)v + 32768); }
__device__ __forceinline__ u64 order_key(int v) { return (u64)((i64)v + 2147483648LL); }

// "a <= b" and "a > b" as NumPy evaluates them: IEEE float32 comparisons, denormals included.
// Under -ftz=true the compiler emits float comparisons as setp.ftz, which flushes denormal
// operands (a denormal pixel would then pass "<= 0" where NumPy's does not); setp without .ftz
// is the same one FSETP. Any NaN operand makes both false.
template <typename T>
__device__ __forceinline__ bool le(T a, T b) { return a <= b; }
template <typename T>
__device__ __forceinline__ bool gt(T a, T b) { return a > b; }
template <>
__device__ __forceinline__ bool le<float>(float a, float b) {
    unsigned r;
    asm("{.reg .pred p; setp.le.f32 p, %1, %2; selp.u32 %0, 1, 0, p;}" : "=r"(r) : "f"(a), "f"(b));
    return r != 0u;
}
template <>
__device__ __forceinline__ bool gt<float>(float a, float b) {
    unsigned r;
    asm("{.reg .pred p; setp.gt.f32 p, %1, %2; selp.u32 %0, 1, 0, p;}" : "=r"(r) : "f"(a), "f"(b));
    return r != 0u;
}
// a b + c clamped to [0, 1], NaN to 0, in one instruction (FFMA.SAT: the compiler's own form of
// __saturatef(__fmaf_rn(a, b, c)) took a separate FADD.SAT).
__device__ __forceinline__ float fma_saturate(float a, float b, float c) {
    float r;
    asm("fma.rn.ftz.sat.f32 %0, %1, %2, %3;" : "=f"(r) : "f"(a), "f"(b), "f"(c));
    return r;
}
// k + (v > hi), the comparison as gt makes it; for floats a predicated add (the compiler's own
// form of it took a select more).
template <typename T>
__device__ __forceinline__ int step_up(int k, T v, T hi) {
    return k + (v > hi);
}
template <>
__device__ __forceinline__ int step_up<float>(int k, float v, float hi) {
    asm("{.reg .pred p; setp.gt.f32 p, %1, %2; @p add.s32 %0, %0, 1;}" : "+r"(k) : "f"(v), "f"(hi));
    return k;
}
template <>
__device__ __forceinline__ int step_up<double>(int k, double v, double hi) {
    asm("{.reg .pred p; setp.gt.f64 p, %1, %2; @p add.s32 %0, %0, 1;}" : "+r"(k) : "d"(v), "d"(hi));
    return k;
}
// A 32-bit address in the shared window, and a load of a word there: for loads whose address
// the caller computes (ecc.cu's ThresholdBins), where the compiler's own arithmetic for a
// biased index added the bias once a load. Host forms in tests/ecc_host_build.py.
typedef unsigned smem_addr;
__device__ __forceinline__ smem_addr shared_address(const void* p) {
    return (smem_addr)__cvta_generic_to_shared(p);
}
__device__ __forceinline__ unsigned load_shared_u32(smem_addr a) {
    unsigned r;
    asm("ld.shared.u32 %0, [%1];" : "=r"(r) : "r"(a));
    return r;
}
// atomicAdd(shared int at a, v) as a reduction (no result) at a 32-bit shared address that the
// caller computed (ecc.cu's HistSink: its lane's copy of the histogram plus the bin's offset).
__device__ __forceinline__ void shared_add(smem_addr a, int v) {
    asm volatile("red.shared.add.s32 [%0], %1;" :: "r"(a), "r"(v) : "memory");
}
// a - b, opaque to the compiler: it does not reassociate the sums that made a and b.
__device__ __forceinline__ unsigned opaque_sub(unsigned a, unsigned b) {
    unsigned r;
    asm("sub.u32 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
    return r;
}

// 2 acc + (the carry out of a + b), unsigned 32-bit: an add that keeps only its carry, then an
// add of acc to itself with carry in (two instructions; a compare and select needs a predicate
// register and one more).
__device__ __forceinline__ unsigned shift_in_carry(unsigned acc, unsigned a, unsigned b) {
    unsigned r;
    asm("{.reg .u32 s; add.cc.u32 s, %1, %2; addc.u32 %0, %3, %3;}" : "=r"(r) : "r"(a), "r"(b), "r"(acc));
    return r;
}

template <typename K>
__device__ __forceinline__ constexpr K all_ones() { return (K)~(K)0; }

// A check whose flags are reduced over a kernel's grid and published without a memset, copy
// or event per call (cutopo._cuda.deferred.PinnedStatus): each block ORs its threads' ``bad``
// into status[0] (zero at rest; status[2] counts the finished blocks), and the last block to
// finish zeroes both for the next launch and, where ``host`` is not null, stores the flags in
// host[1] and then token << 2 in host[0] (mapped page-locked memory, after a system fence).
// Every thread of the block calls it, once, at the end of its work. Returns (block-uniform)
// whether this block finished last: every other block's device-memory writes before its call
// are then visible to it (each block fences them before it counts itself).
__device__ __forceinline__ bool publish_grid_flags(unsigned bad, u64* status, u64* host, i64 token) {
    __shared__ int last_block;
    bad = __reduce_or_sync(0xffffffffu, bad);
    if (threadIdx.x % 32 == 0 && bad) atomicOr(status, (u64)bad);
    __syncthreads();  // this block's writes and reductions are done
    if (threadIdx.x == 0) {
        __threadfence();
        last_block = atomicAdd(status + 2, 1ull) == (u64)gridDim.x - 1;
        if (last_block) {
            __threadfence();
            const u64 flags = atomicExch(status, 0ull);
            atomicExch(status + 2, 0ull);
            if (host != nullptr) {
                volatile u64* word = host;
                word[1] = flags;
                __threadfence_system();  // the flags land before the token that releases them
                word[0] = (u64)token << 2;
            }
        }
    }
    __syncthreads();
    return last_block != 0;
}

}  // namespace cutopo
