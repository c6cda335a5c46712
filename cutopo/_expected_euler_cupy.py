"""CuPy path of expected_euler: launches the kernels of ``cuda_src/ecc_expected.cuh``.

Kernels take the probabilities as float32 or float64 (float16 is widened to float32 here, as
the NumPy path computes it). The caller validates ``prob`` and enters its device.
"""
from __future__ import annotations

import functools
import math

import numpy as np

from ._cuda.compile import register_instances
from ._cuda.deferred import thread_status
from ._cuda.launch import (CALL_INT64, HOST_WORD, PreparedLaunch, Signature, _c_contiguous,
                           _current_device, device_empty, resident_blocks)
from ._cuda.workspace import ZeroedWorkspaces

FAMILY = "ecc"
THREADS = 256                    # ecc::expected::THREADS (block_sum assumes exactly this)
BLOCKS_PER_RESIDENT = 2          # grid size in units of the blocks the device runs at once
MAX_GRID = (1 << 32) // THREADS - 1  # the kernels index a thread's start and stride in 32 bits
KEEP_SUMS_BYTES = 1 << 20        # a plan's kept per-image sums up to this size (per stream)
SEGMENT = 16                     # ecc::expected::SEGMENT: voxels a 3D backward thread walks

_REAL_CTYPE = {np.dtype(np.float32): "float", np.dtype(np.float64): "double"}


def _template(dtype, ndim, tconn) -> str:
    return f"<{_REAL_CTYPE[np.dtype(dtype)]}, {ndim}, {'true' if tconn else 'false'}>"


def forward_signature(dtype, ndim, tconn) -> Signature:
    real = f"ptr:{np.dtype(dtype).name}"
    return Signature(FAMILY, f"cutopo::ecc::expected_euler_forward{_template(dtype, ndim, tconn)}",
                     (real, "ptr:float64", real, "int64", "int64", "int64", "int64", "int32",
                      "ptr:uint64", HOST_WORD, CALL_INT64))


def backward_signature(dtype, ndim, tconn) -> Signature:
    real = f"ptr:{np.dtype(dtype).name}"
    return Signature(FAMILY, f"cutopo::ecc::expected_euler_backward{_template(dtype, ndim, tconn)}",
                     (real, real, real, "int64", "int64", "int64", "int64"))


def _instances():
    for dtype in _REAL_CTYPE:
        for ndim in (2, 3):
            for tconn in (False, True):
                yield forward_signature(dtype, ndim, tconn).name
                yield backward_signature(dtype, ndim, tconn).name


register_instances(FAMILY, _instances)


@functools.lru_cache(maxsize=None)
def _grid_target(device_id: int, sig: Signature) -> int:
    # device_id is part of the key: occupancy and SM count differ between devices.
    return min(MAX_GRID, BLOCKS_PER_RESIDENT * resident_blocks(sig, THREADS))


def _compute(prob):
    """C-contiguous prob in the kernels' dtype (float16 computes in float32)."""
    import cupy

    if prob.dtype in _REAL_CTYPE and _c_contiguous(prob):
        return prob  # (cupy.ascontiguousarray costs microseconds of host time even then)
    dtype = np.float64 if prob.dtype == np.float64 else np.float32
    return cupy.ascontiguousarray(prob, dtype=dtype)


def _dims(spatial):
    """(nz, ny, nx); 2-D images pass nz = 1, which the kernels ignore."""
    return (1,) + tuple(spatial) if len(spatial) == 2 else tuple(spatial)


class ExpectedPlan:
    """The two launches of expected_euler for one geometry (memoized by :func:`expected_plan`):
    a repeated call (a loss in a training loop) allocates its output and launches, nothing
    more. Each launch checks its arguments at its first call alone (call_checked_once): the
    arrays are made here or by :func:`_compute` in the plan's dtype, on its device."""

    def __init__(self, dtype, nimg, spatial, ndim, tconn):
        device = _current_device()
        dims = _dims(spatial)
        fsig = forward_signature(dtype, ndim, tconn)
        anchors = math.prod(n + 2 * tconn for n in spatial)  # base grid: T adds a ring
        if ndim == 3:  # a thread per column segment of SEGMENT anchors (T: from -1 on each axis)
            anchors = (math.ceil((spatial[0] + tconn) / SEGMENT)
                       * math.prod(n + tconn for n in spatial[1:]))
        target = _grid_target(device, fsig)
        # Blocks per image: enough to fill the device, never more than the image has work
        # for. The rest of the grid strides over images, so many small images share few blocks.
        per_image = max(1, min(math.ceil(anchors / THREADS), math.ceil(target / nimg)))
        images = max(1, min(nimg, target // per_image))
        # called with (prob, sums, out, status counters, status, token)
        self.forward = PreparedLaunch(fsig, images * per_image, THREADS,
                                      (None, None, None, nimg, *dims, per_image, None, None, None))
        # the per-image float64 sums, kept zeroed by the kernel's last block
        self.sums = ZeroedWorkspaces(KEEP_SUMS_BYTES)
        bsig = backward_signature(dtype, ndim, tconn)
        # one thread per pixel (2D) or per column segment of SEGMENT voxels (3D)
        items = nimg * math.prod(spatial)
        if ndim == 3:
            items = nimg * math.ceil(spatial[0] / SEGMENT) * math.prod(spatial[1:])
        grid = min(math.ceil(items / THREADS), _grid_target(device, bsig))
        # called with (prob, cotangent, grad); a grid-stride loop covers the rest
        self.backward = PreparedLaunch(bsig, grid, THREADS, (None, None, None, nimg, *dims))


@functools.lru_cache(maxsize=64)
def expected_plan(device_id, dtype, nimg, spatial, ndim, tconn) -> ExpectedPlan:
    return ExpectedPlan(dtype, nimg, spatial, ndim, tconn)


def _plan_of(x, ndim, tconn) -> ExpectedPlan:
    spatial = x.shape[x.ndim - ndim:]
    return expected_plan(_current_device(), x.dtype, math.prod(x.shape[:x.ndim - ndim]), spatial,
                         ndim, bool(tconn))


def expected(prob, ndim, tconn):
    """(E[chi] of every image of ``prob`` (*batch, *spatial), shape batch, in the computation
    dtype (float64 for float64 prob, else float32); whether the kernel found a value outside
    [0, 1] or NaN, when the result is not to be used). On the current device, which is prob's.
    The flag comes through this thread's PinnedStatus: read here, after the launch, it waits
    for the kernel."""
    x = _compute(prob)
    batch = prob.shape[:prob.ndim - ndim]
    out = device_empty(batch, x.dtype)  # the kernel's last block writes it
    if not out.size:
        return out, False
    plan = _plan_of(x, ndim, tconn)
    status = thread_status("ecc.expected_euler_forward")
    token = status.arm()
    sums = plan.sums.get("sums", out.size, np.float64)
    plan.forward.call_checked_once(x, sums, out, status.counters, status, token)
    return out, status.read_status()[1] != 0


def gradient(prob, ndim, tconn, cotangent):
    """dE[chi]/dprob times the cotangent of each image (shape batch): shape and dtype of prob."""
    import cupy

    x = _compute(prob)
    grad = device_empty(x.shape, x.dtype)  # every element is written
    if grad.size:
        nimg = math.prod(prob.shape[:prob.ndim - ndim])
        cot = cotangent
        if not (type(cot) is cupy.ndarray and cot.dtype == x.dtype and _c_contiguous(cot)):
            cot = cupy.ascontiguousarray(cupy.asarray(cot, dtype=x.dtype))
        if cot.shape != (nimg,):
            cot = cot.reshape(nimg)
        _plan_of(x, ndim, tconn).backward.call_checked_once(x, cot, grad)
    return grad if grad.dtype == prob.dtype else grad.astype(prob.dtype)
