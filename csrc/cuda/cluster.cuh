#pragma once
// Thread-block clusters (sm_90 and newer): the blocks of a cluster run at the same time on
// neighbouring multiprocessors, can wait for each other (cluster_sync) and read each other's
// shared memory (distributed shared memory, cluster_peer). The LayerNorm kernels use them to
// keep a row too long for one block on chip across the blocks of a cluster, so that it is
// read from memory once. Also compiled by tests/emulation (FUSEDNORM_EMULATION), whose
// emulator runs a cluster's blocks on concurrent host threads.

#include <c10/cuda/CUDAException.h>
#include <cuda_runtime.h>

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

// Launches kernel with clusters of `cluster` blocks.
template <typename... Params, typename... Args>
void launch_cluster_kernel(void (*kernel)(Params...), dim3 grid, dim3 block, dim3 cluster,
                           cudaStream_t stream, Args&&... args) {
#ifdef FUSEDNORM_EMULATION
  ::emu::launch_cluster(kernel, grid, block, cluster, stream, std::forward<Args>(args)...);
#else
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = 0;
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

// Whether `kernel` may be launched in clusters of `blocks` blocks of `threads` on the
// device: the device supports cluster launches, the kernel's code was compiled for sm_90 or
// newer (not JIT-compiled from older PTX, whose cluster helpers trap), and such a cluster
// fits the device. Cached per device and cluster size in `cache` (0 unknown, 1 yes, 2 no).
template <typename Kernel>
bool cluster_launch_ok(Kernel kernel, int threads, int blocks, int device,
                       std::atomic<int> (*cache)[kMaxClusterBlocks + 1]) {
#ifdef FUSEDNORM_EMULATION
  (void)kernel, (void)threads, (void)device, (void)cache;
  return blocks >= 2 && blocks <= kMaxClusterBlocks && ::emu::config().clusters;
#else
  constexpr int kCachedDevices = 64;
  if (blocks < 2 || blocks > kMaxClusterBlocks || device < 0 || device >= kCachedDevices) {
    return false;
  }
  const int known = cache[device][blocks].load(std::memory_order_relaxed);
  if (known != 0) return known == 1;
  int supported = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&supported, cudaDevAttrClusterLaunch, device));
  bool ok = supported != 0;
  if (ok) {
    cudaFuncAttributes attributes{};
    C10_CUDA_CHECK(cudaFuncGetAttributes(&attributes, kernel));
    ok = attributes.ptxVersion >= 90;
  }
  if (ok) {
    cudaLaunchConfig_t config = {};
    config.gridDim = dim3(1, blocks);
    config.blockDim = dim3(threads);
    cudaLaunchAttribute attribute[1];
    attribute[0].id = cudaLaunchAttributeClusterDimension;
    attribute[0].val.clusterDim.x = 1;
    attribute[0].val.clusterDim.y = blocks;
    attribute[0].val.clusterDim.z = 1;
    config.attrs = attribute;
    config.numAttrs = 1;
    int clusters = 0;
    ok = cudaOccupancyMaxActiveClusters(&clusters, kernel, &config) == cudaSuccess && clusters > 0;
    (void)cudaGetLastError();  // a refused query leaves no error behind
  }
  cache[device][blocks].store(ok ? 1 : 2, std::memory_order_relaxed);
  return ok;
#endif
}

}  // namespace fusednorm::cuda
