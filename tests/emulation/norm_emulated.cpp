// Runs fusednorm's CUDA norm-family launchers and kernels (csrc/cuda/norm_kernels.cuh:
// LayerNorm and RMSNorm, with or without a residual) on the emulated GPU of emu_runtime.h
// and checks every output against a float64 reference computed here. Reads cases from
// stdin, one per line:
//
//   fwd|bwd|dscale  T  P  M  N  affine  x_misalign  p_misalign  order  [sm_count]
//            [clusters[=K]] [rms] [res | resmis] [outlier | outliers] [far] [huge] [eps=E]
//            [wide] [narrow]
//            [drop=P] [rowscale] [captured] [xgrad] [lone]
//   largest  T  P        (prints the tables' largest rows: largest_rows below)
//
// T: f32 f64 f16 bf16; P: the parameter dtype (T, or f32 beside f16/bf16); affine: wb (weight
// and bias), w, b or none, or (backward) F / Fb: a frozen weight, whose gradient is not
// asked for (a null dweight), alone or beside a bias; x_misalign / p_misalign: bytes added to the 256-aligned starts of
// x and dy / of weight and bias (a misaligned view); order: asc, desc or shuffle (the order
// the fibers of a block and the blocks run in); sm_count: the multiprocessors the launchers
// size their grids for (default 2; each is told 2 resident blocks, lone: 1, as a bucket of
// 1024 threads, for which the forward loops each block over rows); clusters: let the
// launchers use thread-block clusters for chunked rows, as on sm_90 (default: not, as
// before sm_90); clusters=K: the same, with the device holding only K clusters at once
// (what cudaOccupancyMaxActiveClusters answers; by default as many as its blocks); rms:
// RMSNorm (affine w or none) instead of LayerNorm; res: a residual (forward: s = x +
// residual is written and normalized; backward: grad_sum added to dx),
// placed like x; resmis: the same, with the residual / grad_sum one element past 16-byte
// alignment while x is not moved; outlier (LayerNorm, N >= 3): one of each row's first
// three values (which one varies by row) sits 1000 times the row's scale from the others,
// and the forward's y must come within 16 units of the accumulator's rounding instead of
// 512 (shifting the statistics by such a value loses about sqrt(N) units); outliers: two of
// them, on one side, so that the shift (their median) is one of them, in two rows of every
// three (the usual 512 units);
// far (LayerNorm):
// of every three rows, one 1e4 (16-bit: 100) times its scale above zero, one as far below and
// one near it (a block of two rows holds both kinds), so that the backward's correction of
// the saved mean's rounding runs where it should (needs_mean_correction: the
// reference's xhat use the exact mean, against which a float32 or float64 backward without
// it is off by thousands of the bound's units); huge (forward, T not f16, no multipliers):
// every other row holds one value whose square overflows acc_t (1e20; float64 1e160), and
// must give rstd and every y NaN; eps=E (forward): eps E instead of 1e-5 (an E past acc_t's
// range, inf or 1e39 for float32, must give rstd 0 and y the bias, not the NaN of huge); wide (T f16 or bf16, P f32): a float32
// residual stream, the kernels' float instantiation with T's x, y and dy (NormFwdArgs' IO):
// the residual, the sum, the backward's x, grad_sum and dx are float32; narrow (with wide
// and res, forward): the residual of T's 16-bit type instead (NormFwdArgs' residual_io);
// drop=P / rowscale (forward with res): s = x * m + residual with common/philox.h's
// multipliers (norm_fwd_dropout_cuda), the sum exact against the rule computed here and
// rng_state checked; captured: the generator's state as pointers (CUDA-graph capture).
// xgrad (backward; needed by drop=P / rowscale there): norm_bwd_input_grad_cuda's kernels,
// which also write the add ops' input gradient dx_input (IO, placed like dy): dx as written
// times the multipliers (drop=P / rowscale; else 1), rounded once to IO, exact against the
// value computed here from the dx the kernels wrote (which is checked as before).
// dscale: dropout_scale.cuh's kernel, out of T from grad of P (T's, or f32 beside 16-bit T),
// grad / out x_misalign / p_misalign bytes off, with drop=P / rowscale; affine ignored. Prints
// "ok <case> | launches L cluster-blocks B clustered C" (the kernel launches the case made,
// the blocks of its clustered ones, and how many of them in clusters) or "FAIL <case>:
// why" per line; exits 1 if any failed. Emulation errors (barrier misuse, misaligned
// vector access, out-of-bounds access) abort with a message.
#include <cuda_runtime.h>  // the emulation's (tests/emulation/include)

#include <algorithm>
#include <iomanip>
#include <iostream>
#include <limits>
#include <sstream>

#include "cuda/dropout_scale.cuh"
#include "cuda/norm_kernels.cuh"
#include "emu_check.h"

namespace {

using namespace fusednorm::cuda;
using emu::Buffer;
using namespace emu_check;

class GuardedWorkspace final : public Workspace {
 public:
  void* allocate(int64_t bytes) override {
    buffers_.push_back(Buffer::make(std::size_t(std::max<int64_t>(bytes, 1))));
    return buffers_.back().data;
  }
  void check() const {
    for (const Buffer& b : buffers_) b.check_canary("a workspace buffer");
  }

 private:
  std::vector<Buffer> buffers_;
};

struct Case {
  std::string pass, t, p;
  int64_t M = 0, N = 0;
  std::string affine;
  int x_misalign = 0, p_misalign = 0;
  std::string order;
  std::string text;
  bool centered = true;  // LayerNorm; false: RMSNorm
  bool residual = false;  // forward residual / backward grad_sum
  int r_misalign = 0;     // bytes: the residual's / grad_sum's start (else x_misalign's)
  int s_misalign = 0;     // bytes: the sum's start (r_misalign's, but for narrow)
  bool outlier = false;   // one of each row's first three values far from the rest
  bool outliers = false;  // two of them, on one side: the shift far from the rest
  bool far = false;       // rows many times their scale from zero
  bool huge = false;      // forward: rows whose statistics overflow the accumulator
  double eps = 1e-5;      // forward (eps=E): an eps past acc_t's range gives rstd 0
  bool wide = false;      // a float32 sum beside T's x, y, dy (the IO type)
  bool narrow = false;    // wide: the residual of IO's type
  double drop = 0;        // dropout_p (drop=P; with res)
  bool rowscale = false;  // a rowscale (with res)
  bool captured = false;  // the generator's state as a CUDA graph capture leaves it
  bool xgrad = false;     // backward: also the input gradient (norm_bwd_input_grad_cuda)
  bool multiplied() const { return drop > 0 || rowscale; }
};

// The (seed, offset) a case's mask is drawn with, and the state the kernels unpack it from:
// the values, or (captured) pointers to them and an intra-graph offset, as under graph
// capture. 64-bit values with high bits set.
struct Key {
  uint64_t seed, offset;
  Buffer words;  // captured: the seed and the offset before the intra-graph part
  at::PhiloxCudaState state;
};

Key make_key(const Case& c) {
  std::mt19937_64 rng(std::hash<std::string>{}(c.text) ^ 0x5eedu);
  Key k{rng(), rng() & ~uint64_t(3), Buffer::make(2 * sizeof(int64_t)), {}};
  if (c.captured) {
    constexpr uint64_t kIntraGraph = 12;
    k.words.as<int64_t>()[0] = static_cast<int64_t>(k.seed);
    k.words.as<int64_t>()[1] = static_cast<int64_t>(k.offset - kIntraGraph);
    k.state = at::PhiloxCudaState(k.words.as<int64_t>(), k.words.as<int64_t>() + 1, kIntraGraph);
  } else {
    k.state = at::PhiloxCudaState(k.seed, k.offset);
  }
  return k;
}

// The multipliers of common/philox.h, computed here from the rule (not the kernels' code):
// element i = row * N + col keeps when draw i % 4 of block i / 4 >= the threshold; a kept
// one is multiplied by keep_scale(p) * rowscale[row], rounded once to acc_t.
template <typename acc_t>
std::vector<acc_t> reference_multipliers(int64_t M, int64_t N, double p, const Key& key,
                                         const std::vector<double>* rowscale) {
  const uint64_t threshold = fusednorm::philox::dropout_threshold(p);
  const acc_t scale = static_cast<acc_t>(fusednorm::philox::keep_scale(p));
  std::vector<acc_t> m(std::size_t(M * N));
  for (int64_t row = 0; row < M; ++row) {
    const acc_t f = rowscale ? acc_t(scale * acc_t((*rowscale)[row])) : scale;
    for (int64_t col = 0; col < N; ++col) {
      const uint64_t i = uint64_t(row * N + col);
      const uint32_t draw = fusednorm::philox::draws(key.seed, key.offset, i / 4).v[i % 4];
      m[i] = threshold == 0 || draw >= threshold ? f : acc_t(0);
    }
  }
  return m;
}

std::vector<double> make_rowscale(const Case& c) {
  std::mt19937_64 rng(std::hash<std::string>{}(c.text) ^ 0x7011u);
  std::uniform_real_distribution<double> u(0.25, 2.0);
  std::vector<double> v(std::size_t(std::max<int64_t>(c.M, 1)));
  for (double& x : v) x = u(rng);
  return v;
}

// A row's mean for the references, as hi + lo in long double (x87's 64-bit significand): a
// first mean, then the mean of what is left. One long double sum is not enough for float64
// rows far from zero: at 1e4 sigma, 8192 values are off by 3e-13 of sigma. RMSNorm: 0.
struct RefMean {
  long double hi = 0, lo = 0;
  long double centered(double x) const { return (x - hi) - lo; }
};

RefMean reference_mean(const double* x, int64_t N, bool centered) {
  RefMean m;
  if (!centered || N == 0) return m;
  for (int64_t j = 0; j < N; ++j) m.hi += x[j];
  m.hi /= N;
  for (int64_t j = 0; j < N; ++j) m.lo += x[j] - m.hi;
  m.lo /= N;
  return m;
}

struct Data {
  std::vector<double> x, dy, w, b, r;  // r: the residual (forward) or grad_sum (backward)
};

// x and dy rounded to IO, the residual / grad_sum to T, the parameters to P.
// huge: rows 0, 2, 4, ... hold one value whose square overflows the accumulator type (acc_t),
// though the row's normalized values are finite: the kernels give such a row NaN.
bool overflows(const Case& c, int64_t r) { return c.huge && r % 2 == 0 && c.N > 0; }

template <typename acc_t>
double huge_value() {
  return std::is_same_v<acc_t, double> ? 1e160 : 1e20;
}

template <typename T, typename P, typename IO = T>
Data make_data(const Case& c) {
  std::mt19937_64 rng(std::hash<std::string>{}(c.text));
  std::normal_distribution<double> normal;
  Data d;
  d.x.resize(std::size_t(c.M * c.N));
  d.dy.resize(d.x.size());
  d.w.resize(std::size_t(c.N));
  d.b.resize(std::size_t(c.N));
  // Rows away from zero mean and unit scale (each row its own), parameters away from 1/0.
  for (int64_t r = 0; r < c.M; ++r) {
    const double near_shift = 2 * normal(rng), scale = 0.5 + std::abs(normal(rng)) * 3;
    const double sigmas = sizeof(IO) == 2 ? 100 : 1e4;
    const double shift = c.far && r % 3 != 2 ? (r % 3 == 0 ? sigmas : -sigmas) * scale : near_shift;
    for (int64_t j = 0; j < c.N; ++j) d.x[r * c.N + j] = shift + scale * normal(rng);
    if (c.outlier) d.x[r * c.N + r % 3] = shift + scale * (r % 2 == 0 ? 1000 : -1000);
    if (c.outliers && r % 3 != 2) {  // (a block of two rows holds both kinds)
      d.x[r * c.N + r % 3] = shift + scale * (r % 2 == 0 ? 1000 : -1000);
      d.x[r * c.N + (r + 1) % 3] = shift + scale * (r % 2 == 0 ? 1001 : -1001);
    }
    if (overflows(c, r)) d.x[r * c.N + (r / 2) % c.N] = huge_value<acc_type_t<T>>();
  }
  // far: dy with a mean of 1, so that mean(g) (which the correction of mean(g * xhat)
  // multiplies) is not near zero.
  for (double& v : d.dy) v = (c.far ? 1 : 0) + normal(rng);
  for (double& v : d.w) v = 1 + 0.5 * normal(rng);
  for (double& v : d.b) v = 0.5 * normal(rng);
  if (c.residual) {
    d.r.resize(d.x.size());
    for (double& v : d.r) v = 1.5 * normal(rng);
    d.r = rounded<T>(d.r);
  }
  d.x = rounded<IO>(d.x);
  d.dy = rounded<IO>(d.dy);
  d.w = rounded<P>(d.w);
  d.b = rounded<P>(d.b);
  return d;
}

template <typename T, typename P, typename IO = T>
std::string run_fwd(const Case& c) {
  using acc_t = acc_type_t<T>;
  const Data d = make_data<T, P, IO>(c);
  const bool has_w = c.affine == "wb" || c.affine == "w";
  const bool has_b = c.affine == "wb" || c.affine == "b";
  Buffer x = upload<IO>(d.x, c.x_misalign);
  Buffer w = upload<P>(d.w, c.p_misalign), b = upload<P>(d.b, c.p_misalign);
  const std::vector<double> r_values =
      c.narrow ? rounded<IO>(d.r) : c.residual ? d.r : std::vector<double>(1);
  Buffer res = c.narrow ? upload<IO>(r_values, c.r_misalign) : upload<T>(r_values, c.r_misalign);
  Buffer y = Buffer::make(d.x.size() * sizeof(IO));
  Buffer sum = Buffer::make(std::max<std::size_t>(d.r.size(), 1) * sizeof(T), std::size_t(c.s_misalign));
  Buffer mean = Buffer::make(std::size_t(c.M) * sizeof(acc_t));
  Buffer rstd = Buffer::make(std::size_t(c.M) * sizeof(acc_t));
  NormFwdArgs<T, P, IO> a{x.as<IO>(), has_w ? w.as<P>() : nullptr, has_b ? b.as<P>() : nullptr,
                      y.as<IO>(), c.centered ? mean.as<acc_t>() : nullptr, rstd.as<acc_t>(),
                      c.M, c.N, c.eps, c.residual && !c.narrow ? res.as<T>() : nullptr,
                      c.residual ? sum.as<T>() : nullptr, c.narrow ? res.as<IO>() : nullptr};
  // Dropout / rowscale: the multipliers' arguments, rng_state poisoned until written.
  const Key key = make_key(c);
  const std::vector<double> rowscale = make_rowscale(c);
  Buffer rs_buf = upload<acc_t>(rowscale, 0);
  Buffer rng_state = Buffer::make(2 * sizeof(int64_t));
  if (c.multiplied()) {
    a.philox = key.state;
    a.threshold = fusednorm::philox::dropout_threshold(c.drop);
    a.keep_scale = fusednorm::philox::keep_scale(c.drop);
    a.rowscale = c.rowscale ? rs_buf.as<acc_t>() : nullptr;
    a.rng_state = c.drop > 0 ? rng_state.as<int64_t>() : nullptr;
  }
  GuardedWorkspace ws;
  const DeviceInfo dev{0, emu::config().sm_count};
  if (c.centered && c.multiplied()) {
    norm_fwd_impl<true, true>(a, ws, dev, nullptr);
  } else if (c.multiplied()) {
    norm_fwd_impl<false, true>(a, ws, dev, nullptr);
  } else if (c.centered) {
    norm_fwd_impl<true>(a, ws, dev, nullptr);
  } else {
    norm_fwd_impl<false>(a, ws, dev, nullptr);
  }
  ws.check();
  for (const Buffer* buf : {&x, &w, &b, &res, &y, &sum, &mean, &rstd, &rs_buf, &rng_state}) buf->check_canary("an argument");
  if (c.drop > 0 && (uint64_t(rng_state.as<int64_t>()[0]) != key.seed ||
                     uint64_t(rng_state.as<int64_t>()[1]) != key.offset)) {
    return "rng_state is not the (seed, offset) the mask was drawn with";
  }

  // float64 reference, on s = x + residual rounded to T (exact in double, then one rounding);
  // with multipliers m, s = x * m (rounded to acc_t) + residual in acc_t, then rounded to T.
  std::vector<double> s_ref = d.x;
  if (c.multiplied()) {
    const std::vector<acc_t> m =
        reference_multipliers<acc_t>(c.M, c.N, c.drop, key, c.rowscale ? &rowscale : nullptr);
    for (std::size_t i = 0; i < s_ref.size(); ++i) {
      const acc_t product = acc_t(d.x[i]) * m[i];
      s_ref[i] = double(static_cast<T>(product + acc_t(r_values[i])));
    }
  } else if (c.residual) {
    for (std::size_t i = 0; i < s_ref.size(); ++i) s_ref[i] = d.x[i] + r_values[i];
    s_ref = rounded<T>(s_ref);
  }
  std::vector<double> ref_y(d.x.size()), ref_mean(std::size_t(c.M)), ref_rstd(std::size_t(c.M));
  std::vector<double> y_scale(d.x.size());
  // eps as the kernels take it: past acc_t's range, infinite.
  using ref_eps_t = long double;
  const ref_eps_t eps = std::isinf(acc_t(c.eps)) ? std::numeric_limits<ref_eps_t>::infinity()
                                                 : ref_eps_t(c.eps);
  for (int64_t r = 0; r < c.M; ++r) {
    // In long double (x87's 64-bit significand): a float64 reference of float64 kernels
    // is no more exact than they are, and the outlier cases' bound is tight.
    using ref_t = long double;
    const double* xr = &s_ref[r * c.N];
    const RefMean mu = reference_mean(xr, c.N, c.centered);
    ref_t v = 0;
    for (int64_t j = 0; j < c.N; ++j) v += mu.centered(xr[j]) * mu.centered(xr[j]);
    v /= ref_t(c.N);
    const ref_t rs = 1 / std::sqrt(v + eps);
    ref_mean[r] = double(mu.hi + mu.lo);
    ref_rstd[r] = double(rs);
    for (int64_t j = 0; j < c.N; ++j) {
      const ref_t xhat = mu.centered(xr[j]) * rs;
      const ref_t wj = has_w ? d.w[j] : 1, bj = has_b ? d.b[j] : 0;
      ref_y[r * c.N + j] = double(xhat * wj + bj);
      y_scale[r * c.N + j] = double((std::abs(xhat) + 1) * std::abs(wj) + std::abs(bj));
    }
  }
  // huge: a row whose statistics overflow has rstd and every y NaN (the kernels' rule); its
  // mean is not checked.
  for (int64_t r = 0; r < c.M; ++r) {
    if (!overflows(c, r)) continue;
    ref_rstd[r] = std::numeric_limits<double>::quiet_NaN();
    std::fill_n(&ref_y[r * c.N], c.N, std::numeric_limits<double>::quiet_NaN());
  }
  const double tol = acc_tolerance<T>(), ulp = unit_roundoff<IO>();
  const double y_tol = c.outlier ? 16 * unit_roundoff<acc_t>() : tol;
  std::string why;
  if (compare<IO>("y", y, ref_y, [&](std::size_t i) { return 2 * ulp * std::abs(ref_y[i]) + subnormal_step<IO>() + y_tol * y_scale[i]; }, why)) return why;
  // The sum output is exact: one rounding of x + residual, as the reference.
  if (c.residual && compare<T>("sum", sum, s_ref, [](std::size_t) { return 0.0; }, why)) return why;
  if (c.centered && compare<acc_t>("mean", mean, ref_mean, [&](std::size_t r) { return overflows(c, int64_t(r)) ? std::numeric_limits<double>::infinity() : tol * (std::abs(ref_mean[r]) + 1 / ref_rstd[r]); }, why)) return why;
  if (compare<acc_t>("rstd", rstd, ref_rstd, [&](std::size_t r) { return tol * ref_rstd[r]; }, why)) return why;
  return "";
}

template <typename T, typename P, typename IO = T>
std::string run_bwd(const Case& c) {
  using acc_t = acc_type_t<T>;
  const Data d = make_data<T, P, IO>(c);
  // F / Fb: a frozen weight (dy scaled by it, dweight not asked for), with a bias in Fb.
  const bool frozen_w = c.affine == "F" || c.affine == "Fb";
  const bool has_w = c.affine == "wb" || c.affine == "w" || frozen_w;
  const bool has_b = c.affine == "wb" || c.affine == "b" || c.affine == "Fb";
  const bool want_w = has_w && !frozen_w;
  // mean and rstd as the forward saves them (acc_t), from statistics in long double. The
  // reference normalizes with the unrounded mean (ref_mu), as the forward does (its rest).
  std::vector<double> mu(std::size_t(c.M)), rs(std::size_t(c.M));
  std::vector<RefMean> ref_mu(std::size_t(c.M));
  for (int64_t r = 0; r < c.M; ++r) {
    ref_mu[r] = reference_mean(&d.x[r * c.N], c.N, c.centered);
    long double v = 0;  // RMSNorm: mean(x^2)
    for (int64_t j = 0; j < c.N; ++j) {
      const long double centered = ref_mu[r].centered(d.x[r * c.N + j]);
      v += centered * centered;
    }
    mu[r] = double(acc_t(ref_mu[r].hi + ref_mu[r].lo));
    rs[r] = double(acc_t(1 / std::sqrt(double(v / c.N) + 1e-5)));
  }
  // x placed like dy, element for element (wide: a float x beside 16-bit dy).
  const int x_misalign = c.x_misalign * int(sizeof(T) / sizeof(IO)) % 16;
  Buffer x = upload<T>(d.x, x_misalign), dy = upload<IO>(d.dy, c.x_misalign);
  Buffer w = upload<P>(d.w, c.p_misalign);
  Buffer mean = upload<acc_t>(mu, 0), rstd = upload<acc_t>(rs, 0);
  Buffer gsum = upload<T>(c.residual ? d.r : std::vector<double>(1), c.r_misalign);
  Buffer dx = Buffer::make(d.x.size() * sizeof(T));
  Buffer dw = Buffer::make(std::size_t(c.N) * sizeof(P)), db = Buffer::make(std::size_t(c.N) * sizeof(P));
  NormBwdArgs<T, P, IO> a{dy.as<IO>(), x.as<T>(), c.centered ? mean.as<acc_t>() : nullptr,
                      rstd.as<acc_t>(), has_w ? w.as<P>() : nullptr, dx.as<T>(),
                      want_w ? dw.as<P>() : nullptr, has_b ? db.as<P>() : nullptr, c.M, c.N,
                      c.residual ? gsum.as<T>() : nullptr};
  // xgrad: the input gradient, placed like dy; (seed, offset) read from rng_state.
  const Key key = make_key(c);
  const std::vector<double> rowscale = make_rowscale(c);
  Buffer dx_input = Buffer::make(std::max<std::size_t>(d.x.size(), 1) * sizeof(IO),
                                 std::size_t(c.x_misalign));
  Buffer rs_buf = upload<acc_t>(rowscale, 0), rng_state = Buffer::make(2 * sizeof(int64_t));
  rng_state.as<int64_t>()[0] = static_cast<int64_t>(key.seed);
  rng_state.as<int64_t>()[1] = static_cast<int64_t>(key.offset);
  if (c.xgrad) {
    a.dx_input = dx_input.as<IO>();
    a.rng_state = c.drop > 0 ? rng_state.as<int64_t>() : nullptr;
    a.threshold = fusednorm::philox::dropout_threshold(c.drop);
    a.keep_scale = fusednorm::philox::keep_scale(c.drop);
    a.rowscale = c.rowscale ? rs_buf.as<acc_t>() : nullptr;
  }
  GuardedWorkspace ws;
  const DeviceInfo dev{0, emu::config().sm_count};
  if (c.centered) {
    c.xgrad ? norm_bwd_impl<true, true>(a, ws, dev, nullptr) : norm_bwd_impl<true>(a, ws, dev, nullptr);
  } else {
    c.xgrad ? norm_bwd_impl<false, true>(a, ws, dev, nullptr) : norm_bwd_impl<false>(a, ws, dev, nullptr);
  }
  ws.check();
  for (const Buffer* buf : {&x, &dy, &w, &mean, &rstd, &gsum, &dx, &dw, &db, &dx_input, &rs_buf, &rng_state}) buf->check_canary("an argument");

  std::vector<double> ref_dx(d.x.size()), dx_scale(d.x.size());
  std::vector<double> ref_dw(std::size_t(c.N), 0), ref_db(std::size_t(c.N), 0);
  std::vector<double> dw_scale(std::size_t(c.N), 0), db_scale(std::size_t(c.N), 0);
  for (int64_t r = 0; r < c.M; ++r) {
    double sum_g = 0, sum_gx = 0, abs_g = 0, abs_gx = 0;
    for (int64_t j = 0; j < c.N; ++j) {
      const double xhat = double(ref_mu[r].centered(d.x[r * c.N + j]) * rs[r]);
      const double g = d.dy[r * c.N + j] * (has_w ? d.w[j] : 1);
      sum_g += g;
      sum_gx += g * xhat;
      abs_g += std::abs(g);
      abs_gx += std::abs(g * xhat);
    }
    const double n = double(c.N);
    for (int64_t j = 0; j < c.N; ++j) {
      const std::size_t i = std::size_t(r * c.N + j);
      const double xhat = double(ref_mu[r].centered(d.x[i]) * rs[r]);
      const double g = d.dy[i] * (has_w ? d.w[j] : 1);
      const double mean_g = c.centered ? sum_g / n : 0.0;  // RMSNorm: no mean(g) term
      const double gs = c.residual ? d.r[i] : 0.0;
      ref_dx[i] = rs[r] * (g - mean_g - xhat * sum_gx / n) + gs;
      dx_scale[i] = rs[r] * (std::abs(g) + abs_g / n + std::abs(xhat) * (abs_gx / n + 1)) + std::abs(gs);
      ref_dw[j] += d.dy[i] * xhat;
      ref_db[j] += d.dy[i];
      dw_scale[j] += std::abs(d.dy[i] * xhat);
      db_scale[j] += std::abs(d.dy[i]);
    }
  }
  const double tol = acc_tolerance<T>();
  std::string why;
  if (compare<T>("dx", dx, ref_dx, [&](std::size_t i) { return 2 * unit_roundoff<T>() * std::abs(ref_dx[i]) + subnormal_step<T>() + tol * dx_scale[i]; }, why)) return why;
  if (want_w && compare<P>("dweight", dw, ref_dw, [&](std::size_t j) { return 2 * unit_roundoff<P>() * std::abs(ref_dw[j]) + subnormal_step<P>() + tol * dw_scale[j]; }, why)) return why;
  if (has_b && compare<P>("dbias", db, ref_db, [&](std::size_t j) { return 2 * unit_roundoff<P>() * std::abs(ref_db[j]) + subnormal_step<P>() + tol * db_scale[j]; }, why)) return why;
  if (c.xgrad) {
    // The host's value of dropout_scale's rule on the dx the kernels wrote: exact.
    const std::vector<acc_t> m = reference_multipliers<acc_t>(c.M, c.N, c.drop, key,
                                                              c.rowscale ? &rowscale : nullptr);
    std::vector<double> ref_in(d.x.size());
    for (std::size_t i = 0; i < ref_in.size(); ++i) {
      ref_in[i] = double(static_cast<IO>(acc_t(dx.as<T>()[i]) * m[i]));
    }
    if (compare<IO>("dx_input", dx_input, ref_in, [](std::size_t) { return 0.0; }, why)) return why;
  }
  return "";
}

// dropout_scale (dropout_scale.cuh): out (O = T) = grad (G = P: T's, or f32 beside 16-bit)
// times the multipliers, rounded once from acc_t; grad / out placed x_misalign / p_misalign
// bytes past 16-byte alignment. Exact against the reference (the same two roundings).
template <typename O, typename G>
std::string run_dropout_scale(const Case& c) {
  using acc_t = acc_type_t<O>;
  std::mt19937_64 rng(std::hash<std::string>{}(c.text));
  std::normal_distribution<double> normal;
  std::vector<double> g(std::size_t(c.M * c.N));
  for (double& v : g) v = normal(rng);
  g = rounded<G>(g);
  const Key key = make_key(c);
  const std::vector<double> rowscale = make_rowscale(c);
  Buffer grad = upload<G>(g, c.x_misalign), rs_buf = upload<acc_t>(rowscale, 0);
  Buffer out = Buffer::make(std::max<std::size_t>(g.size(), 1) * sizeof(O), std::size_t(c.p_misalign));
  Buffer rng_state = Buffer::make(2 * sizeof(int64_t));
  rng_state.as<int64_t>()[0] = static_cast<int64_t>(key.seed);
  rng_state.as<int64_t>()[1] = static_cast<int64_t>(key.offset);
  const DropoutScaleArgs<G, O, acc_t> a{
      grad.as<G>(), out.as<O>(), c.M, c.N, c.drop > 0 ? rng_state.as<int64_t>() : nullptr,
      fusednorm::philox::dropout_threshold(c.drop),
      static_cast<acc_t>(fusednorm::philox::keep_scale(c.drop)),
      c.rowscale ? rs_buf.as<acc_t>() : nullptr};
  dropout_scale_cuda(a, emu::config().sm_count, nullptr);
  for (const Buffer* buf : {&grad, &rs_buf, &out, &rng_state}) buf->check_canary("an argument");
  const std::vector<acc_t> m =
      reference_multipliers<acc_t>(c.M, c.N, c.drop, key, c.rowscale ? &rowscale : nullptr);
  std::vector<double> ref(g.size());
  for (std::size_t i = 0; i < g.size(); ++i) ref[i] = double(static_cast<O>(acc_t(g[i]) * m[i]));
  std::string why;
  if (compare<O>("out", out, ref, [](std::size_t) { return 0.0; }, why)) return why;
  return "";
}

template <typename T, typename P, typename IO = T>
std::string run_case(const Case& c) {
  if (c.pass == "dscale") {
    if constexpr (std::is_same_v<IO, T>) return run_dropout_scale<T, P>(c);
    return "dscale takes no wide";
  }
  return c.pass == "fwd" ? run_fwd<T, P, IO>(c) : run_bwd<T, P, IO>(c);
}

std::string dispatch(const Case& c) {
  if (c.pass != "fwd" && c.pass != "bwd" && c.pass != "dscale") return "bad pass " + c.pass;
  if (c.t == "f32" && c.p == "f32") return run_case<float, float>(c);
#ifndef EMU_ONLY_FLOAT  // (a quicker build, for the test that the harness can fail)
  if (c.wide && c.t == "f16" && c.p == "f32") return run_case<float, float, c10::Half>(c);
  if (c.wide && c.t == "bf16" && c.p == "f32") return run_case<float, float, c10::BFloat16>(c);
  if (c.wide) return "bad wide dtype pair " + c.t + "/" + c.p;
  if (c.t == "f64" && c.p == "f64") return run_case<double, double>(c);
  if (c.t == "f16" && c.p == "f16") return run_case<c10::Half, c10::Half>(c);
  if (c.t == "f16" && c.p == "f32") return run_case<c10::Half, float>(c);
  if (c.t == "bf16" && c.p == "bf16") return run_case<c10::BFloat16, c10::BFloat16>(c);
  if (c.t == "bf16" && c.p == "f32") return run_case<c10::BFloat16, float>(c);
#endif
  return "bad dtype pair " + c.t + "/" + c.p;
}

// "largest T P": the largest bucket's row length in elements of each table the launchers
// take for T (and P), as compiled: the forward's 16-byte and one-element tables (and
// those of the forward with dropout), the backward's 16-byte one, LayerNorm's with a
// grad_sum, and its one-element one (chunks are cut beyond them).
template <typename T, typename P>
std::string largest_rows() {
  using namespace fusednorm::cuda;
  constexpr int64_t vec = kVec<T>;
  const auto largest = [](auto table) {
    using Table = decltype(table);
    return bucket_capacity<Table>(kNumBuckets<Table> - 1);
  };
  std::ostringstream out;
  out << "fwd_vec " << vec * largest(FwdVecTable<T, P>{}) << " fwd_scalar "
      << largest(FwdScalarTable<T>{}) << " fwd_vec_dropout "
      << vec * largest(FwdVecTable<T, P, true>{}) << " fwd_scalar_dropout "
      << largest(FwdScalarTable<T, true>{}) << " bwd_vec " << vec * largest(BwdVecBuckets<T>{})
      << " bwd_vec_ln_grad_sum " << vec * largest(BwdVecBucketsGradSum<T>{}) << " bwd_scalar "
      << largest(BwdScalarBuckets{});
  return out.str();
}

std::string largest_for(const std::string& t, const std::string& p) {
  if (t == "f32" && p == "f32") return largest_rows<float, float>();
#ifndef EMU_ONLY_FLOAT
  if (t == "f64" && p == "f64") return largest_rows<double, double>();
  if (t == "f16" && p == "f16") return largest_rows<c10::Half, c10::Half>();
  if (t == "f16" && p == "f32") return largest_rows<c10::Half, float>();
  if (t == "bf16" && p == "bf16") return largest_rows<c10::BFloat16, c10::BFloat16>();
  if (t == "bf16" && p == "f32") return largest_rows<c10::BFloat16, float>();
#endif
  return "";
}

}  // namespace

int main() {
  std::string line;
  int failed = 0, ran = 0;
  while (std::getline(std::cin, line)) {
    if (line.empty() || line[0] == '#') continue;
    std::istringstream in(line);
    if (line.rfind("largest ", 0) == 0) {
      std::istringstream q(line.substr(8));
      std::string t, p;
      q >> t >> p;
      const std::string rows = largest_for(t, p);
      std::cout << (rows.empty() ? "FAIL " + line + ": bad dtype pair" : "largest " + t + " " + p + " " + rows)
                << std::endl;
      failed += rows.empty();
      ++ran;
      continue;
    }
    Case c;
    c.text = line;
    in >> c.pass >> c.t >> c.p >> c.M >> c.N >> c.affine >> c.x_misalign >> c.p_misalign >> c.order;
    const bool parsed = bool(in);
    // Optional: a multiprocessor count, and "clusters" (sm_90's clustered launches allowed).
    int sms = 2;
    bool clusters = false;
    int resident_clusters = 0;
    bool lone = false;
    for (std::string extra; parsed && in >> extra;) {
      if (extra == "clusters") {
        clusters = true;
      } else if (extra.rfind("clusters=", 0) == 0) {
        clusters = true;
        resident_clusters = std::max(1, std::atoi(extra.c_str() + 9));
      } else if (extra == "rms") {
        c.centered = false;
      } else if (extra == "res") {
        c.residual = true;
      } else if (extra == "outlier") {
        c.outlier = true;
      } else if (extra == "outliers") {
        c.outliers = true;
      } else if (extra == "far") {
        c.far = true;
      } else if (extra == "huge") {
        c.huge = true;
      } else if (extra.rfind("eps=", 0) == 0) {
        c.eps = std::atof(extra.c_str() + 4);
      } else if (extra == "wide") {
        c.wide = true;
      } else if (extra == "narrow") {
        c.narrow = true;
      } else if (extra.rfind("drop=", 0) == 0) {
        c.drop = std::atof(extra.c_str() + 5);
      } else if (extra == "rowscale") {
        c.rowscale = true;
      } else if (extra == "captured") {
        c.captured = true;
      } else if (extra == "xgrad") {
        c.xgrad = true;
      } else if (extra == "lone") {
        lone = true;
      } else if (extra == "resmis") {
        c.residual = true;
        c.r_misalign = -1;  // one element of T, set below
      } else {
        sms = std::atoi(extra.c_str());
      }
    }
    if (c.residual) {
      const bool wide_r = c.wide && !c.narrow, moved = c.r_misalign < 0;
      const int elem = c.t == "f64" ? 8 : c.t == "f32" || wide_r ? 4 : 2;
      // Placed like x, element for element (wide: x's 2-byte elements, the residual's 4).
      const int like_x = wide_r ? c.x_misalign * 2 % 16 : c.x_misalign;
      c.r_misalign = moved ? (like_x + elem) % 16 : like_x;
      // The sum: the residual's place, or (narrow: a float sum beside a 16-bit residual)
      // the float residual's.
      c.s_misalign = c.narrow ? (c.x_misalign * 2 + (moved ? 4 : 0)) % 16 : c.r_misalign;
    }
    const bool rms_bias = !c.centered && (c.affine == "wb" || c.affine == "b" || c.affine == "Fb");
    const bool frozen_fwd = c.pass != "bwd" && (c.affine == "F" || c.affine == "Fb");
    const bool bad_outlier = ((c.outlier || c.outliers) &&
                              (!c.centered || c.N < 3 || c.pass != "fwd")) ||
                             (c.outlier && c.outliers) ||
                             (c.far && !c.centered) ||
                             (c.huge && (c.pass != "fwd" || c.t == "f16" || c.multiplied())) ||
                             (c.eps != 1e-5 && c.pass != "fwd") ||
                             (c.wide && c.pass == "fwd" && !c.residual) ||
                             (c.narrow && (!c.wide || !c.residual || c.pass != "fwd")) ||
                             (c.multiplied() && c.pass == "fwd" && !c.residual) ||
                             (c.multiplied() && c.pass == "bwd" && !c.xgrad) ||
                             (c.xgrad && c.pass != "bwd") ||
                             (c.pass == "dscale" && (c.residual || c.wide)) ||
                             c.drop < 0 || c.drop > 1;
    emu::config().sm_count = sms;
    emu::config().clusters = clusters;
    emu::config().resident_clusters = resident_clusters;
    emu::config().blocks_per_sm = lone ? 1 : 2;
    if (!parsed || sms < 1 || rms_bias || frozen_fwd || bad_outlier) {
      std::cout << "FAIL " << line << ": cannot parse" << std::endl;
      ++failed;
      continue;
    }
    emu::config().order = c.order == "desc"      ? emu::Order::kDescending
                          : c.order == "shuffle" ? emu::Order::kShuffled
                                                 : emu::Order::kAscending;
    std::cerr << "running " << line << std::endl;  // names the case if the emulator aborts
    const long launches = emu::config().launches, clustered = emu::config().cluster_launches;
    const long cluster_blocks = emu::config().cluster_launch_blocks;
    const std::string why = dispatch(c);
    ++ran;
    if (why.empty()) {
      // The launch counts show which path ran (e.g. 1 clustered launch for a chunked row).
      std::cout << "ok " << line << " | launches " << emu::config().launches - launches
                << " cluster-blocks " << emu::config().cluster_launch_blocks - cluster_blocks
                << " clustered " << emu::config().cluster_launches - clustered << std::endl;
    } else {
      std::cout << "FAIL " << line << ": " << why << std::endl;
      ++failed;
    }
  }
  std::cout << ran << " cases, " << failed << " failed" << std::endl;
  return failed == 0 && ran > 0 ? 0 : 1;
}
