"""Every bad input of docs/DESIGN.md's Errors section raises a Python exception naming the
argument, which is a RuntimeError too (what PyTorch raises for the same bad call); the
compiled ops defend themselves too."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fusednorm

ops = torch.ops.fusednorm


def ln(x, shape=(8,), weight=None, bias=None, eps=1e-5):
    return fusednorm.layer_norm(x, shape, weight, bias, eps)


def rms(x, shape=(8,), weight=None, eps=None):
    return fusednorm.rms_norm(x, shape, weight, eps)


def add_ln(x, residual, shape=(8,), weight=None, bias=None):
    return fusednorm.add_layer_norm(x, residual, shape, weight, bias)


def add_rms(x, residual, shape=(8,), weight=None):
    return fusednorm.add_rms_norm(x, residual, shape, weight)


def ffn(x, w1, b1, w2, b2, approximate="none"):
    return fusednorm.gelu_ffn(x, w1, b1, w2, b2, approximate)


def block(x, w1, w2, ln_weight=None, ln_bias=None, eps=1e-5):
    return fusednorm.functional.layer_norm_gelu_ffn(x, ln_weight, ln_bias, eps, w1, None, w2,
                                                    None, "none")


X = torch.randn(4, 8)
W1, W2 = torch.randn(16, 8), torch.randn(8, 16)
META = torch.ones(8, device="meta")

# (fusednorm's call, PyTorch's call of the same mistake or None, error, pattern). Every error
# is also a RuntimeError, and an instance of what PyTorch raises (all RuntimeError but for
# arguments of the wrong Python type: TypeError), so `except RuntimeError` around a drop-in
# keeps working.
CASES = [
    (lambda: ln(X, (7,)), lambda: F.layer_norm(X, (7,)), ValueError, "normalized_shape"),
    (lambda: ln(X, (4, 8, 1)), lambda: F.layer_norm(X, (4, 8, 1)), ValueError, "normalized_shape"),
    (lambda: ln(X, ()), lambda: F.layer_norm(X, ()), ValueError, "normalized_shape"),
    (lambda: ln(X, "8"), lambda: F.layer_norm(X, "8"), TypeError, "normalized_shape"),
    (lambda: ln(X, (8,), torch.ones(7)), lambda: F.layer_norm(X, (8,), torch.ones(7)), ValueError, "weight"),
    (lambda: ln(X, (8,), None, torch.ones(4, 2)), lambda: F.layer_norm(X, (8,), None, torch.ones(4, 2)),
     ValueError, "bias"),
    (lambda: ln(X, (8,), torch.ones(8, dtype=torch.float16)),
     lambda: F.layer_norm(X, (8,), torch.ones(8, dtype=torch.float16)), TypeError, "weight"),
    (lambda: ln(X.double(), (8,), torch.ones(8)), lambda: F.layer_norm(X.double(), (8,), torch.ones(8)),
     TypeError, "weight"),
    (lambda: ln(X.half(), (8,), torch.ones(8), torch.ones(8, dtype=torch.half)),
     lambda: F.layer_norm(X.half(), (8,), torch.ones(8), torch.ones(8, dtype=torch.half)),
     TypeError, "weight and bias"),
    (lambda: ln(X, (8,), [1.0] * 8), lambda: F.layer_norm(X, (8,), [1.0] * 8), TypeError, "weight"),
    (lambda: ln(X.to(torch.int32)), lambda: F.layer_norm(X.to(torch.int32), (8,)), TypeError, "input"),
    (lambda: ln(X.to(torch.complex64)), lambda: F.layer_norm(X.to(torch.complex64), (8,)), TypeError, "input"),
    (lambda: ln(X.bool()), lambda: F.layer_norm(X.bool(), (8,)), TypeError, "input"),
    (lambda: ln(X.tolist()), lambda: F.layer_norm(X.tolist(), (8,)), TypeError, "input"),
    (lambda: ln(X, eps=-1e-5), None, ValueError, "eps"),  # PyTorch takes it
    (lambda: ln(X, eps=float("nan")), None, ValueError, "eps"),
    (lambda: ln(X, (8,), META), lambda: F.layer_norm(X, (8,), META), ValueError, "weight is on meta"),
    (lambda: fusednorm.FusedLayerNorm(16)(X), lambda: nn.LayerNorm(16)(X), ValueError,
     r"normalized_shape=\[16\]"),
    (lambda: fusednorm.FusedLayerNormFunction.apply(X, (7,), None, None, 1e-5),
     lambda: F.layer_norm(X, (7,)), ValueError, "normalized_shape"),
    (lambda: rms(X, (7,)), lambda: F.rms_norm(X, (7,)), ValueError, "normalized_shape"),
    (lambda: rms(X, (8,), torch.ones(7)), lambda: F.rms_norm(X, (8,), torch.ones(7)), ValueError, "weight"),
    (lambda: rms(X.to(torch.int64)), lambda: F.rms_norm(X.to(torch.int64), (8,)), TypeError, "input"),
    (lambda: rms(X, (8,), torch.ones(8, dtype=torch.int32)), None, TypeError, "weight"),  # PyTorch promotes
    (lambda: fusednorm.FusedRMSNorm(16)(X), lambda: nn.RMSNorm(16)(X), ValueError, "normalized_shape"),
    (lambda: add_ln(X, torch.randn(4, 7)), lambda: X + torch.randn(4, 7), ValueError, "residual"),
    (lambda: add_ln(X, X.double()), None, TypeError, "residual"),
    (lambda: add_ln(X, X.to("meta")), None, ValueError, "residual is on meta"),
    (lambda: add_ln(X, X, (8,), torch.ones(5)), None, ValueError, "weight"),
    (lambda: add_rms(X, [1.0]), None, TypeError, "residual"),
    (lambda: add_rms(X, X, (7,)), None, ValueError, "normalized_shape"),
    # residual_dtype: None or torch.float32; a float32 residual beside 16-bit input needs it.
    (lambda: fusednorm.add_rms_norm(X, X, (8,), residual_dtype=torch.float16), None, TypeError,
     "residual_dtype must be None or torch.float32"),
    (lambda: fusednorm.add_layer_norm(X, X, (8,), residual_dtype="float32"), None, TypeError,
     "residual_dtype must be None or torch.float32"),
    (lambda: add_ln(X.bfloat16(), X), None, TypeError, "residual_dtype=torch.float32 takes"),
    (lambda: fusednorm.add_rms_norm(X.bfloat16(), X.half(), (8,), residual_dtype=torch.float32),
     None, TypeError, "residual must have the input's dtype"),
    (lambda: ffn(X, torch.randn(16, 7), None, W2, None), lambda: F.linear(X, torch.randn(16, 7)),
     ValueError, "weight1"),
    (lambda: ffn(X, W1, None, torch.randn(8, 15), None), None, ValueError, "weight2"),
    (lambda: ffn(X, W1, torch.randn(15), W2, None), lambda: F.linear(X, W1, torch.randn(15)),
     ValueError, "bias1"),
    (lambda: ffn(X, W1, None, W2, None, "fast"), lambda: F.gelu(X, approximate="fast"),
     ValueError, "approximate"),
    (lambda: ffn(X, W1.double(), None, W2, None), lambda: F.linear(X, W1.double()), TypeError, "weight1"),
    (lambda: ffn(X, None, None, W2, None), None, TypeError, "weight1 and weight2"),
    (lambda: ffn(X.to(torch.int32), W1, None, W2, None), None, TypeError, "input"),
    (lambda: fusednorm.GeluFFNFunction.apply(X, torch.randn(16, 7), None, W2, None, "none"),
     lambda: F.linear(X, torch.randn(16, 7)), ValueError, "weight1"),
    (lambda: fusednorm.FusedGeluFFN(8, approximate="fast"), None, ValueError, "approximate"),
    (lambda: block(X, W1, torch.randn(7, 16)), None, ValueError, "weight2"),
    (lambda: block(X, W1, W2, torch.ones(7)), None, ValueError,
     "fusednorm.layer_norm_gelu_ffn: ln_weight"),
    (lambda: block(X, W1, W2, torch.ones(8), torch.ones(8, dtype=torch.float64)), None,
     TypeError, "ln_weight and ln_bias"),
    (lambda: ln(X, eps=None), lambda: F.layer_norm(X, (8,), eps=None), TypeError, "eps"),
    (lambda: fusednorm.add_layer_norm(X, X, (8,), eps=None), None, TypeError, "eps"),
    (lambda: fusednorm.add_rms_norm(X, X, (8,), rowscale=torch.ones(4, requires_grad=True)),
     None, ValueError, "rowscale is not differentiable"),
    (lambda: block(X, W1, W2, eps=-1.0), None, ValueError, "eps"),
    (lambda: fusednorm.LayerNormGeluFFNFunction.apply(X, None, None, 1e-5, W1, None,
                                                      torch.randn(7, 16), None, "none"),
     None, ValueError, "weight2"),
    # zero_centered_weight: a bool; with it, weight and bias of any float dtype, but float.
    (lambda: fusednorm.layer_norm(X, (8,), zero_centered_weight=1), None, TypeError,
     "zero_centered_weight must be a bool"),
    (lambda: fusednorm.add_rms_norm(X, X, (8,), zero_centered_weight=None), None, TypeError,
     "zero_centered_weight must be a bool"),
    (lambda: fusednorm.rms_norm(X, (8,), torch.ones(8, dtype=torch.int32),
                                zero_centered_weight=True), None, TypeError, "weight"),
    (lambda: fusednorm.add_layer_norm(X, X, (8,), torch.ones(7), zero_centered_weight=True),
     None, ValueError, "weight"),
    (lambda: fusednorm.FusedRMSNorm(8, zero_centered_weight="yes"), None, TypeError,
     "zero_centered_weight must be a bool"),
    # Sparse and MKLDNN tensors: the kernels index strided memory.
    (lambda: ln(X.to_sparse()), lambda: F.layer_norm(X.to_sparse(), (8,)), TypeError,
     r"input must be a dense tensor \(torch.strided\), got torch.sparse_coo"),
    (lambda: ln(X.to_sparse_csr()), lambda: F.layer_norm(X.to_sparse_csr(), (8,)), TypeError,
     "input must be a dense tensor .*torch.sparse_csr"),
    (lambda: fusednorm.FusedLayerNorm(8)(X.to_mkldnn()), lambda: nn.LayerNorm(8)(X.to_mkldnn()),
     TypeError, "input must be a dense tensor .*torch._mkldnn"),
    (lambda: rms(X, (8,), torch.ones(8).to_sparse()),
     lambda: F.rms_norm(X, (8,), torch.ones(8).to_sparse()), TypeError, "weight must be a dense"),
    (lambda: ln(X, (8,), None, torch.ones(8).to_sparse()), None, TypeError, "bias must be a dense"),
    (lambda: fusednorm.layer_norm(X, (8,), torch.ones(8).to_sparse(), zero_centered_weight=True),
     None, TypeError, "weight must be a dense"),
    (lambda: add_ln(X, X.to_sparse()), None, TypeError,  # torch adds it: ours refuses
     "residual must be a dense"),
    (lambda: fusednorm.add_rms_norm(X, X, (8,), dropout_p=0.1, rowscale=torch.ones(4).to_sparse()),
     None, TypeError, "rowscale must be a dense"),
    (lambda: ffn(X.to_sparse(), W1, None, W2, None), None, TypeError, "input must be a dense"),
    (lambda: ffn(X, W1, None, W2.to_sparse(), None), None, TypeError, "weight2 must be a dense"),
    (lambda: block(X, W1, W2, torch.ones(8).to_sparse()), None, TypeError,
     "ln_weight must be a dense"),
    (lambda: fusednorm.replace_layernorm([nn.LayerNorm(8)]), None, TypeError, "model"),
    (lambda: fusednorm.norm_report(None), None, TypeError, "model"),
]


@pytest.mark.parametrize("call, torch_call, error, pattern", CASES)
def test_errors_name_the_argument_and_are_runtime_errors(call, torch_call, error, pattern):
    with pytest.raises(error, match=pattern) as raised:
        call()
    assert isinstance(raised.value, RuntimeError), type(raised.value).__mro__
    if torch_call is not None:  # what PyTorch's code catches, ours must match
        with pytest.raises(Exception) as theirs:
            torch_call()
        expected = RuntimeError if isinstance(theirs.value, RuntimeError) else type(theirs.value)
        assert isinstance(raised.value, expected), (theirs.value, raised.value)


def test_errors_are_caught_by_except_runtime_error():
    """The drop-in's promise in one line: code written around nn.LayerNorm keeps catching."""
    for module in (nn.LayerNorm(16), fusednorm.FusedLayerNorm(16)):
        try:
            module(X)
        except RuntimeError as error:
            assert "normalized_shape" in str(error)
        else:
            raise AssertionError("no error")


@pytest.mark.parametrize("case", range(len(CASES)))
def test_errors_keep_their_kind_under_a_dispatch_mode(case):
    """Under a TorchDispatchMode (FlopCounterMode, DebugMode, selective checkpointing) the
    op's check error comes back through Python: still fusednorm's, a RuntimeError too."""
    from torch.utils.flop_counter import FlopCounterMode

    call, _, error, pattern = CASES[case]
    with FlopCounterMode(display=False):
        with pytest.raises(error, match=pattern) as raised:
            call()
    assert isinstance(raised.value, RuntimeError), type(raised.value).__mro__


@pytest.mark.parametrize(
    "call, pattern",
    [
        (lambda: ops.norm_fwd(torch.randn(2, 3, 4), None, None, None, 1e-5, True), "input must be 2-D"),
        (lambda: ops.norm_fwd(torch.randn(4, 6)[:, ::2], None, None, None, 1e-5, True), "contiguous"),
        (lambda: ops.norm_fwd(torch.randn(4, 6), None, torch.ones(5), None, 1e-5, True), "weight"),
        (lambda: ops.norm_fwd(torch.randn(4, 6), None, None, None, -1.0, True), "eps"),
        (lambda: ops.norm_fwd(torch.ones(4, 6, dtype=torch.int64), None, None, None, 1e-5, True), "input"),
        (
            lambda: ops.norm_bwd(torch.randn(4, 5), None, torch.randn(4, 6), torch.zeros(4), torch.ones(4), None, None, True),
            "grad_out",
        ),
        (
            lambda: ops.norm_bwd(torch.randn(4, 6), None, torch.randn(4, 6), torch.zeros(3), torch.ones(4), None, None, True),
            "mean",
        ),
        (
            lambda: ops.norm_bwd(
                torch.randn(4, 6), None, torch.randn(4, 6), torch.zeros(4),
                torch.ones(4, dtype=torch.float64), None, None, True,
            ),
            "rstd",
        ),
    ],
)
def test_op_errors(call, pattern):
    with pytest.raises(RuntimeError, match=pattern):
        call()



def test_compiled_call_rejects_while_tracing():
    """Under torch.compile the op's fake kernel runs the same checks: the trace stops with a
    RuntimeError carrying fusednorm's message (as PyTorch's own ops do), not a plain
    ValueError from the compiled graph's first run."""
    torch._dynamo.reset()
    compiled = torch.compile(lambda x, w: fusednorm.layer_norm(x, (8,), w), fullgraph=True)
    with pytest.raises(RuntimeError, match="weight must have shape normalized_shape"):
        compiled(X, torch.ones(7))


def test_public_ops_check_layouts():
    """A direct torch.ops call raises C++'s TypeError, naming the argument."""
    with pytest.raises(TypeError, match="input must be a dense tensor"):
        ops.layer_norm(X.to_sparse(), [8], None, None, 1e-5, False)
    with pytest.raises(TypeError, match="weight2 must be a dense tensor"):
        ops.gelu_ffn(X, W1, None, W2.to_sparse(), None, "none")


def test_layouts_refused_without_kernels(monkeypatch):
    """Where no compiled kernel serves the call (the plain-PyTorch fallback), a sparse
    argument gets the same error, from the Python checks."""
    import types

    from fusednorm import _loader, functional
    from fusednorm import ops as fused_ops

    def no_kernel(*args):
        raise NotImplementedError("Could not run 'fusednorm::layer_norm' with arguments from "
                                  "the 'CPU' backend")

    names = ("layer_norm", "rms_norm", "add_layer_norm", "gelu_ffn")
    for name in names:
        monkeypatch.setattr(fused_ops, name.upper(), no_kernel)
    monkeypatch.setattr(fused_ops, "FAST", types.SimpleNamespace(
        **{name: (lambda *a: NotImplemented) for name in names}))
    monkeypatch.setattr(_loader, "KERNELS", frozenset())
    monkeypatch.setattr(functional, "_warned_fallback", set())
    sparse = X.to_sparse()
    for call, pattern in [
        (lambda: ln(sparse), "fusednorm.layer_norm: input must be a dense"),
        (lambda: rms(X, (8,), torch.ones(8).to_sparse()), "fusednorm.rms_norm: weight must be a dense"),
        (lambda: add_ln(X, sparse), "fusednorm.add_layer_norm: residual must be a dense"),
        (lambda: ffn(X, W1.to_sparse(), None, W2, None), "fusednorm.gelu_ffn: weight1 must be a dense"),
    ]:
        with pytest.raises(TypeError, match=pattern) as raised:
            call()
        assert isinstance(raised.value, RuntimeError)
