"""Exporting to ONNX: while torch.onnx.export traces, fusednorm.functional traces each op's
ATen form (fusednorm.ops.decompositions; LayerNorm as ONNX's LayerNormalization). The
decompositions give each op's outputs (the statistics too) against the op itself on the
CPU, every dtype, parameter case and add-op option; a model traced that way holds no
fusednorm node and computes what the model does; torch.export otherwise keeps the fused
ops. With onnxscript and onnxruntime installed (not fusednorm's
dependencies), a model of every module exports with a dynamic batch and runs in
onnxruntime, and so does a small Llama-style transformers model with its norms swapped.
The TorchScript-based exporter (dynamo=False) traces with the JIT tracer, under which the
same routing holds; torch.jit.trace alone keeps the fused ops."""
from __future__ import annotations

import io

import pytest
import torch

from conftest import random_input
from test_export import Block
from fusednorm.errors import FusedValueError
from fusednorm.ops import decompositions

OPS = torch.ops.fusednorm
DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
PUBLIC = ["layer_norm", "rms_norm", "add_layer_norm", "add_rms_norm", "gelu_ffn",
          "layer_norm_gelu_ffn"]


def _close(got, want, exact=False):
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, want.dtype,
                                                                  got.shape, want.shape)
    if exact:
        assert torch.equal(got, want)
    else:
        # One rounding to the output's dtype apart, from float32 (float64) values that the
        # two compute in different orders.
        eps = torch.finfo(want.dtype).eps
        scale = want.double().abs().max().item() + 1
        torch.testing.assert_close(got.double(), want.double(), rtol=2 * eps, atol=4 * eps * scale)


def _check(name, args, exact_outputs=()):
    want = getattr(OPS, name)(*args)
    got = getattr(decompositions, name)(*args)
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        if w.numel() == 0 and g.numel() == 0:
            assert g.dtype == w.dtype and g.shape == w.shape
            continue
        _close(g, w, exact=i in exact_outputs)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("affine", ["wb", "w", "none", "fp32 params", "zero centered"])
def test_layer_norm_and_rms_norm(dtype, affine):
    x = random_input((3, 5, 37), dtype, "cpu", seed=1)
    param = torch.float32 if affine == "fp32 params" and dtype in (torch.bfloat16, torch.float16) else dtype
    w = random_input((37,), param, "cpu", seed=2) if affine != "none" else None
    b = random_input((37,), param, "cpu", seed=3) if affine in ("wb", "fp32 params", "zero centered") else None
    zc = affine == "zero centered"
    _check("layer_norm", (x, [37], w, b, 1e-5, zc))
    _check("rms_norm", (x, [37], w, None, zc))
    _check("rms_norm", (x, [37], w, 1e-3, zc))
    # Two normalized dims, a strided view, an empty batch.
    x2 = random_input((7, 4, 6), dtype, "cpu", seed=4).transpose(0, 1)
    _check("layer_norm", (x2, [7, 6][1:], None, None, 1e-5, False))
    _check("layer_norm", (random_input((2, 3, 4), dtype, "cpu", seed=5), [3, 4], None, None, 1e-5,
                          False))
    _check("rms_norm", (x[:0], [37], w, None, zc))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("affine", ["wb", "w", "none", "zero centered"])
def test_norm_forms_under_the_jit_tracer(dtype, affine):
    """The forms the TorchScript exporter traces (aten.layer_norm; RMSNorm's primitives):
    every output as the op's, in the traced function too."""
    x = random_input((3, 5, 37), dtype, "cpu", seed=1)
    w = random_input((37,), dtype, "cpu", seed=2) if affine != "none" else None
    b = random_input((37,), dtype, "cpu", seed=3) if affine in ("wb", "zero centered") else None
    zc = affine == "zero centered"
    for name, rest in (("layer_norm", ([37], w, b, 1e-5, zc)), ("rms_norm", ([37], w, None, zc)),
                       ("rms_norm", ([37], w, 1e-3, zc))):
        form = getattr(decompositions, name)
        traced = torch.jit.trace(lambda t, form=form, rest=rest: form(t, *rest), (x,),
                                 check_trace=False)
        kinds = {node.kind() for node in traced.inlined_graph.nodes()}
        assert "aten::rms_norm" not in kinds, kinds
        assert ("aten::layer_norm" in kinds) == (name == "layer_norm"), kinds
        want = getattr(OPS, name)(x, *rest)
        for got in (traced(x), form(x, *rest)):
            for g, w_ in zip(got, want):
                _close(g, w_)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("option", ["plain", "fp32 sum", "rowscale", "fp32 sum rowscale",
                                    "zero centered"])
@pytest.mark.parametrize("name", ["add_layer_norm", "add_rms_norm"])
def test_add_ops(name, dtype, option):
    """The sum exactly (x * rowscale and + residual each rounded in the computation type,
    then once to the sum's dtype); out and the statistics as the op's."""
    x = random_input((4, 3, 29), dtype, "cpu", seed=1)
    wide = "fp32 sum" in option
    r = random_input((4, 3, 29), torch.float32 if wide and dtype != torch.float64 else dtype, "cpu",
                     seed=2)
    w = random_input((29,), dtype, "cpu", seed=3)
    b = random_input((29,), dtype, "cpu", seed=4)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    rowscale = random_input((4, 3), acc, "cpu", seed=5) if "rowscale" in option else None
    rest = (option == "zero centered", torch.float32 if wide else None, 0.0, rowscale)
    if name == "add_layer_norm":
        _check(name, (x, r, [29], w, b, 1e-5, *rest), exact_outputs=(1,))
    else:
        _check(name, (x, r, [29], w, None, *rest), exact_outputs=(1,))


def test_add_ops_dropout_has_no_decomposition():
    x = random_input((2, 8), torch.float32, "cpu", seed=1)
    with pytest.raises(FusedValueError, match="dropout_p"):
        decompositions.add_layer_norm(x, x, [8], None, None, 1e-5, False, None, 0.1, None)
    with pytest.raises(FusedValueError, match="dropout_p"):
        decompositions.add_rms_norm(x, x, [8], None, None, False, None, 0.5, None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("biases", [True, False])
def test_gelu_ffn_ops(dtype, approximate, biases):
    x = random_input((3, 5, 12), dtype, "cpu", seed=1)
    w1, w2 = (random_input((20, 12), dtype, "cpu", seed=2, scale=0.3),
              random_input((12, 20), dtype, "cpu", seed=3, scale=0.3))
    b1 = random_input((20,), dtype, "cpu", seed=4) if biases else None
    b2 = random_input((12,), dtype, "cpu", seed=5) if biases else None
    ln_w, ln_b = random_input((12,), dtype, "cpu", seed=6), random_input((12,), dtype, "cpu", seed=7)
    want = OPS.gelu_ffn(x, w1, b1, w2, b2, approximate)
    got = decompositions.gelu_ffn(x, w1, b1, w2, b2, approximate)
    for g, w in zip(got, want):  # GEMMs of the input's dtype, as eager's
        torch.testing.assert_close(g, w)
    want = OPS.layer_norm_gelu_ffn(x, ln_w, ln_b, 1e-5, w1, b1, w2, b2, approximate)
    got = decompositions.layer_norm_gelu_ffn(x, ln_w, ln_b, 1e-5, w1, b1, w2, b2, approximate)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


def _model_and_inputs():
    torch.manual_seed(0)
    model = Block().eval()  # every module of the library
    model.add_ln.dropout_p = 0.1  # (off in eval mode)
    with torch.no_grad():  # parameters away from their ones / zeros
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    x = random_input((2, 5, 16), torch.float32, "cpu", seed=1)
    r = random_input((2, 5, 16), torch.float32, "cpu", seed=2)
    return model, (x, r)


def test_export_under_onnx_traces_aten(monkeypatch):
    """While torch.onnx.export traces (fusednorm.functional._onnx_exporting), a model's graph
    holds ATen ops only, which compute what the model does; otherwise torch.export keeps the
    fused ops, one node each, also through its default decomposition."""
    from fusednorm import functional

    model, args = _model_and_inputs()
    kept = torch.export.export(model, args).run_decompositions()
    targets = {str(n.target) for n in kept.graph.nodes if n.op == "call_function"}
    assert {f"fusednorm.{name}.default" for name in PUBLIC} <= targets

    monkeypatch.setattr(functional, "_onnx_exporting", lambda: True)
    program = torch.export.export(model, args)
    targets = {str(n.target) for n in program.graph.nodes if n.op == "call_function"}
    assert not [t for t in targets if "fusednorm" in t], targets
    assert "aten.native_layer_norm.default" in targets, targets
    torch.testing.assert_close(program.module()(*args), model(*args), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("opset", [None, 23])
def test_onnx_export_runs_in_onnxruntime(opset):
    """The exporter's default opset, and 23, where RMSNorm becomes RMSNormalization."""
    why = "the onnx extra (bash scripts/install.sh test,onnx; scripts/test.sh installs it)"
    pytest.importorskip("onnxscript", reason="torch.onnx.export needs onnxscript: " + why)
    pytest.importorskip("onnxruntime", reason="running the exported model needs " + why)
    model, args = _model_and_inputs()
    batch = torch.export.Dim("batch")
    program = torch.onnx.export(model, args, dynamo=True, verbose=False, opset_version=opset,
                                dynamic_shapes=({0: batch}, {0: batch}))
    ops = {node.op_type for node in program.model.graph}
    assert "LayerNormalization" in ops, ops
    if opset == 23:
        assert "RMSNormalization" in ops, ops
    for rows in (2, 7):  # a dynamic batch
        x = random_input((rows, 5, 16), torch.float32, "cpu", seed=3)
        r = random_input((rows, 5, 16), torch.float32, "cpu", seed=4)
        (got,) = program(x, r)
        torch.testing.assert_close(got, model(x, r), rtol=1e-4, atol=1e-4)


def test_jit_trace_keeps_the_fused_ops():
    """torch.jit.trace outside an ONNX export: each op one node of the traced graph, as the
    eager calls run them."""
    model, args = _model_and_inputs()
    traced = torch.jit.trace(model, args)
    kinds = {node.kind() for node in traced.inlined_graph.nodes()}
    assert {f"fusednorm::{name}" for name in PUBLIC} <= kinds, kinds
    assert "aten::layer_norm" not in kinds and "aten::native_layer_norm" not in kinds, kinds
    x, r = (random_input((7, 5, 16), torch.float32, "cpu", seed=s) for s in (3, 4))
    torch.testing.assert_close(traced(x, r), model(x, r))


@pytest.mark.parametrize("opset", [14, 17])
def test_torchscript_onnx_export_runs_in_onnxruntime(opset):
    """The TorchScript-based exporter (dynamo=False): LayerNorm as LayerNormalization from
    opset 17 (as nn.LayerNorm), primitives below it; RMSNorm as primitives (nn.RMSNorm does
    not export there); a dynamic batch."""
    why = "the onnx extra (bash scripts/install.sh test,onnx; scripts/test.sh installs it)"
    onnx = pytest.importorskip("onnx", reason="reading the exported graph needs " + why)
    onnxruntime = pytest.importorskip("onnxruntime", reason="running the model needs " + why)
    model, args = _model_and_inputs()
    buffer = io.BytesIO()
    torch.onnx.export(model, args, buffer, dynamo=False, opset_version=opset,
                      input_names=["x", "residual"], output_names=["out"],
                      dynamic_axes={"x": {0: "batch"}, "residual": {0: "batch"}})
    ops = {node.op_type for node in onnx.load_from_string(buffer.getvalue()).graph.node}
    assert ("LayerNormalization" in ops) == (opset >= 17), ops
    session = onnxruntime.InferenceSession(buffer.getvalue())
    for rows in (2, 7):
        x = random_input((rows, 5, 16), torch.float32, "cpu", seed=3)
        r = random_input((rows, 5, 16), torch.float32, "cpu", seed=4)
        (got,) = session.run(None, {"x": x.numpy(), "residual": r.numpy()})
        torch.testing.assert_close(torch.from_numpy(got), model(x, r), rtol=1e-4, atol=1e-4)


def test_onnx_export_of_a_swapped_transformers_model():
    """A small Llama-style transformers model, its RMSNorms swapped, exports to ONNX and
    computes there what it does in PyTorch."""
    why = "the onnx extra (bash scripts/install.sh test,onnx; scripts/test.sh installs it)"
    pytest.importorskip("onnxscript", reason="torch.onnx.export needs onnxscript: " + why)
    pytest.importorskip("onnxruntime", reason="running the exported model needs " + why)
    transformers = pytest.importorskip(
        "transformers", reason="needs transformers (models extra: bash scripts/install.sh test,models)")
    import fusednorm

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2)
    llama = transformers.LlamaForCausalLM(config).eval()
    fusednorm.replace_norms(llama)
    assert fusednorm.norm_report(llama).count("fused") == 5

    class Logits(torch.nn.Module):
        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, ids):
            return self.model(input_ids=ids, use_cache=False).logits

    model = Logits(llama)
    ids = torch.randint(0, 100, (2, 7))
    program = torch.onnx.export(model, (ids,), dynamo=True, verbose=False)
    (got,) = program(ids)
    torch.testing.assert_close(got, model(ids), rtol=1e-4, atol=1e-4)
