// The sm90 backward's dQ kernel (csrc/hopper/diffusion_bwd.cuh has the overview; its
// configurations, DqConfig, are in bwd_parts.cuh).
#pragma once

#include "hopper/bwd_parts.cuh"

namespace dlm::sm90 {

// ------------------------------------------------------------------------------------------ dQ
template <class Cfg>
__global__ void __launch_bounds__(Cfg::kThreads, 1)
    diffusion_bwd_dq_kernel(__grid_constant__ const DqParams<Cfg> p) {
  using Elem = typename Cfg::Elem;
  constexpr int BM = Cfg::BM, BN = Cfg::BN, D = Cfg::D, STAGES = Cfg::STAGES;
  constexpr int kRowsW = Cfg::kConsumerRows;
  using Barrier = cutlass::arch::ClusterBarrier;
  using TxBarrier = cutlass::arch::ClusterTransactionBarrier;

  extern __shared__ __align__(1024) char smem_raw[];
  auto& ss = *reinterpret_cast<typename Cfg::SharedStorage*>(smem_raw);
  Tensor sQ = make_tensor(make_smem_ptr(ss.q), typename Cfg::SmemLayoutQ{});
  Tensor sdO = make_tensor(make_smem_ptr(ss.dout), typename Cfg::SmemLayoutQ{});
  Tensor sK = make_tensor(make_smem_ptr(ss.k), typename Cfg::SmemLayoutKV{});
  Tensor sV = make_tensor(make_smem_ptr(ss.v), typename Cfg::SmemLayoutKV{});
  Tensor sKt = make_tensor(make_smem_ptr(ss.k), typename Cfg::SmemLayoutKt{});

  int e, bh;
  p.order.decode(blockIdx.x, p.entries, e, bh);
  const int b = bh / p.heads, h = bh % p.heads;
  const int kvh = h / (p.heads / p.kv_heads);
  const SampleGeom geom = sample_geom<Cfg>(p, e);
  const SequenceMask& mask = Cfg::kStart == kStartTile ? p.mask : geom.mask;
  const int offset = Cfg::kStart == kStartVarlen ? geom.offset : 0;  // packed row of position 0
  const TilePlans plans = mask.fwd_tiles(BM, BN);
  const int qt = p.tile_order[e];
  const Interval q_tile = plans.tile(qt);
  const TileRuns runs = plans.runs(qt);
  const int warp_group = threadIdx.x / 128;

  if (threadIdx.x == 0) {
    Barrier::init(&ss.q_full, 1);
    init_kv_ring<STAGES>(ss.k_full, ss.k_empty, ss.v_full, ss.v_empty, 128 * Cfg::kConsumers);
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();
  // Launched as a programmatic dependent of the dK/dV kernel: its set-up above ran under that
  // grid's end; nothing is read or written before it has completed.
  wait_for_prerequisite();

  if (warp_group == 0) {  // ---------------------------------------------------------- producer
    cutlass::arch::warpgroup_reg_dealloc<24>();
    if (threadIdx.x == 0) {
      Tensor mQ = p.tma_q.get_tma_tensor(make_shape(p.seqlen, D, p.heads, p.batch));
      Tensor mdO = p.tma_do.get_tma_tensor(make_shape(p.seqlen, D, p.heads, p.batch));
      TxBarrier::arrive_and_expect_tx(&ss.q_full, 2 * Cfg::kTileBytesQ);
      load_tile_pair<Cfg::kStart, BM, D>(ss.q_full, offset, q_tile.lo, p.tma_q, mQ(_, _, h, b), sQ,
                                         p.tma_do, mdO(_, _, h, b), sdO);

      Tensor mK = p.tma_k.get_tma_tensor(make_shape(p.seqlen, D, p.kv_heads, p.batch));
      Tensor mV = p.tma_v.get_tma_tensor(make_shape(p.seqlen, D, p.kv_heads, p.batch));
      auto tma_k = p.tma_k.get_slice(0);
      auto tma_v = p.tma_v.get_slice(0);
      Tensor tKsK = tma_k.partition_D(sK);  // (TMA, 1, 1, STAGES)
      Tensor tVsV = tma_v.partition_D(sV);
      int it = 0;
      if constexpr (Cfg::kStart != kStartTile) {
        produce_kv_runs_at<BN, D, STAGES>(plans, runs, it, offset, Cfg::kTileBytesKV, p.tma_k, tma_k,
                                          mK(_, _, kvh, b), tKsK, ss.k_full, ss.k_empty, p.tma_v,
                                          tma_v, mV(_, _, kvh, b), tVsV, ss.v_full, ss.v_empty);
        return;
      }
      Tensor tKgK = tma_k.partition_S(local_tile(mK(_, _, kvh, b), Shape<Int<BN>, Int<D>>{}, make_coord(_, 0)));
      Tensor tVgV = tma_v.partition_S(local_tile(mV(_, _, kvh, b), Shape<Int<BN>, Int<D>>{}, make_coord(_, 0)));
      produce_kv_runs<BN, STAGES>(plans, runs, it, Cfg::kTileBytesKV, p.tma_k, tKgK, tKsK,
                                  ss.k_full, ss.k_empty, p.tma_v, tVgV, tVsV, ss.v_full, ss.v_empty);
    }
    return;
  }

  // ------------------------------------------------------------------------------------ consumers
  cutlass::arch::warpgroup_reg_alloc<240>();
  const int consumer = warp_group - 1, tid = threadIdx.x % 128;
  constexpr int kKeysW = Cfg::kKeysW;
  // Cfg::kSplitKeys: both consumers on the CTA's rows, consumer c on keys [c kKeysW, (c + 1) kKeysW)
  // of every visited tile; otherwise consumer c on rows [c 64, c 64 + 64) and every key.
  const int row_slot = Cfg::kSplitKeys ? 0 : consumer, key_slot = Cfg::kSplitKeys ? consumer : 0;
  const int row_base = q_tile.lo + row_slot * kRowsW;
  typename Cfg::MmaSdp mma_sdp;
  typename Cfg::MmaDq mma_dq;
  auto thr_sdp = mma_sdp.get_thread_slice(tid);
  auto thr_dq = mma_dq.get_thread_slice(tid);
  Tensor sQc = local_tile(sQ, Shape<Int<kRowsW>, Int<D>>{}, make_coord(row_slot, 0));
  Tensor sdOc = local_tile(sdO, Shape<Int<kRowsW>, Int<D>>{}, make_coord(row_slot, 0));
  Tensor tSrQ = thr_sdp.partition_fragment_A(sQc);  // smem descriptors: (MMA, M, K)
  Tensor tSrdO = thr_sdp.partition_fragment_A(sdOc);
  auto keys = Shape<Int<kKeysW>, Int<D>, Int<STAGES>>{};
  Tensor tSrK = thr_sdp.partition_fragment_B(local_tile(sK, keys, make_coord(key_slot, 0, 0)));  // (MMA, N, K, STAGES)
  Tensor tSrV = thr_sdp.partition_fragment_B(local_tile(sV, keys, make_coord(key_slot, 0, 0)));
  Tensor tQrKt = thr_dq.partition_fragment_B(  // (MMA, N = D, K = kKeysW, STAGES)
      local_tile(sKt, Shape<Int<D>, Int<kKeysW>, Int<STAGES>>{}, make_coord(0, key_slot, 0)));
  Tensor acc_dq = partition_fragment_C(mma_dq, Shape<Int<kRowsW>, Int<D>>{});
  clear(acc_dq);
  Tensor tScS = thr_sdp.partition_C(make_identity_tensor(Shape<Int<kRowsW>, Int<kKeysW>>{}));
  Tensor tScS_rc = make_tensor(tScS.data(), acc_rowcol(tScS.layout()));
  constexpr int kRows = 2;
  Intervals seen[kRows];
  float lse2[kRows], delta[kRows];
  CUTE_UNROLL
  for (int i = 0; i < kRows; ++i) {
    const int row = row_base + get<0>(tScS_rc(i, 0));
    const int64_t at = (static_cast<int64_t>(b) * p.heads + h) * p.seqlen + offset + row;
    seen[i] = mask.row_intervals(row);
    lse2[i] = row < q_tile.hi ? p.lse2[at] : INFINITY;  // rows past the tile: P = 0
    delta[i] = row < q_tile.hi ? p.delta[at] : 0.f;
  }
  Barrier::wait(&ss.q_full, 0);

  int it = 0;
  for (int r = 0; r < 2; ++r) {
    for (int kt = run_begin(runs, r); kt < run_end(runs, r); ++kt, ++it) {
      const int stage = it % STAGES, phase = (it / STAGES) & 1;
      const Visit visit = plans.visit(qt, kt);
      Tensor acc_s = partition_fragment_C(mma_sdp, Shape<Int<kRowsW>, Int<kKeysW>>{});
      Tensor acc_dp = partition_fragment_C(mma_sdp, Shape<Int<kRowsW>, Int<kKeysW>>{});
      Barrier::wait(&ss.k_full[stage], phase);
      gemm_fresh(mma_sdp, tSrQ, tSrK(_, _, _, stage), acc_s);
      Barrier::wait(&ss.v_full[stage], phase);
      gemm_fresh(mma_sdp, tSrdO, tSrV(_, _, _, stage), acc_dp);
      warpgroup_wait<1>();
      warpgroup_fence_operand(acc_s);

      Tensor s = make_tensor(acc_s.data(), acc_rowcol(acc_s.layout()));  // (rows, keys)
      const bool masked = !visit.full || visit.end - visit.start < BN;
      auto exponentiate = [&](auto masked_tag) {
        constexpr bool kMasked = decltype(masked_tag)::value;
        CUTE_UNROLL
        for (int i = 0; i < kRows; ++i) {
          CUTE_UNROLL
          for (int j = 0; j < size<1>(s); ++j) {
            float x = s(i, j) * p.scale_log2 - lse2[i];
            if constexpr (kMasked) {
              const int col = visit.start + key_slot * kKeysW + get<1>(tScS_rc(i, j));
              x = col < visit.end && seen[i].contains(col) ? x : -INFINITY;
            }
            s(i, j) = exp2_approx(x);
          }
        }
      };
      with_mask_decided(masked, exponentiate);
      warpgroup_wait<0>();
      warpgroup_fence_operand(acc_dp);
      Barrier::arrive(&ss.v_empty[stage]);  // V is read only by dP
      Tensor dp = make_tensor(acc_dp.data(), acc_rowcol(acc_dp.layout()));
      Tensor ds_elem = make_fragment_like<Elem>(acc_dp);
      Tensor ds_rc = make_tensor(ds_elem.data(), acc_rowcol(ds_elem.layout()));
      CUTE_UNROLL
      for (int i = 0; i < kRows; ++i)
        CUTE_UNROLL
        for (int j = 0; j < size<1>(dp); ++j) ds_rc(i, j) = Elem(s(i, j) * (dp(i, j) - delta[i]));
      Tensor tdSa = make_tensor(ds_elem.data(), acc_as_operand_a(ds_elem.layout()));

      warpgroup_fence_operand(acc_dq);
      warpgroup_arrive();
      CUTE_UNROLL
      for (int kb = 0; kb < size<2>(tdSa); ++kb)
        gemm(mma_dq, tdSa(_, _, kb), tQrKt(_, _, kb, stage), acc_dq);
      warpgroup_commit_batch();
      warpgroup_wait<0>();
      warpgroup_fence_operand(acc_dq);
      Barrier::arrive(&ss.k_empty[stage]);
    }
  }

  if constexpr (Cfg::kSplitKeys) {
    // dQ = consumer 0's partial + consumer 1's, through the K ring (64 KB; every load has been
    // consumed once both consumers are past their last matmul).
    static_assert(sizeof(ss.k) >= decltype(size(acc_dq))::value * 128 * sizeof(float));
    float4* xfer = reinterpret_cast<float4*>(ss.k);
    bar_sync(kDqSumBarrier, 256);
    if (consumer == 1) fragment_give(xfer, acc_dq, tid);
    bar_sync(kDqSumBarrier, 256);
    if (consumer == 1) return;
    fragment_take<true>(xfer, acc_dq, tid);
  }
  Tensor tQcQ = thr_dq.partition_C(make_identity_tensor(Shape<Int<kRowsW>, Int<D>>{}));
  // Rows of the tile past its half (or sample) are not stored (row_end = q_tile.hi).
  Elem* dq = p.grad_a + b * p.a_stride_b + h * p.a_stride_h + offset * p.a_stride_s;
  if constexpr (Cfg::kTmaStore) {
    if (row_base + kRowsW <= q_tile.hi) {  // all 64 rows of this warpgroup stored: through TMA
      stage_rows<Elem, typename Cfg::SmemLayoutQ>(acc_dq, p.scale, smem_addr(ss.q) + row_slot * kRowsW * 128, tid);
      tma_store_fence();
      bar_sync(kGradStoreBarrier + consumer, 128);
      if (tid == 0) {
        store_rows_tma<D>(p.tma_store_a, sQc, p.seqlen, p.heads, p.batch, offset + row_base, h, b);
        tma_store_arrive();
        tma_store_wait<0>();  // the staging rows must outlive the copy's read (the CTA exits next)
      }
      return;
    }
  }
  if (probe_stores<Cfg>(acc_dq)) store_rows(acc_dq, tQcQ, p.scale, dq, p.a_stride_s, row_base, q_tile.hi);
}

}  // namespace dlm::sm90
