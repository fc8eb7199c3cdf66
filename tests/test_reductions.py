"""Every op's reductions over rows (the parameter gradients) through several row blocks, in
every dtype, with bounds derived from the float64 result's own rounding.

The CPU backward sums dweight/dbias per block of rows (csrc/cpu/partials.h,
num_row_blocks: at least 32 rows a block, at most 64 blocks) and adds the blocks' partial
rows in a vectorized pass over chunks of 8 registers of columns, with a scalar tail. The
shapes here take 4 blocks of unequal rows (101 rows) and the cap of 64 blocks with a short
last one (2100 rows), and rows of whole chunks plus a tail (1023) and of a tail only (67).

The bound (assert_rounded_like): a kernel that computes in float32 (float64 for float64)
and rounds once to the dtype is off from the float64 result by at most that result's own
rounding error plus twice the float32 error accumulated on the way; that error is at most
a small multiple of 2^-24 times the magnitudes summed (the sum of |terms|, computed here
alongside the reference). Nothing grows with the square root of the rows: a dropped block,
a 0.1% error in one term or a wrong derivative moves 16-bit results off their correctly
rounded value and fails. The GELU FFN rounds its intermediates to the dtype (fc1's output,
the activation, the gradients that enter the GEMMs), as PyTorch's eager modules do; its
reference rounds at the same points, and a small share of elements may then sit one unit
off (an intermediate within float32 error of a rounding boundary went the other way).

The CUDA kernels' reductions (partial rows per block, chunks, clusters) are checked the
same way, in float64 against bounds of their rounding, by the emulation
(tests/test_emulation.py)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fusednorm
from conftest import DTYPES, random_input

# Multiples of 2^-24 (2^-53) times the magnitudes summed that float32 (float64) arithmetic
# may add before the one rounding: generous for sums of up to a few thousand terms, far
# below a 16-bit unit (2^-8 of bfloat16, 2^-11 of float16).
ACC_FACTOR = 16
MANTISSA = {torch.float64: 53, torch.float32: 24, torch.bfloat16: 8, torch.float16: 11}
# (rows, columns): 4 row blocks of 26, 26, 26 and 23 rows, columns 7 whole chunks and a
# tail; 64 blocks of 33 rows, the last 21, columns a tail only (float32) or one chunk and a
# tail (float64).
SHAPES = [(101, 1023), (2100, 67)]


def unit(ref, dtype):
    """The spacing of dtype's numbers at |ref| (normal range)."""
    _, exponent = torch.frexp(ref.abs().clamp_min(torch.finfo(dtype).tiny))
    return torch.ldexp(torch.ones_like(ref), exponent - MANTISSA[dtype])


def assert_rounded_like(fused, ref, magnitude, dtype, what, allowed=0.0):
    """|fused - ref| <= |round(ref) - ref| + 2 * ACC_FACTOR * eps_acc * magnitude for every
    element; with `allowed` > 0, all but that share of them, which may be one unit of the
    result and four of the magnitudes summed further off (intermediates rounded the other
    way)."""
    eps_acc = 2.0 ** -53 if dtype == torch.float64 else 2.0 ** -24
    assert fused.dtype == dtype and fused.shape == ref.shape, f"{what}: {fused.dtype} {fused.shape}"
    ref = ref.double()
    rounding = (ref.to(dtype).double() - ref).abs()
    bound = rounding + 2 * ACC_FACTOR * eps_acc * magnitude.double().expand_as(ref)
    err = (fused.double() - ref).abs()
    bad = err > bound
    far = err > bound + unit(ref, dtype) + (4 * 2.0 ** -MANTISSA[dtype] * magnitude if allowed else 0)
    share = bad.double().mean().item()
    if share > allowed or far.any():
        i = (far if far.any() else bad).nonzero()[0].tolist()
        idx = tuple(i)
        raise AssertionError(
            f"{what} ({dtype}): {int(bad.sum())} of {bad.numel()} elements not rounded like "
            f"float64 (allowed {allowed:.1%}), {int(far.sum())} over a unit further; first at "
            f"{i}: fused {fused.double()[idx].item():.9g}, float64 {ref[idx].item():.9g}, "
            f"bound {bound[idx].item():.3g}")


def norm_reference(x, w, b, dy, dsum, eps, centered):
    """The norm's output and gradients in float64 from the (rounded) inputs, with the
    magnitudes that each result sums."""
    x, dy = x.double(), dy.double()
    w = torch.ones(x.shape[-1], dtype=torch.float64) if w is None else w.double()
    mean = x.mean(-1, keepdim=True) if centered else torch.zeros_like(x[:, :1])
    rstd = ((x - mean).square().mean(-1, keepdim=True) + eps).rsqrt()
    xhat = (x - mean) * rstd
    y = xhat * w + (b.double() if b is not None else 0)
    y_mag = (xhat.abs() + mean.abs() * rstd) * w.abs() + (b.double().abs() if b is not None else 0)
    g = dy * w
    mean_g = g.mean(-1, keepdim=True) if centered else 0
    mean_gx = (g * xhat).mean(-1, keepdim=True)
    dx = rstd * (g - mean_g - xhat * mean_gx)
    dx_mag = rstd * (g.abs() + g.abs().mean(-1, keepdim=True) + xhat.abs() * (g * xhat).abs().mean(-1, keepdim=True))
    if dsum is not None:
        dx, dx_mag = dx + dsum.double(), dx_mag + dsum.double().abs()
    return {"output": (y, y_mag), "dx": (dx, dx_mag),
            "dweight": ((dy * xhat).sum(0), (dy * xhat).abs().sum(0)),
            "dbias": (dy.sum(0), dy.abs().sum(0))}


NORM_OPS = ["layer_norm", "rms_norm", "add_layer_norm", "add_rms_norm"]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("M, N", SHAPES)
@pytest.mark.parametrize("op", NORM_OPS)
def test_norm_row_blocks_rounded_like_float64(op, M, N, dtype):
    centered, residual = "layer" in op, op.startswith("add")
    eps = 1e-5
    x = random_input((M, N), dtype, "cpu")
    r = random_input((M, N), dtype, "cpu", scale=2.0, shift=-0.5, seed=1) if residual else None
    w = random_input((N,), dtype, "cpu", scale=0.5, shift=1.0, seed=2).requires_grad_()
    b = random_input((N,), dtype, "cpu", scale=0.5, shift=0.5, seed=3).requires_grad_() if centered else None
    dy = random_input((M, N), dtype, "cpu", scale=1.0, shift=0.2, seed=4)
    dsum = random_input((M, N), dtype, "cpu", scale=1.0, shift=0.0, seed=5) if residual else None
    leaf = x.clone().requires_grad_()
    fn = getattr(fusednorm, op)
    args = (leaf,) + ((r,) if residual else ()) + ((N,), w) + ((b,) if centered else ()) + (eps,)
    outs = fn(*args)
    outs = outs if residual else (outs,)
    torch.autograd.backward(list(outs), [dy] + ([dsum] if residual else []))

    s = x + r if residual else x  # the sum in the dtype: what the norm normalizes
    ref = norm_reference(s, w.detach(), b.detach() if b is not None else None, dy, dsum, eps,
                         centered)
    fused = {"output": outs[0], "dx": leaf.grad, "dweight": w.grad}
    if centered:
        fused["dbias"] = b.grad
    if residual:  # the sum itself: one rounding of x + r
        assert_rounded_like(outs[1], x.double() + r.double(), torch.zeros(()), dtype, "sum")
    for name, value in fused.items():
        assert_rounded_like(value, *ref[name], dtype, f"{op} {name}")


def test_norm_reference_is_fusednorms_reference():
    """The explicit formulas above against fusednorm.reference's autograd, float64."""
    x = random_input((9, 13), torch.float64, "cpu")
    w = random_input((13,), torch.float64, "cpu", seed=2).requires_grad_()
    b = random_input((13,), torch.float64, "cpu", seed=3).requires_grad_()
    dy = random_input((9, 13), torch.float64, "cpu", seed=4)
    for centered in (True, False):
        leaf = x.clone().requires_grad_()
        if centered:
            y = fusednorm.reference.layer_norm(leaf, (13,), w, b, 1e-5)
        else:
            y = fusednorm.reference.rms_norm(leaf, (13,), w, 1e-5)
        y.backward(dy)
        ref = norm_reference(x, w.detach(), b.detach() if centered else None, dy, None, 1e-5, centered)
        got = {"output": y, "dx": leaf.grad, "dweight": w.grad} | ({"dbias": b.grad} if centered else {})
        for name, value in got.items():
            torch.testing.assert_close(value, ref[name][0], rtol=1e-12, atol=1e-12)
        w.grad = b.grad = None


def gelu_and_grad(h, approximate):
    h = h.detach().requires_grad_()
    a = F.gelu(h, approximate=approximate)
    (da,) = torch.autograd.grad(a.sum(), h)
    return a.detach(), da


def ffn_reference(x, w1, b1, w2, b2, dy, approximate, dtype, x_magnitude=None):
    """gelu_ffn's output and gradients in float64, rounded to dtype where the computation
    keeps a dtype tensor (fc1's output, the activation, dy @ w2, gelu's gradient), with
    the magnitudes each result sums (x_magnitude: x's own, when x is a result itself)."""
    rnd = lambda t: t.to(dtype).double()  # noqa: E731
    x, w1, w2, dy = x.double(), w1.double(), w2.double(), dy.double()
    x_magnitude = x.abs() if x_magnitude is None else x_magnitude
    b1 = b1.double() if b1 is not None else torch.zeros(w1.shape[0], dtype=torch.float64)
    b2 = b2.double() if b2 is not None else torch.zeros(w2.shape[0], dtype=torch.float64)
    h = rnd(x @ w1.T + b1)
    act, dact = gelu_and_grad(h, approximate)
    act = rnd(act)
    out = act @ w2.T + b2
    dg = rnd(dy @ w2)
    dh_exact = dg * dact
    dh = rnd(dh_exact)
    # Magnitudes, propagated to first order (|gelu''| < 1): in float32/float64 an error of
    # the arithmetic's size in an intermediate moves the results computed from it; a 16-bit
    # intermediate is rounded, the same value here and in the kernel (but where it
    # rounded the other way: FFN_ALLOWED).
    wide = dtype in (torch.float32, torch.float64)
    h_mag = x_magnitude @ w1.abs().T + b1.abs() if wide else torch.zeros_like(h)
    act_mag = dact.abs() * h_mag + act.abs()
    dh_mag = (dy.abs() @ w2.abs() if wide else dg.abs()) * dact.abs() + dg.abs() * h_mag
    return {
        "output": (out, act_mag @ w2.abs().T + b2.abs()),
        "dx": (dh @ w1, dh_mag @ w1.abs()),
        "dweight1": (dh.T @ x, dh_mag.T @ x_magnitude),
        "dbias1": (dh_exact.sum(0), dh_mag.sum(0)),
        "dweight2": (dy.T @ act, dy.abs().T @ act_mag),
        "dbias2": (dy.sum(0), dy.abs().sum(0)),
    }


# (rows, d_model, hidden): 4 row blocks of the bias gradients' partials, and 22.
FFN_SHAPES = [(101, 40, 96), (700, 24, 160)]
# Share of elements allowed off in 16-bit: an intermediate within float32 error of a
# rounding boundary rounded the other way in the kernel. Measured (AVX-512 build): at most
# 0.13% in bfloat16; float16 0.6% in gelu_ffn, 2.6% in layer_norm_gelu_ffn's dweight2
# (its FFN's input is the LayerNorm's rounded output: more intermediates). A wrong GELU
# derivative moves far more (docs/testing.md).
FFN_ALLOWED = {torch.float64: 0.0, torch.float32: 0.0, torch.bfloat16: 0.01, torch.float16: 0.04}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("M, d, hidden", FFN_SHAPES)
def test_gelu_ffn_row_blocks_rounded_like_float64(M, d, hidden, approximate, dtype):
    x = random_input((M, d), dtype, "cpu", scale=1.0, shift=0.0)
    params = [random_input(shape, dtype, "cpu", scale=s, shift=0.0, seed=seed)
              for shape, s, seed in [((hidden, d), 2.0 / d ** 0.5, 1), ((hidden,), 0.5, 2),
                                     ((d, hidden), 1.0 / hidden ** 0.5, 3), ((d,), 0.5, 4)]]
    params = [p.requires_grad_() for p in params]
    dy = random_input((M, d), dtype, "cpu", scale=1.0, shift=0.1, seed=5)
    leaf = x.clone().requires_grad_()
    out = fusednorm.gelu_ffn(leaf, *params, approximate)
    out.backward(dy)
    ref = ffn_reference(x, *[p.detach() for p in params], dy, approximate, dtype)
    fused = {"output": out, "dx": leaf.grad, "dweight1": params[0].grad, "dbias1": params[1].grad,
             "dweight2": params[2].grad, "dbias2": params[3].grad}
    for name, value in fused.items():
        assert_rounded_like(value, *ref[name], dtype, f"gelu_ffn {name}", allowed=FFN_ALLOWED[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_layer_norm_gelu_ffn_row_blocks_rounded_like_float64(approximate, dtype):
    """The pre-LN block x + ffn(layer_norm(x)): the LayerNorm's output is rounded to the
    dtype (the FFN's input), the FFN's output before the residual is added. The FFN's
    results against the float64 FFN of that rounded input; the LayerNorm's gradients (and
    dx) against the float64 LayerNorm backward of the FFN's input gradient as fusednorm's
    FFN gives it (a dtype tensor whose one-unit differences from float64 would move every
    row's sum), so that they must be rounded as float64 rounds them, in every dtype."""
    M, d, hidden = 101, 40, 96
    rnd = lambda t: t.to(dtype).double()  # noqa: E731
    x = random_input((M, d), dtype, "cpu")
    tensors = [random_input(shape, dtype, "cpu", scale=s, shift=shift, seed=seed)
               for shape, s, shift, seed in [((d,), 0.5, 1.0, 6), ((d,), 0.5, 0.5, 7),
                                             ((hidden, d), 2.0 / d ** 0.5, 0.0, 1),
                                             ((hidden,), 0.5, 0.0, 2),
                                             ((d, hidden), 1.0 / hidden ** 0.5, 0.0, 3),
                                             ((d,), 0.5, 0.0, 4)]]
    w, b, w1, b1, w2, b2 = [t.requires_grad_() for t in tensors]
    dy = random_input((M, d), dtype, "cpu", scale=1.0, shift=0.1, seed=5)
    leaf = x.clone().requires_grad_()
    out = fusednorm.functional.layer_norm_gelu_ffn(leaf, w, b, 1e-5, w1, b1, w2, b2, approximate)
    out.backward(dy)

    detached = [t.detach() for t in (w, b, w1, b1, w2, b2)]
    normed, normed_mag = norm_reference(x, *detached[:2], dy, None, 1e-5, True)["output"]
    normed = rnd(normed)
    ffn = ffn_reference(normed, *detached[2:], dy, approximate, dtype, normed_mag)
    ffn_out, ffn_mag = ffn["output"]
    normed_leaf = fusednorm.layer_norm(x, (d,), *detached[:2], 1e-5).requires_grad_()
    # With trainable parameters, as in the block: a frozen FFN's dx takes other GEMMs.
    ffn_params = [t.clone().requires_grad_() for t in detached[2:]]
    fusednorm.gelu_ffn(normed_leaf, *ffn_params, approximate).backward(dy)
    norm = norm_reference(x, *detached[:2], normed_leaf.grad, None, 1e-5, True)
    ref = {"output": (x.double() + rnd(ffn_out), x.double().abs() + ffn_mag),
           "dweight1": ffn["dweight1"], "dbias1": ffn["dbias1"],
           "dweight2": ffn["dweight2"], "dbias2": ffn["dbias2"]}
    fused = {"output": out, "dweight1": w1.grad, "dbias1": b1.grad, "dweight2": w2.grad,
             "dbias2": b2.grad}
    for name, value in fused.items():
        assert_rounded_like(value, *ref[name], dtype, f"layer_norm_gelu_ffn {name}",
                            allowed=FFN_ALLOWED[dtype])
    # The LayerNorm's backward rounds dx, then adds the residual's gradient dy. Where
    # float64's dx lies within the accumulation margin of a rounding midpoint, the kernel's
    # float dx may round to either neighbour (seen on an AVX2 build: 0.00014 units from the
    # midpoint), and the sum follows that rounding: the reference takes the neighbour nearer
    # the fused result there.
    dx, dx_mag = norm["dx"]
    margin = 2 * ACC_FACTOR * (2.0 ** -53 if dtype == torch.float64 else 2.0 ** -24) * dx_mag
    sums = [rnd(dx + step) + dy.double() for step in (-margin, margin)]
    fused_dx = leaf.grad.double()
    nearer = torch.where((fused_dx - sums[0]).abs() <= (fused_dx - sums[1]).abs(), *sums)
    norm["dx"] = (nearer, dx_mag + dy.double().abs() + rnd(dx).abs())
    for name, value in {"dx": leaf.grad, "dweight": w.grad, "dbias": b.grad}.items():
        assert_rounded_like(value, *norm[name], dtype, f"layer_norm_gelu_ffn {name}")
