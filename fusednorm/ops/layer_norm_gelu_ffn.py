"""fusednorm::layer_norm_gelu_ffn (csrc/ops/layer_norm_gelu_ffn.cpp): fake kernel and
Function name."""
from __future__ import annotations

from ._library import (call_op, leading_rows, overload, register_fake,
                       require_library, row_stat)

LAYER_NORM_GELU_FFN = overload("layer_norm_gelu_ffn")


@register_fake("layer_norm_gelu_ffn")
def _fake(input, ln_weight, ln_bias, eps, weight1, bias1, weight2, bias2, approximate):
    from ..functional import _check_layer_norm_gelu_ffn_call
    _check_layer_norm_gelu_ffn_call(input, ln_weight, ln_bias, eps, weight1, bias1, weight2, bias2,
                                    approximate)
    rows = leading_rows(input, 1)
    hidden = input.new_empty((rows, weight1.shape[0]))
    return input.new_empty(input.shape), row_stat(input, rows), row_stat(input, rows), hidden


class LayerNormGeluFFNFunction:
    """The pre-LN feed-forward sub-block out = input + ffn(layer_norm(input)) as an
    autograd function: apply(input, ln_weight, ln_bias, eps, weight1, bias1, weight2, bias2,
    approximate) -> (out, mean, rstd, hidden_pre); all but out are not differentiable. Saves
    input, the LayerNorm statistics and hidden_pre, not the LayerNorm output, which the
    backward recomputes. The formula lives in C++ (torch.ops.fusednorm.layer_norm_gelu_ffn).
    """

    @staticmethod
    def apply(input, ln_weight, ln_bias, eps, weight1, bias1, weight2, bias2, approximate):
        require_library()
        return call_op(LAYER_NORM_GELU_FFN, 
            input, ln_weight, ln_bias, eps, weight1, bias1, weight2, bias2, approximate
        )
