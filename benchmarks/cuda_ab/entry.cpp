// The C entries of one A/B variant's library (benchmarks/cuda_ab/build.py builds one per
// variant; build.py's Variant calls them through ctypes): forward and backward into
// preallocated outputs, without the ops' checks (benchmarks/cuda_ab makes the buffers:
// contiguous rows, on one device, of the dtypes the variant was compiled for). Plain C
// types only, no torch extension: the library needs no torch of its own version, so it can
// be built on a machine without a GPU and run beside the torch of another.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <map>
#include <string>

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

using Allocate = void* (*)(int64_t bytes);

// Scratch buffers from the caller (its allocator's, on the current stream, as the op's
// TensorWorkspace): held by the caller until the entry returns.
class CallerWorkspace final : public Workspace {
 public:
  explicit CallerWorkspace(Allocate allocate) : allocate_(allocate) {}
  void* allocate(int64_t bytes) override {
    void* p = allocate_(bytes);
    if (p == nullptr) throw std::runtime_error("workspace of " + std::to_string(bytes) + " bytes refused");
    return p;
  }

 private:
  Allocate allocate_;
};

template <typename Fn>
Fn find(const std::map<Key, Fn>& entries, bool centered, int x_type, int p_type) {
  const Key key{centered, static_cast<c10::ScalarType>(x_type), static_cast<c10::ScalarType>(p_type)};
  const auto it = entries.find(key);
  if (it == entries.end()) {
    throw std::runtime_error(std::string("this A/B variant was not compiled for ") +
                             (centered ? "LayerNorm " : "RMSNorm ") +
                             c10::toString(std::get<1>(key)) + " with " +
                             c10::toString(std::get<2>(key)) + " parameters");
  }
  return it->second;
}

// 0, or 1 with the message in error (error_len bytes, NUL-terminated): a pass's entry
// (fwd_entries' or bwd_entries') called with p on the caller's stream and buffers.
template <typename Ptrs, typename Fn>
int call_entry(const std::map<Key, Fn>& entries, int centered, int x_type, int p_type,
               const Ptrs* p, int device, int sm_count, void* stream, Allocate allocate,
               char* error, int error_len) {
  try {
    CallerWorkspace ws(allocate);
    find(entries, centered != 0, x_type, p_type)(*p, ws, DeviceInfo{device, sm_count},
                                                 static_cast<cudaStream_t>(stream));
    return 0;
  } catch (const std::exception& e) {
    if (error != nullptr && error_len > 0) {
      std::strncpy(error, e.what(), error_len - 1);
      error[error_len - 1] = '\0';
    }
    return 1;
  }
}

}  // namespace
}  // namespace fusednorm::cuda::ab

// x_type / p_type: c10::ScalarType values of the input and parameter dtypes; stream: the
// cudaStream_t to launch on; allocate: the scratch buffers' source.
extern "C" __attribute__((visibility("default"))) int fusednorm_ab_fwd(
    int centered, int x_type, int p_type, const fusednorm::cuda::ab::FwdPtrs* p, int device,
    int sm_count, void* stream, fusednorm::cuda::ab::Allocate allocate, char* error,
    int error_len) {
  using namespace fusednorm::cuda::ab;
  return call_entry(fwd_entries(), centered, x_type, p_type, p, device, sm_count, stream,
                    allocate, error, error_len);
}

extern "C" __attribute__((visibility("default"))) int fusednorm_ab_bwd(
    int centered, int x_type, int p_type, const fusednorm::cuda::ab::BwdPtrs* p, int device,
    int sm_count, void* stream, fusednorm::cuda::ab::Allocate allocate, char* error,
    int error_len) {
  using namespace fusednorm::cuda::ab;
  return call_entry(bwd_entries(), centered, x_type, p_type, p, device, sm_count, stream,
                    allocate, error, error_len);
}

// What this variant was compiled for, a line each ("fwd layer_norm BFloat16 Float"), into out
// (out_len bytes, NUL-terminated); returns the length the whole list needs.
extern "C" __attribute__((visibility("default"))) int fusednorm_ab_entries(char* out, int out_len) {
  using namespace fusednorm::cuda::ab;
  std::string text;
  const auto add = [&](const char* pass, const Key& k) {
    text += std::string(pass) + (std::get<0>(k) ? " layer_norm " : " rms_norm ") +
            c10::toString(std::get<1>(k)) + " " + c10::toString(std::get<2>(k)) + "\n";
  };
  for (const auto& entry : fwd_entries()) add("fwd", entry.first);
  for (const auto& entry : bwd_entries()) add("bwd", entry.first);
  if (out != nullptr && out_len > 0) {
    std::strncpy(out, text.c_str(), out_len - 1);
    out[out_len - 1] = '\0';
  }
  return static_cast<int>(text.size()) + 1;
}

// The layout of FwdPtrs and BwdPtrs, for the caller's check of its own (Variant): the size
// and each member's offset in declaration order, FwdPtrs's then BwdPtrs's, into out (n
// slots); returns the count.
extern "C" __attribute__((visibility("default"))) int fusednorm_ab_layout(int64_t* out, int n) {
  using fusednorm::cuda::ab::BwdPtrs;
  using fusednorm::cuda::ab::FwdPtrs;
  const int64_t layout[] = {
      sizeof(FwdPtrs),           offsetof(FwdPtrs, x),        offsetof(FwdPtrs, weight),
      offsetof(FwdPtrs, bias),   offsetof(FwdPtrs, residual), offsetof(FwdPtrs, y),
      offsetof(FwdPtrs, mean),   offsetof(FwdPtrs, rstd),     offsetof(FwdPtrs, sum),
      offsetof(FwdPtrs, M),      offsetof(FwdPtrs, N),        offsetof(FwdPtrs, eps),
      sizeof(BwdPtrs),           offsetof(BwdPtrs, dy),       offsetof(BwdPtrs, x),
      offsetof(BwdPtrs, mean),   offsetof(BwdPtrs, rstd),     offsetof(BwdPtrs, weight),
      offsetof(BwdPtrs, grad_sum), offsetof(BwdPtrs, dx),     offsetof(BwdPtrs, dweight),
      offsetof(BwdPtrs, dbias),  offsetof(BwdPtrs, M),        offsetof(BwdPtrs, N)};
  const int count = static_cast<int>(sizeof(layout) / sizeof(layout[0]));
  for (int i = 0; i < count && i < n; ++i) out[i] = layout[i];
  return count;
}
