"""``cutopo register``: CPAB registration of two images, or of a bundled pair, with figures.

Hooked into :mod:`cutopo.cli` through its ``COMMANDS`` list. Reads 2-D images or 3-D stacks
with :func:`cutopo._io.read_image`, registers them with :func:`cutopo.cpab.register`, and
writes theta, the warped image and a figure (fixed, moving, warped, differences, the deformed
grid, the exact log-Jacobian map and the loss curve) to the output folder.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

from . import __version__

DEFAULT_OUT = "cutopo_out"
DEFAULT_TESS = 16
SAMPLE_SIZE = 128              # the bundled pair: skimage.data.camera() resized to 128 x 128
SAMPLE_MAX_SHIFT = 4.0         # its synthetic deformation moves pixels by at most this (pixels)

DESCRIPTION = """\
Register MOVING to FIXED with one CPAB transformation (cutopo.cpab.register): Adam on theta, the
vertex velocities of a continuous piecewise-affine field on a tessellation of the image box,
so that the backward warp warped(x) = MOVING(phi_theta(x)) matches FIXED. phi_theta is a
diffeomorphism for every theta: the map never folds.

Without paths: a bundled pair, skimage.data.camera() resized to 128x128 and a copy deformed by a
known CPAB transformation on the same tessellation; the recovery error is printed.

With FIXED MOVING (.png, .jpg, .tif, .tiff, .npy; two 2-D images or two 3-D stacks of the same
shape): RGB(A) images become grey. Both are rescaled together to [0, 1] (one affine map) for the
optimisation; warped.npy is mapped back to the input's intensities.

Writes to DIR: theta.npy (the parameters), warped.npy, and register.png (fixed, moving, warped,
loss curve, moving - fixed, warped - fixed, deformed grid, log-Jacobian map; middle slices of
3-D stacks).
"""

EPILOG = """\
conventions: coordinate k of a point is array axis k, in the unit box [0, 1]^K; pixel (i, j) of
an H x W image sits at ((i + 1/2) / H, (j + 1/2) / W). The deformed grid shows phi_theta(x): where
the output pixel x reads the moving image. The log-Jacobian map is log det D phi_theta, exact
(no differencing): > 0 where the moving image is read stretched out, < 0 where compressed.

exit status: 0 on success, 2 on a usage error or an unreadable or mismatched file.
"""


def _tess_shape(text: str):
    """``N`` or ``NxM`` / ``NxMxL``: cells per axis (N alone: the same on every axis)."""
    try:
        parts = tuple(int(p) for p in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N or NxM[xL] cells, got {text!r}") from None
    if not 1 <= len(parts) <= 3 or any(p < 1 for p in parts):
        raise argparse.ArgumentTypeError(f"expected N or NxM[xL] positive cell counts, got {text!r}")
    return parts


def add_register_parser(subparsers) -> argparse.ArgumentParser:
    from .cli import _finite_float, _positive_int

    p = subparsers.add_parser(
        "register", help="CPAB registration of two images (a bundled pair without paths)",
        description=DESCRIPTION, epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("paths", nargs="*", metavar="FIXED MOVING",
                   help="the fixed and the moving image: .png, .jpg, .tif, .tiff or .npy")
    g = p.add_argument_group("registration")
    g.add_argument("--tess", type=_tess_shape, default=None, metavar="N",
                   help=f"cells per axis: N, or NxM (2-D) / NxMxL (3-D); default {DEFAULT_TESS}")
    g.add_argument("--levels", type=_positive_int, default=1, metavar="L",
                   help="coarse-to-fine levels, each halving the cells (default 1)")
    g.add_argument("--loss", choices=("mse", "ncc"), default="mse",
                   help="mse, or ncc: local normalised cross-correlation (default mse)")
    g.add_argument("--steps", type=_positive_int, default=100, metavar="N",
                   help="Adam steps per level (default 100)")
    g.add_argument("--lr", type=_finite_float, default=0.005, help="Adam step size (default 0.005)")
    g.add_argument("--smoothness", type=_finite_float, default=3e-3, metavar="W",
                   help="weight of the field's Dirichlet energy, the integral of |grad v|^2, "
                        "which keeps the field smooth where the images say little (default "
                        "3e-3 for the MSE of images rescaled to [0, 1]; 0 turns it off)")
    g.add_argument("--n-steps", type=_positive_int, default=30, metavar="T",
                   help="integration steps of the transformation (default 30)")
    g.add_argument("--boundary", choices=("noslip", "slip", "none"), default="noslip",
                   help="velocity on the image border: zero (noslip, default), tangential only "
                        "(slip), free (none)")
    g.add_argument("--device", choices=("auto", "cpu", "gpu"), default="auto",
                   help="auto: the GPU when CuPy sees one, else NumPy (default auto)")
    o = p.add_argument_group("output")
    o.add_argument("--out", default=DEFAULT_OUT, metavar="DIR",
                   help=f"output folder (default {DEFAULT_OUT}/)")
    o.add_argument("--no-plot", action="store_true", help="do not write register.png")
    o.add_argument("--quiet", action="store_true", help="print nothing but errors; no progress bar")
    p.set_defaults(run=run_register)
    return p


# --------------------------------------------------------------------------------------------
# Inputs


def _read_pair(paths, note):
    from .cli import CLIError, _check_paths
    from ._io import read_image

    if len(paths) != 2:
        raise CLIError(f"expected two paths, FIXED and MOVING, got {len(paths)}")
    _check_paths(paths)
    images = []
    for path in paths:
        try:
            images.append(read_image(path, note=note))
        except Exception as exc:  # decoders raise many kinds: report, exit 2
            message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise CLIError(message if message.startswith(f"{path}:")
                           else f"{path}: cannot read ({message})") from None
    fixed, moving = images
    if fixed.shape != moving.shape:
        raise CLIError(f"FIXED {paths[0]} has shape {fixed.shape}, MOVING {paths[1]} "
                       f"{moving.shape}: they must agree")
    for path, image in zip(paths, images):
        if image.dtype.kind == "f" and not np.isfinite(image).all():
            raise CLIError(f"{path}: the image holds NaN or inf")
    return fixed, moving


def _rescale(fixed, moving):
    """Both images by one affine map onto [0, 1]; (fixed, moving, (lo, hi))."""
    from .cli import CLIError

    lo = float(min(fixed.min(), moving.min()))
    hi = float(max(fixed.max(), moving.max()))
    if not hi > lo:
        raise CLIError(f"both images are constant ({lo:g}): nothing to register")
    scale = lambda x: ((x.astype(np.float64) - lo) / (hi - lo)).astype(np.float32)  # noqa: E731
    return scale(fixed), scale(moving), (lo, hi)


def _sample_pair(tess, n_steps):
    """(fixed, moving, theta_true): the camera image and a copy deformed by a known theta."""
    from skimage import data
    from skimage.transform import resize

    from .cpab import transform_grid, transform_image

    fixed = resize(data.camera() / 255.0, (SAMPLE_SIZE, SAMPLE_SIZE), anti_aliasing=True)
    fixed = fixed.astype(np.float32)
    theta = tess.sample(1, length_scale=0.3, scale=0.05, rng=0)[0]
    # scale the field so that its largest pixel displacement is SAMPLE_MAX_SHIFT
    shape = fixed.shape
    zero = transform_grid(np.zeros_like(theta), tess, shape)
    shift = (transform_grid(theta, tess, shape, n_steps=n_steps) - zero) * np.array(shape)
    theta *= SAMPLE_MAX_SHIFT / np.sqrt((shift ** 2).sum(axis=-1)).max()
    # moving = fixed deformed by phi_{-theta}: the registration should find theta
    moving = transform_image(fixed[None, None], -theta.astype(np.float32), tess,
                             n_steps=n_steps)[0, 0]
    return fixed, moving, theta


# --------------------------------------------------------------------------------------------
# Figure


def _middle(x, ndim):
    """The middle slice along axis 0 of a 3-D array (2-D arrays unchanged)."""
    return x[x.shape[0] // 2] if ndim == 3 else x


def plot_registration(path, fixed, moving, result, title):
    """Write the 2 x 4 panel figure of a registration (middle slices of 3-D stacks)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from ._array import to_numpy

    ndim = fixed.ndim
    warped = to_numpy(result.warped)
    fig = Figure(figsize=(16, 8.4), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(2, 4)
    grey = dict(cmap="gray", vmin=0, vmax=1, interpolation="nearest")
    where = " (middle slice)" if ndim == 3 else ""
    for ax, image, name in zip(axes[0, :3], (fixed, moving, warped),
                               ("fixed", "moving", "warped (moving o phi)")):
        ax.imshow(_middle(image, ndim), **grey)
        ax.set_title(name + where)
    ax = axes[0, 3]
    ax.semilogy(np.arange(1, len(result.loss_history) + 1), np.abs(result.loss_history), lw=1.2)
    ax.set_xlabel("Adam step")
    ax.set_ylabel(f"|{result.loss} loss|")
    ax.set_title(f"loss: {result.loss_history[0]:.3g} -> {result.final_loss:.3g}")
    ax.grid(alpha=0.3, which="both")
    before, after = _middle(moving - fixed, ndim), _middle(warped - fixed, ndim)
    limit = float(max(np.abs(before).max(), np.abs(after).max(), 1e-12))
    for ax, diff, name in zip(axes[1, :2], (before, after), ("moving - fixed", "warped - fixed")):
        im = ax.imshow(diff, cmap="RdBu_r", vmin=-limit, vmax=limit, interpolation="nearest")
        ax.set_title(f"{name}{where}: RMS {np.sqrt((diff ** 2).mean()):.3g}")
        fig.colorbar(im, ax=ax, shrink=0.8)
    _plot_grid(axes[1, 2], fixed, to_numpy(result.phi), ndim)
    ax = axes[1, 3]
    log_det = _middle(to_numpy(result.log_jacobian), ndim)
    limit = float(max(np.abs(log_det).max(), 1e-12))
    im = ax.imshow(log_det, cmap="PuOr_r", vmin=-limit, vmax=limit, interpolation="nearest")
    ax.set_title(f"log det D phi{where} (exact)\nfolding fraction {result.folding_fraction:.3g}")
    fig.colorbar(im, ax=ax, shrink=0.8)
    for ax in list(axes[0, :3]) + list(axes[1, :3]) + [axes[1, 3]]:
        ax.set_xticks([])
        ax.set_yticks([])
    fig.suptitle(title)
    fig.savefig(path, dpi=100)


def _plot_grid(ax, fixed, phi, ndim, lines=24):
    """phi's image of a regular grid of lines, in pixel coordinates over the fixed image."""
    plane = _middle(phi, ndim)[..., -2:]              # in-plane components (rows, columns)
    shape = np.array(plane.shape[:2])
    pixels = plane * shape - 0.5                      # unit box -> pixel indices
    ax.imshow(_middle(fixed, ndim), cmap="gray", vmin=0, vmax=1, alpha=0.35,
              interpolation="nearest")
    for axis in (0, 1):
        step = max(1, int(shape[axis]) // lines)
        for i in range(0, int(shape[axis]), step):
            line = pixels[i] if axis == 0 else pixels[:, i]
            ax.plot(line[:, 1], line[:, 0], color="tab:red", lw=0.6)
    ax.set_xlim(-0.5, shape[1] - 0.5)
    ax.set_ylim(shape[0] - 0.5, -0.5)
    ax.set_title("deformed grid: phi(x)" + (" (middle slice)" if ndim == 3 else ""))


# --------------------------------------------------------------------------------------------
# The command


def run_register(args) -> int:
    from .cli import CLIError, _ensure_parent, _Reporter, _resolve_device
    from ._array import to_device, to_numpy
    from .cpab import Tessellation, register, transform_grid

    rep = _Reporter(args.quiet)
    device = _resolve_device(args.device)
    boundary = None if args.boundary == "none" else args.boundary
    note = (lambda message: None) if args.quiet else (
        lambda message: print(f"note: {message}", file=sys.stderr))
    theta_true = None
    if args.paths:
        fixed_raw, moving_raw = _read_pair(args.paths, note)
        fixed, moving, (lo, hi) = _rescale(fixed_raw, moving_raw)
        name = f"{args.paths[1]} -> {args.paths[0]}"
    else:
        lo, hi = 0.0, 1.0
    ndim = fixed.ndim if args.paths else 2
    cells = args.tess or (DEFAULT_TESS,)
    if len(cells) == 1:
        cells = cells * ndim
    if len(cells) != ndim:
        raise CLIError(f"--tess {'x'.join(map(str, cells))} has {len(cells)} axes, the images "
                       f"{ndim}")
    try:
        tess = Tessellation(cells, zero_boundary=boundary)
    except ValueError as exc:
        raise CLIError(f"--tess: {exc}") from None
    if not args.paths:
        fixed, moving, theta_true = _sample_pair(tess, args.n_steps)
        name = f"bundled pair: camera {SAMPLE_SIZE}x{SAMPLE_SIZE} and a CPAB-deformed copy"
    rep.say(f"cutopo {__version__}: CPAB registration, {name}")
    rep.say(f"images {'x'.join(map(str, fixed.shape))}, tess {'x'.join(map(str, cells))} "
            f"({tess.n_params} parameters, {args.boundary}), loss {args.loss}, levels "
            f"{args.levels}, {args.steps} steps/level, lr {args.lr:g}, device {device}")
    started = time.perf_counter()
    try:
        result = register(to_device(fixed, device), to_device(moving, device), tess,
                          loss=args.loss, steps=args.steps, lr=args.lr, levels=args.levels,
                          n_steps=args.n_steps, smoothness=args.smoothness,
                          progress=not args.quiet)
    except ValueError as exc:
        raise CLIError(str(exc)) from None
    seconds = time.perf_counter() - started
    log_det = to_numpy(result.log_jacobian)
    rep.say(f"loss {result.loss_history[0]:.4g} -> {result.final_loss:.4g} in "
            f"{sum(result.level_steps)} steps, {result.seconds:.2f} s ({seconds:.2f} s with "
            f"diagnostics)")
    rep.say(f"folding fraction (central differences) {result.folding_fraction:.3g}; exact log "
            f"det D phi in [{log_det.min():.3g}, {log_det.max():.3g}]")
    if theta_true is not None:
        shape = np.array(fixed.shape)
        phi_true = transform_grid(theta_true, tess, fixed.shape, n_steps=result.n_steps)
        error = np.sqrt((((to_numpy(result.phi) - phi_true) * shape) ** 2).sum(axis=-1))
        shift = np.sqrt((((phi_true - transform_grid(np.zeros_like(theta_true), tess,
                                                     fixed.shape)) * shape) ** 2).sum(axis=-1))
        rep.say(f"recovery: |phi - phi_true| median {np.median(error):.3g} px, mean "
                f"{error.mean():.3g} px (true displacement: mean {shift.mean():.3g} px, max "
                f"{shift.max():.3g} px; flat regions such as the sky do not constrain phi)")

    os.makedirs(args.out, exist_ok=True)
    theta_path = os.path.join(args.out, "theta.npy")
    warped_path = os.path.join(args.out, "warped.npy")
    np.save(theta_path, to_numpy(result.theta))
    np.save(warped_path, to_numpy(result.warped).astype(np.float64) * (hi - lo) + lo)
    rep.say(f"wrote {theta_path}")
    rep.say(f"wrote {warped_path}")
    if not args.no_plot:
        png = os.path.join(args.out, "register.png")
        _ensure_parent(png)
        plot_registration(png, fixed, moving, result,
                          f"CPAB registration, tess {'x'.join(map(str, cells))}: {name}")
        rep.say(f"wrote {png}")
    return 0
