"""Euler characteristic curves of periodic Gaussian random fields against the Gaussian
kinematic formula: the torus has no boundary terms, the box has them.

Cosmology maps and simulation boxes are periodic. For a smooth, stationary, isotropic Gaussian
field f of unit variance, the expected Euler characteristic of the sublevel set {f <= t} is the
Gaussian kinematic formula (Adler & Taylor, 2007; {f <= t} has the law of {-f >= -t}):

    torus:  E[chi] = A lam (-t) exp(-t^2 / 2) / (2 pi)^(3/2)
    box:    E[chi] = the same + (P / 2) sqrt(lam) exp(-t^2 / 2) / (2 pi) + Q(-t)

with A the area and P the perimeter in pixels, lam = Var(df/dx) (the second spectral moment)
and Q the standard normal tail. The example draws fields with a Gaussian power spectrum by FFT
(periodic by construction), computes ``cutopo.ecc(f, t, boundary="periodic")`` and the box
``cutopo.ecc(f, t)`` of each, and compares their means with both formulas. Runs on NumPy in
about a second (CuPy arrays work the same way); writes ``periodic_grf.png`` to the folder given
as argv[1] (default: here).

    python examples/periodic_grf.py [OUT_DIR]
"""
import math
import os
import sys

import numpy as np
from scipy.stats import norm

import cutopo

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # _common.py, from any working directory
from _common import subplots, write_figure  # noqa: E402


def gaussian_fields(n, size, correlation, rng):
    """``n`` periodic unit-variance Gaussian fields of ``size`` x ``size`` pixels with power
    spectrum exp(-|k|^2 correlation^2) (k in radians per pixel), and their lam = Var(df/dx)."""
    k = 2 * np.pi * np.fft.fftfreq(size)
    kx, ky = np.meshgrid(k, k, indexing="ij")
    power = np.exp(-(kx ** 2 + ky ** 2) * correlation ** 2)
    power[0, 0] = 0.0                      # zero mean
    lam = float((kx ** 2 * power).sum() / power.sum())
    amplitude = np.sqrt(power) * size / math.sqrt(power.sum())  # unit variance in expectation
    noise = rng.standard_normal((n, size, size))
    return np.fft.ifft2(np.fft.fft2(noise) * amplitude).real, lam


def kinematic_formula(t, size, lam, boundary):
    """The expected Euler characteristic curve of {f <= t} on the torus or the box."""
    e = np.exp(-t ** 2 / 2)
    chi = size * size * lam * (-t) * e / (2 * np.pi) ** 1.5
    if boundary == "box":
        chi = chi + 2 * size * math.sqrt(lam) * e / (2 * np.pi) + norm.sf(-t)
    return chi


def main(out_dir=".", n=30, size=256, correlation=6.0):
    rng = np.random.default_rng(1)
    fields, lam = gaussian_fields(n, size, correlation, rng)
    t = np.linspace(-3.5, 3.5, 57)
    curves = {b: cutopo.ecc(fields, t, ndim=2, boundary=b) for b in ("periodic", "box")}
    fig, axes = subplots(3, (15, 4.2))
    axes[0].imshow(fields[0], cmap="RdBu_r")
    axes[0].set_title(f"one of {n} periodic fields ({size}^2)")
    axes[1].imshow(fields[0] <= 0.5, cmap="gray")
    axes[1].set_title("its sublevel set f <= 0.5 (white)")
    errors = {}
    for (boundary, curve), colour in zip(curves.items(), ("C0", "C1")):
        mean, sd = curve.mean(axis=0), curve.std(axis=0)
        want = kinematic_formula(t, size, lam, "box" if boundary == "box" else "torus")
        errors[boundary] = float(np.abs(mean - want).max() / np.abs(want).max())
        axes[2].fill_between(t, mean - sd, mean + sd, color=colour, alpha=0.25)
        axes[2].plot(t, mean, colour, label=f"cutopo.ecc, {boundary} (mean, sd)")
        axes[2].plot(t, want, colour + "--", label=f"kinematic formula, {boundary}")
        print(f"{boundary:8s}: mean curve against its formula, largest difference "
              f"{errors[boundary]:.1%} of the curve's peak")
    wrong = float(np.abs(curves["box"].mean(axis=0) - kinematic_formula(t, size, lam, "torus")).max()
                  / np.abs(kinematic_formula(t, size, lam, "torus")).max())
    print(f"box curve against the torus formula: {wrong:.1%} (the boundary terms)")
    axes[2].set_xlabel("threshold t")
    axes[2].set_ylabel("Euler characteristic of {f <= t}")
    axes[2].legend(fontsize=8)
    path = write_figure(fig, out_dir, "periodic_grf.png")
    print(f"wrote {path}")
    return 0 if max(errors.values()) < 0.15 else 1


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:2]))
