#pragma once
// The dropout mask of the add ops (dropout_p): a counter-based generator, Philox4x32-10
// (Salmon et al., SC'11), the same function on the CPU and in the CUDA kernels, so that one
// (seed, offset) gives one mask on every device, and a backward regenerates the forward's
// mask from those two numbers instead of storing it.
//
// Element i of the [M, N] rows (i = row * N + column) is kept when output i % 4 of
// Philox4x32-10(counter = (i / 4 as 64 bits, counter_high(offset) as 64 bits), key = seed)
// is at least dropout_threshold(p); a kept element is multiplied by 1 / (1 - p) (and the
// row's rowscale), a dropped one by 0.

#include <c10/macros/Macros.h>

#include <cmath>
#include <cstdint>

namespace fusednorm::philox {

struct Block {
  uint32_t v[4];
};

C10_HOST_DEVICE inline uint32_t mulhilo(uint32_t a, uint32_t b, uint32_t* hi) {
#if defined(__CUDA_ARCH__)
  *hi = __umulhi(a, b);
  return a * b;
#else
  const uint64_t product = uint64_t(a) * uint64_t(b);
  *hi = uint32_t(product >> 32);
  return uint32_t(product);
#endif
}

// Philox4x32 with 10 rounds of the counter (c0..c3) under the key (k0, k1).
C10_HOST_DEVICE inline Block philox4x32_10(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3,
                                           uint32_t k0, uint32_t k1) {
  constexpr uint32_t kMul0 = 0xD2511F53u, kMul1 = 0xCD9E8D57u;
  constexpr uint32_t kWeyl0 = 0x9E3779B9u, kWeyl1 = 0xBB67AE85u;
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (int round = 0; round < 10; ++round) {
    uint32_t hi0, hi1;
    const uint32_t lo0 = mulhilo(kMul0, c0, &hi0);
    const uint32_t lo1 = mulhilo(kMul1, c2, &hi1);
    const uint32_t n0 = hi1 ^ c1 ^ k0, n2 = hi0 ^ c3 ^ k1;
    c0 = n0;
    c1 = lo1;
    c2 = n2;
    c3 = lo0;
    k0 += kWeyl0;
    k1 += kWeyl1;
  }
  return Block{{c0, c1, c2, c3}};
}

// The counter's high 64 bits of one call: its offset with the top bit flipped. PyTorch's own
// CUDA random ops draw Philox4x32-10 under the same key (the generator's seed) at counters
// (offset / 4 + draw, thread index) (curand_init's offset and subsequence); with the offset
// there as is, a call's draws would be those of thread `offset` of later torch random ops.
// Thread indices and CUDA offsets stay below 2^63, so no counter is shared.
C10_HOST_DEVICE inline uint64_t counter_high(uint64_t offset) {
  return offset ^ (uint64_t(1) << 63);
}

// The four draws of elements 4 * quad .. 4 * quad + 3 of one call (seed, offset).
C10_HOST_DEVICE inline Block draws(uint64_t seed, uint64_t offset, uint64_t quad) {
  const uint64_t high = counter_high(offset);
  return philox4x32_10(uint32_t(quad), uint32_t(quad >> 32), uint32_t(high),
                       uint32_t(high >> 32), uint32_t(seed), uint32_t(seed >> 32));
}

// An element is kept when its draw (uniform on [0, 2^32)) is >= the threshold: p * 2^32
// rounded to the nearest integer, in [0, 2^32] (p = 0 keeps all, p = 1 none).
inline uint64_t dropout_threshold(double p) {
  return static_cast<uint64_t>(std::nearbyint(p * 4294967296.0));
}

C10_HOST_DEVICE inline bool keeps(uint32_t draw, uint64_t threshold) {
  return uint64_t(draw) >= threshold;
}

// What a kept element is multiplied by (before its row's rowscale): 1 / (1 - p), 0 for p = 1.
inline double keep_scale(double p) {
  return p < 1.0 ? 1.0 / (1.0 - p) : 0.0;
}

// One call's mask, as the kernels take it: the generator's (seed, offset), the threshold,
// and the scale of a kept element. threshold 0 (p = 0): every element kept, no draws.
struct Dropout {
  uint64_t seed = 0, offset = 0;
  uint64_t threshold = 0;
  double scale = 1.0;

  C10_HOST_DEVICE bool active() const {
    return threshold != 0;
  }
};

}  // namespace fusednorm::philox
