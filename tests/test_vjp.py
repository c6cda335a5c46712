"""The VJP mechanism itself, on a toy op registered here (the real ops test their own VJPs)."""
import numpy as np
import pytest

import cutopo
from cutopo.vjp import REGISTRY, register

CALLS = []


def _forward(x, k, a, *, power=2):
    return a * np.sum(x ** power, axis=-1), (x, a, power)


def _backward(res, g, needs):
    CALLS.append(needs)
    x, a, power = res
    dx = a * power * x ** (power - 1) * g[..., None] if needs[0] else None
    da = np.sum(g * np.sum(x ** power, axis=-1)) if needs[2] else None
    return dx, None, da


@register(name="toy_power_sum", forward=_forward, backward=_backward, arg_names=("x", "k", "a"),
          differentiable=("x", "a"))
def toy(x, k, a, *, power=2):
    return _forward(x, k, a, power=power)[0]


@pytest.fixture(scope="module", autouse=True)
def _unregister_toy():
    yield
    REGISTRY.pop("toy_power_sum", None)  # keep the registry to real ops for other tests


def test_registry_and_plain_forward(rng):
    x = rng.standard_normal((3, 4))
    assert REGISTRY["toy_power_sum"] is toy.__cutopo_op__
    np.testing.assert_allclose(toy(x, 1, 2.0, power=3), 2.0 * np.sum(x ** 3, axis=-1))


def test_pullback_values_types_and_needs(rng):
    x = rng.standard_normal((3, 4))
    k = np.arange(3)
    out, pullback = cutopo.vjp(toy, x, k, 1.5, power=3)
    g = rng.standard_normal(out.shape)
    dx, dk, da = pullback(g)
    np.testing.assert_allclose(dx, 1.5 * 3 * x ** 2 * g[:, None])
    assert dk is None  # integer array and declared non-differentiable
    assert isinstance(da, np.ndarray) and da.shape == () and da.dtype == out.dtype
    np.testing.assert_allclose(da, np.sum(g * np.sum(x ** 3, axis=-1)))
    assert CALLS[-1] == (True, False, True)


def test_pullback_does_not_keep_the_output_alive(rng):
    """The output can be freed while its pullback lives (the toy's residuals do not hold it):
    a large op's output is memory the caller may want back before the backward runs."""
    import gc
    import weakref

    x = rng.standard_normal((3, 4))
    out, pullback = cutopo.vjp(toy, x, 0, 2.0)
    ref = weakref.ref(out)
    del out
    gc.collect()
    assert ref() is None
    dx, _, _ = pullback(np.ones(3))
    np.testing.assert_allclose(dx, 2.0 * 2 * x)


def test_wrt_restricts_what_is_computed(rng):
    x = rng.standard_normal((2, 5)).astype(np.float32)
    out, pullback = cutopo.vjp(toy, x, 0, 2.0, wrt="x")
    dx, dk, da = pullback(np.ones_like(out))
    assert dx.dtype == np.float32 and dx.shape == x.shape and da is None
    assert CALLS[-1] == (True, False, False)
    _, pullback = cutopo.vjp(toy, x, 0, 2.0, wrt=(2,))
    assert pullback(np.ones_like(out))[0] is None and CALLS[-1] == (False, False, True)
    _, pullback = cutopo.vjp(toy, x, 0, 2.0, wrt=())
    assert pullback(np.ones_like(out)) == (None, None, None)


def test_errors(rng):
    x = rng.standard_normal((2, 3))
    with pytest.raises(TypeError, match="not a differentiable cutopo op"):
        cutopo.vjp(np.sum, x)
    with pytest.raises(TypeError, match="3 positional arguments"):
        cutopo.vjp(toy, x, 0)
    with pytest.raises(ValueError, match="wrt"):
        cutopo.vjp(toy, x, 0, 1.0, wrt="y")
    with pytest.raises(ValueError, match="wrt"):
        cutopo.vjp(toy, x, 0, 1.0, wrt=5)
    out, pullback = cutopo.vjp(toy, x, 0, 1.0)
    with pytest.raises(ValueError, match="shape"):
        pullback(np.ones(out.shape + (1,)))
    with pytest.raises(TypeError, match="dtype"):
        pullback(np.ones(out.shape, dtype=complex))
    with pytest.raises(ValueError, match="not positional"):
        register(name="bad", forward=_forward, backward=_backward, arg_names=("x",),
                 differentiable=("y",))


def test_is_float_dtype():
    from cutopo.vjp import is_float_dtype

    for dtype in (np.float16, np.float32, np.float64):
        assert is_float_dtype(dtype)
    for dtype in (np.int32, np.uint8, np.bool_, np.complex64, np.dtype("V4"), np.dtype([("a", "f4")])):
        assert not is_float_dtype(dtype)
    ml_dtypes = pytest.importorskip("ml_dtypes")
    assert is_float_dtype(ml_dtypes.bfloat16)
    assert np.dtype(ml_dtypes.bfloat16).kind == "V"  # why the name check is needed


@pytest.mark.parametrize("half", ["float16", "bfloat16"])
def test_half_precision_arguments_get_cotangents_of_their_dtype(rng, half):
    """The pullback casts each cotangent to its argument's dtype (bfloat16 included: NumPy
    kind "V") and takes a half-precision cotangent."""
    if half == "bfloat16":
        half = pytest.importorskip("ml_dtypes").bfloat16
    half = np.dtype(half)
    x = rng.standard_normal((3, 4)).astype(half)
    out, pullback = cutopo.vjp(toy, x, 0, 1.5)
    dx, dk, da = pullback(np.ones(out.shape, dtype=half))
    assert dx.dtype == half and dx.shape == x.shape and dk is None
    x32 = x.astype(np.float32)
    np.testing.assert_array_equal(dx, (1.5 * 2 * x32).astype(half))  # 3 x is exact in float32
    assert da.shape == () and CALLS[-1] == (True, False, True)


def _seq_forward(xs, a):
    return np.asarray(a * sum(np.sum(np.asarray(x, dtype=np.float64)) for x in xs)), (xs, a)


def _seq_backward(res, g, needs):
    xs, a = res
    dxs = [np.full(x.shape, a * g) for x in xs] if needs[0] else None  # float64 inside
    da = g * sum(np.sum(np.asarray(x, dtype=np.float64)) for x in xs) if needs[1] else None
    return dxs, da


@register(name="toy_sequence_sum", forward=_seq_forward, backward=_seq_backward,
          arg_names=("xs", "a"), differentiable=("xs", "a"))
def toy_sequence(xs, a):
    return _seq_forward(xs, a)[0]


def test_sequence_of_arrays_gets_a_sequence_of_cotangents(rng):
    try:
        xs = [rng.standard_normal((2, 3)), rng.standard_normal(4).astype(np.float32)]
        out, pullback = cutopo.vjp(toy_sequence, xs, 2.0)
        dxs, da = pullback(np.float64(1.0))
        assert isinstance(dxs, list) and len(dxs) == 2
        for d, x in zip(dxs, xs):
            assert d.shape == x.shape and d.dtype == x.dtype
            np.testing.assert_array_equal(d, np.full(x.shape, 2.0, dtype=x.dtype))
        dxs, _ = cutopo.vjp(toy_sequence, tuple(xs), 2.0)[1](np.float64(1.0))
        assert isinstance(dxs, tuple)
        # lists of numbers, empty lists and sequences holding an integer array stay constants
        for constant in ([1.0, 2.0], [], [np.arange(3)]):
            _, pullback = cutopo.vjp(toy_sequence, constant, 2.0)
            assert pullback(np.float64(1.0))[0] is None
    finally:
        REGISTRY.pop("toy_sequence_sum", None)


@pytest.mark.parametrize("x_dtype,a,a_dtype", [
    (np.float64, np.float32(1.5), np.float32),
    (np.float64, np.float16(1.5), np.float16),
    (np.float32, np.float64(1.5), np.float64),
    (np.float32, 1.5, np.float32),   # a Python float has no dtype: the output's
    (np.float64, 1.5, np.float64),
])
def test_scalar_cotangent_has_the_scalars_dtype(rng, x_dtype, a, a_dtype):
    """A NumPy scalar's cotangent is a 0-d array of its own dtype, not the output's."""
    x = rng.standard_normal((3, 4)).astype(x_dtype)
    out, pullback = cutopo.vjp(toy, x, 0, a)
    _, _, da = pullback(np.ones_like(out))
    assert isinstance(da, np.ndarray) and da.shape == () and da.dtype == a_dtype
    np.testing.assert_allclose(da, np.sum(x.astype(np.float64) ** 2), rtol=1e-3)


def test_soft_ecc_numpy_scale_cotangent_keeps_its_dtype(rng):
    image = rng.random((6, 6))  # float64: the curve and the image cotangent are float64
    out, pullback = cutopo.vjp(cutopo.soft_ecc, image, np.linspace(0, 1, 5), np.float32(4.0))
    d_image, d_t, d_scale = pullback(np.ones_like(out))
    assert out.dtype == d_image.dtype == d_t.dtype == np.float64
    assert d_scale.shape == () and d_scale.dtype == np.float32
    _, pullback = cutopo.vjp(cutopo.soft_ecc, image, 5, 4.0)  # Python float: the output's
    assert pullback(np.ones_like(out))[2].dtype == np.float64


def test_cotangent_on_another_device_is_refused():
    """A CuPy cotangent on another GPU than the output's raises a ValueError naming it (the
    backwards' kernels would read it on the output's device); empty arrays and NumPy outputs
    are not checked. Stand-ins for CuPy arrays: the check reads ``size`` and
    ``data.device_id``, as the kernel launches do."""
    from types import SimpleNamespace

    from cutopo.vjp import _check_cotangent_device

    def on(device, size=4):
        return SimpleNamespace(size=size, data=SimpleNamespace(device_id=device))

    _check_cotangent_device(on(1), 1, "toy")
    _check_cotangent_device(on(0, size=0), 1, "toy")
    _check_cotangent_device(np.ones(3), None, "toy")
    with pytest.raises(ValueError, match="cotangent lives on device 0, the output of toy on device 1"):
        _check_cotangent_device(on(0), 1, "toy")
