"""Deform an image by gradient descent until its Euler characteristic curve matches a target.

The loss is the squared difference between the sigmoid-relaxed ECC of the image
(``cutopo.soft_ecc``) and the ECC of a target image; its gradient comes from ``cutopo.vjp``.
Starting from a noisy image (many small components and holes, so a wild curve) and aiming at
the curve of a smoothed one, the optimisation removes topological noise. Runs on NumPy in a
few seconds; writes ``soft_ecc_match.png`` to the folder given as argv[1] (default: here).

    python examples/soft_ecc_match.py [OUT_DIR]
"""
import os
import sys

import numpy as np
from scipy import ndimage
from skimage import data, transform

import cutopo

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # _common.py, from any working directory
from _common import save_figure  # noqa: E402


def main(out_dir="."):
    rng = np.random.default_rng(0)
    clean = transform.resize(data.camera().astype(np.float64) / 255.0, (96, 96), anti_aliasing=True)
    noisy = np.clip(clean + 0.15 * rng.standard_normal(clean.shape), 0.0, 1.0)
    target = ndimage.gaussian_filter(noisy, 2.0)
    thresholds = np.linspace(0.05, 0.95, 64)
    scale = 40.0
    goal = cutopo.ecc(target, thresholds).astype(np.float64)

    image = noisy.copy()
    m, v = np.zeros_like(image), np.zeros_like(image)  # Adam state
    lr, beta1, beta2 = 0.01, 0.9, 0.999
    history = []
    for step in range(1, 201):
        curve, pullback = cutopo.vjp(cutopo.soft_ecc, image, thresholds, scale, wrt="image")
        residual = curve - goal
        history.append(float(np.sum(residual ** 2)))
        (grad, _, _) = pullback(2.0 * residual)
        m = beta1 * m + (1 - beta1) * grad
        v = beta2 * v + (1 - beta2) * grad ** 2
        image -= lr * (m / (1 - beta1 ** step)) / (np.sqrt(v / (1 - beta2 ** step)) + 1e-8)
        np.clip(image, 0.0, 1.0, out=image)
        if step % 50 == 0 or step == 1:
            print(f"step {step:4d}  loss {history[-1]:12.1f}")

    save_figure(out_dir, "soft_ecc_match.png", ((noisy, "start (noisy)"), (image, "optimised"), (target, "target")),
                thresholds, ((noisy, "start"), (image, "optimised")), (target, "target"), history)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:2]))
