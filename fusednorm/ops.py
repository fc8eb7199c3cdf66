"""Thin wrappers over torch.ops.fusednorm.*: fake kernels for tracing, and autograd.

The compiled ops work on [M, N] row-major tensors; reshaping to and from the user's shape
happens here, so the kernels never see a stride.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch

from . import _loader, reference

_ops = torch.ops.fusednorm if _loader.AVAILABLE else None


def _stats_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


if _loader.AVAILABLE:

    @torch.library.register_fake("fusednorm::layer_norm_fwd")
    def _layer_norm_fwd_fake(input, weight, bias, eps):
        rows = input.shape[0]
        stats = input.new_empty((rows,), dtype=_stats_dtype(input.dtype))
        return torch.empty_like(input), stats, torch.empty_like(stats)

    @torch.library.register_fake("fusednorm::layer_norm_bwd")
    def _layer_norm_bwd_fake(grad_out, input, mean, rstd, weight, bias):
        cols = input.shape[1]
        grad_weight = weight.new_empty((cols,)) if weight is not None else input.new_empty((0,))
        grad_bias = bias.new_empty((cols,)) if bias is not None else input.new_empty((0,))
        return torch.empty_like(input), grad_weight, grad_bias


def _as_rows(t: torch.Tensor, normalized_shape: Sequence[int]) -> torch.Tensor:
    """t as [M, N] rows (N = prod(normalized_shape)), row-major: a copy only when t's
    layout is not already that."""
    rows = math.prod(t.shape[: t.dim() - len(normalized_shape)])
    return t.reshape(rows, math.prod(normalized_shape)).contiguous()


def _flat(param: torch.Tensor | None) -> torch.Tensor | None:
    return None if param is None else param.reshape(-1).contiguous()


class _LayerNormBackward(torch.autograd.Function):
    """The fused backward as a differentiable step, so that double backward works: its own
    backward differentiates the reference formula, recomputed from x."""

    @staticmethod
    def forward(grad_out, input, weight, bias, mean, rstd, normalized_shape, eps):
        grad_input, grad_weight, grad_bias = _ops.layer_norm_bwd(
            _as_rows(grad_out, normalized_shape), _as_rows(input, normalized_shape), mean, rstd,
            _flat(weight), _flat(bias),
        )
        grad_weight = grad_weight.view(normalized_shape) if weight is not None else None
        grad_bias = grad_bias.view(normalized_shape) if bias is not None else None
        return grad_input.view(input.shape), grad_weight, grad_bias

    @staticmethod
    def setup_context(ctx, inputs, output):
        grad_out, input, weight, bias, _mean, _rstd, normalized_shape, eps = inputs
        ctx.save_for_backward(grad_out, input, weight)
        ctx.normalized_shape, ctx.eps, ctx.has_bias = normalized_shape, eps, bias is not None

    @staticmethod
    def backward(ctx, ggrad_input, ggrad_weight, ggrad_bias):
        grad_out, input, weight = ctx.saved_tensors
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_() for t in (grad_out, input)]
            weight_leaf = weight.detach().requires_grad_() if weight is not None else None
            outputs = reference.layer_norm_backward(
                leaves[0], leaves[1], weight_leaf, ctx.eps, len(ctx.normalized_shape)
            )
            wrt = leaves + ([weight_leaf] if weight_leaf is not None else [])
            pairs = [
                (out, grad)
                for out, grad in zip(outputs, (ggrad_input, ggrad_weight, ggrad_bias))
                if grad is not None
            ]
            grads = torch.autograd.grad(
                [out for out, _ in pairs],
                wrt,
                [grad.to(out.dtype) for out, grad in pairs],
                create_graph=torch.is_grad_enabled(),
                allow_unused=True,
            )
        grad_weight = grads[2] if weight is not None else None
        return grads[0], grads[1], grad_weight, None, None, None, None, None


class FusedLayerNormFunction(torch.autograd.Function):
    """LayerNorm over the trailing `normalized_shape` dims of input, by fusednorm's kernels.

    apply(input, normalized_shape, weight, bias, eps) -> (output, mean, rstd), where mean
    and rstd are the per-row statistics (float32; float64 for float64 input), not
    differentiable. Saves input, the parameters and the statistics; the backward is one
    fused op, itself differentiable (double backward).
    """

    @staticmethod
    def forward(input, normalized_shape, weight, bias, eps):
        out, mean, rstd = _ops.layer_norm_fwd(
            _as_rows(input, normalized_shape), _flat(weight), _flat(bias), eps
        )
        return out.view(input.shape), mean, rstd

    @staticmethod
    def setup_context(ctx, inputs, output):
        input, normalized_shape, weight, bias, eps = inputs
        _out, mean, rstd = output
        ctx.mark_non_differentiable(mean, rstd)
        ctx.save_for_backward(input, weight, bias, mean, rstd)
        ctx.normalized_shape, ctx.eps = tuple(normalized_shape), eps

    @staticmethod
    def backward(ctx, grad_out, _grad_mean, _grad_rstd):
        input, weight, bias, mean, rstd = ctx.saved_tensors
        grad_input, grad_weight, grad_bias = _LayerNormBackward.apply(
            grad_out, input, weight, bias, mean, rstd, ctx.normalized_shape, ctx.eps
        )
        return grad_input, None, grad_weight, grad_bias, None


def fused_layer_norm(
    input: torch.Tensor,
    normalized_shape: Sequence[int],
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
) -> torch.Tensor:
    """Runs FusedLayerNormFunction on checked arguments and returns only the output."""
    return FusedLayerNormFunction.apply(input, tuple(normalized_shape), weight, bias, eps)[0]
