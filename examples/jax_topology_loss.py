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
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

import cutopo.jax as cj

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # _common.py, from any working directory
from _common import noisy_camera, parse_cli, print_psnr, print_step, reporting, save_figure  # noqa: E402


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
    clean_np, noisy_np = noisy_camera()
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
        if reporting(t, steps):
            print_step(t, float(loss), float(fidelity), float(topology), psnr(out, clean))

    denoised = denoise(params, noisy)
    print_psnr(psnr(noisy, clean), psnr(denoised, clean), jax.default_backend())
    noisy, denoised, clean = np.asarray(noisy), np.asarray(denoised), np.asarray(clean)
    save_figure(out_dir, "jax_topology_loss.png", ((noisy, "noisy"), (denoised, "denoised"), (clean, "clean")),
                np.asarray(thresholds), ((noisy, "noisy"), (denoised, "denoised")), (clean, "clean"), history)
    return 0


if __name__ == "__main__":
    args = parse_cli(__doc__)
    sys.exit(main(args.out_dir, args.steps))
