#pragma once
// The CPU dropout's draws: common/philox.h's Philox4x32-10 of consecutive counters, bit for
// bit philox::draws, several counters at a time. With AVX2 (the AVX-512 build included) eight
// counters run in the 32-bit lanes of one register: _mm256_mul_epu32 gives the 32 x 32 ->
// 64-bit products of the even lanes, and of the odd ones shifted down; elsewhere the counters
// run one after another. (A 256-bit register and not a 512-bit one: the multiplies, which
// bound the rounds, issue at the same rate per lane either way, and the fills of a few
// quads waste fewer lanes.)

#include <cstdint>
#include <cstring>

#include "common/philox.h"

#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#define FUSEDNORM_PHILOX_LANES 1
#endif

namespace fusednorm::cpu {

#if defined(FUSEDNORM_PHILOX_LANES)

namespace philox_lanes {

constexpr int64_t kLanes = 8;

// hi and lo of the eight 32 x 32 -> 64-bit products c * k (k broadcast).
inline __m256i mulhilo(__m256i c, __m256i k, __m256i* lo) {
  const __m256i even = _mm256_mul_epu32(c, k);
  const __m256i odd = _mm256_mul_epu32(_mm256_srli_epi64(c, 32), k);
  *lo = _mm256_blend_epi32(even, _mm256_slli_epi64(odd, 32), 0xAA);
  return _mm256_blend_epi32(_mm256_srli_epi64(even, 32), odd, 0xAA);
}

// The counter words (c0, c1) of quads quad .. quad + 7: the low word's carry goes into c1.
inline void counters(uint64_t quad, __m256i* c0, __m256i* c1) {
  const __m256i low = _mm256_set1_epi32(static_cast<int>(uint32_t(quad)));
  *c0 = _mm256_add_epi32(low, _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  const __m256i sign = _mm256_set1_epi32(INT32_MIN);  // unsigned order as signed
  const __m256i wrapped =
      _mm256_cmpgt_epi32(_mm256_xor_si256(low, sign), _mm256_xor_si256(*c0, sign));
  *c1 = _mm256_sub_epi32(_mm256_set1_epi32(static_cast<int>(uint32_t(quad >> 32))), wrapped);
}

// The draws of quads quad .. quad + 8 * V - 1 into out[0 .. 32 * V) in element order. V
// independent registers per round keep the multipliers busy while one waits on another.
template <int V>
inline void draws(uint64_t seed, uint64_t offset, uint64_t quad, uint32_t* out) {
  const __m256i mul0 = _mm256_set1_epi32(static_cast<int>(0xD2511F53u));
  const __m256i mul1 = _mm256_set1_epi32(static_cast<int>(0xCD9E8D57u));
  __m256i c0[V], c1[V], c2[V], c3[V];
  for (int v = 0; v < V; ++v) {
    counters(quad + uint64_t(v) * kLanes, &c0[v], &c1[v]);
    c2[v] = _mm256_set1_epi32(static_cast<int>(uint32_t(offset)));
    c3[v] = _mm256_set1_epi32(static_cast<int>(uint32_t(offset >> 32)));
  }
  uint32_t k0 = uint32_t(seed), k1 = uint32_t(seed >> 32);
  for (int round = 0; round < 10; ++round) {
    const __m256i key0 = _mm256_set1_epi32(static_cast<int>(k0));
    const __m256i key1 = _mm256_set1_epi32(static_cast<int>(k1));
    for (int v = 0; v < V; ++v) {
      __m256i lo0, lo1;
      const __m256i hi0 = mulhilo(c0[v], mul0, &lo0);
      const __m256i hi1 = mulhilo(c2[v], mul1, &lo1);
      c0[v] = _mm256_xor_si256(_mm256_xor_si256(hi1, c1[v]), key0);
      c2[v] = _mm256_xor_si256(_mm256_xor_si256(hi0, c3[v]), key1);
      c1[v] = lo1;
      c3[v] = lo0;
    }
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  for (int v = 0; v < V; ++v) {  // lanes (quads) x words -> quads' words in a row
    const __m256i t0 = _mm256_unpacklo_epi32(c0[v], c1[v]);  // q0 w0 w1, q1 w0 w1 | q4, q5
    const __m256i t1 = _mm256_unpackhi_epi32(c0[v], c1[v]);  // q2, q3 | q6, q7
    const __m256i t2 = _mm256_unpacklo_epi32(c2[v], c3[v]);
    const __m256i t3 = _mm256_unpackhi_epi32(c2[v], c3[v]);
    const __m256i q04 = _mm256_unpacklo_epi64(t0, t2), q15 = _mm256_unpackhi_epi64(t0, t2);
    const __m256i q26 = _mm256_unpacklo_epi64(t1, t3), q37 = _mm256_unpackhi_epi64(t1, t3);
    __m256i* o = reinterpret_cast<__m256i*>(out + 32 * v);
    _mm256_storeu_si256(o, _mm256_permute2x128_si256(q04, q15, 0x20));
    _mm256_storeu_si256(o + 1, _mm256_permute2x128_si256(q26, q37, 0x20));
    _mm256_storeu_si256(o + 2, _mm256_permute2x128_si256(q04, q15, 0x31));
    _mm256_storeu_si256(o + 3, _mm256_permute2x128_si256(q26, q37, 0x31));
  }
}

}  // namespace philox_lanes

#endif

// out[4 * k + l] = philox::draws(seed, offset, quad + k).v[l] for k in [0, count).
inline void philox_draws(uint64_t seed, uint64_t offset, uint64_t quad, int64_t count,
                         uint32_t* out) {
  int64_t k = 0;
#if defined(FUSEDNORM_PHILOX_LANES)
  using philox_lanes::kLanes;
  for (; k + 2 * kLanes <= count; k += 2 * kLanes) {
    philox_lanes::draws<2>(seed, offset, quad + uint64_t(k), out + 4 * k);
  }
  if (k < count) {  // the last 1 .. 15 quads: one or two registers, the lanes past count dropped
    alignas(32) uint32_t rest[8 * kLanes];
    if (count - k > kLanes) {
      philox_lanes::draws<2>(seed, offset, quad + uint64_t(k), rest);
    } else {
      philox_lanes::draws<1>(seed, offset, quad + uint64_t(k), rest);
    }
    std::memcpy(out + 4 * k, rest, sizeof(uint32_t) * 4 * (count - k));
  }
#else
  for (; k < count; ++k) {
    const philox::Block b = philox::draws(seed, offset, quad + uint64_t(k));
    std::memcpy(out + 4 * k, b.v, sizeof(b.v));
  }
#endif
}

}  // namespace fusednorm::cpu
