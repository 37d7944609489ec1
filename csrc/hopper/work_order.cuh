// The block-sparse forward's work order on the device in one small launch: the (B * H * nQb) items
// sorted by their key block counts, longest list first, ties in item order (what a stable
// descending sort gives). It replaces torch.argsort(stable, descending) + a cast to int32, 22 us
// of GPU time per call at 4096 items (S = 16K, H = 32; 41 us at 16K items) where the 16K / 10 %
// forward takes ~800 us: issue #5's goal missed that point by about as much (csrc/NOTES.md
// "Session 17").
//
// One CTA of kWorkOrderThreads threads (the items are few: 4096 at S = 16K, 16K at 64K):
//   - every count the same (top-k selection gives that): the order is the identity;
//   - otherwise a stable LSD radix sort of the items by bin = max_count - count (counts clamped
//     to [0, max_count], so an unchecked count cannot send a write out of bounds), one bit per
//     pass, as many passes as max_count has bits: each thread splits its own contiguous run of
//     the current order into zeros and ones, a block-wide scan of the zero counts places them, a
//     stable split. Keys (bin << 15 | item) ping-pong between two shared-memory arrays.
// A bitonic sort measured 30 us at 4096 random counts (78 passes of the whole array, one barrier
// each), slower than torch's argsort; the split needs log2(max_count) passes: 8 at S = 16K.
// Plain CUDA (no CuTe); instantiated in csrc/bindings/work_order_sm90.cu.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace dlm::sm90 {

constexpr int kWorkOrderThreads = 1024;
// The key packs the item in 15 bits and the bin in 16: more items or longer lists go to another
// sort (dlm_ops.backends.cutlass_sparse.work_order: torch.argsort). Two arrays of 2^14 keys are
// 128 KB of shared memory.
constexpr int kWorkOrderItemBits = 15;
constexpr int kWorkOrderMaxItems = 1 << 14;
constexpr int kWorkOrderMaxCount = 65535;

// The exclusive prefix sum of x over the block (every thread calls it), and the total.
__device__ inline int block_exclusive_scan(int x, int& total, int* warp_sums) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  int incl = x;
  for (int d = 1; d < 32; d *= 2) {
    const int y = __shfl_up_sync(0xffffffffu, incl, d);
    if (lane >= d) incl += y;
  }
  if (lane == 31) warp_sums[warp] = incl;
  __syncthreads();
  if (warp == 0) {
    const int w = warp_sums[lane];  // kWorkOrderThreads / 32 == 32 warps
    int wi = w;
    for (int d = 1; d < 32; d *= 2) {
      const int y = __shfl_up_sync(0xffffffffu, wi, d);
      if (lane >= d) wi += y;
    }
    warp_sums[lane] = wi - w;  // exclusive, per warp
    if (lane == 31) warp_sums[32] = wi;
  }
  __syncthreads();
  total = warp_sums[32];
  const int before = warp_sums[warp] + incl - x;
  __syncthreads();  // warp_sums is reused by the next call
  return before;
}

__global__ void __launch_bounds__(kWorkOrderThreads, 1)
    work_order_kernel(const int32_t* __restrict__ counts, int n, int max_count, int32_t* __restrict__ order) {
  static_assert(kWorkOrderThreads == 32 * 32, "block_exclusive_scan: one warp scans the warps' sums");
  extern __shared__ uint32_t keys[];  // two arrays of n keys
  __shared__ int warp_sums[33];
  const int tid = threadIdx.x;
  auto clamped = [max_count](int c) { return c < 0 ? 0 : c > max_count ? max_count : c; };
  const int first = clamped(counts[0]);
  bool same = true;
  uint32_t* cur = keys;
  uint32_t* next = keys + n;
  for (int i = tid; i < n; i += kWorkOrderThreads) {
    const int c = clamped(counts[i]);
    same &= c == first;
    cur[i] = static_cast<uint32_t>(max_count - c) << kWorkOrderItemBits | static_cast<uint32_t>(i);
  }
  if (__syncthreads_and(same)) {
    for (int i = tid; i < n; i += kWorkOrderThreads) order[i] = i;
    return;
  }
  // Thread t owns positions [lo, hi) of the current order: contiguous runs keep the split stable.
  const int per = (n + kWorkOrderThreads - 1) / kWorkOrderThreads;
  const int lo = tid * per < n ? tid * per : n, hi = lo + per < n ? lo + per : n;
  for (int bit = kWorkOrderItemBits; (max_count >> (bit - kWorkOrderItemBits)) != 0; ++bit) {
    int zeros = 0;
    for (int i = lo; i < hi; ++i) zeros += !(cur[i] >> bit & 1u);
    int all_zeros;
    int zero_at = block_exclusive_scan(zeros, all_zeros, warp_sums);
    int one_at = all_zeros + (lo - zero_at);  // the ones before this run: lo - zeros before it
    for (int i = lo; i < hi; ++i) {
      const uint32_t key = cur[i];
      next[key >> bit & 1u ? one_at++ : zero_at++] = key;
    }
    __syncthreads();
    uint32_t* t = cur;
    cur = next;
    next = t;
  }
  for (int i = tid; i < n; i += kWorkOrderThreads)
    order[i] = static_cast<int32_t>(cur[i] & ((1u << kWorkOrderItemBits) - 1u));
}

// counts (n) int32, values meant to lie in [0, max_count]; order (n) int32. Preconditions (the
// binding checks them): 0 < n <= kWorkOrderMaxItems, 0 <= max_count <= kWorkOrderMaxCount.
inline cudaError_t launch_work_order(const int32_t* counts, int n, int max_count, int32_t* order,
                                     cudaStream_t stream) {
  if (n <= 0 || n > kWorkOrderMaxItems || max_count < 0 || max_count > kWorkOrderMaxCount)
    return cudaErrorInvalidValue;
  static const cudaError_t configured = cudaFuncSetAttribute(
      work_order_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 2 * kWorkOrderMaxItems * 4);
  if (configured != cudaSuccess) return configured;
  work_order_kernel<<<1, kWorkOrderThreads, 2 * n * sizeof(uint32_t), stream>>>(counts, n, max_count, order);
  return cudaGetLastError();
}

}  // namespace dlm::sm90
