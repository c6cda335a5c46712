"""JAX adapter: every public cutopo op as a ``jax.custom_vjp`` function of JAX arrays.

``cutopo.jax.<op>`` has the name and signature of ``cutopo.<op>`` (``cutopo.jax.cpab.<op>`` for
``cutopo.cpab.<op>``): JAX arrays in, a JAX array out. The functions work eagerly and under
``jax.jit``, ``jax.grad`` (and ``jax.vjp``, ``jax.value_and_grad``) and ``jax.vmap``, in any
composition. They are generated when this module is imported, by one generic adapter, from
:data:`cutopo.vjp.REGISTRY` (the differentiable ops) and a short list of non-differentiable ones
(``ecc``, ``ect``, ``euler_contributions``), like :mod:`cutopo.torch`; an op registered later is
adapted on first access, and needs a shape rule (``OpSpec.meta``) here::

    soft_ecc, soft_ect, expected_euler, deformable_aggregation, grid_sample, ecc, ect,
    euler_contributions, cpab.integrate, cpab.transform_grid, cpab.transform_image

How it works
------------
A call sorts the arguments into *dynamic* ones (JAX arrays and tracers; NumPy arrays and lists
are converted) and *static* ones (Python scalars such as a float ``scale`` or an int threshold
count, keyword arguments, a ``Tessellation``, and arguments that are always static values:
``cpab.transform_grid``'s ``shape``, a tuple or list of ints). For each combination of op, static values and
argument shapes/dtypes it builds (once) a ``jax.custom_vjp`` function of the dynamic arguments
whose forward and backward are callbacks into cutopo: the output's shape and dtype come from the
op's shape rule (``OpSpec.meta``), the backward calls :func:`cutopo.vjp` (the one VJP mechanism)
for exactly the arguments being differentiated (``symbolic_zeros`` tells which).

* CPU: ``jax.pure_callback`` to the NumPy path. The data is on the host already, so NumPy sees
  JAX's buffers without copies; the result is copied once into a JAX buffer. An eager call
  (concrete arrays on one CPU device, no transformation running) skips the callback: it runs
  the NumPy op on the same buffers at once and returns the result on the arrays' device.
* GPU (``jax.default_backend() == "gpu"``, or concrete arrays on a GPU): the callbacks are
  ``jax.experimental.buffer_callback`` callbacks (jax >= 0.6.1) that hand XLA's device buffers
  to CuPy through ``__cuda_array_interface__`` (no copies), run the CUDA kernels on XLA's stream
  (``ctx.stream``) and write the result into XLA's output buffer (one device-to-device copy).
  Tested on an H200 with JAX 0.11.2 (tests/test_jax_adapter.py's GPU tests: values and
  gradients of every op with a CUDA kernel against the NumPy path under ``jax.jit``, buffers
  reaching CuPy uncopied); with an older JAX, GPU arrays raise NotImplementedError.
* ``jax.vmap``: the callbacks are batched with ``vmap_method="expand_dims"``. Where the op
  batches natively over leading axes of one argument (``soft_ecc``/``ecc``/
  ``euler_contributions``: image, ``expected_euler``: prob, ``soft_ect``/``ect``: mask) and
  only that argument is batched, one call handles the whole batch (with ``ndim`` fixed to the
  unbatched image's rank; not for a threshold count, whose thresholds would span the whole
  batch); otherwise the callback loops over the batch (the same results, one call per item).
* Gradients: differentiable float arguments get their cotangents (``soft_ecc``: image,
  thresholds, scale); the others (``soft_ect``'s mask, integer arrays) get zeros
  (``None`` in the custom VJP). A scalar ``scale`` traced by ``jax.grad`` is a weakly typed
  0-d array: it is passed to cutopo as a Python float, so it does not widen the result dtype
  (JAX's own weak-type rule). The backward calls the op's forward again before its VJP (the
  residuals of a cutopo forward are Python objects), so ``jax.grad`` costs two forwards and
  one backward. The non-differentiable ops (integer outputs) have zero gradients. Reverse
  mode, first order only: forward mode (``jax.jvp``, ``jax.jacfwd``) and second derivatives
  (``jax.hessian``, a grad of a grad) raise JAX's errors for custom VJPs and callbacks.
* dtypes: the result dtype is the cutopo op's. float64 needs x64 mode
  (``jax.config.update("jax_enable_x64", True)``): without it a float64 result (float64 inputs,
  a NumPy float64 scale) raises a ValueError that says so, instead of being silently rounded to
  float32. Integer results (``ecc``: int64) follow JAX's canonical dtypes: int32 without x64.
  NumPy float64 arrays are refused without x64 for the same reason; Python lists follow JAX's
  rules (float32 without x64).

Static arguments are part of the cache key: under ``jax.jit`` pass them as Python values (mark
them static with ``static_argnums`` when they are arguments of the jitted function). An eager
call on the CPU costs the op plus about 0.1 ms (argument handling and the copy of the result
into a JAX buffer; measured on this CPU; the first call of a configuration also builds its
function), against about 0.35 ms through a callback; under ``jax.jit`` the callback is part of
the compiled computation.

Errors
------
Bad arguments raise the op's own exception (TypeError or ValueError naming the argument,
the same type and message as ``cutopo.<op>``), in three ways:

* Shapes, dtypes and static values (ranks, a ``scale`` of -1.0 given as a Python float, a bad
  ``connectivity``, thresholds that are not 1-D, inconsistent shapes of arguments): the op's
  shape rule runs the op's checks that need no data, when the call is traced. So these are
  raised at the call, eagerly and under ``jax.jit`` (while tracing), ``jax.grad`` and
  ``jax.vmap``.
* Values (``prob`` outside [0, 1], unsorted thresholds, an inconsistent ``level_start_index``
  given as an array): only the op can check them, when it runs. An eager call on the CPU runs
  it at once and raises its exception. Under ``jax.grad`` or ``jax.vmap`` without ``jit``, and
  eagerly on a GPU, the op runs in a callback; where XLA reports the callback's failure during
  the call, the call raises the op's exception too (JAX also logs the callback's traceback),
  but with JAX's asynchronous dispatch it can surface later, at ``block_until_ready`` or on
  reading the result, as JAX's report of the failed callback: a ``jax.errors.JaxRuntimeError``
  (or, from JAX's C++ dispatch path, a ValueError) whose message, "INTERNAL: CpuCallback
  error ...", ends with the op's exception and its traceback.
* Under ``jax.jit`` value errors always surface as that report when the compiled function
  runs: the op cannot run before the computation does. Check values before a jitted call
  where a clear error matters.

A count given as a JAX array (a traced int, under ``jax.jit`` without ``static_argnums``)
cannot set the result's shape: a TypeError says so.

Examples
--------
>>> import jax, jax.numpy as jnp
>>> import cutopo.jax as cj
>>> image = jax.random.uniform(jax.random.PRNGKey(0), (32, 32))
>>> t = jnp.linspace(0, 1, 16)
>>> cj.soft_ecc(image, t, 20.0).shape
(16,)
>>> loss = lambda x: jnp.sum(cj.soft_ecc(x, t, 20.0) ** 2)
>>> jax.jit(jax.grad(loss))(image).shape
(32, 32)
>>> jax.vmap(lambda x: cj.expected_euler(x))(jnp.stack([image, 1 - image])).shape
(2,)
>>> cj.ecc(image, t).dtype                       # int64 with x64, else int32  # doctest: +SKIP
dtype('int32')
"""
from __future__ import annotations

import collections
import inspect

import numpy as np

try:
    import jax
    import jax.numpy as jnp
except ImportError as exc:  # the message says what to install
    raise ImportError("cutopo.jax needs JAX, which is not installed: "
                      "pip install 'cutopo[jax]' (or pip install 'jax>=0.4.30')") from exc

from . import _adapters
from ._array import is_cupy_array
from .vjp import is_float_dtype
from .vjp import vjp as _vjp

try:  # jax >= 0.6.1: device buffers handed to Python, on XLA's stream
    from jax.experimental.buffer_callback import buffer_callback as _buffer_callback
except ImportError:  # pragma: no cover - older JAX
    _buffer_callback = None

try:
    from jax.custom_derivatives import SymbolicZero as _SymbolicZero
except ImportError:  # pragma: no cover
    from jax._src.custom_derivatives import SymbolicZero as _SymbolicZero

__all__: list[str] = []  # filled in below, one name per op, plus "cpab"

# jax >= 0.4.34 names the batching behaviour vmap_method; older ones had vectorized=True, the same
# "expand_dims" behaviour.
_VMAP = ({"vmap_method": "expand_dims"}
         if "vmap_method" in inspect.signature(jax.pure_callback).parameters
         else {"vectorized": True})

# Which callback runs the NumPy path: "pure" (jax.pure_callback, the default) or "buffer"
# (buffer_callback with NumPy views of the buffers: the GPU code path, testable on the CPU).
_CPU_CALLBACK = "pure"


def _typeof(x):
    return jax.typeof(x) if hasattr(jax, "typeof") else jax.core.get_aval(x)


def _x64() -> bool:
    """Whether JAX keeps float64 (x64 mode, also under ``jax.experimental.enable_x64``)."""
    return np.dtype(jax.dtypes.canonicalize_dtype(np.float64)) == np.float64


_X64_HINT = ("JAX represents float64 only in x64 mode: call jax.config.update('jax_enable_x64', "
             "True) at startup, or pass float32 arrays")


# ----------------------------------------------------------------------------- callbacks

class _Residuals:
    """The custom VJP's residuals: the dynamic arguments, and (static) which cotangents to form."""

    def __init__(self, arrays, needs):
        self.arrays = tuple(arrays)
        self.needs = tuple(needs)


jax.tree_util.register_pytree_node(
    _Residuals, lambda r: (r.arrays, r.needs), lambda needs, arrays: _Residuals(arrays, needs))


class _Runner:
    """Runs one op with fixed static arguments on host (NumPy) or device (CuPy) arrays.

    The dynamic arguments may carry k extra leading axes (``vmap_method="expand_dims"``: every
    argument gets them, size 1 where it is not batched); the results then carry the broadcast
    leading shape.
    """

    def __init__(self, op, template, kwargs, avals, out_dtype):
        self.op = op
        self.template = template          # per positional argument: ("dyn", i, weak) or value
        self.kwargs = kwargs
        self.base = [tuple(a.shape) for a in avals]
        self.dtypes = [np.dtype(a.dtype) for a in avals]
        self.out_dtype = np.dtype(out_dtype)
        self.positions = [p for p, v in enumerate(template) if _is_dyn(v)]
        self.native_slot, self.native_kwargs = None, None
        if op.native_batch is not None:
            named = {name: (_adapters.ArraySpec(self.base[v[1]], self.dtypes[v[1]])
                            if _is_dyn(v) else v)
                     for name, v in zip(op.arg_names, template)}
            rule = op.native_batch(named, dict(kwargs))
            if rule is not None:
                name, native_kwargs = rule
                entry = template[op.arg_names.index(name)]
                if _is_dyn(entry) and not entry[2]:
                    self.native_slot, self.native_kwargs = entry[1], native_kwargs
        self._backward = {}

    # -- helpers
    def _arguments(self, arrays):
        args = []
        for v in self.template:
            if _is_dyn(v):
                a = arrays[v[1]]
                args.append(float(a) if v[2] else a)  # weakly typed scalars act as Python floats
            else:
                args.append(v)
        return args

    def _lead(self, arrays):
        k = arrays[0].ndim - len(self.base[0])
        return k, tuple(np.broadcast_shapes(*(a.shape[:k] for a in arrays))) if k else ()

    def _native(self, arrays, k, needs=None):
        """Whether one call can take the batch: only the native argument is batched (and, for a
        backward, only its cotangent is wanted)."""
        i = self.native_slot
        if i is None:
            return False
        if needs is not None and any(need and j != i for j, need in enumerate(needs)):
            return False
        return all(all(s == 1 for s in a.shape[:k]) for j, a in enumerate(arrays) if j != i)

    @staticmethod
    def _item(a, idx, k):
        return a[tuple(0 if a.shape[d] == 1 else i for d, i in enumerate(idx))] if k else a

    # -- forward
    def forward(self, *arrays):
        xp = _xp(arrays)
        k, lead = self._lead(arrays)
        if k and self._native(arrays, k):
            i = self.native_slot
            arrays = [xp.broadcast_to(a, lead + a.shape[k:]) if j == i else a.reshape(a.shape[k:])
                      for j, a in enumerate(arrays)]
            out = self.op.function(*self._arguments(arrays), **self.native_kwargs)
        elif k:
            items = [self.op.function(*self._arguments([self._item(a, idx, k) for a in arrays]),
                                      **self.kwargs) for idx in np.ndindex(*lead)]
            out = xp.stack(items).reshape(lead + items[0].shape)
        else:
            out = self.op.function(*self._arguments(arrays), **self.kwargs)
        return xp.asarray(out).astype(self.out_dtype, copy=False)

    # -- backward
    def backward_for(self, needs):
        """The host function ``(*arrays, cotangent) -> [cotangent of each needed argument]``."""
        fn = self._backward.get(needs)
        if fn is None:
            def fn(*arrays_and_g):
                return self._backward_run(needs, arrays_and_g[:-1], arrays_and_g[-1])
            self._backward[needs] = fn
        return fn

    def _pullback(self, needs, arrays, g, kwargs):
        wrt = [self.positions[j] for j, need in enumerate(needs) if need]
        _, pullback = _vjp(self.op.function, *self._arguments(arrays), wrt=wrt, **kwargs)
        grads = pullback(g)
        return [grads[self.positions[j]] for j, need in enumerate(needs) if need]

    def _backward_run(self, needs, arrays, g):
        xp = _xp(arrays + (g,))
        k, lead = self._lead(list(arrays) + [g])
        if k and self._native(list(arrays) + [g], k, needs):
            i = self.native_slot
            arrays = [xp.broadcast_to(a, lead + a.shape[k:]) if j == i else a.reshape(a.shape[k:])
                      for j, a in enumerate(arrays)]
            grads = self._pullback(needs, arrays, xp.broadcast_to(g, lead + g.shape[k:]),
                                   self.native_kwargs)
        elif k:
            per_item = [self._pullback(needs, [self._item(a, idx, k) for a in arrays],
                                       self._item(g, idx, k), self.kwargs)
                        for idx in np.ndindex(*lead)]
            grads = [xp.stack(column).reshape(lead + column[0].shape)
                     for column in zip(*per_item)]
        else:
            grads = self._pullback(needs, arrays, g, self.kwargs)
        wanted = [j for j, need in enumerate(needs) if need]
        return [xp.asarray(gr).astype(self.dtypes[j], copy=False) for gr, j in zip(grads, wanted)]


def _is_dyn(entry) -> bool:
    return isinstance(entry, tuple) and len(entry) == 3 and entry[0] is _DYN


_DYN = object()  # marks a dynamic argument in a template: (_DYN, index, weakly typed scalar)


def _xp(arrays):
    if any(is_cupy_array(a) for a in arrays):
        import cupy

        return cupy
    return np


def _on_gpu(args) -> bool:
    """Whether the call runs on a GPU: concrete arrays on a GPU, or tracers under a GPU backend."""
    traced = False
    for a in args:
        if isinstance(a, jax.core.Tracer):
            traced = True
            continue
        devices = a.devices() if hasattr(a, "devices") else ()
        if any(d.platform in ("gpu", "cuda", "rocm") for d in devices):
            return True
    return traced and jax.default_backend() in ("gpu", "cuda", "rocm")


_CALLBACKS: dict = {}  # host function -> its pure/buffer callback wrapper (stable identity)

# The latest exceptions raised by cutopo in callbacks. XLA reports such an exception as a
# JaxRuntimeError ("CpuCallback error ...", its traceback as text); where that surfaces in a call
# of the adapter (eager transformations, GPU), the call raises the op's exception itself
# (_callback_error). Few are kept, so that failed calls pin little memory (their tracebacks).
_CALLBACK_ERRORS: collections.deque = collections.deque(maxlen=4)


def _host_call(fn, arrays):
    """``fn(*arrays)``, remembering an exception for :func:`_callback_error` (any thread: XLA
    may run callbacks on its own)."""
    try:
        return fn(*arrays)
    except Exception as exc:
        _CALLBACK_ERRORS.append(exc)
        raise


def _callback_error(error):
    """The exception of a callback that ``error`` reports (XLA's report of a failed callback: a
    JaxRuntimeError, or a ValueError from JAX's C++ dispatch, whose message holds the
    callback's traceback), or None."""
    text = str(error)
    for exc in reversed(list(_CALLBACK_ERRORS)):
        if f"{type(exc).__name__}: {exc}" in text:
            try:
                _CALLBACK_ERRORS.remove(exc)
            except ValueError:  # taken by another thread meanwhile
                pass
            return exc
    return None


def _pure_wrapper(fn):
    wrapper = _CALLBACKS.get((fn, "pure"))
    if wrapper is None:
        def wrapper(*arrays):
            return _host_call(fn, [np.asarray(a) for a in arrays])
        _CALLBACKS[(fn, "pure")] = wrapper
    return wrapper


def _buffer_wrapper(fn, device: bool):
    """``callback(ctx, out, *args)`` for buffer_callback: views of the buffers (CuPy on a GPU,
    NumPy on the CPU), the host function, and the results written into ``out``."""
    key = (fn, "buffer", device)
    wrapper = _CALLBACKS.get(key)
    if wrapper is None:
        def wrapper(ctx, out, *args):
            outs = out if isinstance(out, (list, tuple)) else [out]
            if not device:
                results = _host_call(fn, [np.asarray(a) for a in args])
                results = results if isinstance(results, (list, tuple)) else [results]
                for o, r in zip(outs, results):
                    np.asarray(o)[...] = r
                return
            import cupy

            ptr = (args[0] if args else outs[0]).__cuda_array_interface__["data"][0]
            device_id = cupy.cuda.runtime.pointerGetAttributes(ptr).device
            with cupy.cuda.Device(device_id), _external_stream(cupy, ctx.stream, device_id):
                results = _host_call(fn, [cupy.asarray(a) for a in args])
                results = results if isinstance(results, (list, tuple)) else [results]
                for o, r in zip(outs, results):
                    cupy.asarray(o)[...] = r  # XLA owns the output buffer: one device copy
        _CALLBACKS[key] = wrapper
    return wrapper


def _external_stream(cupy, pointer: int, device_id: int):
    """XLA's stream as a CuPy stream (CuPy 14: Stream.from_external; older: ExternalStream)."""
    if hasattr(cupy.cuda.Stream, "from_external"):
        class _Handle:  # the __cuda_stream__ protocol: (version, pointer)
            def __cuda_stream__(self):
                return (0, pointer)
        try:
            return cupy.cuda.Stream.from_external(_Handle())
        except TypeError:  # pragma: no cover - a CuPy that wants something else
            pass
    return cupy.cuda.ExternalStream(pointer, device_id)


def _invoke(fn, result_shape, args):
    """Run host function ``fn`` on ``args`` through the callback that suits the platform."""
    if _on_gpu(args):
        if _buffer_callback is None:
            raise NotImplementedError(
                f"cutopo.jax on GPU arrays needs jax.experimental.buffer_callback (jax >= 0.6.1); "
                f"this is jax {jax.__version__}: upgrade JAX, or move the arrays to the CPU")
        return _buffer_callback(_buffer_wrapper(fn, True), result_shape, **_VMAP_BUFFER)(*args)
    if _CPU_CALLBACK == "buffer" and _buffer_callback is not None:
        return _buffer_callback(_buffer_wrapper(fn, False), result_shape, **_VMAP_BUFFER)(*args)
    return jax.pure_callback(_pure_wrapper(fn), result_shape, *args, **_VMAP)


_VMAP_BUFFER = {"vmap_method": "expand_dims"}


# ----------------------------------------------------------------------------- the generic adapter

def _make(op, template, kwargs, avals, out_shape):
    """The custom_vjp function of the dynamic arguments for one static configuration, and its
    runner (which eager calls on the host run directly)."""
    runner = _Runner(op, template, kwargs, avals, out_shape.dtype)
    n = len(avals)
    names = [name for name, v in zip(op.arg_names, template) if _is_dyn(v)]
    differentiable = [name in op.differentiable and is_float_dtype(a.dtype)  # bfloat16 too
                      for name, a in zip(names, avals)]
    grad_shapes = [jax.ShapeDtypeStruct(tuple(a.shape), a.dtype) for a in avals]

    @jax.custom_vjp
    def function(*dyn):
        return _invoke(runner.forward, out_shape, dyn)

    def function_fwd(*primals):
        # symbolic_zeros=True: primals say whether they are being differentiated (perturbed)
        dyn = tuple(p.value for p in primals)
        needs = tuple(bool(p.perturbed) and d for p, d in zip(primals, differentiable))
        return _invoke(runner.forward, out_shape, dyn), _Residuals(dyn, needs)

    def function_bwd(residuals, g):
        needs = residuals.needs
        if isinstance(g, _SymbolicZero) or not any(needs):
            return (None,) * n
        shapes = [s for s, need in zip(grad_shapes, needs) if need]
        grads = iter(_invoke(runner.backward_for(needs), shapes, residuals.arrays + (g,)))
        return tuple(next(grads) if need else None for need in needs)

    function.defvjp(function_fwd, function_bwd, symbolic_zeros=True)
    return function, runner


_FUNCTIONS: dict = {}  # configuration key -> (custom_vjp function, its runner, result struct)


def _public(op: _adapters.AdaptedOp):
    def function(*args, **kwargs):
        values, static = _adapters.bind(op, args, kwargs)
        dyn, template, avals, key = [], [], [], []
        for name, v in zip(op.arg_names, values):
            if name in op.static_arguments:  # e.g. a grid's shape: static, never an array
                v = _adapters.static_value(v)
                template.append(v)
                key.append(_adapters.freeze(v))
                continue
            if isinstance(v, np.ndarray):
                if v.dtype == np.float64 and not _x64():
                    raise ValueError(f"{op.qualified_name.replace('cutopo.', 'cutopo.jax.')}: "
                                     f"{name} is a NumPy float64 array; {_X64_HINT}")
                v = jnp.asarray(v)
            elif isinstance(v, (list, tuple)):
                if any(isinstance(e, (jax.Array, jax.core.Tracer)) for e in v):
                    raise TypeError(f"cutopo.jax: {op.qualified_name} argument {name} is a "
                                    "sequence of arrays, which the adapter does not pass; give "
                                    "one array")
                v = jnp.asarray(v)  # JAX's dtype rules for Python numbers
            if isinstance(v, jax.Array) or isinstance(v, jax.core.Tracer):
                aval = _typeof(v)
                weak = bool(getattr(aval, "weak_type", False)) and aval.ndim == 0 \
                    and np.dtype(aval.dtype).kind == "f"
                template.append((_DYN, len(dyn), weak))
                key.append(("dyn", tuple(aval.shape), np.dtype(aval.dtype).str, weak))
                dyn.append(v)
                avals.append(aval)
            else:
                template.append(v)
                key.append(_adapters.freeze(v))
        # x64 mode is part of the key: it decides the result dtype (int64 or int32)
        cache_key = (op.name, _x64(), tuple(key),
                     tuple((k, _adapters.freeze(v)) for k, v in sorted(static.items())))
        entry = _FUNCTIONS.get(cache_key)
        if entry is None:
            # the shape rule runs the op's checks that need no data: bad shapes, dtypes and
            # static values raise the op's error here, also when tracing under jax.jit
            out_shape = _out_shape(op, template, static, avals)
            entry = _make(op, tuple(template), dict(static), avals, out_shape) + (out_shape,)
            _FUNCTIONS[cache_key] = entry
        function, runner, out_shape = entry
        if not dyn:  # nothing dynamic: the op itself, on host values
            return jnp.asarray(np.asarray(op.function(*values, **static)).astype(out_shape.dtype))
        device = _host_device(dyn)
        if device is not None:
            # eager, nothing traced, on the host: the op itself on the arrays' host buffers (the
            # callback would do the same, later; this way the op's errors come as raised)
            out = runner.forward(*[np.asarray(a) for a in dyn])
            if any(a.committed for a in dyn):
                return jax.device_put(out, device)
            return jnp.asarray(out)
        try:
            return function(*dyn)
        except Exception as exc:  # JaxRuntimeError; the C++ dispatch path raises a ValueError
            original = _callback_error(exc)
            if original is None or original is exc:
                raise
            raise original from None

    function.__name__ = function.__qualname__ = op.public_name
    function.__module__ = __name__ + (f".{op.family}" if op.family else "")
    function.__signature__ = inspect.signature(op.function)
    function.__doc__ = _docstring(op)
    return function


def _host_device(arrays):
    """The device of concrete (not traced) JAX arrays that all live on one CPU device, or None
    (tracers: a transformation is running; GPU arrays: the buffer callback's path)."""
    device = None
    for a in arrays:
        if isinstance(a, jax.core.Tracer) or not isinstance(a, jax.Array):
            return None
        devices = a.devices()
        if len(devices) != 1:
            return None
        (d,) = devices
        if d.platform != "cpu" or (device is not None and d != device):
            return None
        device = d
    return device


def _out_shape(op, template, static, avals):
    """The result's ShapeDtypeStruct from the op's shape rule; float64 needs x64."""
    name = op.qualified_name.replace("cutopo.", "cutopo.jax.", 1)
    if op.meta is None:
        raise NotImplementedError(f"{name}: the op has no shape rule (OpSpec.meta), which "
                                  "cutopo.jax needs; use the NumPy op directly")
    args, counts = [], []
    for arg_name, v in zip(op.arg_names, template):
        if _is_dyn(v):
            aval = avals[v[1]]
            # a weakly typed scalar reaches the op as a Python float, value unknown here: 1.0
            # passes the checks of a scale
            args.append(1.0 if v[2] else _adapters.ArraySpec(tuple(aval.shape), np.dtype(aval.dtype)))
            if aval.ndim == 0 and np.dtype(aval.dtype).kind in "iu":
                counts.append(arg_name)  # perhaps a count given as an array
        else:
            args.append(v)
    try:
        shape, dtype = op.meta(*args, **static)
    except Exception as exc:
        # The op's own checks raise TypeError or ValueError naming the argument: raised as they
        # are, as an eager call of the op would, unless the argument is a 0-d integer array
        # where a count (a Python int, which sets the result's shape) was perhaps meant.
        checked = isinstance(exc, (TypeError, ValueError))
        named = [n for n in counts if n in str(exc)] if checked else counts
        if named:
            raise TypeError(f"{name}: cannot infer the result's shape ({type(exc).__name__}: "
                            f"{exc}); {named[0]} is a 0-d integer JAX array, but arguments that "
                            "set the result's shape, such as a count of thresholds, must be "
                            "Python values, not JAX arrays (under jax.jit: static arguments)"
                            ) from exc
        if checked:
            raise
        raise TypeError(f"{name}: the shape rule failed on these argument shapes and static "
                        f"values ({type(exc).__name__}: {exc})") from exc
    dtype = np.dtype(dtype)
    canonical = np.dtype(jax.dtypes.canonicalize_dtype(dtype))
    if canonical != dtype and dtype.kind == "f":
        raise ValueError(f"{name}: the result is {dtype} (a float64 input or NumPy float64 "
                         f"scalar asks for it); {_X64_HINT}")
    return jax.ShapeDtypeStruct(tuple(int(s) for s in shape), canonical)


def _docstring(op) -> str:
    target = op.qualified_name
    return _adapters.docstring(
        op, f"JAX version of :func:`{target}`: JAX arrays in, a JAX array out.",
        """Generated by :mod:`cutopo.jax` as a ``jax.custom_vjp`` function; works eagerly and under
        ``jax.jit``, ``jax.grad`` and ``jax.vmap``.""",
        ("; the other arguments get zero cotangents.", "Not differentiable (integer result; zero cotangents)."),
        f"""As for :func:`{target}`; arrays as JAX arrays (NumPy arrays and lists are converted),
        other values (Python scalars such as a float ``scale`` or an int count, objects) as
        given: those are static.""",
        ("jax.Array",
         f"What :func:`{target}` returns (float64 needs x64 mode; int64 becomes int32 without it)."),
        _EXAMPLES.get(op.name))


_EXAMPLES = {
    "soft_ecc": """
        >>> import jax, jax.numpy as jnp, cutopo.jax as cj
        >>> images = jax.random.uniform(jax.random.PRNGKey(0), (2, 16, 16))
        >>> f = lambda x: jnp.sum(cj.soft_ecc(x, jnp.linspace(0, 1, 8), 30.0, ndim=2))
        >>> jax.grad(f)(images).shape
        (2, 16, 16)
        """,
    "soft_ect": """
        >>> import jax, jax.numpy as jnp, cutopo.jax as cj
        >>> mask = jax.random.uniform(jax.random.PRNGKey(0), (16, 16)) > 0.5
        >>> directions = jnp.array([[1.0, 0.0], [0.6, 0.8]])
        >>> jax.grad(lambda d: cj.soft_ect(mask, d, 8, 10.0).sum())(directions).shape
        (2, 2)
        """,
    "expected_euler": """
        >>> import jax, jax.numpy as jnp, cutopo.jax as cj
        >>> float(cj.expected_euler(jnp.full((2, 2), 0.5)))
        1.0625
        """,
    "cpab_integrate": """
        >>> import jax, jax.numpy as jnp, cutopo.jax as cj
        >>> from cutopo.cpab import Tessellation
        >>> tess = Tessellation((4,))
        >>> theta = jnp.array([0.2, 0.3, 0.1])
        >>> points = jnp.array([[0.25], [0.5]])
        >>> jax.grad(lambda th: cj.cpab.integrate(points, th, tess).sum())(theta).shape
        (3,)
        """,
    "ecc": """
        >>> import jax.numpy as jnp, cutopo.jax as cj
        >>> cj.ecc(jnp.array([[0, 2, 0], [2, 2, 2], [0, 2, 0]], dtype=jnp.uint8), [0, 1, 2]).tolist()
        [4, 4, 1]
        """,
    "euler_contributions": """
        >>> import jax.numpy as jnp, cutopo.jax as cj
        >>> cj.euler_contributions(jnp.array([[1.0, 0.0], [0.0, 1.0]])).tolist()
        [[-1, 1], [1, 0]]
        """,
    "ect": """
        >>> import jax.numpy as jnp, cutopo.jax as cj
        >>> ring = jnp.ones((3, 3), dtype=bool).at[1, 1].set(False)
        >>> cj.ect(ring, jnp.array([[1.0, 0.0]]), jnp.array([-0.5, 0.5, 1.5])).tolist()
        [[1, 1, 0]]
        """,
}


# ----------------------------------------------------------------------------- build the namespace

_NAMESPACE = _adapters.Namespace(__name__, _public, "JAX")
_NAMESPACE.build()


def __getattr__(name):
    # ops registered after this module was imported (their modules loaded later)
    return _NAMESPACE.late(name)
