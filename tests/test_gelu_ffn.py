"""GELU feed-forward block (fusednorm.gelu_ffn, FusedGeluFFN) and the pre-LN sub-block
(FusedLayerNormGeluFFN): results and gradients against eager PyTorch modules with the same
weights, judged against a float64 reference; ops, compile, memory, errors."""
from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

import fusednorm
from fusednorm import reference

from conftest import (ATOL, DEVICES, DTYPES, HAS_CUDA, RecordingBackend, assert_close_three_way,
                      assert_far_as_exact_as_near, random_input, relative_errors)

APPROXIMATE = ["none", "tanh"]
# (batch shape, d_model, hidden): odd sizes (partial last blocks, unaligned rows), a 3-D input,
# sizes that take the vectorized / cuBLASLt-epilogue paths, and two that the CPU kernels
# run in chunks: 1200 x 4096 in three forward chunks of 400 rows and backward chunks of
# 1408, 1408 and 1280 hidden columns; 300 x 777 in backward chunks of 448 and 329 columns
# (an odd, unaligned last chunk).
SHAPES = [((5,), 7, 33), ((4, 9), 16, 64), ((70,), 64, 256), ((1200,), 24, 4096),
          ((3, 100), 24, 777)]

needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")


def _param(shape, fan_in, generator):
    """nn.Linear's default initialisation, U(-1/sqrt(fan_in), 1/sqrt(fan_in)), in float64."""
    return (torch.rand(shape, generator=generator, dtype=torch.float64) * 2 - 1) / math.sqrt(fan_in)


def _ffn_module_pair(d, hidden, bias, approximate, dtype, device, seed=0):
    """A FusedGeluFFN and the eager nn.Sequential(Linear, GELU, Linear) with equal weights."""
    fused = fusednorm.FusedGeluFFN(d, hidden, bias=bias, approximate=approximate)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for linear, fan_in in ((fused.fc1, d), (fused.fc2, hidden)):
            linear.weight.copy_(_param(linear.weight.shape, fan_in, g))
            if bias:
                linear.bias.copy_(_param(linear.bias.shape, fan_in, g))
    fused = fused.to(device=device, dtype=dtype)
    eager = nn.Sequential(
        copy.deepcopy(fused.fc1), nn.GELU(approximate=approximate), copy.deepcopy(fused.fc2)
    )
    return fused, eager


def _params(module: nn.Module) -> list[torch.Tensor]:
    return [p for p in module.parameters()]


def _grads(out, inputs, grad_out):
    return torch.autograd.grad(out, inputs, grad_out)


def _float64_leaves(tensors):
    return [t.detach().double().requires_grad_() for t in tensors]


def _check_all(fused, eager, ref, dtype, names, rows=1):
    """Three-way check of each tensor; parameter gradients (sums over `rows` rows, whose
    rounding error grows with their length) get the slack of conftest's
    check_outputs_and_grads."""
    for f, e, r, name in zip(fused, eager, ref, names):
        assert f.dtype == dtype, f"{name}: dtype {f.dtype}"
        atol = ATOL[dtype] * (1 if name in ("dx", "output") else max(1, rows) ** 0.5)
        assert_close_three_way(f, e, r, dtype, what=name, atol=atol)


def _check_against_eager(fused, eager, eager_fn, reference_fn, batch, d, dtype, device):
    """fused(x), eager_fn(x) (eager: the module whose parameters it uses) and
    reference_fn(x64, params64) in float64, and their gradients, checked three-way."""
    x = random_input((*batch, d), dtype, device).requires_grad_()
    dy = random_input((*batch, d), dtype, device, scale=1.0, shift=0.0, seed=1)
    y = fused(x)
    y_eager = eager_fn(x)
    x64, *p64 = _float64_leaves([x, *_params(fused)])
    y64 = reference_fn(x64, p64)
    _check_all([y], [y_eager], [y64], dtype, ["output"])
    _check_all(
        _grads(y, [x, *_params(fused)], dy),
        _grads(y_eager, [x, *_params(eager)], dy),
        _grads(y64, [x64, *p64], dy.double()),
        dtype,
        ["dx"] + [n for n, _ in fused.named_parameters()],
        rows=x.numel() // d,
    )


def _eager_grid(test):
    """The grid of the matches-eager tests: device, dtype, approximate, bias, shapes."""
    marks = [
        pytest.mark.parametrize("device", DEVICES),
        pytest.mark.parametrize("dtype", DTYPES),
        pytest.mark.parametrize("approximate", APPROXIMATE),
        pytest.mark.parametrize("bias", [True, False]),
        pytest.mark.parametrize("batch,d,hidden", SHAPES),
    ]
    for mark in reversed(marks):
        test = mark(test)
    return test


# --- results and gradients ---------------------------------------------------------------


@_eager_grid
def test_ffn_matches_eager(device, dtype, approximate, bias, batch, d, hidden):
    fused, eager = _ffn_module_pair(d, hidden, bias, approximate, dtype, device)

    def ref(x64, p64):
        return reference.gelu_ffn(x64, *(p64 if bias else [p64[0], None, p64[1], None]),
                                  approximate)

    _check_against_eager(fused, eager, eager, ref, batch, d, dtype, device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ffn_other_layouts(device, dtype):
    """A strided input, out_features != in_features, one bias only, through gelu_ffn."""
    g = torch.Generator().manual_seed(3)
    w1, b1, w2 = (_param(s, f, g).to(device=device, dtype=dtype) for s, f in
                  (((40, 12), 12), ((40,), 12), ((9, 40), 40)))
    x = random_input((6, 24), dtype, device)[:, ::2].requires_grad_()
    assert not x.is_contiguous()
    leaves = [x, w1.requires_grad_(), b1.requires_grad_(), w2.requires_grad_()]
    dy = random_input((6, 9), dtype, device, scale=1.0, shift=0.0, seed=4)
    y = fusednorm.gelu_ffn(x, w1, b1, w2, None, approximate="tanh")
    y_eager = reference.gelu_ffn(x, w1, b1, w2, None, "tanh", upcast=False)
    leaves64 = _float64_leaves(leaves)
    y64 = reference.gelu_ffn(leaves64[0], leaves64[1], leaves64[2], leaves64[3], None, "tanh")
    _check_all([y], [y_eager], [y64], dtype, ["output"])
    _check_all(_grads(y, leaves, dy), _grads(y_eager, leaves, dy),
               _grads(y64, leaves64, dy.double()), dtype, ["dx", "dW1", "db1", "dW2"])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("batch", [(0,), (2, 0)])
def test_ffn_empty_batch(device, batch):
    fused, eager = _ffn_module_pair(8, 24, True, "none", torch.float32, device)
    x = torch.empty((*batch, 8), device=device, requires_grad=True)
    y = fused(x)
    assert y.shape == (*batch, 8)
    y.sum().backward()
    assert x.grad.shape == x.shape
    for name, p in fused.named_parameters():
        assert p.grad is not None and torch.count_nonzero(p.grad) == 0, name


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ffn_zero_hidden_units(device, dtype):
    """hidden = 0: y = bias2, dx = 0, db2 = the column sums of dy (the CPU backward's chunk
    loop must still run once, and end)."""
    x = random_input((5, 8), dtype, device, seed=1).requires_grad_()
    w1 = torch.empty(0, 8, dtype=dtype, device=device, requires_grad=True)
    w2 = torch.empty(8, 0, dtype=dtype, device=device, requires_grad=True)
    b1 = torch.empty(0, dtype=dtype, device=device, requires_grad=True)
    b2 = random_input((8,), dtype, device, seed=2).requires_grad_()
    y = fusednorm.gelu_ffn(x, w1, b1, w2, b2)
    assert torch.equal(y, b2.detach().expand(5, 8))
    dy = random_input((5, 8), dtype, device, seed=3)
    y.backward(dy)
    assert torch.count_nonzero(x.grad) == 0 and w1.grad.shape == w1.shape
    assert w2.grad.shape == w2.shape and b1.grad.shape == b1.shape
    torch.testing.assert_close(b2.grad, dy.float().sum(0).to(dtype))


def _gelu_through_the_ffn(x, approximate):
    """gelu and gelu' of the column x through gelu_ffn with 1x1 weights of one (the block is
    gelu itself, dx is gelu'), and torch's GELU's: (y, dx, y_eager, dx_eager)."""
    x = x.detach().requires_grad_()
    one = torch.ones(1, 1, device=x.device, dtype=x.dtype)
    y = fusednorm.gelu_ffn(x, one, None, one, None, approximate)
    (dx,) = torch.autograd.grad(y, x, torch.ones_like(y))
    x_eager = x.detach().requires_grad_()
    y_eager = nn.functional.gelu(x_eager, approximate=approximate)
    (dx_eager,) = torch.autograd.grad(y_eager, x_eager, torch.ones_like(y_eager))
    return y, dx, y_eager, dx_eager


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("approximate", APPROXIMATE)
def test_gelu_and_its_derivative_over_a_wide_range(device, dtype, approximate):
    """With 1x1 weights the block is gelu itself and dx is gelu': both over [-12, 12],
    tails included, against torch's GELU; NaN propagates."""
    x = torch.linspace(-12, 12, 4801, dtype=torch.float64).to(device=device, dtype=dtype)
    x = x.unsqueeze(1).requires_grad_()
    y, dx, y_eager, dx_eager = _gelu_through_the_ffn(x, approximate)
    x64 = x.detach().double().requires_grad_()
    y64 = nn.functional.gelu(x64, approximate=approximate)
    (dx64,) = torch.autograd.grad(y64, x64, torch.ones_like(y64))
    _check_all([y, dx], [y_eager, dx_eager], [y64, dx64], dtype, ["gelu", "gelu'"])

    nan = torch.tensor([[float("nan")], [1.0]], device=device, dtype=dtype, requires_grad=True)
    one = torch.ones(1, 1, device=device, dtype=dtype)
    y = fusednorm.gelu_ffn(nan, one, None, one, None, approximate)
    (dx,) = torch.autograd.grad(y.sum(), nan)
    assert y[0].isnan().all() and dx[0].isnan().all() and not y[1].isnan().any()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("approximate", APPROXIMATE)
@pytest.mark.parametrize("bias", [True, False])
def test_ffn_with_frozen_parameters(device, dtype, approximate, bias):
    """Parameters that do not require grad (fine-tuning around a frozen FFN): the input's
    gradient alone, three-way against eager and float64."""
    batch, d, hidden = (3, 50), 24, 97
    fused, eager = _ffn_module_pair(d, hidden, bias, approximate, dtype, device)
    fused.requires_grad_(False)
    eager.requires_grad_(False)
    x = random_input((*batch, d), dtype, device).requires_grad_()
    dy = random_input((*batch, d), dtype, device, scale=1.0, shift=0.0, seed=1)
    y = fused(x)
    (dx,) = _grads(y, [x], dy)
    (dx_eager,) = _grads(eager(x), [x], dy)
    x64, *p64 = _float64_leaves([x, *_params(fused)])
    y64 = reference.gelu_ffn(x64, *(p64 if bias else [p64[0], None, p64[1], None]),
                             approximate)
    (dx64,) = _grads(y64, [x64], dy.double())
    _check_all([dx], [dx_eager], [dx64], dtype, ["dx"])


# Parameters that train while the others are frozen: BitFit (biases), LoRA-style around one
# linear (fc2 or fc1 alone), and fc1's bias alone.
PARTIAL = {"biases": ("fc1.bias", "fc2.bias"), "fc2": ("fc2.weight", "fc2.bias"),
           "fc1": ("fc1.weight", "fc1.bias"), "fc1.bias": ("fc1.bias",)}


def _backward_ops(fn):
    """The ops the backward of fn() runs (torch.ops overload packets), in order."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Record(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(func.overloadpacket)
            return func(*args, **(kwargs or {}))

    recorder = Record()
    out = fn()
    with recorder:
        out.backward(torch.ones_like(out))
    return recorder.ops


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("approximate", APPROXIMATE)
@pytest.mark.parametrize("block", [False, True])
@pytest.mark.parametrize("trainable", list(PARTIAL))
def test_ffn_with_some_parameters_frozen(device, dtype, approximate, block, trainable):
    """Some FFN parameters frozen: each trainable one's gradient and the input's, three-way
    against eager and float64; the backward forms no GEMM that eager does not (a frozen
    weight's gradient is not formed and dropped); the input is saved only where fc1's weight
    trains (its gradient alone reads it)."""
    batch, d, hidden = (3, 50), 24, 97
    if block:
        fused, eager = _block_pair(d, hidden, True, approximate, dtype, device)
        eager_fn = lambda x: x + eager(x)  # noqa: E731
        prefix = {"fc1": "1", "fc2": "3"}
    else:
        fused, eager = _ffn_module_pair(d, hidden, True, approximate, dtype, device)
        eager_fn = eager
        prefix = {"fc1": "0", "fc2": "2"}
    names = PARTIAL[trainable]
    eager_names = [prefix[n.split(".")[0]] + "." + n.split(".")[1] for n in names]
    for name, p in fused.named_parameters():
        p.requires_grad_(name in names)
    for name, p in eager.named_parameters():
        p.requires_grad_(name in eager_names)
    fused_params = [dict(fused.named_parameters())[n] for n in names]
    eager_params = [dict(eager.named_parameters())[n] for n in eager_names]

    x = random_input((*batch, d), dtype, device).requires_grad_()
    dy = random_input((*batch, d), dtype, device, scale=1.0, shift=0.0, seed=1)
    grads = _grads(fused(x), [x, *fused_params], dy)
    eager_grads = _grads(eager_fn(x), [x, *eager_params], dy)
    x64, *p64 = _float64_leaves([x, *_params(fused)])
    if block:
        y64 = reference.layer_norm_gelu_ffn(x64, p64[0], p64[1], 1e-5, *p64[2:], approximate)
    else:
        y64 = reference.gelu_ffn(x64, *p64, approximate)
    p64_by_name = dict(zip([n for n, _ in fused.named_parameters()], p64))
    ref = _grads(y64, [x64, *[p64_by_name[n] for n in names]], dy.double())
    _check_all(grads, eager_grads, ref, dtype, ["dx", *names], rows=x.numel() // d)

    gemms = {torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm}
    ours = _backward_ops(lambda: fused(x))
    theirs = _backward_ops(lambda: eager_fn(x))
    assert torch.ops.fusednorm.gelu_ffn_bwd not in ours, ours
    assert sum(op in gemms for op in ours) <= sum(op in gemms for op in theirs), (ours, theirs)
    if not block:
        x_storage = x.untyped_storage().data_ptr()
        assert (x_storage in _saved_storages(lambda: fused(x))) == ("fc1.weight" in names)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("approximate", APPROXIMATE)
def test_gelu_and_its_derivative_far_out(device, dtype, approximate):
    """Far out in the tails (up to the dtype's largest value), gelu is x or 0 and gelu' is
    1 or 0, as torch's GELU gives them (NaN where torch's tanh form meets inf * 0): no floor
    of the exponential scaled back up by x."""
    big = torch.finfo(dtype).max
    values = [v for v in (1e6, 1e13, 1e37, big) if v <= big] + [3.0e4]
    x = torch.tensor(values + [-v for v in values], dtype=dtype, device=device)
    y, dx, y_eager, dx_eager = _gelu_through_the_ffn(x.unsqueeze(1), approximate)
    torch.testing.assert_close(y, y_eager, atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(dx, dx_eager, atol=0, rtol=0, equal_nan=True)


# --- the pre-LN block ----------------------------------------------------------------------


def _block_pair(d, hidden, bias, approximate, dtype, device):
    """A FusedLayerNormGeluFFN and its eager twin x + Sequential(x) with equal weights."""
    ffn, eager_ffn = _ffn_module_pair(d, hidden, bias, approximate, dtype, device)
    block = fusednorm.FusedLayerNormGeluFFN(d, hidden, bias=bias, approximate=approximate,
                                            device=device, dtype=dtype)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        block.norm.weight.copy_(1 + 0.5 * _param((d,), 1, g))
        block.norm.bias.copy_(0.5 * _param((d,), 1, g))
    block.fc1.load_state_dict(ffn.fc1.state_dict())
    block.fc2.load_state_dict(ffn.fc2.state_dict())
    norm = nn.LayerNorm(d, device=device, dtype=dtype)
    norm.load_state_dict(block.norm.state_dict())
    return block, nn.Sequential(norm, *eager_ffn)


@_eager_grid
def test_layer_norm_block_matches_eager(device, dtype, approximate, bias, batch, d, hidden):
    block, eager = _block_pair(d, hidden, bias, approximate, dtype, device)

    def ref(x64, p64):
        ln_w, ln_b, w1, *rest = p64
        ffn64 = [w1, rest[0], rest[1], rest[2]] if bias else [w1, None, rest[0], None]
        return reference.layer_norm_gelu_ffn(x64, ln_w, ln_b, 1e-5, *ffn64, approximate)

    _check_against_eager(block, eager, lambda x: x + eager(x), ref, batch, d, dtype, device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("approximate", APPROXIMATE)
@pytest.mark.parametrize("frozen", ["ffn", "all"])
def test_layer_norm_block_with_a_frozen_ffn(device, dtype, approximate, frozen):
    """A frozen FFN (fc1 and fc2, or every parameter): the input's gradient, and the norm's
    where it trains, three-way against eager and float64."""
    batch, d, hidden = (3, 50), 24, 97
    block, eager = _block_pair(d, hidden, True, approximate, dtype, device)
    for module in (block, eager):
        (module if frozen == "all" else module[1:] if module is eager
         else nn.ModuleList([module.fc1, module.fc2])).requires_grad_(False)
    trained = [p for p in block.parameters() if p.requires_grad]
    x = random_input((*batch, d), dtype, device).requires_grad_()
    dy = random_input((*batch, d), dtype, device, scale=1.0, shift=0.0, seed=1)
    grads = _grads(block(x), [x, *trained], dy)
    eager_grads = _grads(x + eager(x), [x, *[p for p in eager.parameters() if p.requires_grad]],
                         dy)
    x64, *p64 = _float64_leaves([x, *_params(block)])
    y64 = reference.layer_norm_gelu_ffn(x64, p64[0], p64[1], 1e-5, *p64[2:], approximate)
    ref = _grads(y64, [x64, *p64[:len(trained)]], dy.double())
    _check_all(grads, eager_grads, ref, dtype, ["dx", "norm.weight", "norm.bias"][:len(grads)],
               rows=x.numel() // d)


def _block_gradient_errors(x, seed=5):
    """Each float32 gradient of layer_norm_gelu_ffn at x: its largest error against float64,
    over its largest value."""
    M, d = x.shape
    g = torch.Generator().manual_seed(seed)
    def rand(*shape, scale=1.0, shift=0.0):
        values = torch.randn(*shape, generator=g, dtype=torch.float64)
        return (values * scale + shift).to(x.device)
    tensors = [x.double(), rand(d, shift=1.0), rand(d), rand(2 * d, d, scale=d**-0.5),
               rand(2 * d), rand(d, 2 * d, scale=(2 * d) ** -0.5), rand(d)]
    dy = rand(M, d)
    grads = []
    for dtype, fn in ((torch.float32, fusednorm.functional.layer_norm_gelu_ffn),
                      (torch.float64, reference.layer_norm_gelu_ffn)):
        leaves = [t.to(dtype).requires_grad_() for t in tensors]
        fn(leaves[0], leaves[1], leaves[2], 1e-5, *leaves[3:], "none").backward(dy.to(dtype))
        grads.append([leaf.grad.double() for leaf in leaves])
    return relative_errors(*grads)


@pytest.mark.parametrize("device", DEVICES)
def test_layer_norm_block_far_from_zero_as_exact_as_near_it(device):
    """float32 rows 1e4 sigma from zero: every gradient of the block as close to float64 as for
    the same rows at zero. The backward recomputes the normalized input from the saved float
    mean (layer_norm_apply); without the part of the mean that the float lost, it was up to
    4.9e-4 from what the forward used, and dweight1 drifted with it."""
    noise = torch.randn(32, 256, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    near = _block_gradient_errors(noise.float().to(device))
    far = _block_gradient_errors((noise + 1e4).float().to(device))
    names = ["input", "ln_weight", "ln_bias", "weight1", "bias1", "weight2", "bias2"]
    assert_far_as_exact_as_near(far, near, names)


@pytest.mark.parametrize("device", DEVICES)
def test_layer_norm_block_mixed_precision_norm(device):
    """float32 LayerNorm parameters with a bfloat16 input, as layer_norm allows."""
    block, _ = _block_pair(16, 48, True, "none", torch.bfloat16, device)
    block.norm.float()
    x = random_input((10, 16), torch.bfloat16, device).requires_grad_()
    y = block(x)
    y.float().square().sum().backward()
    assert y.dtype == torch.bfloat16 and block.norm.weight.grad.dtype == torch.float32
    x64 = x.detach().double()
    p = [t.detach().double() for t in _params(block)]
    y64 = reference.layer_norm_gelu_ffn(x64, p[0], p[1], 1e-5, *p[2:], "none")
    assert (y.double() - y64).abs().max() < 0.1 * (1 + y64.abs().max())


# --- gradcheck, opcheck, compile -------------------------------------------------------------


@pytest.mark.parametrize("approximate", APPROXIMATE)
@pytest.mark.parametrize("bias", [True, False])
def test_gradcheck_float64(approximate, bias):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(4, 3, 5, generator=g, dtype=torch.float64, requires_grad=True)
    w1 = (torch.randn(9, 5, generator=g, dtype=torch.float64) / 2).requires_grad_()
    w2 = (torch.randn(5, 9, generator=g, dtype=torch.float64) / 3).requires_grad_()
    b1 = torch.randn(9, generator=g, dtype=torch.float64, requires_grad=True) if bias else None
    b2 = torch.randn(5, generator=g, dtype=torch.float64, requires_grad=True) if bias else None
    inputs = [t for t in (x, w1, b1, w2, b2) if t is not None]

    def ffn(*args):
        x, w1, *rest = args
        b1, w2, b2 = rest if bias else (None, rest[0], None)
        return fusednorm.gelu_ffn(x, w1, b1, w2, b2, approximate)

    assert torch.autograd.gradcheck(ffn, inputs)

    ln_w = (1 + torch.randn(5, generator=g, dtype=torch.float64) / 4).requires_grad_()
    ln_b = torch.randn(5, generator=g, dtype=torch.float64, requires_grad=True)

    def block(x, ln_w, ln_b, w1, *rest):
        b1, w2, b2 = rest if bias else (None, rest[0], None)
        return fusednorm.functional.layer_norm_gelu_ffn(x, ln_w, ln_b, 1e-5, w1, b1, w2, b2,
                                                        approximate)

    assert torch.autograd.gradcheck(block, [x, ln_w, ln_b, *inputs[1:]])


def _op_samples(device, dtype):
    g = torch.Generator().manual_seed(6)

    def rand(*shape):
        return torch.randn(shape, generator=g, dtype=torch.float64).to(device=device, dtype=dtype)

    M, K, H, N = 6, 8, 24, 8
    x, w1, b1, w2, b2 = rand(M, K), rand(H, K), rand(H), rand(N, H), rand(N)
    samples = []
    for approximate in APPROXIMATE:
        samples.append((torch.ops.fusednorm.gelu_ffn_fwd, (x, w1, b1, w2, b2, approximate)))
        samples.append((torch.ops.fusednorm.gelu_ffn_fwd, (x, w1, None, w2, None, approximate)))
        h = x @ w1.T + b1
        for has_bias in (True, False):
            samples.append((torch.ops.fusednorm.gelu_ffn_bwd,
                            (rand(M, N), x, h, w1, w2, has_bias, not has_bias, approximate)))
    mean, rstd = x.float().mean(1), torch.rand(M, generator=g).to(device) + 0.5
    if dtype == torch.float64:
        mean, rstd = mean.double(), rstd.double()
    samples.append((torch.ops.fusednorm.layer_norm_apply, (x, mean, rstd, rand(K), rand(K))))
    samples.append((torch.ops.fusednorm.layer_norm_apply, (x, mean, rstd, None, None)))
    return samples


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_opcheck(device, dtype):
    for op, args in _op_samples(device, dtype):
        torch.library.opcheck(op, args)


def _compile_case(block, device):
    if block:
        return _block_pair(16, 40, True, "tanh", torch.float32, device)[0]
    return _ffn_module_pair(16, 40, True, "none", torch.float32, device)[0]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("block", [False, True], ids=["ffn", "layer_norm_block"])
@pytest.mark.parametrize("dynamic", [False, True])
def test_compile_fullgraph(device, block, dynamic):
    torch._dynamo.reset()
    module = _compile_case(block, device)
    compiled = torch.compile(module, fullgraph=True, dynamic=dynamic)
    for batch in ((3, 5), (7,)):
        x = random_input((*batch, 16), torch.float32, device).requires_grad_()
        dy = random_input((*batch, 16), torch.float32, device, scale=1.0, shift=0.0, seed=2)
        y = compiled(x)
        grads = _grads(y, [x, *_params(module)], dy)
        y_ref = module(x)
        grads_ref = _grads(y_ref, [x, *_params(module)], dy)
        torch.testing.assert_close(y, y_ref)
        for a, b in zip(grads, grads_ref):
            torch.testing.assert_close(a, b)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("block", [False, True], ids=["ffn", "layer_norm_block"])
def test_compiled_graphs_call_the_fused_ops(device, block):
    torch._dynamo.reset()
    backend = RecordingBackend()
    module = _compile_case(block, device)
    compiled = torch.compile(module, backend=backend, fullgraph=True)
    x = random_input((4, 16), torch.float32, device).requires_grad_()
    compiled(x).sum().backward()
    fw = "\n".join(g.code for g in backend.fw_graphs)
    bw = "\n".join(g.code for g in backend.bw_graphs)
    assert "fusednorm.gelu_ffn_bwd" in bw
    assert "aten.gelu" not in fw + bw and "aten.mm" not in fw + bw
    if block:
        assert "fusednorm.layer_norm_gelu_ffn.default" in fw
        assert "fusednorm.layer_norm_apply" in bw and "fusednorm.norm_bwd" in bw
    else:
        assert "fusednorm.gelu_ffn.default" in fw


# --- saved activations ------------------------------------------------------------------------


def _saved_activations(fn, x, params):
    """The tensors autograd saves while fn(x) runs, except x and the parameters (which
    exist anyway): a list of (shape, bytes)."""
    exempt = {t.untyped_storage().data_ptr() for t in (x, *params)}
    saved = []

    def pack(t):
        if t.untyped_storage().data_ptr() not in exempt:
            saved.append((tuple(t.shape), t.untyped_storage().nbytes()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(x)
    return saved


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_saved_activations_halved(device, dtype):
    fused, eager = _ffn_module_pair(32, 128, True, "none", dtype, device)
    x = random_input((4, 50, 32), dtype, device).requires_grad_()
    ours = _saved_activations(fused, x, _params(fused))
    theirs = _saved_activations(eager, x, _params(eager))
    ours_bytes, theirs_bytes = sum(b for _, b in ours), sum(b for _, b in theirs)
    assert ours_bytes <= 0.55 * theirs_bytes, (ours, theirs)
    assert [shape for shape, _ in ours] == [(200, 128)]


def _saved_storages(fn):
    """The storages (data pointers) of the tensors autograd saves while fn() runs."""
    saved = set()

    def pack(t):
        saved.add(t.untyped_storage().data_ptr())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return saved


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("trainable", [False, True])
def test_frozen_ffn_does_not_keep_its_input(device, trainable):
    """With every parameter frozen (fine-tuning elsewhere: LoRA on the attention alone) the
    input's gradient needs the pre-activation and the weights, not the input: like eager's
    frozen Linear, the FFN does not save it (a pre-LN block's norm output would live until
    the backward for nothing). With trainable weights it does: dW1 reads it."""
    fused, eager = _ffn_module_pair(32, 128, True, "none", torch.bfloat16, device)
    fused.requires_grad_(trainable)
    eager.requires_grad_(trainable)
    x = random_input((4, 50, 32), torch.bfloat16, device).requires_grad_()
    x_storage = x.untyped_storage().data_ptr()
    assert (x_storage in _saved_storages(lambda: fused(x))) == trainable
    assert (x_storage in _saved_storages(lambda: eager(x))) == trainable


class _PlusInput(nn.Module):
    """x + inner(x): the residual block the fused LayerNorm block computes."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return x + self.inner(x)


def _fwd_bwd_peak_mib(module, x, dy, device):
    from benchmarks import harness  # the benchmarks' allocator-peak measurement

    params = _params(module)

    def step():
        return torch.autograd.grad(module(x), [x, *params], dy)

    # A training step's steady state, as the benchmarks measure it (after timing): the
    # first GEMMs of a process allocate the persistent per-stream cuBLAS and cuBLASLt
    # workspaces, which no later step allocates again.
    step()
    peak = harness.peak_memory_mb(step, torch.device(device))
    if peak is None:
        pytest.skip("the allocator's peak cannot be measured here")
    return peak


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("block", [False, True], ids=["ffn", "layer_norm_block"])
def test_training_step_peak_memory_below_eager(device, block):
    """A forward+backward needs less memory at its peak than eager's: the backward's
    temporaries (the recomputed activation, the hidden gradient) must not outgrow what
    the forward saved less (on the CPU they live one chunk of rows at a time)."""
    pair = _block_pair if block else _ffn_module_pair
    fused, eager = pair(256, 1024, True, "none", torch.float32, device)
    x = random_input((2048, 256), torch.float32, device).requires_grad_()
    dy = random_input((2048, 256), torch.float32, device, scale=1.0, shift=0.0, seed=1)
    ours = _fwd_bwd_peak_mib(fused, x, dy, device)
    theirs = _fwd_bwd_peak_mib(_PlusInput(eager) if block else eager, x, dy, device)
    assert ours <= theirs, (ours, theirs)


@pytest.mark.parametrize("device", DEVICES)
def test_layer_norm_block_saves_no_layer_norm_output(device):
    block, eager = _block_pair(32, 128, True, "tanh", torch.float32, device)
    x = random_input((4, 50, 32), torch.float32, device).requires_grad_()
    ours = _saved_activations(block, x, _params(block))
    theirs = _saved_activations(lambda t: t + eager(t), x, _params(eager))
    # Ours: the statistics and fc1's output. The LayerNorm output ([200, 32], what fc1 of
    # the eager block saves) is not among them.
    assert sorted(shape for shape, _ in ours) == [(200,), (200,), (200, 128)]
    assert any(shape[-1] == 32 and math.prod(shape) == 200 * 32 for shape, _ in theirs)
    assert sum(b for _, b in ours) <= 0.55 * sum(b for _, b in theirs)


# --- modules ---------------------------------------------------------------------------------


def test_module_structure_and_state_dict():
    ffn = fusednorm.FusedGeluFFN(12)
    assert ffn.fc1.out_features == 48 and ffn.fc2.in_features == 48
    assert list(ffn.state_dict()) == ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
    assert "approximate='none'" in repr(ffn)
    no_bias = fusednorm.FusedGeluFFN(12, 20, bias=False, approximate="tanh")
    assert list(no_bias.state_dict()) == ["fc1.weight", "fc2.weight"]

    block = fusednorm.FusedLayerNormGeluFFN(12, 30, eps=1e-6, bias=False,
                                            dtype=torch.float64)
    assert list(block.state_dict()) == ["norm.weight", "norm.bias", "fc1.weight", "fc2.weight"]
    assert isinstance(block.norm, nn.LayerNorm) and block.norm.eps == 1e-6
    assert block.fc1.weight.dtype == torch.float64
    # State dicts map from the usual modules by name.
    plain = nn.ModuleDict({"norm": nn.LayerNorm(12, eps=1e-6, dtype=torch.float64),
                           "fc1": nn.Linear(12, 30, bias=False, dtype=torch.float64),
                           "fc2": nn.Linear(30, 12, bias=False, dtype=torch.float64)})
    block.load_state_dict(plain.state_dict())
    x = torch.randn(3, 12, dtype=torch.float64)
    expected = x + plain["fc2"](nn.functional.gelu(plain["fc1"](plain["norm"](x))))
    torch.testing.assert_close(block(x), expected)


def test_autocast_cpu_matches_eager_dtype():
    fused, eager = _ffn_module_pair(16, 32, True, "none", torch.float32, "cpu")
    x = random_input((5, 16), torch.float32, "cpu")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, y_eager = fused(x), eager(x)
    assert y.dtype == y_eager.dtype == torch.bfloat16
    torch.testing.assert_close(y, y_eager, atol=0.05, rtol=0.02)


@pytest.mark.parametrize("device", DEVICES)
def test_bias_gradients_deterministic(device):
    fused, _ = _ffn_module_pair(24, 72, True, "none", torch.float32, device)
    x = random_input((300, 24), torch.float32, device)
    dy = random_input((300, 24), torch.float32, device, scale=1.0, shift=0.0, seed=1)

    def bias_grads():
        y = fused(x)
        return _grads(y, [fused.fc1.bias, fused.fc2.bias], dy)

    first = bias_grads()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        second = bias_grads()
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


# --- errors ----------------------------------------------------------------------------------


def _good_args():
    return dict(input=torch.randn(4, 6), weight1=torch.randn(10, 6), bias1=torch.randn(10),
                weight2=torch.randn(6, 10), bias2=torch.randn(6))


@pytest.mark.parametrize(
    "change,error,match",
    [
        (dict(weight1=torch.randn(10, 5)), ValueError, r"weight1 must have shape \[hidden, 6\]"),
        (dict(weight1=torch.randn(60)), ValueError, "weight1 must have shape"),
        (dict(weight2=torch.randn(6, 11)), ValueError, r"weight2 must have shape \[out_features, 10\]"),
        (dict(bias1=torch.randn(9)), ValueError, r"bias1 must have shape \[10\]"),
        (dict(bias2=torch.randn(10)), ValueError, r"bias2 must have shape \[6\]"),
        (dict(approximate="erf"), ValueError, "approximate must be 'none' or 'tanh'"),
        (dict(approximate=None), ValueError, "approximate must be 'none' or 'tanh'"),
        (dict(input=torch.ones(4, 6, dtype=torch.int64)), TypeError, "input must be float32"),
        (dict(input=torch.ones(4, 6, dtype=torch.complex64)), TypeError, "input must be float32"),
        (dict(input=[1.0, 2.0]), TypeError, "input must be a Tensor"),
        (dict(input=torch.tensor(1.0)), ValueError, "at least one dim"),
        (dict(weight1=None), TypeError, "weight1 and weight2 must be Tensors"),
        (dict(weight2=torch.randn(6, 10, dtype=torch.float64)), TypeError,
         r"weight2 must have the input's dtype \(torch.float32\), got torch.float64"),
        (dict(bias1=torch.randn(10, dtype=torch.bfloat16)), TypeError, "bias1 must have the input's dtype"),
        (dict(weight1=torch.randn(10, 6, device="meta")), RuntimeError, "weight1 is on meta but input is on cpu"),
    ],
)
def test_bad_arguments_raise(change, error, match):
    args = _good_args()
    args.update(change)
    with pytest.raises(error, match=match):
        fusednorm.gelu_ffn(**args)


def test_bad_arguments_to_ops_raise():
    a = _good_args()
    x, w1, b1, w2, b2 = a["input"], a["weight1"], a["bias1"], a["weight2"], a["bias2"]
    with pytest.raises(RuntimeError, match="weight1 must be 2-D"):
        torch.ops.fusednorm.gelu_ffn_fwd(x, w1[:, :5].contiguous(), b1, w2, b2, "none")
    with pytest.raises(RuntimeError, match="approximate must be 'none' or 'tanh'"):
        torch.ops.fusednorm.gelu_ffn_fwd(x, w1, b1, w2, b2, "fast")
    with pytest.raises(RuntimeError, match="bias2 must have shape"):
        torch.ops.fusednorm.gelu_ffn_fwd(x, w1, b1, w2, b1, "none")
    with pytest.raises(RuntimeError, match="input must be contiguous"):
        torch.ops.fusednorm.gelu_ffn_fwd(torch.randn(6, 4).T, w1, b1, w2, b2, "none")
    with pytest.raises(RuntimeError, match="hidden_pre must have shape"):
        torch.ops.fusednorm.gelu_ffn_bwd(torch.randn(4, 6), x, torch.randn(4, 9), w1, w2,
                                         True, True, "none")
    with pytest.raises(RuntimeError, match="grad_out must have the input's dtype"):
        torch.ops.fusednorm.gelu_ffn_bwd(torch.randn(4, 6, dtype=torch.float64), x,
                                         torch.randn(4, 10), w1, w2, True, True, "none")


def test_bad_module_arguments_raise():
    with pytest.raises(ValueError, match="approximate must be 'none' or 'tanh'"):
        fusednorm.FusedGeluFFN(8, approximate="sigmoid")
    with pytest.raises(ValueError, match="approximate must be 'none' or 'tanh'"):
        fusednorm.FusedLayerNormGeluFFN(8, approximate="exact")
    block = fusednorm.FusedLayerNormGeluFFN(8, 16)
    with pytest.raises(ValueError, match=r"weight1 must have shape \[hidden, 7\]"):
        block(torch.randn(3, 7))


# --- CPU GEMM backends (csrc/cpu/gemm.h) -----------------------------------------------------

# libtorch's oneDNN matmul runs float32 only where oneDNN has bfloat16 support (x86: AVX-512
# BW/VL/DQ or AVX-NE-CONVERT); elsewhere forcing it is refused (test_cpu_gemm_onednn_refused).
HAS_ONEDNN = (torch.backends.mkldnn.is_available()
              and torch.ops.mkldnn._is_mkldnn_bf16_supported())
GEMM_BACKENDS = ["aten", pytest.param("onednn", marks=pytest.mark.skipif(
    not HAS_ONEDNN, reason="this torch has no oneDNN matmul that runs on this CPU"))]


@pytest.mark.parametrize("backend", GEMM_BACKENDS)
@pytest.mark.parametrize("approximate", APPROXIMATE)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("batch,d,hidden", SHAPES)
def test_cpu_gemm_backends(monkeypatch, backend, approximate, bias, batch, d, hidden):
    """float32 with each CPU GEMM backend forced for every GEMM, whatever its size (by default
    oneDNN takes only large ones, and only on the CPUs where it measured faster): the
    forward's chunked linears, the backward's column chunks accumulating dx, the pre-LN
    block."""
    monkeypatch.setenv("FUSEDNORM_CPU_GEMM", backend)
    test_ffn_matches_eager("cpu", torch.float32, approximate, bias, batch, d, hidden)
    test_layer_norm_block_matches_eager("cpu", torch.float32, approximate, bias, batch, d, hidden)


@pytest.mark.parametrize("backend", GEMM_BACKENDS)
def test_cpu_gemm_backends_edge_shapes(monkeypatch, backend):
    monkeypatch.setenv("FUSEDNORM_CPU_GEMM", backend)
    test_ffn_other_layouts("cpu", torch.float32)
    test_ffn_empty_batch("cpu", (2, 0))
    test_ffn_zero_hidden_units("cpu", torch.float32)


def _onednn_matmul_calls(capfd, dtype=torch.float32):
    """How many oneDNN matmul executions a forward and backward of gelu_ffn make, read from
    oneDNN's own verbose log."""
    torch.manual_seed(0)
    x = torch.randn(16, 8, dtype=dtype, requires_grad=True)
    # Trainable parameters: the fused backward (frozen ones take ATen's dx formula instead).
    w1, w2 = torch.randn(32, 8, dtype=dtype), torch.randn(8, 32, dtype=dtype)
    b1, b2 = torch.randn(32, dtype=dtype), torch.randn(8, dtype=dtype)
    for p in (w1, w2, b1, b2):
        p.requires_grad_()
    capfd.readouterr()
    with torch.backends.mkldnn.verbose(torch.backends.mkldnn.VERBOSE_ON):
        fusednorm.gelu_ffn(x, w1, b1, w2, b2).sum().backward()
    log = capfd.readouterr().out
    return sum(1 for line in log.splitlines() if line.startswith("onednn_verbose")
               and ",exec," in line and ",matmul," in line)


@pytest.mark.skipif(HAS_ONEDNN, reason="oneDNN's matmul runs on this CPU")
def test_cpu_gemm_onednn_refused_where_it_cannot_run(monkeypatch):
    """On a CPU where libtorch's oneDNN matmul refuses float32, FUSEDNORM_CPU_GEMM=onednn
    raises fusednorm's error naming the setting, and the unset setting takes ATen."""
    args = _good_args()
    monkeypatch.setenv("FUSEDNORM_CPU_GEMM", "onednn")
    with pytest.raises(RuntimeError, match="FUSEDNORM_CPU_GEMM=onednn, but this torch"):
        fusednorm.gelu_ffn(**args)
    monkeypatch.delenv("FUSEDNORM_CPU_GEMM")
    assert fusednorm.build_info()["cpu_ffn_gemm"] == "aten"
    F = torch.nn.functional
    expected = F.linear(F.gelu(F.linear(args["input"], args["weight1"], args["bias1"])),
                        args["weight2"], args["bias2"])
    torch.testing.assert_close(fusednorm.gelu_ffn(**args), expected)


@pytest.mark.skipif(not HAS_ONEDNN, reason="this torch has no oneDNN matmul that runs on this CPU")
def test_cpu_gemm_setting_selects_the_backend(monkeypatch, capfd):
    """FUSEDNORM_CPU_GEMM=onednn really runs oneDNN's matmul (the forward's two linears, the
    backward's dy W2 and dh W1: four), =aten none; float64 never does."""
    monkeypatch.setenv("FUSEDNORM_CPU_GEMM", "onednn")
    assert _onednn_matmul_calls(capfd) == 4
    assert _onednn_matmul_calls(capfd, torch.float64) == 0
    monkeypatch.setenv("FUSEDNORM_CPU_GEMM", "aten")
    assert _onednn_matmul_calls(capfd) == 0


@pytest.mark.filterwarnings("ignore:TF32 acceleration on top of oneDNN")
def test_cpu_gemm_bad_settings_raise(monkeypatch):
    args = _good_args()
    monkeypatch.setenv("FUSEDNORM_CPU_GEMM", "mkl")
    with pytest.raises(RuntimeError, match="FUSEDNORM_CPU_GEMM must be 'aten' or 'onednn'"):
        fusednorm.gelu_ffn(**args)
    monkeypatch.setenv("FUSEDNORM_CPU_GEMM", "onednn")
    with torch.backends.mkldnn.flags(enabled=False):
        with pytest.raises(RuntimeError, match="FUSEDNORM_CPU_GEMM=onednn, but this torch"):
            fusednorm.gelu_ffn(**args)


# --- CUDA only -------------------------------------------------------------------------------


@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("approximate", APPROXIMATE)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("batch,d,hidden", SHAPES + [((333,), 128, 512)])
def test_cuda_fallback_path_without_cublaslt(monkeypatch, dtype, approximate, bias, batch, d,
                                              hidden):
    """The own-kernel path that exact GELU, float64 and unaligned shapes take, forced for
    every case by FUSEDNORM_DISABLE_CUBLASLT=1, meets the same bound as the default path."""
    monkeypatch.setenv("FUSEDNORM_DISABLE_CUBLASLT", "1")
    test_ffn_matches_eager("cuda", dtype, approximate, bias, batch, d, hidden)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("approximate", APPROXIMATE)
@pytest.mark.parametrize("bias", [True, False])
def test_cuda_larger_shapes(monkeypatch, dtype, approximate, bias):
    """Sizes where cuBLASLt picks its tensor-core kernels and the column reductions use many
    slabs. For float16/bfloat16 every epilogue must really run (no silent fallback)."""
    if dtype != torch.float32:
        monkeypatch.setenv("FUSEDNORM_CUBLASLT_STRICT", "1")
    test_ffn_matches_eager("cuda", dtype, approximate, bias, (4, 512), 256, 1024)


@needs_cuda
@pytest.mark.parametrize("approximate", APPROXIMATE)
def test_cuda_deterministic_and_graph_capturable(approximate):
    fused, _ = _ffn_module_pair(128, 512, True, approximate, torch.bfloat16, "cuda")
    x = random_input((2048, 128), torch.bfloat16, "cuda").requires_grad_()
    dy = random_input((2048, 128), torch.bfloat16, "cuda", scale=1.0, shift=0.0, seed=1)

    def step():
        # y detached: an autograd graph alive from an eager step would keep the leaves'
        # AccumulateGrad nodes, which remember the (legacy default) stream they were made
        # on, and backward under capture then waits on that stream: PyTorch fails the
        # capture with cudaErrorStreamCaptureImplicit (pytorch/pytorch#164302), as this
        # test did on an H100 while the fused ops alone captured cleanly.
        y = fused(x)
        return (y.detach(), *_grads(y, [x, *_params(fused)], dy))

    eager_results = step()
    again = step()
    for a, b in zip(eager_results, again):
        assert torch.equal(a, b)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # warm-up on the capture stream
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    graph.replay()
    torch.cuda.synchronize()
    # cuBLAS may pick other kernels on the capture stream: equal up to rounding.
    for a, b in zip(captured, eager_results):
        torch.testing.assert_close(a, b, atol=1e-2, rtol=1e-2)


@needs_cuda
def test_cuda_other_device_and_stream():
    """Runs on the tensors' device, not the current one, and on the current stream."""
    device = f"cuda:{torch.cuda.device_count() - 1}"
    fused, eager = _ffn_module_pair(32, 96, True, "tanh", torch.float16, device)
    x = random_input((64, 32), torch.float16, device)
    stream = torch.cuda.Stream(device=device)
    with torch.cuda.device(0), torch.cuda.stream(stream):
        y = fused(x)
        y_eager = eager(x)
    stream.synchronize()
    torch.testing.assert_close(y, y_eager, atol=2e-2, rtol=2e-2)


class _LoRA(nn.Module):
    """A replaced fc1 as PEFT's LoRA layers: the base Linear plus a low-rank update, with
    the base's weight exposed as an attribute."""

    def __init__(self, base: nn.Linear, rank: int = 2):
        super().__init__()
        self.base_layer = base
        self.lora_a = nn.Parameter(torch.randn(rank, base.in_features) * 0.3)
        self.lora_b = nn.Parameter(torch.randn(base.out_features, rank) * 0.3)

    @property
    def weight(self):
        return self.base_layer.weight

    @property
    def bias(self):
        return self.base_layer.bias

    def forward(self, x):
        return self.base_layer(x) + x @ self.lora_a.t() @ self.lora_b.t()


class _Marked(torch.Tensor):
    """A weight of a tensor subclass of another library (as a quantized weight)."""


def _ffn_expected(x, w1, b1, w2, b2, scale1=1.0, delta1=None):
    h = nn.functional.linear(x, w1, b1) * scale1
    if delta1 is not None:
        h = h + delta1
    return nn.functional.linear(nn.functional.gelu(h), w2, b2)


@pytest.mark.parametrize("block", [False, True])
@pytest.mark.parametrize("change", ["fc1_hook", "fc2_pre_hook", "global_hook", "lora_fc1",
                                    "marked_weight", "norm_hook"])
def test_ffn_modules_call_submodules_that_do_more(block, change):
    """A hook, a replaced submodule or a weight of another tensor subclass on fc1/fc2 (or the
    block's norm): forward calls the submodules, so what they add takes effect, never
    silently skipped by the fused op."""
    if change == "norm_hook" and not block:
        pytest.skip("FusedGeluFFN has no norm")
    torch.manual_seed(0)
    module = (fusednorm.FusedLayerNormGeluFFN(8, d_hidden=12) if block
              else fusednorm.FusedGeluFFN(8, 12))
    x = random_input((5, 8), torch.float64, "cpu").float().requires_grad_()
    w1, b1 = module.fc1.weight.detach(), module.fc1.bias.detach()
    w2, b2 = module.fc2.weight.detach(), module.fc2.bias.detach()
    inner = (lambda t: nn.functional.layer_norm(t, (8,), module.norm.weight.detach(),
                                                module.norm.bias.detach())) if block \
        else (lambda t: t)
    outer = (lambda t, y: t + y) if block else (lambda t, y: y)
    scale1, delta1, ln_scale = 1.0, None, 1.0
    handle = None
    if change == "fc1_hook":
        handle = module.fc1.register_forward_hook(lambda m, i, o: o * 2)
        scale1 = 2.0
    elif change == "fc2_pre_hook":
        handle = module.fc2.register_forward_pre_hook(lambda m, i: (i[0] * 0.5,))
        w2 = w2 * 0.5
    elif change == "global_hook":
        calls = []
        handle = nn.modules.module.register_module_forward_hook(
            lambda m, i, o: calls.append(type(m).__name__))
    elif change == "lora_fc1":
        module.fc1 = _LoRA(module.fc1)
    elif change == "marked_weight":
        marked = torch.Tensor._make_subclass(_Marked, module.fc1.weight.detach())
        del module.fc1.weight
        module.fc1.weight = marked
    elif change == "norm_hook":
        handle = module.norm.register_forward_hook(lambda m, i, o: o * 3)
        ln_scale = 3.0
    try:
        out = module(x)
    finally:
        if handle is not None:
            handle.remove()
    normed = inner(x) * ln_scale
    if change == "lora_fc1":
        delta1 = normed @ module.fc1.lora_a.t() @ module.fc1.lora_b.t()
    expected = outer(x, _ffn_expected(normed, w1, b1, w2, b2, scale1, delta1))
    torch.testing.assert_close(out, expected.detach() if change == "lora_fc1" else expected)
    assert not out.grad_fn.name().startswith("fusednorm.")
    if change == "global_hook":
        assert "Linear" in calls
    if change == "lora_fc1":
        out.sum().backward()
        assert module.fc1.lora_a.grad is not None and module.fc1.lora_a.grad.abs().sum() > 0
    # Back to plain submodules: the fused op again.
    if change not in ("lora_fc1", "marked_weight"):
        assert module(x).grad_fn.name().startswith("fusednorm.")


def test_the_block_function_is_public():
    """The README's support table names fusednorm.layer_norm_gelu_ffn."""
    assert fusednorm.layer_norm_gelu_ffn is fusednorm.functional.layer_norm_gelu_ffn
    assert "layer_norm_gelu_ffn" in fusednorm.__all__
