#pragma once
// GELU and its derivative, exact (erf) and tanh-approximated as torch.nn.GELU, for one
// value in the accumulation type (float, or double for double inputs). Shared by the CPU
// kernels' scalar tails and the CUDA kernels.
//
//   exact: gelu(x)  = x * Phi(x),            Phi(x) = 0.5 * (1 + erf(x / sqrt(2)))
//          gelu'(x) = Phi(x) + x * phi(x),   phi(x) = exp(-x^2 / 2) / sqrt(2 pi)
//   tanh:  gelu(x)  = 0.5 * x * (1 + t),     t = tanh(sqrt(2/pi) * (x + 0.044715 x^3))
//          gelu'(x) = 0.5 * (1 + t) + 0.5 * x * (1 - t^2) * sqrt(2/pi) * (1 + 3 * 0.044715 x^2)

#include <c10/macros/Macros.h>

#include <cmath>
#include <type_traits>

namespace fusednorm {

enum class GeluKind { kExact, kTanh };

namespace math {
// The float overload for float and the double one for double, on host and device: CUDA's
// global overloads in device code, std:: on the host (where ::erf(float) would widen).
#if defined(__CUDA_ARCH__)
template <typename T> C10_DEVICE inline T erf(T x) { return ::erf(x); }
template <typename T> C10_DEVICE inline T tanh(T x) { return ::tanh(x); }
template <typename T> C10_DEVICE inline T exp(T x) { return ::exp(x); }
#else
template <typename T> inline T erf(T x) { return std::erf(x); }
template <typename T> inline T tanh(T x) { return std::tanh(x); }
template <typename T> inline T exp(T x) { return std::exp(x); }
#endif
}  // namespace math

template <typename acc_t>
struct GeluConstants {
  static constexpr acc_t kSqrt1_2 = acc_t(0.70710678118654752440);      // 1 / sqrt(2)
  static constexpr acc_t kInvSqrt2Pi = acc_t(0.39894228040143267794);   // 1 / sqrt(2 pi)
  static constexpr acc_t kSqrt2OverPi = acc_t(0.79788456080286535588);  // sqrt(2 / pi)
  static constexpr acc_t kCubic = acc_t(0.044715);
};

// gelu(x) and gelu'(x) together: the backward needs both and they share erf / tanh.
template <typename acc_t>
struct GeluAndGrad {
  acc_t value;
  acc_t grad;
};

template <GeluKind kind, typename acc_t>
C10_HOST_DEVICE inline acc_t gelu(acc_t x) {
  using C = GeluConstants<acc_t>;
  if constexpr (kind == GeluKind::kExact) {
    return x * acc_t(0.5) * (acc_t(1) + math::erf(x * C::kSqrt1_2));
  } else {
    const acc_t inner = C::kSqrt2OverPi * (x + C::kCubic * x * x * x);
    return acc_t(0.5) * x * (acc_t(1) + math::tanh(inner));
  }
}

template <GeluKind kind, typename acc_t>
C10_HOST_DEVICE inline GeluAndGrad<acc_t> gelu_and_grad(acc_t x) {
  using C = GeluConstants<acc_t>;
  if constexpr (kind == GeluKind::kExact) {
    const acc_t cdf = acc_t(0.5) * (acc_t(1) + math::erf(x * C::kSqrt1_2));
    const acc_t pdf = C::kInvSqrt2Pi * math::exp(acc_t(-0.5) * x * x);
    return {x * cdf, cdf + x * pdf};
  } else {
    const acc_t x2 = x * x;
    const acc_t t = math::tanh(C::kSqrt2OverPi * (x + C::kCubic * x2 * x));
    const acc_t dinner = C::kSqrt2OverPi * (acc_t(1) + acc_t(3) * C::kCubic * x2);
    const acc_t half_1pt = acc_t(0.5) * (acc_t(1) + t);
    return {x * half_1pt, half_1pt + acc_t(0.5) * x * (acc_t(1) - t * t) * dinner};
  }
}

// Host-side dispatch: calls fn(std::integral_constant<GeluKind, kind>{}) so that the GELU
// form becomes a template argument of the kernel.
template <typename Fn>
void dispatch_gelu_kind(GeluKind kind, Fn&& fn) {
  if (kind == GeluKind::kTanh) return fn(std::integral_constant<GeluKind, GeluKind::kTanh>{});
  return fn(std::integral_constant<GeluKind, GeluKind::kExact>{});
}

}  // namespace fusednorm
