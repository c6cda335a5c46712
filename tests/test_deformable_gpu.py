"""CUDA kernels of deformable_aggregation (cuda_src/deformable.cu) against the NumPy path.

The NumPy path is the oracle (tested against a loop and finite differences in
test_deformable.py). Every GPU output and cotangent must equal it to the rounding of the
computation dtype; outputs are allocated from a NaN-poisoned pool, so an element a kernel
forgets to write shows up as NaN.
"""
from __future__ import annotations

import numpy as np
import pytest

import cutopo
from cutopo import _deformable_cupy
from cutopo._cuda.repeated import RepeatedCalls
from cutopo.deformable import deformable_aggregation
from deformable_cases import map_layout
from gpu_support import begin_capture, cupy_module as _cp, poison_pool

pytestmark = pytest.mark.gpu

TOL = {np.dtype(np.float32): 2e-5, np.dtype(np.float64): 1e-11}


@pytest.fixture
def vector_mode(request):
    """Sets _deformable_cupy.FORCE_VECTOR for the test, restores it after."""
    old = _deformable_cupy.FORCE_VECTOR
    _deformable_cupy.FORCE_VECTOR = getattr(request, "param", None)
    yield _deformable_cupy.FORCE_VECTOR
    _deformable_cupy.FORCE_VECTOR = old


def problem(rng, bs=2, A=5, P=4, K=3, shapes=((6, 9), (3, 5), (2, 2)), C=8, G=2,
            dtype=np.float32, visibility="mixed", gap=1):
    """Flattened features (maps camera-major, ``gap`` unused rows after each), locations and
    weights. visibility "mixed": per (b, a, p) one visible camera (80 %) or two (20 %), the
    others outside the image (as in Sparse4D); "uniform": every camera in (-0.15, 1.15)."""
    S = len(shapes)
    sh, starts, row = map_layout(shapes, K, gap, other=-1)  # the last camera of another size
    feats = rng.standard_normal((bs, row, C)).astype(dtype)
    if visibility == "uniform":
        loc = rng.uniform(-0.15, 1.15, (bs, A, P, K, 2))
    else:
        loc = rng.choice([-0.4, 1.3], size=(bs, A, P, K, 2))
        n = bs * A * P
        flat = loc.reshape(n, K, 2)
        first = rng.integers(0, K, n)
        flat[np.arange(n), first] = rng.uniform(0.01, 0.99, (n, 2))
        two = rng.random(n) < 0.2
        second = (first + 1 + rng.integers(0, max(K - 1, 1), n)) % K
        flat[np.flatnonzero(two), second[two]] = rng.uniform(0.01, 0.99, (int(two.sum()), 2))
    # Multiples of 2^-12: x = u W - 1/2 is then exact in every dtype (W < 2^11), so oracles in
    # another precision see the same pixel cells (the location cotangent jumps between cells).
    loc = (np.round(loc * 4096) / 4096).astype(dtype)
    w = rng.standard_normal((bs, A, P, K, S, G)).astype(dtype)
    return feats, sh, starts, loc, w


def _to_gpu(*arrays):
    cp = _cp()
    return tuple(cp.asarray(a) for a in arrays)


def assert_close(gpu, ref, dtype, what, rtol=None):
    cp = _cp()
    got = cp.asnumpy(gpu).astype(np.float64)
    ref = cp.asnumpy(ref).astype(np.float64)                 # NumPy or CuPy reference
    assert got.shape == ref.shape, what
    assert np.all(np.isfinite(got)), f"{what}: non-finite values (unwritten output?)"
    tol = (rtol or TOL[np.dtype(dtype)]) * max(1.0, float(np.max(np.abs(ref), initial=0.0)))
    err = np.abs(got - ref)
    assert np.all(err <= tol), f"{what}: max error {err.max():.3g} at {np.unravel_index(err.argmax(), err.shape)}, tol {tol:.3g}"


def run_both(args_np, kw, g_np, wrt=None):
    """(out, cotangents) of the NumPy path and of the GPU path on copies of the same inputs."""
    cp = _cp()
    out_c, pb_c = cutopo.vjp(deformable_aggregation, *args_np, wrt=wrt, **kw)
    cots_c = pb_c(g_np)
    args_g = tuple(cp.asarray(a) if isinstance(a, np.ndarray) else
                   ([cp.asarray(x) for x in a] if isinstance(a, list) else a) for a in args_np)
    poison_pool(256 << 20)
    out_g, pb_g = cutopo.vjp(deformable_aggregation, *args_g, wrt=wrt, **kw)
    poison_pool(256 << 20)
    cots_g = pb_g(cp.asarray(g_np))
    return (out_c, cots_c), (out_g, cots_g)


def check_against_numpy(args_np, kw, g_np, dtype, wrt=None, rtol=None):
    (out_c, cots_c), (out_g, cots_g) = run_both(args_np, kw, g_np, wrt)
    assert out_g.dtype == out_c.dtype
    assert_close(out_g, out_c, dtype, "out", rtol)
    names = ("d_features", "d_spatial_shapes", "d_level_start_index", "d_locations", "d_weights")
    for name, a, b in zip(names, cots_g, cots_c):
        assert (a is None) == (b is None), name
        if isinstance(b, list):  # per-level features: one cotangent per level
            assert isinstance(a, list) and len(a) == len(b), name
            pairs = [(f"{name}[{i}]", ai, bi) for i, (ai, bi) in enumerate(zip(a, b))]
        else:
            pairs = [(name, a, b)] if a is not None else []
        for what, ai, bi in pairs:
            assert ai.dtype == bi.dtype and ai.shape == bi.shape, what
            assert_close(ai, bi, dtype, what, rtol)
    return out_g, cots_g


# ---------------------------------------------------------------------------------------------
# GPU equals NumPy


@pytest.mark.parametrize("vector_mode", [None, "scalar", "vector"], indirect=True)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("boundary", ["sparse4d", "zeros"])
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("C,G", [(8, 2), (24, 3), (20, 4), (96, 2), (512, 1), (64, 64)])
def test_matches_numpy(rng, vector_mode, dtype, boundary, deterministic, C, G):
    args = problem(rng, C=C, G=G, dtype=dtype, visibility="uniform")
    g = rng.standard_normal((args[0].shape[0], args[3].shape[1], C)).astype(dtype)
    check_against_numpy(args, dict(boundary=boundary, deterministic=deterministic), g, dtype)


@pytest.mark.parametrize("vector_mode", [None, "scalar", "vector"], indirect=True)
@pytest.mark.parametrize("deterministic", [False, True])
def test_sparse4d_like_configuration(rng, vector_mode, deterministic):
    """6 cameras, 4 scales, C 256, G 8, P 13 (P K > 32: several visibility ballots), one or
    two visible cameras per point."""
    args = problem(rng, bs=2, A=40, P=13, K=6, shapes=((16, 44), (8, 22), (4, 11), (2, 6)),
                   C=256, G=8, gap=0)
    g = rng.standard_normal((2, 40, 256)).astype(np.float32)
    check_against_numpy(args, dict(deterministic=deterministic), g, np.float32)


@pytest.fixture
def forward_parts(request):
    """Sets _deformable_cupy.FORCE_PARTS for the test, restores it after."""
    old = _deformable_cupy.FORCE_PARTS
    _deformable_cupy.FORCE_PARTS = request.param
    yield request.param
    _deformable_cupy.FORCE_PARTS = old


@pytest.mark.parametrize("forward_parts", [1, 2, 4, 8], indirect=True)
@pytest.mark.parametrize("vector_mode", [None, "scalar"], indirect=True)
@pytest.mark.parametrize("shapes", [((7, 5),), ((6, 9), (3, 5), (2, 2)), ((16, 44), (8, 22), (4, 11), (2, 6))])
@pytest.mark.parametrize("C,G", [(32, 4), (256, 8)])
def test_forward_split_across_warps(rng, forward_parts, vector_mode, shapes, C, G):
    """The forward's items split over 1, 2, 4 or 8 warps per output unit (more scales than
    warps, fewer, equal; A = 5 leaves the last block with missing units): equal to NumPy, and
    the same bits on every call (the partial sums are added in a fixed order)."""
    cp = _cp()
    args = problem(rng, bs=1, A=5, P=7, K=3, shapes=shapes, C=C, G=G)
    check_against_numpy(args, {}, rng.standard_normal((1, 5, C)).astype(np.float32), np.float32)
    gpu = _to_gpu(*args)
    first = deformable_aggregation(*gpu)
    for _ in range(3):
        poison_pool(64 << 20)
        assert bool(cp.array_equal(deformable_aggregation(*gpu), first))


def test_many_cameras(rng):
    """K > 32: the backward's camera ballot runs in two rounds."""
    args = problem(rng, bs=1, A=3, P=2, K=37, shapes=((3, 4), (2, 2)), C=16, G=4, visibility="uniform")
    g = rng.standard_normal((1, 3, 16)).astype(np.float32)
    for det in (False, True):
        check_against_numpy(args, dict(deterministic=det, boundary="zeros"), g, np.float32)


@pytest.mark.parametrize("wrt", ["features", "sampling_locations", "weights",
                                 ("sampling_locations", "weights"), ("features", "weights")])
def test_only_requested_cotangents(rng, wrt):
    args = problem(rng, C=16, G=4)
    g = rng.standard_normal((2, 5, 16)).astype(np.float32)
    _, cots = check_against_numpy(args, {}, g, np.float32, wrt=wrt)
    names = (wrt,) if isinstance(wrt, str) else wrt
    idx = {"features": 0, "sampling_locations": 3, "weights": 4}
    assert {i for i, c in enumerate(cots) if c is not None} == {idx[n] for n in names}


@pytest.mark.parametrize("layout", ["channels_first", "channels_last"])
@pytest.mark.parametrize("vector_mode", [None, "vector"], indirect=True)
def test_level_list_form(rng, layout, vector_mode):
    cp = _cp()
    K, shapes, C, G = 3, ((7, 5), (4, 3), (2, 2)), 16, 4
    S = len(shapes)
    bs, A, P = 2, 6, 3
    levels = []
    for H, W in shapes:
        shape = (bs, K, C, H, W) if layout == "channels_first" else (bs, K, H, W, C)
        levels.append(rng.standard_normal(shape).astype(np.float32))
    loc = rng.uniform(-0.1, 1.1, (bs, A, P, K, 2)).astype(np.float32)
    w = rng.standard_normal((bs, A, P, K, S, G)).astype(np.float32)
    g = rng.standard_normal((bs, A, C)).astype(np.float32)
    kw = dict(level_layout=layout, boundary="zeros")
    for det in (False, True):  # the feature cotangent: atomics into a flat buffer, or sorted
        _, cots = check_against_numpy((levels, None, None, loc, w), dict(kw, deterministic=det), g,
                                      np.float32)
        assert [d.shape for d in cots[0]] == [lv.shape for lv in levels]
    # only the feature cotangent (the scatter launch alone), and with float16 levels
    check_against_numpy((levels, None, None, loc, w), kw, g, np.float32, wrt="features")
    half = [lv.astype(np.float16) for lv in levels]
    out_g, pb_g = cutopo.vjp(deformable_aggregation, [cp.asarray(x) for x in half], None, None,
                             cp.asarray(loc), cp.asarray(w), wrt="features", **kw)
    _, pb_c = cutopo.vjp(deformable_aggregation, [x.astype(np.float64) for x in half], None, None,
                         loc.astype(np.float64), w.astype(np.float64), wrt="features", **kw)
    for a, b in zip(pb_g(cp.asarray(g))[0], pb_c(g.astype(np.float64))[0]):
        assert a.dtype == np.float16
        assert_close(a.astype(np.float32), b, np.float32, "float16 level cotangent", rtol=2e-2)
    # a level that is an odd view (not aligned to 16 bytes) and a non-contiguous one
    lv_g = [cp.asarray(x) for x in levels]
    big = cp.empty(lv_g[1].size + 1, dtype=np.float32)
    big[1:] = lv_g[1].reshape(-1)
    odd = big[1:].reshape(lv_g[1].shape)
    strided = cp.asfortranarray(lv_g[2])
    out = deformable_aggregation([lv_g[0], odd, strided], None, None, cp.asarray(loc), cp.asarray(w), **kw)
    ref = deformable_aggregation(levels, None, None, loc, w, **kw)
    assert_close(out, ref, np.float32, "out (odd views)")


def test_non_contiguous_inputs(rng):
    cp = _cp()
    feats, sh, starts, loc, w = problem(rng, C=16, G=4, visibility="uniform")
    ref = deformable_aggregation(feats, sh, starts, loc, w)
    f_g = cp.asfortranarray(cp.asarray(feats))
    l_g = cp.asarray(np.ascontiguousarray(loc.transpose(4, 0, 1, 2, 3))).transpose(1, 2, 3, 4, 0)
    w_g = cp.asfortranarray(cp.asarray(w))
    out = deformable_aggregation(f_g, cp.asarray(sh), cp.asarray(starts), l_g, w_g)
    assert_close(out, ref, np.float32, "out")


# ---------------------------------------------------------------------------------------------
# Repeated calls: memoized validation and launch plans


@pytest.mark.parametrize("vector_mode", [None, "scalar"], indirect=True)
def test_repeated_calls_reuse_the_forward_plan(rng, vector_mode, monkeypatch):
    cp = _cp()
    from cutopo import deformable as mod

    monkeypatch.setattr(mod, "_MEMO", RepeatedCalls())  # count this test's plans only
    feats, sh, starts, loc, w = problem(rng, C=32, G=4, visibility="uniform")
    ref = deformable_aggregation(feats, sh, starts, loc, w)
    f_g, l_g, w_g = _to_gpu(feats, loc, w)
    outs = [deformable_aggregation(f_g, sh, starts, l_g, w_g) for _ in range(3)]
    for out in outs:
        assert_close(out, ref, np.float32, "out (repeated)")
        np.testing.assert_array_equal(cp.asnumpy(out), cp.asnumpy(outs[0]))
    memo = mod._configure(f_g, sh, starts, l_g, w_g, "sparse4d", False, "channels_first").memo
    assert sum(k[0] == "forward" for k in memo.plans) == 1
    # the same kind of call with a misaligned view of the features (no vector loads), with
    # non-contiguous weights (copied: no plan kept), and with fresh arrays: same values
    big = cp.empty(f_g.size + 1, dtype=f_g.dtype)
    big[1:] = f_g.reshape(-1)
    odd = big[1:].reshape(f_g.shape)
    strided_w = cp.asfortranarray(w_g)
    for _ in range(2):
        assert_close(deformable_aggregation(odd, sh, starts, l_g, w_g), ref, np.float32, "out (odd view)")
        assert_close(deformable_aggregation(f_g, sh, starts, l_g, strided_w), ref, np.float32,
                     "out (strided weights)")
        assert_close(deformable_aggregation(*_to_gpu(feats, sh, starts, loc, w)), ref, np.float32,
                     "out (CuPy tables)")
    assert sum(k[0] == "forward" for k in memo.plans) == 2
    # bfloat16 features (kernel views of their bits) through the plan
    ml_dtypes = pytest.importorskip("ml_dtypes")
    fb = feats.astype(ml_dtypes.bfloat16)
    ref_b = deformable_aggregation(fb, sh, starts, loc, w)
    for _ in range(3):
        assert_close(deformable_aggregation(cp.asarray(fb), sh, starts, l_g, w_g), ref_b, np.float32,
                     "out (bfloat16 features)")


def test_repeated_forward_has_no_host_synchronisation(rng):
    """After a first call of its kind (NumPy tables), the forward is capturable in a CUDA graph:
    no device-to-host copy, no synchronisation."""
    cp = _cp()
    feats, sh, starts, loc, w = problem(rng, C=64, G=8)
    ref = deformable_aggregation(feats, sh, starts, loc, w)
    f_g, l_g, w_g = _to_gpu(feats, loc, w)
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        deformable_aggregation(f_g, sh, starts, l_g, w_g)  # validation, tables, plan, pool block
        stream.synchronize()
        begin_capture(stream)
        try:
            out = deformable_aggregation(f_g, sh, starts, l_g, w_g)
        finally:
            graph = stream.end_capture()  # raises when the call synchronised
        graph.launch(stream)
        stream.synchronize()
    assert_close(out, ref, np.float32, "out (graph replay)")


# ---------------------------------------------------------------------------------------------
# Determinism


def test_deterministic_mode_is_bitwise_reproducible(rng):
    cp = _cp()
    # Coarse maps: many entries share each feature row (heavy atomic contention otherwise).
    feats, sh, starts, loc, w = problem(rng, bs=2, A=300, P=13, K=6, shapes=((8, 22), (4, 11), (2, 6)),
                                        C=256, G=8, gap=0)
    args = _to_gpu(feats, sh, starts, loc, w)
    g = cp.asarray(rng.standard_normal((2, 300, 256)).astype(np.float32))
    runs = []
    for _ in range(3):
        out, pb = cutopo.vjp(deformable_aggregation, *args, deterministic=True)
        d_f, _, _, d_l, d_w = pb(g)
        runs.append([cp.asnumpy(x).view(np.uint32) for x in (out, d_f, d_l, d_w)])
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            np.testing.assert_array_equal(a, b)
    # ... and equal to the atomic version up to rounding
    _, pb = cutopo.vjp(deformable_aggregation, *args, deterministic=False)
    d_atomic = pb(g)[0]
    assert_close(d_atomic, runs[0][1].view(np.float32), np.float32, "atomic vs sorted d_features")


# ---------------------------------------------------------------------------------------------
# Half precision


@pytest.mark.parametrize("storage", ["float16", "bfloat16"])
@pytest.mark.parametrize("weights32", [False, True])
def test_half_storage(rng, storage, weights32):
    cp = _cp()
    if storage == "bfloat16":
        ml_dtypes = pytest.importorskip("ml_dtypes")
        dt = np.dtype(ml_dtypes.bfloat16)
        try:
            cp.asarray(np.zeros(2, dtype=dt))
        except Exception as exc:  # pragma: no cover - CuPy without bfloat16
            pytest.skip(f"CuPy has no bfloat16 arrays: {exc}")
    else:
        dt = np.dtype(np.float16)
    feats, sh, starts, loc, w = problem(rng, bs=2, A=30, P=13, K=6, shapes=((16, 44), (8, 22), (4, 11)),
                                        C=64, G=8)
    fh = feats.astype(dt)
    wh = w if weights32 else w.astype(dt)
    lh = loc.astype(dt) if not weights32 else loc
    g = rng.standard_normal((2, 30, 64)).astype(np.float32)
    args_g = _to_gpu(fh, sh, starts, lh, wh)
    out_g, pb_g = cutopo.vjp(deformable_aggregation, *args_g)
    assert out_g.dtype == (dt if not weights32 else np.float32)
    g_g = cp.asarray(g).astype(out_g.dtype)  # a half output takes a half cotangent
    # Oracle: the NumPy path in float64 on the same (rounded) values and cotangent.
    ref_args = (fh.astype(np.float64), sh, starts, lh.astype(np.float64), wh.astype(np.float64))
    out_c, pb_c = cutopo.vjp(deformable_aggregation, *ref_args)
    cots_c = pb_c(cp.asnumpy(g_g.astype(np.float32)).astype(np.float64))
    # float32 accumulation of half inputs: the rounding of the output dtype dominates
    rtol = 1e-2 if out_g.dtype.itemsize == 2 else 1e-4
    assert_close(out_g.astype(np.float32), out_c, np.float32, "out", rtol)
    cots_g = pb_g(g_g)
    # every float argument, bfloat16 included, gets its cotangent in its own dtype (float32
    # buffers inside, rounded once): within the rounding of that dtype of the float64 oracle
    for a, b, arg in zip(cots_g, cots_c, args_g):
        if b is None:
            assert a is None
            continue
        assert a is not None and a.dtype == arg.dtype and a.shape == arg.shape
        assert_close(a.astype(np.float32), b, np.float32, f"cotangent of {arg.shape} {arg.dtype}",
                     rtol=2e-2 if a.dtype.itemsize == 2 else 1e-3)
    if storage == "bfloat16":
        # ... and equals the float32 path on the same values, rounded to bfloat16 once
        args32 = _to_gpu(fh.astype(np.float32), sh, starts, lh.astype(np.float32), wh.astype(np.float32))
        _, pb32 = cutopo.vjp(deformable_aggregation, *args32)
        for a, b, arg in zip(cots_g, pb32(g_g.astype(np.float32)), args_g):
            if a is not None:
                assert_close(a.astype(np.float32), b.astype(arg.dtype).astype(np.float32), np.float32,
                             f"bfloat16 vs float32 cotangent of {arg.shape}", rtol=1e-2)


# ---------------------------------------------------------------------------------------------
# Boundaries, NaN, validation


def test_nan_locations_contribute_nothing(rng):
    cp = _cp()
    feats, sh, starts, loc, w = problem(rng, C=16, G=4, visibility="uniform")
    loc[0, 1, 2, 0, 0] = np.nan
    loc[1, 0, 0, 1, 1] = np.nan
    loc[1, 2, 1, 0, 0] = np.inf
    loc[0, 0, 3, 2, 1] = -np.inf
    g = rng.standard_normal((2, 5, 16)).astype(np.float32)
    for boundary in ("sparse4d", "zeros"):
        _, cots = check_against_numpy((feats, sh, starts, loc, w), dict(boundary=boundary), g, np.float32)
        d_loc = cp.asnumpy(cots[3])
        assert np.all(d_loc[0, 1, 2, 0] == 0) and np.all(d_loc[1, 0, 0, 1] == 0)


def test_points_on_the_edges(rng):
    """u, v exactly 0 or 1 (cut by "sparse4d"), and the half-pixel band (sampled by "zeros")."""
    feats, sh, starts, loc, w = problem(rng, C=8, G=2)
    W0 = sh[0, 0, 1]
    edge = np.array([0.0, 1.0, 0.5, -0.5 / W0, 1.0 + 0.49 / W0, 1e-40, np.nextafter(np.float32(1), 0)],
                    dtype=np.float32)
    flat = loc.reshape(-1, 2)
    flat[:edge.size * edge.size] = np.stack(np.meshgrid(edge, edge), -1).reshape(-1, 2)[:flat.shape[0]]
    g = rng.standard_normal((2, 5, 8)).astype(np.float32)
    for boundary in ("sparse4d", "zeros"):
        check_against_numpy((feats, sh, starts, loc, w), dict(boundary=boundary), g, np.float32)


def test_device_inputs_validation(rng):
    cp = _cp()
    feats, sh, starts, loc, w = problem(rng)
    f_g, l_g, w_g = _to_gpu(feats, loc, w)
    with pytest.raises(TypeError, match="features"):
        deformable_aggregation(feats, sh, starts, l_g, w_g)
    with pytest.raises(TypeError, match="weights"):
        deformable_aggregation(f_g, sh, starts, l_g, w)
    with pytest.raises(TypeError, match="spatial_shapes"):
        deformable_aggregation(feats, cp.asarray(sh), starts, loc, w)
    with pytest.raises(ValueError, match="level_start_index"):
        deformable_aggregation(f_g, sh, cp.asarray(starts + 10**6), l_g, w_g)
    # CuPy tables are accepted with CuPy data
    out = deformable_aggregation(f_g, cp.asarray(sh), cp.asarray(starts.astype(np.int32)), l_g, w_g)
    assert_close(out, deformable_aggregation(feats, sh, starts, loc, w), np.float32, "out")


def test_empty_on_device(rng):
    cp = _cp()
    feats, sh, starts, loc, w = problem(rng)
    f_g, l_g, w_g = _to_gpu(feats, loc, w)
    out = deformable_aggregation(f_g, sh, starts, l_g[:, :, :0], w_g[:, :, :0])
    assert isinstance(out, cp.ndarray) and out.shape == (2, 5, 8) and not bool(cp.any(out))
    out, pb = cutopo.vjp(deformable_aggregation, f_g, sh, starts, l_g[:, :0], w_g[:, :0])
    d = pb(out)
    assert d[0].shape == feats.shape and not bool(cp.any(d[0]))


# ---------------------------------------------------------------------------------------------
# 64-bit indexing


@pytest.mark.slow
def test_offsets_past_2_31_elements(rng):
    """bs num_feat C > 2^31 float16 elements (4.5 GB; the float32 feature cotangent 9 GB): rows
    of the last batch elements sit past every 32-bit element offset. The reference op's int
    indexing fails in this regime (SparseDrive #62). Checked on a few batch elements against the
    NumPy path on those elements alone."""
    cp = _cp()
    shapes = ((8, 8), (4, 4))
    K, S, C, G = 1, 2, 256, 8
    sh = np.array([[list(hw) for hw in shapes]], dtype=np.int64)
    starts = np.array([[0, 64]], dtype=np.int64)
    num_feat = 80
    bs = 2**31 // (num_feat * C) + 3000                   # 107857: past 2^31 by 6.1e7 elements
    assert bs * num_feat * C > 2**31
    A, P = 1, 3
    pick = np.array([0, 1, bs // 2, bs - 2, bs - 1])
    base = rng.standard_normal((num_feat, C)).astype(np.float16)
    feats = cp.empty((bs, num_feat, C), dtype=np.float16)
    feats[:] = cp.asarray(base)[None]
    local = rng.standard_normal((pick.size, num_feat, C)).astype(np.float16)
    feats[cp.asarray(pick)] = cp.asarray(local)
    loc = rng.uniform(0.02, 0.98, (bs, A, P, K, 2)).astype(np.float32)
    w = rng.standard_normal((bs, A, P, K, S, G)).astype(np.float32)
    g = rng.standard_normal((bs, A, C)).astype(np.float32)
    sub = (local.astype(np.float64), sh, starts, loc[pick].astype(np.float64), w[pick].astype(np.float64))
    out_c, pb_c = cutopo.vjp(deformable_aggregation, *sub)
    d_c = pb_c(g[pick].astype(np.float64))
    for det in (False, True):
        out_g, pb_g = cutopo.vjp(deformable_aggregation, feats, sh, starts, cp.asarray(loc), cp.asarray(w),
                                 deterministic=det)
        assert_close(out_g[cp.asarray(pick)], out_c, np.float32, "out", rtol=1e-4)
        d_f, _, _, d_l, d_w = pb_g(cp.asarray(g))
        assert_close(d_f[cp.asarray(pick)].astype(np.float32), d_c[0], np.float32, "d_features", rtol=2e-2)
        assert_close(d_l[cp.asarray(pick)], d_c[3], np.float32, "d_locations", rtol=1e-3)
        assert_close(d_w[cp.asarray(pick)], d_c[4], np.float32, "d_weights", rtol=1e-3)
        del out_g, pb_g, d_f, d_l, d_w
        cp.get_default_memory_pool().free_all_blocks()
