"""CuPy path of the CPA ops: launches of ``cuda_src/cpab.cu`` (its header describes the kernels).

Per call (:func:`checked_plan`): one ``prepare_cells`` launch makes A = B theta (an ELL
product of the memoized sparse basis), the step-size guard's norm and E_c = expm(h A~_c) per
cell, and checks the finiteness of the points and theta; its last block stores the flags and
the norm in page-locked host memory (a PinnedStatus), read once the call's kernels are queued
(:mod:`cutopo._cuda.deferred`). Then one
thread per (batch item, point) for the trajectory. The VJP runs
``integrate_backward`` (per-cell moments G_c: float64 atomics from a per-warp queue, see
MOMENTS), ``frechet_cells`` (dL/dA_c) and B^T (ELL) on the device. The callers in
:mod:`cutopo.cpab.integrate` and :mod:`cutopo.cpab.velocity` shape the results.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools

import numpy as np

from .._cuda import tables
from .._cuda.compile import register_instances
from .._cuda.deferred import DeferredFlags, reading, thread_status
from .._cuda.launch import (CALL_INT64, HOST_WORD, NULL, Signature, _current_device,
                            as_c_contiguous, device_empty, device_zeros, launch)
from ._checks import check_step_size
from .velocity import raise_not_finite

FAMILY = "cpab"
THREADS = 256          # cpab::THREADS
MAX_SEGMENT = 17       # cpab::MAX_SEGMENT: the largest checkpoint_every of the backward
MAX_LOCAL_CHECKPOINTS = 16  # cpab::MAX_LOCAL_CHECKPOINTS
# Where the VJP's checkpoints live (see checkpoint_segment):
# * "device": the forward writes x_t every S steps to a (ceil(T/S), B, N, K) array, which
#   dominates the VJP's memory (13 copies of the points at T = 50, S = 4);
# * "recompute": the backward kernel runs each trajectory's forward again and keeps its
#   checkpoints in the thread's local memory: one more forward pass, no such array. It needs
#   ceil(T / S) <= MAX_LOCAL_CHECKPOINTS with S <= MAX_SEGMENT: S is raised to
#   ceil(T / MAX_LOCAL_CHECKPOINTS) where needed (the same adjoint: checkpoints only say where
#   segments start), and T > 272 (16 x 17) falls back to "device";
# * "sparse" (default): "device" with S raised to ceil(T / SPARSE_COPIES), so that the array
#   holds at most SPARSE_COPIES copies of the points (3 at T = 50: S = 17), where that S fits
#   MAX_SEGMENT; "recompute" beyond (T > 51), then "device".
# Measured on the H200 (2D b32 256^2 tess 16 / 3D 128^3 tess 10, forward kernel + backward
# kernel): recompute 0.35 + 1.33 / 0.69 + 2.44 ms, device S = 16 (4 copies) 0.46 + 1.06 /
# 0.83 + 2.11 ms before the forward's checkpoint test lost its integer division per step;
# memory at bench_cpab's sizes: recompute 56 / 77 MB, sparse ~106 / ~152 MB, device S = 4
# 274 / 409 MB, against 489 / 780 MB for the scaling-and-squaring baseline.
CHECKPOINTS = "sparse"
SPARSE_COPIES = 3
# How the backward's per-cell moments reach the global sums (cpab.cu, integrate_backward's
# MODE): "lane" (float64 atomics from every lane), "warp" (the lanes of a warp that flush one
# cell at the same step pool their sums first) or "queue" (lanes done with a cell append their
# sums to a per-warp queue in shared memory, which the warp drains 32 entries at a time, pooling
# the entries of one cell from any lanes and steps). benchmarks/profile_cpab.py times them: on
# the H200 (2D b32 256^2 tess 16 / 3D 128^3 tess 10, checkpoints from the forward) lane 1.65 /
# 3.76 ms, warp 1.49 / 2.78 ms, queue 1.35 / 2.49 ms. A fourth mode, pooled sums added to a
# per-block shared-memory cache of cells and flushed once per block, measured slower than
# "warp" (shared float64 atomics and a larger shared footprint) and was removed.
MOMENTS = "queue"
# The backward's moment queue numbers the cells of a call's whole batch in 32-bit integers
# (cpab.cu, MomentQueue::Key: a 32-bit match and store per entry; 2-5 % of the backward).
MAX_CELL_ROWS = 2 ** 31 - 1
MOMENT_MODES = {"lane": 0, "warp": 1, "queue": 2}
_CTYPE = {"float32": "float", "float64": "double"}
_GRID = ("int32",) * 3


# The kernels' signatures, memoized (a call looks up several); each takes dtypes or their
# names (a dtype's name costs ~2 us, so the hot path passes dtypes).
@functools.lru_cache(maxsize=None)
def _cell_sig(t, K):
    t = np.dtype(t).name
    return Signature(FAMILY, f"cutopo::cpab::cell_index<{_CTYPE[t]}, {K}>",
                     (f"ptr:{t}", "ptr:int64", "int64") + _GRID)


@functools.lru_cache(maxsize=None)
def _velocity_sig(t, K):
    t = np.dtype(t).name
    return Signature(FAMILY, f"cutopo::cpab::velocity<{_CTYPE[t]}, {K}>",
                     (f"ptr:{t}", f"ptr:{t}", f"ptr:{t}", "int64", "int64", "int64", "int32", "int32")
                     + _GRID)


@functools.lru_cache(maxsize=None)
def _forward_sig(t, K, project):
    t = np.dtype(t).name
    name = f"cutopo::cpab::integrate_forward<{_CTYPE[t]}, {K}, {'true' if project else 'false'}>"
    return Signature(FAMILY, name, (f"ptr:{t}", f"ptr:{t}", f"ptr:{t}", f"ptr:{t}", "ptr:float64",
                                    f"ptr:{t}", "int64", "int64", "int64", "float64")
                     + ("int32",) * 6 + _GRID)


@functools.lru_cache(maxsize=None)
def _backward_sig(t, K, project, moments="warp"):
    t = np.dtype(t).name
    name = (f"cutopo::cpab::integrate_backward<{_CTYPE[t]}, {K}, {'true' if project else 'false'}, "
            f"{MOMENT_MODES[moments]}>")
    # fit_shared: the segment's local arrays want L1 (launch._fit_shared_carveout)
    return Signature(FAMILY, name, (f"ptr:{t}", f"ptr:{t}", f"ptr:{t}", f"ptr:{t}", "ptr:float64",
                                    "ptr:float64", "int64", "int64", "int64")
                     + ("int32",) * 7 + _GRID, fit_shared=True)


@functools.lru_cache(maxsize=None)
def _prepare_sig(theta_t, t, K):
    theta_t, t = np.dtype(theta_t).name, np.dtype(t).name
    return Signature(FAMILY, f"cutopo::cpab::prepare_cells<{_CTYPE[theta_t]}, {_CTYPE[t]}, {K}>",
                     ("ptr:int32", "ptr:float64", "int32", f"ptr:{theta_t}", "int64", "int64",
                      "int64", "ptr:float64", f"ptr:{t}", "float64", f"ptr:{t}", "int64", "int64",
                      "ptr:uint64", HOST_WORD, CALL_INT64))


@functools.lru_cache(maxsize=None)
def _expm_sig(t, K):
    t = np.dtype(t).name
    return Signature(FAMILY, f"cutopo::cpab::expm_cells<{_CTYPE[t]}, {K}>",
                     ("ptr:float64", f"ptr:{t}", "int64", "float64"))


@functools.lru_cache(maxsize=None)
def _ell_sig(t):
    t = np.dtype(t).name
    return Signature(FAMILY, f"cutopo::cpab::ell_product<{_CTYPE[t]}>",
                     ("ptr:int32", "ptr:float64", f"ptr:{t}", "ptr:float64", "int64", "int64", "int64",
                      "int32"))


@functools.lru_cache(maxsize=None)
def _frechet_sig(K):
    return Signature(FAMILY, f"cutopo::cpab::frechet_cells<{K}>",
                     ("ptr:float64", "ptr:float64", "ptr:float64", "int64", "float64"))


def _instances():
    for t in _CTYPE:
        yield _ell_sig(t).name
    for K in (1, 2, 3):
        yield _frechet_sig(K).name
        for t in _CTYPE:
            yield _cell_sig(t, K).name
            yield _velocity_sig(t, K).name
            yield _expm_sig(t, K).name
            for theta_t in _CTYPE:
                yield _prepare_sig(theta_t, t, K).name
            for project in (False, True):
                yield _forward_sig(t, K, project).name
                for moments in MOMENT_MODES:
                    yield _backward_sig(t, K, project, moments).name


register_instances(FAMILY, _instances)


def _blocks(count, threads=THREADS):
    return -(-int(count) // threads)


def _grid(shape):
    return tuple(shape) + (1,) * (3 - len(shape))


# ---------------------------------------------------------------------------------------------
# The per-call set-up


@dataclasses.dataclass
class Plan:
    """What every kernel of one call needs (the device twin of integrate._Setup)."""

    shape: tuple            # cells per axis
    K: int
    C: int                  # cells per theta batch item
    B: int                  # output batch
    N: int
    n_points: int           # Bp: 1 (shared by the batch) or B
    n_theta: int            # Bt: 1 or B
    n_steps: int
    h: float
    dtype: np.dtype
    project: bool
    points: object          # (Bp, N, K) dtype, C-contiguous (not yet projected)
    A: object               # (Bt C, K, K+1) float64
    E: object               # (Bt C, K, K+1) dtype: top K rows of expm(h A~_c), as applied
    tess: object
    # the call's launches: a KeptLaunches of a repeated kind of call (integrate.py's memo,
    # whose key proved the arguments), or None: the checked launch() at every call
    launches: object = None


def _ell(csr, owner):
    """A scipy CSR matrix as device ELL tables: (indices (R, rows) int32, values (R, rows)
    float64, R), rows padded with zeros (pointing at column 0), entry-major (every row's j-th
    entry together: coalesced in the kernels, one thread per row); ready for kernels on any
    stream, and retired when ``owner`` (the tessellation that memoizes them) is collected."""
    csr = csr.tocsr()
    csr.sort_indices()
    counts = np.diff(csr.indptr)
    R = max(int(counts.max(initial=0)), 1)
    rows = np.repeat(np.arange(csr.shape[0]), counts)
    slot = np.arange(csr.nnz) - np.repeat(csr.indptr[:-1], counts)
    idx = np.zeros((R, csr.shape[0]), dtype=np.int32)
    val = np.zeros((R, csr.shape[0]))
    idx[slot, rows] = csr.indices
    val[slot, rows] = csr.data
    idx, val = tables.upload(idx), tables.upload(val)
    tables.retire_with(owner, idx, val)
    return idx, val, R


def _basis_tables(tess):
    """(B, B^T) as ELL tables on the current device, memoized on the tessellation: cupyx's
    sparse products cost ~0.15 ms of host work per call; these are one small kernel each."""
    import cupy

    key = ("ell", cupy.cuda.Device().id)
    if key not in tess._device_bases:
        tess._device_bases[key] = (_ell(tess.basis, tess), _ell(tess.basis.T, tess))
    return tess._device_bases[key]


def _dirichlet_table(tess):
    """The Dirichlet matrix Q (cutopo.cpab.smoothness) as an ELL table on the current device,
    memoized on the tessellation like the basis tables."""
    import cupy

    from .smoothness import dirichlet_matrix

    key = ("dirichlet ell", cupy.cuda.Device().id)
    if key not in tess._device_bases:
        tess._device_bases[key] = _ell(dirichlet_matrix(tess), tess)
    return tess._device_bases[key]


def _launcher(launches):
    """``launches`` (a KeptLaunches), or the module's checked :func:`launch` for None (looked
    up at each call: tests and probes replace it)."""
    return launch if launches is None else launches


def _ell_product(table, x, rows, launches=None):
    """(batch, rows) float64 = table @ x[b] for every row b of the C-contiguous x (batch, cols)."""
    idx, val, R = table
    batch, cols = x.shape
    y = device_empty((batch, rows), np.float64)
    _launcher(launches)(_ell_sig(x.dtype), _blocks(batch * rows), THREADS,
                        (idx, val, x, y, rows, cols, batch, R))
    return y


def affine_maps(tess, theta2):
    """A = B theta on the device: (Bt C, K, K+1) float64 from theta (Bt, d)."""
    import cupy

    if theta2.dtype not in (np.float32, np.float64):
        theta2 = theta2.astype(np.float64)
    basis, _ = _basis_tables(tess)
    A = _ell_product(basis, cupy.ascontiguousarray(theta2), tess.basis.shape[0])
    return A.reshape(len(theta2) * tess.n_cells, tess.ndim, tess.ndim + 1)


# Check blocks of prepare_cells: a grid-stride pass over the points (a few MB) needs no more.
CHECK_BLOCKS = 2048
PREPARE_THREADS = 128  # cpab::prepare_cells' block (expm's registers)


def _cell_status():
    """This thread's PinnedStatus on the current device (prepare_cells' flags and norm)."""
    return thread_status("cpab.prepare_cells")


class _CellFlags:
    """The values :func:`_raise_failed` reads, as one uint64 array: prepare_cells' flags and
    norm (a PinnedStatus), then the caller's own flags (a DeferredFlags copy, or none)."""

    def __init__(self, status, extra):
        self._status, self._extra, self._values = status, extra, None

    def read(self) -> np.ndarray:
        if self._values is None:
            flags, norm = self._status.read_status()
            extra = () if self._extra is None else self._extra.read().astype(np.uint64)
            self._values = np.array([flags, norm, *extra], dtype=np.uint64)
        return self._values


def _prepare(P, T2, tess, h, dtype, extra, launches=None):
    """One prepare_cells launch: (A (Bt C, K, K+1) float64, E in ``dtype``, flags). The flags
    (finiteness of the points P and theta T2, the guard's norm over A, then the caller's own
    (1,) float64 flags ``extra``) are read by :func:`_raise_failed`: the kernel's straight from
    page-locked memory, the caller's through one copy."""
    import cupy

    K, C = tess.ndim, tess.n_cells
    if T2.dtype not in (np.float32, np.float64):
        T2 = T2.astype(np.float64)       # integers are finite; float16's inf and NaN carry over
    theta = as_c_contiguous(T2)
    (idx, val, R), _ = _basis_tables(tess)
    cells = len(theta) * C
    A = device_empty((cells, K, K + 1), np.float64)
    E = device_empty((cells, K, K + 1), dtype)
    status = _cell_status()
    cell_blocks = _blocks(cells, PREPARE_THREADS)
    check_blocks = max(1, min(_blocks(max(P.size, theta.size), PREPARE_THREADS), CHECK_BLOCKS))
    _launcher(launches)(_prepare_sig(theta.dtype, dtype, K), cell_blocks + check_blocks,
                        PREPARE_THREADS, (idx, val, R, theta, theta.shape[1], len(theta), C, A, E,
                                          h, P, P.size, cell_blocks, status.counters, status,
                                          status.arm()))
    copied = DeferredFlags(cupy.concatenate(list(extra))) if extra else None
    return A, E, _CellFlags(status, copied)


def _raise_failed(values, *, n_steps, name, messages):
    """The ValueError of the first failed check among the values of _prepare's flags:
    (flags, largest norm as double bits, the caller's own flags)."""
    flags = int(values[0])
    raise_not_finite((not flags & 1, not flags & 2))
    for ok, message in zip(values[2:], messages):                   # the caller's own checks
        if not ok:
            raise ValueError(message)
    check_step_size(float(values[1:2].view(np.float64)[0]), n_steps, name)


@contextlib.contextmanager
def checked_plan(points, theta, tess, n_steps, name, dtype, *, extra=(), messages=(),
                 launches=None):
    """The plan of one integrate/log_jacobian/transform_image call from arguments checked by
    check_points_theta(defer_finite=True), for the launches of the ``with`` body.

    The finiteness of points and theta, the caller's device flags ``extra`` ((1,) float64, 1
    where its check passed, each with its error message in ``messages``) and the step-size
    guard are computed on the device and read on the host after the body, which has queued the
    call's kernels by then: the host waits for the checks, not before the work (the kernels
    are safe on non-finite input: cells and sample coordinates are clamped, every loop is
    bounded, expm's squarings are at most ~1100). A failed check raises its ValueError at the
    end of the ``with`` block, so the body's results must not escape it before.

    ``launches``: None (:func:`launch`: every argument checked at every launch), or the
    :class:`~cutopo._cuda.launch.KeptLaunches` of a memoized kind of call whose key proved
    points and theta (shapes, dtypes, C-contiguity, the current device) and fixes n_steps,
    the tessellation and ``dtype``: the plan's kernels then launch through it."""
    K, C = tess.ndim, tess.n_cells
    T2 = theta if theta.ndim == 2 else theta[None]
    if len(T2) * C > MAX_CELL_ROWS:
        raise ValueError(f"cpab.{name}: theta's batch of {len(T2)} items on {C} cells each is "
                         f"{len(T2) * C} cells, more than the CuPy kernels number "
                         f"({MAX_CELL_ROWS}); split the batch")
    P = as_c_contiguous((points if points.ndim == 3 else points[None]).astype(dtype, copy=False))
    Bp, Bt = len(P), len(T2)
    h = 1.0 / n_steps
    A, E, flags = _prepare(P, T2, tess, h, dtype, extra, launches)
    with reading(flags, functools.partial(_raise_failed, n_steps=n_steps, name=name,
                                          messages=messages)):
        yield Plan(shape=tess.shape, K=K, C=C, B=Bt if Bp == 1 else Bp, N=P.shape[1],
                   n_points=Bp, n_theta=Bt, n_steps=n_steps, h=h, dtype=dtype,
                   project=tess.zero_boundary in ("noslip", "slip"), points=P, A=A, E=E, tess=tess,
                   launches=launches)


def setup(points, theta, tess, n_steps, name, dtype, *, extra=(), messages=()) -> Plan:
    """:func:`checked_plan` with its checks read before it returns (tests and profiles: the
    ops themselves queue their kernels inside checked_plan)."""
    with checked_plan(points, theta, tess, n_steps, name, dtype, extra=extra,
                      messages=messages) as plan:
        pass
    return plan


def _shared(plan):
    return int(plan.n_points == 1), int(plan.n_theta == 1)


# ---------------------------------------------------------------------------------------------
# The ops


def integrate(plan: Plan, *, checkpoint_every=None, log_det=False):
    """Run the trajectories: ``(x_T (B, N, K), checkpoints or None, log_det (B, N) or None)``.

    ``checkpoint_every`` S keeps x_t for t = 0, S, 2S, ... (for :func:`backward`).
    """
    import cupy

    B, N, K, dt = plan.B, plan.N, plan.K, plan.dtype
    out = device_empty((B, N, K), dt)
    keep = checkpoint_every is not None
    S = checkpoint_every if keep else plan.n_steps
    # arrays the kernel does not touch are NULL: no allocation per call for them
    chk = device_empty((-(-plan.n_steps // S), B, N, K), dt) if keep else NULL
    trace = (cupy.ascontiguousarray(cupy.trace(plan.A[:, :, :K], axis1=1, axis2=2)) if log_det
             else NULL)
    ld = device_empty((B, N), dt) if log_det else NULL
    ps, ts = _shared(plan)
    _launcher(plan.launches)(_forward_sig(dt, K, plan.project), _blocks(B * N), THREADS,
                             (plan.points, plan.E, out, chk, trace, ld, B, N, plan.C, plan.h, ps,
                              ts, plan.n_steps, S, int(keep), int(log_det)) + _grid(plan.shape))
    return out, (chk if keep else None), (ld if log_det else None)


def local_segment(n_steps, S):
    """The segment length (S or more) with which a thread keeps a trajectory's checkpoints in
    its local memory, or None when n_steps is too long for them."""
    S = max(S, -(-n_steps // MAX_LOCAL_CHECKPOINTS))
    return S if S <= MAX_SEGMENT else None


def checkpoint_segment(n_steps, S):
    """(segment length, recompute) of a VJP asked for checkpoints every S steps, under
    CHECKPOINTS: the forward keeps x_t every `segment length` steps in a device array
    (recompute False), or the backward recomputes them in its threads' local memory (True)."""
    if CHECKPOINTS == "sparse":
        sparse = max(S, -(-n_steps // SPARSE_COPIES))
        if sparse <= MAX_SEGMENT:
            return sparse, False
    if CHECKPOINTS in ("sparse", "recompute"):
        own = local_segment(n_steps, S)
        if own is not None:
            return own, True
    return S, False


def backward(plan: Plan, checkpoints, S, cotangent, need_points, need_theta):
    """``(m_0 lambda_0 (B, N, K) float64 or None, dL/dtheta (Bt, d) float64 or None)``.
    ``checkpoints`` None: the kernel recomputes them (S from :func:`checkpoint_segment`)."""
    B, N, K = plan.B, plan.N, plan.K
    # in the points' dtype: the kernel reads it as float64 (exactly), so no float64 copy of
    # the (B, N, K) cotangent is made (8 bytes per trajectory and coordinate)
    cot = as_c_contiguous(cotangent.astype(plan.dtype, copy=False).reshape(B, N, K))
    launches = plan.launches
    if launches is not None:
        # the forward's kept launches, for a pullback on the forward's device alone (every
        # other array here is made on the current device)
        device = _current_device()
        if device != launches.device or (cot.size and cot.data.device_id != device):
            launches = None
    grad_points = device_empty((B, N, K), np.float64) if need_points else NULL
    size = K * (K + 1)
    G = device_zeros((plan.n_theta * plan.C, size), np.float64) if need_theta else NULL
    ps, ts = _shared(plan)
    recompute = checkpoints is None
    if recompute:
        if -(-plan.n_steps // S) > MAX_LOCAL_CHECKPOINTS or S > MAX_SEGMENT:
            raise ValueError(f"backward: {plan.n_steps} steps in segments of {S} do not fit the "
                             "threads' local checkpoints (see local_segment)")
        checkpoints = NULL
    _launcher(launches)(_backward_sig(plan.dtype, K, plan.project, MOMENTS), _blocks(B * N),
                        THREADS, (plan.points, plan.E, checkpoints, cot, grad_points, G, B, N,
                                  plan.C, ps, ts, plan.n_steps, S, int(need_points),
                                  int(need_theta), int(recompute)) + _grid(plan.shape))
    grad_theta = theta_cotangent(plan, G, launches) if need_theta else None
    return (grad_points if need_points else None), grad_theta


def theta_cotangent(plan: Plan, G, launches=None):
    """dL/dtheta (Bt, d) float64 from the per-cell moments G (Bt C, K (K+1)): dL/dA_c by the
    adjoint Frechet derivative of expm, then B^T. G is overwritten by dL/dA (frechet_cells in
    place: one per-cell float64 array fewer at the VJP's peak)."""
    cells = len(G)
    _launcher(launches)(_frechet_sig(plan.K), _blocks(cells, 64), 64,
                        (plan.A, G, G, cells, plan.h))
    _, basis_t = _basis_tables(plan.tess)
    # the row length spelled out: an empty batch (n_theta = 0) leaves no -1 to infer
    rows = G.reshape(plan.n_theta, plan.C * plan.K * (plan.K + 1))
    return _ell_product(basis_t, rows, plan.tess.n_params, launches)


def velocity(points, theta, tess, dtype):
    """v (B, N, K) in ``dtype`` from checked CuPy points (Bp, N, K) or (N, K) and theta."""
    import cupy

    K = tess.ndim
    P = points if points.ndim == 3 else points[None]
    T2 = theta if theta.ndim == 2 else theta[None]
    Bp, Bt = len(P), len(T2)
    A = cupy.ascontiguousarray(affine_maps(tess, T2).astype(dtype, copy=False))
    B, N = (Bt if Bp == 1 else Bp), P.shape[1]
    out = cupy.empty((B, N, K), dtype=dtype)
    P = cupy.ascontiguousarray(P.astype(dtype, copy=False))
    launch(_velocity_sig(dtype.name, K), _blocks(B * N), THREADS,
           (P, A, out, B, N, tess.n_cells, int(Bp == 1), int(Bt == 1)) + _grid(tess.shape))
    return out


def cell_index(points, shape):
    """Cells (int64, shape points.shape[:-1]) of finite float CuPy points (..., K)."""
    import cupy

    K = len(shape)
    flat = cupy.ascontiguousarray(points.reshape(-1, K))
    cells = cupy.empty(len(flat), dtype=np.int64)
    launch(_cell_sig(flat.dtype.name, K), _blocks(len(flat)), THREADS,
           (flat, cells, len(flat)) + _grid(shape))
    return cells.reshape(points.shape[:-1])
