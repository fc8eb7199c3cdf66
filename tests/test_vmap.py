"""torch.func.vmap over every public op runs the op's vmap rule (fusednorm/ops/batching.py),
not functorch's per-element fallback: a batch on the data folds into the rows (one fused
call), batched parameters (an ensemble) take one call per element. Either way the results are
the unbatched op's."""
from __future__ import annotations

import contextlib

import pytest
import torch

from conftest import DEVICES
from op_cases import OPS, op_args

# The arguments that are row data (the rest are parameters), by op.
DATA = {"layer_norm": 1, "rms_norm": 1, "add_layer_norm": 2, "add_rms_norm": 2,
        "rms_norm_zero_centered": 1, "add_layer_norm_zero_centered": 2,
        "add_rms_norm_residual_fp32": 2, "gelu_ffn": 1, "layer_norm_gelu_ffn": 1}
# The FFN's GEMMs may block a batch of rows differently from one sample's: not bitwise.
BITWISE = {"layer_norm", "rms_norm", "add_layer_norm", "add_rms_norm",
           "rms_norm_zero_centered", "add_layer_norm_zero_centered", "add_rms_norm_residual_fp32"}


@contextlib.contextmanager
def no_vmap_fallback():
    """Inside, an op without a vmap rule raises instead of looping over the batch."""
    was = torch._C._functorch._is_vmap_fallback_enabled()
    torch._C._functorch._set_vmap_fallback_enabled(False)
    try:
        yield
    finally:
        torch._C._functorch._set_vmap_fallback_enabled(was)


def _assert_same(name, ours, theirs):
    for a, b in zip(ours, theirs):
        if name in BITWISE:
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(a, b)


def _stacked(fn, batch, args, in_dims):
    """fn called per batch element, outputs stacked on dim 0: what vmap must equal."""
    per = [fn(*[a.select(d, i) if d is not None else a for a, d in zip(args, in_dims)])
           for i in range(batch)]
    return tuple(torch.stack(o) for o in zip(*per))


def test_the_fallback_switch_works():
    """no_vmap_fallback does catch an op without a rule (else the tests below prove nothing)."""
    x = torch.randn(3, 4)
    with no_vmap_fallback(), pytest.raises(RuntimeError, match="vmap fallback"):
        torch.vmap(lambda t: torch.ops.fusednorm.layer_norm_apply(
            t, torch.zeros(()), torch.ones(()), None, None))(x)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bdim", [0, 1])
@pytest.mark.parametrize("name", list(OPS))
def test_vmap_over_the_data(name, bdim, dtype, device):
    """A batch on the rows' data (at dim 0 or 1), parameters shared: one fused call."""
    _, fused, _ = OPS[name]
    args = op_args(name, device, dtype)
    batch = 5
    n_data = DATA[name]
    gen = torch.Generator(device="cpu").manual_seed(11)
    data = [torch.randn((batch, *a.shape) if bdim == 0 else (a.shape[0], batch, *a.shape[1:]),
                        generator=gen).to(device, dtype) for a in args[:n_data]]
    args = data + args[n_data:]
    in_dims = (bdim,) * n_data + (None,) * (len(args) - n_data)
    with no_vmap_fallback():
        out = torch.vmap(fused, in_dims=in_dims)(*args)
    _assert_same(name, out, _stacked(fused, batch, args, in_dims))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["add_layer_norm", "add_rms_norm"])
def test_vmap_with_one_side_of_the_sum_unbatched(name, device):
    """input batched, residual shared (and the other way round)."""
    _, fused, _ = OPS[name]
    x, r, *params = op_args(name, device, torch.float32)
    xs = torch.stack([x * (i + 1) for i in range(4)])
    for in_dims, args in (((0, None), (xs, r)), ((None, 0), (x, xs))):
        in_dims = in_dims + (None,) * len(params)
        with no_vmap_fallback():
            out = torch.vmap(fused, in_dims=in_dims)(*args, *params)
        _assert_same(name, out, _stacked(fused, 4, (*args, *params), in_dims))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(OPS))
def test_vmap_over_parameters_as_an_ensemble(name, device):
    """Batched parameters (torch.func.stack_module_state's ensembles): the unbatched op's
    results for each member, bit for bit."""
    _, fused, _ = OPS[name]
    args = op_args(name, device, torch.float32)
    n_data = DATA[name]
    members = 3
    params = [torch.stack([p * (1 + 0.1 * i) for i in range(members)]) for p in args[n_data:]]
    in_dims = (None,) * n_data + (0,) * len(params)
    with no_vmap_fallback():
        out = torch.vmap(fused, in_dims=in_dims)(*args[:n_data], *params)
    expected = _stacked(fused, members, (*args[:n_data], *params), in_dims)
    for a, b in zip(out, expected):
        assert torch.equal(a, b)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(OPS))
def test_grad_of_vmap_and_per_sample_gradients(name, device):
    """grad through vmap equals grad of the op on the whole batch; vmap of grad (per-sample
    gradients) runs without the fallback and equals a loop of grads."""
    _, fused, _ = OPS[name]
    args = op_args(name, device, torch.float64)
    n_data = DATA[name]
    data, params = args[:n_data], args[n_data:]

    def loss(params, *sample):
        return sum(o.sin().sum() for o in fused(*sample, *params))

    with no_vmap_fallback():
        through_vmap = torch.func.grad(
            lambda p: sum(o.sin().sum() for o in torch.vmap(
                lambda *s: fused(*s, *p))(*data)))(params)
        per_sample = torch.vmap(torch.func.grad(loss), in_dims=(None,) + (0,) * n_data)(
            params, *data)
    whole = torch.func.grad(lambda p: loss(p, *data))(params)
    for a, b in zip(through_vmap, whole):
        torch.testing.assert_close(a, b)
    looped = [torch.func.grad(loss)(params, *(d[i] for d in data)) for i in range(data[0].shape[0])]
    for k, g in enumerate(per_sample):
        torch.testing.assert_close(g, torch.stack([s[k] for s in looped]))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(OPS))
def test_nested_vmap_over_the_data(name, device):
    """vmap of vmap (two batch dims on the data): each level folds its batch into the rows,
    and the op's per-row outputs (statistics, the FFN's hidden) keep the unbatched op's
    shape, so the outer level finds what it batched."""
    _, fused, _ = OPS[name]
    args = op_args(name, device, torch.float32)
    n_data = DATA[name]
    gen = torch.Generator(device="cpu").manual_seed(12)
    data = [torch.randn((3, 4, *a.shape), generator=gen).to(device) for a in args[:n_data]]
    params = args[n_data:]
    in_dims = (0,) * n_data + (None,) * len(params)
    with no_vmap_fallback():
        out = torch.vmap(torch.vmap(fused, in_dims=in_dims), in_dims=in_dims)(*data, *params)
    expected = _stacked(lambda *a: _stacked(fused, 4, a, in_dims), 3, (*data, *params), in_dims)
    _assert_same(name, out, expected)


@pytest.mark.parametrize("op", ["layer_norm", "rms_norm", "add_layer_norm", "gelu_ffn",
                                "layer_norm_gelu_ffn"])
@pytest.mark.parametrize("shape", [(5,), (2, 3, 5)], ids=["one row", "rows"])
def test_the_rule_keeps_each_outputs_unbatched_shape(op, shape):
    """Every output of a folded call, per batch element, has the unbatched op's shape (a
    1-d input's statistics are [1], not a scalar); a batch of 0 elements too."""
    d = shape[-1]
    ln = (list(shape[-1:]), None, None, 1e-5, False)
    call = {
        "layer_norm": lambda x: torch.ops.fusednorm.layer_norm(x, *ln),
        "rms_norm": lambda x: torch.ops.fusednorm.rms_norm(x, [d], None, 1e-5, False),
        "add_layer_norm": lambda x: torch.ops.fusednorm.add_layer_norm(
            x, x, *ln, None, 0.0, None),
        "gelu_ffn": lambda x: torch.ops.fusednorm.gelu_ffn(
            x, torch.ones(7, d), None, torch.ones(d, 7), None, "none"),
        "layer_norm_gelu_ffn": lambda x: torch.ops.fusednorm.layer_norm_gelu_ffn(
            x, None, None, 1e-5, torch.ones(7, d), None, torch.ones(d, 7), None, "none"),
    }[op]
    one = call(torch.randn(shape))
    for batch in (4, 0):
        with no_vmap_fallback():
            batched = torch.vmap(call)(torch.randn(batch, *shape))
        for unbatched, b in zip(one, batched):
            if unbatched.numel() == 2:  # rng_state: one per call, not batched
                continue
            assert b.shape == (batch, *unbatched.shape), (b.shape, unbatched.shape)
