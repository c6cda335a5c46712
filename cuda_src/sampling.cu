// grid_sample: bilinear (trilinear) and nearest sampling of channels-first images at normalised
// points, torch.nn.functional.grid_sample's semantics, forward and VJP.
//
//   out[n, c, p] = sum_k w_k(grid[n, p]) image[n, c, pix_k(grid[n, p])]
//
// over the K corners of the cell around the point (K = 2^NDIM; K = 1, w = 1 for nearest),
// corners outside the image reading zero. cutopo/sampling.py documents the contract and holds
// the NumPy path these kernels are tested against. The coordinate map, the weights and the
// forward sum repeat that path operation by operation with explicitly rounded arithmetic (no
// fused multiply-add): a point on a pixel edge or centre then falls into the same cell on both
// backends, and the one-sided grid cotangent there is the same.
//
// Layout. image (N, C, S) with S the flattened spatial axes (D H W or H W), grid (N, P, NDIM)
// with P the flattened output points and the components x first (component NDIM - 1 - a runs
// along image axis a), output and output cotangent (N, C, P).
//
// Work layout.
//   forward        one thread per (channel group, n, p), p fastest: the corner set-up is done
//                  once per point and reused for the group's channels; a warp stores 32
//                  consecutive outputs of one channel plane (coalesced) and gathers from a
//                  neighbourhood of the image (cached). Channel groups (more than one only when
//                  N P alone cannot fill the device) split the channel loop, not the sums.
//                  It also tests the grid for non-finite values (flag bit 1).
//   check_image    a grid-stride pass over the image (flag bit 2): the contract refuses
//                  non-finite images, whose pixels the forward does not all read.
//   backward       one thread per (channel group, n, p). Grid cotangent (one group only): per
//                  corner the sum over channels of value times output cotangent, in registers,
//                  then the weights' derivatives; plain stores. Image cotangent: atomic adds of
//                  weight times output cotangent (zero-initialised buffer).
//   entry_keys +   the deterministic image cotangent: every (n, p, corner) entry gets the image
//   image_rows     row n S + pix it adds to (N S when it adds nothing) and its weight; the host
//                  sorts the entries by row (stable), and one thread per (channel group, row)
//                  sums the row's entries in that order and stores every element once (zero
//                  rows included): bitwise reproducible.
//
// Index arithmetic is 64-bit (N C S and N C P may exceed 2^31), except in the forward and
// backward launches whose indices all fit in 31 bits (`narrow`, decided by the host), which
// run the same code with int indices.
#include "sampling.cuh"

namespace cutopo {
namespace sampling {

constexpr int THREADS = 256;
constexpr int GRID_NONFINITE = 1, IMAGE_NONFINITE = 2;
constexpr int ROW_CHANNELS = 8;  // channels per pass of image_rows (accumulators in registers)

// ---------------------------------------------------------------------------------------------
// Bad values

// One atomic OR per warp that saw a bad value (the flag is written rarely: only on bad input).
__device__ __forceinline__ void raise_flag(int* flags, bool bad, int bit) {
    const unsigned any = __ballot_sync(__activemask(), bad);
    if (any && (threadIdx.x % 32) == __ffs(any) - 1) atomicOr(flags, bit);
}

// Thread t of a launch over (channel group, n, p), p fastest: its point and channels.
template <typename I>
struct Item {
    I np, n, p;
    int c0, c1;
    __device__ __forceinline__ Item(I t, I NP, I P, int C, int per_group) {
        const I group = t / NP;
        np = t - group * NP;
        n = np / P;
        p = np - n * P;
        c0 = (int)group * per_group;
        c1 = min(C, c0 + per_group);
    }
};

// ---------------------------------------------------------------------------------------------
// Forward

template <typename I, typename T, typename R, typename O, int NDIM, bool NEAREST>
__device__ __forceinline__ void forward_item(const T* __restrict__ image, const R* __restrict__ grid,
                                             O* __restrict__ out, int* __restrict__ flags, I t, I NP,
                                             I P, int C, int per_group, int padding, int align, int d,
                                             int h, int w) {
    const Item<I> it(t, NP, P, C, per_group);
    const Dims<I, NDIM> dims(d, h, w);
    const I S = dims.stride[0] * dims.size[0];
    Cell<R, NDIM, NEAREST, I> cell;
    cell.setup(grid + it.np * NDIM, dims, padding, align != 0);
    raise_flag(flags, !cell.finite_grid, GRID_NONFINITE);
    // Two channels per iteration: twice the gathers in flight before the stores wait on them.
#pragma unroll 2
    for (int c = it.c0; c < it.c1; ++c) {
        const I plane = it.n * C + c;
        const T* img = image + plane * S;
        R acc = R(0);
#pragma unroll
        for (int k = 0; k < cell.K; ++k)
            if (cell.in(k)) acc = add_rn(acc, mul_rn(cell.wt[k], load<R>(img + cell.pix[k])));
        store(out + plane * P + it.p, acc);
    }
}

// narrow: N C S, N C P and n_threads NDIM are all below 2^31 (32-bit index arithmetic).
template <typename T, typename R, typename O, int NDIM, bool NEAREST>
__global__ void __launch_bounds__(THREADS)
forward(const T* __restrict__ image, const R* __restrict__ grid, O* __restrict__ out,
        int* __restrict__ flags, i64 n_threads, i64 NP, i64 P, int C, int per_group, int padding,
        int align, int d, int h, int w, int narrow) {
    const i64 t = (i64)blockIdx.x * THREADS + threadIdx.x;
    if (t >= n_threads) return;
    if (narrow)
        forward_item<int, T, R, O, NDIM, NEAREST>(image, grid, out, flags, (int)t, (int)NP, (int)P,
                                                  C, per_group, padding, align, d, h, w);
    else
        forward_item<i64, T, R, O, NDIM, NEAREST>(image, grid, out, flags, t, NP, P, C, per_group,
                                                  padding, align, d, h, w);
}

// Non-finite image values (flag bit 2), over a grid-stride loop.
template <typename T>
__global__ void __launch_bounds__(THREADS)
check_image(const T* __restrict__ image, i64 n, int* __restrict__ flags) {
    const i64 stride = (i64)gridDim.x * THREADS;
    bool bad = false;
#pragma unroll 4
    for (i64 i = (i64)blockIdx.x * THREADS + threadIdx.x; i < n; i += stride) bad |= !finite(image[i]);
    raise_flag(flags, bad, IMAGE_NONFINITE);
}

// ---------------------------------------------------------------------------------------------
// Backward: grid cotangent (plain stores), image cotangent by atomics

template <typename I, typename T, typename R, int NDIM, bool NEAREST>
__device__ __forceinline__ void backward_item(const T* __restrict__ image, const R* __restrict__ grid,
                                              const R* __restrict__ gout, R* __restrict__ dimage,
                                              R* __restrict__ dgrid, I t, I NP, I P, int C,
                                              int per_group, int padding, int align, int d, int h,
                                              int w, int need_image, int need_grid) {
    const Item<I> it(t, NP, P, C, per_group);
    const Dims<I, NDIM> dims(d, h, w);
    const I S = dims.stride[0] * dims.size[0];
    Cell<R, NDIM, NEAREST, I> cell;
    cell.setup(grid + it.np * NDIM, dims, padding, align != 0);
    constexpr int K = Cell<R, NDIM, NEAREST, I>::K;
    // Nearest is piecewise constant: its grid cotangent is zero (as torch), no values needed.
    const bool values = need_grid && !NEAREST;
    R s[K];  // per corner: sum over channels of value times output cotangent
#pragma unroll
    for (int k = 0; k < K; ++k) s[k] = R(0);
    if (need_image || values) {
        for (int c = it.c0; c < it.c1; ++c) {
            const I plane = it.n * C + c;
            const R go = gout[plane * P + it.p];
#pragma unroll
            for (int k = 0; k < K; ++k) {
                if (!cell.in(k)) continue;
                if (values) s[k] = add_rn(s[k], mul_rn(load<R>(image + plane * S + cell.pix[k]), go));
                if (need_image) atomicAdd(dimage + plane * S + cell.pix[k], mul_rn(cell.wt[k], go));
            }
        }
    }
    if (!need_grid) return;
    // sampling._backward_numpy: d w_corner / d x_a is +-(the other axes' weights); the corners
    // are summed in order, then scaled by d x_a / d g.
#pragma unroll
    for (int a = 0; a < NDIM; ++a) {
        R gx = R(0);
        if (!NEAREST) {
#pragma unroll
            for (int k = 0; k < K; ++k) {
                R dw = cell.offset(k, a) ? s[k] : -s[k];
#pragma unroll
                for (int b = 0; b < NDIM; ++b)
                    if (b != a) dw = mul_rn(dw, cell.w[b][cell.offset(k, b)]);
                gx = add_rn(gx, dw);
            }
            gx = mul_rn(gx, cell.dx[a]);
        }
        dgrid[it.np * NDIM + (NDIM - 1 - a)] = gx;
    }
}

template <typename T, typename R, int NDIM, bool NEAREST>
__global__ void __launch_bounds__(THREADS)
backward(const T* __restrict__ image, const R* __restrict__ grid, const R* __restrict__ gout,
         R* __restrict__ dimage, R* __restrict__ dgrid, i64 n_threads, i64 NP, i64 P, int C,
         int per_group, int padding, int align, int d, int h, int w, int need_image, int need_grid,
         int narrow) {
    const i64 t = (i64)blockIdx.x * THREADS + threadIdx.x;
    if (t >= n_threads) return;
    if (narrow)
        backward_item<int, T, R, NDIM, NEAREST>(image, grid, gout, dimage, dgrid, (int)t, (int)NP,
                                                (int)P, C, per_group, padding, align, d, h, w,
                                                need_image, need_grid);
    else
        backward_item<i64, T, R, NDIM, NEAREST>(image, grid, gout, dimage, dgrid, t, NP, P, C,
                                                per_group, padding, align, d, h, w, need_image,
                                                need_grid);
}

// ---------------------------------------------------------------------------------------------
// Deterministic image cotangent

// keys[np K + k] = the image row n S + pix that corner k of point np adds to, or N S (sorts
// last, read by no row) when it lies outside; weights[np K + k] its weight.
template <typename R, typename Key, int NDIM, bool NEAREST>
__global__ void __launch_bounds__(THREADS)
entry_keys(const R* __restrict__ grid, Key* __restrict__ keys, R* __restrict__ weights, i64 NP,
           i64 P, int padding, int align, int d, int h, int w) {
    const i64 np = (i64)blockIdx.x * THREADS + threadIdx.x;
    if (np >= NP) return;
    const Dims<i64, NDIM> dims(d, h, w);
    const i64 S = dims.stride[0] * dims.size[0];
    const i64 n = np / P;
    const i64 none = (NP / P) * S;
    Cell<R, NDIM, NEAREST> cell;
    cell.setup(grid + np * NDIM, dims, padding, align != 0);
    constexpr int K = Cell<R, NDIM, NEAREST>::K;
#pragma unroll
    for (int k = 0; k < K; ++k) {
        keys[np * K + k] = (Key)(cell.in(k) ? n * S + cell.pix[k] : none);
        weights[np * K + k] = cell.wt[k];
    }
}

// One thread per (channel group, row), row = n S + pix fastest: the sum over the row's entries
// ent[seg[row]] .. ent[seg[row + 1] - 1] (sorted by row, stable: a fixed order) of weight times
// output cotangent, ROW_CHANNELS channels per pass, each element of the row stored once.
// log2_k: log2 of the corners per point.
template <typename R>
__global__ void __launch_bounds__(THREADS)
image_rows(const R* __restrict__ gout, const i64* __restrict__ ent, const R* __restrict__ weights,
           const i64* __restrict__ seg, R* __restrict__ dimage, i64 n_threads, i64 rows, i64 S,
           i64 P, int C, int per_group, int log2_k) {
    const i64 t = (i64)blockIdx.x * THREADS + threadIdx.x;
    if (t >= n_threads) return;
    const i64 group = t / rows;
    const i64 row = t - group * rows;
    const i64 n = row / S;
    const i64 pix = row - n * S;
    const int c_begin = (int)group * per_group;
    const int c_end = min(C, c_begin + per_group);
    const i64 e0 = seg[row], e1 = seg[row + 1];
    for (int c0 = c_begin; c0 < c_end; c0 += ROW_CHANNELS) {
        R acc[ROW_CHANNELS];
#pragma unroll
        for (int j = 0; j < ROW_CHANNELS; ++j) acc[j] = R(0);
        for (i64 e = e0; e < e1; ++e) {
            const i64 id = ent[e];
            const R wv = weights[id];
            const i64 p = (id >> log2_k) - n * P;
            const R* go = gout + (n * C + c0) * P + p;
#pragma unroll
            for (int j = 0; j < ROW_CHANNELS; ++j)
                if (c0 + j < c_end) acc[j] = add_rn(acc[j], mul_rn(wv, go[j * P]));
        }
#pragma unroll
        for (int j = 0; j < ROW_CHANNELS; ++j)
            if (c0 + j < c_end) dimage[(n * C + c0 + j) * S + pix] = acc[j];
    }
}

}  // namespace sampling
}  // namespace cutopo
