// The library fusednorm: every op schema of the table in op_table.h, defined here.
//
// Two layers. The public ops (layer_norm, rms_norm, add_layer_norm, add_rms_norm,
// gelu_ffn, layer_norm_gelu_ffn) take tensors of any shape and layout; csrc/ops/<op>.cpp
// gives each its argument checks, its view as [M, N] rows, its autograd formula (Autograd
// key) and its autocast rule. They call the backend ops (norm_fwd, norm_bwd,
// layer_norm_apply, gelu_ffn_fwd, gelu_ffn_bwd), which work on contiguous [M, N] rows and
// have one kernel per device: csrc/cpu and csrc/cuda. fusednorm/ops/ adds a fake kernel for
// every op.

#include <Python.h>
#include <torch/library.h>

#include <string>
#include <string_view>

#include "cpu/gemm.h"
#include "op_table.h"

#define FUSEDNORM_STR_(x) #x
#define FUSEDNORM_STR(x) FUSEDNORM_STR_(x)

// Importing fusednorm._C runs the static registrations below; the module has no functions.
PyMODINIT_FUNC PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}

namespace {

// Key=value lines parsed by fusednorm.build_info().
std::string build_info() {
  std::string info = "cpu_capability=" FUSEDNORM_STR(FUSEDNORM_CPU_CAPABILITY_NAME) "\n";
  info += std::string("cpu_ffn_gemm=") + fusednorm::cpu::auto_gemm_backend_name() + "\n";
#ifdef FUSEDNORM_WITH_CUDA
  info += "cuda_archs=" FUSEDNORM_STR(FUSEDNORM_CUDA_ARCHS) "\n";
#endif
  // The public ops of op_table.h, comma-separated (fusednorm._loader.PUBLIC_OPS).
#define FUSEDNORM_OP_NAME(name, ...) #name ","
  info += "public_ops=" FUSEDNORM_PUBLIC_OPS(FUSEDNORM_OP_NAME) "\n";
#undef FUSEDNORM_OP_NAME
  return info;
}

bool draws_from_generator(std::string_view op) {
  return op == "add_layer_norm" || op == "add_rms_norm" || op == "norm_fwd";
}

}  // namespace

TORCH_LIBRARY(fusednorm, m) {
  m.def("build_info() -> str", &build_info);

  // The public ops, then the backend ops they call (op_table.h says what each computes).
  // The ops that draw from the generator (dropout_p > 0) are tagged, so that torch.compile
  // never recomputes them (a recomputation would draw another mask); its partitioner
  // waives the tag where dropout_p is statically 0.
#define FUSEDNORM_DEFINE_OP(name, schema, ...)                          \
  if (draws_from_generator(#name)) {                                    \
    m.def(schema, {at::Tag::nondeterministic_seeded});                  \
  } else {                                                              \
    m.def(schema);                                                      \
  }
  FUSEDNORM_PUBLIC_OPS(FUSEDNORM_DEFINE_OP)
  FUSEDNORM_BACKEND_OPS(FUSEDNORM_DEFINE_OP)
#undef FUSEDNORM_DEFINE_OP
}
