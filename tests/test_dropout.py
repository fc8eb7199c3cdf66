"""dropout_p / rowscale of add_layer_norm / add_rms_norm: s = dropout(input) * rowscale +
residual in the fused pass, the mask from Philox4x32-10 keyed by the device's generator.
Against fusednorm.reference's own Philox (known answers checked): the mask and the sum
exactly, the output and gradients against float64; keep rate, determinism, the backward's
regenerated mask, gradcheck, opcheck, compile, vmap, forward AD, modules, errors; CUDA and
CPU masks equal (with a GPU)."""
from __future__ import annotations

import pytest
import torch

import fusednorm
from fusednorm import reference
from fusednorm.errors import FusedTypeError, FusedValueError
from conftest import DEVICES, DTYPES, HAS_CUDA, check_outputs_and_grads, random_input

KINDS = ["layer_norm", "rms_norm"]
F32, F64 = torch.float32, torch.float64


def _op(kind):
    return fusednorm.add_layer_norm if kind == "layer_norm" else fusednorm.add_rms_norm


def _call(kind, x, r, w=None, b=None, **kw):
    shape = x.shape[-1:]
    if kind == "layer_norm":
        return fusednorm.add_layer_norm(x, r, shape, w, b, 1e-5, **kw)
    return fusednorm.add_rms_norm(x, r, shape, w, 1e-6, **kw)


def _torch_ops(kind, x, r, w=None, b=None, **kw):
    """The op's every output (rng_state among them)."""
    if kind == "layer_norm":
        return torch.ops.fusednorm.add_layer_norm(x, r, x.shape[-1:], w, b, 1e-5, **kw)
    return torch.ops.fusednorm.add_rms_norm(x, r, x.shape[-1:], w, 1e-6, **kw)


def _expected_sum(x, r, m, sum_dtype):
    """The kernels' sum: x * m and + r each rounded in the computation type, then to the
    sum's dtype; m (float64 from the reference) rounded once to that type."""
    acc = F64 if x.dtype == F64 else F32
    return (x.to(acc) * m.to(x.device, acc) + r.to(acc)).to(sum_dtype)


def test_philox_known_answers():
    """Random123's known-answer vectors for Philox4x32-10."""
    t = lambda v: torch.tensor([v])  # noqa: E731
    cases = [
        ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
        ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
        ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
         (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
    ]
    for counter, key, want in cases:
        got = reference.philox4x32_10([t(c) for c in counter], key)
        assert [int(v) for v in got] == list(want)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("offset", [0, 8, 4 * 12345])
def test_mask_counters_apart_from_torch_cuda_random_ops(device, offset):
    """PyTorch's CUDA random ops draw Philox4x32-10 under the generator's seed at counters
    (offset / 4 + draw, thread index): a call's mask must not be drawn at (i / 4, offset),
    which would make it the numbers of thread `offset` of later torch random ops. The mask
    is drawn at (i / 4, offset ^ 2^63)."""
    seed, n = 0x1234_5678_9ABC, 4096
    state = torch.tensor([seed, offset], dtype=torch.int64, device=device)
    ones = torch.ones(1, n, dtype=F32, device=device)
    kept = torch.ops.fusednorm.dropout_scale(ones, None, state, 0.5, F32).cpu() != 0
    quad = torch.arange(n // 4, dtype=torch.int64)
    mask32 = 0xFFFFFFFF

    def kept_at(high: int):
        words = [quad & mask32, quad >> 32, torch.full_like(quad, high & mask32),
                 torch.full_like(quad, high >> 32)]
        draws = torch.stack(reference.philox4x32_10(words, (seed & mask32, seed >> 32)), 1)
        return (draws.reshape(1, n) >= 2 ** 31)

    assert torch.equal(kept, kept_at(offset ^ (1 << 63)))
    shared = (kept == kept_at(offset)).float().mean().item()
    assert 0.4 < shared < 0.6  # independent of thread `offset`'s numbers


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("p, with_rowscale", [(0.1, False), (0.5, True), (0.0, True), (1.0, False)])
def test_sum_and_output_against_reference(device, kind, dtype, p, with_rowscale):
    """The sum bit for bit the reference mask's (odd rows, a strided input), the output
    within the float64 reference's tolerance."""
    lead, n = (3, 7), 133
    x = random_input((*lead, n + 5), dtype, device, seed=1)[..., 2:n + 2]  # strided rows
    r = random_input((*lead, n), dtype, device, seed=2)
    w = random_input((n,), dtype, device, seed=3)
    b = random_input((n,), dtype, device, seed=4) if kind == "layer_norm" else None
    rowscale = random_input(lead, F32, device, seed=5, scale=0.5, shift=1.0) if with_rowscale else None
    outs, (seed, offset) = _rng_state_full(kind, x, r, w, b, p, rowscale)
    m = reference.dropout_multipliers(x.shape, 1, p, seed, offset, rowscale)
    want_sum = _expected_sum(x, r, m, dtype)
    assert torch.equal(outs[1], want_sum)
    ref = reference.add_layer_norm(x.double() * m.to(device), r.double(), (n,), w.double(),
                                   b.double(), 1e-5) if kind == "layer_norm" else \
        reference.add_rms_norm(x.double() * m.to(device), r.double(), (n,), w.double(), 1e-6)
    # Normalized from the sum as the kernel rounded it: the float64 output of that sum.
    ref_out = (reference.layer_norm(outs[1].double(), (n,), w.double(), b.double(), 1e-5)
               if kind == "layer_norm" else
               reference.rms_norm(outs[1].double(), (n,), w.double(), 1e-6))
    tol = {F64: 1e-10, F32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 4e-3}[dtype]
    torch.testing.assert_close(outs[0].double(), ref_out, rtol=tol, atol=tol)
    # And the float64 sum itself is what the kernel's rounds.
    torch.testing.assert_close(outs[1].double(), ref[1], rtol=tol, atol=tol * 10)


def _rng_state_full(kind, x, r, w, b, p, rowscale):
    torch.manual_seed(1234)
    if kind == "layer_norm":
        outs = torch.ops.fusednorm.add_layer_norm(x, r, x.shape[-1:], w, b, 1e-5,
                                                  dropout_p=p, rowscale=rowscale)
    else:
        outs = torch.ops.fusednorm.add_rms_norm(x, r, x.shape[-1:], w, 1e-6,
                                                dropout_p=p, rowscale=rowscale)
    state = [int(v) for v in outs[-1].cpu()]
    if p == 0:
        assert state == []
        state = [0, 0]
    return outs, state


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [F32, F64, torch.bfloat16])
@pytest.mark.parametrize("rows, n", [(3, 1027), (5, 2500), (17, 3), (2, 8192)])
def test_mask_of_long_and_odd_rows_bitwise(device, dtype, rows, n):
    """Rows over several of the CPU's 1024-column fills, with a partial last one, and rows
    shorter than a quad (draws across row boundaries): the sum and dropout_scale bit for
    bit the reference mask's, and the backward's input gradient dropout_scale's. (p = 0.5:
    1 / (1 - p) exact, the kernels' factor rounds once.)"""
    x = random_input((rows, n), dtype, device, seed=1).requires_grad_()
    r = random_input((rows, n), dtype, device, seed=2)
    acc = F64 if dtype == F64 else F32
    rowscale = random_input((rows,), acc, device, seed=3, scale=0.5, shift=1.0)
    torch.manual_seed(99)
    torch.randn(3)  # an offset drawn from the generator, not 0
    outs = torch.ops.fusednorm.add_rms_norm(x, r, (n,), None, 1e-6, dropout_p=0.5,
                                            rowscale=rowscale)
    state = outs[-1]
    seed, offset = (int(v) for v in state.cpu())
    m = reference.dropout_multipliers(x.shape, 1, 0.5, seed, offset, rowscale)
    assert torch.equal(outs[1], _expected_sum(x.detach(), r, m, dtype))
    g = random_input((rows, n), acc, device, seed=4, scale=1.0, shift=0.0)
    scaled = torch.ops.fusednorm.dropout_scale(g, rowscale, state, 0.5, dtype)
    assert torch.equal(scaled, (g * m.to(device, acc)).to(dtype))
    torch.manual_seed(99)
    torch.randn(3)
    out, s = fusednorm.add_rms_norm(x, r, (n,), None, 1e-6, dropout_p=0.5, rowscale=rowscale)
    gs = random_input((rows, n), dtype, device, seed=5, scale=1.0, shift=0.0)
    (grad_x,) = torch.autograd.grad([s], [x], [gs])
    assert torch.equal(grad_x, torch.ops.fusednorm.dropout_scale(gs, rowscale, state, 0.5,
                                                                 dtype))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_three_way_accuracy(device, kind, dtype):
    """Outputs and gradients against float64, at most about twice PyTorch's own error at
    the same dtype (PyTorch given the same mask: x * m + r, then its norm). A fresh seed
    has offset 0 on every device."""
    lead, n = (4, 5), 203
    tensors = [random_input((*lead, n), dtype, device, seed=1),
               random_input((*lead, n), dtype, device, seed=2),
               random_input((n,), dtype, device, seed=3)]
    rowscale = random_input(lead, F32, device, seed=4, scale=0.2)
    m = reference.dropout_multipliers(tensors[0].shape, 1, 0.2, 77, 0, rowscale).to(device)

    def fused(x, r, w):
        torch.manual_seed(77)
        return _call(kind, x, r, w, dropout_p=0.2, rowscale=rowscale)

    def plain(x, r, w):
        s = x * m.to(x.dtype) + r
        if kind == "layer_norm":
            return torch.nn.functional.layer_norm(s, (n,), w, None, 1e-5), s
        return torch.nn.functional.rms_norm(s, (n,), w, 1e-6), s

    def ref(x, r, w):
        s = x * m + r
        if kind == "layer_norm":
            return reference.layer_norm(s, (n,), w, None, 1e-5), s
        return reference.rms_norm(s, (n,), w, 1e-6), s

    check_outputs_and_grads(fused, plain, ref, tensors, ["input", "residual", "weight"])


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, F32])
def test_float32_residual_stream_with_dropout(kind, dtype):
    """residual_dtype=torch.float32 beside dropout: the float32 sum of the masked input."""
    x = random_input((5, 77), dtype, "cpu", seed=1)
    r = random_input((5, 77), F32, "cpu", seed=2)
    torch.manual_seed(7)
    outs = _torch_ops(kind, x, r, residual_dtype=F32, dropout_p=0.25)
    seed, offset = (int(v) for v in outs[-1])
    m = reference.dropout_multipliers(x.shape, 1, 0.25, seed, offset)
    assert outs[1].dtype == F32 and torch.equal(outs[1], _expected_sum(x, r, m, F32))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", KINDS)
def test_zero_dropout_is_the_add_op(device, kind):
    """dropout_p=0 is bitwise the add op (and so is a rowscale of ones)."""
    x = random_input((4, 9, 65), torch.bfloat16, device, seed=1)
    r = random_input((4, 9, 65), torch.bfloat16, device, seed=2)
    plain = _call(kind, x, r)
    for kw in ({"dropout_p": 0.0}, {"rowscale": torch.ones(4, 9, device=device)}):
        for got, want in zip(_call(kind, x, r, **kw), plain):
            assert torch.equal(got, want)


@pytest.mark.parametrize("device", DEVICES)
def test_keep_rate_and_scale(device):
    """The kept fraction within 5 sigma of 1 - p; kept elements scaled by exactly 1 / (1 - p)."""
    n = 1 << 18
    x = torch.ones(64, n // 64, device=device)
    r = torch.zeros_like(x)
    for p in (0.1, 0.5, 0.9):
        _, s = _call("rms_norm", x, r, dropout_p=p)
        kept = s != 0
        rate = kept.double().mean().item()
        sigma = (p * (1 - p) / n) ** 0.5
        assert abs(rate - (1 - p)) < 5 * sigma, (p, rate)
        assert torch.all(s[kept] == torch.tensor(1 / (1 - p), dtype=F32))


@pytest.mark.parametrize("device", DEVICES)
def test_determinism_under_manual_seed(device):
    """A seed gives one sequence of masks: offsets 0, 4, 8 after seeding, the same masks
    again after reseeding (also with the same seed), different masks call to call."""
    x = random_input((8, 300), F32, device, seed=1)
    r = random_input((8, 300), F32, device, seed=2)

    def run(calls):
        torch.manual_seed(42)
        return [_torch_ops("layer_norm", x, r, dropout_p=0.3) for _ in range(calls)]

    first, second = run(3), run(3)
    assert [[int(v) for v in o[-1].cpu()] for o in first] == [[42, 0], [42, 4], [42, 8]]
    for a, b in zip(first, second):
        assert torch.equal(a[1], b[1])
    assert not torch.equal(first[0][1], first[1][1])
    # Other random ops in between: a different, but still seeded, offset.
    torch.manual_seed(42)
    torch.rand(3, device=device)
    state = [int(v) for v in _torch_ops("layer_norm", x, r, dropout_p=0.3)[-1].cpu()]
    torch.manual_seed(42)
    torch.rand(3, device=device)
    assert state == [int(v) for v in _torch_ops("layer_norm", x, r, dropout_p=0.3)[-1].cpu()]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [F32, torch.bfloat16])
@pytest.mark.parametrize("rows, n", [(1, 70), (4099, 40), (97, 1000)])
def test_outputs_and_gradients_bitwise_across_thread_counts(kind, dtype, rows, n):
    """README's determinism claim for the add ops with every option at once (dropout,
    rowscale, a float32 sum): one seed gives bitwise the same outputs and gradients of
    input, residual, weight and bias for 1, 2 and 3 CPU threads (3 on fewer cores: chunks
    taken in a varying order), rows not a multiple of a block included."""
    x = random_input((rows, n), dtype, "cpu", seed=1)
    r = random_input((rows, n), dtype, "cpu", seed=2)
    w = random_input((n,), F32, "cpu", seed=3)
    b = random_input((n,), F32, "cpu", seed=4) if kind == "layer_norm" else None
    rowscale = random_input((rows,), dtype, "cpu", scale=0.2, shift=1.0, seed=5)
    dy = random_input((rows, n), dtype, "cpu", scale=1.0, shift=0.0, seed=6)
    leaves = [t for t in (x, r, w, b) if t is not None]
    results = []
    old = torch.get_num_threads()
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            torch.manual_seed(5)
            inputs = [t.clone().requires_grad_() for t in leaves]
            xs, rs, ws = inputs[:3]
            bs = inputs[3] if b is not None else None
            y, s = _call(kind, xs, rs, ws, bs, residual_dtype=F32, dropout_p=0.3,
                         rowscale=rowscale)
            grads = torch.autograd.grad((y, s), inputs, (dy, dy.to(s.dtype)))
            results.append([y, s, *grads])
    finally:
        torch.set_num_threads(old)
    for other in results[1:]:
        for a, c in zip(results[0], other):
            assert torch.equal(a, c)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("use_reentrant", [False, True])
def test_activation_checkpointing_recomputes_the_same_mask(device, use_reentrant):
    """torch.utils.checkpoint restores the generator's state for its recomputation: the
    masks drawn again are the forward's (also after other dropout calls ran in between),
    so the gradients are those of a plain run."""
    n = 48
    x = random_input((6, n), F32, device, seed=1).requires_grad_()
    r = random_input((6, n), F32, device, seed=2).requires_grad_()
    w = random_input((n,), F32, device, seed=3).requires_grad_()

    def block(x, r):
        out, s = fusednorm.add_layer_norm(x, r, (n,), w, None, 1e-5, dropout_p=0.3)
        return fusednorm.add_layer_norm(out, s, (n,), w, None, 1e-5, dropout_p=0.3)

    def step(checkpointed):
        torch.manual_seed(0)
        torch.rand(1, device=device)  # not a freshly seeded state: a drawn offset
        if checkpointed:
            out, s = torch.utils.checkpoint.checkpoint(block, x, r, use_reentrant=use_reentrant)
        else:
            out, s = block(x, r)
        out, s = fusednorm.add_layer_norm(out, s, (n,), w, None, 1e-5, dropout_p=0.3)
        for t in (x, r, w):
            t.grad = None
        (out * s).sum().backward()  # reentrant checkpointing refuses autograd.grad
        return x.grad, r.grad, w.grad

    # Equal up to the order in which w's three gradient terms are added (the reentrant
    # form accumulates its segment's separately); another mask would be far off.
    for got, want in zip(step(True), step(False)):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [F32, torch.bfloat16, F64])
@pytest.mark.parametrize("p", [0.4, 0.0])
def test_backward_uses_the_forward_mask(device, kind, dtype, p):
    """Gradients against float64 autograd of the reference with the forward's multipliers:
    the input's is the sum's gradient times the mask (zero where dropped); p = 0 with a
    rowscale: one factor a row, no draws (the kernels' path without a mask)."""
    lead, n = (6,), 95
    x = random_input((*lead, n), dtype, device, seed=1).requires_grad_()
    r = random_input((*lead, n), dtype, device, seed=2).requires_grad_()
    w = random_input((n,), dtype, device, seed=3).requires_grad_()
    rowscale = random_input(lead, F32, device, seed=4, scale=0.3)
    torch.manual_seed(5)
    out, s = _call(kind, x, r, w, dropout_p=p, rowscale=rowscale)
    state = [int(v) for v in _torch_ops_state(kind, x, r, w, p, rowscale)] or [0, 0]  # p = 0: []
    m = reference.dropout_multipliers(x.shape, 1, p, *state, rowscale).to(device)
    go = random_input(out.shape, dtype, device, seed=6, scale=1.0, shift=0.0)
    gs = random_input(s.shape, dtype, device, seed=7, scale=1.0, shift=0.0)
    torch.autograd.backward([out, s], [go, gs])
    x64, r64, w64 = (t.detach().double().requires_grad_() for t in (x, r, w))
    s64 = x64 * m + r64
    out64 = (reference.layer_norm(s64, (n,), w64, None, 1e-5) if kind == "layer_norm"
             else reference.rms_norm(s64, (n,), w64, 1e-6))
    torch.autograd.backward([out64, s64], [go.double(), gs.double()])
    tol = {F64: 1e-9, F32: 2e-4, torch.bfloat16: 6e-2}[dtype]
    for got, want in ((x.grad, x64.grad), (r.grad, r64.grad), (w.grad, w64.grad)):
        torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol * 4)
    assert torch.all(x.grad[m == 0] == 0)


def _torch_ops_state(kind, x, r, w, p, rowscale):
    torch.manual_seed(5)
    with torch.no_grad():
        return _torch_ops(kind, x, r, w, dropout_p=p, rowscale=rowscale)[-1].cpu()


@pytest.mark.parametrize("kind", KINDS)
def test_gradcheck_and_gradgradcheck(kind):
    n = 11
    x = random_input((3, 2, n), F64, "cpu", seed=1).requires_grad_()
    r = random_input((3, 2, n), F64, "cpu", seed=2).requires_grad_()
    w = random_input((n,), F64, "cpu", seed=3).requires_grad_()
    rowscale = random_input((3, 2), F64, "cpu", seed=4, scale=0.3)

    def fn(x, r, w):  # one mask for every evaluation
        torch.manual_seed(9)
        return _call(kind, x, r, w, dropout_p=0.35, rowscale=rowscale)

    assert torch.autograd.gradcheck(fn, (x, r, w))
    assert torch.autograd.gradgradcheck(fn, (x, r, w))


@pytest.mark.parametrize("kind", KINDS)
def test_opcheck(kind):
    """opcheck reseeds before each run, so the random op compares like a deterministic one."""
    x = random_input((4, 33), torch.bfloat16, "cpu", seed=1).requires_grad_()
    r = random_input((4, 33), F32, "cpu", seed=2).requires_grad_()
    rowscale = random_input((4,), F32, "cpu", seed=3)
    op = torch.ops.fusednorm.add_layer_norm if kind == "layer_norm" else torch.ops.fusednorm.add_rms_norm
    args = ((x, r, [33], None, None, 1e-5) if kind == "layer_norm" else (x, r, [33], None, 1e-6))
    torch.library.opcheck(op.default, args, {"residual_dtype": F32, "dropout_p": 0.2,
                                             "rowscale": rowscale})


@pytest.mark.parametrize("kind", KINDS)
def test_compile_fullgraph(kind):
    """A compiled call draws its mask when it runs: with the same seed, eager's outputs
    and gradients."""
    x = random_input((5, 40), F32, "cpu", seed=1)
    r = random_input((5, 40), F32, "cpu", seed=2)

    def step(x, r):
        out, s = _call(kind, x, r, dropout_p=0.3)
        return (out * s).sum()

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    results = []
    for fn in (step, compiled, compiled):
        xs, rs = x.clone().requires_grad_(), r.clone().requires_grad_()
        torch.manual_seed(3)
        loss = fn(xs, rs)
        loss.backward()
        results.append((loss.detach(), xs.grad, rs.grad))
    for got in results[1:]:
        for a, b in zip(got, results[0]):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_vmap_randomness():
    x = random_input((3, 4, 20), F32, "cpu", seed=1)
    r = random_input((3, 4, 20), F32, "cpu", seed=2)
    fn = lambda x, r: fusednorm.add_rms_norm(x, r, (20,), dropout_p=0.5)  # noqa: E731
    with pytest.raises(RuntimeError, match="randomness='different'"):
        torch.func.vmap(fn)(x, r)
    torch.manual_seed(0)
    out, s = torch.func.vmap(fn, randomness="different")(x, r)
    torch.manual_seed(0)
    want_out, want_s = fn(x, r)  # the folded rows are the unbatched call's
    assert torch.equal(s, want_s) and torch.equal(out, want_out)


def test_forward_ad():
    """The sum's tangent is the input's times the mask, plus the residual's."""
    x = random_input((4, 30), F64, "cpu", seed=1)
    r = random_input((4, 30), F64, "cpu", seed=2)
    tx = random_input((4, 30), F64, "cpu", seed=3)
    tr = random_input((4, 30), F64, "cpu", seed=4)

    def fn(x, r):
        torch.manual_seed(2)
        return fusednorm.add_layer_norm(x, r, (30,), dropout_p=0.5)

    (_, s), (t_out, t_s) = torch.func.jvp(fn, (x, r), (tx, tr))
    m = reference.dropout_multipliers(x.shape, 1, 0.5, 2, 0)
    torch.testing.assert_close(t_s, tx * m + tr)
    x64, r64 = x.clone().requires_grad_(), r.clone().requires_grad_()
    out_ref = reference.layer_norm(x64 * m + r64, (30,), None, None, 1e-5)
    _, t_ref = torch.func.jvp(lambda a, b: reference.layer_norm(a * m + b, (30,), None, None,
                                                                1e-5), (x, r), (tx, tr))
    torch.testing.assert_close(t_out, t_ref)
    assert out_ref.shape == t_out.shape


@pytest.mark.parametrize("cls, kind", [(fusednorm.FusedAddLayerNorm, "layer_norm"),
                                       (fusednorm.FusedAddRMSNorm, "rms_norm")])
def test_modules_skip_dropout_in_eval(cls, kind):
    module = cls(24, dropout_p=0.5)
    x = random_input((3, 24), F32, "cpu", seed=1)
    r = random_input((3, 24), F32, "cpu", seed=2)
    def functional(**kw):  # the module's own eps (FusedAddRMSNorm's None: the default)
        if kind == "layer_norm":
            return fusednorm.add_layer_norm(x, r, (24,), module.weight, module.bias, module.eps,
                                            **kw)
        return fusednorm.add_rms_norm(x, r, (24,), module.weight, module.eps, **kw)

    torch.manual_seed(1)
    out, s = module(x, r)
    torch.manual_seed(1)
    want = functional(dropout_p=0.5)
    assert torch.equal(s, want[1]) and torch.equal(out, want[0])
    module.eval()
    for got, plain in zip(module(x, r), functional()):
        assert torch.equal(got, plain)
    assert "dropout_p=0.5" in repr(module)
    assert set(module.state_dict()) == ({"weight", "bias"} if kind == "layer_norm" else {"weight"})
    with pytest.raises(FusedValueError, match="dropout_p must be in"):
        cls(8, dropout_p=1.5)


@pytest.mark.parametrize("kind", KINDS)
def test_rejected_arguments(kind):
    x = random_input((2, 3, 8), F32, "cpu", seed=1)
    r = random_input((2, 3, 8), F32, "cpu", seed=2)
    cases = [
        ({"dropout_p": -0.1}, FusedValueError, r"dropout_p must be in \[0, 1\], got -0.1"),
        ({"dropout_p": 1.5}, FusedValueError, r"dropout_p must be in \[0, 1\]"),
        ({"dropout_p": float("nan")}, FusedValueError, r"dropout_p must be in \[0, 1\]"),
        ({"dropout_p": "0.1"}, FusedTypeError, "dropout_p must be a float, got str"),
        ({"rowscale": torch.ones(6)}, FusedValueError,
         r"rowscale must have the shape of input's leading dims \[2, 3\], got \[6\]"),
        ({"rowscale": torch.ones(2, 3, dtype=torch.int32)}, FusedTypeError,
         "rowscale must be float32, float64, float16 or bfloat16, got torch.int32"),
        ({"rowscale": [1.0, 2.0]}, FusedTypeError, "rowscale must be a Tensor or None, got list"),
    ]
    for kw, error, message in cases:
        with pytest.raises(error, match=message):
            _call(kind, x, r, **kw)
    with pytest.raises(RuntimeError, match="rowscale is not differentiable"):
        _call(kind, x.requires_grad_(), r, rowscale=torch.ones(2, 3, requires_grad=True))


def test_backend_checks():
    """Direct backend calls: rng_state given exactly with dropout, of the right form."""
    x = torch.randn(4, 8)
    state = torch.zeros(2, dtype=torch.int64)
    with pytest.raises(RuntimeError, match="rng_state must be given exactly"):
        torch.ops.fusednorm.norm_fwd(x, x, None, None, 1e-5, True, None, 0.5, None, None)
    with pytest.raises(RuntimeError, match="need a residual"):
        torch.ops.fusednorm.norm_fwd(x, None, None, None, 1e-5, True, None, 0.5, None, state)
    with pytest.raises(RuntimeError, match="rng_state must be a contiguous int64"):
        torch.ops.fusednorm.dropout_scale(x, None, torch.zeros(3, dtype=torch.int64), 0.5, F32)
    with pytest.raises(RuntimeError, match="rowscale must be Float"):
        torch.ops.fusednorm.dropout_scale(x, torch.ones(4, dtype=F64), state, 0.5, F32)


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", DTYPES)
def test_same_masks_on_cpu_and_cuda(dtype):
    """One seed, one sequence of calls: the same (seed, offset) and the same sums on both
    devices."""
    x = random_input((7, 257), dtype, "cpu", seed=1)
    r = random_input((7, 257), dtype, "cpu", seed=2)
    rowscale = random_input((7,), F32, "cpu", seed=3, scale=0.5)
    runs = {}
    for device in ("cpu", "cuda"):
        torch.manual_seed(11)
        runs[device] = [_torch_ops("layer_norm", x.to(device), r.to(device), dropout_p=0.3,
                                   rowscale=rowscale.to(device)) for _ in range(2)]
    for cpu, cuda in zip(runs["cpu"], runs["cuda"]):
        assert torch.equal(cpu[-1], cuda[-1].cpu())
        assert torch.equal(cpu[1], cuda[1].cpu())


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_cuda_graph_capture_draws_a_new_mask_per_replay():
    x = random_input((16, 512), torch.bfloat16, "cuda", seed=1)
    r = random_input((16, 512), torch.bfloat16, "cuda", seed=2)
    _torch_ops("rms_norm", x, r, dropout_p=0.5)  # warm up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = _torch_ops("rms_norm", x, r, dropout_p=0.5)
    sums, states = [], []
    for _ in range(2):
        graph.replay()
        torch.cuda.synchronize()
        sums.append(outs[1].clone())
        states.append(outs[-1].cpu().clone())
    assert not torch.equal(states[0], states[1])
    assert not torch.equal(sums[0], sums[1])
    m = reference.dropout_multipliers(x.shape, 1, 0.5, *(int(v) for v in states[1]))
    assert torch.equal(sums[1], _expected_sum(x, r, m, torch.bfloat16))


def test_dtensor_rules_refuse_dropout():
    """Under DTensor the add ops' rule refuses dropout and rowscale (each shard would draw
    its local rows' mask, the same on every rank), and takes the plain call."""
    distributed = pytest.importorskip("fusednorm.distributed")
    rules = distributed._norm_rules("add_rms_norm", "xxsR", "xx.p...d.", 2)
    for tail in ((0.1, None), (0.0, object())):
        with pytest.raises(NotImplementedError, match="dropout_p > 0 and rowscale"):
            rules(None, None, [8], None, None, False, None, *tail)

