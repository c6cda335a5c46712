"""Align two images with a CPAB diffeomorphism learnt in PyTorch (cutopo.torch.cpab.transform_image).

A crop of ``skimage.data.coins()`` is deformed by a CPAB transformation drawn from the
tessellation's prior (the moving image); theta, starting from zero (the identity), is learnt
with ``torch.optim.Adam`` so that the moving image warped by phi_theta matches the fixed one
under the mean squared error. The gradient reaches theta through cutopo's VJP of
``transform_image`` (the exact adjoint of the integration, then of the bilinear sampling).
The map is a diffeomorphism for every theta, so nothing folds. Runs on the GPU when PyTorch
and CuPy see one, else on the CPU in a few seconds; prints progress and the mean error of the
recovered map in pixels, and writes ``cpab_align_torch.png`` to the folder given as argv[1]
(default: here).

    python examples/cpab_align_torch.py [OUT_DIR] [--steps N]
"""
import os
import sys

import numpy as np
import torch
from skimage import data, transform

import cutopo
import cutopo.torch as ct
from cutopo.cpab import Tessellation, transform_grid

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # _common.py, from any working directory
from _common import loss_panel, parse_cli, reporting, subplots, write_figure  # noqa: E402

SIZE, CELLS, N_STEPS, MAX_SHIFT = 96, (4, 4), 20, 4.0  # pixels, cells per axis, integration, px


def true_theta(tess, shape):
    """theta from the prior, scaled so that the map moves no pixel further than MAX_SHIFT."""
    theta = tess.sample(1, length_scale=0.5, scale=0.1, rng=1)[0]
    identity = transform_grid(np.zeros_like(theta), tess, shape)
    shift = (transform_grid(theta, tess, shape, n_steps=N_STEPS) - identity) * np.array(shape)
    return theta * (MAX_SHIFT / np.sqrt((shift ** 2).sum(axis=-1)).max())


def map_error(theta, theta_true, tess, shape):
    """Mean distance in pixels between phi_theta and phi_theta_true at the pixel centres."""
    diff = transform_grid(theta, tess, shape, n_steps=N_STEPS) - transform_grid(
        theta_true, tess, shape, n_steps=N_STEPS)
    return float(np.sqrt(((diff * np.array(shape)) ** 2).sum(axis=-1)).mean())


def main(out_dir=".", steps=100):
    device = "cuda" if torch.cuda.is_available() and cutopo.gpu_available() else "cpu"
    coins = transform.resize(data.coins()[40:296, 60:316] / 255.0, (SIZE, SIZE), anti_aliasing=True)
    tess = Tessellation(CELLS)
    shape = (SIZE, SIZE)
    theta_true = true_theta(tess, shape)
    fixed = torch.tensor(coins[None, None], dtype=torch.float32, device=device)
    # moving(x) = fixed(phi_{-theta_true}(x)): warping it by phi_theta_true gives fixed back
    # (up to the interpolation and the composition's integration error)
    minus = torch.tensor(-theta_true, dtype=torch.float32, device=device)
    moving = ct.cpab.transform_image(fixed, minus, tess, n_steps=N_STEPS)

    theta = torch.zeros(tess.n_params, dtype=torch.float32, device=device, requires_grad=True)
    optimiser = torch.optim.Adam([theta], lr=0.05)
    history = []
    for step in range(1, steps + 1):
        warped = ct.cpab.transform_image(moving, theta, tess, n_steps=N_STEPS)
        loss = torch.mean((warped - fixed) ** 2)
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
        history.append(loss.item())
        if reporting(step, steps):
            error = map_error(theta.detach().cpu().double().numpy(), theta_true, tess, shape)
            print(f"step {step:4d}  MSE {loss.item():.3e}  mean map error {error:.3f} px")

    with torch.no_grad():
        warped = ct.cpab.transform_image(moving, theta, tess, n_steps=N_STEPS)
    learnt = theta.detach().cpu().double().numpy()
    start, end = (map_error(t, theta_true, tess, shape) for t in (np.zeros_like(learnt), learnt))
    print(f"mean map error: {start:.2f} px at the identity, {end:.2f} px learnt ({device})")
    images = [x.detach().cpu().numpy()[0, 0] for x in (fixed, moving, warped)]
    path = _figure(out_dir, images, history)
    print(f"wrote {path}")
    return 0


def _figure(out_dir, images, history):
    fixed, moving, warped = images
    panels = ((fixed, "fixed"), (moving, "moving"), (warped, "moving warped by phi_theta"),
              (np.abs(warped - fixed), "|warped - fixed|"))
    fig, axes = subplots(5, (19, 3.8))
    for i, (ax, (img, title)) in enumerate(zip(axes[:4], panels)):
        ax.imshow(img, cmap="gray", vmin=0, vmax=None if i == 3 else 1)  # the difference: own scale
        ax.set_title(title)
        ax.axis("off")
    loss_panel(axes[4], history, "MSE")
    return write_figure(fig, out_dir, "cpab_align_torch.png")


if __name__ == "__main__":
    args = parse_cli(__doc__, steps=100)
    sys.exit(main(args.out_dir, args.steps))
