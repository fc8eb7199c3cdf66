// CPU entry of the norm family's backward op (schema in csrc/op_table.h): norm_bwd
// (LayerNorm or RMSNorm, with grad_sum, the parameter gradients and the add ops' input
// gradient): checks and outputs here, the rows in norm_bwd_rows_<dy dtype>.cpp.

#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <array>
#include <optional>
#include <type_traits>

#include "cpu/norm_entry.h"

namespace fusednorm::cpu {
namespace {

using namespace entry;

Tensor4 norm_bwd(const at::Tensor& grad_out, const OptTensor& grad_sum, const at::Tensor& input,
                 const at::Tensor& mean, const at::Tensor& rstd, const OptTensor& weight,
                 const OptTensor& bias, bool centered, std::optional<at::ScalarType> x_dtype,
                 double dropout_p, const OptTensor& rowscale, const OptTensor& rng_state,
                 std::array<bool, 2> wanted) {
  check_norm_bwd_args(grad_out, grad_sum, input, mean, rstd, weight, bias, centered);
  check_norm_bwd_input_grad(grad_out, input, x_dtype, dropout_p, rowscale, rng_state);
  const int64_t M = input.size(0), N = input.size(1);
  // A frozen parameter's gradient is not wanted: no column sums (partials) for it.
  const bool weight_grad = given(weight) && wanted[0], bias_grad = given(bias) && wanted[1];
  const bool param_grads = weight_grad || bias_grad;
  const int64_t blocks = param_grads && M > 0 ? num_row_blocks(M, N) : 0;
  ScratchHandle own_partials;
  at::Tensor grad_input, grad_weight, grad_bias, grad_x;
  // T: the input's (and dx's) type; D: dy's, the norm output's (T's, or 16-bit beside a
  // float32 sum); the parameters follow D.
  const bool wide_input = input.scalar_type() != grad_out.scalar_type();
  dispatch_dtype_pair(
      grad_out.scalar_type(), param_dtype(weight, bias, grad_out), [&](auto dy_tag, auto param_tag) {
       dispatch_bool(wide_input, [&](auto wide) {
        using D = decltype(dy_tag);
        using T = std::conditional_t<decltype(wide)::value, float, D>;
        using P = decltype(param_tag);
        using acc_t = acc_type<T>;
        if constexpr (decltype(wide)::value && !kIsReducedFloat<D>) {
          return;  // refused by check_norm_bwd_args
        } else {
        // Scratch before the outputs (see thread_scratch).
        const int64_t part_count = blocks * N;
        acc_t* scratch = thread_scratch<acc_t>((centered ? 2 : 1) * part_count, own_partials);
        const ParamsInAcc<acc_t> params = params_in_acc_type<D, acc_t>(weight, std::nullopt, N);
        grad_input = at::empty_like(input);
        acc_t* partial_w = scratch;
        acc_t* partial_b = centered ? scratch + part_count : nullptr;
        grad_weight =
            weight_grad ? at::empty({N}, weight->options()) : at::empty({0}, input.options());
        grad_bias = bias_grad ? at::empty({N}, bias->options()) : at::empty({0}, input.options());
        // x_dtype is D (check_norm_bwd_input_grad).
        grad_x = x_dtype ? at::empty_like(grad_out) : at::empty({0}, input.options());
        if (M > 0) {
          NormBwdArgs<T, acc_t, D> args{
              grad_out.const_data_ptr<D>(), data_or_null<T>(grad_sum),
              input.const_data_ptr<T>(),    centered ? mean.const_data_ptr<acc_t>() : nullptr,
              rstd.const_data_ptr<acc_t>(), params.weight,
              grad_input.mutable_data_ptr<T>(), M, N,
              params_finite<T, acc_t>(params.weight, nullptr, N)};
          if (x_dtype) {
            args.dx_input = grad_x.mutable_data_ptr<D>();
            args.multipliers = saved_multipliers<acc_t>(dropout_p, rowscale, rng_state, N);
          }
          norm_bwd_rows_for<T, D>(args, centered, given(weight), param_grads,
                                  x_dtype.has_value(), partial_w, partial_b, blocks);
        }
        // With no rows, the partials are an empty sum: the gradients are zeros.
        if (weight_grad) {
          sum_partials<acc_t, P>(partial_w, blocks, N,
                                 grad_weight.mutable_data_ptr<P>());
        }
        if (bias_grad) {
          sum_partials<acc_t, P>(partial_b, blocks, N,
                                 grad_bias.mutable_data_ptr<P>());
        }
        }
       });
      });
  return {grad_input, grad_weight, grad_bias, grad_x};
}

}  // namespace
}  // namespace fusednorm::cpu

TORCH_LIBRARY_IMPL(fusednorm, CPU, m) {
  m.impl("norm_bwd", &fusednorm::cpu::norm_bwd);
}
