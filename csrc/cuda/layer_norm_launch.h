#pragma once
// The interface between the ATen side of the CUDA norm family (layer_norm.cpp: checks,
// outputs, streams, registration) and its kernels, which are compiled per pass and input
// dtype in layer_norm_{fwd,bwd}_<dtype>.cu (LayerNorm) and rms_norm_{fwd,bwd}_<dtype>.cu
// (RMSNorm) so that the build spreads over several compiler jobs.
// Nothing here needs ATen: raw pointers, sizes and a workspace callback.

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <type_traits>

namespace fusednorm::cuda {

// Statistics and sums are accumulated in float, in double for double inputs.
template <typename T>
using acc_type_t = std::conditional_t<std::is_same_v<T, double>, double, float>;

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
// rounded to T is written to `sum` and normalized.
template <typename T, typename P>
struct NormFwdArgs {
  const T* x;
  const P* weight;
  const P* bias;
  T* y;
  acc_type_t<T>* mean;
  acc_type_t<T>* rstd;
  int64_t M;
  int64_t N;
  double eps;
  const T* residual = nullptr;
  T* sum = nullptr;
};

// Norm backward: dx always; dweight when dweight != nullptr (needs weight), dbias when
// dbias != nullptr (LayerNorm only). weight may be null (then dy is not scaled). mean is
// unused (may be null) for RMSNorm. grad_sum, when set, is added to dx before its rounding.
template <typename T, typename P>
struct NormBwdArgs {
  const T* dy;
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
};

template <typename T, typename P>
using LayerNormFwdArgs = NormFwdArgs<T, P>;
template <typename T, typename P>
using LayerNormBwdArgs = NormBwdArgs<T, P>;

// One overload per (input dtype, parameter dtype) pair that checks.h allows; each is
// defined in layer_norm_{fwd,bwd}_<input dtype>.cu. They enqueue work on `stream` and
// never synchronise.
void layer_norm_fwd_cuda(const LayerNormFwdArgs<float, float>&, Workspace&, DeviceInfo, cudaStream_t);
void layer_norm_fwd_cuda(const LayerNormFwdArgs<double, double>&, Workspace&, DeviceInfo, cudaStream_t);
void layer_norm_fwd_cuda(const LayerNormFwdArgs<c10::Half, c10::Half>&, Workspace&, DeviceInfo, cudaStream_t);
void layer_norm_fwd_cuda(const LayerNormFwdArgs<c10::Half, float>&, Workspace&, DeviceInfo, cudaStream_t);
void layer_norm_fwd_cuda(const LayerNormFwdArgs<c10::BFloat16, c10::BFloat16>&, Workspace&, DeviceInfo, cudaStream_t);
void layer_norm_fwd_cuda(const LayerNormFwdArgs<c10::BFloat16, float>&, Workspace&, DeviceInfo, cudaStream_t);

void layer_norm_bwd_cuda(const LayerNormBwdArgs<float, float>&, Workspace&, DeviceInfo, cudaStream_t);
void layer_norm_bwd_cuda(const LayerNormBwdArgs<double, double>&, Workspace&, DeviceInfo, cudaStream_t);
void layer_norm_bwd_cuda(const LayerNormBwdArgs<c10::Half, c10::Half>&, Workspace&, DeviceInfo, cudaStream_t);
void layer_norm_bwd_cuda(const LayerNormBwdArgs<c10::Half, float>&, Workspace&, DeviceInfo, cudaStream_t);
void layer_norm_bwd_cuda(const LayerNormBwdArgs<c10::BFloat16, c10::BFloat16>&, Workspace&, DeviceInfo, cudaStream_t);
void layer_norm_bwd_cuda(const LayerNormBwdArgs<c10::BFloat16, float>&, Workspace&, DeviceInfo, cudaStream_t);

// RMSNorm (mean(x^2), no mean, no bias), in rms_norm_{fwd,bwd}_<input dtype>.cu. The
// LayerNorm entries above take the residual / grad_sum too.
void rms_norm_fwd_cuda(const NormFwdArgs<float, float>&, Workspace&, DeviceInfo, cudaStream_t);
void rms_norm_fwd_cuda(const NormFwdArgs<double, double>&, Workspace&, DeviceInfo, cudaStream_t);
void rms_norm_fwd_cuda(const NormFwdArgs<c10::Half, c10::Half>&, Workspace&, DeviceInfo, cudaStream_t);
void rms_norm_fwd_cuda(const NormFwdArgs<c10::Half, float>&, Workspace&, DeviceInfo, cudaStream_t);
void rms_norm_fwd_cuda(const NormFwdArgs<c10::BFloat16, c10::BFloat16>&, Workspace&, DeviceInfo, cudaStream_t);
void rms_norm_fwd_cuda(const NormFwdArgs<c10::BFloat16, float>&, Workspace&, DeviceInfo, cudaStream_t);

void rms_norm_bwd_cuda(const NormBwdArgs<float, float>&, Workspace&, DeviceInfo, cudaStream_t);
void rms_norm_bwd_cuda(const NormBwdArgs<double, double>&, Workspace&, DeviceInfo, cudaStream_t);
void rms_norm_bwd_cuda(const NormBwdArgs<c10::Half, c10::Half>&, Workspace&, DeviceInfo, cudaStream_t);
void rms_norm_bwd_cuda(const NormBwdArgs<c10::Half, float>&, Workspace&, DeviceInfo, cudaStream_t);
void rms_norm_bwd_cuda(const NormBwdArgs<c10::BFloat16, c10::BFloat16>&, Workspace&, DeviceInfo, cudaStream_t);
void rms_norm_bwd_cuda(const NormBwdArgs<c10::BFloat16, float>&, Workspace&, DeviceInfo, cudaStream_t);

}  // namespace fusednorm::cuda
