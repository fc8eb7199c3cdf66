"""zero_centered_weight (layer_norm, rms_norm, add_layer_norm, add_rms_norm and the modules):
the weight applied is 1 + weight, formed in float32 (float64 for float64 input), gradients to
weight. Three-way accuracy, gradcheck/gradgradcheck, opcheck, compile, modules, errors.
(tests/op_cases.py adds two of the ops to the forward-AD, torch.func, vmap and higher-order
tests.)"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fusednorm
from fusednorm import reference
from conftest import DEVICES, DTYPES, check_outputs_and_grads, random_input

SIZES = [7, 1023]


def _compute_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def _zc(w, dtype):
    """1 + w in the computation type of a `dtype` input: what the ops apply."""
    return None if w is None else w.to(_compute_dtype(dtype)) + 1


def _torch_norm(centered, x, shape, w, b, eps):
    """The same dtype's PyTorch computation: widened, normalized with 1 + w, rounded once
    (Hugging Face Gemma's order)."""
    c = _compute_dtype(x.dtype)
    bias = None if b is None else b.to(c)
    if centered:
        return F.layer_norm(x.to(c), shape, _zc(w, x.dtype), bias, eps).to(x.dtype)
    return F.rms_norm(x.to(c), shape, _zc(w, x.dtype), eps).to(x.dtype)


def _reference(centered, x, shape, w, b, eps):
    if centered:
        return reference.layer_norm(x, shape, _zc(w, x.dtype), b, eps)
    return reference.rms_norm(x, shape, _zc(w, x.dtype), eps)


def _fused(centered, residual):
    if centered:
        if residual:
            return lambda x, r, w, b, shape, eps: fusednorm.add_layer_norm(
                x, r, shape, w, b, eps, zero_centered_weight=True)
        return lambda x, w, b, shape, eps: (fusednorm.layer_norm(
            x, shape, w, b, eps, zero_centered_weight=True),)
    if residual:
        return lambda x, r, w, shape, eps: fusednorm.add_rms_norm(
            x, r, shape, w, eps, zero_centered_weight=True)
    return lambda x, w, shape, eps: (fusednorm.rms_norm(
        x, shape, w, eps, zero_centered_weight=True),)


OPS = [("layer_norm", True, False), ("rms_norm", False, False),
       ("add_layer_norm", True, True), ("add_rms_norm", False, True)]


def _check(name, centered, residual, x, r, w, b, shape, eps=1e-5):
    fused = _fused(centered, residual)

    def expected(norm):
        def run(x, *rest):
            rest = list(rest)
            r = rest.pop(0) if residual else None
            w, b = rest[0], rest[1] if centered else None
            s = x + r if residual else x
            out = norm(centered, s, shape, w, b, eps)
            return (out, s) if residual else (out,)
        return run

    def call(x, *rest):
        return fused(x, *rest, shape, eps)

    tensors = [x] + ([r] if residual else []) + [w] + ([b] if centered else [])
    names = ["input"] + (["residual"] if residual else []) + ["weight"] + (["bias"] if centered else [])
    check_outputs_and_grads(call, expected(_torch_norm), expected(_reference), tensors, names)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N", SIZES)
@pytest.mark.parametrize("op", OPS, ids=[o[0] for o in OPS])
def test_matches_reference(op, N, dtype, device):
    name, centered, residual = op
    x = random_input((37, N), dtype, device)
    r = random_input((37, N), dtype, device, seed=5)
    # A small weight around 0, as zero-centered checkpoints hold.
    w = random_input((N,), dtype, device, scale=0.3, shift=0.1, seed=1)
    b = random_input((N,), dtype, device, scale=0.5, shift=0.0, seed=2)
    _check(name, centered, residual, x, r, w, b, (N,))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("op", OPS, ids=[o[0] for o in OPS])
def test_float32_parameters_for_half_input(op, dtype, device):
    name, centered, residual = op
    x = random_input((9, 130), dtype, device)
    r = random_input((9, 130), dtype, device, seed=5)
    w = random_input((130,), torch.float32, device, scale=0.3, shift=0.1, seed=1)
    b = random_input((130,), torch.float32, device, scale=0.5, shift=0.0, seed=2)
    _check(name, centered, residual, x, r, w, b, (130,))


@pytest.mark.parametrize("device", DEVICES)
def test_strided_multi_dim_and_16_bit_weight_for_float32_input(device):
    """Any float weight dtype is accepted (widened exactly): a bfloat16 weight on float32
    rows, as Gemma's checkpoints meet float32 activations."""
    base = random_input((6, 5, 2, 9), torch.float32, device)
    x = base.transpose(0, 1)[::2]
    w = random_input((2, 9), torch.bfloat16, device, scale=0.3, shift=0.1, seed=1)
    out = fusednorm.rms_norm(x, (2, 9), w, 1e-3, zero_centered_weight=True)
    expected = F.rms_norm(x, (2, 9), w.float() + 1, 1e-3)
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_without_weight_is_the_plain_norm(device):
    x = random_input((5, 33), torch.bfloat16, device)
    b = random_input((33,), torch.bfloat16, device, seed=2)
    assert torch.equal(fusednorm.layer_norm(x, (33,), None, b, zero_centered_weight=True),
                       fusednorm.layer_norm(x, (33,), None, b))
    assert torch.equal(fusednorm.rms_norm(x, (33,), None, zero_centered_weight=True),
                       fusednorm.rms_norm(x, (33,)))


def test_one_rounding_of_one_plus_weight():
    """1 + w is formed in float32 from the bf16 weight, not in bf16: a weight whose 1 + w
    bf16 cannot hold (w = 2^-9) changes the output."""
    x = random_input((4, 64), torch.float32, "cpu")
    w = torch.full((64,), 2.0 ** -9, dtype=torch.bfloat16)
    out = fusednorm.rms_norm(x, (64,), w, 1e-6, zero_centered_weight=True)
    torch.testing.assert_close(out, F.rms_norm(x, (64,), torch.full((64,), 1 + 2.0 ** -9), 1e-6),
                               rtol=2e-7, atol=0)
    plain = F.rms_norm(x, (64,), None, 1e-6)
    assert ((out - plain).abs() > 2 ** -10 * plain.abs()).any()  # 1 + w rounded to 1: no


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", OPS, ids=[o[0] for o in OPS])
def test_gradcheck_and_gradgradcheck(op, device):
    name, centered, residual = op
    x = random_input((3, 11), torch.float64, device).requires_grad_()
    r = random_input((3, 11), torch.float64, device, seed=5).requires_grad_()
    w = random_input((11,), torch.float64, device, scale=0.3, seed=1).requires_grad_()
    b = random_input((11,), torch.float64, device, scale=0.5, seed=2).requires_grad_()
    fused = _fused(centered, residual)
    args = [x] + ([r] if residual else []) + [w] + ([b] if centered else [])
    fn = lambda *a: fused(*a, (11,), 1e-5)  # noqa: E731
    assert torch.autograd.gradcheck(fn, args)
    assert torch.autograd.gradgradcheck(fn, args)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    ops = torch.ops.fusednorm
    x = random_input((4, 37), torch.float32, device)
    r = random_input((4, 37), torch.float32, device, seed=5)
    w = random_input((37,), torch.bfloat16, device, scale=0.3, seed=1)
    wf = random_input((37,), torch.float32, device, scale=0.3, seed=1)
    b = random_input((37,), torch.float32, device, seed=2)
    for grad in (False, True):
        g = lambda t: t.detach().clone().requires_grad_(grad)  # noqa: E731
        torch.library.opcheck(ops.layer_norm.default, (g(x), [37], g(wf), g(b), 1e-5, True))
        torch.library.opcheck(ops.rms_norm.default, (g(x), [37], g(w), None, True))
        torch.library.opcheck(ops.add_layer_norm.default,
                              (g(x), g(r), [37], g(wf), g(b), 1e-5, True))
        torch.library.opcheck(ops.add_rms_norm.default, (g(x), g(r), [37], g(wf), 1e-6, True))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("residual", [False, True])
def test_compile_fullgraph_forward_and_backward(device, residual):
    x = random_input((6, 40), torch.bfloat16, device).requires_grad_()
    r = random_input((6, 40), torch.bfloat16, device, seed=5).requires_grad_()
    w = random_input((40,), torch.bfloat16, device, scale=0.3, seed=1).requires_grad_()
    b = random_input((40,), torch.bfloat16, device, scale=0.5, seed=2).requires_grad_()

    def fn(x, r, w, b):
        if residual:
            out, s = fusednorm.add_layer_norm(x, r, (40,), w, b, zero_centered_weight=True)
            return out.float().sum() + s.float().square().sum()
        return fusednorm.rms_norm(x, (40,), w, 1e-6, zero_centered_weight=True).float().square().sum()

    leaves = [x, r, w, b]
    eager_grads = torch.autograd.grad(fn(*leaves), leaves, allow_unused=True)
    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True)
    compiled_grads = torch.autograd.grad(compiled(*leaves), leaves, allow_unused=True)
    for name, e, c in zip("xrwb", eager_grads, compiled_grads):
        assert (e is None) == (c is None), name
        if e is not None:
            assert torch.equal(e, c), name


def test_modules():
    ln = fusednorm.FusedLayerNorm(24, zero_centered_weight=True)
    rms = fusednorm.FusedRMSNorm(24, eps=1e-6, zero_centered_weight=True)
    assert torch.equal(ln.weight, torch.zeros(24)) and torch.equal(rms.weight, torch.zeros(24))
    assert "zero_centered_weight=True" in repr(ln) and "zero_centered_weight=True" in repr(rms)
    assert ln.state_dict().keys() == torch.nn.LayerNorm(24).state_dict().keys()
    x = random_input((3, 24), torch.float32, "cpu")
    with torch.no_grad():
        ln.weight.normal_(0, 0.3)
        rms.weight.normal_(0, 0.3)
    torch.testing.assert_close(ln(x), F.layer_norm(x, (24,), 1 + ln.weight, ln.bias))
    torch.testing.assert_close(rms(x), F.rms_norm(x, (24,), 1 + rms.weight, 1e-6))
    rms(x).sum().backward()
    assert rms.weight.grad is not None
    # A module swapped in from torch's class has the plain weight.
    plain = fusednorm.replace_norms(torch.nn.RMSNorm(24))
    assert type(plain) is fusednorm.FusedRMSNorm and plain.zero_centered_weight is False
    assert "zero_centered" not in repr(plain)
