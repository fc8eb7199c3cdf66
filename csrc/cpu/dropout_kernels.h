#pragma once
// The CPU side of the add ops' dropout and rowscale (common/philox.h has the mask rule):
// the forward's s = x * m + residual of one row, and dropout_scale's grad * m over [M, N]
// rows. m is a kept element's factor (1 / (1 - p) times the row's rowscale, rounded once in
// acc_t) or 0; x * m and + residual round separately (no fma), as the CUDA kernels do, so
// that both devices give one sum for one mask.

#include <algorithm>
#include <cstdint>

#include "common/philox.h"
#include "cpu/parallel.h"
#include "cpu/philox_lanes.h"
#include "cpu/vec_io.h"

namespace fusednorm::cpu {

// The multipliers of one call: its mask (inactive: rowscale alone) and rowscale ([M], or
// null).
template <typename acc_t>
struct RowMultipliers {
  philox::Dropout dropout;
  const acc_t* rowscale = nullptr;
  int64_t N = 0;

  bool active() const { return dropout.active() || rowscale != nullptr; }

  // A kept element's factor in row `row`.
  acc_t factor(int64_t row) const {
    const acc_t scale = static_cast<acc_t>(dropout.scale);
    return rowscale != nullptr ? scale * rowscale[row] : scale;
  }

  // m of columns [col, col + count) of row `row` into m, f being factor(row): the draws of
  // the quads the columns lie in (philox_draws, vectorized across quads), then the threshold.
  void fill(int64_t row, int64_t col, int64_t count, acc_t f, acc_t* m) const {
    if (!dropout.active()) {
      for (int64_t j = 0; j < count; ++j) m[j] = f;
      return;
    }
    if (dropout.threshold > UINT32_MAX) {  // p = 1: no draw reaches 2^32
      for (int64_t j = 0; j < count; ++j) m[j] = acc_t(0);
      return;
    }
    const uint32_t threshold = static_cast<uint32_t>(dropout.threshold);
    const uint64_t first = static_cast<uint64_t>(row * N + col);
    uint64_t quad = first >> 2;
    int64_t skip = static_cast<int64_t>(first & 3);  // the first quad's draws before col
    constexpr int64_t kQuads = 256;
    alignas(64) uint32_t draws[4 * kQuads];
    for (int64_t j = 0; j < count;) {
      const int64_t take = std::min<int64_t>(count - j, 4 * kQuads - skip);
      const int64_t quads = (skip + take + 3) >> 2;
      philox_draws(dropout.seed, dropout.offset, quad, quads, draws);
      for (int64_t t = 0; t < take; ++t) m[j + t] = draws[skip + t] >= threshold ? f : acc_t(0);
      j += take;
      quad += static_cast<uint64_t>(quads);
      skip = 0;
    }
  }
};

// s = a * m + b over row `row` (a: the input, b: the residual), in acc_t, rounded once to S:
// add_row's counterpart with the multipliers.
template <typename A, typename B, typename S, typename acc_t>
void add_row_scaled(const A* a, const B* b, S* s, int64_t N, int64_t row,
                    const RowMultipliers<acc_t>& mult) {
  using Vec = at::vec::Vectorized<acc_t>;
  constexpr int64_t W = VecIO<A, acc_t>::kWidth;
  constexpr int64_t H = Vec::size();
  static_assert(VecIO<B, acc_t>::kWidth == W && VecIO<S, acc_t>::kWidth == W && W == 2 * H);
  const acc_t f = mult.factor(row);
  // The multipliers kChunk columns at a time: one fill per chunk keeps the draws' lanes full
  // (a chunk that starts inside a quad ends with one quad's registers mostly idle).
  constexpr int64_t kChunk = 1024;
  static_assert(kChunk % W == 0);
  alignas(64) acc_t m[kChunk];
  for (int64_t chunk = 0; chunk < N; chunk += kChunk) {
    const int64_t columns = std::min<int64_t>(kChunk, N - chunk);
    // Without draws every multiplier of the row is f: broadcast, no fill.
    const bool uniform = !mult.dropout.active();
    if (!uniform) {
      mult.fill(row, chunk, columns, f, m);
      for (int64_t j = columns; j < (columns + W - 1) / W * W; ++j) m[j] = acc_t(0);
    }
    for (int64_t c = 0; c < columns; c += W) {
      const int64_t i = chunk + c;
      const int64_t count = std::min<int64_t>(W, columns - c);
      const Vec mlo = uniform ? Vec(f) : Vec::loadu(m + c);
      const Vec mhi = uniform ? Vec(f) : Vec::loadu(m + c + H);
      Vec alo, ahi, blo, bhi;
      if (count == W) {
        VecIO<A, acc_t>::load(a + i, alo, ahi);
        VecIO<B, acc_t>::load(b + i, blo, bhi);
        VecIO<S, acc_t>::store(s + i, alo * mlo + blo, ahi * mhi + bhi);
      } else {
        load_partial<A, acc_t>(a + i, count, alo, ahi);
        load_partial<B, acc_t>(b + i, count, blo, bhi);
        store_partial<false>(s + i, count, alo * mlo + blo, ahi * mhi + bhi);
      }
    }
  }
}

// out = grad * m over [M, N] rows, grad of G (acc_t's, or float beside 16-bit O), rounded
// once to O.
template <typename G, typename O, typename acc_t>
void dropout_scale_rows(const G* grad, O* out, int64_t M, int64_t N,
                        const RowMultipliers<acc_t>& mult) {
  parallel_chunks(M, row_grain(N), [&](int64_t begin, int64_t end) {
    constexpr int64_t kBlock = 1024;  // the multipliers a fill at a time, as add_row_scaled
    acc_t m[kBlock];
    for (int64_t row = begin; row < end; ++row) {
      const acc_t f = mult.factor(row);
      for (int64_t col = 0; col < N; col += kBlock) {
        const int64_t count = std::min<int64_t>(kBlock, N - col);
        mult.fill(row, col, count, f, m);
        const G* g = grad + row * N + col;
        O* o = out + row * N + col;
        for (int64_t j = 0; j < count; ++j) {
          o[j] = static_cast<O>(static_cast<acc_t>(g[j]) * m[j]);
        }
      }
    }
  });
}

}  // namespace fusednorm::cpu
