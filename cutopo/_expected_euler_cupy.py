"""CuPy path of expected_euler: launches the kernels of ``cuda_src/ecc_expected.cuh``.

Kernels take the probabilities as float32 or float64 (float16 is widened to float32 here, as
the NumPy path computes it). The caller validates ``prob`` and enters its device.
"""
from __future__ import annotations

import functools
import math

import numpy as np

from ._cuda.compile import register_instances
from ._cuda.launch import Signature, launch, resident_blocks

FAMILY = "ecc"
THREADS = 256                    # ecc::expected::THREADS (block_sum assumes exactly this)
BLOCKS_PER_RESIDENT = 2          # grid size in units of the blocks the device runs at once
MAX_GRID = (1 << 32) // THREADS - 1  # the kernels index a thread's start and stride in 32 bits

_REAL_CTYPE = {np.dtype(np.float32): "float", np.dtype(np.float64): "double"}


def _template(dtype, ndim, tconn) -> str:
    return f"<{_REAL_CTYPE[np.dtype(dtype)]}, {ndim}, {'true' if tconn else 'false'}>"


def forward_signature(dtype, ndim, tconn) -> Signature:
    real = f"ptr:{np.dtype(dtype).name}"
    return Signature(FAMILY, f"cutopo::ecc::expected_euler_forward{_template(dtype, ndim, tconn)}",
                     (real, "ptr:float64", "int64", "int64", "int64", "int64", "int32"))


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

    dtype = np.float64 if prob.dtype == np.float64 else np.float32
    return cupy.ascontiguousarray(prob, dtype=dtype)


def _dims(spatial):
    """(nz, ny, nx); 2-D images pass nz = 1, which the kernels ignore."""
    return (1,) + tuple(spatial) if len(spatial) == 2 else tuple(spatial)


def expected(prob, ndim, tconn):
    """E[chi] of every image of ``prob`` (*batch, *spatial): float64, shape batch."""
    import cupy

    batch, spatial = prob.shape[:prob.ndim - ndim], prob.shape[prob.ndim - ndim:]
    nimg = math.prod(batch)
    out = cupy.zeros(nimg, dtype=np.float64)  # the kernel adds into it
    if nimg:
        x = _compute(prob)
        sig = forward_signature(x.dtype, ndim, tconn)
        anchors = math.prod(n + 2 * tconn for n in spatial)  # base grid: T adds a ring
        target = _grid_target(cupy.cuda.Device().id, sig)
        # Blocks per image: enough to fill the device, never more than the image has work for.
        # The rest of the grid strides over images, so many small images share few blocks.
        per_image = max(1, min(math.ceil(anchors / THREADS), math.ceil(target / nimg)))
        images = max(1, min(nimg, target // per_image))
        launch(sig, images * per_image, THREADS, (x, out, nimg, *_dims(spatial), per_image))
    return out.reshape(batch)


def gradient(prob, ndim, tconn, cotangent):
    """dE[chi]/dprob times the cotangent of each image (shape batch): shape and dtype of prob."""
    import cupy

    batch, spatial = prob.shape[:prob.ndim - ndim], prob.shape[prob.ndim - ndim:]
    nimg = math.prod(batch)
    x = _compute(prob)
    grad = cupy.empty(x.shape, dtype=x.dtype)  # every element is written
    if grad.size:
        cot = cupy.ascontiguousarray(cupy.asarray(cotangent, dtype=x.dtype)).reshape(nimg)
        sig = backward_signature(x.dtype, ndim, tconn)
        target = _grid_target(cupy.cuda.Device().id, sig)
        grid = min(math.ceil(grad.size / THREADS), target)  # grid-stride loop covers the rest
        launch(sig, grid, THREADS, (x, cot, grad, nimg, *_dims(spatial)))
    return grad.astype(prob.dtype, copy=False)
