// The LayerNorm output from saved statistics, y = ((x - mean) - rest) * rstd * weight + bias
// (as fma(x - mean, rstd, -rest * rstd), then fma(., weight, bias), like the forward),
// on CUDA: one elementwise pass over a contiguous [M, N] input with 16-byte accesses where N
// and the pointers allow, in float (double for double). rest is what the saved float mean
// lost, mean(x - mean), found again by a pass over the rows far from zero only
// (needs_mean_correction; 0 elsewhere), so that the LayerNorm + FFN block's backward
// recomputes the forward's normalized values (which keep that rest), not ones up to
// 2^-24 * |mean| * rstd away.

#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "common/checks.h"
#include "common/dispatch.h"
#include "common/welford.h"
#include "cuda/device_utils.cuh"

namespace fusednorm::cuda {
namespace {

constexpr int kThreads = 256;

// rest[row] = mean(x - mean) over the row where needs_mean_correction, else 0 (without
// reading the row). A warp per row; x is read an element per lane, in order within a lane,
// then a fixed tree over the lanes.
template <typename T, typename acc_t>
__global__ void __launch_bounds__(kThreads)
    layer_norm_mean_rest_kernel(const T* __restrict__ x, const acc_t* __restrict__ mean,
                                const acc_t* __restrict__ rstd, acc_t* __restrict__ rest,
                                int64_t M, int64_t N) {
  constexpr int kRowsPerBlock = kThreads / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;
  for (int64_t row = int64_t(blockIdx.x) * kRowsPerBlock + threadIdx.x / kWarpSize; row < M;
       row += int64_t(gridDim.x) * kRowsPerBlock) {
    const acc_t m = mean[row];
    if (!needs_mean_correction<true>(m, rstd[row])) {  // the same in every lane
      if (lane == 0) rest[row] = acc_t(0);
      continue;
    }
    acc_t sum = 0;
    for (int64_t j = lane; j < N; j += kWarpSize) sum += to_acc(x[row * N + j]) - m;
    sum = warp_sum(sum);
    if (lane == 0) rest[row] = sum / acc_t(N);
  }
}

// x and y are read and written kVec elements at a time (packs_per_row = N / kVec); the
// parameters, a few KB read by every row, come one element at a time from cache.
template <typename T, typename P, typename acc_t, int kVec, bool kWeight, bool kBias>
__global__ void __launch_bounds__(kThreads)
    layer_norm_apply_kernel(const T* __restrict__ x, const acc_t* __restrict__ mean,
                            const acc_t* __restrict__ rest, const acc_t* __restrict__ rstd,
                            const P* __restrict__ weight, const P* __restrict__ bias,
                            T* __restrict__ y, int64_t packs, int64_t packs_per_row) {
  using PackT = Pack<T, kVec>;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < packs;
       i += stride) {
    const int64_t row = i / packs_per_row;
    const int64_t col = (i - row * packs_per_row) * kVec;
    const acc_t row_mean = mean[row], row_rstd = rstd[row];
    const acc_t neg_rest_scaled = -rest[row] * row_rstd;
    const PackT xv = *reinterpret_cast<const PackT*>(x + i * kVec);
    PackT yv;
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      // As the forward computes it (norm_kernels.cuh), bit for bit: the explicit
      // fmas leave the compiler no choice of contraction.
      acc_t v = fma_acc(static_cast<acc_t>(xv.v[j]) - row_mean, row_rstd, neg_rest_scaled);
      if constexpr (kWeight && kBias) {
        v = fma_acc(v, static_cast<acc_t>(weight[col + j]), static_cast<acc_t>(bias[col + j]));
      } else if constexpr (kWeight) {
        v *= static_cast<acc_t>(weight[col + j]);
      } else if constexpr (kBias) {
        v += static_cast<acc_t>(bias[col + j]);
      }
      yv.v[j] = static_cast<T>(v);
    }
    *reinterpret_cast<PackT*>(y + i * kVec) = yv;
  }
}

bool given(const std::optional<at::Tensor>& t) { return t.has_value() && t->defined(); }

template <typename P>
const P* data_or_null(const std::optional<at::Tensor>& t) {
  return given(t) ? t->const_data_ptr<P>() : nullptr;
}

template <typename T, typename P, bool kWeight, bool kBias>
void launch_layer_norm_apply(const at::Tensor& input, const at::Tensor& mean,
                             const at::Tensor& rstd, const P* weight, const P* bias,
                             at::Tensor& out) {
  using acc_t = std::conditional_t<std::is_same_v<T, double>, double, float>;
  constexpr int kWide = 16 / sizeof(T);
  const int64_t M = input.size(0), N = input.size(1);
  const T* x = input.const_data_ptr<T>();
  T* y = out.mutable_data_ptr<T>();
  const bool wide = N % kWide == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0 &&
                    reinterpret_cast<uintptr_t>(y) % 16 == 0;
  const int vec = wide ? kWide : 1;
  const int64_t packs = M * (N / vec);
  const int64_t max_blocks =
      static_cast<int64_t>(at::cuda::getCurrentDeviceProperties()->multiProcessorCount) * 16;
  const auto blocks = static_cast<unsigned>(
      std::max<int64_t>(1, std::min<int64_t>((packs + kThreads - 1) / kThreads, max_blocks)));
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const acc_t* mean_data = mean.const_data_ptr<acc_t>();
  const acc_t* rstd_data = rstd.const_data_ptr<acc_t>();
  at::Tensor rest = at::empty({M}, mean.options());
  acc_t* rest_data = rest.mutable_data_ptr<acc_t>();
  constexpr int kRowsPerBlock = kThreads / kWarpSize;
  const auto rest_blocks = static_cast<unsigned>(
      std::max<int64_t>(1, std::min<int64_t>((M + kRowsPerBlock - 1) / kRowsPerBlock, max_blocks)));
  layer_norm_mean_rest_kernel<T, acc_t><<<rest_blocks, kThreads, 0, stream>>>(
      x, mean_data, rstd_data, rest_data, M, N);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (wide) {
    layer_norm_apply_kernel<T, P, acc_t, kWide, kWeight, kBias><<<blocks, kThreads, 0, stream>>>(
        x, mean_data, rest_data, rstd_data, weight, bias, y, packs, N / kWide);
  } else {
    layer_norm_apply_kernel<T, P, acc_t, 1, kWeight, kBias><<<blocks, kThreads, 0, stream>>>(
        x, mean_data, rest_data, rstd_data, weight, bias, y, packs, N);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

at::Tensor layer_norm_apply(const at::Tensor& input, const at::Tensor& mean,
                            const at::Tensor& rstd, const std::optional<at::Tensor>& weight,
                            const std::optional<at::Tensor>& bias) {
  check_rows(input, "input");
  check_stats(mean, "mean", input);
  check_stats(rstd, "rstd", input);
  check_params(weight, bias, input);
  const c10::cuda::OptionalCUDAGuard device_guard(input.device());
  at::Tensor out = at::empty_like(input);
  if (out.numel() == 0) return out;
  dispatch_dtype_pair(
      input.scalar_type(), param_dtype(weight, bias, input),
      [&](auto input_tag, auto param_tag) {
        using T = decltype(input_tag);
        using P = decltype(param_tag);
        dispatch_bools(given(weight), given(bias), [&](auto has_w, auto has_b) {
          launch_layer_norm_apply<T, P, decltype(has_w)::value, decltype(has_b)::value>(
              input, mean, rstd, data_or_null<P>(weight), data_or_null<P>(bias), out);
        });
      });
  return out;
}

}  // namespace
}  // namespace fusednorm::cuda

TORCH_LIBRARY_IMPL(fusednorm, CUDA, m) {
  m.impl("layer_norm_apply", &fusednorm::cuda::layer_norm_apply);
}
