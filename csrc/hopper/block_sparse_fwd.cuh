// Block-sparse attention forward for Hopper (sm_90a): the v5 diffusion forward's loop (producer
// warpgroup + two consumer warpgroups, FA3 in-warpgroup overlap, ping-pong) over a LIST of key
// blocks per query block instead of the mask geometry's runs (issue #5; csrc/NOTES.md
// "Block-sparse forward (issue #5)").
//
// The op (dlm_ops block_sparse_attn): q (B, Sq, H, D), k / v (B, Sk, Hkv, D); query block qb of
// (b, h) attends exactly to key blocks kv_block_indices[b, h, qb, :kv_block_counts[b, h, qb]]
// (ascending, valid: the op validates); an empty list gives out 0 and lse -inf.
//
// Shape of the work. One CTA owns one query block (BM = 128 rows = one selection block) of one
// (batch, head) and visits its listed key blocks, each one BN = 128 key tile. Warpgroup 0 is the
// producer: one thread reads the list from global memory and issues the TMA copies of Q once and
// of K and V per listed block into a 2-stage ring (full / empty mbarriers). Warpgroups 1 and 2 are
// the consumers (64 rows each): S = Q K^T, the online softmax, O += P V, with FlashAttention-3's
// in-warpgroup overlap and ping-pong turns, as in the diffusion forward (hopper/diffusion_fwd.cuh
// says why each piece is there). Every visit is FULL except the last key block when Sk is not a
// multiple of 128: TMA reads its rows past Sk as zeros and that one tile runs the masked softmax
// (columns >= Sk % 128 get probability 0). Query rows past Sq (the last query block) are loaded as
// zeros and not stored. Lists need not be ascending for correctness (the consumers test each
// block against the last one), only for the producer's reads to walk K / V forward.
//
// Work items: item w is entry work_order[w] (or w) of the flat (B, H, nQb) count tensor. The CTA
// loop over items is v5's with the snake walk (snake_item); the grid is one CTA per item, or
// persistent (SparseFwdArgs::max_ctas, at most that many CTAs; cutlass_sparse.PERSISTENT decides,
// csrc/NOTES.md "Session 10"). On the persistent grid the last round's items may be split into
// parts over the CTAs it would leave idle, merged by the part that finishes last (a second launch
// of the kernel, kTail: tail_part, attn_common.cuh finish_part; SparseFwdArgs::split_parts).
//
// Per-item key lengths (key_len, optional): the column form, the column-sparse forward's
// (csrc/NOTES.md "Column-sparse forward (issue #5)"). With key_len set, the keys of (b, h) are
// [0, key_len[b * H + h]) (<= Sk) and its items visit the key blocks 0, 1, ..., counts - 1 in that
// order (counts <= ceil(key_len / 128)): the list is the shared arange (shared_list, which the
// launch requires; column_gather writes it) and the kernel takes its entries as their indices
// instead of reading them, so the consumers tell the masked tile (block (key_len - 1) / 128, its
// columns from key_len % 128 on) by its index, with no load per tile. That is a second kernel per
// TU (template flag kKeyLen, consumers KeyLenConsumerSide), so the block-sparse kernel (key_len
// null) keeps its machine code: no per-item tail in its loop. Lists may be shared without key_len
// too (shared_list: every item reads the one list kv_block_indices[0, max_blocks)).
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/numeric_types.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "hopper/attn_common.cuh"

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
  const int32_t* kv_block_indices;      // (B, H, nQb, max_blocks), contiguous; or (max_blocks): shared_list
  const int32_t* kv_block_counts;       // (B, H, nQb), contiguous
  int num_q_blocks, max_blocks;
  float scale;                          // softmax scale (natural), the kernel folds log2 e
  const int32_t* work_order = nullptr;  // optional: (B*H*nQb) work items, longest list first; null = natural order
  cudaStream_t stream;
  bool shared_list = false;             // kv_block_indices is one list (max_blocks) read by every item
  const int32_t* key_len = nullptr;     // optional: (B, H) keys per (batch, head), <= seqlen_k; null = seqlen_k;
                                        // set: the column form (shared_list, read as 0, 1, ...: see above)
  int max_ctas = 0;                     // > 0: a persistent grid of at most that many CTAs; 0: one CTA per item
  // The split tail (tail_part below; needs max_ctas > 0): > 0 splits each of the last round's items
  // into up to this many parts over the grid's CTAs. Then the grid is max_ctas CTAs even with
  // fewer items, split_partials holds split_scratch_floats(D, max_ctas) floats and split_counters
  // 2 * max_ctas zeroed int32 (per launch: the parts count themselves in them).
  int split_parts = 0;
  float* split_partials = nullptr;
  int32_t* split_counters = nullptr;
};

// Scratch of the split tail: per CTA and consumer warpgroup, its part's unnormalised O (64 x D
// fp32) and each thread's two row maxima and sums (finish_part in hopper/attn_common.cuh).
inline int64_t split_scratch_floats(int d, int ctas) {
  return int64_t(ctas) * 2 * 128 * (64 * d / 128 + 4);
}

// Host: what this kernel covers (the binding falls back to Triton otherwise).
inline bool block_sparse_fwd_supports(int block_q, int block_k, int d) {
  return block_q == 128 && block_k == 128 && (d == 64 || d == 128);
}

// The diffusion forward's tiles: 128 x 128, 2 stages, ping-pong, its TMA-store epilogue, and its
// softmax: online_softmax_tile_ilp, with a stale max at D = 128 (fwd_stale_max): harness softmax-ab
// (session 16, bf16 D = 128, S 16K-64K, densities 0.1-0.5, medians over both orders) 1.044-1.052x
// over the one-chain softmax at every point (four chains alone 0.994-1.014x); at D = 64 four chains
// 1.011-1.057x, with the stale max 0.962-1.005x. At D = 128 two Q buffers (the persistent producer
// loads the next item's Q during this one; 224 KB of smem) and an item's first S without a turn
// (attn_common.cuh FreeFirstTurn, which says why): 1.006-1.036x at every measured point (session
// 38), where two Q buffers alone had measured 0.985-1.005x (session 15) and 1.005-1.023x (session
// 38). D = 64 takes the free turn with one Q buffer: 1.024-1.056x over strict turns at every
// measured point, where two Q buffers measured 0.97-0.99x with or without it (session 39, harness
// end-ab64). A third K / V stage in place of the O staging measured 0.96-1.03x.
template <class Elem, int D>
using SparseFwdBase = FwdConfig<Elem, D, 128, 128, 2, true, kStartTile, D >= 128 ? 2 : 1, true, true,
                                fwd_stale_max(D)>;
template <class Elem, int D>
using SparseFwdConfig = FreeFirstTurn<SparseFwdBase<Elem, D>>;

template <class Cfg>
struct SparseFwdParams {
  using TmaQ = decltype(make_tma_q<Cfg>(nullptr, 1, 1, 1, 1, 1, 1));
  using TmaKV = decltype(make_tma_kv<Cfg>(nullptr, 1, 1, 1, 1, 1, 1));
  TmaQ tma_q;
  TmaKV tma_k, tma_v;
  typename Cfg::Elem* o;
  float* lse;
  int64_t o_stride_s, o_stride_h, o_stride_b, lse_stride_h, lse_stride_b;
  int seqlen_q, seqlen_k, heads, kv_heads, batch, num_q_blocks;
  int list_stride;            // entries between two items' lists: max_blocks, or 0 (one shared list)
  const int32_t* indices;     // (B, H, nQb, max_blocks), or (max_blocks) shared
  const int32_t* counts;      // (B, H, nQb)
  const int32_t* work_order;  // null: item w is entry w
  float scale_log2;           // softmax scale * log2(e)
  const int32_t* key_len;     // (B, H); read by the kKeyLen kernel only
  int split_parts;            // SparseFwdArgs::split_parts (0: no split tail)
  float* split_partials;
  int32_t* split_counters;
  int items_end;              // the plain launch's walk: items [0, items_end) (all, or the whole rounds)
  // Cfg::kSmemO: the TMA store of O over (seqlen_q, D, heads, batch).
  using TmaO = decltype(make_tma_o<Cfg>(nullptr, 1, 1, 1, 1, 1, 1));
  TmaO tma_o{};
};

// Work item w: query block qb of (b, h) and its key block list.
struct SparseItem {
  int b, h, qb, count;
  const int32_t* list;
};
template <class Params>
CUTE_DEVICE SparseItem sparse_item(Params const& p, int w) {
  const int e = p.work_order ? p.work_order[w] : w, bh = e / p.num_q_blocks;
  return {bh / p.heads, bh % p.heads, e % p.num_q_blocks, p.counts[e],
          p.indices + int64_t(e) * p.list_stride};
}

// The split tail (csrc/NOTES.md "Session 22"). With 4096 items of 13 tiles on 132 CTAs (16K at
// density 0.1) 31 rounds are full and 4 items make a 32nd: 3 % of the launch with 128 CTAs idle.
// With split_parts > 0 the plain launch walks the first whole = items / grid * grid items, and
// the tail launch (kTail) takes the tail = items - whole left (the last round's; the shortest in
// a longest-first order) over the whole grid: tail item t has the CTAs [first, next), first =
// ceil(t * grid / tail), so CTA c works on tail item c * tail / grid; the item splits into parts =
// min(its CTAs, its tiles, split_parts) (at least 1) runs of its list, part i its tiles
// [i * n / parts, (i + 1) * n / parts), and the CTAs past its parts have none. Producer and consumers take the same part
// (TailPart: hopper/attn_common.cuh, with the parts' merge, finish_part).
template <class Params>
CUTE_DEVICE bool tail_part(Params const& p, int num_items, TailPart& tp) {
  const int grid = gridDim.x, whole = num_items / grid * grid, tail = num_items - whole;
  if (p.split_parts <= 0 || tail == 0) return false;
  const int c = blockIdx.x, t = int(int64_t(c) * tail / grid);
  const int first = int((int64_t(t) * grid + tail - 1) / tail);
  const int next = int((int64_t(t + 1) * grid + tail - 1) / tail);
  const int w = whole + t, n = p.counts[p.work_order ? p.work_order[w] : w];
  const int parts = max(1, min(next - first, min(n, p.split_parts))), index = c - first;
  if (index >= parts) return false;
  tp = {w, first, parts, index, int(int64_t(index) * n / parts), int(int64_t(index + 1) * n / parts)};
  return true;
}

// The block-sparse side of fwd_consumers (hopper/attn_common.cuh): item w is query block qb of
// (b, h) with its listed key blocks; every visit is FULL but the short last key block (Sk not a
// multiple of BN), whose keys from k_tail on are masked. Lists need not be ascending: each block is
// tested against the last one.
template <class Cfg, class Params>
struct SparseConsumerSide {
  Params const& p;
  const int k_tail = p.seqlen_k % Cfg::BN, last_kb = (p.seqlen_k - 1) / Cfg::BN;

  struct Item {
    int b, h, row_base, row_offset, n_tiles;
    const int32_t* list;
  };
  template <class Coords>
  CUTE_DEVICE Item item(int w, int consumer, Coords const&) const {
    const SparseItem si = sparse_item(p, w);
    return {si.b, si.h, si.qb * Cfg::BM + consumer * Cfg::kConsumerRows, 0, si.count, si.list};
  }
  CUTE_DEVICE int row_end(Item const&) const { return p.seqlen_q; }  // rows past Sq: not stored
  CUTE_DEVICE int o_rows() const { return p.seqlen_q; }
  CUTE_DEVICE static Item part(Item item, int lo, int hi) {  // entries [lo, hi) of the item's list
    item.list += lo;
    item.n_tiles = hi - lo;
    return item;
  }
  CUTE_DEVICE bool tail(int num_items, TailPart& tp) const { return tail_part(p, num_items, tp); }
  // Step j is short iff Sk is not a multiple of BN and it visits the last key block.
  CUTE_DEVICE int tile(Item const&, int j) const { return j; }
  CUTE_DEVICE bool may_mask(int) const { return k_tail != 0; }
  CUTE_DEVICE bool masked(Item const& item, int j) const { return item.list[j] == last_kb; }
  template <class Coords>
  CUTE_DEVICE KeyTail bounds(Item const&, int, Coords const& tScS_rc) const {
    return {k_tail - get<1>(tScS_rc(0, 0))};  // the keys from Sk on, in this thread's columns
  }
};

// The column form: a key length per (batch, head), key_len[b * H + h], and the implicit list
// 0, 1, ..., count - 1, so step j of an item (or of a split item's part from entry `first` on)
// visits key block first + j, and the tile of block last_kb = (key_len - 1) / BN masks its keys
// from key_len % BN on; last_kb is -1 when key_len is a multiple of BN (no tile masked). Both
// come with the item (one load of key_len per item); the mask test is one compare of the step's
// block, with no list entry read per tile (session 39: that read and its 16-bit phi cost the column
// form's loop ~2 % against the block form's). key_len 0 comes with an empty list (out 0, lse -inf).
template <class Cfg, class Params>
struct KeyLenConsumerSide {
  Params const& p;

  struct Item {
    int b, h, row_base, row_offset, n_tiles;
    int first, k_tail, last_kb;
  };
  template <class Coords>
  CUTE_DEVICE Item item(int w, int consumer, Coords const&) const {
    const SparseItem si = sparse_item(p, w);
    const int len = p.key_len[si.b * p.heads + si.h], k_tail = len % Cfg::BN;
    return {si.b, si.h, si.qb * Cfg::BM + consumer * Cfg::kConsumerRows, 0, si.count, 0, k_tail,
            k_tail != 0 ? len / Cfg::BN : -1};
  }
  CUTE_DEVICE int row_end(Item const&) const { return p.seqlen_q; }
  CUTE_DEVICE int o_rows() const { return p.seqlen_q; }
  CUTE_DEVICE static Item part(Item item, int lo, int hi) {
    item.first = lo;
    item.n_tiles = hi - lo;
    return item;
  }
  CUTE_DEVICE bool tail(int num_items, TailPart& tp) const { return tail_part(p, num_items, tp); }
  CUTE_DEVICE int tile(Item const& item, int j) const { return item.first + j; }  // its key block
  CUTE_DEVICE bool may_mask(int) const { return true; }  // the tail is per item: masked() decides
  CUTE_DEVICE bool masked(Item const& item, int kb) const { return kb == item.last_kb; }
  template <class Coords>
  CUTE_DEVICE KeyTail bounds(Item const& item, int, Coords const& tScS_rc) const {
    return {item.k_tail - get<1>(tScS_rc(0, 0))};
  }
};

// kKeyLen: the consumers take each item's key length from p.key_len (KeyLenConsumerSide);
// otherwise every item has seqlen_k keys (SparseConsumerSide, the shipped kernel). The producer
// is the same: it loads the listed blocks, whatever their valid length. kTail: the split tail's
// launch (one part of a split item per CTA, tail_part), after the plain launch has walked the
// whole rounds; two launches, not one loop, so that the plain kernel's loop stays as it was (the
// loop that also took the tail part ran 1.5-2 % slower: csrc/NOTES.md "Session 22").
template <class Cfg, bool kKeyLen, bool kTail>
__global__ void __launch_bounds__(Cfg::kThreads, 1)
    block_sparse_fwd_kernel(__grid_constant__ const SparseFwdParams<Cfg> p) {
  constexpr int BM = Cfg::BM, BN = Cfg::BN, D = Cfg::D, STAGES = Cfg::STAGES;
  using Barrier = cutlass::arch::ClusterBarrier;
  using TxBarrier = cutlass::arch::ClusterTransactionBarrier;

  extern __shared__ __align__(1024) char smem_raw[];
  auto& ss = *reinterpret_cast<typename Cfg::SharedStorage*>(smem_raw);
  Tensor sQ = make_tensor(make_smem_ptr(ss.q), typename Cfg::SmemLayoutQ{});
  Tensor sK = make_tensor(make_smem_ptr(ss.k), typename Cfg::SmemLayoutKV{});
  Tensor sV = make_tensor(make_smem_ptr(ss.v), typename Cfg::SmemLayoutKV{});

  // The plain launch walks [0, items_end); the tail launch splits what is left (tail_part).
  const int num_items = kTail ? p.batch * p.heads * p.num_q_blocks : p.items_end;
  const int warp_group = threadIdx.x / 128;
  init_fwd_barriers<Cfg>(ss);
  // The split tail's two launches overlap (programmatic dependent launch): the plain launch lets
  // the tail launch's CTAs start as its own leave their SMs, and those wait here, past their
  // set-up, until the plain launch has completed (its writes are not what they read: this keeps
  // the stream's order for whatever comes after). Without a dependent launch both are no-ops.
  if constexpr (kTail)
    wait_for_prerequisite();
  else
    allow_dependents();

  if (warp_group == 0) {  // ---------------------------------------------------------- producer
    cutlass::arch::warpgroup_reg_dealloc<24>();
    if (threadIdx.x == 0) {
      constexpr int ev = kTraceProducer;  // trace_event's slots (common.cuh; harness `trace` only)
      trace_event<Cfg>(0, kTraceEvents - 4);  // the CTA's start: clock64, globaltimer
      trace_event<Cfg>(0, kTraceEvents - 3);
      Tensor mQ = p.tma_q.get_tma_tensor(make_shape(p.seqlen_q, D, p.heads, p.batch));
      Tensor mK = p.tma_k.get_tma_tensor(make_shape(p.seqlen_k, D, p.kv_heads, p.batch));
      Tensor mV = p.tma_v.get_tma_tensor(make_shape(p.seqlen_k, D, p.kv_heads, p.batch));
      auto tma_q = p.tma_q.get_slice(0);
      auto tma_k = p.tma_k.get_slice(0);
      auto tma_v = p.tma_v.get_slice(0);
      Tensor tKsK = tma_k.partition_D(sK);  // (TMA, 1, 1, STAGES)
      Tensor tVsV = tma_v.partition_D(sV);
      int it = 0;  // K/V visits so far, over every work item of this CTA: the ring position
      // The item's Q, then its list's entries [lo, hi), for the item-th of this CTA's items: the
      // plain launch's whole items, or the tail launch's part of a split item (one call site each).
      auto produce = [&](SparseItem const& si, int item, int lo, int hi) {
        const int kvh = si.h / (p.heads / p.kv_heads);
        Tensor gQ = local_tile(mQ(_, _, si.h, si.b), Shape<Int<BM>, Int<D>>{}, make_coord(si.qb, 0));
        produce_q<Cfg>(p.tma_q, tma_q, gQ, sQ, ss, item);
        trace_event<Cfg>(item, ev + 1);
        // Key block kb is key tile kb (block_k == BN): boxes by tile index, a short last one
        // zero-filled by TMA (the zeros still count as transaction bytes).
        Tensor tKgK = tma_k.partition_S(
            local_tile(mK(_, _, kvh, si.b), Shape<Int<BN>, Int<D>>{}, make_coord(_, 0)));
        Tensor tVgV = tma_v.partition_S(
            local_tile(mV(_, _, kvh, si.b), Shape<Int<BN>, Int<D>>{}, make_coord(_, 0)));
        for (int j = lo; j < hi; ++j, ++it) {
          // kKeyLen: the implicit list 0, 1, ... (KeyLenConsumerSide), not read
          const int kb = kKeyLen ? j : si.list[j], stage = it % STAGES, phase = (it / STAGES) & 1;
          Barrier::wait(&ss.k_empty[stage], phase ^ 1);
          TxBarrier::arrive_and_expect_tx(&ss.k_full[stage], Cfg::kTileBytesKV);
          copy(p.tma_k.with(ss.k_full[stage]), tKgK(_, _, _, kb), tKsK(_, _, _, stage));
          Barrier::wait(&ss.v_empty[stage], phase ^ 1);
          TxBarrier::arrive_and_expect_tx(&ss.v_full[stage], Cfg::kTileBytesKV);
          copy(p.tma_v.with(ss.v_full[stage]), tVgV(_, _, _, kb), tVsV(_, _, _, stage));
        }
        trace_event<Cfg>(item, ev + 2);
      };
      if constexpr (!kTail) {
        for (int item = 0, w = snake_item(0); w < num_items; w = snake_item(++item)) {
          trace_event<Cfg>(item, ev + 0);
          const SparseItem si = sparse_item(p, w);
          produce(si, item, 0, si.count);
        }
      } else {
        TailPart tp;
        if (tail_part(p, num_items, tp)) produce(sparse_item(p, tp.w), 0, tp.lo, tp.hi);
      }
      trace_event<Cfg>(0, kTraceEvents - 2);  // the producer's end
      trace_event<Cfg>(0, kTraceEvents - 1);
    }
    return;
  }

  // ------------------------------------------------------------------------------------ consumers
  if constexpr (kKeyLen)
    fwd_consumers<Cfg, KeyLenConsumerSide, kTail>(p, ss, warp_group - 1, num_items);
  else
    fwd_consumers<Cfg, SparseConsumerSide, kTail>(p, ss, warp_group - 1, num_items);
}

// ------------------------------------------------------------------------------------- launch
template <class Cfg, bool kKeyLen, bool kTail>
cudaError_t run_block_sparse_fwd(const SparseFwdParams<Cfg>& p, int ctas, cudaStream_t stream) {
  auto kernel = block_sparse_fwd_kernel<Cfg, kKeyLen, kTail>;
  constexpr int smem = sizeof(typename Cfg::SharedStorage);
  static const cudaError_t configured =  // once per instantiation: the attribute is per function
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (configured != cudaSuccess) return configured;
  // The tail launch: a programmatic dependent launch of the plain launch before it (see the kernel).
  return launch_kernel(kernel, ctas, Cfg::kThreads, smem, stream, kTail, p);
}

// max_ctas > 0: a persistent grid of at most that many CTAs (each walks its items in the snake
// order, snake_item); 0: one CTA per item.
template <class Cfg>
cudaError_t launch_block_sparse_fwd_cfg(const SparseFwdArgs& a, int max_ctas = 0) {
  using Elem = typename Cfg::Elem;
  constexpr int BM = Cfg::BM, D = Cfg::D;
  if (!block_sparse_fwd_supports(a.block_q, a.block_k, D) || a.kv_heads <= 0 ||
      a.heads % a.kv_heads != 0 || a.num_q_blocks != (a.seqlen_q + BM - 1) / BM)
    return cudaErrorInvalidValue;
  // TMA: 16-byte aligned bases and strides; the paired O stores: 4-byte aligned pairs.
  auto aligned = [](const void* x) { return reinterpret_cast<uintptr_t>(x) % 16 == 0; };
  for (const int64_t* st : {a.q_stride, a.k_stride, a.v_stride, a.o_stride})
    for (int i = 0; i < 3; ++i)
      if (st[i] % 8 != 0) return cudaErrorInvalidValue;
  if (!aligned(a.q) || !aligned(a.k) || !aligned(a.v) || !aligned(a.o)) return cudaErrorInvalidValue;
  if (a.key_len && !a.shared_list) return cudaErrorInvalidValue;  // the column form: one arange
  const int items = a.batch * a.heads * a.num_q_blocks;
  if (items == 0) return cudaSuccess;
  auto ptr = [](const void* x) { return static_cast<const Elem*>(x); };
  // Sk = 0 (every list empty): a one-row K / V descriptor that no copy reads.
  const int sk = a.seqlen_k > 0 ? a.seqlen_k : 1;
  SparseFwdParams<Cfg> p{
      make_tma_q<Cfg>(ptr(a.q), a.seqlen_q, a.heads, a.batch, a.q_stride[1], a.q_stride[2], a.q_stride[0]),
      make_tma_kv<Cfg>(ptr(a.k), sk, a.kv_heads, a.batch, a.k_stride[1], a.k_stride[2], a.k_stride[0]),
      make_tma_kv<Cfg>(ptr(a.v), sk, a.kv_heads, a.batch, a.v_stride[1], a.v_stride[2], a.v_stride[0]),
      static_cast<Elem*>(a.o), a.lse, a.o_stride[1], a.o_stride[2], a.o_stride[0],
      a.lse_stride[1], a.lse_stride[0], a.seqlen_q, sk, a.heads, a.kv_heads, a.batch,
      a.num_q_blocks, a.shared_list ? 0 : a.max_blocks, a.kv_block_indices, a.kv_block_counts,
      a.work_order, a.scale * 1.4426950408889634f, a.key_len, a.split_parts, a.split_partials,
      a.split_counters, items};
  if constexpr (Cfg::kSmemO)
    p.tma_o = make_tma_o<Cfg>(static_cast<Elem*>(a.o), a.seqlen_q, a.heads, a.batch, a.o_stride[1],
                              a.o_stride[2], a.o_stride[0]);
  // The split tail: the plain launch walks the whole rounds of the persistent grid, then the tail
  // launch (the same grid, whatever the item count) splits the items left over it.
  const bool split = a.split_parts > 0 && max_ctas > 0 && items % max_ctas != 0;
  if (split && (!a.split_partials || !a.split_counters)) return cudaErrorInvalidValue;
  if (!split) p.split_parts = 0;
  const int ctas = split || (max_ctas > 0 && max_ctas < items) ? max_ctas : items;
  if (split) p.items_end = items - items % ctas;
  const bool key_len = a.key_len != nullptr;
  if (p.items_end > 0) {
    const cudaError_t err = key_len ? run_block_sparse_fwd<Cfg, true, false>(p, ctas, a.stream)
                                    : run_block_sparse_fwd<Cfg, false, false>(p, ctas, a.stream);
    if (err != cudaSuccess || !split) return err;
  }
  return key_len ? run_block_sparse_fwd<Cfg, true, true>(p, ctas, a.stream)
                 : run_block_sparse_fwd<Cfg, false, true>(p, ctas, a.stream);
}

template <class Elem, int D>
cudaError_t launch_block_sparse_fwd(const SparseFwdArgs& a) {
  return launch_block_sparse_fwd_cfg<SparseFwdConfig<Elem, D>>(a, a.max_ctas);
}

// The shipped instantiations, one translation unit each (csrc/hopper/block_sparse_fwd_*.cu).
#define DLM_DECLARE_SPARSE_FWD(ELEM, D) \
  extern template cudaError_t launch_block_sparse_fwd<ELEM, D>(const SparseFwdArgs&);
DLM_DECLARE_SPARSE_FWD(cutlass::bfloat16_t, 64)
DLM_DECLARE_SPARSE_FWD(cutlass::bfloat16_t, 128)
DLM_DECLARE_SPARSE_FWD(cutlass::half_t, 64)
DLM_DECLARE_SPARSE_FWD(cutlass::half_t, 128)
#undef DLM_DECLARE_SPARSE_FWD

}  // namespace dlm::sm90
