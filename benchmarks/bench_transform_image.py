"""transform_image benchmark: cutopo.cpab.transform_image, fused CuPy path against the composed one.
Fused: integrate and sample in one kernel, no grid array; composed: transform_grid, grid_sample.

    python benchmarks/bench_transform_image.py [--quick] [--only NAME] [--json FILE]
                                               [--repeats N] [--no-baseline] [--tol X]
                                               [--theta-scale X] [--n-steps N]

Cases (float32 images, theta batch = image batch):

* 2d 512 register: image (1, 1, 512, 512), tessellation 15 x 15: bench_register.py's per-step
  shape.
* 2d b8 c3 256: image (8, 3, 256, 256), tessellation 16 x 16, one theta per image.
* 3d 128 register: image (1, 1, 128, 128, 128), tessellation 15^3: bench_register.py's 3D shape.
* --quick: 2d 128 (tess 15 x 15), 2d b2 c3 64 (tess 16 x 16), 3d 32 (tess 5^3): a smoke run.

Inputs (as bench_register.py's): every image channel is skimage.data.binary_blobs(length,
volume_fraction=0.5), Gaussian-smoothed (sigma length / 128 pixels) and scaled to [0, 1]; theta
drawn from the tessellation's prior (length scale 0.3, scale --theta-scale, default 0.03: largest
displacements near 7 % of the image), scaled down where needed so that h max_c ||A_c,lin|| <=
0.4 at T = --n-steps (50) integration steps; bilinear, border padding, no-slip boundary. The
cotangent is standard normal noise of the output's shape. Seeds fixed per case.

Stages: ``forward`` (``transform_image``), ``VJP theta`` (``cutopo.vjp(transform_image, ...,
wrt="theta")`` and its pullback: a registration step's work) and ``VJP image+theta`` (the same
without ``wrt``: image and theta cotangents). Each runs once with
``cutopo.cpab.transform.FUSED = True`` (fused) and once with False (composed); the switch is held
over the forward and the pullback alike. Columns:

* fused ms / composed ms: median of --repeats CUDA-event timings of the whole call (Python
  overhead included), after two warm-up calls. The calls synchronise with the host
  (integrate's step-size guard), so there is no CUDA-graph time.
* ratio: composed ms / fused ms.
* peak MB fused / composed: the memory pool's high-water mark during one call of the stage
  while its results live (inputs, and the pixel centres the library keeps per image shape,
  excluded: they exist before the call).
* GB/s, of copy BW: the least traffic of the stage (image read and output written; plus the
  cotangent read for the VJP stages; plus the image cotangent written for VJP image+theta) over
  the fused time, against the device-to-device copy bandwidth of the same run.
* check: fused against composed: max |difference| of the output, and the max |difference| of
  the theta (and image) cotangent relative to the composed one's max |value|; "ok" when every
  one, the output's taken relative to max |output| as well, is <= --tol (1e-4), else "DIFF".

Exit status: 0, or 1 when a check fails, an op raised or the library has no FUSED switch.
Without a GPU the script says so and exits 0.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys

import numpy as np

import cutopo
from cutopo.cpab import Tessellation, transform_grid, transform_image
from cutopo.cpab.integrate import MAX_STEP_NORM

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _bench_common import (device_and_bandwidth, fmt_ms, make_parser, max_rel_error,  # noqa: E402
                           print_header, print_report, print_row, run_cases, write_json)
from bench_cpab import peak_bytes  # noqa: E402
from bench_ecc import time_gpu  # noqa: E402

STAGES = ("forward", "VJP theta", "VJP image+theta")
READING = ("No target: the fused path should be faster than the composed one and need less "
           "peak memory (it writes no grid array and reads none back), with outputs and "
           "cotangents equal to float32 rounding (check column).")


class Case:
    def __init__(self, name, image_shape, tess_shape):
        self.name, self.image_shape, self.tess_shape = name, tuple(image_shape), tuple(tess_shape)

    def inputs(self, cp, n_steps, seed, theta_scale):
        """(image, theta, tess, largest displacement in pixels): float32 CuPy arrays, theta
        (N, d) for an image (N, C, *spatial)."""
        from scipy.ndimage import gaussian_filter
        from skimage import data

        N, C, *spatial = self.image_shape
        length, ndim = spatial[0], len(spatial)
        channels = []
        for i in range(N * C):
            blobs = data.binary_blobs(length=length, n_dim=ndim, volume_fraction=0.5,
                                      rng=seed + i).astype(np.float32)
            img = gaussian_filter(blobs, sigma=length / 128)
            channels.append((img - img.min()) / (img.max() - img.min()))
        image = np.stack(channels).reshape(self.image_shape).astype(np.float32)
        tess = Tessellation(self.tess_shape)
        theta = tess.sample(N, length_scale=0.3, scale=theta_scale, rng=seed)
        A = tess.affine_maps(theta)
        largest = float(np.sqrt((A[..., :ndim] ** 2).sum(axis=(-1, -2))).max())
        theta = (theta * min(1.0, 0.8 * MAX_STEP_NORM * n_steps / largest)).astype(np.float32)
        theta = cp.asarray(theta)
        phi = transform_grid(theta, tess, spatial, n_steps=n_steps)
        ident = transform_grid(cp.zeros_like(theta[:1]), tess, spatial, n_steps=n_steps)
        disp = float(cp.sqrt((((phi - ident) * cp.asarray(spatial, dtype=phi.dtype)) ** 2)
                             .sum(axis=-1)).max())
        return cp.asarray(image), theta, tess, disp


def cases(quick):
    if quick:
        return [Case("2d 128 register", (1, 1, 128, 128), (15, 15)),
                Case("2d b2 c3 64", (2, 3, 64, 64), (16, 16)),
                Case("3d 32 register", (1, 1, 32, 32, 32), (5, 5, 5))]
    return [Case("2d 512 register", (1, 1, 512, 512), (15, 15)),
            Case("2d b8 c3 256", (8, 3, 256, 256), (16, 16)),
            Case("3d 128 register", (1, 1, 128, 128, 128), (15, 15, 15))]


@contextlib.contextmanager
def fused_path(flag):
    """transform_image's fused CuPy path on (True) or off (False) inside the block."""
    from cutopo.cpab import transform

    old = transform.FUSED
    transform.FUSED = flag
    try:
        yield
    finally:
        transform.FUSED = old


def stage_calls(image, theta, tess, cot, n_steps):
    """Each stage as a callable returning a dict of the arrays to check (and keep alive)."""
    def forward():
        return {"out": transform_image(image, theta, tess, n_steps=n_steps)}

    def vjp_theta():
        out, pullback = cutopo.vjp(transform_image, image, theta, tess, wrt="theta",
                                   n_steps=n_steps)
        return {"out": out, "d_theta": pullback(cot)[1]}

    def vjp_all():
        out, pullback = cutopo.vjp(transform_image, image, theta, tess, n_steps=n_steps)
        d_image, d_theta, _ = pullback(cot)
        return {"out": out, "d_theta": d_theta, "d_image": d_image}

    return dict(zip(STAGES, (forward, vjp_theta, vjp_all)))


def measure(cp, fn, fused, reps):
    """(median ms, peak bytes, result) of ``fn`` on one path."""
    with fused_path(fused):
        result = fn()                                  # compile, and the arrays to check
        ms = time_gpu(cp, fn, reps)
        peak = peak_bytes(cp, fn)
    return ms, peak, result


def stage_bytes(stage, image, out):
    """The least traffic of a stage: image read, output written (+ cotangent read, + image
    cotangent written)."""
    nbytes = image.nbytes + out.nbytes
    if stage != "forward":
        nbytes += out.nbytes
    if stage == "VJP image+theta":
        nbytes += image.nbytes
    return nbytes


def compare(cp, ours, base, tol):
    """(errors dict, ok, check cell): the output's max |difference| (and relative), the
    cotangents' relative max |difference|."""
    errors = {"out_max_abs": float(cp.abs(ours["out"].astype(cp.float64)
                                          - base["out"].astype(cp.float64)).max()),
              "out_rel": max_rel_error(cp, ours["out"], base["out"])}
    cell = [f"out {errors['out_max_abs']:.1e}"]
    for name in ("d_theta", "d_image"):
        if name in base:
            errors[f"{name}_rel"] = max_rel_error(cp, ours.get(name), base[name])
            cell.append(f"{name} {errors[f'{name}_rel']:.1e}")
    ok = all(e <= tol for k, e in errors.items() if k != "out_max_abs")  # NaN: not ok
    return errors, ok, f"{'ok' if ok else 'DIFF'} " + ", ".join(cell)


def run_case(cp, case, args, bw, rows, notes, failures):
    seed = sum(map(ord, case.name))
    image, theta, tess, disp = case.inputs(cp, args.n_steps, seed, args.theta_scale)
    reps = args.reps or 30
    out = transform_image(image, theta, tess, n_steps=args.n_steps)
    cot = cp.random.default_rng(seed).standard_normal(out.shape, dtype=cp.float32)
    calls = stage_calls(image, theta, tess, cot, args.n_steps)
    spatial = image.shape[2:]
    centres_mb = 4 * np.prod(spatial) * tess.ndim / 1e6
    notes.append(f"{case.name}: image {'x'.join(map(str, image.shape))} float32, tess "
                 f"{'x'.join(map(str, tess.shape))} ({tess.n_cells} cells, {tess.n_params} "
                 f"params), theta ({theta.shape[0]}, {tess.n_params}), largest displacement "
                 f"{disp:.1f} px, T = {args.n_steps}; {reps} timed repeats per stage and path; "
                 f"the shared float32 pixel centres ({centres_mb:.1f} MB, the composed path's "
                 f"integration points) are resident before the peaks and not counted")
    del out
    for stage in STAGES:
        fn = calls[stage]
        ms, peak, ours = measure(cp, fn, True, reps)
        base_ms = base_peak = None
        errors, ok, check = {}, True, "-"
        if not args.no_baseline:
            base_ms, base_peak, base = measure(cp, fn, False, reps)
            errors, ok, check = compare(cp, ours, base, args.tol)
            del base
            if not ok:
                failures.append(f"{case.name} {stage}: fused and composed differ: {check}")
        nbytes = stage_bytes(stage, image, ours["out"])
        del ours
        cp.get_default_memory_pool().free_all_blocks()
        gbs = nbytes / ms / 1e6
        rows.append({"case": case.name, "stage": stage, "image": list(image.shape),
                     "tess": list(tess.shape), "n_params": tess.n_params, "fused_ms": ms,
                     "composed_ms": base_ms, "ratio": base_ms / ms if base_ms else None,
                     "fused_peak_mb": peak / 1e6,
                     "composed_peak_mb": None if base_peak is None else base_peak / 1e6,
                     "mb": nbytes / 1e6, "gbs": gbs, "copy_bw_fraction": gbs / bw,
                     "check_ok": ok, **errors})
        print_row([case.name, stage, fmt_ms(ms), fmt_ms(base_ms),
                   "-" if base_ms is None else f"{base_ms / ms:.2f}x", f"{peak / 1e6:.1f}",
                   "-" if base_peak is None else f"{base_peak / 1e6:.1f}", f"{gbs:.0f}",
                   f"{100 * gbs / bw:.1f}%", check])


def reading(rows):
    """The closing note: what to expect, and how many stages met it."""
    both = [r for r in rows if r["composed_ms"] is not None]
    if not both:
        return READING
    faster = sum(r["fused_ms"] < r["composed_ms"] for r in both)
    smaller = sum(r["fused_peak_mb"] < r["composed_peak_mb"] for r in both)
    return (f"{READING}\nHere: fused faster in {faster} of {len(both)} stages, less peak memory "
            f"in {smaller} of {len(both)}.")


def run_gpu(args):
    import cupy as cp

    from cutopo.cpab import transform

    if not hasattr(transform, "FUSED"):
        print("bench_transform_image: cutopo.cpab.transform has no FUSED switch (this library "
              "version has no fused transform_image path); nothing to compare.")
        return 1
    name, bw = device_and_bandwidth(cp)
    print(f"# GPU: {name}; device-to-device copy bandwidth {bw:.0f} GB/s (read + write)")
    header = ["case", "stage", "fused ms", "composed ms", "ratio", "peak MB fused",
              "peak MB composed", "GB/s", "of copy BW", "check"]
    print_header(header)
    rows, notes, failures = [], [], []
    only = (lambda n: any(s in n for s in args.only.split(","))) if args.only else (lambda n: True)
    run_cases(cp, cases(args.quick), header, only,
              lambda case: run_case(cp, case, args, bw, rows, notes, failures), failures)
    print_report(notes, [], failures, "Reading", reading(rows))
    if args.json:
        write_json(args.json, {"device": name, "copy_bw_gbs": bw, "rows": rows, "notes": notes,
                               "reading": reading(rows), "failures": failures})
    return 1 if failures else 0


def main(argv=None):
    p = make_parser(__doc__, quick="small sizes (a smoke run)",
                    only="run the cases whose name contains this (comma-separated alternatives)",
                    json_file="write the rows, notes and failures to this file",
                    reps="timed repetitions per stage and path (default 30)",
                    baseline_reps="unused (the composed path runs as many repetitions as the "
                                  "fused)",
                    no_baseline="skip the composed path (no ratio, no check)")
    p.add_argument("--repeats", dest="reps", type=int, default=argparse.SUPPRESS,
                   help="same as --reps")
    p.add_argument("--tol", type=float, default=1e-4,
                   help="largest accepted relative difference, fused against composed, of the "
                        "output and the cotangents (default 1e-4)")
    p.add_argument("--theta-scale", type=float, default=0.03,
                   help="prior scale of theta (default 0.03, bench_register.py's)")
    p.add_argument("--n-steps", type=int, default=50, help="CPAB integration steps (default 50)")
    args = p.parse_args(argv)
    if not cutopo.gpu_available():
        print("bench_transform_image: no CUDA device visible to CuPy; nothing to measure (run it "
              "on a GPU machine).")
        return 0
    return run_gpu(args)


if __name__ == "__main__":
    sys.exit(main())
