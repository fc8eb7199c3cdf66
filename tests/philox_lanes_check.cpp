// tests/test_philox_lanes.py compiles this with each SIMD level's flags: the CPU dropout's
// vectorized draws (cpu/philox_lanes.h) and RowMultipliers::fill against the scalar
// philox::draws and the mask rule, element by element. Prints the mismatches and exits 1 on
// any.
#include <cstdint>
#include <cstdio>
#include <vector>

#include "cpu/dropout_kernels.h"

using namespace fusednorm;

namespace {

int failures = 0;

void fail(const char* what, uint64_t seed, uint64_t offset, uint64_t a, int64_t b) {
  if (++failures <= 20) {
    std::printf("%s: seed %llx offset %llx at %llx, %lld\n", what, (unsigned long long)seed,
                (unsigned long long)offset, (unsigned long long)a, (long long)b);
  }
}

// philox_draws of `count` quads from `quad` against philox::draws, one quad at a time.
void check_draws(uint64_t seed, uint64_t offset, uint64_t quad, int64_t count) {
  std::vector<uint32_t> got(4 * count + 4, 0xDEADBEEFu);
  cpu::philox_draws(seed, offset, quad, count, got.data());
  for (int64_t k = 0; k < count; ++k) {
    const philox::Block want = philox::draws(seed, offset, quad + uint64_t(k));
    for (int l = 0; l < 4; ++l) {
      if (got[4 * k + l] != want.v[l]) fail("draws", seed, offset, quad + k, l);
    }
  }
  for (int l = 0; l < 4; ++l) {  // nothing written past the count
    if (got[4 * count + l] != 0xDEADBEEFu) fail("draws overrun", seed, offset, quad, count);
  }
}

// fill over rows of N columns, in pieces of `piece` columns: element i = row * N + col is
// f where draw i (quad i / 4, word i % 4) is >= the threshold, else 0.
void check_fill(uint64_t seed, uint64_t offset, double p, int64_t N, int64_t rows,
                int64_t piece) {
  cpu::RowMultipliers<float> mult;
  mult.dropout = {seed, offset, philox::dropout_threshold(p), philox::keep_scale(p)};
  mult.N = N;
  std::vector<float> m(N);
  for (int64_t row = 0; row < rows; ++row) {
    const float f = mult.factor(row);
    for (int64_t col = 0; col < N; col += piece) {
      const int64_t count = std::min(piece, N - col);
      mult.fill(row, col, count, f, m.data() + col);
    }
    for (int64_t col = 0; col < N; ++col) {
      const uint64_t i = uint64_t(row * N + col);
      const bool keep =
          philox::keeps(philox::draws(seed, offset, i / 4).v[i % 4], mult.dropout.threshold);
      if (m[col] != (keep ? f : 0.0f)) fail("fill", seed, offset, i, N);
    }
  }
}

}  // namespace

int main() {
  const uint64_t seeds[] = {0, 1, 0x123456789ABCDEF0ull, ~0ull};
  const uint64_t offsets[] = {0, 4, 0xFFFFFFFCull, 0x8000000000000000ull, ~3ull};
  // Quads whose low word wraps inside a register (the carry into the high word), and plain.
  const uint64_t starts[] = {0, 5, 0xFFFFFFF0ull, 0xFFFFFFFBull, 0xFFFFFFFFull,
                             0x1FFFFFFF9ull, ~0ull - 20};
  int64_t draws_checked = 0;
  for (const uint64_t seed : seeds) {
    for (const uint64_t offset : offsets) {
      for (const uint64_t start : starts) {
        for (int64_t count = 1; count <= 40; ++count) {
          check_draws(seed, offset, start, count);
          draws_checked += count;
        }
        check_draws(seed, offset, start, 1000);
        draws_checked += 1000;
      }
    }
  }
  // Rows that are not multiples of 4 or of a register, filled whole, by 1 .. 33 columns and
  // by 256 and by the forward's 1024, at p = 0.5, a small p, and p = 1.
  const int64_t lengths[] = {1, 3, 7, 33, 95, 257, 1000, 1027};
  const int64_t pieces[] = {1, 5, 16, 32, 33, 256, 1024, int64_t(1) << 20};
  for (const int64_t N : lengths) {
    for (const int64_t piece : pieces) {
      check_fill(0x9E3779B97F4A7C15ull, 12, 0.5, N, 9, piece);
    }
  }
  check_fill(7, 0xFFFFFFFCull, 0.1, 1023, 5, 256);
  check_fill(7, 8, 1.0, 37, 3, 16);
#if defined(FUSEDNORM_PHILOX_LANES)
  std::printf("%d lanes: ", int(cpu::philox_lanes::kLanes));
#else
  std::printf("scalar: ");
#endif
  std::printf("%lld quads, %d mismatches\n", (long long)draws_checked, failures);
  return failures == 0 ? 0 : 1;
}
