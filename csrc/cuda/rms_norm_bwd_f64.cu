// Backward RMSNorm for float64 inputs: instantiates
// layer_norm_kernels.cuh with CENTERED = false (a file of its own, so the build runs in
// parallel and LayerNorm's files compile no more than before).

#include "cuda/layer_norm_kernels.cuh"

namespace fusednorm::cuda {

void rms_norm_bwd_cuda(const NormBwdArgs<double, double>& args, Workspace& ws, DeviceInfo dev,
                      cudaStream_t stream) {
  rms_norm_bwd_impl(args, ws, dev, stream);
}

}  // namespace fusednorm::cuda
