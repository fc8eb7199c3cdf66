"""Fake kernels of the backend ops, which work on contiguous [M, N] rows (schemas in
csrc/op_table.h, kernels in csrc/cpu and csrc/cuda)."""
from __future__ import annotations

import torch

from ._library import register_fake, row_stat


@register_fake("norm_fwd")
def _norm_fwd_fake(input, residual, weight, bias, eps, centered, sum_dtype=None, dropout_p=0.0,
                   rowscale=None, rng_state=None):
    rows = input.shape[0]
    total = (torch.empty_like(input, dtype=sum_dtype or input.dtype) if residual is not None
             else input.new_empty((0,)))
    mean = row_stat(input, rows if centered else 0)
    return torch.empty_like(input), total, mean, row_stat(input, rows)


@register_fake("norm_bwd")
def _norm_bwd_fake(grad_out, grad_sum, input, mean, rstd, weight, bias, centered, x_dtype=None,
                   dropout_p=0.0, rowscale=None, rng_state=None, param_grads=(True, True)):
    cols = input.shape[1]
    want_weight, want_bias = param_grads
    grad_weight = (weight.new_empty((cols,)) if weight is not None and want_weight
                   else input.new_empty((0,)))
    grad_bias = bias.new_empty((cols,)) if bias is not None and want_bias else input.new_empty((0,))
    grad_x = torch.empty_like(grad_out) if x_dtype is not None else input.new_empty((0,))
    return torch.empty_like(input), grad_weight, grad_bias, grad_x


@register_fake("dropout_scale")
def _dropout_scale_fake(grad, rowscale, rng_state, dropout_p, dtype):
    return torch.empty_like(grad, dtype=dtype)


@register_fake("layer_norm_apply")
def _layer_norm_apply_fake(input, mean, rstd, weight, bias):
    return input.new_empty(input.shape)


@register_fake("gelu_ffn_fwd")
def _gelu_ffn_fwd_fake(input, weight1, bias1, weight2, bias2, approximate):
    rows = input.shape[0]
    return input.new_empty((rows, weight2.shape[0])), input.new_empty((rows, weight1.shape[0]))


@register_fake("gelu_ffn_bwd")
def _gelu_ffn_bwd_fake(grad_out, input, hidden_pre, weight1, weight2, has_bias1, has_bias2,
                       approximate):
    hidden, out_features = weight1.shape[0], weight2.shape[0]
    return (
        input.new_empty(input.shape),
        weight1.new_empty(weight1.shape),
        input.new_empty((hidden if has_bias1 else 0,)),
        weight2.new_empty(weight2.shape),
        input.new_empty((out_features if has_bias2 else 0,)),
    )
