"""The one vector-Jacobian-product mechanism of cutopo.

Every differentiable op registers, next to its public function, a ``forward`` that returns
``(output, residuals)`` and a ``backward`` that maps ``(residuals, cotangent, needs)`` to one
cotangent per positional argument. :func:`vjp` runs the forward and hands back the pullback;
calling the op directly is the plain forward. The framework adapters (PyTorch, JAX) are built
from :data:`REGISTRY`, so an op needs nothing else to become differentiable there.

Conventions
-----------
* Positional arguments are the arrays (and scalars) that may be differentiated; keyword
  arguments are static configuration and never receive cotangents.
* A cotangent has the shape, dtype and array type of its argument. Scalars get 0-d arrays of
  the output's array type: of the scalar's dtype for a NumPy scalar (``numpy.float32(4.0)``),
  of the output's floating dtype for a Python float (it has no dtype). An argument that is a
  list or tuple of floating arrays (such as per-level feature maps) gets a list or tuple of
  cotangents, one per array, each in that array's shape, dtype and array type. A list or tuple
  of Python numbers (``thresholds=[0.1, 0.5]``) is a constant and gets ``None``: pass an array
  to differentiate it.
* Floating means float16, float32, float64 and bfloat16 (``ml_dtypes.bfloat16``, the dtype
  CuPy and JAX use for bfloat16 arrays; NumPy files it under kind "V", not "f"):
  :func:`is_float_dtype`. Half-precision arguments are differentiated like the others: a
  backward may accumulate in float32 (the ops do), and the cotangent is rounded to the
  argument's dtype once, at the end (here, in the pullback).
* Arguments that cannot be differentiated (integer/bool arrays, arguments the op declares
  non-differentiable, or ones left out of ``wrt``) get ``None``, and the backward is told not
  to compute them (``needs``), so asking for fewer cotangents costs less.
* Residuals are kept small: a backward recomputes cheap quantities (such as the Euler
  contribution map) instead of storing them. Residuals refer to the arguments, not copies:
  modifying an argument in place between the forward and the pullback changes the cotangents.
"""
from __future__ import annotations

import dataclasses
import operator
from typing import Any, Callable

import numpy as np

from ._array import array_module, is_cupy_array

__all__ = ["vjp", "register", "OpSpec", "REGISTRY", "is_float_dtype"]


@dataclasses.dataclass(frozen=True)
class OpSpec:
    """How an op is differentiated.

    ``forward(*args, **kwargs) -> (out, residuals)``;
    ``backward(residuals, cotangent, needs) -> tuple`` with one entry per positional argument
    (``needs[i]`` False: entry i is ignored and may be None; a list or tuple of arrays for an
    argument that is one), in any floating dtype: :func:`vjp` casts each to its argument's.

    ``meta(*args, **kwargs) -> (shape, dtype)`` (optional) is the output's shape rule: array
    arguments arrive as objects with ``shape``, ``ndim`` and a NumPy ``dtype`` only (no data),
    the others as given. The framework adapters use it to declare the output before the op runs
    (``torch.compile``, ``jax.jit``): without one, :mod:`cutopo.torch` runs the op outside
    compiled graphs and :mod:`cutopo.jax` refuses it. ``function`` is the public op, filled in
    by :func:`register`.
    """

    name: str
    forward: Callable[..., tuple[Any, Any]]
    backward: Callable[[Any, Any, tuple[bool, ...]], tuple]
    arg_names: tuple[str, ...]
    differentiable: frozenset[str]
    meta: Callable[..., tuple[tuple[int, ...], np.dtype]] | None = None
    function: Callable | None = None


REGISTRY: dict[str, OpSpec] = {}


def register(*, name: str, forward, backward, arg_names, differentiable, meta=None):
    """Decorator: attach an :class:`OpSpec` to a public op and record it in :data:`REGISTRY`.

    ``meta`` is the optional shape/dtype rule of :class:`OpSpec`.
    """
    unknown = set(differentiable) - set(arg_names)
    if unknown:
        raise ValueError(f"{name}: differentiable arguments {sorted(unknown)} are not positional arguments")
    spec = OpSpec(name, forward, backward, tuple(arg_names), frozenset(differentiable), meta)

    def attach(fn):
        full = dataclasses.replace(spec, function=fn)
        fn.__cutopo_op__ = full
        REGISTRY[name] = full
        return fn

    return attach


# Floating dtypes that NumPy does not file under kind "f": ml_dtypes' bfloat16 is kind "V" (a
# user-defined dtype), and CuPy and JAX give their bfloat16 arrays that same NumPy dtype.
_OTHER_FLOAT_NAMES = frozenset({"bfloat16"})


def is_float_dtype(dtype) -> bool:
    """Whether ``dtype`` is a real floating dtype that cotangents can have: float16, float32,
    float64 (NumPy kind "f") or bfloat16 (``ml_dtypes.bfloat16``, kind "V")."""
    dtype = np.dtype(dtype)
    return dtype.kind == "f" or (dtype.kind == "V" and dtype.name in _OTHER_FLOAT_NAMES)


def _is_array(x) -> bool:
    return isinstance(x, np.ndarray) or is_cupy_array(x)


def _is_float_argument(x) -> bool:
    if getattr(getattr(x, "dtype", None), "kind", None) == "f":  # the usual case, decided first
        return True
    if isinstance(x, (bool, np.bool_)):
        return False
    if isinstance(x, (float, np.floating)):
        return True
    if isinstance(x, (list, tuple)):
        # a sequence of arrays (per-level feature maps); a list of Python numbers stays a
        # constant, as before (the ops turn it into an array of their own)
        return len(x) > 0 and all(_is_array(e) and is_float_dtype(e.dtype) for e in x)
    dtype = getattr(x, "dtype", None)
    return dtype is not None and is_float_dtype(dtype)


def _normalise_wrt(spec: OpSpec, wrt) -> set[int] | None:
    """The indices of the arguments in ``wrt``; None for all of them (``wrt=None``)."""
    if wrt is None:
        return None
    if isinstance(wrt, (str, int)):
        wrt = (wrt,)
    chosen = set()
    for w in wrt:
        if isinstance(w, str):
            if w not in spec.arg_names:
                raise ValueError(f"wrt: {spec.name} has no positional argument {w!r} "
                                 f"(arguments: {', '.join(spec.arg_names)})")
            chosen.add(spec.arg_names.index(w))
        else:
            i = operator.index(w)
            if not -len(spec.arg_names) <= i < len(spec.arg_names):
                raise ValueError(f"wrt: argument index {i} out of range for {spec.name}")
            chosen.add(i % len(spec.arg_names))
    return chosen


def _as_cotangent(g, like, name):
    """Cast a backward's result to the argument's shape, dtype and array type (element-wise for
    a list or tuple of arrays). Backwards accumulate half-precision arguments in float32: the
    cast here is the one rounding to the argument's dtype."""
    if isinstance(like, (float, np.floating, int)):
        return g
    if isinstance(like, (list, tuple)):
        if not isinstance(g, (list, tuple)) or len(g) != len(like):
            raise AssertionError(f"internal: cotangent of {name} must be a sequence of "
                                 f"{len(like)} arrays, got {type(g).__name__}")
        parts = [_as_cotangent(gi, li, f"{name}[{i}]") for i, (gi, li) in enumerate(zip(g, like))]
        return parts if isinstance(like, list) else tuple(parts)
    if type(g) is type(like) and g.dtype == like.dtype and g.shape == like.shape:
        return g  # already the argument's array type, dtype and shape (the usual case)
    xp = array_module(like)
    if xp is np and is_cupy_array(g):
        g = g.get()  # a host argument (e.g. NumPy thresholds) of an op run on the device
    g = xp.asarray(g)
    if g.shape != like.shape:
        raise AssertionError(f"internal: cotangent of {name} has shape {g.shape}, argument {like.shape}")
    return g.astype(like.dtype, copy=False)


def _check_cotangent_device(cotangent, device, name):
    """A CuPy cotangent must live on the device of the output (``device``; None: a NumPy or
    empty output, nothing to check): the backwards' kernels read it there, and some launch
    without checking their arguments again after a plan's first call."""
    if device is not None and cotangent.size and cotangent.data.device_id != device:
        raise ValueError(f"cotangent lives on device {cotangent.data.device_id}, the output of "
                         f"{name} on device {device}")


def vjp(op, *args, wrt=None, **kwargs):
    """Run ``op(*args, **kwargs)`` and return ``(out, pullback)``.

    Parameters
    ----------
    op : callable
        A differentiable cutopo op (one carrying an :class:`OpSpec`).
    *args
        The op's positional arguments.
    wrt : None, int, str or sequence of them, optional
        Positional arguments (by index or name) whose cotangents the pullback should compute;
        None means all differentiable ones. The others come back as None, uncomputed.
    **kwargs
        The op's keyword (static) arguments.

    Returns
    -------
    out : the op's output
    pullback : callable
        ``pullback(cotangent) -> tuple`` with one entry per positional argument: its cotangent
        (same shape, dtype and array type; a 0-d array for a scalar, of a NumPy scalar's dtype
        or, for a Python float, the output's; a list or tuple of cotangents for a list or
        tuple of arrays) or None. ``cotangent`` has the output's shape
        and a real dtype (bfloat16 included); it is cast to the output's dtype.

    Examples
    --------
    >>> import numpy as np, cutopo
    >>> image = np.random.default_rng(0).random((8, 8))
    >>> out, pullback = cutopo.vjp(cutopo.expected_euler, image)     # doctest: +SKIP
    >>> (d_image,) = pullback(np.ones_like(out))                     # doctest: +SKIP
    """
    spec = getattr(op, "__cutopo_op__", None)
    if spec is None:
        raise TypeError(f"{getattr(op, '__name__', op)!r} is not a differentiable cutopo op")
    if len(args) != len(spec.arg_names):
        raise TypeError(f"{spec.name} takes {len(spec.arg_names)} positional arguments "
                        f"({', '.join(spec.arg_names)}), got {len(args)}")
    chosen = None if wrt is None else _normalise_wrt(spec, wrt)
    out, residuals = spec.forward(*args, **kwargs)
    # which cotangents the pullback computes, decided once the forward's kernels are queued
    # (microseconds of host time that would delay its first launch otherwise)
    differentiable = spec.differentiable
    needs = tuple([(chosen is None or i in chosen) and name in differentiable
                   and _is_float_argument(a)
                   for i, (name, a) in enumerate(zip(spec.arg_names, args))])
    # The pullback keeps what it needs of the output, not the output: a caller that drops it
    # gets its memory back (a 2.2e9-trajectory integrate's is 17.7 GB).
    xp = array_module(out)
    out_is_cupy = xp is not np
    array_type, out_dtype, out_shape = xp.ndarray, out.dtype, out.shape
    out_device = out.data.device_id if out_is_cupy and out.size else None  # (None: no check)

    def pullback(cotangent):
        if (type(cotangent) is array_type and cotangent.dtype == out_dtype
                and cotangent.shape == out_shape):
            _check_cotangent_device(cotangent, out_device, spec.name)
            return _pull(cotangent)  # already the output's array type, dtype and shape
        if is_cupy_array(cotangent) != out_is_cupy:
            raise TypeError(f"cotangent must be a {'CuPy' if out_is_cupy else 'NumPy'} array like "
                            f"the output of {spec.name}")
        cotangent = xp.asarray(cotangent)
        _check_cotangent_device(cotangent, out_device, spec.name)
        if cotangent.shape != out_shape:
            raise ValueError(f"cotangent has shape {cotangent.shape}, the output of {spec.name} "
                             f"has shape {out_shape}")
        if cotangent.dtype.kind not in "iub" and not is_float_dtype(cotangent.dtype):
            raise TypeError(f"cotangent: dtype {cotangent.dtype} is not real")
        return _pull(cotangent.astype(out_dtype, copy=False))

    def _pull(cotangent):
        grads = spec.backward(residuals, cotangent, needs)
        if len(grads) != len(args):
            raise AssertionError(f"internal: {spec.name} backward returned {len(grads)} cotangents")
        result = []
        for need, g, a, name in zip(needs, grads, args, spec.arg_names):
            if not need:
                result.append(None)
            elif isinstance(a, (float, np.floating)):
                # a NumPy scalar keeps its own dtype; a Python float gets the output's
                dtype = a.dtype if isinstance(a, np.floating) else out_dtype
                if not (type(g) is array_type and g.dtype == dtype and g.shape == ()):
                    g = xp.asarray(g).astype(dtype, copy=False).reshape(())
                result.append(g)
            else:
                result.append(_as_cotangent(g, a, name))
        return tuple(result)

    return out, pullback
