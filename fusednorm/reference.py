"""Plain-PyTorch math for fusednorm's ops: the textbook formulas, differentiable.

Tests compare the kernels against these in float64; fusednorm also falls back to them
when its compiled library is missing, and uses them for double backward.
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


def layer_norm_backward(
    grad_out: torch.Tensor,
    input: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    n_norm_dims: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dweight, dbias) of LayerNorm over the last `n_norm_dims` dims, by the closed form

        xhat = (x - mean) * rstd,  g = dy * weight
        dx = rstd * (g - mean(g) - xhat * mean(g * xhat)),  dweight = sum(dy * xhat),
        dbias = sum(dy)

    computed differentiably from x (mean and rstd are recomputed), in the accumulation
    dtype (float32, float64 for float64). Gradients come back in the input's dtype.
    """
    acc = torch.float64 if input.dtype == torch.float64 else torch.float32
    dims = tuple(range(-n_norm_dims, 0))
    batch_dims = tuple(range(input.dim() - n_norm_dims))
    x = input.to(acc)
    dy = grad_out.to(acc)
    mean = x.mean(dim=dims, keepdim=True)
    rstd = torch.rsqrt((x - mean).square().mean(dim=dims, keepdim=True) + eps)
    xhat = (x - mean) * rstd
    g = dy * weight.to(acc) if weight is not None else dy
    dx = rstd * (g - g.mean(dim=dims, keepdim=True) - xhat * (g * xhat).mean(dim=dims, keepdim=True))
    dweight = (dy * xhat).sum(dim=batch_dims)
    dbias = dy.sum(dim=batch_dims)
    return dx.to(input.dtype), dweight, dbias


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
