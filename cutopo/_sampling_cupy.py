"""CuPy path of :func:`cutopo.grid_sample`: plans and launches of ``cuda_src/sampling.cu`` (the
kernels' header comment describes the work layout).

:func:`cutopo.sampling._prepare` hands over kernel-ready arrays: the image C-contiguous in its
storage dtype (float16, float32 or float64), the grid C-contiguous in the computation dtype.
The forward returns the output together with the kernels' non-finite flags, which the caller
turns into the NumPy path's errors. The deterministic image cotangent sorts the
(point, corner) entries by the image row they add to with ``cupy.argsort`` (stable) before
one thread per row sums them in that order.
"""
from __future__ import annotations

import functools

import numpy as np

from ._cuda.compile import register_instances
from ._cuda.launch import PreparedLaunch, Signature, device_attribute

FAMILY = "sampling"
THREADS = 256            # sampling::THREADS
ROW_CHANNELS = 8         # sampling::ROW_CHANNELS
GRID_NONFINITE, IMAGE_NONFINITE = 1, 2  # sampling::GRID_NONFINITE, IMAGE_NONFINITE
PADDING_CODES = {"zeros": 0, "border": 1, "reflection": 2}

# Threads a launch should have to fill the device, in units of the threads all multiprocessors
# hold at once: fewer points than that split the channels into groups (forward, and the image
# cotangent when the grid cotangent is not asked for).
FILL = 2
# Image rows (N S) up to which the deterministic path sorts int32 keys (the sentinel N S and the
# N S + 1 segment bounds must fit); tests lower it to exercise the int64 keys.
KEY32_MAX_ROWS = 2**31 - 2
# Channels per group: None picks by size; tests set an int to force a split (or none).
FORCE_PER_GROUP = None
# Tests set True to run the forward and backward with 64-bit indices even where 32 bits suffice.
FORCE_WIDE_INDEX = False

_CTYPE = {"float16": "cutopo::half", "float32": "float", "float64": "double"}
# (image storage, computation, output) of the forward instances. Float64 computations read
# float16 and float32 images as they are; float16 outputs are written by the kernel directly.
FORWARD_TYPES = (("float16", "float32", "float16"), ("float16", "float32", "float32"),
                 ("float32", "float32", "float32"), ("float16", "float64", "float64"),
                 ("float32", "float64", "float64"), ("float64", "float64", "float64"))
BACKWARD_TYPES = tuple(dict.fromkeys((t, r) for t, r, _ in FORWARD_TYPES))
REALS = ("float32", "float64")


# ---------------------------------------------------------------------------------------------
# Instances and signatures


def _flag(b):
    return "true" if b else "false"


def _forward_sig(t, r, o, ndim, nearest):
    name = (f"cutopo::sampling::forward<{_CTYPE[t]}, {_CTYPE[r]}, {_CTYPE[o]}, {ndim}, "
            f"{_flag(nearest)}>")
    return Signature(FAMILY, name, (f"ptr:{t}", f"ptr:{r}", f"ptr:{o}", "ptr:int32", "int64",
                                    "int64", "int64") + ("int32",) * 8)


def _check_sig(t):
    return Signature(FAMILY, f"cutopo::sampling::check_image<{_CTYPE[t]}>",
                     (f"ptr:{t}", "int64", "ptr:int32"))


def _backward_sig(t, r, ndim, nearest):
    name = f"cutopo::sampling::backward<{_CTYPE[t]}, {_CTYPE[r]}, {ndim}, {_flag(nearest)}>"
    return Signature(FAMILY, name, (f"ptr:{t}", f"ptr:{r}", f"ptr:{r}", f"ptr:{r}", f"ptr:{r}",
                                    "int64", "int64", "int64") + ("int32",) * 10)


def _keys_sig(r, key, ndim, nearest):
    ctype = "int" if key == "int32" else "long long"
    name = f"cutopo::sampling::entry_keys<{_CTYPE[r]}, {ctype}, {ndim}, {_flag(nearest)}>"
    return Signature(FAMILY, name, (f"ptr:{r}", f"ptr:{key}", f"ptr:{r}", "int64", "int64")
                     + ("int32",) * 5)


def _rows_sig(r):
    return Signature(FAMILY, f"cutopo::sampling::image_rows<{_CTYPE[r]}>",
                     (f"ptr:{r}", "ptr:int64", f"ptr:{r}", "ptr:int64", f"ptr:{r}", "int64", "int64",
                      "int64", "int64", "int32", "int32", "int32"))


def _instances():
    for ndim in (2, 3):
        for nearest in (False, True):
            for t, r, o in FORWARD_TYPES:
                yield _forward_sig(t, r, o, ndim, nearest).name
            for t, r in BACKWARD_TYPES:
                yield _backward_sig(t, r, ndim, nearest).name
            for r in REALS:
                for key in ("int32", "int64"):
                    yield _keys_sig(r, key, ndim, nearest).name
    for t in _CTYPE:
        yield _check_sig(t).name
    for r in REALS:
        yield _rows_sig(r).name


register_instances(FAMILY, _instances)


# ---------------------------------------------------------------------------------------------
# Plans


@functools.lru_cache(maxsize=256)
def _prepared(device_id, sig, n_threads, scalars):
    """A launch of one thread per item, every pointer given per call, memoized per device."""
    n_ptr = sum(1 for p in sig.params if p.startswith("ptr:"))
    return PreparedLaunch(sig, -(-n_threads // THREADS), THREADS,
                          (None,) * n_ptr + (n_threads,) + scalars)


def _device_threads():
    return device_attribute("MultiProcessorCount") * device_attribute("MaxThreadsPerMultiProcessor")


def channel_groups(items, C, *, split=True, multiple=1):
    """(groups, channels per group) for a launch over ``items`` points (or rows) times channel
    groups: one group when the items alone fill the device (or ``split`` is False), else enough
    groups to fill it, each a multiple of ``multiple`` channels."""
    if C <= 0:
        return 1, 1
    per = C
    if FORCE_PER_GROUP is not None and split:
        per = max(1, min(C, int(FORCE_PER_GROUP)))
    elif split and items > 0:
        want = -(-FILL * _device_threads() // items)
        if want > 1:
            per = -(-C // min(C, want))
            per = min(C, -(-per // multiple) * multiple)
    return -(-C // per), per


def _dims(spatial):
    """(d, h, w) as the kernels take them; 2-D images pass d = 1, which they ignore."""
    return (1,) + tuple(spatial) if len(spatial) == 2 else tuple(spatial)


def _narrow(n_threads, cfg):
    """1 when the forward/backward launch of ``n_threads`` threads can index with int32: every
    flattened image, output and grid index and the thread index below 2^31."""
    N, C, P, S = cfg.N, cfg.C, cfg.P, cfg.image.shape[2]
    biggest = max(n_threads, N * C * max(S, P), N * P * len(cfg.spatial))
    return int(not FORCE_WIDE_INDEX and biggest < 2**31)


def _common(cfg):
    """The scalars after the counts of the forward, backward and keys kernels."""
    return (PADDING_CODES[cfg.padding], int(cfg.align_corners)) + _dims(cfg.spatial)


# ---------------------------------------------------------------------------------------------
# Forward and backward


def forward(cfg):
    """(output of shape cfg.out_shape and dtype cfg.dtype, flags): flags has GRID_NONFINITE and
    IMAGE_NONFINITE set when the grid or the image holds a NaN or inf (one device-to-host copy)."""
    import cupy

    image, grid = cfg.image, cfg.grid
    t, r, o = image.dtype.name, cfg.real.name, np.dtype(cfg.dtype).name
    ndim = len(cfg.spatial)
    with image.device:
        device = cupy.cuda.Device().id
        out = cupy.empty(cfg.out_shape, dtype=o)
        flags = cupy.zeros(1, dtype=np.int32)
        if image.size:
            n = image.size
            blocks = min(-(-n // THREADS), FILL * _device_threads() // THREADS)
            launch = _prepared_blocks(device, _check_sig(t), blocks, n)
            launch(image, flags)
        NP = cfg.N * cfg.P
        if NP:
            groups, per = channel_groups(NP, cfg.C)
            plan = _prepared(device, _forward_sig(t, r, o, ndim, cfg.nearest), groups * NP,
                             (NP, cfg.P, cfg.C, per) + _common(cfg) + (_narrow(groups * NP, cfg),))
            plan(image, grid, out, flags)
        return out, int(flags.get()[0])


@functools.lru_cache(maxsize=64)
def _prepared_blocks(device_id, sig, blocks, n):
    """check_image: a grid-stride launch of ``blocks`` blocks over ``n`` elements."""
    return PreparedLaunch(sig, blocks, THREADS, (None, n, None))


def backward(cfg, g, needs):
    """(d_image (N, C, *spatial), d_grid (N, *out, ndim)) in the computation dtype, None where
    not asked for. ``g`` is the output cotangent (a CuPy array of the output's shape)."""
    import cupy

    need_image, need_grid = needs
    image, grid = cfg.image, cfg.grid
    t, r = image.dtype.name, cfg.real.name
    ndim = len(cfg.spatial)
    N, C, P = cfg.N, cfg.C, cfg.P
    S = image.shape[2]
    NP = N * P
    with image.device:
        device = cupy.cuda.Device().id
        g = cupy.ascontiguousarray(g.reshape(N, C, P), dtype=r)
        dummy = cupy.empty(0, dtype=r)
        atomic = need_image and not cfg.deterministic
        d_image = cupy.zeros((N, C, S), dtype=r) if atomic else None
        d_grid = cupy.empty((NP, ndim), dtype=r) if need_grid else None
        if NP and (atomic or need_grid):
            # The grid cotangent sums over every channel of a point in one thread: no split then.
            groups, per = channel_groups(NP, C, split=not need_grid)
            plan = _prepared(device, _backward_sig(t, r, ndim, cfg.nearest), groups * NP,
                             (NP, P, C, per) + _common(cfg)
                             + (int(atomic), int(need_grid), _narrow(groups * NP, cfg)))
            plan(image, grid, g, d_image if atomic else dummy, d_grid if need_grid else dummy)
        if need_image and cfg.deterministic:
            d_image = _sorted_image_cotangent(cfg, g, device)
    if need_image:
        d_image = d_image.reshape((N, C) + tuple(cfg.spatial))
    if need_grid:
        d_grid = d_grid.reshape(cfg.out_shape[:1] + cfg.out_shape[2:] + (ndim,))
    return d_image, d_grid


def _sorted_image_cotangent(cfg, g, device):
    """The image cotangent without atomics: bitwise reproducible."""
    import cupy

    r = cfg.real.name
    ndim = len(cfg.spatial)
    N, C, P = cfg.N, cfg.C, cfg.P
    S = cfg.image.shape[2]
    NP, rows = N * P, N * S
    log2_k = 0 if cfg.nearest else ndim
    d_image = cupy.empty((N, C, S), dtype=r)
    if rows * C == 0:
        return d_image
    if NP == 0:
        d_image.fill(0)
        return d_image
    key = "int32" if rows <= KEY32_MAX_ROWS else "int64"
    n_entries = NP << log2_k
    keys = cupy.empty(n_entries, dtype=key)
    weights = cupy.empty(n_entries, dtype=r)
    plan = _prepared(device, _keys_sig(r, key, ndim, cfg.nearest), NP, (P,) + _common(cfg))
    plan(cfg.grid, keys, weights)
    ent = cupy.argsort(keys)  # stable: a row's entries keep the order of their ids
    seg = cupy.searchsorted(keys[ent], cupy.arange(rows + 1, dtype=key))
    del keys
    groups, per = channel_groups(rows, C, multiple=ROW_CHANNELS)
    plan = _prepared(device, _rows_sig(r), groups * rows, (rows, S, P, C, per, log2_k))
    plan(g, ent, weights, seg, d_image)
    return d_image
