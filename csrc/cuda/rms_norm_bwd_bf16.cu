// Backward RMSNorm for bfloat16 inputs, with float32 or bfloat16 parameters: instantiates
// layer_norm_kernels.cuh with CENTERED = false (a file of its own, so the build runs in
// parallel and LayerNorm's files compile no more than before).

#include "cuda/layer_norm_kernels.cuh"

namespace fusednorm::cuda {

void rms_norm_bwd_cuda(const NormBwdArgs<c10::BFloat16, c10::BFloat16>& args, Workspace& ws, DeviceInfo dev,
                      cudaStream_t stream) {
  rms_norm_bwd_impl(args, ws, dev, stream);
}

void rms_norm_bwd_cuda(const NormBwdArgs<c10::BFloat16, float>& args, Workspace& ws, DeviceInfo dev,
                      cudaStream_t stream) {
  rms_norm_bwd_impl(args, ws, dev, stream);
}

}  // namespace fusednorm::cuda
