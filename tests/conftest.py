"""Shared test helpers: the devices to run on and the three-way accuracy check."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fusednorm

HAS_CUDA = torch.cuda.is_available() and fusednorm.build_info()["cuda_kernels"]

# Every test parametrized over DEVICES runs on CPU, and on CUDA when a GPU is visible
# (skipped, and reported as skipped, otherwise).
DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")),
]

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]

# Absolute slack per dtype for the three-way check, on top of twice PyTorch's own error.
ATOL = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def assert_close_three_way(fused, torch_same_dtype, ref64, dtype, what="output", atol=None):
    """|fused - ref64| <= 2 * |torch_same_dtype - ref64| + atol, elementwise: fusednorm may
    be at most about twice as wrong as PyTorch itself at the same dtype."""
    atol = ATOL[dtype] if atol is None else atol
    assert fused.shape == ref64.shape, f"{what}: shape {fused.shape} != {ref64.shape}"
    fused_err = (fused.double() - ref64.double()).abs()
    torch_err = (torch_same_dtype.double() - ref64.double()).abs()
    bound = 2 * torch_err + atol * (1 + ref64.double().abs())
    bad = fused_err > bound
    if bad.any():
        idx = bad.nonzero()[0].tolist()
        raise AssertionError(
            f"{what} ({dtype}): {int(bad.sum())} of {bad.numel()} elements beyond the bound; "
            f"first at {idx}: fused err {fused_err[tuple(idx)].item():.3e}, torch err "
            f"{torch_err[tuple(idx)].item():.3e}, max fused err {fused_err.max().item():.3e}"
        )


def torch_layer_norm(x, normalized_shape, weight=None, bias=None, eps=1e-5):
    """F.layer_norm, the comparator of the three-way checks. float32 weight and bias with a
    float16/bfloat16 input are refused by the CUDA kernel of older PyTorch (2.11): there it
    is what newer PyTorch computes, float32 arithmetic rounded once to the input's dtype."""
    try:
        return F.layer_norm(x, normalized_shape, weight, bias, eps)
    except RuntimeError as error:
        mixed = any(t is not None and t.dtype != x.dtype for t in (weight, bias))
        if not (mixed and "expected scalar type" in str(error)):
            raise
    return F.layer_norm(x.float(), normalized_shape, weight, bias, eps).to(x.dtype)


def random_input(shape, dtype, device, scale=3.0, shift=1.0, seed=0):
    """Random data away from zero mean and unit scale, so that a kernel that skipped the
    centring or the scaling would fail."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g, dtype=torch.float64) * scale + shift).to(
        device=device, dtype=dtype
    )


def check_outputs_and_grads(fused_fn, torch_fn, ref_fn, tensors, names, grad_seed=7):
    """Runs fused_fn, torch_fn (same dtype) and ref_fn (float64 leaves) on `tensors` (None
    allowed), each returning a tuple of outputs; checks every output and then every
    gradient (for random output gradients) within the three-way bound. Gradients of
    parameters (anything but the first two names' tensors of the same shape as input) get
    a slack that grows with the rows they sum over."""
    x = tensors[0]
    dtype = x.dtype

    def leaves(cast):
        return [cast(t).requires_grad_() if t is not None else None for t in tensors]

    mine = leaves(lambda t: t.detach().clone())
    theirs = leaves(lambda t: t.detach().clone())
    ref = leaves(lambda t: t.detach().double())
    outs, expected, ref_outs = fused_fn(*mine), torch_fn(*theirs), ref_fn(*ref)
    for i, (o, e, r) in enumerate(zip(outs, expected, ref_outs)):
        assert o.dtype == e.dtype and o.shape == e.shape, f"output {i}: {o.dtype} {o.shape}"
        assert_close_three_way(o, e, r, dtype, what=f"output {i}")
    grads = [random_input(o.shape, o.dtype, o.device, scale=1.0, shift=0.0, seed=grad_seed + i)
             for i, o in enumerate(outs)]
    torch.autograd.backward(list(outs), grads)
    torch.autograd.backward(list(expected), grads)
    torch.autograd.backward(list(ref_outs), [g.double() for g in grads])
    for name, m, t, r in zip(names, mine, theirs, ref):
        if m is None:
            continue
        assert m.grad is not None and m.grad.dtype == m.dtype, f"gradient of {name}"
        rows = 1 if m.shape == x.shape else x.numel() // max(1, m.numel())
        atol = ATOL[dtype] * max(1, rows) ** 0.5
        assert_close_three_way(m.grad, t.grad, r.grad, dtype, what=f"grad {name}", atol=atol)
class RecordingBackend:
    """A torch.compile backend that runs AOTAutograd's forward and backward graphs eagerly
    and keeps them (fw_graphs, bw_graphs), to check which ops they call.

    torch._dynamo.testing.AotEagerAndRecordGraphs does the same but hands AOTAutograd
    unboxed functions, for which AOTAutograd warns ("...doesn't take boxed arguments") on
    every backward; make_boxed_func is what that warning asks for."""

    def __init__(self):
        from functorch.compile import make_boxed_func
        from torch._dynamo.backends.common import aot_autograd

        self.fw_graphs, self.bw_graphs = [], []

        def recorder(graphs):
            def compiler(gm, example_inputs):
                graphs.append(gm)
                return make_boxed_func(gm.forward)
            return compiler

        self._backend = aot_autograd(fw_compiler=recorder(self.fw_graphs),
                                     bw_compiler=recorder(self.bw_graphs))

    def __call__(self, gm, example_inputs):
        return self._backend(gm, example_inputs)


def halfway_pairs(shape, dtype, seed=0, scale=4.0):
    """Ties of a 16-bit dtype: for random neighbours low < high in magnitude (low about
    scale times a normal sample), the float32 value halfway between them (exact: one bit
    more than the dtype holds) and the even one of the two, to which round-to-nearest-even
    takes that tie."""
    g = torch.Generator().manual_seed(seed)
    low = (torch.randn(shape, generator=g) * scale).to(dtype)
    bits = low.view(torch.int16)
    high = (bits + 1).view(dtype)  # same sign, one step further from zero
    mid = ((low.double() + high.double()) / 2).float()
    even = torch.where(bits % 2 == 0, low, high)
    assert torch.equal(mid.to(dtype), even), "PyTorch's conversion rounds ties to even"
    return mid, even


def relative_errors(tensors, references):
    """Each tensor's largest error against its float64 reference, over the reference's
    largest value."""
    return [((t.double() - r).abs().max() / r.abs().max().clamp_min(1e-30)).item()
            for t, r in zip(tensors, references)]


def assert_far_as_exact_as_near(far, near, names, where=""):
    """Errors (relative_errors) of rows far from zero at most 4x those of the same rows at
    zero: the far-from-zero tests' bound."""
    for name, e_far, e_near in zip(names, far, near):
        assert e_far <= 4 * e_near + 1e-7, (
            f"grad {name}{where}: {e_far:.2e} from float64, {e_near:.2e} at zero")

