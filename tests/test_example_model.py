"""The example GPT (examples/gpt_model.py) with fusednorm's modules against the same model
with PyTorch's: identical initialisation, autocast, torch.compile of the whole model, and
CUDA-graph capture of a training step."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import fusednorm
from conftest import DEVICES, HAS_CUDA
from gpt_example import TINY, build_model, token_batch

needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU and fusednorm's CUDA kernels")


def _loss_and_grads(model: nn.Module, x: torch.Tensor, y: torch.Tensor):
    model.zero_grad(set_to_none=True)
    _, loss = model(x, y)
    loss.backward()
    # A compiled module names its parameters "_orig_mod.<name>".
    return loss.detach(), {
        name.removeprefix("_orig_mod."): p.grad.clone() for name, p in model.named_parameters()
    }


def test_same_initial_weights_for_both_norms():
    """--norm torch and --norm fused start from bitwise-equal weights under the same keys."""
    torch_state = build_model(TINY, "torch", seed=3).state_dict()
    fused_model = build_model(TINY, "fused", seed=3)
    assert any(isinstance(m, fusednorm.FusedLayerNorm) for m in fused_model.modules())
    fused_state = fused_model.state_dict()
    assert list(fused_state) == list(torch_state)
    for name, value in torch_state.items():
        assert torch.equal(fused_state[name], value), name


def test_fused_ffn_is_used_when_fusednorm_has_it():
    ffn_class = getattr(fusednorm, "FusedGeluFFN", None)
    if ffn_class is None:
        pytest.skip("fusednorm.FusedGeluFFN is not in this fusednorm yet")
    assert all(isinstance(block.ffn, ffn_class) for block in build_model(TINY, "fused", 0).blocks)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("gelu", ["none", "tanh"])
def test_both_norms_train_alike_with_either_gelu(device, gelu):
    """--gelu none and tanh (GPT-2's): each FFN applies the config's GELU, and the fused model's
    loss and gradients equal the torch model's to float32 rounding; the two forms differ."""
    import dataclasses

    config = dataclasses.replace(TINY, gelu=gelu)
    x, y = token_batch(4, config, device=device)
    models = [build_model(config, norm, seed=5, device=device) for norm in ("torch", "fused")]
    assert all(block.ffn.approximate == gelu for m in models for block in m.blocks)
    (loss_t, grads_t), (loss_f, grads_f) = (_loss_and_grads(m, x, y) for m in models)
    torch.testing.assert_close(loss_f, loss_t, rtol=1e-5, atol=1e-6)
    for name, grad in grads_t.items():
        torch.testing.assert_close(grads_f[name], grad, rtol=1e-4, atol=1e-6, msg=name)
    # The block's FFN on inputs where the two forms differ (the tiny model's own activations
    # are too small for that): fused as torch, and unlike the other form.
    other = build_model(dataclasses.replace(config, gelu="tanh" if gelu == "none" else "none"),
                        "torch", seed=5, device=device)
    h = torch.randn(8, config.d_model, generator=torch.Generator().manual_seed(1)).to(device) * 20
    with torch.no_grad():
        ffn_t, ffn_f, ffn_o = (m.blocks[0].ffn(h) for m in (*models, other))
    torch.testing.assert_close(ffn_f, ffn_t)
    # erf and tanh GELU differ by up to ~2e-4: far above float32's rounding of the outputs.
    assert (ffn_o - ffn_t).abs().max() > 100 * torch.finfo(torch.float32).eps * ffn_t.abs().max()


AUTOCAST_CASES = [
    ("cpu", torch.bfloat16),
    pytest.param("cuda", torch.float16, marks=needs_cuda),
    pytest.param("cuda", torch.bfloat16, marks=needs_cuda),
]


def _record_norm_dtypes(model: nn.Module) -> list[tuple[torch.dtype, torch.dtype]]:
    """Hooks that append (input dtype, output dtype) of every LayerNorm call to a list."""
    records: list[tuple[torch.dtype, torch.dtype]] = []
    for module in model.modules():
        if isinstance(module, nn.LayerNorm):
            module.register_forward_hook(lambda m, args, out: records.append((args[0].dtype, out.dtype)))
    return records


@pytest.mark.parametrize("device, dtype", AUTOCAST_CASES)
def test_autocast(device, dtype):
    """Under torch.autocast the fused model computes what the torch model does, with the
    documented LayerNorm output dtypes: the input's dtype on CPU (autocast leaves
    layer_norm alone there), float32 on CUDA (layer_norm is on autocast's float32 list)."""
    x, y = token_batch(4, device=device)
    results = {}
    for norm in ("torch", "fused"):
        model = build_model(TINY, norm, 0, device)
        dtypes = _record_norm_dtypes(model)
        with torch.autocast(device, dtype=dtype):
            model.zero_grad(set_to_none=True)
            logits, loss = model(x, y)
        loss.backward()
        grads = {name: p.grad for name, p in model.named_parameters()}
        results[norm] = logits, loss, grads, dtypes
    logits, loss, grads, dtypes = results["fused"]
    t_logits, t_loss, t_grads, t_dtypes = results["torch"]
    expected_out = (lambda in_dtype: in_dtype) if device == "cpu" else (lambda _: torch.float32)
    assert len(dtypes) == 2 * TINY.n_layer + 1
    assert all(out == expected_out(inp) for inp, out in dtypes), dtypes
    assert dtypes == t_dtypes
    assert logits.dtype == t_logits.dtype == dtype
    # Both models round the same matmuls to `dtype`; the LayerNorms differ by float32
    # rounding only, which a low-precision matmul input rarely turns into a different value.
    torch.testing.assert_close(loss, t_loss, atol=1e-2, rtol=1e-2)
    for name, grad in grads.items():
        rel = (grad.float() - t_grads[name].float()).norm() / t_grads[name].float().norm()
        assert rel < 2e-2, f"grad of {name}: relative difference {rel:.2e}"


@pytest.mark.slow  # inductor compiles C++ on a CPU: tens of seconds on two cores
@pytest.mark.parametrize("device", DEVICES)
def test_compile_whole_model(device):
    """torch.compile(fullgraph=True) of the whole model, forward and backward, equals eager:
    fusednorm's ops trace without graph breaks inside a real model."""
    torch._dynamo.reset()
    model = build_model(TINY, "fused", 0, device)
    x, y = token_batch(4, device=device)
    eager_loss, eager_grads = _loss_and_grads(model, x, y)
    compiled_loss, compiled_grads = _loss_and_grads(torch.compile(model, fullgraph=True), x, y)
    torch.testing.assert_close(compiled_loss, eager_loss, atol=1e-5, rtol=1e-5)
    for name, grad in eager_grads.items():
        torch.testing.assert_close(compiled_grads[name], grad, atol=1e-5, rtol=1e-4,
                                   msg=lambda m, name=name: f"grad of {name}: {m}")


@needs_cuda
def test_cuda_graph_training_step():
    """A whole training step (forward, backward, AdamW step) captured in a CUDA graph and
    replayed on new batches gives the parameters of the same steps run eagerly."""
    device = "cuda"
    warmup_steps, replays = 3, 4
    batches = [token_batch(4, seed=i, device=device) for i in range(warmup_steps + replays)]

    def make():
        model = build_model(TINY, "fused", 0, device)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3, capturable=True)

    eager, eager_opt = make()
    for x, y in batches:
        _, loss = eager(x, y)
        eager_opt.zero_grad(set_to_none=True)
        loss.backward()
        eager_opt.step()

    model, optimizer = make()
    static_x, static_y = (t.clone() for t in batches[0])

    def step():
        _, loss = model(static_x, static_y)
        loss.backward()
        optimizer.step()
        return loss

    # Warm-up on a side stream (allocates the optimizer state), then capture with the
    # gradients set to None, so that backward allocates them from the graph's pool and
    # every replay overwrites them (no zeroing between replays).
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for x, y in batches[:warmup_steps]:
            static_x.copy_(x)
            static_y.copy_(y)
            optimizer.zero_grad(set_to_none=True)
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    optimizer.zero_grad(set_to_none=True)
    with torch.cuda.graph(graph):
        step()
    # Capture ran nothing: each replay is one full step.
    for x, y in batches[warmup_steps:]:
        static_x.copy_(x)
        static_y.copy_(y)
        graph.replay()
    torch.cuda.synchronize()
    for (name, p), ref in zip(model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p, ref, atol=1e-5, rtol=1e-4,
                                   msg=lambda m, name=name: f"{name}: {m}")
