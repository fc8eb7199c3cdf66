// The LayerNorm output from saved statistics, y = (x - mean) * rstd * weight + bias, on
// the CPU: rows in parallel, each row vectorized, in float (double for double). It
// normalizes x as layer_norm_bwd does ((x - mean) * rstd), so it agrees with
// layer_norm_fwd's output to rounding.

#include <ATen/Parallel.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <algorithm>

#include "common/checks.h"
#include "common/dispatch.h"
#include "cpu/vec_io.h"

namespace fusednorm::cpu {
namespace {

template <typename T, typename P, typename acc_t, bool kWeight, bool kBias>
void layer_norm_apply_rows(const T* x, const acc_t* mean, const acc_t* rstd, const P* weight,
                           const P* bias, T* y, int64_t M, int64_t N) {
  using IO = VecIO<T, acc_t>;
  using ParamIO = VecIO<P, acc_t>;
  using Vec = at::vec::Vectorized<acc_t>;
  static_assert(ParamIO::kWidth == IO::kWidth);
  const int64_t vec_end = N - N % IO::kWidth;
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(N, 1));
  at::parallel_for(0, M, grain, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const T* xr = x + row * N;
      T* yr = y + row * N;
      const Vec vmean(mean[row]), vrstd(rstd[row]);
      for (int64_t i = 0; i < vec_end; i += IO::kWidth) {
        Vec lo, hi;
        IO::load(xr + i, lo, hi);
        lo = (lo - vmean) * vrstd;
        hi = (hi - vmean) * vrstd;
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
        IO::store(yr + i, lo, hi);
      }
      for (int64_t i = vec_end; i < N; ++i) {
        acc_t v = (static_cast<acc_t>(xr[i]) - mean[row]) * rstd[row];
        if constexpr (kWeight) v *= static_cast<acc_t>(weight[i]);
        if constexpr (kBias) v += static_cast<acc_t>(bias[i]);
        yr[i] = static_cast<T>(v);
      }
    }
  });
}

bool given(const std::optional<at::Tensor>& t) { return t.has_value() && t->defined(); }

template <typename P>
const P* data_or_null(const std::optional<at::Tensor>& t) {
  return given(t) ? t->const_data_ptr<P>() : nullptr;
}

at::Tensor layer_norm_apply(const at::Tensor& input, const at::Tensor& mean,
                            const at::Tensor& rstd, const std::optional<at::Tensor>& weight,
                            const std::optional<at::Tensor>& bias) {
  check_rows(input, "input");
  check_stats(mean, "mean", input);
  check_stats(rstd, "rstd", input);
  check_params(weight, bias, input);
  const int64_t M = input.size(0), N = input.size(1);
  at::Tensor out = at::empty_like(input);
  if (out.numel() == 0) return out;
  dispatch_input_and_param(
      input.scalar_type(), param_dtype(weight, bias, input),
      [&](auto input_tag, auto param_tag) {
        using T = decltype(input_tag);
        using P = decltype(param_tag);
        using acc_t = acc_type<T>;
        dispatch_bools(given(weight), given(bias), [&](auto has_w, auto has_b) {
          layer_norm_apply_rows<T, P, acc_t, decltype(has_w)::value, decltype(has_b)::value>(
              input.const_data_ptr<T>(), mean.const_data_ptr<acc_t>(),
              rstd.const_data_ptr<acc_t>(), data_or_null<P>(weight), data_or_null<P>(bias),
              out.mutable_data_ptr<T>(), M, N);
        });
      });
  return out;
}

}  // namespace
}  // namespace fusednorm::cpu

TORCH_LIBRARY_IMPL(fusednorm, CPU, m) {
  m.impl("layer_norm_apply", &fusednorm::cpu::layer_norm_apply);
}
