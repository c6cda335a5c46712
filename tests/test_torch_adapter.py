"""The PyTorch adapter, cutopo.torch, on the CPU (GPU variants are marked ``gpu``).

Values must equal the NumPy ops exactly, gradients must equal cutopo.vjp's, and
torch.autograd.gradcheck must pass in float64; torch.compile must trace the ops without graph
breaks.
"""
from __future__ import annotations

import shutil
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed (pip install 'cutopo[torch]')")

import cutopo  # noqa: E402
import cutopo.torch as ct  # noqa: E402
from adapter_cases import (cases, check_namespace, import_without, of_array_args,  # noqa: E402
                           record_wrt, resolve, run_docstring_examples, skip_without_cuda_kernel,
                           toy_backward, toy_forward)
from cutopo.cpab import Tessellation  # noqa: E402

CASES = cases()


def to_torch(a, requires_grad=False):
    """NumPy arrays and NumPy float scalars become tensors; other values stay as they are."""
    if isinstance(a, (np.ndarray, np.floating)):
        t = torch.from_numpy(np.array(a))
        return t.requires_grad_() if requires_grad else t
    return a


# ---------------------------------------------------------------------------------------------
# The namespace


def test_every_public_op_is_there_with_its_signature():
    check_namespace(ct)


def test_importing_cutopo_imports_neither_torch_nor_jax():
    code = ("import sys, numpy, cutopo, cutopo.cpab; cutopo.soft_ecc(numpy.ones((3, 3)), 2, 1.0); "
            "assert 'torch' not in sys.modules and 'jax' not in sys.modules, "
            "[m for m in sys.modules if m in ('torch', 'jax')]")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_docstring_examples_of_the_cpab_namespace():
    """pytest's doctest collection does not reach ct.cpab.integrate: run its examples here."""
    run_docstring_examples(ct.cpab.integrate)


def test_import_without_torch_says_what_to_install(monkeypatch):
    with pytest.raises(ImportError, match=r"pip install 'cutopo\[torch\]'"):
        import_without(monkeypatch, "torch", "cutopo.torch")


# ---------------------------------------------------------------------------------------------
# Values and gradients against the NumPy path


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_values_equal_the_numpy_op(case):
    expected = case.function(*case.args, **case.kwargs)
    out = resolve(ct, case.path)(*[to_torch(a) for a in case.args], **case.kwargs)
    assert isinstance(out, torch.Tensor)
    assert out.numpy().dtype == expected.dtype and out.shape == expected.shape
    np.testing.assert_array_equal(out.numpy(), expected)


@pytest.mark.parametrize("case", [c for c in CASES if c.differentiable], ids=lambda c: c.id)
def test_gradients_equal_cutopo_vjp(case, rng):
    positions = case.grad_positions()
    args = [to_torch(a, requires_grad=i in positions) for i, a in enumerate(case.args)]
    out = resolve(ct, case.path)(*args, **case.kwargs)
    cotangent = np.asarray(rng.standard_normal(out.shape)).astype(out.detach().numpy().dtype)
    grads = torch.autograd.grad(out, [args[i] for i in positions], torch.from_numpy(cotangent))
    expected = case.vjp_reference(cotangent)
    for i, g in zip(positions, grads):
        assert g.dtype == args[i].dtype and g.shape == args[i].shape
        np.testing.assert_array_equal(g.numpy(), expected[i])


@pytest.mark.parametrize("case", [c for c in CASES if c.differentiable], ids=lambda c: c.id)
def test_second_derivatives_are_refused_by_name(case, rng):
    """create_graph=True gives the first-order gradients unchanged; differentiating them again
    raises NotImplementedError naming the op (was torch's message about an internal op)."""
    positions = case.grad_positions()
    args = [to_torch(a, requires_grad=i in positions) for i, a in enumerate(case.args)]
    out = resolve(ct, case.path)(*args, **case.kwargs)
    cotangent = np.asarray(rng.standard_normal(out.shape)).astype(out.detach().numpy().dtype)
    grads = torch.autograd.grad(out, [args[i] for i in positions], torch.from_numpy(cotangent),
                                create_graph=True)
    expected = case.vjp_reference(cotangent)
    for i, g in zip(positions, grads):
        np.testing.assert_array_equal(g.detach().numpy(), expected[i])
    with pytest.raises(NotImplementedError, match="has no second derivative"):
        torch.autograd.grad(sum(g.float().sum() for g in grads), [args[i] for i in positions])


def test_only_the_needed_gradients_are_computed(monkeypatch):
    """The backward asks cutopo.vjp only for the tensors that require grad (ctx.needs_input_grad)."""
    seen = record_wrt(monkeypatch, ct)
    image = torch.rand(8, 8, dtype=torch.float64)
    t = torch.linspace(0, 1, 5, dtype=torch.float64, requires_grad=True)
    scale = torch.tensor(10.0, dtype=torch.float64)
    ct.soft_ecc(image, t, scale).sum().backward()
    assert seen[-1] == (1,)
    image.requires_grad_()
    scale.requires_grad_()
    t.requires_grad_(False)
    ct.soft_ecc(image, t, scale).sum().backward()
    assert seen[-1] == (0, 2)


def test_a_newly_registered_op_is_adapted_generically():
    """A toy op registered like the real ones, after cutopo.torch was imported: w is a float
    argument the op does not differentiate (its gradient is None), and without a shape rule it
    runs outside torch.compile's graph instead of failing."""
    from cutopo.vjp import REGISTRY, register

    @register(name="toy_torch_adapter", forward=toy_forward, backward=toy_backward,
              arg_names=("x", "w", "a"), differentiable=("x", "a"))
    def toy(x, w, a, *, power=2):
        return toy_forward(x, w, a, power=power)[0]

    try:
        fn = ct.toy_torch_adapter  # registered after cutopo.torch was built: adapted on access
        assert fn.__name__ == "toy_torch_adapter" and "x, w, a" in fn.__doc__
        x = torch.rand(3, 4, dtype=torch.float64, requires_grad=True)
        w = torch.rand(3, 4, dtype=torch.float64, requires_grad=True)
        a = torch.tensor(1.5, dtype=torch.float64, requires_grad=True)
        out = fn(x, w, a, power=3)
        torch.testing.assert_close(out, 1.5 * (x ** 3 * w).sum(-1), rtol=1e-14, atol=0)
        dx, dw, da = torch.autograd.grad(out.sum(), [x, w, a], allow_unused=True)
        assert dw is None
        torch.testing.assert_close(dx, 4.5 * x.detach() ** 2 * w.detach())
        torch.testing.assert_close(da, (x.detach() ** 3 * w.detach()).sum())
        compiled = torch.compile(lambda x: fn(x, w, 2.0).sum() * 2, backend="aot_eager")
        torch.testing.assert_close(compiled(x), 2 * fn(x, w, 2.0).sum())
    finally:
        REGISTRY.pop("toy_torch_adapter", None)


def test_non_differentiable_arguments_get_no_gradient():
    mask = torch.rand(8, 8) > 0.5  # bool: cannot require grad; the op does not differentiate it
    dirs = torch.tensor([[0.8, 0.3], [0.2, -0.9]], dtype=torch.float64, requires_grad=True)
    (d_dirs,) = torch.autograd.grad(ct.soft_ect(mask, dirs, 6, 4.0).sum(), [dirs])
    assert d_dirs.shape == (2, 2)
    # integer outputs of the non-differentiable ops carry no graph
    image = torch.rand(6, 6, requires_grad=True)
    assert not ct.ecc(image, 4).requires_grad
    assert not ct.ect(mask, dirs, 4).requires_grad


def test_static_arguments_pass_through():
    rng = np.random.default_rng(3)
    image = rng.random((2, 7, 7)).astype(np.float32)
    ti = torch.from_numpy(image)
    thresholds = np.linspace(0.1, 0.9, 4)                          # NumPy: converted, no grad
    for args, kwargs in [((ti, 5, 9.0), {"ndim": 2}),                 # int count, Python float
                         ((ti, thresholds, 9.0), {"ndim": 2, "connectivity": 2}),
                         ((ti, list(thresholds), np.float64(9.0)), {"ndim": 2}),
                         ((ti,), {"thresholds": 3, "scale": 2.0, "ndim": 2})]:
        np_args = [a.numpy() if isinstance(a, torch.Tensor) else a for a in args]
        expected = cutopo.soft_ecc(*np_args, **kwargs)
        out = ct.soft_ecc(*args, **kwargs)
        assert out.numpy().dtype == expected.dtype
        np.testing.assert_array_equal(out.numpy(), expected)
    with pytest.raises(TypeError, match="unexpected keyword"):
        ct.soft_ecc(ti, 5, 9.0, nd=2)
    with pytest.raises(TypeError, match="positional"):
        ct.soft_ecc(ti, 5, 9.0, 2)


def test_strided_and_expanded_tensors(rng):
    base = torch.from_numpy(rng.random((12, 10)))
    image = base.t()                                  # transposed: not contiguous
    assert not image.is_contiguous()
    t = torch.linspace(0, 1, 5, dtype=torch.float64).expand(2, 5)[0]
    np.testing.assert_array_equal(ct.soft_ecc(image, t, 10.0).numpy(),
                                  cutopo.soft_ecc(image.numpy().copy(), t.numpy().copy(), 10.0))
    prob = torch.rand(1, 8, dtype=torch.float64).expand(6, 8)   # stride 0
    leaf = prob.clone().requires_grad_()
    out = ct.expected_euler(prob)
    np.testing.assert_array_equal(out.numpy(), cutopo.expected_euler(prob.numpy().copy()))
    (g,) = torch.autograd.grad(ct.expected_euler(leaf.t()), [leaf])
    _, pullback = cutopo.vjp(cutopo.expected_euler, leaf.detach().numpy().T.copy())
    np.testing.assert_array_equal(g.numpy(), pullback(np.ones(()))[0].T)


def test_dtypes(rng):
    image = rng.random((9, 9))
    for dtype in (torch.float16, torch.uint8, torch.int16, torch.bool):
        tensor = (torch.from_numpy(image) * (200 if dtype != torch.bool else 1)).to(dtype)
        out = ct.soft_ecc(tensor, 4, 3.0)
        expected = cutopo.soft_ecc(tensor.numpy(), 4, 3.0)
        assert out.dtype == torch.float32
        np.testing.assert_array_equal(out.numpy(), expected)
    with pytest.raises(TypeError, match="bfloat16"):
        ct.soft_ecc(torch.from_numpy(image).bfloat16(), 4, 3.0)


# ---------------------------------------------------------------------------------------------
# bfloat16: ops that take it (deformable_aggregation) get ml_dtypes.bfloat16 arrays over the
# tensors' memory; the others refuse it


def _bf16_numpy(t):
    """The ml_dtypes.bfloat16 array of a CPU bfloat16 tensor (the test's own conversion)."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    return t.detach().view(torch.int16).numpy().view(ml_dtypes.bfloat16)


def _bf16_deformable_args(loc_dtype, weight_dtype):
    """deformable-zeros-f32 with bfloat16 features (and locations/weights as asked), as
    tensors and as the NumPy arrays that the NumPy path gets (the same values)."""
    feats, shapes, starts, loc, weights = _case("deformable-zeros-f32").args
    tensors = [torch.from_numpy(feats).bfloat16(), torch.from_numpy(shapes),
               torch.from_numpy(starts), torch.from_numpy(loc).to(loc_dtype),
               torch.from_numpy(weights).to(weight_dtype)]
    arrays = [_bf16_numpy(t) if t.dtype == torch.bfloat16 else t.numpy() for t in tensors]
    return tensors, arrays


@pytest.mark.parametrize("loc_dtype, weight_dtype", [
    (torch.float32, torch.float32), (torch.float32, torch.bfloat16),
    (torch.bfloat16, torch.bfloat16)], ids=["w-f32", "w-bf16", "all-bf16"])
def test_bfloat16_deformable_values_and_gradients(loc_dtype, weight_dtype, rng):
    """Values equal the NumPy path on the same ml_dtypes arrays; gradients equal cutopo.vjp's,
    bfloat16 tensors for bfloat16 arguments (and the output is bfloat16 when all three are)."""
    kwargs = _case("deformable-zeros-f32").kwargs
    tensors, arrays = _bf16_deformable_args(loc_dtype, weight_dtype)
    expected = cutopo.deformable_aggregation(*arrays, **kwargs)
    positions = (0, 3, 4)
    for i in positions:
        tensors[i].requires_grad_()
    out = ct.deformable_aggregation(*tensors, **kwargs)
    want_dtype = torch.bfloat16 if loc_dtype == weight_dtype == torch.bfloat16 else torch.float32
    assert out.dtype == want_dtype and out.shape == expected.shape
    got = _bf16_numpy(out) if out.dtype == torch.bfloat16 else out.detach().numpy()
    assert got.dtype == expected.dtype
    np.testing.assert_array_equal(got.view(np.uint8), expected.view(np.uint8))  # bit for bit

    cotangent = torch.from_numpy(rng.standard_normal(out.shape).astype(np.float32)).to(out.dtype)
    grads = torch.autograd.grad(out, [tensors[i] for i in positions], cotangent)
    g_np = _bf16_numpy(cotangent) if cotangent.dtype == torch.bfloat16 else cotangent.numpy()
    _, pullback = cutopo.vjp(cutopo.deformable_aggregation, *arrays, **kwargs)
    reference = pullback(g_np)
    for i, g in zip(positions, grads):
        assert g.dtype == tensors[i].dtype and g.shape == tensors[i].shape
        g_got = _bf16_numpy(g) if g.dtype == torch.bfloat16 else g.numpy()
        assert g_got.dtype == reference[i].dtype
        np.testing.assert_array_equal(g_got.view(np.uint8), reference[i].view(np.uint8))


def test_bfloat16_tensors_cross_without_copies():
    """CPU bfloat16 tensors reach the op as ml_dtypes.bfloat16 views of their memory (strides
    kept), and bfloat16 results come back as tensors over the result's memory."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    op = next(o for o in ct._adapters.adapted_ops() if o.name == "deformable_aggregation")
    base = torch.randn(6, 10, 4).bfloat16()
    for t in (base, base.transpose(0, 1), base[:, ::3], base[0, 0, 0]):  # strided, 0-d
        a = ct._to_array(t, op)
        assert isinstance(a, np.ndarray) and a.dtype == np.dtype(ml_dtypes.bfloat16)
        assert a.shape == t.shape and a.strides == tuple(s * 2 for s in t.stride())
        assert a.__array_interface__["data"][0] == t.data_ptr()
        t.mul_(2)  # a write through the tensor shows in the array (exact in bfloat16)
        np.testing.assert_array_equal(a.astype(np.float32), t.float().numpy())
        assert np.shares_memory(a.view(np.int16), t.view(torch.int16).numpy())
    result = np.arange(12, dtype=np.float32).reshape(3, 4).astype(ml_dtypes.bfloat16)
    back = ct._to_tensor(result, [])
    assert back.dtype == torch.bfloat16 and back.data_ptr() == result.__array_interface__["data"][0]
    torch.testing.assert_close(back.float(), torch.arange(12.0).reshape(3, 4), rtol=0, atol=0)
    # an output that aliases an input is copied (custom ops may not alias)
    features = torch.randn(3, 4).bfloat16()
    fa = ct._to_array(features, op)
    assert ct._to_tensor(fa, [fa]).data_ptr() != features.data_ptr()


def test_bfloat16_numpy_arguments_are_converted():
    """ml_dtypes.bfloat16 NumPy arrays given for tensor arguments become bfloat16 tensors."""
    kwargs = _case("deformable-zeros-f32").kwargs
    tensors, arrays = _bf16_deformable_args(torch.float32, torch.bfloat16)
    out = ct.deformable_aggregation(arrays[0], *tensors[1:], **kwargs)
    np.testing.assert_array_equal(out.numpy(), cutopo.deformable_aggregation(*arrays, **kwargs))


def test_bfloat16_under_torch_compile():
    """The fake kernel declares the bfloat16 output (the shape rule's dtype maps back)."""
    torch._dynamo.reset()
    kwargs = _case("deformable-zeros-f32").kwargs
    tensors, _ = _bf16_deformable_args(torch.bfloat16, torch.bfloat16)
    feats = tensors[0].clone().requires_grad_()
    fn = lambda f: ct.deformable_aggregation(f, *tensors[1:], **kwargs).float().square().sum()  # noqa: E731
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    got, want = compiled(feats), fn(feats)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    (g_got,) = torch.autograd.grad(got, [feats])
    (g_want,) = torch.autograd.grad(want, [feats])
    assert g_got.dtype == torch.bfloat16
    torch.testing.assert_close(g_got, g_want, rtol=0, atol=0)


def test_ops_without_bfloat16_refuse_it(rng):
    """Every op but deformable_aggregation keeps refusing bfloat16 tensors, with the adapter's
    TypeError, before any work."""
    image = torch.from_numpy(rng.random((1, 2, 6, 6))).bfloat16()
    grid = torch.zeros(1, 3, 3, 2)
    calls = [lambda: ct.soft_ecc(image[0, 0], 4, 3.0), lambda: ct.expected_euler(image),
             lambda: ct.ecc(image[0, 0], 4), lambda: ct.euler_contributions(image),
             lambda: ct.grid_sample(image, grid), lambda: ct.grid_sample(image.float(), grid.bfloat16()),
             lambda: ct.soft_ect(image[0, 0] > 0.5, torch.tensor([[1.0, 0.0]]).bfloat16(), 4, 2.0)]
    for call in calls:
        with pytest.raises(TypeError, match=r"torch\.bfloat16 are not supported by cutopo\.\w+ "
                                            r"\(bfloat16 is taken by cutopo\.deformable_aggregation only\)"):
            call()


class _FakeCupyArray:
    """A NumPy array standing in for a CuPy one (the CUDA path's logic, tested on the CPU)."""

    def __init__(self, a, viewable=True):
        self.a, self.viewable = a, viewable

    @property
    def dtype(self):
        return self.a.dtype

    def view(self, dtype):
        if not self.viewable:
            raise TypeError("dtype not supported")
        return _FakeCupyArray(self.a.view(dtype))


def test_cuda_bfloat16_fallbacks_on_the_cpu(monkeypatch):
    """_cupy_bfloat16's logic with a stand-in CuPy over NumPy (which imports no bfloat16 through
    DLPack): the tensor's bits as int16, viewed as bfloat16; a CuPy that cannot view them
    gives the clear TypeError."""
    import types

    pytest.importorskip("ml_dtypes")
    t = torch.randn(4, 5).bfloat16().t()
    with pytest.raises(Exception):
        np.from_dlpack(t)  # what the stand-in's direct import does: refused
    viewable = [True]
    fake = types.ModuleType("cupy")
    fake.__version__ = "0-fake"
    fake.from_dlpack = lambda x: _FakeCupyArray(np.from_dlpack(x), viewable[0])
    monkeypatch.setitem(sys.modules, "cupy", fake)
    a = ct._cupy_bfloat16(t).a
    assert a.dtype == ct._BFLOAT16 and a.__array_interface__["data"][0] == t.data_ptr()
    np.testing.assert_array_equal(a.astype(np.float32), t.float().numpy())
    viewable[0] = False
    with pytest.raises(TypeError, match="CuPy 0-fake takes no bfloat16 arrays"):
        ct._cupy_bfloat16(t)


def test_outputs_do_not_alias_inputs(rng):
    prob = torch.from_numpy(rng.random((3, 5, 5)))
    out = ct.euler_contributions(prob, ndim=2)
    assert out.data_ptr() != prob.data_ptr() and out.dtype == torch.int8


def test_errors_of_the_op_come_through():
    with pytest.raises(ValueError, match="sorted"):
        ct.soft_ecc(torch.rand(5, 5), torch.tensor([0.5, 0.1]), 1.0)


# ---------------------------------------------------------------------------------------------
# gradcheck in float64. Fixed seeds: finite differences need points off the op's kinks (two
# pixel values within eps of each other, a trajectory step starting on a cell face).


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def test_gradcheck_soft_ecc():
    image = torch.rand(7, 6, dtype=torch.float64, generator=_gen(0)).requires_grad_()
    t = torch.linspace(0.05, 0.95, 6, dtype=torch.float64).requires_grad_()
    scale = torch.tensor(6.0, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, y, s: ct.soft_ecc(x, y, s), (image, t, scale))
    batch = torch.rand(2, 5, 5, dtype=torch.float64, generator=_gen(1)).requires_grad_()
    assert torch.autograd.gradcheck(lambda x: ct.soft_ecc(x, t.detach(), 4.0, ndim=2,
                                                          connectivity=2), (batch,))


def test_gradcheck_soft_ect():
    mask = torch.rand(7, 8, generator=_gen(2)) > 0.4
    dirs = torch.tensor([[0.83, 0.31], [-0.42, 0.77]], dtype=torch.float64, requires_grad=True)
    t = torch.linspace(-1.1, 1.1, 7, dtype=torch.float64).requires_grad_()
    scale = torch.tensor(3.0, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda d, y, s: ct.soft_ect(mask, d, y, s), (dirs, t, scale))
    # a threshold count: the thresholds move with the directions
    assert torch.autograd.gradcheck(lambda d: ct.soft_ect(mask, d, 6, 3.0, connectivity=2), (dirs,))


def test_gradcheck_expected_euler():
    prob = torch.rand(2, 5, 6, dtype=torch.float64, generator=_gen(3)).requires_grad_()
    assert torch.autograd.gradcheck(lambda p: ct.expected_euler(p, ndim=2), (prob,))
    vol = torch.rand(3, 4, 3, dtype=torch.float64, generator=_gen(4)).requires_grad_()
    assert torch.autograd.gradcheck(lambda p: ct.expected_euler(p, connectivity=3), (vol,))


def test_gradcheck_cpab_integrate():
    tess = Tessellation((2, 2))
    theta = torch.from_numpy(tess.sample(1, length_scale=0.4, rng=5)[0]).requires_grad_()
    points = (0.1 + 0.8 * torch.rand(4, 2, dtype=torch.float64, generator=_gen(5))).requires_grad_()
    assert torch.autograd.gradcheck(lambda p, th: ct.cpab.integrate(p, th, tess, n_steps=8),
                                    (points, theta))


def _case(case_id):
    return next(c for c in CASES if c.id == case_id)


@pytest.mark.parametrize("case_id", ["grid_sample-2d-f64", "deformable-f64", "cpab-grid-f64",
                                     "cpab-image-f64"])
def test_gradcheck_sampling_and_warps(case_id):
    """grid_sample, deformable_aggregation and the CPAB warps, in every float argument at once
    (the cases keep sample points off pixel centres, where the bilinear interpolant has kinks)."""
    case = _case(case_id)
    positions = case.grad_positions()
    fn = resolve(ct, case.path)
    inputs = [to_torch(case.args[i], requires_grad=True) for i in positions]

    def f(*diff):
        args = [to_torch(a) for a in case.args]
        for i, d in zip(positions, diff):
            args[i] = d
        return fn(*args, **case.kwargs)

    assert torch.autograd.gradcheck(f, inputs)


def test_opcheck():
    image = torch.rand(6, 6, dtype=torch.float64, requires_grad=True)
    t = torch.linspace(0, 1, 4, dtype=torch.float64, requires_grad=True)
    key = ct._intern("soft_ecc", (0, 1, -1), ("ndim", "connectivity", "boundary"), None, None, 5.0,
                     None, 1, "box")
    torch.library.opcheck(torch.ops.cutopo.soft_ecc.default, ([image, t], key))
    prob = torch.rand(2, 5, 5, requires_grad=True)
    key = ct._intern("expected_euler", (0,), ("ndim", "connectivity"), None, 2, 1)
    torch.library.opcheck(torch.ops.cutopo.expected_euler.default, ([prob], key))


# ---------------------------------------------------------------------------------------------
# torch.compile


def _compiler_available():
    return any(shutil.which(c) for c in ("g++", "c++", "clang++"))


@pytest.mark.parametrize("backend", [
    "eager", "aot_eager",
    pytest.param("inductor", marks=pytest.mark.skipif(not _compiler_available(),
                                                      reason="inductor needs a C++ compiler")),
])
def test_torch_compile_fullgraph(backend):
    torch._dynamo.reset()
    rng = np.random.default_rng(7)
    image = torch.from_numpy(rng.random((10, 10)))
    t = torch.linspace(0.1, 0.9, 6, dtype=torch.float64)
    mask = torch.from_numpy(rng.random((8, 8)) > 0.5)
    dirs = torch.tensor([[0.83, 0.31], [-0.42, 0.77]], dtype=torch.float64)
    tess = Tessellation((2, 2))
    theta = torch.from_numpy(tess.sample(1, length_scale=0.4, rng=2)[0])
    points = torch.from_numpy(rng.uniform(0.1, 0.9, (5, 2)))

    def loss(x, d, th, scale):
        return (ct.soft_ecc(x, t, scale).square().sum()
                + ct.expected_euler(x) * 0.5
                + ct.soft_ect(mask, d, 5, 4.0).sum()
                + ct.cpab.integrate(points, th, tess, n_steps=6).sum()
                + ct.ecc(x, 4).sum() + ct.ect(mask, d, t).sum())  # integer terms: constants

    compiled = torch.compile(loss, fullgraph=True, backend=backend)
    for scale in (20.0, 25.0):  # a new Python scalar recompiles (a guarded constant)
        inputs = [v.clone().requires_grad_() for v in (image, dirs, theta)]
        eager = [v.clone().requires_grad_() for v in (image, dirs, theta)]
        got = compiled(*inputs, scale)
        want = loss(*eager, scale)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=0)
        got.backward()
        want.backward()
        for a, b in zip(inputs, eager):
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("backend", [
    "eager", "aot_eager",
    pytest.param("inductor", marks=pytest.mark.skipif(not _compiler_available(),
                                                      reason="inductor needs a C++ compiler")),
])
def test_torch_compile_sampling_and_warps(backend):
    """grid_sample, deformable_aggregation and the CPAB warps in one compiled loss (fullgraph:
    no graph breaks), values and gradients equal to eager; the grid's shape of transform_grid
    is a static (constant) argument."""
    torch._dynamo.reset()
    grid_case, deform, warp_grid, warp = (_case(i) for i in (
        "grid_sample-2d-f64", "deformable-f64", "cpab-grid-f64", "cpab-image-f64"))
    feats, shapes, starts, loc, weights = deform.args
    picture, theta, tess = warp.args
    shapes_t, starts_t = torch.from_numpy(shapes), torch.from_numpy(starts)

    def loss(image, grid, f, lo, w, th, pic):
        return (ct.grid_sample(image, grid).square().sum()
                + ct.deformable_aggregation(f, shapes_t, starts_t, lo, w).sum()
                + ct.cpab.transform_grid(th, tess, warp_grid.args[2], n_steps=8).square().sum()
                + ct.cpab.transform_image(pic, th, tess, n_steps=8).sum())

    values = (*grid_case.args, feats, loc, weights, theta, picture)
    compiled = torch.compile(loss, fullgraph=True, backend=backend)
    inputs = [torch.from_numpy(v).requires_grad_() for v in values]
    eager = [torch.from_numpy(v).requires_grad_() for v in values]
    got, want = compiled(*inputs), loss(*eager)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)
    got.backward()
    want.backward()
    for a, b in zip(inputs, eager):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-12, atol=1e-12)


def test_transform_grid_shape_is_static():
    """The grid's shape never becomes a tensor: a tuple or a list of ints, also under
    torch.compile with dynamic shapes taken from a tensor."""
    case = _case("cpab-grid-f64")
    theta, tess, shape = case.args
    th = torch.from_numpy(theta)
    expected = cutopo.cpab.transform_grid(theta, tess, shape, n_steps=8)
    for s in (shape, list(shape), torch.Size(shape)):
        np.testing.assert_array_equal(ct.cpab.transform_grid(th, tess, s, n_steps=8).numpy(), expected)
    torch._dynamo.reset()
    f = torch.compile(lambda t, image: ct.cpab.transform_grid(t, tess, image.shape, n_steps=8),
                      fullgraph=True, dynamic=True, backend="aot_eager")
    for n in (4, 6):
        out = f(th, torch.zeros(n, 5))
        assert out.shape == (n, 5, 2)
        np.testing.assert_array_equal(
            out.numpy(), cutopo.cpab.transform_grid(theta, tess, (n, 5), n_steps=8))


def test_torch_compile_dynamic_shapes():
    torch._dynamo.reset()
    t = torch.linspace(0, 1, 5)
    f = torch.compile(lambda x: ct.soft_ecc(x, t, 10.0, ndim=2).sum(), fullgraph=True,
                      dynamic=True, backend="aot_eager")
    for n in (6, 9):
        x = torch.rand(2, n, n, requires_grad=True)
        f(x).backward()
        assert x.grad.shape == (2, n, n)


def _bad_shape_calls():
    """(op path, NumPy arguments, keywords) whose shapes, dtypes or options the op refuses; its
    shape rule, which the fake kernels run, refuses them too."""
    rng = np.random.default_rng(16)
    image = rng.random((6, 7))
    t = np.linspace(0.1, 0.9, 4)
    mask = rng.random((6, 7)) > 0.5
    dirs = np.array([[0.8, 0.3], [-0.4, 0.7]])
    feats, shapes, starts, loc, weights = _case("deformable-f64").args
    picture, theta, tess = _case("cpab-image-f64").args
    grid_image, grid = _case("grid_sample-2d-f64").args
    return [
        pytest.param("deformable_aggregation", (feats[0], shapes, starts, loc, weights), {},
                     id="deformable-features-rank"),
        pytest.param("deformable_aggregation", (feats, shapes, starts, loc[0, 0, 0, 0], weights),
                     {}, id="deformable-locations-rank"),
        pytest.param("deformable_aggregation", (feats, shapes, starts, loc, weights[0]), {},
                     id="deformable-weights-rank"),
        pytest.param("deformable_aggregation", (feats, shapes[0], starts, loc, weights), {},
                     id="deformable-shapes-rank"),
        pytest.param("expected_euler", (np.full(4, 0.5),), {}, id="expected_euler-rank"),
        pytest.param("soft_ecc", (image, np.ones((2, 2)), 1.0), {}, id="soft_ecc-thresholds-rank"),
        pytest.param("soft_ecc", (image[0], t, 1.0), {}, id="soft_ecc-image-rank"),
        pytest.param("soft_ecc", (image, t, np.ones(2)), {}, id="soft_ecc-scale-rank"),
        pytest.param("soft_ect", (mask, dirs[0], 5, 2.0), {}, id="soft_ect-directions-rank"),
        pytest.param("ecc", (image[0], t), {}, id="ecc-rank"),
        pytest.param("euler_contributions", (image[0],), {}, id="contributions-rank"),
        pytest.param("ect", (mask[0], dirs, t), {}, id="ect-mask-rank"),
        pytest.param("grid_sample", (grid_image[0], grid), {}, id="grid_sample-image-rank"),
        pytest.param("grid_sample", (grid_image, grid[0]), {}, id="grid_sample-grid-rank"),
        pytest.param("cpab.integrate", (rng.random(5), theta, tess), {}, id="integrate-points-rank"),
        pytest.param("cpab.transform_grid", (theta[None, None], tess, (4, 5)), {},
                     id="grid-theta-rank"),
        pytest.param("cpab.transform_image", (picture[0], theta, tess), {}, id="image-rank"),
        pytest.param("cpab.compose", (rng.random((5, 2)), theta, tess), {}, id="compose-thetas-rank"),
    ]


def _in_chain(exc, expected):
    """Whether ``exc`` or an exception in its ``__cause__``/``__context__`` chain is one of
    ``expected``'s type with its message."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if type(exc) is type(expected) and str(exc) == str(expected):
            return True
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return False


@pytest.mark.parametrize("path, args, kwargs", _bad_shape_calls())
def test_torch_compile_bad_shapes_raise_the_ops_error(path, args, kwargs):
    """Under torch.compile(fullgraph=True) a bad rank or shape is refused while tracing, by the
    op's own check in the shape rule (it used to crash the rule: IndexError, unpacking errors).
    Dynamo wraps the fake kernel's exception in its TorchRuntimeError: the op's exception is in
    the chain and its message, naming the argument, in Dynamo's; eager calls raise it as is."""
    with pytest.raises((TypeError, ValueError)) as info:
        resolve(cutopo, path)(*args, **kwargs)
    expected = info.value
    fn = resolve(ct, path)
    with pytest.raises((TypeError, ValueError)) as info:  # eager: the op's exception
        fn(*[to_torch(a) for a in args], **kwargs)
    assert type(info.value) is type(expected) and str(info.value) == str(expected)
    of_tensors, dyn = of_array_args(fn, args, kwargs)

    graphs = []

    def backend(gm, example_inputs):  # "eager", recording the graphs it gets
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(of_tensors, fullgraph=True, backend=backend)
    with pytest.raises(Exception) as info:
        compiled(*[torch.from_numpy(args[i]) for i in dyn])
    assert not graphs  # refused while tracing, not by the op when the graph ran
    assert _in_chain(info.value, expected), repr(info.value)
    assert type(info.value) in (type(expected), torch._dynamo.exc.TorchRuntimeError)
    assert str(expected) in str(info.value)


def test_torch_compile_bad_values_raise_the_ops_error_when_run():
    torch._dynamo.reset()
    compiled = torch.compile(lambda p: ct.expected_euler(p).sum(), fullgraph=True, backend="eager")
    with pytest.raises(ValueError, match=r"prob: values must lie in \[0, 1\]"):
        compiled(torch.full((3, 3), 1.5))


def test_shape_rule_checks_do_not_specialise_dynamic_shapes():
    """The shape rules check the arguments on stand-ins of the example's sizes: with dynamic
    shapes a new size reuses the graph (a guard on a size would recompile)."""
    picture, theta, tess = _case("cpab-image-f64").args
    th = torch.from_numpy(theta)
    t = torch.linspace(0, 1, 5)
    calls = [
        (lambda x: ct.soft_ecc(x, t, 10.0, ndim=2, boundary="periodic").sum(),
         lambda n: (torch.rand(2, n, n),)),
        (lambda x: ct.expected_euler(x, ndim=2).sum(), lambda n: (torch.rand(2, n, n),)),
        (lambda im, g: ct.grid_sample(im, g).sum(),
         lambda n: (torch.rand(2, 3, n, n), torch.rand(2, n, 4, 2) * 2 - 1)),
        (lambda im: ct.cpab.transform_image(im, th, tess, n_steps=4).sum(),
         lambda n: (torch.rand(1, 2, n, n, dtype=torch.float64),)),
        (lambda p: ct.cpab.compose(p, torch.stack([th, -th]), tess, n_steps=4).sum(),
         lambda n: (torch.rand(n, 2, dtype=torch.float64),)),
    ]
    with torch._dynamo.config.patch(error_on_recompile=True):
        for f, make in calls:
            torch._dynamo.reset()
            compiled = torch.compile(f, fullgraph=True, dynamic=True, backend="eager")
            for n in (6, 9):
                args = make(n)
                torch.testing.assert_close(compiled(*args), f(*args))


# ---------------------------------------------------------------------------------------------
# GPU (skipped without one)


def _cuda_ready():
    return torch.cuda.is_available() and cutopo.gpu_available()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA device")
@pytest.mark.parametrize("case", [c for c in CASES if c.path != "cpab.integrate"], ids=lambda c: c.id)
def test_cuda_values_and_gradients_match_the_cpu(case):
    skip_without_cuda_kernel(case)
    positions = case.grad_positions()
    cpu = [to_torch(a, requires_grad=i in positions) for i, a in enumerate(case.args)]
    gpu = [a.detach().cuda().requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor) else a
           for a in cpu]
    fn = resolve(ct, case.path)
    out_cpu, out_gpu = fn(*cpu, **case.kwargs), fn(*gpu, **case.kwargs)
    assert out_gpu.is_cuda and out_gpu.dtype == out_cpu.dtype and out_gpu.shape == out_cpu.shape
    if out_cpu.dtype.is_floating_point:
        torch.testing.assert_close(out_gpu.cpu(), out_cpu, rtol=1e-5, atol=1e-4)
    else:
        torch.testing.assert_close(out_gpu.cpu(), out_cpu, rtol=0, atol=0)
    if positions:
        g_cpu = torch.autograd.grad(out_cpu.sum(), [cpu[i] for i in positions])
        g_gpu = torch.autograd.grad(out_gpu.sum(), [gpu[i] for i in positions])
        for a, b in zip(g_gpu, g_cpu):
            assert a.is_cuda
            torch.testing.assert_close(a.cpu(), b, rtol=1e-4, atol=1e-3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA device")
def test_cuda_tensors_cross_without_copies():
    import cupy

    x = torch.rand(64, 64, device="cuda").t()  # strided: DLPack carries the strides
    a = ct._to_array(x)
    assert isinstance(a, cupy.ndarray) and a.data.ptr == x.data_ptr()
    assert a.strides == tuple(s * x.element_size() for s in x.stride())
    y = cupy.arange(10, dtype=cupy.float32)
    back = ct._to_tensor(y, [])
    assert back.is_cuda and back.data_ptr() == y.data.ptr


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA device")
def test_cuda_runs_on_the_current_non_default_stream(monkeypatch):
    import cupy

    streams = []
    real = ct._to_array

    def spy(t, *rest):
        streams.append(cupy.cuda.get_current_stream().ptr)
        return real(t, *rest)

    monkeypatch.setattr(ct, "_to_array", spy)
    image = torch.rand(4, 256, 256, device="cuda", requires_grad=True)
    t = torch.linspace(0, 1, 64, device="cuda")
    reference = ct.soft_ecc(image.detach(), t, 30.0, ndim=2)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        image2 = image * 1.0  # queued on the side stream just before the op reads it
        out = ct.soft_ecc(image2, t, 30.0, ndim=2)
        (g,) = torch.autograd.grad(out.sum(), [image])
    side.synchronize()
    assert side.cuda_stream in streams
    torch.testing.assert_close(out, reference, rtol=1e-6, atol=1e-5)
    assert g.shape == image.shape and torch.isfinite(g).all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA device")
@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16], ids=["w-f32", "w-bf16"])
def test_cuda_bfloat16_deformable(weight_dtype):
    """CUDA bfloat16 tensors cross to CuPy without copies (DLPack's bfloat16, or the bits as
    int16; a CuPy without bfloat16 arrays: the adapter's TypeError, reported as a skip), and
    deformable_aggregation's values and bfloat16 gradients match the CPU path's."""
    pytest.importorskip("ml_dtypes")
    import cupy

    op = next(o for o in ct._adapters.adapted_ops() if o.name == "deformable_aggregation")
    x = torch.randn(8, 6, 4, device="cuda").bfloat16().transpose(0, 1)
    try:
        a = ct._to_array(x, op)
    except TypeError as exc:
        pytest.skip(f"CuPy refuses bfloat16: {exc}")
    assert isinstance(a, cupy.ndarray) and a.dtype == ct._BFLOAT16
    assert a.data.ptr == x.data_ptr() and a.strides == tuple(2 * s for s in x.stride())
    back = ct._to_tensor(a.copy(), [])
    assert back.is_cuda and back.dtype == torch.bfloat16 and torch.equal(back, x)

    kwargs = _case("deformable-zeros-f32").kwargs
    cpu, _ = _bf16_deformable_args(torch.float32, weight_dtype)
    gpu = [t.cuda() for t in cpu]
    positions = (0, 3, 4)
    for ts in (cpu, gpu):
        for i in positions:
            ts[i].requires_grad_()
    out_cpu = ct.deformable_aggregation(*cpu, **kwargs)
    out_gpu = ct.deformable_aggregation(*gpu, **kwargs)
    assert out_gpu.is_cuda and out_gpu.dtype == out_cpu.dtype == torch.float32
    torch.testing.assert_close(out_gpu.cpu(), out_cpu, rtol=1e-5, atol=1e-4)
    g_cpu = torch.autograd.grad(out_cpu.sum(), [cpu[i] for i in positions])
    g_gpu = torch.autograd.grad(out_gpu.sum(), [gpu[i] for i in positions])
    for i, a_, b_ in zip(positions, g_gpu, g_cpu):
        assert a_.is_cuda and a_.dtype == cpu[i].dtype == b_.dtype
        # bfloat16 cotangents: float32 sums rounded once; the two backends sum in other orders
        tol = 2e-2 if a_.dtype == torch.bfloat16 else 1e-4
        torch.testing.assert_close(a_.cpu().float(), b_.float(), rtol=tol, atol=tol)


def test_torch_func_transforms_are_refused_as_documented():
    """cutopo.torch's docstring says torch.func's grad and vmap do not work (no vmap rules;
    functorch refuses custom ops' register_autograd formulas, pytorch/pytorch#179652): if a
    torch release lifts that, this fails and the docstring should change."""
    x = torch.rand(6, 7, dtype=torch.float64)
    t = torch.linspace(0, 1, 5, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="setup_context"):
        torch.func.grad(lambda a: ct.soft_ecc(a, t, 4.0).sum())(x)
    with pytest.raises(RuntimeError, match="[Bb]atching rule"):
        torch.vmap(lambda a: ct.soft_ecc(a, t, 4.0))(torch.rand(3, 6, 7, dtype=torch.float64))
