#pragma once
// How fusednorm's backward nodes take part in compiled autograd
// (torch._dynamo.compiled_autograd, PyTorch 2.14 on): a node's compiled_args collects what
// its backward depends on (saved tensors, constants: compiled autograd's cache key), and its
// apply_with_saved records one call of the node's functional form, a static function of
// its incoming gradients and packed arguments. Compiled autograd traces that call like
// PyTorch's own nodes' (the backend ops it calls, through their fake kernels) or runs it.
// Before 2.14 the nodes have neither, and compiled autograd refuses them.

#include <torch/version.h>

#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 14)
#define FUSEDNORM_COMPILED_AUTOGRAD 1
#else
#define FUSEDNORM_COMPILED_AUTOGRAD 0
#endif

#if FUSEDNORM_COMPILED_AUTOGRAD
#include <torch/csrc/dynamo/compiled_autograd.h>

#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace fusednorm {

using torch::dynamo::autograd::CompiledNodeArgs;
using torch::dynamo::autograd::SwapSavedVariables;

// One call of `fn` on grads and args, recorded by the compiler that `saved` belongs to;
// fn is bound to it as compiled autograd's ops.<name> once per process (`bound`), with the
// types of args as its schema: a node packs the same types on every call.
inline torch::autograd::variable_list call_functional(
    SwapSavedVariables& saved, const std::string& name, std::once_flag& bound,
    const torch::autograd::functional_apply_t& fn, const torch::autograd::variable_list& grads,
    const torch::autograd::ivalue_list& args, const torch::autograd::edge_list& next_edges) {
  const auto& compiler = torch::dynamo::autograd::getPyCompilerInterface();
  std::call_once(bound, [&] {
    std::vector<at::TypePtr> schema;
    schema.reserve(args.size());
    for (const at::IValue& arg : args) {
      schema.push_back(arg.isTensor() ? at::TensorType::get() : arg.type());
    }
    compiler->bind_function(saved.get_py_compiler(), name, fn, std::move(schema),
                            /*is_custom_function=*/false, /*is_traceable=*/true);
  });
  const at::IValue metadata = torch::dynamo::autograd::IValuePacker<
      std::vector<std::optional<torch::autograd::InputMetadata>>>::
      pack(torch::dynamo::autograd::get_input_metadata(next_edges));
  return compiler->call_function(saved.get_py_compiler(), "apply_functional", name, grads, args,
                                 metadata);
}

}  // namespace fusednorm
#endif
