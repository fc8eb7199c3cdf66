#pragma once
// The GELU-FFN's elementwise and column-slab kernels and their launchers (the ops, with
// the GEMMs, are gelu_ffn.cu): a = gelu(h); the backward's dgelu pass (dh = dg * gelu'(h)
// stored over dg, db1 = column sums of dh); the column sum of dy. The launchers take raw
// pointers and sizes and no ATen, so that tests/emulation compiles them too.
//
// The kernels read and write 16 bytes per access where the row length and the pointers
// allow it (a 1-element path otherwise), compute in float (double for double) and round
// once on store. Bias gradients are reduced without atomics: each block sums a slab of
// rows for its columns in a fixed order, then one kernel adds the slabs in order, with a
// slab split that depends on the shape only, so results are bitwise reproducible.

#include <c10/cuda/CUDAException.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <type_traits>

#include "common/gelu.h"
#include "cuda/device_utils.cuh"

namespace fusednorm::cuda {
namespace gelu_ffn_detail {

template <typename T>
using acc_type = std::conditional_t<std::is_same_v<T, double>, double, float>;

// kVec elements of T moved as one 16-byte (or, for kVec = 1, one-element) access. Not
// device_utils.cuh's Pack and stores: its explicit store instruction cost these kernels an
// address add per store, which the compiler folds into a plain store.
template <typename T, int kVec>
struct alignas(sizeof(T) * kVec) Pack {
  T v[kVec];
};

template <int kVec, typename T>
__device__ __forceinline__ Pack<T, kVec> load_pack(const T* p) {
#ifdef FUSEDNORM_EMULATION
  ::emu::check_aligned(p, alignof(Pack<T, kVec>));  // a GPU faults on a misaligned access
#endif
  return *reinterpret_cast<const Pack<T, kVec>*>(p);
}

template <int kVec, typename T>
__device__ __forceinline__ void store_pack(T* p, const Pack<T, kVec>& pack) {
#ifdef FUSEDNORM_EMULATION
  ::emu::check_aligned(p, alignof(Pack<T, kVec>));
#endif
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

// ---- launch helpers ----------------------------------------------------------------------

inline bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

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
inline unsigned elementwise_blocks(int64_t work_items, int sm_count) {
  const int64_t max_blocks = static_cast<int64_t>(sm_count) * 16;
  const int64_t needed = (work_items + kElementwiseThreads - 1) / kElementwiseThreads;
  return static_cast<unsigned>(std::max<int64_t>(1, std::min(needed, max_blocks)));
}

// The slab split of a [rows, cols] column reduction: a function of the shape only (not of
// the pack width or the GPU), so the summation order, and the result, never change.
struct SlabSplit {
  int64_t slabs;
  int64_t rows_per_slab;
};

inline SlabSplit slab_split(int64_t rows, int64_t cols) {
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
// and, when sum_out is given, writes the column sums of its values to sum_out ([cols]),
// through partial (column_slab_partial_size(rows, cols) elements).
template <typename T, typename MakeStep>
void launch_column_slabs(int64_t rows, int64_t cols, bool packs_ok, MakeStep&& make_step,
                         T* sum_out, acc_type<T>* partial, int sm_count, cudaStream_t stream) {
  if (rows == 0 || cols == 0) return;
  const SlabSplit split = slab_split(rows, cols);
  const bool reduce = sum_out != nullptr;
  acc_type<T>* partial_ptr = reduce ? partial : nullptr;
  dispatch_vec<T>(packs_ok, [&](auto vec_tag) {
    constexpr int kVec = decltype(vec_tag)::value;
    const auto step = make_step(vec_tag);
    using Step = std::decay_t<decltype(step)>;
    const int64_t block_cols = kSlabColThreads * kVec;
    const dim3 grid(static_cast<unsigned>((cols + block_cols - 1) / block_cols),
                    static_cast<unsigned>(split.slabs));
    const dim3 block(kSlabColThreads, kSlabRowThreads);
    if (reduce) {
      launch_kernel(column_slab_kernel<T, kVec, true, Step>, grid, block, stream, step,
                    partial_ptr, rows, cols, split.rows_per_slab);
    } else {
      launch_kernel(column_slab_kernel<T, kVec, false, Step>, grid, block, stream, step,
                    nullptr, rows, cols, split.rows_per_slab);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  if (reduce) {
    const unsigned blocks = elementwise_blocks(cols, sm_count);
    launch_kernel(sum_slabs_kernel<T>, dim3(blocks), dim3(kElementwiseThreads), stream,
                  partial_ptr, split.slabs, cols, sum_out);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

}  // namespace gelu_ffn_detail

// ---- launchers: contiguous tensors as raw pointers; sm_count sizes the grids -------------

// Elements of the partial-sums buffer (float, double for double) that a column-sum pass
// over [rows, cols] (launch_dgelu with db1, launch_column_sum) needs.
inline int64_t column_slab_partial_size(int64_t rows, int64_t cols) {
  if (rows == 0 || cols == 0) return 0;
  return gelu_ffn_detail::slab_split(rows, cols).slabs * cols;
}

// a = gelu(h) over n contiguous elements.
template <typename T>
void launch_gelu(const T* h, T* a, int64_t n, GeluKind kind, int sm_count, cudaStream_t stream) {
  using namespace gelu_ffn_detail;
  if (n == 0) return;
  // Packs may cross rows here: only the total length and the pointers matter.
  dispatch_vec<T>(packs_fit<T>(n, {h, a}), [&](auto vec_tag) {
    constexpr int kVec = decltype(vec_tag)::value;
    const int64_t packs = n / kVec;
    const unsigned blocks = elementwise_blocks(packs, sm_count);
    dispatch_gelu_kind(kind, [&](auto kind_tag) {
      launch_kernel(gelu_kernel<T, kVec, decltype(kind_tag)::value>, dim3(blocks),
                    dim3(kElementwiseThreads), stream, h, a, packs);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
}

// The backward's pass over contiguous [rows, cols] h and dg_dh: dh = dg * gelu'(h) over dg,
// and, when grad_bias is given, its column sums db1 (through partial).
template <typename T>
void launch_dgelu(const T* h, T* dg_dh, int64_t rows, int64_t cols, T* grad_bias,
                  gelu_ffn_detail::acc_type<T>* partial, GeluKind kind, int sm_count,
                  cudaStream_t stream) {
  using namespace gelu_ffn_detail;
  const bool packs_ok = packs_fit<T>(cols, {h, dg_dh});
  dispatch_gelu_kind(kind, [&](auto kind_tag) {
    constexpr GeluKind k = decltype(kind_tag)::value;
    launch_column_slabs<T>(
        rows, cols, packs_ok,
        [&](auto vec_tag) { return DGeluStep<T, decltype(vec_tag)::value, k>{h, dg_dh}; },
        grad_bias, partial, sm_count, stream);
  });
}

// out = column sums of the contiguous [rows, cols] x (through partial).
template <typename T>
void launch_column_sum(const T* x, int64_t rows, int64_t cols, T* out,
                       gelu_ffn_detail::acc_type<T>* partial, int sm_count, cudaStream_t stream) {
  using namespace gelu_ffn_detail;
  launch_column_slabs<T>(
      rows, cols, packs_fit<T>(cols, {x}),
      [&](auto vec_tag) { return ReadStep<T, decltype(vec_tag)::value>{x}; }, out, partial,
      sm_count, stream);
}

}  // namespace fusednorm::cuda
