"""The ECC kernels run whole on the CPU: ecc.cu compiled for the host, a block's threads as
host threads (tests/ecc_host_build.py).

The GPU tests check the kernels on the device; CI has no GPU. This test runs each kernel's
grid, block after block, on small random images (several tiles per block, blocks past the
last tile, image edges that cut tiles and vectors, ties, NaN) and compares with the NumPy
path: ``ecc_histogram`` (every cumulation), ``ecc_histogram_masked`` (streamed slabs, Dask
chunks), ``ecc_contributions`` (box and torus), ``finite_range``, ``expected_euler_forward``
and ``_backward``. It checks the tile loads, the packed and scalar sweeps, the bins and the
sinks as the kernels compose them; what only a GPU shows (the flush of denormals under
-ftz=true, warp timing, memory ordering between blocks that run together) stays with the
GPU tests.
"""
from __future__ import annotations

import subprocess

import numpy as np
import pytest

import cutopo
from cutopo._ecc_cupy import (_INPUT_CTYPE, _VALUE_KEY, THREADS, tall_rows, _key_value,
                              histogram_bin_arguments, histogram_cumulation, histogram_key_ctype,
                              histogram_shared_bytes, threshold_table_in_shared)
from cutopo._checks import check_thresholds
from ecc_host_build import EMULATED_SMEM, build
from oracles import extreme_even_thresholds, values_near

CASES = [
    # shape, dtype, ndim, tconn, thresholds (a count, "random" or "float64"), zchunk, blocks
    # per image. Rows of 16-byte multiples (the vector reads) and tiles away from every edge
    # (x0 >= 1, x0 + 65 <= nx, y0 >= 1, y0 + 33 <= ny) in most; odd sizes in the others.
    ((70, 196), "float32", 2, False, 64, 1, 4),
    ((70, 150), "float32", 2, True, 64, 1, 3),
    ((2, 33, 65), "float32", 2, False, "random", 1, 2),
    ((3, 67, 132), "float32", 2, False, "float64", 1, 2),  # float32 pixels, float64 comparisons
    ((9, 66, 132), "float32", 3, True, 50, 4, 3),
    ((20, 40, 70), "float32", 3, False, 50, 6, 2),
    ((66, 144), "uint8", 2, True, 12, 1, 20),
    ((7, 67, 160), "uint8", 3, False, 30, 3, 2),
    ((19, 35, 66), "uint8", 3, True, 30, 5, 2),
    ((30, 67), "bool", 2, False, 2, 1, 2),
    ((2, 5, 66, 136), "uint16", 3, False, 40, 3, 3),
    ((70, 200), "int16", 2, False, "random", 1, 3),
    ((70, 130), "float64", 2, False, 100, 1, 2),
    ((5, 66, 136), "float16", 3, False, 40, 2, 2),
    ((50, 70), "float32", 2, False, 5000, 1, 3),  # the scalar sweep, a global histogram
    # Images that tiles fit exactly (nx a multiple of 64, ny of 32): the last tiles read their
    # rows whole, their right halo column and the row below lie outside.
    ((64, 128), "float32", 2, False, 64, 1, 2),
    ((6, 64, 128), "uint8", 3, True, 30, 2, 2),
]
# 2D tall tiles (_ecc_cupy.tall_rows(dtype) rows per thread, 64 to 96 rows; _ecc_cupy takes them
# for large images): every read path (vector rows of 1, 2, 4 and 8 bytes, rows not 16-byte
# multiples, float16's float32 comparisons, binary search) with a tile away from every edge
# (_two_tiles: y0 = one tile, 2 tiles + 1 <= ny; the heights follow the dtype's rows).
def _two_tiles(dtype):
    return 2 * tall_rows(dtype) * (THREADS // 32)


TALL_CASES = [
    ((_two_tiles("float32") + 12, 200), "float32", 2, False, 64, 1, 3),
    ((2, _two_tiles("uint8") + 72, 144), "uint8", 2, True, 12, 1, 2),
    ((_two_tiles("float64") + 22, 136), "float64", 2, False, 100, 1, 2),
    ((_two_tiles("uint16") + 2, 200), "uint16", 2, True, 40, 1, 2),
    ((_two_tiles("float16") + 5, 160), "float16", 2, False, 40, 1, 2),
    ((_two_tiles("int16") + 12, 136), "int16", 2, False, "random", 1, 3),
    ((_two_tiles("bool") + 3, 141), "bool", 2, True, 2, 1, 1),
    ((_two_tiles("float32"), 192), "float32", 2, True, 64, 1, 2),  # tiles fit exactly
    ((_two_tiles("int32") + 7, 72), "int32", 2, False, 30, 1, 2),
]


def _instance(dtype, t_dtype, T, ndim, tconn, rows=4):
    """The ecc_histogram template arguments _ecc_cupy.HistogramPlan picks (``rows``: per thread
    of the packed sweep's tiles)."""
    cmp = histogram_bin_arguments(dtype, np.arange(3).astype(np.result_type(dtype, t_dtype)))[0]
    return (_INPUT_CTYPE[dtype], cmp, histogram_key_ctype(T), ndim, tconn, rows)


def _threshold_dtype(dtype, thresholds):
    if thresholds == "float64" or dtype.kind != "f":
        return np.dtype("float64")
    return dtype  # linear_thresholds and the random ones keep a float image's dtype


INSTANCES = sorted({_instance(np.dtype(d), _threshold_dtype(np.dtype(d), th),
                              th if isinstance(th, int) else 45, nd, tc, rows)
                    for cases, tall in ((CASES, False), (TALL_CASES, True))
                    for _, d, nd, tc, th, _, _ in cases for rows in [tall_rows(d) if tall else 4]})

CONTRIBUTION_CASES = [
    # shape, dtype, ndim, tconn, periodic, zchunk, blocks per image
    ((70, 150), "float32", 2, False, False, 1, 3),
    ((2, 33, 65), "float64", 2, True, False, 1, 2),
    ((20, 40, 70), "float32", 3, False, False, 4, 3),
    ((9, 35, 66), "uint8", 3, True, False, 3, 2),
    ((40, 67), "int16", 2, False, True, 1, 2),
    ((5, 34, 33), "float32", 3, True, True, 2, 2),
    ((6, 5, 40), "uint16", 3, False, True, 4, 1),
    ((30, 70), "float16", 2, True, False, 1, 2),
    ((3, 40, 66), "int32", 2, False, False, 1, 3),
]


def _contribution_instance(dtype, ndim, tconn, periodic):
    """The ecc_contributions template arguments _ecc_cupy.contributions_instance picks."""
    return (_INPUT_CTYPE[dtype], _VALUE_KEY.get(_INPUT_CTYPE[dtype], "unsigned int"), ndim, tconn, periodic)


CONTRIBUTION_INSTANCES = sorted({_contribution_instance(np.dtype(d), nd, tc, per)
                                 for _, d, nd, tc, per, _, _ in CONTRIBUTION_CASES})

RANGE_DTYPES = ["bool", "uint8", "uint16", "int16", "int32", "float16", "float32", "float64"]
RANGE_INSTANCES = sorted({_INPUT_CTYPE[np.dtype(d)] for d in RANGE_DTYPES})

EXPECTED_INSTANCES = [(real, nd, tc) for real in ("float", "double") for nd in (2, 3) for tc in (False, True)]

_DRIVER = r"""
// Runs a kernel's grid, block after block, each block as THREADS host threads.
template <class Launch>
void run_grid(unsigned blocks, Launch launch) {
    std::barrier<> barrier(emu::THREADS);
    std::vector<emu::Warp> warps(emu::THREADS / 32);
    emu::block_barrier = &barrier;
    emu::warps = warps.data();
    blockDim = {(unsigned)emu::THREADS, 1, 1};
    gridDim = {blocks, 1, 1};
    for (unsigned b = 0; b < blocks; ++b) {
        blockIdx = {b, 0, 0};
        std::memset(emu::dynamic_smem, 0xA5, sizeof emu::dynamic_smem);  // poisoned
        std::vector<std::thread> threads;
        for (int t = 0; t < emu::THREADS; ++t)
            threads.emplace_back([&, t] {
                threadIdx = {(unsigned)t, 0, 0};
                launch();
            });
        for (auto& th : threads) th.join();
    }
}

template <class T>
bool read(std::vector<T>& v, size_t n) {
    v.resize(n);
    return fread(v.data(), sizeof(T), n, stdin) == n;
}

// The histogram kernels. a: kernel (0 ecc_histogram, 1 ecc_histogram_masked), instance, nimg,
// nz, ny, nx, zchunk, blocks_per_image, T, estimate, table_in_smem, hist_in_smem, cumulate;
// d: t0, inv_dt; then the table ((T + 1) x 2 comparison values), the image (nimg nz ny nx
// pixels) and, masked, the masks (nz, ny, nx bytes). stdout: the (nimg, T) int64 rows; exit
// status 3 when a counter of blocks done is not zero afterwards (the plan keeps them).
template <class In, class Cmp, class K, int NDIM, bool TCONN, int RPT>
int histogram(const int64_t* a, const double* d) {
    const int64_t nimg = a[2], nz = a[3], ny = a[4], nx = a[5], T = a[8];
    const int zchunk = (int)a[6], bpi = (int)a[7];
    std::vector<cutopo::ecc::Bounds<Cmp>> table;
    std::vector<In> image;
    std::vector<unsigned char> oz, oy, ox;
    if (!read(table, T + 1) || !read(image, nimg * nz * ny * nx)) return 2;
    if (a[0] == 1 && !(read(oz, nz) && read(oy, ny) && read(ox, nx))) return 2;
    std::vector<long long> hist(nimg * T, 0);
    std::vector<unsigned> done(nimg, 0u);
    run_grid((unsigned)(nimg * bpi), [&] {
        if (a[0] == 1 && RPT == cutopo::ecc::PY)  // the masked kernel has the default tiles
            cutopo::ecc::ecc_histogram_masked<In, Cmp, K, NDIM, TCONN>(
                image.data(), table.data(), hist.data(), nz, ny, nx, zchunk, bpi, (int)T, (int)a[9], d[0],
                d[1], (int)a[10], (int)a[11], oz.data(), oy.data(), ox.data());
        else
            cutopo::ecc::ecc_histogram<In, Cmp, K, NDIM, TCONN, RPT>(
                image.data(), table.data(), hist.data(), nz, ny, nx, zchunk, bpi, (int)T, (int)a[9], d[0],
                d[1], (int)a[10], (int)a[11], done.data(), (int)a[12]);
    });
    fwrite(hist.data(), 8, hist.size(), stdout);
    for (unsigned v : done)  // the last block of each image leaves its counter zeroed (cumulate 1)
        if (v != 0u) { fprintf(stderr, "a counter of blocks done was left at %%u\n", v); return 3; }
    return 0;
}

// The contribution map. a: 2, instance, nimg, nz, ny, nx, zchunk, blocks_per_image; then the
// image. stdout: the int8 map.
template <class In, class K, int NDIM, bool TCONN, bool PERIODIC>
int contributions(const int64_t* a) {
    const int64_t nimg = a[2], nz = a[3], ny = a[4], nx = a[5];
    const int zchunk = (int)a[6], bpi = (int)a[7];
    std::vector<In> image;
    if (!read(image, nimg * nz * ny * nx)) return 2;
    std::vector<signed char> out(image.size(), (signed char)0x5A);  // poisoned
    run_grid((unsigned)(nimg * bpi), [&] {
        cutopo::ecc::ecc_contributions<In, K, NDIM, TCONN, PERIODIC>(image.data(), out.data(), nz, ny, nx,
                                                                     zchunk, bpi);
    });
    fwrite(out.data(), 1, out.size(), stdout);
    return 0;
}

// The finite value range. a: 3, instance, n, blocks, offset (elements the image starts past
// a 16-byte boundary: 0 takes the vector reads); then the n values. stdout: range[0..1].
template <class In>
int range(const int64_t* a) {
    std::vector<In> buffer;
    if (!read(buffer, a[2] + a[4])) return 2;  // the first offset values are padding
    unsigned long long out[2] = {0, 0};
    run_grid((unsigned)a[3], [&] { cutopo::ecc::finite_range<In>(buffer.data() + a[4], a[2], out); });
    fwrite(out, 8, 2, stdout);
    return 0;
}

// expected_euler_forward. a: 4, instance, nimg, nz, ny, nx, blocks_per_image, grid, token;
// then prob. stdout: E[chi] per image (Real), then the host words, the status words and the
// per-image sums left behind (uint64: 2 + 3 + nimg). expected_euler_backward. a: 5, instance,
// nimg, nz, ny, nx, 0, grid; then prob and the cotangent (nimg). stdout: the gradient, in Real.
template <class Real, int NDIM, bool TCONN>
int expected(const int64_t* a) {
    const int64_t nimg = a[2], nz = a[3], ny = a[4], nx = a[5];
    std::vector<Real> prob, cotangent;
    if (!read(prob, nimg * nz * ny * nx)) return 2;
    if (a[0] == 4) {
        std::vector<double> sums(nimg, 0.0);
        std::vector<Real> out(nimg, (Real)-7.25);  // poisoned
        std::vector<unsigned long long> host(2, 0ull), status(3, 0ull);
        run_grid((unsigned)a[7], [&] {
            cutopo::ecc::expected_euler_forward<Real, NDIM, TCONN>(prob.data(), sums.data(), out.data(),
                                                                   nimg, nz, ny, nx, (int)a[6],
                                                                   status.data(), host.data(), a[8]);
        });
        fwrite(out.data(), sizeof(Real), out.size(), stdout);
        fwrite(host.data(), 8, host.size(), stdout);
        fwrite(status.data(), 8, status.size(), stdout);
        fwrite(sums.data(), 8, sums.size(), stdout);
        return 0;
    }
    if (!read(cotangent, nimg)) return 2;
    std::vector<Real> grad(prob.size(), (Real)-7.25);  // poisoned
    run_grid((unsigned)a[7], [&] {
        cutopo::ecc::expected_euler_backward<Real, NDIM, TCONN>(prob.data(), cotangent.data(), grad.data(),
                                                                nimg, nz, ny, nx);
    });
    fwrite(grad.data(), sizeof(Real), grad.size(), stdout);
    return 0;
}

int main() {
    int64_t a[13];
    double d[2];
    if (fread(a, 8, 13, stdin) != 13 || fread(d, 8, 2, stdin) != 2) return 2;
    if (a[0] == 3) {
        switch (a[1]) {
%(ranges)s
        }
        return 3;
    }
    if (a[0] == 4 || a[0] == 5) {
        switch (a[1]) {
%(expected)s
        }
        return 3;
    }
    if (a[0] == 2) {
        switch (a[1]) {
%(contributions)s
        }
        return 3;
    }
    switch (a[1]) {
%(histograms)s
    }
    return 3;
}
"""


def _driver() -> str:
    def cpp(flag):
        return "true" if flag else "false"

    histograms = "\n".join(f"        case {i}: return histogram<{inp}, {cmp}, {key}, {nd}, {cpp(tc)}, {rows}>(a, d);"
                           for i, (inp, cmp, key, nd, tc, rows) in enumerate(INSTANCES))
    contributions = "\n".join(
        f"        case {i}: return contributions<{inp}, {key}, {nd}, {cpp(tc)}, {cpp(per)}>(a);"
        for i, (inp, key, nd, tc, per) in enumerate(CONTRIBUTION_INSTANCES))
    ranges = "\n".join(f"        case {i}: return range<{inp}>(a);" for i, inp in enumerate(RANGE_INSTANCES))
    expected = "\n".join(f"        case {i}: return expected<{real}, {nd}, {cpp(tc)}>(a);"
                         for i, (real, nd, tc) in enumerate(EXPECTED_INSTANCES))
    return _DRIVER % {"histograms": histograms, "contributions": contributions, "ranges": ranges,
                      "expected": expected}


@pytest.fixture(scope="module")
def emulator(tmp_path_factory):
    return build(tmp_path_factory, "ecc_emulated", _driver())


# ecc.cu's compile-time variants for benchmarks/ab_ecc.py --variant: the A/B is only worth
# running on the device if they count right.
VARIANTS = ["-DCUTOPO_ECC_NO_CUBE_PAIRS", "-DCUTOPO_ECC_NO_GROUP_READS_3D"]


@pytest.fixture(scope="module", params=VARIANTS)
def variant_emulator(request, tmp_path_factory):
    return build(tmp_path_factory, "ecc_emulated", _driver(), *request.param.split())


def _run(emulator, head, floats, *arrays):
    stdin = (np.asarray(head, np.int64).tobytes() + np.asarray(floats, np.float64).tobytes()
             + b"".join(np.ascontiguousarray(x).tobytes() for x in arrays))
    run = subprocess.run([str(emulator)], input=stdin, capture_output=True, timeout=60)
    assert run.returncode == 0, run.stderr[-2000:]
    return run.stdout


def _geometry(image, ndim):
    spatial = image.shape[image.ndim - ndim:]
    return int(np.prod(image.shape[:image.ndim - ndim])), (1,) * (3 - ndim) + spatial


def _pixels(image):
    return image.view(np.uint16) if image.dtype == np.float16 else image


def _copies(instance, T, table_bytes, most=32):
    """The shared histogram's copies (ecc_histogram's hist_copies): none for the scalar sweep
    (32-bit keys), else the most up to ``most`` that the emulator's dynamic shared memory holds
    (the host's histogram_copies asks the device's occupancy instead)."""
    if instance[2] != "unsigned short":
        return 0
    in_smem = threshold_table_in_shared(table_bytes, instance[2], instance[1])
    copies = most
    while copies > 1 and histogram_shared_bytes(T, table_bytes, in_smem, copies) > EMULATED_SMEM:
        copies //= 2
    return copies


def _kernel_rows(emulator, image, t, ndim, tconn, zchunk, blocks_per_image, cumulate, masks=None, rows=4,
                 most_copies=32, key_ctype=None):
    """The (*batch, T) rows ecc_histogram (ecc_histogram_masked with ``masks``) leaves, with
    the arguments _ecc_cupy.HistogramPlan gives it (the geometry chosen here; the shared
    histogram in up to ``most_copies`` copies)."""
    dtype = image.dtype
    T = t.size
    _, table, estimate = histogram_bin_arguments(dtype, t)
    instance = _instance(dtype, t.dtype, T, ndim, tconn, rows)
    if key_ctype is not None:  # the device's choice (histogram_key_ctype with its shared memory)
        instance = instance[:2] + (key_ctype,) + instance[3:]
    assert instance in INSTANCES, f"{instance} is not compiled into the emulator"
    nimg, (nz, ny, nx) = _geometry(image, ndim)
    copies = _copies(instance, T, table.nbytes, most_copies)
    assert cumulate != 2 or copies, "every block's prefix sums need the shared histogram"
    head = [masks is not None, INSTANCES.index(instance), nimg, nz, ny, nx, zchunk, blocks_per_image, T,
            estimate is not None, threshold_table_in_shared(table.nbytes, instance[2], instance[1]),
            copies, cumulate]
    out = _run(emulator, head, estimate if estimate is not None else (0.0, 0.0), table, _pixels(image),
               *(masks or ()))
    return np.frombuffer(out, np.int64).reshape(image.shape[:image.ndim - ndim] + (T,))


def _kernel_contributions(emulator, image, ndim, tconn, periodic, zchunk, blocks_per_image):
    instance = _contribution_instance(image.dtype, ndim, tconn, periodic)
    nimg, (nz, ny, nx) = _geometry(image, ndim)
    head = [2, CONTRIBUTION_INSTANCES.index(instance), nimg, nz, ny, nx, zchunk, blocks_per_image] + [0] * 5
    return np.frombuffer(_run(emulator, head, (0.0, 0.0), _pixels(image)), np.int8).reshape(image.shape)


def _image(rng, shape, dtype):
    if dtype == np.bool_:
        return rng.random(shape) < 0.5
    if dtype.kind == "f":
        img = rng.normal(size=shape).round(1).astype(dtype)  # rounded: many ties
        img.flat[rng.integers(0, img.size, 3)] = np.nan
        return img
    info = np.iinfo(dtype)
    return rng.integers(max(info.min, -40), min(info.max, 40) + 1, size=shape).astype(dtype)


def _thresholds(rng, image, thresholds):
    if thresholds == "random":
        lo, hi = np.nanmin(image.astype(np.float64)), np.nanmax(image.astype(np.float64))
        return np.sort(rng.uniform(lo - 1, hi + 1, 37)).astype(_threshold_dtype(image.dtype, "random"))
    if thresholds == "float64":
        return np.linspace(-2.0, 2.0, 45)
    return cutopo.linear_thresholds(image, thresholds)


# cumulate 0: rows added (cumulated here), 1: the last block cumulates, 2: every block adds
# its own prefix (the host takes 2 only with the shared histogram, T <= 4096); the shared
# histogram in up to 1, 2, ... 32 copies, in turn.
RUNS = [(case, cumulate, tall_rows(case[1]) if tall else 4)
        for cases, tall in ((CASES, False), (TALL_CASES, True)) for case in cases
        for cumulate in (0, 1, 2) if not (cumulate == 2 and case[4] == 5000)]
RUNS = [run + (2 ** (i % 6),) for i, run in enumerate(RUNS)]


@pytest.mark.parametrize("case, cumulate, rows, most_copies", RUNS,
                         ids=[f"{c[1]}-{'x'.join(map(str, c[0]))}-{c[2]}d-cumulate{m}-rows{r}-copies{k}"
                              for c, m, r, k in RUNS])
def test_emulated_histogram_kernel_equals_numpy(emulator, case, cumulate, rows, most_copies, rng):
    """ecc_histogram's curve equals cutopo.ecc's on the NumPy path."""
    shape, dtype, ndim, tconn, thresholds, zchunk, bpi = case
    dtype = np.dtype(dtype)
    image = _image(rng, shape, dtype)
    t = _thresholds(rng, image, thresholds)
    want = cutopo.ecc(image, t, ndim=ndim, connectivity=ndim if tconn else 1)
    tc, _ = check_thresholds(t, image)  # as cutopo.ecc compares them
    got = _kernel_rows(emulator, image, tc, ndim, tconn, zchunk, bpi, cumulate, rows=rows,
                       most_copies=most_copies)
    np.testing.assert_array_equal(got if cumulate else np.cumsum(got, axis=-1), want)


def test_emulated_scalar_sweep_within_shared_bins_cumulates(emulator, rng):
    """Where a block's shared memory is too small for the packed sweep (4096 float32 bins in
    Turing's 64 KB), 32-bit keys take the scalar sweep, which adds into the global rows: the
    host then has its last block cumulate them (cumulate 2, every block's own prefix sums of a
    shared histogram it never filled, left them uncumulated)."""
    image = rng.random((50, 70)).astype(np.float32)
    t = cutopo.linear_thresholds(image, 4096)
    _, table, _ = histogram_bin_arguments(image.dtype, t)
    key = histogram_key_ctype(t.size, "float", table.nbytes, smem_optin=64 * 1024)
    assert key == "unsigned int"
    instance = _instance(image.dtype, t.dtype, t.size, 2, False)[:2] + (key,) + (2, False, 4)
    copies = _copies(instance, t.size, table.nbytes)
    big_block = 1 << 27  # pixels enough for every block's prefix sums, had it a shared histogram
    assert histogram_cumulation(1, image.dtype, t.size, big_block) == 2
    cumulate = histogram_cumulation(copies, image.dtype, t.size, big_block)
    assert (copies, cumulate) == (0, 1)
    got = _kernel_rows(emulator, image, t, 2, False, 1, 3, cumulate, key_ctype=key)
    np.testing.assert_array_equal(got, cutopo.ecc(image, t))


@pytest.mark.parametrize("case", CASES[::2], ids=lambda c: f"{c[1]}-{'x'.join(map(str, c[0]))}-{c[2]}d")
def test_emulated_masked_histogram_adds_the_marked_pixels(emulator, case, rng):
    """ecc_histogram_masked (the streamed slabs' and Dask chunks' kernel) adds the contributions
    of the pixels whose coordinates every axis' mask marks. The kernel decides ownership on
    threshold bins (ties broken by index), so the oracle is the NumPy contribution map of the
    bin image, summed over the marked pixels by bin (bin T, NaN included, not counted)."""
    shape, dtype, ndim, tconn, thresholds, zchunk, bpi = case
    image = _image(rng, shape, np.dtype(dtype))
    t, _ = check_thresholds(_thresholds(rng, image, thresholds), image)
    nimg, spatial = _geometry(image, ndim)
    masks = [(rng.random(n) < 0.7).astype(np.uint8) for n in spatial]
    got = _kernel_rows(emulator, image, t, ndim, tconn, zchunk, bpi, 0, masks)
    bins = np.searchsorted(t, image.astype(t.dtype), side="left").astype(np.int32)  # NaN: T
    c = cutopo.euler_contributions(bins, ndim=ndim, connectivity=ndim if tconn else 1).astype(np.int64)
    marked = (slice(None),) + np.ix_(*(m.astype(bool) for m in masks))
    c = c.reshape((nimg,) + spatial)[marked].reshape(nimg, -1)
    bins = bins.reshape((nimg,) + spatial)[marked].reshape(nimg, -1)
    want = np.stack([np.bincount(b[b < t.size], weights=w[b < t.size], minlength=t.size)
                     for b, w in zip(bins, c)]).astype(np.int64)
    np.testing.assert_array_equal(got.reshape(nimg, -1), want)


@pytest.mark.parametrize("case", CONTRIBUTION_CASES,
                         ids=lambda c: f"{c[1]}-{'x'.join(map(str, c[0]))}-{c[2]}d")
def test_emulated_contribution_map_equals_numpy(emulator, case, rng):
    """ecc_contributions (cutopo.euler_contributions on CuPy arrays; the scalar sweep with
    value keys, box and torus) against the NumPy path's map."""
    shape, dtype, ndim, tconn, periodic, zchunk, bpi = case
    image = _image(rng, shape, np.dtype(dtype))
    got = _kernel_contributions(emulator, image, ndim, tconn, periodic, zchunk, bpi)
    want = cutopo.euler_contributions(image, ndim=ndim, connectivity=ndim if tconn else 1,
                                      boundary="periodic" if periodic else "box")
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[1]}-{'x'.join(map(str, c[0]))}-{c[2]}d")
def test_emulated_variants_equal_numpy(variant_emulator, case, rng):
    """Each compile-time variant of ecc_histogram gives cutopo.ecc's curve (cumulate 1)."""
    shape, dtype, ndim, tconn, thresholds, zchunk, bpi = case
    image = _image(rng, shape, np.dtype(dtype))
    t = _thresholds(rng, image, thresholds)
    want = cutopo.ecc(image, t, ndim=ndim, connectivity=ndim if tconn else 1)
    tc, _ = check_thresholds(t, image)
    got = _kernel_rows(variant_emulator, image, tc, ndim, tconn, zchunk, bpi, 1)
    np.testing.assert_array_equal(got, want)


# Instances of CASES (so compiled into the emulators) that bin through the float estimate.
# "far": float32 thresholds 1 apart near 2^20, where the estimate's float errors are largest
# ((|t_0| + |t_{T-1}|) / dt + T just under the host's 2^21).
ESTIMATE_CASES = [((70, 196), "float32", 2, "near"), ((20, 40, 70), "float32", 3, "near"),
                  ((70, 200), "int16", 2, "near"), ((5, 66, 136), "float16", 3, "near"),
                  ((2, 5, 66, 136), "uint16", 3, "near"), ((70, 196), "float32", 2, "far"),
                  ((20, 40, 70), "float32", 3, "far")]


def _jittered_thresholds(rng, dtype, where="near", T=41):
    """Thresholds that the host still bins by estimate (each within 0.2 spacings of the line
    through the first and the last): the estimate then lands a bin off near many of them.
    Integer images get real thresholds under 4 apart, so that floor(t) moves them further."""
    lo, span = (-3.0, 6.0) if dtype.kind == "f" else (-40.0, 80.0)
    if where == "far":
        lo, span = 2.0 ** 20 - 100, T - 1.0
    dt = span / (T - 1)
    t = lo + dt * np.arange(T) + rng.uniform(-0.2, 0.2, T) * dt * (np.arange(T) % (T - 1) != 0)
    t = t.astype(np.float32 if dtype.kind == "f" else np.float64)
    assert histogram_bin_arguments(dtype, t)[2] is not None, "the host no longer takes the estimate"
    return t


def _values_at_thresholds(rng, shape, dtype, t):
    """Pixels at the thresholds, one float step either side, beyond both ends, random and NaN."""
    if dtype.kind == "f":
        near = np.concatenate([t, np.nextafter(t, -np.inf), np.nextafter(t, np.inf),
                               [t[0] - 5, t[-1] + 5, np.inf, -np.inf, np.nan, 0.0]]).astype(dtype)
    else:
        info = np.iinfo(dtype)
        whole = np.floor(t).astype(np.int64)
        near = np.clip(np.concatenate([whole - 1, whole, whole + 1, [-60, 60]]), info.min, info.max)
    pool = np.concatenate([near, rng.uniform(t[0] - 1, t[-1] + 1, near.size)]).astype(dtype)
    return rng.choice(pool, size=shape)


@pytest.mark.parametrize("case", ESTIMATE_CASES, ids=lambda c: f"{c[1]}-{'x'.join(map(str, c[0]))}-{c[3]}")
def test_emulated_bins_at_jittered_thresholds(emulator, variant_emulator, case, rng):
    """The estimate's bins (an O(1) guess made exact by the table) at and beside every
    threshold, with thresholds uneven enough that the guess is often a bin off: the kernel's
    curve equals cutopo.ecc's, with and without each compile-time variant."""
    shape, dtype, ndim, where = case
    dtype = np.dtype(dtype)
    t = _jittered_thresholds(rng, dtype, where)
    image = _values_at_thresholds(rng, shape, dtype, t)
    want = cutopo.ecc(image, t, ndim=ndim)
    tc, _ = check_thresholds(t, image)
    zchunk = 3 if ndim == 3 else 1
    for emu in (emulator, variant_emulator):
        got = _kernel_rows(emu, image, tc, ndim, False, zchunk, 2, 1)
        np.testing.assert_array_equal(got, want)


# uint8 images whose every byte is its own bin (thresholds 0, 1, ..., 255, as ecc(image, 256)
# takes for an image spanning 0..255): the kernels take the bytes as keys. Instances of CASES and
# TALL_CASES (compiled into the emulator): shape, ndim, tconn, rows.
BYTE_CASES = [((66, 144), 2, True, 4), ((2, _two_tiles("uint8") + 72, 144), 2, True, tall_rows("uint8")),
              ((7, 67, 160), 3, False, 4), ((19, 35, 66), 3, True, 4)]


@pytest.mark.parametrize("case", BYTE_CASES, ids=lambda c: f"{'x'.join(map(str, c[0]))}-{c[1]}d-{'T' if c[2] else 'V'}")
def test_emulated_bytes_as_their_own_bins(emulator, case, rng):
    """Full-range uint8 images against thresholds 0..255 (the bytes are the bins: the kernel
    packs the bytes themselves), 0..299 (the same bins, more thresholds), and 0..255 with one
    threshold moved below its byte (the table again): every curve equals cutopo.ecc's."""
    shape, ndim, tconn, rows = case
    image = rng.integers(0, 256, size=shape, dtype=np.uint8)
    image.flat[rng.integers(0, image.size, 4)] = [0, 255, 1, 254]
    moved = np.arange(256.0)
    moved[100] = 99.5
    for t in (np.arange(256.0), np.arange(300.0), moved):
        want = cutopo.ecc(image, t, ndim=ndim, connectivity=ndim if tconn else 1)
        tc, _ = check_thresholds(t, image)
        zchunk = 3 if ndim == 3 else 1
        got = _kernel_rows(emulator, image, tc, ndim, tconn, zchunk, 3, 1, rows=rows)
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("name, t", extreme_even_thresholds(), ids=lambda c: c if isinstance(c, str) else "")
def test_emulated_bins_at_extreme_even_thresholds(emulator, name, t, rng):
    """Evenly spaced thresholds whose bin guess float arithmetic cannot make (1/dt beyond
    float32 or float64) are binned by search: the curve equals cutopo.ecc's (2885a61's
    kernels, which took the guess, got both cases wrong; the denormal flush of -ftz=true,
    which the host does not emulate, is test_ecc_gpu's)."""
    image = values_near(rng, t, (70, 196))
    tc, _ = check_thresholds(t, image)
    assert histogram_bin_arguments(image.dtype, tc)[2] is None, name
    got = _kernel_rows(emulator, image, tc, 2, False, 1, 3, 1)
    np.testing.assert_array_equal(got, cutopo.ecc(image, t))


@pytest.mark.parametrize("dtype", RANGE_DTYPES)
def test_emulated_finite_range_equals_numpy(emulator, dtype, rng):
    """finite_range (a threshold count's minimum and maximum on CuPy arrays) gives the smallest
    and largest finite value through its order keys, decoded as _ecc_cupy.finite_range does:
    vector reads and the scalar tail, an unaligned start, inf and NaN skipped, none finite."""
    dtype = np.dtype(dtype)
    for n, blocks, offset in [(1, 1, 0), (7, 2, 1), (1000, 3, 0), (4099, 2, 0), (4099, 4, 1)]:
        image = _image(rng, (n,), dtype)
        if dtype.kind == "f":
            image[rng.integers(0, n, 2)] = [np.inf, -np.inf][:min(n, 2)]
            if n == 7:
                image[:] = np.nan  # nothing finite
        pixels = np.concatenate([np.zeros(offset, image.dtype), image])
        head = [3, RANGE_INSTANCES.index(_INPUT_CTYPE[dtype]), n, blocks, offset] + [0] * 8
        out = _run(emulator, head, (0.0, 0.0), _pixels(pixels))
        not_lo, hi = (int(k) for k in np.frombuffer(out, np.uint64))
        finite = image[np.isfinite(image)] if dtype.kind == "f" else image
        if finite.size == 0:
            assert not_lo == 0
            continue
        got = _key_value(~not_lo & 0xFFFFFFFFFFFFFFFF, dtype), _key_value(hi, dtype)
        assert got == (finite.min(), finite.max()), (n, got, finite.min(), finite.max())


def _emulated_expected(emulator, index, prob, ndim, blocks_per_image, grid):
    """(expected_euler_forward's result in prob's dtype, its published flags): the host words
    must carry the call's token, and the status words and the sums be left zeroed for the next
    launch."""
    nimg, (nz, ny, nx) = _geometry(prob, ndim)
    token = int(np.random.default_rng().integers(1, 1 << 40))
    head = [4, index, nimg, nz, ny, nx, blocks_per_image, grid, token] + [0] * 4
    raw = _run(emulator, head, (0.0, 0.0), prob)
    size = prob.dtype.itemsize * nimg
    out = np.frombuffer(raw[:size], prob.dtype)
    host0, host1, *rest = (int(v) for v in np.frombuffer(raw[size:], np.uint64))
    assert host0 == token << 2 and rest[:3] == [0, 0, 0]
    assert not any(rest[3:]), "the per-image sums were left non-zero"
    return out, host1


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("tconn", [False, True])
@pytest.mark.parametrize("bad", [-0.25, 1.0625, np.nan, -np.inf])
def test_emulated_expected_euler_flags_a_pixel_outside_the_unit_interval(emulator, dtype, tconn,
                                                                         bad, rng):
    """One pixel outside [0, 1] anywhere (corners, ring-adjacent edges, the last image) sets
    the published flag, whatever the grid; -0.0, 0 and 1 do not."""
    dtype = np.dtype(dtype)
    for shape, ndim in (((3, 7, 9), 2), ((2, 4, 5, 6), 3)):
        index = EXPECTED_INSTANCES.index(({"float32": "float", "float64": "double"}[dtype.name],
                                          ndim, tconn))
        prob = rng.random(shape).astype(dtype)
        prob.flat[rng.integers(0, prob.size, 5)] = np.array([0.0, 1.0, -0.0, 0.0, 1.0], dtype)
        assert _emulated_expected(emulator, index, prob, ndim, 2, 3)[1] == 0
        for where in (0, prob.size - 1, int(rng.integers(prob.size))):
            p = prob.copy()
            p.flat[where] = bad
            for blocks_per_image, grid in ((1, 1), (2, 4)):
                assert _emulated_expected(emulator, index, p, ndim, blocks_per_image, grid)[1] == 1


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("shape, ndim", [((2, 17, 23), 2), ((40, 3), 2), ((2, 5, 9, 13), 3), ((3, 4, 70), 3),
                                         ((2, 37, 5, 6), 3), ((33, 1, 4), 3), ((1, 16, 3, 1), 3)])
@pytest.mark.parametrize("tconn", [False, True])
def test_emulated_expected_euler_equals_numpy(emulator, dtype, shape, ndim, tconn, rng):
    """expected_euler_forward and _backward against cutopo.expected_euler and its pullback on
    the NumPy path (to the float type's rounding: the kernels sum in another order)."""
    dtype = np.dtype(dtype)
    prob = rng.random(shape).astype(dtype)
    prob[prob < 0.1] = 0.0  # exact zeros and ones too
    prob[prob > 0.9] = 1.0
    connectivity = ndim if tconn else 1
    nimg, (nz, ny, nx) = _geometry(prob, ndim)
    index = EXPECTED_INSTANCES.index(({"float32": "float", "float64": "double"}[dtype.name], ndim, tconn))
    want, pullback = cutopo.vjp(cutopo.expected_euler, prob, ndim=ndim, connectivity=connectivity)
    cotangent = rng.normal(size=want.shape).astype(dtype)
    (want_grad,) = pullback(cotangent)
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == np.float32 else dict(rtol=1e-10, atol=1e-10)
    for blocks_per_image, grid in [(1, nimg), (3, 3)]:
        got, flags = _emulated_expected(emulator, index, prob, ndim, blocks_per_image, grid)
        np.testing.assert_allclose(got.reshape(want.shape), want, **tol)
        assert flags == 0
    head = [5, index, nimg, nz, ny, nx, 0, 3] + [0] * 5
    grad = np.frombuffer(_run(emulator, head, (0.0, 0.0), prob, cotangent), dtype).reshape(prob.shape)
    np.testing.assert_allclose(grad, want_grad, **tol)
