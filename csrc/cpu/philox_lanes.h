#pragma once
// The CPU dropout's draws: common/philox.h's Philox4x32-10 of consecutive counters, bit for
// bit philox::draws, many counters at a time. The counters run in the 32-bit lanes of a
// vector register (sixteen in an AVX-512 build, eight with AVX2), four registers per step so
// that the multiplies of one overlap the others' latency: _mm*_mul_epu32 gives the 32 x 32
// -> 64-bit products of the even lanes, and of the odd lanes shifted down. Other builds run
// the counters one after another.

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

#if defined(CPU_CAPABILITY_AVX512)
struct Lanes {  // sixteen counters in a 512-bit register
  using Reg = __m512i;
  static constexpr int64_t kCount = 16;
  static Reg broadcast(uint32_t v) { return _mm512_set1_epi32(static_cast<int>(v)); }
  static Reg xor3(Reg a, Reg b, Reg c) { return _mm512_ternarylogic_epi32(a, b, c, 0x96); }
  // hi and lo of the lanes' 32 x 32 -> 64-bit products c * k (k broadcast).
  static Reg mulhilo(Reg c, Reg k, Reg* lo) {
    const Reg even = _mm512_mul_epu32(c, k);
    const Reg odd = _mm512_mul_epu32(_mm512_srli_epi64(c, 32), k);
    *lo = _mm512_mask_blend_epi32(0xAAAA, even, _mm512_slli_epi64(odd, 32));
    return _mm512_mask_blend_epi32(0xAAAA, _mm512_srli_epi64(even, 32), odd);
  }
  // The counter words (c0, c1) of quads quad .. quad + 15: the low word's carry into c1.
  static void counters(uint64_t quad, Reg* c0, Reg* c1) {
    const Reg low = broadcast(uint32_t(quad)), high = broadcast(uint32_t(quad >> 32));
    *c0 = _mm512_add_epi32(
        low, _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
    const __mmask16 wrapped = _mm512_cmplt_epu32_mask(*c0, low);
    *c1 = _mm512_mask_add_epi32(high, wrapped, high, broadcast(1));
  }
  // Lanes (quads) x words -> each quad's four words in a row, quad 0 first.
  static void store(Reg c0, Reg c1, Reg c2, Reg c3, uint32_t* out) {
    const Reg t0 = _mm512_unpacklo_epi32(c0, c1), t1 = _mm512_unpackhi_epi32(c0, c1);
    const Reg t2 = _mm512_unpacklo_epi32(c2, c3), t3 = _mm512_unpackhi_epi32(c2, c3);
    // Per 128-bit block b: q(4b), q(4b + 1), q(4b + 2), q(4b + 3).
    const Reg q0 = _mm512_unpacklo_epi64(t0, t2), q1 = _mm512_unpackhi_epi64(t0, t2);
    const Reg q2 = _mm512_unpacklo_epi64(t1, t3), q3 = _mm512_unpackhi_epi64(t1, t3);
    const Reg v0 = _mm512_shuffle_i32x4(q0, q1, 0x88), v1 = _mm512_shuffle_i32x4(q0, q1, 0xDD);
    const Reg v2 = _mm512_shuffle_i32x4(q2, q3, 0x88), v3 = _mm512_shuffle_i32x4(q2, q3, 0xDD);
    _mm512_storeu_si512(out, _mm512_shuffle_i32x4(v0, v2, 0x88));
    _mm512_storeu_si512(out + 16, _mm512_shuffle_i32x4(v1, v3, 0x88));
    _mm512_storeu_si512(out + 32, _mm512_shuffle_i32x4(v0, v2, 0xDD));
    _mm512_storeu_si512(out + 48, _mm512_shuffle_i32x4(v1, v3, 0xDD));
  }
};
#else
struct Lanes {  // eight counters in a 256-bit register
  using Reg = __m256i;
  static constexpr int64_t kCount = 8;
  static Reg broadcast(uint32_t v) { return _mm256_set1_epi32(static_cast<int>(v)); }
  static Reg xor3(Reg a, Reg b, Reg c) { return _mm256_xor_si256(_mm256_xor_si256(a, b), c); }
  static Reg mulhilo(Reg c, Reg k, Reg* lo) {
    const Reg even = _mm256_mul_epu32(c, k);
    const Reg odd = _mm256_mul_epu32(_mm256_srli_epi64(c, 32), k);
    *lo = _mm256_blend_epi32(even, _mm256_slli_epi64(odd, 32), 0xAA);
    return _mm256_blend_epi32(_mm256_srli_epi64(even, 32), odd, 0xAA);
  }
  static void counters(uint64_t quad, Reg* c0, Reg* c1) {
    const Reg low = broadcast(uint32_t(quad));
    *c0 = _mm256_add_epi32(low, _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    const Reg sign = broadcast(0x80000000u);  // unsigned order as signed
    const Reg wrapped =
        _mm256_cmpgt_epi32(_mm256_xor_si256(low, sign), _mm256_xor_si256(*c0, sign));
    *c1 = _mm256_sub_epi32(broadcast(uint32_t(quad >> 32)), wrapped);
  }
  static void store(Reg c0, Reg c1, Reg c2, Reg c3, uint32_t* out) {
    const Reg t0 = _mm256_unpacklo_epi32(c0, c1), t1 = _mm256_unpackhi_epi32(c0, c1);
    const Reg t2 = _mm256_unpacklo_epi32(c2, c3), t3 = _mm256_unpackhi_epi32(c2, c3);
    // Per 128-bit half h: q(h * 4 + 0 .. 3) across the four registers.
    const Reg q04 = _mm256_unpacklo_epi64(t0, t2), q15 = _mm256_unpackhi_epi64(t0, t2);
    const Reg q26 = _mm256_unpacklo_epi64(t1, t3), q37 = _mm256_unpackhi_epi64(t1, t3);
    Reg* o = reinterpret_cast<Reg*>(out);
    _mm256_storeu_si256(o, _mm256_permute2x128_si256(q04, q15, 0x20));
    _mm256_storeu_si256(o + 1, _mm256_permute2x128_si256(q26, q37, 0x20));
    _mm256_storeu_si256(o + 2, _mm256_permute2x128_si256(q04, q15, 0x31));
    _mm256_storeu_si256(o + 3, _mm256_permute2x128_si256(q26, q37, 0x31));
  }
};
#endif

constexpr int64_t kLanes = Lanes::kCount;
constexpr int kMaxRegisters = 4;

// The draws of quads quad .. quad + V * kLanes - 1 into out[0 .. 4 * V * kLanes), in element
// order.
template <int V>
inline void draws(uint64_t seed, uint64_t offset, uint64_t quad, uint32_t* out) {
  using Reg = Lanes::Reg;
  const Reg mul0 = Lanes::broadcast(0xD2511F53u), mul1 = Lanes::broadcast(0xCD9E8D57u);
  Reg c0[V], c1[V], c2[V], c3[V];
  const uint64_t high = philox::counter_high(offset);
  for (int v = 0; v < V; ++v) {
    Lanes::counters(quad + uint64_t(v) * kLanes, &c0[v], &c1[v]);
    c2[v] = Lanes::broadcast(uint32_t(high));
    c3[v] = Lanes::broadcast(uint32_t(high >> 32));
  }
  uint32_t k0 = uint32_t(seed), k1 = uint32_t(seed >> 32);
  for (int round = 0; round < 10; ++round) {
    const Reg key0 = Lanes::broadcast(k0), key1 = Lanes::broadcast(k1);
    for (int v = 0; v < V; ++v) {
      Reg lo0, lo1;
      const Reg hi0 = Lanes::mulhilo(c0[v], mul0, &lo0);
      const Reg hi1 = Lanes::mulhilo(c2[v], mul1, &lo1);
      c0[v] = Lanes::xor3(hi1, c1[v], key0);
      c2[v] = Lanes::xor3(hi0, c3[v], key1);
      c1[v] = lo1;
      c3[v] = lo0;
    }
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  for (int v = 0; v < V; ++v) Lanes::store(c0[v], c1[v], c2[v], c3[v], out + 4 * kLanes * v);
}

}  // namespace philox_lanes

#endif

// out[4 * k + l] = philox::draws(seed, offset, quad + k).v[l] for k in [0, count).
inline void philox_draws(uint64_t seed, uint64_t offset, uint64_t quad, int64_t count,
                         uint32_t* out) {
  int64_t k = 0;
#if defined(FUSEDNORM_PHILOX_LANES)
  using philox_lanes::kLanes;
  using philox_lanes::kMaxRegisters;
  constexpr int64_t kStep = kMaxRegisters * kLanes;
  for (; k + kStep <= count; k += kStep) {
    philox_lanes::draws<kMaxRegisters>(seed, offset, quad + uint64_t(k), out + 4 * k);
  }
  if (k < count) {  // the last quads: as few registers as hold them, the lanes past count dropped
    alignas(64) uint32_t rest[4 * kStep];
    const uint64_t at = quad + uint64_t(k);
    switch ((count - k + kLanes - 1) / kLanes) {
      case 1: philox_lanes::draws<1>(seed, offset, at, rest); break;
      case 2: philox_lanes::draws<2>(seed, offset, at, rest); break;
      default: philox_lanes::draws<kMaxRegisters>(seed, offset, at, rest); break;
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
