"""Calls of every public op, and the checks, shared by the PyTorch and JAX adapter tests.

Each case is an op path (``"soft_ecc"``, ``"cpab.integrate"``), NumPy positional arguments
(arrays and plain values) and keyword arguments. The adapters must reproduce the NumPy op
exactly on them, and their gradients must equal :func:`cutopo.vjp`'s.
"""
from __future__ import annotations

import dataclasses
import doctest
import functools
import importlib
import inspect
import sys

import numpy as np

import cutopo
from cutopo.cpab import Tessellation

# Every public op the adapters wrap, by path (cutopo.<path>).
OP_PATHS = ("soft_ecc", "soft_ect", "expected_euler", "cpab.integrate", "ecc",
            "euler_contributions", "ect", "grid_sample", "deformable_aggregation",
            "cpab.transform_grid", "cpab.transform_image")


@dataclasses.dataclass
class Case:
    path: str
    args: tuple
    kwargs: dict
    id: str

    @property
    def function(self):
        return resolve(cutopo, self.path)

    @property
    def differentiable(self) -> bool:
        return hasattr(self.function, "__cutopo_op__")

    def grad_positions(self):
        """Positions of the arguments that the op differentiates: float arrays, and NumPy float
        scalars (the adapter tests pass those as 0-d arrays, which the ops treat alike)."""
        spec = getattr(self.function, "__cutopo_op__", None)
        if spec is None:
            return []
        return [i for i, (name, a) in enumerate(zip(spec.arg_names, self.args))
                if name in spec.differentiable and isinstance(a, (np.ndarray, np.floating))
                and np.asarray(a).dtype.kind == "f"]

    def vjp_reference(self, cotangent):
        """cutopo.vjp's cotangents of every argument (NumPy float scalars passed as 0-d arrays,
        as the adapter tests pass them)."""
        args = [np.asarray(a) if isinstance(a, np.floating) else a for a in self.args]
        _, pullback = cutopo.vjp(self.function, *args, **self.kwargs)
        return pullback(cotangent)


def resolve(module, path):
    return functools.reduce(getattr, path.split("."), module)


def of_array_args(fn, args, kwargs):
    """(function of the array arguments, their positions in ``args``): ``fn(*args, **kwargs)``
    with the NumPy arrays among ``args`` replaced, in order, by the function's arguments (a
    framework's arrays, so that its transformations see them as inputs)."""
    dyn = [i for i, a in enumerate(args) if isinstance(a, np.ndarray)]

    def of_arrays(*arrays):
        full = list(args)
        for i, a in zip(dyn, arrays):
            full[i] = a
        return fn(*full, **kwargs)

    return of_arrays, dyn


def skip_without_cuda_kernel(case):
    """Skip the calling (GPU) test when the op refuses CuPy arrays (NotImplementedError: no
    CUDA kernel yet). Asked of the op itself, so that a kernel added later is tested at once."""
    import cupy
    import pytest

    args = [cupy.asarray(a) if isinstance(a, np.ndarray) else a for a in case.args]
    try:
        case.function(*args, **case.kwargs)
    except NotImplementedError as exc:
        pytest.skip(f"{case.path} has no CUDA kernel: {exc}")


def cases(float64=True):
    """The cases; ``float64=False`` keeps only those whose arrays and results are float32/int
    (for JAX without x64)."""
    rng = np.random.default_rng(20240607)  # fixed: the cases must not sit on ties (see below)
    image = rng.random((10, 11))
    images32 = rng.random((2, 9, 8)).astype(np.float32)
    volume = rng.random((5, 6, 4))
    mask = rng.random((9, 10)) > 0.4
    masks = rng.random((2, 7, 7)) > 0.5
    # Generic directions: no two pixel heights tie, so the contribution maps are locally constant.
    dirs = np.array([[0.83, 0.31], [-0.42, 0.77], [0.15, -0.91]])
    tess = Tessellation((3, 3))
    theta = tess.sample(1, length_scale=0.3, rng=1)[0]
    points = rng.uniform(0.05, 0.95, (6, 2))
    tess1 = Tessellation((4,), zero_boundary=None)
    out = [
        Case("soft_ecc", (image, np.linspace(0.05, 0.95, 9), 20.0), {}, "soft_ecc-2d-f64"),
        Case("soft_ecc", (images32, 6, 15.0), {"ndim": 2}, "soft_ecc-batch-count-f32"),
        Case("soft_ecc", (images32, np.linspace(0.1, 0.9, 5).astype(np.float32),
                          np.float32(12.0)), {"ndim": 2, "connectivity": 2}, "soft_ecc-batch-T-f32"),
        Case("soft_ecc", (volume, np.linspace(0.0, 1.0, 7), np.float64(9.0)), {"connectivity": 3},
             "soft_ecc-3d-T-f64"),
        Case("soft_ecc", (image, np.linspace(0.05, 0.95, 9), 20.0), {"boundary": "periodic"},
             "soft_ecc-2d-periodic-f64"),
        Case("soft_ect", (mask, dirs, np.linspace(-1.2, 1.2, 8), 6.0), {}, "soft_ect-f64"),
        Case("soft_ect", (masks, dirs.astype(np.float32), 7, 5.0), {"connectivity": 2},
             "soft_ect-batch-count-f32"),
        Case("expected_euler", (image,), {}, "expected_euler-f64"),
        Case("expected_euler", (images32,), {"ndim": 2, "connectivity": 2}, "expected_euler-batch-f32"),
        Case("cpab.integrate", (points, theta, tess), {"n_steps": 12}, "cpab-2d-f64"),
        Case("cpab.integrate", (rng.uniform(0.05, 0.95, (2, 5, 1)).astype(np.float32),
                                np.array([0.3, -0.2, 0.4, 0.1, 0.2], dtype=np.float32), tess1),
             {"n_steps": 8, "checkpoint_every": 3}, "cpab-1d-batch-f32"),
        Case("ecc", ((image * 255).astype(np.uint8), 5), {}, "ecc-uint8-count"),
        Case("ecc", (images32, np.linspace(0, 1, 6).astype(np.float32)), {"ndim": 2, "connectivity": 2},
             "ecc-batch-f32"),
        Case("euler_contributions", (image,), {"connectivity": 2}, "contributions"),
        Case("ect", (mask, dirs.astype(np.float32), np.linspace(-1, 1, 5).astype(np.float32)), {},
             "ect"),
        Case("ect", (masks, dirs.astype(np.float32), 4), {"connectivity": 2}, "ect-batch-count"),
        Case("ect", (mask, dirs.astype(np.float32), np.linspace(-1, 1, 5).astype(np.float32)),
             {"boundary": "periodic"}, "ect-periodic"),
        *_sampling_cases(rng, tess, theta),
    ]
    if float64:
        return out
    return [c for c in out if not _wide(c)]


def _sampling_cases(rng, tess, theta):
    """grid_sample, deformable_aggregation and the CPAB warps (small: the adapters' tests call
    them many times). Sample points avoid pixel centres and image edges (kinks of the bilinear
    interpolant), so finite differences of these cases see one smooth piece."""
    image = rng.standard_normal((2, 3, 5, 6))
    grid = np.stack([_off_centre(rng, (2, 4, 3), (6,)), _off_centre(rng, (2, 4, 3), (5,))], axis=-1)
    volume = rng.standard_normal((1, 2, 3, 4, 5)).astype(np.float32)
    grid3 = rng.uniform(-1.1, 1.1, (1, 2, 3, 2, 3)).astype(np.float32)
    # deformable: 2 cameras, 2 scales, C 4 in 2 groups; flat maps camera-major
    shapes = np.array([[[4, 5], [2, 3]], [[3, 4], [2, 2]]], dtype=np.int64)
    pix = shapes[..., 0] * shapes[..., 1]
    starts = (np.cumsum(pix.reshape(-1)) - pix.reshape(-1)).reshape(2, 2)
    feats = rng.standard_normal((2, int(pix.sum()), 4))
    loc = np.stack([_off_centre(rng, (2, 3, 2, 2), (5, 3, 4, 2), unit=True),   # u against W
                    _off_centre(rng, (2, 3, 2, 2), (4, 2, 3), unit=True)], axis=-1)  # v against H
    loc[0, 0, 0, 1] = (1.3, 0.5)  # outside camera 1: contributes nothing
    weights = rng.standard_normal((2, 3, 2, 2, 2, 2))
    picture = rng.random((1, 2, 6, 5))
    return [
        Case("grid_sample", (image, grid), {}, "grid_sample-2d-f64"),
        Case("grid_sample", (image[:1].astype(np.float32), grid[:1].astype(np.float32)),
             {"padding_mode": "border", "align_corners": True}, "grid_sample-2d-border-f32"),
        Case("grid_sample", (volume, grid3), {"padding_mode": "reflection"}, "grid_sample-3d-f32"),
        Case("deformable_aggregation", (feats, shapes, starts, loc, weights), {},
             "deformable-f64"),
        Case("deformable_aggregation", (feats.astype(np.float32), shapes, starts,
                                        loc.astype(np.float32), weights.astype(np.float32)),
             {"boundary": "zeros"}, "deformable-zeros-f32"),
        Case("cpab.transform_grid", (theta, tess, (4, 5)), {"n_steps": 8}, "cpab-grid-f64"),
        Case("cpab.transform_grid", (np.stack([theta, -theta]).astype(np.float32), tess, (3, 4)),
             {"n_steps": 6}, "cpab-grid-batch-f32"),
        Case("cpab.transform_image", (picture, theta, tess), {"n_steps": 8}, "cpab-image-f64"),
        Case("cpab.transform_image", (picture.astype(np.float32), theta.astype(np.float32), tess),
             {"n_steps": 6, "padding_mode": "zeros"}, "cpab-image-zeros-f32"),
    ]


def _off_centre(rng, shape, sizes, unit=False, margin=0.15):
    """Coordinates t in (0.05, 0.95) of the image width whose pixel position t n - 1/2 stays
    ``margin`` pixel from every pixel centre on axes of each of the ``sizes`` n: as
    deformable_aggregation's u, v (``unit``), or as grid_sample's 2 t - 1 (align_corners
    False)."""
    t = np.empty(int(np.prod(shape)))
    todo = np.arange(t.size)
    while todo.size:
        t[todo] = rng.uniform(0.05, 0.95, todo.size)
        frac = np.stack([(t[todo] * n - 0.5) % 1.0 for n in sizes])
        todo = todo[~np.all((frac > margin) & (frac < 1 - margin), axis=0)]
    t = t.reshape(shape)
    return t if unit else 2 * t - 1


def _wide(case) -> bool:
    """Whether the case involves float64 (arrays, NumPy scalars or the result)."""
    if any(getattr(a, "dtype", None) == np.float64 for a in case.args):
        return True
    return np.asarray(case.function(*case.args, **case.kwargs)).dtype == np.float64


# ---------------------------------------------------------------------------------------------
# Checks of an adapter module (cutopo.torch, cutopo.jax)


def check_namespace(adapter):
    """Every public op is in the adapter module with cutopo's signature and a docstring, every
    registered op of cutopo (also one added later) is adapted, and the cpab sub-namespace is an
    importable module."""
    for path in OP_PATHS:
        fn = resolve(adapter, path)
        assert inspect.signature(fn) == inspect.signature(resolve(cutopo, path)), path
        assert fn.__doc__ and "Returns" in fn.__doc__
    assert set(adapter.__all__) >= {p.split(".")[0] for p in OP_PATHS}
    from cutopo.vjp import REGISTRY

    for spec in REGISTRY.values():
        if not spec.function.__module__.startswith("cutopo."):
            continue  # toy ops of other tests
        family = spec.function.__module__.split(".")[1]
        where = getattr(adapter, family) if family in ("cpab",) else adapter
        assert callable(getattr(where, spec.function.__name__)), spec.name
    cpab = importlib.import_module(f"{adapter.__name__}.cpab")
    assert cpab.integrate is adapter.cpab.integrate


def run_docstring_examples(fn):
    """Run the examples of ``fn``'s docstring (pytest's doctest collection does not reach the
    adapters' generated sub-namespaces); all must pass, and there must be some."""
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    for test in doctest.DocTestFinder().find(fn, fn.__name__, globs={}):
        runner.run(test)
    assert runner.tries > 0 and runner.failures == 0


def import_without(monkeypatch, framework, adapter_name):
    """Import the adapter module afresh as if ``framework`` were not installed (monkeypatch
    restores both modules afterwards)."""
    monkeypatch.setitem(sys.modules, framework, None)  # makes "import <framework>" raise ImportError
    monkeypatch.delitem(sys.modules, adapter_name)
    return importlib.import_module(adapter_name)


def record_wrt(monkeypatch, adapter):
    """A list to which every call of the adapter's ``_vjp`` (its cutopo.vjp) adds its ``wrt``
    tuple: which arguments the backward asked cotangents for."""
    seen = []
    real = adapter._vjp

    def spy(op, *args, wrt=None, **kwargs):
        seen.append(tuple(wrt))
        return real(op, *args, wrt=wrt, **kwargs)

    monkeypatch.setattr(adapter, "_vjp", spy)
    return seen


# A toy op for the registration tests: a * sum(x**power * w, axis=-1), differentiable in x and a
# (not in w, a float argument all the same).


def toy_forward(x, w, a, *, power=2):
    return a * np.sum(x ** power * w, axis=-1), (x, w, a, power)


def toy_backward(res, g, needs):
    x, w, a, power = res
    dx = a * power * x ** (power - 1) * w * g[..., None] if needs[0] else None
    da = np.sum(g * np.sum(x ** power * w, axis=-1)) if needs[2] else None
    return dx, None, da


def toy_meta(x, w, a, *, power=2):
    return tuple(x.shape[:-1]), np.result_type(x.dtype, w.dtype)
