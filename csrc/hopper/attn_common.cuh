// The pieces of the sm90 attention forwards that do not depend on the mask (the block-diffusion
// forward, hopper/diffusion_fwd.cuh, and the block-sparse one, hopper/block_sparse_fwd.cuh): the
// tile config (128-row query tile, two consumer warpgroups of 64 rows, a K / V ring), the TMA
// descriptors, the quad reductions, the ping-pong named barriers, one tile of the online softmax
// with its mask given per row as a column interval, and the epilogue (O and lse from registers).
// Moved here from diffusion_fwd.cuh unchanged: the shipped forward's SASS is byte-identical
// (csrc/NOTES.md "Block-sparse forward (issue #5)").
#pragma once

#include <cute/tensor.hpp>
#include <cute/atom/copy_traits_sm90_tma.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/numeric_types.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "hopper/common.cuh"

namespace dlm::sm90 {

using namespace cute;

// START_: where tiles may start (kStartTile / kStartAny / kStartVarlen, hopper/common.cuh).
template <class Elem_, int D_, int BM_ = 128, int BN_ = 128, int STAGES_ = 2, bool PINGPONG_ = true,
          int START_ = kStartTile>
struct FwdConfig {
  using Elem = Elem_;
  static constexpr int D = D_, BM = BM_, BN = BN_, STAGES = STAGES_;
  static constexpr bool kPingPong = PINGPONG_;  // the consumers take turns at the tensor cores
  static constexpr int kStart = START_;
  static constexpr int kConsumerRows = 64;  // one wgmma M per consumer warpgroup
  static constexpr int kConsumers = BM / kConsumerRows;
  static constexpr int kThreads = 128 * (1 + kConsumers);
  static_assert(kConsumers == 2, "the register split below assumes two consumer warpgroups");

  // 128-byte swizzled, K-major (head dim contiguous), the layout TMA writes and wgmma reads.
  using SmemLayoutQ = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Elem>{},
                                             Shape<Int<BM>, Int<D>>{}));
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

  struct SharedStorage {
    alignas(1024) Elem q[cosize_v<SmemLayoutQ>];
    alignas(1024) Elem k[cosize_v<SmemLayoutKV>];
    alignas(1024) Elem v[cosize_v<SmemLayoutKV>];
    alignas(8) uint64_t q_full, q_empty;  // q_empty: the consumers' last S of a work item is done
    uint64_t k_full[STAGES], k_empty[STAGES], v_full[STAGES], v_empty[STAGES];
  };
  static constexpr int kTileBytesQ = BM * D * sizeof(Elem);
  static constexpr int kTileBytesKV = BN * D * sizeof(Elem);
};

template <class Cfg>
auto make_tma_q(typename Cfg::Elem const* p, int s, int h, int b, int64_t ss, int64_t sh, int64_t sb) {
  return make_tma_copy(SM90_TMA_LOAD{}, bshd_tensor(p, s, Cfg::D, h, b, ss, sh, sb),
                       typename Cfg::SmemLayoutQ{});
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
constexpr int kTurnBarrier = 1;
CUTE_DEVICE void named_barrier_sync(int id) { asm volatile("bar.sync %0, 256;" ::"r"(id)); }
CUTE_DEVICE void named_barrier_arrive(int id) { asm volatile("bar.arrive %0, 256;" ::"r"(id)); }

// One tile of the online softmax, in base 2, on the scores this thread holds (two rows): scales
// by scale_log2, masks (kMasked) as selects, updates the running max and the quad-partial row
// sums, leaves exp2(s - max) in s and the factor that rescales the accumulator in scale_row.
// kMasked: `bounds(i, lo, hi)` gives row i's visible keys as the interval [lo, hi) of this
// thread's columns, relative to its first one (a compare with a constant per bound and score).
// The mask is decided per tile, as a template argument: v4 tested a runtime `masked` flag inside
// the element loop, and ptxas kept a BSSY / ISETP / BRA / BSYNC group around every score's mask
// (64 per tile and thread), FULL tiles included; taking it out of the loop measured 1.46-1.72x
// faster (csrc/NOTES.md, v5).
template <bool kMasked, class Scores, class Coords, class Bounds, int kRows>
CUTE_DEVICE void online_softmax_tile(Scores& acc_s, Coords const& tScS_rc, Bounds const& bounds,
                                     float scale_log2, float (&row_max)[kRows],
                                     float (&row_sum)[kRows], float (&scale_row)[kRows]) {
  Tensor s = make_tensor(acc_s.data(), acc_rowcol(acc_s.layout()));  // (rows, cols)
  CUTE_UNROLL
  for (int i = 0; i < kRows; ++i) {
    float mx = row_max[i];
    [[maybe_unused]] int lo = 0, hi = 0;
    if constexpr (kMasked) bounds(i, lo, hi);
    CUTE_UNROLL
    for (int j = 0; j < size<1>(s); ++j) {
      float x = s(i, j) * scale_log2;
      if constexpr (kMasked) {
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
    const float inv = l > 0.f ? 1.f / l : 0.f;
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

}  // namespace dlm::sm90
