// Soft ECC in one pass over the image, forward and backward (cutopo/_soft_ecc_cupy.py).
//
// The contribution map is never written: ecc.cu's sweep hands every pixel's c(p) to a sink that
// queues the critical ones (c != 0) of the warp's rows in shared memory, and after the rows of
// each plane the warp evaluates their bands with ecc_band.cuh's forward_warp / backward_warp,
// 32 queued pixels at a time (most pixels of a smooth image have c = 0: one pixel per lane
// would leave most lanes idle in the band loops). The queue keeps the sweep's pixel order, so
// consecutive entries of a warp are neighbours with nearby values and their bands mostly fall
// in one register window (Window in ecc_band.cuh).
//
// The map and the band kernel were two launches (plus a third for the curve, a fourth for the
// thresholds' cotangent): at 1024^2 the call was bound by those launches on the host, and the
// map's 1 byte per pixel was written and read back twice per forward+VJP.
//
// The forward's last block of each image turns the image's accumulators into its curve; the
// backward's last block of the grid scales the thresholds' cotangent by lambda and writes both
// scalar-shaped cotangents in the dtypes the caller asked for (the one rounding of each).
//
// The forward also keeps the critical pixels whose band is not empty (KeptEntries: flat index
// and c, in the order the warps met them, so consecutive entries are still neighbours), up to a
// capacity per image. The backward of an image whose entries all fit reads that list instead
// of sweeping the image again: at 1024^2 about 5 % of the pixels are critical, and most of
// the sweep's instructions (tile loads, contributions, queues) are per pixel, not per entry.
// Its warps take short runs of consecutive entries; an image whose list overflowed is swept.
// Included at the end of ecc.cu, after ecc_band.cuh.
#pragma once
#include "common.cuh"

namespace cutopo {
namespace ecc {
namespace band {

constexpr int ROW_SLOTS = TX * PY;  // pixels of a warp's rows per plane: 32 columns x PY rows

// Blocks per multiprocessor the sweep kernels' register budget is sized for (-D options of the
// A/B runs). Measured on the H200 (benchmarks/RESULTS.md, seventeenth session) for float32 with
// 32-bit keys: 6 in 2D (40 registers; 32 at 7 or 8 was 1-7 % slower at 1024^2, up to 7 % faster
// at 64 x 256^2), 5 in 3D (48 registers; 2-30 % faster than 40 or 32 at 256^3); asked for 1
// block, ptxas took 80 (2D) and 96 (3D) registers and ran 16-40 % slower. float64, 64-bit keys
// (int32 and float64 images) and the torus (its tie-break flips) spilled up to 356 bytes at
// those budgets: they take 2 (up to 128 registers).
#ifndef CUTOPO_SOFT_MIN_BLOCKS_2D
#define CUTOPO_SOFT_MIN_BLOCKS_2D 6
#endif
#ifndef CUTOPO_SOFT_MIN_BLOCKS_3D
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
#define CUTOPO_SOFT_MIN_BLOCKS_3D 3  // sm_80 spilled up to 136 bytes at 5, 100 at 4 (not timed there)
#else
#define CUTOPO_SOFT_MIN_BLOCKS_3D 5
#endif
#endif
#ifndef CUTOPO_SOFT_MIN_BLOCKS_WIDE
#define CUTOPO_SOFT_MIN_BLOCKS_WIDE 2
#endif
template <typename Real, typename K, int NDIM, bool PERIODIC>
constexpr int soft_min_blocks() {
    return (sizeof(Real) == 8 || sizeof(K) == 8 || PERIODIC) ? CUTOPO_SOFT_MIN_BLOCKS_WIDE
           : NDIM == 3                           ? CUTOPO_SOFT_MIN_BLOCKS_3D
                                                 : CUTOPO_SOFT_MIN_BLOCKS_2D;
}

// ... and of the listed backward's float32 instances (their transposed passes, below): at the
// sweep's 40 registers (2D) the 2D instance spilled 180 bytes.
#ifndef CUTOPO_SOFT_LISTED_MIN_BLOCKS
#define CUTOPO_SOFT_LISTED_MIN_BLOCKS 4
#endif
template <typename Real, typename K, int NDIM, bool PERIODIC, bool LISTED>
constexpr int soft_backward_min_blocks() {
    constexpr int sweep = soft_min_blocks<Real, K, NDIM, PERIODIC>();
    return LISTED && sizeof(Real) == 4 && CUTOPO_SOFT_LISTED_MIN_BLOCKS < sweep ? CUTOPO_SOFT_LISTED_MIN_BLOCKS
                                                                               : sweep;
}

// Blocks per multiprocessor of the packed forward (packed_soft_forward instances): 4 (64
// registers, the band code inlined) measured 8 % faster than 6 at 1024^2 and 6 % at 64 x 256^2
// (float32; RESULTS.md, twentieth session); it still spills 80-184 bytes, 5 and 6 more.
#ifndef CUTOPO_SOFT_PACKED_MIN_BLOCKS
#define CUTOPO_SOFT_PACKED_MIN_BLOCKS 4
#endif

// Per warp: the contribution of each pixel the sink saw this plane (slot = call * 32 + lane),
// the flat index of the critical ones, and the compacted order of the critical slots.
struct RowQueues {
    signed char c[WARPS][ROW_SLOTS];
    unsigned char order[WARPS][ROW_SLOTS];
    i64 index[WARPS][ROW_SLOTS];
};

// The 3D forward's block-wide queue of critical voxels (RowBands): a ring of CAP entries
// (KeptEntries::pack(i, c)), entries [head, tail) waiting; ``tail`` counts every entry put,
// ``head`` (each thread's copy in RowBands) every entry taken.
template <int CAP>
struct BlockQueue {
    static_assert((CAP & (CAP - 1)) == 0, "a power of two");
    unsigned long long e[CAP];
    unsigned tail;
};

// Entries waiting in the 3D forward's block queue that start a round of batches during the
// sweep (RowBands::drain; at least 32 * WARPS): 256, a round as soon as there is one. 512 (a
// block of a 256^3 volume then keeps its ~240 entries to the end) ran the same within 1 %
// (H200, benchmarks/RESULTS.md, thirty-fifth session).
#ifndef CUTOPO_SOFT_QUEUE_DRAIN
#define CUTOPO_SOFT_QUEUE_DRAIN 256
#endif

// Ring entries of the 3D forward's block queue: 8 KiB for 32-bit keys; 2 KiB for 64-bit ones,
// whose planes take twice the shared memory (48 KiB static at most).
template <typename K>
constexpr int block_queue_cap() { return sizeof(K) == 4 ? 1024 : 256; }

// The workspace of the forward: a counter per image of the blocks done, a counter per image of
// the entries met (KeptEntries), the band sums (rows, T) float64 and the difference arrays
// (rows, T) int64. Zeroed when made; the forward's last block of each image zeroes its parts
// again once read, so the host keeps one workspace per thread and stream (kernels on one
// stream run in order) and a call needs neither an allocation nor a memset for it.
struct ForwardWorkspace {
    unsigned* done;
    unsigned long long* met;
    double* acc;
    long long* sat;

    __device__ __forceinline__ ForwardWorkspace(unsigned long long* ws, i64 rows, int T) {
        done = reinterpret_cast<unsigned*>(ws);
        met = ws + (rows + 1) / 2;
        acc = reinterpret_cast<double*>(met + rows);
        sat = reinterpret_cast<long long*>(acc + rows * T);
    }

    // By one warp of the image's last block: out_row = the image's curve (write_soft_row), then
    // the image's accumulators and block counter zeroed for the next launch on the workspace
    // (every other block of the image has finished).
    template <typename Real>
    __device__ __forceinline__ void finish_row(i64 img, int T, Real* out_row) const {
        double* acc_row = acc + img * T;
        long long* sat_row = sat + img * T;
        write_soft_row(sat_row, acc_row, out_row, T);
        __syncwarp();
        for (int k = threadIdx.x % 32; k < T; k += 32) {
            acc_row[k] = 0.0;
            sat_row[k] = 0;
        }
        if (threadIdx.x % 32 == 0) done[img] = 0u;
    }
};

// Words of a ForwardWorkspace (the host allocates this many 8-byte words).
__host__ __device__ inline i64 forward_workspace_words(i64 rows, int T) {
    return (rows + 1) / 2 + rows + 2 * rows * (i64)T;
}

// The entries a forward keeps for its backward, in one uint64 array made per call: the count
// of each image's entries (rows words, written by the image's last block; more than ``cap``
// means the list overflowed and holds only the first ``cap``), then ``cap`` slots per image,
// each (flat index << 8) | (c & 0xff) (|c| <= 127 in 2D and 3D). Null: nothing kept.
struct KeptEntries {
    unsigned long long* data;
    i64 cap;

    __device__ __forceinline__ unsigned long long* slots(i64 img, i64 rows) const {
        return data + rows + img * cap;
    }
    __device__ __forceinline__ static unsigned long long pack(i64 i, int c) {
        return ((unsigned long long)i << 8) | (unsigned long long)(c & 0xff);
    }
    __device__ __forceinline__ static i64 index(unsigned long long v) { return (i64)(v >> 8); }
    __device__ __forceinline__ static int contribution(unsigned long long v) {
        return (int)(signed char)(v & 0xffu);
    }
};

// The check of device thresholds, by one block (a block-uniform call): writes
// (token << 2) | flags into the page-locked host word ``word`` (bit 0: a value is not finite,
// bit 1: some t[k + 1] < t[k]), so the host reads it while the rest of the sweep runs
// (cutopo._cuda.deferred.PinnedWord; a separate check kernel, its copy and its event cost ~20 us
// of host time per call). The token tells this launch's flags from a late
// write of an earlier, abandoned one. The forward stays in bounds on bad thresholds (band
// edges are clamped to [0, T]); its result is then never returned. Not inlined: inlined, it
// changed the sweep's register allocation (136 bytes of spill loads in the 2D float32 forward
// at its 40-register budget, none as a call).
template <typename Real>
__device__ __noinline__ void report_thresholds(const Real* t, int T,
                                                  unsigned long long* word, long long token) {
    __shared__ unsigned warp_bad[WARPS];
    unsigned bad = 0;
    for (int k = threadIdx.x; k < T; k += THREADS) {
        const Real v = t[k];
        if (!isfinite(v)) bad |= 1u;
        if (k + 1 < T && t[k + 1] < v) bad |= 2u;
    }
    bad = __reduce_or_sync(FULL, bad);
    if (threadIdx.x % 32 == 0) warp_bad[threadIdx.x / 32] = bad;
    __syncthreads();
    if (threadIdx.x == 0) {
        unsigned all = 0;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) all |= warp_bad[w];
        // a volatile store is a relaxed system-scope one: it reaches the host without a fence
        // (a fence would only make this warp wait for it)
        *reinterpret_cast<volatile unsigned long long*>(word) =
            ((unsigned long long)token << 2) | all;
    }
}

// The sink and rows hook of the sweep (one object for both): queues the critical pixels of
// the warp's rows, then runs Work::entries(valid, f, c, i) over them, 32 at a time, in every
// lane of the warp. ``calls`` counts the sink's calls in this thread this plane (at most PY).
// With a block queue (QCAP > 0, the 3D forward), a warp puts its plane's entries into the
// block's ring instead; at the start of a plane step, once CUTOPO_SOFT_QUEUE_DRAIN entries
// wait, the block's warps take the whole rounds of 32 x WARPS waiting, a batch of 32 each, and
// finish() deals what is left after the sweep evenly over the warps. Run by the warp whose
// rows held them, as before, the band work of a plane fell unevenly on the warps: bench_soft's
// smooth 256^3 volume puts ~2.4 critical voxels in a warp's rows of a plane, and its warps
// spent 31 % of their cycles waiting at the sweep's barriers (Nsight Compute, H100). With the
// ring (and the chunk lengths of _ecc_cupy.sweep_geometry) a smooth 512^3 volume's
// forward ran 20 % faster (32-plane chunks), white noise 4 %, 256^3 and 128^3 the same, a
// batch of 4 x 96^3 5 % slower (H100, benchmarks/RESULTS.md, thirty-fifth session). A ring
// too full for a warp's entries: the warp runs them at its next step. Without: 2D tiles,
// which hold a warp's rows once, and the backward's sweep, which runs only on images whose
// kept list overflowed (noise-like: their planes fill whole batches).
template <typename In, typename Real, class Work, int QCAP>
struct RowBands {
    static constexpr bool STOPS = false;
    RowQueues* q;
    const In* image;
    Work work;
    mutable int calls;
    BlockQueue<QCAP == 0 ? 1 : QCAP>* block;  // QCAP > 0
    mutable unsigned head;
    mutable int own;  // entries of the warp's last plane that the ring had no room for

    __device__ __forceinline__ void operator()(int c, u64, i64 i) const {
        const int slot = calls * 32 + threadIdx.x % 32;
        ++calls;
        RowQueues& r = *q;
        r.c[threadIdx.x / 32][slot] = (signed char)c;
        if (c != 0) r.index[threadIdx.x / 32][slot] = i;
        else work.skipped(i);
    }

    // Entries of the lanes below n (warp-uniform), each lane's (c, i).
    __device__ __forceinline__ void run(int n, int c, i64 i) const {
        const bool mine = threadIdx.x % 32 < n;
        const Real f = mine ? convert<Real>(image[i]) : Real(0);
        work.entries(mine, mine && !no_entry(f), f, c, i);
    }

    __device__ __forceinline__ void rows_done() const {
        const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
        RowQueues& r = *q;
        int n = 0;
#pragma unroll
        for (int s = 0; s < PY; ++s) {  // own slots only: no barrier needed before
            const int slot = s * 32 + lane;
            const bool critical = s < calls && r.c[warp][slot] != 0;
            const unsigned b = __ballot_sync(FULL, critical);
            if (critical) r.order[warp][n + __popc(b & ((1u << lane) - 1u))] = (unsigned char)slot;
            n += __popc(b);
        }
        calls = 0;
        __syncwarp();  // order and index of the other lanes
        if constexpr (QCAP == 0) {
            for (int base = 0; base < n; base += 32) {  // warp-uniform bounds: every lane takes part
                int c = 0;
                i64 i = 0;
                if (base + lane < n) {
                    const int slot = r.order[warp][base + lane];
                    c = r.c[warp][slot];
                    i = r.index[warp][slot];
                }
                run(min(32, n - base), c, i);
            }
        } else if (n > 0) {
            // Into the block's ring if it has room: lane 0 reserves [at, at + n) by
            // compare-and-swap only then (the live entries start at head, the same in every
            // thread between drain()'s barriers). Without room, they stay in r.order for the
            // warp's next drain(), before the next plane's sink rewrites it.
            unsigned at = 0;
            bool room = true;
            if (lane == 0) {
                at = block->tail;
                for (;;) {
                    if (at + (unsigned)n - head > (unsigned)QCAP) {
                        room = false;
                        break;
                    }
                    const unsigned seen = atomicCAS(&block->tail, at, at + (unsigned)n);
                    if (seen == at) break;
                    at = seen;
                }
            }
            at = __shfl_sync(FULL, at, 0);
            if (__shfl_sync(FULL, room, 0)) {
                for (int e = lane; e < n; e += 32) {
                    const int slot = r.order[warp][e];
                    block->e[(at + e) & (QCAP - 1)] = KeptEntries::pack(r.index[warp][slot], r.c[warp][slot]);
                }
            } else {
                own = n;
            }
        }
        __syncwarp();  // the next plane rewrites the queue
    }

    // The warp's batches: its own entries left in r.order (``own``), then ring batches warp,
    // warp + WARPS, ... of ``chunk`` entries each of the ring's first ``taken`` entries from
    // head; one call of run() (it inlines the whole band work). A batch runs its entries one
    // after the other (a band's thresholds across the lanes), so the entries are dealt evenly:
    // after a 128^3 sweep ~60 were left per block, and batches of 32 put them on two warps
    // (the forward 26 % slower than per-warp batches). No warp puts entries between the
    // barriers around a drain() (sweep), so every thread reads the same tail and advances head
    // alike.
    __device__ __forceinline__ void drain(bool all) const {
        const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
        const unsigned waiting = block->tail - head;
        // whole rounds of a batch of 32 per warp while sweeping, once CUTOPO_SOFT_QUEUE_DRAIN
        // entries wait (any fewer would fall on a few warps while the others wait at the next
        // barrier); everything after the sweep
        const unsigned taken = all ? waiting
                                   : waiting >= (unsigned)CUTOPO_SOFT_QUEUE_DRAIN
                                         ? waiting / (32 * WARPS) * (32 * WARPS) : 0u;
        const unsigned chunk = min(32u, (taken + WARPS - 1) / WARPS);
        const int own_batches = (own + 31) / 32;
        for (int b = 0;; ++b) {  // warp-uniform
            int n, c = 0;
            i64 i = 0;
            if (b < own_batches) {
                n = min(32, own - 32 * b);
                if (lane < n) {
                    const int slot = q->order[warp][32 * b + lane];
                    c = q->c[warp][slot];
                    i = q->index[warp][slot];
                }
            } else {
                const unsigned first = chunk * (unsigned)(warp + (b - own_batches) * WARPS);
                if (first >= taken) break;
                n = (int)min(chunk, taken - first);
                if (lane < n) {
                    const unsigned long long v = block->e[(head + first + lane) & (QCAP - 1)];
                    c = KeptEntries::contribution(v);
                    i = KeptEntries::index(v);
                }
            }
            run(n, c, i);
        }
        head += taken;
        own = 0;
    }

    // At the start of every plane step (QCAP > 0): whole rounds of the block's ring, and the
    // warp's entries it had no room for.
    __device__ __forceinline__ void step_begin() const {
        if constexpr (QCAP > 0) drain(false);
    }

    // What is left after the sweep (every thread of the block calls).
    __device__ __forceinline__ void finish() const {
        if constexpr (QCAP > 0) {
            __syncthreads();  // every warp's entries are in the ring or its r.order
            drain(true);
        }
    }
};

// ---------------------------------------------------------------------------------------------
// The 2D forward's packed sweep (ecc.cu's packed::sweep, two pixels per 32-bit word). The
// scalar sweep compares 32- or 64-bit value keys one neighbour and pixel at a time: half the
// 1024^2 forward's time (benchmarks/RESULTS.md, twentieth session).
//
// Keys: 15 bits of the value, by a monotone map (QuantKey), so that q's key below p's implies
// q's value below p's and the packed comparisons give every pixel whose keys all differ from
// its neighbours' the contribution of the exact order (value, then index). A pixel with a
// neighbour of equal key (a tie in 15 bits: equal values, values closer than the map's step,
// values clamped at either end, NaN and +inf) is marked TIED and its contribution recomputed
// from the image with the exact keys (exact_contribution) when its warp takes its queue. One-
// byte inputs are their own keys: exact, no ties to mark.
// ---------------------------------------------------------------------------------------------

template <bool C, typename A, typename B> struct Select { typedef A type; };
template <typename A, typename B> struct Select<false, A, B> { typedef B type; };
template <typename T> struct IsFloatInput { static constexpr bool value = false; };
template <> struct IsFloatInput<float> { static constexpr bool value = true; };
template <> struct IsFloatInput<double> { static constexpr bool value = true; };
template <> struct IsFloatInput<half> { static constexpr bool value = true; };

// Which forward instances take the packed sweep: 2D floating-point and one-byte inputs in the
// box (the packed sweep has no torus). 16- and 32-bit integer inputs keep the scalar sweep:
// their values are dense in 15 bits only for small ranges. 3D keeps it too: 15 bits are too
// few for 26 neighbours. At 256^3 float32 0.8 % of a smooth volume's voxels tie, but 82 % of
// a warp's planes hold one, resolved on one or two lanes: the packed forward took 0.48 ms
// against the scalar's 0.375 (0.255 with the ties ignored, results then wrong). Queued per
// warp and resolved 32 at a time, the ties still cost 0.37 ms at 256^3 and 3.05 at 512^3
// (scalar 2.60; 2.18 with the queue's resolution dropped, 40k of 2.49M entries then wrong):
// the larger volume ties more, and the tie code's registers spill (64 per thread at 4 blocks,
// 13x the scalar's local-memory traffic). Measured on the H200, benchmarks/RESULTS.md,
// twenty-first session. Mirrored by cutopo/_soft_ecc_cupy.py (packed_forward), which sizes
// the launch for it.
template <typename In, int NDIM, bool PERIODIC>
constexpr bool packed_soft_forward() {
    return NDIM == 2 && !PERIODIC && (sizeof(In) == 1 || IsFloatInput<In>::value);
}

constexpr unsigned QUANT_TOP = 32765u;  // the largest quantized key (below packed::OUTSIDE)

// Packed-sweep keys of a forward (packed::sweep's KeyOf): round(clamp(v * inv + off, 0, TOP))
// in float (double for float64 images), monotone in v (an FMA with a positive factor, a clamp
// and a rounding each are), NaN to the top (fmin returns its other operand). The rounding adds
// 1.5 * 2^23 (2^52): the key is then the low 16 bits of the sum's bit pattern, so two pixels
// pack into a word with one byte permute. inv and off map [t_0, t_{T-1}], widened by 1/16 of
// its span at each end, onto [0, TOP] (from_thresholds; every block computes the same).
template <typename In>
struct QuantKey : Reads16<In> {
    using Reads16<In>::VEC;
    using Reads16<In>::image;
    // packed::sweep reads plane rows one 16-byte read at a time: grouped reads spilled the
    // fused forward's registers (ptxas: 92 -> 148 bytes of stores in float32).
    static constexpr bool GROUP_READS = false;
    static constexpr bool EXACT = sizeof(In) == 1;
    typedef typename Select<sizeof(In) == 8, double, float>::type Q;
    Q inv, off;

    template <typename Real>
    __device__ __forceinline__ static QuantKey from_thresholds(const In* image, const Real* t, int T) {
        const Q a = (Q)t[0], b = (Q)t[T - 1];
        const Q span = b - a;
        Q inv = (Q)QUANT_TOP / (span + span / (Q)8);
        Q off = -(a - span / (Q)16) * inv;
        // one threshold, equal or non-finite ones: any positive factor keeps the map monotone
        // (most pixels then tie, and take the exact contribution)
        if (!(span > (Q)0) || !isfinite(inv) || !isfinite(off) || !(inv > (Q)0)) {
            inv = (Q)1;
            off = (Q)(QUANT_TOP / 2);
        }
        return QuantKey{{image}, inv, off};
    }
    // A word whose low 16 bits are the key of x.
    __device__ __forceinline__ unsigned raw(In x) const {
        if constexpr (EXACT) {
            return (unsigned)(unsigned char)x;
        } else if constexpr (sizeof(Q) == 8) {
            const double u = fmax(fmin(fma((double)x, inv, off), (double)QUANT_TOP), 0.0);
            return (unsigned)__double2loint(u + 6755399441055744.0);
        } else {
            const float u = fmaxf(fminf(__fmaf_rn(convert<float>(x), inv, off), (float)QUANT_TOP), 0.0f);
            return __float_as_uint(__fadd_rn(u, 12582912.0f));
        }
    }
    __device__ __forceinline__ unsigned operator()(i64 i) const { return raw(image[i]) & 0xffffu; }
    // The VEC keys of a 16-byte read, two per word.
    __device__ __forceinline__ void pack(uint4 raw16, unsigned (&packed)[VEC / 2]) const {
#pragma unroll
        for (int k = 0; k < VEC / 2; ++k)
            packed[k] = __byte_perm(raw(this->value_in(raw16, 2 * k)), raw(this->value_in(raw16, 2 * k + 1)), 0x5410);
    }
};

// c(p) of pixel (z, y, x) from the image's exact value keys (ecc.cu's contribution, as the
// scalar sweep computes it), for a pixel marked TIED. Not inlined: few lanes ever take it,
// and its keys and addresses would share the band code's registers.
template <typename In, typename K, int NDIM, bool TCONN>
__device__ __noinline__ int exact_contribution(const In* image, i64 base, i64 z, i64 y, i64 x,
                                                i64 nz, i64 ny, i64 nx) {
    K nb[pow3(NDIM)];
#pragma unroll
    for (int j = 0; j < pow3(NDIM); ++j) {
        const i64 zz = NDIM == 3 ? z + digit<NDIM>(j, 0) : 0;
        const i64 yy = y + digit<NDIM>(j, NDIM - 2);
        const i64 xx = x + digit<NDIM>(j, NDIM - 1);
        const bool inside = (u64)zz < (u64)nz && (u64)yy < (u64)ny && (u64)xx < (u64)nx;
        nb[j] = inside ? (K)order_key(image[base + (zz * ny + yy) * nx + xx]) : all_ones<K>();
    }
    return contribution<NDIM, TCONN>(nb);
}

constexpr int PACKED_SLOTS = 2 * 32 * PY;  // pixels of a warp's rows per plane (64 columns x PY)
constexpr int TIED = -128;                 // a slot's mark: the contribution is recomputed

// Per warp: each slot's contribution (0 for pixels past the image, TIED), slot (2 j + h) * 32
// + lane for the pixel x0 + 2 lane + h of the thread's row j; the compacted order of the
// non-zero ones. A slot's position follows from its number: no index is queued.
struct PackedQueues {
    signed char c[WARPS][PACKED_SLOTS];
    unsigned char order[WARPS][PACKED_SLOTS];
};

// Replaces the TIED marks among a warp's n queued slots (as packed_bands reads them) by the
// pixels' exact contributions, before the band code runs.
template <typename In, typename K, int NDIM, bool TCONN>
__device__ __forceinline__ void resolve_ties(signed char* c_slots, const unsigned char* order, int n,
                                             const In* image, i64 base, i64 z, i64 y, i64 x0,
                                             i64 nz, i64 ny, i64 nx) {
    const int lane = threadIdx.x % 32;
    for (int first = 0; first < n; first += 32) {  // warp-uniform bounds
        const int slot = first + lane < n ? order[first + lane] : 0;
        const bool tied = first + lane < n && c_slots[slot] == TIED;
        if (__any_sync(FULL, tied) && tied)
            c_slots[slot] = (signed char)exact_contribution<In, K, NDIM, TCONN>(
                image, base, z, y + (slot >> 6), x0 + 2 * (slot & 31) + ((slot >> 5) & 1), nz, ny, nx);
    }
    __syncwarp();  // the contributions of the other lanes' slots
}

// The band work of a warp's n queued slots (c, order: the warp's PackedQueues rows) of plane z,
// whose rows start at y (the tile's origin plus the warp's first row) and columns at x0.
template <typename In, typename K, typename Real, int NDIM, bool TCONN, class Work>
__device__ __forceinline__ void packed_bands(const signed char* c_slots, const unsigned char* order, int n,
                                          const In* image, i64 base, i64 z, i64 y, i64 x0, i64 nz,
                                          i64 ny, i64 nx, const Work* work_s, Window<Real, SOFT_PAIRS>* window) {
    const int lane = threadIdx.x % 32;
    Work work = *work_s;
    work.win = *window;
    for (int first = 0; first < n; first += 32) {  // warp-uniform bounds: every lane takes part
        const bool mine = first + lane < n;
        int c = 0;
        i64 i = 0, gy = 0, gx = 0;
        Real f = 0;
        if (mine) {
            const int slot = order[first + lane];
            c = c_slots[slot];
            gy = y + (slot >> 6);
            gx = x0 + 2 * (slot & 31) + ((slot >> 5) & 1);
            i = base + (z * ny + gy) * nx + gx;
            f = convert<Real>(image[i]);
        }
        work.entries(mine, mine && c != 0 && !no_entry(f), f, c, i);
    }
    *window = work.win;
}

// The sink and rows hook of the packed sweep (RowBands' counterpart; one object for both).
// The band work's parameters (one Work per block) and each thread's register window live in
// shared memory between planes (as KeptSink does): held in registers through the sweep, beside
// its neighbourhood and comparison words, they made the forward spill (3D float32: ~400 bytes
// at 48 registers; the form measured is this one).
template <typename In, typename K, typename Real, int NDIM, bool TCONN, class Work>
struct PackedRowBands {
    static constexpr bool WORDS = true;
    static constexpr bool TIES = !QuantKey<In>::EXACT;
    PackedQueues* q;
    const In* image;
    i64 base, nz, ny, nx;
    const Work* work_s;       // shared
    Window<Real, SOFT_PAIRS>* windows;    // shared, one per thread

    __device__ __forceinline__ void word(unsigned pos, unsigned neg, unsigned ties, i64, i64 gy,
                                         i64 gx, int j) const {
        constexpr int BASE = cell_sign<NDIM, TCONN>((pow3(NDIM) - 1) / 2);
        signed char* c = q->c[threadIdx.x / 32] + 64 * j + threadIdx.x % 32;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            int v = BASE + (int)((pos >> (16 * h)) & 0xffffu) - (int)((neg >> (16 * h)) & 0xffffu);
            if (TIES && ((ties >> (15 + 16 * h)) & 1u)) v = TIED;
            c[32 * h] = (gy < ny && gx + h < nx) ? (signed char)v : (signed char)0;
        }
    }

    __device__ __forceinline__ void rows_done(i64 z, i64 y0, i64 x0) const {
        const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
        PackedQueues& r = *q;
        int n = 0;
#pragma unroll
        for (int s = 0; s < 2 * PY; ++s) {  // own slots only: no barrier needed before
            const int slot = s * 32 + lane;
            const bool queued = r.c[warp][slot] != 0;
            const unsigned b = __ballot_sync(FULL, queued);
            if (queued) r.order[warp][n + __popc(b & ((1u << lane) - 1u))] = (unsigned char)slot;
            n += __popc(b);
        }
        __syncwarp();  // order and contributions of the other lanes
        if constexpr (TIES) {
            if (n > 0)
                resolve_ties<In, K, NDIM, TCONN>(r.c[warp], r.order[warp], n, image, base, z,
                                                 y0 + warp * PY, x0, nz, ny, nx);
        }
        if (n > 0)     // warp-uniform
            packed_bands<In, K, Real, NDIM, TCONN, Work>(r.c[warp], r.order[warp], n, image, base,
                                                         z, y0 + warp * PY, x0, nz, ny, nx,
                                                         work_s, windows + threadIdx.x);
        __syncwarp();  // the next plane rewrites the queue
    }
};

// Where a forward block keeps its image's entries: the image's slots of a KeptEntries (null:
// none kept), their counter in the workspace, the slots' number. In shared memory, set once per
// block: held in registers through the sweep, the three made the 3D forward spill more.
struct KeptSink {
    unsigned long long* slots;
    unsigned long long* met;
    i64 cap;
};
__shared__ KeptSink forward_kept;

// Whether a warp of the listing forward's block (soft_ecc_list_forward) found its image's list
// full, and that at the start of the current plane step (StopWhenFull).
struct ListState {
    bool overflowed, full;
};
__shared__ ListState list_state;

// Appends (i, c) of the lanes where ``keep`` to the block's image's kept list (forward_kept;
// none: nothing), one atomic per warp; past the capacity they are counted, not written (the
// list overflowed; NOTE: noted in list_state). Every lane calls (a warp-uniform loop).
template <bool NOTE = false>
__device__ __forceinline__ void keep_entries(bool keep, i64 i, int c) {
    unsigned long long* slots = forward_kept.slots;
    if (slots == nullptr) return;
    const unsigned b = __ballot_sync(FULL, keep);
    if (b == 0u) return;
    const int lane = threadIdx.x % 32;
    unsigned long long base = 0;
    if (lane == 0) base = atomicAdd(forward_kept.met, (unsigned long long)__popc(b));
    base = __shfl_sync(FULL, base, 0) + __popc(b & ((1u << lane) - 1u));
    if (keep) {
        if (base < (unsigned long long)forward_kept.cap) slots[base] = KeptEntries::pack(i, c);
        else if (NOTE) list_state.overflowed = true;
    }
}

// The band work of the sweep's critical pixels; the running state (the warp's register window,
// the lane's scale cotangent) is mutable: the sweep holds its sink by const reference.
template <typename Real>
struct ForwardWork {
    const Real* t;
    int T;
    Real lam;
    double w;
    Accum a;
    mutable Window<Real, SOFT_PAIRS> win;

    __device__ __forceinline__ void skipped(i64) const {}
    __device__ __forceinline__ void entries(bool, bool valid, Real f, int c, i64 i) const {
        keep_entries(forward_warp<Real>(valid, f, c, t, T, lam, w, true, a, win), i, c);
    }
};

// This warp's transposed rows (transposed_groups) in static shared memory, or null where a
// kernel takes the passes alone (double, whose bands are longer; or ON false).
template <typename Real, bool ON = true>
__device__ __forceinline__ Real* warp_transposed_rows() {
    if constexpr (ON && sizeof(Real) == 4) {
        __shared__ float rows[WARPS][transposed_warp_words<Real>()];
        return reinterpret_cast<Real*>(rows[threadIdx.x / 32]);
    } else {
        return nullptr;
    }
}

// The band work of the listed forward's kept entries (soft_ecc_listed_forward): ForwardWork's,
// transposed for the bands that fit a row (forward_listed_warp; buf: the warp's rows, null for
// double: the passes), nothing kept.
template <typename Real>
struct ListedForwardWork {
    const Real* t;
    int T;
    Real lam;
    double w;
    Accum a;
    Real* buf;
    mutable Window<Real, false> win;

    __device__ __forceinline__ void entries(bool, bool valid, Real f, int c, i64) const {
        forward_listed_warp<Real>(valid, f, c, t, T, lam, w, a, win, buf);
    }
};

// The listing forward's work (soft_ecc_list_forward): every critical pixel with a finite
// value into the kept list, band or not; no band work.
template <typename Real>
struct ListWork {
    __device__ __forceinline__ void skipped(i64) const {}
    __device__ __forceinline__ void entries(bool, bool valid, Real, int c, i64 i) const {
        keep_entries<true>(valid, i, c);
    }
};

// The listing forward's sweep hook: the rows' entries into the list (RowBands), and the sweep
// stopped once the image's list has overflowed, since the fused forward sweeps an overflowed
// image again (white noise at 256^3 listed to the end: the listed forward 24 % slower than the
// fused one, H100, benchmarks/RESULTS.md). A block learns of it from its own entries past the
// capacity (keep_entries<true>): thread 0 publishes that at a step's start, read by every
// thread after the step's barrier (block-uniform). White noise at 256^3 then took 10 % more
// time than the fused forward, smooth volumes 1 % more than listed to the end. Reading the
// image's count at every step instead (the address every warp's atomic takes), or at every
// fourth, made the smooth 256^3 and 512^3 forwards 4-9 % slower (H100, fortieth session).
template <class Bands>
struct StopWhenFull {
    static constexpr bool STOPS = true;
    const Bands& bands;
    __device__ __forceinline__ void rows_done() const { bands.rows_done(); }
    __device__ __forceinline__ void step_begin() const {
        if (threadIdx.x == 0) list_state.full = list_state.overflowed;
    }
    __device__ __forceinline__ bool stopped() const { return list_state.full; }
};

// The kept entries e[0 .. n) of one image dealt over the warps of its blocks_per_image blocks
// (the listed backward's and the listed forward's): batches of per_warp consecutive entries,
// the image's entries spread over all of its warps, at most 32. A warp walks its batch one
// entry after the other, so a short batch is a short chain, and about the sweep's share keeps
// a batch within a few of the sweep's warps, whose entries are neighbours (the register window
// seldom moves). n < 2^31: the host keeps kept_cap below (KEPT_MAX_BYTES).
struct ListedDeal {
    unsigned n, warps, per_warp;
    __device__ __forceinline__ ListedDeal(unsigned long long count, int blocks_per_image)
        : n((unsigned)count),
          warps((unsigned)min((i64)blocks_per_image * WARPS, (i64)1 << 24)),
          per_warp(min(max((n + warps - 1) / warps, 1u), 32u)) {}
    // Whether block ``chunk`` of the image has a batch.
    __device__ __forceinline__ bool busy(int chunk) const {
        return (unsigned long long)chunk * WARPS * per_warp < n;
    }
    // work.entries over the batches of this thread's warp in block ``chunk``; the entries' values
    // read from image (flat indices).
    template <typename Real, typename In, class Work>
    __device__ __forceinline__ void run(const unsigned long long* e, int chunk, const In* image,
                                        const Work& work) const {
        const int lane = threadIdx.x % 32;
        const unsigned long long first = ((unsigned long long)chunk * WARPS + threadIdx.x / 32) * per_warp;
        // below 2^32: j < n < 2^31 and the step is at most 2^29 (one round unless per_warp is
        // 32). Warp-uniform bounds: every lane of a warp takes part.
        for (unsigned j = first < n ? (unsigned)first : n; j < n; j += warps * per_warp) {
            const bool mine = lane < (int)per_warp && j + lane < n;
            int c = 0;
            i64 i = 0;
            Real f = 0;
            if (mine) {
                const unsigned long long v = e[j + lane];
                i = KeptEntries::index(v);
                c = KeptEntries::contribution(v);
                f = convert<Real>(image[i]);
            }
            work.entries(mine, mine && !no_entry(f), f, c, i);
        }
    }
};

// The forward: each block sweeps its tiles of one image (blocks_per_image blocks per image);
// out (rows, T) is written by the image's last block to finish. ws: a zeroed ForwardWorkspace
// (the image's last block leaves its parts zeroed again). word: null, or the host word that
// block 0 writes the thresholds' check into (report_thresholds) with ``token``. kept: null or
// a KeptEntries of ``kept_cap`` slots per image, for the backward. listed: null, or the list
// of the listed forward's first launch (soft_ecc_list_forward), whose images that fit are not
// swept here (the listed 3D forward's third launch; kept is then null).
template <typename In, typename K, typename Real, int NDIM, bool PERIODIC>
constexpr int soft_forward_min_blocks() {
    return !packed_soft_forward<In, NDIM, PERIODIC>() ? soft_min_blocks<Real, K, NDIM, PERIODIC>()
           : CUTOPO_SOFT_PACKED_MIN_BLOCKS;
}

template <typename In, typename K, typename Real, int NDIM, bool TCONN, bool PERIODIC>
__global__ void __launch_bounds__(THREADS, (soft_forward_min_blocks<In, K, Real, NDIM, PERIODIC>()))
soft_ecc_fused_forward(const In* __restrict__ image, const Real* __restrict__ thresholds,
                       unsigned long long* __restrict__ ws, Real* __restrict__ out,
                       unsigned long long* __restrict__ word, long long token,
                       unsigned long long* __restrict__ kept, i64 kept_cap, i64 nz, i64 ny,
                       i64 nx, int zchunk, int blocks_per_image, int T, Real lam, double w,
                       int shared, const unsigned long long* __restrict__ listed) {
    extern __shared__ __align__(16) unsigned char smem[];
    const i64 img = blockIdx.x / blocks_per_image;
    if (listed != nullptr && listed[img] <= (unsigned long long)kept_cap) return;  // (block-uniform)
    const int chunk = blockIdx.x % blocks_per_image;
    const i64 rows = gridDim.x / blocks_per_image;
    const ForwardWorkspace wsp(ws, rows, T);
    constexpr int QCAP = NDIM == 3 ? block_queue_cap<K>() : 0;  // the scalar sweep's (3D)
    __shared__ BlockQueue<QCAP == 0 ? 1 : QCAP> queue;
    if (threadIdx.x == 0) {  // published by setup's barrier
        forward_kept = KeptSink{kept != nullptr ? KeptEntries{kept, kept_cap}.slots(img, rows) : nullptr,
                                wsp.met + img, kept_cap};
        queue.tail = 0u;
    }
    const Smem<Real> s = setup<Real>(smem, thresholds, nullptr, T, shared, true);
    if (word != nullptr && blockIdx.x == 0) report_thresholds(s.t, T, word, token);
    double* acc_row = wsp.acc + img * T;
    long long* sat_row = wsp.sat + img * T;
    const ForwardWork<Real> work{s.t, T, lam, w, Accum{s.acc, acc_row, s.sat, sat_row}, {}};
    const i64 base = img * nz * ny * nx;
    if constexpr (packed_soft_forward<In, NDIM, PERIODIC>()) {
        // 16-byte aligned: load_plane stores the packed rows as uint2
        __shared__ __align__(16) unsigned words[NDIM == 3 ? 3 : 1][packed::PLANEW];
        __shared__ PackedQueues q;
        // raw storage: a __shared__ variable takes no initialiser (Window has defaults)
        __shared__ __align__(16) unsigned char work_bytes[sizeof(ForwardWork<Real>)];
        __shared__ __align__(16) unsigned char window_bytes[THREADS * sizeof(Window<Real, SOFT_PAIRS>)];
        ForwardWork<Real>* work_s = reinterpret_cast<ForwardWork<Real>*>(work_bytes);
        Window<Real, SOFT_PAIRS>* windows = reinterpret_cast<Window<Real, SOFT_PAIRS>*>(window_bytes);
        if (threadIdx.x == 0) *work_s = work;
        windows[threadIdx.x] = Window<Real, SOFT_PAIRS>();
        __syncthreads();
        const PackedRowBands<In, K, Real, NDIM, TCONN, ForwardWork<Real>> bands{
            &q, image, base, nz, ny, nx, work_s, windows};
        packed::sweep<NDIM, TCONN>(words, nz, ny, nx, zchunk, base, chunk, blocks_per_image,
                                   QuantKey<In>::from_thresholds(image, s.t, T), bands,
                                   AllPixels(), bands);
        windows[threadIdx.x].flush(work.a);
    } else {
        __shared__ K tile[NDIM == 3 ? 3 : 1][PLANE];
        __shared__ RowQueues q;
        const RowBands<In, Real, ForwardWork<Real>, QCAP> bands{&q, image, work, 0, &queue, 0u, 0};
        sweep<NDIM, TCONN, K, NDIM == 3>(tile, nz, ny, nx, zchunk, base, chunk, blocks_per_image,
                                         ValueKey<In, K>{{image}}, bands, AllPixels(),
                                         Boundary<PERIODIC>(), bands);
        bands.finish();
        bands.work.win.flush(bands.work.a);
    }
    if (shared) flush(s.acc, s.sat, acc_row, sat_row, T);

    // The image's last block: out = prefix sum of sat + acc, rounded once, the workspace's
    // parts zeroed, and the count of its entries handed to ``kept``.
    if (last_block_done(wsp.done + img, (unsigned)blocks_per_image) && threadIdx.x < 32) {
        wsp.finish_row(img, T, out + img * T);
        if (threadIdx.x == 0) {
            const unsigned long long met = atomicExch(wsp.met + img, 0ull);
            if (kept != nullptr) kept[img] = met;
        }
    }
}

// a[begin, end) = 0 by the block: 16-byte stores between the first and last 16-byte boundary
// (``a`` itself 16-byte aligned: a CuPy allocation), single elements at the ends. Element by
// element, the 3D backward's zeroing of a listed 256^3 float32 image wrote 2.1 TB/s on the H100
// (32 us, 0.36 instructions per cycle: the loop's 64-bit arithmetic per 4 bytes).
template <typename Real>
__device__ __forceinline__ void zero_range(Real* a, i64 begin, i64 end) {
    constexpr i64 V = 16 / sizeof(Real);
    const i64 head = min(end, (begin + V - 1) / V * V);  // begin rounded up to a boundary
    const i64 body = max(head, end / V * V);             // end rounded down, not below head
    for (i64 p = begin + threadIdx.x; p < head; p += THREADS) a[p] = Real(0);
    uint4* v = reinterpret_cast<uint4*>(a);
    for (i64 q = head / V + threadIdx.x; q < body / V; q += THREADS) v[q] = uint4{0u, 0u, 0u, 0u};
    for (i64 p = body + threadIdx.x; p < end; p += THREADS) a[p] = Real(0);
}

// The share of block ``chunk`` (of blocks_per_image) in zeroing image ``img``'s n elements of a.
template <typename Real>
__device__ __forceinline__ void zero_share(Real* a, i64 img, int chunk, i64 n, int blocks_per_image) {
    const i64 per_block = (n + blocks_per_image - 1) / blocks_per_image;
    zero_range(a, img * n + min(n, chunk * per_block), img * n + min(n, (chunk + 1) * per_block));
}

// The listed 3D forward, for volumes whose critical voxels are few (smooth images): the fused
// forward's sweep without its band work (first launch, this kernel), the band work of the
// listed entries over the whole grid (second, soft_ecc_listed_forward), and the fused forward
// for the images whose list overflowed (third, with ``listed``). The sweep of the fused forward
// runs its warps' band work between plane steps, while the others wait at the next barrier.
//
// This kernel lists every critical voxel with a finite value (band or not) into ``kept``
// (KeptEntries, kept_cap slots per image; past them counted until the image's blocks stop, at
// their next plane step: StopWhenFull); the image's last block writes the count (more than
// kept_cap: overflowed, and then below the number of critical voxels) and leaves the
// workspace's counters zeroed.
// Block 0 checks the thresholds into ``word`` when not null (report_thresholds).
// d_image: null, or the backward's d_image (rows, N), zeroed here (the block's share of its
// image, before the sweep, so that a block stopped early has zeroed it too): the forward of
// cutopo.vjp, whose backward then writes the listed voxels alone. On bench_soft's 256^3
// float32 volume (H100, forty-second session) this sweep took 14 us longer, the backward's
// zeroing launch 19 us less and its listed launch 9 us less: 306 -> 293 us in all. Zeroing
// each voxel as the sweep passes it, and evict-first stores either way, cost the sweep the
// same 14 us.
template <typename In, typename K, typename Real, int NDIM, bool TCONN, bool PERIODIC>
__global__ void __launch_bounds__(THREADS, (soft_min_blocks<Real, K, NDIM, PERIODIC>()))
soft_ecc_list_forward(const In* __restrict__ image, const Real* __restrict__ thresholds,
                      unsigned long long* __restrict__ ws, unsigned long long* __restrict__ word,
                      long long token, unsigned long long* __restrict__ kept, i64 kept_cap, i64 nz,
                      i64 ny, i64 nx, int zchunk, int blocks_per_image, int T,
                      Real* __restrict__ d_image) {
    static_assert(!packed_soft_forward<In, NDIM, PERIODIC>(), "the scalar sweep's instances");
    __shared__ K tile[NDIM == 3 ? 3 : 1][PLANE];
    __shared__ RowQueues q;
    const i64 img = blockIdx.x / blocks_per_image;
    const int chunk = blockIdx.x % blocks_per_image;
    const i64 rows = gridDim.x / blocks_per_image;
    const ForwardWorkspace wsp(ws, rows, T);
    if (threadIdx.x == 0) {
        forward_kept = KeptSink{KeptEntries{kept, kept_cap}.slots(img, rows), wsp.met + img, kept_cap};
        list_state = ListState{false, false};
    }
    __syncthreads();
    if (d_image != nullptr) zero_share(d_image, img, chunk, nz * ny * nx, blocks_per_image);
    if (word != nullptr && blockIdx.x == 0) report_thresholds(thresholds, T, word, token);
    const RowBands<In, Real, ListWork<Real>, 0> bands{&q, image, ListWork<Real>{}, 0, nullptr, 0u, 0};
    sweep<NDIM, TCONN, K, NDIM == 3>(tile, nz, ny, nx, zchunk, img * nz * ny * nx, chunk,
                                     blocks_per_image, ValueKey<In, K>{{image}}, bands, AllPixels(),
                                     Boundary<PERIODIC>(), StopWhenFull<decltype(bands)>{bands});
    if (last_block_done(wsp.done + img, (unsigned)blocks_per_image) && threadIdx.x == 0) {
        wsp.done[img] = 0u;
        kept[img] = atomicExch(wsp.met + img, 0ull);
    }
}

// The listed 3D forward's second launch: the band work of the listed entries of every image
// whose list fit (the others are the third launch's), dealt over the image's blocks as the
// listed backward deals them; the image's last block writes its row of ``out`` and leaves the
// workspace's parts zeroed, as the fused forward's does.
template <typename In, typename Real>
__global__ void __launch_bounds__(THREADS)
soft_ecc_listed_forward(const In* __restrict__ image, const Real* __restrict__ thresholds,
                        unsigned long long* __restrict__ ws, Real* __restrict__ out,
                        const unsigned long long* __restrict__ kept, i64 kept_cap,
                        int blocks_per_image, int T, Real lam, double w, int shared) {
    extern __shared__ __align__(16) unsigned char smem[];
    const i64 img = blockIdx.x / blocks_per_image;
    const unsigned long long count = kept[img];
    if (count > (unsigned long long)kept_cap) return;  // (block-uniform) overflowed
    const int chunk = blockIdx.x % blocks_per_image;
    const i64 rows = gridDim.x / blocks_per_image;
    const ForwardWorkspace wsp(ws, rows, T);
    const Smem<Real> s = setup<Real>(smem, thresholds, nullptr, T, shared, true);
    double* acc_row = wsp.acc + img * T;
    long long* sat_row = wsp.sat + img * T;
    Real* buf = warp_transposed_rows<Real>();
    const ListedForwardWork<Real> work{s.t, T, lam, w, Accum{s.acc, acc_row, s.sat, sat_row}, buf, {}};
    const ListedDeal deal(count, blocks_per_image);
    deal.run<Real>(KeptEntries{const_cast<unsigned long long*>(kept), kept_cap}.slots(img, rows), chunk,
                   image, work);
    work.win.flush(work.a);
    if (shared) flush(s.acc, s.sat, acc_row, sat_row, T);
    if (last_block_done(wsp.done + img, (unsigned)blocks_per_image) && threadIdx.x < 32)
        wsp.finish_row(img, T, out + img * T);
}

// TRANSPOSED: the listed backward's, transposed for the bands that fit a row
// (backward_listed_warp; buf: the warp's rows, null for double: the passes).
template <typename Real, bool TRANSPOSED = false>
struct BackwardWork {
    const Real* t;
    const Real* g;
    int T;
    Real lam;
    double w;
    Accum a;
    Real* d_image;  // nullptr: not wanted
    bool need_t;
    mutable GradWindow<Real, SOFT_PAIRS> win;
    mutable double dscale;
    Real* buf = nullptr;

    __device__ __forceinline__ void skipped(i64 i) const {
        if (d_image) d_image[i] = Real(0);
    }
    __device__ __forceinline__ void entries(bool mine, bool valid, Real f, int c, i64 i) const {
        double sum;
        if constexpr (TRANSPOSED)
            sum = backward_listed_warp<Real>(valid, f, c, t, g, T, lam, w, need_t, d_image != nullptr, dscale,
                                             a, win, buf);
        else
            sum = backward_warp<Real>(valid, f, c, t, g, T, lam, w, need_t, d_image != nullptr, dscale, a,
                                      win);
        if (d_image && mine) d_image[i] = valid ? (Real)(-(double)lam * sum) : Real(0);
    }
};

// Copies of the backward's global accumulators: block b adds its thresholds' and scale
// cotangents to copy b % BACKWARD_COPIES, which the last block sums. With one copy, the 1024
// blocks of a 1024^2 image each added T doubles to the same T addresses, and the atomics'
// serialisation in L2 held every block at its final fence (a third of the kernel's stall
// samples once the kept entries made the rest short).
constexpr int BACKWARD_COPIES = 16;

// Doubles of a backward workspace: the copies' d_t (T each) and d_scale, the blocks' counter.
__host__ __device__ inline i64 backward_workspace_words(int T) {
    return (i64)BACKWARD_COPIES * (T + 1) + 1;
}

// The backward: d_image (rows, N) gets -lambda sum_k g_k c sigma'_k at every pixel (0 where
// c = 0 or f is not finite); ws (backward_workspace_words doubles, zeroed) gathers the
// thresholds' cotangent without lambda and the scale's, in BACKWARD_COPIES copies, and (as an
// unsigned) the count of blocks done. The grid's last block writes d_t = lambda * (sum of the
// copies' d_t) and d_scale = the copies' sum into whichever of the Real or double outputs is
// not null (none: not wanted), and leaves ws zeroed again (as the forward's).
//
// kept: null (the sweep of every image), or the forward's KeptEntries (``kept_cap`` slots per
// image), which take two launches on ws, in this order: the sweep instance (LISTED false)
// sweeps only the images whose list overflowed and leaves the cotangents in ws (no final
// write, its blocks not counted) and zeroes the other images' d_image (unless ``zeroed``: the
// listed forward zeroed all of d_image, soft_ecc_list_forward), then the LISTED
// instance evaluates the listed images' entries (d_image written at those pixels alone) and
// makes the final write. Two instances, not one kernel with both paths: together they made the 2D
// float32 backward spill ~150 bytes at its 40-register budget, and the sweep 17 % slower.
template <typename In, typename K, typename Real, int NDIM, bool TCONN, bool PERIODIC, bool LISTED>
__global__ void __launch_bounds__(THREADS, (soft_backward_min_blocks<Real, K, NDIM, PERIODIC, LISTED>()))
soft_ecc_fused_backward(const In* __restrict__ image, const Real* __restrict__ thresholds,
                        const Real* __restrict__ g, Real* __restrict__ d_image,
                        double* __restrict__ ws, Real* __restrict__ d_t_real,
                        double* __restrict__ d_t_double, Real* __restrict__ d_scale_real,
                        double* __restrict__ d_scale_double,
                        const unsigned long long* __restrict__ kept, i64 kept_cap, i64 nz, i64 ny,
                        i64 nx, int zchunk, int blocks_per_image, int T, Real lam, double w,
                        int shared, int zeroed) {
    extern __shared__ __align__(16) unsigned char smem[];
    __shared__ K tile[LISTED ? 1 : (NDIM == 3 ? 3 : 1)][PLANE];  // (unused when LISTED)
    __shared__ RowQueues q;
    __shared__ double scratch[WARPS];
    const i64 img = blockIdx.x / blocks_per_image;
    const int chunk = blockIdx.x % blocks_per_image;
    const bool need_t = d_t_real != nullptr || d_t_double != nullptr;
    const bool need_scale = d_scale_real != nullptr || d_scale_double != nullptr;
    const int copy = blockIdx.x % BACKWARD_COPIES;
    double* dt_g = ws + (i64)copy * T;
    double* dscale_g = ws + (i64)BACKWARD_COPIES * T + copy;
    unsigned* done = reinterpret_cast<unsigned*>(ws + backward_workspace_words(T) - 1);
    // listed: the image's entries all fit in kept (block-uniform); the host keeps kept_cap
    // below 2^31 (cutopo/_soft_ecc_cupy.py, KEPT_MAX_BYTES), so 32-bit counters do
    const unsigned long long count = kept != nullptr ? kept[img] : 0ull;
    const bool listed = kept != nullptr && count <= (unsigned long long)kept_cap && kept_cap < (1LL << 31);
    if (!LISTED && listed) {  // the LISTED launch's image: its d_image zeroed here (unless the
        // forward zeroed it), in order before that launch writes the listed pixels
        if (d_image != nullptr && !zeroed) zero_share(d_image, img, chunk, nz * ny * nx, blocks_per_image);
        return;
    }
    const ListedDeal deal(LISTED && listed ? count : 0ull, blocks_per_image);
    // this block has work: an image to sweep, or entries
    const bool busy = LISTED ? listed && deal.busy(chunk) : true;
    if (busy) {
        const Smem<Real> s = setup<Real>(smem, thresholds, g + img * T, T, shared, false);
        Real* buf = warp_transposed_rows<Real, LISTED>();
        const RowBands<In, Real, BackwardWork<Real, LISTED>, 0> bands{
            &q, image,
            BackwardWork<Real, LISTED>{s.t, s.g, T, lam, w, Accum{s.acc, dt_g, nullptr, nullptr}, d_image,
                                       need_t, {}, 0.0, buf},
            0, nullptr, 0u, 0};
        if constexpr (LISTED) {
            const i64 rows = gridDim.x / blocks_per_image;
            deal.run<Real>(KeptEntries{const_cast<unsigned long long*>(kept), kept_cap}.slots(img, rows),
                           chunk, image, bands.work);
        } else {
            sweep<NDIM, TCONN, K>(tile, nz, ny, nx, zchunk, img * nz * ny * nx, chunk,
                                  blocks_per_image, ValueKey<In, K>{{image}}, bands, AllPixels(),
                                  Boundary<PERIODIC>(), bands);
        }
        bands.work.win.flush(bands.work.a);
        if (shared && need_t) flush(s.acc, nullptr, dt_g, nullptr, T);
        if (need_scale) block_add(bands.work.dscale, dscale_g, scratch);
    }
    if (!LISTED && kept != nullptr) return;  // the LISTED launch makes the final write

    if (last_block_done(done, gridDim.x)) {
        for (int k = threadIdx.x; k < T && need_t; k += THREADS) {
            double v = 0.0;
            for (int c = 0; c < BACKWARD_COPIES; ++c) {
                v += __ldcg(ws + (i64)c * T + k);
                ws[(i64)c * T + k] = 0.0;
            }
            v *= (double)lam;
            if (d_t_real) d_t_real[k] = (Real)v;
            if (d_t_double) d_t_double[k] = v;
        }
        if (threadIdx.x == 0) {
            if (need_scale) {
                double v = 0.0;
                for (int c = 0; c < BACKWARD_COPIES; ++c) {
                    v += __ldcg(ws + (i64)BACKWARD_COPIES * T + c);
                    ws[(i64)BACKWARD_COPIES * T + c] = 0.0;
                }
                if (d_scale_real) *d_scale_real = (Real)v;
                if (d_scale_double) *d_scale_double = v;
            }
            *done = 0u;
        }
    }
}

}  // namespace band
}  // namespace ecc
}  // namespace cutopo
