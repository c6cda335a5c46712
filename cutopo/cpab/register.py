"""Pairwise image registration with one CPAB transformation: Adam on theta, optionally coarse to fine.

:func:`register` finds theta such that the backward warp of the moving image,
``transform_image(moving, theta, tess)``, matches the fixed image under MSE or local NCC. Each
step is one :func:`cutopo.vjp` of :func:`~cutopo.cpab.transform_image` (forward and theta
cotangent), the loss's own gradient (:mod:`cutopo.cpab.losses`) and one Adam update; every
array stays on the images' device. Coarse-to-fine runs optimise on nested tessellations in
turn and carry theta over exactly (:func:`~cutopo.cpab.prolong`).
"""
from __future__ import annotations

import dataclasses
import math
import time

import numpy as np

from .. import sampling as _sampling
from .._adam import Adam
from .._array import array_module, as_array, is_cupy_array, to_numpy
from .._progress import ProgressBar
from ..vjp import vjp
from . import _register_cupy
from ._checks import PRACTICAL_STEPS, StepSizeError, check_count, check_n_steps
from .folding import folding_fraction as _folding_fraction
from .integrate import MAX_STEP_NORM
from .integrate import log_jacobian as _log_jacobian
from .losses import local_ncc, mse
from .prolong import prolong, refinement_factor
from .smoothness import dirichlet_matrix
from .tessellation import Tessellation
from .transform import centres_like, transform_grid, transform_image

__all__ = ["register", "RegistrationResult", "LOSSES"]

LOSSES = ("mse", "ncc")
LR_SCHEDULES = ("cosine", "constant")


@dataclasses.dataclass
class RegistrationResult:
    """What :func:`register` returns.

    Attributes
    ----------
    theta : ndarray, shape (tess.n_params,)
        The parameters found, on the finest tessellation :attr:`tess`; array type and dtype
        of the computation (float64 for float64 images, else float32).
    tess : Tessellation
        The tessellation of :attr:`theta` (the ``tess`` argument of :func:`register`).
    warped : ndarray, the moving image's shape
        ``transform_image(moving, theta, tess)`` in the moving image's layout.
    loss_history : numpy.ndarray of float64, shape (total steps,)
        The loss at the theta of every step, before its update (all levels in order).
    final_loss : float
        The loss of :attr:`warped`, after the last update.
    folding_fraction : float or None
        The share of pixels whose finite-difference Jacobian determinant of phi is <= 0
        (:func:`cutopo.cpab.folding.folding_fraction`, VoxelMorph's and TransMorph's
        measure); 0 for CPAB maps up to the differences' error. None without diagnostics.
    log_jacobian : ndarray, the spatial shape, or None
        The exact log det D phi_theta at every pixel centre
        (:func:`~cutopo.cpab.log_jacobian`): > 0 expansion, < 0 compression, finite
        everywhere (no folding). None without diagnostics.
    phi : ndarray, shape (*spatial, K), or None
        The map at the pixel centres (:func:`~cutopo.cpab.transform_grid`), unit-box
        coordinates: the output pixel at x reads the moving image at ``phi(x)``. None
        without diagnostics.
    level_shapes : tuple of tuple of int
        The tessellation shapes of the levels, coarse to fine.
    level_steps : tuple of int
        Adam steps per level.
    n_steps : int
        The integration steps of the last level: the ``n_steps`` argument, or more where theta
        outgrew it (see :func:`register`).
    loss : str
        ``"mse"`` or ``"ncc"``.
    seconds : float
        Wall time of the optimisation (levels, steps and the final warp; no diagnostics).
    """

    # the arrays stay out of the repr, which shows the scalars and the levels
    theta: object = dataclasses.field(repr=False)
    tess: Tessellation = dataclasses.field(repr=False)
    warped: object = dataclasses.field(repr=False)
    loss_history: np.ndarray = dataclasses.field(repr=False)
    final_loss: float
    folding_fraction: float | None
    log_jacobian: object = dataclasses.field(repr=False)
    phi: object = dataclasses.field(repr=False)
    level_shapes: tuple
    level_steps: tuple
    n_steps: int
    loss: str
    seconds: float


# -- argument checks ------------------------------------------------------------------------------

def _check_image(x, name, K):
    x = as_array(x, name)
    if x.dtype.kind not in "biuf":
        raise TypeError(f"{name} must hold real numbers, got dtype {x.dtype}")
    if x.ndim not in (K, K + 1):
        want = "(H, W) or (C, H, W)" if K == 2 else "(D, H, W) or (C, D, H, W)"
        raise ValueError(f"{name} must have shape {want} for a {K}-D tessellation, got {x.shape}")
    if 0 in x.shape:
        raise ValueError(f"{name} is empty (shape {x.shape})")
    if x.dtype.kind == "f" and not bool(array_module(x).isfinite(x).all()):
        raise ValueError(f"{name} must be finite (found NaN or inf)")
    return x


def _check_pair(fixed, moving, tess):
    """(fixed, moving) as (1, C, *spatial) arrays of the computation dtype, that dtype, and
    whether moving has a channel axis (the layout of the warped result)."""
    if not isinstance(tess, Tessellation):
        raise TypeError(f"tess must be a cutopo.cpab.Tessellation, got {type(tess).__name__}")
    K = tess.ndim
    if K not in (2, 3):
        raise ValueError(f"cpab.register: images are 2-D or 3-D, the tessellation is {K}-D")
    fixed, moving = _check_image(fixed, "fixed", K), _check_image(moving, "moving", K)
    if is_cupy_array(fixed) != is_cupy_array(moving):
        which = "fixed" if is_cupy_array(fixed) else "moving"
        raise TypeError(f"{which} is a CuPy array but the other image is not: move both to one "
                        f"device")
    if fixed.shape[-K:] != moving.shape[-K:]:
        raise ValueError(f"fixed and moving have different spatial shapes: {fixed.shape[-K:]} "
                         f"and {moving.shape[-K:]}")
    channels = [x.shape[0] if x.ndim == K + 1 else 1 for x in (fixed, moving)]
    if channels[0] != channels[1]:
        raise ValueError(f"fixed and moving have different numbers of channels: {channels[0]} "
                         f"and {channels[1]} (channels come first: (C, *spatial))")
    dtype = np.result_type(fixed.dtype, moving.dtype, np.float32)
    dtype = dtype if dtype in (np.float32, np.float64) else np.dtype(np.float64)
    as4 = lambda x: x.reshape((1, channels[0]) + x.shape[-K:]).astype(dtype, copy=False)  # noqa: E731
    return as4(fixed), as4(moving), dtype, moving.ndim == K + 1


def _check_positive(value, name, *, zero=False):
    """A finite real number > 0 (>= 0 with ``zero``), as a float; bools are not numbers here."""
    kind = "non-negative" if zero else "positive"
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer,
                                                                      np.floating)):
        raise TypeError(f"{name} must be a {kind} number, got {value!r}")
    if not (math.isfinite(value) and (value >= 0 if zero else value > 0)):
        raise ValueError(f"{name} must be a {kind} finite number, got {value!r}")
    return float(value)


def _check_betas(betas):
    """Adam's (beta1, beta2): two real numbers in [0, 1) (Adam itself would unpack and compare
    anything, and fail with errors that do not name the argument)."""
    if isinstance(betas, (str, bytes)) or not isinstance(betas, (list, tuple, np.ndarray)) \
            or len(betas) != 2:
        raise TypeError(f"betas must be a pair of numbers (beta1, beta2), got {betas!r}")
    out = []
    for b in betas:
        if isinstance(b, (bool, np.bool_)) or not isinstance(b, (int, float, np.integer,
                                                                  np.floating)):
            raise TypeError(f"betas must be a pair of numbers (beta1, beta2), got {betas!r}")
        if not 0 <= b < 1:                                 # NaN fails this too
            raise ValueError(f"betas must lie in [0, 1), got {betas!r}")
        out.append(float(b))
    return tuple(out)


def _check_flag(value, name):
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be True or False, got {value!r}")
    return bool(value)


def _level_tessellations(tess, levels):
    """The tessellations of the levels, coarse to fine, ending with ``tess``."""
    if isinstance(levels, (int, np.integer)) and not isinstance(levels, (bool, np.bool_)):
        n = check_count(levels, "levels")
        divisor = 2 ** (n - 1)
        if any(s % divisor for s in tess.shape):
            raise ValueError(f"levels={n}: every entry of tess.shape {tess.shape} must be "
                             f"divisible by 2**{n - 1} = {divisor} (each level halves the "
                             f"cells); pass the coarse shapes instead, e.g. levels=[(5, 5)]")
        shapes = [tuple(s // 2 ** (n - 1 - l) for s in tess.shape) for l in range(n - 1)]
    elif isinstance(levels, (list, tuple)):
        shapes = list(levels)
    else:
        raise TypeError(f"levels must be an int or a sequence of tessellation shapes, got "
                        f"{levels!r}")
    chain = []
    for entry in shapes:
        if isinstance(entry, Tessellation):
            chain.append(entry)
            continue
        try:
            chain.append(Tessellation(entry, zero_boundary=tess.zero_boundary))
        except (TypeError, ValueError) as exc:          # Tessellation's errors name "shape"
            raise type(exc)(f"levels: entry {entry!r}: {exc}") from None
    if not chain or chain[-1].shape != tess.shape:
        chain.append(tess)
    else:
        chain[-1] = tess
    for coarse, fine in zip(chain[:-1], chain[1:]):
        try:
            refinement_factor(coarse, fine)
        except ValueError as exc:
            raise ValueError(f"levels: {exc}") from None
    return chain


def _level_steps(steps, n_levels):
    if isinstance(steps, (list, tuple)):
        if len(steps) != n_levels:
            raise ValueError(f"steps has {len(steps)} entries for {n_levels} levels")
        return tuple(check_count(s, "steps", minimum=0) for s in steps)
    return (check_count(steps, "steps", minimum=0),) * n_levels


def _initial_theta(theta0, tess, xp, dtype):
    if theta0 is None:
        return xp.zeros(tess.n_params, dtype=dtype)
    if is_cupy_array(theta0) != (xp is not np):
        raise TypeError("theta0 must be on the images' device (NumPy or CuPy like them)")
    theta0 = xp.asarray(theta0)
    if theta0.dtype.kind not in "fiu":
        raise TypeError(f"theta0 must hold real numbers, got dtype {theta0.dtype}")
    if theta0.shape != (tess.n_params,):
        raise ValueError(f"theta0 must have shape ({tess.n_params},) (the first level's "
                         f"n_params), got {theta0.shape}")
    if not bool(xp.isfinite(theta0).all()):
        raise ValueError("theta0 must be finite")
    return theta0.astype(dtype)                        # a copy: Adam updates it in place


# -- the optimisation -----------------------------------------------------------------------------

def _raised_n_steps(largest, n_steps):
    """An n_steps that passes integrate's step-size guard for a field whose max_c
    ||A_c,lin||_F is ``largest`` (the guard's StepSizeError carries it), with a quarter to
    spare (so that a theta still growing does not trip it again at once); None where no
    practical count does (theta diverged)."""
    if not math.isfinite(largest):
        return None
    raised = max(n_steps + 1, math.ceil(1.25 * largest / MAX_STEP_NORM))
    return raised if raised <= PRACTICAL_STEPS else None


def _dirichlet(tess, xp, dtype):
    """``theta -> Q theta`` in ``dtype`` with Q the Dirichlet matrix of ``tess``: scipy's sparse
    product on the host; on the device the ELL kernel of the CPAB basis products (Q is as
    sparse as the basis), summed in float64 and rounded to dtype, one launch where cuSPARSE
    costs ~0.15 ms of host work per product (every registration step makes one)."""
    if xp is np:
        Q = dirichlet_matrix(tess).astype(dtype)
        return lambda theta: Q @ theta
    from ._integrate_cupy import _dirichlet_table, _ell_product

    table, n = _dirichlet_table(tess), tess.n_params
    return lambda theta: _ell_product(table, theta.reshape(1, n), n)[0].astype(dtype, copy=False)


def register(fixed, moving, tess, *, loss="mse", steps=200, lr=0.01, levels=1, n_steps=50,
             smoothness=0.0, theta0=None, ncc_window=9, betas=(0.9, 0.999), lr_schedule="cosine",
             mode="bilinear", padding_mode="border", diagnostics=True, progress=True):
    """Register ``moving`` to ``fixed`` with one CPAB transformation (per-pair optimisation).

    Minimises ``loss(transform_image(moving, theta, tess), fixed) + smoothness * integral
    |grad v_theta|^2`` over theta with Adam, starting from the identity (theta = 0),
    optionally on a sequence of nested tessellations from coarse to fine.

    Parameters
    ----------
    fixed, moving : ndarray, shape (H, W) or (C, H, W) in 2-D; (D, H, W) or (C, D, H, W) in 3-D
        The images, NumPy or CuPy (both the same; every computation stays on their device).
        A channel axis, if any, comes first; the number of spatial axes is ``tess.ndim``, so a
        3-D array is a 2-D image with channels under a 2-D tessellation and a volume under a
        3-D one. Same spatial shape and number of channels; real and finite. Computed in
        float64 when either is float64, else in float32.
    tess : Tessellation
        A 2-D or 3-D tessellation: the finest level, whose theta is returned.
    loss : {"mse", "ncc"}, optional
        Mean squared error (default), or the negative local normalised cross-correlation
        (:func:`cutopo.cpab.losses.local_ncc`, window ``ncc_window``), for images whose
        intensities differ by a local affine map.
    steps : int or sequence of int, optional
        Adam steps per level (default 200), or one count per level.
    lr : float, optional
        Adam's step size (default 0.01), in theta's units (velocities, domain lengths per
        unit time: 0.01 moves a vertex's velocity by about 1 % of the image per step).
    levels : int or sequence, optional
        1 (default): optimise on ``tess`` alone. An int n > 1: n levels, level l with
        ``tess.shape / 2**(n-1-l)`` cells (each entry must divide). A sequence: the coarser
        levels' shapes (or :class:`Tessellation` objects), coarse to fine; ``tess`` ends it
        (it may be given as the last entry). Each level must nest in the previous one (one
        integer factor on all axes, see :func:`~cutopo.cpab.prolong`); theta carries over
        exactly, and Adam restarts at every level.
    n_steps : int, optional
        Integration steps of the transformation (default 50; see
        :func:`~cutopo.cpab.integrate`). Should theta outgrow integrate's step-size guard
        during the optimisation, n_steps is raised to what the guard asks for, plus a quarter
        (reading theta on the host once); the result's ``n_steps`` says which was used last.
    smoothness : float, optional
        Weight of the velocity field's Dirichlet energy ``integral over [0, 1]^K of
        |grad v|^2`` (default 0), exact for a CPA field
        (:func:`cutopo.cpab.smoothness.dirichlet_matrix`): the diffusion regulariser of
        dense methods. Adam normalises the gradient, so vertices that see no image structure
        (flat backgrounds) or only fine texture would otherwise take steps of about ``lr``
        in directions the images barely constrain; a small weight (relative to the loss's
        scale: about 1e-6 to 1e-4 for MSE on images in [0, 1]) keeps the field smooth there.
    theta0 : ndarray, shape (n_params of the first level,), optional
        Start here instead of at theta = 0 (on the images' device).
    ncc_window : int, optional
        Odd window width of the NCC loss (default 9).
    betas : (float, float), optional
        Adam's moment decay rates, two numbers in [0, 1) (default (0.9, 0.999)).
    lr_schedule : {"cosine", "constant"}, optional
        Step size within each level: ``"cosine"`` (default) anneals it from ``lr`` to 0 over
        the level's steps, ``lr * (1 + cos(pi k / steps)) / 2`` at step k; ``"constant"``
        keeps ``lr``. Adam's steps are about ``lr`` per parameter whatever the gradient's
        size, so at a constant step size theta keeps jittering by about ``lr`` around the
        optimum (a velocity error of ``lr``, about ``lr`` times the image size in pixels of
        displacement); the annealed step lets it settle.
    mode, padding_mode : str, optional
        Interpolation of the warp, as for :func:`~cutopo.cpab.transform_image` (defaults
        "bilinear" and "border").
    diagnostics : bool, optional
        Compute :attr:`RegistrationResult.folding_fraction`, ``log_jacobian`` and ``phi``
        after the optimisation (default True; two more integrations of the grid).
    progress : bool, optional
        Draw a progress bar with the current loss on stderr (default True).

    Returns
    -------
    RegistrationResult
        theta, the warped image, the loss history, the folding fraction and the exact
        log-Jacobian map, among others (see :class:`RegistrationResult`).

    Raises
    ------
    ValueError
        Images whose shapes or channel counts disagree, that do not fit ``tess``, or that are
        not finite; an unknown ``loss``, ``lr_schedule``, ``mode`` or ``padding_mode``;
        ``steps`` < 0; ``lr`` not positive; ``smoothness`` negative; ``betas`` outside
        [0, 1); an even or non-positive ``ncc_window``; levels that do not nest or do not
        divide ``tess.shape``; theta0 of the wrong shape.
    TypeError
        ``tess`` not a :class:`Tessellation`, non-real images, one image on the GPU and the
        other not; an argument of the wrong type (``betas`` not a pair of numbers,
        ``diagnostics`` or ``progress`` not a bool, a non-numeric ``lr`` or
        ``smoothness``, ...).

    Notes
    -----
    Every step runs ``cutopo.vjp(transform_image, moving, theta, tess, wrt="theta")``, the
    loss and its gradient in the warped image (written out for both losses), the pullback,
    and :class:`cutopo._adam.Adam`'s update, all array operations on the images' device; the
    loss history stays there until the end, and the progress bar reads the loss only when it
    redraws (about ten times a second). On CuPy images with ``loss="mse"`` the same step runs
    as a fixed sequence of kernel launches on buffers made once per level (the fused warp,
    the MSE gradient, the fused warp's backward, the Frechet adjoint, Adam), captured once as
    a CUDA graph and replayed; the step-size guard and the finiteness of theta become device
    flags read once every 100 steps: a chunk that trips them is replayed from its start
    through the ``cutopo.vjp`` loop, which raises ``n_steps`` (or the error) exactly as it
    would have.

    Under the no-slip and slip boundaries the transformation is a diffeomorphism for every
    theta, so no regulariser is needed against folding; the tessellation sets the smoothness.
    The folding fraction is reported for comparison with dense methods (VoxelMorph,
    TransMorph); it can exceed 0 for CPAB maps only where the map varies faster than the
    pixel grid resolves (the differences' error), and a spatial axis of size 1 is left out of
    it. ``log_jacobian`` is the exact certificate (finite everywhere). Under
    ``zero_boundary=None`` both hold only for pixels whose trajectories stay in the box:
    outside it the scheme follows a discontinuous field (see
    :func:`~cutopo.cpab.integrate`, "Outside the box").

    Convention
    ----------
    Backward warp, as :func:`~cutopo.cpab.transform_image`: ``warped(x) = moving(phi_theta(x))``
    on the fixed image's grid, pixel ``(i, j)`` of an H x W image at ``((i + 1/2) / H,
    (j + 1/2) / W)`` in the unit box, coordinate k along array axis k. So if ``moving`` is
    ``transform_image(fixed, -theta_true)`` (``fixed`` deformed by ``phi_{-theta_true}``), the
    registration recovers theta close to theta_true.

    Examples
    --------
    >>> import numpy as np
    >>> from scipy.ndimage import gaussian_filter
    >>> from cutopo.cpab import Tessellation, register, transform_image
    >>> rng = np.random.default_rng(0)
    >>> fixed = gaussian_filter(rng.random((32, 32)), 2)
    >>> tess = Tessellation((2, 2))
    >>> theta_true = tess.sample(1, length_scale=0.5, scale=0.04, rng=1)[0]
    >>> moving = transform_image(fixed[None, None], -theta_true, tess)[0, 0]
    >>> result = register(fixed, moving, tess, steps=60, lr=0.01, n_steps=20, progress=False)
    >>> bool(result.final_loss < 0.05 * result.loss_history[0]), result.folding_fraction
    (True, 0.0)

    References
    ----------
    .. [1] O. Freifeld, S. Hauberg, K. Batmanghelich, J. W. Fisher III, "Transformations based on
       continuous piecewise-affine velocity fields", IEEE TPAMI 39(12), 2017.
    .. [2] D. P. Kingma, J. Ba, "Adam: a method for stochastic optimization", ICLR 2015.
    .. [3] G. Balakrishnan, A. Zhao, M. R. Sabuncu, J. Guttag, A. V. Dalca, "VoxelMorph: a
       learning framework for deformable medical image registration", IEEE TMI 38(8), 2019
       (the NCC loss and the folding measure).
    """
    fixed4, moving4, dtype, moving_channels = _check_pair(fixed, moving, tess)
    if not isinstance(loss, str) or loss not in LOSSES:
        raise ValueError(f"loss must be one of {', '.join(map(repr, LOSSES))}, got {loss!r}")
    lr = _check_positive(lr, "lr")
    if not isinstance(lr_schedule, str) or lr_schedule not in LR_SCHEDULES:
        raise ValueError(f"lr_schedule must be one of {', '.join(map(repr, LR_SCHEDULES))}, got "
                         f"{lr_schedule!r}")
    smoothness = _check_positive(smoothness, "smoothness", zero=True)
    betas = _check_betas(betas)
    _sampling._choice(mode, "mode", _sampling.MODES)      # before any step, not at the first warp
    _sampling._choice(padding_mode, "padding_mode", _sampling.PADDING_MODES)
    diagnostics = _check_flag(diagnostics, "diagnostics")
    progress = _check_flag(progress, "progress")
    window = check_count(ncc_window, "ncc_window")
    if window % 2 == 0:
        raise ValueError(f"ncc_window must be odd, got {window}")
    n_steps = check_n_steps(n_steps)
    chain = _level_tessellations(tess, levels)
    per_level = _level_steps(steps, len(chain))
    xp = array_module(fixed4)
    theta = _initial_theta(theta0, chain[0], xp, dtype)
    warp = dict(mode=mode, padding_mode=padding_mode)

    def objective(warped):
        return mse(warped, fixed4) if loss == "mse" else local_ncc(warped, fixed4, window)

    def forward(t):
        """The warp and its pullback, raising n_steps once if theta outgrew it."""
        nonlocal n_steps
        try:
            return vjp(transform_image, moving4, theta, t, wrt="theta", n_steps=n_steps, **warp)
        except StepSizeError as exc:
            raised = _raised_n_steps(exc.largest, n_steps)
            if raised is None:
                raise ValueError(f"register: theta diverged (its field grew past what any "
                                 f"practical n_steps integrates); lower lr (got {lr})") from exc
        n_steps = raised
        return vjp(transform_image, moving4, theta, t, wrt="theta", n_steps=n_steps, **warp)

    start = time.perf_counter()
    history = []                                  # 1-D pieces: a step's value, or a chunk's
    with ProgressBar(sum(per_level), "register", enabled=progress) as bar:
        for level, (t, count) in enumerate(zip(chain, per_level)):
            if level:
                theta = prolong(theta, chain[level - 1], t).astype(dtype, copy=False)
            optimiser = Adam(theta, lr, betas=betas)
            Q = _dirichlet(t, xp, dtype) if smoothness else None

            def lr_at(k, count=count):
                if lr_schedule == "cosine":
                    return 0.5 * lr * (1 + math.cos(math.pi * k / count))
                return lr

            def eager_step(k, t=t, optimiser=optimiser, Q=Q):
                optimiser.lr = lr_at(k)
                warped, pullback = forward(t)
                value, d_warped = objective(warped)
                d_theta = pullback(d_warped)[1]
                if smoothness:
                    Q_theta = Q(theta)
                    value = value + smoothness * (theta * Q_theta).sum()
                    d_theta = d_theta + (2 * smoothness) * Q_theta
                optimiser.step(d_theta)
                history.append(value.reshape(1))
                bar.update(1, status=lambda: f"loss {float(value):.4g}")

            # CuPy and MSE: chunks of steps on the device with no host read per step; a chunk
            # that tripped the step-size guard (or met a non-finite theta) is replayed eagerly
            # from its start, which raises n_steps (or the error) where the eager loop would.
            device_level, k = None, 0
            while k < count:
                stop = min(count, k + _register_cupy.CHUNK)
                if _register_cupy.usable(moving4, loss, n_steps):
                    if device_level is None or device_level.n_steps != n_steps:
                        device_level = _register_cupy.Level(moving4, fixed4, optimiser, t,
                                                            n_steps, mode, padding_mode,
                                                            smoothness)
                    saved = (theta.copy(), optimiser.m.copy(), optimiser.v.copy(), optimiser.t)
                    device_level.clear()
                    values = device_level.run(k, stop, lr_at, bar)
                    if not device_level.flagged():
                        history.append(values)
                        k = stop
                        continue
                    theta[...], optimiser.m[...], optimiser.v[...] = saved[:3]
                    optimiser.t = saved[3]
                    bar.update(k - stop)
                for step in range(k, stop):
                    eager_step(step)
                k = stop
    warped = forward(tess)[0]
    final = objective(warped)[0]
    if smoothness:
        final = final + smoothness * (theta * _dirichlet(tess, xp, dtype)(theta)).sum()
    final_loss = float(final)
    if history:
        history = to_numpy(xp.concatenate(history)).astype(np.float64)
    else:
        history = np.zeros(0)
    seconds = time.perf_counter() - start

    spatial = tuple(fixed4.shape[2:])
    folding = log_det = phi = None
    if diagnostics:
        phi = transform_grid(theta, tess, spatial, n_steps=n_steps)
        folding = _folding_fraction(phi)
        centres = centres_like(theta, spatial, dtype)
        log_det = _log_jacobian(centres, theta, tess, n_steps=n_steps).reshape(spatial)
    warped = warped[0] if moving_channels else warped[0, 0]
    return RegistrationResult(theta=theta, tess=tess, warped=warped, loss_history=history,
                              final_loss=final_loss, folding_fraction=folding,
                              log_jacobian=log_det, phi=phi,
                              level_shapes=tuple(t.shape for t in chain),
                              level_steps=per_level, n_steps=n_steps, loss=loss,
                              seconds=seconds)
