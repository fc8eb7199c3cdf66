// GELU feed-forward block on CUDA.
//
//   forward:  h = x @ W1^T + b1, a = gelu(h), out = a @ W2^T + b2
//   backward: a = gelu(h) again, dW2 = dy^T @ a, db2 = sum_rows(dy), dg = dy @ W2,
//             dh = dg * gelu'(h), db1 = sum_rows(dh), dW1 = dh^T @ x, dx = dh @ W1
//
// GEMMs go through cuBLASLt with the epilogue that fuses the elementwise work where one
// applies (float16 / bfloat16 / float32; GELU epilogues only for approximate="tanh", since
// cuBLASLt's GELU is the tanh form, and only for float16 / bfloat16: in float32 it is less
// accurate than PyTorch's GELU, an error that stays under 16-bit rounding; see
// docs/perf-notes.md, "CUDA kernels"), else through ATen's GEMMs plus
// fusednorm's kernels ("otherwise": float64, FUSEDNORM_DISABLE_CUBLASLT=1, or no cuBLASLt
// algorithm):
//
//   step        with cuBLASLt                                          otherwise
//   h, a        tanh, 16-bit: GEMM + GELU_AUX(_BIAS) epilogue           addmm (mm), gelu pass
//               else:         GEMM + BIAS epilogue, gelu pass
//   out         GEMM + BIAS epilogue                                    addmm (mm)
//   a           gelu pass (recomputed from h)                           gelu pass
//   dW2, db2    GEMM + BGRADB epilogue                                  mm, column sum of dy
//   dh, db1     tanh, 16-bit: GEMM + DGELU(_BGRAD) epilogue             mm (dg), dgelu pass
//               else:         mm (dg), dgelu pass (dh, db1 at once)
//   dW1, dx     mm                                                      mm
//
// fusednorm's kernels (the gelu pass, the dgelu pass, the column sum) and their launchers
// are in gelu_ffn_kernels.cuh (ATen-free, so that tests/emulation runs them too); this file
// holds the ops: checks, outputs, workspaces and the GEMMs. Everything runs on the current
// stream with no host synchronisation or host-side allocation outside the caching
// allocator, so the ops can be captured in a CUDA graph.

#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/addmm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cstdint>
#include <tuple>
#include <type_traits>

#include "common/dispatch.h"
#include "common/gelu.h"
#include "common/gelu_ffn_checks.h"
#include "cuda/cublaslt_gemm.h"
#include "cuda/gelu_ffn_kernels.cuh"

namespace fusednorm::cuda {
namespace {

template <typename T>
using acc_type = gelu_ffn_detail::acc_type<T>;

int sm_count() { return at::cuda::getCurrentDeviceProperties()->multiProcessorCount; }

// The partial sums of a column-sum pass over [rows, cols] (none for rows = 0).
template <typename T>
at::Tensor column_sum_workspace(int64_t rows, int64_t cols, const at::TensorOptions& options) {
  return at::empty({column_slab_partial_size(rows, cols)},
                   options.dtype(c10::CppTypeToScalarType<acc_type<T>>::value));
}

// a = gelu(h) for contiguous tensors of one shape.
template <typename T>
void gelu_pass(const at::Tensor& h, at::Tensor& a, GeluKind kind) {
  launch_gelu<T>(h.const_data_ptr<T>(), a.mutable_data_ptr<T>(), h.numel(), kind, sm_count(),
                 at::cuda::getCurrentCUDAStream());
}

// The backward's pass: dh = dg * gelu'(h) over dg, db1 = column sums of dh.
template <typename T>
void dgelu_pass(const at::Tensor& h, at::Tensor& dg_dh, T* grad_bias, GeluKind kind) {
  const int64_t rows = h.size(0), cols = h.size(1);
  at::Tensor partial = column_sum_workspace<T>(grad_bias ? rows : 0, cols, h.options());
  launch_dgelu<T>(h.const_data_ptr<T>(), dg_dh.mutable_data_ptr<T>(), rows, cols, grad_bias,
                  grad_bias ? partial.mutable_data_ptr<acc_type<T>>() : nullptr, kind,
                  sm_count(), at::cuda::getCurrentCUDAStream());
}

// out = column sums of the contiguous [rows, cols] tensor x.
template <typename T>
void column_sum(const at::Tensor& x, T* out) {
  at::Tensor partial = column_sum_workspace<T>(x.size(0), x.size(1), x.options());
  launch_column_sum<T>(x.const_data_ptr<T>(), x.size(0), x.size(1), out,
                       partial.mutable_data_ptr<acc_type<T>>(), sm_count(),
                       at::cuda::getCurrentCUDAStream());
}

// cuBLASLt's GELU epilogues: its GELU is the tanh form, accurate to 16-bit rounding only.
template <typename T>
constexpr bool gelu_epilogue_usable(GeluKind kind) {
  return kind == GeluKind::kTanh && (std::is_same_v<T, at::Half> || std::is_same_v<T, at::BFloat16>);
}

template <typename T>
T* data_or_null(const std::optional<at::Tensor>& t) {
  return given(t) ? const_cast<T*>(t->const_data_ptr<T>()) : nullptr;
}

// ---- ops ---------------------------------------------------------------------------------

std::tuple<at::Tensor, at::Tensor> gelu_ffn_fwd(const at::Tensor& input, const at::Tensor& weight1,
                                                const std::optional<at::Tensor>& bias1,
                                                const at::Tensor& weight2,
                                                const std::optional<at::Tensor>& bias2,
                                                c10::string_view approximate) {
  check_gelu_ffn_fwd_args(input, weight1, bias1, weight2, bias2);
  const GeluKind kind = parse_approximate(approximate);
  const c10::cuda::OptionalCUDAGuard device_guard(input.device());
  const int64_t M = input.size(0), H = weight1.size(0), N = weight2.size(0);
  const auto options = input.options();
  at::Tensor hidden = at::empty({M, H}, options);
  at::Tensor act = at::empty({M, H}, options);
  at::Tensor out = at::empty({M, N}, options);
  const bool lt = cublaslt_enabled(input.scalar_type());

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, input.scalar_type(), "gelu_ffn_fwd", [&] {
    using T = scalar_t;
    T* b1 = data_or_null<T>(bias1);
    T* b2 = data_or_null<T>(bias2);

    // h and a: one GEMM whose epilogue adds b1, applies tanh-GELU and keeps h (tanh only).
    const bool fused = lt && gelu_epilogue_usable<T>(kind) &&
                       try_cublaslt_gemm({input, false, weight1, true, act,
                                          b1 ? LtEpilogue::kGeluAuxBias : LtEpilogue::kGeluAux,
                                          b1, hidden.mutable_data_ptr()});
    if (!fused) {
      // Else the GEMM with b1 added inside it (epilogue, or addmm's beta = 1), before the
      // product is rounded to T: adding it to a rounded float16/bfloat16 product loses
      // accuracy wherever the two nearly cancel. Then GELU in one pass.
      const bool gemm_done = lt && b1 != nullptr &&
                             try_cublaslt_gemm({input, false, weight1, true, hidden,
                                                LtEpilogue::kBias, b1});
      if (!gemm_done) {
        if (b1 != nullptr) {
          at::addmm_out(hidden, *bias1, input, weight1.t());
        } else {
          at::mm_out(hidden, input, weight1.t());
        }
      }
      gelu_pass<T>(hidden, act, kind);
    }

    // out = a @ W2^T + b2.
    const bool out_done = lt && b2 != nullptr &&
                          try_cublaslt_gemm({act, false, weight2, true, out, LtEpilogue::kBias, b2});
    if (!out_done) {
      if (b2 != nullptr) {
        at::addmm_out(out, *bias2, act, weight2.t());
      } else {
        at::mm_out(out, act, weight2.t());
      }
    }
  });
  return {out, hidden};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> gelu_ffn_bwd(
    const at::Tensor& grad_out, const at::Tensor& input, const at::Tensor& hidden_pre,
    const at::Tensor& weight1, const at::Tensor& weight2, bool has_bias1, bool has_bias2,
    c10::string_view approximate) {
  check_gelu_ffn_bwd_args(grad_out, input, hidden_pre, weight1, weight2);
  const GeluKind kind = parse_approximate(approximate);
  const c10::cuda::OptionalCUDAGuard device_guard(input.device());
  const int64_t M = input.size(0), K = input.size(1), H = weight1.size(0), N = weight2.size(0);
  const auto options = input.options();
  at::Tensor grad_input = at::empty({M, K}, options);
  at::Tensor grad_weight1 = at::empty({H, K}, options);
  at::Tensor grad_weight2 = at::empty({N, H}, options);
  at::Tensor grad_bias1 = at::empty({has_bias1 ? H : 0}, options);
  at::Tensor grad_bias2 = at::empty({has_bias2 ? N : 0}, options);
  if (M == 0) {  // no rows: the weight and bias gradients are empty sums
    grad_weight1.zero_();
    grad_weight2.zero_();
    grad_bias1.zero_();
    grad_bias2.zero_();
    return {grad_input, grad_weight1, grad_bias1, grad_weight2, grad_bias2};
  }
  const bool lt = cublaslt_enabled(input.scalar_type());
  at::Tensor grad_hidden;  // dg, then dh in place

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, input.scalar_type(), "gelu_ffn_bwd", [&] {
    using T = scalar_t;
    T* db1 = has_bias1 ? grad_bias1.mutable_data_ptr<T>() : nullptr;
    T* db2 = has_bias2 ? grad_bias2.mutable_data_ptr<T>() : nullptr;

    // a = gelu(h) again, then dW2 = dy^T @ a, with db2 = column sums of dy in the GEMM's
    // epilogue if it can. a is released before dh is allocated, so the backward holds h and
    // one [M, H] temporary at a time (the caching allocator hands a's block to dh), where
    // eager holds h, a and a gradient of one of them. The price, off the 16-bit tanh path:
    // h is read twice (the gelu pass, then the dgelu pass); one pass writing a and dh after
    // dg would hold a, dh and db1 at once, over eager's peak (docs/perf-notes.md).
    {
      at::Tensor act = at::empty({M, H}, options);
      gelu_pass<T>(hidden_pre, act, kind);
      const bool db2_done = lt && db2 != nullptr &&
                            try_cublaslt_gemm({grad_out, true, act, false, grad_weight2,
                                               LtEpilogue::kBgradRowsOfA, db2});
      if (!db2_done) {
        at::mm_out(grad_weight2, grad_out.t(), act);
        if (db2 != nullptr) column_sum<T>(grad_out, db2);
      }
    }

    // dh = (dy @ W2) * gelu'(h), stored over dg, and db1: in the GEMM's epilogue where it
    // applies, else dg = dy @ W2 and one pass over h and dg.
    grad_hidden = at::empty({M, H}, options);
    const bool fused = lt && gelu_epilogue_usable<T>(kind) &&
                       try_cublaslt_gemm({grad_out, false, weight2, false, grad_hidden,
                                          db1 ? LtEpilogue::kDGeluBgrad : LtEpilogue::kDGelu,
                                          db1, const_cast<void*>(hidden_pre.const_data_ptr())});
    if (!fused) {
      at::mm_out(grad_hidden, grad_out, weight2);
      dgelu_pass<T>(hidden_pre, grad_hidden, db1, kind);
    }
  });
  at::mm_out(grad_weight1, grad_hidden.t(), input);
  at::mm_out(grad_input, grad_hidden, weight1);
  return {grad_input, grad_weight1, grad_bias1, grad_weight2, grad_bias2};
}

}  // namespace
}  // namespace fusednorm::cuda

TORCH_LIBRARY_IMPL(fusednorm, CUDA, m) {
  m.impl("gelu_ffn_fwd", &fusednorm::cuda::gelu_ffn_fwd);
  m.impl("gelu_ffn_bwd", &fusednorm::cuda::gelu_ffn_bwd);
}
