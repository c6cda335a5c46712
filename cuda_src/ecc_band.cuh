// Band-limited sigmoid sums of the soft ECC and soft ECT, and the histogram of the exact ECT.
//
// An "entry" is a (value f, contribution c) pair that adds c * sigmoid(lambda (t_k - f)) to
// row r of the result for every threshold t_k. Only the thresholds of the band [lo, hi), where
// |lambda (t_k - f)| < B, are evaluated; from hi on the sigmoid is exactly 1 and c enters a
// difference array ("sat") whose prefix sum adds it to every later threshold. The band edges are
// computed in float64 exactly as the NumPy path does (cutopo/_soft_ecc.py), so both backends
// evaluate the same entries.
//
// Work layout: each thread prepares one entry (band edges, the saturated part), then its warp
// walks the warp's entries one at a time, the 32 lanes covering consecutive thresholds of the
// band (in the soft ECT's kernels two at a time where both bands are at most 16 long, a half
// warp each: Window, ECT_PAIRS). Lanes thus add to distinct accumulators: shared-memory float
// atomics are CAS loops on sm_80/sm_90, and lanes of one warp hitting one address (neighbouring
// pixels of a smooth image have nearly equal values) would serialise them. The float32 kernels
// over kept entries go transposed instead (transposed_groups, below): a lane per entry for the
// terms, a lane per threshold for the sums.
//
// Entry sources: the critical pixels of an image as ecc.cu's sweep finds them (soft ECC,
// ecc_soft.cuh), or the critical pixels of a mask with their heights <x_p, v_d> in direction d
// (ECT).
//
// Included at the end of ecc.cu (the ECC family's one source), whose warp_row_prefix_sum the
// final prefix sum uses.
#pragma once
#include "common.cuh"

namespace cutopo {
namespace ecc {
namespace band {

constexpr int THREADS = 256;
constexpr int WARPS = THREADS / 32;
constexpr unsigned FULL = 0xffffffffu;

// The band work's register window (Window, below): pairs of short bands per pass in the soft
// ECT's kernels, one entry per pass in the soft ECC's. Timed on an H100 (benchmarks/RESULTS.md,
// thirty-seventh session): pairs, with a block's entries dealt over its warps (EctBlock), took
// the soft ECT's backward from 0.057 to 0.037 ms; in the soft ECC's kernels pairs (and a window
// of 64 thresholds) were 0-10 % slower (their register-capped sweeps spill more with a second
// accumulator per lane).
constexpr bool ECT_PAIRS = true;
constexpr bool SOFT_PAIRS = false;

// sigmoid(u) and sigmoid'(u) = s (1 - s) from e = exp(-|u|), without cancellation, in the
// operation order of the NumPy path (_soft_ecc._sigmoid_parts).
__device__ __forceinline__ float exp_neg_abs(float u) { return expf(-fabsf(u)); }
__device__ __forceinline__ double exp_neg_abs(double u) { return ::exp(-::fabs(u)); }

// 1 / x correctly rounded, as the division 1 / x is, without the division's slow-path checks.
__device__ __forceinline__ float reciprocal(float x) { return __frcp_rn(x); }
__device__ __forceinline__ double reciprocal(double x) { return __drcp_rn(x); }

template <typename Real>
__device__ __forceinline__ Real sigmoid(Real u) {
    const Real e = exp_neg_abs(u);
    const Real r = reciprocal(Real(1) + e);
    return u >= Real(0) ? r : e * r;
}
template <typename Real>
__device__ __forceinline__ Real dsigmoid(Real u) {
    const Real e = exp_neg_abs(u);
    const Real r = reciprocal(Real(1) + e);
    return e * r * r;
}

// out_row[k] = (sum of sat_row[0 .. k]) + acc_row[k], rounded once, by one warp: a soft
// curve's row from its accumulators (the saturated parts' difference array, the band sums).
// acc_row is read from L2: other blocks' atomics wrote it.
template <typename Real>
__device__ __forceinline__ void write_soft_row(const long long* sat_row, const double* acc_row,
                                               Real* out_row, int T) {
    warp_row_prefix_sum(sat_row, T, [out_row, acc_row](int k, long long sum) {
        out_row[k] = (Real)((double)sum + __ldcg(acc_row + k));
    });
}

__device__ __forceinline__ double inf_d() { return __longlong_as_double(0x7ff0000000000000LL); }

// The next double towards -inf / +inf (nextafter without its library call, which made ptxas
// spill around it). Infinities and NaN stay as they are.
__device__ __forceinline__ double next_down(double x) {
    const long long b = __double_as_longlong(x);
    if (x != x || x == -inf_d()) return x;
    if (x == 0.0) return -__longlong_as_double(1LL);  // -denorm_min, also for -0.0
    return __longlong_as_double(b >= 0 ? b - 1 : b + 1);
}
__device__ __forceinline__ double next_up(double x) { return -next_down(-x); }

// Number of thresholds t_k (sorted, T of them) with t_k <= x (upper) or t_k < x (lower).
template <typename Real>
__device__ __forceinline__ int count_le(const Real* t, int T, double x) {
    int lo = 0, hi = T;
    while (lo < hi) {
        const int mid = (lo + hi) >> 1;
        if (convert<double>(t[mid]) <= x) lo = mid + 1; else hi = mid;
    }
    return lo;
}
template <typename Real>
__device__ __forceinline__ int count_lt(const Real* t, int T, double x) {
    int lo = 0, hi = T;
    while (lo < hi) {
        const int mid = (lo + hi) >> 1;
        if (convert<double>(t[mid]) < x) lo = mid + 1; else hi = mid;
    }
    return lo;
}

// The band [lo, hi) of value f for half-width w = B / lambda (already widened by 2^-40): the
// edges f -+ w are pushed outwards by two ulps, past the rounding of the subtraction, so every
// threshold outside the band has |lambda (t - f)| >= B exactly (as numpy.searchsorted there).
template <typename Real>
__device__ __forceinline__ void band_edges(Real f, double w, const Real* t, int T, int& lo, int& hi) {
    const double fd = convert<double>(f);  // exact for float32 denormals despite -ftz=true
    if (fd == -inf_d()) {  // sigmoid(+inf) = 1 at every threshold
        lo = hi = 0;
        return;
    }
    double a = fd - w, b = fd + w;
    a = next_down(next_down(a));
    b = next_up(next_up(b));
    hi = count_lt(t, T, b);
    lo = min(count_le(t, T, a), hi);
}

// f is NaN or +inf: the entry adds nothing (sigmoid(-inf) = 0).
template <typename Real>
__device__ __forceinline__ bool no_entry(Real f) {
    return isnan(f) || convert<double>(f) == inf_d();
}

template <typename T>
__device__ __forceinline__ T warp_sum(T v) {
#pragma unroll
    for (int d = 16; d > 0; d >>= 1) v += __shfl_xor_sync(FULL, v, d);
    return v;
}

// Block-wide sum of one double per thread, added to *out by thread 0 (one atomic per block).
__device__ __forceinline__ void block_add(double v, double* out, double* scratch) {
    v = warp_sum(v);
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    if (warp == 0) {
        v = lane < WARPS ? scratch[lane] : 0.0;
        v = warp_sum(v);
        if (lane == 0 && v != 0.0) atomicAdd(out, v);
    }
    __syncthreads();
}

// Per-row accumulators: shared per block (flushed at the end) or straight to global memory
// when T is too large for shared memory.
// Shared and global pointers are kept apart (not one generic pointer) so that the compiler
// emits shared-memory atomics for the shared ones.
struct Accum {
    double* acc_s;     // shared band sums (forward) or threshold cotangents (backward), or nullptr
    double* acc_g;     // their global row (used when acc_s is nullptr)
    int* sat_s;        // shared difference array, or nullptr
    long long* sat_g;  // global difference array of the row (used when sat_s is nullptr)

    __device__ __forceinline__ void add(int k, double v) const {
        if (acc_s) atomicAdd(acc_s + k, v);
        else atomicAdd(acc_g + k, v);
    }
    __device__ __forceinline__ void add_sat(int k, int c) const {
        if (sat_s) atomicAdd(sat_s + k, c);
        else atomicAdd(reinterpret_cast<u64*>(sat_g + k), (u64)(i64)c);
    }
};

// Shared-memory layout of a block: thresholds (T Real), cotangent row (T Real, backward only),
// band accumulator (T double), difference array (T int). Offsets rounded to 16 bytes.
__host__ __device__ inline size_t align16(size_t n) { return (n + 15) & ~(size_t)15; }

// A warp's register accumulators for 32 thresholds k0 .. k0 + 31, with the lanes' thresholds
// (and cotangents) cached. Consecutive entries of a warp are nearby pixels with nearby values,
// so their bands usually fall in one window: the sigmoid terms then go into registers, and
// memory (shared atomics) is touched only when the window moves. Adding every term with a
// shared atomic instead made lanes of different warps contend for the same thresholds (CAS
// loops for doubles): ~2000 cycles per entry at 1024^2.
//
// Without PAIRS lane l holds threshold k0 + l (acc0, t0), and a pass of the warp evaluates one
// entry. With PAIRS lane l (h = l % 16) holds k0 + h (acc0, t0) and k0 + 16 + h (acc1, t1),
// lanes l and l + 16 the same two, so that a pass evaluates two entries whose bands are at most
// 16 long, lanes 0-15 one and 16-31 the other, each lane at the one of its thresholds in its
// entry's band (16 consecutive thresholds fall on distinct h); an entry alone still takes one
// threshold per lane, k0 + l. Bands of bench_soft's soft ECT are ~8.5 thresholds long: a pass
// on one entry leaves ~3/4 of the lanes idle.
template <typename Real, bool PAIRS> struct WindowSlots { double acc0 = 0.0; Real t0 = 0; };
template <typename Real> struct WindowSlots<Real, true> { double acc0 = 0.0, acc1 = 0.0; Real t0 = 0, t1 = 0; };

template <typename Real, bool PAIRS>
struct Window : WindowSlots<Real, PAIRS> {
    static constexpr int H = PAIRS ? 16 : 32;  // the lane's first threshold is k0 + lane % H
    int k0 = -(1 << 30);  // no window yet: the first band always moves it

    __device__ __forceinline__ int first() const {  // the lane's (first) threshold
        return k0 + (int)(threadIdx.x % H);
    }
    // Adds the lane's sums to the accumulators of the row (distinct k per lane, or half warp).
    __device__ __forceinline__ void flush(const Accum& a) {
        if (this->acc0 != 0.0) a.add(first(), this->acc0);
        this->acc0 = 0.0;
        if constexpr (PAIRS) {
            if (this->acc1 != 0.0) a.add(first() + H, this->acc1);
            this->acc1 = 0.0;
        }
    }
    __device__ __forceinline__ bool covers(int lo, int hi) const { return lo >= k0 && hi <= k0 + 32; }
    // Makes [lo, hi) (at most 32 long) part of the window, placing a new one that starts at lo
    // (or ends at T) if needed: for_each_band moves it to the lowest band left. Returns whether
    // it moved.
    __device__ __forceinline__ bool cover(int lo, int hi, const Real* tt, int T, const Accum& a) {
        if (covers(lo, hi)) return false;  // warp-uniform: lo, hi are the same in every lane
        flush(a);
        k0 = max(0, min(lo, T - 32));
        const int k = first();
        this->t0 = k < T ? tt[k] : Real(0);
        if constexpr (PAIRS) this->t1 = k + H < T ? tt[k + H] : Real(0);
        return true;
    }
    // Whether this lane evaluates a threshold of the band [lo, hi) (covered, at most 32 long;
    // ``pair``: at most 16 long and the half warp's own), and which: ``upper`` for its second.
    __device__ __forceinline__ bool pick(int lo, int hi, bool pair, bool& upper) const {
        if constexpr (PAIRS) upper = pair ? first() < lo : threadIdx.x % 32 >= 16;
        else upper = false;
        const int k = first() + (upper ? H : 0);
        return k >= lo && k < hi;
    }
    __device__ __forceinline__ Real t_at(bool upper) const {
        if constexpr (PAIRS) return upper ? this->t1 : this->t0;
        else return this->t0;
    }
    __device__ __forceinline__ void add(bool upper, double v) {
        if constexpr (PAIRS) {
            if (upper) this->acc1 += v;
            else this->acc0 += v;
        } else {
            this->acc0 += v;
        }
    }
};

// The backward's window: the cotangent row's entries at the lane's thresholds too.
template <typename Real, bool PAIRS> struct GradSlots { Real g0 = 0; };
template <typename Real> struct GradSlots<Real, true> { Real g0 = 0, g1 = 0; };

template <typename Real, bool PAIRS>
struct GradWindow : Window<Real, PAIRS>, GradSlots<Real, PAIRS> {
    __device__ __forceinline__ void cover(int lo, int hi, const Real* tt, const Real* gg, int T,
                                          const Accum& a) {
        if (!Window<Real, PAIRS>::cover(lo, hi, tt, T, a)) return;
        constexpr int H = Window<Real, PAIRS>::H;
        const int k = this->first();
        this->g0 = k < T ? gg[k] : Real(0);
        if constexpr (PAIRS) this->g1 = k + H < T ? gg[k + H] : Real(0);
    }
    __device__ __forceinline__ Real g_at(bool upper) const {
        if constexpr (PAIRS) return upper ? this->g1 : this->g0;
        else return this->g0;
    }
};

// Runs body(a, b, f, c, lo, hi) in the whole warp for each lane whose entry has a non-empty
// band: b < 0: entry a alone, every lane holding its values (the lanes then cover its band's
// thresholds together); b >= 0 (warp-uniform): two entries whose bands are at most 16 long and
// covered by the window, lanes 0-15 holding a's values and 16-31 b's (Window::pick).
// Order: first every entry whose band the window already covers (paired where both are short),
// then the entry of the lowest band left (whose cover() moves the window to start there), and
// so on: a greedy cover of the warp's bands by the fewest windows. In the lanes' order the
// window moved for 76 % of the entries of bench_soft's 1024^2 image (neighbours of a smooth
// image are 4 pixels or more apart in a warp's queue, their values further apart than the
// window's 23 spare thresholds), each move a flush (a shared-memory CAS loop per lane) and a
// reload; in this order 27 %. Pairs: a pass evaluates one sigmoid per lane, and bands of the
// benchmarks are ~8.5 thresholds long, so a pass on one entry leaves ~3/4 of the lanes idle.
template <bool PAIRS, typename Real, typename Win, typename Body>
__device__ __forceinline__ void for_each_band(bool banded, Real f, int c, int lo, int hi,
                                              const Win& win, Body body) {
    const int lane = threadIdx.x % 32;
    unsigned todo = __ballot_sync(FULL, banded);
    const unsigned short_band = PAIRS ? __ballot_sync(FULL, banded && hi - lo <= 16) : 0u;
    while (todo) {
        const bool pending = (todo >> lane) & 1u;
        unsigned run = __ballot_sync(FULL, pending && win.covers(lo, hi));
        if (run == 0u) {  // none covered: the lowest band left (a band wider than 32 is never covered)
            const int low = __reduce_min_sync(FULL, pending ? lo : (1 << 30));
            run = __ballot_sync(FULL, pending && lo == low);
            run &= 0u - run;  // its first lane alone: its body moves the window
        }
        todo &= ~run;
        do {  // the window does not move in this run (its entries are covered, or it is one entry)
            const int a = __ffs(run) - 1;
            run &= run - 1;
            int b = -1;  // a partner: the next short band of the run (none in a moving run of one)
            const unsigned partners = run & short_band;
            if (PAIRS && ((short_band >> a) & 1u) && partners != 0u) {
                b = __ffs(partners) - 1;
                run &= ~(1u << b);
            }
            const int src = (b >= 0 && lane >= 16) ? b : a;
            body(a, b, __shfl_sync(FULL, f, src), __shfl_sync(FULL, c, src),
                 __shfl_sync(FULL, lo, src), __shfl_sync(FULL, hi, src));
        } while (run);
    }
}

// The passes of forward_warp over the warp's banded entries (one entry, or a pair, a pass).
template <typename Real, bool PAIRS>
__device__ __forceinline__ void forward_passes(bool banded, Real f, int c, int lo, int hi, const Real* t,
                                               int T, Real lam, const Accum& a, Window<Real, PAIRS>& win) {
    const int lane = threadIdx.x % 32;
    for_each_band<PAIRS>(banded, f, c, lo, hi, win, [&](int, int pb, Real fi, int ci, int loi, int hii) {
        if (hii - loi <= 32) {
            win.cover(loi, hii, t, T, a);  // (a pair is covered: no move)
            bool upper;
            if (win.pick(loi, hii, pb >= 0, upper))
                win.add(upper, (double)sigmoid<Real>((win.t_at(upper) - fi) * lam) * (double)ci);
        } else {  // a band wider than a window: straight to the accumulators, distinct k per lane
            for (int k = loi + lane; k < hii; k += 32)
                a.add(k, (double)sigmoid<Real>((t[k] - fi) * lam) * (double)ci);
        }
    });
}

// Forward of one warp's entries. Each lane holds one entry (valid: contributes something).
// Returns whether the lane's entry has a non-empty band (the entries a backward evaluates).
template <typename Real, bool PAIRS>
__device__ __forceinline__ bool forward_warp(bool valid, Real f, int c, const Real* t, int T,
                                             Real lam, double w, bool soft, const Accum& a,
                                             Window<Real, PAIRS>& win) {
    int lo = T, hi = T;
    if (valid) {
        if (soft) {
            band_edges(f, w, t, T, lo, hi);
        } else {  // exact: the entry counts from the first t_k >= f on (f <= t_k)
            hi = count_lt(t, T, convert<double>(f));
            lo = hi;
        }
        if (hi < T) a.add_sat(hi, c);
    }
    forward_passes<Real, PAIRS>(valid && lo < hi, f, c, lo, hi, t, T, lam, a, win);
    return lo < hi;
}

// The passes of backward_warp over the warp's banded entries: returns the lane's own sum.
template <typename Real, bool PAIRS>
__device__ __forceinline__ double backward_passes(bool banded, Real f, int c, int lo, int hi,
                                                  const Real* t, const Real* g, int T, Real lam,
                                                  bool need_t, bool need_sum, double& dscale,
                                                  const Accum& a, GradWindow<Real, PAIRS>& win) {
    const int lane = threadIdx.x % 32;
    double mine = 0.0;
    for_each_band<PAIRS>(banded, f, c, lo, hi, win, [&](int pa, int pb, Real fi, int ci, int loi, int hii) {
        double sum = 0.0;
        if (hii - loi <= 32) {
            win.cover(loi, hii, t, g, T, a);  // (a pair is covered: no move)
            bool upper;
            if (win.pick(loi, hii, pb >= 0, upper)) {
                const Real diff = win.t_at(upper) - fi;
                sum = (double)dsigmoid<Real>(diff * lam) * (double)ci * (double)win.g_at(upper);
                if (need_t) win.add(upper, sum);
                dscale += sum * (double)diff;
            }
        } else {
            for (int k = loi + lane; k < hii; k += 32) {
                const Real diff = t[k] - fi;
                const double v = (double)dsigmoid<Real>(diff * lam) * (double)ci * (double)g[k];
                if (need_t) a.add(k, v);
                sum += v;
                dscale += v * (double)diff;
            }
        }
        if (need_sum && !PAIRS) {
            sum = warp_sum(sum);
            if (lane == pa) mine = sum;
        } else if (need_sum) {  // half-warp sums, then each half's from the other half
#pragma unroll
            for (int d = 8; d > 0; d >>= 1) sum += __shfl_xor_sync(FULL, sum, d);
            const double other = __shfl_xor_sync(FULL, sum, 16);
            if (pb < 0) {
                if (lane == pa) mine = sum + other;
            } else if (lane == pa) {
                mine = lane < 16 ? sum : other;  // a's sum is the lower half's
            } else if (lane == pb) {
                mine = lane < 16 ? other : sum;
            }
        }
    });
    return mine;
}

// Backward of one warp's entries: threshold cotangents (when need_t) through the window into
// a, the scale cotangent into dscale (per lane), and, when need_sum, the sum over k of
// g_k c sigma'_k of the lane's own entry returned (0 for an invalid entry).
template <typename Real, bool PAIRS>
__device__ __forceinline__ double backward_warp(bool valid, Real f, int c, const Real* t,
                                                const Real* g, int T, Real lam, double w,
                                                bool need_t, bool need_sum, double& dscale,
                                                const Accum& a, GradWindow<Real, PAIRS>& win) {
    int lo = T, hi = T;
    if (valid) band_edges(f, w, t, T, lo, hi);
    return backward_passes<Real, PAIRS>(valid && lo < hi, f, c, lo, hi, t, g, T, lam, need_t, need_sum,
                                        dscale, a, win);
}

// ---------------------------------------------------------------------------------------------
// Transposed passes: the kernels over kept entries (float32)
//
// A pass per entry (for_each_band: ballots, shuffles of the entry, the window's checks, one
// sigmoid per lane of ~8.5 in a band) is most of the instructions of the kernels over kept
// entries. Transposed, each lane evaluates the terms of its own entry's band (of at most
// TRANSPOSED_BAND thresholds) into the warp's buffer (a row of TRANSPOSED_BAND words per
// lane); then, for each group of entries whose bands lie in one window, each lane adds up the
// terms at its own threshold of the window (k0 + lane) over the group. The terms and their
// products with c (and g) are the passes' values, computed in the same order; only the order
// of the sums differs. Longer bands take the passes.
constexpr int TRANSPOSED_BAND = 15;  // odd: a warp's stores to its rows fall in 32 banks

// Words of a warp's transposed rows (1 for double: its bands are longer, and it takes the
// passes).
template <typename Real>
__host__ __device__ constexpr int transposed_warp_words() {
    return sizeof(Real) == 4 ? 32 * TRANSPOSED_BAND : 1;
}

// For each group of the lanes in ``pending`` whose bands lie in one window (the lowest band
// left and every band within 32 thresholds of its start: a greedy cover, as for_each_band's),
// the window moved over it (cover(base, top)), then in every lane add(term, c_e) for each
// lane e of the group whose band holds the lane's threshold k0 + lane, the term lane e's
// row[k0 + lane - lo_e] of ``buf`` (one shuffle and one conflict-free load per entry).
template <typename Real, typename Cover, typename Add>
__device__ __forceinline__ void transposed_groups(unsigned pending, int lo, int hi, int c, const Real* buf,
                                                  const int& k0, Cover cover, Add add) {
    const int lane = threadIdx.x % 32;
    while (pending) {  // warp-uniform
        const bool mine = (pending >> lane) & 1u;
        const int base = __reduce_min_sync(FULL, mine ? lo : 0x7fffffff);
        unsigned group = __ballot_sync(FULL, mine && hi <= base + 32);
        pending &= ~group;
        cover(base, __reduce_max_sync(FULL, (group >> lane) & 1u ? hi : 0));  // k0 <= base, top <= k0 + 32
        const int packed = (lo - k0) | ((hi - lo) << 6) | (int)((unsigned)c << 11);
        do {
            const int e = __ffs(group) - 1;
            group &= group - 1;
            const int x = __shfl_sync(FULL, packed, e);
            const int j = lane - (x & 63);
            if ((unsigned)j < (unsigned)((x >> 6) & 31)) add(buf[e * TRANSPOSED_BAND + j], x >> 11);
        } while (group);
    }
}

// forward_warp (soft) for the kernels over kept entries, transposed where it can be; ``buf``
// the warp's rows (null: never transposed). Returns nothing: those kernels keep no entries.
template <typename Real>
__device__ __forceinline__ void forward_listed_warp(bool valid, Real f, int c, const Real* t, int T,
                                                    Real lam, double w, const Accum& a,
                                                    Window<Real, false>& win, Real* buf) {
    int lo = T, hi = T;
    if (valid) {
        band_edges(f, w, t, T, lo, hi);
        if (hi < T) a.add_sat(hi, c);
    }
    const bool banded = valid && lo < hi;
    const bool row_fits = buf != nullptr && hi - lo <= TRANSPOSED_BAND;
    if (__any_sync(FULL, banded && !row_fits))  // bands longer than a row: the passes
        forward_passes<Real, false>(banded && !row_fits, f, c, lo, hi, t, T, lam, a, win);
    const unsigned pending = __ballot_sync(FULL, banded && row_fits);
    if (pending == 0u) return;
    if (banded && row_fits) {
        Real* row = buf + (threadIdx.x % 32) * TRANSPOSED_BAND;
        for (int k = lo; k < hi; ++k) row[k - lo] = sigmoid<Real>((t[k] - f) * lam);
    }
    __syncwarp();
    transposed_groups(pending, lo, hi, c, buf, win.k0,
                      [&](int base, int top) { win.cover(base, top, t, T, a); },
                      [&](Real s, int ce) { win.add(false, (double)s * (double)ce); });
    __syncwarp();  // the next round rewrites the rows
}

// backward_warp for the kernels over kept entries, transposed where it can be (see
// forward_listed_warp).
template <typename Real>
__device__ __forceinline__ double backward_listed_warp(bool valid, Real f, int c, const Real* t,
                                                       const Real* g, int T, Real lam, double w,
                                                       bool need_t, bool need_sum, double& dscale,
                                                       const Accum& a, GradWindow<Real, false>& win,
                                                       Real* buf) {
    int lo = T, hi = T;
    if (valid) band_edges(f, w, t, T, lo, hi);
    const bool banded = valid && lo < hi;
    const bool row_fits = buf != nullptr && hi - lo <= TRANSPOSED_BAND;
    double mine = 0.0;
    if (__any_sync(FULL, banded && !row_fits))  // bands longer than a row: the passes
        mine = backward_passes<Real, false>(banded && !row_fits, f, c, lo, hi, t, g, T, lam, need_t, need_sum,
                                            dscale, a, win);
    const unsigned pending = __ballot_sync(FULL, banded && row_fits);
    if (pending == 0u) return mine;
    if (banded && row_fits) {
        Real* row = buf + (threadIdx.x % 32) * TRANSPOSED_BAND;
        for (int k = lo; k < hi; ++k) {
            const Real diff = t[k] - f;
            const Real d = dsigmoid<Real>(diff * lam);
            const double v = (double)d * (double)c * (double)g[k];
            mine += v;
            dscale += v * (double)diff;
            if (need_t) row[k - lo] = d;
        }
    }
    if (need_t) {
        __syncwarp();
        transposed_groups(pending, lo, hi, c, buf, win.k0,
                          [&](int base, int top) { win.cover(base, top, t, g, T, a); },
                          [&](Real d, int ce) {
                              win.add(false, (double)d * (double)ce * (double)win.g_at(false));
                          });
        __syncwarp();  // the next round rewrites the rows
    }
    return need_sum ? mine : 0.0;
}

// ---------------------------------------------------------------------------------------------
// Block set-up and flush

template <typename Real>
struct Smem {
    Real* t;
    Real* g;
    double* acc;
    int* sat;
};

// With `shared`: carves the dynamic shared memory, loads the thresholds (and the cotangent row)
// and zeroes the accumulators. Without: t and g stay in global memory, accumulators are global.
template <typename Real>
__device__ __forceinline__ Smem<Real> setup(unsigned char* smem, const Real* t, const Real* g,
                                            int T, bool shared, bool with_sat) {
    Smem<Real> s{const_cast<Real*>(t), const_cast<Real*>(g), nullptr, nullptr};
    if (shared) {
        size_t off = 0;
        s.t = reinterpret_cast<Real*>(smem);
        off = align16((size_t)T * sizeof(Real));
        if (g) {
            s.g = reinterpret_cast<Real*>(smem + off);
            off += align16((size_t)T * sizeof(Real));
        }
        s.acc = reinterpret_cast<double*>(smem + off);
        off += align16((size_t)T * sizeof(double));
        if (with_sat) s.sat = reinterpret_cast<int*>(smem + off);
        for (int k = threadIdx.x; k < T; k += THREADS) {
            s.t[k] = t[k];
            if (g) s.g[k] = g[k];
            s.acc[k] = 0.0;
            if (with_sat) s.sat[k] = 0;
        }
    }
    __syncthreads();
    return s;
}

// Adds a block's shared accumulators to the row's global ones.
__device__ __forceinline__ void flush(const double* acc, const int* sat, double* acc_g,
                                      long long* sat_g, int T) {
    __syncthreads();
    for (int k = threadIdx.x; k < T; k += THREADS) {
        if (acc_g && acc[k] != 0.0) atomicAdd(acc_g + k, acc[k]);
        if (sat && sat[k] != 0) atomicAdd(reinterpret_cast<u64*>(sat_g + k), (u64)(i64)sat[k]);
    }
}

// ---------------------------------------------------------------------------------------------
// ECT: entries are the critical pixels (c != 0) of the masks, listed per segment; direction d
// of image b reads segment seg_of_dir[d] * B + b, entries [seg[s], seg[s + 1]). Their heights
// x_0 v_0 + x_1 v_1 (+ x_2 v_2) are formed in float64 with explicit round-to-nearest operations
// (no fused multiply-add) so that they equal the NumPy heights bit for bit.
//
// Grid: rows = B * D rows (b, d) in the output's order (b major), chunks_per_row blocks each.

// Position of pixel lin (C order in the grid n0 x n1 (x n2)); coords holds the positions of
// axis 0, then axis 1 (then axis 2), concatenated.
template <int NDIM>
__device__ __forceinline__ void position(i64 lin, const double* coords, i64 n0, i64 n1, i64 n2,
                                         double (&x)[NDIM]) {
    if constexpr (NDIM == 2) {
        const i64 i1 = lin % n1, i0 = lin / n1;
        x[0] = coords[i0];
        x[1] = coords[n0 + i1];
    } else {
        const i64 i2 = lin % n2, r = lin / n2;
        const i64 i1 = r % n1, i0 = r / n1;
        x[0] = coords[i0];
        x[1] = coords[n0 + i1];
        x[2] = coords[n0 + n1 + i2];
    }
}

template <int NDIM>
__device__ __forceinline__ double height(const double (&x)[NDIM], const double (&v)[NDIM]) {
    double h = __dmul_rn(x[0], v[0]);
#pragma unroll
    for (int a = 1; a < NDIM; ++a) h = __dadd_rn(h, __dmul_rn(x[a], v[a]));
    return h;
}

// What a block of the ECT kernels works on: output row (b, d), the direction, and its range of
// entries (chunk `chunk` of the segment of (orthant or direction of d, image b)).
template <int NDIM>
struct EctBlock {
    i64 row, begin, end;
    int d;
    double v[NDIM];

    __device__ __forceinline__ EctBlock(const i64* seg, const int* seg_of_dir, const double* dirs,
                                        int B, int D, int chunks_per_row) {
        row = blockIdx.x / chunks_per_row;
        const int chunk = blockIdx.x % chunks_per_row;
        const int b = (int)(row / D);
        d = (int)(row % D);
#pragma unroll
        for (int a = 0; a < NDIM; ++a) v[a] = dirs[(i64)d * NDIM + a];
        const i64 sid = (i64)seg_of_dir[d] * B + b;
        const i64 s0 = seg[sid], n = seg[sid + 1] - s0;
        begin = s0 + n * chunk / chunks_per_row;
        end = s0 + n * (chunk + 1) / chunks_per_row;
    }
    // Entries per warp batch of the soft ECT: the block's entries dealt evenly over its warps
    // (at most 32 each). A warp evaluates its batch one pass after the
    // other, and a block of bench_soft's soft ECT holds ~100 entries: 32 a warp kept four warps
    // busy for 32 dependent passes each and left four idle; dealt out, each warp makes ~13.
    __device__ __forceinline__ int per_warp() const {
        return (int)min((i64)32, max((i64)1, (end - begin + WARPS - 1) / WARPS));
    }
};

// Blocks per multiprocessor of the ECT kernels: the registers ptxas took for them unbounded
// before for_each_band's greedy order (forward 40 float / 48 double, backward 64 / 74-80),
// stated, because with that order it took 32 and 48 registers (float) and spilled 40-172 bytes.
template <typename Real, bool BACKWARD>
constexpr int ect_min_blocks() {
    return sizeof(Real) == 8 ? (BACKWARD ? 3 : 5) : (BACKWARD ? 4 : 6);
}

// Forward of the exact (soft = 0: Real is double, only the difference array) or soft ECT.
// With ``out`` (soft only; ``done``: a zeroed counter per row) the last block of each row to
// finish also writes out[row] = prefix sum of sat + acc (soft_finalize's work, without its
// launch).
template <typename Real, int NDIM>
__global__ void __launch_bounds__(THREADS, (ect_min_blocks<Real, false>()))
ect_forward(const i64* __restrict__ ent_lin, const signed char* __restrict__ ent_c,
            const i64* __restrict__ seg, const int* __restrict__ seg_of_dir,
            const double* __restrict__ coords, const double* __restrict__ dirs,
            const Real* __restrict__ thresholds, double* __restrict__ acc_g,
            long long* __restrict__ sat_g, Real* __restrict__ out, unsigned* __restrict__ done,
            i64 n0, i64 n1, i64 n2, int B, int D, int chunks_per_row, int T, Real lam, double w,
            int soft, int shared) {
    extern __shared__ __align__(16) unsigned char smem[];
    const EctBlock<NDIM> blk(seg, seg_of_dir, dirs, B, D, chunks_per_row);
    const Smem<Real> s = setup<Real>(smem, thresholds, nullptr, T, shared, true);
    double* acc_row = soft ? acc_g + blk.row * T : nullptr;
    long long* sat_row = sat_g + blk.row * T;
    const Accum a{s.acc, acc_row, s.sat, sat_row};
    Window<Real, ECT_PAIRS> win;
    // (the exact ECT's batches are lane-parallel, no passes: 32 entries a warp as they were)
    const int per_warp = soft ? blk.per_warp() : 32, lane = threadIdx.x % 32;
    // warp-uniform bounds: every lane takes part in forward_warp's votes
    for (i64 base = blk.begin + (i64)(threadIdx.x / 32) * per_warp; base < blk.end;
         base += (i64)WARPS * per_warp) {
        const i64 e = base + lane;
        int c = 0;
        Real f = 0;
        if (lane < per_warp && e < blk.end) {
            c = ent_c[e];
            double x[NDIM];
            position<NDIM>(ent_lin[e], coords, n0, n1, n2, x);
            f = (Real)height<NDIM>(x, blk.v);
        }
        forward_warp<Real>(c != 0, f, c, s.t, T, lam, w, soft != 0, a, win);
    }
    win.flush(a);
    if (shared) flush(soft ? s.acc : nullptr, s.sat, acc_row, sat_row, T);
    if (out == nullptr) return;  // (grid-uniform)
    if (last_block_done(done + blk.row, (unsigned)chunks_per_row) && threadIdx.x < 32)
        write_soft_row(sat_row, acc_row, out + blk.row * T, T);
}

// d_dirs (D, NDIM) float64 receives -lambda sum g c sigma' x_p (added; must be zeroed).
template <typename Real, int NDIM>
__global__ void __launch_bounds__(THREADS, (ect_min_blocks<Real, true>()))
ect_backward(const i64* __restrict__ ent_lin, const signed char* __restrict__ ent_c,
             const i64* __restrict__ seg, const int* __restrict__ seg_of_dir,
             const double* __restrict__ coords, const double* __restrict__ dirs,
             const Real* __restrict__ thresholds, const Real* __restrict__ g,
             double* __restrict__ d_dirs, double* __restrict__ dt_g, double* __restrict__ dscale_g,
             i64 n0, i64 n1, i64 n2, int B, int D, int chunks_per_row, int T, Real lam, double w,
             int shared, int need_dirs, int need_t, int need_scale) {
    extern __shared__ __align__(16) unsigned char smem[];
    __shared__ double scratch[WARPS];
    const EctBlock<NDIM> blk(seg, seg_of_dir, dirs, B, D, chunks_per_row);
    const Smem<Real> s = setup<Real>(smem, thresholds, g + blk.row * T, T, shared, false);
    const Accum a{s.acc, dt_g, nullptr, nullptr};
    GradWindow<Real, ECT_PAIRS> win;
    double dscale = 0.0;
    double dv[NDIM];
#pragma unroll
    for (int k = 0; k < NDIM; ++k) dv[k] = 0.0;
    const int per_warp = blk.per_warp(), lane = threadIdx.x % 32;
    for (i64 base = blk.begin + (i64)(threadIdx.x / 32) * per_warp; base < blk.end;
         base += (i64)WARPS * per_warp) {
        const i64 e = base + lane;
        int c = 0;
        Real f = 0;
        double x[NDIM] = {};
        if (lane < per_warp && e < blk.end) {
            c = ent_c[e];
            position<NDIM>(ent_lin[e], coords, n0, n1, n2, x);
            f = (Real)height<NDIM>(x, blk.v);
        }
        const double sum = backward_warp<Real>(c != 0, f, c, s.t, s.g, T, lam, w, need_t != 0,
                                               need_dirs != 0, dscale, a, win);
        if (need_dirs && sum != 0.0) {
#pragma unroll
            for (int k = 0; k < NDIM; ++k) dv[k] += sum * x[k];
        }
    }
    win.flush(a);
    if (shared && need_t) flush(s.acc, nullptr, dt_g, nullptr, T);
    if (need_scale) block_add(dscale, dscale_g, scratch);
    if (need_dirs) {
#pragma unroll
        for (int k = 0; k < NDIM; ++k)
            block_add(-(double)lam * dv[k], d_dirs + (i64)blk.d * NDIM + k, scratch);
    }
}

// ---------------------------------------------------------------------------------------------
// out (rows, T) = prefix sum of sat over the thresholds + acc, rounded once to Real; one warp
// per row.
template <typename Real>
__global__ void __launch_bounds__(THREADS)
soft_finalize(const long long* __restrict__ sat, const double* __restrict__ acc,
              Real* __restrict__ out, i64 rows, int T) {
    const i64 row = (i64)blockIdx.x * WARPS + threadIdx.x / 32;
    if (row >= rows) return;  // whole warps leave together: no block barrier below
    write_soft_row(sat + row * T, acc + row * T, out + row * T, T);
}

// ---------------------------------------------------------------------------------------------
// Contribution maps of the V construction per orthant (the ECT's Eucalc precomputation), read
// straight from the masks: image u * B + b of the output is orthant codes[u] of mask b. The key
// of a mask pixel is the sum over the axes of its index, reversed along the axes whose
// direction component is negative (bit a of the code clear: axis a counted from the high end),
// so the corner that matches sign(v) is the strict key maximum of every cell and owns it; a
// pixel outside the mask has the key `big`, above every mask key, and contributes 0. The same
// map as contributions of the key image where(mask, key, big) multiplied by the mask (the NumPy
// path, _ect._orthant_contributions), without that image or the two extra passes.
struct OrthantKey {
    const bool* mask;  // mask b, indexed by the pixel's position in its image
    i64 image_base;    // the output image's first element (the sweep passes global indices)
    i64 ny, nx;
    unsigned rz, ry, rx;  // per axis: n - 1 where the axis is reversed, else 0
    unsigned big;
    __device__ __forceinline__ unsigned operator()(i64 i) const {
        const i64 p = i - image_base;
        if (!mask[p]) return big;
        unsigned x, y, z;
        if ((p >> 32) == 0) {  // 32-bit divisions where they suffice (far fewer instructions)
            const unsigned q = (unsigned)p, w = (unsigned)nx, h = (unsigned)ny;
            const unsigned row = q / w;
            x = q - row * w;
            y = row % h;
            z = row / h;
        } else {
            const i64 row = p / nx;
            x = (unsigned)(p - row * nx);
            y = (unsigned)(row % ny);
            z = (unsigned)(row / ny);
        }
        // |r - i| with r = 0 (axis kept) or n - 1 (reversed): i or n - 1 - i
        return (rz ? rz - z : z) + (ry ? ry - y : y) + (rx ? rx - x : x);
    }
};

struct MaskedMapSink {
    signed char* out;
    unsigned big;  // the key of pixels outside the mask
    __device__ __forceinline__ void operator()(int c, u64 key, i64 i) const {
        out[i] = key == big ? (signed char)0 : (signed char)c;
    }
};

// The sweep of one block of orthant_contributions(_counted): image img = blockIdx.x /
// blocks_per_image of the output is orthant codes[img / B] of mask img % B.
template <int NDIM, class Sink>
__device__ __forceinline__ void orthant_sweep(unsigned (*tile)[PLANE], const bool* masks,
                                              const int* codes, i64 B, i64 nz, i64 ny, i64 nx,
                                              int zchunk, int blocks_per_image, const Sink& sink) {
    const i64 img = blockIdx.x / blocks_per_image;
    const int chunk = blockIdx.x % blocks_per_image;
    const i64 N = nz * ny * nx;
    const int code = codes[img / B];
    // axes in array order: bit 0 is axis 0 (z in 3D, y in 2D)
    const int bz = NDIM == 3 ? 0 : -1, by = NDIM == 3 ? 1 : 0, bx = NDIM == 3 ? 2 : 1;
    auto reversed = [&](int bit, i64 n) -> unsigned {
        return (bit >= 0 && !((code >> bit) & 1)) ? (unsigned)(n - 1) : 0u;
    };
    OrthantKey key_of{masks + (img % B) * N, img * N, ny, nx, reversed(bz, nz), reversed(by, ny),
                      reversed(bx, nx), sink.big};
    sweep<NDIM, false, unsigned>(tile, nz, ny, nx, zchunk, img * N, chunk, blocks_per_image,
                                 key_of, sink, AllPixels(), Boundary<false>());
}

__device__ __forceinline__ unsigned orthant_big(i64 nz, i64 ny, i64 nx) {
    return (unsigned)(nz - 1 + ny - 1 + nx - 1 + 1);
}

template <int NDIM>
__global__ void __launch_bounds__(THREADS)
orthant_contributions(const bool* __restrict__ masks, const int* __restrict__ codes,
                      signed char* __restrict__ out, i64 B, i64 nz, i64 ny, i64 nx, int zchunk,
                      int blocks_per_image) {
    __shared__ unsigned tile[NDIM == 3 ? 3 : 1][PLANE];
    orthant_sweep<NDIM>(tile, masks, codes, B, nz, ny, nx, zchunk, blocks_per_image,
                        MaskedMapSink{out, orthant_big(nz, ny, nx)});
}

// The map sink that also counts the non-zero contributions per COMPACT_TILE pixels of each
// output image (counts zeroed, rows x tiles): the count pass of the compaction, done while the
// map is written (orthant_contributions_counted, for write_entries_scanned).
struct CountingMapSink {
    signed char* out;
    unsigned big;
    unsigned long long* counts;
    i64 N, tiles;
    __device__ __forceinline__ void operator()(int c, u64 key, i64 i) const {
        const signed char v = key == big ? (signed char)0 : (signed char)c;
        out[i] = v;
        if (v != 0) {
            const i64 row = i / N;
            atomicAdd(counts + row * tiles + (i - row * N) / (THREADS * 16), 1ull);  // COMPACT_TILE
        }
    }
};

template <int NDIM>
__global__ void __launch_bounds__(THREADS)
orthant_contributions_counted(const bool* __restrict__ masks, const int* __restrict__ codes,
                              signed char* __restrict__ out, long long* __restrict__ counts,
                              i64 B, i64 nz, i64 ny, i64 nx, int zchunk, int blocks_per_image,
                              i64 tiles) {
    __shared__ unsigned tile[NDIM == 3 ? 3 : 1][PLANE];
    orthant_sweep<NDIM>(tile, masks, codes, B, nz, ny, nx, zchunk, blocks_per_image,
                        CountingMapSink{out, orthant_big(nz, ny, nx),
                                        reinterpret_cast<unsigned long long*>(counts),
                                        nz * ny * nx, tiles});
}

// ---------------------------------------------------------------------------------------------
// Entries of the ECT: the non-zero contributions of c (rows of N pixels, row-major) as
// lin (position in the row), cc (the value) and seg (rows + 1: the first entry of each row, the
// total last), in row-major order, as flatnonzero lists them. Three launches and one 8-byte read
// of the total (to size lin and cc) replace flatnonzero, whose count is a host synchronisation
// after several launches of its own: count_nonzero per tile of COMPACT_TILE pixels of a row,
// scan_counts (one block) to the tiles' first entries and seg, write_entries per tile.
constexpr int COMPACT_TILE = THREADS * 16;

__device__ __forceinline__ int tile_span(i64 N, i64 tiles, i64& row, i64& begin) {
    row = blockIdx.x / tiles;
    begin = (blockIdx.x - row * tiles) * COMPACT_TILE;
    return (int)min((i64)COMPACT_TILE, N - begin);
}

// counts[b]: the non-zero contributions of tile b (tile b % tiles of row b / tiles).
__global__ void __launch_bounds__(THREADS)
count_nonzero(const signed char* __restrict__ c, long long* __restrict__ counts, i64 N, i64 tiles) {
    __shared__ int warp_counts[WARPS];
    i64 row, begin;
    const int n = tile_span(N, tiles, row, begin);
    const signed char* p = c + row * N + begin;
    int k = 0;
    for (int i = threadIdx.x; i < n; i += THREADS) k += p[i] != 0;
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) k += __shfl_xor_sync(FULL, k, o);
    if (threadIdx.x % 32 == 0) warp_counts[threadIdx.x / 32] = k;
    __syncthreads();
    if (threadIdx.x == 0) {
        int total = 0;
        #pragma unroll
        for (int w = 0; w < WARPS; ++w) total += warp_counts[w];
        counts[blockIdx.x] = total;
    }
}

// counts (rows * tiles) -> their exclusive prefix sums in place; seg[r] = that of row r's first
// tile, seg[rows] = the total. One block walks the tiles THREADS at a time.
__global__ void __launch_bounds__(THREADS)
scan_counts(long long* __restrict__ counts, long long* __restrict__ seg, i64 rows, i64 tiles) {
    __shared__ long long warp_sums[WARPS];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const i64 m = rows * tiles;
    long long carry = 0;
    for (i64 base = 0; base < m; base += THREADS) {
        const i64 i = base + threadIdx.x;
        const long long v = i < m ? counts[i] : 0;
        long long x = v;  // inclusive scan over the warp
        #pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const long long y = __shfl_up_sync(FULL, x, o);
            if (lane >= o) x += y;
        }
        if (lane == 31) warp_sums[warp] = x;
        __syncthreads();
        long long before = 0, chunk = 0;
        #pragma unroll
        for (int w = 0; w < WARPS; ++w) {
            before += w < warp ? warp_sums[w] : 0;
            chunk += warp_sums[w];
        }
        if (i < m) {
            const long long first = carry + before + x - v;
            counts[i] = first;
            if (i % tiles == 0) seg[i / tiles] = first;
        }
        carry += chunk;
        __syncthreads();  // warp_sums is rewritten by the next pass
    }
    if (threadIdx.x == 0) seg[rows] = carry;
}

// The entries of tile b from its first entry `next`, in pixel order: each pass of THREADS
// pixels ranks its non-zero ones by warp ballots and the counts of the warps before.
__device__ __forceinline__ void write_tile(const signed char* c, long long next, long long* lin,
                                           signed char* cc, i64 N, i64 tiles, int* warp_counts) {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    i64 row, begin;
    const int n = tile_span(N, tiles, row, begin);
    const signed char* p = c + row * N + begin;
    for (int base = 0; base < n; base += THREADS) {
        const int i = base + threadIdx.x;
        const signed char v = i < n ? p[i] : (signed char)0;
        const unsigned ballot = __ballot_sync(FULL, v != 0);
        if (lane == 0) warp_counts[warp] = __popc(ballot);
        __syncthreads();
        int before = 0, pass = 0;
        #pragma unroll
        for (int w = 0; w < WARPS; ++w) {
            before += w < warp ? warp_counts[w] : 0;
            pass += warp_counts[w];
        }
        if (v != 0) {
            const long long e = next + before + __popc(ballot & ((1u << lane) - 1u));
            lin[e] = begin + i;
            cc[e] = v;
        }
        next += pass;
        __syncthreads();  // warp_counts is rewritten by the next pass
    }
}

// The entries of tile b from its first entry first[b] (scan_counts).
__global__ void __launch_bounds__(THREADS)
write_entries(const signed char* __restrict__ c, const long long* __restrict__ first,
              long long* __restrict__ lin, signed char* __restrict__ cc, i64 N, i64 tiles) {
    __shared__ int warp_counts[WARPS];
    write_tile(c, first[blockIdx.x], lin, cc, N, tiles, warp_counts);
}

// write_entries without scan_counts, for few tiles (SoftEctPlan: at most a few thousand): each
// block sums the counts of the tiles before it itself (counts, rows x tiles, from
// orthant_contributions_counted), the first tile of each row writes seg[row], the last tile
// seg[rows] (the total).
__global__ void __launch_bounds__(THREADS)
write_entries_scanned(const signed char* __restrict__ c, const long long* __restrict__ counts,
                      long long* __restrict__ lin, signed char* __restrict__ cc,
                      long long* __restrict__ seg, i64 N, i64 tiles) {
    __shared__ int warp_counts[WARPS];
    __shared__ long long warp_sums[WARPS];
    long long before = 0;
    for (i64 j = threadIdx.x; j < (i64)blockIdx.x; j += THREADS) before += counts[j];
    before = warp_sum(before);
    if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = before;
    __syncthreads();
    long long first = 0;
    #pragma unroll
    for (int w = 0; w < WARPS; ++w) first += warp_sums[w];
    if (threadIdx.x == 0) {
        if (blockIdx.x % tiles == 0) seg[blockIdx.x / tiles] = first;
        if (blockIdx.x == gridDim.x - 1) seg[gridDim.x / tiles] = first + counts[blockIdx.x];
    }
    write_tile(c, first, lin, cc, N, tiles, warp_counts);
}

// ---------------------------------------------------------------------------------------------
// The device-resident arguments of the soft ECT (cutopo/_band_cupy.py, SoftEctPlan), so that a
// call with device directions and thresholds reads none of them on the host: the thresholds'
// checks (flag bit 0: a value is not finite; bit 1: some t[k + 1] < t[k], a NaN comparing
// false, setting bit 0), and per direction d its
// float64 copy dirs64 (D, NDIM), its orthant code (bit a: v_a >= 0, so -0.0 counts as +, as
// on the host), and the flags bit 2 (a component is not finite), bit 3 (every component is
// zero) and bit 4 (sum |v_a| > 1e300: the heights might overflow float64, which the host then
// decides exactly). The ECT kernels stay in bounds on such arguments (codes are in
// [0, 2^NDIM) and loops are bounded); their output is never returned.
//
// The flags reach the host as prepare_cells' (cpab.cu) do, without a copy, an event or a
// memset per call (publish_grid_flags; `host` may be null).
template <typename Real, typename Dir, int NDIM>
__global__ void __launch_bounds__(THREADS)
check_ect_arguments(const Real* __restrict__ t, i64 T, const Dir* __restrict__ dirs, i64 D,
                    double* __restrict__ dirs64, int* __restrict__ codes,
                    unsigned long long* __restrict__ status, unsigned long long* __restrict__ host,
                    long long token) {
    const i64 stride = (i64)gridDim.x * blockDim.x;
    const i64 n = T > D ? T : D;
    unsigned bad = 0;
    for (i64 k = (i64)blockIdx.x * blockDim.x + threadIdx.x; k < n; k += stride) {
        if (k < T) {
            const Real v = t[k];
            if (!isfinite(v)) bad |= 1u;
            if (k + 1 < T && t[k + 1] < v) bad |= 2u;
        }
        if (k < D) {
            int code = 0;
            bool zero = true;
            double bound = 0.0;
#pragma unroll
            for (int a = 0; a < NDIM; ++a) {
                const double v = (double)dirs[k * NDIM + a];
                dirs64[k * NDIM + a] = v;
                if (!isfinite(v)) bad |= 4u;
                if (v != 0.0) zero = false;
                if (v >= 0.0) code |= 1 << a;
                bound += fabs(v);
            }
            if (zero) bad |= 8u;
            if (bound > 1e300) bad |= 16u;  // also for inf components (bit 2 decides first)
            codes[k] = code;
        }
    }
    publish_grid_flags(bad, status, host, token);
}

// The soft ECT's cotangents from SoftEctPlan's float64 workspace (d_dirs: n_dirs values, d_t: T,
// d_scale: 1, in that order), the thresholds' after the factor lambda, each converted to the
// dtype that its argument's cotangent has (or kept in double where that dtype is another:
// the one rounding is then the caller's): one launch in place of a scaling and three casts.
template <typename Dir, typename TOut, typename SOut>
__global__ void __launch_bounds__(THREADS)
ect_finish_cotangents(const double* __restrict__ ws, i64 n_dirs, i64 T, double lam,
                      Dir* __restrict__ d_dirs, TOut* __restrict__ d_t, SOut* __restrict__ d_scale) {
    const i64 stride = (i64)gridDim.x * blockDim.x;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i <= n_dirs + T; i += stride) {
        if (i < n_dirs) d_dirs[i] = (Dir)ws[i];
        else if (i < n_dirs + T) d_t[i - n_dirs] = (TOut)(ws[i] * lam);
        else d_scale[0] = (SOut)ws[i];
    }
}

}  // namespace band
}  // namespace ecc
}  // namespace cutopo
