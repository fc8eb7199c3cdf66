"""fusednorm::add_rms_norm (csrc/ops/add_rms_norm.cpp): fake kernel."""
from __future__ import annotations

from ._library import leading_rows, overload, register_fake, row_stat

ADD_RMS_NORM = overload("add_rms_norm")


@register_fake("add_rms_norm")
def _fake(input, residual, normalized_shape, weight, eps, zero_centered_weight=False):
    from ..functional import _check_norm_call
    _check_norm_call("fusednorm.add_rms_norm", input, normalized_shape, weight, None, eps,
                     residual, True, zero_centered_weight)
    rows = leading_rows(input, len(normalized_shape))
    return input.new_empty(input.shape), input.new_empty(input.shape), row_stat(input, rows)
