"""replace_layernorm on models of popular libraries (Hugging Face transformers, timm), built
from configs with random weights (nothing is downloaded): the same outputs and gradients
as the original model."""
from __future__ import annotations

import copy
import importlib.util

import pytest
import torch
from torch import nn

import fusednorm
from conftest import DEVICES, assert_close_three_way

transformers = pytest.importorskip(
    "transformers", reason="needs transformers (models extra: bash scripts/install.sh test,models)")


def _import_timm():
    """timm, or a skip that says why it cannot run here. timm imports torchvision, which must
    be the build made for the installed torch: scripts/install.sh installs it with timm, or
    prints why it cannot (e.g. a +cpu torch, whose torchvision only its own index has)."""
    try:
        import timm
        return timm
    except Exception as error:  # noqa: BLE001  (a torchvision of another build: RuntimeError)
        no_vision = importlib.util.find_spec("torchvision") is None
        need = f"the torchvision built for torch {torch.__version__}"
        if importlib.util.find_spec("timm") is None:
            pytest.skip(f"needs timm (models extra) and {need}"
                        + (", neither installed" if no_vision else "")
                        + ": scripts/install.sh test,models installs them or prints why it cannot")
        pytest.skip(f"timm does not import ({type(error).__name__}: {error}): it needs {need}, "
                    + ("and none is installed" if no_vision else "the one installed may be another's"))


def _randomize_layernorms(model: nn.Module, seed: int = 0) -> None:
    """LayerNorm weights away from 1 and biases away from 0, so that a kernel that skipped
    the affine step would show."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.LayerNorm) and module.elementwise_affine:
                module.weight.copy_(1 + 0.5 * torch.randn(module.weight.shape, generator=generator))
                if module.bias is not None:
                    module.bias.copy_(0.5 * torch.randn(module.bias.shape, generator=generator))


def _count(model: nn.Module, cls: type) -> int:
    return sum(type(m) is cls for m in model.modules())


def _first_tensor(output) -> torch.Tensor:
    """The main output of a transformers model (logits or last hidden state) or a tensor."""
    if isinstance(output, torch.Tensor):
        return output
    return output[0]


def _output_and_grads(model: nn.Module, inputs: dict) -> tuple[torch.Tensor, dict]:
    """The main output of model(**inputs), and every parameter's gradient for a fixed
    random cotangent (None for parameters the output does not reach)."""
    model.zero_grad(set_to_none=True)
    out = _first_tensor(model(**inputs))
    cotangent = torch.randn(out.shape, dtype=torch.float64,
                            generator=torch.Generator().manual_seed(1)).to(out)
    (out * cotangent).sum().backward()
    return out.detach(), {name: p.grad for name, p in model.named_parameters()}


def _assert_close_normwise(fused, torch_same_dtype, ref64, what, rtol=1e-5):
    """||fused - ref64|| <= 2 ||torch - ref64|| + rtol (||ref64|| + sqrt(numel)): for
    gradients of deep models, where rounding differences of every layer add up and an
    elementwise bound would judge noise. The sqrt(numel) term is conftest's elementwise
    float32 atol (1e-5 per element) over the tensor: a gradient that is zero in exact
    arithmetic (BERT's key biases: softmax ignores a shift of its row) is float32 noise in
    both models, which twice PyTorch's noise alone would not always bound."""
    ref64 = ref64.double()
    fused_err = (fused.double() - ref64).norm().item()
    torch_err = (torch_same_dtype.double() - ref64).norm().item()
    bound = 2 * torch_err + rtol * (ref64.norm().item() + ref64.numel() ** 0.5)
    assert fused_err <= bound, f"{what}: error norm {fused_err:.3e} > {bound:.3e} (torch {torch_err:.3e})"


def assert_same_outputs_and_grads(model: nn.Module, fused: nn.Module, inputs: dict,
                                  normwise_grads: bool = False) -> None:
    """fused(**inputs) and its parameter gradients match model(**inputs)'s, as far as
    float32 allows: both are checked against the model run in float64, and the fused
    model's error may be at most about twice the original's (plus a small atol), element
    by element (gradients: per tensor, by norm, with normwise_grads)."""
    ref64 = copy.deepcopy(model).double()
    inputs64 = {k: v.double() if v.is_floating_point() else v for k, v in inputs.items()}
    out, grads = _output_and_grads(model, inputs)
    fused_out, fused_grads = _output_and_grads(fused, inputs)
    ref_out, ref_grads = _output_and_grads(ref64, inputs64)
    assert_close_three_way(fused_out, out, ref_out, torch.float32, "output")
    assert fused_grads.keys() == grads.keys()
    for name, grad in grads.items():
        if grad is None:
            assert fused_grads[name] is None, name
            continue
        if normwise_grads:
            _assert_close_normwise(fused_grads[name], grad, ref_grads[name], f"grad of {name}")
        else:
            assert_close_three_way(fused_grads[name], grad, ref_grads[name], torch.float32,
                                   f"grad of {name}")


def check_replace_layernorm(model: nn.Module, inputs: dict, device: str) -> None:
    """replace_layernorm on a copy of `model` swaps every nn.LayerNorm and changes neither
    the outputs (element by element) nor the gradients (per tensor, by norm: a parameter
    such as ViT's cls_token sums contributions of every layer and token, whose float32
    rounding depends on the order autograd adds them in, so its elements near zero differ
    from the float64 model by noise on the scale of the whole tensor)."""
    model = model.to(device).eval()  # eval: no dropout, whatever the config says
    _randomize_layernorms(model)
    n_layernorms = _count(model, nn.LayerNorm)
    assert n_layernorms > 0, "the model has no nn.LayerNorm to replace"
    fused = fusednorm.replace_layernorm(copy.deepcopy(model))
    assert _count(fused, nn.LayerNorm) == 0
    assert _count(fused, fusednorm.FusedLayerNorm) == n_layernorms
    inputs = {k: v.to(device) for k, v in inputs.items()}
    assert_same_outputs_and_grads(model, fused, inputs, normwise_grads=True)


def _tokens(batch: int, length: int, vocab: int) -> torch.Tensor:
    return torch.randint(vocab, (batch, length), generator=torch.Generator().manual_seed(0))


def _images(batch: int, size: int) -> torch.Tensor:
    return torch.randn(batch, 3, size, size, generator=torch.Generator().manual_seed(0))


_NO_DROPOUT = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


@pytest.mark.parametrize("device", DEVICES)
def test_gpt2(device):
    config = transformers.GPT2Config(
        vocab_size=96, n_positions=32, n_embd=32, n_layer=2, n_head=2, bos_token_id=0,
        eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    check_replace_layernorm(model, {"input_ids": _tokens(2, 12, 96)}, device)


@pytest.mark.parametrize("device", DEVICES)
def test_bert_with_padding_mask(device):
    config = transformers.BertConfig(
        vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=32, **_NO_DROPOUT,
    )
    torch.manual_seed(0)
    model = transformers.BertModel(config)
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, 7:] = 0
    check_replace_layernorm(
        model, {"input_ids": _tokens(2, 12, 96), "attention_mask": mask}, device
    )


@pytest.mark.parametrize("device", DEVICES)
def test_vit(device):
    config = transformers.ViTConfig(
        image_size=32, patch_size=8, num_channels=3, hidden_size=32, num_hidden_layers=2,
        num_attention_heads=2, intermediate_size=64, **_NO_DROPOUT,
    )
    torch.manual_seed(0)
    model = transformers.ViTModel(config)
    check_replace_layernorm(model, {"pixel_values": _images(2, 32)}, device)


def _timm_vit(norm_layer):
    """A small timm ViT; norm_layer=None: timm's default (timm.layers.LayerNorm)."""
    timm = _import_timm()
    torch.manual_seed(0)
    kwargs = {} if norm_layer is None else {"norm_layer": norm_layer}
    return timm.create_model(
        "vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2,
        embed_dim=32, num_heads=2, num_classes=10, **kwargs,
    )


@pytest.mark.parametrize("device", DEVICES)
def test_timm_vit_built_with_nn_layernorm(device):
    """Built with norm_layer=nn.LayerNorm the model is all plain LayerNorms."""
    check_replace_layernorm(_timm_vit(nn.LayerNorm), {"x": _images(2, 32)}, device)


def check_swaps_timm_norms(model: nn.Module, inputs: dict, device: str, source: str,
                           target: type, count: int, normwise_grads: bool = False) -> None:
    """replace_layernorm turns `count` modules of timm's class `source` into `target`,
    says so in norm_report, and leaves outputs and gradients unchanged."""
    model = model.to(device).eval()
    _randomize_layernorms(model)
    before = fusednorm.norm_report(model)
    assert [e.cls for e in before.entries if e.action == "swap"] == [source] * count
    fused = fusednorm.replace_layernorm(copy.deepcopy(model))
    assert _count(fused, target) == count
    after = fusednorm.norm_report(fused)
    assert after.count("fused") == count and after.count("swap") == 0
    assert_same_outputs_and_grads(model, fused, {k: v.to(device) for k, v in inputs.items()},
                                  normwise_grads)


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
def test_timm_vit_tiny(device):
    """timm's default ViT-tiny, whose 25 norms are timm.layers.LayerNorm (an nn.LayerNorm
    subclass computing F.layer_norm over the same arguments)."""
    timm = _import_timm()
    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False)
    check_swaps_timm_norms(model, {"x": _images(1, 224)}, device,
                           "timm.layers.norm.LayerNorm", fusednorm.FusedLayerNorm, 25,
                           normwise_grads=True)  # 12 blocks deep: see _assert_close_normwise


@pytest.mark.parametrize("device", DEVICES)
def test_timm_convnext(device):
    """ConvNeXt's channels-first timm.layers.LayerNorm2d becomes FusedLayerNorm2d."""
    timm = _import_timm()
    torch.manual_seed(0)
    model = timm.create_model("convnext_atto", pretrained=False, num_classes=10,
                              depths=(1, 1, 1, 1), dims=(16, 24, 32, 48))
    check_swaps_timm_norms(model, {"x": _images(2, 64)}, device,
                           "timm.layers.norm.LayerNorm2d", fusednorm.FusedLayerNorm2d, 9)


# timm's norm classes that replace_norms swaps, and the input shape each takes.
_TIMM_NORMS = [("LayerNorm2d", 4), ("LayerNormFp32", 2), ("LayerNorm2dFp32", 4),
               ("RmsNormFp32", 2), ("RmsNorm2dFp32", 4), ("LayerNormAct", 2),
               ("LayerNormAct2d", 4), ("LayerNormActFp32", 2), ("LayerNormAct2dFp32", 4),
               ("RmsNormActFp32", 2), ("RmsNormAct2dFp32", 4)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name, dims", _TIMM_NORMS, ids=[n for n, _ in _TIMM_NORMS])
def test_timm_norms_script_after_the_swap(name, dims, dtype):
    """timm's models script (torch.jit.script), and still do once replace_norms has swapped
    their norms: the scripted module computes what the swapped eager one does, bit for bit,
    and what timm's own (scripted) computes. float32 parameters under bfloat16 input take
    the Fp32 classes' cast rule."""
    timm = _import_timm()
    original = getattr(timm.layers, name)(24).eval()
    _randomize_layernorms(original)
    for p in original.parameters():
        p.data = p.data + 0.25  # an RMSNorm's weight away from 1 as well
    model = nn.Sequential(original).to(dtype)
    want = torch.jit.script(copy.deepcopy(model))
    fused = fusednorm.replace_norms(model)
    assert type(fused[0]).__module__.startswith("fusednorm"), type(fused[0])
    scripted = torch.jit.script(fused)
    assert "fusednorm::" in str(scripted.inlined_graph)
    shape = (3, 24, 5, 7) if dims == 4 else (3, 5, 24)
    x = (torch.randn(shape, dtype=torch.float64) * 2 + 1).to(dtype)
    leaf, script_leaf = x.clone().requires_grad_(), x.clone().requires_grad_()
    out, script_out = fused(leaf), scripted(script_leaf)
    assert script_out.dtype == out.dtype and torch.equal(script_out, out)
    grad = torch.randn(out.shape, dtype=torch.float64).to(out.dtype)
    out.backward(grad)
    script_out.backward(grad)
    assert torch.equal(script_leaf.grad, leaf.grad)
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    with torch.no_grad():  # (timm's scripted LayerNormAct2d in bfloat16 acts in place)
        expected = want(x)
    torch.testing.assert_close(out.detach(), expected, **tol)


@pytest.mark.parametrize("device", DEVICES)
def test_timm_convnext_scripts_after_the_swap(device):
    """A whole timm ConvNeXt scripts with its LayerNorm2d swapped, computing what eager does."""
    timm = _import_timm()
    torch.manual_seed(0)
    model = timm.create_model("convnext_atto", pretrained=False, num_classes=10,
                              depths=(1, 1, 1, 1), dims=(16, 24, 32, 48)).to(device).eval()
    _randomize_layernorms(model)
    fused = fusednorm.replace_norms(model)
    assert _count(fused, fusednorm.FusedLayerNorm2d) == 9
    scripted = torch.jit.script(fused)
    x = _images(2, 64).to(device)
    assert torch.equal(scripted(x), fused(x))


def test_timm_fast_norm_is_kept():
    """With timm's fast norm on, its LayerNorm computes otherwise (apex, or low precision
    under autocast): replace_layernorm leaves it, and warns that nothing was swapped."""
    timm = _import_timm()
    from timm.layers import is_fast_norm, set_fast_norm

    was = is_fast_norm()
    set_fast_norm(True)
    try:
        model = _timm_vit(None)
    finally:
        set_fast_norm(was)
    with pytest.warns(UserWarning, match="fast norm"):
        fusednorm.replace_layernorm(model)
    assert _count(model, fusednorm.FusedLayerNorm) == 0


@pytest.mark.parametrize("device", DEVICES)
def test_timm_vit_built_with_fused_layernorm(device):
    """FusedLayerNorm passed to timm as norm_layer: the same model as with nn.LayerNorm."""
    plain = _timm_vit(nn.LayerNorm).to(device).eval()
    _randomize_layernorms(plain)
    fused = _timm_vit(fusednorm.FusedLayerNorm).to(device).eval()
    fused.load_state_dict(plain.state_dict())
    assert _count(fused, fusednorm.FusedLayerNorm) == _count(plain, nn.LayerNorm) > 0
    assert_same_outputs_and_grads(plain, fused, {"x": _images(2, 32).to(device)})


def _randomize_rms_weights(model: nn.Module, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            if "RMSNorm" in type(module).__name__:
                module.weight.copy_(torch.rand(module.weight.shape, generator=g) + 0.5)


@pytest.mark.parametrize("device", DEVICES)
def test_llama_replace_norms(device):
    """A small random Llama: replace_norms swaps its LlamaRMSNorms (2 per layer and the
    final one) and changes neither outputs nor gradients."""
    config = transformers.LlamaConfig(vocab_size=101, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(config).to(device).eval()
    _randomize_rms_weights(model)
    fused = fusednorm.replace_norms(copy.deepcopy(model))
    assert _count(fused, fusednorm.FusedHFRMSNorm) == 5
    inputs = {"input_ids": _tokens(2, 16, 101).to(device)}
    assert_same_outputs_and_grads(model, fused, inputs, normwise_grads=True)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hf_rms_norm_classes_keep_their_numerics(family, dtype):
    """Each swapped Hugging Face RMSNorm class gives its own results: normalized in float32,
    cast to the input dtype, then times the weight (whose dtype sets the output's)."""
    import importlib

    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    cls = next(getattr(module, n) for n in dir(module) if n.lower() == f"{family}rmsnorm")
    norm = cls(48, eps=1e-5)
    _randomize_rms_weights(norm)
    x = (torch.randn(5, 7, 48, generator=torch.Generator().manual_seed(2)) * 3 + 1).to(dtype)
    expected = norm(x)
    fused = fusednorm.replace_norms(copy.deepcopy(norm))
    assert type(fused) is fusednorm.FusedHFRMSNorm
    out = fused(x)
    assert out.dtype == expected.dtype
    # float32 statistics summed in another order: equal to float32 rounding, and the bf16
    # cast before the weight makes at most one bf16 step of difference, rarely.
    torch.testing.assert_close(out, expected, rtol=1e-5 if dtype == torch.float32 else 8e-3,
                               atol=1e-6 if dtype == torch.float32 else 8e-3)


@pytest.mark.parametrize("device", DEVICES)
def test_gemma_replace_norms(device):
    """A small random Gemma: replace_norms swaps its GemmaRMSNorms (x.float() times
    1 + weight.float(), cast back) for FusedGemmaRMSNorm and changes neither outputs nor
    gradients."""
    config = transformers.GemmaConfig(vocab_size=101, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, head_dim=16,
                                      max_position_embeddings=64)
    model = transformers.GemmaForCausalLM(config).to(device).eval()
    _randomize_rms_weights(model)
    fused = fusednorm.replace_norms(copy.deepcopy(model))
    assert _count(fused, fusednorm.swap_targets.FusedGemmaRMSNorm) == 5
    inputs = {"input_ids": _tokens(2, 16, 101).to(device)}
    assert_same_outputs_and_grads(model, fused, inputs, normwise_grads=True)


@pytest.mark.parametrize("device", DEVICES)
def test_t5_replace_norms(device):
    """A small random T5 encoder: replace_norms swaps its T5LayerNorms (float32 variance,
    the weight's cast rule) for FusedT5LayerNorm and changes neither outputs nor
    gradients."""
    config = transformers.T5Config(vocab_size=101, d_model=64, d_kv=16, d_ff=128, num_layers=2,
                                   num_heads=4, dropout_rate=0.0)
    model = transformers.T5EncoderModel(config).to(device).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for module in model.modules():
            if type(module).__name__ == "T5LayerNorm":
                module.weight.copy_(torch.rand(module.weight.shape, generator=g) + 0.5)
    fused = fusednorm.replace_norms(copy.deepcopy(model))
    assert _count(fused, fusednorm.swap_targets.FusedT5LayerNorm) == 5  # 2 per layer + final
    inputs = {"input_ids": _tokens(2, 16, 101).to(device)}
    assert_same_outputs_and_grads(model, fused, inputs, normwise_grads=True)
