"""norm_bwd's grad_x: the add ops' input gradient written by the backward's own pass (x_dtype
given), bitwise what the second pass over the sum's gradient gave before it:
dropout_scale(grad_input, rowscale, rng_state, p, x_dtype) with dropout / rowscale, and
grad_input.to(x_dtype) for a float32 sum beside 16-bit inputs (residual_dtype). The old pass
is the oracle, on random data, odd and vector-aligned N, every dtype pair, with and without
weight and grad_sum; then end to end through the add ops' autograd."""
from __future__ import annotations

import pytest
import torch

import fusednorm
from conftest import DEVICES, random_input

O = torch.ops.fusednorm
F16, BF16, F32, F64 = torch.float16, torch.bfloat16, torch.float32, torch.float64
# (x's dtype, the sum's): the input's own, and the float32 residual stream of 16-bit inputs.
PAIRS = [(F32, F32), (F64, F64), (F16, F16), (BF16, BF16), (F16, F32), (BF16, F32)]
# (dropout_p, rowscale)
MULTIPLIERS = [(0.0, False), (0.3, False), (0.0, True), (0.5, True), (1.0, False)]


def _stats_dtype(dtype):
    return F64 if dtype == F64 else F32


def _forward(device, centered, x_dtype, sum_dtype, M, N, p, with_rowscale, with_weight, seed):
    x = random_input((M, N), x_dtype, device, seed=seed)
    r = random_input((M, N), sum_dtype, device, seed=seed + 1)
    pdtype = F32 if x_dtype in (F16, BF16) and sum_dtype == F32 else x_dtype
    w = random_input((N,), pdtype, device, seed=seed + 2) if with_weight else None
    b = random_input((N,), pdtype, device, seed=seed + 3) if with_weight and centered else None
    rowscale = (torch.rand(M, device=device, dtype=_stats_dtype(x_dtype)) + 0.5
                if with_rowscale else None)
    rng_state = torch.empty(2, dtype=torch.long, device=device) if p > 0 else None
    _, s, mean, rstd = O.norm_fwd(x, r, w, b, 1e-5, centered,
                                  sum_dtype if sum_dtype != x_dtype else None, p, rowscale,
                                  rng_state)
    return x, s, mean, rstd, w, b, rowscale, rng_state


# Where the input's gradient differs from grad_input: a wider sum, or multipliers.
ASKED = [(x, s, p, rs) for x, s in PAIRS for p, rs in MULTIPLIERS if x != s or p > 0 or rs]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("centered", [True, False])
@pytest.mark.parametrize("x_dtype, sum_dtype, p, with_rowscale", ASKED)
@pytest.mark.parametrize("N", [37, 64, 333])
def test_grad_x_is_the_second_pass(device, centered, x_dtype, sum_dtype, p, with_rowscale, N):
    M = 9
    for with_weight, with_grad_sum in [(True, True), (False, False)]:
        x, s, mean, rstd, w, b, rowscale, rng_state = _forward(
            device, centered, x_dtype, sum_dtype, M, N, p, with_rowscale, with_weight, seed=N)
        dy = random_input((M, N), x_dtype, device, seed=N + 7)
        ds = random_input((M, N), sum_dtype, device, seed=N + 8) if with_grad_sum else None
        if not centered:
            mean = torch.empty(0, dtype=rstd.dtype, device=device)
        plain = O.norm_bwd(dy, ds, s, mean, rstd, w, b, centered)
        fused = O.norm_bwd(dy, ds, s, mean, rstd, w, b, centered, x_dtype, p, rowscale,
                           rng_state)
        assert plain[3].shape == (0,)
        for a, c in zip(plain[:3], fused[:3]):  # grad_input and the parameters' unchanged
            assert torch.equal(a, c)
        grad_input = plain[0]
        if p > 0 or with_rowscale:
            state = rng_state if rng_state is not None else torch.empty(0, dtype=torch.long,
                                                                        device=device)
            want = O.dropout_scale(grad_input, rowscale, state, p, x_dtype)
        else:
            want = grad_input.to(x_dtype)
        assert fused[3].dtype == x_dtype and fused[3].shape == (M, N)
        assert torch.equal(fused[3], want), (fused[3] - want).abs().max()


@pytest.mark.parametrize("device", DEVICES)
def test_grad_x_without_rows(device):
    x, s, mean, rstd, w, b, rowscale, rng_state = _forward(
        device, True, BF16, F32, 0, 16, 0.2, True, True, seed=1)
    dy = torch.empty(0, 16, dtype=BF16, device=device)
    grads = O.norm_bwd(dy, None, s, mean, rstd, w, b, True, BF16, 0.2, rowscale,
                       torch.zeros(2, dtype=torch.long, device=device))
    assert grads[3].shape == (0, 16) and grads[3].dtype == BF16


@pytest.mark.parametrize("kind", ["layer_norm", "rms_norm"])
@pytest.mark.parametrize("x_dtype, sum_dtype", PAIRS)
@pytest.mark.parametrize("p, with_rowscale", [(0.0, False), (0.25, True)])
def test_add_ops_input_gradient_end_to_end(kind, x_dtype, sum_dtype, p, with_rowscale):
    """x.grad of the add op equals the old second pass applied to the residual's gradient
    (a residual of the sum's dtype: the sum's gradient itself)."""
    M, N = 6, 45
    x = random_input((2, M // 2, N), x_dtype, "cpu", seed=3).requires_grad_()
    r = random_input((2, M // 2, N), sum_dtype, "cpu", seed=4).requires_grad_()
    rowscale = torch.rand(2, M // 2, dtype=_stats_dtype(x_dtype)) + 0.5 if with_rowscale else None
    kw = dict(residual_dtype=F32 if sum_dtype != x_dtype else None)
    if kind == "layer_norm":
        out = torch.ops.fusednorm.add_layer_norm(x, r, (N,), None, None, 1e-5, False,
                                                 kw["residual_dtype"], p, rowscale)
    else:
        out = torch.ops.fusednorm.add_rms_norm(x, r, (N,), None, 1e-6, False,
                                               kw["residual_dtype"], p, rowscale)
    y, s, rng_state = out[0], out[1], out[-1]
    (y.float().square().sum() + (s.float() * 0.5).sin().sum()).backward()
    dsum = r.grad.reshape(M, N)
    if p > 0 or with_rowscale:
        want = O.dropout_scale(dsum, None if rowscale is None else rowscale.reshape(-1),
                               rng_state, p, x_dtype)
    else:
        want = dsum.to(x_dtype)
    assert torch.equal(x.grad.reshape(M, N), want)


def test_sixteen_bit_residual_beside_a_float32_sum_shares_the_input_gradient():
    """A 16-bit residual of a float32 sum, no multipliers: its gradient is the input's."""
    x = random_input((4, 33), BF16, "cpu", seed=5).requires_grad_()
    r = random_input((4, 33), BF16, "cpu", seed=6).requires_grad_()
    y, s = fusednorm.add_rms_norm(x, r, (33,), residual_dtype=F32)
    (y.float().sum() + s.square().sum()).backward()
    assert torch.equal(x.grad, r.grad)


def test_backend_checks():
    x, s, mean, rstd, w, b, rowscale, rng_state = _forward(
        "cpu", True, BF16, F32, 3, 8, 0.2, True, True, seed=2)
    dy = random_input((3, 8), BF16, "cpu", seed=9)
    with pytest.raises(RuntimeError, match="x_dtype must be grad_out's dtype"):
        O.norm_bwd(dy, None, s, mean, rstd, w, b, True, F32)
    with pytest.raises(RuntimeError, match="need x_dtype"):
        O.norm_bwd(dy, None, s, mean, rstd, w, b, True, None, 0.2, rowscale, rng_state)
    with pytest.raises(RuntimeError, match="rng_state must be given exactly"):
        O.norm_bwd(dy, None, s, mean, rstd, w, b, True, BF16, 0.2, rowscale, None)
    with pytest.raises(RuntimeError, match="rowscale must have shape"):
        O.norm_bwd(dy, None, s, mean, rstd, w, b, True, BF16, 0.2, rowscale[:2], rng_state)
