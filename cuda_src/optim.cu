// Optimiser updates on parameter arrays: one fused Adam step (cutopo/_adam.py holds the NumPy
// form these kernels repeat, and the contract), and the gradient of the mean squared error with
// its sum (cutopo/cpab/losses.py's mse, for register's device steps).
//
//   m = b1 m + (1 - b1) g;   v = b2 v + (1 - b2) g g;   p -= step m / (sqrt(v) root + eps)
//
// in the parameters' dtype T, operation by operation in NumPy's order with T-rounded constants
// (NumPy casts the Python float constants to T), each product and sum rounded on its own (no
// fused multiply-add), IEEE division and square root: the same values as the NumPy update.
//
// Work layout: adam_step one thread per element; mse_gradient a grid-stride loop, block sums
// in shared memory, one float64 atomic per block.
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

// grad = (warped - fixed) scale in T (scale = 2 / n rounded to T by the host, as NumPy's
// diff * (2.0 / diff.size)); *sum += sum of (warped - fixed)^2, each square and the sums in
// float64 (the mean's numerator; losses.mse sums in T, so the value agrees to T's rounding).
template <typename T>
__global__ void __launch_bounds__(THREADS)
mse_gradient(const T* __restrict__ warped, const T* __restrict__ fixed, T* __restrict__ grad, i64 n,
             T scale, double* __restrict__ sum) {
    __shared__ double partial[THREADS / 32];
    double acc = 0.0;
    for (i64 i = (i64)blockIdx.x * THREADS + threadIdx.x; i < n; i += (i64)gridDim.x * THREADS) {
        const T d = sub_rn(warped[i], fixed[i]);
        grad[i] = mul_rn(d, scale);
        const double dd = convert<double>(d);
        acc += dd * dd;
    }
    #pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) acc += __shfl_down_sync(0xffffffffu, acc, offset);
    if ((threadIdx.x & 31) == 0) partial[threadIdx.x / 32] = acc;
    __syncthreads();
    if (threadIdx.x == 0) {
        double total = 0.0;
        #pragma unroll
        for (int w = 0; w < THREADS / 32; ++w) total += partial[w];
        atomicAdd(sum, total);
    }
}

}  // namespace optim
}  // namespace cutopo
