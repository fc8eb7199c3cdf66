// fusednorm::gelu_ffn, the public GELU feed-forward op out = gelu(x W1^T + b1) W2^T + b2 over
// the last dim: argument checks, the [M, K] rows view for the backends' gelu_ffn_fwd /
// gelu_ffn_bwd kernels, its autograd formula (gradients of any order) and its autocast rule.

#include <ATen/autocast_mode.h>
#include <ATen/ops/gelu.h>
#include <ATen/ops/linear.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <string>
#include <tuple>

#include "common/op_support.h"
#include "common/public_checks.h"
#include "ops/row_ops.h"

namespace fusednorm {
namespace {

using torch::autograd::AutogradContext;
using OptTensor = std::optional<at::Tensor>;
using Result = std::tuple<at::Tensor, at::Tensor>;
using GeluFFNSig = Result(const at::Tensor&, const at::Tensor&, const OptTensor&,
                          const at::Tensor&, const OptTensor&, c10::string_view);

Result gelu_ffn_rows(const at::Tensor& input, const at::Tensor& weight1, const OptTensor& bias1,
                     const at::Tensor& weight2, const OptTensor& bias2,
                     c10::string_view approximate) {
  check_gelu_ffn_call("fusednorm.gelu_ffn", input, weight1, bias1, weight2, bias2, approximate);
  auto [out, hidden] = row_ops::gelu_ffn_fwd().call(
      as_rows(input, 1), weight1.contiguous(), contiguous_or_none(bias1), weight2.contiguous(),
      contiguous_or_none(bias2), approximate);
  if (input.dim() == 2) return {out, hidden};
  auto out_shape = input.sizes().vec();
  out_shape.back() = weight2.size(0);
  return {out.view(out_shape), hidden};
}

// The op from ATen's differentiable ops: what a create_graph backward differentiates and
// what gives forward-mode AD's tangent.
at::Tensor ffn_reference(const at::Tensor& input, const at::Tensor& weight1,
                         const OptTensor& bias1, const at::Tensor& weight2,
                         const OptTensor& bias2, c10::string_view approximate) {
  return at::linear(at::gelu(at::linear(input, weight1, bias1), approximate), weight2, bias2);
}

class GeluFFNFunction : public torch::autograd::Function<GeluFFNFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& input,
                               const at::Tensor& weight1, const OptTensor& bias1,
                               const at::Tensor& weight2, const OptTensor& bias2,
                               c10::string_view approximate) {
    static const auto op = fusednorm_op<GeluFFNSig>("fusednorm::gelu_ffn");
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    auto [out, hidden] = op.call(input, weight1, bias1, weight2, bias2, approximate);
    // hidden_pre = x W1^T + b1 is all the backward keeps besides the parameters: gelu of
    // it is recomputed there.
    ctx->save_for_backward({input, weight1, defined_or_empty(bias1), weight2,
                            defined_or_empty(bias2), hidden});
    ctx->saved_data["approximate"] = std::string(approximate);
    ctx->mark_non_differentiable({hidden});
    // Outputs nobody differentiated reach backward undefined, not as zero tensors of
    // their size (an [M, hidden] one for the FFN's pre-activation).
    ctx->set_materialize_grads(false);
    return {out, hidden};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto s = ctx->get_saved_variables();
    const at::Tensor &input = s[0], &weight1 = s[1], &bias1 = s[2], &weight2 = s[3],
                     &bias2 = s[4], &hidden = s[5];
    const std::string approximate = ctx->saved_data["approximate"].toStringRef();
    const at::Tensor& grad_out = grads[0];
    if (!grad_out.defined()) return variable_list(6);

    if (at::GradMode::is_enabled()) {  // create_graph=True: a differentiable backward
      auto g = differentiable_backward(
          [&](const variable_list& v) {
            return variable_list{ffn_reference(v[0], v[1], v[2], v[3], v[4], approximate)};
          },
          {input, weight1, bias1, weight2, bias2}, {grad_out});
      g.emplace_back();  // approximate
      return g;
    }

    // Grad mode is off: straight to the backend kernel (see NormBackward::apply).
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    auto [grad_input, grad_w1, grad_b1, grad_w2, grad_b2] = row_ops::gelu_ffn_bwd().call(
        as_rows(grad_out, 1), as_rows(input, 1), hidden, weight1.contiguous(),
        weight2.contiguous(), bias1.defined(), bias2.defined(), approximate);
    return {shaped_like(grad_input, input.sizes()), grad_w1, bias1.defined() ? grad_b1 : at::Tensor(),
            grad_w2, bias2.defined() ? grad_b2 : at::Tensor(), at::Tensor()};
  }
};

Result gelu_ffn_autograd(const at::Tensor& input, const at::Tensor& weight1,
                         const OptTensor& bias1, const at::Tensor& weight2,
                         const OptTensor& bias2, c10::string_view approximate) {
  Result result = [&]() -> Result {
    if (!needs_grad(input, weight1, bias1, weight2, bias2)) {
      static const auto op = fusednorm_op<GeluFFNSig>("fusednorm::gelu_ffn");
      at::AutoDispatchBelowADInplaceOrView below_autograd;
      return op.call(input, weight1, bias1, weight2, bias2, approximate);
    }
    auto r = GeluFFNFunction::apply(primal(input), primal(weight1), primal(bias1),
                                    primal(weight2), primal(bias2), approximate);
    return {r[0], r[1]};
  }();
  if (any_tangent(input, weight1, bias1, weight2, bias2)) {
    attach_tangent(std::get<0>(result),
                   ffn_reference(input, weight1, bias1, weight2, bias2, approximate));
  }
  return result;
}

// As torch.nn.functional.linear under autocast: every floating argument in the autocast
// dtype (float16 or bfloat16).
template <c10::DeviceType kDevice>
Result gelu_ffn_autocast(const at::Tensor& input, const at::Tensor& weight1,
                         const OptTensor& bias1, const at::Tensor& weight2,
                         const OptTensor& bias2, c10::string_view approximate) {
  static const auto op = fusednorm_op<GeluFFNSig>("fusednorm::gelu_ffn");
  c10::impl::ExcludeDispatchKeyGuard no_autocast(
      at::autocast::get_autocast_dispatch_key_from_device_type(kDevice));
  const auto dtype = at::autocast::get_autocast_dtype(kDevice);
  const auto cast = [dtype](const auto& t) { return at::autocast::cached_cast(dtype, t, kDevice); };
  return op.call(cast(input), cast(weight1), cast(bias1), cast(weight2), cast(bias2),
                 approximate);
}

}  // namespace
}  // namespace fusednorm

TORCH_LIBRARY_IMPL(fusednorm, CompositeExplicitAutograd, m) {
  m.impl("gelu_ffn", &fusednorm::gelu_ffn_rows);
}

TORCH_LIBRARY_IMPL(fusednorm, Autograd, m) {
  m.impl("gelu_ffn", &fusednorm::gelu_ffn_autograd);
}

TORCH_LIBRARY_IMPL(fusednorm, AutocastCPU, m) {
  m.impl("gelu_ffn", &fusednorm::gelu_ffn_autocast<c10::DeviceType::CPU>);
}

TORCH_LIBRARY_IMPL(fusednorm, AutocastCUDA, m) {
  m.impl("gelu_ffn", &fusednorm::gelu_ffn_autocast<c10::DeviceType::CUDA>);
}
