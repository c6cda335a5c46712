"""CuPy path of :func:`cutopo.cpab.transform_image`: the fused kernels ``warp_forward`` and
``warp_backward`` of ``cuda_src/cpab.cu`` (its section "transform_image" describes them).

One thread per (batch item, pixel) integrates the pixel centre and samples the image at the
end point, so the (B, *spatial, K) grid of the composed path (``transform_grid`` then
``grid_sample``) never exists, nor the VJP's checkpoints: the backward recomputes each
trajectory in its thread. The result equals the composed path's (same operations, same
roundings); the theta cotangent sums the same terms in another order.
"""
from __future__ import annotations

import dataclasses
import functools

import numpy as np

from .. import sampling as _sampling
from .._cuda.compile import register_instances
from .._cuda.launch import Signature, launch
from .._sampling_cupy import _CTYPE, PADDING_CODES, _dims, _flag
from . import _integrate_cupy as icp
from .velocity import check_points_theta
from ._checks import broadcast_batch, check_n_steps

FAMILY = icp.FAMILY
THREADS = icp.THREADS
# (image storage, computation, output) for each trajectory dtype: the computation dtype is
# float64 when the trajectory's or the image's is (grid_sample's rule for a grid of that dtype).
TYPES = {"float32": (("float16", "float32", "float32"), ("float32", "float32", "float32"),
                     ("float64", "float64", "float64")),
         "float64": (("float16", "float64", "float64"), ("float32", "float64", "float64"),
                     ("float64", "float64", "float64"))}


@functools.lru_cache(maxsize=None)  # memoized: a call looks it up
def _forward_sig(t, ti, r, o, K, project, nearest):
    name = (f"cutopo::cpab::warp_forward<{_CTYPE[t]}, {_CTYPE[ti]}, {_CTYPE[r]}, {_CTYPE[o]}, {K}, "
            f"{_flag(project)}, {_flag(nearest)}>")
    return Signature(FAMILY, name, (f"ptr:{t}", f"ptr:{ti}", f"ptr:{o}", f"ptr:{t}", "int64",
                                    "int64") + ("int32",) * 13)


@functools.lru_cache(maxsize=None)
def _backward_sig(t, ti, r, K, project, nearest):
    name = (f"cutopo::cpab::warp_backward<{_CTYPE[t]}, {_CTYPE[ti]}, {_CTYPE[r]}, {K}, "
            f"{_flag(project)}, {_flag(nearest)}>")
    # fit_shared: integrate_backward's local arrays (launch._fit_shared_carveout)
    return Signature(FAMILY, name, (f"ptr:{t}", f"ptr:{ti}", f"ptr:{r}", f"ptr:{r}", "ptr:float64",
                                    f"ptr:{t}", "int64", "int64") + ("int32",) * 15,
                     fit_shared=True)


def _instances():
    for t, combos in TYPES.items():
        for ti, r, o in combos:
            for K in (2, 3):
                for project in (False, True):
                    for nearest in (False, True):
                        yield _forward_sig(t, ti, r, o, K, project, nearest).name
                        yield _backward_sig(t, ti, r, K, project, nearest).name


register_instances(FAMILY, _instances)


def supports(n_steps) -> bool:
    """Whether the backward can keep an n_steps trajectory's checkpoints in local memory
    (n_steps <= 272: 16 checkpoints, segments of at most 17); longer ones take the composed path."""
    return icp.local_segment(n_steps, 4) is not None


def _image_finite(image):
    """(1,) float64 on the device: 1 where the image holds no NaN or inf."""
    import cupy

    return cupy.isfinite(image).all(keepdims=True).reshape(1).astype(np.float64)


@dataclasses.dataclass
class Residuals:
    plan: object            # _integrate_cupy.Plan of the trajectories (its points unused)
    image: object           # (Bi, C, S) C-contiguous, storage dtype
    spatial: tuple
    real: np.dtype          # computation dtype of the sample
    nearest: bool
    padding: int
    theta_ndim: int


def forward(image, theta, tess, n_steps, mode, padding_mode):
    """(out (B, C, *spatial), Residuals) for a CuPy image (N, C, *spatial) and theta, on the
    image's device."""
    with image.device:
        return _forward(image, theta, tess, n_steps, mode, padding_mode)


def _forward(image, theta, tess, n_steps, mode, padding_mode):
    import cupy

    _sampling._choice(mode, "mode", _sampling.MODES)
    _sampling._choice(padding_mode, "padding_mode", _sampling.PADDING_MODES)
    image = _sampling._float_array(image, "image")
    n_steps = check_n_steps(n_steps)
    # The kernels make the pixel centres themselves; integrate's checks and plan are given one
    # float32 point, which gives the trajectories transform_grid's dtype (theta's, at least
    # float32) and costs no pass over a grid of centres.
    probe = cupy.full((1, tess.ndim), 0.5, dtype=np.float32)
    _, theta, dtype = check_points_theta(probe, theta, tess, "transform_image", defer_finite=True)
    N, C = image.shape[:2]
    spatial = tuple(int(s) for s in image.shape[2:])
    if 0 in spatial:
        raise ValueError(f"image: spatial shape {spatial} has a zero-length axis")
    S = int(np.prod(spatial))
    B = broadcast_batch(N, len(theta) if theta.ndim == 2 else 1, ("image", "theta"),
                        "transform_image")
    ti, r, o = next(c for c in TYPES[dtype.name] if c[0] == image.dtype.name)
    img = cupy.ascontiguousarray(image).reshape(N, C, S)
    out = cupy.empty((B, C, S), dtype=o)
    K = tess.ndim
    padding = PADDING_CODES[padding_mode]
    # the image's finiteness is read with the plan's own checks, after the warp is queued
    with icp.checked_plan(probe, theta, tess, n_steps, "transform_image", dtype,
                          extra=(_image_finite(image),),
                          messages=(_sampling._IMAGE_NOT_FINITE,)) as plan:
        launch(_forward_sig(dtype.name, ti, r, o, K, plan.project, mode == "nearest"),
               icp._blocks(B * S), THREADS,
               (plan.E, img, out, cupy.empty(0, dtype=dtype), B, plan.C, int(plan.n_theta == 1),
                int(N == 1), C, n_steps, 1, 0, padding) + icp._grid(plan.shape) + _dims(spatial))
    res = Residuals(plan, img, spatial, np.dtype(r), mode == "nearest", padding, theta.ndim)
    return out.reshape((B, C) + spatial), res


def backward(res: Residuals, cotangent, need_image, need_theta):
    """(d_image (Bi, C, *spatial) in the computation dtype or None, d_theta float64 or None),
    on the image's device."""
    with res.image.device:
        return _backward(res, cotangent, need_image, need_theta)


def _backward(res: Residuals, cotangent, need_image, need_theta):
    import cupy

    plan, img = res.plan, res.image
    Bi, C, S = img.shape
    B = broadcast_batch(Bi, plan.n_theta, ("image", "theta"), "transform_image")
    K = plan.K
    g = cupy.ascontiguousarray(cotangent, dtype=res.real).reshape(B, C, S)
    d_image = cupy.zeros((Bi, C, S), dtype=res.real) if need_image else cupy.empty(0, res.real)
    wants_moments = need_theta and not res.nearest
    G = cupy.zeros((plan.n_theta * plan.C, K * (K + 1)) if wants_moments else (0,),
                   dtype=np.float64)
    segment = icp.local_segment(plan.n_steps, 4)
    if need_image or wants_moments:
        launch(_backward_sig(plan.dtype.name, img.dtype.name, res.real.name, K, plan.project,
                             res.nearest), icp._blocks(B * S), THREADS,
               (plan.E, img, g, d_image, G, cupy.empty(0, dtype=plan.dtype), B, plan.C,
                int(plan.n_theta == 1), int(Bi == 1), C, plan.n_steps, segment, 1, res.padding,
                int(need_image), int(wants_moments))
               + icp._grid(plan.shape) + _dims(res.spatial))
    d_theta = None
    if need_theta:
        d_theta = (icp.theta_cotangent(plan, G) if wants_moments
                   else cupy.zeros((plan.n_theta, plan.tess.n_params), dtype=np.float64))
        if res.theta_ndim == 1:
            d_theta = d_theta[0]
    return (d_image.reshape((Bi, C) + res.spatial) if need_image else None), d_theta
