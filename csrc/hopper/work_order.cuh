// The block-sparse forward's work order on the device in one small launch: the (B * H * nQb) items
// sorted by their key block counts, longest list first, ties in item order (a stable descending
// counting sort). It replaces torch.argsort(stable, descending) + a cast to int32, which cost
// ~21 us + ~2 us of GPU time at 4096 items (S = 16K, H = 32): 2-3 % of the 16K / 10 % forward
// that issue #5's goal still misses (csrc/NOTES.md "Session 17").
//
// One CTA of kThreads threads (the items are few: B * H * nQb, 4096 at 16K, 16K at 64K):
//   1. a histogram of the counts (clamped to [0, max_count]: an unchecked count cannot send a
//      write out of bounds) in shared memory;
//   2. each bin's first slot, bins taken from the largest count down (an exclusive scan);
//   3. every item's slot: when one bin holds every item (uniform counts, what top-k selection
//      gives) the order is the identity, written by all threads; otherwise warp 0 walks the items
//      32 at a time in item order (their bins staged in shared memory by all threads), lanes with
//      equal counts ranked by __match_any_sync, so ties keep their order: 128 steps at 4096 items.
// Plain CUDA (no CuTe); instantiated in csrc/bindings/work_order_sm90.cu.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace dlm::sm90 {

constexpr int kWorkOrderThreads = 1024;
// Bins in shared memory: counts up to kWorkOrderMaxCount (max_blocks = ceil(Sk / 128) reaches it
// at Sk = 512K); above it, or above kWorkOrderMaxItems items, the caller sorts another way
// (dlm_ops.backends.cutlass_sparse.work_order: torch.argsort).
constexpr int kWorkOrderMaxCount = 4095;
constexpr int kWorkOrderMaxItems = 1 << 18;
constexpr int kWorkOrderChunk = 8192;  // items ranked per pass of step 3 (16 KB of bins)

__global__ void __launch_bounds__(kWorkOrderThreads, 1)
    work_order_kernel(const int32_t* __restrict__ counts, int n, int max_count, int32_t* __restrict__ order) {
  constexpr int kBins = kWorkOrderMaxCount + 1, kPerThread = kBins / kWorkOrderThreads;
  static_assert(kBins % kWorkOrderThreads == 0, "the scan gives each thread whole bins");
  __shared__ int start[kBins];  // the histogram, then each bin's next free slot
  __shared__ int warp_sums[kWorkOrderThreads / 32];
  __shared__ int nonzero_bins;
  __shared__ uint16_t bins[kWorkOrderChunk];  // a chunk of items' bins (step 3)
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  auto bin_of = [max_count](int c) {  // bin 0 holds the largest count: descending order
    return max_count - (c < 0 ? 0 : c > max_count ? max_count : c);
  };
  for (int b = tid; b < kBins; b += kWorkOrderThreads) start[b] = 0;
  if (tid == 0) nonzero_bins = 0;
  __syncthreads();
  for (int i = tid; i < n; i += kWorkOrderThreads) atomicAdd(&start[bin_of(counts[i])], 1);
  __syncthreads();

  // Exclusive scan over the bins: thread t owns bins [t * kPerThread, (t + 1) * kPerThread).
  int own[kPerThread], total = 0, used = 0;
  for (int j = 0; j < kPerThread; ++j) {
    own[j] = start[tid * kPerThread + j];
    total += own[j];
    used += own[j] != 0;
  }
  int incl = total;  // inclusive scan of the threads' totals: within the warp, then over warps
  for (int d = 1; d < 32; d *= 2) {
    const int x = __shfl_up_sync(0xffffffffu, incl, d);
    if (lane >= d) incl += x;
  }
  if (lane == 31) warp_sums[warp] = incl;
  if (used) atomicAdd(&nonzero_bins, used);
  __syncthreads();
  int before = incl - total;
  for (int w = 0; w < warp; ++w) before += warp_sums[w];
  for (int j = 0; j < kPerThread; ++j) {
    start[tid * kPerThread + j] = before;
    before += own[j];
  }
  __syncthreads();

  if (nonzero_bins <= 1) {  // every item has the same count: the order is the identity
    for (int i = tid; i < n; i += kWorkOrderThreads) order[i] = i;
    return;
  }
  // The ranking, chunk by chunk: all threads stage the chunk's bins in shared memory (warp 0
  // alone would wait on a global load per step), then warp 0 walks it.
  for (int chunk = 0; chunk < n; chunk += kWorkOrderChunk) {
    const int len = n - chunk < kWorkOrderChunk ? n - chunk : kWorkOrderChunk;
    __syncthreads();  // warp 0 is done with the previous chunk
    for (int i = tid; i < len; i += kWorkOrderThreads) bins[i] = static_cast<uint16_t>(bin_of(counts[chunk + i]));
    __syncthreads();
    if (warp != 0) continue;
    for (int base = 0; base < len; base += 32) {
      const int i = base + lane;
      const unsigned valid = __ballot_sync(0xffffffffu, i < len);
      if (i < len) {
        const int b = bins[i];
        const unsigned peers = __match_any_sync(valid, b);
        const int rank = __popc(peers & ((1u << lane) - 1u));
        const int slot = start[b];
        __syncwarp(valid);
        if (rank == 0) start[b] = slot + __popc(peers);
        order[slot + rank] = chunk + i;
      }
      __syncwarp();
    }
  }
}

// counts (n) int32, values meant to lie in [0, max_count]; order (n) int32. Preconditions (the
// binding checks them): 0 < n <= kWorkOrderMaxItems, 0 <= max_count <= kWorkOrderMaxCount.
inline cudaError_t launch_work_order(const int32_t* counts, int n, int max_count, int32_t* order,
                                     cudaStream_t stream) {
  if (n <= 0 || n > kWorkOrderMaxItems || max_count < 0 || max_count > kWorkOrderMaxCount)
    return cudaErrorInvalidValue;
  work_order_kernel<<<1, kWorkOrderThreads, 0, stream>>>(counts, n, max_count, order);
  return cudaGetLastError();
}

}  // namespace dlm::sm90
