// Exact expected Euler characteristic of random binary images with independent pixels, and its
// gradient (cutopo.expected_euler; the cell model is described in cutopo/_expected_euler.py).
//
// A cell is a box spanned by a set S of axes over a base grid B; its box product is the product
// of B over its 2^|S| corners. V construction: B = p, a cell contributes (-1)^|S| * product.
// T construction: B = q = 1 - p on a grid padded by a ring of ones, a cell contributes
// (-1)^(NDIM - |S|) * (1 - product), and along the axes outside S only the image's own
// positions count. Box types S are bit masks: bit a set when the box spans axis a (C order,
// axis 0 slowest). In 2D a thread reads its 2^NDIM (forward) or 3^NDIM (backward) neighbours
// straight from global memory: the work per element is small, and the caches serve the reuse.
// In 3D a thread walks a column of SEGMENT positions along z, its lanes' columns consecutive in
// x: each plane of its neighbourhood is loaded once and serves two (forward) or three
// (backward) positions, and the products are regrouped by plane (forward_segment,
// backward_segment).
#include "common.cuh"

namespace cutopo {
namespace ecc {
namespace expected {

constexpr int THREADS = 256;
constexpr int WARPS = THREADS / 32;

__host__ __device__ constexpr int popcount(unsigned m) { return m ? (int)(m & 1u) + popcount(m >> 1) : 0; }

// (-1)^dim of the cells of box type S: dim = |S| (V) or NDIM - |S| (T).
template <int NDIM, bool TCONN>
__host__ __device__ constexpr int cell_sign(unsigned S) {
    return ((TCONN ? NDIM - popcount(S) : popcount(S)) & 1) ? -1 : 1;
}

// Index into a 3^NDIM neighbourhood (digit of axis a weighs 3^a) of corner d of a box, seen
// from corner c of the same box (both bit masks: the offset along axis a is d_a - c_a).
template <int NDIM>
__host__ __device__ constexpr int relative(unsigned d, unsigned c, int a = 0, int weight = 1) {
    return a == NDIM ? 0 : (1 + (int)((d >> a) & 1u) - (int)((c >> a) & 1u)) * weight +
                           relative<NDIM>(d, c, a + 1, weight * 3);
}

// Product of nb over the corners D != C of a box of type S, nb seen from corner C. Template
// recursion keeps every neighbourhood index a compile-time constant, so nb[] stays in
// registers (loops left to the unroller put it in local memory in 3D).
template <int NDIM, unsigned S, unsigned C, unsigned D = 0, typename Real, int NB>
__device__ __forceinline__ Real others(const Real (&nb)[NB]) {
    if constexpr (D == (1u << NDIM)) {
        return Real(1);
    } else if constexpr ((D & ~S) != 0 || D == C) {
        return others<NDIM, S, C, D + 1>(nb);
    } else {
        return nb[relative<NDIM>(D, C)] * others<NDIM, S, C, D + 1>(nb);
    }
}

// Sum over the box types S and the corners C of S of (-1)^dim times the product of the other
// corners: the derivative of the cells through the centre of nb with respect to it.
template <int NDIM, bool TCONN, unsigned S = 0, unsigned C = 0, typename Real, int NB>
__device__ __forceinline__ Real cell_derivatives(const Real (&nb)[NB]) {
    constexpr unsigned CORNERS = 1u << NDIM;
    if constexpr (S == CORNERS) {
        return Real(0);
    } else if constexpr (C == CORNERS) {
        return cell_derivatives<NDIM, TCONN, S + 1, 0>(nb);
    } else if constexpr ((C & ~S) != 0) {
        return cell_derivatives<NDIM, TCONN, S, C + 1>(nb);
    } else {
        const Real rest = cell_derivatives<NDIM, TCONN, S, C + 1>(nb);
        if constexpr (cell_sign<NDIM, TCONN>(S) > 0) return rest + others<NDIM, S, C>(nb);
        else return rest - others<NDIM, S, C>(nb);
    }
}

template <int NDIM>
__device__ __forceinline__ void extents(i64 (&n)[NDIM], i64 nz, i64 ny, i64 nx) {
    if constexpr (NDIM == 3) n[0] = nz;
    n[NDIM - 2] = ny;
    n[NDIM - 1] = nx;
}

// Block-wide sum, complete in thread 0. Every thread of the block must call it (barriers).
__device__ __forceinline__ double block_sum(double v) {
    __shared__ double partial[WARPS];
#pragma unroll
    for (int d = 16; d > 0; d >>= 1) v += __shfl_down_sync(0xffffffffu, v, d);
    if (threadIdx.x % 32 == 0) partial[threadIdx.x / 32] = v;
    __syncthreads();
    v = 0.0;
    if (threadIdx.x < 32) {
        v = threadIdx.x < WARPS ? partial[threadIdx.x] : 0.0;
#pragma unroll
        for (int d = 16; d > 0; d >>= 1) v += __shfl_down_sync(0xffffffffu, v, d);
    }
    __syncthreads();  // the next call overwrites partial[]
    return v;
}

// Mixed-radix coordinates of a C-order linear index over extents ext (digit 0 unbounded), moved
// by a fixed step with carries: the loops below then need no 64-bit division, a subroutine
// call that costs more than a cell's arithmetic and made ptxas spill around it. A thread's
// start and step are below 2^32 (the host caps the grid at 2^32 / THREADS blocks), so the
// constructor divides in 32 bits: an extent above the index just takes the index whole.
template <int K>
struct Counter {
    i64 digit[K];
    __device__ __forceinline__ Counter(unsigned i, const i64 (&ext)[K]) {
#pragma unroll
        for (int a = K - 1; a > 0; --a) {
            if ((u64)ext[a] > i) {
                digit[a] = i;
                i = 0;
            } else {  // ext[a] <= i < 2^32
                digit[a] = i % (unsigned)ext[a];
                i /= (unsigned)ext[a];
            }
        }
        digit[0] = i;
    }
    // Needs step.digit[a] < ext[a] (true by construction), so one carry per digit suffices.
    __device__ __forceinline__ void advance(const Counter& step, const i64 (&ext)[K]) {
        int carry = 0;
#pragma unroll
        for (int a = K - 1; a > 0; --a) {
            const i64 d = digit[a] + step.digit[a] + carry;
            carry = d >= ext[a];
            digit[a] = carry ? d - ext[a] : d;
        }
        digit[0] += step.digit[0] + carry;
    }
};

// The signed terms of anchor_terms from the anchor's image offset and its masks (see there).
// FULL: every mask is all ones (the anchor and its unit box inside the image, as for all but
// the last layer of anchors), known at compile time, so the corners load without a bounds
// check and no box type is tested (256^3 float32 on an H100, forty-third session: T 161 ->
// 140 us, V 135 -> 133).
template <bool FULL, typename Real, int NDIM, bool TCONN>
__device__ __forceinline__ double anchor_sum(const Real* p, i64 off, const i64 (&stride)[NDIM],
                                             unsigned spans, unsigned own, unsigned next,
                                             unsigned& bad) {
    constexpr int CORNERS = 1 << NDIM;
    if constexpr (FULL) spans = own = next = CORNERS - 1;

    // B at the corners y + c of the unit box: q = 1 on the T ring. In V every corner a cell
    // uses is inside; the others are never read.
    Real v[CORNERS];
#pragma unroll
    for (unsigned c = 0; c < CORNERS; ++c) {
        const bool inside = (c & ~next) == 0 && ((CORNERS - 1) & ~c & ~own) == 0;
        i64 corner = off;
#pragma unroll
        for (int a = 0; a < NDIM; ++a)
            if ((c >> a) & 1u) corner += stride[a];
        if constexpr (TCONN) v[c] = inside ? Real(1) - p[corner] : Real(1);
        else v[c] = inside ? p[corner] : Real(0);
        if (c == 0 && inside && !(p[corner] >= Real(0) && p[corner] <= Real(1))) bad = 1u;
    }

    double sum = 0.0;
#pragma unroll
    for (unsigned S = 0; S < CORNERS; ++S) {
        const unsigned rest = (CORNERS - 1) & ~S;
        if ((S & ~spans) || (rest & ~own)) continue;  // no cell of type S anchored here
        Real w = Real(1);
#pragma unroll
        for (unsigned c = 0; c < CORNERS; ++c)
            if ((c & ~S) == 0) w *= v[c];
        const double term = TCONN ? 1.0 - (double)w : (double)w;
        sum += cell_sign<NDIM, TCONN>(S) * term;
    }
    return sum;
}

// Signed terms of the cells of every box type anchored (lowest corner) at base position y of
// one image ``p`` with C-order strides ``stride``: the base grid has extents n + 2 * TCONN.
// ``bad`` gets bit 0 when the anchor's own pixel (every pixel is one anchor's corner 0) lies
// outside [0, 1] or is NaN: the forward's check of prob.
template <typename Real, int NDIM, bool TCONN>
__device__ __forceinline__ double anchor_terms(const Real* p, const i64 (&n)[NDIM], const i64 (&stride)[NDIM],
                                               const i64 (&y)[NDIM], unsigned& bad) {
    constexpr int TRIM = TCONN ? 1 : 0;
    constexpr unsigned ALL = (1u << NDIM) - 1;
    // Bit a of: spans, a box may extend along axis a from here (y_a + 1 < n_a + 2 TRIM); own,
    // the anchor's image coordinate x_a = y_a - TRIM is inside the image (in T: y_a is not on
    // the ring); next, x_a + 1 is inside the image.
    unsigned spans = 0, own = 0, next = 0;
    i64 off = 0;  // image offset of the anchor (unused when outside)
#pragma unroll
    for (int a = 0; a < NDIM; ++a) {
        const i64 x = y[a] - TRIM;
        off += x * stride[a];
        if (x + 1 < n[a] + TRIM) spans |= 1u << a;
        if (x >= 0 && x < n[a]) own |= 1u << a;
        if (x + 1 < n[a]) next |= 1u << a;
    }
    if ((spans & own & next) == ALL)
        return anchor_sum<true, Real, NDIM, TCONN>(p, off, stride, spans, own, next, bad);
    return anchor_sum<false, Real, NDIM, TCONN>(p, off, stride, spans, own, next, bad);
}

// The 3D backward walks a column of SEGMENT voxels along axis 0 (z), one thread per (image,
// segment, y, x): a warp's lanes are consecutive x, so every load is coalesced, and each plane
// of the walk is loaded once (its 3 x 3 block around (y, x)) and used by three voxels.
constexpr int SEGMENT = 16;

// What the walk keeps of one plane z' of the 3 x 3 block around a column (y, x), B values
// (pad outside the image): m = B(z', y, x); f, the four face neighbours in the plane
// (y-1, x), (y+1, x), (y, x-1), (y, x+1); and t, for the four squares of the plane through
// (y, x) (corner (y + sy, x + sx), sy, sx = -1 or +1, in that order), the product of the
// square's three corners other than (y, x).
template <typename Real>
struct PlaneBlock {
    Real m, f[4], t[4];
};

// The plane z' of the block around (y, x) at ``column`` (the address of (z', y, x)); ``rows``
// (1 for (z', y - 1), 2 for (z', y + 1)) and ``cols`` (1 for x - 1, 2 for x + 1) say which
// neighbours lie inside the image, ``inside`` whether z' does; sy the row stride.
template <typename Real, bool TCONN, bool INTERIOR>
__device__ __forceinline__ PlaneBlock<Real> plane_block(const Real* column, i64 sy, bool inside,
                                                        unsigned rows, unsigned cols) {
    constexpr Real PAD = TCONN ? Real(1) : Real(0);
    Real w[3][3];
#pragma unroll
    for (int dy = 0; dy < 3; ++dy) {
#pragma unroll
        for (int dx = 0; dx < 3; ++dx) {
            bool ok = inside;
            if constexpr (!INTERIOR) {
                if (dy != 1) ok = ok && ((rows >> (dy >> 1)) & 1u);
                if (dx != 1) ok = ok && ((cols >> (dx >> 1)) & 1u);
            }
            const Real v = ok ? column[(dy - 1) * sy + (dx - 1)] : PAD;
            w[dy][dx] = TCONN && ok ? Real(1) - v : v;
        }
    }
    PlaneBlock<Real> b;
    b.m = w[1][1];
    b.f[0] = w[0][1];
    b.f[1] = w[2][1];
    b.f[2] = w[1][0];
    b.f[3] = w[1][2];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        const int dy = (k >> 1) * 2, dx = (k & 1) * 2;  // (-1,-1), (-1,+1), (+1,-1), (+1,+1)
        b.t[k] = w[dy][1] * w[1][dx] * w[dy][dx];
    }
    return b;
}

// dE/dB at every voxel of one column segment [z0, z1) of image ``p`` (extents nz, ny, nx),
// written times ``scale`` to ``grad`` (the image's gradient). The cells through a voxel x, by
// box type (cell_derivatives' sum, regrouped by planes): its vertex (sign s0, product 1); the
// six edges (s1: the face neighbours' B); the twelve squares (s2): four in x's plane (t of its
// plane) and, for each z' = z -+ 1, four across planes, B(z', y, x) times the pair products
// B(z, face) B(z', face) of the four face columns; the eight cubes (s3): for each square of
// x's plane and each z', its t times B(z', y, x) times t of plane z'. So
//   g(z) = own(z) + B(z-1, y, x) L(z-1, z) + B(z+1, y, x) L(z, z+1),
//   own(z) = s0 + s1 (sum of f(z)) + s2 (sum of t(z)),
//   L(u, v) = s1 + s2 (sum of f(u) f(v)) + s3 (sum of t(u) t(v)),
// the link L of two neighbouring planes serving both. The walk keeps one plane (m, f, t) and
// the voxel's sum so far (own and the term of the plane below), so that it fits its launch
// bound without spills (expected_euler_backward). A voxel costs one plane's loads and ~30
// products and sums, against 27 loads and ~80 products of the plain loop.
template <typename Real, bool TCONN, bool INTERIOR>
__device__ __forceinline__ void backward_segment(const Real* p, Real* grad, Real scale, i64 nz, i64 sz,
                                                 i64 sy, i64 column, i64 z0, i64 z1, unsigned rows,
                                                 unsigned cols) {
    constexpr Real S0 = cell_sign<3, TCONN>(0u), S1 = cell_sign<3, TCONN>(1u);
    constexpr Real S2 = cell_sign<3, TCONN>(3u), S3 = cell_sign<3, TCONN>(7u);
    const auto own = [](const PlaneBlock<Real>& b) {
        return S0 + S1 * ((b.f[0] + b.f[1]) + (b.f[2] + b.f[3]))
               + S2 * ((b.t[0] + b.t[1]) + (b.t[2] + b.t[3]));
    };
    const auto link = [](const PlaneBlock<Real>& u, const PlaneBlock<Real>& v) {
        const Real pairs = u.f[0] * v.f[0] + u.f[1] * v.f[1] + u.f[2] * v.f[2] + u.f[3] * v.f[3];
        const Real cubes = u.t[0] * v.t[0] + u.t[1] * v.t[1] + u.t[2] * v.t[2] + u.t[3] * v.t[3];
        return S1 + S2 * pairs + S3 * cubes;
    };
    const Real* at = p + column + (z0 - 1) * sz;
    const PlaneBlock<Real> below = plane_block<Real, TCONN, INTERIOR>(at, sy, z0 > 0, rows, cols);
    PlaneBlock<Real> cur = plane_block<Real, TCONN, INTERIOR>(at + sz, sy, true, rows, cols);
    Real sum = own(cur) + below.m * link(below, cur);  // g(z0) but the plane above's term
    at += 2 * sz;
    for (i64 z = z0; z < z1; ++z, at += sz) {
        const PlaneBlock<Real> next = plane_block<Real, TCONN, INTERIOR>(at, sy, z + 1 < nz, rows, cols);
        const Real L = link(cur, next);
        grad[column + z * sz] = (sum + next.m * L) * scale;
        sum = own(next) + cur.m * L;
        cur = next;
    }
}

// The in-plane box products of plane z' at anchor column (y, x): g[T] = the product of B over
// the corners of the box of in-plane type T (0: the pixel (y, x), 1: with (y, x + 1), 2: with
// (y + 1, x), 3: the square of all four), pad outside the image; ``corners`` bit c (c = 2 cy +
// cx) says whether corner (y + cy, x + cx) lies inside the image's plane, ``inside`` whether
// z' does. ``bad`` gets bit 0 when the pixel (z', y, x) is inside and outside [0, 1] or NaN.
template <typename Real, bool TCONN, bool FULL>
__device__ __forceinline__ void plane_products(const Real* at, i64 sy, bool inside, unsigned corners,
                                               Real (&g)[4], unsigned& bad) {
    constexpr Real PAD = TCONN ? Real(1) : Real(0);
    Real v[4];
#pragma unroll
    for (int c = 0; c < 4; ++c) {
        const bool ok = inside && (FULL || ((corners >> c) & 1u));
        const Real raw = ok ? at[(c >> 1) * sy + (c & 1)] : Real(0);
        if (c == 0 && ok && !(raw >= Real(0) && raw <= Real(1))) bad = 1u;
        v[c] = ok ? (TCONN ? Real(1) - raw : raw) : PAD;
    }
    g[0] = v[0];
    g[1] = v[0] * v[1];
    g[2] = v[0] * v[2];
    g[3] = g[1] * (v[2] * v[3]);
}

// The signed terms of the cells anchored at the SEGMENT (or fewer) anchors [k0, k1) of one
// column (y, x) along z (anchor z' = k): its in-plane types T at plane k and T + {z} spanning
// planes k and k + 1, whose box product is g_T(k) g_T(k + 1); a plane is loaded once and used by
// two anchors (anchor_terms loads 2^3 corners an anchor). V: the image's anchors, pad 0, each
// term (-1)^|S| times the product (a cell leaving the image has a corner reading 0). T: anchors
// from -1 (the ring) on each axis, pad 1, each term (-1)^(3 - |S|) (1 - product): T's and
// T + {z}'s terms add up to (-1)^|T| (g_T(k) - g_T(k) g_T(k + 1)), as V's do, and a cell the
// T complex does not have (its anchor on the ring along an axis it does not span) has every
// corner on the ring: g = 1, no term. So both take one formula and no mask.
template <typename Real, bool TCONN, bool FULL>
__device__ __forceinline__ double forward_segment(const Real* p, i64 nz, i64 sz, i64 sy, i64 column,
                                                  i64 k0, i64 k1, unsigned corners, unsigned& bad) {
    Real cur[4], next[4];
    const Real* at = p + column + k0 * sz;
    plane_products<Real, TCONN, FULL>(at, sy, k0 >= 0, corners, cur, bad);
    double sum = 0.0;
    for (i64 k = k0; k < k1; ++k) {
        at += sz;
        plane_products<Real, TCONN, FULL>(at, sy, k + 1 < nz, corners, next, bad);
        // (-1)^|T|: + for the pixel and the square, - for the two edges
        sum += ((double)cur[0] - (double)(cur[0] * next[0])) + ((double)cur[3] - (double)(cur[3] * next[3]))
               - ((double)cur[1] - (double)(cur[1] * next[1])) - ((double)cur[2] - (double)(cur[2] * next[2]));
#pragma unroll
        for (int T = 0; T < 4; ++T) cur[T] = next[T];
    }
    return sum;
}

// E[chi] terms of one image in 3D: one thread per (segment of SEGMENT anchors along z, anchor
// column (y, x)), the items of the image's blocks_per_image blocks (thread ``index`` of them,
// ``count`` threads in all); V anchors cover the image, T anchors start at -1 on each axis.
template <typename Real, bool TCONN>
__device__ __forceinline__ double forward_walks(const Real* p, i64 nz, i64 ny, i64 nx, unsigned index,
                                                unsigned count, unsigned& bad) {
    constexpr i64 TRIM = TCONN ? 1 : 0;
    const i64 segments = (nz + TRIM + SEGMENT - 1) / SEGMENT;
    const i64 ext[3] = {segments, ny + TRIM, nx + TRIM};
    const i64 sz = ny * nx;
    const Counter<3> step(count, ext);
    double sum = 0.0;
    for (Counter<3> item(index, ext); item.digit[0] < segments; item.advance(step, ext)) {
        const i64 y = item.digit[1] - TRIM, x = item.digit[2] - TRIM;
        const i64 k0 = item.digit[0] * SEGMENT - TRIM;
        const i64 k1 = k0 + SEGMENT < nz ? k0 + SEGMENT : nz;
        unsigned corners = 0u;
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            const i64 yc = y + (c >> 1), xc = x + (c & 1);
            if (yc >= 0 && yc < ny && xc >= 0 && xc < nx) corners |= 1u << c;
        }
        const i64 column = y * nx + x;
        if (corners == 15u)
            sum += forward_segment<Real, TCONN, true>(p, nz, sz, nx, column, k0, k1, corners, bad);
        else
            sum += forward_segment<Real, TCONN, false>(p, nz, sz, nx, column, k0, k1, corners, bad);
    }
    return sum;
}

// expected_euler_backward in 3D: one thread per (image, segment of SEGMENT planes, y, x), in
// C order (x fastest), over a grid-stride loop.
template <typename Real, bool TCONN>
__device__ __forceinline__ void backward_walks(const Real* __restrict__ prob, const Real* __restrict__ cotangent,
                                               Real* __restrict__ grad, i64 nimg, i64 nz, i64 ny, i64 nx) {
    const i64 segments = (nz + SEGMENT - 1) / SEGMENT;
    const i64 ext[4] = {nimg, segments, ny, nx};
    const i64 sz = ny * nx, npix = nz * sz;
    const i64 total = nimg * segments * sz;
    const unsigned first = blockIdx.x * THREADS + threadIdx.x;
    const unsigned step = gridDim.x * THREADS;
    const Counter<4> item_step(step, ext);
    Counter<4> item(first, ext);
    for (i64 i = first; i < total; i += step, item.advance(item_step, ext)) {
        const i64 img = item.digit[0], y = item.digit[2], x = item.digit[3];
        const i64 z0 = item.digit[1] * SEGMENT;
        const i64 z1 = z0 + SEGMENT < nz ? z0 + SEGMENT : nz;
        const unsigned rows = (y > 0 ? 1u : 0u) | (y + 1 < ny ? 2u : 0u);
        const unsigned cols = (x > 0 ? 1u : 0u) | (x + 1 < nx ? 2u : 0u);
        const Real* p = prob + img * npix;
        Real* g = grad + img * npix;
        const i64 column = y * nx + x;
        if (rows == 3u && cols == 3u)
            backward_segment<Real, TCONN, true>(p, g, cotangent[img], nz, sz, nx, column, z0, z1, rows, cols);
        else
            backward_segment<Real, TCONN, false>(p, g, cotangent[img], nz, sz, nx, column, z0, z1, rows, cols);
    }
}

}  // namespace expected

// out (nimg,): E[chi] of image img of prob (nimg, *spatial), in Real.
// Each image gets blocks_per_image blocks that stride over its base positions; the grid is a
// multiple of blocks_per_image and strides over images, so a block never mixes two images in
// one sum. One thread per anchor (3D: per column segment, expected::forward_walks), one
// double atomicAdd per block and image into ``sums``
// (nimg, zero at rest); the last block to finish writes out = (Real)sums and leaves sums
// zeroed (no memset and no cast kernel per call). The check of prob (a pixel outside [0, 1]
// or NaN: flag 1) is published by publish_grid_flags, into ``status`` (3 words, zero at rest)
// and ``host`` (may be null) with ``token``: the op reads it once the kernel is queued,
// instead of a reduction and a copy before it.
template <typename Real, int NDIM, bool TCONN>
__global__ void __launch_bounds__(expected::THREADS)
expected_euler_forward(const Real* __restrict__ prob, double* __restrict__ sums,
                       Real* __restrict__ out, i64 nimg, i64 nz, i64 ny, i64 nx,
                       int blocks_per_image, u64* __restrict__ status, u64* __restrict__ host,
                       i64 token) {
    i64 n[NDIM], stride[NDIM], L[NDIM];
    expected::extents<NDIM>(n, nz, ny, nx);
    i64 npix = 1;
#pragma unroll
    for (int a = NDIM - 1; a >= 0; --a) {
        L[a] = n[a] + (TCONN ? 2 : 0);
        stride[a] = npix;
        npix *= n[a];
    }
    typedef expected::Counter<NDIM> Anchor;
    const Anchor first((blockIdx.x % blocks_per_image) * expected::THREADS + threadIdx.x, L);
    const Anchor step((unsigned)blocks_per_image * expected::THREADS, L);
    const i64 images_per_pass = gridDim.x / blocks_per_image;

    unsigned bad = 0u;
    for (i64 img = blockIdx.x / blocks_per_image; img < nimg; img += images_per_pass) {
        const Real* p = prob + img * npix;
        double sum = 0.0;
        if constexpr (NDIM == 3)
            sum = expected::forward_walks<Real, TCONN>(
                p, nz, ny, nx, (blockIdx.x % blocks_per_image) * expected::THREADS + threadIdx.x,
                (unsigned)blocks_per_image * expected::THREADS, bad);
        else
            for (Anchor y = first; y.digit[0] < L[0]; y.advance(step, L))
                sum += expected::anchor_terms<Real, NDIM, TCONN>(p, n, stride, y.digit, bad);
        sum = expected::block_sum(sum);
        if (threadIdx.x == 0) atomicAdd(sums + img, sum);
    }
    if (publish_grid_flags(bad, status, host, token)) {
        for (i64 k = threadIdx.x; k < nimg; k += expected::THREADS) {
            out[k] = (Real)__ldcg(sums + k);  // from L2, where the atomics added
            sums[k] = 0.0;
        }
    }
}

// grad (nimg, *spatial) = dE[chi]/dprob times the cotangent of each image, no atomics: the sum
// over every cell containing x of (-1)^dim times the product of the cell's other corners,
// products formed directly (no division by p). In 2D one thread per pixel (below), in 3D one
// per column segment (expected::backward_walks). In T, a pixel's
// cells all exist (the ring gives every box through x an anchor, and x is an own position), and
// corners on the ring read q = 1. In V a cell through x that leaves the image has another corner
// outside, which reads 0 and cancels the term: no cell needs a bounds check in either.
// The 3D walk keeps one plane of its block and a sum in registers (backward_segment): held to
// four blocks a multiprocessor in float32 (64 registers; unbounded, ptxas took 85-94: two
// blocks, and 256^3 ran 235-250 us against 144-159 held) and three in float64 (80), neither
// spills. Against the walk's first form (three planes: 122 registers in float64, ~110 bytes
// spilled at three blocks), 256^3 on an H200: float32 V 236 -> 138-147 us, T 315 -> 153-162;
// float64 V 272 -> 232-242, T 381 -> 331-344 (RESULTS.md, forty-sixth session).
template <typename Real, int NDIM, bool TCONN>
__global__ void __launch_bounds__(expected::THREADS, NDIM == 3 ? (sizeof(Real) == 8 ? 3 : 4) : 1)
expected_euler_backward(const Real* __restrict__ prob, const Real* __restrict__ cotangent,
                        Real* __restrict__ grad, i64 nimg, i64 nz, i64 ny, i64 nx) {
    if constexpr (NDIM == 3) {
        expected::backward_walks<Real, TCONN>(prob, cotangent, grad, nimg, nz, ny, nx);
        return;
    }
    constexpr int NB = NDIM == 3 ? 27 : 9;
    i64 n[NDIM], stride[NDIM];
    expected::extents<NDIM>(n, nz, ny, nx);
    i64 npix = 1;
#pragma unroll
    for (int a = NDIM - 1; a >= 0; --a) {
        stride[a] = npix;
        npix *= n[a];
    }
    // Position i is (image, x_0, ..., x_{NDIM-1}) in C order.
    i64 ext[NDIM + 1];
    ext[0] = nimg;
#pragma unroll
    for (int a = 0; a < NDIM; ++a) ext[a + 1] = n[a];
    typedef expected::Counter<NDIM + 1> Pixel;
    const i64 total = nimg * npix;
    const unsigned first = blockIdx.x * expected::THREADS + threadIdx.x;
    const unsigned step = gridDim.x * expected::THREADS;
    const Pixel pixel_step(step, ext);

    Pixel pos(first, ext);
    for (i64 i = first; i < total; i += step, pos.advance(pixel_step, ext)) {
        const i64 img = pos.digit[0];
        const i64* x = pos.digit + 1;

        // B on the 3^NDIM neighbourhood of x (digit of axis a weighs 3^a, offset digit - 1).
        // Pixels whose whole neighbourhood is inside (all but the border layer) load it
        // without a bounds check, whose compares and selects were more of the 3D loop's
        // instructions than the products (static SASS, sass_lines.py): 256^3 float32 on an
        // H100 (forty-third session) V 300 -> 220 us, T 396 -> 367.
        bool interior = true;
#pragma unroll
        for (int a = 0; a < NDIM; ++a) interior = interior && x[a] > 0 && x[a] + 1 < n[a];
        Real nb[NB];
        if (interior) {
            const Real* centre = prob + i;
#pragma unroll
            for (int j = 0; j < NB; ++j) {
                i64 off = 0;
                int rest = j;
#pragma unroll
                for (int a = 0; a < NDIM; ++a) {
                    off += (rest % 3 - 1) * stride[a];
                    rest /= 3;
                }
                if constexpr (TCONN) nb[j] = Real(1) - centre[off];
                else nb[j] = centre[off];
            }
        } else {
#pragma unroll
            for (int j = 0; j < NB; ++j) {
                bool inside = true;
                i64 off = i;
                int rest = j;
#pragma unroll
                for (int a = 0; a < NDIM; ++a) {
                    const int o = rest % 3 - 1;
                    rest /= 3;
                    const i64 xa = x[a] + o;
                    inside = inside && xa >= 0 && xa < n[a];
                    off += o * stride[a];
                }
                if constexpr (TCONN) nb[j] = inside ? Real(1) - prob[off] : Real(1);
                else nb[j] = inside ? prob[off] : Real(0);
            }
        }

        // x is corner C of the cells of type S anchored at x - C.
        const Real g = expected::cell_derivatives<NDIM, TCONN>(nb);
        grad[i] = g * cotangent[img];
    }
}

}  // namespace ecc
}  // namespace cutopo
