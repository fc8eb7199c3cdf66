// The instantiations of the CUDA norm family's entries (norm_launch.h) for one kind (LayerNorm
// or RMSNorm), one pass and one input dtype. setup.py writes one small .cu file per
// combination into build/ (NORM_INSTANCES there), each defining the three macros below and
// including this file, so that nvcc compiles them in parallel:
//   FUSEDNORM_NORM_CENTERED           true (LayerNorm) or false (RMSNorm)
//   FUSEDNORM_NORM_PASS               fwd, fwd_dropout (the forward with dropout / rowscale),
//                                     bwd or bwd_input_grad (the backward that also writes
//                                     the add ops' input gradient)
//   FUSEDNORM_NORM_ONLY_<tag>(...)    for every input tag of FUSEDNORM_CUDA_NORM_DTYPES:
//                                     its arguments for this file's tag, nothing for the others

#include "cuda/norm_kernels.cuh"

#define FUSEDNORM_NORM_ENTRY_(pass) norm_##pass##_cuda
#define FUSEDNORM_NORM_ENTRY(pass) FUSEDNORM_NORM_ENTRY_(pass)
#define FUSEDNORM_NORM_ARGS_fwd NormFwdArgs
#define FUSEDNORM_NORM_ARGS_fwd_dropout NormFwdArgs
#define FUSEDNORM_NORM_ARGS_bwd NormBwdArgs
#define FUSEDNORM_NORM_ARGS_bwd_input_grad NormBwdArgs
#define FUSEDNORM_NORM_ARGS_(pass) FUSEDNORM_NORM_ARGS_##pass
#define FUSEDNORM_NORM_ARGS(pass) FUSEDNORM_NORM_ARGS_(pass)

#define FUSEDNORM_NORM_INSTANTIATE(tag, T, P, IO)                                         \
  FUSEDNORM_NORM_ONLY_##tag(template void FUSEDNORM_NORM_ENTRY(FUSEDNORM_NORM_PASS)<      \
                            FUSEDNORM_NORM_CENTERED, T, P, IO>(                           \
      const FUSEDNORM_NORM_ARGS(FUSEDNORM_NORM_PASS)<T, P, IO>&, Workspace&, DeviceInfo,  \
      cudaStream_t);)

namespace fusednorm::cuda {

FUSEDNORM_CUDA_NORM_DTYPES(FUSEDNORM_NORM_INSTANTIATE)

}  // namespace fusednorm::cuda
