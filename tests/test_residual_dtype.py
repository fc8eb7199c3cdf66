"""residual_dtype=torch.float32 of add_layer_norm / add_rms_norm: the sum s = input +
residual formed (one rounding), kept and returned in float32 (float64 for float64 input),
the output in the input's dtype rounded once from the float32 computation; gradients: the
residual's in the sum's dtype, the input's rounded once from it. Against float64, exactness
of the sum and of the one rounding, gradients, opcheck, compile, gradcheck, errors."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fusednorm
from fusednorm import reference
from fusednorm.errors import FusedTypeError
from conftest import DEVICES, DTYPES, check_outputs_and_grads, random_input

F32 = torch.float32
HALF = [torch.bfloat16, torch.float16]
KINDS = ["layer_norm", "rms_norm"]
# Unit roundoff of each output dtype: one rounding moves a value by at most u * |value|.
UNIT = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11, torch.float32: 2.0 ** -24,
        torch.float64: 2.0 ** -53}


def _sum_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else F32


def _fused(kind, shape, eps=None, residual_dtype=F32):
    if kind == "layer_norm":
        return lambda x, r, w, b: fusednorm.add_layer_norm(  # noqa: E731
            x, r, shape, w, b, 1e-5 if eps is None else eps, residual_dtype=residual_dtype)
    return lambda x, r, w, b: fusednorm.add_rms_norm(  # noqa: E731
        x, r, shape, w, eps, residual_dtype=residual_dtype)


def _torch(kind, shape, eps=None):
    """PyTorch's float32 residual stream: s = x.float() + r.float(), the norm of s in
    float32, rounded once to x's dtype."""
    def run(x, r, w, b):
        s = x.to(_sum_dtype(x.dtype)) + r.to(_sum_dtype(x.dtype))
        wc = None if w is None else w.to(s.dtype)
        if kind == "layer_norm":
            out = F.layer_norm(s, shape, wc, None if b is None else b.to(s.dtype),
                               1e-5 if eps is None else eps)
        else:
            out = F.rms_norm(s, shape, wc, eps)
        return out.to(x.dtype), s
    return run


def _reference(kind, shape, eps=None):
    """float64 leaves: the exact sum, normalized in float64."""
    def run(x, r, w, b):
        if kind == "layer_norm":
            return reference.add_layer_norm(x, r, shape, w, b, 1e-5 if eps is None else eps)
        return reference.add_rms_norm(x, r, shape, w, eps or reference.rms_eps(F32))
    return run


def _data(M, N, dtype, rdtype, device, kind, wdtype=None, shift=1.0):
    x = random_input((M, N), dtype, device, shift=shift)
    r = random_input((M, N), rdtype, device, seed=2, shift=-0.5)
    wdtype = wdtype or dtype
    w = random_input((N,), wdtype, device, scale=1.0, shift=1.0, seed=3)
    b = random_input((N,), wdtype, device, scale=1.0, shift=0.5, seed=4) if kind == "layer_norm" else None
    return x, r, w, b


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("residual_is_wide", [True, False], ids=["r_sum_dtype", "r_input_dtype"])
@pytest.mark.parametrize("N", [1, 7, 768, 1023, 4099])
@pytest.mark.parametrize("kind", KINDS)
def test_matches_reference(device, dtype, residual_is_wide, N, kind):
    x, r, w, b = _data(37, N, dtype, _sum_dtype(dtype) if residual_is_wide else dtype, device, kind)
    fused = _fused(kind, (N,))
    out, s = fused(x, r, w, b)
    assert out.dtype == dtype and s.dtype == _sum_dtype(dtype)
    # The sum: one rounding of the exact x + r to the sum's dtype.
    assert torch.equal(s, x.to(s.dtype) + r.to(s.dtype))
    check_outputs_and_grads(fused, _torch(kind, (N,)), _reference(kind, (N,)), [x, r, w, b],
                            ["input", "residual", "weight", "bias"])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("N", [7, 1023, 4099])
@pytest.mark.parametrize("kind", KINDS)
def test_one_rounding_of_output_and_gradients(device, dtype, N, kind):
    """Rows far from zero (shift 40: a sum rounded to 16 bits moves every LayerNorm output by
    2^-8 of 40 sigma) and a float32 residual. The output within one rounding of the float64
    norm of the float32 sum; the residual's gradient (float32) within float32 accuracy of the
    float64 gradient; the input's gradient exactly the residual's rounded once."""
    x, r, w, b = _data(29, N, dtype, F32, device, kind, wdtype=F32, shift=40.0)
    x.requires_grad_()
    r.requires_grad_()
    out, s = _fused(kind, (N,))(x, r, w, b)
    dy = random_input(out.shape, dtype, device, scale=1.0, shift=0.0, seed=8)
    ds = random_input(s.shape, F32, device, scale=1.0, shift=0.0, seed=9)
    torch.autograd.backward([out, s], [dy, ds])
    assert x.grad.dtype == dtype and r.grad.dtype == F32
    assert torch.equal(x.grad, r.grad.to(dtype))

    s64 = s.detach().double().requires_grad_()
    ref = (reference.layer_norm(s64, (N,), w.double(), b.double(), 1e-5) if kind == "layer_norm"
           else reference.rms_norm(s64, (N,), w.double(), reference.rms_eps(F32)))
    torch.autograd.backward([ref, s64], [dy.double(), ds.double()])
    err = (out.double() - ref.detach()).abs()
    bound = UNIT[dtype] * ref.detach().abs() + 2.0 ** -17 * (1 + ref.detach().abs())
    assert (err <= bound).all(), f"output: max err {err.max():.3e}"
    gerr = (r.grad.double() - s64.grad).abs()
    assert (gerr <= 2.0 ** -15 * (1 + s64.grad.abs())).all(), f"grad: max err {gerr.max():.3e}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", KINDS)
def test_float32_and_float64_inputs_and_none_as_before(device, kind):
    """Where the sum already has the input's dtype (float32; float64, whose sum is never
    narrowed), residual_dtype=torch.float32 computes bitwise what None does; None is the
    default."""
    for dtype in (F32, torch.float64, torch.bfloat16):
        x, r, w, b = _data(5, 300, dtype, dtype, device, kind)
        plain = _fused(kind, (300,), residual_dtype=None)(x, r, w, b)
        call = (fusednorm.add_layer_norm(x, r, (300,), w, b) if kind == "layer_norm"
                else fusednorm.add_rms_norm(x, r, (300,), w))
        assert all(torch.equal(p, c) for p, c in zip(plain, call))
        if dtype != torch.bfloat16:
            wide = _fused(kind, (300,))(x, r, w, b)
            assert all(torch.equal(p, q) for p, q in zip(plain, wide))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", KINDS)
def test_strided_multi_dim(device, kind):
    base = random_input((6, 5, 2, 33), torch.bfloat16, device)
    x = base.transpose(0, 1)[::2]
    r = random_input((3, 6, 2, 66), F32, device, seed=2)[..., ::2]
    w = random_input((2, 33), torch.bfloat16, device, seed=3)
    b = random_input((2, 33), torch.bfloat16, device, seed=4) if kind == "layer_norm" else None
    fused = _fused(kind, (2, 33))
    out, s = fused(x, r, w, b)
    assert torch.equal(s, x.float() + r)
    check_outputs_and_grads(fused, _torch(kind, (2, 33)), _reference(kind, (2, 33)),
                            [x, r, w, b], ["input", "residual", "weight", "bias"])


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("N", [1000, 4100])
@pytest.mark.parametrize("kind", KINDS)
def test_calls_larger_than_caches(dtype, N, kind):
    """Calls that move 16 MiB or more: the CPU kernels stream the output and the float32 sum
    (1000: through the staging copy; 4100: plain stores of rows over 16 KiB), and the
    backward streams dx. Every call gives the same, correct result."""
    M = (5 << 20) // (N * 4) + 1
    x, r, w, b = _data(M, N, dtype, F32, "cpu", kind)
    for _ in range(2):
        out, s = _fused(kind, (N,))(x, r, w, b)
        assert torch.equal(s, x.float() + r)
        expected = _torch(kind, (N,))(x, r, w, b)[0]
        assert (out.float() - expected.float()).abs().max() <= 2 * UNIT[dtype] * (
            1 + expected.float().abs().max())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", KINDS)
def test_gradcheck_and_gradgradcheck(device, kind):
    """float64 input: the sum stays float64 (residual_dtype never narrows)."""
    x, r, w, b = _data(3, 11, torch.float64, torch.float64, device, kind)
    args = [t.requires_grad_() for t in (x, r, w, b) if t is not None]
    fused = _fused(kind, (11,))
    fn = (lambda x, r, w, b: fused(x, r, w, b)) if kind == "layer_norm" else (  # noqa: E731
        lambda x, r, w: fused(x, r, w, None))
    assert torch.autograd.gradcheck(fn, args)
    assert torch.autograd.gradgradcheck(fn, args)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", KINDS)
def test_create_graph_formulas_agree_with_the_kernels(device, kind):
    """A create_graph backward (the ATen formulas) gives the fused backward's gradients and
    dtypes for a bfloat16 input with a float32 residual, and a second derivative."""
    x, r, w, b = _data(4, 65, torch.bfloat16, F32, device, kind)
    leaves = [t.requires_grad_() for t in (x, r, w, b) if t is not None]
    fused = _fused(kind, (65,))
    dy = random_input((4, 65), torch.bfloat16, device, scale=1.0, shift=0.0, seed=8)
    ds = random_input((4, 65), F32, device, scale=1.0, shift=0.0, seed=9)

    def grads(create_graph):
        out, s = fused(*leaves) if kind == "layer_norm" else fused(*leaves, None)
        return torch.autograd.grad([out, s], leaves, [dy, ds], create_graph=create_graph)

    plain, graphed = grads(False), grads(True)
    for p, g in zip(plain, graphed):
        assert p.dtype == g.dtype
        torch.testing.assert_close(g.float(), p.float(), rtol=2e-2, atol=2e-2)
    second = torch.autograd.grad(graphed[1].square().sum(), leaves[0])[0]
    assert second.dtype == torch.bfloat16 and torch.isfinite(second.float()).all()


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    ops = torch.ops.fusednorm
    x, r, w, b = _data(4, 37, torch.bfloat16, F32, device, "layer_norm", wdtype=F32)
    r16 = r.to(torch.bfloat16)
    for grad in (False, True):
        g = lambda t: t.detach().clone().requires_grad_(grad)  # noqa: E731
        torch.library.opcheck(ops.add_layer_norm.default,
                              (g(x), g(r), [37], g(w), g(b), 1e-5, False, F32))
        torch.library.opcheck(ops.add_layer_norm.default,
                              (g(x), g(r16), [37], g(w), g(b), 1e-5, True, F32))
        torch.library.opcheck(ops.add_rms_norm.default, (g(x), g(r), [37], g(w), None, False, F32))
    torch.library.opcheck(ops.norm_fwd.default, (x, r16, w, b, 1e-5, True, F32))
    _, s, mean, rstd = ops.norm_fwd(x, r, w, None, 1e-5, False, F32)
    assert s.dtype == F32 and torch.equal(s, x.float() + r)
    dy = random_input((4, 37), torch.bfloat16, device, seed=8)
    torch.library.opcheck(ops.norm_bwd.default, (dy, r, s, mean, rstd, w, None, False))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", KINDS)
def test_compile_fullgraph_forward_and_backward(device, kind):
    x, r, w, b = _data(6, 40, torch.bfloat16, F32, device, kind)
    leaves = [t.requires_grad_() for t in (x, r, w, b) if t is not None]
    fused = _fused(kind, (40,))

    def fn(*leaves):
        out, s = fused(*leaves) if kind == "layer_norm" else fused(*leaves, None)
        return out.float().sum() + s.square().sum()

    eager = torch.autograd.grad(fn(*leaves), leaves)
    torch._dynamo.reset()
    compiled = torch.autograd.grad(torch.compile(fn, fullgraph=True)(*leaves), leaves)
    for e, c in zip(eager, compiled):
        assert e.dtype == c.dtype and torch.equal(e, c)


@pytest.mark.parametrize("kind", KINDS)
def test_vmap_and_forward_ad(kind):
    x, r, w, b = _data(3 * 5, 24, torch.bfloat16, F32, "cpu", kind)
    fused = _fused(kind, (24,))
    batched = torch.func.vmap(lambda x, r: fused(x, r, w, b))(x.view(3, 5, 24), r.view(3, 5, 24))
    for got, want in zip(batched, fused(x, r, w, b)):
        assert torch.equal(got.reshape(want.shape), want)
    tx = random_input(x.shape, torch.bfloat16, "cpu", seed=11)
    tr = random_input(r.shape, F32, "cpu", seed=12)
    _, tangents = torch.func.jvp(lambda x, r: fused(x, r, w, b), (x, r), (tx, tr))
    _, expected = torch.func.jvp(lambda x, r: _torch(kind, (24,))(x, r, w, b), (x, r), (tx, tr))
    assert [t.dtype for t in tangents] == [torch.bfloat16, F32]
    for t, e in zip(tangents, expected):
        torch.testing.assert_close(t.float(), e.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", KINDS)
def test_rejected_arguments(device, kind):
    x, r, w, b = _data(2, 8, torch.bfloat16, F32, device, kind)
    fused = lambda r, residual_dtype: _fused(kind, (8,), residual_dtype=residual_dtype)(x, r, w, b)  # noqa: E731
    cases = [
        (r, torch.float16, "residual_dtype must be None or torch.float32, got torch.float16"),
        (r, torch.float64, "residual_dtype must be None or torch.float32"),
        (r, "float32", "residual_dtype must be None or torch.float32, got str"),
        (r, None, "residual_dtype=torch.float32 takes a float32 residual"),
        (r.half(), F32, "residual must have the input's dtype (torch.bfloat16) or residual_dtype's"),
    ]
    for residual, residual_dtype, message in cases:
        with pytest.raises(FusedTypeError, match=message.replace("(", r"\(").replace(")", r"\)")):
            fused(residual, residual_dtype)
    # float64 input: the sum is float64 and a float32 residual is refused, not narrowed to.
    x64 = x.double()
    with pytest.raises(FusedTypeError, match="residual"):
        fusednorm.add_rms_norm(x64, r, (8,), residual_dtype=F32)
    # The op itself refuses as well (a plain TypeError from C++).
    op = torch.ops.fusednorm.add_rms_norm.default
    with pytest.raises(TypeError, match="residual_dtype must be None or torch.float32"):
        op(x, r, [8], None, None, False, torch.float16)
    with pytest.raises(TypeError, match="residual"):
        op(x, r, [8], None, None, False, None)
    with pytest.raises(RuntimeError, match="sum_dtype"):
        torch.ops.fusednorm.norm_fwd(x, None, None, None, 1e-5, True, F32)


@pytest.mark.parametrize("kind", KINDS)
def test_reference_fallback(kind, monkeypatch):
    """Where no kernel serves the device, the fallback (input + residual, then the norm's
    reference) forms the sum in float32 too, and rounds the output once to the input's."""
    import types

    from fusednorm import _loader, functional, ops

    def no_kernel(*args):
        raise NotImplementedError("Could not run 'fusednorm' with arguments from the 'CPU' backend")

    for name in ("ADD_RMS_NORM", "ADD_LAYER_NORM", "RMS_NORM", "LAYER_NORM"):
        monkeypatch.setattr(ops, name, no_kernel)
    monkeypatch.setattr(ops, "FAST", types.SimpleNamespace(**{
        n: lambda *a: NotImplemented
        for n in ("add_rms_norm", "add_layer_norm", "rms_norm", "layer_norm")}))
    monkeypatch.setattr(_loader, "KERNELS", frozenset())
    monkeypatch.setattr(functional, "_warned_fallback", set())
    x, r, w, b = _data(5, 33, torch.bfloat16, F32, "cpu", kind, wdtype=F32)
    with pytest.warns(RuntimeWarning):
        out, s = _fused(kind, (33,))(x, r, w, b)
    assert out.dtype == torch.bfloat16 and torch.equal(s, x.float() + r)
    expected = _torch(kind, (33,))(x, r, w, b)[0]
    torch.testing.assert_close(out.float(), expected.float(), rtol=2 * UNIT[torch.bfloat16], atol=1e-5)
    with pytest.raises(FusedTypeError, match="residual_dtype must be None or torch.float32"):
        _fused(kind, (33,), residual_dtype=torch.float16)(x, r, w, b)
