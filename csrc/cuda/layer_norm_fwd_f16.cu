// Forward LayerNorm for float16 inputs, with float32 or float16 parameters: instantiates
// layer_norm_kernels.cuh (one file per pass and dtype, so the build runs in parallel).

#include "cuda/layer_norm_kernels.cuh"

namespace fusednorm::cuda {

void layer_norm_fwd_cuda(const LayerNormFwdArgs<c10::Half, c10::Half>& args, Workspace& ws,
                         DeviceInfo dev, cudaStream_t stream) {
  layer_norm_fwd_impl(args, ws, dev, stream);
}

void layer_norm_fwd_cuda(const LayerNormFwdArgs<c10::Half, float>& args, Workspace& ws,
                         DeviceInfo dev, cudaStream_t stream) {
  layer_norm_fwd_impl(args, ws, dev, stream);
}

}  // namespace fusednorm::cuda
