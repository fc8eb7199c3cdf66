#pragma once
// Loads and stores between memory of dtype T and registers of the accumulation type
// (float for float/half/bfloat16, double for double), kWidth elements at a time as two
// at::vec::Vectorized<acc_t> registers. half/bfloat16 are widened on load and rounded
// once on store.

#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <type_traits>

namespace fusednorm::cpu {

template <typename T>
using acc_type = std::conditional_t<std::is_same_v<T, double>, double, float>;

// Primary template: a reduced-precision T (Half, BFloat16) widened to float.
template <typename T, typename acc_t>
struct VecIO {
  static_assert(std::is_same_v<acc_t, float>, "reduced types accumulate in float");
  using Vec = at::vec::Vectorized<float>;
  static constexpr int64_t kWidth = at::vec::Vectorized<T>::size();
  static_assert(kWidth == 2 * Vec::size(), "one Vectorized<T> widens to two float vectors");

  static inline void load(const T* p, Vec& lo, Vec& hi) {
    std::tie(lo, hi) = at::vec::convert_to_float<T>(at::vec::Vectorized<T>::loadu(p));
  }
  static inline void store(T* p, const Vec& lo, const Vec& hi) {
    at::vec::convert_from_float<T>(lo, hi).store(p);
  }
};

// Same type in memory and registers: two plain vector loads.
template <typename acc_t>
struct VecIO<acc_t, acc_t> {
  using Vec = at::vec::Vectorized<acc_t>;
  static constexpr int64_t kWidth = 2 * Vec::size();

  static inline void load(const acc_t* p, Vec& lo, Vec& hi) {
    lo = Vec::loadu(p);
    hi = Vec::loadu(p + Vec::size());
  }
  static inline void store(acc_t* p, const Vec& lo, const Vec& hi) {
    lo.store(p);
    hi.store(p + Vec::size());
  }
};

// Sum of all lanes, added in a fixed order.
template <typename acc_t>
inline acc_t lane_sum(const at::vec::Vectorized<acc_t>& v) {
  return at::vec::vec_reduce_all<acc_t>([](auto a, auto b) { return a + b; }, v);
}

}  // namespace fusednorm::cpu
