"""Stage costs of the soft ECC on the GPU: each kernel of the forward and the VJP timed alone.

    python benchmarks/profile_soft.py

For the bench_soft.py image cases, prints the CUDA-graph time (ms) of: the contribution map,
the band forward kernel (given the map), the prefix-sum finalisation, the band backward kernel,
and the whole kernel sequence of the forward and of the VJP. Guides kernel work; the headline
numbers are bench_soft.py's.
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import cutopo  # noqa: E402
from bench_ecc import time_graph  # noqa: E402
from bench_soft import smooth_image  # noqa: E402
from cutopo import _band_cupy, _ecc_cupy  # noqa: E402
from cutopo._cuda.launch import launch  # noqa: E402
from cutopo._soft_ecc import band_halfwidth  # noqa: E402

CASES = [("2d 1024^2", (1024, 1024), 2), ("2d 64x256^2", (64, 256, 256), 2),
         ("3d 256^3", (256, 256, 256), 3)]
T = 256


def stages(cp, image, ndim):
    t = np.linspace(0, 1, T).astype(np.float32)
    lam = np.float32(4.0 * (T - 1))
    w = band_halfwidth(np.float32, lam)
    x, cmap, nimg, N = _band_cupy._soft_ecc_inputs(image, ndim, False)
    acc = cp.zeros((nimg, T), dtype=np.float64)
    sat = cp.zeros((nimg, T), dtype=np.int64)
    g = cp.asarray(np.random.default_rng(0).standard_normal((nimg, T)).astype(np.float32))
    real = np.dtype(np.float32)
    fsig = _band_cupy._soft_ecc_sig("forward", image.dtype, real)
    shared, smem = _band_cupy._shared_plan(T, real, False, True)
    bpi = _band_cupy._blocks_per_row(fsig, nimg, N, T, smem, _band_cupy.MIN_PIXELS_PER_BLOCK)
    t_dev = _band_cupy.device_table(t)
    bsig = _band_cupy._soft_ecc_sig("backward", image.dtype, real)
    bshared, bsmem = _band_cupy._shared_plan(T, real, True, False)
    bbpi = _band_cupy._blocks_per_row(bsig, nimg, N, T, bsmem,
                                       _band_cupy.MIN_PIXELS_PER_BLOCK)
    d_image = cp.empty((nimg, N), dtype=np.float32)
    dt = cp.zeros(T, dtype=np.float64)
    ds = cp.zeros(1, dtype=np.float64)
    return {
        "contributions": lambda: _ecc_cupy.euler_contributions(image, ndim, False),
        f"band forward ({nimg * bpi} blocks)": lambda: launch(
            fsig, nimg * bpi, 256, (x, cmap, t_dev, acc, sat, N, bpi, T, lam, w, int(shared)),
            shared_mem=smem),
        "finalize": lambda: _band_cupy._finalize(sat, acc, real),
        f"band backward ({nimg * bbpi} blocks)": lambda: launch(
            bsig, nimg * bbpi, 256, (x, cmap, t_dev, g, d_image, dt, ds, N, bbpi, T, lam, w,
                                     int(bshared), 1, 1, 1), shared_mem=bsmem),
        "forward (all kernels)": lambda: _band_cupy.soft_ecc_forward(image, t, lam, w, ndim, False),
        "VJP (all kernels)": lambda: _band_cupy.soft_ecc_backward(image, t, lam, w, ndim, False, g,
                                                                  (True, True, True)),
    }


def main():
    if not cutopo.gpu_available():
        print("# no GPU")
        return 0
    import cupy as cp

    for name, shape, ndim in CASES:
        image = smooth_image(cp, shape, ndim, 2.0, 1)
        c = cutopo.euler_contributions(image, ndim=ndim)
        print(f"## soft_ecc {name}: {float(cp.count_nonzero(c)) / c.size:.2%} of pixels with c != 0")
        for stage, fn in stages(cp, image, ndim).items():
            print(f"  {stage:32s} {time_graph(cp, fn, 30):8.4f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
