"""PyTorch adapter: every public cutopo op as a differentiable function of torch tensors.

``cutopo.torch.<op>`` has the name and signature of ``cutopo.<op>`` (``cutopo.torch.cpab.<op>``
for ``cutopo.cpab.<op>``): tensors in, a tensor out, differentiable with autograd in the
arguments the op's VJP covers. The functions are generated when this module is imported, by one
generic adapter, from :data:`cutopo.vjp.REGISTRY` (the differentiable ops) and a short list of
non-differentiable ones (``ecc``, ``ect``, ``euler_contributions``); an op registered later is
adapted on first access (``cutopo.torch.<registry name>``)::

    soft_ecc, soft_ect, expected_euler, deformable_aggregation, grid_sample, ecc, ect,
    euler_contributions, cpab.integrate, cpab.transform_grid, cpab.transform_image

How it works
------------
Each op is a ``torch.library.custom_op`` named ``cutopo::<registry name>`` (for example
``torch.ops.cutopo.soft_ecc``) with the schema ``(Tensor[] tensors, int static) -> Tensor``: the
tensor arguments travel as a list, and everything else (Python scalars such as a float
``scale`` or an int threshold count, keyword arguments, a ``Tessellation``) is interned once in
a table and passed as its integer key. Differentiable ops get a second custom op
``cutopo::<name>_vjp`` that calls :func:`cutopo.vjp` (the one VJP mechanism), attached with
``register_autograd``; both get a ``register_fake`` kernel from the op's shape rule
(``OpSpec.meta``), so ``torch.compile`` sees their output shapes without running them.

* CPU tensors go to the NumPy path through ``Tensor.numpy()`` and come back through
  ``torch.from_numpy``: no copies (strided tensors stay strided; the ops copy where they must).
  On the CPU ``numpy()`` is the same zero-copy view DLPack would give, for every dtype NumPy has.
* CUDA tensors go to CuPy through DLPack and back without copies, on the caller's current torch
  CUDA stream (CuPy runs its kernels on ``torch.cuda.current_stream()``), on the tensor's device.
* bfloat16: the ops that take it (``deformable_aggregation``; ``AdaptedOp.accepts_bfloat16``)
  get ``ml_dtypes.bfloat16`` arrays over the tensor's memory, without copies: on the CPU through
  an int16 view (``t.view(torch.int16).numpy().view(bfloat16)``: ``numpy()`` itself refuses
  bfloat16), on CUDA through DLPack (DLPack's bfloat16 where CuPy imports it, else the bits as
  int16 viewed as bfloat16 in CuPy; a CuPy without bfloat16 arrays: a TypeError). bfloat16
  results and the gradients of bfloat16 arguments come back as bfloat16 tensors. The other ops
  refuse bfloat16 tensors with a TypeError before any work (convert them, e.g. ``.float()``).
  bfloat16 needs ``ml_dtypes`` (it comes with JAX).
* Array-likes (NumPy arrays, lists) given for array arguments become tensors; they get no
  gradient. Sequences *of tensors* (such as per-level feature lists) are not passed yet: a
  TypeError says so. Arguments that are always static values (``cpab.transform_grid``'s
  ``shape``, a tuple or list of ints, or a ``torch.Size``) stay Python values.
* The output has exactly the shape and dtype of the cutopo op's result (int64 for ``ecc``,
  float32 or float64 by the op's dtype rules; a Python float ``scale`` is weakly typed there
  too), and lives on the device of the op's first tensor argument.
* Gradients: tensors that require grad get a gradient when the op differentiates that argument
  (for example ``soft_ecc``: image, thresholds, scale); the others (``soft_ect``'s mask, a
  ``Tessellation``, integer tensors) get ``None``. The backward forms cotangents only for the
  tensors that require grad (``ctx.needs_input_grad``). Python scalars are constants.
* The backward calls the op's forward again before its VJP (the residuals of a cutopo forward
  are Python objects, which cannot pass through a custom op), so a training step costs two
  forwards and one backward.
* Non-differentiable ops return integer tensors; asking for a gradient through them is an error
  of autograd's (no grad_fn).
* First order only: differentiating a backward (``create_graph=True`` and then a gradient of
  the gradient, as gradient penalties and Hessian-vector products do) raises
  NotImplementedError naming the op. A ``create_graph=True`` backward alone works.

``torch.compile``: every op is one opaque node; ``torch.compile(fn, fullgraph=True)`` of a
function that calls these ops and differentiates through them compiles without graph breaks
(tested on CPU with the ``"eager"``, ``"aot_eager"`` and ``"inductor"`` backends, every op
above; the inductor backend needs a C++ compiler). Static arguments (Python scalars,
keywords, a grid's shape) are constants of the graph: a new value recompiles (pass a changing
``scale`` as a 0-d tensor instead). Dynamic shapes (``dynamic=True``) work; a static argument
taken from a symbolic shape (``image.shape``) is specialised (guarded) to its value. An op
registered later without a shape rule still works, but runs outside the compiled graph (a graph
break).

``torch.func`` transforms (``grad``, ``vmap``, ``jacrev``) are not supported: the ops have no
vmap rules, and functorch refuses the autograd formula that ``register_autograd`` attaches to a
custom op ("must override the setup_context staticmethod"; pytorch/pytorch#179652, open in torch
2.13). Batch through the ops' leading axes and differentiate with ``torch.autograd`` or
``.backward()``, which ``torch.compile`` also handles.

Errors: eager calls raise the op's own exceptions (TypeError or ValueError naming the
argument). Under ``torch.compile`` the fake kernels run the op's shape rule, which runs the
op's checks that need no data (ranks, shapes, dtypes, options) on data-free stand-ins of the
tensors (with dynamic shapes, of the example's sizes: the checks add no guards). A bad shape
is therefore reported while tracing, but Dynamo wraps every exception of a fake kernel in its
own ``torch._dynamo.exc.TorchRuntimeError`` (there is no way around this in Dynamo, with
``fullgraph=True`` or without): its message quotes the op's error (``... got
ValueError('features must have shape (bs, num_feat, C) ...')``) and its ``__cause__`` chain
holds the op's exception itself. Errors that depend on values (a probability outside [0, 1],
unsorted thresholds) are raised by the op when the compiled graph runs, as they are (ValueError).

Cost per call: the op, plus about 0.1 ms of Python (argument handling and torch's dispatch of a
Python custom op; measured on this CPU), so tiny inputs are dominated by it.

Examples
--------
>>> import torch
>>> import cutopo.torch as ct
>>> image = torch.rand(32, 32, dtype=torch.float64, requires_grad=True)
>>> t = torch.linspace(0, 1, 16, dtype=torch.float64)
>>> curve = ct.soft_ecc(image, t, 20.0)            # a Python float scale is a constant
>>> curve.shape, curve.dtype
(torch.Size([16]), torch.float64)
>>> curve.sum().backward()
>>> image.grad.shape
torch.Size([32, 32])
>>> ct.ecc(image.detach() > 0.5, 2).dtype              # non-differentiable ops: int64 curves
torch.int64
>>> ct.cpab.integrate                                  # cutopo.cpab.integrate  # doctest: +ELLIPSIS
<function integrate at 0x...>
"""
from __future__ import annotations

import contextlib
import inspect

import numpy as np

try:
    import torch
except ImportError as exc:  # the message says what to install
    raise ImportError("cutopo.torch needs PyTorch, which is not installed: "
                      "pip install 'cutopo[torch]' (or pip install 'torch>=2.4')") from exc

if not hasattr(torch, "library") or not hasattr(torch.library, "custom_op"):
    raise ImportError(f"cutopo.torch needs torch>=2.4 (torch.library.custom_op), found "
                      f"torch {torch.__version__}: pip install 'cutopo[torch]'")

from . import _adapters

try:
    from torch.fx.experimental.symbolic_shapes import guard_scalar as _guard_scalar
except ImportError:  # pragma: no cover - older torch: scalars are never symbolic there
    def _guard_scalar(v):
        return v
try:  # the example value of a symbolic size, without a guard (torch >= 2.13; before: hint_int)
    from torch.fx.experimental.symbolic_shapes import optimization_hint as _size_hint
except ImportError:  # pragma: no cover
    try:
        from torch.fx.experimental.symbolic_shapes import hint_int as _size_hint
    except ImportError:
        _size_hint = None
from ._array import is_cupy_array
from .vjp import vjp as _vjp

__all__: list[str] = []  # filled in below, one name per op, plus "cpab"

_LIBRARY = "cutopo"


# ----------------------------------------------------------------------------- dtypes

# A fixed table, not torch.empty(...).numpy(): the fake kernels run under FakeTensorMode, where
# a new tensor is fake and has no NumPy view.
_NUMPY_OF = {getattr(torch, name): np.dtype(name) for name in
             ("bool", "uint8", "uint16", "int8", "int16", "int32", "int64", "float16", "float32",
              "float64") if hasattr(torch, name)}  # uint16: torch >= 2.3
_TORCH_OF = {v: k for k, v in _NUMPY_OF.items()}

# bfloat16: NumPy has none; ml_dtypes' is the one CuPy and JAX use (and the ops take). Only for
# the ops that accept it (AdaptedOp.accepts_bfloat16); None without ml_dtypes.
try:
    import ml_dtypes as _ml_dtypes
except ImportError:  # pragma: no cover - ml_dtypes comes with JAX
    _BFLOAT16 = None
else:
    _BFLOAT16 = np.dtype(_ml_dtypes.bfloat16)
    _TORCH_OF[_BFLOAT16] = torch.bfloat16


def _numpy_dtype(dtype: torch.dtype, op: _adapters.AdaptedOp | None = None) -> np.dtype:
    """The NumPy dtype of a tensor dtype, for arguments of ``op``: bfloat16 only when the op
    accepts it (``ml_dtypes.bfloat16``), a TypeError for the others."""
    found = _NUMPY_OF.get(dtype)
    if found is not None:
        return found
    if dtype == torch.bfloat16 and op is not None and op.accepts_bfloat16:
        if _BFLOAT16 is None:
            raise TypeError(f"cutopo.torch: bfloat16 tensors need ml_dtypes (pip install ml_dtypes) "
                            f"for {op.qualified_name}; or convert them first, e.g. with .float()")
        return _BFLOAT16
    # bfloat16 for the other ops, complex, unsigned 32+ bit: the ops do not take them
    where = f" by {op.qualified_name}" if op is not None else ""
    also = ""
    if dtype == torch.bfloat16:
        takers = sorted(o.qualified_name for o in _adapters.adapted_ops() if o.accepts_bfloat16)
        also = f" (bfloat16 is taken by {', '.join(takers)} only)" if takers else ""
    raise TypeError(f"cutopo.torch: tensors of dtype {dtype} are not supported{where}{also}; "
                    "convert them first, e.g. with .float()")


def _torch_dtype(dtype) -> torch.dtype:
    return _TORCH_OF[np.dtype(dtype)]


# ----------------------------------------------------------------------------- static arguments

class _Slot:
    """Marks a positional argument that is a tensor: ``index`` into the op's tensor list."""

    __slots__ = ("index",)

    def __init__(self, index: int):
        self.index = index


# Interned static configurations: key -> id, id -> (template, keyword arguments). A template
# holds one entry per positional argument: a _Slot for a tensor, else the value itself. Entries
# are never dropped: a compiled graph may refer to an id at any later time.
_STATIC_IDS: dict = {}
_STATICS: list = []


@torch.compiler.assume_constant_result
def _intern(name: str, slots: tuple, keywords: tuple, *values) -> int:
    """The id of a static configuration, interned on first sight.

    ``slots[i]`` is the tensor index of positional argument i (its entry in ``values`` is
    None), -1 when the next entry of ``values`` is its value, or -2 - n when it is a tuple
    whose n items are the next n entries; the keyword values follow the positional ones.
    Everything is passed as a flat list of plain values because torch.compile runs this
    function at trace time (``assume_constant_result``: it mutates module state, which dynamo
    would otherwise defer until after the graph that needs the id) and can hand it only values
    it can turn into constants (a tuple built during tracing, such as a shape, is not one).
    """
    positional, i = [], 0
    for s in slots:
        n = -2 - s if s <= -2 else 1
        positional.append(tuple(values[i:i + n]) if s <= -2 else values[i])
        i += n
    kw_values = values[i:]
    key = (name,
           tuple(("tensor", s) if s >= 0 else _adapters.freeze(v) for s, v in zip(slots, positional)),
           tuple((k, _adapters.freeze(v)) for k, v in zip(keywords, kw_values)))
    found = _STATIC_IDS.get(key)
    if found is None:
        found = len(_STATICS)
        template = tuple(_Slot(s) if s >= 0 else v for s, v in zip(slots, positional))
        _STATICS.append((template, dict(zip(keywords, kw_values))))
        _STATIC_IDS[key] = found
    return found


# ----------------------------------------------------------------------------- tensors <-> arrays

@contextlib.contextmanager
def _device_scope(tensors):
    """CuPy on the device and current torch stream of the first CUDA tensor (no-op on CPU)."""
    device = next((t.device for t in tensors if t.device.type == "cuda"), None)
    if device is None:
        yield
        return
    import cupy

    stream = torch.cuda.current_stream(device)
    with cupy.cuda.Device(device.index):
        # Stream.from_external is CuPy 14's spelling; ExternalStream the older one.
        if hasattr(cupy.cuda.Stream, "from_external") and hasattr(stream, "__cuda_stream__"):
            external = cupy.cuda.Stream.from_external(stream)
        else:
            external = cupy.cuda.ExternalStream(stream.cuda_stream, device.index)
        with external:
            yield


def _to_array(t: torch.Tensor, op: _adapters.AdaptedOp | None = None):
    """A NumPy (CPU) or CuPy (CUDA) view of the tensor's memory, strides kept.

    bfloat16 (for an ``op`` that accepts it) becomes an ``ml_dtypes.bfloat16`` array over the
    same memory: on the CPU through an int16 view of the tensor (NumPy has no bfloat16 of its
    own, so ``Tensor.numpy()`` refuses it), on CUDA through DLPack (:func:`_cupy_bfloat16`).
    """
    _numpy_dtype(t.dtype, op)  # a clear error for dtypes the op does not take
    t = t.detach()
    if t.device.type == "cpu":
        if t.dtype == torch.bfloat16:  # (same itemsize: views of any strides, 0-d included)
            return t.view(torch.int16).numpy().view(_BFLOAT16)
        return t.resolve_conj().resolve_neg().numpy()
    if t.device.type == "cuda":
        import cupy

        if t.dtype == torch.bfloat16:
            return _cupy_bfloat16(t)
        return cupy.from_dlpack(t)
    raise TypeError(f"cutopo.torch: tensors on device {t.device} are not supported (CPU or CUDA)")


def _cupy_bfloat16(t: torch.Tensor):
    """A CuPy ``ml_dtypes.bfloat16`` array over a CUDA bfloat16 tensor's memory (no copy).

    DLPack's own bfloat16 (``kDLBfloat``) first; when this CuPy does not import that, the
    tensor's bits as int16 through DLPack, viewed as bfloat16 in CuPy. A CuPy without bfloat16
    arrays refuses both: a TypeError says so.
    """
    import cupy

    try:
        direct = cupy.from_dlpack(t)
    except Exception:  # noqa: BLE001 - CuPy's error for kDLBfloat varies by version; see below
        direct = None
    if direct is not None and direct.dtype == _BFLOAT16:
        return direct
    # Errors of this import are not about bfloat16 (the device, the stream): let them through.
    bits = cupy.from_dlpack(t.view(torch.int16))
    try:
        return bits.view(_BFLOAT16)
    except Exception as exc:  # noqa: BLE001 - CuPy without bfloat16 arrays
        raise TypeError(f"cutopo.torch: CuPy {getattr(cupy, '__version__', '?')} takes no "
                        "bfloat16 arrays (neither through DLPack nor as a view of the tensor's "
                        "bits), so CUDA bfloat16 tensors cannot be passed; convert them first, "
                        "e.g. with .float(), or update CuPy") from exc


def _from_numpy(x: np.ndarray) -> torch.Tensor:
    """``torch.from_numpy``, also for ``ml_dtypes.bfloat16`` arrays (through an int16 view:
    the same memory)."""
    if _BFLOAT16 is not None and x.dtype == _BFLOAT16:
        return torch.from_numpy(x.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(x)


def _to_tensor(x, inputs) -> torch.Tensor:
    """The op's result as a contiguous tensor that shares no memory with the inputs.

    Contiguous because the fake kernels promise contiguous outputs to torch.compile; no sharing
    because a custom op's outputs may not alias its inputs. bfloat16 results come back as
    bfloat16 tensors, without copies (through int16 views of their bits).
    """
    if is_cupy_array(x):
        import cupy

        if not x.flags.c_contiguous:  # (ascontiguousarray would turn 0-d into 1-d)
            x = x.copy(order="C")
        if any(is_cupy_array(a) and cupy.may_share_memory(x, a) for a in inputs):
            x = x.copy()
        if _BFLOAT16 is not None and x.dtype == _BFLOAT16:
            # the bits as int16: no reliance on CuPy exporting DLPack's bfloat16
            return torch.from_dlpack(x.view(np.int16)).view(torch.bfloat16)
        return torch.from_dlpack(x)
    x = np.asarray(x)
    if not x.flags.c_contiguous:  # (ascontiguousarray would turn 0-d into 1-d)
        x = x.copy(order="C")
    if not x.flags.writeable or any(isinstance(a, np.ndarray) and np.may_share_memory(x, a)
                                    for a in inputs):
        x = x.copy()
    return _from_numpy(x)


def _arguments(template, arrays):
    return [arrays[v.index] if isinstance(v, _Slot) else v for v in template]


# ----------------------------------------------------------------------------- the generic adapter

_FORWARD_SCHEMA = "(Tensor[] tensors, int static) -> Tensor"
_VJP_SCHEMA = "(Tensor[] tensors, Tensor cotangent, int static, bool[] needs) -> Tensor[]"


def _define(op: _adapters.AdaptedOp):
    """Register ``cutopo::<name>`` (and ``cutopo::<name>_vjp``); return the forward op."""

    def forward_impl(tensors, static):
        template, kwargs = _STATICS[static]
        with _device_scope(tensors):
            arrays = [_to_array(t, op) for t in tensors]
            out = op.function(*_arguments(template, arrays), **kwargs)
            return _to_tensor(out, arrays)

    forward = torch.library.custom_op(f"{_LIBRARY}::{op.name}", forward_impl, mutates_args=(),
                                      schema=_FORWARD_SCHEMA)

    def abstract(tensors, template):
        specs = [_adapters.ArraySpec(tuple(t.shape), _numpy_dtype(t.dtype, op), _example(t.shape))
                 for t in tensors]
        return _arguments(template, specs)

    if op.meta is not None:
        def forward_fake(tensors, static):
            template, kwargs = _STATICS[static]
            shape, dtype = op.meta(*abstract(tensors, template), **kwargs)
            return tensors[0].new_empty(tuple(shape), dtype=_torch_dtype(dtype))

        forward.register_fake(forward_fake)

    if op.differentiable:
        _define_vjp(op, forward)
    return forward


def _example(shape):
    """The concrete sizes of a fake tensor whose shape is symbolic (dynamic shapes), for the
    shape rule's argument checks (:func:`cutopo._adapters.stand_in`): the example's sizes, read
    without a guard, so that the checks do not specialise the graph. None for a concrete shape,
    or where the sizes have no example value (the checks then use the symbolic sizes)."""
    if all(type(s) is int for s in shape):
        return None
    if _size_hint is None:
        return None
    try:
        return tuple(int(_size_hint(s)) for s in shape)
    except Exception:  # noqa: BLE001 - a size without an example value (unbacked)
        return None


def _slot_names(op, template):
    """Argument name of every tensor slot, in slot order."""
    return [name for name, v in zip(op.arg_names, template) if isinstance(v, _Slot)]


def _define_vjp(op, forward):
    def vjp_impl(tensors, cotangent, static, needs):
        template, kwargs = _STATICS[static]
        positions = [i for i, v in enumerate(template) if isinstance(v, _Slot)]
        wrt = [positions[k] for k, need in enumerate(needs) if need]
        with _device_scope(tensors):
            arrays = [_to_array(t, op) for t in tensors]
            g = _to_array(cotangent, op)
            _, pullback = _vjp(op.function, *_arguments(template, arrays), wrt=wrt, **kwargs)
            grads = pullback(g)
            result = []
            for k, need in enumerate(needs):
                if not need:
                    continue
                grad = grads[positions[k]]
                if grad is None:  # not expected: needs only holds arguments the op differentiates
                    grad = arrays[k] * 0
                result.append(_to_tensor(grad, arrays + [g]))
            return result

    vjp_op = torch.library.custom_op(f"{_LIBRARY}::{op.name}_vjp", vjp_impl, mutates_args=(),
                                     schema=_VJP_SCHEMA)

    if op.meta is not None:
        def vjp_fake(tensors, cotangent, static, needs):
            return [t.new_empty(tuple(t.shape)) for t, need in zip(tensors, needs) if need]

        vjp_op.register_fake(vjp_fake)

    # The VJPs are first-order: say so when autograd differentiates a backward (create_graph),
    # rather than torch's "no autograd formula was registered" for an internal op.
    def vjp_setup_context(ctx, inputs, output):
        pass

    def vjp_backward(ctx, *grads):
        raise NotImplementedError(
            f"cutopo.torch: {op.name} has no second derivative (its VJP is first-order): "
            "double backward and Hessian-vector products through cutopo ops are not supported")

    vjp_op.register_autograd(vjp_backward, setup_context=vjp_setup_context)

    def setup_context(ctx, inputs, output):
        tensors, static = inputs
        ctx.static = static
        ctx.save_for_backward(*tensors)

    def backward(ctx, cotangent):
        tensors = ctx.saved_tensors
        template, _ = _STATICS[ctx.static]
        asked = ctx.needs_input_grad[0]
        needs = [bool(a) and name in op.differentiable and t.is_floating_point()
                 for a, name, t in zip(asked, _slot_names(op, template), tensors)]
        if not any(needs):
            return [None] * len(tensors), None
        grads = iter(vjp_op(list(tensors), cotangent, ctx.static, needs))
        return [next(grads) if need else None for need in needs], None

    forward.register_autograd(backward, setup_context=setup_context)


def _static(value):
    """A static positional argument (``AdaptedOp.static_arguments``) as a graph constant:
    lists become tuples, and symbolic ints in them (torch.compile with dynamic shapes, e.g. a
    shape taken from a tensor) are made concrete (guarded)."""
    value = _adapters.static_value(value)
    if isinstance(value, tuple):
        # (under dynamo a symbolic int passes isinstance(e, int), as in _public's scalars)
        return tuple(_guard_scalar(e) if isinstance(e, (int, torch.SymInt)) and not isinstance(e, bool)
                     else e for e in value)
    return value


def _public(op: _adapters.AdaptedOp, forward):
    """The user-facing function: sorts the arguments into tensors and static values."""

    def function(*args, **kwargs):
        values, static = _adapters.bind(op, args, kwargs)
        tensors, slots, plain = [], [], []
        for name, v in zip(op.arg_names, values):
            if name in op.static_arguments:  # e.g. a grid's shape: a constant, never a tensor
                v = _static(v)
                if isinstance(v, tuple):  # item by item: see _intern
                    slots.append(-2 - len(v))
                    plain.extend(v)
                else:
                    slots.append(-1)
                    plain.append(v)
                continue
            if isinstance(v, (list, tuple)) and any(isinstance(e, torch.Tensor) for e in v):
                raise TypeError(f"cutopo.torch: {op.qualified_name} argument {name} is a sequence "
                                "of tensors, which the adapter does not pass; give one tensor")
            if isinstance(v, (np.ndarray, list, tuple)):
                v = _from_numpy(np.asarray(v))  # array-likes: constants to autograd
            if isinstance(v, torch.Tensor):
                if v.dtype not in _NUMPY_OF:
                    _numpy_dtype(v.dtype, op)  # bfloat16 for an op without it: a TypeError now
                slots.append(len(tensors))
                tensors.append(v)
                plain.append(None)
            else:
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    # Under torch.compile a Python scalar input may arrive symbolic; make it a
                    # constant of the graph (guarded: a new value recompiles).
                    v = _guard_scalar(v)
                slots.append(-1)
                plain.append(v)
        if not tensors:  # nothing to adapt: let the op report what is wrong with its arguments
            return torch.as_tensor(op.function(*values, **static))
        keywords = tuple(static)
        key = _intern(op.name, tuple(slots), keywords, *plain, *(static[k] for k in keywords))
        return forward(tensors, key)

    if op.meta is None:
        # Without a shape rule torch.compile cannot trace the op: leave it out of the graph.
        function = torch.compiler.disable(function)
    function.__name__ = function.__qualname__ = op.public_name
    function.__module__ = __name__ + (f".{op.family}" if op.family else "")
    function.__signature__ = inspect.signature(op.function)
    function.__doc__ = _docstring(op)
    return function


def _docstring(op) -> str:
    target = op.qualified_name
    return _adapters.docstring(
        op, f"PyTorch version of :func:`{target}`: torch tensors in, a torch tensor out.",
        f"Generated by :mod:`cutopo.torch` (custom op ``torch.ops.{_LIBRARY}.{op.name}``).",
        (" (tensors requiring grad); the other arguments get no gradient.", "Not differentiable (no VJP registered)."),
        f"""As for :func:`{target}`; arrays as torch tensors (CPU or CUDA; NumPy arrays
        and lists are converted, and get no gradient), other values (Python scalars such as a
        float ``scale`` or an int count, objects) as given: those are constants.""",
        ("torch.Tensor",
         f"""What :func:`{target}` returns, as a tensor of the same shape and dtype on the
         device of the first tensor argument."""),
        _EXAMPLES.get(op.name))


_EXAMPLES = {
    "soft_ecc": """
        >>> import torch, cutopo.torch as ct
        >>> image = torch.rand(2, 16, 16, requires_grad=True)
        >>> ct.soft_ecc(image, torch.linspace(0, 1, 8), 30.0, ndim=2).sum().backward()
        >>> image.grad.shape
        torch.Size([2, 16, 16])
        """,
    "soft_ect": """
        >>> import torch, cutopo.torch as ct
        >>> mask = torch.rand(16, 16) > 0.5
        >>> directions = torch.tensor([[1.0, 0.0], [0.6, 0.8]], requires_grad=True)
        >>> ct.soft_ect(mask, directions, 8, 10.0).shape
        torch.Size([2, 8])
        """,
    "expected_euler": """
        >>> import torch, cutopo.torch as ct
        >>> prob = torch.full((3, 3), 0.5, dtype=torch.float64, requires_grad=True)
        >>> ct.expected_euler(prob).backward()
        >>> prob.grad.shape
        torch.Size([3, 3])
        """,
    "cpab_integrate": """
        >>> import torch, cutopo.torch as ct
        >>> from cutopo.cpab import Tessellation
        >>> tess = Tessellation((4,))
        >>> theta = torch.tensor([0.2, 0.3, 0.1], dtype=torch.float64, requires_grad=True)
        >>> phi = ct.cpab.integrate(torch.tensor([[0.25], [0.5]], dtype=torch.float64), theta, tess)
        >>> phi.sum().backward()
        >>> theta.grad.shape
        torch.Size([3])
        """,
    "ecc": """
        >>> import torch, cutopo.torch as ct
        >>> ct.ecc(torch.tensor([[0, 2, 0], [2, 2, 2], [0, 2, 0]], dtype=torch.uint8), [0, 1, 2])
        tensor([4, 4, 1])
        """,
    "euler_contributions": """
        >>> import torch, cutopo.torch as ct
        >>> ct.euler_contributions(torch.tensor([[1.0, 0.0], [0.0, 1.0]]))
        tensor([[-1,  1],
                [ 1,  0]], dtype=torch.int8)
        """,
    "ect": """
        >>> import torch, cutopo.torch as ct
        >>> ring = torch.ones(3, 3, dtype=torch.bool)
        >>> ring[1, 1] = False
        >>> ct.ect(ring, torch.tensor([[1.0, 0.0]]), torch.tensor([-0.5, 0.5, 1.5]))
        tensor([[1, 1, 0]])
        """,
}


# ----------------------------------------------------------------------------- build the namespace

def _adapt(op: _adapters.AdaptedOp):
    """The torch function of one op: register its custom ops, wrap them."""
    return _public(op, _define(op))


_NAMESPACE = _adapters.Namespace(__name__, _adapt, "PyTorch")
_NAMESPACE.build()


def __getattr__(name):
    # ops registered after this module was imported (their modules loaded later)
    return _NAMESPACE.late(name)
