// Multi-camera, multi-scale deformable aggregation (the Sparse4D operator), forward and VJP.
//
//   out[b,a,c] = sum_{p,k,s} [visible] * wt[b,a,p,k,s,g(c)] * Bilinear_{k,s}(b; u, v)[c]
//
// with (u, v) = loc[b,a,p,k,:], x = u W - 1/2, y = v H - 1/2 (pixel centres at integer x, y),
// zero padding per corner, g(c) = c / (C / G). cutopo/deformable.py documents the contract and
// holds the NumPy path these kernels are tested against.
//
// Feature maps. Map (k, s) is described by one row of `maps` (int64): the element offset of
// its pixel (0, 0), channel 0, batch 0 from the `feat` pointer; the element stride between
// batches; H; W. Channels-last maps (the flattened (bs, num_feat, C) tensor, or per-level
// (bs, K, H, W, C) arrays) have pixel stride C and channel stride 1; channels-first maps
// (per-level (bs, K, C, H, W) arrays) pixel stride 1 and channel stride H W. Per-level arrays
// are reached through offsets from the first level's pointer, so they need no flattening copy.
//
// Lane layout, shared by every kernel. Lanes own V consecutive channels (one 16-byte load per
// corner when V > 1: channels-last only). Lanes are split into segments of L lanes (L a power of
// two, L >= CG / V where CG = C / G), one segment per channel group, GT = 32 / L groups per
// "tile"; a group wider than L V channels is covered in `steps` steps. A lane's channels thus
// always belong to one group, and a group's weight cotangent is a butterfly sum over its
// segment: no shared memory, no atomics, fixed order.
//
// Work layout.
//   forward          `parts` warps per (b, a, tile, step): the output elements of its lanes are
//                    owned by them. Each warp accumulates its share of the (point, camera, scale)
//                    items in registers; the shares are added in shared memory in a fixed order
//                    and stored once. No atomics (deterministic). parts > 1 fills the device
//                    at small batches with 16-byte lanes (one lane per channel instead, the
//                    other way to get more warps, costs four times the instructions per sample)
//                    and shortens each warp's serial chain of loads when a unit has many items
//                    (cutopo/_deformable_cupy.py: forward_parts).
//   backward         one warp per (b, a, p): the warp scans its K cameras (a ballot of the
//                    visibility test) and works only on visible ones; location and weight
//                    cotangents are reduced inside the warp and stored with plain stores (zeros
//                    for the invisible cameras). The feature cotangent, when asked for here, is
//                    scattered with atomics (16-byte vector reductions on sm_90).
//   entry_keys +     the deterministic feature cotangent: every (b, a, p, k, s, corner) entry
//   feature_rows     gets the feature row it reads (-1 when it reads nothing); the host sorts
//                    the entries by row (stable) and one warp per (row, tile, step) sums the
//                    row's entries in that order and stores the row once (zero rows included).
#include "common.cuh"

namespace cutopo {
namespace deform {

constexpr int THREADS = 256;
constexpr int WARPS = THREADS / 32;
constexpr unsigned FULL = 0xffffffffu;
// __launch_bounds__(THREADS, 1) everywhere: with the block size alone ptxas capped the
// registers of the backward and row kernels low enough to spill (around their 64-bit
// divisions); with a minimum of one block it allocates what they need (<= 128).

// bfloat16 storage: the upper half of a float32.
struct bf16 {
    unsigned short bits;
};

// ---------------------------------------------------------------------------------------------
// Loads: storage type -> computation type (float for half/bf16/float, double for double)

__device__ __forceinline__ float ld(const float* p) { return __ldg(p); }
__device__ __forceinline__ double ld(const double* p) { return __ldg(p); }
__device__ __forceinline__ float ld(const half* p) {
    return half_to_float(half{__ldg(reinterpret_cast<const unsigned short*>(p))});
}
__device__ __forceinline__ float ld(const bf16* p) {
    return __uint_as_float((unsigned)__ldg(reinterpret_cast<const unsigned short*>(p)) << 16);
}

__device__ __forceinline__ float lo_half(unsigned w) { return half_to_float(half{(unsigned short)(w & 0xffffu)}); }
__device__ __forceinline__ float hi_half(unsigned w) { return half_to_float(half{(unsigned short)(w >> 16)}); }
__device__ __forceinline__ float lo_bf16(unsigned w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float hi_bf16(unsigned w) { return __uint_as_float(w & 0xffff0000u); }

// V consecutive elements from p (16-byte aligned when V > 1).
template <int V, typename R>
__device__ __forceinline__ void ldv(const float* p, R (&o)[V]) {
    if constexpr (V % 4 == 0) {
#pragma unroll
        for (int j = 0; j < V; j += 4) {
            const float4 t = __ldg(reinterpret_cast<const float4*>(p + j));
            o[j] = t.x; o[j + 1] = t.y; o[j + 2] = t.z; o[j + 3] = t.w;
        }
    } else {
#pragma unroll
        for (int j = 0; j < V; ++j) o[j] = __ldg(p + j);
    }
}
template <int V, typename R>
__device__ __forceinline__ void ldv(const double* p, R (&o)[V]) {
    if constexpr (V % 2 == 0) {
#pragma unroll
        for (int j = 0; j < V; j += 2) {
            const double2 t = __ldg(reinterpret_cast<const double2*>(p + j));
            o[j] = t.x; o[j + 1] = t.y;
        }
    } else {
#pragma unroll
        for (int j = 0; j < V; ++j) o[j] = __ldg(p + j);
    }
}
template <int V, typename R>
__device__ __forceinline__ void ldv(const half* p, R (&o)[V]) {
    if constexpr (V == 8) {
        const uint4 t = __ldg(reinterpret_cast<const uint4*>(p));
        o[0] = lo_half(t.x); o[1] = hi_half(t.x); o[2] = lo_half(t.y); o[3] = hi_half(t.y);
        o[4] = lo_half(t.z); o[5] = hi_half(t.z); o[6] = lo_half(t.w); o[7] = hi_half(t.w);
    } else {
#pragma unroll
        for (int j = 0; j < V; ++j) o[j] = ld(p + j);
    }
}
template <int V, typename R>
__device__ __forceinline__ void ldv(const bf16* p, R (&o)[V]) {
    if constexpr (V == 8) {
        const uint4 t = __ldg(reinterpret_cast<const uint4*>(p));
        o[0] = lo_bf16(t.x); o[1] = hi_bf16(t.x); o[2] = lo_bf16(t.y); o[3] = hi_bf16(t.y);
        o[4] = lo_bf16(t.z); o[5] = hi_bf16(t.z); o[6] = lo_bf16(t.w); o[7] = hi_bf16(t.w);
    } else {
#pragma unroll
        for (int j = 0; j < V; ++j) o[j] = ld(p + j);
    }
}

template <int V>
__device__ __forceinline__ void stv(float* p, const float (&o)[V]) {
    if constexpr (V % 4 == 0) {
#pragma unroll
        for (int j = 0; j < V; j += 4)
            *reinterpret_cast<float4*>(p + j) = make_float4(o[j], o[j + 1], o[j + 2], o[j + 3]);
    } else {
#pragma unroll
        for (int j = 0; j < V; ++j) p[j] = o[j];
    }
}
template <int V>
__device__ __forceinline__ void stv(double* p, const double (&o)[V]) {
    if constexpr (V % 2 == 0) {
#pragma unroll
        for (int j = 0; j < V; j += 2) *reinterpret_cast<double2*>(p + j) = make_double2(o[j], o[j + 1]);
    } else {
#pragma unroll
        for (int j = 0; j < V; ++j) p[j] = o[j];
    }
}

// Atomic accumulation of V values into the feature cotangent. sm_90 has 16-byte vector
// reductions: one L2 operation per four floats instead of four.
template <int V>
__device__ __forceinline__ void red_add(float* p, const float (&o)[V]) {
#if __CUDA_ARCH__ >= 900
    constexpr bool vector = V % 4 == 0;
#else
    constexpr bool vector = false;
#endif
    if constexpr (vector) {
#pragma unroll
        for (int j = 0; j < V; j += 4)
            asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};"
                         :: "l"(p + j), "f"(o[j]), "f"(o[j + 1]), "f"(o[j + 2]), "f"(o[j + 3])
                         : "memory");
    } else {
#pragma unroll
        for (int j = 0; j < V; ++j) atomicAdd(p + j, o[j]);
    }
}
template <int V>
__device__ __forceinline__ void red_add(double* p, const double (&o)[V]) {
#pragma unroll
    for (int j = 0; j < V; ++j) atomicAdd(p + j, o[j]);
}

// ---------------------------------------------------------------------------------------------
// Geometry

// 0 < u < 1, exactly (NaN fails). float32 on the bits: the kernels compile with -ftz=true, under
// which a comparison sees a denormal u as 0 while NumPy does not.
__device__ __forceinline__ bool open_unit(float u) {
    const int b = __float_as_int(u);
    return b > 0 && b < 0x3f800000;
}
__device__ __forceinline__ bool open_unit(double u) { return u > 0.0 && u < 1.0; }

// A superset of the (point, camera) pairs that can contribute. boundary 0 ("sparse4d"): the
// reference's cut 0 < u, v < 1. boundary 1 ("zeros"): some scale has -1 < x < W, i.e.
// -1/(2W) < u < 1 + 1/(2W), inside (-1/2, 3/2) for every W >= 1; the exact test is per scale.
template <typename R>
__device__ __forceinline__ bool visible(R u, R v, int boundary) {
    if (boundary == 0) return open_unit(u) && open_unit(v);
    return u > R(-0.5) && u < R(1.5) && v > R(-0.5) && v < R(1.5);
}

// x = u W - 1/2 rounded twice, as NumPy computes it (no fused multiply-add), so both backends
// see the same pixel cell and the same fractions.
__device__ __forceinline__ float coord(float u, int n) { return __fadd_rn(__fmul_rn(u, (float)n), -0.5f); }
__device__ __forceinline__ double coord(double u, int n) { return __dadd_rn(__dmul_rn(u, (double)n), -0.5); }

// Bilinear set-up of one (point, camera, scale): false when no corner is inside (then nothing
// is read). Pixel (y, x) of the map is at element offset (y W + x) * ps + c * cs.
template <typename R>
struct Cell {
    R hx, lx, hy, ly;   // 1 - fx, fx, 1 - fy, fy
    i64 pix00;          // y0 W + x0 (may be out of the map when a corner is)
    int W, H;
    bool ok00, ok01, ok10, ok11;

    __device__ __forceinline__ bool setup(R u, R v, int h, int w) {
        H = h; W = w;
        const R x = coord(u, w), y = coord(v, h);
        // -1 < x < W and -1 < y < H: at least one corner is inside; also bounds x0, y0 below,
        // so the conversions to int cannot overflow. NaN fails.
        if (!(x > R(-1) && x < R(w) && y > R(-1) && y < R(h))) return false;
        const R fx0 = floor(x), fy0 = floor(y);
        const int x0 = (int)fx0, y0 = (int)fy0;
        lx = x - fx0; ly = y - fy0;
        hx = R(1) - lx; hy = R(1) - ly;
        const bool xin0 = x0 >= 0, xin1 = x0 + 1 <= w - 1;
        const bool yin0 = y0 >= 0, yin1 = y0 + 1 <= h - 1;
        ok00 = yin0 && xin0; ok01 = yin0 && xin1; ok10 = yin1 && xin0; ok11 = yin1 && xin1;
        pix00 = (i64)y0 * w + x0;
        return true;
    }
    __device__ __forceinline__ i64 pix(int i) const {
        return pix00 + (i >> 1) * (i64)W + (i & 1);
    }
    __device__ __forceinline__ bool ok(int i) const {
        return i == 0 ? ok00 : i == 1 ? ok01 : i == 2 ? ok10 : ok11;
    }
    __device__ __forceinline__ R weight(int i) const {  // (i >> 1 ? ly : hy) * (i & 1 ? lx : hx)
        return ((i >> 1) ? ly : hy) * ((i & 1) ? lx : hx);
    }
};

struct Map {
    i64 off, bstride;
    int H, W;
};
__device__ __forceinline__ Map load_map(const i64* maps, int ks) {
    Map m;
    m.off = __ldg(maps + 4 * ks);
    m.bstride = __ldg(maps + 4 * ks + 1);
    m.H = (int)__ldg(maps + 4 * ks + 2);
    m.W = (int)__ldg(maps + 4 * ks + 3);
    return m;
}

// The lane's channels: group g, first channel c (V of them); active when they exist.
struct Lanes {
    int g, c;
    bool active;
    __device__ __forceinline__ Lanes(int tile, int step, int L, int GT, int G, int CG, int V) {
        const int lane = threadIdx.x % 32;
        g = tile * GT + lane / L;
        const int cin = (lane % L + L * step) * V;
        active = g < G && cin < CG;
        c = g * CG + cin;
    }
};

template <typename T>
__device__ __forceinline__ T warp_sum(T v) {
#pragma unroll
    for (int d = 16; d > 0; d >>= 1) v += __shfl_xor_sync(FULL, v, d);
    return v;
}

// ---------------------------------------------------------------------------------------------
// Forward

template <typename F, typename Wt, typename R, int V>
__global__ void __launch_bounds__(THREADS, 1)
forward(const F* __restrict__ feat, const i64* __restrict__ maps, const R* __restrict__ loc,
        const Wt* __restrict__ wts, R* __restrict__ out, i64 n_warps, int A, int P, int K, int S,
        int C, int G, int L, int GT, int steps, int per_anchor, int parts, int channels_first,
        int boundary) {
    // Partial sums of the `parts` warps of one output unit (parts is 1, 2, 4 or 8: it divides
    // WARPS, so a unit's warps are consecutive in one block).
    __shared__ R partial[WARPS][32][V];
    const i64 warp = (i64)blockIdx.x * WARPS + threadIdx.x / 32;
    // Warps past the end (the last block's missing units) skip the work but not the barrier.
    const bool live = warp < n_warps;
    const int lane = threadIdx.x % 32;
    const i64 unit = warp / parts;
    const int part = (int)(warp - unit * parts);
    const i64 ba = unit / per_anchor;
    const int r = (int)(unit - ba * per_anchor);
    const i64 b = ba / A;
    const int CG = C / G;
    const Lanes ln(r / steps, r % steps, L, GT, G, CG, V);

    R acc[V];
#pragma unroll
    for (int j = 0; j < V; ++j) acc[j] = R(0);

    const int PK = P * K;
    const R* loc_a = loc + ba * (i64)PK * 2;
    const Wt* wts_a = wts + ba * (i64)PK * S * G;
    for (int j0 = 0; live && j0 < PK; j0 += 32) {
        // One lane per (point, camera) tests visibility; the warp then visits the visible ones.
        const int jl = j0 + lane;
        R u = R(0), v = R(0);
        if (jl < PK) {
            u = loc_a[2 * (i64)jl];
            v = loc_a[2 * (i64)jl + 1];
        }
        unsigned todo = __ballot_sync(FULL, jl < PK && visible(u, v, boundary));
        while (todo) {
            const int src = __ffs(todo) - 1;
            todo &= todo - 1;
            const R uu = __shfl_sync(FULL, u, src), vv = __shfl_sync(FULL, v, src);
            const int j = j0 + src;
            const int k = j % K;
            // This warp's items (j, s): those with (j S + s) mod parts == part (parts is a
            // power of two).
            const int s_first = (part - j * S) & (parts - 1);
            for (int s = s_first; s < S; s += parts) {
                const Map m = load_map(maps, k * S + s);
                Cell<R> cell;
                if (!cell.setup(uu, vv, m.H, m.W) || !ln.active) continue;
                const R wt = ld(wts_a + ((i64)j * S + s) * G + ln.g);
                const F* base = feat + m.off + b * m.bstride;
                const i64 ps = channels_first ? 1 : C;
                const i64 cs = channels_first ? (i64)m.H * m.W : 1;
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    if (!cell.ok(i)) continue;
                    R val[V];
                    ldv<V>(base + cell.pix(i) * ps + ln.c * cs, val);
                    const R cw = wt * cell.weight(i);
#pragma unroll
                    for (int q = 0; q < V; ++q) acc[q] = fma(cw, val[q], acc[q]);
                }
            }
        }
    }
    if (parts > 1) {  // the same for the whole grid: every warp reaches the barrier
        const int w = threadIdx.x / 32;
#pragma unroll
        for (int q = 0; q < V; ++q) partial[w][lane][q] = acc[q];
        __syncthreads();
        if (part != 0) return;
        for (int p = 1; p < parts; ++p)  // in part order: the sum's order is fixed
#pragma unroll
            for (int q = 0; q < V; ++q) acc[q] += partial[w + p][lane][q];
    }
    if (live && ln.active) stv<V>(out + ba * C + ln.c, acc);
}

// ---------------------------------------------------------------------------------------------
// Backward: location and weight cotangents (plain stores), feature cotangent by atomics

template <typename F, typename Wt, typename R, int V>
__global__ void __launch_bounds__(THREADS, 1)
backward(const F* __restrict__ feat, const i64* __restrict__ maps, const R* __restrict__ loc,
         const Wt* __restrict__ wts, const R* __restrict__ gout, R* __restrict__ dfeat,
         R* __restrict__ dloc, R* __restrict__ dwt, i64 n_warps, int A, int P, int K, int S,
         int C, int G, int L, int GT, int steps, int tiles, int channels_first, int boundary,
         int need_feat, int need_loc, int need_wt) {
    const i64 warp = (i64)blockIdx.x * WARPS + threadIdx.x / 32;
    if (warp >= n_warps) return;
    const int lane = threadIdx.x % 32;
    const i64 bap = warp;            // (b, a, p)
    const i64 ba = bap / P;
    const i64 b = ba / A;
    const int CG = C / G;
    const int SG = S * G;
    const bool need_values = need_loc || need_wt;

    for (int k0 = 0; k0 < K; k0 += 32) {
        const int kl = k0 + lane;
        const i64 pkl = bap * K + kl;
        R u = R(0), v = R(0);
        if (kl < K) {
            u = loc[2 * pkl];
            v = loc[2 * pkl + 1];
        }
        const bool vis = kl < K && visible(u, v, boundary);
        if (need_loc && kl < K && !vis) {  // invisible cameras get zero cotangents
            dloc[2 * pkl] = R(0);
            dloc[2 * pkl + 1] = R(0);
        }
        const unsigned todo_all = __ballot_sync(FULL, vis);
        if (need_wt) {
            unsigned hidden = __ballot_sync(FULL, kl < K) & ~todo_all;
            while (hidden) {
                const int src = __ffs(hidden) - 1;
                hidden &= hidden - 1;
                R* row = dwt + (bap * K + k0 + src) * SG;
                for (int i = lane; i < SG; i += 32) row[i] = R(0);
            }
        }
        unsigned todo = todo_all;
        while (todo) {
            const int src = __ffs(todo) - 1;
            todo &= todo - 1;
            const R uu = __shfl_sync(FULL, u, src), vv = __shfl_sync(FULL, v, src);
            const int k = k0 + src;
            const i64 pk = bap * K + k;
            R du = R(0), dv = R(0);
            for (int s = 0; s < S; ++s) {
                const Map m = load_map(maps, k * S + s);
                Cell<R> cell;
                R* dwt_s = dwt + (pk * S + s) * G;
                if (!cell.setup(uu, vv, m.H, m.W)) {  // zeros boundary: this scale reads nothing
                    if (need_wt)
                        for (int i = lane; i < G; i += 32) dwt_s[i] = R(0);
                    continue;
                }
                const F* base = feat + m.off + b * m.bstride;
                R* dbase = dfeat + m.off + b * m.bstride;
                const i64 ps = channels_first ? 1 : C;
                const i64 cs = channels_first ? (i64)m.H * m.W : 1;
                R dus = R(0), dvs = R(0);
                for (int tile = 0; tile < tiles; ++tile) {
                    R pw = R(0);  // the lane's part of d wt[b,a,p,k,s,g]
                    int g = tile * GT + lane / L;
                    const bool gvalid = g < G;
                    const R wt = gvalid ? ld(wts + (pk * S + s) * G + g) : R(0);
                    for (int step = 0; step < steps; ++step) {
                        const Lanes ln(tile, step, L, GT, G, CG, V);
                        if (!ln.active) continue;
                        R go[V];
                        ldv<V>(gout + ba * C + ln.c, go);
                        if (need_values) {
                            R val[4][V];
#pragma unroll
                            for (int i = 0; i < 4; ++i) {
                                if (cell.ok(i)) {
                                    ldv<V>(base + cell.pix(i) * ps + ln.c * cs, val[i]);
                                } else {
#pragma unroll
                                    for (int q = 0; q < V; ++q) val[i][q] = R(0);
                                }
                            }
                            const R w00 = cell.weight(0), w01 = cell.weight(1);
                            const R w10 = cell.weight(2), w11 = cell.weight(3);
#pragma unroll
                            for (int q = 0; q < V; ++q) {
                                const R bil = w00 * val[0][q] + w01 * val[1][q] + w10 * val[2][q]
                                            + w11 * val[3][q];
                                pw += go[q] * bil;
                                const R tg = go[q] * wt;
                                dus += tg * (cell.hy * (val[1][q] - val[0][q]) + cell.ly * (val[3][q] - val[2][q]));
                                dvs += tg * (cell.hx * (val[2][q] - val[0][q]) + cell.lx * (val[3][q] - val[1][q]));
                            }
                        }
                        if (need_feat) {
#pragma unroll
                            for (int i = 0; i < 4; ++i) {
                                if (!cell.ok(i)) continue;
                                const R cw = wt * cell.weight(i);
                                R contrib[V];
#pragma unroll
                                for (int q = 0; q < V; ++q) contrib[q] = cw * go[q];
                                red_add<V>(dbase + cell.pix(i) * ps + ln.c * cs, contrib);
                            }
                        }
                    }
                    if (need_wt) {
                        for (int d = L / 2; d > 0; d >>= 1) pw += __shfl_xor_sync(FULL, pw, d);
                        if (gvalid && lane % L == 0) dwt_s[g] = pw;
                    }
                }
                du += R(m.W) * dus;  // dx/du = W, dy/dv = H
                dv += R(m.H) * dvs;
            }
            if (need_loc) {
                du = warp_sum(du);
                dv = warp_sum(dv);
                if (lane == 0) {
                    dloc[2 * pk] = du;
                    dloc[2 * pk + 1] = dv;
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Deterministic feature cotangent

// keys[4 n + i] = the feature row (b num_feat + map row) that corner i of entry
// n = ((((b A + a) P + p) K + k) S + s) reads, or -1. Flattened (channels-last) features only.
template <typename R, typename Key>
__global__ void __launch_bounds__(THREADS, 1)
entry_keys(const i64* __restrict__ maps, const R* __restrict__ loc, Key* __restrict__ keys,
           i64 n_entries, int A, int P, int K, int S, int C, i64 num_feat, int boundary) {
    const i64 n = (i64)blockIdx.x * THREADS + threadIdx.x;
    if (n >= n_entries) return;
    const i64 pk = n / S;
    const int s = (int)(n - pk * S);
    const int k = (int)(pk % K);
    const i64 b = pk / ((i64)K * P * A);
    const R u = loc[2 * pk], v = loc[2 * pk + 1];
    Key out[4] = {Key(-1), Key(-1), Key(-1), Key(-1)};
    if (visible(u, v, boundary)) {
        const Map m = load_map(maps, k * S + s);
        Cell<R> cell;
        if (cell.setup(u, v, m.H, m.W)) {
            const i64 row0 = b * num_feat + m.off / C;
#pragma unroll
            for (int i = 0; i < 4; ++i)
                if (cell.ok(i)) out[i] = (Key)(row0 + cell.pix(i));
        }
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) keys[4 * n + i] = out[i];
}

// One warp per (feature row, tile, step): the sum over the row's entries ent[seg[row]] ..
// ent[seg[row + 1] - 1] (sorted by row, stable, so the order is fixed) of
// wt[entry, g] * corner weight * gout[b, a, c], stored once. Lanes first prepare 32 entries at
// a time (their decoding and corner weight), then the warp consumes them one by one.
template <typename Wt, typename R, int V>
__global__ void __launch_bounds__(THREADS, 1)
feature_rows(const i64* __restrict__ maps, const R* __restrict__ loc, const Wt* __restrict__ wts,
             const R* __restrict__ gout, const i64* __restrict__ ent, const i64* __restrict__ seg,
             R* __restrict__ dfeat, i64 n_warps, int A, int P, int K, int S, int C, int G, int L,
             int GT, int steps, int per_row) {
    const i64 warp = (i64)blockIdx.x * WARPS + threadIdx.x / 32;
    if (warp >= n_warps) return;
    const int lane = threadIdx.x % 32;
    const i64 row = warp / per_row;
    const int r = (int)(warp - row * per_row);
    const int CG = C / G;
    const Lanes ln(r / steps, r % steps, L, GT, G, CG, V);

    R acc[V];
#pragma unroll
    for (int j = 0; j < V; ++j) acc[j] = R(0);
    const i64 e0 = seg[row], e1 = seg[row + 1];
    for (i64 eb = e0; eb < e1; eb += 32) {
        const i64 e = eb + lane;
        i64 n = 0, ba = 0;
        R cw = R(0);
        if (e < e1) {
            const i64 id = ent[e];
            n = id >> 2;
            const int corner = (int)(id & 3);
            const i64 pk = n / S;
            const int s = (int)(n - pk * S);
            const int k = (int)(pk % K);
            ba = pk / ((i64)K * P);
            const Map m = load_map(maps, k * S + s);
            Cell<R> cell;
            cell.setup(loc[2 * pk], loc[2 * pk + 1], m.H, m.W);  // true: the entry has a key
            cw = cell.weight(corner);
        }
        const int count = (int)min((i64)32, e1 - eb);
        for (int i = 0; i < count; ++i) {
            const i64 ni = __shfl_sync(FULL, n, i);
            const i64 bai = __shfl_sync(FULL, ba, i);
            const R cwi = __shfl_sync(FULL, cw, i);
            if (!ln.active) continue;
            const R c = ld(wts + ni * G + ln.g) * cwi;  // the atomic path's wt * corner weight
            R go[V];
            ldv<V>(gout + bai * C + ln.c, go);
#pragma unroll
            for (int q = 0; q < V; ++q) acc[q] = fma(c, go[q], acc[q]);
        }
    }
    if (ln.active) stv<V>(dfeat + row * C + ln.c, acc);
}

}  // namespace deform
}  // namespace cutopo
