// fusednorm::rms_norm, the public RMSNorm op (torch.nn.functional.rms_norm's signature,
// plus rstd): a NormKind of the norm family (ops/norm_family.h) adapted to its schema.

#include <torch/library.h>

#include "ops/norm_family.h"

namespace fusednorm {
namespace {

using namespace norm_family;
using Result = std::tuple<at::Tensor, at::Tensor>;  // out, rstd
constexpr NormKind kKind{"fusednorm.rms_norm", /*centered=*/false, /*residual=*/false};

const auto& op() { return public_ops::rms_norm(); }

Result rows(const at::Tensor& input, c10::SymIntArrayRef normalized_shape,
            const OptTensor& weight, std::optional<double> eps, bool zero_centered_weight) {
  const Params p = effective_params(kKind, input, weight, std::nullopt, zero_centered_weight);
  auto [out, sum, mean, rstd, rng_state] = forward_rows(kKind, input, std::nullopt, normalized_shape,
                                             p.weight, std::nullopt,
                                             eps.value_or(default_rms_eps(input)));
  return {out, rstd};
}

Result autograd_kernel(const at::Tensor& input, c10::SymIntArrayRef normalized_shape,
                       const OptTensor& weight, std::optional<double> eps,
                       bool zero_centered_weight) {
  const Params p = effective_params(kKind, input, weight, std::nullopt, zero_centered_weight);
  const auto below = [&]() -> Outputs {
    auto [out, rstd] = op().call(input, normalized_shape, p.weight, eps, false);
    return {out, at::Tensor(), at::Tensor(), rstd, at::Tensor()};  // no sum, no mean
  };
  auto [out, sum, mean, rstd, rng_state] =
      autograd_call(kKind, input, std::nullopt, normalized_shape, p.weight, std::nullopt,
                    eps.value_or(default_rms_eps(input)), below);
  return {out, rstd};
}

Result autocast_cuda(const at::Tensor& input, c10::SymIntArrayRef normalized_shape,
                     const OptTensor& weight, std::optional<double> eps,
                     bool zero_centered_weight) {
  return autocast_cuda_fp32(
      [&](const at::Tensor& x, const OptTensor&, const OptTensor& w, const OptTensor&) {
        return op().call(x, normalized_shape, w, eps, zero_centered_weight);
      },
      input, std::nullopt, weight, std::nullopt);
}

}  // namespace
}  // namespace fusednorm

TORCH_LIBRARY_IMPL(fusednorm, CompositeExplicitAutograd, m) {
  m.impl("rms_norm", &fusednorm::rows);
}
TORCH_LIBRARY_IMPL(fusednorm, Autograd, m) {
  m.impl("rms_norm", &fusednorm::autograd_kernel);
}
TORCH_LIBRARY_IMPL(fusednorm, AutocastCUDA, m) {
  m.impl("rms_norm", &fusednorm::autocast_cuda);
}
