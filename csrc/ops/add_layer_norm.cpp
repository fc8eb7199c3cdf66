// fusednorm::add_layer_norm: s = input + residual (in the input's dtype, or float32 with
// residual_dtype; the input through dropout and rowscale first, if asked), then LayerNorm of
// s, in one pass over memory; returns (norm(s), s, mean, rstd, rng_state), the first two
// differentiable. A NormKind of the norm family (ops/norm_family.h) adapted to its schema.

#include <ATen/ops/add.h>
#include <torch/library.h>

#include "ops/norm_family.h"

namespace fusednorm {
namespace {

using namespace norm_family;
constexpr NormKind kKind{"fusednorm.add_layer_norm", /*centered=*/true, /*residual=*/true};

const auto& op() { return public_ops::add_layer_norm(); }

Outputs rows(const at::Tensor& input, const at::Tensor& residual,
             c10::SymIntArrayRef normalized_shape, const OptTensor& weight,
             const OptTensor& bias, double eps, bool zero_centered_weight,
             OptDtype residual_dtype, double dropout_p, const OptTensor& rowscale) {
  const at::ScalarType sum = sum_type(kKind, input, residual_dtype);
  const Params p = effective_params(kKind, input, weight, bias, zero_centered_weight);
  return forward_rows(kKind, input, residual, normalized_shape, p.weight, p.bias, eps, sum,
                      Dropout{dropout_p, rowscale});
}

Outputs autograd_kernel(const at::Tensor& input, const at::Tensor& residual,
                        c10::SymIntArrayRef normalized_shape, const OptTensor& weight,
                        const OptTensor& bias, double eps, bool zero_centered_weight,
                        OptDtype residual_dtype, double dropout_p, const OptTensor& rowscale) {
  const Params p = effective_params(kKind, input, weight, bias, zero_centered_weight);
  const auto below = [&] {
    return op().call(input, residual, normalized_shape, p.weight, p.bias, eps, false,
                     residual_dtype, dropout_p, rowscale);
  };
  return autograd_call(kKind, input, residual, normalized_shape, p.weight, p.bias, eps, below,
                       Dropout{dropout_p, rowscale});
}

// Under CUDA autocast: the sum as eager's (autocast leaves add and dropout alone; in
// residual_dtype), then layer_norm by its autocast rule (float32).
Outputs autocast_cuda(const at::Tensor& input, const at::Tensor& residual,
                      c10::SymIntArrayRef normalized_shape, const OptTensor& weight,
                      const OptTensor& bias, double eps, bool zero_centered_weight,
                      OptDtype residual_dtype, double dropout_p, const OptTensor& rowscale) {
  const auto [sum, rng_state] = autocast_sum(kKind, input, residual, residual_dtype,
                                             Dropout{dropout_p, rowscale}, [&] {
    return op().call(input, residual, normalized_shape, weight, bias, eps, zero_centered_weight,
                     residual_dtype, dropout_p, rowscale);
  });
  auto [out, mean, rstd] = public_ops::layer_norm().call(sum, normalized_shape, weight, bias,
                                                         eps, zero_centered_weight);
  return {out, sum, mean, rstd, rng_state};
}

}  // namespace
}  // namespace fusednorm

TORCH_LIBRARY_IMPL(fusednorm, CompositeExplicitAutograd, m) {
  m.impl("add_layer_norm", &fusednorm::rows);
}
TORCH_LIBRARY_IMPL(fusednorm, Autograd, m) {
  m.impl("add_layer_norm", &fusednorm::autograd_kernel);
}
TORCH_LIBRARY_IMPL(fusednorm, AutocastCUDA, m) {
  m.impl("add_layer_norm", &fusednorm::autocast_cuda);
}
