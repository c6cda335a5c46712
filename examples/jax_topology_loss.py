"""Train a small JAX denoiser with a topological loss term (cutopo.jax.soft_ecc).

The JAX twin of ``torch_topology_loss.py``: a noisy crop of ``skimage.data.camera()`` is
denoised by a tiny residual CNN trained on fidelity to the noisy image plus the distance
between the soft Euler characteristic curve (``cutopo.jax.soft_ecc``) of the output and that of
the clean image. The whole training step (forward, ``jax.value_and_grad`` through the soft ECC,
Adam update) is one ``jax.jit``-compiled function; the soft ECC runs as a callback into
cutopo's NumPy path on the CPU. Prints progress and writes ``jax_topology_loss.png`` to the
folder given as argv[1] (default: here).

    python examples/jax_topology_loss.py [OUT_DIR] [--steps N]
"""
import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from skimage import data, transform

import cutopo
import cutopo.jax as cj


def conv(x, w, b):
    """3x3 convolution, reflect padding; x (C_in, H, W), w (C_out, C_in, 3, 3)."""
    x = jnp.pad(x, ((0, 0), (1, 1), (1, 1)), mode="reflect")
    y = jax.lax.conv_general_dilated(x[None], w, (1, 1), "VALID")[0]
    return y + b[:, None, None]


def denoise(params, x):
    """x + a correction from two 3x3 convolutions (the identity at the start)."""
    h = jnp.tanh(conv(x[None], params["w1"], params["b1"]))
    return x + conv(h, params["w2"], params["b2"])[0]


def init(key, width=8):
    k1, _ = jax.random.split(key)
    bound = 1.0 / 3.0  # 1 / sqrt(fan_in) with fan_in = 9
    return {"w1": jax.random.uniform(k1, (width, 1, 3, 3), minval=-bound, maxval=bound),
            "b1": jnp.zeros(width),
            "w2": jnp.zeros((1, width, 3, 3)), "b2": jnp.zeros(1)}


def psnr(a, b):
    return float(10 * jnp.log10(1.0 / jnp.mean((a - b) ** 2)))


def main(out_dir=".", steps=120):
    rng = np.random.default_rng(0)
    clean_np = transform.resize(data.camera()[100:356, 150:406] / 255.0, (80, 80), anti_aliasing=True)
    noisy_np = clean_np + 0.12 * rng.standard_normal(clean_np.shape)
    clean = jnp.asarray(clean_np, jnp.float32)
    noisy = jnp.asarray(noisy_np, jnp.float32)

    thresholds = jnp.linspace(0.05, 0.95, 48)
    scale = 40.0  # sigmoid sharpness, in inverse intensity units
    target = cj.soft_ecc(clean, thresholds, scale)   # the curve the output should have
    weight = 1e-4  # the ECC distance is ~1e4 at the start (see torch_topology_loss.py)

    def loss_fn(params):
        out = denoise(params, noisy)
        fidelity = jnp.mean((out - noisy) ** 2)
        topology = jnp.mean((cj.soft_ecc(out, thresholds, scale) - target) ** 2)
        return fidelity + weight * topology, (fidelity, topology, out)

    lr, b1, b2 = 0.01, 0.9, 0.999

    @jax.jit
    def step(params, m, v, t):
        (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        m = jax.tree_util.tree_map(lambda m, g: b1 * m + (1 - b1) * g, m, grads)
        v = jax.tree_util.tree_map(lambda v, g: b2 * v + (1 - b2) * g * g, v, grads)
        params = jax.tree_util.tree_map(
            lambda p, m, v: p - lr * (m / (1 - b1 ** t)) / (jnp.sqrt(v / (1 - b2 ** t)) + 1e-8),
            params, m, v)
        return params, m, v, loss, aux

    params = init(jax.random.PRNGKey(0))
    m = jax.tree_util.tree_map(jnp.zeros_like, params)
    v = jax.tree_util.tree_map(jnp.zeros_like, params)
    history = []
    for t in range(1, steps + 1):
        params, m, v, loss, (fidelity, topology, out) = step(params, m, v, t)
        history.append(float(loss))
        if t == 1 or t % 30 == 0 or t == steps:
            print(f"step {t:4d}  loss {float(loss):.5f}  fidelity {float(fidelity):.5f}  "
                  f"ECC distance {float(topology):10.1f}  PSNR {psnr(out, clean):5.2f} dB")

    denoised = denoise(params, noisy)
    print(f"PSNR against the clean image: noisy {psnr(noisy, clean):.2f} dB, "
          f"denoised {psnr(denoised, clean):.2f} dB ({jax.default_backend()})")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tt = np.asarray(thresholds)
    fig, axes = plt.subplots(1, 5, figsize=(19, 3.8))
    for ax, img, title in zip(axes[:3], (noisy, denoised, clean), ("noisy", "denoised", "clean")):
        ax.imshow(np.asarray(img), cmap="gray", vmin=0, vmax=1)
        ax.set_title(title)
        ax.axis("off")
    for img, label in ((noisy, "noisy"), (denoised, "denoised")):
        axes[3].plot(tt, cutopo.ecc(np.asarray(img), tt), label=label)
    axes[3].plot(tt, cutopo.ecc(np.asarray(clean), tt), "k--", label="clean")
    axes[3].set_xlabel("threshold")
    axes[3].set_ylabel("Euler characteristic")
    axes[3].legend()
    axes[4].semilogy(history)
    axes[4].set_xlabel("step")
    axes[4].set_title("loss")
    fig.tight_layout()
    path = os.path.join(out_dir, "jax_topology_loss.png")
    fig.savefig(path, dpi=90)
    plt.close(fig)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", nargs="?", default=".")
    parser.add_argument("--steps", type=int, default=120)
    args = parser.parse_args()
    sys.exit(main(args.out_dir, args.steps))
