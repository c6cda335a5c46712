"""Multi-camera, multi-scale deformable aggregation (the Sparse4D operator), with its VJP.

``out[b, a, c] = sum over points p, cameras k, scales s of
weights[b, a, p, k, s, g(c)] * bilinear sample of map (k, s) of batch b at sampling_locations[b, a, p, k]``,
channel c using weight group g(c) = c // (C / G). NumPy arrays take the vectorised NumPy path
below (the CPU fallback and the oracle of the GPU tests); CuPy arrays the kernels of
``cuda_src/deformable.cu`` (:mod:`cutopo._deformable_cupy`). The VJP with respect to features,
sampling locations and weights goes through :func:`cutopo.vjp`.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np

from ._array import as_array, is_cupy_array, to_numpy
from ._cuda.repeated import RepeatedCalls
from .vjp import register

__all__ = ["deformable_aggregation"]

BOUNDARIES = ("sparse4d", "zeros")
LEVEL_LAYOUTS = ("channels_first", "channels_last")
_FLOAT_NAMES = ("float16", "bfloat16", "float32", "float64")
_INT32_MAX = 2**31 - 1

# Entries ((b, a, p) triples) per chunk of the NumPy path, divided by C: bounds its temporaries
# (a few (entries, C) arrays per corner) to tens of megabytes.
_CHUNK_VALUES = 1 << 21


class _Config(NamedTuple):
    features: object        # flat (bs, num_feat, C) array, or tuple of per-level arrays
    flat: bool              # the flattened form
    channels_first: bool    # per-level arrays are (bs, K, C, H, W) (list form only)
    shapes: np.ndarray      # (K, S, 2) int64 (H, W), host
    starts: np.ndarray      # (K, S) int64 first row of each map in the flattened form, host
    num_feat: int           # rows per batch element of the flattened form (sum of maps in the list form)
    loc: object             # (bs, A, P, K, 2) as given
    weights: object         # (bs, A, P, K, S, G) as given
    bs: int
    A: int
    P: int
    K: int
    S: int
    C: int
    G: int
    dtype: np.dtype         # output dtype
    real: np.dtype          # computation dtype: float32 or float64
    boundary: int           # 0: "sparse4d", 1: "zeros"
    deterministic: bool
    gpu: bool
    memo: object = None     # the call kind's _Memo (see _configure), None when not memoized


# ---------------------------------------------------------------------------------------------
# Validation


@functools.lru_cache(maxsize=None)
def _dtype_name(dtype) -> str:
    # numpy computes dtype.name afresh at every access (~5 us, the largest host cost of a call)
    return dtype.name


def _float_array(x, name):
    x = as_array(x, name)
    if _dtype_name(x.dtype) not in _FLOAT_NAMES:
        raise TypeError(f"{name}: dtype {x.dtype} is not supported "
                        f"(use float16, bfloat16, float32 or float64)")
    return x


def _int_table(x, name):
    """(host int64 copy, the array as given)."""
    if x is None:
        raise ValueError(f"{name} is required with flattened features")
    x = as_array(x, name)
    if x.dtype.kind not in "iu":
        raise TypeError(f"{name}: dtype {x.dtype} is not an integer type")
    host = to_numpy(x)  # one device-to-host copy for a CuPy table
    if host.dtype.kind == "u" and host.size and host.max() > np.iinfo(np.int64).max:
        raise ValueError(f"{name}: values exceed the int64 range")
    return host.astype(np.int64), x


def _promote(dtypes):
    """Output dtype: float64 if any argument is float64; the common 2-byte type if all share one;
    else float32."""
    names = {_dtype_name(d) for d in dtypes}
    if "float64" in names:
        return np.dtype(np.float64)
    if len(names) == 1 and names <= {"float16", "bfloat16"}:
        return dtypes[0]
    return np.dtype(np.float32)


def _check_bool(x, name):
    if not isinstance(x, (bool, np.bool_)):
        raise TypeError(f"{name} must be True or False, got {x!r}")
    return bool(x)


@functools.lru_cache(maxsize=256)
def _check_maps(shapes_bytes, shapes_shape, starts_bytes, starts_shape, num_feat):
    """Validate the (int64) map tables against ``num_feat``; memoized, as a training loop passes
    the same tables every call."""
    shapes = np.frombuffer(shapes_bytes, dtype=np.int64).reshape(shapes_shape)
    starts = np.frombuffer(starts_bytes, dtype=np.int64).reshape(starts_shape)
    if shapes.ndim != 3 or shapes.shape[-1] != 2:
        raise ValueError(f"spatial_shapes must have shape (K, S, 2) (H, W per camera and scale), got {shapes.shape}")
    K, S = shapes.shape[:2]
    if K < 1 or S < 1:
        raise ValueError(f"spatial_shapes must describe at least one camera and scale, got shape {shapes.shape}")
    if np.any(shapes < 1) or np.any(shapes > _INT32_MAX):
        raise ValueError(f"spatial_shapes: every H and W must be in [1, 2^31 - 1], got {shapes.tolist()}")
    if starts.shape != (K, S):
        raise ValueError(f"level_start_index must have shape (K, S) = {(K, S)} like spatial_shapes, got {starts.shape}")
    pixels = shapes[..., 0] * shapes[..., 1]  # < 2^62: no overflow
    bad = (starts < 0) | (starts > num_feat) | (pixels > num_feat - np.clip(starts, 0, num_feat))
    if np.any(bad):
        k, s = np.argwhere(bad)[0]
        raise ValueError(f"level_start_index/spatial_shapes: map (camera {k}, scale {s}) covers rows "
                         f"[{starts[k, s]}, {starts[k, s]} + {pixels[k, s]}) outside the {num_feat} "
                         "rows of features")
    return True


def _prepare(features, spatial_shapes, level_start_index, sampling_locations, weights,
             boundary, deterministic, level_layout) -> _Config:
    if not isinstance(boundary, str) or boundary not in BOUNDARIES:
        raise ValueError(f"boundary must be 'sparse4d' or 'zeros', got {boundary!r}")
    deterministic = _check_bool(deterministic, "deterministic")
    if not isinstance(level_layout, str) or level_layout not in LEVEL_LAYOUTS:
        raise ValueError(f"level_layout must be 'channels_first' or 'channels_last', got {level_layout!r}")

    loc = _float_array(sampling_locations, "sampling_locations")
    wts = _float_array(weights, "weights")
    if loc.ndim != 5 or loc.shape[-1] != 2:
        raise ValueError(f"sampling_locations must have shape (bs, A, P, K, 2), got {loc.shape}")
    if wts.ndim != 6:
        raise ValueError(f"weights must have shape (bs, A, P, K, S, G), got {wts.shape}")
    gpu = is_cupy_array(loc)
    if is_cupy_array(wts) != gpu:
        raise TypeError("weights and sampling_locations must both be NumPy or both CuPy arrays")

    flat = not isinstance(features, (list, tuple))
    if flat:
        feats = _float_array(features, "features")
        if feats.ndim != 3:
            raise ValueError(f"features must have shape (bs, num_feat, C) or be a list of per-level "
                             f"arrays, got shape {feats.shape}")
        if is_cupy_array(feats) != gpu:
            raise TypeError("features and sampling_locations must both be NumPy or both CuPy arrays")
        levels = (feats,)
        bs, num_feat, C = feats.shape
    else:
        if len(features) == 0:
            raise ValueError("features: an empty list of levels")
        levels = tuple(_float_array(f, f"features[{i}]") for i, f in enumerate(features))
        for i, f in enumerate(levels):
            if is_cupy_array(f) != gpu:
                raise TypeError(f"features[{i}] and sampling_locations must both be NumPy or both CuPy arrays")
            if f.ndim != 5:
                raise ValueError(f"features[{i}] must have shape (bs, K, C, H, W) (level_layout="
                                 f"'channels_first') or (bs, K, H, W, C) ('channels_last'), got {f.shape}")
            if f.dtype != levels[0].dtype:
                raise TypeError(f"features[{i}] has dtype {f.dtype}, features[0] {levels[0].dtype}: "
                                "every level must have one dtype")
        cf = level_layout == "channels_first"
        bs, K_f = levels[0].shape[:2]
        C = levels[0].shape[2] if cf else levels[0].shape[4]
        hw = []
        for i, f in enumerate(levels):
            c_i, (h, w) = (f.shape[2], f.shape[3:]) if cf else (f.shape[4], f.shape[2:4])
            if f.shape[:2] != (bs, K_f) or c_i != C:
                raise ValueError(f"features[{i}] has shape {f.shape}, inconsistent with features[0] "
                                 f"{levels[0].shape} (level_layout={level_layout!r})")
            hw.append((h, w))
        derived = np.array([[hw[s] for s in range(len(levels))]] * K_f, dtype=np.int64).reshape(K_f, len(levels), 2)
        pix = derived[..., 0] * derived[..., 1]
        per_cam = pix.sum(axis=1)
        derived_starts = (np.arange(K_f)[:, None] * per_cam[:, None]
                          + np.cumsum(pix, axis=1) - pix).astype(np.int64)
        num_feat = int(per_cam.sum())

    # spatial_shapes and level_start_index
    if flat:
        shapes, shapes_arr = _int_table(spatial_shapes, "spatial_shapes")
        starts, starts_arr = _int_table(level_start_index, "level_start_index")
    else:
        shapes = derived
        starts = derived_starts
        shapes_arr = starts_arr = None
        if spatial_shapes is not None:
            given, shapes_arr = _int_table(spatial_shapes, "spatial_shapes")
            if given.shape != derived.shape or not np.array_equal(given, derived):
                raise ValueError(f"spatial_shapes {given.tolist()} disagrees with the shapes of the "
                                 f"feature levels {derived.tolist()} (pass None to derive them)")
        if level_start_index is not None:
            given, starts_arr = _int_table(level_start_index, "level_start_index")
            if given.shape != derived_starts.shape or not np.array_equal(given, derived_starts):
                raise ValueError(f"level_start_index {given.tolist()} is not the camera-major "
                                 f"flattening {derived_starts.tolist()} of the feature levels "
                                 "(pass None to derive it)")
    for arr, name in ((shapes_arr, "spatial_shapes"), (starts_arr, "level_start_index")):
        if arr is not None and is_cupy_array(arr) and not gpu:
            raise TypeError(f"{name} is a CuPy array but the features are not: move both to one device")
    _check_maps(shapes.tobytes(), shapes.shape, starts.tobytes(), starts.shape, num_feat)
    K, S = shapes.shape[:2]
    if not flat and K != K_f:
        raise ValueError(f"features levels have {K_f} cameras, spatial_shapes {K}")

    # Shapes of locations and weights
    bs_l, A, P, K_l = loc.shape[:4]
    if bs_l != bs:
        raise ValueError(f"sampling_locations has batch {bs_l}, features {bs}")
    if K_l != K:
        # the cameras come from spatial_shapes, or from the feature levels when they are a list
        source = "spatial_shapes" if flat else "the feature levels"
        raise ValueError(f"sampling_locations has {K_l} cameras, {source} {K}")
    if wts.shape[:5] != (bs, A, P, K, S):
        raise ValueError(f"weights must have shape (bs, A, P, K, S, G) = ({bs}, {A}, {P}, {K}, {S}, G), "
                         f"got {wts.shape}")
    G = wts.shape[5]
    if G < 1:
        raise ValueError("weights: the group axis G must not be empty")
    if C % G:
        raise ValueError(f"weights: the {G} groups must divide the C = {C} channels of features "
                         f"(C % G = {C % G})")
    if gpu:
        if any(x.size and x.device.id != loc.device.id for x in levels + (wts,)):
            raise ValueError("features, sampling_locations and weights must be on one device")

    dtype = _promote([levels[0].dtype, loc.dtype, wts.dtype])
    real = np.dtype(np.float64 if dtype == np.float64 else np.float32)
    return _Config(levels[0] if flat else levels, flat, (not flat) and level_layout == "channels_first",
                   shapes, starts, num_feat, loc, wts, bs, A, P, K, S, C, G, dtype, real,
                   BOUNDARIES.index(boundary), deterministic, gpu)


# ---------------------------------------------------------------------------------------------
# Memoized validation: a training loop calls the op with the same shapes, dtypes, tables and
# options every step, and at batch 1 on the GPU the checks above cost more than the kernel.


class _Memo:
    """What validating one kind of call found: ``head`` and ``tail``, the fields of its
    _Config around the arrays (features | head | loc, weights | tail), and ``plans``, where the
    CUDA path keeps launch plans for calls of this kind (keyed by what else they depend on)."""

    __slots__ = ("head", "tail", "plans")

    def __init__(self, cfg: _Config):
        self.head = tuple(cfg[1:6])
        self.tail = tuple(cfg[8:-1]) + (self,)
        self.plans = {}


_MEMO = RepeatedCalls(256)  # call kinds remembered (the oldest is dropped first)


@functools.lru_cache(maxsize=None)
def _cupy_ndarray():
    """cupy.ndarray, or a class nothing is an instance of when CuPy is missing."""
    try:
        import cupy
    except ImportError:
        return type("_NoCupy", (), {})
    return cupy.ndarray


def _call_key(features, spatial_shapes, level_start_index, loc, weights, boundary,
              deterministic, level_layout):
    """What _prepare's outcome depends on, as a hashable key, or None for calls left to the
    full checks every time (per-level features, array-likes, array subclasses, CuPy tables).

    The key holds the array types, shapes, dtypes and devices, the tables' values (their
    bytes: NumPy tables only, so building it needs no device-to-host copy) and the options.
    _prepare reads nothing else from its arguments, so a call with a known key passes it.
    """
    kind = type(features)
    if type(loc) is not kind or type(weights) is not kind:
        return None
    if kind is np.ndarray:
        devices = None
    elif kind is _cupy_ndarray():
        devices = (features.device.id, loc.device.id, weights.device.id)
    else:
        return None
    if type(spatial_shapes) is not np.ndarray or type(level_start_index) is not np.ndarray:
        return None
    if type(boundary) is not str or type(level_layout) is not str or type(deterministic) is not bool:
        return None
    return (kind, devices, features.shape, features.dtype, loc.shape, loc.dtype, weights.shape,
            weights.dtype, spatial_shapes.dtype, spatial_shapes.shape, spatial_shapes.tobytes(),
            level_start_index.dtype, level_start_index.shape, level_start_index.tobytes(),
            boundary, deterministic, level_layout)


def _configure(features, spatial_shapes, level_start_index, sampling_locations, weights,
               boundary, deterministic, level_layout) -> _Config:
    """_prepare, memoized per kind of call (_call_key): a repeated call only builds its key.
    Same results and errors as _prepare (failing calls are never remembered)."""
    key = _call_key(features, spatial_shapes, level_start_index, sampling_locations, weights,
                    boundary, deterministic, level_layout)
    if key is not None:
        memo = _MEMO.get(key)
        if memo is not None:
            return tuple.__new__(_Config, (features,) + memo.head + (sampling_locations, weights)
                                 + memo.tail)
    cfg = _prepare(features, spatial_shapes, level_start_index, sampling_locations, weights,
                   boundary, deterministic, level_layout)
    if key is not None:
        # the host tables are shared by every later call of this kind
        cfg.shapes.flags.writeable = False
        cfg.starts.flags.writeable = False
        memo = _Memo(cfg)
        cfg = cfg._replace(memo=memo)
        _MEMO.keep(key, memo)
    return cfg


# ---------------------------------------------------------------------------------------------
# NumPy path


def _map_views(cfg: _Config):
    """Yield (k, s, H, W, view, start) for every map: ``view`` is (bs, H W, C) (channels-last)
    or (bs, C, H W) (channels-first): views of the input, no copy of the features."""
    for k in range(cfg.K):
        for s in range(cfg.S):
            H, W = (int(n) for n in cfg.shapes[k, s])
            start = int(cfg.starts[k, s])
            if cfg.flat:
                view = cfg.features[:, start:start + H * W, :]
            elif cfg.channels_first:
                view = cfg.features[s][:, k].reshape(cfg.bs, cfg.C, H * W)
            else:
                view = cfg.features[s][:, k].reshape(cfg.bs, H * W, cfg.C)
            yield k, s, H, W, view, start


def _gather(cfg: _Config, view, b, pix):
    """(N, C) feature rows of the entries (batch b, pixel pix) in the computation dtype."""
    rows = view[b, :, pix] if cfg.channels_first else view[b, pix]
    return rows.astype(cfg.real, copy=False)


class _Cells(NamedTuple):
    idx: np.ndarray      # entries (positions in the chunk) that read something
    hx: np.ndarray
    lx: np.ndarray
    hy: np.ndarray
    ly: np.ndarray
    pix: list            # four arrays: pixel index y W + x of each corner
    ok: list             # four boolean arrays: corner inside the map


def _cells(u, v, H, W, real, sparse4d) -> _Cells:
    """Bilinear set-up of the entries with locations (u, v) on an H x W map.

    x = u W - 1/2 and y = v H - 1/2 rounded once per operation in the computation dtype (the
    kernels do the same). An entry reads something when -1 < x < W and -1 < y < H; with
    ``sparse4d`` also only when 0 < u < 1 and 0 < v < 1. NaN fails both tests.
    """
    with np.errstate(over="ignore"):  # a huge finite location overflows to +-inf: outside
        x = u * real.type(W) - real.type(0.5)
        y = v * real.type(H) - real.type(0.5)
    keep = (x > -1) & (x < W) & (y > -1) & (y < H)
    if sparse4d:
        keep &= (u > 0) & (u < 1) & (v > 0) & (v < 1)
    idx = np.flatnonzero(keep)
    x, y = x[idx], y[idx]
    fx0, fy0 = np.floor(x), np.floor(y)
    lx, ly = x - fx0, y - fy0
    hx, hy = real.type(1) - lx, real.type(1) - ly
    x0, y0 = fx0.astype(np.int64), fy0.astype(np.int64)
    pix, ok = [], []
    for dy in (0, 1):
        for dx in (0, 1):
            cy, cx = y0 + dy, x0 + dx
            ok.append((cy >= 0) & (cy < H) & (cx >= 0) & (cx < W))
            pix.append(cy * W + cx)
    return _Cells(idx, hx, lx, hy, ly, pix, ok)


def _corner_weights(c: _Cells):
    return (c.hy * c.hx, c.hy * c.lx, c.ly * c.hx, c.ly * c.lx)


def _chunks(cfg: _Config):
    n3 = cfg.bs * cfg.A * cfg.P
    step = max(1, _CHUNK_VALUES // max(cfg.C, 1))
    for n0 in range(0, n3, step):
        yield n0, min(n3, n0 + step)


def _visible(cfg: _Config):
    """The entries that read something, per chunk of (b, a, p) entries and per map: yield
    (k, s, H, W, view, start, cell, n, b, ba, wt) with ``cell`` their bilinear cells (see
    _cells), ``n`` their flat (b, a, p) indices, ``b`` their batch, ``ba`` their (b, a) output
    row and ``wt`` (N, G) their weights for the map, in the computation dtype."""
    real = cfg.real
    loc = cfg.loc.reshape(-1, cfg.K, 2)
    wts = cfg.weights.reshape(-1, cfg.K, cfg.S, cfg.G)
    maps = list(_map_views(cfg))
    for n0, n1 in _chunks(cfg):
        lc = loc[n0:n1].astype(real)
        for k, s, H, W, view, start in maps:
            cell = _cells(lc[:, k, 0], lc[:, k, 1], H, W, real, cfg.boundary == 0)
            if cell.idx.size == 0:
                continue
            n = n0 + cell.idx
            b, ba = n // (cfg.A * cfg.P), n // cfg.P
            yield k, s, H, W, view, start, cell, n, b, ba, wts[n, k, s].astype(real)


def _segment_add(target, rows, values):
    """target[rows] += values with repeated rows summed (sorted, then reduceat)."""
    if rows.size == 0:
        return
    order = np.argsort(rows, kind="stable")
    rows, values = rows[order], values[order]
    first = np.flatnonzero(np.r_[True, rows[1:] != rows[:-1]])
    target[rows[first]] += np.add.reduceat(values, first, axis=0)


def _forward_numpy(cfg: _Config):
    real, C, G = cfg.real, cfg.C, cfg.G
    CG = C // G
    out = np.zeros((cfg.bs * cfg.A, C), dtype=real)
    for k, s, _, _, view, _, cell, n, b, ba, wt in _visible(cfg):
        contrib = np.zeros((n.size, G, CG), dtype=real)
        for i, w in enumerate(_corner_weights(cell)):
            sel = np.flatnonzero(cell.ok[i])
            vals = _gather(cfg, view, b[sel], cell.pix[i][sel]).reshape(-1, G, CG)
            contrib[sel] += (wt[sel] * w[sel, None])[:, :, None] * vals  # (wt * corner weight) * value, as the kernel
        _segment_add(out, ba, contrib.reshape(-1, C))
    return out.reshape(cfg.bs, cfg.A, C)


def _backward_numpy(cfg: _Config, g, needs):
    need_feat, _, _, need_loc, need_wt = needs
    real, C, G = cfg.real, cfg.C, cfg.G
    CG = C // G
    g2 = np.asarray(g).astype(real).reshape(cfg.bs * cfg.A, C)
    n3 = cfg.bs * cfg.A * cfg.P
    d_feat = np.zeros((cfg.bs * cfg.num_feat, C), dtype=real) if need_feat else None
    d_loc = np.zeros((n3, cfg.K, 2), dtype=real) if need_loc else None
    d_wt = np.zeros((n3, cfg.K, cfg.S, G), dtype=real) if need_wt else None
    for k, s, H, W, view, start, cell, n, b, ba, wt in _visible(cfg):
        go = g2[ba].reshape(-1, G, CG)
        cw = _corner_weights(cell)
        if need_loc or need_wt:
            vals = []
            for i in range(4):
                v = np.zeros((n.size, G, CG), dtype=real)
                sel = np.flatnonzero(cell.ok[i])
                v[sel] = _gather(cfg, view, b[sel], cell.pix[i][sel]).reshape(-1, G, CG)
                vals.append(v)
            v00, v01, v10, v11 = vals
            if need_wt:
                bil = (cw[0][:, None, None] * v00 + cw[1][:, None, None] * v01
                       + cw[2][:, None, None] * v10 + cw[3][:, None, None] * v11)
                d_wt[n, k, s] = (go * bil).sum(axis=2)
            if need_loc:
                tg = go * wt[:, :, None]
                ddx = cell.hy[:, None, None] * (v01 - v00) + cell.ly[:, None, None] * (v11 - v10)
                ddy = cell.hx[:, None, None] * (v10 - v00) + cell.lx[:, None, None] * (v11 - v01)
                d_loc[n, k, 0] += real.type(W) * (tg * ddx).sum(axis=(1, 2))
                d_loc[n, k, 1] += real.type(H) * (tg * ddy).sum(axis=(1, 2))
        if need_feat:
            rows, values = [], []
            for i in range(4):
                sel = np.flatnonzero(cell.ok[i])
                rows.append(b[sel] * cfg.num_feat + start + cell.pix[i][sel])
                values.append(((wt[sel] * cw[i][sel, None])[:, :, None] * go[sel]).reshape(-1, C))
            _segment_add(d_feat, np.concatenate(rows), np.concatenate(values))
    return (d_feat.reshape(cfg.bs, cfg.num_feat, C) if need_feat else None,
            d_loc.reshape(cfg.loc.shape) if need_loc else None,
            d_wt.reshape(cfg.weights.shape) if need_wt else None)


# ---------------------------------------------------------------------------------------------
# Forward and backward (registered with cutopo.vjp)


@functools.lru_cache(maxsize=None)
def _cupy_module():
    """:mod:`cutopo._deformable_cupy`, imported on the first CuPy call (it needs CuPy)."""
    from . import _deformable_cupy

    return _deformable_cupy


def _empty(cfg: _Config):
    """True when the output is all zeros without any work (no anchors, points or channels)."""
    return cfg.bs * cfg.A * cfg.C == 0 or cfg.P == 0


def _forward(features, spatial_shapes, level_start_index, sampling_locations, weights, *,
             boundary="sparse4d", deterministic=False, level_layout="channels_first"):
    cfg = _configure(features, spatial_shapes, level_start_index, sampling_locations, weights,
                     boundary, deterministic, level_layout)
    if cfg.gpu:
        if _empty(cfg):
            import cupy

            return cupy.zeros((cfg.bs, cfg.A, cfg.C), dtype=cfg.dtype), cfg
        out = _cupy_module().forward(cfg)
        return (out if out.dtype == cfg.dtype else out.astype(cfg.dtype)), cfg
    if _empty(cfg):
        return np.zeros((cfg.bs, cfg.A, cfg.C), dtype=cfg.dtype), cfg
    return _forward_numpy(cfg).astype(cfg.dtype, copy=False), cfg


def _split_levels(cfg: _Config, d_flat, xp):
    """Per-level form: the flat (bs, num_feat, C) feature cotangent (maps camera-major, as
    ``cfg.starts`` lays them out) as one array per level, in that level's layout."""
    per_camera = d_flat.reshape(cfg.bs, cfg.K, cfg.num_feat // cfg.K, cfg.C)
    levels = []
    for s in range(cfg.S):
        H, W = (int(n) for n in cfg.shapes[0, s])
        first = int(cfg.starts[0, s])
        d = per_camera[:, :, first:first + H * W].reshape(cfg.bs, cfg.K, H, W, cfg.C)
        if cfg.channels_first:
            d = d.transpose(0, 1, 4, 2, 3)
        levels.append(xp.ascontiguousarray(d))
    return levels


def _backward(cfg: _Config, g, needs):
    sub = (needs[0], False, False, needs[3], needs[4])
    if not any(sub):
        return (None,) * 5
    xp = np
    if cfg.gpu:
        import cupy as xp
    if _empty(cfg):
        zeros = lambda a: xp.zeros(a.shape, dtype=cfg.real)  # noqa: E731
        d_feat = None
        if needs[0]:
            d_feat = zeros(cfg.features) if cfg.flat else [zeros(f) for f in cfg.features]
        return (d_feat, None, None, zeros(cfg.loc) if sub[3] else None,
                zeros(cfg.weights) if sub[4] else None)
    if cfg.gpu:
        d_feat, d_loc, d_wt = _cupy_module().backward(cfg, g, sub)
    else:
        d_feat, d_loc, d_wt = _backward_numpy(cfg, g, sub)
    if d_feat is not None and not cfg.flat:
        d_feat = _split_levels(cfg, d_feat, xp)
    return d_feat, None, None, d_loc, d_wt


def _meta(features, spatial_shapes, level_start_index, sampling_locations, weights, *,
          boundary="sparse4d", deterministic=False, level_layout="channels_first"):
    """Output (shape, dtype) from the arguments' shapes and dtypes (see cutopo.vjp.OpSpec):
    (bs, A, C) with C from the (first level of the) features, dtype as _prepare promotes.

    First _prepare's checks (options, dtypes, ranks, shapes against one another), on data-free
    stand-ins: a bad argument raises the op's own error before the op runs. The map tables'
    values are unknown here: their stand-ins (every map 1 x 1, starting at row 0) pass the
    checks of values whenever the features have a row, so those are left to the op."""
    from ._adapters import stand_in

    flat = hasattr(features, "shape")  # an array (the adapters' specs are NamedTuples: tuples)
    if flat:
        tables = (stand_in(spatial_shapes, 1), stand_in(level_start_index, 0))
    else:  # per-level features: _prepare checks given tables against the levels' own values
        tables = (None, None)
    _prepare(stand_in(features) if flat else [stand_in(f) for f in features], *tables,
             stand_in(sampling_locations), stand_in(weights), boundary, deterministic, level_layout)
    if hasattr(features, "shape"):  # an array (the adapters' array specs are NamedTuples)
        first = features
        C = first.shape[2]
    else:
        first = features[0]
        C = first.shape[2] if level_layout == "channels_first" else first.shape[4]
    bs, A = sampling_locations.shape[:2]
    return (bs, A, C), _promote([first.dtype, sampling_locations.dtype, weights.dtype])


# ---------------------------------------------------------------------------------------------
# Public op


@register(name="deformable_aggregation", forward=_forward, backward=_backward,
          arg_names=("features", "spatial_shapes", "level_start_index", "sampling_locations", "weights"),
          differentiable=("features", "sampling_locations", "weights"), meta=_meta)
def deformable_aggregation(features, spatial_shapes, level_start_index, sampling_locations, weights,
                           *, boundary="sparse4d", deterministic=False, level_layout="channels_first"):
    r"""Multi-camera, multi-scale deformable aggregation (the Sparse4D operator).

    Every anchor a of batch element b gathers, for each of its P points and K cameras, a
    bilinear sample of each of the S feature maps of that camera, weighs it per channel group
    and sums:

        out[b, a, c] = sum_{p, k, s} weights[b, a, p, k, s, c // (C / G)]
                       * bilinear_{k, s}(b; sampling_locations[b, a, p, k])[c].

    Differentiable in ``features``, ``sampling_locations`` and ``weights`` through
    :func:`cutopo.vjp`; the pullback computes only the cotangents asked for with ``wrt``.

    Parameters
    ----------
    features : ndarray (bs, num_feat, C), or list of S per-level arrays
        Flattened form: every camera's maps, channels last; pixel (y, x) of map (k, s) of batch
        element b is row ``level_start_index[k, s] + y * W + x``. Per-level form (the FPN
        output, as Sparse4D's ``feature_maps_format`` takes it): a list or tuple of S arrays
        (bs, K, C, H_s, W_s) (``level_layout="channels_first"``) or (bs, K, H_s, W_s, C)
        (``"channels_last"``), read in place without a flattening copy (the CUDA kernels reach
        the levels through offsets from the first level's pointer; a level that is not
        C-contiguous is copied). dtype float16, bfloat16 (``ml_dtypes``), float32 or float64.
    spatial_shapes : integer array (K, S, 2)
        (H, W) of every camera's map at every scale; cameras may differ. Per-level form: None
        (derived from the arrays) or equal to the derived shapes. NumPy is best for CuPy
        features too: a CuPy table costs a device-to-host copy (a synchronisation) per call
        for its validation, while with NumPy tables a repeated call (same shapes, dtypes,
        tables and options) skips the checks and, on CUDA, the launch planning.
    level_start_index : integer array (K, S)
        First row of every map in ``features`` (flattened form). Per-level form: None, or the
        camera-major flattening ``feature_maps_format`` would produce (checked).
    sampling_locations : ndarray (bs, A, P, K, 2)
        Normalised image coordinates (u, v) of every point in every camera, x (width) first;
        see *Convention*. Non-finite values are allowed (see *Boundary*).
    weights : ndarray (bs, A, P, K, S, G)
        One weight per point, camera, scale and channel group; G must divide C.
    boundary : {"sparse4d", "zeros"}, optional
        ``"sparse4d"`` (default, the reference CUDA op): a (point, camera) pair contributes
        only when 0 < u < 1 and 0 < v < 1 (open interval), at every scale; inside, corners off
        the map read 0. ``"zeros"``: plain zero padding, the semantics of
        ``grid_sample(2 * loc - 1, padding_mode="zeros", align_corners=False)`` (the
        reference's PyTorch fallback), which also samples the half-pixel band outside the
        image.
    deterministic : bool, optional
        CuPy arrays: compute the feature cotangent without atomics (entries sorted by the
        feature row they touch, then summed in that fixed order), bitwise reproducible from
        run to run. The default scatters it with atomic additions (faster; the summation order,
        hence the last bits, vary). The forward and the location and weight cotangents are
        always deterministic; so is the whole NumPy path.
    level_layout : {"channels_first", "channels_last"}, optional
        Axis order of the per-level arrays (ignored for the flattened form).

    Returns
    -------
    out : ndarray (bs, A, C)
        Of the inputs' array type. dtype float64 if any of features, sampling_locations and
        weights is float64; float16 (bfloat16) if all three are; else float32. The sums are
        accumulated in float32 (float64 for float64 outputs) whatever the storage dtype.

    Notes
    -----
    *Convention.* ``(u, v) = sampling_locations[..., 0:2]`` with u along the width (x) and v
    along the height (y); u = 0 is the left edge of the image, u = 1 the right edge, and pixel
    centre i is at u = (i + 0.5) / W (align_corners=False). On map (k, s) of size (H, W) the
    sample point is x = u W - 0.5, y = v H - 0.5 in pixel units (computed as two roundings,
    identically by both backends), and

        bilinear = (1-ly)(1-lx) F[y0, x0] + (1-ly) lx F[y0, x0+1] + ly (1-lx) F[y0+1, x0] + ly lx F[y0+1, x0+1]

    with x0 = floor(x), lx = x - x0 (same for y) and F = 0 outside the map (per corner).

    *Boundary.* A sample with x <= -1, x >= W, y <= -1 or y >= H reads nothing (all four
    corners are off the map). NaN and infinite locations contribute 0 and get zero
    cotangents in both modes (every comparison with NaN is false); no error is raised, so a
    NaN from an upstream projection silently drops that (point, camera) pair. The op is
    piecewise bilinear in the locations: its derivative jumps where x or y crosses a pixel
    centre, and with ``"sparse4d"`` the value jumps at u, v in {0, 1}; the VJP there is the
    derivative of the cell the point is in, except at x = -1 or y = -1 exactly, which read
    nothing (the reference's -1 < x test): there the sample adds its left-hand derivative, 0.

    *VJP.* ``cutopo.vjp(deformable_aggregation, *args, wrt=...)`` returns the cotangents of
    the arguments named in ``wrt`` (default: features, sampling_locations, weights; the
    integer tables get None). Only those are computed: leaving out features skips the whole
    feature scatter (no feature-sized buffer), leaving out locations and weights skips the
    corner reads. Cotangents are accumulated in float32 (float64) and returned in their
    argument's dtype (float16 and bfloat16 arguments: float32 buffers inside, rounded once
    at the end; a bfloat16 output takes a bfloat16 cotangent). With the per-level form the
    feature cotangent is a list (a tuple for a tuple of levels) with one array per level,
    each in its level's shape, layout (``level_layout``), dtype and array type; it is
    computed in the flattened layout and then split (one copy of the feature-sized
    cotangent; on CUDA also one more kernel launch, which scatters into that flat buffer,
    unless ``deterministic``).

    *CUDA work layout.* The forward gives every output element to one lane, which loops over
    the anchor's visible (point, camera) pairs (a warp ballot skips the others) and scales:
    no atomics. The backward gives each (b, a, p) to a warp that reduces the location and
    weight cotangents in registers and shuffles (plain stores). Index arithmetic is 64-bit.
    Features should be C-contiguous (else they are copied); per-level channels-first arrays
    are read without vector loads (strided channels) and are slower than channels-last.
    Kernels exist for feature storage float16, bfloat16, float32 and float64 with weights of
    the same dtype or float32; other weight dtypes, and every argument of a float64
    computation, are first cast to the computation dtype (a copy). Locations are cast to the
    computation dtype (small).

    Examples
    --------
    >>> import numpy as np, cutopo
    >>> from cutopo.deformable import deformable_aggregation
    >>> rng = np.random.default_rng(0)
    >>> shapes = np.array([[[4, 6], [2, 3]]])                 # one camera, two scales (H, W)
    >>> starts = np.array([[0, 24]])
    >>> feats = rng.random((1, 30, 8), dtype=np.float32)      # bs 1, 24 + 6 rows, C 8
    >>> loc = rng.uniform(0.1, 0.9, (1, 5, 3, 1, 2)).astype(np.float32)  # A 5, P 3
    >>> w = rng.random((1, 5, 3, 1, 2, 2), dtype=np.float32)  # G 2
    >>> out = deformable_aggregation(feats, shapes, starts, loc, w)
    >>> out.shape, out.dtype
    ((1, 5, 8), dtype('float32'))
    >>> out, pullback = cutopo.vjp(deformable_aggregation, feats, shapes, starts, loc, w,
    ...                            wrt=("sampling_locations", "weights"))
    >>> d_feats, _, _, d_loc, d_w = pullback(np.ones_like(out))
    >>> d_feats is None, d_loc.shape, d_w.shape
    (True, (1, 5, 3, 1, 2), (1, 5, 3, 1, 2, 2))

    References
    ----------
    .. [1] X. Lin, T. Lin, Z. Pei, L. Huang, Z. Su, "Sparse4D v2: Recurrent Temporal Fusion with
       Sparse Model", arXiv:2305.14018, 2023 (the efficient deformable aggregation).
    .. [2] X. Lin, Z. Pei, T. Lin, L. Huang, Z. Su, "Sparse4D v3: Advancing End-to-End 3D
       Detection and Tracking", arXiv:2311.11722, 2023.
    .. [3] X. Zhu, W. Su, L. Lu, B. Li, X. Wang, J. Dai, "Deformable DETR: Deformable
       Transformers for End-to-End Object Detection", ICLR 2021 (multi-scale deformable
       attention, the single-camera relative).
    """
    return _forward(features, spatial_shapes, level_start_index, sampling_locations, weights,
                    boundary=boundary, deterministic=deterministic, level_layout=level_layout)[0]
