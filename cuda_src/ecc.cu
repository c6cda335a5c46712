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

// Bits of the lowest corners of the cells spanned by p and p + o for the offsets o whose
// non-zero components are on the axes of ``axes`` (bit a: axis a): o'_a in {-1, 0} on those
// axes, 0 on the others. The cell of o is the 2^k block of the 3^NDIM neighbourhood whose
// lowest corner is p + min(o, 0).
template <int NDIM>
__device__ constexpr unsigned cell_corners(unsigned axes) {
    unsigned m = 0;
    for (int j = 0; j < pow3(NDIM); ++j) {
        bool corner = true;
        for (int a = 0; a < NDIM; ++a) {
            const int d = digit<NDIM>(j, a);
            if (((axes >> a) & 1u) ? d > 0 : d != 0) corner = false;
        }
        if (corner) m |= 1u << j;
    }
    return m;
}

// Bits of the 2 NDIM face neighbours (offsets with one non-zero component).
template <int NDIM>
__device__ constexpr unsigned face_neighbours() {
    unsigned m = 0;
    for (int j = 0; j < pow3(NDIM); ++j) {
        int k = 0;
        for (int a = 0; a < NDIM; ++a) k += digit<NDIM>(j, a) != 0;
        if (k == 1) m |= 1u << j;
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

// Bit J of the result: neighbour J precedes the centre (key, then C-order index; ``flips``
// marks the neighbours whose index order is reversed, those across the torus' wrap, 0 in the
// box). Template recursion with constexpr locals, so every table entry is a compile-time
// constant: left to the optimiser, the 3D tables were partly evaluated at run time (thousands
// of instructions).
template <int NDIM, int J = 0, typename K>
__device__ __forceinline__ unsigned precedence_bits(const K (&nb)[pow3(NDIM)], K kp, unsigned flips) {
    constexpr int N = pow3(NDIM);
    if constexpr (J == N) {
        return 0u;
    } else if constexpr (J == (N - 1) / 2) {
        return precedence_bits<NDIM, J + 1>(nb, kp, flips);
    } else {
        const bool before = earlier<NDIM>(J) != (((flips >> J) & 1u) != 0);
        const bool l = before ? (nb[J] <= kp) : (nb[J] < kp);
        return ((unsigned)l << J) | precedence_bits<NDIM, J + 1>(nb, kp, flips);
    }
}

// Sum of (-1)^dim over the cells the centre owns, given its owner-test bits (V: the
// neighbours that precede p, T: those p precedes): a cell is owned when all its vertices' bits
// are set, the centre's taken as set. Bit j of ``x`` (``y``) says that bits j and j + 1
// (j + 3) are set: j and its neighbour one step up the last axis (the one before); ANDs of
// shifted copies extend that to the squares' and cubes' 2^k blocks, read at their lowest
// corners (cell_corners: the block of a cell through p lies inside the neighbourhood, so no
// bit read wraps a row). ~25 instructions in 3D; the cell-by-cell test (26 masks, compare,
// select) compiled to ~105 (sm_90, the soft ECC's 3D forward).
template <int NDIM, bool TCONN>
__device__ __forceinline__ int owned_cells(unsigned owner_test) {
    constexpr int CENTRE = (pow3(NDIM) - 1) / 2;
    const unsigned b = owner_test | (1u << CENTRE);
    const unsigned x = b & (b >> 1);  // the last axis has stride 1, the one before 3, then 9
    const unsigned xy = x & (x >> 3);
    int n = 1 - __popc(b & face_neighbours<NDIM>());
    if constexpr (NDIM == 2) {
        n += __popc(xy & cell_corners<2>(3u));
    } else {
        const unsigned y = b & (b >> 3);
        n += __popc(xy & cell_corners<3>(6u)) + __popc((x & (x >> 9)) & cell_corners<3>(5u))
             + __popc((y & (y >> 9)) & cell_corners<3>(3u)) - __popc((xy & (xy >> 9)) & cell_corners<3>(7u));
    }
    // T: dim = NDIM - |o| instead of |o|, so every sign times (-1)^NDIM
    return (TCONN && (NDIM & 1)) ? -n : n;
}

// Bits of the earlier (in C order) neighbours: those that precede p on a tie.
template <int NDIM>
__device__ constexpr unsigned earlier_neighbours() {
    unsigned m = 0;
    for (int j = 0; j < pow3(NDIM); ++j) m |= earlier<NDIM>(j) ? 1u << j : 0u;
    return m;
}

// precedence_bits' complement for 32-bit keys in the box (no flips), bit J for J != centre:
// neighbour J does not precede the centre. Two instructions a neighbour and no predicate: the
// carry out of nb[J] + c shifted into the result (shift_in_carry), with c = ~kp for the
// earlier neighbours (carry: nb > kp) and c = -kp for the later ones (carry: nb >= kp; wrong
// only at kp = 0, where nothing is below kp: fixed after). The predicated compare-and-select
// of precedence_bits took ~2.7 instructions a neighbour, the 26 comparisons of a 3D voxel ~69
// (sm_90; 53 so, the 3D soft forward 7 % faster on the H100). J runs down, so the first
// neighbour ends at bit N-1.
template <int NDIM, int J = pow3(NDIM) - 1>
__device__ __forceinline__ unsigned later_bits32(const unsigned (&nb)[pow3(NDIM)], unsigned not_kp,
                                                 unsigned neg_kp, unsigned acc = 0u) {
    if constexpr (J < 0) {
        return acc;
    } else {
        if constexpr (J == (pow3(NDIM) - 1) / 2) {
            acc += acc;
        } else {
            const unsigned c = earlier<NDIM>(J) ? not_kp : neg_kp;
            acc = shift_in_carry(acc, nb[J], c);
        }
        return later_bits32<NDIM, J - 1>(nb, not_kp, neg_kp, acc);
    }
}

// c(p) from the keys of p's 3^NDIM neighbourhood (centre included) on the torus: ``flips`` as
// for precedence_bits. Outside pixels carry the all-ones key, later than every pixel, so they
// never precede p.
template <int NDIM, bool TCONN, typename K>
__device__ __forceinline__ int contribution(const K (&nb)[pow3(NDIM)], unsigned flips) {
    const unsigned lower = precedence_bits<NDIM>(nb, nb[(pow3(NDIM) - 1) / 2], flips);
    // V: p owns a cell when every other vertex precedes it.
    // T: p owns a face when it precedes every other pixel that shares the face.
    return owned_cells<NDIM, TCONN>(TCONN ? ~lower : lower);
}

// c(p) in the box (no flips).
template <int NDIM, bool TCONN, typename K>
__device__ __forceinline__ int contribution(const K (&nb)[pow3(NDIM)]) {
    if constexpr (sizeof(K) == 4) {
        const unsigned kp = nb[(pow3(NDIM) - 1) / 2];
        unsigned later = later_bits32<NDIM>(nb, ~kp, 0u - kp);
        if (kp == 0u) later |= ~earlier_neighbours<NDIM>();  // nothing is below key 0
        return owned_cells<NDIM, TCONN>(TCONN ? later : ~later);
    } else {
        return contribution<NDIM, TCONN>(nb, 0u);
    }
}

// The torus complex (boundary="periodic"). The neighbour q = p + o of p comes before p in the
// torus' C order as in the box, except where q wraps around o's first non-zero axis a: at
// p_a = 0 with o_a < 0 (q is the last plane) and at p_a = n_a - 1 with o_a > 0 (q is the first).
// Bits of the offsets whose first non-zero component lies on ``axis`` and has sign ``sign``:
template <int NDIM>
__device__ constexpr unsigned first_axis_offsets(int axis, int sign) {
    unsigned m = 0;
    for (int j = 0; j < pow3(NDIM); ++j) {
        for (int a = 0; a < NDIM; ++a) {
            const int d = digit<NDIM>(j, a);
            if (d != 0) {
                if (a == axis && d == sign) m |= 1u << j;
                break;
            }
        }
    }
    return m;
}

// Bits of the neighbours of pixel p (coordinates p, axis lengths n) whose tie-break flips.
template <int NDIM, int A = 0>
__device__ __forceinline__ unsigned torus_flips(const i64 (&p)[NDIM], const i64 (&n)[NDIM]) {
    if constexpr (A == NDIM) {
        return 0u;
    } else {
        constexpr unsigned below = first_axis_offsets<NDIM>(A, -1);
        constexpr unsigned above = first_axis_offsets<NDIM>(A, 1);
        return (p[A] == 0 ? below : 0u) | (p[A] == n[A] - 1 ? above : 0u) | torus_flips<NDIM, A + 1>(p, n);
    }
}

// How a sweep reads positions past the image: the box reads the outside key there, the torus
// (PERIODIC) the pixel at the other end of the axis (a halo position is one past either end;
// positions further out are tile overhang, neighbours of no counted pixel, and stay outside).
template <bool P> struct Boundary { static constexpr bool PERIODIC = P; };
__device__ __forceinline__ i64 wrap_index(i64 g, i64 n) { return g == -1 ? n - 1 : (g == n ? 0 : g); }

// Which pixels of the swept image hand their contribution to the sink. The whole-image kernels
// count every pixel; a block of a larger volume (an out-of-core slab, a Dask chunk) is swept
// with its one-pixel halo, whose pixels are read as neighbours but counted by another block.
struct AllPixels {
    static constexpr bool SPARE_REGISTERS = true;  // for ThresholdBins' hold_round, BinKey's bytes_are_bins
    __device__ __forceinline__ bool operator()(i64, i64, i64) const { return true; }
};
// Pixel (z, y, x) counts when its byte is non-zero in each of three per-axis masks (lengths nz,
// ny, nx; in 2D z is 0 and the z mask has one byte). Coordinates past ny or nx (the tile
// overhang) never count, so the masks need no padding.
struct MaskedPixels {
    static constexpr bool SPARE_REGISTERS = false;
    const unsigned char* z;
    const unsigned char* y;
    const unsigned char* x;
    i64 ny, nx;
    __device__ __forceinline__ bool operator()(i64 gz, i64 gy, i64 gx) const {
        return (u64)gy < (u64)ny && (u64)gx < (u64)nx && (__ldg(z + gz) & __ldg(y + gy) & __ldg(x + gx)) != 0;
    }
};

// What the sweep runs in every thread of the block (points where every warp is converged)
// after each plane's rows, and at the start of each plane step (after the barrier that ends
// the step before, before the next barrier: no thread is in any other part of the step):
// nothing, or the soft ECC's band work on the pixels its sink queued (ecc_soft.cuh). After
// the step's planes are loaded (past their barrier) the scalar sweep of a hook whose STOPS
// holds returns where stopped() does, which must then hold in every thread of the block (the
// listing forward's full list).
struct NoRowsHook {
    static constexpr bool STOPS = false;
    template <typename... Args>
    __device__ __forceinline__ void rows_done(Args...) const {}
    __device__ __forceinline__ void step_begin() const {}
};

// The tiles first, first + step, ... of an ntx x nty x ntz grid (x fastest) that a block
// sweeps. 3D: the tile number, its coordinates divided out per tile (64-bit divisions,
// amortized over the tile's planes).
template <int NDIM>
struct TileWalk {
    i64 ntx, nty, ntiles, t, step;
    __device__ __forceinline__ TileWalk(i64 ntx_, i64 nty_, i64 ntz, i64 first, i64 step_)
        : ntx(ntx_), nty(nty_), ntiles(ntx_ * nty_ * ntz), t(first), step(step_) {}
    __device__ __forceinline__ bool valid() const { return t < ntiles; }
    __device__ __forceinline__ void next() { t += step; }
    __device__ __forceinline__ i64 x() const { return t % ntx; }
    __device__ __forceinline__ i64 y() const { return (t / ntx) % nty; }
    __device__ __forceinline__ i64 z() const { return t / (ntx * nty); }
};

// 2D: a tile is one plane, so the divisions (on their 32-bit fast path ~25 instructions each,
// issued by every warp for every tile: ~10 % of a 2D float32 tile's instructions by the SASS)
// are made once per block: the tile's column and row advance by the step's with a carry. (In
// 3D, where they are amortized, the same walk made the register-capped kernels spill.)
template <>
struct TileWalk<2> {
    i64 ntx, nty;
    i64 tx, ty;  // the current tile
    i64 sx, sy;  // the step
    __device__ __forceinline__ TileWalk(i64 ntx_, i64 nty_, i64, i64 first, i64 step)
        : ntx(ntx_), nty(nty_), tx(first % ntx_), ty(first / ntx_), sx(step % ntx_), sy(step / ntx_) {}
    __device__ __forceinline__ bool valid() const { return ty < nty; }
    __device__ __forceinline__ void next() {
        tx += sx;
        const bool carry = tx >= ntx;  // tx + sx < 2 ntx
        if (carry) tx -= ntx;
        ty += sy + carry;
    }
    __device__ __forceinline__ i64 x() const { return tx; }
    __device__ __forceinline__ i64 y() const { return ty; }
    __device__ __forceinline__ i64 z() const { return 0; }
};

// The tile slot (row ly, column lx, halo included) of a plane load's i-th key: the 32 tile
// columns row by row (lane = column, no division), then the two halo columns of every row.
__device__ __forceinline__ void plane_slot(int i, int& ly, int& lx) {
    const unsigned u = (unsigned)i;  // i >= 0: a shift and a mask, not signed division
    if (u < LY * TX) {
        ly = (int)(u / TX);
        lx = (int)(u % TX) + 1;
    } else {
        ly = (int)((u - LY * TX) >> 1);
        lx = (u & 1u) ? LX - 1 : 0;
    }
}

// The slots of planes z-1, z, z+1 in a 3D sweep's ring of three shared planes, `step` = z - z0
// plane steps after the tile's first (z0-1 in slot 0, z0 in slot 1): step, step + 1, step + 2
// mod 3, taken in 32 bits (in 64 bits ~20 instructions a plane step and warp, by Nsight
// Compute of the packed sweep).
struct RingSlots {
    unsigned below, at, above;
    __device__ __forceinline__ explicit RingSlots(i64 step)
        : below((unsigned)step % 3u), at(below == 2 ? 0 : below + 1), above(below == 0 ? 2 : below - 1) {}
};

// Sweep the tiles [first, first + step, ...) of one image. KeyOf(i) gives the key of element i;
// Sink(c, key, i) consumes the contribution of element i when Region(z, y, x) holds for it
// (each thread at most PY times per plane, once per row it owns); every thread calls
// after.step_begin() at the start of every plane step and after.rows_done() after its rows,
// and returns where after.stopped() (with After::STOPS; NoRowsHook). NARROW: read the planes
// with 32-bit offsets where they allow it, by 16-byte reads where the rows are aligned (KeyOf
// is then a Reads16 key with key_in; below).
template <int NDIM, bool TCONN, typename K, bool NARROW = false, class KeyOf, class Sink,
          class Region = AllPixels, class Edges = Boundary<false>, class After = NoRowsHook>
__device__ __forceinline__ void sweep(K (*tile)[PLANE], i64 nz, i64 ny, i64 nx, int zchunk,
                                      i64 image_base, i64 first, i64 step, const KeyOf& key_of,
                                      const Sink& sink, const Region& counts = Region(),
                                      const Edges& = Edges(), const After& after = After()) {
    constexpr int NP = NDIM == 3 ? 3 : 1;
    const int tx = threadIdx.x % TX;
    const int row0 = (threadIdx.x / TX) * PY + 1;  // first tile row of this thread, halo coords
    const i64 ntx = (nx + TX - 1) / TX;
    const i64 nty = (ny + TY - 1) / TY;
    const i64 ntz = NDIM == 3 ? (nz + zchunk - 1) / zchunk : 1;

    for (TileWalk<NDIM> w(ntx, nty, ntz, first, step); w.valid(); w.next()) {
        const i64 x0 = w.x() * TX;
        const i64 y0 = w.y() * TY;
        const i64 z0 = NDIM == 3 ? w.z() * zchunk : 0;
        const i64 z1 = NDIM == 3 ? min(z0 + (i64)zchunk, nz) : 1;

        // Keys of plane z into dst, in plane_slot's order.
        auto load_plane = [&](i64 z, K* dst) {
            if constexpr (Edges::PERIODIC) z = wrap_index(z, nz);
            const bool plane_inside = z >= 0 && z < nz;
            const i64 plane_base = image_base + z * ny * nx;
            if constexpr (NARROW && !Edges::PERIODIC) {
                // A plane of under 2^31 - 256 elements (every image but the largest planes; the
                // margin keeps a halo column's x in int range): 32-bit offsets and one unsigned
                // test per axis, where the 64-bit ones below take ~50 instructions per key. The
                // 3D soft forward ran 1-4 % faster so (benchmarks/RESULTS.md, thirty-fifth
                // session); in the soft backward sweeps ptxas spilled ~60 B more, not timed.
                if (ny * nx < (i64)0x7fffff00) {
                    const int nyi = (int)ny, nxi = (int)nx;
                    const int gy0 = (int)y0 - 1, gx0 = (int)x0 - 1;
                    int first = 0;  // plane_slot's first key still to load
                    if (key_of.vector_rows(nx)) {
                        // The tile's rows by 16-byte reads (KeyOf is a Reads16 key): one address
                        // and bounds test per VEC keys, where plane_slot's loop takes ~40
                        // instructions per key (sm_90 SASS); the halo columns below.
                        constexpr int VEC = KeyOf::VEC;
                        constexpr int PER_ROW = TX / VEC;
                        for (int r = threadIdx.x; r < LY * PER_ROW; r += THREADS) {
                            const unsigned ly = (unsigned)r / PER_ROW, v = (unsigned)r % PER_ROW;
                            const int gy = gy0 + (int)ly, gx = (int)x0 + (int)v * VEC;
                            K* row = dst + ly * LX + 1 + v * VEC;
                            if (plane_inside && (unsigned)gy < (unsigned)nyi && gx < nxi) {
                                const uint4 raw = key_of.load16(plane_base + (gy * nxi + gx));
#pragma unroll
                                for (int k = 0; k < VEC; ++k) row[k] = key_of.key_in(raw, k);
                            } else {
#pragma unroll
                                for (int k = 0; k < VEC; ++k) row[k] = all_ones<K>();
                            }
                        }
                        first = LY * TX;
                    }
                    for (int i = first + threadIdx.x; i < LY * TX + 2 * LY; i += THREADS) {
                        int ly, lx;
                        plane_slot(i, ly, lx);
                        const int gy = gy0 + ly, gx = gx0 + lx;
                        K key = all_ones<K>();
                        if (plane_inside && (unsigned)gy < (unsigned)nyi && (unsigned)gx < (unsigned)nxi)
                            key = key_of(plane_base + (gy * nxi + gx));
                        dst[ly * LX + lx] = key;
                    }
                    return;
                }
            }
            for (int i = threadIdx.x; i < LY * TX + 2 * LY; i += THREADS) {
                int ly, lx;
                plane_slot(i, ly, lx);
                i64 gy = y0 + ly - 1;
                i64 gx = x0 + lx - 1;
                if constexpr (Edges::PERIODIC) {
                    gy = wrap_index(gy, ny);
                    gx = wrap_index(gx, nx);
                }
                K key = all_ones<K>();
                if (plane_inside && gy >= 0 && gy < ny && gx >= 0 && gx < nx)
                    key = key_of(plane_base + gy * nx + gx);
                dst[ly * LX + lx] = key;
            }
        };

        if constexpr (NDIM == 3) {
            load_plane(z0 - 1, tile[0]);
            load_plane(z0, tile[1]);
        }
        for (i64 z = z0; z < z1; ++z) {
            after.step_begin();
            const K* planes[NP];
            if constexpr (NDIM == 3) {
                const RingSlots slot(z - z0);
                load_plane(z + 1, tile[slot.above]);
                planes[0] = tile[slot.below];
                planes[NP - 2] = tile[slot.at];
                planes[NP - 1] = tile[slot.above];
            } else {
                load_plane(0, tile[0]);
                planes[0] = tile[0];
            }
            __syncthreads();
            // a hook that can stop (STOPS): a constant-false test made ptxas allocate the
            // soft forward's registers differently (7 more spill accesses)
            if constexpr (After::STOPS) {
                if (after.stopped()) return;  // block-uniform
            }

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
                if (gy < ny && gx < nx && counts(z, gy, gx)) {
                    int c;
                    if constexpr (Edges::PERIODIC) {
                        i64 p[NDIM], n[NDIM];
                        if constexpr (NDIM == 3) {
                            p[0] = z, p[1] = gy, p[2] = gx, n[0] = nz, n[1] = ny, n[2] = nx;
                        } else {
                            p[0] = gy, p[1] = gx, n[0] = ny, n[1] = nx;
                        }
                        c = contribution<NDIM, TCONN>(nb, torus_flips<NDIM>(p, n));
                    } else {
                        c = contribution<NDIM, TCONN>(nb);
                    }
                    sink(c, nb[(pow3(NDIM) - 1) / 2], image_base + (z * ny + gy) * nx + gx);
                }
            }
            after.rows_done();
            __syncthreads();  // the next step overwrites plane z-1
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Packed sweep for the histogram: two 15-bit keys (bins; outside the image a key above every
// bin) per 32-bit word, compared with SWAR arithmetic. With H = 0x80008000 and keys below
// 2^15, bit 15 of each 16-bit lane of (p | H) - q is [q <= p], and of (p | H) - q - 0x00010001
// is [q < p]: a lane never borrows from its neighbour. So one IADD3 compares two pixels with a
// neighbour each; cell ownership is 3-input ANDs of those bits, and a pixel's contribution is
// a sum of bits (lane sums stay below 2^15). The scalar sweep spends a comparison, a select
// and a shift per neighbour and pixel, and was bound by instruction issue.
// ---------------------------------------------------------------------------------------------
namespace packed {
constexpr int WORDS = 32;                // words per tile row, one per lane
constexpr int TXP = 2 * WORDS;           // tile width in pixels
// A shared row holds 72 keys: [pad pad pad x0-1 | x0 ... x0+63 | x0+64 pad pad pad], so the
// tile starts 8-byte aligned (vector stores) and word w+1 holds pixels x0+2w-2, x0+2w-1.
constexpr int ROWW = WORDS + 4;          // words per shared row
constexpr int ROWK = 2 * ROWW;           // keys per shared row
constexpr int KEY0 = 3;                  // key index of halo column 0 (pixel x0 - 1)
// A tile of WARPS x RPT rows (RPT rows per thread) and its shared plane (one-row halo).
template <int RPT>
struct Rows {
    static constexpr int TILE = WARPS * RPT;               // tile height
    static constexpr int SHARED = TILE + 2;                // rows per shared plane
    static constexpr int PLANEW = ROWW * SHARED;           // words per shared plane
    static constexpr int LOADS = SHARED * (TXP + 2);       // keys loaded per plane
};
constexpr int PLANEW = Rows<PY>::PLANEW;  // the soft ECC's tiles (ecc_soft.cuh)
constexpr unsigned H = 0x80008000u;
// Key of positions outside the image, unless the key type has its own (RUNTIME_OUTSIDE: the
// histogram's BinKey takes T + 1). Bins 0..T must stay below it: the host takes this kernel
// only for T <= _ecc_cupy.PACKED_MAX_BINS (4096, the bins of a shared histogram).
constexpr unsigned OUTSIDE = 0x7fffu;
// 16-byte reads a thread issues before it bins them: a plane's interior rows take 1 to 5
// rounds of the block's threads in tiles of 32 rows (3 for 4-byte pixels), 2 to 9 in tiles of
// 64 (5 for 4-byte pixels); rounds past three bin in further groups.
constexpr int LOADS_IN_FLIGHT = 3;
// 3D planes read as 2D ones (below). CUTOPO_ECC_NO_GROUP_READS_3D: one read at a time, the
// form before (a variant for benchmarks/ab_ecc.py --variant).
#ifdef CUTOPO_ECC_NO_GROUP_READS_3D
constexpr bool GROUP_READS_3D = false;
#else
constexpr bool GROUP_READS_3D = true;
#endif

// Keys of the VEC pixels of one 16-byte read into word v (of the row's TXP / VEC) of shared
// row ly (halo coordinates) of a plane.
template <class KeyOf>
__device__ __forceinline__ void store_keys(const KeyOf& key_of, uint4 raw, unsigned* plane, int ly, int v) {
    constexpr int VEC = KeyOf::VEC;
    unsigned packed[VEC / 2];
    key_of.pack(raw, packed);
    unsigned* row = plane + ly * ROWW + 2 + v * (VEC / 2);
    if constexpr (VEC == 2) {
        row[0] = packed[0];
    } else {
#pragma unroll
        for (int k = 0; k < VEC / 2; k += 2)
            *reinterpret_cast<uint2*>(row + k) = make_uint2(packed[k], packed[k + 1]);
    }
}

// A tile's place as a type, for two instances of its row reads: at an image edge or not.
template <bool E> struct Edge { static constexpr bool value = E; };

// The outside keys of store_keys' VEC pixels (a row above or below the image): KeyOf's, by
// default OUTSIDE.
template <int VEC>
__device__ __forceinline__ void store_outside(unsigned* plane, int ly, int v, unsigned outside) {
    const unsigned W = outside | (outside << 16);
    unsigned* row = plane + ly * ROWW + 2 + v * (VEC / 2);
    if constexpr (VEC == 2) {
        row[0] = W;
    } else {
#pragma unroll
        for (int k = 0; k < VEC / 2; k += 2) *reinterpret_cast<uint2*>(row + k) = make_uint2(W, W);
    }
}

template <int NDIM>
__device__ constexpr int level(int j) {
    int k = 0;
    for (int a = 0; a < NDIM; ++a) k += digit<NDIM>(j, a) != 0;
    return k;
}

// Bit 15 of lane i of P[J]: neighbour J of pixel i precedes it (other bits are garbage).
// q precedes p when q <= p for neighbours earlier in C order, when q < p for later ones.
template <int NDIM, int J = 0>
__device__ __forceinline__ void precedence(const unsigned (&W)[pow3(NDIM)], unsigned p_high,
                                           unsigned (&P)[pow3(NDIM)]) {
    if constexpr (J < pow3(NDIM)) {
        if constexpr (J == (pow3(NDIM) - 1) / 2) {
            P[J] = 0;
        } else if constexpr (earlier<NDIM>(J)) {
            P[J] = p_high - W[J];
        } else {
            P[J] = p_high - W[J] - 0x00010001u;
        }
        precedence<NDIM, J + 1>(W, p_high, P);
    }
}

// As precedence, and bit 15 of each lane of ``ties`` is set when some neighbour's key equals
// the centre's: (p | H) - q is 0x8000 exactly then, so its bit 15 is set and that of one less
// is clear (one IADD3 and one LOP3 more per neighbour word).
template <int NDIM, int J = 0>
__device__ __forceinline__ void precedence_ties(const unsigned (&W)[pow3(NDIM)], unsigned p_high,
                                                unsigned (&P)[pow3(NDIM)], unsigned& ties) {
    if constexpr (J < pow3(NDIM)) {
        if constexpr (J == (pow3(NDIM) - 1) / 2) {
            P[J] = 0;
        } else {
            const unsigned le = p_high - W[J];     // bit 15: q <= p
            const unsigned lt = le - 0x00010001u;  // bit 15: q < p
            P[J] = earlier<NDIM>(J) ? le : lt;
            ties |= le & ~lt;
        }
        precedence_ties<NDIM, J + 1>(W, p_high, P, ties);
    }
}

// In 3D each cube (level 3) is paired with one of its squares, no square twice (zeroing axis 2
// where o_2 > 0, else axis 0 or 1: the eight cubes take eight of the twelve squares). A cube is
// owned only when its squares are, and the two have opposite signs, so together they count
// sign(square) x (square and not cube), one bit: a count (LEA.HI) per cube less, 8 of the 26
// per word. -1 where J is not a cube (2D: none). CUTOPO_ECC_NO_CUBE_PAIRS: every cell counted
// on its own (the form before, for benchmarks/ab_ecc.py --variant).
template <int NDIM>
__device__ constexpr int paired_square(int j) {
#ifdef CUTOPO_ECC_NO_CUBE_PAIRS
    return -1;
#else
    if (NDIM != 3 || j == (pow3(NDIM) - 1) / 2 || level<NDIM>(j) != 3) return -1;
    const int axis = digit<NDIM>(j, 2) > 0 ? 2 : (digit<NDIM>(j, 0) == digit<NDIM>(j, 1) ? 0 : 1);
    return j - digit<NDIM>(j, axis) * pow3(NDIM - 1 - axis);
#endif
}

template <int NDIM>
__device__ constexpr bool is_paired(int j) {
    for (int k = 0; k < pow3(NDIM); ++k)
        if (paired_square<NDIM>(k) == j) return true;
    return false;
}

template <int NDIM>
__device__ constexpr int paired_count() {
    int n = 0;
    for (int j = 0; j < pow3(NDIM); ++j) n += is_paired<NDIM>(j);
    return n;
}
#ifndef CUTOPO_ECC_NO_CUBE_PAIRS
static_assert(paired_count<3>() == 8 && paired_count<2>() == 0, "each cube pairs with its own square");
#endif

// AND of own[] over the children of J (J with one non-zero component zeroed, centre excluded),
// child SKIP left out.
template <int NDIM, int J, int SKIP = -1, int A = 0>
__device__ __forceinline__ unsigned children_and(const unsigned (&own)[pow3(NDIM)]) {
    if constexpr (A == NDIM) {
        return 0xffffffffu;
    } else {
        constexpr int d = digit<NDIM>(J, A);
        constexpr int child = J - d * pow3(NDIM - 1 - A);
        if constexpr (d != 0 && child != (pow3(NDIM) - 1) / 2 && child != SKIP)
            return own[child] & children_and<NDIM, J, SKIP, A + 1>(own);
        else
            return children_and<NDIM, J, SKIP, A + 1>(own);
    }
}

// Ownership bits of the cells of one level (number of non-zero offset components), added to
// the positive or negative count by the cell's sign; a cube and its paired square as one bit.
template <int NDIM, bool TCONN, int LEVEL, int J = 0>
__device__ __forceinline__ void own_level(const unsigned (&P)[pow3(NDIM)], unsigned (&own)[pow3(NDIM)],
                                          unsigned& pos, unsigned& neg) {
    if constexpr (J < pow3(NDIM)) {
        if constexpr (J != (pow3(NDIM) - 1) / 2 && level<NDIM>(J) == LEVEL) {
            const unsigned test = TCONN ? ~P[J] : P[J];
            constexpr int PAIR = paired_square<NDIM>(J);
            if constexpr (PAIR >= 0) {
                // cube = own[PAIR] & rest; own[PAIR] - cube = own[PAIR] & ~rest
                const unsigned rest = test & children_and<NDIM, J, PAIR>(own) & H;
                const unsigned o = own[PAIR] & ~rest;
                if constexpr (cell_sign<NDIM, TCONN>(PAIR) > 0) pos += o >> 15;
                else neg += o >> 15;
            } else {
                const unsigned o = test & children_and<NDIM, J>(own) & H;
                own[J] = o;
                if constexpr (!is_paired<NDIM>(J)) {
                    if constexpr (cell_sign<NDIM, TCONN>(J) > 0) pos += o >> 15;
                    else neg += o >> 15;
                }
            }
        }
        own_level<NDIM, TCONN, LEVEL, J + 1>(P, own, pos, neg);
    }
}

// Contributions of the two pixels of the centre word: c = base + pos - neg per 16-bit lane.
// With TIES, bit 15 of each lane of ``ties`` tells that the lane's pixel has a neighbour of
// equal key (the soft ECC's quantized keys: then its contribution is recomputed exactly).
template <int NDIM, bool TCONN, bool TIES = false>
__device__ __forceinline__ void word_counts(const unsigned (&W)[pow3(NDIM)], unsigned& pos, unsigned& neg,
                                            unsigned& ties) {
    constexpr int N = pow3(NDIM);
    unsigned P[N], own[N];
    if constexpr (TIES) {
        ties = 0u;
        precedence_ties<NDIM>(W, W[(N - 1) / 2] | H, P, ties);
    } else {
        precedence<NDIM>(W, W[(N - 1) / 2] | H, P);
    }
    pos = 0;
    neg = 0;
    own_level<NDIM, TCONN, 1>(P, own, pos, neg);
    own_level<NDIM, TCONN, 2>(P, own, pos, neg);
    if constexpr (NDIM == 3) own_level<NDIM, TCONN, 3>(P, own, pos, neg);
}

// Sweep the tiles [first, first + step, ...) of one image (64 pixels or 32 words wide, WARPS x
// RPT rows high). Sink(c, key, 0) consumes each counted pixel's contribution; a sink with WORDS set instead
// takes each thread's word of two pixels, sink.word(pos, neg, ties, z, gy, gx, j) (its pixels
// (z, gy, gx) and (z, gy, gx + 1), counted or not; ties as word_counts makes them when the
// sink sets TIES), and after the rows of every plane every thread calls
// after.rows_done(z, y0, x0) (the plane and the tile's origin).
template <int NDIM, bool TCONN, int RPT = PY, class KeyOf, class Sink, class Region = AllPixels,
          class After = NoRowsHook>
__device__ __forceinline__ void sweep(unsigned (*tile)[Rows<RPT>::PLANEW], i64 nz, i64 ny, i64 nx, int zchunk,
                                      i64 image_base, i64 first, i64 step, const KeyOf& key_of,
                                      const Sink& sink, const Region& counts = Region(),
                                      const After& after = After()) {
    constexpr int NP = NDIM == 3 ? 3 : 1;
    constexpr int TY = Rows<RPT>::TILE, ROWS = Rows<RPT>::SHARED, LOADS = Rows<RPT>::LOADS;
    constexpr int BASE = cell_sign<NDIM, TCONN>((pow3(NDIM) - 1) / 2);
    const int lane = threadIdx.x % 32;
    const int row0 = (threadIdx.x / 32) * RPT + 1;  // first tile row of this thread, halo coords
    const i64 ntx = (nx + TXP - 1) / TXP;
    const i64 nty = (ny + TY - 1) / TY;
    const i64 ntz = NDIM == 3 ? (nz + zchunk - 1) / zchunk : 1;
    const i64 plane_px = ny * nx;
    // The key of positions outside the image: OUTSIDE, a constant (taken from the key type as a
    // call, the soft ECC's kernels compiled otherwise), or the key type's (BinKey's T + 1).
    unsigned short outside = OUTSIDE;
    if constexpr (KeyOf::RUNTIME_OUTSIDE) outside = (unsigned short)key_of.outside();

    for (TileWalk<NDIM> w(ntx, nty, ntz, first, step); w.valid(); w.next()) {
        const i64 x0 = w.x() * TXP;
        const i64 y0 = w.y() * TY;
        const i64 z0 = NDIM == 3 ? w.z() * zchunk : 0;
        const i64 z1 = NDIM == 3 ? min(z0 + (i64)zchunk, nz) : 1;

        // Keys of plane z into dst. Tiles whose 64 columns lie in the image (every tile but a
        // last one that overhangs nx) read their rows whole, by 16 bytes per thread where rows
        // are 16-byte aligned, and test only each row (gy in the image) and the two halo keys
        // of each row end; the others take every key with its bounds test. (Tiles at the y and
        // x edges took that slow path too, ~40 instructions a key against ~17: a third of the
        // tiles at 512^3, which runs 15 % faster so, 256^3 26 %, 64 x 1024^2 11 %; 8192^2
        // float64 8 % slower until 2D tiles away from the y edges read their rows without a
        // test again, below; benchmarks/RESULTS.md, fifty-third and fifty-fourth sessions.)
        // (Prefetching the next plane into registers was measured slower: 1.19 -> 1.93 ms at
        // 512^3 float32, from register pressure; see benchmarks/RESULTS.md.)
        auto row_inside = [&](int ly) { return (u64)(y0 + ly - 1) < (u64)ny; };  // halo row ly
        // Plane z's corner from the tile's and the plane size: one multiply a plane step, not
        // two (3D uint8 3-4 % faster, float32 0-0.5 %; H100, benchmarks/RESULTS.md, fifty-sixth
        // session).
        const i64 tile_corner = image_base + (y0 - 1) * nx + x0 - 1;  // halo (0, 0) of plane 0
        auto load_plane = [&](i64 z, unsigned* dst) {
            unsigned short* keys = reinterpret_cast<unsigned short*>(dst);
            const bool plane_inside = z >= 0 && z < nz;
            const i64 corner = tile_corner + z * plane_px;  // halo (0, 0)
            if (plane_inside && x0 + TXP <= nx) {  // the tile's columns lie in the image
                // The keys at the two ends of halo row ly (column 0 or TXP + 1), which may lie
                // outside the image.
                auto end_inside = [&](int ly, int ex) { return row_inside(ly) && (ex ? x0 + TXP < nx : x0 >= 1); };
                if (key_of.vector_rows(nx)) {
                    constexpr int VEC = KeyOf::VEC;  // pixels per 16-byte load
                    constexpr int PER_ROW = TXP / VEC;
                    constexpr int VECTORS = ROWS * PER_ROW;
                    if constexpr ((NDIM == 2 || GROUP_READS_3D) && KeyOf::GROUP_READS) {
                        // Every read of the plane (up to LOADS_IN_FLIGHT per thread, and the
                        // row ends') is issued before the first key is formed: a loop of load,
                        // bin, store waited a memory latency per round, 3 rounds and the row
                        // ends for 4-byte pixels. In 3D, whose registers are capped lower, the
                        // grouped reads first spilled and measured slower (twenty-fourth
                        // session); with the reads by column they spill 12-48 B (sm_90) and
                        // measured 3-5 % faster for float32 volumes from 256^3 up, uint8 equal
                        // (benchmarks/RESULTS.md, thirty-second session). KeyOf may opt out
                        // (the soft ECC's forward, whose band work needs the registers).
                        constexpr int ROUNDS = (VECTORS + THREADS - 1) / THREADS;
                        constexpr int GROUP = ROUNDS < LOADS_IN_FLIGHT ? ROUNDS : LOADS_IN_FLIGHT;
                        static_assert(2 * ROWS <= THREADS, "one thread per row end");
                        const bool end_thread = threadIdx.x < 2 * ROWS;
                        const int ey = threadIdx.x >> 1, ex = (threadIdx.x & 1) ? TXP + 1 : 0;
                        // A row end outside the image reads pixel (y0, x0) instead, which is
                        // inside: the read stays as unconditional as the tile's row reads.
                        const bool end_in = end_inside(ey, ex);
                        typename KeyOf::In end_value{};
                        if (end_thread) end_value = key_of.load(corner + (end_in ? (i64)ey * nx + ex : nx + 1));
                        // Round u reads row r0 + u RSTEP of the thread's column v (as below).
                        static_assert(THREADS % PER_ROW == 0, "a thread keeps its column");
                        constexpr int RSTEP = THREADS / PER_ROW;
                        const int v = threadIdx.x % PER_ROW, r0 = threadIdx.x / PER_ROW;
                        const i64 stride = (i64)RSTEP * nx;
                        const i64 at = corner + (i64)r0 * nx + 1 + v * VEC;
                        // EDGE: test each row (a tile at the top or bottom edge); without, the
                        // reads of the middle rounds go unpredicated. 2D takes both instances
                        // (8192^2 float64 19 % faster than with one, float32 5 %, uint8 1 %
                        // slower); 3D one, two measured no faster there (256^3 float32 +3.5 %,
                        // 512^3 -1.4 %; H200, benchmarks/RESULTS.md, fifty-fourth session).
                        auto rows = [&](auto edge) {
                            constexpr bool EDGE = decltype(edge)::value;
#pragma unroll
                            for (int g = 0; g < ROUNDS; g += GROUP) {
                                uint4 raw[GROUP];
#pragma unroll
                                for (int u = 0; u < GROUP; ++u) {
                                    const int r = r0 + (g + u) * RSTEP;
                                    if (g + u < ROUNDS && r < ROWS && (!EDGE || row_inside(r)))
                                        raw[u] = key_of.load16(at + (g + u) * stride);
                                }
#pragma unroll
                                for (int u = 0; u < GROUP; ++u) {
                                    const int r = r0 + (g + u) * RSTEP;
                                    if (g + u < ROUNDS && r < ROWS) {
                                        if (!EDGE || row_inside(r)) store_keys(key_of, raw[u], dst, r, v);
                                        else store_outside<VEC>(dst, r, v, outside);
                                    }
                                }
                            }
                        };
                        if (NDIM == 2 && y0 >= 1 && y0 + TY + 1 <= ny) rows(Edge<false>());
                        else rows(Edge<true>());
                        if (end_thread)
                            keys[ey * ROWK + KEY0 + ex] =
                                end_in ? (unsigned short)key_of.of_value(end_value) : outside;
                        return;
                    } else {
                        // A thread reads one column v of the rows r0, r0 + RSTEP, ...: its index
                        // steps by RSTEP rows (a 64-bit multiply and division less per read).
                        static_assert(THREADS % PER_ROW == 0, "a thread keeps its column");
                        constexpr int RSTEP = THREADS / PER_ROW;
                        const int v = threadIdx.x % PER_ROW;
                        const i64 stride = (i64)RSTEP * nx;
                        i64 at = corner + (i64)(threadIdx.x / PER_ROW) * nx + 1 + v * VEC;
                        for (int r = threadIdx.x / PER_ROW; r < ROWS; r += RSTEP, at += stride) {
                            if (row_inside(r)) store_keys(key_of, key_of.load16(at), dst, r, v);
                            else store_outside<VEC>(dst, r, v, outside);
                        }
                    }
                } else {
                    for (int i = threadIdx.x; i < ROWS * TXP; i += THREADS) {
                        const int ly = i / TXP, lx = i % TXP + 1;
                        keys[ly * ROWK + KEY0 + lx] = row_inside(ly)
                            ? (unsigned short)key_of(corner + (i64)ly * nx + lx) : outside;
                    }
                }
                for (int i = threadIdx.x; i < 2 * ROWS; i += THREADS) {
                    const int ly = i >> 1, ex = (i & 1) ? TXP + 1 : 0;
                    keys[ly * ROWK + KEY0 + ex] = end_inside(ly, ex)
                        ? (unsigned short)key_of(corner + (i64)ly * nx + ex) : outside;
                }
                return;
            }
            for (int i = threadIdx.x; i < LOADS; i += THREADS) {
                const int ly = i / (TXP + 2);
                const int lx = i - ly * (TXP + 2);
                const i64 gy = y0 + ly - 1;
                const i64 gx = x0 + lx - 1;
                unsigned short key = outside;
                if (plane_inside && (u64)gy < (u64)ny && (u64)gx < (u64)nx)
                    key = (unsigned short)key_of(corner + (i64)ly * nx + lx);
                keys[ly * ROWK + KEY0 + lx] = key;
            }
        };
        // Words of one shared row around this lane: pixels shifted left, centre, shifted right.
        auto row_words = [&](const unsigned* plane, int row, unsigned (&w)[3]) {
            const unsigned* r = plane + row * ROWW + 1 + lane;
            const unsigned a = r[0], b = r[1], c = r[2];
            w[0] = __byte_perm(a, b, 0x5432);
            w[1] = b;
            w[2] = __byte_perm(b, c, 0x5432);
        };

        if constexpr (NDIM == 3) {
            load_plane(z0 - 1, tile[0]);
            load_plane(z0, tile[1]);
        }
        for (i64 z = z0; z < z1; ++z) {
            const unsigned* planes[NP];
            if constexpr (NDIM == 3) {
                // (A ring of four planes, plane z+2 loaded while the window reads z-1..z+1 and
                // one barrier a step, measured 2-7 % slower: benchmarks/RESULTS.md,
                // fifty-fourth session.)
                const RingSlots slot(z - z0);
                load_plane(z + 1, tile[slot.above]);
                planes[0] = tile[slot.below];
                planes[1] = tile[slot.at];
                planes[2] = tile[slot.above];
            } else {
                load_plane(0, tile[0]);
                planes[0] = tile[0];
            }
            __syncthreads();

            unsigned win[NP][3][3];
#pragma unroll
            for (int p = 0; p < NP; ++p) {
                row_words(planes[p], row0 - 1, win[p][1]);
                row_words(planes[p], row0, win[p][2]);
            }
#pragma unroll
            for (int j = 0; j < RPT; ++j) {
                unsigned W[pow3(NDIM)];
#pragma unroll
                for (int p = 0; p < NP; ++p) {
#pragma unroll
                    for (int q = 0; q < 3; ++q) {
                        win[p][0][q] = win[p][1][q];
                        win[p][1][q] = win[p][2][q];
                    }
                    row_words(planes[p], row0 + j + 1, win[p][2]);
#pragma unroll
                    for (int r = 0; r < 3; ++r)
#pragma unroll
                        for (int q = 0; q < 3; ++q) W[(p * 3 + r) * 3 + q] = win[p][r][q];
                }
                unsigned pos, neg, ties;
#ifdef CUTOPO_PROFILE_LOAD_ONLY  // profiling variant: tile loads only
                pos = W[(pow3(NDIM) - 1) / 2] ^ W[0];
                neg = 0;
                ties = 0;
#else
                word_counts<NDIM, TCONN, Sink::TIES>(W, pos, neg, ties);
#endif
                // The centre word holds pixels x0 + 2 lane (low half) and x0 + 2 lane + 1.
                const i64 gy = y0 + row0 + j - 1;
                const i64 gx = x0 + 2 * lane;
                if constexpr (Sink::WORDS) {
                    sink.word(pos, neg, ties, z, gy, gx, j);
                } else {
                    const unsigned keys = W[(pow3(NDIM) - 1) / 2];
#ifdef CUTOPO_PROFILE_NO_SINK  // profiling variant: no histogram updates
                    if ((pos ^ neg ^ keys) == 0x12345678u) sink(1, 0, 0);
#else
                    // Both contributions in one subtraction, c = c1 2^16 + c0 with c0 the low
                    // lane sign-extended (opaque: else the compiler subtracted each negative
                    // cell's count on its own, a shift and an add where one LEA.HI adds).
                    const unsigned both = opaque_sub(pos + (unsigned)BASE * 0x00010001u, neg);
                    const int c0 = (int)(short)(both & 0xffffu);
                    // Each key by a byte permute, opaque to the compiler, which otherwise
                    // scaled the word and masked it (three instructions an address, not two).
                    if (counts(z, gy, gx)) sink(c0, __byte_perm(keys, 0, 0x4410), 0);
                    if (counts(z, gy, gx + 1)) sink(((int)both - c0) >> 16, __byte_perm(keys, 0, 0x4432), 0);
#endif
                }
            }
            after.rows_done(z, y0, x0);
            __syncthreads();  // the next step overwrites plane z-1
        }
    }
}
}  // namespace packed

// One entry of the threshold table: bin k's bounds lo = t_{k-1} and hi = t_k, in the comparison
// type; checking an estimate of the bin then reads one 8- or 16-byte entry instead of two
// dependent thresholds. Entry 0 and entry T: (t_0, t_0) and (t_{T-1}, t_{T-1}), so that an
// estimate of 0 or T walks into [1, T-1]; in the float and int32 types bounds that every value
// passes, so that an estimate checks without early outs: float32 and float64 (NaN, t_0) and
// (t_{T-1}, NaN) (a NaN compares false), int32 (INT_MIN, t_0) and (t_{T-1}, INT_MAX) (the int32
// table of 16-bit integer images holds floor(t), clipped to just beyond their range: _ecc_cupy).
template <typename Tab>
struct alignas(2 * sizeof(Tab)) Bounds {
    Tab lo, hi;
};

// The packed sweep's tables of 4-byte comparison values (16-bit keys: at most PACKED_MAX_BINS + 1
// entries, 32 KB) always lie in shared memory (_ecc_cupy.threshold_table_in_shared).
template <typename Cmp, typename K>
constexpr bool TABLE_ALWAYS_IN_SMEM = sizeof(K) == 2 && sizeof(Cmp) == 4;

// A 4-byte comparison value as the float the bin estimate starts from: a float32 itself; an
// int32 (a pixel of a 16-bit integer image, |v| < 2^22) exactly, as the float whose bits are
// those of 1.5 * 2^23 + v, less 1.5 * 2^23 (an integer and a float add on the full-rate pipes,
// where a conversion instruction would take the slower one).
__device__ __forceinline__ float estimate_arg(float v) { return v; }
__device__ __forceinline__ float estimate_arg(int v) {
    return __fsub_rn(__int_as_float(0x4B400000 + v), 12582912.0f);
}

template <typename T> constexpr bool IS_DOUBLE = false;
template <> constexpr bool IS_DOUBLE<double> = true;

// A 4-byte comparison value from its bits.
template <typename Cmp> __device__ __forceinline__ Cmp from_bits(unsigned u);
template <> __device__ __forceinline__ float from_bits<float>(unsigned u) { return __int_as_float((int)u); }
template <> __device__ __forceinline__ int from_bits<int>(unsigned u) { return (int)u; }

// Threshold bin of a value: the first k with v <= t_k (T when there is none, NaN included).
// Most values need one table read (with an estimate). SHARED_TABLE: the table lies in shared
// memory (known at compile time).
template <typename Cmp, bool SHARED_TABLE = false>
struct ThresholdBins {
    const Bounds<Cmp>* bounds;  // T + 1 entries, shared or global memory
    Cmp first, last;            // t_0, t_{T-1}
    int T, estimate;
    double t0, inv_dt;          // the estimate x = (v - t0) inv_dt of v's bin, in double
    // and in float, as the fraction of the way down from bin T: u = (T - x) / T = v scale +
    // offset, scale = -inv_dt / T, offset = 1 + t0 inv_dt / T (the host takes the estimate only
    // where the scale is a normal float: -ftz=true flushes a denormal one to zero)
    float scale, offset;
    float round_T;              // ROUND + T
    static constexpr float ROUND = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
    static constexpr int ROUND_BITS = 0x4B400000;  // its bits, whose low 16 are zero
    static constexpr double ROUND_D = 6755399441055744.0;  // 1.5 * 2^52, for float64
    double offset_d;            // -t0 inv_dt in float64
    // With SHARED_TABLE and the estimate, t_k (the upper bound of row k) lies at the shared
    // address table_from_bits + 8 (ROUND_BITS + k): the 4-byte estimate's y indexes the table
    // by its bits (the 32-bit address arithmetic wraps). The compiler's own address of
    // bounds[bits - ROUND_BITS] added the bias to each key (a VIADD in the sm_90 SASS), and so
    // did ptxas to an address computed here, as long as the bias was a constant: it depends on
    // estimate for that.
    smem_addr table_from_bits;

    __device__ __forceinline__ ThresholdBins(const Bounds<Cmp>* b, int T_, int estimate_, double t0_,
                                             double inv_dt_, bool hold_round = true)
        : bounds(b), first(b[0].hi), last(b[T_ - 1].hi), T(T_), estimate(estimate_), t0(t0_),
          inv_dt(inv_dt_), scale((float)(-inv_dt_ / T_)), offset((float)(1.0 + t0_ * inv_dt_ / T_)),
          round_T(ROUND + (float)T_), offset_d(-t0_ * inv_dt_),
          table_from_bits(SHARED_TABLE ? shared_address(&b->hi) - (estimate_ ? (smem_addr)ROUND_BITS : 0u)
                                                                      * (smem_addr)sizeof(Bounds<Cmp>)
                                       : 0u) {
        // The scale and (hold_round) ROUND + T held in general registers: a key's FFMAs take
        // one operand from a uniform register (the offset, -T) and the other from a general
        // one, into which the compiler otherwise moved it before every key (an IMAD.U32 a key
        // in the sm_90 SASS). x + 0 x threadIdx.x is x exactly, but no longer uniform to ptxas.
        // (The masked 3D histograms, short of registers, spilled more with ROUND + T held.)
        scale = __fmaf_rn(0.0f, (float)threadIdx.x, scale);
        if (hold_round) round_T = __fmaf_rn(0.0f, (float)threadIdx.x, round_T);
    }

    // LOW16: only the result's low 16 bits need be the bin (16-bit keys).
    template <bool LOW16 = false>
    __device__ __forceinline__ int operator()(Cmp v) const {
        int k;
        if constexpr (sizeof(Cmp) == 4) {  // float32, or int32 (16-bit integer images)
            if (estimate) {
                // The guess round(x), x = (v - t0) / dt, clamped to [0, T] in float (NaN to
                // T), is v's bin k or k - 1, so one comparison with t_guess makes it exact: no
                // early outs, no order keys, no loop. The host takes the estimate only where
                // every t_k lies within dt/4 of t_0 + k dt, so a v of bin k (t_{k-1} < v <=
                // t_k) has x in (k - 5/4, k + 1/4], and where (|t_0| + |t_{T-1}|) / dt + T <=
                // 2^21, so the float errors stay below 1/4 bin (in x: 2^-24 of
                // (|t_0| + |v|) / dt + 2T, from the rounding of the scale, the offset and the
                // first FFMA) and the guess lands in (k - 3/2, k + 1/2); values beyond either
                // end land at or beside their bin, 0 or T, or are clamped to it, and row T's
                // upper bound (NaN, or INT32_MAX) no value exceeds (_ecc_cupy._uniform_estimate
                // and _threshold_table; a 16-bit integer v is in bin k of the integer table
                // exactly when t_{k-1} < v <= t_k). The clamp is the saturation of the first
                // FFMA, which takes NaN to 0, i.e. to bin T; the second FFMA scales it and
                // rounds. In the sm_90 SASS a float32 value took 26 instructions with order
                // keys and early outs, 15 with a loop each way and a generic load, 10 with
                // the guess rounded to the nearest bin (two comparisons) and clamped by fminf
                // and fmaxf, 7 now (with the table's shared load at an address biased once and
                // the key's low bits taken from y's); a 16-bit integer's took a float64
                // conversion, comparisons and rounding (three conversions on the slow pipe)
                // (benchmarks/RESULTS.md, thirtieth, fifty-fifth, fifty-sixth and sixtieth
                // sessions).
                const float y = __fmaf_rn(fma_saturate(estimate_arg(v), scale, offset), -(float)T, round_T);
                const int bits = __float_as_int(y);  // ROUND_BITS + the guess
                Cmp hi;
                if constexpr (SHARED_TABLE) {
                    hi = from_bits<Cmp>(load_shared_u32(table_from_bits + (smem_addr)bits * sizeof(Bounds<Cmp>)));
                } else {
                    hi = bounds[bits - ROUND_BITS].hi;
                }
                k = step_up(bits, v, hi);
                return LOW16 ? k : k - ROUND_BITS;
            }
        } else if constexpr (IS_DOUBLE<Cmp>) {
            if (estimate) {
                // The same in float64 (float64 images, or float64 thresholds), where the host
                // asks (|t_0| + |t_{T-1}|) / dt + T <= 2^50 for errors below 1/4 bin; y's low
                // word is the guess (ROUND_D's is zero), clamped to [0, T] by two comparisons
                // (NaN to T; fmin and fmax took ~7 instructions each).
                const double y = __dadd_rn(__fma_rn(v, inv_dt, offset_d), ROUND_D);
                k = y >= ROUND_D ? __double2loint(y) : 0;
                k = y <= ROUND_D + (double)T ? k : T;
                return step_up(k, v, bounds[k].hi);
            }
        }
        if (!le(v, last)) return T;
        if (le(v, first)) return 0;
        // Now t_0 < v <= t_{T-1}: the answer k lies in [1, T-1].
        if (estimate) {
            // Evenly spaced thresholds, the 8-byte integer comparison types: an O(1) guess in
            // float64, made exact by the comparisons below (the host allows this only when the
            // guess is within a bin or so of the answer).
            k = (int)fmin(ceil(((double)v - t0) * inv_dt), (double)T);
            k = min(max(k, 1), T - 1);
            const Bounds<Cmp> b = bounds[k];
            if (le(v, b.lo)) {
                do --k; while (le(v, bounds[k].lo));
            } else if (!le(v, b.hi)) {
                do ++k; while (!le(v, bounds[k].hi));
            }
        } else {  // binary search keeping v <= t_hi and not v <= t_lo
            int lo = 0, hi = T - 1;
            while (hi - lo > 1) {
                const int mid = (lo + hi) >> 1;
                if (le(v, bounds[mid].hi)) hi = mid; else lo = mid;
            }
            k = hi;
        }
        return k;
    }
};

// The image reads the sweeps' key types share: 16-byte reads of VEC pixels where every image
// row starts 16-byte aligned. Then so does every tile row, whose first column is a multiple of
// VEC, and a read lies wholly inside or wholly outside its row (nx % VEC == 0).
template <typename In_>
struct Reads16 {
    typedef In_ In;
    static constexpr int VEC = 16 / sizeof(In);  // pixels per 16-byte read
    const In* image;
    __device__ __forceinline__ In load(i64 i) const { return image[i]; }
    __device__ __forceinline__ bool vector_rows(i64 nx) const {
        return (reinterpret_cast<size_t>(image) % 16) == 0 && (nx * (i64)sizeof(In)) % 16 == 0;
    }
    // The 16 bytes from element i (16-byte aligned).
    __device__ __forceinline__ uint4 load16(i64 i) const {
        return __ldg(reinterpret_cast<const uint4*>(image + i));
    }
    // The key of positions outside the image (packed::sweep): OUTSIDE, unless a key type says
    // otherwise (RUNTIME_OUTSIDE and its outside()).
    static constexpr bool RUNTIME_OUTSIDE = false;
    // Pixel k of a 16-byte read.
    __device__ __forceinline__ static In value_in(uint4 raw, int k) {
        union {
            uint4 raw;
            In px[VEC];
        } u;
        u.raw = raw;
        return u.px[k];
    }
};

// Key of a pixel for the histogram: its threshold bin. One-byte inputs look it up in a
// 256-entry table built once per block, unless every byte is its own bin (bytes_are_bins:
// thresholds 0, 1, ..., 255 and maybe more, as `ecc(image, 256)` takes for an 8-bit image
// that spans 0..255), when the keys are the bytes.
template <typename In_, typename Cmp, typename K>
struct BinKey : Reads16<In_> {
    typedef In_ In;
    using Reads16<In>::VEC;
    using Reads16<In>::image;
    static constexpr bool GROUP_READS = true;  // packed::sweep's 2D plane reads
    ThresholdBins<Cmp, TABLE_ALWAYS_IN_SMEM<Cmp, K>> bins;
    const K* byte_bins;   // one-byte inputs only
    bool bytes_are_bins;  // one-byte inputs only: byte_bins[v] == v for every v
    __device__ __forceinline__ K of_value(In v) const {
        if constexpr (sizeof(In) == 1) {
            return bytes_are_bins ? (K)(unsigned char)v : byte_bins[(unsigned char)v];
        } else {
            return (K)bins.template operator()<sizeof(K) == 2>(convert<Cmp>(v));
        }
    }
    __device__ __forceinline__ K operator()(i64 i) const { return of_value(image[i]); }
    // Outside the image the key T + 1, above every bin: HistSink adds such pixels (and bin T's)
    // to slots T + 1 and T, past the histogram, without clamping their keys.
    static constexpr bool RUNTIME_OUTSIDE = true;
    __device__ __forceinline__ unsigned outside() const { return (unsigned)bins.T + 1u; }
    // The VEC keys of a 16-byte read, two per word (16-bit keys): each bin's low half by a byte
    // permute, which ignores the high ones (the compiler masked a key before it shifted and
    // merged it: an instruction a key more in the sm_90 SASS).
    __device__ __forceinline__ unsigned low16_key(In v) const {
        if constexpr (sizeof(In) == 1) return byte_bins[(unsigned char)v];
        else return (unsigned)bins.template operator()<true>(convert<Cmp>(v));
    }
    __device__ __forceinline__ void pack(uint4 raw, unsigned (&packed)[VEC / 2]) const {
        static_assert(sizeof(K) == 2, "two keys a word");
        if constexpr (sizeof(In) == 1) {
            if (bytes_are_bins) {  // two bytes to a word by one permute: 0.5 instructions a key, not 3.5
                const unsigned w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
                for (int k = 0; k < VEC / 2; ++k) packed[k] = __byte_perm(w[k / 2], 0u, k % 2 ? 0x4342 : 0x4140);
                return;
            }
        }
#pragma unroll
        for (int k = 0; k < VEC / 2; ++k)
            packed[k] = __byte_perm(low16_key(this->value_in(raw, 2 * k)),
                                    low16_key(this->value_in(raw, 2 * k + 1)), 0x5410);
    }
};

// Inclusive prefix sum of the row h[0 .. T) by one warp (8 consecutive entries per lane, a
// shuffle scan across lanes), handing every (k, sum up to k) to store. Each lane stores only
// the entries it loaded, so h may be written in place. The loads bypass L1 (ld.global.cg): a
// histogram's last block reads what the other blocks' atomics left in L2.
template <typename Store>
__device__ __forceinline__ void warp_row_prefix_sum(const long long* h, int T, Store store) {
    constexpr int PER = 8;
    const int lane = threadIdx.x % 32;
    long long carry = 0;
    for (int base = 0; base < T; base += 32 * PER) {
        long long v[PER];
#pragma unroll
        for (int i = 0; i < PER; ++i) {
            const int k = base + lane * PER + i;
            v[i] = k < T ? __ldcg(h + k) : 0;
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
            if (k < T) store(k, v[i] + before);
        }
        carry += __shfl_sync(0xffffffffu, incl, 31);
    }
}

// Whether this block is the last of ``blocks`` to count itself done in *counter; every thread
// of the block calls it, once per kernel. The barrier orders the block's additions before
// thread 0's fence, which is cumulative: they are visible device-wide before the block counts
// itself (the pattern of cooperative groups' grid sync). The last block fences again before
// it reads what the others added (from L2: __ldcg, or loads that bypass L1).
__device__ __forceinline__ bool last_block_done(unsigned* counter, unsigned blocks) {
    __shared__ int is_last;
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        is_last = atomicAdd(counter, 1u) == blocks - 1u;
    }
    __syncthreads();
    const bool last = is_last != 0;
    if (last) __threadfence();
    return last;
}

// Adds a pixel's contribution to the block's shared histogram (SHARED: the packed sweep, whose
// bins always fit there) or straight to the global one (the scalar sweep's many bins). A
// compile-time choice: a run-time test of the shared pointer kept both atomics and their
// branches in the count (322 -> 234 instructions per thread and 2D float32 plane; 3-6 % faster,
// benchmarks/RESULTS.md, twenty-fourth session).
// The shared histogram is R interleaved copies (R a power of two, _ecc_cupy.histogram_copies:
// 4 where they leave as many blocks resident as one): bin k of copy r is word k R + r, and lane
// l adds to copy l % R (``lane_base``), so that lanes of different copies never meet at one
// address. Every pixel adds, zeros included, in one unconditional reduction: keys past every
// threshold (bin T; outside the image T + 1, BinKey::outside) go to slots T and T + 1 of each
// copy, which no one reads. The form before (one copy, zeros to a word of the lane's own) took
// a test and a select a pixel more: a thread's plane step 497 instructions in 2D float32
// against 435, uint8 592 against 531, 3D float32 515 against 493 (sm_90). With 4 copies 2D
// 8192^2 measured 5-6 % faster (float32) and 13-16 % (uint8) on white noise and smooth images,
// volumes and float64 1.5-2 %, small images and bool equal. One copy left smooth images 3-9 %
// slower than the form before (neighbours' zeros to one address), 16 copies 4-27 % slower
// than 4 (H100, benchmarks/RESULTS.md, fifty-ninth session).
template <bool SHARED>
struct HistSink {
    static constexpr bool WORDS = false, TIES = false;  // one pixel per call (packed::sweep)
    long long* global;    // this image's row of the global histogram
    int T;
    smem_addr lane_base;  // this lane's copy of the shared histogram (SHARED)
    unsigned stride;      // bytes from one bin to the next: 4 R (SHARED)
    __device__ __forceinline__ void operator()(int c, unsigned key, i64) const {
        if constexpr (SHARED) {
            shared_add(lane_base + stride * key, c);
        } else if (c != 0 && (int)key < T) {
            atomicAdd(reinterpret_cast<u64*>(global + key), (u64)(i64)c);
        }
    }
};

// Bin k of a block's shared histogram: the sum of its ``copies`` copies.
__device__ __forceinline__ int bin_total(const int* hist_s, int k, int copies) {
    int h = 0;
    for (int r = 0; r < copies; ++r) h += hist_s[k * copies + r];
    return h;
}

// Blocks per multiprocessor the histogram kernel's register budget is sized for. Left to
// itself ptxas gave the 3D kernels ~108 registers (2 blocks/SM), too few warps to hide the
// tile loads; capping at 64 (4 blocks/SM) measured 1.86 -> 1.28 ms at 512^3 float32 despite
// a few bytes of spill, and 48 (5 blocks/SM) 5-12 % less again from 256^3 up (ninth
// session). Since the packed sweep and the one-step bins, 48 registers spill 92/120 B in the
// window's loop (float32) and 64 none: 4 blocks/SM measured 1.5-2 % faster for float32 and
// uint8 volumes from 512^3 (float64 +0.9 %, 256^3 equal; H100, benchmarks/RESULTS.md,
// fifty-sixth session). 2D kernels: 40 registers (6 blocks/SM; the grouped
// plane reads spill a few bytes) measured 3-10 % faster than 4 or 5 blocks/SM (twenty-fourth
// session). The masked kernels (halo planes and blocks of streamed volumes) keep 4: at 5 the
// uint8 one spills 260 bytes and was not measured.
#ifndef CUTOPO_ECC_MIN_BLOCKS
#define CUTOPO_ECC_MIN_BLOCKS 6
#endif
#ifndef CUTOPO_ECC_MIN_BLOCKS_3D
#define CUTOPO_ECC_MIN_BLOCKS_3D 4
#endif
#ifndef CUTOPO_ECC_MIN_BLOCKS_MASKED
#define CUTOPO_ECC_MIN_BLOCKS_MASKED 4
#endif
#define CUTOPO_ECC_BLOCKS(NDIM) ((NDIM) == 3 ? CUTOPO_ECC_MIN_BLOCKS_3D : CUTOPO_ECC_MIN_BLOCKS)

// Keys of 16 bits take the packed sweep (tiles 64 pixels wide, WARPS x RPT rows), 32-bit keys
// the scalar one. The body of the histogram kernels: the pixels for which counts(z, y, x) holds
// are counted.
template <typename In, typename Cmp, typename K, int NDIM, bool TCONN, int RPT, class Region>
__device__ __forceinline__ void
histogram_tiles(const In* __restrict__ image, const Bounds<Cmp>* __restrict__ thresholds,
                long long* __restrict__ hist, i64 nz, i64 ny, i64 nx, int zchunk, int blocks_per_image,
                int T, int estimate, double t0, double inv_dt, int table_in_smem, int hist_copies,
                const Region& counts, unsigned* __restrict__ done, bool block_prefix = false) {
    extern __shared__ __align__(16) unsigned char dynamic_smem[];

    // The packed sweep's tables of 4-byte comparison values (at most PACKED_MAX_BINS + 1
    // entries, 32 KB) are always in shared memory (_ecc_cupy.threshold_table_in_shared), known
    // here at compile time: the bins' reads are then shared loads, not generic ones with 64-bit
    // addresses (with the estimate's one step, float32 volumes 3-9 % faster, 2D float32 images
    // 3-10 %, float16 17 %, uint16 volumes 10 %; H100, benchmarks/RESULTS.md, fifty-fifth
    // session). Larger tables (8-byte values) stay where the host puts them.
    constexpr bool TABLE_IN_SMEM = TABLE_ALWAYS_IN_SMEM<Cmp, K>;
    const Bounds<Cmp>* tab = thresholds;
    int* hist_s = nullptr;
    size_t offset = 0;
    if (TABLE_IN_SMEM || table_in_smem) {
        Bounds<Cmp>* t = reinterpret_cast<Bounds<Cmp>*>(dynamic_smem);
        for (int i = threadIdx.x; i <= T; i += THREADS) t[i] = thresholds[i];
        tab = t;
        offset = ((size_t)(T + 1) * sizeof(Bounds<Cmp>) + 15) & ~(size_t)15;
    }
    if (hist_copies) {
        hist_s = reinterpret_cast<int*>(dynamic_smem + offset);
        for (int i = threadIdx.x; i < T * hist_copies; i += THREADS) hist_s[i] = 0;
    }
    __shared__ K byte_bins[sizeof(In) == 1 ? 256 : 1];
    __shared__ int byte_not_bin;  // one-byte inputs: some byte's bin is not the byte
    if (sizeof(In) == 1 && threadIdx.x == 0) byte_not_bin = 0;
    __syncthreads();  // the table must be complete
    const ThresholdBins<Cmp, TABLE_IN_SMEM> bins(tab, T, estimate, t0, inv_dt, Region::SPARE_REGISTERS);
    // (The masked 3D histograms, short of registers, spilled twice as much with the bytes' own
    // path: they keep the table.)
    bool bytes_are_bins = false;
    if constexpr (sizeof(In) == 1) {
        static_assert(THREADS % 32 == 0 && 256 % THREADS == 0, "whole warps build the table");
        for (int i = threadIdx.x; i < 256; i += THREADS) {
            const K k = (K)bins(convert<Cmp>((In)i));
            byte_bins[i] = k;
            // one shared atomic a warp at most: one a thread would queue up to 256 on one word
            if (__any_sync(0xffffffffu, k != (K)i) && threadIdx.x % 32 == 0) atomicOr(&byte_not_bin, 1);
        }
        __syncthreads();
        bytes_are_bins = Region::SPARE_REGISTERS && byte_not_bin == 0;
    }

    const i64 img = blockIdx.x / blocks_per_image;
    const int chunk = blockIdx.x % blocks_per_image;
    BinKey<In, Cmp, K> key_of{{image}, bins, byte_bins, bytes_are_bins};
    // 16-bit keys: T <= HIST_SMEM_MAX_BINS, so hist_copies >= 1 (_ecc_cupy.HistogramPlan)
    HistSink<sizeof(K) == 2> sink{hist + img * T, T,
                                  shared_address(hist_s + (threadIdx.x & 31 & (hist_copies - 1))),
                                  4u * (unsigned)hist_copies};
    if constexpr (sizeof(K) == 2) {
        // 16-byte aligned: load_plane stores the packed rows as uint2
        __shared__ __align__(16) unsigned words[NDIM == 3 ? 3 : 1][packed::Rows<RPT>::PLANEW];
        packed::sweep<NDIM, TCONN, RPT>(words, nz, ny, nx, zchunk, img * nz * ny * nx, chunk,
                                        blocks_per_image, key_of, sink, counts);
    } else {
        __shared__ K tile[NDIM == 3 ? 3 : 1][PLANE];
        sweep<NDIM, TCONN, K>(tile, nz, ny, nx, zchunk, img * nz * ny * nx, chunk, blocks_per_image,
                              key_of, sink, counts);
    }

    long long* row = hist + img * T;
    if (hist_copies && block_prefix) {
        // Every block adds its own cumulative histogram: the sum over blocks is the curve, so
        // no block waits for the others and no last block cumulates the row afterwards (the
        // tail of a one-wave launch). Costs one atomic per bin from the block's first non-zero
        // partial sum on, so the host takes it only where blocks fill most of their bins
        // (_ecc_cupy.BLOCK_PREFIX_MIN_PIXELS).
        // |partial sums| <= 7 x the block's pixels < 2^31 (MAX_PIXELS_PER_BLOCK).
        __shared__ int warp_sums[WARPS];
        const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
        int carry = 0;
        __syncthreads();
        for (int base = 0; base < T; base += THREADS) {
            const int k = base + threadIdx.x;
            int v = k < T ? bin_total(hist_s, k, hist_copies) : 0;
#pragma unroll
            for (int d = 1; d < 32; d <<= 1) {
                const int n = __shfl_up_sync(0xffffffffu, v, d);
                if (lane >= d) v += n;
            }
            if (lane == 31) warp_sums[warp] = v;
            __syncthreads();
            int before = carry, total = 0;
#pragma unroll
            for (int w = 0; w < WARPS; ++w) {
                const int sw = warp_sums[w];
                if (w < warp) before += sw;
                total += sw;
            }
            v += before;
            if (k < T && v != 0) atomicAdd(reinterpret_cast<u64*>(row + k), (u64)(i64)v);
            carry += total;
            __syncthreads();  // warp_sums is rewritten by the next round
        }
        return;
    }
    if (hist_copies) {
        __syncthreads();
        for (int k = threadIdx.x; k < T; k += THREADS) {
            const int h = bin_total(hist_s, k, hist_copies);
            if (h != 0) atomicAdd(reinterpret_cast<u64*>(row + k), (u64)(i64)h);
        }
    }
    if (done != nullptr) {
        // The image's last block to finish turns its row into the cumulative curve: no second
        // launch (ecc_cumsum, 2.5 of a 1024^2 call's 17 us; the call measured ~4 % faster).
        // Every block has counted by then, so it leaves the counter zeroed for the next call
        // (the plan keeps the counters: no memset a call).
        if (last_block_done(done + img, (unsigned)blocks_per_image) && threadIdx.x < 32) {
            if (threadIdx.x == 0) done[img] = 0u;
            warp_row_prefix_sum(row, T, [row](int k, long long sum) { row[k] = sum; });
        }
    }
}

// The ECC histograms: each block adds the contributions of its tiles of one image to hist
// (rows, T). cumulate 1: hist and done (one counter per row) start zeroed and the last block
// of each image to finish makes its row cumulative (the ECC curve) and leaves done zeroed; 2: hist starts zeroed and
// every block adds its own cumulative histogram (the same curve; done is not touched); 0:
// hist accumulates (blocks of one volume added by several launches), done is not touched.
// RPT: rows per thread of the packed sweep's tiles. 2D images of many tiles take 8 (64 rows):
// a tile's fixed work (its walk, the plane's row ends and barrier, the window's first rows) was
// ~11 of a 2D pixel's instructions at 32 rows; smaller ones keep 4, which gives their one wave
// twice the blocks (_ecc_cupy.HIST_TALL_ROWS).
template <typename In, typename Cmp, typename K, int NDIM, bool TCONN, int RPT = PY>
__global__ void __launch_bounds__(THREADS, CUTOPO_ECC_BLOCKS(NDIM))
ecc_histogram(const In* __restrict__ image, const Bounds<Cmp>* __restrict__ thresholds,
              long long* __restrict__ hist, i64 nz, i64 ny, i64 nx, int zchunk, int blocks_per_image,
              int T, int estimate, double t0, double inv_dt, int table_in_smem, int hist_copies,
              unsigned* __restrict__ done, int cumulate) {
    histogram_tiles<In, Cmp, K, NDIM, TCONN, RPT>(image, thresholds, hist, nz, ny, nx, zchunk,
                                                  blocks_per_image, T, estimate, t0, inv_dt,
                                                  table_in_smem, hist_copies, AllPixels(),
                                                  cumulate == 1 ? done : nullptr, cumulate == 2);
}

// The same histogram, adding only the pixels whose coordinates are marked in the per-axis masks
// own_z (nz bytes; one byte in 2D), own_y (ny) and own_x (nx): a block of a larger volume swept
// together with its halo (cutopo/_stream.py, cutopo/dask.py). hist accumulates: launches on the
// blocks of one volume may add into the same rows.
template <typename In, typename Cmp, typename K, int NDIM, bool TCONN>
__global__ void __launch_bounds__(THREADS, CUTOPO_ECC_MIN_BLOCKS_MASKED)
ecc_histogram_masked(const In* __restrict__ image,
                     const Bounds<Cmp>* __restrict__ thresholds,
                     long long* __restrict__ hist, i64 nz, i64 ny, i64 nx, int zchunk,
                     int blocks_per_image, int T, int estimate, double t0, double inv_dt,
                     int table_in_smem, int hist_copies, const unsigned char* __restrict__ own_z,
                     const unsigned char* __restrict__ own_y, const unsigned char* __restrict__ own_x) {
    histogram_tiles<In, Cmp, K, NDIM, TCONN, PY>(image, thresholds, hist, nz, ny, nx, zchunk,
                                                 blocks_per_image, T, estimate, t0, inv_dt,
                                                 table_in_smem, hist_copies,
                                                 MaskedPixels{own_z, own_y, own_x, ny, nx}, nullptr);
}

// In-place inclusive prefix sum of each row of hist (rows, T); one warp per row.
__global__ void __launch_bounds__(THREADS) ecc_cumsum(long long* __restrict__ hist, i64 rows, int T) {
    const i64 row = (i64)blockIdx.x * WARPS + threadIdx.x / 32;
    if (row >= rows) return;  // whole warps leave together: no block barrier below
    long long* h = hist + row * T;
    warp_row_prefix_sum(h, T, [h](int k, long long sum) { h[k] = sum; });
}

// -- the finite value range of an image (linear_thresholds) ------------------------------------

// Order key of a value (common.cuh order_key, widened) and whether the value is finite (its
// exponent bits not all ones: a test of the bits, which -ftz=true leaves alone; denormals are
// finite values like any other).
template <typename In>
__device__ __forceinline__ bool finite_key(In v, u64& key) {
    key = (u64)order_key(v);
    return true;
}
template <>
__device__ __forceinline__ bool finite_key<float>(float v, u64& key) {
    key = order_key(v);
    return (__float_as_uint(v) & 0x7f800000u) != 0x7f800000u;
}
template <>
__device__ __forceinline__ bool finite_key<half>(half v, u64& key) {
    return finite_key(half_to_float(v), key);  // exact: every float16 is a float32
}
template <>
__device__ __forceinline__ bool finite_key<double>(double v, u64& key) {
    key = order_key(v);
    return ((u64)__double_as_longlong(v) & 0x7ff0000000000000ULL) != 0x7ff0000000000000ULL;
}

// One element into the running extremes (not_lo: the largest ~key, hi: the largest key).
template <typename In>
__device__ __forceinline__ void range_add(In v, u64& not_lo, u64& hi) {
    u64 key;
    if (finite_key(v, key)) {
        not_lo = max(not_lo, ~key);
        hi = max(hi, key);
    }
}

constexpr int RANGE_UNROLL = 2;  // 16-byte loads in flight per thread and iteration

// range[0] = max over the finite values of ~key, range[1] = max of key, from range zeroed:
// the smallest and largest finite value as order keys (range[0] stays 0 when no value is
// finite). One pass over the image in 16-byte loads where it is 16-byte aligned, and no
// temporaries, where min/max through isfinite and where made four passes and two image-sized
// temporaries.
template <typename In>
__global__ void __launch_bounds__(THREADS)
finite_range(const In* __restrict__ image, i64 n, u64* __restrict__ range) {
    constexpr int VEC = 16 / sizeof(In);
    u64 not_lo = 0, hi = 0;
    const i64 tid = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    const i64 stride = (i64)gridDim.x * blockDim.x;
    i64 head = 0;  // elements before this are read as vectors
    if (reinterpret_cast<size_t>(image) % 16 == 0) {
        const i64 vectors = n / VEC;
        const uint4* v = reinterpret_cast<const uint4*>(image);
        for (i64 base = tid; base < vectors; base += stride * RANGE_UNROLL) {
            uint4 raw[RANGE_UNROLL];
#pragma unroll
            for (int u = 0; u < RANGE_UNROLL; ++u)
                if (base + u * stride < vectors) raw[u] = __ldg(v + base + u * stride);
#pragma unroll
            for (int u = 0; u < RANGE_UNROLL; ++u) {
                if (base + u * stride >= vectors) continue;
                const In* px = reinterpret_cast<const In*>(&raw[u]);
#pragma unroll
                for (int k = 0; k < VEC; ++k) range_add(px[k], not_lo, hi);
            }
        }
        head = vectors * VEC;
    }
    for (i64 i = head + tid; i < n; i += stride) range_add(image[i], not_lo, hi);
#pragma unroll
    for (int d = 16; d > 0; d >>= 1) {
        not_lo = max(not_lo, __shfl_xor_sync(0xffffffffu, not_lo, d));
        hi = max(hi, __shfl_xor_sync(0xffffffffu, hi, d));
    }
    if (threadIdx.x % 32 == 0 && not_lo != 0) {
        atomicMax(range, not_lo);
        atomicMax(range + 1, hi);
    }
}

template <typename In, typename K>
struct ValueKey : Reads16<In> {
    __device__ __forceinline__ K operator()(i64 i) const { return (K)order_key(this->image[i]); }
    // The key of pixel k of a 16-byte read.
    __device__ __forceinline__ K key_in(uint4 raw, int k) const { return (K)order_key(this->value_in(raw, k)); }
};

struct MapSink {
    signed char* out;
    __device__ __forceinline__ void operator()(int c, u64, i64 i) const { out[i] = (signed char)c; }
};

// The int8 contribution map c(p) under the order (value, linear index), NaN as +inf; of the
// box complex, or of the torus with PERIODIC (every axis >= 3).
template <typename In, typename K, int NDIM, bool TCONN, bool PERIODIC = false>
__global__ void __launch_bounds__(THREADS)
ecc_contributions(const In* __restrict__ image, signed char* __restrict__ out, i64 nz, i64 ny,
                  i64 nx, int zchunk, int blocks_per_image) {
    __shared__ K tile[NDIM == 3 ? 3 : 1][PLANE];
    const i64 img = blockIdx.x / blocks_per_image;
    const int chunk = blockIdx.x % blocks_per_image;
    ValueKey<In, K> key_of{{image}};
    MapSink sink{out};
    sweep<NDIM, TCONN, K>(tile, nz, ny, nx, zchunk, img * nz * ny * nx, chunk, blocks_per_image,
                          key_of, sink, AllPixels(), Boundary<PERIODIC>());
}

}  // namespace ecc
}  // namespace cutopo
#include "ecc_band.cuh"
#include "ecc_soft.cuh"
#include "ecc_expected.cuh"
