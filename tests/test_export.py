"""torch.export of models built from fusednorm's modules: strict and non-strict (the
default) tracing keep every fused op as one graph node, dynamic shapes included, and the
exported program computes what the module does, also after a save / load round trip."""
from __future__ import annotations

import io

import pytest
import torch

import fusednorm
from conftest import random_input

D = 16


class Block(torch.nn.Module):
    """A pre-norm transformer block's norms and FFN: every fused op of the library."""

    def __init__(self):
        super().__init__()
        self.ln = fusednorm.FusedLayerNorm(D)
        self.rms = fusednorm.FusedRMSNorm(D)
        self.add_ln = fusednorm.FusedAddLayerNorm(D)
        self.add_rms = fusednorm.FusedAddRMSNorm(D)
        self.ffn = fusednorm.FusedGeluFFN(D, 24)
        self.block = fusednorm.FusedLayerNormGeluFFN(D, d_hidden=24)

    def forward(self, x, residual):
        y, s = self.add_ln(self.ln(x), residual)
        z, s = self.add_rms(self.rms(y), s)
        return self.block(self.ffn(z)) + s


OPS = ["layer_norm", "rms_norm", "add_layer_norm", "add_rms_norm", "gelu_ffn",
       "layer_norm_gelu_ffn"]


@pytest.mark.parametrize("strict", [False, True])
def test_export_keeps_every_fused_op(strict):
    torch.manual_seed(0)
    model = Block().eval()
    x = random_input((2, 5, D), torch.float32, "cpu")
    r = random_input((2, 5, D), torch.float32, "cpu", seed=1)
    batch = torch.export.Dim("batch")
    program = torch.export.export(model, (x, r), strict=strict,
                                  dynamic_shapes=({0: batch}, {0: batch}))
    targets = [str(n.target) for n in program.graph.nodes if n.op == "call_function"]
    for op in OPS:
        assert f"fusednorm.{op}.default" in targets, (op, targets)
    assert not any("linear" in t or "native_layer_norm" in t for t in targets), targets

    buffer = io.BytesIO()
    torch.export.save(program, buffer)
    buffer.seek(0)
    loaded = torch.export.load(buffer)
    for rows in (2, 7):
        x = random_input((rows, 5, D), torch.float32, "cpu", seed=2)
        r = random_input((rows, 5, D), torch.float32, "cpu", seed=3)
        want = model(x, r)
        assert torch.equal(program.module()(x, r), want)
        assert torch.equal(loaded.module()(x, r), want)
