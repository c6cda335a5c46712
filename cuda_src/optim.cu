// Optimiser updates on parameter arrays: one fused Adam step (cutopo/_adam.py holds the NumPy
// form these kernels repeat, and the contract).
//
//   m = b1 m + (1 - b1) g;   v = b2 v + (1 - b2) g g;   p -= step m / (sqrt(v) root + eps)
//
// in the parameters' dtype T, operation by operation in NumPy's order with T-rounded constants
// (NumPy casts the Python float constants to T), each product and sum rounded on its own (no
// fused multiply-add), IEEE division and square root: the same values as the NumPy update.
//
// Work layout: one thread per element.
#include "common.cuh"

namespace cutopo {
namespace optim {

constexpr int THREADS = 256;

__device__ __forceinline__ float mul(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ double mul(double a, double b) { return __dmul_rn(a, b); }
__device__ __forceinline__ float add(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ double add(double a, double b) { return __dadd_rn(a, b); }
__device__ __forceinline__ float sub(float a, float b) { return __fsub_rn(a, b); }
__device__ __forceinline__ double sub(double a, double b) { return __dsub_rn(a, b); }
__device__ __forceinline__ float div(float a, float b) { return __fdiv_rn(a, b); }
__device__ __forceinline__ double div(double a, double b) { return __ddiv_rn(a, b); }
__device__ __forceinline__ float root(float a) { return __fsqrt_rn(a); }
__device__ __forceinline__ double root(double a) { return __dsqrt_rn(a); }

// c1 = 1 - b1, c2 = 1 - b2, step = lr / (1 - b1^t), inv = 1 / sqrt(1 - b2^t), each already
// rounded to T by the host as NumPy rounds the Python floats.
template <typename T>
__global__ void __launch_bounds__(THREADS)
adam_step(T* __restrict__ params, T* __restrict__ m, T* __restrict__ v, const T* __restrict__ grad,
          i64 n, T b1, T c1, T b2, T c2, T step, T inv, T eps) {
    const i64 i = (i64)blockIdx.x * THREADS + threadIdx.x;
    if (i >= n) return;
    const T g = grad[i];
    const T mi = add(mul(m[i], b1), mul(c1, g));
    const T vi = add(mul(v[i], b2), mul(c2, mul(g, g)));
    m[i] = mi;
    v[i] = vi;
    params[i] = sub(params[i], div(mul(step, mi), add(mul(root(vi), inv), eps)));
}

}  // namespace optim
}  // namespace cutopo
