#pragma once
// The A/B tool's type-erased entries into one variant's norm kernels (csrc/cuda/norm_launch.h):
// each generated instance file registers its (pass, kind, input dtype, parameter dtype)
// entries here at load; entry.cpp looks them up per call.

#include <c10/core/ScalarType.h>

#include <cstdint>
#include <map>
#include <tuple>

#include "cuda/norm_launch.h"

namespace fusednorm::cuda::ab {

struct FwdPtrs {
  const void *x, *weight, *bias, *residual;
  void *y, *mean, *rstd, *sum;
  int64_t M, N;
  double eps;
};

struct BwdPtrs {
  const void *dy, *x, *mean, *rstd, *weight, *grad_sum;
  void *dx, *dweight, *dbias;
  int64_t M, N;
};

using FwdFn = void (*)(const FwdPtrs&, Workspace&, DeviceInfo, cudaStream_t);
using BwdFn = void (*)(const BwdPtrs&, Workspace&, DeviceInfo, cudaStream_t);
// (centered, input dtype, parameter dtype)
using Key = std::tuple<bool, c10::ScalarType, c10::ScalarType>;

std::map<Key, FwdFn>& fwd_entries();  // entry.cpp
std::map<Key, BwdFn>& bwd_entries();

template <bool CENTERED, typename T, typename P>
void fwd_entry(const FwdPtrs& p, Workspace& ws, DeviceInfo dev, cudaStream_t stream) {
  using acc_t = acc_type_t<T>;
  const NormFwdArgs<T, P> a{static_cast<const T*>(p.x),      static_cast<const P*>(p.weight),
                            static_cast<const P*>(p.bias),   static_cast<T*>(p.y),
                            static_cast<acc_t*>(p.mean),     static_cast<acc_t*>(p.rstd),
                            p.M,                             p.N,
                            p.eps,                           static_cast<const T*>(p.residual),
                            static_cast<T*>(p.sum)};
  norm_fwd_cuda<CENTERED>(a, ws, dev, stream);
}

template <bool CENTERED, typename T, typename P>
void bwd_entry(const BwdPtrs& p, Workspace& ws, DeviceInfo dev, cudaStream_t stream) {
  using acc_t = acc_type_t<T>;
  const NormBwdArgs<T, P> a{static_cast<const T*>(p.dy),       static_cast<const T*>(p.x),
                            static_cast<const acc_t*>(p.mean), static_cast<const acc_t*>(p.rstd),
                            static_cast<const P*>(p.weight),   static_cast<T*>(p.dx),
                            static_cast<P*>(p.dweight),        static_cast<P*>(p.dbias),
                            p.M,                               p.N,
                            static_cast<const T*>(p.grad_sum)};
  norm_bwd_cuda<CENTERED>(a, ws, dev, stream);
}

// One per pass, so that an instance file instantiates only its own pass's kernels. Only the
// rows of FUSEDNORM_CUDA_NORM_DTYPES whose x has T's type (IO = T) are timed.
template <bool CENTERED, typename T, typename P, typename IO>
bool register_fwd() {
  if constexpr (std::is_same_v<T, IO>) {
    fwd_entries()[{CENTERED, c10::CppTypeToScalarType<T>::value,
                   c10::CppTypeToScalarType<P>::value}] = &fwd_entry<CENTERED, T, P>;
  }
  return true;
}

template <bool CENTERED, typename T, typename P, typename IO>
bool register_bwd() {
  if constexpr (std::is_same_v<T, IO>) {
    bwd_entries()[{CENTERED, c10::CppTypeToScalarType<T>::value,
                   c10::CppTypeToScalarType<P>::value}] = &bwd_entry<CENTERED, T, P>;
  }
  return true;
}

}  // namespace fusednorm::cuda::ab
