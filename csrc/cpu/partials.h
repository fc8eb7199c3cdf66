#pragma once
// Per-block partial sums of a backward's reductions over rows (dweight, dbias, dbias1...):
// each block of rows writes one partial row of `cols` sums, and the partials are added in
// block order. The split into blocks depends on the shape only, never on the thread count,
// so the result is bitwise the same on any machine size.

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <memory>

namespace fusednorm::cpu {

// Row blocks for `rows` rows of `cols` columns: at most 64 (enough to keep the threads of
// a large machine busy), at least kMinRowsPerBlock rows each (a partial row costs a read
// and a write of `cols` values, which must stay small beside the rows' own traffic), and
// at most 4M partial values in all. 32 rows, not 8: at 1024 rows, 8-row blocks made 64
// partial rows to zero, update tile by tile and add up, where 32-row blocks make 32
// (docs/perf-notes.md, "Code comments: num_row_blocks"); from 2048 rows the cap of 64
// holds either way.
inline int64_t num_row_blocks(int64_t rows, int64_t cols) {
  constexpr int64_t kMaxBlocks = 64;
  constexpr int64_t kMinRowsPerBlock = 32;
  constexpr int64_t kPartialBudget = int64_t(1) << 22;
  const int64_t by_rows = (rows + kMinRowsPerBlock - 1) / kMinRowsPerBlock;
  const int64_t by_memory = kPartialBudget / std::max<int64_t>(cols, 1);
  return std::max<int64_t>(1, std::min({by_rows, kMaxBlocks, by_memory}));
}

// Room for `count` values of T that belongs to the calling thread and outlives the call
// (the partials of the next backward reuse it), up to kKeptBytes; larger requests get a
// buffer of their own, freed with the returned handle. Why not at::empty: scratch that is
// malloc'ed and freed in every call lands above the call's large outputs in the heap, so
// that freeing those later makes a top chunk past glibc's trim threshold; the heap is then
// handed back to the kernel and the next step page-faults its outputs in again
// (docs/perf-notes.md, "Code comments: thread_scratch").
struct FreeDeleter {
  void operator()(void* p) const { std::free(p); }
};
using ScratchHandle = std::unique_ptr<void, FreeDeleter>;

// What one call holds at once gets a slot each: the same slot twice in one call would hand
// out the same memory.
enum class ScratchSlot { kPartials, kParams, kMultipliers };

template <typename T, ScratchSlot kSlot = ScratchSlot::kPartials>
T* thread_scratch(int64_t count, ScratchHandle& own) {
  constexpr size_t kKeptBytes = size_t(8) << 20;
  constexpr size_t kAlign = 64;
  const size_t bytes = (std::max<int64_t>(count, 1) * sizeof(T) + kAlign - 1) / kAlign * kAlign;
  if (bytes > kKeptBytes) {
    own.reset(std::aligned_alloc(kAlign, bytes));
    TORCH_CHECK(own != nullptr, "fusednorm: out of memory for ", bytes, " bytes of scratch");
    return static_cast<T*>(own.get());
  }
  thread_local ScratchHandle kept;
  thread_local size_t kept_bytes = 0;
  if (kept_bytes < bytes) {
    size_t grown = std::max<size_t>(kAlign, kept_bytes);
    while (grown < bytes) grown *= 2;  // powers of two up to kKeptBytes: few regrowths
    kept.reset(std::aligned_alloc(kAlign, grown));
    TORCH_CHECK(kept != nullptr, "fusednorm: out of memory for ", grown, " bytes of scratch");
    kept_bytes = grown;
  }
  return static_cast<T*>(kept.get());
}

// out[j] = sum over b of partial[b * cols + j], added in block order (b = 0, 1, ...).
// Vectorized across columns: each lane does the same additions in the same order as a
// scalar loop would, so the result does not depend on the vector width either.
template <typename acc_t, typename Out>
void sum_partials(const acc_t* partial, int64_t blocks, int64_t cols, Out* out) {
  using Vec = at::vec::Vectorized<acc_t>;
  constexpr int64_t W = Vec::size();
  constexpr int64_t kChunk = 8 * W;  // columns per task step: sums stay in registers
  const int64_t chunks = (cols + kChunk - 1) / kChunk;
  at::parallel_for(0, chunks, std::max<int64_t>(1, 16384 / (kChunk * std::max<int64_t>(blocks, 1))),
                   [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      const int64_t j0 = c * kChunk, width = std::min(kChunk, cols - j0);
      acc_t sum[kChunk];
      if (width == kChunk) {
        Vec acc[8];
        for (int v = 0; v < 8; ++v) acc[v] = Vec(0);
        for (int64_t b = 0; b < blocks; ++b) {
          const acc_t* p = partial + b * cols + j0;
          for (int v = 0; v < 8; ++v) acc[v] = acc[v] + Vec::loadu(p + v * W);
        }
        for (int v = 0; v < 8; ++v) acc[v].store(sum + v * W);
      } else {
        std::fill(sum, sum + width, acc_t(0));
        for (int64_t b = 0; b < blocks; ++b) {
          const acc_t* p = partial + b * cols + j0;
          for (int64_t j = 0; j < width; ++j) sum[j] += p[j];
        }
      }
      for (int64_t j = 0; j < width; ++j) out[j0 + j] = static_cast<Out>(sum[j]);
    }
  });
}

}  // namespace fusednorm::cpu
