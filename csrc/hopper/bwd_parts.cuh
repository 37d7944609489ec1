// The sm90 backward's shared pieces (csrc/hopper/diffusion_bwd.cuh has the overview): named
// barriers and register helpers, the dK/dV and dQ configurations, their parameters, the gradient
// stores, and the two memory-bound kernels around the matmul kernels (preprocess, dQ conversion).
#pragma once

#include <cute/tensor.hpp>
#include <cute/arch/copy_sm90_tma.hpp>
#include <cute/atom/copy_traits_sm90_tma.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/numeric_types.h>

#include <cmath>

#include "dlm/geometry.h"
#include "hopper/common.cuh"

namespace dlm::sm90 {

using namespace cute;

// The tile shapes the shipped instantiations use (the binding builds the orders for them): at D =
// 128, dK/dV over (64 queries) x (128 keys) tiles and dQ over (128 rows) x (128 keys); at D = 64
// dK/dV over 128 x 128 (bwd_block_m: S^T / dP^T 64 x 128 per warpgroup, dK / dV 64 x 64, the same
// 192 accumulator registers as D = 128's 64 x 64 and 64 x 128; harness `bm128-64`, session 19: the
// dK/dV kernel 1.13-1.20x, the whole backward 1.07-1.14x the 64-query tiles' with the persistent
// kernel, 1.03-1.05x one CTA per key tile); at D = 256 both over 64 x 64 (DkDvConfig kRoles, DqConfig
// kSplitKeys say why). The backward with dS through HBM (hopper/bwd_dq_from_ds.cuh; D = 128 / 256)
// keeps the dK/dV tiles, and its dQ kernel takes 128 rows x the dK/dV kernel's key tile
// (ds_dq_block_n): one scratch block of dS^T per (64 rows, key tile).
constexpr int kBwdBlockM = 64, kBwdBlockN = 128, kBwdStages = 2;
constexpr int kDqBlockM = 128, kDqBlockN = 128, kDqStages = 2;
constexpr int bwd_block_m(int d) { return d == 64 ? 128 : kBwdBlockM; }
constexpr int bwd_block_n(int d) { return d == 256 ? 64 : kBwdBlockN; }
constexpr int dq_block_m(int d) { return d == 256 ? 64 : kDqBlockM; }
constexpr int dq_block_n(int d) { return d == 256 ? 64 : kDqBlockN; }
constexpr int kDsDqBlockM = 128;
constexpr int ds_dq_block_n(int d) { return bwd_block_n(d); }
constexpr int64_t ds_block_elems(int d) { return int64_t{kBwdBlockM} * bwd_block_n(d); }

// Named barriers of the fused dK/dV/dQ kernel (id 0 is __syncthreads): both consumers' dS^T
// written (256 threads); one consumer's dQ partial staged (128 threads, id kFusedDqBarrier + consumer).
constexpr int kFusedDsBarrier = 1, kFusedDqBarrier = 2;
// x, through a volatile move the compiler can neither fold nor hoist: what is computed from the
// result is computed where this call stands.
CUTE_DEVICE int opaque(int x) {
  int y;
  asm volatile("mov.b32 %0, %1;" : "=r"(y) : "r"(x));
  return y;
}
// Element (row, col) of a swizzled shared tile (layout Layout, element Elem) from the tile's start,
// in a GMMA descriptor's start-address units (16 bytes): added to the descriptors of the tile's
// first sub-tile, it gives those of the sub-tile there (rows and columns at multiples of the
// swizzle's 1 KB period keep its phase).
template <class Layout, class Elem>
constexpr uint32_t desc_units(int row, int col) {
  return uint32_t(Layout{}(row, col) * sizeof(Elem) / 16);
}
CUTE_DEVICE void st_shared_f32x2(uint32_t addr, float x, float y) {
  asm volatile("st.shared.v2.f32 [%0], {%1, %2};" ::"r"(addr), "f"(x), "f"(y));
}

// An fp32 register fragment passed between the two consumer warpgroups (same fragment layout):
// thread t of the sender writes its values where thread t of the receiver reads them, as float4s
// in [value / 4][thread] order (consecutive threads, consecutive 16 bytes: no bank conflicts).
// fragment_take stores them into the receiver's fragment, or (kAdd) adds them to it.
template <class Frag>
CUTE_DEVICE void fragment_give(float4* buf, Frag const& f, int tid) {
  CUTE_UNROLL
  for (int i = 0; i < size(f); i += 4) buf[i / 4 * 128 + tid] = make_float4(f(i), f(i + 1), f(i + 2), f(i + 3));
}
template <bool kAdd, class Frag>
CUTE_DEVICE void fragment_take(float4 const* buf, Frag& f, int tid) {
  CUTE_UNROLL
  for (int i = 0; i < size(f); i += 4) {
    const float4 x = buf[i / 4 * 128 + tid];
    if constexpr (kAdd) {
      f(i) += x.x, f(i + 1) += x.y, f(i + 2) += x.z, f(i + 3) += x.w;
    } else {
      f(i) = x.x, f(i + 1) = x.y, f(i + 2) = x.z, f(i + 3) = x.w;
    }
  }
}

// f(true_type) or f(false_type): a tile's element loop compiled once with and once without the
// mask, so the test is made per tile rather than per score (a per-score test compiled to a
// predicated branch around every score, FULL tiles included: csrc/NOTES.md "Per-tile mask").
template <class F>
CUTE_DEVICE void with_mask_decided(bool masked, F&& f) {
  if (masked) {
    f(cute::true_type{});
  } else {
    f(cute::false_type{});
  }
}

// ------------------------------------------------------------------------------ configurations
// 128-byte swizzled, K-major (head dim contiguous): the layout TMA writes and wgmma reads. A
// transposed view (MN-major, the other dimension contiguous) over the same bytes is what the
// P^T dO / dS^T Q / dS K matmuls read as their B operand.
template <class Elem, int ROWS, int D>
using SwizzledTile = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Elem>{},
                                            Shape<Int<ROWS>, Int<D>>{}));
template <class Elem, int ROWS, int D, int STAGES>
using SwizzledTiles = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Elem>{},
                                             Shape<Int<ROWS>, Int<D>, Int<STAGES>>{}));
template <class Elem, int ROWS, int D, int STAGES>
using SwizzledTilesT = decltype(composition(
    SwizzledTiles<Elem, ROWS, D, STAGES>{},
    make_ordered_layout(Shape<Int<D>, Int<ROWS>, Int<STAGES>>{}, Step<_2, _1, _3>{})));

// START_: where tiles may start (kStartTile / kStartAny / kStartVarlen, hopper/common.cuh). The
// consumers' loops have no ping-pong turns and no in-warpgroup overlap: both were measured slower
// here (csrc/NOTES.md "Backward variants (measured, deleted)").
// The dK/dV kernel's extra pieces when it also produces dQ (FUSED_DQ_, csrc/NOTES.md "Fused dQ"):
// dS staged in shared memory as the (queries x keys) A operand of dQ = dS K, two buffers so that a
// warpgroup may write tile j + 1's dS while the other still reads tile j's; each consumer's
// (BM x D / 2) fp32 dQ partial staged for one TMA reduce-add into a (B, S, H, D) fp32 accumulator.
template <class Elem, int D, int BM, int BN, int kConsumers>
struct FusedDqParts {
  static constexpr int kCols = D / kConsumers;  // dQ columns per consumer warpgroup
  using SmemLayoutdS = decltype(tile_to_shape(GMMA::Layout_MN_SW128_Atom<Elem>{},
                                              Shape<Int<BM>, Int<BN>, _2>{}));  // queries contiguous
  // The same bytes as (keys, queries, buffer): where each consumer writes its dS^T accumulator.
  using SmemLayoutdSt = decltype(composition(
      SmemLayoutdS{}, make_ordered_layout(Shape<Int<BN>, Int<BM>, _2>{}, Step<_2, _1, _3>{})));
  using SmemLayoutKt = decltype(composition(
      SwizzledTile<Elem, BN, D>{}, make_ordered_layout(Shape<Int<D>, Int<BN>>{}, Step<_2, _1>{})));
  using SmemLayoutdQ = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<float>{},
                                              Shape<Int<BM>, Int<kCols>>{}));
  // dQ = dS K over the tile's BN keys: (BM queries) x (D / 2 columns), both operands from smem.
  using MmaDq = decltype(make_tiled_mma(
      SM90::GMMA::ss_op_selector<Elem, Elem, float, Shape<Int<BM>, Int<kCols>, Int<BN>>,
                                 GMMA::Major::MN, GMMA::Major::MN>()));
  using TmaDq = decltype(make_tma_copy(
      SM90_TMA_REDUCE_ADD{},
      make_tensor(make_gmem_ptr(static_cast<float*>(nullptr)), make_shape(1, D, 1, 1),
                  make_stride(int64_t{D}, _1{}, int64_t{D}, int64_t{D})),
      SmemLayoutdQ{}));
  struct Smem {
    alignas(1024) Elem ds[cosize_v<SmemLayoutdS>];
    alignas(1024) float dq[kConsumers][cosize_v<SmemLayoutdQ>];
  };
};
struct NoFusedDq {  // what the unfused configs hold in the fused pieces' places: nothing
  struct Smem {};
  using TmaDq = Smem;
  using MmaDq = Smem;
  using TmaDs = Smem;
};

// HANDOFF_ (an experiment of the D = 256 role split, harness `d256-handoff`; not shipped): consumer
// 0 hands its P^T (fp32, in its accumulator's per-thread order) to consumer 1 through two shared
// buffers, so that consumer 1 computes dP^T but not S^T: 4 matmuls per tile pair instead of 5.
// One-directional, two buffers deep (named barriers kHandoffReady / kHandoffFree + buffer):
// consumer 0 may run a tile ahead, which the fused dQ's two-way per-tile barrier did not allow.
template <int kElems>
struct PHandoff {
  struct Smem {
    alignas(16) float p[2][kElems];
  };
};
constexpr int kHandoffReady = 1, kHandoffFree = 3;  // named barriers (+ buffer), 256 threads

// STORE_DS_'s pieces: each storing warpgroup (every consumer; at D = 256 the dK one alone) stages
// its 64 keys x BM queries of dS^T (bf16, queries contiguous, 128-byte swizzle) in one of two
// buffers, and each of its warps stores its 16 keys with one TMA store: no barrier beyond the warp,
// the buffer reused two visits later (bulk group wait).
template <class Elem, int BM, int kStorers>
struct DsStoreParts {
  static constexpr int kWarpRows = 16;  // keys per warp
  using SmemLayout = SwizzledTile<Elem, 64, BM>;
  struct Smem {
    alignas(1024) Elem ds[2][kStorers][cosize_v<SmemLayout>];
  };
  // The scratch as (rows, BM): block k's BN keys are rows [k BN, (k + 1) BN).
  static auto make_tma(Elem* p, int rows) {
    return make_tma_copy(SM90_TMA_STORE{},
                         make_tensor(make_gmem_ptr(p), make_shape(rows, BM), make_stride(int64_t{BM}, _1{})),
                         SwizzledTile<Elem, kWarpRows, BM>{});
  }
  using TmaDs = decltype(make_tma(nullptr, 1));
};

template <class Elem_, int D_, int BM_ = 64, int BN_ = 128, int STAGES_ = 2, int START_ = kStartTile,
          bool FUSED_DQ_ = false, bool TMA_STORE_ = false, bool PERSISTENT_ = false, bool HANDOFF_ = false,
          int STORE_DS_ = 0>
struct DkDvConfig {
  using Elem = Elem_;
  static constexpr int kStart = START_;
  // STORE_DS_ (session 18): the kernel also writes every visited tile's dS^T (the A operand of its
  // dK matmul) to p.ds, for a dQ kernel that reads dS instead of recomputing S and dP
  // (hopper/bwd_dq_from_ds.cuh): 5 matmuls per tile pair, no atomics, 2 bytes per pair. 1: staged
  // before the dV / dK matmuls are issued; 2: behind them (reading their A operand's registers).
  static constexpr bool kStoreDs = STORE_DS_ != 0;
  static constexpr bool kStoreDsBehind = STORE_DS_ == 2;
  // At D = 256 (the role split below) the dK warpgroup alone holds dS^T, so it alone stores it.
  // Tiles at multiples of the tile size (batched halves of multiples of 128) or packed samples
  // (kStartVarlen: each sample's slot table rows from p.ds_rows; keys a tile reads past its half
  // get dS^T = 0, since the dQ kernel multiplies the whole block by the rows of K it loads).
  static_assert(!STORE_DS_ || ((D_ == 64 || D_ == 128 || (D_ == 256 && !HANDOFF_)) &&
                               (START_ == kStartTile || START_ == kStartVarlen) && !FUSED_DQ_),
                "the dS store: D = 64 (harness ds64), 128 or 256 (without the hand-over), kStartTile or kStartVarlen tiles");
  // TMA_STORE_: the epilogue stages dK / dV in the warpgroup's own (now dead) rows of K / V in
  // shared memory and stores them with TMA (store_rows_tma) instead of 4-byte register stores.
  static constexpr bool kTmaStore = TMA_STORE_;
  // FUSED_DQ_: the kernel also computes dQ (one more matmul per tile, fp32 reduce-adds; the dQ
  // kernel does not run; not deterministic). Correct but measured 0.79-0.90x of the two kernels on
  // the H200, so only the harness runs it (launch_bwd_fused; csrc/NOTES.md "Fused dQ"). Session 13
  // found register pressure behind it and cut the spills (kStartAny: 228 -> 8 bytes); not timed yet.
  static constexpr bool kFusedDq = FUSED_DQ_;
  // Bulk copies need 16-byte aligned sources: a query tile starting anywhere copies its lse2 / delta
  // from the aligned element at or before its first row, kRowPad more floats, and the consumers
  // skip the (row & 3) leading ones.
  static constexpr int kRowPad = kStart == kStartTile ? 0 : 4;
  // BM: queries per visited tile; BN: keys per CTA, 64 per consumer warpgroup. BM = 64 keeps the
  // four accumulators of a warpgroup (dK, dV: 64 x D; S^T, dP^T: 64 x BM) at 192 fp32 registers
  // per thread for D = 128, under setmaxnreg's 240; BM = 128 does the same at D = 64 (bwd_block_m).
  static constexpr int D = D_, BM = BM_, BN = BN_, STAGES = STAGES_;
  // D = 256: the consumers split the work by gradient, not by key. Both take the CTA's BN = 64 keys;
  // consumer 0 accumulates dV += P^T dO, consumer 1 dK += dS^T Q, each over all 256 columns (one
  // 64 x 256 accumulator, 128 registers: dK and dV of 64 keys in one warpgroup would need 256).
  // Both compute S^T, consumer 1 also dP^T: 5 matmuls per tile pair where D <= 128 does 4, and
  // no data passes between the warpgroups (a lockstep barrier per tile cost the fused dQ 1.9x,
  // csrc/NOTES.md "Fused dQ"). 194 KB of shared memory (K, V 32 KB each; Q, dO 2 x 32 KB each).
  static constexpr bool kRoles = D == 256;
  static constexpr int kConsumerRows = 64;  // keys per consumer warpgroup
  static constexpr int kConsumers = kRoles ? 2 : BN / kConsumerRows;
  static constexpr int kThreads = 128 * (1 + kConsumers);
  static_assert(kConsumers == 2, "the register split below assumes two consumer warpgroups");
  static_assert(!kRoles || (BN == kConsumerRows && !FUSED_DQ_ && !TMA_STORE_ && !PERSISTENT_),
                "D = 256: 64 keys per CTA, register stores, one CTA per key tile");
  static constexpr bool kHandoff = HANDOFF_;  // PHandoff above
  static_assert(!kHandoff || kRoles, "the P^T hand-over is a variant of the role split");
  using Handoff = std::conditional_t<kHandoff, PHandoff<kConsumerRows * BM>, NoFusedDq>;
  // D = 64 would give each warpgroup a 32-column slice of K^T, half a 128-byte swizzle row, which
  // a wgmma descriptor cannot address.
  static_assert(!kFusedDq || D == 128, "the fused dQ splits D = 128 between the consumers");
  static_assert(!(kFusedDq && kTmaStore), "the fused dQ reads every row of K until the end");
  // PERSISTENT_: a grid of at most one CTA per SM walks the (key tile, slot) items in the launch's
  // order, with two K / V buffers: the producer loads the next item's K and V (and its first Q /
  // dO tiles) while the consumers finish this one, so an item's prologue (K / V and Q / dO load
  // latency) and its epilogue's store no longer sit between two items' matmuls. 192 KB of shared
  // memory at D = 128 (K, V 2 x 64 KB, Q / dO 64 KB).
  static constexpr bool kPersistent = PERSISTENT_;
  static constexpr int kKvBufs = kPersistent ? 2 : 1;
  static_assert(!(kFusedDq && kPersistent), "the fused dQ is not persistent");
  using Fused = std::conditional_t<kFusedDq, FusedDqParts<Elem, D, BM, BN, kConsumers>, NoFusedDq>;
  using DsStore = std::conditional_t<kStoreDs, DsStoreParts<Elem, BM, kRoles ? 1 : kConsumers>, NoFusedDq>;

  using SmemLayoutQ = SwizzledTiles<Elem, BM, D, STAGES>;    // Q and dO: (BM, D, STAGES)
  using SmemLayoutQt = SwizzledTilesT<Elem, BM, D, STAGES>;  // their transpose: (D, BM, STAGES)
  using SmemLayoutKV = SwizzledTile<Elem, BN, D>;            // K and V, loaded once

  // S^T = K Q^T and dP^T = V dO^T: (64 keys) x (BM queries), reduced over D.
  using MmaSdp = decltype(make_tiled_mma(
      SM90::GMMA::ss_op_selector<Elem, Elem, float, Shape<Int<kConsumerRows>, Int<BM>, Int<D>>>()));
  // dV += P^T dO and dK += dS^T Q: (64 keys) x D, reduced over the BM queries.
  using MmaKV = decltype(make_tiled_mma(
      SM90::GMMA::rs_op_selector<Elem, Elem, float, Shape<Int<kConsumerRows>, Int<D>, Int<BM>>,
                                 GMMA::Major::K, GMMA::Major::MN>()));

  struct SharedStorage {
    alignas(1024) Elem k[kKvBufs][cosize_v<SmemLayoutKV>];
    alignas(1024) Elem v[kKvBufs][cosize_v<SmemLayoutKV>];
    alignas(1024) Elem q[cosize_v<SmemLayoutQ>];
    alignas(1024) Elem dout[cosize_v<SmemLayoutQ>];
    alignas(16) float lse2[STAGES][BM + kRowPad];  // bulk copies need 16-byte aligned destinations
    alignas(16) float delta[STAGES][BM + kRowPad];
    alignas(8) uint64_t kv_full[kKvBufs], kv_empty[kKvBufs];
    uint64_t q_full[STAGES], do_full[STAGES], empty[STAGES];
    typename Fused::Smem fused;
    typename Handoff::Smem handoff;
    typename DsStore::Smem ds_store;
  };
  static constexpr int kTileBytesQ = BM * D * sizeof(Elem);
  static constexpr int kTileBytesKV = BN * D * sizeof(Elem);
  static constexpr int kRowBytes = (BM + kRowPad) * sizeof(float);  // one tile's lse2 or delta
};

template <class Elem_, int D_, int BM_ = 128, int BN_ = 128, int STAGES_ = 2, int START_ = kStartTile,
          bool TMA_STORE_ = false>
struct DqConfig {  // START_, TMA_STORE_: as DkDvConfig's (dQ staged in the warpgroup's rows of Q)
  using Elem = Elem_;
  static constexpr int kStart = START_;
  static constexpr bool kTmaStore = TMA_STORE_;
  static constexpr bool kFusedDq = false;
  using Fused = NoFusedDq;
  using DsStore = NoFusedDq;
  static constexpr int D = D_, BM = BM_, BN = BN_, STAGES = STAGES_;
  // D = 256: the consumers split each visited key tile, not the rows. Both take the CTA's BM = 64
  // rows, each the tile's half of BN = 64 keys (kKeysW), and each accumulates its own partial dQ
  // over all 256 columns (64 x 256, 128 registers; two warpgroups of 64 rows each would hold the
  // same, but Q and dO of 128 rows at D = 256 leave no room for a K / V ring). No tensor work is
  // repeated; consumer 1 hands its partial to consumer 0 through shared memory at the end (a fixed
  // order: deterministic). 193 KB of shared memory (Q, dO 32 KB each; K, V 2 x 32 KB each).
  static constexpr bool kSplitKeys = D == 256;
  static constexpr int kConsumerRows = 64;
  static constexpr int kConsumers = kSplitKeys ? 2 : BM / kConsumerRows;
  static constexpr int kKeysW = kSplitKeys ? BN / 2 : BN;  // keys of a visited tile per consumer
  static constexpr int kThreads = 128 * (1 + kConsumers);
  static_assert(kConsumers == 2, "the register split below assumes two consumer warpgroups");
  static_assert(!kSplitKeys || (BM == kConsumerRows && BN == 64 && !TMA_STORE_),
                "D = 256: 64 rows and 64-key tiles per CTA, register stores");

  using SmemLayoutQ = SwizzledTile<Elem, BM, D>;             // Q and dO, loaded once
  using SmemLayoutKV = SwizzledTiles<Elem, BN, D, STAGES>;   // K and V per visit
  using SmemLayoutKt = SwizzledTilesT<Elem, BN, D, STAGES>;  // K^T: (D, BN, STAGES)

  // S = Q K^T and dP = dO V^T: (64 rows) x kKeysW, reduced over D.
  using MmaSdp = decltype(make_tiled_mma(
      SM90::GMMA::ss_op_selector<Elem, Elem, float, Shape<Int<kConsumerRows>, Int<kKeysW>, Int<D>>>()));
  // dQ += dS K: (64 rows) x D, reduced over kKeysW.
  using MmaDq = decltype(make_tiled_mma(
      SM90::GMMA::rs_op_selector<Elem, Elem, float, Shape<Int<kConsumerRows>, Int<D>, Int<kKeysW>>,
                                 GMMA::Major::K, GMMA::Major::MN>()));

  struct SharedStorage {
    alignas(1024) Elem q[cosize_v<SmemLayoutQ>];
    alignas(1024) Elem dout[cosize_v<SmemLayoutQ>];
    alignas(1024) Elem k[cosize_v<SmemLayoutKV>];
    alignas(1024) Elem v[cosize_v<SmemLayoutKV>];
    alignas(8) uint64_t q_full;
    uint64_t k_full[STAGES], k_empty[STAGES], v_full[STAGES], v_empty[STAGES];
  };
  static constexpr int kTileBytesQ = BM * D * sizeof(Elem);
  static constexpr int kTileBytesKV = BN * D * sizeof(Elem);
};

// TMA descriptors: one box of ROWS x D of a (B, S, H, D) tensor.
template <class Elem, int ROWS, int D>
auto make_tma_rows(Elem const* p, int s, int h, int b, int64_t ss, int64_t sh, int64_t sb) {
  return make_tma_copy(SM90_TMA_LOAD{}, bshd_tensor(p, s, D, h, b, ss, sh, sb),
                       SwizzledTile<Elem, ROWS, D>{});
}
template <class Elem, int ROWS, int D>
using TmaRows = decltype(make_tma_rows<Elem, ROWS, D>(nullptr, 1, 1, 1, 1, 1, 1));
// TMA stores of a gradient (B, S, H, D): boxes of kGradStoreRows x 64, one 128-byte swizzle atom
// column of a consumer's staged rows (a 64-row slice of a 128-row K-major tile is contiguous per
// atom column, not as a whole).
constexpr int kGradStoreRows = 64;
template <class Elem>
auto make_tma_store_rows(Elem* p, int s, int d, int h, int b, int64_t ss, int64_t sh, int64_t sb) {
  return make_tma_copy(SM90_TMA_STORE{},
                       make_tensor(make_gmem_ptr(p), make_shape(s, d, h, b), make_stride(ss, _1{}, sh, sb)),
                       SwizzledTile<Elem, kGradStoreRows, 64>{});
}
template <class Elem>
using TmaStoreRows = decltype(make_tma_store_rows<Elem>(nullptr, 1, 1, 1, 1, 1, 1, 1));

// Everything both gradient kernels read: Q, K, V and dO through TMA, lse2 / delta from the
// preprocess, the mask, and the walk order of their work tiles.
template <class Cfg, int Q_ROWS, int KV_ROWS>
struct BwdParams {
  using Elem = typename Cfg::Elem;
  TmaRows<Elem, Q_ROWS, Cfg::D> tma_q, tma_do;
  TmaRows<Elem, KV_ROWS, Cfg::D> tma_k, tma_v;
  const float* lse2;   // (B, H, S) contiguous: lse * log2 e
  const float* delta;  // (B, H, S) contiguous: rowsum(dO * O) - dlse
  Elem *grad_a, *grad_b;  // dK/dV kernel: dK, dV; dQ kernel: dQ, unused
  int64_t a_stride_s, a_stride_h, a_stride_b, b_stride_s, b_stride_h, b_stride_b;
  int seqlen, heads, kv_heads, batch;
  SequenceMask mask;
  float scale, scale_log2;    // softmax scale, and times log2 e
  const int32_t* tile_order;  // own tiles, most expensive first (geometry most_expensive_first)
  // kStartVarlen only: entry e is own tile tile_order[e] of sample tile_sample[e]; sample i
  // occupies packed rows [cu_seqlens[i], cu_seqlens[i + 1]) of batch 0; mask.block_size is every
  // sample's block size.
  const int32_t* tile_sample = nullptr;
  const int32_t* cu_seqlens = nullptr;
  // The grid: CTA w is (entry, slot) of `order` (hopper/common.cuh WorkOrder), over `entries` of
  // tile_order and the batch * (kv) heads slots.
  int entries = 0;
  WorkOrder order{};
  // Fused dK/dV/dQ only: reduce-adds into the (B, S, H, D) fp32 dQ accumulator.
  typename Cfg::Fused::TmaDq tma_dq{};
  // Cfg::kTmaStore only: stores of grad_a and grad_b (dQ kernel: grad_a alone).
  TmaStoreRows<Elem> tma_store_a{}, tma_store_b{};
  // DkDvConfig kStoreDs only: the dS^T scratch, blocks of BN x BM (keys x queries, queries
  // contiguous); the visit of query tile qt and key tile kt of slot (b, h) writes block 1 + (b * heads
  // + h) * ds_visits + ds_slots[(row0 + qt) * ds_k_tiles + kt] (diffusion_bwd.cuh launch_bwd_ds),
  // row0 = 0, or (kStartVarlen) ds_rows[sample]: each sample's rows of the table.
  Elem* ds = nullptr;
  const int32_t* ds_slots = nullptr;
  const int32_t* ds_rows = nullptr;
  int ds_k_tiles = 0, ds_visits = 0;
  typename Cfg::DsStore::TmaDs tma_ds{};
  // The persistent dK/dV kernel's walk: the balanced schedule built for exactly this grid
  // (common.cuh walk_item), or null: the snake.
  const int32_t* schedule = nullptr;
};

// Floats past the end of the lse2 / delta scratch (B * H * S) that the odd-length / varlen dK/dV
// kernel may read (a tile's BM rows plus the 3 before its aligned start), which must hold finite
// values (zeros): masked queries get P^T = 0, and dS^T = 0 * (dP^T - delta) only if delta is finite.
constexpr int kVarlenScratchPad = 128;

// The mask and the packed row of position 0 of the CTA's sample (kStartVarlen: entry e's sample;
// otherwise the kernel's mask and row 0).
struct SampleGeom {
  SequenceMask mask;
  int offset;
};
template <class Cfg, class Params>
CUTE_DEVICE SampleGeom sample_geom(Params const& p, int e) {
  if constexpr (Cfg::kStart == kStartVarlen) {
    const int sample = p.tile_sample[e], lo = p.cu_seqlens[sample];
    return {block_diffusion(p.cu_seqlens[sample + 1] - lo, p.mask.block_size), lo};
  } else {
    return {p.mask, 0};
  }
}
template <class Cfg>
using DkDvParams = BwdParams<Cfg, Cfg::BM, Cfg::BN>;  // Q tiles of BM rows, one K/V tile of BN
template <class Cfg>
using DqParams = BwdParams<Cfg, Cfg::BM, Cfg::BN>;    // one Q tile of BM rows, K/V tiles of BN

// Stores a 64 x N fp32 accumulator (times `mul`) as Elem rows of a strided tensor, two adjacent
// columns per 32-bit store (the accumulator's pairs (c = 0, 1) are neighbours).
template <class Elem, class Acc, class Coords>
CUTE_DEVICE void store_rows(Acc const& acc, Coords const& coords, float mul, Elem* base,
                            int64_t stride_row, int row_base, int row_end) {
  Tensor a = make_tensor(acc.data(), acc_rowcol(acc.layout()));
  Tensor c = make_tensor(coords.data(), acc_rowcol(coords.layout()));
  CUTE_UNROLL
  for (int i = 0; i < size<0>(a); ++i) {
    const int row = row_base + get<0>(c(i, 0));
    if (row >= row_end) continue;
    CUTE_UNROLL
    for (int j = 0; j < size<1>(a); j += 2) {
      alignas(4) Elem pair[2] = {Elem(a(i, j) * mul), Elem(a(i, j + 1) * mul)};
      *reinterpret_cast<uint32_t*>(base + row * stride_row + get<1>(c(i, j))) =
          *reinterpret_cast<uint32_t*>(pair);
    }
  }
}

// The TMA-store epilogue of a consumer warpgroup (Cfg::kTmaStore): stage_rows writes its 64 x D
// accumulator (times `mul`) as Elem into its own 64-row slice of a tile laid out as TileLayout
// (K-major, 128-byte swizzled: is_sw128_k_tile) that no wgmma reads any more, starting at the
// shared address row0 (conflict-free 32-bit stores, the addresses by Sw128Stage); after
// tma_store_fence and a warpgroup barrier, one thread issues store_rows_tma: the slice's 64 x 64
// atom columns to rows [row, row + 64) of head h, batch b of the (rows, D, heads, batch) tensor
// `tma` stores. The caller takes this path only for warpgroups whose 64 rows all lie before the
// tile's end (a box would write rows of the next half or sample). Why: the forward's register
// stores of O cost it up to 19 % (csrc/NOTES.md, forward v6); the gradient kernels store the same
// way. tid: the thread's index in its warpgroup.
template <class Elem, class TileLayout, class Acc>
CUTE_DEVICE void stage_rows(Acc const& acc, float mul, uint32_t row0, int tid) {
  constexpr int kTileRows = size<0>(TileLayout{}), D = size<1>(TileLayout{});
  static_assert(is_sw128_k_tile<TileLayout, Elem, kTileRows, D>(),
                "Sw128Stage's addresses assume the staging tile's layout");
  Tensor a_rc = make_tensor(acc.data(), acc_rowcol(acc.layout()));
  static_assert(size<0>(a_rc) == 2 && size<1>(a_rc) == D / 4, "a 64 x D accumulator per warpgroup");
  const Sw128Stage<kTileRows> stage(row0, tid);
  CUTE_UNROLL
  for (int i = 0; i < size<0>(a_rc); ++i)
    CUTE_UNROLL
    for (int j = 0; j < size<1>(a_rc); j += 2) {
      alignas(4) Elem pair[2] = {Elem(a_rc(i, j) * mul), Elem(a_rc(i, j + 1) * mul)};
      st_shared_b32(stage.pair(i, j / 2), *reinterpret_cast<uint32_t*>(pair));
    }
}
template <int D, class Tma, class Stage>
CUTE_DEVICE void store_rows_tma(Tma const& tma, Stage const& stage, int rows, int heads, int batch,
                                int row, int h, int b) {
  Tensor m = tma.get_tma_tensor(make_shape(rows, D, heads, batch));
  Tensor g = domain_offset(make_coord(row, 0), m(_, _, h, b));
  auto slice = tma.get_slice(0);
  CUTE_UNROLL
  for (int k = 0; k < D / 64; ++k)
    copy(tma, slice.partition_S(local_tile(stage, Shape<Int<kGradStoreRows>, _64>{}, make_coord(0, k))),
         slice.partition_D(local_tile(g, Shape<Int<kGradStoreRows>, _64>{}, make_coord(0, k))));
}
// Named barriers of the TMA-store epilogue: kGradStoreBarrier + consumer (128 threads); of the
// D = 256 dQ kernel's partial sums: kDqSumBarrier (both consumers, 256 threads).
constexpr int kGradStoreBarrier = 4, kDqSumBarrier = 6;

// ---------------------------------------------------------------------------------- preprocess
// delta and lse2 of kPreRows consecutive rows s of one (batch, head) per CTA (grid: row blocks, H,
// B), D / 8 threads per row, 16 bytes of O and dO per thread. Rows run along s, so a warp's lse /
// dlse reads and delta / lse2 writes ((B, H, S) arrays) are contiguous, and no thread divides: the
// first version walked (b, s, h) rows with three 64-bit divisions per thread and scattered 4-byte
// accesses, and took 53.5 us at B = 8, S = 2K, H = 16, D = 128 (2.5 TB/s of O and dO; session 8).
template <class Elem>
struct PreParams {
  const Elem *o, *dout;
  const float *lse, *dlse;  // dlse may be null (no gradient flows into lse)
  float *lse2, *delta;      // (B, H, S) contiguous
  int64_t o_stride[3], do_stride[3];            // (batch, seq, head)
  int64_t lse_stride[2], dlse_stride[2];        // (batch, head)
  int batch, seqlen, heads;
  // Zeroed by the launch's first CTA, for the kernels after it (one launch instead of a memset or
  // fill each: session 20, the step at n = 1K is near host-bound): pad_floats floats of lse2 and
  // of delta past their B * H * S (kVarlenScratchPad), and zero_vectors 16-byte words at zero
  // (the dS backward's block 0).
  int pad_floats = 0;
  uint4* zero = nullptr;
  int zero_vectors = 0;
};
constexpr int kPreThreads = 256;
template <int D>
constexpr int kPreRows = kPreThreads / (D / 8);
// The lanes of the row thread t works on (kLanes consecutive threads, kLanes <= 32 a power of 2).
template <int kLanes>
CUTE_DEVICE unsigned row_lanes_mask(unsigned t) {
  return kLanes == 32 ? 0xffffffffu : ((1u << kLanes) - 1) << (t % 32 / kLanes * kLanes);
}

template <class Elem, int D>
__global__ void __launch_bounds__(kPreThreads) bwd_preprocess_kernel(const PreParams<Elem> p) {
  constexpr int kLanes = D / 8;  // threads per row
  const int h = blockIdx.y, lane = threadIdx.x % kLanes;
  const int s = blockIdx.x * kPreRows<D> + threadIdx.x / kLanes;
  // The dK/dV kernel after it (a programmatic dependent launch) may start its set-up now; it waits
  // for this grid's end before it loads lse2 / delta.
  allow_dependents();
  if (blockIdx.x == 0 && blockIdx.y == 0 && blockIdx.z == 0) {
    const int64_t rows = static_cast<int64_t>(p.batch) * p.heads * p.seqlen;
    for (int i = threadIdx.x; i < p.pad_floats; i += kPreThreads) p.lse2[rows + i] = p.delta[rows + i] = 0.f;
    for (int i = threadIdx.x; i < p.zero_vectors; i += kPreThreads) p.zero[i] = make_uint4(0, 0, 0, 0);
  }
  if (s >= p.seqlen) return;  // whole rows leave: the shuffles below stay within live rows
  for (int b = blockIdx.z; b < p.batch; b += gridDim.z) {  // grid.z is at most 65535
    const uint4 o = *reinterpret_cast<const uint4*>(
        p.o + b * p.o_stride[0] + s * p.o_stride[1] + h * p.o_stride[2] + lane * 8);
    const uint4 g = *reinterpret_cast<const uint4*>(
        p.dout + b * p.do_stride[0] + s * p.do_stride[1] + h * p.do_stride[2] + lane * 8);
    const Elem* oe = reinterpret_cast<const Elem*>(&o);
    const Elem* ge = reinterpret_cast<const Elem*>(&g);
    float acc = 0.f;
    CUTE_UNROLL
    for (int i = 0; i < 8; ++i) acc += static_cast<float>(oe[i]) * static_cast<float>(ge[i]);
    CUTE_UNROLL
    for (int m = kLanes / 2; m > 0; m /= 2) acc += __shfl_xor_sync(row_lanes_mask<kLanes>(threadIdx.x), acc, m);
    if (lane == 0) {
      const int64_t out = (static_cast<int64_t>(b) * p.heads + h) * p.seqlen + s;
      if (p.dlse) acc -= p.dlse[b * p.dlse_stride[0] + h * p.dlse_stride[1] + s];
      p.delta[out] = acc;
      p.lse2[out] = p.lse[b * p.lse_stride[0] + h * p.lse_stride[1] + s] * 1.4426950408889634f;
    }
  }
}

// dQ = scale * the fused kernel's fp32 accumulator ((B, S, H, D) contiguous), as Elem into dq's
// strides: 8 values per thread, D / 8 threads per row.
template <class Elem, int D>
__global__ void __launch_bounds__(256) bwd_convert_dq_kernel(const float* acc, Elem* dq,
                                                             int64_t s_b, int64_t s_s, int64_t s_h,
                                                             int batch, int seqlen, int heads, float scale) {
  constexpr int kLanes = D / 8;
  const int64_t rows = static_cast<int64_t>(batch) * seqlen * heads;
  const int64_t r = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / kLanes;
  if (r >= rows) return;
  const int lane = threadIdx.x % kLanes;
  const int h = static_cast<int>(r % heads), s = static_cast<int>((r / heads) % seqlen);
  const int64_t b = r / (static_cast<int64_t>(heads) * seqlen);
  const float4* src = reinterpret_cast<const float4*>(acc + r * D + lane * 8);
  const float4 x = src[0], y = src[1];
  alignas(16) Elem out[8] = {Elem(x.x * scale), Elem(x.y * scale), Elem(x.z * scale), Elem(x.w * scale),
                             Elem(y.x * scale), Elem(y.y * scale), Elem(y.z * scale), Elem(y.w * scale)};
  *reinterpret_cast<uint4*>(dq + b * s_b + s * s_s + h * s_h + lane * 8) = *reinterpret_cast<uint4*>(out);
}

}  // namespace dlm::sm90
