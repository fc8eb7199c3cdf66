#pragma once
// The norm kernels' Workspace (norm_launch.h) served by PyTorch: the op's entries
// (norm.cpp) hand it to the kernels (benchmarks/cuda_ab's entries have their own, the
// caller's buffers). Host code with ATen: never included by a .cu file.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <cstdint>
#include <vector>

#include "cuda/norm_launch.h"

namespace fusednorm::cuda {

// Byte buffers from the caching allocator, held until the op returns: the kernels that use
// them are already enqueued on the current stream, which is what the allocator's reuse
// follows (and what CUDA-graph capture records).
class TensorWorkspace final : public Workspace {
 public:
  explicit TensorWorkspace(const at::Tensor& like) : options_(like.options().dtype(at::kByte)) {}

  void* allocate(int64_t bytes) override {
    buffers_.push_back(at::empty({bytes}, options_));
    return buffers_.back().mutable_data_ptr();
  }

 private:
  at::TensorOptions options_;
  std::vector<at::Tensor> buffers_;
};

}  // namespace fusednorm::cuda
