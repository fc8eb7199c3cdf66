"""Plain-PyTorch math for fusednorm's ops: the textbook formulas, differentiable.

Tests compare the kernels against these in float64; fusednorm also falls back to them
where no kernel is compiled for a device (or the library is missing).
"""
from __future__ import annotations

from typing import Sequence

import torch

_Shape = int | Sequence[int]


def _dims(normalized_shape: _Shape) -> tuple[int, ...]:
    shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    return tuple(range(-len(shape), 0))


def layer_norm(
    input: torch.Tensor,
    normalized_shape: _Shape,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
    upcast: bool = True,
) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) * weight + bias over the last dims, biased variance.

    With upcast=True the math runs in float64 and the result stays float64 (the accuracy
    reference); with upcast=False it runs in float32 (float64 for float64 inputs) and the
    result has the input's dtype.
    """
    acc = torch.float64 if upcast or input.dtype == torch.float64 else torch.float32
    dims = _dims(normalized_shape)
    x = input.to(acc)
    mean = x.mean(dim=dims, keepdim=True)
    var = (x - mean).square().mean(dim=dims, keepdim=True)
    y = (x - mean) * torch.rsqrt(var + eps)
    if weight is not None:
        y = y * weight.to(acc)
    if bias is not None:
        y = y + bias.to(acc)
    return y if upcast else y.to(input.dtype)


def rms_eps(dtype: torch.dtype) -> float:
    """torch.nn.functional.rms_norm's eps=None: the machine epsilon of the computation type
    (float32 for float16/bfloat16/float32, float64 for float64)."""
    return torch.finfo(torch.float64 if dtype == torch.float64 else torch.float32).eps


def rms_norm(
    input: torch.Tensor,
    normalized_shape: _Shape,
    weight: torch.Tensor | None = None,
    eps: float | None = None,
    upcast: bool = True,
) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * weight over the last dims; eps None as rms_eps. upcast
    as layer_norm's."""
    acc = torch.float64 if upcast or input.dtype == torch.float64 else torch.float32
    eps = rms_eps(input.dtype) if eps is None else eps
    x = input.to(acc)
    y = x * torch.rsqrt(x.square().mean(dim=_dims(normalized_shape), keepdim=True) + eps)
    if weight is not None:
        y = y * weight.to(acc)
    return y if upcast else y.to(input.dtype)


def residual_sum(input, residual, residual_dtype=None):
    """input + residual in the input's dtype (as eager) for residual_dtype=None; for
    torch.float32 in float32 (float64 for float64 input), rounded once from the exact sum."""
    if residual_dtype is None:
        return input + residual
    dtype = torch.float64 if input.dtype == torch.float64 else residual_dtype
    return input.to(dtype) + residual.to(dtype)


_M32 = 0xFFFFFFFF


def _mulhilo(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(hi, lo) 32-bit halves of a * b for a 32-bit constant a and int64 tensor b of 32-bit
    values, in 16-bit pieces so that nothing overflows int64."""
    low = a * (b & 0xFFFF)
    high = a * (b >> 16)
    lo = low + ((high & 0xFFFF) << 16)
    return (high >> 16) + (lo >> 32), lo & _M32


def philox4x32_10(counter: Sequence[torch.Tensor], key: tuple[int, int]) -> list[torch.Tensor]:
    """Philox4x32-10 (Salmon et al.) of int64 tensors holding the four 32-bit counter
    words, under a 64-bit key as two 32-bit words: the four output words."""
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for _ in range(10):
        hi0, lo0 = _mulhilo(0xD2511F53, c0)
        hi1, lo1 = _mulhilo(0xCD9E8D57, c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0, k1 = (k0 + 0x9E3779B9) & _M32, (k1 + 0xBB67AE85) & _M32
    return [c0, c1, c2, c3]


def dropout_multipliers(shape: Sequence[int], dims: int, dropout_p: float, seed: int,
                        offset: int, rowscale: torch.Tensor | None = None) -> torch.Tensor:
    """The add ops' dropout / rowscale multipliers of one call (seed, offset: its
    rng_state), as float64 of `shape`: element i of the [M, N] rows (N the last `dims`
    dims) is kept when output i % 4 of Philox4x32-10(counter (i // 4, offset ^ 2^63), key
    seed) is >= round(p * 2^32) (the flipped bit keeps the counters apart from those of
    torch's own CUDA random ops under the same seed); a kept one is 1 / (1 - p) (0 for
    p = 1) times its row's rowscale.
    The kernels round 1 / (1 - p) to their computation type, then its product with the
    rowscale: compare within those two roundings."""
    numel = 1
    for d in shape:
        numel *= d
    index = torch.arange(numel, dtype=torch.int64)
    quad = index >> 2
    seed, offset = seed & ((1 << 64) - 1), offset & ((1 << 64) - 1)
    high = offset ^ (1 << 63)
    counter = [quad & _M32, quad >> 32, torch.full_like(quad, high & _M32),
               torch.full_like(quad, high >> 32)]
    draws = torch.stack(philox4x32_10(counter, (seed & _M32, seed >> 32)))
    draw = draws.gather(0, (index & 3).unsqueeze(0)).squeeze(0)
    keep = draw >= round(dropout_p * 2.0 ** 32)
    scale = 1.0 / (1.0 - dropout_p) if dropout_p < 1 else 0.0
    m = keep.to(torch.float64) * scale
    rows = m.view(-1, max(1, _row_length(shape, dims)))
    if rowscale is not None:
        rows = rows * rowscale.detach().to("cpu", torch.float64).reshape(-1, 1)
    return rows.reshape(tuple(shape))


def _row_length(shape: Sequence[int], dims: int) -> int:
    n = 1
    for d in tuple(shape)[len(shape) - dims:]:
        n *= d
    return n


def add_layer_norm(input, residual, normalized_shape, weight=None, bias=None, eps=1e-5,
                   upcast=True, residual_dtype=None):
    """(layer_norm(s), s) with s = residual_sum(input, residual, residual_dtype); without
    upcast, layer_norm(s) is rounded to the input's dtype."""
    s = residual_sum(input, residual, residual_dtype)
    out = layer_norm(s, normalized_shape, weight, bias, eps, upcast)
    return (out if upcast else out.to(input.dtype)), s


def add_rms_norm(input, residual, normalized_shape, weight=None, eps=None, upcast=True,
                 residual_dtype=None):
    """(rms_norm(s), s) with s = residual_sum(input, residual, residual_dtype); without
    upcast, rms_norm(s) is rounded to the input's dtype."""
    s = residual_sum(input, residual, residual_dtype)
    out = rms_norm(s, normalized_shape, weight, eps, upcast)
    return (out if upcast else out.to(input.dtype)), s


def gelu_ffn(
    input: torch.Tensor,
    weight1: torch.Tensor,
    bias1: torch.Tensor | None,
    weight2: torch.Tensor,
    bias2: torch.Tensor | None,
    approximate: str = "none",
    upcast: bool = True,
) -> torch.Tensor:
    """linear(gelu(linear(input, weight1, bias1), approximate), weight2, bias2), as
    nn.Sequential(nn.Linear, nn.GELU(approximate), nn.Linear).

    With upcast=True every tensor is converted to float64 and the result stays float64
    (the accuracy reference); with upcast=False it runs in the input's dtype, as eager
    PyTorch does.
    """
    if upcast:
        input, weight1, weight2 = input.double(), weight1.double(), weight2.double()
        bias1 = bias1.double() if bias1 is not None else None
        bias2 = bias2.double() if bias2 is not None else None
    hidden = torch.nn.functional.linear(input, weight1, bias1)
    return torch.nn.functional.linear(
        torch.nn.functional.gelu(hidden, approximate=approximate), weight2, bias2
    )


def layer_norm_gelu_ffn(
    input: torch.Tensor,
    ln_weight: torch.Tensor | None,
    ln_bias: torch.Tensor | None,
    eps: float,
    weight1: torch.Tensor,
    bias1: torch.Tensor | None,
    weight2: torch.Tensor,
    bias2: torch.Tensor | None,
    approximate: str = "none",
    upcast: bool = True,
) -> torch.Tensor:
    """input + gelu_ffn(layer_norm(input)) over the last dim: the pre-LN transformer
    feed-forward sub-block. upcast as in gelu_ffn (float64 throughout, or eager's dtypes)."""
    normed = layer_norm(input, input.shape[-1], ln_weight, ln_bias, eps, upcast=upcast)
    out = gelu_ffn(normed, weight1, bias1, weight2, bias2, approximate, upcast=upcast)
    return (input.double() if upcast else input) + out
