#pragma once
// The CPU FFN's GEMMs: ATen's (what eager nn.Linear runs: MKL for float32) or, where it is
// measured faster, oneDNN's matmul, which ships inside libtorch_cpu.
//
// Which one, per GEMM (float32 only; every other dtype stays on ATen, whose addmm already
// hands bfloat16/float16 to oneDNN where the CPU supports them):
//   FUSEDNORM_CPU_GEMM=aten     ATen always.
//   FUSEDNORM_CPU_GEMM=onednn   oneDNN for every non-empty float32 GEMM; an error if this
//                               torch has no oneDNN matmul (tests use it to prove the path).
//   unset (auto)                oneDNN on AMD CPUs with AVX-512 for GEMMs of at least 2^24
//                               multiply-adds, ATen otherwise. Measured on Zen 4 (2 cores,
//                               torch 2.14.1): MKL's sgemm takes 1.14-1.17x oneDNN's time
//                               for [M, K] x [K, N] with M the long side (2048 x 768 x 3072
//                               and 256-4096 rows alike), and the same time when the
//                               reduction runs over M (weight gradients), so only the former
//                               go through here. Below 2^24 oneDNN's fixed cost (about 12 us
//                               per call) outweighs the gain; on other CPUs nothing was
//                               measured, so they keep eager's choice.
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
