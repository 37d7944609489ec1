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
//     pass, as many passes as max_count has bits (8 at S = 16K): each warp splits its own
//     contiguous run of the current order into zeros and ones (ballots rank the lanes), a scan
//     of the warps' zero counts places them. Keys (bin << 15 | item) ping-pong between two
//     shared-memory arrays.
// Measured against torch (H200, CUDA graphs): a bitonic sort took 30 us at 4096 random counts (78
// passes, one barrier each), slower than argsort's 24; the split with a contiguous run per THREAD
// 13 us at 4096 but 105 us at 16K items (a run per thread reads shared memory with a stride: bank
// conflicts), hence a run per warp.
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

__global__ void __launch_bounds__(kWorkOrderThreads, 1)
    work_order_kernel(const int32_t* __restrict__ counts, int n, int max_count, int32_t* __restrict__ order) {
  constexpr int kWarps = kWorkOrderThreads / 32;
  static_assert(kWarps == 32, "one warp scans the warps' zero counts");
  extern __shared__ uint32_t keys[];  // two arrays of n keys
  __shared__ int zeros_before[kWarps + 1];
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const unsigned below = (1u << lane) - 1u;  // the lanes before this one
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
  // Warp w owns positions [lo, hi) of the current order (a contiguous run keeps the split
  // stable), read 32 consecutive keys at a time (no bank conflict); ballots rank the lanes.
  const int per = (n + kWarps - 1) / kWarps;
  const int lo = warp * per < n ? warp * per : n, hi = lo + per < n ? lo + per : n;
  for (int bit = kWorkOrderItemBits; (max_count >> (bit - kWorkOrderItemBits)) != 0; ++bit) {
    int zeros = 0;
    for (int base = lo; base < hi; base += 32) {
      const bool zero = base + lane < hi && !(cur[base + lane] >> bit & 1u);
      zeros += __popc(__ballot_sync(0xffffffffu, zero));
    }
    if (lane == 0) zeros_before[warp] = zeros;
    __syncthreads();
    if (warp == 0) {  // exclusive scan of the 32 warps' zero counts, and the total
      const int z = zeros_before[lane];
      int incl = z;
      for (int d = 1; d < 32; d *= 2) {
        const int y = __shfl_up_sync(0xffffffffu, incl, d);
        if (lane >= d) incl += y;
      }
      zeros_before[lane] = incl - z;
      if (lane == 31) zeros_before[kWarps] = incl;
    }
    __syncthreads();
    int zero_at = zeros_before[warp];
    int one_at = zeros_before[kWarps] + (lo - zero_at);  // the ones before this run
    for (int base = lo; base < hi; base += 32) {
      const bool valid = base + lane < hi;
      const uint32_t key = valid ? cur[base + lane] : 0u;
      const bool one = key >> bit & 1u;
      const unsigned zero_lanes = __ballot_sync(0xffffffffu, valid && !one);
      const unsigned one_lanes = __ballot_sync(0xffffffffu, valid && one);
      if (valid) next[one ? one_at + __popc(one_lanes & below) : zero_at + __popc(zero_lanes & below)] = key;
      zero_at += __popc(zero_lanes);
      one_at += __popc(one_lanes);
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
