"""CUDA kernels against the NumPy path: results must be identical (integers, exact comparisons)."""
import numpy as np
import pytest

import cutopo
from oracles import extreme_even_thresholds, values_near

pytestmark = pytest.mark.gpu

DTYPES = ["bool", "uint8", "uint16", "int16", "int32", "float16", "float32", "float64"]


def _cp():
    import cupy

    return cupy


def random_image(rng, shape, dtype, levels=None, nan_fraction=0.0):
    """Random test image; ``levels`` gives heavy ties."""
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return rng.random(shape) < 0.5
    if levels is not None:
        img = rng.integers(0, levels, size=shape).astype(dtype)
    elif dtype.kind == "f":
        img = rng.standard_normal(shape).astype(dtype)
    else:
        info = np.iinfo(dtype)
        img = rng.integers(max(info.min, -1000), min(info.max, 1000), size=shape, endpoint=True).astype(dtype)
    if nan_fraction and dtype.kind == "f":
        img[rng.random(shape) < nan_fraction] = np.nan
    return img


def assert_same_ecc(img, thresholds, **kw):
    cp = _cp()
    want = cutopo.ecc(img, thresholds, **kw)
    t_dev = cp.asarray(thresholds) if isinstance(thresholds, np.ndarray) else thresholds
    got = cutopo.ecc(cp.asarray(img), t_dev, **kw)
    assert isinstance(got, cp.ndarray) and got.dtype == np.int64
    np.testing.assert_array_equal(got.get(), want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ndim", [2, 3])
@pytest.mark.parametrize("conn", ["V", "T"])
def test_every_dtype_matches_numpy(rng, dtype, ndim, conn):
    shape = (37, 70) if ndim == 2 else (13, 21, 40)
    connectivity = 1 if conn == "V" else ndim
    for levels in (None, 5):
        img = random_image(rng, shape, dtype, levels=levels, nan_fraction=0.05)
        assert_same_ecc(img, 64, connectivity=connectivity)
        c_cpu = cutopo.euler_contributions(img, connectivity=connectivity)
        c_gpu = cutopo.euler_contributions(_cp().asarray(img), connectivity=connectivity)
        np.testing.assert_array_equal(c_gpu.get(), c_cpu)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ndim", [2, 3])
def test_vector_loads_every_dtype(rng, dtype, ndim):
    """Shapes with interior tiles and 16-byte aligned rows (nx a multiple of 16), so the kernel's
    16-byte vector-load path runs for every storage size; plus a misaligned view of the same."""
    shape = (2, 100, 208) if ndim == 2 else (4, 70, 144)
    for levels in (None, 6):
        img = random_image(rng, shape, dtype, levels=levels, nan_fraction=0.03)
        for connectivity in (1, ndim):
            assert_same_ecc(img, 97, ndim=ndim, connectivity=connectivity)
    cp = _cp()
    flat = cp.asarray(img.reshape(-1))
    view = flat[1:1 + img[1:].size].reshape(img[1:].shape)  # contiguous, off by one element
    for connectivity in (1, ndim):
        np.testing.assert_array_equal(
            cutopo.ecc(view, 97, ndim=ndim, connectivity=connectivity).get(),
            cutopo.ecc(view.get(), 97, ndim=ndim, connectivity=connectivity))


@pytest.mark.parametrize("ndim", [2, 3])
def test_batches_and_odd_shapes(rng, ndim):
    shapes = [(1, 1), (1, 33), (33, 1), (31, 33), (65, 97)] if ndim == 2 else \
        [(1, 1, 1), (1, 5, 40), (7, 1, 3), (35, 33, 31)]
    for spatial in shapes:
        img = random_image(rng, (3, 2) + spatial, "float32", levels=7)
        for connectivity in (1, ndim):
            assert_same_ecc(img, np.linspace(-1, 7, 17), ndim=ndim, connectivity=connectivity)


def test_thresholds_paths(rng):
    """Uniform (O(1) bins), non-uniform (binary search), shared vs global table and histogram."""
    img = random_image(rng, (2, 45, 77), "float32", nan_fraction=0.02)
    lo, hi = float(np.nanmin(img)), float(np.nanmax(img))
    cases = [
        np.linspace(lo, hi, 256),                                 # uniform, shared
        np.sort(rng.uniform(lo - 0.5, hi + 0.5, 300)),            # binary search
        np.concatenate([[lo] * 5, np.linspace(lo, hi, 50), [hi] * 5]),  # duplicates
        np.linspace(lo, hi, 4096),                                # largest T of the packed kernel
        np.linspace(lo, hi, 4097),                                # 32-bit keys, global histogram
        np.linspace(lo, hi, 32767),                               # 32-bit keys, table in global memory
        np.linspace(lo, hi, 70000),                               # 32-bit keys, table in global memory
        np.array([0.0]),
        np.array([lo - 1, hi + 1]),
    ]
    for t in cases:
        for connectivity in (1, 2):
            assert_same_ecc(img, t, ndim=2, connectivity=connectivity)


def test_comparison_dtype_is_result_type(rng):
    """float32 pixels against float64 thresholds between float32 neighbours."""
    vals = np.float32(1.0) + np.arange(-3, 4, dtype=np.float32) * np.finfo(np.float32).eps
    img = rng.choice(vals, size=(40, 40)).astype(np.float32)
    t = np.sort(np.concatenate([vals.astype(np.float64) + 1e-9, vals.astype(np.float64) - 1e-9]))
    assert_same_ecc(img, t)
    assert_same_ecc(img.astype(np.float16), t.astype(np.float16))
    ints = rng.integers(-5, 5, size=(30, 30)).astype(np.int16)
    assert_same_ecc(ints, np.arange(-6, 6, dtype=np.int64))
    assert_same_ecc(ints.astype(np.uint16), np.arange(0, 6, dtype=np.uint64))


@pytest.mark.parametrize("dtype", ["uint16", "int16"])
@pytest.mark.parametrize("ndim", [2, 3])
def test_16bit_integer_images_bin_on_integer_bounds(rng, dtype, ndim):
    """uint16/int16 images bin against int32 bounds floor(t) with a float32 estimate, whatever
    the thresholds' dtype: evenly spaced float thresholds (the estimate, fractional and on
    integers), jittered ones, integer ones, float16/float32 ones, thresholds past both ends of
    the dtype's range, few (no estimate) and many (the scalar sweep, T > 4096); pixels on, next
    to and between the thresholds and at the dtype's extremes."""
    info = np.iinfo(dtype)
    shape = (3, 70, 90) if ndim == 2 else (40, 30, 70)
    full = float(info.max) - float(info.min)
    low = info.min + 0.3 * full
    cases = [np.linspace(info.min - 100.5, info.max + 100.5, 256),  # estimate, past both ends
             np.linspace(low, low + 300, 200),                        # dt ~ 1.5
             np.arange(info.min + 1000, info.min + 1256, dtype=np.int64),
             np.linspace(info.min, info.max, 5000),                   # T > 4096
             np.array([info.min + 0.5 * full]),                       # one threshold
             np.linspace(-60000.0, 60000.0, 64).astype(np.float32),
             np.linspace(-1000.0, 1000.0, 80).astype(np.float16)]
    jittered = np.linspace(info.min + 0.2 * full, info.min + 0.4 * full, 300)
    jittered[1:-1] += rng.uniform(-0.2, 0.2, 298) * (jittered[1] - jittered[0])
    cases.append(np.sort(jittered))
    for t in cases:
        lo, hi = max(float(info.min), float(t[0]) - 3), min(float(info.max), float(t[-1]) + 3)
        on = np.floor(rng.choice(t.astype(np.float64), size=shape))
        near = np.clip(on + rng.integers(-1, 2, size=shape), info.min, info.max)
        between = rng.uniform(lo, hi, size=shape)
        img = np.where(rng.random(shape) < 0.5, near, between).astype(dtype)
        img[rng.random(shape) < 0.02] = info.min
        img[rng.random(shape) < 0.02] = info.max
        for connectivity in (1, ndim):
            assert_same_ecc(img, t, ndim=ndim, connectivity=connectivity)


@pytest.mark.parametrize("ndim", [2, 3])
def test_float32_bin_estimate_at_bin_edges(rng, ndim):
    """float32 images against float32 thresholds take the estimated bin (round((v - t0) / dt)
    in float, clamped by a saturation, one table read and one comparison): pixels on every
    threshold, one ulp either side, between, outside the range, +-inf, NaN and -0.0, for
    evenly spaced thresholds and ones jittered by up to a quarter bin (the guess is then a bin
    below the answer about as often as not)."""
    from cutopo._ecc_cupy import _uniform_estimate

    shape = (3, 70, 90) if ndim == 2 else (40, 30, 70)
    # (T, jitter, first threshold, estimated): far from 0 the float guess errs more; the host
    # guesses only while (|t_0| + |t_{T-1}|) / dt + T <= 2^21 (then within 1/4 bin)
    for T, jitter, t0, guessed in [(256, 0.0, -1.0, True), (200, 0.12, -1.0, True), (3, 0.0, -1.0, True),
                                   (2, 0.0, -1.0, False), (2000, 0.12, -1.0, True),
                                   (256, 0.0, 1.0e4, True), (256, 0.05, -1.04e4, True),
                                   (256, 0.0, 1.1e4, False)]:
        dt = 0.01
        t = (np.float32(t0) + dt * np.arange(T) + jitter * dt * rng.uniform(-1, 1, T)).astype(np.float32)
        t = np.sort(t)
        assert (_uniform_estimate(t) is not None) == guessed, (T, t0)
        on = rng.choice(t, size=shape)
        step = rng.choice(np.array([-1, 0, 1]), size=shape)
        vals = np.where(step < 0, np.nextafter(on, np.float32(-np.inf)),
                        np.where(step > 0, np.nextafter(on, np.float32(np.inf)), on)).astype(np.float32)
        between = rng.uniform(t[0] - 0.5, t[-1] + 0.5, size=shape).astype(np.float32)
        img = np.where(rng.random(shape) < 0.5, vals, between).astype(np.float32)
        special = np.array([np.inf, -np.inf, np.nan, -0.0, 0.0], dtype=np.float32)
        pick = rng.random(shape) < 0.05
        img[pick] = rng.choice(special, size=int(pick.sum()))
        for connectivity in (1, ndim):
            assert_same_ecc(img, t, ndim=ndim, connectivity=connectivity)


def test_denormals_compare_exactly(rng):
    """CuPy compiles with -ftz=true; float32 denormals must still order as NumPy orders them."""
    tiny = np.finfo(np.float32).smallest_subnormal
    vals = np.array([-3 * tiny, -tiny, -0.0, 0.0, tiny, 2 * tiny, 1e-39, 1.0], dtype=np.float32)
    img = rng.choice(vals, size=(33, 47)).astype(np.float32)
    for t in (vals[np.argsort(vals, kind="stable")].astype(np.float32), np.sort(vals.astype(np.float64))):
        for connectivity in (1, 2):
            assert_same_ecc(img, t, connectivity=connectivity)
    c = cutopo.euler_contributions(_cp().asarray(img))
    np.testing.assert_array_equal(c.get(), cutopo.euler_contributions(img))


@pytest.mark.parametrize("name, t", extreme_even_thresholds(), ids=lambda c: c if isinstance(c, str) else "")
def test_extreme_even_thresholds(rng, name, t):
    """Evenly spaced thresholds whose bin guess float arithmetic under -ftz=true cannot make
    (1/dt or 1/(T dt) infinite or denormal, denormal values a bin or more from the thresholds)
    give NumPy's curves: the host bins them by search (2885a61 guessed in every case, and
    its kernels' curves were wrong in the two where 1/dt leaves float32 or float64 even on
    the host emulation; the other two turn on the GPU's denormal flush)."""
    for shape in ((70, 196), (9, 40, 70)):
        img = values_near(rng, t, shape)
        for connectivity in (1, len(shape)):
            assert_same_ecc(img, t, connectivity=connectivity)


@pytest.mark.parametrize("shape", [(300, 512), (3, 70, 144), (40, 64, 96), (19, 35, 66)])
def test_uint8_bytes_as_their_own_bins(rng, shape):
    """Full-range uint8 images with 256 thresholds (0..255: every byte its own bin, which the
    kernels take as the keys), 300 (the same bins), and 0..255 with one threshold moved below
    its byte (the table again): NumPy's curves, both connectivities."""
    img = rng.integers(0, 256, size=shape, dtype=np.uint8)
    img.flat[:2] = [0, 255]
    moved = np.arange(256.0)
    moved[100] = 99.5
    ndim = 3 if len(shape) == 3 and shape[0] > 3 else 2
    for t in (256, np.arange(300.0), moved):
        for connectivity in (1, ndim):
            assert_same_ecc(img, t, ndim=ndim, connectivity=connectivity)


def test_int_count_uses_same_thresholds(rng):
    cp = _cp()
    img = random_image(rng, (50, 60), "float32", nan_fraction=0.1)
    img[0, 0] = np.inf
    t_cpu = cutopo.linear_thresholds(img, 100)
    t_gpu = cutopo.linear_thresholds(cp.asarray(img), 100)
    np.testing.assert_array_equal(t_gpu.get(), t_cpu)
    np.testing.assert_array_equal(cutopo.ecc(cp.asarray(img), 100).get(), cutopo.ecc(img, 100))


def _plain_range(img):
    """(min, max) of the finite values by NumPy's own reductions (an independent oracle)."""
    finite = img[np.isfinite(img)] if img.dtype.kind == "f" else img.ravel()
    return (finite.min().item(), finite.max().item()) if finite.size else None


@pytest.mark.parametrize("dtype", DTYPES)
def test_finite_range_kernel_matches_numpy(rng, dtype):
    """The one-pass finite range (linear_thresholds' minimum and maximum) of every image dtype
    equals NumPy's: NaN, +-inf, denormals and -0.0 among the values; the dtype's extreme values
    planted at the first, the last or a random element (the keys' offsets and every thread's
    share); an image of zeros whose extremes are denormals (finite and ordered: -ftz=true
    must not flush them); sizes around the kernel's block and unroll boundaries and past 2^24;
    None when no value is finite; the thresholds and the ECC of a count as NumPy's."""
    cp = _cp()
    from cutopo import _checks, _ecc_cupy

    dt = np.dtype(dtype)
    low, high = ((-float(np.finfo(dt).max), float(np.finfo(dt).max)) if dt.kind == "f" else
                 (False, True) if dt == np.bool_ else (np.iinfo(dt).min, np.iinfo(dt).max))

    def check(img):
        want = _plain_range(img)
        assert _ecc_cupy.finite_range(cp.asarray(img)) == want
        assert _checks.finite_range(img) == want

    for n in (1, 7, 1023, 4 * 1024 + 1, 1 << 20, (1 << 24) + 13):
        img = random_image(rng, (n,), dtype)
        if dt.kind == "f":
            where = rng.integers(0, n, size=min(n, 12))
            img[where] = rng.choice(np.array([np.nan, np.inf, -np.inf, -0.0], dtype=dt), size=len(where))
        check(img)
        for lo_at, hi_at in ((0, n - 1), (n - 1, 0), tuple(rng.integers(0, n, size=2))):
            if lo_at != hi_at:
                planted = img.copy()
                planted[lo_at], planted[hi_at] = low, high
                check(planted)
        if dt.kind == "f" and n > 2:
            tiny = np.finfo(dt).smallest_subnormal
            zeros = np.where(rng.random(n) < 0.5, dt.type(0.0), dt.type(-0.0)).astype(dt)
            zeros[rng.integers(0, n, size=2)] = [-tiny, 3 * tiny]
            check(zeros)
    if dt.kind == "f":
        junk = np.array([np.nan, np.inf, -np.inf, np.nan] * 300, dtype=dt)
        assert _ecc_cupy.finite_range(cp.asarray(junk)) is None
        with pytest.raises(ValueError, match="no finite pixel"):
            cutopo.ecc(cp.asarray(junk.reshape(30, 40)), 5)
    img = random_image(rng, (3, 45, 61), dtype, nan_fraction=0.2 if dt.kind == "f" else 0.0)
    np.testing.assert_array_equal(cutopo.linear_thresholds(cp.asarray(img), 33).get(),
                                  cutopo.linear_thresholds(img, 33))
    np.testing.assert_array_equal(cutopo.ecc(cp.asarray(img), 33, ndim=2).get(),
                                  cutopo.ecc(img, 33, ndim=2))


def test_finite_range_of_strided_and_other_dtypes(rng):
    """A strided CuPy view is read as its values, a contiguous one that starts off a 16-byte
    boundary element by element; a dtype outside the ECC's (int64, which linear_thresholds
    takes too) goes through CuPy's reductions."""
    cp = _cp()
    from cutopo import _checks

    img = rng.standard_normal((64, 80)).astype(np.float32)
    view = cp.asarray(img)[::3, 1::2]
    assert _checks.finite_range(view) == _plain_range(img[::3, 1::2])
    flat = cp.asarray(img).ravel()
    for start in (1, 2, 3, 4):
        assert flat[start:].data.ptr % 16 != 0 or start == 4
        assert _checks.finite_range(flat[start:]) == _plain_range(img.ravel()[start:])
    big = rng.integers(-2**62, 2**62, size=(50,), dtype=np.int64)
    assert _checks.finite_range(cp.asarray(big)) == (int(big.min()), int(big.max()))


def test_large_2d(rng):
    img = rng.random((4096, 4096), dtype=np.float32)
    assert_same_ecc(img, 256)
    img8 = rng.integers(0, 256, size=(4096, 4096), dtype=np.uint8)
    assert_same_ecc(img8, 256, connectivity=2)


@pytest.mark.parametrize("tall", [False, True])
def test_2d_tiles_of_32_and_64_rows(rng, monkeypatch, tall):
    """2D histograms take tall tiles (64 to 96 rows, _ecc_cupy.tall_rows) where an image has
    many, else 32: both kernels, forced here on small images (every dtype, vector rows and odd
    widths, interior tiles, a batch, V and T), equal the NumPy path."""
    from cutopo import _ecc_cupy

    names = []

    class Recorded(_ecc_cupy.HistogramPlan):
        def __init__(self, spatial, nimg, dtype, *args, **kw):
            super().__init__(spatial, nimg, dtype, *args, **kw)
            names.append((np.dtype(dtype), self.sig.name))

    monkeypatch.setattr(_ecc_cupy, "HistogramPlan", Recorded)
    if tall:  # one resident block: every image of two or more tiles is "large"
        monkeypatch.setattr(_ecc_cupy, "resident_blocks", lambda *args, **kw: 1)
    else:
        monkeypatch.setattr(_ecc_cupy, "HIST_TALL_ROWS", {})
    _ecc_cupy.clear_plans()  # plans choose their tiles when they are made
    try:
        for dtype in DTYPES:
            for shape in [(2, 200, 208), (150, 131)]:
                img = random_image(rng, shape, dtype, levels=None if dtype != "int32" else 7, nan_fraction=0.03)
                for connectivity in (1, 2):
                    assert_same_ecc(img, 97, ndim=2, connectivity=connectivity)
    finally:
        _ecc_cupy.clear_plans()
    assert {dtype.name for dtype, _ in names} == set(DTYPES), names
    for dtype, name in names:  # each dtype's own rows per thread (an itemsize's)
        assert name.endswith(f", {_ecc_cupy.tall_rows(dtype)}>") == tall, (dtype, name)


def test_large_3d(rng):
    img = rng.random((256, 256, 256), dtype=np.float32)
    assert_same_ecc(img, 256)
    assert_same_ecc(img, 256, connectivity=3)


def test_contributions_write_every_pixel(rng):
    """Poison the memory the output will reuse: every element must be overwritten."""
    cp = _cp()
    img = random_image(rng, (3, 19, 41, 37), "float64", levels=4)
    cp.get_default_memory_pool().free_all_blocks()
    poison = cp.full(img.shape, 127, dtype=np.int8)
    del poison  # its block goes back to the pool and is reused by the next allocation of this size
    got = cutopo.euler_contributions(cp.asarray(img), ndim=3, connectivity=3)
    np.testing.assert_array_equal(got.get(), cutopo.euler_contributions(img, ndim=3, connectivity=3))


def test_strided_input_and_side_stream(rng):
    cp = _cp()
    img = random_image(rng, (64, 48), "float32")
    dev = cp.asarray(img).T  # a transposed view: the kernel must see a contiguous copy
    with cp.cuda.Stream(non_blocking=True) as s:
        got = cutopo.ecc(dev, 32)
        s.synchronize()
    np.testing.assert_array_equal(got.get(), cutopo.ecc(np.ascontiguousarray(img.T), 32))


def test_zero_batch():
    cp = _cp()
    out = cutopo.ecc(cp.zeros((0, 4, 4), dtype=np.float32), np.array([0.0, 1.0]), ndim=2)
    assert out.shape == (0, 2) and isinstance(out, cp.ndarray)


def test_last_block_makes_each_curve_cumulative(rng):
    """The histogram kernel's last block per image turns that image's row into the curve: with
    many blocks per image (2048^2, a batch of 7 at 300^2, 3D 96^3) and 8192 global-memory bins,
    every call of a repeated series equals the NumPy path (a block that read its row before
    the others' additions landed would show as a run-to-run difference)."""
    cp = _cp()
    cases = [((2048, 2048), 2, np.linspace(-3, 3, 256)), ((7, 300, 300), 2, np.linspace(-3, 3, 64)),
             ((96, 96, 96), 3, np.linspace(-3, 3, 256)), ((2, 257, 300), 2, np.linspace(-3, 3, 8192))]
    for shape, ndim, t in cases:
        img = rng.standard_normal(shape).astype(np.float32)
        want = cutopo.ecc(img, t, ndim=ndim)
        dev = cp.asarray(img)
        for _ in range(10):
            np.testing.assert_array_equal(cutopo.ecc(dev, t, ndim=ndim).get(), want, err_msg=str(shape))



@pytest.mark.parametrize("mode", ["block prefix", "last block"])
def test_both_ways_of_cumulating(rng, monkeypatch, mode):
    """The plan cumulates the curve either by every block's prefix sums (small launches) or
    by the last block of each image; both must give the NumPy curve exactly, on random data,
    heavy ties (few non-zero bins per block, whose prefix sums then span many bins), NaN, 2D
    batches and 3D, V and T constructions, T from 1 to 4096 shared bins."""
    from cutopo import _ecc_cupy

    cp = _cp()
    _ecc_cupy.clear_plans()  # plans decide the mode when they are made
    monkeypatch.setattr(_ecc_cupy, "BLOCK_PREFIX_MIN_PIXELS", 0 if mode == "block prefix" else 1 << 40)
    cases = [((1024, 1024), 2, np.linspace(-3, 3, 256), None), ((5, 301, 257), 2, np.linspace(-2, 2, 1), None),
             ((3, 200, 130), 2, np.linspace(0, 6, 300), 7), ((70, 50, 66), 3, np.linspace(-3, 3, 97), None),
             ((2, 333, 129), 2, np.sort(rng.normal(size=4096)), None), ((40, 41, 42), 3, np.arange(4.0), 5)]
    try:
        for shape, ndim, t, levels in cases:
            img = random_image(rng, shape, "float32", levels=levels, nan_fraction=0.02)
            dev = cp.asarray(img)
            for conn in (1, ndim):
                plan = _ecc_cupy.histogram_plan(dev, t, ndim, conn == ndim)
                assert plan.cumulate == (2 if mode == "block prefix" else 1)
                want = cutopo.ecc(img, t, ndim=ndim, connectivity=conn)
                for _ in range(3):
                    got = cutopo.ecc(dev, t, ndim=ndim, connectivity=conn)
                    np.testing.assert_array_equal(got.get(), want, err_msg=f"{shape} {conn}")
    finally:
        _ecc_cupy.clear_plans()


def test_default_way_of_cumulating():
    """Block prefix sums where blocks fill their bins; the last block for bool images (at most
    two non-zero bins per block) and for more bins than a quarter of a block's pixels."""
    from cutopo import _ecc_cupy

    from types import SimpleNamespace

    for shape, dtype, T, want in [((1024, 1024), np.float32, 256, 2), ((1024, 1024), np.bool_, 256, 1),
                                  ((64, 64, 64), np.uint8, 256, 2), ((1024, 1024), np.float32, 4096, 1)]:
        geometry = SimpleNamespace(shape=shape, dtype=np.dtype(dtype))  # a plan needs no data
        t = np.linspace(0, 1, T)
        assert _ecc_cupy.histogram_plan(geometry, t, len(shape), False).cumulate == want, (shape, dtype, T)


def test_memoized_tables_are_ready_for_every_stream(rng):
    """Each op's tables first made on a stream with a backlog, then used at once on another
    stream: that stream must not read a table before it is there. soft_ecc's plan depends on
    T only, so NumPy thresholds of a known length but new values make only a new threshold
    table; the ECC plan and the ECT tables are new with every new threshold array. (The
    tables themselves read wrong from a second stream before cutopo._cuda.tables,
    test_tables_gpu; through these ops the old code gave right answers all the same, for a
    reason not found: this guards the property, it did not reproduce the failure.)"""
    from gpu_support import busy

    cp = _cp()
    img = random_image(rng, (2, 300, 280), "float32", levels=9)
    mask = img > 4
    dev, dmask = cp.asarray(img), cp.asarray(mask)
    dirs = rng.normal(size=(6, 2))
    slow, other = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
    ops = {"soft_ecc": (lambda x, m, t: cutopo.soft_ecc(x, t.astype(np.float32), 8.0, ndim=2),
                        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-3)),
           "ecc": (lambda x, m, t: cutopo.ecc(x, t, ndim=2), np.testing.assert_array_equal),
           "ect": (lambda x, m, t: cutopo.ect(m, dirs, t / 9 - 0.5), np.testing.assert_array_equal)}
    for name, (op, check) in ops.items():
        op(dev, dmask, np.linspace(0, 9, 40))  # kernels loaded, plans of this length made
        for _ in range(4):
            t = np.sort(rng.uniform(0, 9, 40))  # values never seen before: new tables
            busy(cp, slow)
            with slow:
                op(dev, dmask, t)
            with other:
                got = op(dev, dmask, t)
                other.synchronize()
            slow.synchronize()
            check(got.get(), op(img, mask, t))


def test_ecc_repeated_calls_keep_every_check(rng):
    """Repeated calls of one geometry and one thresholds array skip the checks and the plan's
    lookup (cutopo._ecc_cupy._REPEATED) but nothing that depends on the call: the image's
    values, the thresholds' values (a changed array is another key: checked, binned anew),
    other layouts and types; the kept counters of the last-block curves stay zeroed."""
    from cutopo import _ecc_cupy

    cp = _cp()
    _ecc_cupy.clear_plans()
    # (shape, ndim, T): the last block cumulates (bool, many bins) or every block (float32)
    for shape, ndim, T, dtype in (((3, 70, 90), 2, 300, "float32"), ((40, 33, 35), 3, 64, "float32"),
                                  ((130, 120), 2, 32, "bool"), ((2, 64, 64), 2, 4096, "float32")):
        t = np.sort(rng.uniform(-2.5, 2.5, T)).astype(np.float32 if dtype == "float32" else np.float64)
        for _ in range(3):  # fresh images of one geometry
            img = random_image(rng, shape, dtype, nan_fraction=0.01)
            got = cutopo.ecc(cp.asarray(img), t, ndim=ndim)
            np.testing.assert_array_equal(got.get(), cutopo.ecc(img, t, ndim=ndim), err_msg=str(shape))
        plan = _ecc_cupy.histogram_plan(cp.asarray(img), t.astype(np.result_type(img.dtype, t.dtype)),
                                        ndim, False)
        for ws in plan._counters.kept():
            assert not ws.any(), "a counter of blocks done was left non-zero"
    assert len(_ecc_cupy._REPEATED) == 4
    img = random_image(rng, (3, 70, 90), "float32")
    dev = cp.asarray(img)
    t = np.sort(rng.uniform(-2.5, 2.5, 300)).astype(np.float32)
    cutopo.ecc(dev, t, ndim=2)
    bad = t.copy()
    bad[[5, 200]] = bad[[200, 5]]
    with pytest.raises(ValueError, match="sorted"):
        cutopo.ecc(dev, bad, ndim=2)
    bad = t.copy()
    bad[7] = np.nan
    with pytest.raises(ValueError, match="finite"):
        cutopo.ecc(dev, bad, ndim=2)
    with pytest.raises(ValueError, match="connectivity"):
        cutopo.ecc(dev, t, ndim=2, connectivity=5)
    # the same geometry, other thresholds values (in place too): binned anew
    moved = t + np.float32(0.25)
    np.testing.assert_array_equal(cutopo.ecc(dev, moved, ndim=2).get(), cutopo.ecc(img, moved, ndim=2))
    t += np.float32(0.5)
    np.testing.assert_array_equal(cutopo.ecc(dev, t, ndim=2).get(), cutopo.ecc(img, t, ndim=2))
    # other layouts, types and batch shapes of the same pixels; another stream
    want = cutopo.ecc(img, t, ndim=2)
    for other in (cp.asarray(np.repeat(img, 2, axis=2))[:, :, ::2], dev.astype(cp.float64),
                  dev.reshape(1, 3, 70, 90)):
        got = cutopo.ecc(other, t, ndim=2)
        np.testing.assert_array_equal(got.get().reshape(want.shape), want)
    with cp.cuda.Stream(non_blocking=True) as s:
        got = cutopo.ecc(dev, t, ndim=2)
        s.synchronize()
    np.testing.assert_array_equal(got.get(), want)
    _ecc_cupy.clear_plans()
