"""Cascades of CPAB transformations, ``phi_{theta_m} o ... o phi_{theta_1}``, differentiable in
every theta.

:func:`compose` moves points through m integrations in turn; :func:`compose_grid` and
:func:`compose_image` are its pixel-grid and backward-warp forms (the cascade's counterparts of
:func:`~cutopo.cpab.transform_grid` and :func:`~cutopo.cpab.transform_image`). The m fields
share one tessellation and are stacked on a leading axis, so that every differentiable argument
is one array (one cotangent each, as :func:`cutopo.vjp` and the framework adapters expect).

The VJPs chain the registered VJPs of the parts: the cotangent runs backwards through the
stages, each stage's integrate backward giving the cotangent of its start points (the previous
stage's output) and of its theta.
"""
from __future__ import annotations

import numpy as np

from .._array import array_module, is_cupy_array
from ..vjp import register
from ._checks import broadcast_batch, check_count
from .integrate import _integrate_meta, integrate
from .tessellation import Tessellation
from .transform import (_check_image, _check_shape, _EmptyResiduals, _from_normalised_cotangent,
                        _GRID_SAMPLE, _sum_to, _theta_dtype, _to_normalised, centres_like,
                        empty_cotangents, empty_warp)

__all__ = ["compose", "compose_grid", "compose_image"]

_INTEGRATE = integrate.__cutopo_op__


def _check_thetas(thetas, tess, name):
    """thetas as a NumPy or CuPy array of shape (m, d) or (m, B, d), m >= 1."""
    if isinstance(thetas, (list, tuple)):
        # one array per differentiable argument: a list would silently get no cotangent
        raise TypeError(f"cpab.{name}: thetas must be one array of shape (m, d) or (m, B, d); "
                        f"stack the fields first (numpy.stack(thetas) or cupy.stack(thetas))")
    if not isinstance(tess, Tessellation):
        raise TypeError(f"tess must be a cutopo.cpab.Tessellation, got {type(tess).__name__}")
    if not (isinstance(thetas, np.ndarray) or is_cupy_array(thetas)):
        thetas = np.asarray(thetas)
    d = tess.n_params
    if thetas.ndim not in (2, 3) or thetas.shape[-1] != d or thetas.shape[0] < 1:
        raise ValueError(f"cpab.{name}: thetas must have shape (m, {d}) or (m, B, {d}) with "
                         f"m >= 1 (n_params={d}), got {thetas.shape}")
    return thetas


# -- compose --------------------------------------------------------------------------------------

def _compose_forward(points, thetas, tess, *, n_steps=50, checkpoint_every=4):
    thetas = _check_thetas(thetas, tess, "compose")
    residuals, x = [], points
    for theta in thetas:
        x, r = _INTEGRATE.forward(x, theta, tess, n_steps=n_steps,
                                  checkpoint_every=checkpoint_every)
        residuals.append(r)
    return x, (residuals, array_module(thetas))


def _compose_backward(residuals, cotangent, needs):
    stages, xp = residuals
    need_points, need_thetas = needs[0], needs[1]
    if not (need_points or need_thetas):
        return None, None, None
    lam, d_thetas = cotangent, []
    for i in range(len(stages) - 1, -1, -1):
        # stage i's start points are stage i-1's output: their cotangent carries on backwards
        want_points = i > 0 or need_points
        lam, d_theta, _ = _INTEGRATE.backward(stages[i], lam, (want_points, need_thetas, False))
        d_thetas.append(d_theta)
    d_thetas = xp.stack(d_thetas[::-1]) if need_thetas else None
    return (lam if need_points else None), d_thetas, None


def _compose_meta(points, thetas, tess, *, n_steps=50, checkpoint_every=4):
    """Output (shape, dtype) from the arguments' shapes and dtypes (see cutopo.vjp.OpSpec):
    integrate's rule (and checks) with one theta of the stack, after compose's checks of the
    stack on a data-free stand-in (a bad argument raises the op's own error)."""
    from .._adapters import ArraySpec, stand_in

    blank = _check_thetas(stand_in(thetas), tess, "compose")
    check_count(checkpoint_every, "checkpoint_every")
    # one theta of the stack: its shape (perhaps symbolic) and, for the checks, its example's
    one = ArraySpec(tuple(thetas.shape[1:]), np.dtype(thetas.dtype), blank.shape[1:])
    return _integrate_meta(points, one, tess, n_steps=n_steps)


@register(name="cpab_compose", forward=_compose_forward, backward=_compose_backward,
          arg_names=("points", "thetas", "tess"), differentiable=("points", "thetas"),
          meta=_compose_meta)
def compose(points, thetas, tess, *, n_steps=50, checkpoint_every=4):
    """The cascade ``phi_{thetas[m-1]} o ... o phi_{thetas[0]}`` of m CPAB transformations at points.

    Parameters
    ----------
    points : ndarray, shape (N, K) or (B, N, K)
        Start points, as for :func:`~cutopo.cpab.integrate`.
    thetas : ndarray, shape (m, n_params) or (m, B, n_params)
        The m fields, **applied in order**: ``thetas[0]`` first. One array (stack a list with
        ``numpy.stack``); ``thetas[i]`` is a theta as :func:`~cutopo.cpab.integrate` takes it.
        m >= 1.
    tess : Tessellation
        The tessellation of every field.
    n_steps, checkpoint_every : int, optional
        As for :func:`~cutopo.cpab.integrate`, for every stage (the step-size guard applies to
        each field).

    Returns
    -------
    phi : ndarray, shape (B, N, K), or (N, K) when neither points nor thetas has a batch axis
        dtype as :func:`~cutopo.cpab.integrate`'s; the array type of the inputs.

    Raises
    ------
    ValueError
        thetas not of shape (m, d) or (m, B, d) with m >= 1, and integrate's errors (points'
        shape, batch sizes that disagree, non-finite values, n_steps too small).
    TypeError
        thetas given as a list or tuple (stack it), ``tess`` not a :class:`Tessellation`, and
        integrate's type errors.

    Notes
    -----
    Each stage is :func:`~cutopo.cpab.integrate` with its own theta, so the cascade is the
    composition of the schemes' maps, and ``compose(x, stack([theta, -theta]))`` is the
    identity up to the discretisation error of the scheme (``phi_{-theta}`` is the inverse
    flow). A cascade of m fields reaches maps that no single CPA field on ``tess`` gives (the
    set of CPAB maps is not closed under composition), at m times the cost.

    VJP (registered as ``"cpab_compose"``, differentiable in points and thetas): the stages'
    integrate VJPs chained backwards; the thetas cotangent has thetas' shape (summed over a
    shared batch as integrate's), the points cotangent that of points. Exact for the scheme
    almost everywhere, as integrate's.

    Convention
    ----------
    As :func:`~cutopo.cpab.integrate`: the unit box [0, 1]^K, coordinate k of a point is
    array axis k. ``compose(x, thetas)[..., k]`` is coordinate k of
    ``phi_{thetas[m-1]}(... phi_{thetas[0]}(x))``.

    Examples
    --------
    >>> import numpy as np
    >>> from cutopo.cpab import Tessellation, compose, integrate
    >>> tess = Tessellation((3, 3))
    >>> thetas = tess.sample(2, length_scale=0.3, rng=0)                 # (2, d): two fields
    >>> x = np.random.default_rng(1).random((5, 2))
    >>> phi = compose(x, thetas, tess, n_steps=20)
    >>> bool(np.array_equal(phi, integrate(integrate(x, thetas[0], tess, n_steps=20),
    ...                                    thetas[1], tess, n_steps=20)))
    True
    >>> back = compose(x, np.stack([thetas[0], -thetas[0]]), tess)      # phi^-1 o phi
    >>> bool(np.abs(back - x).max() < 1e-3)
    True

    Differentiable in every theta:

    >>> import cutopo
    >>> out, pullback = cutopo.vjp(compose, x, thetas, tess, n_steps=20)
    >>> d_points, d_thetas, _ = pullback(np.ones_like(out))
    >>> d_points.shape, d_thetas.shape
    ((5, 2), (2, 26))

    References
    ----------
    .. [1] O. Freifeld, S. Hauberg, K. Batmanghelich, J. W. Fisher III, "Transformations based on
       continuous piecewise-affine velocity fields", IEEE TPAMI 39(12), 2017.
    .. [2] N. S. Detlefsen, O. Freifeld, S. Hauberg, "Deep diffeomorphic transformer networks",
       CVPR 2018 (cascades of CPAB layers).
    """
    thetas = _check_thetas(thetas, tess, "compose")
    check_count(checkpoint_every, "checkpoint_every")
    x = points
    for theta in thetas:
        x = integrate(x, theta, tess, n_steps=n_steps)
    return x


_COMPOSE = compose.__cutopo_op__


# -- compose_grid ---------------------------------------------------------------------------------

def _grid_forward(thetas, tess, shape, *, n_steps=50):
    thetas = _check_thetas(thetas, tess, "compose_grid")
    shape = _check_shape(shape, tess, "compose_grid")
    dtype = _theta_dtype(thetas.dtype) if thetas.dtype.kind in "fiu" else np.float64
    points = centres_like(thetas, shape, dtype)
    phi, residuals = _COMPOSE.forward(points, thetas, tess, n_steps=n_steps)
    return phi.reshape(phi.shape[:-2] + shape + (tess.ndim,)), (residuals, phi.shape)


def _grid_backward(residuals, cotangent, needs):
    inner, phi_shape = residuals
    if not needs[0]:
        return None, None, None
    _, d_thetas, _ = _COMPOSE.backward(inner, cotangent.reshape(phi_shape), (False, True, False))
    return d_thetas, None, None


def _grid_meta(thetas, tess, shape, *, n_steps=50):
    """Output (shape, dtype) from the arguments' shapes and dtypes (see cutopo.vjp.OpSpec).

    First compose_grid's checks, in its order, on a data-free stand-in of thetas: a bad
    argument raises the op's own error before the op runs."""
    from .._adapters import stand_in
    from .transform import _check_grid_arguments

    blank = _check_thetas(stand_in(thetas), tess, "compose_grid")
    _check_grid_arguments(blank[0], tess, shape, n_steps, "compose_grid")
    batch = (thetas.shape[1],) if thetas.ndim == 3 else ()
    return batch + tuple(int(s) for s in shape) + (tess.ndim,), _theta_dtype(thetas.dtype)


@register(name="cpab_compose_grid", forward=_grid_forward, backward=_grid_backward,
          arg_names=("thetas", "tess", "shape"), differentiable=("thetas",), meta=_grid_meta)
def compose_grid(thetas, tess, shape, *, n_steps=50):
    """The pixel centres of a regular grid moved by the cascade of :func:`compose`.

    Parameters
    ----------
    thetas : ndarray, shape (m, n_params) or (m, B, n_params)
        The fields, ``thetas[0]`` applied first (see :func:`compose`).
    tess : Tessellation
    shape : tuple of int
        The grid, ``tess.ndim`` positive ints, as for :func:`~cutopo.cpab.transform_grid`.
    n_steps : int, optional
        Integration steps per field (default 50).

    Returns
    -------
    phi : ndarray, shape (B, *shape, K), or (*shape, K) when thetas is (m, n_params)
        In unit-box coordinates; dtype ``result_type(thetas, float32)`` (float64 unless that
        is float32).

    Raises
    ------
    ValueError, TypeError
        As :func:`compose` and :func:`~cutopo.cpab.transform_grid`.

    Notes
    -----
    :func:`compose` at the pixel centres, reshaped; with m = 1 it equals
    ``transform_grid(thetas[0], tess, shape)``. VJP registered as ``"cpab_compose_grid"``,
    differentiable in thetas.

    Convention
    ----------
    As :func:`~cutopo.cpab.transform_grid`: pixel ``(i_0, ..., i_{K-1})`` of a grid of
    ``shape`` has its centre at ``((i_0 + 1/2) / shape[0], ...)``, ``phi[..., k]`` is along
    array axis k.

    References
    ----------
    .. [1] O. Freifeld, S. Hauberg, K. Batmanghelich, J. W. Fisher III, "Transformations based on
       continuous piecewise-affine velocity fields", IEEE TPAMI 39(12), 2017.

    Examples
    --------
    >>> import numpy as np
    >>> from cutopo.cpab import Tessellation, compose_grid, transform_grid
    >>> tess = Tessellation((2, 2))
    >>> thetas = tess.sample(3, length_scale=0.3, rng=0)                 # a cascade of 3
    >>> compose_grid(thetas, tess, (5, 4), n_steps=20).shape
    (5, 4, 2)
    >>> bool(np.array_equal(compose_grid(thetas[:1], tess, (5, 4)),
    ...                     transform_grid(thetas[0], tess, (5, 4))))
    True
    """
    return _grid_forward(thetas, tess, shape, n_steps=n_steps)[0]


# -- compose_image --------------------------------------------------------------------------------

def _image_forward(image, thetas, tess, *, n_steps=50, mode="bilinear", padding_mode="border"):
    thetas = _check_thetas(thetas, tess, "compose_image")
    image, B = _check_image(image, thetas[0], tess)
    if B == 0:
        return empty_warp(image, thetas, tess, n_steps, mode, padding_mode, name="compose_image",
                          theta_ndims=(2, 3))
    stack = thetas[:, None] if thetas.ndim == 2 else thetas              # (m, Bt, d)
    spatial = image.shape[2:]
    phi, grid_res = _grid_forward(stack, tess, spatial, n_steps=n_steps)  # (Bt, *spatial, K)
    grid = array_module(phi).broadcast_to(_to_normalised(phi), (B,) + phi.shape[1:])
    sample_image = array_module(image).broadcast_to(image, (B,) + image.shape[1:])
    out, sample_res = _GRID_SAMPLE.forward(sample_image, grid, mode=mode,
                                           padding_mode=padding_mode, align_corners=False)
    return out, (grid_res, sample_res, len(image), len(phi), thetas.ndim)


def _image_backward(residuals, cotangent, needs):
    need_image, need_thetas = needs[0], needs[1]
    if not (need_image or need_thetas):
        return None, None, None
    if isinstance(residuals, _EmptyResiduals):
        return empty_cotangents(residuals, need_image, need_thetas) + (None,)
    grid_res, sample_res, n_image, n_theta, thetas_ndim = residuals
    d_image, d_grid = _GRID_SAMPLE.backward(sample_res, cotangent, (need_image, need_thetas))
    if need_image:
        d_image = _sum_to(d_image, n_image)
    d_thetas = None
    if need_thetas:
        d_phi = _sum_to(_from_normalised_cotangent(d_grid), n_theta)
        d_thetas = _grid_backward(grid_res, d_phi, (True, False, False))[0]   # (m, Bt, d)
        if thetas_ndim == 2:
            d_thetas = d_thetas[:, 0]
    return d_image, d_thetas, None


def _image_meta(image, thetas, tess, *, n_steps=50, mode="bilinear", padding_mode="border"):
    """Output (shape, dtype) from the arguments' shapes and dtypes (see cutopo.vjp.OpSpec).

    First compose_image's checks, in its order, on data-free stand-ins: a bad argument raises
    the op's own error before the op runs (the values of thetas are left to the op)."""
    from .._adapters import stand_in
    from .transform import _check_grid_arguments, _check_sampling_options

    blank_thetas = _check_thetas(stand_in(thetas), tess, "compose_image")
    blank, batch = _check_image(stand_in(image), blank_thetas[0], tess)
    if batch == 0:
        empty_warp(blank, blank_thetas, tess, n_steps, mode, padding_mode, name="compose_image",
                   theta_ndims=(2, 3))
    else:
        stack = blank_thetas[:, None] if blank_thetas.ndim == 2 else blank_thetas
        _check_grid_arguments(stack[0], tess, blank.shape[2:], n_steps, "compose_grid")
        _check_sampling_options(blank, mode, padding_mode)
    Bt = thetas.shape[1] if thetas.ndim == 3 else 1
    B = broadcast_batch(image.shape[0], Bt, ("image", "thetas"), "compose_image")
    return ((B,) + tuple(image.shape[1:]),
            np.result_type(image.dtype, _theta_dtype(thetas.dtype)))


@register(name="cpab_compose_image", forward=_image_forward, backward=_image_backward,
          arg_names=("image", "thetas", "tess"), differentiable=("image", "thetas"),
          meta=_image_meta)
def compose_image(image, thetas, tess, *, n_steps=50, mode="bilinear", padding_mode="border"):
    """Warp images by the cascade of :func:`compose`: ``out(x) = image(phi_m(... phi_1(x)))``.

    Parameters
    ----------
    image : ndarray, shape (N, C, H, W) or (N, C, D, H, W)
        As for :func:`~cutopo.cpab.transform_image`.
    thetas : ndarray, shape (m, n_params) or (m, B, n_params)
        The fields, ``thetas[0]`` applied first to the output grid's points (see
        :func:`compose`); B = N, or a batch of 1 on either side broadcasts.
    tess : Tessellation
        A 2-D or 3-D tessellation.
    n_steps, mode, padding_mode
        As for :func:`~cutopo.cpab.transform_image` (``n_steps`` per field).

    Returns
    -------
    out : ndarray, shape (B', C, *spatial)
        B' the broadcast of N and B (N = B, or the one that is not 1: an empty batch, 0
        against 1, gives an empty result without integrating). dtype ``result_type(image,
        result_type(thetas, float32))``.

    Raises
    ------
    ValueError, TypeError
        As :func:`compose` and :func:`~cutopo.cpab.transform_image`.

    Notes
    -----
    ``grid_sample(image, 2 phi[..., ::-1] - 1, align_corners=False)`` with ``phi =
    compose_grid(thetas, tess, spatial)``; with m = 1 it equals ``transform_image(image,
    thetas[0], tess)``. Backward warp: the output pixel at x reads the input at the cascade's
    image of x, so the field applied *first* to x is ``thetas[0]``. VJP registered as
    ``"cpab_compose_image"``, differentiable in image and thetas.

    Convention
    ----------
    As :func:`~cutopo.cpab.transform_image`: pixel ``(i, j)`` of an H x W image sits at
    ``((i + 1/2) / H, (j + 1/2) / W)`` in the unit box, coordinate 0 along the rows.

    References
    ----------
    As for :func:`~cutopo.cpab.transform_image` (CPAB fields; sampling at the moved grid).

    Examples
    --------
    >>> import numpy as np, cutopo
    >>> from cutopo.cpab import Tessellation, compose_image
    >>> tess = Tessellation((2, 2))
    >>> image = np.random.default_rng(0).random((1, 1, 8, 8))
    >>> thetas = tess.sample(2, length_scale=0.3, rng=0)
    >>> out, pullback = cutopo.vjp(compose_image, image, thetas, tess, n_steps=20)
    >>> d_image, d_thetas, _ = pullback(np.ones_like(out))
    >>> out.shape, d_thetas.shape
    ((1, 1, 8, 8), (2, 10))
    """
    return _image_forward(image, thetas, tess, n_steps=n_steps, mode=mode,
                          padding_mode=padding_mode)[0]
