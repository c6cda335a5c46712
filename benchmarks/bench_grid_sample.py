"""grid_sample benchmark: cutopo's GPU op (forward, VJP) vs torch.nn.functional.grid_sample.

    python benchmarks/bench_grid_sample.py [--quick] [--only NAME] [--json FILE] [--reps N]
                                           [--baseline-reps N] [--no-baseline] [--deterministic]
                                           [--tol X]

Cases (float32, a smooth warp: a small rotation and scaling plus a sum of sinusoidal
displacements of a few pixels, some points outside the image; seeds fixed per case):

* 2D N8 C16 256^2 (bilinear, nearest, reflection+align_corners): image (8, 16, 256, 256), grid
  (8, 256, 256, 2): a batch of feature maps warped onto a grid of their own size.
* 3D N1 C1 128^3 (trilinear, border): image (1, 1, 128, 128, 128), grid (1, 128, 128, 128, 3): a
  volume warped as in 3-D registration.
* --quick: 2D N2 C4 64^2 and 3D N1 C1 32^3.

Stages: ``forward`` (the op), ``VJP`` (the pullback alone, both cotangents: image and grid;
residuals from one earlier ``cutopo.vjp``) and ``forward+VJP``. Columns:

* call ms: median of CUDA-event timings of the whole call, Python overhead included. The
  forward checks the image and the grid for NaN and inf (one extra read of the image, and a
  device-to-host copy of the flag that the call waits for): its time includes both.
* GPU ms: median replay of a CUDA graph captured from one call (device work alone); "no graph"
  when the call synchronises with the host (the forward's finiteness flag, the sort of
  ``--deterministic``).
* torch ms: ``torch.nn.functional.grid_sample`` on the same inputs (shared through DLPack) on
  the same GPU; autograd for the VJP (both cotangents). Without CUDA in torch it runs on the
  CPU (marked "(CPU)"; the ratio then compares devices). Skipped with --no-baseline or
  without torch.
* ratio: torch ms / call ms.
* min MB: forward: the image read once, the grid read, the output written; VJP: image, grid
  and output cotangent read, image and grid cotangents written. GB/s = min MB / time (GPU ms
  where there is one, else call ms); of copy BW: against the device-to-device copy bandwidth
  of the same run.
* check: max |ours - torch| / max |torch| over the stage's outputs. "MISMATCH" above --tol.

Exit status: 0, or 1 when a check reports MISMATCH or an op raised. Without a GPU the script
says so and exits 0.
"""
from __future__ import annotations

import os
import sys
import time

import numpy as np

import cutopo

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _bench_common import (check_cell, device_and_bandwidth, fmt_ms, make_parser,  # noqa: E402
                           max_rel_error, print_header, print_report, print_row, run_cases,
                           time_call_and_graph, write_json)

F32 = np.float32


class Case:
    def __init__(self, name, N, C, spatial, out=None, mode="bilinear", padding_mode="zeros",
                 align_corners=False):
        self.name, self.N, self.C, self.spatial = name, N, C, tuple(spatial)
        self.out = tuple(out or spatial)
        self.kw = dict(mode=mode, padding_mode=padding_mode, align_corners=align_corners)

    def inputs(self, cp, seed):
        rng = np.random.default_rng(seed)
        ndim = len(self.spatial)
        image = cp.random.default_rng(seed).standard_normal((self.N, self.C) + self.spatial, dtype=F32)
        # Pixel centres of the output grid in [-1, 1] (x first), then a rotation and scaling
        # about the centre and smooth displacements of a few pixels per batch element.
        axes = [(np.arange(n) + 0.5) * 2 / n - 1 for n in self.out[::-1]]        # x, y(, z)
        base = np.stack(np.meshgrid(*axes[::-1], indexing="ij")[::-1], -1)       # (*out, ndim)
        grids = []
        for _ in range(self.N):
            a = rng.uniform(-0.1, 0.1)
            rot = np.eye(ndim)
            rot[:2, :2] = [[np.cos(a), -np.sin(a)], [np.sin(a), np.cos(a)]]
            g = base @ (rot * rng.uniform(0.95, 1.08)).T
            for j in range(ndim):
                k = rng.uniform(1, 4, ndim)
                phase = rng.uniform(0, 2 * np.pi)
                amp = rng.uniform(1, 3) * 2 / self.spatial[ndim - 1 - j]            # 1-3 pixels
                g[..., j] += amp * np.sin(np.pi * (base * k).sum(-1) + phase)
            grids.append(g)
        grid = cp.asarray(np.stack(grids).astype(F32))
        return image, grid

    def describe(self, image, grid):
        return (f"image {image.shape} ({image.nbytes / 1e6:.1f} MB), grid {grid.shape} "
                f"({grid.nbytes / 1e6:.1f} MB), {self.kw}")


def cases(quick):
    if quick:
        return [Case("2D N2 C4 64^2", 2, 4, (64, 64)), Case("3D N1 C1 32^3", 1, 1, (32, 32, 32))]
    two = (256, 256)
    return [Case("2D N8 C16 256^2", 8, 16, two),
            Case("2D N8 C16 256^2 nearest", 8, 16, two, mode="nearest"),
            Case("2D N8 C16 256^2 reflection align", 8, 16, two, padding_mode="reflection",
                 align_corners=True),
            Case("3D N1 C1 128^3", 1, 1, (128, 128, 128)),
            Case("3D N1 C1 128^3 border", 1, 1, (128, 128, 128), padding_mode="border")]


def min_bytes(image, grid, out_nbytes):
    fwd = image.nbytes + grid.nbytes + out_nbytes
    vjp = image.nbytes + grid.nbytes + out_nbytes + image.nbytes + grid.nbytes
    return {"forward": fwd, "VJP": vjp, "forward+VJP": fwd + vjp}


# ---------------------------------------------------------------------------------------------
# torch baseline


def torch_device():
    """"cuda", "cpu", or None without torch."""
    try:
        import torch
    except ImportError:
        return None
    return "cuda" if torch.cuda.is_available() else "cpu"


def time_torch(fn, reps, device, setup=None):
    """Median milliseconds of ``fn(setup())`` (or ``fn()``): CUDA events on the GPU, the wall
    clock on the CPU; ``setup`` runs untimed."""
    import torch

    cuda = device == "cuda"
    for _ in range(2):
        fn(setup()) if setup else fn()
    if cuda:
        torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        state = setup() if setup else None
        if cuda:
            torch.cuda.synchronize()
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn() if state is None else fn(state)
            stop.record()
            stop.synchronize()
            times.append(start.elapsed_time(stop))
        else:
            t0 = time.perf_counter()
            fn() if state is None else fn(state)
            times.append((time.perf_counter() - t0) * 1e3)
    return float(np.median(times))


def torch_tensors(cp, arrays, device):
    import torch

    if device == "cuda":
        return [torch.from_dlpack(a) for a in arrays]
    return [torch.from_numpy(cp.asnumpy(a)) for a in arrays]


def to_cupy(cp, t):
    return cp.from_dlpack(t.detach()) if t.is_cuda else cp.asarray(t.detach().numpy())


# ---------------------------------------------------------------------------------------------


def run_case(cp, case, args, bw, rows, notes, failures, tdev):
    seed = sum(map(ord, case.name))
    image, grid = case.inputs(cp, seed)
    kw = dict(case.kw, deterministic=args.deterministic)
    notes.append(f"{case.name}: {case.describe(image, grid)}")
    in_mb = (image.nbytes + grid.nbytes) / 1e6
    reps = args.reps or 30

    out, pullback = cutopo.vjp(cutopo.grid_sample, image, grid, **kw)
    g = cp.asarray(np.random.default_rng(seed + 1).standard_normal(out.shape).astype(F32))
    d_image, d_grid = pullback(g)
    nbytes = min_bytes(image, grid, out.nbytes)
    stages = {"forward": lambda: cutopo.grid_sample(image, grid, **kw),
              "VJP": lambda: pullback(g),
              "forward+VJP": lambda: cutopo.vjp(cutopo.grid_sample, image, grid, **kw)[1](g)}

    checks = {"forward": [], "VJP": []}
    torch_ms = {}
    if tdev is not None and not args.no_baseline:
        import torch
        import torch.nn.functional as F

        ti, tg, tgo = torch_tensors(cp, (image, grid, g), tdev)
        tkw = case.kw

        def leaves():
            return ti.detach().requires_grad_(True), tg.detach().requires_grad_(True)

        li, lg = leaves()
        t_out = F.grid_sample(li, lg, **tkw)
        t_out.backward(tgo)
        checks["forward"].append((max_rel_error(cp, out, to_cupy(cp, t_out)), "out vs torch"))
        checks["VJP"].append((max_rel_error(cp, d_image, to_cupy(cp, li.grad)), "d_image vs torch"))
        checks["VJP"].append((max_rel_error(cp, d_grid, to_cupy(cp, lg.grad)), "d_grid vs torch"))
        del t_out, li, lg
        treps = reps if tdev == "cuda" else args.baseline_reps

        def fwd_state():
            a, b = leaves()
            return F.grid_sample(a, b, **tkw)

        with torch.no_grad():
            torch_ms["forward"] = time_torch(lambda: F.grid_sample(ti, tg, **tkw), treps, tdev)
        torch_ms["VJP"] = time_torch(lambda o: o.backward(tgo), treps, tdev, setup=fwd_state)
        torch_ms["forward+VJP"] = time_torch(lambda: fwd_state().backward(tgo), treps, tdev)
        del ti, tg, tgo
        if tdev == "cuda":
            torch.cuda.empty_cache()

    for stage in ("forward", "VJP", "forward+VJP"):
        fn = stages[stage]
        call_ms, gpu_ms, ms_bw = time_call_and_graph(cp, fn, reps, notes, f"{case.name} {stage}")
        gbs = nbytes[stage] / ms_bw / 1e6
        tms = torch_ms.get(stage)
        ratio = tms / call_ms if tms else None
        parts = checks["forward"] + checks["VJP"] if stage == "forward+VJP" else checks[stage]
        chk = check_cell(f"{case.name} {stage}", parts, args.tol, failures) if parts else "n/a"
        tcell = fmt_ms(tms, 3) + (" (CPU)" if tms is not None and tdev == "cpu" else "")
        rows.append({"case": case.name, "stage": stage, "in_mb": in_mb, "call_ms": call_ms,
                     "gpu_ms": gpu_ms, "torch_ms": tms, "torch_device": tdev, "ratio": ratio,
                     "min_mb": nbytes[stage] / 1e6, "gbs": gbs, "copy_bw_fraction": gbs / bw,
                     "check": chk})
        print_row((case.name, stage, f"{in_mb:.1f}", fmt_ms(call_ms),
                   "no graph" if gpu_ms is None else fmt_ms(gpu_ms), tcell,
                   f"{ratio:.2f}x" if ratio else "-", f"{nbytes[stage] / 1e6:.1f}", f"{gbs:.0f}",
                   f"{gbs / bw:.1%}", chk))
    for stage, parts in checks.items():
        for e, which in parts:
            notes.append(f"{case.name} {stage}: {which} max rel. difference {e:.2e}")


def run_gpu(args):
    import cupy as cp

    tdev = None if args.no_baseline else torch_device()
    gpu_name, bw = device_and_bandwidth(cp)
    print(f"# GPU: {gpu_name}; device-to-device copy bandwidth {bw:.0f} GB/s (read + write); "
          f"torch baseline: {tdev or 'no'}; deterministic={args.deterministic}")
    header = ("case", "stage", "in MB", "call ms", "GPU ms", "torch ms", "ratio", "min MB", "GB/s",
              "of copy BW", "check")
    print_header(header)
    rows, notes, failures = [], [], []
    run_cases(cp, cases(args.quick), header,
              lambda name: not args.only or any(o in name for o in args.only.split(",")),
              lambda case: run_case(cp, case, args, bw, rows, notes, failures, tdev), failures)
    print_report(notes, [], failures, "Targets",
                 "(no time target for grid_sample; the ratio column compares with torch on the "
                 "same run)")
    if args.json:
        write_json(args.json, {"gpu": gpu_name, "copy_bw_gbs": bw, "rows": rows, "notes": notes,
                               "failures": failures})
    return 1 if failures else 0


def main(argv=None):
    p = make_parser(__doc__, quick="small sizes (smoke test)",
                    only="run the cases whose name contains this (comma-separated alternatives, e.g. 2D,3D)",
                    json_file="write the rows and notes to this file",
                    reps="timed repetitions per stage (default 30)",
                    baseline_reps="timed repetitions of torch when it runs on the CPU",
                    no_baseline="skip the torch baseline (and its checks)")
    p.add_argument("--deterministic", action="store_true",
                   help="time deterministic=True (sorted image cotangent)")
    p.add_argument("--tol", type=float, default=1e-4,
                   help="largest accepted max rel. difference against torch (default 1e-4)")
    args = p.parse_args(argv)
    if not cutopo.gpu_available():
        print("bench_grid_sample: no CUDA device visible to CuPy; nothing to measure (run it on a GPU machine).")
        return 0
    return run_gpu(args)


if __name__ == "__main__":
    sys.exit(main())
