"""Grids and images moved by a CPAB transformation: :func:`transform_grid` and :func:`transform_image`.

Both are thin compositions of registered ops, differentiated by composing their VJPs (the
forward and backward of each :class:`~cutopo.vjp.OpSpec` are called directly, so the inner
backwards compute only the cotangents that are asked for):

* ``transform_grid = integrate(pixel centres)``, reshaped to the grid;
* ``transform_image = grid_sample(image, to_normalised(transform_grid))``, with
  ``to_normalised(phi) = 2 phi[..., ::-1] - 1`` (axis order reversed to grid_sample's x first,
  the unit box onto [-1, 1] with ``align_corners=False``, so that pixel centres land on pixel
  centres).

On CuPy images ``transform_image`` is not composed: one kernel per call integrates every pixel
centre and samples the image at its end point (``_warp_cupy``, with the same operations and
roundings, so the same output), and its VJP recomputes the trajectories, so no grid and no
checkpoints are ever stored. ``FUSED = False`` selects the composition (the fused path's test
oracle; also taken for n_steps > 272, beyond the backward's local checkpoints).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools

import numpy as np

from .. import sampling as _sampling
from .._array import array_module, is_cupy_array
from ..sampling import grid_sample
from ..vjp import register
from . import _warp_cupy
from ._checks import broadcast_batch, check_count, check_n_steps
from .integrate import integrate
from .tessellation import Tessellation

__all__ = ["transform_grid", "transform_image"]


# -- helpers -------------------------------------------------------------------------------------

def _theta_dtype(theta_dtype) -> np.dtype:
    """The dtype integrate computes in for float points of the same dtype as theta."""
    dtype = np.result_type(theta_dtype, np.float32)
    return dtype if dtype in (np.float32, np.float64) else np.dtype(np.float64)


def _check_shape(shape, tess, name):
    """``shape`` as a tuple of tess.ndim positive ints."""
    if not isinstance(tess, Tessellation):
        raise TypeError(f"tess must be a cutopo.cpab.Tessellation, got {type(tess).__name__}")
    try:
        items = tuple(shape)
    except TypeError:
        raise TypeError(f"cpab.{name}: shape must be a tuple of ints, got {shape!r}") from None
    if len(items) != tess.ndim:
        raise ValueError(f"cpab.{name}: shape {items} has {len(items)} axes, the tessellation "
                         f"{tess.ndim}")
    return tuple(check_count(s, "shape") for s in items)


def pixel_centres(shape, dtype=np.float64, xp=np):
    """(prod(shape), K) unit-box coordinates of the pixel centres of a grid of ``shape``:
    point ``(i_0, ..., i_{K-1})`` (C order) is ``((i_0 + 1/2) / shape[0], ...)``, made by the
    array module ``xp`` (CuPy: on the current device, the same correctly rounded float64
    operations, so the same values)."""
    axes = [(xp.arange(n, dtype=np.float64) + 0.5) / n for n in shape]
    mesh = xp.meshgrid(*axes, indexing="ij", copy=False)
    return xp.stack([m.ravel() for m in mesh], axis=-1).astype(dtype)


class _Shared:
    """A memoized array; on the device, retired (cutopo._cuda.tables) when the memo drops it."""

    __slots__ = ("array", "__weakref__")

    def __init__(self, array):
        self.array = array


@functools.lru_cache(maxsize=4)
def _shared_centres(shape, dtype, device_id):
    if device_id is None:
        centres = pixel_centres(shape, dtype)
        centres.setflags(write=False)
        return _Shared(centres)
    import cupy

    from .._cuda import tables

    with cupy.cuda.Device(device_id):  # ready for every stream: callers on any stream share it
        shared = _Shared(tables.made_ready(lambda: pixel_centres(shape, dtype, cupy)))
    tables.retire_with(shared, shared.array)
    return shared


def centres_like(like, shape, dtype):
    """:func:`pixel_centres` (shape, dtype) on the array type and device of ``like``, made once
    per (shape, dtype, device) and shared: an iterative caller (register's every step) would
    otherwise build and upload the grid's coordinates every time, which cost more than the
    step's kernels. Shared arrays are never written (NumPy's are read-only)."""
    device_id = like.device.id if is_cupy_array(like) else None
    return _shared_centres(tuple(int(s) for s in shape), np.dtype(dtype), device_id).array


def _to_normalised(phi):
    """Unit-box points (..., K), axis order, to grid_sample's [-1, 1] coordinates, x first."""
    return 2 * phi[..., ::-1] - 1


def _from_normalised_cotangent(d_grid):
    """The transpose of :func:`_to_normalised`'s linear part."""
    return 2 * d_grid[..., ::-1]


_INTEGRATE = integrate.__cutopo_op__
_GRID_SAMPLE = grid_sample.__cutopo_op__
# CuPy images: one kernel integrates every pixel centre and samples there (_warp_cupy), with no
# grid array and a backward that recomputes the trajectories; False: the composition below
# (integrate, then grid_sample), kept as the fused path's test oracle and for n_steps > 272.
FUSED = True


# -- transform_grid --------------------------------------------------------------------------------

def _grid_forward(theta, tess, shape, *, n_steps=50):
    shape = _check_shape(shape, tess, "transform_grid")
    theta_dtype = theta.dtype if hasattr(theta, "dtype") else np.asarray(theta).dtype
    # CuPy theta: the centres are made on its device
    points = centres_like(theta, shape, _theta_dtype(theta_dtype)
                          if theta_dtype.kind in "fiu" else np.float64)
    phi, residuals = _INTEGRATE.forward(points, theta, tess, n_steps=n_steps)
    out_shape = phi.shape[:-2] + shape + (tess.ndim,)                    # (B,)? + shape + (K,)
    return phi.reshape(out_shape), (residuals, phi.shape)


def _grid_backward(residuals, cotangent, needs):
    inner, phi_shape = residuals
    if not needs[0]:
        return None, None, None
    _, d_theta, _ = _INTEGRATE.backward(inner, cotangent.reshape(phi_shape),
                                        (False, True, False))
    return d_theta, None, None


def _grid_meta(theta, tess, shape, *, n_steps=50):
    """Output (shape, dtype) from the arguments' shapes and dtypes (see cutopo.vjp.OpSpec).

    First transform_grid's checks (the grid's shape, then integrate's of theta and n_steps,
    the grid's points being the op's own), on a data-free stand-in of theta: a bad argument
    raises the op's own error before the op runs."""
    from .._adapters import stand_in

    _check_grid_arguments(stand_in(theta), tess, shape, n_steps, "transform_grid")
    batch = (theta.shape[0],) if theta.ndim == 2 else ()
    return batch + tuple(int(s) for s in shape) + (tess.ndim,), _theta_dtype(theta.dtype)


@register(name="cpab_transform_grid", forward=_grid_forward, backward=_grid_backward,
          arg_names=("theta", "tess", "shape"), differentiable=("theta",), meta=_grid_meta)
def transform_grid(theta, tess, shape, *, n_steps=50):
    """The pixel centres of a regular grid moved by phi_theta: ``phi_theta(x)`` at every pixel.

    Parameters
    ----------
    theta : ndarray, shape (n_params,) or (B, n_params)
        Vertex velocities, as for :func:`~cutopo.cpab.integrate`. A CuPy theta runs on the
        device (the pixel centres are made there) and gives a CuPy result.
    tess : Tessellation
    shape : tuple of int
        The grid's size along each axis, ``tess.ndim`` positive ints (``(H, W)`` in 2D,
        ``(D, H, W)`` in 3D).
    n_steps : int, optional
        Integration steps, as for :func:`~cutopo.cpab.integrate` (default 50, with the same
        step-size guard).

    Returns
    -------
    phi : ndarray, shape (B, *shape, K), or (*shape, K) when theta has no batch axis
        ``phi[b, i_0, ..., i_{K-1}]`` is ``phi_theta_b`` at the centre of pixel ``(i_0, ...)``,
        in unit-box coordinates (see Convention). dtype ``result_type(theta, float32)``
        (float64 unless that is float32).

    Raises
    ------
    ValueError
        ``shape`` without ``tess.ndim`` positive entries, and :func:`~cutopo.cpab.integrate`'s
        errors (theta's shape, non-finite theta, ``n_steps`` too small).
    TypeError
        ``tess`` not a :class:`Tessellation`, ``shape`` not a sequence of ints.
    Notes
    -----
    This is :func:`~cutopo.cpab.integrate` at the pixel centres, reshaped; its VJP (registered
    as ``"cpab_transform_grid"``, differentiable in theta) is integrate's with the cotangent
    reshaped back.

    Convention
    ----------
    As :func:`~cutopo.cpab.integrate`'s: coordinate k is array axis k, in the unit box
    [0, 1]^K. Pixel ``(i_0, ..., i_{K-1})`` of a grid of ``shape`` has its centre at
    ``((i_0 + 1/2) / shape[0], ..., (i_{K-1} + 1/2) / shape[K-1])``, so the grid's pixels tile
    the box, and ``phi[..., k]`` is the moved point's coordinate along array axis k (row
    first in 2D: the reverse of grid_sample's x-first order).

    References
    ----------
    .. [1] O. Freifeld, S. Hauberg, K. Batmanghelich, J. W. Fisher III, "Transformations based on
       continuous piecewise-affine velocity fields", IEEE TPAMI 39(12), 2017.

    Examples
    --------
    >>> import numpy as np
    >>> from cutopo.cpab import Tessellation, transform_grid
    >>> tess = Tessellation((2, 2))
    >>> phi = transform_grid(np.zeros(tess.n_params), tess, (2, 4))   # theta = 0: the centres
    >>> phi.shape
    (2, 4, 2)
    >>> phi[1, 0]                                                     # row 1, column 0
    array([0.75 , 0.125])
    >>> theta = tess.sample(3, length_scale=0.3, rng=0)
    >>> transform_grid(theta, tess, (5, 6), n_steps=20).shape
    (3, 5, 6, 2)
    """
    return _grid_forward(theta, tess, shape, n_steps=n_steps)[0]


# -- transform_image -------------------------------------------------------------------------------

def _check_image(image, theta, tess):
    """image as an array with 2 + tess.ndim axes; (batch of the result, theta's batch)."""
    if not isinstance(tess, Tessellation):
        raise TypeError(f"tess must be a cutopo.cpab.Tessellation, got {type(tess).__name__}")
    if tess.ndim not in (2, 3):
        raise ValueError(f"cpab.transform_image: images are 2-D or 3-D, the tessellation is "
                         f"{tess.ndim}-D")
    if is_cupy_array(image) != is_cupy_array(theta):
        which, other = ("image", "theta") if is_cupy_array(image) else ("theta", "image")
        raise TypeError(f"cpab.transform_image: {which} is a CuPy array but {other} is not: move "
                        f"both to one device")
    image = array_module(image).asarray(image)
    if image.ndim != 2 + tess.ndim:
        want = "(N, C, H, W)" if tess.ndim == 2 else "(N, C, D, H, W)"
        raise ValueError(f"cpab.transform_image: image must have shape {want} for a "
                         f"{tess.ndim}-D tessellation, got {image.shape}")
    Bt = np.shape(theta)[0] if np.ndim(theta) == 2 else 1
    return image, broadcast_batch(image.shape[0], Bt, ("image", "theta"), "transform_image")


@dataclasses.dataclass
class _EmptyResiduals:
    """The residuals of a warp of an empty batch: what the zero cotangents need."""

    image: tuple            # (shape, dtype) of d_image: the image's, in the computation dtype
    theta: tuple            # (shape, dtype) of d_theta: theta's, float64 (as integrate's)
    xp: object
    device: object          # the arrays' CuPy device, or None


def _on(device):
    return device if device is not None else contextlib.nullcontext()


def empty_warp(image, theta, tess, n_steps, mode, padding_mode, *, name="transform_image",
               theta_ndims=(1, 2)):
    """``(out, residuals)`` of a warp whose batch is empty (batch sizes 0 and 0, or 0 and 1):
    the empty result, without integrating or launching a kernel, so that nothing indexes the
    empty argument. Shapes, dtypes and options are checked as the warp checks them; theta's
    values are never read, so neither its finiteness nor the step-size guard is checked.
    ``theta_ndims``: the numbers of axes theta may have (compose_image's thetas: (2, 3))."""
    _sampling._choice(mode, "mode", _sampling.MODES)
    _sampling._choice(padding_mode, "padding_mode", _sampling.PADDING_MODES)
    image = _sampling._float_array(image, "image")
    check_n_steps(n_steps)
    _check_shape(image.shape[2:], tess, name)
    xp = array_module(image)
    theta = xp.asarray(theta)
    if theta.dtype.kind not in "fiu":
        raise TypeError(f"theta must hold real numbers, got dtype {theta.dtype}")
    d = tess.n_params
    if theta.ndim not in theta_ndims or theta.shape[-1] != d:   # compose_image's: checked before
        raise ValueError(f"theta must have shape ({d},) or (B, {d}) (n_params={d}), got "
                         f"{theta.shape}")
    dtype = np.result_type(image.dtype, _theta_dtype(theta.dtype))    # _image_meta's rule
    device = image.device if is_cupy_array(image) else None
    with _on(device):
        out = xp.zeros((0,) + image.shape[1:], dtype=dtype)
    return out, _EmptyResiduals((image.shape, dtype), (theta.shape, np.dtype(np.float64)), xp,
                                device)


def empty_cotangents(res, need_image, need_theta):
    """(d_image, d_theta) of :func:`empty_warp`: zeros, the output having no entries."""
    with _on(res.device):
        return tuple(res.xp.zeros(*spec) if need else None
                     for spec, need in ((res.image, need_image), (res.theta, need_theta)))


def _sum_to(g, n):
    """Sum a batch cotangent (B, ...) to a broadcast argument's batch n (1 or B)."""
    return g.sum(axis=0, keepdims=True) if n == 1 != len(g) else g


def _image_forward(image, theta, tess, *, n_steps=50, mode="bilinear", padding_mode="border"):
    image, B = _check_image(image, theta, tess)
    if B == 0:
        return empty_warp(image, theta, tess, n_steps, mode, padding_mode)
    if FUSED and is_cupy_array(image) and _warp_cupy.supports(n_steps):
        return _warp_cupy.forward(image, theta, tess, n_steps, mode, padding_mode)
    theta2 = array_module(theta).asarray(theta)
    theta2 = theta2[None] if theta2.ndim == 1 else theta2
    spatial = image.shape[2:]
    phi, grid_res = _grid_forward(theta2, tess, spatial, n_steps=n_steps)  # (Bt, *spatial, K)
    xp = array_module(image)
    grid = array_module(phi).broadcast_to(_to_normalised(phi), (B,) + phi.shape[1:])
    sample_image = xp.broadcast_to(image, (B,) + image.shape[1:])
    out, sample_res = _GRID_SAMPLE.forward(sample_image, grid, mode=mode,
                                           padding_mode=padding_mode, align_corners=False)
    return out, (grid_res, sample_res, len(image), len(phi), np.ndim(theta))


def _image_backward(residuals, cotangent, needs):
    need_image, need_theta = needs[0], needs[1]
    if not (need_image or need_theta):
        return None, None, None
    if isinstance(residuals, _EmptyResiduals):
        return empty_cotangents(residuals, need_image, need_theta) + (None,)
    if isinstance(residuals, _warp_cupy.Residuals):
        return _warp_cupy.backward(residuals, cotangent, need_image, need_theta) + (None,)
    grid_res, sample_res, n_image, n_theta, theta_ndim = residuals
    d_image, d_grid = _GRID_SAMPLE.backward(sample_res, cotangent, (need_image, need_theta))
    if need_image:
        d_image = _sum_to(d_image, n_image)
    d_theta = None
    if need_theta:
        d_phi = _sum_to(_from_normalised_cotangent(d_grid), n_theta)
        d_theta = _grid_backward(grid_res, d_phi, (True, False, False))[0]
        if theta_ndim == 1:
            d_theta = d_theta[0]
    return d_image, d_theta, None


def _check_grid_arguments(theta, tess, shape, n_steps, name):
    """The checks of a warp's grid (shape rules only): ``shape`` for ``tess``, then
    integrate's of ``theta`` (a stand-in array: its shape and dtype) and ``n_steps``."""
    from .velocity import check_points_theta

    _check_shape(shape, tess, name)
    check_points_theta(np.zeros((1, tess.ndim)), theta, tess, "integrate")
    check_n_steps(n_steps)


def _check_sampling_options(image, mode, padding_mode):
    """grid_sample's checks of the options and the image's dtype (shape rules only), on
    1-pixel stand-ins of the image and the grid."""
    K = image.ndim - 2
    _sampling._prepare(np.zeros((1,) * (K + 2), image.dtype), np.zeros((1,) * (K + 1) + (K,)),
                       mode, padding_mode, False)


def _image_meta(image, theta, tess, *, n_steps=50, mode="bilinear", padding_mode="border"):
    """Output (shape, dtype) from the arguments' shapes and dtypes (see cutopo.vjp.OpSpec).

    First transform_image's checks, in its order, on data-free stand-ins: a bad argument
    raises the op's own error before the op runs (theta's values, read by the step-size guard,
    are left to the op)."""
    from .._adapters import stand_in

    blank_theta = stand_in(theta)
    blank, batch = _check_image(stand_in(image), blank_theta, tess)
    if batch == 0:
        empty_warp(blank, blank_theta, tess, n_steps, mode, padding_mode)
    else:
        _check_grid_arguments(blank_theta[None] if blank_theta.ndim == 1 else blank_theta, tess,
                              blank.shape[2:], n_steps, "transform_grid")
        _check_sampling_options(blank, mode, padding_mode)
    # the result's batch from the (possibly symbolic) shapes, not the stand-ins' example sizes
    Bt = theta.shape[0] if theta.ndim == 2 else 1
    B = broadcast_batch(image.shape[0], Bt, ("image", "theta"), "transform_image")
    return ((B,) + tuple(image.shape[1:]),
            np.result_type(image.dtype, _theta_dtype(theta.dtype)))


@register(name="cpab_transform_image", forward=_image_forward, backward=_image_backward,
          arg_names=("image", "theta", "tess"), differentiable=("image", "theta"),
          meta=_image_meta)
def transform_image(image, theta, tess, *, n_steps=50, mode="bilinear", padding_mode="border"):
    """Warp images by a CPAB transformation: the backward warp ``out(x) = image(phi_theta(x))``.

    Parameters
    ----------
    image : ndarray, shape (N, C, H, W) or (N, C, D, H, W)
        float16, float32 or float64 (as :func:`cutopo.grid_sample`), with ``tess.ndim``
        spatial axes; finite. NumPy or CuPy, as theta (CuPy: integrate's and grid_sample's
        CUDA kernels).
    theta : ndarray, shape (n_params,) or (B, n_params)
        Vertex velocities, as for :func:`~cutopo.cpab.integrate`: one field for every image,
        or one per image (B = N; a batch of 1 on either side broadcasts, as in NumPy: 1
        against 0 gives an empty batch).
    tess : Tessellation
        A 2-D or 3-D tessellation.
    n_steps : int, optional
        Integration steps, as for :func:`~cutopo.cpab.integrate` (default 50).
    mode : {"bilinear", "nearest"}, optional
        Interpolation, as for :func:`cutopo.grid_sample` (bilinear is trilinear in 3-D).
    padding_mode : {"border", "zeros", "reflection"}, optional
        What points outside the image read, as for :func:`cutopo.grid_sample`. Default
        ``"border"``: under the no-slip and slip boundaries phi maps the box into itself, so
        only the half pixel between the outermost pixel centres and the box's faces is
        outside the image.

    Returns
    -------
    out : ndarray, shape (B', C, *spatial)
        The warped images, on the same grid as ``image``; B' is the broadcast of N and B (N =
        B, or the one that is not 1). dtype ``result_type(image,
        result_type(theta, float32))`` (float64 for a float64 image or theta).

    Raises
    ------
    ValueError
        An image whose number of spatial axes is not ``tess.ndim``, a 1-D tessellation, batch
        sizes that disagree, a non-finite image, unknown modes, and the errors of
        :func:`~cutopo.cpab.integrate` (theta's shape, ``n_steps`` too small).
    TypeError
        ``tess`` not a :class:`Tessellation`, a non-float image, one of image and theta a CuPy
        array and the other not.
    Notes
    -----
    ``transform_image(image, theta, tess) == grid_sample(image, 2 phi[..., ::-1] - 1,
    align_corners=False)`` with ``phi = transform_grid(theta, tess, spatial)``. The VJP
    (registered as ``"cpab_transform_image"``, differentiable in image and theta) composes
    grid_sample's VJP (image and grid cotangents) with the transpose of that coordinate
    conversion and integrate's VJP; the cotangent of an argument broadcast over the batch is
    summed over it. The result is exact almost everywhere: bilinear interpolation has kinks at
    pixel boundaries and the integration scheme at cell faces (one-sided derivatives there).

    On CuPy arrays one fused kernel integrates and samples (n_steps <= 272): the same output
    as the composition, bit for bit, without the (B, *spatial, K) grid; its VJP recomputes
    each trajectory in its thread, so the forward and backward together hold no more than
    the image, the output, their cotangents and per-cell tables.

    An empty batch (B' = 0) returns an empty ``out`` of the array type and dtype above, and
    its VJP zero cotangents, without integrating or launching a kernel: theta's values are
    then not read (neither its finiteness nor the step-size guard is checked).

    Convention
    ----------
    Pixel centres in the unit box as for :func:`transform_grid`: pixel ``(i, j)`` of an H x W
    image sits at ``((i + 1/2) / H, (j + 1/2) / W)``, coordinate 0 along the rows (array axis
    0 of the spatial axes), as in :func:`~cutopo.cpab.integrate`. The image's pixels tile the
    box, which is why the conversion to grid_sample's coordinates uses
    ``align_corners=False`` (-1 and 1 are the outer edges of the image) and reverses the
    axis order (grid_sample's grid is x, i.e. the last axis, first). Backward warp: the output
    pixel at x reads the input at phi_theta(x); ``-theta`` warps (approximately) the other
    way.

    References
    ----------
    .. [1] O. Freifeld, S. Hauberg, K. Batmanghelich, J. W. Fisher III, "Transformations based on
       continuous piecewise-affine velocity fields", IEEE TPAMI 39(12), 2017.
    .. [2] M. Jaderberg, K. Simonyan, A. Zisserman, K. Kavukcuoglu, "Spatial Transformer
       Networks", NeurIPS 2015 (sampling an image at the transformed grid).

    Examples
    --------
    >>> import numpy as np
    >>> from cutopo.cpab import Tessellation, transform_image
    >>> tess = Tessellation((2, 2))
    >>> image = np.random.default_rng(0).random((1, 1, 8, 8))
    >>> out = transform_image(image, np.zeros(tess.n_params), tess)      # theta = 0: identity
    >>> bool(np.abs(out - image).max() < 1e-12)
    True
    >>> theta = tess.sample(2, length_scale=0.3, rng=0)
    >>> transform_image(image, theta, tess, n_steps=20).shape           # image shared by both
    (2, 1, 8, 8)

    Differentiable in image and theta:

    >>> import cutopo
    >>> out, pullback = cutopo.vjp(transform_image, image, theta, tess, n_steps=20)
    >>> d_image, d_theta, d_tess = pullback(np.ones_like(out))
    >>> d_image.shape, d_theta.shape, d_tess
    ((1, 1, 8, 8), (2, 10), None)
    """
    return _image_forward(image, theta, tess, n_steps=n_steps, mode=mode,
                          padding_mode=padding_mode)[0]
