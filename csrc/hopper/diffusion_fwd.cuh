// Block-diffusion attention forward for Hopper (sm_90a), written with CuTe from the nvidia-cutlass
// wheel: TMA loads, wgmma, one producer warpgroup and two consumer warpgroups.
//
// Shape of the work. One CTA owns one query tile of BM = 128 rows of one (batch, head) and walks the
// key tiles it sees (dlm/geometry.h: at most two runs of consecutive tiles; FULL tiles run without
// the element mask, PARTIAL ones take it). Warpgroup 0 is the producer: one thread issues the TMA
// copies of Q once and of K and V per visited tile into a ring of STAGES buffers, each guarded by a
// "full" mbarrier (TMA transaction bytes) and an "empty" one (the consumers' release). Warpgroups 1
// and 2 are consumers, each owning 64 of the 128 rows: S = Q K^T (wgmma from shared memory), the
// online softmax in registers, O += P V (wgmma with P from registers, V^T read MN-major from shared
// memory). Each consumer issues S_i = Q K_i^T and then O += P_{i-1} V_{i-1} together and computes
// the softmax of S_i while that P V runs (FlashAttention-3's in-warpgroup overlap); the two
// consumers take turns at issuing (ping-pong), so one's softmax also overlaps the other's
// matmuls. The producer gives most of its registers to them (setmaxnreg 24 / 240). At D <= 128
// each consumer writes its rows of O into shared memory and one thread stores them with TMA
// (store_o_lse_tma), so that a CTA walking several work items starts the next one at once.
//
// What it leaves to the Triton kernel (dlm_ops/backends/cutlass_diffusion.py checks): softcap,
// head dims other than 64, 128, 256, dtypes other than bf16/fp16, rows not 16-byte aligned for TMA.
// Halves of any length and packed samples (varlen) run through the START_ option (hopper/common.cuh:
// launch_fwd<Elem, D> runs kBatchedStart, launch_fwd<Elem, D, kStartVarlen> packed samples). The
// mask is any [n_noisy | n_clean] SequenceMask (BD3, or block-causal with n_noisy 0). Tiles that
// run past a half's end are masked by column, so the next half's rows they load get probability 0.
//
// Versions, predictions and measurements: csrc/NOTES.md (this is v11: v6's TMA-store epilogue, v7's
// work items decoded once by the producer (FwdItem), v8's item trimmed: no O rescale at its first
// visit, O staged with one XOR per 16-byte chunk, 1 / l on the SFU; v9's noisy diagonal visited at
// 64 keys per consumer where block_size divides 64, narrow_visit; v11's two Q buffers in that
// narrow kernel, fwd_q_stages).
//
// Notation as in templates/diffusion_attn.py: logits in base 2 (s2 = q.k * scale * log2 e), lse
// stored in natural log, (B, H, S) fp32.
#pragma once

#include <cute/tensor.hpp>
#include <cute/atom/copy_traits_sm90_tma.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/numeric_types.h>

#include <cmath>

#include "dlm/geometry.h"
#include "hopper/attn_common.cuh"
#include "hopper/common.cuh"

namespace dlm::sm90 {

using namespace cute;

template <class Cfg>
struct FwdParams {
  using TmaQ = decltype(make_tma_q<Cfg>(nullptr, 1, 1, 1, 1, 1, 1));
  using TmaKV = decltype(make_tma_kv<Cfg>(nullptr, 1, 1, 1, 1, 1, 1));
  TmaQ tma_q;
  TmaKV tma_k, tma_v;
  typename Cfg::Elem* o;
  float* lse;
  int64_t o_stride_s, o_stride_h, o_stride_b, lse_stride_h, lse_stride_b;
  int seqlen, heads, kv_heads, batch;
  SequenceMask mask;
  float scale_log2;           // softmax scale * log2(e)
  const int32_t* tile_order;  // query tiles, most expensive first (geometry most_expensive_first)
  int num_tiles;              // entries of tile_order
  // kStartVarlen only (appended, so the shipped kernels' parameter offsets do not move): work
  // entry e is query tile tile_order[e] of sample tile_sample[e]; sample i occupies packed rows
  // [cu_seqlens[i], cu_seqlens[i + 1]) of batch 0; mask.block_size is every sample's block size.
  const int32_t* tile_sample = nullptr;
  const int32_t* cu_seqlens = nullptr;
  WorkOrder order;  // of the (tile_order entry, batch * heads slot) pairs
  // Cfg::kSmemO: the TMA store of O over (seqlen, D, heads, batch), from with_tma_o.
  using TmaO = decltype(make_tma_o<Cfg>(nullptr, 1, 1, 1, 1, 1, 1));
  TmaO tma_o{};
  // A persistent grid's walk: the balanced schedule built for exactly this grid (common.cuh
  // walk_item), or null: the snake (what the launchers run). Harness `sched` only: against the
  // snake it measured 0.98-1.02x (session 20, csrc/NOTES.md), where the dK/dV kernel's gains.
  const int32_t* schedule = nullptr;
};

// The parameters with their O store descriptor (Cfg::kSmemO), made from their own o fields.
template <class Cfg>
FwdParams<Cfg> with_tma_o(FwdParams<Cfg> p) {
  if constexpr (Cfg::kSmemO)
    p.tma_o = make_tma_o<Cfg>(p.o, p.seqlen, p.heads, p.batch, p.o_stride_s, p.o_stride_h, p.o_stride_b);
  return p;
}

// The work: item w is (entry e, slot j) of p.order (dlm/geometry.h WorkOrder; by default
// entry-major, so the most expensive tiles of every head come first): query tile tile_order[e] of
// (batch, head) j. CTA c takes items c, c + grid, c + 2 grid, ... (persistent when the grid is
// smaller than the work).
struct WorkItem {
  int b, h, qt;
};
template <class Params>
CUTE_DEVICE WorkItem work_item(Params const& p, int w) {
  int e, bh;
  p.order.decode(w, p.num_tiles, e, bh);
  return {bh / p.heads, bh % p.heads, p.tile_order[e]};
}

// A work item with its mask and the packed row its sample starts at (kStartAny: the batch's mask,
// row 0; kStartVarlen: entry e of sample tile_sample[e], slot j its head, batch 0).
struct ItemGeom {
  WorkItem wi;
  SequenceMask mask;
  int offset;
};
template <class Cfg, class Params>
CUTE_DEVICE ItemGeom item_geom(Params const& p, int w) {
  if constexpr (Cfg::kStart == kStartVarlen) {
    int e, h;
    p.order.decode(w, p.num_tiles, e, h);
    const int sample = p.tile_sample[e], lo = p.cu_seqlens[sample];
    return {{0, h, p.tile_order[e]},
            block_diffusion(p.cu_seqlens[sample + 1] - lo, p.mask.block_size), lo};
  } else {
    return {work_item(p, w), p.mask, 0};
  }
}

// What the consumers need of a work item, decoded once by the producer's thread (which decodes the
// item anyway for its loads) and handed over in shared memory. Decoding it in every consumer thread
// put ~240 instructions per item on the critical path between two items: the work order's and the
// head's integer divisions, then the tile_order load, then the mask's divisions (csrc/NOTES.md
// "Session 25": 4-5 % of the consumers' warp time at n = 1K). The producer publishes it right after
// the consumers free the item's Q buffer (q_empty), long before they finish the previous item.
struct FwdItem {
  int b, h, row_offset;  // row_offset: the packed row of the item's sample's position 0
  SequenceMask mask;     // the item's (kStartVarlen: its sample's)
  Interval q_tile;
  TileRuns runs;
  Intervals all_keys;    // keys_seen_by_all(mask, q_tile)
};
static_assert(sizeof(FwdItem) == 64, "four 16-byte shared-memory vectors");

// The forward's shared memory: the config's, plus one FwdItem and its "published" barrier per Q
// buffer (the barrier's phase is the Q buffer's).
template <class Cfg>
struct FwdShared : Cfg::SharedStorage {
  alignas(16) FwdItem item[Cfg::QSTAGES];
  alignas(8) uint64_t item_full[Cfg::QSTAGES];
};

// online_softmax_tile with the block-diffusion mask (kMasked: PARTIAL tiles and tiles cut short
// by their half's end). A visit lies inside one half and each of the row's two key ranges inside
// another, so one range holds all its visible keys: the mask is one interval of the row's columns.
// Cfg::kSoftmaxIlp: online_softmax_tile_ilp (attn_common.cuh), whose return value says whether O
// needs its rescale (always true without Cfg::kStaleMax); the shipped configs take both (FwdShipped).
template <bool kMasked, class Cfg = void, class Scores, class Coords, int kRows>
CUTE_DEVICE bool online_softmax(Scores& acc_s, Coords const& tScS_rc, Visit const& visit,
                                  Intervals const (&seen)[kRows], float scale_log2,
                                  float (&row_max)[kRows], float (&row_sum)[kRows],
                                  float (&scale_row)[kRows]) {
  auto bounds = [&](int i, int& lo, int& hi) {
    const bool first = seen[i].first.hi > visit.start && seen[i].first.lo < visit.end;
    const int base = visit.start + get<1>(tScS_rc(i, 0));
    lo = (first ? seen[i].first.lo : seen[i].second.lo) - base;
    hi = imin(first ? seen[i].first.hi : seen[i].second.hi, visit.end) - base;
  };
  if constexpr (!std::is_void_v<Cfg>) {
    return online_softmax_tile_ilp<kMasked, Cfg::kStaleMax>(acc_s, tScS_rc, bounds, scale_log2, row_max,
                                                            row_sum, scale_row);
  } else {
    online_softmax_tile<kMasked>(acc_s, tScS_rc, bounds, scale_log2, row_max, row_sum, scale_row);
    return true;
  }
}

// A visit of key run r is FULL iff its keys lie in the part of range r that every row
// of the query tile sees, [lo of the last row, hi of the first row) (each range is monotone in the
// row), and it is not cut short by the half's end. The same as tile_kind (which takes block_of of
// both key ends: two integer divisions per step, in the loop); `seen_by_all` = that part, per range.
CUTE_HOST_DEVICE Intervals keys_seen_by_all(SequenceMask const& m, Interval q_tile) {
  const Intervals a = m.row_intervals(q_tile.lo), b = m.row_intervals(q_tile.hi - 1);
  return {{b.first.lo, a.first.hi}, {b.second.lo, a.second.hi}};
}
template <int BN>
CUTE_HOST_DEVICE bool visit_full(Interval const& seen_by_all, int start, int end) {
  return end - start == BN && start >= seen_by_all.lo && end <= seen_by_all.hi;
}

// The visit of one step (what plans.visit computes) from the key bounds hoisted out of the loop.
template <class Cfg>
CUTE_DEVICE Visit step_visit(TilePlans const& plans, int kt, bool run0, Intervals const& all_keys) {
  const Interval t = plans.other.tile(kt);
  // Bounds by selects: a ternary between the two Interval structs put them on the stack (16 bytes).
  const Interval all{run0 ? all_keys.first.lo : all_keys.second.lo,
                     run0 ? all_keys.first.hi : all_keys.second.hi};
  return {t.lo, t.hi, visit_full<Cfg::BN>(all, t.lo, t.hi)};
}

// Whether an item's first visit runs narrow (Cfg::kNarrowDiag): a noisy query tile's run 0 is its own
// diagonal noisy tile, whose rows see only their own block. Where block_size divides 64, the 64 rows
// of consumer c (rows [64c, 64c + 64) of the tile) see only keys [64c, 64c + 64) of it, so each
// consumer computes S over those 64 keys alone (m64n64) and O += P V over them (k = 64): half the
// matmuls and half the softmax of a full visit. At n = 1K these are 8 of a (batch, head)'s 80 visits
// (block 16: 1/8 of the tile visible), the 8 the causal halves do not have (csrc/NOTES.md "Session 29").
template <class Cfg>
CUTE_DEVICE bool narrow_first_visit(SequenceMask const& mask, Interval q_tile, TileRuns const& runs) {
  if constexpr (!Cfg::kNarrowDiag) {
    return false;
  } else {
    return q_tile.lo < mask.n_noisy && runs.end[0] - runs.begin[0] == 1 &&
           Cfg::kConsumerRows % mask.block_size == 0;
  }
}

// The narrow visit of ring position (stage, phase), whole: S over this consumer's 64 keys, the
// masked softmax (the item's first visit: O holds nothing yet), O = P V, the stage released. Its
// P V is waited for here, not overlapped with the next visit's softmax as a full visit's is: left
// in flight across the branch that calls this, it made ptxas serialize every wgmma of the kernel
// (C7518, nvcc 13.0). The other consumer's turn keeps the tensor cores busy meanwhile.
template <class Cfg, class SQc, class SK, class SVt, class AccO, int kRows>
CUTE_DEVICE void narrow_visit(typename Cfg::SharedStorage& ss, SQc const& sQc, SK const& sK, SVt const& sVt,
                              int qbuf, int stage, int phase, AccO& acc_o, Visit const& tile,
                              Intervals const (&seen)[kRows], float scale_log2, float (&row_max)[kRows],
                              float (&row_sum)[kRows], float (&scale_row)[kRows], int consumer, int tid) {
  using Barrier = cutlass::arch::ClusterBarrier;
  using Elem = typename Cfg::Elem;
  constexpr int W = Cfg::kConsumerRows, D = Cfg::D;
  typename Cfg::MmaSNarrow mma_s;
  typename Cfg::MmaONarrow mma_o;
  auto thr_s = mma_s.get_thread_slice(tid);
  auto thr_o = mma_o.get_thread_slice(tid);
  Tensor tSrQ = thr_s.partition_fragment_A(sQc);  // (MMA, M, K, QSTAGES)
  Tensor tSrK = thr_s.partition_fragment_B(local_tile(sK, Shape<Int<W>, Int<D>>{}, make_coord(consumer, 0)));
  Tensor tOrV = thr_o.partition_fragment_B(local_tile(sVt, Shape<Int<D>, Int<W>>{}, make_coord(0, consumer)));
  Tensor acc_s = partition_fragment_C(mma_s, Shape<Int<W>, Int<W>>{});
  Tensor p_elem = make_fragment_like<Elem>(acc_s);
  Tensor tOrP = make_tensor(p_elem.data(), acc_as_operand_a(p_elem.layout()));
  Tensor tScS = thr_s.partition_C(make_identity_tensor(Shape<Int<W>, Int<W>>{}));
  Tensor tScS_rc = make_tensor(tScS.data(), acc_rowcol(tScS.layout()));

  Barrier::wait(&ss.k_full[stage], phase);
  if (Cfg::kPingPong) named_barrier_sync(kTurnBarrier + consumer);
  gemm_fresh(mma_s, tSrQ(_, _, _, qbuf), tSrK(_, _, _, stage), acc_s);
  warpgroup_wait<0>();
  if (Cfg::kPingPong) named_barrier_arrive(next_turn<Cfg>(consumer));
  warpgroup_fence_operand(acc_s);
  Barrier::arrive(&ss.k_empty[stage]);
  // Keys past a short tile's end (its half's) stay masked, as in a full visit.
  const Visit mine{tile.start + consumer * W, imin(tile.start + (consumer + 1) * W, tile.end), false};
  online_softmax<true, Cfg>(acc_s, tScS_rc, mine, seen, scale_log2, row_max, row_sum, scale_row);
  CUTE_UNROLL
  for (int i = 0; i < size(acc_s); ++i) p_elem(i) = Elem(acc_s(i));
  Barrier::wait(&ss.v_full[stage], phase);
  gemm_fresh(mma_o, tOrP, tOrV(_, _, _, stage), acc_o);
  warpgroup_wait<0>();
  warpgroup_fence_operand(acc_o);
  Barrier::arrive(&ss.v_empty[stage]);
}

template <class Cfg>
__global__ void __launch_bounds__(Cfg::kThreads, 1)
    diffusion_fwd_kernel(__grid_constant__ const FwdParams<Cfg> p) {
  using Elem = typename Cfg::Elem;
  constexpr int BM = Cfg::BM, BN = Cfg::BN, D = Cfg::D, STAGES = Cfg::STAGES;
  using Barrier = cutlass::arch::ClusterBarrier;

  extern __shared__ __align__(1024) char smem_raw[];
  auto& ss = *reinterpret_cast<FwdShared<Cfg>*>(smem_raw);
  Tensor sQ = make_tensor(make_smem_ptr(ss.q), typename Cfg::SmemLayoutQ{});
  Tensor sK = make_tensor(make_smem_ptr(ss.k), typename Cfg::SmemLayoutKV{});
  Tensor sV = make_tensor(make_smem_ptr(ss.v), typename Cfg::SmemLayoutKV{});
  Tensor sVt = make_tensor(make_smem_ptr(ss.v), typename Cfg::SmemLayoutVt{});

  const TilePlans plans = p.mask.fwd_tiles(BM, BN);
  const TilePlans& kernel_plans = plans;
  const int num_items = p.num_tiles * p.batch * p.heads;
  const int warp_group = threadIdx.x / 128;

  if (threadIdx.x == 0)  // before init_fwd_barriers' fence and CTA sync
    for (int i = 0; i < Cfg::QSTAGES; ++i) cutlass::arch::ClusterBarrier::init(&ss.item_full[i], 1);
  init_fwd_barriers<Cfg>(ss);

  if (warp_group == 0) {  // ---------------------------------------------------------- producer
    cutlass::arch::warpgroup_reg_dealloc<Cfg::kProducerRegs>();
    if (threadIdx.x == 0) {
      trace_event<Cfg>(0, kTraceEvents - 4);  // the CTA's start (harness `trace` only)
      trace_event<Cfg>(0, kTraceEvents - 3);
      Tensor mQ = p.tma_q.get_tma_tensor(make_shape(p.seqlen, D, p.heads, p.batch));
      Tensor mK = p.tma_k.get_tma_tensor(make_shape(p.seqlen, D, p.kv_heads, p.batch));
      Tensor mV = p.tma_v.get_tma_tensor(make_shape(p.seqlen, D, p.kv_heads, p.batch));
      auto tma_q = p.tma_q.get_slice(0);
      auto tma_k = p.tma_k.get_slice(0);
      auto tma_v = p.tma_v.get_slice(0);
      Tensor tKsK = tma_k.partition_D(sK);  // (TMA, 1, 1, STAGES)
      Tensor tVsV = tma_v.partition_D(sV);
      int it = 0;  // K/V visits so far, over every work item of this CTA: the ring position
      for (int item = 0, w = walk_item(p.schedule, 0, num_items); w < num_items;
           w = walk_item(p.schedule, ++item, num_items)) {
        // kStartTile: the kernel's plans and mask; otherwise the item's own (sample-relative rows).
        const ItemGeom ig = item_geom<Cfg>(p, w);
        const WorkItem wi = ig.wi;
        const int kvh = wi.h / (p.heads / p.kv_heads);
        const SequenceMask& mask = Cfg::kStart == kStartTile ? p.mask : ig.mask;
        const TilePlans iplans = Cfg::kStart == kStartTile ? plans : mask.fwd_tiles(BM, BN);
        const Interval q_tile = iplans.tile(wi.qt);
        const TileRuns runs = iplans.runs(wi.qt);
        const FwdItem published{wi.b, wi.h, ig.offset, mask, q_tile, runs, keys_seen_by_all(mask, q_tile)};
        // Published once the consumers are done with the Q buffer's previous item (produce_q's
        // wait), before the Q load is issued: they decode nothing themselves.
        auto publish = [&](int buf) {
          ss.item[buf] = published;
          cutlass::arch::ClusterBarrier::arrive(&ss.item_full[buf]);
        };
        trace_event<Cfg>(item, kTraceProducer + 0);
        if constexpr (Cfg::kStart != kStartTile) {
          // Tiles start anywhere: the TMA boxes are placed by element coordinates (rows past the
          // tensor's end read as zeros; rows past the half or sample are masked by the consumers).
          Tensor gQ = local_tile(domain_offset(make_coord(ig.offset + q_tile.lo, 0), mQ(_, _, wi.h, wi.b)),
                                 Shape<Int<BM>, Int<D>>{}, make_coord(0, 0));
          produce_q<Cfg>(p.tma_q, tma_q, gQ, sQ, ss, item, publish);
          trace_event<Cfg>(item, kTraceProducer + 1);
          produce_kv_runs_at<BN, D, STAGES>(iplans, runs, it, ig.offset, Cfg::kTileBytesKV, p.tma_k,
                                            tma_k, mK(_, _, kvh, wi.b), tKsK, ss.k_full, ss.k_empty,
                                            p.tma_v, tma_v, mV(_, _, kvh, wi.b), tVsV, ss.v_full,
                                            ss.v_empty);
        } else {
          Tensor gQ = local_tile(mQ(_, _, wi.h, wi.b), Shape<Int<BM>, Int<D>>{}, make_coord(q_tile.lo / BM, 0));
          produce_q<Cfg>(p.tma_q, tma_q, gQ, sQ, ss, item, publish);
          trace_event<Cfg>(item, kTraceProducer + 1);
          Tensor tKgK = tma_k.partition_S(
              local_tile(mK(_, _, kvh, wi.b), Shape<Int<BN>, Int<D>>{}, make_coord(_, 0)));
          Tensor tVgV = tma_v.partition_S(
              local_tile(mV(_, _, kvh, wi.b), Shape<Int<BN>, Int<D>>{}, make_coord(_, 0)));
          produce_kv_runs<BN, STAGES>(plans, runs, it, Cfg::kTileBytesKV, p.tma_k, tKgK, tKsK,
                                      ss.k_full, ss.k_empty, p.tma_v, tVgV, tVsV, ss.v_full, ss.v_empty);
        }
        trace_event<Cfg>(item, kTraceProducer + 2);
      }
      trace_event<Cfg>(0, kTraceEvents - 2);  // the producer's end
      trace_event<Cfg>(0, kTraceEvents - 1);
    }
    return;
  }

  // ------------------------------------------------------------------------------------ consumers
  // Not fwd_consumers (attn_common.cuh): with its visit and mask test as that loop's hooks the PTX
  // matched only after rewrites, and ptxas still renamed registers (csrc/NOTES.md "Consumer loop").
  cutlass::arch::warpgroup_reg_alloc<Cfg::kConsumerRegs>();
  const int consumer = warp_group - 1, tid = threadIdx.x % 128;
  typename Cfg::MmaS mma_s;
  typename Cfg::MmaO mma_o;
  auto thr_s = mma_s.get_thread_slice(tid);
  auto thr_o = mma_o.get_thread_slice(tid);
  Tensor sQc = local_tile(sQ, Shape<Int<Cfg::kConsumerRows>, Int<D>>{}, make_coord(consumer, 0));
  Tensor tSrQ = thr_s.partition_fragment_A(sQc);  // smem descriptors, (MMA, M, K, QSTAGES)
  Tensor tSrK = thr_s.partition_fragment_B(sK);   // (MMA, N, K, STAGES)
  Tensor tOrV = thr_o.partition_fragment_B(sVt);  // (MMA, N=D, K=BN, STAGES)
  Tensor acc_o = partition_fragment_C(mma_o, Shape<Int<Cfg::kConsumerRows>, Int<D>>{});
  Tensor acc_s = partition_fragment_C(mma_s, Shape<Int<Cfg::kConsumerRows>, Int<BN>>{});
  Tensor p_elem = make_fragment_like<Elem>(acc_s);  // P of the previous tile, the A of O += P V
  Tensor tOrP = make_tensor(p_elem.data(), acc_as_operand_a(p_elem.layout()));
  // (row, column) of every score this thread holds, relative to (row_base, tile start).
  Tensor tScS = thr_s.partition_C(make_identity_tensor(Shape<Int<Cfg::kConsumerRows>, Int<BN>>{}));
  Tensor tScS_rc = make_tensor(tScS.data(), acc_rowcol(tScS.layout()));
  Tensor tOcO = thr_o.partition_C(make_identity_tensor(Shape<Int<Cfg::kConsumerRows>, Int<D>>{}));
  Tensor tOcO_rc = make_tensor(tOcO.data(), acc_rowcol(tOcO.layout()));
  constexpr int kRows = 2;  // rows per thread (r = 0, 1: lane/4 and lane/4 + 8)

  int it = 0;  // the producer's ring position, kept in step
  if (Cfg::kPingPong && consumer == Cfg::kConsumers - 1) named_barrier_arrive(kTurnBarrier + 0);  // see kTurnBarrier
  for (int item = 0, w = walk_item(p.schedule, 0, num_items); w < num_items;
       w = walk_item(p.schedule, ++item, num_items)) {
    const int ev = consumer * 8;  // trace_event's slots, as in fwd_consumers (harness `trace` only)
    trace_event<Cfg>(item, ev + 0);
    // The item as the producer decoded it (FwdItem); the loop's plans from its mask.
    const QSlot<Cfg> qs(item);
    Barrier::wait(&ss.item_full[qs.buf], qs.phase);
    const FwdItem fi = ss.item[qs.buf];
    const SequenceMask& mask = Cfg::kStart == kStartVarlen ? fi.mask : p.mask;
    const TilePlans plans = Cfg::kStart == kStartTile ? kernel_plans : mask.fwd_tiles(BM, BN);
    const int row_offset = fi.row_offset;  // packed row of position 0 (0 unless kStartVarlen)
    const Interval q_tile = fi.q_tile;
    const TileRuns runs = fi.runs;
    const int row_base = q_tile.lo + consumer * Cfg::kConsumerRows;  // this warpgroup's first row
    float row_max[kRows], row_sum[kRows], scale_row[kRows];
    Intervals seen[kRows];
    for (int i = 0; i < kRows; ++i) {
      row_max[i] = -INFINITY;
      row_sum[i] = 0.f;
      seen[i] = mask.row_intervals(row_base + get<0>(tScS_rc(i, 0)));
    }
    clear(acc_o);
    const int n_first = runs.end[0] - runs.begin[0], n_tiles = runs.count();
    const Intervals all_keys = fi.all_keys;
    Barrier::wait(&ss.q_full[qs.buf], qs.phase);
    trace_event<Cfg>(item, ev + 1);
    if (consumer == 0) trace_value<Cfg>(item, kTraceTiles, n_tiles);
    // j0: the loop's first visit (1 after a narrow one).
    int j0 = 0;
    if (narrow_first_visit<Cfg>(mask, q_tile, runs)) {
      narrow_visit<Cfg>(ss, sQc, sK, sVt, qs.buf, it % STAGES, (it / STAGES) & 1, acc_o,
                        step_visit<Cfg>(plans, runs.begin[0], true, all_keys), seen, p.scale_log2,
                        row_max, row_sum, scale_row, consumer, tid);
      j0 = 1;
      ++it;
    }

    for (int j = j0; j < n_tiles; ++j, ++it) {
      const int stage = it % STAGES, phase = (it / STAGES) & 1;
      const int prev = (it + STAGES - 1) % STAGES, prev_phase = ((it - 1) / STAGES) & 1;
      const int kt = j < n_first ? runs.begin[0] + j : runs.begin[1] + (j - n_first);
      const Visit visit = step_visit<Cfg>(plans, kt, j < n_first, all_keys);
      Barrier::wait(&ss.k_full[stage], phase);
      if (j > j0) Barrier::wait(&ss.v_full[prev], prev_phase);
      if (Cfg::kPingPong) named_barrier_sync(kTurnBarrier + consumer);
      if (j == j0) trace_event<Cfg>(item, ev + 2);
      // S_j = Q K_j^T, then (FlashAttention-3's in-warpgroup overlap) O += P_{j-1} V_{j-1}
      // behind it: the softmax of S_j below runs while the tensor cores do that P V.
      gemm_fresh(mma_s, tSrQ(_, _, _, qs.buf), tSrK(_, _, _, stage), acc_s);
      if (j > j0) gemm_batch(mma_o, tOrP, tOrV(_, _, _, prev), acc_o, false);
      if (j > j0) warpgroup_wait<1>(); else warpgroup_wait<0>();  // S_j is ready
      if (j == j0) trace_event<Cfg>(item, ev + 3);
      // Hand the turn over only now: a bar.arrive between the wgmma issue and its wait makes ptxas
      // serialize the wgmmas (warning C7514; nvcc 13.0). The other consumer's S then queues behind
      // our P V, which keeps the tensor cores busy all the same.
      if (Cfg::kPingPong) named_barrier_arrive(next_turn<Cfg>(consumer));
      warpgroup_fence_operand(acc_s);
      Barrier::arrive(&ss.k_empty[stage]);

      [[maybe_unused]] bool rescale = true;
      if constexpr (probe_of<Cfg> & kProbeNoSoftmax) {
        for (int i = 0; i < kRows; ++i) scale_row[i] = 1.f;
      } else if constexpr (Cfg::kSoftmaxIlp) {
        if (!(probe_of<Cfg> & kProbeNoMask) && (!visit.full || visit.end - visit.start < BN))
          rescale = online_softmax<true, Cfg>(acc_s, tScS_rc, visit, seen, p.scale_log2, row_max, row_sum, scale_row);
        else
          rescale = online_softmax<false, Cfg>(acc_s, tScS_rc, visit, seen, p.scale_log2, row_max, row_sum, scale_row);
      } else if (!(probe_of<Cfg> & kProbeNoMask) && (!visit.full || visit.end - visit.start < BN)) {
        online_softmax<true>(acc_s, tScS_rc, visit, seen, p.scale_log2, row_max, row_sum, scale_row);
      } else {
        online_softmax<false>(acc_s, tScS_rc, visit, seen, p.scale_log2, row_max, row_sum, scale_row);
      }

      warpgroup_wait<0>();  // P_{j-1} V_{j-1} is in acc_o, and p_elem is free again
      warpgroup_fence_operand(acc_o);
      if (j > j0) Barrier::arrive(&ss.v_empty[prev]);
      Tensor o_rc = make_tensor(acc_o.data(), acc_rowcol(acc_o.layout()));
      // O is still zero at the first visit (j == 0): no rescale. kStaleMax: a warp-uniform branch.
      if (j > 0 && (!Cfg::kStaleMax || rescale)) {
        CUTE_UNROLL
        for (int i = 0; i < kRows; ++i)
          CUTE_UNROLL
          for (int c = 0; c < size<1>(o_rc); ++c) o_rc(i, c) *= scale_row[i];
      }
      CUTE_UNROLL
      for (int i = 0; i < size(acc_s); ++i) p_elem(i) = Elem(acc_s(i));
      if (j == j0) trace_event<Cfg>(item, ev + 4);
    }
    trace_event<Cfg>(item, ev + 5);
    // The consumers' last S of this item has read Q: the producer may load the next item's (one
    // arrival after the loop, not a test in every step).
    Barrier::arrive(&ss.q_empty[qs.buf]);
    if (n_tiles > j0) {  // the last tile's O += P V (none after a lone narrow visit: done whole)
      const int last = (it - 1) % STAGES;
      Barrier::wait(&ss.v_full[last], ((it - 1) / STAGES) & 1);
      gemm_batch(mma_o, tOrP, tOrV(_, _, _, last), acc_o, false);
      warpgroup_wait<0>();
      warpgroup_fence_operand(acc_o);
      Barrier::arrive(&ss.v_empty[last]);
    }

    trace_event<Cfg>(item, ev + 6);
    // Epilogue; rows of the tile past its half (or sample) are not stored.
    store_item<Cfg>(p, ss, acc_o, tOcO_rc, row_sum, row_max, fi.b, fi.h, row_base, q_tile.hi,
                    row_offset, p.seqlen, consumer, tid);
    trace_event<Cfg>(item, ev + 7);
  }
  store_o_drain<Cfg>(tid);
}

// ------------------------------------------------------------------------------------- launch
// Plain arguments (no torch): each (dtype, head dim) instantiation lives in its own translation
// unit (csrc/hopper/diffusion_fwd_*.cu) so that ninja builds them in parallel; the torch binding
// (csrc/bindings/diffusion_fwd_sm90.cu) only fills FwdArgs.
struct FwdArgs {
  const void *q, *k, *v;
  void* o;
  float* lse;
  int64_t q_stride[3], k_stride[3], v_stride[3], o_stride[3];  // (batch, seq, head), elements
  int64_t lse_stride[2];                                       // (batch, head)
  int batch, seqlen, heads, kv_heads, n_noisy, block_size;  // mask: [n_noisy | seqlen - n_noisy]
  float scale;
  const int32_t* tile_order;
  int num_tiles;
  int max_ctas;  // persistent grid: at most this many CTAs (the SM count); 0 = one CTA per work item
  cudaStream_t stream;
  int order_chunk = 0, order_block = 0;  // work_order's arguments (0, 0: the plain order); the harness's A/B sets them
  // kStartVarlen configs only (batch 1, seqlen = packed tokens): the sample of each tile_order
  // entry and the samples' offsets (csrc/NOTES.md "Odd lengths and varlen").
  const int32_t *tile_sample = nullptr, *cu_seqlens = nullptr;
  // The noisy diagonal's narrow visit (narrow_visit) where the instantiation has it
  // (fwd_narrow_built); the backend asks for it where it measured faster (short halves).
  bool narrow_diag = false;
};

// Tiles of the shipped instantiations. D = 256 takes 64-key tiles: a consumer thread then holds O
// (64 x 256 fp32 over 128 threads: 128 registers), S (32) and P (16) within setmaxnreg's 240, and
// Q (64 KB) plus two stages of K and V (2 x 2 x 32 KB) fit in shared memory.
constexpr int kFwdBlockM = 128, kFwdStages = 2;
constexpr int fwd_block_n(int d) { return d > 128 ? 64 : 128; }

// The forward's WorkOrder: a slot re-reads its kv head's K and V, which the group's query heads
// (adjacent slots) share.
template <class Cfg>
WorkOrder fwd_work_order(int batch, int seqlen, int heads, int kv_heads, int chunk = 0, int block = 0) {
  const int64_t kv_bytes = int64_t{2} * seqlen * Cfg::D * sizeof(typename Cfg::Elem);
  return work_order(batch * heads, kv_bytes * kv_heads / heads, chunk, block);
}

// Any FwdConfig (the shipped ones through launch_fwd; kStartAny / kStartVarlen ones directly).
template <class Cfg>
cudaError_t launch_fwd_cfg(const FwdArgs& a) {
  using Elem = typename Cfg::Elem;
  auto ptr = [](const void* x) { return static_cast<const Elem*>(x); };
  const FwdParams<Cfg> p = with_tma_o<Cfg>({
      make_tma_q<Cfg>(ptr(a.q), a.seqlen, a.heads, a.batch, a.q_stride[1], a.q_stride[2], a.q_stride[0]),
      make_tma_kv<Cfg>(ptr(a.k), a.seqlen, a.kv_heads, a.batch, a.k_stride[1], a.k_stride[2], a.k_stride[0]),
      make_tma_kv<Cfg>(ptr(a.v), a.seqlen, a.kv_heads, a.batch, a.v_stride[1], a.v_stride[2], a.v_stride[0]),
      static_cast<Elem*>(a.o), a.lse, a.o_stride[1], a.o_stride[2], a.o_stride[0],
      a.lse_stride[1], a.lse_stride[0], a.seqlen, a.heads, a.kv_heads, a.batch,
      SequenceMask{a.n_noisy, a.seqlen - a.n_noisy, a.block_size}, a.scale * 1.4426950408889634f,
      a.tile_order, a.num_tiles, a.tile_sample, a.cu_seqlens,
      fwd_work_order<Cfg>(a.batch, a.seqlen, a.heads, a.kv_heads, a.order_chunk, a.order_block)});
  auto kernel = diffusion_fwd_kernel<Cfg>;
  constexpr int smem = sizeof(FwdShared<Cfg>);
  static const cudaError_t configured =  // once per instantiation: the attribute is per function
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (configured != cudaSuccess) return configured;
  const int items = a.batch * a.heads * a.num_tiles;
  const int ctas = a.max_ctas > 0 && a.max_ctas < items ? a.max_ctas : items;
  kernel<<<ctas, Cfg::kThreads, smem, a.stream>>>(p);
  return cudaGetLastError();
}

// The shipped config with its tiles starting per START (the one place that names the options).
// The TMA-store epilogue wherever its staging buffer fits (D = 256: Q, two stages of K and V and
// O would take 256 KB): harness `smem-o` (session 8), bf16 D = 128, 1.11x at n = 1K, 1.08x at
// 2K, 1.04x at 4K, 1.025x at 8K. Two Q buffers measured no gain with or without it (+-1 %) in the plain kernel (fwd_q_stages).
// The softmax of online_softmax_tile_ilp (SOFTMAX_ILP_), with a stale max from D = 128 on
// (STALE_MAX_, fwd_stale_max says why not at D = 64): harness softmax-ab (session 16, bf16 D = 128,
// n 1K-8K, block sizes 4 / 16, GQA 32/8) 1.003-1.089x over the one-chain softmax (1.00-1.02 at
// n = 1K, 1.05-1.09 from 2K on), D = 256 1.03-1.095x from 2K on, D = 64 (four chains alone)
// 1.00-1.067x.
constexpr bool fwd_smem_o(int d) { return d <= 128; }
// Two Q buffers in the narrow kernel (the backend's at n <= 1K, items of ~5 key tiles): the
// producer loads an item's Q one item ahead, where with one buffer it waits for both consumers'
// last S of the item before (the trace at n = 1K, D = 128: Q issue -> ready 1.46 us, the
// consumers' Q wait 0.59 us of an 11.2 us item). Session 35 (fwd_standalone q2-narrow, bf16,
// n = 1K, best of 12 rounds, A/A arms within 0.7 %): D = 128 1.013 / 1.025 / 1.035x at block 16 /
// block 4 / GQA 32/8, D = 64 1.030 / 1.026 / 1.006x. The plain kernel keeps one (sessions 8 and
// 15: 0.985-1.005x; its items are longer), which also leaves D = 256 its shared memory.
constexpr int fwd_q_stages(bool narrow) { return narrow ? 2 : 1; }
template <class Elem, int D, int START, bool NARROW = false>
using FwdShipped = FwdConfig<Elem, D, kFwdBlockM, fwd_block_n(D), kFwdStages, true, START,
                             fwd_q_stages(NARROW), fwd_smem_o(D), true, fwd_stale_max(D), NARROW>;

// Where a second kernel with the noisy diagonal's narrow visit is built: D = 64 and 128 (128-key
// tiles), batched and packed. v9 against v8 (benchmarks.build_ab, bf16, 16K tokens, block 16 / 4;
// csrc/NOTES.md "Session 29"): the forward 1.024 / 1.024x and 1.015x at n = 1K, but 0.988 / 0.996x
// at 2K, 0.980x at 8K and 0.994x for the block-128 control (no narrow visit): the kernel's other
// visits paid for it. So the kernel without it stays as it was, and the backend asks for the
// narrow one where it measured faster (cutlass_diffusion.NARROW_DIAG_*).
constexpr bool fwd_narrow_built(int d, int start) {
  return fwd_block_n(d) == kFwdBlockM && (start == kBatchedStart || start == kStartVarlen);
}

// START: kBatchedStart (batched calls) or kStartVarlen (packed samples: batch 1, tile_sample and
// cu_seqlens set).
template <class Elem, int D, int START = kBatchedStart>
cudaError_t launch_fwd(const FwdArgs& a) {
  if constexpr (fwd_narrow_built(D, START)) {
    if (a.narrow_diag) return launch_fwd_cfg<FwdShipped<Elem, D, START, true>>(a);
  }
  return launch_fwd_cfg<FwdShipped<Elem, D, START>>(a);
}

#define DLM_DECLARE_FWD(ELEM, D)                                         \
  extern template cudaError_t launch_fwd<ELEM, D>(const FwdArgs&); \
  extern template cudaError_t launch_fwd<ELEM, D, kStartVarlen>(const FwdArgs&);
DLM_DECLARE_FWD(cutlass::bfloat16_t, 64)
DLM_DECLARE_FWD(cutlass::bfloat16_t, 128)
DLM_DECLARE_FWD(cutlass::half_t, 64)
DLM_DECLARE_FWD(cutlass::half_t, 128)
DLM_DECLARE_FWD(cutlass::bfloat16_t, 256)
DLM_DECLARE_FWD(cutlass::half_t, 256)
#undef DLM_DECLARE_FWD

}  // namespace dlm::sm90
