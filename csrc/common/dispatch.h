#pragma once
// dtype dispatch for ops that take an input and optional parameters (weight, bias).
// Parameters have the input's dtype, or float for a half/bfloat16 input
// (param_dtype_allowed, checks.h), so only those pairs are instantiated.

#include <ATen/Dispatch.h>

#include <type_traits>

namespace fusednorm {

template <typename T>
constexpr bool kIsReducedFloat =
    std::is_same_v<T, c10::Half> || std::is_same_v<T, c10::BFloat16>;

// Calls fn(scalar_t{}, param_t{}) with the C++ types of the input and parameter dtypes.
template <typename Fn>
void dispatch_input_and_param(at::ScalarType input, at::ScalarType param, Fn&& fn) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, input, "fusednorm", [&] {
    if constexpr (kIsReducedFloat<scalar_t>) {
      if (param == at::kFloat) return fn(scalar_t{}, float{});
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
