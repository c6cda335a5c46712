"""Deformable aggregation benchmark (Sparse4D configuration): cutopo's GPU op (forward, VJP) vs
the PyTorch grid_sample formulation and a straightforward CuPy version.

    python benchmarks/bench_deformable.py [--quick] [--only NAME] [--json FILE] [--reps N]
                                          [--baseline-reps N] [--no-baseline] [--no-torch]
                                          [--deterministic] [--tol X]

Cases (Sparse4Dv3-R50 nuScenes 256x704; research/deformable.md 4.1):

* sparse4d bs1 / bs6 / A1220 bs6: K = 6 cameras, maps (64,176) (32,88) (16,44) (8,22)
  (num_feat = 89760 rows per sample), C = 256, G = 8, A = 900 (1220: training with denoising
  anchors), P = 13, float32.
* sparsedrive map bs12: the SparseDrive map head's stress case, A = 100, P = 300, bs 12, same maps
  (the reference op's 32-bit indexing fails here).
* --quick: bs 1 and 2 with A = 100 on maps a quarter of the size.

Inputs: features standard normal (bs, num_feat, C); per (b, a, p) one visible camera (80 %) or
two (20 %) with (u, v) uniform in (0, 1), the other cameras at u, v in {-0.5, 1.5} (outside,
as projections behind or beside a camera are); weights a softmax over (points, cameras,
scales) per group (Sparse4D's _get_weights). Seeds fixed per case.

Stages: ``forward`` (the op), ``VJP`` (the pullback alone, all three cotangents: features,
sampling_locations, weights; residuals from one earlier ``cutopo.vjp``) and ``forward+VJP``.
Columns:

* call ms: median of CUDA-event timings of the whole call, Python overhead included.
* GPU ms: median replay of a CUDA graph captured from one call (device work alone); "no graph"
  when the call synchronises with the host (``--deterministic``: its compaction does).
* torch ms: the PyTorch fallback of the reference (per level ``grid_sample(2 loc - 1,
  bilinear, zeros, align_corners=False)`` on (bs K, C, H, W) maps, then the weighted sum over
  points, cameras and scales), autograd for the VJP; on the device, same inputs (the NCHW level
  tensors are built once, untimed). Skipped without torch or with --no-torch.
* cupy ms: a straightforward CuPy version (dense over every (point, camera, scale), fancy-index
  gathers, ``cupyx.scatter_add`` for the feature cotangent), timed with fewer repetitions.
* ratio: torch ms / call ms (cupy ms / call ms when torch is missing).
* min MB: locations and weights read, the feature rows the samples touch read once, outputs
  written (for the VJP also the cotangent read and the dense feature cotangent written);
  GB/s = min MB / time; of copy BW: against the device-to-device copy bandwidth of the same run.
* check: max |ours - baseline| / max |baseline| over the stage's outputs, against the CuPy
  version (same "sparse4d" boundary) and, for torch, ours with boundary="zeros" (grid_sample's
  semantics). "MISMATCH" above --tol.

Exit status: 0, or 1 when a check reports MISMATCH or an op raised. Without a GPU the script
says so and exits 0.
"""
from __future__ import annotations

import os
import sys

import numpy as np

import cutopo
from cutopo.deformable import deformable_aggregation

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _bench_common import (check_cell, device_and_bandwidth, fmt_ms, make_parser,  # noqa: E402
                           max_rel_error, print_header, print_report, print_row, run_cases,
                           target_dicts, time_call_and_graph, time_status, write_json)
from bench_ecc import time_gpu  # noqa: E402

F32 = np.float32
MAPS = ((64, 176), (32, 88), (16, 44), (8, 22))
TIME_TARGETS = {  # issue 5, H200, ms (call time)
    ("sparse4d bs6", "forward"): 0.85,
    ("sparse4d bs6", "VJP"): 3.2,
    ("sparse4d bs1", "forward"): 0.15,
}
REFERENCE_MS = {  # the reference CUDA op on the H200 (issue 5), for orientation
    ("sparse4d bs1", "forward"): 0.62, ("sparse4d bs1", "VJP"): 2.23,
    ("sparse4d bs6", "forward"): 3.40, ("sparse4d bs6", "VJP"): 12.77,
}


class Case:
    def __init__(self, name, bs, A, P, maps=MAPS, K=6, C=256, G=8):
        self.name, self.bs, self.A, self.P, self.maps, self.K, self.C, self.G = name, bs, A, P, maps, K, C, G

    def inputs(self, cp, seed):
        rng = np.random.default_rng(seed)
        K, S = self.K, len(self.maps)
        shapes = np.array([self.maps] * K, dtype=np.int64)
        pix = shapes[..., 0] * shapes[..., 1]
        starts = (np.arange(K)[:, None] * pix.sum(1)[:, None] + np.cumsum(pix, 1) - pix).astype(np.int64)
        num_feat = int(pix.sum())
        crng = cp.random.default_rng(seed)
        feats = crng.standard_normal((self.bs, num_feat, self.C), dtype=F32)
        n = self.bs * self.A * self.P
        loc = rng.choice(np.array([-0.5, 1.5], dtype=F32), size=(n, K, 2))
        first = rng.integers(0, K, n)
        loc[np.arange(n), first] = rng.random((n, 2), dtype=F32) * F32(0.998) + F32(0.001)
        two = np.flatnonzero(rng.random(n) < 0.2)
        second = (first[two] + rng.integers(1, K, two.size)) % K
        loc[two, second] = rng.random((two.size, 2), dtype=F32) * F32(0.998) + F32(0.001)
        loc = cp.asarray(loc.reshape(self.bs, self.A, self.P, K, 2))
        logits = crng.standard_normal((self.bs, self.A, self.P * K * S, self.G), dtype=F32)
        w = cp.exp(logits - logits.max(axis=2, keepdims=True))
        w /= w.sum(axis=2, keepdims=True)
        w = cp.ascontiguousarray(w.reshape(self.bs, self.A, self.P, K, S, self.G))
        return feats, shapes, starts, loc, w

    def describe(self, args):
        feats, shapes, starts, loc, w = args
        return (f"bs {self.bs}, A {self.A}, P {self.P}, K {self.K}, maps {list(map(tuple, self.maps))}, "
                f"C {self.C}, G {self.G}; features {feats.nbytes / 1e6:.0f} MB, weights {w.nbytes / 1e6:.1f} MB")


def cases(quick):
    if quick:
        small = tuple((h // 4, w // 4) for h, w in MAPS)
        return [Case("quick bs1", 1, 100, 13, small), Case("quick bs2", 2, 100, 13, small)]
    return [Case("sparse4d bs1", 1, 900, 13), Case("sparse4d bs6", 6, 900, 13),
            Case("sparse4d A1220 bs6", 6, 1220, 13), Case("sparsedrive map bs12", 12, 100, 300)]


# ---------------------------------------------------------------------------------------------
# Minimum bytes


def touched_rows(cp, args):
    """Number of distinct feature rows (b, row) that some visible sample reads."""
    feats, shapes, starts, loc, w = args
    out, pb = cutopo.vjp(deformable_aggregation, feats, shapes, starts, loc, w, wrt="features")
    d = pb(cp.ones_like(out))[0]
    return int(cp.count_nonzero(cp.any(d != 0, axis=2)))


def min_bytes(cp, args, case):
    feats, shapes, starts, loc, w = args
    rows = touched_rows(cp, args)
    out_b = case.bs * case.A * case.C * 4
    fwd = loc.nbytes + w.nbytes + rows * case.C * 4 + out_b
    bwd = loc.nbytes + w.nbytes + rows * case.C * 4 + out_b + feats.nbytes + loc.nbytes + w.nbytes
    return {"forward": fwd, "VJP": bwd, "forward+VJP": fwd + bwd}


# ---------------------------------------------------------------------------------------------
# Straightforward CuPy version ("sparse4d" boundary), dense over every (point, camera, scale)


def _cupy_samples(cp, shapes, starts, l):
    """Per corner: (rows (.., K, S) int64, weight (.., K, S) float32 with 0 where not read,
    (dy, dx), read mask)."""
    H = cp.asarray(shapes[..., 0].astype(F32))
    W = cp.asarray(shapes[..., 1].astype(F32))
    Hi, Wi = cp.asarray(shapes[..., 0]), cp.asarray(shapes[..., 1])
    st = cp.asarray(starts)
    u, v = l[..., 0:1], l[..., 1:2]                   # (.., K, 1)
    vis = (u > 0) & (u < 1) & (v > 0) & (v < 1)
    x, y = u * W - F32(0.5), v * H - F32(0.5)         # (.., K, S)
    x0, y0 = cp.floor(x), cp.floor(y)
    lx, ly = x - x0, y - y0
    x0, y0 = x0.astype(cp.int64), y0.astype(cp.int64)
    out = []
    for dy, dx, wc in ((0, 0, (1 - ly) * (1 - lx)), (0, 1, (1 - ly) * lx), (1, 0, ly * (1 - lx)), (1, 1, ly * lx)):
        cy, cx = y0 + dy, x0 + dx
        ok = vis & (cy >= 0) & (cy < Hi) & (cx >= 0) & (cx < Wi)
        rows = st + cp.clip(cy, 0, Hi - 1) * Wi + cp.clip(cx, 0, Wi - 1)
        out.append((rows, cp.where(ok, wc, F32(0)), (dy, dx), ok))
    return out, (lx, ly, W, H)


def cupy_forward(cp, feats, shapes, starts, loc, w, chunk=32):
    bs, nf, C = feats.shape
    A, G = loc.shape[1], w.shape[-1]
    out = cp.zeros((bs, A, C), dtype=F32)
    b_idx = cp.arange(bs).reshape(bs, 1, 1, 1, 1)
    for a0 in range(0, A, chunk):
        l, wt = loc[:, a0:a0 + chunk], w[:, a0:a0 + chunk]
        corners, _ = _cupy_samples(cp, shapes, starts, l)
        acc = 0
        for rows, wc, _, _ in corners:
            vals = feats[b_idx, rows]                                   # (bs, n, P, K, S, C)
            coef = (wc[..., None] * wt)[..., None]                      # (bs, n, P, K, S, G, 1)
            acc = acc + (vals.reshape(vals.shape[:-1] + (G, C // G)) * coef).sum(axis=(2, 3, 4))
        out[:, a0:a0 + chunk] = acc.reshape(acc.shape[:2] + (C,))
    return out


def cupy_vjp(cp, feats, shapes, starts, loc, w, g, chunk=32):
    import cupyx

    bs, nf, C = feats.shape
    A, G = loc.shape[1], w.shape[-1]
    d_feat = cp.zeros_like(feats)
    d_loc = cp.zeros_like(loc)
    d_w = cp.zeros_like(w)
    b_idx = cp.arange(bs).reshape(bs, 1, 1, 1, 1)
    for a0 in range(0, A, chunk):
        l, wt = loc[:, a0:a0 + chunk], w[:, a0:a0 + chunk]
        gg = g[:, a0:a0 + chunk].reshape(bs, -1, 1, 1, 1, G, C // G)
        corners, (lx, ly, W, H) = _cupy_samples(cp, shapes, starts, l)
        vals = {}
        for rows, wc, key, ok in corners:
            v = feats[b_idx, rows]
            # the read mask, not wc > 0: a corner with weight exactly 0 (x on a pixel centre)
            # still enters the location derivative
            vals[key] = v.reshape(v.shape[:-1] + (G, C // G)) * ok[..., None, None]
            contrib = (wc[..., None] * wt)[..., None] * gg              # (bs, n, P, K, S, G, CG)
            cupyx.scatter_add(d_feat, (cp.broadcast_to(b_idx, rows.shape), rows),
                              contrib.reshape(contrib.shape[:5] + (C,)))
        bil = sum(wc[..., None, None] * vals[key] for _, wc, key, _ in corners)
        d_w[:, a0:a0 + chunk] = (bil * gg).sum(axis=-1)
        tg = gg * wt[..., None]
        v00, v01, v10, v11 = vals[(0, 0)], vals[(0, 1)], vals[(1, 0)], vals[(1, 1)]
        ddx = (1 - ly)[..., None, None] * (v01 - v00) + ly[..., None, None] * (v11 - v10)
        ddy = (1 - lx)[..., None, None] * (v10 - v00) + lx[..., None, None] * (v11 - v01)
        d_loc[:, a0:a0 + chunk, ..., 0] = ((tg * ddx).sum(axis=(-1, -2)) * W).sum(axis=-1)
        d_loc[:, a0:a0 + chunk, ..., 1] = ((tg * ddy).sum(axis=(-1, -2)) * H).sum(axis=-1)
    return d_feat, d_loc, d_w


# ---------------------------------------------------------------------------------------------
# PyTorch grid_sample formulation (the reference's fallback; zero-padding semantics)


def torch_setup(cp, args):
    import torch

    feats, shapes, starts, loc, w = args
    bs, nf, C = feats.shape
    K, S = shapes.shape[:2]
    t = torch.from_dlpack(feats)
    levels = []
    for s in range(S):
        H, W = (int(n) for n in shapes[0, s])
        lv = torch.stack([t[:, int(starts[k, s]):int(starts[k, s]) + H * W] for k in range(K)], 1)
        levels.append(lv.reshape(bs * K, H, W, C).permute(0, 3, 1, 2).contiguous())
    return levels, torch.from_dlpack(loc), torch.from_dlpack(w)


def torch_forward(levels, loc, w):
    import torch
    import torch.nn.functional as F

    bs, A, P, K, _ = loc.shape
    S, G = w.shape[4], w.shape[5]
    C = levels[0].shape[1]
    grid = (2 * loc - 1).permute(0, 3, 1, 2, 4).reshape(bs * K, A, P, 2)
    sampled = torch.stack([F.grid_sample(lv, grid, mode="bilinear", padding_mode="zeros", align_corners=False)
                           for lv in levels], -1)                           # (bs K, C, A, P, S)
    sampled = sampled.reshape(bs, K, G, C // G, A, P, S)
    return torch.einsum("bkgcaps,bapksg->bagc", sampled, w).reshape(bs, A, C)


def torch_levels_to_flat(cp, grads, shapes, starts, bs, nf):
    """The level gradients (bs K, C, H, W) as a (bs, num_feat, C) CuPy array."""
    K, S = shapes.shape[:2]
    C = grads[0].shape[1]
    flat = cp.zeros((bs, nf, C), dtype=F32)
    for s, gl in enumerate(grads):
        H, W = (int(n) for n in shapes[0, s])
        gc = cp.from_dlpack(gl.permute(0, 2, 3, 1).contiguous()).reshape(bs, K, H * W, C)
        for k in range(K):
            flat[:, int(starts[k, s]):int(starts[k, s]) + H * W] = gc[:, k]
    return flat


def time_torch(fn, reps, setup=None):
    import torch

    for _ in range(2):
        fn(setup()) if setup else fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        state = setup() if setup else None
        torch.cuda.synchronize()
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn() if state is None else fn(state)
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return float(np.median(times))


# ---------------------------------------------------------------------------------------------


def run_case(cp, case, args, bw, rows, notes, failures, have_torch):
    seed = sum(map(ord, case.name))
    op_args = case.inputs(cp, seed)
    feats, shapes, starts, loc, w = op_args
    kw = {"deterministic": args.deterministic}
    notes.append(f"{case.name}: {case.describe(op_args)}")
    in_mb = sum(a.nbytes for a in (feats, loc, w)) / 1e6
    reps = args.reps or 30
    g = cp.asarray(np.random.default_rng(seed + 1).standard_normal((case.bs, case.A, case.C)).astype(F32))

    out, pullback = cutopo.vjp(deformable_aggregation, *op_args, **kw)
    cots = pullback(g)
    nbytes = min_bytes(cp, op_args, case)
    stages = {"forward": lambda: deformable_aggregation(*op_args, **kw),
              "VJP": lambda: pullback(g),
              "forward+VJP": lambda: cutopo.vjp(deformable_aggregation, *op_args, **kw)[1](g)}

    checks = {"forward": [], "VJP": []}
    base_ms, torch_ms = {}, {}
    if not args.no_baseline:
        b = args.baseline_reps
        base_out = cupy_forward(cp, *op_args)
        checks["forward"].append((max_rel_error(cp, out, base_out), "out vs cupy"))
        del base_out
        base_cots = cupy_vjp(cp, *op_args, g)
        for name, o, bc in zip(("d_features", "d_locations", "d_weights"), (cots[0], cots[3], cots[4]), base_cots):
            checks["VJP"].append((max_rel_error(cp, o, bc), f"{name} vs cupy"))
        del base_cots
        base_ms = {"forward": time_gpu(cp, lambda: cupy_forward(cp, *op_args), b, warmup=1),
                   "VJP": time_gpu(cp, lambda: cupy_vjp(cp, *op_args, g), b, warmup=1)}
        base_ms["forward+VJP"] = base_ms["forward"] + base_ms["VJP"]
        cp.get_default_memory_pool().free_all_blocks()
    if have_torch:
        import torch

        levels, tl, tw = torch_setup(cp, op_args)
        tg = torch.from_dlpack(g)
        zout, zpb = cutopo.vjp(deformable_aggregation, *op_args, boundary="zeros")
        zc = zpb(g)

        def leaves():
            ls = [lv.detach().requires_grad_(True) for lv in levels]
            return ls, tl.detach().requires_grad_(True), tw.detach().requires_grad_(True)

        ls, l_, w_ = leaves()
        t_out = torch_forward(ls, l_, w_)
        t_out.backward(tg)
        checks["forward"].append((max_rel_error(cp, zout, cp.from_dlpack(t_out.detach())), "out vs torch (zeros)"))
        t_df = torch_levels_to_flat(cp, [x.grad for x in ls], shapes, starts, case.bs, feats.shape[1])
        for name, o, t in (("d_features", zc[0], t_df), ("d_locations", zc[3], cp.from_dlpack(l_.grad)),
                           ("d_weights", zc[4], cp.from_dlpack(w_.grad))):
            checks["VJP"].append((max_rel_error(cp, o, t), f"{name} vs torch (zeros)"))
        del t_out, ls, l_, w_, t_df, zout, zpb, zc

        def fwd_state():
            lv, l2, w2 = leaves()
            return torch_forward(lv, l2, w2)

        with torch.no_grad():
            torch_ms["forward"] = time_torch(lambda: torch_forward(levels, tl, tw), reps)
        torch_ms["VJP"] = time_torch(lambda o: o.backward(tg), reps, setup=fwd_state)
        torch_ms["forward+VJP"] = time_torch(lambda: fwd_state().backward(tg), reps)
        del levels, tl, tw
        torch.cuda.empty_cache()

    for stage in ("forward", "VJP", "forward+VJP"):
        fn = stages[stage]
        call_ms, gpu_ms, ms_bw = time_call_and_graph(cp, fn, reps, notes, f"{case.name} {stage}")
        gbs = nbytes[stage] / ms_bw / 1e6
        tms, bms = torch_ms.get(stage), base_ms.get(stage)
        ratio = (tms or bms) / call_ms if (tms or bms) else None
        parts = checks["forward"] + checks["VJP"] if stage == "forward+VJP" else checks[stage]
        chk = check_cell(f"{case.name} {stage}", parts, args.tol, failures) if parts else "n/a"
        rows.append({"case": case.name, "stage": stage, "in_mb": in_mb, "call_ms": call_ms, "gpu_ms": gpu_ms,
                     "torch_ms": tms, "cupy_ms": bms, "ratio": ratio, "min_mb": nbytes[stage] / 1e6,
                     "gbs": gbs, "copy_bw_fraction": gbs / bw, "check": chk,
                     "reference_ms": REFERENCE_MS.get((case.name, stage))})
        print_row((case.name, stage, f"{in_mb:.0f}", fmt_ms(call_ms), "no graph" if gpu_ms is None else fmt_ms(gpu_ms),
                   fmt_ms(tms, 3), fmt_ms(bms, 2), f"{ratio:.1f}x" if ratio else "-", f"{nbytes[stage] / 1e6:.1f}",
                   f"{gbs:.0f}", f"{gbs / bw:.1%}", chk))
    for stage, parts in checks.items():
        for e, which in parts:
            notes.append(f"{case.name} {stage}: {which} max rel. difference {e:.2e}")


def target_rows(rows):
    by = {(r["case"], r["stage"]): r for r in rows}
    out = []
    for (name, stage), limit in TIME_TARGETS.items():
        r = by.get((name, stage))
        if r is None:
            continue
        call, gpu = r["call_ms"], r["gpu_ms"]
        ref = REFERENCE_MS.get((name, stage))
        ref_txt = f"; reference op {ref} ms ({ref / call:.1f}x slower)" if ref else ""
        out.append((f"{name} {stage} <= {limit} ms", f"call {fmt_ms(call)} ms, GPU {fmt_ms(gpu)} ms{ref_txt}",
                    time_status(call, gpu, limit)))
    return out


def run_gpu(args):
    import cupy as cp

    have_torch = False
    if not args.no_torch:
        try:
            import torch

            have_torch = torch.cuda.is_available()
        except ImportError:
            pass
    gpu_name, bw = device_and_bandwidth(cp)
    print(f"# GPU: {gpu_name}; device-to-device copy bandwidth {bw:.0f} GB/s (read + write); "
          f"torch baseline: {'yes' if have_torch else 'no'}; deterministic={args.deterministic}")
    header = ("case", "stage", "in MB", "call ms", "GPU ms", "torch ms", "cupy ms", "ratio", "min MB", "GB/s",
              "of copy BW", "check")
    print_header(header)
    rows, notes, failures = [], [], []
    run_cases(cp, cases(args.quick), header,
              lambda name: not args.only or any(o in name for o in args.only.split(",")),
              lambda case: run_case(cp, case, args, bw, rows, notes, failures, have_torch), failures)
    targets = target_rows(rows)
    print_report(notes, targets, failures, "Targets (issue 5; H200)", "(no target case ran)")
    if args.json:
        write_json(args.json, {"gpu": gpu_name, "copy_bw_gbs": bw, "rows": rows, "notes": notes, "failures": failures,
                               "targets": target_dicts(targets)})
    return 1 if failures else 0


def main(argv=None):
    p = make_parser(__doc__, quick="small sizes (smoke test)",
                    only="run the cases whose name contains this (comma-separated alternatives, e.g. bs1,bs6)",
                    json_file="write the rows, notes and targets to this file",
                    reps="timed repetitions per stage (default 30)",
                    baseline_reps="timed repetitions of the CuPy baseline",
                    no_baseline="skip the straightforward CuPy version")
    p.add_argument("--no-torch", action="store_true", help="skip the PyTorch grid_sample baseline")
    p.add_argument("--deterministic", action="store_true", help="time deterministic=True (sorted feature cotangent)")
    p.add_argument("--tol", type=float, default=1e-4, help="largest accepted max rel. difference (default 1e-4)")
    args = p.parse_args(argv)
    if not cutopo.gpu_available():
        print("bench_deformable: no CUDA device visible to CuPy; nothing to measure (run it on a GPU machine).")
        return 0
    return run_gpu(args)


if __name__ == "__main__":
    sys.exit(main())
