#pragma once
// Every op of fusednorm, written once: its schema (what torch.ops.fusednorm.<name> takes
// and returns) and the C++ signature of its kernels and typed handles. Read by
// csrc/fusednorm.cpp (which defines the schemas), csrc/ops (the public ops' kernels and
// handles, op_table::<name>), csrc/ops/op_handles.h (every op's typed handle) and
// csrc/python/fast_calls.cpp (the public ops' direct Python entries). The dispatcher
// checks, when fusednorm._C loads, that every kernel registered for an op has the
// signature given here and that it matches the schema; tests/test_op_table.py checks that
// the Python side (fake kernels, vmap rules, fusednorm.functional) agrees with the schemas.
//
// FUSEDNORM_PUBLIC_OPS(X): X(name, schema, signature, fast_outputs) for each public op (any
// shape and layout, autograd to any order, autocast like torch.nn.functional);
// fast_outputs: how many leading outputs fusednorm.functional.<name> returns (1: out; 2:
// (out, sum)), which is also what its direct entry in fusednorm._fast returns.
// FUSEDNORM_BACKEND_OPS(X): X(name, schema, signature) for each backend op (contiguous
// [M, N] rows, one kernel per device in csrc/cpu and csrc/cuda, no autograd).

#include <ATen/core/Tensor.h>
#include <c10/util/string_view.h>

#include <array>
#include <optional>
#include <tuple>

namespace fusednorm::op_table {

using OptTensor = std::optional<at::Tensor>;
using Tensor2 = std::tuple<at::Tensor, at::Tensor>;
using Tensor3 = std::tuple<at::Tensor, at::Tensor, at::Tensor>;
using Tensor4 = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;
using Tensor5 = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;
using Tensor = const at::Tensor&;
using Opt = const OptTensor&;
using Shape = c10::SymIntArrayRef;
using Str = c10::string_view;
using OptDtype = std::optional<at::ScalarType>;
using ParamGrads = std::array<bool, 2>;  // norm_bwd's: grad_weight, grad_bias wanted

}  // namespace fusednorm::op_table

#define FUSEDNORM_PUBLIC_OPS(X)                                                              \
  /* LayerNorm over the trailing normalized_shape dims, as torch.native_layer_norm: the     \
     output (input's shape and dtype, contiguous) and the per-row statistics mean and rstd  \
     ([M], float32; float64 for a float64 input), which are not differentiable.             \
     zero_centered_weight (this op, rms_norm, add_layer_norm, add_rms_norm): the weight     \
     applied is 1 + weight, formed in the computation type (float32; float64 for a float64  \
     input) by ATen ops before the kernels run, so gradients go to weight. */               \
  X(layer_norm,                                                                              \
    "layer_norm(Tensor input, SymInt[] normalized_shape, Tensor? weight, Tensor? bias,"      \
    " float eps, bool zero_centered_weight=False)"                                           \
    " -> (Tensor out, Tensor mean, Tensor rstd)",                                            \
    Tensor3(Tensor, Shape, Opt, Opt, double, bool), 1)                                       \
  /* RMSNorm over the trailing normalized_shape dims, as torch.nn.functional.rms_norm (eps  \
     None: the machine epsilon of float32, or of float64 for a float64 input), and rstd. */ \
  X(rms_norm,                                                                                \
    "rms_norm(Tensor input, SymInt[] normalized_shape, Tensor? weight, float? eps,"          \
    " bool zero_centered_weight=False) -> (Tensor out, Tensor rstd)",                        \
    Tensor2(Tensor, Shape, Opt, std::optional<double>, bool), 1)                             \
  /* s = input + residual, then LayerNorm / RMSNorm of s, in one pass over memory:        \
     (norm(s), s, statistics); norm(s) and s are differentiable. residual_dtype None: s in  \
     the input's dtype, residual of the input's dtype; float32: s formed, kept and returned \
     in float32 (float64 for a float64 input: never narrower than the input), residual of  \
     the input's dtype or s's; out stays in the input's dtype. dropout_p / rowscale:        \
     s = dropout(input, dropout_p) * rowscale[row] + residual, the mask drawn from the     \
     device's default generator (common/philox.h), rowscale (not differentiable) of the    \
     leading dims' shape; rng_state: the (seed, offset) of the mask (int64 [2] on the      \
     input's device; [0] when dropout_p is 0), which the backward regenerates it from. */ \
  X(add_layer_norm,                                                                          \
    "add_layer_norm(Tensor input, Tensor residual, SymInt[] normalized_shape, Tensor? weight," \
    " Tensor? bias, float eps, bool zero_centered_weight=False,"                             \
    " ScalarType? residual_dtype=None, float dropout_p=0., Tensor? rowscale=None)"           \
    " -> (Tensor out, Tensor sum, Tensor mean, Tensor rstd, Tensor rng_state)",              \
    Tensor5(Tensor, Tensor, Shape, Opt, Opt, double, bool, OptDtype, double, Opt), 2)        \
  X(add_rms_norm,                                                                            \
    "add_rms_norm(Tensor input, Tensor residual, SymInt[] normalized_shape, Tensor? weight," \
    " float? eps, bool zero_centered_weight=False, ScalarType? residual_dtype=None,"         \
    " float dropout_p=0., Tensor? rowscale=None)"                                            \
    " -> (Tensor out, Tensor sum, Tensor rstd, Tensor rng_state)",                           \
    Tensor4(Tensor, Tensor, Shape, Opt, std::optional<double>, bool, OptDtype, double, Opt), \
    2)                                                                                       \
  /* gelu(input @ weight1.T + bias1) @ weight2.T + bias2 over the last dim, and hidden_pre = \
     input @ weight1.T + bias1 as [M, hidden] rows (not differentiable). */                 \
  X(gelu_ffn,                                                                                \
    "gelu_ffn(Tensor input, Tensor weight1, Tensor? bias1, Tensor weight2, Tensor? bias2,"   \
    " str approximate) -> (Tensor out, Tensor hidden_pre)",                                  \
    Tensor2(Tensor, Tensor, Opt, Tensor, Opt, Str), 1)                                       \
  /* input + gelu_ffn(layer_norm(input, [d])): the pre-LN feed-forward sub-block, with the  \
     LayerNorm statistics and hidden_pre (not differentiable). */                           \
  X(layer_norm_gelu_ffn,                                                                     \
    "layer_norm_gelu_ffn(Tensor input, Tensor? ln_weight, Tensor? ln_bias, float eps,"       \
    " Tensor weight1, Tensor? bias1, Tensor weight2, Tensor? bias2, str approximate)"        \
    " -> (Tensor out, Tensor mean, Tensor rstd, Tensor hidden_pre)",                         \
    Tensor4(Tensor, Opt, Opt, double, Tensor, Opt, Tensor, Opt, Str), 1)

#define FUSEDNORM_BACKEND_OPS(X)                                                             \
  /* The norm family over the rows of a contiguous [M, N] input: LayerNorm (centered) or    \
     RMSNorm (not centered: no mean, no bias), normalizing input + residual when a residual \
     is given. sum = input + residual in sum_dtype ([0] without a residual): the input's    \
     dtype (None), or float32 beside a float16/bfloat16 input, the residual being of either \
     dtype; mean ([M]; [0] for RMSNorm) and rstd ([M]) are float32 (float64 for a float64   \
     input); out has the input's dtype. With a residual, dropout_p > 0 and/or rowscale     \
     ([M], float32; float64 for a float64 input): sum = input * m + residual, m per element \
     the mask of common/philox.h times 1 / (1 - p) times rowscale[row]; the (seed, offset) \
     drawn from the device's default generator are written to rng_state (int64 [2], given \
     exactly when dropout_p > 0). */                                                      \
  X(norm_fwd,                                                                                \
    "norm_fwd(Tensor input, Tensor? residual, Tensor? weight, Tensor? bias, float eps,"      \
    " bool centered, ScalarType? sum_dtype=None, float dropout_p=0.,"                        \
    " Tensor? rowscale=None, Tensor(a!)? rng_state=None)"                                    \
    " -> (Tensor out, Tensor sum, Tensor mean, Tensor rstd)",                                \
    Tensor4(Tensor, Opt, Opt, Opt, double, bool, OptDtype, double, Opt, Opt))               \
  /* input is what was normalized (the sum, with a residual); grad_sum, the gradient of the \
     sum output, is added to grad_input (input's dtype). grad_out has the input's dtype, or \
     is float16/bfloat16 beside a float32 input (a float32 sum of norm_fwd's sum_dtype);    \
     parameters follow grad_out's dtype. grad_weight / grad_bias are [N] in the parameter's \
     dtype, or empty ([0]) when that parameter is None; their reduction over rows is        \
     deterministic. grad_x, the add op's input gradient, is written in the same pass when   \
     x_dtype is given (grad_out's dtype: norm_fwd's input's), else empty ([0]): grad_input  \
     (rounded) times the multipliers of the norm_fwd call whose dropout_p, rowscale and     \
     rng_state (given exactly when dropout_p > 0) are given, rounded once to x_dtype;       \
     bitwise dropout_scale(grad_input, rowscale, rng_state, dropout_p, x_dtype), and        \
     without dropout / rowscale grad_input.to(x_dtype). param_grads: whether grad_weight   \
     and grad_bias are wanted; one not wanted (a frozen parameter) is empty ([0]) and its   \
     column sums are not formed. */                                                         \
  X(norm_bwd,                                                                                \
    "norm_bwd(Tensor grad_out, Tensor? grad_sum, Tensor input, Tensor mean, Tensor rstd,"    \
    " Tensor? weight, Tensor? bias, bool centered, ScalarType? x_dtype=None,"               \
    " float dropout_p=0., Tensor? rowscale=None, Tensor? rng_state=None,"                    \
    " bool[2] param_grads=[True, True]) -> (Tensor grad_input, Tensor grad_weight,"          \
    " Tensor grad_bias, Tensor grad_x)",                                                     \
    Tensor4(Tensor, Opt, Tensor, Tensor, Tensor, Opt, Opt, bool, OptDtype, double, Opt, Opt, \
            ParamGrads))                                                                     \
  /* grad * m rounded once to dtype (grad's, or float16/bfloat16 beside a float32 grad: a  \
     float32 sum's input), m the multipliers of the norm_fwd call whose rng_state (and     \
     dropout_p, rowscale) are given, on rows of grad's [M, N] shape: the input gradient of \
     that call's dropout, the mask regenerated rather than stored. */                      \
  X(dropout_scale,                                                                           \
    "dropout_scale(Tensor grad, Tensor? rowscale, Tensor rng_state, float dropout_p,"        \
    " ScalarType dtype) -> Tensor",                                                          \
    at::Tensor(Tensor, Opt, Tensor, double, at::ScalarType))                                 \
  /* The LayerNorm output (input - mean) * rstd * weight + bias from the statistics that    \
     norm_fwd returned: a block that does not save its LayerNorm output recomputes it with  \
     this in the backward. */                                                               \
  X(layer_norm_apply,                                                                        \
    "layer_norm_apply(Tensor input, Tensor mean, Tensor rstd, Tensor? weight,"               \
    " Tensor? bias) -> Tensor",                                                              \
    at::Tensor(Tensor, Tensor, Tensor, Opt, Opt))                                            \
  /* GELU feed-forward block out = gelu(input @ weight1.T + bias1) @ weight2.T + bias2 over \
     a contiguous [M, K] input; weight1 [H, K], weight2 [N, H], biases [H] / [N], all of    \
     the input's dtype. approximate is 'none' (erf) or 'tanh', as torch.nn.GELU.            \
     hidden_pre = input @ weight1.T + bias1 ([M, H]) is all the backward needs besides the  \
     input. */                                                                              \
  X(gelu_ffn_fwd,                                                                            \
    "gelu_ffn_fwd(Tensor input, Tensor weight1, Tensor? bias1, Tensor weight2,"              \
    " Tensor? bias2, str approximate) -> (Tensor out, Tensor hidden_pre)",                   \
    Tensor2(Tensor, Tensor, Opt, Tensor, Opt, Str))                                          \
  /* Recomputes gelu(hidden_pre) where it needs it. grad_bias1 / grad_bias2 are [H] / [N],  \
     or empty ([0]) when has_bias1 / has_bias2 is false; their reduction over rows is       \
     deterministic. */                                                                      \
  X(gelu_ffn_bwd,                                                                            \
    "gelu_ffn_bwd(Tensor grad_out, Tensor input, Tensor hidden_pre, Tensor weight1,"         \
    " Tensor weight2, bool has_bias1, bool has_bias2, str approximate) -> (Tensor"           \
    " grad_input, Tensor grad_weight1, Tensor grad_bias1, Tensor grad_weight2,"              \
    " Tensor grad_bias2)",                                                                   \
    Tensor5(Tensor, Tensor, Tensor, Tensor, Tensor, bool, bool, Str))

namespace fusednorm::op_table {

// op_table::<name>: the signature of each op, for its kernels and typed handles.
#define FUSEDNORM_OP_SIGNATURE(name, schema, signature, ...) using name = signature;
FUSEDNORM_PUBLIC_OPS(FUSEDNORM_OP_SIGNATURE)
FUSEDNORM_BACKEND_OPS(FUSEDNORM_OP_SIGNATURE)
#undef FUSEDNORM_OP_SIGNATURE

}  // namespace fusednorm::op_table
