// LayerNorm forward and backward on the CPU: rows in parallel (at::parallel_for), each row
// vectorized (at::vec), statistics by Welford in float (double for double inputs).

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <tuple>
#include <utility>

#include "common/checks.h"
#include "common/dispatch.h"
#include "common/welford.h"
#include "cpu/vec_io.h"

namespace fusednorm::cpu {
namespace {

using at::vec::Vectorized;

// Rows per parallel task: enough elements that a task outweighs its scheduling cost.
int64_t row_grain(int64_t N) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(N, 1)); }

// Streaming stores pay off only for outputs that would not stay in cache anyway.
bool use_streaming_stores(int64_t output_bytes) {
  constexpr int64_t kLargerThanCaches = int64_t(8) << 20;
  return output_bytes >= kLargerThanCaches;
}

// One Welford step on a register of lanes that have all seen `count` values.
template <typename acc_t>
inline void welford_step(const Vectorized<acc_t>& x, const Vectorized<acc_t>& inv_count,
                         Vectorized<acc_t>& mean, Vectorized<acc_t>& m2) {
  const auto delta = x - mean;
  mean = at::vec::fmadd(delta, inv_count, mean);
  m2 = at::vec::fmadd(delta, x - mean, m2);
}

// Mean and M2 of one row in a single pass, over x - shift: with shift = x[0], the values
// Welford accumulates are small even when the row sits far from zero (1e4 + noise), so the
// running mean does not lose the noise to rounding (its mean is shift + the result's).
// Four independent accumulator registers hide the latency of the dependent Welford chain;
// their lanes, which all hold the same count, are merged with Chan's formula, then the
// scalar tail is merged in.
template <typename T, typename acc_t>
WelfordState<acc_t> row_statistics(const T* x, int64_t N, acc_t shift) {
  using IO = VecIO<T, acc_t>;
  using Vec = Vectorized<acc_t>;
  constexpr int64_t kStep = 2 * IO::kWidth;
  constexpr int kRegs = 4;
  constexpr int kLanes = kRegs * Vec::size();

  Vec mean[kRegs] = {Vec(0), Vec(0), Vec(0), Vec(0)};
  Vec m2[kRegs] = {Vec(0), Vec(0), Vec(0), Vec(0)};
  const Vec vshift(shift);
  const int64_t vec_end = N - N % kStep;
  acc_t count = 0;
  for (int64_t i = 0; i < vec_end; i += kStep) {
    count += acc_t(1);
    const Vec inv_count(acc_t(1) / count);
    Vec v[kRegs];
    IO::load(x + i, v[0], v[1]);
    IO::load(x + i + IO::kWidth, v[2], v[3]);
    for (int r = 0; r < kRegs; ++r) welford_step(v[r] - vshift, inv_count, mean[r], m2[r]);
  }

  WelfordState<acc_t> total;
  if (vec_end > 0) {
    // Equal counts: the merged mean is the mean of the lane means, and Chan's correction
    // term is count * sum((lane_mean - mean)^2).
    acc_t lane_mean[kLanes], lane_m2[kLanes];
    for (int r = 0; r < kRegs; ++r) {
      mean[r].store(lane_mean + r * Vec::size());
      m2[r].store(lane_m2 + r * Vec::size());
    }
    acc_t mean_sum = 0;
    for (int l = 0; l < kLanes; ++l) mean_sum += lane_mean[l];
    total.mean = mean_sum / kLanes;
    acc_t m2_sum = 0, spread = 0;
    for (int l = 0; l < kLanes; ++l) {
      m2_sum += lane_m2[l];
      const acc_t d = lane_mean[l] - total.mean;
      spread += d * d;
    }
    total.m2 = m2_sum + count * spread;
    total.count = count * kLanes;
  }
  WelfordState<acc_t> tail;
  for (int64_t i = vec_end; i < N; ++i) tail.update(static_cast<acc_t>(x[i]) - shift);
  total.merge(tail);
  return total;
}

template <typename T, typename P, typename acc_t, bool kWeight, bool kBias>
void layer_norm_fwd_rows(const T* x, const P* weight, const P* bias, T* y, acc_t* mean_out,
                         acc_t* rstd_out, int64_t M, int64_t N, acc_t eps) {
  using IO = VecIO<T, acc_t>;
  using ParamIO = VecIO<P, acc_t>;
  using Vec = Vectorized<acc_t>;
  static_assert(ParamIO::kWidth == IO::kWidth);
  const bool stream = use_streaming_stores(M * N * sizeof(T));
  at::parallel_for(0, M, row_grain(N), [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const T* xr = x + row * N;
      T* yr = y + row * N;
      const acc_t shift = N > 0 ? static_cast<acc_t>(xr[0]) : acc_t(0);
      const WelfordState<acc_t> stats = row_statistics<T, acc_t>(xr, N, shift);
      const acc_t rstd = acc_t(1) / std::sqrt(stats.variance() + eps);
      mean_out[row] = shift + stats.mean;
      rstd_out[row] = rstd;

      // The row was just read: this second sweep is served from cache. x - shift is exact
      // for the values near shift where it matters, so y keeps the precision of the
      // shifted statistics.
      const Vec vshift(shift), vmean(stats.mean), vrstd(rstd);
      const int64_t vec_end = N - N % IO::kWidth;
      const bool stream_row = stream && is_stream_aligned(yr);
      for (int64_t i = 0; i < vec_end; i += IO::kWidth) {
        Vec lo, hi;
        IO::load(xr + i, lo, hi);
        lo = (lo - vshift - vmean) * vrstd;
        hi = (hi - vshift - vmean) * vrstd;
        if constexpr (kWeight) {
          Vec wlo, whi;
          ParamIO::load(weight + i, wlo, whi);
          lo = lo * wlo;
          hi = hi * whi;
        }
        if constexpr (kBias) {
          Vec blo, bhi;
          ParamIO::load(bias + i, blo, bhi);
          lo = lo + blo;
          hi = hi + bhi;
        }
        if (stream_row) {
          IO::store_streaming(yr + i, lo, hi);
        } else {
          IO::store(yr + i, lo, hi);
        }
      }
      for (int64_t i = vec_end; i < N; ++i) {
        acc_t v = (static_cast<acc_t>(xr[i]) - shift - stats.mean) * rstd;
        if constexpr (kWeight) v *= static_cast<acc_t>(weight[i]);
        if constexpr (kBias) v += static_cast<acc_t>(bias[i]);
        yr[i] = static_cast<T>(v);
      }
    }
    if (stream) streaming_fence();
  });
}

// Per-row sums of the backward: mean(g) and mean(g * xhat), with
//   xhat = (x - mean) * rstd,  g = dy * weight.
template <typename T, typename P, typename acc_t, bool kWeight>
std::pair<acc_t, acc_t> row_grad_means(const T* dy, const T* x, acc_t mean, acc_t rstd,
                                       const P* weight, int64_t N) {
  using IO = VecIO<T, acc_t>;
  using ParamIO = VecIO<P, acc_t>;
  using Vec = Vectorized<acc_t>;
  constexpr int64_t W = IO::kWidth;
  static_assert(ParamIO::kWidth == W);
  const int64_t vec_end = N - N % W;
  const Vec vmean(mean), vrstd(rstd);
  Vec sum_g_lo(0), sum_g_hi(0), sum_gx_lo(0), sum_gx_hi(0);
  for (int64_t i = 0; i < vec_end; i += W) {
    Vec dlo, dhi, xlo, xhi;
    IO::load(dy + i, dlo, dhi);
    IO::load(x + i, xlo, xhi);
    if constexpr (kWeight) {
      Vec wlo, whi;
      ParamIO::load(weight + i, wlo, whi);
      dlo = dlo * wlo;
      dhi = dhi * whi;
    }
    sum_g_lo = sum_g_lo + dlo;
    sum_g_hi = sum_g_hi + dhi;
    sum_gx_lo = at::vec::fmadd(dlo, (xlo - vmean) * vrstd, sum_gx_lo);
    sum_gx_hi = at::vec::fmadd(dhi, (xhi - vmean) * vrstd, sum_gx_hi);
  }
  acc_t sum_g = lane_sum(sum_g_lo + sum_g_hi);
  acc_t sum_gx = lane_sum(sum_gx_lo + sum_gx_hi);
  for (int64_t i = vec_end; i < N; ++i) {
    acc_t g = static_cast<acc_t>(dy[i]);
    if constexpr (kWeight) g *= static_cast<acc_t>(weight[i]);
    sum_g += g;
    sum_gx += g * (static_cast<acc_t>(x[i]) - mean) * rstd;
  }
  return {sum_g / N, sum_gx / N};
}

// Rows processed together in the second sweep, so that the dweight/dbias partials are
// read and written once per tile instead of once per row.
constexpr int64_t kRowTile = 4;

// dx = rstd * (g - mean(g) - xhat * mean(g * xhat)) for `rows` (<= kRowTile) consecutive
// rows, and (kParamGrads) their dy * xhat and dy added to the partials. The rows were just
// read by row_grad_means: this sweep is served from cache.
template <typename T, typename P, typename acc_t, bool kWeight, bool kParamGrads>
void layer_norm_bwd_tile(const T* dy, const T* x, const acc_t* mean, const acc_t* rstd,
                         const P* weight, T* dx, acc_t* dweight_part, acc_t* dbias_part,
                         int64_t rows, int64_t N) {
  using IO = VecIO<T, acc_t>;
  using ParamIO = VecIO<P, acc_t>;
  using AccIO = VecIO<acc_t, acc_t>;
  using Vec = Vectorized<acc_t>;
  constexpr int64_t W = IO::kWidth;
  static_assert(AccIO::kWidth == W);
  acc_t mean_g[kRowTile], mean_gx[kRowTile];
  for (int64_t r = 0; r < rows; ++r) {
    std::tie(mean_g[r], mean_gx[r]) = row_grad_means<T, P, acc_t, kWeight>(
        dy + r * N, x + r * N, mean[r], rstd[r], weight, N);
  }
  const int64_t vec_end = N - N % W;
  for (int64_t i = 0; i < vec_end; i += W) {
    Vec wlo(1), whi(1), pw_lo(0), pw_hi(0), pb_lo(0), pb_hi(0);
    if constexpr (kWeight) ParamIO::load(weight + i, wlo, whi);
    if constexpr (kParamGrads) {
      AccIO::load(dweight_part + i, pw_lo, pw_hi);
      AccIO::load(dbias_part + i, pb_lo, pb_hi);
    }
    for (int64_t r = 0; r < rows; ++r) {
      const Vec vmean(mean[r]), vrstd(rstd[r]), vmean_g(mean_g[r]), vmean_gx(mean_gx[r]);
      Vec dlo, dhi, xlo, xhi;
      IO::load(dy + r * N + i, dlo, dhi);
      IO::load(x + r * N + i, xlo, xhi);
      xlo = (xlo - vmean) * vrstd;
      xhi = (xhi - vmean) * vrstd;
      const Vec glo = kWeight ? dlo * wlo : dlo, ghi = kWeight ? dhi * whi : dhi;
      IO::store(dx + r * N + i, vrstd * (glo - vmean_g - xlo * vmean_gx),
                vrstd * (ghi - vmean_g - xhi * vmean_gx));
      if constexpr (kParamGrads) {
        pw_lo = at::vec::fmadd(dlo, xlo, pw_lo);
        pw_hi = at::vec::fmadd(dhi, xhi, pw_hi);
        pb_lo = pb_lo + dlo;
        pb_hi = pb_hi + dhi;
      }
    }
    if constexpr (kParamGrads) {
      AccIO::store(dweight_part + i, pw_lo, pw_hi);
      AccIO::store(dbias_part + i, pb_lo, pb_hi);
    }
  }
  for (int64_t i = vec_end; i < N; ++i) {
    const acc_t w = kWeight ? static_cast<acc_t>(weight[i]) : acc_t(1);
    for (int64_t r = 0; r < rows; ++r) {
      const acc_t d = static_cast<acc_t>(dy[r * N + i]);
      const acc_t xhat = (static_cast<acc_t>(x[r * N + i]) - mean[r]) * rstd[r];
      dx[r * N + i] = static_cast<T>(rstd[r] * (d * w - mean_g[r] - xhat * mean_gx[r]));
      if constexpr (kParamGrads) {
        dweight_part[i] += d * xhat;
        dbias_part[i] += d;
      }
    }
  }
}

// Row blocks whose dweight/dbias partials are summed at the end. The split depends on M
// and N only, never on the thread count, so the result is bitwise reproducible.
int64_t num_param_grad_blocks(int64_t M, int64_t N) {
  constexpr int64_t kMaxBlocks = 64;
  constexpr int64_t kPartialBudget = int64_t(1) << 22;  // elements per partial buffer
  const int64_t by_memory = std::max<int64_t>(1, kPartialBudget / std::max<int64_t>(N, 1));
  return std::max<int64_t>(1, std::min({M, kMaxBlocks, by_memory}));
}

// Sums the [blocks, N] partials over blocks, in block order, into out (dtype P).
template <typename acc_t, typename P>
void reduce_partials(const acc_t* partial, int64_t blocks, int64_t N, P* out) {
  at::parallel_for(0, N, 4096, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) {
      acc_t sum = 0;
      for (int64_t b = 0; b < blocks; ++b) sum += partial[b * N + j];
      out[j] = static_cast<P>(sum);
    }
  });
}

// Rows [begin, end) in tiles of kRowTile.
template <typename T, typename P, typename acc_t, bool kWeight, bool kParamGrads>
void layer_norm_bwd_row_range(const T* dy, const T* x, const acc_t* mean, const acc_t* rstd,
                              const P* weight, T* dx, acc_t* pw, acc_t* pb, int64_t begin,
                              int64_t end, int64_t N) {
  for (int64_t r = begin; r < end; r += kRowTile) {
    layer_norm_bwd_tile<T, P, acc_t, kWeight, kParamGrads>(
        dy + r * N, x + r * N, mean + r, rstd + r, weight, dx + r * N, pw, pb,
        std::min(kRowTile, end - r), N);
  }
}

template <typename T, typename P, typename acc_t, bool kWeight, bool kParamGrads>
void layer_norm_bwd_rows(const T* dy, const T* x, const acc_t* mean, const acc_t* rstd,
                         const P* weight, T* dx, acc_t* partial_w, acc_t* partial_b,
                         int64_t M, int64_t N, int64_t blocks) {
  if constexpr (!kParamGrads) {
    at::parallel_for(0, M, row_grain(N), [&](int64_t begin, int64_t end) {
      layer_norm_bwd_row_range<T, P, acc_t, kWeight, false>(dy, x, mean, rstd, weight, dx,
                                                            nullptr, nullptr, begin, end, N);
    });
    return;
  }
  const int64_t rows_per_block = (M + blocks - 1) / blocks;
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      acc_t* pw = partial_w + b * N;
      acc_t* pb = partial_b + b * N;
      std::fill(pw, pw + N, acc_t(0));
      std::fill(pb, pb + N, acc_t(0));
      const int64_t row_begin = std::min(M, b * rows_per_block);
      const int64_t row_end = std::min(M, row_begin + rows_per_block);
      layer_norm_bwd_row_range<T, P, acc_t, kWeight, true>(dy, x, mean, rstd, weight, dx, pw,
                                                           pb, row_begin, row_end, N);
    }
  });
}

template <typename P>
const P* data_or_null(const std::optional<at::Tensor>& t) {
  return t.has_value() && t->defined() ? t->const_data_ptr<P>() : nullptr;
}

bool present(const std::optional<at::Tensor>& t) { return t.has_value() && t->defined(); }

std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_fwd(
    const at::Tensor& input, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, double eps) {
  check_layer_norm_fwd_args(input, weight, bias, eps);
  const int64_t M = input.size(0), N = input.size(1);
  at::Tensor out = at::empty_like(input);
  const auto stats_options = input.options().dtype(stats_dtype(input.scalar_type()));
  at::Tensor mean = at::empty({M}, stats_options);
  at::Tensor rstd = at::empty({M}, stats_options);
  if (M == 0) return {out, mean, rstd};
  dispatch_input_and_param(
      input.scalar_type(), param_dtype(weight, bias, input),
      [&](auto input_tag, auto param_tag) {
        using T = decltype(input_tag);
        using P = decltype(param_tag);
        using acc_t = acc_type<T>;
        dispatch_bools(present(weight), present(bias), [&](auto has_w, auto has_b) {
          layer_norm_fwd_rows<T, P, acc_t, decltype(has_w)::value, decltype(has_b)::value>(
              input.const_data_ptr<T>(), data_or_null<P>(weight), data_or_null<P>(bias),
              out.mutable_data_ptr<T>(), mean.mutable_data_ptr<acc_t>(),
              rstd.mutable_data_ptr<acc_t>(), M, N, static_cast<acc_t>(eps));
        });
      });
  return {out, mean, rstd};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_bwd(
    const at::Tensor& grad_out, const at::Tensor& input, const at::Tensor& mean,
    const at::Tensor& rstd, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias) {
  check_layer_norm_bwd_args(grad_out, input, mean, rstd, weight, bias);
  const int64_t M = input.size(0), N = input.size(1);
  const bool param_grads = present(weight) || present(bias);
  at::Tensor grad_input = at::empty_like(input);
  at::Tensor grad_weight = present(weight) ? at::empty({N}, weight->options())
                                           : at::empty({0}, input.options());
  at::Tensor grad_bias =
      present(bias) ? at::empty({N}, bias->options()) : at::empty({0}, input.options());
  const auto acc_options = input.options().dtype(stats_dtype(input.scalar_type()));
  const int64_t blocks = param_grads ? num_param_grad_blocks(M, N) : 0;
  at::Tensor partial_w = at::empty({param_grads ? blocks : 0, N}, acc_options);
  at::Tensor partial_b = at::empty({param_grads ? blocks : 0, N}, acc_options);

  dispatch_input_and_param(
      input.scalar_type(), param_dtype(weight, bias, input),
      [&](auto input_tag, auto param_tag) {
        using T = decltype(input_tag);
        using P = decltype(param_tag);
        using acc_t = acc_type<T>;
        if (M > 0) {
          dispatch_bools(present(weight), param_grads, [&](auto has_w, auto grads) {
            layer_norm_bwd_rows<T, P, acc_t, decltype(has_w)::value, decltype(grads)::value>(
                grad_out.const_data_ptr<T>(), input.const_data_ptr<T>(),
                mean.const_data_ptr<acc_t>(), rstd.const_data_ptr<acc_t>(),
                data_or_null<P>(weight), grad_input.mutable_data_ptr<T>(),
                partial_w.mutable_data_ptr<acc_t>(), partial_b.mutable_data_ptr<acc_t>(), M,
                N, blocks);
          });
        }
        // With no rows, the partials are an empty sum: the gradients are zeros.
        if (present(weight)) {
          reduce_partials<acc_t, P>(partial_w.const_data_ptr<acc_t>(), M > 0 ? blocks : 0, N,
                                    grad_weight.mutable_data_ptr<P>());
        }
        if (present(bias)) {
          reduce_partials<acc_t, P>(partial_b.const_data_ptr<acc_t>(), M > 0 ? blocks : 0, N,
                                    grad_bias.mutable_data_ptr<P>());
        }
      });
  return {grad_input, grad_weight, grad_bias};
}

}  // namespace
}  // namespace fusednorm::cpu

TORCH_LIBRARY_IMPL(fusednorm, CPU, m) {
  m.impl("layer_norm_fwd", &fusednorm::cpu::layer_norm_fwd);
  m.impl("layer_norm_bwd", &fusednorm::cpu::layer_norm_bwd);
}
