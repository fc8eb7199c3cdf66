// Every op schema of fusednorm, written once. Backends add implementations in
// csrc/cpu/*.cpp and csrc/cuda/*.cu with TORCH_LIBRARY_IMPL; Python adds fake kernels and
// autograd in fusednorm/ops.py.

#include <Python.h>
#include <torch/library.h>

#include <string>

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
#ifdef FUSEDNORM_WITH_CUDA
  info += "cuda_archs=" FUSEDNORM_STR(FUSEDNORM_CUDA_ARCHS) "\n";
#endif
  return info;
}

}  // namespace

TORCH_LIBRARY(fusednorm, m) {
  m.def("build_info() -> str", &build_info);

  // LayerNorm over the rows of a contiguous [M, N] input. mean and rstd are [M], float32
  // (float64 for a float64 input), saved for the backward.
  m.def(
      "layer_norm_fwd(Tensor input, Tensor? weight, Tensor? bias, float eps)"
      " -> (Tensor out, Tensor mean, Tensor rstd)");
  // grad_weight / grad_bias are [N] in the parameter's dtype, or empty ([0]) when that
  // parameter is None. Their reduction over rows is deterministic.
  m.def(
      "layer_norm_bwd(Tensor grad_out, Tensor input, Tensor mean, Tensor rstd,"
      " Tensor? weight, Tensor? bias) -> (Tensor grad_input, Tensor grad_weight,"
      " Tensor grad_bias)");
}
