"""What the framework adapters (:mod:`cutopo.torch`, :mod:`cutopo.jax`) share.

This module imports neither framework. It lists the public ops that the adapters wrap (every op
of :data:`cutopo.vjp.REGISTRY`, plus the few non-differentiable ones below), with their shape
rules, how each batches over leading axes and which positional arguments are always static; it
turns static (non-array) arguments into hashable keys, and it writes the adapted functions'
docstrings.
"""
from __future__ import annotations

import dataclasses
import sys
import types
import importlib
import inspect
import warnings
from typing import Any, Callable, NamedTuple

import numpy as np

from ._checks import (check_boundary, check_connectivity, check_image, check_scale, check_thresholds,
                      is_count)

__all__ = ["ArraySpec", "AdaptedOp", "adapted_ops", "docstring", "freeze", "stand_in"]


class ArraySpec(NamedTuple):
    """Shape and NumPy dtype of an array argument, without data (what an op's ``meta`` sees).

    ``example_shape``: the concrete sizes of the example being traced when ``shape`` holds
    symbolic ones (``torch.compile`` with dynamic shapes), else None. A shape rule computes its
    result from ``shape`` and checks the arguments on :func:`stand_in` arrays, which take
    ``example_shape``: so the checks neither specialise nor guard the symbolic sizes.
    """

    shape: tuple
    dtype: np.dtype
    example_shape: tuple | None = None

    @property
    def ndim(self) -> int:
        return len(self.shape)


def stand_in(value, fill=0):
    """An array argument of a shape rule (an :class:`ArraySpec`, or any array) as a NumPy array
    of its shape and dtype holding ``fill`` everywhere, without data: a 0-d array broadcast with
    zero strides. A shape rule runs its op's own argument checks on such stand-ins, so that
    bad shapes, dtypes and options raise the op's errors when the adapters trace the op, before
    it runs. Other values (Python and NumPy scalars, ``None``, objects) are returned as given.

    The checks read the fill value, never the argument's data: pick a ``fill`` that passes the
    value checks (1 for a scale or directions, 0 for probabilities), and run only checks whose
    cost does not grow with the data, or grows only with a cheap pass over the stand-in.
    """
    if isinstance(value, np.generic) or not (hasattr(value, "shape") and hasattr(value, "dtype")):
        return value
    shape = getattr(value, "example_shape", None)
    if shape is None:
        shape = value.shape
    return np.broadcast_to(np.full((), fill, dtype=np.dtype(value.dtype)), tuple(shape))


# ----------------------------------------------------------------------------- shape rules
# The non-differentiable public ops have no OpSpec; their shape rules live here.
#
# The other keyword arguments (device, max_slab_bytes, ...) do not change the result's shape:
# the rules take them as ``**_``, so that a new option of an op does not break its adapters.
# Each rule first runs the op's checks that need no data, on stand-ins (``stand_in``), in the
# op's order: a bad argument raises the op's own error when the adapters trace the call.

def check_image_op(image, thresholds=None, *, ndim=None, connectivity=1, boundary="box",
                   scale=None):
    """The checks of an image op (ecc, euler_contributions, soft_ecc) that need no data, on
    stand-ins, in the ops' order: image, connectivity, boundary, (unless None) scale, of
    ones, and thresholds, a count checked against a 1-pixel image (no pass over the data).
    Returns (spatial ndim, threshold count T or None)."""
    blank, spatial = check_image(stand_in(image), ndim)
    check_connectivity(connectivity, spatial)
    check_boundary(boundary, blank, spatial)
    if scale is not None:
        check_scale(stand_in(scale, 1))
    if thresholds is None:
        return spatial, None
    check_thresholds(stand_in(thresholds), np.zeros(min(blank.size, 1), dtype=blank.dtype))
    return spatial, int(thresholds) if is_count(thresholds) else thresholds.shape[0]


def _ecc_meta(image, thresholds, *, ndim=None, connectivity=1, boundary="box", **_):
    spatial, T = check_image_op(image, thresholds, ndim=ndim, connectivity=connectivity,
                                boundary=boundary)
    return tuple(image.shape[:image.ndim - spatial]) + (T,), np.dtype(np.int64)


def _contributions_meta(image, *, ndim=None, connectivity=1, boundary="box", **_):
    check_image_op(image, ndim=ndim, connectivity=connectivity, boundary=boundary)
    return tuple(image.shape), np.dtype(np.int8)


def _ect_meta(mask, directions, thresholds, *, connectivity=1, boundary="box", **_):
    from ._ect import _prepare

    # directions of ones: the stand-in must pass the check that no direction is zero
    _, _, mask_b, _, spatial, _, _, _, _ = _prepare(
        "ect", stand_in(mask), stand_in(directions, 1), stand_in(thresholds), connectivity)
    check_boundary(boundary, mask_b, len(spatial))
    D, ndim = directions.shape
    T = int(thresholds) if is_count(thresholds) else thresholds.shape[0]
    return tuple(mask.shape[:mask.ndim - ndim]) + (D, T), np.dtype(np.int64)


# ----------------------------------------------------------------------------- static arguments
# Positional arguments that are always static values, never arrays, although they may look
# like array-likes (a tuple of ints): the adapters pass them to the op as given (a list as a
# tuple) instead of converting them to tensors or JAX arrays. By registry name.

_STATIC_ARGUMENTS = {
    "cpab_transform_grid": frozenset({"shape"}),   # the grid's size, which sets the output shape
    "cpab_compose_grid": frozenset({"shape"}),
}


# ----------------------------------------------------------------------------- bfloat16
# Ops that take bfloat16 arrays (``ml_dtypes.bfloat16``, what CuPy and JAX give bfloat16 arrays),
# by registry name. The adapters refuse bfloat16 for every other op with a TypeError of their own,
# before any work; an op that learns bfloat16 is added here.

_BFLOAT16_OPS = frozenset({"deformable_aggregation"})


# ----------------------------------------------------------------------------- batching rules
# ``native_batch(args, kwargs) -> (name, kwargs) or None``: when the op can take extra leading
# axes on argument ``name`` as a batch (the output then gains the same leading axes, every other
# argument being shared), the argument and the keyword arguments to use for such a call; None
# when it cannot (the adapter then loops). ``args`` maps argument names to values (ArraySpec for
# arrays), at their unbatched shapes.

def _leading(name, count_arg=None):
    def rule(args, kwargs):
        if count_arg is not None and is_count(args[count_arg]):
            return None  # a count means thresholds from the min and max of the whole batch
        if "ndim" in kwargs and kwargs["ndim"] is None:
            # ndim=None reads the spatial rank off the array; extra axes would change it
            kwargs = dict(kwargs, ndim=args[name].ndim)
        return name, kwargs
    return rule


_NATIVE_BATCH = {
    "ecc": _leading("image", "thresholds"),
    "euler_contributions": _leading("image"),
    "ect": _leading("mask"),
    "soft_ecc": _leading("image", "thresholds"),
    "soft_ect": _leading("mask"),
    "expected_euler": _leading("prob"),
}

# Public ops without a VJP: (module, name, positional argument names, shape rule).
_NON_DIFFERENTIABLE = (
    ("cutopo", "ecc", ("image", "thresholds"), _ecc_meta),
    ("cutopo", "euler_contributions", ("image",), _contributions_meta),
    ("cutopo", "ect", ("mask", "directions", "thresholds"), _ect_meta),
)

# Subpackages whose registered ops get a sub-namespace in the adapters (cutopo.torch.cpab).
_FAMILIES = ("cpab",)


@dataclasses.dataclass(frozen=True)
class AdaptedOp:
    """One public op as the adapters see it.

    ``name`` is unique (the registry name, e.g. ``"cpab_integrate"``); ``family`` and
    ``public_name`` say where the adapter exposes it (``cpab``, ``integrate``; family None means
    at the top level under ``name``).
    """

    name: str
    family: str | None
    public_name: str
    function: Callable
    arg_names: tuple[str, ...]
    differentiable: frozenset
    meta: Callable | None
    native_batch: Callable | None
    keyword_defaults: dict
    static_arguments: frozenset = frozenset()  # positional arguments never converted to arrays
    accepts_bfloat16: bool = False  # the op takes bfloat16 (ml_dtypes) arrays: _BFLOAT16_OPS

    @property
    def qualified_name(self) -> str:
        """``cutopo.<family>.<public_name>`` or ``cutopo.<name>``."""
        return f"cutopo.{self.family}.{self.public_name}" if self.family else f"cutopo.{self.name}"


def _keyword_defaults(function, arg_names) -> dict:
    params = inspect.signature(function).parameters
    positional = [p.name for p in params.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if tuple(positional) != tuple(arg_names):
        raise AssertionError(f"internal: {function.__name__} has positional arguments {positional}, "
                             f"the registry says {arg_names}")
    defaults = {}
    for p in params.values():
        if p.kind == p.KEYWORD_ONLY:
            if p.default is p.empty:
                raise AssertionError(f"internal: {function.__name__}: keyword {p.name} has no default")
            defaults[p.name] = p.default
    return defaults


def _locate(spec):
    """(family, public name) of a registered op: ``cutopo.<family>.<function name>`` for the ops
    of a family, else the registry name at the top level (the function's name for cutopo's own
    ops)."""
    module = getattr(spec.function, "__module__", "") or ""
    parts = module.split(".")
    if len(parts) >= 2 and parts[0] == "cutopo" and parts[1] in _FAMILIES:
        return parts[1], spec.function.__name__
    return None, spec.name


def adapted_ops() -> tuple[AdaptedOp, ...]:
    """Every public op the adapters wrap: the registry (after loading the op families) and the
    non-differentiable ops. Not cached: ops registered later appear on the next call."""
    from .vjp import REGISTRY

    for family in _FAMILIES:  # the families load lazily; their ops register on import
        importlib.import_module(f"cutopo.{family}")
    ops = []
    for spec in list(REGISTRY.values()):
        if spec.function is None:
            continue
        family, public = _locate(spec)
        try:
            defaults = _keyword_defaults(spec.function, spec.arg_names)
        except AssertionError as exc:  # one malformed registration must not break the adapters
            warnings.warn(f"cutopo adapters: leaving out {spec.name}: {exc}", RuntimeWarning,
                          stacklevel=2)
            continue
        ops.append(AdaptedOp(spec.name, family, public, spec.function, spec.arg_names,
                             spec.differentiable, spec.meta, _NATIVE_BATCH.get(spec.name),
                             defaults, _STATIC_ARGUMENTS.get(spec.name, frozenset()),
                             spec.name in _BFLOAT16_OPS))
    for module, name, arg_names, meta in _NON_DIFFERENTIABLE:
        function = getattr(importlib.import_module(module), name)
        ops.append(AdaptedOp(name, None, name, function, arg_names, frozenset(), meta,
                             _NATIVE_BATCH.get(name), _keyword_defaults(function, arg_names)))
    return tuple(ops)


def static_value(value):
    """A static positional argument as the op gets it: lists become tuples (hashable, so that
    the adapters can key compiled functions on them)."""
    return tuple(value) if isinstance(value, list) else value


def bind(op: AdaptedOp, args, kwargs):
    """(positional values in ``op.arg_names`` order, keyword values with defaults filled in).

    Plain Python rather than ``inspect.Signature.bind`` so that ``torch.compile`` traces it.
    """
    if len(args) > len(op.arg_names):
        raise TypeError(f"{op.qualified_name} takes {len(op.arg_names)} positional arguments "
                        f"({', '.join(op.arg_names)}), got {len(args)}")
    kwargs = dict(kwargs)
    values = list(args)
    for name in op.arg_names[len(args):]:
        if name not in kwargs:
            raise TypeError(f"{op.qualified_name} missing argument {name!r}")
        values.append(kwargs.pop(name))
    static = dict(op.keyword_defaults)
    for key, value in kwargs.items():
        if key not in static:
            if key in op.arg_names:
                raise TypeError(f"{op.qualified_name} got multiple values for argument {key!r}")
            raise TypeError(f"{op.qualified_name} got an unexpected keyword argument {key!r}")
        static[key] = value
    return values, static


# ----------------------------------------------------------------------------- docstrings

def _block(text: str, indent: str) -> str:
    """``text`` (indented as in the source: inspect.cleandoc) with every line after the first
    indented by ``indent`` (the first goes where the template puts it)."""
    return ("\n" + indent).join(inspect.cleandoc(text).splitlines())


def docstring(op: AdaptedOp, summary: str, about: str, grads: tuple[str, str], arrays: str,
              returns: tuple[str, str], example: str | None = None) -> str:
    """The numpydoc docstring of an adapter's function for ``op``.

    ``summary``: the first line; ``about``: the paragraph after it (how the adapter made the
    function), which goes on with "Differentiable in: <arguments>" and ``grads[0]`` for an op
    with a VJP, ``grads[1]`` for one without; ``arrays``: how the function takes the positional
    arguments; ``returns``: (type, description); ``example``: doctest lines, if any. The keyword
    arguments, when the op has some, are described as static, as for the op.
    """
    if op.differentiable:
        names = ", ".join(n for n in op.arg_names if n in op.differentiable)
        about += f" Differentiable in: {names}{grads[0]}"
    else:
        about += f" {grads[1]}"
    doc = f"""{summary}

    {_block(about, "    ")}

    Parameters
    ----------
    {", ".join(op.arg_names)}
        {_block(arrays, "        ")}
    """
    if op.keyword_defaults:
        doc += f"""{", ".join(op.keyword_defaults)}
        Keyword (static) arguments, as for :func:`{op.qualified_name}`.
    """
    doc += f"""
    Returns
    -------
    {returns[0]}
        {_block(returns[1], "        ")}
    """
    if example:
        doc += "\n    Examples\n    --------\n" + "".join(
            f"    {line}\n" for line in inspect.cleandoc(example).splitlines())
    return doc


# ----------------------------------------------------------------------------- static keys

_KEEP: dict[int, Any] = {}  # objects keyed by id(): kept alive so that their id is never reused


def freeze(value):
    """A hashable key that tells static argument values apart exactly.

    Python scalars are keyed with their type (``1``, ``1.0`` and ``True`` differ, as they do to
    the ops: a Python float scale is weakly typed, a NumPy float64 is not), NumPy scalars with
    their dtype, tuples element-wise; any other object (a Tessellation) by identity, and then
    kept alive for the life of the process.
    """
    if value is None or isinstance(value, (bool, int, float, complex, str)):
        return (type(value).__name__, value)
    if isinstance(value, np.generic):
        return ("numpy", value.dtype.str, value.item())
    if isinstance(value, tuple):
        return ("tuple",) + tuple(freeze(v) for v in value)
    _KEEP.setdefault(id(value), value)
    return ("object", id(value))


# ----------------------------------------------------------------------------- namespaces

class Namespace:
    """Fills an adapter module with one function per op, mirroring cutopo's layout.

    ``cutopo.<op>`` becomes ``<module>.<op>`` and ``cutopo.<family>.<op>`` becomes
    ``<module>.<family>.<op>`` (a sub-module, also importable as ``<module>.<family>``). Ops
    registered after the module was built (their modules imported later) are adapted on first
    access, through the modules' ``__getattr__``.

    Parameters
    ----------
    module_name : str
        The adapter module (``"cutopo.torch"``), already in ``sys.modules``.
    adapt : callable
        ``adapt(op: AdaptedOp) -> function``, the framework's generic adapter.
    framework : str
        For the sub-modules' docstrings (``"PyTorch"``).
    """

    def __init__(self, module_name: str, adapt: Callable, framework: str):
        self.module = sys.modules[module_name]
        self.adapt = adapt
        self.framework = framework
        self.families: dict = {}
        self.built: set = set()

    def build(self) -> None:
        for op in adapted_ops():
            self._install(op)

    def _install(self, op: AdaptedOp):
        function = self.adapt(op)
        self.built.add(op.name)
        if op.family is None:
            setattr(self.module, op.name, function)
            self.module.__all__.append(op.name)
            return function
        family = self.families.get(op.family)
        if family is None:
            name = f"{self.module.__name__}.{op.family}"
            family = types.ModuleType(name, f"{self.framework} versions of the ops of "
                                            f":mod:`cutopo.{op.family}` (see :mod:`{self.module.__name__}`).")
            family.__all__ = []
            family.__getattr__ = lambda attr, f=op.family: self.late(attr, f)
            self.families[op.family] = family
            sys.modules[name] = family  # so that ``import cutopo.torch.cpab`` works
            setattr(self.module, op.family, family)
            self.module.__all__.append(op.family)
        setattr(family, op.public_name, function)
        family.__all__.append(op.public_name)
        return function

    def late(self, attr: str, family: str | None = None):
        """The module ``__getattr__``: adapt an op registered since the module was built."""
        if not attr.startswith("__"):
            for op in adapted_ops():
                where = op.public_name if family else op.name
                if op.family == family and where == attr and op.name not in self.built:
                    return self._install(op)
        owner = self.module.__name__ + (f".{family}" if family else "")
        raise AttributeError(f"module {owner!r} has no attribute {attr!r}")
