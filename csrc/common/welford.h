#pragma once
// Welford's online mean/variance and Chan's pairwise merge, shared by the CPU and CUDA
// kernels. One state summarises `count` values; variance = m2 / count (biased, as LayerNorm).
// Also the steps around it that both kernels take the same way: the shift the values are
// summarised around, the mean split into a nearest value and its rest, and which rows'
// backward corrects the saved mean's rounding.

#include <c10/macros/Macros.h>

#include <cstdint>

namespace fusednorm {

template <typename acc_t>
struct WelfordState {
  acc_t mean = acc_t(0);
  acc_t m2 = acc_t(0);
  acc_t count = acc_t(0);  // in acc_t so the merge needs no int->float conversion

  // Adds one value. Division per element: used only for tails and the general paths.
  C10_HOST_DEVICE inline void update(acc_t x) {
    count += acc_t(1);
    const acc_t delta = x - mean;
    mean += delta / count;
    m2 += delta * (x - mean);
  }

  // Chan et al.: combines two disjoint summaries exactly as if one had seen both inputs.
  C10_HOST_DEVICE inline void merge(const WelfordState& other) {
    if (other.count == acc_t(0)) return;
    if (count == acc_t(0)) {
      *this = other;
      return;
    }
    const acc_t total = count + other.count;
    const acc_t delta = other.mean - mean;
    const acc_t other_share = other.count / total;
    mean += delta * other_share;
    m2 += other.m2 + delta * delta * count * other_share;
    count = total;
  }

  // Biased variance; 0 for an empty or one-element summary.
  C10_HOST_DEVICE inline acc_t variance() const {
    return count > acc_t(0) ? m2 / count : acc_t(0);
  }
};

// The shift a LayerNorm row's statistics are taken around: the median of its first three
// values (the first alone in shorter rows). Any value near the bulk of the row keeps what
// Welford accumulates small (a row at 1e4 + noise); the first value alone failed where it
// was an outlier, as a feature far from the others is: every x - shift then lost 2^-24 of
// that distance (x[0] 1000 sigma from the rest, 768-4096 wide: outputs 2-4e-6 from float64
// where PyTorch's are 3-6e-8). The first three share the row's first cache line (or
// sector): a value from farther along would wait on memory before the sweep could start.
template <typename acc_t>
C10_HOST_DEVICE inline acc_t median_of_three(acc_t a, acc_t b, acc_t c) {
  const acc_t lo = a < b ? a : b, hi = a < b ? b : a;
  return c < lo ? lo : (c > hi ? hi : c);
}

// That shift for a row of N > 0 values, value_at(i) giving its i-th as acc_t (the CPU and
// CUDA kernels read their rows differently: with or without a residual, per chunk).
template <typename acc_t, typename ValueAt>
C10_HOST_DEVICE inline acc_t row_shift_of(int64_t N, ValueAt value_at) {
  const acc_t first = value_at(0);
  return N < 3 ? first : median_of_three(first, value_at(1), value_at(2));
}

// a + b as the nearest acc_t and the exact rest (Knuth's TwoSum: no branch on which is
// larger): a row's mean from its shift and the mean of the shifted values. Normalizing with
// ((x - nearest) - rest) keeps the bits of the shifted statistics that the rounded mean
// lost, and never subtracts the shift itself from x.
template <typename acc_t>
struct NearestAndRest {
  acc_t nearest;
  acc_t rest;
};

template <typename acc_t>
C10_HOST_DEVICE inline NearestAndRest<acc_t> nearest_and_rest(acc_t a, acc_t b) {
  const acc_t sum = a + b;
  const acc_t b_part = sum - a;
  return {sum, (a - (sum - b_part)) + (b - b_part)};
}

// Whether a LayerNorm backward corrects a row's xhat by their mean (kCentered: RMSNorm has
// no mean). The saved mean is a float, rounded: every xhat = (x - mean) * rstd of the row is
// off by up to 2^-24 * |mean| * rstd (and the CPU's float16/bfloat16 form's -mean * rstd
// rounds the same); in exact arithmetic the xhat of a row sum to zero, so their mean is
// that error, and subtracting it removes it. Rows within 16 sigma of zero are off by at most
// 2^-20 (PyTorch's backward is off by as much) and skip it: it costs the CPU backward of a
// row 2-10% (benchmarks.kernel_ab, 2 threads: float32 2%, bfloat16 6-7%, float16 10%).
template <bool kCentered, typename acc_t>
C10_HOST_DEVICE inline bool needs_mean_correction(acc_t mean, acc_t rstd) {
  const acc_t sigmas = mean * rstd;
  return kCentered && (sigmas > acc_t(16) || sigmas < acc_t(-16));
}

}  // namespace fusednorm
