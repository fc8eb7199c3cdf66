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


# --- GELU feed-forward block -------------------------------------------------------------

if _loader.AVAILABLE:

    @torch.library.register_fake("fusednorm::layer_norm_apply")
    def _layer_norm_apply_fake(input, mean, rstd, weight, bias):
        return input.new_empty(input.shape)

    @torch.library.register_fake("fusednorm::gelu_ffn_fwd")
    def _gelu_ffn_fwd_fake(input, weight1, bias1, weight2, bias2, approximate):
        rows = input.shape[0]
        return input.new_empty((rows, weight2.shape[0])), input.new_empty((rows, weight1.shape[0]))

    @torch.library.register_fake("fusednorm::gelu_ffn_bwd")
    def _gelu_ffn_bwd_fake(
        grad_out, input, hidden_pre, weight1, weight2, has_bias1, has_bias2, approximate
    ):
        hidden, out_features = weight1.shape[0], weight2.shape[0]
        return (
            input.new_empty(input.shape),
            weight1.new_empty(weight1.shape),
            input.new_empty((hidden if has_bias1 else 0,)),
            weight2.new_empty(weight2.shape),
            input.new_empty((out_features if has_bias2 else 0,)),
        )


def _contiguous(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.contiguous()


def _gelu_ffn_grads(ctx, grad_out, input, hidden, weight1, weight2):
    """The fused backward on [M, K] / [M, N] rows: (dx [M, K], dW1, db1, dW2, db2), the bias
    gradients None where the bias was None."""
    grad_input, grad_w1, grad_b1, grad_w2, grad_b2 = _ops.gelu_ffn_bwd(
        grad_out, input, hidden, weight1.contiguous(), weight2.contiguous(),
        ctx.has_bias1, ctx.has_bias2, ctx.approximate,
    )
    return (
        grad_input,
        grad_w1,
        grad_b1 if ctx.has_bias1 else None,
        grad_w2,
        grad_b2 if ctx.has_bias2 else None,
    )


class GeluFFNFunction(torch.autograd.Function):
    """out = gelu(input @ weight1.T + bias1) @ weight2.T + bias2 over the last dim of input,
    by fusednorm's kernels (GELU exact or approximate="tanh").

    apply(input, weight1, bias1, weight2, bias2, approximate) -> (out, hidden_pre), where
    hidden_pre = input @ weight1.T + bias1 as [M, hidden] rows is not differentiable. Saves
    input and hidden_pre only (besides the weights): gelu(hidden_pre) is recomputed in the
    backward, which is one fused op and supports a single backward pass.
    """

    @staticmethod
    def forward(input, weight1, bias1, weight2, bias2, approximate):
        out, hidden = _ops.gelu_ffn_fwd(
            _as_rows(input, input.shape[-1:]), weight1.contiguous(), _contiguous(bias1),
            weight2.contiguous(), _contiguous(bias2), approximate,
        )
        return out.view(*input.shape[:-1], out.shape[1]), hidden

    @staticmethod
    def setup_context(ctx, inputs, output):
        input, weight1, bias1, weight2, bias2, approximate = inputs
        _out, hidden = output
        ctx.mark_non_differentiable(hidden)
        ctx.save_for_backward(input, hidden, weight1, weight2)
        ctx.has_bias1, ctx.has_bias2 = bias1 is not None, bias2 is not None
        ctx.approximate = approximate

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out, _grad_hidden):
        input, hidden, weight1, weight2 = ctx.saved_tensors
        grad_input, *param_grads = _gelu_ffn_grads(
            ctx, _as_rows(grad_out, weight2.shape[:1]), _as_rows(input, input.shape[-1:]),
            hidden, weight1, weight2,
        )
        return (grad_input.view(input.shape), *param_grads, None)


def fused_gelu_ffn(
    input: torch.Tensor,
    weight1: torch.Tensor,
    bias1: torch.Tensor | None,
    weight2: torch.Tensor,
    bias2: torch.Tensor | None,
    approximate: str,
) -> torch.Tensor:
    """Runs GeluFFNFunction on checked arguments and returns only the output."""
    return GeluFFNFunction.apply(input, weight1, bias1, weight2, bias2, approximate)[0]


class LayerNormGeluFFNFunction(torch.autograd.Function):
    """The pre-LN transformer feed-forward sub-block out = input + ffn(layer_norm(input)),
    ffn as GeluFFNFunction, LayerNorm over the last dim.

    apply(input, ln_weight, ln_bias, eps, weight1, bias1, weight2, bias2, approximate) ->
    (out, mean, rstd, hidden_pre); all but out are not differentiable. Saves input, the
    LayerNorm statistics and hidden_pre (besides the parameters), not the LayerNorm output:
    the backward recomputes it from input, mean and rstd.
    """

    @staticmethod
    def forward(input, ln_weight, ln_bias, eps, weight1, bias1, weight2, bias2, approximate):
        x = _as_rows(input, input.shape[-1:])
        normed, mean, rstd = _ops.layer_norm_fwd(x, _contiguous(ln_weight), _contiguous(ln_bias), eps)
        y, hidden = _ops.gelu_ffn_fwd(
            normed, weight1.contiguous(), _contiguous(bias1), weight2.contiguous(),
            _contiguous(bias2), approximate,
        )
        return (x + y).view(input.shape), mean, rstd, hidden

    @staticmethod
    def setup_context(ctx, inputs, output):
        input, ln_weight, ln_bias, eps, weight1, bias1, weight2, bias2, approximate = inputs
        _out, mean, rstd, hidden = output
        ctx.mark_non_differentiable(mean, rstd, hidden)
        ctx.save_for_backward(input, ln_weight, ln_bias, mean, rstd, hidden, weight1, weight2)
        ctx.has_bias1, ctx.has_bias2 = bias1 is not None, bias2 is not None
        ctx.approximate = approximate

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out, _grad_mean, _grad_rstd, _grad_hidden):
        input, ln_weight, ln_bias, mean, rstd, hidden, weight1, weight2 = ctx.saved_tensors
        x = _as_rows(input, input.shape[-1:])
        grad_rows = _as_rows(grad_out, input.shape[-1:])
        ln_weight, ln_bias = _contiguous(ln_weight), _contiguous(ln_bias)
        normed = _ops.layer_norm_apply(x, mean, rstd, ln_weight, ln_bias)
        grad_normed, *ffn_grads = _gelu_ffn_grads(ctx, grad_rows, normed, hidden, weight1, weight2)
        del normed
        grad_x, grad_ln_weight, grad_ln_bias = _ops.layer_norm_bwd(
            grad_normed, x, mean, rstd, ln_weight, ln_bias
        )
        grad_input = (grad_x + grad_rows).view(input.shape)  # the residual's share
        return (
            grad_input,
            grad_ln_weight if ln_weight is not None else None,
            grad_ln_bias if ln_bias is not None else None,
            None,
            *ffn_grads,
            None,
        )


def fused_layer_norm_gelu_ffn(
    input: torch.Tensor,
    ln_weight: torch.Tensor | None,
    ln_bias: torch.Tensor | None,
    eps: float,
    weight1: torch.Tensor,
    bias1: torch.Tensor | None,
    weight2: torch.Tensor,
    bias2: torch.Tensor | None,
    approximate: str,
) -> torch.Tensor:
    """Runs LayerNormGeluFFNFunction on checked arguments and returns only the output."""
    return LayerNormGeluFFNFunction.apply(
        input, ln_weight, ln_bias, eps, weight1, bias1, weight2, bias2, approximate
    )[0]
