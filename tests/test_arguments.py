"""Every constructor and call argument of every public module and function, with a value
that changes the result: eps large against the input's scale (and None where allowed, on
inputs whose mean square is near the default), no weight and/or no bias, approximate,
dtype and device. Each result is compared with PyTorch's own module or function given the
same arguments (float64 and float32, tight tolerances), so that an argument that is not
passed on, or is replaced by a default, fails here. The parameters are random, never the
default ones and zeros, so that a dropped weight or bias shows."""
from __future__ import annotations

import copy
import types

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fusednorm
from fusednorm import functional
from conftest import random_input

DTYPES = [torch.float64, torch.float32]
SMALL = 0.1  # the inputs' scale: mean square 0.01, so eps = 0.5 dominates it
BIG_EPS = 0.5


def small_input(shape, dtype, scale=SMALL, seed=0):
    return random_input(shape, dtype, "cpu", scale=scale, shift=0.3 * scale, seed=seed)


def randomize(module: nn.Module, seed=3) -> nn.Module:
    """Every parameter random (weights near 1, biases near 0.5): a dropped one shows."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            shift = 1.0 if name.endswith("weight") and p.dim() == 1 else 0.0
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.5 + shift
                    + (0.5 if name.endswith("bias") else 0.0))
    return module


def assert_same_results(fused_fn, torch_fn, inputs, params_fused=(), params_torch=()):
    """fused_fn(*inputs) and torch_fn(*inputs) give the same outputs and the same gradients
    of the inputs and of the two parameter lists (in order), to the dtype's precision."""
    a = [t.detach().clone().requires_grad_() for t in inputs]
    b = [t.detach().clone().requires_grad_() for t in inputs]
    out_a, out_b = fused_fn(*a), torch_fn(*b)
    out_a = out_a if isinstance(out_a, tuple) else (out_a,)
    out_b = out_b if isinstance(out_b, tuple) else (out_b,)
    dtype = inputs[0].dtype
    tol = dict(rtol=1e-10, atol=1e-12) if dtype == torch.float64 else dict(rtol=2e-5, atol=2e-5)
    for i, (x, y) in enumerate(zip(out_a, out_b, strict=True)):
        assert x.dtype == y.dtype and x.shape == y.shape, f"output {i}: {x.dtype} {x.shape}"
        torch.testing.assert_close(x, y, **tol, msg=lambda m: f"output {i}: {m}")
    grads = [random_input(o.shape, o.dtype, "cpu", scale=1.0, shift=0.0, seed=9 + i)
             for i, o in enumerate(out_a)]
    leaves_a, leaves_b = a + list(params_fused), b + list(params_torch)
    assert len(leaves_a) == len(leaves_b)
    ga = torch.autograd.grad(out_a, leaves_a, grads, allow_unused=True)
    gb = torch.autograd.grad(out_b, leaves_b, grads, allow_unused=True)
    for i, (x, y) in enumerate(zip(ga, gb)):
        assert (x is None) == (y is None), f"gradient {i}: {x is None} vs {y is None}"
        if x is not None:
            torch.testing.assert_close(x, y, **tol, msg=lambda m: f"gradient {i}: {m}")


def module_pair(fused_cls, torch_cls, *args, **kwargs):
    theirs = randomize(torch_cls(*args, **kwargs))
    mine = fused_cls(*args, **kwargs)
    mine.load_state_dict(theirs.state_dict(), strict=True)
    return mine, theirs


# --- modules ---------------------------------------------------------------------------

LAYER_NORM_KWARGS = [dict(eps=BIG_EPS), dict(eps=BIG_EPS, bias=False),
                     dict(eps=BIG_EPS, elementwise_affine=False), dict(bias=False)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kwargs", LAYER_NORM_KWARGS, ids=str)
def test_fused_layer_norm_arguments(dtype, kwargs):
    mine, theirs = module_pair(fusednorm.FusedLayerNorm, nn.LayerNorm, (3, 7), dtype=dtype,
                               **kwargs)
    assert [p.dtype for p in mine.parameters()] == [dtype] * len(list(theirs.parameters()))
    x = small_input((5, 3, 7), dtype)
    assert_same_results(mine, theirs, [x], mine.parameters(), theirs.parameters())


RMS_NORM_KWARGS = [dict(eps=BIG_EPS), dict(eps=None), dict(eps=BIG_EPS, elementwise_affine=False),
                   dict(eps=None, elementwise_affine=False)]


def rms_scale(dtype, eps):
    """Inputs whose mean square is about eps (eps None: torch's default, float32's or
    float64's machine epsilon), where eps changes the result by half."""
    if eps is None:
        eps = torch.finfo(torch.float64 if dtype == torch.float64 else torch.float32).eps
    return eps ** 0.5


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kwargs", RMS_NORM_KWARGS, ids=str)
def test_fused_rms_norm_arguments(dtype, kwargs):
    mine, theirs = module_pair(fusednorm.FusedRMSNorm, nn.RMSNorm, 7, dtype=dtype, **kwargs)
    x = small_input((5, 7), dtype, scale=rms_scale(dtype, kwargs["eps"]))
    assert_same_results(mine, theirs, [x], mine.parameters(), theirs.parameters())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_hf_rms_norm_keeps_variance_epsilon(dtype):
    """Hugging Face's RMSNorm with eps = 0.5, swapped in place by replace_norms."""
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    theirs = randomize(llama.LlamaRMSNorm(8, eps=BIG_EPS)).to(dtype)
    mine = fusednorm.replace_norms(nn.Sequential(copy.deepcopy(theirs)))[0]
    assert type(mine) is fusednorm.FusedHFRMSNorm and mine.variance_epsilon == BIG_EPS
    x = small_input((4, 8), dtype)
    if dtype == torch.float32:
        assert_same_results(mine, theirs, [x], mine.parameters(), theirs.parameters())
    else:  # both normalize in float32 and round once, then multiply in bfloat16
        torch.testing.assert_close(mine(x), theirs(x), rtol=0, atol=0)


@pytest.mark.parametrize("kwargs", [dict(eps=BIG_EPS), dict(eps=BIG_EPS, affine=False)], ids=str)
def test_fused_layer_norm_2d_matches_timm(kwargs):
    """timm's LayerNorm2d (eps 0.5, with and without affine) swapped by replace_layernorm,
    on a square image, whose height and width a wrong permutation would exchange."""
    timm_norm = pytest.importorskip("timm.layers")
    theirs = randomize(timm_norm.LayerNorm2d(6, **kwargs))
    mine = fusednorm.replace_layernorm(nn.Sequential(copy.deepcopy(theirs)))[0]
    assert type(mine) is fusednorm.FusedLayerNorm2d
    x = small_input((2, 6, 5, 5), torch.float32)
    assert_same_results(mine, theirs, [x], mine.parameters(), theirs.parameters())


@pytest.mark.parametrize("kwargs", [dict(eps=BIG_EPS), dict(elementwise_affine=False, eps=BIG_EPS),
                                    dict(bias=False)], ids=str)
def test_fused_layer_norm_2d_arguments(kwargs):
    mine = randomize(fusednorm.FusedLayerNorm2d(6, dtype=torch.float64, **kwargs))
    x = small_input((2, 6, 4, 4), torch.float64)

    def theirs(t):
        return F.layer_norm(t.permute(0, 2, 3, 1), (6,), mine.weight, mine.bias,
                            mine.eps).permute(0, 3, 1, 2)

    assert mine.eps == kwargs.get("eps", 1e-5)
    assert_same_results(mine, theirs, [x])


def ffn_reference(d, hidden, bias, approximate, dtype):
    return nn.Sequential(nn.Linear(d, hidden, bias=bias, dtype=dtype),
                         nn.GELU(approximate=approximate),
                         nn.Linear(hidden, d, bias=bias, dtype=dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("bias", [True, False])
def test_fused_gelu_ffn_arguments(dtype, approximate, bias):
    theirs = randomize(ffn_reference(6, 10, bias, approximate, dtype))
    mine = fusednorm.FusedGeluFFN(6, 10, bias=bias, approximate=approximate, dtype=dtype)
    # The state dict maps with strict=True: exactly the biases asked for, by the same names.
    mine.load_state_dict({k.replace("0.", "fc1.").replace("2.", "fc2."): v
                          for k, v in theirs.state_dict().items()}, strict=True)
    assert {p.dtype for p in mine.parameters()} == {dtype}
    assert mine.approximate == approximate
    # Pre-activations of both signs and up to about 3, where tanh's GELU differs most.
    x = random_input((7, 6), dtype, "cpu", scale=2.0, shift=0.0)
    assert_same_results(mine, theirs, [x], mine.parameters(), theirs.parameters())


def test_fused_gelu_ffn_default_hidden_and_device():
    module = fusednorm.FusedGeluFFN(6, device="meta")
    assert module.fc1.weight.shape == (24, 6) and module.fc2.weight.shape == (6, 24)
    assert {p.device.type for p in module.parameters()} == {"meta"}
    assert {p.dtype for p in fusednorm.FusedGeluFFN(6, dtype=torch.bfloat16).parameters()} == {
        torch.bfloat16}


class Block(nn.Module):
    """x + fc2(gelu(fc1(LayerNorm(x)))) from PyTorch's modules, with
    FusedLayerNormGeluFFN's parameter names."""

    def __init__(self, d, hidden, eps, bias, approximate, dtype):
        super().__init__()
        self.norm = nn.LayerNorm(d, eps=eps, dtype=dtype)
        self.fc1 = nn.Linear(d, hidden, bias=bias, dtype=dtype)
        self.fc2 = nn.Linear(hidden, d, bias=bias, dtype=dtype)
        self.act = nn.GELU(approximate=approximate)

    def forward(self, x):
        return x + self.fc2(self.act(self.fc1(self.norm(x))))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("bias", [True, False])
def test_fused_layer_norm_gelu_ffn_arguments(dtype, approximate, bias):
    theirs = randomize(Block(6, 10, BIG_EPS, bias, approximate, dtype))
    mine = fusednorm.FusedLayerNormGeluFFN(6, 10, eps=BIG_EPS, bias=bias, approximate=approximate,
                                           dtype=dtype)
    mine.load_state_dict(theirs.state_dict(), strict=True)
    assert mine.norm.eps == BIG_EPS and {p.dtype for p in mine.parameters()} == {dtype}
    # Small rows, so that eps matters; the FFN's weights (about 0.5) keep GELU's input
    # away from zero through the norm's weight and bias.
    x = small_input((7, 6), dtype)
    assert_same_results(mine, theirs, [x], mine.parameters(), theirs.parameters())


@pytest.mark.parametrize("cls, args", [
    (fusednorm.FusedLayerNorm, (7,)), (fusednorm.FusedRMSNorm, (7,)),
    (fusednorm.FusedLayerNorm2d, (7,)), (fusednorm.FusedGeluFFN, (7, 9)),
    (fusednorm.FusedLayerNormGeluFFN, (7, 9))])
def test_modules_take_device_and_dtype(cls, args):
    on_meta = cls(*args, device="meta", dtype=torch.float16)
    assert {(p.device.type, p.dtype) for p in on_meta.parameters()} == {("meta", torch.float16)}


# --- functions -------------------------------------------------------------------------

WB = ["weight_bias", "weight", "bias", "none"]


def norm_params(which, n, dtype):
    w = random_input((n,), dtype, "cpu", scale=0.5, shift=1.0, seed=4) if "weight" in which else None
    b = random_input((n,), dtype, "cpu", scale=0.5, shift=0.5, seed=5) if "bias" in which else None
    return w, b


def split(params):
    """The tensors among params (to differentiate) and a function that puts them back."""
    present = [p for p in params if p is not None]

    def rebuild(*tensors):
        it = iter(tensors)
        return [next(it) if p is not None else None for p in params]

    return present, rebuild


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("which", WB)
def test_layer_norm_function_arguments(dtype, which):
    w, b = norm_params(which, 7, dtype)
    x = small_input((5, 7), dtype)
    present, rebuild = split([w, b])
    for fn in (fusednorm.layer_norm,
               lambda *a: fusednorm.FusedLayerNormFunction.apply(*a)[0]):
        assert_same_results(
            lambda x, *p: fn(x, (7,), *rebuild(*p), BIG_EPS),
            lambda x, *p: F.layer_norm(x, (7,), *rebuild(*p), BIG_EPS), [x, *present])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("eps", [BIG_EPS, None])
@pytest.mark.parametrize("weight", [True, False])
def test_rms_norm_function_arguments(dtype, eps, weight):
    w, _ = norm_params("weight" if weight else "none", 7, dtype)
    x = small_input((5, 7), dtype, scale=rms_scale(dtype, eps))
    present, rebuild = split([w])
    assert_same_results(lambda x, *p: fusednorm.rms_norm(x, (7,), *rebuild(*p), eps),
                        lambda x, *p: F.rms_norm(x, (7,), *rebuild(*p), eps), [x, *present])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("which", WB)
def test_add_layer_norm_arguments(dtype, which):
    w, b = norm_params(which, 7, dtype)
    x, r = small_input((5, 7), dtype), small_input((5, 7), dtype, seed=1)
    present, rebuild = split([w, b])

    def theirs(x, r, *p):
        s = x + r
        return F.layer_norm(s, (7,), *rebuild(*p), BIG_EPS), s

    assert_same_results(
        lambda x, r, *p: fusednorm.add_layer_norm(x, r, (7,), *rebuild(*p), BIG_EPS), theirs,
        [x, r, *present])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("eps", [BIG_EPS, None])
@pytest.mark.parametrize("weight", [True, False])
def test_add_rms_norm_arguments(dtype, eps, weight):
    w, _ = norm_params("weight" if weight else "none", 7, dtype)
    scale = rms_scale(dtype, eps) / 2 ** 0.5  # the sum's mean square about eps
    x, r = small_input((5, 7), dtype, scale=scale), small_input((5, 7), dtype, scale=scale, seed=1)
    present, rebuild = split([w])

    def theirs(x, r, *p):
        s = x + r
        return F.rms_norm(s, (7,), *rebuild(*p), eps), s

    assert_same_results(lambda x, r, *p: fusednorm.add_rms_norm(x, r, (7,), *rebuild(*p), eps),
                        theirs, [x, r, *present])


def ffn_tensors(dtype, bias1, bias2, d=6, hidden=10):
    g = lambda shape, seed, scale: random_input(shape, dtype, "cpu", scale=scale, shift=0.0, seed=seed)  # noqa: E731
    return [g((hidden, d), 11, 0.5), g((hidden,), 12, 1.0) if bias1 else None,
            g((d, hidden), 13, 0.5), g((d,), 14, 1.0) if bias2 else None]


def eager_ffn(x, w1, b1, w2, b2, approximate):
    return F.linear(F.gelu(F.linear(x, w1, b1), approximate=approximate), w2, b2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("bias1, bias2", [(True, True), (True, False), (False, True), (False, False)])
def test_gelu_ffn_function_arguments(dtype, approximate, bias1, bias2):
    x = random_input((7, 6), dtype, "cpu", scale=2.0, shift=0.0)
    present, rebuild = split(ffn_tensors(dtype, bias1, bias2))
    for fn in (fusednorm.gelu_ffn, lambda *a: fusednorm.GeluFFNFunction.apply(*a)[0]):
        assert_same_results(lambda x, *p: fn(x, *rebuild(*p), approximate),
                            lambda x, *p: eager_ffn(x, *rebuild(*p), approximate), [x, *present])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("which", ["weight_bias", "none"])
def test_layer_norm_gelu_ffn_function_arguments(dtype, approximate, which):
    w, b = norm_params(which, 6, dtype)
    x = small_input((7, 6), dtype)
    present, rebuild = split([w, b, *ffn_tensors(dtype, True, False)])

    def theirs(x, *p):
        w, b, w1, b1, w2, b2 = rebuild(*p)
        return x + eager_ffn(F.layer_norm(x, (6,), w, b, BIG_EPS), w1, b1, w2, b2, approximate)

    for fn in (functional.layer_norm_gelu_ffn,
               lambda *a: fusednorm.LayerNormGeluFFNFunction.apply(*a)[0]):
        def mine(x, *p, fn=fn):
            w, b, w1, b1, w2, b2 = rebuild(*p)
            return fn(x, w, b, BIG_EPS, w1, b1, w2, b2, approximate)

        assert_same_results(mine, theirs, [x, *present])


# --- eps in the higher-order and forward-mode formulas ---------------------------------

NORMS = {
    "layer_norm": (lambda x, w, b, eps: fusednorm.layer_norm(x, (7,), w, b, eps),
                   lambda x, w, b, eps: F.layer_norm(x, (7,), w, b, eps)),
    "rms_norm": (lambda x, w, b, eps: fusednorm.rms_norm(x, (7,), w, eps),
                 lambda x, w, b, eps: F.rms_norm(x, (7,), w, eps)),
    "add_layer_norm": (lambda x, w, b, eps: fusednorm.add_layer_norm(x, 0.5 * x, (7,), w, b, eps)[0],
                       lambda x, w, b, eps: F.layer_norm(x + 0.5 * x, (7,), w, b, eps)),
    "add_rms_norm": (lambda x, w, b, eps: fusednorm.add_rms_norm(x, 0.5 * x, (7,), w, eps)[0],
                     lambda x, w, b, eps: F.rms_norm(x + 0.5 * x, (7,), w, eps)),
}


@pytest.mark.parametrize("name, eps", [(name, eps) for name in NORMS
                                       for eps in ([BIG_EPS] if "layer" in name else [BIG_EPS, None])])
def test_eps_reaches_double_backward_and_forward_mode(name, eps):
    """The second derivative (create_graph) and the jvp are formulas apart from the
    forward kernels: each must use the call's eps (None: the default)."""
    mine, theirs = NORMS[name]
    w, b = norm_params("weight_bias", 7, torch.float64)
    x = small_input((3, 7), torch.float64, scale=rms_scale(torch.float64, eps))
    tangent = random_input(x.shape, torch.float64, "cpu", scale=1.0, shift=0.0, seed=2)
    results = []
    for fn in (mine, theirs):
        leaf = x.clone().requires_grad_()
        (g,) = torch.autograd.grad((fn(leaf, w, b, eps) * tangent).sum(), leaf, create_graph=True)
        (gg,) = torch.autograd.grad(g.square().sum(), leaf)
        _, jvp = torch.func.jvp(lambda t: fn(t, w, b, eps), (x,), (tangent,))
        results.append((g.detach(), gg, jvp))
    for what, a, b_ in zip(("gradient", "second derivative", "jvp"), *results):
        torch.testing.assert_close(a, b_, rtol=1e-9, atol=1e-10, msg=lambda m: f"{what}: {m}")


def test_reference_fallback_keeps_eps(monkeypatch):
    """Where no kernel serves the device, the plain-PyTorch fallback gets the same
    arguments (eps here) as the kernel would."""
    from fusednorm import _loader, ops

    def no_kernel(*args):
        raise NotImplementedError("Could not run 'fusednorm::rms_norm' with arguments from "
                                  "the 'CPU' backend")

    monkeypatch.setattr(ops, "RMS_NORM", no_kernel)
    monkeypatch.setattr(ops, "LAYER_NORM", no_kernel)
    monkeypatch.setattr(ops, "FAST", types.SimpleNamespace(
        rms_norm=lambda *a: NotImplemented, layer_norm=lambda *a: NotImplemented))
    monkeypatch.setattr(_loader, "KERNELS", frozenset())
    monkeypatch.setattr(functional, "_warned_fallback", set())
    x, (w, b) = small_input((3, 7), torch.float64), norm_params("weight_bias", 7, torch.float64)
    with pytest.warns(RuntimeWarning, match="reference"):
        out = fusednorm.rms_norm(x, (7,), w, BIG_EPS)
    torch.testing.assert_close(out, F.rms_norm(x, (7,), w, BIG_EPS), rtol=1e-12, atol=1e-12)
    out = fusednorm.layer_norm(x, (7,), w, b, BIG_EPS)
    torch.testing.assert_close(out, F.layer_norm(x, (7,), w, b, BIG_EPS), rtol=1e-12, atol=1e-12)


# --- fusednorm.reference: the same arguments, and upcast -------------------------------

def test_reference_arguments():
    """fusednorm.reference's functions (the tests' float64 oracle and the fallback) take
    eps, eps=None, approximate and upcast as their fused counterparts: compared with
    PyTorch's functions in float64 (upcast=True from float32 input) and in the input's
    dtype (upcast=False)."""
    ref = fusednorm.reference
    x32, r32 = small_input((5, 7), torch.float32), small_input((5, 7), torch.float32, seed=1)
    w, b = norm_params("weight_bias", 7, torch.float32)
    close = lambda a, e: torch.testing.assert_close(a, e, rtol=1e-6, atol=1e-7)  # noqa: E731
    x, r, w64, b64 = x32.double(), r32.double(), w.double(), b.double()
    close(ref.layer_norm(x32, (7,), w, b, BIG_EPS), F.layer_norm(x, (7,), w64, b64, BIG_EPS))
    close(ref.layer_norm(x32, (7,), w, b, BIG_EPS, upcast=False),
          F.layer_norm(x32, (7,), w, b, BIG_EPS))
    s = x + r
    close(ref.add_layer_norm(x32, r32, (7,), w, b, BIG_EPS)[0], F.layer_norm(s, (7,), w64, b64, BIG_EPS))
    for eps in (BIG_EPS, None):
        xs = small_input((5, 7), torch.float32, scale=rms_scale(torch.float32, eps))
        torch.testing.assert_close(ref.rms_norm(xs, (7,), w, eps, upcast=False),
                                   F.rms_norm(xs, (7,), w, eps))
        close(ref.add_rms_norm(xs, xs, (7,), w, eps, upcast=False)[0], F.rms_norm(xs + xs, (7,), w, eps))
    tensors = ffn_tensors(torch.float64, True, True)
    xf = random_input((7, 6), torch.float64, "cpu", scale=2.0, shift=0.0)
    for approximate in ("none", "tanh"):
        close(ref.gelu_ffn(xf.float(), *[t.float() for t in tensors], approximate),
              eager_ffn(xf.float().double(), *[t.float().double() for t in tensors], approximate))
        xn = small_input((7, 6), torch.float64)
        wn, bn = norm_params("weight_bias", 6, torch.float64)
        close(ref.layer_norm_gelu_ffn(xn, wn, bn, BIG_EPS, *tensors, approximate),
              xn + eager_ffn(F.layer_norm(xn, (6,), wn, bn, BIG_EPS), *tensors, approximate))
