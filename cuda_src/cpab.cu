// CPAB: continuous piecewise-affine velocity fields on simplex tessellations of [0, 1]^K, their
// integration (the transformation phi_theta), its log-Jacobian and its discrete adjoint.
// cutopo/cpab/integrate.py documents the scheme and holds the NumPy path these kernels are
// tested against; cutopo/cpab/_integrate_cupy.py plans the launches.
//
//   x_0 = P(points),   x_{t+1} = P(E_c(t) [x_t; 1]),   c(t) = cell(x_t),   E_c = expm(h A~_c)
//
// Bit-compatibility with the NumPy path. The point location and the step are evaluated in the
// points' dtype with the same roundings in the same order as NumPy (explicit __*_rn intrinsics,
// so the compiler cannot contract a product and a sum into one FMA), and the cell tests are
// exact (a filtered sign: the rounded sum where it is far from 0, else the sign of an exact
// expansion), so with the same step matrices E a trajectory is the NumPy trajectory bit for
// bit. E itself comes from expm_cells (Pade 13 with scaling and squaring in
// float64, as NumPy's _expm), equal to NumPy's up to float64 rounding. Float32 denormals flush
// to zero (CuPy compiles with -ftz=true): a point coordinate below 1.2e-38 counts as 0.
//
// Work layout.
//   cell_index, velocity     one thread per (batch item, point).
//   integrate_forward        one thread per (batch item, point), the whole trajectory in
//                            registers; optionally the checkpoints every S steps (for the VJP)
//                            and the log-Jacobian h * sum_t tr A_c(t).
//   integrate_backward       one thread per (batch item, point): segment by segment from the
//                            last checkpoint (the forward's, or with `recompute` the thread's
//                            own, from one forward pass into local memory: then no (T/S, B, N,
//                            K) array exists), recompute the S steps into local memory, sweep
//                            them backwards (lambda_t = E_lin^T (m_{t+1} lambda_{t+1}), in the
//                            points' dtype: Adjoint below) and add mu_{t+1} [x_t; 1]^T to the
//                            per-cell moments G_c (float64). A point stays in
//                            one cell for many consecutive steps, so the outer products are
//                            summed in registers while the cell does not change and flushed
//                            on a change (and at the end): into a per-warp queue in shared
//                            memory that the warp drains 32 entries at a time, the entries of
//                            one cell added together before one lane issues the float64
//                            atomics (MODE 2; MODE 1: the lanes flushing at the same step pool
//                            their sums; MODE 0: every lane its own atomics).
//   frechet_cells            one thread per cell: dL/dA_c = h [L(h A~_c^T, [G_c; 0])]_{:K}, the
//                            adjoint Frechet derivative of expm, by the Taylor series of Van
//                            Loan's block exponential (registers only: (K+1) x (K+1) blocks).
//   expm_cells               one thread per cell: E_c = expm(h A~_c), top K rows, in the
//                            points' dtype.
//   ell_product              A = B theta and dL/dtheta = B^T dL/dA with the sparse basis in ELL
//                            layout (at most K + 1 entries per row of B), one thread per row.
//   warp_forward,            transform_image fused: one thread per (batch item, pixel) makes
//   warp_backward            the pixel centre, integrates it and samples the image there (no
//                            grid array); the backward scatters the image cotangent and sweeps
//                            the trajectory back as integrate_backward does (section below).
//   step_guard               one thread per cell: integrate's step-size guard as a device flag
//                            (register's device steps).
//   prepare_cells            one thread per cell: a call's A = B theta, the guard's norm and
//                            E = expm(h A~); further blocks: the finiteness checks (grid-
//                            stride); the last block stores the flags and the norm in
//                            page-locked host memory.
// sampling.cuh (with common.cuh): the fused warp samples as grid_sample does
#include "sampling.cuh"

namespace cutopo {
namespace cpab {

constexpr int THREADS = 256;
constexpr int MAX_SEGMENT = 17;  // the largest checkpoint_every the backward supports
// The most checkpoints the backward recomputes into a thread's local memory (no checkpoint
// array from the forward): the host picks S >= ceil(T / MAX_LOCAL_CHECKPOINTS) for that mode.
constexpr int MAX_LOCAL_CHECKPOINTS = 16;

// -- roundings the compiler may not fuse: add_rn, mul_rn (common.cuh) -----------------------

// s + e == a + b exactly, s = fl(a + b) (Knuth's two-sum).
template <typename T>
__device__ __forceinline__ void two_sum(T a, T b, T& s, T& e) {
    s = add_rn(a, b);
    const T bv = add_rn(s, -a);
    e = add_rn(add_rn(a, -add_rn(s, -bv)), add_rn(b, -bv));
}

// The exact sign (-1, 0, 1) of t[0] + ... + t[N-1]: Shewchuk's grow-expansion turns the sum
// into non-overlapping components of increasing magnitude; the largest non-zero one has the
// sign of the sum. The same steps as cutopo.cpab.tessellation._sign_of_sum.
template <typename T, int N>
__device__ __forceinline__ int sign_of_sum(const T (&t)[N]) {
    T e[N];
    e[0] = t[0];
    #pragma unroll
    for (int i = 1; i < N; ++i) {
        T q = t[i];
        #pragma unroll
        for (int j = 0; j < i; ++j) {
            T s, h;
            two_sum(q, e[j], s, h);
            e[j] = h;
            q = s;
        }
        e[i] = q;
    }
    #pragma unroll
    for (int i = N - 1; i >= 0; --i) {
        if (e[i] > T(0)) return 1;
        if (e[i] < T(0)) return -1;
    }
    return 0;
}

// A bound on |fl(sum) - sum| for the cell tests' sums of at most 4 terms of magnitude <= 2
// (3 N ulp(4) and then some): a rounded sum beyond it has the exact sum's sign, so only sums
// closer to 0 need sign_of_sum.
template <typename T> struct SignBound;
template <> struct SignBound<float> { static __device__ __forceinline__ float value() { return 0x1p-16f; } };
template <> struct SignBound<double> { static __device__ __forceinline__ double value() { return 0x1p-45; } };

// Cells per axis; axis 0 varies fastest in the box number.
struct Grid {
    int n[3];
};

template <int K> struct Simplices;
template <> struct Simplices<1> { static constexpr int value = 1; };
template <> struct Simplices<2> { static constexpr int value = 4; };
template <> struct Simplices<3> { static constexpr int value = 5; };

// The simplex (0..4) of a point of a 3D box from its local coordinates (X, Y, Z): the first of
// the corner-tetrahedron tests "a X + b Y + c Z + d >= 0" that holds, in the order of
// tessellation._TET_TESTS,
//   even boxes: -X - Y + Z,      X + Y + Z - 2,   -X + Y - Z,       X - Y - Z,
//   odd boxes:   X - Y + Z - 1, -X + Y + Z - 1,   -X - Y - Z + 1,   X + Y - Z - 1,
// else 0 (the central tetrahedron). Without divergence: the parity's terms come from one
// select, o = 1 (odd) or 0, as exact products and sums (+-X = (2 o - 1) X; the constants -o,
// o - 2, o), the four sums formed in NumPy's order, and where every sum is clear of 0 by more
// than the filter's bound (almost always) the first positive one decides; otherwise the tests
// in order with their exact signs. Trying the tests one by one with early exits, a warp ran
// both parities' chains: the 3D register step's two warp kernels took 3.74 ms instead of 2.95
// (benchmarks/RESULTS.md). Compares and selects issue at half the rate of float adds and
// products (the ALU pipe), which bound the trajectory kernels: hence the products for the
// signs and one |s| compare per sum for the filter.
template <typename T>
__device__ __forceinline__ int tetrahedron(T X, T Y, T Z, bool odd) {
    const T o = odd ? T(1) : T(0);
    const T sign = add_rn(add_rn(o, o), T(-1));   // exact: 1 (odd) or -1
    const T sX = mul_rn(sign, X), sY = mul_rn(sign, Y);
    const T t[4][4] = {
        {sX, -Y, Z, -o},
        {-sX, Y, Z, add_rn(o, T(-2))},
        {-X, -sY, -Z, o},
        {X, sY, -Z, -o},
    };
    bool clear = true;
    bool positive[4];
    #pragma unroll
    for (int i = 0; i < 4; ++i) {
        const T s = add_rn(add_rn(add_rn(t[i][0], t[i][1]), t[i][2]), t[i][3]);
        clear &= fabs(s) > SignBound<T>::value();  // false for NaN, as the two tests were
        positive[i] = s > T(0);
    }
    if (clear) return positive[0] ? 1 : positive[1] ? 2 : positive[2] ? 3 : positive[3] ? 4 : 0;
    #pragma unroll
    for (int i = 0; i < 4; ++i)
        if (sign_of_sum(t[i]) >= 0) return i + 1;
    return 0;
}

// The cell holding x (already in the points' dtype), as cutopo.cpab.tessellation.cell_index:
// u = clip(x n, 0, n), box = min(floor(u), n - 1), local = u - box (exact), then the simplex.
// IN_BOX: the caller's x lies in [0, 1]^K (projected trajectories, pixel centres), so u is in
// [0, n] already (fl(x n) <= n for x <= 1) and the clip is left out. The clips are min/max,
// one instruction each (a NaN u becomes 0, as before: on bad input, which the call's checks
// raise, the kernels need only a cell in range). An int: Tessellation keeps K (K+1) n_cells
// below 2^31.
template <typename T, int K, bool IN_BOX = false>
__device__ __forceinline__ int cell_of(const T (&x)[K], const Grid& g) {
    T local[K];
    int box_number = 0;  // below n_cells < 2^31 (Tessellation's check)
    int parity = 0;
    #pragma unroll
    for (int k = K - 1; k >= 0; --k) {
        const T n = T(g.n[k]);
        T u = mul_rn(x[k], n);
        if (!IN_BOX) u = fmin(fmax(u, T(0)), n);
        const T b = fmin(floor(u), add_rn(n, T(-1)));
        local[k] = add_rn(u, -b);
        const int bi = (int)b;
        parity += bi;
        box_number = box_number * g.n[k] + bi;
    }
    int simplex = 0;
    if (K == 2) {
        // x + y > 1? Rounding is monotone, so fl(x + y) > 1 implies x + y > 1 and fl(x + y) < 1
        // implies x + y < 1: only fl(x + y) == 1 needs the exact sign.
        const T sum = add_rn(local[0], local[K - 1]);
        bool above_anti = sum > T(1);
        if (sum == T(1)) {
            const T t[3] = {local[0], local[K - 1], T(-1)};
            above_anti = sign_of_sum(t) > 0;
        }
        if (local[0] < local[K - 1]) simplex = above_anti ? 2 : 3;
        else simplex = above_anti ? 1 : 0;
    } else if (K == 3) {
        simplex = tetrahedron(local[0], local[1 % K], local[2 % K], parity & 1);
    }
    return Simplices<K>::value * box_number + simplex;
}

// A cell's K (K+1) matrix entries in 8- or 16-byte loads (rows start at multiples of
// K (K+1) elements, so every row is aligned for its vector width).
template <typename T, int W> struct Vec;
template <> struct Vec<float, 2> { typedef float2 type; };
template <> struct Vec<float, 4> { typedef float4 type; };
template <> struct Vec<double, 2> { typedef double2 type; };

template <typename T, int K>
__device__ __forceinline__ void load_cell(const T* __restrict__ p, T (&r)[K * (K + 1)]) {
    constexpr int W = (sizeof(T) == 4 && K == 3) ? 4 : 2;
    typedef typename Vec<T, W>::type V;
    const V* v = reinterpret_cast<const V*>(p);
    #pragma unroll
    for (int i = 0; i < K * (K + 1) / W; ++i) {
        const V t = __ldg(v + i);
        const T* e = reinterpret_cast<const T*>(&t);
        #pragma unroll
        for (int j = 0; j < W; ++j) r[i * W + j] = e[j];
    }
}

// The rows of one batch item's block of a per-cell table (width entries per cell), formed once
// per thread before its step loops. The empty asm hides where the pointer came from: otherwise
// the compiler folds the loop-invariant item offset back into every step's index (the PTX of
// the forward had, per step, a 64-bit multiply of the item offset, another of the sign-extended
// cell and 64-bit selects and adds, ~13 of its ~74 operations); from this pointer a step's
// index is one 32-bit multiply-wide and the loads take immediate offsets. On the H200 (kernels
// alternating in one process, bench_cpab's cases): forward 2D 0.384 -> 0.322 ms, 3D 0.650 ->
// 0.625; backward with moments 2D 1.01 -> 0.975, 3D 1.93 -> 1.87 (benchmarks/RESULTS.md).
template <typename T>
__device__ __forceinline__ const T* item_rows(const T* __restrict__ table, i64 cell_offset,
                                              int width) {
    const T* rows = table + cell_offset * width;
    asm("mov.b64 %0, %0;" : "+l"(rows));
    return rows;
}

// A thread's (batch item, point) and where its inputs live. Points are (Bp, N, K) with Bp 1
// (shared) or B; tables hold one block of C cells per theta batch item (Bt 1 or B).
struct Item {
    i64 b, n, idx, point_row, cell_offset;
};

__device__ __forceinline__ bool item_of(i64 B, i64 N, int points_shared, int theta_shared, i64 C,
                                        Item& it) {
    it.idx = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (it.idx >= B * N) return false;
    it.b = it.idx / N;
    it.n = it.idx - it.b * N;
    it.point_row = (points_shared ? 0 : it.b) * N + it.n;
    it.cell_offset = (theta_shared ? 0 : it.b) * C;
    return true;
}

// -- point location and the velocity field ---------------------------------------------------

template <typename T, int K>
__global__ void __launch_bounds__(THREADS)
cell_index(const T* __restrict__ points, i64* __restrict__ cells, i64 count, int n0, int n1, int n2) {
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= count) return;
    const Grid g = {{n0, n1, n2}};
    T x[K];
    #pragma unroll
    for (int k = 0; k < K; ++k) x[k] = points[i * K + k];
    cells[i] = cell_of<T, K>(x, g);
}

// v = A_c [x; 1] with x the nearest point of the box, A in the points' dtype, summed as NumPy
// does: A[:, K] + A[:, 0] x_0 + A[:, 1] x_1 + ...
template <typename T, int K>
__global__ void __launch_bounds__(THREADS)
velocity(const T* __restrict__ points, const T* __restrict__ A, T* __restrict__ out, i64 B, i64 N,
         i64 C, int points_shared, int theta_shared, int n0, int n1, int n2) {
    Item it;
    if (!item_of(B, N, points_shared, theta_shared, C, it)) return;
    const Grid g = {{n0, n1, n2}};
    T x[K];
    #pragma unroll
    for (int k = 0; k < K; ++k) {
        const T v = points[it.point_row * K + k];
        x[k] = v > T(0) ? (v < T(1) ? v : T(1)) : T(0);
    }
    T a[K * (K + 1)];
    load_cell<T, K>(A + (it.cell_offset + cell_of<T, K>(x, g)) * (K * (K + 1)), a);
    #pragma unroll
    for (int k = 0; k < K; ++k) {
        T v = a[k * (K + 1) + K];
        #pragma unroll
        for (int q = 0; q < K; ++q) v = add_rn(v, mul_rn(a[k * (K + 1) + q], x[q]));
        out[it.idx * K + k] = v;
    }
}

// -- the step --------------------------------------------------------------------------------

// P on one coordinate: clip to [0, 1]. Float: one saturating add (the float pipe), no
// compares and selects (the ALU pipe, half rate); "left alone" is then one compare, x == y.
// A NaN becomes 0 (the kernels stay in the box on bad input, which the call's checks raise).
__device__ __forceinline__ float unit_clip(float y) { return __saturatef(y); }
__device__ __forceinline__ double unit_clip(double y) { return fmin(fmax(y, 0.0), 1.0); }

// y = E_c [x; 1] in the points' dtype (NumPy's order), then P. `E_item`: the item's rows of E
// (item_rows). Returns the cell within the item's block and sets bit k of `inside` when P left
// coordinate k alone. Under P x stays in [0, 1]^K (x_0 = P(points) or a pixel centre), so the
// cell's clip is left out (cell_of's IN_BOX). The trajectory kernels are bound by the ALU
// pipe's half-rate compares, selects and min/max, not by their float adds: with the clips as
// min/max or left out, P as a saturating add, and the tetrahedron's parity as products, a
// step went from ~67 to ~40 instructions in 2D (26 -> 9 of them ALU) and from ~138 to ~87
// in 3D (~68 -> ~21); on the H200 the forward kernel 0.324 -> 0.205 ms (2D b32 256^2, tess
// 16) and 0.615 -> 0.371 ms (3D 128^3, tess 10), the backward with theta 0.843 -> 0.790 and
// 1.506 -> 1.431 ms, trajectories unchanged bit for bit (benchmarks/RESULTS.md, twenty-sixth
// session). Taking floor and its int from u + 2^23 rounded down instead of FRND and F2I (the
// conversion unit) measured 4 % slower.
template <typename T, int K, bool PROJECT>
__device__ __forceinline__ int step(T (&x)[K], const T* __restrict__ E_item, const Grid& g,
                                    int& inside) {
    const int cell = cell_of<T, K, PROJECT>(x, g);
    T e[K * (K + 1)];
    load_cell<T, K>(E_item + cell * (K * (K + 1)), e);
    T y[K];
    #pragma unroll
    for (int k = 0; k < K; ++k) {
        T v = e[k * (K + 1) + K];
        #pragma unroll
        for (int q = 0; q < K; ++q) v = add_rn(v, mul_rn(e[k * (K + 1) + q], x[q]));
        y[k] = v;
    }
    inside = 0;
    #pragma unroll
    for (int k = 0; k < K; ++k) {
        if (PROJECT) {
            x[k] = unit_clip(y[k]);
            inside |= (int)(x[k] == y[k]) << k;
        } else {
            x[k] = y[k];
        }
    }
    return cell;
}

template <typename T, int K, bool PROJECT>
__device__ __forceinline__ void start_point(const T* __restrict__ points, i64 row, T (&x)[K], int& inside0) {
    inside0 = 0;
    #pragma unroll
    for (int k = 0; k < K; ++k) {
        const T v = points[row * K + k];
        if (PROJECT) {
            x[k] = unit_clip(v);
            inside0 |= (int)(x[k] == v) << k;
        } else {
            x[k] = v;
        }
    }
}

// The n_steps steps of one trajectory from x, in segments of S: x_0, x_S, ... to `chk` (planes
// `plane` apart) before each segment when KEEP, the sum of the cells' traces in `total` when LOG_DET. The
// segment loop replaces a per-step "is this a checkpoint" test (an integer compare and select
// each step; the trajectory kernels are bound by such ALU-pipe instructions) and the template
// flags the per-step predicated loads and adds of the trace.
template <typename T, int K, bool PROJECT, bool KEEP, bool LOG_DET>
__device__ __forceinline__ void forward_steps(T (&x)[K], const T* __restrict__ E_item,
                                              const double* __restrict__ trace_item, const Grid& g,
                                              int n_steps, int S, T* __restrict__ chk, i64 plane,
                                              double& total) {
    int inside;
    for (int t0 = 0; t0 < n_steps; t0 += S) {
        if (KEEP) {
            #pragma unroll
            for (int k = 0; k < K; ++k) chk[k] = x[k];
            chk += plane;
        }
        const int end = min(n_steps, t0 + S);
        for (int t = t0; t < end; ++t) {
            const int cell = step<T, K, PROJECT>(x, E_item, g, inside);
            if (LOG_DET) total += trace_item[cell];
        }
    }
}

// The forward. `checkpoints` (ceil(T/S), B, N, K) receives x_t for t = 0, S, 2S, ... when
// `keep` is set; `log_det` (B, N) receives h * sum_t trace[c(t)] (summed in float64, rounded
// once, as NumPy) when `with_log_det` is set. Unused arrays may be empty or null.
template <typename T, int K, bool PROJECT>
__global__ void __launch_bounds__(THREADS)
integrate_forward(const T* __restrict__ points, const T* __restrict__ E, T* __restrict__ out,
                  T* __restrict__ checkpoints, const double* __restrict__ trace,
                  T* __restrict__ log_det, i64 B, i64 N, i64 C, double h, int points_shared,
                  int theta_shared, int n_steps, int S, int keep, int with_log_det, int n0, int n1,
                  int n2) {
    Item it;
    if (!item_of(B, N, points_shared, theta_shared, C, it)) return;
    const Grid g = {{n0, n1, n2}};
    T x[K];
    int inside;
    start_point<T, K, PROJECT>(points, it.point_row, x, inside);
    double total = 0.0;
    const i64 plane = B * N * K;
    const T* E_item = item_rows(E, it.cell_offset, K * (K + 1));
    const double* trace_item = with_log_det ? item_rows(trace, it.cell_offset, 1) : trace;
    T* chk = keep ? checkpoints + it.idx * K : checkpoints;
    const int seg = max(keep ? S : n_steps, 1);  // the host's S >= 1; a bound loop regardless
    if (keep && with_log_det)
        forward_steps<T, K, PROJECT, true, true>(x, E_item, trace_item, g, n_steps, seg, chk, plane, total);
    else if (keep)
        forward_steps<T, K, PROJECT, true, false>(x, E_item, trace_item, g, n_steps, seg, chk, plane, total);
    else if (with_log_det)
        forward_steps<T, K, PROJECT, false, true>(x, E_item, trace_item, g, n_steps, seg, chk, plane, total);
    else
        forward_steps<T, K, PROJECT, false, false>(x, E_item, trace_item, g, n_steps, seg, chk, plane, total);
    #pragma unroll
    for (int k = 0; k < K; ++k) out[it.idx * K + k] = x[k];
    if (with_log_det) log_det[it.idx] = (T)(h * total);
}

// -- the adjoint -----------------------------------------------------------------------------

constexpr int WARPS = THREADS / 32;

// The adjoint's arithmetic: lambda, mu and the per-run moment sums in the trajectory's type;
// G's sums over the runs and the stored point cotangents stay float64. For float32 trajectories
// float64 there cost a conversion of each E entry and coordinate per step and FP64 arithmetic
// at half rate: the backward with theta measured 1.006 -> 0.895 ms (2D b32 256^2, tess 16)
// and 1.924 -> 1.670 ms (3D 128^3, tess 10; no more spills) in float32, the cotangents within
// 4e-7 (points) and 1.3e-5 (theta) of the largest against the float64 adjoint
// (benchmarks/RESULTS.md, twenty-fifth session). -DCUTOPO_CPAB_ADJOINT_DOUBLE=1: float64.
#ifndef CUTOPO_CPAB_ADJOINT_DOUBLE
#define CUTOPO_CPAB_ADJOINT_DOUBLE 0
#endif
template <typename T> struct Adjoint { typedef T type; };
#if CUTOPO_CPAB_ADJOINT_DOUBLE
template <> struct Adjoint<float> { typedef double type; };
#endif

// Per-thread sums of mu [x; 1]^T for the run of steps spent in one cell: `cell` within the
// item's block of cells (-1: none yet), G's row `cell_offset + cell`. A 32-bit cell keeps the
// step's comparison and the 3D backward's registers (80, at their bound) small.
template <int K, typename A>
struct Moments {
    static constexpr int SIZE = K * (K + 1);
    int cell;
    A g[SIZE];

    __device__ __forceinline__ void reset(int c) {
        cell = c;
        #pragma unroll
        for (int i = 0; i < SIZE; ++i) g[i] = A(0);
    }

    // G's row of the sums, -1 for none
    __device__ __forceinline__ i64 row(i64 cell_offset) const {
        return cell >= 0 ? cell_offset + cell : (i64)-1;
    }
};

// Add the sums of every lane of the warp that flushes now into G: lanes flushing the same cell
// pool their sums through shared memory and the lowest of them issues the atomics (MODE 1; MODE
// 0: every lane its own). `scratch` is this warp's 32 * SIZE doubles. Lanes may belong to
// different batch items: they pool by G's row.
template <int K, int MODE, typename A>
__device__ __forceinline__ void flush(const Moments<K, A>& m, i64 cell_offset, double* __restrict__ G,
                                      double* scratch) {
    constexpr int SIZE = K * (K + 1);
    const i64 row = m.row(cell_offset);
    if (MODE == 0) {  // every lane adds its own sums
        if (row >= 0)
            #pragma unroll
            for (int i = 0; i < SIZE; ++i)
                if (m.g[i] != A(0)) atomicAdd(G + row * SIZE + i, (double)m.g[i]);
        return;
    }
    const unsigned active = __activemask();
    const int lane = threadIdx.x & 31;
    const unsigned group = __match_any_sync(active, (unsigned long long)row);
    #pragma unroll
    for (int i = 0; i < SIZE; ++i) scratch[i * 32 + lane] = (double)m.g[i];
    __syncwarp(active);
    if (lane == __ffs(group) - 1 && row >= 0) {
        double sum[SIZE];
        #pragma unroll
        for (int i = 0; i < SIZE; ++i) sum[i] = (double)m.g[i];
        for (unsigned rest = group & (group - 1); rest; rest &= rest - 1) {
            const int other = __ffs(rest) - 1;
            #pragma unroll
            for (int i = 0; i < SIZE; ++i) sum[i] += scratch[i * 32 + other];
        }
        double* dst = G + row * SIZE;
        #pragma unroll
        for (int i = 0; i < SIZE; ++i)
            if (sum[i] != 0.0) atomicAdd(dst + i, sum[i]);
    }
    __syncwarp(active);
}

// MODE 2: a lane done with a cell appends its sums to a queue of 32 entries per warp in shared
// memory (a ballot gives each appending lane its slot); when the next appends would not fit,
// and at the end, the whole warp drains it: the entries of one cell, from any lanes and any
// steps, are added together and added to G. A trajectory changes cell every ~10 steps, so
// nearly every step some lane of a warp flushes: MODE 1 paid a warp-wide flush (match, shared
// exchange, atomics) at almost every step, this a ballot per step and a drain every few. A warp
// with exited lanes (the grid's tail) adds directly (MODE 0).
// `storage`: this warp's MomentQueue::BYTES (32 slots of PITCH sums of type E, then 32 cells).
// The entries keep the sums in the adjoint's type A, so a push stores them as they are (float64
// entries for float32 sums cost each push a conversion, and its flush of float32 denormals,
// per sum); the drain adds a cell's entries in A and widens the total for the atomic. Float32
// backward with theta on the H200: 2D 0.909 -> 0.845 ms, 3D 1.673 -> 1.599 ms, theta within
// 4e-6 of the largest (twenty-fifth session). -DCUTOPO_QUEUE_DOUBLE_ENTRIES=1: float64 entries.
//
// The drain's atomics go out SIZE lanes to a cell, a cell's SIZE consecutive doubles (3 or 1.5
// sectors) in one instruction: one lane per cell issuing SIZE atomics sent every sum in a
// sector of its own, and at fine tessellations (a warp's 32 entries in ~20 cells) the L2's
// atomic throughput bounded the backward: 3D 128^3 tess 30, 2.34 ms, 1.57 without the atomics
// (-DCUTOPO_PROFILE_MOMENTS=1), 1.07 without the queue (=2). Who adds a cell's entries: with
// few cells in the queue (at most PER, one round), the lanes, each one sum over the cell's
// entries (add_by_lanes); with more, in 3D, a leader lane per cell adds all SIZE sums of its
// entries, in parallel over the cells, and the sums move to the first slots for the lanes'
// atomics (add_by_leaders; in 2D, 5 cells per round, the lanes alone measured 1-2 % faster,
// with 13 registers fewer). The VJP (bench_cpab.py, H200, twenty-eighth session, old and new
// trees alternating in one call, 3 rounds, ms): 3D 128^3 tess 2 0.95-1.01 -> 0.88-0.89, tess 10
// 1.55-1.61 -> 1.35-1.42, tess 30 1.99-2.64 -> 1.59-1.73; 2D b32 256^2 tess 16 0.76-0.78 ->
// 0.71-0.73, tess 64 1.33-1.43 -> 1.24-1.25. The entries are slot-major, a slot's sums in
// whole 16-byte words (3D float: a push is 3 vector stores instead of 12, the shared-memory
// pipe's work per push), the cells 32-bit (a 32-bit match and store), and the queue is sized
// by its entries' type (it was 32 * (SIZE + 1) doubles whatever the type; 3D 27 -> 13 KB per
// block, more of L1 for the local arrays): backward with theta 2-6 % faster (3D tess 10
// 1.303 -> 1.229 ms, tess 30 1.700 -> 1.609, 2D tess 16 0.744 -> 0.729, tess 64 1.275 ->
// 1.240; one process, twenty-eighth session).
//
// -DCUTOPO_PROFILE_MOMENTS=1 / 2 / 3 (profiling only: the theta cotangent is then wrong): 1
// drains the queue without its atomics, 2 keeps the per-lane moments but queues nothing (a push
// only tests them against a value they never take, so that they are still computed), 3 pushes
// but drains nothing.
#ifndef CUTOPO_QUEUE_DOUBLE_ENTRIES
#define CUTOPO_QUEUE_DOUBLE_ENTRIES 0
#endif
#ifndef CUTOPO_PROFILE_MOMENTS
#define CUTOPO_PROFILE_MOMENTS 0
#endif
template <typename A> struct QueueEntry {
#if CUTOPO_QUEUE_DOUBLE_ENTRIES
    typedef double type;
#else
    typedef A type;
#endif
};

template <int K, typename A>
struct MomentQueue {
    static constexpr int SIZE = K * (K + 1);
    typedef typename QueueEntry<A>::type E;
    static constexpr int W = 16 / (int)sizeof(E);        // entries per 16-byte word
    static constexpr int PITCH = (SIZE + W - 1) / W * W;  // a slot's sums in whole words
    static constexpr int PER = 32 / SIZE;       // cells a drain adds to G per instruction
    static constexpr bool BY_LEADERS = K == 3;  // drains of more than PER cells: add_by_leaders
    typedef int Key;  // G's row: the host keeps a call's cells below 2^31 (MAX_CELL_ROWS)
    // bytes of one warp's queue: 32 slots of PITCH sums, then 32 cells
    static constexpr int BYTES = 32 * PITCH * (int)sizeof(E) + 32 * (int)sizeof(Key);
    E* val;         // slot s's sum i at val[s * PITCH + i]
    Key* cell;
    unsigned live;  // the lanes running the sweep
    int n;          // entries queued (the same in every lane)

    __device__ __forceinline__ MomentQueue(double* storage, unsigned live_lanes)
        : val(reinterpret_cast<E*>(storage)),
          cell(reinterpret_cast<Key*>(reinterpret_cast<char*>(storage) + 32 * PITCH * sizeof(E))),
          live(live_lanes), n(0) {}

    // slot s's SIZE sums, in 16-byte words where the pitch allows
    __device__ __forceinline__ void store_slot(int s, const E (&g)[SIZE]) const {
        E* dst = val + s * PITCH;
        #pragma unroll
        for (int j = 0; j + W <= SIZE; j += W) {
            typename Vec<E, W>::type v;
            E* e = reinterpret_cast<E*>(&v);
            #pragma unroll
            for (int w = 0; w < W; ++w) e[w] = g[j + w];
            *reinterpret_cast<typename Vec<E, W>::type*>(dst + j) = v;
        }
        if constexpr (SIZE % W != 0) {  // 2D float: the last 2 sums
            constexpr int R = SIZE % W, J = SIZE - R;
            typename Vec<E, R>::type v;
            E* e = reinterpret_cast<E*>(&v);
            #pragma unroll
            for (int w = 0; w < R; ++w) e[w] = g[J + w];
            *reinterpret_cast<typename Vec<E, R>::type*>(dst + J) = v;
        }
    }

    __device__ __forceinline__ void load_slot(int s, E (&g)[SIZE]) const {
        const E* src = val + s * PITCH;
        #pragma unroll
        for (int j = 0; j + W <= SIZE; j += W) {
            const typename Vec<E, W>::type v = *reinterpret_cast<const typename Vec<E, W>::type*>(src + j);
            const E* e = reinterpret_cast<const E*>(&v);
            #pragma unroll
            for (int w = 0; w < W; ++w) g[j + w] = e[w];
        }
        if constexpr (SIZE % W != 0) {
            constexpr int R = SIZE % W, J = SIZE - R;
            const typename Vec<E, R>::type v = *reinterpret_cast<const typename Vec<E, R>::type*>(src + J);
            const E* e = reinterpret_cast<const E*>(&v);
            #pragma unroll
            for (int w = 0; w < R; ++w) g[J + w] = e[w];
        }
    }

    __device__ __forceinline__ static bool wanted(E v) {
        return CUTOPO_PROFILE_MOMENTS == 1 ? (double)v == 0x1.234p-999 : v != E(0);
    }

    // The leader of each cell adds its entries, the sums move to the first slots (in the
    // leaders' order), then the warp adds them to G PER cells per instruction.
    __device__ __forceinline__ void add_by_leaders(double* __restrict__ G, Key c, unsigned group,
                                                   bool leader, unsigned leaders, int groups,
                                                   int part, int i) {
        const int lane = threadIdx.x & 31;
        E sum[SIZE];
        if (leader) {
            load_slot(lane, sum);
            for (unsigned rest = group & (group - 1); rest; rest &= rest - 1) {
                E g[SIZE];
                load_slot(__ffs(rest) - 1, g);
                #pragma unroll
                for (int q = 0; q < SIZE; ++q) sum[q] += g[q];
            }
        }
        __syncwarp(live);  // every entry read before the sums take the first slots
        if (leader) {
            const int r = __popc(leaders & ((1u << lane) - 1u));
            store_slot(r, sum);
            cell[r] = c;
        }
        __syncwarp(live);
        for (int base = 0; base < groups; base += PER) {
            const int r = base + part;
            if (part < PER && r < groups) {
                const E v = val[r * PITCH + i];
                if (wanted(v)) atomicAdd(G + (i64)cell[r] * SIZE + i, (double)v);
            }
        }
    }

    // PER cells a round: the lanes of each add one sum over that cell's entries each.
    __device__ __forceinline__ void add_by_lanes(double* __restrict__ G, Key c, unsigned group,
                                                 unsigned leaders, int part, int i) {
        for (unsigned rest = leaders; rest;) {  // warp-uniform
            int mine_leader = -1;
            #pragma unroll
            for (int p = 0; p < PER; ++p) {
                const int l = __ffs(rest) - 1;
                if (p == part) mine_leader = l;
                rest &= rest - 1;
            }
            const unsigned members = __shfl_sync(live, group, mine_leader & 31);
            const Key cc = __shfl_sync(live, c, mine_leader & 31);
            if (part < PER && mine_leader >= 0) {
                E v = E(0);
                for (unsigned m = members; m; m &= m - 1) v += val[(__ffs(m) - 1) * PITCH + i];
                if (wanted(v)) atomicAdd(G + (i64)cc * SIZE + i, (double)v);
            }
        }
    }

    __device__ __forceinline__ void drain(double* __restrict__ G) {
        __syncwarp(live);
        if (CUTOPO_PROFILE_MOMENTS == 3) {  // profiling: the pushes without their drains
            n = 0;
            return;
        }
        const int lane = threadIdx.x & 31;
        const bool mine = lane < n;
        const Key c = mine ? cell[lane] : (Key)(-1 - lane);  // idle lanes: keys of their own
        const unsigned group = __match_any_sync(live, c);
        const bool leader = mine && lane == __ffs(group) - 1;
        const unsigned leaders = __ballot_sync(live, leader);
        const int groups = __popc(leaders);
        const int part = lane / SIZE, i = lane - part * SIZE;
        if (BY_LEADERS && groups > PER)
            add_by_leaders(G, c, group, leader, leaders, groups, part, i);
        else
            add_by_lanes(G, c, group, leaders, part, i);
        n = 0;
        __syncwarp(live);
    }

    // Every lane of `live` calls this at the same point; the lanes with `has` hand in m, whose
    // item's block of G starts at row `cell_offset`.
    __device__ __forceinline__ void push(const Moments<K, A>& m, bool has, i64 cell_offset,
                                         double* __restrict__ G) {
        if (CUTOPO_PROFILE_MOMENTS == 2) {
            A total = A(0);
            #pragma unroll
            for (int i = 0; i < SIZE; ++i) total += m.g[i];
            if (has && (double)total == 0x1.234p-999) atomicAdd(G, 1.0);
            return;
        }
        const unsigned who = __ballot_sync(live, has);
        if (!who) return;
        if (live != 0xffffffffu) {
            if (has) flush<K, 0>(m, cell_offset, G, nullptr);
            return;
        }
        const int k = __popc(who);
        if (n + k > 32) drain(G);
        if (has) {
            const int slot = n + __popc(who & ((1u << (threadIdx.x & 31)) - 1u));
            E g[SIZE];
            #pragma unroll
            for (int i = 0; i < SIZE; ++i) g[i] = (E)m.g[i];
            cell[slot] = (Key)(cell_offset + m.cell);
            store_slot(slot, g);
        }
        n += k;
    }
};

// Shared doubles per warp that moment mode MODE needs (trajectories of type T).
template <typename T, int K, int MODE> struct MomentScratch {
    static constexpr int value =
        MODE == 0 ? 0
        : MODE == 1 ? 32 * K * (K + 1)
        : (MomentQueue<K, typename Adjoint<T>::type>::BYTES + 15) / 16 * 2;  // 16-byte slots
};

// The forward once more, x_t kept at t = 0, S, 2S, ... in `own` (the same steps in the same
// order as integrate_forward, so the same values); x ends at x_T.
template <typename T, int K, bool PROJECT>
__device__ __forceinline__ void recompute_checkpoints(T (&x)[K], const T* __restrict__ E_item,
                                                      const Grid& g, int n_steps, int S,
                                                      T (&own)[MAX_LOCAL_CHECKPOINTS][K]) {
    int inside;
    for (int t = 0, next = 0, slot = 0; t < n_steps; ++t) {
        if (t == next) {
            #pragma unroll
            for (int k = 0; k < K; ++k) own[slot][k] = x[k];
            ++slot;
            next += S;
        }
        step<T, K, PROJECT>(x, E_item, g, inside);
    }
}

// lambda_T -> lambda_0 (in place) through the trajectory, segment by segment from the last
// checkpoint: `own` (recompute) or the forward's `checkpoints` at row `row` of planes of
// `plane` elements. `E_item`: the item's rows of E (item_rows), its block starting at cell
// `cell_offset` of G. Adds mu_{t+1} [x_t; 1]^T to G when `need_theta`. MODE: how the moments
// reach G (0: per-lane atomics, 1: warp-pooled at each flush, 2: a per-warp queue), with
// `my_scratch` the warp's MomentScratch doubles; `live`: the lanes of the warp that run the
// sweep (all with the same n_steps and S, so they run its loops in step).
template <typename T, int K, bool PROJECT, int MODE>
__device__ __forceinline__ void adjoint_sweep(
        typename Adjoint<T>::type (&lam)[K], const T* __restrict__ E_item, i64 cell_offset, const Grid& g,
        int n_steps, int S, bool recompute, const T (&own)[MAX_LOCAL_CHECKPOINTS][K],
        const T* __restrict__ checkpoints, i64 row, i64 plane, double* __restrict__ G,
        int need_theta, double* my_scratch, unsigned live) {
    typedef typename Adjoint<T>::type A;
    MomentQueue<K, A> queue(my_scratch, live);
    // The segment's steps in local memory (indexed at run time), as compact as they go: x_t,
    // and one word of the cell within the item's block of cells with P's mask in its low K
    // bits (Tessellation keeps K (K+1) n_cells < 2^31, so the cell is below 2^(31-K)). These
    // arrays are most of the L1 working set (~210 KB per SM at 2D's 4 blocks), whose misses
    // to L2 bound the backward as much as its instructions do (Nsight Compute: L1 hit rate
    // 65-74 %, L2 56-76 % busy); one word instead of an int and a byte: 2D 1.08 -> 1.03 ms
    // (benchmarks/RESULTS.md, twenty-second session; 16-bit words gained nothing more).
    T xs[MAX_SEGMENT][K];
    unsigned words[MAX_SEGMENT];
    Moments<K, A> m;
    m.reset(-1);
    const int segments = (n_steps + S - 1) / S;
    for (int j = segments - 1; j >= 0; --j) {
        const int L = min(S, n_steps - j * S);
        T x[K];
        #pragma unroll
        for (int k = 0; k < K; ++k)
            x[k] = recompute ? own[j][k] : checkpoints[(i64)j * plane + row * K + k];
        for (int i = 0; i < L; ++i) {
            #pragma unroll
            for (int k = 0; k < K; ++k) xs[i][k] = x[k];
            int inside;
            const unsigned cell = (unsigned)step<T, K, PROJECT>(x, E_item, g, inside);
            words[i] = PROJECT ? cell << K | (unsigned)inside : cell;
        }
        for (int i = L - 1; i >= 0; --i) {
            const unsigned word = words[i];
            const int cell = (int)(PROJECT ? word >> K : word);
            const int inside = PROJECT ? (int)(word & ((1u << K) - 1)) : 0;
            A mu[K];
            #pragma unroll
            for (int k = 0; k < K; ++k)
                mu[k] = (!PROJECT || ((inside >> k) & 1)) ? lam[k] : A(0);
            T e[K * (K + 1)];
            load_cell<T, K>(E_item + cell * (K * (K + 1)), e);
            #pragma unroll
            for (int q = 0; q < K; ++q) {
                A v = A(0);
                #pragma unroll
                for (int k = 0; k < K; ++k) v += convert<A>(e[k * (K + 1) + q]) * mu[k];
                lam[q] = v;
            }
            if (need_theta) {
                const bool change = cell != m.cell;
                if (MODE == 2) {
                    queue.push(m, change && m.cell >= 0, cell_offset, G);
                } else if (change && m.cell >= 0) {
                    flush<K, MODE>(m, cell_offset, G, my_scratch);
                }
                if (change) m.reset(cell);
                // x_t widened once per step (the inline cvt is not merged across the k loop)
                A xd[K];
                #pragma unroll
                for (int q = 0; q < K; ++q) xd[q] = convert<A>(xs[i][q]);
                #pragma unroll
                for (int k = 0; k < K; ++k) {
                    #pragma unroll
                    for (int q = 0; q < K; ++q) m.g[k * (K + 1) + q] += mu[k] * xd[q];
                    m.g[k * (K + 1) + K] += mu[k];
                }
            }
        }
    }
    if (need_theta) {
        if (MODE == 2) {
            queue.push(m, m.cell >= 0, cell_offset, G);
            if (queue.n) queue.drain(G);
        } else {
            flush<K, MODE>(m, cell_offset, G, my_scratch);
        }
    }
}

// The backward: `cotangent` (B, N, K) in the points' dtype (read as float64 here: no float64
// copy of it, 2x its size, exists), `grad_points` (B, N, K) float64 out
// (m_0 lambda_0, not yet summed over a shared batch), `G` (Bt C, K (K+1)) float64 moments
// accumulated when `need_theta`. Checkpoints as integrate_forward keeps them, or none with
// `recompute` (ceil(n_steps / S) <= MAX_LOCAL_CHECKPOINTS, the host's promise).
template <typename T, int K, bool PROJECT, int MODE>
__device__ __forceinline__ void backward_item(
        const Item& it, const T* __restrict__ points, const T* __restrict__ E,
        const T* __restrict__ checkpoints, const T* __restrict__ cotangent,
        double* __restrict__ grad_points, double* __restrict__ G, i64 B, i64 N, int n_steps, int S,
        int need_points, int need_theta, int recompute, const Grid& g, double* my_scratch,
        unsigned live) {
    typedef typename Adjoint<T>::type A;
    A lam[K];
    #pragma unroll
    for (int k = 0; k < K; ++k) lam[k] = convert<A>(cotangent[it.idx * K + k]);
    T own[MAX_LOCAL_CHECKPOINTS][K];
    const T* E_item = item_rows(E, it.cell_offset, K * (K + 1));
    if (recompute) {
        T x[K];
        int inside;
        start_point<T, K, PROJECT>(points, it.point_row, x, inside);
        recompute_checkpoints<T, K, PROJECT>(x, E_item, g, n_steps, S, own);
    }
    adjoint_sweep<T, K, PROJECT, MODE>(lam, E_item, it.cell_offset, g, n_steps, S, recompute != 0, own,
                                       checkpoints, it.idx, B * N * K, G, need_theta, my_scratch,
                                       live);
    if (need_points) {
        int inside0 = (1 << K) - 1;
        if (PROJECT) {
            T x0[K];
            start_point<T, K, PROJECT>(points, it.point_row, x0, inside0);
        }
        #pragma unroll
        for (int k = 0; k < K; ++k)
            grad_points[it.idx * K + k] = ((inside0 >> k) & 1) ? (double)lam[k] : 0.0;
    }
}

// Blocks per SM the backward's registers are sized for, float32 trajectories: 3 in 3D, where
// the queue's bookkeeping would otherwise take 97 registers (2 blocks/SM); 4 in 2D, which fits
// 64 registers without spills (ptxas' own choice, 78, leaves 3 blocks/SM; on the H200, b32
// 256^2 tess 16: points-only backward 0.59 -> 0.56 ms, recomputed checkpoints 1.25 -> 1.22,
// with moments unchanged at 1.07; 5 blocks spill: 0.89 / 1.32 / 1.21). With the float32
// adjoint (53 and 76 registers) 5 blocks in 2D and 4 in 3D measured within noise of these
// (-1 % to +3 % over two calls, twenty-fifth session). float64 trajectories keep ptxas'
// choice (they would spill at 80). -DCUTOPO_BACKWARD_MIN_BLOCKS_2D=N / _3D=N to profile others.
#ifndef CUTOPO_BACKWARD_MIN_BLOCKS_2D
#define CUTOPO_BACKWARD_MIN_BLOCKS_2D 4
#endif
#ifndef CUTOPO_BACKWARD_MIN_BLOCKS_3D
#define CUTOPO_BACKWARD_MIN_BLOCKS_3D 3
#endif
template <typename T, int K> struct BackwardBlocks {
    static constexpr int value = sizeof(T) != 4 ? 1 : K == 3 ? CUTOPO_BACKWARD_MIN_BLOCKS_3D
                                                  : K == 2 ? CUTOPO_BACKWARD_MIN_BLOCKS_2D : 1;
};

template <typename T, int K, bool PROJECT, int MODE>
__global__ void __launch_bounds__(THREADS, (BackwardBlocks<T, K>::value))
integrate_backward(const T* __restrict__ points, const T* __restrict__ E,
                   const T* __restrict__ checkpoints, const T* __restrict__ cotangent,
                   double* __restrict__ grad_points, double* __restrict__ G, i64 B, i64 N, i64 C,
                   int points_shared, int theta_shared, int n_steps, int S, int need_points,
                   int need_theta, int recompute, int n0, int n1, int n2) {
    constexpr int PER_WARP = MomentScratch<T, K, MODE>::value;
    __shared__ __align__(16) double scratch[MODE >= 1 ? WARPS * PER_WARP : 1];
    Item it;
    const bool valid = item_of(B, N, points_shared, theta_shared, C, it);
    const unsigned live = __ballot_sync(0xffffffffu, valid);
    if (valid) {
        const Grid g = {{n0, n1, n2}};
        backward_item<T, K, PROJECT, MODE>(it, points, E, checkpoints, cotangent, grad_points, G, B,
                                           N, n_steps, S, need_points, need_theta, recompute, g,
                                           scratch + (threadIdx.x / 32) * PER_WARP, live);
    }
}

// -- transform_image: the trajectory and the sample in one thread --------------------------------
//
// out[b, c, p] = image[b, c](phi_b(x_p)) with x_p the centre of output pixel p: one thread per
// (batch item, pixel) computes the centre, integrates it (registers) and samples every channel
// at x_T, so no (B, *spatial, K) grid exists. The backward recomputes the trajectory with its
// checkpoints in local memory, scatters the image cotangent (atomics) and turns the sample's
// point cotangent into lambda_T for the adjoint sweep. Every operation is the composed path's
// (cutopo/cpab/transform.py: integrate, then grid_sample at 2 phi[..., ::-1] - 1 with
// align_corners=False) with the same roundings, so both give the same output.

// A warp kernel thread's (batch item, pixel) among B items of S pixels, and its item's block
// of cells: item_of's counterpart for the kernels that make their own points.
struct Pixel {
    i64 S, idx, b, p, cell_offset;
};

__device__ __forceinline__ bool pixel_of(i64 B, i64 S, i64 C, int theta_shared, Pixel& px) {
    px.S = S;
    px.idx = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (px.idx >= B * S) return false;
    px.b = px.idx / S;
    px.p = px.idx - px.b * S;
    px.cell_offset = (theta_shared ? 0 : px.b) * C;
    return true;
}

// The centre of pixel p (C order) of a grid of dims.size: ((i_k + 1/2) / size_k) in float64,
// rounded once to T, as transform.pixel_centres.
template <typename T, int K>
__device__ __forceinline__ void pixel_centre(i64 p, const sampling::Dims<i64, K>& dims, T (&x)[K]) {
    #pragma unroll
    for (int k = K - 1; k >= 0; --k) {
        const i64 n = dims.size[k];
        const i64 q = p / n;
        x[k] = (T)div_rn((double)(p - q * n) + 0.5, (double)n);
        p = q;
    }
}

// The corners and weights around x_T: grid_sample's normalised coordinate x first, 2 x - 1
// rounded in T (transform._to_normalised), widened to R (exact), align_corners=False.
template <typename T, typename R, int K, bool NEAREST>
__device__ __forceinline__ void sample_cell(const T (&x)[K], const sampling::Dims<i64, K>& dims,
                                            int padding, sampling::Cell<R, K, NEAREST>& cell) {
    R gn[K];
    #pragma unroll
    for (int k = 0; k < K; ++k) gn[K - 1 - k] = convert<R>(sub_rn(mul_rn(T(2), x[k]), T(1)));
    cell.setup(gn, dims, padding, false);
}

// Blocks per multiprocessor warp_forward's register budget is sized for, with float32
// trajectories and samples (-DCUTOPO_WARP_FORWARD_MIN_BLOCKS=N to profile others). The step loop
// is a chain of dependent loads and needs few registers, but ptxas sized the whole kernel for
// the sampling after it (75 in 3D: 3 blocks of 256 threads per SM); 6 blocks (40 registers, the
// spills in the sampling, once per thread) measured 1.09 -> 0.89 ms at 128^3 before the
// uniform cell tests, 8 blocks no better (benchmarks/RESULTS.md).
#ifndef CUTOPO_WARP_FORWARD_MIN_BLOCKS
#define CUTOPO_WARP_FORWARD_MIN_BLOCKS 6
#endif

// A warp kernel's minimum blocks per multiprocessor: BLOCKS for float32 trajectories (T) and
// samples (R), 1 (ptxas' choice) otherwise.
template <int BLOCKS, typename T, typename R>
struct Float32Blocks {
    static constexpr int value = sizeof(T) == 4 && sizeof(R) == 4 ? BLOCKS : 1;
};

// image (Bi, channels, S) with Bi 1 (shared) or B, out (B, channels, S), E as integrate's.
// With `keep`, checkpoints (ceil(n_steps / S_seg), B, S, K) receives x_t at t = 0, S_seg, ...
// for a backward that does not recompute them.
template <typename T, typename TI, typename R, typename O, int K, bool PROJECT, bool NEAREST>
__global__ void __launch_bounds__(THREADS, (Float32Blocks<CUTOPO_WARP_FORWARD_MIN_BLOCKS, T, R>::value))
warp_forward(const T* __restrict__ E, const TI* __restrict__ image, O* __restrict__ out,
             T* __restrict__ checkpoints, i64 B, i64 C, int theta_shared, int image_shared,
             int channels, int n_steps, int S_seg, int keep, int padding, int n0, int n1, int n2,
             int d, int h, int w) {
    const sampling::Dims<i64, K> dims(d, h, w);
    Pixel px;
    if (!pixel_of(B, dims.stride[0] * dims.size[0], C, theta_shared, px)) return;
    const i64 S = px.S, idx = px.idx, b = px.b, p = px.p, cell_offset = px.cell_offset;
    const Grid g = {{n0, n1, n2}};
    T x[K];
    pixel_centre<T, K>(p, dims, x);  // inside the box: P leaves it alone
    int inside;
    const i64 plane = B * S * K;
    const T* E_item = item_rows(E, cell_offset, K * (K + 1));
    for (int t = 0, next = 0, slot = 0; t < n_steps; ++t) {
        if (keep && t == next) {
            #pragma unroll
            for (int k = 0; k < K; ++k) checkpoints[(i64)slot * plane + idx * K + k] = x[k];
            ++slot;
            next += S_seg;
        }
        step<T, K, PROJECT>(x, E_item, g, inside);
    }
    sampling::Cell<R, K, NEAREST> cell;
    sample_cell<T, R, K, NEAREST>(x, dims, padding, cell);
    const TI* img = image + (image_shared ? 0 : b) * channels * S;
    for (int c = 0; c < channels; ++c) {
        R acc = R(0);
        #pragma unroll
        for (int k = 0; k < cell.K; ++k)
            if (cell.in(k)) acc = add_rn(acc, mul_rn(cell.wt[k], sampling::load<R>(img + c * S + cell.pix[k])));
        sampling::store(out + (b * channels + c) * S + p, acc);
    }
}

// Blocks per multiprocessor warp_backward's register budget is sized for, with float32
// trajectories and samples (-DCUTOPO_WARP_BACKWARD_MIN_BLOCKS=N to profile others). Left to
// itself ptxas took 93 registers in 3D, 2 blocks of 256 threads per SM (25 % occupancy) for a
// latency-bound kernel; 3 blocks (80 registers, 32 B more local memory) measured 3.16 -> 2.70
// ms at 128^3, 4 blocks 2.75 ms (benchmarks/RESULTS.md). Float64 trajectories or samples would
// spill past the compile test's budget: they keep ptxas' choice.
#ifndef CUTOPO_WARP_BACKWARD_MIN_BLOCKS
#define CUTOPO_WARP_BACKWARD_MIN_BLOCKS 3
#endif
// How its moments reach G (adjoint_sweep's MODE; -DCUTOPO_WARP_BACKWARD_MOMENTS=1 to compare).
#ifndef CUTOPO_WARP_BACKWARD_MOMENTS
#define CUTOPO_WARP_BACKWARD_MOMENTS 2
#endif

// gout (B, channels, S) in R; dimage (Bi, channels, S) in R, zero-initialised, when
// `need_image`; G as integrate_backward's when `need_theta` (bilinear only: nearest sampling
// is piecewise constant, its theta cotangent zero). S_seg: the checkpoint segment; with
// `recompute` the thread recomputes its checkpoints into local memory (ceil(n_steps / S_seg)
// <= MAX_LOCAL_CHECKPOINTS, the host's promise), else it reads warp_forward's.
template <typename T, typename TI, typename R, int K, bool PROJECT, bool NEAREST>
__global__ void __launch_bounds__(THREADS, (Float32Blocks<CUTOPO_WARP_BACKWARD_MIN_BLOCKS, T, R>::value))
warp_backward(const T* __restrict__ E, const TI* __restrict__ image, const R* __restrict__ gout,
              R* __restrict__ dimage, double* __restrict__ G, const T* __restrict__ checkpoints,
              i64 B, i64 C, int theta_shared, int image_shared, int channels, int n_steps,
              int S_seg, int recompute, int padding, int need_image, int need_theta, int n0,
              int n1, int n2, int d, int h, int w) {
    constexpr int PER_WARP = MomentScratch<T, K, CUTOPO_WARP_BACKWARD_MOMENTS>::value;
    __shared__ __align__(16) double scratch[WARPS * PER_WARP];
    const sampling::Dims<i64, K> dims(d, h, w);
    Pixel px;
    const bool valid = pixel_of(B, dims.stride[0] * dims.size[0], C, theta_shared, px);
    const unsigned live = __ballot_sync(0xffffffffu, valid);
    if (!valid) return;
    const i64 S = px.S, idx = px.idx, b = px.b, p = px.p, cell_offset = px.cell_offset;
    const Grid g = {{n0, n1, n2}};
    const bool theta_wanted = need_theta && !NEAREST;
    const i64 plane = B * S * K;
    const T* E_item = item_rows(E, cell_offset, K * (K + 1));
    T x[K];
    T own[MAX_LOCAL_CHECKPOINTS][K];
    int inside;
    if (theta_wanted && !recompute) {  // x_T from the last checkpoint
        const int last = (n_steps - 1) / S_seg;
        #pragma unroll
        for (int k = 0; k < K; ++k) x[k] = checkpoints[(i64)last * plane + idx * K + k];
        for (int t = last * S_seg; t < n_steps; ++t) step<T, K, PROJECT>(x, E_item, g, inside);
    } else {
        pixel_centre<T, K>(p, dims, x);
        if (theta_wanted)
            recompute_checkpoints<T, K, PROJECT>(x, E_item, g, n_steps, S_seg, own);
        else
            for (int t = 0; t < n_steps; ++t) step<T, K, PROJECT>(x, E_item, g, inside);
    }
    sampling::Cell<R, K, NEAREST> cell;
    sample_cell<T, R, K, NEAREST>(x, dims, padding, cell);
    constexpr int KC = sampling::Cell<R, K, NEAREST>::K;
    const i64 image_row = (image_shared ? 0 : b) * channels;
    R s[KC];  // per corner: sum over channels of value times output cotangent
    #pragma unroll
    for (int k = 0; k < KC; ++k) s[k] = R(0);
    for (int c = 0; c < channels; ++c) {
        const R go = gout[(b * channels + c) * S + p];
        const TI* img = image + (image_row + c) * S;
        #pragma unroll
        for (int k = 0; k < KC; ++k) {
            if (!cell.in(k)) continue;
            if (theta_wanted) s[k] = add_rn(s[k], mul_rn(sampling::load<R>(img + cell.pix[k]), go));
            if (need_image) atomicAdd(dimage + (image_row + c) * S + cell.pix[k], mul_rn(cell.wt[k], go));
        }
    }
    if (!theta_wanted) return;
    // grid_sample's grid cotangent along image axis a (sampling.cu, backward_item), then
    // transform._from_normalised_cotangent: d phi_a = 2 d grid_{K-1-a}, exact in R and float64.
    typedef typename Adjoint<T>::type A;
    A lam[K];
    #pragma unroll
    for (int a = 0; a < K; ++a) {
        R gx = R(0);
        #pragma unroll
        for (int k = 0; k < KC; ++k) {
            R dw = cell.offset(k, a) ? s[k] : -s[k];
            #pragma unroll
            for (int q = 0; q < K; ++q)
                if (q != a) dw = mul_rn(dw, cell.w[q][cell.offset(k, q)]);
            gx = add_rn(gx, dw);
        }
        lam[a] = convert<A>(mul_rn(R(2), mul_rn(gx, cell.dx[a])));
    }
    adjoint_sweep<T, K, PROJECT, CUTOPO_WARP_BACKWARD_MOMENTS>(
        lam, E_item, cell_offset, g, n_steps, S_seg, recompute != 0, own, checkpoints, idx, plane, G, 1,
        scratch + (threadIdx.x / 32) * PER_WARP, live);
}

// -- the step-size guard on the device ----------------------------------------------------------

// Bit 1 of *flags when h max_c ||A_c,lin||_F > max_norm (integrate's check_step_size), bit 2
// when an entry of A is not finite: register's device steps read the flags once per chunk of
// steps instead of once per step.
template <int K>
__global__ void __launch_bounds__(THREADS)
step_guard(const double* __restrict__ A, i64 cells, int n_steps, double max_norm,
           int* __restrict__ flags) {
    const i64 c = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= cells) return;
    double s = 0.0;
    bool finite = true;
    #pragma unroll
    for (int k = 0; k < K; ++k)
        #pragma unroll
        for (int q = 0; q <= K; ++q) {
            const double a = A[c * (K * (K + 1)) + k * (K + 1) + q];
            finite &= isfinite(a);
            if (q < K) s += a * a;
        }
    const int bad = (finite ? 0 : 2) | (sqrt(s) / n_steps > max_norm ? 1 : 0);
    if (bad) atomicOr(flags, bad);
}

// -- the sparse basis: A = B theta and dL/dtheta = B^T dL/dA -----------------------------------

// y[b, r] = sum_j val[j, r] x[b, idx[j, r]] in float64, in the order of the CSR rows (ELL layout:
// every row padded to R entries with zeros, entry j of all rows together, so that a warp's
// rows read their j-th entries in one coalesced load: B^T dL/dA 0.125-0.129 -> 0.050 ms at 2D
// b32 tess 64, 0.084 -> 0.046-0.055 at 3D tess 30 against row-major tables, H200, twenty-eighth
// session). B has at most K + 1 entries per row, B^T at most (K + 1) times the cells around a
// vertex, so one thread per output row and batch item.
template <typename T>
__global__ void __launch_bounds__(THREADS)
ell_product(const int* __restrict__ idx, const double* __restrict__ val, const T* __restrict__ x,
            double* __restrict__ y, i64 rows, i64 cols, i64 batch, int R) {
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= rows * batch) return;
    const i64 b = i / rows, r = i - b * rows;
    const T* xb = x + b * cols;
    double acc = 0.0;
    // no columns (a tessellation without free parameters): the padding's column 0 is no entry
    if (cols > 0)
        for (int j = 0; j < R; ++j) acc += val[j * rows + r] * convert<double>(xb[idx[j * rows + r]]);
    y[i] = acc;
}

// -- per-cell matrix exponentials --------------------------------------------------------------

// Pade(13, 13) numerator coefficients divided by the first (a zero matrix gives exactly I).
__constant__ double PADE_13[14] = {
    1.0, 0.5, 0.12, 0.018333333333333333, 0.0019927536231884057, 0.00016304347826086958,
    1.0351966873706003e-05, 5.175983436853002e-07, 2.0431513566525008e-08,
    6.306022705717595e-10, 1.48377004840414e-11, 2.529153491597966e-13,
    2.8101705462199623e-15, 1.5440497506703088e-17};  // repr() of NumPy's _PADE_13: same doubles
constexpr double THETA_13 = 5.371920351148152;  // Higham (2005): Pade 13 is accurate below it

// Loops over M x M matrices are unrolled (matrices in registers) up to M = 4, the size of
// every caller's matrices (K + 1); a larger M would stay rolled over local arrays.
template <int M> struct UNROLL { static constexpr int value = M <= 4 ? M : 1; };

template <int M>
__device__ __forceinline__ void matmul(const double (&a)[M][M], const double (&b)[M][M], double (&c)[M][M]) {
    #pragma unroll (UNROLL<M>::value)
    for (int i = 0; i < M; ++i)
        #pragma unroll (UNROLL<M>::value)
        for (int j = 0; j < M; ++j) {
            double s = 0.0;
            #pragma unroll (UNROLL<M>::value)
            for (int l = 0; l < M; ++l) s += a[i][l] * b[l][j];
            c[i][j] = s;
        }
}

// A <- expm(A): scaling by 2^-s with s the smallest s >= 0 such that ||A||_1 2^-s <= THETA_13
// (NumPy: ceil(log2(||A||_1 / THETA_13)), here exactly from the exponent), Pade(13, 13) with
// Higham's even/odd split, one LU solve with partial pivoting, s squarings.
template <int M>
__device__ void expm_inplace(double (&A)[M][M]) {
    double norm1 = 0.0;
    #pragma unroll (UNROLL<M>::value)
    for (int j = 0; j < M; ++j) {
        double col = 0.0;
        #pragma unroll (UNROLL<M>::value)
        for (int i = 0; i < M; ++i) col += fabs(A[i][j]);
        norm1 = fmax(norm1, col);
    }
    int s = 0;
    if (norm1 > 0.0) {
        int e;
        const double f = frexp(norm1 / THETA_13, &e);  // = f 2^e, f in [0.5, 1)
        s = max(f == 0.5 ? e - 1 : e, 0);
    }
    const double scale = ldexp(1.0, -s);
    double X[M][M], X2[M][M], X4[M][M], X6[M][M], U[M][M], V[M][M];
    #pragma unroll (UNROLL<M>::value)
    for (int i = 0; i < M; ++i)
        #pragma unroll (UNROLL<M>::value)
        for (int j = 0; j < M; ++j) X[i][j] = A[i][j] * scale;
    matmul<M>(X, X, X2);
    matmul<M>(X2, X2, X4);
    matmul<M>(X4, X2, X6);
    const double* b = PADE_13;
    // U = X (X6 (b13 X6 + b11 X4 + b9 X2) + b7 X6 + b5 X4 + b3 X2 + b1 I)
    // V = X6 (b12 X6 + b10 X4 + b8 X2) + b6 X6 + b4 X4 + b2 X2 + b0 I
    #pragma unroll (UNROLL<M>::value)
    for (int i = 0; i < M; ++i)
        #pragma unroll (UNROLL<M>::value)
        for (int j = 0; j < M; ++j) {
            U[i][j] = b[13] * X6[i][j] + b[11] * X4[i][j] + b[9] * X2[i][j];
            V[i][j] = b[12] * X6[i][j] + b[10] * X4[i][j] + b[8] * X2[i][j];
        }
    matmul<M>(X6, U, A);  // A is scratch from here on
    #pragma unroll (UNROLL<M>::value)
    for (int i = 0; i < M; ++i)
        #pragma unroll (UNROLL<M>::value)
        for (int j = 0; j < M; ++j)
            U[i][j] = A[i][j] + b[7] * X6[i][j] + b[5] * X4[i][j] + b[3] * X2[i][j] + (i == j ? b[1] : 0.0);
    matmul<M>(X6, V, A);
    #pragma unroll (UNROLL<M>::value)
    for (int i = 0; i < M; ++i)
        #pragma unroll (UNROLL<M>::value)
        for (int j = 0; j < M; ++j)
            V[i][j] = A[i][j] + b[6] * X6[i][j] + b[4] * X4[i][j] + b[2] * X2[i][j] + (i == j ? b[0] : 0.0);
    matmul<M>(X, U, X2);  // X2 = U from here on
    // Solve (V - U) R = (V + U): LU with partial pivoting on P = V - U, right-hand sides in X4.
    #pragma unroll (UNROLL<M>::value)
    for (int i = 0; i < M; ++i)
        #pragma unroll (UNROLL<M>::value)
        for (int j = 0; j < M; ++j) {
            X6[i][j] = V[i][j] - X2[i][j];
            X4[i][j] = V[i][j] + X2[i][j];
        }
    #pragma unroll (UNROLL<M>::value)
    for (int c = 0; c < M; ++c) {
        int p = c;
        #pragma unroll (UNROLL<M>::value)
        for (int r = c + 1; r < M; ++r)
            if (fabs(X6[r][c]) > fabs(X6[p][c])) p = r;
        if (p != c)
            #pragma unroll (UNROLL<M>::value)
            for (int j = 0; j < M; ++j) {
                double t = X6[c][j]; X6[c][j] = X6[p][j]; X6[p][j] = t;
                t = X4[c][j]; X4[c][j] = X4[p][j]; X4[p][j] = t;
            }
        const double inv = 1.0 / X6[c][c];
        #pragma unroll (UNROLL<M>::value)
        for (int r = c + 1; r < M; ++r) {
            const double f = X6[r][c] * inv;
            if (f == 0.0) continue;
            #pragma unroll (UNROLL<M>::value)
            for (int j = c; j < M; ++j) X6[r][j] -= f * X6[c][j];
            #pragma unroll (UNROLL<M>::value)
            for (int j = 0; j < M; ++j) X4[r][j] -= f * X4[c][j];
        }
    }
    #pragma unroll (UNROLL<M>::value)
    for (int c = M - 1; c >= 0; --c)
        #pragma unroll (UNROLL<M>::value)
        for (int j = 0; j < M; ++j) {
            double v = X4[c][j];
            #pragma unroll (UNROLL<M>::value)
            for (int l = c + 1; l < M; ++l) v -= X6[c][l] * A[l][j];
            A[c][j] = v / X6[c][c];
        }
    #pragma unroll (UNROLL<M>::value)
    for (int i = 0; i < s; ++i) {
        matmul<M>(A, A, X);
        #pragma unroll (UNROLL<M>::value)
        for (int r = 0; r < M; ++r)
            #pragma unroll (UNROLL<M>::value)
            for (int j = 0; j < M; ++j) A[r][j] = X[r][j];
    }
}

// E_c = top K rows of expm(h A~_c), A (cells, K, K+1) float64 -> E (cells, K, K+1) in T.
template <typename T, int K>
__global__ void __launch_bounds__(128)
expm_cells(const double* __restrict__ A, T* __restrict__ E, i64 cells, double h) {
    const i64 c = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= cells) return;
    double M[K + 1][K + 1];
    for (int k = 0; k < K; ++k)
        for (int q = 0; q <= K; ++q) M[k][q] = h * A[c * (K * (K + 1)) + k * (K + 1) + q];
    for (int q = 0; q <= K; ++q) M[K][q] = 0.0;
    expm_inplace<K + 1>(M);
    for (int k = 0; k < K; ++k)
        for (int q = 0; q <= K; ++q) E[c * (K * (K + 1)) + k * (K + 1) + q] = (T)M[k][q];
}

// -- a call's cells and argument checks in one launch ------------------------------------------

// The per-call set-up of an integrate / log_jacobian / transform_image call in one launch (each
// launch costs 10-50 us of host time on the device machines, where a call's host time had come
// to exceed its forward kernel's): blocks [0, cell_blocks) take one (theta item b, cell c) per
// thread: A_c = rows of B theta_b (ell_product's sums in its order: the same A), the step-size
// guard's norm ||A_c,lin||_F and E_c = expm(h A~_c) (expm_cells' steps); the blocks after them
// test the finiteness of `points` and `theta` (grid-stride). A (items C, K, K+1) float64, E the
// same in the points' dtype T.
//
// The checks reach the host without a copy, an event or a memset per call
// (cutopo._cuda.deferred.PinnedStatus; together ~25 us of host time per call there): the blocks
// reduce into `status` (zero at rest: flags, largest norm, finished blocks; one atomic per
// warp), and the last block to finish (the finished-block count, after a fence in every warp
// that reduced) takes the totals, zeroes `status` for the next launch and, where `host` is not
// null, stores the norm in host[1] and then (token << 2) | flags in host[0] (mapped page-locked
// memory, after a system fence: the host reads host[1] once host[0] carries its token). Flags:
// bit 0 when a coordinate of `points` is not finite, bit 1 when an entry of `theta` is. The norm
// is stored as the bits of a non-negative double, whose unsigned order is the numeric order
// (NaN, possible only with a non-finite theta, orders above +inf).
template <typename TT, typename T, int K>
__global__ void __launch_bounds__(128)
prepare_cells(const int* __restrict__ idx, const double* __restrict__ val, int R,
              const TT* __restrict__ theta, i64 d, i64 items, i64 C, double* __restrict__ A,
              T* __restrict__ E, double h, const T* __restrict__ points, i64 n_points,
              i64 cell_blocks, unsigned long long* __restrict__ status,
              unsigned long long* __restrict__ host, long long token) {
    constexpr int SIZE = K * (K + 1);
    const bool lane0 = (threadIdx.x & 31) == 0;
    if ((i64)blockIdx.x >= cell_blocks) {  // the finiteness checks
        const i64 stride = ((i64)gridDim.x - cell_blocks) * blockDim.x;
        const i64 first = ((i64)blockIdx.x - cell_blocks) * blockDim.x + threadIdx.x;
        unsigned bad = 0;
        for (i64 i = first; i < n_points; i += stride)
            if (!isfinite(points[i])) bad |= 1u;
        for (i64 i = first; i < items * d; i += stride)
            if (!isfinite(theta[i])) bad |= 2u;
        bad = __reduce_or_sync(0xffffffffu, bad);
        if (lane0 && bad) {
            atomicOr(status, (unsigned long long)bad);
            __threadfence();
        }
    } else {
        const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
        const bool valid = i < items * C;
        double M[K + 1][K + 1];
        unsigned long long largest = 0;
        if (valid) {
            const i64 b = i / C, c = i - b * C;
            const TT* tb = theta + b * d;
            const i64 rows = C * SIZE;  // B's (ELL tables entry-major, as ell_product reads them)
            #pragma unroll
            for (int j = 0; j < SIZE; ++j) {
                const i64 r = c * SIZE + j;
                double acc = 0.0;
                if (d > 0)  // else B has no columns, and the padding's column 0 no entry
                    for (int s = 0; s < R; ++s) acc += val[s * rows + r] * convert<double>(tb[idx[s * rows + r]]);
                A[i * SIZE + j] = acc;
                M[j / (K + 1)][j % (K + 1)] = acc;
            }
            double norm2 = 0.0;
            #pragma unroll
            for (int k = 0; k < K; ++k)
                #pragma unroll
                for (int q = 0; q < K; ++q) norm2 += M[k][q] * M[k][q];
            largest = (unsigned long long)__double_as_longlong(sqrt(norm2));
        }
        #pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const unsigned long long other = __shfl_xor_sync(0xffffffffu, largest, o);
            largest = other > largest ? other : largest;
        }
        if (lane0 && largest) {
            atomicMax(status + 1, largest);
            __threadfence();
        }
        if (valid) {
            #pragma unroll
            for (int k = 0; k < K; ++k)
                #pragma unroll
                for (int q = 0; q <= K; ++q) M[k][q] = h * M[k][q];
            #pragma unroll
            for (int q = 0; q <= K; ++q) M[K][q] = 0.0;
            expm_inplace<K + 1>(M);
            for (int k = 0; k < K; ++k)
                for (int q = 0; q <= K; ++q) E[i * SIZE + k * (K + 1) + q] = (T)M[k][q];
        }
    }
    __syncthreads();  // this block's reductions are fenced
    if (threadIdx.x == 0 &&
        atomicAdd(status + 2, 1ull) == (unsigned long long)gridDim.x - 1) {  // the last block
        __threadfence();
        const unsigned long long flags = atomicExch(status, 0ull);
        const unsigned long long norm = atomicExch(status + 1, 0ull);
        atomicExch(status + 2, 0ull);
        if (host != nullptr) {
            volatile unsigned long long* word = host;
            word[1] = norm;
            __threadfence_system();  // the norm lands before the token that releases it
            word[0] = ((unsigned long long)token << 2) | flags;
        }
    }
}

// L(Y, Z), the Frechet derivative of expm at Y in the direction Z, for (K+1) x (K+1) matrices
// in registers: the top-right block of expm([[Y, Z], [0, Y]]) (Van Loan) by its Taylor series
// with scaling and squaring. With X = Y / 2^s, D = Z / 2^s and ||X||_1 <= 1/2, the series'
// blocks P_k = X^k / k! and Q_k = (X Q_{k-1} + D P_{k-1}) / k (the top-right block of W^k / k!)
// are summed to k = FRECHET_TERMS (the remainder is below 0.5^19 / 19! ~ 1e-22 of the sum), then
// s squarings of [[E, L], [0, E]] give E <- E E, L <- E L + L E. Small norms are the rule here
// (the step-size guard bounds h ||A_c,lin||), so s is usually 0.
constexpr int FRECHET_TERMS = 18;

template <int M>
__device__ __forceinline__ void expm_frechet(const double (&Y)[M][M], const double (&Z)[M][M],
                                             double (&L)[M][M]) {
    double norm1 = 0.0;
    #pragma unroll
    for (int j = 0; j < M; ++j) {
        double col = 0.0;
        #pragma unroll
        for (int i = 0; i < M; ++i) col += fabs(Y[i][j]);
        norm1 = fmax(norm1, col);
    }
    int s = 0;
    if (norm1 > 0.5) {
        int e;
        const double f = frexp(norm1 / 0.5, &e);  // norm1 / 0.5 = f 2^e, f in [0.5, 1)
        s = f == 0.5 ? e - 1 : e;
    }
    const double scale = ldexp(1.0, -s);
    double X[M][M], D[M][M], P[M][M], Q[M][M], E[M][M], T[M][M], U[M][M];
    #pragma unroll
    for (int i = 0; i < M; ++i)
        #pragma unroll
        for (int j = 0; j < M; ++j) {
            X[i][j] = Y[i][j] * scale;
            D[i][j] = Z[i][j] * scale;
            P[i][j] = i == j ? 1.0 : 0.0;
            E[i][j] = P[i][j];
            Q[i][j] = 0.0;
            L[i][j] = 0.0;
        }
    for (int k = 1; k <= FRECHET_TERMS; ++k) {
        const double inv = 1.0 / k;
        matmul<M>(X, Q, T);   // X Q_{k-1}
        matmul<M>(D, P, U);   // D P_{k-1}
        #pragma unroll
        for (int i = 0; i < M; ++i)
            #pragma unroll
            for (int j = 0; j < M; ++j) Q[i][j] = (T[i][j] + U[i][j]) * inv;
        matmul<M>(X, P, T);
        #pragma unroll
        for (int i = 0; i < M; ++i)
            #pragma unroll
            for (int j = 0; j < M; ++j) {
                P[i][j] = T[i][j] * inv;
                E[i][j] += P[i][j];
                L[i][j] += Q[i][j];
            }
    }
    for (int i = 0; i < s; ++i) {
        matmul<M>(E, L, T);
        matmul<M>(L, E, U);
        #pragma unroll
        for (int r = 0; r < M; ++r)
            #pragma unroll
            for (int j = 0; j < M; ++j) L[r][j] = T[r][j] + U[r][j];
        matmul<M>(E, E, T);
        #pragma unroll
        for (int r = 0; r < M; ++r)
            #pragma unroll
            for (int j = 0; j < M; ++j) E[r][j] = T[r][j];
    }
}

// dL/dA_c = h [L(h A~_c^T, [G_c; 0])]_{:K} for every cell with non-zero moments (zero for the
// others). G is divided by its largest magnitude first (L is linear in it; the same scaling as
// NumPy's _expm_frechet_adjoint, which computes L by the 2(K+1) block exponential itself).
// dA may be G itself (no __restrict__ on them): a thread reads its cell's G before it writes
// that cell's dA, and no other cell's; the VJP then holds one (cells, K (K+1)) float64 array
// fewer (25 MB at 2D tess 64, batch 32).
template <int K>
__global__ void __launch_bounds__(64)
frechet_cells(const double* __restrict__ A, const double* G, double* dA, i64 cells, double h) {
    constexpr int M = K + 1, SIZE = K * (K + 1);
    const i64 c = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= cells) return;
    double scale = 0.0;
    #pragma unroll
    for (int i = 0; i < SIZE; ++i) scale = fmax(scale, fabs(G[c * SIZE + i]));
    if (scale == 0.0) {
        #pragma unroll
        for (int i = 0; i < SIZE; ++i) dA[c * SIZE + i] = 0.0;
        return;
    }
    double Y[M][M], Z[M][M], L[M][M];
    #pragma unroll
    for (int q = 0; q < M; ++q) {
        #pragma unroll
        for (int k = 0; k < M; ++k) {
            Y[q][k] = k < K ? h * A[c * SIZE + k * (K + 1) + q] : 0.0;  // Y = (h A~)^T
            Z[k][q] = k < K ? G[c * SIZE + k * (K + 1) + q] / scale : 0.0;
        }
    }
    expm_frechet<M>(Y, Z, L);
    #pragma unroll
    for (int k = 0; k < K; ++k)
        #pragma unroll
        for (int q = 0; q <= K; ++q) dA[c * SIZE + k * (K + 1) + q] = h * (L[k][q] * scale);
}

}  // namespace cpab
}  // namespace cutopo
