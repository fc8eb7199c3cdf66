#pragma once
// dropout_scale's kernel and launcher (the op is dropout_scale.cu): out = grad * m rounded
// once from acc_t to O, m the multipliers of common/philox.h regenerated from the forward's
// (seed, offset), which the kernel reads from rng_state on the device (no host sync: a CUDA
// graph replays it with the state its forward wrote). No ATen here, so that tests/emulation
// compiles it too.

#include <c10/cuda/CUDAException.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "common/philox.h"
#include "cuda/device_utils.cuh"

namespace fusednorm::cuda {

constexpr int kDropoutScaleThreads = 256;

// grad and out: contiguous [M, N] of G and O (G: O's, or float beside 16-bit O); acc_t:
// float (double for double). threshold: philox::dropout_threshold(p), 0 keeping every
// element without reading rng_state (which may then be null); keep_scale:
// philox::keep_scale(p); rowscale: [M] or null.
template <typename G, typename O, typename acc_t>
struct DropoutScaleArgs {
  const G* grad;
  O* out;
  int64_t M, N;
  const int64_t* rng_state;
  uint64_t threshold;
  acc_t keep_scale;
  const acc_t* rowscale;
};

namespace dropout_scale_detail {

template <typename acc_t>
__device__ __forceinline__ acc_t factor(const acc_t* rowscale, acc_t keep_scale, int64_t row) {
  return rowscale != nullptr ? mul_rn(keep_scale, rowscale[row]) : keep_scale;
}

// A thread per quad of flat indices 4q .. 4q + 3 (one block of draws), over the grid. PACKS:
// grad and out aligned for 4-element packs, which every whole quad then moves at once.
template <typename G, typename O, typename acc_t, bool PACKS>
__global__ void __launch_bounds__(kDropoutScaleThreads)
    dropout_scale_kernel(const DropoutScaleArgs<G, O, acc_t> a) {
  uint64_t seed = 0, offset = 0;
  if (a.threshold != 0) {
    seed = static_cast<uint64_t>(a.rng_state[0]);
    offset = static_cast<uint64_t>(a.rng_state[1]);
  }
  const int64_t total = a.M * a.N;
  const int64_t quads = ceil_div(total, 4);
  for (int64_t q = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; q < quads;
       q += int64_t(gridDim.x) * blockDim.x) {
    philox::Block b{};  // threshold 0: every draw (0) is kept
    if (a.threshold != 0) b = philox::draws(seed, offset, static_cast<uint64_t>(q));
    const int64_t first = 4 * q;
    int64_t row = first / a.N, col = first - row * a.N;
    acc_t f = factor(a.rowscale, a.keep_scale, row);
    acc_t m[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      if (col == a.N) {  // the quad runs into the next row (at most once per element)
        ++row;
        col = 0;
        if (first + k < total) f = factor(a.rowscale, a.keep_scale, row);
      }
      m[k] = philox::keeps(b.v[k], a.threshold) ? f : acc_t(0);
      ++col;
    }
    if (PACKS && first + 4 <= total) {
      const Pack<G, 4> g = load_pack<4>(a.grad + first);
      Pack<O, 4> o;
#pragma unroll
      for (int k = 0; k < 4; ++k) o.v[k] = static_cast<O>(mul_rn(pack_acc(g, k), m[k]));
      store_pack<4>(a.out + first, o);
    } else {
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        if (first + k < total) {
          a.out[first + k] = static_cast<O>(mul_rn(to_acc(a.grad[first + k]), m[k]));
        }
      }
    }
  }
}

}  // namespace dropout_scale_detail

// Enqueues dropout_scale on `stream` (M * N > 0), a grid of at most 8 blocks per
// multiprocessor.
template <typename G, typename O, typename acc_t>
void dropout_scale_cuda(const DropoutScaleArgs<G, O, acc_t>& a, int sm_count,
                        cudaStream_t stream) {
  using namespace dropout_scale_detail;
  const int64_t quads = ceil_div(a.M * a.N, 4);
  const auto blocks = static_cast<unsigned>(std::clamp<int64_t>(
      ceil_div(quads, kDropoutScaleThreads), 1, int64_t(std::max(sm_count, 1)) * 8));
  const bool packs = reinterpret_cast<std::uintptr_t>(a.grad) % alignof(Pack<G, 4>) == 0 &&
                     reinterpret_cast<std::uintptr_t>(a.out) % alignof(Pack<O, 4>) == 0;
  if (packs) {
    launch_kernel(dropout_scale_kernel<G, O, acc_t, true>, blocks, kDropoutScaleThreads, stream, a);
  } else {
    launch_kernel(dropout_scale_kernel<G, O, acc_t, false>, blocks, kDropoutScaleThreads, stream,
                  a);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace fusednorm::cuda
