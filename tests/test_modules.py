"""FusedLayerNorm as a drop-in for nn.LayerNorm, and replace_layernorm()."""
from __future__ import annotations

import copy
import types

import pytest
import torch
from torch import nn

import fusednorm
from conftest import DEVICES, random_input


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kwargs", [{}, {"elementwise_affine": False}, {"bias": False}, {"eps": 1e-3}])
def test_module_matches_nn_layernorm(device, kwargs):
    torch.manual_seed(0)
    ours = fusednorm.FusedLayerNorm((4, 6), device=device, **kwargs)
    theirs = nn.LayerNorm((4, 6), device=device, **kwargs)
    for p in ours.parameters():
        nn.init.normal_(p)
    theirs.load_state_dict(ours.state_dict())
    assert isinstance(ours, nn.LayerNorm)
    assert repr(ours).endswith(repr(theirs)[len("LayerNorm"):])
    assert ours.state_dict().keys() == theirs.state_dict().keys()
    x = random_input((3, 4, 6), torch.float32, device).requires_grad_()
    x2 = x.detach().clone().requires_grad_()
    out, ref = ours(x), theirs(x2)
    torch.testing.assert_close(out, ref)
    out.pow(2).sum().backward()
    ref.pow(2).sum().backward()
    torch.testing.assert_close(x.grad, x2.grad)
    for a, b in zip(ours.parameters(), theirs.parameters()):
        torch.testing.assert_close(a.grad, b.grad)


def test_module_dtype_and_reset_parameters():
    m = fusednorm.FusedLayerNorm(8, dtype=torch.bfloat16)
    assert m.weight.dtype == torch.bfloat16
    nn.init.normal_(m.weight)
    m.reset_parameters()
    assert torch.equal(m.weight, torch.ones(8, dtype=torch.bfloat16))
    assert torch.equal(m.bias, torch.zeros(8, dtype=torch.bfloat16))


def test_state_dict_round_trip_with_nn_layernorm():
    torch.manual_seed(0)
    plain = nn.LayerNorm(10)
    nn.init.normal_(plain.weight)
    nn.init.normal_(plain.bias)
    fused = fusednorm.FusedLayerNorm(10)
    fused.load_state_dict(plain.state_dict())
    back = nn.LayerNorm(10)
    back.load_state_dict(fused.state_dict())
    for name, value in plain.state_dict().items():
        assert torch.equal(back.state_dict()[name], value)


def _encoder():
    layer = nn.TransformerEncoderLayer(d_model=32, nhead=4, dim_feedforward=64, dropout=0.0,
                                       batch_first=True, norm_first=True)
    return nn.TransformerEncoder(layer, num_layers=2, norm=nn.LayerNorm(32), enable_nested_tensor=False)


@pytest.mark.parametrize("device", DEVICES)
def test_replace_layernorm_on_transformer_encoder(device):
    torch.manual_seed(0)
    model = _encoder().to(device)
    for m in model.modules():
        if isinstance(m, nn.LayerNorm):
            nn.init.normal_(m.weight)
            nn.init.normal_(m.bias)
    original = copy.deepcopy(model)
    params_before = {name: p for name, p in model.named_parameters()}
    assert fusednorm.replace_layernorm(model) is model
    norms = [m for m in model.modules() if isinstance(m, nn.LayerNorm)]
    assert len(norms) == 5 and all(type(m) is fusednorm.FusedLayerNorm for m in norms)
    # The very same Parameter objects: an optimizer built before the swap stays valid.
    for name, p in model.named_parameters():
        assert p is params_before[name]

    x = random_input((3, 7, 32), torch.float32, device)
    out, ref = model(x), original(x)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    out.square().mean().backward()
    ref.square().mean().backward()
    for (name, p), q in zip(model.named_parameters(), original.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_replace_layernorm_keeps_mode_dtype_and_subclasses():
    class CustomNorm(nn.LayerNorm):
        pass

    model = nn.Sequential(nn.LayerNorm(4, dtype=torch.float64), CustomNorm(4)).eval()
    fusednorm.replace_layernorm(model)
    assert type(model[0]) is fusednorm.FusedLayerNorm and not model[0].training
    assert model[0].weight.dtype == torch.float64
    assert type(model[1]) is CustomNorm
    root = fusednorm.replace_layernorm(nn.LayerNorm(3))
    assert type(root) is fusednorm.FusedLayerNorm
    with pytest.raises(TypeError, match="model"):
        fusednorm.replace_layernorm("not a model")


def test_build_info():
    info = fusednorm.build_info()
    assert info["compiled"] and info["cpu_kernels"]
    assert info["torch"] == torch.__version__
    assert info["cpu_capability"] in ("default", "avx2", "avx512")
    assert info["cpu_ffn_gemm"] in ("aten", "onednn")


def test_meta_tensors_give_shapes_without_computing():
    x = torch.randn(3, 5, device="meta")
    out = fusednorm.layer_norm(x, (5,), torch.ones(5, device="meta"))
    assert out.shape == x.shape and out.device.type == "meta"


META_MODULES = {
    "layer_norm": lambda: fusednorm.FusedLayerNorm(6),
    "rms_norm": lambda: fusednorm.FusedRMSNorm(6),
    "add_layer_norm": lambda: fusednorm.FusedAddLayerNorm(6, dropout_p=0.1),
    "add_rms_norm": lambda: fusednorm.FusedAddRMSNorm(6, dropout_p=0.1),
    "gelu_ffn": lambda: fusednorm.FusedGeluFFN(6, 10),
    "layer_norm_gelu_ffn": lambda: fusednorm.FusedLayerNormGeluFFN(6, d_hidden=10),
}


@pytest.mark.parametrize("name", sorted(META_MODULES))
def test_module_built_on_meta_runs_there_then_materializes(name):
    """Deferred init (FSDP2's and HF's): a module built under torch.device("meta") runs
    forward and backward on meta tensors, shapes only; to_empty + reset_parameters then
    gives the CPU module's results."""
    with torch.device("meta"):
        module = META_MODULES[name]()
    x = torch.randn(2, 3, 6, device="meta", requires_grad=True)
    args = (x, torch.randn(2, 3, 6, device="meta")) if name.startswith("add_") else (x,)
    outs = module(*args)
    outs = outs if isinstance(outs, tuple) else (outs,)
    assert all(o.device.type == "meta" and o.shape == x.shape for o in outs)
    sum(o.sum() for o in outs).backward()
    assert x.grad.device.type == "meta" and x.grad.shape == x.shape
    assert all(p.grad is not None and p.grad.shape == p.shape for p in module.parameters())

    module.to_empty(device="cpu")
    for m in module.modules():
        if hasattr(m, "reset_parameters"):
            m.reset_parameters()
    fresh = META_MODULES[name]()
    for a, b in zip(module.parameters(), fresh.parameters()):
        if a.dim() == 1 and name in ("layer_norm", "rms_norm", "add_layer_norm",
                                     "add_rms_norm"):  # the norms' init is not random
            torch.testing.assert_close(a, b)
    module.load_state_dict(fresh.state_dict())
    module.eval(), fresh.eval()
    cpu_args = [random_input(tuple(a.shape), torch.float32, "cpu") for a in args]
    got, want = module(*cpu_args), fresh(*cpu_args)
    torch.testing.assert_close(got, want)


def test_device_without_kernel_falls_back_to_reference_with_a_warning(monkeypatch):
    """A device with no compiled kernel (the dispatcher raises NotImplementedError, as for
    CUDA tensors in a CPU-only build): a warning, then the reference's result."""
    from fusednorm import _loader, functional, ops

    def no_kernel(*args):
        raise NotImplementedError("Could not run 'fusednorm::layer_norm' with arguments from "
                                  "the 'CPU' backend")

    monkeypatch.setattr(ops, "LAYER_NORM", no_kernel)
    # The direct entry declines a call the dispatcher refuses (test_fast_calls.py).
    monkeypatch.setattr(ops, "FAST", types.SimpleNamespace(layer_norm=lambda *a: NotImplemented))
    monkeypatch.setattr(_loader, "KERNELS", frozenset())
    monkeypatch.setattr(functional, "_warned_fallback", set())
    x, w = torch.randn(3, 5), torch.randn(5)
    with pytest.warns(RuntimeWarning, match="reference"):
        out = fusednorm.layer_norm(x, (5,), w)
    torch.testing.assert_close(out, torch.nn.functional.layer_norm(x, (5,), w))
