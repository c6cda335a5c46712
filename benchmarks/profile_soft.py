"""Stage costs of the soft ECC on the GPU: each kernel of the forward and the VJP timed alone.

    python benchmarks/profile_soft.py
    python benchmarks/profile_soft.py --forward-3d [--only TEXT]

For the bench_soft.py image cases, prints the CUDA-graph time (ms) of: the fused forward sweep, the whole forward and the whole VJP (their kernels called
directly), and the fused forward against its blocks per image. Guides kernel work; the headline
numbers are bench_soft.py's. ``--forward-3d``: only the 3D forward, on volumes of several sizes
and dtypes, with a few values of each output, so that two trees' outputs compare line by line
(``benchmarks/ab_trees.sh ab/old . 2 -- python3 benchmarks/profile_soft.py --forward-3d``).
``--only TEXT``: the 3D cases whose name holds TEXT; "1024^3" (4 GiB, left out otherwise) only so.
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import cutopo  # noqa: E402
from bench_ecc import time_graph  # noqa: E402
from bench_soft import smooth_image  # noqa: E402
from cutopo import _band_cupy, _soft_ecc_cupy  # noqa: E402
from cutopo._cuda.launch import NULL, PreparedLaunch  # noqa: E402
from cutopo._band_numpy import band_halfwidth  # noqa: E402

CASES = [("2d 1024^2", (1024, 1024), 2), ("2d 64x256^2", (64, 256, 256), 2),
         ("3d 256^3", (256, 256, 256), 3)]
T = 256


def _setup(cp, image, ndim):
    """Thresholds, scale, band and plan of bench_soft's case (float32, V construction)."""
    t = cp.asarray(np.linspace(0, 1, T).astype(np.float32))
    lam = np.float32(4.0 * (T - 1))
    w = band_halfwidth(np.float32, lam)
    nimg = int(np.prod(image.shape[:image.ndim - ndim]))
    plan = _soft_ecc_cupy.soft_ecc_plan(cp.cuda.runtime.getDevice(), image.dtype, nimg,
                                        tuple(image.shape[image.ndim - ndim:]), False, False, T,
                                        np.dtype(np.float32))
    return t, lam, w, plan


def stages(cp, image, ndim):
    t, lam, w, plan = _setup(cp, image, ndim)
    out = cp.empty(image.shape[:image.ndim - ndim] + (T,), dtype=np.float32)
    g = cp.asarray(np.random.default_rng(0).standard_normal(out.shape).astype(np.float32))
    ws = cp.zeros(plan.words, dtype=np.uint64)
    kept = _soft_ecc_cupy.soft_ecc_forward(image, t, lam, w, ndim, False, keep=True)[1]
    return {
        f"fused forward ({plan._forward.grid} blocks)": lambda: plan._forward(image, t, ws, out, NULL, 0,
                                                                            NULL, lam, w),
        "forward (unchecked, entries kept)": lambda: _soft_ecc_cupy.soft_ecc_forward(
            image, t, lam, w, ndim, False, keep=True),
        "VJP (fused backward, sweep)": lambda: _soft_ecc_cupy.soft_ecc_backward(
            image, t, lam, w, ndim, False, g, (True, True, True)),
        "VJP (fused backward, kept entries)": lambda: _soft_ecc_cupy.soft_ecc_backward(
            image, t, lam, w, ndim, False, g, (True, True, True), kept=kept),
    }


def forward_3d(cp, only=None):
    """The 3D forward (unchecked) alone, with and without kept entries, on smooth volumes
    (large, small, a batch, float64) and white noise; with `only`, the cases named so."""
    cases = [("256^3 float32", (256, 256, 256), np.float32, False),
             ("128^3 float32", (128, 128, 128), np.float32, False),
             ("192^3 float32", (192, 192, 192), np.float32, False),
             ("4x96^3 float32", (4, 96, 96, 96), np.float32, False),
             ("128^3 float64", (128, 128, 128), np.float64, False),
             ("96^3 float32 noise", (96, 96, 96), np.float32, True),
             ("256^3 float32 noise", (256, 256, 256), np.float32, True),
             ("64^3 float32", (64, 64, 64), np.float32, False),
             ("512^3 float32", (512, 512, 512), np.float32, False),
             ("1024^3 float32", (1024, 1024, 1024), np.float32, False)]
    for name, shape, dtype, noise in cases:
        if (only is None and "1024^3" in name) or (only is not None and only not in name):
            continue
        if noise:
            image = cp.asarray(np.random.default_rng(5).random(shape, dtype=np.float32))
        else:
            image = smooth_image(cp, shape, 3, 2.0, 7).astype(dtype)
        t = cp.asarray(np.linspace(0, 1, T).astype(dtype))
        lam = dtype(4.0 * (T - 1))
        w = band_halfwidth(np.dtype(dtype), lam)
        plain = lambda: _soft_ecc_cupy.soft_ecc_forward(image, t, lam, w, 3, False)  # noqa: E731
        kept = lambda: _soft_ecc_cupy.soft_ecc_forward(image, t, lam, w, 3, False, keep=True)  # noqa: E731
        out, residual = kept()
        o = out.astype(np.float64).reshape(-1, T)
        n = int(residual.kept[0].get()) if residual is not None else -1
        print(f"## soft_ecc 3d {name}: output sum {float(o.sum()):.10e}, [-1, 100] {float(o[-1, 100]):.10e}, "
              f"[0, 128] {float(o[0, 128]):.10e}; {n} entries kept of the first image")
        print(f"  forward {time_graph(cp, plain, 30):.4f} ms, with kept entries {time_graph(cp, kept, 30):.4f} ms")


def host_profile(cp, image, ndim):
    """Where the host time of one soft_ecc forward + VJP call goes (cProfile, 20 calls)."""
    import cProfile
    import pstats

    t = cp.asarray(np.linspace(0, 1, T).astype(np.float32))
    scale = 4.0 * (T - 1)

    def call():
        out, pullback = cutopo.vjp(cutopo.soft_ecc, image, t, scale, ndim=ndim)
        pullback(cp.ones_like(out))

    call()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(20):
        call()
    cp.cuda.get_current_stream().synchronize()
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(15)


def block_sweep(cp, image, ndim):
    """Fused forward time against blocks per image (the plan's choice marked)."""
    t, lam, w, plan = _setup(cp, image, ndim)
    fwd = plan._forward
    out = cp.empty((plan.nimg, T), dtype=np.float32)
    ws = cp.zeros(plan.words, dtype=np.uint64)
    chosen = fwd.grid // plan.nimg
    for bpi in sorted({66, 132, 264, 528, 1056, chosen}):
        args = list(fwd.args)
        args[12] = bpi  # blocks_per_image
        p = PreparedLaunch(fwd.sig, plan.nimg * bpi, 256, tuple(args), shared_mem=fwd.shared_mem)
        ms = time_graph(cp, lambda p=p: p(image, t, ws, out, NULL, 0, NULL, lam, w), 30)
        print(f"  blocks/image {bpi:5d}: {ms:.4f} ms{' (plan)' if bpi == chosen else ''}")


def ect_stages(cp):
    """The soft ECT forward of bench_soft.py, stage by stage (event-timed: they synchronise)."""
    from bench_ecc import time_gpu
    from bench_soft import SoftEct
    from cutopo import _ect

    case = SoftEct("soft_ect", 512, 256, 128)
    (mask, directions, t, scale), _ = case.inputs(cp, 2.0, 1)
    dirs64 = cp.asnumpy(directions).astype(np.float64)
    mask_b = mask.reshape((1,) + mask.shape)
    coords = _ect._axis_coordinates(mask.shape)
    t_host = cp.asnumpy(t)
    lam = np.float32(scale)
    w = band_halfwidth(np.float32, lam)
    steps = {
        "entries (orthant passes + compaction)": lambda: _band_cupy.entries_v(mask_b, dirs64),
        "forward (entries + kernels)": lambda: _band_cupy.ect_forward(
            mask_b, dirs64, coords, t_host, False, True, lam, w),
        "whole op": lambda: cutopo.soft_ect(mask, directions, t, scale),
    }
    for name, fn in steps.items():
        print(f"  {name:40s} {time_gpu(cp, fn, 20):8.4f} ms")
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(10):
        steps["whole op"]()
    cp.cuda.get_current_stream().synchronize()
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(12)


def main():
    if not cutopo.gpu_available():
        print("# no GPU")
        return 0
    import cupy as cp

    argv = sys.argv[1:]
    if "--forward-3d" in argv:
        forward_3d(cp, argv[argv.index("--only") + 1] if "--only" in argv else None)
        return 0
    print("## soft_ect 2d 512^2 D=256 forward")
    ect_stages(cp)
    print("## soft_ecc 2d 1024^2 fused forward")
    image = smooth_image(cp, (1024, 1024), 2, 2.0, 1)
    block_sweep(cp, image, 2)
    print("## soft_ecc 2d 1024^2 forward + VJP: host profile")
    host_profile(cp, image, 2)
    for name, shape, ndim in CASES:
        image = smooth_image(cp, shape, ndim, 2.0, 1)
        c = cutopo.euler_contributions(image, ndim=ndim)
        print(f"## soft_ecc {name}: {float(cp.count_nonzero(c)) / c.size:.2%} of pixels with c != 0")
        for stage, fn in stages(cp, image, ndim).items():
            print(f"  {stage:32s} {time_graph(cp, fn, 30):8.4f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
