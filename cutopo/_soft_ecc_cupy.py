"""CuPy path of the soft ECC: one sweep of the image per forward and per backward.

The kernels (``cuda_src/ecc_soft.cuh``) compute each pixel's contribution c(p) in ecc.cu's
tile sweep and evaluate the band-limited sigmoid sums of the critical pixels in the same pass;
the forward's last block per image writes the curve, the backward's last block the thresholds'
and the scale's cotangents, each in the dtype that cutopo.vjp hands back (no cast after). Both
leave their workspace zeroed again, so each plan keeps one per thread and stream. A forward
is one launch (its block 0 checks device thresholds and writes the flags into page-locked host
memory, read before the call returns), a backward one. Everything that depends only on the
geometry is planned once per (device, input dtype, batch, shape, construction, T, computation
dtype) and memoized (:class:`SoftEccPlan`).

The 2D forward sweeps with the packed (two pixels per word) sweep on 15-bit keys of the values,
recomputing exactly the contribution of every pixel tied with a neighbour in 15 bits
(band::packed_soft_forward, :func:`packed_forward`).

A forward made for a backward also keeps its entries (the critical pixels with a non-empty
band: index and contribution, 8 bytes each) in a buffer of one slot per KEPT_PIXELS_PER_SLOT
pixels (at most KEPT_MAX_BYTES per call); the backward of an image whose entries fit reads
them instead of sweeping the image again, and sweeps the others. Such a forward also makes the
backward's outputs, which its :class:`Residual` holds (d_image up to BACKWARD_D_IMAGE_MAX_BYTES);
the listed 3D forward zeroes that d_image in its first launch, and the backward writes the
listed voxels alone. Every forward launches on the arrays that the previous call of its kind
made for it (cutopo._cuda.workspace.made_ahead): a plain forward makes them once its launches
are queued, a forward with a backward once that backward's launches are.
"""
from __future__ import annotations

import functools
import math
import threading

import numpy as np

from . import _ecc_cupy
from ._band_cupy import _shared_plan, _thresholds_on_device, raise_failed_thresholds
from ._checks import check_thresholds
from ._cuda.compile import register_instances
from ._cuda.deferred import PinnedWord
from ._cuda.launch import (HOST_WORD, NULL, PreparedLaunch, Signature, _c_contiguous, _current_device,
                           device_empty)
from ._cuda.launch import on_device_of as _on_device_of
from ._cuda.workspace import ZeroedWorkspaces, made_ahead

FAMILY = "ecc"
THREADS = 256                  # band::THREADS
WARPS = THREADS // 32
PLANE = 34 * 34                # ecc::PLANE: a 32 x 32 tile with its halo
ROW_SLOTS = 32 * 4             # band::ROW_SLOTS
# Static shared memory of the sweep kernels besides the tile: RowQueues (1 + 1 + 8 bytes per
# slot) and a few words, and in the 3D forward the block's ring of entries (band::BlockQueue,
# band::block_queue_cap entries of 8 bytes); the dynamic part (thresholds, accumulators) gets
# what is left of the 48 KiB a block may take without opting in (_band_cupy.SHARED_MAX), else
# the accumulators go to global memory.
QUEUE_BYTES = WARPS * ROW_SLOTS * 10 + 128
BLOCK_QUEUE_CAP = {4: 1024, 8: 256}  # band::block_queue_cap by key bytes
# The float32 kernels over kept entries' transposed rows (band::transposed_warp_words, per warp).
TRANSPOSED_BAND = 15           # band::TRANSPOSED_BAND
TRANSPOSED_BYTES = WARPS * 32 * TRANSPOSED_BAND * 4
# The packed forward's (band::PackedQueues, its one-word-per-pixel-pair tile of packed::PLANEW
# words per plane, the block's band parameters and a register window per thread).
PACKED_SLOTS = 2 * 32 * 4      # band::PACKED_SLOTS
PACKED_PLANE_WORDS = 36 * 34   # packed::PLANEW
PACKED_QUEUE_BYTES = WARPS * PACKED_SLOTS * 2 + THREADS * 32 + 256
# Workspaces up to this size are kept per plan, thread and stream (the kernels leave them
# zeroed); larger ones are made zeroed at every call.
KEEP_WORKSPACE_BYTES = 1 << 20
# The forward's kept entries (band::KeptEntries): slots per image = its pixels / this (smooth
# images have 2-5 % critical pixels, white noise about half: its backward sweeps), and at most
# this many bytes per call (a larger batch or image keeps fewer slots per image: 1024^3 one per
# 16 voxels, enough for a smooth volume's list; 2048^3 one per 128, and its forward is fused).
# The buffer is made without a fill: its size costs memory, not time. At 64 MiB a smooth
# 1024^3 volume's list overflowed: its forward was fused, its backward swept the volume again
# (benchmarks/RESULTS.md, forty-first session).
KEPT_PIXELS_PER_SLOT = 8
KEPT_MAX_BYTES = 512 << 20
# Copies of the backward's global d_t and d_scale (band::BACKWARD_COPIES).
BACKWARD_COPIES = 16
# The 3D forward as three launches (listed_forward) on calls of at least this many voxels
# (None: never): the sweep lists the critical voxels, a second kernel runs their band work
# over the whole grid, the fused forward sweeps the images whose list overflowed. Against the
# fused forward on an H100 (benchmarks/RESULTS.md, fortieth session): 8 % less time on smooth
# 256^3 volumes, 12 % less at 512^3, 2 % more at 192^3, the same on 4 x 96^3, 17-26 % more at
# 128^3 and 64^3 (three launches where the fused forward is one, on little work); white noise
# (its list overflows: swept twice, the first sweep stopped early) 10 % more at 256^3.
LISTED_FORWARD_MIN_VOXELS = 1 << 23
# ... and with a slot for every this many voxels of each image at least: the list of a smooth
# volume (bench_soft's 256^3, Gaussian sigma 2: 1.9 % of the voxels critical; 1024^3: 1.8 %)
# then fits where KEPT_MAX_BYTES leaves fewer slots than KEPT_PIXELS_PER_SLOT asks (1024^3:
# one per 16 voxels; 2048^3: one per 128, where such a list would overflow after a good part
# of the sweep, which then runs again).
LISTED_FORWARD_VOXELS_PER_SLOT = 32

# The kernels over kept entries (the listed forward's band work, the listed backward) run on
# a grid of their own: per image, LISTED_WAVES waves of their resident blocks over the call,
# but at least a block per LISTED_PIXELS_PER_BLOCK pixels (a large image's many entries) and
# LISTED_MIN_BLOCKS_PER_IMAGE blocks, and at most the sweep's blocks (None: the sweep's). Each
# warp takes up to 32 entries a round, and every block ends by adding its T accumulators to its
# image's row in global memory (atomics on the same T addresses). On an H100 (forty-first
# session, benchmarks/RESULTS.md; one wave against the sweep's blocks): 256^3 2048 -> 792 and
# 660 blocks, the two kernels 139 -> 118 us; 4 x 128^3 83 -> 72 us; the 2D 1024^2 backward's
# 27.7 -> 24.8 us. Fewer blocks lost where entries are many per block (512^3, +2.4 % at one
# wave: the pixel floor keeps its 4096) or the batch's rows spread the atomics already (64 x
# 256^2, +26 % at 13 blocks an image: the floor of 64 keeps its 25). With the transposed band
# work (ecc_band.cuh) one wave stayed best (0.5 and 2 waves, H200, the same session).
LISTED_WAVES: float | None = 1.0
LISTED_PIXELS_PER_BLOCK = 1 << 15
LISTED_MIN_BLOCKS_PER_IMAGE = 64

# The forward of cutopo.vjp makes the backward's outputs, which the residual holds until the
# backward, d_image for calls whose d_image takes at most this many bytes (as large as the
# image: up to 512 MiB, a 512^3 float32 volume): the host time of the pullback, which in 2D
# is the call's critical path, then makes no array, and the listed forward zeroes d_image
# while it sweeps (band::soft_ecc_list_forward), so that its backward skips a launch's worth
# of zeroing at the copy bandwidth (bench_soft's 256^3 float32 volume on an H100: the five
# launches 306 -> 293 us, benchmarks/RESULTS.md, forty-second session).
BACKWARD_D_IMAGE_MAX_BYTES = 512 << 20

_REAL = {np.dtype(np.float32): "float", np.dtype(np.float64): "double"}


class Residual:
    """What a forward made for a backward keeps (soft_ecc_forward with ``keep``): the kept
    entries (``kept``: band::KeptEntries, None when the plan keeps none) and the backward's
    outputs made by the forward (SoftEccPlan.launch_forward: d_image, already zeroed by the
    listed forward; d_t and d_scale in the computation dtype), for the first backward
    (:meth:`take_outputs`; the pullback may run again and must not write into the arrays an
    earlier call returned), and the making of the next call's arrays (:meth:`make_next`)."""

    __slots__ = ("kept", "_outputs", "_next")

    def __init__(self, kept, d_image=None, d_t=None, d_scale=None, zeroed=False, make_next=None):
        self.kept = kept
        self._outputs = [] if d_t is None else [(d_image, d_t, d_scale, bool(zeroed))]
        self._next = [] if make_next is None else [make_next]

    def make_next(self) -> None:
        """Make the next call's arrays (made_ahead.make_next), once: called by the first
        backward after its launches, while the GPU runs them. Not at the forward: in 2D the
        forward's kernel ends before the host, were it making them there, could launch the
        backward (the forty-eighth session's H100 host: ~15 us of allocations between the two,
        the GPU idle; benchmarks/RESULTS.md)."""
        try:
            make = self._next.pop()
        except IndexError:
            return
        make()

    def take_outputs(self):
        """(d_image or None, d_t, d_scale, whether d_image is zeroed), once (None after, or
        when the forward made none)."""
        try:
            return self._outputs.pop()  # one pop wins when threads race
        except IndexError:
            return None


def _cbool(x) -> str:
    return "true" if x else "false"


def _key_ctype(in_ctype: str) -> str:
    return _ecc_cupy._VALUE_KEY.get(in_ctype, "unsigned int")


def _sweep_sig(kind, in_dtype, real, ndim, tconn, periodic, listed=False) -> Signature:
    """A sweep kernel's signature: ``kind`` "forward" (the fused forward), "list" (the listed
    forward's first launch) or "backward" (``listed``: the instance over kept entries)."""
    in_ctype = _ecc_cupy._INPUT_CTYPE[np.dtype(in_dtype)]
    view = _ecc_cupy._INPUT_VIEW.get(np.dtype(in_dtype), np.dtype(in_dtype)).name
    r = np.dtype(real).name
    kernel = {"forward": "soft_ecc_fused_forward", "list": "soft_ecc_list_forward",
              "backward": "soft_ecc_fused_backward"}[kind]
    listed_arg = f", {_cbool(listed)}" if kind == "backward" else ""
    name = (f"cutopo::ecc::band::{kernel}<{in_ctype}, {_key_ctype(in_ctype)}, "
            f"{_REAL[np.dtype(real)]}, {ndim}, {_cbool(tconn)}, {_cbool(periodic)}{listed_arg}>")
    geometry = ("int64", "int64", "int64", "int32", "int32", "int32", r, "float64", "int32")
    kept = ("ptr:uint64", "int64")  # band::KeptEntries and its slots per image
    if kind == "forward":  # image, thresholds, workspace, out, check word, its token, kept,
        # geometry, the listed forward's list (its third launch)
        params = ((f"ptr:{view}", f"ptr:{r}", "ptr:uint64", f"ptr:{r}", HOST_WORD, "int64") + kept
                  + geometry + ("ptr:uint64",))
    elif kind == "list":  # image, thresholds, workspace, check word, its token, kept, geometry,
        # the d_image to zero
        params = ((f"ptr:{view}", f"ptr:{r}", "ptr:uint64", HOST_WORD, "int64") + kept + geometry[:6]
                  + (f"ptr:{r}",))
    else:  # image, thresholds, g, d_image, workspace, d_t (real, double), d_scale (real, double),
        # kept, geometry, whether the forward zeroed d_image
        params = (f"ptr:{view}", f"ptr:{r}", f"ptr:{r}", f"ptr:{r}", "ptr:float64", f"ptr:{r}",
                  "ptr:float64", f"ptr:{r}", "ptr:float64") + kept + geometry + ("int32",)
    return Signature(FAMILY, name, params)


def _listed_forward_sig(in_dtype, real) -> Signature:
    """The listed forward's band kernel (image, thresholds, workspace, out, kept, its slots per
    image, blocks per image, T, lambda, w, shared)."""
    in_ctype = _ecc_cupy._INPUT_CTYPE[np.dtype(in_dtype)]
    view = _ecc_cupy._INPUT_VIEW.get(np.dtype(in_dtype), np.dtype(in_dtype)).name
    r = np.dtype(real).name
    name = f"cutopo::ecc::band::soft_ecc_listed_forward<{in_ctype}, {_REAL[np.dtype(real)]}>"
    return Signature(FAMILY, name, (f"ptr:{view}", f"ptr:{r}", "ptr:uint64", f"ptr:{r}", "ptr:uint64",
                                    "int64", "int32", "int32", r, "float64", "int32"))


def listed_forward(in_dtype, ndim, periodic, nimg, voxels) -> bool:
    """Whether the forward of ``nimg`` images of ``voxels`` voxels is the listed one
    (band::soft_ecc_list_forward, then the listed entries' band work, then the fused forward
    for the images whose list overflowed): the 3D scalar sweeps of at least
    LISTED_FORWARD_MIN_VOXELS in all, with a kept slot per LISTED_FORWARD_VOXELS_PER_SLOT."""
    return (LISTED_FORWARD_MIN_VOXELS is not None and nimg * voxels >= LISTED_FORWARD_MIN_VOXELS
            and ndim == 3 and not packed_forward(in_dtype, ndim, periodic)
            and kept_capacity(nimg, voxels) * LISTED_FORWARD_VOXELS_PER_SLOT >= voxels)


def _instances():
    """What the offline compile check builds: every input and computation dtype in one
    configuration (2D, V construction, box), every configuration (rank, construction,
    boundary) for float32, and the 64-bit-key 3D instances, each as the forward and the two
    backward instances (sweep, kept entries). All 312 instances would take minutes; they
    differ only in the types and flags that these cover."""
    f32, f64 = np.dtype(np.float32), np.dtype(np.float64)
    kinds = (("forward", False), ("backward", False), ("backward", True))
    for in_dtype in _ecc_cupy._INPUT_CTYPE:
        if in_dtype == np.bool_:
            continue  # read as uint8: the same instances
        for real in _REAL:
            if in_dtype == np.float64 and real == f32:
                continue  # float64 images always compute in float64
            for kind, listed in kinds:
                yield _sweep_sig(kind, in_dtype, real, 2, False, False, listed).name
    for ndim in (2, 3):
        for tconn in (False, True):
            for periodic in (False, True):
                if (ndim, tconn, periodic) != (2, False, False):
                    for kind, listed in kinds:
                        yield _sweep_sig(kind, f32, f32, ndim, tconn, periodic, listed).name
    for in_dtype in (np.dtype(np.int32), f64):
        for kind, listed in kinds:
            yield _sweep_sig(kind, in_dtype, f64, 3, True, True, listed).name
    # the listed forward's (3D): the list sweep and the band kernel
    yield _sweep_sig("list", f32, f32, 3, False, False).name
    yield _sweep_sig("list", f64, f64, 3, True, True).name
    for in_dtype, real in ((f32, f32), (f32, f64), (f64, f64)):
        yield _listed_forward_sig(in_dtype, real).name


register_instances(FAMILY, _instances)


def forward_workspace_words(rows: int, T: int) -> int:
    """Words of band::ForwardWorkspace: the per-image counters, acc and sat."""
    return (rows + 1) // 2 + rows + 2 * rows * T


def backward_workspace_words(T: int) -> int:
    """Doubles of a backward workspace (band::backward_workspace_words): BACKWARD_COPIES copies
    of d_t and d_scale, the blocks' counter."""
    return BACKWARD_COPIES * (T + 1) + 1


def kept_capacity(nimg: int, pixels: int) -> int:
    """Slots per image of a forward's kept entries (0: none kept)."""
    per_image = -(-pixels // KEPT_PIXELS_PER_SLOT)
    fit = (KEPT_MAX_BYTES // 8 - nimg) // nimg  # the counts, then the slots
    return max(0, min(per_image, fit))


def packed_forward(in_dtype, ndim, periodic) -> bool:
    """Whether the forward takes the packed sweep (band::packed_soft_forward): 2D floating-point
    and one-byte inputs in the box."""
    return (ndim == 2 and not periodic
            and (np.dtype(in_dtype).kind == "f" or np.dtype(in_dtype).itemsize == 1))


def listed_blocks_per_image(sig, nimg, pixels, per_image, shared_mem) -> int:
    """Blocks per image of a kernel over kept entries (LISTED_WAVES), at most the sweep's
    ``per_image``, for ``nimg`` images of ``pixels`` pixels."""
    if LISTED_WAVES is None:
        return per_image
    waves = math.ceil(LISTED_WAVES * _ecc_cupy.resident_blocks(sig, THREADS, shared_mem) / nimg)
    floor = max(LISTED_MIN_BLOCKS_PER_IMAGE, -(-pixels // LISTED_PIXELS_PER_BLOCK))
    return max(1, min(per_image, max(waves, floor)))


def _dynamic_shared(T, real, with_g, with_sat, ndim, key_bytes, packed=False, listed=False):
    """(accumulators in shared memory, dynamic shared bytes) for one sweep kernel; ``listed``:
    the listed backward (its one plane and, in float32, its transposed rows)."""
    planes = 3 if ndim == 3 else 1
    if listed:
        static = PLANE * key_bytes + QUEUE_BYTES
        if np.dtype(real) == np.float32:
            static += TRANSPOSED_BYTES
    elif packed:
        static = planes * PACKED_PLANE_WORDS * 4 + PACKED_QUEUE_BYTES
    else:
        static = planes * PLANE * key_bytes + QUEUE_BYTES
        if with_sat and ndim == 3:  # the forward's ring
            static += BLOCK_QUEUE_CAP[key_bytes] * 8 + 8
    return _shared_plan(T, real, with_g, with_sat, static)


class SoftEccPlan:
    """The launches of the soft ECC for one geometry (memoized by :func:`soft_ecc_plan`): a
    repeated call (a training loop) then allocates its outputs and launches, nothing more."""

    def __init__(self, in_dtype, nimg, spatial, tconn, periodic, T, real):
        ndim = len(spatial)
        real = np.dtype(real)
        key_bytes = 8 if _key_ctype(_ecc_cupy._INPUT_CTYPE[np.dtype(in_dtype)]).endswith("long") else 4
        self.nimg, self.ndim, self.T, self.real = nimg, ndim, T, real
        self._pixels = math.prod(spatial)
        self.words = forward_workspace_words(nimg, T)
        self.kept_cap = kept_capacity(nimg, self._pixels)

        fsig = _sweep_sig("forward", in_dtype, real, ndim, tconn, periodic)
        packed = packed_forward(in_dtype, ndim, periodic)
        shared, smem = _dynamic_shared(T, real, False, True, ndim, key_bytes, packed)
        tile_x = _ecc_cupy.TILE_X["unsigned short" if packed else "unsigned int"]
        (nz, ny, nx), zchunk, per_image = _ecc_cupy.sweep_geometry(fsig, nimg, spatial, ndim, smem, tile_x)
        # (image, thresholds, workspace, out, word, token, kept, cap, ..., lam, w, shared,
        # listed): arrays, the check word and its token, the kept entries and the scale per call
        geometry = (nz, ny, nx, zchunk, per_image, T)
        args = (None,) * 7 + (self.kept_cap,) + geometry + (None, None, int(shared))
        self._forward = PreparedLaunch(fsig, nimg * per_image, THREADS, args + (NULL,), shared_mem=smem)
        self._list = self._listed = self._overflowed = None
        if self.kept_cap > 0 and listed_forward(in_dtype, ndim, periodic, nimg, self._pixels):
            # (image, thresholds, workspace, word, token, kept, d_image to zero or NULL): no
            # dynamic shared memory
            lsig = _sweep_sig("list", in_dtype, real, ndim, tconn, periodic)
            self._list = PreparedLaunch(lsig, nimg * per_image, THREADS,
                                        (None,) * 6 + (self.kept_cap,) + geometry + (None,))
            # (image, thresholds, workspace, out, kept, lam, w); its static shared memory (the
            # float32 transposed rows, TRANSPOSED_BYTES) is below the fused forward's 3D static
            # part, which sized ``smem``
            listed_sig = _listed_forward_sig(in_dtype, real)
            lper = listed_blocks_per_image(listed_sig, nimg, self._pixels, per_image, smem)
            self._listed = PreparedLaunch(listed_sig, nimg * lper, THREADS,
                                          (None,) * 5 + (self.kept_cap, lper, T, None, None, int(shared)),
                                          shared_mem=smem)
            # (image, thresholds, workspace, out, lam, w, list): no kept entries, no check
            self._overflowed = PreparedLaunch(fsig, nimg * per_image, THREADS,
                                              args[:4] + (NULL, 0, NULL) + args[7:] + (None,),
                                              shared_mem=smem)
        self.zeroes_d_image = self._list is not None  # (the d_image that a forward makes)

        self._bsig = _sweep_sig("backward", in_dtype, real, ndim, tconn, periodic)
        self._lsig = _sweep_sig("backward", in_dtype, real, ndim, tconn, periodic, listed=True)
        bshared, self._bsmem = _dynamic_shared(T, real, True, False, ndim, key_bytes)
        _, bzchunk, bper_image = _ecc_cupy.sweep_geometry(self._bsig, nimg, spatial, ndim, self._bsmem,
                                                          _ecc_cupy.TILE_X["unsigned int"])
        self._bgeometry = (nz, ny, nx, bzchunk, bper_image, T, None, None, int(bshared))
        self._bgrid = nimg * bper_image
        self._lshared = _dynamic_shared(T, real, True, False, ndim, key_bytes, listed=True)
        self._backward = {}
        self._workspaces = ZeroedWorkspaces(KEEP_WORKSPACE_BYTES)

    def workspace(self, kind: str, words: int, dtype, stream: int | None = None):
        """A zeroed workspace of ``words`` elements for ``kind`` ("forward", "backward"), kept
        per thread and stream up to KEEP_WORKSPACE_BYTES (the kernels leave it zeroed);
        ``stream``: the current stream's pointer, if the caller has read it."""
        return self._workspaces.get(kind, words, dtype, stream)

    def _arrays(self, shape, keep: bool):
        """The arrays of a forward of images of ``shape``: (kept entries or None, the curve,
        and with ``keep`` and kept entries the backward's d_image (up to
        BACKWARD_D_IMAGE_MAX_BYTES, else None), d_t and d_scale in the computation dtype, else
        None, None, None)."""
        kept = None
        if self._list is not None or (keep and self.kept_cap > 0):  # the listed forward's list
            kept = device_empty(self.nimg * (1 + self.kept_cap), dtype=np.uint64)  # no fill: the
            # kernel writes every word it reads back
        out = device_empty(shape[:len(shape) - self.ndim] + (self.T,), dtype=self.real)
        if not keep or kept is None:
            return kept, out, None, None, None
        d_image = None
        if self.nimg * self._pixels * self.real.itemsize <= BACKWARD_D_IMAGE_MAX_BYTES:
            d_image = device_empty(shape, dtype=self.real)
        return (kept, out, d_image, device_empty(self.T, dtype=self.real),
                device_empty((), dtype=self.real))

    def _forward_arrays(self, shape, keep: bool, stream: int | None = None):
        """(this plan's forward workspace on the current stream (``stream``: its pointer, if
        read), then :meth:`_arrays`): what a forward takes from made_ahead. The workspace
        travels with the arrays made ahead, which are made and taken on one stream, so that a
        repeated call skips its lookup before its first launch."""
        ws = self._workspaces.get("forward", self.words, np.uint64, stream)
        return (ws,) + self._arrays(shape, keep)

    def launch_forward(self, x, t, shape, lam, w, check: bool, keep: bool = False):
        """Launch the forward of images of ``shape`` (batch and spatial axes) and return (the
        curve (*batch, T) in the computation dtype, a :class:`Residual` for :meth:`backward`
        with ``keep``, else None; None too when the plan keeps nothing; with ``check``, the
        PinnedWord whose flags the caller reads before it returns, else None). With ``check``,
        block 0 checks the thresholds (raise_failed_thresholds(word.read()) raises where one
        failed). The listed forward (listed_forward) is three launches: the list sweep, the
        band work of the lists that fit, the fused forward of the images whose list
        overflowed; its list holds every critical pixel (band or not) and is the kept entries,
        and with ``keep`` its sweep zeroes the backward's d_image (zeroes_d_image).

        The arrays (the workspace, the curve, the kept entries, with ``keep`` the backward's
        outputs, which the Residual holds) are those that the previous call of the same kind
        made for this one (made_ahead), else made here. The next call's are made once this
        call's launches are queued (the host waits for block 0's check word next), or, for a
        forward with a Residual, by its first backward once that one's are (Residual.make_next).

        ``x`` (the plan's input dtype, or already as the kernels view it: bool as uint8, float16
        as uint16), ``t`` and ``lam`` (the plan's computation dtype) come from
        soft_ecc_forward or a planned device call (cutopo._soft_ecc._forward, whose
        thresholds block 0 checks), contiguous and on the current device; the workspace is
        this plan's. So after the first call, whose launch checks every argument, the launch
        skips the checks (PreparedLaunch.call_checked_once)."""
        import cupy

        x = _ecc_cupy._image_view(x)  # (idempotent: a viewed image keeps its view)
        stream = cupy.cuda.get_current_stream()  # read once for all of the call (~0.3 us a read)
        ptr = stream.ptr
        word = check_word() if check else NULL
        token = word.arm(stream) if check else 0
        kind = (shape, bool(keep))
        arrays = made_ahead.take(self, kind, ptr)
        if arrays is None:
            arrays = self._forward_arrays(shape, keep, ptr)
        ws, kept, out, d_image, d_t, d_scale = arrays
        zeroed = self.zeroes_d_image and d_image is not None
        if self._list is not None:  # the listed forward: its list is the kept entries
            self._list.call_checked_once(x, t, ws, word, token, kept, d_image if zeroed else NULL,
                                         stream=ptr)
            self._listed.call_checked_once(x, t, ws, out, kept, lam, w, stream=ptr)
            self._overflowed.call_checked_once(x, t, ws, out, lam, w, kept, stream=ptr)
        else:
            self._forward.call_checked_once(x, t, ws, out, word, token,
                                            NULL if kept is None else kept, lam, w, stream=ptr)
        def make_next():
            made_ahead.make_next(self, kind, lambda: self._forward_arrays(shape, keep))

        residual = None
        if keep and kept is not None:
            residual = Residual(kept, d_image, d_t, d_scale, zeroed, make_next)
        else:
            make_next()
        return out, residual, (word if check else None)

    def forward(self, x, t, shape, lam, w, check: bool, keep: bool = False):
        """:meth:`launch_forward`, its check word read: (the curve, the Residual or None)."""
        out, residual, word = self.launch_forward(x, t, shape, lam, w, check, keep)
        if check:
            raise_failed_thresholds(word.read())
        return out, residual

    def backward_launch(self, need_image, t_dtype, s_dtype, listed=False, zeroed=False) -> PreparedLaunch:
        """The backward launch writing d_image (if ``need_image``), d_t in ``t_dtype`` and d_scale
        in ``s_dtype`` (each the computation dtype, float64, or None: not wanted); ``listed``:
        the instance over kept entries; ``zeroed``: d_image comes zeroed (the sweep instance
        leaves the listed images' alone). Called with (image, thresholds, g, [d_image], ws,
        [d_t], [d_scale], kept or NULL, lam, w)."""
        zeroed = bool(zeroed and need_image and not listed)
        key = (need_image, t_dtype, s_dtype, listed, zeroed)
        launch_ = self._backward.get(key)
        if launch_ is None:
            def outputs(dtype):  # (real slot, double slot): None = passed at call time
                if dtype is None:
                    return (NULL, NULL)
                return (None, NULL) if dtype == self.real else (NULL, None)
            geometry, grid, smem = self._bgeometry, self._bgrid, self._bsmem
            if listed:  # its own blocks per image (LISTED_WAVES) and shared memory
                shared, smem = self._lshared
                per_image = listed_blocks_per_image(self._lsig, self.nimg, self._pixels, geometry[4], smem)
                geometry = geometry[:4] + (per_image,) + geometry[5:8] + (int(shared),)
                grid = self.nimg * per_image
            args = ((None, None, None, None if need_image else NULL, None) + outputs(t_dtype)
                    + outputs(s_dtype) + (None, self.kept_cap) + geometry + (int(zeroed),))
            launch_ = PreparedLaunch(self._lsig if listed else self._bsig, grid, THREADS, args,
                                     shared_mem=smem)
            self._backward[key] = launch_
        return launch_

    def backward(self, need_image, t_dtype, s_dtype, arrays, lam, w, zeroed=False, stream=None) -> None:
        """Launch the backward (see backward_launch) on ``arrays``, which soft_ecc_backward
        makes as forward's are made: checked at the launch's first call only. With kept
        entries (the last array), the sweep of the images whose list overflowed, then the
        listed images' entries and the final write (band::soft_ecc_fused_backward).
        ``zeroed``: d_image was zeroed by the forward; ``stream``: the current stream's pointer,
        if the caller has read it."""
        self.backward_launch(need_image, t_dtype, s_dtype, zeroed=zeroed).call_checked_once(
            *arrays, lam, w, stream=stream)
        if arrays[-1] is not NULL:
            self.backward_launch(need_image, t_dtype, s_dtype, True).call_checked_once(
                *arrays, lam, w, stream=stream)


_WORDS = threading.local()


def check_word() -> PinnedWord:
    """This thread's page-locked word for the thresholds' check flags (one per thread serves
    every plan: a forward arms, launches and reads it before it returns)."""
    word = getattr(_WORDS, "word", None)
    if word is None:
        word = _WORDS.word = PinnedWord()
    return word


@functools.lru_cache(maxsize=64)
def soft_ecc_plan(device_id, in_dtype, nimg, spatial, tconn, periodic, T, real) -> SoftEccPlan:
    return SoftEccPlan(in_dtype, nimg, spatial, tconn, periodic, T, real)


def device_plan(image, ndim, tconn, periodic, T, real):
    """The plan of a CuPy image on the current device (None for an empty batch)."""
    nimg = math.prod(image.shape[:image.ndim - ndim])
    if nimg == 0:
        return None
    return soft_ecc_plan(_current_device(), image.dtype, nimg,
                         tuple(image.shape[image.ndim - ndim:]), bool(tconn), bool(periodic), T,
                         np.dtype(real))


def _plan_and_view(image, ndim, tconn, periodic, T, real, plan=None):
    """(the plan, or None for an empty batch; the image as the kernels read it). ``plan``: the
    image's plan, already looked up (cutopo._soft_ecc._first_device_call)."""
    import cupy

    if plan is None:
        plan = device_plan(image, ndim, tconn, periodic, T, real)
        if plan is None:
            return None, image
    if not _c_contiguous(image):
        image = cupy.ascontiguousarray(image)
    return plan, _ecc_cupy._image_view(image)


def soft_ecc_forward(image, t, lam, w, ndim, tconn, periodic=False, check=False, plan=None,
                     keep=False):
    """((*batch, T) curve in the dtype of ``t``, the :class:`Residual` for soft_ecc_backward
    or None). ``t``: host thresholds (checked) or device ones (C-contiguous, on the image's
    device; checked on the device with ``check``); ``lam`` the scale in that dtype, ``w`` the
    band half-width; ``plan`` the image's, if looked up; ``keep``: keep the entries (and, from
    the listed forward, a zeroed d_image)."""
    real, T = t.dtype, t.size
    with _on_device_of(image):
        plan, x = _plan_and_view(image, ndim, tconn, periodic, T, real, plan)
        if plan is not None:
            return plan.forward(x, _thresholds_on_device(t), image.shape, lam, w, check, keep)
        if check:  # an empty batch: no kernel, so the host checks the thresholds
            check_thresholds(t, image)
        return device_empty(image.shape[:image.ndim - ndim] + (T,), dtype=real), None


def soft_ecc_backward(image, t, lam, w, ndim, tconn, g, needs, periodic=False,
                      t_dtype=np.float64, s_dtype=np.float64, plan=None, kept=None):
    """(d_image in the dtype of t or None, d_t (T,) in ``t_dtype`` or None, d_scale 0-d in
    ``s_dtype`` or None) for the cotangent ``g`` (*batch, T); ``t_dtype`` and ``s_dtype`` are
    the dtype of t or float64; ``plan`` the image's, if looked up; ``kept`` the forward's
    :class:`Residual` (soft_ecc_forward with ``keep``) or None."""
    import cupy

    need_image, need_t, need_scale = needs
    real, T = t.dtype, t.size
    t_dtype = np.dtype(t_dtype) if need_t else None
    s_dtype = np.dtype(s_dtype) if need_scale else None
    with _on_device_of(image):
        plan, x = _plan_and_view(image, ndim, tconn, periodic, T, real, plan)
        if g.dtype != real or not _c_contiguous(g):
            g = cupy.ascontiguousarray(g.astype(real, copy=False))
        # the outputs that the forward made, where they are the wanted ones (once)
        made = kept.take_outputs() if kept is not None else None
        made_image, made_t, made_scale, zeroed = made if made is not None else (None,) * 3 + (False,)
        d_image = d_t = d_scale = None
        if need_image:
            d_image = made_image if made_image is not None else device_empty(image.shape, dtype=real)
        zeroed = zeroed and d_image is made_image
        if need_t:
            d_t = made_t if made_t is not None and made_t.dtype == t_dtype else device_empty(T, dtype=t_dtype)
        if need_scale:
            d_scale = (made_scale if made_scale is not None and made_scale.dtype == s_dtype
                       else device_empty((), dtype=s_dtype))
        if plan is None:  # an empty batch
            for d in (d_image, d_t, d_scale):
                if d is not None:
                    d.fill(0)
            return d_image, d_t, d_scale
        stream = cupy.cuda.get_current_stream().ptr  # read once for the workspace and launches
        ws = plan.workspace("backward", backward_workspace_words(T), np.float64, stream)
        arrays = [x, _thresholds_on_device(t), g] + ([d_image] if need_image else []) + [ws]
        arrays += [d for d in (d_t, d_scale) if d is not None]
        arrays.append(NULL if kept is None else kept.kept)
        plan.backward(bool(need_image), t_dtype, s_dtype, arrays, lam, w, zeroed, stream)
        if kept is not None:
            kept.make_next()
    return d_image, d_t, d_scale
