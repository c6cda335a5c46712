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

// Read an element of a storage type as the type comparisons are made in.
template <typename To, typename From>
__device__ __forceinline__ To convert(From v) { return static_cast<To>(v); }
template <>
__device__ __forceinline__ float convert<float, half>(half v) { return half_to_float(v); }
template <>
__device__ __forceinline__ double convert<double, half>(half v) { return (double)half_to_float(v); }
template <>
__device__ __forceinline__ long long convert<long long, half>(half v) { return (long long)half_to_float(v); }

// Order-preserving unsigned keys: a < b  <=>  key(a) < key(b), with NaN ordered as +inf and
// -0.0 equal to +0.0 (as the comparison operators see them). The all-ones key is never
// produced, so it can stand for "outside the image".
__device__ __forceinline__ unsigned int order_key(float v) {
    if (v != v) v = __int_as_float(0x7f800000);   // NaN -> +inf
    v = v + 0.0f;                                   // -0.0 -> +0.0
    unsigned int u = __float_as_uint(v);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
__device__ __forceinline__ u64 order_key(double v) {
    if (v != v) v = __longlong_as_double(0x7ff0000000000000LL);
    v = v + 0.0;
    u64 u = (u64)__double_as_longlong(v);
    return (u & 0x8000000000000000ULL) ? ~u : (u | 0x8000000000000000ULL);
}
__device__ __forceinline__ unsigned int order_key(half v) { return order_key(half_to_float(v)); }
__device__ __forceinline__ unsigned int order_key(unsigned char v) { return v; }
__device__ __forceinline__ unsigned int order_key(unsigned short v) { return v; }
__device__ __forceinline__ unsigned int order_key(short v) { return (unsigned int)((int)v + 32768); }
__device__ __forceinline__ u64 order_key(int v) { return (u64)((i64)v + 2147483648LL); }

template <typename K>
__device__ __forceinline__ constexpr K all_ones() { return (K)~(K)0; }

}  // namespace cutopo
