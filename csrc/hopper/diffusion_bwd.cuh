// Block-diffusion attention backward for Hopper (sm_90a), written with CuTe from the nvidia-cutlass
// wheel: three kernels, in this order on one stream.
//
//   preprocess  one pass over O and dO: delta = rowsum(dO * O) - dlse and lse2 = lse * log2 e,
//               fp32, (B, H, S) contiguous scratch (plain CUDA, memory bound).
//   dK/dV       one CTA per (batch, kv head, key tile of BN = 128 keys), or (DkDvPersistent, D = 64 at
//               every length, D = 128 for halves up to the Python backend's PERSISTENT_DKDV_MAX_HALF)
//               one per SM walking those items with two K / V buffers and a TMA-store epilogue
//               (DkDvConfig PERSISTENT_ / TMA_STORE_). Warpgroup 0 produces: one
//               thread loads K and V once, then for each query head of the kv head's group and
//               each query tile of BM = 64 rows (128 at D = 64: bwd_block_m) that sees the key
//               tile (dlm/geometry.h bwd_tiles: at most two runs) it issues TMA copies of Q and
//               dO plus bulk copies of that tile's lse2 and delta into a ring of STAGES buffers.
//               Warpgroups 1 and 2 consume, each
//               owning 64 of the 128 keys, in the transposed form (keys are the wgmma M side):
//                 S^T = K Q^T, dP^T = V dO^T      (wgmma, both operands from shared memory)
//                 P^T = exp2(S^T * scale log2 e - lse2)   (element mask only on PARTIAL tiles)
//                 dS^T = P^T (dP^T - delta)
//                 dV += P^T dO, dK += dS^T Q      (wgmma, P^T / dS^T from registers, dO^T / Q^T
//                                                  read MN-major from shared memory)
//               dK and dV stay in registers over the whole walk, so the GQA sum over the group's
//               query heads is a loop inside the CTA: deterministic, no partials, no atomics.
//   dQ          one CTA per (batch, head, query tile of 128 rows) over the key tiles it sees
//               (fwd_tiles), the forward's shape: Q and dO loaded once, K and V per visit,
//                 S = Q K^T, dP = dO V^T, P = exp2(S * scale log2 e - lse2), dS = P (dP - delta),
//                 dQ += dS K.
//               Three matmuls per tile pair on top of the dK/dV kernel's four (a fused dQ with
//               fp32 atomics would need five in all): csrc/NOTES.md "Backward" gives the numbers
//               behind that choice. Every output element is written by one CTA, in one order, so
//               the whole backward is bitwise deterministic. The fused variant (dK/dV/dQ in one
//               kernel, FUSED_DQ_ below) exists for the harness: it measured slower.
//
// Coverage as the forward's (dlm_ops/backends/cutlass_diffusion.py checks): halves of any length
// and packed samples (the START_ option of both configs, hopper/common.cuh: launch_bwd<Elem, D>
// runs kBatchedStart, launch_bwd<Elem, D, kStartVarlen> packed samples), head dim 64, 128 or 256
// (at 256 the consumers split the gradients, not the keys: DkDvConfig kRoles, DqConfig
// kSplitKeys), bf16/fp16, no softcap; any [n_noisy | n_clean] SequenceMask (BD3, or block-causal
// with n_noisy 0).
//
// Notation as in templates/diffusion_attn.py: logits in base 2, lse in natural log on the outside,
// scale the softmax scale (dS is the gradient of the scaled logits, hence the final * scale).
//
// Files: bwd_parts.cuh (configurations, parameters, stores, preprocess), bwd_dkdv.cuh and
// bwd_dq.cuh (the two matmul kernels), this file (the launchers and the shipped configs).
#pragma once

#include "hopper/bwd_dkdv.cuh"
#include "hopper/bwd_dq.cuh"
#include "hopper/bwd_dq_from_ds.cuh"

namespace dlm::sm90 {

// ------------------------------------------------------------------------------------- launch
// Plain arguments (no torch), like FwdArgs: one (dtype, head dim) instantiation per translation
// unit (csrc/hopper/diffusion_bwd_*.cu); the torch binding only fills BwdArgs.
struct BwdArgs {
  const void *q, *k, *v, *o, *dout;
  void *dq, *dk, *dv;
  const float *lse, *dlse;  // dlse may be null
  float *lse2, *delta;      // scratch, (B, H, S) contiguous fp32 each
  int64_t q_stride[3], k_stride[3], v_stride[3], o_stride[3], do_stride[3];  // (batch, seq, head)
  int64_t dq_stride[3], dk_stride[3], dv_stride[3];
  int64_t lse_stride[2], dlse_stride[2];  // (batch, head)
  int batch, seqlen, heads, kv_heads, n_noisy, block_size;  // mask: [n_noisy | seqlen - n_noisy]
  float scale;
  const int32_t* dkdv_order;  // key tiles of bwd_tiles(bwd_block_m(D), bwd_block_n(D)), most expensive first
  int dkdv_tiles;
  const int32_t* dq_order;    // query tiles of fwd_tiles(dq_block_m(D), dq_block_n(D)), most expensive first
  int dq_tiles;
  cudaStream_t stream;
  int order_chunk = 0, order_block = 0;  // work_order's arguments (0, 0: the plain order); the harness's A/B sets them
  // kStartVarlen configs only (batch 1, seqlen = packed tokens): the sample of each entry of
  // dkdv_order / dq_order, and the samples' offsets (csrc/NOTES.md "Odd lengths and varlen"). The
  // odd-length / varlen dK/dV kernel also reads up to kVarlenScratchPad floats past the lse2 /
  // delta scratch, which the preprocess zeroes (so the scratch holds that many more).
  const int32_t *dkdv_sample = nullptr, *dq_sample = nullptr, *cu_seqlens = nullptr;
  // launch_bwd: run the persistent dK/dV kernel (DkDvPersistent) where the head dim has one
  // (dkdv_persistent_supports); the caller decides by the head dim and the halves' lengths (the
  // Python backend: PERSISTENT_DKDV_*).
  bool persistent_dkdv = false;
  // launch_bwd_fused only (D = 128): dQ computed by the dK/dV kernel and reduce-added into this
  // (B, S, H, D) contiguous fp32 scratch, then scaled into dq; dq_order / dq_tiles unused.
  float* dq_accum = nullptr;
  // The backward with dS through HBM (hopper/bwd_dq_from_ds.cuh; launch_bwd takes it where
  // ds_scratch is set): the scratch of 1 + B * H * ds_visits blocks of ds_block_elems(D) and the
  // slot table (launch_bwd_ds says what it holds) on the device; dq_order / dq_tiles then list the
  // query tiles of fwd_tiles(kDsDqBlockM, ds_dq_block_n(D)).
  void* ds_scratch = nullptr;
  const int32_t* ds_slots = nullptr;
  int ds_visits = 0;
  // The slot table's width (key tiles per row); 0: ceil(seqlen / key tile), the batched table's.
  // kStartVarlen: ds_rows[i], sample i's first row of the table (its own rows, its own key tiles).
  int ds_k_tiles = 0;
  const int32_t* ds_rows = nullptr;
  // Optional (device): the persistent dK/dV kernel's balanced schedule (dlm/geometry.h
  // balanced_schedule) for exactly min(SM count, items) CTAs; null: the snake walk. The other
  // kernels ignore it.
  const int32_t* dkdv_schedule = nullptr;
  // Optional (device): the persistent dQ-from-dS kernel's balanced schedule over its walk
  // (ds_dq_work_order; dlm/geometry.h order_schedule with kDsDqScheduleTailRounds, or
  // entry_schedule for packed samples) for exactly min(SM count, items) CTAs; null: the snake.
  const int32_t* dq_schedule = nullptr;
  // launch_bwd_ds only: the dK/dV kernel's work_order arguments (0, 0: the plain order; the
  // balanced schedule, if given, must be built over the same walk).
  int dkdv_order_chunk = 0, dkdv_order_block = 0;
  // launch_dkdv / launch_dq / launch_dq_from_ds: launched as programmatic dependents of the kernel
  // before them in the stream (common.cuh launch_kernel), which in launch_bwd / launch_bwd_ds is the
  // preprocess or the dK/dV kernel: each one's launch and set-up overlap the end of the one before.
  // The kernels wait for it before they touch its outputs, so this is a speed setting only (false:
  // plain launches, the harness's A/B arm).
  bool dependent_launch = true;
};

// A persistent grid: at most one CTA per SM of the current device.
inline cudaError_t cap_at_sm_count(int& ctas) {
  int device = 0, sms = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (err == cudaSuccess && sms < ctas) ctas = sms;
  return err;
}

template <class Kernel>
cudaError_t set_smem(Kernel kernel, int smem) {
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
}

// The preprocess (lse2, delta), which also zeroes lse2 / delta's kVarlenScratchPad floats past
// B * H * S and `zero_bytes` (a multiple of 16) at `zero`.
template <class Elem, int D>
cudaError_t launch_preprocess(const BwdArgs& a, void* zero = nullptr, int64_t zero_bytes = 0) {
  PreParams<Elem> p{static_cast<const Elem*>(a.o), static_cast<const Elem*>(a.dout), a.lse, a.dlse,
                    a.lse2, a.delta, {a.o_stride[0], a.o_stride[1], a.o_stride[2]},
                    {a.do_stride[0], a.do_stride[1], a.do_stride[2]},
                    {a.lse_stride[0], a.lse_stride[1]}, {a.dlse_stride[0], a.dlse_stride[1]},
                    a.batch, a.seqlen, a.heads, kVarlenScratchPad, static_cast<uint4*>(zero),
                    static_cast<int>(zero_bytes / 16)};
  const dim3 grid((a.seqlen + kPreRows<D> - 1) / kPreRows<D>, a.heads, a.batch < 65535 ? a.batch : 65535);
  bwd_preprocess_kernel<Elem, D><<<grid, kPreThreads, 0, a.stream>>>(p);
  return cudaGetLastError();
}

template <class Cfg>
cudaError_t launch_dkdv(const BwdArgs& a) {
  using Elem = typename Cfg::Elem;
  constexpr int D = Cfg::D;
  auto ptr = [](const void* x) { return static_cast<const Elem*>(x); };
  DkDvParams<Cfg> p{
      make_tma_rows<Elem, Cfg::BM, D>(ptr(a.q), a.seqlen, a.heads, a.batch, a.q_stride[1], a.q_stride[2], a.q_stride[0]),
      make_tma_rows<Elem, Cfg::BM, D>(ptr(a.dout), a.seqlen, a.heads, a.batch, a.do_stride[1], a.do_stride[2], a.do_stride[0]),
      make_tma_rows<Elem, Cfg::BN, D>(ptr(a.k), a.seqlen, a.kv_heads, a.batch, a.k_stride[1], a.k_stride[2], a.k_stride[0]),
      make_tma_rows<Elem, Cfg::BN, D>(ptr(a.v), a.seqlen, a.kv_heads, a.batch, a.v_stride[1], a.v_stride[2], a.v_stride[0]),
      a.lse2, a.delta, static_cast<Elem*>(a.dk), static_cast<Elem*>(a.dv),
      a.dk_stride[1], a.dk_stride[2], a.dk_stride[0], a.dv_stride[1], a.dv_stride[2], a.dv_stride[0],
      a.seqlen, a.heads, a.kv_heads, a.batch,
      SequenceMask{a.n_noisy, a.seqlen - a.n_noisy, a.block_size}, a.scale,
      a.scale * 1.4426950408889634f, a.dkdv_order, a.dkdv_sample, a.cu_seqlens, a.dkdv_tiles,
      // A (batch, kv head) slot re-reads Q and dO of the group's query heads at every key tile.
      work_order(a.batch * a.kv_heads, int64_t{2} * a.seqlen * D * sizeof(Elem) * (a.heads / a.kv_heads),
                 a.order_chunk, a.order_block)};
  if constexpr (Cfg::kTmaStore) {
    p.tma_store_a = make_tma_store_rows(static_cast<Elem*>(a.dk), a.seqlen, D, a.kv_heads, a.batch,
                                        a.dk_stride[1], a.dk_stride[2], a.dk_stride[0]);
    p.tma_store_b = make_tma_store_rows(static_cast<Elem*>(a.dv), a.seqlen, D, a.kv_heads, a.batch,
                                        a.dv_stride[1], a.dv_stride[2], a.dv_stride[0]);
  }
  if constexpr (Cfg::kStoreDs) {
    p.ds = static_cast<Elem*>(a.ds_scratch);
    p.ds_slots = a.ds_slots;
    p.ds_rows = a.ds_rows;
    p.ds_k_tiles = a.ds_k_tiles ? a.ds_k_tiles : (a.seqlen + Cfg::BN - 1) / Cfg::BN;
    p.ds_visits = a.ds_visits;
    p.tma_ds = Cfg::DsStore::make_tma(p.ds, (1 + a.batch * a.heads * a.ds_visits) * Cfg::BN);
  }
  if constexpr (Cfg::kFusedDq) {
    p.tma_dq = make_tma_copy(
        SM90_TMA_REDUCE_ADD{},
        make_tensor(make_gmem_ptr(a.dq_accum), make_shape(a.seqlen, D, a.heads, a.batch),
                    make_stride(int64_t{a.heads} * D, _1{}, int64_t{D}, int64_t{a.seqlen} * a.heads * D)),
        typename Cfg::Fused::SmemLayoutdQ{});
  }
  auto kernel = diffusion_bwd_dkdv_kernel<Cfg>;
  constexpr int smem = sizeof(DkDvShared<Cfg>);
  static const cudaError_t configured = set_smem(kernel, smem);  // once: the attribute is per function
  if (configured != cudaSuccess) return configured;
  int ctas = a.batch * a.kv_heads * a.dkdv_tiles;
  // Persistent: one CTA per SM (1 fits: 192 KB of shared memory at D = 128).
  if constexpr (Cfg::kPersistent) {
    if (const cudaError_t err = cap_at_sm_count(ctas); err != cudaSuccess) return err;
    p.schedule = a.dkdv_schedule;
  }
  return launch_kernel(kernel, ctas, Cfg::kThreads, smem, a.stream, a.dependent_launch, p);
}

// The TMA-store descriptor of dq (B, S, H, D) for the dQ kernels' TMA-store epilogues.
template <class Elem, int D>
TmaStoreRows<Elem> make_tma_store_dq(const BwdArgs& a) {
  return make_tma_store_rows(static_cast<Elem*>(a.dq), a.seqlen, D, a.heads, a.batch, a.dq_stride[1],
                             a.dq_stride[2], a.dq_stride[0]);
}

template <class Cfg>
cudaError_t launch_dq(const BwdArgs& a) {
  using Elem = typename Cfg::Elem;
  constexpr int D = Cfg::D;
  auto ptr = [](const void* x) { return static_cast<const Elem*>(x); };
  DqParams<Cfg> p{
      make_tma_rows<Elem, Cfg::BM, D>(ptr(a.q), a.seqlen, a.heads, a.batch, a.q_stride[1], a.q_stride[2], a.q_stride[0]),
      make_tma_rows<Elem, Cfg::BM, D>(ptr(a.dout), a.seqlen, a.heads, a.batch, a.do_stride[1], a.do_stride[2], a.do_stride[0]),
      make_tma_rows<Elem, Cfg::BN, D>(ptr(a.k), a.seqlen, a.kv_heads, a.batch, a.k_stride[1], a.k_stride[2], a.k_stride[0]),
      make_tma_rows<Elem, Cfg::BN, D>(ptr(a.v), a.seqlen, a.kv_heads, a.batch, a.v_stride[1], a.v_stride[2], a.v_stride[0]),
      a.lse2, a.delta, static_cast<Elem*>(a.dq), nullptr,
      a.dq_stride[1], a.dq_stride[2], a.dq_stride[0], 0, 0, 0,
      a.seqlen, a.heads, a.kv_heads, a.batch,
      SequenceMask{a.n_noisy, a.seqlen - a.n_noisy, a.block_size}, a.scale,
      a.scale * 1.4426950408889634f, a.dq_order, a.dq_sample, a.cu_seqlens, a.dq_tiles,
      // A (batch, head) slot re-reads its kv head's K and V (shared by the group: adjacent slots).
      work_order(a.batch * a.heads, int64_t{2} * a.seqlen * D * sizeof(Elem) * a.kv_heads / a.heads,
                 a.order_chunk, a.order_block)};
  if constexpr (Cfg::kTmaStore) p.tma_store_a = make_tma_store_dq<Elem, D>(a);
  auto kernel = diffusion_bwd_dq_kernel<Cfg>;
  constexpr int smem = sizeof(typename Cfg::SharedStorage);
  static const cudaError_t configured = set_smem(kernel, smem);
  if (configured != cudaSuccess) return configured;
  return launch_kernel(kernel, a.batch * a.heads * a.dq_tiles, Cfg::kThreads, smem, a.stream,
                       a.dependent_launch, p);
}

// The dQ-from-dS kernel's walk over B * H (batch, head) slots: a slot re-reads its kv head's K (shared by
// the group: adjacent slots); the dS blocks it reads are its own. launch_bwd_ds walks kDsDqOrderChunk /
// kDsDqOrderBlock's order; the bindings build its balanced schedule over the same.
inline WorkOrder ds_dq_work_order(int batch, int heads, int kv_heads, int seqlen, int d, int elem_bytes, int chunk,
                                  int block) {
  return work_order(batch * heads, int64_t{seqlen} * d * elem_bytes * kv_heads / heads, chunk, block);
}

template <class Cfg>
cudaError_t launch_dq_from_ds(const BwdArgs& a) {
  using Elem = typename Cfg::Elem;
  constexpr int D = Cfg::D;
  DqFromDsParams<Cfg> p{
      make_tma_rows<Elem, Cfg::BN, D>(static_cast<const Elem*>(a.k), a.seqlen, a.kv_heads, a.batch,
                                      a.k_stride[1], a.k_stride[2], a.k_stride[0]),
      make_tma_ds<Cfg>(static_cast<const Elem*>(a.ds_scratch), 1 + a.batch * a.heads * a.ds_visits),
      static_cast<Elem*>(a.dq), a.dq_stride[1], a.dq_stride[2], a.dq_stride[0],
      a.seqlen, a.heads, a.kv_heads, a.batch,
      SequenceMask{a.n_noisy, a.seqlen - a.n_noisy, a.block_size}, a.scale, a.dq_order, a.ds_slots,
      a.ds_k_tiles ? a.ds_k_tiles : (a.seqlen + Cfg::BN - 1) / Cfg::BN, a.ds_visits, a.dq_tiles,
      ds_dq_work_order(a.batch, a.heads, a.kv_heads, a.seqlen, D, sizeof(Elem), a.order_chunk, a.order_block)};
  p.tile_sample = a.dq_sample, p.cu_seqlens = a.cu_seqlens, p.ds_rows = a.ds_rows;
  if constexpr (Cfg::kTmaStore) p.tma_store = make_tma_store_dq<Elem, D>(a);
  auto kernel = diffusion_bwd_dq_from_ds_kernel<Cfg>;
  constexpr int smem = sizeof(typename Cfg::SharedStorage);
  static const cudaError_t configured = set_smem(kernel, smem);
  if (configured != cudaSuccess) return configured;
  int ctas = a.batch * a.heads * a.dq_tiles;
  if constexpr (Cfg::kPersistent) {
    if (const cudaError_t err = cap_at_sm_count(ctas); err != cudaSuccess) return err;
    p.schedule = a.dq_schedule;
  }
  return launch_kernel(kernel, ctas, Cfg::kThreads, smem, a.stream, a.dependent_launch, p);
}

// The shipped configs with their tiles starting per START (the one place that names the options).
template <class Elem, int D, int START>
using DkDvShipped = DkDvConfig<Elem, D, bwd_block_m(D), bwd_block_n(D), kBwdStages, START>;
template <class Elem, int D, int START>
using DqShipped = DqConfig<Elem, D, dq_block_m(D), dq_block_n(D), kDqStages, START>;
template <class Elem, int D, int START>
using DkDvFused = DkDvConfig<Elem, D, kBwdBlockM, kBwdBlockN, kBwdStages, START, true>;
// The persistent dK/dV kernel: two K / V buffers, TMA-store epilogue, snake walk. Harness
// `persistent` (session 9, bf16 D = 128, 16K tokens) against DkDvShipped: the dK/dV kernel 1.12x /
// 1.20x at n = 1K (block 16 / 4), the whole backward 1.07x / 1.10x; at 2K 0.98x (whole 1.03x), at
// 4K 0.92x (0.91x), at 8K 1.00x (0.93x), GQA 32/8 at 2K 0.90x. D = 64 (session 10, `persistent64`):
// the whole backward 1.055x / 1.058x at n = 1K, 1.01x at 2K, 0.97x at 4K, 0.91x at 8K, 0.94x GQA;
// over 128-query tiles (session 19, `bm128-64`) 1.09 / 1.04 / 1.04 / 1.01x (n = 1K-8K), GQA 1.01x
// the one-CTA-per-tile kernel over the same tiles, 1.05-1.09x the best of session 18's two at every
// shape.
template <class Elem, int D, int START>
using DkDvPersistent = DkDvConfig<Elem, D, bwd_block_m(D), kBwdBlockN, kBwdStages, START, false, true, true>;
constexpr bool dkdv_persistent_supports(int d) { return d == 64 || d == 128; }
constexpr bool fused_dq_supports(int d) { return d == 128; }

template <class Elem, int D>
cudaError_t launch_convert_dq(const BwdArgs& a) {
  const int64_t threads = static_cast<int64_t>(a.batch) * a.seqlen * a.heads * (D / 8);
  bwd_convert_dq_kernel<Elem, D><<<static_cast<unsigned>((threads + 255) / 256), 256, 0, a.stream>>>(
      a.dq_accum, static_cast<Elem*>(a.dq), a.dq_stride[0], a.dq_stride[1], a.dq_stride[2], a.batch,
      a.seqlen, a.heads, a.scale);
  return cudaGetLastError();
}

// The backward with dS through HBM (hopper/bwd_dq_from_ds.cuh, csrc/NOTES.md "Session 18"): the
// dK/dV kernels that also store dS^T (kStartTile: batched halves on multiples of 128; kStartVarlen:
// packed samples of any lengths, session 24), staging it behind
// their dV / dK matmuls (kDsStore = 2; harness `ds`, session 18: the whole backward 1.04-1.05x
// faster than staging it before them); at D = 128 the persistent one at every length (call 3: the
// whole backward 1.12-1.21x the shipped one's with it, 1.03-1.06x with one CTA per key tile); at
// D = 256 the role split, one CTA per key tile (its only dK/dV kernel).
constexpr int kDsStore = 2;
constexpr bool ds_backward_supports(int d) { return d == 128 || d == 256; }
template <class Elem, int D, int STORE = kDsStore, int START = kStartTile>
using DkDvStoreDs = DkDvConfig<Elem, D, kBwdBlockM, bwd_block_n(D), kBwdStages, START, false, false,
                               false, false, STORE>;
template <class Elem, int D, int STORE = kDsStore, int START = kStartTile>
using DkDvStoreDsPersistent = DkDvConfig<Elem, D, kBwdBlockM, kBwdBlockN, kBwdStages, START, false,
                                         true, true, false, STORE>;
// The dQ-from-dS kernel persistent (harness `ds-dq`, session 18: the dQ kernel 1.03-1.18x, the whole
// backward 1.00-1.03x against one CTA per item), walking its items in L2 chunks of (batch, head)
// slots, 4-wave blocks (work_order's chunk -1, block 0): at n = 1K it re-read K from DRAM 3.5x in
// the plain entry-major order (ncu, session 19: the kernel at 76 % of DRAM bandwidth); harness
// `ds-dq-order`: the dQ kernel 1.135 / 1.143 / 1.073 / 1.017x at n = 1K-8K (1.115x block 4, 1.006x
// GQA 32/8), the whole backward 1.03 / 1.03 / 1.03 / 1.00x. dQ through TMA stores (TMA_STORE_;
// harness `ds-dq-tma` / `ds-dq-tma256`, session 20): at D = 128 the dQ kernel 1.10 / 1.08 / 1.04 /
// 1.02x at n = 1K-8K, 1.15x GQA 32/8, the whole backward 1.03 / 1.02 / 1.01 / 0.99x, 1.02x GQA; at
// D = 256 the dQ kernel 1.17 / 1.15 / 1.04x at n = 1K / 2K / 8K, 1.22x GQA, the whole backward
// 1.03 / 1.03 / 1.01x, 1.03x GQA.
template <class Elem, int D, int START = kStartTile>
using DqFromDsPersistent = DqFromDsConfig<Elem, D, 3, true, true, START>;
constexpr int kDsDqOrderChunk = -1, kDsDqOrderBlock = 0;
// The last rounds of that walk its balanced schedule hands out most expensive first (dlm/geometry.h
// balanced_schedule; cutlass_diffusion.DQ_SCHEDULE turns it on; csrc/NOTES.md "Session 47").
constexpr int kDsDqScheduleTailRounds = 4;

// Preprocess, dK/dV writing dS^T, dQ from dS. a.ds_scratch: 1 + B * H * a.ds_visits blocks of
// ds_block_elems(D) (block 0 is zeroed by the preprocess: it stands for the halves of dQ tiles that
// no dK/dV visit covers), a.ds_slots: the block of each (64-query tile, key tile) visit of the
// dK/dV kernel per (batch, head), numbered key tile by key tile in its visit order, -1 where it
// does not visit (the Python backend builds it from geometry.py: cutlass_diffusion._ds_slots);
// a.dq_order: the query tiles of fwd_tiles(kDsDqBlockM, ds_dq_block_n(D)). a.persistent_dkdv is not
// read, nor a.order_*: the dK/dV kernel walks a.dkdv_order_chunk / a.dkdv_order_block's order
// (a.dkdv_schedule's, if given), the dQ kernel kDsDqOrderChunk / kDsDqOrderBlock's (the harness
// times others through launch_dkdv / launch_dq_from_ds). START: kStartTile (batched halves of
// multiples of 128) or kStartVarlen (packed samples: a.ds_rows and a.ds_k_tiles say where each
// sample's rows of the slot table lie; a.dq_sample is then the dQ-from-dS entries' samples).
template <class Elem, int D, int STORE = kDsStore, int START = kStartTile>
cudaError_t launch_bwd_ds(const BwdArgs& a) {
  static_assert(ds_backward_supports(D), "the dS store and the dQ-from-dS kernel: D = 128 or 256");
  using DkDv = std::conditional_t<dkdv_persistent_supports(D), DkDvStoreDsPersistent<Elem, D, STORE, START>,
                                  DkDvStoreDs<Elem, D, STORE, START>>;
  if (a.batch * a.heads == 0 || a.seqlen == 0) return cudaSuccess;
  cudaError_t err = launch_preprocess<Elem, D>(a, a.ds_scratch, ds_block_elems(D) * sizeof(Elem));
  BwdArgs dkdv = a, dq = a;
  dkdv.order_chunk = a.dkdv_order_chunk, dkdv.order_block = a.dkdv_order_block;
  dq.order_chunk = kDsDqOrderChunk, dq.order_block = kDsDqOrderBlock;
  if (err == cudaSuccess && a.dkdv_tiles) err = launch_dkdv<DkDv>(dkdv);
  if (err == cudaSuccess && a.dq_tiles) err = launch_dq_from_ds<DqFromDsPersistent<Elem, D, START>>(dq);
  return err;
}

// The whole backward: preprocess, dK/dV, dQ (one stream, so each sees the previous one's writes).
// START: kBatchedStart (batched calls) or kStartVarlen (packed samples: batch 1, dkdv_sample,
// dq_sample and cu_seqlens set). lse2 / delta hold kVarlenScratchPad floats past their B * H * S,
// zeroed by the preprocess (the kStartAny / kStartVarlen dK/dV kernels read them). Calls with
// a.ds_scratch set (D = 128 or 256; batched: halves on multiples of 128, the binding checks) run
// launch_bwd_ds instead.
template <class Elem, int D, int START = kBatchedStart>
cudaError_t launch_bwd(const BwdArgs& a) {
  if constexpr (ds_backward_supports(D) && START == kBatchedStart) {
    if (a.ds_scratch) return launch_bwd_ds<Elem, D>(a);
  }
  if constexpr (ds_backward_supports(D) && START == kStartVarlen) {
    if (a.ds_scratch) return launch_bwd_ds<Elem, D, kDsStore, kStartVarlen>(a);
  }
  if (a.batch * a.heads == 0 || a.seqlen == 0) return cudaSuccess;
  cudaError_t err = launch_preprocess<Elem, D>(a);
  if (err == cudaSuccess && a.dkdv_tiles) {
    if constexpr (dkdv_persistent_supports(D)) {
      err = a.persistent_dkdv ? launch_dkdv<DkDvPersistent<Elem, D, START>>(a)
                              : launch_dkdv<DkDvShipped<Elem, D, START>>(a);
    } else {
      err = launch_dkdv<DkDvShipped<Elem, D, START>>(a);
    }
  }
  if (err == cudaSuccess && a.dq_tiles) err = launch_dq<DqShipped<Elem, D, START>>(a);
  return err;
}

// The fused backward (dQ inside the dK/dV kernel; csrc/NOTES.md "Fused dQ"): measured slower than
// launch_bwd on the H200, so the extension does not instantiate it; tests/cuda's harness does.
// a.dq_accum: (B, S, H, D) fp32 scratch, zeroed here.
template <class Elem, int D, int START = kBatchedStart>
cudaError_t launch_bwd_fused(const BwdArgs& a) {
  static_assert(fused_dq_supports(D));
  if (a.batch * a.heads == 0 || a.seqlen == 0) return cudaSuccess;
  const size_t bytes = sizeof(float) * a.batch * a.seqlen * a.heads * D;
  cudaError_t err = cudaMemsetAsync(a.dq_accum, 0, bytes, a.stream);
  if (err == cudaSuccess) err = launch_preprocess<Elem, D>(a);
  if (err == cudaSuccess && a.dkdv_tiles) err = launch_dkdv<DkDvFused<Elem, D, START>>(a);
  if (err == cudaSuccess) err = launch_convert_dq<Elem, D>(a);
  return err;
}

#define DLM_DECLARE_BWD(ELEM, D)                                         \
  extern template cudaError_t launch_bwd<ELEM, D>(const BwdArgs&); \
  extern template cudaError_t launch_bwd<ELEM, D, kStartVarlen>(const BwdArgs&);
DLM_DECLARE_BWD(cutlass::bfloat16_t, 64)
DLM_DECLARE_BWD(cutlass::bfloat16_t, 128)
DLM_DECLARE_BWD(cutlass::bfloat16_t, 256)
DLM_DECLARE_BWD(cutlass::half_t, 64)
DLM_DECLARE_BWD(cutlass::half_t, 128)
DLM_DECLARE_BWD(cutlass::half_t, 256)
#undef DLM_DECLARE_BWD

}  // namespace dlm::sm90
