// fusednorm::layer_norm, the public LayerNorm op (torch.nn.functional.layer_norm's
// signature, plus the statistics): a NormKind of the norm family (ops/norm_family.h)
// adapted to its schema, and its registrations.

#include <torch/library.h>

#include "ops/norm_family.h"

namespace fusednorm {
namespace {

using namespace norm_family;
using Result = std::tuple<at::Tensor, at::Tensor, at::Tensor>;  // out, mean, rstd
constexpr NormKind kKind{"fusednorm.layer_norm", /*centered=*/true, /*residual=*/false};

const auto& op() { return public_ops::layer_norm(); }

Result rows(const at::Tensor& input, c10::SymIntArrayRef normalized_shape,
            const OptTensor& weight, const OptTensor& bias, double eps,
            bool zero_centered_weight) {
  const Params p = effective_params(kKind, input, weight, bias, zero_centered_weight);
  auto [out, sum, mean, rstd, rng_state] =
      forward_rows(kKind, input, std::nullopt, normalized_shape, p.weight, p.bias, eps);
  return {out, mean, rstd};
}

Result autograd_kernel(const at::Tensor& input, c10::SymIntArrayRef normalized_shape,
                       const OptTensor& weight, const OptTensor& bias, double eps,
                       bool zero_centered_weight) {
  const Params p = effective_params(kKind, input, weight, bias, zero_centered_weight);
  const auto below = [&]() -> Outputs {
    auto [out, mean, rstd] = op().call(input, normalized_shape, p.weight, p.bias, eps, false);
    return {out, at::Tensor(), mean, rstd, at::Tensor()};  // no sum without a residual
  };
  auto [out, sum, mean, rstd, rng_state] =
      autograd_call(kKind, input, std::nullopt, normalized_shape, p.weight, p.bias, eps, below);
  return {out, mean, rstd};
}

Result autocast_cuda(const at::Tensor& input, c10::SymIntArrayRef normalized_shape,
                     const OptTensor& weight, const OptTensor& bias, double eps,
                     bool zero_centered_weight) {
  return autocast_cuda_fp32(
      [&](const at::Tensor& x, const OptTensor&, const OptTensor& w, const OptTensor& b) {
        return op().call(x, normalized_shape, w, b, eps, zero_centered_weight);
      },
      input, std::nullopt, weight, bias);
}

}  // namespace
}  // namespace fusednorm

TORCH_LIBRARY_IMPL(fusednorm, CompositeExplicitAutograd, m) {
  m.impl("layer_norm", &fusednorm::rows);
}
TORCH_LIBRARY_IMPL(fusednorm, Autograd, m) {
  m.impl("layer_norm", &fusednorm::autograd_kernel);
}
TORCH_LIBRARY_IMPL(fusednorm, AutocastCUDA, m) {
  m.impl("layer_norm", &fusednorm::autocast_cuda);
}
