"""Jagged nested tensors (torch.nested, layout=torch.jagged), which nn.LayerNorm, nn.RMSNorm
and nn.Linear take: each op runs on the packed values and returns a nested tensor of the
input's structure, bit for bit the op's result on the values, with gradients to the nested
input and the parameters."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

import fusednorm
from conftest import DEVICES, random_input
from fusednorm import functional
from fusednorm.errors import FusedTypeError, FusedValueError

DTYPES = [torch.float32, torch.bfloat16]


def jagged(lengths, tail, dtype, device, seed=0, requires_grad=False):
    """A jagged tensor of len(lengths) sequences of shape (length, *tail), random values."""
    total = random_input((sum(lengths), *tail), dtype, device, seed=seed)
    parts = list(total.split(lengths))
    return torch.nested.nested_tensor(parts, layout=torch.jagged, requires_grad=requires_grad)


def same_structure(a, b):
    assert a.is_nested and a.layout == torch.jagged
    assert a.offsets() is b.offsets() and a._ragged_idx == b._ragged_idx
    assert a.shape == b.shape and a.dtype == b.dtype


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
@pytest.mark.parametrize("tail,normalized", [((24,), (24,)), ((3, 10), (3, 10)), ((3, 10), (10,))])
def test_norm_of_jagged_tensor_is_the_norm_of_its_values(device, dtype, op, tail, normalized):
    x = jagged([5, 1, 7], tail, dtype, device, requires_grad=True)
    w = random_input(normalized, dtype, device, seed=1).requires_grad_()
    args = (w, random_input(normalized, dtype, device, seed=2)) if op == "layer_norm" else (w,)
    out = getattr(fusednorm, op)(x, normalized, *args)
    same_structure(out, x)
    values = x.values().detach().requires_grad_()
    dense = getattr(fusednorm, op)(values, normalized, *args)
    assert torch.equal(out.values(), dense)
    # PyTorch's own result on the values (its jagged support varies across releases).
    torch.testing.assert_close(out.values(), getattr(F, op)(values, normalized, *args),
                               **({} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}))

    grad = random_input(dense.shape, dtype, device, seed=3)
    (gx, gw) = torch.autograd.grad(out.values(), (x, w), grad)
    (gv, gw_dense) = torch.autograd.grad(dense, (values, w), grad)
    same_structure(gx, x)
    assert torch.equal(gx.values(), gv) and torch.equal(gw, gw_dense)


@pytest.mark.parametrize("device", DEVICES)
def test_transposed_jagged_tensor(device):
    """Ragged dim 2 (a (B, j, H, D) tensor transposed to (B, H, j, D)): strided values."""
    x = jagged([4, 9], (3, 16), torch.float32, device).transpose(1, 2)
    assert x._ragged_idx == 2
    out = fusednorm.layer_norm(x, (16,))
    same_structure(out, x)
    assert torch.equal(out.values(), fusednorm.layer_norm(x.values(), (16,)))
    torch.testing.assert_close(out.values(), F.layer_norm(x.values(), (16,)))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", ["add_layer_norm", "add_rms_norm"])
def test_add_norm_of_jagged_tensors(device, op):
    x = jagged([6, 2, 3], (20,), torch.bfloat16, device, requires_grad=True)
    residual = torch.nested.nested_tensor_from_jagged(
        random_input(x.values().shape, torch.bfloat16, device, seed=4), x.offsets())
    w = random_input((20,), torch.float32, device, seed=5)
    args = (w, w.flip(0)) if op == "add_layer_norm" else (w,)
    out, s = getattr(fusednorm, op)(x, residual, (20,), *args, residual_dtype=torch.float32)
    same_structure(out, x)
    assert s.offsets() is x.offsets() and s.dtype == torch.float32
    dense_out, dense_s = getattr(fusednorm, op)(x.values(), residual.values(), (20,), *args,
                                                residual_dtype=torch.float32)
    assert torch.equal(out.values(), dense_out) and torch.equal(s.values(), dense_s)
    (gx,) = torch.autograd.grad(out.values().float().sum() + s.values().sum(), x)
    same_structure(gx, x)


@pytest.mark.parametrize("device", DEVICES)
def test_ffn_modules_on_jagged_tensor(device):
    torch.manual_seed(0)
    x = jagged([3, 8], (12,), torch.float32, device, requires_grad=True)
    ffn = fusednorm.FusedGeluFFN(12, 20, device=device)
    eager = torch.nn.Sequential(ffn.fc1, torch.nn.GELU(), ffn.fc2)
    out = ffn(x)
    same_structure(out, x)
    torch.testing.assert_close(out.values(), eager(x.values()))
    (gx,) = torch.autograd.grad(out.values().sum(), x)
    same_structure(gx, x)
    block = fusednorm.FusedLayerNormGeluFFN(12, d_hidden=20, device=device)
    out = block(x)
    same_structure(out, x)
    assert torch.equal(out.values(), block(x.values()))


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_jagged_errors_name_the_problem():
    x = jagged([3, 4], (8,), torch.float32, "cpu")
    with pytest.raises(FusedValueError, match="batch dim"):
        fusednorm.layer_norm(x, tuple(x.shape))
    flat = torch.nested.nested_tensor([torch.randn(3), torch.randn(4)], layout=torch.jagged)
    with pytest.raises(FusedValueError, match="ragged dim"):  # the FFN ops: no fallback
        fusednorm.gelu_ffn(flat, torch.randn(5, 4), None, torch.randn(4, 5), None)
    other = jagged([3, 4], (8,), torch.float32, "cpu", seed=1)  # equal lengths, own offsets
    with pytest.raises(FusedValueError, match="structure"):
        fusednorm.add_layer_norm(x, other, (8,))
    strided = torch.nested.nested_tensor([torch.randn(3, 8), torch.randn(4, 8)])
    with pytest.raises(FusedTypeError, match="torch.jagged"):
        fusednorm.rms_norm(strided, (8,))


def test_compiled_module_on_jagged_tensor():
    torch._dynamo.reset()
    x = jagged([3, 5], (8,), torch.float32, "cpu", requires_grad=True)
    norm = fusednorm.FusedLayerNorm(8)
    out = torch.compile(norm, fullgraph=True)(x)
    same_structure(out, x)
    assert torch.equal(out.values(), norm(x).values())
    (gx,) = torch.autograd.grad(out.values().sum(), x)
    same_structure(gx, x)


# Normalized dims that include the ragged dim: each sequence normalized as a whole, which
# nn.LayerNorm takes (forward only in torch 2.14: its backward raises, and F.layer_norm
# ignores a weight and bias there); fusednorm falls back to PyTorch's own functions.
TOL = {torch.float32: {}, torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2}}


def over_ragged(x):
    """The normalized_shape of every dim from x's ragged dim (1) on."""
    return tuple(x.shape[1:])


def grads_or_raise(torch_out, fused_out, inputs, grad):
    """The fused output's gradients of `inputs` are PyTorch's, or raise where PyTorch's do."""
    try:
        expected = torch.autograd.grad(torch_out.values(), inputs, grad)
    except RuntimeError:
        with pytest.raises(RuntimeError):
            torch.autograd.grad(fused_out.values(), inputs, grad)
        return
    got = torch.autograd.grad(fused_out.values(), inputs, grad)
    for g, e in zip(got, expected):
        assert torch.equal(g.values() if g.is_nested else g, e.values() if e.is_nested else e)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tail", [(7,), (3, 5)])
def test_layer_norm_over_the_ragged_dim_is_pytorchs(device, dtype, tail, monkeypatch):
    monkeypatch.setattr(functional, "_warned_fallback", set())
    x = jagged([5, 1, 7], tail, dtype, device, requires_grad=True)
    shape = over_ragged(x)
    with pytest.warns(RuntimeWarning, match="ragged dim.*torch.nn.functional.layer_norm") \
            as record:
        out = fusednorm.layer_norm(x, shape, eps=1e-3)
    assert record[0].filename == __file__  # the warning points at the caller
    same_structure(out, x)
    expected = F.layer_norm(x, shape, eps=1e-3)
    assert torch.equal(out.values(), expected.values())
    for seq, row in zip(x.unbind(), out.unbind()):  # each sequence normalized as a whole
        torch.testing.assert_close(row, F.layer_norm(seq, seq.shape, eps=1e-3), **TOL[dtype])
    # The module, as nn.LayerNorm takes such a normalized_shape (without parameters).
    module = fusednorm.FusedLayerNorm(shape, eps=1e-3, elementwise_affine=False)
    eager = torch.nn.LayerNorm(shape, eps=1e-3, elementwise_affine=False)
    assert torch.equal(module(x).values(), eager(x).values())
    grads_or_raise(expected, out, (x,), random_input(out.values().shape, dtype, device, seed=3))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("residual_dtype", [None, torch.float32])
def test_add_layer_norm_over_the_ragged_dim_is_the_composition(device, dtype, residual_dtype,
                                                               monkeypatch):
    monkeypatch.setattr(functional, "_warned_fallback", set())
    x = jagged([3, 6, 1], (5,), dtype, device, requires_grad=True)
    residual = torch.nested.nested_tensor_from_jagged(
        random_input(x.values().shape, residual_dtype or dtype, device, seed=4),
        x.offsets()).requires_grad_()
    shape = over_ragged(x)
    with pytest.warns(RuntimeWarning, match="input \\+ residual, then torch.nn.functional"):
        out, s = fusednorm.add_layer_norm(x, residual, shape, eps=1e-4,
                                          residual_dtype=residual_dtype)
    same_structure(out, x)
    assert s.offsets() is x.offsets() and s.dtype == (residual_dtype or dtype)
    # PyTorch's composition: the sum in the residual stream's dtype, then the norm.
    total = x.to(s.dtype) + residual.to(s.dtype)
    expected = F.layer_norm(total, shape, eps=1e-4).to(dtype)
    assert torch.equal(s.values(), total.values())
    assert torch.equal(out.values(), expected.values())
    module = fusednorm.FusedAddLayerNorm(shape, eps=1e-4, elementwise_affine=False,
                                         residual_dtype=residual_dtype)
    module_out, module_s = module(x, residual)
    assert torch.equal(module_out.values(), out.values()) and torch.equal(module_s.values(),
                                                                          s.values())
    grad = random_input(s.values().shape, s.dtype, device, seed=5)
    got = torch.autograd.grad(s.values(), (x, residual), grad)
    want = torch.autograd.grad(total.values(), (x, residual), grad)
    for g, w in zip(got, want):
        assert torch.equal(g.values(), w.values())
    grads_or_raise(expected, out, (x, residual),
                   random_input(out.values().shape, dtype, device, seed=6))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norms_over_the_ragged_dim_do_as_pytorch(dtype):
    """F.rms_norm / nn.RMSNorm, and so the composition add_rms_norm stands for, raise over
    the ragged dim in torch 2.14: fusednorm raises too, naming its fallback; were PyTorch to
    compute it, fusednorm's result would be PyTorch's."""
    x = jagged([4, 1, 3], (3, 5), dtype, "cpu")
    residual = torch.nested.nested_tensor_from_jagged(
        random_input(x.values().shape, dtype, "cpu", seed=1), x.offsets())
    shape = over_ragged(x)
    cases = [
        (lambda: fusednorm.rms_norm(x, shape, eps=1e-4),
         lambda: F.rms_norm(x, shape, eps=1e-4)),
        (lambda: fusednorm.FusedRMSNorm(shape, eps=1e-4, elementwise_affine=False)(x),
         lambda: torch.nn.RMSNorm(shape, eps=1e-4, elementwise_affine=False)(x)),
        (lambda: fusednorm.add_rms_norm(x, residual, shape, eps=1e-4)[0],
         lambda: F.rms_norm(x + residual, shape, eps=1e-4)),
    ]
    for fused, eager in cases:
        try:
            expected = eager()
        except (RuntimeError, ValueError):
            with pytest.raises(FusedValueError,
                               match="falls back to torch.nn.functional.rms_norm"):
                fused()
        else:
            with pytest.warns(RuntimeWarning):
                assert torch.equal(fused().values(), expected.values())


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_over_the_ragged_dim_unsupported_arguments_name_themselves():
    x = jagged([3, 4], (6,), torch.float32, "cpu")
    residual = torch.nested.nested_tensor_from_jagged(torch.randn(7, 6), x.offsets())
    shape = over_ragged(x)
    w = torch.randn(6)
    # No dense weight or bias has the ragged size (F.layer_norm would ignore them).
    for call, name in [
        (lambda: fusednorm.layer_norm(x, shape, w), "weight"),
        (lambda: fusednorm.layer_norm(x, shape, None, w), "bias"),
        (lambda: fusednorm.rms_norm(x, shape, w), "weight"),
        (lambda: fusednorm.add_layer_norm(x, residual, shape, None, w), "bias"),
        (lambda: fusednorm.add_rms_norm(x, residual, shape, w), "weight"),
        # fusednorm's dropout mask and rowscale are the kernels', which do not run there.
        (lambda: fusednorm.add_layer_norm(x, residual, shape, dropout_p=0.25), "dropout_p"),
        (lambda: fusednorm.add_rms_norm(x, residual, shape, dropout_p=0.5), "dropout_p"),
        (lambda: fusednorm.add_layer_norm(x, residual, shape, rowscale=torch.ones(2)),
         "rowscale"),
    ]:
        with pytest.raises(FusedValueError, match=f"ragged dim 1 .*: {name}"):
            call()
    module = fusednorm.FusedAddLayerNorm(shape, elementwise_affine=False, dropout_p=0.1)
    with pytest.raises(FusedValueError, match="dropout_p=0.1"):
        module(x, residual)
    module.eval()  # dropout applies in training mode only
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        assert torch.equal(module(x, residual)[0].values(),
                           F.layer_norm(x + residual, shape).values())
    # Arguments the op checks, checked as ever; residual of another structure.
    with pytest.raises(FusedValueError, match="eps"):
        fusednorm.layer_norm(x, shape, eps=-1.0)
    other = jagged([3, 4], (6,), torch.float32, "cpu", seed=1)
    with pytest.raises(FusedValueError, match="structure"):
        fusednorm.add_layer_norm(x, other, shape)
    # What PyTorch's fallback does not support raises, naming it: a ragged dim other than
    # 1, a jagged tensor with holes.
    transposed = jagged([3, 5], (4, 6), torch.float32, "cpu").transpose(1, 2)
    with pytest.raises(FusedValueError, match="ragged dim 2 .*falls back to "
                                              "torch.nn.functional.layer_norm"):
        fusednorm.layer_norm(transposed, tuple(transposed.shape[1:]))
    holes = torch.nested.nested_tensor_from_jagged(
        torch.randn(9, 6), torch.tensor([0, 4, 9]), torch.tensor([3, 4]))
    with pytest.raises(FusedValueError, match="falls back to torch.nn.functional.layer_norm"):
        fusednorm.layer_norm(holes, over_ragged(holes))
