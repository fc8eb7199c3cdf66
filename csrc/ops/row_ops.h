#pragma once
// Typed dispatcher handles of the backend ops on [M, N] rows (schemas in
// csrc/fusednorm.cpp, kernels in csrc/cpu and csrc/cuda), for the public ops of csrc/ops
// to call. Each is looked up once.

#include <ATen/core/Tensor.h>
#include <c10/util/string_view.h>

#include <tuple>

#include "common/op_support.h"

namespace fusednorm::row_ops {

using OptTensor = std::optional<at::Tensor>;
using Tensor3 = std::tuple<at::Tensor, at::Tensor, at::Tensor>;

inline const auto& layer_norm_fwd() {
  static const auto op = fusednorm_op<Tensor3(const at::Tensor&, const OptTensor&,
                                              const OptTensor&, double)>("fusednorm::layer_norm_fwd");
  return op;
}

inline const auto& layer_norm_bwd() {
  static const auto op =
      fusednorm_op<Tensor3(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                           const at::Tensor&, const OptTensor&, const OptTensor&)>(
          "fusednorm::layer_norm_bwd");
  return op;
}

inline const auto& norm_fwd() {
  static const auto op = fusednorm_op<std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
      const at::Tensor&, const OptTensor&, const OptTensor&, const OptTensor&, double, bool)>(
      "fusednorm::norm_fwd");
  return op;
}

inline const auto& norm_bwd() {
  static const auto op =
      fusednorm_op<Tensor3(const at::Tensor&, const OptTensor&, const at::Tensor&,
                           const at::Tensor&, const at::Tensor&, const OptTensor&,
                           const OptTensor&, bool)>("fusednorm::norm_bwd");
  return op;
}

inline const auto& layer_norm_apply() {
  static const auto op =
      fusednorm_op<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                              const OptTensor&, const OptTensor&)>("fusednorm::layer_norm_apply");
  return op;
}

inline const auto& gelu_ffn_fwd() {
  static const auto op = fusednorm_op<std::tuple<at::Tensor, at::Tensor>(
      const at::Tensor&, const at::Tensor&, const OptTensor&, const at::Tensor&,
      const OptTensor&, c10::string_view)>("fusednorm::gelu_ffn_fwd");
  return op;
}

inline const auto& gelu_ffn_bwd() {
  static const auto op = fusednorm_op<
      std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
          const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
          const at::Tensor&, bool, bool, c10::string_view)>("fusednorm::gelu_ffn_bwd");
  return op;
}

}  // namespace fusednorm::row_ops
