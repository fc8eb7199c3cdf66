#pragma once
// Thread-block clusters (sm_90 and newer): the blocks of a cluster run at the same time on
// neighbouring multiprocessors, can wait for each other (cluster_sync) and read each other's
// shared memory (distributed shared memory, cluster_peer). The LayerNorm kernels use them to
// keep a row too long for one block on chip across the blocks of a cluster, so that it is
// read from memory once. Also compiled by tests/emulation (FUSEDNORM_EMULATION), whose
// emulator runs a cluster's blocks on concurrent host threads.

#include <c10/cuda/CUDAException.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <utility>

#if !defined(FUSEDNORM_EMULATION)
#include <cooperative_groups.h>
#endif

namespace fusednorm::cuda {

// The most blocks a cluster may have on every sm_90+ GPU ("portable" cluster size).
constexpr int kMaxClusterBlocks = 8;

#if !defined(FUSEDNORM_EMULATION) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define FUSEDNORM_DEVICE_CLUSTERS 1
#endif

// Barrier over every thread of every block of the cluster; it also makes each block's
// shared-memory writes before it visible to the others' reads after it.
__device__ __forceinline__ void cluster_sync() {
#if defined(FUSEDNORM_EMULATION)
  ::emu::cluster_sync();
#elif defined(FUSEDNORM_DEVICE_CLUSTERS)
  cooperative_groups::this_cluster().sync();
#else
  __trap();  // clustered launches are only made where the kernel has sm_90 code
#endif
}

// The address of `p` (a __shared__ variable of this block) in block `rank` of the cluster.
template <typename V>
__device__ __forceinline__ const V* cluster_peer(const V* p, int rank) {
#if defined(FUSEDNORM_EMULATION)
  return ::emu::map_shared_rank(p, rank);
#elif defined(FUSEDNORM_DEVICE_CLUSTERS)
  return cooperative_groups::this_cluster().map_shared_rank(const_cast<V*>(p), rank);
#else
  __trap();
  return p;
#endif
}

// Launches kernel with clusters of `cluster` blocks and smem bytes of dynamic shared memory.
template <typename... Params, typename... Args>
void launch_cluster_kernel(void (*kernel)(Params...), dim3 grid, dim3 block, dim3 cluster,
                           int smem, cudaStream_t stream, Args&&... args) {
#ifdef FUSEDNORM_EMULATION
  (void)smem;
  ::emu::launch_cluster(kernel, grid, block, cluster, stream, std::forward<Args>(args)...);
#else
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeClusterDimension;
  attribute[0].val.clusterDim.x = cluster.x;
  attribute[0].val.clusterDim.y = cluster.y;
  attribute[0].val.clusterDim.z = cluster.z;
  config.attrs = attribute;
  config.numAttrs = 1;
  C10_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...));
#endif
}

// How many clusters of `blocks` blocks of `threads` (smem bytes of dynamic shared memory
// each) running `kernel` the device holds at once (cudaOccupancyMaxActiveClusters), or 0
// where it may not launch them: the device lacks cluster launches, the kernel's code was not
// compiled for sm_90 or newer (JIT-compiled from older PTX, whose cluster helpers trap), or
// no such cluster fits. The launchers' grids are persistent (each block loops over row
// groups), so they launch at most this many clusters: per-multiprocessor occupancy x SMs /
// blocks can exceed it (a cluster's blocks share one GPC, and GPC sizes need not divide by
// the cluster size), and the clusters over it would start only when the first ones had
// finished all their rows. Cached per device and cluster size in `cache` (0 unknown, -1
// none, else the count).
template <typename Kernel>
int resident_clusters(Kernel kernel, int threads, int blocks, int smem, int device,
                      std::atomic<int> (*cache)[kMaxClusterBlocks + 1]) {
#ifdef FUSEDNORM_EMULATION
  (void)kernel, (void)threads, (void)smem, (void)device, (void)cache;
  const ::emu::Config& emulated = ::emu::config();
  if (blocks < 2 || blocks > kMaxClusterBlocks || !emulated.clusters) return 0;
  if (emulated.resident_clusters > 0) return emulated.resident_clusters;
  return std::max(1, emulated.sm_count * emulated.blocks_per_sm / blocks);
#else
  constexpr int kCachedDevices = 64;
  if (blocks < 2 || blocks > kMaxClusterBlocks || device < 0 || device >= kCachedDevices) {
    return 0;
  }
  const int known = cache[device][blocks].load(std::memory_order_relaxed);
  if (known != 0) return std::max(known, 0);
  int supported = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&supported, cudaDevAttrClusterLaunch, device));
  bool ok = supported != 0;
  if (ok) {
    cudaFuncAttributes attributes{};
    C10_CUDA_CHECK(cudaFuncGetAttributes(&attributes, kernel));
    ok = attributes.ptxVersion >= 90;
  }
  int clusters = 0;
  if (ok) {
    cudaLaunchConfig_t config = {};
    config.gridDim = dim3(1, blocks);
    config.blockDim = dim3(threads);
    config.dynamicSmemBytes = smem;
    cudaLaunchAttribute attribute[1];
    attribute[0].id = cudaLaunchAttributeClusterDimension;
    attribute[0].val.clusterDim.x = 1;
    attribute[0].val.clusterDim.y = blocks;
    attribute[0].val.clusterDim.z = 1;
    config.attrs = attribute;
    config.numAttrs = 1;
    ok = cudaOccupancyMaxActiveClusters(&clusters, kernel, &config) == cudaSuccess && clusters > 0;
    (void)cudaGetLastError();  // a refused query leaves no error behind
  }
  cache[device][blocks].store(ok ? clusters : -1, std::memory_order_relaxed);
  return ok ? clusters : 0;
#endif
}

}  // namespace fusednorm::cuda
