#pragma once
// Row-major GEMMs through cuBLASLt, with the epilogues the GELU feed-forward block fuses.
//
// cuBLASLt's GELU epilogues (GELU_AUX, GELU_AUX_BIAS, DGELU, DGELU_BGRAD) compute the tanh
// approximation of GELU -- Transformer Engine uses them for its tanh "gelu", and PyTorch's
// own fallback for them (addmm with use_gelu) is gelu(approximate="tanh") -- so fusednorm
// uses them for approximate="tanh" only; exact GELU always goes through its own kernels.

#include <ATen/core/Tensor.h>

namespace fusednorm::cuda {

// What cuBLASLt does after the product, in the row-major terms of D [m, n] = op(A) @ op(B).
enum class LtEpilogue {
  kNone,
  kBias,          // D += bias[n], broadcast over rows                   (reads bias)
  kGeluAuxBias,   // aux = D + bias[n]; D = gelu_tanh(aux)               (reads bias, writes aux)
  kGeluAux,       // aux = D;           D = gelu_tanh(aux)               (writes aux)
  kDGelu,         // D = D * gelu_tanh'(aux)                             (reads aux)
  kDGeluBgrad,    // D = D * gelu_tanh'(aux); bias[n] = sum over rows of D (reads aux, writes bias)
  kBgradRowsOfA,  // bias[m] = sum over k of op(A)[m, k]                 (writes bias)
};

// D = op(A) @ op(B) on contiguous row-major tensors of one dtype. op(A) is [m, k]: A is
// [m, k], or [k, m] with trans_a. op(B) is [k, n]: B is [k, n], or [n, k] with trans_b.
// aux, when the epilogue uses it, is a contiguous [m, n] tensor of D's dtype; bias is a
// vector of D's dtype.
struct LtGemm {
  const at::Tensor& a;
  bool trans_a;
  const at::Tensor& b;
  bool trans_b;
  at::Tensor& d;
  LtEpilogue epilogue = LtEpilogue::kNone;
  void* bias = nullptr;
  void* aux = nullptr;
};

// Whether cuBLASLt may be used for tensors of this dtype: float16, bfloat16 or float32,
// unless the environment sets FUSEDNORM_DISABLE_CUBLASLT=1 (read at every call, so tests
// can exercise the fallback paths).
bool cublaslt_enabled(at::ScalarType dtype);

// Runs the GEMM on the current stream, with a workspace from the caching allocator, and
// returns true; or returns false, having launched nothing, when cuBLASLt offers no
// algorithm for it (the caller then takes its fallback path). With
// FUSEDNORM_CUBLASLT_STRICT=1 in the environment, no algorithm is an error instead: tests
// use it to prove that the epilogue path runs.
bool try_cublaslt_gemm(const LtGemm& gemm);

}  // namespace fusednorm::cuda
