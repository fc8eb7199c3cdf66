// dropout_scale on CUDA (op_table.h): grad * m rounded once to dtype, m the multipliers of
// the norm_fwd call whose rng_state, dropout_p and rowscale are given (the kernel,
// dropout_scale.cuh, reads (seed, offset) from rng_state on the device).

#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/empty_like.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <type_traits>

#include "common/checks.h"
#include "common/philox.h"
#include "cuda/dropout_scale.cuh"
#include "op_table.h"

namespace fusednorm::cuda {
namespace {

template <typename G, typename O>
void launch_dropout_scale(const at::Tensor& grad, const std::optional<at::Tensor>& rowscale,
                          const at::Tensor& rng_state, double dropout_p, at::Tensor& out) {
  using acc_t = std::conditional_t<std::is_same_v<O, double>, double, float>;
  const bool draws = dropout_p > 0.0;
  const DropoutScaleArgs<G, O, acc_t> args{
      grad.const_data_ptr<G>(),
      out.mutable_data_ptr<O>(),
      grad.size(0),
      grad.size(1),
      draws ? rng_state.const_data_ptr<int64_t>() : nullptr,
      draws ? philox::dropout_threshold(dropout_p) : 0,
      static_cast<acc_t>(philox::keep_scale(dropout_p)),
      given(rowscale) ? rowscale->const_data_ptr<acc_t>() : nullptr};
  dropout_scale_cuda(args, at::cuda::getCurrentDeviceProperties()->multiProcessorCount,
                     at::cuda::getCurrentCUDAStream());
}

at::Tensor dropout_scale(const at::Tensor& grad, const std::optional<at::Tensor>& rowscale,
                         const at::Tensor& rng_state, double dropout_p, at::ScalarType dtype) {
  TORCH_CHECK(grad.is_cuda(), "fusednorm: grad must be a CUDA tensor, got one on ",
              grad.device());
  check_dropout_scale_args(grad, rowscale, rng_state, dropout_p, dtype);
  const c10::cuda::OptionalCUDAGuard device_guard(grad.device());
  at::Tensor out = at::empty_like(grad, grad.options().dtype(dtype));
  if (out.numel() == 0) return out;
  const bool float_grad = grad.scalar_type() == at::kFloat;
  switch (dtype) {
    case at::kFloat:
      launch_dropout_scale<float, float>(grad, rowscale, rng_state, dropout_p, out);
      break;
    case at::kDouble:
      launch_dropout_scale<double, double>(grad, rowscale, rng_state, dropout_p, out);
      break;
    case at::kHalf:
      if (float_grad) {
        launch_dropout_scale<float, c10::Half>(grad, rowscale, rng_state, dropout_p, out);
      } else {
        launch_dropout_scale<c10::Half, c10::Half>(grad, rowscale, rng_state, dropout_p, out);
      }
      break;
    case at::kBFloat16:
      if (float_grad) {
        launch_dropout_scale<float, c10::BFloat16>(grad, rowscale, rng_state, dropout_p, out);
      } else {
        launch_dropout_scale<c10::BFloat16, c10::BFloat16>(grad, rowscale, rng_state, dropout_p,
                                                           out);
      }
      break;
    default:
      TORCH_CHECK(false, "fusednorm: dropout_scale: unsupported dtype ", dtype);
  }
  return out;
}

}  // namespace
}  // namespace fusednorm::cuda

// The signature op_table.h gives (the dispatcher checks it again when fusednorm._C loads).
static_assert(std::is_same_v<decltype(fusednorm::cuda::dropout_scale),
                             fusednorm::op_table::dropout_scale>);

TORCH_LIBRARY_IMPL(fusednorm, CUDA, m) {
  m.impl("dropout_scale", &fusednorm::cuda::dropout_scale);
}
