#pragma once
// Device-side helpers shared by fusednorm's CUDA kernels: vector accesses, conversions,
// rounding-controlled arithmetic and warp reductions that give every lane the same bits.

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>

#include "common/welford.h"

namespace fusednorm::cuda {

constexpr int kWarpSize = 32;
constexpr unsigned kFullMask = 0xffffffffu;

// VEC elements of T moved by one access: 16 bytes when VEC * sizeof(T) >= 16 (a wider pack,
// e.g. 8 float parameters beside 8 halves, is moved as several 16-byte accesses).
template <typename T, int VEC>
struct alignas(VEC * sizeof(T) >= 16 ? 16 : VEC * sizeof(T)) Pack {
  T v[VEC];
};

template <int VEC, typename T>
__device__ __forceinline__ Pack<T, VEC> load_pack(const T* p) {
#ifdef FUSEDNORM_EMULATION
  ::emu::check_aligned(p, alignof(Pack<T, VEC>));  // a GPU faults on a misaligned access
#endif
  return *reinterpret_cast<const Pack<T, VEC>*>(p);
}

// One 16-byte global store, as an explicit instruction: assigning a pack of
// c10::Half/BFloat16 (or a uint4 copied from one) let the compiler split the store into 2-
// or 4-byte stores, and __stwb's vector store is a strong (ordered) one. No "memory"
// clobber, so that the compiler may still issue later loads (the next packs' parameters)
// before it: nothing reads these outputs back in the same kernel.
__device__ __forceinline__ void store_global_16b(void* p, const uint4& v) {
#ifdef FUSEDNORM_EMULATION
  ::emu::check_aligned(p, 16);
  *reinterpret_cast<uint4*>(p) = v;
#else
  asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x), "r"(v.y),
               "r"(v.z), "r"(v.w));
#endif
}

// The same for 8 bytes (a pack of four 16-bit outputs beside float math: NormFwdArgs' IO).
__device__ __forceinline__ void store_global_8b(void* p, const uint2& v) {
#ifdef FUSEDNORM_EMULATION
  ::emu::check_aligned(p, 8);
  *reinterpret_cast<uint2*>(p) = v;
#else
  asm volatile("st.global.v2.b32 [%0], {%1, %2};" ::"l"(p), "r"(v.x), "r"(v.y));
#endif
}

// Packs of 16 bytes or a multiple go out as 16-byte stores, packs of several elements in 8
// bytes as one 8-byte store; narrower ones (VEC = 1) as one T.
template <int VEC, typename T>
__device__ __forceinline__ void store_pack(T* p, const Pack<T, VEC>& pack) {
  if constexpr (sizeof(Pack<T, VEC>) % 16 == 0) {
    const uint4* words = reinterpret_cast<const uint4*>(&pack);
#pragma unroll
    for (int w = 0; w < int(sizeof(Pack<T, VEC>) / 16); ++w) {
      store_global_16b(reinterpret_cast<uint4*>(p) + w, words[w]);
    }
  } else if constexpr (VEC > 1 && sizeof(Pack<T, VEC>) == 8) {
    store_global_8b(p, *reinterpret_cast<const uint2*>(&pack));
  } else {
#ifdef FUSEDNORM_EMULATION
    ::emu::check_aligned(p, alignof(Pack<T, VEC>));
#endif
    *reinterpret_cast<Pack<T, VEC>*>(p) = pack;
  }
}

// Element to accumulator. The 16-bit types convert from their bits, which keeps a pack in
// its 4 registers until each element is used (c10's conversion operators go through the
// element's address, which for bfloat16 made the compiler unpack whole rows early).
__device__ __forceinline__ float to_acc(float v) { return v; }
__device__ __forceinline__ double to_acc(double v) { return v; }
__device__ __forceinline__ float to_acc(c10::Half v) { return __half2float(__ushort_as_half(v.x)); }
__device__ __forceinline__ float to_acc(c10::BFloat16 v) {
  return __uint_as_float(static_cast<unsigned>(v.x) << 16);  // exact: bf16 is f32's top half
}

// Element e of a pack as the accumulator type. bfloat16 is a float's upper half, so the
// 32-bit word that holds elements 2k and 2k + 1 gives each in one instruction (a shift, a
// mask); to_acc of the element first extracts its half from the word, two instructions and
// often a move for every odd element (the SASS of the 16-bit forward, an issue-bound kernel).
template <typename T, int VEC>
__device__ __forceinline__ auto pack_acc(const Pack<T, VEC>& p, int e) {
  if constexpr (std::is_same_v<T, c10::BFloat16> && VEC % 2 == 0) {
    unsigned word;
    memcpy(&word, &p.v[e - e % 2], sizeof(word));
    return __uint_as_float(e % 2 == 0 ? word << 16 : word & 0xffff0000u);
  } else {
    return to_acc(p.v[e]);
  }
}

// Whether p may be read by 16-byte accesses (nullptr: an absent tensor, nothing to read).
inline bool is_16b_aligned(const void* p) {
  return reinterpret_cast<std::uintptr_t>(p) % 16 == 0;
}

// a * b rounded once, never fused into a neighbouring add by the compiler: a product that
// is later subtracted from its own rounded value (dy * w in the backward) must round alike
// both times for exact cancellations such as dx = 0 on a one-element row.
__device__ __forceinline__ float mul_rn(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ double mul_rn(double a, double b) { return __dmul_rn(a, b); }

// a * b + c rounded once, as an explicit fused multiply-add (the same in every kernel that
// must reproduce another's bits, e.g. the LayerNorm forward and layer_norm_apply).
__device__ __forceinline__ float fma_acc(float a, float b, float c) { return __fmaf_rn(a, b, c); }
__device__ __forceinline__ double fma_acc(double a, double b, double c) { return __fma_rn(a, b, c); }

template <typename T>
__device__ __forceinline__ T shfl_xor(T v, int mask) {
  return __shfl_xor_sync(kFullMask, v, mask);
}

// Sum over each aligned group of kGroup lanes (a power of two), the same bits in every lane
// of the group (the butterfly's two partners add the same two operands, and addition
// commutes).
template <int kGroup, typename acc_t>
__device__ __forceinline__ acc_t group_sum(acc_t v) {
  static_assert(kGroup > 0 && kGroup <= kWarpSize && (kGroup & (kGroup - 1)) == 0,
                "lanes per group: a power of two up to a warp");
#pragma unroll
  for (int mask = 1; mask < kGroup; mask <<= 1) v += shfl_xor(v, mask);
  return v;
}

// Sum over the 32 lanes of a warp, the same bits in every lane.
template <typename acc_t>
__device__ __forceinline__ acc_t warp_sum(acc_t v) {
  return group_sum<kWarpSize>(v);
}

template <typename acc_t>
__device__ __forceinline__ WelfordState<acc_t> shfl_xor(const WelfordState<acc_t>& s, int mask) {
  WelfordState<acc_t> out;
  out.mean = shfl_xor(s.mean, mask);
  out.m2 = shfl_xor(s.m2, mask);
  out.count = shfl_xor(s.count, mask);
  return out;
}

// count_b / total for Chan's merge. float: the fast division (two ulp at most, no slow-path
// call: counts are normal numbers), as a full-precision division costs a subroutine call,
// whose saved registers spilled the large buckets; the weight's error is far below the
// rounding of the merged mean. double: exact division.
__device__ __forceinline__ float count_share(float part, float total) {
  return __fdividef(part, total);
}
__device__ __forceinline__ double count_share(double part, double total) { return part / total; }

// WelfordState::merge (Chan's formula), with the weight other.count / total computed by
// count_share.
template <typename acc_t>
__device__ __forceinline__ WelfordState<acc_t> chan_merge(const WelfordState<acc_t>& a,
                                                          const WelfordState<acc_t>& b) {
  if (b.count == acc_t(0)) return a;
  if (a.count == acc_t(0)) return b;
  WelfordState<acc_t> out;
  out.count = a.count + b.count;
  const acc_t b_share = count_share(b.count, out.count);
  const acc_t delta = b.mean - a.mean;
  out.mean = a.mean + delta * b_share;
  out.m2 = a.m2 + b.m2 + delta * delta * a.count * b_share;
  return out;
}

// Chan merge of the 32 lanes' summaries in a fixed tree order, the same bits in every lane:
// at each step the lane whose `mask` bit is clear is the left operand, so both partners
// compute chan_merge(left, right) on the same operands.
template <typename acc_t>
__device__ __forceinline__ WelfordState<acc_t> warp_merge(WelfordState<acc_t> s) {
  const int lane = threadIdx.x % kWarpSize;
#pragma unroll
  for (int mask = 1; mask < kWarpSize; mask <<= 1) {
    const WelfordState<acc_t> other = shfl_xor(s, mask);
    const bool left = (lane & mask) == 0;
    s = left ? chan_merge(s, other) : chan_merge(other, s);
  }
  return s;
}

// Launches kernel<<<grid, block, smem, stream>>>(args...) (smem: bytes of dynamic shared
// memory). The launchers go through it so that tests/emulation can compile them as host C++
// and run the kernels on its emulated blocks (FUSEDNORM_EMULATION, defined only there; its
// kernels' dynamic shared memory is a static array, dynamic_shared).
template <typename... Params, typename... Args>
inline void launch_kernel_smem(void (*kernel)(Params...), dim3 grid, dim3 block, int smem,
                               cudaStream_t stream, Args&&... args) {
#ifdef FUSEDNORM_EMULATION
  (void)smem;
  ::emu::launch(kernel, grid, block, stream, std::forward<Args>(args)...);
#else
  kernel<<<grid, block, smem, stream>>>(std::forward<Args>(args)...);
#endif
}

template <typename... Params, typename... Args>
inline void launch_kernel(void (*kernel)(Params...), dim3 grid, dim3 block, cudaStream_t stream,
                          Args&&... args) {
  launch_kernel_smem(kernel, grid, block, 0, stream, std::forward<Args>(args)...);
}

// The block's dynamic shared memory as kWords words of acc_t (the launch gives the bytes).
// The emulation has none: a static array of the instantiation stands in (one per block).
template <typename acc_t, int kWords>
__device__ __forceinline__ acc_t* dynamic_shared() {
#ifdef FUSEDNORM_EMULATION
  __shared__ acc_t words[kWords];
  return words;
#else
  extern __shared__ __align__(16) unsigned char dynamic_smem[];
  return reinterpret_cast<acc_t*>(dynamic_smem);
#endif
}

// cp.async: 16 bytes from global to shared memory in the background (sm_80 and newer), zero
// where !valid (then src is not read). A thread's copies form a group at async_commit;
// async_wait<n>() returns once all but its newest n groups have landed. Used for what a
// thread itself reads back (its own slots): no barrier is needed.
__device__ __forceinline__ void async_copy16(void* smem, const void* src, bool valid) {
#ifdef FUSEDNORM_EMULATION
  ::emu::async_copy(smem, src, 16, valid);
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
               "r"(valid ? 16 : 0)
               : "memory");
#else
  *static_cast<uint4*>(smem) = valid ? *static_cast<const uint4*>(src) : uint4{0, 0, 0, 0};
#endif
}

__device__ __forceinline__ void async_commit() {
#ifdef FUSEDNORM_EMULATION
  ::emu::async_commit();
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}

template <int kNewest>
__device__ __forceinline__ void async_wait() {
#ifdef FUSEDNORM_EMULATION
  ::emu::async_wait(kNewest);
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kNewest) : "memory");
#endif
}

__host__ __device__ constexpr int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace fusednorm::cuda
