"""Sampling an image at arbitrary points: :func:`grid_sample`, with PyTorch's semantics and a VJP.

``out[n, c, *p] = interpolation of image[n, c] at the point grid[n, *p]`` (normalised
coordinates in [-1, 1], x first), exactly as ``torch.nn.functional.grid_sample``. NumPy arrays
take the vectorised NumPy path below, chunked over output points (the CPU fallback and the
oracle of the GPU tests); CuPy arrays the kernels of ``cuda_src/sampling.cu``
(:mod:`cutopo._sampling_cupy`). The VJP with respect to the image and the grid goes through
:func:`cutopo.vjp`.
"""
from __future__ import annotations

import itertools
from typing import NamedTuple

import numpy as np

from ._array import as_array, is_cupy_array
from .vjp import register

__all__ = ["grid_sample"]

MODES = ("bilinear", "nearest")
PADDING_MODES = ("zeros", "border", "reflection")
_FLOAT_NAMES = ("float16", "float32", "float64")

# Output points per chunk, times the channels: bounds the temporaries (a few (points, C) arrays
# per corner, eight corners in 3-D) to tens of megabytes.
_CHUNK_VALUES = 1 << 18


class _Config(NamedTuple):
    image: np.ndarray       # (N, C, S): S the flattened spatial axes (a view where possible;
                            # CuPy: C-contiguous, storage dtype)
    grid: np.ndarray        # (N * P, ndim): P the flattened output points, x first (CuPy:
                            # C-contiguous, computation dtype)
    N: int
    C: int
    P: int
    spatial: tuple          # spatial sizes in image order ((H, W) or (D, H, W))
    out_shape: tuple        # (N, C, *out)
    dtype: np.dtype         # output dtype
    real: np.dtype          # computation dtype: float32 or float64
    nearest: bool
    padding: str
    align_corners: bool
    deterministic: bool     # CuPy: sorted (not atomic) image cotangent; NumPy: no effect
    gpu: bool


_GRID_NOT_FINITE = "grid must be finite (found NaN or inf)"
_IMAGE_NOT_FINITE = "image must be finite (found NaN or inf)"


# ---------------------------------------------------------------------------------------------
# Validation


def _choice(value, name, choices):
    if not isinstance(value, str):
        raise TypeError(f"{name} must be one of {', '.join(map(repr, choices))}, got {value!r}")
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}, got {value!r}")
    return value


def _float_array(x, name):
    x = as_array(x, name)
    if x.dtype.name not in _FLOAT_NAMES:
        raise TypeError(f"{name}: dtype {x.dtype} is not supported (use float16, float32 or float64)")
    return x


def _kind(x) -> str:
    """The array type, for messages: "numpy.ndarray" or "cupy.ndarray"."""
    return f"{type(x).__module__.split('.')[0]}.{type(x).__name__}"


def _out_dtype(image_dtype, grid_dtype) -> np.dtype:
    return np.result_type(image_dtype, grid_dtype)


def _prepare(image, grid, mode, padding_mode, align_corners, deterministic=False) -> _Config:
    _choice(mode, "mode", MODES)
    _choice(padding_mode, "padding_mode", PADDING_MODES)
    if not isinstance(align_corners, (bool, np.bool_)):
        raise TypeError(f"align_corners must be True or False, got {align_corners!r}")
    if not isinstance(deterministic, (bool, np.bool_)):
        raise TypeError(f"deterministic must be True or False, got {deterministic!r}")
    image = _float_array(image, "image")
    grid = _float_array(grid, "grid")
    gpu = is_cupy_array(image)
    if is_cupy_array(grid) != gpu:
        raise TypeError("image and grid must both be NumPy or both CuPy arrays "
                        f"(image: {_kind(image)}, grid: {_kind(grid)})")
    if gpu and image.device.id != grid.device.id:
        raise ValueError(f"image and grid must be on one device (image on {image.device.id}, "
                         f"grid on {grid.device.id})")
    if image.ndim not in (4, 5):
        raise ValueError(f"image must have shape (N, C, H, W) or (N, C, D, H, W), got {image.shape}")
    ndim = image.ndim - 2
    if grid.ndim != image.ndim or grid.shape[-1] != ndim:
        want = "(N, H_out, W_out, 2)" if ndim == 2 else "(N, D_out, H_out, W_out, 3)"
        raise ValueError(f"grid must have shape {want} for an image with {ndim} spatial axes "
                         f"{image.shape}, got {grid.shape}")
    N, C = image.shape[:2]
    if grid.shape[0] != N:
        raise ValueError(f"grid has batch {grid.shape[0]}, image {N}")
    spatial = tuple(int(s) for s in image.shape[2:])
    if any(s == 0 for s in spatial):
        raise ValueError(f"image: spatial shape {spatial} has a zero-length axis")
    # A NaN pixel would spoil every sample that reads it. CuPy arrays are checked on the device
    # (_forward): the grid by the sampling kernel itself, the image by one extra pass, one flag
    # copied back.
    if not gpu and not np.isfinite(grid).all():
        raise ValueError(_GRID_NOT_FINITE)
    if not gpu and not np.isfinite(image).all():
        raise ValueError(_IMAGE_NOT_FINITE)
    dtype = _out_dtype(image.dtype, grid.dtype)
    real = np.dtype(np.float64 if dtype == np.float64 else np.float32)
    out = tuple(int(s) for s in grid.shape[1:-1])
    P = int(np.prod(out, dtype=np.int64))
    S = int(np.prod(spatial, dtype=np.int64))
    image, grid = image.reshape(N, C, S), grid.reshape(N * P, ndim)
    if gpu:  # the kernels read the image in its storage dtype and the grid in the computation's
        import cupy

        with image.device:
            image = cupy.ascontiguousarray(image)
            grid = cupy.ascontiguousarray(grid, dtype=real)
    return _Config(image, grid, N, C, P, spatial, (N, C) + out, dtype, real, mode == "nearest",
                   padding_mode, bool(align_corners), bool(deterministic), gpu)


# ---------------------------------------------------------------------------------------------
# NumPy path


def _clip(x, dx, size):
    """Clamp to [0, size - 1]; the derivative is 0 where the input was outside or on an end
    (as torch: on the end the clamp's one-sided derivative 0; keeping dx there made the
    gradient of x = size - 1 read the missing pixel past the edge). NaN, the reflection of a
    coordinate that overflowed to +-inf, goes to 0 with derivative 0, as in the CUDA kernels
    (fmax(NaN, 0) = 0)."""
    dx = np.where((x > 0) & (x < size - 1), dx, 0)
    return np.fmin(np.fmax(x, 0), size - 1), dx


def _reflect(x, dx, size, align_corners):
    """Reflect about the image's edges (pixel centres with align_corners, else the outer edges
    half a pixel beyond), then clamp: torch's reflect_coordinates and clip_coordinates."""
    low2, high2 = (0, 2 * (size - 1)) if align_corners else (-1, 2 * size - 1)
    if low2 == high2:  # one pixel with align_corners: every point maps to it
        return np.zeros_like(x), np.zeros_like(dx)
    low, span = low2 / 2, (high2 - low2) / 2
    t = x - x.dtype.type(low)
    sign = np.where(t < 0, -1, 1).astype(x.dtype)
    t = np.abs(t)
    extra = np.fmod(t, x.dtype.type(span))
    odd = np.floor(t / x.dtype.type(span)) % 2 == 1
    x = np.where(odd, x.dtype.type(span) - extra, extra) + x.dtype.type(low)
    return _clip(x, np.where(odd, -sign, sign) * dx, size)


def _coordinates(g, size, cfg: _Config):
    """Pixel coordinate along one axis of ``size`` pixels of the normalised coordinates ``g``,
    and its derivative with respect to ``g``."""
    t = cfg.real.type
    scale = t((size - 1) / 2) if cfg.align_corners else t(size / 2)
    # a finite grid value can overflow here (|g| near the dtype's largest): +-inf is clamped
    # below, or reflected to NaN and clamped to 0 (_clip), never read as a pixel
    with np.errstate(over="ignore", invalid="ignore"):
        x = (g.astype(cfg.real) + t(1)) * scale
        if not cfg.align_corners:
            x -= t(0.5)
        dx = np.full_like(x, scale)
        if cfg.padding == "border":
            x, dx = _clip(x, dx, size)
        elif cfg.padding == "reflection":
            x, dx = _reflect(x, dx, size, cfg.align_corners)
        else:
            # Points further out than one pixel read nothing: clamping them there changes no
            # output and keeps the integer conversion below in range.
            x = np.clip(x, -2, size + 1)
    return x, dx


class _Corner(NamedTuple):
    offsets: tuple          # 0/1 per spatial axis (image order)
    pix: np.ndarray         # flattened pixel index (clamped into the image)
    inside: np.ndarray      # the corner lies in the image (else it reads zero)
    weight: np.ndarray


class _Chunk(NamedTuple):
    rows: slice             # rows of cfg.grid (flattened points over the batch)
    n: np.ndarray           # batch index of each point
    corners: list
    axis_weights: list      # per spatial axis: (weight of offset 0, weight of offset 1)
    coord_grad: list        # per spatial axis: d pixel coordinate / d grid coordinate


def _chunks(cfg: _Config):
    ndim = len(cfg.spatial)
    strides = [int(np.prod(cfg.spatial[a + 1:], dtype=np.int64)) for a in range(ndim)]
    step = max(1, _CHUNK_VALUES // max(cfg.C, 1))
    for q0 in range(0, cfg.N * cfg.P, step):
        rows = slice(q0, min(q0 + step, cfg.N * cfg.P))
        n = np.arange(rows.start, rows.stop) // max(cfg.P, 1)
        per_axis, axis_weights, coord_grad = [], [], []
        for a, size in enumerate(cfg.spatial):
            x, dx = _coordinates(cfg.grid[rows, ndim - 1 - a], size, cfg)  # grid is x (last axis) first
            coord_grad.append(dx)
            if cfg.nearest:
                i = np.rint(x).astype(np.int64)  # rounds half to even, as torch's nearbyint
                per_axis.append([(i, np.ones_like(x))])
                continue
            x0 = np.floor(x)
            w = ((x0 + 1) - x, x - x0)  # torch's form of the weights
            axis_weights.append(w)
            i0 = x0.astype(np.int64)
            per_axis.append([(i0, w[0]), (i0 + 1, w[1])])
        corners = []
        for offsets in itertools.product(*(range(len(p)) for p in per_axis)):
            pix = np.zeros(rows.stop - rows.start, dtype=np.int64)
            inside = np.ones(pix.shape, dtype=bool)
            weight = None
            for a, o in enumerate(offsets):
                i, w = per_axis[a][o]
                inside &= (i >= 0) & (i < cfg.spatial[a])
                pix += np.clip(i, 0, cfg.spatial[a] - 1) * strides[a]
                weight = w if weight is None else weight * w
            corners.append(_Corner(offsets, pix, inside, weight))
        yield _Chunk(rows, n, corners, axis_weights, coord_grad)


def _gather(cfg: _Config, chunk: _Chunk, corner: _Corner):
    """(points, C) pixel values of a corner in the computation dtype, zero outside the image."""
    values = cfg.image[chunk.n, :, corner.pix].astype(cfg.real)  # advanced indexing: a copy
    values[~corner.inside] = 0
    return values


def _forward_numpy(cfg: _Config):
    out = np.empty((cfg.N * cfg.P, cfg.C), dtype=cfg.real)
    for chunk in _chunks(cfg):
        acc = np.zeros((chunk.rows.stop - chunk.rows.start, cfg.C), dtype=cfg.real)
        for corner in chunk.corners:
            acc += corner.weight[:, None] * _gather(cfg, chunk, corner)
        out[chunk.rows] = acc
    out = out.reshape(cfg.N, cfg.P, cfg.C).transpose(0, 2, 1)
    return np.ascontiguousarray(out, dtype=cfg.dtype).reshape(cfg.out_shape)


def _backward_numpy(cfg: _Config, g, needs):
    need_image, need_grid = needs
    ndim = len(cfg.spatial)
    S = cfg.image.shape[2]
    # (N * P, C) cotangent rows, one per output point
    g = np.ascontiguousarray(g.reshape(cfg.N, cfg.C, cfg.P).transpose(0, 2, 1), dtype=cfg.real)
    g = g.reshape(cfg.N * cfg.P, cfg.C)
    d_image = np.zeros(cfg.N * cfg.C * S) if need_image else None
    d_grid = np.zeros((cfg.N * cfg.P, ndim), dtype=cfg.real) if need_grid else None
    channels = np.arange(cfg.C, dtype=np.int64)
    for chunk in _chunks(cfg):
        gc = g[chunk.rows]
        if need_image:
            # Deterministic scatter-add: one bincount over every corner of the chunk.
            index, weight = [], []
            for corner in chunk.corners:
                keep = corner.inside
                rows = (chunk.n[keep, None] * cfg.C + channels) * S + corner.pix[keep, None]
                index.append(rows.ravel())
                weight.append((corner.weight[keep, None] * gc[keep]).ravel())
            d_image += np.bincount(np.concatenate(index), np.concatenate(weight),
                                   minlength=d_image.size)
        if need_grid and not cfg.nearest:  # nearest: piecewise constant, zero gradient (as torch)
            gx = np.zeros((chunk.rows.stop - chunk.rows.start, ndim), dtype=cfg.real)
            for corner in chunk.corners:
                s = np.einsum("pc,pc->p", _gather(cfg, chunk, corner), gc)
                for a in range(ndim):
                    dw = s if corner.offsets[a] else -s
                    for b, o in enumerate(corner.offsets):
                        if b != a:
                            dw = dw * chunk.axis_weights[b][o]
                    gx[:, ndim - 1 - a] += dw
            d_grid[chunk.rows] = gx * np.stack(chunk.coord_grad[::-1], axis=1)
    if need_image:
        d_image = d_image.reshape(cfg.N, cfg.C, *cfg.spatial)
    if need_grid:
        d_grid = d_grid.reshape(cfg.N, *cfg.out_shape[2:], ndim)
    return d_image, d_grid


# ---------------------------------------------------------------------------------------------
# Forward and backward (registered with cutopo.vjp)


def _forward(image, grid, *, mode="bilinear", padding_mode="zeros", align_corners=False,
             deterministic=False):
    cfg = _prepare(image, grid, mode, padding_mode, align_corners, deterministic)
    if not cfg.gpu:
        return _forward_numpy(cfg), cfg
    from . import _sampling_cupy

    out, flags = _sampling_cupy.forward(cfg)
    if flags & _sampling_cupy.GRID_NONFINITE:
        raise ValueError(_GRID_NOT_FINITE)
    if flags & _sampling_cupy.IMAGE_NONFINITE:
        raise ValueError(_IMAGE_NOT_FINITE)
    return out, cfg


def _backward(cfg: _Config, g, needs):
    if not cfg.gpu:
        return _backward_numpy(cfg, g, needs)
    from . import _sampling_cupy

    return _sampling_cupy.backward(cfg, g, needs)


def _meta(image, grid, *, mode="bilinear", padding_mode="zeros", align_corners=False,
          deterministic=False):
    """Output (shape, dtype) from the arguments' shapes and dtypes (see cutopo.vjp.OpSpec):
    (N, C, *grid.shape[1:-1]) in the result dtype of image and grid.

    First _prepare's checks on data-free stand-ins of zeros: a bad option, dtype or shape
    raises the op's own error before the op runs (its finiteness checks pass over the
    stand-ins, never the data)."""
    from ._adapters import stand_in

    _prepare(stand_in(image), stand_in(grid), mode, padding_mode, align_corners, deterministic)
    return ((image.shape[0], image.shape[1]) + tuple(grid.shape[1:-1]),
            _out_dtype(image.dtype, grid.dtype))


@register(name="grid_sample", forward=_forward, backward=_backward, arg_names=("image", "grid"),
          differentiable=("image", "grid"), meta=_meta)
def grid_sample(image, grid, *, mode="bilinear", padding_mode="zeros", align_corners=False,
                deterministic=False):
    r"""Sample images at the points of a grid: ``torch.nn.functional.grid_sample``'s semantics.

    ``out[n, c, *p]`` is the value of ``image[n, c]`` at the point ``grid[n, *p]``, interpolated
    (``mode``) from the pixels around it, with pixels outside the image given by
    ``padding_mode``. Differentiable in the image and the grid through :func:`cutopo.vjp`.

    Parameters
    ----------
    image : ndarray, shape (N, C, H, W) or (N, C, D, H, W)
        float16, float32 or float64.
    grid : ndarray, shape (N, H_out, W_out, 2) or (N, D_out, H_out, W_out, 3)
        Normalised sampling points, float16, float32 or float64, **x first**: ``grid[..., 0]``
        runs along the last image axis (W), ``grid[..., 1]`` along H, ``grid[..., 2]`` along D.
        -1 and 1 are the first and last pixel centres (``align_corners=True``) or the outer
        edges of the first and last pixels (``align_corners=False``); points outside [-1, 1]
        are allowed (``padding_mode`` says what they read). Must be finite.
    mode : {"bilinear", "nearest"}, keyword-only
        Bilinear (trilinear for 3-D images) interpolation, or the nearest pixel (ties round
        half to even, as torch).
    padding_mode : {"zeros", "border", "reflection"}, keyword-only
        Outside the image: zero, the nearest edge pixel, or the image reflected about its edges
        (about the edge pixel centres with ``align_corners=True``, about the outer pixel edges
        with ``align_corners=False``).
    align_corners : bool, keyword-only
        Whether -1 and 1 are the centres of the corner pixels (True) or their outer corners.
    deterministic : bool, keyword-only
        CuPy arrays: compute the image cotangent of the VJP without atomics (the (point,
        corner) entries sorted by the pixel they add to, then summed in that fixed order),
        bitwise reproducible from run to run. The default scatters it with atomic additions
        (faster; the order of the sums, hence the last bits, vary). The forward and the grid
        cotangent are always deterministic; so is the whole NumPy path, where this changes
        nothing.

    Returns
    -------
    out : ndarray, shape (N, C, H_out, W_out) or (N, C, D_out, H_out, W_out)
        Of the inputs' array type (NumPy or CuPy). dtype ``numpy.result_type(image, grid)``
        (torch requires equal dtypes; mixed ones are promoted here).

    Raises
    ------
    ValueError
        Shapes that disagree (batch, the grid's last axis against the image's spatial axes), an
        empty spatial axis, a non-finite grid or image, an unknown ``mode`` or ``padding_mode``.
        On CuPy arrays also image and grid on different devices.
    TypeError
        Non-float dtypes, a non-string mode or padding mode, a non-bool ``align_corners`` or
        ``deterministic``, one NumPy and one CuPy argument.

    Notes
    -----
    Pixel coordinates are ``(g + 1) (size - 1) / 2`` (``align_corners=True``) or
    ``(g + 1) size / 2 - 1/2``, then mapped into the image by the padding mode. The
    computation runs in float64 when the result is float64, else in float32 (float16 inputs are
    computed in float32 and the result rounded to float16). Non-finite images and grids are
    refused (ValueError), where torch would let a NaN pixel spoil every point whose
    interpolation reads it, even with weight 0. The NumPy path is chunked over
    output points (about :data:`_CHUNK_VALUES` point-channel values at a time).

    VJP: the image cotangent is the transpose of the interpolation, scattered deterministically
    (``numpy.bincount``, float64 accumulation). The grid cotangent is the derivative of the
    interpolation weights times that of the coordinate map, as torch computes it: the border
    clamp has derivative 0 outside ``[0, size - 1]``, reflection flips its sign on reflected
    stretches, and ``mode="nearest"`` gives zero. At the kinks (pixel boundaries, the edges of
    clamping or reflection) it is one-sided, as in torch.

    CUDA (CuPy arrays): one thread per output point (and group of channels, when the points
    alone cannot fill the device) sets up the cell once and loops over the channels, storing
    coalesced rows of each channel plane; the coordinate map, the weights and the sums round
    as the NumPy path does (no fused multiply-add), so both backends see the same cells. The
    finiteness of the image costs one extra read of it per call and one device-to-host copy
    of a flag (the call waits for the kernels). Index arithmetic is 64-bit. The VJP gives each
    point to one thread that sums the grid cotangent over the channels in registers (plain
    stores) and scatters the image cotangent with atomic additions, or, with
    ``deterministic=True``, sorts the (point, corner) entries by pixel and sums each pixel's
    entries in one thread. Images are read in their storage dtype (float16 computes in
    float32); grids are cast to the computation dtype, non-contiguous arrays copied.
    Cotangents are accumulated in the computation dtype (float64 on the NumPy path) and
    returned in their argument's dtype.

    Convention
    ----------
    The grid's last axis is (x, y) or (x, y, z): reversed with respect to the image's axes,
    as in PyTorch. ``grid_sample`` is a backward warp: ``out(p) = image(grid(p))``.

    Examples
    --------
    >>> import numpy as np, cutopo
    >>> image = np.arange(12.0).reshape(1, 1, 3, 4)
    >>> grid = np.array([[[[-1.0, -1.0], [0.0, 0.0], [1.0, 1.0]]]])   # (N, H_out, W_out, 2)
    >>> cutopo.grid_sample(image, grid, align_corners=True)
    array([[[[ 0. ,  5.5, 11. ]]]])
    >>> cutopo.grid_sample(image, grid, padding_mode="border")         # corners of the corner pixels
    array([[[[ 0. ,  5.5, 11. ]]]])
    >>> out, pullback = cutopo.vjp(cutopo.grid_sample, image, grid, align_corners=True)
    >>> d_image, d_grid = pullback(np.ones_like(out))
    >>> d_grid[0, 0, 1]                                                 # d out / d (x, y) at the centre
    array([1.5, 4. ])

    References
    ----------
    .. [1] M. Jaderberg, K. Simonyan, A. Zisserman, K. Kavukcuoglu, "Spatial Transformer
       Networks", NeurIPS 2015 (differentiable bilinear sampling).
    .. [2] PyTorch, ``torch.nn.functional.grid_sample`` (the semantics reproduced here).
    """
    return _forward(image, grid, mode=mode, padding_mode=padding_mode, align_corners=align_corners,
                    deterministic=deterministic)[0]
