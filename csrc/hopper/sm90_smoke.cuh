// Two small sm_90a kernels that prove the toolchain before any attention kernel exists: that
// dlm/geometry.h runs on the device and agrees with dlm_ops/geometry.py, and that CuTe's wgmma path
// from the nvidia-cutlass wheel's headers builds and computes with this nvcc. They are checks, not
// a backend: tests/test_cutlass_build.py compiles this file without a GPU (resource usage) and runs
// it through csrc/bindings/sm90_smoke.cu on the H200.
#pragma once

#include <cute/tensor.hpp>
#include <cute/atom/mma_atom.hpp>
#include <cutlass/arch/barrier.h>

#include "dlm/geometry.h"

namespace dlm::smoke {

// One thread per own tile t of `plans`: runs[t] = [begin0, end0, begin1, end1], area[t], and
// kinds[t * other + o] = 0 (not visited), 1 (PARTIAL) or 2 (FULL) for every other-side tile o.
__global__ void tile_runs_kernel(TilePlans plans, int32_t* runs, int64_t* area, int8_t* kinds) {
  const int t = blockIdx.x * blockDim.x + threadIdx.x;
  if (t >= plans.count()) return;
  const TileRuns r = plans.runs(t);
  const int others = plans.other.count();
  for (int o = 0; o < others; ++o) kinds[static_cast<int64_t>(t) * others + o] = 0;
  DLM_UNROLL
  for (int i = 0; i < 2; ++i) {
    runs[4 * t + 2 * i] = r.begin[i];
    runs[4 * t + 2 * i + 1] = r.end[i];
    for (int o = r.begin[i]; o < r.end[i]; ++o)
      kinds[static_cast<int64_t>(t) * others + o] = plans.visit(t, o).full ? 2 : 1;
  }
  area[t] = plans.area(t);
}

constexpr int kTile = 64;  // one 64 x 64 score tile, head dim 64: a single warpgroup's wgmma
using Elem = cutlass::bfloat16_t;
// 128-byte swizzled, K-major: a 64-element bf16 row is exactly one 128-byte swizzle row.
using SmemLayout = decltype(cute::tile_to_shape(cute::GMMA::Layout_K_SW128_Atom<Elem>{},
                                                cute::Shape<cute::Int<kTile>, cute::Int<kTile>>{}));

// S = q[row0 : row0+64] . k[col0 : col0+64]^T (fp32, wgmma from shared memory), with every pair
// `mask` hides (or past its end) set to -inf, as a PARTIAL tile of an attention kernel would be.
// q, k: (seqlen, 64) bf16 row-major; s: 64 x 64 fp32 row-major. One warpgroup (128 threads).
__global__ void __launch_bounds__(128) masked_scores_kernel(const Elem* q, const Elem* k,
                                                            SequenceMask mask, int row0, int col0,
                                                            float* s) {
  using namespace cute;
  // 1024-byte alignment: the 128-byte swizzle pattern repeats every 8 rows of 128 bytes.
  __shared__ alignas(1024) Elem q_buf[kTile * kTile];
  __shared__ alignas(1024) Elem k_buf[kTile * kTile];
  Tensor sQ = make_tensor(make_smem_ptr(q_buf), SmemLayout{});
  Tensor sK = make_tensor(make_smem_ptr(k_buf), SmemLayout{});
  const int seqlen = mask.seqlen();
  for (int i = threadIdx.x; i < kTile * kTile; i += blockDim.x) {
    const int r = i / kTile, d = i % kTile;
    sQ(r, d) = row0 + r < seqlen ? q[(row0 + r) * kTile + d] : Elem(0.f);
    sK(r, d) = col0 + r < seqlen ? k[(col0 + r) * kTile + d] : Elem(0.f);
  }
  cutlass::arch::fence_view_async_shared();  // generic-proxy stores, then wgmma's async-proxy reads
  __syncthreads();

  auto mma = make_tiled_mma(SM90_64x64x16_F32BF16BF16_SS<GMMA::Major::K, GMMA::Major::K>{});
  auto thr = mma.get_slice(threadIdx.x);
  Tensor tSrQ = thr.make_fragment_A(thr.partition_A(sQ));  // smem descriptors, (MMA, M, K)
  Tensor tSrK = thr.make_fragment_B(thr.partition_B(sK));
  Tensor gS = make_tensor(make_gmem_ptr(s), make_shape(Int<kTile>{}, Int<kTile>{}),
                          make_stride(Int<kTile>{}, Int<1>{}));
  Tensor tSgS = thr.partition_C(gS);
  Tensor acc = thr.make_fragment_C(tSgS);
  clear(acc);
  warpgroup_fence_operand(acc);
  warpgroup_arrive();
  gemm(mma, tSrQ, tSrK, acc);
  warpgroup_commit_batch();
  warpgroup_wait<0>();
  warpgroup_fence_operand(acc);

  // The element mask reads each accumulator's (row, column) from an identity tensor partitioned
  // like the accumulator: the same mapping an attention kernel will use on its PARTIAL tiles.
  Tensor tScS = thr.partition_C(make_identity_tensor(make_shape(Int<kTile>{}, Int<kTile>{})));
  CUTE_UNROLL
  for (int i = 0; i < size(acc); ++i) {
    const int row = row0 + get<0>(tScS(i)), col = col0 + get<1>(tScS(i));
    if (row >= seqlen || col >= seqlen || !mask.visible(row, col)) acc(i) = -INFINITY;
  }
  copy(acc, tSgS);
}

}  // namespace dlm::smoke
