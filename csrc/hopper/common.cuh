// Pieces every sm90 block-diffusion kernel needs (forward and backward): the (S, D, H, B) view TMA
// descriptors are made of, the two register views of a wgmma accumulator, exp2 as the SFU's
// instruction, and the bounds of a tile run without a stack frame.
//
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include <cstdint>
#include <type_traits>

#include "dlm/geometry.h"

namespace dlm::sm90 {

using namespace cute;

// Where a kernel's tiles may start (a compile-time option of every sm90 config; csrc/NOTES.md "Odd
// lengths and varlen"). kStartTile (the shipped kernels): on multiples of the tile size, so both
// halves must be multiples of 128 and TMA boxes are addressed by tile index. kStartAny: each half
// is tiled from its own start at any length, the boxes placed by element coordinates
// (domain_offset); rows a tile reads past its half are masked by column (keys) and not stored
// (queries). kStartVarlen: kStartAny over packed samples (batch 1; cu_seqlens), the work listing
// (sample, tile) pairs built on the host; sample i is block_diffusion(its length, block_size).
constexpr int kStartTile = 0, kStartAny = 1, kStartVarlen = 2;
// Where the batched launchers' tiles start (launch_fwd / launch_bwd; varlen always kStartVarlen).
// kStartAny measured as fast as kStartTile on the shipped shapes (H200, bf16 D=128 H=16, 16K
// tokens, the v4 forward loop: fwd 202 / 314 TFLOPS both at n = 1K / 4K, bwd 229 vs 230 / 373 vs
// 375) and runs any even halves; kStartTile would again need both halves multiples of 128 (the bindings export
// `batched_any_length` so that dlm_ops follows a flip of this constant).
constexpr int kBatchedStart = kStartAny;

// The order a kernel walks its (tile entry, slot) work in (dlm/geometry.h WorkOrder), for slots
// that re-read `bytes_per_slot` each. chunk 0 (the launchers' default): the plain entry-major
// order. chunk < 0: chunks of as many slots as fit in half the device's L2 (the other half for
// what streams through once); chunk > 0: that many. block <= 0: blocks of entries that give each
// (block, chunk) group -block waves of CTAs (block 0: kOrderWaves); block > 0: that many entries.
// Chunks are off by default because no net gain is established (session 7, harness `order` mode,
// csrc/NOTES.md "Work order"): dK/dV lost 3-13 % with them at every shape, the forward 5 % at
// n = 8K for +5 % at n = 1K; dQ gained 1-10 % (GQA 32/8: +8-10 % in three runs), not yet
// confirmed through torch. The first A/Bs timed variants in a fixed order, which alone moved a
// result by up to 15 %; the harness now alternates the order between rounds.
constexpr int kOrderWaves = 4;

// This CTA's item-th work index on the launch's grid: dlm/geometry.h snake_index (why a snake, and
// what it measured: there and csrc/NOTES.md session 9).
CUTE_DEVICE int snake_item(int item) { return dlm::snake_index(item, gridDim.x, blockIdx.x); }
// The same through a host-built balanced schedule (dlm/geometry.h balanced_schedule, for exactly
// this grid) when one is given, the snake otherwise.
CUTE_DEVICE int walk_item(const int32_t* schedule, int item, int num_items) {
  return schedule ? dlm::scheduled_index(schedule, item, blockIdx.x, num_items) : snake_item(item);
}
inline WorkOrder work_order(int slots, int64_t bytes_per_slot, int chunk = 0, int block = 0) {
  if (chunk == 0 || slots <= 1) return {slots, slots, 1};
  int device = 0, sms = 0, l2 = 0;
  cudaGetDevice(&device);
  if (chunk < 0) {
    if (cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, device) != cudaSuccess || l2 <= 0)
      l2 = 50 << 20;  // the H100's (the H200 has 60 MB)
    chunk = static_cast<int>(l2 / 2 / (bytes_per_slot > 0 ? bytes_per_slot : 1));
  }
  chunk = chunk < 1 ? 1 : chunk < slots ? chunk : slots;
  if (block <= 0) {
    if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess || sms <= 0)
      sms = 132;
    const int waves = block < 0 ? -block : kOrderWaves;
    block = (waves * sms + chunk - 1) / chunk;
  }
  return {slots, chunk, block};
}

// Knockouts for the standalone harnesses' `probe` modes (tests/cuda): a config type that declares
// `static constexpr int kProbe` skips parts of a kernel (the diffusion forward: the O / lse store,
// the mask, the softmax; the backward kernels: the gradient stores), so that timing it against
// the whole kernel shows what those parts cost. Its results are wrong; no shipped config declares
// one.
enum : int { kProbeNoStore = 1, kProbeNoMask = 2, kProbeNoSoftmax = 4 };
template <class Cfg, class = void>
inline constexpr int probe_of = 0;
template <class Cfg>
inline constexpr int probe_of<Cfg, std::void_t<decltype(Cfg::kProbe)>> = Cfg::kProbe;
// The harnesses' knockout configs: Base with the parts in PROBE skipped.
template <class Base, int PROBE>
struct Probe : Base {
  static constexpr int kProbe = PROBE;
};
// Whether a probe-free config stores (always) or a kNoStore probe does (never, in practice: the
// test on the accumulator keeps the stored values' computation alive).
template <class Cfg, class Acc>
CUTE_DEVICE bool probe_stores(Acc const& acc) {
  return !(probe_of<Cfg> & kProbeNoStore) || acc(0) == 1234.5f;
}

// Timestamps for the harnesses' `trace` modes (tests/cuda): a config that declares `static
// constexpr bool kTrace = true` (Traced<Base>) has thread 0 of each warpgroup record clock64() at
// fixed points of its first kTraceItems work items into g_trace<>[(CTA, item, slot)], which the
// harness points at a buffer (cudaMemcpyToSymbol). Slots: consumer c's events at c * 8 + e (e =
// 0..7: the forwards' consumer loops say which); the producer's at kTraceProducer + e (0 the item's
// top, 1 its Q issued, 2 its K / V issued); the item's key tile count at kTraceTiles (a value, not
// a time); in the last four the CTA's clock64 and globaltimer at its start and end (the SM clock's
// rate). tests/cuda/trace_stats.h reads them. No shipped config declares kTrace: trace_event
// compiles to nothing and g_trace is not even instantiated there.
constexpr int kTraceItems = 64, kTraceEvents = 28, kTraceProducer = 16, kTraceTiles = 20;
template <class T>
__device__ T* g_trace;
template <class Cfg, class = void>
inline constexpr bool trace_of = false;
template <class Cfg>
inline constexpr bool trace_of<Cfg, std::void_t<decltype(Cfg::kTrace)>> = Cfg::kTrace;
template <class Base>
struct Traced : Base {
  static constexpr bool kTrace = true;
};
template <class Cfg>
CUTE_DEVICE void trace_value(int item, int slot, unsigned long long value) {
  if constexpr (trace_of<Cfg>) {
    if (threadIdx.x % 128 == 0 && item < kTraceItems)
      g_trace<unsigned long long>[(size_t(blockIdx.x) * kTraceItems + item) * kTraceEvents + slot] = value;
  }
}
template <class Cfg>
CUTE_DEVICE void trace_event(int item, int event) {
  if constexpr (trace_of<Cfg>) {
    unsigned long long t;
    if (event >= kTraceEvents - 4 && event % 2) asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    else t = clock64();
    trace_value<Cfg>(item, event, t);
  }
}

// Programmatic dependent launch (PDL). A kernel launched by launch_kernel with `dependent` set may
// start while the kernel before it in the stream is still running, once every CTA of that kernel
// has called allow_dependents() (or exited). Its threads must call wait_for_prerequisite() before
// they read what that kernel writes or write what it reads: the wait returns when it has completed
// and its writes are visible (its own prerequisites had completed before it could). Both are no-ops
// in a kernel launched without the attribute. What it buys: the launch and the set-up (barriers,
// the first loads of inputs) of each kernel of a chain overlap the end of the one before (the
// backward's preprocess -> dK/dV -> dQ, csrc/NOTES.md "Session 46"; the sparse forward's split
// tail, session 22).
CUTE_DEVICE void allow_dependents() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }
CUTE_DEVICE void wait_for_prerequisite() { asm volatile("griddepcontrol.wait;" ::: "memory"); }

// kernel<<<ctas, threads, smem, stream>>>(params), as a programmatic dependent of the stream's
// previous kernel where `dependent` is set (the kernel then calls wait_for_prerequisite first).
template <class Params>
cudaError_t launch_kernel(void (*kernel)(Params), int ctas, int threads, int smem, cudaStream_t stream,
                          bool dependent, const Params& p) {
  if (!dependent) {
    kernel<<<ctas, threads, smem, stream>>>(p);
    return cudaGetLastError();
  }
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(ctas), config.blockDim = dim3(threads);
  config.dynamicSmemBytes = smem, config.stream = stream;
  config.attrs = &attribute, config.numAttrs = 1;
  return cudaLaunchKernelEx(&config, kernel, p);
}

// Named barrier `id` over `threads` threads (id 0 is __syncthreads).
CUTE_DEVICE void bar_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
// Arrives without waiting; the threads that bar_sync the same id see this thread's earlier writes.
CUTE_DEVICE void bar_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
// Register fragments into swizzled shared memory through 32-bit shared addresses: a plain C++
// store through the tensor's element pointer compiled to generic ST with 64-bit addresses held
// over the loop (the fused dK/dV/dQ kernel: 404 bytes spilled). The address must come from the
// element reference: these tensors hold a swizzle_ptr (GMMA layouts carry smem_ptr_flag), which
// swizzles on dereference, so data() + layout offset is the unswizzled address.
CUTE_DEVICE void st_shared_b32(uint32_t addr, uint32_t v) {
  asm volatile("st.shared.b32 [%0], %1;" ::"r"(addr), "r"(v));
}
template <class T>
CUTE_DEVICE uint32_t smem_addr(T* p) { return cute::cast_smem_ptr_to_uint(p); }

// A (seqlen, D, heads, batch) view of a (B, S, H, D) tensor, the shape TMA descriptors are made of.
template <class Elem>
CUTE_HOST_DEVICE auto bshd_tensor(Elem const* ptr, int seqlen, int d, int heads, int batch,
                                  int64_t stride_s, int64_t stride_h, int64_t stride_b) {
  return make_tensor(make_gmem_ptr(ptr), make_shape(seqlen, d, heads, batch),
                     make_stride(stride_s, _1{}, stride_h, stride_b));
}

// The accumulator of a 64 x N wgmma holds, per thread, values (c, r, v) at column 2*(lane%4) + c +
// 8*v and row 16*warp + lane/4 + 8*r. Viewed as (rows, columns) for row-wise work:
template <class Layout>
CUTE_DEVICE auto acc_rowcol(Layout l) {  // ((2, 2, V), M, N) -> ((2, M), (2, V, N))
  static_assert(rank_v<decltype(get<0>(l))> == 3);
  return make_layout(make_layout(get<0, 1>(l), get<1>(l)),
                     make_layout(get<0, 0>(l), get<0, 2>(l), get<2>(l)));
}

// Hand-made shared addresses for staging a 64 x D wgmma accumulator (the epilogues' O, dK, dV,
// dQ) as 16-bit elements in a 128-byte-swizzled, K-major tile: CuTe's Layout_K_SW128_Atom (8 rows
// of 64 elements, the 16-byte chunks of row r XORed with r % 8) tiled to (kTileRows, D), down the
// rows first (is_sw128_k_tile checks a layout against this). The thread's pair (i, g) of the
// accumulator's row-column view lies in row 16 warp + lane / 4 + 8 i, columns 8 g + 2 (lane % 4)
// + {0, 1}: in 16-byte chunk g % 8 of its 128-byte row of column block g / 8, which the swizzle
// moves to chunk (g % 8) ^ (lane / 4). So one XOR per chunk on a per-thread base plus immediate
// offsets, where CuTe's per-element swizzle math took ~150 instructions per staged tile
// (csrc/NOTES.md, "Session 25"). row0: the shared address of the staged 64 rows' first, a multiple
// of 8 rows into a 1024-byte aligned tile; tid: the thread's index in its warpgroup.
template <int kTileRows>
struct Sw128Stage {
  uint32_t t0;
  CUTE_DEVICE Sw128Stage(uint32_t row0, int tid) {
    const int lane = tid % 32, x = lane / 4;
    t0 = row0 + (16 * (tid / 32) + x) * 128 + (x << 4) + (lane % 4) * 4;
  }
  CUTE_DEVICE uint32_t pair(int i, int g) const {
    return (t0 ^ ((g % 8) << 4)) + i * (8 * 128) + (g / 8) * (kTileRows * 128);
  }
};
template <class Layout, class Elem, int kTileRows, int D>
constexpr bool is_sw128_k_tile() {
  static_assert(sizeof(Elem) == 2, "64 elements per 128-byte row");
  if (!std::is_same_v<std::decay_t<decltype(get_swizzle_portion(Layout{}))>, Swizzle<3, 4, 3>>) return false;
  // A rank-2 CuTe layout is the sum of its modes' functions, inner(r, c) = inner(r, 0) + inner(0, c):
  // each mode checked alone covers every (r, c) (all pairs took nvcc past its constexpr limits).
  constexpr auto inner = get_nonswizzle_portion(Layout{});
  static_assert(rank_v<decltype(inner)> == 2 && size<0>(inner) == kTileRows && size<1>(inner) == D);
  for (int r = 0; r < kTileRows; ++r)
    if (int(inner(r, 0)) != r * 64) return false;
  for (int c = 0; c < D; ++c)
    if (int(inner(0, c)) != (c / 64) * (kTileRows * 64) + c % 64) return false;
  return true;
}

// ... and the same registers as the A operand of the next wgmma (K = 16 per instruction): column
// blocks 2j and 2j+1 of 8 form k-block j, so a score tile becomes an operand without moving
// between threads.
template <class Layout>
CUTE_DEVICE auto acc_as_operand_a(Layout l) {  // ((2, 2, V), M, N) -> ((2, 2, 2), M, (V / 2, N))
  auto v = logical_divide(get<0>(l), Shape<_2, _2, _2>{});  // ((2, 1), (2, 1), (2, V / 2))
  return make_layout(make_layout(get<0, 0>(v), get<1, 0>(v), get<2, 0>(v)), get<1>(l),
                     make_layout(get<2, 1>(v), get<2>(l)));
}

// acc (+)= A B as one committed wgmma batch over the operands' k blocks. A and B: (MMA, M or N, K)
// fragments. With `overwrite` the first instruction writes acc instead of adding to it (the wgmma's
// scale-d predicate) and the rest accumulate: an accumulator that holds nothing yet needs no clear.
// The caller waits.
template <class Mma, class FragA, class FragB, class Acc>
CUTE_DEVICE void gemm_batch(Mma& mma, FragA const& a, FragB const& b, Acc& acc, bool overwrite) {
  warpgroup_fence_operand(acc);
  warpgroup_arrive();
  mma.accumulate_ = overwrite ? GMMA::ScaleOut::Zero : GMMA::ScaleOut::One;
  CUTE_UNROLL
  for (int kb = 0; kb < size<2>(a); ++kb) {
    gemm(mma, a(_, _, kb), b(_, _, kb), acc);
    mma.accumulate_ = GMMA::ScaleOut::One;
  }
  warpgroup_commit_batch();
}
// acc = A B (gemm_batch overwriting acc).
template <class Mma, class FragA, class FragB, class Acc>
CUTE_DEVICE void gemm_fresh(Mma& mma, FragA const& a, FragB const& b, Acc& acc) {
  gemm_batch(mma, a, b, acc, true);
}

// 1 / x as the SFU's approximate reciprocal (rcp.approx.ftz, ~1 ulp), for the epilogues' row sums:
// x >= 1 wherever a row saw a key (its largest term is exp2(s_max - m) with the max m it was taken
// against <= s_max, stale or not), far from where the approximation or the flush would matter.
// The IEEE division 1.f / x compiled to a checked sequence with a slow-path call, ~10 instructions
// per row in every work item's epilogue; in bf16 / fp16 outputs the difference does not show.
CUTE_DEVICE float rcp_approx(float x) {
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// exp2 as the SFU's approximate instruction (what --use_fast_math makes of exp2f): the kernels
// say so themselves instead of depending on a build flag. ex2.approx of -inf is +0, which masked
// scores rely on.
CUTE_DEVICE float exp2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// A run's bounds by selects. Indexing runs.begin[r] with r a loop counter puts TileRuns on the
// stack where the run loop is not unrolled (a 16-byte stack frame, LDL / STL in the backward's
// SASS before these).
CUTE_HOST_DEVICE int run_begin(const TileRuns& t, int r) { return r ? t.begin[1] : t.begin[0]; }
CUTE_HOST_DEVICE int run_end(const TileRuns& t, int r) { return r ? t.end[1] : t.end[0]; }

// The K / V ring's barriers, one set per stage: "full" completes on the producer's TMA bytes,
// "empty" on every consumer thread's release. Called by thread 0 before fence_barrier_init.
template <int STAGES>
CUTE_DEVICE void init_kv_ring(uint64_t* k_full, uint64_t* k_empty, uint64_t* v_full,
                              uint64_t* v_empty, int consumer_threads) {
  using Barrier = cutlass::arch::ClusterBarrier;
  for (int s = 0; s < STAGES; ++s) {
    Barrier::init(&k_full[s], 1);
    Barrier::init(&v_full[s], 1);
    Barrier::init(&k_empty[s], consumer_threads);
    Barrier::init(&v_empty[s], consumer_threads);
  }
}

// One ROWS x D box of each of two same-shaped (S, D) views (K and V of a key tile, or Q and dO of a
// query tile) loaded by TMA into one transaction barrier, the box at row `row` of the half or
// sample starting at packed row `offset`: by element coordinates where tiles start anywhere
// (kStart != kStartTile), by tile index otherwise. The caller arms `bar` for both boxes.
template <int kStart, int ROWS, int D, class TmaA, class ViewA, class SmemA, class TmaB, class ViewB,
          class SmemB>
CUTE_DEVICE void load_tile_pair(uint64_t& bar, int offset, int row, TmaA const& tma_a, ViewA const& mA,
                                SmemA& sA, TmaB const& tma_b, ViewB const& mB, SmemB& sB) {
  auto ta = tma_a.get_slice(0);
  auto tb = tma_b.get_slice(0);
  const auto box = Shape<Int<ROWS>, Int<D>>{};
  if constexpr (kStart != kStartTile) {
    const auto at = make_coord(offset + row, 0);
    Tensor gA = local_tile(domain_offset(at, mA), box, make_coord(0, 0));
    Tensor gB = local_tile(domain_offset(at, mB), box, make_coord(0, 0));
    copy(tma_a.with(bar), ta.partition_S(gA), ta.partition_D(sA));
    copy(tma_b.with(bar), tb.partition_S(gB), tb.partition_D(sB));
  } else {
    Tensor gA = local_tile(mA, box, make_coord(row / ROWS, 0));
    Tensor gB = local_tile(mB, box, make_coord(row / ROWS, 0));
    copy(tma_a.with(bar), ta.partition_S(gA), ta.partition_D(sA));
    copy(tma_b.with(bar), tb.partition_S(gB), tb.partition_D(sB));
  }
}

// The producer's K / V stream, shared by the forward and the backward's dQ kernel: for each key
// tile of the runs, wait until the consumers have freed the ring stage, then TMA-load K and V into
// it (one "full" transaction barrier each). `it` is the ring position, kept across calls so that
// a CTA may walk several work items.
template <int BN, int STAGES, class Tma, class Src, class Dst>
CUTE_DEVICE void produce_kv_runs(TilePlans const& plans, TileRuns const& runs, int& it, int bytes,
                                 Tma const& tma_k, Src const& tKgK, Dst& tKsK, uint64_t* k_full,
                                 uint64_t* k_empty, Tma const& tma_v, Src const& tVgV, Dst& tVsV,
                                 uint64_t* v_full, uint64_t* v_empty) {
  using Barrier = cutlass::arch::ClusterBarrier;
  using TxBarrier = cutlass::arch::ClusterTransactionBarrier;
  CUTE_UNROLL
  for (int r = 0; r < 2; ++r) {
    for (int kt = runs.begin[r]; kt < runs.end[r]; ++kt, ++it) {
      const int stage = it % STAGES, phase = (it / STAGES) & 1;
      const int col_tile = plans.other.tile(kt).lo / BN;
      Barrier::wait(&k_empty[stage], phase ^ 1);
      TxBarrier::arrive_and_expect_tx(&k_full[stage], bytes);
      copy(tma_k.with(k_full[stage]), tKgK(_, _, _, col_tile), tKsK(_, _, _, stage));
      Barrier::wait(&v_empty[stage], phase ^ 1);
      TxBarrier::arrive_and_expect_tx(&v_full[stage], bytes);
      copy(tma_v.with(v_full[stage]), tVgV(_, _, _, col_tile), tVsV(_, _, _, stage));
    }
  }
}

// produce_kv_runs for tiles that start anywhere (kStartAny / kStartVarlen): the box of key tile kt
// is placed at row `offset + other.tile(kt).lo` of the (S, D) coordinate view `mKV` by
// domain_offset, not at a tile index, so halves of any length and packed samples are addressed
// alike. Rows past the tensor's end read as zeros (TMA); rows past the half or sample are masked
// by the consumers' column test (visit.end).
template <int BN, int D, int STAGES, class Tma, class ThrTma, class Coord, class Dst>
CUTE_DEVICE void produce_kv_runs_at(TilePlans const& plans, TileRuns const& runs, int& it,
                                    int offset, int bytes, Tma const& tma_k, ThrTma const& thr_k,
                                    Coord const& mK, Dst& tKsK, uint64_t* k_full, uint64_t* k_empty,
                                    Tma const& tma_v, ThrTma const& thr_v, Coord const& mV,
                                    Dst& tVsV, uint64_t* v_full, uint64_t* v_empty) {
  using Barrier = cutlass::arch::ClusterBarrier;
  using TxBarrier = cutlass::arch::ClusterTransactionBarrier;
  CUTE_UNROLL
  for (int r = 0; r < 2; ++r) {
    for (int kt = runs.begin[r]; kt < runs.end[r]; ++kt, ++it) {
      const int stage = it % STAGES, phase = (it / STAGES) & 1;
      const auto at = make_coord(offset + plans.other.tile(kt).lo, 0);
      const auto box = Shape<Int<BN>, Int<D>>{};
      Barrier::wait(&k_empty[stage], phase ^ 1);
      TxBarrier::arrive_and_expect_tx(&k_full[stage], bytes);
      copy(tma_k.with(k_full[stage]),
           thr_k.partition_S(local_tile(domain_offset(at, mK), box, make_coord(0, 0))),
           tKsK(_, _, _, stage));
      Barrier::wait(&v_empty[stage], phase ^ 1);
      TxBarrier::arrive_and_expect_tx(&v_full[stage], bytes);
      copy(tma_v.with(v_full[stage]),
           thr_v.partition_S(local_tile(domain_offset(at, mV), box, make_coord(0, 0))),
           tVsV(_, _, _, stage));
    }
  }
}

}  // namespace dlm::sm90
