// GELU feed-forward block on CUDA.
//
//   forward:  h = x @ W1^T + b1, a = gelu(h), out = a @ W2^T + b2
//   backward: a = gelu(h) again, dW2 = dy^T @ a, db2 = sum_rows(dy), dg = dy @ W2,
//             dh = dg * gelu'(h), db1 = sum_rows(dh), dW1 = dh^T @ x, dx = dh @ W1
//
// GEMMs go through cuBLASLt with the epilogue that fuses the elementwise work where one
// applies (float16 / bfloat16 / float32; GELU epilogues only for approximate="tanh", since
// cuBLASLt's GELU is the tanh form, and only for float16 / bfloat16: in float32 it is less
// accurate than PyTorch's GELU, an error that stays under 16-bit rounding; see
// docs/perf-notes.md, "CUDA kernels"), else through ATen's GEMMs plus
// fusednorm's kernels ("otherwise": float64, FUSEDNORM_DISABLE_CUBLASLT=1, or no cuBLASLt
// algorithm):
//
//   step        with cuBLASLt                                          otherwise
//   h, a        tanh, 16-bit: GEMM + GELU_AUX(_BIAS) epilogue           addmm (mm), gelu pass
//               else:         GEMM + BIAS epilogue, gelu pass
//   out         GEMM + BIAS epilogue                                    addmm (mm)
//   a           gelu pass (recomputed from h)                           gelu pass
//   dW2, db2    GEMM + BGRADB epilogue                                  mm, column sum of dy
//   dh, db1     tanh, 16-bit: GEMM + DGELU(_BGRAD) epilogue             mm (dg), dgelu pass
//               else:         mm (dg), dgelu pass (dh, db1 at once)
//   dW1, dx     mm                                                      mm
//
// The kernels read and write 16 bytes per access where the row length and the pointers
// allow it (a 1-element path otherwise), compute in float (double for double) and round
// once on store. Bias gradients are reduced without atomics: each block sums a slab of
// rows for its columns in a fixed order, then one kernel adds the slabs in order, with a
// slab split that depends on the shape only, so results are bitwise reproducible.
// Everything runs on the current stream with no host synchronisation or host-side
// allocation outside the caching allocator, so the ops can be captured in a CUDA graph.

#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/addmm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <tuple>
#include <type_traits>

#include "common/dispatch.h"
#include "common/gelu.h"
#include "common/gelu_ffn_checks.h"
#include "cuda/cublaslt_gemm.h"

namespace fusednorm::cuda {
namespace {

template <typename T>
using acc_type = std::conditional_t<std::is_same_v<T, double>, double, float>;

// kVec elements of T moved as one 16-byte (or, for kVec = 1, one-element) access.
template <typename T, int kVec>
struct alignas(sizeof(T) * kVec) Pack {
  T v[kVec];
};

template <int kVec, typename T>
__device__ __forceinline__ Pack<T, kVec> load_pack(const T* p) {
  return *reinterpret_cast<const Pack<T, kVec>*>(p);
}

template <int kVec, typename T>
__device__ __forceinline__ void store_pack(T* p, const Pack<T, kVec>& pack) {
  *reinterpret_cast<Pack<T, kVec>*>(p) = pack;
}

constexpr int kElementwiseThreads = 256;

// ---- forward: a = gelu(h) --------------------------------------------------------------

// a = gelu(h) over n contiguous elements, kVec at a time (packs = n / kVec).
template <typename T, int kVec, GeluKind kind>
__global__ void __launch_bounds__(kElementwiseThreads)
    gelu_kernel(const T* __restrict__ h, T* __restrict__ a, int64_t packs) {
  using acc_t = acc_type<T>;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < packs;
       i += stride) {
    const Pack<T, kVec> hv = load_pack<kVec>(h + i * kVec);
    Pack<T, kVec> av;
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      av.v[j] = static_cast<T>(gelu<kind>(static_cast<acc_t>(hv.v[j])));
    }
    store_pack<kVec>(a + i * kVec, av);
  }
}

// ---- column-slab passes: the backward's dgelu pass and the column sum of dy ------------

// A block covers kSlabColThreads * kVec columns and one slab of rows; its threads step
// through the slab kSlabRowThreads rows apart.
constexpr int kSlabColThreads = 32;
constexpr int kSlabRowThreads = 8;

// The backward's elementwise work on kVec elements at offset `off` of [rows, cols]:
// dh = dg * gelu'(h) stored over dg; returns dh (before rounding) for db1.
template <typename T, int kVec, GeluKind kind>
struct DGeluStep {
  const T* __restrict__ h;
  T* __restrict__ dg_dh;

  __device__ __forceinline__ void operator()(int64_t off, acc_type<T> (&out)[kVec]) const {
    using acc_t = acc_type<T>;
    const Pack<T, kVec> hv = load_pack<kVec>(h + off);
    const Pack<T, kVec> gv = load_pack<kVec>(dg_dh + off);
    Pack<T, kVec> dv;
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      out[j] = static_cast<acc_t>(gv.v[j]) * gelu_and_grad<kind>(static_cast<acc_t>(hv.v[j])).grad;
      dv.v[j] = static_cast<T>(out[j]);
    }
    store_pack<kVec>(dg_dh + off, dv);
  }
};

// Reads kVec elements: the column sum of x.
template <typename T, int kVec>
struct ReadStep {
  const T* __restrict__ x;

  __device__ __forceinline__ void operator()(int64_t off, acc_type<T> (&out)[kVec]) const {
    const Pack<T, kVec> xv = load_pack<kVec>(x + off);
#pragma unroll
    for (int j = 0; j < kVec; ++j) out[j] = static_cast<acc_type<T>>(xv.v[j]);
  }
};

// Runs step over every kVec-element pack of a contiguous [rows, cols] tensor (cols a
// multiple of kVec). With kReduce, block (x, y) writes the sums of step's values over the
// rows of slab y, for its columns, to partial[y, col]: each thread adds its rows in
// order, then the block adds its threads' sums in threadIdx.y order. No atomics.
template <typename T, int kVec, bool kReduce, typename Step>
__global__ void __launch_bounds__(kSlabColThreads* kSlabRowThreads)
    column_slab_kernel(Step step, acc_type<T>* __restrict__ partial, int64_t rows,
                       int64_t cols, int64_t rows_per_slab) {
  using acc_t = acc_type<T>;
  constexpr int kBlockCols = kSlabColThreads * kVec;
  const int64_t block_col = static_cast<int64_t>(blockIdx.x) * kBlockCols;
  const int64_t col = block_col + static_cast<int64_t>(threadIdx.x) * kVec;
  const int64_t row_begin = static_cast<int64_t>(blockIdx.y) * rows_per_slab;
  const int64_t row_end = rows < row_begin + rows_per_slab ? rows : row_begin + rows_per_slab;

  acc_t sum[kVec];
#pragma unroll
  for (int j = 0; j < kVec; ++j) sum[j] = acc_t(0);
  if (col < cols) {
    for (int64_t row = row_begin + threadIdx.y; row < row_end; row += kSlabRowThreads) {
      acc_t values[kVec];
      step(row * cols + col, values);
#pragma unroll
      for (int j = 0; j < kVec; ++j) sum[j] += values[j];
    }
  }
  if constexpr (kReduce) {
    __shared__ acc_t block_sums[kSlabRowThreads][kBlockCols];
#pragma unroll
    for (int j = 0; j < kVec; ++j) block_sums[threadIdx.y][threadIdx.x * kVec + j] = sum[j];
    __syncthreads();
    for (int c = threadIdx.y * kSlabColThreads + threadIdx.x; c < kBlockCols;
         c += kSlabColThreads * kSlabRowThreads) {
      if (block_col + c < cols) {
        acc_t total = acc_t(0);
#pragma unroll
        for (int r = 0; r < kSlabRowThreads; ++r) total += block_sums[r][c];
        partial[static_cast<int64_t>(blockIdx.y) * cols + block_col + c] = total;
      }
    }
  }
}

// out[col] = sum over slabs of partial[slab, col], in slab order.
template <typename T>
__global__ void __launch_bounds__(kElementwiseThreads)
    sum_slabs_kernel(const acc_type<T>* __restrict__ partial, int64_t slabs, int64_t cols,
                     T* __restrict__ out) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t col = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; col < cols;
       col += stride) {
    acc_type<T> total = 0;
    for (int64_t s = 0; s < slabs; ++s) total += partial[s * cols + col];
    out[col] = static_cast<T>(total);
  }
}

// ---- launches ----------------------------------------------------------------------------

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// Calls fn(std::integral_constant<int, kVec>{}): 16-byte packs when the row length and
// every pointer allow them, single elements otherwise.
template <typename T, typename Fn>
void dispatch_vec(bool packs_fit, Fn&& fn) {
  constexpr int kWide = 16 / sizeof(T);
  if (packs_fit) return fn(std::integral_constant<int, kWide>{});
  return fn(std::integral_constant<int, 1>{});
}

template <typename T>
bool packs_fit(int64_t cols, std::initializer_list<const void*> pointers) {
  if (cols % (16 / sizeof(T)) != 0) return false;
  return std::all_of(pointers.begin(), pointers.end(),
                     [](const void* p) { return p == nullptr || aligned16(p); });
}

// Blocks of a grid-stride elementwise launch: enough to fill the GPU, no more.
unsigned elementwise_blocks(int64_t work_items) {
  const int64_t max_blocks =
      static_cast<int64_t>(at::cuda::getCurrentDeviceProperties()->multiProcessorCount) * 16;
  const int64_t needed = (work_items + kElementwiseThreads - 1) / kElementwiseThreads;
  return static_cast<unsigned>(std::max<int64_t>(1, std::min(needed, max_blocks)));
}

// a = gelu(h) for contiguous tensors of one shape.
template <typename T>
void launch_gelu(const at::Tensor& h, at::Tensor& a, GeluKind kind) {
  const int64_t n = h.numel();
  if (n == 0) return;
  const T* h_ptr = h.const_data_ptr<T>();
  T* a_ptr = a.mutable_data_ptr<T>();
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  // Packs may cross rows here: only the total length and the pointers matter.
  dispatch_vec<T>(packs_fit<T>(n, {h_ptr, a_ptr}), [&](auto vec_tag) {
    constexpr int kVec = decltype(vec_tag)::value;
    const int64_t packs = n / kVec;
    const unsigned blocks = elementwise_blocks(packs);
    dispatch_gelu_kind(kind, [&](auto kind_tag) {
      gelu_kernel<T, kVec, decltype(kind_tag)::value><<<blocks, kElementwiseThreads, 0, stream>>>(
          h_ptr, a_ptr, packs);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
}

// The slab split of a [rows, cols] column reduction: a function of the shape only (not of
// the pack width or the GPU), so the summation order, and the result, never change.
struct SlabSplit {
  int64_t slabs;
  int64_t rows_per_slab;
};

SlabSplit slab_split(int64_t rows, int64_t cols) {
  constexpr int64_t kTargetBlocks = 2048;         // about two waves of blocks on an H100
  constexpr int64_t kNominalBlockCols = 256;      // columns of a block at 16-bit packs
  constexpr int64_t kMinRowsPerThread = 4;
  const int64_t col_blocks = std::max<int64_t>(1, (cols + kNominalBlockCols - 1) / kNominalBlockCols);
  const int64_t max_slabs = std::max<int64_t>(1, rows / (kSlabRowThreads * kMinRowsPerThread));
  const int64_t slabs = std::clamp<int64_t>((kTargetBlocks + col_blocks - 1) / col_blocks, 1, max_slabs);
  const int64_t rows_per_slab = (rows + slabs - 1) / slabs;
  return {(rows + rows_per_slab - 1) / rows_per_slab, rows_per_slab};
}

// Runs the step that make_step builds for the chosen pack width (packs when packs_ok: cols
// and the step's pointers allow them) over the contiguous [rows, cols] tensors it reads,
// and, when sum_out is given, writes the column sums of its values to sum_out ([cols]).
template <typename T, typename MakeStep>
void launch_column_slabs(int64_t rows, int64_t cols, bool packs_ok, MakeStep&& make_step,
                         T* sum_out, const at::TensorOptions& options) {
  if (rows == 0 || cols == 0) return;
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const SlabSplit split = slab_split(rows, cols);
  const bool reduce = sum_out != nullptr;
  at::Tensor partial = at::empty({reduce ? split.slabs : 0, cols},
                                 options.dtype(c10::CppTypeToScalarType<acc_type<T>>::value));
  acc_type<T>* partial_ptr = reduce ? partial.mutable_data_ptr<acc_type<T>>() : nullptr;
  dispatch_vec<T>(packs_ok, [&](auto vec_tag) {
    constexpr int kVec = decltype(vec_tag)::value;
    const auto step = make_step(vec_tag);
    using Step = std::decay_t<decltype(step)>;
    const int64_t block_cols = kSlabColThreads * kVec;
    const dim3 grid(static_cast<unsigned>((cols + block_cols - 1) / block_cols),
                    static_cast<unsigned>(split.slabs));
    const dim3 block(kSlabColThreads, kSlabRowThreads);
    if (reduce) {
      column_slab_kernel<T, kVec, true, Step><<<grid, block, 0, stream>>>(
          step, partial_ptr, rows, cols, split.rows_per_slab);
    } else {
      column_slab_kernel<T, kVec, false, Step><<<grid, block, 0, stream>>>(
          step, nullptr, rows, cols, split.rows_per_slab);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  if (reduce) {
    const unsigned blocks = elementwise_blocks(cols);
    sum_slabs_kernel<T><<<blocks, kElementwiseThreads, 0, stream>>>(
        partial_ptr, split.slabs, cols, sum_out);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

// The backward's pass: dh = dg * gelu'(h) over dg, db1 = column sums of dh.
template <typename T>
void launch_dgelu(const at::Tensor& h, at::Tensor& dg_dh, T* grad_bias, GeluKind kind) {
  const T* h_ptr = h.const_data_ptr<T>();
  T* dg_ptr = dg_dh.mutable_data_ptr<T>();
  const bool packs_ok = packs_fit<T>(h.size(1), {h_ptr, dg_ptr});
  dispatch_gelu_kind(kind, [&](auto kind_tag) {
    constexpr GeluKind k = decltype(kind_tag)::value;
    launch_column_slabs<T>(
        h.size(0), h.size(1), packs_ok,
        [&](auto vec_tag) {
          return DGeluStep<T, decltype(vec_tag)::value, k>{h_ptr, dg_ptr};
        },
        grad_bias, h.options());
  });
}

// out = column sums of the contiguous [rows, cols] tensor x.
template <typename T>
void launch_column_sum(const at::Tensor& x, T* out) {
  const T* x_ptr = x.const_data_ptr<T>();
  launch_column_slabs<T>(
      x.size(0), x.size(1), packs_fit<T>(x.size(1), {x_ptr}),
      [&](auto vec_tag) { return ReadStep<T, decltype(vec_tag)::value>{x_ptr}; }, out,
      x.options());
}

// cuBLASLt's GELU epilogues: its GELU is the tanh form, accurate to 16-bit rounding only.
template <typename T>
constexpr bool gelu_epilogue_usable(GeluKind kind) {
  return kind == GeluKind::kTanh && (std::is_same_v<T, at::Half> || std::is_same_v<T, at::BFloat16>);
}

template <typename T>
T* data_or_null(const std::optional<at::Tensor>& t) {
  return given(t) ? const_cast<T*>(t->const_data_ptr<T>()) : nullptr;
}

// ---- ops ---------------------------------------------------------------------------------

std::tuple<at::Tensor, at::Tensor> gelu_ffn_fwd(const at::Tensor& input, const at::Tensor& weight1,
                                                const std::optional<at::Tensor>& bias1,
                                                const at::Tensor& weight2,
                                                const std::optional<at::Tensor>& bias2,
                                                c10::string_view approximate) {
  check_gelu_ffn_fwd_args(input, weight1, bias1, weight2, bias2);
  const GeluKind kind = parse_approximate(approximate);
  const c10::cuda::OptionalCUDAGuard device_guard(input.device());
  const int64_t M = input.size(0), H = weight1.size(0), N = weight2.size(0);
  const auto options = input.options();
  at::Tensor hidden = at::empty({M, H}, options);
  at::Tensor act = at::empty({M, H}, options);
  at::Tensor out = at::empty({M, N}, options);
  const bool lt = cublaslt_enabled(input.scalar_type());

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, input.scalar_type(), "gelu_ffn_fwd", [&] {
    using T = scalar_t;
    T* b1 = data_or_null<T>(bias1);
    T* b2 = data_or_null<T>(bias2);

    // h and a: one GEMM whose epilogue adds b1, applies tanh-GELU and keeps h (tanh only).
    const bool fused = lt && gelu_epilogue_usable<T>(kind) &&
                       try_cublaslt_gemm({input, false, weight1, true, act,
                                          b1 ? LtEpilogue::kGeluAuxBias : LtEpilogue::kGeluAux,
                                          b1, hidden.mutable_data_ptr()});
    if (!fused) {
      // Else the GEMM with b1 added inside it (epilogue, or addmm's beta = 1), before the
      // product is rounded to T: adding it to a rounded float16/bfloat16 product loses
      // accuracy wherever the two nearly cancel. Then GELU in one pass.
      const bool gemm_done = lt && b1 != nullptr &&
                             try_cublaslt_gemm({input, false, weight1, true, hidden,
                                                LtEpilogue::kBias, b1});
      if (!gemm_done) {
        if (b1 != nullptr) {
          at::addmm_out(hidden, *bias1, input, weight1.t());
        } else {
          at::mm_out(hidden, input, weight1.t());
        }
      }
      launch_gelu<T>(hidden, act, kind);
    }

    // out = a @ W2^T + b2.
    const bool out_done = lt && b2 != nullptr &&
                          try_cublaslt_gemm({act, false, weight2, true, out, LtEpilogue::kBias, b2});
    if (!out_done) {
      if (b2 != nullptr) {
        at::addmm_out(out, *bias2, act, weight2.t());
      } else {
        at::mm_out(out, act, weight2.t());
      }
    }
  });
  return {out, hidden};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> gelu_ffn_bwd(
    const at::Tensor& grad_out, const at::Tensor& input, const at::Tensor& hidden_pre,
    const at::Tensor& weight1, const at::Tensor& weight2, bool has_bias1, bool has_bias2,
    c10::string_view approximate) {
  check_gelu_ffn_bwd_args(grad_out, input, hidden_pre, weight1, weight2);
  const GeluKind kind = parse_approximate(approximate);
  const c10::cuda::OptionalCUDAGuard device_guard(input.device());
  const int64_t M = input.size(0), K = input.size(1), H = weight1.size(0), N = weight2.size(0);
  const auto options = input.options();
  at::Tensor grad_input = at::empty({M, K}, options);
  at::Tensor grad_weight1 = at::empty({H, K}, options);
  at::Tensor grad_weight2 = at::empty({N, H}, options);
  at::Tensor grad_bias1 = at::empty({has_bias1 ? H : 0}, options);
  at::Tensor grad_bias2 = at::empty({has_bias2 ? N : 0}, options);
  if (M == 0) {  // no rows: the weight and bias gradients are empty sums
    grad_weight1.zero_();
    grad_weight2.zero_();
    grad_bias1.zero_();
    grad_bias2.zero_();
    return {grad_input, grad_weight1, grad_bias1, grad_weight2, grad_bias2};
  }
  const bool lt = cublaslt_enabled(input.scalar_type());
  at::Tensor grad_hidden;  // dg, then dh in place

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, input.scalar_type(), "gelu_ffn_bwd", [&] {
    using T = scalar_t;
    T* db1 = has_bias1 ? grad_bias1.mutable_data_ptr<T>() : nullptr;
    T* db2 = has_bias2 ? grad_bias2.mutable_data_ptr<T>() : nullptr;

    // a = gelu(h) again, then dW2 = dy^T @ a, with db2 = column sums of dy in the GEMM's
    // epilogue if it can. a is released before dh is allocated, so the backward holds h and
    // one [M, H] temporary at a time (the caching allocator hands a's block to dh), where
    // eager holds h, a and a gradient of one of them. The price, off the 16-bit tanh path:
    // h is read twice (the gelu pass, then the dgelu pass), once when one pass wrote a and dh.
    {
      at::Tensor act = at::empty({M, H}, options);
      launch_gelu<T>(hidden_pre, act, kind);
      const bool db2_done = lt && db2 != nullptr &&
                            try_cublaslt_gemm({grad_out, true, act, false, grad_weight2,
                                               LtEpilogue::kBgradRowsOfA, db2});
      if (!db2_done) {
        at::mm_out(grad_weight2, grad_out.t(), act);
        if (db2 != nullptr) launch_column_sum<T>(grad_out, db2);
      }
    }

    // dh = (dy @ W2) * gelu'(h), stored over dg, and db1: in the GEMM's epilogue where it
    // applies, else dg = dy @ W2 and one pass over h and dg.
    grad_hidden = at::empty({M, H}, options);
    const bool fused = lt && gelu_epilogue_usable<T>(kind) &&
                       try_cublaslt_gemm({grad_out, false, weight2, false, grad_hidden,
                                          db1 ? LtEpilogue::kDGeluBgrad : LtEpilogue::kDGelu,
                                          db1, const_cast<void*>(hidden_pre.const_data_ptr())});
    if (!fused) {
      at::mm_out(grad_hidden, grad_out, weight2);
      launch_dgelu<T>(hidden_pre, grad_hidden, db1, kind);
    }
  });
  at::mm_out(grad_weight1, grad_hidden.t(), input);
  at::mm_out(grad_input, grad_hidden, weight1);
  return {grad_input, grad_weight1, grad_bias1, grad_weight2, grad_bias2};
}

}  // namespace
}  // namespace fusednorm::cuda

TORCH_LIBRARY_IMPL(fusednorm, CUDA, m) {
  m.impl("gelu_ffn_fwd", &fusednorm::cuda::gelu_ffn_fwd);
  m.impl("gelu_ffn_bwd", &fusednorm::cuda::gelu_ffn_bwd);
}
