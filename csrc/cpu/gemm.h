#pragma once
// The CPU FFN's GEMMs: ATen's (what eager nn.Linear runs: MKL for float32) or, where it is
// measured faster, oneDNN's matmul, which ships inside libtorch_cpu.
//
// Which one, per GEMM (float32 only; every other dtype stays on ATen, whose addmm already
// hands bfloat16/float16 to oneDNN where the CPU supports them):
//   FUSEDNORM_CPU_GEMM=aten     ATen always.
//   FUSEDNORM_CPU_GEMM=onednn   oneDNN for every non-empty float32 GEMM; an error if this
//                               torch has no oneDNN matmul, or it cannot run on this CPU
//                               (tests use it to prove the path).
//   unset (auto)                oneDNN on AMD CPUs with AVX-512 for GEMMs of at least 2^24
//                               multiply-adds with the tokens as the long side, ATen
//                               otherwise: there oneDNN measured faster than MKL's sgemm,
//                               while a reduction over the tokens (weight gradients) took
//                               the same time, and below 2^24 oneDNN's fixed cost per call
//                               outweighs the gain. Other CPUs were not measured and keep
//                               eager's choice (docs/perf-notes.md, "Code comments: gemm.h").
// The variable is read at every call (cheap beside a GEMM this size), so tests can flip it.

#include <ATen/core/Tensor.h>

#include <optional>

namespace fusednorm::cpu {

// out = a @ b, or out += a @ b when `accumulate`. a [m, k] and b [k, n] in any strides;
// out [m, n] with unit column stride.
void matmul_into(const at::Tensor& out, const at::Tensor& a, const at::Tensor& b,
                 bool accumulate);

// out = a @ w^T + bias (bias added inside the GEMM's accumulation, as addmm does).
void linear_into(const at::Tensor& out, const at::Tensor& a, const at::Tensor& w,
                 const std::optional<at::Tensor>& bias);

// What the unset setting picks for large float32 GEMMs on this CPU with this torch:
// "onednn" or "aten" (for build_info and the benchmarks' notes).
const char* auto_gemm_backend_name();

}  // namespace fusednorm::cpu
