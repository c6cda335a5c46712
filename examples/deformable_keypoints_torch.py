"""Recover sampling points of a multi-camera deformable aggregation by gradient descent in PyTorch.

The Sparse4D operator (``cutopo.torch.deformable_aggregation``) sums, for every anchor, weighted
bilinear samples of every camera's feature maps at its points' projections. Here two cameras
with two scales each hold smooth random features; a target output is aggregated at hidden
point locations, and the locations, started about two pixels off, are learnt with
``torch.optim.Adam`` so that the aggregation matches the target: the gradient reaches them
through cutopo's VJP in the sampling locations (the derivative of the bilinear interpolation,
per camera and scale). Runs on the GPU when PyTorch and CuPy see one, else on the CPU in a
few seconds; prints progress and the location errors in pixels, and writes
``deformable_keypoints_torch.png`` to the folder given as argv[1] (default: here).

    python examples/deformable_keypoints_torch.py [OUT_DIR] [--steps N]
"""
import os
import sys

import numpy as np
import torch
from scipy import ndimage

import cutopo
import cutopo.torch as ct

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # _common.py, from any working directory
from _common import loss_panel, parse_cli, reporting, subplots, write_figure  # noqa: E402

K, C, G = 2, 16, 4                 # cameras, channels, channel groups
SHAPES = [(32, 48), (16, 24)]      # (H, W) of the two scales, the same for both cameras
A, P = 24, 1                       # anchors, points per anchor


def feature_maps(rng):
    """Smooth random fields (K, S) of (C, H, W) (features vary over a few pixels, so that
    the samples move smoothly with the points), flattened as the operator takes them:
    (features (1, rows, C) channels last, spatial_shapes (K, S, 2), level_start_index (K, S)),
    rows camera-major."""
    maps, shapes, starts, row = [], [], [], 0
    for k in range(K):
        for H, W in SHAPES:
            noise = rng.standard_normal((C, H, W))
            field = ndimage.gaussian_filter(noise, (0, 2.0 * H / SHAPES[0][0], 2.0 * W / SHAPES[0][1]))
            maps.append(4.0 * field.reshape(C, H * W).T)
            shapes.append((H, W))
            starts.append(row)
            row += H * W
    features = np.concatenate(maps)[None]
    return (features, np.array(shapes, dtype=np.int64).reshape(K, len(SHAPES), 2),
            np.array(starts, dtype=np.int64).reshape(K, len(SHAPES)))


def pixel_errors(loc, truth):
    """Distances in pixels of the finest map between two location arrays (.., 2), flat."""
    H, W = SHAPES[0]
    d = (loc - truth) * np.array([W, H])
    return np.sqrt((d ** 2).sum(axis=-1)).ravel()


def summary(errors):
    return f"median {np.median(errors):.2f} px, {np.mean(errors < 0.5):.0%} within 0.5 px"


def main(out_dir=".", steps=200):
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    device = "cuda" if torch.cuda.is_available() and cutopo.gpu_available() else "cpu"
    as_tensor = lambda a: torch.tensor(a, dtype=torch.float32, device=device)  # noqa: E731
    features, shapes, starts = feature_maps(rng)
    maps = (as_tensor(features), torch.tensor(shapes), torch.tensor(starts))
    truth = rng.uniform(0.2, 0.8, (1, A, P, K, 2))
    start = truth + rng.normal(0.0, 0.035, truth.shape)              # about 2 pixels off
    weights = as_tensor(rng.uniform(0.2, 1.0, (1, A, P, K, len(SHAPES), G)) / (P * K))
    target = ct.deformable_aggregation(*maps, as_tensor(truth), weights)

    loc = as_tensor(start).requires_grad_(True)
    optimiser = torch.optim.Adam([loc], lr=4e-3)
    history = []
    for step in range(1, steps + 1):
        out = ct.deformable_aggregation(*maps, loc, weights)
        loss = torch.mean((out - target) ** 2)
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
        history.append(loss.item())
        if reporting(step, steps):
            errors = pixel_errors(loc.detach().cpu().numpy(), truth)
            print(f"step {step:4d}  MSE {loss.item():.3e}  location error {summary(errors)}")
    learnt = loc.detach().cpu().numpy()
    # One point per anchor: its C channels pin both projections down. With several points per
    # anchor the target is a sum of their samples, which has other minima nearby (try P = 3).
    print(f"location error at the start: {summary(pixel_errors(start, truth))}; learnt: "
          f"{summary(pixel_errors(learnt, truth))} ({device})")
    H, W = SHAPES[0]
    channel0 = features[0, :H * W, 0].reshape(H, W)                   # camera 0, scale 0
    path = _figure(out_dir, channel0, truth, start, learnt, history)
    print(f"wrote {path}")
    return 0


def _figure(out_dir, feature, truth, start, learnt, history):
    H, W = SHAPES[0]
    fig, axes = subplots(2, (12, 4), gridspec_kw={"width_ratios": [1.6, 1]})
    ax = axes[0]
    ax.imshow(feature, cmap="gray", extent=(0, W, H, 0))   # pixel edges: u W, v H
    for pts, style, label in ((start, "x", "start"), (learnt, "+", "learnt"),
                              (truth, "o", "hidden")):
        uv = pts[0, :, :, 0].reshape(-1, 2)                   # camera 0's points
        ax.plot(uv[:, 0] * W, uv[:, 1] * H, style, ms=7, mfc="none", label=label)
    ax.set_title("camera 0, scale 0, channel 0: the points")
    ax.legend(loc="upper right")
    loss_panel(axes[1], history, "MSE against the target aggregation")
    return write_figure(fig, out_dir, "deformable_keypoints_torch.png")


if __name__ == "__main__":
    args = parse_cli(__doc__, steps=200)
    sys.exit(main(args.out_dir, args.steps))
