"""fusednorm::add_layer_norm (csrc/ops/add_layer_norm.cpp): fake kernel."""
from __future__ import annotations

from ._library import leading_rows, overload, register_fake, rng_state, row_stat

ADD_LAYER_NORM = overload("add_layer_norm")


@register_fake("add_layer_norm")
def _fake(input, residual, normalized_shape, weight, bias, eps, zero_centered_weight=False,
          residual_dtype=None, dropout_p=0.0, rowscale=None):
    from ..functional import _check_norm_call, _sum_dtype
    fn = "fusednorm.add_layer_norm"
    _check_norm_call(fn, input, normalized_shape, weight, bias, eps, residual, True,
                     zero_centered_weight, residual_dtype, dropout_p, rowscale)
    rows = leading_rows(input, len(normalized_shape))
    total = input.new_empty(input.shape, dtype=_sum_dtype(fn, input, residual_dtype))
    return (input.new_empty(input.shape), total, row_stat(input, rows), row_stat(input, rows),
            rng_state(input, dropout_p))
