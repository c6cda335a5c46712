"""The JAX adapter, cutopo.jax, on the CPU (GPU variants are marked ``gpu``).

Values must equal the NumPy ops exactly, and gradients cutopo.vjp's, eagerly and under jax.jit,
jax.grad and jax.vmap. Most tests run in x64 mode (float64 cases need it): the module turns it
on for its own tests and restores the previous setting afterwards, because it is a global flag.
"""
from __future__ import annotations

import sys

import numpy as np
import pytest

jax = pytest.importorskip("jax", reason="JAX is not installed (pip install 'cutopo[jax]')")
import jax.numpy as jnp  # noqa: E402

import cutopo  # noqa: E402
import cutopo.jax as cj  # noqa: E402
from adapter_cases import (cases, check_namespace, import_without, of_array_args, record_wrt,  # noqa: E402
                           resolve, run_docstring_examples, skip_without_cuda_kernel,
                           toy_backward, toy_forward, toy_meta)
from cutopo.cpab import Tessellation  # noqa: E402


@pytest.fixture(autouse=True)
def x64():
    """x64 on for each test (a global flag: restored afterwards, for the other test modules)."""
    previous = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    yield
    jax.config.update("jax_enable_x64", previous)


@pytest.fixture
def no_x64():
    jax.config.update("jax_enable_x64", False)
    yield


CASES = cases()


def to_jax(a):
    """NumPy arrays (and NumPy float scalars) become JAX arrays; other values stay as they are."""
    if isinstance(a, (np.ndarray, np.floating)):
        return jnp.asarray(np.asarray(a))
    return a


def call(case, transform=None):
    """The adapter's op on the case's arguments; ``transform`` wraps the function of the
    dynamic (array) arguments, e.g. jax.jit."""
    of_arrays, dyn = of_array_args(resolve(cj, case.path), case.args, case.kwargs)
    f = transform(of_arrays) if transform else of_arrays
    return f(*[jnp.asarray(case.args[i]) for i in dyn])


# ---------------------------------------------------------------------------------------------
# The namespace


def test_every_public_op_is_there_with_its_signature():
    check_namespace(cj)


def test_docstring_examples_of_the_cpab_namespace():
    """pytest's doctest collection does not reach cj.cpab.integrate: run its examples here."""
    run_docstring_examples(cj.cpab.integrate)


def test_import_without_jax_says_what_to_install(monkeypatch):
    with pytest.raises(ImportError, match=r"pip install 'cutopo\[jax\]'"):
        import_without(monkeypatch, "jax", "cutopo.jax")


# ---------------------------------------------------------------------------------------------
# Values


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_values_equal_the_numpy_op(case, jit):
    expected = case.function(*case.args, **case.kwargs)
    out = call(case, jax.jit if jit else None)
    assert out.dtype == expected.dtype and out.shape == expected.shape
    np.testing.assert_array_equal(np.asarray(out), expected)


@pytest.mark.parametrize("case", cases(float64=False), ids=lambda c: c.id)
def test_without_x64_float32_values_and_int32_curves(case, no_x64):
    expected = case.function(*case.args, **case.kwargs)
    out = call(case, jax.jit)
    assert out.shape == expected.shape
    assert out.dtype == (np.int32 if expected.dtype == np.int64 else expected.dtype)
    np.testing.assert_array_equal(np.asarray(out), expected)


def test_float64_without_x64_is_a_clear_error(no_x64):
    image = np.random.default_rng(0).random((6, 6))
    with pytest.raises(ValueError, match="jax_enable_x64"):
        cj.soft_ecc(image, jnp.linspace(0, 1, 4), 3.0)                 # a NumPy float64 array
    with pytest.raises(ValueError, match="jax_enable_x64"):
        cj.soft_ecc(jnp.asarray(image, jnp.float32), 4, np.float64(3.0))  # float64 result
    out = cj.soft_ecc(jnp.asarray(image, jnp.float32), [0.2, 0.5], 3.0)  # lists: JAX's rules
    assert out.dtype == jnp.float32


def test_static_and_keyword_arguments():
    rng = np.random.default_rng(1)
    image = rng.random((2, 7, 7)).astype(np.float32)
    t = np.linspace(0.1, 0.9, 4).astype(np.float32)
    for args, kwargs in [((image, 5, 9.0), {"ndim": 2}),
                         ((image, t, 9.0), {"ndim": 2, "connectivity": 2}),
                         ((image,), {"thresholds": t, "scale": np.float32(2.0), "ndim": 2})]:
        expected = cutopo.soft_ecc(*args, **kwargs)
        jargs = [to_jax(a) for a in args]
        jkw = {k: to_jax(v) for k, v in kwargs.items()}
        out = cj.soft_ecc(*jargs, **jkw)
        assert out.dtype == expected.dtype
        np.testing.assert_array_equal(np.asarray(out), expected)
    f = jax.jit(cj.soft_ecc, static_argnames=("ndim",))
    np.testing.assert_array_equal(np.asarray(f(jnp.asarray(image), jnp.asarray(t), 9.0, ndim=2)),
                                  cutopo.soft_ecc(image, t, np.float32(9.0), ndim=2))
    with pytest.raises(TypeError, match="unexpected keyword"):
        cj.soft_ecc(jnp.asarray(image), 5, 9.0, nd=2)
    with pytest.raises(TypeError, match="Python values"):  # a traced count cannot set a shape
        jax.jit(lambda x, n: cj.soft_ecc(x, n, 1.0, ndim=2))(jnp.asarray(image), 5)


# ---------------------------------------------------------------------------------------------
# Gradients


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("case", [c for c in CASES if c.differentiable], ids=lambda c: c.id)
def test_gradients_equal_cutopo_vjp(case, jit, rng):
    positions = case.grad_positions()
    fn = resolve(cj, case.path)
    expected_out = case.function(*case.args, **case.kwargs)
    cotangent = np.asarray(rng.standard_normal(expected_out.shape)).astype(expected_out.dtype)

    def loss(*diff):
        args = [to_jax(a) for a in case.args]
        for i, a in zip(positions, diff):
            args[i] = a
        return jnp.sum(fn(*args, **case.kwargs) * cotangent)

    grad = jax.grad(loss, argnums=tuple(range(len(positions))))
    if jit:
        grad = jax.jit(grad)
    grads = grad(*[to_jax(case.args[i]) for i in positions])
    expected = case.vjp_reference(cotangent)
    for i, g in zip(positions, grads):
        assert g.dtype == np.asarray(case.args[i]).dtype and g.shape == np.shape(case.args[i])
        np.testing.assert_allclose(np.asarray(g), expected[i], rtol=1e-12, atol=0)


def test_bfloat16_arguments_get_bfloat16_gradients():
    """JAX's bfloat16 (ml_dtypes, NumPy kind "V") is a floating dtype to cutopo.vjp: the
    features' gradient is bfloat16 and equals cutopo.vjp's, eagerly and under jit."""
    rng = np.random.default_rng(14)
    sh, st = np.array([[[4, 5], [2, 3]]]), np.array([[0, 20]])
    feats = jnp.asarray(rng.standard_normal((1, 26, 4)), jnp.bfloat16)
    loc = jnp.asarray(rng.uniform(0.1, 0.9, (1, 3, 2, 1, 2)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((1, 3, 2, 1, 2, 2)), jnp.float32)
    loss = lambda f, lo: jnp.sum(cj.deformable_aggregation(f, sh, st, lo, w))  # noqa: E731
    _, pullback = cutopo.vjp(cutopo.deformable_aggregation, np.asarray(feats), sh, st,
                             np.asarray(loc), np.asarray(w))
    expected = pullback(np.ones((1, 3, 4), np.float32))
    for grad in (jax.grad(loss, argnums=(0, 1)), jax.jit(jax.grad(loss, argnums=(0, 1)))):
        d_feats, d_loc = grad(feats, loc)
        assert d_feats.dtype == jnp.bfloat16 and d_loc.dtype == jnp.float32
        np.testing.assert_array_equal(np.asarray(d_feats), expected[0])
        np.testing.assert_array_equal(np.asarray(d_loc), expected[3])


def test_only_the_differentiated_arguments_are_computed(monkeypatch):
    seen = record_wrt(monkeypatch, cj)
    image = jnp.asarray(np.random.default_rng(2).random((8, 8)))
    t = jnp.linspace(0, 1, 5)
    scale = jnp.float64(10.0)
    f = lambda x, y, s: jnp.sum(cj.soft_ecc(x, y, s))  # noqa: E731
    jax.grad(f, argnums=1)(image, t, scale)
    assert seen[-1] == (1,)
    jax.jit(jax.grad(f, argnums=(0, 2)))(image, t, scale)
    assert seen[-1] == (0, 2)


def test_weakly_typed_scale_does_not_widen_and_gets_a_gradient():
    image = jnp.asarray(np.random.default_rng(3).random((8, 8)), jnp.float32)
    t = jnp.linspace(0, 1, 5, dtype=jnp.float32)
    f = lambda s: jnp.sum(cj.soft_ecc(image, t, s))  # noqa: E731
    assert jax.jit(lambda s: cj.soft_ecc(image, t, s))(7.0).dtype == jnp.float32
    g = jax.grad(f)(7.0)
    _, pullback = cutopo.vjp(cutopo.soft_ecc, np.asarray(image), np.asarray(t), 7.0)
    np.testing.assert_allclose(float(g), float(pullback(np.ones(5, np.float32))[2]), rtol=1e-6)


def test_non_differentiable_arguments_and_ops_get_zeros():
    mask = jnp.asarray(np.random.default_rng(4).random((8, 8)) > 0.5)
    dirs = jnp.array([[0.8, 0.3], [0.2, -0.9]])
    g = jax.grad(lambda d: jnp.sum(cj.soft_ect(mask, d, 6, 4.0)))(dirs)
    assert g.shape == (2, 2) and bool(jnp.all(jnp.isfinite(g)))
    image = jnp.asarray(np.random.default_rng(5).random((6, 6)))
    # an integer curve in a loss contributes nothing (and does not break differentiation)
    f = lambda x: jnp.sum(cj.soft_ecc(x, 4, 3.0)) + jnp.sum(cj.ecc(x, 4)) * 0.0  # noqa: E731
    np.testing.assert_allclose(np.asarray(jax.grad(f)(image)),
                               np.asarray(jax.grad(lambda x: jnp.sum(cj.soft_ecc(x, 4, 3.0)))(image)))


def test_grad_in_float64_matches_finite_differences():
    """jax.grad of the adapter against central differences of the NumPy op (x64)."""
    rng = np.random.default_rng(6)
    image = rng.random((6, 5))
    t = np.linspace(0.05, 0.95, 6)
    direction = rng.standard_normal(image.shape)
    f = lambda x: jnp.sum(cj.soft_ecc(x, jnp.asarray(t), 6.0) ** 2)  # noqa: E731
    g = np.asarray(jax.grad(f)(jnp.asarray(image)))
    eps = 1e-6
    fd = (np.sum(cutopo.soft_ecc(image + eps * direction, t, 6.0) ** 2)
          - np.sum(cutopo.soft_ecc(image - eps * direction, t, 6.0) ** 2)) / (2 * eps)
    np.testing.assert_allclose(np.sum(g * direction), fd, rtol=1e-6)


@pytest.mark.parametrize("case_id", ["grid_sample-2d-f64", "deformable-f64", "cpab-grid-f64",
                                     "cpab-image-f64"])
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_grad_of_sampling_and_warps_matches_finite_differences(case_id, jit):
    """jax.grad (reverse mode) of grid_sample, deformable_aggregation and the CPAB warps against
    central differences (x64; the cases keep sample points off the bilinear kinks)."""
    from jax.test_util import check_grads

    case = next(c for c in CASES if c.id == case_id)
    positions = case.grad_positions()
    fn = resolve(cj, case.path)

    def f(*diff):
        args = [to_jax(a) for a in case.args]
        for i, d in zip(positions, diff):
            args[i] = d
        return fn(*args, **case.kwargs)

    check_grads(jax.jit(f) if jit else f, tuple(jnp.asarray(case.args[i]) for i in positions),
                order=1, modes=("rev",), eps=1e-6)


def test_transform_grid_shape_is_static():
    """The grid's shape is a static argument (a tuple or list of ints), never a JAX array."""
    theta, tess, shape = next(c for c in CASES if c.id == "cpab-grid-f64").args
    expected = cutopo.cpab.transform_grid(theta, tess, shape, n_steps=8)
    th = jnp.asarray(theta)
    for s in (shape, list(shape)):
        np.testing.assert_array_equal(np.asarray(cj.cpab.transform_grid(th, tess, s, n_steps=8)),
                                      expected)
        f = jax.jit(lambda t, s=s: cj.cpab.transform_grid(t, tess, s, n_steps=8))
        np.testing.assert_array_equal(np.asarray(f(th)), expected)


def test_a_newly_registered_op_is_adapted_generically():
    """A toy op registered after cutopo.jax was imported is adapted on first access; with a
    shape rule it works under jit, grad and vmap (looping: it has no native batching rule)."""
    from cutopo.vjp import REGISTRY, register

    @register(name="toy_jax_adapter", forward=toy_forward, backward=toy_backward,
              arg_names=("x", "w", "a"), differentiable=("x", "a"), meta=toy_meta)
    def toy(x, w, a, *, power=2):
        return toy_forward(x, w, a, power=power)[0]

    try:
        fn = cj.toy_jax_adapter
        rng = np.random.default_rng(13)
        x, w = rng.random((3, 4)), rng.random((3, 4))
        loss = lambda x, w, a: jnp.sum(fn(x, w, a, power=3) ** 2)  # noqa: E731
        gx, gw, ga = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(jnp.asarray(x), jnp.asarray(w),
                                                               jnp.float64(1.5))
        out = 1.5 * np.sum(x ** 3 * w, axis=-1)
        np.testing.assert_allclose(np.asarray(gx), 2 * out[:, None] * 4.5 * x ** 2 * w, rtol=1e-12)
        assert not np.any(np.asarray(gw))  # not differentiated by the op: zero
        np.testing.assert_allclose(float(ga), np.sum(2 * out * out / 1.5), rtol=1e-12)
        v = jax.vmap(lambda x: fn(x, jnp.asarray(w), 2.0))(jnp.asarray(np.stack([x, 2 * x])))
        np.testing.assert_allclose(np.asarray(v[1]), 4 * toy(x, w, 2.0), rtol=1e-12)
    finally:
        REGISTRY.pop("toy_jax_adapter", None)


# ---------------------------------------------------------------------------------------------
# Bad arguments: the op's own errors (type and message), eagerly and, for shapes, under jit


def _bad_shape_calls():
    """(op path, NumPy arguments, keywords) whose shapes, dtypes or static values the op refuses:
    its shape rule refuses them too, without data."""
    rng = np.random.default_rng(14)
    image = rng.random((6, 7))
    t = np.linspace(0.1, 0.9, 4)
    mask = rng.random((6, 7)) > 0.5
    dirs = np.array([[0.8, 0.3], [-0.4, 0.7]])
    feats, shapes, starts, loc, weights = next(c for c in CASES if c.id == "deformable-f64").args
    picture, theta, tess = next(c for c in CASES if c.id == "cpab-image-f64").args
    grid_image, grid = next(c for c in CASES if c.id == "grid_sample-2d-f64").args
    return [
        pytest.param("expected_euler", (np.full(4, 0.5),), {}, id="expected_euler-rank"),
        pytest.param("expected_euler", (np.zeros((3, 3), np.int32),), {}, id="expected_euler-dtype"),
        pytest.param("soft_ecc", (image, t, -1.0), {}, id="soft_ecc-scale"),
        pytest.param("soft_ecc", (image, np.ones((2, 2)), 1.0), {}, id="soft_ecc-thresholds-rank"),
        pytest.param("soft_ecc", (image, t, 1.0), {"connectivity": 5}, id="soft_ecc-connectivity"),
        pytest.param("soft_ecc", (image[:2, :2], t, 1.0), {"boundary": "periodic"},
                     id="soft_ecc-periodic-small"),
        pytest.param("soft_ecc", (image, 0, 1.0), {}, id="soft_ecc-count-0"),
        pytest.param("soft_ect", (mask, dirs[0], 5, 2.0), {}, id="soft_ect-directions-rank"),
        pytest.param("ecc", (image[0], t), {}, id="ecc-rank"),
        pytest.param("euler_contributions", (image,), {"ndim": 4}, id="contributions-ndim"),
        pytest.param("ect", (mask[0], dirs, t), {}, id="ect-mask-rank"),
        pytest.param("deformable_aggregation", (feats[0], shapes, starts, loc, weights), {},
                     id="deformable-features-rank"),
        pytest.param("deformable_aggregation", (feats, shapes, starts, loc[0, 0, 0, 0], weights),
                     {}, id="deformable-locations-rank"),
        pytest.param("deformable_aggregation", (feats, shapes, starts, loc, weights[..., :1].repeat(3, -1)),
                     {}, id="deformable-groups"),
        pytest.param("deformable_aggregation", (feats, shapes, starts[:1], loc, weights), {},
                     id="deformable-starts-shape"),
        pytest.param("grid_sample", (grid_image[0], grid), {}, id="grid_sample-image-rank"),
        pytest.param("grid_sample", (grid_image, grid), {"mode": "cubic"}, id="grid_sample-mode"),
        pytest.param("cpab.integrate", (rng.random((5, 3)), theta, tess), {}, id="integrate-points"),
        pytest.param("cpab.transform_grid", (theta[:-1], tess, (4, 5)), {}, id="grid-theta"),
        pytest.param("cpab.transform_grid", (theta, tess, (4, 5, 6)), {}, id="grid-shape"),
        pytest.param("cpab.transform_image", (picture[0], theta, tess), {}, id="image-rank"),
        pytest.param("cpab.transform_image", (picture, theta, tess), {"mode": "cubic"},
                     id="image-mode"),
        pytest.param("cpab.compose", (rng.random((5, 2)), theta, tess), {}, id="compose-thetas"),
        pytest.param("cpab.compose_grid", (np.stack([theta, theta]), tess, (4,)), {},
                     id="compose_grid-shape"),
        pytest.param("cpab.compose_image", (picture, np.stack([theta[:-1]] * 2), tess), {},
                     id="compose_image-thetas"),
    ]


def _bad_value_calls():
    """Calls whose arguments only the op, reading their values, can refuse."""
    feats, shapes, starts, loc, weights = next(c for c in CASES if c.id == "deformable-f64").args
    bad_starts = starts.copy()
    bad_starts[1, 1] = 10 ** 6  # a map past the end of features
    grid_image, grid = next(c for c in CASES if c.id == "grid_sample-2d-f64").args
    nan_grid = grid.copy()
    nan_grid[0, 0, 0, 0] = np.nan
    return [
        pytest.param("expected_euler", (np.full((3, 3), 1.5),), {}, id="expected_euler-range"),
        pytest.param("soft_ecc", (np.full((4, 4), 0.3), np.array([0.5, 0.1]), 2.0), {},
                     id="soft_ecc-unsorted"),
        pytest.param("deformable_aggregation", (feats, shapes, bad_starts, loc, weights), {},
                     id="deformable-starts-values"),
        pytest.param("grid_sample", (grid_image, nan_grid), {}, id="grid_sample-nan"),
    ]


def _numpy_error(path, args, kwargs):
    """The exception the NumPy op raises for these arguments."""
    with pytest.raises(Exception) as info:
        resolve(cutopo, path)(*args, **kwargs)
    assert isinstance(info.value, (TypeError, ValueError)), info.value
    return info.value


def _of_arrays(path, args, kwargs):
    """(function of the array arguments, those arguments as JAX arrays)."""
    of_arrays, dyn = of_array_args(resolve(cj, path), args, kwargs)
    return of_arrays, [jnp.asarray(args[i]) for i in dyn]


@pytest.mark.parametrize("path, args, kwargs", _bad_shape_calls() + _bad_value_calls())
def test_bad_arguments_raise_the_ops_error_eagerly(path, args, kwargs, caplog):
    """Eager calls raise the NumPy op's exception itself: its type and message (which names the
    argument), not JAX's JaxRuntimeError of a failed callback, and nothing is logged."""
    expected = _numpy_error(path, args, kwargs)
    fn, arrays = _of_arrays(path, args, kwargs)
    with pytest.raises(type(expected)) as info:
        jax.block_until_ready(fn(*arrays))
    assert type(info.value) is type(expected) and str(info.value) == str(expected)
    assert not [r for r in caplog.records if r.levelno >= 40], caplog.text


@pytest.mark.parametrize("path, args, kwargs", _bad_shape_calls())
def test_bad_shapes_raise_the_ops_error_while_tracing_under_jit(path, args, kwargs):
    """Shapes, dtypes and static values are checked by the shape rule: jax.jit raises the op's
    exception while tracing (``lower`` runs nothing), not a JaxRuntimeError when it runs."""
    expected = _numpy_error(path, args, kwargs)
    fn, arrays = _of_arrays(path, args, kwargs)
    with pytest.raises(type(expected)) as info:
        jax.jit(fn).lower(*arrays)
    assert type(info.value) is type(expected) and str(info.value) == str(expected)


@pytest.mark.parametrize("transform", ["grad", "vmap"])
@pytest.mark.parametrize("path, args, kwargs", _bad_value_calls())
def test_bad_values_raise_the_ops_error_under_eager_grad_and_vmap(path, args, kwargs, transform):
    """Without jit the op runs in a callback during the call: its exception comes through."""
    expected = _numpy_error(path, args, kwargs)
    fn, arrays = _of_arrays(path, args, kwargs)
    floats = [i for i, a in enumerate(arrays) if a.dtype.kind == "f"]
    if transform == "grad":
        run = jax.grad(lambda x: jnp.sum(fn(*arrays[:floats[0]], x, *arrays[floats[0] + 1:])))
        call = lambda: run(arrays[floats[0]])  # noqa: E731
    else:
        batched = [jnp.stack([a, a]) for a in arrays]
        call = lambda: jax.vmap(fn)(*batched)  # noqa: E731
    with pytest.raises(type(expected)) as info:
        jax.block_until_ready(call())
    assert str(info.value) == str(expected)


def test_bad_values_under_jit_fail_when_the_computation_runs():
    """Under jax.jit only the compiled computation reads values: the op's error surfaces as
    JAX's report of the failed callback (a JaxRuntimeError; from JAX's C++ dispatch, once the
    executable is cached, a ValueError), whose message ends with the op's (documented)."""
    expected = _numpy_error("expected_euler", (np.full((3, 3), 1.5),), {})
    f = jax.jit(cj.expected_euler)
    for _ in range(2):
        with pytest.raises((jax.errors.JaxRuntimeError, ValueError)) as info:
            jax.block_until_ready(f(jnp.full((3, 3), 1.5)))
        assert "CpuCallback" in str(info.value) and str(expected) in str(info.value)


def test_a_count_given_as_an_array_is_named_only_when_it_is_the_problem():
    image = jnp.asarray(np.random.default_rng(15).random((6, 6)))
    f = jax.jit(lambda x, n: cj.soft_ecc(x, n, 1.0, ndim=2))
    with pytest.raises(TypeError, match="thresholds is a 0-d integer JAX array.*Python values"):
        f(image, 5)
    with pytest.raises(ValueError, match="image: ndim=2") as info:  # the image's error, as it is
        f(image[0], 5)
    assert "count" not in str(info.value)


# ---------------------------------------------------------------------------------------------
# vmap


def _spy_forward(monkeypatch):
    shapes = []
    real = cj._Runner.forward

    def spy(self, *arrays):
        shapes.append([a.shape for a in arrays])
        return real(self, *arrays)

    monkeypatch.setattr(cj._Runner, "forward", spy)
    return shapes


def test_vmap_over_images_is_one_native_call(monkeypatch):
    shapes = _spy_forward(monkeypatch)
    rng = np.random.default_rng(7)
    batch = rng.random((2, 3, 9, 9))
    t = jnp.linspace(0.1, 0.9, 6)
    f = jax.jit(jax.vmap(jax.vmap(lambda x: cj.soft_ecc(x, t, 15.0))))
    out = f(jnp.asarray(batch))
    assert len(shapes) == 1 and shapes[0][0] == (2, 3, 9, 9)  # one call, the whole batch
    np.testing.assert_array_equal(np.asarray(out),
                                  cutopo.soft_ecc(batch, np.asarray(t), 15.0, ndim=2))
    probs = rng.random((4, 5, 5))
    e = jax.vmap(cj.expected_euler)(jnp.asarray(probs))
    np.testing.assert_array_equal(np.asarray(e), cutopo.expected_euler(probs, ndim=2))


@pytest.mark.parametrize("case", [c for c in CASES if c.path != "cpab.integrate"
                                  and isinstance(c.args[0], np.ndarray)], ids=lambda c: c.id)
def test_vmap_over_the_first_argument_equals_a_loop(case):
    """Batch the first argument (image, mask, prob) with jax.vmap: each result must equal the
    op on that item (a count's thresholds are per item: the adapter loops then)."""
    first = case.args[0]
    stack = np.stack([first, first[::-1].copy()])
    fn = resolve(cj, case.path)
    out = jax.vmap(lambda x: fn(x, *[to_jax(a) for a in case.args[1:]], **case.kwargs))(
        jnp.asarray(stack))
    for k in range(2):
        expected = case.function(stack[k], *case.args[1:], **case.kwargs)
        np.testing.assert_array_equal(np.asarray(out[k]), expected)


def test_vmap_over_shared_arguments_loops(monkeypatch):
    shapes = _spy_forward(monkeypatch)
    rng = np.random.default_rng(8)
    image = rng.random((8, 8))
    ts = np.sort(rng.random((3, 5)), axis=1)
    scales = np.array([3.0, 5.0, 9.0])
    out = jax.jit(jax.vmap(lambda t, s: cj.soft_ecc(jnp.asarray(image), t, s)))(
        jnp.asarray(ts), jnp.asarray(scales))
    assert len(shapes) == 1 and shapes[0][0] == (1, 8, 8)
    for k in range(3):
        np.testing.assert_array_equal(np.asarray(out[k]),
                                      cutopo.soft_ecc(image, ts[k], np.float64(scales[k])))


@pytest.mark.parametrize("argnum", [0, 1, 2])
def test_vmap_of_grad_gives_per_example_gradients(argnum):
    rng = np.random.default_rng(9)
    images = rng.random((3, 7, 7))
    t = np.linspace(0.1, 0.9, 5)
    scale = np.float64(8.0)

    def loss(x, y, s):
        return jnp.sum(cj.soft_ecc(x, y, s) ** 2)

    g = jax.jit(jax.vmap(jax.grad(loss, argnums=argnum), in_axes=(0, None, None)))(
        jnp.asarray(images), jnp.asarray(t), jnp.asarray(scale))
    for k in range(3):
        out, pullback = cutopo.vjp(cutopo.soft_ecc, images[k], t, scale)
        np.testing.assert_allclose(np.asarray(g[k]), pullback(2 * out)[argnum], rtol=1e-12)


def test_vmap_grad_of_cpab_and_soft_ect():
    tess = Tessellation((2, 2))
    thetas = tess.sample(3, length_scale=0.4, rng=3)
    points = np.random.default_rng(10).uniform(0.1, 0.9, (4, 2))
    f = lambda th: jnp.sum(cj.cpab.integrate(jnp.asarray(points), th, tess, n_steps=6) ** 2)  # noqa
    g = jax.vmap(jax.grad(f))(jnp.asarray(thetas))
    for k in range(3):
        out, pullback = cutopo.vjp(cutopo.cpab.integrate, points, thetas[k], tess, n_steps=6)
        np.testing.assert_allclose(np.asarray(g[k]), pullback(2 * out)[1], rtol=1e-12)
    mask = np.random.default_rng(11).random((7, 7)) > 0.5
    dirs = np.array([[[0.8, 0.3]], [[0.2, -0.9]]])
    h = jax.vmap(jax.grad(lambda d: jnp.sum(cj.soft_ect(jnp.asarray(mask), d, 5, 3.0))))(
        jnp.asarray(dirs))
    for k in range(2):
        out, pullback = cutopo.vjp(cutopo.soft_ect, mask, dirs[k], 5, 3.0)
        np.testing.assert_allclose(np.asarray(h[k]), pullback(np.ones_like(out))[1], rtol=1e-12)


# ---------------------------------------------------------------------------------------------
# The buffer_callback path (the GPU design) with NumPy views on the CPU


@pytest.mark.skipif(cj._buffer_callback is None, reason="jax.experimental.buffer_callback missing")
def test_buffer_callback_path_on_the_cpu(monkeypatch):
    monkeypatch.setattr(cj, "_CPU_CALLBACK", "buffer")
    rng = np.random.default_rng(12)
    images = rng.random((2, 8, 8))
    t = np.linspace(0.1, 0.9, 5)

    def loss(x, y):
        return jnp.sum(cj.soft_ecc(x, y, 9.0) ** 2)

    g = jax.jit(jax.vmap(jax.grad(loss, argnums=(0, 1)), in_axes=(0, None)))(
        jnp.asarray(images), jnp.asarray(t))
    for k in range(2):
        out, pullback = cutopo.vjp(cutopo.soft_ecc, images[k], t, 9.0)
        ref = pullback(2 * out)
        np.testing.assert_allclose(np.asarray(g[0][k]), ref[0], rtol=1e-12)
        np.testing.assert_allclose(np.asarray(g[1][k]), ref[1], rtol=1e-12)


# ---------------------------------------------------------------------------------------------
# GPU (skipped without one, and without a CUDA build of JAX)


def _jax_gpu():
    try:
        return jax.default_backend() == "gpu"
    except Exception:
        return False


@pytest.mark.gpu
@pytest.mark.skipif(not _jax_gpu(), reason="JAX has no GPU backend")
@pytest.mark.parametrize("case", [c for c in CASES if c.path != "cpab.integrate"], ids=lambda c: c.id)
def test_gpu_values_and_gradients_match_the_numpy_path(case):
    skip_without_cuda_kernel(case)
    expected = case.function(*case.args, **case.kwargs)
    out = call(case, jax.jit)
    assert out.devices().pop().platform == "gpu" and out.dtype == expected.dtype
    if expected.dtype.kind == "f":
        np.testing.assert_allclose(np.asarray(out), expected, rtol=1e-5, atol=1e-4)
    else:
        np.testing.assert_array_equal(np.asarray(out), expected)
    positions = case.grad_positions()
    if positions:
        fn = resolve(cj, case.path)

        def loss(*diff):
            args = [to_jax(a) for a in case.args]
            for i, a in zip(positions, diff):
                args[i] = a
            return jnp.sum(fn(*args, **case.kwargs))

        grads = jax.jit(jax.grad(loss, argnums=tuple(range(len(positions)))))(
            *[to_jax(case.args[i]) for i in positions])
        expected_grads = case.vjp_reference(np.ones_like(expected))
        for i, g in zip(positions, grads):
            np.testing.assert_allclose(np.asarray(g), expected_grads[i], rtol=1e-4, atol=1e-3)


@pytest.mark.gpu
@pytest.mark.skipif(not _jax_gpu(), reason="JAX has no GPU backend")
def test_gpu_buffers_reach_cupy_without_copies(monkeypatch):
    import cupy

    pointers = []
    real = cj._Runner.forward

    def spy(self, *arrays):
        assert all(isinstance(a, cupy.ndarray) for a in arrays)
        pointers.append(arrays[0].data.ptr)
        return real(self, *arrays)

    monkeypatch.setattr(cj._Runner, "forward", spy)
    x = jax.device_put(jnp.ones((64, 64), jnp.float32))
    out = cj.expected_euler(x)
    out.block_until_ready()
    assert pointers and pointers[0] == x.unsafe_buffer_pointer()


@pytest.mark.gpu
@pytest.mark.skipif(not _jax_gpu(), reason="JAX has no GPU backend")
def test_gpu_runs_on_xlas_stream_in_a_subprocess():
    """The JAX + CuPy process must exit cleanly (a crash at exit was once seen)."""
    import subprocess

    code = ("import jax, jax.numpy as jnp, cutopo.jax as cj\n"
            "x = jax.random.uniform(jax.random.PRNGKey(0), (4, 128, 128))\n"
            "t = jnp.linspace(0, 1, 32)\n"
            "g = jax.jit(jax.grad(lambda x: cj.soft_ecc(x, t, 20.0, ndim=2).sum()))(x)\n"
            "assert bool(jnp.isfinite(g).all())\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
