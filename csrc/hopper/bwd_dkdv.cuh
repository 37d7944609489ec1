// The sm90 backward's dK/dV kernel (csrc/hopper/diffusion_bwd.cuh has the overview; its
// configurations, DkDvConfig, are in bwd_parts.cuh).
#pragma once

#include "hopper/bwd_parts.cuh"

namespace dlm::sm90 {

// ------------------------------------------------------------------------------------- dK / dV
// A persistent dK/dV CTA's work item as its producer decoded it, handed to the consumers in shared
// memory per K / V buffer (the forward's FwdItem says why: the work order's and the head's
// divisions, the tile_order load and the mask's divisions were each consumer thread's per item;
// here also the dS^T slot's load). Published after the buffer's kv_empty wait, before its loads.
struct DkDvItem {
  int b, kvh, kt, offset, ds_slot0;  // ds_slot0: Cfg::kStoreDs, the slot of the tile's first visit
  SequenceMask mask;
  Interval k_tile;
  TileRuns runs;
  int pad[2];
};
static_assert(sizeof(DkDvItem) == 64, "four 16-byte shared-memory vectors");
template <class Cfg>
struct DkDvShared : Cfg::SharedStorage {
  alignas(16) DkDvItem item[Cfg::kKvBufs];
  alignas(8) uint64_t item_full[Cfg::kKvBufs];
};

template <class Cfg>
__global__ void __launch_bounds__(Cfg::kThreads, 1)
    diffusion_bwd_dkdv_kernel(__grid_constant__ const DkDvParams<Cfg> p) {
  using Elem = typename Cfg::Elem;
  constexpr int BM = Cfg::BM, BN = Cfg::BN, D = Cfg::D, STAGES = Cfg::STAGES;
  constexpr int kRowsW = Cfg::kConsumerRows;  // keys per consumer warpgroup
  using Barrier = cutlass::arch::ClusterBarrier;
  using TxBarrier = cutlass::arch::ClusterTransactionBarrier;

  extern __shared__ __align__(1024) char smem_raw[];
  auto& ss = *reinterpret_cast<DkDvShared<Cfg>*>(smem_raw);
  Tensor sQ = make_tensor(make_smem_ptr(ss.q), typename Cfg::SmemLayoutQ{});
  Tensor sdO = make_tensor(make_smem_ptr(ss.dout), typename Cfg::SmemLayoutQ{});
  Tensor sQt = make_tensor(make_smem_ptr(ss.q), typename Cfg::SmemLayoutQt{});
  Tensor sdOt = make_tensor(make_smem_ptr(ss.dout), typename Cfg::SmemLayoutQt{});
  const int group = p.heads / p.kv_heads;
  const int warp_group = threadIdx.x / 128;

  // Work item w: (entry, batch * kv head slot) of p.order; the CTA's own (one per CTA), or those
  // of its walk (Cfg::kPersistent: walk_item, the snake or p.schedule). The CTA's item-th item
  // uses K / V buffer item % kKvBufs for the (item / kKvBufs)-th time: its barriers' phase parity.
  [[maybe_unused]] const int num_items = p.entries * p.batch * p.kv_heads;
  struct Item {
    int b, kvh, kt, offset;  // offset: the packed row of the sample's position 0 (kStartVarlen)
    int ds_row;              // Cfg::kStoreDs: the sample's first row of the slot table
    int ds_slot0;            // Cfg::kStoreDs: the slot of the tile's first visit
    SequenceMask mask;
    TilePlans plans;  // own: key tiles; other: query tiles
    Interval k_tile;
    TileRuns runs;
  };
  auto item_at = [&](int w) {
    int e, bh;
    p.order.decode(w, p.entries, e, bh);
    const SampleGeom geom = sample_geom<Cfg>(p, e);
    Item t;
    t.b = bh / p.kv_heads, t.kvh = bh % p.kv_heads, t.kt = p.tile_order[e];
    t.offset = Cfg::kStart == kStartVarlen ? geom.offset : 0;
    t.ds_row = 0;
    if constexpr (Cfg::kStoreDs && Cfg::kStart == kStartVarlen) t.ds_row = p.ds_rows[p.tile_sample[e]];
    t.mask = Cfg::kStart == kStartTile ? p.mask : geom.mask;
    t.plans = t.mask.bwd_tiles(BM, BN);
    t.k_tile = t.plans.tile(t.kt);
    t.runs = t.plans.runs(t.kt);
    // Cfg::kStoreDs: the dS^T slot of this key tile's first visit. The slot table numbers a key
    // tile's visits consecutively (run 0, then run 1), so one load per item gives every visit's: a
    // load per visit (by each warp's storing lane) cost the dK/dV kernel 6 % (stores behind the
    // matmuls) to 17 % (before them) at n = 8K (harness `ds`, session 18).
    t.ds_slot0 = 0;
    if constexpr (Cfg::kStoreDs) {
      const bool run0 = run_end(t.runs, 0) > run_begin(t.runs, 0);
      if (run0 || run_end(t.runs, 1) > run_begin(t.runs, 1))
        t.ds_slot0 = p.ds_slots[(t.ds_row + (run0 ? run_begin(t.runs, 0) : run_begin(t.runs, 1))) *
                                    p.ds_k_tiles + t.kt];
    }
    return t;
  };
  // What a consumer of a persistent CTA reads instead of decoding (DkDvItem).
  auto publish = [&](Item const& t, int buf) {
    ss.item[buf] = DkDvItem{t.b, t.kvh, t.kt, t.offset, t.ds_slot0, t.mask, t.k_tile, t.runs, {0, 0}};
    Barrier::arrive(&ss.item_full[buf]);
  };
  auto published = [&](int item) {
    const int buf = item % Cfg::kKvBufs;
    Barrier::wait(&ss.item_full[buf], (item / Cfg::kKvBufs) & 1);
    const DkDvItem d = ss.item[buf];
    Item t;
    t.b = d.b, t.kvh = d.kvh, t.kt = d.kt, t.offset = d.offset, t.ds_row = 0, t.ds_slot0 = d.ds_slot0;
    t.mask = Cfg::kStart == kStartVarlen ? d.mask : p.mask;
    t.plans = t.mask.bwd_tiles(BM, BN);
    t.k_tile = d.k_tile;
    t.runs = d.runs;
    return t;
  };
  // Non-persistent: the CTA's one item, decoded once before the warpgroups part (as both read it).
  [[maybe_unused]] const Item own = item_at(blockIdx.x);
  auto item_of = [&](int w) {
    if constexpr (Cfg::kPersistent) return item_at(w); else return own;
  };
  // f(w, item) for the CTA's items: its one (blockIdx.x), or (persistent) walk_item's walk. The
  // one-item form has no loop: an outer loop around the tile loop cost ~30 registers of spills.
  auto for_each_item = [&](auto&& f) {
    if constexpr (Cfg::kPersistent) {
      for (int item = 0, w = walk_item(p.schedule, 0, num_items); w < num_items;
           w = walk_item(p.schedule, ++item, num_items))
        f(w, item);
    } else {
      f(static_cast<int>(blockIdx.x), 0);
    }
  };
  auto kv_tile = [&](Elem (&buffers)[Cfg::kKvBufs][cosize_v<typename Cfg::SmemLayoutKV>], int buf) {
    return make_tensor(make_smem_ptr(buffers[buf]), typename Cfg::SmemLayoutKV{});
  };

  // The dQ kernel after this one (a programmatic dependent launch) may take the SMs this grid's
  // CTAs leave; it waits for the whole grid's end before it reads anything.
  allow_dependents();
  if (threadIdx.x == 0) {
    for (int i = 0; i < Cfg::kKvBufs; ++i) {
      Barrier::init(&ss.item_full[i], 1);
      Barrier::init(&ss.kv_full[i], 1);
      Barrier::init(&ss.kv_empty[i], 128 * Cfg::kConsumers);
    }
    for (int s = 0; s < STAGES; ++s) {
      Barrier::init(&ss.q_full[s], 1);
      Barrier::init(&ss.do_full[s], 1);
      Barrier::init(&ss.empty[s], 128 * Cfg::kConsumers);
    }
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();

  if (warp_group == 0) {  // ---------------------------------------------------------- producer
    cutlass::arch::warpgroup_reg_dealloc<24>();
    if (threadIdx.x == 0) {
      Tensor mK = p.tma_k.get_tma_tensor(make_shape(p.seqlen, D, p.kv_heads, p.batch));
      Tensor mV = p.tma_v.get_tma_tensor(make_shape(p.seqlen, D, p.kv_heads, p.batch));
      Tensor mQ = p.tma_q.get_tma_tensor(make_shape(p.seqlen, D, p.heads, p.batch));
      Tensor mdO = p.tma_do.get_tma_tensor(make_shape(p.seqlen, D, p.heads, p.batch));
      auto tma_q = p.tma_q.get_slice(0);
      auto tma_do = p.tma_do.get_slice(0);
      Tensor tQsQ = tma_q.partition_D(sQ);     // (TMA, 1, 1, STAGES)
      Tensor tdOsdO = tma_do.partition_D(sdO);
      int it = 0;  // the Q / dO ring position, continued across items
      for_each_item([&](int w, int item) {
        const Item t = item_of(w);
        const int b = t.b, kvh = t.kvh, offset = t.offset;
        const TilePlans& plans = t.plans;
        const TileRuns& runs = t.runs;
        const int buf = item % Cfg::kKvBufs;
        if constexpr (Cfg::kPersistent) {
          Barrier::wait(&ss.kv_empty[buf], ((item / Cfg::kKvBufs) & 1) ^ 1);
          publish(t, buf);
        }
        Tensor sK = kv_tile(ss.k, buf), sV = kv_tile(ss.v, buf);
        TxBarrier::arrive_and_expect_tx(&ss.kv_full[buf], 2 * Cfg::kTileBytesKV);
        load_tile_pair<Cfg::kStart, BN, D>(ss.kv_full[buf], offset, t.k_tile.lo, p.tma_k, mK(_, _, kvh, b), sK,
                                           p.tma_v, mV(_, _, kvh, b), sV);
        // Launched as a dependent of the preprocess: K and V are inputs, lse2 / delta its outputs.
        if (item == 0) wait_for_prerequisite();
        for (int g = 0; g < group; ++g) {
          const int h = kvh * group + g;
          Tensor tQgQ = tma_q.partition_S(
              local_tile(mQ(_, _, h, b), Shape<Int<BM>, Int<D>>{}, make_coord(_, 0)));  // (.., tiles)
          Tensor tdOgdO = tma_do.partition_S(
              local_tile(mdO(_, _, h, b), Shape<Int<BM>, Int<D>>{}, make_coord(_, 0)));
          const int64_t rows_bh = (static_cast<int64_t>(b) * p.heads + h) * p.seqlen;
          for (int r = 0; r < 2; ++r) {
            for (int qt = run_begin(runs, r); qt < run_end(runs, r); ++qt, ++it) {
              const int stage = it % STAGES, phase = (it / STAGES) & 1;
              const int row0 = plans.other.tile(qt).lo;
              Barrier::wait(&ss.empty[stage], phase ^ 1);
              if constexpr (Cfg::kStart != kStartTile) {
                // Q / dO boxes by coordinates; lse2 / delta from the 16-byte aligned element at or
                // before the tile's first row (the consumers skip (first & 3) floats).
                const auto at = make_coord(offset + row0, 0);
                const int64_t first = rows_bh + offset + row0, aligned = first & ~int64_t{3};
                TxBarrier::arrive_and_expect_tx(&ss.q_full[stage], Cfg::kTileBytesQ + Cfg::kRowBytes);
                copy(p.tma_q.with(ss.q_full[stage]),
                     tma_q.partition_S(local_tile(domain_offset(at, mQ(_, _, h, b)), Shape<Int<BM>, Int<D>>{},
                                                  make_coord(0, 0))),
                     tQsQ(_, _, _, stage));
                SM90_BULK_COPY_G2S::copy(p.lse2 + aligned, &ss.q_full[stage], ss.lse2[stage], Cfg::kRowBytes);
                TxBarrier::arrive_and_expect_tx(&ss.do_full[stage], Cfg::kTileBytesQ + Cfg::kRowBytes);
                copy(p.tma_do.with(ss.do_full[stage]),
                     tma_do.partition_S(local_tile(domain_offset(at, mdO(_, _, h, b)), Shape<Int<BM>, Int<D>>{},
                                                   make_coord(0, 0))),
                     tdOsdO(_, _, _, stage));
                SM90_BULK_COPY_G2S::copy(p.delta + aligned, &ss.do_full[stage], ss.delta[stage], Cfg::kRowBytes);
                continue;
              }
              TxBarrier::arrive_and_expect_tx(&ss.q_full[stage], Cfg::kTileBytesQ + Cfg::kRowBytes);
              copy(p.tma_q.with(ss.q_full[stage]), tQgQ(_, _, _, row0 / BM), tQsQ(_, _, _, stage));
              SM90_BULK_COPY_G2S::copy(p.lse2 + rows_bh + row0, &ss.q_full[stage], ss.lse2[stage],
                                       Cfg::kRowBytes);
              TxBarrier::arrive_and_expect_tx(&ss.do_full[stage], Cfg::kTileBytesQ + Cfg::kRowBytes);
              copy(p.tma_do.with(ss.do_full[stage]), tdOgdO(_, _, _, row0 / BM), tdOsdO(_, _, _, stage));
              SM90_BULK_COPY_G2S::copy(p.delta + rows_bh + row0, &ss.do_full[stage], ss.delta[stage],
                                       Cfg::kRowBytes);
            }
          }
        }
      });
    }
    return;
  }

  // ------------------------------------------------------------------------------------ consumers
  cutlass::arch::warpgroup_reg_alloc<240>();
  wait_for_prerequisite();  // (a dependent launch) before any store: dK, dV and dS^T
  const int consumer = warp_group - 1, tid = threadIdx.x % 128;
  typename Cfg::MmaSdp mma_sdp;
  typename Cfg::MmaKV mma_kv;
  auto thr_sdp = mma_sdp.get_thread_slice(tid);
  auto thr_kv = mma_kv.get_thread_slice(tid);
  Tensor tSrQ = thr_sdp.partition_fragment_B(sQ);     // (MMA, N, K, STAGES)
  Tensor tSrdO = thr_sdp.partition_fragment_B(sdO);
  Tensor tKrQt = thr_kv.partition_fragment_B(sQt);    // (MMA, N = D, K = BM, STAGES)
  Tensor tVrdOt = thr_kv.partition_fragment_B(sdOt);
  // Cfg::kRoles: consumer 0 computes dV (B operand dO^T), consumer 1 dK (Q^T), both over key slot 0.
  const bool grad_dk = Cfg::kRoles && consumer == 1;
  const int key_slot = Cfg::kRoles ? 0 : consumer;
  [[maybe_unused]] Tensor tGrB = thr_kv.partition_fragment_B(
      make_tensor(make_smem_ptr(grad_dk ? ss.q : ss.dout), typename Cfg::SmemLayoutQt{}));
  // This warpgroup's rows of K / V in buffer 0: smem descriptors (MMA, M, K).
  // Cfg::kFusedDq: key slot 0's descriptors (constants), moved per tile by the slot's row offset
  // (kSlotShift): per-consumer descriptors held over the loop were 12 spilled registers there.
  const int desc_slot = Cfg::kFusedDq ? 0 : key_slot;
  Tensor tSrK0 = thr_sdp.partition_fragment_A(
      local_tile(kv_tile(ss.k, 0), Shape<Int<kRowsW>, Int<D>>{}, make_coord(desc_slot, 0)));
  Tensor tSrV0 = thr_sdp.partition_fragment_A(
      local_tile(kv_tile(ss.v, 0), Shape<Int<kRowsW>, Int<D>>{}, make_coord(desc_slot, 0)));
  // (key, query) of every score this thread holds, relative to (key_base, query tile start).
  Tensor tScS = thr_sdp.partition_C(make_identity_tensor(Shape<Int<kRowsW>, Int<BM>>{}));
  Tensor tScS_rc = make_tensor(tScS.data(), acc_rowcol(tScS.layout()));
  constexpr int kRows = 2;  // keys per thread (lane/4 and lane/4 + 8 of its warp's 16)
  // Fused dQ: this warpgroup writes its 64 keys of dS^T into the shared (queries x keys) tile, then
  // multiplies the whole tile by its D / 2 columns of K: dQ[:, cols] = dS K[:, cols].
  using Fused = typename Cfg::Fused;
  [[maybe_unused]] typename Fused::MmaDq mma_dq;
  // Register pressure (session 13: 444 bytes of spills, LDL / STL and R2UR the most sampled stalls):
  // the K^T descriptors are consumer 0's (constants) moved by the consumer's column offset at each
  // use, and the staging addresses of dS^T and dQ are computed where they are stored, from an
  // opaque thread index (stage_parts), not held over the tile loop (32 registers).
  auto fused_parts = [&] {
    if constexpr (Cfg::kFusedDq) {
      auto thr_dq = mma_dq.get_thread_slice(tid);
      Tensor sdS = make_tensor(make_smem_ptr(ss.fused.ds), typename Fused::SmemLayoutdS{});
      Tensor sKt = make_tensor(make_smem_ptr(ss.k[0]), typename Fused::SmemLayoutKt{});
      Tensor sdQ = make_tensor(make_smem_ptr(ss.fused.dq[consumer]), typename Fused::SmemLayoutdQ{});
      return make_tuple(
          thr_dq.partition_fragment_A(sdS),  // (MMA, M, K, buffer) descriptors
          thr_dq.partition_fragment_B(
              local_tile(sKt, Shape<Int<Fused::kCols>, Int<BN>>{}, make_coord(0, 0))),  // consumer 0's
          sdQ);
    } else {
      return 0;
    }
  };
  // (where this thread's dS^T goes, where its dQ partial goes): built at the stores.
  [[maybe_unused]] auto stage_parts = [&] {
    if constexpr (Cfg::kFusedDq) {
      const int t = opaque(tid);
      Tensor sdSt = make_tensor(make_smem_ptr(ss.fused.ds), typename Fused::SmemLayoutdSt{});
      Tensor sdQ = make_tensor(make_smem_ptr(ss.fused.dq[consumer]), typename Fused::SmemLayoutdQ{});
      return make_tuple(mma_sdp.get_thread_slice(t).partition_C(
                            local_tile(sdSt, Shape<Int<kRowsW>, Int<BM>, _2>{}, make_coord(consumer, 0, 0))),
                        mma_dq.get_thread_slice(t).partition_C(sdQ));
    } else {
      return 0;
    }
  };
  [[maybe_unused]] auto fp = fused_parts();

  int it = 0;  // the Q / dO ring position, continued across items
  // Cfg::kHandoff: both P^T buffers start free (the dK warpgroup arrives once for each; after that
  // each buffer's free and ready phases alternate, so no warpgroup can arrive twice on one phase).
  if constexpr (Cfg::kHandoff) {
    if (grad_dk) bar_arrive(kHandoffFree + 0, 256), bar_arrive(kHandoffFree + 1, 256);
  }
  // Cfg::kPersistent: the K / V buffer whose epilogue TMA store (issued by tid 0) may still be
  // reading it. Its kv_empty arrival waits for that read, one tile into the next item, so the store
  // drains behind that item's first matmuls.
  [[maybe_unused]] int store_pending = -1;
  auto release_pending = [&] {
    if constexpr (Cfg::kPersistent) {
      if (store_pending >= 0) {
        if (tid == 0) tma_store_wait<0>();
        Barrier::arrive(&ss.kv_empty[store_pending]);
        store_pending = -1;
      }
    }
  };
  for_each_item([&](int w, int item) {
    const Item t = Cfg::kPersistent ? published(item) : item_of(w);
    int b = t.b, kvh = t.kvh, offset = t.offset;
    const int kt = t.kt;
    const SequenceMask& mask = t.mask;
    const TilePlans& plans = t.plans;
    const TileRuns& runs = t.runs;
    Interval k_tile = t.k_tile;
    const int buf = item % Cfg::kKvBufs;
    int key_base = k_tile.lo + key_slot * kRowsW;  // this warpgroup's first key
    Tensor sKc = local_tile(kv_tile(ss.k, buf), Shape<Int<kRowsW>, Int<D>>{}, make_coord(key_slot, 0));
    Tensor sVc = local_tile(kv_tile(ss.v, buf), Shape<Int<kRowsW>, Int<D>>{}, make_coord(key_slot, 0));
    // Cfg::kRoles: acc_dv is this warpgroup's one gradient (dK for consumer 1) and acc_dk is unused.
    Tensor acc_dk = partition_fragment_C(mma_kv, Shape<Int<kRowsW>, Int<D>>{});
    Tensor acc_dv = partition_fragment_C(mma_kv, Shape<Int<kRowsW>, Int<D>>{});
    if constexpr (!Cfg::kRoles) clear(acc_dk);
    clear(acc_dv);
    [[maybe_unused]] const int ds_slot0 = t.ds_slot0;
    Barrier::wait(&ss.kv_full[buf], (item / Cfg::kKvBufs) & 1);
    for (int g = 0; g < group; ++g) {
      for (int r = 0; r < 2; ++r) {
        for (int qt = run_begin(runs, r); qt < run_end(runs, r); ++qt, ++it) {
          const int stage = it % STAGES, phase = (it / STAGES) & 1;
          const Visit visit = plans.visit(kt, qt);
          // K / V smem descriptors of this item's buffer: buffer 0's (constants) with the start
          // address moved by the buffer's offset (16-byte units, the descriptor's low field). The
          // offset is opaque per tile, else the compiler builds every k-block's descriptor once per
          // item and holds them across the tile loop: ~40 registers, 160 bytes of spills (build 1,
          // csrc/NOTES.md session 9); built per tile from the buffer index they took tens of
          // instructions per tile.
          constexpr uint32_t kSlotShift = desc_units<typename Cfg::SmemLayoutKV, Elem>(kRowsW, 0);
          const uint32_t kv_shift = (Cfg::kPersistent ? opaque(buf) * uint32_t(Cfg::kTileBytesKV / 16) : 0u) +
                                    (Cfg::kFusedDq ? opaque(key_slot) * kSlotShift : 0u);
          Tensor tSrK = make_tensor(tSrK0.data() + kv_shift, tSrK0.layout());
          Tensor tSrV = make_tensor(tSrV0.data() + kv_shift, tSrV0.layout());
          Tensor acc_s = partition_fragment_C(mma_sdp, Shape<Int<kRowsW>, Int<BM>>{});
          Tensor acc_dp = partition_fragment_C(mma_sdp, Shape<Int<kRowsW>, Int<BM>>{});
          // S^T and dP^T issued back to back: P^T's exponentials run while dP^T is computed.
          // Cfg::kHandoff: the dK warpgroup receives P^T from the dV one instead of computing S^T.
          const bool computes_s = !Cfg::kHandoff || !grad_dk;
          if (computes_s) {
            Barrier::wait(&ss.q_full[stage], phase);
            gemm_fresh(mma_sdp, tSrK, tSrQ(_, _, _, stage), acc_s);
          }
          Barrier::wait(&ss.do_full[stage], phase);
          if (!Cfg::kRoles || grad_dk) {  // the dV-only warpgroup needs no dP^T
            gemm_fresh(mma_sdp, tSrV, tSrdO(_, _, _, stage), acc_dp);
            if (computes_s) warpgroup_wait<1>(); else warpgroup_wait<0>();
          } else {
            warpgroup_wait<0>();
          }
          warpgroup_fence_operand(acc_s);

          // P^T = exp2(s * scale log2 e - lse2[query]); masked pairs get exp2(-inf) = 0.
          Tensor s = make_tensor(acc_s.data(), acc_rowcol(acc_s.layout()));  // (keys, queries)
          // Cfg::kStoreDs over packed samples: keys this warpgroup reads past its half are masked
          // too, as their dS^T rows are stored (the dQ kernel's K rows there are other keys).
          constexpr bool kKeysPast = Cfg::kStoreDs && Cfg::kStart != kStartTile;
          const bool masked = !visit.full || visit.end - visit.start < BM ||
                              (kKeysPast && key_base + kRowsW > k_tile.hi);
          // kStartAny / kStartVarlen: the copy began (first row & 3) floats before the tile.
          [[maybe_unused]] int skip = 0;
          if constexpr (Cfg::kStart != kStartTile)
            skip = static_cast<int>(((static_cast<int64_t>(b) * p.heads + kvh * group + g) * p.seqlen +
                                     offset + visit.start) & 3);
          const float* lse2 = ss.lse2[stage] + skip;
          auto exponentiate = [&](auto masked_tag) {
            constexpr bool kMasked = decltype(masked_tag)::value;
            // The query rows that see each of this thread's keys, recomputed per PARTIAL tile rather
            // than held over the loop: 8 registers the accumulators need (4 bytes spilled otherwise).
            [[maybe_unused]] Intervals seen_by[kRows];
            if constexpr (kMasked) {
              CUTE_UNROLL
              for (int i = 0; i < kRows; ++i) {
                const int key = key_base + get<0>(tScS_rc(i, 0));
                seen_by[i] = !kKeysPast || key < k_tile.hi ? mask.col_intervals(key) : Intervals{};
              }
            }
            CUTE_UNROLL
            for (int j = 0; j < size<1>(s); ++j) {
              const int col = get<1>(tScS_rc(0, j));
              const float l = lse2[col];
              CUTE_UNROLL
              for (int i = 0; i < kRows; ++i) {
                float x = s(i, j) * p.scale_log2 - l;
                if constexpr (kMasked) {
                  const int row = visit.start + col;
                  x = row < visit.end && seen_by[i].contains(row) ? x : -INFINITY;
                }
                s(i, j) = exp2_approx(x);
              }
            }
          };
          if (computes_s) with_mask_decided(masked, exponentiate);
          if constexpr (Cfg::kHandoff) {  // P^T from the dV warpgroup to the dK one, fp32, thread to thread
            const int hb = it & 1;
            float4* hand = reinterpret_cast<float4*>(ss.handoff.p[hb]);
            if (!grad_dk) {
              bar_sync(kHandoffFree + hb, 256);
              fragment_give(hand, acc_s, tid);
              bar_arrive(kHandoffReady + hb, 256);
            } else {
              bar_sync(kHandoffReady + hb, 256);
              fragment_take<false>(hand, acc_s, tid);
              bar_arrive(kHandoffFree + hb, 256);
            }
          }
          warpgroup_wait<0>();
          warpgroup_fence_operand(acc_dp);
          // dS^T = P^T (dP^T - delta[query]), in dP^T's registers.
          Tensor dp = make_tensor(acc_dp.data(), acc_rowcol(acc_dp.layout()));
          const float* delta = ss.delta[stage] + skip;
          if (!Cfg::kRoles || grad_dk) {
            CUTE_UNROLL
            for (int j = 0; j < size<1>(dp); ++j) {
              const float dl = delta[get<1>(tScS_rc(0, j))];
              CUTE_UNROLL
              for (int i = 0; i < kRows; ++i) dp(i, j) = s(i, j) * (dp(i, j) - dl);
            }
          }
          // Cfg::kStoreDs: this warpgroup's 64 keys of the tile's dS^T block (ds_frag, the Elem
          // copy of dS^T in the accumulator's layout), staged in shared memory, then one TMA store
          // per warp (16 keys). Cfg::kRoles: the dK warpgroup's (the dV one holds no dS^T).
          [[maybe_unused]] auto store_ds = [&](auto& ds_frag) {
            if constexpr (Cfg::kStoreDs) {
              using DsStore = typename Cfg::DsStore;
              const int lane = tid % 32, warp = tid / 32, x = lane / 4, hb = it & 1;
              // The buffer's store of two visits ago (this warp's lane 0 issued it) has read it.
              if (lane == 0) tma_store_wait<1>();
              __syncwarp();
              // By the accumulator layout (as the forward's O): rows 16 warp + x and + 8, in
              // column group c the pair 8 c + 2 (lane % 4); the 128-byte swizzle puts chunk c of
              // row r at c ^ (r % 8) = c ^ x: one XOR per pair.
              const uint32_t t0 = smem_addr(ss.ds_store.ds[hb][Cfg::kRoles ? 0 : consumer]) + (16 * warp + x) * (BM * 2) +
                                  (x << 4) + (lane % 4) * 4;
              Tensor ds_rc = make_tensor(ds_frag.data(), acc_rowcol(ds_frag.layout()));
              CUTE_UNROLL
              for (int i = 0; i < kRows; ++i)
                CUTE_UNROLL
                for (int c = 0; c < BM / 8; ++c) {
                  alignas(4) Elem pair[2] = {ds_rc(i, 2 * c), ds_rc(i, 2 * c + 1)};
                  st_shared_b32((t0 ^ (c << 4)) + i * 8 * (BM * 2), *reinterpret_cast<uint32_t*>(pair));
                }
              tma_store_fence();  // the generic-proxy writes, visible to the TMA (async proxy)
              __syncwarp();
              if (lane == 0) {
                const int bh = b * p.heads + kvh * group + g;
                const int visit = qt - run_begin(runs, r) + (r ? run_end(runs, 0) - run_begin(runs, 0) : 0);
                const int block = 1 + bh * p.ds_visits + ds_slot0 + visit;
                const int rows = (1 + p.batch * p.heads * p.ds_visits) * BN;
                Tensor mDs = p.tma_ds.get_tma_tensor(make_shape(rows, int(BM)));
                Tensor gDs = local_tile(mDs, Shape<Int<DsStore::kWarpRows>, Int<BM>>{},
                                        make_coord((block * BN + key_slot * kRowsW) / DsStore::kWarpRows + warp, 0));
                Tensor sDs = local_tile(
                    make_tensor(make_smem_ptr(ss.ds_store.ds[hb][Cfg::kRoles ? 0 : consumer]), typename DsStore::SmemLayout{}),
                    Shape<Int<DsStore::kWarpRows>, Int<BM>>{}, make_coord(warp, 0));
                auto tma = p.tma_ds.get_slice(0);
                copy(p.tma_ds, tma.partition_S(sDs), tma.partition_D(gDs));
                tma_store_arrive();
              }
            }
          };
          if constexpr (Cfg::kRoles) {  // this warpgroup's one matmul: dV += P^T dO or dK += dS^T Q
            Tensor g_elem = make_fragment_like<Elem>(acc_s);
            if (grad_dk) {
              CUTE_UNROLL
              for (int i = 0; i < size(acc_dp); ++i) g_elem(i) = Elem(acc_dp(i));
            } else {
              CUTE_UNROLL
              for (int i = 0; i < size(acc_s); ++i) g_elem(i) = Elem(acc_s(i));
            }
            Tensor tGa = make_tensor(g_elem.data(), acc_as_operand_a(g_elem.layout()));
            if (!computes_s) Barrier::wait(&ss.q_full[stage], phase);  // dK's Q^T
            if constexpr (Cfg::kStoreDs && !Cfg::kStoreDsBehind) {
              if (grad_dk) store_ds(g_elem);
            }
            warpgroup_fence_operand(acc_dv);
            warpgroup_arrive();
            CUTE_UNROLL
            for (int kb = 0; kb < size<2>(tGa); ++kb) gemm(mma_kv, tGa(_, _, kb), tGrB(_, _, kb, stage), acc_dv);
            warpgroup_commit_batch();
            if constexpr (Cfg::kStoreDsBehind) {
              if (grad_dk) store_ds(g_elem);
            }
            warpgroup_wait<0>();
            warpgroup_fence_operand(acc_dv);
            Barrier::arrive(&ss.empty[stage]);
            continue;
          }
          Tensor p_elem = make_fragment_like<Elem>(acc_s);
          Tensor ds_elem = make_fragment_like<Elem>(acc_dp);
          CUTE_UNROLL
          for (int i = 0; i < size(acc_s); ++i) {
            p_elem(i) = Elem(acc_s(i));
            ds_elem(i) = Elem(acc_dp(i));
          }
          Tensor tPa = make_tensor(p_elem.data(), acc_as_operand_a(p_elem.layout()));
          Tensor tdSa = make_tensor(ds_elem.data(), acc_as_operand_a(ds_elem.layout()));
          if constexpr (Cfg::kFusedDq) {  // dS^T into buffer it & 1, two adjacent queries per store
            // The buffers are 16 KB apart, a multiple of the swizzle's period: buffer 1's offsets are
            // buffer 0's plus that.
            // Keys of the box past the key tile (the next half's or sample's, where tiles start
            // anywhere) are not masked in S^T: their dK / dV rows are simply not stored, but dQ sums
            // over every key of the box, so their dS^T must be 0 here.
            auto tdSs = get<0>(stage_parts());
            const uint32_t buffer = (it & 1) * uint32_t(BM * BN * sizeof(Elem));
            [[maybe_unused]] const int keys_live = k_tile.hi - key_base;
            CUTE_UNROLL
            for (int e = 0; e < size(ds_elem); e += 2) {
              alignas(4) Elem pair[2] = {ds_elem(e), ds_elem(e + 1)};
              uint32_t bits = *reinterpret_cast<uint32_t*>(pair);
              if constexpr (Cfg::kStart != kStartTile) bits = get<0>(tScS(e)) < keys_live ? bits : 0u;
              st_shared_b32(smem_addr(&tdSs(e, 0, 0, 0)) + buffer, bits);
            }
          }

          if constexpr (Cfg::kStoreDs && !Cfg::kStoreDsBehind) store_ds(ds_elem);
          warpgroup_fence_operand(acc_dv);
          warpgroup_fence_operand(acc_dk);
          warpgroup_arrive();
          CUTE_UNROLL
          for (int kb = 0; kb < size<2>(tPa); ++kb)
            gemm(mma_kv, tPa(_, _, kb), tVrdOt(_, _, kb, stage), acc_dv);
          CUTE_UNROLL
          for (int kb = 0; kb < size<2>(tdSa); ++kb)
            gemm(mma_kv, tdSa(_, _, kb), tKrQt(_, _, kb, stage), acc_dk);
          warpgroup_commit_batch();
          if constexpr (Cfg::kFusedDq) {
            // Both halves of dS written (the generic-proxy stores made visible to wgmma), and this
            // warpgroup's previous reduce-add done reading its staging buffer: then dQ = dS K.
            tma_store_fence();
            if (tid == 0) tma_store_wait<0>();
            bar_sync(kFusedDsBarrier, 256);
            Tensor acc_dq = partition_fragment_C(mma_dq, Shape<Int<BM>, Int<Fused::kCols>>{});
            auto& tdQrdS = get<0>(fp);
            // This consumer's D / 2 columns of K^T: consumer 0's descriptors moved by the columns'
            // offset in K's tile (16-byte units, the descriptor's start-address field).
            constexpr uint32_t kColsShift = desc_units<typename Cfg::SmemLayoutKV, Elem>(0, Fused::kCols);
            Tensor tdQrK = make_tensor(get<1>(fp).data() + opaque(consumer) * kColsShift, get<1>(fp).layout());
            gemm_fresh(mma_dq, tdQrdS(_, _, _, it & 1), tdQrK, acc_dq);
            warpgroup_wait<0>();
            warpgroup_fence_operand(acc_dq);
            warpgroup_fence_operand(acc_dv);
            warpgroup_fence_operand(acc_dk);
            Barrier::arrive(&ss.empty[stage]);
            // Stage the partial, then one thread reduce-adds it at the tile's rows; rows past the
            // visit (next half, sample or S) hold exact zeros (P^T = 0 there) or fall off the tensor.
            auto tdQs = get<1>(stage_parts());
            CUTE_UNROLL
            for (int e = 0; e < size(acc_dq); e += 2)
              st_shared_f32x2(smem_addr(&tdQs(e)), acc_dq(e), acc_dq(e + 1));
            tma_store_fence();
            bar_sync(kFusedDqBarrier + consumer, 128);
            if (tid == 0) {
              const int h = kvh * group + g;
              Tensor mdQ = p.tma_dq.get_tma_tensor(make_shape(p.seqlen, D, p.heads, p.batch));
              Tensor gdQ = local_tile(
                  domain_offset(make_coord(offset + visit.start, consumer * Fused::kCols), mdQ(_, _, h, b)),
                  Shape<Int<BM>, Int<Fused::kCols>>{}, make_coord(0, 0));
              auto tma_dq = p.tma_dq.get_slice(0);
              copy(p.tma_dq, tma_dq.partition_S(get<2>(fp)), tma_dq.partition_D(gdQ));
              tma_store_arrive();
            }
          } else {
            if constexpr (Cfg::kStoreDsBehind) store_ds(ds_elem);
            warpgroup_wait<0>();
            warpgroup_fence_operand(acc_dv);
            warpgroup_fence_operand(acc_dk);
            Barrier::arrive(&ss.empty[stage]);
            release_pending();
          }
        }
      }
    }
    release_pending();  // an item without tiles (none in the geometry's plans; kept for safety)
    if constexpr (Cfg::kFusedDq) {
      if (tid == 0) tma_store_wait<0>();  // the last reduce-add has read its staging buffer
    }

    // Epilogue: dK = scale * sum dS^T Q and dV, through shared memory and TMA (Cfg::kTmaStore,
    // warpgroups whose 64 keys are all in the tile) or straight from registers; rows are keys.
    // Persistent: the thread's epilogue addresses derive from an opaque copy of tid, so they are
    // computed here and stay out of the tile loop's live registers.
    const int tid_epi = Cfg::kPersistent ? opaque(tid) : tid;
    auto thr_epi = mma_kv.get_thread_slice(tid_epi);
    Tensor tKcK = thr_epi.partition_C(make_identity_tensor(Shape<Int<kRowsW>, Int<D>>{}));
    // Persistent: the item's coordinates read again from its published copy (unchanged until this
    // buffer's kv_empty), not held across the tile loop (held, they spilled: 20-68 bytes).
    if constexpr (Cfg::kPersistent) {
      const DkDvItem& again = ss.item[buf];
      b = again.b, kvh = again.kvh, offset = again.offset, k_tile = again.k_tile;
      key_base = k_tile.lo + key_slot * kRowsW;
    }
    // Keys of the tile past its half (or sample) are not stored (row_end = k_tile.hi).
    Elem* dk = p.grad_a + b * p.a_stride_b + kvh * p.a_stride_h + offset * p.a_stride_s;
    Elem* dv = p.grad_b + b * p.b_stride_b + kvh * p.b_stride_h + offset * p.b_stride_s;
    if constexpr (Cfg::kRoles) {
      if (grad_dk) store_rows(acc_dv, tKcK, p.scale, dk, p.a_stride_s, key_base, k_tile.hi);
      else store_rows(acc_dv, tKcK, 1.f, dv, p.b_stride_s, key_base, k_tile.hi);
      return;
    }
    if constexpr (Cfg::kTmaStore) {
      if (key_base + kRowsW <= k_tile.hi) {  // all 64 keys of this warpgroup stored: through TMA
        using Tile = typename Cfg::SmemLayoutKV;  // this warpgroup's keys: rows key_slot * 64 on
        const uint32_t slot_bytes = key_slot * kRowsW * 128;
        stage_rows<Elem, Tile>(acc_dk, p.scale, smem_addr(ss.k[buf]) + slot_bytes, tid_epi);
        stage_rows<Elem, Tile>(acc_dv, 1.f, smem_addr(ss.v[buf]) + slot_bytes, tid_epi);
        tma_store_fence();
        bar_sync(kGradStoreBarrier + consumer, 128);
        if (tid == 0) {
          store_rows_tma<D>(p.tma_store_a, sKc, p.seqlen, p.kv_heads, p.batch, offset + key_base, kvh, b);
          store_rows_tma<D>(p.tma_store_b, sVc, p.seqlen, p.kv_heads, p.batch, offset + key_base, kvh, b);
          tma_store_arrive();
          // The staging rows must outlive the copy's read: before the CTA exits, or (persistent)
          // before the producer reloads this buffer (release_pending).
          if constexpr (!Cfg::kPersistent) tma_store_wait<0>();
        }
        if constexpr (Cfg::kPersistent) store_pending = buf;
        return;
      }
    }
    if (probe_stores<Cfg>(acc_dk)) store_rows(acc_dk, tKcK, p.scale, dk, p.a_stride_s, key_base, k_tile.hi);
    if (probe_stores<Cfg>(acc_dv)) store_rows(acc_dv, tKcK, 1.f, dv, p.b_stride_s, key_base, k_tile.hi);
    if constexpr (Cfg::kPersistent) Barrier::arrive(&ss.kv_empty[buf]);  // done reading K / V
  });
  if constexpr (Cfg::kPersistent) {
    if (store_pending >= 0 && tid == 0) tma_store_wait<0>();  // the last item's store read
  }
  if constexpr (Cfg::kStoreDs) {
    if (tid % 32 == 0) tma_store_wait<0>();  // each warp's last dS^T store has read its buffer
  }
}

}  // namespace dlm::sm90
