// GELU feed-forward block on the CPU. The GEMMs go through ATen (MKL / oneDNN), or those
// with the tokens as the long side through oneDNN's matmul where it measured faster (see
// cpu/gemm.h); the elementwise work is one fused pass each way (parallel_chunks over
// rows, at::vec along them), in float (double for double inputs):
//
//   forward:  h = x @ W1^T + b1 (bias inside the GEMM);  one pass: a = gelu(h) (exact:
//             ATen's gelu, i.e. oneDNN's kernel);  y = a @ W2^T + b2
//   backward: dg = dy @ W2;  one pass over h and dg: a = gelu(h), dh = dg * gelu'(h) (in
//             place of dg), with the partial column sums of dh (db1) and dy (db2);
//             dW2 = dy^T @ a,  dW1 = dh^T @ x,  dx = dh @ W1
//
// Only x and h are kept between the two: gelu(h) is recomputed in the backward's pass. The
// [M, H] temporaries live one chunk at a time: rows of the activation in the forward,
// hidden columns of the activation and hidden gradient in the backward.

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/gelu.h>
#include <ATen/ops/mm.h>
#include <torch/library.h>

#include <algorithm>
#include <tuple>

#include "common/dispatch.h"
#include "common/gelu.h"
#include "common/gelu_ffn_checks.h"
#include "cpu/gemm.h"
#include "cpu/parallel.h"
#include "cpu/partials.h"
#include "cpu/vec_io.h"

namespace fusednorm::cpu {
namespace {

using at::vec::Vectorized;

// float math with one exponential per element, inlined (double uses at::vec's erf / tanh,
// exact to double precision):
//  - exp_of_nonpositive(a) = 2^n * e^r, n = round(a / ln 2), |r| <= ln(2) / 2, e^r by its
//    Taylor polynomial to degree 7 (truncation error < 1e-8 relative), 2^n built from its
//    exponent bits; a is clamped at -87 so that 2^n stays a normal float, and the result
//    below that is 0: the callers multiply it by x or x^3, which would scale a floor back up.
//  - exact GELU: Phi(x) by Abramowitz & Stegun 7.1.26 for erf(|x|/sqrt 2) (absolute error
//    <= 1.5e-7, the approximation at::vec's float erf uses), whose exp(-x^2/2) is also the
//    phi(x) of gelu'. Phi of a negative x is the small tail itself, not 1 - (1 - tail).
//  - tanh GELU: 0.5 * (1 + tanh(u)) = sigmoid(2u) = s, so gelu(x) = x * s and
//    gelu'(x) = s + 2 x s (1 - s) u', with s and 1 - s from exp(-2|u|): no cancellation.
inline Vectorized<float> exp_of_nonpositive(const Vectorized<float>& a) {
  using Vec = Vectorized<float>;
  using IVec = Vectorized<int32_t>;
  constexpr float kLog2e = 1.44269504088896341f;
  constexpr float kLn2Hi = 0.693145751953125f;  // ln 2 = kLn2Hi + kLn2Lo, kLn2Hi exact in
  constexpr float kLn2Lo = 1.42860682030941723e-6f;  // 16 bits so that n * kLn2Hi is exact
  const Vec clamped = at::vec::maximum(a, Vec(-87.0f));  // NaN stays NaN
  const Vec n = (clamped * Vec(kLog2e)).round();
  Vec r = at::vec::fmadd(n, Vec(-kLn2Hi), clamped);
  r = at::vec::fmadd(n, Vec(-kLn2Lo), r);
  Vec p(1.0f / 5040.0f);
  p = at::vec::fmadd(p, r, Vec(1.0f / 720.0f));
  p = at::vec::fmadd(p, r, Vec(1.0f / 120.0f));
  p = at::vec::fmadd(p, r, Vec(1.0f / 24.0f));
  p = at::vec::fmadd(p, r, Vec(1.0f / 6.0f));
  p = at::vec::fmadd(p, r, Vec(0.5f));
  p = at::vec::fmadd(p, r, Vec(1.0f));
  p = at::vec::fmadd(p, r, Vec(1.0f));
  const IVec exponent = (at::vec::convert_to_int_of_same_size(n) + IVec(127)) << IVec(23);
  return Vec::blendv(p * at::vec::cast<float>(exponent), Vec(0.0f), a < Vec(-87.0f));
}

// Phi(-|x|) = 0.5 * erfc(|x| / sqrt 2), given e = exp(-x^2 / 2).
inline Vectorized<float> normal_cdf_tail(const Vectorized<float>& x, const Vectorized<float>& e) {
  using Vec = Vectorized<float>;
  constexpr float kP = 0.3275911f;
  constexpr float kA1 = 0.254829592f, kA2 = -0.284496736f, kA3 = 1.421413741f,
                  kA4 = -1.453152027f, kA5 = 1.061405429f;
  const Vec t = (Vec(1.0f) + Vec(kP * GeluConstants<float>::kSqrt1_2) * x.abs()).reciprocal();
  Vec poly = at::vec::fmadd(t, Vec(kA5), Vec(kA4));
  poly = at::vec::fmadd(poly, t, Vec(kA3));
  poly = at::vec::fmadd(poly, t, Vec(kA2));
  poly = at::vec::fmadd(poly, t, Vec(kA1));
  return Vec(0.5f) * poly * t * e;
}

// sigmoid(2u) and 1 - sigmoid(2u), each without cancellation.
inline void sigmoid_2u(const Vectorized<float>& u, Vectorized<float>& s,
                       Vectorized<float>& one_minus_s) {
  using Vec = Vectorized<float>;
  const Vec q = exp_of_nonpositive(Vec(-2.0f) * u.abs());
  const Vec large = (Vec(1.0f) + q).reciprocal();  // sigmoid(2|u|)
  const Vec small = q * large;                     // sigmoid(-2|u|)
  const Vec negative = u < Vec(0.0f);
  s = Vec::blendv(large, small, negative);
  one_minus_s = Vec::blendv(small, large, negative);
}

template <GeluKind kind, typename acc_t>
inline Vectorized<acc_t> gelu_vec(const Vectorized<acc_t>& x) {
  using C = GeluConstants<acc_t>;
  using Vec = Vectorized<acc_t>;
  const Vec half(acc_t(0.5)), one(acc_t(1));
  if constexpr (std::is_same_v<acc_t, float>) {
    if constexpr (kind == GeluKind::kExact) {
      const Vec tail = normal_cdf_tail(x, exp_of_nonpositive(Vec(-0.5f) * x * x));
      return x * Vec::blendv(one - tail, tail, x < Vec(0.0f));
    } else {
      const Vec u = Vec(C::kSqrt2OverPi) * at::vec::fmadd(Vec(C::kCubic) * x * x, x, x);
      Vec s, one_minus_s;
      sigmoid_2u(u, s, one_minus_s);
      return x * s;
    }
  } else if constexpr (kind == GeluKind::kExact) {
    return x * half * (one + (x * Vec(C::kSqrt1_2)).erf());
  } else {
    const Vec inner = Vec(C::kSqrt2OverPi) * at::vec::fmadd(Vec(C::kCubic) * x * x, x, x);
    return half * x * (one + inner.tanh());
  }
}

// gelu(x) and gelu'(x) of a register, sharing their transcendental functions.
template <GeluKind kind, typename acc_t>
inline void gelu_and_grad_vec(const Vectorized<acc_t>& x, Vectorized<acc_t>& value,
                              Vectorized<acc_t>& grad) {
  using C = GeluConstants<acc_t>;
  using Vec = Vectorized<acc_t>;
  const Vec half(acc_t(0.5)), one(acc_t(1));
  if constexpr (std::is_same_v<acc_t, float>) {
    if constexpr (kind == GeluKind::kExact) {
      const Vec e = exp_of_nonpositive(Vec(-0.5f) * x * x);
      const Vec tail = normal_cdf_tail(x, e);
      const Vec cdf = Vec::blendv(one - tail, tail, x < Vec(0.0f));
      value = x * cdf;
      grad = at::vec::fmadd(x * Vec(C::kInvSqrt2Pi), e, cdf);
    } else {
      const Vec x2 = x * x;
      const Vec u = Vec(C::kSqrt2OverPi) * at::vec::fmadd(Vec(C::kCubic) * x2, x, x);
      const Vec du = Vec(C::kSqrt2OverPi) * at::vec::fmadd(Vec(3.0f * C::kCubic), x2, one);
      Vec s, one_minus_s;
      sigmoid_2u(u, s, one_minus_s);
      value = x * s;
      grad = at::vec::fmadd(Vec(2.0f) * x * s * one_minus_s, du, s);
    }
  } else if constexpr (kind == GeluKind::kExact) {
    const Vec cdf = half * (one + (x * Vec(C::kSqrt1_2)).erf());
    const Vec pdf = Vec(C::kInvSqrt2Pi) * (Vec(acc_t(-0.5)) * x * x).exp();
    value = x * cdf;
    grad = at::vec::fmadd(x, pdf, cdf);
  } else {
    const Vec x2 = x * x;
    const Vec t = (Vec(C::kSqrt2OverPi) * at::vec::fmadd(Vec(C::kCubic) * x2, x, x)).tanh();
    const Vec dinner = Vec(C::kSqrt2OverPi) * at::vec::fmadd(Vec(acc_t(3) * C::kCubic), x2, one);
    const Vec half_1pt = half * (one + t);
    value = x * half_1pt;
    grad = at::vec::fmadd(half * x * (one - t * t), dinner, half_1pt);
  }
}

// The forward's pass over the [M, H] pre-activation: a = gelu(h). Used for tanh, where
// the one-exp sigmoid form is faster than ATen's tanh-based kernel (docs/perf-notes.md,
// "Code comments: gelu_rows").
template <typename T, GeluKind kind>
void gelu_rows(const T* h, T* a, int64_t M, int64_t H) {
  using acc_t = acc_type<T>;
  using IO = VecIO<T, acc_t>;
  using Vec = Vectorized<acc_t>;
  const int64_t vec_end = H - H % IO::kWidth;
  parallel_chunks(M, row_grain(H), [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const T* hr = h + row * H;
      T* ar = a + row * H;
      for (int64_t i = 0; i < vec_end; i += IO::kWidth) {
        Vec lo, hi;
        IO::load(hr + i, lo, hi);
        IO::store(ar + i, gelu_vec<kind>(lo), gelu_vec<kind>(hi));
      }
      if (vec_end < H) {  // the last columns as one partial block, as the full ones
        Vec lo, hi;
        load_partial<T, acc_t>(hr + vec_end, H - vec_end, lo, hi);
        store_partial<false>(ar + vec_end, H - vec_end, gelu_vec<kind>(lo), gelu_vec<kind>(hi));
      }
    }
  });
}

// The backward's pass over one row: a = gelu(h), dh = dg * gelu'(h) (dg_dh holds dg and
// receives dh), and the row's dh added to part1 (kBias1), in float before rounding.
template <typename T, GeluKind kind, bool kBias1>
void dgelu_row(const T* h, T* dg_dh, T* a, acc_type<T>* part1, int64_t H) {
  using acc_t = acc_type<T>;
  using IO = VecIO<T, acc_t>;
  using AccIO = VecIO<acc_t, acc_t>;
  using Vec = Vectorized<acc_t>;
  static_assert(AccIO::kWidth == IO::kWidth);
  const int64_t vec_end = H - H % IO::kWidth;
  // The columns from i (kPartial: the `count` from i, the last ones, as one partial block).
  auto block = [&](auto partial, int64_t i, int64_t count) {
    constexpr bool kPartial = decltype(partial)::value;
    Vec hlo, hhi, glo, ghi, vlo, vhi, dlo, dhi;
    load_block<kPartial>(h + i, count, hlo, hhi);
    load_block<kPartial>(dg_dh + i, count, glo, ghi);
    gelu_and_grad_vec<kind>(hlo, vlo, dlo);
    gelu_and_grad_vec<kind>(hhi, vhi, dhi);
    dlo = glo * dlo;
    dhi = ghi * dhi;
    store_block<kPartial, false>(a + i, count, vlo, vhi);
    store_block<kPartial, false>(dg_dh + i, count, dlo, dhi);
    if constexpr (kBias1) {
      Vec plo, phi;
      load_block<kPartial>(part1 + i, count, plo, phi);
      store_block<kPartial, false>(part1 + i, count, plo + dlo, phi + dhi);
    }
  };
  for (int64_t i = 0; i < vec_end; i += IO::kWidth) block(std::false_type{}, i, IO::kWidth);
  if (vec_end < H) block(std::true_type{}, vec_end, H - vec_end);
}

// part += row, elementwise over n values.
template <typename T>
void add_row(const T* row, acc_type<T>* part, int64_t n) {
  using acc_t = acc_type<T>;
  using IO = VecIO<T, acc_t>;
  using AccIO = VecIO<acc_t, acc_t>;
  using Vec = Vectorized<acc_t>;
  const int64_t vec_end = n - n % IO::kWidth;
  for (int64_t i = 0; i < vec_end; i += IO::kWidth) {
    Vec lo, hi, plo, phi;
    IO::load(row + i, lo, hi);
    AccIO::load(part + i, plo, phi);
    AccIO::store(part + i, plo + lo, phi + hi);
  }
  if (vec_end < n) {  // the last columns as one partial block
    Vec lo, hi, plo, phi;
    load_partial<T, acc_t>(row + vec_end, n - vec_end, lo, hi);
    load_partial<acc_t, acc_t>(part + vec_end, n - vec_end, plo, phi);
    store_partial<false>(part + vec_end, n - vec_end, plo + lo, phi + hi);
  }
}

// The backward's pass over M rows of one chunk of hidden columns (`cols` wide; h's rows
// are h_stride apart, dg_dh's and a's are contiguous), in `blocks` row blocks: block b
// sets its column sums of dh into part1 + b * part1_stride (the chunk's columns of its
// [blocks, H] partials) and (kBias2: the first chunk only) of dy into part2[b] ([blocks, N]).
template <typename T, GeluKind kind, bool kBias1, bool kBias2>
void dgelu_rows(const T* h, int64_t h_stride, T* dg_dh, T* a, const T* dy,
                acc_type<T>* part1, int64_t part1_stride, acc_type<T>* part2, int64_t M,
                int64_t cols, int64_t N, int64_t blocks) {
  using acc_t = acc_type<T>;
  const int64_t rows_per_block = (M + blocks - 1) / blocks;
  parallel_chunks(blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      acc_t* p1 = kBias1 ? part1 + b * part1_stride : nullptr;
      acc_t* p2 = kBias2 ? part2 + b * N : nullptr;
      if constexpr (kBias1) std::fill(p1, p1 + cols, acc_t(0));
      if constexpr (kBias2) std::fill(p2, p2 + N, acc_t(0));
      const int64_t row_end = std::min(M, (b + 1) * rows_per_block);
      for (int64_t r = b * rows_per_block; r < row_end; ++r) {
        dgelu_row<T, kind, kBias1>(h + r * h_stride, dg_dh + r * cols, a + r * cols, p1, cols);
        if constexpr (kBias2) add_row(dy + r * N, p2, N);
      }
    }
  });
}

// Rows per chunk of the forward's [M, H] activation: about 2^21 values, so that it stays
// a fraction of the saved pre-activation, but never fewer than 512 rows, so that each
// chunk's GEMMs still run at full speed; M is split into equal chunks (no short last one),
// at least two when M allows 512-row chunks.
int64_t chunk_rows(int64_t M, int64_t H) {
  constexpr int64_t kChunkValues = int64_t(1) << 21;
  const int64_t half = std::max<int64_t>(512, (M + 1) / 2);
  const int64_t target =
      std::min({M, half, std::max<int64_t>(512, kChunkValues / std::max<int64_t>(H, 1))});
  if (target <= 0) return M;
  const int64_t chunks = (M + target - 1) / target;
  return (M + chunks - 1) / chunks;
}

// Hidden columns per chunk of the backward's [M, H] temporaries (the activation, the hidden
// gradient): about 2^21 values, at least two chunks when H allows (the two temporaries of
// a single chunk would be as large as eager's two saved activations), never fewer than 256
// columns, equal chunks rounded up to 64 columns. By columns, not rows: each chunk's weight
// gradients are then whole GEMMs over all M rows, where row chunks' weight gradients would
// accumulate over smaller GEMMs, which cost more (docs/perf-notes.md, "Code comments:
// chunk_cols"). Depends on the shape only.
int64_t chunk_cols(int64_t M, int64_t H) {
  constexpr int64_t kChunkValues = int64_t(1) << 21, kMinCols = 256, kAlign = 64;
  int64_t cols = std::min(kChunkValues / std::max<int64_t>(M, 1), (H + 1) / 2);
  cols = std::max(cols, kMinCols);
  if (cols >= H) return H;
  const int64_t chunks = (H + cols - 1) / cols;
  cols = ((H + chunks - 1) / chunks + kAlign - 1) / kAlign * kAlign;
  return std::min(cols, H);
}

// a = gelu(h) over rows of h (both [rows, H], contiguous).
void gelu_into(const at::Tensor& h, at::Tensor& a, GeluKind kind) {
  if (kind == GeluKind::kExact) {
    // ATen's exact GELU runs oneDNN's JIT kernel on the CPU, faster than an at::vec erf.
    at::gelu_out(a, h, "none");
    return;
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, h.scalar_type(), "gelu_ffn_fwd", [&] {
    gelu_rows<scalar_t, GeluKind::kTanh>(h.const_data_ptr<scalar_t>(),
                                         a.mutable_data_ptr<scalar_t>(), h.size(0), h.size(1));
  });
}

std::tuple<at::Tensor, at::Tensor> gelu_ffn_fwd(const at::Tensor& input, const at::Tensor& weight1,
                                                const std::optional<at::Tensor>& bias1,
                                                const at::Tensor& weight2,
                                                const std::optional<at::Tensor>& bias2,
                                                c10::string_view approximate) {
  check_gelu_ffn_fwd_args(input, weight1, bias1, weight2, bias2);
  const GeluKind kind = parse_approximate(approximate);
  const int64_t M = input.size(0), H = weight1.size(0), N = weight2.size(0);
  // The activation exists one chunk of rows at a time: only hidden is kept for backward.
  // (Scratch before the outputs: see thread_scratch in cpu/partials.h.)
  const int64_t rows = std::max<int64_t>(1, chunk_rows(M, H));
  at::Tensor act = at::empty({std::min(rows, M), H}, input.options());
  at::Tensor hidden = at::empty({M, H}, input.options());
  at::Tensor out = at::empty({M, N}, input.options());
  // b1 is added inside the GEMM (beta = 1 on the broadcast bias), before the product is
  // rounded to the input's dtype: adding it to a rounded float16/bfloat16 product instead
  // loses accuracy wherever the two nearly cancel.
  linear_into(hidden, input, weight1, bias1);
  if (rows >= M) {  // one chunk: no views to make (a small call's host time)
    gelu_into(hidden, act, kind);
    linear_into(out, act, weight2, bias2);
    return {out, hidden};
  }
  for (int64_t r0 = 0; r0 < M; r0 += rows) {
    const int64_t n = std::min(rows, M - r0);
    at::Tensor act_c = act.narrow(0, 0, n), out_c = out.narrow(0, r0, n);
    gelu_into(hidden.narrow(0, r0, n), act_c, kind);
    linear_into(out_c, act_c, weight2, bias2);
  }
  return {out, hidden};
}

// Backward, one chunk of hidden columns [c0, c0 + nc) at a time (temporaries [M, nc],
// never [M, H]):
//   dg = dy W2[:, c];  a = gelu(h[:, c]), dh = dg * gelu'(h[:, c]) (one pass);
//   dW2[:, c] = dy^T a;  dW1[c, :] = dh^T x;  dx += dh W1[c, :];
//   db1[c], db2 = column sums of dh, dy (per-block partials, summed in block order).
// float16/bfloat16 run as one chunk: their GEMMs round each product to the dtype, so dx
// summed over chunks would be rounded once per chunk instead of once.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> gelu_ffn_bwd(
    const at::Tensor& grad_out, const at::Tensor& input, const at::Tensor& hidden_pre,
    const at::Tensor& weight1, const at::Tensor& weight2, bool has_bias1, bool has_bias2,
    c10::string_view approximate) {
  check_gelu_ffn_bwd_args(grad_out, input, hidden_pre, weight1, weight2);
  const GeluKind kind = parse_approximate(approximate);
  const int64_t M = input.size(0), K = input.size(1), H = weight1.size(0), N = weight2.size(0);
  const auto options = input.options();

  const bool reduced = input.scalar_type() == at::kHalf || input.scalar_type() == at::kBFloat16;
  const int64_t cols = reduced ? H : chunk_cols(M, H);
  const int64_t blocks = M > 0 ? num_row_blocks(M, H + N) : 0;
  const auto acc_options = options.dtype(stats_dtype(input.scalar_type()));
  at::Tensor part1 = at::empty({has_bias1 ? blocks : 0, H}, acc_options);
  at::Tensor part2 = at::empty({has_bias2 ? blocks : 0, N}, acc_options);
  // Flat, so that a narrower last chunk is still a contiguous [M, nc] view.
  at::Tensor grad_hidden = at::empty({M * cols}, options);  // dg, then dh
  at::Tensor act = at::empty({M * cols}, options);
  // The outputs after the scratch (see thread_scratch in cpu/partials.h for why).
  at::Tensor grad_input = at::empty({M, K}, options);
  at::Tensor grad_weight1 = at::empty({H, K}, options);
  at::Tensor grad_weight2 = at::empty({N, H}, options);
  at::Tensor grad_bias1 = at::empty({has_bias1 ? H : 0}, options);
  at::Tensor grad_bias2 = at::empty({has_bias2 ? N : 0}, options);
  if (M == 0) {  // empty sums
    grad_weight1.zero_();
    grad_weight2.zero_();
  }

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, input.scalar_type(), "gelu_ffn_bwd", [&] {
    using acc_t = acc_type<scalar_t>;
    // At least one chunk, so that H = 0 still gives dx = 0 and the column sums of dy
    // (cols is 0 then: the step is at least 1).
    for (int64_t c0 = 0; c0 == 0 || c0 < H; c0 += std::max<int64_t>(cols, 1)) {
      const int64_t nc = std::min(cols, H - c0);
      at::Tensor dh_c = grad_hidden.narrow(0, 0, M * nc).view({M, nc});
      at::Tensor act_c = act.narrow(0, 0, M * nc).view({M, nc});
      matmul_into(dh_c, grad_out, weight2.narrow(1, c0, nc), /*accumulate=*/false);
      if (M > 0) {
        const bool first = c0 == 0;
        dispatch_gelu_kind(kind, [&](auto kind_tag) {
          dispatch_bools(has_bias1, has_bias2 && first, [&](auto b1, auto b2) {
            dgelu_rows<scalar_t, decltype(kind_tag)::value, decltype(b1)::value,
                       decltype(b2)::value>(
                hidden_pre.const_data_ptr<scalar_t>() + c0, H, dh_c.mutable_data_ptr<scalar_t>(),
                act_c.mutable_data_ptr<scalar_t>(), grad_out.const_data_ptr<scalar_t>(),
                has_bias1 ? part1.mutable_data_ptr<acc_t>() + c0 : nullptr, H,
                has_bias2 ? part2.mutable_data_ptr<acc_t>() : nullptr, M, nc, N, blocks);
          });
        });
      }
      at::Tensor dw2_c = grad_weight2.narrow(1, c0, nc);
      at::mm_out(dw2_c, grad_out.t(), act_c);
      at::Tensor dw1_c = grad_weight1.narrow(0, c0, nc);
      at::mm_out(dw1_c, dh_c.t(), input);
      // The first chunk writes dx (H = 0: zeros), the others add to it.
      matmul_into(grad_input, dh_c, weight1.narrow(0, c0, nc), /*accumulate=*/c0 != 0);
    }
    if (has_bias1) {
      sum_partials(part1.const_data_ptr<acc_t>(), blocks, H, grad_bias1.mutable_data_ptr<scalar_t>());
    }
    if (has_bias2) {
      sum_partials(part2.const_data_ptr<acc_t>(), blocks, N, grad_bias2.mutable_data_ptr<scalar_t>());
    }
  });
  return {grad_input, grad_weight1, grad_bias1, grad_weight2, grad_bias2};
}

}  // namespace
}  // namespace fusednorm::cpu

TORCH_LIBRARY_IMPL(fusednorm, CPU, m) {
  m.impl("gelu_ffn_fwd", &fusednorm::cpu::gelu_ffn_fwd);
  m.impl("gelu_ffn_bwd", &fusednorm::cpu::gelu_ffn_bwd);
}
