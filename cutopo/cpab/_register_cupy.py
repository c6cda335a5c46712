"""register's MSE steps on CuPy arrays, with no host synchronisation per step.

The eager loop of :func:`cutopo.cpab.register` calls ``cutopo.vjp(transform_image, ...)`` at
every step, whose finiteness checks and step-size guard are read on the host, and whose generic
launches convert every argument: at 512^2 that host work costs several times the kernels. Here
one level's step is a fixed sequence of prepared launches on buffers allocated once (A = B theta,
the guard into a device flag, expm, the fused warp, the MSE gradient, the fused warp's backward,
the adjoint Frechet derivative, B^T), and the flags are read once per chunk of :data:`CHUNK`
steps. The caller replays a chunk whose flags are set through the eager loop, from the state
saved at its start, which raises n_steps (or the error) at the step where it would have anyway.
"""
from __future__ import annotations

import numpy as np

from .._cuda.compile import register_instances
from .._cuda.launch import PreparedLaunch, Signature
from .._sampling_cupy import PADDING_CODES, _dims
from . import _integrate_cupy as icp
from . import _warp_cupy as wcp
from ._checks import MAX_STEP_NORM

# Steps between reads of the device flags: a flagged chunk is replayed eagerly.
CHUNK = 100
# False: register runs every step through the eager loop (the tests' oracle for this path).
DEVICE_STEPS = True
_CTYPE = {"float32": "float", "float64": "double"}
_MSE_THREADS = 256      # optim::THREADS
_MSE_BLOCKS = 512       # enough blocks to fill the device for a grid-stride pass


def _guard_sig(K):
    return Signature(icp.FAMILY, f"cutopo::cpab::step_guard<{K}>",
                     ("ptr:float64", "int64", "int32", "float64", "ptr:int32"))


def _mse_sig(t):
    return Signature("optim", f"cutopo::optim::mse_gradient<{_CTYPE[t]}>",
                     (f"ptr:{t}",) * 3 + ("int64", t, "ptr:float64"))


register_instances(icp.FAMILY, lambda: (_guard_sig(K).name for K in (2, 3)))
register_instances("optim", lambda: (_mse_sig(t).name for t in _CTYPE))


def usable(moving4, loss, n_steps) -> bool:
    """Whether a level can run here: CuPy images, the MSE loss, a fused-warp n_steps."""
    from .._array import is_cupy_array

    return (DEVICE_STEPS and loss == "mse" and is_cupy_array(moving4)
            and moving4.dtype.name in _CTYPE and wcp.supports(n_steps))


class Level:
    """One level's theta cotangent as prepared launches: ``theta`` (the Adam parameters,
    updated in place, so its address is fixed) against ``moving4``/``fixed4`` (1, C, *spatial)
    of theta's dtype."""

    def __init__(self, moving4, fixed4, theta, tess, n_steps, mode, padding_mode):
        import cupy

        t = theta.dtype.name
        K, C, d = tess.ndim, tess.n_cells, tess.n_params
        size = K * (K + 1)
        spatial = tuple(int(s) for s in moving4.shape[2:])
        channels = int(moving4.shape[1])
        S = int(np.prod(spatial))
        h = 1.0 / n_steps
        self.n_steps, self.dtype, self.size = n_steps, theta.dtype, channels * S
        self.nearest = mode == "nearest"
        project = tess.zero_boundary in ("noslip", "slip")
        padding = PADDING_CODES[padding_mode]
        (idx, val, R), (idx_t, val_t, R_t) = icp._basis_tables(tess)

        self.A = cupy.empty((C, size), dtype=np.float64)
        self.E = cupy.empty((C, size), dtype=t)
        self.G = cupy.empty((C, size), dtype=np.float64)
        self.dA = cupy.empty((1, C * size), dtype=np.float64)
        self.grad = cupy.zeros((1, d), dtype=np.float64)
        self.flags = cupy.zeros(1, dtype=np.int32)
        self.moving = cupy.ascontiguousarray(moving4).reshape(1, channels, S)
        self.fixed = cupy.ascontiguousarray(fixed4).reshape(-1)
        self.warped = cupy.empty((1, channels, S), dtype=t)
        self.d_warped = cupy.empty_like(self.warped)
        theta2 = theta.reshape(1, d)
        warp = icp._grid(tess.shape) + _dims(spatial)
        blocks = icp._blocks
        self.forward = [
            PreparedLaunch(icp._ell_sig(t), blocks(C * size), icp.THREADS,
                           (idx, val, theta2, self.A, C * size, d, 1, R)),
            PreparedLaunch(_guard_sig(K), blocks(C), icp.THREADS,
                           (self.A, C, n_steps, MAX_STEP_NORM, self.flags)),
            PreparedLaunch(icp._expm_sig(t, K), blocks(C, 128), 128, (self.A, self.E, C, h)),
            PreparedLaunch(wcp._forward_sig(t, t, t, t, K, project, self.nearest), blocks(S),
                           icp.THREADS, (self.E, self.moving, self.warped, 1, C, 1, 1, channels,
                                         n_steps, padding) + warp),
        ]
        n = self.size
        self.mse = PreparedLaunch(_mse_sig(t), min(_MSE_BLOCKS, -(-n // _MSE_THREADS)), _MSE_THREADS,
                                  (self.warped, self.fixed, self.d_warped, n, 2.0 / n, None))
        # nearest sampling is piecewise constant: its theta cotangent is zero (self.grad)
        self.backward = [] if self.nearest else [
            PreparedLaunch(wcp._backward_sig(t, t, t, K, project, False), blocks(S), icp.THREADS,
                           (self.E, self.moving, self.d_warped, cupy.empty(0, dtype=t), self.G, 1,
                            C, 1, 1, channels, n_steps, icp.local_segment(n_steps, 4), padding, 0,
                            1) + warp),
            PreparedLaunch(icp._frechet_sig(K), blocks(C, 64), 64, (self.A, self.G, self.dA, C, h)),
            PreparedLaunch(icp._ell_sig("float64"), blocks(d), icp.THREADS,
                           (idx_t, val_t, self.dA, self.grad, d, C * size, 1, R_t)),
        ]

    def theta_cotangent(self, loss_sum):
        """The MSE's gradient in theta, (d,) float64; adds the squared error's sum to the (1,)
        float64 device array ``loss_sum``."""
        for launch in self.forward:
            launch()
        self.mse(loss_sum)
        if self.backward:
            self.G.fill(0)
            for launch in self.backward:
                launch()
        return self.grad[0]

    def run(self, start, stop, optimiser, lr_at, smooth, bar):
        """Steps ``start`` .. ``stop - 1``: Adam on ``optimiser.params`` with the step sizes
        ``lr_at(k)``, plus ``weight * theta.Q theta`` when ``smooth`` is (Q, weight). Returns
        the steps' loss values ((stop - start,) in theta's dtype, on the device)."""
        import cupy

        n = stop - start
        sums = cupy.zeros(n, dtype=np.float64)
        theta = optimiser.params
        smooth_values = cupy.zeros(n, dtype=self.dtype) if smooth else None
        for i in range(n):
            optimiser.lr = lr_at(start + i)
            d_theta = self.theta_cotangent(sums[i:i + 1]).astype(self.dtype)
            if smooth:
                Q, weight = smooth
                Q_theta = Q(theta)
                smooth_values[i] = (theta * Q_theta).sum()
                d_theta = d_theta + (2 * weight) * Q_theta
            optimiser.step(d_theta)
            bar.update(1, status=lambda i=i: f"loss {float(sums[i]) / self.size:.4g}")
        values = (sums / self.size).astype(self.dtype)
        return values + smooth[1] * smooth_values if smooth else values

    def flagged(self) -> bool:
        """Whether a step since the last :meth:`clear` tripped the step-size guard or met a
        non-finite theta (one host read)."""
        return bool(int(self.flags.get()[0]))

    def clear(self):
        self.flags.fill(0)
