// fusednorm::add_rms_norm: s = input + residual (in the input's dtype, or float32 with
// residual_dtype), then RMSNorm of s,
// in one pass over memory; returns (norm(s), s, rstd), the first two differentiable. A
// NormKind of the norm family (ops/norm_family.h) adapted to its schema.

#include <ATen/ops/add.h>
#include <torch/library.h>

#include "ops/norm_family.h"

namespace fusednorm {
namespace {

using namespace norm_family;
using Result = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;  // out, sum, rstd, rng_state
constexpr NormKind kKind{"fusednorm.add_rms_norm", /*centered=*/false, /*residual=*/true};

const auto& op() { return public_ops::add_rms_norm(); }

Result rows(const at::Tensor& input, const at::Tensor& residual,
            c10::SymIntArrayRef normalized_shape, const OptTensor& weight,
            std::optional<double> eps, bool zero_centered_weight,
            OptDtype residual_dtype, double dropout_p, const OptTensor& rowscale) {
  const at::ScalarType type = sum_type(kKind, input, residual_dtype);
  const Params p = effective_params(kKind, input, weight, std::nullopt, zero_centered_weight);
  auto [out, sum, mean, rstd, rng_state] =
      forward_rows(kKind, input, residual, normalized_shape, p.weight, std::nullopt,
                   eps.value_or(default_rms_eps(input)), type, Dropout{dropout_p, rowscale});
  return {out, sum, rstd, rng_state};
}

Result autograd_kernel(const at::Tensor& input, const at::Tensor& residual,
                       c10::SymIntArrayRef normalized_shape, const OptTensor& weight,
                       std::optional<double> eps, bool zero_centered_weight,
                       OptDtype residual_dtype, double dropout_p, const OptTensor& rowscale) {
  const Params p = effective_params(kKind, input, weight, std::nullopt, zero_centered_weight);
  const auto below = [&]() -> Outputs {
    auto [out, sum, rstd, rng_state] = op().call(input, residual, normalized_shape, p.weight,
                                                 eps, false, residual_dtype, dropout_p, rowscale);
    return {out, sum, at::Tensor(), rstd, rng_state};  // no mean
  };
  auto [out, sum, mean, rstd, rng_state] =
      autograd_call(kKind, input, residual, normalized_shape, p.weight, std::nullopt,
                    eps.value_or(default_rms_eps(input)), below, Dropout{dropout_p, rowscale});
  return {out, sum, rstd, rng_state};
}

// Under CUDA autocast: the sum as eager's (autocast leaves add alone; in residual_dtype),
// then rms_norm by its autocast rule (float32).
Result autocast_cuda(const at::Tensor& input, const at::Tensor& residual,
                     c10::SymIntArrayRef normalized_shape, const OptTensor& weight,
                     std::optional<double> eps, bool zero_centered_weight,
                     OptDtype residual_dtype, double dropout_p, const OptTensor& rowscale) {
  const auto [sum, rng_state] = autocast_sum(kKind, input, residual, residual_dtype,
                                             Dropout{dropout_p, rowscale}, [&] {
    auto [out, s, rstd, state] = op().call(input, residual, normalized_shape, weight, eps,
                                           zero_centered_weight, residual_dtype, dropout_p,
                                           rowscale);
    return Outputs{out, s, at::Tensor(), rstd, state};
  });
  auto [out, rstd] =
      public_ops::rms_norm().call(sum, normalized_shape, weight, eps, zero_centered_weight);
  return {out, sum, rstd, rng_state};
}

}  // namespace
}  // namespace fusednorm

TORCH_LIBRARY_IMPL(fusednorm, CompositeExplicitAutograd, m) {
  m.impl("add_rms_norm", &fusednorm::rows);
}
TORCH_LIBRARY_IMPL(fusednorm, Autograd, m) {
  m.impl("add_rms_norm", &fusednorm::autograd_kernel);
}
TORCH_LIBRARY_IMPL(fusednorm, AutocastCUDA, m) {
  m.impl("add_rms_norm", &fusednorm::autocast_cuda);
}
