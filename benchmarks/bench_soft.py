"""Soft ECC, soft ECT and expected Euler benchmark: cutopo's GPU ops (forward, VJP) vs straightforward CuPy.

    python benchmarks/bench_soft.py [--quick] [--only NAME] [--json FILE] [--reps N]
                                    [--baseline-reps N] [--no-baseline] [--sigma S] [--tol X]

Cases (full run; --quick uses small sizes of the same kinds):

* soft_ecc 2d 1024^2, 2d 64x256^2 (batch) and 3d 256^3: float32 smooth random images (Gaussian-
  filtered noise, sigma --sigma pixels, normalised to [0, 1]), T = 256 thresholds
  linspace(0, 1), scale = 4 / threshold spacing, V construction.
* soft_ect 2d 512^2 D=256: a bool mask of a few random disks and blobs, D = 256 unit directions at
  evenly spread angles 2 pi (d + 1/2) / D (the half step keeps them off the axes and diagonals,
  where tied heights make the ownership, and so the direction cotangent, ambiguous), T = 128
  thresholds linspace(-1.5, 1.5), scale = 4 / spacing.
* expected_euler 2d 1024^2 and 3d 256^3: the same smooth images as probabilities.

Every case has three stages: ``forward`` (the op), ``VJP`` (the pullback alone, all
differentiable arguments, residuals from one earlier ``cutopo.vjp``) and ``forward+VJP``
(``cutopo.vjp`` then the pullback). The columns:

* call ms: median of CUDA-event timings of the whole call, Python overhead included (as
  bench_ecc.py does).
* GPU ms: median replay of a CUDA graph captured from one call: the device work alone. Ops that
  synchronise with the host (a device-to-host copy of a size or a value) cannot be captured;
  the column then says "no graph" and the footnote says why. GB/s then uses the call time.
* baseline ms: a straightforward CuPy version on the same run (below), CUDA-event timed with
  fewer repetitions. ratio: baseline / call.
* min MB: the bytes the op must at least read plus write (below); GB/s = min MB / time;
  of copy BW: GB/s against the device-to-device copy bandwidth measured in the same run
  (bench_ecc.copy_bandwidth: bytes read plus written by a 1 GiB copy).
* check: max |ours - baseline| over the stage's outputs, divided by the max of the same
  quantity computed with absolute values (|c|, |g|, |t - f|): for the curve that is sum |c|.
  "MISMATCH" when above --tol.

Minimum bytes (N pixels, B images, D directions, T thresholds, 4-byte floats, 1-byte mask):

* soft_ecc forward: image 4N + thresholds 4T read, curve 4BT written. VJP: image 4N,
  thresholds 4T and cotangent 4BT read; d_image 4N, d_thresholds 4T, d_scale 4 written.
  forward+VJP: the sum (two calls, each must read the image).
* soft_ect forward: mask N + directions 4D ndim + thresholds 4T read, transform 4BDT written.
  VJP: the same inputs and the cotangent 4BDT read; d_directions 4D ndim, d_thresholds 4T,
  d_scale 4 written.
* expected_euler forward: prob 4N read, 4B written. VJP: prob 4N and the cotangent 4B read,
  d_prob 4N written.

Baselines ("straightforward CuPy"): soft_ecc takes c = cutopo.euler_contributions(image) on the
GPU, keeps the pixels with c != 0 and evaluates the dense sigmoid over (those pixels x T) in
chunks of 2^26 entries: chi_k = sum_p c_p s(scale (t_k - f_p)); its VJP uses the dense formulas
d f_p = -scale c_p sum_k g_k s'(.), d t_k = scale sum_p c_p g_k s'(.),
d scale = sum c g (t - f) s'(.). soft_ect does the same per direction on the height image
where(mask, <x_p, v>, +inf) (positions as cutopo._ect.heights, float64), pixels outside the mask
dropped. expected_euler multiplies shifted slices for every cell type and corner (the NumPy
algorithm's formula, without its sub-box sharing).

Exit status: 0, or 1 when a check reports MISMATCH or an op raised. Without a GPU the script
says so and exits 0.
"""
from __future__ import annotations

import itertools
import math
import os
import sys

import numpy as np

import cutopo

# bench_ecc.py sits next to this file; its timing and copy-bandwidth helpers keep the two tables
# measured the same way. _bench_common.py holds what the op benchmarks share.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _bench_common import (check_cell, device_and_bandwidth, first_line, fmt_ms, make_parser,  # noqa: E402
                           max_rel_error, print_header, print_report, print_row, run_cases,
                           target_dicts, time_status, worst, write_json)
from bench_ecc import time_gpu, time_graph_or_none  # noqa: E402

CHUNK_ENTRIES = 1 << 26  # dense (pixel x threshold) entries per baseline chunk: ~256 MB per float32 temporary
RATIO_TARGET = 50.0       # issue: >= 50x the straightforward version (forward+VJP of its soft cases)
RATIO_TARGET_CASES = ("soft_ecc 2d 1024^2", "soft_ecc 2d 64x256^2", "soft_ecc 3d 256^3", "soft_ect 2d 512^2 D=256")
TIME_TARGETS = {          # issue: forward+VJP on the H200, ms
    "soft_ecc 2d 1024^2": 0.1,
    "soft_ect 2d 512^2 D=256": 0.3,
}
F32 = np.float32


# ---------------------------------------------------------------------------------------------
# Inputs (xp is cupy on the device; numpy works too, which is how the baselines were checked
# against cutopo's NumPy ops on a machine without a GPU)


def _ndimage(xp):
    if xp is np:
        import scipy.ndimage as ndi
    else:
        import cupyx.scipy.ndimage as ndi
    return ndi


def smooth_image(xp, shape, ndim, sigma, seed):
    """Gaussian-filtered noise over the spatial axes, normalised to [0, 1], float32.

    Smooth images have few critical pixels (c != 0) and a realistic spread of values per
    threshold band; white noise would make almost every pixel critical.
    """
    noise = xp.asarray(np.random.default_rng(seed).standard_normal(shape, dtype=F32))
    sig = (0.0,) * (len(shape) - ndim) + (sigma,) * ndim
    x = _ndimage(xp).gaussian_filter(noise, sig, mode="wrap")
    lo, hi = x.min(), x.max()
    return ((x - lo) / (hi - lo)).astype(F32)


def blob_mask(xp, n, seed):
    """A few random disks plus smooth blobs (thresholded filtered noise): curved, irregular
    boundaries, some holes, as a segmentation mask would have."""
    rng = np.random.default_rng(seed)
    i = xp.arange(n, dtype=F32)[:, None]
    j = xp.arange(n, dtype=F32)[None, :]
    mask = xp.zeros((n, n), dtype=bool)
    for _ in range(6):
        cy, cx = rng.uniform(0.15 * n, 0.85 * n, size=2)
        r = rng.uniform(0.05 * n, 0.14 * n)
        mask |= (i - cy) ** 2 + (j - cx) ** 2 <= r * r
    field = smooth_image(xp, (n, n), 2, n / 40.0, seed + 1)
    mask |= field > 0.72
    mask &= ~(smooth_image(xp, (n, n), 2, n / 100.0, seed + 2) > 0.8)  # holes
    return mask


def _sigmoid(xp, u):
    # The plain formula: exp(-u) overflows to inf for very negative u and gives 0, never NaN.
    return 1 / (1 + xp.exp(-u))


# ---------------------------------------------------------------------------------------------
# Straightforward baselines. ``absolute=True`` evaluates the same sums with |c|, |g| and
# |t - f| (every sign +): the scale against which the check measures the differences.


def _dense_forward(xp, f, cv, row, nrows, t, scale):
    """out[r, k] = sum over entries e with row[e] == r of cv[e] * sigmoid(scale (t_k - f[e]))."""
    T = t.size
    out = xp.zeros((nrows, T), dtype=F32)
    step = max(1, CHUNK_ENTRIES // T)
    for a in range(0, f.size, step):
        s = _sigmoid(xp, scale * (t[None, :] - f[a:a + step, None]))
        if nrows == 1:
            out[0] += cv[a:a + step] @ s  # one image: a matrix-vector product (cuBLAS)
        else:
            xp.add.at(out, row[a:a + step], cv[a:a + step, None] * s)
    return out


def _dense_backward(xp, f, cv, row, g2, t, scale, absolute):
    """Per entry d f = -scale c sum_k g s'; d t_k = scale sum c g s'; d scale = sum c g (t - f) s'."""
    T = t.size
    d_f = xp.empty(f.size, dtype=F32)
    d_t = xp.zeros(T, dtype=F32)
    d_s = xp.zeros((), dtype=F32)
    step = max(1, CHUNK_ENTRIES // T)
    for a in range(0, f.size, step):
        diff = t[None, :] - f[a:a + step, None]
        s = _sigmoid(xp, scale * diff)
        gr = g2[0][None, :] if g2.shape[0] == 1 else g2[row[a:a + step]]
        w = gr * (s * (1 - s)) * cv[a:a + step, None]
        d_f[a:a + step] = (scale if absolute else -scale) * w.sum(axis=1)
        d_t += scale * w.sum(axis=0)
        d_s += (w * (xp.abs(diff) if absolute else diff)).sum()
    return d_f, d_t, d_s


class SoftEcc:
    op_name = "soft_ecc"

    def __init__(self, name, shape, ndim, T):
        self.name, self.shape, self.ndim, self.T = name, shape, ndim, T

    def inputs(self, xp, sigma, seed):
        image = smooth_image(xp, self.shape, self.ndim, sigma, seed)
        t = xp.asarray(np.linspace(0, 1, self.T).astype(F32))
        scale = 4.0 / (1.0 / (self.T - 1))  # the sigmoid spans a few threshold spacings
        return (image, t, scale), {"ndim": self.ndim}

    def describe(self, xp, args):
        image, t, scale = args
        c = cutopo.euler_contributions(image, ndim=self.ndim)
        nz = int(xp.count_nonzero(c))
        return (f"T={self.T} thresholds linspace(0, 1), spacing {1 / (self.T - 1):.5f}, scale {scale:g} "
                f"(4 / spacing); {nz / c.size:.2%} of pixels have c != 0, sum|c| = {int(xp.abs(c.astype(np.int32)).sum())}")

    def min_bytes(self, args, out_size):
        image, t, _ = args
        fwd = image.nbytes + t.nbytes + 4 * out_size
        bwd = image.nbytes + t.nbytes + 4 * out_size + image.nbytes + t.nbytes + 4
        return {"forward": fwd, "VJP": bwd, "forward+VJP": fwd + bwd}

    def device_stages(self, cp, args, kw, g):
        """The op's device work alone: the kernels called directly, without the argument checks
        (the host's read of the CuPy thresholds' check keeps the op itself out of a CUDA graph)."""
        from cutopo import _soft_ecc_cupy
        from cutopo._band_numpy import band_halfwidth

        image, t, scale = args
        lam = t.dtype.type(scale)
        w = band_halfwidth(t.dtype, lam)

        def fwd():  # device thresholds, not checked (the check's read cannot be captured)
            return _soft_ecc_cupy.soft_ecc_forward(image, t, lam, w, self.ndim, False, keep=True)

        def bwd(kept):  # the forward's kept entries, as cutopo.vjp's pullback reads them
            return _soft_ecc_cupy.soft_ecc_backward(image, t, lam, w, self.ndim, False, g,
                                                    (True, True, True), t_dtype=t.dtype,
                                                    s_dtype=t.dtype, kept=kept)

        kept = fwd()[1]
        return {"forward": fwd, "VJP": lambda: bwd(kept), "forward+VJP": lambda: bwd(fwd()[1])}

    def baseline_forward(self, xp, image, t, scale, absolute=False):
        ndim = self.ndim
        batch = image.shape[:image.ndim - ndim]
        B = math.prod(batch)
        per_image = math.prod(image.shape[image.ndim - ndim:])
        c = cutopo.euler_contributions(image, ndim=ndim).reshape(-1)
        idx = xp.flatnonzero(c)
        cv = c[idx].astype(F32)
        if absolute:
            cv = xp.abs(cv)
        f = image.reshape(-1)[idx]
        row = idx // per_image
        out = _dense_forward(xp, f, cv, row, B, t, F32(scale))
        return out.reshape(batch + (t.size,)), (idx, cv, f, row, B)

    def baseline_backward(self, xp, res, g, image, t, scale, absolute=False):
        idx, cv, f, row, B = res
        g2 = g.reshape(B, t.size)
        if absolute:
            g2 = xp.abs(g2)
        d_f, d_t, d_s = _dense_backward(xp, f, cv, row, g2, t, F32(scale), absolute)
        d_image = xp.zeros(image.size, dtype=F32)
        d_image[idx] = d_f
        return d_image.reshape(image.shape), d_t, d_s


class SoftEct:
    op_name = "soft_ect"

    def __init__(self, name, n, D, T):
        self.name, self.n, self.D, self.T = name, n, D, T
        self.lo, self.hi = -1.5, 1.5

    def inputs(self, xp, sigma, seed):
        mask = blob_mask(xp, self.n, seed)
        angles = 2 * np.pi * (np.arange(self.D) + 0.5) / self.D
        directions = xp.asarray(np.stack([np.cos(angles), np.sin(angles)], axis=1).astype(F32))
        t = xp.asarray(np.linspace(self.lo, self.hi, self.T).astype(F32))
        scale = 4.0 / ((self.hi - self.lo) / (self.T - 1))
        return (mask, directions, t, scale), {}

    def describe(self, xp, args):
        mask, directions, t, scale = args
        _, res = self.baseline_forward(xp, *args)
        entries = res[0].size
        return (f"D={self.D} unit directions, T={self.T} thresholds linspace({self.lo}, {self.hi}), "
                f"scale {scale:g} (4 / spacing); mask {float(mask.mean()):.1%} foreground, "
                f"{entries / self.D:.0f} pixels with c != 0 per direction (mean)")

    def min_bytes(self, args, out_size):
        mask, directions, t, _ = args
        ins = mask.nbytes + 4 * directions.size + t.nbytes
        fwd = ins + 4 * out_size
        bwd = ins + 4 * out_size + 4 * directions.size + t.nbytes + 4
        return {"forward": fwd, "VJP": bwd, "forward+VJP": fwd + bwd}

    def device_stages(self, cp, args, kw, g):
        """The op's device work alone: SoftEctPlan's kernels called directly, the argument
        check's kernel included and the copy of its flags to the host not (that copy's event
        keeps the op itself out of a CUDA graph)."""
        from cutopo import _band_cupy
        from cutopo._band_numpy import band_halfwidth

        mask, directions, t, scale = args
        real = t.dtype
        lam = real.type(scale)
        w = band_halfwidth(real, lam)
        plan = _band_cupy.soft_ect_plan(mask.device.id, 1, mask.shape, self.D, self.T, real,
                                        directions.dtype)
        mask_b = mask.reshape((1,) + mask.shape)

        def fwd():
            workspace, dirs64, codes = plan.checked_arguments(t, directions)
            return plan.forward(mask_b, workspace, dirs64, codes, t, lam, w)

        def bwd(kept):
            return plan.backward(kept, t, g, lam, w, (True, True, True), real, real)

        kept = fwd()[1]
        return {"forward": fwd, "VJP": lambda: bwd(kept), "forward+VJP": lambda: bwd(fwd()[1])}

    def _coords(self, xp, spatial):
        from cutopo._ect import _axis_coordinates  # the op's own positions, so heights agree

        return [xp.asarray(c) for c in _axis_coordinates(spatial)]

    def baseline_forward(self, xp, mask, directions, t, scale, absolute=False):
        spatial = mask.shape
        ndim = len(spatial)
        N = math.prod(spatial)
        D = directions.shape[0]
        coords = self._coords(xp, spatial)
        v = directions.astype(np.float64)
        group = max(1, CHUNK_ENTRIES // N)  # directions per euler_contributions batch
        parts = []
        for d0 in range(0, D, group):
            vg = v[d0:d0 + group]
            # h = x_0 v_0 + x_1 v_1 (+ x_2 v_2) in float64, left to right, as cutopo._ect.heights.
            h = None
            for a in range(ndim):
                x = coords[a].reshape((1,) + (1,) * a + (-1,) + (1,) * (ndim - 1 - a))
                term = x * vg[:, a].reshape((-1,) + (1,) * ndim)
                h = term if h is None else h + term
            vals = xp.where(mask[None], h, np.inf)
            c = cutopo.euler_contributions(vals, ndim=ndim)
            c *= mask[None]  # +inf pixels never enter a sublevel set: their contributions go
            ent = xp.flatnonzero(c)
            parts.append((ent // N + d0, ent % N, c.reshape(-1)[ent], h.reshape(-1)[ent]))
        d_of = xp.concatenate([p[0] for p in parts])
        pix = xp.concatenate([p[1] for p in parts])
        cv = xp.concatenate([p[2] for p in parts]).astype(F32)
        if absolute:
            cv = xp.abs(cv)
        h = xp.concatenate([p[3] for p in parts]).astype(F32)
        out = _dense_forward(xp, h, cv, d_of, D, t, F32(scale))
        return out, (d_of, pix, cv, h)

    def baseline_backward(self, xp, res, g, mask, directions, t, scale, absolute=False):
        d_of, pix, cv, h = res
        D, ndim = directions.shape
        g2 = xp.abs(g) if absolute else g
        lam = F32(scale)
        # Per entry: sum_k g c s' (through the same helper: its d_f is -scale times that sum).
        d_h, d_t, d_s = _dense_backward(xp, h, cv, d_of, g2, t, lam, absolute)
        coords = self._coords(xp, mask.shape)
        idx = xp.unravel_index(pix, mask.shape)
        # d v_a = sum over entries of (d height) x_a(p): d h = -scale c sum_k g s'.
        d_v = xp.stack([xp.bincount(d_of, weights=(d_h.astype(np.float64) * (xp.abs(coords[a][idx[a]]) if absolute
                                                                             else coords[a][idx[a]])),
                                    minlength=D) for a in range(ndim)], axis=1)
        return None, d_v.astype(F32), d_t, d_s


class ExpectedEuler:
    op_name = "expected_euler"

    def __init__(self, name, shape):
        self.name, self.shape, self.ndim = name, shape, len(shape)

    def inputs(self, xp, sigma, seed):
        return (smooth_image(xp, self.shape, self.ndim, sigma, seed),), {}

    def describe(self, xp, args):
        return "probabilities: the smooth image in [0, 1], V construction"

    def min_bytes(self, args, out_size):
        (prob,) = args
        fwd = prob.nbytes + 4 * out_size
        bwd = prob.nbytes + 4 * out_size + prob.nbytes
        return {"forward": fwd, "VJP": bwd, "forward+VJP": fwd + bwd}

    @staticmethod
    def _corner(shape, ndim, S, delta):
        """Index of one corner (delta on the axes S) of every cell of box type S."""
        d = dict(zip(S, delta))
        return (Ellipsis,) + tuple(slice(d[a], shape[a] - 1 + d[a]) if a in d else slice(None)
                                   for a in range(ndim))

    def _cell_types(self):
        for k in range(self.ndim + 1):
            for S in itertools.combinations(range(self.ndim), k):
                yield S, (-1.0 if k % 2 else 1.0)

    def baseline_forward(self, xp, prob, absolute=False):
        spatial = prob.shape[prob.ndim - self.ndim:]
        total = xp.zeros(prob.shape[:prob.ndim - self.ndim], dtype=np.float64)
        for S, sign in self._cell_types():
            cells = None
            for delta in itertools.product((0, 1), repeat=len(S)):
                x = prob[self._corner(spatial, self.ndim, S, delta)]
                cells = x if cells is None else cells * x
            s = cells.sum(axis=tuple(range(-self.ndim, 0)), dtype=np.float64)
            total += s if absolute else sign * s
        return total.astype(F32), None

    def baseline_backward(self, xp, res, g, prob, absolute=False):
        spatial = prob.shape[prob.ndim - self.ndim:]
        grad = xp.zeros_like(prob)
        for S, sign in self._cell_types():
            corners = list(itertools.product((0, 1), repeat=len(S)))
            for delta in corners:
                other = None  # product of the cell's other corners: the derivative of its box product
                for eps in corners:
                    if eps != delta:
                        x = prob[self._corner(spatial, self.ndim, S, eps)]
                        other = x if other is None else other * x
                view = grad[self._corner(spatial, self.ndim, S, delta)]
                if other is None:
                    view += 1.0 if absolute else sign
                elif absolute or sign > 0:
                    view += other
                else:
                    view -= other
        gg = xp.abs(g) if absolute else g
        return (grad * gg.reshape(gg.shape + (1,) * self.ndim).astype(F32),)


def cases(quick):
    if quick:
        return [SoftEcc("soft_ecc 2d 256^2", (256, 256), 2, 256),
                SoftEcc("soft_ecc 2d 8x128^2", (8, 128, 128), 2, 256),
                SoftEcc("soft_ecc 3d 64^3", (64, 64, 64), 3, 256),
                SoftEct("soft_ect 2d 128^2 D=32", 128, 32, 128),
                ExpectedEuler("expected_euler 2d 256^2", (256, 256)),
                ExpectedEuler("expected_euler 3d 64^3", (64, 64, 64))]
    return [SoftEcc("soft_ecc 2d 1024^2", (1024, 1024), 2, 256),
            SoftEcc("soft_ecc 2d 64x256^2", (64, 256, 256), 2, 256),
            SoftEcc("soft_ecc 3d 256^3", (256, 256, 256), 3, 256),
            SoftEct("soft_ect 2d 512^2 D=256", 512, 256, 128),
            ExpectedEuler("expected_euler 2d 1024^2", (1024, 1024)),
            ExpectedEuler("expected_euler 3d 256^3", (256, 256, 256))]


# ---------------------------------------------------------------------------------------------
# Timing


def _as_list(x):
    return list(x) if isinstance(x, tuple) else [x]


# ---------------------------------------------------------------------------------------------
# One case


def run_case(cp, case, args, bw, rows, notes, failures):
    xp = cp
    op = getattr(cutopo, case.op_name)
    seed = sum(map(ord, case.name))  # fixed per case, so runs are comparable
    op_args, kw = case.inputs(xp, args.sigma, seed)
    notes.append(f"{case.name}: {case.describe(xp, op_args)}")
    reps = args.reps or (50 if op_args[0].nbytes < 2e8 else 20)
    in_mb = sum(getattr(a, "nbytes", 0) for a in op_args) / 1e6

    # Ours: one vjp for the outputs, the checks and the pullback's residuals.
    ours_error = None
    try:
        out, pullback = cutopo.vjp(op, *op_args, **kw)
        g = xp.asarray(np.random.default_rng(seed + 1).standard_normal(out.shape).astype(F32))
        cots = pullback(g)
    except Exception as exc:
        ours_error = first_line(exc, 120)
        failures.append(f"{case.name}: {ours_error}")
        out, g, cots = None, None, None
    if g is None:  # the cotangent the baseline needs: its own output's shape
        base_out, _ = case.baseline_forward(xp, *op_args)
        g = xp.asarray(np.random.default_rng(seed + 1).standard_normal(base_out.shape).astype(F32))
    out_size = int(g.size)
    nbytes = case.min_bytes(op_args, out_size)

    stages = {}
    if ours_error is None:
        stages = {
            "forward": lambda: op(*op_args, **kw),
            "VJP": lambda: pullback(g),
            "forward+VJP": lambda: cutopo.vjp(op, *op_args, **kw)[1](g),
        }

    # Baseline: timed, and the reference for the checks.
    base_ms = {}
    check = {"forward": None, "VJP": None}
    if not args.no_baseline:
        fwd = lambda: case.baseline_forward(xp, *op_args)  # noqa: E731
        base_out, res = fwd()
        bwd = lambda: case.baseline_backward(xp, res, g, *op_args)  # noqa: E731
        both = lambda: case.baseline_backward(xp, fwd()[1], g, *op_args)  # noqa: E731
        b = args.baseline_reps
        base_ms = {"forward": time_gpu(cp, fwd, b, warmup=1), "VJP": time_gpu(cp, bwd, b, warmup=1),
                   "forward+VJP": time_gpu(cp, both, b, warmup=1)}
        if ours_error is None:
            base_cots = _as_list(bwd())
            abs_out, abs_res = case.baseline_forward(xp, *op_args, absolute=True)
            abs_cots = _as_list(case.baseline_backward(xp, abs_res, g, *op_args, absolute=True))
            e_out = max_rel_error(xp, out, base_out, abs_out)
            check["forward"] = (e_out, "out")
            notes.append(f"{case.name}: output max rel. difference {e_out:.2e}")
            errors = []
            for name, o, bc, ab in zip(op.__cutopo_op__.arg_names, cots, base_cots, abs_cots):
                if bc is not None:  # an argument the baseline differentiates
                    errors.append((max_rel_error(xp, o, bc, ab), f"d_{name}"))
                    notes.append(f"{case.name}: {errors[-1][1]} max rel. difference {errors[-1][0]:.2e}")
            check["VJP"] = worst(errors)

    for stage in ("forward", "VJP", "forward+VJP"):
        call_ms = gpu_ms = None
        graph_note = ""
        if stage in stages:
            fn = stages[stage]
            call_ms = time_gpu(cp, fn, reps)
            gpu_ms, why = time_graph_or_none(cp, fn, reps)
            if why and hasattr(case, "device_stages"):
                kernels = case.device_stages(cp, op_args, kw, g)[stage]
                gpu_ms, why2 = time_graph_or_none(cp, kernels, reps)
                if why2 is None:
                    graph_note = fmt_ms(gpu_ms) + " k"
                    notes.append(f"{case.name} {stage}: the op itself cannot be captured ({why}); "
                                 "GPU ms (marked k) is a graph of its kernels called directly")
                else:
                    why = f"{why}; kernels: {why2}"
            if why and not graph_note:
                graph_note = "no graph"
                notes.append(f"{case.name} {stage}: no CUDA graph ({why}); GB/s from the call time")
        ms_bw = gpu_ms if gpu_ms is not None else call_ms
        gbs = nbytes[stage] / ms_bw / 1e6 if ms_bw else None
        bms = base_ms.get(stage)
        ratio = bms / call_ms if (bms and call_ms) else None
        parts = [check[s] for s in (("forward", "VJP") if stage == "forward+VJP" else (stage,))]
        if ours_error is not None:
            chk = "op failed"
        elif args.no_baseline or any(p is None for p in parts):
            chk = "n/a"
        else:
            chk = check_cell(f"{case.name} {stage}", parts, args.tol, failures)
        row = {"case": case.name, "stage": stage, "in_mb": in_mb,
               "call_ms": call_ms, "gpu_ms": gpu_ms, "graph": gpu_ms is not None,
               "baseline_ms": bms, "ratio": ratio, "min_mb": nbytes[stage] / 1e6,
               "gbs": gbs, "copy_bw_fraction": gbs / bw if gbs else None, "check": chk}
        rows.append(row)
        print_row((case.name, stage, f"{in_mb:.1f}", fmt_ms(call_ms),
                   graph_note or fmt_ms(gpu_ms), fmt_ms(bms, 3),
                   (f"{ratio:.1f}x" if ratio < 10 else f"{ratio:.0f}x") if ratio else "-",
                   f"{nbytes[stage] / 1e6:.2f}", f"{gbs:.0f}" if gbs else "-",
                   f"{gbs / bw:.1%}" if gbs else "-", chk))
        if ours_error is not None and stage == "forward":
            notes.append(f"{case.name}: op raised {ours_error}")


# ---------------------------------------------------------------------------------------------
# Targets


def target_rows(rows):
    """(target, measured, status) for every target case that ran; forward+VJP rows."""
    by = {(r["case"], r["stage"]): r for r in rows}
    out = []
    for name, limit in TIME_TARGETS.items():
        r = by.get((name, "forward+VJP"))
        if r is None:
            continue
        what = f"{name} forward+VJP <= {limit} ms"
        if r["call_ms"] is None:
            out.append((what, "-", "NOT MEASURED (op failed)"))
            continue
        call, gpu = r["call_ms"], r["gpu_ms"]
        out.append((what, f"call {fmt_ms(call)} ms, GPU {fmt_ms(gpu)} ms", time_status(call, gpu, limit)))
    for name in RATIO_TARGET_CASES:
        r = by.get((name, "forward+VJP"))
        if r is None:
            continue
        what = f"{name} >= {RATIO_TARGET:.0f}x the straightforward version"
        if r["ratio"] is None:
            out.append((what, "-", "NOT MEASURED (op failed)" if r["call_ms"] is None else "NOT MEASURED (no baseline)"))
            continue
        gpu_ratio = r["baseline_ms"] / r["gpu_ms"] if r["gpu_ms"] else None
        status = "MET" if r["ratio"] >= RATIO_TARGET else (
            "MISSED per call (MET on GPU time)" if gpu_ratio and gpu_ratio >= RATIO_TARGET else "MISSED")
        measured = f"{r['ratio']:.1f}x per call" + (f", {gpu_ratio:.1f}x on GPU time" if gpu_ratio else "")
        out.append((what, measured, status))
    return out


# ---------------------------------------------------------------------------------------------


def run_gpu(args):
    import cupy as cp

    gpu_name, bw = device_and_bandwidth(cp)
    print(f"# GPU: {gpu_name}; device-to-device copy bandwidth {bw:.0f} GB/s (read + write)")
    header = ("case", "stage", "in MB", "call ms", "GPU ms", "baseline ms", "ratio", "min MB",
              "GB/s", "of copy BW", "check")
    print_header(header)
    rows, notes, failures = [], [], []
    run_cases(cp, cases(args.quick), header, lambda name: not args.only or args.only in name,
              lambda case: run_case(cp, case, args, bw, rows, notes, failures), failures)
    targets = target_rows(rows)
    print_report(notes, targets, failures, "Targets (issue; H200)",
                 "(no target case ran" + (": --quick sizes differ from the targets' sizes)" if args.quick else ")"))
    if args.json:
        write_json(args.json, {"gpu": gpu_name, "copy_bw_gbs": bw, "sigma": args.sigma, "tol": args.tol,
                               "quick": args.quick, "rows": rows, "notes": notes,
                               "targets": target_dicts(targets), "failures": failures})
    return 1 if failures else 0


def main(argv=None):
    p = make_parser(__doc__, quick="small sizes of every case (smoke test)",
                    only="run the cases whose name contains this (e.g. soft_ect, 3d, 1024)",
                    json_file="also write the rows, notes and targets to this JSON file",
                    reps="timed repetitions of our ops (default 50, 20 above 200 MB)",
                    baseline_reps="timed repetitions of the baselines (default 3)",
                    no_baseline="skip the baselines (and so the checks)")
    p.add_argument("--sigma", type=float, default=2.0, help="Gaussian smoothing of the images, pixels (default 2)")
    p.add_argument("--tol", type=float, default=1e-5,
                   help="largest accepted relative difference to the baseline (default 1e-5)")
    args = p.parse_args(argv)
    if not cutopo.gpu_available():
        print("# no GPU: CuPy sees no CUDA device; nothing to benchmark (this script measures the GPU ops)")
        return 0
    return run_gpu(args)


if __name__ == "__main__":
    sys.exit(main())
