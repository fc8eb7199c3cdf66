#pragma once
// Argument checks of the backend ops, shared by every backend. The public ops check first
// with the user's argument names (public_checks.h); these guard direct torch.ops calls so
// that no kernel ever sees a tensor it would read out of bounds.

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

namespace fusednorm {

// Whether an optional tensor argument was given (Python's None arrives as nullopt or as an
// undefined tensor).
inline bool given(const std::optional<at::Tensor>& t) { return t.has_value() && t->defined(); }

inline bool is_reduced_float(at::ScalarType t) {
  return t == at::kHalf || t == at::kBFloat16;
}

// The one rule for the dtype of a parameter (weight, bias): the input's, or float32 beside a
// float16/bfloat16 input (mixed precision: parameters kept in float32). Every check of the
// public ops (public_checks.h) and of the backend ops asks it; dispatch.h instantiates
// exactly these pairs.
inline bool param_dtype_allowed(at::ScalarType input, at::ScalarType param) {
  return param == input || (param == at::kFloat && is_reduced_float(input));
}

inline void check_param(const std::optional<at::Tensor>& param, const char* name,
                        const at::Tensor& input, int64_t N) {
  if (!param.has_value() || !param->defined()) return;
  const at::Tensor& p = *param;
  TORCH_CHECK(p.dim() == 1 && p.size(0) == N, "fusednorm: ", name,
              " must be a 1-D tensor of ", N, " elements, got shape ", p.sizes());
  TORCH_CHECK(p.device() == input.device(), "fusednorm: ", name, " is on ", p.device(),
              " but input is on ", input.device());
  TORCH_CHECK(param_dtype_allowed(input.scalar_type(), p.scalar_type()), "fusednorm: ", name,
              " must have the input's dtype (", input.scalar_type(),
              ") or float32 for a float16/bfloat16 input, got ", p.scalar_type());
  TORCH_CHECK(p.is_contiguous(), "fusednorm: ", name, " must be contiguous");
}

// weight and bias of a [M, N] input; when both are given they share one dtype.
inline void check_params(const std::optional<at::Tensor>& weight,
                         const std::optional<at::Tensor>& bias, const at::Tensor& input) {
  check_param(weight, "weight", input, input.size(1));
  check_param(bias, "bias", input, input.size(1));
  if (weight.has_value() && weight->defined() && bias.has_value() && bias->defined()) {
    TORCH_CHECK(weight->scalar_type() == bias->scalar_type(),
                "fusednorm: weight and bias must have the same dtype, got ",
                weight->scalar_type(), " and ", bias->scalar_type());
  }
}

// The dtype the parameters are read in: weight's, else bias's, else the input's.
inline at::ScalarType param_dtype(const std::optional<at::Tensor>& weight,
                                  const std::optional<at::Tensor>& bias,
                                  const at::Tensor& input) {
  if (weight.has_value() && weight->defined()) return weight->scalar_type();
  if (bias.has_value() && bias->defined()) return bias->scalar_type();
  return input.scalar_type();
}

inline void check_floating_input(const at::Tensor& t, const char* name) {
  const auto st = t.scalar_type();
  TORCH_CHECK(st == at::kFloat || st == at::kDouble || is_reduced_float(st), "fusednorm: ",
              name, " must be float32, float64, float16 or bfloat16, got ", st);
}

// The [M, N] row-major layout every LayerNorm kernel reads.
inline void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 2, "fusednorm: ", name, " must be 2-D [M, N], got shape ", t.sizes());
  TORCH_CHECK(t.is_contiguous(), "fusednorm: ", name, " must be contiguous");
  check_floating_input(t, name);
}

// The one rule for the dtype of a residual stream's sum beside the input it is added to:
// the input's, or float32 beside a float16/bfloat16 input (residual_dtype=torch.float32).
inline bool sum_dtype_allowed(at::ScalarType input, at::ScalarType sum) {
  return sum == input || (sum == at::kFloat && is_reduced_float(input));
}

// Saved statistics: [M] of float32 (float64 for a float64 input).
inline at::ScalarType stats_dtype(at::ScalarType input) {
  return input == at::kDouble ? at::kDouble : at::kFloat;
}

inline void check_stats(const at::Tensor& stat, const char* name, const at::Tensor& input) {
  TORCH_CHECK(stat.dim() == 1 && stat.size(0) == input.size(0), "fusednorm: ", name,
              " must have shape [", input.size(0), "], got ", stat.sizes());
  TORCH_CHECK(stat.scalar_type() == stats_dtype(input.scalar_type()), "fusednorm: ", name,
              " must be ", stats_dtype(input.scalar_type()), ", got ", stat.scalar_type());
  TORCH_CHECK(stat.device() == input.device() && stat.is_contiguous(), "fusednorm: ", name,
              " must be contiguous and on ", input.device());
}


// A tensor that must match input exactly: shape, dtype (input's, or `dtype`), device,
// contiguous rows.
inline void check_like_input(const at::Tensor& t, const char* name, const at::Tensor& input,
                             std::optional<at::ScalarType> dtype = std::nullopt) {
  const at::ScalarType want = dtype.value_or(input.scalar_type());
  TORCH_CHECK(t.sizes() == input.sizes() && (t.scalar_type() == input.scalar_type() ||
                                             t.scalar_type() == want),
              "fusednorm: ", name, " must match input (", input.sizes(), ", ",
              input.scalar_type(), want != input.scalar_type() ? " or " : "",
              want != input.scalar_type() ? c10::toString(want) : "", "), got ", t.sizes(),
              ", ", t.scalar_type());
  TORCH_CHECK(t.device() == input.device(), "fusednorm: ", name, " is on ", t.device(),
              " but input is on ", input.device());
  TORCH_CHECK(t.is_contiguous(), "fusednorm: ", name, " must be contiguous");
}

// The multipliers of the add ops' dropout (dropout_p in [0, 1]) and rowscale ([M] of
// `stats`, the statistics' dtype of the forward's input); rng_state (int64 [2] on `device`)
// is given exactly when dropout_p > 0. Shared by norm_fwd and dropout_scale.
inline void check_dropout_args(int64_t M, at::Device device, at::ScalarType stats,
                               double dropout_p,
                               const std::optional<at::Tensor>& rowscale,
                               const std::optional<at::Tensor>& rng_state) {
  TORCH_CHECK(dropout_p >= 0.0 && dropout_p <= 1.0, "fusednorm: dropout_p must be in [0, 1], got ",
              dropout_p);
  if (given(rowscale)) {
    const at::Tensor& r = *rowscale;
    TORCH_CHECK(r.dim() == 1 && r.size(0) == M, "fusednorm: rowscale must have shape [", M,
                "], got ", r.sizes());
    TORCH_CHECK(r.scalar_type() == stats, "fusednorm: rowscale must be ", stats, ", got ",
                r.scalar_type());
    TORCH_CHECK(r.device() == device && r.is_contiguous(), "fusednorm: rowscale must be "
                "contiguous and on ", device);
  }
  TORCH_CHECK(given(rng_state) == (dropout_p > 0.0), "fusednorm: rng_state must be given exactly "
              "when dropout_p > 0");
  if (given(rng_state)) {
    const at::Tensor& s = *rng_state;
    TORCH_CHECK(s.dim() == 1 && s.size(0) == 2 && s.scalar_type() == at::kLong &&
                    s.device() == device && s.is_contiguous(),
                "fusednorm: rng_state must be a contiguous int64 tensor of shape [2] on ",
                device, ", got ", s.scalar_type(), " ", s.sizes(), " on ", s.device());
  }
}

// norm_fwd's dropout arguments: only with a residual (the dropout is of the added input).
inline void check_norm_fwd_dropout(const at::Tensor& input,
                                   const std::optional<at::Tensor>& residual, double dropout_p,
                                   const std::optional<at::Tensor>& rowscale,
                                   const std::optional<at::Tensor>& rng_state) {
  TORCH_CHECK(given(residual) || (dropout_p == 0.0 && !given(rowscale)),
              "fusednorm: dropout_p and rowscale need a residual");
  check_dropout_args(input.size(0), input.device(), stats_dtype(input.scalar_type()), dropout_p,
                     rowscale, rng_state);
}

// dropout_scale: grad [M, N] rows; dtype grad's, or float16/bfloat16 beside float32 grad.
inline void check_dropout_scale_args(const at::Tensor& grad,
                                     const std::optional<at::Tensor>& rowscale,
                                     const at::Tensor& rng_state, double dropout_p,
                                     at::ScalarType dtype) {
  check_rows(grad, "grad");
  TORCH_CHECK(sum_dtype_allowed(dtype, grad.scalar_type()), "fusednorm: dtype must be grad's (",
              grad.scalar_type(), ") or float16/bfloat16 beside a float32 grad, got ", dtype);
  // rng_state is [0] when dropout_p is 0 (the add ops' output then).
  check_dropout_args(grad.size(0), grad.device(), stats_dtype(dtype), dropout_p, rowscale,
                     rng_state.numel() > 0 ? std::optional<at::Tensor>(rng_state) : std::nullopt);
}

// norm_fwd: LayerNorm (centered) or RMSNorm (no mean, no bias), with an optional residual.
// sum_dtype: the sum's (sum_dtype_allowed; only with a residual), which the residual may
// have too; the dropout arguments as check_norm_fwd_dropout.
inline void check_norm_fwd_args(const at::Tensor& input, const std::optional<at::Tensor>& residual,
                                const std::optional<at::Tensor>& weight,
                                const std::optional<at::Tensor>& bias, double eps,
                                bool centered,
                                std::optional<at::ScalarType> sum_dtype = std::nullopt,
                                double dropout_p = 0.0,
                                const std::optional<at::Tensor>& rowscale = std::nullopt,
                                const std::optional<at::Tensor>& rng_state = std::nullopt) {
  check_rows(input, "input");
  TORCH_CHECK(eps >= 0.0, "fusednorm: eps must be >= 0, got ", eps);
  check_params(weight, bias, input);
  TORCH_CHECK(centered || !given(bias), "fusednorm: RMSNorm (centered=False) takes no bias");
  if (sum_dtype.has_value() && *sum_dtype != input.scalar_type()) {
    TORCH_CHECK(sum_dtype_allowed(input.scalar_type(), *sum_dtype),
                "fusednorm: sum_dtype must be the input's dtype or float32 beside a "
                "float16/bfloat16 input, got ", *sum_dtype, " beside ", input.scalar_type());
    TORCH_CHECK(given(residual), "fusednorm: sum_dtype needs a residual");
  }
  if (given(residual)) check_like_input(*residual, "residual", input, sum_dtype);
  check_norm_fwd_dropout(input, residual, dropout_p, rowscale, rng_state);
}

inline void check_norm_bwd_args(const at::Tensor& grad_out,
                                const std::optional<at::Tensor>& grad_sum,
                                const at::Tensor& input, const at::Tensor& mean,
                                const at::Tensor& rstd, const std::optional<at::Tensor>& weight,
                                const std::optional<at::Tensor>& bias, bool centered) {
  check_rows(input, "input");
  // grad_out has the norm output's dtype: the input's, or 16-bit beside a float32 sum
  // (residual_dtype); the parameters follow it.
  check_rows(grad_out, "grad_out");
  TORCH_CHECK(grad_out.sizes() == input.sizes() &&
                  sum_dtype_allowed(grad_out.scalar_type(), input.scalar_type()),
              "fusednorm: grad_out must match input (", input.sizes(), ", ", input.scalar_type(),
              ", or float16/bfloat16 beside a float32 input), got ", grad_out.sizes(), ", ",
              grad_out.scalar_type());
  TORCH_CHECK(grad_out.device() == input.device(), "fusednorm: grad_out is on ",
              grad_out.device(), " but input is on ", input.device());
  if (given(grad_sum)) check_like_input(*grad_sum, "grad_sum", input);
  if (centered) check_stats(mean, "mean", input);
  check_stats(rstd, "rstd", input);
  check_params(weight, bias, grad_out);
  TORCH_CHECK(centered || !given(bias), "fusednorm: RMSNorm (centered=False) takes no bias");
}

// norm_bwd's input-gradient arguments: x_dtype, when given, is grad_out's (the add op's
// input's); the multipliers (check_dropout_args, of the forward's statistics dtype) need it.
inline void check_norm_bwd_input_grad(const at::Tensor& grad_out, const at::Tensor& input,
                                      std::optional<at::ScalarType> x_dtype, double dropout_p,
                                      const std::optional<at::Tensor>& rowscale,
                                      const std::optional<at::Tensor>& rng_state) {
  TORCH_CHECK(!x_dtype.has_value() || *x_dtype == grad_out.scalar_type(),
              "fusednorm: x_dtype must be grad_out's dtype (", grad_out.scalar_type(), "), got ",
              *x_dtype);
  TORCH_CHECK(x_dtype.has_value() || (dropout_p == 0.0 && !given(rowscale) && !given(rng_state)),
              "fusednorm: dropout_p, rowscale and rng_state need x_dtype (they shape grad_x)");
  check_dropout_args(input.size(0), input.device(), stats_dtype(input.scalar_type()), dropout_p,
                     rowscale, rng_state);
}

}  // namespace fusednorm
