"""The dense stationary-velocity-field (SVF) baseline of the CPAB benchmarks: phi = exp(v) by
scaling and squaring, as VoxelMorph integrates its fields (``VecInt``, 7 squarings, bilinear or
trilinear resampling), written with array operations and :func:`cutopo.grid_sample` and its VJP.

The pullbacks of the squarings are chained by hand (no autograd framework), so the baseline runs
on NumPy and on CuPy arrays alike, with cutopo's own sampling kernels: the comparison measures
the parameterisation and the integration, not a framework.

API (used by ``bench_register.py`` and ``bench_cpab.py``):

* :func:`svf_forward` ``(velocity, n_squarings=7) -> (phi, pullback)``: the map and its VJP.
* :func:`svf_warp` ``(image, velocity, ...) -> (out, pullback)``: the backward warp and its VJP.
* :func:`svf_register`: per-pair optimisation of v with the optimiser of
  :func:`cutopo.cpab.register` (:class:`cutopo._adam.Adam`).
* :func:`identity_grid`: the pixel centres in the unit box.

Convention
----------
cutopo's CPAB convention throughout, so that the maps compare directly with
:func:`cutopo.cpab.transform_grid`: coordinates in the unit box [0, 1]^K, coordinate k along
array axis k, pixel ``(i_0, ..., i_{K-1})`` of a grid of ``shape`` at ``((i_0 + 1/2) / shape[0],
...)``. A velocity field has VoxelMorph's layout (B, K, *spatial), component k (along array
axis k) on channel k, in unit-box lengths per unit time; phi has the same shape, in unit-box
positions (``numpy.moveaxis(phi, 1, -1)`` is transform_grid's layout). Sampling uses
``align_corners=False`` and ``border`` padding (VoxelMorph's ``SpatialTransformer`` pads with
zeros, which pulls a displacement towards 0 outside the image; the border keeps it constant,
as cutopo's warps do).

References
----------
.. [1] V. Arsigny, O. Commowick, X. Pennec, N. Ayache, "A log-Euclidean framework for statistics
   on diffeomorphisms", MICCAI 2006 (scaling and squaring of stationary velocity fields).
.. [2] A. V. Dalca, G. Balakrishnan, J. Guttag, M. R. Sabuncu, "Unsupervised learning of
   probabilistic diffeomorphic registration for images and surfaces", Medical Image Analysis
   57, 2019 (VoxelMorph-diff: ``VecInt`` with 7 squarings).
"""
from __future__ import annotations

import numpy as np

import cutopo
from cutopo._adam import Adam
from cutopo._array import array_module, to_numpy

__all__ = ["identity_grid", "svf_forward", "svf_warp", "svf_register", "N_SQUARINGS"]

N_SQUARINGS = 7          # VoxelMorph's default int_steps


def identity_grid(shape, xp=np, dtype=np.float32):
    """The pixel centres of a grid of ``shape`` in the unit box, shape (*shape, K)."""
    axes = [(xp.arange(n, dtype=np.float64) + 0.5) / n for n in shape]
    return xp.stack(xp.meshgrid(*axes, indexing="ij"), axis=-1).astype(dtype)


def _to_grid(points):
    """Unit-box points (..., K), axis order, to grid_sample's [-1, 1] coordinates, x first."""
    return 2 * points[..., ::-1] - 1


def _from_grid_cotangent(d_grid):
    """The transpose of :func:`_to_grid`'s linear part."""
    return 2 * d_grid[..., ::-1]


def _channels_first(field):
    """(B, *spatial, K) -> (B, K, *spatial), contiguous: a field as grid_sample's image."""
    xp = array_module(field)
    return xp.ascontiguousarray(xp.moveaxis(field, -1, 1))


def _channels_last(image):
    xp = array_module(image)
    return xp.ascontiguousarray(xp.moveaxis(image, 1, -1))


def _check_velocity(velocity):
    if velocity.ndim not in (4, 5) or velocity.shape[1] != velocity.ndim - 2:
        raise ValueError(f"velocity must have shape (B, 2, H, W) or (B, 3, D, H, W), got "
                         f"{velocity.shape}")
    if velocity.dtype.kind != "f":
        raise TypeError(f"velocity must be floating, got dtype {velocity.dtype}")


def svf_forward(velocity, n_squarings=N_SQUARINGS):
    """phi = exp(v) of a stationary velocity field by scaling and squaring, and its pullback.

    ``u_0 = v / 2**n``, then n times ``u <- u + u(x + u(x))`` (the displacement resampled
    bilinearly/trilinearly at the moved points), and ``phi = x + u_n``: the flow of v for unit
    time, VoxelMorph's ``VecInt``.

    Parameters
    ----------
    velocity : ndarray, shape (B, 2, H, W) or (B, 3, D, H, W)
        v at the pixel centres, unit-box lengths per unit time, channel k the component along
        spatial axis k (VoxelMorph's layout). NumPy or CuPy, float32 or float64.
    n_squarings : int, optional
        n (default 7).

    Returns
    -------
    phi : ndarray, the shape and dtype of velocity
        The map at the pixel centres, unit-box positions, channel k along spatial axis k.
    pullback : callable
        ``pullback(d_phi) -> d_velocity``: the VJP, the squarings' grid_sample VJPs (image
        and grid cotangents) chained backwards.
    """
    _check_velocity(velocity)
    xp = array_module(velocity)
    spatial = velocity.shape[2:]
    ident = identity_grid(spatial, xp, velocity.dtype)                  # (*spatial, K)
    u = velocity / 2 ** n_squarings                                     # (B, K, *spatial)
    pullbacks = []
    for _ in range(n_squarings):
        grid = _to_grid(ident + _channels_last(u))
        sampled, pullback = cutopo.vjp(cutopo.grid_sample, u, grid, mode="bilinear",
                                       padding_mode="border", align_corners=False)
        u = u + sampled
        pullbacks.append(pullback)

    def pullback(d_phi):
        g = d_phi                                      # the cotangent of u_n
        for pb in reversed(pullbacks):
            # u_{i+1} = u_i + S(u_i, x + u_i): identity, the sampled image, the sampling points
            d_image, d_grid = pb(g)
            g = g + d_image + _channels_first(_from_grid_cotangent(d_grid))
        return g / 2 ** n_squarings

    return xp.moveaxis(ident, -1, 0)[None] + u, pullback


def svf_warp(image, velocity, n_squarings=N_SQUARINGS, mode="bilinear", padding_mode="border"):
    """The backward warp ``out(x) = image(exp(v)(x))`` and its pullback.

    Parameters
    ----------
    image : ndarray, shape (B, C, *spatial)
    velocity : ndarray, shape (B, K, *spatial)
        As for :func:`svf_forward`, on the image's grid.
    n_squarings : int, optional
    mode, padding_mode : str, optional
        Of the image's sampling, as for :func:`cutopo.cpab.transform_image`.

    Returns
    -------
    out : ndarray, the image's shape
    pullback : callable
        ``pullback(d_out) -> (d_image, d_velocity)``.
    """
    phi, phi_pullback = svf_forward(velocity, n_squarings)
    out, sample_pullback = cutopo.vjp(cutopo.grid_sample, image, _to_grid(_channels_last(phi)),
                                      mode=mode, padding_mode=padding_mode, align_corners=False)

    def pullback(d_out):
        d_image, d_grid = sample_pullback(d_out)
        return d_image, phi_pullback(_channels_first(_from_grid_cotangent(d_grid)))

    return out, pullback


def _gradient_energy(v):
    """mean over pixels of |forward differences of v|^2 (pixel units) and its gradient:
    VoxelMorph's ``Grad('l2')`` regulariser without its averaging over axes."""
    xp = array_module(v)
    value, grad = 0.0, xp.zeros_like(v)
    for axis in range(2, v.ndim):
        d = xp.diff(v, axis=axis)
        value = value + (d * d).sum()
        pad_lo = [(0, 0)] * v.ndim
        pad_hi = [(0, 0)] * v.ndim
        pad_lo[axis], pad_hi[axis] = (1, 0), (0, 1)
        grad += 2 * (xp.pad(d, pad_lo) - xp.pad(d, pad_hi))       # d/dv of sum d^2
    n = v[:, 0].size
    return value / n, grad / n


def svf_register(fixed, moving, *, steps, lr, n_squarings=N_SQUARINGS, smoothness=0.0,
                 betas=(0.9, 0.999)):
    """Register ``moving`` to ``fixed`` with a dense SVF: Adam on v for the MSE (+ smoothness).

    Parameters
    ----------
    fixed, moving : ndarray, shape (1, C, *spatial)
        NumPy or CuPy, one array type.
    steps : int
        Adam steps.
    lr : float
        Adam's step size, in v's units (unit-box lengths per unit time).
    n_squarings : int, optional
    smoothness : float, optional
        Weight of the forward-difference gradient energy of v (pixel units; default 0).
    betas : (float, float), optional

    Returns
    -------
    velocity : ndarray, shape (1, K, *spatial)
    warped : ndarray, the images' shape
    history : numpy.ndarray of float64, shape (steps,)
        The MSE (with the smoothness term) before each update.
    final_mse : float
        The MSE of ``warped``.
    """
    xp = array_module(fixed)
    K = fixed.ndim - 2
    velocity = xp.zeros((1, K) + fixed.shape[2:], dtype=fixed.dtype)
    optimiser = Adam(velocity, lr, betas=betas)
    history = []
    for _ in range(steps):
        warped, pullback = svf_warp(moving, velocity, n_squarings)
        diff = warped - fixed
        value = (diff * diff).mean()
        d_velocity = pullback(diff * (2.0 / diff.size))[1]
        if smoothness:
            energy, d_energy = _gradient_energy(velocity)
            value = value + smoothness * energy
            d_velocity = d_velocity + smoothness * d_energy
        optimiser.step(d_velocity)
        history.append(value)
    warped = svf_warp(moving, velocity, n_squarings)[0]
    final = float(((warped - fixed) ** 2).mean())
    history = to_numpy(xp.stack(history)).astype(np.float64) if history else np.zeros(0)
    return velocity, warped, history, final
