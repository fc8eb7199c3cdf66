// One side of a CPU kernel A/B (see benchmarks/kernel_ab): the norm forward and backward of
// one source tree, compiled with -Dfusednorm=fusednorm_<side> so that two trees link into one
// binary, and entered through extern "C" functions named after the side.
#include "cpu/norm_kernels.h"
#include "cpu/partials.h"

#define AB_CAT2(a, b) a##b
#define AB_CAT(a, b) AB_CAT2(a, b)

namespace {
using namespace fusednorm::cpu;

template <typename T>
void forward(const void* x, const void* residual, const float* w, const float* b, void* y,
             void* sum, float* mean, float* rstd, int64_t M, int64_t N) {
  // Designated fields: the two trees' argument structs may differ in fields this leaves out.
  NormFwdArgs<T, float> a{.x = static_cast<const T*>(x),
                          .residual = static_cast<const T*>(residual),
                          .weight = w, .bias = b, .y = static_cast<T*>(y),
                          .sum = static_cast<T*>(sum), .mean = mean, .rstd = rstd, .M = M,
                          .N = N, .eps = 1e-5f, .params_finite = true};
  norm_fwd_rows<T, float, true, true, true>(a);
}

// As the op does it: dx and per-block partials, then the partials summed in block order.
// partials: room for 2 x 64 x N floats, the same buffer for both sides (where the partials
// lie modulo 4 KiB against dy, x and dx moved a backward: docs/perf-notes.md, "Where the
// backward's partials lie").
template <typename T>
void backward(const void* dy, const void* x, const float* mean, const float* rstd,
              const float* w, void* dx, float* dw, float* db, float* partials, int64_t M,
              int64_t N) {
  NormBwdArgs<T, float> a{.dy = static_cast<const T*>(dy), .x = static_cast<const T*>(x),
                          .mean = mean, .rstd = rstd, .weight = w,
                          .dx = static_cast<T*>(dx), .M = M, .N = N, .weight_finite = true};
  const int64_t blocks = num_row_blocks(M, N);
  norm_bwd_rows<T, float, true, true, true>(a, partials, partials + blocks * N, blocks);
  sum_partials<float, float>(partials, blocks, N, dw);
  sum_partials<float, float>(partials + blocks * N, blocks, N, db);
}
}  // namespace

// dtype: 0 bfloat16, 1 float16, 2 float32 (weight and bias in float, as the op widens them).
// residual and sum null: LayerNorm; else add + LayerNorm (the sum written to sum).
extern "C" void AB_CAT(ab_forward_, AB_SIDE)(int dtype, const void* x, const void* residual,
                                             const float* w, const float* b, void* y,
                                             void* sum, float* mean, float* rstd, int64_t M,
                                             int64_t N) {
  if (dtype == 0) forward<c10::BFloat16>(x, residual, w, b, y, sum, mean, rstd, M, N);
  if (dtype == 1) forward<c10::Half>(x, residual, w, b, y, sum, mean, rstd, M, N);
  if (dtype == 2) forward<float>(x, residual, w, b, y, sum, mean, rstd, M, N);
}

extern "C" void AB_CAT(ab_backward_, AB_SIDE)(int dtype, const void* dy, const void* x,
                                              const float* mean, const float* rstd,
                                              const float* w, void* dx, float* dw,
                                              float* db, float* partials, int64_t M,
                                              int64_t N) {
  if (dtype == 0) backward<c10::BFloat16>(dy, x, mean, rstd, w, dx, dw, db, partials, M, N);
  if (dtype == 1) backward<c10::Half>(dy, x, mean, rstd, w, dx, dw, db, partials, M, N);
  if (dtype == 2) backward<float>(dy, x, mean, rstd, w, dx, dw, db, partials, M, N);
}
