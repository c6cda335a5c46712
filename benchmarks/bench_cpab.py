"""CPAB benchmark: cutopo.cpab.integrate forward and VJP on the GPU, against a dense stationary
velocity field integrated by scaling and squaring (VoxelMorph's integrator).

    python benchmarks/bench_cpab.py [--quick] [--only NAME] [--json FILE] [--reps N]
                                    [--baseline-reps N] [--no-baseline] [--no-scaling]

Cases (issue 4):

* 2d: batch 32, the 256^2 pixel centres (shared by the batch), tessellation 16 x 16, T = 50.
* 3d: batch 1, the 128^3 voxel centres, tessellation 10^3, T = 50.
* scaling: the VJP's time and memory for 2D tessellations 4..64 (batch 32, 256^2) and 3D
  tessellations 2..30 (batch 1, 128^3); the issue asks for at most 2x from the smallest to
  the largest.
* --quick: 2D batch 4 on 64^2, 3D 32^3, two scaling sizes each.

Inputs: theta drawn from the tessellation's prior (length scale 0.25) and rescaled so that
max_c ||A_c,lin||_F = 10 (h ||A|| = 0.2 at T = 50, inside the step-size guard); float32
points; no-slip boundary. Seeds fixed per case.

Stages: ``forward`` (integrate), ``VJP`` (the pullback alone, theta cotangent only, as a
registration needs; residuals from one earlier ``cutopo.vjp``) and ``forward+VJP``.
Columns:

* call ms: median of CUDA-event timings of the whole call, Python overhead included. The op
  synchronises once per call (the step-size guard reads max ||A_c|| on the host), so there is
  no CUDA-graph time.
* base ms: the baseline on the same run: a stationary velocity field on the same grid (the
  CPAB field evaluated at the pixel centres), exp(v) by 7 squarings phi <- phi o phi with
  bilinear/trilinear resampling (``cutopo.grid_sample``, border padding), VJP by chaining the
  squarings' pullbacks; benchmarks/_svf_baseline.py.
* ratio: base ms / call ms.
* peak MB / base MB: the memory pool's high-water mark during one forward+VJP (inputs
  excluded), ours and the baseline's; the issue's target is ours <= 1/4 of the baseline's.
* GB/s, of copy BW: the points read and the result written (forward), plus the cotangent read
  (VJP), over the time, against the device-to-device copy bandwidth of the same run.
* check: the forward against the NumPy path on a subset of the points (max abs. difference;
  float32 trajectories agree to rounding up to rare face-crossing steps, see
  tests/test_cpab_gpu.py), "ok" below --tol.

Exit status: 0, or 1 when a check fails or an op raised. Without a GPU the script says so and
exits 0.
"""
from __future__ import annotations

import os
import sys

import numpy as np

import cutopo
from cutopo.cpab import Tessellation, integrate

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _bench_common import (device_and_bandwidth, fmt_ms, make_parser, print_header,  # noqa: E402
                           print_report, print_row, run_cases, target_dicts, time_status,
                           write_json)
from bench_ecc import time_gpu  # noqa: E402

T_STEPS = 50
LARGEST = 10.0


class Case:
    def __init__(self, name, batch, grid, tess, stages=("forward", "VJP", "forward+VJP")):
        self.name, self.batch, self.grid, self.tess_shape, self.stages = name, batch, grid, tess, stages

    def inputs(self, cp, seed):
        rng = np.random.default_rng(seed)
        tess = Tessellation(self.tess_shape)
        theta = tess.sample(self.batch, length_scale=0.25, rng=rng)
        A = tess.affine_maps(theta)
        norm = float(np.sqrt((A[..., :tess.ndim] ** 2).sum(axis=(-1, -2))).max())
        theta = (theta * (LARGEST / norm)).astype(np.float32)
        axes = [(np.arange(n) + 0.5) / n for n in self.grid]
        points = np.stack(np.meshgrid(*axes, indexing="ij"), axis=-1).reshape(-1, len(self.grid))
        return tess, cp.asarray(points.astype(np.float32)), cp.asarray(theta)


def cases(quick):
    if quick:
        return [Case("2d b4 64^2 tess 16", 4, (64, 64), (16, 16)),
                Case("3d 32^3 tess 10", 1, (32, 32, 32), (10, 10, 10)),
                Case("scaling 2d tess 4", 4, (64, 64), (4, 4), ("VJP",)),
                Case("scaling 2d tess 32", 4, (64, 64), (32, 32), ("VJP",))]
    main = [Case("2d b32 256^2 tess 16", 32, (256, 256), (16, 16)),
            Case("3d 128^3 tess 10", 1, (128, 128, 128), (10, 10, 10))]
    scaling = [Case(f"scaling 2d tess {n}", 32, (256, 256), (n, n), ("VJP",)) for n in (4, 8, 16, 32, 64)]
    scaling += [Case(f"scaling 3d tess {n}", 1, (128, 128, 128), (n, n, n), ("VJP",)) for n in (2, 5, 10, 20, 30)]
    return main + scaling


def peak_bytes(cp, fn):
    """High-water mark of the default memory pool while ``fn()`` runs and its result lives: the
    pool keeps freed blocks cached, so its total after the call bounds the peak."""
    pool = cp.get_default_memory_pool()
    cp.cuda.Device().synchronize()
    pool.free_all_blocks()
    before = pool.total_bytes()
    keep = fn()
    cp.cuda.Device().synchronize()
    peak = pool.total_bytes() - before
    del keep
    return peak


def baseline(cp, case, tess, points, theta):
    """(forward, forward+VJP) callables of the scaling-and-squaring baseline, or None."""
    try:
        from _svf_baseline import svf_forward
    except ImportError:
        return None
    K = len(case.grid)
    v = cutopo.cpab.velocity(points, theta, tess)                         # (B, N, K)
    field = cp.ascontiguousarray(cp.moveaxis(v.reshape((case.batch,) + case.grid + (K,)), -1, 1))

    def fwd():
        return svf_forward(field)[0]

    def fwd_vjp():
        phi, pullback = svf_forward(field)
        return pullback(cp.ones_like(phi))

    return fwd, fwd_vjp


def run_case(cp, case, args, bw, rows, notes, failures):
    tess, points, theta = case.inputs(cp, seed=hash(case.name) % 2**31)
    B, N, K = case.batch, points.shape[0], tess.ndim
    reps = args.reps or (10 if N * B > 1e6 else 30)
    out, pullback = cutopo.vjp(integrate, points, theta, tess, wrt="theta", n_steps=T_STEPS)
    cot = cp.random.default_rng(1).standard_normal(out.shape, dtype=cp.float32)

    stages = {
        "forward": lambda: integrate(points, theta, tess, n_steps=T_STEPS),
        "VJP": lambda: pullback(cot),
        "forward+VJP": lambda: cutopo.vjp(integrate, points, theta, tess, wrt="theta",
                                          n_steps=T_STEPS)[1](cot),
    }
    base = None if args.no_baseline else baseline(cp, case, tess, points, theta)
    peak = peak_bytes(cp, stages["forward+VJP"])
    base_peak = None if base is None else peak_bytes(cp, base[1])
    sub = slice(0, min(N, 4096))
    want = integrate(points[sub].get(), theta.get(), tess, n_steps=T_STEPS)
    err = float(np.abs(out[:, sub].get() - want).max())
    ok = err <= args.tol
    if not ok:
        failures.append(f"{case.name}: forward differs from NumPy by {err:.2e}")
    notes.append(f"{case.name}: tess {case.tess_shape} ({tess.n_cells} cells, {tess.n_params} "
                 f"params), batch {B}, {N} points, T = {T_STEPS}; max |GPU - NumPy| on "
                 f"{sub.stop} points: {err:.1e}")
    for stage in case.stages:
        ms = time_gpu(cp, stages[stage], reps)
        base_ms = None
        if base is not None and stage != "VJP":
            base_ms = time_gpu(cp, base[0] if stage == "forward" else base[1], args.baseline_reps)
        nbytes = 4 * (N * K + 2 * B * N * K) if stage != "forward" else 4 * (N * K + B * N * K)
        gbs = nbytes / ms / 1e6
        row = {"case": case.name, "stage": stage, "call_ms": ms, "base_ms": base_ms,
               "peak_mb": peak / 1e6, "base_peak_mb": None if base_peak is None else base_peak / 1e6,
               "gbs": gbs, "err": err}
        rows.append(row)
        print_row([case.name, stage, fmt_ms(ms), fmt_ms(base_ms),
                   "-" if base_ms is None else f"{base_ms / ms:.1f}x", f"{peak / 1e6:.1f}",
                   "-" if base_peak is None else f"{base_peak / 1e6:.1f}", f"{gbs:.0f}",
                   f"{100 * gbs / bw:.1f}%", f"{'ok' if ok else 'MISMATCH'} {err:.1e}"])


def target_rows(rows):
    def get(case, stage):
        return next((r for r in rows if r["case"].startswith(case) and r["stage"] == stage), None)

    targets = []
    for prefix, limit in (("2d b32", 1.0), ("3d 128", 2.0)):
        r = get(prefix, "forward+VJP")
        if r is not None:
            targets.append((f"{r['case']} forward+VJP <= {limit} ms", f"call {r['call_ms']:.4f} ms",
                            time_status(r["call_ms"], None, limit)))
            if r["base_peak_mb"]:
                frac = r["peak_mb"] / r["base_peak_mb"]
                targets.append((f"{r['case']} peak memory <= 1/4 of the baseline's",
                                f"{r['peak_mb']:.1f} MB vs {r['base_peak_mb']:.1f} MB ({frac:.2f})",
                                "MET" if frac <= 0.25 else "MISSED"))
    for dim in ("2d", "3d"):
        scal = [r for r in rows if r["case"].startswith(f"scaling {dim}") and r["stage"] == "VJP"]
        if len(scal) >= 2:
            t = [r["call_ms"] for r in scal]
            m = [r["peak_mb"] for r in scal]
            targets.append((f"scaling {dim}: VJP time and memory within 2x from the smallest to "
                            "the largest tessellation",
                            f"time {t[-1] / t[0]:.2f}x, memory {m[-1] / m[0]:.2f}x",
                            "MET" if t[-1] / t[0] <= 2 and m[-1] / m[0] <= 2 else "MISSED"))
    return targets


def run_gpu(args):
    import cupy as cp

    name, bw = device_and_bandwidth(cp)
    print(f"# GPU: {name}; device-to-device copy bandwidth {bw:.0f} GB/s (read + write)")
    header = ["case", "stage", "call ms", "base ms", "ratio", "peak MB", "base MB", "GB/s",
              "of copy BW", "check"]
    print_header(header)
    rows, notes, failures = [], [], []
    only = (lambda n: any(s in n for s in args.only.split(","))) if args.only else (lambda n: True)
    todo = [c for c in cases(args.quick) if not (args.no_scaling and c.name.startswith("scaling"))]
    run_cases(cp, todo, header, only,
              lambda case: run_case(cp, case, args, bw, rows, notes, failures), failures)
    targets = target_rows(rows)
    print_report(notes, targets, failures, "Targets (issue 4; H200)", "no target case ran")
    if args.json:
        write_json(args.json, {"device": name, "copy_bw": bw, "rows": rows, "notes": notes,
                               "targets": target_dicts(targets), "failures": failures})
    return 1 if failures else 0


def main(argv=None):
    p = make_parser(__doc__, quick="small sizes (smoke test)",
                    only="run the cases whose name contains this (comma-separated alternatives)",
                    json_file="write the rows, notes and targets to this file",
                    reps="timed repetitions per stage (default 30, 10 for large cases)",
                    baseline_reps="timed repetitions of the baseline",
                    no_baseline="skip the scaling-and-squaring baseline")
    p.add_argument("--no-scaling", action="store_true", help="skip the tessellation-scaling cases")
    p.add_argument("--checkpoints", choices=("sparse", "device", "recompute"), default=None,
                   help="where the VJP keeps its checkpoints (cutopo.cpab._integrate_cupy.CHECKPOINTS; "
                        "default: the library's)")
    p.add_argument("--tol", type=float, default=1e-3,
                   help="largest accepted max |GPU - NumPy| of the forward (default 1e-3)")
    args = p.parse_args(argv)
    if not cutopo.gpu_available():
        print("bench_cpab: no CUDA device visible to CuPy; nothing to measure (run it on a GPU machine).")
        return 0
    if args.checkpoints:
        from cutopo.cpab import _integrate_cupy

        _integrate_cupy.CHECKPOINTS = args.checkpoints
    return run_gpu(args)


if __name__ == "__main__":
    sys.exit(main())
