// EXPERIMENT (session 10, not shipped; csrc/NOTES.md "Session 10"): fwd_consumers (attn_common.cuh)
// with the pipeline carried across work items, for FwdConfig<..., CARRY_ = true>. The block-sparse
// forward (SparseConsumerSide) and the diffusion forward (DiffusionConsumerSide, diffusion_fwd.cuh)
// run it for such configs only (harness modes `carry` of tests/cuda/block_sparse_fwd_standalone.cu
// and diffusion_fwd_standalone.cu); the shipped configs keep their loops, whose SASS this file does
// not touch. After its A/B this loop either replaces fwd_consumers (one loop again) or is deleted.
//
// Why: at 10 % density an item of the block-sparse forward visits 13 key tiles at S = 16K and
// costs ~2.5 tile-times more than its tiles: both consumers reach the item's end together, so
// the tensor cores idle through the last P V alone, the epilogue, the next Q, and the first S
// whose softmax has no P V to hide behind. Here step 0 of item i + 1 issues S_0 of i + 1 together
// with the last P V of item i (two Q buffers: Q of i + 1 is loaded while item i runs), and item i's
// epilogue runs after that softmax, in the other consumer's turn. Predicted: +4-8 % at density 0.1
// (16K), ~0 at 0.5; the price is the two Q buffers (230 KB of smem at D = 128; session 10 measured
// them alone 0.93-0.97x at 0.3 / 0.5), so it may lose there.
#pragma once

#include "hopper/attn_common.cuh"

namespace dlm::sm90 {

template <class Cfg, template <class, class> class Side, class Params, class... SideArgs>
CUTE_DEVICE void fwd_consumers_carry(Params const& p, typename Cfg::SharedStorage& ss, int consumer,
                                     int num_items, SideArgs const&... side_args) {
  static_assert(Cfg::kCarry && Cfg::QSTAGES >= 2);
  using Elem = typename Cfg::Elem;
  constexpr int BN = Cfg::BN, D = Cfg::D, STAGES = Cfg::STAGES;
  using Barrier = cutlass::arch::ClusterBarrier;
  Tensor sQ = make_tensor(make_smem_ptr(ss.q), typename Cfg::SmemLayoutQ{});
  Tensor sK = make_tensor(make_smem_ptr(ss.k), typename Cfg::SmemLayoutKV{});
  Tensor sVt = make_tensor(make_smem_ptr(ss.v), typename Cfg::SmemLayoutVt{});
  cutlass::arch::warpgroup_reg_alloc<240>();
  const int tid = threadIdx.x % 128;
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
  Tensor tScS = thr_s.partition_C(make_identity_tensor(Shape<Int<Cfg::kConsumerRows>, Int<BN>>{}));
  Tensor tScS_rc = make_tensor(tScS.data(), acc_rowcol(tScS.layout()));
  Tensor tOcO = thr_o.partition_C(make_identity_tensor(Shape<Int<Cfg::kConsumerRows>, Int<D>>{}));
  Tensor tOcO_rc = make_tensor(tOcO.data(), acc_rowcol(tOcO.layout()));
  constexpr int kRows = 2;  // rows per thread (r = 0, 1: lane/4 and lane/4 + 8)
  const Side<Cfg, Params> kernel{p, side_args...};

  int it = 0;  // the producer's ring position, kept in step
  // The previous item while its last O += P V and its epilogue are still to come (`live`).
  struct Pending {
    bool live = false;
    int b, h, row_base, row_end, row_offset;
    float row_sum[kRows], row_max[kRows];
  } pend;
  auto store_pending = [&] {
    store_item<Cfg>(p, ss, acc_o, tOcO_rc, pend.row_sum, pend.row_max, pend.b, pend.h,
                    pend.row_base, pend.row_end, pend.row_offset, kernel.o_rows(), consumer, tid);
    pend.live = false;
  };
  // With no next S to go with (an item without key tiles, or the CTA's last item): the pending
  // last P V alone (P in p_elem, V in the ring's slot of position it - 1), then the epilogue.
  auto finish_pending = [&] {
    const int last = (it - 1) % STAGES;
    Barrier::wait(&ss.v_full[last], ((it - 1) / STAGES) & 1);
    warpgroup_fence_operand(acc_o);
    warpgroup_arrive();
    CUTE_UNROLL
    for (int kb = 0; kb < size<2>(tOrP); ++kb) gemm(mma_o, tOrP(_, _, kb), tOrV(_, _, kb, last), acc_o);
    warpgroup_commit_batch();
    warpgroup_wait<0>();
    warpgroup_fence_operand(acc_o);
    Barrier::arrive(&ss.v_empty[last]);
    store_pending();
  };

  for (int item = 0, w = snake_item(0); w < num_items; w = snake_item(++item)) {
    const auto wi = kernel.item(w, consumer, tScS_rc);
    const int n_tiles = wi.n_tiles;
    float row_max[kRows], row_sum[kRows], scale_row[kRows];
    for (int i = 0; i < kRows; ++i) {
      row_max[i] = -INFINITY;
      row_sum[i] = 0.f;
    }
    if (pend.live && n_tiles == 0) finish_pending();
    if (!pend.live) clear(acc_o);  // else acc_o holds the pending item's O until step 0 below
    // Ping-pong turns as in fwd_consumers: consumer 1 pre-arrives so that consumer 0 goes first.
    if (Cfg::kPingPong && consumer == 1 && n_tiles > 0) named_barrier_arrive(kTurnBarrier + 0);
    const QSlot<Cfg> qs(item);
    Barrier::wait(&ss.q_full[qs.buf], qs.phase);

    for (int j = 0; j < n_tiles; ++j, ++it) {
      const int stage = it % STAGES, phase = (it / STAGES) & 1;
      const int prev = (it + STAGES - 1) % STAGES, prev_phase = ((it - 1) / STAGES) & 1;
      const auto tile = kernel.tile(wi, j);
      const bool masked = kernel.may_mask(tile) && kernel.masked(wi, tile);
      // O += P_{j-1} V_{j-1} behind S_j; at step 0 that is the pending item's last P V.
      const bool carried = j == 0 && pend.live;
      const bool pv = j > 0 || carried;
      Barrier::wait(&ss.k_full[stage], phase);
      if (pv) Barrier::wait(&ss.v_full[prev], prev_phase);
      if (Cfg::kPingPong) named_barrier_sync(kTurnBarrier + consumer);
      gemm_fresh(mma_s, tSrQ(_, _, _, qs.buf), tSrK(_, _, _, stage), acc_s);
      if (pv) {
        warpgroup_fence_operand(acc_o);
        warpgroup_arrive();
        CUTE_UNROLL
        for (int kb = 0; kb < size<2>(tOrP); ++kb) gemm(mma_o, tOrP(_, _, kb), tOrV(_, _, kb, prev), acc_o);
        warpgroup_commit_batch();
      }
      if (pv) warpgroup_wait<1>(); else warpgroup_wait<0>();  // S_j is ready
      if (Cfg::kPingPong) named_barrier_arrive(kTurnBarrier + 1 - consumer);
      warpgroup_fence_operand(acc_s);
      Barrier::arrive(&ss.k_empty[stage]);

      const auto bounds = kernel.bounds(wi, tile, tScS_rc);
      if (masked)
        online_softmax_tile<true>(acc_s, tScS_rc, bounds, p.scale_log2, row_max, row_sum, scale_row);
      else
        online_softmax_tile<false>(acc_s, tScS_rc, bounds, p.scale_log2, row_max, row_sum, scale_row);

      warpgroup_wait<0>();  // P_{j-1} V_{j-1} is in acc_o, and p_elem is free again
      warpgroup_fence_operand(acc_o);
      if (pv) Barrier::arrive(&ss.v_empty[prev]);
      if (carried) {  // acc_o is the pending item's O: its epilogue, then this item from zero
        store_pending();
        // Zeroed by the rescale below: a clear(acc_o) in this branch made ptxas serialize the
        // wgmmas of the whole loop (C7514, nvcc 13.0). acc_o is finite, so 0 * acc_o is 0.
        for (int i = 0; i < kRows; ++i) scale_row[i] = 0.f;
      }
      Tensor o_rc = make_tensor(acc_o.data(), acc_rowcol(acc_o.layout()));
      CUTE_UNROLL
      for (int i = 0; i < kRows; ++i)
        CUTE_UNROLL
        for (int c = 0; c < size<1>(o_rc); ++c) o_rc(i, c) *= scale_row[i];
      CUTE_UNROLL
      for (int i = 0; i < size(acc_s); ++i) p_elem(i) = Elem(acc_s(i));
    }
    Barrier::arrive(&ss.q_empty[qs.buf]);
    if (Cfg::kPingPong && consumer == 0 && n_tiles > 0) named_barrier_sync(kTurnBarrier + 0);
    if (n_tiles > 0) {  // its last P V and epilogue go with the next item's first S
      pend.live = true;
      pend.b = wi.b, pend.h = wi.h, pend.row_base = wi.row_base, pend.row_offset = wi.row_offset;
      pend.row_end = kernel.row_end(wi);
      for (int i = 0; i < kRows; ++i) pend.row_sum[i] = row_sum[i], pend.row_max[i] = row_max[i];
    } else {  // no key tile: O = 0, lse = -inf
      store_item<Cfg>(p, ss, acc_o, tOcO_rc, row_sum, row_max, wi.b, wi.h, wi.row_base,
                      kernel.row_end(wi), wi.row_offset, kernel.o_rows(), consumer, tid);
    }
  }
  if (pend.live) finish_pending();
  store_o_drain<Cfg>(tid);
}

}  // namespace dlm::sm90
