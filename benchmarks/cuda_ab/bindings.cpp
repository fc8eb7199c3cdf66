// The Python entries of one A/B variant (a torch extension per variant): forward and backward
// into preallocated outputs, without the ops' checks (benchmarks/cuda_ab makes the tensors:
// contiguous rows, on one device, of the dtypes the variant was compiled for).
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include <optional>
#include <string>
#include <vector>

#include "cuda/norm_workspace.h"
#include "registry.h"

namespace fusednorm::cuda::ab {

std::map<Key, FwdFn>& fwd_entries() {
  static std::map<Key, FwdFn> entries;
  return entries;
}
std::map<Key, BwdFn>& bwd_entries() {
  static std::map<Key, BwdFn> entries;
  return entries;
}

namespace {

using Opt = std::optional<at::Tensor>;

const void* in(const Opt& t) { return t && t->defined() ? t->const_data_ptr() : nullptr; }
void* out(const Opt& t) { return t && t->defined() ? t->mutable_data_ptr() : nullptr; }

DeviceInfo device_info(const at::Tensor& t) {
  int sm_count = 0;
  TORCH_CHECK(cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount,
                                     t.device().index()) == cudaSuccess);
  return {t.device().index(), sm_count};
}

template <typename Fn>
Fn find(const std::map<Key, Fn>& entries, bool centered, const at::Tensor& x, const Opt& w) {
  const Key key{centered, x.scalar_type(), w ? w->scalar_type() : x.scalar_type()};
  const auto it = entries.find(key);
  TORCH_CHECK(it != entries.end(), "this A/B variant was not compiled for ",
              centered ? "LayerNorm " : "RMSNorm ", x.scalar_type());
  return it->second;
}

void fwd(bool centered, const at::Tensor& x, const Opt& residual, const Opt& weight,
         const Opt& bias, double eps, at::Tensor& y, const Opt& sum, const Opt& mean,
         at::Tensor& rstd) {
  TensorWorkspace ws(x);
  const FwdPtrs p{x.const_data_ptr(), in(weight), in(bias), in(residual), y.mutable_data_ptr(),
                  out(mean), rstd.mutable_data_ptr(), out(sum), x.size(0), x.size(1), eps};
  find(fwd_entries(), centered, x, weight)(p, ws, device_info(x),
                                           c10::cuda::getCurrentCUDAStream());
}

void bwd(bool centered, const at::Tensor& dy, const Opt& grad_sum, const at::Tensor& x,
         const Opt& mean, const at::Tensor& rstd, const Opt& weight, at::Tensor& dx,
         const Opt& dweight, const Opt& dbias) {
  TensorWorkspace ws(x);
  const BwdPtrs p{dy.const_data_ptr(), x.const_data_ptr(), in(mean), rstd.const_data_ptr(),
                  in(weight), in(grad_sum), dx.mutable_data_ptr(), out(dweight), out(dbias),
                  x.size(0), x.size(1)};
  find(bwd_entries(), centered, x, weight)(p, ws, device_info(x),
                                           c10::cuda::getCurrentCUDAStream());
}

// What this variant was compiled for: "fwd layer_norm BFloat16 Float", ...
std::vector<std::string> entries() {
  std::vector<std::string> out;
  auto name = [](const char* pass, const Key& k) {
    return std::string(pass) + (std::get<0>(k) ? " layer_norm " : " rms_norm ") +
           c10::toString(std::get<1>(k)) + " " + c10::toString(std::get<2>(k));
  };
  for (const auto& [key, fn] : fwd_entries()) out.push_back(name("fwd", key));
  for (const auto& [key, fn] : bwd_entries()) out.push_back(name("bwd", key));
  return out;
}

}  // namespace
}  // namespace fusednorm::cuda::ab

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("fwd", &fusednorm::cuda::ab::fwd);
  m.def("bwd", &fusednorm::cuda::ab::bwd);
  m.def("entries", &fusednorm::cuda::ab::entries);
}
