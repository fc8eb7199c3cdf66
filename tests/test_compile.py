"""The ops under torch.library.opcheck, torch.compile(fullgraph=True) and autocast."""
from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

import fusednorm
from conftest import DEVICES, RecordingBackend, random_input


def _opcheck_cases(device):
    for dtype, param_dtype in [(torch.float32, torch.float32), (torch.float64, torch.float64),
                               (torch.bfloat16, torch.float32), (torch.float16, torch.float16)]:
        x = random_input((6, 37), dtype, device)
        w = random_input((37,), param_dtype, device, seed=1)
        b = random_input((37,), param_dtype, device, seed=2)
        for weight, bias in [(w, b), (w, None), (None, b), (None, None)]:
            yield x, weight, bias


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    for x, weight, bias in _opcheck_cases(device):
        torch.library.opcheck(torch.ops.fusednorm.norm_fwd.default, (x, None, weight, bias, 1e-5, True))
        out, _, mean, rstd = torch.ops.fusednorm.norm_fwd(x, None, weight, bias, 1e-5, True)
        dy = random_input(x.shape, x.dtype, device, seed=5)
        torch.library.opcheck(
            torch.ops.fusednorm.norm_bwd.default, (dy, None, x, mean, rstd, weight, bias, True)
        )


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_public_ops(device):
    """The public ops (any shape, autograd in C++) under opcheck, with grad and without."""
    ops = torch.ops.fusednorm
    for x, weight, bias in _opcheck_cases(device):
        x3 = x.reshape(2, 3, 37)
        for grad in (False, True):
            args = [t.clone().requires_grad_(grad) if t is not None else None
                    for t in (x3, weight, bias)]
            torch.library.opcheck(ops.layer_norm.default, (args[0], [37], args[1], args[2], 1e-5))
    for dtype in (torch.float32, torch.float64):
        x = random_input((2, 3, 8), dtype, device).requires_grad_()
        w1, w2 = (random_input(s, dtype, device, seed=i).requires_grad_()
                  for i, s in ((1, (12, 8)), (2, (8, 12))))
        b1, b2 = random_input((12,), dtype, device, seed=3), random_input((8,), dtype, device, seed=4)
        torch.library.opcheck(ops.gelu_ffn.default, (x, w1, b1, w2, b2, "tanh"))
        torch.library.opcheck(ops.gelu_ffn.default, (x, w1, None, w2, None, "none"))
        ln_w = random_input((8,), dtype, device, seed=5)
        torch.library.opcheck(ops.layer_norm_gelu_ffn.default,
                              (x, ln_w, None, 1e-5, w1, b1, w2, b2, "none"))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dynamic", [False, True])
def test_compile_fullgraph_forward_backward(device, dynamic):
    torch._dynamo.reset()
    model = torch.nn.Sequential(
        torch.nn.Linear(24, 48), fusednorm.FusedLayerNorm(48), torch.nn.GELU(), torch.nn.Linear(48, 8)
    ).to(device)
    compiled = torch.compile(model, fullgraph=True, dynamic=dynamic)
    for rows in (5, 9):
        x = random_input((rows, 24), torch.float32, device)
        eager_out = model(x)
        eager_grads = torch.autograd.grad(eager_out.square().sum(), list(model.parameters()))
        out = compiled(x)
        grads = torch.autograd.grad(out.square().sum(), list(model.parameters()))
        torch.testing.assert_close(out, eager_out)
        for a, b in zip(grads, eager_grads):
            torch.testing.assert_close(a, b)


# (module, inputs it takes, their trailing shape)
DYNAMIC_MODULES = [
    ("layer_norm", lambda: fusednorm.FusedLayerNorm(16), 1),
    ("rms_norm", lambda: fusednorm.FusedRMSNorm(16, zero_centered_weight=True), 1),
    ("add_layer_norm", lambda: fusednorm.FusedAddLayerNorm(16, residual_dtype=torch.float32), 2),
    ("add_rms_norm", lambda: fusednorm.FusedAddRMSNorm(16, dropout_p=0.1), 2),
    ("gelu_ffn", lambda: fusednorm.FusedGeluFFN(16, 24), 1),
    ("layer_norm_gelu_ffn", lambda: fusednorm.FusedLayerNormGeluFFN(16, 24), 1),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name, make, n_inputs", DYNAMIC_MODULES, ids=[m[0] for m in DYNAMIC_MODULES])
def test_dynamic_shapes_compile_one_graph_for_every_batch(device, name, make, n_inputs):
    """Forward and backward under dynamic shapes: one graph for every batch size, as
    nn.LayerNorm gets (the backward nodes read sizes as SymInts; a concrete size() there
    specialized every compiled backward to its batch, and a mark_dynamic batch raised), and
    every batch's gradients those of eager."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    module = make().to(device)
    compiled = torch.compile(module, backend="aot_eager", dynamic=True, fullgraph=True)
    for batch in (2, 3, 5, 7, 11):
        inputs = [random_input((batch, 3, 16), torch.float32, device, seed=batch + k)
                  for k in range(n_inputs)]
        grads = []
        for fn in (compiled, module):
            leaves = [t.clone().requires_grad_() for t in inputs]
            torch.manual_seed(batch)  # the same dropout mask for both
            out = fn(*leaves)
            out = out if isinstance(out, tuple) else (out,)
            torch.autograd.backward(out, [o.detach().cos() for o in out])
            grads.append([t.grad for t in leaves])
        for got, want in zip(*grads):
            torch.testing.assert_close(got, want)
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])

    torch._dynamo.reset()
    x = random_input((6, 3, 16), torch.float32, device).requires_grad_()
    torch._dynamo.mark_dynamic(x, 0)
    compiled = torch.compile(module, backend="aot_eager", fullgraph=True)
    out = compiled(*([x] * n_inputs))
    (out[0] if isinstance(out, tuple) else out).sum().backward()  # no ConstraintViolationError


@pytest.mark.parametrize("device", DEVICES)
def test_compiled_graphs_call_the_fused_ops(device):
    """The forward graph runs fusednorm's op and the backward graph its fused backward op,
    not a decomposition (the create_graph path of the backward is not taken)."""
    torch._dynamo.reset()
    backend = RecordingBackend()
    fn = torch.compile(lambda x, w, b: fusednorm.layer_norm(x, (16,), w, b), backend=backend, fullgraph=True)
    x = random_input((4, 16), torch.float32, device).requires_grad_()
    w = torch.ones(16, device=device, requires_grad=True)
    b = torch.zeros(16, device=device, requires_grad=True)
    fn(x, w, b).sum().backward()
    fw = "\n".join(g.code for g in backend.fw_graphs)
    bw = "\n".join(g.code for g in backend.bw_graphs)
    assert "fusednorm.layer_norm.default" in fw
    assert "fusednorm.norm_bwd" in bw
    assert "native_layer_norm" not in fw + bw


def _eager_forwards(device):
    """name -> (forward over (x, r, w, b, w1, w2) giving the tensors the loss takes, which of
    those require grad): every backward node, the add ops with dropout, a float32 sum and a
    frozen bias."""
    def ffn(x, r, w, b, w1, w2):
        return (fusednorm.gelu_ffn(x, w1, None, w2, None, approximate="tanh"),)
    return {
        "layer_norm": (lambda x, r, w, b, w1, w2: (fusednorm.layer_norm(x, (16,), w, b),), "xwb"),
        "rms_norm": (lambda x, r, w, b, w1, w2: (fusednorm.rms_norm(x, (16,), w),), "xw"),
        "layer_norm_frozen_bias": (
            lambda x, r, w, b, w1, w2: (fusednorm.layer_norm(x, (16,), w, b),), "xw"),
        "add_layer_norm_dropout": (
            lambda x, r, w, b, w1, w2: fusednorm.add_layer_norm(x, r, (16,), w, b, dropout_p=0.25),
            "xrwb"),
        "add_rms_norm_float32_sum": (
            lambda x, r, w, b, w1, w2: fusednorm.add_rms_norm(
                x.bfloat16(), r, (16,), w, residual_dtype=torch.float32), "xrw"),
        "add_layer_norm_sum_alone": (
            lambda x, r, w, b, w1, w2: fusednorm.add_layer_norm(x, r, (16,), w, b)[1:], "xrwb"),
        "gelu_ffn": (ffn, "x12"),
        "layer_norm_gelu_ffn": (
            lambda x, r, w, b, w1, w2: (fusednorm.functional.layer_norm_gelu_ffn(
                x, w, b, 1e-5, w1, None, w2, None),), "xwb12"),
    }


@pytest.mark.skipif(torch.torch_version.TorchVersion(torch.__version__) < (2, 14),
                    reason="fusednorm's backward nodes take part in compiled autograd from "
                           "PyTorch 2.14")
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(_eager_forwards("cpu")))
def test_compiled_autograd_over_an_eager_forward(device, name):
    """torch._dynamo.compiled_autograd over an eager forward traces fusednorm's backward
    nodes into its graph as their fused backward ops (not the create_graph formulas), and
    every gradient is the eager backward's."""
    from torch._dynamo import compiled_autograd

    forward, trainable = _eager_forwards(device)[name]
    leaves = {
        "x": random_input((5, 16), torch.float32, device),
        "r": random_input((5, 16), torch.float32, device, seed=1),
        "w": random_input((16,), torch.float32, device, seed=2),
        "b": random_input((16,), torch.float32, device, seed=3),
        "1": random_input((24, 16), torch.float32, device, seed=4),
        "2": random_input((16, 24), torch.float32, device, seed=5),
    }

    def grads():
        torch.manual_seed(0)  # (the same dropout mask in both runs)
        inputs = {k: t.clone().requires_grad_(k in trainable) for k, t in leaves.items()}
        outs = forward(*inputs.values())
        loss = sum((o.float() * random_input(o.shape, torch.float32, device, seed=6 + i)).sum()
                   for i, o in enumerate(outs))
        loss.backward()
        return {k: t.grad for k, t in inputs.items()}

    expected = grads()
    torch._dynamo.reset()
    backend = RecordingBackend()
    with compiled_autograd._enable(lambda gm: torch.compile(gm, backend=backend, fullgraph=True)):
        got = grads()
    assert backend.fw_graphs, "the backward did not run through compiled autograd"
    graphs = "\n".join(g.code for g in backend.fw_graphs)
    if name != "add_layer_norm_sum_alone":  # (which takes the sum's gradient alone: ATen ops)
        assert "fusednorm.norm_bwd" in graphs or "fusednorm.gelu_ffn_bwd" in graphs, graphs
    for k in leaves:
        if expected[k] is None:
            assert got[k] is None, k
        else:
            torch.testing.assert_close(got[k], expected[k], rtol=0, atol=0, msg=k)


@pytest.mark.skipif(torch.torch_version.TorchVersion(torch.__version__) < (2, 14),
                    reason="fusednorm's backward nodes take part in compiled autograd from "
                           "PyTorch 2.14")
def test_compiled_autograd_with_saved_tensor_hooks():
    """Saved tensors packed by hooks (activation offloading's kind) are unpacked inside the
    compiled backward graph; gradients equal eager's."""
    from torch._dynamo import compiled_autograd

    ln, lin = fusednorm.FusedLayerNorm(32), torch.nn.Linear(32, 32)
    unpacked = []

    def grads():
        x = random_input((6, 32), torch.float32, "cpu").requires_grad_()
        for p in (*ln.parameters(), *lin.parameters()):
            p.grad = None
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t * 1,
                                                      lambda t: unpacked.append(1) or t):
            y = lin(ln(x))
        y.square().sum().backward()
        return [x.grad, ln.weight.grad, ln.bias.grad]

    expected = grads()
    unpacked.clear()
    torch._dynamo.reset()
    with compiled_autograd._enable(lambda gm: torch.compile(gm, backend="aot_eager",
                                                            fullgraph=True)):
        got = grads()
    assert unpacked, "the unpack hooks did not run"
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.skipif(torch.torch_version.TorchVersion(torch.__version__) < (2, 14),
                    reason="fusednorm's backward nodes take part in compiled autograd from "
                           "PyTorch 2.14")
@pytest.mark.parametrize("frozen", [False, True])
def test_compiled_autograd_second_derivative_of_an_ffn(frozen):
    """A gradient penalty (create_graph) under compiled autograd: eager's second derivative
    with a trainable weight; with every parameter frozen the FFN did not save its input, and
    compiled autograd's form of its node cannot reach it, so the backward raises, naming the
    op, rather than drop the gelu'' term."""
    from torch._dynamo import compiled_autograd

    w1, w2 = (random_input(s, torch.float64, "cpu", seed=i) for i, s in
              enumerate([(24, 16), (16, 24)]))
    w1.requires_grad_(not frozen)
    x0 = random_input((5, 16), torch.float64, "cpu", seed=3)

    def penalty_grad(ffn, compiled):
        x = x0.clone().requires_grad_()
        ctx = (compiled_autograd._enable(lambda gm: torch.compile(gm, backend="aot_eager"))
               if compiled else contextlib.nullcontext())
        with ctx:
            (g,) = torch.autograd.grad(ffn(x).sin().sum(), x, create_graph=True)
            g.square().sum().backward()
        return x.grad

    def fused(x):
        return fusednorm.gelu_ffn(x, w1, None, w2, None)

    def eager(x):
        return F.linear(F.gelu(F.linear(x, w1)), w2)

    expected = penalty_grad(eager, compiled=False)
    torch.testing.assert_close(penalty_grad(fused, compiled=False), expected)
    torch._dynamo.reset()
    if frozen:
        with pytest.raises(RuntimeError, match="compiled autograd cannot differentiate"):
            penalty_grad(fused, compiled=True)
    else:
        torch.testing.assert_close(penalty_grad(fused, compiled=True), expected)


def test_autocast_cpu_leaves_layer_norm_alone():
    """Like torch.nn.functional.layer_norm, CPU autocast does not cast: the output has the
    input's dtype, float32 parameters included."""
    w = torch.randn(32)
    b = torch.randn(32)
    for dtype in (torch.float32, torch.bfloat16):
        x = random_input((4, 32), dtype, "cpu")
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = fusednorm.layer_norm(x, (32,), w, b)
            expected = F.layer_norm(x, (32,), w, b)
        assert out.dtype == expected.dtype == dtype
        torch.testing.assert_close(out, expected)


@pytest.mark.parametrize("autocast_dtype", [torch.float16, torch.bfloat16])
def test_autocast_cuda_runs_in_float32(autocast_dtype):
    """CUDA autocast puts layer_norm on its float32 list; fusednorm follows."""
    if "cuda" not in [getattr(d, "values", [d])[0] for d in DEVICES] or not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    x = random_input((4, 64), autocast_dtype, "cuda")
    w = torch.randn(64, device="cuda")
    with torch.autocast("cuda", dtype=autocast_dtype):
        out = fusednorm.layer_norm(x, (64,), w)
        expected = F.layer_norm(x, (64,), w)
    assert out.dtype == expected.dtype == torch.float32
    torch.testing.assert_close(out, expected)


def test_compile_cache_key_follows_the_build(monkeypatch):
    """torch.compile's on-disk caches name fusednorm's ops, not their schemas: the import
    tags their key with the loaded build's stamp (a user's tag kept), so that a graph
    compiled against another build is never loaded."""
    from torch._inductor.codecache import compiled_fx_graph_hash

    from fusednorm import _loader

    ours = _loader.compile_cache_tag(_loader._build_stamp())
    assert ours in torch.compiler.config.cache_key_tag.split(","), torch.compiler.config.cache_key_tag
    gm = torch.fx.symbolic_trace(
        lambda x, w: torch.ops.fusednorm.layer_norm.default(x, [8], w, None, 1e-5, False)[0])
    inputs = [random_input((4, 8), torch.float32, "cpu"), random_input((8,), torch.float32, "cpu")]

    def key_when_built_from(stamp, user_tag=""):
        monkeypatch.setattr(_loader, "_build_stamp", lambda: stamp)
        with torch.compiler.config.patch(cache_key_tag=user_tag):
            _loader._tag_compile_caches()
            tag = torch.compiler.config.cache_key_tag
            return compiled_fx_graph_hash(gm, inputs, {}, [])[0], tag

    key_a, tag_a = key_when_built_from("a")
    assert key_when_built_from("a") == (key_a, tag_a)
    assert key_when_built_from("b")[0] != key_a
    assert key_when_built_from("a", "mine")[1] == "mine," + tag_a
