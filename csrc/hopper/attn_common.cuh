// The pieces of the sm90 attention forwards that do not depend on the mask (the block-diffusion
// forward, hopper/diffusion_fwd.cuh, and the block-sparse one, hopper/block_sparse_fwd.cuh): the
// tile config (128-row query tile, two consumer warpgroups of 64 rows, a K / V ring), the TMA
// descriptors, the quad reductions, the ping-pong named barriers, one tile of the online softmax
// with its mask given per row as a column interval, the epilogue (O and lse from registers), the
// barrier set-up and the consumer loop (fwd_consumers; the block-sparse forward's).
// Moved here from diffusion_fwd.cuh unchanged: the shipped forward's SASS is byte-identical
// (csrc/NOTES.md "Block-sparse forward (issue #5)").
#pragma once

#include <cute/tensor.hpp>
#include <cute/atom/copy_traits_sm90_tma.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/numeric_types.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "hopper/common.cuh"

namespace dlm::sm90 {

using namespace cute;

// Shared memory for the O tiles of the TMA-store epilogue (none when N = 0).
template <class Elem, int N>
struct OStaging {
  alignas(1024) Elem o[N];
};
template <class Elem>
struct OStaging<Elem, 0> {};

// START_: where tiles may start (kStartTile / kStartAny / kStartVarlen, hopper/common.cuh).
// QSTAGES_: Q buffers. With two, a CTA that runs several work items (a persistent grid) loads the
// next item's Q, and then its first K / V, while the consumers still work on this one; with one,
// the producer waits until the consumers' last S of an item before it loads anything of the next.
// SMEM_O_: the epilogue writes O to shared memory and stores it with TMA (store_o_lse_tma), so the
// consumers start their next work item while the copy drains; otherwise each thread stores its O
// values to global memory itself (store_o_lse).
// SOFTMAX_ILP_: online_softmax_tile_ilp, the tile's softmax with its row max and row sum in four
// independent chains and the scale folded into the exponent's FFMA. STALE_MAX_ (with it): a warp
// keeps its rows' maxima while none grows by more than kStaleMaxBound, and then skips the O rescale.
// NARROW_DIAG_ (the diffusion forward only; BM = BN = 128): where block_size divides 64, each consumer
// visits a noisy tile's diagonal noisy tile at the 64 keys its 64 rows can see (diffusion_fwd.cuh).
template <class Elem_, int D_, int BM_ = 128, int BN_ = 128, int STAGES_ = 2, bool PINGPONG_ = true,
          int START_ = kStartTile, int QSTAGES_ = 1, bool SMEM_O_ = false, bool SOFTMAX_ILP_ = false,
          bool STALE_MAX_ = false, bool NARROW_DIAG_ = false>
struct FwdConfig {
  using Elem = Elem_;
  static constexpr int D = D_, BM = BM_, BN = BN_, STAGES = STAGES_, QSTAGES = QSTAGES_;
  static constexpr bool kSmemO = SMEM_O_;
  static constexpr bool kSoftmaxIlp = SOFTMAX_ILP_ || STALE_MAX_;
  static constexpr bool kStaleMax = STALE_MAX_;
  static constexpr bool kPingPong = PINGPONG_;  // the consumers take turns at the tensor cores
  static constexpr bool kFreeFirstTurn = false;  // FreeFirstTurn<FwdConfig<...>> sets it (below)
  static constexpr int kStart = START_;
  static constexpr int kConsumerRows = 64;  // one wgmma M per consumer warpgroup
  static constexpr int kConsumers = BM / kConsumerRows;
  static constexpr int kThreads = 128 * (1 + kConsumers);
  // Three consumers (BM = 192, the diffusion forward only: FlashAttention-3's tile at D = 64) take
  // the register file as 32 + 3 x 160 per thread, two as 24 + 2 x 240 (setmaxnreg).
  static_assert(kConsumers == 2 || kConsumers == 3, "two or three consumer warpgroups");
  static constexpr int kProducerRegs = kConsumers == 2 ? 24 : 32, kConsumerRegs = kConsumers == 2 ? 240 : 160;
  static constexpr bool kNarrowDiag = NARROW_DIAG_;
  static_assert(!kNarrowDiag || (BM == 128 && BN == 128), "a narrow visit is one consumer's half of a 128-key tile");

  // 128-byte swizzled, K-major (head dim contiguous), the layout TMA writes and wgmma reads.
  using SmemLayoutQ = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Elem>{},
                                             Shape<Int<BM>, Int<D>, Int<QSTAGES>>{}));
  using SmemLayoutKV = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Elem>{},
                                              Shape<Int<BN>, Int<D>, Int<STAGES>>{}));
  // V^T as the B operand of O = P V: (D, BN, STAGES) over the same bytes, D contiguous (MN-major).
  using SmemLayoutVt = decltype(composition(
      SmemLayoutKV{}, make_ordered_layout(Shape<Int<D>, Int<BN>, Int<STAGES>>{}, Step<_2, _1, _3>{})));

  using MmaS = decltype(make_tiled_mma(
      SM90::GMMA::ss_op_selector<Elem, Elem, float, Shape<Int<kConsumerRows>, Int<BN>, Int<D>>>()));
  using MmaO = decltype(make_tiled_mma(
      SM90::GMMA::rs_op_selector<Elem, Elem, float, Shape<Int<kConsumerRows>, Int<D>, Int<BN>>,
                                 GMMA::Major::K, GMMA::Major::MN>()));
  // The narrow visit's S = Q K^T over kConsumerRows keys and its O += P V over them.
  using MmaSNarrow = decltype(make_tiled_mma(
      SM90::GMMA::ss_op_selector<Elem, Elem, float, Shape<Int<kConsumerRows>, Int<kConsumerRows>, Int<D>>>()));
  using MmaONarrow = decltype(make_tiled_mma(
      SM90::GMMA::rs_op_selector<Elem, Elem, float, Shape<Int<kConsumerRows>, Int<D>, Int<kConsumerRows>>,
                                 GMMA::Major::K, GMMA::Major::MN>()));

  // Each consumer's kConsumerRows x D tile of O, staged for the TMA store (kSmemO).
  using SmemLayoutO = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Elem>{},
                                             Shape<Int<kConsumerRows>, Int<D>>{}));

  struct SharedStorage : OStaging<Elem, kSmemO ? kConsumers * cosize_v<SmemLayoutO> : 0> {
    alignas(1024) Elem q[cosize_v<SmemLayoutQ>];
    alignas(1024) Elem k[cosize_v<SmemLayoutKV>];
    alignas(1024) Elem v[cosize_v<SmemLayoutKV>];
    // q_empty: the consumers' last S of a work item is done (per Q buffer)
    alignas(8) uint64_t q_full[QSTAGES], q_empty[QSTAGES];
    uint64_t k_full[STAGES], k_empty[STAGES], v_full[STAGES], v_empty[STAGES];
  };
  static constexpr int kTileBytesQ = BM * D * sizeof(Elem);
  static constexpr int kTileBytesKV = BN * D * sizeof(Elem);
};

template <class Cfg>
auto make_tma_q(typename Cfg::Elem const* p, int s, int h, int b, int64_t ss, int64_t sh, int64_t sb) {
  return make_tma_copy(SM90_TMA_LOAD{}, bshd_tensor(p, s, Cfg::D, h, b, ss, sh, sb),
                       take<0, 2>(typename Cfg::SmemLayoutQ{}));
}

template <class Cfg>
auto make_tma_o(typename Cfg::Elem* p, int s, int h, int b, int64_t ss, int64_t sh, int64_t sb) {
  return make_tma_copy(SM90_TMA_STORE{},
                       make_tensor(make_gmem_ptr(p), make_shape(s, Cfg::D, h, b), make_stride(ss, _1{}, sh, sb)),
                       typename Cfg::SmemLayoutO{});
}

// The Q buffer of a CTA's item-th work item and the phase of its two barriers.
template <class Cfg>
struct QSlot {
  int buf, phase;
  CUTE_HOST_DEVICE explicit QSlot(int item) : buf(item % Cfg::QSTAGES), phase((item / Cfg::QSTAGES) & 1) {}
};

struct NothingToPublish {
  CUTE_DEVICE void operator()(int) const {}
};

// The producer's Q load of a CTA's item-th work item (gQ: the item's BM x D box of Q), once the
// consumers are done with the buffer's previous item; publish(buffer) runs between that wait and
// the load (the diffusion forward hands its consumers the decoded item there).
template <class Cfg, class Tma, class TmaSlice, class GQ, class SQ, class Publish = NothingToPublish>
CUTE_DEVICE void produce_q(Tma const& tma, TmaSlice const& slice, GQ const& gQ, SQ const& sQ,
                           typename Cfg::SharedStorage& ss, int item, Publish&& publish = {}) {
  const QSlot<Cfg> q(item);
  cutlass::arch::ClusterBarrier::wait(&ss.q_empty[q.buf], q.phase ^ 1);
  publish(q.buf);
  cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(&ss.q_full[q.buf], Cfg::kTileBytesQ);
  copy(tma.with(ss.q_full[q.buf]), slice.partition_S(gQ), slice.partition_D(sQ)(_, _, _, q.buf));
}

template <class Cfg>
auto make_tma_kv(typename Cfg::Elem const* p, int s, int h, int b, int64_t ss, int64_t sh, int64_t sb) {
  return make_tma_copy(SM90_TMA_LOAD{}, bshd_tensor(p, s, Cfg::D, h, b, ss, sh, sb),
                       take<0, 2>(typename Cfg::SmemLayoutKV{}));
}

// Max / sum over the 4 threads of a quad, which together hold a row.
CUTE_DEVICE float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffff, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffff, x, 2));
}
CUTE_DEVICE float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffff, x, 1);
  return x + __shfl_xor_sync(0xffffffff, x, 2);
}

// Named barriers for the consumers' turns (0 is __syncthreads): each phase needs both consumer
// warpgroups, one syncing (waiting for its turn) and the other arriving (handing it over).
// Ping-pong: the consumers take turns to issue their matmuls, so that one's softmax runs while the
// tensor cores work for the other. Consumer 1 pre-arrives on barrier kTurnBarrier + 0 once, before
// its first item, so that consumer 0 goes first; after that every S of one consumer hands the
// turn to the other, across items (both consumers visit the same tiles of every item, so the turns
// pair up), and consumer 1's last hand-over stays open at exit. Not per item (consumer 1
// pre-arriving at each item's start, consumer 0 closing the open phase at its end, as until
// session 11): a consumer 1 that reaches its next pre-arrival before consumer 0's closing sync
// arrives twice on one phase, which completes it without consumer 0, and both then wait on each
// other. The forward loops won that race by the length of consumer 1's epilogue; session 10's
// carried loop, which moved that epilogue into the next item, deadlocked on its first run.
constexpr int kTurnBarrier = 1;
CUTE_DEVICE void named_barrier_sync(int id) { asm volatile("bar.sync %0, 256;" ::"r"(id)); }
CUTE_DEVICE void named_barrier_arrive(int id) { asm volatile("bar.arrive %0, 256;" ::"r"(id)); }
// The barrier that hands consumer c's turn to the next one (in a ring of Cfg::kConsumers; with
// three, consumer 2 pre-arrives on consumer 0's as consumer 1 does with two).
template <class Cfg>
CUTE_DEVICE int next_turn(int consumer) {
  if constexpr (Cfg::kConsumers == 2) return kTurnBarrier + 1 - consumer;
  else return kTurnBarrier + (consumer + 1 == Cfg::kConsumers ? 0 : consumer + 1);
}

// A key tail: the columns from `hi` on (relative to this thread's first one) are masked in every
// row, the mask of a tile whose keys end inside it (the sparse forward's short last key block).
// Passed as the softmax's bounds instead of a per-row interval: the rows share the mask, so
// mask_key_tail decides each column once (one ISETP) and selects both rows' scores by it. With a
// per-row interval that returns the same bounds for both rows ptxas kept the 32 column predicates
// for the second row in a register's bits (two LOP3 per column in one dependent chain, read back
// per score): the masked tile's max took 307 instructions against 90 unmasked (session 39, SASS
// of the column form's kernel; the column form runs one such tile per item).
struct KeyTail {
  int hi;
};
template <class B>
inline constexpr bool is_key_tail = std::is_same_v<std::decay_t<B>, KeyTail>;
template <class S, class Coords>
CUTE_DEVICE void mask_key_tail(S& s, Coords const& tScS_rc, int hi) {
  CUTE_UNROLL
  for (int j = 0; j < size<1>(s); ++j) {
    const bool out = get<1>(tScS_rc(0, j)) - get<1>(tScS_rc(0, 0)) >= hi;  // a constant - hi
    CUTE_UNROLL
    for (int i = 0; i < size<0>(s); ++i)
      if (out) s(i, j) = -INFINITY;
  }
}

// One tile of the online softmax, in base 2, on the scores this thread holds (two rows): scales
// by scale_log2, masks (kMasked) as selects, updates the running max and the quad-partial row
// sums, leaves exp2(s - max) in s and the factor that rescales the accumulator in scale_row.
// kMasked: `bounds(i, lo, hi)` gives row i's visible keys as the interval [lo, hi) of this
// thread's columns, relative to its first one (a compare with a constant per bound and score), or
// bounds is a KeyTail (the same tail in every row: mask_key_tail).
// The mask is decided per tile, as a template argument: v4 tested a runtime `masked` flag inside
// the element loop, and ptxas kept a BSSY / ISETP / BRA / BSYNC group around every score's mask
// (64 per tile and thread), FULL tiles included; taking it out of the loop measured 1.46-1.72x
// faster (csrc/NOTES.md, v5).
template <bool kMasked, class Scores, class Coords, class Bounds, int kRows>
CUTE_DEVICE void online_softmax_tile(Scores& acc_s, Coords const& tScS_rc, Bounds const& bounds,
                                     float scale_log2, float (&row_max)[kRows],
                                     float (&row_sum)[kRows], float (&scale_row)[kRows]) {
  Tensor s = make_tensor(acc_s.data(), acc_rowcol(acc_s.layout()));  // (rows, cols)
  constexpr bool kTail = kMasked && is_key_tail<Bounds>, kRowMask = kMasked && !kTail;
  if constexpr (kTail) mask_key_tail(s, tScS_rc, bounds.hi);  // -inf * scale_log2 stays -inf
  CUTE_UNROLL
  for (int i = 0; i < kRows; ++i) {
    float mx = row_max[i];
    [[maybe_unused]] int lo = 0, hi = 0;
    if constexpr (kRowMask) bounds(i, lo, hi);
    CUTE_UNROLL
    for (int j = 0; j < size<1>(s); ++j) {
      float x = s(i, j) * scale_log2;
      if constexpr (kRowMask) {
        const int k = get<1>(tScS_rc(i, j)) - get<1>(tScS_rc(i, 0));
        x = k < lo || k >= hi ? -INFINITY : x;
      }
      s(i, j) = x;
      mx = fmaxf(mx, x);
    }
    mx = quad_max(mx);
    const float m_use = mx == -INFINITY ? 0.f : mx;  // a row with nothing visible yet
    scale_row[i] = exp2_approx(row_max[i] - m_use);
    row_max[i] = mx;
    float sum = 0.f;
    CUTE_UNROLL
    for (int j = 0; j < size<1>(s); ++j) {
      s(i, j) = exp2_approx(s(i, j) - m_use);
      sum += s(i, j);
    }
    row_sum[i] = row_sum[i] * scale_row[i] + sum;
  }
}

// online_softmax_tile with more instruction-level parallelism, for the consumers' critical path
// (S ready -> P ready). The row max and the row sum each run as four independent chains (a thread's
// 32 scores of a row were one chain of 32 dependent FMNMX, then 32 dependent FADD: ptxas keeps the
// order of float operations), and the max is taken over the raw scores, so that the scale folds
// into the exponent's FFMA (exp2(s * scale - m * scale)) instead of an FMUL per score. The scale is
// positive, so max(s) * scale equals max(s * scale) (rounding is monotonic); the sums associate
// differently (fp32, 32 terms). Session 15: ncu had our consumers stalled on fixed-latency
// dependencies 1.57 cycles per issued instruction where cuDNN's forward doing the same work had 0.90.
//
// kStale (FlashAttention-4's conditional rescaling): the max a row's exponentials are taken against
// need not be the row's running max, only bound it from below by little; the result is the same
// (out = acc / l and lse = m + log2 l hold for any m; the epilogue uses the m kept here). So while
// no row of the warp sees its max grow by more than kStaleMaxBound (log2 units) the warp keeps the
// old maxima: scale_row is 1, the caller skips the O rescale (64 FMUL per tile and thread at
// D = 128), and P stays below 2^kStaleMaxBound = 256 (bf16 / fp16 P, fp32 sums: no overflow). The
// decision is warp-uniform (one vote), so the skip is a uniform branch. A row's first visible tile
// always sets its max (old - new is -inf or NaN there: the comparison fails).
// Returns whether the caller must rescale O (always without kStale).
constexpr float kStaleMaxBound = 8.f;
// Where the shipped forwards keep a stale max (FwdShipped, SparseFwdConfig): from D = 128 on, where
// the skipped O rescale is 64 (D = 128) or 128 (D = 256) FMUL per tile and thread. At D = 64 it
// saves 32 and the vote costs more: diffusion forward harness softmax-ab (session 16, bf16, n 1K-8K)
// four chains alone 0.998-1.067x the one-chain softmax, with the stale max 0.969-1.002x; D = 128
// 1.003-1.089x (four chains alone 1.008-1.036x), D = 256 1.030-1.095x from n = 2K on (1K: noise,
// the A/A column read 0.975 there); the sparse forward at D = 64 (its harness, S 16K-64K): four
// chains 1.011-1.057x, with the stale max 0.962-1.005x.
constexpr bool fwd_stale_max(int d) { return d >= 128; }
template <bool kMasked, bool kStale = false, class Scores, class Coords, class Bounds, int kRows>
CUTE_DEVICE bool online_softmax_tile_ilp(Scores& acc_s, Coords const& tScS_rc, Bounds const& bounds,
                                         float scale_log2, float (&row_max)[kRows],
                                         float (&row_sum)[kRows], float (&scale_row)[kRows]) {
  constexpr int kChains = 4;
  Tensor s = make_tensor(acc_s.data(), acc_rowcol(acc_s.layout()));  // (rows, cols)
  static_assert(size<1>(decltype(s){}) % kChains == 0, "columns per thread: a multiple of the chains");
  float new_max[kRows];
  bool keep = kStale;
  constexpr bool kTail = kMasked && is_key_tail<Bounds>, kRowMask = kMasked && !kTail;
  if constexpr (kTail) mask_key_tail(s, tScS_rc, bounds.hi);
  CUTE_UNROLL
  for (int i = 0; i < kRows; ++i) {
    [[maybe_unused]] int lo = 0, hi = 0;
    if constexpr (kRowMask) bounds(i, lo, hi);
    float part[kChains];
    CUTE_UNROLL
    for (int c = 0; c < kChains; ++c) part[c] = -INFINITY;
    CUTE_UNROLL
    for (int j = 0; j < size<1>(s); ++j) {
      if constexpr (kRowMask) {
        const int k = get<1>(tScS_rc(i, j)) - get<1>(tScS_rc(i, 0));
        if (k < lo || k >= hi) s(i, j) = -INFINITY;
      }
      part[j % kChains] = fmaxf(part[j % kChains], s(i, j));
    }
    const float raw_max = quad_max(fmaxf(fmaxf(part[0], part[1]), fmaxf(part[2], part[3])));
    new_max[i] = fmaxf(row_max[i], raw_max * scale_log2);
    if constexpr (kStale) keep = keep && new_max[i] - row_max[i] <= kStaleMaxBound;
  }
  if constexpr (kStale) keep = __all_sync(0xffffffffu, keep);
  CUTE_UNROLL
  for (int i = 0; i < kRows; ++i) {
    float m_use;
    if (keep) {
      m_use = row_max[i];
      scale_row[i] = 1.f;
    } else {
      const float mx = new_max[i];
      m_use = mx == -INFINITY ? 0.f : mx;  // a row with nothing visible yet
      scale_row[i] = exp2_approx(row_max[i] - m_use);
      row_max[i] = mx;
    }
    float part[kChains];
    CUTE_UNROLL
    for (int c = 0; c < kChains; ++c) part[c] = 0.f;
    CUTE_UNROLL
    for (int j = 0; j < size<1>(s); ++j) {
      s(i, j) = exp2_approx(fmaf(s(i, j), scale_log2, -m_use));
      part[j % kChains] += s(i, j);
    }
    row_sum[i] = row_sum[i] * scale_row[i] + ((part[0] + part[1]) + (part[2] + part[3]));
  }
  return !keep;
}

// Epilogue: O = acc / l straight from registers, lse = (m + log2 l) * ln 2 (natural log; -inf and
// O = 0 for a row that saw nothing). Row r of (batch b, head h) is stored at p.o + b * o_stride_b +
// h * o_stride_h + (row_offset + r) * o_stride_s and p.lse[b * lse_stride_b + h * lse_stride_h +
// row_offset + r]; rows from row_end on are not stored. Params: any kernel parameters with those
// fields (read from the parameter space here, where the diffusion forward read them before this
// was shared: moved, its SASS is byte-identical).
template <class Params, class AccO, class Coords, int kRows>
CUTE_DEVICE void store_o_lse(Params const& p, AccO& acc_o, Coords const& tOcO_rc,
                             float (&row_sum)[kRows], float (&row_max)[kRows], int b, int h,
                             int row_base, int row_end, int row_offset, int tid) {
  using Elem = std::remove_pointer_t<decltype(p.o)>;
  Tensor o_rc = make_tensor(acc_o.data(), acc_rowcol(acc_o.layout()));
  Elem* o_head = p.o + b * p.o_stride_b + h * p.o_stride_h;
  CUTE_UNROLL
  for (int i = 0; i < kRows; ++i) {
    const float l = quad_sum(row_sum[i]);
    const float inv = l > 0.f ? rcp_approx(l) : 0.f;
    const int row = row_base + get<0>(tOcO_rc(i, 0));
    if (row < row_end) {
      // Columns 2c and 2c + 1 are neighbours in this thread's registers: one 4-byte store each
      // (the row stride is a multiple of D and the base 16-byte aligned, checked at launch).
      CUTE_UNROLL
      for (int c = 0; c < size<1>(o_rc); c += 2) {
        const Elem pair[2] = {Elem(o_rc(i, c) * inv), Elem(o_rc(i, c + 1) * inv)};
        *reinterpret_cast<uint32_t*>(o_head + (row_offset + row) * p.o_stride_s + get<1>(tOcO_rc(i, c))) =
            *reinterpret_cast<const uint32_t*>(pair);
      }
      if (tid % 4 == 0)
        p.lse[b * p.lse_stride_b + h * p.lse_stride_h + row_offset + row] =
            l > 0.f ? (row_max[i] + __log2f(l)) * 0.6931471805599453f : -INFINITY;
    }
  }
}

// The TMA-store epilogue (Cfg::kSmemO), for a consumer warpgroup whose kConsumerRows rows all
// lie before the tile's end (a box would otherwise write rows of the next half or sample:
// callers take store_o_lse there): O = acc / l into the warpgroup's staging buffer, then one
// thread stores the tile with TMA and the warpgroup moves on while the copy drains; lse as
// store_o_lse writes it. o_rows: the rows of p.tma_o's (rows, D, heads, batch) tensor. Why: the
// knockout `no O / lse store` (harness `probe`, session 8) made the forward 1.23x faster at
// n = 1K, 1.04x at 8K; the per-thread 4-byte stores of the register path (8 rows x 16 bytes per
// warp instruction) held the tensor cores idle at every item's end. This path measured +11 % at
// 1K, +2.5 % at 8K (csrc/NOTES.md, forward v6). Named barriers kOStoreBarrier + consumer (128
// threads).
constexpr int kOStoreBarrier = kTurnBarrier + 2;
template <class Cfg>  // past the turn barriers of Cfg's consumers (kOStoreBarrier with two)
constexpr int o_store_barrier = kTurnBarrier + Cfg::kConsumers;
template <class Cfg, class Params, class AccO, class Coords, int kRows>
CUTE_DEVICE void store_o_lse_tma(Params const& p, typename Cfg::SharedStorage& ss, AccO& acc_o,
                                 Coords const& tOcO_rc, float (&row_sum)[kRows],
                                 float (&row_max)[kRows], int b, int h, int row_base,
                                 int row_offset, int o_rows, int consumer, int tid) {
  using Elem = typename Cfg::Elem;
  using SmemLayoutO = typename Cfg::SmemLayoutO;
  constexpr int D = Cfg::D, kConsumerRows = Cfg::kConsumerRows;
  static_assert(is_sw128_k_tile<SmemLayoutO, Elem, kConsumerRows, D>(),
                "Sw128Stage's addresses assume SmemLayoutO's layout");
  Elem* const staging = ss.o + consumer * cosize_v<SmemLayoutO>;  // 1024-byte aligned (OStaging)
  Tensor sO = make_tensor(make_smem_ptr(staging), SmemLayoutO{});
  Tensor o_rc = make_tensor(acc_o.data(), acc_rowcol(acc_o.layout()));
  const Sw128Stage<kConsumerRows> stage(smem_addr(staging), tid);
  // The buffer is free once this warpgroup's previous store has read it (long done, as a rule).
  if (tid == 0) tma_store_wait<0>();
  bar_sync(o_store_barrier<Cfg> + consumer, 128);
  CUTE_UNROLL
  for (int i = 0; i < kRows; ++i) {
    const float l = quad_sum(row_sum[i]);
    const float inv = l > 0.f ? rcp_approx(l) : 0.f;
    CUTE_UNROLL
    for (int c = 0; c < size<1>(o_rc); c += 2) {
      const Elem pair[2] = {Elem(o_rc(i, c) * inv), Elem(o_rc(i, c + 1) * inv)};
      st_shared_b32(stage.pair(i, c / 2), *reinterpret_cast<const uint32_t*>(pair));
    }
    if (tid % 4 == 0)
      p.lse[b * p.lse_stride_b + h * p.lse_stride_h + row_offset + row_base + get<0>(tOcO_rc(i, 0))] =
          l > 0.f ? (row_max[i] + __log2f(l)) * 0.6931471805599453f : -INFINITY;
  }
  tma_store_fence();  // the generic-proxy writes above, visible to the TMA (async proxy)
  bar_sync(o_store_barrier<Cfg> + consumer, 128);
  if (tid == 0) {
    Tensor mO = p.tma_o.get_tma_tensor(make_shape(o_rows, D, p.heads, p.batch));
    Tensor gO = local_tile(domain_offset(make_coord(row_offset + row_base, 0), mO(_, _, h, b)),
                           Shape<Int<Cfg::kConsumerRows>, Int<D>>{}, make_coord(0, 0));
    auto slice = p.tma_o.get_slice(0);
    copy(p.tma_o, slice.partition_S(sO), slice.partition_D(gO));
    tma_store_arrive();
  }
}

// The forwards' epilogue of one work item: store_o_lse_tma where Cfg::kSmemO and all of the
// warpgroup's rows lie before row_end, store_o_lse otherwise (a kProbeNoStore knockout stores
// nothing; the test on row_sum keeps its sums alive). store_o_drain after the last item: the
// last TMA store must have read the staging buffer before the CTA exits.
template <class Cfg, class Params, class AccO, class Coords, int kRows>
CUTE_DEVICE void store_item(Params const& p, typename Cfg::SharedStorage& ss, AccO& acc_o,
                            Coords const& tOcO_rc, float (&row_sum)[kRows], float (&row_max)[kRows],
                            int b, int h, int row_base, int row_end, int row_offset, int o_rows,
                            int consumer, int tid) {
  if constexpr (Cfg::kSmemO) {
    if (row_base + Cfg::kConsumerRows <= row_end) {
      if (probe_stores<Cfg>(acc_o) || row_sum[0] == 1234.5f)
        store_o_lse_tma<Cfg>(p, ss, acc_o, tOcO_rc, row_sum, row_max, b, h, row_base, row_offset,
                             o_rows, consumer, tid);
      return;
    }
  }
  if (probe_stores<Cfg>(acc_o) || row_sum[0] == 1234.5f)
    store_o_lse(p, acc_o, tOcO_rc, row_sum, row_max, b, h, row_base, row_end, row_offset, tid);
}
template <class Cfg>
CUTE_DEVICE void store_o_drain(int tid) {
  if constexpr (Cfg::kSmemO) {
    if (tid == 0) tma_store_wait<0>();
  }
}

// A part of a split work item (the block-sparse forward's split tail, block_sparse_fwd.cuh
// tail_part): walk index w, the item's first CTA, its number of parts, this CTA's part and the
// part's entries [lo, hi) of the item's key list.
struct TailPart {
  int w, first, parts, index, lo, hi;
};

// finish_part's synchronisation: a count with release and acquire semantics at GPU scope, and a
// warpgroup barrier that ORs a predicate.
CUTE_DEVICE int atomic_add_acq_rel_gpu(int32_t* p, int v) {
  int old;
  asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v) : "memory");
  return old;
}
// bar.sync over `threads` threads that also ORs `pred` over them (every thread gets the result).
CUTE_DEVICE bool bar_sync_or(int id, int threads, bool pred) {
  uint32_t out;
  asm volatile(
      "{\n .reg .pred p, q;\n setp.ne.u32 p, %1, 0;\n"
      " bar.red.or.pred q, %2, %3, p;\n selp.u32 %0, 1, 0, q;\n}"
      : "=r"(out) : "r"(uint32_t(pred)), "r"(id), "r"(threads) : "memory");
  return out != 0;
}

// The end of a part of a split item (tp; one consumer warpgroup's rows). A part alone (parts 1) is
// the whole item: the usual epilogue. Otherwise every part writes its unnormalised O, row maxima and
// row sums (fp32, the registers as they lie in (row, column) order: float4 stores, 128 threads side
// by side, so each store instruction writes 2 KB contiguously) to its CTA's slot of `partials`, and
// counts itself in the item's counter (release); the part that counts last (acquire) reads every
// part's slot from L2 in part order, merges them in its registers (the max of the row maxima, each
// part rescaled by 2^(m_part - max)) and runs the item's epilogue. Nothing waits for another CTA,
// and the result is the same whichever part comes last (run to run reproducible).
// counters: zero at the launch (the binding's per-call buffer), 2 per item (its consumers'),
// indexed by the item's first CTA.
template <class Cfg, class Params, class AccO, class Coords, int kRows>
CUTE_DEVICE void finish_part(Params const& p, typename Cfg::SharedStorage& ss, AccO& acc_o,
                             Coords const& tOcO_rc, float (&row_sum)[kRows],
                             float (&row_max)[kRows], TailPart const& tp, float* partials,
                             int32_t* counters, int b, int h, int row_base, int row_end,
                             int row_offset, int o_rows, int consumer, int tid) {
  if (tp.parts > 1) {
    static_assert(kRows == 2, "a slot holds two rows' max and sum per thread");
    Tensor o_rc = make_tensor(acc_o.data(), acc_rowcol(acc_o.layout()));
    constexpr int kCols = decltype(size<1>(o_rc))::value, kVecs = kRows * kCols / 4;
    static_assert(kCols % 4 == 0);
    constexpr int64_t kSlot = 128 * (kVecs + 1) * 4;  // floats per part and consumer
    auto slot = [&](int cta) {
      return reinterpret_cast<float4*>(partials + (int64_t(cta) * Cfg::kConsumers + consumer) * kSlot);
    };
    float4* mine = slot(tp.first + tp.index);
    CUTE_UNROLL
    for (int i = 0; i < kRows; ++i)
      CUTE_UNROLL
      for (int c = 0; c < kCols; c += 4)
        mine[((i * kCols + c) / 4) * 128 + tid] =
            make_float4(o_rc(i, c), o_rc(i, c + 1), o_rc(i, c + 2), o_rc(i, c + 3));
    mine[kVecs * 128 + tid] = make_float4(row_max[0], row_max[1], row_sum[0], row_sum[1]);
    bar_sync(kOStoreBarrier + consumer, 128);  // the warpgroup's writes, then its count
    bool last = false;
    if (tid == 0)
      last = atomic_add_acq_rel_gpu(counters + tp.first * Cfg::kConsumers + consumer, 1) == tp.parts - 1;
    if (!bar_sync_or(kOStoreBarrier + consumer, 128, last)) return;
    // Every part's partial in part order, this one's too (read back): the sum's order, and so the
    // result, does not depend on which part finished last. The first merge copies part 0 exactly.
    for (int i = 0; i < kRows; ++i) {
      row_max[i] = -INFINITY;
      row_sum[i] = 0.f;
    }
    clear(acc_o);
    for (int part = 0; part < tp.parts; ++part) {
      const float4* other = slot(tp.first + part);
      const float4 ml = __ldcg(other + kVecs * 128 + tid);
      const float m_other[kRows] = {ml.x, ml.y}, l_other[kRows] = {ml.z, ml.w};
      float keep[kRows], add[kRows];
      CUTE_UNROLL
      for (int i = 0; i < kRows; ++i) {
        const float m = fmaxf(row_max[i], m_other[i]);
        // -inf on both sides (no key seen): both weights 0, the epilogue's l = 0.
        keep[i] = row_max[i] == -INFINITY ? 0.f : exp2f(row_max[i] - m);
        add[i] = m_other[i] == -INFINITY ? 0.f : exp2f(m_other[i] - m);
        row_sum[i] = row_sum[i] * keep[i] + l_other[i] * add[i];
        row_max[i] = m;
      }
      CUTE_UNROLL
      for (int i = 0; i < kRows; ++i)
        CUTE_UNROLL
        for (int c = 0; c < kCols; c += 4) {
          const float4 x = __ldcg(other + ((i * kCols + c) / 4) * 128 + tid);
          o_rc(i, c) = o_rc(i, c) * keep[i] + x.x * add[i];
          o_rc(i, c + 1) = o_rc(i, c + 1) * keep[i] + x.y * add[i];
          o_rc(i, c + 2) = o_rc(i, c + 2) * keep[i] + x.z * add[i];
          o_rc(i, c + 3) = o_rc(i, c + 3) * keep[i] + x.w * add[i];
        }
    }
  }
  store_item<Cfg>(p, ss, acc_o, tOcO_rc, row_sum, row_max, b, h, row_base, row_end, row_offset,
                  o_rows, consumer, tid);
}

// Barrier set-up of the forwards: Q full / empty and the K / V ring, then the CTA's sync.
template <class Cfg>
CUTE_DEVICE void init_fwd_barriers(typename Cfg::SharedStorage& ss) {
  if (threadIdx.x == 0) {
    for (int i = 0; i < Cfg::QSTAGES; ++i) {
      cutlass::arch::ClusterBarrier::init(&ss.q_full[i], 1);
      cutlass::arch::ClusterBarrier::init(&ss.q_empty[i], 128 * Cfg::kConsumers);
    }
    init_kv_ring<Cfg::STAGES>(ss.k_full, ss.k_empty, ss.v_full, ss.v_empty, 128 * Cfg::kConsumers);
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();
}

// kFreeFirstTurn (FreeFirstTurn<Base> over a FwdConfig, whose own is false): an item's first S,
// which has no P V beside it, takes no turn: each consumer issues it as soon as its Q and K are
// there, and the turns run on from the item's second S (kTurnBarrier: the
// pairs stay matched, since both consumers skip the same visit). With strict turns consumer 0's
// second S waited for consumer 1's first, and consumer 1 reaches it only after its own last P V and
// epilogue, half a tile after consumer 0's; now consumer 0 runs its first two visits meanwhile.
// Measured on the block-sparse forward with two Q buffers (tests/cuda/block_sparse_fwd_standalone.cu
// `end-ab`, H200, bf16 D = 128, H = 32/8, 8 rounds; csrc/NOTES.md "Session 38"): 1.033 / 1.034 /
// 1.006x the one-Q shipped kernel at 16K and density 0.1 / 0.3 / 0.5, 1.036 / 1.020 / 1.009x at 32K,
// 1.024x at 64K / 0.1, where two Q buffers alone read 1.019 / 1.022 / 1.005x, 1.023 / 1.006 / 1.008x,
// 1.013x and the bound (two Q, no O store at all) 1.046x at 16K / 0.1.
template <class Base>
struct FreeFirstTurn : Base {
  static constexpr bool kFreeFirstTurn = true;
};

// The consumer warpgroups of the v5 forward loop (csrc/NOTES.md; hopper/diffusion_fwd.cuh says why
// each piece is there): per work item, S = Q K^T, the online softmax and O += P V over the item's
// key tiles with FlashAttention-3's in-warpgroup overlap and ping-pong turns, then the epilogue.
// The block-sparse forward runs it; the diffusion forward keeps its own copy (diffusion_fwd.cuh
// says why). What differs per kernel comes from Side<Cfg, Params>{p, side_args...}, `kernel`:
//   kernel.item(w, consumer, tScS_rc): work item w of this consumer warpgroup, a value with
//     n_tiles (key tiles it visits), b, h, row_base (the warpgroup's first row) and row_offset;
//   kernel.row_end(item): rows from there on are not stored (store_o_lse);
//   kernel.o_rows(): the rows of p.tma_o's tensor (Cfg::kSmemO: store_o_lse_tma);
//   kernel.tile(item, j): what the loop needs of the item's j-th key tile; it takes the element
//     mask (a template argument, online_softmax_tile says why) iff kernel.may_mask(tile) &&
//     kernel.masked(item, tile), asked before the barrier waits (the sparse list's global read
//     then overlaps them); kernel.bounds(item, tile, tScS_rc): the mask's column intervals.
//     The && stands here, not in a hook: one returned from a hook was a 16-bit phi in the PTX
//     (not a predicate) and moved the SASS.
// The producer loads the same tiles in the same order into the ring; `it` keeps in step with it.
// Params: the kernel's parameters (scale_log2 and store_o_lse's fields, read in place).
// kTail: the split tail's launch (block_sparse_fwd.cuh): instead of the walk, this CTA's part of a
// split item (kernel.tail(num_items, tp), kernel.part(item, lo, hi)), ended by finish_part.
template <class Cfg, template <class, class> class Side, bool kTail = false, class Params,
          class... SideArgs>
CUTE_DEVICE void fwd_consumers(Params const& p, typename Cfg::SharedStorage& ss, int consumer,
                               int num_items, SideArgs const&... side_args) {
  constexpr bool kFreeFirst = Cfg::kFreeFirstTurn;
  using Elem = typename Cfg::Elem;
  constexpr int BN = Cfg::BN, D = Cfg::D, STAGES = Cfg::STAGES;
  using Barrier = cutlass::arch::ClusterBarrier;
  Tensor sQ = make_tensor(make_smem_ptr(ss.q), typename Cfg::SmemLayoutQ{});
  Tensor sK = make_tensor(make_smem_ptr(ss.k), typename Cfg::SmemLayoutKV{});
  Tensor sVt = make_tensor(make_smem_ptr(ss.v), typename Cfg::SmemLayoutVt{});
  static_assert(Cfg::kConsumers == 2, "the block-sparse consumers take turns in pairs (three: the diffusion forward only)");
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
  // (row, column) of every score this thread holds, relative to (row_base, tile start).
  Tensor tScS = thr_s.partition_C(make_identity_tensor(Shape<Int<Cfg::kConsumerRows>, Int<BN>>{}));
  Tensor tScS_rc = make_tensor(tScS.data(), acc_rowcol(tScS.layout()));
  Tensor tOcO = thr_o.partition_C(make_identity_tensor(Shape<Int<Cfg::kConsumerRows>, Int<D>>{}));
  Tensor tOcO_rc = make_tensor(tOcO.data(), acc_rowcol(tOcO.layout()));
  constexpr int kRows = 2;  // rows per thread (r = 0, 1: lane/4 and lane/4 + 8)
  const Side<Cfg, Params> kernel{p, side_args...};

  int it = 0;  // the producer's ring position, kept in step
  if (Cfg::kPingPong && consumer == 1) named_barrier_arrive(kTurnBarrier + 0);  // see kTurnBarrier
  // Work item wi, the item-th of this CTA's: its key tiles into acc_o, row_max and row_sum. One call
  // site per instantiation (a lambda called twice became a function, whose wgmmas ptxas serialized:
  // C7520), so the plain kernel's loop is what it was before the split tail.
  auto visit = [&](auto const& wi, int item, float (&row_max)[kRows], float (&row_sum)[kRows]) {
    const int ev = consumer * 8;
    float scale_row[kRows];
    for (int i = 0; i < kRows; ++i) {
      row_max[i] = -INFINITY;
      row_sum[i] = 0.f;
    }
    clear(acc_o);
    const int n_tiles = wi.n_tiles;
    const QSlot<Cfg> qs(item);
    Barrier::wait(&ss.q_full[qs.buf], qs.phase);
    trace_event<Cfg>(item, ev + 1);
    if (consumer == 0) trace_value<Cfg>(item, kTraceTiles, n_tiles);

    for (int j = 0; j < n_tiles; ++j, ++it) {
      const int stage = it % STAGES, phase = (it / STAGES) & 1;
      const int prev = (it + STAGES - 1) % STAGES, prev_phase = ((it - 1) / STAGES) & 1;
      const auto tile = kernel.tile(wi, j);
      const bool masked = kernel.may_mask(tile) && kernel.masked(wi, tile);
      Barrier::wait(&ss.k_full[stage], phase);
      if (j > 0) Barrier::wait(&ss.v_full[prev], prev_phase);
      if (Cfg::kPingPong && (!kFreeFirst || j > 0)) named_barrier_sync(kTurnBarrier + consumer);
      if (j == 0) trace_event<Cfg>(item, ev + 2);
      // S_j = Q K_j^T, then (FlashAttention-3's in-warpgroup overlap) O += P_{j-1} V_{j-1}
      // behind it: the softmax of S_j below runs while the tensor cores do that P V.
      gemm_fresh(mma_s, tSrQ(_, _, _, qs.buf), tSrK(_, _, _, stage), acc_s);
      if (j > 0) gemm_batch(mma_o, tOrP, tOrV(_, _, _, prev), acc_o, false);
      if (j > 0) warpgroup_wait<1>(); else warpgroup_wait<0>();  // S_j is ready
      if (j == 0) trace_event<Cfg>(item, ev + 3);
      // Hand the turn over only now: a bar.arrive between the wgmma issue and its wait makes ptxas
      // serialize the wgmmas (warning C7514; nvcc 13.0). The other consumer's S then queues behind
      // our P V, which keeps the tensor cores busy all the same.
      if (Cfg::kPingPong && (!kFreeFirst || j > 0)) named_barrier_arrive(kTurnBarrier + 1 - consumer);
      warpgroup_fence_operand(acc_s);
      Barrier::arrive(&ss.k_empty[stage]);

      const auto bounds = kernel.bounds(wi, tile, tScS_rc);
      [[maybe_unused]] bool rescale = true;
      if constexpr (Cfg::kSoftmaxIlp) {
        constexpr bool kStale = Cfg::kStaleMax;
        if (masked)
          rescale = online_softmax_tile_ilp<true, kStale>(acc_s, tScS_rc, bounds, p.scale_log2, row_max, row_sum, scale_row);
        else
          rescale = online_softmax_tile_ilp<false, kStale>(acc_s, tScS_rc, bounds, p.scale_log2, row_max, row_sum, scale_row);
      } else {
        if (masked)
          online_softmax_tile<true>(acc_s, tScS_rc, bounds, p.scale_log2, row_max, row_sum, scale_row);
        else
          online_softmax_tile<false>(acc_s, tScS_rc, bounds, p.scale_log2, row_max, row_sum, scale_row);
      }

      warpgroup_wait<0>();  // P_{j-1} V_{j-1} is in acc_o, and p_elem is free again
      warpgroup_fence_operand(acc_o);
      if (j > 0) Barrier::arrive(&ss.v_empty[prev]);
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
      if (j == 0) trace_event<Cfg>(item, ev + 4);
    }
    trace_event<Cfg>(item, ev + 5);
    // The consumers' last S of this item has read Q: the producer may load the next item's (one
    // arrival after the loop, not a test in every step).
    Barrier::arrive(&ss.q_empty[qs.buf]);
    if (n_tiles > 0) {  // the last tile's O += P V
      const int last = (it - 1) % STAGES;
      Barrier::wait(&ss.v_full[last], ((it - 1) / STAGES) & 1);
      gemm_batch(mma_o, tOrP, tOrV(_, _, _, last), acc_o, false);
      warpgroup_wait<0>();
      warpgroup_fence_operand(acc_o);
      Barrier::arrive(&ss.v_empty[last]);
    }
    trace_event<Cfg>(item, ev + 6);
  };
  if constexpr (!kTail) {
    for (int item = 0, w = snake_item(0); w < num_items; w = snake_item(++item)) {
      trace_event<Cfg>(item, consumer * 8 + 0);
      const auto wi = kernel.item(w, consumer, tScS_rc);
      float row_max[kRows], row_sum[kRows];
      visit(wi, item, row_max, row_sum);
      // Epilogue (no key tile: O = 0, lse = -inf); rows from row_end on are not stored.
      store_item<Cfg>(p, ss, acc_o, tOcO_rc, row_sum, row_max, wi.b, wi.h, wi.row_base,
                      kernel.row_end(wi), wi.row_offset, kernel.o_rows(), consumer, tid);
      trace_event<Cfg>(item, consumer * 8 + 7);
    }
  } else {  // the split tail's launch: this CTA's part of a split item (num_items: all of them)
    TailPart tp;
    if (kernel.tail(num_items, tp)) {
      const auto wi = kernel.part(kernel.item(tp.w, consumer, tScS_rc), tp.lo, tp.hi);
      float row_max[kRows], row_sum[kRows];
      visit(wi, 0, row_max, row_sum);
      finish_part<Cfg>(p, ss, acc_o, tOcO_rc, row_sum, row_max, tp, p.split_partials,
                       p.split_counters, wi.b, wi.h, wi.row_base, kernel.row_end(wi),
                       wi.row_offset, kernel.o_rows(), consumer, tid);
    }
  }
  store_o_drain<Cfg>(tid);
}

}  // namespace dlm::sm90
