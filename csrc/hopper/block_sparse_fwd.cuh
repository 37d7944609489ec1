// Block-sparse attention forward for Hopper (sm_90a): the v5 diffusion forward's loop (producer
// warpgroup + two consumer warpgroups, FA3 in-warpgroup overlap, ping-pong) over a LIST of key
// blocks per query block instead of the mask geometry's runs (issue #5; csrc/NOTES.md
// "Block-sparse forward (issue #5)").
//
// The op (dlm_ops block_sparse_attn): q (B, Sq, H, D), k / v (B, Sk, Hkv, D); query block qb of
// (b, h) attends exactly to key blocks kv_block_indices[b, h, qb, :kv_block_counts[b, h, qb]]
// (ascending, valid: the op validates); an empty list gives out 0 and lse -inf.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace dlm::sm90 {

// Plain arguments (no torch): the binding fills this, each (dtype, head dim) instantiation lives in
// its own translation unit (csrc/hopper/block_sparse_fwd_*.cu).
struct SparseFwdArgs {
  const void *q, *k, *v;
  void* o;
  float* lse;
  int64_t q_stride[3], k_stride[3], v_stride[3], o_stride[3];  // (batch, seq, head), elements; D contiguous
  int64_t lse_stride[2];                                       // (batch, head); lse (B, H, Sq) fp32
  int batch, seqlen_q, seqlen_k, heads, kv_heads;
  int block_q, block_k;                 // selection block sizes (this kernel: both == 128)
  const int32_t* kv_block_indices;      // (B, H, nQb, max_blocks), contiguous
  const int32_t* kv_block_counts;       // (B, H, nQb), contiguous
  int num_q_blocks, max_blocks;
  float scale;                          // softmax scale (natural), the kernel folds log2 e
  const int32_t* work_order = nullptr;  // optional: (B*H*nQb) work items, longest list first; null = natural order
  cudaStream_t stream;
};

template <class Elem, int D>
cudaError_t launch_block_sparse_fwd(const SparseFwdArgs&);

// Host: what this kernel covers (the binding falls back to Triton otherwise).
inline bool block_sparse_fwd_supports(int block_q, int block_k, int d) {
  return block_q == 128 && block_k == 128 && (d == 64 || d == 128);
}

}  // namespace dlm::sm90
