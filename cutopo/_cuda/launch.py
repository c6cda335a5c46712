"""The one launch path of every cutopo kernel.

A RawKernel receives raw pointers and raw bytes: CuPy does no type checking, a Python float
reaches a ``float`` parameter as the first half of a double, and views/strides are ignored.
So every kernel declares its signature (:class:`Signature`) and every launch goes through
:func:`launch` or a :class:`PreparedLaunch`, which check each array (type, dtype,
C-contiguity, device) and convert each scalar to the declared C type (range-checked), then
launch on CuPy's current stream.

A :class:`PreparedLaunch` (a launch repeated with the same geometry, as every memoized plan
makes) keeps its parameters packed as the driver reads them, one 8-byte slot per parameter,
and launches with ``cuLaunchKernel`` on that block: per call it only writes the call-time
slots. On the H200 machines' hosts that takes a 20-argument launch from 18 to about 7 us
(CuPy's own launch packs every argument anew at every call, about 10 us there).

:func:`launch` makes such launches itself: the second time it sees a kernel launched with the
same geometry, device and scalar arguments (an op called again on arguments of the same
shapes), it keeps a PreparedLaunch with every array a call-time slot, and later launches of
that kind only check and write the arrays.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import math
import operator
import os
import threading

import numpy as np

from .._array import _cupy, array_module
from .compile import get_function
from .deferred import PinnedWord

# Declared parameter kinds: "ptr:<numpy dtype>" for arrays, a numpy dtype name for scalars, and
# HOST_WORD for a page-locked host word that the kernel writes (a PinnedWord, or NULL), and
# CALL_INT64 for an int64 that changes at every call (a check's token): launch() keeps it out of
# the key of its prepared launches, whose call-time arguments it is, like the arrays.
_SCALAR_KINDS = {"int32", "int64", "float32", "float64"}
HOST_WORD = "host:uint64"
CALL_INT64 = "call:int64"
# The device addresses a launch packs: an array's (NULL: 0) and a host word's (NULL: 0)
_ARRAY_POINTER = operator.attrgetter("data.ptr")
_WORD_POINTER = operator.attrgetter("device_ptr")


@dataclasses.dataclass(frozen=True)
class Signature:
    """A kernel instance and the kinds of its parameters, in order."""

    family: str
    name: str                # C++ name expression, e.g. "cutopo::ecc::ecc_cumsum"
    params: tuple[str, ...]  # e.g. ("ptr:int64", "int64", "int32")
    # True for a kernel whose threads keep large arrays in local memory (indexed at run time):
    # its launches ask for no more shared memory per multiprocessor than its resident blocks
    # use, so that L1 holds the rest (see _fit_shared_carveout)
    fit_shared: bool = False
    # Every launch looks a signature up in a few tables (its slots, its prepared launches): a
    # dataclass rehashes all its fields each time (~1 us per lookup), so the hash is kept.
    _hash: int = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "_hash", hash((self.family, self.name, self.params, self.fit_shared)))

    def __hash__(self) -> int:
        return self._hash

    def __reduce__(self):
        # rebuilt, not restored: string hashes differ between processes (hash randomisation)
        return (Signature, (self.family, self.name, self.params, self.fit_shared))


class LaunchError(RuntimeError):
    pass


class _NullData:
    ptr = 0


class _NullPointer:
    """The type of :data:`NULL`. It packs as 0 through the attributes a launch reads of an
    array (``data.ptr``) and of a host word (``device_ptr``)."""

    __slots__ = ()
    data = _NullData()
    device_ptr = 0

    def __repr__(self) -> str:
        return "NULL"


# A null pointer for any "ptr:" parameter: an optional output that the kernel tests for
# (e.g. a cotangent nobody asked for), passed explicitly rather than as a dummy array.
NULL = _NullPointer()


@functools.lru_cache(maxsize=None)
def _device_attributes(device_id: int) -> dict:
    import cupy

    return dict(cupy.cuda.Device(device_id).attributes)


def device_attribute(name: str) -> int:
    """An attribute of the current device (names as in cudaDevAttr*, without the prefix)."""
    import cupy

    return _device_attributes(cupy.cuda.Device().id)[name]


@functools.lru_cache(maxsize=None)
def _pointer_dtype(kind: str):
    """The NumPy dtype of a "ptr:<dtype>" parameter kind, None for a scalar kind (memoized:
    parsing a dtype name at every launch is measurable at small sizes)."""
    return np.dtype(kind[4:]) if kind.startswith("ptr:") else None


def _c_contiguous(value) -> bool:
    # CuPy keeps the flag as an attribute; ``flags`` builds an object at every read (a
    # microsecond per launch argument). The attribute is internal, so fall back to ``flags``.
    flag = getattr(value, "_c_contiguous", None)
    return value.flags.c_contiguous if flag is None else bool(flag)


def as_c_contiguous(x):
    """``x`` itself when it is C-contiguous, else a C-contiguous copy (NumPy or CuPy): CuPy's
    ascontiguousarray costs ~9 us of host time even on a C-contiguous array, a launch's worth.
    For arrays of at least one dimension (ascontiguousarray makes a 0-d array 1-d)."""
    return x if _c_contiguous(x) else array_module(x).ascontiguousarray(x)


def _check_array(value, dtype, index: int, sig: Signature, device=None):
    """``value`` if it is a C-contiguous CuPy array of ``dtype`` on the current device
    (``device``, read here when None) or :data:`NULL`, else a LaunchError."""
    if value is NULL:
        return value
    if not isinstance(value, _cupy().ndarray):
        raise LaunchError(f"{sig.name}: argument {index} must be a cupy.ndarray, got {type(value)}")
    if value.dtype != dtype:
        raise LaunchError(f"{sig.name}: argument {index} has dtype {value.dtype}, kernel expects {dtype}")
    if not _c_contiguous(value):
        raise LaunchError(f"{sig.name}: argument {index} is not C-contiguous; kernels ignore strides")
    if value.size:
        if device is None:
            device = _current_device()
        if value.data.device_id != device:
            raise LaunchError(f"{sig.name}: argument {index} lives on device "
                              f"{value.data.device_id}, launching on device {device}")
    return value


def device_empty(shape, dtype):
    """``cupy.empty(shape, dtype)``: an unwritten C-order array on the current device, made by
    ``cupy.ndarray`` itself. cupy.empty passes ``order`` on as a keyword, which cost ~2 us of
    host time a call on the H100 machines (3.8 against 1.6 us; forty-second session), where an
    op's call makes several arrays before its first launch."""
    import cupy

    return cupy.ndarray(shape, dtype)


def device_zeros(shape, dtype):
    """``cupy.zeros(shape, dtype)``: a device_empty array zeroed by one memset on the current
    stream (as cupy.zeros does, without its keyword's host time)."""
    a = device_empty(shape, dtype)
    if a.nbytes:
        a.data.memset_async(0, a.nbytes)
    return a


def _current_device() -> int:
    import cupy  # (_cupy()'s import without its call: read before first launches)

    return cupy.cuda.runtime.getDevice()


# on_device_of's context on the current device (a nullcontext has no state: one serves all)
_NO_CONTEXT = contextlib.nullcontext()


def on_device_of(array):
    """A context on a CuPy ``array``'s device: none at all when that is the current one (a
    Device context costs microseconds per call)."""
    if array.data.device_id == _current_device():
        return _NO_CONTEXT
    return array.device


@functools.lru_cache(maxsize=None)
def _scalar_kind(kind: str):
    """(dtype, smallest, largest) of a scalar parameter kind (None, None for floats); memoized,
    as np.iinfo costs microseconds per launch argument."""
    if kind not in _SCALAR_KINDS:
        return None
    dtype = np.dtype(kind)
    if dtype.kind == "i":
        info = np.iinfo(dtype)
        return dtype, int(info.min), int(info.max)
    return dtype, None, None


def _convert(value, kind: str, index: int, sig: Signature, device=None):
    dtype = _pointer_dtype(kind)
    if dtype is not None:
        return _check_array(value, dtype, index, sig, device)
    if kind == HOST_WORD:
        if value is NULL or isinstance(value, PinnedWord):
            return value
        raise LaunchError(f"{sig.name}: argument {index} must be a PinnedWord or NULL, got "
                          f"{type(value).__name__}")
    scalar = _scalar_kind("int64" if kind == CALL_INT64 else kind)
    if scalar is None:
        raise LaunchError(f"{sig.name}: unknown parameter kind {kind!r}")
    dtype, lo, hi = scalar
    if lo is not None:
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
            raise LaunchError(f"{sig.name}: argument {index} must be an integer, got {value!r}")
        if not lo <= int(value) <= hi:
            raise LaunchError(f"{sig.name}: argument {index} = {value} overflows {kind}")
        return dtype.type(int(value))
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise LaunchError(f"{sig.name}: argument {index} must be a real number, got {value!r}")
    return dtype.type(value)


def _checked_kernel(sig: Signature, grid: int, block: int, shared_mem: int,
                    options: tuple[str, ...], device=None):
    device = _current_device() if device is None else device
    if grid > _device_attributes(device)["MaxGridDimX"]:
        raise LaunchError(f"{sig.name}: grid of {grid} blocks exceeds the device limit")
    if sig.fit_shared:
        _fit_shared_carveout(device, sig, options, int(block), int(shared_mem))
    kernel = _kernel(device, sig, options)
    _allow_shared_memory(kernel, sig, device, shared_mem)
    return kernel


def _allow_shared_memory(kernel, sig: Signature, device_id: int, shared_mem: int) -> None:
    """Opts ``kernel`` into ``shared_mem`` bytes of dynamic shared memory above the default
    48 KB (a launch needs it, and so does the occupancy query: without it the query may count
    no block resident). LaunchError past the device's limit."""
    if shared_mem <= 48 * 1024:
        return
    if shared_mem > _device_attributes(device_id)["MaxSharedMemoryPerBlockOptin"]:
        raise LaunchError(f"{sig.name}: {shared_mem} bytes of shared memory exceed the device limit")
    kernel.max_dynamic_shared_size_bytes = shared_mem


@functools.lru_cache(maxsize=None)
def _kernel(device_id: int, sig: Signature, options: tuple[str, ...]):
    """The compiled kernel of ``sig`` on a device (memoized: a launch then costs a lookup)."""
    return get_function(sig.family, sig.name, options)


@functools.lru_cache(maxsize=None)
def _fit_shared_carveout(device_id: int, sig: Signature, options: tuple[str, ...], block: int,
                         shared_mem: int) -> int:
    """Set the kernel's preferred shared-memory carveout to what its resident blocks need (the
    percentage of the multiprocessor's shared memory, rounded up; the driver takes the next
    larger capacity it supports) and return it. Left to itself the driver gave the CPAB
    backward's 4 blocks of 15 KB a 132 KB carveout on the H200, leaving L1 ~120 KB for ~210 KB
    of local arrays: 64 KB measured 0-5 % faster in 2D, 100 KB (3D's 3 blocks of 27 KB) 3 %;
    none of it 2.3x slower, all of it 1.1-1.3x (benchmarks/RESULTS.md, twenty-second session).
    Memoized: the carveout is the function's, set once per device (the occupancy query sees
    the carveout set last, so it is asked with all of the shared memory)."""
    import cupy

    kernel = _kernel(device_id, sig, options)
    attrs = _device_attributes(device_id)
    # the occupancy query sees the carveout set last: ask it with all the shared memory
    kernel.preferred_shared_memory_carveout = 100
    per_sm = cupy.cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor(
        kernel.kernel.ptr, block, shared_mem)
    reserved = attrs.get("ReservedSharedMemoryPerBlock", 1024)
    per_block = kernel.shared_size_bytes + shared_mem + reserved
    total = attrs["MaxSharedMemoryPerMultiprocessor"]
    percent = min(100, -(-100 * max(1, per_sm) * per_block // total))
    kernel.preferred_shared_memory_carveout = percent
    return percent


# Debugging: CUTOPO_SYNC=1 (read when cutopo is imported) synchronises after every launch, so
# that a fault surfaces at the launch that caused it. Read once: an environment lookup costs
# microseconds at every launch.
SYNC = os.environ.get("CUTOPO_SYNC") == "1"


def _after_launch(sig: Signature) -> None:
    if SYNC:
        import cupy

        try:
            cupy.cuda.get_current_stream().synchronize()
        except Exception as exc:  # pragma: no cover - needs a faulting kernel
            raise LaunchError(f"{sig.name} failed: {exc}") from exc


@functools.lru_cache(maxsize=None)
def _slots(sig: Signature):
    """(call-time slots: arrays, host words and CALL_INT64, a getter of the other scalar
    arguments, a getter of the floating-point scalar arguments) of a signature; the getters
    return tuples."""
    arrays = tuple(i for i, k in enumerate(sig.params)
                   if k.startswith("ptr:") or k in (HOST_WORD, CALL_INT64))
    scalars = tuple(i for i in range(len(sig.params)) if i not in arrays)
    floats = tuple(i for i in scalars if sig.params[i].startswith("float"))
    return arrays, _tuple_getter(scalars), _tuple_getter(floats)


def _tuple_getter(indices):
    """args -> tuple(args[i] for i in indices), in C (itemgetter) where it can."""
    if not indices:
        return lambda args: ()
    if len(indices) == 1:
        i = indices[0]
        return lambda args: (args[i],)
    return operator.itemgetter(*indices)


# launch()'s prepared launches, by (signature, geometry, options, device, scalar arguments),
# and the keys seen once: a launch is prepared the second time its key comes, so that scalars
# that change at every call (a per-image value range) never pay for preparing. Both are
# bounded; the oldest entries go first.
_PREPARED: dict = {}
_SEEN: dict = {}
PREPARED_CAPACITY = 1024
# False: every launch() packs its arguments anew (the plain path; for tests and benchmarks)
PREPARE_REPEATS = True


_REMEMBER_LOCK = threading.Lock()  # launches from threads (Dask's): eviction iterates a table


def _remember(table: dict, key, value) -> None:
    with _REMEMBER_LOCK:
        if len(table) >= PREPARED_CAPACITY:
            del table[next(iter(table))]
        table[key] = value


def _prepared_key(sig: Signature, grid, block, shared_mem, options, device, args, slots):
    """The key of a launch's PreparedLaunch, or None when it gets none: scalars by type and
    value (1 and 1.0, or 1 and True, convert differently or not at all), floats also by sign
    (-0.0 == 0.0). Shared memory past the 48 KB default (a per-kernel limit, which a later
    launch of another size would lower) gets none. An unhashable argument (a conversion error
    to come) makes a key that raises TypeError when it is looked up."""
    if shared_mem > 48 * 1024:
        return None
    _, scalars, floats = slots
    values = scalars(args)
    try:
        signs = tuple(map(math.copysign, itertools.repeat(1.0), floats(args)))
    except TypeError:
        return None
    return (sig, grid, block, shared_mem, options, device, values, tuple(map(type, values)), signs)


def launch(sig: Signature, grid: int, block: int, args: tuple, *, shared_mem: int = 0,
           options: tuple[str, ...] = ()) -> None:
    """Check and convert ``args`` against ``sig``, then launch a 1-D grid on the current stream."""
    if len(args) != len(sig.params):
        raise LaunchError(f"{sig.name}: {len(args)} arguments given, signature has {len(sig.params)}")
    device = _current_device()
    if grid > 0 and PREPARE_REPEATS:
        slots = _slots(sig)
        key = _prepared_key(sig, grid, block, shared_mem, options, device, args, slots)
        prepared = None
        if key is not None:
            try:
                prepared = _PREPARED.get(key)
            except TypeError:  # an unhashable argument: the plain path raises its error
                key = None
        if key is not None:
            if prepared is None and key in _SEEN:
                prepared = PreparedLaunch(sig, grid, block, tuple(
                    None if i in slots[0] else a for i, a in enumerate(args)),
                    shared_mem=shared_mem, options=options)
                _remember(_PREPARED, key, prepared)
            if prepared is not None:
                prepared.call_on(device, *(args[i] for i in slots[0]))
                return
            _remember(_SEEN, key, True)
    converted = tuple(_convert(a, k, i, sig, device) for i, (a, k) in enumerate(zip(args, sig.params)))
    if grid <= 0:
        return  # nothing to do; CuPy would clamp the grid to 1 block
    kernel = _checked_kernel(sig, grid, block, shared_mem, options, device)
    converted = tuple(np.uint64(0) if a is NULL else  # 8 bytes, by value
                      np.uint64(a.device_ptr) if isinstance(a, PinnedWord) else a for a in converted)
    kernel((int(grid),), (int(block),), converted, shared_mem=int(shared_mem))
    _after_launch(sig)


class ParameterBlock:
    """Kernel parameters packed as ``cuLaunchKernel`` reads them: slot i (8 bytes, 8-aligned)
    holds parameter i, an array's device pointer or a scalar's bytes (4-byte kinds in the slot's
    low half: the machine is little-endian, as every CUDA host is), and ``pointers`` the
    address of every slot (the driver's ``kernelParams``). The driver copies the values when
    the launch is queued, so the block may be rewritten right after it."""

    __slots__ = ("u64", "i64", "f64", "i32", "f32", "pointers", "address")

    def __init__(self, template):
        self.u64 = template.copy()
        self.i64 = self.u64.view(np.int64)
        self.f64 = self.u64.view(np.float64)
        self.i32 = self.u64.view(np.int32)
        self.f32 = self.u64.view(np.float32)
        base = self.u64.ctypes.data
        self.pointers = np.arange(self.u64.size, dtype=np.uint64) * np.uint64(8) + np.uint64(base)
        self.address = self.pointers.ctypes.data

    def writer(self, i: int, kind: str):
        """(view, index, getter) that store a converted value of ``kind`` in slot i as
        ``view[index] = getter(value)`` (getter None: the value itself): a prepared launch's
        call-time slots are written this way, without write()'s dispatch on the kind."""
        if kind.startswith("ptr:"):
            return self.u64, i, _ARRAY_POINTER
        if kind == HOST_WORD:
            return self.u64, i, _WORD_POINTER
        if kind in ("int32", "float32"):
            return (self.i32 if kind == "int32" else self.f32), 2 * i, None
        return (self.i64 if kind in ("int64", CALL_INT64) else self.f64), i, None

    def write(self, i: int, kind: str, value) -> None:
        """Store the converted ``value`` (a checked CuPy array, a PinnedWord, NULL or a NumPy
        scalar of the kind's C type) in slot i."""
        view, index, getter = self.writer(i, kind)
        view[index] = value if getter is None else getter(value)


@functools.lru_cache(maxsize=None)
def slots_writer(slots: tuple):
    """``write(block, values)``: stores ``values`` (converted, one per slot) in the slots
    ``slots`` ((index, kind) pairs) of a ParameterBlock, as :meth:`ParameterBlock.writer`'s
    triples do, in straight-line code made once per layout: a prepared launch's call-time slots
    at every call, where a loop over the triples cost ~0.06 us more a slot on the build machine
    (an attribute getter's call, the loop's unpacking). Raises ValueError for a count of
    values other than the slots'."""
    sample = ParameterBlock(np.zeros(max([i for i, _ in slots], default=0) + 1, dtype=np.uint64))
    views = {id(getattr(sample, name)): name for name in ("u64", "i64", "f64", "i32", "f32")}
    reads = {id(None): "", id(_ARRAY_POINTER): ".data.ptr", id(_WORD_POINTER): ".device_ptr"}
    names = [f"v{k}" for k in range(len(slots))]
    lines = ["def write(block, values):",
             f"    ({''.join(n + ', ' for n in names)}) = values"]
    for name, (i, kind) in zip(names, slots):
        view, index, getter = sample.writer(i, kind)
        lines.append(f"    block.{views[id(view)]}[{index}] = {name}{reads[id(getter)]}")
    namespace: dict = {}
    exec("\n".join(lines), namespace)  # noqa: S102 - source made above from ints and names
    return namespace["write"]


class PreparedLaunch:
    """A launch whose geometry and most arguments are fixed: per call only a few change.

    ``args`` holds every argument, with ``None`` where one is passed at call time (typically
    the arrays, and scalars such as a learnable scale); the fixed ones are converted and packed
    once here (a :class:`ParameterBlock`, one per thread: a plan may be shared by threads), the
    call-time ones are checked and converted at every call, like :func:`launch` does, and
    written into their slots. Fixed arrays are kept alive by this object.
    """

    def __init__(self, sig: Signature, grid: int, block: int, args: tuple, *, shared_mem: int = 0,
                 options: tuple[str, ...] = ()):
        if len(args) != len(sig.params):
            raise LaunchError(f"{sig.name}: {len(args)} arguments given, signature has {len(sig.params)}")
        self.sig, self.grid, self.block, self.shared_mem = sig, int(grid), int(block), int(shared_mem)
        self.slots = [i for i, a in enumerate(args) if a is None]
        # per call-time slot: (index, array dtype or None for a scalar, kind); the checks at
        # call time are _convert's, with the dtypes parsed once and the current device read
        # once per call
        self._slot_kinds = [(i, _pointer_dtype(sig.params[i]), sig.params[i]) for i in self.slots]
        self.args = [a if a is None else _convert(a, k, i, sig) for i, (a, k) in enumerate(zip(args, sig.params))]
        self.device = _current_device()
        self.kernel = (_checked_kernel(sig, self.grid, self.block, self.shared_mem, options)
                       if self.grid > 0 else None)
        template = ParameterBlock(np.zeros(max(len(sig.params), 1), dtype=np.uint64))
        for i, (a, k) in enumerate(zip(self.args, sig.params)):
            if a is not None:
                template.write(i, k, a)
        self._template = template.u64
        self._function = self.kernel.kernel.ptr if self.kernel is not None else 0
        self._launch_kernel = _cupy().cuda.driver.launchKernel if self.kernel is not None else None
        self._write = slots_writer(tuple((i, kind) for i, _, kind in self._slot_kinds))
        self._local = threading.local()
        self._checked_once = False  # call_checked_once has checked one call

    def _block(self) -> ParameterBlock:
        """This thread's parameter block."""
        block = getattr(self._local, "block", None)
        if block is None:
            block = self._local.block = ParameterBlock(self._template)
        return block

    def _launch(self, block: ParameterBlock, stream: int | None = None) -> None:
        if stream is None:
            stream = _cupy().cuda.get_current_stream().ptr
        self._launch_kernel(self._function, self.grid, 1, 1, self.block, 1, 1, self.shared_mem,
                            stream, block.address, 0)
        if SYNC:
            _after_launch(self.sig)

    def _check_device(self, device: int) -> None:
        if device != self.device:
            raise LaunchError(f"{self.sig.name}: prepared on device {self.device}, launching on "
                              f"device {device}")

    def __call__(self, *values) -> None:
        self.call_on(_current_device(), *values)

    def call_on(self, device: int, *values) -> None:
        """``__call__`` with the current device already read (``device``)."""
        if len(values) != len(self.slots):
            raise LaunchError(f"{self.sig.name}: {len(values)} arguments given, {len(self.slots)} expected")
        sig = self.sig
        self._check_device(device)
        block = self._block()
        self._write(block, tuple(_check_array(a, dtype, i, sig, device) if dtype is not None
                                 else _convert(a, kind, i, sig)
                                 for (i, dtype, kind), a in zip(self._slot_kinds, values)))
        if self.kernel is not None:
            self._launch(block)

    def call_prechecked(self, *values) -> None:
        """Launch like ``__call__``, without checking ``values`` again.

        Only for a caller that passed arguments of the same kinds through ``__call__`` before
        and has proved that these match them in everything the checks look at: array dtype,
        C-contiguity and device (the current one), scalars already of their C types. A plan
        memoized on exactly those properties is such a caller; anything else uses
        ``__call__``.
        """
        self._write_and_launch(values)

    def _write_and_launch(self, values: tuple, stream: int | None = None) -> None:
        # call_prechecked's work, in as few calls as it takes: the launches of a repeated call,
        # whose host time before its first launch a per-call timing pays in full
        block = getattr(self._local, "block", None) or self._block()
        self._write(block, values)
        if self.kernel is not None:
            self._launch(block, stream)

    def call_checked_once(self, *values, stream: int | None = None) -> None:
        """``__call__`` at the first call, ``call_prechecked`` after it: for a caller that has
        call_prechecked's proof for every call after the first (a memoized plan that makes or
        checks its arrays itself), whose first call still checks them all. ``stream``: the
        current stream's pointer, where the caller has read it for several launches (~0.3 us
        a read on the device machines' hosts), else read here."""
        if self._checked_once:
            self._write_and_launch(values, stream)
        else:
            self(*values)
            self._checked_once = True


class KeptLaunches:
    """The launches of one kind of repeated op call, made through :func:`launch`'s interface
    but with the array checks done once per launch kind instead of at every call.

    An op that memoizes what it checked of a call (a :class:`~cutopo._cuda.repeated.RepeatedCalls`
    entry: its arrays' shapes, dtypes, C-contiguity and device) keeps one of these in the
    entry, and launches every kernel of a call of that kind through it. A launch is kept by
    its signature, geometry and scalar arguments (:func:`launch`'s key); its first call checks
    every argument, later ones write the arrays' pointers unchecked
    (:meth:`PreparedLaunch.call_prechecked`). That is sound only for a caller whose arrays of a
    given launch kind are the same in everything the checks read, call after call: the op's
    memoized arguments, and arrays it makes itself on the current device in dtypes that the
    key fixes. Calls must be made on ``device`` (the caller checks it where a call could come
    from elsewhere, e.g. a pullback). The generic :func:`launch` checks every array at every
    call: ~1.5 us an array on the device machines' hosts, 8-18 us for a CPAB kernel's launch
    (forty-fourth session)."""

    CAPACITY = 64  # launch kinds kept (a kind of call makes a handful)

    def __init__(self):
        self.device = _current_device()
        self._table: dict = {}

    def __call__(self, sig: Signature, grid: int, block: int, args: tuple) -> None:
        """Launch ``sig`` on a 1-D grid of ``grid`` blocks on the current stream (no dynamic
        shared memory, no options: the kernels that need them use :func:`launch`)."""
        slots = _slots(sig)
        key = (_prepared_key(sig, grid, block, 0, (), self.device, args, slots)
               if len(args) == len(sig.params) and grid > 0 else None)
        prepared = self._table.get(key) if key is not None else None
        if prepared is None:
            if key is None or len(self._table) >= self.CAPACITY:
                launch(sig, grid, block, args)  # an unusual call: the checked path
                return
            prepared = PreparedLaunch(sig, grid, block, tuple(
                None if i in slots[0] else a for i, a in enumerate(args)))
            prepared.call_on(self.device, *map(args.__getitem__, slots[0]))  # checked, once
            self._table[key] = prepared
            return
        prepared.call_prechecked(*map(args.__getitem__, slots[0]))


def static_shared_bytes(sig: Signature, options: tuple[str, ...] = ()) -> int:
    """The kernel's static shared memory (its ``__shared__`` arrays) on the current device."""
    import cupy

    return int(_kernel(cupy.cuda.Device().id, sig, tuple(options)).shared_size_bytes)


def resident_blocks(sig: Signature, block: int, shared_mem: int = 0,
                    options: tuple[str, ...] = ()) -> int:
    """How many blocks of this kernel the whole device runs at once (memoized per device)."""
    import cupy

    return _resident_blocks(cupy.cuda.Device().id, sig, int(block), int(shared_mem), tuple(options))


@functools.lru_cache(maxsize=1024)
def _resident_blocks(device_id, sig, block, shared_mem, options):
    import cupy

    kernel = get_function(sig.family, sig.name, options)
    _allow_shared_memory(kernel, sig, device_id, shared_mem)
    per_sm = cupy.cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor(
        kernel.kernel.ptr, block, shared_mem)
    return max(1, per_sm) * device_attribute("MultiProcessorCount")
