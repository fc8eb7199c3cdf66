"""torch.jit.script of the modules: the scripted forward calls fusednorm's ops itself
(torch.ops.fusednorm), so a scripted model computes what the eager one does, trains
(the ops' autograd), and saves and loads; the FFN modules call their submodules, unfused,
where calling them does more than the fused op (decided as the module is scripted)."""
from __future__ import annotations

import io

import pytest
import torch
from torch import nn

from conftest import DEVICES, random_input
from fusednorm import (FusedAddLayerNorm, FusedAddRMSNorm, FusedGeluFFN, FusedLayerNorm,
                       FusedLayerNorm2d, FusedLayerNormGeluFFN, FusedRMSNorm)

D = 40
NORMS = [
    (FusedLayerNorm, {}, "layer_norm"),
    (FusedLayerNorm, {"zero_centered_weight": True}, "layer_norm"),
    (FusedLayerNorm, {"bias": False}, "layer_norm"),
    (FusedRMSNorm, {}, "rms_norm"),
    (FusedRMSNorm, {"eps": 1e-3, "zero_centered_weight": True}, "rms_norm"),
    (FusedAddLayerNorm, {}, "add_layer_norm"),
    (FusedAddLayerNorm, {"residual_dtype": torch.float32}, "add_layer_norm"),
    (FusedAddRMSNorm, {"zero_centered_weight": True}, "add_rms_norm"),
]


def _outputs(out):
    return out if isinstance(out, tuple) else (out,)


def _round_trip(scripted):
    buf = io.BytesIO()
    torch.jit.save(scripted, buf)
    buf.seek(0)
    return torch.jit.load(buf)


def _randomized(module, device):
    module = module.to(device)
    with torch.no_grad():
        for i, p in enumerate(module.parameters()):
            p.copy_(random_input(p.shape, p.dtype, device, scale=0.5, shift=0.5, seed=10 + i))
    return module


def _check_same(module, scripted, args):
    """Forward outputs and every gradient (inputs and parameters) bitwise equal."""
    leaves = [a.detach().requires_grad_() for a in args]
    script_leaves = [a.detach().requires_grad_() for a in args]
    want = _outputs(module(*leaves))
    got = _outputs(scripted(*script_leaves))
    assert len(want) == len(got)
    for w, g in zip(want, got):
        assert g.dtype == w.dtype and torch.equal(g, w)
    grads = [random_input(w.shape, w.dtype, w.device, scale=1.0, shift=0.0, seed=20 + i)
             for i, w in enumerate(want)]
    torch.autograd.backward(want, grads)
    torch.autograd.backward(got, grads)
    for a, b in zip(leaves, script_leaves):
        assert torch.equal(b.grad, a.grad)
    for (name, p), q in zip(module.named_parameters(), scripted.parameters()):
        assert q.grad is not None and torch.equal(q.grad, p.grad), name


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cls, kwargs, op", NORMS, ids=[f"{c.__name__}-{k}" for c, k, _ in NORMS])
def test_scripted_norm_modules_call_the_op(device, cls, kwargs, op):
    module = _randomized(cls(D, **kwargs), device)
    scripted = torch.jit.script(module)
    assert f"fusednorm::{op}" in str(scripted.inlined_graph)
    dtype = torch.bfloat16 if "residual_dtype" in kwargs else torch.float32
    x = random_input((3, 7, D), dtype, device)
    args = (x, random_input((3, 7, D), dtype, device, seed=4)) if op.startswith("add") else (x,)
    if "residual_dtype" in kwargs:
        module, scripted = module.to(dtype), torch.jit.script(module.to(dtype))
        args = (x, args[1].float())
    _check_same(module, scripted, args)
    loaded = _round_trip(scripted)
    for w, g in zip(_outputs(module(*args)), _outputs(loaded(*args))):
        assert torch.equal(g, w)


@pytest.mark.parametrize("device", DEVICES)
def test_scripted_layer_norm_2d(device):
    """FusedLayerNorm2d (channels of an NCHW tensor) scripts as timm's LayerNorm2d does."""
    module = _randomized(FusedLayerNorm2d(D), device)
    scripted = torch.jit.script(module)
    assert "fusednorm::layer_norm" in str(scripted.inlined_graph)
    _check_same(module, scripted, (random_input((2, D, 3, 5), torch.float32, device),))


@pytest.mark.parametrize("cls", [FusedAddLayerNorm, FusedAddRMSNorm])
def test_scripted_add_norm_dropout_in_training_mode_only(cls):
    """Training mode draws the mask the eager module draws from the same generator state;
    eval mode adds without dropout."""
    module = _randomized(cls(D, dropout_p=0.3), "cpu")
    scripted = torch.jit.script(module)
    x, r = random_input((5, D), torch.float32, "cpu"), random_input((5, D), torch.float32, "cpu", seed=2)
    torch.manual_seed(7)
    want = module(x, r)
    torch.manual_seed(7)
    got = scripted(x, r)
    assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0])
    assert not torch.equal(want[1], x + r)  # a mask was drawn
    module.eval()
    scripted.eval()
    assert torch.equal(scripted(x, r)[1], x + r)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cls, op", [(FusedGeluFFN, "gelu_ffn"),
                                     (FusedLayerNormGeluFFN, "layer_norm_gelu_ffn")])
def test_scripted_ffn_modules(device, cls, op):
    """The fused op where the submodules are plain; their own forward, unfused, where one is
    replaced by a Linear that does more (as a LoRA or float8 layer)."""
    module = _randomized(cls(D, 56, approximate="tanh"), device)
    scripted = torch.jit.script(module)
    assert f"fusednorm::{op}(" in str(scripted.inlined_graph)
    x = random_input((2, 9, D), torch.float32, device)
    _check_same(module, scripted, (x,))
    loaded = _round_trip(scripted)
    assert torch.equal(loaded(x), module(x))

    class Doubled(nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return 2.0 * nn.functional.linear(x, self.weight, self.bias)

    plain = module.fc1
    module.fc1 = Doubled(D, 56, device=device)
    module.fc1.load_state_dict(plain.state_dict())
    scripted = torch.jit.script(module)
    assert f"fusednorm::{op}(" not in str(scripted.inlined_graph)
    torch.testing.assert_close(scripted(x), module(x))
    # The replaced submodule's work is in the result (not the fused op's).
    module.fc1 = plain
    assert not torch.allclose(scripted(x), module(x))


@pytest.mark.parametrize("eps_name", ["variance_epsilon", "eps"])
def test_scripted_hf_rms_norm_keeps_its_eps(eps_name):
    """FusedHFRMSNorm (Hugging Face's RMSNorm swapped in place) scripts with the eps of the
    class it replaced, under either of the names those classes give it."""
    from fusednorm import FusedHFRMSNorm

    module = FusedHFRMSNorm()
    module.weight = nn.Parameter(random_input((D,), torch.float32, "cpu", seed=3))
    setattr(module, eps_name, 0.5)  # large: a dropped eps changes the result
    scripted = torch.jit.script(module)
    assert "fusednorm::rms_norm" in str(scripted.inlined_graph)
    x = random_input((3, D), torch.float32, "cpu", scale=0.3)
    _check_same(module, scripted, (x,))
    setattr(module, eps_name, 1e-6)
    assert not torch.allclose(module(x), scripted(x))
