"""Host-side (Python) cost of repeated op calls on CuPy arrays: cProfile of N calls.

    python benchmarks/profile_host.py [ecc|ecc_uint8|grid_sample|grid_sample_vjp|integrate|integrate_vjp|register|
                                       soft_ecc|soft_ecc_vjp|soft_ecc_both|soft_ect|soft_ect_vjp|
                                       grid_sample_stages|soft_ect_stages|soft_ecc_stages] [--calls N]

Prints the functions with the largest own time; ``grid_sample_stages`` instead times the
forward's pieces (argument preparation, the image check kernel, the sampling kernel, the whole
call) with CUDA events, and ``soft_ect_stages`` the soft ECT's (mean wall time of back-to-back
calls: host time, or the GPU's where a stage waits for it). Synchronising calls (a flag or a norm read on
the host) show up as time in ``get``/``synchronize``: that is the wait for the GPU, not Python.
"""
from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import time

import numpy as np

import cutopo

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

def _grid_sample_inputs(cp):
    rng = cp.random.default_rng(0)
    image = rng.standard_normal((8, 16, 256, 256), dtype=cp.float32)
    grid = rng.uniform(-1.1, 1.1, (8, 256, 256, 2), dtype=cp.float32)
    return image, grid


def _cpab_inputs(cp):
    from cutopo.cpab import Tessellation

    tess = Tessellation((16, 16))
    theta = cp.asarray(tess.sample(32, length_scale=0.25, rng=0).astype(np.float32))
    axes = [(np.arange(256) + 0.5) / 256] * 2
    pts = np.stack(np.meshgrid(*axes, indexing="ij"), -1).reshape(-1, 2).astype(np.float32)
    return cp.asarray(pts), theta, tess


def _register_call(cp):
    """register on bench_register's 2d 512 case (tess 15 x 15, MSE, smoothness): 20 steps."""
    from bench_register import Case

    from cutopo.cpab import register

    fixed, moving, tess, _ = Case("2d 512", 512, 2, 15, 20).inputs(cp, 50, 0)
    fixed, moving = fixed[0, 0], moving[0, 0]
    return lambda: register(fixed, moving, tess, steps=20, lr=0.005, smoothness=1e-4,
                            progress=False, diagnostics=False)


def make_call(cp, which):
    from cutopo.cpab import integrate

    if which == "register":
        return _register_call(cp)
    if which in ("ecc", "ecc_uint8"):
        # bench_ecc's single 1024^2 image, its host thresholds (256)
        from bench_ecc import make_image

        dtype = "uint8" if which == "ecc_uint8" else "float32"
        image = make_image(cp, (1024, 1024), dtype, seed=0)
        t = np.linspace(0, 255, 256) if dtype == "uint8" else np.linspace(0, 1, 256, dtype=np.float32)
        return lambda: cutopo.ecc(image, t)

    if which.startswith("grid_sample"):
        image, grid = _grid_sample_inputs(cp)
        if which == "grid_sample":
            return lambda: cutopo.grid_sample(image, grid)
        out, pb = cutopo.vjp(cutopo.grid_sample, image, grid)
        g = cp.ones_like(out)
        return lambda: pb(g)
    if which.startswith("soft_ecc"):
        # bench_soft's 1024^2 case: a smooth CuPy image, CuPy thresholds, a Python float scale
        from bench_soft import SoftEcc

        (image, t, scale), _ = SoftEcc("soft_ecc", (1024, 1024), 2, 256).inputs(cp, 2.0, 0)
        out, pb = cutopo.vjp(cutopo.soft_ecc, image, t, scale)
        g = cp.ones_like(out)
        calls = {"soft_ecc": lambda: cutopo.soft_ecc(image, t, scale), "soft_ecc_vjp": lambda: pb(g),
                 "soft_ecc_both": lambda: cutopo.vjp(cutopo.soft_ecc, image, t, scale)[1](g)}
        return calls[which]
    if which.startswith("soft_ect"):
        mask, directions, t, scale = _soft_ect_inputs(cp)
        if which == "soft_ect":
            return lambda: cutopo.soft_ect(mask, directions, t, scale)
        out, pb = cutopo.vjp(cutopo.soft_ect, mask, directions, t, scale)
        g = cp.ones_like(out)
        return lambda: pb(g)
    pts, theta, tess = _cpab_inputs(cp)
    if which == "integrate":
        return lambda: integrate(pts, theta, tess)
    out, pb = cutopo.vjp(integrate, pts, theta, tess, wrt="theta")
    g = cp.ones_like(out)
    return lambda: pb(g)


def _soft_ect_inputs(cp):
    """bench_soft's soft_ect 512^2 D=256 case: CuPy mask, directions and thresholds."""
    from bench_soft import SoftEct

    return SoftEct("soft_ect", 512, 256, 128).inputs(cp, 0, seed=0)[0]


def _wall_us(cp, fn, calls=300):
    """Mean microseconds of back-to-back calls, one synchronisation at the end."""
    for _ in range(5):
        fn()
    cp.cuda.Device().synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    cp.cuda.Device().synchronize()
    return (time.perf_counter() - start) / calls * 1e6


def soft_ect_stages(cp):
    """Wall time per call of each piece of a CuPy soft_ect forward (V construction): the
    device-argument path (SoftEctPlan) that bench_soft's CuPy directions and thresholds take,
    and the host-argument path's stages for comparison."""
    from cutopo import _band_cupy, _ect
    from cutopo._band_numpy import band_halfwidth
    from cutopo._cuda.deferred import reading

    mask, directions, t, scale = _soft_ect_inputs(cp)
    _, dirs64, mask_b, _, spatial, coords, tconn, t64, _ = _ect._prepare("soft_ect", mask, directions, t, 1)
    B, N = mask_b.shape[0], int(np.prod(spatial))
    codes = np.unique((dirs64 >= 0).astype(np.int64) @ (1 << np.arange(len(spatial))))
    c = _band_cupy.orthant_contributions(mask_b, codes)
    t32, lam = t64.astype(np.float32), np.float32(scale)
    w = band_halfwidth(np.dtype(np.float32), lam)
    plan = _band_cupy.soft_ect_plan(cp.cuda.Device().id, B, tuple(spatial), directions.shape[0],
                                    t.size, np.dtype(np.float32), directions.dtype)
    ws, d64, dev_codes, flags = plan.arguments(t, directions)
    flags.read()

    def device_forward():
        ws, d64, dev_codes, flags = plan.arguments(t, directions)
        with reading(flags, lambda values: None):
            plan.forward(mask_b, ws, d64, dev_codes, t, lam, w)

    out, pb = cutopo.vjp(cutopo.soft_ect, mask, directions, t, scale)
    g = cp.ones_like(out)
    rows = [("soft_ect call", lambda: cutopo.soft_ect(mask, directions, t, scale)),
            ("pullback call", lambda: pb(g)),
            ("vjp forward + pullback", lambda: cutopo.vjp(cutopo.soft_ect, mask, directions, t, scale)[1](g)),
            ("device path: SoftEctPlan.arguments + forward + flag read", device_forward),
            ("device path: SoftEctPlan.arguments (zeros, check kernel, flags read)",
             lambda: plan.arguments(t, directions)[3].read()),
            ("host path: _prepare (checks, two host reads)", lambda: _ect._prepare("soft_ect", mask, directions, t, 1)),
            ("host path: ect_forward (entries, kernel, finalize)",
             lambda: _band_cupy.ect_forward(mask_b, dirs64, coords, t32, tconn, True, lam=lam, w=w, keep=True)),
            ("host path: entries_v", lambda: _band_cupy.entries_v(mask_b, dirs64)),
            ("host path: orthant_contributions", lambda: _band_cupy.orthant_contributions(mask_b, codes)),
            ("host path: _compact (one host read)", lambda: _band_cupy._compact(c, B, N, codes.size))]
    print("\n## soft_ect stages (512^2 mask, 256 directions, T = 128)\n| stage | us per call |\n|---|---|")
    for name, fn in rows:
        print(f"| {name} | {_wall_us(cp, fn):.1f} |")


def soft_ecc_stages(cp):
    """Wall time per call of each piece of a CuPy soft_ecc forward and pullback (bench_soft's
    1024^2 case: a smooth CuPy image, CuPy thresholds, a Python float scale). Pieces shorter
    than their kernels show the kernels' time."""
    from bench_soft import SoftEcc

    from cutopo import _soft_ecc, _soft_ecc_cupy
    from cutopo._cuda.launch import NULL

    (image, t, scale), _ = SoftEcc("soft_ecc 2d 1024^2", (1024, 1024), 2, 256).inputs(cp, 2.0, 0)
    cfg = _soft_ecc._prepare(image, t, scale, None, 1)
    w = cfg.w
    plan = _soft_ecc_cupy.soft_ecc_plan(cp.cuda.runtime.getDevice(), image.dtype, 1, (1024, 1024),
                                        False, False, t.size, cfg.dtype)
    ws = cp.zeros(plan.words, dtype=np.uint64)
    out = cp.empty((1, t.size), dtype=cfg.dtype)
    word = _soft_ecc_cupy.check_word()
    vout, pb = cutopo.vjp(cutopo.soft_ecc, image, t, scale)
    g = cp.ones_like(vout)

    rows = [("soft_ecc call", lambda: cutopo.soft_ecc(image, t, scale)),
            ("pullback call", lambda: pb(g)),
            ("vjp forward + pullback", lambda: cutopo.vjp(cutopo.soft_ecc, image, t, scale)[1](g)),
            ("vjp forward", lambda: cutopo.vjp(cutopo.soft_ecc, image, t, scale)),
            ("_forward", lambda: _soft_ecc._forward(image, t, scale)),
            ("_prepare (argument checks)", lambda: _soft_ecc._prepare(image, t, scale, None, 1)),
            ("soft_ecc_forward, checked", lambda: _soft_ecc_cupy.soft_ecc_forward(
                image, cfg.t, cfg.scale, w, 2, False, check=True)),
            ("soft_ecc_forward, unchecked", lambda: _soft_ecc_cupy.soft_ecc_forward(
                image, cfg.t, cfg.scale, w, 2, False)),
            ("soft_ecc_backward", lambda: _soft_ecc_cupy.soft_ecc_backward(
                image, cfg.t, cfg.scale, w, 2, False, g, (True, True, True), t_dtype=cfg.dtype,
                s_dtype=cfg.dtype)),
            ("fused forward launch, unchecked", lambda: plan._forward(image, t, ws, out, NULL, 0,
                                                                      NULL, cfg.scale, w)),
            ("fused forward launch + check word read", lambda: (
                plan._forward(image, t, ws, out, word, word.arm(), NULL, cfg.scale, w),
                word.read())),
            ("cupy.empty", lambda: cp.empty((1, t.size), dtype=cfg.dtype)),
            ("cupy.zeros", lambda: cp.zeros(258, dtype=np.float64))]
    print("\n## soft_ecc stages (1024^2 float32, T = 256)\n| stage | us per call |\n|---|---|")
    for name, fn in rows:
        print(f"| {name} | {_wall_us(cp, fn):.1f} |")


def grid_sample_stages(cp, reps=50):
    """Median ms of each piece of a CuPy grid_sample forward (bilinear, zeros)."""
    from bench_ecc import time_gpu

    from cutopo import _sampling_cupy as sc
    from cutopo import sampling

    image, grid = _grid_sample_inputs(cp)
    cfg = sampling._prepare(image, grid, "bilinear", "zeros", False)
    dev = cp.cuda.Device().id
    NP = cfg.N * cfg.P
    groups, per = sc.channel_groups(NP, cfg.C)
    t, r = cfg.image.dtype.name, cfg.real.name
    plan = sc._prepared(dev, sc._forward_sig(t, r, np.dtype(cfg.dtype).name, 2, False), groups * NP,
                        (NP, cfg.P, cfg.C, per) + sc._common(cfg) + (sc._narrow(groups * NP, cfg),))
    out = cp.empty(cfg.out_shape, dtype=cfg.dtype)
    flags = cp.zeros(1, dtype=np.int32)
    n = cfg.image.size
    blocks = min(-(-n // sc.THREADS), sc.FILL * sc._device_threads() // sc.THREADS)
    check = sc._prepared_blocks(dev, sc._check_sig(t), blocks, n)
    split = []
    for per_group in (16, 8, 4, 2):
        g = -(-cfg.C // per_group)
        p = sc._prepared(dev, sc._forward_sig(t, r, np.dtype(cfg.dtype).name, 2, False), g * NP,
                         (NP, cfg.P, cfg.C, per_group) + sc._common(cfg) + (sc._narrow(g * NP, cfg),))
        split.append((f"forward kernel, {per_group} channels per thread",
                      time_gpu(cp, lambda: p(cfg.image, cfg.grid, out, flags), reps)))
    rows = split + [("_prepare (host)", time_gpu(cp, lambda: sampling._prepare(image, grid, "bilinear", "zeros", False), reps)),
            ("check_image kernel", time_gpu(cp, lambda: check(cfg.image, flags), reps)),
            (f"forward kernel ({groups} channel groups)", time_gpu(cp, lambda: plan(cfg.image, cfg.grid, out, flags), reps)),
            ("_sampling_cupy.forward (both + flag read)", time_gpu(cp, lambda: sc.forward(cfg), reps)),
            ("grid_sample call", time_gpu(cp, lambda: cutopo.grid_sample(image, grid), reps))]
    print("\n## grid_sample forward stages: image (8, 16, 256, 256) float32, grid uniform in (-1.1, 1.1)")
    print("| stage | ms |\n|---|---|")
    for name, ms in rows:
        print(f"| {name} | {ms:.4f} |")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("which", nargs="?", default="grid_sample")
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--top", type=int, default=18)
    p.add_argument("--sort", default="tottime", help="pstats sort keys, comma-separated (tottime,cumtime)")
    args = p.parse_args(argv)
    if not cutopo.gpu_available():
        print("profile_host: no CUDA device visible to CuPy")
        return 0
    import cupy as cp

    for which in args.which.split(","):
        stages = {"grid_sample_stages": grid_sample_stages, "soft_ect_stages": soft_ect_stages,
                  "soft_ecc_stages": soft_ecc_stages}
        if which in stages:
            stages[which](cp)
            continue
        call = make_call(cp, which)
        for _ in range(3):
            call()
        cp.cuda.Device().synchronize()
        start = time.perf_counter()
        for _ in range(args.calls):
            call()
        cp.cuda.Device().synchronize()
        per_call = (time.perf_counter() - start) / args.calls * 1e3
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.calls):
            call()
        cp.cuda.Device().synchronize()
        prof.disable()
        print(f"\n## {which}: {args.calls} calls, {per_call:.3f} ms per call without the profiler")
        for key in args.sort.split(","):
            pstats.Stats(prof).sort_stats(key).print_stats(args.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
