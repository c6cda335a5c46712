"""GPU kernels of soft_ecc (cuda_src/ecc_soft.cuh), ect and soft_ect (cuda_src/ecc_band.cuh)
against the NumPy path.

The NumPy path is the oracle: it is tested against finite differences, scikit-image and
closed forms in test_soft_ecc.py / test_ect.py. Here every result of the kernels must equal
it: exactly for the integer ECT, to the rounding of the computation dtype (relative to
sum |c|, the scale of the terms) for the soft ops.
"""
from __future__ import annotations

import numpy as np
import pytest

import cutopo
from cutopo import _ecc_numpy
from gpu_support import begin_capture, cupy_module as _cp, poison_pool

pytestmark = pytest.mark.gpu

RTOL = {np.dtype(np.float32): 2e-6, np.dtype(np.float64): 1e-12}


def _image(rng, shape, dtype=np.float32, levels=None, specials=False):
    if levels:
        img = rng.integers(0, levels, size=shape).astype(np.float64) / levels
    else:
        img = rng.random(shape)
    img = img.astype(dtype)
    if specials:
        flat = img.reshape(-1)
        idx = rng.choice(flat.size, size=3, replace=False)
        flat[idx] = [np.nan, np.inf, -np.inf]
    return img


def _sum_abs_c(image, ndim, conn, periodic=False):
    c = _ecc_numpy.euler_contributions(image, ndim, conn == ndim, periodic)
    return np.abs(c.reshape(c.shape[:c.ndim - ndim] + (-1,))).sum(axis=-1)


def _close(gpu, cpu, scale, dtype, what):
    gpu = _cp().asnumpy(gpu).astype(np.float64)
    cpu = np.asarray(cpu, dtype=np.float64)
    assert gpu.shape == cpu.shape, what
    assert np.all(np.isfinite(gpu)), f"{what}: non-finite values"
    tol = RTOL[np.dtype(dtype)] * (np.asarray(scale, dtype=np.float64) + 1.0)
    err = np.abs(gpu - cpu)
    assert np.all(err <= tol), f"{what}: max error {err.max():.3g}, tolerance {np.min(tol):.3g}"


def _close_cotangents(d_g, d_c, g, S, scale, T, dtype, what=""):
    """soft_ecc's three cotangents (image, thresholds, scale) against the NumPy path's, each to
    the size of its own sums: scale * sum |g|, that times sum |c| / T, and sum |g| sum |c| / (4
    scale) (d_scale's terms g c sigma'(u) u / scale, |sigma'(u) u| < 0.224: sum |g| sum |c|
    alone is scale / 0.224 times looser)."""
    lam_g = scale * np.abs(g).sum()
    _close(d_g[0], d_c[0], lam_g, dtype, f"d_image{what}")
    _close(d_g[1], d_c[1], lam_g * S.sum() / T, dtype, f"d_thresholds{what}")
    _close(d_g[2], d_c[2], np.abs(g).sum() * S.sum() / (4.0 * scale), dtype, f"d_scale{what}")


# ---------------------------------------------------------------------------------------------
# soft_ecc


@pytest.mark.parametrize("ndim,shape", [(2, (37, 53)), (2, (3, 64, 40)), (3, (11, 9, 13)),
                                        (3, (2, 7, 16, 5))])
@pytest.mark.parametrize("conn_is_ndim", [False, True])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_soft_ecc_forward_and_vjp_match_numpy(rng, ndim, shape, conn_is_ndim, dtype):
    cp = _cp()
    conn = ndim if conn_is_ndim else 1
    img = _image(rng, shape, dtype, levels=int(rng.integers(5, 40)), specials=True)
    t = np.sort(rng.uniform(-0.1, 1.1, size=int(rng.integers(20, 90)))).astype(dtype)
    scale = float(rng.uniform(5, 60))
    kw = dict(ndim=ndim, connectivity=conn)
    out_c, pb_c = cutopo.vjp(cutopo.soft_ecc, img, t, scale, **kw)
    poison_pool()
    out_g, pb_g = cutopo.vjp(cutopo.soft_ecc, cp.asarray(img), cp.asarray(t), scale, **kw)
    assert isinstance(out_g, cp.ndarray) and out_g.dtype == out_c.dtype
    S = _sum_abs_c(img, ndim, conn)[..., None]
    _close(out_g, out_c, S, dtype, "forward")

    g = rng.standard_normal(out_c.shape).astype(dtype)
    d_c = pb_c(g)
    poison_pool()
    d_g = pb_g(cp.asarray(g))
    _close_cotangents(d_g, d_c, g, S, scale, len(t), dtype)
    # Pixels without a contribution get exactly zero (every element is written).
    c = _ecc_numpy.euler_contributions(img, ndim, conn == ndim, False)
    assert np.all(cp.asnumpy(d_g[0])[c == 0] == 0)


@pytest.mark.parametrize("in_dtype", ["bool", "uint8", "uint16", "int16", "int32", "float16"])
@pytest.mark.parametrize("shape,listed", [((40, 33), False), ((9, 14, 64), False), ((9, 14, 64), True)],
                         ids=["2d", "3d", "3d-listed"])
def test_soft_ecc_input_dtypes(rng, force_listed_forward, fresh_soft_ecc_plans, in_dtype, shape, listed):
    """Every input dtype, 2D and 3D (rows of 64: the 3D sweeps' 16-byte plane reads of every
    width), the fused forward and the listed one (_soft_ecc_cupy.listed_forward)."""
    from cutopo import _soft_ecc_cupy

    cp = _cp()
    force_listed_forward(listed)
    if in_dtype == "bool":
        img = rng.random(shape) < 0.5
    elif in_dtype == "float16":
        img = rng.random(shape).astype(np.float16)
    else:
        img = rng.integers(0, 100, size=shape).astype(in_dtype)
    assert _soft_ecc_cupy.listed_forward(img.dtype, len(shape), False, 1, img.size) == listed
    t = 12  # a count: linear_thresholds of the image
    out_c = cutopo.soft_ecc(img, t, 3.0)
    out_g = cutopo.soft_ecc(cp.asarray(img), t, 3.0)
    _close(out_g, out_c, _sum_abs_c(img, len(shape), 1)[..., None], np.float32, in_dtype)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_soft_ecc_many_thresholds_use_global_accumulators(rng, dtype):
    """T large enough that the per-block accumulators leave shared memory."""
    cp = _cp()
    img = _image(rng, (2, 30, 31), dtype)
    t = np.linspace(-0.2, 1.2, 5000).astype(dtype)
    out_c, pb_c = cutopo.vjp(cutopo.soft_ecc, img, t, 200.0, ndim=2)
    out_g, pb_g = cutopo.vjp(cutopo.soft_ecc, cp.asarray(img), cp.asarray(t), 200.0, ndim=2)
    S = _sum_abs_c(img, 2, 1)[..., None]
    _close(out_g, out_c, S, dtype, "forward")
    g = rng.standard_normal(out_c.shape).astype(dtype)
    d_c, d_g = pb_c(g), pb_g(cp.asarray(g))
    lam_g = 200.0 * np.abs(g).sum()
    _close(d_g[0], d_c[0], lam_g, dtype, "d_image")
    _close(d_g[1], d_c[1], lam_g * S.sum() / len(t), dtype, "d_thresholds")


def test_soft_ecc_scale_extremes(rng):
    """Tiny scale: every threshold inside the band; huge scale: bands empty, the exact ECC."""
    cp = _cp()
    img = _image(rng, (25, 26), np.float64, levels=10)
    t = np.linspace(0.05, 0.95, 10)  # between the levels
    for scale in (1e-3, 1e9):
        out_c = cutopo.soft_ecc(img, t, scale)
        out_g = cutopo.soft_ecc(cp.asarray(img), cp.asarray(t), scale)
        _close(out_g, out_c, _sum_abs_c(img, 2, 1)[..., None], np.float64, f"scale {scale}")
    np.testing.assert_array_equal(cp.asnumpy(cutopo.soft_ecc(cp.asarray(img), t, 1e9)),
                                  cutopo.ecc(img, t).astype(np.float64))


def test_soft_ecc_host_thresholds_get_host_cotangent(rng):
    cp = _cp()
    img = cp.asarray(_image(rng, (16, 16), np.float32))
    t = np.linspace(0, 1, 8).astype(np.float32)
    out, pb = cutopo.vjp(cutopo.soft_ecc, img, t, cp.asarray(np.float32(9.0)))
    d_img, d_t, d_scale = pb(cp.ones_like(out))
    assert isinstance(d_img, cp.ndarray) and isinstance(d_t, np.ndarray)
    assert isinstance(d_scale, cp.ndarray) and d_scale.shape == () and d_scale.dtype == np.float32


def test_soft_ecc_rejects_bad_input_on_gpu(rng):
    cp = _cp()
    img = cp.asarray(_image(rng, (8, 8), np.float32))
    with pytest.raises(ValueError, match="scale"):
        cutopo.soft_ecc(img, 4, cp.asarray(-1.0))
    with pytest.raises(ValueError, match="sorted"):
        cutopo.soft_ecc(img, cp.asarray([0.5, 0.2]), 1.0)
    with pytest.raises(ValueError, match="image"):  # periodic: every axis >= 3
        cutopo.soft_ecc(img[:2], 4, 1.0, boundary="periodic")
    with pytest.raises(TypeError, match="thresholds is a CuPy array"):
        cutopo.soft_ecc(cp.asnumpy(img), cp.asarray([0.5]), 1.0)


def test_soft_ecc_device_thresholds_are_checked_on_the_device(monkeypatch, rng):
    """Float CuPy thresholds are checked by a kernel whose flags are read after the op's
    kernels are queued, never copied to the host: the results equal those of the same
    thresholds from the host (float16, float32 and float64; to rounding, as the kernels' float64
    atomics add in no fixed order), and NaN, inf and decreasing thresholds still raise at the
    call, on the forward and on cutopo.vjp's forward, without disturbing the calls after them."""
    from cutopo import _soft_ecc, _soft_ecc_cupy
    from cutopo._cuda import deferred

    cp = _cp()
    events = []
    real_read, real_forward = deferred.PinnedWord.read, _soft_ecc_cupy.SoftEccPlan.launch_forward

    def read(self):
        events.append("read")
        return real_read(self)

    def forward(*args, **kwargs):  # every forward's launches, planned calls' and others'
        events.append("forward")
        return real_forward(*args, **kwargs)

    def no_host_check(*args, **kwargs):
        raise AssertionError("float CuPy thresholds reached the host check")

    img = _image(rng, (3, 29, 31), np.float32, levels=17)
    for t_dtype in (np.float16, np.float32, np.float64):
        t = np.sort(rng.uniform(-0.1, 1.1, size=int(rng.integers(2, 700)))).astype(t_dtype)
        want = cutopo.soft_ecc(cp.asarray(img), t, 25.0, ndim=2)          # host thresholds
        monkeypatch.setattr(_soft_ecc, "check_thresholds", no_host_check)
        monkeypatch.setattr(deferred.PinnedWord, "read", read)
        monkeypatch.setattr(_soft_ecc_cupy.SoftEccPlan, "launch_forward", forward)
        events.clear()
        got, pullback = cutopo.vjp(cutopo.soft_ecc, cp.asarray(img), cp.asarray(t), 25.0, ndim=2)
        assert events == ["forward", "read"]
        assert got.dtype == want.dtype
        S = _sum_abs_c(img, 2, 1)[..., None]
        _close(got, want.get(), S, got.dtype, f"{np.dtype(t_dtype).name} thresholds")
        d_img, d_t, _ = pullback(cp.asarray(rng.standard_normal(got.shape).astype(got.dtype)))
        assert isinstance(d_t, cp.ndarray) and d_t.shape == t.shape
        for k, value in ((int(rng.integers(t.size)), np.nan), (0, np.inf), (t.size - 1, -np.inf)):
            bad = t.copy()
            bad[k] = value
            with pytest.raises(ValueError, match="thresholds must be finite"):
                cutopo.soft_ecc(cp.asarray(img), cp.asarray(bad), 25.0, ndim=2)
        if t.size > 1:
            k = int(rng.integers(t.size - 1))
            bad = t.copy()
            bad[k], bad[k + 1] = t[k + 1] + 1, t[k]
            for call in (cutopo.soft_ecc, lambda *a, **kw: cutopo.vjp(cutopo.soft_ecc, *a, **kw)):
                with pytest.raises(ValueError, match="sorted in non-decreasing order"):
                    call(cp.asarray(img), cp.asarray(bad), 25.0, ndim=2)
        monkeypatch.undo()
        again = cutopo.soft_ecc(cp.asarray(img), cp.asarray(t), 25.0, ndim=2)
        _close(again, want.get(), S, got.dtype, "after the errors")


@pytest.mark.parametrize("t_dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("scale_kind", ["python", "float16", "float32", "float64", "device"])
def test_soft_ecc_cotangent_subsets_and_dtypes(rng, t_dtype, scale_kind):
    """Every subset of wanted cotangents, each in its argument's dtype and array type as on the
    NumPy path (the backward's last block writes the thresholds' and the scale's cotangents in
    the computation dtype or in float64, which vjp then rounds once)."""
    cp = _cp()
    img = _image(rng, (2, 23, 41), np.float32, levels=23, specials=True)
    t = np.sort(rng.uniform(-0.1, 1.1, size=int(rng.integers(5, 60)))).astype(t_dtype)
    value = float(rng.uniform(8, 40))
    scale = {"python": value, "float16": np.float16(value), "float32": np.float32(value),
             "float64": np.float64(value), "device": np.float32(value)}[scale_kind]
    g_scale = cp.asarray(scale) if scale_kind == "device" else scale
    S = _sum_abs_c(img, 2, 1)[..., None]
    for wrt in ((0,), (1,), (2,), (0, 1), (1, 2), (0, 2), (0, 1, 2)):
        out_c, pb_c = cutopo.vjp(cutopo.soft_ecc, img, t, scale, ndim=2, wrt=wrt)
        poison_pool()
        out_g, pb_g = cutopo.vjp(cutopo.soft_ecc, cp.asarray(img), cp.asarray(t), g_scale, ndim=2,
                                 wrt=wrt)
        assert out_g.dtype == out_c.dtype and out_g.shape == out_c.shape
        _close(out_g, out_c, S, out_c.dtype, f"forward {wrt}")
        g = rng.standard_normal(out_c.shape).astype(out_c.dtype)
        d_c = pb_c(g)
        poison_pool()
        d_g = pb_g(cp.asarray(g))
        lam_g = value * np.abs(g).sum()
        bounds = (lam_g, lam_g * S.sum() / len(t), np.abs(g).sum() * S.sum())
        for k, (dc, dg, bound) in enumerate(zip(d_c, d_g, bounds)):
            if k not in wrt:
                assert dc is None and dg is None, (wrt, k)
                continue
            assert isinstance(dg, cp.ndarray), (wrt, k)
            assert dg.dtype == dc.dtype and dg.shape == dc.shape, (wrt, k, dg.dtype, dc.dtype)
            if dc.dtype == np.float16:  # rounded once to float16 on both paths
                np.testing.assert_allclose(cp.asnumpy(dg).astype(np.float64),
                                           dc.astype(np.float64), rtol=2e-3, atol=bound * 2e-6)
            else:
                _close(dg, dc, bound, dc.dtype, f"cotangent {k} of {wrt}")


@pytest.mark.parametrize("ndim,shape", [(2, (3, 67, 45)), (3, (2, 13, 17, 35))])
@pytest.mark.parametrize("conn_is_ndim", [False, True])
@pytest.mark.parametrize("pattern", ["checkerboard", "noise"])
def test_soft_ecc_dense_critical_pixels(rng, ndim, shape, conn_is_ndim, pattern):
    """Images where most pixels have c != 0 (a checkerboard, white noise): every warp's queue
    fills with all its pixels of a plane, across several 32-wide queue passes."""
    cp = _cp()
    conn = ndim if conn_is_ndim else 1
    if pattern == "checkerboard":
        idx = np.indices(shape[-ndim:]).sum(axis=0) % 2
        img = (idx + 0.01 * rng.random(shape)).astype(np.float64)
    else:
        img = rng.random(shape)
    c = _ecc_numpy.euler_contributions(img, ndim, conn == ndim, False)
    assert np.mean(c != 0) > 0.3
    t = np.linspace(-0.1, 1.1, 41)
    out_c, pb_c = cutopo.vjp(cutopo.soft_ecc, img, t, 30.0, ndim=ndim, connectivity=conn)
    poison_pool()
    out_g, pb_g = cutopo.vjp(cutopo.soft_ecc, cp.asarray(img), cp.asarray(t), 30.0, ndim=ndim,
                             connectivity=conn)
    S = _sum_abs_c(img, ndim, conn)[..., None]
    _close(out_g, out_c, S, np.float64, "forward")
    g = rng.standard_normal(out_c.shape)
    d_c, d_g = pb_c(g), pb_g(cp.asarray(g))
    _close_cotangents(d_g, d_c, g, S, 30.0, len(t), np.float64)


def test_soft_ecc_workspaces_are_left_zeroed(rng):
    """The kernels leave their kept workspaces zeroed: calls after calls (new images, the same
    plan), a pullback called twice, forwards without pullbacks in between, and another
    stream (its own workspace) all give the NumPy path's results."""
    cp = _cp()
    shape, t = (2, 45, 38), np.linspace(-0.05, 1.05, 33).astype(np.float32)
    images = [_image(rng, shape, np.float32, levels=int(rng.integers(5, 30))) for _ in range(3)]
    S = [_sum_abs_c(img, 2, 1)[..., None] for img in images]
    g = rng.standard_normal((2, 33)).astype(np.float32)
    stream = cp.cuda.Stream(non_blocking=True)
    for k, img in enumerate(images + images[:1]):
        ctx = stream if k == 2 else cp.cuda.Stream.null
        with ctx:
            out, pb = cutopo.vjp(cutopo.soft_ecc, cp.asarray(img), cp.asarray(t), 20.0, ndim=2)
            cutopo.soft_ecc(cp.asarray(images[(k + 1) % 3]), cp.asarray(t), 20.0, ndim=2)
            first, second = pb(cp.asarray(g)), pb(cp.asarray(g))
        out_c, pb_c = cutopo.vjp(cutopo.soft_ecc, img, t, 20.0, ndim=2)
        d_c = pb_c(g)
        S_k = S[k % 3]
        _close(out, out_c, S_k, np.float32, f"forward {k}")
        for d in (first, second):
            _close_cotangents(d, d_c, g, S_k, 20.0, len(t), np.float32, f" {k}")


def test_soft_ecc_empty_batch(rng):
    cp = _cp()
    img = cp.asarray(rng.random((0, 9, 9)).astype(np.float32))
    t = cp.linspace(0, 1, 5, dtype=cp.float32)
    out, pb = cutopo.vjp(cutopo.soft_ecc, img, t, 3.0, ndim=2)
    assert out.shape == (0, 5) and out.dtype == np.float32
    d_img, d_t, d_s = pb(cp.ones_like(out))
    assert d_img.shape == (0, 9, 9) and d_t.shape == (5,) and d_s.shape == ()
    assert float(cp.abs(d_t).sum()) == 0.0 and float(d_s) == 0.0


def test_soft_ecc_empty_batch_checks_device_thresholds(rng):
    """No kernel runs for an empty batch: its device thresholds are checked on the host."""
    cp = _cp()
    img = cp.asarray(rng.random((0, 9, 9)).astype(np.float32))
    with pytest.raises(ValueError, match="sorted in non-decreasing order"):
        cutopo.soft_ecc(img, cp.asarray([0.5, 0.25], dtype=cp.float32), 3.0, ndim=2)
    with pytest.raises(ValueError, match="thresholds must be finite"):
        cutopo.soft_ecc(img, cp.asarray([0.5, np.nan], dtype=cp.float32), 3.0, ndim=2)


def test_soft_ecc_check_word_takes_only_its_own_launch(rng):
    """The forward's block 0 writes (token << 2) | flags into the thread's page-locked word: a
    value left there by an earlier, abandoned launch (an older token, failed flags) is not read
    as this launch's, and an abandoned launch's late flags do not leak into the next call."""
    from cutopo import _soft_ecc_cupy
    from cutopo._cuda.launch import NULL

    cp = _cp()
    img = _image(rng, (21, 30), np.float32, levels=13)
    t = np.linspace(-0.1, 1.1, 17).astype(np.float32)
    want = cutopo.soft_ecc(img, t, 12.0)
    cutopo.soft_ecc(cp.asarray(img), cp.asarray(t), 12.0)  # makes the plan and its word
    plan = _soft_ecc_cupy.soft_ecc_plan(cp.cuda.runtime.getDevice(), np.dtype(np.float32), 1,
                                        (21, 30), False, False, t.size, np.dtype(np.float32))
    word = _soft_ecc_cupy.check_word()
    token = word._token
    word._host[0] = ((token + 1) << 2) | 3  # what a stale launch with the next token would...
    word._token = token + 1                 # ...have written had it been armed twice
    got = cutopo.soft_ecc(cp.asarray(img), cp.asarray(t), 12.0)  # arms token + 2
    assert word._token == token + 2 and int(word._host[0]) == (token + 2) << 2
    _close(got, want, _sum_abs_c(img, 2, 1), np.float32, "after a stale word")
    # an abandoned launch on bad thresholds (armed, launched, never read), then a good call
    bad = cp.asarray(t[::-1].copy())
    out = cp.empty((1, t.size), dtype=cp.float32)
    x = cp.asarray(img).reshape(1, 21, 30)
    plan._forward(x, bad, plan.workspace("forward", plan.words, np.uint64), out, word, word.arm(),
                  NULL, np.float32(12.0), 0.1)
    got = cutopo.soft_ecc(cp.asarray(img), cp.asarray(t), 12.0)
    _close(got, want, _sum_abs_c(img, 2, 1), np.float32, "after an abandoned launch")
    with pytest.raises(ValueError, match="sorted in non-decreasing order"):
        cutopo.soft_ecc(cp.asarray(img), bad, 12.0)


def test_soft_ecc_device_thresholds_refuse_graph_capture(rng):
    """Inside a stream capture the kernel does not run, so its check cannot be read: a clear
    error, not a hang; host thresholds are captured (no check to read)."""
    cp = _cp()
    t = np.linspace(0, 1, 9).astype(np.float32)
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        # made on the stream that reads them: a non-blocking stream does not wait for the
        # default stream's copies (t_dev made there was read before it arrived, "not sorted")
        img = cp.asarray(_image(rng, (19, 23), np.float32, levels=9))
        t_dev = cp.asarray(t)
        cutopo.soft_ecc(img, t_dev, 5.0)  # warm: plans, tables, and a free block of the pool
        cutopo.soft_ecc(img, t, 5.0)      # (CuPy's pool keeps free blocks per stream)
        stream.synchronize()
        begin_capture(stream)
        try:
            with pytest.raises(RuntimeError, match="CUDA graph capture"):
                cutopo.soft_ecc(img, t_dev, 5.0)
        finally:
            stream.end_capture()
        begin_capture(stream)
        out = cutopo.soft_ecc(img, t, 5.0)
        graph = stream.end_capture()
        out.fill(np.nan)
        graph.launch()
        stream.synchronize()
    _close(out, cutopo.soft_ecc(img.get(), t, 5.0), _sum_abs_c(img.get(), 2, 1), np.float32,
           "graph replay")


def test_soft_ecc_repeated_calls_keep_every_check(rng):
    """Repeated calls of one geometry skip _prepare (cutopo._soft_ecc._DEVICE_CALLS) but not
    the checks that depend on the call: the scale's value, arguments of other types or layouts,
    the thresholds' values; the kept entries hold no array of the call that made them."""
    from cutopo import _soft_ecc

    cp = _cp()
    img_h = _image(rng, (2, 17, 26), np.float32, levels=11)
    img, t = cp.asarray(img_h), cp.linspace(-0.1, 1.1, 21, dtype=cp.float32)
    t_h = t.get()
    S = _sum_abs_c(img_h, 2, 1)[..., None]
    for scale in (7.0, 19.5, np.float32(3.0), np.float64(11.0)):
        for _ in range(2):
            got = cutopo.soft_ecc(img, t, scale, ndim=2)
            want = cutopo.soft_ecc(img_h, t_h, scale, ndim=2)
            assert got.dtype == want.dtype
            _close(got, want, S, want.dtype, f"scale {scale!r}")
    assert _soft_ecc._DEVICE_CALLS
    assert all(cfg.image is None and cfg.t is None for cfg in _soft_ecc._DEVICE_CALLS.values())
    for scale, err, match in ((np.nan, ValueError, "scale"), (-1.0, ValueError, "scale"),
                              (0.0, ValueError, "scale"), (np.inf, ValueError, "scale"),
                              (1e39, ValueError, "scale"), (np.float32(0.0), ValueError, "scale")):
        with pytest.raises(err, match=match):
            cutopo.soft_ecc(img, t, scale, ndim=2)
    with pytest.raises(TypeError, match="connectivity"):
        cutopo.soft_ecc(img, t, 7.0, ndim=2, connectivity=True)
    with pytest.raises(ValueError, match="ndim"):
        cutopo.soft_ecc(img, t, 7.0, ndim=True)
    with pytest.raises(ValueError, match="thresholds must be finite"):
        cutopo.soft_ecc(img, cp.where(t > 0.5, cp.float32(np.inf), t), 7.0, ndim=2)
    # other layouts of the same values: a strided image and strided thresholds
    wide = cp.zeros((2, 17, 52), dtype=cp.float32)
    wide[..., ::2] = img
    t_wide = cp.repeat(t, 2)[::2]
    got = cutopo.soft_ecc(wide[..., ::2], t_wide, 7.0, ndim=2)
    _close(got, cutopo.soft_ecc(img_h, t_h, 7.0, ndim=2), S, np.float32, "strided arguments")


def _waves(rng, shape, ndim, dtype):
    """A few random low-frequency waves per image: smooth, with few critical pixels (all of a
    forward's entries then fit in its kept list)."""
    spatial = shape[len(shape) - ndim:]
    grids = np.meshgrid(*[np.arange(n, dtype=np.float64) for n in spatial], indexing="ij")
    out = np.empty(shape)
    for idx in np.ndindex(*shape[:len(shape) - ndim]):
        f = np.zeros(spatial)
        for _ in range(3):
            k = rng.uniform(0.05, 0.35, size=ndim) * rng.choice([-1.0, 1.0], size=ndim)
            f += np.cos(sum(ka * g for ka, g in zip(k, grids)) + rng.uniform(0, 2 * np.pi))
        out[idx] = f
    return out.astype(dtype)


def _kept_mask(px, in_dtype, ndim, periodic, shape):
    """Which pixels of _soft_ecc._pixels a GPU forward of an image of ``shape`` keeps: those
    with a non-empty band, or all of them where the forward is the listed one
    (_soft_ecc_cupy.listed_forward: its list holds every critical pixel)."""
    from cutopo import _soft_ecc_cupy

    nimg, voxels = int(np.prod(shape[:len(shape) - ndim])), int(np.prod(shape[len(shape) - ndim:]))
    if _soft_ecc_cupy.listed_forward(in_dtype, ndim, periodic, nimg, voxels):
        return np.ones(px.lo.size, bool)
    return px.lo < px.hi


def _kept_lists(res, image, ndim, tconn, periodic, T, dtype):
    """(counts per image, sorted (index, c) per image) of a CuPy forward's kept entries."""
    from cutopo import _soft_ecc_cupy

    plan = _soft_ecc_cupy.device_plan(image, ndim, tconn, periodic, T, dtype)
    nimg, cap = plan.nimg, plan.kept_cap
    kept = _cp().asnumpy(res.kept.kept)  # (the config's _soft_ecc_cupy.Residual)
    assert kept.shape == (nimg * (1 + cap),)
    counts = kept[:nimg].astype(np.int64)
    slots = kept[nimg:].reshape(nimg, cap)
    lists = []
    for b in range(nimg):
        v = slots[b, :min(counts[b], cap)]
        c = (v & 0xff).astype(np.uint8).view(np.int8).astype(np.int64)
        lists.append(sorted(zip((v >> 8).astype(np.int64).tolist(), c.tolist())))
    return counts, cap, lists


@pytest.mark.parametrize("ndim,shape,listed", [(2, (3, 40, 52), False), (3, (3, 12, 14, 16), False),
                                               (3, (3, 12, 14, 16), True)])
@pytest.mark.parametrize("conn_is_ndim", [False, True])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("boundary", ["box", "periodic"])
def test_soft_ecc_kept_entries(rng, monkeypatch, force_listed_forward, fresh_soft_ecc_plans, ndim, shape, listed,
                               conn_is_ndim, dtype, boundary):
    """A forward made for a backward keeps the critical pixels with a non-empty band (with
    ``listed``, the listed 3D forward: every critical pixel, band or not), exactly those of the
    NumPy path (index and contribution), and the backward of an image whose list fits reads it
    instead of sweeping; an image whose list overflows (white noise in the middle of the batch)
    is swept. Both give the NumPy path's cotangents, and pixels off the list get exactly zero."""
    from cutopo import _soft_ecc, _soft_ecc_cupy

    cp = _cp()
    force_listed_forward(listed)
    # a slot per 4 pixels: the random waves' lists (up to ~15 % of the pixels in 3D, 379 of 2688
    # seen) fit with room to spare, the noise's (about half) overflow; the default, a slot per
    # 8 pixels, left a few draws of waves without room
    monkeypatch.setattr(_soft_ecc_cupy, "KEPT_PIXELS_PER_SLOT", 4)
    conn = ndim if conn_is_ndim else 1
    img = _waves(rng, shape, ndim, dtype)
    img[1] = rng.random(shape[1:]).astype(dtype) * 4 - 2  # noise: about half its pixels critical
    img.reshape(-1)[rng.choice(img.size, 2, replace=False)] = [np.nan, -np.inf]
    t = np.linspace(-2.5, 2.5, int(rng.integers(30, 80))).astype(dtype)
    scale = float(rng.uniform(5, 30))
    kw = dict(ndim=ndim, connectivity=conn, boundary=boundary)
    out_c, pb_c = cutopo.vjp(cutopo.soft_ecc, img, t, scale, **kw)
    poison_pool()
    x = cp.asarray(img)
    out_g, res = _soft_ecc._forward(x, cp.asarray(t), scale, **kw)
    _, pb_g = cutopo.vjp(cutopo.soft_ecc, x, cp.asarray(t), scale, **kw)

    cfg = _soft_ecc._prepare(img, t, scale, ndim, conn, boundary)
    index, px = _soft_ecc._pixels(cfg)
    banded = _kept_mask(px, dtype, ndim, boundary == "periodic", img.shape)
    counts, cap, lists = _kept_lists(res, x, ndim, cfg.tconn, cfg.periodic, t.size, cfg.dtype)
    per_image = int(np.prod(shape[1:]))
    for b in range(shape[0]):
        sel = banded & (index // per_image == b)
        want = sorted(zip(index[sel].tolist(), px.c[sel].astype(np.int64).tolist()))
        if b == 1:  # the listed forward stops listing an image that overflowed
            assert cap < counts[b] <= len(want), "the noise image's list should overflow"
            assert listed or counts[b] == len(want), f"{counts[b]} kept, {len(want)} expected"
        else:
            assert counts[b] == len(want), f"image {b}: {counts[b]} kept, {len(want)} expected"
            assert counts[b] <= cap, "a smooth image's list should fit"
            assert lists[b] == want, f"image {b}: kept entries differ"

    S = _sum_abs_c(img, ndim, conn, boundary == "periodic")[..., None]
    _close(out_g, out_c, S, dtype, "forward")
    g = rng.standard_normal(out_c.shape).astype(dtype)
    d_c = pb_c(g)
    poison_pool()
    d_g = pb_g(cp.asarray(g))
    _close_cotangents(d_g, d_c, g, S, scale, len(t), dtype)
    off = np.ones(img.size, dtype=bool)
    off[index[banded]] = False
    assert np.all(cp.asnumpy(d_g[0]).reshape(-1)[off] == 0)


def test_soft_ecc_listed_forward_at_its_size(rng, fresh_soft_ecc_plans):
    """The listed 3D forward as calls take it (LISTED_FORWARD_MIN_VOXELS voxels or more, many
    blocks per volume): a smooth volume whose list fits, white noise whose list overflows (its
    listing stopped early, the volume swept again), both the NumPy path's curve and
    cotangents (the smooth one's from its list). The list sweep of cutopo.vjp's forward zeroed
    d_image (from a poisoned pool), which its first pullback fills; a second pullback zeroes
    its own and leaves the first one's result alone."""
    from cutopo import _soft_ecc, _soft_ecc_cupy

    cp = _cp()
    shape = (2, 168, 168, 168)
    assert _soft_ecc_cupy.listed_forward(np.float32, 3, False, shape[0], int(np.prod(shape[1:])))
    img = _waves(rng, shape, 3, np.float32)
    img[1] = rng.random(shape[1:]) * 4 - 2
    t = np.linspace(-2.5, 2.5, int(rng.integers(40, 60))).astype(np.float32)
    scale = float(rng.uniform(5, 30))
    out_c, pb_c = cutopo.vjp(cutopo.soft_ecc, img, t, scale, ndim=3)
    poison_pool()
    x = cp.asarray(img)
    cfg = _soft_ecc._prepare(img, t, scale, 3, 1, "box")
    out_g, res = _soft_ecc._forward(x, cp.asarray(t), scale, ndim=3)
    counts, cap, lists = _kept_lists(res, x, 3, cfg.tconn, False, t.size, cfg.dtype)
    index, px = _soft_ecc._pixels(cfg)
    first = index < img[0].size
    assert counts[0] == first.sum() <= cap, "the smooth volume lists every critical voxel"
    assert lists[0] == sorted(zip(index[first].tolist(), px.c[first].astype(np.int64).tolist()))
    assert cap < counts[1] <= (~first).sum(), "the noise's list should overflow"
    S = _sum_abs_c(img, 3, 1)[..., None]
    _close(out_g, out_c, S, np.float32, "forward")
    poison_pool()
    _, pb_g = cutopo.vjp(cutopo.soft_ecc, x, cp.asarray(t), scale, ndim=3)
    assert _soft_ecc_cupy.device_plan(x, 3, False, False, t.size, np.float32).zeroes_d_image
    g = rng.standard_normal(out_c.shape).astype(np.float32)
    d_c = pb_c(g)
    poison_pool()
    first = pb_g(cp.asarray(g))
    kept_first = cp.asnumpy(first[0])
    _close_cotangents(first, d_c, g, S, scale, len(t), np.float32)
    poison_pool()
    g2 = rng.standard_normal(out_c.shape).astype(np.float32)
    _close_cotangents(pb_g(cp.asarray(g2)), pb_c(g2), g2, S, scale, len(t), np.float32)
    np.testing.assert_array_equal(cp.asnumpy(first[0]), kept_first)


def _near_ties(rng, shape, ndim, dtype):
    """Images whose packed-sweep keys (15 bits of the value over the thresholds' range) tie
    everywhere but in a smooth band: runs of values a few ulps apart, exact ties, values far
    outside the thresholds (their keys clamp), -0.0 beside +0.0, NaN and both infinities."""
    img = _waves(rng, shape, ndim, np.float64)
    flat = img.reshape(shape[:len(shape) - ndim] + (-1,))
    n = flat.shape[-1]
    part = np.roll(np.arange(n), int(rng.integers(n)))  # runs of consecutive pixels
    q = n // 6
    dt = np.dtype(dtype) if np.dtype(dtype).kind == "f" else np.dtype(np.float32)
    ulps = rng.integers(0, 40, size=flat[..., part[:q]].shape)
    flat[..., part[:q]] = np.nextafter(dt.type(0.3), dt.type(1))  # one value ...
    flat[..., part[:q]] += ulps * float(np.spacing(dt.type(0.3)))  # ... plus up to 40 ulps
    flat[..., part[q:2 * q]] = 0.25                                # exact ties
    flat[..., part[2 * q:3 * q]] = rng.choice([-50.0, 70.0], size=flat[..., part[2 * q:3 * q]].shape)
    flat[..., part[2 * q:3 * q]] += rng.standard_normal(flat[..., part[2 * q:3 * q]].shape)
    flat[..., part[3 * q:3 * q + 3]] = [-0.0, 0.0, -0.0]
    flat[..., part[3 * q + 3:3 * q + 6]] = [np.nan, np.inf, -np.inf]
    return img.astype(dtype)


@pytest.mark.parametrize("ndim,shape", [(2, (2, 45, 130)), (3, (2, 9, 21, 70))])
@pytest.mark.parametrize("conn_is_ndim", [False, True])
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
def test_soft_ecc_packed_forward_on_tied_keys(rng, monkeypatch, fresh_soft_ecc_plans, ndim, shape,
                                              conn_is_ndim, dtype):
    """The 2D forward's packed sweep compares 15-bit keys of the values and recomputes the
    contribution of every pixel with a neighbour of equal key from the exact order: its kept
    entries (index and contribution) equal the NumPy path's on images tied in 15 bits almost
    everywhere, and so do the curve and the cotangents."""
    from cutopo import _soft_ecc, _soft_ecc_cupy

    cp = _cp()
    assert _soft_ecc_cupy.packed_forward(dtype, ndim, False) == (ndim == 2)  # 3D: the scalar sweep
    monkeypatch.setattr(_soft_ecc_cupy, "KEPT_PIXELS_PER_SLOT", 1)  # room for every entry
    conn = ndim if conn_is_ndim else 1
    img = _near_ties(rng, shape, ndim, dtype)
    t = np.linspace(-2.5, 2.5, int(rng.integers(30, 80))).astype(np.float32 if dtype == np.float16 else dtype)
    scale = float(rng.uniform(5, 30))
    kw = dict(ndim=ndim, connectivity=conn)
    out_c, pb_c = cutopo.vjp(cutopo.soft_ecc, img, t, scale, **kw)
    poison_pool()
    x = cp.asarray(img)
    out_g, res = _soft_ecc._forward(x, cp.asarray(t), scale, **kw)
    cfg = _soft_ecc._prepare(img, t, scale, ndim, conn, "box")
    index, px = _soft_ecc._pixels(cfg)
    banded = _kept_mask(px, dtype, ndim, False, img.shape)
    counts, cap, lists = _kept_lists(res, x, ndim, cfg.tconn, False, t.size, cfg.dtype)
    per_image = int(np.prod(shape[1:]))
    for b in range(shape[0]):
        sel = banded & (index // per_image == b)
        want = sorted(zip(index[sel].tolist(), px.c[sel].astype(np.int64).tolist()))
        assert counts[b] == len(want) and counts[b] <= cap
        assert lists[b] == want, f"image {b}: kept entries differ"
    S = _sum_abs_c(img, ndim, conn)[..., None]
    _close(out_g, out_c, S, cfg.dtype, "forward")
    _, pb_g = cutopo.vjp(cutopo.soft_ecc, x, cp.asarray(t), scale, **kw)
    g = rng.standard_normal(out_c.shape).astype(cfg.dtype)
    d_c = pb_c(g)
    poison_pool()
    d_g = pb_g(cp.asarray(g))
    if dtype == np.float16:  # d_image is float16 on both paths: one rounding each, maybe apart
        lam_g = scale * np.abs(g).sum()
        np.testing.assert_allclose(cp.asnumpy(d_g[0]).astype(np.float64), d_c[0].astype(np.float64),
                                   rtol=2.0 ** -10, atol=RTOL[np.dtype(np.float32)] * (lam_g + 1))
        _close(d_g[1], d_c[1], lam_g * S.sum() / len(t), cfg.dtype, "d_thresholds")
        _close(d_g[2], d_c[2], np.abs(g).sum() * S.sum(), cfg.dtype, "d_scale")
    else:
        _close_cotangents(d_g, d_c, g, S, scale, len(t), cfg.dtype)


@pytest.mark.parametrize("in_dtype", ["bool", "uint8"])
@pytest.mark.parametrize("ndim,shape", [(2, (3, 41, 70)), (3, (11, 19, 67))])
def test_soft_ecc_packed_forward_on_byte_images(rng, monkeypatch, fresh_soft_ecc_plans, in_dtype,
                                                ndim, shape):
    """One-byte images are their own packed keys (no ties to recompute): the kept entries equal
    the NumPy path's, ties of equal bytes broken by index."""
    from cutopo import _soft_ecc, _soft_ecc_cupy

    cp = _cp()
    monkeypatch.setattr(_soft_ecc_cupy, "KEPT_PIXELS_PER_SLOT", 1)
    img = (rng.random(shape) < 0.5) if in_dtype == "bool" else rng.integers(0, 6, size=shape).astype(np.uint8)
    t = np.linspace(-0.5, 6.5, 23).astype(np.float32)
    for conn in (1, ndim):
        x = cp.asarray(img)
        out_g, res = _soft_ecc._forward(x, cp.asarray(t), 4.0, ndim=ndim, connectivity=conn)
        cfg = _soft_ecc._prepare(img, t, 4.0, ndim, conn, "box")
        index, px = _soft_ecc._pixels(cfg)
        banded = _kept_mask(px, img.dtype, ndim, False, img.shape)
        counts, cap, lists = _kept_lists(res, x, ndim, cfg.tconn, False, t.size, cfg.dtype)
        nimg = int(np.prod(shape[:len(shape) - ndim]))
        per_image = img.size // nimg
        for b in range(nimg):
            sel = banded & (index // per_image == b)
            want = sorted(zip(index[sel].tolist(), px.c[sel].astype(np.int64).tolist()))
            assert counts[b] == len(want) <= cap
            assert lists[b] == want, f"image {b}, connectivity {conn}: kept entries differ"
        _close(out_g, cutopo.soft_ecc(img, t, 4.0, ndim=ndim, connectivity=conn),
               _sum_abs_c(img, ndim, conn)[..., None], np.float32, f"{in_dtype} forward")


@pytest.fixture
def fresh_soft_ecc_plans():
    """Plans made after a test changes the kept entries' sizes, none of them kept after it."""
    from cutopo import _soft_ecc, _soft_ecc_cupy

    def clear():
        _soft_ecc_cupy.soft_ecc_plan.cache_clear()
        _soft_ecc._DEVICE_CALLS.clear()

    clear()
    yield
    clear()


@pytest.mark.parametrize("pixels_per_slot,max_bytes", [(10 ** 9, 64 << 20), (8, 8)])
def test_soft_ecc_kept_entries_capacity(rng, monkeypatch, fresh_soft_ecc_plans, pixels_per_slot,
                                        max_bytes):
    """One slot per image (every list overflows: the backward sweeps) and no room at all
    (nothing kept: the forward gets a null list) give the NumPy path's results too."""
    from cutopo import _soft_ecc, _soft_ecc_cupy

    cp = _cp()
    monkeypatch.setattr(_soft_ecc_cupy, "KEPT_PIXELS_PER_SLOT", pixels_per_slot)
    monkeypatch.setattr(_soft_ecc_cupy, "KEPT_MAX_BYTES", max_bytes)
    img = _waves(rng, (2, 37, 45), 2, np.float32)
    t = np.linspace(-2.5, 2.5, 40).astype(np.float32)
    out_c, pb_c = cutopo.vjp(cutopo.soft_ecc, img, t, 9.0, ndim=2)
    x = cp.asarray(img)
    _, res = _soft_ecc._forward(x, cp.asarray(t), 9.0, ndim=2)
    if max_bytes == 8:
        assert res.kept is None
    else:
        counts, cap, _ = _kept_lists(res, x, 2, False, False, t.size, np.dtype(np.float32))
        assert cap == 1 and np.all(counts > 1)
    out_g, pb_g = cutopo.vjp(cutopo.soft_ecc, x, cp.asarray(t), 9.0, ndim=2)
    S = _sum_abs_c(img, 2, 1)[..., None]
    _close(out_g, out_c, S, np.float32, "forward")
    g = rng.standard_normal(out_c.shape).astype(np.float32)
    d_c = pb_c(g)
    poison_pool()
    d_g = pb_g(cp.asarray(g))
    _close_cotangents(d_g, d_c, g, S, 9.0, len(t), np.float32)


def test_soft_ecc_plain_call_keeps_no_entries(rng, monkeypatch):
    """The plain forward (no backward to come) keeps no entries; cutopo.vjp's forward does."""
    from cutopo import _soft_ecc_cupy

    cp = _cp()
    seen = []
    real = _soft_ecc_cupy.SoftEccPlan.launch_forward

    def launch_forward(self, *args, **kwargs):
        seen.append(args[6] if len(args) > 6 else kwargs.get("keep", False))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(_soft_ecc_cupy.SoftEccPlan, "launch_forward", launch_forward)
    x = cp.asarray(_waves(rng, (20, 30), 2, np.float32))
    t = cp.linspace(-2, 2, 9, dtype=cp.float32)
    for _ in range(2):  # the first calls of their key, then repeated ones
        cutopo.soft_ecc(x, t, 5.0)
        cutopo.vjp(cutopo.soft_ecc, x, t, 5.0)
    cutopo.soft_ecc(x, t.get(), 5.0)  # host thresholds: not a planned call
    assert seen == [False, True] * 2 + [False]


@pytest.mark.parametrize("ndim,shape,listed", [(2, (2, 40, 52), False), (3, (2, 12, 14, 16), False),
                                               (3, (2, 12, 14, 16), True)])
def test_soft_ecc_made_ahead_arrays_are_fresh(rng, monkeypatch, force_listed_forward, fresh_soft_ecc_plans,
                                              ndim, shape, listed):
    """Repeated calls of one kind launch on the arrays that the call before made for them
    (cutopo._cuda.workspace.made_ahead), here poisoned (all bits set: NaN, and kept entries past
    any count) when taken: every call's curve and cotangents are the NumPy path's, no two calls
    share an output, and what an earlier call returned stays as it was through the later
    calls (cutopo.vjp calls, then plain ones; the listed forward's with the d_image it zeroes)."""
    from cutopo._cuda.workspace import made_ahead

    cp = _cp()
    force_listed_forward(listed)
    made_ahead.drop()
    taken = []
    real_take = made_ahead.take

    def take(owner, kind, *stream):
        arrays = real_take(owner, kind, *stream)
        taken.append(arrays is not None)
        kept_zeroed = [id(ws) for ws in owner._workspaces.kept()]  # (they travel along, zeroed)
        for a in arrays or ():
            if a is not None and id(a) not in kept_zeroed:  # (reshape: a 0-d array takes no
                a.reshape(-1).view(cp.uint8).fill(255)  # view of another itemsize)
        return arrays

    monkeypatch.setattr(made_ahead, "take", take)
    t_h = np.linspace(-2.5, 2.5, int(rng.integers(20, 60))).astype(np.float32)
    t = cp.asarray(t_h)  # device thresholds: a planned call
    scale = float(rng.uniform(5, 20))
    calls = []
    for vjp in (True,) * 3 + (False,) * 3:
        img = _waves(rng, shape, ndim, np.float32)
        x = cp.asarray(img)
        if vjp:
            out, pullback = cutopo.vjp(cutopo.soft_ecc, x, t, scale, ndim=ndim)
            g = rng.standard_normal(out.shape).astype(np.float32)
            results = (out,) + pullback(cp.asarray(g))
        else:
            g, results = None, (cutopo.soft_ecc(x, t, scale, ndim=ndim),)
        calls.append((img, g, results, [cp.asnumpy(a) for a in results]))
    assert taken == [False, True, True, False, True, True]
    pointers = [a.data.ptr for _, _, results, _ in calls for a in results[:3]]
    assert len(set(pointers)) == len(pointers), "two calls share an output"
    for k, (img, g, results, then) in enumerate(calls):
        for now, before in zip(results, then):
            assert np.array_equal(cp.asnumpy(now), before, equal_nan=True), f"call {k}: changed later"
        want, pb = cutopo.vjp(cutopo.soft_ecc, img, t_h, scale, ndim=ndim)
        S = _sum_abs_c(img, ndim, 1)[..., None]
        _close(results[0], want, S, np.float32, f"call {k}: forward")
        if g is not None:
            _close_cotangents(results[1:], pb(g), g, S, scale, t_h.size, np.float32, f" (call {k})")


def test_soft_ecc_integer_device_thresholds_are_checked_on_the_host(rng):
    """Integer CuPy thresholds take the host check: cast to float32 two unsorted integers can
    become equal (2^24 + 1 > 2^24 both round to 2^24) and pass a device check of the cast."""
    cp = _cp()
    img = cp.asarray(rng.integers(0, 1 << 25, size=(9, 10)).astype(np.int32))
    with pytest.raises(ValueError, match="sorted"):
        cutopo.soft_ecc(img, cp.asarray([(1 << 24) + 1, 1 << 24], dtype=cp.int32), 1e-6)


# ---------------------------------------------------------------------------------------------
# ect and soft_ect


def _mask(rng, shape, p=0.55):
    from scipy import ndimage

    m = rng.random(shape) < p
    return ndimage.binary_opening(m) | (rng.random(shape) < 0.05)


def _directions(rng, D, ndim):
    d = rng.standard_normal((D, ndim))
    d[0] = 0.0
    d[0, -1] = 1.0           # a zero component counts as +
    if D > 1:
        d[1] = -d[0]
    return d


@pytest.mark.parametrize("ndim,shape", [(2, (33, 47)), (2, (3, 20, 21)), (3, (9, 12, 10)),
                                        (3, (2, 6, 5, 7))])
@pytest.mark.parametrize("conn_is_ndim", [False, True])
def test_ect_matches_numpy_exactly(rng, ndim, shape, conn_is_ndim):
    cp = _cp()
    conn = ndim if conn_is_ndim else 1
    mask = _mask(rng, shape)
    dirs = _directions(rng, 13, ndim)
    for t in (np.sort(rng.uniform(-2, 2, 40)), 25):
        want = cutopo.ect(mask, dirs, t, connectivity=conn)
        got = cutopo.ect(cp.asarray(mask), cp.asarray(dirs), t, connectivity=conn)
        assert isinstance(got, cp.ndarray) and got.dtype == np.int64
        np.testing.assert_array_equal(cp.asnumpy(got), want)


def test_ect_integer_mask_and_empty_mask(rng):
    cp = _cp()
    mask = (rng.random((2, 20, 20)) < 0.4).astype(np.int32) * 7
    mask[1] = 0
    dirs = _directions(rng, 5, 2)
    want = cutopo.ect(mask, dirs, 9)
    got = cutopo.ect(cp.asarray(mask), dirs, 9)
    np.testing.assert_array_equal(cp.asnumpy(got), want)
    assert np.all(want[1] == 0)


@pytest.mark.parametrize("ndim,shape", [(2, (31, 40)), (3, (2, 8, 9, 7))])
@pytest.mark.parametrize("conn_is_ndim", [False, True])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("count", [False, True])
def test_soft_ect_forward_and_vjp_match_numpy(rng, ndim, shape, conn_is_ndim, dtype, count):
    cp = _cp()
    conn = ndim if conn_is_ndim else 1
    mask = _mask(rng, shape)
    dirs = _directions(rng, 9, ndim).astype(dtype)
    t = 30 if count else np.sort(rng.uniform(-1.8, 1.8, 30)).astype(dtype)
    scale = dtype(rng.uniform(3, 40))
    out_c, pb_c = cutopo.vjp(cutopo.soft_ect, mask, dirs, t, scale, connectivity=conn)
    t_g = t if count else cp.asarray(t)
    out_g, pb_g = cutopo.vjp(cutopo.soft_ect, cp.asarray(mask), cp.asarray(dirs), t_g,
                             cp.asarray(scale), connectivity=conn)
    assert isinstance(out_g, cp.ndarray) and out_g.dtype == out_c.dtype == dtype
    S = float(mask.size) * 2 ** ndim  # bounds sum |c| per direction
    _close(out_g, out_c, S, dtype, "forward")
    g = rng.standard_normal(out_c.shape).astype(dtype)
    d_c = pb_c(g)
    d_g = pb_g(cp.asarray(g))
    assert d_g[0] is None
    big = float(scale) * np.abs(g).sum() * S
    _close(d_g[1], d_c[1], big, dtype, "d_directions")
    if not count:
        _close(d_g[2], d_c[2], big, dtype, "d_thresholds")
    _close(d_g[3], d_c[3], big, dtype, "d_scale")


def test_soft_ect_many_thresholds_use_global_accumulators(rng):
    cp = _cp()
    mask = _mask(rng, (24, 25))
    dirs = _directions(rng, 4, 2)
    t = np.linspace(-1.5, 1.5, 5000)
    out_c, pb_c = cutopo.vjp(cutopo.soft_ect, mask, dirs, t, 100.0)
    out_g, pb_g = cutopo.vjp(cutopo.soft_ect, cp.asarray(mask), cp.asarray(dirs), cp.asarray(t),
                             100.0)
    _close(out_g, out_c, 4.0 * mask.size, np.float64, "forward")
    g = rng.standard_normal(out_c.shape)
    d_c, d_g = pb_c(g), pb_g(cp.asarray(g))
    big = 100.0 * np.abs(g).sum() * 4.0 * mask.size
    for i in (1, 2, 3):
        _close(d_g[i], d_c[i], big, np.float64, f"cotangent {i}")


def _count_device_plan_calls(monkeypatch):
    """A list that gets one entry per SoftEctPlan forward (the device-argument path)."""
    from cutopo import _band_cupy

    calls = []
    forward = _band_cupy.SoftEctPlan.forward

    def counted(self, *args):
        calls.append(self.D)
        return forward(self, *args)

    monkeypatch.setattr(_band_cupy.SoftEctPlan, "forward", counted)
    return calls


@pytest.mark.parametrize("ndim,shape", [(2, (29, 38)), (2, (3, 17, 20)), (3, (9, 11, 10)),
                                        (3, (2, 6, 7, 5)),
                                        # several compaction tiles (4096 pixels) per map
                                        (2, (3, 90, 101)), (3, (30, 31, 29))])
@pytest.mark.parametrize("dir_dtype,t_dtype", [(np.float32, np.float32), (np.float64, np.float32),
                                               (np.float32, np.float16),
                                               (np.float32, np.float64)])
def test_soft_ect_device_arguments_match_numpy(rng, monkeypatch, ndim, shape, dir_dtype, t_dtype):
    """CuPy directions and thresholds take SoftEctPlan (no host read): every orthant's map,
    worst-case entry arrays, checks on the device; equal to the NumPy path."""
    cp = _cp()
    calls = _count_device_plan_calls(monkeypatch)
    mask = _mask(rng, shape)
    dirs = _directions(rng, 11, ndim)
    dirs[2] = -0.0           # a negative zero counts as + (as on the host)
    dirs[2, 0] = -1.0
    dirs = dirs.astype(dir_dtype)
    t = np.sort(rng.uniform(-1.8, 1.8, 27)).astype(t_dtype)
    t[5] = t[4]              # tied thresholds
    scale = float(rng.uniform(3, 30))
    out_c, pb_c = cutopo.vjp(cutopo.soft_ect, mask, dirs, t, scale)
    poison_pool()
    out_g, pb_g = cutopo.vjp(cutopo.soft_ect, cp.asarray(mask), cp.asarray(dirs), cp.asarray(t),
                             scale)
    assert calls == [11]
    dtype = out_c.dtype
    assert isinstance(out_g, cp.ndarray) and out_g.dtype == dtype
    S = float(mask.size) * 2 ** ndim
    _close(out_g, out_c, S, dtype, "forward")
    g = rng.standard_normal(out_c.shape).astype(dtype)
    d_c, d_g = pb_c(g), pb_g(cp.asarray(g))
    assert d_g[0] is None
    big = scale * np.abs(g).sum() * S
    assert d_g[1].dtype == dir_dtype and d_g[2].dtype == t_dtype
    _close(d_g[1], d_c[1], big, dtype, "d_directions")
    _close(d_g[2], d_c[2], big, dtype if t_dtype != np.float16 else np.float32, "d_thresholds")
    _close(d_g[3], d_c[3], big, dtype, "d_scale")


def test_soft_ect_device_arguments_repeated_calls_and_dense_masks(rng, monkeypatch):
    """One plan serves calls with new values (nothing of a call stays in it), and a
    checkerboard (most pixels critical, near the worst case the entries are sized for); the
    scale as a Python float, a NumPy float32 and a NumPy float64 (which makes the computation
    float64: the thresholds' cotangent then comes back in float64 and is cast once)."""
    cp = _cp()
    calls = _count_device_plan_calls(monkeypatch)
    board = (np.indices((2, 40, 33)).sum(axis=0) % 2 == 0)
    board[1] = _mask(rng, (40, 33))
    for scale in (12.0, np.float32(12.0), np.float64(12.0)):
        dirs = rng.standard_normal((6, 2)).astype(np.float32)
        t = np.sort(rng.uniform(-1.5, 1.5, 20)).astype(np.float32)
        out_c, pb_c = cutopo.vjp(cutopo.soft_ect, board, dirs, t, scale)
        out_g, pb_g = cutopo.vjp(cutopo.soft_ect, cp.asarray(board), cp.asarray(dirs),
                                 cp.asarray(t), scale)
        assert out_g.dtype == out_c.dtype
        S = float(board[0].size) * 4
        _close(out_g, out_c, S, np.float32, "forward")
        g = rng.standard_normal(out_c.shape).astype(out_c.dtype)
        d_c, d_g = pb_c(g), pb_g(cp.asarray(g))
        big = 12.0 * np.abs(g).sum() * S
        for i in (1, 2, 3):
            assert d_g[i].dtype == d_c[i].dtype, i
            _close(d_g[i], d_c[i], big, np.float32, f"cotangent {i}")
    assert calls == [6, 6, 6]


def test_soft_ect_repeated_calls_keep_every_check(rng, monkeypatch):
    """Repeated calls of one geometry skip the checks and planning that need no values
    (cutopo._ect._DEVICE_CALLS) but not those that depend on the call: the scale's value, the
    directions' and thresholds' values (the device's check), arguments of other layouts or
    types; and the plan kept holds no array of a call."""
    from cutopo import _ect

    cp = _cp()
    calls = _count_device_plan_calls(monkeypatch)
    _ect._DEVICE_CALLS.clear()
    mask = _mask(rng, (2, 21, 18))
    dirs = rng.standard_normal((5, 2)).astype(np.float32)
    t = np.sort(rng.uniform(-1.5, 1.5, 19)).astype(np.float32)
    m, d, tt = cp.asarray(mask), cp.asarray(dirs), cp.asarray(t)
    S = float(mask[0].size) * 4
    for scale in (9.0, 21.5, np.float32(4.0), np.float64(7.0), 9.0):
        got = cutopo.soft_ect(m, d, tt, scale)
        want = cutopo.soft_ect(mask, dirs, t, scale)
        assert got.dtype == want.dtype
        _close(got, want, S, want.dtype, f"scale {scale!r}")
    assert calls == [5] * 5
    assert len(_ect._DEVICE_CALLS) == 3  # a key per type of scale
    for planned in _ect._DEVICE_CALLS.values():
        assert not any(isinstance(v, cp.ndarray) for v in planned)
    for scale in (np.nan, -1.0, 0.0, np.inf, 1e39, np.float32(0.0)):
        with pytest.raises(ValueError, match="scale"):
            cutopo.soft_ect(m, d, tt, scale)
    bad_t, bad_d = t.copy(), dirs.copy()
    bad_t[[2, 9]] = bad_t[[9, 2]]
    bad_d[3] = 0.0
    with pytest.raises(ValueError, match="sorted"):
        cutopo.soft_ect(m, d, cp.asarray(bad_t), 9.0)
    with pytest.raises(ValueError, match="row 3 is zero"):
        cutopo.soft_ect(m, cp.asarray(bad_d), tt, 9.0)
    with pytest.raises(ValueError, match="connectivity"):
        cutopo.soft_ect(m, d, tt, 9.0, connectivity=5)
    # a strided mask, integer masks and Fortran-order directions take the checked path
    want = cutopo.soft_ect(mask, dirs, t, 9.0)
    for m2, d2 in ((cp.asarray(np.repeat(mask, 2, axis=2))[:, :, ::2], d), (m.astype(cp.uint8), d),
                   (m, cp.asfortranarray(d))):
        _close(cutopo.soft_ect(m2, d2, tt, 9.0), want, S, np.float32, "another layout")
    _close(cutopo.soft_ect(m, d, tt, 9.0), want, S, np.float32, "after them")


@pytest.mark.parametrize("bad,message", [
    ("nan_direction", "directions must be finite"),
    ("inf_direction", "directions must be finite"),
    ("zero_direction", "row 3 is zero"),
    ("overflow", "overflow float64"),
    ("nan_threshold", "thresholds must be finite"),
    ("unsorted", "sorted"),
])
def test_soft_ect_device_arguments_raise_the_host_errors(rng, bad, message):
    cp = _cp()
    mask = cp.asarray(_mask(rng, (2, 12, 14)))
    dirs = rng.standard_normal((5, 2))
    t = np.sort(rng.uniform(-1, 1, 9))
    if bad == "nan_direction":
        dirs[4, 1] = np.nan
    elif bad == "inf_direction":
        dirs[0, 0] = -np.inf
    elif bad == "zero_direction":
        dirs[3] = [0.0, -0.0]
    elif bad == "overflow":
        dirs[1] = [1.5e308, 1.5e308]
    elif bad == "nan_threshold":
        t[2] = np.nan
    else:
        t[[3, 6]] = t[[6, 3]]
    with pytest.raises(ValueError, match=message):
        cutopo.soft_ect(mask, cp.asarray(dirs), cp.asarray(t), 5.0)
    with pytest.raises(ValueError, match=message):  # the host path's own message
        cutopo.soft_ect(cp.asnumpy(mask), dirs, t, 5.0)


def test_soft_ect_device_arguments_refuse_graph_capture(rng):
    """Inside a stream capture the argument check does not run, so its flags (a PinnedStatus)
    cannot be read: a clear error, not a hang; the calls after it check their own arguments."""
    cp = _cp()
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:  # the arguments made on the stream that reads them (see above)
        mask = cp.asarray(_mask(rng, (1, 24, 20)))
        dirs = cp.asarray(rng.standard_normal((6, 2)).astype(np.float32))
        t = cp.asarray(np.linspace(-1.5, 1.5, 16).astype(np.float32))
        expected = cutopo.soft_ect(mask, dirs, t, 8.0)  # warm: the plan, a free block of the pool
        stream.synchronize()
        begin_capture(stream)
        try:
            with pytest.raises(RuntimeError, match="CUDA graph capture"):
                cutopo.soft_ect(mask, dirs, t, 8.0)
        finally:
            stream.end_capture()
        again = cutopo.soft_ect(mask, dirs, t, 8.0)
        with pytest.raises(ValueError, match="sorted"):
            cutopo.soft_ect(mask, dirs, t[::-1].copy(), 8.0)
        last = cutopo.soft_ect(mask, dirs, t, 8.0)
    assert bool(cp.array_equal(again, expected)) and bool(cp.array_equal(last, expected))


def test_soft_ect_device_arguments_large_but_finite_heights(rng, monkeypatch):
    """sum |v_a| above 1e300 only flags a possible overflow; the host's exact check passes
    these, and the result is the NumPy path's."""
    cp = _cp()
    calls = _count_device_plan_calls(monkeypatch)
    mask = _mask(rng, (15, 16))
    dirs = np.array([[8e300, 0.0], [0.0, -9e300], [1.0, 2.0]])
    t = np.array([-1e301, -1.0, 0.0, 1.0, 1e301])
    want = cutopo.soft_ect(mask, dirs, t, 1e-300)
    got = cutopo.soft_ect(cp.asarray(mask), cp.asarray(dirs), cp.asarray(t), 1e-300)
    assert calls == [3]
    _close(got, want, 4.0 * mask.size, np.float64, "forward")


def test_ect_mixed_devices_are_refused(rng):
    cp = _cp()
    with pytest.raises(TypeError, match="scale is a CuPy array but mask is not"):
        cutopo.soft_ect(np.ones((4, 4), dtype=bool), [[1.0, 0.0]], [0.0], cp.asarray(2.0))
    with pytest.raises(TypeError, match="directions is a CuPy array but mask is not"):
        cutopo.ect(np.ones((4, 4), dtype=bool), cp.asarray([[1.0, 0.0]]), [0.0])


@pytest.mark.parametrize("shape", [(2, 1024, 1100), (3, 701, 1001)])
def test_soft_ecc_large_inputs(rng, shape):
    """Millions of pixels: several blocks per image, each sweeping many tiles, widths that are
    not multiples of the tile."""
    cp = _cp()
    img = _image(rng, shape, np.float32, levels=200, specials=True)
    t = np.linspace(0.0, 1.0, 64).astype(np.float32)
    out_c, pb_c = cutopo.vjp(cutopo.soft_ecc, img, t, 300.0, ndim=2)
    poison_pool(256 << 20)
    out_g, pb_g = cutopo.vjp(cutopo.soft_ecc, cp.asarray(img), t, 300.0, ndim=2)
    S = _sum_abs_c(img, 2, 1)[..., None]
    _close(out_g, out_c, S, np.float32, "forward")
    g = rng.standard_normal(out_c.shape).astype(np.float32)
    d_c, d_g = pb_c(g), pb_g(cp.asarray(g))
    _close_cotangents(d_g, d_c, g, S, 300.0, len(t), np.float32)


@pytest.mark.parametrize("density", [0.0, 0.003, 0.3, 1.0])
@pytest.mark.parametrize("nseg,B,N", [(1, 1, 1), (4, 3, 257), (2, 5, 1000), (1, 2, 3 * 4096 + 5),
                                      (30, 10, 4097)])
def test_compact_entries_matches_numpy(rng, density, nseg, B, N):
    """_band_cupy._compact (count per tile, scan, write): the in-row positions, values and row
    starts of the non-zero contributions, as NumPy's flatnonzero finds them; empty rows at the
    start, in the middle and at the end get their starts too (the sparse densities leave many).
    Rows of several 4096-pixel tiles, with a partial last one, and more tiles (600) than the
    scan's block has threads (256)."""
    from cutopo import _band_cupy

    cp = _cp()
    c = rng.choice(np.array([-2, -1, 1, 3], dtype=np.int8), size=(nseg, B, N))
    c[rng.random(c.shape) >= density] = 0
    c[0, 0] = 0  # the first row empty
    poison_pool(1 << 20)
    lin, cc, seg, per_segment = _band_cupy._compact(cp.asarray(c), B, N, nseg)
    flat = np.flatnonzero(c)
    rows = flat // N
    np.testing.assert_array_equal(cp.asnumpy(lin), flat - rows * N)
    np.testing.assert_array_equal(cp.asnumpy(cc), c.reshape(-1)[flat])
    np.testing.assert_array_equal(cp.asnumpy(seg), np.searchsorted(rows, np.arange(nseg * B + 1)))
    assert lin.dtype == np.int64 and cc.dtype == np.int8 and seg.dtype == np.int64
    assert per_segment == -(-flat.size // (nseg * B))


@pytest.mark.parametrize("shape", [(1, 1, 1), (5, 1, 7), (2, 37, 53), (1, 1, 6, 1), (2, 11, 9, 13),
                                   (1, 40, 3, 70)])
@pytest.mark.parametrize("density", [0.1, 0.6, 1.0])
def test_orthant_contributions_match_numpy(rng, shape, density):
    """orthant_contributions (one kernel, keys formed from the masks) equals the NumPy path's
    contribution maps of the key images (_ect._orthant_contributions) for every orthant, masks
    from sparse to full, axes of length 1 included (ect's tests cover the entries built on
    them)."""
    from cutopo import _band_cupy, _ect

    cp = _cp()
    mask = rng.random(shape) < density
    ndim = len(shape) - 1
    codes = np.arange(1 << ndim)[::-1]  # every orthant, not in order
    poison_pool(1 << 22)
    got = cp.asnumpy(_band_cupy.orthant_contributions(cp.asarray(mask), codes))
    for u, code in enumerate(codes):
        positive = [(code >> a) & 1 == 1 for a in range(ndim)]
        want = _ect._orthant_contributions(mask, positive)
        np.testing.assert_array_equal(got[u], want.reshape(shape[0], -1), err_msg=f"code {code}")
