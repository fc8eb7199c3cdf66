#pragma once
// Loads and stores between memory of dtype T and registers of the accumulation type
// (float for float/half/bfloat16, double for double), kWidth elements at a time as two
// at::vec::Vectorized<acc_t> registers. half/bfloat16 are widened on load and rounded
// once on store.

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#endif
#if defined(__linux__)
#include <sys/mman.h>
#include <unistd.h>
#endif

namespace fusednorm::cpu {

template <typename T>
using acc_type = std::conditional_t<std::is_same_v<T, double>, double, float>;

// Streaming (non-temporal) stores write a result that will not be read back soon straight
// to memory, without first fetching the destination line into cache: a third less memory
// traffic for a kernel that reads x once and writes y once. The address must be aligned to
// the vector size (is_stream_aligned); callers end a run of them with streaming_fence().
constexpr int64_t kStreamAlign = sizeof(at::vec::Vectorized<float>);

inline bool is_stream_aligned(const void* p) {
  return reinterpret_cast<std::uintptr_t>(p) % kStreamAlign == 0;
}

// Whether the pages of [p, p + bytes) are mapped in (probed at the first, middle and last
// page with mincore: three system calls, for outputs of megabytes). false where unknown.
inline bool pages_resident(const void* p, int64_t bytes) {
#if defined(__linux__)
  static const std::uintptr_t page = static_cast<std::uintptr_t>(sysconf(_SC_PAGESIZE));
  const std::uintptr_t start = reinterpret_cast<std::uintptr_t>(p);
  for (const int64_t offset : {int64_t(0), bytes / 2, bytes - 1}) {
    const std::uintptr_t addr = (start + offset) & ~(page - 1);
    unsigned char resident = 0;
    if (mincore(reinterpret_cast<void*>(addr), page, &resident) != 0 || !(resident & 1)) {
      return false;
    }
  }
  return true;
#else
  (void)p;
  (void)bytes;
  return false;
#endif
}

template <typename V>
inline void stream_bytes(void* p, const V& v) {
  static_assert(sizeof(V) == kStreamAlign);
#if defined(CPU_CAPABILITY_AVX512)
  _mm512_stream_si512(reinterpret_cast<__m512i*>(p), reinterpret_cast<const __m512i&>(v));
#elif defined(CPU_CAPABILITY_AVX2)
  _mm256_stream_si256(reinterpret_cast<__m256i*>(p), reinterpret_cast<const __m256i&>(v));
#else
  std::memcpy(p, &v, sizeof(V));
#endif
}

// Whether stream_bytes stores past the caches (x86 builds) or is a plain copy.
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
constexpr bool kNonTemporalStores = true;
#else
constexpr bool kNonTemporalStores = false;
#endif

constexpr int64_t kCacheLine = 64;

// Elements of T from p (aligned to T) up to the next cache-line boundary; 0 on a boundary.
template <typename T>
inline int64_t line_head(const T* p) {
  const int64_t misalignment = static_cast<int64_t>(reinterpret_cast<std::uintptr_t>(p) % kCacheLine);
  return (kCacheLine - misalignment) % kCacheLine / int64_t(sizeof(T));
}

// Streams the one cache line at dst (line-aligned) from src (any alignment).
C10_ALWAYS_INLINE void stream_line(char* dst, const char* src) {
  using V = at::vec::Vectorized<float>;
  for (int64_t k = 0; k < kCacheLine; k += int64_t(sizeof(V))) {
    stream_bytes(dst + k, V::loadu(src + k));
  }
}

// Copies `bytes` from src to dst with streaming stores for every whole cache line of dst and
// plain stores for the partial lines at either end, which neighbouring writes share. A
// streaming store that leaves its line partly unwritten is flushed as a partial line that
// memory has to merge: rows whose start or length is not a multiple of a line (N = 1000
// float32) lost more to that than streaming saved, so the outputs that do not stream from
// registers (line_head) are staged in cache and written out with this.
inline void stream_copy(void* dst, const void* src, int64_t bytes) {
  auto* d = static_cast<char*>(dst);
  const auto* s = static_cast<const char*>(src);
  const int64_t misalignment = static_cast<int64_t>(reinterpret_cast<std::uintptr_t>(d) % kCacheLine);
  int64_t done = std::min<int64_t>(bytes, (kCacheLine - misalignment) % kCacheLine);
  std::memcpy(d, s, done);
  for (; done + kCacheLine <= bytes; done += kCacheLine) stream_line(d + done, s + done);
  std::memcpy(d + done, s + done, bytes - done);
}

// Streams a staged tile of output rows (rows of row_bytes, contiguous in dst and laid out
// alike in stage) out while the kernel still writes it: as each row's columns become final
// from its start, written() streams the whole lines they complete, and finish() the rest
// (stream_copy: whole lines streamed, plain stores only for the tile's partial end lines).
// Copying the tile out in one go after the kernel wrote it (stream_copy alone) was a burst
// of streaming stores with nothing to overlap them (docs/perf-notes.md, "Code comments:
// StagedTileStream").
class StagedTileStream {
 public:
  static constexpr int64_t kMaxRows = 2;

  StagedTileStream(char* dst, const char* stage, int64_t row_bytes, int64_t rows)
      : dst_(dst), stage_(stage), row_bytes_(row_bytes), rows_(rows) {
    const auto misalignment = static_cast<int64_t>(reinterpret_cast<std::uintptr_t>(dst) % kCacheLine);
    for (int64_t r = 0; r < rows; ++r) {
      // The first line that starts in row r (or the tile's end): lines before it hold
      // bytes of the row before, not final until that row is.
      const int64_t begin = r * row_bytes;
      const int64_t first = begin + (kCacheLine - (misalignment + begin) % kCacheLine) % kCacheLine;
      start_[r] = done_[r] = std::min(first, rows * row_bytes);
    }
  }

  // Row r's first `bytes` are final in the stage.
  C10_ALWAYS_INLINE void written(int64_t r, int64_t bytes) {
    const int64_t end = r * row_bytes_ + bytes;
    for (; done_[r] + kCacheLine <= end; done_[r] += kCacheLine) {
      stream_line(dst_ + done_[r], stage_ + done_[r]);
    }
  }

  // Every row final: the bytes not yet streamed.
  void finish() {
    int64_t from = 0;
    for (int64_t r = 0; r < rows_; ++r) {
      stream_copy(dst_ + from, stage_ + from, start_[r] - from);
      from = done_[r];
    }
    stream_copy(dst_ + from, stage_ + from, rows_ * row_bytes_ - from);
  }

 private:
  char* dst_;
  const char* stage_;
  int64_t row_bytes_, rows_;
  int64_t start_[kMaxRows], done_[kMaxRows];  // tile byte offsets: lines [start, done) streamed
};

// Orders this thread's streaming stores before what follows (e.g. the end of a task).
inline void streaming_fence() {
#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
  _mm_sfence();
#endif
}

#if defined(CPU_CAPABILITY_AVX2)
// float -> bfloat16, round to nearest even, for lanes whose NaNs (if any) are known to carry
// their payload in the upper 16 bits: the upper half of x + 0x7fff + (bit 16 of x). Exact
// for every other float (infinities stay infinite, the largest floats round up to
// infinity); a NaN with only low payload bits would come out as infinity or wrap the sign. ATen's conversion also masks NaN lanes (a compare
// and a blend per register), which is a fifth of a bfloat16 forward in cache.
inline at::vec::Vectorized<c10::BFloat16> round_to_bfloat16_no_nan(
    const at::vec::Vectorized<float>& lo, const at::vec::Vectorized<float>& hi) {
  const __m256i bias = _mm256_set1_epi32(0x7fff), one = _mm256_set1_epi32(1);
  auto round = [&](__m256 v) {
    const __m256i bits = _mm256_castps_si256(v);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), one);
    return _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(bits, bias), odd), 16);
  };
  // packus interleaves the 128-bit lanes of its operands; the permute restores the order.
  const __m256i packed = _mm256_packus_epi32(round(lo), round(hi));
  return _mm256_permute4x64_epi64(packed, 0xd8);
}
#endif

#if defined(CPU_CAPABILITY_AVX512)
// Whether this CPU has AVX512_BF16 (Zen 4, Cooper Lake, Sapphire Rapids and later): asked
// of the running CPU once, as an AVX-512 build may load on an AVX-512 CPU without it.
inline bool detect_avx512_bf16() {
  __builtin_cpu_init();  // may run before the constructors that would otherwise call it
  return __builtin_cpu_supports("avx512bf16");
}
inline const bool cpu_has_avx512_bf16 = detect_avx512_bf16();

// Whether every lane of lo and hi is zero, normal or infinite (no denormal, no NaN): the
// lanes that AVX512_BF16's vcvtne2ps2bf16 rounds as c10::BFloat16 does. It flushes denormals
// to zero and keeps a NaN's sign and payload, where c10::BFloat16 keeps denormals and writes
// 0x7fc0 (ATen's vectorized conversion, which the AVX2 build uses, writes 0xffff).
inline bool lanes_zero_normal_or_infinite(const __m512& lo, const __m512& hi) {
  constexpr int kNaNOrDenormal = 0x01 | 0x20 | 0x80;  // quiet NaN, denormal, signaling NaN
  return _kortestz_mask16_u8(_mm512_fpclass_ps_mask(lo, kNaNOrDenormal),
                             _mm512_fpclass_ps_mask(hi, kNaNOrDenormal));
}

// vcvtne2ps2bf16: lo's 16 floats then hi's, rounded to nearest even, in one instruction
// (the integer rounding below takes nine). Inline assembly, so that the build needs no
// -mavx512bf16 (whose code would then run on CPUs without it); callers check
// cpu_has_avx512_bf16 and lanes_zero_normal_or_infinite first.
inline __m512i round_to_bfloat16_instruction(const __m512& lo, const __m512& hi) {
  __m512i packed;
  asm("vcvtne2ps2bf16 %1, %2, %0" : "=v"(packed) : "v"(lo), "v"(hi));
  return packed;
}

// float -> bfloat16 with AVX-512: the same rounding as above on 16 lanes; unless kNoNaN,
// NaN lanes are set to bfloat16's quiet NaN (0x7fc0, as c10::BFloat16) through a mask (a
// compare into a mask register and a masked move). The upper halves of both registers are
// gathered in order by one two-source word permute (no pack + lane fix-up). Where the CPU
// has AVX512_BF16 and no lane is a denormal or NaN, its one instruction instead.
template <bool kNoNaN>
inline at::vec::Vectorized<c10::BFloat16> round_to_bfloat16_avx512(
    const at::vec::Vectorized<float>& lo, const at::vec::Vectorized<float>& hi) {
  if (cpu_has_avx512_bf16 && lanes_zero_normal_or_infinite(lo, hi)) {
    return round_to_bfloat16_instruction(lo, hi);  // 10% of a bfloat16 forward in cache
  }
  const __m512i bias = _mm512_set1_epi32(0x7fff), one = _mm512_set1_epi32(1);
  const __m512i quiet_nan = _mm512_set1_epi32(0x7fc00000);
  auto round = [&](__m512 v) {
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), one);
    const __m512i rounded = _mm512_add_epi32(_mm512_add_epi32(bits, bias), odd);
    if constexpr (kNoNaN) return rounded;
    return _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), quiet_nan);
  };
  // Word k of the result is word 2k + 1 of the 64-word concatenation (lo's lanes, then hi's).
  const __m512i upper_words = _mm512_set_epi16(
      63, 61, 59, 57, 55, 53, 51, 49, 47, 45, 43, 41, 39, 37, 35, 33,
      31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
  return _mm512_permutex2var_epi16(round(lo), upper_words, round(hi));
}
#endif

#if defined(CPU_CAPABILITY_AVX2)
// vcvtps2ph's rounding: to nearest even, as ATen's conversion.
constexpr int kHalfRounding = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
#endif

// Primary template: a reduced-precision T (Half, BFloat16) widened to float.
template <typename T, typename acc_t>
struct VecIO {
  static_assert(std::is_same_v<acc_t, float>, "reduced types accumulate in float");
  using Vec = at::vec::Vectorized<float>;
  static constexpr int64_t kWidth = at::vec::Vectorized<T>::size();
  static_assert(kWidth == 2 * Vec::size(), "one Vectorized<T> widens to two float vectors");

  static inline void load(const T* p, Vec& lo, Vec& hi) {
#if defined(CPU_CAPABILITY_AVX512)
    if constexpr (std::is_same_v<T, c10::Half>) {
      // Each half of the block widened straight from memory: no 512-bit load and extract
      // in between (docs/perf-notes.md, "Code comments: VecIO: float16 load").
      lo = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
      hi = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + Vec::size())));
      return;
    }
#elif defined(CPU_CAPABILITY_AVX2)
    // Both halves widened in order straight from 16-byte loads: float16 by vcvtph2ps from
    // memory, bfloat16 by a broadcast load and one byte shuffle per register that puts word
    // k of the half in the upper half of float k: fewer shuffles and shifts than ATen's
    // conversion (a 32-byte load, an extract, two zero-extends and, for bfloat16, two
    // shifts), in kernels bound by them (docs/perf-notes.md, "Code comments: VecIO: AVX2
    // widen").
    if constexpr (std::is_same_v<T, c10::Half>) {
      lo = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
      hi = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + Vec::size())));
      return;
    }
    if constexpr (std::is_same_v<T, c10::BFloat16>) {
      const __m256i to_upper = _mm256_setr_epi8(
          -1, -1, 0, 1, -1, -1, 2, 3, -1, -1, 4, 5, -1, -1, 6, 7,
          -1, -1, 8, 9, -1, -1, 10, 11, -1, -1, 12, 13, -1, -1, 14, 15);
      const auto half = [](const T* q) {
        return _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
      };
      const __m256i a = half(p), b = half(p + Vec::size());
      lo = _mm256_castsi256_ps(_mm256_shuffle_epi8(a, to_upper));
      hi = _mm256_castsi256_ps(_mm256_shuffle_epi8(b, to_upper));
      return;
    }
#endif
    widen(at::vec::Vectorized<T>::loadu(p), lo, hi);
  }
  static inline void widen(const at::vec::Vectorized<T>& v, Vec& lo, Vec& hi) {
#if defined(CPU_CAPABILITY_AVX512)
    if constexpr (std::is_same_v<T, c10::BFloat16>) {
      // A bfloat16 is the upper half of its float: one word permute per register puts word
      // k of v (k + 16 for hi) at word 2k + 1 and zeroes the even words. ATen's widening
      // (extract, two zero-extends, two shifts) was three shuffles per 32 values, and a
      // backward widens dy and x twice (docs/perf-notes.md, "Code comments: VecIO: bfloat16
      // widen").
      const __m512i to_lo = _mm512_set_epi16(
          15, 0, 14, 0, 13, 0, 12, 0, 11, 0, 10, 0, 9, 0, 8, 0,
          7, 0, 6, 0, 5, 0, 4, 0, 3, 0, 2, 0, 1, 0, 0, 0);
      const __m512i to_hi = _mm512_add_epi16(to_lo, _mm512_set1_epi16(16));
      constexpr __mmask32 kOddWords = 0xAAAAAAAAu;
      lo = _mm512_castsi512_ps(_mm512_maskz_permutexvar_epi16(kOddWords, to_lo, v));
      hi = _mm512_castsi512_ps(_mm512_maskz_permutexvar_epi16(kOddWords, to_hi, v));
      return;
    }
#endif
    std::tie(lo, hi) = at::vec::convert_to_float<T>(v);
  }
  // The same kWidth values in some order, for sums over a row that never pair a value with
  // a column (statistics): bfloat16 widens in two instructions, the even elements shifted
  // into the upper half and the odd ones masked, with no cross-lane shuffle.
  static inline void load_any_order(const T* p, Vec& lo, Vec& hi) {
#if defined(CPU_CAPABILITY_AVX2)
    if constexpr (std::is_same_v<T, c10::BFloat16>) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
      lo = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
      hi = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(int(0xffff0000u))));
      return;
    }
#elif defined(CPU_CAPABILITY_AVX512)
    if constexpr (std::is_same_v<T, c10::BFloat16>) {
      const __m512i v = _mm512_loadu_si512(p);
      lo = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
      hi = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(int(0xffff0000u))));
      return;
    }
#endif
    load(p, lo, hi);
  }
  // kNoNaN: the caller knows that no lane is NaN (see round_to_bfloat16_no_nan).
  template <bool kNoNaN = false>
  static inline void store(T* p, const Vec& lo, const Vec& hi) {
#if defined(CPU_CAPABILITY_AVX2)
    if constexpr (std::is_same_v<T, c10::Half>) {
      return store_half_by_halves(p, lo, hi, [](__m128i* q, __m128i v) { _mm_storeu_si128(q, v); });
    }
#endif
    narrow<kNoNaN>(lo, hi).store(p);
  }
  template <bool kNoNaN = false>
  static inline void store_streaming(T* p, const Vec& lo, const Vec& hi) {
#if defined(CPU_CAPABILITY_AVX2)
    if constexpr (std::is_same_v<T, c10::Half>) {
      return store_half_by_halves(p, lo, hi, [](__m128i* q, __m128i v) { _mm_stream_si128(q, v); });
    }
#endif
    stream_bytes(p, narrow<kNoNaN>(lo, hi));
  }
#if defined(CPU_CAPABILITY_AVX2)
  // float16: each register narrowed and stored (store16) as a 16-byte half, without the
  // insert that joins ATen's two halves into one register.
  template <typename Store16>
  static inline void store_half_by_halves(T* p, const Vec& lo, const Vec& hi, Store16 store16) {
    store16(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(lo, kHalfRounding));
    store16(reinterpret_cast<__m128i*>(p + Vec::size()), _mm256_cvtps_ph(hi, kHalfRounding));
  }
#endif

  template <bool kNoNaN>
  static inline at::vec::Vectorized<T> narrow(const Vec& lo, const Vec& hi) {
#if defined(CPU_CAPABILITY_AVX2)
    if constexpr (kNoNaN && std::is_same_v<T, c10::BFloat16>) {
      return round_to_bfloat16_no_nan(lo, hi);
    }
#elif defined(CPU_CAPABILITY_AVX512)
    if constexpr (std::is_same_v<T, c10::BFloat16>) return round_to_bfloat16_avx512<kNoNaN>(lo, hi);
#endif
    return at::vec::convert_from_float<T>(lo, hi);
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
  static inline void load_any_order(const acc_t* p, Vec& lo, Vec& hi) { load(p, lo, hi); }
  template <bool kNoNaN = false>
  static inline void store(acc_t* p, const Vec& lo, const Vec& hi) {
    lo.store(p);
    hi.store(p + Vec::size());
  }
  template <bool kNoNaN = false>
  static inline void store_streaming(acc_t* p, const Vec& lo, const Vec& hi) {
    stream_bytes(p, lo);
    stream_bytes(p + Vec::size(), hi);
  }
};

// The first `count` (<= kWidth) elements at p into registers, the other lanes zero; and
// the first `count` lanes back out. A row's tail columns go through the same vector code as
// the rest of it: the scalar tail was a fifth of a 1000-wide float32 backward.
#if defined(CPU_CAPABILITY_AVX512)
// AVX-512 reads and writes the partial block with lane masks: no bounce through a stack
// buffer (a tenth of a 1000-wide float32 forward), and masked-off lanes never touch memory.
inline uint64_t first_lanes_mask(int64_t count) {
  return count >= 64 ? ~uint64_t(0) : (uint64_t(1) << std::max<int64_t>(count, 0)) - 1;
}

template <typename T, typename acc_t>
inline void load_partial(const T* p, int64_t count, at::vec::Vectorized<acc_t>& lo,
                         at::vec::Vectorized<acc_t>& hi) {
  constexpr int64_t n = at::vec::Vectorized<acc_t>::size();
  if constexpr (std::is_same_v<T, float>) {
    lo = _mm512_maskz_loadu_ps(__mmask16(first_lanes_mask(count)), p);
    hi = _mm512_maskz_loadu_ps(__mmask16(first_lanes_mask(count - n)), p + n);
  } else if constexpr (std::is_same_v<T, double>) {
    lo = _mm512_maskz_loadu_pd(__mmask8(first_lanes_mask(count)), p);
    hi = _mm512_maskz_loadu_pd(__mmask8(first_lanes_mask(count - n)), p + n);
  } else {
    static_assert(sizeof(T) == 2);
    const __m512i raw = _mm512_maskz_loadu_epi16(__mmask32(first_lanes_mask(count)), p);
    VecIO<T, acc_t>::widen(at::vec::Vectorized<T>(raw), lo, hi);
  }
}

template <bool kNoNaN, typename T, typename acc_t>
inline void store_partial(T* p, int64_t count, const at::vec::Vectorized<acc_t>& lo,
                          const at::vec::Vectorized<acc_t>& hi) {
  constexpr int64_t n = at::vec::Vectorized<acc_t>::size();
  if constexpr (std::is_same_v<T, float>) {
    _mm512_mask_storeu_ps(p, __mmask16(first_lanes_mask(count)), lo);
    _mm512_mask_storeu_ps(p + n, __mmask16(first_lanes_mask(count - n)), hi);
  } else if constexpr (std::is_same_v<T, double>) {
    _mm512_mask_storeu_pd(p, __mmask8(first_lanes_mask(count)), lo);
    _mm512_mask_storeu_pd(p + n, __mmask8(first_lanes_mask(count - n)), hi);
  } else {
    static_assert(sizeof(T) == 2);
    const __m512i narrowed = VecIO<T, acc_t>::template narrow<kNoNaN>(lo, hi);
    _mm512_mask_storeu_epi16(p, __mmask32(first_lanes_mask(count)), narrowed);
  }
}
#else
template <typename T, typename acc_t>
inline void load_partial(const T* p, int64_t count, at::vec::Vectorized<acc_t>& lo,
                         at::vec::Vectorized<acc_t>& hi) {
  T buffer[VecIO<T, acc_t>::kWidth] = {};
  std::memcpy(buffer, p, count * sizeof(T));
  VecIO<T, acc_t>::load(buffer, lo, hi);
}

template <bool kNoNaN, typename T, typename acc_t>
inline void store_partial(T* p, int64_t count, const at::vec::Vectorized<acc_t>& lo,
                          const at::vec::Vectorized<acc_t>& hi) {
  T buffer[VecIO<T, acc_t>::kWidth];
  VecIO<T, acc_t>::template store<kNoNaN>(buffer, lo, hi);
  std::memcpy(p, buffer, count * sizeof(T));
}
#endif

// A full block of kWidth columns (kPartial false) or the row's last `count` (kPartial true).
template <bool kPartial, typename T, typename acc_t>
inline void load_block(const T* p, int64_t count, at::vec::Vectorized<acc_t>& lo,
                       at::vec::Vectorized<acc_t>& hi) {
  if constexpr (kPartial) {
    load_partial<T, acc_t>(p, count, lo, hi);
  } else {
    VecIO<T, acc_t>::load(p, lo, hi);
  }
}

template <bool kPartial, bool kNoNaN, typename T, typename acc_t>
inline void store_block(T* p, int64_t count, const at::vec::Vectorized<acc_t>& lo,
                        const at::vec::Vectorized<acc_t>& hi) {
  if constexpr (kPartial) {
    store_partial<kNoNaN>(p, count, lo, hi);
  } else {
    VecIO<T, acc_t>::template store<kNoNaN>(p, lo, hi);
  }
}

// Lanes [0, count) of `first` and the others of `rest` (count may be <= 0 or >= size).
// With AVX-512 through a lane mask: Vec::set switches over the count, a jump per call that
// was a third of a block's time in the backward's tail (1 thread in cache, 1000 wide).
template <typename acc_t>
inline at::vec::Vectorized<acc_t> first_lanes_from(int64_t count,
                                                   const at::vec::Vectorized<acc_t>& first,
                                                   const at::vec::Vectorized<acc_t>& rest) {
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<acc_t, float>) {
    return _mm512_mask_blend_ps(__mmask16(first_lanes_mask(count)), rest, first);
  } else {
    static_assert(std::is_same_v<acc_t, double>);
    return _mm512_mask_blend_pd(__mmask8(first_lanes_mask(count)), rest, first);
  }
#else
  using Vec = at::vec::Vectorized<acc_t>;
  return Vec::set(rest, first, std::clamp<int64_t>(count, 0, Vec::size()));
#endif
}

// Lanes [0, count) of a two-register block kept, the others zero (count <= 2 * size).
template <typename acc_t>
inline void keep_first_lanes(int64_t count, at::vec::Vectorized<acc_t>& lo,
                             at::vec::Vectorized<acc_t>& hi) {
  using Vec = at::vec::Vectorized<acc_t>;
  lo = first_lanes_from(count, lo, Vec(0));
  hi = first_lanes_from(count - Vec::size(), hi, Vec(0));
}

// A row's last columns as a full block that ends at the row's end (the "overlapping tail"):
// its first kWidth - count lanes repeat columns that another block covers, so only its
// last `count` lanes may add to a sum. Plain loads and register blends rather than masked
// loads and stores, which cost more (docs/perf-notes.md, "Code comments: blend_last_lanes").
// Lanes [2 * size - count, 2 * size) of new_lo:new_hi, the others from old_lo:old_hi.
template <typename acc_t>
inline void blend_last_lanes(int64_t count, const at::vec::Vectorized<acc_t>& old_lo,
                             const at::vec::Vectorized<acc_t>& old_hi,
                             at::vec::Vectorized<acc_t>& new_lo,
                             at::vec::Vectorized<acc_t>& new_hi) {
  using Vec = at::vec::Vectorized<acc_t>;
  const int64_t n = Vec::size(), kept_old = 2 * n - count;
#if defined(CPU_CAPABILITY_AVX512)
  // One mask for both registers, fewer instructions than two first_lanes_from calls.
  const uint64_t take_new = ~first_lanes_mask(kept_old);
  if constexpr (std::is_same_v<acc_t, float>) {
    new_lo = _mm512_mask_blend_ps(__mmask16(take_new), old_lo, new_lo);
    new_hi = _mm512_mask_blend_ps(__mmask16(take_new >> n), old_hi, new_hi);
  } else {
    new_lo = _mm512_mask_blend_pd(__mmask8(take_new), old_lo, new_lo);
    new_hi = _mm512_mask_blend_pd(__mmask8(take_new >> n), old_hi, new_hi);
  }
#else
  new_lo = first_lanes_from(kept_old, old_lo, new_lo);
  new_hi = first_lanes_from(kept_old - n, old_hi, new_hi);
#endif
}

// n values of T in the accumulation type (a parameter row, once per call), bitwise as
// Tensor::to would widen them.
template <typename T, typename acc_t>
void widen_row(const T* src, acc_t* dst, int64_t n) {
  using IO = VecIO<T, acc_t>;
  using Vec = at::vec::Vectorized<acc_t>;
  int64_t i = 0;
  for (; i + IO::kWidth <= n; i += IO::kWidth) {
    Vec lo, hi;
    IO::load(src + i, lo, hi);
    lo.store(dst + i);
    hi.store(dst + i + Vec::size());
  }
  if (i < n) {
    Vec lo, hi;
    load_partial<T, acc_t>(src + i, n - i, lo, hi);
    store_partial<false>(dst + i, n - i, lo, hi);
  }
}

// Sum of all lanes, added in a fixed order. double's lanes are added as a tree of register
// halves: ATen's vec_reduce_all has shuffles for float only and takes double's lanes one at
// a time through memory, a chain that every float64 row waited for (docs/perf-notes.md,
// "Code comments: lane_sum").
template <typename acc_t>
inline acc_t lane_sum(const at::vec::Vectorized<acc_t>& v) {
  if constexpr (std::is_same_v<acc_t, double>) {
#if defined(CPU_CAPABILITY_AVX512)
    const __m512d all = v;
    const __m256d four = _mm256_add_pd(_mm512_castpd512_pd256(all), _mm512_extractf64x4_pd(all, 1));
    const __m128d two = _mm_add_pd(_mm256_castpd256_pd128(four), _mm256_extractf128_pd(four, 1));
    return _mm_cvtsd_f64(_mm_add_sd(two, _mm_unpackhi_pd(two, two)));
#elif defined(CPU_CAPABILITY_AVX2)
    const __m256d four = v;
    const __m128d two = _mm_add_pd(_mm256_castpd256_pd128(four), _mm256_extractf128_pd(four, 1));
    return _mm_cvtsd_f64(_mm_add_sd(two, _mm_unpackhi_pd(two, two)));
#endif
  }
  return at::vec::vec_reduce_all<acc_t>([](auto a, auto b) { return a + b; }, v);
}

}  // namespace fusednorm::cpu
