"""The autograd graph every op records: what reverse mode needs (saved tensors released
after backward, in-place changes to them detected, gradients only where asked). Forward
mode: tests/test_forward_ad.py."""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import fusednorm
from conftest import DEVICES, random_input


def _norm_calls():
    w, b = torch.randn(6) + 1, torch.randn(6)
    r = random_input((3, 6), torch.float32, "cpu", seed=9)
    w1, w2 = torch.randn(8, 6), torch.randn(6, 8)
    return {
        "layer_norm": lambda x: fusednorm.layer_norm(x, (6,), w, b),
        "rms_norm": lambda x: fusednorm.rms_norm(x, (6,), w),
        "add_layer_norm": lambda x: fusednorm.add_layer_norm(x, r, (6,), w, b)[0],
        "add_rms_norm": lambda x: fusednorm.add_rms_norm(x, r, (6,), w)[0],
        "gelu_ffn": lambda x: fusednorm.gelu_ffn(x, w1, None, w2, None),
        "layer_norm_gelu_ffn": lambda x: fusednorm.functional.layer_norm_gelu_ffn(
            x, w, b, 1e-5, w1, None, w2, None),
    }


@pytest.mark.parametrize("name", ["layer_norm", "add_layer_norm"])
def test_saved_tensors_are_released_after_backward(name):
    x = random_input((3, 6), torch.float32, "cpu").requires_grad_()
    y = _norm_calls()[name](x)
    y.sum().backward()
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        y.sum().backward()


def test_in_place_change_of_a_saved_input_is_detected():
    x = random_input((3, 6), torch.float32, "cpu").requires_grad_()
    h = x * 2
    y = fusednorm.layer_norm(h, (6,))
    h.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_gradients_only_for_what_requires_them():
    """A weight that requires grad while the input does not: the weight gets its exact
    gradient, the input none."""
    x = random_input((4, 6), torch.float64, "cpu")
    w = torch.randn(6, dtype=torch.float64, requires_grad=True)
    y = fusednorm.layer_norm(x, (6,), w)
    assert y.requires_grad and y.grad_fn is not None
    dy = random_input((4, 6), torch.float64, "cpu", seed=2)
    (gw,) = torch.autograd.grad(y, w, dy)
    w_ref = w.detach().clone().requires_grad_()
    (gw_ref,) = torch.autograd.grad(torch.nn.functional.layer_norm(x, (6,), w_ref), w_ref, dy)
    torch.testing.assert_close(gw, gw_ref)
    assert x.grad is None


def test_statistics_are_not_differentiable():
    x = random_input((4, 6), torch.float32, "cpu").requires_grad_()
    out, mean, rstd = fusednorm.FusedLayerNormFunction.apply(x, (6,), None, None, 1e-5)
    assert out.requires_grad
    assert not mean.requires_grad and not rstd.requires_grad


@pytest.mark.parametrize("name", ["add_layer_norm", "add_rms_norm"])
@pytest.mark.parametrize("dropout_p", [0.0, 0.25])
def test_add_ops_keep_only_the_sum_of_their_inputs(name, dropout_p):
    """What eager's add then norm keeps for the backward: the sum (with the parameters and
    statistics), not input or residual, which a training step would otherwise hold
    alive until its backward (a [tokens, d] tensor a layer)."""
    x = random_input((5, 6), torch.float32, "cpu").requires_grad_()
    r = random_input((5, 6), torch.float32, "cpu", seed=1).requires_grad_()
    w = torch.randn(6, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out, s = getattr(fusednorm, name)(x, r, (6,), w, dropout_p=dropout_p)
    kept = {t.data_ptr() for t in saved if t.numel()}
    assert s.data_ptr() in kept
    assert x.data_ptr() not in kept and r.data_ptr() not in kept
    # The create_graph backward (from the sum as saved) still gives exact second derivatives.
    (gx, gr) = torch.autograd.grad((out * out).sum(), (x, r), create_graph=True)
    assert gx.requires_grad and gr.requires_grad



@pytest.mark.parametrize("name", ["add_layer_norm", "add_rms_norm"])
@pytest.mark.parametrize("dropout_p", [0.0, 0.3])
@pytest.mark.parametrize("create_graph", [False, True])
def test_add_ops_with_only_the_sum_used(name, dropout_p, create_graph):
    """Where only the sum reaches the loss, as eager's `s = x + r; norm(s)` whose norm node
    never runs: input and residual get the sum's gradient (times the dropout and rowscale),
    weight and bias none (an optimizer with weight decay must skip them), and the sum may be
    changed in place after the op."""
    x = random_input((5, 6), torch.float32, "cpu").requires_grad_()
    r = random_input((5, 6), torch.float32, "cpu", seed=1).requires_grad_()
    w = (torch.randn(6) + 1).requires_grad_()
    b = torch.randn(6, requires_grad=True)
    rowscale = torch.rand(5) + 0.5
    kwargs = {"dropout_p": dropout_p, "rowscale": rowscale} if dropout_p else {}
    args = (w, b) if name == "add_layer_norm" else (w,)
    out, s = getattr(fusednorm, name)(x, r, (6,), *args, **kwargs)
    ds = random_input((5, 6), torch.float32, "cpu", seed=2)
    # The full backward with a zero gradient for out: the sum's part alone.
    expected = torch.autograd.grad((out, s), (x, r), (torch.zeros_like(out), 2 * ds),
                                   retain_graph=True)
    s.mul_(2)  # not needed by the sum's own gradient
    grads = torch.autograd.grad(s, (x, r, *args), ds, allow_unused=True,
                                create_graph=create_graph)
    torch.testing.assert_close(grads[0], expected[0])
    torch.testing.assert_close(grads[1], expected[1])
    if dropout_p:
        assert (grads[0] == 0).any() and (grads[0] != 2 * ds).any()  # mask and rowscale in
    assert all(g is None for g in grads[2:])
    with pytest.raises(RuntimeError, match="not have been used in the graph"):
        _, s = getattr(fusednorm, name)(x, r, (6,), *args)
        torch.autograd.grad(s.sum(), w)


@pytest.mark.parametrize("name", ["add_layer_norm", "add_rms_norm"])
def test_add_ops_sum_needs_no_grad_through_the_parameters(name):
    """With only the parameters requiring grad, the sum does not require grad (it does not
    depend on them), as `x + r` would not; the output does, with exact gradients."""
    x = random_input((5, 6), torch.float32, "cpu")
    r = random_input((5, 6), torch.float32, "cpu", seed=1)
    w = (torch.randn(6) + 1).requires_grad_()
    out, s = getattr(fusednorm, name)(x, r, (6,), w)
    assert out.requires_grad and not s.requires_grad
    dy = random_input((5, 6), torch.float32, "cpu", seed=2)
    (gw,) = torch.autograd.grad(out, w, dy)
    w_ref = w.detach().requires_grad_()
    norm = (torch.nn.functional.layer_norm if name == "add_layer_norm"
            else torch.nn.functional.rms_norm)
    (gw_ref,) = torch.autograd.grad(norm(x + r, (6,), w_ref), w_ref, dy)
    torch.testing.assert_close(gw, gw_ref)


@pytest.mark.skipif(not hasattr(torch.autograd.graph, "node_creation_hook"),
                    reason="torch.autograd.graph.node_creation_hook is new in PyTorch 2.14")
@pytest.mark.parametrize("name", list(_norm_calls()))
def test_node_creation_hooks_see_every_op(name):
    """torch.autograd.graph.node_creation_hook sees each op's node, as it sees PyTorch's."""
    x = random_input((3, 6), torch.float32, "cpu").requires_grad_()
    seen = []
    with torch.autograd.graph.node_creation_hook(lambda node: seen.append(node)):
        y = _norm_calls()[name](x)
    assert y.grad_fn in seen
    assert sum(1 for n in seen if n.name().startswith("fusednorm")) == 1


class _NormBwdCalls(TorchDispatchMode):
    """Records each norm_bwd call's param_grads and the numels of the grad_weight and
    grad_bias it returned."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.fusednorm.norm_bwd.default:
            wanted = args[12] if len(args) > 12 else (kwargs or {}).get("param_grads", [True] * 2)
            self.calls.append((list(wanted), out[1].numel(), out[2].numel()))
        return out


def _with_parameters(name, device, trainable):
    """name's op over a (5, 7) input x with its norm parameters (weight, and bias where it
    has one) requiring grad as `trainable` says: (fn(x), the parameters)."""
    w = (random_input((7,), torch.float32, device, seed=3)).requires_grad_("weight" in trainable)
    b = random_input((7,), torch.float32, device, seed=4).requires_grad_("bias" in trainable)
    r = random_input((5, 7), torch.float32, device, seed=5)
    w1 = random_input((9, 7), torch.float32, device, seed=6).requires_grad_()
    w2 = random_input((7, 9), torch.float32, device, seed=7).requires_grad_()
    calls = {
        "layer_norm": (lambda x: fusednorm.layer_norm(x, (7,), w, b), (w, b)),
        "rms_norm": (lambda x: fusednorm.rms_norm(x, (7,), w), (w,)),
        "add_layer_norm": (lambda x: fusednorm.add_layer_norm(x, r, (7,), w, b)[0], (w, b)),
        "add_rms_norm": (lambda x: fusednorm.add_rms_norm(x, r, (7,), w)[0], (w,)),
        "layer_norm_gelu_ffn": (lambda x: fusednorm.functional.layer_norm_gelu_ffn(
            x, w, b, 1e-5, w1, None, w2, None), (w, b)),
    }
    return calls[name]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("trainable", [(), ("bias",), ("weight",), ("weight", "bias")])
@pytest.mark.parametrize("name", ["layer_norm", "rms_norm", "add_layer_norm", "add_rms_norm",
                                  "layer_norm_gelu_ffn"])
def test_frozen_parameters_get_no_column_sums(name, trainable, device):
    """A frozen norm weight or bias (LoRA, BitFit fine-tuning) gets no gradient, and the
    backward's kernel is asked for none (param_grads), so its column sums are not formed;
    every other gradient is bitwise the one of a run where all parameters train."""
    x = random_input((5, 7), torch.float32, device).requires_grad_()
    dy = random_input((5, 7), torch.float32, device, seed=2)
    fn, params = _with_parameters(name, device, trainable)
    record = _NormBwdCalls()
    with record:
        fn(x).backward(dy)
    wanted = [p.requires_grad for p in params] + [False] * (2 - len(params))
    formed = [p.numel() if w else 0 for p, w in zip(params, wanted)] + [0] * (2 - len(params))
    assert record.calls == [(wanted, *formed)]
    full_fn, full_params = _with_parameters(name, device, ("weight", "bias"))
    x_full = x.detach().clone().requires_grad_()
    full_fn(x_full).backward(dy)
    assert torch.equal(x.grad, x_full.grad)
    for p, full in zip(params, full_params):
        if p.requires_grad:
            assert torch.equal(p.grad, full.grad)
        else:
            assert p.grad is None


@pytest.mark.parametrize("name", ["layer_norm", "add_rms_norm", "layer_norm_gelu_ffn"])
def test_grad_of_the_input_alone_forms_no_parameter_gradients(name):
    """torch.autograd.grad(out, x) with trainable parameters: only x's gradient is asked
    for, so the kernel forms no column sums."""
    x = random_input((5, 7), torch.float32, "cpu").requires_grad_()
    dy = random_input((5, 7), torch.float32, "cpu", seed=2)
    fn, params = _with_parameters(name, "cpu", ("weight", "bias"))
    record = _NormBwdCalls()
    with record:
        (gx,) = torch.autograd.grad(fn(x), x, dy)
    assert record.calls == [([False, False], 0, 0)]
    x_full = x.detach().clone().requires_grad_()
    fn(x_full).backward(dy)
    # (the block's FFN then takes its frozen path: dx from other GEMMs, rounded apart)
    torch.testing.assert_close(gx, x_full.grad)
    assert all(p.grad is not None for p in params)


def _frozen_rows_call(name, fused):
    """(out, sum) of a norm op, fusednorm's or PyTorch's own (the add ops: s = x + r, then
    F.layer_norm / F.rms_norm of s); sum None for the plain ops."""
    F = torch.nn.functional
    norm = {"layer_norm": (fusednorm.layer_norm, F.layer_norm),
            "rms_norm": (fusednorm.rms_norm, F.rms_norm)}[name.removeprefix("add_")]
    fn = norm[0] if fused else norm[1]
    params = (lambda w, b: (w, b)) if name.endswith("layer_norm") else (lambda w, b: (w,))

    def call(x, r, w, b):
        if not name.startswith("add_"):
            return fn(x, (6,), *params(w, b)), None
        if fused:
            add = fusednorm.add_layer_norm if name == "add_layer_norm" else fusednorm.add_rms_norm
            return add(x, r, (6,), *params(w, b))
        s = x + r
        return fn(s, (6,), *params(w, b)), s
    return call


def _frozen_rows_outcome(call, case):
    """The weight's gradient, or the RuntimeError raised, when rows that need no gradient
    meet a weight that does: made in inference mode, or changed in place (the input, the
    add ops' sum, or the weight) between the call and the backward."""
    x = random_input((4, 6), torch.float32, "cpu")
    r = random_input((4, 6), torch.float32, "cpu", seed=3)
    if case == "inference_input":
        with torch.inference_mode():
            x, r = x.clone(), r.clone()
    w = random_input((6,), torch.float32, "cpu", seed=4).requires_grad_()
    b = random_input((6,), torch.float32, "cpu", seed=5).requires_grad_()
    dy = random_input((4, 6), torch.float32, "cpu", seed=6)
    try:
        y, s = call(x, r, w, b)
        if case == "input_changed_in_place":
            x.add_(1)
        elif case == "sum_changed_in_place":
            s.add_(1)
        elif case == "weight_changed_in_place":
            with torch.no_grad():
                w.mul_(2)
        return torch.autograd.grad(y, w, dy)[0]
    except RuntimeError as error:
        return error


@pytest.mark.parametrize("name, case", [
    (name, case) for name in ("rms_norm", "layer_norm", "add_rms_norm", "add_layer_norm")
    for case in ("inference_input", "input_changed_in_place", "sum_changed_in_place",
                 "weight_changed_in_place")
    if name.startswith("add_") or case != "sum_changed_in_place"])
def test_frozen_rows_refused_exactly_where_torch_refuses(name, case):
    """A trainable weight over rows that need no gradient (frozen features into a trained
    norm): F.rms_norm's graph then keeps only a tensor computed from the rows, so PyTorch
    takes an inference-mode input, and an input (or sum) or weight changed in place before
    the backward, where F.layer_norm, which keeps its input and weight, refuses them.
    fusednorm refuses exactly where PyTorch does, and elsewhere gives its weight gradient
    (of the rows as they were at the call)."""
    expected = _frozen_rows_outcome(_frozen_rows_call(name, fused=False), case)
    got = _frozen_rows_outcome(_frozen_rows_call(name, fused=True), case)
    if isinstance(expected, RuntimeError):
        assert isinstance(got, RuntimeError), f"PyTorch raised {expected!r}; fusednorm did not"
    else:
        assert not isinstance(got, Exception), f"PyTorch did not raise; fusednorm: {got!r}"
        torch.testing.assert_close(got, expected)
