"""Forward-mode AD (dual tensors, torch.func.jvp) through every public op: the primal is
the fused kernels' output, bit for bit; the tangent is that of the op written in plain
PyTorch ops; gradcheck's forward-mode check passes in float64; the tangent can itself be
differentiated in reverse mode (Hessian-vector products, consistency-model losses)."""
from __future__ import annotations

import pytest
import torch
import torch.autograd.forward_ad as fwAD
from conftest import DEVICES, random_input
from op_cases import OPS, op_args

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(OPS))
def test_gradcheck_forward_mode(name, device):
    args = [a.requires_grad_() for a in op_args(name, device, torch.float64)]
    assert torch.autograd.gradcheck(OPS[name][1], args, check_forward_ad=True,
                                    check_undefined_grad=False, check_batched_grad=False)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(OPS))
def test_jvp_primal_is_the_fused_output_and_tangent_is_torchs(name, dtype, device):
    _, fused, eager = OPS[name]
    primals = op_args(name, device, dtype)
    tangents = [random_input(p.shape, p.dtype, device, scale=1.0, seed=40 + i)
                for i, p in enumerate(primals)]
    out, tangent = torch.func.jvp(fused, tuple(primals), tuple(tangents))
    plain = fused(*primals)
    _, tangent_ref = torch.func.jvp(eager, tuple(p.double() for p in primals),
                                    tuple(t.double() for t in tangents))
    for o, p in zip(out, plain):
        assert torch.equal(o, p)
    tol = {torch.float32: 1e-4, torch.bfloat16: 5e-2}[dtype]
    for t, o, ref in zip(tangent, out, tangent_ref):
        assert t.dtype == o.dtype  # the input's (a float32 sum's with residual_dtype)
        torch.testing.assert_close(t.double(), ref, rtol=tol, atol=tol * ref.abs().max().item())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["layer_norm", "add_layer_norm", "rms_norm"])
def test_dual_tensor_of_one_argument_only(name, device):
    """A tangent on the weight alone (float32 weight beside a bfloat16 input): the output's
    tangent in the output's dtype, the other inputs' tangents taken as zero."""
    _, fused, eager = OPS[name]
    primals = op_args(name, device, torch.bfloat16, param_dtype=torch.float32)
    w_index = OPS[name][0].index("w")
    w_tangent = random_input(primals[w_index].shape, torch.float32, device, seed=50)
    with fwAD.dual_level():
        dual = list(primals)
        dual[w_index] = fwAD.make_dual(primals[w_index], w_tangent)
        out = fused(*dual)[0]
        tangent = fwAD.unpack_dual(out).tangent
    ref_args = [p.double() for p in primals]
    _, ref = torch.func.jvp(lambda w: eager(*ref_args[:w_index], w, *ref_args[w_index + 1:])[0],
                            (ref_args[w_index],), (w_tangent.double(),))
    assert tangent.dtype == torch.bfloat16
    torch.testing.assert_close(tangent.double(), ref, rtol=5e-2, atol=5e-2 * ref.abs().max().item())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(OPS))
def test_reverse_mode_through_the_tangent(name, device):
    """d/dinputs of sum(tangent * c): what a loss built on a jvp differentiates, equal to
    the plain-PyTorch op's in float64."""
    _, fused, eager = OPS[name]
    grads = []
    for fn in (fused, eager):
        primals = [a.requires_grad_() for a in op_args(name, device, torch.float64)]
        tangents = [random_input(p.shape, p.dtype, device, scale=1.0, seed=60 + i)
                    for i, p in enumerate(primals)]
        with fwAD.dual_level():
            outs = fn(*[fwAD.make_dual(p, t) for p, t in zip(primals, tangents)])
            loss = sum((fwAD.unpack_dual(o).tangent * random_input(o.shape, o.dtype, device, seed=70)).sum()
                       for o in outs)
        grads.append(torch.autograd.grad(loss, primals, allow_unused=True))
    for g, ref in zip(*grads):
        assert (g is None) == (ref is None)
        if g is not None:
            torch.testing.assert_close(g, ref)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(OPS))
def test_nested_jvp_second_directional_derivative(name, device):
    """jvp of jvp: d²/dt² op(x + t v), as the primitives give it (F.layer_norm's nested
    forward mode is wrong, pytorch/pytorch#196700)."""
    _, fused, eager = OPS[name]
    args = op_args(name, device, torch.float64)
    v = random_input(args[0].shape, torch.float64, device, scale=1.0, seed=80)

    def second(fn):
        def first(x):
            return torch.func.jvp(lambda y: fn(y, *args[1:])[0], (x,), (v,))[1]
        return torch.func.jvp(first, (args[0],), (v,))[1]

    torch.testing.assert_close(second(fused), second(eager))
