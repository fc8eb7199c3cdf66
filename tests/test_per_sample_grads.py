"""torch's per-sample gradients (torch.nn.utils._per_sample_grad.call_for_per_sample_grads,
the ExpandedWeight mechanism DP-SGD trainers use): the modules give each parameter its
grad_sample, equal to the gradient of each sample's loss taken alone, as nn.LayerNorm and
nn.Linear do; the RMSNorm ops raise, as torch's F.rms_norm does (torch has no rule for it)."""
from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.utils._per_sample_grad import call_for_per_sample_grads

from conftest import DEVICES, random_input
from fusednorm import (FusedAddLayerNorm, FusedAddRMSNorm, FusedGeluFFN, FusedLayerNorm,
                       FusedLayerNormGeluFFN, FusedRMSNorm)
from fusednorm.errors import FusedTypeError

BATCH, SEQ, D = 5, 3, 24


def _randomized(module: nn.Module, device: str) -> nn.Module:
    module = module.to(device=device, dtype=torch.float64)
    with torch.no_grad():
        for i, p in enumerate(module.parameters()):
            p.copy_(random_input(p.shape, p.dtype, device, scale=0.5, shift=0.5, seed=30 + i))
    return module


def _loss(out) -> torch.Tensor:
    """A loss that weighs every output element differently (a plain sum would make the
    gradient through a LayerNorm's normalization vanish)."""
    outs = out if isinstance(out, tuple) else (out,)
    total = 0
    for k, o in enumerate(outs):
        w = torch.linspace(-1.0, 2.0, o.shape[-1], dtype=o.dtype, device=o.device) * (k + 1)
        total = total + (o.sin() * w).sum()
    return total


def _one_by_one(module: nn.Module, inputs: list) -> dict:
    """name -> [BATCH, *param.shape]: the gradient of each sample's loss, taken alone."""
    grads = {name: [] for name, _ in module.named_parameters()}
    for b in range(BATCH):
        module.zero_grad()
        _loss(module(*(t[b:b + 1] for t in inputs))).backward()
        for name, p in module.named_parameters():
            grads[name].append(p.grad.clone())
    return {name: torch.stack(g) for name, g in grads.items()}


MODULES = [
    ("layer_norm", lambda: FusedLayerNorm(D), 1),
    ("layer_norm no bias", lambda: FusedLayerNorm(D, bias=False), 1),
    ("add_layer_norm", lambda: FusedAddLayerNorm(D), 2),
    ("gelu_ffn", lambda: FusedGeluFFN(D, 2 * D), 1),
    ("gelu_ffn tanh", lambda: FusedGeluFFN(D, 2 * D, approximate="tanh"), 1),
    ("layer_norm_gelu_ffn", lambda: FusedLayerNormGeluFFN(D, 2 * D), 1),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name, make, n_inputs", MODULES, ids=[m[0] for m in MODULES])
def test_grad_sample_is_each_samples_own_gradient(device, name, make, n_inputs):
    module = _randomized(make(), device)
    inputs = [random_input((BATCH, SEQ, D), torch.float64, device, seed=k) for k in range(n_inputs)]
    want = _one_by_one(module, inputs)
    module.zero_grad()
    _loss(call_for_per_sample_grads(module, loss_reduction="sum")(*inputs)).backward()
    for pname, p in module.named_parameters():
        assert p.grad_sample.shape == (BATCH, *p.shape), pname
        torch.testing.assert_close(p.grad_sample, want[pname], rtol=1e-9, atol=1e-10,
                                   msg=lambda m: f"{name} {pname}: {m}")


@pytest.mark.parametrize("module", [FusedRMSNorm(D), FusedAddRMSNorm(D)],
                         ids=["rms_norm", "add_rms_norm"])
def test_rms_norm_raises_as_torchs(module):
    inputs = [torch.randn(BATCH, D) for _ in range(2 if isinstance(module, FusedAddRMSNorm) else 1)]
    with pytest.raises(RuntimeError, match="Expanded Weights"):
        call_for_per_sample_grads(nn.RMSNorm(D))(inputs[0])  # torch's own refusal
    with pytest.raises(RuntimeError, match="Expanded Weights"):
        call_for_per_sample_grads(module)(*inputs)


def test_zero_centered_weight_has_no_per_sample_rule():
    module = FusedLayerNorm(D, zero_centered_weight=True)
    with pytest.raises(FusedTypeError, match="zero_centered_weight"):
        call_for_per_sample_grads(module)(torch.randn(BATCH, D))
