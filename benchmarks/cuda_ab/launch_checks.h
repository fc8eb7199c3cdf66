#pragma once
// Force-included (-include) first in every file of an A/B variant's library: c10's CUDA
// checks replaced by ones that throw a plain std::runtime_error, so that the library calls
// nothing of c10's (whose check function changed signature between torch versions) and
// loads beside any torch: built once here, carried to a GPU machine with another torch.
// The kernels' machine code is the same; only their host-side error path differs.
#include <c10/cuda/CUDAException.h>
#include <cuda_runtime_api.h>

#include <stdexcept>
#include <string>

#undef C10_CUDA_CHECK
#undef C10_CUDA_KERNEL_LAUNCH_CHECK

namespace fusednorm_ab_checks {
[[noreturn]] inline void fail(cudaError_t error, const char* file, int line) {
  throw std::runtime_error(std::string(file) + ":" + std::to_string(line) + ": " +
                           cudaGetErrorString(error));
}
}  // namespace fusednorm_ab_checks

#define C10_CUDA_CHECK(expr)                                                       \
  do {                                                                             \
    const cudaError_t fusednorm_ab_error_ = (expr);                                \
    if (fusednorm_ab_error_ != cudaSuccess) {                                      \
      ::fusednorm_ab_checks::fail(fusednorm_ab_error_, __FILE__, __LINE__);        \
    }                                                                              \
  } while (0)
#define C10_CUDA_KERNEL_LAUNCH_CHECK() C10_CUDA_CHECK(cudaGetLastError())
