// Forward LayerNorm for float32 inputs: instantiates
// layer_norm_kernels.cuh (one file per pass and dtype, so the build runs in parallel).

#include "cuda/layer_norm_kernels.cuh"

namespace fusednorm::cuda {

void layer_norm_fwd_cuda(const LayerNormFwdArgs<float, float>& args, Workspace& ws,
                         DeviceInfo dev, cudaStream_t stream) {
  layer_norm_fwd_impl(args, ws, dev, stream);
}

}  // namespace fusednorm::cuda
