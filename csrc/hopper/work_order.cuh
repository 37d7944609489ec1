// The block-sparse forward's work order on the device in one small launch: the (B * H * nQb) items
// sorted by their key block counts, longest list first, ties in item order (what a stable
// descending sort gives). It replaces torch.argsort(stable, descending) + a cast to int32, ~42 us
// of GPU time per call at 4096 items (S = 16K, H = 32) where the 16K / 10 % forward takes ~800 us:
// issue #5's goal missed that point by about as much (csrc/NOTES.md "Session 17").
//
// One CTA of kWorkOrderThreads threads (the items are few: 4096 at S = 16K, 16K at 64K):
//   - every count the same (top-k selection gives that): the order is the identity;
//   - otherwise a bitonic sort of one 32-bit key per item in shared memory, key = (max_count -
//     count) << 15 | item (counts clamped to [0, max_count], so an unchecked count cannot send a
//     write out of bounds): keys are distinct, so the ascending order is longest first with ties
//     in item order, as a stable sort. log2(P) (log2(P) + 1) / 2 passes over P = n rounded up to a
//     power of two, one barrier each: 78 at 4096 items.
// Plain CUDA (no CuTe); instantiated in csrc/bindings/work_order_sm90.cu.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace dlm::sm90 {

constexpr int kWorkOrderThreads = 1024;
// The key packs the item in 15 bits and the count's complement in 16: more items or longer lists
// go to another sort (dlm_ops.backends.cutlass_sparse.work_order: torch.argsort). 2^15 keys are
// 128 KB of shared memory.
constexpr int kWorkOrderItemBits = 15;
constexpr int kWorkOrderMaxItems = 1 << kWorkOrderItemBits;
constexpr int kWorkOrderMaxCount = 65535;

__global__ void __launch_bounds__(kWorkOrderThreads, 1)
    work_order_kernel(const int32_t* __restrict__ counts, int n, int padded, int max_count,
                      int32_t* __restrict__ order) {
  extern __shared__ uint32_t keys[];  // padded (a power of two >= n) keys
  const int tid = threadIdx.x;
  auto clamped = [max_count](int c) { return c < 0 ? 0 : c > max_count ? max_count : c; };
  const int first = clamped(counts[0]);
  bool same = true;
  for (int i = tid; i < n; i += kWorkOrderThreads) {
    const int c = clamped(counts[i]);
    same &= c == first;
    keys[i] = static_cast<uint32_t>(max_count - c) << kWorkOrderItemBits | static_cast<uint32_t>(i);
  }
  for (int i = n + tid; i < padded; i += kWorkOrderThreads) keys[i] = 0xffffffffu;  // sort last
  if (__syncthreads_and(same)) {
    for (int i = tid; i < n; i += kWorkOrderThreads) order[i] = i;
    return;
  }
  for (int k = 2; k <= padded; k *= 2) {
    for (int j = k / 2; j > 0; j /= 2) {
      for (int t = tid; t < padded / 2; t += kWorkOrderThreads) {
        const int i = 2 * t - (t & (j - 1)), l = i + j;  // the pair (i, i + j), bit j of i clear
        const uint32_t a = keys[i], b = keys[l];
        if ((a > b) == ((i & k) == 0)) {  // ascending runs where bit k of i is clear
          keys[i] = b;
          keys[l] = a;
        }
      }
      __syncthreads();
    }
  }
  for (int i = tid; i < n; i += kWorkOrderThreads)
    order[i] = static_cast<int32_t>(keys[i] & ((1u << kWorkOrderItemBits) - 1u));
}

// counts (n) int32, values meant to lie in [0, max_count]; order (n) int32. Preconditions (the
// binding checks them): 0 < n <= kWorkOrderMaxItems, 0 <= max_count <= kWorkOrderMaxCount.
inline cudaError_t launch_work_order(const int32_t* counts, int n, int max_count, int32_t* order,
                                     cudaStream_t stream) {
  if (n <= 0 || n > kWorkOrderMaxItems || max_count < 0 || max_count > kWorkOrderMaxCount)
    return cudaErrorInvalidValue;
  static const cudaError_t configured = cudaFuncSetAttribute(
      work_order_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kWorkOrderMaxItems * 4);
  if (configured != cudaSuccess) return configured;
  int padded = 1;
  while (padded < n) padded *= 2;
  work_order_kernel<<<1, kWorkOrderThreads, padded * sizeof(uint32_t), stream>>>(counts, n, padded,
                                                                                  max_count, order);
  return cudaGetLastError();
}

}  // namespace dlm::sm90
