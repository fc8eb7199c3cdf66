#pragma once
// The interface between the ATen side of the CUDA LayerNorm (layer_norm.cu: checks, outputs,
// streams, registration) and its kernels, which are compiled per input dtype in
// layer_norm_{fwd,bwd}_<dtype>.cu so that the build spreads over several compiler jobs.
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

// LayerNorm forward over the rows of a row-major [M, N] x. weight/bias may be null.
// mean and rstd ([M]) are written for the backward.
template <typename T, typename P>
struct LayerNormFwdArgs {
  const T* x;
  const P* weight;
  const P* bias;
  T* y;
  acc_type_t<T>* mean;
  acc_type_t<T>* rstd;
  int64_t M;
  int64_t N;
  double eps;
};

// LayerNorm backward: dx always; dweight when dweight != nullptr (needs weight), dbias when
// dbias != nullptr. weight may be null (then dy is not scaled).
template <typename T, typename P>
struct LayerNormBwdArgs {
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
};

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

}  // namespace fusednorm::cuda
