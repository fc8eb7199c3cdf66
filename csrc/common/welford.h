#pragma once
// Welford's online mean/variance and Chan's pairwise merge, shared by the CPU and CUDA
// kernels. One state summarises `count` values; variance = m2 / count (biased, as LayerNorm).

#include <c10/macros/Macros.h>

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

}  // namespace fusednorm
