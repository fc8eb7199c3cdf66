#pragma once
// The norm family's forward and backward kernels and their launchers: LayerNorm
// (CENTERED = true) and RMSNorm (CENTERED = false: mean(x^2) instead of a Welford mean and
// variance, no mean, no bias), each with an optional residual (runtime pointers, so that it
// costs no instantiation: forward s = x + residual rounded to T, written out and normalized;
// backward adds grad_sum to dx before its one rounding). The forward with dropout and
// rowscale (s = x * m + residual, common/philox.h's mask) is the same code compiled with
// DROPOUT into kernels of its own (norm_fwd_dropout_kernel), so that the plain ones are
// untouched; likewise the backward that also writes the add ops' input gradient (the sum's
// gradient dx times the forward's multipliers, rounded to the input's dtype): norm_bwd_kernel
// with an InputGradParams argument (its trailing pack; empty in the plain kernels).
// Included by norm_instances.cuh, which setup.py compiles once per kind, pass and input
// dtype; the entries at the end (norm_fwd_cuda, norm_fwd_dropout_cuda, norm_bwd_cuda,
// norm_bwd_input_grad_cuda) are what those files instantiate. Everything else here has
// internal linkage: each of those files holds its own copies of what it uses.
//
// Work layout. A row (or, for rows longer than a kernel holds, a chunk of a row) is handled
// by TPR threads; thread t of a row holds the 16-byte packs t, t + TPR, ..., t + (ITEMS-1)*TPR
// in registers between reading them and writing the result, so every element is read from
// memory once. TPR and ITEMS come from a size bucket (norm_config.cuh, with every other
// tuning choice); a block of fewer than 128 threads per row takes 128 / TPR rows side by
// side. Blocks stride over row groups
// (grid.x) and chunks (grid.y), so no grid limit binds and offsets are int64.
//
// Rows that do not fit one kernel's registers are split into chunks. On sm_90 and newer, up
// to 8 chunks are held by the blocks of a thread-block cluster (the CLUSTER instantiations),
// which exchange their chunks' statistics through distributed shared memory: the row is
// still read once. Elsewhere (and for more chunks) a first launch writes per-chunk partial
// results (Welford summaries; backward sums), a small kernel merges each row's chunks in a
// fixed order, and a second launch of the same kernel applies them.
//
// Inputs whose pointers are not 16-byte aligned or whose N is not a multiple of the pack
// width take the same kernels with one-element packs (VEC = 1).

#include <c10/cuda/CUDAException.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <cmath>
#include <cstdint>
#include <iterator>
#include <limits>
#include <tuple>
#include <type_traits>
#include <utility>

#include "common/philox.h"
#include "common/welford.h"
#include "cuda/cluster.cuh"
#include "cuda/device_utils.cuh"
#include "cuda/norm_config.cuh"
#include "cuda/norm_launch.h"

// at::cuda::philox::unpack of norm_launch.h's at::PhiloxCudaState (no other ATen header).
#include <ATen/cuda/PhiloxUtils.cuh>

namespace fusednorm::cuda {
namespace {

// ---------------------------------------------------------------------------------------
// Size buckets (the tables are in norm_config.cuh)

template <typename Table>
constexpr int kNumBuckets = static_cast<int>(std::size(Table::kList));

template <typename Table>
constexpr int64_t bucket_capacity(int i) {
  return int64_t(Table::kList[i].tpr) * Table::kList[i].items;
}

// How a row is cut: `chunks` chunks of `chunk` elements (the last may be shorter), each
// handled by bucket `bucket`.
struct RowSplit {
  int bucket;
  int64_t chunk;
  int64_t chunks;
};

template <typename Table>
RowSplit split_row(int64_t N, int vec) {
  const int64_t packs = ceil_div(N, vec);
  const int64_t largest = bucket_capacity<Table>(kNumBuckets<Table> - 1);
  const int64_t chunks = std::max<int64_t>(1, ceil_div(packs, largest));
  const int64_t packs_per_chunk = ceil_div(packs, chunks);
  int bucket = kNumBuckets<Table> - 1;
  for (int i = 0; i < kNumBuckets<Table>; ++i) {
    if (bucket_capacity<Table>(i) >= packs_per_chunk) {
      bucket = i;
      break;
    }
  }
  return {bucket, packs_per_chunk * vec, chunks};
}

// Calls fn(integral_constant<tpr>, integral_constant<items>) for the bucket `index` of Table:
// the only place where a runtime bucket becomes template arguments, so exactly the buckets
// of the tables are instantiated.
template <typename Table, typename Fn, std::size_t... I>
void visit_bucket_impl(int index, Fn& fn, std::index_sequence<I...>) {
  (void)((index == static_cast<int>(I)
              ? (fn(std::integral_constant<int, Table::kList[I].tpr>{},
                    std::integral_constant<int, Table::kList[I].items>{}),
                 true)
              : false) ||
         ...);
}

template <typename Table, typename Fn>
void visit_bucket(int index, Fn&& fn) {
  visit_bucket_impl<Table>(index, fn, std::make_index_sequence<kNumBuckets<Table>>{});
}

// ---------------------------------------------------------------------------------------
// Device helpers

// Correctly rounded 1/sqrt(v) (no division: its slow-path call made the large buckets spill).
// rstd = 1 / sqrt(v), v = sum / N + eps with sum the row's sum of squares (or of squared
// deviations); NaN where sum overflowed to infinity (docs/DESIGN.md, Numerics: a row whose
// statistics overflow). An eps that overflows v gives 0, as PyTorch's.
__device__ __forceinline__ float inverse_sqrt(float sum, float v) {
  return isinf(sum) ? std::numeric_limits<float>::quiet_NaN() : __frsqrt_rn(v);
}
__device__ __forceinline__ double inverse_sqrt(double sum, double v) {
  return isinf(sum) ? std::numeric_limits<double>::quiet_NaN() : 1.0 / sqrt(v);
}

// kLanes Welford summaries that have all seen `count` values, merged into one (Chan's
// formula for equal counts: the mean of the means, and the spread of the means).
template <int kLanes, typename acc_t>
__device__ __forceinline__ WelfordState<acc_t> merge_lanes(const acc_t (&mean)[kLanes],
                                                           const acc_t (&m2)[kLanes],
                                                           int count) {
  WelfordState<acc_t> s;
  if (count == 0) return s;
  acc_t mean_sum = 0, m2_sum = 0;
#pragma unroll
  for (int l = 0; l < kLanes; ++l) {
    mean_sum += mean[l];
    m2_sum += m2[l];
  }
  s.mean = mean_sum / acc_t(kLanes);
  acc_t spread = 0;
#pragma unroll
  for (int l = 0; l < kLanes; ++l) {
    const acc_t d = mean[l] - s.mean;
    spread = fma_acc(d, d, spread);
  }
  s.m2 = fma_acc(acc_t(count), spread, m2_sum);
  s.count = acc_t(count) * acc_t(kLanes);
  return s;
}

// Sums of v[0], ..., v[K-1] over a row's TPR threads, the same bits in every thread of the
// row. red: this row's K * kWarps slots of shared memory, not read since the last barrier by
// any thread (the callers alternate two buffers, so one barrier per reduction suffices).
// Every value is reduced whether used or not: a shuffle under a condition the compiler
// cannot prove uniform made the 16-bit backward buckets of 4 packs spill.
// The warps' partial sums: with a power-of-two count, each group of kWarps lanes holds them
// all and sums them in log2(kWarps) steps (the issue-bound forward runs two of these per row);
// otherwise lanes past kWarps hold 0 and the whole warp sums.
template <int kWarps, int K, typename acc_t>
__device__ __forceinline__ void row_sums(acc_t (&v)[K], acc_t* red) {
#pragma unroll
  for (int k = 0; k < K; ++k) v[k] = warp_sum(v[k]);
  if constexpr (kWarps > 1) {
    const int lane = threadIdx.x % kWarpSize;
    const int warp = (threadIdx.x / kWarpSize) % kWarps;
    if (lane == 0) {
#pragma unroll
      for (int k = 0; k < K; ++k) red[K * warp + k] = v[k];
    }
    __syncthreads();
    if constexpr ((kWarps & (kWarps - 1)) == 0) {
#pragma unroll
      for (int k = 0; k < K; ++k) v[k] = group_sum<kWarps>(red[K * (lane % kWarps) + k]);
    } else {
#pragma unroll
      for (int k = 0; k < K; ++k) v[k] = warp_sum(lane < kWarps ? red[K * lane + k] : acc_t(0));
    }
  }
}

// The row's summary from its threads' when the row's count is known (count: the chunk's
// elements; inv_count: its reciprocal, 0 for an empty chunk), the same bits in every thread
// of the row. Chan's formula for all the parts at once: mean = sum(n_t * mean_t) / count,
// m2 = sum(m2_t + n_t * (mean_t - mean)^2), every term of the second sum >= 0. Two sums of
// one value instead of warp_merge's pairwise merges (five a warp, each with a division and
// branches on empty parts), which cost the issue-bound 16-bit forward a large share of its
// instructions. red: this row's 2 * kWarps slots of shared memory (as for row_sums).
template <int kWarps, typename acc_t>
__device__ __forceinline__ WelfordState<acc_t> row_merge_counted(const WelfordState<acc_t>& t,
                                                                 acc_t count, acc_t inv_count,
                                                                 acc_t* red) {
  WelfordState<acc_t> s;
  s.count = count;
  acc_t sum[1] = {t.count * t.mean};
  row_sums<kWarps>(sum, red);
  s.mean = sum[0] * inv_count;
  const acc_t d = t.mean - s.mean;  // threads with no values: 0 * d + 0 adds nothing
  acc_t m2[1] = {fma_acc(t.count * d, d, t.m2)};
  row_sums<kWarps>(m2, red + kWarps);
  s.m2 = m2[0];
  return s;
}

// The row's summary of a thread's valid packs from shifted sums (kFwdShiftedSums), the same
// bits in every thread of the row: v = x - shift, sum(v) and sum(v^2) reduced together, mean = sum / count, m2 = sum(v^2) - sum * mean. The difference
// keeps its precision while the shift is within 4 standard deviations of the mean (mean^2 <=
// 16 variance: m2 >= sum(v^2) / 17); a row past that (a shift among outliers) takes a second
// pass over its registers, m2 = sum((v - mean)^2). Every row of the block (of the warp, for a
// row per warp) takes that pass when one needs it, so that its reduction's barrier and
// shuffles are reached by all threads. red: this row's 3 * kWarps slots (as for row_sums).
template <int kWarps, int kRows, typename T, int VEC, int ITEMS, typename acc_t>
__device__ __forceinline__ WelfordState<acc_t> shifted_sums_summary(
    const Pack<T, VEC> (&xs)[ITEMS], int valid, acc_t shift, acc_t count, acc_t inv_count,
    acc_t* red) {
  acc_t sums[2] = {0, 0};  // sum(v), sum(v^2)
#pragma unroll
  for (int i = 0; i < ITEMS; ++i) {
    if (i < valid) {
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        const acc_t v = pack_acc(xs[i], e) - shift;
        sums[0] += v;
        sums[1] = fma_acc(v, v, sums[1]);
      }
    }
  }
  row_sums<kWarps>(sums, red);
  WelfordState<acc_t> s;
  s.count = count;
  s.mean = sums[0] * inv_count;
  s.m2 = fma_acc(-sums[0], s.mean, sums[1]);
  // count * mean^2 > 16/17 sum(v^2), i.e. mean^2 > 16 variance.
  bool again = acc_t(17) * sums[0] * s.mean > acc_t(16) * sums[1];
  if constexpr (kWarps > 1 && kRows > 1) again = __syncthreads_or(again);
  if (again) {
    acc_t m2[1] = {0};
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      if (i < valid) {
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
          const acc_t d = (pack_acc(xs[i], e) - shift) - s.mean;
          m2[0] = fma_acc(d, d, m2[0]);
        }
      }
    }
    row_sums<kWarps>(m2, red + 2 * kWarps);
    s.m2 = m2[0];
  }
  return s;
}

// The row's summary over the blocks of a cluster (each holds one chunk), merged in block-rank
// order: the same bits in every thread of every block. slot: this block's 3 words for the
// row, in a buffer that no block has read since the previous cluster barrier (the callers
// alternate two, and every block passes a cluster barrier per row).
template <typename acc_t>
__device__ __forceinline__ WelfordState<acc_t> cluster_merge(const WelfordState<acc_t>& s,
                                                             acc_t* slot, bool writer,
                                                             int blocks) {
  if (writer) {
    slot[0] = s.mean;
    slot[1] = s.m2;
    slot[2] = s.count;
  }
  cluster_sync();
  WelfordState<acc_t> total;
  for (int r = 0; r < blocks; ++r) {
    const acc_t* peer = cluster_peer(slot, r);
    WelfordState<acc_t> t;
    t.mean = peer[0];
    t.m2 = peer[1];
    t.count = peer[2];
    total = chan_merge(total, t);
  }
  return total;
}

// Sums of v[0], ..., v[K-1] over the blocks of a cluster, in block-rank order (as
// cluster_merge). slot: K words.
template <int K, typename acc_t>
__device__ __forceinline__ void cluster_sums(acc_t (&v)[K], acc_t* slot, bool writer,
                                             int blocks) {
  if (writer) {
#pragma unroll
    for (int k = 0; k < K; ++k) slot[k] = v[k];
  }
  cluster_sync();
#pragma unroll
  for (int k = 0; k < K; ++k) v[k] = acc_t(0);
  for (int r = 0; r < blocks; ++r) {
    const acc_t* peer = cluster_peer(slot, r);
#pragma unroll
    for (int k = 0; k < K; ++k) v[k] += peer[k];
  }
}

// What a launch of the row kernels does with its chunk of each row.
enum RowMode : int {
  kFull = 0,     // whole rows: statistics/sums in the block, then the output
  kPartial = 1,  // chunks: write the chunk's Welford summary / backward sums only
  kApply = 2,    // chunks: read the merged per-row values, write the output
};

// ---------------------------------------------------------------------------------------
// Forward

// IO: the type of x and y (T's, or 16-bit beside a float T: see NormFwdArgs).
template <typename T, typename P, typename IO = T>
struct FwdParams {
  using acc_t = acc_type_t<T>;
  const IO* x;
  const T* residual;  // nullable: normalize s = x + residual (rounded to T)
  const IO* residual_io;  // IO != T only, instead of residual: a residual of IO's type
  const P* weight;    // nullable
  const P* bias;      // nullable
  IO* y;
  T* sum;             // s, written when residual is set
  acc_t* mean;        // unused (null) when not CENTERED
  acc_t* rstd;
  // kPartial: [M, chunks, 3] (mean, m2, count) of x - shift; not CENTERED: (sum of x^2, 0, 0)
  acc_t* partial;
  acc_t* mean_rest;  // kApply, CENTERED: [M] what the float mean lost (nearest_and_rest)
  int64_t M, N;
  int64_t chunk, chunks;
  // 1 / the elements of a chunk: of every chunk but the last, of the last; 1 / N (all 0 for
  // N = 0). Reciprocals from the host: no division per row.
  acc_t inv_chunk, inv_last_chunk, inv_n;
  acc_t eps;
  int mode;
};

// Element i of what is normalized: x[i], or x[i] + residual[i] rounded to T (added in the
// accumulator type, as the CPU kernels and eager `x + residual` do).
template <typename T, typename IO>
__device__ __forceinline__ T normalized_input(const IO* x, const T* residual,
                                              const IO* residual_io, int64_t i) {
  if (residual != nullptr) return static_cast<T>(to_acc(x[i]) + to_acc(residual[i]));
  if constexpr (std::is_same_v<T, IO>) {
    return x[i];
  } else {
    if (residual_io != nullptr) return static_cast<T>(to_acc(x[i]) + to_acc(residual_io[i]));
    return static_cast<T>(to_acc(x[i]));
  }
}

// A pack of IO as T (exact: IO is T or narrower).
template <typename T, typename IO, int VEC>
__device__ __forceinline__ Pack<T, VEC> pack_as(const Pack<IO, VEC>& in) {
  if constexpr (std::is_same_v<T, IO>) {
    return in;
  } else {
    Pack<T, VEC> out;
#pragma unroll
    for (int e = 0; e < VEC; ++e) out.v[e] = static_cast<T>(pack_acc(in, e));
    return out;
  }
}

// Whether the forward adds a residual, and its pack at `at` as T: of T, or (IO != T, the
// float32 sum of 16-bit inputs) one of IO's type, widened on load. With IO = T only
// `residual` exists.
template <typename T, typename P, typename IO>
__device__ __forceinline__ bool has_residual(const FwdParams<T, P, IO>& p) {
  if constexpr (!std::is_same_v<T, IO>) {
    if (p.residual_io != nullptr) return true;
  }
  return p.residual != nullptr;
}

template <int VEC, typename T, typename P, typename IO>
__device__ __forceinline__ Pack<T, VEC> residual_pack(const FwdParams<T, P, IO>& p, int64_t at) {
  if constexpr (!std::is_same_v<T, IO>) {
    if (p.residual_io != nullptr) return pack_as<T>(load_pack<VEC>(p.residual_io + at));
  }
  return load_pack<VEC>(p.residual + at);
}

// The shift of a LayerNorm row of N > 0 values starting at row_start (median_of_three). The
// same in every chunk of a row: all read the row's first values.
template <typename T, typename IO>
__device__ __forceinline__ acc_type_t<T> row_shift(const IO* x, const T* residual,
                                                   const IO* residual_io, int64_t row_start,
                                                   int64_t N) {
  return row_shift_of<acc_type_t<T>>(N, [&](int64_t i) {
    return to_acc(normalized_input(x, residual, residual_io, row_start + i));
  });
}

// ---------------------------------------------------------------------------------------
// Dropout and rowscale (norm_fwd_dropout_cuda): s = x * m + residual, m and the mask as
// common/philox.h defines them, x * m rounded in acc_t before the add (mul_rn: never fused
// into it), as the CPU kernels do, so that both give one sum for one (seed, offset).

// The multipliers of a launch: the second argument of the dropout kernels only (the plain
// kernels' argument and code stay as they were).
template <typename acc_t>
struct DropoutParams {
  at::PhiloxCudaState philox;  // unpacked in the kernel: a captured graph replays new values
  uint64_t threshold;          // philox::dropout_threshold(p); 0 keeps all, without draws
  acc_t keep_scale;            // philox::keep_scale(p)
  const acc_t* rowscale;       // nullable: [M]
  int64_t* rng_state;          // nullable: (seed, offset) written by one thread
};

struct PhiloxKey {
  uint64_t seed, offset;
};

__device__ __forceinline__ PhiloxKey philox_key(const at::PhiloxCudaState& state) {
  const auto [seed, offset] = at::cuda::philox::unpack(state);
  return {seed, offset};
}

// Draw k (0..3, known at run time only) of a block, by selects: an index would put the
// block in local memory.
__device__ __forceinline__ uint32_t draw_at(const philox::Block& b, int k) {
  return k == 0 ? b.v[0] : k == 1 ? b.v[1] : k == 2 ? b.v[2] : b.v[3];
}

// What a kept element of row `row` is multiplied by: keep_scale * rowscale[row], rounded once.
// Multipliers: DropoutParams, or the backward's InputGradParams (the same members).
template <typename Multipliers>
__device__ __forceinline__ auto row_factor(const Multipliers& d, int64_t row) {
  return d.rowscale != nullptr ? mul_rn(d.keep_scale, d.rowscale[row]) : d.keep_scale;
}

// The multipliers m[e] of the elements at + e (flat index row * N + column; `at` a multiple
// of VEC): f where kept, 0 where dropped. A pack of 4 or 8 elements takes whole blocks of
// draws; a pack of 1 or 2, its lanes of one block.
template <int VEC, typename acc_t, typename Multipliers>
__device__ __forceinline__ void dropout_multipliers(acc_t (&m)[VEC], const Multipliers& d,
                                                    PhiloxKey key, int64_t at, acc_t f) {
  const uint64_t first = static_cast<uint64_t>(at);
  if constexpr (VEC % 4 == 0) {
#pragma unroll
    for (int q = 0; q < VEC / 4; ++q) {
      philox::Block b{};  // threshold 0: every draw (0) is kept
      if (d.threshold != 0) b = philox::draws(key.seed, key.offset, first / 4 + q);
#pragma unroll
      for (int k = 0; k < 4; ++k) m[4 * q + k] = philox::keeps(b.v[k], d.threshold) ? f : acc_t(0);
    }
  } else {
    static_assert(4 % VEC == 0, "packs of 1, 2 or a multiple of 4 elements");
    philox::Block b{};
    if (d.threshold != 0) b = philox::draws(key.seed, key.offset, first / 4);
    const int lane = static_cast<int>(first % 4);
#pragma unroll
    for (int e = 0; e < VEC; ++e) {
      m[e] = philox::keeps(draw_at(b, lane + e), d.threshold) ? f : acc_t(0);
    }
  }
}

// Element i of the residual as acc_t (of T, or of IO beside a float T), 0 without one.
template <typename T, typename IO>
__device__ __forceinline__ acc_type_t<T> residual_at(const T* residual, const IO* residual_io,
                                                     int64_t i) {
  if (residual != nullptr) return to_acc(residual[i]);
  if constexpr (!std::is_same_v<T, IO>) {
    if (residual_io != nullptr) return to_acc(residual_io[i]);
  }
  return acc_type_t<T>(0);
}

// row_shift of the sum with dropout: the median of s's first three values (as the sum output
// holds them), from the one or two blocks of draws they fall in. f: the row's factor.
template <typename T, typename IO>
__device__ __forceinline__ acc_type_t<T> row_shift_dropout(
    const IO* x, const T* residual, const IO* residual_io, int64_t row_start, int64_t N,
    const DropoutParams<acc_type_t<T>>& d, PhiloxKey key, acc_type_t<T> f) {
  using acc_t = acc_type_t<T>;
  const uint64_t first = static_cast<uint64_t>(row_start);
  const int lane0 = static_cast<int>(first % 4);
  philox::Block b0{}, b1{};
  if (d.threshold != 0) {
    b0 = philox::draws(key.seed, key.offset, first / 4);
    if (lane0 + std::min<int64_t>(N, 3) > 4) {
      b1 = philox::draws(key.seed, key.offset, first / 4 + 1);
    }
  }
  return row_shift_of<acc_t>(N, [&](int64_t j) {
    const int k = lane0 + static_cast<int>(j);
    const uint32_t draw = k < 4 ? draw_at(b0, k) : draw_at(b1, k - 4);
    const acc_t m = philox::keeps(draw, d.threshold) ? f : acc_t(0);
    const acc_t s = mul_rn(to_acc(x[row_start + j]), m) +
                    residual_at(residual, residual_io, row_start + j);
    return to_acc(static_cast<T>(s));
  });
}

// Packs of a forward kernel's staged row (kFwdStagedRow): [ITEMS][TPR].
template <int TPR, int ITEMS>
constexpr int kFwdStagePacks = ITEMS * TPR;

// Bytes of dynamic shared memory a forward kernel takes (its staged row, or none).
template <typename T, typename P, typename IO, int VEC, int TPR, int ITEMS, bool DROPOUT>
constexpr int kFwdSharedBytes =
    kFwdStagedRow<T, P, IO, VEC, TPR, ITEMS, DROPOUT> ? kFwdStagePacks<TPR, ITEMS> * 16 : 0;

// Statistics are taken of x - shift with shift = the median of the row's first three
// values (row_shift, as the CPU kernel does), so that a row far from zero (1e4 + noise)
// keeps the noise's precision; shift + mean(x - shift) = mean + rest (nearest_and_rest),
// y = ((x - mean) - rest) * rstd * w + b, so that the shift never reaches y.
// At most 64 registers per thread, so that 1024 threads per multiprocessor stay resident
// whatever the bucket (the largest hold 32 registers of packs): several rows in flight per
// multiprocessor let one row's loads overlap another's reductions. The exceptions, at 128
// registers and 512 threads: kFwdMinBlocks.
// CLUSTER: launched in clusters of p.chunks blocks along y (grid.y == p.chunks), mode kFull:
// block y holds chunk y of each row, and the blocks merge their statistics (cluster_merge).
// Not CENTERED (RMSNorm): shift = mean = 0, the statistic is the row's sum of squares
// (row_sums / cluster_sums; one chain per thread, as a pack's elements are independent).
// DROPOUT: s = x * m + residual (DropoutParams d; norm_fwd_dropout_kernel), the multipliers
// applied to each pack as it is loaded, and in the shift's values.
template <typename T, typename P, int VEC, int TPR, int ITEMS, bool CLUSTER, bool CENTERED,
          typename IO, bool DROPOUT>
__device__ __forceinline__ void norm_fwd_rows(const FwdParams<T, P, IO>& p,
                                              const DropoutParams<acc_type_t<T>>& d) {
  using acc_t = acc_type_t<T>;
  using Layout = RowLayout<TPR>;
  __shared__ acc_t red[2][Layout::kRows][3 * Layout::kWarps];
  __shared__ acc_t cluster_slots[CLUSTER ? 2 : 1][Layout::kRows][3];

  const int tid = threadIdx.x % TPR;
  const int slot = threadIdx.x / TPR;
  const int64_t groups = ceil_div(p.M, Layout::kRows);
  // A clustered launch holds whole rows (kFull): the other modes' code compiles out of it
  // (the float64 one spilled with the apply mode's loads in it).
  const int mode = CLUSTER ? int(kFull) : p.mode;
  constexpr bool kHoistParams = kHoistFwdParams<P, VEC, ITEMS>;
  constexpr bool kStaged = kFwdStagedRow<T, P, IO, VEC, TPR, ITEMS, DROPOUT>;
  static_assert(!kStaged || (Layout::kRows == 1 && std::is_same_v<T, IO> &&
                             VEC * sizeof(T) == 16 && !DROPOUT),
                "staged rows: one-row kernels of 16-byte packs of x, without dropout");
  // kStaged: pack i of this thread's next row at stage[i * TPR + tid]; each thread reads back
  // only what it copied.
  Pack<T, VEC>* stage = nullptr;
  if constexpr (kStaged) stage = dynamic_shared<Pack<T, VEC>, kFwdStagePacks<TPR, ITEMS>>();
  int parity = 0;
#if !defined(FUSEDNORM_EMULATION) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
  // Clustered launches need sm_90 (resident_clusters); below it a clustered instantiation
  // only traps. __trap() ends the kernel, so the code after it compiles out (no `return`:
  // nvcc warned for each instantiation that the loop below it was unreachable).
  if constexpr (CLUSTER) __trap();
#endif
  PhiloxKey key{};
  if constexpr (DROPOUT) {
    key = philox_key(d.philox);
    // One thread of the launch that writes the sum (every launch unpacks the same state).
    if (d.rng_state != nullptr && mode != kPartial && blockIdx.x == 0 && blockIdx.y == 0 &&
        threadIdx.x == 0) {
      d.rng_state[0] = static_cast<int64_t>(key.seed);
      d.rng_state[1] = static_cast<int64_t>(key.offset);
    }
  }

  for (int64_t c = blockIdx.y; c < p.chunks; c += gridDim.y) {
    const int64_t col0 = c * p.chunk;
    // Elements of this chunk (at most one bucket's capacity, so offsets in it fit an int).
    const int len = static_cast<int>(std::min(p.chunk, p.N - col0));
    const acc_t inv_len = c + 1 < p.chunks ? p.inv_chunk : p.inv_last_chunk;  // 1 / len
    // kStaged: copies this chunk of row group g2's row (one row per block) into the stage, as
    // one cp.async group; nothing past the rows (g2 is the same for the whole block).
    const auto stage_row = [&](int64_t g2) {
      if (g2 >= groups) return;
      // One address at a time (not unrolled): cp.async takes no offset on its global
      // address, so the unrolled copies held 8 addresses of 64 bits beside the row's packs.
      const IO* src = p.x + g2 * p.N + col0 + int64_t(tid) * VEC;
#pragma unroll 1
      for (int i = 0; i < ITEMS && (i * TPR + tid) * VEC < len; ++i, src += TPR * VEC) {
        async_copy16(stage + i * TPR + tid, src, true);
      }
      async_commit();
    };
    if constexpr (kStaged) stage_row(blockIdx.x);
    // Small buckets keep their parameter packs in registers for all the block's rows
    // (loaded once, not after each row's reduction: a cache round trip per row).
    Pack<P, VEC> w_hoisted[kHoistParams ? ITEMS : 1], b_hoisted[kHoistParams ? ITEMS : 1];
    if constexpr (kHoistParams) {
#pragma unroll
      for (int i = 0; i < ITEMS; ++i) {
        const int off = (i * TPR + tid) * VEC;
        if (off < len && mode != kPartial) {
          if (p.weight != nullptr) w_hoisted[i] = load_pack<VEC>(p.weight + col0 + off);
          if (p.bias != nullptr) b_hoisted[i] = load_pack<VEC>(p.bias + col0 + off);
        }
      }
    }
    for (int64_t g = blockIdx.x; g < groups; g += gridDim.x) {
      const int64_t row = g * Layout::kRows + slot;
      const bool row_ok = row < p.M;
      const int64_t row_start = row_ok ? row * p.N : 0;
      // This thread's first element in the row; pack i is kStride elements further. (Addresses
      // as base + a constant, not base + (i * TPR + tid) * VEC: the buckets of 8 packs kept
      // those offsets in registers, and spilled them.)
      constexpr int kStride = TPR * VEC;
      const int64_t first = row_start + col0 + int64_t(tid) * VEC;
      acc_t factor = 0;  // DROPOUT: what a kept element of the row is multiplied by
      if constexpr (DROPOUT) {
        if (row_ok) factor = row_factor(d, row);
      }

      // Read this thread's packs; the valid ones are a prefix of the ITEMS.
      Pack<T, VEC> xs[ITEMS];
      int valid = 0;
      if constexpr (kStaged) async_wait<0>();  // this row's copies have landed
#pragma unroll
      for (int i = 0; i < ITEMS; ++i) {
        const int off = (i * TPR + tid) * VEC;
        if (row_ok && off < len) {
          if constexpr (kStaged) {
            xs[i] = stage[i * TPR + tid];
          } else {
            xs[i] = pack_as<T>(load_pack<VEC>(p.x + first + i * kStride));
          }
          if (has_residual(p)) {
            // s = x + residual, rounded to T: the sum output, and what is normalized (its
            // rounded values, as the backward sees them).
            const Pack<T, VEC> r = residual_pack<VEC>(p, first + i * kStride);
            if constexpr (DROPOUT) {
              acc_t m[VEC];
              dropout_multipliers<VEC>(m, d, key, first + i * kStride, factor);
#pragma unroll
              for (int e = 0; e < VEC; ++e) {
                xs[i].v[e] = static_cast<T>(mul_rn(pack_acc(xs[i], e), m[e]) + pack_acc(r, e));
              }
            } else {
#pragma unroll
              for (int e = 0; e < VEC; ++e) {
                xs[i].v[e] = static_cast<T>(pack_acc(xs[i], e) + pack_acc(r, e));
              }
            }
            if (mode != kPartial) store_pack<VEC>(p.sum + first + i * kStride, xs[i]);
          }
          valid = i + 1;
        }
      }
      acc_t shift = 0;
      if (CENTERED && mode != kApply && row_ok && p.N > 0) {
        if constexpr (DROPOUT) {
          shift = row_shift_dropout(p.x, p.residual, p.residual_io, row_start, p.N, d, key,
                                    factor);
          // For the merge kernel (norm_merge_stats_dropout_kernel), which overwrites it.
          if (mode == kPartial && c == 0 && tid == 0) p.mean_rest[row] = shift;
        } else {
          shift = row_shift(p.x, p.residual, p.residual_io, row_start, p.N);
        }
      }
      // y = ((x - mean) - mean_rest) * rstd (RMSNorm: x * rstd), computed as
      // fma(x - mean, rstd, -mean_rest * rstd): one operation fewer per element in a kernel
      // bound by its instruction issue, and one rounding fewer.
      acc_t mean = 0, mean_rest = 0, rstd = 0;
      if (mode != kApply && !CENTERED) {
        // RMSNorm: rstd = 1 / sqrt(mean(x^2) + eps).
        acc_t sum_sq = 0;
#pragma unroll
        for (int i = 0; i < ITEMS; ++i) {
          if (i < valid) {
#pragma unroll
            for (int e = 0; e < VEC; ++e) {
              const acc_t v = pack_acc(xs[i], e);
              sum_sq = fma_acc(v, v, sum_sq);
            }
          }
        }
        acc_t row_sum_sq[1] = {sum_sq};
        row_sums<Layout::kWarps>(row_sum_sq, red[parity][slot]);
        if constexpr (CLUSTER) {
          cluster_sums(row_sum_sq, cluster_slots[parity][slot], tid == 0, int(p.chunks));
        }
        sum_sq = row_sum_sq[0];
        parity ^= 1;
        // The next row's copies go out once this row's values are consumed (the reduction's
        // barrier is behind them), to be in flight while this row is written.
        if constexpr (kStaged) stage_row(g + gridDim.x);
        if (mode == kPartial) {
          if (row_ok && tid == 0) {
            acc_t* out = p.partial + (row * p.chunks + c) * 3;
            out[0] = sum_sq;
            out[1] = out[2] = 0;
          }
          continue;
        }
        // An empty row has mean(x^2) = 0, as on the CPU (inv_n = 0, not 0 / 0).
        rstd = inverse_sqrt(sum_sq, sum_sq * p.inv_n + p.eps);
        if (row_ok && tid == 0 && (!CLUSTER || blockIdx.y == 0)) p.rstd[row] = rstd;
      } else if (mode != kApply) {
        WelfordState<acc_t> s;
        if constexpr (kFwdShiftedSums<T>) {
          s = shifted_sums_summary<Layout::kWarps, Layout::kRows>(xs, valid, shift, acc_t(len),
                                                                  inv_len, red[parity][slot]);
        } else {
          // Welford per lane. Lane l's k-th value is element l + k * kLanes of the thread's
          // packs in order, so every update's 1/count is a compile-time constant.
          constexpr int kLanes = kWelfordLanes<VEC>;
          acc_t lane_mean[kLanes], lane_m2[kLanes];
#pragma unroll
          for (int l = 0; l < kLanes; ++l) lane_mean[l] = lane_m2[l] = 0;
#pragma unroll
          for (int i = 0; i < ITEMS; ++i) {
            if (i < valid) {
#pragma unroll
              for (int e = 0; e < VEC; ++e) {
                constexpr int kPerPack = VEC / kLanes;
                const int l = e % kLanes;
                const acc_t inv_count = acc_t(1) / acc_t(i * kPerPack + e / kLanes + 1);
                const acc_t v = pack_acc(xs[i], e) - shift;
                if (i == 0 && e < kLanes) {
                  // A lane's first value: mean v, m2 0, what the update gives for a finite v
                  // (an infinite one makes the row's statistics NaN either way), 3 operations
                  // fewer.
                  lane_mean[l] = v;
                } else {
                  const acc_t delta = v - lane_mean[l];
                  lane_mean[l] = fma_acc(delta, inv_count, lane_mean[l]);
                  lane_m2[l] = fma_acc(delta, v - lane_mean[l], lane_m2[l]);
                }
              }
            }
          }
          s = row_merge_counted<Layout::kWarps>(
              merge_lanes<kLanes>(lane_mean, lane_m2, valid * (VEC / kLanes)), acc_t(len), inv_len,
              red[parity][slot]);
        }
        if constexpr (CLUSTER) {
          s = cluster_merge(s, cluster_slots[parity][slot], tid == 0, int(p.chunks));
        }
        parity ^= 1;
        if constexpr (kStaged) stage_row(g + gridDim.x);  // (as RMSNorm's above)
        if (mode == kPartial) {
          if (row_ok && tid == 0) {
            acc_t* out = p.partial + (row * p.chunks + c) * 3;
            out[0] = s.mean;
            out[1] = s.m2;
            out[2] = s.count;
          }
          continue;
        }
        const NearestAndRest<acc_t> split = nearest_and_rest(shift, s.mean);
        mean = split.nearest;
        mean_rest = split.rest;
        rstd = inverse_sqrt(s.m2, s.m2 * p.inv_n + p.eps);  // s.count is N here: no division per row
        if (row_ok && tid == 0 && (!CLUSTER || blockIdx.y == 0)) {
          p.mean[row] = mean;
          p.rstd[row] = rstd;
        }
      } else if (row_ok) {
        if constexpr (CENTERED) {
          mean = p.mean[row];
          mean_rest = p.mean_rest[row];
        }
        rstd = p.rstd[row];
      }
      const acc_t neg_rest_scaled = -mean_rest * rstd;  // LayerNorm only

#pragma unroll
      for (int i = 0; i < ITEMS; ++i) {
        if (i < valid) {
          const auto xhat = [&](int e) {
            if constexpr (CENTERED) {
              return fma_acc(pack_acc(xs[i], e) - mean, rstd, neg_rest_scaled);
            } else {
              return pack_acc(xs[i], e) * rstd;
            }
          };
          // One branch per affine case, each loading what it uses: parameter packs that
          // might be unset were unpacked element by element into separate registers.
          // Parameters wider than T (float beside 16-bit x) are taken 16 bytes at a time, so
          // that fewer parameter registers are live at once (8 instead of 16 per pack).
          constexpr int kSub = std::min<int>(VEC, 16 / int(sizeof(P)));
          Pack<IO, VEC> out;
#pragma unroll
          for (int h = 0; h < VEC / kSub; ++h) {
            const int64_t at = col0 + tid * VEC + i * kStride + h * kSub;
            const auto param = [&](const P* base, const Pack<P, VEC>& hoisted) {
              Pack<P, kSub> sub;
              if constexpr (kHoistParams) {
#pragma unroll
                for (int e = 0; e < kSub; ++e) sub.v[e] = hoisted.v[h * kSub + e];
              } else {
                sub = load_pack<kSub>(base + at);
              }
              return sub;
            };
            if (p.weight != nullptr && p.bias != nullptr) {
              const Pack<P, kSub> w = param(p.weight, w_hoisted[kHoistParams ? i : 0]);
              const Pack<P, kSub> b = param(p.bias, b_hoisted[kHoistParams ? i : 0]);
#pragma unroll
              for (int e = 0; e < kSub; ++e) {
                out.v[h * kSub + e] =
                    static_cast<IO>(fma_acc(xhat(h * kSub + e), pack_acc(w, e), pack_acc(b, e)));
              }
            } else if (p.weight != nullptr) {
              const Pack<P, kSub> w = param(p.weight, w_hoisted[kHoistParams ? i : 0]);
#pragma unroll
              for (int e = 0; e < kSub; ++e) {
                out.v[h * kSub + e] = static_cast<IO>(xhat(h * kSub + e) * pack_acc(w, e));
              }
            } else if (p.bias != nullptr) {
              const Pack<P, kSub> b = param(p.bias, b_hoisted[kHoistParams ? i : 0]);
#pragma unroll
              for (int e = 0; e < kSub; ++e) {
                out.v[h * kSub + e] = static_cast<IO>(xhat(h * kSub + e) + pack_acc(b, e));
              }
            } else {
#pragma unroll
              for (int e = 0; e < kSub; ++e) out.v[h * kSub + e] = static_cast<IO>(xhat(h * kSub + e));
            }
          }
          store_pack<VEC>(p.y + first + i * kStride, out);
        }
      }
      // The apply pass reduces nothing: its next row goes out once this one is written.
      if constexpr (kStaged) {
        if (mode == kApply) stage_row(g + gridDim.x);
      }
    }
  }
  // No block may exit while another still reads its shared memory.
  if constexpr (CLUSTER) cluster_sync();
}

template <typename T, typename P, int VEC, int TPR, int ITEMS, bool CLUSTER = false,
          bool CENTERED = true, typename IO = T>
__global__ void __launch_bounds__(RowLayout<TPR>::kBlock, (kFwdMinBlocks<T, P, TPR, ITEMS>))
    norm_fwd_kernel(const FwdParams<T, P, IO> p) {
  norm_fwd_rows<T, P, VEC, TPR, ITEMS, CLUSTER, CENTERED, IO, false>(
      p, DropoutParams<acc_type_t<T>>{});
}

// The same with dropout / rowscale (a residual is given).
template <typename T, typename P, int VEC, int TPR, int ITEMS, bool CLUSTER = false,
          bool CENTERED = true, typename IO = T>
__global__ void __launch_bounds__(RowLayout<TPR>::kBlock, kFwdDropoutMinBlocks<TPR>)
    norm_fwd_dropout_kernel(const FwdParams<T, P, IO> p,
                            const DropoutParams<acc_type_t<T>> d) {
  norm_fwd_rows<T, P, VEC, TPR, ITEMS, CLUSTER, CENTERED, IO, true>(p, d);
}

// Per row: merges the chunks' summaries (in chunk order within each lane, then a fixed
// tree over lanes) and writes mean, rstd and the mean's rest for the apply pass. A warp
// per row. Not centered (RMSNorm): adds the chunks' sums of squares (the same fixed order)
// and writes rstd only.
// shift_of(row): the row's shift (row_shift, or row_shift_dropout), for LayerNorm.
template <typename acc_t, bool CENTERED, typename ShiftOf>
__device__ __forceinline__ void merge_stats_rows(const acc_t* partial, int64_t M, int64_t N,
                                                 int64_t chunks, acc_t eps, acc_t* mean,
                                                 acc_t* rstd, acc_t* mean_rest,
                                                 const ShiftOf& shift_of) {
  constexpr int kRowsPerBlock = kMergeThreads / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;
  for (int64_t row = int64_t(blockIdx.x) * kRowsPerBlock + threadIdx.x / kWarpSize; row < M;
       row += int64_t(gridDim.x) * kRowsPerBlock) {
    if constexpr (!CENTERED) {
      acc_t sum_sq = 0;
      for (int64_t c = lane; c < chunks; c += kWarpSize) sum_sq += partial[(row * chunks + c) * 3];
      sum_sq = warp_sum(sum_sq);
      if (lane == 0) rstd[row] = inverse_sqrt(sum_sq, sum_sq / acc_t(N) + eps);
    } else {
      WelfordState<acc_t> s;
      for (int64_t c = lane; c < chunks; c += kWarpSize) {
        const acc_t* in = partial + (row * chunks + c) * 3;
        WelfordState<acc_t> t;
        t.mean = in[0];
        t.m2 = in[1];
        t.count = in[2];
        s.merge(t);
      }
      s = warp_merge(s);
      if (lane == 0) {
        const NearestAndRest<acc_t> split =
            nearest_and_rest(shift_of(row), s.mean);
        mean[row] = split.nearest;
        rstd[row] = inverse_sqrt(s.m2, s.variance() + eps);
        mean_rest[row] = split.rest;
      }
    }
  }
}

template <typename T, bool CENTERED, typename IO = T>
__global__ void __launch_bounds__(kMergeThreads)
    norm_merge_stats_kernel(const acc_type_t<T>* partial, const IO* x, const T* residual,
                            const IO* residual_io, int64_t M, int64_t N, int64_t chunks,
                            acc_type_t<T> eps, acc_type_t<T>* mean, acc_type_t<T>* rstd,
                            acc_type_t<T>* mean_rest) {
  merge_stats_rows<acc_type_t<T>, CENTERED>(
      partial, M, N, chunks, eps, mean, rstd, mean_rest,
      [&](int64_t row) { return row_shift(x, residual, residual_io, row * N, N); });
}

// LayerNorm's with dropout / rowscale: the partial launch left each row's shift in
// mean_rest (drawing it again here, in this kernel's float64 build, spilled).
template <typename acc_t>
__global__ void __launch_bounds__(kMergeThreads)
    norm_merge_stats_dropout_kernel(const acc_t* partial, int64_t M, int64_t N, int64_t chunks,
                                    acc_t eps, acc_t* mean, acc_t* rstd, acc_t* mean_rest) {
  merge_stats_rows<acc_t, true>(partial, M, N, chunks, eps, mean, rstd, mean_rest,
                                [&](int64_t row) { return mean_rest[row]; });
}

// ---------------------------------------------------------------------------------------
// Backward
//
//   xhat = (x - mean) * rstd,  g = dy * w
//   dx = rstd * (g - mean(g) - xhat * mean(g * xhat)),  dw = sum(dy * xhat),  db = sum(dy)
//
// Rows far from zero (needs_mean_correction: |mean| > 16 sigma) also sum xhat: its mean c is
// the saved float mean's rounding error, the same in every xhat of the row (in exact
// arithmetic they sum to zero). Their xhat are then (x - mean) * rstd - c, and mean(g * xhat)
// the first sweep's, less c * mean(g). Other rows add nothing to that sum (c = 0), which is
// reduced all the same (row_sums).
//
// RMSNorm (not CENTERED): mean = 0 and no mean(g) term, no db; with a residual, grad_sum
// (the gradient of the forward's sum output) is added to dx before its one rounding.
//
// Each thread keeps fp32 sums of dy * xhat and dy for its own columns over all the rows its
// block handles; at the end the block's row slots are added in slot order and the block
// writes one row of partials (dweight and dbias side by side), which one last kernel sums
// over in row order.

// The sums a backward row reduces: g and g * xhat, and for LayerNorm xhat (0 in the rows
// that needs_mean_correction does not pick; RMSNorm has no mean to correct).
template <bool CENTERED>
constexpr int kBwdSums = CENTERED ? 3 : 2;

// IO: dy's type (T's, or 16-bit beside a float T: see NormBwdArgs).
template <typename T, typename P, typename IO = T>
struct BwdParams {
  using acc_t = acc_type_t<T>;
  const IO* dy;
  const T* x;
  const acc_t* mean;
  const acc_t* rstd;
  const P* weight;  // nullable
  const T* grad_sum;  // nullable: added to dx
  T* dx;
  // Parameter-gradient partials: one row per block of grid.x, rows part_stride apart in one
  // buffer (dweight's N columns, then dbias's), so that one launch sums both.
  acc_t* dweight_part;  // nullable
  acc_t* dbias_part;    // nullable
  int64_t part_stride;
  // kPartial: [M, chunks, kBwdSums] the row's sums (kBwdSums) over the chunk
  acc_t* row_part;
  // kApply: [M, kBwdSums] mean(g), mean(g * xhat) (corrected) and mean(xhat) (0: not corrected)
  const acc_t* row_coef;
  int64_t M, N;
  int64_t chunk, chunks;
  int mode;
};

// The add ops' input gradient beside dx (the instantiations of norm_bwd_kernel that take
// it; the plain kernels' argument and code stay as they were): dx_input = dx (rounded to T)
// * m, rounded once to IO, m the multipliers of the forward's dropout (DropoutParams' rule;
// threshold 0 and no rowscale: m = 1, dx rounded to IO). (seed, offset) are read from
// rng_state on the device, as dropout_scale does (a CUDA graph replays the forward's).
template <typename acc_t, typename IO>
struct InputGradParams {
  IO* dx_input;
  const int64_t* rng_state;  // read only when threshold != 0
  uint64_t threshold;
  acc_t keep_scale;
  const acc_t* rowscale;  // nullable: [M]
};

// At most 128 registers per thread (16 warps per multiprocessor, kBwdMinBlocks): without the
// bound, the 16-bit buckets with float parameters ran one block of 256 per multiprocessor.
// CLUSTER: as for the forward kernel; the blocks add their chunks' sums (cluster_sums).
// InputGrad: empty (the plain kernels), or InputGradParams: then also writes dx_input from
// each dx pack as it is stored. (A pack, with the body in the kernel: moved into a device
// function shared by two kernels, the plain kernels' SASS changed.)
template <typename acc_t, typename IO>
__device__ __forceinline__ InputGradParams<acc_t, IO> input_grad_or_none() {
  return {};
}
template <typename acc_t, typename IO>
__device__ __forceinline__ InputGradParams<acc_t, IO> input_grad_or_none(
    const InputGradParams<acc_t, IO>& ig) {
  return ig;
}

// A backward thread's column sums in shared memory (kBwdSharedSums): dweight's (grad 0),
// then dbias's (grad 1, LayerNorm only), of element e of its pack i in word
// (((grad * ITEMS + i) * VEC / kQuad + e / kQuad) * TPR + tid) * kQuad + e % kQuad, so that a
// warp's 16-byte accesses are contiguous. Only the thread itself reads its words: no barrier.
template <typename acc_t, int VEC, int TPR, int ITEMS, bool CENTERED>
struct SharedColumnSums {
  static constexpr int kQuad = VEC % (16 / sizeof(acc_t)) == 0 ? 16 / sizeof(acc_t) : 1;
  static constexpr int kWords = (CENTERED ? 2 : 1) * ITEMS * VEC * TPR;
  acc_t* words;
  int tid;

  __device__ __forceinline__ Pack<acc_t, kQuad>* quad(int grad, int i, int q) const {
    return reinterpret_cast<Pack<acc_t, kQuad>*>(
        words + (((grad * ITEMS + i) * (VEC / kQuad) + q) * TPR + tid) * kQuad);
  }
  __device__ __forceinline__ void load(int grad, int i, acc_t (&v)[VEC]) const {
#pragma unroll
    for (int q = 0; q < VEC / kQuad; ++q) {
      const Pack<acc_t, kQuad> w = *quad(grad, i, q);
#pragma unroll
      for (int j = 0; j < kQuad; ++j) v[q * kQuad + j] = w.v[j];
    }
  }
  __device__ __forceinline__ void store(int grad, int i, const acc_t (&v)[VEC]) const {
#pragma unroll
    for (int q = 0; q < VEC / kQuad; ++q) {
      Pack<acc_t, kQuad> w;
#pragma unroll
      for (int j = 0; j < kQuad; ++j) w.v[j] = v[q * kQuad + j];
      *quad(grad, i, q) = w;
    }
  }
};

// Packs of a backward kernel's staged rows (kBwdStagedRow): [2 buffers][x, dy][ITEMS][TPR].
template <int TPR, int ITEMS>
constexpr int kBwdStagePacks = 2 * 2 * ITEMS * TPR;

// Bytes of dynamic shared memory a backward kernel takes (its SharedColumnSums, its staged
// rows, or none).
template <typename T, int VEC, int TPR, int ITEMS, bool CLUSTER, bool CENTERED>
constexpr int kBwdSharedBytes =
    kBwdSharedSums<T, VEC, TPR, ITEMS, CLUSTER>
        ? SharedColumnSums<acc_type_t<T>, VEC, TPR, ITEMS, CENTERED>::kWords *
              int(sizeof(acc_type_t<T>))
        : kBwdStagedRow<T, VEC, TPR, ITEMS, CLUSTER> ? kBwdStagePacks<TPR, ITEMS> * 16 : 0;

template <typename T, typename P, int VEC, int TPR, int ITEMS, bool CLUSTER = false,
          bool CENTERED = true, typename IO = T, typename... InputGrad>
__global__ void __launch_bounds__(RowLayout<TPR>::kBlock,
                                  (sizeof...(InputGrad) == 0
                                       ? kBwdMinBlocks<T, VEC, TPR, ITEMS, CLUSTER>
                                       : kBwdInputGradMinBlocks<T, VEC, TPR, ITEMS, CLUSTER>))
    norm_bwd_kernel(const BwdParams<T, P, IO> p, InputGrad... input_grad) {
  using acc_t = acc_type_t<T>;
  constexpr bool INPUT_GRAD = sizeof...(InputGrad) > 0;
  const InputGradParams<acc_t, IO> ig = input_grad_or_none<acc_t, IO>(input_grad...);
  using Layout = RowLayout<TPR>;
  constexpr int kSums = kBwdSums<CENTERED>;
  __shared__ acc_t red[2][Layout::kRows][kSums * Layout::kWarps];
  __shared__ acc_t cluster_slots[CLUSTER ? 2 : 1][Layout::kRows][kSums];
  // Slot s > 0's dweight/dbias sums for slot 0, laid out [s - 1][2 * VEC][TPR] (consecutive
  // threads, consecutive words); one word when the block holds a single row.
  __shared__ acc_t combine[Layout::kRows > 1 ? (Layout::kRows - 1) * 2 * VEC * TPR : 1];
  constexpr bool kSharedSums = kBwdSharedSums<T, VEC, TPR, ITEMS, CLUSTER>;
  constexpr bool kNextRow = kBwdNextRow<T, VEC, TPR, ITEMS, CLUSTER>;
  static_assert(!(kSharedSums || kNextRow) || Layout::kRows == 1,
                "the sums in shared memory and the next row's loads: one row per block");
  constexpr bool kStaged = kBwdStagedRow<T, VEC, TPR, ITEMS, CLUSTER>;
  static_assert(!kStaged || (Layout::kRows == 1 && !kSharedSums && !kNextRow &&
                             sizeof(T) == 2 && std::is_same_v<T, IO> && VEC * sizeof(T) == 16),
                "staged rows: 16-bit one-row kernels of 16-byte packs, alone");
  using Sums = SharedColumnSums<acc_t, VEC, TPR, ITEMS, CENTERED>;

  const int tid = threadIdx.x % TPR;
  Sums shared_sums{nullptr, tid};
  if constexpr (kSharedSums) shared_sums.words = dynamic_shared<acc_t, Sums::kWords>();
  // kStaged: buffer b's tensor k (x, dy) pack i of this thread at stage[((b * 2 + k) *
  // ITEMS + i) * TPR + tid]; each thread reads back only what it copied.
  Pack<T, VEC>* stage = nullptr;
  if constexpr (kStaged) stage = dynamic_shared<Pack<T, VEC>, kBwdStagePacks<TPR, ITEMS>>();
  const int slot = threadIdx.x / TPR;
  const int64_t groups = ceil_div(p.M, Layout::kRows);
  const bool param_grads =
      p.mode != kPartial && (p.dweight_part != nullptr || p.dbias_part != nullptr);
  int parity = 0;
#if !defined(FUSEDNORM_EMULATION) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
  if constexpr (CLUSTER) __trap();  // as in the forward kernel
#endif
  PhiloxKey key{};  // INPUT_GRAD: the forward's (seed, offset)
  if constexpr (INPUT_GRAD) {
    if (ig.threshold != 0) {
      key = {static_cast<uint64_t>(ig.rng_state[0]), static_cast<uint64_t>(ig.rng_state[1])};
    }
  }

  for (int64_t c = blockIdx.y; c < p.chunks; c += gridDim.y) {
    const int64_t col0 = c * p.chunk;
    // Elements of this chunk (at most one bucket's capacity, so offsets in it fit an int).
    const int len = static_cast<int>(std::min(p.chunk, p.N - col0));
    acc_t dw[ITEMS][VEC], db[ITEMS][VEC];
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
#pragma unroll
      for (int e = 0; e < VEC; ++e) dw[i][e] = db[i][e] = 0;
      if constexpr (kSharedSums) {
        shared_sums.store(0, i, dw[i]);
        if constexpr (CENTERED) shared_sums.store(1, i, db[i]);
      }
    }
    // Small buckets keep the weight packs in registers for all the block's rows (as the
    // forward); the others load them per row, where both passes over the row use them.
    constexpr bool kHoistWeight = kHoistFwdParams<P, VEC, ITEMS>;
    Pack<P, VEC> w_hoisted[kHoistWeight ? ITEMS : 1];
    if constexpr (kHoistWeight) {
#pragma unroll
      for (int i = 0; i < ITEMS; ++i) {
        const int off = (i * TPR + tid) * VEC;
        if (off < len && p.weight != nullptr) w_hoisted[i] = load_pack<VEC>(p.weight + col0 + off);
      }
    }
    const auto weight_pack = [&](int i, int off) {
      if constexpr (kHoistWeight) {
        return w_hoisted[i];
      } else {
        return load_pack<VEC>(p.weight + col0 + off);
      }
    };

    // kNextRow: the block's next row, loaded before the current row's reductions.
    Pack<T, VEC> x_next[kNextRow ? ITEMS : 1];
    Pack<IO, VEC> dy_next[kNextRow ? ITEMS : 1];
    acc_t mean_next = 0, rstd_next = 0;
    const auto load_next = [&](int64_t g2) {
      const int64_t row2 = g2 * Layout::kRows + slot;
      if (g2 < groups && row2 < p.M) {
        const int64_t base2 = row2 * p.N + col0;
#pragma unroll
        for (int i = 0; i < ITEMS; ++i) {
          const int off = (i * TPR + tid) * VEC;
          if (off < len) {
            x_next[i] = load_pack<VEC>(p.x + base2 + off);
            dy_next[i] = load_pack<VEC>(p.dy + base2 + off);
          }
        }
        if constexpr (CENTERED) mean_next = p.mean[row2];
        rstd_next = p.rstd[row2];
      }
    };
    if constexpr (kNextRow) load_next(blockIdx.x);
    // kStaged: copies the packs of group g2's row (zeros past the rows) into buffer `buf`.
    const auto stage_row = [&](int64_t g2, int buf) {
      const int64_t row2 = g2 * Layout::kRows + slot;
      const bool ok = g2 < groups && row2 < p.M;
      // A pack of each at a time (not unrolled), as the forward's stage_row.
      int64_t at = (ok ? row2 * p.N : 0) + col0 + int64_t(tid) * VEC;
#pragma unroll 1
      for (int i = 0; i < ITEMS; ++i, at += TPR * VEC) {
        const bool copy = ok && (i * TPR + tid) * VEC < len;
        const int64_t from = copy ? at : 0;
        async_copy16(stage + ((buf * 2 + 0) * ITEMS + i) * TPR + tid, p.x + from, copy);
        async_copy16(stage + ((buf * 2 + 1) * ITEMS + i) * TPR + tid, p.dy + from, copy);
      }
      async_commit();
    };
    int next_buf = 0;
    if constexpr (kStaged) stage_row(blockIdx.x, next_buf);

    for (int64_t g = blockIdx.x; g < groups; g += gridDim.x) {
      const int64_t row = g * Layout::kRows + slot;
      const bool row_ok = row < p.M;
      const int64_t base = (row_ok ? row * p.N : 0) + col0;
      const T* x = p.x + base;
      const IO* dy = p.dy + base;
      acc_t factor = 0;  // INPUT_GRAD: what a kept element of the row is multiplied by
      if constexpr (INPUT_GRAD) {
        if (row_ok) factor = row_factor(ig, row);
      }
      const int buf = next_buf;
      if constexpr (kStaged) {
        // The next row's copies go out first, to be in flight through all of this row; then
        // this row's (every group but that newest one) must have landed.
        next_buf ^= 1;
        stage_row(g + gridDim.x, next_buf);
        async_wait<1>();
      }

      Pack<T, VEC> xs[ITEMS];
      Pack<IO, VEC> dys[ITEMS];
      int valid = 0;
#pragma unroll
      for (int i = 0; i < ITEMS; ++i) {
        const int off = (i * TPR + tid) * VEC;
        if (row_ok && off < len) {
          if constexpr (kNextRow) {
            xs[i] = x_next[i];
            dys[i] = dy_next[i];
          } else if constexpr (kStaged) {
            xs[i] = stage[((buf * 2 + 0) * ITEMS + i) * TPR + tid];
            dys[i] = stage[((buf * 2 + 1) * ITEMS + i) * TPR + tid];
          } else {
            xs[i] = load_pack<VEC>(x + off);
            dys[i] = load_pack<VEC>(dy + off);
          }
          valid = i + 1;
        }
      }
      acc_t mean = 0, rstd = 0;
      if constexpr (kNextRow) {
        mean = row_ok ? mean_next : acc_t(0);
        rstd = row_ok ? rstd_next : acc_t(0);
        load_next(g + gridDim.x);
      } else {
        mean = CENTERED && row_ok ? p.mean[row] : acc_t(0);
        rstd = row_ok ? p.rstd[row] : acc_t(0);
      }
      // Whether this row corrects the saved mean's rounding (see above).
      const bool correct = needs_mean_correction<CENTERED>(mean, rstd);

      // xhat_shift: the mean of the row's uncorrected xhat where `correct`, else 0.
      acc_t mean_g = 0, mean_gx = 0, xhat_shift = 0;
      if (p.mode != kApply) {
        // The thread's sums of g (LayerNorm only), g * (x - mean) and, in the rows `correct`
        // picks, x - mean (a sweep of their own: the common rows skip it); the last two times
        // rstd once, which makes them sums of g * xhat and xhat (a multiply a row, not an
        // element).
        acc_t sum_g = 0, sum_gd = 0, sum_d = 0;
#pragma unroll
        for (int i = 0; i < ITEMS; ++i) {
          if (i < valid) {
            // g(e, dy): dy * w, or dy without weight (one branch each, as in the forward).
            const auto add = [&](auto g) {
#pragma unroll
              for (int e = 0; e < VEC; ++e) {
                const acc_t gv = g(e, pack_acc(dys[i], e));
                if constexpr (CENTERED) sum_g += gv;
                const acc_t x = pack_acc(xs[i], e);
                sum_gd = fma_acc(gv, CENTERED ? x - mean : x, sum_gd);
              }
            };
            if (p.weight != nullptr) {
              const Pack<P, VEC> w = weight_pack(i, (i * TPR + tid) * VEC);
              add([&](int e, acc_t d) { return mul_rn(d, pack_acc(w, e)); });
            } else {
              add([](int, acc_t d) { return d; });
            }
          }
        }
        if (correct) {
#pragma unroll
          for (int i = 0; i < ITEMS; ++i) {
            if (i < valid) {
#pragma unroll
              for (int e = 0; e < VEC; ++e) sum_d += pack_acc(xs[i], e) - mean;
            }
          }
        }
        // The sum of xhat is reduced in every row (0 where not corrected).
        acc_t sums[kSums];
        sums[0] = sum_g;
        sums[1] = sum_gd * rstd;
        if constexpr (CENTERED) sums[kSums - 1] = sum_d * rstd;
        row_sums<Layout::kWarps>(sums, red[parity][slot]);
        if constexpr (CLUSTER) {
          cluster_sums(sums, cluster_slots[parity][slot], tid == 0, int(p.chunks));
        }
        parity ^= 1;
        if (p.mode == kPartial) {
          if (row_ok && tid == 0) {
            acc_t* out = p.row_part + (row * p.chunks + c) * kSums;
            for (int k = 0; k < kSums; ++k) out[k] = sums[k];
          }
          continue;
        }
        acc_t sum_gx = sums[1];
        mean_g = CENTERED ? sums[0] / acc_t(p.N) : acc_t(0);
        if (correct) {
          xhat_shift = sums[kSums - 1] / acc_t(p.N);
          sum_gx = fma_acc(-xhat_shift, sums[0], sum_gx);
        }
        mean_gx = sum_gx / acc_t(p.N);
      } else if (row_ok) {
        mean_g = CENTERED ? p.row_coef[kSums * row] : acc_t(0);
        mean_gx = p.row_coef[kSums * row + 1];
        if constexpr (CENTERED) xhat_shift = p.row_coef[kSums * row + kSums - 1];
      }
      // fma(x - mean, rstd, -0) rounds as (x - mean) * rstd: uncorrected rows keep their bits
      // (and RMSNorm's code, with a constant -0, its instructions).
      const acc_t neg_xhat_shift = CENTERED ? -xhat_shift : acc_t(-0.0);
      // dx = rstd * (g - mean_g - xhat * mean_gx) as fma(rstd, g, xhat * slope + offset), with
      // the row's slope = -rstd * mean_gx and offset = -rstd * mean_g: one operation fewer an
      // element (RMSNorm: xhat * slope, no offset). The one-element kernels keep the product
      // form: at their 64 registers the other spilled (float32's of 8 items).
      constexpr bool kFoldedDx = VEC > 1;
      const acc_t dx_slope = -rstd * mean_gx;
      const acc_t dx_offset = -rstd * mean_g;

#pragma unroll
      for (int i = 0; i < ITEMS; ++i) {
        if (i < valid) {
          const int off = (i * TPR + tid) * VEC;
          Pack<T, VEC> out, gsum;
          const bool has_gsum = kBwdGradSum<CENTERED, T, VEC, TPR, ITEMS> && p.grad_sum != nullptr;
          if (has_gsum) gsum = load_pack<VEC>(p.grad_sum + base + off);
          if constexpr (kSharedSums) {  // this pack's sums into dw[i], db[i] for the row
            shared_sums.load(0, i, dw[i]);
            if constexpr (CENTERED) shared_sums.load(1, i, db[i]);
          }
          const auto apply = [&](auto g) {
#pragma unroll
            for (int e = 0; e < VEC; ++e) {
              const acc_t x = CENTERED ? pack_acc(xs[i], e) - mean : pack_acc(xs[i], e);
              const acc_t xhat = CENTERED ? fma_acc(x, rstd, neg_xhat_shift) : x * rstd;
              const acc_t d = pack_acc(dys[i], e);
              acc_t v = kFoldedDx ? fma_acc(rstd, g(e, d),
                                            CENTERED ? fma_acc(xhat, dx_slope, dx_offset)
                                                     : xhat * dx_slope)
                                  : rstd * fma_acc(-xhat, mean_gx, g(e, d) - mean_g);
              if (has_gsum) v += pack_acc(gsum, e);  // (a branch: no -0 + 0 without it)
              out.v[e] = static_cast<T>(v);
              dw[i][e] = fma_acc(d, xhat, dw[i][e]);
              if constexpr (CENTERED) db[i][e] += d;
            }
          };
          if (p.weight != nullptr) {
            const Pack<P, VEC> w = weight_pack(i, off);
            apply([&](int e, acc_t d) { return mul_rn(d, pack_acc(w, e)); });
          } else {
            apply([](int, acc_t d) { return d; });
          }
          store_pack<VEC>(p.dx + base + off, out);
          if constexpr (kSharedSums) {
            shared_sums.store(0, i, dw[i]);
            if constexpr (CENTERED) shared_sums.store(1, i, db[i]);
          }
          if constexpr (INPUT_GRAD) {
            acc_t m[VEC];
            dropout_multipliers<VEC>(m, ig, key, base + off, factor);
            Pack<IO, VEC> dx_input;
#pragma unroll
            for (int e = 0; e < VEC; ++e) {
              dx_input.v[e] = static_cast<IO>(mul_rn(pack_acc(out, e), m[e]));
            }
            store_pack<VEC>(ig.dx_input + base + off, dx_input);
          }
        }
      }
    }
    // The last stage (past the rows) lands before the buffers serve another chunk.
    if constexpr (kStaged) async_wait<0>();

    if (param_grads) {
      if constexpr (Layout::kRows > 1) {
        // Add the other row slots' sums to slot 0's, in slot order.
#pragma unroll
        for (int i = 0; i < ITEMS; ++i) {
          __syncthreads();
          if (slot > 0) {
            acc_t* mine = combine + (slot - 1) * 2 * VEC * TPR;
#pragma unroll
            for (int e = 0; e < VEC; ++e) {
              mine[e * TPR + tid] = dw[i][e];
              if constexpr (CENTERED) mine[(VEC + e) * TPR + tid] = db[i][e];
            }
          }
          __syncthreads();
          if (slot == 0) {
            for (int s = 0; s < Layout::kRows - 1; ++s) {
              const acc_t* theirs = combine + s * 2 * VEC * TPR;
#pragma unroll
              for (int e = 0; e < VEC; ++e) {
                dw[i][e] += theirs[e * TPR + tid];
                if constexpr (CENTERED) db[i][e] += theirs[(VEC + e) * TPR + tid];
              }
            }
          }
        }
      }
      if (slot == 0) {
        const int64_t part_base = int64_t(blockIdx.x) * p.part_stride + col0;
#pragma unroll
        for (int i = 0; i < ITEMS; ++i) {
          const int off = (i * TPR + tid) * VEC;
          if (off < len) {
            if constexpr (kSharedSums) {
              shared_sums.load(0, i, dw[i]);
              if constexpr (CENTERED) shared_sums.load(1, i, db[i]);
            }
            Pack<acc_t, VEC> w_out, b_out;
#pragma unroll
            for (int e = 0; e < VEC; ++e) {
              w_out.v[e] = dw[i][e];
              b_out.v[e] = db[i][e];
            }
            if (p.dweight_part != nullptr) store_pack<VEC>(p.dweight_part + part_base + off, w_out);
            if (CENTERED && p.dbias_part != nullptr) {
              store_pack<VEC>(p.dbias_part + part_base + off, b_out);
            }
          }
        }
      }
    }
  }
  // No block may exit while another still reads its shared memory.
  if constexpr (CLUSTER) cluster_sync();
}

// Per row: sums the chunks' kSums sums (kBwdSums) in a fixed order and writes mean(g),
// mean(g * xhat) and (kSums 3) mean(xhat), corrected as in the kernel's kFull mode (the
// chunks' sums of xhat are all 0 in the rows it does not correct). A warp per row.
template <typename acc_t, int kSums>
__global__ void __launch_bounds__(kMergeThreads)
    norm_merge_sums_kernel(const acc_t* row_part, int64_t M, int64_t N, int64_t chunks,
                                 acc_t* row_coef) {
  constexpr int kRowsPerBlock = kMergeThreads / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;
  for (int64_t row = int64_t(blockIdx.x) * kRowsPerBlock + threadIdx.x / kWarpSize; row < M;
       row += int64_t(gridDim.x) * kRowsPerBlock) {
    acc_t sums[kSums] = {};
    for (int64_t c = lane; c < chunks; c += kWarpSize) {
#pragma unroll
      for (int k = 0; k < kSums; ++k) sums[k] += row_part[(row * chunks + c) * kSums + k];
    }
#pragma unroll
    for (int k = 0; k < kSums; ++k) sums[k] = warp_sum(sums[k]);
    if (lane == 0) {
      acc_t* out = row_coef + kSums * row;
      if constexpr (kSums == 3) {
        const acc_t xhat_shift = sums[2] / acc_t(N);
        if (xhat_shift != acc_t(0)) sums[1] = fma_acc(-xhat_shift, sums[0], sums[1]);
        out[2] = xhat_shift;
      }
      out[0] = sums[0] / acc_t(N);
      out[1] = sums[1] / acc_t(N);
    }
  }
}

// The parameter gradients from the backward's partial rows: column j of part ([rows,
// width], width = N for one gradient, 2N for dweight then dbias) summed over the rows into
// out0[j] (j < N) or out1[j - N], rounded once to P. One launch for both gradients. A block
// of kSumThreads takes `cols` adjacent columns (sum_partial_cols) with kSumThreads / cols row
// lanes; lane r sums rows r, r + lanes, ... in order, then lane 0 adds the lanes' sums in
// lane order: a fixed order for a given device and shape, so the result is bitwise
// reproducible.
template <typename acc_t, typename P>
__global__ void __launch_bounds__(kSumThreads)
    sum_partial_rows_kernel(const acc_t* part, int64_t rows, int64_t width, int64_t N, int cols,
                            P* out0, P* out1) {
  __shared__ acc_t lanes_sum[kSumThreads];
  const int tx = threadIdx.x % cols;
  const int lane = threadIdx.x / cols;
  const int lanes = kSumThreads / cols;
  for (int64_t col0 = int64_t(blockIdx.x) * cols; col0 < width;
       col0 += int64_t(gridDim.x) * cols) {
    const int64_t col = col0 + tx;
    acc_t sum = 0;
    if (col < width) {
#pragma unroll 4
      for (int64_t r = lane; r < rows; r += lanes) sum += part[r * width + col];
    }
    lanes_sum[threadIdx.x] = sum;
    __syncthreads();
    if (lane == 0 && col < width) {
      acc_t total = 0;
      for (int l = 0; l < lanes; ++l) total += lanes_sum[l * cols + tx];
      if (col < N) {
        out0[col] = static_cast<P>(total);
      } else {
        out1[col - N] = static_cast<P>(total);
      }
    }
    __syncthreads();
  }
}

// ---------------------------------------------------------------------------------------
// Launchers: one small host function per kernel, each followed by its launch check.

constexpr int kMaxCachedDevices = 64;

// Blocks of `kernel` (with smem bytes of dynamic shared memory) resident per
// multiprocessor, cached per device in `cache` (the occupancy query runs once per kernel and
// device, before any graph capture that warms up).
template <typename Kernel>
int blocks_per_sm(Kernel kernel, int threads, DeviceInfo dev, std::atomic<int>* cache,
                  int smem = 0) {
  const bool cacheable = dev.index >= 0 && dev.index < kMaxCachedDevices;
  if (cacheable) {
    const int known = cache[dev.index].load(std::memory_order_relaxed);
    if (known > 0) return known;
  }
  int blocks = 0;
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, threads, smem));
  blocks = std::max(blocks, 1);
  if (cacheable) cache[dev.index].store(blocks, std::memory_order_relaxed);
  return blocks;
}

// Lets `kernel` take smem bytes of dynamic shared memory (over 48 KiB needs the opt-in),
// once per device (allowed: the kernel's own flags), before its occupancy is asked.
template <typename Kernel>
void allow_dynamic_shared(Kernel kernel, int smem, DeviceInfo dev, std::atomic<bool>* allowed) {
#ifdef FUSEDNORM_EMULATION
  (void)kernel, (void)smem, (void)dev, (void)allowed;
#else
  if (smem == 0) return;
  const bool cacheable = dev.index >= 0 && dev.index < kMaxCachedDevices;
  if (cacheable && allowed[dev.index].load(std::memory_order_relaxed)) return;
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  if (cacheable) allowed[dev.index].store(true, std::memory_order_relaxed);
#endif
}

// A grid that fills the device once: chunks on y (capped at the limit), row groups on x.
dim3 row_grid(int64_t groups, int64_t chunks, int64_t resident_blocks) {
  const int64_t gy = std::min<int64_t>(chunks, 65535);
  const int64_t gx =
      std::clamp<int64_t>(resident_blocks / gy, 1, std::max<int64_t>(1, std::min<int64_t>(groups, INT_MAX)));
  return dim3(static_cast<unsigned>(gx), static_cast<unsigned>(gy));
}

// The grid of an unclustered row kernel of TPR threads per row (row_grid, sized by its
// occupancy; cache: the kernel's own; smem: its dynamic shared memory).
template <int TPR, typename Kernel, typename Params>
dim3 rows_grid(Kernel kernel, const Params& p, DeviceInfo dev, std::atomic<int>* cache,
               int smem = 0) {
  const int per_sm = blocks_per_sm(kernel, RowLayout<TPR>::kBlock, dev, cache, smem);
  return row_grid(ceil_div(p.M, RowLayout<TPR>::kRows), p.chunks, int64_t(per_sm) * dev.sm_count);
}

// The grid of a forward row kernel (cache: its occupancy; smem: its dynamic shared memory,
// a staged row's, kFwdSharedBytes): over whole rows, where a multiprocessor holds several of
// its blocks, a block per row group rather than one wave of blocks looping over the rows, as
// the wave's blocks load and reduce in step while blocks that start as others finish keep
// loads in flight; else (chunked rows, whose partial and cluster launches the wave sizes, a
// lone block per multiprocessor, or a kernel that stages its next row, which only a block
// looping over rows has) the wave. (The forward kernels' A/B on the H200,
// docs/gpu_runs/README.md.)
template <int TPR, typename Kernel, typename Params>
dim3 fwd_rows_grid(Kernel kernel, const Params& p, DeviceInfo dev, std::atomic<int>* cache,
                   int smem) {
  const int per_sm = blocks_per_sm(kernel, RowLayout<TPR>::kBlock, dev, cache, smem);
  if (p.chunks == 1 && per_sm > 1 && smem == 0) {
    const int64_t groups = ceil_div(p.M, RowLayout<TPR>::kRows);
    return dim3(static_cast<unsigned>(std::clamp<int64_t>(groups, 1, INT_MAX)));
  }
  return rows_grid<TPR>(kernel, p, dev, cache, smem);  // (the occupancy asked again: cached)
}

// smem: bytes of dynamic shared memory; extra: the arguments after p (the dropout kernels'
// DropoutParams).
template <int TPR, typename Kernel, typename Params, typename... Extra>
void launch_rows(Kernel kernel, const Params& p, dim3 grid, int smem, cudaStream_t stream,
                 const Extra&... extra) {
  launch_kernel_smem(kernel, grid, RowLayout<TPR>::kBlock, smem, stream, p, extra...);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// The forward kernel of a bucket: norm_fwd_kernel, or with DROPOUT norm_fwd_dropout_kernel
// (which takes the DropoutParams after p).
template <typename T, typename P, int VEC, int TPR, int ITEMS, bool CLUSTER, bool CENTERED,
          typename IO, bool DROPOUT>
constexpr auto fwd_kernel() {
  if constexpr (DROPOUT) {
    return norm_fwd_dropout_kernel<T, P, VEC, TPR, ITEMS, CLUSTER, CENTERED, IO>;
  } else {
    return norm_fwd_kernel<T, P, VEC, TPR, ITEMS, CLUSTER, CENTERED, IO>;
  }
}

// The chunked forward in one launch of clusters of p.chunks blocks, when the device and the
// build allow it, with at most as many clusters as fit at once (resident_clusters); returns
// whether it launched. extra: as launch_rows.
template <typename T, typename P, int VEC, int TPR, int ITEMS, bool CENTERED, bool DROPOUT,
          typename IO, typename... Extra>
bool try_launch_fwd_cluster(const FwdParams<T, P, IO>& p, dim3 grid, DeviceInfo dev,
                            cudaStream_t stream, const Extra&... extra) {
  static std::atomic<int> cache[kMaxCachedDevices][kMaxClusterBlocks + 1];
  static std::atomic<bool> smem_allowed[kMaxCachedDevices];
  constexpr auto kernel = fwd_kernel<T, P, VEC, TPR, ITEMS, true, CENTERED, IO, DROPOUT>();
  constexpr int kBlock = RowLayout<TPR>::kBlock;
  constexpr int kSmem = kFwdSharedBytes<T, P, IO, VEC, TPR, ITEMS, DROPOUT>;
  if (grid.y != p.chunks) return false;
  allow_dynamic_shared(kernel, kSmem, dev, smem_allowed);
  const int clusters = resident_clusters(kernel, kBlock, int(p.chunks), kSmem, dev.index, cache);
  if (clusters == 0) return false;
  grid.x = std::min(grid.x, unsigned(clusters));
  launch_cluster_kernel(kernel, grid, kBlock, dim3(1, grid.y, 1), kSmem, stream, p, extra...);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return true;
}

unsigned warp_per_row_grid(int64_t M, DeviceInfo dev) {
  return static_cast<unsigned>(
      std::clamp<int64_t>(ceil_div(M, kMergeThreads / kWarpSize), 1, int64_t(dev.sm_count) * 16));
}

// DROPOUT: LayerNorm's merge takes the shifts the partial launch left (RMSNorm's has none).
template <bool CENTERED, bool DROPOUT, typename T, typename P, typename IO>
void launch_merge_stats(const FwdParams<T, P, IO>& p, DeviceInfo dev, cudaStream_t stream) {
  if constexpr (CENTERED && DROPOUT) {
    launch_kernel(norm_merge_stats_dropout_kernel<acc_type_t<T>>, warp_per_row_grid(p.M, dev),
                  kMergeThreads, stream, p.partial, p.M, p.N, p.chunks, p.eps, p.mean, p.rstd,
                  p.mean_rest);
  } else {
    launch_kernel(norm_merge_stats_kernel<T, CENTERED, IO>, warp_per_row_grid(p.M, dev),
                  kMergeThreads, stream, p.partial, p.x, p.residual, p.residual_io, p.M, p.N,
                  p.chunks, p.eps, p.mean, p.rstd, p.mean_rest);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename T, typename P, int VEC, typename Table, bool CENTERED, bool DROPOUT,
          typename IO>
void run_fwd(const NormFwdArgs<T, P, IO>& a, Workspace& ws, DeviceInfo dev, cudaStream_t stream) {
  using acc_t = acc_type_t<T>;
  const DropoutParams<acc_t> d{a.philox, a.threshold, static_cast<acc_t>(a.keep_scale),
                               a.rowscale, a.rng_state};
  // fn(the row kernels' arguments after p): d for the dropout kernels, none for the others.
  const auto with_extra = [&](const auto& fn) {
    if constexpr (DROPOUT) {
      return fn(d);
    } else {
      return fn();
    }
  };
  const RowSplit split = split_row<Table>(a.N, VEC);
  const int64_t last_chunk = a.N - (split.chunks - 1) * split.chunk;
  FwdParams<T, P, IO> p{
      .x = a.x, .residual = a.residual, .residual_io = a.residual_io, .weight = a.weight,
      .bias = a.bias, .y = a.y, .sum = a.sum, .mean = a.mean, .rstd = a.rstd, .M = a.M, .N = a.N,
      .chunk = split.chunk, .chunks = split.chunks,
      .inv_chunk = acc_t(1) / static_cast<acc_t>(std::max<int64_t>(split.chunk, 1)),
      .inv_last_chunk = last_chunk > 0 ? acc_t(1) / static_cast<acc_t>(last_chunk) : acc_t(0),
      .inv_n = a.N > 0 ? acc_t(1) / static_cast<acc_t>(a.N) : acc_t(0),
      .eps = static_cast<acc_t>(a.eps)};
  visit_bucket<Table>(split.bucket, [&](auto tpr, auto items) {
    constexpr int kTpr = decltype(tpr)::value;
    constexpr int kItems = decltype(items)::value;
    constexpr auto kernel = fwd_kernel<T, P, VEC, kTpr, kItems, false, CENTERED, IO, DROPOUT>();
    static std::atomic<int> occupancy[kMaxCachedDevices];  // this kernel's
    static std::atomic<bool> smem_allowed[kMaxCachedDevices];
    constexpr int kSmem = kFwdSharedBytes<T, P, IO, VEC, kTpr, kItems, DROPOUT>;
    allow_dynamic_shared(kernel, kSmem, dev, smem_allowed);
    const dim3 grid = fwd_rows_grid<kTpr>(kernel, p, dev, occupancy, kSmem);
    const auto launch = [&] {
      with_extra([&](const auto&... extra) {
        launch_rows<kTpr>(kernel, p, grid, kSmem, stream, extra...);
      });
    };
    if (split.chunks == 1) {
      p.mode = kFull;
      launch();
      return;
    }
    // Only the largest bucket is ever cut into chunks (each chunk is more than half of it,
    // and the next bucket holds at most half): the only one with a cluster instantiation.
    if constexpr (int64_t(kTpr) * kItems == bucket_capacity<Table>(kNumBuckets<Table> - 1)) {
      p.mode = kFull;
      const bool clustered = with_extra([&](const auto&... extra) {
        return try_launch_fwd_cluster<T, P, VEC, kTpr, kItems, CENTERED, DROPOUT>(
            p, grid, dev, stream, extra...);
      });
      if (clustered) return;
    }
    p.partial = static_cast<acc_t*>(ws.allocate(a.M * split.chunks * 3 * int64_t(sizeof(acc_t))));
    if (CENTERED) p.mean_rest = static_cast<acc_t*>(ws.allocate(a.M * int64_t(sizeof(acc_t))));
    p.mode = kPartial;
    launch();
    launch_merge_stats<CENTERED, DROPOUT>(p, dev, stream);
    p.mode = kApply;
    launch();
  });
}

// The forward of LayerNorm (CENTERED) or RMSNorm. Every pointer, the residual and the sum
// included, must be 16-byte aligned for the 16-byte packs (null counts as aligned).
// DROPOUT: with the multipliers of a's dropout members (a residual is given).
template <bool CENTERED, bool DROPOUT = false, typename T, typename P, typename IO>
void norm_fwd_impl(const NormFwdArgs<T, P, IO>& a, Workspace& ws, DeviceInfo dev,
                   cudaStream_t stream) {
  if (a.M == 0) return;
  const bool vectorized = a.N % kVec<T> == 0 && is_16b_aligned(a.x) && is_16b_aligned(a.y) &&
                          is_16b_aligned(a.weight) && is_16b_aligned(a.bias) &&
                          is_16b_aligned(a.residual) && is_16b_aligned(a.residual_io) &&
                          is_16b_aligned(a.sum);
  if (vectorized) {
    run_fwd<T, P, kVec<T>, FwdVecTable<T, P, DROPOUT>, CENTERED, DROPOUT>(a, ws, dev, stream);
  } else {
    run_fwd<T, P, 1, FwdScalarTable<T, DROPOUT>, CENTERED, DROPOUT>(a, ws, dev, stream);
  }
}

// The backward kernel of a bucket: norm_bwd_kernel, with INPUT_GRAD its instantiation that
// takes InputGradParams after p. (Cast to the kernel's type: a trailing pack named
// explicitly may still grow by deduction, so the bare name is not one function.)
template <typename T, typename P, int VEC, int TPR, int ITEMS, bool CLUSTER, bool CENTERED,
          typename IO, bool INPUT_GRAD>
constexpr auto bwd_kernel() {
  using Params = BwdParams<T, P, IO>;
  if constexpr (INPUT_GRAD) {
    using Extra = InputGradParams<acc_type_t<T>, IO>;
    return static_cast<void (*)(Params, Extra)>(
        norm_bwd_kernel<T, P, VEC, TPR, ITEMS, CLUSTER, CENTERED, IO, Extra>);
  } else {
    return static_cast<void (*)(Params)>(
        norm_bwd_kernel<T, P, VEC, TPR, ITEMS, CLUSTER, CENTERED, IO>);
  }
}

// How many clusters of p.chunks blocks the chunked backward's clustered launch may use (as
// try_launch_fwd_cluster), 0 where it cannot run in clusters. Asked before the launch: the
// parameter-gradient partials take one row per block of grid.x.
template <typename T, typename P, int VEC, int TPR, int ITEMS, bool CENTERED, bool INPUT_GRAD,
          typename IO>
int bwd_resident_clusters(const BwdParams<T, P, IO>& p, dim3 grid, DeviceInfo dev) {
  static std::atomic<int> cache[kMaxCachedDevices][kMaxClusterBlocks + 1];
  static std::atomic<bool> smem_allowed[kMaxCachedDevices];
  constexpr auto kernel = bwd_kernel<T, P, VEC, TPR, ITEMS, true, CENTERED, IO, INPUT_GRAD>();
  constexpr int kSmem = kBwdSharedBytes<T, VEC, TPR, ITEMS, true, CENTERED>;
  if (grid.y != p.chunks) return 0;
  allow_dynamic_shared(kernel, kSmem, dev, smem_allowed);
  return resident_clusters(kernel, RowLayout<TPR>::kBlock, int(p.chunks), kSmem, dev.index,
                           cache);
}

// extra: as launch_rows.
template <typename T, typename P, int VEC, int TPR, int ITEMS, bool CENTERED, bool INPUT_GRAD,
          typename IO, typename... Extra>
void launch_bwd_cluster(const BwdParams<T, P, IO>& p, dim3 grid, cudaStream_t stream,
                        const Extra&... extra) {
  launch_cluster_kernel(bwd_kernel<T, P, VEC, TPR, ITEMS, true, CENTERED, IO, INPUT_GRAD>(), grid,
                        RowLayout<TPR>::kBlock, dim3(1, grid.y, 1),
                        kBwdSharedBytes<T, VEC, TPR, ITEMS, true, CENTERED>, stream, p, extra...);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <bool CENTERED, typename T, typename P, typename IO>
void launch_merge_sums(const BwdParams<T, P, IO>& p, acc_type_t<T>* row_coef, DeviceInfo dev,
                       cudaStream_t stream) {
  launch_kernel(norm_merge_sums_kernel<acc_type_t<T>, kBwdSums<CENTERED>>,
                warp_per_row_grid(p.M, dev), kMergeThreads, stream, p.row_part, p.M, p.N, p.chunks,
                row_coef);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename acc_t, typename P>
void launch_sum_partial_rows(const acc_t* part, int64_t rows, int64_t width, int64_t N, P* out0,
                             P* out1, DeviceInfo dev, cudaStream_t stream) {
  const int cols = sum_partial_cols(width, dev);
  const auto blocks = static_cast<unsigned>(
      std::clamp<int64_t>(ceil_div(width, cols), 1, int64_t(dev.sm_count) * 8));
  launch_kernel(sum_partial_rows_kernel<acc_t, P>, blocks, kSumThreads, stream, part, rows, width,
                N, cols, out0, out1);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename T, typename P, int VEC, typename Table, bool CENTERED, bool INPUT_GRAD,
          typename IO>
void run_bwd(const NormBwdArgs<T, P, IO>& a, Workspace& ws, DeviceInfo dev, cudaStream_t stream) {
  using acc_t = acc_type_t<T>;
  const InputGradParams<acc_t, IO> ig{a.dx_input, a.rng_state, a.threshold,
                                      static_cast<acc_t>(a.keep_scale), a.rowscale};
  // fn(the row kernels' arguments after p): ig for the input-gradient kernels, none otherwise.
  const auto with_extra = [&](const auto& fn) {
    if constexpr (INPUT_GRAD) {
      return fn(ig);
    } else {
      return fn();
    }
  };
  const RowSplit split = split_row<Table>(a.N, VEC);
  BwdParams<T, P, IO> p{.dy = a.dy, .x = a.x, .mean = a.mean, .rstd = a.rstd,
                        .weight = a.weight, .grad_sum = a.grad_sum, .dx = a.dx, .M = a.M,
                        .N = a.N, .chunk = split.chunk, .chunks = split.chunks};
  visit_bucket<Table>(split.bucket, [&](auto tpr, auto items) {
    constexpr int kTpr = decltype(tpr)::value;
    constexpr int kItems = decltype(items)::value;
    constexpr auto kernel = bwd_kernel<T, P, VEC, kTpr, kItems, false, CENTERED, IO, INPUT_GRAD>();
    static std::atomic<int> occupancy[kMaxCachedDevices];  // this kernel's
    static std::atomic<bool> smem_allowed[kMaxCachedDevices];
    constexpr int kSmem = kBwdSharedBytes<T, VEC, kTpr, kItems, false, CENTERED>;
    allow_dynamic_shared(kernel, kSmem, dev, smem_allowed);
    dim3 grid = rows_grid<kTpr>(kernel, p, dev, occupancy, kSmem);
    const auto launch = [&] {
      with_extra([&](const auto&... extra) {
        launch_rows<kTpr>(kernel, p, grid, kSmem, stream, extra...);
      });
    };
    // Chunked rows run in one clustered launch where possible (see run_fwd: only the
    // largest bucket chunks), of at most as many clusters as fit at once.
    bool clustered = false;
    if constexpr (int64_t(kTpr) * kItems == bucket_capacity<Table>(kNumBuckets<Table> - 1)) {
      if (split.chunks > 1) {
        const int clusters =
            bwd_resident_clusters<T, P, VEC, kTpr, kItems, CENTERED, INPUT_GRAD>(p, grid, dev);
        clustered = clusters > 0;
        if (clustered) grid.x = std::min(grid.x, unsigned(clusters));
      }
    }
    // One partial row per block ([grid.x, grads * N]: dweight's columns, then dbias's).
    const int grads = int(a.dweight != nullptr) + int(a.dbias != nullptr);
    const int64_t part_stride = grads * a.N;
    acc_t* part = grads > 0 ? static_cast<acc_t*>(ws.allocate(int64_t(grid.x) * part_stride *
                                                               int64_t(sizeof(acc_t))))
                            : nullptr;
    acc_t* dweight_part = a.dweight != nullptr ? part : nullptr;
    acc_t* dbias_part = a.dbias != nullptr ? part + (a.dweight != nullptr ? a.N : 0) : nullptr;
    p.part_stride = part_stride;
    p.dweight_part = dweight_part;
    p.dbias_part = dbias_part;
    p.mode = kFull;
    bool launched = false;
    if constexpr (int64_t(kTpr) * kItems == bucket_capacity<Table>(kNumBuckets<Table> - 1)) {
      if (clustered) {
        with_extra([&](const auto&... extra) {
          launch_bwd_cluster<T, P, VEC, kTpr, kItems, CENTERED, INPUT_GRAD>(p, grid, stream,
                                                                             extra...);
        });
        launched = true;
      }
    }
    if (split.chunks > 1 && !launched) {
      const auto param_parts = std::make_pair(p.dweight_part, p.dbias_part);
      p.dweight_part = p.dbias_part = nullptr;  // the apply launch writes them
      constexpr int64_t kSums = kBwdSums<CENTERED>;
      p.row_part = static_cast<acc_t*>(
          ws.allocate(a.M * split.chunks * kSums * int64_t(sizeof(acc_t))));
      acc_t* row_coef = static_cast<acc_t*>(ws.allocate(a.M * kSums * int64_t(sizeof(acc_t))));
      p.mode = kPartial;
      launch();
      launch_merge_sums<CENTERED>(p, row_coef, dev, stream);
      p.row_coef = row_coef;
      p.mode = kApply;
      std::tie(p.dweight_part, p.dbias_part) = param_parts;
    }
    if (!launched) launch();
    if (grads > 0) {
      // Columns [0, N) go to the first gradient present, [N, 2N) to dbias.
      P* first = a.dweight != nullptr ? a.dweight : a.dbias;
      launch_sum_partial_rows(part, grid.x, part_stride, a.N, first, a.dbias, dev, stream);
    }
  });
}

// Whether every bucket of Table compiles the grad_sum add (kBwdGradSum).
template <typename Table, bool CENTERED, typename T, int VEC>
constexpr bool adds_grad_sum() {
  for (const Bucket& b : Table::kList) {
    if (!bwd_adds_grad_sum(CENTERED, sizeof(T), VEC, b.tpr, b.items)) return false;
  }
  return true;
}

// The backward of LayerNorm (CENTERED) or RMSNorm (then a.mean and a.dbias are unused).
// INPUT_GRAD: also the input's gradient of a's input-gradient members (NormBwdArgs).
template <bool CENTERED, bool INPUT_GRAD = false, typename T, typename P, typename IO>
void norm_bwd_impl(const NormBwdArgs<T, P, IO>& a, Workspace& ws, DeviceInfo dev,
                   cudaStream_t stream) {
  // M == 0 (gradients are zeros) and N == 0 (nothing to compute) are settled by the caller.
  if (a.M == 0 || a.N == 0) return;
  const bool vectorized = a.N % kVec<T> == 0 && is_16b_aligned(a.x) && is_16b_aligned(a.dy) &&
                          is_16b_aligned(a.dx) && is_16b_aligned(a.weight) &&
                          is_16b_aligned(a.grad_sum) && is_16b_aligned(a.dx_input);
  static_assert(adds_grad_sum<BwdVecBucketsGradSum<T>, CENTERED, T, kVec<T>>() &&
                adds_grad_sum<BwdScalarBuckets, CENTERED, T, 1>());
  // 16-bit LayerNorm's input-gradient kernels take the grad_sum table too (at most 2 packs
  // per thread): its buckets of 4 packs spilled at 128 registers with the multipliers.
  if (vectorized && CENTERED && (a.grad_sum != nullptr || INPUT_GRAD)) {
    run_bwd<T, P, kVec<T>, BwdVecBucketsGradSum<T>, CENTERED, INPUT_GRAD>(a, ws, dev, stream);
  } else if (vectorized) {
    static_assert(CENTERED || adds_grad_sum<BwdVecBuckets<T>, CENTERED, T, kVec<T>>());
    if constexpr (!(CENTERED && INPUT_GRAD)) {  // (those took the branch above)
      run_bwd<T, P, kVec<T>, BwdVecBuckets<T>, CENTERED, INPUT_GRAD>(a, ws, dev, stream);
    }
  } else {
    run_bwd<T, P, 1, BwdScalarBuckets, CENTERED, INPUT_GRAD>(a, ws, dev, stream);
  }
}

}  // namespace

// The entries norm_launch.h declares, instantiated by norm_instances.cuh.
template <bool CENTERED, typename T, typename P, typename IO>
void norm_fwd_cuda(const NormFwdArgs<T, P, IO>& args, Workspace& ws, DeviceInfo dev,
                   cudaStream_t stream) {
  norm_fwd_impl<CENTERED>(args, ws, dev, stream);
}

template <bool CENTERED, typename T, typename P, typename IO>
void norm_fwd_dropout_cuda(const NormFwdArgs<T, P, IO>& args, Workspace& ws, DeviceInfo dev,
                           cudaStream_t stream) {
  norm_fwd_impl<CENTERED, true>(args, ws, dev, stream);
}

template <bool CENTERED, typename T, typename P, typename IO>
void norm_bwd_cuda(const NormBwdArgs<T, P, IO>& args, Workspace& ws, DeviceInfo dev,
                   cudaStream_t stream) {
  norm_bwd_impl<CENTERED>(args, ws, dev, stream);
}

template <bool CENTERED, typename T, typename P, typename IO>
void norm_bwd_input_grad_cuda(const NormBwdArgs<T, P, IO>& args, Workspace& ws, DeviceInfo dev,
                              cudaStream_t stream) {
  norm_bwd_impl<CENTERED, true>(args, ws, dev, stream);
}

}  // namespace fusednorm::cuda
