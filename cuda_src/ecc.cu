// Exact Euler characteristic curves of 2D/3D images (cubical complexes, V and T constructions).
//
// Every cell of the complex is owned by one pixel: its latest vertex (V construction) or its
// earliest adjacent pixel (T construction) in the strict order (key, linear index). A pixel's
// contribution c(p) = sum over its cells of (-1)^dim, and the ECC is the cumulative histogram of
// c over the pixels' filtration keys. For the histogram the key is the pixel's threshold bin
// (the sublevel set at t_k is exactly {bin <= k}), so ownership is decided on small integers,
// whatever the image dtype; the contribution map uses an order-preserving key of the value.
//
// Tiling: a block sweeps 32 x 32 (y, x) tiles of keys kept in shared memory with a one-pixel
// halo; in 3D it marches a tile through a run of z planes with a ring of three planes, so each
// voxel is read from global memory once (plus the halo). Keys live only in shared memory: no
// intermediate array the size of the input.
#include "common.cuh"

namespace cutopo {
namespace ecc {

constexpr int TX = 32;            // tile width: one warp per tile row
constexpr int WARPS = 8;          // warps per block
constexpr int PY = 4;             // tile rows per thread
constexpr int TY = WARPS * PY;    // tile height
constexpr int LX = TX + 2;        // tile plus halo
constexpr int LY = TY + 2;
constexpr int PLANE = LX * LY;
constexpr int THREADS = TX * WARPS;

__host__ __device__ constexpr int pow3(int d) { return d == 0 ? 1 : 3 * pow3(d - 1); }

// Neighbour offsets o in {-1,0,1}^NDIM are numbered j = sum_a (o_a + 1) 3^(NDIM-1-a); axis 0 is
// the slowest (C order), so j = (N-1)/2 is the centre.
template <int NDIM>
__device__ constexpr int digit(int j, int axis) {
    return (j / pow3(NDIM - 1 - axis)) % 3 - 1;
}

// q = p + o precedes p in C order exactly when o's first non-zero component is negative.
template <int NDIM>
__device__ constexpr bool earlier(int j) {
    for (int a = 0; a < NDIM; ++a) {
        const int d = digit<NDIM>(j, a);
        if (d != 0) return d < 0;
    }
    return false;
}

// Bits of the non-zero offsets o' with o'_a in {0, o_a}: the other vertices of the cell spanned
// by p and p + o (V), or the other pixels that share the face of p towards o (T).
template <int NDIM>
__device__ constexpr unsigned sub_offsets(int j) {
    unsigned m = 0;
    for (int i = 0; i < pow3(NDIM); ++i) {
        if (i == (pow3(NDIM) - 1) / 2) continue;
        bool inside = true;
        for (int a = 0; a < NDIM; ++a) {
            const int di = digit<NDIM>(i, a);
            if (di != 0 && di != digit<NDIM>(j, a)) inside = false;
        }
        if (inside) m |= 1u << i;
    }
    return m;
}

// (-1)^dim of the cell that offset j stands for: dim = |o| in V, NDIM - |o| in T.
template <int NDIM, bool TCONN>
__device__ constexpr int cell_sign(int j) {
    int k = 0;
    for (int a = 0; a < NDIM; ++a) k += digit<NDIM>(j, a) != 0;
    const int dim = TCONN ? NDIM - k : k;
    return (dim & 1) ? -1 : 1;
}

// c(p) from the keys of p's 3^NDIM neighbourhood (centre included). Outside pixels carry the
// all-ones key, later than every pixel, so they never precede p.
template <int NDIM, bool TCONN, typename K>
__device__ __forceinline__ int contribution(const K (&nb)[pow3(NDIM)]) {
    constexpr int N = pow3(NDIM);
    constexpr int C = (N - 1) / 2;
    const K kp = nb[C];
    unsigned lower = 0;  // bit j: neighbour j precedes p
#pragma unroll
    for (int j = 0; j < N; ++j) {
        if (j == C) continue;
        const bool l = earlier<NDIM>(j) ? (nb[j] <= kp) : (nb[j] < kp);
        lower |= (unsigned)l << j;
    }
    // V: p owns a cell when every other vertex precedes it.
    // T: p owns a face when it precedes every other pixel that shares the face.
    const unsigned owner_test = TCONN ? ~lower : lower;
    int c = 0;
#pragma unroll
    for (int j = 0; j < N; ++j) {
        const unsigned s = sub_offsets<NDIM>(j);
        if ((owner_test & s) == s) c += cell_sign<NDIM, TCONN>(j);
    }
    return c;
}

// Sweep the tiles [first, first + step, ...) of one image. KeyOf(i) gives the key of element i;
// Sink(c, key, i) consumes the contribution of element i.
template <int NDIM, bool TCONN, typename K, class KeyOf, class Sink>
__device__ __forceinline__ void sweep(K (*tile)[PLANE], i64 nz, i64 ny, i64 nx, int zchunk,
                                      i64 image_base, i64 first, i64 step, const KeyOf& key_of,
                                      Sink& sink) {
    constexpr int NP = NDIM == 3 ? 3 : 1;
    const int tx = threadIdx.x % TX;
    const int row0 = (threadIdx.x / TX) * PY + 1;  // first tile row of this thread, halo coords
    const i64 ntx = (nx + TX - 1) / TX;
    const i64 nty = (ny + TY - 1) / TY;
    const i64 ntz = NDIM == 3 ? (nz + zchunk - 1) / zchunk : 1;
    const i64 ntiles = ntx * nty * ntz;

    for (i64 t = first; t < ntiles; t += step) {
        const i64 x0 = (t % ntx) * TX;
        const i64 y0 = ((t / ntx) % nty) * TY;
        const i64 z0 = NDIM == 3 ? (t / (ntx * nty)) * zchunk : 0;
        const i64 z1 = NDIM == 3 ? min(z0 + (i64)zchunk, nz) : 1;

        auto load_plane = [&](i64 z, K* dst) {
            for (int i = threadIdx.x; i < PLANE; i += THREADS) {
                const int ly = i / LX;
                const int lx = i - ly * LX;
                const i64 gy = y0 + ly - 1;
                const i64 gx = x0 + lx - 1;
                K key = all_ones<K>();
                if (z >= 0 && z < nz && gy >= 0 && gy < ny && gx >= 0 && gx < nx)
                    key = key_of(image_base + (z * ny + gy) * nx + gx);
                dst[i] = key;
            }
        };

        if (NDIM == 3) {
            load_plane(z0 - 1, tile[0]);
            load_plane(z0, tile[1]);
        }
        for (i64 z = z0; z < z1; ++z) {
            // Planes z-1, z, z+1 sit in ring slots (z-z0), (z-z0+1), (z-z0+2) mod 3.
            const int s = (int)((z - z0) % 3);
            const K* planes[NP];
            if (NDIM == 3) {
                load_plane(z + 1, tile[(s + 2) % 3]);
                planes[0] = tile[s];
                planes[NP - 2] = tile[(s + 1) % 3];
                planes[NP - 1] = tile[(s + 2) % 3];
            } else {
                load_plane(0, tile[0]);
                planes[0] = tile[0];
            }
            __syncthreads();

            // Window of 3 rows x 3 columns per plane, slid down the thread's PY rows.
            K win[NP][3][3];
#pragma unroll
            for (int p = 0; p < NP; ++p)
#pragma unroll
                for (int r = 0; r < 2; ++r)
#pragma unroll
                    for (int q = 0; q < 3; ++q) win[p][r + 1][q] = planes[p][(row0 - 1 + r) * LX + tx + q];
#pragma unroll
            for (int j = 0; j < PY; ++j) {
#pragma unroll
                for (int p = 0; p < NP; ++p)
#pragma unroll
                    for (int q = 0; q < 3; ++q) {
                        win[p][0][q] = win[p][1][q];
                        win[p][1][q] = win[p][2][q];
                        win[p][2][q] = planes[p][(row0 + j + 1) * LX + tx + q];
                    }
                K nb[pow3(NDIM)];
#pragma unroll
                for (int p = 0; p < NP; ++p)
#pragma unroll
                    for (int r = 0; r < 3; ++r)
#pragma unroll
                        for (int q = 0; q < 3; ++q) nb[(p * 3 + r) * 3 + q] = win[p][r][q];
                const i64 gy = y0 + row0 + j - 1;
                const i64 gx = x0 + tx;
                if (gy < ny && gx < nx)
                    sink(contribution<NDIM, TCONN>(nb), nb[(pow3(NDIM) - 1) / 2],
                         image_base + (z * ny + gy) * nx + gx);
            }
            __syncthreads();  // the next step overwrites plane z-1
        }
    }
}

// Threshold bin of a value: the first k with v <= t_k (T when there is none, NaN included).
template <typename Cmp>
__device__ __forceinline__ int threshold_bin(Cmp v, const Cmp* tab, int T, int estimate, double t0,
                                             double inv_dt) {
    if (!(v <= tab[T - 1])) return T;
    if (v <= tab[0]) return 0;
    // Now t_0 < v <= t_{T-1}: the answer k lies in [1, T-1].
    int k;
    if (estimate) {  // evenly spaced thresholds: O(1) guess, corrected by exact comparisons
        double e = ceil(((double)v - t0) * inv_dt);
        e = fmin(fmax(e, 1.0), (double)(T - 1));
        k = (int)e;
        while (!(v <= tab[k])) ++k;
        while (v <= tab[k - 1]) --k;
    } else {  // binary search with v <= t_hi and not v <= t_lo
        int lo = 0, hi = T - 1;
        while (hi - lo > 1) {
            const int mid = (lo + hi) >> 1;
            if (v <= tab[mid]) hi = mid; else lo = mid;
        }
        k = hi;
    }
    return k;
}

template <typename In, typename Cmp, typename K>
struct BinKey {
    const In* image;
    const Cmp* tab;
    int T, estimate;
    double t0, inv_dt;
    __device__ __forceinline__ K operator()(i64 i) const {
        return (K)threshold_bin<Cmp>(convert<Cmp>(image[i]), tab, T, estimate, t0, inv_dt);
    }
};

// Adds contributions to the block's shared histogram (or straight to the global one when the
// bins do not fit), merging runs of equal bins within a thread first.
struct HistSink {
    int* shared;        // nullptr: no shared histogram
    long long* global;  // this image's row of the global histogram
    int T;
    int run_key = -1, run_sum = 0;
    __device__ __forceinline__ void add(int key, int v) {
        if (shared) atomicAdd(shared + key, v);
        else atomicAdd(reinterpret_cast<u64*>(global + key), (u64)(i64)v);
    }
    __device__ __forceinline__ void operator()(int c, unsigned key, i64) {
        if (c == 0 || (int)key >= T) return;
        if ((int)key == run_key) { run_sum += c; return; }
        if (run_sum != 0) add(run_key, run_sum);
        run_key = (int)key;
        run_sum = c;
    }
    __device__ __forceinline__ void flush() {
        if (run_sum != 0) add(run_key, run_sum);
        run_sum = 0;
    }
};

// hist (rows, T) must be zeroed; each block adds the contributions of its tiles of one image.
template <typename In, typename Cmp, typename K, int NDIM, bool TCONN>
__global__ void __launch_bounds__(THREADS)
ecc_histogram(const In* __restrict__ image, const Cmp* __restrict__ thresholds,
              long long* __restrict__ hist, i64 nz, i64 ny, i64 nx, int zchunk, int blocks_per_image,
              int T, int estimate, double t0, double inv_dt, int table_in_smem, int hist_in_smem) {
    __shared__ K tile[NDIM == 3 ? 3 : 1][PLANE];
    extern __shared__ __align__(16) unsigned char dynamic_smem[];

    const Cmp* tab = thresholds;
    int* hist_s = nullptr;
    size_t offset = 0;
    if (table_in_smem) {
        Cmp* t = reinterpret_cast<Cmp*>(dynamic_smem);
        for (int i = threadIdx.x; i < T; i += THREADS) t[i] = thresholds[i];
        tab = t;
        offset = ((size_t)T * sizeof(Cmp) + 15) & ~(size_t)15;
    }
    if (hist_in_smem) {
        hist_s = reinterpret_cast<int*>(dynamic_smem + offset);
        for (int i = threadIdx.x; i < T; i += THREADS) hist_s[i] = 0;
    }
    __syncthreads();

    const i64 img = blockIdx.x / blocks_per_image;
    const int chunk = blockIdx.x % blocks_per_image;
    BinKey<In, Cmp, K> key_of{image, tab, T, estimate, t0, inv_dt};
    HistSink sink{hist_s, hist + img * T, T};
    sweep<NDIM, TCONN, K>(tile, nz, ny, nx, zchunk, img * nz * ny * nx, chunk, blocks_per_image,
                          key_of, sink);
    sink.flush();

    if (hist_in_smem) {
        __syncthreads();
        long long* row = hist + img * T;
        for (int k = threadIdx.x; k < T; k += THREADS) {
            const int h = hist_s[k];
            if (h != 0) atomicAdd(reinterpret_cast<u64*>(row + k), (u64)(i64)h);
        }
    }
}

// In-place inclusive prefix sum of each row of hist (rows, T); one warp per row.
__global__ void __launch_bounds__(THREADS) ecc_cumsum(long long* __restrict__ hist, i64 rows, int T) {
    constexpr int PER = 8;  // consecutive elements per lane
    const int lane = threadIdx.x % 32;
    const i64 row = (i64)blockIdx.x * WARPS + threadIdx.x / 32;
    if (row >= rows) return;  // whole warps leave together: no block barrier below
    long long* h = hist + row * T;
    long long carry = 0;
    for (int base = 0; base < T; base += 32 * PER) {
        long long v[PER];
#pragma unroll
        for (int i = 0; i < PER; ++i) {
            const int k = base + lane * PER + i;
            v[i] = k < T ? h[k] : 0;
        }
#pragma unroll
        for (int i = 1; i < PER; ++i) v[i] += v[i - 1];
        long long incl = v[PER - 1];
#pragma unroll
        for (int d = 1; d < 32; d <<= 1) {
            const long long n = __shfl_up_sync(0xffffffffu, incl, d);
            if (lane >= d) incl += n;
        }
        const long long before = incl - v[PER - 1] + carry;
#pragma unroll
        for (int i = 0; i < PER; ++i) {
            const int k = base + lane * PER + i;
            if (k < T) h[k] = v[i] + before;
        }
        carry += __shfl_sync(0xffffffffu, incl, 31);
    }
}

template <typename In, typename K>
struct ValueKey {
    const In* image;
    __device__ __forceinline__ K operator()(i64 i) const { return (K)order_key(image[i]); }
};

struct MapSink {
    signed char* out;
    __device__ __forceinline__ void operator()(int c, u64, i64 i) { out[i] = (signed char)c; }
};

// The int8 contribution map c(p) under the order (value, linear index), NaN as +inf.
template <typename In, typename K, int NDIM, bool TCONN>
__global__ void __launch_bounds__(THREADS)
ecc_contributions(const In* __restrict__ image, signed char* __restrict__ out, i64 nz, i64 ny,
                  i64 nx, int zchunk, int blocks_per_image) {
    __shared__ K tile[NDIM == 3 ? 3 : 1][PLANE];
    const i64 img = blockIdx.x / blocks_per_image;
    const int chunk = blockIdx.x % blocks_per_image;
    ValueKey<In, K> key_of{image};
    MapSink sink{out};
    sweep<NDIM, TCONN, K>(tile, nz, ny, nx, zchunk, img * nz * ny * nx, chunk, blocks_per_image,
                          key_of, sink);
}

}  // namespace ecc
}  // namespace cutopo
