#pragma once
// A long row's reductions taken block by block, the blocks' results combined pairwise: each
// lane of a block's vector accumulators takes at most 2048 values (kRowBlock float32
// elements in 32 lanes), so that the rounding of a row's sums and statistics grows with
// log2 of its blocks, not with N (one accumulator per lane over a row of 2^24 elements lost
// 5 digits of its variance; docs/DESIGN.md, Numerics).

#include <cstdint>

namespace fusednorm::cpu {

// Elements of a row per block (a multiple of every kernel's vector step). A row of at most
// this many is one block: reduced exactly as without blocks.
constexpr int64_t kRowBlock = 65536;

// Results of consecutive blocks combined as a binary counter does its carries: level k
// holds the combination of 2^k blocks, so the combination tree is balanced.
// combine(a, b): a's blocks come before b's.
template <typename S>
class PairwiseCombiner {
 public:
  template <typename Combine>
  void add(S s, const Combine& combine) {
    int k = 0;
    for (; full_[k]; ++k) {
      s = combine(level_[k], s);
      full_[k] = false;
    }
    level_[k] = s;
    full_[k] = true;
  }

  // Every block added (at least one).
  template <typename Combine>
  S result(const Combine& combine) const {
    int k = kLevels - 1;
    while (!full_[k]) --k;
    S total = level_[k];
    for (--k; k >= 0; --k) {
      if (full_[k]) total = combine(total, level_[k]);
    }
    return total;
  }

 private:
  static constexpr int kLevels = 48;  // 2^47 blocks
  S level_[kLevels];
  bool full_[kLevels] = {};
};

// f(start, end) over the elements [0, n) in blocks of kRowBlock, combined pairwise; f(0, n)
// alone where n <= kRowBlock. f's last call is the one with end == n.
template <typename S, typename F, typename Combine>
S combined_blocks(int64_t n, const F& f, const Combine& combine) {
  if (n <= kRowBlock) return f(int64_t(0), n);
  PairwiseCombiner<S> blocks;
  for (int64_t start = 0; start < n; start += kRowBlock) {
    blocks.add(f(start, start + kRowBlock < n ? start + kRowBlock : n), combine);
  }
  return blocks.result(combine);
}

}  // namespace fusednorm::cpu
