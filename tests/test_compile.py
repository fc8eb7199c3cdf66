"""The ops under torch.library.opcheck, torch.compile(fullgraph=True) and autocast."""
from __future__ import annotations

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
        torch.library.opcheck(torch.ops.fusednorm.layer_norm_fwd.default, (x, weight, bias, 1e-5))
        out, mean, rstd = torch.ops.fusednorm.layer_norm_fwd(x, weight, bias, 1e-5)
        dy = random_input(x.shape, x.dtype, device, seed=5)
        torch.library.opcheck(
            torch.ops.fusednorm.layer_norm_bwd.default, (dy, x, mean, rstd, weight, bias)
        )


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


@pytest.mark.parametrize("device", DEVICES)
def test_compiled_graphs_call_the_fused_ops(device):
    """The backward graph runs fusednorm's fused backward op, not a decomposition."""
    torch._dynamo.reset()
    backend = RecordingBackend()
    fn = torch.compile(lambda x, w, b: fusednorm.layer_norm(x, (16,), w, b), backend=backend, fullgraph=True)
    x = random_input((4, 16), torch.float32, device).requires_grad_()
    w = torch.ones(16, device=device, requires_grad=True)
    b = torch.zeros(16, device=device, requires_grad=True)
    fn(x, w, b).sum().backward()
    fw = "\n".join(g.code for g in backend.fw_graphs)
    bw = "\n".join(g.code for g in backend.bw_graphs)
    assert "fusednorm.layer_norm_fwd" in fw
    assert "fusednorm.layer_norm_bwd" in bw


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
