#pragma once
// What the CPU entries of the norm family (norm_fwd.cpp, norm_bwd.cpp) share: the
// parameters in the accumulation type, the compile-time dispatch of the dtypes and flags,
// and the dropout / rowscale multipliers of a call.

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <cstring>
#include <optional>
#include <tuple>
#include <type_traits>
#include <utility>

#include "common/checks.h"
#include "common/dispatch.h"
#include "cpu/norm_kernels.h"

namespace fusednorm::cpu::entry {

using OptTensor = std::optional<at::Tensor>;
using Tensor4 = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

template <typename P>
const P* data_or_null(const OptTensor& t) {
  return given(t) ? t->const_data_ptr<P>() : nullptr;
}

// weight and bias as the kernels read them, in the accumulation type: float16/bfloat16
// parameters are widened once per call (N values each) into this thread's scratch, so that
// no inner loop converts them. (Tensor::to made a tensor per parameter: with both, a
// bfloat16 call at 1 x 1000 took 4.7 us of host time against PyTorch's 3.5.)
template <typename acc_t>
struct ParamsInAcc {
  const acc_t* weight = nullptr;
  const acc_t* bias = nullptr;
  ScratchHandle own;  // the widened values, when they outgrow the kept scratch
};

template <typename T, typename acc_t>
ParamsInAcc<acc_t> params_in_acc_type(const OptTensor& weight, const OptTensor& bias,
                                      int64_t N) {
  auto widened = [](const OptTensor& p) {
    return given(p) && p->scalar_type() != c10::CppTypeToScalarType<acc_t>::value;
  };
  ParamsInAcc<acc_t> params;
  const int64_t count = (int64_t(widened(weight)) + int64_t(widened(bias))) * N;
  acc_t* scratch =
      count > 0 ? thread_scratch<acc_t, ScratchSlot::kParams>(count, params.own) : nullptr;
  auto read = [&](const OptTensor& p) -> const acc_t* {
    if (!given(p)) return nullptr;
    if (!widened(p)) return p->const_data_ptr<acc_t>();
    if constexpr (!std::is_same_v<T, acc_t>) {
      widen_row<T, acc_t>(p->const_data_ptr<T>(), scratch, N);
    }
    return std::exchange(scratch, scratch + N);
  };
  params.weight = read(weight);
  params.bias = read(bias);
  return params;
}

// Whether the N values of weight and bias (either may be null) are free of NaN and
// infinity; asked only where the answer changes the kernel (bfloat16 outputs:
// row_output_has_no_nan, tile_rounds_without_nan_mask).
template <typename T, typename acc_t>
bool params_finite(const acc_t* weight, const acc_t* bias, int64_t N) {
  if constexpr (!std::is_same_v<T, c10::BFloat16>) {
    return false;
  } else {
    for (const float* p : {weight, bias}) {
      if (p == nullptr) continue;
      // Exponent bits all ones: NaN or infinity. Integer tests, so the loop vectorizes.
      uint32_t non_finite = 0;
      for (int64_t i = 0; i < N; ++i) {
        uint32_t bits;
        std::memcpy(&bits, p + i, sizeof(bits));
        constexpr uint32_t kExponent = 0x7f800000u;
        non_finite |= static_cast<uint32_t>((bits & kExponent) == kExponent);
      }
      if (non_finite != 0) return false;
    }
    return true;
  }
}

template <typename T>
T* data_or_null(const at::Tensor& t) {
  return t.numel() > 0 ? t.mutable_data_ptr<T>() : nullptr;
}

// Calls fn(centered, has_weight, has_bias) as compile-time flags; RMSNorm has no bias, so
// that combination is never instantiated.
template <typename Fn>
void dispatch_norm_flags(bool centered, bool has_weight, bool has_bias, Fn&& fn) {
  dispatch_bools(has_weight, has_bias, [&](auto w, auto b) {
    if (centered) return fn(std::true_type{}, w, b);
    if constexpr (!decltype(b)::value) return fn(std::false_type{}, w, b);
  });
}

// The multipliers of a norm_fwd call with dropout_p and rowscale whose mask is keyed by
// (seed, offset) (unused when dropout_p is 0).
template <typename acc_t>
RowMultipliers<acc_t> row_multipliers(double dropout_p, const OptTensor& rowscale,
                                      uint64_t seed, uint64_t offset, int64_t N) {
  RowMultipliers<acc_t> m;
  m.N = N;
  m.rowscale = data_or_null<acc_t>(rowscale);
  if (dropout_p > 0.0) {
    m.dropout = {seed, offset, philox::dropout_threshold(dropout_p), philox::keep_scale(dropout_p)};
  }
  return m;
}

// The multipliers of the norm_fwd call whose dropout_p, rowscale and rng_state are given
// (its mask regenerated from rng_state's (seed, offset)).
template <typename acc_t>
RowMultipliers<acc_t> saved_multipliers(double dropout_p, const OptTensor& rowscale,
                                        const OptTensor& rng_state, int64_t N) {
  uint64_t seed = 0, offset = 0;
  if (dropout_p > 0.0) {
    const int64_t* state = rng_state->const_data_ptr<int64_t>();
    seed = static_cast<uint64_t>(state[0]);
    offset = static_cast<uint64_t>(state[1]);
  }
  return row_multipliers<acc_t>(dropout_p, rowscale, seed, offset, N);
}

// The backward's rows (norm_bwd_rows) for one (T, D) pair, its flags picked at run time.
// Defined in norm_bwd_rows.h and instantiated in norm_bwd_rows_<dy dtype>.cpp: files of their
// own, so that the build compiles the backward's many instantiations side by side.
template <typename T, typename D>
void norm_bwd_rows_for(const NormBwdArgs<T, acc_type<T>, D>& args, bool centered, bool weight,
                       bool param_grads, bool input_grad, acc_type<T>* partial_w,
                       acc_type<T>* partial_b, int64_t blocks);

}  // namespace fusednorm::cpu::entry
