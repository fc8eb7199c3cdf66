// fusednorm::layer_norm_gelu_ffn, the pre-LN feed-forward sub-block
// out = x + gelu_ffn(layer_norm(x)) over the last dim: checks, rows, autograd (the
// backward recomputes the LayerNorm output from x and the saved statistics instead of
// keeping it) and autocast (layer_norm then gelu_ffn, each by its own autocast rule).

#include <ATen/ops/add.h>
#include <ATen/ops/gelu.h>
#include <ATen/ops/linear.h>
#include <torch/autograd.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/library.h>

#include <string>
#include <tuple>

#include "common/op_support.h"
#include "common/public_checks.h"
#include "ops/differentiable_formulas.h"
#include "ops/op_handles.h"

namespace fusednorm {
namespace {

using OptTensor = std::optional<at::Tensor>;
using Result = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;
constexpr const char* kName = "fusednorm.layer_norm_gelu_ffn";

// The residual connection needs out_features == d_model.
void check_residual(const at::Tensor& input, const at::Tensor& weight1,
                    const at::Tensor& weight2) {
  const int64_t d = input.size(-1);
  TORCH_CHECK_VALUE(weight2.size(0) == d, kName, ": weight2 must have shape [", d, ", ",
                    weight1.size(0), "] for the residual connection to input of shape ",
                    input.sizes(), ", got ", weight2.sizes());
}

Result block_rows(const at::Tensor& input, const OptTensor& ln_weight, const OptTensor& ln_bias,
                  double eps, const at::Tensor& weight1, const OptTensor& bias1,
                  const at::Tensor& weight2, const OptTensor& bias2,
                  c10::string_view approximate) {
  check_gelu_ffn_call(kName, input, weight1, bias1, weight2, bias2, approximate);
  check_residual(input, weight1, weight2);
  check_layer_norm_call(kName, input, input.sizes().slice(input.dim() - 1), ln_weight, ln_bias,
                        eps);
  const at::Tensor x = as_rows(input, 1);
  auto [normed, sum, mean, rstd] = row_ops::norm_fwd().call(
      x, std::nullopt, contiguous_or_none(ln_weight), contiguous_or_none(ln_bias), eps,
      /*centered=*/true, /*sum_dtype=*/std::nullopt, /*dropout_p=*/0.0,
      /*rowscale=*/std::nullopt, /*rng_state=*/std::nullopt);
  auto [y, hidden] = row_ops::gelu_ffn_fwd().call(normed, weight1.contiguous(),
                                                  contiguous_or_none(bias1), weight2.contiguous(),
                                                  contiguous_or_none(bias2), approximate);
  return {shaped_like(at::add(x, y), input.sym_sizes()), mean, rstd, hidden};
}

at::Tensor block_reference(const variable_list& v, double eps, const std::string& approximate) {
  const at::Tensor& x = v[0];
  const at::Tensor normed = formulas::norm_forward(/*centered=*/true, x, 1, v[1], v[2], eps);
  return at::add(x, at::linear(at::gelu(at::linear(normed, v[3], v[4]), approximate), v[5], v[6]));
}

// The backward node of a recorded layer_norm_gelu_ffn (a torch::autograd::Node: see
// GeluFFNBackward). Next edges: input, ln_weight, ln_bias, weight1, bias1, weight2, bias2.
// Saved: those, the LayerNorm statistics and the FFN's pre-activation; not the LayerNorm
// output: the backward recomputes it from input, mean and rstd.
struct BlockBackward : public SavedListNode {
  double eps_ = 0;
  std::string approximate_;

  std::string name() const override { return "fusednorm.layer_norm_gelu_ffnBackward"; }

  variable_list apply(variable_list&& grads) override {
    return backward(unpack_saved(), grads, eps_, approximate_, wanted_outputs());
  }

  // The gradients from the saved tensors s (as saved) and grads; wanted: wanted_outputs().
  static variable_list backward(const variable_list& s, const variable_list& grads, double eps,
                                const std::string& approximate,
                                const std::vector<bool>& wanted) {
    const at::Tensor &input = s[0], &ln_weight = s[1], &ln_bias = s[2], &weight1 = s[3],
                     &bias1 = s[4], &weight2 = s[5], &bias2 = s[6], &mean = s[7], &rstd = s[8],
                     &hidden = s[9];
    const at::Tensor& grad_out = grads[0];
    if (!grad_out.defined()) return variable_list(7);

    if (at::GradMode::is_enabled()) {  // create_graph=True: a differentiable backward
      // out = x + ffn(normed), normed = layer_norm(x): the FFN's formula, then the norm's.
      const at::Tensor normed =
          formulas::norm_forward(/*centered=*/true, input, 1, ln_weight, ln_bias, eps);
      const auto ffn = formulas::ffn_backward(normed, weight1, bias1, weight2, bias2,
                                              approximate, grad_out);
      const auto norm =
          formulas::norm_backward(/*centered=*/true, input, 1, ln_weight, ln_bias, eps, ffn[0],
                                  at::Tensor(), input.scalar_type(), std::nullopt);
      return {norm[0] + grad_out, norm[2], norm[3], ffn[1], ffn[2], ffn[3], ffn[4]};
    }

    // Grad mode is off: straight to the backend kernels (see NormBackward::apply).
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    const at::Tensor x = as_rows(input, 1);
    const at::Tensor grad_rows = as_rows(grad_out, 1);
    const auto ln_w = contiguous_or_none(ln_weight), ln_b = contiguous_or_none(ln_bias);
    at::Tensor grad_normed, grad_w1, grad_b1, grad_w2, grad_b2;
    // The LayerNorm output, recomputed, is read for weight1's gradient alone.
    const auto normed = [&] {
      return row_ops::layer_norm_apply().call(x, mean, rstd, ln_w, ln_b);
    };
    if (wanted[3] && wanted[5]) {
      std::tie(grad_normed, grad_w1, grad_b1, grad_w2, grad_b2) = row_ops::gelu_ffn_bwd().call(
          grad_rows, normed(), hidden, weight1.contiguous(), weight2.contiguous(),
          bias1.defined(), bias2.defined(), approximate);
    } else {  // a frozen FFN weight: the wanted gradients alone (see GeluFFNBackward)
      const auto ffn = formulas::ffn_wanted_grads(
          grad_rows, wanted[3] ? normed() : at::Tensor(), weight1, bias1.defined(), weight2,
          bias2.defined(), hidden, approximate,
          {true, wanted[3], wanted[4], wanted[5], wanted[6]});
      grad_normed = ffn[0];
      grad_w1 = ffn[1];
      grad_b1 = ffn[2];
      grad_w2 = ffn[3];
      grad_b2 = ffn[4];
    }
    // A frozen LayerNorm weight or bias gets no column sums (see NormBackward).
    const bool ln_weight_grad = ln_weight.defined() && wanted[1];
    const bool ln_bias_grad = ln_bias.defined() && wanted[2];
    auto [grad_x, grad_ln_w, grad_ln_b, unused] = row_ops::norm_bwd().call(
        grad_normed, std::nullopt, x, mean, rstd, ln_w, ln_b, /*centered=*/true, std::nullopt,
        0.0, std::nullopt, std::nullopt, {ln_weight_grad, ln_bias_grad});
    const at::Tensor grad_input = shaped_like(at::add(grad_x, grad_rows), input.sym_sizes());  // + the residual's
    return {grad_input,
            ln_weight_grad ? grad_ln_w.view_symint(ln_weight.sym_sizes()) : at::Tensor(),
            ln_bias_grad ? grad_ln_b.view_symint(ln_bias.sym_sizes()) : at::Tensor(),
            grad_w1,
            bias1.defined() ? grad_b1 : at::Tensor(),
            grad_w2,
            bias2.defined() ? grad_b2 : at::Tensor()};  // undefined alike for a frozen FFN
  }

#if FUSEDNORM_COMPILED_AUTOGRAD
  // Compiled autograd (common/compiled_autograd.h).
  void compiled_args(CompiledNodeArgs& args) const override {
    args.collect(saved_, false);
    args.collect(eps_);
    args.collect(approximate_);
  }

  variable_list apply_with_saved(const variable_list& grads,
                                 SwapSavedVariables& saved) override {
    static std::once_flag bound;
    return call_saved_list_functional(*this, saved, grads, "fusednorm_layer_norm_gelu_ffn_backward",
                                      bound, &functional, {eps_, approximate_});
  }

  static variable_list functional(const variable_list& grads,
                                  const torch::autograd::ivalue_list& args) {
    const FunctionalArgs a = unpack_functional(args, 10);
    return backward(a.saved, grads, a.constants[0].toDouble(), a.constants[1].toStringRef(),
                    a.wanted);
  }
#endif
};

Result block_autograd(const at::Tensor& input, const OptTensor& ln_weight,
                      const OptTensor& ln_bias, double eps, const at::Tensor& weight1,
                      const OptTensor& bias1, const at::Tensor& weight2, const OptTensor& bias2,
                      c10::string_view approximate) {
  const auto& op = public_ops::layer_norm_gelu_ffn();
  const auto below = [&] {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    return op.call(input, ln_weight, ln_bias, eps, weight1, bias1, weight2, bias2, approximate);
  };
  Result result = [&]() -> Result {
    if (!needs_grad(input, ln_weight, ln_bias, weight1, bias1, weight2, bias2)) return below();
    auto [node_ptr, node] = make_node<BlockBackward>();
    node->set_next_edges(torch::autograd::collect_next_edges(input, ln_weight, ln_bias, weight1,
                                                             bias1, weight2, bias2));
    auto [out, mean, rstd, hidden] = below();
    torch::autograd::set_history(out, node_ptr);  // the rest: no history, not differentiable
    node->eps_ = eps;
    node->approximate_ = std::string(approximate);
    node->save({input, defined_or_empty(ln_weight), defined_or_empty(ln_bias), weight1,
                defined_or_empty(bias1), weight2, defined_or_empty(bias2), mean, rstd, hidden});
    announce_node(node_ptr);
    return {out, mean, rstd, hidden};
  }();
  if (any_tangent(input, ln_weight, ln_bias, weight1, bias1, weight2, bias2)) {
    const variable_list v{input,   defined_or_empty(ln_weight), defined_or_empty(ln_bias),
                          weight1, defined_or_empty(bias1),     weight2,
                          defined_or_empty(bias2)};
    attach_tangent(std::get<0>(result), block_reference(v, eps, std::string(approximate)));
  }
  return result;
}

// Under autocast the block runs as its two parts, each by its own autocast rule (layer_norm
// in float32 on CUDA, the FFN in the autocast dtype), as the eager modules would.
template <c10::DeviceType kDevice>
Result block_autocast(const at::Tensor& input, const OptTensor& ln_weight,
                      const OptTensor& ln_bias, double eps, const at::Tensor& weight1,
                      const OptTensor& bias1, const at::Tensor& weight2, const OptTensor& bias2,
                      c10::string_view approximate) {
  const auto& layer_norm = public_ops::layer_norm();
  const auto& gelu_ffn = public_ops::gelu_ffn();
  check_public_input(kName, input);
  TORCH_CHECK_VALUE(input.dim() >= 1, kName,
                    ": input must have at least one dim (the features), got a scalar");
  const c10::SymInt d = input.sym_size(-1);
  auto [normed, mean, rstd] = layer_norm.call(input, {d}, ln_weight, ln_bias, eps, false);
  auto [y, hidden] = gelu_ffn.call(normed, weight1, bias1, weight2, bias2, approximate);
  check_residual(input, weight1, weight2);  // weight1, weight2 are 2-D: gelu_ffn checked
  return {at::add(input, y), mean, rstd, hidden};
}

}  // namespace
}  // namespace fusednorm

TORCH_LIBRARY_IMPL(fusednorm, CompositeExplicitAutograd, m) {
  m.impl("layer_norm_gelu_ffn", &fusednorm::block_rows);
}

TORCH_LIBRARY_IMPL(fusednorm, Autograd, m) {
  m.impl("layer_norm_gelu_ffn", &fusednorm::block_autograd);
}

TORCH_LIBRARY_IMPL(fusednorm, AutocastCPU, m) {
  m.impl("layer_norm_gelu_ffn", &fusednorm::block_autocast<c10::DeviceType::CPU>);
}

TORCH_LIBRARY_IMPL(fusednorm, AutocastCUDA, m) {
  m.impl("layer_norm_gelu_ffn", &fusednorm::block_autocast<c10::DeviceType::CUDA>);
}
