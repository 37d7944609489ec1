// Block-diffusion attention backward for Hopper (sm_90a), written with CuTe from the nvidia-cutlass
// wheel: three kernels, in this order on one stream.
//
//   preprocess  one pass over O and dO: delta = rowsum(dO * O) - dlse and lse2 = lse * log2 e,
//               fp32, (B, H, S) contiguous scratch (plain CUDA, memory bound).
//   dK/dV       one CTA per (batch, kv head, key tile of BN = 128 keys), or (DkDvPersistent, halves
//               up to 1024 at D = 64 / 128) one per SM walking those items with two K / V buffers and a
//               TMA-store epilogue (DkDvConfig PERSISTENT_ / TMA_STORE_). Warpgroup 0 produces: one
//               thread loads K and V once, then for each query head of the kv head's group and
//               each query tile of BM = 64 rows that sees the key tile (dlm/geometry.h bwd_tiles:
//               at most two runs) it issues TMA copies of Q and dO plus bulk copies of that tile's
//               lse2 and delta into a ring of STAGES buffers. Warpgroups 1 and 2 consume, each
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
};

// DkDvConfig OWN_KIND_: each consumer thread's copy of its warpgroup's sub-runs of the item
// ([begin0, end0, begin1, end1] of TilePlans::runs_of over the warpgroup's keys).
template <int kThreads>
struct OwnRuns {
  struct Smem {
    alignas(16) int32_t runs[kThreads][4];
  };
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

template <class Elem_, int D_, int BM_ = 64, int BN_ = 128, int STAGES_ = 2, int START_ = kStartTile,
          bool FUSED_DQ_ = false, bool TMA_STORE_ = false, bool PERSISTENT_ = false, bool HANDOFF_ = false,
          bool OWN_KIND_ = false>
struct DkDvConfig {
  using Elem = Elem_;
  static constexpr int kStart = START_;
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
  // per thread for D = 128, under setmaxnreg's 240.
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
  // OWN_KIND_ (harness only, not measured yet): each consumer skips the visits that its own 64
  // keys see none of where the CTA's 128 see some (the noisy diagonal's other half, the
  // staircase's upper half when block_size divides 64: 10 % of the warpgroup visits at n = 1K,
  // 5.6 % at 2K, 2.9 % at 4K). Session 14's two versions kept the warpgroup's sub-run in registers
  // and lost 3-17 % to the spills (csrc/NOTES.md); this one keeps it in shared memory, one slot per
  // consumer thread (written and read by that thread only: no synchronisation), read per visit.
  static constexpr bool kOwnKind = OWN_KIND_ && !kRoles && !FUSED_DQ_;
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
    typename std::conditional_t<kOwnKind, OwnRuns<128 * kConsumers>, NoFusedDq>::Smem own;
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
// accumulator (times `mul`) as Elem into `stage`, its own 64-row slice of a K-major swizzled tile
// that no wgmma reads any more (partitioned like the accumulator: conflict-free 32-bit stores);
// after tma_store_fence and a warpgroup barrier, one thread issues store_rows_tma: the slice's
// 64 x 64 atom columns to rows [row, row + 64) of head h, batch b of the (rows, D, heads, batch)
// tensor `tma` stores. The caller takes this path only for warpgroups whose 64 rows all lie
// before the tile's end (a box would write rows of the next half or sample). Why: the forward's
// register stores of O cost it up to 19 % (csrc/NOTES.md, forward v6); the gradient kernels
// store the same way.
template <class Elem, class Acc, class Stage, class ThrMma>
CUTE_DEVICE void stage_rows(Acc const& acc, float mul, Stage const& stage, ThrMma const& thr) {
  Tensor st = thr.partition_C(stage);
  Tensor s_rc = make_tensor(st.data(), acc_rowcol(st.layout()));
  Tensor a_rc = make_tensor(acc.data(), acc_rowcol(acc.layout()));
  CUTE_UNROLL
  for (int i = 0; i < size<0>(a_rc); ++i)
    CUTE_UNROLL
    for (int j = 0; j < size<1>(a_rc); j += 2) {
      alignas(4) Elem pair[2] = {Elem(a_rc(i, j) * mul), Elem(a_rc(i, j + 1) * mul)};
      st_shared_b32(smem_addr(&s_rc(i, j)), *reinterpret_cast<uint32_t*>(pair));
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

// ------------------------------------------------------------------------------------- dK / dV
template <class Cfg>
__global__ void __launch_bounds__(Cfg::kThreads, 1)
    diffusion_bwd_dkdv_kernel(__grid_constant__ const DkDvParams<Cfg> p) {
  using Elem = typename Cfg::Elem;
  constexpr int BM = Cfg::BM, BN = Cfg::BN, D = Cfg::D, STAGES = Cfg::STAGES;
  constexpr int kRowsW = Cfg::kConsumerRows;  // keys per consumer warpgroup
  using Barrier = cutlass::arch::ClusterBarrier;
  using TxBarrier = cutlass::arch::ClusterTransactionBarrier;

  extern __shared__ __align__(1024) char smem_raw[];
  auto& ss = *reinterpret_cast<typename Cfg::SharedStorage*>(smem_raw);
  Tensor sQ = make_tensor(make_smem_ptr(ss.q), typename Cfg::SmemLayoutQ{});
  Tensor sdO = make_tensor(make_smem_ptr(ss.dout), typename Cfg::SmemLayoutQ{});
  Tensor sQt = make_tensor(make_smem_ptr(ss.q), typename Cfg::SmemLayoutQt{});
  Tensor sdOt = make_tensor(make_smem_ptr(ss.dout), typename Cfg::SmemLayoutQt{});
  const int group = p.heads / p.kv_heads;
  const int warp_group = threadIdx.x / 128;

  // Work item w: (entry, batch * kv head slot) of p.order; the CTA's own (one per CTA), or those
  // of snake_item's walk (Cfg::kPersistent). The CTA's item-th item uses K / V buffer
  // item % kKvBufs for the (item / kKvBufs)-th time: its barriers' phase parity.
  [[maybe_unused]] const int num_items = p.entries * p.batch * p.kv_heads;
  struct Item {
    int b, kvh, kt, offset;  // offset: the packed row of the sample's position 0 (kStartVarlen)
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
    t.mask = Cfg::kStart == kStartTile ? p.mask : geom.mask;
    t.plans = t.mask.bwd_tiles(BM, BN);
    t.k_tile = t.plans.tile(t.kt);
    t.runs = t.plans.runs(t.kt);
    return t;
  };
  // Non-persistent: the CTA's one item, decoded once before the warpgroups part (as both read it).
  [[maybe_unused]] const Item own = item_at(blockIdx.x);
  auto item_of = [&](int w) {
    if constexpr (Cfg::kPersistent) return item_at(w); else return own;
  };
  // f(w, item) for the CTA's items: its one (blockIdx.x), or (persistent) snake_item's walk. The
  // one-item form has no loop: an outer loop around the tile loop cost ~30 registers of spills.
  auto for_each_item = [&](auto&& f) {
    if constexpr (Cfg::kPersistent) {
      for (int item = 0, w = snake_item(0); w < num_items; w = snake_item(++item)) f(w, item);
    } else {
      f(static_cast<int>(blockIdx.x), 0);
    }
  };
  auto kv_tile = [&](Elem (&buffers)[Cfg::kKvBufs][cosize_v<typename Cfg::SmemLayoutKV>], int buf) {
    return make_tensor(make_smem_ptr(buffers[buf]), typename Cfg::SmemLayoutKV{});
  };

  if (threadIdx.x == 0) {
    for (int i = 0; i < Cfg::kKvBufs; ++i) {
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
        if constexpr (Cfg::kPersistent) Barrier::wait(&ss.kv_empty[buf], ((item / Cfg::kKvBufs) & 1) ^ 1);
        Tensor sK = kv_tile(ss.k, buf), sV = kv_tile(ss.v, buf);
        TxBarrier::arrive_and_expect_tx(&ss.kv_full[buf], 2 * Cfg::kTileBytesKV);
        load_tile_pair<Cfg::kStart, BN, D>(ss.kv_full[buf], offset, t.k_tile.lo, p.tma_k, mK(_, _, kvh, b), sK,
                                           p.tma_v, mV(_, _, kvh, b), sV);
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
    const Item t = item_of(w);
    const int b = t.b, kvh = t.kvh, kt = t.kt, offset = t.offset;
    const SequenceMask& mask = t.mask;
    const TilePlans& plans = t.plans;
    const TileRuns& runs = t.runs;
    const Interval& k_tile = t.k_tile;
    const int buf = item % Cfg::kKvBufs;
    const int key_base = k_tile.lo + key_slot * kRowsW;  // this warpgroup's first key
    Tensor sKc = local_tile(kv_tile(ss.k, buf), Shape<Int<kRowsW>, Int<D>>{}, make_coord(key_slot, 0));
    Tensor sVc = local_tile(kv_tile(ss.v, buf), Shape<Int<kRowsW>, Int<D>>{}, make_coord(key_slot, 0));
    // Cfg::kRoles: acc_dv is this warpgroup's one gradient (dK for consumer 1) and acc_dk is unused.
    Tensor acc_dk = partition_fragment_C(mma_kv, Shape<Int<kRowsW>, Int<D>>{});
    Tensor acc_dv = partition_fragment_C(mma_kv, Shape<Int<kRowsW>, Int<D>>{});
    if constexpr (!Cfg::kRoles) clear(acc_dk);
    clear(acc_dv);
    // Cfg::kOwnKind: this warpgroup's sub-runs (empty when it has no keys), to this thread's slot.
    [[maybe_unused]] const uint32_t own_slot = smem_addr(&ss.own) + 16u * (128u * consumer + tid);
    if constexpr (Cfg::kOwnKind) {
      const Interval own{key_base, imin(key_base + kRowsW, k_tile.hi)};
      const TileRuns mine = own.empty() ? TileRuns{} : plans.runs_of(own);
      asm volatile("st.shared.v4.s32 [%0], {%1, %2, %3, %4};" ::"r"(own_slot), "r"(mine.begin[0]),
                   "r"(mine.end[0]), "r"(mine.begin[1]), "r"(mine.end[1]) : "memory");
    }
    Barrier::wait(&ss.kv_full[buf], (item / Cfg::kKvBufs) & 1);
    for (int g = 0; g < group; ++g) {
      for (int r = 0; r < 2; ++r) {
        for (int qt = run_begin(runs, r); qt < run_end(runs, r); ++qt, ++it) {
          const int stage = it % STAGES, phase = (it / STAGES) & 1;
          const Visit visit = plans.visit(kt, qt);
          if constexpr (Cfg::kOwnKind) {
            int b0, e0, b1, e1;  // read per visit (volatile): nothing held over the loop
            asm volatile("ld.shared.v4.s32 {%0, %1, %2, %3}, [%4];"
                         : "=r"(b0), "=r"(e0), "=r"(b1), "=r"(e1) : "r"(own_slot) : "memory");
            if (r ? (qt < b1 || qt >= e1) : (qt < b0 || qt >= e0)) {
              // None of this warpgroup's keys is seen by the tile's queries: the stage is released
              // as a computed one is, after its loads landed, so that both warpgroups still wait
              // every phase of the ring's barriers.
              Barrier::wait(&ss.q_full[stage], phase);
              Barrier::wait(&ss.do_full[stage], phase);
              Barrier::arrive(&ss.empty[stage]);
              release_pending();
              continue;
            }
          }
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
          const bool masked = !visit.full || visit.end - visit.start < BM;
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
              for (int i = 0; i < kRows; ++i)
                seen_by[i] = mask.col_intervals(key_base + get<0>(tScS_rc(i, 0)));
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
            warpgroup_fence_operand(acc_dv);
            warpgroup_arrive();
            CUTE_UNROLL
            for (int kb = 0; kb < size<2>(tGa); ++kb) gemm(mma_kv, tGa(_, _, kb), tGrB(_, _, kb, stage), acc_dv);
            warpgroup_commit_batch();
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
    auto thr_epi = mma_kv.get_thread_slice(Cfg::kPersistent ? opaque(tid) : tid);
    Tensor tKcK = thr_epi.partition_C(make_identity_tensor(Shape<Int<kRowsW>, Int<D>>{}));
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
        stage_rows<Elem>(acc_dk, p.scale, sKc, thr_epi);
        stage_rows<Elem>(acc_dv, 1.f, sVc, thr_epi);
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
}

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
      stage_rows<Elem>(acc_dq, p.scale, sQc, thr_dq);
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
  const int32_t* dkdv_order;  // key tiles of bwd_tiles(kBwdBlockM, bwd_block_n(D)), most expensive first
  int dkdv_tiles;
  const int32_t* dq_order;    // query tiles of fwd_tiles(dq_block_m(D), dq_block_n(D)), most expensive first
  int dq_tiles;
  cudaStream_t stream;
  int order_chunk = 0, order_block = 0;  // work_order's arguments (0, 0: the plain order); the harness's A/B sets them
  // kStartVarlen configs only (batch 1, seqlen = packed tokens): the sample of each entry of
  // dkdv_order / dq_order, and the samples' offsets (csrc/NOTES.md "Odd lengths and varlen"). The
  // odd-length / varlen dK/dV kernel also reads up to kVarlenScratchPad zeroed floats past the
  // lse2 / delta scratch.
  const int32_t *dkdv_sample = nullptr, *dq_sample = nullptr, *cu_seqlens = nullptr;
  // launch_bwd: run the persistent dK/dV kernel (DkDvPersistent) where the head dim has one
  // (dkdv_persistent_supports); the caller decides by the halves' lengths (the Python backend:
  // PERSISTENT_DKDV_MAX_HALF).
  bool persistent_dkdv = false;
  // launch_bwd_fused only (D = 128): dQ computed by the dK/dV kernel and reduce-added into this
  // (B, S, H, D) contiguous fp32 scratch, then scaled into dq; dq_order / dq_tiles unused.
  float* dq_accum = nullptr;
};

// The tile shapes the shipped instantiations use (the binding builds the orders for them): at D <=
// 128, dK/dV over (64 queries) x (128 keys) tiles and dQ over (128 rows) x (128 keys); at D = 256
// both over 64 x 64 (DkDvConfig kRoles, DqConfig kSplitKeys say why).
constexpr int kBwdBlockM = 64, kBwdBlockN = 128, kBwdStages = 2;
constexpr int kDqBlockM = 128, kDqBlockN = 128, kDqStages = 2;
constexpr int bwd_block_n(int d) { return d == 256 ? 64 : kBwdBlockN; }
constexpr int dq_block_m(int d) { return d == 256 ? 64 : kDqBlockM; }
constexpr int dq_block_n(int d) { return d == 256 ? 64 : kDqBlockN; }

template <class Kernel>
cudaError_t set_smem(Kernel kernel, int smem) {
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
}

template <class Elem, int D>
cudaError_t launch_preprocess(const BwdArgs& a) {
  PreParams<Elem> p{static_cast<const Elem*>(a.o), static_cast<const Elem*>(a.dout), a.lse, a.dlse,
                    a.lse2, a.delta, {a.o_stride[0], a.o_stride[1], a.o_stride[2]},
                    {a.do_stride[0], a.do_stride[1], a.do_stride[2]},
                    {a.lse_stride[0], a.lse_stride[1]}, {a.dlse_stride[0], a.dlse_stride[1]},
                    a.batch, a.seqlen, a.heads};
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
  if constexpr (Cfg::kFusedDq) {
    p.tma_dq = make_tma_copy(
        SM90_TMA_REDUCE_ADD{},
        make_tensor(make_gmem_ptr(a.dq_accum), make_shape(a.seqlen, D, a.heads, a.batch),
                    make_stride(int64_t{a.heads} * D, _1{}, int64_t{D}, int64_t{a.seqlen} * a.heads * D)),
        typename Cfg::Fused::SmemLayoutdQ{});
  }
  auto kernel = diffusion_bwd_dkdv_kernel<Cfg>;
  constexpr int smem = sizeof(typename Cfg::SharedStorage);
  static const cudaError_t configured = set_smem(kernel, smem);  // once: the attribute is per function
  if (configured != cudaSuccess) return configured;
  int ctas = a.batch * a.kv_heads * a.dkdv_tiles;
  if constexpr (Cfg::kPersistent) {  // one CTA per SM (1 fits: 192 KB of shared memory at D = 128)
    int device = 0, sms = 0;
    cudaError_t err = cudaGetDevice(&device);
    if (err == cudaSuccess) err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
    if (err != cudaSuccess) return err;
    ctas = ctas < sms ? ctas : sms;
  }
  kernel<<<ctas, Cfg::kThreads, smem, a.stream>>>(p);
  return cudaGetLastError();
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
  if constexpr (Cfg::kTmaStore)
    p.tma_store_a = make_tma_store_rows(static_cast<Elem*>(a.dq), a.seqlen, D, a.heads, a.batch,
                                        a.dq_stride[1], a.dq_stride[2], a.dq_stride[0]);
  auto kernel = diffusion_bwd_dq_kernel<Cfg>;
  constexpr int smem = sizeof(typename Cfg::SharedStorage);
  static const cudaError_t configured = set_smem(kernel, smem);
  if (configured != cudaSuccess) return configured;
  kernel<<<a.batch * a.heads * a.dq_tiles, Cfg::kThreads, smem, a.stream>>>(p);
  return cudaGetLastError();
}

// The shipped configs with their tiles starting per START (the one place that names the options).
template <class Elem, int D, int START>
using DkDvShipped = DkDvConfig<Elem, D, kBwdBlockM, bwd_block_n(D), kBwdStages, START>;
template <class Elem, int D, int START>
using DqShipped = DqConfig<Elem, D, dq_block_m(D), dq_block_n(D), kDqStages, START>;
template <class Elem, int D, int START>
using DkDvFused = DkDvConfig<Elem, D, kBwdBlockM, kBwdBlockN, kBwdStages, START, true>;
// The persistent dK/dV kernel: two K / V buffers, TMA-store epilogue, snake walk. Harness
// `persistent` (session 9, bf16 D = 128, 16K tokens) against DkDvShipped: the dK/dV kernel 1.12x /
// 1.20x at n = 1K (block 16 / 4), the whole backward 1.07x / 1.10x; at 2K 0.98x (whole 1.03x), at
// 4K 0.92x (0.91x), at 8K 1.00x (0.93x), GQA 32/8 at 2K 0.90x. D = 64 (session 10, `persistent64`):
// the whole backward 1.055x / 1.058x at n = 1K, 1.01x at 2K, 0.97x at 4K, 0.91x at 8K, 0.94x GQA.
template <class Elem, int D, int START>
using DkDvPersistent = DkDvConfig<Elem, D, kBwdBlockM, kBwdBlockN, kBwdStages, START, false, true, true>;
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

// The whole backward: preprocess, dK/dV, dQ (one stream, so each sees the previous one's writes).
// START: kBatchedStart (batched calls) or kStartVarlen (packed samples: batch 1, dkdv_sample,
// dq_sample and cu_seqlens set). Unless START is kStartTile, lse2 / delta need kVarlenScratchPad
// zeroed floats past their B * H * S.
template <class Elem, int D, int START = kBatchedStart>
cudaError_t launch_bwd(const BwdArgs& a) {
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
