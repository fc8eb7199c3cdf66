"""Gradients of any order for every differentiable op: gradgradcheck in float64, a third
derivative against PyTorch's, and a gradient-penalty training step against eager for each
function and module. A detached gradient (one without grad_fn) would silently drop the
penalty term: these tests fail on it."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fusednorm
from conftest import DEVICES, random_input
from op_cases import OPS, op_args


def _rand(shape, device, seed, scale=0.5):
    return random_input(shape, torch.float64, device, scale=scale, shift=0.1, seed=seed)


def _ffn_params(device, d=5, hidden=7, out=None, seed=10):
    out = d if out is None else out
    shapes = [(hidden, d), (hidden,), (out, hidden), (out,)]
    return [_rand(s, device, seed + i).requires_grad_() for i, s in enumerate(shapes)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("bias", [True, False])
def test_gelu_ffn_gradgradcheck(device, approximate, bias):
    x = _rand((2, 3, 5), device, 0, scale=1.5).requires_grad_()
    w1, b1, w2, b2 = _ffn_params(device, out=4)
    if not bias:
        b1 = b2 = None

    def fn(x, w1, w2, *biases):
        b1, b2 = biases if biases else (None, None)
        return fusednorm.gelu_ffn(x, w1, b1, w2, b2, approximate)

    args = (x, w1, w2) + ((b1, b2) if bias else ())
    assert torch.autograd.gradcheck(fn, args)
    assert torch.autograd.gradgradcheck(fn, args)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("trainable", ["none", "biases", "weight2"])
def test_frozen_gelu_ffn_derivatives_of_every_order(device, approximate, trainable):
    """weight1 frozen (every parameter, the biases alone trained as in BitFit, or weight2):
    the input is not saved, and a differentiable backward reaches the input and bias1
    through the saved pre-activation. Second and third derivatives equal eager's (and pass
    gradgradcheck); a detached or constant pre-activation would drop the gelu'' term."""
    x = _rand((2, 3, 5), device, 0, scale=1.5)
    w1, b1, w2, b2 = (t.detach() for t in _ffn_params(device, out=4))
    if trainable == "none":
        b1 = b2 = None  # (and no bias at all)
    names = {"none": [], "biases": ["b1", "b2"], "weight2": ["w2"]}[trainable]
    frozen = {"w1": w1, "b1": b1, "w2": w2, "b2": b2}
    trained = [frozen[n] for n in names]

    def parameters(trained):
        p = {**frozen, **dict(zip(names, trained))}
        return p["w1"], p["b1"], p["w2"], p["b2"]

    def fused(x, *trained):
        return fusednorm.gelu_ffn(x, *parameters(trained), approximate)

    def eager(x, *trained):
        w1, b1, w2, b2 = parameters(trained)
        return F.linear(F.gelu(F.linear(x, w1, b1), approximate=approximate), w2, b2)

    def third(fn):
        leaves = [t.clone().requires_grad_() for t in (x, *trained)]
        firsts = torch.autograd.grad(fn(*leaves).pow(3).sum(), leaves, create_graph=True)
        seconds = torch.autograd.grad(sum(g.pow(2).sum() for g in firsts), leaves,
                                      create_graph=True)
        return (*seconds, *torch.autograd.grad(sum(g.sin().sum() for g in seconds), leaves))

    for a, e in zip(third(fused), third(eager)):
        torch.testing.assert_close(a, e)
    leaves = [t.clone().requires_grad_() for t in (x, *trained)]
    assert torch.autograd.gradcheck(fused, leaves)
    assert torch.autograd.gradgradcheck(fused, leaves)


@pytest.mark.parametrize("device", DEVICES)
def test_layer_norm_gelu_ffn_gradgradcheck(device):
    x = _rand((3, 5), device, 0, scale=1.5).requires_grad_()
    ln_w, ln_b = (_rand((5,), device, s).requires_grad_() for s in (1, 2))
    w1, b1, w2, b2 = _ffn_params(device)

    def fn(*args):
        x, ln_w, ln_b, w1, b1, w2, b2 = args
        return fusednorm.functional.layer_norm_gelu_ffn(x, ln_w, ln_b, 1e-5, w1, b1, w2, b2, "tanh")

    args = (x, ln_w, ln_b, w1, b1, w2, b2)
    assert torch.autograd.gradcheck(fn, args)
    assert torch.autograd.gradgradcheck(fn, args)


def _layer_norm_from_primitives(x, w, b, eps=1e-5):
    """LayerNorm from mean, square, rsqrt: differentiable to any order by autograd."""
    centered = x - x.mean(-1, keepdim=True)
    return centered * torch.rsqrt(centered.square().mean(-1, keepdim=True) + eps) * w + b


@pytest.mark.parametrize("device", DEVICES)
def test_layer_norm_third_derivative_is_exact(device):
    """Third derivatives equal those of LayerNorm written from primitives (and pass
    gradcheck). F.layer_norm's do not (its double backward treats the saved statistics
    as constants, pytorch/pytorch#175754): a place where we are exact and PyTorch is not."""
    x = _rand((3, 6), device, 0, scale=2.0)
    w, b = _rand((6,), device, 1), _rand((6,), device, 2)

    def second(fn):
        def g(x, w, b):
            y = fn(x, w, b)
            (g1,) = torch.autograd.grad(y.pow(3).sum(), x, create_graph=True)
            (g2,) = torch.autograd.grad(g1.pow(2).sum(), x, create_graph=True)
            return g2
        return g

    def third(fn):
        leaves = [t.clone().requires_grad_() for t in (x, w, b)]
        return torch.autograd.grad(second(fn)(*leaves).sin().sum(), leaves)

    fused = lambda x, w, b: fusednorm.layer_norm(x, (6,), w, b)  # noqa: E731
    for a, e in zip(third(fused), third(_layer_norm_from_primitives)):
        torch.testing.assert_close(a, e)
    leaves = [t.clone().requires_grad_() for t in (x, w, b)]
    assert torch.autograd.gradcheck(second(fused), leaves)


# --- gradient penalty: loss = out² + |d out.sum() / dx|², one optimizer step -------------


def _penalty_step(fn, params, x):
    """One SGD step on a gradient-penalty loss; returns the loss and the updated params."""
    x = x.clone().requires_grad_()
    out = fn(x)
    (gx,) = torch.autograd.grad(out.sum(), x, create_graph=True)
    assert gx.grad_fn is not None, "the gradient is detached: the penalty would be dropped"
    loss = out.pow(2).mean() + gx.pow(2).sum()
    grads = torch.autograd.grad(loss, params)
    return loss.detach(), [p.detach() - 0.1 * g for p, g in zip(params, grads)]


def _assert_same_step(fused_fn, fused_params, eager_fn, eager_params, x):
    loss, updated = _penalty_step(fused_fn, fused_params, x)
    eager_loss, eager_updated = _penalty_step(eager_fn, eager_params, x)
    torch.testing.assert_close(loss, eager_loss)
    for a, e in zip(updated, eager_updated):
        torch.testing.assert_close(a, e)


def _module_cases(device):
    d = 6
    norm = nn.LayerNorm(d)
    ffn = nn.Sequential(nn.Linear(d, 16), nn.GELU(), nn.Linear(16, d))
    block = fusednorm.FusedLayerNormGeluFFN(d, 16, approximate="tanh")
    eager_block = _EagerBlock(block)
    fused_norm = copy.deepcopy(norm)
    fusednorm.replace_layernorm(fused_norm)
    fused_ffn = fusednorm.FusedGeluFFN(d, 16)
    fused_ffn.load_state_dict({"fc1.weight": ffn[0].weight, "fc1.bias": ffn[0].bias,
                               "fc2.weight": ffn[2].weight, "fc2.bias": ffn[2].bias})
    rms = nn.RMSNorm(d)
    with torch.no_grad():
        rms.weight.uniform_(0.5, 1.5)
    fused_rms = fusednorm.FusedRMSNorm(d)
    fused_rms.load_state_dict(rms.state_dict())
    pairs = {"FusedLayerNorm": (fused_norm, norm), "FusedRMSNorm": (fused_rms, rms),
             "FusedGeluFFN": (fused_ffn, ffn),
             "FusedLayerNormGeluFFN": (block, eager_block)}
    return {k: (f.to(device, torch.float64), e.to(device, torch.float64)) for k, (f, e) in pairs.items()}


class _EagerBlock(nn.Module):
    """x + fc2(gelu(fc1(norm(x)))) with a FusedLayerNormGeluFFN's parameters, in eager ops."""

    def __init__(self, block):
        super().__init__()
        self.block = copy.deepcopy(block)

    def forward(self, x):
        b = self.block
        h = F.gelu(F.linear(F.layer_norm(x, (x.shape[-1],), b.norm.weight, b.norm.bias, b.norm.eps),
                            b.fc1.weight, b.fc1.bias), approximate=b.approximate)
        return x + F.linear(h, b.fc2.weight, b.fc2.bias)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["FusedLayerNorm", "FusedRMSNorm", "FusedGeluFFN",
                                  "FusedLayerNormGeluFFN"])
def test_gradient_penalty_step_modules(device, name):
    fused, eager = _module_cases(device)[name]
    x = _rand((4, 3, 6), device, 5, scale=2.0)
    _assert_same_step(fused, list(fused.parameters()), eager, list(eager.parameters()), x)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fn", ["layer_norm", "rms_norm", "add_layer_norm", "add_rms_norm",
                                "gelu_ffn", "layer_norm_gelu_ffn"])
def test_gradient_penalty_step_functions(device, fn):
    x = _rand((5, 6), device, 7, scale=2.0)
    ln = [_rand((6,), device, s).requires_grad_() for s in (1, 2)]
    ffn = _ffn_params(device, d=6, hidden=9)
    if fn == "layer_norm":
        params = ln
        fused = lambda x: fusednorm.layer_norm(x, (6,), *params)  # noqa: E731
        eager = lambda x: F.layer_norm(x, (6,), *params)  # noqa: E731
    elif fn == "rms_norm":
        params = ln[:1]
        fused = lambda x: fusednorm.rms_norm(x, (6,), ln[0])  # noqa: E731
        eager = lambda x: F.rms_norm(x, (6,), ln[0])  # noqa: E731
    elif fn.startswith("add_"):
        # Both outputs feed the loss: the penalty differentiates through norm(s) and s.
        residual = _rand((5, 6), device, 8).requires_grad_()
        norm = F.layer_norm if fn == "add_layer_norm" else F.rms_norm
        norm_args = ln if fn == "add_layer_norm" else ln[:1]
        params = norm_args + [residual]

        def fused(x):
            y, s = getattr(fusednorm, fn)(x, residual, (6,), *norm_args)
            return y * s

        def eager(x):
            s = x + residual
            return norm(s, (6,), *norm_args) * s
    elif fn == "gelu_ffn":
        params = ffn
        fused = lambda x: fusednorm.gelu_ffn(x, *params)  # noqa: E731
        eager = lambda x: F.linear(F.gelu(F.linear(x, *params[:2])), *params[2:])  # noqa: E731
    else:
        params = ln + ffn

        def fused(x):
            return fusednorm.functional.layer_norm_gelu_ffn(x, ln[0], ln[1], 1e-5, *ffn)

        def eager(x):
            h = F.gelu(F.linear(F.layer_norm(x, (6,), ln[0], ln[1]), *ffn[:2]))
            return x + F.linear(h, *ffn[2:])

    _assert_same_step(fused, params, eager, params, x)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtypes", [(torch.float32, None), (torch.bfloat16, None),
                                    (torch.bfloat16, torch.float32)],
                         ids=["float32", "bfloat16", "bfloat16-float32-params"])
@pytest.mark.parametrize("name", list(OPS))
def test_first_order_gradients_do_not_depend_on_create_graph(name, dtypes, device):
    """create_graph=True takes the ATen formulas (differentiable_formulas.h); its
    first-order values agree with the fused kernels' to the dtype's rounding (the norms
    compute in float for 16-bit inputs there too)."""
    dtype, param_dtype = dtypes
    if param_dtype is not None and "w" not in OPS[name][0]:
        pytest.skip("no norm parameters")
    _, fused, _ = OPS[name]
    args = [a.requires_grad_() for a in op_args(name, device, dtype, param_dtype)]
    outs = fused(*args)
    cotangents = [random_input(o.shape, o.dtype, device, scale=1.0, seed=30 + i)
                  for i, o in enumerate(outs)]
    plain = torch.autograd.grad(outs, args, cotangents, retain_graph=True)
    graphed = torch.autograd.grad(outs, args, cotangents, create_graph=True)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    for a, e in zip(graphed, plain):
        assert a.dtype == e.dtype
        torch.testing.assert_close(a.float(), e.float(), rtol=tol,
                                   atol=tol * e.float().abs().max().item())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_create_graph_norm_of_16_bit_rows_computes_in_float(device, dtype):
    """16-bit rows 32 sigma from zero: the create_graph gradients agree with the fused
    backward's (float arithmetic, one rounding), where 16-bit arithmetic would be off by
    about a tenth (the mean rounded to 8 bits of 32)."""
    x = random_input((6, 64), dtype, device, scale=1.0, shift=32.0).requires_grad_()
    w = random_input((64,), dtype, device, seed=1).requires_grad_()
    y = fusednorm.layer_norm(x, (64,), w)
    dy = random_input(y.shape, dtype, device, scale=1.0, seed=2)
    plain = torch.autograd.grad(y, (x, w), dy, retain_graph=True)
    graphed = torch.autograd.grad(y, (x, w), dy, create_graph=True)
    for a, e in zip(graphed, plain):
        torch.testing.assert_close(a.float(), e.float(), rtol=2e-2,
                                   atol=2e-2 * e.float().abs().max().item())
