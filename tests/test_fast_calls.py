"""fusednorm._fast, the direct entries that fusednorm.functional calls before torch.ops:
the same outputs, gradients, graphs and errors as the torch.ops path, and NotImplemented
(so that torch.ops decides) for whatever it does not take as is: tensor subclasses,
TorchFunctionModes, arguments of other Python types, errors."""
from __future__ import annotations

import os
import warnings

import pytest
import torch
from torch.overrides import TorchFunctionMode

import fusednorm
from fusednorm import functional, ops
from conftest import DEVICES, random_input

FAST_DISABLED = os.environ.get("FUSEDNORM_FAST_CALLS", "1") == "0"


def test_fast_calls_are_loaded_with_the_library():
    info = fusednorm.build_info()
    if not info["compiled"] or FAST_DISABLED:
        pytest.skip(f"not expected here: {info['fast_calls_error']}")
    assert info["fast_calls"], info["fast_calls_error"]


needs_fast = pytest.mark.skipif(ops.FAST is None, reason="fusednorm._fast not loaded")


def _args(device, dtype=torch.float32):
    """Arguments of every public op, on random data with an odd row length."""
    d, h = 37, 52
    g = lambda shape, seed, scale=1.0: random_input(shape, dtype, device, scale=scale, seed=seed)  # noqa: E731
    return {
        "x": g((3, 5, d), 1), "r": g((3, 5, d), 2), "w": g((d,), 3), "b": g((d,), 4),
        "w1": g((h, d), 5, 0.2), "b1": g((h,), 6), "w2": g((d, h), 7, 0.2), "b2": g((d,), 8),
        "rowscale": g((3, 5), 9),
    }


# name -> (entry's positional arguments, torch.ops call with the same arguments, how many
# of the op's outputs the function returns)
def _calls(a):
    x, r, w, b, w1, b1, w2, b2 = (a[k] for k in ("x", "r", "w", "b", "w1", "b1", "w2", "b2"))
    return {
        "layer_norm": ((x, (37,), w, b, 1e-5, False), ops.LAYER_NORM, 1),
        "rms_norm": ((x, [37], w, None, True), ops.RMS_NORM, 1),
        "add_layer_norm": ((x, r, torch.Size([37]), w, b, 1e-5, True, None, 0.0, None),
                           ops.ADD_LAYER_NORM, 2),
        "add_rms_norm": ((x, r, (37,), None, 1e-6, False, torch.float32, 0.0, a["rowscale"]),
                         ops.ADD_RMS_NORM, 2),
        "gelu_ffn": ((x, w1, b1, w2, b2, "tanh"), ops.GELU_FFN, 1),
        "layer_norm_gelu_ffn": ((x, w, b, 1e-5, w1, None, w2, b2, "none"),
                                ops.LAYER_NORM_GELU_FFN, 1),
    }


def _leaves(args):
    return [t for t in args if isinstance(t, torch.Tensor)]


@needs_fast
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(_calls(_args("cpu"))))
def test_entry_matches_torch_ops_path_bitwise(name, device):
    """Same kernels either way: outputs and every gradient equal bit for bit, and the
    output's graph is the op's own backward node."""
    results = []
    for path in ("fast", "torch.ops"):
        # rowscale is not differentiable: a rowscale requiring grad is refused.
        a = {k: t if k == "rowscale" else t.requires_grad_() for k, t in _args(device).items()}
        args, op, n_out = _calls(a)[name]
        outs = getattr(ops.FAST, name)(*args) if path == "fast" else op(*args)[:n_out]
        outs = outs if isinstance(outs, tuple) else (outs,)
        assert len(outs) == n_out
        assert outs[0].grad_fn is not None and "fusednorm" in outs[0].grad_fn.name()
        grads_out = [random_input(o.shape, o.dtype, device, seed=20 + i) for i, o in enumerate(outs)]
        leaves = [t for t in _leaves(args) if t.requires_grad]
        grads = torch.autograd.grad(outs, leaves, grads_out, allow_unused=True)
        results.append((outs, grads))
    (fast_outs, fast_grads), (ops_outs, ops_grads) = results
    for f, o in zip(fast_outs, ops_outs):
        assert torch.equal(f, o)
    for f, o in zip(fast_grads, ops_grads):
        assert (f is None) == (o is None)
        if f is not None:
            assert torch.equal(f, o)


@needs_fast
def test_entry_without_grad_records_no_graph():
    a = _args("cpu")
    args, _, _ = _calls(a)["layer_norm"]
    assert ops.FAST.layer_norm(*args).grad_fn is None


class _Tagged(torch.Tensor):
    """A subclass whose __torch_function__ sees every call made with it."""
    seen: list = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        cls.seen.append(func)
        return super().__torch_function__(func, types, args, kwargs or {})


class _Recording(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.seen.append(func)
        return func(*args, **(kwargs or {}))


@needs_fast
@pytest.mark.parametrize("name", list(_calls(_args("cpu"))))
def test_entry_declines_subclasses_and_modes(name):
    a = _args("cpu")
    args, op, _ = _calls(a)[name]
    entry = getattr(ops.FAST, name)
    tagged = (args[0].as_subclass(_Tagged),) + args[1:]
    assert entry(*tagged) is NotImplemented
    with _Recording():
        assert entry(*args) is NotImplemented


@needs_fast
@pytest.mark.parametrize("name", list(_calls(_args("cpu"))))
def test_entry_declines_under_the_jit_tracer(name):
    """While torch.jit.trace runs (also the TorchScript-based ONNX exporter), the functions
    decide on the torch.ops path: fused op or, in an ONNX export, its ATen form."""
    args, _, _ = _calls(_args("cpu"))[name]
    entry = getattr(ops.FAST, name)
    answers = []

    def traced(x):
        answers.append(entry(x, *args[1:]))
        return x + 1

    torch.jit.trace(traced, (args[0],), check_trace=False)
    assert answers == [NotImplemented]
    assert entry(*args) is not NotImplemented


@needs_fast
def test_functions_keep_torch_function_semantics():
    """Through the functions, a subclass's __torch_function__ and an active mode still see
    the fusednorm op, as they did before the direct entries existed."""
    x = random_input((4, 37), torch.float32, "cpu")
    _Tagged.seen = []
    out = fusednorm.layer_norm(x.as_subclass(_Tagged), (37,))
    assert ops.LAYER_NORM in _Tagged.seen and isinstance(out, _Tagged)
    with _Recording() as mode:
        fusednorm.gelu_ffn(x, torch.randn(8, 37), None, torch.randn(37, 8), None)
    assert ops.GELU_FFN in mode.seen


@needs_fast
@pytest.mark.parametrize("bad", [
    {"shape": (torch.tensor(37),)}, {"shape": (True,)}, {"shape": 37}, {"shape": ((37,),)},
    {"shape": (2 ** 70,)}, {"eps": torch.tensor(1e-5)}, {"eps": None}, {"eps": True},
    {"weight": "w"}, {"weight": 1.0}, {"input": [[1.0]]}, {"input": None},
    {"zero_centered": 1}, {"zero_centered": None},
])
def test_entry_declines_other_argument_types(bad):
    x, w, b = torch.randn(2, 37), torch.randn(37), torch.randn(37)
    args = {"input": x, "shape": (37,), "weight": w, "bias": b, "eps": 1e-5,
            "zero_centered": False}
    args.update(bad)
    assert ops.FAST.layer_norm(*args.values()) is NotImplemented


@needs_fast
def test_entry_takes_int_eps_and_parameters():
    x = random_input((2, 37), torch.float32, "cpu")
    w = torch.nn.Parameter(torch.randn(37))
    out = ops.FAST.layer_norm(x, [37], w, None, 0, False)
    assert out is not NotImplemented
    assert torch.equal(out, ops.LAYER_NORM(x, [37], w, None, 0.0)[0])


@needs_fast
@pytest.mark.parametrize("call", [
    lambda x: ops.FAST.layer_norm(x, (36,), None, None, 1e-5, False),  # shape mismatch
    lambda x: ops.FAST.layer_norm(x, (37,), torch.randn(36), None, 1e-5, True),
    lambda x: ops.FAST.layer_norm(x.to(torch.int32), (37,), None, None, 1e-5, False),
    lambda x: ops.FAST.rms_norm(x, (37,), None, -1.0, False),
    lambda x: ops.FAST.add_layer_norm(x, x[:1], (37,), None, None, 1e-5, False, None, 0.0, None),
    lambda x: ops.FAST.gelu_ffn(x, torch.randn(8, 37), None, torch.randn(37, 8), None, "erf"),
])
def test_entry_declines_on_errors(call):
    """An op error becomes NotImplemented: the torch.ops path raises it with fusednorm's
    explanation (test_errors.py checks those messages through the functions)."""
    assert call(random_input((2, 37), torch.float32, "cpu")) is NotImplemented


@needs_fast
def test_entry_refuses_wrong_argument_counts():
    with pytest.raises(TypeError, match="takes 6 arguments"):
        ops.FAST.layer_norm(torch.randn(2, 3), (3,))


@needs_fast
def test_function_errors_are_explained_as_before():
    x = random_input((2, 37), torch.float32, "cpu")
    with pytest.raises(ValueError, match="normalized_shape"):
        functional.layer_norm(x, (36,))
    with pytest.raises(ValueError, match="residual"):
        functional.add_rms_norm(x, x[:1], (37,))


@needs_fast
def test_compiled_function_traces_the_op():
    """Under torch.compile the functions call torch.ops (the direct entry is skipped), so
    fullgraph compiles and the graph holds the fusednorm op."""
    x = random_input((4, 37), torch.float32, "cpu")
    w, b = torch.randn(37), torch.randn(37)
    compiled = torch.compile(lambda t: fusednorm.layer_norm(t, (37,), w, b), fullgraph=True,
                             backend="eager")
    assert torch.equal(compiled(x), fusednorm.layer_norm(x, (37,), w, b))


@needs_fast
@pytest.mark.parametrize("name", list(_calls(_args("cpu"))))
def test_functions_take_the_direct_entry(name, monkeypatch):
    """With the torch.ops handle gone, a plain call still runs the fused op (a fallback to
    the reference would warn): the function took its direct entry."""
    a = _args("cpu")
    args, op, n_out = _calls(a)[name]
    expected = op(*args)[:n_out]
    monkeypatch.setattr(ops, op.__name__.split(".")[0].upper(), None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        # The norm functions take zero_centered_weight (and the add ops residual_dtype,
        # dropout_p and rowscale) by keyword only.
        keywords = {}
        if name.startswith("add_"):
            keywords.update(zip(("residual_dtype", "dropout_p", "rowscale"), args[-3:]))
            args = args[:-3]
        if isinstance(args[-1], bool):
            args, keywords["zero_centered_weight"] = args[:-1], args[-1]
        got = getattr(functional, name)(*args, **keywords)
    got = got if isinstance(got, tuple) else (got,)
    for g, e in zip(got, expected):
        assert torch.equal(g, e)
