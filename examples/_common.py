"""What the examples share: the noisy camera crop, progress lines, the command line and the
five-panel figure (three images, their Euler characteristic curves, the loss).

The examples import it from their own folder (they put it on ``sys.path``), so they run from any
working directory.
"""
import argparse
import os

import numpy as np

import cutopo


def noisy_camera(size=80, noise=0.12, seed=0):
    """(clean, noisy) float64 images: a crop of ``skimage.data.camera()`` resized to
    ``size`` x ``size`` in [0, 1], and the same plus Gaussian noise of standard deviation
    ``noise`` (not clipped)."""
    from skimage import data, transform

    rng = np.random.default_rng(seed)
    clean = transform.resize(data.camera()[100:356, 150:406] / 255.0, (size, size), anti_aliasing=True)
    return clean, clean + noise * rng.standard_normal(clean.shape)


def reporting(step, steps, every=30):
    """Whether a training loop prints progress at ``step`` (1-based): the first, every
    ``every``-th and the last."""
    return step == 1 or step % every == 0 or step == steps


def print_step(step, loss, fidelity, topology, psnr_db):
    print(f"step {step:4d}  loss {loss:.5f}  fidelity {fidelity:.5f}  "
          f"ECC distance {topology:10.1f}  PSNR {psnr_db:5.2f} dB")


def print_psnr(noisy_db, denoised_db, where):
    print(f"PSNR against the clean image: noisy {noisy_db:.2f} dB, "
          f"denoised {denoised_db:.2f} dB ({where})")


def parse_cli(doc, steps=120):
    """``[OUT_DIR] [--steps N]`` of a training example."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("out_dir", nargs="?", default=".")
    parser.add_argument("--steps", type=int, default=steps)
    return parser.parse_args()


def save_figure(out_dir, filename, panels, thresholds, curves, target, history):
    """Write the examples' figure to ``out_dir/filename`` and say so; returns the path.

    ``panels``: three (image, title) pairs, shown in grey over [0, 1]. ``curves``: (image,
    label) pairs whose ECC (:func:`cutopo.ecc` at ``thresholds``) is plotted, then ``target``'s
    (an (image, label) pair) dashed in black. ``history``: the loss per step (log scale). Images
    are NumPy arrays.
    """
    fig, axes = subplots(5, (19, 3.8))
    for ax, (img, title) in zip(axes[:3], panels):
        ax.imshow(img, cmap="gray", vmin=0, vmax=1)
        ax.set_title(title)
        ax.axis("off")
    for img, label in curves:
        axes[3].plot(thresholds, cutopo.ecc(img, thresholds), label=label)
    axes[3].plot(thresholds, cutopo.ecc(target[0], thresholds), "k--", label=target[1])
    axes[3].set_xlabel("threshold")
    axes[3].set_ylabel("Euler characteristic")
    axes[3].legend()
    loss_panel(axes[4], history, "loss")
    path = write_figure(fig, out_dir, filename)
    print(f"wrote {path}")
    return path


def loss_panel(ax, history, title):
    """The loss per step on a log scale, titled ``title``."""
    ax.semilogy(history)
    ax.set_xlabel("step")
    ax.set_title(title)


def subplots(ncols, figsize, **kwargs):
    """(figure, axes) of one row of ``ncols`` panels, drawn without a display (Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(1, ncols, figsize=figsize, **kwargs)


def write_figure(fig, out_dir, filename):
    """Lay out, save to ``out_dir/filename`` and close ``fig``; returns the path."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path = os.path.join(out_dir, filename)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
