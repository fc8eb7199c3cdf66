// The norm family's forward and backward on CUDA (norm_fwd / norm_bwd: LayerNorm or
// RMSNorm, optional residual): argument checks (the CPU entries' own), outputs and workspace
// from PyTorch's caching allocator, the input's device and current stream; the kernels are
// in norm_kernels.cuh, compiled per kind, pass and dtype (norm_instances.cuh). Host code
// only, compiled by the C++ compiler (no ATen headers pass through nvcc).

#include <ATen/core/Generator.h>
#include <ATen/cuda/CUDAGeneratorImpl.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <torch/library.h>

#include <atomic>
#include <mutex>
#include <tuple>
#include <type_traits>

#include "common/checks.h"
#include "common/philox.h"
#include "op_table.h"
#include "common/dispatch.h"
#include "cuda/norm_launch.h"
#include "cuda/norm_workspace.h"

namespace fusednorm::cuda {
namespace {

bool present(const std::optional<at::Tensor>& t) { return t.has_value() && t->defined(); }

template <typename P>
const P* data_or_null(const std::optional<at::Tensor>& t) {
  return present(t) ? t->const_data_ptr<P>() : nullptr;
}

// An output that may be empty ([0]: the sum without a residual, RMSNorm's mean).
template <typename T>
T* out_or_null(const at::Tensor& t) {
  return t.numel() > 0 ? t.mutable_data_ptr<T>() : nullptr;
}

void check_on_cuda(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.is_cuda(), "fusednorm: ", name, " must be a CUDA tensor, got one on ",
              t.device());
}

// The multiprocessor count of t's device, queried once per device (so that a graph capture
// after a warm-up makes no CUDA API call at all besides the launches).
DeviceInfo device_info(const at::Tensor& t) {
  constexpr int kCachedDevices = 64;
  static std::atomic<int> sm_counts[kCachedDevices];
  const int index = t.device().index();
  const bool cacheable = index >= 0 && index < kCachedDevices;
  int sm_count = cacheable ? sm_counts[index].load(std::memory_order_relaxed) : 0;
  if (sm_count == 0) {
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount, index));
    if (cacheable) sm_counts[index].store(sm_count, std::memory_order_relaxed);
  }
  return {index, sm_count};
}

// The kernels' entry for an argument struct: LayerNorm's (centered) or RMSNorm's, with the
// multipliers (dropout / rowscale) when the arguments have them.
template <typename T, typename P, typename IO>
void launch(const NormFwdArgs<T, P, IO>& args, bool centered, Workspace& ws, DeviceInfo dev,
            cudaStream_t stream) {
  // (rng_state: dropout_p > 0, even one whose threshold rounds to 0: the state is written)
  const bool multiplied = args.rng_state != nullptr || args.rowscale != nullptr;
  if (multiplied) {
    if (centered) return norm_fwd_dropout_cuda<true>(args, ws, dev, stream);
    return norm_fwd_dropout_cuda<false>(args, ws, dev, stream);
  }
  if (centered) return norm_fwd_cuda<true>(args, ws, dev, stream);
  norm_fwd_cuda<false>(args, ws, dev, stream);
}

// The multipliers of a norm_fwd call (common/philox.h): with dropout_p > 0, an offset
// reserved on the device's default generator, whose state the kernels unpack (a captured
// CUDA graph then replays with the generator's new offsets) and write to rng_state.
struct Multipliers {
  at::PhiloxCudaState philox{};
  uint64_t threshold = 0;
  double keep_scale = 1.0;
  const void* rowscale = nullptr;
  int64_t* rng_state = nullptr;
};

Multipliers forward_multipliers(const at::Tensor& input, double dropout_p,
                                const std::optional<at::Tensor>& rowscale,
                                const std::optional<at::Tensor>& rng_state) {
  Multipliers m;
  m.keep_scale = philox::keep_scale(dropout_p);
  m.rowscale = present(rowscale) ? rowscale->const_data_ptr() : nullptr;
  if (dropout_p > 0.0) {
    at::Generator generator = at::cuda::detail::getDefaultCUDAGenerator(input.device().index());
    auto* impl = at::check_generator<at::CUDAGeneratorImpl>(generator);
    {
      std::lock_guard<std::mutex> lock(impl->mutex_);
      m.philox = impl->philox_cuda_state(4);  // one Philox counter block per call
    }
    m.threshold = philox::dropout_threshold(dropout_p);
    m.rng_state = rng_state->mutable_data_ptr<int64_t>();
  }
  return m;
}

// args with the multipliers m (rowscale of acc_t, the statistics' dtype).
template <typename T, typename P, typename IO>
NormFwdArgs<T, P, IO> with_multipliers(NormFwdArgs<T, P, IO> args, const Multipliers& m) {
  args.philox = m.philox;
  args.threshold = m.threshold;
  args.keep_scale = m.keep_scale;
  args.rowscale = static_cast<const acc_type_t<T>*>(m.rowscale);
  args.rng_state = m.rng_state;
  return args;
}

// The backward's entry: with the input's gradient (dx_input) in kernels of their own.
template <typename T, typename P, typename IO>
void launch(const NormBwdArgs<T, P, IO>& args, bool centered, Workspace& ws, DeviceInfo dev,
            cudaStream_t stream) {
  if (args.dx_input != nullptr) {
    if (centered) return norm_bwd_input_grad_cuda<true>(args, ws, dev, stream);
    return norm_bwd_input_grad_cuda<false>(args, ws, dev, stream);
  }
  if (centered) return norm_bwd_cuda<true>(args, ws, dev, stream);
  norm_bwd_cuda<false>(args, ws, dev, stream);
}

// args with the input gradient grad_x (when given: numel > 0) and the saved multipliers of
// its forward (rowscale of acc_t; rng_state read by the kernels on the device).
template <typename T, typename P, typename IO>
NormBwdArgs<T, P, IO> with_input_grad(NormBwdArgs<T, P, IO> args, const at::Tensor& grad_x,
                                      double dropout_p, const std::optional<at::Tensor>& rowscale,
                                      const std::optional<at::Tensor>& rng_state) {
  if (grad_x.numel() == 0) return args;
  args.dx_input = grad_x.mutable_data_ptr<IO>();
  args.rng_state = data_or_null<int64_t>(rng_state);
  args.threshold = dropout_p > 0.0 ? philox::dropout_threshold(dropout_p) : 0;
  args.keep_scale = philox::keep_scale(dropout_p);
  args.rowscale = data_or_null<acc_type_t<T>>(rowscale);
  return args;
}

// A float32 residual stream beside 16-bit inputs (sum_dtype; grad_out of a float32 sum): the
// kernels' float instantiations with the input's type for x, y and dy (NormFwdArgs' IO).
// They take float parameters: 16-bit ones are widened here (N values), and their gradients
// rounded once back; a residual of either dtype.
std::optional<at::Tensor> widened(const std::optional<at::Tensor>& t) {
  if (!present(t) || t->scalar_type() == at::kFloat) return t;
  return t->to(at::kFloat);
}

template <typename MakeArgs>
void launch_float_sum(const at::Tensor& io, bool centered, const MakeArgs& make_args) {
  TensorWorkspace workspace(io);
  const DeviceInfo dev = device_info(io);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  if (io.scalar_type() == at::kHalf) {
    launch(make_args(c10::Half{}), centered, workspace, dev, stream);
  } else {
    launch(make_args(c10::BFloat16{}), centered, workspace, dev, stream);
  }
}

// Launches the kernels on the argument struct make_args(T{}, P{}) makes for the C++ types
// of the input and of the parameters, on the input's device and current stream.
template <typename MakeArgs>
void launch_typed(const at::Tensor& input, const std::optional<at::Tensor>& weight,
                  const std::optional<at::Tensor>& bias, bool centered,
                  const MakeArgs& make_args) {
  TensorWorkspace workspace(input);
  const DeviceInfo dev = device_info(input);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  dispatch_dtype_pair(input.scalar_type(), param_dtype(weight, bias, input),
                           [&](auto input_tag, auto param_tag) {
                             launch(make_args(input_tag, param_tag), centered, workspace, dev,
                                    stream);
                           });
}

// norm_fwd: outputs as the CPU entry's (csrc/cpu/norm_fwd.cpp): sum is [0] without a residual,
// mean is [0] for RMSNorm (centered = false). With no rows nothing is drawn (as on the CPU).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> norm_fwd(
    const at::Tensor& input, const std::optional<at::Tensor>& residual,
    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias, double eps,
    bool centered, std::optional<at::ScalarType> sum_dtype, double dropout_p,
    const std::optional<at::Tensor>& rowscale, const std::optional<at::Tensor>& rng_state) {
  check_on_cuda(input, "input");
  check_norm_fwd_args(input, residual, weight, bias, eps, centered, sum_dtype, dropout_p, rowscale,
                      rng_state);
  const c10::cuda::OptionalCUDAGuard guard(input.device());
  const int64_t M = input.size(0), N = input.size(1);
  const at::ScalarType sum_type = sum_dtype.value_or(input.scalar_type());
  at::Tensor out = at::empty_like(input);
  at::Tensor sum = present(residual) ? at::empty_like(input, input.options().dtype(sum_type))
                                     : at::empty({0}, input.options());
  const auto stats_options = input.options().dtype(stats_dtype(input.scalar_type()));
  at::Tensor mean = at::empty({centered ? M : 0}, stats_options);
  at::Tensor rstd = at::empty({M}, stats_options);
  if (M == 0) return {out, sum, mean, rstd};
  const Multipliers mult = forward_multipliers(input, dropout_p, rowscale, rng_state);

  if (sum_type != input.scalar_type()) {
    const auto w = widened(weight), b = widened(bias);
    const bool wide_residual = residual->scalar_type() == at::kFloat;
    launch_float_sum(input, centered, [&](auto io_tag) {
      using IO = decltype(io_tag);
      return with_multipliers(
          NormFwdArgs<float, float, IO>{
              input.const_data_ptr<IO>(), data_or_null<float>(w), data_or_null<float>(b),
              out.mutable_data_ptr<IO>(), out_or_null<float>(mean),
              rstd.mutable_data_ptr<float>(), M, N, eps,
              wide_residual ? residual->const_data_ptr<float>() : nullptr,
              sum.mutable_data_ptr<float>(),
              wide_residual ? nullptr : residual->const_data_ptr<IO>()},
          mult);
    });
    return {out, sum, mean, rstd};
  }

  launch_typed(input, weight, bias, centered, [&](auto input_tag, auto param_tag) {
    using T = decltype(input_tag);
    using P = decltype(param_tag);
    using acc_t = acc_type_t<T>;
    return with_multipliers(
        NormFwdArgs<T, P>{input.const_data_ptr<T>(), data_or_null<P>(weight),
                          data_or_null<P>(bias), out.mutable_data_ptr<T>(),
                          out_or_null<acc_t>(mean), rstd.mutable_data_ptr<acc_t>(), M, N, eps,
                          data_or_null<T>(residual), out_or_null<T>(sum)},
        mult);
  });
  return {out, sum, mean, rstd};
}

// norm_bwd: input is what was normalized (the sum, with a residual); grad_sum is added to
// grad_input. For RMSNorm mean is [0] and unused, and there is no bias.
// grad_x (x_dtype given): the input's gradient, written by the same kernels (with_input_grad).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> norm_bwd(
    const at::Tensor& grad_out, const std::optional<at::Tensor>& grad_sum,
    const at::Tensor& input, const at::Tensor& mean, const at::Tensor& rstd,
    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
    bool centered, std::optional<at::ScalarType> x_dtype, double dropout_p,
    const std::optional<at::Tensor>& rowscale, const std::optional<at::Tensor>& rng_state,
    std::array<bool, 2> wanted) {
  check_on_cuda(input, "input");
  check_norm_bwd_args(grad_out, grad_sum, input, mean, rstd, weight, bias, centered);
  check_norm_bwd_input_grad(grad_out, input, x_dtype, dropout_p, rowscale, rng_state);
  const c10::cuda::OptionalCUDAGuard guard(input.device());
  const int64_t M = input.size(0), N = input.size(1);
  // A frozen parameter's gradient is not wanted: its kernels' pointer is null (no partials).
  const bool weight_grad = present(weight) && wanted[0], bias_grad = present(bias) && wanted[1];
  at::Tensor grad_input = at::empty_like(input);
  at::Tensor grad_weight =
      weight_grad ? at::empty({N}, weight->options()) : at::empty({0}, input.options());
  at::Tensor grad_bias =
      bias_grad ? at::empty({N}, bias->options()) : at::empty({0}, input.options());
  // x_dtype is grad_out's (check_norm_bwd_input_grad).
  at::Tensor grad_x = x_dtype ? at::empty_like(grad_out) : at::empty({0}, input.options());
  if (M == 0) {
    // No rows: the parameter gradients are empty sums.
    grad_weight.zero_();
    grad_bias.zero_();
    return {grad_input, grad_weight, grad_bias, grad_x};
  }
  if (N == 0) return {grad_input, grad_weight, grad_bias, grad_x};

  if (grad_out.scalar_type() != input.scalar_type()) {  // a float sum, 16-bit dy
    const auto w = widened(weight);
    at::Tensor gw = weight_grad ? at::empty({N}, input.options()) : grad_weight;
    at::Tensor gb = bias_grad ? at::empty({N}, input.options()) : grad_bias;
    launch_float_sum(grad_out, centered, [&](auto io_tag) {
      using IO = decltype(io_tag);
      return with_input_grad(
          NormBwdArgs<float, float, IO>{
              grad_out.const_data_ptr<IO>(),
              input.const_data_ptr<float>(),
              centered ? mean.const_data_ptr<float>() : nullptr,
              rstd.const_data_ptr<float>(),
              data_or_null<float>(w),
              grad_input.mutable_data_ptr<float>(),
              weight_grad ? gw.mutable_data_ptr<float>() : nullptr,
              bias_grad ? gb.mutable_data_ptr<float>() : nullptr,
              M,
              N,
              data_or_null<float>(grad_sum)},
          grad_x, dropout_p, rowscale, rng_state);
    });
    if (weight_grad) grad_weight.copy_(gw);  // one rounding, to the weight's dtype
    if (bias_grad) grad_bias.copy_(gb);
    return {grad_input, grad_weight, grad_bias, grad_x};
  }

  launch_typed(input, weight, bias, centered, [&](auto input_tag, auto param_tag) {
    using T = decltype(input_tag);
    using P = decltype(param_tag);
    return with_input_grad(
        NormBwdArgs<T, P>{
            grad_out.const_data_ptr<T>(),
            input.const_data_ptr<T>(),
            centered ? mean.const_data_ptr<acc_type_t<T>>() : nullptr,
            rstd.const_data_ptr<acc_type_t<T>>(),
            data_or_null<P>(weight),
            grad_input.mutable_data_ptr<T>(),
            weight_grad ? grad_weight.mutable_data_ptr<P>() : nullptr,
            bias_grad ? grad_bias.mutable_data_ptr<P>() : nullptr,
            M,
            N,
            data_or_null<T>(grad_sum)},
        grad_x, dropout_p, rowscale, rng_state);
  });
  return {grad_input, grad_weight, grad_bias, grad_x};
}

}  // namespace
}  // namespace fusednorm::cuda

// The signatures op_table.h gives (the dispatcher checks them again when fusednorm._C loads).
static_assert(std::is_same_v<decltype(fusednorm::cuda::norm_fwd), fusednorm::op_table::norm_fwd>);
static_assert(std::is_same_v<decltype(fusednorm::cuda::norm_bwd), fusednorm::op_table::norm_bwd>);

TORCH_LIBRARY_IMPL(fusednorm, CUDA, m) {
  m.impl("norm_fwd", &fusednorm::cuda::norm_fwd);
  m.impl("norm_bwd", &fusednorm::cuda::norm_bwd);
}
