#pragma once
// Checks of the public ops' arguments (torch.ops.fusednorm.layer_norm, gelu_ffn, ...), with
// the user's argument names and the exception types of Python: TypeError for a wrong dtype,
// ValueError for a wrong shape or value, RuntimeError for a wrong device. They run once per
// call, before any reshape, so every path (eager, inference mode, compiled graphs) gets
// the same messages. Arguments of the wrong Python type never reach here: the op's schema
// rejects them and fusednorm/functional.py turns that into a TypeError naming them.
// Python does not repeat these: it only explains a rejection by the schema.

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>
#include <c10/util/string_view.h>

#include <sstream>
#include <string>

#include "common/checks.h"

namespace fusednorm {

// A dtype as Python prints it ("torch.float32"), so messages read the same from C++ as
// they did from Python.
inline std::string python_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return "torch.float32";
    case at::kDouble: return "torch.float64";
    case at::kHalf: return "torch.float16";
    case at::kBFloat16: return "torch.bfloat16";
    case at::kByte: return "torch.uint8";
    case at::kChar: return "torch.int8";
    case at::kShort: return "torch.int16";
    case at::kInt: return "torch.int32";
    case at::kLong: return "torch.int64";
    case at::kBool: return "torch.bool";
    case at::kComplexHalf: return "torch.complex32";
    case at::kComplexFloat: return "torch.complex64";
    case at::kComplexDouble: return "torch.complex128";
    default: return std::string("torch.") + c10::toString(t);
  }
}

// A layout as Python prints it ("torch.sparse_coo").
inline std::string python_layout(at::Layout l) {
  switch (l) {
    case at::kStrided: return "torch.strided";
    case at::kSparse: return "torch.sparse_coo";
    case at::kSparseCsr: return "torch.sparse_csr";
    case at::kSparseCsc: return "torch.sparse_csc";
    case at::kSparseBsr: return "torch.sparse_bsr";
    case at::kSparseBsc: return "torch.sparse_bsc";
    case at::kMkldnn: return "torch._mkldnn";
    case at::kJagged: return "torch.jagged";
    default: {
      std::ostringstream name;
      name << "layout " << l;
      return name.str();
    }
  }
}

inline bool is_supported_float(at::ScalarType t) {
  return t == at::kFloat || t == at::kDouble || is_reduced_float(t);
}

// A tensor argument's layout: strided (dense), as the kernels index it. Sparse and MKLDNN
// tensors otherwise failed deep inside a reshape, naming no argument.
inline void check_dense(const char* fn, const char* name, const at::Tensor& t) {
  if (C10_LIKELY(t.layout() == at::kStrided)) return;
  TORCH_CHECK_TYPE(false, fn, ": ", name, " must be a dense tensor (torch.strided), got ",
                   python_layout(t.layout()));
}

inline void check_public_input(const char* fn, const at::Tensor& input) {
  check_dense(fn, "input", input);
  TORCH_CHECK_TYPE(is_supported_float(input.scalar_type()), fn,
                   ": input must be float32, float64, float16 or bfloat16, got ",
                   python_dtype(input.scalar_type()));
}

// A LayerNorm weight or bias: normalized_shape, on input's device, a dtype that
// param_dtype_allowed (checks.h) accepts.
inline void check_norm_param(const char* fn, const char* name,
                             const std::optional<at::Tensor>& param, const at::Tensor& input,
                             at::IntArrayRef shape) {
  if (!param.has_value() || !param->defined()) return;
  const at::Tensor& p = *param;
  check_dense(fn, name, p);
  TORCH_CHECK_VALUE(p.sizes() == shape, fn, ": ", name, " must have shape normalized_shape=",
                    shape, ", got ", p.sizes());
  TORCH_CHECK(p.device() == input.device(), fn, ": ", name, " is on ", p.device(),
              " but input is on ", input.device());
  TORCH_CHECK_TYPE(param_dtype_allowed(input.scalar_type(), p.scalar_type()), fn, ": ", name,
                   " must have the input's dtype (", python_dtype(input.scalar_type()),
                   ") or float32 for a float16/bfloat16 input, got ",
                   python_dtype(p.scalar_type()));
}

inline void check_layer_norm_call(const char* fn, const at::Tensor& input,
                                  at::IntArrayRef shape,
                                  const std::optional<at::Tensor>& weight,
                                  const std::optional<at::Tensor>& bias, double eps) {
  check_public_input(fn, input);
  const int64_t dims = static_cast<int64_t>(shape.size());
  TORCH_CHECK_VALUE(
      dims > 0 && input.dim() >= dims && input.sizes().slice(input.dim() - dims) == shape, fn,
      ": normalized_shape=", shape,
      " must be non-empty and equal the trailing dims of input, whose shape is ",
      input.sizes());
  TORCH_CHECK_VALUE(eps >= 0.0, fn, ": eps must be a float >= 0, got ", eps);
  check_norm_param(fn, "weight", weight, input, shape);
  check_norm_param(fn, "bias", bias, input, shape);
  if (weight.has_value() && weight->defined() && bias.has_value() && bias->defined()) {
    TORCH_CHECK_TYPE(weight->scalar_type() == bias->scalar_type(), fn,
                     ": weight and bias must share a dtype, got ",
                     python_dtype(weight->scalar_type()), " and ",
                     python_dtype(bias->scalar_type()));
  }
}

// One tensor of the FFN: on input's device, with input's dtype.
inline void check_ffn_operand(const char* fn, const char* name, const at::Tensor& t,
                              const at::Tensor& input) {
  check_dense(fn, name, t);
  TORCH_CHECK(t.device() == input.device(), fn, ": ", name, " is on ", t.device(),
              " but input is on ", input.device());
  TORCH_CHECK_TYPE(t.scalar_type() == input.scalar_type(), fn, ": ", name,
                   " must have the input's dtype (", python_dtype(input.scalar_type()),
                   "), got ", python_dtype(t.scalar_type()));
}

inline void check_gelu_ffn_call(const char* fn, const at::Tensor& input,
                                const at::Tensor& weight1,
                                const std::optional<at::Tensor>& bias1,
                                const at::Tensor& weight2,
                                const std::optional<at::Tensor>& bias2,
                                c10::string_view approximate) {
  TORCH_CHECK_VALUE(approximate == "none" || approximate == "tanh", fn,
                    ": approximate must be 'none' or 'tanh', got '", approximate, "'");
  check_public_input(fn, input);
  check_ffn_operand(fn, "weight1", weight1, input);
  check_ffn_operand(fn, "weight2", weight2, input);
  const bool has_bias1 = bias1.has_value() && bias1->defined();
  const bool has_bias2 = bias2.has_value() && bias2->defined();
  if (has_bias1) check_ffn_operand(fn, "bias1", *bias1, input);
  if (has_bias2) check_ffn_operand(fn, "bias2", *bias2, input);
  TORCH_CHECK_VALUE(input.dim() >= 1, fn,
                    ": input must have at least one dim (the features), got a scalar");
  const int64_t in_features = input.size(-1);
  TORCH_CHECK_VALUE(weight1.dim() == 2 && weight1.size(1) == in_features, fn,
                    ": weight1 must have shape [hidden, ", in_features,
                    "] to match input of shape ", input.sizes(), ", got ", weight1.sizes());
  const int64_t hidden = weight1.size(0);
  TORCH_CHECK_VALUE(weight2.dim() == 2 && weight2.size(1) == hidden, fn,
                    ": weight2 must have shape [out_features, ", hidden,
                    "] to match weight1 of shape ", weight1.sizes(), ", got ", weight2.sizes());
  if (has_bias1) {
    TORCH_CHECK_VALUE(bias1->dim() == 1 && bias1->size(0) == hidden, fn,
                      ": bias1 must have shape [", hidden, "], got ", bias1->sizes());
  }
  if (has_bias2) {
    TORCH_CHECK_VALUE(bias2->dim() == 1 && bias2->size(0) == weight2.size(0), fn,
                      ": bias2 must have shape [", weight2.size(0), "], got ", bias2->sizes());
  }
}

}  // namespace fusednorm
