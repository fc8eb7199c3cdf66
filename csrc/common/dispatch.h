#pragma once
// dtype dispatch for the ops' kernels: an input dtype and a second dtype that is the
// input's, or float beside a half/bfloat16 input (the parameters: param_dtype_allowed, and
// the add ops' sum: sum_dtype_allowed, checks.h), so only those pairs are instantiated.

#include <ATen/Dispatch.h>

#include <type_traits>

namespace fusednorm {

template <typename T>
constexpr bool kIsReducedFloat =
    std::is_same_v<T, c10::Half> || std::is_same_v<T, c10::BFloat16>;

// Calls fn(scalar_t{}, second_t{}) with the C++ types of the input dtype and the second.
template <typename Fn>
void dispatch_dtype_pair(at::ScalarType input, at::ScalarType second, Fn&& fn) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, input, "fusednorm", [&] {
    if constexpr (kIsReducedFloat<scalar_t>) {
      if (second == at::kFloat) return fn(scalar_t{}, float{});
    }
    return fn(scalar_t{}, scalar_t{});
  });
}

// Calls fn(std::bool_constant<a>{}): a runtime flag as a compile-time constant.
template <typename Fn>
void dispatch_bool(bool a, Fn&& fn) {
  if (a) return fn(std::true_type{});
  return fn(std::false_type{});
}

// Calls fn(std::bool_constant<a>{}, std::bool_constant<b>{}) so that two runtime flags
// become compile-time constants of the kernel (no per-element branches).
template <typename Fn>
void dispatch_bools(bool a, bool b, Fn&& fn) {
  if (a) {
    if (b) return fn(std::true_type{}, std::true_type{});
    return fn(std::true_type{}, std::false_type{});
  }
  if (b) return fn(std::false_type{}, std::true_type{});
  return fn(std::false_type{}, std::false_type{});
}

}  // namespace fusednorm
