"""fusednorm::layer_norm (csrc/ops/layer_norm.cpp): fake kernel and Function name."""
from __future__ import annotations

from ._library import (call_op, leading_rows, overload, register_fake,
                       require_library, row_stat)

LAYER_NORM = overload("layer_norm")


@register_fake("layer_norm")
def _fake(input, normalized_shape, weight, bias, eps, zero_centered_weight=False):
    from ..functional import _check_layer_norm_call
    _check_layer_norm_call(input, normalized_shape, weight, bias, eps, zero_centered_weight)
    rows = leading_rows(input, len(normalized_shape))
    return input.new_empty(input.shape), row_stat(input, rows), row_stat(input, rows)


class FusedLayerNormFunction:
    """LayerNorm over the trailing `normalized_shape` dims with fusednorm's kernels, as an
    autograd function: apply(input, normalized_shape, weight, bias, eps) -> (output, mean,
    rstd), mean and rstd the per-row statistics (float32; float64 for float64 input), not
    differentiable. The formula lives in C++ (the Autograd kernel of
    torch.ops.fusednorm.layer_norm): gradients of any order, no Python per call.
    """

    @staticmethod
    def apply(input, normalized_shape, weight, bias, eps):
        require_library()
        return call_op(LAYER_NORM, input, normalized_shape, weight, bias, eps)
