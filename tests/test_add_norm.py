"""Residual add + norm (fusednorm.add_layer_norm, add_rms_norm): (norm(x + r), x + r) in one
pass, against the float64 reference and the eager composite, gradients through both
outputs, opcheck, compile, errors."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fusednorm
from fusednorm import reference
from conftest import (DEVICES, DTYPES, RecordingBackend, assert_far_as_exact_as_near,
                      check_outputs_and_grads, random_input, relative_errors)

KINDS = ["layer_norm", "rms_norm"]


def _fns(kind, shape, eps):
    if kind == "layer_norm":
        fused = lambda x, r, w, b: fusednorm.add_layer_norm(x, r, shape, w, b, eps)  # noqa: E731

        def eager(x, r, w, b):
            s = x + r
            return F.layer_norm(s, shape, w, b, eps), s

        ref = lambda x, r, w, b: reference.add_layer_norm(x, r, shape, w, b, eps)  # noqa: E731
    else:
        fused = lambda x, r, w, b: fusednorm.add_rms_norm(x, r, shape, w, eps)  # noqa: E731

        def eager(x, r, w, b):
            s = x + r
            return F.rms_norm(s, shape, w, eps), s

        def ref(x, r, w, b):
            return reference.add_rms_norm(x, r, shape, w, eps or reference.rms_eps(x.dtype))
    return fused, eager, ref


def _check(kind, x, r, shape, w, b, eps=None):
    eps = 1e-5 if kind == "layer_norm" and eps is None else eps
    fused, eager, ref = _fns(kind, shape, eps)
    check_outputs_and_grads(fused, eager, ref, [x, r, w, b], ["input", "residual", "weight", "bias"])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N", [1, 7, 768, 1023, 4096])
@pytest.mark.parametrize("kind", KINDS)
def test_matches_reference(device, dtype, N, kind):
    x = random_input((37, N), dtype, device)
    r = random_input((37, N), dtype, device, seed=2, shift=-0.5)
    w = random_input((N,), dtype, device, scale=1.0, shift=1.0, seed=3)
    b = random_input((N,), dtype, device, scale=1.0, shift=0.5, seed=4) if kind == "layer_norm" else None
    _check(kind, x, r, (N,), w, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("N", [1024, 1000, 4100, 2048])
@pytest.mark.parametrize("kind", KINDS)
def test_calls_larger_than_caches(dtype, N, kind):
    """Calls that move 16 MiB or more (over 4 MiB per tensor): from the second call on (the
    pages mapped) the CPU kernels stream the output and the sum, the sum through a staging
    copy in cache for rows of up to 16 KiB (1024; 1000, whose rows do not start on a cache
    line) and with plain stores for longer ones (4100 float32); the backward streams
    bfloat16 rows of 2048 (4 KiB apart) one row a tile on AVX2. Every call must give the
    same, correct result, the sum bitwise that of x + r."""
    M = (5 << 20) // (N * dtype.itemsize) + 1
    x = random_input((M, N), dtype, "cpu")
    r = random_input((M, N), dtype, "cpu", seed=2, shift=-0.5)
    w = random_input((N,), dtype, "cpu", scale=1.0, shift=1.0, seed=3)
    b = random_input((N,), dtype, "cpu", scale=1.0, shift=0.5, seed=4) if kind == "layer_norm" else None
    fused, _, _ = _fns(kind, (N,), 1e-5 if kind == "layer_norm" else None)
    for _ in range(3):
        _check(kind, x, r, (N,), w, b)
        _, s = fused(x, r, w, b)
        assert torch.equal(s, x + r)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype, weight_dtype", [(torch.float32, torch.bfloat16),
                                                 (torch.bfloat16, torch.float16),
                                                 (torch.float16, torch.float64)], ids=str)
@pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight")  # torch's own
def test_rms_weight_of_another_float_dtype(device, dtype, weight_dtype):
    """add_rms_norm takes rms_norm's weights: any float dtype, the output in the input's."""
    x, r = random_input((9, 130), dtype, device), random_input((9, 130), dtype, device, seed=2)
    w = random_input((130,), weight_dtype, device, scale=1.0, seed=3)
    eps = reference.rms_eps(dtype)
    fused, eager, ref = _fns("rms_norm", (130,), eps)
    check_outputs_and_grads(fused, lambda x, r, w, b: tuple(o.to(x.dtype) for o in eager(x, r, w, b)),
                            ref, [x, r, w, None], ["input", "residual", "weight", "bias"])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", KINDS)
def test_strided_multi_dim_no_params(device, kind):
    x = random_input((4, 6, 3, 5), torch.float32, device).transpose(0, 1)[::2]
    r = random_input((3, 4, 3, 5), torch.float32, device, seed=2)
    _check(kind, x, r, (3, 5), None, None)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", KINDS)
def test_sum_is_the_inputs_dtype_sum_bitwise(device, dtype, kind):
    x = random_input((5, 33), dtype, device)
    r = random_input((5, 33), dtype, device, seed=2)
    fused, _, _ = _fns(kind, (33,), None if kind == "rms_norm" else 1e-5)
    _, s = fused(x, r, None, None)
    assert s.dtype == dtype and torch.equal(s, x + r)


def _hard_rounding_pairs(dtype):
    """(x, r) pairs whose float sum rounds to `dtype` at a tie, into the subnormals, past the
    largest finite value or from a NaN/infinity: where a shortcut (no NaN mask, a
    flush-to-zero conversion instruction, truncation) would differ from PyTorch."""
    info = torch.finfo(dtype)
    ulp_at_one = info.eps
    pairs = [
        (1.0, ulp_at_one / 2),                  # tie: rounds to even (down)
        (1.0 + ulp_at_one, ulp_at_one / 2),     # tie: rounds to even (up)
        (-1.0, -ulp_at_one / 2),
        (info.tiny, -info.tiny / 4),            # a subnormal result
        (info.tiny / 2, info.tiny / 8),         # subnormal + subnormal
        (-info.tiny / 4, info.tiny / 16),
        (float(info.max), float(info.max) * ulp_at_one / 4),  # stays at the largest value
        (float(info.max), float(info.max) * ulp_at_one / 2),  # tie past it: infinity
        (float("nan"), 1.0), (1.0, float("nan")), (float("inf"), 1.0), (float("-inf"), -1.0),
        (0.0, -0.0), (-0.0, -0.0),
    ]
    return pairs


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("N", [5, 67, 100])
def test_sum_rounds_like_pytorch_at_hard_values(device, dtype, kind, N):
    """The residual sum is rounded to the dtype by the kernels' own vector code (full
    blocks and the masked last block): bit for bit PyTorch's x + r, NaN for NaN."""
    pairs = _hard_rounding_pairs(dtype)
    rows = (len(pairs) + N - 1) // N + 1
    x = random_input((rows, N), dtype, device).flatten()
    r = random_input((rows, N), dtype, device, seed=2).flatten()
    # Spread the hard pairs over columns of every position modulo 32, the tail included.
    positions = torch.randperm(rows * N, generator=torch.Generator().manual_seed(5))[: len(pairs)]
    for pos, (a, b) in zip(positions.tolist(), pairs):
        x[pos], r[pos] = a, b
    x, r = x.view(rows, N), r.view(rows, N)
    fused, _, _ = _fns(kind, (N,), None if kind == "rms_norm" else 1e-5)
    _, s = fused(x, r, None, None)
    expected = x + r
    assert torch.equal(torch.isnan(s), torch.isnan(expected))
    finite_or_inf = ~torch.isnan(expected)
    bits, expected_bits = s.view(torch.int16), expected.view(torch.int16)
    assert torch.equal(bits[finite_or_inf], expected_bits[finite_or_inf])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", KINDS)
def test_gradcheck_and_gradgradcheck(device, kind):
    x = random_input((3, 6), torch.float64, device).requires_grad_()
    r = random_input((3, 6), torch.float64, device, seed=2).requires_grad_()
    w = random_input((6,), torch.float64, device, seed=3).requires_grad_()
    fused, _, _ = _fns(kind, (6,), 1e-5)
    fn = lambda x, r, w: fused(x, r, w, None)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (x, r, w))
    assert torch.autograd.gradgradcheck(fn, (x, r, w))


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    ops = torch.ops.fusednorm
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        x = random_input((2, 3, 12), dtype, device)
        r = random_input((2, 3, 12), dtype, device, seed=2)
        w = random_input((12,), dtype, device, seed=3)
        b = random_input((12,), dtype, device, seed=4)
        for grad in (False, True):
            xg, rg = x.clone().requires_grad_(grad), r.clone().requires_grad_(grad)
            torch.library.opcheck(ops.add_layer_norm.default, (xg, rg, [12], w, b, 1e-5))
            torch.library.opcheck(ops.add_rms_norm.default, (xg, rg, [12], w, None))
        rows, res = x.reshape(6, 12), r.reshape(6, 12)
        for centered, bias in ((True, b), (False, None)):
            torch.library.opcheck(ops.norm_fwd.default, (rows, res, w, bias, 1e-5, centered))
            _, s, mean, rstd = ops.norm_fwd(rows, res, w, bias, 1e-5, centered)
            dy = random_input(rows.shape, dtype, device, seed=5)
            ds = random_input(rows.shape, dtype, device, seed=6)
            torch.library.opcheck(ops.norm_bwd.default, (dy, ds, s, mean, rstd, w, bias, centered))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dynamic", [False, True])
def test_compile_fullgraph(device, kind, dynamic):
    torch._dynamo.reset()
    backend = RecordingBackend()
    fused, eager, _ = _fns(kind, (16,), 1e-5)
    w = random_input((16,), torch.float32, device, seed=3).requires_grad_()
    compiled = torch.compile(lambda x, r: fused(x, r, w, None), backend=backend, fullgraph=True,
                             dynamic=dynamic)
    for rows in (4, 7):
        x = random_input((rows, 16), torch.float32, device).requires_grad_()
        r = random_input((rows, 16), torch.float32, device, seed=2).requires_grad_()
        y, s = compiled(x, r)
        ey, es = eager(x, r, w, None)
        torch.testing.assert_close(y, ey)
        torch.testing.assert_close(s, es)
        got = torch.autograd.grad((y * s).sum(), (x, r, w))
        want = torch.autograd.grad((ey * es).sum(), (x, r, w))
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b)
    fw = "\n".join(g.code for g in backend.fw_graphs)
    bw = "\n".join(g.code for g in backend.bw_graphs)
    assert f"fusednorm.add_{kind}.default" in fw and "fusednorm.norm_bwd" in bw


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    "change, error, pattern",
    [
        (dict(residual=torch.randn(4, 7)), ValueError, "residual must have the input's shape"),
        (dict(residual=torch.randn(4, 8, dtype=torch.float64)), TypeError, "residual must have the input's dtype"),
        (dict(residual=torch.randn(4, 8, device="meta")), RuntimeError, "residual is on meta"),
        (dict(residual=[1.0]), TypeError, "residual must be a Tensor"),
        (dict(normalized_shape=(7,)), ValueError, "normalized_shape"),
        (dict(weight=torch.ones(3)), ValueError, "weight"),
        (dict(weight=torch.ones(8, dtype=torch.int64)), TypeError, "weight"),
    ],
)
def test_errors_name_the_argument(kind, change, error, pattern):
    args = dict(input=torch.randn(4, 8), residual=torch.randn(4, 8), normalized_shape=(8,),
                weight=None)
    args.update(change)
    fn = fusednorm.add_layer_norm if kind == "layer_norm" else fusednorm.add_rms_norm
    with pytest.raises(error, match=pattern):
        fn(**args)


def _add_layer_norm_gradient_errors(x, residual, seed=3):
    """Each float32 gradient of add_layer_norm (both outputs given a gradient): its largest
    error against float64, over its largest value."""
    N = x.shape[-1]
    g = torch.Generator().manual_seed(seed)
    weight, bias, dy, dsum = (torch.randn(*shape, generator=g, dtype=torch.float64).to(x.device)
                              for shape in ((N,), (N,), x.shape, x.shape))
    grads = []
    for dtype, fn in ((torch.float32, fusednorm.add_layer_norm),
                      (torch.float64, reference.add_layer_norm)):
        leaves = [t.detach().to(dtype).clone().requires_grad_()
                  for t in (x, residual, weight + 1, bias)]
        out, s = fn(leaves[0], leaves[1], (N,), leaves[2], leaves[3], 1e-5)
        torch.autograd.backward([out, s], [dy.to(dtype), dsum.to(dtype)])
        grads.append([leaf.grad.double() for leaf in leaves])
    return relative_errors(*grads)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("N", [24, 1000, 4096])
def test_add_layer_norm_backward_far_from_zero_as_exact_as_near_it(device, N):
    """The sum 1e4 sigma from zero (float32): every gradient as close to float64 as at zero
    (the backward's mean correction, as LayerNorm's). The residual holds small integers, so
    that the float32 sum is exact and float64 normalizes the same values."""
    g = torch.Generator().manual_seed(13)
    noise = torch.randn(16, N, generator=g, dtype=torch.float64).float().double().to(device)
    residual = torch.randint(-4, 5, (16, N), generator=g).double().to(device)
    near = _add_layer_norm_gradient_errors(noise, residual)
    far = _add_layer_norm_gradient_errors((noise + 1e4).float().double(), residual)
    assert_far_as_exact_as_near(far, near, ("input", "residual", "weight", "bias"))
