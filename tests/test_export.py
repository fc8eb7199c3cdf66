"""torch.export of models built from fusednorm's modules: strict and non-strict (the
default) tracing keep every fused op as one graph node, dynamic shapes included, and the
exported program computes what the module does, also after a save / load round trip and
compiled ahead of time by AOTInductor."""
from __future__ import annotations

import io
import json
import zipfile

import pytest
import torch

import fusednorm
from conftest import DEVICES, random_input

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


@pytest.mark.slow  # compiles a C++ wrapper (about 10 s)
@pytest.mark.parametrize("device", DEVICES)
def test_aot_inductor_package_calls_the_fused_ops(device, tmp_path):
    """AOTInductor (torch._inductor.aoti_compile_and_package) keeps each fused op as an extern
    call of the op (its proxy executor: the process has imported fusednorm), dynamic batch
    included, and the loaded package computes what the module does."""
    torch.manual_seed(0)
    model = Block().to(device).eval()
    x = random_input((2, 5, D), torch.float32, device)
    r = random_input((2, 5, D), torch.float32, device, seed=1)
    batch = torch.export.Dim("batch")
    program = torch.export.export(model, (x, r), dynamic_shapes=({0: batch}, {0: batch}))
    path = torch._inductor.aoti_compile_and_package(program,
                                                    package_path=str(tmp_path / "block.pt2"))
    with zipfile.ZipFile(path) as package:
        (wrapper,) = [n for n in package.namelist() if n.endswith(".wrapper.json")]
        extern = {node["node"]["target"] for node in json.loads(package.read(wrapper))["nodes"]}
    assert {f"fusednorm::{op}" for op in OPS} <= extern, extern
    loaded = torch._inductor.aoti_load_package(path)
    for rows in (2, 7):
        x = random_input((rows, 5, D), torch.float32, device, seed=2)
        r = random_input((rows, 5, D), torch.float32, device, seed=3)
        torch.testing.assert_close(loaded(x, r), model(x, r))
