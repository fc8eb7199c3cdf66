"""torch.fx.symbolic_trace of the modules (the tracer that FX quantization, torchvision's
feature extraction and graph-rewriting tools run): each traces to a graph that calls
fusednorm's op, the add ops' two outputs as two getitem nodes, and the traced module
computes what the eager one does, outputs and gradients."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from conftest import random_input
from fusednorm import (FusedAddLayerNorm, FusedAddRMSNorm, FusedGeluFFN, FusedLayerNorm,
                       FusedLayerNorm2d, FusedLayerNormGeluFFN, FusedRMSNorm)

D = 24
MODULES = [
    ("layer_norm", lambda: FusedLayerNorm(D), 1, (5, D)),
    ("rms_norm", lambda: FusedRMSNorm(D, zero_centered_weight=True), 1, (5, D)),
    ("add_layer_norm", lambda: FusedAddLayerNorm(D), 2, (5, D)),
    ("add_rms_norm", lambda: FusedAddRMSNorm(D, residual_dtype=torch.float32), 2, (5, D)),
    ("gelu_ffn", lambda: FusedGeluFFN(D), 1, (5, D)),
    ("layer_norm_gelu_ffn", lambda: FusedLayerNormGeluFFN(D), 1, (5, D)),
    ("layer_norm_2d", lambda: FusedLayerNorm2d(D), 1, (2, D, 3, 5)),
]


class _Block(nn.Module):
    """A pre-norm residual step as user code writes it: the add module's two outputs
    unpacked and used."""

    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.norm = norm

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        y, s = self.norm(x, residual)
        return y * 2 + s


def _outputs(out) -> tuple:
    return out if isinstance(out, tuple) else (out,)


def _same_outputs_and_grads(module: nn.Module, traced: nn.Module, inputs: list) -> None:
    mine = [t.detach().requires_grad_() for t in inputs]
    theirs = [t.detach().requires_grad_() for t in inputs]
    want, got = _outputs(module(*mine)), _outputs(traced(*theirs))
    assert len(want) == len(got)
    for w, g in zip(want, got):
        assert g.dtype == w.dtype and torch.equal(g, w)
    grads = [random_input(w.shape, w.dtype, "cpu", seed=20 + i) for i, w in enumerate(want)]
    names = [name for name, _ in module.named_parameters()]
    traced_params = dict(traced.named_parameters())
    assert sorted(traced_params) == sorted(names)
    want_grads = torch.autograd.grad(want, [*mine, *module.parameters()], grads)
    got_grads = torch.autograd.grad(got, [*theirs, *(traced_params[n] for n in names)], grads)
    for what, w, g in zip([f"input {k}" for k in range(len(inputs))] + names, want_grads,
                          got_grads):
        assert torch.equal(g, w), what


@pytest.mark.parametrize("name, make, n_inputs, shape", MODULES, ids=[m[0] for m in MODULES])
def test_symbolic_trace_calls_the_op(name, make, n_inputs, shape):
    module = make()
    with torch.no_grad():
        for i, p in enumerate(module.parameters()):
            p.copy_(random_input(p.shape, p.dtype, "cpu", scale=0.5, shift=0.5, seed=10 + i))
    traced = torch.fx.symbolic_trace(module)
    targets = [str(n.target) for n in traced.graph.nodes if n.op == "call_function"]
    assert any(t.startswith("fusednorm.") for t in targets), targets
    inputs = [random_input(shape, torch.float32, "cpu", seed=k) for k in range(n_inputs)]
    _same_outputs_and_grads(module, traced, inputs)


@pytest.mark.parametrize("cls", [FusedAddLayerNorm, FusedAddRMSNorm])
def test_symbolic_trace_of_a_block_that_unpacks_the_add_outputs(cls):
    block = _Block(cls(D))
    traced = torch.fx.symbolic_trace(block)
    getitems = [n for n in traced.graph.nodes if n.op == "call_function" and "getitem" in str(n.target)]
    assert len(getitems) == 2
    inputs = [random_input((4, 3, D), torch.float32, "cpu", seed=k) for k in range(2)]
    _same_outputs_and_grads(block, traced, inputs)


def _library_norms():
    """(name, factory) of other libraries' norm classes whose swap targets convert their
    parameters by the input's dtype (swap_targets.fused_param), where installed."""
    found = []
    try:
        import timm.layers as layers
    except ImportError:
        layers = None
    if layers is not None:
        found += [("timm.LayerNormFp32", lambda: layers.LayerNormFp32(D)),
                  ("timm.RmsNormFp32", lambda: layers.RmsNormFp32(D)),
                  ("timm.LayerNormAct", lambda: layers.LayerNormActFp32(D))]
    try:
        from transformers.models.cohere.modeling_cohere import CohereLayerNorm
    except ImportError:
        CohereLayerNorm = None
    if CohereLayerNorm is not None:
        found.append(("transformers.CohereLayerNorm", lambda: CohereLayerNorm(D)))
    return found or [pytest.param(None, None, marks=pytest.mark.skip(
        reason="needs timm or transformers"))]


@pytest.mark.parametrize("name, make", _library_norms())
def test_symbolic_trace_of_swapped_library_norms(name, make):
    """A model that traced before replace_norms traces after it: the targets that convert
    their parameters by the input's dtype (fused_param) trace it as a leaf; the traced
    module computes what the swapped one does, outputs and gradients."""
    import fusednorm

    original = nn.Sequential(make())
    with torch.no_grad():
        for i, p in enumerate(original.parameters()):
            p.copy_(random_input(p.shape, p.dtype, "cpu", scale=0.5, shift=0.5, seed=10 + i))
    torch.fx.symbolic_trace(original)
    swapped = fusednorm.replace_norms(original)
    assert type(swapped[0]).__module__.startswith("fusednorm"), type(swapped[0])
    traced = torch.fx.symbolic_trace(swapped)
    targets = [str(n.target) for n in traced.graph.nodes if n.op == "call_function"]
    assert any(t.startswith("fusednorm.") for t in targets), targets
    _same_outputs_and_grads(swapped, traced, [random_input((5, D), torch.float32, "cpu")])
