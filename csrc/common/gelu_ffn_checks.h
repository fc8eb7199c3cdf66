#pragma once
// Argument checks of the GELU feed-forward ops (gelu_ffn_fwd / gelu_ffn_bwd), shared by the
// CPU and CUDA backends. The Python layer checks first with the user's argument names;
// these guard direct torch.ops calls so that no GEMM or kernel sees a tensor of the wrong
// shape, dtype, device or layout.
//
// Shapes: input [M, K], weight1 [H, K], bias1 [H], weight2 [N, H], bias2 [N], hidden_pre
// and its gradient [M, H], out / grad_out [M, N]. Every tensor has the input's dtype and
// device and is contiguous (row-major).

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include <c10/util/string_view.h>

#include "common/checks.h"
#include "common/gelu.h"

namespace fusednorm {

inline GeluKind parse_approximate(c10::string_view approximate) {
  TORCH_CHECK(approximate == "none" || approximate == "tanh",
              "fusednorm: approximate must be 'none' or 'tanh', got '", approximate, "'");
  return approximate == "tanh" ? GeluKind::kTanh : GeluKind::kExact;
}

// t has the given shape, input's dtype and device, and is contiguous.
inline void check_ffn_tensor(const at::Tensor& t, const char* name, at::IntArrayRef shape,
                             const at::Tensor& input) {
  TORCH_CHECK(t.sizes() == shape, "fusednorm: ", name, " must have shape ", shape, ", got ",
              t.sizes());
  TORCH_CHECK(t.device() == input.device(), "fusednorm: ", name, " is on ", t.device(),
              " but input is on ", input.device());
  TORCH_CHECK(t.scalar_type() == input.scalar_type(), "fusednorm: ", name,
              " must have the input's dtype (", input.scalar_type(), "), got ",
              t.scalar_type());
  TORCH_CHECK(t.is_contiguous(), "fusednorm: ", name, " must be contiguous");
}

inline void check_ffn_weights(const at::Tensor& input, const at::Tensor& weight1,
                              const at::Tensor& weight2) {
  check_rows(input, "input");
  TORCH_CHECK(weight1.dim() == 2 && weight1.size(1) == input.size(1), "fusednorm: weight1 must ",
              "be 2-D [hidden, ", input.size(1), "] for an input of shape ", input.sizes(),
              ", got ", weight1.sizes());
  check_ffn_tensor(weight1, "weight1", weight1.sizes(), input);
  TORCH_CHECK(weight2.dim() == 2 && weight2.size(1) == weight1.size(0), "fusednorm: weight2 ",
              "must be 2-D [out_features, ", weight1.size(0), "] for weight1 of shape ",
              weight1.sizes(), ", got ", weight2.sizes());
  check_ffn_tensor(weight2, "weight2", weight2.sizes(), input);
}

inline void check_gelu_ffn_fwd_args(const at::Tensor& input, const at::Tensor& weight1,
                                    const std::optional<at::Tensor>& bias1,
                                    const at::Tensor& weight2,
                                    const std::optional<at::Tensor>& bias2) {
  check_ffn_weights(input, weight1, weight2);
  if (given(bias1)) check_ffn_tensor(*bias1, "bias1", {weight1.size(0)}, input);
  if (given(bias2)) check_ffn_tensor(*bias2, "bias2", {weight2.size(0)}, input);
}

inline void check_gelu_ffn_bwd_args(const at::Tensor& grad_out, const at::Tensor& input,
                                    const at::Tensor& hidden_pre, const at::Tensor& weight1,
                                    const at::Tensor& weight2) {
  check_ffn_weights(input, weight1, weight2);
  check_ffn_tensor(grad_out, "grad_out", {input.size(0), weight2.size(0)}, input);
  check_ffn_tensor(hidden_pre, "hidden_pre", {input.size(0), weight1.size(0)}, input);
}

}  // namespace fusednorm
