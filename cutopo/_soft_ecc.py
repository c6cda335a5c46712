"""Soft (sigmoid-relaxed) Euler characteristic curve, differentiable through :mod:`cutopo.vjp`.

chi_lambda(t_k) = sum_p c(p) * sigmoid(lambda * (t_k - f(p))), with c the contribution map of
:func:`cutopo.euler_contributions`. Only the thresholds inside a band around each pixel's value
are evaluated; the saturated ones are added exactly through a difference array over the
thresholds (ecc.md 5.8). NumPy path: cutopo._band_numpy; CuPy arrays go to the kernels of
``cuda_src/ecc_soft.cuh`` (:mod:`cutopo._soft_ecc_cupy`), which evaluate the same band entries.
"""
from __future__ import annotations

import functools
import math
from typing import NamedTuple

import numpy as np

from . import _band_numpy, _ecc_numpy, _soft_ecc_cupy
from ._array import array_module, as_array, is_cupy_array
from ._band_cupy import raise_failed_thresholds
from ._band_numpy import _BAND, band_halfwidth
from ._checks import (check_boundary, check_connectivity, check_image, check_result_memory,
                      check_scale, check_threshold_array, check_thresholds, is_count,
                      same_array_type, scale_lambda)
from ._cuda.launch import _c_contiguous
from ._cuda.repeated import RepeatedCalls
from .vjp import register

__all__ = ["soft_ecc"]

class _Config(NamedTuple):
    image: np.ndarray   # validated input image, (*batch, *spatial)
    t: np.ndarray       # thresholds, 1-D, computation dtype (float CuPy thresholds stay on the device)
    scale: np.generic   # positive finite scalar of the computation dtype
    ndim: int
    tconn: bool
    dtype: np.dtype     # computation dtype (float32 or float64)
    band: float         # B
    periodic: bool = False  # boundary="periodic": the torus complex
    count: bool = False     # t = linear_thresholds(image, n): t moves with the image's range
    check: bool = False     # t: device thresholds that the forward's kernels check
    t_dtype: np.dtype | None = None      # the thresholds argument's dtype (None: a count)
    scale_dtype: np.dtype | None = None  # the scale argument's (None: a Python number)
    w: float = 0.0      # the band half-width B / scale (band_halfwidth)
    plan: object = None  # the CuPy path's SoftEccPlan, when _first_device_call made this
    kept: object = None  # the CuPy forward's _soft_ecc_cupy.Residual for the backward, or None


# ---------------------------------------------------------------------------------------------
# Validation


def _prepare(image, thresholds, scale, ndim, connectivity, boundary="box") -> _Config:
    image, ndim = check_image(image, ndim)
    same_array_type(image, [("thresholds", thresholds), ("scale", scale)])
    tconn = check_connectivity(connectivity, ndim)
    periodic = check_boundary(boundary, image, ndim)
    scale_value, scale64 = check_scale(scale)
    count = is_count(thresholds)
    on_device = False
    if count:
        t_host, _ = check_thresholds(thresholds, image)  # linear_thresholds(image, n)
        t64 = False  # a count does not choose the precision
    else:
        if not isinstance(thresholds, (float, np.floating)):
            thresholds = as_array(thresholds, "thresholds")
        on_device = _checked_on_device(image, thresholds)
        if not on_device:
            t_host, _ = check_thresholds(thresholds, image)
        t64 = thresholds.dtype == np.float64
    dtype = np.dtype(np.float64 if (image.dtype == np.float64 or t64 or scale64) else np.float32)
    lam = scale_lambda(dtype, scale_value)
    w = band_halfwidth(dtype, lam)
    if on_device:
        t = thresholds
        if t.dtype != dtype or not _c_contiguous(t):  # float16 or float32 -> float64: exact
            with image.device:
                t = t.astype(dtype, order="C")
    else:
        t = t_host.astype(dtype)
    scale_dtype = None if isinstance(scale, (int, float)) and not isinstance(scale, np.generic) \
        else np.dtype(scale.dtype)
    return _Config(image, t, lam, ndim, tconn, dtype, _BAND[dtype], periodic, count, on_device,
                   None if count else np.dtype(thresholds.dtype), scale_dtype, w)


def _checked_on_device(image, thresholds) -> bool:
    """Whether the values of ``thresholds`` are checked by a kernel, read once the op's own
    kernels are queued (no host copy that waits for the stream's earlier work): float CuPy
    thresholds on the CuPy image's device (the forward's first kernel checks them). Integer
    ones are checked on the host, since their cast to the computation dtype can merge values
    that are out of order."""
    if not (is_cupy_array(image) and is_cupy_array(thresholds) and thresholds.dtype.kind == "f"
            and thresholds.device.id == image.device.id):
        return False
    check_threshold_array(thresholds)    # the checks that need no values (check_thresholds' rest)
    return True


# ---------------------------------------------------------------------------------------------
# Repeated device calls

# _prepare's result for a CuPy call (cutopo._cuda.repeated), by everything its checks read but
# the scale's value (checked at every call): a repeated call (a training loop) then costs a
# dictionary lookup instead of ~7-30 us of checks, as much as the 1024^2 forward+VJP's kernels.
# Only calls whose checks depend on nothing else are kept: a C-contiguous CuPy image with float
# CuPy thresholds (whose values the kernel checks), both on the current device, a float scale
# and int/None/str static arguments.
_DEVICE_CALLS = RepeatedCalls()


@functools.lru_cache(maxsize=256)
def _lambda_and_halfwidth(dtype: np.dtype, value: float):
    """(lambda, w) of a positive finite scale value in the computation dtype (memoized: the
    two cost ~1-2 us a call, and a loop usually has one scale)."""
    lam = scale_lambda(dtype, value)
    return lam, band_halfwidth(dtype, lam)


def _first_device_call(key, image, thresholds, scale, ndim, connectivity, boundary):
    """The _Config of a CuPy call whose key (``_DEVICE_CALLS.key``) has no entry yet:
    _prepare's, with its plan, and kept (without arrays) for the calls after it when the
    kernels check the thresholds' values (float CuPy thresholds used as they are) and the
    batch is not empty. A repeated call takes the entry in _forward."""
    cfg = _prepare(image, thresholds, scale, ndim, connectivity, boundary)
    if cfg.check and cfg.t is thresholds:
        plan = _soft_ecc_cupy.device_plan(image, cfg.ndim, cfg.tconn, cfg.periodic, cfg.t.size,
                                          cfg.dtype)
        if plan is not None:
            cfg = cfg._replace(plan=plan)
            _DEVICE_CALLS.keep(key, cfg._replace(image=None, t=None))  # no array kept
    return cfg


# ---------------------------------------------------------------------------------------------
# Pixels


def _pixels(cfg: _Config):
    """(flat index into image.reshape(-1), their bands) of every pixel that matters: c != 0
    and value neither NaN nor +inf (sigmoid(-inf) = 0 at every threshold)."""
    image = cfg.image
    per_image = math.prod(image.shape[image.ndim - cfg.ndim:])
    c_all = _ecc_numpy.euler_contributions(image, cfg.ndim, cfg.tconn, cfg.periodic).reshape(-1)
    index = np.flatnonzero(c_all)
    f = image.reshape(-1)[index].astype(cfg.dtype)
    if f.dtype.kind == "f":
        keep = ~(np.isnan(f) | (f == np.inf))
        index, f = index[keep], f[keep]
    c = c_all[index].astype(np.float64)
    return index, _band_numpy.bands(index // per_image, c, f, cfg.t, cfg.w)


# ---------------------------------------------------------------------------------------------
# Forward and backward


def _shape_info(cfg: _Config):
    batch = cfg.image.shape[:cfg.image.ndim - cfg.ndim]
    return batch, math.prod(batch)


def _forward(image, thresholds, scale, *, ndim=None, connectivity=1, boundary="box",
             _keep=True):
    """(curve, residuals); ``_keep=False`` (the plain call, which has no backward) keeps no
    entries on the GPU."""
    key = _DEVICE_CALLS.key((image, thresholds), (ndim, connectivity, boundary), scale)
    kept = None if key is None else _DEVICE_CALLS.get(key)
    cfg = None
    if kept is not None:
        value = float(scale)
        if 0.0 < value < math.inf:  # (NaN fails too: _prepare raises below)
            # A repeated call: straight to the plan's launches, the _Config after them. What
            # runs before the first launch is host time that a per-call timing pays in full,
            # and a single pass of it costs 2-3x its steps' times in a loop (benchmarks/
            # RESULTS.md, fifty-second session): each Python call on the way counts.
            lam, w = _lambda_and_halfwidth(kept.dtype, value)
            out, residual, word = kept.plan.launch_forward(image, thresholds, image.shape, lam, w,
                                                           True, _keep)
            # made while the kernel starts (the host waits for block 0's check word next)
            cfg = _Config(image, thresholds, lam, *kept[3:12], w, kept.plan, residual)
            raise_failed_thresholds(word.read())
            return out, cfg
    elif key is not None:
        cfg = _first_device_call(key, image, thresholds, scale, ndim, connectivity, boundary)
    if cfg is None:
        cfg = _prepare(image, thresholds, scale, ndim, connectivity, boundary)
    if cfg.plan is not None:  # a planned device call: its arguments are as the plan takes them
        out, kept, word = cfg.plan.launch_forward(cfg.image, cfg.t, cfg.image.shape, cfg.scale,
                                                  cfg.w, True, _keep)
        raise_failed_thresholds(word.read())
        return out, (cfg if kept is None else cfg._replace(kept=kept))
    if is_cupy_array(cfg.image):
        out, kept = _soft_ecc_cupy.soft_ecc_forward(cfg.image, cfg.t, cfg.scale, cfg.w, cfg.ndim,
                                                    cfg.tconn, cfg.periodic, cfg.check,
                                                    keep=_keep)
        return out, (cfg if kept is None else cfg._replace(kept=kept))
    batch, nimg = _shape_info(cfg)
    T = cfg.t.size
    check_result_memory(batch, (T,), 24)  # float64 sums, the saturated counts, the result
    _, px = _pixels(cfg)
    out = _band_numpy.forward(px, cfg.t, cfg.scale, nimg)
    return out.astype(cfg.dtype).reshape(batch + (T,)), cfg


def _backward(cfg: _Config, g, needs):
    need_image, need_t, need_scale = needs
    if not any(needs):
        return None, None, None
    chain = need_image and cfg.count  # count thresholds move with the image's min and max
    if is_cupy_array(cfg.image):
        # each cotangent in the dtype vjp hands back (float64 where that is another dtype: the
        # one rounding is then vjp's; the count's chain rule below reads float64)
        real = cfg.dtype
        t_out = real if (cfg.t_dtype == real and not chain) else np.float64
        s_out = real if cfg.scale_dtype in (None, real) else np.float64
        d_image, d_t, d_scale = _soft_ecc_cupy.soft_ecc_backward(
            cfg.image, cfg.t, cfg.scale, cfg.w, cfg.ndim, cfg.tconn, g,
            (need_image, need_t or chain, need_scale), cfg.periodic, t_out, s_out, cfg.plan,
            cfg.kept)
    else:
        g = np.asarray(g, dtype=cfg.dtype).reshape(-1)
        index, px = _pixels(cfg)
        d_f, d_t, d_scale = _band_numpy.backward(px, cfg.t, cfg.scale, g, need_image,
                                                 need_t or chain, need_scale)
        d_image = None
        if need_image:
            d_image = np.zeros(cfg.image.size, dtype=np.float64)
            d_image[index] = d_f
            d_image = d_image.reshape(cfg.image.shape)
        d_scale = np.asarray(d_scale) if need_scale else None
    if chain:
        d_image = _range_pullback(cfg, d_image, d_t)
    return d_image, (d_t if need_t else None), d_scale


def _range_pullback(cfg: _Config, d_image, d_t):
    """Add the count thresholds' cotangent ``d_t`` to the pixels that set them.

    linear_thresholds(image, n) is numpy.linspace(lo, hi, n) over the finite pixels of the
    whole array (one range shared by the batch): t_k = lo + (hi - lo) k / (n - 1), t = [lo]
    when n = 1, so dt_k/dhi = k / (n - 1) and dt_k/dlo = 1 - k / (n - 1). lo and hi move with
    the first pixel (C order) attaining them: at ties that is one one-sided derivative, as
    soft_ect's reach R takes the first direction attaining it. On the array's own device.
    """
    xp = array_module(cfg.image)
    n = cfg.t.size
    slope = xp.arange(n, dtype=np.float64) / (n - 1) if n > 1 else xp.zeros(1)
    d_hi = xp.dot(d_t, slope)
    d_lo = xp.sum(d_t) - d_hi
    flat = cfg.image.reshape(-1)
    finite = xp.isfinite(flat)  # NaN and +-inf are left out of the range, as there
    i_lo = xp.argmin(xp.where(finite, flat, xp.inf))  # first minimum, on both backends
    i_hi = xp.argmax(xp.where(finite, flat, -xp.inf))
    d_image = d_image.reshape(-1)  # a view: d_image is contiguous
    d_image[i_lo] += d_lo
    d_image[i_hi] += d_hi
    return d_image.reshape(cfg.image.shape)


def _meta(image, thresholds, scale, *, ndim=None, connectivity=1, boundary="box"):
    """Output (shape, dtype) from the arguments' shapes and dtypes (see cutopo.vjp.OpSpec).

    First _prepare's checks, in its order, on data-free stand-ins (a scale of ones; a count of
    thresholds against a 1-pixel image): a bad argument raises the op's own error before the
    op runs. The checks of values (scale overflowing float32) are left to the op."""
    from ._adapters import check_image_op

    spatial, T = check_image_op(image, thresholds, ndim=ndim, connectivity=connectivity,
                                boundary=boundary, scale=scale)
    batch = tuple(image.shape[:image.ndim - spatial])
    count = is_count(thresholds)
    # as _prepare: float64 when image, array thresholds or a NumPy scale is float64
    wide = (image.dtype == np.float64 or (not count and thresholds.dtype == np.float64)
            or getattr(scale, "dtype", None) == np.float64)
    return batch + (T,), np.dtype(np.float64 if wide else np.float32)


# ---------------------------------------------------------------------------------------------
# Public op


@register(name="soft_ecc", forward=_forward, backward=_backward,
          arg_names=("image", "thresholds", "scale"),
          differentiable=("image", "thresholds", "scale"), meta=_meta)
def soft_ecc(image, thresholds, scale, *, ndim=None, connectivity=1, boundary="box"):
    r"""Soft Euler characteristic curve: the ECC with every step relaxed to a sigmoid.

    Entry k of the result is

        chi_lambda(t_k) = sum_p c(p) * sigmoid(scale * (t_k - f(p))),

    where f is the image and c its contribution map (:func:`euler_contributions`, same
    construction). It is differentiable in the image, the thresholds and the scale through
    :func:`cutopo.vjp`, and tends to :func:`ecc` as ``scale`` grows.

    Parameters
    ----------
    image : ndarray, shape (*batch, *spatial)
        NumPy or CuPy array of dtype bool, uint8, uint16, int16, int32, float16, float32 or
        float64, as for :func:`ecc`. NaN and +inf pixels contribute nothing
        (sigmoid(-inf) = 0); -inf pixels contribute c(p) at every threshold.
    thresholds : int or 1-D array
        Sorted (non-decreasing), finite threshold values, or a count ``n`` meaning
        :func:`linear_thresholds(image, n) <linear_thresholds>` (the count does not affect the
        computation dtype; it gets no cotangent, but the image's does include the
        thresholds' dependence on the image's finite minimum and maximum, see Notes).
    scale : float or 0-d array
        The positive, finite sharpness lambda of the sigmoid, in inverse units of the image.
    ndim : {None, 2, 3}, optional
        Number of trailing spatial axes, as for :func:`ecc`.
    connectivity : {1, ndim}, optional
        ``1``: V construction (cells take the max of their vertices); ``ndim``: T construction
        (lower cells take the min of the pixels around them), as for :func:`ecc`.
    boundary : {"box", "periodic"}, optional
        ``"box"`` (default) or ``"periodic"`` (the cubical complex of the torus: cells spanning
        the wrap included, every spatial axis >= 3; the curve tends to 0 instead of 1 once
        every pixel is in), as for :func:`ecc`; the contributions are those of
        :func:`euler_contributions` with the same boundary, on NumPy and CuPy alike.

    Returns
    -------
    curve : ndarray of float32 or float64, shape (*batch, T)
        Of the image's array type (NumPy or CuPy).
        float64 when ``image``, ``thresholds`` or ``scale`` is float64 (a NumPy float64
        scalar or array; a plain Python float does not count), else float32 (float16 and
        integer images are computed in float32).

    Notes
    -----
    *Per-cell relaxation.* Every cell's value is the value of the pixel that owns it
    (:func:`euler_contributions`), so the result equals the per-cell relaxation of
    Röell & Rieck [1]_, ``sum over cells of (-1)^dim * sigmoid(scale * (t_k - f(cell)))``.
    As ``scale -> inf`` every sigmoid tends to the step ``[f(p) < t_k]`` (1/2 at
    ``f(p) == t_k``), so the curve tends to :func:`ecc` at every threshold that equals no pixel
    value.

    *Band-limited evaluation.* With u = scale * (t_k - f(p)) and a band half-width B (37 in
    float64, 17 in float32: sigmoid(B) rounds to exactly 1 in that dtype), only the thresholds
    with |u| < B are evaluated with the sigmoid. Those with u >= B count as 1 and are added
    exactly (c(p) enters a difference array at the first threshold above the band, followed by
    one prefix sum over the thresholds); those with u <= -B count as 0. The band edges come
    from ``numpy.searchsorted`` on the sorted thresholds, so the cost is
    O(N + number of band entries + T) per image instead of O(N T), in bounded memory.
    Since ``|sigmoid(u) - 1| = sigmoid(-u)`` for u >= B, ``sigmoid(u)`` for u <= -B, and
    ``sigmoid(-B) = 1 / (1 + e^B) < e^-B``, every dropped term errs by less than
    ``|c(p)| e^-B``, hence for every threshold

        |chi_exact(t_k) - chi_band(t_k)| <= e^-B * sum_p |c(p)|,

    that is below 8.6e-17 (float64) or 4.2e-8 (float32) times ``sum |c|`` (at most 3 N in 2D,
    7 N in 3D), on top of the rounding of the evaluated entries and of the sums. The band
    entries are summed in float64 before the cast to the computation dtype.

    *GPU.* Float CuPy thresholds are checked (finite, sorted) by the forward kernel's first
    block, which writes its flags into page-locked host memory, read as soon as they land: the
    call makes no host copy of the thresholds that would wait for the stream's earlier work,
    and a failed check still raises before the call returns.
    CuPy inputs run the kernels of ``cuda_src/ecc_soft.cuh``: one pass over the image that
    finds each pixel's contribution (the tile sweep of :func:`ecc`) and, for the pixels with
    c != 0, their band edges (the same float64 edges as above, by binary search), the 32
    lanes of a warp evaluating the band of one pixel at a time over consecutive thresholds
    into per-block float64 accumulators; the last block of each image writes its curve, and
    the backward's last block the cotangents of the thresholds and the scale. A forward made
    by :func:`cutopo.vjp` (or a framework adapter) also keeps, as a residual, the critical
    pixels with a non-empty band (8 bytes each, room for one per 8 pixels of each image and
    at most 512 MiB per call); the backward evaluates that list instead of sweeping the image
    again, and sweeps only the images whose list overflowed (noise-like images, where most
    pixels are critical); it also makes the backward's outputs, which the residual holds
    (the image's cotangent up to 512 MiB: as large as the image in the computation dtype).
    The plain call keeps nothing. 3D calls of at least 2^23 voxels (and
    room for a slot per 32 voxels of each volume: up to 1024^3) list every critical voxel in
    a first pass, run the band work from that list in a second, and sweep again only the
    volumes whose list overflowed (faster on smooth volumes, where the critical voxels are
    few; the list is then the residual). Made by :func:`cutopo.vjp`, that first pass also
    zeroes the image's cotangent. A plain call, once its kernels are queued, makes the
    arrays of the next call of the same kind and shapes on the same thread and stream (one
    call's worth per thread, at most 256 MiB), and a call made by :func:`cutopo.vjp` makes
    them once its pullback's kernels are, so that a repeated call (a training loop) launches
    without allocating first. Work from a list runs
    transposed in float32: a lane per entry evaluates its band, a lane per threshold sums a
    window of them. The entries are the same as on the CPU; the sums are formed in a
    different order and the sigmoids by CUDA's ``exp``, so the results agree to the
    rounding of the computation dtype relative to ``sum |c|``, not bit for bit.

    The vector-Jacobian product is the exact derivative of this band-limited curve, over the
    band entries only (sigma' = s (1 - s) inside the band, 0 outside): for a cotangent g,

    * image: ``-scale * c(p) * sum_k g_k sigma'_pk`` (c is piecewise constant, so its
      derivative is zero almost everywhere; NaN and +-inf pixels get 0). With a count
      ``n``, t_k = lo + (hi - lo) k / (n - 1) moves with the finite minimum lo and maximum
      hi of the whole array (one range for the batch), so the pixel attaining lo also gets
      ``sum_k d_t_k (1 - k / (n - 1))`` and the one attaining hi ``sum_k d_t_k k / (n - 1)``
      (d_t as below; the first such pixel in C order when several tie);
    * thresholds: ``scale * sum_p c(p) g_k sigma'_pk``, summed over the batch;
    * scale: ``sum_k sum_p g_k c(p) (t_k - f(p)) sigma'_pk``.

    Convention: array axes are spatial axes in C order (``(rows, cols)`` in 2D,
    ``(planes, rows, cols)`` in 3D); positions outside the image are empty (``boundary="box"``)
    or the image repeats (``boundary="periodic"``). Pixels are ordered
    by (value, linear index), NaN as +inf, exactly as for :func:`ecc`; note that the relaxed
    step is centred on the pixel value, so a threshold equal to a pixel value gets 1/2 of its
    contribution, where :func:`ecc` (``image <= t``) counts it fully.

    Examples
    --------
    >>> import numpy as np, cutopo
    >>> image = np.array([[0.0, 2.0, 0.0],
    ...                   [2.0, 2.0, 2.0],
    ...                   [0.0, 2.0, 0.0]])
    >>> cutopo.ecc(image, [1.0, 3.0])                     # four isolated zeros, then one square
    array([4, 1])
    >>> cutopo.soft_ecc(image, [1.0, 3.0], 50.0).round(6)
    array([4., 1.])
    >>> cutopo.soft_ecc(image, [1.0, 3.0], 2.0).round(3)  # a blurred step
    array([3.166, 1.348])

    References
    ----------
    .. [1] E. Röell, B. Rieck, "Differentiable Euler Characteristic Transforms for Shape
       Classification", ICLR 2024 (the sigmoid-relaxed Euler characteristic).
    """
    return _forward(image, thresholds, scale, ndim=ndim, connectivity=connectivity,
                    boundary=boundary, _keep=False)[0]
