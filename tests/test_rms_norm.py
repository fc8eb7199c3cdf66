"""RMSNorm (fusednorm.rms_norm, FusedRMSNorm): accuracy against the float64 reference and
torch.nn.functional.rms_norm, gradients of any order, opcheck, compile, errors."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fusednorm
from fusednorm import reference
from conftest import DEVICES, DTYPES, RecordingBackend, check_outputs_and_grads, random_input

SIZES = [1, 7, 768, 1023, 4096, 65537]


def _weight(shape, dtype, device):
    return random_input(shape, dtype, device, scale=1.0, shift=1.0, seed=1)


def _check(x, shape, weight, eps=None):
    check_outputs_and_grads(
        lambda x, w: (fusednorm.rms_norm(x, shape, w, eps),),
        lambda x, w: (F.rms_norm(x, shape, w, eps),),
        lambda x, w: (reference.rms_norm(x, shape, w, reference.rms_eps(x.dtype) if eps is None
                                         else eps),),
        [x, weight], ["input", "weight"])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N", SIZES)
@pytest.mark.parametrize("affine", [True, False])
def test_matches_reference(device, dtype, N, affine):
    rows = 3 if N > 4096 else 37
    x = random_input((rows, N), dtype, device)
    _check(x, (N,), _weight((N,), dtype, device) if affine else None)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight")  # torch's own
def test_float32_weight_for_half_input(device, dtype):
    x = random_input((9, 130), dtype, device)
    _check(x, (130,), _weight((130,), torch.float32, device))


# torch.nn.functional.rms_norm takes a weight of any float dtype and returns the input's
# dtype; fusednorm converts one the kernels do not take (float32 beside 16-bit input they do).
OTHER_WEIGHT_DTYPES = [
    (x, w) for x in DTYPES for w in DTYPES
    if w != x and not (w == torch.float32 and x in (torch.float16, torch.bfloat16))]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype, weight_dtype", OTHER_WEIGHT_DTYPES, ids=str)
@pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight")  # torch's own
def test_weight_of_another_float_dtype_as_torchs(device, dtype, weight_dtype):
    """Output in the input's dtype, the weight's gradient in the weight's, both within the
    three-way bound of the float64 reference (eps: the input dtype's default)."""
    x, w = random_input((9, 130), dtype, device), _weight((130,), weight_dtype, device)
    eps = reference.rms_eps(dtype)
    check_outputs_and_grads(
        lambda x, w: (fusednorm.rms_norm(x, (130,), w),),
        lambda x, w: (F.rms_norm(x, (130,), w).to(x.dtype),),
        lambda x, w: (reference.rms_norm(x, (130,), w, eps),),
        [x, w], ["input", "weight"])
    if dtype in (torch.float16, torch.bfloat16):
        # The weight applied in float32, not rounded to the input's dtype first: y is the
        # float64 result rounded once (a weight rounded to bfloat16 or float16 matched about
        # 73% of elements here).
        nearest = reference.rms_norm(x.double(), (130,), w.double(), eps).to(dtype)
        assert (fusednorm.rms_norm(x, (130,), w) == nearest).float().mean() >= 0.99


@pytest.mark.parametrize("device", DEVICES)
def test_weight_of_another_float_dtype_compiles_and_opchecks(device):
    """A bfloat16 weight beside float32 input: opcheck (the fake kernel's dtypes are the
    real ones'), torch.compile(fullgraph=True) and vmap give eager's results."""
    x = random_input((4, 3, 16), torch.float32, device).requires_grad_()
    w = _weight((16,), torch.bfloat16, device).requires_grad_()
    torch.library.opcheck(torch.ops.fusednorm.rms_norm.default, (x, [16], w, None))
    eager = fusednorm.rms_norm(x, (16,), w)
    torch._dynamo.reset()
    compiled = torch.compile(lambda x, w: fusednorm.rms_norm(x, (16,), w), backend="aot_eager",
                             fullgraph=True)(x, w)
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)
    (dw,) = torch.autograd.grad(compiled.sum(), w)
    assert dw.dtype == torch.bfloat16
    mapped = torch.vmap(lambda row: fusednorm.rms_norm(row, (16,), w))(x.detach())
    torch.testing.assert_close(mapped, eager.detach(), rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_multi_dim_strided_and_explicit_eps(device):
    base = random_input((6, 5, 2, 9), torch.float32, device)
    x = base.transpose(0, 1)[::2]  # not contiguous
    _check(x, (2, 9), _weight((2, 9), torch.float32, device), eps=1e-3)


@pytest.mark.parametrize("dtype", DTYPES)
def test_default_eps_is_torchs(dtype):
    x = random_input((4, 16), dtype, "cpu", scale=1e-4, shift=0.0)  # eps dominates
    torch.testing.assert_close(fusednorm.rms_norm(x, (16,)), F.rms_norm(x, (16,)))


@pytest.mark.parametrize("device", DEVICES)
def test_gradcheck_and_gradgradcheck(device):
    x = random_input((3, 2, 5), torch.float64, device).requires_grad_()
    w = _weight((2, 5), torch.float64, device).requires_grad_()
    fn = lambda x, w: fusednorm.rms_norm(x, (2, 5), w, 1e-5)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (x, w))
    assert torch.autograd.gradgradcheck(fn, (x, w))


@pytest.mark.parametrize("device", DEVICES)
def test_empty_batch(device):
    x = torch.empty(0, 8, device=device, requires_grad=True)
    w = torch.ones(8, device=device, requires_grad=True)
    y = fusednorm.rms_norm(x, (8,), w)
    y.sum().backward()
    assert y.shape == (0, 8) and torch.equal(w.grad, torch.zeros(8, device=device))


def test_weight_gradient_is_deterministic_across_thread_counts():
    x = random_input((1000, 300), torch.float32, "cpu").requires_grad_()
    w = _weight((300,), torch.float32, "cpu").requires_grad_()
    dy = random_input((1000, 300), torch.float32, "cpu", seed=3)
    grads = []
    threads = torch.get_num_threads()
    for n in (threads, 1):
        torch.set_num_threads(n)
        grads.append(torch.autograd.grad(fusednorm.rms_norm(x, (300,), w), w, dy)[0])
    torch.set_num_threads(threads)
    assert torch.equal(grads[0], grads[1])


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    ops = torch.ops.fusednorm
    for dtype, wdtype in [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                          (torch.float64, torch.float64)]:
        x = random_input((2, 3, 37), dtype, device)
        w = _weight((37,), wdtype, device)
        for grad in (False, True):
            xg, wg = x.clone().requires_grad_(grad), w.clone().requires_grad_(grad)
            torch.library.opcheck(ops.rms_norm.default, (xg, [37], wg, None))
            torch.library.opcheck(ops.rms_norm.default, (xg, [37], None, 1e-3))
        rows = x.reshape(6, 37)
        torch.library.opcheck(ops.norm_fwd.default, (rows, None, w, None, 1e-5, False))
        out, _, mean, rstd = ops.norm_fwd(rows, None, w, None, 1e-5, False)
        dy = random_input(rows.shape, dtype, device, seed=4)
        torch.library.opcheck(ops.norm_bwd.default, (dy, None, rows, mean, rstd, w, None, False))


@pytest.mark.parametrize("device", DEVICES)
def test_compile_fullgraph_runs_the_fused_ops(device):
    torch._dynamo.reset()
    backend = RecordingBackend()
    w = _weight((16,), torch.float32, device).requires_grad_()
    fn = torch.compile(lambda x: fusednorm.rms_norm(x, (16,), w), backend=backend, fullgraph=True)
    x = random_input((4, 16), torch.float32, device).requires_grad_()
    y = fn(x)
    torch.testing.assert_close(y, F.rms_norm(x, (16,), w))
    y.sum().backward()
    fw = "\n".join(g.code for g in backend.fw_graphs)
    bw = "\n".join(g.code for g in backend.bw_graphs)
    assert "fusednorm.rms_norm.default" in fw and "fusednorm.norm_bwd" in bw


def test_module_is_a_drop_in_for_nn_rmsnorm():
    torch.manual_seed(0)
    plain = nn.RMSNorm((4, 6), eps=1e-6)
    with torch.no_grad():
        plain.weight.uniform_(0.5, 1.5)
    fused = fusednorm.FusedRMSNorm((4, 6), eps=1e-6)
    fused.load_state_dict(plain.state_dict())
    assert isinstance(fused, nn.RMSNorm) and list(fused.state_dict()) == ["weight"]
    x = random_input((3, 4, 6), torch.float32, "cpu")
    torch.testing.assert_close(fused(x), plain(x))
    assert repr(fused).replace("FusedRMSNorm", "RMSNorm") == repr(plain)


@pytest.mark.parametrize(
    "call, error, pattern",
    [
        (lambda x: fusednorm.rms_norm(x, (7,)), ValueError, r"normalized_shape=\[7\]"),
        (lambda x: fusednorm.rms_norm(x, (8,), torch.ones(7)), ValueError, "weight"),
        (lambda x: fusednorm.rms_norm(x, (8,), torch.ones(8, dtype=torch.int32)), TypeError, "weight"),
        (lambda x: fusednorm.rms_norm(x, (8,), torch.ones(8, dtype=torch.complex64)), TypeError, "weight"),
        (lambda x: fusednorm.rms_norm(x.int(), (8,)), TypeError, "input"),
        (lambda x: fusednorm.rms_norm(x, "8"), TypeError, "normalized_shape"),
        (lambda x: fusednorm.rms_norm(x, (8,), None, -1.0), ValueError, "eps"),
        (lambda x: fusednorm.rms_norm(x.tolist(), (8,)), TypeError, "input"),
        (lambda x: fusednorm.rms_norm(x, (8,), torch.ones(8, device="meta")), RuntimeError, "weight"),
    ],
)
def test_errors_name_the_argument(call, error, pattern):
    with pytest.raises(error, match=pattern):
        call(torch.randn(4, 8))
