// Optimiser updates on parameter arrays: one fused Adam step (cutopo/_adam.py holds the NumPy
// form these kernels repeat, and the contract), and for register's device steps
// (cutopo/cpab/_register_cupy.py) the gradient of the mean squared error with its sum
// (cutopo/cpab/losses.py's mse) and the theta gradient with the Dirichlet term.
//
//   m = b1 m + (1 - b1) g;   v = b2 v + (1 - b2) g g;   p -= step m / (sqrt(v) root + eps)
//
// in the parameters' dtype T, operation by operation in NumPy's order with T-rounded constants
// (NumPy casts the Python float constants to T), each product and sum rounded on its own (no
// fused multiply-add), IEEE division and square root: the same values as the NumPy update.
//
// Work layout: adam_step, adam_scheduled and theta_gradient one thread per element;
// mse_gradient a grid-stride loop; sums as block sums in shared memory, one float64 atomic per
// block.
#include "common.cuh"

namespace cutopo {
namespace optim {

constexpr int THREADS = 256;

// One element of the Adam update. c1 = 1 - b1, c2 = 1 - b2, step = lr / (1 - b1^t),
// inv = 1 / sqrt(1 - b2^t), each already rounded to T by the host as NumPy rounds the Python
// floats.
template <typename T>
__device__ __forceinline__ void adam_element(T* __restrict__ params, T* __restrict__ m,
                                             T* __restrict__ v, T g, i64 i, T b1, T c1, T b2, T c2,
                                             T step, T inv, T eps) {
    const T mi = add_rn(mul_rn(m[i], b1), mul_rn(c1, g));
    const T vi = add_rn(mul_rn(v[i], b2), mul_rn(c2, mul_rn(g, g)));
    m[i] = mi;
    v[i] = vi;
    params[i] = sub_rn(params[i], div_rn(mul_rn(step, mi), add_rn(mul_rn(sqrt_rn(vi), inv), eps)));
}

template <typename T>
__global__ void __launch_bounds__(THREADS)
adam_step(T* __restrict__ params, T* __restrict__ m, T* __restrict__ v, const T* __restrict__ grad,
          i64 n, T b1, T c1, T b2, T c2, T step, T inv, T eps) {
    const i64 i = (i64)blockIdx.x * THREADS + threadIdx.x;
    if (i >= n) return;
    adam_element(params, m, v, grad[i], i, b1, c1, b2, c2, step, inv, eps);
}

// -- register's device steps: the step index lives on the device ----------------------------------

// sums[*counter] += the sum of every thread's acc in the block (warp shuffles, then one float64
// atomic from thread 0); every thread of the block must call it.
__device__ __forceinline__ void add_block_sum(double acc, double* __restrict__ sums,
                                              const int* __restrict__ counter) {
    __shared__ double partial[THREADS / 32];
    #pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) acc += __shfl_down_sync(0xffffffffu, acc, offset);
    if ((threadIdx.x & 31) == 0) partial[threadIdx.x / 32] = acc;
    __syncthreads();
    if (threadIdx.x == 0) {
        double total = 0.0;
        #pragma unroll
        for (int w = 0; w < THREADS / 32; ++w) total += partial[w];
        atomicAdd(sums + *counter, total);
    }
}
//
// A captured CUDA graph replays fixed arguments, so what changes from step to step (the loss
// slot, the step size and Adam's bias corrections) is read through *counter, the step's index
// in its chunk, which `advance` increments last.

// The update of step *counter: step = steps[*counter], inv = invs[*counter] (the host's tables,
// the values adam_step would be passed).
template <typename T>
__global__ void __launch_bounds__(THREADS)
adam_scheduled(T* __restrict__ params, T* __restrict__ m, T* __restrict__ v,
               const T* __restrict__ grad, i64 n, T b1, T c1, T b2, T c2, T eps,
               const T* __restrict__ steps, const T* __restrict__ invs,
               const int* __restrict__ counter) {
    const i64 i = (i64)blockIdx.x * THREADS + threadIdx.x;
    if (i >= n) return;
    const int k = *counter;
    adam_element(params, m, v, grad[i], i, b1, c1, b2, c2, steps[k], invs[k], eps);
}

// grad_T = T(grad) (+ w2 T(q) with `smooth`: the Dirichlet term's gradient 2 w Q theta, w2 = 2 w
// rounded to T), as register's array expression rounds it; with `smooth` also
// penalty[*counter] += sum theta T(q) in float64 (theta . Q theta, one atomic per block).
template <typename T>
__global__ void __launch_bounds__(THREADS)
theta_gradient(const double* __restrict__ grad, const double* __restrict__ q,
               const T* __restrict__ theta, T* __restrict__ grad_T, i64 n, T w2, int smooth,
               double* __restrict__ penalty, const int* __restrict__ counter) {
    const i64 i = (i64)blockIdx.x * THREADS + threadIdx.x;
    double acc = 0.0;
    if (i < n) {
        T g = (T)grad[i];
        if (smooth) {
            const T qi = (T)q[i];
            g = add_rn(g, mul_rn(w2, qi));
            acc = convert<double>(theta[i]) * convert<double>(qi);
        }
        grad_T[i] = g;
    }
    if (!smooth) return;
    add_block_sum(acc, penalty, counter);
}

// grad = (warped - fixed) scale in T (scale = 2 / n rounded to T by the host, as NumPy's
// diff * (2.0 / diff.size)); sums[*counter] += sum of (warped - fixed)^2, each square and the
// sums in float64 (the mean's numerator; losses.mse sums in T, so the value agrees to T's
// rounding).
template <typename T>
__global__ void __launch_bounds__(THREADS)
mse_gradient(const T* __restrict__ warped, const T* __restrict__ fixed, T* __restrict__ grad, i64 n,
             T scale, double* __restrict__ sums, const int* __restrict__ counter) {
    double acc = 0.0;
    for (i64 i = (i64)blockIdx.x * THREADS + threadIdx.x; i < n; i += (i64)gridDim.x * THREADS) {
        const T d = sub_rn(warped[i], fixed[i]);
        grad[i] = mul_rn(d, scale);
        const double dd = convert<double>(d);
        acc += dd * dd;
    }
    add_block_sum(acc, sums, counter);
}

__global__ void advance(int* counter) { *counter += 1; }

}  // namespace optim
}  // namespace cutopo
