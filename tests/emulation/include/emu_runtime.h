// A small host emulation of the CUDA built-ins fusednorm's kernels use, so that their
// templates compile as plain C++ (g++) and run on the CPU: see tests/emulation/README.md.
//
// A block's threads are fibers (ucontext to start, _setjmp/_longjmp to switch) on one OS
// thread, run round robin, or in reverse or shuffled order; a thread runs until it reaches
// __syncthreads() or a warp shuffle and then lets the next one run. So every access between
// two synchronisation points of one thread happens before any other thread's, and a missing
// barrier shows up as a read of a value not yet (or no longer) written. Blocks run one after
// another. Checked: barriers reached by all threads of a block, shuffles reached by all 32
// lanes of a warp in the same order (else a deadlock or mismatch is reported), full masks,
// alignment of vector accesses. Not seen: timing, memory ordering between real warps and
// blocks running at the same time, the compiler's device code generation.
#pragma once

#include <setjmp.h>
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <stdexcept>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

// ---------------------------------------------------------------------------------------
// Qualifiers and types

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __restrict__ __restrict
// Shared memory: one copy per kernel instantiation and host thread, which all the fibers
// of the block running on that thread see (a cluster's blocks run on their own threads).
#define __shared__ static thread_local

struct uint3 {
  unsigned x = 0, y = 0, z = 0;
};
struct dim3 {
  unsigned x = 1, y = 1, z = 1;
  constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
struct uint4 {
  unsigned x, y, z, w;
};
struct uint2 {
  unsigned x, y;
};
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return {x, y, z, w}; }

using cudaStream_t = void*;
enum cudaError_t { cudaSuccess = 0, cudaErrorUnknown = 999 };

struct __half {
  unsigned short x;
};

namespace emu {

[[noreturn]] inline void fail(const std::string& what) {
  std::fprintf(stderr, "EMULATION ERROR: %s\n", what.c_str());
  std::fflush(stderr);
  std::abort();
}

inline void check_status(cudaError_t status, const char* expr) {
  if (status != cudaSuccess) fail(std::string("CUDA call failed: ") + expr);
}

inline void check_aligned(const void* p, std::size_t alignment) {
  if (reinterpret_cast<std::uintptr_t>(p) % alignment != 0) {
    fail("misaligned " + std::to_string(alignment) + "-byte access at " +
         std::to_string(reinterpret_cast<std::uintptr_t>(p)));
  }
}

// ---------------------------------------------------------------------------------------
// Fibers

struct Fiber {
  jmp_buf context;
  ucontext_t start;
  uint3 thread_idx;
  int linear = 0;
  bool started = false;
  bool done = false;
  long collective_ops = 0;  // warp shuffles this thread has done: lanes must agree
  // cp.async (async_copy): the copies issued since the last commit, and the committed groups
  // not yet waited for, oldest first. A copy lands only at the wait that covers it, so a
  // read of its slot before that wait sees what was there before.
  struct Copy {
    void* dst;
    const void* src;
    int bytes;
    bool valid;
  };
  std::vector<Copy> open_copies;
  std::vector<std::vector<Copy>> copy_groups;
};

enum class Order { kAscending, kDescending, kShuffled };

// The blocks of one cluster, each run by its own host thread.
struct ClusterState {
  int blocks = 1;
  std::mutex mutex;
  std::condition_variable cv;
  int arrived = 0;
  long generation = 0;
  std::vector<const char*> anchors;  // per block: its host thread's TLS anchor
};

struct BlockState {
  std::vector<Fiber> fibers;
  ClusterState* cluster = nullptr;  // null: not a cluster launch
  int cluster_rank = 0;
  int barrier_kind = 0;  // 1 __syncthreads, 2 cluster_sync: all threads must be at the same
  Fiber* current = nullptr;
  jmp_buf scheduler;
  std::function<void()> body;
  int threads = 0;
  long events = 0;  // arrivals and exits: progress for the deadlock check
  // __syncthreads
  int barrier_arrived = 0;
  long barrier_generation = 0;
  int barrier_or = 0;      // __syncthreads_or: the predicates of the threads arrived so far
  int barrier_result = 0;  // and of all, once the last has arrived (read before the next can end)
  // Per warp: the exchange slots of a shuffle and a two-phase rendezvous.
  struct Warp {
    uint64_t slots[32];
    int arrived = 0;
    long generation = 0;
    long op = -1;  // collective_ops of the lanes in this exchange
  };
  std::vector<Warp> warps;
};

struct Config {
  int sm_count = 2;
  int blocks_per_sm = 2;  // what the occupancy query answers
  Order order = Order::kAscending;
  bool clusters = false;  // whether the launchers may use clustered launches
  int resident_clusters = 0;  // what the cluster occupancy query answers (0: as blocks allow)
  unsigned seed = 1;
  long launches = 0;
  long cluster_launches = 0;
  long cluster_launch_blocks = 0;  // blocks of the clustered launches
  std::vector<const void*> kernels;  // every launch's kernel, in order (which path ran)
};

inline Config& config() {
  static Config c;
  return c;
}

inline BlockState& block_state() {
  thread_local BlockState b;
  return b;
}

inline uint3& block_idx() {
  thread_local uint3 v;
  return v;
}
inline dim3& grid_dim() {
  thread_local dim3 v;
  return v;
}
inline dim3& block_dim() {
  thread_local dim3 v;
  return v;
}

// A thread-local variable of the executable: its address differs between host threads by
// the same amount as that of any other (static TLS has one layout per thread), which is how
// map_shared_rank finds another block's copy of a __shared__ variable.
inline const char* tls_anchor() {
  thread_local char anchor;
  return &anchor;
}

// Back to the scheduler; resumes here when the scheduler picks this fiber again.
inline void yield() {
  BlockState& b = block_state();
  if (_setjmp(b.current->context) == 0) _longjmp(b.scheduler, 1);
}

inline void fiber_entry() {
  BlockState& b = block_state();
  b.body();
  b.current->done = true;
  ++b.events;
  if (b.barrier_arrived > 0) fail("a thread exited while others wait at __syncthreads()");
  _longjmp(b.scheduler, 1);
}

// Fiber stacks, allocated once and reused: 128 KiB per thread with an inaccessible page
// below each; one set per block of a cluster (set = rank), allocated before the cluster's
// host threads start (reserve_stacks), so that they only read this table.
constexpr std::size_t kStackBytes = 128 << 10;
inline std::vector<std::vector<char*>>& stack_sets() {
  static std::vector<std::vector<char*>> sets;
  return sets;
}
inline void reserve_stacks(int sets, int threads) {
  const std::size_t page = sysconf(_SC_PAGESIZE);
  auto& all = stack_sets();
  if (int(all.size()) < sets) all.resize(sets);
  for (int s = 0; s < sets; ++s) {
    while (int(all[s].size()) < threads) {
      void* m = mmap(nullptr, kStackBytes + page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (m == MAP_FAILED) fail("mmap of a fiber stack failed");
      mprotect(m, page, PROT_NONE);
      all[s].push_back(static_cast<char*>(m) + page);
    }
  }
}

inline void run_block(dim3 block, const std::function<void()>& body) {
  BlockState& b = block_state();
  b.threads = int(block.x * block.y * block.z);
  if (b.threads % 32 != 0) fail("block size not a multiple of 32 (the kernels assume full warps)");
  b.fibers.assign(b.threads, Fiber{});
  b.warps.assign(b.threads / 32, BlockState::Warp{});
  b.body = body;
  b.barrier_arrived = 0;
  for (int t = 0; t < b.threads; ++t) {
    Fiber& f = b.fibers[t];
    f.linear = t;
    f.thread_idx = {unsigned(t % block.x), unsigned(t / block.x % block.y), unsigned(t / (block.x * block.y))};
    getcontext(&f.start);
    f.start.uc_stack.ss_sp = stack_sets()[b.cluster_rank][t];
    f.start.uc_stack.ss_size = kStackBytes;
    f.start.uc_link = nullptr;
    makecontext(&f.start, fiber_entry, 0);
  }
  std::vector<int> order(b.threads);
  for (int t = 0; t < b.threads; ++t) order[t] = t;
  if (config().order == Order::kDescending) std::reverse(order.begin(), order.end());
  std::mt19937 rng(config().seed + unsigned(config().launches));
  int live = b.threads;
  while (live > 0) {
    if (config().order == Order::kShuffled) std::shuffle(order.begin(), order.end(), rng);
    const long events_before = b.events;
    for (int t : order) {
      Fiber& f = b.fibers[t];
      if (f.done) continue;
      b.current = &f;
      thread_local ucontext_t scheduler_uc;
      if (_setjmp(b.scheduler) == 0) {
        if (!f.started) {
          f.started = true;
          swapcontext(&scheduler_uc, &f.start);
        } else {
          _longjmp(f.context, 1);
        }
      }
      if (f.done) --live;
    }
    if (live > 0 && b.events == events_before) {
      fail("deadlock: the live threads wait at barriers or shuffles that not all of their block/warp reach");
    }
  }
  b.current = nullptr;
}

// ---------------------------------------------------------------------------------------
// Synchronisation

// The host-thread barrier of a cluster, entered by the last thread of each block to reach
// cluster_sync (the others are parked at it).
inline void cluster_barrier(ClusterState& c) {
  std::unique_lock<std::mutex> lock(c.mutex);
  const long generation = c.generation;
  if (++c.arrived == c.blocks) {
    c.arrived = 0;
    ++c.generation;
    c.cv.notify_all();
    return;
  }
  if (!c.cv.wait_for(lock, std::chrono::seconds(60), [&] { return c.generation != generation; })) {
    fail("cluster barrier: a block of the cluster never reached cluster.sync()");
  }
}

// kind 1: __syncthreads(); kind 2: cluster.sync() (the block's threads, then the blocks);
// kind 3: __syncthreads_or(predicate), whose result it returns (0 for the others).
inline int block_barrier(int kind, int predicate = 0) {
  BlockState& b = block_state();
  const long generation = b.barrier_generation;
  ++b.events;
  if (b.barrier_arrived == 0) {
    b.barrier_kind = kind;
  } else if (b.barrier_kind != kind) {
    fail("threads of a block wait at different barriers (__syncthreads, __syncthreads_or, "
         "cluster.sync)");
  }
  b.barrier_or |= predicate != 0;
  if (++b.barrier_arrived == b.threads) {
    if (kind == 2) cluster_barrier(*b.cluster);
    b.barrier_arrived = 0;
    b.barrier_result = b.barrier_or;
    b.barrier_or = 0;
    ++b.barrier_generation;
  }
  while (b.barrier_generation == generation) yield();
  return b.barrier_result;
}

inline void syncthreads() { block_barrier(1); }
inline int syncthreads_or(int predicate) { return block_barrier(3, predicate); }

inline void cluster_sync() {
  if (block_state().cluster == nullptr) fail("cluster.sync() in a launch without clusters");
  block_barrier(2);
}

template <typename V>
const V* map_shared_rank(const V* p, int rank) {
  BlockState& b = block_state();
  if (b.cluster == nullptr) fail("map_shared_rank in a launch without clusters");
  if (rank < 0 || rank >= b.cluster->blocks) fail("map_shared_rank: rank outside the cluster");
  const char* mine = reinterpret_cast<const char*>(p);
  return reinterpret_cast<const V*>(mine - tls_anchor() + b.cluster->anchors[rank]);
}

// All 32 lanes of the current warp meet here; they must be at the same collective op.
inline void warp_rendezvous(BlockState::Warp& w, long op) {
  const long generation = w.generation;
  ++block_state().events;
  if (w.arrived == 0) {
    w.op = op;
  } else if (w.op != op) {
    fail("warp lanes at different shuffles (divergent collective operations)");
  }
  if (++w.arrived == 32) {
    w.arrived = 0;
    ++w.generation;
  }
  while (w.generation == generation) yield();
}

template <typename T>
T shfl_xor_sync(unsigned mask, T value, int lane_mask) {
  static_assert(sizeof(T) <= 8 && std::is_trivially_copyable_v<T>, "shuffle of a register value");
  if (mask != 0xffffffffu) fail("shuffle with a partial mask (the kernels use full warps)");
  BlockState& b = block_state();
  Fiber& f = *b.current;
  BlockState::Warp& w = b.warps[f.linear / 32];
  const int lane = f.linear % 32;
  const long op = f.collective_ops++;
  uint64_t bits = 0;
  std::memcpy(&bits, &value, sizeof(T));
  w.slots[lane] = bits;
  warp_rendezvous(w, op);  // every lane has written its value
  T out;
  const uint64_t theirs = w.slots[(lane ^ lane_mask) & 31];
  std::memcpy(&out, &theirs, sizeof(T));
  warp_rendezvous(w, op);  // every lane has read before any writes the next exchange
  return out;
}

// ---------------------------------------------------------------------------------------
// cp.async

inline void async_copy(void* dst, const void* src, int bytes, bool valid) {
  if (reinterpret_cast<uintptr_t>(dst) % bytes || (valid && reinterpret_cast<uintptr_t>(src) % bytes)) {
    fail("cp.async: a misaligned address");
  }
  block_state().current->open_copies.push_back({dst, src, bytes, valid});
}

inline void async_commit() {
  Fiber& f = *block_state().current;
  f.copy_groups.push_back(std::move(f.open_copies));
  f.open_copies.clear();
}

inline void async_wait(int newest) {
  Fiber& f = *block_state().current;
  while (int(f.copy_groups.size()) > newest) {
    for (const Fiber::Copy& c : f.copy_groups.front()) {
      if (c.valid) {
        std::memcpy(c.dst, c.src, c.bytes);
      } else {
        std::memset(c.dst, 0, c.bytes);
      }
    }
    f.copy_groups.erase(f.copy_groups.begin());
  }
}

// ---------------------------------------------------------------------------------------
// Launch

template <typename... Params, typename... Args>
void launch(void (*kernel)(Params...), dim3 grid, dim3 block, cudaStream_t, Args&&... args) {
  if (grid.x == 0 || grid.y == 0 || grid.z == 0) fail("empty grid");
  if (grid.y > 65535 || grid.z > 65535) fail("grid.y/z over 65535");
  if (block.x * block.y * block.z > 1024) fail("more than 1024 threads per block");
  ++config().launches;
  config().kernels.push_back(reinterpret_cast<const void*>(kernel));
  // Kernel parameters are copies, as on the device.
  std::tuple<std::decay_t<Params>...> params(std::forward<Args>(args)...);
  reserve_stacks(1, int(block.x * block.y * block.z));
  block_state().cluster = nullptr;
  block_state().cluster_rank = 0;
  grid_dim() = grid;
  block_dim() = block;
  // Blocks in reverse order for the descending schedule: no block may depend on another.
  const long blocks = long(grid.x) * grid.y * grid.z;
  for (long i = 0; i < blocks; ++i) {
    const long k = config().order == Order::kDescending ? blocks - 1 - i : i;
    block_idx() = {unsigned(k % grid.x), unsigned(k / grid.x % grid.y), unsigned(k / (long(grid.x) * grid.y))};
    run_block(block, [&] { std::apply(kernel, params); });
  }
}

// A launch in clusters of `cluster` blocks: the blocks of one cluster run at the same time,
// each on its own host thread (with its own fibers and __shared__ variables); clusters run
// one after another.
template <typename... Params, typename... Args>
void launch_cluster(void (*kernel)(Params...), dim3 grid, dim3 block, dim3 cluster, cudaStream_t,
                    Args&&... args) {
  const int size = int(cluster.x * cluster.y * cluster.z);
  if (size < 1 || size > 8) fail("cluster size outside 1..8 (the portable limit)");
  if (grid.x % cluster.x || grid.y % cluster.y || grid.z % cluster.z) fail("grid not a multiple of the cluster");
  if (block.x * block.y * block.z > 1024) fail("more than 1024 threads per block");
  ++config().launches;
  ++config().cluster_launches;
  config().cluster_launch_blocks += long(grid.x) * grid.y * grid.z;
  std::tuple<std::decay_t<Params>...> params(std::forward<Args>(args)...);
  reserve_stacks(size, int(block.x * block.y * block.z));
  for (unsigned cz = 0; cz < grid.z / cluster.z; ++cz) {
    for (unsigned cy = 0; cy < grid.y / cluster.y; ++cy) {
      for (unsigned cx = 0; cx < grid.x / cluster.x; ++cx) {
        ClusterState state;
        state.blocks = size;
        state.anchors.assign(size, nullptr);
        std::mutex ready_mutex;
        std::condition_variable ready_cv;
        int ready = 0;
        std::vector<std::thread> threads;
        for (int r = 0; r < size; ++r) {
          threads.emplace_back([&, r] {
            const uint3 in = {unsigned(r % cluster.x), unsigned(r / cluster.x % cluster.y),
                              unsigned(r / (cluster.x * cluster.y))};
            BlockState& b = block_state();
            b.cluster = &state;
            b.cluster_rank = r;
            grid_dim() = grid;
            block_dim() = block;
            block_idx() = {cx * cluster.x + in.x, cy * cluster.y + in.y, cz * cluster.z + in.z};
            {  // every block's anchor is known before any block runs
              std::unique_lock<std::mutex> lock(ready_mutex);
              state.anchors[r] = tls_anchor();
              if (++ready == size) ready_cv.notify_all();
              ready_cv.wait(lock, [&] { return ready == size; });
            }
            run_block(block, [&] { std::apply(kernel, params); });
          });
        }
        for (std::thread& t : threads) t.join();
      }
    }
  }
}

// ---------------------------------------------------------------------------------------
// Device memory: each buffer ends at an inaccessible page (reads or writes past the end
// fault at once) and starts after a canary (writes before the start are found by
// check_canary); contents start as 0xff bytes, a NaN in every floating-point format.

struct Buffer {
  void* mapping = nullptr;
  std::size_t mapping_bytes = 0;
  char* data = nullptr;
  std::size_t bytes = 0;
  std::size_t canary = 0;  // bytes before data holding the canary

  Buffer() = default;
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  Buffer(Buffer&& o) noexcept { *this = std::move(o); }
  Buffer& operator=(Buffer&& o) noexcept {
    std::swap(mapping, o.mapping);
    std::swap(mapping_bytes, o.mapping_bytes);
    std::swap(data, o.data);
    std::swap(bytes, o.bytes);
    std::swap(canary, o.canary);
    return *this;
  }
  ~Buffer() {
    if (mapping) munmap(mapping, mapping_bytes);
  }

  // `bytes` usable bytes whose start is `misalign` bytes past a 256-byte boundary (as
  // cudaMalloc's pointers are aligned); the end touches the guard page when the size allows
  // (bytes + misalign a multiple of 256), else it is at most 255 bytes before it.
  static Buffer make(std::size_t bytes, std::size_t misalign = 0) {
    const std::size_t page = sysconf(_SC_PAGESIZE);
    Buffer b;
    const std::size_t span = bytes + misalign;
    const std::size_t body = (span + 255) / 256 * 256;
    const std::size_t pages = (body + 256 + page - 1) / page;  // >= 256 canary bytes
    b.mapping_bytes = (pages + 1) * page;
    b.mapping = mmap(nullptr, b.mapping_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (b.mapping == MAP_FAILED) fail("mmap of a device buffer failed");
    char* guard = static_cast<char*>(b.mapping) + pages * page;
    mprotect(guard, page, PROT_NONE);
    char* aligned_start = guard - body;
    b.data = aligned_start + misalign;
    b.bytes = bytes;
    b.canary = std::size_t(b.data - static_cast<char*>(b.mapping));
    std::memset(b.mapping, 0xa5, b.canary);
    std::memset(b.data, 0xff, guard - b.data);
    return b;
  }

  template <typename T>
  T* as() const {
    return reinterpret_cast<T*>(data);
  }

  // Writes before the start, or in the slack after the end (when the size left some).
  void check_canary(const char* name) const {
    const auto* start = static_cast<const unsigned char*>(mapping);
    for (std::size_t i = 0; i < canary; ++i) {
      if (start[i] != 0xa5) fail(std::string("write before the start of ") + name);
    }
    const std::size_t page = sysconf(_SC_PAGESIZE);
    const char* guard = static_cast<const char*>(mapping) + mapping_bytes - page;
    for (const char* p = data + bytes; p < guard; ++p) {
      if (static_cast<unsigned char>(*p) != 0xff) fail(std::string("write past the end of ") + name);
    }
  }
};

}  // namespace emu

// ---------------------------------------------------------------------------------------
// Built-ins

#define threadIdx (::emu::block_state().current->thread_idx)
#define blockIdx (::emu::block_idx())
#define gridDim (::emu::grid_dim())
#define blockDim (::emu::block_dim())

inline void __syncthreads() { ::emu::syncthreads(); }
inline int __syncthreads_or(int predicate) { return ::emu::syncthreads_or(predicate); }

template <typename T>
inline T __shfl_xor_sync(unsigned mask, T value, int lane_mask) {
  return ::emu::shfl_xor_sync(mask, value, lane_mask);
}

inline float __fmaf_rn(float a, float b, float c) { return std::fma(a, b, c); }
inline double __fma_rn(double a, double b, double c) { return std::fma(a, b, c); }
inline float __fmul_rn(float a, float b) { return a * b; }
inline double __dmul_rn(double a, double b) { return a * b; }
inline float __fdividef(float a, float b) { return a / b; }
// Correctly rounded on the GPU; here through double (off by an ulp at most, rarely).
inline float __frsqrt_rn(float v) { return float(1.0 / std::sqrt(double(v))); }
// CUDA's isinf, in the global namespace as there.
inline bool isinf(float v) { return std::isinf(v); }
inline bool isinf(double v) { return std::isinf(v); }

inline float __uint_as_float(unsigned u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline unsigned __float_as_uint(float f) {
  unsigned u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline long long __double_as_longlong(double d) {
  long long u;
  std::memcpy(&u, &d, 8);
  return u;
}
inline __half __ushort_as_half(unsigned short bits) { return __half{bits}; }
inline float __half2float(__half h) { return c10::detail::fp16_ieee_to_fp32_value(h.x); }

inline cudaError_t cudaOccupancyMaxActiveBlocksPerMultiprocessor(int* blocks, const void*, int, std::size_t) {
  *blocks = ::emu::config().blocks_per_sm;
  return cudaSuccess;
}
template <typename Kernel>
inline cudaError_t cudaOccupancyMaxActiveBlocksPerMultiprocessor(int* blocks, Kernel, int threads, std::size_t smem) {
  return cudaOccupancyMaxActiveBlocksPerMultiprocessor(blocks, static_cast<const void*>(nullptr), threads, smem);
}
