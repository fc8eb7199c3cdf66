"""fusednorm::gelu_ffn (csrc/ops/gelu_ffn.cpp): fake kernel and Function name."""
from __future__ import annotations

from ._library import call_op, leading_rows, overload, register_fake, require_library

GELU_FFN = overload("gelu_ffn")


@register_fake("gelu_ffn")
def _fake(input, weight1, bias1, weight2, bias2, approximate):
    from ..functional import _check_gelu_ffn_call
    _check_gelu_ffn_call(input, weight1, bias1, weight2, bias2, approximate)
    out = input.new_empty((*input.shape[:-1], weight2.shape[0]))
    return out, input.new_empty((leading_rows(input, 1), weight1.shape[0]))


class GeluFFNFunction:
    """out = gelu(input @ weight1.T + bias1) @ weight2.T + bias2 over the last dim of input,
    as an autograd function: apply(input, weight1, bias1, weight2, bias2, approximate) ->
    (out, hidden_pre), hidden_pre = input @ weight1.T + bias1 as [M, hidden] rows, not
    differentiable. Only input and hidden_pre are saved (besides the parameters); the
    formula lives in C++ (torch.ops.fusednorm.gelu_ffn), gradients of any order.
    """

    @staticmethod
    def apply(input, weight1, bias1, weight2, bias2, approximate):
        require_library()
        return call_op(GELU_FFN, input, weight1, bias1, weight2, bias2, approximate)
