// Every op schema of fusednorm, written once.
//
// Two layers. The public ops (layer_norm, gelu_ffn, layer_norm_gelu_ffn) take tensors of
// any shape and layout; csrc/ops/<op>.cpp gives each its argument checks, its view as
// [M, N] rows, its autograd formula (Autograd key) and its autocast rule. They call the
// backend ops below, which work on contiguous [M, N] rows and have one kernel per device:
// csrc/cpu/*.cpp and csrc/cuda/*.cu. fusednorm/ops.py adds a fake kernel for every op.

#include <Python.h>
#include <torch/library.h>

#include <string>

#include "cpu/gemm.h"

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
  return info;
}

}  // namespace

TORCH_LIBRARY(fusednorm, m) {
  m.def("build_info() -> str", &build_info);

  // --- public ops: any shape, autograd to any order, autocast like torch.nn.functional ---

  // LayerNorm over the trailing normalized_shape dims, as torch.native_layer_norm: the
  // output (input's shape and dtype, contiguous) and the per-row statistics mean and rstd
  // ([M], float32; float64 for a float64 input), which are not differentiable.
  //
  // zero_centered_weight (the norm ops): the weight applied is 1 + weight, formed in the
  // computation type (float32; float64 for a float64 input); gradients go to weight.
  m.def(
      "layer_norm(Tensor input, SymInt[] normalized_shape, Tensor? weight, Tensor? bias,"
      " float eps, bool zero_centered_weight=False) -> (Tensor out, Tensor mean, Tensor rstd)");
  // RMSNorm over the trailing normalized_shape dims, as torch.nn.functional.rms_norm (eps
  // None: the machine epsilon of float32, or of float64 for a float64 input), and rstd.
  m.def(
      "rms_norm(Tensor input, SymInt[] normalized_shape, Tensor? weight, float? eps,"
      " bool zero_centered_weight=False) -> (Tensor out, Tensor rstd)");
  // s = input + residual (input's dtype), then LayerNorm / RMSNorm of s, in one pass over
  // memory: (norm(s), s, statistics); norm(s) and s are differentiable.
  m.def(
      "add_layer_norm(Tensor input, Tensor residual, SymInt[] normalized_shape, Tensor? weight,"
      " Tensor? bias, float eps, bool zero_centered_weight=False)"
      " -> (Tensor out, Tensor sum, Tensor mean, Tensor rstd)");
  m.def(
      "add_rms_norm(Tensor input, Tensor residual, SymInt[] normalized_shape, Tensor? weight,"
      " float? eps, bool zero_centered_weight=False) -> (Tensor out, Tensor sum, Tensor rstd)");
  // gelu(input @ weight1.T + bias1) @ weight2.T + bias2 over the last dim, and hidden_pre =
  // input @ weight1.T + bias1 as [M, hidden] rows (not differentiable).
  m.def(
      "gelu_ffn(Tensor input, Tensor weight1, Tensor? bias1, Tensor weight2, Tensor? bias2,"
      " str approximate) -> (Tensor out, Tensor hidden_pre)");
  // input + gelu_ffn(layer_norm(input, [d])): the pre-LN feed-forward sub-block, with the
  // LayerNorm statistics and hidden_pre (not differentiable).
  m.def(
      "layer_norm_gelu_ffn(Tensor input, Tensor? ln_weight, Tensor? ln_bias, float eps,"
      " Tensor weight1, Tensor? bias1, Tensor weight2, Tensor? bias2, str approximate)"
      " -> (Tensor out, Tensor mean, Tensor rstd, Tensor hidden_pre)");

  // --- backend ops: contiguous [M, N] rows, one kernel per device, no autograd ---

  // The norm family over the rows of a contiguous [M, N] input: LayerNorm (centered) or
  // RMSNorm (not centered: no mean, no bias), normalizing input + residual when a residual
  // is given. sum = input + residual in the input's dtype ([0] without a residual); mean
  // ([M]; [0] for RMSNorm) and rstd ([M]) are float32 (float64 for a float64 input).
  m.def(
      "norm_fwd(Tensor input, Tensor? residual, Tensor? weight, Tensor? bias, float eps,"
      " bool centered) -> (Tensor out, Tensor sum, Tensor mean, Tensor rstd)");
  // input is what was normalized (the sum, with a residual); grad_sum, the gradient of the
  // sum output, is added to grad_input. grad_weight / grad_bias as layer_norm_bwd's.
  m.def(
      "norm_bwd(Tensor grad_out, Tensor? grad_sum, Tensor input, Tensor mean, Tensor rstd,"
      " Tensor? weight, Tensor? bias, bool centered) -> (Tensor grad_input,"
      " Tensor grad_weight, Tensor grad_bias)");

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
  // The LayerNorm output (input - mean) * rstd * weight + bias from the statistics that
  // layer_norm_fwd returned: a block that does not save its LayerNorm output recomputes
  // it with this in the backward.
  m.def(
      "layer_norm_apply(Tensor input, Tensor mean, Tensor rstd, Tensor? weight,"
      " Tensor? bias) -> Tensor");

  // GELU feed-forward block out = gelu(input @ weight1.T + bias1) @ weight2.T + bias2 over
  // a contiguous [M, K] input; weight1 [H, K], weight2 [N, H], biases [H] / [N], all of the
  // input's dtype. approximate is 'none' (erf) or 'tanh', as torch.nn.GELU. hidden_pre =
  // input @ weight1.T + bias1 ([M, H]) is all the backward needs besides the input.
  m.def(
      "gelu_ffn_fwd(Tensor input, Tensor weight1, Tensor? bias1, Tensor weight2,"
      " Tensor? bias2, str approximate) -> (Tensor out, Tensor hidden_pre)");
  // Recomputes gelu(hidden_pre) where it needs it. grad_bias1 / grad_bias2 are [H] / [N],
  // or empty ([0]) when has_bias1 / has_bias2 is false; their reduction over rows is
  // deterministic.
  m.def(
      "gelu_ffn_bwd(Tensor grad_out, Tensor input, Tensor hidden_pre, Tensor weight1,"
      " Tensor weight2, bool has_bias1, bool has_bias2, str approximate) -> (Tensor"
      " grad_input, Tensor grad_weight1, Tensor grad_bias1, Tensor grad_weight2,"
      " Tensor grad_bias2)");
}
