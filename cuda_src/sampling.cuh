// The sampling arithmetic of grid_sample shared by its kernels (sampling.cu) and by the fused
// CPAB warp (cpab.cu): storage conversions, the pixel coordinate of a normalised coordinate
// under each padding mode, and the cell of corners around one point with its weights. The
// operations repeat cutopo/sampling.py's NumPy path one rounding at a time (sampling.cu's
// header says why).
#pragma once
#include "common.cuh"

namespace cutopo {
namespace sampling {

constexpr int BORDER = 1, REFLECTION = 2;  // padding codes (0: zeros), sampling.PADDING_MODES order

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

// ---------------------------------------------------------------------------------------------
// Coordinates: sampling._coordinates, _clip and _reflect

// Clamp into [0, size - 1]; the derivative is 0 where x was outside or on an end (sampling._clip).
// NaN (the reflection of a coordinate that overflowed to +-inf) goes to 0 (fmax(NaN, 0) = 0)
// with derivative 0.
template <typename R>
__device__ __forceinline__ R clip_coordinate(R x, R& dx, int size) {
    const R hi = R(size - 1);
    if (!(x > R(0) && x < hi)) dx = R(0);
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

}  // namespace sampling
}  // namespace cutopo
