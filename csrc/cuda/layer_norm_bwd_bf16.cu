// Backward LayerNorm for bfloat16 inputs, with float32 or bfloat16 parameters: instantiates
// layer_norm_kernels.cuh (one file per pass and dtype, so the build runs in parallel).

#include "cuda/layer_norm_kernels.cuh"

namespace fusednorm::cuda {

void layer_norm_bwd_cuda(const LayerNormBwdArgs<c10::BFloat16, c10::BFloat16>& args, Workspace& ws,
                         DeviceInfo dev, cudaStream_t stream) {
  layer_norm_bwd_impl(args, ws, dev, stream);
}

void layer_norm_bwd_cuda(const LayerNormBwdArgs<c10::BFloat16, float>& args, Workspace& ws,
                         DeviceInfo dev, cudaStream_t stream) {
  layer_norm_bwd_impl(args, ws, dev, stream);
}

}  // namespace fusednorm::cuda
