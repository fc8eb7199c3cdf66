#pragma once
// The CPU kernels of the norm family on [M, N] rows: LayerNorm (centered: subtract the mean)
// and RMSNorm (not centered), each with an optional residual added first
// (s = input + residual, rounded to the input's dtype and written out, then normalized).
// Rows run in parallel (cpu/parallel.h), each row vectorized (at::vec), statistics in
// float (double for double inputs). One template per sweep; the variants are compile-time
// flags, so no per-element branch remains. Weight and bias arrive in the accumulation type:
// the host converts float16/bfloat16 parameters once per call, not once per row.

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <optional>
#include <tuple>
#include <utility>

#include "common/welford.h"
#include "common/dispatch.h"
#include "cpu/dropout_kernels.h"
#include "cpu/partials.h"
#include "cpu/row_blocks.h"
#include "cpu/parallel.h"
#include "cpu/vec_io.h"

namespace fusednorm::cpu {

using at::vec::Vectorized;

// Streaming stores pay off only for a call whose traffic (bytes read and written) would not
// stay in cache anyway, and only into pages that are already mapped: a fresh allocation
// (glibc mmaps large ones) is page-faulted in by the first store, the kernel zeroes the
// page through the cache, and a streaming store then has to evict those lines again. The
// threshold is on the traffic, not the output (a backward reads dy and x besides writing
// dx). Figures: docs/perf-notes.md, "Code comments: use_streaming_stores".
inline bool use_streaming_stores(const void* output, int64_t output_bytes,
                                 int64_t traffic_bytes) {
  constexpr int64_t kLargerThanCaches = int64_t(16) << 20;
  return traffic_bytes >= kLargerThanCaches && is_stream_aligned(output) &&
         pages_resident(output, output_bytes);
}

// Output rows of at most this many bytes go through a staging buffer when streamed
// (stream_copy): it stays in L1 next to the rows being read.
constexpr int64_t kStageBytes = 16 << 10;

// How a kernel's output rows reach memory: plain stores, streaming stores straight from registers
// (rows that are whole cache lines from a line-aligned start), or streaming stores of a copy
// staged in cache (rows that are not, but whose tile of tile_rows rows is small enough).
enum class OutputPath { kPlain, kStream, kStaged };

template <typename T>
inline OutputPath output_path(bool stream, const T* out, int64_t N, int64_t tile_rows) {
  if (!stream) return OutputPath::kPlain;
  const int64_t row_bytes = N * int64_t(sizeof(T));
  if (row_bytes % kCacheLine == 0 && reinterpret_cast<std::uintptr_t>(out) % kCacheLine == 0) {
    return OutputPath::kStream;
  }
  return tile_rows * row_bytes <= kStageBytes ? OutputPath::kStaged : OutputPath::kPlain;
}

// How far behind the block being computed a staged row is streamed out (StagedTileStream),
// in blocks: a line loaded back from the stage while the stores that wrote it still wait in
// the store queue cannot take their data and waits for them; eight is about the queue's
// depth in a backward block's stores (docs/perf-notes.md, "Code comments: kStagedLagBlocks").
constexpr int64_t kStagedLagBlocks = 8;

// Asks for the cache lines of one block of kWidth elements of T into L2: one request per
// line's worth of bytes from p, so that a row's blocks, asked for in turn, ask for every
// line from the row's first up to the one that holds the last block's start.
template <typename T, typename acc_t>
C10_ALWAYS_INLINE void prefetch_block(const T* p) {
  constexpr int64_t kBytes = VecIO<T, acc_t>::kWidth * int64_t(sizeof(T));
  const char* line = reinterpret_cast<const char*>(p);
  for (int64_t offset = 0; offset < kBytes; offset += kCacheLine) {
    __builtin_prefetch(line + offset, 0, 2);
  }
}

// Asks for the lines of a row that its blocks' requests (prefetch_block) leave out: those of
// its last `count` columns (the tail after the full blocks; a whole short row), and the
// line of its last byte. A row that does not start on a line (N = 1000 bfloat16: 2000-byte
// rows) ends in a line that no block starts in; unasked, that line and the tail's were read
// from memory when the row was reached, a wait for every row (docs/perf-notes.md, "Code
// comments: prefetch_last_columns").
template <typename T>
C10_ALWAYS_INLINE void prefetch_last_columns(const T* row_end, int64_t count) {
  if (count <= 0) return;
  const char* end = reinterpret_cast<const char*>(row_end);
  for (const char* p = end - count * int64_t(sizeof(T)); p < end; p += kCacheLine) {
    __builtin_prefetch(p, 0, 2);
  }
  __builtin_prefetch(end - 1, 0, 2);
}

// One Welford step on a register of lanes that have all seen `count` values.
template <typename acc_t>
inline void welford_step(const Vectorized<acc_t>& x, const Vectorized<acc_t>& inv_count,
                         Vectorized<acc_t>& mean, Vectorized<acc_t>& m2) {
  const auto delta = x - mean;
  mean = at::vec::fmadd(delta, inv_count, mean);
  m2 = at::vec::fmadd(delta, x - mean, m2);
}

// Mean and M2 of one row in a single pass, over x - shift: with shift a value of the row,
// the values Welford accumulates are small even when the row sits far from zero (1e4 +
// noise), so the running mean does not lose the noise to rounding (its mean is shift + the
// result's).
// Four independent accumulator registers hide the latency of the dependent Welford chain
// (two 512-bit ones were slower in cache); their lanes, which all hold the same count, are
// merged with Chan's formula, then the tail is taken in around their mean. kPrefetch: next
// is a row of the same length to prefetch along the way (a template flag, not a null test,
// so that rows which never prefetch keep a loop without the branch).
template <typename T, typename acc_t, bool kPrefetch = false>
WelfordState<acc_t> row_statistics(const T* x, int64_t N, acc_t shift, const T* next = nullptr) {
  using IO = VecIO<T, acc_t>;
  using Vec = Vectorized<acc_t>;
  constexpr int64_t kStep = 2 * IO::kWidth;
  constexpr int kRegs = 4;
  constexpr int kLanes = kRegs * Vec::size();

  const Vec vshift(shift);
  const int64_t vec_end = N - N % kStep;
  // The summary of the vector columns [start, end) (row_blocks.h: a long row's blocks).
  const auto block_summary = [&](int64_t start, int64_t end) {
    Vec mean[kRegs] = {Vec(0), Vec(0), Vec(0), Vec(0)};
    Vec m2[kRegs] = {Vec(0), Vec(0), Vec(0), Vec(0)};
    acc_t count = 0;
    for (int64_t i = start; i < end; i += kStep) {
      count += acc_t(1);
      const Vec inv_count(acc_t(1) / count);
      Vec v[kRegs];
      if constexpr (kPrefetch) {
        prefetch_block<T, acc_t>(next + i);
        prefetch_block<T, acc_t>(next + i + IO::kWidth);
      }
      IO::load_any_order(x + i, v[0], v[1]);
      IO::load_any_order(x + i + IO::kWidth, v[2], v[3]);
      for (int r = 0; r < kRegs; ++r) welford_step(v[r] - vshift, inv_count, mean[r], m2[r]);
    }
    WelfordState<acc_t> block;
    if (end > start) {
      // Equal counts everywhere, so Chan's merge of two lanes is exact and cheap: the mean
      // of the two means, and M2a + M2b + (mean_a - mean_b)^2 * n / 2. The registers are
      // merged pairwise as vectors first (a short row pays little for the merge: the scalar
      // one over all 32 lanes was a quarter of a 128-wide row's forward), then the lanes of
      // the last.
      acc_t n = count;
      for (int width = kRegs; width > 1; width /= 2, n *= 2) {
        const Vec half_n(n / 2), half(acc_t(0.5));
        for (int r = 0; r < width / 2; ++r) {
          const Vec d = mean[r] - mean[r + width / 2];
          m2[r] = at::vec::fmadd(d * d, half_n, m2[r] + m2[r + width / 2]);
          mean[r] = (mean[r] + mean[r + width / 2]) * half;
        }
      }
      // The lanes of the last register by shuffles (a scalar loop over its lanes was a
      // chain of dependent additions that each row waited for).
      block.mean = lane_sum(mean[0]) / acc_t(Vec::size());
      const Vec d = mean[0] - Vec(block.mean);
      block.m2 = lane_sum(at::vec::fmadd(d * d, Vec(n), m2[0]));
      block.count = count * kLanes;
    }
    return block;
  };
  WelfordState<acc_t> total = combined_blocks<WelfordState<acc_t>>(
      vec_end, block_summary, [](WelfordState<acc_t> a, const WelfordState<acc_t>& b) {
        a.merge(b);
        return a;
      });
  if constexpr (kPrefetch) prefetch_last_columns(next + N, N - vec_end);
  // The tail (fewer than kStep values, up to 63 with AVX-512) through the vector code in
  // blocks of kWidth zero-padded at the end.
  if (vec_end < N) {
    // x - shift - center over the block at i, the padded lanes zeroed after the subtraction.
    auto centered_block = [&](int64_t i, const Vec& center, Vec& lo, Vec& hi) {
      const int64_t count = std::min<int64_t>(IO::kWidth, N - i);
      load_partial<T, acc_t>(x + i, count, lo, hi);
      lo = lo - vshift - center;
      hi = hi - vshift - center;
      keep_first_lanes(count, lo, hi);
    };
    if (vec_end > 0) {
      // One pass: the sums S1 and S2 of d = x - shift - mean, around the mean of the row's
      // other values, which the total then takes in as mean += S1 / n and
      // M2 += S2 - S1^2 / n (exact algebra; S1^2 / n <= S2 * tail / n < S2 / 2, the tail
      // being under half the row: no cancellation). Two passes (the tail's own mean, then
      // its M2, then Chan's merge) were a chain of dependent steps that each row waited for.
      const Vec center(total.mean);
      Vec s1(0), s2(0);
      for (int64_t i = vec_end; i < N; i += IO::kWidth) {
        Vec lo, hi;
        centered_block(i, center, lo, hi);
        s1 = s1 + (lo + hi);
        s2 = at::vec::fmadd(lo, lo, at::vec::fmadd(hi, hi, s2));
      }
      const acc_t n = acc_t(N), sum1 = lane_sum(s1), sum2 = lane_sum(s2);
      total.mean += sum1 / n;
      total.m2 += sum2 - sum1 * sum1 / n;
      total.count = n;
    } else {
      // A row shorter than kStep: two passes, its mean, then its M2 around that mean.
      WelfordState<acc_t> tail;
      tail.count = acc_t(N);
      Vec sum(0);
      for (int64_t i = 0; i < N; i += IO::kWidth) {
        Vec lo, hi;
        centered_block(i, Vec(0), lo, hi);
        sum = sum + (lo + hi);
      }
      tail.mean = lane_sum(sum) / tail.count;
      Vec m2_sum(0);
      for (int64_t i = 0; i < N; i += IO::kWidth) {
        Vec lo, hi;
        centered_block(i, Vec(tail.mean), lo, hi);
        m2_sum = at::vec::fmadd(lo, lo, at::vec::fmadd(hi, hi, m2_sum));
      }
      tail.m2 = lane_sum(m2_sum);
      total = tail;
    }
  }
  return total;
}

// Mean of x^2 over one row (RMSNorm's statistic), four accumulators wide.
template <typename T, typename acc_t>
acc_t row_mean_square(const T* x, int64_t N) {
  using IO = VecIO<T, acc_t>;
  using Vec = Vectorized<acc_t>;
  constexpr int64_t kStep = 2 * IO::kWidth;
  const int64_t vec_end = N - N % kStep;
  // The sum over the vector columns [start, end), and the tail with the last block.
  const auto block_sum = [&](int64_t start, int64_t end) {
    Vec sum[4] = {Vec(0), Vec(0), Vec(0), Vec(0)};
    for (int64_t i = start; i < end; i += kStep) {
      Vec v[4];
      IO::load_any_order(x + i, v[0], v[1]);
      IO::load_any_order(x + i + IO::kWidth, v[2], v[3]);
      for (int r = 0; r < 4; ++r) sum[r] = at::vec::fmadd(v[r], v[r], sum[r]);
    }
    if (end == vec_end) {
      for (int64_t i = vec_end; i < N; i += IO::kWidth) {  // the tail, zero-padded blocks
        Vec lo, hi;
        load_partial<T, acc_t>(x + i, std::min<int64_t>(IO::kWidth, N - i), lo, hi);
        sum[0] = at::vec::fmadd(lo, lo, sum[0]);
        sum[1] = at::vec::fmadd(hi, hi, sum[1]);
      }
    }
    return lane_sum((sum[0] + sum[1]) + (sum[2] + sum[3]));
  };
  const acc_t total = combined_blocks<acc_t>(vec_end, block_sum, std::plus<acc_t>());
  return N > 0 ? total / N : acc_t(0);
}

// Whether y = xhat * weight + bias is NaN-free for a row with these statistics, given finite
// weight and bias: mean and rstd finite and rstd > 0 mean every x - mean was finite, so
// |xhat| <= sqrt(N), and xhat * weight + bias may overflow to infinity but not become NaN.
// (A non-finite x makes the statistics non-finite.)
template <typename acc_t>
inline bool row_output_has_no_nan(bool params_finite, acc_t mean, acc_t rstd) {
  return params_finite && std::isfinite(mean) && std::isfinite(rstd) && rstd > acc_t(0);
}

// ((x - shift) - mean) * rstd * weight + bias for the kWidth columns from i (kPartial: the
// `count` columns from i, the other lanes zero).
template <typename T, typename acc_t, bool kWeight, bool kBias, bool kPartial>
C10_ALWAYS_INLINE void normalize_block(const T* x, const acc_t* weight, const acc_t* bias,
                                       int64_t i, int64_t count, const Vectorized<acc_t>& vshift,
                                       const Vectorized<acc_t>& vmean,
                                       const Vectorized<acc_t>& vrstd, Vectorized<acc_t>& lo,
                                       Vectorized<acc_t>& hi) {
  using Vec = Vectorized<acc_t>;
  load_block<kPartial>(x + i, count, lo, hi);
  if constexpr (sizeof(T) == 2) {
    // One fma instead of two operations; rounding mean * rstd costs 2^-24 of
    // |mean| * rstd, far below the 2^-8 of a float16/bfloat16 input or output.
    const Vec offset = Vec(0) - vmean * vrstd;
    lo = at::vec::fmadd(lo - vshift, vrstd, offset);
    hi = at::vec::fmadd(hi - vshift, vrstd, offset);
  } else {
    lo = (lo - vshift - vmean) * vrstd;
    hi = (hi - vshift - vmean) * vrstd;
  }
  Vec wlo(1), whi(1), blo(0), bhi(0);
  if constexpr (kWeight) load_block<kPartial>(weight + i, count, wlo, whi);
  if constexpr (kBias) load_block<kPartial>(bias + i, count, blo, bhi);
  if constexpr (kWeight && kBias) {
    lo = at::vec::fmadd(lo, wlo, blo);
    hi = at::vec::fmadd(hi, whi, bhi);
  } else if constexpr (kWeight) {
    lo = lo * wlo;
    hi = hi * whi;
  } else if constexpr (kBias) {
    lo = lo + blo;
    hi = hi + bhi;
  }
}

// The vectorized part of normalize_row, one variant per store flavor, the partial last
// block included. A function of its own with everything passed by value: a lambda
// capturing by reference had the compiler reload the row constants after every store
// (they might alias y). next_a, next_b (may be null): rows of the same length to prefetch.
// head: y's first columns, up to its first line boundary, stored plainly as partial blocks,
// so that each full block's streaming stores fill whole lines.
template <typename T, typename acc_t, bool kWeight, bool kBias, bool kNoNaN, bool kStream,
          typename X>
void normalize_vectorized(const X* __restrict__ x, T* __restrict__ y, int64_t N, acc_t shift,
                          acc_t mean, acc_t rstd, const acc_t* __restrict__ weight,
                          const acc_t* __restrict__ bias, const T* next_a, const T* next_b,
                          StagedTileStream* staged, int64_t head) {
  using IO = VecIO<T, acc_t>;
  using Vec = Vectorized<acc_t>;
  constexpr int64_t W = IO::kWidth;
  const Vec vshift(shift), vmean(mean), vrstd(rstd);
  head = std::min(head, N);
  int64_t i = 0;
  if (head > 0) {
    if (next_a != nullptr) prefetch_block<T, acc_t>(next_a);
    if (next_b != nullptr) prefetch_block<T, acc_t>(next_b);
    for (; i < head; i += W) {
      const int64_t count = std::min(W, head - i);
      Vec lo, hi;
      normalize_block<X, acc_t, kWeight, kBias, true>(x, weight, bias, i, count, vshift, vmean,
                                                      vrstd, lo, hi);
      store_partial<kNoNaN>(y + i, count, lo, hi);
    }
    i = head;
  }
  const int64_t vec_end = N - (N - head) % W;
  for (; i < vec_end; i += W) {
    if (next_a != nullptr) prefetch_block<T, acc_t>(next_a + i);
    if (next_b != nullptr) prefetch_block<T, acc_t>(next_b + i);
    Vec lo, hi;
    normalize_block<X, acc_t, kWeight, kBias, false>(x, weight, bias, i, W, vshift, vmean,
                                                     vrstd, lo, hi);
    if constexpr (kStream) {
      IO::template store_streaming<kNoNaN>(y + i, lo, hi);
    } else {
      IO::template store<kNoNaN>(y + i, lo, hi);
    }
    if (staged != nullptr) {
      staged->written(0, (i + W - kStagedLagBlocks * W) * int64_t(sizeof(T)));
    }
  }
  if (next_a != nullptr) prefetch_last_columns(next_a + N, N - vec_end);
  if (next_b != nullptr) prefetch_last_columns(next_b + N, N - vec_end);
  if (vec_end < N) {
    Vec lo, hi;
    normalize_block<X, acc_t, kWeight, kBias, true>(x, weight, bias, vec_end, N - vec_end,
                                                    vshift, vmean, vrstd, lo, hi);
    store_partial<kNoNaN>(y + vec_end, N - vec_end, lo, hi);
  }
}

// y = ((x - shift) - mean) * rstd * weight + bias over one row (weight, bias optional;
// shift = mean = 0 for RMSNorm): one rounding to T at the store. no_nan: the row's outputs
// are known not to be NaN (row_output_has_no_nan), so bfloat16 rounds without a NaN mask.
// next_a and next_b (either may be null) are prefetched into L2 along the way; staged (may
// be null): y is a staging buffer that it streams out to memory as it fills; head: see
// normalize_vectorized. x is of T, or (X = float beside a float16/bfloat16 T) a float32 sum
// row.
template <typename T, typename acc_t, bool kWeight, bool kBias, typename X>
void normalize_row(const X* x, T* y, int64_t N, acc_t shift, acc_t mean, acc_t rstd,
                   const acc_t* weight, const acc_t* bias, bool stream, bool no_nan,
                   const T* next_a = nullptr, const T* next_b = nullptr,
                   StagedTileStream* staged = nullptr, int64_t head = 0) {
  // Only bfloat16 rounds differently without NaN lanes; other types keep one variant.
  constexpr bool kNoNaNMatters = std::is_same_v<T, c10::BFloat16>;
  dispatch_bool(stream, [&](auto kStream) {
    if (kNoNaNMatters && no_nan) {
      normalize_vectorized<T, acc_t, kWeight, kBias, true, decltype(kStream)::value>(
          x, y, N, shift, mean, rstd, weight, bias, next_a, next_b, staged, head);
    } else {
      normalize_vectorized<T, acc_t, kWeight, kBias, false, decltype(kStream)::value>(
          x, y, N, shift, mean, rstd, weight, bias, next_a, next_b, staged, head);
    }
  });
}

// s = a + b over one row, added in acc_t and rounded once to S (the sum in the input's
// dtype, as eager a + b; or in float32 beside 16-bit a, b of either dtype).
template <typename A, typename B, typename S, typename acc_t>
void add_row(const A* a, const B* b, S* s, int64_t N) {
  constexpr int64_t W = VecIO<A, acc_t>::kWidth;
  static_assert(VecIO<B, acc_t>::kWidth == W && VecIO<S, acc_t>::kWidth == W);
  using Vec = Vectorized<acc_t>;
  const int64_t vec_end = N - N % W;
  for (int64_t i = 0; i < vec_end; i += W) {
    Vec alo, ahi, blo, bhi;
    VecIO<A, acc_t>::load(a + i, alo, ahi);
    VecIO<B, acc_t>::load(b + i, blo, bhi);
    VecIO<S, acc_t>::store(s + i, alo + blo, ahi + bhi);
  }
  if (vec_end < N) {  // the last columns as one partial block: no scalar conversions
    const int64_t count = N - vec_end;
    Vec alo, ahi, blo, bhi;
    load_partial<A, acc_t>(a + vec_end, count, alo, ahi);
    load_partial<B, acc_t>(b + vec_end, count, blo, bhi);
    store_partial<false>(s + vec_end, count, alo + blo, ahi + bhi);
  }
}

// Pointers of one forward call; residual / sum null without a residual, mean null for
// RMSNorm, weight / bias null when absent. S: the sum's type, T's or float beside a 16-bit
// T (residual_dtype); the residual is either residual (of T) or residual_s (of S).
template <typename T, typename acc_t, typename S = T>
struct NormFwdArgs {
  const T* x;
  const T* residual;
  const S* residual_s;
  const acc_t* weight;
  const acc_t* bias;
  T* y;
  S* sum;
  acc_t* mean;
  acc_t* rstd;
  int64_t M, N;
  acc_t eps;
  bool params_finite;  // weight and bias (where given) have no NaN or infinity
  // dropout / rowscale of the input before the add (inactive: s = x + residual).
  RowMultipliers<acc_t> multipliers = {};

  bool has_residual() const { return residual != nullptr || residual_s != nullptr; }
};

// Whether the forward asks for the row kAhead rows on while it computes one (see there).
// With a residual, every row: its sweeps read the sum back from L1 while memory would
// otherwise idle, and two input streams wait behind each row's add. Without one, float32
// rows under 8 KiB, at the memory limit already, lose to the extra requests
// (docs/perf-notes.md, "Code comments: forward_prefetches").
template <typename T>
inline bool forward_prefetches(int64_t N, bool residual) {
  const int64_t row_bytes = N * int64_t(sizeof(T));
  return sizeof(T) == 2 || residual || (row_bytes >= 8 * 1024 && row_bytes <= 16 * 1024);
}

// What normalizing a row needs: its shift (LayerNorm: median_of_three; RMSNorm: 0), the
// mean of x - shift (RMSNorm: 0) and rstd.
template <typename acc_t>
struct RowMoments {
  acc_t shift = 0, mean = 0, rstd = 0;
};

// rstd = 1 / sqrt(stat + eps), stat a row's variance or mean square; NaN where stat
// overflowed to infinity (docs/DESIGN.md, Numerics: a row whose statistics overflow). An
// eps that overflows the sum gives 0, as PyTorch's.
template <typename acc_t>
inline acc_t row_rstd(acc_t stat, acc_t eps) {
  return std::isinf(stat) ? std::numeric_limits<acc_t>::quiet_NaN()
                          : acc_t(1) / std::sqrt(stat + eps);
}

// The statistics sweep of one row and its rstd; prefetch_row (LayerNorm only; may be null):
// a row of the same length to ask for along the way.
template <typename T, typename acc_t, bool kCentered>
RowMoments<acc_t> row_moments(const T* x, int64_t N, acc_t eps, const T* prefetch_row) {
  RowMoments<acc_t> m;
  if constexpr (kCentered) {
    // The shift: see median_of_three.
    if (N > 0) {
      m.shift = row_shift_of<acc_t>(N, [x](int64_t i) { return static_cast<acc_t>(x[i]); });
    }
    const WelfordState<acc_t> stats =
        prefetch_row != nullptr ? row_statistics<T, acc_t, true>(x, N, m.shift, prefetch_row)
                                : row_statistics<T, acc_t, false>(x, N, m.shift);
    m.mean = stats.mean;
    m.rstd = row_rstd(stats.variance(), eps);
  } else {
    m.rstd = row_rstd(row_mean_square<T, acc_t>(x, N), eps);
  }
  return m;
}

template <typename T, typename acc_t, bool kCentered, bool kWeight, bool kBias, typename S>
void norm_fwd_rows(const NormFwdArgs<T, acc_t, S>& a) {
  const int64_t N = a.N;
  const bool residual = a.has_residual();
  // Traffic: x and y (and the residual and the sum, each counted at the sum's width).
  const int64_t bytes = a.M * N * int64_t(sizeof(T));
  const int64_t sum_bytes = a.M * N * int64_t(sizeof(S));
  const bool stream =
      use_streaming_stores(a.y, bytes, 2 * bytes + (residual ? 2 * sum_bytes : 0));
  // Streamed rows over 2 KiB without a residual go out from registers, those that do not
  // start on a cache line after their first columns up to the line, stored plainly: staged
  // in L1 and copied out, they paid for a second pass. Shorter rows, whose partial head
  // block costs more per byte, and rows with a residual keep the stage (docs/perf-notes.md,
  // "2026-11-27: the float32 forward's streamed rows").
  const bool peeled = !residual && N * int64_t(sizeof(T)) > 2048;
  const OutputPath path = !peeled ? output_path(stream, a.y, N, 1)
                          : stream ? OutputPath::kStream
                                   : OutputPath::kPlain;
  // The sum is computed into a staging buffer, streamed out from there and normalized from
  // there: plain stores of it made every line read before written, and the streaming and
  // plain stores mixed (docs/perf-notes.md, "Code comments: norm_fwd_rows: the staged sum").
  const bool stage_sum = residual && stream && N * int64_t(sizeof(S)) <= kStageBytes &&
                         pages_resident(a.sum, sum_bytes);
  // Rows ask for a later row's inputs while one computes from cache, so that memory does not
  // idle (forward_prefetches): float16/bfloat16 rows, rows with a residual, and float32/float64
  // rows of 8-16 KiB; shorter float32 rows already keep memory busy and lose to the extra
  // requests, and so do 32 KiB rows. LayerNorm asks during its statistics sweep (asked during
  // the short normalize sweep, they came too late); RMSNorm, whose statistics sweep is one fma
  // per register, and a residual's row during the normalize sweep. Two rows ahead, not the
  // next: short rows asked for the next one too late. Figures: docs/perf-notes.md, "Code
  // comments: norm_fwd_rows: kAhead".
  constexpr int64_t kAhead = 2;
  const bool prefetches = forward_prefetches<T>(N, residual);
  const bool statistics_ahead = !kCentered && sizeof(T) == 2 && !residual &&
                                N * int64_t(sizeof(T)) <= 8 * 1024;
  parallel_chunks(a.M, row_grain(N), [&](int64_t begin, int64_t end) {
    alignas(kCacheLine) char stage[kStageBytes];  // uninitialized: costs no time unused
    alignas(kCacheLine) char sum_stage[kStageBytes];
    // Row `row` of base to prefetch, or null (no prefetch, no such tensor or row).
    auto ahead = [&](const auto* base, int64_t row) -> decltype(base) {
      return prefetches && base != nullptr && row < end ? base + row * N : nullptr;
    };
    // Writes a row's statistics and normalizes x (its input, or the sum: of T or S) into y.
    auto normalize = [&](int64_t row, const auto* x, const RowMoments<acc_t>& m,
                         const T* next_a, const T* next_b) {
      const auto [mean, rest] = nearest_and_rest(m.shift, m.mean);
      if constexpr (kCentered) a.mean[row] = mean;
      a.rstd[row] = m.rstd;
      T* yr = path == OutputPath::kStaged ? reinterpret_cast<T*>(stage) : a.y + row * N;
      // y = ((x - mean) - rest) * rstd: x - mean is exact for the values near the mean
      // (a row far from zero), and rounds like any x - mean elsewhere; rest keeps the bits
      // of the shifted statistics that the rounded mean lost. (Subtracting the shift, the
      // row's first value, instead lost 2^-24 of |x[0] - mean| in every output: 1e-5 of
      // sigma where x[0] sat 80 sigma from the rest.)
      std::optional<StagedTileStream> staged;  // only for staged rows: no setup per row else
      if (path == OutputPath::kStaged) {
        staged.emplace(reinterpret_cast<char*>(a.y + row * N), stage, N * int64_t(sizeof(T)), 1);
      }
      normalize_row<T, acc_t, kWeight, kCentered && kBias>(
          x, yr, N, mean, rest, m.rstd, a.weight, a.bias, path == OutputPath::kStream,
          row_output_has_no_nan(a.params_finite, mean, m.rstd), next_a, next_b,
          staged ? &*staged : nullptr, path == OutputPath::kStream ? line_head(yr) : 0);
      if (staged) staged->finish();
    };
    if (statistics_ahead) {
      // RMSNorm's float16/bfloat16 statistics run one row ahead of its normalize sweep: a
      // row's lane sum, sqrt and division are a chain of dependent steps that the normalize
      // sweep would wait for, and behind the next row's statistics sweep it costs nothing.
      // float32 rows, LayerNorm's and rows of 16 KiB (which with the next row outgrow L1)
      // gained nothing from it (docs/perf-notes.md, "Code comments: norm_fwd_rows:
      // statistics_ahead").
      auto moments = [&](int64_t row) {
        return row_moments<T, acc_t, kCentered>(a.x + row * N, N, a.eps, nullptr);
      };
      RowMoments<acc_t> current = moments(begin);
      for (int64_t row = begin; row < end; ++row) {
        const RowMoments<acc_t> next = row + 1 < end ? moments(row + 1) : RowMoments<acc_t>{};
        normalize(row, a.x + row * N, current, ahead(a.x, row + 1 + kAhead), nullptr);
        current = next;
      }
    } else {
      for (int64_t row = begin; row < end; ++row) {
        const T* xr = a.x + row * N;
        const T* next_x = ahead(a.x, row + kAhead);
        if (residual) {  // normalize the sum, read back from cache
          S* sr = stage_sum ? reinterpret_cast<S*>(sum_stage) : a.sum + row * N;
          const bool scaled = a.multipliers.active();
          if (a.residual != nullptr) {
            if (scaled) {
              add_row_scaled<T, T, S, acc_t>(xr, a.residual + row * N, sr, N, row, a.multipliers);
            } else {
              add_row<T, T, S, acc_t>(xr, a.residual + row * N, sr, N);
            }
          } else {
            if (scaled) {
              add_row_scaled<T, S, S, acc_t>(xr, a.residual_s + row * N, sr, N, row,
                                             a.multipliers);
            } else {
              add_row<T, S, S, acc_t>(xr, a.residual_s + row * N, sr, N);
            }
            // A residual of S is asked for here, all its row at once: normalize_row's
            // prefetches are of T's blocks.
            if (const S* next_r = ahead(a.residual_s, row + kAhead)) {
              prefetch_last_columns(next_r + N, N);
            }
          }
          if (stage_sum) stream_copy(a.sum + row * N, sr, N * int64_t(sizeof(S)));
          // The input's next row is asked for as without a residual where the sum has
          // T's type; a float32 sum's statistics sweep asks for nothing (its prefetches
          // are of the sum's blocks), so its normalize sweep asks for that row.
          const bool during_stats = kCentered && std::is_same_v<S, T>;
          const RowMoments<acc_t> m = row_moments<S, acc_t, kCentered>(
              sr, N, a.eps, during_stats ? reinterpret_cast<const S*>(next_x) : nullptr);
          normalize(row, static_cast<const S*>(sr), m, during_stats ? nullptr : next_x,
                    ahead(a.residual, row + kAhead));
          continue;
        }
        const RowMoments<acc_t> m =
            row_moments<T, acc_t, kCentered>(xr, N, a.eps, kCentered ? next_x : nullptr);
        normalize(row, xr, m, kCentered ? nullptr : next_x, nullptr);
      }
    }
    if (stream) streaming_fence();
  });
}

// xhat = (x - mean) * rstd + offset of one register, offset a per-row constant (see
// xhat_offset). For float16/bfloat16 x as one fma, the row's -mean * rstd folded into the
// offset, one operation fewer (docs/perf-notes.md, "Code comments: normalized"): the
// rounding of that product is 2^-24 of |mean| * rstd, 2^-13 of what the input's own 16-bit
// rounding already puts into xhat.
// float32/float64 keep the exact subtraction.
template <typename T, typename acc_t>
C10_ALWAYS_INLINE Vectorized<acc_t> normalized(const Vectorized<acc_t>& x,
                                               const Vectorized<acc_t>& mean,
                                               const Vectorized<acc_t>& rstd,
                                               const Vectorized<acc_t>& offset) {
  if constexpr (sizeof(T) == 2) {
    return at::vec::fmadd(x, rstd, offset);
  } else {
    return at::vec::fmadd(x - mean, rstd, offset);
  }
}

// The offset that normalized() adds for a row: -correction, and for float16/bfloat16
// also the row's -mean * rstd.
template <typename T, typename acc_t>
inline acc_t xhat_offset(acc_t mean, acc_t rstd, acc_t correction) {
  return sizeof(T) == 2 ? -mean * rstd - correction : -correction;
}

// Per-row sums of the backward: mean(g) (centered only) and mean(g * xhat), with
//   xhat = (x - mean) * rstd (mean = 0 for RMSNorm),  g = dy * weight.
// prefetch_dy (may be null): a row of dy to ask for along the way (norm_bwd_tile).
template <typename T, typename acc_t, bool kCentered, bool kWeight, typename D>
std::pair<acc_t, acc_t> row_grad_means(const D* dy, const T* x, acc_t mean, acc_t rstd,
                                       const acc_t* weight, int64_t N, const D* prefetch_dy) {
  using IO = VecIO<T, acc_t>;
  using DyIO = VecIO<D, acc_t>;
  using ParamIO = VecIO<acc_t, acc_t>;
  using Vec = Vectorized<acc_t>;
  constexpr int64_t W = IO::kWidth;
  static_assert(ParamIO::kWidth == W && DyIO::kWidth == W);
  const int64_t vec_end = N - N % W;
  const Vec vmean(mean), vrstd(rstd), voffset(xhat_offset<T>(mean, rstd, acc_t(0)));
  // g and x of the kWidth columns from i (the function has no stores: captures stay in
  // registers).
  auto load_g_and_x = [&](int64_t i, Vec& glo, Vec& ghi, Vec& xlo, Vec& xhi) {
    DyIO::load(dy + i, glo, ghi);
    IO::load(x + i, xlo, xhi);
    if constexpr (kWeight) {
      Vec wlo, whi;
      ParamIO::load(weight + i, wlo, whi);
      glo = glo * wlo;
      ghi = ghi * whi;
    }
  };
  // The sums over the columns [start, end), and the last columns with the last block.
  const auto block_sums = [&](int64_t start, int64_t end) {
    Vec sum_g_lo(0), sum_g_hi(0), sum_gx_lo(0), sum_gx_hi(0);
    for (int64_t i = start; i < end; i += W) {
      if (prefetch_dy != nullptr) prefetch_block<D, acc_t>(prefetch_dy + i);
      Vec dlo, dhi, xlo, xhi;
      load_g_and_x(i, dlo, dhi, xlo, xhi);
      if constexpr (kCentered) {
        sum_g_lo = sum_g_lo + dlo;
        sum_g_hi = sum_g_hi + dhi;
      }
      sum_gx_lo = at::vec::fmadd(dlo, normalized<T>(xlo, vmean, vrstd, voffset), sum_gx_lo);
      sum_gx_hi = at::vec::fmadd(dhi, normalized<T>(xhi, vmean, vrstd, voffset), sum_gx_hi);
    }
    if (end < vec_end || vec_end == N) {
      return std::pair<acc_t, acc_t>(lane_sum(sum_g_lo + sum_g_hi), lane_sum(sum_gx_lo + sum_gx_hi));
    }
    if (vec_end > 0) {  // the last columns: an overlapping tail (vec_io.h)
      Vec dlo, dhi, xlo, xhi;
      load_g_and_x(N - W, dlo, dhi, xlo, xhi);
      Vec gx_lo = dlo * normalized<T>(xlo, vmean, vrstd, voffset),
          gx_hi = dhi * normalized<T>(xhi, vmean, vrstd, voffset);
      const Vec zero(0);
      blend_last_lanes(N - vec_end, zero, zero, dlo, dhi);
      blend_last_lanes(N - vec_end, zero, zero, gx_lo, gx_hi);
      sum_g_lo = sum_g_lo + dlo;
      sum_g_hi = sum_g_hi + dhi;
      sum_gx_lo = sum_gx_lo + gx_lo;
      sum_gx_hi = sum_gx_hi + gx_hi;
    } else {  // a row shorter than a block: one zero-padded block
      const int64_t count = N - vec_end;
      Vec dlo, dhi, xlo, xhi;
      load_partial<D, acc_t>(dy + vec_end, count, dlo, dhi);
      load_partial<T, acc_t>(x + vec_end, count, xlo, xhi);
      if constexpr (kWeight) {
        Vec wlo, whi;
        load_partial<acc_t, acc_t>(weight + vec_end, count, wlo, whi);
        dlo = dlo * wlo;
        dhi = dhi * whi;
      }
      sum_g_lo = sum_g_lo + dlo;  // padded lanes add g = 0
      sum_g_hi = sum_g_hi + dhi;
      // A padded lane's xhat is that of x = 0, non-finite with non-finite statistics: masked.
      Vec gx_lo = dlo * normalized<T>(xlo, vmean, vrstd, voffset),
          gx_hi = dhi * normalized<T>(xhi, vmean, vrstd, voffset);
      keep_first_lanes(count, gx_lo, gx_hi);
      sum_gx_lo = sum_gx_lo + gx_lo;
      sum_gx_hi = sum_gx_hi + gx_hi;
    }
    return std::pair<acc_t, acc_t>(lane_sum(sum_g_lo + sum_g_hi), lane_sum(sum_gx_lo + sum_gx_hi));
  };
  if (prefetch_dy != nullptr) prefetch_last_columns(prefetch_dy + N, N - vec_end);
  const auto [sum_g, sum_gx] = combined_blocks<std::pair<acc_t, acc_t>>(
      vec_end, block_sums, [](const std::pair<acc_t, acc_t>& a, const std::pair<acc_t, acc_t>& b) {
        return std::pair<acc_t, acc_t>(a.first + b.first, a.second + b.second);
      });
  return {kCentered ? sum_g / N : acc_t(0), sum_gx / N};
}

// The mean over one row of f(v), v the row's values as registers of acc_t (f maps one
// register to one): the lanes past the row's end are left out.
template <typename T, typename acc_t, typename F>
C10_ALWAYS_INLINE acc_t row_mean_of(const T* x, int64_t N, F f) {
  using IO = VecIO<T, acc_t>;
  using Vec = Vectorized<acc_t>;
  constexpr int64_t W = IO::kWidth;
  const int64_t vec_end = N - N % W;
  // The sum over the columns [start, end), and the tail with the last block.
  const auto block_sum = [&](int64_t start, int64_t end) {
    Vec sum_lo(0), sum_hi(0);
    for (int64_t i = start; i < end; i += W) {
      Vec lo, hi;
      IO::load_any_order(x + i, lo, hi);  // a sum: any order of the columns will do
      sum_lo = sum_lo + f(lo);
      sum_hi = sum_hi + f(hi);
    }
    if (end == vec_end && vec_end < N) {
      const int64_t count = N - vec_end;
      Vec lo, hi;
      load_partial<T, acc_t>(x + vec_end, count, lo, hi);
      lo = f(lo);
      hi = f(hi);
      keep_first_lanes(count, lo, hi);  // a padded lane holds f(0)
      sum_lo = sum_lo + lo;
      sum_hi = sum_hi + hi;
    }
    return lane_sum(sum_lo + sum_hi);
  };
  return combined_blocks<acc_t>(vec_end, block_sum, std::plus<acc_t>()) / N;
}

// mean(xhat) over one row, xhat = (x - mean) * rstd as the backward computes it: a sweep
// of its own, from cache after row_grad_means, for the rows that needs_mean_correction
// picks, so that rows near zero do not pay for it (a sum inside row_grad_means cost every
// 16-bit backward: docs/perf-notes.md, "Code comments: row_mean_xhat").
template <typename T, typename acc_t>
acc_t row_mean_xhat(const T* x, acc_t mean, acc_t rstd, int64_t N) {
  using Vec = Vectorized<acc_t>;
  const Vec vmean(mean), vrstd(rstd), voffset(xhat_offset<T>(mean, rstd, acc_t(0)));
  return row_mean_of<T, acc_t>(
      x, N, [&](const Vec& v) { return normalized<T>(v, vmean, vrstd, voffset); });
}

// mean(x - mean) over one row: the part of the row's mean that a rounded mean lost.
template <typename T, typename acc_t>
acc_t row_mean_rest(const T* x, acc_t mean, int64_t N) {
  using Vec = Vectorized<acc_t>;
  const Vec vmean(mean);
  return row_mean_of<T, acc_t>(x, N, [&](const Vec& v) { return v - vmean; });
}

// y from given statistics (mean null: RMSNorm), as the forward computes it: ((x - mean) -
// rest) * rstd, with rest the part of the row's mean that the saved float lost, found again
// (row_mean_rest) for the rows where it matters (needs_mean_correction). So the LayerNorm +
// FFN block's backward recomputes the forward's normalized values, not ones up to 2^-24 *
// |mean| * rstd away (float32 1e4 + N(0, 1): up to 4.9e-4).
template <typename T, typename acc_t, bool kWeight, bool kBias>
void norm_apply_rows(const T* x, const acc_t* mean, const acc_t* rstd, const acc_t* weight,
                     const acc_t* bias, T* y, int64_t M, int64_t N) {
  parallel_chunks(M, row_grain(N), [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const T* xr = x + row * N;
      const acc_t m = mean ? mean[row] : acc_t(0), s = rstd[row];
      const acc_t rest =
          mean && needs_mean_correction<true>(m, s) ? row_mean_rest<T>(xr, m, N) : acc_t(0);
      normalize_row<T, acc_t, kWeight, kBias>(xr, y + row * N, N, m, rest, s, weight, bias,
                                                 false, false);
    }
  });
}

// How many tiles ahead the backward asks for the dy and x it will read (see
// norm_bwd_column_block): 16-bit rows are half as many bytes.
template <typename T>
constexpr int64_t kPrefetchTiles = sizeof(T) == 2 ? 2 : 1;

// Rows processed together in the second sweep, so that the dweight/dbias partials are
// read and written once per tile instead of once per row. Two, not more: when a row is a
// multiple of 4 KiB (N = 1024 float32, 2048 bfloat16, ...) the tile's rows of dy, x, dsum
// and dx all fall in the same L1 set (8 ways), which four rows overflowed; one row is
// slower again (docs/perf-notes.md, "Code comments: kRowTile").
constexpr int64_t kRowTile = 2;
static_assert(StagedTileStream::kMaxRows >= kRowTile);

// The rows of a backward tile: kRowTile, or one where dx is streamed from blocks narrower
// than a cache line (16-bit rows on AVX2: 32 of a line's 64 bytes) and the rows lie a
// multiple of 4 KiB apart. Two such rows keep two half-written streamed lines at the same
// address modulo 4096, and each block's stores then wait on them: 1.6x slower than plain
// stores or than one row a tile (docs/perf-notes.md, "Code comments: bwd_tile_rows").
template <typename T, typename acc_t>
inline int64_t bwd_tile_rows(OutputPath path, int64_t N) {
  constexpr bool kPartLines =
      kNonTemporalStores && VecIO<T, acc_t>::kWidth * int64_t(sizeof(T)) < kCacheLine;
  const bool rows_alias = N * int64_t(sizeof(T)) % 4096 == 0;
  return kPartLines && path == OutputPath::kStream && rows_alias ? 1 : kRowTile;
}

// Pointers of one backward call: x is what was normalized (the sum with a residual), mean
// null for RMSNorm, dsum (the gradient of the sum output) null when there is none, the
// partials null without parameter gradients. D: dy's type, T's or float16/bfloat16 beside
// a float32 T (a float32 sum of residual_dtype, whose norm output has the input's dtype).
// dx_input (the kInputGrad kernels only): the add ops' input gradient, dx (rounded to T)
// times the forward's multipliers, rounded once to D (dropout_scale_rows' values).
template <typename T, typename acc_t, typename D = T>
struct NormBwdArgs {
  const D* dy;
  const T* dsum;
  const T* x;
  const acc_t* mean;
  const acc_t* rstd;
  const acc_t* weight;
  T* dx;
  int64_t M, N;
  bool weight_finite;  // no NaN or infinity in weight (true without one)
  D* dx_input = nullptr;
  RowMultipliers<acc_t> multipliers{};  // inactive: m = 1 (dx rounded to D)
};

// dx_input = round_D(round_T(v) * m) over the columns [i, i + kWidth) of row `row` (a short
// block: the `count` from i), v the block's unrounded dx: the second pass of
// dropout_scale_rows done while the row is in registers. row_m: the row's multipliers
// (norm_bwd_tile's, with dropout), else null: fill's for the block.
template <typename T, typename acc_t, bool kPartial, typename D>
C10_ALWAYS_INLINE void store_input_grad(const NormBwdArgs<T, acc_t, D>& a, int64_t row,
                                        int64_t i, int64_t count, const acc_t* row_m,
                                        const Vectorized<acc_t>& lo,
                                        const Vectorized<acc_t>& hi) {
  using Vec = Vectorized<acc_t>;
  constexpr int64_t W = VecIO<T, acc_t>::kWidth;
  constexpr int64_t H = Vec::size();
  Vec rlo = lo, rhi = hi;
  if constexpr (!std::is_same_v<T, acc_t>) {  // round to T, as dx holds it
    alignas(64) T rounded[W];
    VecIO<T, acc_t>::store(rounded, lo, hi);
    VecIO<T, acc_t>::load(rounded, rlo, rhi);
  }
  const int64_t lanes = kPartial ? count : W;  // a tail's W columns all lie in the row
  Vec mlo, mhi;
  if (row_m != nullptr) {  // loadu with a count: the lanes past it are 0
    mlo = Vec::loadu(row_m + i, std::min<int64_t>(lanes, H));
    mhi = Vec::loadu(row_m + i + H, std::max<int64_t>(lanes - H, 0));
  } else if (!a.multipliers.dropout.active()) {
    // No draws: one factor for the row (rowscale, or 1); lanes past `count` are not stored.
    mlo = mhi = Vec(a.multipliers.factor(row));
  } else {
    alignas(64) acc_t m[W];
    a.multipliers.fill(row, i, lanes, a.multipliers.factor(row), m);
    for (int64_t j = lanes; j < W; ++j) m[j] = acc_t(0);
    mlo = Vec::loadu(m);
    mhi = Vec::loadu(m + H);
  }
  store_block<kPartial, false>(a.dx_input + row * a.N + i, count, rlo * mlo, rhi * mhi);
}

// Row statistics of a backward tile: the forward's mean and rstd, and row_grad_means.
template <typename acc_t>
struct TileStats {
  acc_t mean[kRowTile], rstd[kRowTile];
  acc_t xhat_offset[kRowTile];    // normalized()'s offset, the correction included
  acc_t dx_offset[kRowTile];      // -rstd * mean(g)
  acc_t dx_xhat_scale[kRowTile];  // rstd * mean(g * xhat), of the corrected xhat
  const acc_t* multipliers = nullptr;  // kInputGrad with dropout: the tile's, rows N apart
};

// Whether a tile's dx may use the bfloat16 rounding without a NaN mask. That rounding is
// exact for every float except NaNs whose payload sits in the low 16 bits (they would come
// out as infinity, or carry into the sign). The NaNs a backward can make are x86's default
// NaN (0xffc00000) or one propagated from an operand; dy, x and dsum are bfloat16 (their
// NaNs have 16 zero low bits and a non-zero upper payload), so it is enough that the float
// operands (weight, mean, rstd) hold no NaN at all.
template <typename acc_t>
inline bool tile_rounds_without_nan_mask(bool weight_finite, const TileStats<acc_t>& s,
                                         int64_t rows) {
  if (!weight_finite) return false;
  for (int64_t r = 0; r < rows; ++r) {
    if (!std::isfinite(s.mean[r]) || !std::isfinite(s.rstd[r])) return false;
  }
  return true;
}

// The column blocks of a row: full blocks of kWidth columns; a row's last columns as the
// overlapping tail (the kWidth columns that end the row, of which only the last `count`
// are new: see blend_last_lanes); or, for a row shorter than kWidth, one block of its
// `count` columns with the other lanes zero and never touched in memory.
enum class Block { kFull, kTail, kShort };

// dx = rstd * (g - mean(g) - xhat * mean(g * xhat)) (+ dsum) for kRows (<= kRowTile)
// consecutive rows from `row`, and (kParamGrads) their dy * xhat and dy added to the
// partials, over the columns [i, i + kWidth) (a short block: the `count` from i). dx goes
// to dx_tile (a.dx at `row`, or a staging buffer), rows N apart; stream: full blocks with
// streaming stores. The rows were just read by row_grad_means: this sweep is served from
// cache.
template <typename T, typename acc_t, int64_t kRows, bool kCentered, bool kWeight,
          bool kParamGrads, bool kNoNaN, Block kBlock, bool kInputGrad, typename D>
C10_ALWAYS_INLINE void norm_bwd_column_block(const NormBwdArgs<T, acc_t, D>& a, int64_t row,
                                             const TileStats<acc_t>& s,
                                             T* dx_tile, acc_t* dweight_part,
                                             acc_t* dbias_part, int64_t i, int64_t count,
                                             bool stream) {
  using Vec = Vectorized<acc_t>;
  constexpr bool kPartial = kBlock == Block::kShort;  // masked loads and stores
  const int64_t N = a.N;
  const D* dy = a.dy + row * N + i;
  const T* x = a.x + row * N + i;
  const T* dsum = a.dsum ? a.dsum + row * N + i : nullptr;
  T* dx = dx_tile + i;
  Vec wlo(1), whi(1), pw_lo(0), pw_hi(0), pb_lo(0), pb_hi(0);
  if constexpr (kWeight) load_block<kPartial>(a.weight + i, count, wlo, whi);
  if constexpr (kParamGrads) {
    load_block<kPartial>(dweight_part + i, count, pw_lo, pw_hi);
    if constexpr (kCentered) load_block<kPartial>(dbias_part + i, count, pb_lo, pb_hi);
  }
  const Vec pw_in_lo = pw_lo, pw_in_hi = pw_hi, pb_in_lo = pb_lo, pb_in_hi = pb_hi;
  // The dy and x of a tile ahead, asked for while this sweep computes from cache:
  // its row_grad_means would otherwise wait on memory with nothing else in flight. 16-bit
  // rows two tiles ahead, about as many bytes as the next tile of float32 rows (float32 lost
  // time two tiles ahead). A residual's dsum, read only by this sweep, is asked for with
  // them. When dx is streamed, dy is asked for by the first sweep instead (norm_bwd_tile).
  // Figures: docs/perf-notes.md, "Code comments: norm_bwd_column_block: kAhead".
  constexpr int64_t kAhead = kPrefetchTiles<T> * kRows;
  if (kBlock == Block::kFull && row + kAhead < a.M) {
    const int64_t next_rows = std::min(kRows, a.M - row - kAhead);
    for (int64_t r = kAhead; r < kAhead + next_rows; ++r) {
      if (!stream) prefetch_block<D, acc_t>(dy + r * N);
      prefetch_block<T, acc_t>(x + r * N);
      if (dsum != nullptr) prefetch_block<T, acc_t>(dsum + r * N);
    }
  } else if (kBlock != Block::kFull && row + kAhead < a.M) {  // and the rows' last lines
    const int64_t next_rows = std::min(kRows, a.M - row - kAhead);
    for (int64_t r = kAhead; r < kAhead + next_rows; ++r) {
      const int64_t row_end = r * N + N - i;  // from this block's columns
      if (!stream) prefetch_last_columns(dy + row_end, count);
      prefetch_last_columns(x + row_end, count);
      if (dsum != nullptr) prefetch_last_columns(dsum + row_end, count);
    }
  }
  // Every load of this column block before any store to it: rows of 4 KiB multiples (N =
  // 1024 float32, 2048 bfloat16, ...) put dx and the next row's dy / x at the same
  // address modulo 4096, and a load behind such a store waits for it (4K aliasing;
  // docs/perf-notes.md, "Code comments: norm_bwd_column_block: loads before stores").
  // dx = (g * rstd + (-rstd * mean(g))) - xhat * (rstd * mean(g * xhat)), per-row constants
  // from TileStats: three operations instead of four. g * rstd is rounded before the add
  // (no fma), so that it cancels exactly against rstd * mean(g) where g is the mean (dx of
  // a one-element row is 0, as in PyTorch).
  Vec out_lo[kRows], out_hi[kRows];
  for (int64_t r = 0; r < kRows; ++r) {
    const Vec vmean(s.mean[r]), vrstd(s.rstd[r]), voffset(s.dx_offset[r]),
        vxhat_scale(s.dx_xhat_scale[r]), vxhat_offset(s.xhat_offset[r]);
    Vec dlo, dhi, xlo, xhi;
    load_block<kPartial>(dy + r * N, count, dlo, dhi);
    load_block<kPartial>(x + r * N, count, xlo, xhi);
    xlo = normalized<T>(xlo, vmean, vrstd, vxhat_offset);
    xhi = normalized<T>(xhi, vmean, vrstd, vxhat_offset);
    const Vec glo = kWeight ? dlo * wlo : dlo, ghi = kWeight ? dhi * whi : dhi;
    out_lo[r] = at::vec::fnmadd(xlo, vxhat_scale, glo * vrstd + voffset);
    out_hi[r] = at::vec::fnmadd(xhi, vxhat_scale, ghi * vrstd + voffset);
    if (dsum != nullptr) {  // the sum's own gradient joins in before the one rounding
      Vec slo, shi;
      load_block<kPartial>(dsum + r * N, count, slo, shi);
      out_lo[r] = out_lo[r] + slo;
      out_hi[r] = out_hi[r] + shi;
    }
    if constexpr (kParamGrads) {
      pw_lo = at::vec::fmadd(dlo, xlo, pw_lo);
      pw_hi = at::vec::fmadd(dhi, xhi, pw_hi);
      if constexpr (kCentered) {
        pb_lo = pb_lo + dlo;
        pb_hi = pb_hi + dhi;
      }
    }
  }
  for (int64_t r = 0; r < kRows; ++r) {
    // A tail's repeated lanes rewrite the values the block before stored (or will store:
    // the tail goes first), computed alike: bitwise the same.
    if (kBlock == Block::kFull && stream) {
      VecIO<T, acc_t>::template store_streaming<kNoNaN>(dx + r * N, out_lo[r], out_hi[r]);
    } else {
      store_block<kPartial, kNoNaN>(dx + r * N, count, out_lo[r], out_hi[r]);
    }
  }
  if constexpr (kInputGrad) {
    for (int64_t r = 0; r < kRows; ++r) {
      const acc_t* row_m = s.multipliers != nullptr ? s.multipliers + r * N : nullptr;
      store_input_grad<T, acc_t, kPartial>(a, row + r, i, count, row_m, out_lo[r], out_hi[r]);
    }
  }
  if constexpr (kParamGrads) {
    if constexpr (kBlock == Block::kTail) {  // the repeated lanes keep the partials they had
      blend_last_lanes(count, pw_in_lo, pw_in_hi, pw_lo, pw_hi);
      if constexpr (kCentered) blend_last_lanes(count, pb_in_lo, pb_in_hi, pb_lo, pb_hi);
    }
    store_block<kPartial, false>(dweight_part + i, count, pw_lo, pw_hi);
    if constexpr (kCentered) store_block<kPartial, false>(dbias_part + i, count, pb_lo, pb_hi);
  }
}

// All column blocks of one backward tile of kRows rows, the row's last columns included.
// The row count is a template argument so that the tile's registers stay registers: with
// a run-time count the compiler kept them on the stack (docs/perf-notes.md, "Code comments:
// norm_bwd_tile_columns").
template <typename T, typename acc_t, int64_t kRows, bool kCentered, bool kWeight,
          bool kParamGrads, bool kNoNaN, bool kInputGrad, typename D>
void norm_bwd_tile_columns(const NormBwdArgs<T, acc_t, D>& a, int64_t row,
                           const TileStats<acc_t>& s, T* dx_tile, acc_t* dweight_part,
                           acc_t* dbias_part, bool stream, StagedTileStream* staged) {
  constexpr int64_t W = VecIO<T, acc_t>::kWidth;
  // Local copies: through the references, every vector store (which may alias anything)
  // made the compiler reload the pointers and row constants.
  const NormBwdArgs<T, acc_t, D> args = a;
  const TileStats<acc_t> stats = s;
  const int64_t vec_end = args.N - args.N % W;
  // The tail first, so that no load of the partials meets a store to the same lines still
  // in flight (a tail last loads, in part, what the block just before stored).
  if (vec_end < args.N && vec_end > 0) {
    norm_bwd_column_block<T, acc_t, kRows, kCentered, kWeight, kParamGrads, kNoNaN,
                          Block::kTail, kInputGrad>(args, row, stats, dx_tile, dweight_part, dbias_part,
                                        args.N - W, args.N - vec_end, stream);
  }
  for (int64_t i = 0; i < vec_end; i += W) {
    norm_bwd_column_block<T, acc_t, kRows, kCentered, kWeight, kParamGrads, kNoNaN,
                          Block::kFull, kInputGrad>(args, row, stats, dx_tile, dweight_part, dbias_part,
                                        i, W, stream);
    // The staged rows' columns before the last kStagedLagBlocks blocks are final.
    if (staged != nullptr) {
      const int64_t final_columns = i + W - kStagedLagBlocks * W;
      for (int64_t r = 0; r < kRows; ++r) staged->written(r, final_columns * int64_t(sizeof(T)));
    }
  }
  if (vec_end == 0 && args.N > 0) {
    norm_bwd_column_block<T, acc_t, kRows, kCentered, kWeight, kParamGrads, kNoNaN,
                          Block::kShort, kInputGrad>(args, row, stats, dx_tile, dweight_part, dbias_part,
                                         0, args.N, stream);
  }
}

// One backward tile: the row sums of row_grad_means, then dx and the partials.
template <typename T, typename acc_t, bool kCentered, bool kWeight, bool kParamGrads,
          bool kInputGrad, typename D>
void norm_bwd_tile(const NormBwdArgs<T, acc_t, D>& a, int64_t row, int64_t rows,
                   acc_t* dweight_part, acc_t* dbias_part, OutputPath path) {
  const int64_t N = a.N;
  TileStats<acc_t> s;
  if (a.dsum != nullptr) {
    // dsum is read only by the second sweep: ask for its rows now, so that they arrive
    // while row_grad_means streams dy and x (else that sweep waits on memory for them).
    prefetch_last_columns(a.dsum + (row + rows) * N, rows * N);
  }
  // With dx streamed, the first sweep asks for the dy of the rows a tile ahead and the
  // second for their x: else all of the next tile's reads are asked for in the second
  // sweep, and memory idles through the first but for dx's stores. Rows staged through
  // cache (N = 1000 float32) gained nothing, and keep both in the second sweep
  // (docs/perf-notes.md, "Code comments: norm_bwd_tile: dy in the first sweep").
  const int64_t ahead = kPrefetchTiles<T> * rows;
  for (int64_t r = 0; r < rows; ++r) {
    s.mean[r] = kCentered ? a.mean[row + r] : acc_t(0);
    s.rstd[r] = a.rstd[row + r];
    const D* prefetch_dy = path == OutputPath::kStream && row + r + ahead < a.M
                               ? a.dy + (row + r + ahead) * N
                               : nullptr;
    const T* x = a.x + (row + r) * N;
    const auto [mean_g, mean_gx] = row_grad_means<T, acc_t, kCentered, kWeight>(
        a.dy + (row + r) * N, x, s.mean[r], s.rstd[r], a.weight, N, prefetch_dy);
    // The correction: the xhat of a row sum to zero in exact arithmetic, and whatever
    // mean(xhat) row_mean_xhat finds (0 where it is not asked) is the error of the saved
    // mean (a float, rounded: for a row at 1e4 + noise, up to 5e-4 of sigma) and of
    // -mean * rstd's rounding, the same in every xhat of the row. The second sweep
    // subtracts it from each xhat, and mean(g * xhat) follows: the backward is then as
    // exact as the forward, which normalizes with the mean's exact rest (1e4 + N(0, 1),
    // float32: dx and dweight 1.2-1.6e-7 from float64, PyTorch's 0.8-1.5e-4 and 4.8-5.0e-4:
    // benchmarks/results/amd-epyc/accuracy_far_rows.md).
    const acc_t correction = needs_mean_correction<kCentered>(s.mean[r], s.rstd[r])
                                 ? row_mean_xhat<T>(x, s.mean[r], s.rstd[r], N)
                                 : acc_t(0);
    s.xhat_offset[r] = xhat_offset<T>(s.mean[r], s.rstd[r], correction);
    s.dx_offset[r] = -s.rstd[r] * mean_g;
    s.dx_xhat_scale[r] = s.rstd[r] * (mean_gx - correction * mean_g);
  }
  // With dropout, the input gradient's multipliers of the whole tile first: a fill per row
  // keeps the draws' vector lanes full, where one per column block left half of them idle.
  ScratchHandle own_multipliers;
  if constexpr (kInputGrad) {
    if (a.multipliers.dropout.active()) {
      acc_t* m = thread_scratch<acc_t, ScratchSlot::kMultipliers>(rows * N, own_multipliers);
      for (int64_t r = 0; r < rows; ++r) {
        a.multipliers.fill(row + r, 0, N, a.multipliers.factor(row + r), m + r * N);
      }
      s.multipliers = m;
    }
  }
  alignas(kCacheLine) char stage[kStageBytes];  // uninitialized: costs no time unused
  T* dx_tile = path == OutputPath::kStaged ? reinterpret_cast<T*>(stage) : a.dx + row * N;
  std::optional<StagedTileStream> staged;
  if (path == OutputPath::kStaged) {
    staged.emplace(reinterpret_cast<char*>(a.dx + row * N), stage, N * int64_t(sizeof(T)), rows);
  }
  StagedTileStream* staged_or_null = staged ? &*staged : nullptr;
  const bool stream = path == OutputPath::kStream;
  static_assert(kRowTile == 2, "the dispatch below knows tiles of two rows and one");
  // Only bfloat16 rounds differently without a NaN mask; other types keep one variant.
  const bool no_nan_mask = std::is_same_v<T, c10::BFloat16> &&
                           tile_rounds_without_nan_mask(a.weight_finite, s, rows);
  dispatch_bool(no_nan_mask, [&](auto kNoNaN) {
    constexpr bool kNoNaNValue = std::is_same_v<T, c10::BFloat16> && decltype(kNoNaN)::value;
    if (rows == 2) {
      norm_bwd_tile_columns<T, acc_t, 2, kCentered, kWeight, kParamGrads, kNoNaNValue,
                            kInputGrad>(
          a, row, s, dx_tile, dweight_part, dbias_part, stream, staged_or_null);
    } else {
      norm_bwd_tile_columns<T, acc_t, 1, kCentered, kWeight, kParamGrads, kNoNaNValue,
                            kInputGrad>(
          a, row, s, dx_tile, dweight_part, dbias_part, stream, staged_or_null);
    }
  });
  if (staged) staged->finish();
}

// dx for all rows, and (kParamGrads) the [blocks, N] dweight/dbias partials of the row
// blocks of num_row_blocks(M, N), for sum_partials to add up. kInputGrad: also a.dx_input,
// from each dx block while it is in registers.
template <typename T, typename acc_t, bool kCentered, bool kWeight, bool kParamGrads,
          bool kInputGrad = false, typename D>
void norm_bwd_rows(const NormBwdArgs<T, acc_t, D>& a, acc_t* partial_w, acc_t* partial_b,
                   int64_t blocks) {
  const int64_t M = a.M, N = a.N;
  // dx is written once and read by the next layer's backward much later.
  // Traffic: dy, x and dx (and dsum).
  const int64_t bytes = M * N * int64_t(sizeof(T));
  const bool stream = use_streaming_stores(a.dx, bytes, (a.dsum != nullptr ? 4 : 3) * bytes);
  const OutputPath path = output_path(stream, a.dx, N, kRowTile);
  const int64_t tile_rows = bwd_tile_rows<T, acc_t>(path, N);
  auto row_range = [&](int64_t begin, int64_t end, acc_t* pw, acc_t* pb) {
    for (int64_t r = begin; r < end; r += tile_rows) {
      norm_bwd_tile<T, acc_t, kCentered, kWeight, kParamGrads, kInputGrad>(
          a, r, std::min(tile_rows, end - r), pw, pb, path);
    }
    if (stream) streaming_fence();
  };
  if constexpr (!kParamGrads) {
    parallel_chunks(M, row_grain(N), [&](int64_t begin, int64_t end) {
      row_range(begin, end, nullptr, nullptr);
    });
    return;
  }
  const int64_t rows_per_block = (M + blocks - 1) / blocks;
  parallel_chunks(blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      acc_t* pw = partial_w + b * N;
      acc_t* pb = partial_b + b * N;
      std::fill(pw, pw + N, acc_t(0));
      if (kCentered) std::fill(pb, pb + N, acc_t(0));
      const int64_t row_begin = std::min(M, b * rows_per_block);
      row_range(row_begin, std::min(M, row_begin + rows_per_block), pw, pb);
    }
  });
}

}  // namespace fusednorm::cpu
