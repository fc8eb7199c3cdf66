"""torch.func's transforms over every public op (the FFN ops once refused them: their
autograd was a C++ torch::autograd::Function): grad, vjp, jacrev, hessian (forward over
reverse) and per-sample gradients (vmap of grad), equal to the plain-PyTorch op's in
float64."""
from __future__ import annotations

import pytest
import torch

from conftest import DEVICES
from op_cases import OPS, op_args


def _scalar(fn, n_args):
    """sum(sin(outputs)): a scalar of the op's outputs with a nonzero second derivative."""
    def loss(*args):
        assert len(args) == n_args
        return sum(o.sin().sum() for o in fn(*args))
    return loss


def _assert_same(ours, theirs):
    for a, b in zip(torch.utils._pytree.tree_leaves(ours), torch.utils._pytree.tree_leaves(theirs)):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(OPS))
def test_grad_vjp_and_jacrev(name, device):
    keys, fused, eager = OPS[name]
    args = op_args(name, device, torch.float64)
    argnums = tuple(range(len(args)))
    _assert_same(torch.func.grad(_scalar(fused, len(args)), argnums=argnums)(*args),
                 torch.func.grad(_scalar(eager, len(args)), argnums=argnums)(*args))
    outs, vjp_fn = torch.func.vjp(fused, *args)
    ref_outs, ref_vjp_fn = torch.func.vjp(eager, *args)
    cotangents = tuple(torch.randn_like(o) for o in outs)
    _assert_same(outs, ref_outs)
    _assert_same(vjp_fn(cotangents), ref_vjp_fn(cotangents))
    _assert_same(torch.func.jacrev(lambda x: fused(x, *args[1:])[0])(args[0]),
                 torch.func.jacrev(lambda x: eager(x, *args[1:])[0])(args[0]))


def _split(name, args):
    """(the per-row arguments: input, and residual for the add ops; the parameters)."""
    n = 2 if "r" in OPS[name][0] else 1
    return tuple(args[:n]), tuple(args[n:])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(OPS))
def test_hessian(name, device):
    keys, fused, eager = OPS[name]
    rows, params = _split(name, op_args(name, device, torch.float64))
    rows = tuple(t[:1, :1] for t in rows)  # one row: a small Hessian

    def on_input(fn):
        return lambda x: _scalar(fn, len(rows) + len(params))(x, *rows[1:], *params)

    _assert_same(torch.func.hessian(on_input(fused))(rows[0]),
                 torch.func.hessian(on_input(eager))(rows[0]))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(OPS))
def test_per_sample_gradients(name, device):
    """vmap over grad: each sample's gradient of the parameters, as in DP-SGD."""
    keys, fused, eager = OPS[name]
    rows, params = _split(name, op_args(name, device, torch.float64))

    def per_sample(fn):
        def loss(params, *sample):
            return _scalar(fn, len(rows) + len(params))(*(t.unsqueeze(0) for t in sample), *params)
        return torch.vmap(torch.func.grad(loss), in_dims=(None,) + (0,) * len(rows))(params, *rows)

    _assert_same(per_sample(fused), per_sample(eager))
