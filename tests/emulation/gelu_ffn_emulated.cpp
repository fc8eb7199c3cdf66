// Runs the GELU-FFN's elementwise and column-slab launchers and kernels
// (csrc/cuda/gelu_ffn_kernels.cuh) on the emulated GPU of emu_runtime.h and checks every
// output against a reference computed here in long double. Reads cases from stdin, one per
// line:
//
//   gelu|dgelu|colsum  T  kind  M  N  m1  m2  order  sm_count  [nobias]
//
// gelu: a = gelu(h) over the M * N elements of h (launch_gelu); dgelu: dh = dg * gelu'(h)
// over dg and db1 = its column sums (launch_dgelu; nobias: no db1); colsum: the column sums
// of x (launch_column_sum, the backward's db2). T: f32 f64 f16 bf16; kind: none (erf) or
// tanh (colsum: ignored); m1 / m2: bytes added to the 256-aligned starts of the first input
// (h; colsum: x) / of the second buffer (gelu: a; dgelu: dg; colsum: must be 0): a view
// misaligned by an element takes the one-element path; order: asc, desc or shuffle (the
// order the fibers of a block and the blocks run in); sm_count: the multiprocessors the
// launchers size their grids for (1 makes the grid-stride kernels stride). Prints
// "ok <case> | launches L vec V" (the kernel launches the case made; V: 1 if its main kernel
// was the 16-byte instantiation, 0 for one-element packs) or "FAIL <case>: why" per line;
// exits 1 if any failed. Emulation errors (barrier misuse, misaligned vector access,
// out-of-bounds access) abort with a message.
#include <cuda_runtime.h>  // the emulation's (tests/emulation/include)

#include <cstring>
#include <iostream>
#include <random>
#include <sstream>

#include "cuda/gelu_ffn_kernels.cuh"
#include "emu_check.h"

namespace {

using namespace fusednorm;
using namespace fusednorm::cuda;
using namespace emu_check;
using ref_t = long double;

struct Case {
  std::string pass, t, kind;
  int64_t M = 0, N = 0;
  int m1 = 0, m2 = 0;
  std::string order;
  int sms = 2;
  bool bias = true;
  std::string text;
};

// GELU and its derivative in long double, from their definitions (common/gelu.h's table).
ref_t ref_gelu(ref_t x, bool tanh_form) {
  if (!tanh_form) return x * 0.5L * (1 + std::erf(x / std::sqrt(2.0L)));
  const ref_t k = std::sqrt(2 / 3.14159265358979323846264338327950288L);
  return 0.5L * x * (1 + std::tanh(k * (x + 0.044715L * x * x * x)));
}

ref_t ref_gelu_grad(ref_t x, bool tanh_form) {
  const ref_t pi = 3.14159265358979323846264338327950288L;
  if (!tanh_form) {
    return 0.5L * (1 + std::erf(x / std::sqrt(2.0L))) + x * std::exp(-x * x / 2) / std::sqrt(2 * pi);
  }
  const ref_t k = std::sqrt(2 / pi);
  const ref_t t = std::tanh(k * (x + 0.044715L * x * x * x));
  return 0.5L * (1 + t) + 0.5L * x * (1 - t * t) * k * (1 + 3 * 0.044715L * x * x);
}

// h: mostly N(0, 1.5), one value in 16 uniform in [-8, 8] (GELU's tails); g: N(0, 1).
std::vector<double> make_values(const Case& c, bool hidden, uint64_t salt) {
  std::mt19937_64 rng(std::hash<std::string>{}(c.text) ^ salt);
  std::normal_distribution<double> normal;
  std::uniform_real_distribution<double> wide(-8, 8);
  std::vector<double> v(std::size_t(c.M * c.N));
  for (std::size_t i = 0; i < v.size(); ++i) {
    v[i] = hidden ? (i % 16 == 5 ? wide(rng) : 1.5 * normal(rng)) : normal(rng);
  }
  return v;
}

// The kernel a case's path must have launched first: the 16-byte instantiation.
template <typename T, GeluKind kind>
const void* wide_kernel(const std::string& pass, bool reduce) {
  using namespace gelu_ffn_detail;
  constexpr int kW = 16 / sizeof(T);
  if (pass == "gelu") return reinterpret_cast<const void*>(gelu_kernel<T, kW, kind>);
  if (pass == "colsum") {
    return reinterpret_cast<const void*>(column_slab_kernel<T, kW, true, ReadStep<T, kW>>);
  }
  return reduce ? reinterpret_cast<const void*>(column_slab_kernel<T, kW, true, DGeluStep<T, kW, kind>>)
                : reinterpret_cast<const void*>(column_slab_kernel<T, kW, false, DGeluStep<T, kW, kind>>);
}

// Elementwise bound: T's rounding of the reference plus the accumulator's error on a value
// of magnitude `scale`.
template <typename T>
double bound_of(double ref, double scale) {
  return 2 * unit_roundoff<T>() * std::abs(ref) + subnormal_step<T>() + acc_tolerance<T>() * scale;
}

// Column sums' bound: T's rounding plus the accumulator's error on the magnitudes summed.
template <typename T>
std::vector<double> column_sums(const std::vector<ref_t>& v, const std::vector<double>& mag,
                                const Case& c, std::vector<double>& tol) {
  std::vector<double> sums(std::size_t(c.N));
  tol.assign(std::size_t(c.N), 0);
  for (int64_t j = 0; j < c.N; ++j) {
    ref_t s = 0, m = 0;
    for (int64_t r = 0; r < c.M; ++r) {
      s += v[r * c.N + j];
      m += mag[r * c.N + j];
    }
    sums[j] = double(s);
    tol[j] = 2 * unit_roundoff<T>() * std::abs(double(s)) + subnormal_step<T>() +
             acc_tolerance<T>() * double(m);
  }
  return sums;
}

template <typename T, GeluKind kind>
std::string run(const Case& c) {
  using acc_t = acc_of<T>;
  constexpr bool kTanh = kind == GeluKind::kTanh;
  const std::size_t n = std::size_t(c.M * c.N);
  const int sms = c.sms;
  std::string why;
  const std::vector<double> h = rounded<T>(make_values(c, c.pass != "colsum", 0x1));
  Buffer h_buf = upload<T>(h, c.m1);
  const std::size_t first_launch = emu::config().kernels.size();
  bool reduce = true;

  if (c.pass == "gelu") {
    Buffer a = Buffer::make(n * sizeof(T), std::size_t(c.m2));
    launch_gelu<T>(h_buf.as<T>(), a.as<T>(), int64_t(n), kind, sms, nullptr);
    for (const Buffer* b : {&h_buf, &a}) b->check_canary("an argument");
    std::vector<double> ref(n);
    for (std::size_t i = 0; i < n; ++i) ref[i] = double(ref_gelu(h[i], kTanh));
    if (compare<T>("a", a, ref, [&](std::size_t i) { return bound_of<T>(ref[i], std::abs(h[i]) + 1); }, why)) return why;
  } else if (c.pass == "dgelu") {
    reduce = c.bias;
    const std::vector<double> g = rounded<T>(make_values(c, false, 0x2));
    Buffer dg = upload<T>(g, c.m2);
    Buffer db1 = Buffer::make(std::size_t(c.N) * sizeof(T));
    const int64_t partial_size = column_slab_partial_size(c.M, c.N);
    Buffer partial = Buffer::make(std::size_t(std::max<int64_t>(partial_size, 1)) * sizeof(acc_t));
    launch_dgelu<T>(h_buf.as<T>(), dg.as<T>(), c.M, c.N, c.bias ? db1.as<T>() : nullptr,
                    c.bias ? partial.as<acc_t>() : nullptr, kind, sms, nullptr);
    for (const Buffer* b : {&h_buf, &dg, &db1, &partial}) b->check_canary("an argument");
    std::vector<ref_t> dh(n);
    std::vector<double> ref(n), mag(n);
    for (std::size_t i = 0; i < n; ++i) {
      dh[i] = ref_t(g[i]) * ref_gelu_grad(h[i], kTanh);
      ref[i] = double(dh[i]);
      mag[i] = std::abs(g[i]) * (std::abs(h[i]) + 1);
    }
    if (compare<T>("h (read only)", h_buf, h, [](std::size_t) { return 0.0; }, why)) return why;
    if (compare<T>("dh", dg, ref, [&](std::size_t i) { return bound_of<T>(ref[i], mag[i]); }, why)) return why;
    if (c.bias) {
      std::vector<double> tol;
      const std::vector<double> db = column_sums<T>(dh, mag, c, tol);
      if (compare<T>("db1", db1, db, [&](std::size_t j) { return tol[j]; }, why)) return why;
    } else {
      for (std::size_t i = 0; i < db1.bytes; ++i) {
        if (static_cast<unsigned char>(db1.data[i]) != 0xff) return "db1 written without a bias";
      }
    }
  } else if (c.pass == "colsum") {
    if (c.m2 != 0) return "colsum takes no second buffer (m2 must be 0)";
    Buffer out = Buffer::make(std::size_t(c.N) * sizeof(T));
    Buffer partial = Buffer::make(
        std::size_t(std::max<int64_t>(column_slab_partial_size(c.M, c.N), 1)) * sizeof(acc_t));
    launch_column_sum<T>(h_buf.as<T>(), c.M, c.N, out.as<T>(), partial.as<acc_t>(), sms, nullptr);
    for (const Buffer* b : {&h_buf, &out, &partial}) b->check_canary("an argument");
    std::vector<ref_t> x(h.begin(), h.end());
    std::vector<double> mag(n), tol;
    for (std::size_t i = 0; i < n; ++i) mag[i] = std::abs(h[i]);
    const std::vector<double> sums = column_sums<T>(x, mag, c, tol);
    if (compare<T>("column sum", out, sums, [&](std::size_t j) { return tol[j]; }, why)) return why;
  } else {
    return "bad pass " + c.pass;
  }
  const auto& launched = emu::config().kernels;
  if (launched.size() == first_launch) return "no kernel launched";
  const bool vec = launched[first_launch] == wide_kernel<T, kind>(c.pass, reduce);
  return vec ? "vec 1" : "vec 0";
}

template <typename T>
std::string run_kind(const Case& c) {
  if (c.kind == "tanh") return run<T, GeluKind::kTanh>(c);
  if (c.kind == "none") return run<T, GeluKind::kExact>(c);
  return "bad kind " + c.kind;
}

std::string dispatch(const Case& c) {
  if (c.t == "f32") return run_kind<float>(c);
#ifndef EMU_ONLY_FLOAT  // (a quicker build, for the tests that the harness can fail)
  if (c.t == "f64") return run_kind<double>(c);
  if (c.t == "f16") return run_kind<c10::Half>(c);
  if (c.t == "bf16") return run_kind<c10::BFloat16>(c);
#endif
  return "bad dtype " + c.t;
}

}  // namespace

int main() {
  std::string line;
  int failed = 0, ran = 0;
  while (std::getline(std::cin, line)) {
    if (line.empty() || line[0] == '#') continue;
    std::istringstream in(line);
    Case c;
    c.text = line;
    in >> c.pass >> c.t >> c.kind >> c.M >> c.N >> c.m1 >> c.m2 >> c.order >> c.sms;
    bool parsed = bool(in) && c.M >= 0 && c.N >= 0 && c.sms >= 1;
    for (std::string extra; parsed && in >> extra;) {
      if (extra == "nobias" && c.pass == "dgelu") {
        c.bias = false;
      } else {
        parsed = false;
      }
    }
    if (!parsed) {
      std::cout << "FAIL " << line << ": cannot parse" << std::endl;
      ++failed;
      continue;
    }
    emu::config().sm_count = c.sms;
    emu::config().order = c.order == "desc"      ? emu::Order::kDescending
                          : c.order == "shuffle" ? emu::Order::kShuffled
                                                 : emu::Order::kAscending;
    std::cerr << "running " << line << std::endl;  // names the case if the emulator aborts
    const long launches = emu::config().launches;
    const std::string result = dispatch(c);
    ++ran;
    if (result.rfind("vec ", 0) == 0) {
      std::cout << "ok " << line << " | launches " << emu::config().launches - launches << " "
                << result << std::endl;
    } else {
      std::cout << "FAIL " << line << ": " << result << std::endl;
      ++failed;
    }
  }
  std::cout << ran << " cases, " << failed << " failed" << std::endl;
  return failed == 0 && ran > 0 ? 0 : 1;
}
