// What the emulation programs (norm_emulated.cpp, gelu_ffn_emulated.cpp) share to check
// kernel outputs: T's rounding, device buffers made from host values, and an element-wise
// comparison against a float64 reference with a bound per element.
#pragma once

#include <cuda_runtime.h>  // the emulation's (tests/emulation/include)

#include <cmath>
#include <cstdint>
#include <iomanip>
#include <limits>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

namespace emu_check {

using emu::Buffer;

template <typename T>
constexpr double unit_roundoff() {
  if constexpr (std::is_same_v<T, c10::BFloat16>) return 1.0 / 256;
  if constexpr (std::is_same_v<T, c10::Half>) return 1.0 / 2048;
  if constexpr (std::is_same_v<T, float>) return 1.0 / (1 << 24);
  return 1.0 / 9007199254740992.0;
}

// Spacing of T's subnormals: the absolute rounding error of a tiny output.
template <typename T>
double subnormal_step() {
  return double(std::numeric_limits<T>::denorm_min());
}

// The kernels' accumulator: float, double for double.
template <typename T>
using acc_of = std::conditional_t<std::is_same_v<T, double>, double, float>;

// Accumulation error allowance: 512 units of the accumulator's roundoff (far below any
// logic error, which is of the order of the values themselves).
template <typename T>
constexpr double acc_tolerance() {
  return 512 * unit_roundoff<acc_of<T>>();
}

// A buffer of n values of T, starting `misalign` bytes past a 256-byte boundary, from
// `values` (rounded to T).
template <typename T>
Buffer upload(const std::vector<double>& values, int misalign) {
  Buffer b = Buffer::make(values.size() * sizeof(T), std::size_t(misalign));
  for (std::size_t i = 0; i < values.size(); ++i) b.as<T>()[i] = static_cast<T>(values[i]);
  return b;
}

template <typename T>
std::vector<double> rounded(std::vector<double> v) {
  for (double& x : v) x = double(static_cast<T>(x));
  return v;
}

template <typename T>
double value_of(const Buffer& b, std::size_t i) {
  return double(b.as<T>()[i]);
}

// Counts elements of got (as T) beyond bound(i) of ref; fills `why` with the first. A NaN in
// ref asks for a NaN of positive sign, the kernels' (an unwritten element is poisoned with
// 0xff bytes, a negative NaN, which fails).
template <typename T, typename Bound>
int64_t compare(const char* what, const Buffer& got, const std::vector<double>& ref, Bound bound,
                std::string& why) {
  int64_t bad = 0;
  for (std::size_t i = 0; i < ref.size(); ++i) {
    const double g = value_of<T>(got, i);
    const double err = std::abs(g - ref[i]);
    const bool off = std::isnan(ref[i]) ? !(std::isnan(g) && !std::signbit(g)) : !(err <= bound(i));
    if (off) {  // NaN (an unwritten, poisoned element) fails too
      if (bad == 0) {
        std::ostringstream s;
        s << std::setprecision(17) << what << "[" << i << "] = " << g << ", reference " << ref[i]
          << ", bound " << bound(i);
        why = s.str();
      }
      ++bad;
    }
  }
  if (bad > 0) why += " (" + std::to_string(bad) + " of " + std::to_string(ref.size()) + " beyond)";
  return bad;
}

}  // namespace emu_check
