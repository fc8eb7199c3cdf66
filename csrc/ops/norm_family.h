#pragma once
// What the norm family's public ops share (layer_norm, rms_norm, add_layer_norm,
// add_rms_norm): one op is a NormKind (centered or not, residual or not) plus its schema.
// This header holds, for every kind: the checks and the [M, N] rows view around the backend
// kernels, the autograd formula (fused backward; ATen recomputation under create_graph)
// and CUDA autocast. A csrc/ops/<op>.cpp adapts its schema to these and registers them.

#include <ATen/autocast_mode.h>
#include <ATen/ops/add.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/layer_norm.h>
#include <ATen/ops/rms_norm.h>
#include <torch/autograd.h>

#include <functional>
#include <tuple>

#include "common/op_support.h"
#include "common/public_checks.h"
#include "ops/row_ops.h"

namespace fusednorm::norm_family {

using OptTensor = std::optional<at::Tensor>;
// (out, sum, mean, rstd): sum is input + residual ([0] without a residual), mean [0] for
// RMSNorm; every op returns the ones its schema names.
using Outputs = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

struct NormKind {
  const char* name;  // the Python function, for messages: "fusednorm.rms_norm"
  bool centered;     // LayerNorm (subtracts the mean) or RMSNorm
  bool residual;     // normalizes input + residual and returns the sum too
};

// torch.nn.functional.rms_norm's eps=None: the machine epsilon of the computation type
// (float32's for float16/bfloat16/float32 input, float64's for float64).
inline double default_rms_eps(const at::Tensor& input) {
  return input.scalar_type() == at::kDouble ? std::numeric_limits<double>::epsilon()
                                            : std::numeric_limits<float>::epsilon();
}

inline void check_residual(const NormKind& kind, const at::Tensor& input,
                           const at::Tensor& residual) {
  TORCH_CHECK_VALUE(residual.sizes() == input.sizes(), kind.name,
                    ": residual must have the input's shape ", input.sizes(), ", got ",
                    residual.sizes());
  TORCH_CHECK(residual.device() == input.device(), kind.name, ": residual is on ",
              residual.device(), " but input is on ", input.device());
  TORCH_CHECK_TYPE(residual.scalar_type() == input.scalar_type(), kind.name,
                   ": residual must have the input's dtype (", python_dtype(input.scalar_type()),
                   "), got ", python_dtype(residual.scalar_type()));
}

// Below autograd, any backend: check, view as rows, run the backend kernel, give back the
// input's shape. LayerNorm alone runs on layer_norm_fwd, the rest on norm_fwd.
inline Outputs forward_rows(const NormKind& kind, const at::Tensor& input,
                            const OptTensor& residual, c10::SymIntArrayRef normalized_shape,
                            const OptTensor& weight, const OptTensor& bias, double eps) {
  const auto shape = C10_AS_INTARRAYREF_SLOW(normalized_shape);
  check_layer_norm_call(kind.name, input, shape, weight, bias, eps);
  if (kind.residual) check_residual(kind, input, *residual);
  const auto dims = static_cast<int64_t>(shape.size());
  const at::Tensor x = as_rows(input, dims);
  if (kind.centered && !kind.residual) {
    auto [out, mean, rstd] = row_ops::layer_norm_fwd().call(x, flat(weight), flat(bias), eps);
    return {shaped_like(out, input.sizes()), at::empty({0}, input.options()), mean, rstd};
  }
  const OptTensor r = kind.residual ? OptTensor(as_rows(*residual, dims)) : std::nullopt;
  auto [out, sum, mean, rstd] =
      row_ops::norm_fwd().call(x, r, flat(weight), flat(bias), eps, kind.centered);
  if (kind.residual) sum = shaped_like(sum, input.sizes());
  return {shaped_like(out, input.sizes()), sum, mean, rstd};
}

// The op itself, called below autograd by the autograd kernel (so that a compiled graph
// records the public op, with its fake kernel). Outputs the op's schema lacks are empty
// tensors (`none_like`).
using BelowAutograd = std::function<Outputs()>;

inline at::Tensor none_like(const at::Tensor& t) { return at::empty({0}, t.options()); }

class NormFunction : public torch::autograd::Function<NormFunction> {
 public:
  static variable_list forward(torch::autograd::AutogradContext* ctx, const at::Tensor& input,
                               const OptTensor& residual, const OptTensor& weight,
                               const OptTensor& bias, const NormKind& kind, int64_t dims,
                               double eps, const BelowAutograd& below) {
    auto [out, sum, mean, rstd] = [&] {
      at::AutoDispatchBelowADInplaceOrView below_autograd;
      return below();
    }();
    // Saved: what was normalized (input, or the sum output), and for a create_graph
    // backward the inputs it recomputes from.
    ctx->save_for_backward({kind.residual ? sum : input, defined_or_empty(weight),
                            defined_or_empty(bias), mean, rstd, input,
                            defined_or_empty(residual)});
    ctx->saved_data["centered"] = kind.centered;
    ctx->saved_data["residual"] = kind.residual;
    ctx->saved_data["dims"] = dims;
    ctx->saved_data["eps"] = eps;
    ctx->mark_non_differentiable(kind.residual ? variable_list{mean, rstd}
                                               : variable_list{sum, mean, rstd});
    // Outputs nobody differentiated reach backward undefined, not as zero tensors of
    // their size (an [M, hidden] one for the FFN's pre-activation).
    ctx->set_materialize_grads(false);
    return {out, sum, mean, rstd};
  }

  // Gradients for (input, residual, weight, bias) and the non-tensor arguments.
  static variable_list backward(torch::autograd::AutogradContext* ctx, variable_list grads) {
    const auto s = ctx->get_saved_variables();
    const at::Tensor &normed_input = s[0], &weight = s[1], &bias = s[2], &mean = s[3],
                     &rstd = s[4], &input = s[5], &residual = s[6];
    const bool centered = ctx->saved_data["centered"].toBool();
    const bool has_residual = ctx->saved_data["residual"].toBool();
    const int64_t dims = ctx->saved_data["dims"].toInt();
    const double eps = ctx->saved_data["eps"].toDouble();
    const at::Tensor& grad_out = grads[0];
    const at::Tensor grad_sum = has_residual ? grads[1] : at::Tensor();
    variable_list result(8);
    if (!grad_out.defined() && !grad_sum.defined()) return result;
    const auto shape = input.sym_sizes().slice(input.dim() - dims);

    if (at::GradMode::is_enabled()) {  // create_graph=True: a differentiable backward
      auto g = differentiable_backward(
          [&](const variable_list& v) {
            const at::Tensor sum = has_residual ? at::add(v[0], v[1]) : v[0];
            const at::Tensor y = centered ? at::layer_norm_symint(sum, shape, v[2], v[3], eps)
                                          : at::rms_norm_symint(sum, shape, v[2], eps);
            return variable_list{y, sum};
          },
          {input, residual, weight, bias}, {grad_out, grad_sum});
      std::copy(g.begin(), g.end(), result.begin());
      return result;
    }

    const at::Tensor x = as_rows(normed_input, dims);
    const at::Tensor dy =
        grad_out.defined() ? as_rows(grad_out, dims) : at::zeros_like(x);  // sum used alone
    at::Tensor grad_input, grad_weight, grad_bias;
    if (centered && !has_residual) {
      std::tie(grad_input, grad_weight, grad_bias) =
          row_ops::layer_norm_bwd().call(dy, x, mean, rstd, flat(weight), flat(bias));
    } else {
      const OptTensor ds = grad_sum.defined() ? OptTensor(as_rows(grad_sum, dims)) : std::nullopt;
      std::tie(grad_input, grad_weight, grad_bias) = row_ops::norm_bwd().call(
          dy, ds, x, mean, rstd, flat(weight), flat(bias), centered);
    }
    grad_input = shaped_like(grad_input, input.sizes());
    result[0] = grad_input;
    if (has_residual) result[1] = grad_input;  // d(input + residual) / d residual = 1
    if (weight.defined()) result[2] = grad_weight.view(weight.sizes());
    if (bias.defined()) result[3] = grad_bias.view(bias.sizes());
    return result;
  }
};

// The autograd kernel of every norm op when a graph is recorded (each op calls itself
// below autograd directly when not: a Function costs a node and its bookkeeping).
inline Outputs record(const NormKind& kind, const at::Tensor& input, const OptTensor& residual,
                      int64_t dims, const OptTensor& weight, const OptTensor& bias, double eps,
                      const BelowAutograd& below) {
  auto r = NormFunction::apply(input, residual, weight, bias, kind, dims, eps, below);
  return {r[0], r[1], r[2], r[3]};
}

// CUDA autocast as torch.nn.functional's: layer_norm and rms_norm are on autocast's
// float32 list, so float16/bfloat16 tensors run (and return) in float32.
template <class Call>
auto autocast_cuda_fp32(const Call& call_below, const at::Tensor& input, const OptTensor& residual,
                        const OptTensor& weight, const OptTensor& bias) {
  c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::DispatchKey::AutocastCUDA);
  const auto cuda = c10::DeviceType::CUDA;
  const auto fp32 = [&](const auto& t) { return at::autocast::cached_cast(at::kFloat, t, cuda); };
  return call_below(fp32(input), fp32(residual), fp32(weight), fp32(bias));
}

}  // namespace fusednorm::norm_family
