// cuBLASLt calls for the GELU feed-forward block (see cublaslt_gemm.h).
//
// cuBLAS is column-major; a row-major [r, c] tensor is the column-major [c, r] matrix with
// leading dimension c. So the row-major D [m, n] = op(A) @ op(B) is computed as the
// column-major D^T [n, m] = op(B)^T @ op(A)^T: cuBLAS's first operand is our B, its
// second our A, and its M, N are our n, m. In cuBLAS's terms a per-column bias of our D
// is a per-row bias of D^T (BIAS / GELU_*_BIAS / DGELU_BGRAD: "length = rows of D"), and a
// reduction of our op(A) over k is BGRADB (its B is our A).

#include "cuda/cublaslt_gemm.h"

#include <ATen/Context.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/Exceptions.h>
#include <c10/util/Exception.h>
#include <cublasLt.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <unordered_map>

namespace fusednorm::cuda {
namespace {

struct MatmulDesc {
  cublasLtMatmulDesc_t desc = nullptr;
  ~MatmulDesc() {
    if (desc) cublasLtMatmulDescDestroy(desc);
  }
  template <typename V>
  void set(cublasLtMatmulDescAttributes_t attr, const V& value) {
    TORCH_CUDABLAS_CHECK(cublasLtMatmulDescSetAttribute(desc, attr, &value, sizeof(value)));
  }
};

struct Layout {
  cublasLtMatrixLayout_t layout = nullptr;
  // The column-major view of a contiguous row-major [rows, cols] tensor.
  Layout(cudaDataType_t type, int64_t rows, int64_t cols) {
    TORCH_CUDABLAS_CHECK(cublasLtMatrixLayoutCreate(&layout, type, cols, rows, cols));
  }
  ~Layout() {
    if (layout) cublasLtMatrixLayoutDestroy(layout);
  }
};

struct Preference {
  cublasLtMatmulPreference_t pref = nullptr;
  Preference() { TORCH_CUDABLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref)); }
  ~Preference() {
    if (pref) cublasLtMatmulPreferenceDestroy(pref);
  }
  template <typename V>
  void set(cublasLtMatmulPreferenceAttributes_t attr, const V& value) {
    TORCH_CUDABLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, attr, &value, sizeof(value)));
  }
};

cudaDataType_t cuda_type(at::ScalarType t) {
  switch (t) {
    case at::kHalf: return CUDA_R_16F;
    case at::kBFloat16: return CUDA_R_16BF;
    case at::kFloat: return CUDA_R_32F;
    default: TORCH_CHECK(false, "fusednorm: no cuBLASLt path for ", t);
  }
  return CUDA_R_32F;  // not reached
}

// The largest power of two (at most 256) that divides the address: what the heuristic
// must assume about a buffer's alignment (its default is 256 bytes).
uint32_t alignment_bytes(const void* p) {
  const auto address = reinterpret_cast<uintptr_t>(p);
  uint32_t alignment = 1;
  while (alignment < 256 && address % (2 * alignment) == 0) alignment *= 2;
  return alignment;
}

bool uses_aux(LtEpilogue e) {
  return e == LtEpilogue::kGeluAuxBias || e == LtEpilogue::kGeluAux ||
         e == LtEpilogue::kDGelu || e == LtEpilogue::kDGeluBgrad;
}

bool uses_bias(LtEpilogue e) {
  return e == LtEpilogue::kBias || e == LtEpilogue::kGeluAuxBias ||
         e == LtEpilogue::kDGeluBgrad || e == LtEpilogue::kBgradRowsOfA;
}

cublasLtEpilogue_t to_cublaslt(LtEpilogue e) {
  switch (e) {
    case LtEpilogue::kNone: return CUBLASLT_EPILOGUE_DEFAULT;
    case LtEpilogue::kBias: return CUBLASLT_EPILOGUE_BIAS;
    case LtEpilogue::kGeluAuxBias: return CUBLASLT_EPILOGUE_GELU_AUX_BIAS;
    case LtEpilogue::kGeluAux: return CUBLASLT_EPILOGUE_GELU_AUX;
    case LtEpilogue::kDGelu: return CUBLASLT_EPILOGUE_DGELU;
    case LtEpilogue::kDGeluBgrad: return CUBLASLT_EPILOGUE_DGELU_BGRAD;
    case LtEpilogue::kBgradRowsOfA: return CUBLASLT_EPILOGUE_BGRADB;  // cuBLAS's B is our A
  }
  return CUBLASLT_EPILOGUE_DEFAULT;
}

// The workspace is PyTorch's own cuBLASLt workspace for the current handle and stream (the
// one its cuBLASLt GEMMs use): allocated once per stream, not per call, so it is not part
// of every call's peak memory (the FFN's forward+backward peak is meant to stay under
// eager's, whose cuBLAS workspace is persistent too), and no call allocates under graph
// capture. An algorithm may ask for at most its size.
size_t max_workspace_bytes() { return at::cuda::getCUDABlasLtWorkspaceSize(); }

// Whether the environment variable is set to 1; read at every call, so that tests can
// change it.
bool env_flag(const char* name) {
  const char* value = std::getenv(name);
  return value != nullptr && std::strcmp(value, "1") == 0;
}

}  // namespace

bool cublaslt_enabled(at::ScalarType dtype) {
  if (env_flag("FUSEDNORM_DISABLE_CUBLASLT")) return false;
  return dtype == at::kHalf || dtype == at::kBFloat16 || dtype == at::kFloat;
}

namespace {

// What a cuBLASLt plan depends on: everything in the descriptors and the heuristic's
// preferences except the bias/aux pointers, which are set per call. The alignments are those
// of the operands' addresses (at most 256), as the heuristic was told them.
struct PlanKey {
  int device;
  int dtype;
  int64_t m, n, k;
  bool trans_a, trans_b, tf32;
  int epilogue;
  uint32_t align_a, align_b, align_d;

  bool operator==(const PlanKey& o) const {
    return device == o.device && dtype == o.dtype && m == o.m && n == o.n && k == o.k &&
           trans_a == o.trans_a && trans_b == o.trans_b && tf32 == o.tf32 &&
           epilogue == o.epilogue && align_a == o.align_a && align_b == o.align_b &&
           align_d == o.align_d;
  }
};

struct PlanKeyHash {
  size_t operator()(const PlanKey& k) const {
    size_t h = 0;
    const auto mix = [&h](uint64_t v) { h ^= std::hash<uint64_t>{}(v) + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2); };
    mix(uint64_t(k.device) << 32 | uint32_t(k.dtype));
    mix(uint64_t(k.m));
    mix(uint64_t(k.n));
    mix(uint64_t(k.k));
    mix(uint64_t(k.epilogue) << 3 | uint64_t(k.trans_a) << 2 | uint64_t(k.trans_b) << 1 | uint64_t(k.tf32));
    mix(uint64_t(k.align_a) << 40 | uint64_t(k.align_b) << 20 | k.align_d);
    return h;
  }
};

// Descriptors, layouts and the chosen algorithm of one GEMM shape, built once. `usable` is
// false when cuBLASLt offered no algorithm or its matmul failed: later calls go straight to
// the fallback.
struct Plan {
  MatmulDesc desc;
  std::unique_ptr<Layout> first, second, out;
  cublasLtMatmulAlgo_t algo{};
  size_t workspace = 0;
  bool usable = false;
};

// Per host thread (a descriptor's bias/aux pointers are set per call, so plans are not
// shared between threads); cleared when it reaches kMaxPlans, so that a workload of ever new
// shapes does not grow it without bound.
constexpr size_t kMaxPlans = 512;

std::unordered_map<PlanKey, std::unique_ptr<Plan>, PlanKeyHash>& plan_cache() {
  thread_local std::unordered_map<PlanKey, std::unique_ptr<Plan>, PlanKeyHash> cache;
  return cache;
}

std::unique_ptr<Plan> make_plan(const LtGemm& g, const PlanKey& key) {
  auto plan = std::make_unique<Plan>();
  const cudaDataType_t type = cuda_type(g.d.scalar_type());
  TORCH_CUDABLAS_CHECK(cublasLtMatmulDescCreate(
      &plan->desc.desc, key.tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F,
      CUDA_R_32F));
  // cuBLAS's first operand is our B, its second our A (see the top of this file).
  const cublasOperation_t op_first = g.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t op_second = g.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  plan->desc.set(CUBLASLT_MATMUL_DESC_TRANSA, op_first);
  plan->desc.set(CUBLASLT_MATMUL_DESC_TRANSB, op_second);
  const cublasLtEpilogue_t epilogue = to_cublaslt(g.epilogue);
  plan->desc.set(CUBLASLT_MATMUL_DESC_EPILOGUE, epilogue);
  // The heuristic may look at the epilogue pointers: give it this call's (reset per call).
  if (uses_bias(g.epilogue)) plan->desc.set(CUBLASLT_MATMUL_DESC_BIAS_POINTER, g.bias);
  if (uses_aux(g.epilogue)) {
    plan->desc.set(CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, g.aux);
    plan->desc.set(CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, key.n);
  }
  plan->first = std::make_unique<Layout>(type, g.b.size(0), g.b.size(1));
  plan->second = std::make_unique<Layout>(type, g.a.size(0), g.a.size(1));
  plan->out = std::make_unique<Layout>(type, key.m, key.n);

  Preference pref;
  pref.set(CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, static_cast<uint64_t>(max_workspace_bytes()));
  pref.set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, key.align_b);
  pref.set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, key.align_a);
  pref.set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, key.align_d);
  pref.set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, key.align_d);
  if (g.d.scalar_type() != at::kFloat) {
    // Split-k partial sums in float, never in the 16-bit output type.
    const uint32_t schemes = CUBLASLT_REDUCTION_SCHEME_NONE | CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE;
    pref.set(CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, schemes);
  }

  cublasLtMatmulHeuristicResult_t heuristic = {};
  int found = 0;
  const cublasStatus_t status = cublasLtMatmulAlgoGetHeuristic(
      at::cuda::getCurrentCUDABlasLtHandle(), plan->desc.desc, plan->first->layout,
      plan->second->layout, plan->out->layout, plan->out->layout, pref.pref, 1, &heuristic,
      &found);
  if (status != CUBLAS_STATUS_SUCCESS && status != CUBLAS_STATUS_NOT_SUPPORTED) {
    TORCH_WARN_ONCE("fusednorm: cuBLASLt heuristic failed (status ", static_cast<int>(status),
                    ") for epilogue ", static_cast<int>(epilogue), "; using the fallback path");
  }
  if (status == CUBLAS_STATUS_SUCCESS && found > 0) {
    plan->algo = heuristic.algo;
    plan->workspace = heuristic.workspaceSize;
    plan->usable = true;
  }
  return plan;
}

// The epilogue's vectors must be 16-byte aligned for cuBLASLt (an 8-byte aligned bias
// failed on some GPUs elsewhere); a tensor that is a view at an odd offset takes the fallback.
bool epilogue_pointers_aligned(const LtGemm& g) {
  if (uses_bias(g.epilogue) && alignment_bytes(g.bias) < 16) return false;
  if (uses_aux(g.epilogue) && alignment_bytes(g.aux) < 16) return false;
  return true;
}

}  // namespace

bool try_cublaslt_gemm(const LtGemm& g) {
  const at::ScalarType dtype = g.d.scalar_type();
  TORCH_INTERNAL_ASSERT(g.a.scalar_type() == dtype && g.b.scalar_type() == dtype);
  TORCH_INTERNAL_ASSERT(g.a.is_contiguous() && g.b.is_contiguous() && g.d.is_contiguous());
  const int64_t m = g.d.size(0), n = g.d.size(1);
  const int64_t k = g.trans_a ? g.a.size(0) : g.a.size(1);
  TORCH_INTERNAL_ASSERT((g.trans_a ? g.a.size(1) : g.a.size(0)) == m);
  TORCH_INTERNAL_ASSERT((g.trans_b ? g.b.size(1) : g.b.size(0)) == k);
  TORCH_INTERNAL_ASSERT((g.trans_b ? g.b.size(0) : g.b.size(1)) == n);
  TORCH_INTERNAL_ASSERT(!uses_aux(g.epilogue) || g.aux != nullptr);
  TORCH_INTERNAL_ASSERT(!uses_bias(g.epilogue) || g.bias != nullptr);
  if (m == 0 || n == 0 || k == 0) return false;
  // The GELU input matrix's leading dimension (n) must be a multiple of 8.
  if (uses_aux(g.epilogue) && n % 8 != 0) return false;
  const bool strict = env_flag("FUSEDNORM_CUBLASLT_STRICT");
  if (!epilogue_pointers_aligned(g)) {
    TORCH_CHECK(!strict, "fusednorm: cuBLASLt epilogue vector not 16-byte aligned "
                "(FUSEDNORM_CUBLASLT_STRICT=1 makes this an error instead of a fallback)");
    return false;
  }

  const PlanKey key{g.d.get_device(),
                    static_cast<int>(dtype),
                    m, n, k,
                    g.trans_a, g.trans_b,
                    dtype == at::kFloat && at::globalContext().allowTF32CuBLAS(),
                    static_cast<int>(g.epilogue),
                    alignment_bytes(g.a.const_data_ptr()),
                    alignment_bytes(g.b.const_data_ptr()),
                    alignment_bytes(g.d.const_data_ptr())};
  auto& cache = plan_cache();
  auto it = cache.find(key);
  if (it == cache.end()) {
    if (cache.size() >= kMaxPlans) cache.clear();
    it = cache.emplace(key, make_plan(g, key)).first;
  }
  Plan& plan = *it->second;
  if (!plan.usable) {
    TORCH_CHECK(!strict, "fusednorm: cuBLASLt has no algorithm for epilogue ",
                static_cast<int>(g.epilogue), " of a ", dtype, " GEMM with m=", m, ", n=", n,
                ", k=", k, " (FUSEDNORM_CUBLASLT_STRICT=1 makes this an error instead of a fallback)");
    return false;
  }
  if (uses_bias(g.epilogue)) plan.desc.set(CUBLASLT_MATMUL_DESC_BIAS_POINTER, g.bias);
  if (uses_aux(g.epilogue)) plan.desc.set(CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, g.aux);

  void* workspace = plan.workspace > 0 ? at::cuda::getCUDABlasLtWorkspace() : nullptr;
  const float alpha = 1.0f, beta = 0.0f;
  const cublasStatus_t status = cublasLtMatmul(
      at::cuda::getCurrentCUDABlasLtHandle(), plan.desc.desc, &alpha, g.b.const_data_ptr(),
      plan.first->layout, g.a.const_data_ptr(), plan.second->layout, &beta,
      g.d.mutable_data_ptr(), plan.out->layout, g.d.mutable_data_ptr(), plan.out->layout,
      &plan.algo, workspace, plan.workspace,
      at::cuda::getCurrentCUDAStream());
  if (status != CUBLAS_STATUS_SUCCESS) {
    // The caller recomputes everything this call would have written (outputs, aux, bias
    // gradient) on its fallback path; this shape stays there from now on.
    TORCH_CHECK(!strict, "fusednorm: cublasLtMatmul failed (status ", static_cast<int>(status),
                ") for epilogue ", static_cast<int>(g.epilogue), " of a ", dtype,
                " GEMM with m=", m, ", n=", n, ", k=", k);
    TORCH_WARN_ONCE("fusednorm: cublasLtMatmul failed (status ", static_cast<int>(status),
                    "); using the fallback path for this GEMM shape");
    plan.usable = false;
    return false;
  }
  return true;
}

}  // namespace fusednorm::cuda
