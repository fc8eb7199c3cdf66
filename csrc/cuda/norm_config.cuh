#pragma once
// The tuning of the CUDA norm-family kernels (norm_kernels.cuh), in one place: the size
// buckets (threads per row x packs per thread) each pass picks from, the launch bounds
// (threads per multiprocessor a kernel is compiled to keep resident), which buckets hold
// parameters in registers or add grad_sum, and the block sizes of the small kernels. Each
// rule says why in a line; the measurements behind them are in docs/perf-notes.md ("CUDA kernels").
// Also compiled by tests/emulation, whose tests take the largest buckets' row lengths from
// here.

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "cuda/device_utils.cuh"
#include "cuda/norm_launch.h"

namespace fusednorm::cuda {
namespace {

// ---------------------------------------------------------------------------------------
// Size buckets: a row (or a chunk of one) is handled by `tpr` threads holding `items`
// 16-byte packs each (or single elements, in the Scalar tables). A pass takes the smallest
// bucket that holds the row; rows beyond the largest are cut into chunks.

struct Bucket {
  int tpr;    // threads per row (a multiple of 32)
  int items;  // packs per thread
};

// Forward, 16-byte packs: a warp per row up to 128 packs (1024 halves, 512 floats), then
// more warps; 8 packs (128 bytes, 32 registers) per thread at most, so the largest bucket
// holds 8192 packs: 65536 halves, 32768 floats, 16384 doubles per row.
struct FwdVecBuckets {
  static constexpr Bucket kList[] = {{32, 1},  {32, 2},  {32, 4},  {64, 4},  {128, 4},
                                     {256, 4}, {512, 4}, {512, 8}, {1024, 8}};
};
// Forward, 16-byte packs, when 1024 threads of 64 registers do not hold a large bucket
// without spilling: float64 (its arithmetic takes register pairs) and float parameters
// beside 16-bit inputs (16 bytes of weight and bias per 8 elements). The same capacity,
// with at most 512 threads per row and up to 128 registers (kFwdMinBlocks).
struct FwdVecBucketsWide {
  static constexpr Bucket kList[] = {{32, 1},  {32, 2},  {32, 4},  {64, 4},  {128, 4},
                                     {256, 4}, {512, 4}, {512, 8}, {512, 16}};
};
// Forward, one element per pack (misaligned data or N not a multiple of the pack width).
struct FwdScalarBuckets {
  static constexpr Bucket kList[] = {{32, 4}, {128, 4}, {256, 8}, {1024, 8}};
};
struct FwdScalarBucketsWide {
  static constexpr Bucket kList[] = {{32, 4}, {128, 4}, {256, 8}, {512, 16}};
};
// Backward, 16-byte packs. A thread holds x and dy packs and fp32 dweight/dbias sums for
// its columns (3 registers per element for 16-bit inputs, 4 for float, 8 for double): up to
// 512 threads x 4 packs (about 128 registers a thread, one block per multiprocessor), so
// 16-bit rows to 16384 elements stay whole instead of running chunked in clusters (faster
// on the H200, docs/perf-notes.md 2026-11-27).
struct BwdVecBucketList {
  static constexpr Bucket kList[] = {{32, 1},  {32, 2},  {32, 4}, {64, 4},
                                     {128, 4}, {256, 4}, {512, 4}};
};
struct BwdScalarBuckets {
  static constexpr Bucket kList[] = {{32, 4}, {128, 4}, {256, 8}, {512, 8}};
};
// Backward of 16-bit LayerNorm with a grad_sum (add_layer_norm's), 16-byte packs: at most 2
// packs per thread (the grad_sum packs beside the dbias sums made the buckets of 4 spill),
// so rows over 8192 run chunked (1024 x 2 spills). Inputs of 4 and 8 bytes keep
// BwdVecBucketList.
struct BwdVecBucketsGradSum16 {
  static constexpr Bucket kList[] = {{32, 1}, {32, 2}, {64, 2}, {128, 2}, {256, 2}, {512, 2}};
};

// The inputs for which the forward uses the Wide bucket tables.
template <typename T, typename P>
constexpr bool kWideFwd = sizeof(T) == 8 || sizeof(P) > sizeof(T);

// Which table each pass takes, by input dtype T and parameter dtype P. The forward with
// dropout (DROPOUT) takes the Wide ones for every dtype: its draws beside the packs spilled
// at 64 registers (kFwdDropoutMinBlocks).
template <typename T, typename P, bool DROPOUT = false>
using FwdVecTable =
    std::conditional_t<kWideFwd<T, P> || DROPOUT, FwdVecBucketsWide, FwdVecBuckets>;
template <typename T, bool DROPOUT = false>
using FwdScalarTable =
    std::conditional_t<sizeof(T) == 8 || DROPOUT, FwdScalarBucketsWide, FwdScalarBuckets>;
template <typename T>
using BwdVecBuckets = BwdVecBucketList;
// LayerNorm with a grad_sum: kernels that add it (kBwdGradSum).
template <typename T>
using BwdVecBucketsGradSum =
    std::conditional_t<sizeof(T) == 2, BwdVecBucketsGradSum16, BwdVecBucketList>;

// ---------------------------------------------------------------------------------------
// Rows per block: a block of fewer than 128 threads per row takes 128 / TPR rows side by side.

template <int TPR>
struct RowLayout {
  static_assert(TPR % kWarpSize == 0 && TPR <= 1024, "threads per row: a multiple of 32");
  static constexpr int kBlock = TPR >= 128 ? TPR : 128;
  static constexpr int kRows = kBlock / TPR;  // rows side by side in a block
  static constexpr int kWarps = TPR / kWarpSize;  // warps per row
};

// Packs of 16 bytes for T.
template <typename T>
constexpr int kVec = 16 / static_cast<int>(sizeof(T));

// Independent Welford summaries per thread: element e of a pack goes to lane e % kLanes.
// More lanes shorten the dependent chains; four keep 8 registers for them.
template <int VEC>
constexpr int kWelfordLanes = VEC < 4 ? VEC : 4;

// Whether the LayerNorm forward of T takes a row's statistics from shifted sums (v = x -
// shift: sum(v) and sum(v^2), 3 operations an element where Welford's lanes take 5, and one
// reduction of both instead of two in turn; shifted_sums_summary) instead of Welford's
// lanes. Off: an A/B question (benchmarks/cuda_ab, fwd16_shifted_sums) until a GPU times it;
// the emulation runs it on.
template <typename T>
constexpr bool kFwdShiftedSums = false;

// Threads of the per-row merge kernels (a warp per row).
constexpr int kMergeThreads = 128;

// Threads of sum_partial_rows_kernel, and its columns per block: the widest of 32, 16, 8
// that still makes a block per multiprocessor (wider left most multiprocessors idle).
constexpr int kSumThreads = 256;
inline int sum_partial_cols(int64_t width, DeviceInfo dev) {
  for (int cols : {32, 16}) {
    if (ceil_div(width, cols) >= dev.sm_count) return cols;
  }
  return 8;
}

// ---------------------------------------------------------------------------------------
// Forward launch bounds and parameter hoisting

// Threads per multiprocessor a forward kernel is compiled to keep resident (launch bounds):
// 1024 (64 registers a thread), or 512 (128 registers) for float64 and for the buckets of
// 8 or more packs with float parameters beside 16-bit inputs, which spilled at 64.
template <typename T, typename P, int TPR, int ITEMS>
constexpr int kFwdMinBlocks =
    std::max(1, (sizeof(T) == 8 || (sizeof(P) > sizeof(T) && ITEMS >= 8) ? 512 : 1024) /
                    RowLayout<TPR>::kBlock);

// The forward kernels with dropout (norm_fwd_dropout_kernel): 512 threads (128 registers)
// in every bucket; at 64 most buckets spilled (the draws, and the key and factor held
// across the row, beside the packs).
template <int TPR>
constexpr int kFwdDropoutMinBlocks = std::max(1, 512 / RowLayout<TPR>::kBlock);

// Whether a bucket holds its weight (and bias) packs in registers across rows: when they take
// at most 8 registers each (the buckets of up to 2 packs per thread), or 4 on sm_100 and
// newer, where 8 made the 2-pack forward buckets spill at 64 registers.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 1000
constexpr int kHoistBytes = 16;
#else
constexpr int kHoistBytes = 32;
#endif
template <typename P, int VEC, int ITEMS>
constexpr bool kHoistFwdParams = ITEMS * VEC * sizeof(P) <= kHoistBytes;

// Whether a forward kernel stages its block's next row of x in shared memory
// (kFwdStagedRow): each thread copies its own packs of the next row there with cp.async once
// the current row's statistics are reduced (every value it read back is consumed by then),
// and reads them back at the next row's top, so that a lone block has loads in flight while it
// writes a row (16 x ITEMS x TPR bytes of dynamic shared memory: 128 KB for the largest
// bucket). One-row kernels of 16-byte packs of x (IO = T), without dropout. Off: a CUDA A/B
// question (fwd_staged_rows), not yet timed.
template <typename T, typename P, typename IO, int VEC, int TPR, int ITEMS, bool DROPOUT>
constexpr bool kFwdStagedRow = false;

// ---------------------------------------------------------------------------------------
// Backward launch bounds and grad_sum

// Threads per multiprocessor the backward kernels are compiled for: 512 (128 registers),
// except 384 (168 registers) for the 16-bit buckets of 4 packs where 128 spilled: on sm_100
// and newer those holding 2 or 4 rows per block (their slot-combining code), before sm_80
// (no bfloat16 instructions) all of them. Only the device compilation reads these (launch
// bounds); sm_80 and sm_90 fit 128.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 1000
constexpr int kBwd16ThreadsMultiRow = 384, kBwd16ThreadsOneRow = 512;
constexpr int kBwdScalar32Threads8 = 768;  // (see kBwdThreadsPerSm)
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
constexpr int kBwd16ThreadsMultiRow = 384, kBwd16ThreadsOneRow = 384;
#else
constexpr int kBwd16ThreadsMultiRow = 512, kBwd16ThreadsOneRow = 512;
#endif
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ < 1000
constexpr int kBwdScalar32Threads8 = 1024;
#endif

// The one-element kernels (VEC = 1: misaligned or odd rows, and LayerNorm with a grad_sum)
// of inputs up to 4 bytes, unclustered: 1024 (64 registers), which they fit without
// spilling on sm_90 (the 512 bound left registers unused and halved the rows in flight);
// not the clustered ones, nor on sm_100 float32's of 8 items, which take 768 there
// (kBwdScalar32Threads8).
template <typename T, int VEC, int TPR, int ITEMS, bool CLUSTER>
constexpr int kBwdThreadsPerSm =
    VEC == 1 && !CLUSTER && sizeof(T) == 4 && ITEMS == 8 ? kBwdScalar32Threads8
    : VEC == 1 && !CLUSTER && sizeof(T) <= 4             ? 1024
    : sizeof(T) != 2 || ITEMS != 4                       ? 512
    : RowLayout<TPR>::kRows > 1                          ? kBwd16ThreadsMultiRow
                                                         : kBwd16ThreadsOneRow;

template <typename T, int VEC, int TPR, int ITEMS, bool CLUSTER>
constexpr int kBwdMinBlocks =
    std::max(1, kBwdThreadsPerSm<T, VEC, TPR, ITEMS, CLUSTER> / RowLayout<TPR>::kBlock);

// The backward kernels that also write the add ops' input gradient (its multipliers' draws
// on top): the one-element kernels of 8 items at 512 threads per multiprocessor (128
// registers), as LayerNorm's spilled at 1024 (64); the others as the plain ones. (16-bit
// LayerNorm's 16-byte ones take the grad_sum table: norm_bwd_impl.)
template <typename T, int VEC, int TPR, int ITEMS, bool CLUSTER>
constexpr int kBwdInputGradMinBlocks =
    VEC == 1 && ITEMS == 8
        ? std::max(1, std::min(512, kBwdThreadsPerSm<T, VEC, TPR, ITEMS, CLUSTER>) /
                          RowLayout<TPR>::kBlock)
        : kBwdMinBlocks<T, VEC, TPR, ITEMS, CLUSTER>;

// Whether a backward kernel adds grad_sum: all RMSNorm kernels; LayerNorm's one-element
// kernels, those of 4- and 8-byte inputs, and the 16-bit ones of at most 2 packs per
// thread. In LayerNorm's 16-bit buckets of 4 packs the grad_sum packs (with the dbias sums)
// spilled at 128 registers, so 16-bit LayerNorm with a grad_sum takes
// BwdVecBucketsGradSum16 (norm_bwd_impl), and those kernels stay without it. (tpr: for the
// CUDA A/B tool's variants of this rule.)
constexpr bool bwd_adds_grad_sum(bool centered, int elem_bytes, int vec, int tpr, int items) {
  return !centered || vec == 1 || elem_bytes >= 4 || items <= 2;
}
template <bool CENTERED, typename T, int VEC, int TPR, int ITEMS>
constexpr bool kBwdGradSum = bwd_adds_grad_sum(CENTERED, sizeof(T), VEC, TPR, ITEMS);

// Where a backward kernel of one row per block (TPR >= 128) holds what it carries from row
// to row: its columns' dweight/dbias sums in shared memory instead of registers
// (kBwdSharedSums), and the block's next row (x, dy, mean, rstd) loaded before the current
// row's reductions (kBwdNextRow: bytes in flight while a lone block reduces and writes; it
// takes the registers the sums free). Both on for float's chunked rows in clusters only
// (N > 8192): there they gain, and 16-bit rows and whole float rows lose (the backward's
// A/B on the H200, docs/gpu_runs/README.md). The emulation runs them on in every path.
template <typename T, int VEC, int TPR, int ITEMS, bool CLUSTER>
constexpr bool kBwdSharedSums =
    sizeof(T) == 4 && CLUSTER && VEC > 1 && RowLayout<TPR>::kRows == 1;
template <typename T, int VEC, int TPR, int ITEMS, bool CLUSTER>
constexpr bool kBwdNextRow = kBwdSharedSums<T, VEC, TPR, ITEMS, CLUSTER>;
// The block's next row staged in shared memory instead (kBwdStagedRow): each thread copies its
// own packs of the next row's x and dy there with cp.async while it reduces and writes the
// current one (two buffers, 64 * ITEMS * TPR bytes of dynamic shared memory), so loads stay
// in flight without the registers kBwdNextRow takes. 16-bit one-row kernels only (IO = T,
// 16-byte packs of both). Off: a CUDA A/B question (bwd16_staged_rows), not yet timed.
template <typename T, int VEC, int TPR, int ITEMS, bool CLUSTER>
constexpr bool kBwdStagedRow = false;

}  // namespace
}  // namespace fusednorm::cuda
