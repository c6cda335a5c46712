"""Per-launch GPU times of the soft ECC forward + VJP where entries are kept (listed 3D forward,
listed backward), for values of _soft_ecc_cupy.LISTED_WAVES.

    python benchmarks/profile_listed.py [--waves 0.5,1,2] [--only TEXT] [--noise]

For each case (smooth float32 images, or white noise with ``--noise``, whose lists overflow:
the fallback launches' work; T = 256, bench_soft's scale) and waves value, runs the
plan's launches directly (list sweep, listed band work, fused forward of the overflowed
images; or the 2D fused forward keeping entries; then the backward's sweep launch, which
zeroes d_image for the listed images unless the list sweep did (SoftEccPlan.zeroes_d_image,
as in cutopo.vjp's forward), and the listed backward) with a CUDA event between each
two, the stream first held busy so that the events time the GPU alone; prints the median of
22 calls per launch (us), the grids of the kernels over entries and sums of the outputs
(identical between trees and waves where only the work's layout differs).
(`benchmarks/ab_trees.sh ab/old . 2 -- python3 benchmarks/profile_listed.py`.)
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import cutopo  # noqa: E402
from bench_soft import smooth_image  # noqa: E402

T = 256
CASES = [("256^3", (256, 256, 256), 3), ("1024^2", (1024, 1024), 2), ("64x256^2", (64, 256, 256), 2),
         ("512^3", (512, 512, 512), 3), ("4x128^3", (4, 128, 128, 128), 3)]


def run(cp, name, shape, ndim, waves, noise=False):
    from cutopo import _soft_ecc_cupy
    from cutopo._band_numpy import band_halfwidth
    from cutopo._cuda.launch import NULL

    f32 = np.dtype(np.float32)
    _soft_ecc_cupy.LISTED_WAVES = waves
    _soft_ecc_cupy.soft_ecc_plan.cache_clear()
    image = (cp.asarray(np.random.default_rng(1).random(shape, dtype=np.float32)) if noise
             else smooth_image(cp, shape, ndim, 2.0, 1))
    t = cp.asarray(np.linspace(0, 1, T).astype(np.float32))
    lam = np.float32(4.0 * (T - 1))
    w = band_halfwidth(f32, lam)
    nimg = int(np.prod(shape[:-ndim]))
    plan = _soft_ecc_cupy.soft_ecc_plan(cp.cuda.runtime.getDevice(), image.dtype, nimg, shape[-ndim:], False,
                                        False, T, f32)
    out = cp.empty(shape[:-ndim] + (T,), dtype=np.float32)
    g = cp.asarray(np.random.default_rng(0).standard_normal(out.shape).astype(np.float32))
    d_image = cp.empty(shape, dtype=np.float32)
    d_t = cp.empty(T, dtype=np.float32)
    d_s = cp.empty((), dtype=np.float32)
    kept = cp.empty(nimg * (1 + plan.kept_cap), dtype=np.uint64)
    busy = cp.ones(1 << 26, dtype=np.float32)
    listed = plan._list is not None
    names = (["list sweep", "listed band", "overflowed"] if listed else ["fused forward (kept)"]) + \
        ["backward sweep", "backward listed"]
    rows = []
    for rep in range(25):
        ws = plan.workspace("forward", plan.words, np.uint64)
        bws = plan.workspace("backward", _soft_ecc_cupy.backward_workspace_words(T), np.float64)
        for _ in range(4):  # ~1 ms of queued work: the host enqueues the launches meanwhile
            busy *= np.float32(1.0000001)
        ev = [cp.cuda.Event() for _ in range(len(names) + 1)]
        ev[0].record()
        if listed:
            plan._list(image, t, ws, NULL, 0, kept, d_image if plan.zeroes_d_image else NULL)
            ev[1].record()
            plan._listed(image, t, ws, out, kept, lam, w)
            ev[2].record()
            plan._overflowed(image, t, ws, out, lam, w, kept)
            ev[3].record()
        else:
            plan._forward(image, t, ws, out, NULL, 0, kept, lam, w)
            ev[1].record()
        k = len(names) - 1
        arrays = [image, t, g, d_image, bws, d_t, d_s, kept]
        plan.backward_launch(True, f32, f32, zeroed=plan.zeroes_d_image)(*arrays, lam, w)
        ev[k].record()
        plan.backward_launch(True, f32, f32, True)(*arrays, lam, w)
        ev[k + 1].record()
        ev[-1].synchronize()
        if rep >= 3:
            rows.append([cp.cuda.get_elapsed_time(ev[i], ev[i + 1]) for i in range(len(names))])
    med = np.median(np.array(rows), axis=0) * 1e3
    sums = (float(out.astype(cp.float64).sum()), float(d_image.astype(cp.float64).sum()),
            float(cp.abs(d_image).astype(cp.float64).sum()), float(d_t.astype(cp.float64).sum()), float(d_s))
    grids = (plan._listed.grid if listed else None, plan.backward_launch(True, f32, f32, True).grid)
    print(f"{name}{' noise' if noise else ''} waves={waves} grids (listed forward, listed backward) {grids}, "
          f"{int(kept[0].get())} entries in image 0: " + ", ".join(f"{n} {m:.1f}" for n, m in zip(names, med))
          + f"; total {med.sum():.1f} us; sums {sums}", flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--waves", default="1", help="comma-separated LISTED_WAVES values ('none': the sweep's)")
    p.add_argument("--only", help="the cases whose name holds this")
    p.add_argument("--noise", action="store_true", help="white noise instead of smooth images")
    args = p.parse_args()
    if not cutopo.gpu_available():
        print("# no GPU")
        return 0
    import cupy as cp

    waves = [None if v.strip().lower() == "none" else float(v) for v in args.waves.split(",")]
    for name, shape, ndim in CASES:
        if args.only and args.only not in name:
            continue
        for v in waves:
            run(cp, name, shape, ndim, v, args.noise)
    return 0


if __name__ == "__main__":
    sys.exit(main())
