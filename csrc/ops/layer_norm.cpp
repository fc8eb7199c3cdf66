// fusednorm::layer_norm, the public LayerNorm op: argument checks, the view of any input as
// [M, N] rows for the backends' layer_norm_fwd / layer_norm_bwd kernels, its autograd
// formula and its autocast rule. Everything a call needs happens in C++, so the Python
// function is one torch.ops call.

#include <ATen/autocast_mode.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/layer_norm.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <tuple>

#include "common/op_support.h"
#include "common/public_checks.h"
#include "ops/row_ops.h"

namespace fusednorm {
namespace {

using torch::autograd::AutogradContext;
using Stats = std::tuple<at::Tensor, at::Tensor, at::Tensor>;
using OptTensor = std::optional<at::Tensor>;

using LayerNormSig = Stats(const at::Tensor&, c10::SymIntArrayRef, const OptTensor&,
                           const OptTensor&, double);

// Below autograd: check, flatten to rows, run the backend's kernel, give back the input's
// shape. Registered for every backend (CompositeExplicitAutograd).
Stats layer_norm_rows(const at::Tensor& input, c10::SymIntArrayRef normalized_shape,
                      const OptTensor& weight, const OptTensor& bias, double eps) {
  const auto shape = C10_AS_INTARRAYREF_SLOW(normalized_shape);
  check_layer_norm_call("fusednorm.layer_norm", input, shape, weight, bias, eps);
  auto [out, mean, rstd] = row_ops::layer_norm_fwd().call(as_rows(input, static_cast<int64_t>(shape.size())), flat(weight), flat(bias), eps);
  return {shaped_like(out, input.sizes()), mean, rstd};
}

class LayerNormFunction : public torch::autograd::Function<LayerNormFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& input,
                               c10::SymIntArrayRef normalized_shape, const OptTensor& weight,
                               const OptTensor& bias, double eps) {
    static const auto op = fusednorm_op<LayerNormSig>("fusednorm::layer_norm");
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    auto [out, mean, rstd] = op.call(input, normalized_shape, weight, bias, eps);
    ctx->save_for_backward({input, defined_or_empty(weight), defined_or_empty(bias), mean, rstd});
    ctx->saved_data["normalized_ndim"] = static_cast<int64_t>(normalized_shape.size());
    ctx->saved_data["eps"] = eps;
    ctx->mark_non_differentiable({mean, rstd});
    return {out, mean, rstd};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &input = saved[0], &weight = saved[1], &bias = saved[2];
    const at::Tensor &mean = saved[3], &rstd = saved[4];
    const at::Tensor& grad_out = grads[0];
    const int64_t dims = ctx->saved_data["normalized_ndim"].toInt();
    const auto shape = input.sym_sizes().slice(input.dim() - dims);  // normalized_shape
    const double eps = ctx->saved_data["eps"].toDouble();
    if (!grad_out.defined()) return {at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};

    if (at::GradMode::is_enabled()) {  // create_graph=True: a differentiable backward
      auto g = differentiable_backward(
          [&](const variable_list& v) {
            return variable_list{at::layer_norm_symint(v[0], shape, v[1], v[2], eps)};
          },
          {input, weight, bias}, {grad_out});
      return {g[0], at::Tensor(), g[1], g[2], at::Tensor()};
    }

    auto [grad_input, grad_weight, grad_bias] =
        row_ops::layer_norm_bwd().call(as_rows(grad_out, dims), as_rows(input, dims), mean, rstd,
                 flat(weight), flat(bias));
    return {shaped_like(grad_input, input.sizes()), at::Tensor(),
            weight.defined() ? grad_weight.view(weight.sizes()) : at::Tensor(),
            bias.defined() ? grad_bias.view(bias.sizes()) : at::Tensor(), at::Tensor()};
  }
};

Stats layer_norm_autograd(const at::Tensor& input, c10::SymIntArrayRef normalized_shape,
                          const OptTensor& weight, const OptTensor& bias, double eps) {
  if (!needs_grad(input, weight, bias)) {  // no graph to record: skip the Function's cost
    static const auto op = fusednorm_op<LayerNormSig>("fusednorm::layer_norm");
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    return op.call(input, normalized_shape, weight, bias, eps);
  }
  auto r = LayerNormFunction::apply(input, normalized_shape, weight, bias, eps);
  return {r[0], r[1], r[2]};
}

// As torch.nn.functional.layer_norm under CUDA autocast: layer_norm is on autocast's
// float32 list, so float16/bfloat16 arguments run (and return) in float32. CPU autocast
// leaves layer_norm alone, and so does fusednorm.
Stats layer_norm_autocast_cuda(const at::Tensor& input, c10::SymIntArrayRef normalized_shape,
                               const OptTensor& weight, const OptTensor& bias, double eps) {
  static const auto op = fusednorm_op<LayerNormSig>("fusednorm::layer_norm");
  c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::DispatchKey::AutocastCUDA);
  const auto cuda = c10::DeviceType::CUDA;
  return op.call(at::autocast::cached_cast(at::kFloat, input, cuda), normalized_shape,
                 at::autocast::cached_cast(at::kFloat, weight, cuda),
                 at::autocast::cached_cast(at::kFloat, bias, cuda), eps);
}

}  // namespace
}  // namespace fusednorm

TORCH_LIBRARY_IMPL(fusednorm, CompositeExplicitAutograd, m) {
  m.impl("layer_norm", &fusednorm::layer_norm_rows);
}

TORCH_LIBRARY_IMPL(fusednorm, Autograd, m) {
  m.impl("layer_norm", &fusednorm::layer_norm_autograd);
}

TORCH_LIBRARY_IMPL(fusednorm, AutocastCUDA, m) {
  m.impl("layer_norm", &fusednorm::layer_norm_autocast_cuda);
}
