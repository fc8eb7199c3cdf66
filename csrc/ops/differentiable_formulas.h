#pragma once
// The public ops written with ATen's differentiable elementwise and reduction ops: the norm's
// forward (what gives forward-mode AD's tangents) and the backward formulas a backward node
// returns when grad mode is on inside it (create_graph=True, torch.func.vjp / grad / jacrev
// / hessian). The results depend differentiably on the inputs and on the incoming
// gradients, to any order, everything recomputed from the op's inputs (not from the fused
// forward's saved statistics).
//
// Not at::layer_norm and its backward: PyTorch's layer_norm formulas treat the saved mean
// and rstd as constants from the third derivative on (pytorch/pytorch#175754) and nested
// forward mode (#196700), so they return wrong values there. And plain ATen expressions on
// the saved tensors, like PyTorch's generated formulas, not a nested torch::autograd::grad
// call: under torch.func a vjp_fn runs after its transform's level has ended, where such a
// nested call saw no input requiring grad and returned nothing (so zeros).

#include <ATen/ATen.h>

#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace fusednorm::formulas {

// The leading dims of a tensor normalized over its last `dims` dims (what the parameter
// gradients sum over) and those last dims (what the statistics reduce over).
inline std::vector<int64_t> leading_dims(const at::Tensor& t, int64_t dims) {
  std::vector<int64_t> d;
  for (int64_t i = 0; i < t.dim() - dims; ++i) d.push_back(i);
  return d;
}
inline std::vector<int64_t> trailing_dims(const at::Tensor& t, int64_t dims) {
  std::vector<int64_t> d;
  for (int64_t i = t.dim() - dims; i < t.dim(); ++i) d.push_back(i);
  return d;
}

// Sum over the leading dims, to a parameter's shape and dtype.
inline at::Tensor sum_to_param(const at::Tensor& t, int64_t dims, const at::Tensor& param) {
  const auto lead = leading_dims(t, dims);
  const at::Tensor s = lead.empty() ? t : t.sum(lead);
  return s.to(param.scalar_type());
}

// The dtype a norm computes in, as the kernels do: float for 16-bit inputs (and beside
// float parameters), double for double.
inline at::ScalarType compute_type(const at::Tensor& x, const at::Tensor& weight,
                                   const at::Tensor& bias) {
  const at::Tensor& param = weight.defined() ? weight : bias;
  const auto type = param.defined() ? at::promote_types(param.scalar_type(), x.scalar_type())
                                    : x.scalar_type();
  return type == at::kHalf || type == at::kBFloat16 ? at::kFloat : type;
}

// (xhat, rstd) of x normalized over its last `dims` dims: xhat = (x - mean) * rstd
// (RMSNorm: x * rstd), rstd = 1 / sqrt(var + eps) (RMSNorm: mean(x^2) + eps).
inline std::pair<at::Tensor, at::Tensor> normalized(bool centered, const at::Tensor& x,
                                                    int64_t dims, double eps) {
  const auto rows = trailing_dims(x, dims);
  const at::Tensor centered_x = centered ? x - x.mean(rows, /*keepdim=*/true) : x;
  const at::Tensor rstd = at::rsqrt(centered_x.square().mean(rows, true) + eps);
  return {centered_x * rstd, rstd};
}

// y = norm(x) * weight + bias over the last `dims` dims, in x's dtype.
inline at::Tensor norm_forward(bool centered, const at::Tensor& x, int64_t dims,
                               const at::Tensor& weight, const at::Tensor& bias, double eps) {
  const auto [xhat, rstd] = normalized(centered, x.to(compute_type(x, weight, bias)), dims, eps);
  at::Tensor y = weight.defined() ? xhat * weight : xhat;
  if (bias.defined()) y = y + bias;
  return y.to(x.scalar_type());
}

// s = input + residual in sum_type (the input's, or wider: residual_dtype), one rounding.
// With multipliers (the add ops' dropout / rowscale, in the computation type), as the
// kernels: input * multipliers and + residual each rounded in that type, then to sum_type.
inline at::Tensor residual_sum(const at::Tensor& input, const at::Tensor& residual,
                               at::ScalarType sum_type, const at::Tensor& multipliers = {}) {
  if (multipliers.defined()) {
    const at::ScalarType type = multipliers.scalar_type();
    return at::add(at::mul(input.to(type), multipliers), residual.to(type)).to(sum_type);
  }
  if (input.scalar_type() == sum_type && residual.scalar_type() == sum_type) {
    return at::add(input, residual);
  }
  return at::add(input.to(sum_type), residual.to(sum_type));
}

// The gradients (input, residual, weight, bias) of a norm op: y = norm(s) with
// s = input + residual (s = input without a residual), and the sum s as a second output.
// sum: s itself, for the add ops the op's sum output, whose grad_fn (the op's node) carries a
// gradient of these on to input and residual, so that neither is kept for a create_graph
// backward. grad_out or grad_sum may be undefined (no gradient reached it); weight and bias
// may be undefined. The arithmetic is in compute_type, the result rounded once to the
// input's (input_type) and the parameters' dtypes; the sum's gradient is the residual's
// before its rounding to residual_type (none: no residual); multipliers: the input's
// dropout / rowscale (residual_sum), which its gradient is multiplied by.
inline std::vector<at::Tensor> norm_backward(bool centered, const at::Tensor& sum, int64_t dims,
                                             const at::Tensor& weight, const at::Tensor& bias,
                                             double eps, const at::Tensor& grad_out,
                                             const at::Tensor& grad_sum,
                                             at::ScalarType input_type,
                                             std::optional<at::ScalarType> residual_type,
                                             const at::Tensor& multipliers = {}) {
  std::vector<at::Tensor> grads(4);
  at::Tensor grad_input;
  if (grad_out.defined()) {
    const auto type = compute_type(sum, weight, bias);
    const at::Tensor dy = grad_out.to(type);
    const auto rows = trailing_dims(dy, dims);
    const auto [xhat, rstd] = normalized(centered, sum.to(type), dims, eps);
    const at::Tensor g = weight.defined() ? dy * weight : dy;
    // dx = rstd * (g - mean(g) - xhat * mean(g * xhat)); RMSNorm has no mean(g) term.
    at::Tensor inner = g - xhat * (g * xhat).mean(rows, true);
    if (centered) inner = inner - g.mean(rows, true);
    grad_input = rstd * inner;  // rounded to the input's dtype below, after the grad_sum
    if (weight.defined()) grads[2] = sum_to_param(dy * xhat, dims, weight);
    if (bias.defined()) grads[3] = sum_to_param(dy, dims, bias);
  }
  if (grad_sum.defined()) {
    grad_input = grad_input.defined() ? grad_input + grad_sum.to(grad_input.scalar_type())
                                      : grad_sum;
  }
  if (grad_input.defined()) {
    grads[0] = multipliers.defined() ? (grad_input * multipliers).to(input_type)
                                     : grad_input.to(input_type);
    if (residual_type.has_value()) grads[1] = grad_input.to(*residual_type);
  }
  return grads;
}

// The gradient of the FFN's pre-activation hidden = x W1^T + b1 ([rows, H]) from dy ([rows,
// N]): (dy W2) * gelu'(hidden).
inline at::Tensor ffn_hidden_grad(const at::Tensor& dy, const at::Tensor& weight2,
                                  const at::Tensor& hidden, const std::string& approximate) {
  return at::gelu_backward(at::mm(dy, weight2), hidden, approximate);
}

// The gradients (input as [rows, K], weight1, bias1, weight2, bias2) of the FFN from its
// pre-activation hidden, each formed only where `wanted` (biases: where has_bias), with
// eager's ops: a frozen weight costs no GEMM. x ([rows, K]) is read for weight1's alone.
// Differentiable in grad mode (through hidden's history for the input).
inline std::vector<at::Tensor> ffn_wanted_grads(const at::Tensor& dy, const at::Tensor& x,
                                                const at::Tensor& weight1, bool has_bias1,
                                                const at::Tensor& weight2, bool has_bias2,
                                                const at::Tensor& hidden,
                                                const std::string& approximate,
                                                const std::vector<bool>& wanted) {
  std::vector<at::Tensor> grads(5);
  if (wanted[0] || wanted[1] || (wanted[2] && has_bias1)) {
    const at::Tensor grad_hidden = ffn_hidden_grad(dy, weight2, hidden, approximate);
    if (wanted[0]) grads[0] = at::mm(grad_hidden, weight1);
    if (wanted[1]) grads[1] = at::mm(grad_hidden.t(), x);
    if (wanted[2] && has_bias1) grads[2] = grad_hidden.sum(0);
  }
  if (wanted[3]) grads[3] = at::mm(dy.t(), at::gelu(hidden, approximate));
  if (wanted[4] && has_bias2) grads[4] = dy.sum(0);
  return grads;
}

// The gradients (input, weight1, bias1, weight2, bias2) of out = gelu(x W1^T + b1) W2^T + b2.
inline std::vector<at::Tensor> ffn_backward(const at::Tensor& input, const at::Tensor& weight1,
                                            const at::Tensor& bias1, const at::Tensor& weight2,
                                            const at::Tensor& bias2,
                                            const std::string& approximate,
                                            const at::Tensor& grad_out) {
  const at::Tensor x = input.reshape_symint({-1, input.sym_size(-1)});
  const at::Tensor dy = grad_out.reshape_symint({-1, grad_out.sym_size(-1)});
  const std::optional<at::Tensor> b1 = bias1.defined() ? std::optional(bias1) : std::nullopt;
  std::vector<at::Tensor> grads =
      ffn_wanted_grads(dy, x, weight1, bias1.defined(), weight2, bias2.defined(),
                       at::linear(x, weight1, b1), approximate, std::vector<bool>(5, true));
  grads[0] = grads[0].view_symint(input.sym_sizes());
  return grads;
}

}  // namespace fusednorm::formulas
