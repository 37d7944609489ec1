// The column-sparse forward's input preparation in one launch (issue #5; csrc/NOTES.md
// "Column-sparse forward (issue #5)", "One gather launch"): the listed K / V rows of every query
// head gathered into contiguous buffers, and the block-sparse kernel's plan for them. Plain CUDA,
// no CuTe, no torch: the binding is bindings/column_gather_sm90.cu.
//
// Notation. B batch, H query heads, Hkv kv heads (G = H / Hkv; query head h reads kv head h / G),
// Sk keys, K list slots (kv_indices.shape[-1]), R bytes per row (D * element size; the kernel moves
// bytes, so one instantiation serves every dtype and head dim), V the vector width in bytes (16 when
// the bases and strides allow it, else 8 / 4 / 2), nQb query blocks, bk the kernel's key block.
//
// What it writes, for every (b, h) with c = clamp(counts[b, h], 0, K):
//   kg[b, j, h, :] = k[b, row(j), h / G, :] and vg likewise, j in [0, K), where row(j) =
//     idx[b, h, j] for j < c, else idx[b, h, 0] (c > 0) or 0 (c = 0): the slots past a count are
//     masked by the attention kernel but must be finite (0 * inf is NaN in P V), so they repeat a
//     row the result reads anyway. A row outside [0, Sk) (only with check_indices=False) reads as
//     zeros instead of past the tensor, like TMA's zero fill in the attention kernel.
//   key_len[b, h] = c; block_counts[b, h, :] = ceil(c / bk); shared_list[i] = i, i < ceil(K / bk);
//   work_order (optional): the stable longest-first order of the (b, h, qb) items by block count,
//     heads sorted and expanded over nQb (dlm_ops/backends/cutlass_sparse.py column_plan).
//
// Shape of the work. Grid (ceil(K / (P * kUnroll)), H, B); a CTA of (R / V, 2, P) threads: x the
// V-byte vector of a row, y k or v, z one of P slots in flight (P = 256 / (2 R / V), 8 slots at
// R = 256 B and V = 16: one warp per slot, lanes 0-15 the k row and 16-31 the v row). Each thread
// loads kUnroll vectors (slots j, j + P, ...) before storing any: ~64 KB in flight per SM at 8 CTAs,
// above the ~25 KB that 4.8 TB/s x ~700 ns of DRAM latency spread over 132 SMs needs. The list
// entry of a slot is one int32 load per thread (every lane of a row reads the same address: one
// transaction), issued together with the count and the first entry so the row's address waits on
// one memory latency, not three. Writes are whole rows (128 / 256 B, full sectors); reads are
// whole rows of k / v wherever their strides put them.
//
// The plan is written by the CTAs of slot chunk 0, one per (b, h). Its rank (work_order) costs
// each of those CTAs a pass over the B * H counts: B * H * B * H loads in all (L2 hits), 16 M at
// B * H = 4096; the caller passes work_order = null above that and sorts with torch instead.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

namespace dlm::sm90 {

struct ColumnGatherArgs {
  const void *k, *v;                    // (B, Sk, Hkv, R bytes), rows contiguous
  int64_t k_stride[3], v_stride[3];     // (batch, key, kv head), BYTES
  void *kg, *vg;                        // (B, K, H, R bytes), contiguous
  const int32_t* kv_indices;            // (B, H, K), contiguous
  const int32_t* kv_counts;             // (B, H), contiguous; clamped to [0, K] here
  int batch, heads, kv_heads, list_len, seqlen_k, row_bytes;
  int32_t* key_len;                     // (B, H)
  int32_t* block_counts;                // (B, H, nQb)
  int32_t* shared_list;                 // (ceil(K / block_k))
  int32_t* work_order = nullptr;        // optional: (B * H * nQb)
  int num_q_blocks, block_k;
  cudaStream_t stream;
};

namespace column_gather_detail {

constexpr int kThreads = 256;  // per CTA when a row has <= 128 vectors (every shipped case)
constexpr int kUnroll = 4;     // slots per thread, loaded before any store

__device__ __forceinline__ int clamp_count(int c, int list_len) {
  return c < 0 ? 0 : (c > list_len ? list_len : c);
}

// The plan entries of head `head` (= b * H + h), by every thread of the CTA.
__device__ void write_plan(const ColumnGatherArgs& a, int64_t head, int count) {
  const int tid = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
  const int nthreads = blockDim.x * blockDim.y * blockDim.z;
  const int bk = a.block_k, nqb = a.num_q_blocks;
  const int mine = (count + bk - 1) / bk;
  if (tid == 0) a.key_len[head] = count;
  for (int q = tid; q < nqb; q += nthreads) a.block_counts[head * nqb + q] = mine;
  if (head == 0)
    for (int i = tid; i < (a.list_len + bk - 1) / bk; i += nthreads) a.shared_list[i] = i;
  if (a.work_order == nullptr) return;
  // Stable descending rank: heads with more blocks, then heads before this one with as many.
  const int64_t heads = static_cast<int64_t>(a.batch) * a.heads;
  int before = 0;
  for (int64_t o = tid; o < heads; o += nthreads) {
    const int other = (clamp_count(a.kv_counts[o], a.list_len) + bk - 1) / bk;
    before += other > mine || (other == mine && o < head);
  }
  __shared__ int rank;
  if (tid == 0) rank = 0;
  __syncthreads();
  // A shared atomic per thread with a nonzero part, not a warp shuffle: a CTA of 2 R / V x P
  // threads need not fill its last warp (R = 144 B: 252 threads), and this runs once per head.
  if (before) atomicAdd(&rank, before);
  __syncthreads();
  const int64_t base = static_cast<int64_t>(rank) * nqb;
  for (int q = tid; q < nqb; q += nthreads)
    a.work_order[base + q] = static_cast<int32_t>(head * nqb + q);
}

template <class Vec>
__global__ void __launch_bounds__(1024) column_gather_kernel(const ColumnGatherArgs a) {
  const int h = blockIdx.y, b = blockIdx.z;
  const int64_t head = static_cast<int64_t>(b) * a.heads + h;
  const int32_t* list = a.kv_indices + head * a.list_len;
  // Three independent loads; the row of a slot needs all three, so they go out together.
  const int raw_count = a.kv_counts[head];
  const int first_entry = list[0];  // K >= 1 (the binding checks)
  const int per_pass = blockDim.z;
  const int64_t slot0 = static_cast<int64_t>(blockIdx.x) * per_pass * kUnroll + threadIdx.z;
  int entry[kUnroll];
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    const int64_t j = slot0 + u * per_pass;
    entry[u] = j < a.list_len ? list[j] : 0;
  }
  const int count = clamp_count(raw_count, a.list_len);
  const int first = count > 0 ? first_entry : 0;

  const bool is_v = threadIdx.y == 1;
  const int kvh = h / (a.heads / a.kv_heads);
  const int64_t* st = is_v ? a.v_stride : a.k_stride;
  const char* src = static_cast<const char*>(is_v ? a.v : a.k) + b * st[0] + kvh * st[2] +
                    threadIdx.x * sizeof(Vec);
  const int64_t out_row = static_cast<int64_t>(a.heads) * a.row_bytes;  // bytes per slot
  char* dst = static_cast<char*>(is_v ? a.vg : a.kg) +
              static_cast<int64_t>(b) * a.list_len * out_row + h * int64_t(a.row_bytes) +
              threadIdx.x * sizeof(Vec);
  Vec data[kUnroll];
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    const int64_t j = slot0 + u * per_pass;
    const int row = j < count ? entry[u] : first;
    data[u] = Vec{};  // a row outside [0, Sk): zeros
    if (j < a.list_len && static_cast<unsigned>(row) < static_cast<unsigned>(a.seqlen_k))
      data[u] = __ldg(reinterpret_cast<const Vec*>(src + row * st[1]));
  }
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    const int64_t j = slot0 + u * per_pass;
    if (j < a.list_len) *reinterpret_cast<Vec*>(dst + j * out_row) = data[u];
  }
  if (blockIdx.x == 0) write_plan(a, head, count);
}

template <class Vec>
cudaError_t launch_with(const ColumnGatherArgs& a) {
  const int row_vecs = a.row_bytes / static_cast<int>(sizeof(Vec));
  // blockDim.z <= 64: rows of one vector (R = 16 B) run 128 threads.
  const int per_pass = 2 * row_vecs >= kThreads ? 1 : std::min(64, kThreads / (2 * row_vecs));
  const int64_t chunks = (a.list_len + int64_t(per_pass) * kUnroll - 1) / (int64_t(per_pass) * kUnroll);
  const dim3 grid(static_cast<unsigned>(chunks), a.heads, a.batch), block(row_vecs, 2, per_pass);
  column_gather_kernel<Vec><<<grid, block, 0, a.stream>>>(a);
  return cudaGetLastError();
}

}  // namespace column_gather_detail

// The widest vector (16, 8, 4 or 2 bytes) that divides the row, both bases and every stride of
// k and v (kg / vg are the caller's fresh contiguous buffers: their bases are checked too), or 0.
inline int column_gather_vector_bytes(const ColumnGatherArgs& a) {
  for (int w = 16; w >= 2; w /= 2) {
    bool ok = a.row_bytes % w == 0 && a.row_bytes / w <= 512;  // 2 x R / V threads <= 1024
    for (const void* p : {a.k, a.v, static_cast<const void*>(a.kg), static_cast<const void*>(a.vg)})
      ok = ok && reinterpret_cast<uintptr_t>(p) % w == 0;
    for (int i = 0; i < 3; ++i) ok = ok && a.k_stride[i] % w == 0 && a.v_stride[i] % w == 0;
    if (ok) return w;
  }
  return 0;
}

// Host: one launch, no sync. cudaErrorInvalidValue for arguments the kernel cannot take (the
// binding checks them first, with messages).
inline cudaError_t launch_column_gather(const ColumnGatherArgs& a) {
  using namespace column_gather_detail;
  if (a.list_len < 1 || a.batch < 1 || a.heads < 1 || a.kv_heads < 1 || a.heads % a.kv_heads ||
      a.block_k < 1 || a.num_q_blocks < 0 || a.batch > 65535 || a.heads > 65535)
    return cudaErrorInvalidValue;
  switch (column_gather_vector_bytes(a)) {
    case 16: return launch_with<uint4>(a);
    case 8: return launch_with<uint2>(a);
    case 4: return launch_with<unsigned>(a);
    case 2: return launch_with<unsigned short>(a);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace dlm::sm90
