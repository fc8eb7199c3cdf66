"""The public ops written with ATen ops, for torch.onnx.export: while it traces a model
(torch.onnx.is_in_onnx_export()), fusednorm.functional calls these instead of the fused ops,
so the exported graph holds ATen ops that ONNX has functions for (LayerNorm becomes
ONNX's LayerNormalization, as nn.LayerNorm's export does; RMSNorm RMSNormalization from
opset 23). Not in torch._decomp's table, which the ONNX exporter also reads: torch.compile
(inductor) refuses, under CI=1, a fallback kernel for an op that has a decomposition there.

The TorchScript-based exporter (dynamo=False) traces with the JIT tracer
(torch.jit.is_tracing()) and has its own table of ONNX functions: LayerNormalization for
aten::layer_norm (opset 17 on), primitives for aten::native_layer_norm, nothing for
aten::rms_norm (nn.RMSNorm does not export there); for it the norms are written with those.

Each gives the op's outputs (the statistics too) with its dtypes and shapes, in its
computation type (float32; float64 for float64 inputs), rounded once, as the kernels.
The add ops' dropout has no ATen form (its mask is fusednorm's Philox stream): with
dropout_p > 0 the decomposition raises; the modules pass 0 in eval mode.
"""
from __future__ import annotations

import torch

from ..errors import FusedValueError
from ..reference import rms_eps
from ._library import stats_dtype


def _weight(weight, zero_centered_weight, acc):
    """The weight applied, in the computation type: 1 + weight when zero-centered."""
    if weight is None:
        return None
    return weight.to(acc) + 1 if zero_centered_weight else weight.to(acc)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """A [*leading, 1, ...] statistic as the ops return it: [M]."""
    return t.reshape(-1)


def layer_norm(input, normalized_shape, weight, bias, eps, zero_centered_weight=False):
    acc = stats_dtype(input.dtype)
    x, weight = input.to(acc), _weight(weight, zero_centered_weight, acc)
    bias = None if bias is None else bias.to(acc)
    out, mean, rstd = torch.ops.aten.native_layer_norm.default(x, normalized_shape, weight, bias,
                                                               eps)
    if torch.jit.is_tracing():  # the TorchScript exporter: aten::layer_norm, the ONNX op
        out = torch.ops.aten.layer_norm.default(x, normalized_shape, weight, bias, eps)
    return out.to(input.dtype), _rows(mean), _rows(rstd)


def rms_norm(input, normalized_shape, weight, eps, zero_centered_weight=False):
    acc = stats_dtype(input.dtype)
    x = input.to(acc)
    eps = rms_eps(input.dtype) if eps is None else eps
    weight = _weight(weight, zero_centered_weight, acc)
    # (Most graphs leave rstd unused, and the exporter drops it.)
    dims = tuple(range(-len(normalized_shape), 0))
    rstd = torch.rsqrt(x.square().mean(dims, keepdim=True) + eps)
    if torch.jit.is_tracing():  # the TorchScript exporter, which has no aten::rms_norm
        out = x * rstd if weight is None else x * rstd * weight
    else:  # aten.rms_norm: ONNX's RMSNormalization from opset 23, its own decomposition below
        out = torch.ops.aten.rms_norm.default(x, normalized_shape, weight, eps)
    return out.to(input.dtype), _rows(rstd)


def _sum(fn, input, residual, dims, residual_dtype, dropout_p, rowscale):
    """s = input * rowscale[row] + residual in the sum's dtype (the product and the add in
    the computation type, then one rounding), or input + residual as eager's add."""
    from ..functional import _sum_dtype

    if dropout_p > 0:
        raise FusedValueError(
            f"{fn}: dropout_p={dropout_p} has no decomposition into ATen ops (its mask is "
            "fusednorm's Philox stream); export the model in eval mode, where fusednorm's "
            "modules pass dropout_p=0")
    sum_dtype = _sum_dtype(fn, input, residual_dtype)
    if rowscale is None:
        return input.to(sum_dtype) + residual.to(sum_dtype)
    acc = stats_dtype(input.dtype)
    scale = rowscale.to(acc).reshape(*rowscale.shape, *([1] * dims))
    return (input.to(acc) * scale + residual.to(acc)).to(sum_dtype)


def _no_rng_state(input):
    return input.new_empty((0,), dtype=torch.int64)


def add_layer_norm(input, residual, normalized_shape, weight, bias, eps,
                   zero_centered_weight=False, residual_dtype=None, dropout_p=0.0, rowscale=None):
    total = _sum("fusednorm.add_layer_norm", input, residual, len(normalized_shape),
                 residual_dtype, dropout_p, rowscale)
    out, mean, rstd = layer_norm(total, normalized_shape, weight, bias, eps, zero_centered_weight)
    return out.to(input.dtype), total, mean, rstd, _no_rng_state(input)


def add_rms_norm(input, residual, normalized_shape, weight, eps, zero_centered_weight=False,
                 residual_dtype=None, dropout_p=0.0, rowscale=None):
    total = _sum("fusednorm.add_rms_norm", input, residual, len(normalized_shape), residual_dtype,
                 dropout_p, rowscale)
    out, rstd = rms_norm(total, normalized_shape, weight, eps, zero_centered_weight)
    return out.to(input.dtype), total, rstd, _no_rng_state(input)


def gelu_ffn(input, weight1, bias1, weight2, bias2, approximate):
    hidden = torch.nn.functional.linear(input, weight1, bias1)
    out = torch.nn.functional.linear(torch.nn.functional.gelu(hidden, approximate=approximate),
                                     weight2, bias2)
    return out, hidden.reshape(-1, weight1.shape[0])


def layer_norm_gelu_ffn(input, ln_weight, ln_bias, eps, weight1, bias1, weight2, bias2,
                        approximate):
    normed, mean, rstd = layer_norm(input, input.shape[-1:], ln_weight, ln_bias, eps)
    out, hidden = gelu_ffn(normed, weight1, bias1, weight2, bias2, approximate)
    return input + out, mean, rstd, hidden
