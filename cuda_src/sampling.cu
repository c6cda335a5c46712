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
#include "common.cuh"

namespace cutopo {
namespace sampling {

constexpr int THREADS = 256;
constexpr int BORDER = 1, REFLECTION = 2;  // padding codes (0: zeros), sampling.PADDING_MODES order
constexpr int GRID_NONFINITE = 1, IMAGE_NONFINITE = 2;
constexpr int ROW_CHANNELS = 8;  // channels per pass of image_rows (accumulators in registers)

// ---------------------------------------------------------------------------------------------
// Storage: loads into the computation type R, stores of R into the output type

template <typename R>
__device__ __forceinline__ R load(const float* p);
template <>
__device__ __forceinline__ float load<float>(const float* p) { return __ldg(p); }
template <>
__device__ __forceinline__ double load<double>(const float* p) { return convert<double, float>(__ldg(p)); }
template <typename R>
__device__ __forceinline__ R load(const double* p) { return __ldg(p); }
template <typename R>
__device__ __forceinline__ R load(const half* p) {
    return (R)half_to_float(half{__ldg(reinterpret_cast<const unsigned short*>(p))});
}

__device__ __forceinline__ void store(float* p, float v) { *p = v; }
__device__ __forceinline__ void store(double* p, double v) { *p = v; }
// float16 outputs: round to nearest even, as NumPy's astype(float16) does.
__device__ __forceinline__ void store(half* p, float v) {
    unsigned short bits;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(bits) : "f"(v));
    reinterpret_cast<unsigned short*>(p)[0] = bits;
}

// Non-finite tests on the bits: the comparisons of isfinite would be the same, but bits say
// what is meant, and -ftz=true cannot touch them.
__device__ __forceinline__ bool finite(float v) { return (__float_as_uint(v) & 0x7f800000u) != 0x7f800000u; }
__device__ __forceinline__ bool finite(double v) {
    return ((unsigned long long)__double_as_longlong(v) & 0x7ff0000000000000ULL) != 0x7ff0000000000000ULL;
}
__device__ __forceinline__ bool finite(half v) { return (v.bits & 0x7c00u) != 0x7c00u; }

// One atomic OR per warp that saw a bad value (the flag is written rarely: only on bad input).
__device__ __forceinline__ void raise_flag(int* flags, bool bad, int bit) {
    const unsigned any = __ballot_sync(__activemask(), bad);
    if (any && (threadIdx.x % 32) == __ffs(any) - 1) atomicOr(flags, bit);
}

// ---------------------------------------------------------------------------------------------
// Coordinates: sampling._coordinates, _clip and _reflect

// Clamp into [0, size - 1]; the derivative is 0 where x was outside.
template <typename R>
__device__ __forceinline__ R clip_coordinate(R x, R& dx, int size) {
    const R hi = R(size - 1);
    if (x < R(0) || x > hi) dx = R(0);
    return fmin(fmax(x, R(0)), hi);
}

// Reflect about the edges (pixel centres with align_corners, the outer pixel edges half a pixel
// beyond without), then clamp.
template <typename R>
__device__ __forceinline__ R reflect_coordinate(R x, R& dx, int size, bool align) {
    if (align && size == 1) {  // both edges at the one pixel centre: every point maps to it
        dx = R(0);
        return R(0);
    }
    const R low = align ? R(0) : R(-0.5);
    const R span = align ? R(size - 1) : R(size);
    R t = sub_rn(x, low);
    const bool negative = t < R(0);
    t = fabs(t);
    const R extra = fmod(t, span);
    const bool odd = fmod(floor(div_rn(t, span)), R(2)) == R(1);
    x = add_rn(odd ? sub_rn(span, extra) : extra, low);
    if (odd != negative) dx = -dx;
    return clip_coordinate(x, dx, size);
}

// Pixel coordinate along an axis of `size` pixels of the normalised coordinate g, and its
// derivative with respect to g.
template <typename R>
__device__ __forceinline__ R coordinate(R g, int size, int padding, bool align, R& dx) {
    const R scale = align ? mul_rn(R(size - 1), R(0.5)) : mul_rn(R(size), R(0.5));
    R x = mul_rn(add_rn(g, R(1)), scale);
    if (!align) x = sub_rn(x, R(0.5));
    dx = scale;
    if (padding == BORDER) {
        x = clip_coordinate(x, dx, size);
    } else if (padding == REFLECTION) {
        x = reflect_coordinate(x, dx, size, align);
    }
    // Zeros: points further out than one pixel read nothing, and the clamp keeps the integer
    // conversions in range. A no-op after border and reflection, except that it sends NaN (a
    // float32 coordinate that overflowed to inf, then reflected) to -2: nothing read out of
    // bounds, whatever the input.
    return fmin(fmax(x, R(-2)), R(size) + R(1));
}

// ---------------------------------------------------------------------------------------------
// The cell of one point

// I: the index type, int where every flattened index of the launch fits in 31 bits (the host
// says so: 64-bit multiplies and divisions cost several instructions each), else i64.
template <typename I, int NDIM>
struct Dims {
    int size[NDIM];  // image order: (H, W) or (D, H, W)
    I stride[NDIM];  // element strides of the flattened spatial axes
    __device__ __forceinline__ Dims(int d, int h, int w) {
        if constexpr (NDIM == 2) {
            size[0] = h; size[1] = w;
        } else {
            size[0] = d; size[1] = h; size[2] = w;
        }
        I s = 1;
#pragma unroll
        for (int a = NDIM - 1; a >= 0; --a) {
            stride[a] = s;
            s *= size[a];
        }
    }
};

template <typename R, int NDIM, bool NEAREST, typename I = i64>
struct Cell {
    static constexpr int K = NEAREST ? 1 : 1 << NDIM;  // corners, itertools.product order
    R w[NDIM][2];      // per axis, the weights of offsets 0 and 1 (bilinear)
    R dx[NDIM];        // per axis, d pixel coordinate / d grid component
    R wt[K];           // corner weights: w[0][o_0] * w[1][o_1] (* w[2][o_2]), in that order
    I pix[K];          // flattened pixel index of each corner, clamped into the image
    unsigned inside;   // bit k: corner k lies in the image
    bool finite_grid;

    __device__ __forceinline__ static int offset(int k, int a) { return (k >> (NDIM - 1 - a)) & 1; }

    __device__ __forceinline__ void setup(const R* g, const Dims<I, NDIM>& dims, int padding, bool align) {
        int i0[NDIM];  // coordinate() keeps x in [-2, size + 1]
        finite_grid = true;
#pragma unroll
        for (int a = 0; a < NDIM; ++a) {
            const R ga = g[NDIM - 1 - a];  // the grid is x (the last image axis) first
            finite_grid &= finite(ga);
            const R x = coordinate(ga, dims.size[a], padding, align, dx[a]);
            if (NEAREST) {
                i0[a] = (int)rint(x);  // round half to even: torch's nearbyint
                w[a][0] = R(1);
                w[a][1] = R(0);
            } else {
                const R x0 = floor(x);
                w[a][0] = sub_rn(add_rn(x0, R(1)), x);
                w[a][1] = sub_rn(x, x0);
                i0[a] = (int)x0;
            }
        }
        inside = 0;
#pragma unroll
        for (int k = 0; k < K; ++k) {
            bool in = true;
            I p = 0;
            R weight = R(1);
#pragma unroll
            for (int a = 0; a < NDIM; ++a) {
                const int o = offset(k, a);
                const int i = i0[a] + o;
                in &= i >= 0 && i < dims.size[a];
                p += (I)min(max(i, 0), dims.size[a] - 1) * dims.stride[a];
                weight = a == 0 ? w[a][o] : mul_rn(weight, w[a][o]);
            }
            pix[k] = p;
            wt[k] = weight;
            inside |= (unsigned)in << k;
        }
    }
    __device__ __forceinline__ bool in(int k) const { return (inside >> k) & 1u; }
};

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
