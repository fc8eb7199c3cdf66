// fusednorm::gelu_ffn, the public GELU feed-forward op out = gelu(x W1^T + b1) W2^T + b2 over
// the last dim: argument checks, the [M, K] rows view for the backends' gelu_ffn_fwd /
// gelu_ffn_bwd kernels, its autograd formula (gradients of any order) and its autocast rule.

#include <ATen/autocast_mode.h>
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
using Result = std::tuple<at::Tensor, at::Tensor>;

Result gelu_ffn_rows(const at::Tensor& input, const at::Tensor& weight1, const OptTensor& bias1,
                     const at::Tensor& weight2, const OptTensor& bias2,
                     c10::string_view approximate) {
  check_gelu_ffn_call("fusednorm.gelu_ffn", input, weight1, bias1, weight2, bias2, approximate);
  auto [out, hidden] = row_ops::gelu_ffn_fwd().call(
      as_rows(input, 1), weight1.contiguous(), contiguous_or_none(bias1), weight2.contiguous(),
      contiguous_or_none(bias2), approximate);
  if (input.dim() == 2) return {out, hidden};
  auto out_shape = input.sym_sizes().vec();
  out_shape.back() = weight2.sym_size(0);
  return {out.view_symint(out_shape), hidden};
}

// The op from ATen's differentiable ops, which gives forward-mode AD's tangent.
at::Tensor ffn_reference(const at::Tensor& input, const at::Tensor& weight1,
                         const OptTensor& bias1, const at::Tensor& weight2,
                         const OptTensor& bias2, c10::string_view approximate) {
  return at::linear(at::gelu(at::linear(input, weight1, bias1), approximate), weight2, bias2);
}

// The input's sizes from the gradient of the output (the input's leading dims) and weight1.
std::vector<c10::SymInt> input_sizes(const at::Tensor& grad_out, const at::Tensor& weight1) {
  std::vector<c10::SymInt> sizes = grad_out.sym_sizes().vec();
  sizes.back() = weight1.sym_size(1);
  return sizes;
}

// hidden = x W1^T + b1 of an FFN whose weight1 is frozen, as a function of its input x and
// bias1, whose gradient g goes on as g W1 to the input's edge and as g's column sums to
// bias1's: a differentiable backward of that FFN (whose input was not saved) reaches them
// through hidden.
struct FrozenHiddenBackward : public torch::autograd::Node {
  torch::autograd::SavedVariable weight1_;
  std::vector<c10::SymInt> input_sizes_;

  std::string name() const override { return "fusednorm.gelu_ffnHiddenBackward"; }

  void release_variables() override { weight1_.reset_data(); }

  variable_list apply(variable_list&& grads) override {
    variable_list result(2);
    if (!grads[0].defined()) return result;
    if (task_should_compute_output(0)) {
      result[0] = at::mm(grads[0], weight1_.unpack()).view_symint(input_sizes_);
    }
    if (task_should_compute_output(1)) result[1] = grads[0].sum(0);
    return result;
  }
};

// The saved hidden with the history of FrozenHiddenBackward (next edges: the input's and
// bias1's).
at::Tensor hidden_with_history(const at::Tensor& hidden, const at::Tensor& weight1,
                               torch::autograd::edge_list edges,
                               std::vector<c10::SymInt> sizes) {
  auto [node_ptr, node] = make_node<FrozenHiddenBackward>();
  node->set_next_edges(std::move(edges));
  node->weight1_ = torch::autograd::SavedVariable(weight1, /*is_output=*/false);
  node->input_sizes_ = std::move(sizes);
  at::Tensor result = hidden.detach();
  torch::autograd::set_history(result, node_ptr);
  announce_node(node_ptr);
  return result;
}

// Whether a tensor is a torch.func grad or jvp transform's wrapper: a transform outside the
// one recording this op, whose tangents the saved tensors must carry.
inline bool transform_wrapper(const at::Tensor& t) {
  return t.defined() && t.key_set().has(c10::DispatchKey::FuncTorchGradWrapper);
}
inline bool transform_wrapper(const OptTensor& t) {
  return t.has_value() && transform_wrapper(*t);
}
template <class... Ts>
bool any_transform_wrapper(const Ts&... tensors) {
  return (transform_wrapper(tensors) || ...);
}

// The backward node of a recorded gelu_ffn: a torch::autograd::Node of our own, as the
// norms' NormBackward (the C++ API of torch::autograd::Function works with none of
// torch.func's transforms). Next edges: input, weight1, bias1, weight2, bias2. Saved: those
// and hidden = x W1^T + b1, all the backward keeps besides the parameters: gelu of it is
// recomputed there. With weight1 frozen (and no tangent) the input is not saved, as eager's
// frozen Linear does not save it: only weight1's gradient reads it.
struct GeluFFNBackward : public SavedListNode {
  std::string approximate_;

  std::string name() const override { return "fusednorm.gelu_ffnBackward"; }

  variable_list apply(variable_list&& grads) override {
    variable_list s = unpack_saved();
    if (!s[0].defined() && at::GradMode::is_enabled() && grads[0].defined()) {
      s[5] = hidden_with_history(s[5], s[1], {next_edge(0), next_edge(2)},
                                 input_sizes(grads[0], s[1]));
    }
    return backward(s, grads, approximate_, wanted_outputs());
  }

  // The gradients from the saved tensors s (hidden: with the history of the input and bias1
  // in a differentiable backward without the input) and grads; wanted: wanted_outputs().
  static variable_list backward(const variable_list& s, const variable_list& grads,
                                const std::string& approximate,
                                const std::vector<bool>& wanted) {
    const at::Tensor &input = s[0], &weight1 = s[1], &bias1 = s[2], &weight2 = s[3],
                     &bias2 = s[4], &hidden = s[5];
    const at::Tensor& grad_out = grads[0];
    if (!grad_out.defined()) return variable_list(5);

    if (at::GradMode::is_enabled() && input.defined()) {  // create_graph=True
      return formulas::ffn_backward(input, weight1, bias1, weight2, bias2, approximate,
                                    grad_out);
    }
    TORCH_CHECK(input.defined() || !wanted[1],
                "fusednorm.gelu_ffn: weight1's gradient asked of an FFN whose weight1 was "
                "frozen in its forward");
    if (!wanted[1] || !wanted[3]) {
      // A frozen weight (fine-tuning around it: LoRA, BitFit): the wanted gradients alone,
      // not the kernel that forms dW1 and dW2 both; differentiable in grad mode through
      // hidden's history.
      // (Compiled autograd's functional form has no edges to give hidden a history.)
      TORCH_CHECK(!at::GradMode::is_enabled() || hidden.grad_fn(),
                  "fusednorm.gelu_ffn: compiled autograd cannot differentiate the backward "
                  "(create_graph=True) of an FFN whose weight1 was frozen in its forward, "
                  "which did not save its input; run that backward without compiled "
                  "autograd");
      variable_list result = formulas::ffn_wanted_grads(
          as_rows(grad_out, 1), input.defined() ? as_rows(input, 1) : at::Tensor(), weight1,
          bias1.defined(), weight2, bias2.defined(), hidden, approximate, wanted);
      if (result[0].defined()) result[0] = result[0].view_symint(input_sizes(grad_out, weight1));
      return result;
    }

    // Grad mode is off: straight to the backend kernel (see NormBackward::apply).
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    auto [grad_input, grad_w1, grad_b1, grad_w2, grad_b2] = row_ops::gelu_ffn_bwd().call(
        as_rows(grad_out, 1), as_rows(input, 1), hidden, weight1.contiguous(),
        weight2.contiguous(), bias1.defined(), bias2.defined(), approximate);
    return {shaped_like(grad_input, input.sym_sizes()), grad_w1,
            bias1.defined() ? grad_b1 : at::Tensor(), grad_w2,
            bias2.defined() ? grad_b2 : at::Tensor()};
  }

#if FUSEDNORM_COMPILED_AUTOGRAD
  // Compiled autograd (common/compiled_autograd.h).
  void compiled_args(CompiledNodeArgs& args) const override {
    args.collect(saved_, false);
    args.collect(approximate_);
  }

  variable_list apply_with_saved(const variable_list& grads,
                                 SwapSavedVariables& saved) override {
    static std::once_flag bound;
    return call_saved_list_functional(*this, saved, grads, "fusednorm_gelu_ffn_backward", bound,
                                      &functional, {approximate_});
  }

  static variable_list functional(const variable_list& grads,
                                  const torch::autograd::ivalue_list& args) {
    const FunctionalArgs a = unpack_functional(args, 6);
    return backward(a.saved, grads, a.constants[0].toStringRef(), a.wanted);
  }
#endif
};

Result gelu_ffn_autograd(const at::Tensor& input, const at::Tensor& weight1,
                         const OptTensor& bias1, const at::Tensor& weight2,
                         const OptTensor& bias2, c10::string_view approximate) {
  const auto& op = public_ops::gelu_ffn();
  const auto below = [&] {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    return op.call(input, weight1, bias1, weight2, bias2, approximate);
  };
  Result result = [&]() -> Result {
    if (!needs_grad(input, weight1, bias1, weight2, bias2)) return below();
    auto [node_ptr, node] = make_node<GeluFFNBackward>();
    node->set_next_edges(
        torch::autograd::collect_next_edges(input, weight1, bias1, weight2, bias2));
    auto [out, hidden] = below();
    torch::autograd::set_history(out, node_ptr);  // hidden: no history, not differentiable
    node->approximate_ = std::string(approximate);
    // Forward over reverse (a tangent; torch.func's transforms around this one, as in
    // hessian) recomputes hidden from the input: the saved hidden carries no tangent.
    const bool keep_input = requires_grad(weight1) ||
                            any_tangent(input, weight1, bias1, weight2, bias2) ||
                            any_transform_wrapper(input, weight1, bias1, weight2, bias2);
    node->save({keep_input ? input : at::Tensor(), weight1, defined_or_empty(bias1), weight2,
                defined_or_empty(bias2), hidden});
    announce_node(node_ptr);
    return {out, hidden};
  }();
  if (any_tangent(input, weight1, bias1, weight2, bias2)) {
    attach_tangent(std::get<0>(result),
                   ffn_reference(input, weight1, bias1, weight2, bias2, approximate));
  }
  return result;
}

// As torch.nn.functional.linear under autocast: every floating argument in the autocast
// dtype (float16 or bfloat16).
template <c10::DeviceType kDevice>
Result gelu_ffn_autocast(const at::Tensor& input, const at::Tensor& weight1,
                         const OptTensor& bias1, const at::Tensor& weight2,
                         const OptTensor& bias2, c10::string_view approximate) {
  const auto& op = public_ops::gelu_ffn();
  c10::impl::ExcludeDispatchKeyGuard no_autocast(
      at::autocast::get_autocast_dispatch_key_from_device_type(kDevice));
  const auto dtype = at::autocast::get_autocast_dtype(kDevice);
  const auto cast = [dtype](const auto& t) { return at::autocast::cached_cast(dtype, t, kDevice); };
  return op.call(cast(input), cast(weight1), cast(bias1), cast(weight2), cast(bias2),
                 approximate);
}

}  // namespace
}  // namespace fusednorm

TORCH_LIBRARY_IMPL(fusednorm, CompositeExplicitAutograd, m) {
  m.impl("gelu_ffn", &fusednorm::gelu_ffn_rows);
}

TORCH_LIBRARY_IMPL(fusednorm, Autograd, m) {
  m.impl("gelu_ffn", &fusednorm::gelu_ffn_autograd);
}

TORCH_LIBRARY_IMPL(fusednorm, AutocastCPU, m) {
  m.impl("gelu_ffn", &fusednorm::gelu_ffn_autocast<c10::DeviceType::CPU>);
}

TORCH_LIBRARY_IMPL(fusednorm, AutocastCUDA, m) {
  m.impl("gelu_ffn", &fusednorm::gelu_ffn_autocast<c10::DeviceType::CUDA>);
}
