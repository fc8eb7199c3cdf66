"""Rows at the ends of the range: rows of millions of elements keep the accuracy of short
ones (their sums are taken in blocks combined pairwise, not in one accumulator per lane), and
a row whose statistics overflow the accumulator gives NaN, where 1 / sqrt(inf) = 0 would
make it all zeros (or the bias): a wrong answer nothing flags."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fusednorm
from conftest import DEVICES, assert_close_three_way, random_input

NORMS = {
    "layer_norm": (lambda x, w, b: fusednorm.layer_norm(x, x.shape[-1:], w, b),
                   lambda x, w, b: F.layer_norm(x, x.shape[-1:], w, b)),
    "rms_norm": (lambda x, w, b: fusednorm.rms_norm(x, x.shape[-1:], w, 1e-6),
                 lambda x, w, b: F.rms_norm(x, x.shape[-1:], w, 1e-6)),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(NORMS))
def test_rows_of_millions_keep_their_accuracy(device, name):
    """Two rows of 2^23 + 5 elements (float32), away from zero mean: output and every
    gradient within the three-way bound with a slack of 1e-6 (one accumulator per lane,
    2^18 values each, was 30 times PyTorch's error in the output)."""
    fused, torch_fn = NORMS[name]
    n = (1 << 23) + 5
    x = random_input((2, n), torch.float32, device, scale=2.0, shift=3.0)
    w = random_input((n,), torch.float32, device, scale=0.5, shift=1.0, seed=1)
    b = random_input((n,), torch.float32, device, scale=0.5, shift=0.0, seed=2)
    dy = random_input((2, n), torch.float32, device, scale=1.0, shift=0.5, seed=3)
    results = []
    for fn, cast in ((fused, torch.float32), (torch_fn, torch.float32), (torch_fn, torch.float64)):
        leaves = [t.detach().to(cast).requires_grad_() for t in (x, w, b)]
        y = fn(*leaves)
        grads = torch.autograd.grad(y, leaves, dy.to(cast), allow_unused=True)
        results.append([y.detach(), *grads])
    names = ["y", "dx", "dweight", "dbias"]
    for what, mine, theirs, ref in zip(names, *results):
        if ref is None:  # RMSNorm: no bias
            continue
        # The parameter gradients sum over 2 rows: the bound's slack scales with them.
        assert_close_three_way(mine, theirs, ref, torch.float32, f"{name} {what}", atol=1e-6)


# (dtype, a value whose square overflows the statistics' accumulator)
HUGE = [(torch.float32, 1e20), (torch.bfloat16, 1e20), (torch.float64, 1e160)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype, huge", HUGE, ids=[str(d).split(".")[1] for d, _ in HUGE])
@pytest.mark.parametrize("kind", ["layer_norm", "rms_norm", "add_layer_norm", "add_rms_norm"])
@pytest.mark.parametrize("n", [7, 256, 70000])
def test_a_row_whose_statistics_overflow_is_nan(device, dtype, huge, kind, n):
    """Row 1 holds one value whose square overflows float32 (float64: 1e160): every output of
    that row, its input gradient and the parameter gradients (sums over the rows) are NaN;
    the other rows' outputs and input gradients are what they are without it."""
    x = random_input((3, n), dtype, device)
    x[1, n // 2] = huge
    w = random_input((n,), dtype, device, scale=0.5, shift=1.0, seed=1).requires_grad_()
    b = random_input((n,), dtype, device, scale=0.5, shift=0.0, seed=2).requires_grad_()
    xs = x.detach().requires_grad_()

    def call(inp):
        if kind == "layer_norm":
            return fusednorm.layer_norm(inp, (n,), w, b)
        if kind == "rms_norm":
            return fusednorm.rms_norm(inp, (n,), w)
        zero = torch.zeros_like(inp)
        if kind == "add_layer_norm":
            return fusednorm.add_layer_norm(inp, zero, (n,), w, b)[0]
        return fusednorm.add_rms_norm(inp, zero, (n,), w)[0]

    y = call(xs)
    dy = random_input(y.shape, dtype, device, seed=4)
    y.backward(dy)
    assert y[1].isnan().all(), f"{int(y[1].isnan().sum())} of {n} NaN"
    assert xs.grad[1].isnan().all()
    assert w.grad.isnan().all()
    assert torch.isfinite(y[[0, 2]]).all() and torch.isfinite(xs.grad[[0, 2]]).all()
    # The other rows, alone: the same values.
    alone = x[[0, 2]].detach().requires_grad_()
    y_alone = call(alone)
    y_alone.backward(dy[[0, 2]])
    assert torch.equal(y[[0, 2]], y_alone) and torch.equal(xs.grad[[0, 2]], alone.grad)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("eps", [float("inf"), 1e39])
@pytest.mark.parametrize("kind", ["layer_norm", "rms_norm", "add_layer_norm", "add_rms_norm"])
def test_an_eps_that_overflows_is_not_an_overflowing_row(device, dtype, eps, kind):
    """An eps past float32's range (inf, or 1e39 once in float32): rstd = 1 / sqrt(inf) = 0,
    so y is the bias (0 without one) and dx and dweight are 0, as PyTorch gives them, not the
    NaN of a row whose own statistics overflow."""
    n = 37
    x = random_input((4, n), dtype, device).requires_grad_()
    w = random_input((n,), dtype, device, scale=0.5, shift=1.0, seed=1).requires_grad_()
    b = random_input((n,), dtype, device, scale=0.5, seed=2).requires_grad_()
    zero = torch.zeros_like(x)
    calls = {
        "layer_norm": lambda: fusednorm.layer_norm(x, (n,), w, b, eps),
        "rms_norm": lambda: fusednorm.rms_norm(x, (n,), w, eps),
        "add_layer_norm": lambda: fusednorm.add_layer_norm(x, zero, (n,), w, b, eps)[0],
        "add_rms_norm": lambda: fusednorm.add_rms_norm(x, zero, (n,), w, eps)[0],
    }
    y = calls[kind]()
    dy = random_input(y.shape, dtype, device, seed=4)
    params = (x, w, b) if "layer" in kind else (x, w)
    grads = torch.autograd.grad(y, params, dy)
    expected = b.detach().expand_as(y) if "layer" in kind else torch.zeros_like(y)
    assert torch.equal(y, expected)
    assert torch.equal(grads[0], torch.zeros_like(x)) and torch.equal(grads[1], torch.zeros_like(w))
    if "layer" in kind:
        torch.testing.assert_close(grads[2], dy.float().sum(0).to(dtype))
    # PyTorch's own, where its kernels take this eps (CPU float32)
    if device == "cpu" and dtype == torch.float32:
        ref = (F.layer_norm(x, (n,), w, b, eps) if "layer" in kind
               else F.rms_norm(x, (n,), w, eps))
        assert torch.equal(y, ref)
