"""Jagged nested tensors (torch.nested, layout=torch.jagged), which nn.LayerNorm, nn.RMSNorm
and nn.Linear take: each op runs on the packed values and returns a nested tensor of the
input's structure, bit for bit the op's result on the values, with gradients to the nested
input and the parameters."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fusednorm
from conftest import DEVICES, random_input
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
    with pytest.raises(FusedValueError, match="ragged dim"):
        fusednorm.layer_norm(x, (x.shape[1], 8))
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
