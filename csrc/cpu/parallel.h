#pragma once
// Loops over rows (or fixed row blocks) split among the intra-op threads in chunks that each
// thread takes when it is free, instead of at::parallel_for's one fixed equal share per
// thread. A memory-bound kernel's threads finish together only while every core runs at the
// same speed; one slowed by another process, an interrupt or its neighbour's traffic made
// the whole call wait for its share (docs/perf-notes.md, "Code comments: parallel.h").
// Which thread runs a chunk never changes a result: a row's outputs do not depend on who
// computes them, and a row block's partial sums have a row of their own (partials.h).

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace fusednorm::cpu {

// Rows of `cols` values per parallel task: enough elements that a task outweighs its
// scheduling cost.
inline int64_t row_grain(int64_t cols) {
  return std::max<int64_t>(1, 32768 / std::max<int64_t>(cols, 1));
}

// body(begin, end) over chunks of [0, n) that the threads take in turn, largest first
// ("guided", as OpenMP's schedule of that name): each chunk is 1 / (2 * threads) of what is
// left, so that the first ones are long sequential streams for the hardware prefetchers and
// the last ones, down to kFinalChunks per thread, even out the threads' finish. At least
// `grain` items per chunk (as at::parallel_for's grain: a smaller call runs on the calling
// thread alone).
template <typename F>
void parallel_chunks(int64_t n, int64_t grain, const F& body) {
  constexpr int64_t kFinalChunks = 16;
  if (n <= 0) return;
  const int64_t threads = at::in_parallel_region() ? 1 : at::get_num_threads();
  const int64_t min_chunk = std::max({grain, n / (threads * kFinalChunks), int64_t(1)});
  if (threads <= 1 || n <= min_chunk) {
    body(int64_t(0), n);
    return;
  }
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min(threads, (n + min_chunk - 1) / min_chunk), 1, [&](int64_t, int64_t) {
    int64_t begin = next.load(std::memory_order_relaxed);
    while (begin < n) {
      const int64_t size = std::max(min_chunk, (n - begin) / (2 * threads));
      if (next.compare_exchange_weak(begin, begin + size, std::memory_order_relaxed)) {
        body(begin, std::min(n, begin + size));
        begin = next.load(std::memory_order_relaxed);
      }  // else begin now holds the counter's current value: try again from there
    }
  });
}

}  // namespace fusednorm::cpu
