// CPU entries of the norm family's forward ops (schemas in csrc/op_table.h): norm_fwd
// (LayerNorm or RMSNorm, optional residual, dropout and rowscale), layer_norm_apply and
// dropout_scale, on the kernels of cpu/norm_kernels.h. The backward is norm_bwd.cpp: two
// files, so the build compiles them side by side.

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <cstdint>
#include <deque>
#include <mutex>
#include <optional>
#include <unordered_map>

#include "cpu/norm_entry.h"

namespace fusednorm::cpu {
namespace {

using namespace entry;

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
  dispatch_dtype_pair(input.scalar_type(), sum_type, [&](auto input_tag, auto sum_tag) {
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

// dropout_scale: the mask of the forward whose rng_state is given, regenerated.
at::Tensor dropout_scale(const at::Tensor& grad, const OptTensor& rowscale,
                         const at::Tensor& rng_state, double dropout_p, at::ScalarType dtype) {
  check_dropout_scale_args(grad, rowscale, rng_state, dropout_p, dtype);
  const int64_t M = grad.size(0), N = grad.size(1);
  at::Tensor out = at::empty_like(grad, grad.options().dtype(dtype));
  dispatch_dtype_pair(dtype, grad.scalar_type(), [&](auto out_tag, auto grad_tag) {
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
  m.impl("layer_norm_apply", &fusednorm::cpu::layer_norm_apply);
  m.impl("dropout_scale", &fusednorm::cpu::dropout_scale);
}
