#pragma once
// The interface between the ATen side of the CUDA norm family (norm.cpp: checks, outputs,
// streams, registration) and its kernels (norm_kernels.cuh), which setup.py compiles once
// per kind, pass and input dtype (norm_instances.cuh) so that the build spreads over several
// compiler jobs. Nothing here needs ATen: raw pointers, sizes and a workspace callback.

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <type_traits>

// at::PhiloxCudaState (its header includes no other ATen header).
#include <ATen/cuda/PhiloxCudaState.h>

namespace fusednorm::cuda {

// Statistics and sums are accumulated in float, in double for double inputs.
template <typename T>
using acc_type_t = std::conditional_t<std::is_same_v<T, double>, double, float>;

// The dtypes the kernels are compiled for: X(input's file tag, T, P, IO). T: what is
// normalized (the input; the sum with a residual) and the backward's x and dx; P: the
// parameters'; IO: the forward's x and y and the backward's dy. The pairs that
// dispatch_dtype_pair (common/dispatch.h) gives have IO = T; the last two are a float32
// residual stream (residual_dtype) beside 16-bit inputs: a float sum and float parameters
// (norm.cpp widens 16-bit ones), 16-bit x, y and dy. setup.py makes one compiled file per
// tag (f32, f64, f16, bf16), kind and pass.
#define FUSEDNORM_CUDA_NORM_DTYPES(X)                  \
  X(f32, float, float, float)                          \
  X(f64, double, double, double)                       \
  X(f16, c10::Half, c10::Half, c10::Half)              \
  X(f16, c10::Half, float, c10::Half)                  \
  X(bf16, c10::BFloat16, c10::BFloat16, c10::BFloat16) \
  X(bf16, c10::BFloat16, float, c10::BFloat16)         \
  X(f16, float, float, c10::Half)                      \
  X(bf16, float, float, c10::BFloat16)

// Temporary device buffers (chunk partials, parameter-gradient partials), valid until the
// op returns. The op file serves them from PyTorch's caching allocator on the current
// stream, so the launches stay capturable in CUDA graphs.
class Workspace {
 public:
  virtual void* allocate(int64_t bytes) = 0;

 protected:
  ~Workspace() = default;
};

// The device the tensors live on: its index and multiprocessor count size the grids.
struct DeviceInfo {
  int index;
  int sm_count;
};

// Norm forward over the rows of a row-major [M, N] x. weight/bias may be null (bias always
// null for RMSNorm). mean (LayerNorm only; null for RMSNorm) and rstd ([M]) are written for
// the backward. With a residual (the trailing members, null by default), s = x + residual
// rounded to T is written to `sum` and normalized. x and y are of IO (T's, or 16-bit
// beside a float T: a float32 sum of 16-bit inputs, whose output has their dtype).
template <typename T, typename P, typename IO = T>
struct NormFwdArgs {
  const IO* x;
  const P* weight;
  const P* bias;
  IO* y;
  acc_type_t<T>* mean;
  acc_type_t<T>* rstd;
  int64_t M;
  int64_t N;
  double eps;
  const T* residual = nullptr;
  T* sum = nullptr;
  // IO != T only, instead of residual: a residual of the input's 16-bit type (widened on
  // load; the sum is T).
  const IO* residual_io = nullptr;
  // With a residual, the multipliers of common/philox.h (norm_fwd_dropout_cuda only):
  // s = x * m + residual, m = keep_scale * rowscale[row] for a kept element, 0 for a dropped
  // one. philox: the generator's state, unpacked into (seed, offset) in the kernels (so that
  // a CUDA graph replays fresh ones); threshold: philox::dropout_threshold(p), 0 keeping
  // every element without drawing (rowscale alone); keep_scale: philox::keep_scale(p);
  // rowscale: [M] or null; rng_state: where the kernels write (seed, offset), or null.
  at::PhiloxCudaState philox{};
  uint64_t threshold = 0;
  double keep_scale = 1.0;
  const acc_type_t<T>* rowscale = nullptr;
  int64_t* rng_state = nullptr;
};

// Norm backward: dx always; dweight when dweight != nullptr (needs weight), dbias when
// dbias != nullptr (LayerNorm only). weight may be null (then dy is not scaled). mean is
// unused (may be null) for RMSNorm. grad_sum, when set, is added to dx before its rounding.
// dy is of IO (the forward's y: T's, or 16-bit beside a float T).
// norm_bwd_input_grad_cuda also writes the add ops' input gradient (the trailing members):
// dx_input = dx (rounded to T) * m rounded once to IO, m the multipliers of the forward's
// dropout (NormFwdArgs' rule) with (seed, offset) read from rng_state on the device;
// threshold 0 (rng_state unread, may be null) and no rowscale: m = 1, dx rounded to IO.
template <typename T, typename P, typename IO = T>
struct NormBwdArgs {
  const IO* dy;
  const T* x;
  const acc_type_t<T>* mean;
  const acc_type_t<T>* rstd;
  const P* weight;
  T* dx;
  P* dweight;
  P* dbias;
  int64_t M;
  int64_t N;
  const T* grad_sum = nullptr;
  IO* dx_input = nullptr;
  const int64_t* rng_state = nullptr;
  uint64_t threshold = 0;
  double keep_scale = 1.0;
  const acc_type_t<T>* rowscale = nullptr;
};

// The entries into the kernels (norm_kernels.cuh): LayerNorm when CENTERED, else RMSNorm
// (mean(x^2), no mean, no bias); both take the residual / grad_sum. They enqueue work on
// `stream` and never synchronise. Instantiated for the pairs of FUSEDNORM_CUDA_NORM_DTYPES,
// by norm_instances.cuh. norm_fwd_cuda ignores the dropout members of NormFwdArgs;
// norm_fwd_dropout_cuda (a residual, and a threshold or a rowscale) applies them: its own
// kernels, compiled in their own files, so that the plain ones stay as they were.
// norm_bwd_cuda ignores the input-gradient members of NormBwdArgs; norm_bwd_input_grad_cuda
// (dx_input set) writes it, likewise from kernels of its own.
template <bool CENTERED, typename T, typename P, typename IO = T>
void norm_fwd_cuda(const NormFwdArgs<T, P, IO>&, Workspace&, DeviceInfo, cudaStream_t);
template <bool CENTERED, typename T, typename P, typename IO = T>
void norm_fwd_dropout_cuda(const NormFwdArgs<T, P, IO>&, Workspace&, DeviceInfo, cudaStream_t);
template <bool CENTERED, typename T, typename P, typename IO = T>
void norm_bwd_cuda(const NormBwdArgs<T, P, IO>&, Workspace&, DeviceInfo, cudaStream_t);
template <bool CENTERED, typename T, typename P, typename IO = T>
void norm_bwd_input_grad_cuda(const NormBwdArgs<T, P, IO>&, Workspace&, DeviceInfo,
                              cudaStream_t);

}  // namespace fusednorm::cuda
