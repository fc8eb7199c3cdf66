"""LayerNorm: accuracy against the float64 reference, gradients, and the module API, on every
device in conftest.DEVICES."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fusednorm
from fusednorm import reference
from conftest import (ATOL, DEVICES, DTYPES, assert_close_three_way, assert_far_as_exact_as_near,
                      halfway_pairs, random_input, relative_errors, torch_layer_norm)

ops = torch.ops.fusednorm

SIZES = [1, 7, 768, 1023, 4096, 65537]
# affine: weight and bias; weight_only: bias=None; none: neither.
AFFINE = ["affine", "weight_only", "none"]


def make_params(normalized_shape, affine, dtype, device, seed=1):
    if affine == "none":
        return None, None
    weight = random_input(normalized_shape, dtype, device, scale=1.0, shift=1.0, seed=seed)
    bias = None
    if affine == "affine":
        bias = random_input(normalized_shape, dtype, device, scale=1.0, shift=0.5, seed=seed + 1)
    return weight, bias


def check_forward_backward(x, normalized_shape, weight, bias, eps=1e-5, grad_seed=7):
    """Output and all gradients within the three-way bound of the float64 reference."""
    dtype = x.dtype
    leaves = [t.detach().requires_grad_() if t is not None else None for t in (x, weight, bias)]
    ref_leaves = [t.detach().double().requires_grad_() if t is not None else None for t in (x, weight, bias)]
    torch_leaves = [t.detach().requires_grad_() if t is not None else None for t in (x, weight, bias)]

    out = fusednorm.layer_norm(leaves[0], normalized_shape, leaves[1], leaves[2], eps)
    ref = reference.layer_norm(ref_leaves[0], normalized_shape, ref_leaves[1], ref_leaves[2], eps)
    expected = torch_layer_norm(torch_leaves[0], normalized_shape, torch_leaves[1], torch_leaves[2], eps)
    assert out.dtype == dtype and out.shape == x.shape
    assert_close_three_way(out, expected, ref, dtype)

    grad = random_input(x.shape, dtype, x.device, scale=1.0, shift=0.0, seed=grad_seed)
    out.backward(grad)
    ref.backward(grad.double())
    expected.backward(grad)
    for name, mine, ref_leaf, theirs in zip(("input", "weight", "bias"), leaves, ref_leaves, torch_leaves):
        if mine is None:
            continue
        assert mine.grad is not None, f"no gradient for {name}"
        assert mine.grad.dtype == mine.dtype
        # Parameter gradients sum over rows: scale the slack with the number of rows.
        rows = x.numel() // max(1, mine.numel()) if name != "input" else 1
        atol = None if name == "input" else ATOL[dtype] * max(1, rows) ** 0.5
        assert_close_three_way(mine.grad, theirs.grad, ref_leaf.grad, dtype, what=f"grad {name}", atol=atol)


def run_ops(x, weight, bias, dy, eps=1e-5):
    """(out, mean, rstd, dx, dweight, dbias) from the two ops directly. Kept here, where
    the CPU runs it (test_raw_ops_match_reference), though the CUDA-only tests use it most."""
    out, _, mean, rstd = ops.norm_fwd(x, None, weight, bias, eps, True)
    dx, dw, db, _ = ops.norm_bwd(dy, None, x, mean, rstd, weight, bias, True)
    return out, mean, rstd, dx, dw, db


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_raw_ops_match_reference(device, dtype):
    """norm_fwd / norm_bwd called directly, as the CUDA-only tests call them."""
    M, N = 5, 301
    x = random_input((M, N), dtype, device)
    dy = random_input((M, N), dtype, device, scale=1.0, shift=0.0, seed=3)
    weight, bias = make_params((N,), "affine", dtype, device)
    out, mean, rstd, dx, dw, db = run_ops(x, weight, bias, dy)
    leaves = [t.detach().double().requires_grad_() for t in (x, weight, bias)]
    ref = reference.layer_norm(leaves[0], (N,), leaves[1], leaves[2], 1e-5)
    ref.backward(dy.double())
    xd = x.double()
    ref_mean = xd.mean(-1)
    ref_rstd = (xd.var(-1, unbiased=False) + 1e-5).rsqrt()
    assert mean.shape == rstd.shape == (M,)
    torch.testing.assert_close(mean.double(), ref_mean, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rstd.double(), ref_rstd, rtol=1e-5, atol=1e-5)
    for name, got, want in [("out", out, ref), ("grad input", dx, leaves[0].grad),
                            ("grad weight", dw, leaves[1].grad), ("grad bias", db, leaves[2].grad)]:
        assert got.dtype == dtype, name
        atol = ATOL[dtype] * (M ** 0.5 if name in ("grad weight", "grad bias") else 1.0)
        torch.testing.assert_close(got.double(), want, rtol=ATOL[dtype], atol=atol, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N", [301, 1024, 20000])
@pytest.mark.parametrize("centered", [True, False])
def test_raw_backward_forms_only_the_wanted_parameter_gradients(device, dtype, N, centered):
    """norm_bwd's param_grads: a gradient not wanted (a frozen parameter) comes back empty;
    grad_input and the wanted one are bitwise those of the call that forms both. Also a
    16-bit grad_out beside a float32 input (an add op's float32 sum)."""
    M = 6
    cases = [(dtype, dtype)]
    if dtype in (torch.bfloat16, torch.float16):
        cases.append((torch.float32, dtype))
    for x_dtype, dy_dtype in cases:
        x = random_input((M, N), x_dtype, device)
        dy = random_input((M, N), dy_dtype, device, scale=1.0, shift=0.0, seed=3)
        weight, bias = make_params((N,), "affine", dy_dtype, device)
        bias = bias if centered else None
        _, _, mean, rstd = ops.norm_fwd(x, None, None, None, 1e-5, centered)
        full = ops.norm_bwd(dy, None, x, mean, rstd, weight, bias, centered)
        for wanted in ([False, True], [True, False], [False, False]):
            got = ops.norm_bwd(dy, None, x, mean, rstd, weight, bias, centered,
                               param_grads=wanted)
            assert torch.equal(got[0], full[0])
            for want, mine, formed in zip(wanted, got[1:3], full[1:3]):
                if want and formed.numel():
                    assert torch.equal(mine, formed)
                else:
                    assert mine.shape == (0,)
        if device == "cpu" or x_dtype == dtype:
            torch.library.opcheck(ops.norm_bwd.default,
                                  (dy, None, x, mean, rstd, weight, bias, centered),
                                  {"param_grads": [False, True]})


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N", SIZES)
@pytest.mark.parametrize("affine", AFFINE)
def test_matches_reference(device, dtype, N, affine):
    x = random_input((5, N), dtype, device)
    weight, bias = make_params((N,), affine, dtype, device)
    check_forward_backward(x, (N,), weight, bias)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_million_element_row(device, dtype):
    N = 1 << 20
    x = random_input((2, N), dtype, device)
    weight, bias = make_params((N,), "affine", dtype, device)
    check_forward_backward(x, (N,), weight, bias)


def rows_of_output(mib, N, dtype):
    """Rows of N elements of dtype whose output is just over `mib` MiB."""
    return (mib << 20) // (N * dtype.itemsize) + 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("N", [1024, 1000, 1008, 4100, 24, 2048])
@pytest.mark.parametrize("output_mib", [6, 9])
def test_outputs_larger_than_caches(dtype, N, output_mib):
    """Calls that move over 16 MiB (the forward from 8 MiB of output, the backward from
    5.3 MiB of dx): the CPU kernels stream their outputs (non-temporal stores) once the
    pages are mapped, i.e. from the second call on, when the allocator hands back the first
    call's memory; every call must give the same, correct result. The forward streams every
    row over 2 KiB from registers, a row that does not start on a cache line (1000 float32,
    4100) after its first columns up to the line, stored plainly; shorter rows go as the
    backward's. In the backward, rows of whole cache lines (1024; 1008 float32, whose last
    columns are a block that overlaps the one before; every N but 4100 in float64) stream
    from registers and ask for the next tile's dy in its first sweep; short rows that are
    not (1000 float32 and bfloat16) go through a staging copy that streams each row's lines
    out as they fill, long ones (4100) take plain stores. Rows shorter than a line (24)
    share lines with their neighbours, and the threads' chunks of rows meet inside lines.
    bfloat16 rows of 2048 (4 KiB apart) are streamed one row a tile where a vector block is
    half a line (AVX2), two elsewhere."""
    M = rows_of_output(output_mib, N, dtype)
    x = random_input((M, N), dtype, "cpu")
    weight, bias = make_params((N,), "affine", dtype, "cpu")
    for _ in range(3):
        check_forward_backward(x, (N,), weight, bias)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("affine", AFFINE)
def test_multi_dim_normalized_shape(device, dtype, affine):
    x = random_input((2, 3, 3, 4), dtype, device)
    weight, bias = make_params((3, 4), affine, dtype, device)
    check_forward_backward(x, (3, 4), weight, bias)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_float32_params_with_half_input(device, dtype):
    x = random_input((6, 769), dtype, device)
    weight, bias = make_params((769,), "affine", torch.float32, device)
    check_forward_backward(x, (769,), weight, bias)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "layout", ["transposed", "sliced_rows", "sliced_cols", "expanded", "offset_by_one"]
)
def test_strided_inputs(device, dtype, layout):
    base = random_input((24, 66), dtype, device)
    x = {
        "transposed": lambda: base.t()[:, :24],  # [66, 24] with stride (1, 66)
        "sliced_rows": lambda: base[::3],
        "sliced_cols": lambda: base[:, 1:-1],
        "expanded": lambda: base[:1].expand(5, 66),
        "offset_by_one": lambda: base.reshape(-1)[1:1 + 23 * 66].view(23, 66),
    }[layout]()
    N = x.shape[-1]
    weight, bias = make_params((N,), "affine", dtype, device)
    check_forward_backward(x, (N,), weight, bias)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("affine", AFFINE)
def test_empty_batch(device, dtype, affine):
    weight, bias = make_params((33,), affine, dtype, device)
    x = torch.empty(0, 4, 33, dtype=dtype, device=device, requires_grad=True)
    leaves = [p.detach().requires_grad_() if p is not None else None for p in (weight, bias)]
    out = fusednorm.layer_norm(x, (33,), *leaves)
    assert out.shape == x.shape and out.dtype == dtype
    out.sum().backward()
    assert x.grad.shape == x.shape
    for p in leaves:
        if p is not None:
            assert torch.equal(p.grad, torch.zeros_like(p))


@pytest.mark.parametrize("device", DEVICES)
def test_constant_rows_give_bias(device):
    x = torch.full((3, 100), 2.5, device=device)
    x[1] = -7.0
    weight, bias = make_params((100,), "affine", torch.float32, device)
    out = fusednorm.layer_norm(x, (100,), weight, bias)
    torch.testing.assert_close(out, bias.expand(3, 100), rtol=0, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nonfinite_values_stay_in_their_row(device, dtype, bad):
    x = random_input((4, 257), dtype, device)
    x[2, 100] = bad
    out = fusednorm.layer_norm(x, (257,))
    assert torch.isnan(out[2]).all(), "a NaN/inf row normalizes to NaN, as in PyTorch"
    for row in (0, 1, 3):
        assert torch.isfinite(out[row]).all()
    torch.testing.assert_close(out[[0, 1, 3]], F.layer_norm(x[[0, 1, 3]], (257,)))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_nonfinite_params_give_nan_and_inf_where_pytorch_does(device, dtype):
    """The bfloat16 CPU store skips its NaN mask only for rows it proves NaN-free; a NaN or
    infinite weight/bias must still come out as NaN/inf in exactly the columns PyTorch's do."""
    x = random_input((6, 300), dtype, device)
    weight, bias = make_params((300,), "affine", dtype, device)
    weight[5], weight[40], bias[7] = float("inf"), float("-inf"), float("nan")
    out = fusednorm.layer_norm(x, (300,), weight, bias)
    expected = F.layer_norm(x.float(), (300,), weight.float(), bias.float())
    assert torch.equal(torch.isnan(out), torch.isnan(expected))
    assert torch.equal(torch.isinf(out), torch.isinf(expected))
    assert torch.equal(torch.signbit(out[torch.isinf(out)]), torch.signbit(expected[torch.isinf(expected)]))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("where", ["dy", "weight"])
def test_nonfinite_gradients_give_nan_where_pytorch_does(device, dtype, where):
    """Backward with a NaN in dy (its row of dx, and a column of dweight, become NaN) or in
    the weight (all of dx): NaN exactly where PyTorch's float32 backward has them (the bfloat16
    CPU store drops its NaN mask only where no NaN can be mis-rounded). (An infinite weight
    would make inf - inf, NaN or not by the order of operations: no pattern to compare.)"""
    x = random_input((9, 300), dtype, device).requires_grad_()
    weight, bias = (p.requires_grad_() for p in make_params((300,), "affine", dtype, device))
    dy = random_input((9, 300), dtype, device, seed=5)
    if where == "dy":
        dy[4, 17] = float("nan")
    else:
        with torch.no_grad():
            weight[23] = float("nan")
    grads = torch.autograd.grad(fusednorm.layer_norm(x, (300,), weight, bias), (x, weight, bias), dy)
    leaves = [t.detach().float().requires_grad_() for t in (x, weight, bias)]
    expected = torch.autograd.grad(F.layer_norm(leaves[0], (300,), leaves[1], leaves[2]),
                                   leaves, dy.float())
    assert torch.isnan(expected[0]).any(), "the test must make NaNs"
    for name, got, want in zip(("dx", "dweight", "dbias"), grads, expected):
        assert torch.equal(torch.isnan(got), torch.isnan(want)), name
        finite = torch.isfinite(want)
        if finite.any():
            torch.testing.assert_close(got[finite].float(), want[finite],
                                       rtol=0.05, atol=0.05 * want[finite].abs().max().item())


BF16_SMALLEST_NORMAL = 2.0 ** -126
BF16_DENORMAL_STEP = 2.0 ** -133  # spacing of bfloat16's denormals


@pytest.mark.parametrize("device", DEVICES)
def test_bfloat16_denormal_outputs_are_kept_not_flushed(device):
    """Outputs and input gradients below bfloat16's smallest normal value come out as the
    denormals of PyTorch's conversion: AVX512_BF16's one-instruction rounding (the CPU store
    where the CPU has it) flushes denormals to zero, so blocks holding any must not use it."""
    x = random_input((6, 300), torch.bfloat16, device).requires_grad_()
    weight = torch.full((300,), 3e-39, device=device)  # |y| = |xhat| * 3e-39: denormal
    out = fusednorm.layer_norm(x, (300,), weight)
    leaf = x.detach().float().requires_grad_()
    expected = F.layer_norm(leaf, (300,), weight)
    assert (expected.abs() < BF16_SMALLEST_NORMAL).all() and (expected != 0).float().mean() > 0.9
    torch.testing.assert_close(out.float(), expected.to(torch.bfloat16).float(), rtol=0,
                               atol=BF16_DENORMAL_STEP)
    # dx = rstd * (dy - mean(dy) - xhat * mean(dy xhat)) for a dy of denormals: denormal too.
    dy = (random_input((6, 300), torch.float32, device, seed=3) * 1e-39).to(torch.bfloat16)
    (dx,) = torch.autograd.grad(fusednorm.layer_norm(x, (300,)), x, dy)
    (want,) = torch.autograd.grad(F.layer_norm(leaf, (300,)), leaf, dy.float())
    assert (want.abs() < BF16_SMALLEST_NORMAL).all() and (want != 0).float().mean() > 0.9
    torch.testing.assert_close(dx.float(), want.to(torch.bfloat16).float(), rtol=0,
                               atol=2 * BF16_DENORMAL_STEP)


@pytest.mark.parametrize("device", DEVICES)
def test_bfloat16_nan_outputs_are_a_canonical_nan(device):
    """NaN outputs (a row with a NaN input, a column with a NaN weight) are one canonical
    bfloat16 NaN, the one PyTorch writes on that device. CPU: 0x7fc0 as c10::BFloat16's
    integer rounding writes it (the AVX-512 build) or 0xffff as ATen's vectorized conversion
    writes it (the AVX2 build); AVX512_BF16's instruction would instead keep the sign of the
    -NaN that x86 arithmetic propagates (0xffc0), so a CPU store that used it on NaN lanes
    fails here. CUDA: the cvt instruction's canonical NaN, 0x7fff, which c10::BFloat16 and so
    PyTorch's own CUDA kernels write (the H200 run of 2026-11-26 showed fusednorm writes it)."""
    x = random_input((4, 300), torch.bfloat16, device)
    x[1, 7] = -float("nan")
    weight = torch.randn(300, device=device)
    weight[9] = -float("nan")
    out = fusednorm.layer_norm(x, (300,), weight, torch.randn(300, device=device)).view(torch.int16)
    nan_bits = torch.cat([out[1], out[:, 9]]).unique().tolist()
    if torch.device(device).type == "cuda":
        signed_nans = torch.tensor([float("nan"), -float("nan")], device=device)
        canonical = set(signed_nans.to(torch.bfloat16).view(torch.int16).tolist())
        assert len(canonical) == 1, "PyTorch's CUDA conversion keeps the NaN's sign"
    else:
        canonical = {0x7FC0, -1}
    assert len(nan_bits) == 1 and nan_bits[0] in canonical, [hex(b & 0xFFFF) for b in nan_bits]
    assert torch.isfinite(out.view(torch.bfloat16)[[0, 2, 3]][:, [c for c in range(300) if c != 9]]).all()


@pytest.mark.parametrize("device", DEVICES)
def test_bfloat16_outputs_round_to_infinity_past_the_largest_value(device):
    """Finite parameters so large that y overflows: infinities, not NaN; below the overflow,
    the same rounding as PyTorch's float -> bfloat16 conversion."""
    x = random_input((5, 203), torch.bfloat16, device)
    weight = torch.full((203,), 3.0e38, device=device)
    weight[::2] = 1.0e38  # |y| of both sides of bfloat16's largest value (3.39e38)
    out = fusednorm.layer_norm(x, (203,), weight)
    expected = F.layer_norm(x.float(), (203,), weight).to(torch.bfloat16)
    assert not torch.isnan(out).any()
    assert torch.isinf(out).any() and torch.isfinite(out).any(), "the test must cross the overflow"
    torch.testing.assert_close(out, expected, rtol=1.6e-2, atol=0)
    assert torch.equal(torch.isinf(out), torch.isinf(expected))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("N", [1000, 4096])
@pytest.mark.parametrize("kind", ["layer_norm", "rms_norm"])
def test_16_bit_outputs_and_input_grads_round_to_nearest(device, dtype, N, kind):
    """y and dx are their float values rounded to the nearest 16-bit value: they equal the
    float64 reference rounded to the dtype except where it lies within the float32 math's
    error of a rounding boundary (measured: under 0.1% of elements), never further than one
    step beyond that error. A store that truncated misses about half of them; one that
    widened or narrowed a block's lanes out of order, nearly all.

    The float32 error is relative to the terms that cancel into a value, not to the value:
    y = xhat * w + b near zero (xhat * w ~ -b ~ 1) is a few float32 roundings of 1 off,
    more than a step of its own 16-bit magnitude (seen with AVX-512's statistics, whose
    lanes sum the row in another order than AVX2's)."""
    x = random_input((33, N), dtype, device, seed=5).requires_grad_()
    g = torch.Generator().manual_seed(2)
    weight = torch.randn(N, generator=g).to(device=device, dtype=dtype)
    bias = torch.randn(N, generator=g).to(device=device, dtype=dtype)
    dy = random_input((33, N), dtype, device, seed=6)
    x64 = x.detach().double().requires_grad_()
    if kind == "layer_norm":
        out = fusednorm.layer_norm(x, (N,), weight, bias)
        want = reference.layer_norm(x64, (N,), weight.double(), bias.double())
    else:
        out = fusednorm.rms_norm(x, (N,), weight)
        want = reference.rms_norm(x64, (N,), weight.double(), eps=reference.rms_eps(dtype))
    (dx,) = torch.autograd.grad(out, x, dy)
    (want_dx,) = torch.autograd.grad(want, x64, dy.double())
    scales = float32_terms(x.detach().double(), weight.double(), bias.double(), dy.double(),
                           centered=kind == "layer_norm",
                           eps=1e-5 if kind == "layer_norm" else reference.rms_eps(dtype))
    for name, got, exact, scale in (("y", out, want, scales[0]), ("dx", dx, want_dx, scales[1])):
        nearest = exact.to(dtype)
        equal = (got == nearest).double().mean().item()
        assert equal >= 0.995, f"{name}: {equal:.4f} of the elements are the nearest value"
        step = torch.finfo(dtype).eps * nearest.double().abs().clamp_min(torch.finfo(dtype).tiny)
        float32_error = 16 * torch.finfo(torch.float32).eps / 2 * scale
        assert ((got.double() - nearest.double()).abs() <= step + float32_error).all(), name


def float32_terms(x, weight, bias, dy, centered, eps=1e-5):
    """Per element, the sum of the magnitudes of the terms a norm's y and dx are formed
    from (float64): |xhat * w| + |b|, and rstd * (|g| + |mean(g)| + |xhat * mean(g * xhat)|)
    with g = dy * w (LayerNorm; RMSNorm: no mean terms, no bias). Float32 math errs by a
    few roundings of these, whatever the result's own magnitude after they cancel."""
    mean = x.mean(-1, keepdim=True) if centered else torch.zeros_like(x[..., :1])
    rstd = ((x - mean).square().mean(-1, keepdim=True) + eps).rsqrt()
    xhat = (x - mean) * rstd
    g = dy * weight
    g_mean = g.mean(-1, keepdim=True) if centered else torch.zeros_like(mean)
    y_terms = (xhat * weight).abs() + (bias.abs() if centered else 0)
    dx_terms = rstd * (g.abs() + g_mean.abs() + (xhat * (g * xhat).mean(-1, keepdim=True)).abs())
    return y_terms, dx_terms


def rows_streamed_from_the_second_call(N, dtype, device):
    """CPU: rows enough for 9 MiB of output, so that a forward moves over 16 MiB and, its
    pages mapped, streams its output from the second call on (as
    test_outputs_larger_than_caches); elsewhere a few."""
    return rows_of_output(9, N, dtype) if device == "cpu" else 33


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("N", [7, 1000, 2048, 4099])
@pytest.mark.parametrize("weight_kind", ["zero", "zero_but_one_infinite"])
@pytest.mark.parametrize("op", ["layer_norm", "add_layer_norm", "add_layer_norm_float32_sum"])
def test_16_bit_outputs_round_ties_to_even(device, dtype, N, weight_kind, op):
    """y = xhat * 0 + bias is bias exactly, so a float32 bias halfway between two 16-bit
    values must come out as the even one of them, in every column, as PyTorch converts.
    Random data almost never meets a tie, so test_16_bit_outputs_and_input_grads_round_to_nearest
    cannot tell this from rounding ties away from zero, which misses half of them here.
    Every other band of 64 columns holds ties between denormals (those a conversion that
    flushes them, as AVX512_BF16's instruction, would get wrong). An infinite weight in
    column 0 puts every row on bfloat16's NaN-masked rounding (the CPU rounds finite rows
    without the mask); the other columns stay ties. The add ops normalize their sum, of the
    input's dtype or float32 (residual_dtype), through their own instantiations."""
    mid, even = halfway_pairs((N,), dtype, seed=N)
    tiny_mid, tiny_even = halfway_pairs((N,), dtype, seed=N + 1,
                                        scale=2 * torch.finfo(dtype).tiny)
    denormal_band = torch.arange(N) // 64 % 2 == 1
    mid = torch.where(denormal_band, tiny_mid, mid)
    even = torch.where(denormal_band, tiny_even, even)
    weight = torch.zeros(N)
    columns = slice(None)
    if weight_kind == "zero_but_one_infinite":
        weight[0] = float("inf")
        columns = slice(1, None)
    M = rows_streamed_from_the_second_call(N, dtype, device)
    x = random_input((M, N), dtype, device)
    residual = random_input((M, N), dtype, device, seed=1)
    weight, mid, even = weight.to(device), mid.to(device), even.to(device)
    for call in range(2):
        if op == "layer_norm":
            y = fusednorm.layer_norm(x, (N,), weight, mid)
        else:
            sum_dtype = torch.float32 if op == "add_layer_norm_float32_sum" else None
            y, _ = fusednorm.add_layer_norm(x, residual, (N,), weight, mid,
                                            residual_dtype=sum_dtype)
        wrong = (y[:, columns] != even[columns]).sum().item()
        assert wrong == 0, f"call {call}: {wrong} of {y[:, columns].numel()} ties not even"


@pytest.mark.parametrize("device", DEVICES)
def test_large_mean_small_variance(device):
    """Welford keeps precision where sum/sum-of-squares would cancel catastrophically."""
    x = (1e4 + random_input((8, 4096), torch.float64, device, scale=1e-2, shift=0.0)).float()
    ref = reference.layer_norm(x, (4096,))
    out = fusednorm.layer_norm(x, (4096,))
    assert_close_three_way(out, F.layer_norm(x, (4096,)), ref, torch.float32)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,offset", [(torch.float16, 2000.0), (torch.bfloat16, 300.0)])
def test_large_mean_16_bit_forward_and_backward(device, dtype, offset):
    """16-bit rows whose mean is 100-200 sigma from zero (as far as the dtype still resolves
    the spread in tens of steps): the kernels' fma forms of (x - mean) * rstd hold the
    three-way bound in the output and every gradient."""
    x = random_input((6, 1000), torch.float64, device, scale=offset / 150, shift=offset)
    weight, bias = make_params((1000,), "affine", dtype, device)
    check_forward_backward(x.to(dtype), (1000,), weight, bias)


def relative_errors_of_gradients(x, seed=3):
    """Each gradient's largest error against float64, over its largest value."""
    N = x.shape[-1]
    weight = random_input((N,), torch.float32, x.device, scale=1.0, shift=1.0, seed=seed)
    bias = random_input((N,), torch.float32, x.device, scale=1.0, shift=0.0, seed=seed + 1)
    grad = random_input(x.shape, torch.float32, x.device, scale=1.0, shift=0.0, seed=seed + 2)
    leaves = [t.detach().clone().requires_grad_() for t in (x, weight, bias)]
    ref_leaves = [t.detach().double().requires_grad_() for t in (x, weight, bias)]
    fusednorm.layer_norm(leaves[0], (N,), leaves[1], leaves[2]).backward(grad)
    reference.layer_norm(ref_leaves[0], (N,), ref_leaves[1], ref_leaves[2]).backward(grad.double())
    return relative_errors([m.grad for m in leaves], [r.grad for r in ref_leaves])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("N", [3, 24, 1000, 1023, 4096])
def test_backward_far_from_zero_as_exact_as_near_it(device, N):
    """float32 rows 1e2 and 1e4 sigma from zero: every gradient as close to float64 as for the
    same rows at zero. The saved mean is a float; the xhat a backward forms from it are all
    off by its rounding (up to 4.9e-4 of sigma at 1e4), which PyTorch's gradients carry
    (benchmarks.accuracy_far_rows) and fusednorm's backward removes (their mean over the
    row)."""
    noise = random_input((16, N), torch.float64, device, scale=1.0, shift=0.0, seed=11)
    near = relative_errors_of_gradients(noise.float())
    for offset in (1e2, 1e4):
        far = relative_errors_of_gradients((noise + offset).float())
        assert_far_as_exact_as_near(far, near, ("input", "weight", "bias"),
                                    f", rows {offset:g} from zero")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N", [100, 1000, 1023])
@pytest.mark.parametrize("layout", ["tail_far", "first_far", "both_far"])
def test_statistics_when_the_row_end_or_start_sits_apart(device, dtype, N, layout):
    """The CPU statistics take a row's last columns (under one vector step) in with one pass
    around the mean of the rest; the CPU and CUDA statistics shift every value by one of the
    row's own (the median of its first three): rows whose last 60 values sit 50 sigma from
    the rest, or whose first value sits 1000 sigma away (an outlier feature), or both, keep
    the three-way bound. (Shifted by its first value, such a row lost 2^-24 of that distance
    in every output: 100x PyTorch's error.)"""
    x = random_input((4, N), torch.float64, device, scale=1.0, shift=0.0)
    if layout in ("tail_far", "both_far"):
        x[:, -60:] += 50.0
    if layout in ("first_far", "both_far"):
        x[:, 0] -= 1000.0
    weight, bias = make_params((N,), "affine", dtype, device)
    check_forward_backward(x.to(dtype), (N,), weight, bias)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("eps", [0.0, 1e-12, 0.5])
def test_eps(device, eps):
    x = random_input((3, 50), torch.float64, device)
    torch.testing.assert_close(
        fusednorm.layer_norm(x, (50,), eps=eps), F.layer_norm(x, (50,), eps=eps)
    )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("affine", AFFINE)
def test_gradcheck_and_gradgradcheck(device, affine):
    x = random_input((3, 2, 11), torch.float64, device).requires_grad_()
    weight, bias = make_params((2, 11), affine, torch.float64, device)
    params = [p.requires_grad_() for p in (weight, bias) if p is not None]

    def fn(x, *params):
        w = params[0] if affine != "none" else None
        b = params[1] if affine == "affine" else None
        return fusednorm.layer_norm(x, (2, 11), w, b, 1e-5)

    assert torch.autograd.gradcheck(fn, (x, *params))
    assert torch.autograd.gradgradcheck(fn, (x, *params))


@pytest.mark.parametrize("device", DEVICES)
def test_statistics_saved_by_function(device):
    x = random_input((4, 9), torch.float32, device)
    out, mean, rstd = fusednorm.FusedLayerNormFunction.apply(x, (9,), None, None, 1e-5)
    torch.testing.assert_close(mean, x.mean(-1))
    torch.testing.assert_close(rstd, torch.rsqrt(x.var(-1, unbiased=False) + 1e-5))
    assert mean.dtype == rstd.dtype == torch.float32


@pytest.mark.parametrize("device", DEVICES)
def test_backward_is_deterministic(device):
    x = random_input((1000, 300), torch.float32, device).requires_grad_()
    weight, bias = (p.requires_grad_() for p in make_params((300,), "affine", torch.float32, device))
    grad = random_input((1000, 300), torch.float32, device, seed=3)
    grads = []
    for _ in range(2):
        torch.autograd.backward(fusednorm.layer_norm(x, (300,), weight, bias), grad)
        grads.append([t.grad.clone() for t in (x, weight, bias)])
        for t in (x, weight, bias):
            t.grad = None
    for a, b in zip(*grads):
        assert torch.equal(a, b)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backward_deterministic_across_thread_counts(device, dtype):
    if device != "cpu":
        pytest.skip("thread count is a CPU notion")
    x = random_input((257, 129), dtype, device).requires_grad_()
    weight, bias = (p.requires_grad_() for p in make_params((129,), "affine", dtype, device))
    results = []
    old = torch.get_num_threads()
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            out = fusednorm.layer_norm(x, (129,), weight, bias)
            results.append(torch.autograd.grad(out.sum(), (x, weight, bias)))
    finally:
        torch.set_num_threads(old)
    for other in results[1:]:  # 3 threads on 2 cores: chunks taken in a varying order
        for a, b in zip(results[0], other):
            assert torch.equal(a, b)


@pytest.mark.parametrize("device", DEVICES)
def test_zero_width_rows(device):
    x = torch.randn(3, 2, 0, device=device, requires_grad=True)
    weight = torch.ones(2, 0, device=device, requires_grad=True)
    out = fusednorm.layer_norm(x, (2, 0), weight)
    assert out.shape == x.shape
    out.sum().backward()
    assert x.grad.shape == x.shape and weight.grad.shape == weight.shape
