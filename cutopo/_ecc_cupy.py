"""CuPy path of the exact ECC: plans and launches the kernels of ``cuda_src/ecc.cu``."""
from __future__ import annotations

import math

import numpy as np

from ._cuda.compile import register_instances
from ._cuda.launch import Signature, launch, resident_blocks

FAMILY = "ecc"
THREADS = 256                # ecc::THREADS
TILE_Y, TILE_X = 32, 32      # ecc::TY, ecc::TX
TABLE_SMEM_MAX = 16 * 1024   # threshold table in shared memory up to this many bytes
HIST_SMEM_MAX_BINS = 4096    # per-block shared histogram up to this many bins
MAX_PIXELS_PER_BLOCK = 1 << 27  # keeps each block's int32 shared histogram from overflowing

# Storage dtype -> C type of the kernel's input (bool is one byte, read as unsigned char).
_INPUT_CTYPE = {
    np.dtype("bool"): "unsigned char", np.dtype("uint8"): "unsigned char",
    np.dtype("uint16"): "unsigned short", np.dtype("int16"): "short", np.dtype("int32"): "int",
    np.dtype("float16"): "cutopo::half", np.dtype("float32"): "float", np.dtype("float64"): "double",
}
_INPUT_VIEW = {np.dtype("bool"): np.dtype("uint8"), np.dtype("float16"): np.dtype("uint16")}
# Value-order keys of the contribution map (common.cuh order_key): 64-bit where 32 cannot hold them.
_VALUE_KEY = {"int": "unsigned long long", "double": "unsigned long long"}


def _compare_type(dtype: np.dtype) -> tuple[str, np.dtype]:
    """C type and NumPy dtype in which ``f <= t`` is evaluated exactly as NumPy does in ``dtype``."""
    if dtype.kind == "f":  # float16 compares exactly in float32
        return ("double", np.dtype("float64")) if dtype.itemsize == 8 else ("float", np.dtype("float32"))
    if dtype == np.dtype("uint64"):
        return "unsigned long long", dtype
    return "long long", np.dtype("int64")


def histogram_instance(in_ctype, cmp_ctype, key_ctype, ndim, tconn) -> str:
    return (f"cutopo::ecc::ecc_histogram<{in_ctype}, {cmp_ctype}, {key_ctype}, {ndim}, "
            f"{'true' if tconn else 'false'}>")


def contributions_instance(in_ctype, ndim, tconn) -> str:
    key = _VALUE_KEY.get(in_ctype, "unsigned int")
    return f"cutopo::ecc::ecc_contributions<{in_ctype}, {key}, {ndim}, {'true' if tconn else 'false'}>"


CUMSUM = Signature(FAMILY, "cutopo::ecc::ecc_cumsum", ("ptr:int64", "int64", "int32"))


def _instances():
    """Instances the offline compile check builds: every input type, both ranks and constructions."""
    natural_cmp = {"unsigned char": "long long", "unsigned short": "long long", "short": "long long",
                   "int": "long long", "cutopo::half": "float", "float": "float", "double": "double"}
    for in_ctype in sorted(set(_INPUT_CTYPE.values())):
        for ndim in (2, 3):
            for tconn in (False, True):
                yield histogram_instance(in_ctype, natural_cmp[in_ctype], "unsigned short", ndim, tconn)
                yield contributions_instance(in_ctype, ndim, tconn)
    yield histogram_instance("float", "double", "unsigned int", 3, False)
    yield histogram_instance("unsigned short", "unsigned long long", "unsigned short", 2, True)
    yield CUMSUM.name


register_instances(FAMILY, _instances)


def _image_view(x):
    view = _INPUT_VIEW.get(x.dtype)
    return x.view(view) if view is not None else x


def _plan(sig, nimg, spatial, ndim, shared_mem):
    """(zchunk, blocks_per_image): enough tiles to fill the device, bounded pixels per block."""
    nz, ny, nx = (1,) + tuple(spatial) if ndim == 2 else tuple(spatial)
    target = 2 * resident_blocks(sig, THREADS, shared_mem)
    tiles_yx = math.ceil(ny / TILE_Y) * math.ceil(nx / TILE_X)
    zchunk = 1
    if ndim == 3:
        zchunk = int(np.clip((nz * tiles_yx * nimg) // target, 2, 64))
    tiles = tiles_yx * math.ceil(nz / zchunk)
    pixels = nz * ny * nx
    blocks = max(math.ceil(target / nimg), math.ceil(pixels / MAX_PIXELS_PER_BLOCK))
    return (nz, ny, nx), zchunk, max(1, min(tiles, blocks))


def _uniform_estimate(t: np.ndarray):
    """(t0, 1/dt) when thresholds are close enough to evenly spaced for the O(1) bin guess."""
    T = t.size
    if T < 3:
        return None
    tt = t.astype(np.float64)
    dt = (tt[-1] - tt[0]) / (T - 1)
    if not dt > 0:
        return None
    if np.max(np.abs(tt - (tt[0] + dt * np.arange(T)))) > 0.25 * dt:
        return None
    return float(tt[0]), float(1.0 / dt)


def ecc(image, thresholds, ndim, tconn):
    import cupy

    batch = image.shape[:-ndim]
    spatial = image.shape[-ndim:]
    nimg = math.prod(batch)
    T = int(thresholds.size)
    out = cupy.zeros((nimg, T), dtype=np.int64)
    if nimg == 0:
        return out.reshape(batch + (T,))
    with image.device:
        x = _image_view(cupy.ascontiguousarray(image)).reshape((nimg,) + spatial)
        in_ctype = _INPUT_CTYPE[image.dtype]
        cmp_ctype, cmp_dtype = _compare_type(thresholds.dtype)
        key_ctype = "unsigned short" if T < 0xFFFF else "unsigned int"
        table = cupy.asarray(thresholds.astype(cmp_dtype))
        estimate = _uniform_estimate(thresholds)
        table_bytes = T * cmp_dtype.itemsize
        table_in_smem = table_bytes <= TABLE_SMEM_MAX
        hist_in_smem = T <= HIST_SMEM_MAX_BINS
        shared_mem = ((table_bytes + 15) // 16 * 16 if table_in_smem else 0) + (4 * T if hist_in_smem else 0)
        sig = Signature(FAMILY, histogram_instance(in_ctype, cmp_ctype, key_ctype, ndim, tconn),
                        (f"ptr:{x.dtype}", f"ptr:{cmp_dtype}", "ptr:int64", "int64", "int64", "int64",
                         "int32", "int32", "int32", "int32", "float64", "float64", "int32", "int32"))
        (nz, ny, nx), zchunk, per_image = _plan(sig, nimg, spatial, ndim, shared_mem)
        t0, inv_dt = estimate if estimate else (0.0, 0.0)
        launch(sig, nimg * per_image, THREADS,
               (x, table, out, nz, ny, nx, zchunk, per_image, T, int(estimate is not None), t0, inv_dt,
                int(table_in_smem), int(hist_in_smem)), shared_mem=shared_mem)
        launch(CUMSUM, math.ceil(nimg / (THREADS // 32)), THREADS, (out, nimg, T))
    return out.reshape(batch + (T,))


def euler_contributions(image, ndim, tconn):
    import cupy

    batch = image.shape[:-ndim]
    spatial = image.shape[-ndim:]
    nimg = math.prod(batch)
    with image.device:
        out = cupy.empty(image.shape, dtype=np.int8)
        if nimg == 0:
            return out
        x = _image_view(cupy.ascontiguousarray(image)).reshape((nimg,) + spatial)
        sig = Signature(FAMILY, contributions_instance(_INPUT_CTYPE[image.dtype], ndim, tconn),
                        (f"ptr:{x.dtype}", "ptr:int8", "int64", "int64", "int64", "int32", "int32"))
        (nz, ny, nx), zchunk, per_image = _plan(sig, nimg, spatial, ndim, 0)
        launch(sig, nimg * per_image, THREADS, (x, out, nz, ny, nx, zchunk, per_image))
    return out
