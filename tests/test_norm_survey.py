"""The survey of transformers' and timm's norm classes (scripts/norm_survey.py,
docs/models.md): complete and current for the library versions it was made from (where
those are installed), every verdict a fusednorm class, and each swap target computing what
the classes it replaces compute, in their order of operations and cast rule, eager and
under torch.compile."""
from __future__ import annotations

import copy
import importlib
import importlib.util
import pathlib
import sys

import pytest
import torch
from torch import nn

import fusednorm
from fusednorm import patch, swap_targets

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import norm_survey  # noqa: E402

MISSING = [lib for lib in norm_survey.LIBRARIES if importlib.util.find_spec(lib) is None]
needs_libraries = pytest.mark.skipif(
    bool(MISSING), reason=f"the survey reads the installed {' and '.join(MISSING)}, not installed")


@needs_libraries
def test_every_installed_norm_class_has_a_verdict_and_the_files_are_current():
    surveyed, versions = fusednorm.library_classes.VERSIONS, norm_survey.installed()
    if versions != surveyed:
        pytest.skip("docs/models.md and fusednorm/library_classes.py are for "
                    + " and ".join(f"{lib} {v}" for lib, v in surveyed.items())
                    + " (the versions CI pins); installed: "
                    + " and ".join(f"{lib} {v}" for lib, v in versions.items()))
    classes, unjudged = norm_survey.survey()
    assert not unjudged, (
        "norm classes no one has judged (read them, add their verdicts to "
        "scripts/norm_survey.py VERDICTS):\n" + "\n".join(f"{c.name} {c.digest}" for c in unjudged))
    table = norm_survey.render_table(versions, classes)
    generated = norm_survey.render_classes(versions, classes)
    stale = "stale against the installed libraries: run python scripts/norm_survey.py --write"
    page = norm_survey.TABLE.read_text()
    assert norm_survey.with_block(page, table) == page, f"docs/models.md's survey is {stale}"
    assert norm_survey.CLASSES.read_text() == generated, f"fusednorm/library_classes.py is {stale}"
    assert sum(len(c) for c in classes.values()) > 300  # the scan found the classes at all


def test_every_swap_verdict_is_a_target_and_every_target_is_used():
    swaps = {v for v in norm_survey.VERDICTS.values() if norm_survey.is_swap(v)}
    assert swaps <= set(patch.TARGETS), swaps - set(patch.TARGETS)
    assert set(patch.TARGETS) <= swaps, set(patch.TARGETS) - swaps
    for name, (target, _) in fusednorm.library_classes.SWAPPED.items():
        assert patch.SWAPS[name] is patch.TARGETS[target]


def test_kept_reasons_are_sentences():
    for digest, verdict in norm_survey.VERDICTS.items():
        if not norm_survey.is_swap(verdict):
            assert len(verdict) > 30, (digest, verdict)


# (module, class, constructor args, constructor kwargs, input shape, target)
CASES = [
    ("transformers.models.llama.modeling_llama", "LlamaRMSNorm", (48,), {"eps": 1e-5},
     (5, 7, 48), "FusedHFRMSNorm"),
    ("transformers.models.llama4.modeling_llama4", "Llama4TextRMSNorm", (48,), {"eps": 1e-5},
     (5, 7, 48), "FusedHFRMSNorm"),
    ("transformers.models.gpt_oss.modeling_gpt_oss", "GptOssRMSNorm", (48,), {"eps": 1e-5},
     (5, 7, 48), "FusedHFRMSNormCastLast"),
    ("transformers.models.helium.modeling_helium", "HeliumRMSNorm", (48,), {"eps": 1e-5},
     (5, 7, 48), "FusedHFRMSNormCastLast"),
    ("transformers.models.moshi.modeling_moshi", "MoshiRMSNorm", (48,), {"eps": 1e-5},
     (5, 7, 48), "FusedHFRMSNormCastLast"),
    ("transformers.models.gemma3n.modeling_gemma3n", "Gemma3nRMSNorm", (48,), {"eps": 1e-5},
     (5, 7, 48), "FusedHFRMSNormCastLast"),
    ("transformers.models.gemma3n.modeling_gemma3n", "Gemma3nRMSNorm", (48,),
     {"eps": 1e-5, "with_scale": False}, (5, 7, 48), "FusedHFRMSNormCastLast"),
    ("transformers.models.llama4.modeling_llama4", "Llama4TextL2Norm", (), {"eps": 1e-5},
     (5, 7, 48), "FusedHFRMSNormCastLast"),
    ("transformers.models.t5.modeling_t5", "T5LayerNorm", (48,), {"eps": 1e-5},
     (5, 7, 48), "FusedT5LayerNorm"),
    ("transformers.models.gemma.modeling_gemma", "GemmaRMSNorm", (48,), {"eps": 1e-5},
     (5, 7, 48), "FusedGemmaRMSNorm"),
    ("transformers.models.gemma2.modeling_gemma2", "Gemma2RMSNorm", (48,), {"eps": 1e-5},
     (5, 7, 48), "FusedGemmaRMSNorm"),
    ("transformers.models.gemma3.modeling_gemma3", "Gemma3RMSNorm", (48,), {"eps": 1e-5},
     (5, 7, 48), "FusedGemmaRMSNorm"),
    ("transformers.models.qwen4_exp.modeling_qwen4_exp", "Qwen4ExpTextRMSNorm", (48,),
     {"eps": 1e-5}, (5, 7, 48), "FusedGemmaRMSNorm"),
    ("transformers.models.cohere.modeling_cohere", "CohereLayerNorm", (),
     {"hidden_size": 48, "eps": 1e-5}, (5, 7, 48), "FusedHFLayerNormCastLast"),
    ("transformers.models.deberta.modeling_deberta", "DebertaLayerNorm", (48,), {"eps": 1e-5},
     (5, 7, 48), "FusedHFLayerNorm"),
    ("transformers.models.olmo.modeling_olmo", "OlmoLayerNorm", (48,), {}, (5, 7, 48),
     "FusedParameterFreeLayerNorm"),
    ("transformers.models.esmc.modeling_esmc", "EsmcLayerNorm", (48,), {}, (5, 7, 48),
     "FusedLayerNorm"),
    ("transformers.models.esmfold2.modeling_esmfold2", "EsmFold2LayerNorm", (48,), {},
     (5, 7, 48), "FusedLayerNormFp32"),
    ("transformers.models.convnext.modeling_convnext", "ConvNextLayerNorm", (16,),
     {"data_format": "channels_first"}, (2, 16, 5, 7), "FusedDataFormatLayerNorm"),
    ("transformers.models.convnext.modeling_convnext", "ConvNextLayerNorm", (16,), {},
     (2, 5, 7, 16), "FusedDataFormatLayerNorm"),
    ("transformers.models.eomt.modeling_eomt", "EomtLayerNorm2d", (16,), {}, (2, 16, 5, 7),
     "FusedLayerNorm2d"),
    ("transformers.models.squeezebert.modeling_squeezebert", "SqueezeBertLayerNorm", (16,), {},
     (2, 16, 9), "FusedLayerNormChannelsFirst"),
    ("timm.layers.norm", "LayerNormFp32", (48,), {}, (5, 7, 48), "FusedLayerNormFp32"),
    ("timm.layers.norm", "LayerNorm2dFp32", (16,), {}, (2, 16, 5, 7), "FusedLayerNorm2dFp32"),
    ("timm.layers.norm", "RmsNormFp32", (48,), {}, (5, 7, 48), "FusedRMSNormFp32"),
    ("timm.layers.norm", "RmsNorm2dFp32", (16,), {}, (2, 16, 5, 7), "FusedRMSNorm2dFp32"),
    ("timm.models.metaformer", "LayerNormNoBias", (48,), {}, (5, 7, 48), "FusedLayerNorm"),
    ("timm.layers.norm_act", "LayerNormAct", (48,), {}, (5, 7, 48),
     "FusedLayerNormAct"),
    ("timm.layers.norm_act", "LayerNormAct2d", (16,), {}, (2, 16, 5, 7), "FusedLayerNormAct2d"),
    ("timm.layers.norm_act", "LayerNormActFp32", (48,), {}, (5, 7, 48), "FusedLayerNormActFp32"),
    ("timm.layers.norm_act", "LayerNormAct2dFp32", (16,), {}, (2, 16, 5, 7),
     "FusedLayerNormAct2dFp32"),
    ("timm.layers.norm_act", "RmsNormActFp32", (48,), {}, (5, 7, 48), "FusedRMSNormActFp32"),
    ("timm.layers.norm_act", "RmsNormAct2dFp32", (16,), {}, (2, 16, 5, 7),
     "FusedRMSNormAct2dFp32"),
    ("timm.models.metaformer", "LayerNorm2dNoBias", (16,), {}, (2, 16, 5, 7),
     "FusedLayerNorm2d"),
]
# (input dtype, parameter dtype): all float32, a bf16 model, bf16 activations with float32
# parameters (mixed precision without autocast).
DTYPES = [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
          (torch.bfloat16, torch.float32)]


def _case_id(case) -> str:
    return f"{case[1]}{'-' + '-'.join(f'{k}={v}' for k, v in case[3].items() if k != 'eps') if case[3] else ''}"


def _build(case, param_dtype):
    module_name, cls_name, args, kwargs, shape, target = case
    library = module_name.split(".")[0]
    pytest.importorskip(library, reason=f"needs {library} (the class under test is {library}'s)")
    cls = getattr(importlib.import_module(module_name), cls_name)
    norm = cls(*args, **kwargs).to(param_dtype)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in norm.named_parameters():
            scale = 1.0 if "bias" in name else 0.5
            offset = 0.0 if "bias" in name or torch.all(p == 0) else 1.0
            p.copy_(offset + scale * torch.randn(p.shape, generator=generator))
    return norm, shape, patch.TARGETS[target].target


def _input(shape, dtype, seed=4):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 3 + 1
    return x.to(dtype).requires_grad_()


def assert_same_rounding(out: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Equal but for the float32 statistics' summation order: float32 results within a few
    units of rounding; 16-bit results differ in at most 2% of the elements (a statistic one
    float32 unit apart moves a rounding across a tie; a wrong cast order or a rounding
    too many changes a quarter or more), by at most two 16-bit units."""
    assert out.dtype == expected.dtype and out.shape == expected.shape, (
        f"{what}: {out.dtype} {tuple(out.shape)} != {expected.dtype} {tuple(expected.shape)}")
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6, msg=what)
        return
    a, b = out.double(), expected.double()
    differ = a != b
    fraction = differ.float().mean().item()
    assert fraction <= 0.02, f"{what}: {fraction:.1%} of the elements differ"
    unit = torch.finfo(out.dtype).eps
    rel = ((a - b).abs() / b.abs().clamp_min(torch.finfo(out.dtype).tiny))[differ]
    assert rel.numel() == 0 or rel.max().item() <= 2 * unit, f"{what}: {rel.max().item():.3e}"


@needs_libraries
@pytest.mark.parametrize("dtypes", DTYPES, ids=lambda d: f"{d[0]}-{d[1]}".replace("torch.", ""))
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_swapped_class_computes_what_the_original_computes(case, dtypes):
    x_dtype, param_dtype = dtypes
    norm, shape, target = _build(case, param_dtype)
    swapped = fusednorm.replace_norms(copy.deepcopy(norm))
    assert type(swapped) is target
    x, x2 = _input(shape, x_dtype), _input(shape, x_dtype)
    try:
        expected = norm(x)
    except RuntimeError as error:  # the original's own dtype rules
        pytest.skip(f"{case[1]} itself refuses a {x_dtype} input with {param_dtype} "
                    f"parameters: {error}")
    out = swapped(x2)
    assert_same_rounding(out, expected, "output")
    assert out.stride() == expected.stride()
    if x_dtype != torch.float32:
        return  # gradients: the original's chain of ATen backwards rounds at every step
    cotangent = torch.randn(expected.shape, generator=torch.Generator().manual_seed(5))
    grads = torch.autograd.grad(expected, [x, *norm.parameters()], cotangent)
    fused_grads = torch.autograd.grad(out, [x2, *swapped.parameters()], cotangent)
    for name, g, f in zip(["input", *dict(norm.named_parameters())], grads, fused_grads):
        torch.testing.assert_close(f, g, rtol=1e-4, atol=1e-5, msg=f"grad of {name}")


@needs_libraries
def test_grouped_qwen4_norm_is_kept():
    from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpTextRMSNorm

    model = nn.ModuleDict({"row": Qwen4ExpTextRMSNorm(48),
                           "groups": Qwen4ExpTextRMSNorm(48, group_size=16)})
    fusednorm.replace_norms(model)
    assert type(model["row"]) is swap_targets.FusedGemmaRMSNorm
    assert type(model["groups"]) is Qwen4ExpTextRMSNorm


@needs_libraries
def test_per_head_cohere_norm_is_kept():
    from transformers.models.cohere.modeling_cohere import CohereLayerNorm

    model = nn.ModuleDict({"flat": CohereLayerNorm(hidden_size=48),
                           "heads": CohereLayerNorm(hidden_size=(4, 12))})
    fusednorm.replace_norms(model)
    assert type(model["flat"]) is swap_targets.FusedHFLayerNormCastLast
    assert type(model["heads"]) is CohereLayerNorm
    entry = next(e for e in fusednorm.norm_report(model).entries if e.name == "heads")
    assert entry.action == "keep" and "per-head" in entry.detail


class _Stack(nn.Module):
    def __init__(self, norms):
        super().__init__()
        self.norms = nn.ModuleList(norms)

    def forward(self, xs):
        return [norm(x) for norm, x in zip(self.norms, xs)]


@needs_libraries
@torch._inductor.config.patch(emulate_precision_casts=True)
def test_swapped_classes_under_compile():
    """Every target in one graph of torch.compile(fullgraph=True): forward and input
    gradients as the original classes' in eager mode, bfloat16 model and input. Inductor
    rounds its intermediate bfloat16 values as eager does only with emulate_precision_casts
    (by default it fuses elementwise steps into one rounding, the originals' and ours)."""
    cases = [case for case in CASES if case[1] != "EsmFold2LayerNorm"]  # float32 parameters only
    built = [_build(case, torch.bfloat16)[:2] for case in cases]
    originals = _Stack([norm for norm, _ in built])
    stack = fusednorm.replace_norms(copy.deepcopy(originals))
    xs = [_input(shape, torch.bfloat16, seed=i) for i, (_, shape) in enumerate(built)]
    xs_c = [x.detach().clone().requires_grad_() for x in xs]
    expected = originals(xs)
    torch._dynamo.reset()
    compiled = torch.compile(stack, fullgraph=True)(xs_c)
    for case, c, e in zip(cases, compiled, expected):
        assert_same_rounding(c, e, f"{case[1]} output")
    cotangents = [torch.randn(e.shape, generator=torch.Generator().manual_seed(i)).to(e.dtype)
                  for i, e in enumerate(expected)]
    torch.autograd.backward(expected, cotangents)
    torch.autograd.backward(compiled, cotangents)
    for case, x, x_c in zip(cases, xs, xs_c):
        # bf16 gradients through the original's chain of ATen backwards round at every
        # step: judged against the gradient's scale, not in units of the last place.
        scale = x.grad.float().abs().max().item()
        torch.testing.assert_close(x_c.grad.float(), x.grad.float(), rtol=0,
                                   atol=0.05 * scale, msg=f"{case[1]} input grad")
