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

// c1 = 1 - b1, c2 = 1 - b2, step = lr / (1 - b1^t), inv = 1 / sqrt(1 - b2^t), each already
// rounded to T by the host as NumPy rounds the Python floats.
template <typename T>
__global__ void __launch_bounds__(THREADS)
adam_step(T* __restrict__ params, T* __restrict__ m, T* __restrict__ v, const T* __restrict__ grad,
          i64 n, T b1, T c1, T b2, T c2, T step, T inv, T eps) {
    const i64 i = (i64)blockIdx.x * THREADS + threadIdx.x;
    if (i >= n) return;
    const T g = grad[i];
    const T mi = add_rn(mul_rn(m[i], b1), mul_rn(c1, g));
    const T vi = add_rn(mul_rn(v[i], b2), mul_rn(c2, mul_rn(g, g)));
    m[i] = mi;
    v[i] = vi;
    params[i] = sub_rn(params[i], div_rn(mul_rn(step, mi), add_rn(mul_rn(sqrt_rn(vi), inv), eps)));
}

}  // namespace optim
}  // namespace cutopo
