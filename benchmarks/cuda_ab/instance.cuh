// One generated instance file of an A/B variant (benchmarks/cuda_ab/build.py writes them with
// the macros of csrc/cuda/norm_instances.cuh): the production instantiation, then the
// registration of its entries.
#include "cuda/norm_instances.cuh"
#include "registry.h"

#define FUSEDNORM_AB_REGISTER_(pass) register_##pass
#define FUSEDNORM_AB_REGISTER_PASS(pass) FUSEDNORM_AB_REGISTER_(pass)
#define FUSEDNORM_AB_REGISTER(tag, T, P, IO)                                           \
  FUSEDNORM_NORM_ONLY_##tag(ab::FUSEDNORM_AB_REGISTER_PASS(FUSEDNORM_NORM_PASS)<       \
                            FUSEDNORM_NORM_CENTERED, T, P, IO>();)

namespace fusednorm::cuda {
namespace {
const bool ab_registered = [] {
  FUSEDNORM_CUDA_NORM_DTYPES(FUSEDNORM_AB_REGISTER)
  return true;
}();
}  // namespace
}  // namespace fusednorm::cuda
