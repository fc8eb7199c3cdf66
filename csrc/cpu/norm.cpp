// CPU entries of the norm family's backend ops (schemas in csrc/op_table.h): norm_fwd /
// norm_bwd (LayerNorm or RMSNorm, optional residual) and layer_norm_apply, all on the
// kernels of cpu/norm_kernels.h.

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <deque>
#include <mutex>
#include <optional>
#include <unordered_map>
#include <tuple>
#include <utility>

#include "common/checks.h"
#include "common/dispatch.h"
#include "cpu/norm_kernels.h"

namespace fusednorm::cpu {
namespace {

using OptTensor = std::optional<at::Tensor>;
using Tensor3 = std::tuple<at::Tensor, at::Tensor, at::Tensor>;
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

// Calls fn(T{}, S{}): the C++ type of the input and of the sum (the input's, or float beside
// a float16/bfloat16 input: sum_dtype_allowed).
template <typename Fn>
void dispatch_input_and_sum(at::ScalarType input, at::ScalarType sum, Fn&& fn) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, input, "fusednorm", [&] {
    if constexpr (kIsReducedFloat<scalar_t>) {
      if (sum == at::kFloat) return fn(scalar_t{}, float{});
    }
    return fn(scalar_t{}, scalar_t{});
  });
}

// The CPU generator has no Philox offset, so fusednorm keeps one for the default CPU
// generator's dropout calls, as the CUDA generator does for its own (0, 4, 8, ... after
// seeding), and makes it a function of the generator's state, as every torch random op's
// result is (so that torch.utils.checkpoint's recomputation, which restores the state,
// draws the forward's mask again): a freshly seeded state has offset 0; a state that a
// call left behind, that call's offset + 4 (remembered by the state's hash); any other
// state (other random ops ran since) an offset drawn from it. Every call draws the same
// amount and leaves a state that no seed and sequence of draws reaches (mt19937's left_ +
// next_ is 1 when freshly seeded, 625 after any draw; we leave 624, which the next block's
// regeneration ends), so a remembered state is never one a reseed or other draws led to.
// One seed and one sequence of fusednorm dropout calls give the masks that sequence gets
// on CUDA.
class OffsetMemory {
 public:
  std::optional<uint64_t> find(uint64_t state) const {
    const auto it = next_.find(state);
    return it == next_.end() ? std::nullopt : std::optional<uint64_t>(it->second);
  }

  void remember(uint64_t state, uint64_t offset) {
    if (next_.emplace(state, offset).second) order_.push_back(state);
    if (order_.size() > kCapacity) {
      next_.erase(order_.front());
      order_.pop_front();
    }
  }

 private:
  // The calls one training step may make before its checkpointed segments recompute.
  static constexpr size_t kCapacity = 4096;
  std::unordered_map<uint64_t, uint64_t> next_;
  std::deque<uint64_t> order_;
};

uint64_t state_hash(const at::mt19937_data_pod& s) {
  uint64_t h = 0xcbf29ce484222325ull;  // FNV-1a over 32-bit words
  const auto mix = [&h](uint64_t word) { h = (h ^ word) * 0x100000001b3ull; };
  mix(s.seed_);
  mix(static_cast<uint64_t>(s.left_));
  mix(s.seeded_);
  mix(s.next_);
  for (const uint32_t word : s.state_) mix(word);
  return h;
}

// The (seed, offset) of a dropout call on the default CPU generator (OffsetMemory's rule).
struct PhiloxKey {
  uint64_t seed, offset;
};

PhiloxKey draw_philox_key() {
  at::Generator generator = at::detail::getDefaultCPUGenerator();
  auto* impl = at::check_generator<at::CPUGeneratorImpl>(generator);
  std::lock_guard<std::mutex> lock(generator.mutex());
  static OffsetMemory memory;  // guarded by the default generator's mutex
  const at::mt19937_data_pod now = impl->engine().data();
  const uint64_t drawn = impl->random64();
  uint64_t offset = drawn & ~uint64_t(3);
  if (now.seeded_ && now.left_ == 1 && now.next_ == 0) {  // as mt19937's seeding leaves it
    offset = 0;
  } else if (const auto next = memory.find(state_hash(now))) {
    offset = *next;
  }
  at::mt19937 engine = impl->engine();
  at::mt19937_data_pod left = engine.data();
  if (left.left_ < 2) {  // the block's last value: regenerate first (left_ stays >= 1)
    impl->random();
    engine = impl->engine();
    left = engine.data();
  }
  left.left_ -= 1;
  engine.set_data(left);
  impl->set_engine(engine);
  memory.remember(state_hash(left), offset + 4);
  return {impl->current_seed(), offset};
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

// The multipliers of a norm_fwd call: its mask drawn (dropout_p > 0, its (seed, offset)
// written to rng_state) and its rowscale.
template <typename acc_t>
RowMultipliers<acc_t> forward_multipliers(double dropout_p, const OptTensor& rowscale,
                                          const OptTensor& rng_state, int64_t N) {
  PhiloxKey key{0, 0};
  if (dropout_p > 0.0) {
    key = draw_philox_key();
    int64_t* state = rng_state->mutable_data_ptr<int64_t>();
    state[0] = static_cast<int64_t>(key.seed);
    state[1] = static_cast<int64_t>(key.offset);
  }
  return row_multipliers<acc_t>(dropout_p, rowscale, key.seed, key.offset, N);
}

Tensor4 norm_fwd(const at::Tensor& input, const OptTensor& residual, const OptTensor& weight,
                 const OptTensor& bias, double eps, bool centered,
                 std::optional<at::ScalarType> sum_dtype, double dropout_p,
                 const OptTensor& rowscale, const OptTensor& rng_state) {
  check_norm_fwd_args(input, residual, weight, bias, eps, centered, sum_dtype, dropout_p,
                      rowscale, rng_state);
  const int64_t M = input.size(0), N = input.size(1);
  const at::ScalarType sum_type = sum_dtype.value_or(input.scalar_type());
  Tensor4 result;
  dispatch_input_and_sum(input.scalar_type(), sum_type, [&](auto input_tag, auto sum_tag) {
    using T = decltype(input_tag);
    using S = decltype(sum_tag);
    using acc_t = acc_type<T>;
    // Scratch before the outputs (see thread_scratch).
    const ParamsInAcc<acc_t> params = params_in_acc_type<T, acc_t>(weight, bias, N);
    at::Tensor out = at::empty_like(input);
    at::Tensor sum = given(residual) ? at::empty_like(input, input.options().dtype(sum_type))
                                     : at::empty({0}, input.options());
    const auto stats_options = input.options().dtype(stats_dtype(input.scalar_type()));
    at::Tensor mean = at::empty({centered ? M : 0}, stats_options);
    at::Tensor rstd = at::empty({M}, stats_options);
    result = {out, sum, mean, rstd};
    if (M == 0) return;
    // The residual is read as T or as S, whichever dtype it has.
    const bool residual_in_t = given(residual) && residual->scalar_type() == input.scalar_type();
    NormFwdArgs<T, acc_t, S> args{
        input.const_data_ptr<T>(),
        residual_in_t ? residual->const_data_ptr<T>() : nullptr,
        given(residual) && !residual_in_t ? residual->const_data_ptr<S>() : nullptr,
        params.weight,
        params.bias,
        out.mutable_data_ptr<T>(),
        data_or_null<S>(sum),
        data_or_null<acc_t>(mean),
        rstd.mutable_data_ptr<acc_t>(),
        M,
        N,
        static_cast<acc_t>(eps),
        params_finite<T, acc_t>(params.weight, params.bias, N)};
    if (dropout_p > 0.0 || given(rowscale)) {
      args.multipliers = forward_multipliers<acc_t>(dropout_p, rowscale, rng_state, N);
    }
    dispatch_norm_flags(centered, given(weight), given(bias), [&](auto c, auto w, auto b) {
      norm_fwd_rows<T, acc_t, decltype(c)::value, decltype(w)::value, decltype(b)::value>(args);
    });
  });
  return result;
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

Tensor4 norm_bwd(const at::Tensor& grad_out, const OptTensor& grad_sum, const at::Tensor& input,
                 const at::Tensor& mean, const at::Tensor& rstd, const OptTensor& weight,
                 const OptTensor& bias, bool centered, std::optional<at::ScalarType> x_dtype,
                 double dropout_p, const OptTensor& rowscale, const OptTensor& rng_state) {
  check_norm_bwd_args(grad_out, grad_sum, input, mean, rstd, weight, bias, centered);
  check_norm_bwd_input_grad(grad_out, input, x_dtype, dropout_p, rowscale, rng_state);
  const int64_t M = input.size(0), N = input.size(1);
  const bool param_grads = given(weight) || given(bias);
  const int64_t blocks = param_grads && M > 0 ? num_row_blocks(M, N) : 0;
  ScratchHandle own_partials;
  at::Tensor grad_input, grad_weight, grad_bias, grad_x;
  // T: the input's (and dx's) type; D: dy's, the norm output's (T's, or 16-bit beside a
  // float32 sum); the parameters follow D.
  const bool wide_input = input.scalar_type() != grad_out.scalar_type();
  dispatch_input_and_param(
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
            given(weight) ? at::empty({N}, weight->options()) : at::empty({0}, input.options());
        grad_bias = given(bias) ? at::empty({N}, bias->options()) : at::empty({0}, input.options());
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
          dispatch_bools(centered, given(weight), [&](auto c, auto w) {
            dispatch_bools(param_grads, x_dtype.has_value(), [&](auto grads, auto input_grad) {
              norm_bwd_rows<T, acc_t, decltype(c)::value, decltype(w)::value,
                            decltype(grads)::value, decltype(input_grad)::value>(
                  args, partial_w, partial_b, blocks);
            });
          });
        }
        // With no rows, the partials are an empty sum: the gradients are zeros.
        if (given(weight)) {
          sum_partials<acc_t, P>(partial_w, blocks, N,
                                 grad_weight.mutable_data_ptr<P>());
        }
        if (given(bias)) {
          sum_partials<acc_t, P>(partial_b, blocks, N,
                                 grad_bias.mutable_data_ptr<P>());
        }
        }
       });
      });
  return {grad_input, grad_weight, grad_bias, grad_x};
}

// dropout_scale: the mask of the forward whose rng_state is given, regenerated.
at::Tensor dropout_scale(const at::Tensor& grad, const OptTensor& rowscale,
                         const at::Tensor& rng_state, double dropout_p, at::ScalarType dtype) {
  check_dropout_scale_args(grad, rowscale, rng_state, dropout_p, dtype);
  const int64_t M = grad.size(0), N = grad.size(1);
  at::Tensor out = at::empty_like(grad, grad.options().dtype(dtype));
  dispatch_input_and_sum(dtype, grad.scalar_type(), [&](auto out_tag, auto grad_tag) {
    using O = decltype(out_tag);
    using G = decltype(grad_tag);
    using acc_t = acc_type<O>;
    const RowMultipliers<acc_t> m = saved_multipliers<acc_t>(
        dropout_p, rowscale, dropout_p > 0.0 ? OptTensor(rng_state) : std::nullopt, N);
    if (M > 0) dropout_scale_rows<G, O, acc_t>(grad.const_data_ptr<G>(),
                                               out.mutable_data_ptr<O>(), M, N, m);
  });
  return out;
}

at::Tensor layer_norm_apply(const at::Tensor& input, const at::Tensor& mean,
                            const at::Tensor& rstd, const OptTensor& weight,
                            const OptTensor& bias) {
  check_rows(input, "input");
  check_stats(mean, "mean", input);
  check_stats(rstd, "rstd", input);
  check_params(weight, bias, input);
  const int64_t M = input.size(0), N = input.size(1);
  at::Tensor out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, input.scalar_type(), "norm_apply", [&] {
    using T = scalar_t;
    using acc_t = acc_type<T>;
    // Scratch before the output (see thread_scratch).
    const ParamsInAcc<acc_t> params = params_in_acc_type<T, acc_t>(weight, bias, N);
    out = at::empty_like(input);
    if (out.numel() == 0) return;
    dispatch_bools(given(weight), given(bias), [&](auto w, auto b) {
      norm_apply_rows<T, acc_t, decltype(w)::value, decltype(b)::value>(
          input.const_data_ptr<T>(), mean.const_data_ptr<acc_t>(), rstd.const_data_ptr<acc_t>(),
          params.weight, params.bias, out.mutable_data_ptr<T>(), M, N);
    });
  });
  return out;
}

}  // namespace
}  // namespace fusednorm::cpu

TORCH_LIBRARY_IMPL(fusednorm, CPU, m) {
  m.impl("norm_fwd", &fusednorm::cpu::norm_fwd);
  m.impl("norm_bwd", &fusednorm::cpu::norm_bwd);
  m.impl("layer_norm_apply", &fusednorm::cpu::layer_norm_apply);
  m.impl("dropout_scale", &fusednorm::cpu::dropout_scale);
}
