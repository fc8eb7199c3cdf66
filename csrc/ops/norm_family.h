#pragma once
// What the norm family's public ops share (layer_norm, rms_norm, add_layer_norm,
// add_rms_norm): one op is a NormKind (centered or not, residual or not) plus its schema.
// This header holds, for every kind: the checks and the [M, N] rows view around the backend
// kernels, the autograd formula (fused backward; ATen recomputation under create_graph)
// and CUDA autocast. A csrc/ops/<op>.cpp adapts its schema to these and registers them.

#include <ATen/autocast_mode.h>
#include <ATen/ops/add.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/zeros.h>
#include <torch/autograd.h>
#include <torch/csrc/autograd/functions/utils.h>

#include <array>
#include <functional>
#include <mutex>
#include <string>
#include <tuple>
#include <utility>

#include "common/compiled_autograd.h"
#include "common/op_support.h"
#include "common/public_checks.h"
#include "ops/differentiable_formulas.h"
#include "ops/op_handles.h"

namespace fusednorm::norm_family {

using OptTensor = std::optional<at::Tensor>;
// (out, sum, mean, rstd, rng_state): sum is input + residual (undefined without a residual),
// mean [0] for RMSNorm, rng_state the add ops' dropout state (undefined without a residual);
// every op returns the ones its schema names.
using Outputs = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

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

using OptDtype = std::optional<at::ScalarType>;

// The dtype of the add ops' sum for their residual_dtype: None, the input's; torch.float32,
// the computation type (float32; float64 for a float64 input, never narrower than it).
inline at::ScalarType sum_type(const NormKind& kind, const at::Tensor& input,
                               OptDtype residual_dtype) {
  if (!residual_dtype.has_value()) return input.scalar_type();
  TORCH_CHECK_TYPE(*residual_dtype == at::kFloat, kind.name,
                   ": residual_dtype must be None or torch.float32, got ",
                   python_dtype(*residual_dtype));
  return input.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

// The residual: the input's shape and device; the input's dtype, or the sum's (sum_type).
inline void check_residual(const NormKind& kind, const at::Tensor& input,
                           const at::Tensor& residual, at::ScalarType sum) {
  check_dense(kind.name, "residual", residual);
  TORCH_CHECK_VALUE(residual.sizes() == input.sizes(), kind.name,
                    ": residual must have the input's shape ", input.sizes(), ", got ",
                    residual.sizes());
  TORCH_CHECK(residual.device() == input.device(), kind.name, ": residual is on ",
              residual.device(), " but input is on ", input.device());
  const at::ScalarType type = residual.scalar_type();
  if (sum == input.scalar_type()) {
    const bool hint = type == at::kFloat && is_reduced_float(input.scalar_type());
    TORCH_CHECK_TYPE(type == input.scalar_type(), kind.name,
                     ": residual must have the input's dtype (", python_dtype(input.scalar_type()),
                     "), got ", python_dtype(type),
                     hint ? " (residual_dtype=torch.float32 takes a float32 residual)" : "");
  } else {
    TORCH_CHECK_TYPE(type == input.scalar_type() || type == sum, kind.name,
                     ": residual must have the input's dtype (", python_dtype(input.scalar_type()),
                     ") or residual_dtype's (", python_dtype(sum), "), got ", python_dtype(type));
  }
}

// The add ops' dropout_p and rowscale (the user's: of the input's leading dims' shape).
// Active: the input is multiplied before the add (common/philox.h), and its gradient
// with the same multipliers.
struct Dropout {
  double p = 0.0;
  OptTensor rowscale;

  bool active() const { return p > 0.0 || given(rowscale); }
};

// dropout_p in [0, 1]; rowscale: the leading dims' shape, a float dtype, the input's device.
inline void check_dropout(const NormKind& kind, const at::Tensor& input, int64_t dims,
                          const Dropout& dropout) {
  TORCH_CHECK_VALUE(dropout.p >= 0.0 && dropout.p <= 1.0, kind.name,
                    ": dropout_p must be in [0, 1], got ", dropout.p);
  if (!given(dropout.rowscale)) return;
  const at::Tensor& r = *dropout.rowscale;
  check_dense(kind.name, "rowscale", r);
  const auto lead = input.sizes().slice(0, input.dim() - dims);
  TORCH_CHECK_VALUE(r.sizes() == lead, kind.name,
                    ": rowscale must have the shape of input's leading dims ", lead, ", got ",
                    r.sizes());
  TORCH_CHECK(r.device() == input.device(), kind.name, ": rowscale is on ", r.device(),
              " but input is on ", input.device());
  TORCH_CHECK_TYPE(is_supported_float(r.scalar_type()), kind.name,
                   ": rowscale must be float32, float64, float16 or bfloat16, got ",
                   python_dtype(r.scalar_type()));
}

// rowscale as the kernels read it: [M] contiguous in the statistics' dtype (float32;
// float64 for a float64 input). M values: no pass over the rows.
inline OptTensor rowscale_rows(const OptTensor& rowscale, const at::Tensor& input) {
  if (!given(rowscale)) return std::nullopt;
  return rowscale->reshape({-1}).to(stats_dtype(input.scalar_type())).contiguous();
}

// zero_centered_weight: the kernels get 1 + weight as their weight, formed here once per
// call (N values, never a pass over the rows) in the computation type (float32; float64 for
// a float64 input): one rounding of the exact sum, the same on every device, and no kernel
// variant. ATen ops form it, so autograd carries gradients (and forward-mode tangents) from
// it to weight. A bias is widened alike (exact), since the kernels take weight and bias of
// one dtype. Any float dtype of weight/bias is accepted: what the kernels see is widened.
struct Params {
  OptTensor weight, bias;
};

// RMSNorm's weight of another float dtype than the kernels take (param_dtype_allowed): as
// torch.nn.functional.rms_norm, which takes any and returns the input's dtype, converted to
// the kernels' parameter dtype (float32 beside 16-bit input, else the input's) by an ATen
// op, so autograd gives the weight its gradient in its own dtype. LayerNorm's weight and
// bias stay checked: F.layer_norm refuses such pairs.
inline OptTensor rms_kernel_weight(const at::Tensor& input, const OptTensor& weight) {
  if (!given(weight)) return weight;
  const at::ScalarType x = input.scalar_type(), w = weight->scalar_type();
  if (param_dtype_allowed(x, w) || !is_supported_float(x) || !is_supported_float(w)) {
    return weight;  // what the kernels take, or what the checks refuse by name
  }
  return weight->to(is_reduced_float(x) ? at::kFloat : x);
}

inline Params effective_params(const NormKind& kind, const at::Tensor& input,
                               const OptTensor& weight, const OptTensor& bias,
                               bool zero_centered) {
  if (!zero_centered) return {kind.centered ? weight : rms_kernel_weight(input, weight), bias};
  check_public_input(kind.name, input);
  const at::ScalarType type = input.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const auto widened = [&](const OptTensor& param, const char* name) -> OptTensor {
    if (!param.has_value() || !param->defined()) return param;
    check_dense(kind.name, name, *param);
    TORCH_CHECK_TYPE(is_supported_float(param->scalar_type()), kind.name, ": ", name,
                     " must be float32, float64, float16 or bfloat16, got ",
                     python_dtype(param->scalar_type()));
    return param->to(type);
  };
  OptTensor one_plus_weight = widened(weight, "weight");
  if (one_plus_weight.has_value()) one_plus_weight = at::add(*one_plus_weight, 1);
  return {one_plus_weight, widened(bias, "bias")};
}

// Below autograd, any backend: check, view as rows, run the backend kernel, give back the
// input's shape.
// sum: the sum's dtype (sum_type; the input's without a residual).
// dropout (the add ops): rng_state is int64 [2] on the input's device with dropout_p > 0,
// [0] without.
inline Outputs forward_rows(const NormKind& kind, const at::Tensor& input,
                            const OptTensor& residual, c10::SymIntArrayRef normalized_shape,
                            const OptTensor& weight, const OptTensor& bias, double eps,
                            OptDtype sum_dtype = std::nullopt, const Dropout& dropout = {}) {
  const auto shape = C10_AS_INTARRAYREF_SLOW(normalized_shape);
  check_layer_norm_call(kind.name, input, shape, weight, bias, eps);
  const auto dims = static_cast<int64_t>(shape.size());
  if (kind.residual) {
    check_residual(kind, input, *residual, sum_dtype.value_or(input.scalar_type()));
    check_dropout(kind, input, dims, dropout);
  }
  const at::Tensor x = as_rows(input, dims);
  const OptTensor r = kind.residual ? OptTensor(as_rows(*residual, dims)) : std::nullopt;
  if (sum_dtype == input.scalar_type()) sum_dtype = std::nullopt;
  // Written by the kernels, which launch nothing for no rows: zeros then.
  at::Tensor rng_state;
  if (kind.residual) {
    const auto options = input.options().dtype(at::kLong);
    const int64_t size = dropout.p > 0.0 ? 2 : 0;
    rng_state = x.size(0) > 0 ? at::empty({size}, options) : at::zeros({size}, options);
  }
  auto [out, sum, mean, rstd] = row_ops::norm_fwd().call(
      x, r, flat(weight), flat(bias), eps, kind.centered, sum_dtype, dropout.p,
      rowscale_rows(dropout.rowscale, input),
      dropout.p > 0.0 ? OptTensor(rng_state) : std::nullopt);
  // Without a residual, sum is an empty placeholder: no sum output.
  sum = kind.residual ? shaped_like(sum, input.sym_sizes()) : at::Tensor();
  return {shaped_like(out, input.sym_sizes()), sum, mean, rstd, rng_state};
}

// The multipliers of a forward with dropout / rowscale as a tensor of the input's shape, in
// the statistics' dtype: what the ATen formulas (create_graph, forward-mode AD) multiply
// the input and its gradient by.
inline at::Tensor multipliers(const at::Tensor& input, int64_t dims, const Dropout& dropout,
                              const at::Tensor& rng_state) {
  const at::ScalarType type = stats_dtype(input.scalar_type());
  const at::Tensor ones =
      at::ones_symint(as_rows(input, dims).sym_sizes(), input.options().dtype(type));
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  return row_ops::dropout_scale()
      .call(ones, rowscale_rows(dropout.rowscale, input), rng_state, dropout.p, type)
      .view_symint(input.sym_sizes());
}

// The op from ATen's differentiable ops (formulas::norm_forward): (out, sum), sum = input +
// residual in sum_type (the input without a residual), out in the input's dtype. What gives
// forward-mode AD's tangents.
// multipliers: undefined, or the input's dropout / rowscale (multipliers()).
inline std::pair<at::Tensor, at::Tensor> reference(const NormKind& kind, const at::Tensor& input,
                                                   const at::Tensor& residual, int64_t dims,
                                                   const at::Tensor& weight,
                                                   const at::Tensor& bias, double eps,
                                                   at::ScalarType sum_type,
                                                   const at::Tensor& multipliers = {}) {
  const at::Tensor sum =
      kind.residual ? formulas::residual_sum(input, residual, sum_type, multipliers) : input;
  const at::Tensor out = formulas::norm_forward(kind.centered, sum, dims, weight, bias, eps);
  return {out.to(input.scalar_type()), sum};
}

// Forward-mode AD: the tangents of out (and of the sum with a residual) set on the
// outputs the fused kernels computed (attach_tangent).
inline void attach_tangents(const NormKind& kind, const at::Tensor& input,
                            const OptTensor& residual, c10::SymIntArrayRef shape,
                            const OptTensor& weight, const OptTensor& bias, double eps,
                            const at::Tensor& out, const at::Tensor& sum,
                            const Dropout& dropout = {}, const at::Tensor& rng_state = {}) {
  if (!any_tangent(input, residual, weight, bias)) return;
  const auto dims = static_cast<int64_t>(shape.size());
  const at::Tensor m = dropout.active() ? multipliers(input, dims, dropout, rng_state)
                                        : at::Tensor();
  const auto [ref_out, ref_sum] =
      reference(kind, input, residual.value_or(at::Tensor()), dims,
                weight.value_or(at::Tensor()), bias.value_or(at::Tensor()), eps,
                kind.residual ? sum.scalar_type() : input.scalar_type(), m);
  attach_tangent(out, ref_out);
  if (kind.residual) attach_tangent(sum, ref_sum);
}

// The op itself, called below autograd by the autograd kernel (so that a compiled graph
// records the public op, with its fake kernel). Outputs the op's schema lacks are undefined:
// the sum without a residual, RMSNorm's mean (record() saves `none_like` for norm_bwd).
using BelowAutograd = std::function<Outputs()>;

// A tensor subclass (DTensor) gets one of its own kind: its ops reject a plain tensor among
// their arguments ("mixed torch.Tensor and DTensor").
inline at::Tensor none_like(const at::Tensor& t) {
  if (t.key_set().has(c10::DispatchKey::Python)) return t.new_empty({0});
  return at::empty({0}, t.options());
}

// A contiguous copy of t with its own storage and version counter (record(): RMSNorm's
// frozen rows and weight); of an inference tensor, outside inference mode, a normal tensor.
inline at::Tensor private_copy(const at::Tensor& t) {
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  return t.clone(at::MemoryFormat::Contiguous);
}

// The backward node of a recorded norm op: a torch::autograd::Node of our own, as
// PyTorch's generated ones (NativeLayerNormBackward0), not a torch::autograd::Function,
// whose context (string-keyed saved data, output wrapping) cost a LayerNorm call with grad
// more host time than the op itself. Inputs (next edges): input, residual, weight, bias;
// incoming gradients: out (and the sum with a residual), undefined where none flowed.
struct NormBackward : public torch::autograd::Node {
  torch::autograd::SavedVariable normed_input_;  // input, or the sum output (residual)
  bool normed_input_is_output_ = false;          // the sum, differentiable: this node's output
  torch::autograd::SavedVariable weight_, bias_, mean_, rstd_;
  // The add ops' dropout / rowscale (inactive: none): the input's gradient is the sum's
  // times the forward's multipliers, its mask regenerated from rng_state.
  bool dropout_active_ = false;
  double dropout_p_ = 0.0;
  torch::autograd::SavedVariable rowscale_, rng_state_;
  NormKind kind_{};
  int64_t dims_ = 1;
  double eps_ = 0;
  // The dtypes of input and residual (their gradients'), and of the sum output: wider than
  // the input's with residual_dtype, whose gradient is then rounded once to the input's.
  at::ScalarType input_type_ = at::kFloat, residual_type_ = at::kFloat, sum_type_ = at::kFloat;

  // The saved tensors, unpacked (undefined where the backward does not read them).
  struct Saved {
    at::Tensor normed_input, weight, bias, mean, rstd, rowscale, rng_state;
  };

  std::string name() const override {
    return std::string(kind_.name) + "Backward";
  }

  void release_variables() override {
    for (auto* v : saved_variables()) v->reset_data();
  }

  variable_list apply(variable_list&& grads) override {
    Saved s;
    s.rowscale = rowscale_.unpack();
    s.rng_state = rng_state_.unpack();
    if (grads[0].defined()) {  // (the sum's gradient alone reads nothing else: sum_gradients)
      s.normed_input = normed_input_.unpack(getptr());
      s.weight = weight_.unpack();
      s.bias = bias_.unpack();
      s.mean = mean_.unpack();
      s.rstd = rstd_.unpack();
    }
    // A frozen weight or bias (fine-tuning: LoRA, BitFit) gets no column sums.
    return backward(grads, s, {task_should_compute_output(2), task_should_compute_output(3)});
  }

  // The gradients of input, residual, weight, bias from grads (out's, and the sum's with a
  // residual) and the saved tensors; param_grads: whether weight's and bias's are wanted.
  variable_list backward(const variable_list& grads, const Saved& s,
                         std::array<bool, 2> param_grads) const {
    const at::Tensor& grad_out = grads[0];
    const at::Tensor grad_sum = kind_.residual ? grads[1] : at::Tensor();
    const Dropout dropout{dropout_p_, dropout_active_ ? OptTensor(s.rowscale) : std::nullopt};
    if (!grad_out.defined()) return sum_gradients(grad_sum, dropout, s.rng_state);
    const at::Tensor &normed_input = s.normed_input, &weight = s.weight, &bias = s.bias;
    variable_list result(4);

    if (at::GradMode::is_enabled()) {  // create_graph=True: a differentiable backward
      // From the sum output as saved (its grad_fn is this node), not input + residual again.
      const at::Tensor m = dropout_active_
                               ? multipliers(normed_input, dims_, dropout, s.rng_state)
                               : at::Tensor();
      return formulas::norm_backward(
          kind_.centered, normed_input, dims_, weight, bias, eps_, grad_out, grad_sum,
          input_type_, kind_.residual ? std::optional(residual_type_) : std::nullopt, m);
    }

    const at::Tensor x = as_rows(normed_input, dims_);
    const at::Tensor dy = as_rows(grad_out, dims_);
    at::Tensor grad_input, grad_weight, grad_bias, grad_x;
    // Grad mode is off here: straight to the backend kernel. Through the Autograd key the
    // backend op (which has no autograd kernel) would take the boxed not-implemented
    // fallback: about 3 us of a 4x64 LayerNorm forward+backward.
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    const OptTensor ds = grad_sum.defined() ? OptTensor(as_rows(grad_sum, dims_)) : std::nullopt;
    // d(input + residual) / d residual = 1. The input's gradient differs from the sum's
    // (grad_input) with a wider sum (residual_dtype: rounded once to the input's dtype) and
    // with dropout / rowscale (times the forward's multipliers, its mask regenerated): the
    // backend writes it as grad_x in the same pass over the rows (x_dtype asks for it).
    const bool own_input_grad = dropout_active_ || input_type_ != sum_type_;
    const double p = dropout_active_ ? dropout_p_ : 0.0;
    const bool weight_grad = weight.defined() && param_grads[0];
    const bool bias_grad = bias.defined() && param_grads[1];
    std::tie(grad_input, grad_weight, grad_bias, grad_x) = row_ops::norm_bwd().call(
        dy, ds, x, s.mean, s.rstd, flat(weight), flat(bias), kind_.centered,
        own_input_grad ? OptDtype(input_type_) : std::nullopt, p,
        dropout_active_ ? rowscale_rows(dropout.rowscale, normed_input) : std::nullopt,
        p > 0.0 ? OptTensor(s.rng_state) : std::nullopt, {weight_grad, bias_grad});
    grad_input = shaped_like(grad_input, normed_input.sym_sizes());
    result[0] = own_input_grad ? shaped_like(grad_x, normed_input.sym_sizes()) : grad_input;
    if (kind_.residual) {
      // The residual's: the sum's, in the residual's dtype (rounded once: that of a 16-bit
      // residual beside a wider sum is the input's gradient itself when no multiplier
      // applies, a pass saved).
      const bool same_as_input = !dropout_active_ && residual_type_ == input_type_;
      result[1] = residual_type_ == sum_type_ ? grad_input
                  : same_as_input            ? result[0]
                                             : grad_input.to(residual_type_);
    }
    if (weight_grad) result[2] = grad_weight.view_symint(weight.sym_sizes());
    if (bias_grad) result[3] = grad_bias.view_symint(bias.sym_sizes());
    return result;
  }

  // Only the sum's gradient flowed (out unused, or none at all): input and residual get
  // the sum's, weight and bias none, as under `s = x + r; norm(s)`, whose norm node never
  // runs then. Nothing saved is unpacked, so the sum may have been changed in place since.
  variable_list sum_gradients(const at::Tensor& grad_sum, const Dropout& dropout,
                              const at::Tensor& rng_state) const {
    variable_list result(4);
    if (!grad_sum.defined()) return result;
    result[0] = dropout_active_
                    ? (grad_sum * multipliers(grad_sum, dims_, dropout, rng_state))
                          .to(input_type_)
                    : grad_sum.to(input_type_);
    result[1] = grad_sum.to(residual_type_);
    return result;
  }

#if FUSEDNORM_COMPILED_AUTOGRAD
  // Compiled autograd: what the graph depends on, and one call of `functional` on the saved
  // tensors (its proxies), the constants (visit_constants' order) and the wanted gradients.
  void compiled_args(CompiledNodeArgs& args) const override {
    args.collect(normed_input_, normed_input_is_output_);
    for (const auto* v : {&weight_, &bias_, &mean_, &rstd_, &rowscale_, &rng_state_}) {
      args.collect(*v, false);
    }
    visit_constants([&](const auto& c) { args.collect(c); });
  }

  variable_list apply_with_saved(const variable_list& grads,
                                 SwapSavedVariables& saved) override {
    for (auto* v : saved_variables()) saved.before(*v);
    torch::autograd::ivalue_list args;
    for (auto* v : saved_variables()) args.emplace_back(v->unpack());
    visit_constants([&](const auto& c) { args.emplace_back(c); });
    args.emplace_back(task_should_compute_output(2));
    args.emplace_back(task_should_compute_output(3));
    static std::once_flag bound;
    variable_list result = call_functional(saved, "fusednorm_norm_backward", bound, &functional,
                                           grads, args, next_edges());
    for (auto* v : saved_variables()) saved.after(*v);
    return result;
  }

  static variable_list functional(const variable_list& grads,
                                  const torch::autograd::ivalue_list& args) {
    NormBackward node;
    Saved s;
    size_t i = 0;
    for (at::Tensor* t : {&s.normed_input, &s.weight, &s.bias, &s.mean, &s.rstd, &s.rowscale,
                          &s.rng_state}) {
      *t = args[i++].toTensor();
    }
    node.dropout_active_ = args[i++].toBool();
    node.dropout_p_ = args[i++].toDouble();
    const std::string name = args[i++].toStringRef();
    node.kind_.name = name.c_str();
    node.kind_.centered = args[i++].toBool();
    node.kind_.residual = args[i++].toBool();
    node.dims_ = args[i++].toInt();
    node.eps_ = args[i++].toDouble();
    for (at::ScalarType* t : {&node.input_type_, &node.residual_type_, &node.sum_type_}) {
      *t = args[i++].toScalarType();
    }
    const bool weight_grad = args[i++].toBool();
    const bool bias_grad = args[i++].toBool();
    return node.backward(grads, s, {weight_grad, bias_grad});
  }

  // f(constant) for each constant the backward reads, in the order functional unpacks them.
  template <class F>
  void visit_constants(F&& f) const {
    f(dropout_active_);
    f(dropout_p_);
    f(std::string(kind_.name));
    f(kind_.centered);
    f(kind_.residual);
    f(dims_);
    f(eps_);
    f(input_type_);
    f(residual_type_);
    f(sum_type_);
  }
#endif

 private:
  std::array<torch::autograd::SavedVariable*, 7> saved_variables() {
    return {&normed_input_, &weight_, &bias_, &mean_, &rstd_, &rowscale_, &rng_state_};
  }
};

// The autograd kernel of every norm op when a graph is recorded (autograd_call): runs the
// op below autograd, then links its differentiable outputs (out, and the sum with a
// residual) to a NormBackward node. mean and rstd get no history: not differentiable.
inline Outputs record(const NormKind& kind, const at::Tensor& input, const OptTensor& residual,
                      int64_t dims, const OptTensor& weight, const OptTensor& bias, double eps,
                      const BelowAutograd& below, const Dropout& dropout) {
  auto [node_ptr, node] = make_node<NormBackward>();
  node->set_next_edges(torch::autograd::collect_next_edges(input, residual, weight, bias));
  Outputs outputs = [&] {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    return below();
  }();
  auto& [out, sum, mean, rstd, rng_state] = outputs;
  torch::autograd::set_history(out, node_ptr);
  // The sum is differentiable where input or residual is (not through weight and bias):
  // otherwise its gradient slot stays, with no history attached.
  const bool sum_has_history =
      kind.residual && (input.requires_grad() || (given(residual) && residual->requires_grad()));
  if (sum_has_history) {
    torch::autograd::set_history(sum, node_ptr);
  } else if (kind.residual) {
    node->add_input_metadata(torch::autograd::Node::undefined_input());
  }
  node->kind_ = kind;
  node->dims_ = dims;
  node->eps_ = eps;
  node->input_type_ = input.scalar_type();
  node->residual_type_ = kind.residual ? residual->scalar_type() : input.scalar_type();
  node->sum_type_ = kind.residual ? sum.scalar_type() : input.scalar_type();
  // RMSNorm whose rows need no gradient (a trainable weight over frozen inputs): there
  // torch.nn.functional.rms_norm's graph keeps only a tensor computed from the rows (x times
  // rstd, saved by the weight's multiply), neither the input nor the weight, so an input made
  // in inference mode is taken, and the input (or the sum) and the weight may change in place
  // before the backward. The node keeps copies of the rows and the weight then (a pass over
  // the rows, in this case only), which refuse neither. LayerNorm keeps its input and weight,
  // as F.layer_norm's node does (and refuses all of these).
  const bool frozen_rms_rows = !kind.centered && !sum_has_history && !input.requires_grad();
  const at::Tensor& normed = kind.residual ? sum : input;
  node->normed_input_ = frozen_rms_rows
                            ? torch::autograd::SavedVariable(private_copy(normed), false)
                            : torch::autograd::SavedVariable(normed, sum_has_history);
  node->normed_input_is_output_ = kind.residual && sum_has_history;
  node->weight_ = torch::autograd::SavedVariable(
      frozen_rms_rows && given(weight) ? private_copy(*weight) : defined_or_empty(weight), false);
  node->bias_ = torch::autograd::SavedVariable(defined_or_empty(bias), false);
  // RMSNorm has no mean: norm_bwd takes an empty tensor for it.
  node->mean_ = torch::autograd::SavedVariable(mean.defined() ? mean : none_like(rstd), false);
  node->rstd_ = torch::autograd::SavedVariable(rstd, false);
  if (dropout.active()) {
    node->dropout_active_ = true;
    node->dropout_p_ = dropout.p;
    node->rowscale_ = torch::autograd::SavedVariable(defined_or_empty(dropout.rowscale), false);
    node->rng_state_ = torch::autograd::SavedVariable(rng_state, false);
  }
  announce_node(node_ptr);
  return outputs;
}

// The autograd kernel of every norm op: the op below autograd when nothing requires grad
// (no node, no saved tensors), record() when something does, then the tangents of
// forward-mode AD (attach_tangents).
// dropout (the add ops): rowscale is not differentiable, and says so when it requires grad.
inline Outputs autograd_call(const NormKind& kind, const at::Tensor& input,
                             const OptTensor& residual, c10::SymIntArrayRef normalized_shape,
                             const OptTensor& weight, const OptTensor& bias, double eps,
                             const BelowAutograd& below, const Dropout& dropout = {}) {
  TORCH_CHECK_VALUE(!given(dropout.rowscale) || !dropout.rowscale->requires_grad() ||
                        !at::GradMode::is_enabled(),
                    kind.name, ": rowscale is not differentiable; pass rowscale.detach()");
  Outputs outputs = [&]() -> Outputs {
    if (!needs_grad(input, residual, weight, bias)) {
      at::AutoDispatchBelowADInplaceOrView below_autograd;
      return below();
    }
    return record(kind, input, residual, static_cast<int64_t>(normalized_shape.size()), weight,
                  bias, eps, below, dropout);
  }();
  attach_tangents(kind, input, residual, normalized_shape, weight, bias, eps,
                  std::get<0>(outputs), std::get<1>(outputs), dropout, std::get<4>(outputs));
  return outputs;
}

// The add ops' (sum, rng_state) under CUDA autocast (which leaves add and dropout alone):
// input + residual in residual_dtype's sum type, as eager's `input + residual` (or its
// float32 form). With dropout / rowscale, the sum of the op itself below autocast
// (op_below, its own output unused: a normalize pass more than needed, on this path only).
template <class OpBelow>
std::pair<at::Tensor, at::Tensor> autocast_sum(const NormKind& kind, const at::Tensor& input,
                                               const at::Tensor& residual,
                                               OptDtype residual_dtype, const Dropout& dropout,
                                               const OpBelow& op_below) {
  if (dropout.active()) {
    c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::DispatchKey::AutocastCUDA);
    const Outputs outputs = op_below();
    return {std::get<1>(outputs), std::get<4>(outputs)};
  }
  const at::ScalarType type = sum_type(kind, input, residual_dtype);
  check_residual(kind, input, residual, type);
  check_dropout(kind, input, 1, dropout);
  return {formulas::residual_sum(input, residual, type),
          at::empty({0}, input.options().dtype(at::kLong))};
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
