// The CPU FFN's GEMM backend choice (see gemm.h for when oneDNN is used and why).

#include "cpu/gemm.h"

#include <ATen/Context.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/addmm.h>
#include <ATen/ops/mm.h>
#include <c10/util/Exception.h>

#include <cstdlib>
#include <cstring>

// libtorch_cpu's oneDNN matmul: result = beta * result + alpha * (mat1 @ mat2), for any
// strides of mat1 and mat2. It is exported but its header is not installed, so it is
// declared here, weak: a torch without it (or with another signature: the mangled name
// carries the signature) still loads this library, and the function's address is then
// null, which selects ATen.
namespace at::native {
__attribute__((weak, visibility("default"))) void mkldnn_matmul(const at::Tensor& mat1,
                                                                const at::Tensor& mat2,
                                                                const at::Tensor& result,
                                                                float beta, float alpha);
}  // namespace at::native

namespace fusednorm::cpu {
namespace {

enum class GemmBackend { kAten, kOneDnn };

// Whether libtorch's mkldnn_matmul runs on this CPU: it refuses float32 as well as bfloat16
// where oneDNN has no bfloat16 support (x86: AVX-512 BW/VL/DQ or AVX-NE-CONVERT), so torch's
// own answer to that is asked, once (false where this torch lacks the op).
bool onednn_matmul_runs_on_this_cpu() {
  static const bool runs = [] {
    const auto op = c10::Dispatcher::singleton().findSchema(
        {"mkldnn::_is_mkldnn_bf16_supported", ""});
    return op.has_value() && op->typed<bool()>().call();
  }();
  return runs;
}

bool onednn_matmul_available() {
  return at::native::mkldnn_matmul != nullptr && at::hasMKLDNN() &&
         at::globalContext().userEnabledMkldnn() && onednn_matmul_runs_on_this_cpu();
}

// The CPUs where oneDNN's float32 matmul was measured faster than MKL's (gemm.h).
bool onednn_measured_faster_here() {
#if defined(__x86_64__) || defined(_M_X64)
  static const bool amd_avx512 =
      __builtin_cpu_is("amd") && __builtin_cpu_supports("avx512f");
  return amd_avx512;
#else
  return false;
#endif
}

GemmBackend choose_backend(const at::Tensor& a, const at::Tensor& b) {
  if (a.scalar_type() != at::kFloat) return GemmBackend::kAten;
  const int64_t m = a.size(0), k = a.size(1), n = b.size(1);
  if (m == 0 || k == 0 || n == 0) return GemmBackend::kAten;  // ATen's empty-GEMM rules
  const char* setting = std::getenv("FUSEDNORM_CPU_GEMM");
  if (setting != nullptr && std::strcmp(setting, "aten") == 0) return GemmBackend::kAten;
  if (setting != nullptr && std::strcmp(setting, "onednn") == 0) {
    TORCH_CHECK(onednn_matmul_available(),
                "fusednorm: FUSEDNORM_CPU_GEMM=onednn, but this torch offers no oneDNN "
                "matmul here (built without it, disabled by torch.backends.mkldnn, "
                "at::native::mkldnn_matmul missing, or this CPU lacks what it needs: "
                "AVX-512 BW/VL/DQ or AVX-NE-CONVERT, torch.ops.mkldnn."
                "_is_mkldnn_bf16_supported())");
    return GemmBackend::kOneDnn;
  }
  TORCH_CHECK(setting == nullptr || *setting == '\0',
              "fusednorm: FUSEDNORM_CPU_GEMM must be 'aten' or 'onednn' (or unset), got '",
              setting, "'");
  constexpr int64_t kMinMultiplyAdds = int64_t(1) << 24;
  const bool large = m * k >= kMinMultiplyAdds / n;  // m * k * n without overflow
  return large && onednn_measured_faster_here() && onednn_matmul_available()
             ? GemmBackend::kOneDnn
             : GemmBackend::kAten;
}

}  // namespace

const char* auto_gemm_backend_name() {
  return onednn_measured_faster_here() && onednn_matmul_available() ? "onednn" : "aten";
}

void matmul_into(const at::Tensor& out, const at::Tensor& a, const at::Tensor& b,
                 bool accumulate) {
  if (choose_backend(a, b) == GemmBackend::kOneDnn) {
    at::native::mkldnn_matmul(a, b, out, accumulate ? 1.0f : 0.0f, 1.0f);
  } else if (accumulate) {
    // addmm_'s self is out itself; a const Tensor& still shares its storage.
    at::Tensor target = out;
    target.addmm_(a, b);
  } else {
    at::Tensor target = out;
    at::mm_out(target, a, b);
  }
}

void linear_into(const at::Tensor& out, const at::Tensor& a, const at::Tensor& w,
                 const std::optional<at::Tensor>& bias) {
  const bool has_bias = bias.has_value() && bias->defined();
  const at::Tensor wt = w.t();
  if (choose_backend(a, wt) == GemmBackend::kOneDnn) {
    // The bias first, then the product added onto it: the sum is taken in float before
    // the result is stored, as in addmm.
    if (has_bias) out.copy_(bias->expand_as(out));
    at::native::mkldnn_matmul(a, wt, out, has_bias ? 1.0f : 0.0f, 1.0f);
    return;
  }
  at::Tensor target = out;
  if (has_bias) {
    at::addmm_out(target, *bias, a, wt);
  } else {
    at::mm_out(target, a, wt);
  }
}

}  // namespace fusednorm::cpu
