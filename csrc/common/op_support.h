#pragma once
// What every public op of csrc/ops/ needs besides its own math: calling another fusednorm
// op through the dispatcher, viewing a tensor as the [M, N] rows the kernels read, and the
// backward that a create_graph=True pass takes so that gradients of any order exist.

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>
#include <torch/version.h>

#include "common/compiled_autograd.h"

#include <initializer_list>
#include <mutex>
#include <string>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

namespace fusednorm {

using torch::autograd::variable_list;

// The typed handle of fusednorm::<name>; look it up once (a function-local static at the
// call site), then .call(...) costs one dispatch.
template <class Signature>
c10::TypedOperatorHandle<Signature> fusednorm_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

// Sizes here are SymInts (sym_sizes, view_symint): the autograd nodes run these helpers
// while torch.compile traces a backward, where a concrete size() would specialize the graph
// to that size (a recompile per batch size under dynamic shapes).

// t as row-major [rows, cols] with cols = the product of its trailing `trailing_dims`
// dims: a copy only when t's layout is not already that.
inline at::Tensor as_rows(const at::Tensor& t, int64_t trailing_dims) {
  if (t.dim() == 2 && trailing_dims == 1 && t.is_contiguous()) return t;  // no dispatch
  const c10::SymIntArrayRef sizes = t.sym_sizes();
  c10::SymInt rows = 1;
  for (int64_t d = 0; d < t.dim() - trailing_dims; ++d) rows *= sizes[d];
  c10::SymInt cols = 1;
  for (int64_t d = t.dim() - trailing_dims; d < t.dim(); ++d) cols *= sizes[d];
  if (t.is_contiguous()) return t.view_symint({rows, cols});
  return t.reshape_symint({rows, cols}).contiguous();
}

// The inverse of as_rows for an output of `rows`' layout: `like`'s shape.
inline at::Tensor shaped_like(const at::Tensor& rows, c10::SymIntArrayRef shape) {
  return rows.sym_sizes() == shape ? rows : rows.view_symint(shape);
}

// A parameter flattened to a contiguous 1-D tensor (nullopt stays nullopt).
inline std::optional<at::Tensor> flat(const std::optional<at::Tensor>& t) {
  if (!t.has_value() || !t->defined()) return std::nullopt;
  if (t->dim() == 1 && t->is_contiguous()) return t;
  return t->reshape({-1}).contiguous();
}

// An optional tensor made contiguous (nullopt stays nullopt).
inline std::optional<at::Tensor> contiguous_or_none(const std::optional<at::Tensor>& t) {
  if (!t.has_value() || !t->defined()) return std::nullopt;
  return t->contiguous();
}

inline at::Tensor defined_or_empty(const std::optional<at::Tensor>& t) {
  return t.has_value() ? *t : at::Tensor();
}

// Whether a call with these tensor arguments records an autograd graph. When it does not,
// an Autograd kernel calls below autograd directly: a torch::autograd::Function costs a
// node, its context and output wrapping even when nothing requires grad.
inline bool requires_grad(const at::Tensor& t) { return t.defined() && t.requires_grad(); }
inline bool requires_grad(const std::optional<at::Tensor>& t) {
  return t.has_value() && requires_grad(*t);
}
template <class... Ts>
bool needs_grad(const Ts&... tensors) {
  return at::GradMode::is_enabled() && (requires_grad(tensors) || ...);
}

// Forward-mode AD (dual tensors, torch.func.jvp): the fused kernels compute the primal
// output from the inputs' primals, and the op recomputed from ATen's ops (the op's
// `reference`, whose ops have forward-AD formulas) gives the tangent, which attach_tangent
// sets on the fused output. Only calls with a tangent pay for that second forward; the
// tangent keeps ATen's reverse-mode graph, so it can be differentiated in turn.
inline bool has_tangent(const at::Tensor& t) { return t.defined() && t._fw_grad(0).defined(); }
inline bool has_tangent(const std::optional<at::Tensor>& t) {
  return t.has_value() && has_tangent(*t);
}
template <class... Ts>
bool any_tangent(const Ts&... tensors) {
  return (has_tangent(tensors) || ...);
}

// Sets on `out` the tangent that `reference_out` (the same output from ATen's ops) carries,
// in out's dtype; none when no input's tangent reached it.
inline void attach_tangent(const at::Tensor& out, const at::Tensor& reference_out) {
  const at::Tensor tangent = reference_out._fw_grad(/*level=*/0);
  if (tangent.defined()) {
    out._set_fw_grad(tangent.to(out.scalar_type()), /*level=*/0, /*is_inplace_op=*/false);
  }
}

// A new autograd node of type T: its owning pointer (the type Node::getptr returns, an
// intrusive_ptr in recent PyTorch, a shared_ptr before) and T* to fill in its fields.
template <class T>
auto make_node() {
  using NodePtr = decltype(std::declval<torch::autograd::Node&>().getptr());
  if constexpr (std::is_same_v<NodePtr, std::shared_ptr<torch::autograd::Node>>) {
    std::shared_ptr<T> node(new T());
    return std::pair<NodePtr, T*>(node, node.get());
  } else {
    auto node = c10::make_intrusive<T>();
    T* raw = node.get();
    return std::pair<NodePtr, T*>(NodePtr(std::move(node)), raw);
  }
}

// Runs the torch.autograd.graph.node_creation_hook callbacks (PyTorch 2.14 on) for a node
// whose outputs and saved tensors are all in place, as PyTorch's own nodes do once built.
template <class NodePtr>
void announce_node(const NodePtr& node) {
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 14)
  torch::autograd::fire_node_creation_hooks(node);
#else
  (void)node;
#endif
}

// A backward node that keeps a list of tensors (SavedVariables, so saved-tensor hooks and
// in-place checks apply) and releases them after the backward, unless retain_graph.
struct SavedListNode : public torch::autograd::Node {
  std::vector<torch::autograd::SavedVariable> saved_;

  // Inputs of the op, or outputs without history (never the node's own outputs).
  void save(std::initializer_list<at::Tensor> tensors) {
    for (const at::Tensor& t : tensors) saved_.emplace_back(t, /*is_output=*/false);
  }
  variable_list unpack_saved() {
    variable_list tensors;
    tensors.reserve(saved_.size());
    for (auto& s : saved_) tensors.push_back(s.unpack());
    return tensors;
  }
  void release_variables() override {
    for (auto& s : saved_) s.reset_data();
  }
  // Which of the gradients (of the inputs, in next-edge order) the backward is asked for.
  std::vector<bool> wanted_outputs() const {
    std::vector<bool> wanted(num_outputs());
    for (size_t i = 0; i < wanted.size(); ++i) wanted[i] = task_should_compute_output(i);
    return wanted;
  }
};

#if FUSEDNORM_COMPILED_AUTOGRAD
// A SavedListNode's apply_with_saved: one call of fn (common/compiled_autograd.h) on its
// saved tensors, then `constants`, then wanted_outputs() (unpack_functional reads them back).
inline variable_list call_saved_list_functional(SavedListNode& node,
                                                SwapSavedVariables& saved,
                                                const variable_list& grads,
                                                const std::string& name, std::once_flag& bound,
                                                const torch::autograd::functional_apply_t& fn,
                                                std::initializer_list<at::IValue> constants) {
  saved.before(node.saved_);
  torch::autograd::ivalue_list args;
  for (const auto& s : node.saved_) args.emplace_back(s.unpack());
  for (const at::IValue& c : constants) args.push_back(c);
  args.emplace_back(node.wanted_outputs());
  variable_list result = call_functional(saved, name, bound, fn, grads, args, node.next_edges());
  saved.after(node.saved_);
  return result;
}

// A SavedListNode's packed arguments: its `count` saved tensors, its constants, the wanted
// gradients.
struct FunctionalArgs {
  variable_list saved;
  std::vector<at::IValue> constants;
  std::vector<bool> wanted;
};

inline FunctionalArgs unpack_functional(const torch::autograd::ivalue_list& args, size_t count) {
  FunctionalArgs out;
  for (size_t i = 0; i < count; ++i) out.saved.push_back(args[i].toTensor());
  out.constants.assign(args.begin() + count, args.end() - 1);
  out.wanted = args.back().toBoolList().vec();
  return out;
}
#endif

}  // namespace fusednorm
