"""fusednorm::add_layer_norm (csrc/ops/add_layer_norm.cpp): fake kernel."""
from __future__ import annotations

from ._library import leading_rows, overload, register_fake, row_stat

ADD_LAYER_NORM = overload("add_layer_norm")


@register_fake("add_layer_norm")
def _fake(input, residual, normalized_shape, weight, bias, eps, zero_centered_weight=False):
    from ..functional import _check_norm_call
    _check_norm_call("fusednorm.add_layer_norm", input, normalized_shape, weight, bias, eps,
                     residual, True, zero_centered_weight)
    rows = leading_rows(input, len(normalized_shape))
    return (input.new_empty(input.shape), input.new_empty(input.shape), row_stat(input, rows),
            row_stat(input, rows))
