"""CUDA-only LayerNorm tests: every kernel path (16-byte packs, one-element packs for
misaligned data, chunked long rows) against the float64 reference, many rows and more than
2^31 elements, CUDA graphs, run-to-run determinism, torch.compile, opcheck, CPU/CUDA
agreement. Skipped without a GPU; the device-generic cases are in test_layer_norm.py.

Tests marked `sanitize` are the representative subset that tests/sanitize.sh runs under
compute-sanitizer.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import fusednorm
from fusednorm import reference
from conftest import HAS_CUDA, assert_close_three_way, random_input, torch_layer_norm
from test_layer_norm import check_forward_backward, make_params, run_ops

pytestmark = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")

ops = torch.ops.fusednorm
DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
HALF_DTYPES = [torch.bfloat16, torch.float16]
# Odd sizes and the bucket edges; 65537 and 262144 are split into chunks.
SIZES = [1, 7, 769, 1023, 5125, 65537, 262144]
# Which parameters are present.
AFFINE = ["affine", "weight_only", "bias_only", "none"]


@pytest.fixture(autouse=True)
def nan_filled_allocator():
    """Leaves NaN in the caching allocator's free blocks, so that an output element a kernel
    forgot to write (they come from torch.empty) fails the comparison instead of holding an
    old, plausible value."""
    if HAS_CUDA:
        for numel in (64 << 20, 1 << 17, 1 << 17, 1 << 12, 1 << 12):
            torch.full((numel,), float("nan"), device="cuda")
    yield


def rows_for(N: int) -> int:
    """Enough rows to exercise the row loops, few enough to keep a case fast."""
    return max(3, min(512, (1 << 18) // max(N, 1)))


def params(N, affine, dtype, device="cuda"):
    """(weight, bias) for the AFFINE cases, via test_layer_norm.make_params."""
    if affine == "bias_only":
        _, bias = make_params((N,), "affine", dtype, device)
        return None, bias
    return make_params((N,), affine, dtype, device)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N", SIZES)
@pytest.mark.parametrize("affine", AFFINE)
def test_matches_reference(dtype, N, affine):
    x = random_input((rows_for(N), N), dtype, "cuda")
    weight, bias = params(N, affine, dtype)
    check_forward_backward(x, (N,), weight, bias)


@pytest.mark.parametrize("dtype", HALF_DTYPES)
@pytest.mark.parametrize("N", SIZES)
@pytest.mark.parametrize("affine", ["affine", "weight_only"])
def test_float32_params(dtype, N, affine):
    x = random_input((rows_for(N), N), dtype, "cuda")
    weight, bias = params(N, affine, torch.float32)
    check_forward_backward(x, (N,), weight, bias)


# One shape per kernel path and block layout: (N, dtype). With M = 5 rows, and float32
# parameters for the 16-bit inputs.
REPRESENTATIVE = [
    (64, torch.float32),       # packs of 4, a warp per row, 4 rows per block
    (1024, torch.bfloat16),    # packs of 8, a warp per row
    (2048, torch.float32),     # 2 warps per row, 2 rows per block
    (8192, torch.float16),     # a block per row
    (32768, torch.bfloat16),   # the largest forward bucket; backward in 4 chunks
    (4096, torch.float64),     # packs of 2
    (1000, torch.float16),     # N not a multiple of the pack: one-element packs
    (40000, torch.float32),    # chunked forward and backward
    (70001, torch.float16),    # chunked, one-element packs
    (3, torch.float32),        # fewer elements than a warp
]


@pytest.mark.sanitize
@pytest.mark.parametrize("N, dtype", REPRESENTATIVE)
@pytest.mark.parametrize("affine", ["affine", "none"])
def test_representative_paths(N, dtype, affine):
    param_dtype = torch.float32 if dtype in HALF_DTYPES else dtype
    x = random_input((5, N), dtype, "cuda")
    weight, bias = params(N, affine, param_dtype)
    check_forward_backward(x, (N,), weight, bias)


@pytest.mark.parametrize("N, dtype", [(64, torch.float32), (1000, torch.bfloat16), (4096, torch.float16)])
def test_many_rows(N, dtype):
    """More rows than any grid holds: every block strides over many rows, and the weight
    gradient sums hundreds of per-block partials."""
    M = (1 << 16) + 3
    param_dtype = torch.float32 if dtype in HALF_DTYPES else dtype
    x = random_input((M, N), dtype, "cuda")
    weight, bias = params(N, "affine", param_dtype)
    check_forward_backward(x, (N,), weight, bias)


def _free_gpu_bytes():
    free, _total = torch.cuda.mem_get_info()
    return free


@pytest.mark.slow
def test_more_than_2_31_elements():
    """int64 offsets: a bf16 [2^19 + 1, 4096] input (2^31 + 4096 elements). Checked on the
    first, middle and last rows; the parameter gradients (sums over all rows) against a
    float64 sum taken in slices."""
    M, N = (1 << 19) + 1, 4096
    need = 4 * M * N * 2 + (3 << 30)  # x, dy, out, dx in bf16, and float64 slices
    if _free_gpu_bytes() < need:
        pytest.skip(f"needs {need / 2**30:.0f} GiB of free GPU memory")
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(M, N, device="cuda", generator=g, dtype=torch.bfloat16).mul_(3).add_(1)
    dy = torch.randn(M, N, device="cuda", generator=g, dtype=torch.bfloat16)
    weight = torch.randn(N, device="cuda", generator=g) + 1
    bias = torch.randn(N, device="cuda", generator=g)
    out, mean, rstd, dx, dw, db = run_ops(x, weight, bias, dy)
    assert x.numel() > 2**31

    rows = torch.tensor([0, 1, M // 2, M - 2, M - 1], device="cuda")
    xr, dyr = x[rows].double(), dy[rows].double()
    xr.requires_grad_()
    w64 = weight.double().requires_grad_()
    b64 = bias.double().requires_grad_()
    ref = reference.layer_norm(xr, (N,), w64, b64, 1e-5)
    torch.autograd.backward(ref, dyr)
    expected = torch_layer_norm(x[rows], (N,), weight, bias)
    assert_close_three_way(out[rows], expected, ref.detach(), torch.bfloat16)
    torch.testing.assert_close(mean[rows].double(), xr.detach().mean(-1), rtol=1e-5, atol=1e-5)
    xr_grad = xr.grad
    xt = x[rows].detach().requires_grad_()
    torch.autograd.backward(torch_layer_norm(xt, (N,), weight, bias), dy[rows])
    assert_close_three_way(dx[rows], xt.grad, xr_grad, torch.bfloat16, what="grad input")

    ref_dw = torch.zeros(N, dtype=torch.float64, device="cuda")
    ref_db = torch.zeros(N, dtype=torch.float64, device="cuda")
    for start in range(0, M, 1 << 14):
        xs = x[start:start + (1 << 14)].double()
        dys = dy[start:start + (1 << 14)].double()
        xhat = (xs - xs.mean(-1, keepdim=True)) * torch.rsqrt(xs.var(-1, unbiased=False, keepdim=True) + 1e-5)
        ref_dw += (dys * xhat).sum(0)
        ref_db += dys.sum(0)
        del xs, dys, xhat
    scale = math.sqrt(M)
    torch.testing.assert_close(dw.double(), ref_dw, rtol=1e-4, atol=1e-4 * scale)
    torch.testing.assert_close(db.double(), ref_db, rtol=1e-4, atol=1e-4 * scale)


def _misaligned(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of t whose data starts one element past an aligned allocation."""
    flat = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)[1:]
    return flat.view(t.shape).copy_(t)


@pytest.mark.sanitize
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N", [64, 1024, 8192, 40000])
@pytest.mark.parametrize("which", ["input", "grad_out", "weight"])
def test_misaligned_tensors(dtype, N, which):
    """A tensor whose data pointer is one element off 16 bytes takes the one-element-pack
    kernels; results match the reference and, closely, the aligned kernels."""
    M = 6
    x = random_input((M, N), dtype, "cuda")
    dy = random_input((M, N), dtype, "cuda", scale=1.0, shift=0.0, seed=3)
    weight, bias = make_params((N,), "affine", dtype, "cuda")
    aligned = run_ops(x, weight, bias, dy)
    if which == "input":
        x = _misaligned(x)
    elif which == "grad_out":
        dy = _misaligned(dy)
    else:
        weight = _misaligned(weight)
    for t in (x, dy, weight):
        assert t.is_contiguous()
    assert {"input": x, "grad_out": dy, "weight": weight}[which].data_ptr() % 16 != 0
    got = run_ops(x, weight, bias, dy)
    names = ["out", "mean", "rstd", "grad input", "grad weight", "grad bias"]
    for name, a, b in zip(names, got, aligned):
        torch.testing.assert_close(a, b, msg=lambda m: f"{name}: {m}")
    check_forward_backward(x, (N,), weight, bias)


CAPTURE_CASES = [
    (1024, torch.bfloat16, torch.float32),  # packs, a warp per row
    (5125, torch.float16, torch.float16),   # one-element packs
    (65537, torch.float32, torch.float32),  # chunked: workspace buffers inside the graph
]


@pytest.mark.parametrize("N, dtype, param_dtype", CAPTURE_CASES)
def test_cuda_graph_capture_and_replay(N, dtype, param_dtype):
    """Forward and backward captured in one graph and replayed on new data give the same
    bits as eager calls (no host synchronisation, no allocation outside the allocator)."""
    M = 7
    x = random_input((M, N), dtype, "cuda")
    dy = random_input((M, N), dtype, "cuda", scale=1.0, shift=0.0, seed=4)
    weight, bias = make_params((N,), "affine", param_dtype, "cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # warm-up: occupancy queries, allocator
            run_ops(x, weight, bias, dy)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = run_ops(x, weight, bias, dy)
    for seed in (10, 11):
        x.copy_(random_input((M, N), dtype, "cuda", seed=seed))
        dy.copy_(random_input((M, N), dtype, "cuda", scale=1.0, shift=0.0, seed=seed + 100))
        graph.replay()
        eager = run_ops(x, weight, bias, dy)
        for a, b in zip(captured, eager):
            assert torch.equal(a, b)


def test_graphed_module_forward_backward():
    """torch.cuda.make_graphed_callables over a FusedLayerNorm: autograd through replays."""
    module = fusednorm.FusedLayerNorm(768, device="cuda")
    x = random_input((16, 768), torch.float32, "cuda").requires_grad_()
    graphed = torch.cuda.make_graphed_callables(module, (x,))
    for seed in (1, 2):
        x_new = random_input((16, 768), torch.float32, "cuda", seed=seed).requires_grad_()
        dy = random_input((16, 768), torch.float32, "cuda", scale=1.0, shift=0.0, seed=seed + 9)
        out = graphed(x_new)
        out.backward(dy)
        grads = (x_new.grad, module.weight.grad.clone(), module.bias.grad.clone())
        module.zero_grad()
        x_ref = x_new.detach().requires_grad_()
        fusednorm.layer_norm(x_ref, (768,), module.weight, module.bias).backward(dy)
        for a, b in zip(grads, (x_ref.grad, module.weight.grad, module.bias.grad)):
            assert torch.equal(a, b)
        module.zero_grad()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M, N", [(4097, 768), (300, 5125), (9, 65537)])
def test_bitwise_deterministic(dtype, M, N):
    """Two runs give the same bits: fixed reduction orders, no float atomics."""
    param_dtype = torch.float32 if dtype in HALF_DTYPES else dtype
    x = random_input((M, N), dtype, "cuda")
    dy = random_input((M, N), dtype, "cuda", scale=1.0, shift=0.0, seed=6)
    weight, bias = make_params((N,), "affine", param_dtype, "cuda")
    first = run_ops(x, weight, bias, dy)
    second = run_ops(x, weight, bias, dy)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def test_compile_fullgraph_mixed_precision():
    """torch.compile(fullgraph=True) of a bf16 model with float32 LayerNorm parameters calls
    the CUDA ops and matches eager, forward and backward."""
    torch._dynamo.reset()
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 1024), fusednorm.FusedLayerNorm(1024), torch.nn.Linear(1024, 64)
    ).cuda()
    model[0].to(torch.bfloat16)
    model[2].to(torch.bfloat16)
    compiled = torch.compile(model, fullgraph=True)
    x = random_input((33, 64), torch.bfloat16, "cuda")
    eager_out = model(x)
    eager_grads = torch.autograd.grad(eager_out.float().square().sum(), list(model.parameters()))
    out = compiled(x)
    grads = torch.autograd.grad(out.float().square().sum(), list(model.parameters()))
    # Inductor may order the surrounding bf16 work differently: bf16-level agreement.
    torch.testing.assert_close(out, eager_out, rtol=2e-2, atol=2e-2)
    for a, b in zip(grads, eager_grads):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("M, N", [(6, 64), (5, 37), (3, 40000)])
@pytest.mark.parametrize(
    "dtype, param_dtype",
    [(torch.float32, torch.float32), (torch.float64, torch.float64),
     (torch.bfloat16, torch.float32), (torch.float16, torch.float16)],
)
def test_opcheck(M, N, dtype, param_dtype):
    x = random_input((M, N), dtype, "cuda")
    w = random_input((N,), param_dtype, "cuda", seed=1)
    b = random_input((N,), param_dtype, "cuda", seed=2)
    for weight, bias in [(w, b), (w, None), (None, b), (None, None)]:
        torch.library.opcheck(ops.norm_fwd.default, (x, None, weight, bias, 1e-5, True))
        out, _, mean, rstd = ops.norm_fwd(x, None, weight, bias, 1e-5, True)
        dy = random_input((M, N), dtype, "cuda", seed=5)
        torch.library.opcheck(ops.norm_bwd.default, (dy, None, x, mean, rstd, weight, bias, True))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N", [7, 1024, 5125, 65537])
def test_cpu_and_cuda_agree(dtype, N):
    M = 9
    param_dtype = torch.float32 if dtype in HALF_DTYPES else dtype
    x = random_input((M, N), dtype, "cpu")
    dy = random_input((M, N), dtype, "cpu", scale=1.0, shift=0.0, seed=8)
    weight, bias = make_params((N,), "affine", param_dtype, "cpu")
    on_cpu = run_ops(x, weight, bias, dy)
    on_cuda = run_ops(*(t.cuda() for t in (x, weight, bias, dy)))
    names = ["out", "mean", "rstd", "grad input", "grad weight", "grad bias"]
    for name, a, b in zip(names, on_cpu, on_cuda):
        assert b.device.type == "cuda" and a.dtype == b.dtype and a.shape == b.shape
        # Both round once from float32 (float64) math: at most a unit in the last place
        # of the output dtype apart, plus the accumulation order's rounding.
        tol = {torch.float64: 1e-10, torch.float32: 2e-5, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}[a.dtype]
        scale = math.sqrt(M) if name.startswith("grad weight") or name.startswith("grad bias") else 1.0
        torch.testing.assert_close(b.cpu(), a, rtol=tol, atol=tol * scale, msg=lambda m: f"{name}: {m}")


def test_side_stream_and_device_guard():
    """Work goes to the current stream of the input's device."""
    x = random_input((64, 1024), torch.float32, "cuda")
    expected = ops.norm_fwd(x, None, None, None, 1e-5, True)[0]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        out = ops.norm_fwd(x, None, None, None, 1e-5, True)[0]
    torch.cuda.current_stream().wait_stream(side)
    assert torch.equal(out, expected)
    if torch.cuda.device_count() > 1:
        x1 = x.to("cuda:1")
        with torch.cuda.device(0):
            out1 = ops.norm_fwd(x1, None, None, None, 1e-5, True)[0]
        assert out1.device == x1.device
        assert torch.equal(out1.cpu(), expected.cpu())


@pytest.mark.parametrize(
    "call, pattern",
    [
        (lambda x: ops.norm_fwd(x, None, torch.ones(8), None, 1e-5, True), "weight is on cpu"),
        (lambda x: ops.norm_fwd(x, None, None, torch.ones(8), 1e-5, True), "bias is on cpu"),
        (lambda x: ops.norm_bwd(x, None, x, torch.zeros(4), torch.ones(4, device="cuda"), None, None, True), "mean"),
        (lambda x: ops.norm_bwd(x.cpu(), None, x, torch.zeros(4, device="cuda"), torch.ones(4, device="cuda"), None, None, True), "grad_out"),
    ],
)
def test_device_mismatch_errors(call, pattern):
    with pytest.raises(RuntimeError, match=pattern):
        call(torch.randn(4, 8, device="cuda"))
