"""Train a small PyTorch denoiser with a topological loss term (cutopo.torch.soft_ecc).

A noisy crop of ``skimage.data.camera()`` is denoised by a tiny residual CNN. The loss has two
terms: fidelity to the noisy image (mean squared error) and the distance between the soft Euler
characteristic curve (``cutopo.torch.soft_ecc``) of the output and that of the clean image, the
topological prior (noise adds many small components and holes, so its curve is far off). The
gradient of the soft-ECC term flows through autograd into the network's weights. Fidelity
alone would keep the identity; with the topological term the network learns to smooth the
noise away (PSNR 18.5 -> 23.6 dB here). Runs on the
GPU when PyTorch and CuPy see one, else on the CPU in a few seconds; prints progress and
writes ``torch_topology_loss.png`` to the folder given as argv[1] (default: here).

    python examples/torch_topology_loss.py [OUT_DIR] [--steps N]
"""
import os
import sys

import numpy as np
import torch

import cutopo
import cutopo.torch as ct

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # _common.py, from any working directory
from _common import noisy_camera, parse_cli, print_psnr, print_step, reporting, save_figure  # noqa: E402


class Denoiser(torch.nn.Module):
    """x + a correction from two 3x3 convolutions (the identity at the start)."""

    def __init__(self, width=8):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(1, width, 3, padding=1, padding_mode="reflect")
        self.conv2 = torch.nn.Conv2d(width, 1, 3, padding=1, padding_mode="reflect")
        torch.nn.init.zeros_(self.conv2.weight)
        torch.nn.init.zeros_(self.conv2.bias)

    def forward(self, x):
        return x + self.conv2(torch.tanh(self.conv1(x)))


def psnr(a, b):
    return float(10 * torch.log10(1.0 / torch.mean((a - b) ** 2)))


def main(out_dir=".", steps=120):
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() and cutopo.gpu_available() else "cpu"
    clean_np, noisy_np = noisy_camera()
    clean = torch.tensor(clean_np, dtype=torch.float32, device=device)
    noisy = torch.tensor(noisy_np, dtype=torch.float32, device=device)

    thresholds = torch.linspace(0.05, 0.95, 48, device=device)
    scale = 40.0  # sigmoid sharpness, in inverse intensity units
    target = ct.soft_ecc(clean, thresholds, scale)     # the curve the output should have
    # The ECC distance is in squared Euler characteristics (about 1e4 for the noisy image): this
    # weight lets it dominate at the start and leaves fidelity to win once the curves are close.
    weight = 1e-4

    model = Denoiser().to(device)
    optimiser = torch.optim.Adam(model.parameters(), lr=0.01)
    history = []
    for step in range(1, steps + 1):
        out = model(noisy[None, None])[0, 0]
        fidelity = torch.mean((out - noisy) ** 2)
        topology = torch.mean((ct.soft_ecc(out, thresholds, scale) - target) ** 2)
        loss = fidelity + weight * topology
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
        history.append(loss.item())
        if reporting(step, steps):
            print_step(step, loss.item(), fidelity.item(), topology.item(), psnr(out.detach(), clean))

    with torch.no_grad():
        denoised = model(noisy[None, None])[0, 0]
    print_psnr(psnr(noisy, clean), psnr(denoised, clean), device)
    noisy, denoised = noisy.cpu().numpy(), denoised.cpu().numpy()
    save_figure(out_dir, "torch_topology_loss.png",
                ((noisy, "noisy"), (denoised, "denoised"), (clean.cpu().numpy(), "clean")),
                thresholds.cpu().numpy(), ((noisy, "noisy"), (denoised, "denoised")),
                (clean_np.astype(np.float32), "clean"), history)
    return 0


if __name__ == "__main__":
    args = parse_cli(__doc__)
    sys.exit(main(args.out_dir, args.steps))
