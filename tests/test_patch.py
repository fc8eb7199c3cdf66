"""replace_layernorm's swap table, its log line, its warning, norm_report, and
FusedLayerNorm2d (timm's LayerNorm2d computation). The timm and transformers models
themselves are in test_model_libraries.py."""
from __future__ import annotations

import copy
import logging
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fusednorm
from conftest import DEVICES, assert_close_three_way, random_input
from fusednorm import patch


class CustomNorm(nn.LayerNorm):
    """A LayerNorm subclass fusednorm knows nothing about: it must be left alone."""

    def forward(self, x):
        return super().forward(x) * 2


def test_report_and_log_line(caplog):
    model = nn.Sequential(nn.LayerNorm(4), nn.Linear(4, 4), CustomNorm(4), nn.BatchNorm1d(4))
    report = fusednorm.norm_report(model)
    assert [(e.name, e.action) for e in report.entries] == [
        ("0", "swap"), ("2", "keep"), ("3", "keep")]
    assert report.entries[0].detail == "FusedLayerNorm"
    assert "not known to compute F.layer_norm" in report.entries[1].detail
    with caplog.at_level(logging.INFO, logger="fusednorm"):
        assert fusednorm.replace_layernorm(model) is model
    (record,) = [r for r in caplog.records if r.name == "fusednorm"]
    assert record.levelno == logging.INFO
    assert record.getMessage().startswith(
        "replace_layernorm: swapped 1 norm module(s) "
        "(1 torch.nn.modules.normalization.LayerNorm -> FusedLayerNorm); kept 2 (")
    after = fusednorm.norm_report(model)
    assert (after.count("fused"), after.count("swap"), after.count("keep")) == (1, 0, 2)
    assert str(after).splitlines()[0] == "3 norm modules: 1 fusednorm, 0 to swap, 2 kept"


def test_warns_when_norms_exist_but_none_is_swapped():
    model = nn.Sequential(nn.Linear(4, 4), CustomNorm(4))
    with pytest.warns(UserWarning, match=r"swapped none of the model's 1 norm module\(s\)"
                                         r".*CustomNorm.*norm_report") as caught:
        fusednorm.replace_layernorm(model)
    assert caught[0].filename == __file__  # points at the caller's line
    assert type(model[1]) is CustomNorm


def test_no_warning_when_swapped_already_fused_or_normless():
    models = [nn.Sequential(nn.LayerNorm(4), CustomNorm(4)),
              fusednorm.replace_layernorm(nn.Sequential(nn.LayerNorm(4))),  # a second call
              nn.Sequential(nn.Linear(4, 4), nn.ReLU())]
    for model in models:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            fusednorm.replace_layernorm(model)


def test_one_entry_adds_a_class(monkeypatch):
    """A class with other attribute names becomes swappable with a single SWAPS entry."""

    class OtherLayerNorm(nn.Module):
        def __init__(self, n):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(n))
            self.bias = nn.Parameter(torch.randn(n))
            self.variance_epsilon = 1e-3

        def forward(self, x):
            return F.layer_norm(x, x.shape[-1:], self.weight, self.bias, self.variance_epsilon)

    def adapt(module):
        module.normalized_shape = tuple(module.weight.shape)
        module.eps = module.variance_epsilon
        module.elementwise_affine = True

    key = patch.class_name(OtherLayerNorm)
    monkeypatch.setitem(patch.SWAPS, key,
                        patch.Swap("layer_norm", fusednorm.FusedLayerNorm, adapt=adapt))
    model = nn.Sequential(OtherLayerNorm(8)).double()
    x = random_input((5, 8), torch.float64, "cpu")
    expected = model(x)
    weight = model[0].weight
    fusednorm.replace_layernorm(model)
    assert type(model[0]) is fusednorm.FusedLayerNorm and model[0].weight is weight
    torch.testing.assert_close(model(x), expected)


def test_other_families_are_not_swapped_by_replace_layernorm(monkeypatch, caplog):
    """An entry of another family (e.g. RMSNorm's) is swapped by its own replace function:
    norm_report lists it as swappable, replace_layernorm keeps it and says why."""
    monkeypatch.setitem(patch.SWAPS, patch.class_name(CustomNorm),
                        patch.Swap("some_other_norm", fusednorm.FusedLayerNorm))
    model = nn.Sequential(CustomNorm(4), nn.LayerNorm(4))
    assert fusednorm.norm_report(model).count("swap") == 2
    with caplog.at_level(logging.INFO, logger="fusednorm"):
        fusednorm.replace_layernorm(model)
    assert type(model[0]) is CustomNorm
    assert "another replace function (some_other_norm family)" in caplog.records[-1].getMessage()


def test_warning_names_the_replace_function_that_swaps_the_kept_norms():
    """replace_layernorm on a model of RMSNorms only (a Llama) says which function to call."""
    model = nn.Sequential(nn.RMSNorm(4), nn.RMSNorm(4))
    with pytest.warns(UserWarning, match=r"swapped by fusednorm\.replace_norms \(rms_norm family\)"):
        fusednorm.replace_layernorm(model)
    assert type(model[0]) is nn.RMSNorm


def _timm_layer_norm_2d(x, weight, bias, eps):
    """timm.layers.LayerNorm2d.forward (timm 1.0), without importing timm."""
    return F.layer_norm(x.permute(0, 2, 3, 1), weight.shape, weight, bias, eps).permute(0, 3, 1, 2)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("channels_last", [False, True])
def test_fused_layer_norm_2d(device, channels_last):
    norm = fusednorm.FusedLayerNorm2d(12, eps=1e-6, device=device)
    with torch.no_grad():
        norm.weight.copy_(random_input((12,), torch.float32, device, seed=1))
        norm.bias.copy_(random_input((12,), torch.float32, device, seed=2))
    x = random_input((2, 12, 5, 7), torch.float32, device)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    x.requires_grad_()
    y = norm(x)
    expected = _timm_layer_norm_2d(x, norm.weight, norm.bias, 1e-6)
    assert y.shape == expected.shape and y.stride() == expected.stride()
    leaves = [x.detach().double().requires_grad_(), norm.weight.detach().double(),
              norm.bias.detach().double()]
    ref = _timm_layer_norm_2d(*leaves, 1e-6)
    assert_close_three_way(y, expected, ref, torch.float32)
    dy = random_input(y.shape, torch.float32, device, seed=3)
    (dx,) = torch.autograd.grad(y, x, dy)
    (dx_torch,) = torch.autograd.grad(expected, x, dy)
    (dx_ref,) = torch.autograd.grad(ref, leaves[0], dy.double())
    assert_close_three_way(dx, dx_torch, dx_ref, torch.float32, "dx")


def test_swapped_model_pickles(tmp_path):
    """torch.save of a whole swapped model works: the new classes are importable."""
    model = fusednorm.replace_layernorm(nn.Sequential(nn.LayerNorm(4)))
    torch.save(copy.deepcopy(model), tmp_path / "m.pt")
    loaded = torch.load(tmp_path / "m.pt", weights_only=False)
    assert type(loaded[0]) is fusednorm.FusedLayerNorm


def test_replace_norms_swaps_rms_norm_and_layer_norm_in_place():
    rms, ln = nn.RMSNorm(6, eps=1e-5), nn.LayerNorm(6)
    with torch.no_grad():
        rms.weight.uniform_(0.5, 1.5)
    model = nn.Sequential(rms, ln)
    x = torch.randn(3, 6)
    expected = model(x)
    weight = rms.weight
    assert fusednorm.replace_norms(model) is model
    assert type(model[0]) is fusednorm.FusedRMSNorm and model[0].weight is weight
    assert type(model[1]) is fusednorm.FusedLayerNorm
    torch.testing.assert_close(model(x), expected)


class _Doubled(nn.Module):
    """A parametrization: the tensor times two (random data stays random)."""

    def forward(self, t):
        return 2 * t


def test_replace_norms_swaps_parametrized_norms():
    """Norms under torch.nn.utils.parametrize (weight_norm's kind) are swapped too: same
    results and gradients (through the parametrization to its `original`, the same
    Parameter object), each module its own class (parametrize adds and removes properties
    on it), and remove_parametrizations leaves the plain fused class."""
    from torch.nn.utils import parametrize

    def model():
        torch.manual_seed(0)
        norms = nn.Sequential(nn.LayerNorm(6), nn.RMSNorm(6), nn.LayerNorm(6), nn.LayerNorm(6))
        with torch.no_grad():
            for norm in norms:
                norm.weight.uniform_(0.5, 1.5)
        parametrize.register_parametrization(norms[0], "weight", _Doubled())
        parametrize.register_parametrization(norms[0], "bias", _Doubled())
        parametrize.register_parametrization(norms[1], "weight", _Doubled())
        parametrize.register_parametrization(norms[2], "weight", _Doubled())
        return norms

    eager, fused = model(), model()
    original = fused[0].parametrizations.weight.original
    fusednorm.replace_norms(fused)
    assert [type(m).__name__ for m in fused] == [
        "ParametrizedFusedLayerNorm", "ParametrizedFusedRMSNorm", "ParametrizedFusedLayerNorm",
        "FusedLayerNorm"]
    assert all(isinstance(m, fusednorm.FusedLayerNorm) for m in fused[::2])
    assert type(fused[0]) is not type(fused[2])
    assert fused[0].parametrizations.weight.original is original
    assert fusednorm.norm_report(fused).count("fused") == 4
    x = random_input((4, 6), torch.float32, "cpu")
    y, y_eager = fused(x), eager(x)
    torch.testing.assert_close(y, y_eager)
    dy = random_input((4, 6), torch.float32, "cpu", seed=1)
    y.backward(dy)
    y_eager.backward(dy)
    for (name, p), (_, p_eager) in zip(fused.named_parameters(), eager.named_parameters()):
        torch.testing.assert_close(p.grad, p_eager.grad, msg=name)

    # Removing one module's parametrizations leaves the others' classes as they were.
    weight = fused[0].weight.detach().clone()
    parametrize.remove_parametrizations(fused[0], "weight")
    parametrize.remove_parametrizations(fused[0], "bias")
    assert type(fused[0]) is fusednorm.FusedLayerNorm
    assert type(fused[2]).__name__ == "ParametrizedFusedLayerNorm"
    torch.testing.assert_close(fused[0].weight, weight)
    torch.testing.assert_close(fused(x), eager(x))


def test_replace_layernorm_leaves_rms_norm_to_replace_norms():
    model = nn.Sequential(nn.RMSNorm(4), nn.LayerNorm(4))
    fusednorm.replace_layernorm(model)
    assert type(model[0]) is nn.RMSNorm and type(model[1]) is fusednorm.FusedLayerNorm
    entry = fusednorm.norm_report(model).entries[0]  # what replace_norms would do
    assert (entry.action, entry.detail) == ("swap", "FusedRMSNorm")


def _llama_rms_norm():
    modeling = pytest.importorskip("transformers.models.llama.modeling_llama")
    return modeling.LlamaRMSNorm


def test_library_class_is_swapped_while_its_code_is_the_one_checked():
    model = nn.Sequential(_llama_rms_norm()(8))
    fusednorm.replace_norms(model)
    assert type(model[0]) is fusednorm.FusedHFRMSNorm


def _assert_kept_as_changed(model, caplog):
    cls = type(model[0])
    with caplog.at_level(logging.INFO, logger="fusednorm"), pytest.warns(UserWarning) as record:
        fusednorm.replace_norms(model)
    assert type(model[0]) is cls
    reason = "its code differs from the transformers "
    entry, = fusednorm.norm_report(model).entries
    assert (entry.action, entry.cls) == ("keep", patch.class_name(cls))
    assert entry.detail.startswith(reason) and entry.detail.endswith("checked; not swapped")
    assert any(reason in str(w.message) for w in record) and reason in caplog.text


def test_same_name_other_forward_is_kept(caplog):
    """A class of another library version (here a subclass given the recorded class's
    qualified name) whose forward differs is kept, and the report says why."""
    original = _llama_rms_norm()

    class Changed(original):
        def forward(self, hidden_states):
            return super().forward(hidden_states) * 2

    Changed.__module__, Changed.__qualname__ = original.__module__, original.__qualname__
    _assert_kept_as_changed(nn.Sequential(Changed(8)), caplog)


def test_patched_forward_is_kept(monkeypatch, caplog):
    original = _llama_rms_norm()
    forward = original.forward
    monkeypatch.setattr(original, "forward", lambda self, x: forward(self, x) * 2)
    _assert_kept_as_changed(nn.Sequential(original(8)), caplog)


def test_recorded_fingerprint_is_compared(monkeypatch, caplog):
    """The source's fingerprint is compared with the recorded one (here made different)."""
    original = _llama_rms_norm()
    name = patch.class_name(original)
    monkeypatch.setitem(patch.SWAPPED, name, (patch.SWAPPED[name][0], "0" * 12))
    _assert_kept_as_changed(nn.Sequential(original(8)), caplog)
