// The backward with dS through HBM (session 18; csrc/NOTES.md "Session 18"): the dK/dV kernel with
// DkDvConfig STORE_DS_ writes every visited tile's dS^T (2 bytes per pair of a visited tile, each
// written once and read once: no atomics, deterministic), and the dQ kernel here runs one matmul
// per tile pair, dQ += dS K, where the shipped dQ kernel runs three (S = Q K^T and dP = dO V^T
// again, then dQ): 5 matmuls per tile pair instead of 7, paid with the dS traffic through HBM.
//
// The scratch holds one block of BN keys x 64 queries per visit of the dK/dV kernel (BN: its key
// tile, 128 at D = 128, 64 at D = 256; queries contiguous, as it holds dS^T), numbered by the slot
// table (diffusion_bwd.cuh launch_bwd_ds), plus block 0, all zeros, which stands for the 64-row
// halves of a visited 128 x BN dQ tile that no dK/dV visit covers.
//
// One CTA per (batch, head, 128-row query tile), in the dQ kernel's order; per visited key tile a
// producer thread loads K (BN keys x D) and the tile's two dS^T blocks into a ring; consumer c
// multiplies its block by K (wgmma SS: dS^T read as the MN-major A operand, K^T MN-major) into its
// 64 x D accumulator (128 registers at D = 256). START_: tiles at multiples of their size
// (kStartTile: halves of multiples of 128) or packed samples (kStartVarlen: each sample's halves
// tiled from their own starts, K boxes placed by coordinates, the rows of a tile past its half
// stored from registers; the dK/dV kernel zeroed dS^T of the keys past a half).
#pragma once

#include "hopper/bwd_parts.cuh"

namespace dlm::sm90 {

// PERSISTENT_: a grid of at most one CTA per SM walks the (query tile, slot) items in snake order
// (common.cuh snake_item) or a host-built balanced schedule's (DqFromDsParams::schedule) with the
// ring continued across items, so that one item's last matmul and dQ stores overlap the next
// item's loads; otherwise one CTA per item.
// TMA_STORE_ (written in session 19, shipped in session 20: diffusion_bwd.cuh DqFromDsPersistent):
// each consumer stages its 64 x D dQ in its own shared buffer (stage_rows) and one thread stores it
// with TMA (store_rows_tma), where the register stores' 4-byte STGs took 13 % of the kernel's stall
// samples at n = 1K (ncu). The buffer is reused one item later, after that store has read it.
// 224 KB of shared memory at D = 128, 208 KB at D = 256.
template <class Elem_, int D_ = 128, int STAGES_ = 3, bool PERSISTENT_ = false, bool TMA_STORE_ = false,
          int START_ = kStartTile>
struct DqFromDsConfig {
  using Elem = Elem_;
  static constexpr int kStart = START_;
  static_assert(START_ == kStartTile || START_ == kStartVarlen, "the dS store's tilings");
  static constexpr bool kTmaStore = TMA_STORE_;
  // BN: the dK/dV kernel's key tile, one dS^T block's keys.
  static constexpr int D = D_, BM = kDsDqBlockM, BN = ds_dq_block_n(D), STAGES = STAGES_;
  static constexpr bool kPersistent = PERSISTENT_;
  static constexpr int kDsRows = kBwdBlockM;  // queries per dS^T block
  static constexpr int kConsumers = BM / kDsRows, kThreads = 128 * (1 + kConsumers);
  static_assert(D == 64 || D == 128 || D == 256, "the head dims whose dK/dV kernel stores dS^T (64: harness ds64)");

  using SmemLayoutK = SwizzledTiles<Elem, BN, D, STAGES>;
  using SmemLayoutKt = SwizzledTilesT<Elem, BN, D, STAGES>;  // K^T: (D, BN, STAGES), D contiguous
  // (64 queries, BN keys) per consumer and stage, queries contiguous: 128-byte rows of one key.
  using SmemLayoutDs = decltype(tile_to_shape(GMMA::Layout_MN_SW128_Atom<Elem>{},
                                              Shape<Int<kDsRows>, Int<BN>, Int<kConsumers * STAGES>>{}));
  using MmaDq = decltype(make_tiled_mma(
      SM90::GMMA::ss_op_selector<Elem, Elem, float, Shape<Int<kDsRows>, Int<D>, Int<BN>>,
                                 GMMA::Major::MN, GMMA::Major::MN>()));

  // kTmaStore: a consumer's dQ rows, K-major swizzled as the TMA store's boxes read them.
  using SmemLayoutDq = SwizzledTile<Elem, kDsRows, D>;
  struct DqStaging {
    alignas(1024) Elem dq[kConsumers][cosize_v<SmemLayoutDq>];
  };

  struct SharedStorage {
    alignas(1024) Elem k[cosize_v<SmemLayoutK>];
    alignas(1024) Elem ds[cosize_v<SmemLayoutDs>];
    alignas(8) uint64_t full[STAGES], empty[STAGES];
    std::conditional_t<kTmaStore, DqStaging, NoFusedDq::Smem> dq_store;
  };
  static constexpr int kTileBytesK = BN * D * sizeof(Elem);
  static constexpr int kBlockBytesDs = kDsRows * BN * sizeof(Elem);
};

// The dS^T scratch as a (64 queries, BN keys, blocks) tensor, one box per block.
template <class Cfg>
auto make_tma_ds(typename Cfg::Elem const* p, int blocks) {
  return make_tma_copy(SM90_TMA_LOAD{},
                       make_tensor(make_gmem_ptr(p), make_shape(Cfg::kDsRows, Cfg::BN, blocks),
                                   make_stride(_1{}, Cfg::kDsRows, int64_t{Cfg::kDsRows} * Cfg::BN)),
                       take<0, 2>(typename Cfg::SmemLayoutDs{}));
}

template <class Cfg>
struct DqFromDsParams {
  using Elem = typename Cfg::Elem;
  TmaRows<Elem, Cfg::BN, Cfg::D> tma_k;
  decltype(make_tma_ds<Cfg>(nullptr, 1)) tma_ds;
  Elem* dq;
  int64_t dq_stride_s, dq_stride_h, dq_stride_b;
  int seqlen, heads, kv_heads, batch;
  SequenceMask mask;
  float scale;
  const int32_t* tile_order;  // query tiles of fwd_tiles(BM, BN), most expensive first
  const int32_t* ds_slots;    // the slot table (diffusion_bwd.cuh launch_bwd_ds)
  int ds_k_tiles, ds_visits;
  int entries;                // of tile_order: the items are (entry, batch * head slot)
  WorkOrder order;            // their order (entry-major, or L2 chunks of slots: work_order)
  // Cfg::kPersistent: the balanced schedule of that order for exactly this grid (dlm/geometry.h
  // order_schedule / entry_schedule, BwdArgs::dq_schedule); null: the snake.
  const int32_t* schedule = nullptr;
  TmaStoreRows<Elem> tma_store{};  // Cfg::kTmaStore: dq as (S, D, H, B)
  // kStartVarlen only (batch 1): entry e's sample, the samples' offsets, and each sample's first
  // row of the slot table (BwdParams' fields of the same names).
  const int32_t* tile_sample = nullptr;
  const int32_t* cu_seqlens = nullptr;
  const int32_t* ds_rows = nullptr;
  // L2 policies of the loads (TMA::CacheHintSm90 values). The dS^T blocks are read once: evicted
  // first, they leave L2 to K, which every query tile of its slot reads. Session 40 (csrc/NOTES.md,
  // bf16, 16K tokens, 10 alternating rounds): this kernel 1.102 / 1.107 / 1.073 / 1.019x at n = 1K /
  // 2K / 4K / 8K (D = 128; 1.104x block 4, 1.074x GQA 32/8; D = 256 1.039x), the whole backward
  // 1.020 / 1.024 / 1.005 / 1.012x (1.023x, 1.026x; D = 256 0.997x). K kept with EVICT_LAST as well
  // measured no more (1.006-1.008x alone; k_hint is read by the batched tiles' K loads only).
  // Runtime fields: the measured binary read them so.
  uint64_t k_hint = uint64_t(TMA::CacheHintSm90::EVICT_NORMAL), ds_hint = uint64_t(TMA::CacheHintSm90::EVICT_FIRST);
};

template <class Cfg>
__global__ void __launch_bounds__(Cfg::kThreads, 1)
    diffusion_bwd_dq_from_ds_kernel(__grid_constant__ const DqFromDsParams<Cfg> p) {
  constexpr int BM = Cfg::BM, BN = Cfg::BN, D = Cfg::D, STAGES = Cfg::STAGES;
  using Barrier = cutlass::arch::ClusterBarrier;
  using TxBarrier = cutlass::arch::ClusterTransactionBarrier;

  extern __shared__ __align__(1024) char smem_raw[];
  auto& ss = *reinterpret_cast<typename Cfg::SharedStorage*>(smem_raw);
  Tensor sK = make_tensor(make_smem_ptr(ss.k), typename Cfg::SmemLayoutK{});
  Tensor sKt = make_tensor(make_smem_ptr(ss.k), typename Cfg::SmemLayoutKt{});
  Tensor sDs = make_tensor(make_smem_ptr(ss.ds), typename Cfg::SmemLayoutDs{});

  const int slots = p.batch * p.heads, num_items = slots * p.entries;
  struct Item {
    int b, h, bh, qt;
    int offset, ds_row, seqlen;  // kStartVarlen: the sample's packed row 0, first slot-table row, length
  };
  auto item_at = [&](int w) {
    int e, bh;
    p.order.decode(w, p.entries, e, bh);
    Item t{bh / p.heads, bh % p.heads, bh, p.tile_order[e], 0, 0, 0};
    if constexpr (Cfg::kStart == kStartVarlen) {
      const int sample = p.tile_sample[e];
      t.offset = p.cu_seqlens[sample], t.ds_row = p.ds_rows[sample];
      t.seqlen = p.cu_seqlens[sample + 1] - t.offset;
    }
    return t;
  };
  // The item's tiles: query tiles of BM rows, key tiles of BN (the launch's mask, or its sample's).
  auto plans_of = [&](const Item& t) {
    if constexpr (Cfg::kStart == kStartVarlen) return block_diffusion(t.seqlen, p.mask.block_size).fwd_tiles(BM, BN);
    else return p.mask.fwd_tiles(BM, BN);
  };
  // f(item) for the CTA's items: its one (blockIdx.x), or (Cfg::kPersistent) walk_item's walk.
  auto for_each_item = [&](auto&& f) {
    if constexpr (Cfg::kPersistent) {
      for (int i = 0, w = walk_item(p.schedule, 0, num_items); w < num_items;
           w = walk_item(p.schedule, ++i, num_items))
        f(item_at(w));
    } else {
      f(item_at(blockIdx.x));
    }
  };
  const int warp_group = threadIdx.x / 128;

  if (threadIdx.x == 0) {
    for (int s = 0; s < STAGES; ++s) {
      Barrier::init(&ss.full[s], 1);
      Barrier::init(&ss.empty[s], 128 * Cfg::kConsumers);
    }
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();
  // Launched as a programmatic dependent of the dK/dV kernel (which writes its dS^T): the set-up
  // above ran under that grid's end; nothing is read or written before it has completed.
  wait_for_prerequisite();

  if (warp_group == 0) {  // ---------------------------------------------------------- producer
    cutlass::arch::warpgroup_reg_dealloc<24>();
    if (threadIdx.x == 0) {
      Tensor mK = p.tma_k.get_tma_tensor(make_shape(p.seqlen, D, p.kv_heads, p.batch));
      auto tma_k = p.tma_k.get_slice(0);
      Tensor tKsK = tma_k.partition_D(sK);  // (TMA, 1, 1, STAGES)
      const int blocks = 1 + slots * p.ds_visits;
      Tensor mDs = p.tma_ds.get_tma_tensor(make_shape(int(Cfg::kDsRows), int(BN), blocks));
      auto tma_ds = p.tma_ds.get_slice(0);
      Tensor tDgD = tma_ds.partition_S(mDs);  // (TMA, 1, 1, blocks)
      Tensor tDsD = tma_ds.partition_D(sDs);  // (TMA, 1, 1, consumers * STAGES)
      int it = 0;  // the ring position, continued across items
      for_each_item([&](const Item t) {
        const int kvh = t.h / (p.heads / p.kv_heads);
        const TilePlans plans = plans_of(t);
        const TileRuns runs = plans.runs(t.qt);
        Tensor tKgK = tma_k.partition_S(
            local_tile(mK(_, _, kvh, t.b), Shape<Int<BN>, Int<D>>{}, make_coord(_, 0)));
        // kStartTile: consumer c's slot-table row is 2 qt + c. kStartVarlen: the dK/dV kernel's
        // 64-query tile at q_tile.lo + 64 c of the sample (tiles are cut from each half's start,
        // so it is one of them), or none past the half (block 0).
        [[maybe_unused]] const int32_t* slot_rows = p.ds_slots + t.qt * Cfg::kConsumers * p.ds_k_tiles;
        [[maybe_unused]] const int32_t* sample_rows[Cfg::kConsumers];
        if constexpr (Cfg::kStart == kStartVarlen) {
          const Interval q_tile = plans.tile(t.qt);
          const Tiling ds_tiling{plans.n_noisy, plans.n_clean, Cfg::kDsRows};
          for (int c = 0; c < Cfg::kConsumers; ++c) {
            const int lo = q_tile.lo + c * Cfg::kDsRows;
            sample_rows[c] = lo < q_tile.hi ? p.ds_slots + int64_t(t.ds_row + ds_tiling.index_of(lo)) * p.ds_k_tiles
                                            : nullptr;
          }
        }
        const int first_block = 1 + t.bh * p.ds_visits;
        for (int r = 0; r < 2; ++r) {
          for (int kt = run_begin(runs, r); kt < run_end(runs, r); ++kt, ++it) {
            const int stage = it % STAGES, phase = (it / STAGES) & 1;
            Barrier::wait(&ss.empty[stage], phase ^ 1);
            TxBarrier::arrive_and_expect_tx(&ss.full[stage],
                                            Cfg::kTileBytesK + Cfg::kConsumers * Cfg::kBlockBytesDs);
            if constexpr (Cfg::kStart == kStartTile) {
              copy(p.tma_k.with(ss.full[stage], 0, TMA::CacheHintSm90(p.k_hint)), tKgK(_, _, _, kt),
                   tKsK(_, _, _, stage));
            } else {  // rows past the tensor's end read as zeros; past the half, dS^T is 0 there
              const auto at = make_coord(t.offset + plans.other.tile(kt).lo, 0);
              copy(p.tma_k.with(ss.full[stage]),
                   tma_k.partition_S(local_tile(domain_offset(at, mK(_, _, kvh, t.b)), Shape<Int<BN>, Int<D>>{},
                                                make_coord(0, 0))),
                   tKsK(_, _, _, stage));
            }
            for (int c = 0; c < Cfg::kConsumers; ++c) {
              // A 64-row half that no dK/dV visit covers (slot -1) reads block 0, all zeros.
              int slot;
              if constexpr (Cfg::kStart == kStartTile) slot = slot_rows[c * p.ds_k_tiles + kt];
              else slot = sample_rows[c] ? sample_rows[c][kt] : -1;
              copy(p.tma_ds.with(ss.full[stage], 0, TMA::CacheHintSm90(p.ds_hint)),
                   tDgD(_, _, _, slot < 0 ? 0 : first_block + slot),
                   tDsD(_, _, _, stage * Cfg::kConsumers + c));
            }
          }
        }
      });
    }
    return;
  }

  // ------------------------------------------------------------------------------------ consumers
  cutlass::arch::warpgroup_reg_alloc<240>();
  const int consumer = warp_group - 1, tid = threadIdx.x % 128;
  typename Cfg::MmaDq mma;
  auto thr = mma.get_thread_slice(tid);
  Tensor tArD = thr.partition_fragment_A(sDs);   // descriptors: (MMA, M, K, consumers * STAGES)
  Tensor tBrK = thr.partition_fragment_B(sKt);   // (MMA, N = D, K = BN, STAGES)
  Tensor acc = partition_fragment_C(mma, Shape<Int<Cfg::kDsRows>, Int<D>>{});
  Tensor tQcQ = thr.partition_C(make_identity_tensor(Shape<Int<Cfg::kDsRows>, Int<D>>{}));
  int it = 0;  // the producer's ring position, kept in step
  for_each_item([&](const Item t) {
    const TilePlans plans = plans_of(t);
    const TileRuns runs = plans.runs(t.qt);
    const Interval q_tile = plans.tile(t.qt);
    clear(acc);
    // Visit j's matmul is issued before visit j - 1's is waited for, whose stage is then released.
    const int first = it;
    for (int r = 0; r < 2; ++r) {
      for (int kt = run_begin(runs, r); kt < run_end(runs, r); ++kt, ++it) {
        const int stage = it % STAGES, phase = (it / STAGES) & 1;
        Barrier::wait(&ss.full[stage], phase);
        warpgroup_fence_operand(acc);
        warpgroup_arrive();
        CUTE_UNROLL
        for (int kb = 0; kb < size<2>(tArD); ++kb)
          gemm(mma, tArD(_, _, kb, stage * Cfg::kConsumers + consumer), tBrK(_, _, kb, stage), acc);
        warpgroup_commit_batch();
        warpgroup_wait<1>();
        warpgroup_fence_operand(acc);
        if (it > first) Barrier::arrive(&ss.empty[(it - 1) % STAGES]);
      }
    }
    warpgroup_wait<0>();
    warpgroup_fence_operand(acc);
    if (it > first) Barrier::arrive(&ss.empty[(it - 1) % STAGES]);  // the item's last visit
    const int row0 = q_tile.lo + consumer * Cfg::kDsRows;
    // kStartTile: every consumer's 64 rows lie in the tile (tiles at multiples of 128 inside halves
    // of multiples of 128); kStartVarlen: the rows past the half are not stored, so a consumer
    // whose rows the tile does not all hold stores from registers.
    if constexpr (Cfg::kTmaStore) {
      if (Cfg::kStart == kStartTile || row0 + Cfg::kDsRows <= q_tile.hi) {
        // The previous item's store has read the buffer before any thread of this warpgroup writes it.
        Tensor sDq = make_tensor(make_smem_ptr(ss.dq_store.dq[consumer]), typename Cfg::SmemLayoutDq{});
        if (tid == 0) tma_store_wait<0>();
        bar_sync(kGradStoreBarrier + consumer, 128);
        stage_rows<typename Cfg::Elem, typename Cfg::SmemLayoutDq>(acc, p.scale, smem_addr(ss.dq_store.dq[consumer]), tid);
        tma_store_fence();
        bar_sync(kGradStoreBarrier + consumer, 128);
        if (tid == 0) {
          store_rows_tma<D>(p.tma_store, sDq, p.seqlen, p.heads, p.batch, t.offset + row0, t.h, t.b);
          tma_store_arrive();
        }
        return;
      }
    }
    typename Cfg::Elem* dq = p.dq + t.b * p.dq_stride_b + t.h * p.dq_stride_h + t.offset * p.dq_stride_s;
    store_rows(acc, tQcQ, p.scale, dq, p.dq_stride_s, row0, q_tile.hi);
  });
  if constexpr (Cfg::kTmaStore) {
    if (tid == 0) tma_store_wait<0>();  // the last store has read its buffer before the CTA exits
  }
}

}  // namespace dlm::sm90
