// The timing loop of a CPU kernel A/B (see benchmarks/kernel_ab). Usage:
//   driver PASS DTYPE M N THREADS ROUNDS FOOTPRINT_BYTES
// (PASS: fwd, afwd (add + LayerNorm) or bwd; DTYPE: 0 bf16, 1 fp16, 2 fp32)
// Inputs and outputs: enough sets of M x N to fill FOOTPRINT_BYTES each (at least two),
// cycled.
// Each round times one pass over every set with each side, the side that goes first
// alternating; the result line holds both sides' median and minimum ms per call and the
// median over rounds of the ratio base / head of the round's two times (with its 20% and
// 80% quantiles): a machine that changes speed between rounds moves both times of a round
// alike.
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

extern "C" {
void ab_forward_base(int, const void*, const void*, const float*, const float*, void*, void*,
                     float*, float*, int64_t, int64_t);
void ab_forward_head(int, const void*, const void*, const float*, const float*, void*, void*,
                     float*, float*, int64_t, int64_t);
void ab_backward_base(int, const void*, const void*, const float*, const float*, const float*,
                      void*, float*, float*, float*, int64_t, int64_t);
void ab_backward_head(int, const void*, const void*, const float*, const float*, const float*,
                      void*, float*, float*, float*, int64_t, int64_t);
}

namespace {
// A buffer aligned as PyTorch's CPU allocator aligns tensors (64 bytes). A std::vector of
// megabytes sits 16 bytes past a page (glibc's mmap'ed chunk header), where the kernels
// refuse streaming stores (is_stream_aligned): every output then took the plain-store path.
struct AlignedBuffer {
  explicit AlignedBuffer(int64_t bytes)
      : data_(static_cast<char*>(std::aligned_alloc(64, size_t((bytes + 63) / 64 * 64)))) {
    if (data_ == nullptr) throw std::bad_alloc();
  }
  char* data() const { return data_.get(); }

 private:
  struct Free {
    void operator()(char* p) const { std::free(p); }
  };
  std::unique_ptr<char, Free> data_;
};

double quantile(std::vector<double> v, double q) {
  std::sort(v.begin(), v.end());
  return v[size_t(q * double(v.size() - 1) + 0.5)];
}
}  // namespace

int main(int argc, char** argv) {
  if (argc != 8) {
    std::fprintf(stderr, "usage: %s fwd|afwd|bwd DTYPE M N THREADS ROUNDS FOOTPRINT_BYTES\n",
                 argv[0]);
    return 2;
  }
  const bool backward = std::string(argv[1]) == "bwd";
  const bool residual = std::string(argv[1]) == "afwd";
  const int dtype = std::atoi(argv[2]);
  const int64_t M = std::atoll(argv[3]), N = std::atoll(argv[4]);
  const int rounds = std::atoi(argv[6]);
  at::set_num_threads(std::atoi(argv[5]));
  const int64_t element_bytes = dtype == 2 ? 4 : 2;
  const int64_t bytes = M * N * element_bytes;
  // Input sets to cycle through: as many as fill the footprint (128 MiB by default, out of
  // every cache; a small one keeps a case in cache), at least two (dy is the next set).
  const int64_t footprint = std::atoll(argv[7]);
  const int64_t sets = std::max<int64_t>(2, footprint / std::max<int64_t>(bytes, 1));

  std::mt19937 gen(0);
  std::normal_distribution<float> normal;
  std::vector<AlignedBuffer> inputs;
  for (int64_t k = 0; k < sets; ++k) inputs.emplace_back(bytes);
  for (auto& set : inputs) {
    for (int64_t i = 0; i < M * N; ++i) {
      const float v = normal(gen) + 3.0f;  // off zero, as the shift handles
      char* p = set.data() + i * element_bytes;
      if (dtype == 0) { const c10::BFloat16 h(v); std::memcpy(p, &h, 2); }
      if (dtype == 1) { const c10::Half h(v); std::memcpy(p, &h, 2); }
      if (dtype == 2) std::memcpy(p, &v, 4);
    }
  }
  std::vector<float> w(N), b(N), mean(M, 3.0f), rstd(M, 1.0f), dw(N), db(N);
  for (auto& v : w) v = normal(gen);
  for (auto& v : b) v = normal(gen);
  // Outputs cycle with the inputs: a call writes memory that is out of cache, as a new
  // tensor from the allocator usually is. One output buffer for every call stayed in L3
  // and made plain stores look faster than the suite found them (docs/perf-notes.md,
  // "Streaming stores").
  // Their pages are mapped before the timing, as the suite's reused memory is.
  std::vector<AlignedBuffer> outs, sums;  // sums: the add + LayerNorm forward's only
  for (int64_t k = 0; k < sets; ++k) {
    outs.emplace_back(bytes);
    std::memset(outs.back().data(), 0, size_t(bytes));
    if (residual) {
      sums.emplace_back(bytes);
      std::memset(sums.back().data(), 0, size_t(bytes));
    }
  }
  // Room for the backward's partial rows (num_row_blocks: at most 64 blocks), 64-byte
  // aligned like the op's thread scratch (a std::vector of this size sits 16 bytes off a line).
  AlignedBuffer partials_buffer(int64_t(sizeof(float)) * 2 * 64 * N);
  float* partials = reinterpret_cast<float*>(partials_buffer.data());

  auto pass = [&](bool head) {
    const auto start = std::chrono::steady_clock::now();
    for (int64_t k = 0; k < sets; ++k) {
      const char* x = inputs[k].data();
      if (backward) {
        const char* dy = inputs[(k + 1) % sets].data();
        (head ? ab_backward_head : ab_backward_base)(dtype, dy, x, mean.data(), rstd.data(),
                                                     w.data(), outs[k].data(), dw.data(),
                                                     db.data(), partials, M, N);
      } else {
        const char* r = residual ? inputs[(k + 1) % sets].data() : nullptr;
        (head ? ab_forward_head : ab_forward_base)(dtype, x, r, w.data(), b.data(),
                                                   outs[k].data(),
                                                   residual ? sums[k].data() : nullptr,
                                                   mean.data(), rstd.data(), M, N);
      }
    }
    const std::chrono::duration<double, std::milli> elapsed =
        std::chrono::steady_clock::now() - start;
    return elapsed.count() / double(sets);
  };
  for (int warm = 0; warm < 3; ++warm) { pass(false); pass(true); }
  std::vector<double> base, head, ratio;
  for (int r = 0; r < rounds; ++r) {
    const bool head_first = r % 2 == 1;
    const double first = pass(head_first), second = pass(!head_first);
    base.push_back(head_first ? second : first);
    head.push_back(head_first ? first : second);
    ratio.push_back(base.back() / head.back());
  }
  std::printf("base_ms %.4f base_min_ms %.4f head_ms %.4f head_min_ms %.4f "
              "speedup %.3f speedup_q20 %.3f speedup_q80 %.3f\n",
              quantile(base, 0.5), *std::min_element(base.begin(), base.end()),
              quantile(head, 0.5), *std::min_element(head.begin(), head.end()),
              quantile(ratio, 0.5), quantile(ratio, 0.2), quantile(ratio, 0.8));
  return 0;
}
