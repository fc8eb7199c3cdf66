"""fusednorm's compiled ops as Python sees them: fake kernels, and the Function names.

Everything a call needs (argument checks, the view as [M, N] rows, the autograd formula
with gradients of any order, the autocast rule) lives in C++, in csrc/ops/<op>.cpp, so a
call is one torch.ops call with no Python on its way. Python adds what tracing needs: a
fake kernel per op, which says the output shapes without reading data, so that
torch.compile(fullgraph=True) and torch.export see every op as one opaque node.
"""
from __future__ import annotations

import math

import torch

from . import _loader

_ops = torch.ops.fusednorm if _loader.AVAILABLE else None

# The public ops' overloads, called directly (an OpOverload call skips the packet's
# overload resolution); None when the library is not loaded.
LAYER_NORM = _ops.layer_norm.default if _ops is not None else None
GELU_FFN = _ops.gelu_ffn.default if _ops is not None else None
LAYER_NORM_GELU_FFN = _ops.layer_norm_gelu_ffn.default if _ops is not None else None


def _stats_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _row_stats(input: torch.Tensor, rows) -> tuple[torch.Tensor, torch.Tensor]:
    stats = input.new_empty((rows,), dtype=_stats_dtype(input.dtype))
    return stats, torch.empty_like(stats)


def _check_devices(fn: str, input: torch.Tensor, **tensors) -> None:
    """A fake kernel also serves meta tensors, which may come mixed with real ones (the
    dispatcher picks the meta kernel then): the device check of the C++ op, repeated."""
    for name, t in tensors.items():
        if t is not None and t.device != input.device:
            raise RuntimeError(f"{fn}: {name} is on {t.device} but input is on {input.device}")


if _loader.AVAILABLE:

    # --- public ops (any shape) ----------------------------------------------------------

    @torch.library.register_fake("fusednorm::layer_norm")
    def _layer_norm_fake(input, normalized_shape, weight, bias, eps):
        _check_devices("fusednorm.layer_norm", input, weight=weight, bias=bias)
        rows = math.prod(input.shape[: input.dim() - len(normalized_shape)])
        return (input.new_empty(input.shape), *_row_stats(input, rows))

    @torch.library.register_fake("fusednorm::gelu_ffn")
    def _gelu_ffn_fake(input, weight1, bias1, weight2, bias2, approximate):
        _check_devices("fusednorm.gelu_ffn", input, weight1=weight1, bias1=bias1,
                       weight2=weight2, bias2=bias2)
        rows = math.prod(input.shape[:-1])
        out = input.new_empty((*input.shape[:-1], weight2.shape[0]))
        return out, input.new_empty((rows, weight1.shape[0]))

    @torch.library.register_fake("fusednorm::layer_norm_gelu_ffn")
    def _layer_norm_gelu_ffn_fake(
        input, ln_weight, ln_bias, eps, weight1, bias1, weight2, bias2, approximate
    ):
        _check_devices("fusednorm.layer_norm_gelu_ffn", input, ln_weight=ln_weight,
                       ln_bias=ln_bias, weight1=weight1, bias1=bias1, weight2=weight2,
                       bias2=bias2)
        rows = math.prod(input.shape[:-1])
        hidden = input.new_empty((rows, weight1.shape[0]))
        return (input.new_empty(input.shape), *_row_stats(input, rows), hidden)

    # --- backend ops ([M, N] rows) ---------------------------------------------------------

    @torch.library.register_fake("fusednorm::layer_norm_fwd")
    def _layer_norm_fwd_fake(input, weight, bias, eps):
        return (torch.empty_like(input), *_row_stats(input, input.shape[0]))

    @torch.library.register_fake("fusednorm::layer_norm_bwd")
    def _layer_norm_bwd_fake(grad_out, input, mean, rstd, weight, bias):
        cols = input.shape[1]
        grad_weight = weight.new_empty((cols,)) if weight is not None else input.new_empty((0,))
        grad_bias = bias.new_empty((cols,)) if bias is not None else input.new_empty((0,))
        return torch.empty_like(input), grad_weight, grad_bias

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


def _require_library() -> None:
    if _ops is None:
        raise RuntimeError(f"fusednorm's compiled ops are not available: {_loader.LOAD_ERROR}")


class FusedLayerNormFunction:
    """LayerNorm over the trailing `normalized_shape` dims with fusednorm's kernels, as an
    autograd function: apply(input, normalized_shape, weight, bias, eps) -> (output, mean,
    rstd), mean and rstd the per-row statistics (float32; float64 for float64 input), not
    differentiable. The formula lives in C++ (the Autograd kernel of
    torch.ops.fusednorm.layer_norm): gradients of any order, no Python per call.
    """

    @staticmethod
    def apply(input, normalized_shape, weight, bias, eps):
        _require_library()
        return LAYER_NORM(input, normalized_shape, weight, bias, eps)


class GeluFFNFunction:
    """out = gelu(input @ weight1.T + bias1) @ weight2.T + bias2 over the last dim of input,
    as an autograd function: apply(input, weight1, bias1, weight2, bias2, approximate) ->
    (out, hidden_pre), hidden_pre = input @ weight1.T + bias1 as [M, hidden] rows, not
    differentiable. Only input and hidden_pre are saved (besides the parameters); the
    formula lives in C++ (torch.ops.fusednorm.gelu_ffn), gradients of any order.
    """

    @staticmethod
    def apply(input, weight1, bias1, weight2, bias2, approximate):
        _require_library()
        return GELU_FFN(input, weight1, bias1, weight2, bias2, approximate)


class LayerNormGeluFFNFunction:
    """The pre-LN feed-forward sub-block out = input + ffn(layer_norm(input)) as an
    autograd function: apply(input, ln_weight, ln_bias, eps, weight1, bias1, weight2, bias2,
    approximate) -> (out, mean, rstd, hidden_pre); all but out are not differentiable. Saves
    input, the LayerNorm statistics and hidden_pre, not the LayerNorm output, which the
    backward recomputes. The formula lives in C++ (torch.ops.fusednorm.layer_norm_gelu_ffn).
    """

    @staticmethod
    def apply(input, ln_weight, ln_bias, eps, weight1, bias1, weight2, bias2, approximate):
        _require_library()
        return LAYER_NORM_GELU_FFN(
            input, ln_weight, ln_bias, eps, weight1, bias1, weight2, bias2, approximate
        )
