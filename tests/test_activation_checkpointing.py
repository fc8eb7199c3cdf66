"""torch.utils.checkpoint around every public op: the recomputation in the backward gives
the gradients a plain call gives, bit for bit, in both of checkpoint's modes.

The non-reentrant mode stops its recomputation by raising an exception from a
saved-tensor hook, in the middle of an op: that exception must leave the op as it is (the
direct entries once turned it into a SystemError)."""
from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import fusednorm
from fusednorm import functional
from conftest import DEVICES, random_input

D, H = 37, 52  # odd row length and hidden width


def _tensors(device, dtype):
    g = lambda shape, seed, scale=1.0: random_input(shape, dtype, device, scale=scale, seed=seed)  # noqa: E731
    return {
        "x": g((3, 5, D), 1), "r": g((3, 5, D), 2), "w": g((D,), 3), "b": g((D,), 4),
        "w1": g((H, D), 5, 0.2), "b1": g((H,), 6), "w2": g((D, H), 7, 0.2), "b2": g((D,), 8),
    }


# name -> function of the tensors dict returning a tuple of outputs
CALLS = {
    "layer_norm": lambda t: (fusednorm.layer_norm(t["x"], (D,), t["w"], t["b"]),),
    "rms_norm": lambda t: (fusednorm.rms_norm(t["x"], (D,), t["w"]),),
    "add_layer_norm": lambda t: fusednorm.add_layer_norm(t["x"], t["r"], (D,), t["w"], t["b"]),
    "add_rms_norm": lambda t: fusednorm.add_rms_norm(t["x"], t["r"], (D,), t["w"]),
    "gelu_ffn": lambda t: (fusednorm.gelu_ffn(t["x"], t["w1"], t["b1"], t["w2"], t["b2"]),),
    "layer_norm_gelu_ffn": lambda t: (functional.layer_norm_gelu_ffn(
        t["x"], t["w"], t["b"], 1e-5, t["w1"], t["b1"], t["w2"], t["b2"]),),
}


def _outputs_and_grads(call, device, dtype, wrap):
    leaves = {k: v.requires_grad_() for k, v in _tensors(device, dtype).items()}
    outs = wrap(lambda *values: call(dict(zip(leaves, values))), *leaves.values())
    grads_out = [random_input(o.shape, o.dtype, device, seed=20 + i) for i, o in enumerate(outs)]
    # .backward(), not autograd.grad: the reentrant mode supports only the former.
    torch.autograd.backward(outs, grads_out)
    return outs, [leaf.grad for leaf in leaves.values()]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("use_reentrant", [False, True])
@pytest.mark.parametrize("name", list(CALLS))
def test_checkpointed_call_gives_the_same_gradients(name, use_reentrant, dtype, device):
    call = CALLS[name]
    plain = _outputs_and_grads(call, device, dtype, lambda fn, *args: fn(*args))
    ckpt = _outputs_and_grads(
        call, device, dtype,
        lambda fn, *args: checkpoint(fn, *args, use_reentrant=use_reentrant))
    for p, c in zip(plain[0], ckpt[0]):
        assert torch.equal(p, c)
    used = 0
    for p, c in zip(plain[1], ckpt[1]):
        assert (p is None) == (c is None)
        if p is not None:
            assert torch.equal(p, c)
            used += 1
    assert used >= 2  # at least the input and a weight reached the gradient


@pytest.mark.parametrize("device", DEVICES)
def test_checkpointed_modules_train_as_without(device):
    """A pre-LN block of the fused modules under non-reentrant checkpointing, as training
    code wraps its blocks: same loss and parameter gradients as without."""
    torch.manual_seed(0)
    block = torch.nn.Sequential(fusednorm.FusedLayerNorm(D), fusednorm.FusedGeluFFN(D, H),
                                fusednorm.FusedRMSNorm(D)).to(device)
    x = random_input((4, 7, D), torch.float32, device).requires_grad_()
    results = []
    for wrap in (lambda m, v: m(v), lambda m, v: checkpoint(m, v, use_reentrant=False)):
        block.zero_grad()
        x.grad = None
        loss = wrap(block, x).square().mean()
        loss.backward()
        results.append((loss.detach(), x.grad.clone(),
                        [p.grad.clone() for p in block.parameters()]))
    (loss0, dx0, g0), (loss1, dx1, g1) = results
    assert torch.equal(loss0, loss1) and torch.equal(dx0, dx1)
    assert all(torch.equal(a, b) for a, b in zip(g0, g1))


class _HookError(Exception):
    pass


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(CALLS))
def test_python_error_from_a_saved_tensor_hook_is_raised_once(name, device):
    """An exception raised by Python code inside an op (here a saved-tensor pack hook)
    leaves the call as itself, and the op does not run again: the hook saw one call."""
    tensors = {k: v.requires_grad_() for k, v in _tensors(device, torch.float32).items()}
    calls = []

    def pack(t):
        calls.append(tuple(t.shape))
        raise _HookError("from the pack hook")

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with pytest.raises(_HookError, match="from the pack hook"):
            CALLS[name](tensors)
    assert len(calls) == 1, calls


@pytest.mark.parametrize("device", DEVICES)
def test_checkpointed_block_compiled_recomputes_the_fused_ops(device):
    """torchtitan's order: checkpoint_wrapper (non-reentrant) around a block, then
    torch.compile(fullgraph=True) of the wrapper. The fused ops are in the forward graph and
    again in the backward one (recomputed there, with their backward ops); loss and
    gradients are eager's, bit for bit."""
    from torch._dynamo.backends.common import aot_autograd
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from functorch.compile import make_boxed_func

    torch.manual_seed(0)
    block = torch.nn.Sequential(fusednorm.FusedLayerNorm(D), fusednorm.FusedGeluFFN(D, H),
                                fusednorm.FusedRMSNorm(D)).to(device)
    x = random_input((4, 7, D), torch.float32, device).requires_grad_()
    graphs = {}

    def recording(name):
        def compiler(gm, example_inputs):
            graphs[name] = {str(n.target) for n in gm.graph.nodes
                            if n.op == "call_function" and str(n.target).startswith("fusednorm.")}
            return make_boxed_func(gm.forward)
        return compiler

    backend = aot_autograd(fw_compiler=recording("forward"), bw_compiler=recording("backward"))
    compiled = torch.compile(checkpoint_wrapper(block, preserve_rng_state=False),
                             backend=backend, fullgraph=True)
    results = []
    for fn in (block, compiled):
        block.zero_grad()
        x.grad = None
        loss = fn(x).square().mean()
        loss.backward()
        results.append((loss.detach(), x.grad.clone(), [p.grad.clone() for p in block.parameters()]))
    ops = {"fusednorm.layer_norm.default", "fusednorm.gelu_ffn.default", "fusednorm.rms_norm.default"}
    assert graphs["forward"] == ops, graphs
    assert ops <= graphs["backward"], graphs  # recomputed
    assert {"fusednorm.norm_bwd.default", "fusednorm.gelu_ffn_bwd.default"} <= graphs["backward"], graphs
    (loss0, dx0, g0), (loss1, dx1, g1) = results
    assert torch.equal(loss0, loss1) and torch.equal(dx0, dx1)
    assert all(torch.equal(a, b) for a, b in zip(g0, g1))
