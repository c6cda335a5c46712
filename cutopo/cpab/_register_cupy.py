"""register's MSE steps on CuPy arrays, with no host synchronisation per step.

The eager loop of :func:`cutopo.cpab.register` calls ``cutopo.vjp(transform_image, ...)`` at
every step, whose finiteness checks and step-size guard are read on the host, and whose generic
launches convert every argument: at 512^2 that host work costs several times the kernels. Here
one level's step is a fixed sequence of prepared launches on buffers allocated once (A = B theta,
the guard into a device flag, expm, the fused warp keeping its checkpoints, the MSE gradient,
the fused warp's backward, the adjoint Frechet derivative, B^T, the Dirichlet term, Adam),
captured once as a CUDA graph and replayed, and the flags are read once per chunk of
:data:`CHUNK` steps. The caller replays a chunk whose flags are set through the eager loop,
from the state saved at its start, which raises n_steps (or the error) at the step where it
would have anyway.
"""
from __future__ import annotations

import numpy as np

from .._cuda.compile import register_instances
from .._adam_cupy import THREADS as _OPTIM_THREADS
from .._cuda.launch import PreparedLaunch, Signature
from .._sampling_cupy import PADDING_CODES, _dims
from . import _integrate_cupy as icp
from . import _warp_cupy as wcp
from ._checks import MAX_STEP_NORM

# Steps between reads of the device flags: a flagged chunk is replayed eagerly.
CHUNK = 100
# False: register runs every step through the eager loop (the tests' oracle for this path).
DEVICE_STEPS = True
# True: a level's step is captured once as a CUDA graph and replayed (one launch per step
# instead of a dozen from Python); False: the same launches issued one by one.
GRAPHS = True
# Bytes of trajectory checkpoints a level may keep: the forward then writes x_t every
# KEEP_SEGMENT steps and the backward starts its segments there instead of integrating every
# trajectory again (at 512^2 a sixth of the step); above it the backward recomputes them
# (segments of 16 steps, its local checkpoints' limit).
KEEP_CHECKPOINTS_BYTES = 1 << 30
# Kept checkpoints every 8 steps rather than 16: the backward's segment in local memory is
# half as long (3D 128^3 warp_backward 2.23 -> 2.20 ms, 2.64 -> 2.58 ms in another run; the
# forward's extra checkpoint writes did not show).
KEEP_SEGMENT = 8
_CTYPE = {"float32": "float", "float64": "double"}
_MSE_BLOCKS = 512       # enough blocks to fill the device for a grid-stride pass


def _guard_sig(K):
    return Signature(icp.FAMILY, f"cutopo::cpab::step_guard<{K}>",
                     ("ptr:float64", "int64", "int32", "float64", "ptr:int32"))


def _mse_sig(t):
    return Signature("optim", f"cutopo::optim::mse_gradient<{_CTYPE[t]}>",
                     (f"ptr:{t}",) * 3 + ("int64", t, "ptr:float64", "ptr:int32"))


def _gradient_sig(t):
    return Signature("optim", f"cutopo::optim::theta_gradient<{_CTYPE[t]}>",
                     ("ptr:float64", "ptr:float64", f"ptr:{t}", f"ptr:{t}", "int64", t, "int32",
                      "ptr:float64", "ptr:int32"))


def _adam_sig(t):
    return Signature("optim", f"cutopo::optim::adam_scheduled<{_CTYPE[t]}>",
                     (f"ptr:{t}",) * 4 + ("int64",) + (t,) * 5 + (f"ptr:{t}", f"ptr:{t}", "ptr:int32"))


_ADVANCE = Signature("optim", "cutopo::optim::advance", ("ptr:int32",))


def _instances():
    for t in _CTYPE:
        yield _mse_sig(t).name
        yield _gradient_sig(t).name
        yield _adam_sig(t).name
    yield _ADVANCE.name


register_instances(icp.FAMILY, lambda: (_guard_sig(K).name for K in (2, 3)))
register_instances("optim", _instances)


def usable(moving4, loss, n_steps) -> bool:
    """Whether a level can run here: CuPy images on the current device (a level's buffers,
    stream and graph are made there), the MSE loss, a fused-warp n_steps."""
    from .._array import is_cupy_array

    if not (DEVICE_STEPS and loss == "mse" and is_cupy_array(moving4)):
        return False
    import cupy

    return (moving4.device.id == cupy.cuda.Device().id and moving4.dtype.name in _CTYPE
            and wcp.supports(n_steps))


class Level:
    """One level's registration steps as prepared launches on buffers made once: Adam on
    ``optimiser.params`` (theta, updated in place, so every address is fixed) for the MSE of
    ``moving4`` warped against ``fixed4`` ((1, C, *spatial), theta's dtype), plus
    ``smoothness * theta.Q theta`` (Q the Dirichlet matrix) when ``smoothness`` is not 0."""

    def __init__(self, moving4, fixed4, optimiser, tess, n_steps, mode, padding_mode, smoothness):
        import cupy

        theta = optimiser.params
        t = theta.dtype.name
        K, C, d = tess.ndim, tess.n_cells, tess.n_params
        size = K * (K + 1)
        spatial = tuple(int(s) for s in moving4.shape[2:])
        channels = int(moving4.shape[1])
        S = int(np.prod(spatial))
        h = 1.0 / n_steps
        self.n_steps, self.dtype, self.size = n_steps, theta.dtype, channels * S
        self.optimiser, self.smoothness = optimiser, float(smoothness)
        nearest = mode == "nearest"
        project = tess.zero_boundary in ("noslip", "slip")
        padding = PADDING_CODES[padding_mode]
        (idx, val, R), (idx_t, val_t, R_t) = icp._basis_tables(tess)

        self.stream = cupy.cuda.Stream(non_blocking=True)
        self.graph = None
        self.counter = cupy.zeros(1, dtype=np.int32)
        self.flags = cupy.zeros(1, dtype=np.int32)
        self.sums = cupy.zeros(CHUNK, dtype=np.float64)        # squared errors per step
        self.penalty = cupy.zeros(CHUNK, dtype=np.float64)     # theta . Q theta per step
        self.steps = cupy.zeros(CHUNK, dtype=t)                # Adam's step sizes per step
        self.invs = cupy.zeros(CHUNK, dtype=t)                 # and 1 / sqrt(1 - b2^t)
        A = cupy.empty((C, size), dtype=np.float64)
        E = cupy.empty((C, size), dtype=t)
        self.G = cupy.empty((C, size), dtype=np.float64)
        dA = cupy.empty((1, C * size), dtype=np.float64)
        grad = cupy.zeros((1, d), dtype=np.float64)
        q = cupy.zeros((1, d), dtype=np.float64)
        grad_T = cupy.empty(d, dtype=t)
        moving = cupy.ascontiguousarray(moving4).reshape(1, channels, S)
        fixed = cupy.ascontiguousarray(fixed4).reshape(-1)
        warped = cupy.empty((1, channels, S), dtype=t)
        d_warped = cupy.empty_like(warped)
        planes = -(-n_steps // KEEP_SEGMENT)
        keep = not nearest and planes * S * K * theta.dtype.itemsize <= KEEP_CHECKPOINTS_BYTES
        segment = KEEP_SEGMENT if keep else icp.local_segment(n_steps, icp.MAX_SEGMENT)
        checkpoints = cupy.empty((planes, S, K) if keep else (0,), dtype=t)
        theta2 = theta.reshape(1, d)
        warp = icp._grid(tess.shape) + _dims(spatial)
        blocks = icp._blocks
        b1, b2 = optimiser.betas
        n = self.size
        launches = [
            PreparedLaunch(icp._ell_sig(t), blocks(C * size), icp.THREADS,
                           (idx, val, theta2, A, C * size, d, 1, R)),
            PreparedLaunch(_guard_sig(K), blocks(C), icp.THREADS,
                           (A, C, n_steps, MAX_STEP_NORM, self.flags)),
            PreparedLaunch(icp._expm_sig(t, K), blocks(C, 128), 128, (A, E, C, h)),
            PreparedLaunch(wcp._forward_sig(t, t, t, t, K, project, nearest), blocks(S),
                           icp.THREADS, (E, moving, warped, checkpoints, 1, C, 1, 1, channels,
                                         n_steps, segment, int(keep), padding) + warp),
            PreparedLaunch(_mse_sig(t), min(_MSE_BLOCKS, -(-n // _OPTIM_THREADS)), _OPTIM_THREADS,
                           (warped, fixed, d_warped, n, 2.0 / n, self.sums, self.counter)),
        ]
        if not nearest:   # nearest sampling is piecewise constant: a zero theta cotangent
            launches += [
                self.G.fill,
                PreparedLaunch(wcp._backward_sig(t, t, t, K, project, False), blocks(S),
                               icp.THREADS, (E, moving, d_warped, cupy.empty(0, dtype=t), self.G,
                                             checkpoints, 1, C, 1, 1, channels, n_steps, segment,
                                             int(not keep), padding, 0, 1) + warp),
                PreparedLaunch(icp._frechet_sig(K), blocks(C, 64), 64, (A, self.G, dA, C, h)),
                PreparedLaunch(icp._ell_sig("float64"), blocks(d), icp.THREADS,
                               (idx_t, val_t, dA, grad, d, C * size, 1, R_t)),
            ]
        if smoothness:
            q_idx, q_val, q_R = icp._dirichlet_table(tess)
            launches.append(PreparedLaunch(icp._ell_sig(t), blocks(d), icp.THREADS,
                                           (q_idx, q_val, theta2, q, d, d, 1, q_R)))
        launches += [
            PreparedLaunch(_gradient_sig(t), blocks(d, _OPTIM_THREADS), _OPTIM_THREADS,
                           (grad, q, theta, grad_T, d, 2 * self.smoothness, int(bool(smoothness)),
                            self.penalty, self.counter)),
            PreparedLaunch(_adam_sig(t), blocks(d, _OPTIM_THREADS), _OPTIM_THREADS,
                           (theta, optimiser.m, optimiser.v, grad_T, d, b1, 1 - b1, b2, 1 - b2,
                            optimiser.eps, self.steps, self.invs, self.counter)),
            PreparedLaunch(_ADVANCE, 1, 1, (self.counter,)),
        ]
        self._launches = launches

    def _step(self):
        for launch in self._launches:
            launch() if isinstance(launch, PreparedLaunch) else launch(0)

    def _replay(self):
        """One step on self.stream: the captured graph (made at the first call), or the
        launches one by one (GRAPHS off, or a capture this CuPy or driver refused)."""
        if GRAPHS and self.graph is None:
            self.graph = self._capture()
        if GRAPHS and self.graph:
            self.graph.launch(self.stream)
        else:
            self._step()

    def _capture(self):
        """The step as a CUDA graph, or False where it cannot be captured. Nothing runs
        during a capture, so a refused one leaves no trace; an error of the step itself
        surfaces again when the launches then run one by one."""
        try:
            self.stream.begin_capture()
        except Exception:
            return False
        error = None
        try:
            self._step()
        except Exception as exc:
            error = exc
        try:
            graph = self.stream.end_capture()
        except Exception as exc:
            error = error or exc
        return False if error is not None else graph

    def run(self, start, stop, lr_at, bar):
        """Steps ``start`` .. ``stop - 1`` (at most CHUNK) with step sizes ``lr_at(k)``; the
        optimiser's state advances as if :meth:`Adam.step` had run. Returns the steps' loss
        values ((stop - start,) in theta's dtype, on the device)."""
        import cupy

        n = stop - start
        opt = self.optimiser
        # Adam.step's scalars for the chunk's updates (rounded to theta's dtype by the tables)
        steps, invs = zip(*(opt.scalars(opt.t + 1 + i, lr_at(start + i)) for i in range(n)))
        caller = cupy.cuda.get_current_stream()
        with self.stream:
            self.stream.wait_event(caller.record())            # theta's last writes first
            self.steps[:n].set(np.asarray(steps, dtype=self.dtype), self.stream)
            self.invs[:n].set(np.asarray(invs, dtype=self.dtype), self.stream)
            self.counter.fill(0)
            self.sums.fill(0)
            self.penalty.fill(0)
            for i in range(n):
                self._replay()
                bar.update(1, status=lambda i=i: f"loss {self._value(i):.4g}")
            values = (self.sums[:n] / self.size).astype(self.dtype)
            if self.smoothness:
                values = values + self.smoothness * self.penalty[:n].astype(self.dtype)
        caller.wait_event(self.stream.record())
        opt.t += n
        opt.lr = lr_at(stop - 1)
        return values

    def _value(self, i):
        """Step i's loss on the host (the progress bar's, when it redraws)."""
        self.stream.synchronize()
        value = float(self.sums[i].get(stream=self.stream)) / self.size
        if self.smoothness:
            value += self.smoothness * float(self.penalty[i].get(stream=self.stream))
        return value

    def flagged(self) -> bool:
        """Whether a step since the last :meth:`clear` tripped the step-size guard or met a
        non-finite theta (one host read)."""
        return bool(int(self.flags.get()[0]))

    def clear(self):
        self.flags.fill(0)
