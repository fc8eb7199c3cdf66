"""Saving and loading models with fusednorm's modules: whole-model pickles, state dicts
(weights_only), checkpoints written with nn.LayerNorm loaded into a replaced model and
back, resuming training with optimizer state, and transformers' save_pretrained."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import fusednorm
from gpt_example import TINY, build_model, token_batch


def _norm_classes(model: nn.Module) -> set[type]:
    return {type(m) for m in model.modules() if isinstance(m, nn.LayerNorm)}


def _assert_same_state(a: dict, b: dict) -> None:
    assert list(a) == list(b)
    for name, value in a.items():
        assert torch.equal(value, b[name]), name


@torch.no_grad()
def _logits(model: nn.Module) -> torch.Tensor:
    return model(token_batch(3, seed=7)[0])


def test_torch_save_whole_model(tmp_path):
    model = build_model(TINY, "fused", seed=0)
    torch.save(model, tmp_path / "model.pt")
    loaded = torch.load(tmp_path / "model.pt", weights_only=False)
    assert _norm_classes(loaded) == {fusednorm.FusedLayerNorm}
    _assert_same_state(loaded.state_dict(), model.state_dict())
    assert torch.equal(_logits(loaded), _logits(model))


def test_state_dict_weights_only(tmp_path):
    model = build_model(TINY, "fused", seed=0)
    torch.save(model.state_dict(), tmp_path / "state.pt")
    other = build_model(TINY, "fused", seed=1)
    other.load_state_dict(torch.load(tmp_path / "state.pt", weights_only=True))
    assert torch.equal(_logits(other), _logits(model))


def test_layernorm_checkpoint_into_replaced_model_and_back(tmp_path):
    """A state dict written by a model with nn.LayerNorm loads strictly into the same model
    after replace_layernorm, and what that model writes loads back into a plain one: the
    keys and values are the same, only the kernels differ."""
    plain = build_model(TINY, "torch", seed=0)
    torch.save(plain.state_dict(), tmp_path / "plain.pt")

    replaced = fusednorm.replace_layernorm(build_model(TINY, "torch", seed=1))
    assert _norm_classes(replaced) == {fusednorm.FusedLayerNorm}
    replaced.load_state_dict(torch.load(tmp_path / "plain.pt", weights_only=True))
    _assert_same_state(replaced.state_dict(), plain.state_dict())
    torch.testing.assert_close(_logits(replaced), _logits(plain), atol=1e-5, rtol=1e-5)

    torch.save(replaced.state_dict(), tmp_path / "replaced.pt")
    back = build_model(TINY, "torch", seed=2)
    back.load_state_dict(torch.load(tmp_path / "replaced.pt", weights_only=True))
    assert _norm_classes(back) == {nn.LayerNorm}
    _assert_same_state(back.state_dict(), plain.state_dict())
    assert torch.equal(_logits(back), _logits(plain))


def _train(model, optimizer, seeds) -> None:
    for seed in seeds:
        _, loss = model(*token_batch(4, seed=seed))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()


def _adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-3)


@pytest.mark.parametrize("how", ["load_checkpoint", "replace_in_place"])
def test_resume_training_with_fused_layernorm(tmp_path, how):
    """Training started with nn.LayerNorm goes on with FusedLayerNorm, optimizer state
    included, as it would have with nn.LayerNorm: either from a checkpoint (model and
    optimizer state dicts) or by replace_layernorm on the live model."""
    model = build_model(TINY, "torch", seed=0)
    optimizer = _adamw(model)
    _train(model, optimizer, seeds=[0, 1])
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()},
               tmp_path / "ckpt.pt")

    expected = copy.deepcopy(model)
    expected_opt = _adamw(expected)
    # A deep copy: load_state_dict would share the moment tensors with `optimizer`.
    expected_opt.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    _train(expected, expected_opt, seeds=[2, 3])

    if how == "load_checkpoint":
        checkpoint = torch.load(tmp_path / "ckpt.pt", weights_only=True)
        resumed = build_model(TINY, "fused", seed=1)
        resumed.load_state_dict(checkpoint["model"])
        resumed_opt = _adamw(resumed)
        resumed_opt.load_state_dict(checkpoint["optimizer"])
    else:
        resumed, resumed_opt = fusednorm.replace_layernorm(model), optimizer
    assert fusednorm.FusedLayerNorm in _norm_classes(resumed)
    _train(resumed, resumed_opt, seeds=[2, 3])
    # Adam's steps are about lr (1e-3) each, so lost or stale optimizer state would show
    # far above this tolerance; float32 rounding in the gradients stays below it.
    for (name, value), ref in zip(resumed.state_dict().items(), expected.state_dict().values()):
        torch.testing.assert_close(value, ref, atol=1e-5, rtol=1e-4,
                                   msg=lambda m, name=name: f"{name}: {m}")


def test_transformers_save_pretrained_round_trip(tmp_path):
    """A transformers model after replace_layernorm saves with save_pretrained and loads
    with from_pretrained (from the local directory) into a plain model, and back."""
    transformers = pytest.importorskip("transformers", reason="needs transformers (models extra)")
    config = transformers.GPT2Config(vocab_size=96, n_positions=32, n_embd=32, n_layer=2,
                                     n_head=2, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = fusednorm.replace_layernorm(transformers.GPT2LMHeadModel(config).eval())
    model.save_pretrained(tmp_path)
    plain = transformers.GPT2LMHeadModel.from_pretrained(tmp_path, local_files_only=True).eval()
    assert _norm_classes(plain) == {nn.LayerNorm}
    _assert_same_state(plain.state_dict(), model.state_dict())
    again = fusednorm.replace_layernorm(plain)
    ids = torch.randint(96, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(again(input_ids=ids).logits, model(input_ids=ids).logits)
