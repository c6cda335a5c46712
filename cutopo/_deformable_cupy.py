"""CuPy path of :func:`cutopo.deformable.deformable_aggregation`: plans and launches of
``cuda_src/deformable.cu`` (the kernels' header comment describes the work layout).

The Python side picks the storage instance (feature and weight dtypes), the lanes' vector
width and the lane layout, the forward's warps per output unit (:func:`forward_parts`), builds
the per-map descriptor table (memoized on the device) and launches on CuPy's current stream.
The deterministic feature cotangent sorts the (entry, corner) pairs by feature row with
``cupy.argsort`` (stable) before one warp sums each row in that order.

Repeated forwards of one kind of call (``cfg.memo``: the validation memoized in
:mod:`cutopo.deformable`) reuse a :class:`_ForwardPlan`: at batch 1 the host's preparation of
a call, not the kernel, set the pace (0.25 ms per call for 0.12 ms of device work on the H200,
before the plans; 0.095 ms per call for 0.068 ms now).
"""
from __future__ import annotations

import functools

import numpy as np

from ._array import _cupy
from ._cuda import tables
from ._cuda.compile import register_instances
from ._cuda.launch import PreparedLaunch, Signature, device_attribute

FAMILY = "deformable"
THREADS = 256  # deform::THREADS
WARPS = THREADS // 32

# "scalar" forces one channel per lane (tests, benchmarks); None and "vector" take 16-byte lanes
# whenever the arrays allow them.
FORCE_VECTOR = None
# Set to 1, 2, 4 or 8 to force the forward's warps per output unit (tests); None picks by size
# (see forward_parts).
FORCE_PARTS = None

_CTYPE = {"float16": "cutopo::half", "bfloat16": "cutopo::deform::bf16", "float32": "float",
          "float64": "double"}
# The dtype a kernel parameter is declared (and the array viewed) as: CuPy's bfloat16 arrays
# travel as their uint16 bits.
_VIEW = {"float16": "float16", "bfloat16": "uint16", "float32": "float32", "float64": "float64"}
_ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}
# (feature storage, weight storage) instances; other weight dtypes are cast to the computation
# dtype first.
PAIRS = (("float16", "float16"), ("float16", "float32"), ("bfloat16", "bfloat16"),
         ("bfloat16", "float32"), ("float32", "float32"), ("float64", "float64"))
_ROW_WEIGHTS = ("float16", "bfloat16", "float32", "float64")


def _real(fname):
    return "float64" if fname == "float64" else "float32"


def _vbig(name):
    """Channels per lane of a 16-byte load of ``name``."""
    return 16 // _ITEMSIZE[name]


# ---------------------------------------------------------------------------------------------
# Instances and signatures


def _forward_sig(f, w, v):
    r = _real(f)
    name = f"cutopo::deform::forward<{_CTYPE[f]}, {_CTYPE[w]}, {_CTYPE[r]}, {v}>"
    return Signature(FAMILY, name, (f"ptr:{_VIEW[f]}", "ptr:int64", f"ptr:{r}", f"ptr:{_VIEW[w]}",
                                    f"ptr:{r}", "int64") + ("int32",) * 13)


def _backward_sig(f, w, v):
    r = _real(f)
    name = f"cutopo::deform::backward<{_CTYPE[f]}, {_CTYPE[w]}, {_CTYPE[r]}, {v}>"
    return Signature(FAMILY, name, (f"ptr:{_VIEW[f]}", "ptr:int64", f"ptr:{r}", f"ptr:{_VIEW[w]}",
                                    f"ptr:{r}", f"ptr:{r}", f"ptr:{r}", f"ptr:{r}", "int64")
                     + ("int32",) * 15)


def _keys_sig(r, key):
    ctype = "int" if key == "int32" else "long long"
    name = f"cutopo::deform::entry_keys<{_CTYPE[r]}, {ctype}>"
    return Signature(FAMILY, name, ("ptr:int64", f"ptr:{r}", f"ptr:{key}", "int64") + ("int32",) * 5
                     + ("int64", "int32"))


def _rows_sig(w, r, v):
    name = f"cutopo::deform::feature_rows<{_CTYPE[w]}, {_CTYPE[r]}, {v}>"
    return Signature(FAMILY, name, ("ptr:int64", f"ptr:{r}", f"ptr:{_VIEW[w]}", f"ptr:{r}", "ptr:int64",
                                    "ptr:int64", f"ptr:{r}", "int64") + ("int32",) * 10)


def _row_pairs():
    for w in _ROW_WEIGHTS:
        yield w, ("float64" if w == "float64" else "float32")


def _instances():
    for f, w in PAIRS:
        for v in (1, _vbig(f)):
            yield _forward_sig(f, w, v).name
            yield _backward_sig(f, w, v).name
    for r in ("float32", "float64"):
        for key in ("int32", "int64"):
            yield _keys_sig(r, key).name
    for w, r in _row_pairs():
        for v in (1, _vbig(r)):
            yield _rows_sig(w, r, v).name


register_instances(FAMILY, _instances)


# ---------------------------------------------------------------------------------------------
# Plans


def layout(C, G, V):
    """(L, GT, steps, tiles): lanes per group segment, groups per tile, steps per group, tiles.

    A group's CG / V lanes get a segment of L lanes (the next power of two, at most 32);
    wider groups take ``steps`` steps of L V channels.
    """
    per = (C // G) // V
    L = 1
    while L < per and L < 32:
        L *= 2
    steps = -(-per // L)
    GT = 32 // L
    return L, GT, steps, -(-G // GT)


@functools.lru_cache(maxsize=256)
def _prepared(device_id, sig, n_warps, scalars):
    """A launch of ``n_warps`` warps with every pointer given per call, memoized."""
    n_ptr = sum(1 for p in sig.params if p.startswith("ptr:"))
    return PreparedLaunch(sig, -(-n_warps // WARPS), THREADS, (None,) * n_ptr + (n_warps,) + scalars)


def _table(host):
    """A device copy of a small int64 host table, memoized and ready for kernels on any stream
    (read-only by convention): repeated calls with the same maps make no host-to-device copy."""
    return tables.memoized(np.ascontiguousarray(host, dtype=np.int64))


@functools.lru_cache(maxsize=64)
def _flat_host_table(shapes_bytes, starts_bytes, K, S, num_feat, C):
    table = np.empty((K, S, 4), dtype=np.int64)
    table[..., 2:] = np.frombuffer(shapes_bytes, dtype=np.int64).reshape(K, S, 2)
    table[..., 0] = np.frombuffer(starts_bytes, dtype=np.int64).reshape(K, S) * C
    table[..., 1] = num_feat * C
    return table.reshape(K * S, 4)


def _flat_table(shapes_bytes, starts_bytes, K, S, num_feat, C):
    """The device descriptor table of the flattened form on the current device, memoized and
    ready for kernels on any stream: per map (k, s) the element offset start * C, the batch
    stride num_feat * C, H, W."""
    return tables.memoized(_flat_host_table(shapes_bytes, starts_bytes, K, S, num_feat, C))


def _kernel_view(x):
    import cupy

    return x.view(cupy.uint16) if x.dtype.name == "bfloat16" else x


def _aligned(x, n=16):
    return x.data.ptr % n == 0


class _Inputs:
    """The kernel-ready arrays of one call: storage dtypes resolved, C-contiguous."""

    def __init__(self, cfg):
        import cupy

        r = cfg.real.name
        levels = [cfg.features] if cfg.flat else list(cfg.features)
        f = levels[0].dtype.name
        if r == "float64" and f != "float64":  # float64 computation: one storage instance
            levels = [lv.astype(np.float64) for lv in levels]
            f = "float64"
        w = cfg.weights.dtype.name
        weights = cfg.weights
        if r == "float64" or w not in (f, "float32"):
            weights = weights.astype(r)
            w = r
        levels = [cupy.ascontiguousarray(lv) for lv in levels]
        # Per-level arrays are reached through element offsets from the first level's pointer:
        # a level not aligned to its element size (an odd view) is copied.
        isz = _ITEMSIZE[f]
        levels = [lv if lv.data.ptr % isz == 0 else lv.copy() for lv in levels]
        self.levels, self.f, self.w = levels, f, w
        self.weights = cupy.ascontiguousarray(weights)
        self.loc = cupy.ascontiguousarray(cfg.loc.astype(r, copy=False))
        self.r = r
        if cfg.flat:  # the usual case: one memoized lookup, no table rebuilt per call
            self.maps = _flat_table(cfg.shapes.tobytes(), cfg.starts.tobytes(),
                                    cfg.K, cfg.S, cfg.num_feat, cfg.C)
        else:
            self.maps = _table(self._maps_host(cfg))
        channels_last = cfg.flat or not cfg.channels_first
        self.vector_ok = (channels_last and (cfg.C // cfg.G) % _vbig(f) == 0
                          and all(_aligned(lv) for lv in levels))

    def _maps_host(self, cfg):
        """Per-level form: (K S, 4) int64 descriptor rows: element offset of map (k, s) from the
        first level's pointer, batch stride, H, W."""
        K, S, C = cfg.K, cfg.S, cfg.C
        table = np.empty((K, S, 4), dtype=np.int64)
        table[..., 2:] = cfg.shapes
        base = self.levels[0].data.ptr
        isz = _ITEMSIZE[self.f]
        for s, lv in enumerate(self.levels):
            H, W = (int(n) for n in cfg.shapes[0, s])
            per_camera = C * H * W
            table[:, s, 0] = (lv.data.ptr - base) // isz + np.arange(K) * per_camera
            table[:, s, 1] = K * per_camera
        return table.reshape(K * S, 4)


def _vector(cfg, name, ok):
    """Channels per lane: a 16-byte vector when possible, else 1."""
    vb = _vbig(name)
    if not ok or (cfg.C // cfg.G) % vb or FORCE_VECTOR == "scalar":
        return 1
    return vb


def forward_parts(units, items):
    """Warps per output unit of the forward (1, 2, 4 or 8): the fewest that give the device 16
    warps per multiprocessor and each warp at most 256 of a unit's ``items`` (points x cameras
    x scales; a warp's items are one serial chain of loads). Measured on an H200
    (benchmarks/RESULTS.md): Sparse4D (312 items) runs fastest with 2 at batch 1 and 6, the
    SparseDrive map head (7200 items, 2400 units) with 8."""
    if FORCE_PARTS is not None:
        return FORCE_PARTS
    want = 16 * device_attribute("MultiProcessorCount")
    parts = 1
    while parts < WARPS and (units * parts < want or items > 256 * parts):
        parts *= 2
    return parts


def _gout(cfg, g, r):
    import cupy

    g = cupy.ascontiguousarray(g.reshape(cfg.bs, cfg.A, cfg.C).astype(r, copy=False))
    return g if _aligned(g) else g.copy()


# ---------------------------------------------------------------------------------------------
# Forward and backward


class _ForwardPlan:
    """The forward of every call of one kind (``cfg.memo``) whose arrays the kernel can read
    as they are (no cast, no copy): allocate the output, launch. Kept in ``cfg.memo.plans``
    under :func:`_forward_key`, so that a repeated call costs a dictionary lookup, one
    allocation and the launch (at batch 1 the host time of the call, not the kernel, set the
    pace)."""

    __slots__ = ("launch", "maps", "shape", "dtype", "bits_f", "bits_w")

    def __init__(self, launch, maps, shape, dtype, f, w):
        self.launch, self.maps, self.shape, self.dtype = launch, maps, shape, dtype
        self.bits_f, self.bits_w = f == "bfloat16", w == "bfloat16"  # see _kernel_view

    def __call__(self, cfg):
        cupy = _cupy()
        out = cupy.empty(self.shape, dtype=self.dtype)
        feats = cfg.features.view(cupy.uint16) if self.bits_f else cfg.features
        weights = cfg.weights.view(cupy.uint16) if self.bits_w else cfg.weights
        # The launch's argument checks passed for the call that made this plan, and the keys
        # (the call's and _forward_key) prove these arrays alike in every property they check.
        self.launch.call_prechecked(feats, self.maps, cfg.loc, weights, out)
        return out


def _forward_key(cfg):
    """What a forward plan depends on besides the kind of call (``cfg.memo``, which fixes
    shapes, dtypes, tables, options and the arrays' devices): the current device, the
    features' alignment (vector loads), the arrays' contiguity, FORCE_VECTOR, FORCE_PARTS."""
    return ("forward", _cupy().cuda.runtime.getDevice(), cfg.features.data.ptr & 15,
            cfg.features.flags.c_contiguous, cfg.loc.flags.c_contiguous,
            cfg.weights.flags.c_contiguous, FORCE_VECTOR, FORCE_PARTS)


def forward(cfg):
    """(bs, A, C) output in the computation dtype."""
    import cupy

    memo = cfg.memo
    if memo is not None:
        key = _forward_key(cfg)
        plan = memo.plans.get(key)
        if plan is not None:
            return plan(cfg)
    with cfg.loc.device:
        x = _Inputs(cfg)
        V = _vector(cfg, x.f, x.vector_ok)
        L, GT, steps, tiles = layout(cfg.C, cfg.G, V)
        units = cfg.bs * cfg.A * tiles * steps
        parts = forward_parts(units, cfg.P * cfg.K * cfg.S)
        out = cupy.empty((cfg.bs, cfg.A, cfg.C), dtype=x.r)
        plan = _prepared(cupy.cuda.Device().id, _forward_sig(x.f, x.w, V), units * parts,
                         (cfg.A, cfg.P, cfg.K, cfg.S, cfg.C, cfg.G, L, GT, steps, tiles * steps,
                          parts, int(cfg.channels_first), cfg.boundary))
        plan(_kernel_view(x.levels[0]), x.maps, x.loc, _kernel_view(x.weights), out)
    # Keep the plan for the next calls of this kind when they can skip everything above: the
    # arrays went to the kernel as given (_Inputs copied or cast none of them; identity
    # tells) and the call ran on the arrays' device (the plan runs on the current one).
    if (memo is not None and x.levels[0] is cfg.features and x.loc is cfg.loc
            and x.weights is cfg.weights and key[1] == cfg.loc.device.id):
        memo.plans[key] = _ForwardPlan(plan, x.maps, out.shape, out.dtype, x.f, x.w)
    return out


def _flat_maps(cfg):
    """The descriptor table of the flattened (bs, num_feat, C) channels-last layout of the maps
    (``cfg.starts``): the layout of the feature cotangent, whatever the features' form."""
    return _flat_table(cfg.shapes.tobytes(), cfg.starts.tobytes(),
                       cfg.K, cfg.S, cfg.num_feat, cfg.C)


def backward(cfg, g, needs):
    """(d_features, d_locations, d_weights) in the computation dtype, None where not needed.

    d_features is (bs, num_feat, C) channels-last in both forms (``cfg.starts`` lays the maps
    out); the caller splits it into levels for the per-level form.
    """
    import cupy

    need_feat, _, _, need_loc, need_wt = needs
    with cfg.loc.device:
        x = _Inputs(cfg)
        r = x.r
        gout = _gout(cfg, g, r)
        dummy = cupy.empty(0, dtype=r)
        atomic = need_feat and not cfg.deterministic
        # The kernel addresses the feature cotangent through the features' descriptor table.
        # That fits the flattened form (same layout, so one launch does everything); per-level
        # arrays are separate allocations, so there a second launch scatters into a flat buffer
        # through the flat table (that launch reads no features: need_loc = need_wt = 0).
        fused = atomic and cfg.flat
        d_feat = cupy.zeros((cfg.bs, cfg.num_feat, cfg.C), dtype=r) if atomic else dummy
        d_loc = cupy.empty(x.loc.shape, dtype=r) if need_loc else dummy
        d_wt = cupy.empty(x.weights.shape, dtype=r) if need_wt else dummy
        device = cupy.cuda.Device().id
        if fused or need_loc or need_wt:
            V = _vector(cfg, x.f, x.vector_ok)
            L, GT, steps, tiles = layout(cfg.C, cfg.G, V)
            plan = _prepared(device, _backward_sig(x.f, x.w, V), cfg.bs * cfg.A * cfg.P,
                             (cfg.A, cfg.P, cfg.K, cfg.S, cfg.C, cfg.G, L, GT, steps, tiles,
                              int(cfg.channels_first), cfg.boundary, int(fused), int(need_loc),
                              int(need_wt)))
            plan(_kernel_view(x.levels[0]), x.maps, x.loc, _kernel_view(x.weights), gout,
                 d_feat if fused else dummy, d_loc, d_wt)
        if atomic and not fused:
            # channels-last flat buffer: vector lanes whenever the group width allows (the
            # buffer and gout are 16-byte aligned)
            V = _vector(cfg, x.f, True)
            L, GT, steps, tiles = layout(cfg.C, cfg.G, V)
            plan = _prepared(device, _backward_sig(x.f, x.w, V), cfg.bs * cfg.A * cfg.P,
                             (cfg.A, cfg.P, cfg.K, cfg.S, cfg.C, cfg.G, L, GT, steps, tiles,
                              0, cfg.boundary, 1, 0, 0))
            plan(_kernel_view(x.levels[0]), _flat_maps(cfg), x.loc, _kernel_view(x.weights), gout,
                 d_feat, dummy, dummy)
        if need_feat and cfg.deterministic:
            d_feat = _sorted_feature_cotangent(cfg, x, gout)
    return (d_feat if need_feat else None, d_loc if need_loc else None,
            d_wt if need_wt else None)


def _sorted_feature_cotangent(cfg, x, gout):
    """The feature cotangent without atomics: bitwise reproducible. The keys and row kernels
    read no features, only the maps' sizes and flat first rows: the flat table serves both
    forms."""
    import cupy

    r = x.r
    maps = _flat_maps(cfg)
    device = cupy.cuda.Device().id
    n_entries = cfg.bs * cfg.A * cfg.P * cfg.K * cfg.S
    rows = cfg.bs * cfg.num_feat
    key = "int32" if rows < 2**31 - 1 else "int64"
    keys = cupy.empty(4 * n_entries, dtype=key)
    sig = _keys_sig(r, key)
    launch = _prepared_threads(device, sig, n_entries,
                               (cfg.A, cfg.P, cfg.K, cfg.S, cfg.C, cfg.num_feat, cfg.boundary))
    launch(maps, x.loc, keys)
    ids = cupy.flatnonzero(keys >= 0)          # (entry, corner) ids in increasing order
    kv = keys[ids]
    del keys
    order = cupy.argsort(kv)                   # stable: ties keep the id order
    ent = ids[order]
    seg = cupy.searchsorted(kv[order], cupy.arange(rows + 1, dtype=key)).astype(np.int64)
    del ids, kv, order
    V = _vector(cfg, r, _aligned(gout))
    L, GT, steps, tiles = layout(cfg.C, cfg.G, V)
    d_feat = cupy.empty((cfg.bs, cfg.num_feat, cfg.C), dtype=r)
    plan = _prepared(device, _rows_sig(x.w, r, V), rows * tiles * steps,
                     (cfg.A, cfg.P, cfg.K, cfg.S, cfg.C, cfg.G, L, GT, steps, tiles * steps))
    plan(maps, x.loc, _kernel_view(x.weights), gout, ent, seg, d_feat)
    return d_feat


@functools.lru_cache(maxsize=64)
def _prepared_threads(device_id, sig, n_threads, scalars):
    """A launch of one thread per item (entry_keys): (maps, loc, keys) per call."""
    return PreparedLaunch(sig, -(-n_threads // THREADS) if n_threads else 0, THREADS,
                          (None, None, None, n_threads) + scalars)
