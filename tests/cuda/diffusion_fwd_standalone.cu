// Standalone check + timing of csrc/hopper/diffusion_fwd.cuh without torch (no JIT build, so a kernel
// change costs one nvcc run here and seconds on the GPU): random bf16 inputs, an fp64 CPU reference
// on sampled rows (BD3, GQA, block sizes 5 / 16 / 300), then CUDA-event timing at the benchmark
// shapes. csrc/NOTES.md's "standalone" rows come from it. Build (nvcc >= 12.3, CUTLASS headers from
// the nvidia-cutlass wheel) and run on an H100/H200:
//   nvcc -gencode=arch=compute_90a,code=sm_90a -std=c++17 -O3 --expt-relaxed-constexpr \
//     -I<cutlass_library/source/include> -Icsrc/include -Icsrc \
//     -o fwd_standalone tests/cuda/diffusion_fwd_standalone.cu
//   ./fwd_standalone shipped       # the four shipped instantiations (checks; bf16 D=128 timed)
//   ./fwd_standalone plain2        # or plain3, bn64, nopp: the variants of NOTES.md
//   ./fwd_standalone persist       # a persistent grid (one CTA per SM): checks, then timing
//   ./fwd_standalone snake         # the 2K grid rule against persistent everywhere (snake walk)
//   ./fwd_standalone snake64 / snake256  # the same at D = 64 / 256 (bf16); "backend's grid" in
//                                  # these tables is the 2K rule, persistent everywhere since session 13
//   ./fwd_standalone d256          # head dim 256 (128 x 64 tiles): checks, then timing
//   ./fwd_standalone ab            # the shipped config against 3 stages and no ping-pong: checks of
//                                  # each, then all timed shape by shape on the same inputs, a
//                                  # comparison table last; exit 1 on a failure
//   ./fwd_standalone probe         # timing of knockouts (no O store, no mask, no softmax): what costs
//   ./fwd_standalone smem-o        # the TMA-store epilogue and two Q buffers against the register
//                                  # stores: checks on persistent grids, then the A/B
//   ./fwd_standalone varlen        # odd lengths and varlen (kStartAny / kStartVarlen, csrc/NOTES.md
//                                  # "Odd lengths and varlen"): checks, then varlen vs batched timing;
//                                  # exit 1 on a failure
//   ./fwd_standalone softmax-ab    # shipped softmax vs one chain / four chains: checks, then A/B at D 128/64/256
//   ./fwd_standalone epi-ab        # the item's end: two Q buffers, the store knocked out
//   ./fwd_standalone q2-narrow     # two Q buffers for the narrow kernels at n = 1K: checks, then
//                                  # 12 rounds with A/A arms (D = 128 and 64); q2-plain: the
//                                  # plain kernels at n = 2K / 4K (timing only)
//   ./fwd_standalone bm192-64      # D = 64 with three consumer warpgroups (BM = 192): checks, then the A/B
//   ./fwd_standalone bn256-64      # D = 64 over 256-key tiles: checks, then the A/B
//   ./fwd_standalone ab64          # D = 64: 3 / 4 stages, no ping-pong, two Q buffers against shipped
//   ./fwd_standalone order         # WorkOrders (slot-major, L2 chunks) against the plain order on the
//                                  # shipped persistent config: checks, then the A/B
//   ./fwd_standalone sched         # persistent grids: the balanced schedule against the snake
//   ./fwd_standalone trace         # where an item's time goes: per-phase means (trace_stats.h);
//                                  # trace-sched: the same with the CTAs on the balanced schedule;
//                                  # trace-narrow: the narrow-diagonal kernels at n = 1K (D 128, 64)
//   ./fwd_standalone small         # one small check per head dim (compute-sanitizer runs)
//   ./fwd_standalone prove         # host only (no GPU): the hoisted FULL test equals tile_kind's
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <random>
#include <algorithm>
#include <string>
#include <cuda_runtime.h>
#include "hopper/diffusion_fwd.cuh"
#include "trace_stats.h"

#define CK(x) do { cudaError_t err_ = (x); if (err_ != cudaSuccess) { printf("CUDA error %s at %d\n", cudaGetErrorString(err_), __LINE__); exit(1); } } while (0)

struct Run { int B, n, H, Hkv, bs; bool causal = false; };  // causal: block-causal over 2n
int g_max_ctas = 0;  // persistent grid of at most this many CTAs; 0: one CTA per work item
// work_order's arguments for every launch here (0, 0: the plain order, as the launchers').
int g_order_chunk = 0, g_order_block = 0;
int g_failed = 0;    // checks that failed (exit status of `ab`)
// Persistent grids walk a balanced schedule (dlm/geometry.h order_schedule, the plain order) instead of the snake.
bool g_schedule = false;

// The schedule for a launch of `ctas` CTAs over B * H slots of `ord`'s entries when g_schedule is
// set and the grid is persistent (fewer CTAs than items); null otherwise (the snake). Device memory
// the caller frees.
int32_t* schedule_for(const dlm::TilePlans& plans, const std::vector<int32_t>& ord, int slots, int ctas) {
  const int items = (int)ord.size() * slots;
  if (!g_schedule || ctas >= items) return nullptr;
  const std::vector<int32_t> sched =
      dlm::order_schedule(plans, ord.data(), (int)ord.size(), dlm::WorkOrder{slots, slots, 1}, 1, ctas);
  int32_t* d = nullptr;
  CK(cudaMalloc(&d, sched.size() * 4));
  CK(cudaMemcpy(d, sched.data(), sched.size() * 4, cudaMemcpyHostToDevice));
  return d;
}

template <class Cfg>
float run(Run r, bool check, int iters) {
  using Elem = typename Cfg::Elem;
  const int S = 2 * r.n, D = Cfg::D;
  size_t nq = (size_t)r.B * S * r.H * D, nk = (size_t)r.B * S * r.Hkv * D;
  std::vector<Elem> hq(nq), hk(nk), hv(nk);
  std::mt19937 g(1); std::normal_distribution<float> nd;
  for (auto& x : hq) x = Elem(nd(g)); for (auto& x : hk) x = Elem(nd(g)); for (auto& x : hv) x = Elem(nd(g));
  Elem *q, *k, *v, *o; float* lse; int32_t* order;
  CK(cudaMalloc(&q, nq * 2)); CK(cudaMalloc(&k, nk * 2)); CK(cudaMalloc(&v, nk * 2)); CK(cudaMalloc(&o, nq * 2));
  CK(cudaMalloc(&lse, (size_t)r.B * r.H * S * 4));
  CK(cudaMemcpy(q, hq.data(), nq * 2, cudaMemcpyHostToDevice)); CK(cudaMemcpy(k, hk.data(), nk * 2, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(v, hv.data(), nk * 2, cudaMemcpyHostToDevice)); CK(cudaMemset(o, 0xff, nq * 2));
  CK(cudaMemset(lse, 0xff, (size_t)r.B * r.H * S * 4));  // NaN: an unwritten lse fails too
  dlm::SequenceMask mask = r.causal ? dlm::block_causal(S, r.bs) : dlm::block_diffusion(S, r.bs);
  dlm::TilePlans plans = mask.fwd_tiles(Cfg::BM, Cfg::BN);
  int T = plans.count();
  std::vector<int64_t> area(T); for (int t = 0; t < T; ++t) area[t] = plans.area(t);
  std::vector<int32_t> ord(T); dlm::most_expensive_first(area.data(), T, ord.data());
  CK(cudaMalloc(&order, T * 4)); CK(cudaMemcpy(order, ord.data(), T * 4, cudaMemcpyHostToDevice));
  dlm::sm90::FwdParams<Cfg> p{
      dlm::sm90::make_tma_q<Cfg>(q, S, r.H, r.B, (int64_t)r.H * D, D, (int64_t)S * r.H * D),
      dlm::sm90::make_tma_kv<Cfg>(k, S, r.Hkv, r.B, (int64_t)r.Hkv * D, D, (int64_t)S * r.Hkv * D),
      dlm::sm90::make_tma_kv<Cfg>(v, S, r.Hkv, r.B, (int64_t)r.Hkv * D, D, (int64_t)S * r.Hkv * D),
      o, lse, (int64_t)r.H * D, D, (int64_t)S * r.H * D, S, (int64_t)r.H * S, S, r.H, r.Hkv, r.B, mask,
      (float)(1.4426950408889634 / std::sqrt((double)D)), order, T, nullptr, nullptr,
      dlm::sm90::fwd_work_order<Cfg>(r.B, S, r.H, r.Hkv, g_order_chunk, g_order_block)};
  p = dlm::sm90::with_tma_o<Cfg>(p);
  auto kern = dlm::sm90::diffusion_fwd_kernel<Cfg>;
  int smem = sizeof(dlm::sm90::FwdShared<Cfg>);
  CK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  const int items = r.B * r.H * T;
  dim3 grid(g_max_ctas > 0 && g_max_ctas < items ? g_max_ctas : items);
  p.schedule = schedule_for(plans, ord, r.B * r.H, (int)grid.x);
  kern<<<grid, Cfg::kThreads, smem>>>(p);
  CK(cudaGetLastError()); CK(cudaDeviceSynchronize());
  if (check) {
    std::vector<Elem> ho(nq); std::vector<float> hl((size_t)r.B * r.H * S);
    CK(cudaMemcpy(ho.data(), o, nq * 2, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(hl.data(), lse, hl.size() * 4, cudaMemcpyDeviceToHost));
    double max_err = 0, max_lse_err = 0; int bad = 0;
    const float scale = 1.f / std::sqrt((float)D);
    for (int b = 0; b < r.B; ++b) for (int h = 0; h < r.H; ++h) for (int i = 0; i < S; i += (r.n > 512 ? 37 : 1)) {
      int kvh = h / (r.H / r.Hkv);
      std::vector<double> sc(S); double mx = -1e30;
      for (int j = 0; j < S; ++j) {
        if (!mask.visible(i, j)) { sc[j] = -1e30; continue; }
        double acc = 0;
        for (int d = 0; d < D; ++d) acc += (double)(float)hq[(((size_t)b * S + i) * r.H + h) * D + d] * (double)(float)hk[(((size_t)b * S + j) * r.Hkv + kvh) * D + d];
        sc[j] = acc * scale; mx = std::max(mx, sc[j]);
      }
      double l = 0; for (int j = 0; j < S; ++j) if (sc[j] > -1e29) l += std::exp(sc[j] - mx);
      for (int d = 0; d < D; ++d) {
        double acc = 0;
        for (int j = 0; j < S; ++j) if (sc[j] > -1e29) acc += std::exp(sc[j] - mx) / l * (double)(float)hv[(((size_t)b * S + j) * r.Hkv + kvh) * D + d];
        float got = (float)ho[(((size_t)b * S + i) * r.H + h) * D + d];
        double e = std::fabs(got - acc); if (!(e <= 0.05)) ++bad; max_err = std::max(max_err, std::isnan(got) ? 1e9 : e);
      }
      double le = std::fabs(hl[((size_t)b * r.H + h) * S + i] - (mx + std::log(l)));
      max_lse_err = std::max(max_lse_err, std::isnan(le) ? 1e9 : le);
    }
    int unwritten = 0;  // every row is stored: the poison (NaN) must be gone everywhere
    for (size_t i = 0; i < nq; ++i) unwritten += std::isnan((float)ho[i]);
    for (float x : hl) unwritten += std::isnan(x);
    const bool ok = bad == 0 && max_lse_err <= 1e-3 && unwritten == 0;
    g_failed += !ok;
    printf("%s ", ok ? "PASS" : "FAIL");
    if (unwritten) printf("(%d unwritten) ", unwritten);
    printf("check B=%d n=%d H=%d/%d bs=%d%s: max |out err| %.4f, max |lse err| %.5f, bad %d\n", r.B, r.n, r.H, r.Hkv, r.bs, r.causal ? " causal" : "", max_err, max_lse_err, bad);
  }
  float ms = 0;
  if (iters) {
    cudaEvent_t a, e; cudaEventCreate(&a); cudaEventCreate(&e);
    for (int i = 0; i < 3; ++i) kern<<<grid, Cfg::kThreads, smem>>>(p);
    cudaEventRecord(a);
    for (int i = 0; i < iters; ++i) kern<<<grid, Cfg::kThreads, smem>>>(p);
    cudaEventRecord(e); CK(cudaEventSynchronize(e)); cudaEventElapsedTime(&ms, a, e); ms /= iters;
    double pairs = (double)mask.num_pairs();
    printf("time B=%d n=%d H=%d/%d bs=%d: %.3f ms, %.0f TFLOPS (visible pairs)\n", r.B, r.n, r.H, r.Hkv, r.bs, ms, 4.0 * pairs * D * r.H * r.B / ms / 1e9);
  }
  cudaFree(q); cudaFree(k); cudaFree(v); cudaFree(o); cudaFree(lse); cudaFree(order);
  cudaFree((void*)p.schedule);
  return ms;
}

template <class Cfg>
void all(const char* name, bool timing) {
  printf("== %s\n", name);
  run<Cfg>({1, 256, 2, 2, 16}, true, 0);
  run<Cfg>({2, 512, 4, 2, 16}, true, 0);
  run<Cfg>({1, 384, 2, 1, 5}, true, 0);
  run<Cfg>({1, 1024, 2, 2, 300}, true, 0);
  run<Cfg>({1, 256, 2, 1, 1, true}, true, 0);
  run<Cfg>({1, 384, 2, 2, 16, true}, true, 0);
  if (!timing) return;
  for (int n : {1024, 2048, 4096, 8192}) run<Cfg>({16384 / (2 * n), n, 16, 16, 16}, false, 20);
  run<Cfg>({4, 2048, 32, 8, 16}, false, 20);
}

// ------------------------------------------------------------------------------ ab: the next A/B
// Checks (BD3 at block sizes 1 / 4 / 5 / 16 / 32 / 64 / 300, GQA, block-causal at 1 / 16 / 64: every
// masking path a visit can take), then timing of every variant on the same
// inputs, shape by shape and interleaved (round 1: all variants, round 2: all again; the better of
// the two is kept), so GPU clocks drift across variants alike.
template <class Cfg>
void ab_checks(const char* name) {
  printf("== checks: %s\n", name);
  for (int bs : {1, 4, 5, 16, 32, 64, 300}) run<Cfg>({1, 512, 2, 1, bs}, true, 0);
  run<Cfg>({2, 256, 4, 2, 16}, true, 0);
  run<Cfg>({1, 1024, 2, 2, 16}, true, 0);
  for (int bs : {1, 16, 64}) run<Cfg>({1, 384, 2, 2, bs, true}, true, 0);
}

// ab_checks of each config, on a persistent grid of 3 CTAs and then one CTA per work item (the
// grids every A/B mode checks its variants on); names[i] is Cfgs' i-th.
template <class... Cfgs>
void ab_checks_on_grids(const char* const* names) {
  for (int ctas : {3, 0}) {
    g_max_ctas = ctas;
    int i = 0;
    (ab_checks<Cfgs>(names[i++]), ...);
  }
  g_max_ctas = 0;
}

struct Bufs { void *q, *k, *v, *o; float* lse; int32_t* order; };

__global__ void fill_random(cutlass::bfloat16_t* x, size_t n, uint32_t seed) {  // ~N(0, 1)-ish, cheap
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    uint32_t h = (uint32_t)i * 2654435761u ^ seed;
    h ^= h >> 15; h *= 2246822519u; h ^= h >> 13; h *= 3266489917u; h ^= h >> 16;
    const float u = ((h & 0xffff) + (h >> 16)) * (1.f / 65536.f) - 1.f;  // triangular on (-1, 1)
    x[i] = cutlass::bfloat16_t(u * 2.45f);                                // unit variance
  }
}

template <class Cfg>
float time_on(Run r, const Bufs& b, int iters) {
  using Elem = typename Cfg::Elem;
  const int S = 2 * r.n, D = Cfg::D;
  dlm::SequenceMask mask = r.causal ? dlm::block_causal(S, r.bs) : dlm::block_diffusion(S, r.bs);
  dlm::TilePlans plans = mask.fwd_tiles(Cfg::BM, Cfg::BN);
  const int T = plans.count();
  std::vector<int64_t> area(T); for (int t = 0; t < T; ++t) area[t] = plans.area(t);
  std::vector<int32_t> ord(T); dlm::most_expensive_first(area.data(), T, ord.data());
  CK(cudaMemcpy(b.order, ord.data(), T * 4, cudaMemcpyHostToDevice));
  auto q = static_cast<const Elem*>(b.q), k = static_cast<const Elem*>(b.k), v = static_cast<const Elem*>(b.v);
  dlm::sm90::FwdParams<Cfg> p{
      dlm::sm90::make_tma_q<Cfg>(q, S, r.H, r.B, (int64_t)r.H * D, D, (int64_t)S * r.H * D),
      dlm::sm90::make_tma_kv<Cfg>(k, S, r.Hkv, r.B, (int64_t)r.Hkv * D, D, (int64_t)S * r.Hkv * D),
      dlm::sm90::make_tma_kv<Cfg>(v, S, r.Hkv, r.B, (int64_t)r.Hkv * D, D, (int64_t)S * r.Hkv * D),
      static_cast<Elem*>(b.o), b.lse, (int64_t)r.H * D, D, (int64_t)S * r.H * D, S, (int64_t)r.H * S, S,
      r.H, r.Hkv, r.B, mask, (float)(1.4426950408889634 / std::sqrt((double)D)), b.order, T, nullptr,
      nullptr, dlm::sm90::fwd_work_order<Cfg>(r.B, S, r.H, r.Hkv, g_order_chunk, g_order_block)};
  p = dlm::sm90::with_tma_o<Cfg>(p);
  auto kern = dlm::sm90::diffusion_fwd_kernel<Cfg>;
  const int smem = sizeof(dlm::sm90::FwdShared<Cfg>);
  CK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  const int items = r.B * r.H * T;
  dim3 grid(g_max_ctas > 0 && g_max_ctas < items ? g_max_ctas : items);
  p.schedule = schedule_for(plans, ord, r.B * r.H, (int)grid.x);
  cudaEvent_t e0, e1; CK(cudaEventCreate(&e0)); CK(cudaEventCreate(&e1));
  for (int i = 0; i < 3; ++i) kern<<<grid, Cfg::kThreads, smem>>>(p);
  CK(cudaEventRecord(e0));
  for (int i = 0; i < iters; ++i) kern<<<grid, Cfg::kThreads, smem>>>(p);
  CK(cudaEventRecord(e1)); CK(cudaEventSynchronize(e1)); CK(cudaGetLastError());
  float ms = 0; cudaEventElapsedTime(&ms, e0, e1);
  cudaEventDestroy(e0); cudaEventDestroy(e1);
  cudaFree((void*)p.schedule);
  return ms / iters;
}

// A variant: a config, or a config in a given WorkOrder (Ordered<Cfg, chunk, block>).
template <class Cfg_, int CHUNK, int BLOCK>
struct Ordered {};
// ... or a variant on a persistent grid of one CTA per SM at every shape (Persistent<Cfg>,
// Persistent<Ordered<...>>).
template <class Cfg_>
struct Persistent {};
// ... or persistent walking the balanced schedule (Scheduled<Cfg>).
template <class Cfg_>
struct Scheduled {};
template <class T>
struct VariantOf {
  using Cfg = T;
  static constexpr int kChunk = 0, kBlock = 0;
  static constexpr bool kPersistent = false, kSchedule = false;
};
template <class Cfg_, int CHUNK, int BLOCK>
struct VariantOf<Ordered<Cfg_, CHUNK, BLOCK>> {
  using Cfg = Cfg_;
  static constexpr int kChunk = CHUNK, kBlock = BLOCK;
  static constexpr bool kPersistent = false, kSchedule = false;
};
template <class V>  // Persistent<Cfg> or Persistent<Ordered<...>>
struct VariantOf<Persistent<V>> : VariantOf<V> {
  static constexpr bool kPersistent = true;
};
template <class Cfg_>
struct VariantOf<Scheduled<Cfg_>> {
  using Cfg = Cfg_;
  static constexpr int kChunk = 0, kBlock = 0;
  static constexpr bool kPersistent = true, kSchedule = true;
};

template <class V>
float time_variant(Run r, const Bufs& b) {
  g_order_chunk = VariantOf<V>::kChunk, g_order_block = VariantOf<V>::kBlock;
  const int grid = g_max_ctas;
  if (VariantOf<V>::kPersistent) CK(cudaDeviceGetAttribute(&g_max_ctas, cudaDevAttrMultiProcessorCount, 0));
  g_schedule = VariantOf<V>::kSchedule;
  const float ms = time_on<typename VariantOf<V>::Cfg>(r, b, 20);
  g_order_chunk = g_order_block = 0;
  g_schedule = false;
  g_max_ctas = grid;
  return ms;
}
// Odd rounds run the variants in reverse: a fixed order biased the A/B by up to 15 % (session 7:
// the same work order, timed first and third in one round, 344 vs 389 TFLOPS).
template <class... Vs>
struct Variants {
  static constexpr int kCount = sizeof...(Vs);
  static void time_all(Run r, const Bufs& b, float* ms, int round) {
    using Fn = float (*)(Run, const Bufs&);
    const Fn fns[] = {&time_variant<Vs>...};
    for (int j = 0; j < kCount; ++j) {
      const int i = round & 1 ? kCount - 1 - j : j;
      ms[i] = std::min(ms[i], fns[i](r, b));
    }
  }
};
int g_backend_grid = 0;  // ab_timing: the 2K rule's grid (persistent, the SM count, for n <= 2048)
// ab_timing: the persistent grid at every length (the backend's since session 9: cutlass_diffusion
// _max_ctas), not the 2K rule that g_backend_grid alone gives.
bool g_persistent_all = false;

// Buffers for every timing shape below at head dim D (bf16, random): the largest q is GQA 32/8's
// (k and v are smaller); free with free_timing_bufs.
Bufs timing_bufs(int D) {
  const size_t nq = (size_t)4 * 4096 * 32 * D;
  Bufs b;
  CK(cudaMalloc(&b.q, nq * 2)); CK(cudaMalloc(&b.k, nq * 2)); CK(cudaMalloc(&b.v, nq * 2));
  CK(cudaMalloc(&b.o, nq * 2)); CK(cudaMalloc(&b.lse, (size_t)4 * 32 * 4096 * 4)); CK(cudaMalloc(&b.order, 1 << 16));
  fill_random<<<1024, 256>>>(static_cast<cutlass::bfloat16_t*>(b.q), nq, 1);
  fill_random<<<1024, 256>>>(static_cast<cutlass::bfloat16_t*>(b.k), nq, 2);
  fill_random<<<1024, 256>>>(static_cast<cutlass::bfloat16_t*>(b.v), nq, 3);
  CK(cudaDeviceSynchronize());
  return b;
}
void free_timing_bufs(Bufs& b) {
  cudaFree(b.q); cudaFree(b.k); cudaFree(b.v); cudaFree(b.o); cudaFree(b.lse); cudaFree(b.order);
}

int g_rounds = 4;  // ab_timing's timed rounds per shape (after one untimed)
const std::vector<Run> kAbShapes = {{8, 1024, 16, 16, 16}, {4, 2048, 16, 16, 16}, {2, 4096, 16, 16, 16},
                                    {1, 8192, 16, 16, 16}, {8, 1024, 16, 16, 4},  {4, 2048, 16, 16, 4},
                                    {2, 4096, 16, 16, 4},  {1, 8192, 16, 16, 4},  {4, 2048, 32, 8, 16}};
template <class V, int D = 128>  // D: the variants' head dim (bf16)
void ab_timing(const char* const* names, const std::vector<Run>& shapes = kAbShapes) {
  Bufs b = timing_bufs(D);
  std::vector<std::vector<float>> ms(shapes.size(), std::vector<float>(V::kCount, 1e30f));
  for (size_t s = 0; s < shapes.size(); ++s) {
    g_max_ctas = g_persistent_all || shapes[s].n <= 2048 ? g_backend_grid : 0;
    // One untimed round first: the backward harness's A/A controls (session 14) found its best-of
    // keeping the first variant's first samples, taken before the clocks settled.
    std::vector<float> warm_up(V::kCount, 1e30f);
    V::time_all(shapes[s], b, warm_up.data(), 0);
    for (int round = 0; round < g_rounds; ++round) V::time_all(shapes[s], b, ms[s].data(), round);
  }
  g_max_ctas = 0;
  printf("\n== forward A/B, bf16 D=%d, %s; TFLOPS on visible pairs (ratio to %s)\n", D,
         !g_backend_grid ? "one CTA per work item"
         : g_persistent_all ? "persistent at every length (the backend's grid)"
                            : "the 2K rule's grid (persistent for n <= 2048)",
         names[0]);
  printf("| B | n | H/Hkv | bs |");
  for (int i = 0; i < V::kCount; ++i) printf(" %s |", names[i]);
  printf("\n|---|---|---|---|");
  for (int i = 0; i < V::kCount; ++i) printf("---|");
  printf("\n");
  for (size_t s = 0; s < shapes.size(); ++s) {
    const Run& r = shapes[s];
    const double flop = 4.0 * (double)dlm::block_diffusion(2 * r.n, r.bs).num_pairs() * D * r.H * r.B;
    printf("| %d | %d | %d/%d | %d |", r.B, r.n, r.H, r.Hkv, r.bs);
    for (int i = 0; i < V::kCount; ++i)
      printf(" %.0f (%.3f) |", flop / ms[s][i] / 1e9, ms[s][0] / ms[s][i]);
    printf("\n");
  }
  free_timing_bufs(b);
}

// Mode `trace`: where a work item's time goes (tests/cuda/trace_stats.h says what each column is):
// the shipped config with kTrace (common.cuh Traced), one launch on the persistent grid after three
// untraced ones, bf16 D = 128, 16K tokens, H = 16, block 16 at n = 1K / 2K / 8K and block 4 at 1K.
// Mode `trace-narrow`: the same for the narrow-diagonal kernels the backend runs at n <= 1K
// (FwdShipped NARROW = true; a noisy item's narrow first visit falls inside "first K"), D = 128
// and 64, beside the plain kernel at n = 1K.
template <class Cfg>
void trace_runs(const char* cfg_label, std::initializer_list<Run> runs) {
  using namespace dlm::sm90;
  using u64 = unsigned long long;
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const size_t slots = (size_t)sms * kTraceItems * kTraceEvents;
  u64* dbuf = nullptr;
  CK(cudaMalloc(&dbuf, slots * sizeof(u64)));
  CK(cudaMemcpyToSymbol(g_trace<u64>, &dbuf, sizeof(dbuf)));
  std::vector<u64> h(slots);
  Bufs b = timing_bufs(Cfg::D);
  g_max_ctas = sms;
  for (const Run r : runs) {
    CK(cudaMemset(dbuf, 0, slots * sizeof(u64)));
    const float ms = time_on<Cfg>(r, b, 1);
    CK(cudaMemcpy(h.data(), dbuf, slots * sizeof(u64), cudaMemcpyDeviceToHost));
    const int items = r.B * r.H * dlm::block_diffusion(2 * r.n, r.bs).fwd_tiles(Cfg::BM, Cfg::BN).count();
    char label[64];
    snprintf(label, sizeof(label), "%s n %d, block %d", cfg_label, r.n, r.bs);
    trace_stats::row(label, h, std::min(sms, items), items, 1000.0 * ms);
  }
  g_max_ctas = 0;
  free_timing_bufs(b);
  CK(cudaFree(dbuf));
}

void trace() {
  using namespace dlm::sm90;
  trace_stats::header();
  trace_runs<Traced<FwdShipped<cutlass::bfloat16_t, 128, kBatchedStart>>>(
      "D 128", {Run{8, 1024, 16, 16, 16}, Run{4, 2048, 16, 16, 16}, Run{1, 8192, 16, 16, 16},
                Run{8, 1024, 16, 16, 4}});
}

void trace_narrow() {
  using namespace dlm::sm90;
  using bf16 = cutlass::bfloat16_t;
  trace_stats::header();
  trace_runs<Traced<FwdShipped<bf16, 128, kBatchedStart>>>("D 128 plain", {Run{8, 1024, 16, 16, 16}});
  trace_runs<Traced<FwdShipped<bf16, 128, kBatchedStart, true>>>(
      "D 128 narrow", {Run{8, 1024, 16, 16, 16}, Run{8, 1024, 16, 16, 4}});
  trace_runs<Traced<FwdShipped<bf16, 64, kBatchedStart, true>>>("D 64 narrow", {Run{8, 1024, 16, 16, 16}});
  trace_runs<Traced<FwdShipped<bf16, 64, kBatchedStart>>>("D 64 plain", {Run{4, 2048, 16, 16, 16}});
}

// ------------------------------------------------------------------ varlen: packed samples
// Sample i has halves[i] noisy + halves[i] clean tokens at packed rows [cu[i], cu[i + 1]) of a
// (1, total, H, D) tensor; work entries (sample, query tile) of every sample, most expensive first.
template <class Cfg>
float run_varlen(const std::vector<int>& halves, int H, int Hkv, int bs, bool check, int iters,
                 const char* label = "") {
  using Elem = typename Cfg::Elem;
  static_assert(Cfg::kStart == dlm::sm90::kStartVarlen);
  const int N = (int)halves.size(), D = Cfg::D;
  std::vector<int32_t> cu(N + 1, 0);
  for (int i = 0; i < N; ++i) cu[i + 1] = cu[i] + 2 * halves[i];
  const int S = cu[N];
  if (S == 0) return 0.f;
  size_t nq = (size_t)S * H * D, nk = (size_t)S * Hkv * D;
  std::vector<Elem> hq(nq), hk(nk), hv(nk);
  std::mt19937 g(7); std::normal_distribution<float> nd;
  for (auto& x : hq) x = Elem(nd(g)); for (auto& x : hk) x = Elem(nd(g)); for (auto& x : hv) x = Elem(nd(g));
  // The schedule: (area, sample, tile) of every sample, largest area first, ties in (sample, tile).
  std::vector<int64_t> area; std::vector<int32_t> tsamp, ttile;
  int64_t pairs = 0;
  for (int i = 0; i < N; ++i) {
    const dlm::SequenceMask m = dlm::block_diffusion(2 * halves[i], bs);
    pairs += m.num_pairs();
    const dlm::TilePlans plans = m.fwd_tiles(Cfg::BM, Cfg::BN);
    for (int t = 0; t < plans.count(); ++t) { area.push_back(plans.area(t)); tsamp.push_back(i); ttile.push_back(t); }
  }
  const int E = (int)area.size();
  std::vector<int32_t> ord(E); dlm::most_expensive_first(area.data(), E, ord.data());
  std::vector<int32_t> order(E), sample(E);
  for (int e = 0; e < E; ++e) { order[e] = ttile[ord[e]]; sample[e] = tsamp[ord[e]]; }
  Elem *q, *k, *v, *o; float* lse; int32_t *d_order, *d_sample, *d_cu;
  CK(cudaMalloc(&q, nq * 2)); CK(cudaMalloc(&k, nk * 2)); CK(cudaMalloc(&v, nk * 2)); CK(cudaMalloc(&o, nq * 2));
  CK(cudaMalloc(&lse, (size_t)H * S * 4));
  CK(cudaMalloc(&d_order, E * 4 + 4)); CK(cudaMalloc(&d_sample, E * 4 + 4)); CK(cudaMalloc(&d_cu, (N + 1) * 4));
  CK(cudaMemcpy(q, hq.data(), nq * 2, cudaMemcpyHostToDevice)); CK(cudaMemcpy(k, hk.data(), nk * 2, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(v, hv.data(), nk * 2, cudaMemcpyHostToDevice)); CK(cudaMemset(o, 0xff, nq * 2));
  CK(cudaMemset(lse, 0xff, (size_t)H * S * 4));
  CK(cudaMemcpy(d_order, order.data(), E * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(d_sample, sample.data(), E * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(d_cu, cu.data(), (N + 1) * 4, cudaMemcpyHostToDevice));
  dlm::sm90::FwdParams<Cfg> p{
      dlm::sm90::make_tma_q<Cfg>(q, S, H, 1, (int64_t)H * D, D, (int64_t)S * H * D),
      dlm::sm90::make_tma_kv<Cfg>(k, S, Hkv, 1, (int64_t)Hkv * D, D, (int64_t)S * Hkv * D),
      dlm::sm90::make_tma_kv<Cfg>(v, S, Hkv, 1, (int64_t)Hkv * D, D, (int64_t)S * Hkv * D),
      o, lse, (int64_t)H * D, D, (int64_t)S * H * D, S, (int64_t)H * S, S, H, Hkv, 1,
      dlm::SequenceMask{0, 0, bs}, (float)(1.4426950408889634 / std::sqrt((double)D)), d_order, E,
      d_sample, d_cu, dlm::sm90::fwd_work_order<Cfg>(1, S, H, Hkv, g_order_chunk, g_order_block)};
  p = dlm::sm90::with_tma_o<Cfg>(p);
  auto kern = dlm::sm90::diffusion_fwd_kernel<Cfg>;
  int smem = sizeof(dlm::sm90::FwdShared<Cfg>);
  CK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  dim3 grid(g_max_ctas > 0 && g_max_ctas < H * E ? g_max_ctas : H * E);
  if (E) kern<<<grid, Cfg::kThreads, smem>>>(p);
  CK(cudaGetLastError()); CK(cudaDeviceSynchronize());
  if (check) {
    std::vector<Elem> ho(nq); std::vector<float> hl((size_t)H * S);
    CK(cudaMemcpy(ho.data(), o, nq * 2, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(hl.data(), lse, hl.size() * 4, cudaMemcpyDeviceToHost));
    double max_err = 0, max_lse_err = 0; int bad = 0, unwritten = 0;
    for (size_t i = 0; i < nq; ++i) unwritten += std::isnan((float)ho[i]);
    for (float x : hl) unwritten += std::isnan(x);
    const double scale = 1.0 / std::sqrt((double)D);
    for (int smp = 0; smp < N; ++smp) {
      const int base = cu[smp], len = 2 * halves[smp];
      const dlm::SequenceMask mask = dlm::block_diffusion(len, bs);
      for (int h = 0; h < H; ++h) for (int i = 0; i < len; i += (len > 1024 ? 37 : len > 300 ? 7 : 1)) {
        const int kvh = h / (H / Hkv);
        std::vector<double> sc(len); double mx = -1e30;
        for (int j = 0; j < len; ++j) {
          if (!mask.visible(i, j)) { sc[j] = -1e30; continue; }
          double acc = 0;
          for (int d = 0; d < D; ++d) acc += (double)(float)hq[((size_t)(base + i) * H + h) * D + d] * (double)(float)hk[((size_t)(base + j) * Hkv + kvh) * D + d];
          sc[j] = acc * scale; mx = std::max(mx, sc[j]);
        }
        double l = 0; for (int j = 0; j < len; ++j) if (sc[j] > -1e29) l += std::exp(sc[j] - mx);
        for (int d = 0; d < D; ++d) {
          double acc = 0;
          for (int j = 0; j < len; ++j) if (sc[j] > -1e29) acc += std::exp(sc[j] - mx) / l * (double)(float)hv[((size_t)(base + j) * Hkv + kvh) * D + d];
          float got = (float)ho[((size_t)(base + i) * H + h) * D + d];
          double e = std::fabs(got - acc); if (!(e <= 0.05)) ++bad; max_err = std::max(max_err, std::isnan(got) ? 1e9 : e);
        }
        double le = std::fabs(hl[(size_t)h * S + base + i] - (mx + std::log(l)));
        max_lse_err = std::max(max_lse_err, std::isnan(le) ? 1e9 : le);
      }
    }
    const bool ok = bad == 0 && max_lse_err <= 1e-3 && unwritten == 0;
    g_failed += !ok;
    printf("%s varlen %s%d samples (", ok ? "PASS" : "FAIL", label, N);
    for (int i = 0; i < N && i < 12; ++i) printf("%s%d", i ? " " : "", halves[i]);
    printf("%s) total %d H=%d/%d bs=%d: max |out err| %.4f, max |lse err| %.5f, bad %d, unwritten %d\n",
           N > 12 ? " ..." : "", S, H, Hkv, bs, max_err, max_lse_err, bad, unwritten);
  }
  float ms = 0;
  if (iters && E) {
    cudaEvent_t a, e; cudaEventCreate(&a); cudaEventCreate(&e);
    for (int i = 0; i < 3; ++i) kern<<<grid, Cfg::kThreads, smem>>>(p);
    cudaEventRecord(a);
    for (int i = 0; i < iters; ++i) kern<<<grid, Cfg::kThreads, smem>>>(p);
    cudaEventRecord(e); CK(cudaEventSynchronize(e)); cudaEventElapsedTime(&ms, a, e); ms /= iters;
    printf("time varlen %s%d samples, %d tokens, H=%d/%d bs=%d: %.3f ms, %.0f TFLOPS (visible pairs)\n",
           label, N, S, H, Hkv, bs, ms, 4.0 * pairs * D * H / ms / 1e9);
  }
  cudaFree(q); cudaFree(k); cudaFree(v); cudaFree(o); cudaFree(lse);
  cudaFree(d_order); cudaFree(d_sample); cudaFree(d_cu);
  return ms;
}

// Odd lengths (kStartAny, batched) and varlen (kStartVarlen): checks of both at head dims 64 / 128
// / 256, then timing at 16K tokens: varlen against the shipped batched kernel on the same work.
template <class Any, class Var>
void odd_checks(const char* name) {
  printf("== odd lengths, batched (kStartAny): %s\n", name);
  run<Any>({1, 100, 2, 2, 16}, true, 0);
  run<Any>({5, 300, 2, 1, 5}, true, 0);
  run<Any>({1, 1000, 2, 2, 300}, true, 0);
  run<Any>({16, 100, 2, 1, 1}, true, 0);
  run<Any>({300, 3, 1, 1, 1}, true, 0);
  run<Any>({1, 77, 4, 2, 16, true}, true, 0);    // block-causal over 154 tokens
  run<Any>({1, 300, 2, 2, 1, true}, true, 0);
  run<Any>({2, 256, 2, 2, 16}, true, 0);         // multiples of 128: the shipped tiling
  // A short key tile (the last of a half) that is FULL for a query tile (one block holds both)
  // still needs the column mask (issue #7, n = 500 bs = 300, failed on the H200 by the loop before
  // v5). Each case fails tests/cuda/fwd_mask_mirror.cpp's mirror of that loop.
  run<Any>({1, 500, 2, 1, 300}, true, 0);
  run<Any>({2, 180, 2, 1, 60}, true, 0);
  run<Any>({3, 70, 2, 2, 100}, true, 0);         // (128-key tiles only: D = 256's 64 were right)
  run<Any>({1, 250, 2, 1, 128}, true, 0);
  run<Any>({4, 33, 2, 1, 40}, true, 0);
  run<Any>({1, 200, 2, 1, 150}, true, 0);        // nearby shapes (right in that loop too)
  run<Any>({1, 129, 2, 2, 100}, true, 0);
  printf("== varlen (kStartVarlen): %s\n", name);
  run_varlen<Var>({0, 100, 37, 0, 256, 1, 300}, 4, 2, 16, true, 0);
  run_varlen<Var>({5, 0, 0, 64, 129, 0}, 2, 2, 1, true, 0);
  run_varlen<Var>({1000}, 2, 1, 300, true, 0);
  run_varlen<Var>({0, 0, 3}, 2, 2, 5, true, 0);
  run_varlen<Var>({500}, 2, 1, 300, true, 0);    // short FULL key tiles, as the batched ones above
  run_varlen<Var>({200, 70, 0, 33, 160, 129, 250, 180, 1}, 2, 1, 100, true, 0);
  std::mt19937 g(3);
  std::vector<int> many(40);
  for (auto& x : many) x = g() % 5 == 0 ? 0 : (int)(g() % 200);
  run_varlen<Var>(many, 2, 1, 5, true, 0, "random ");
}

// ----------------------------------------------------------------- prove (host only, no GPU)
// The kernel's FULL test (visit_full over keys_seen_by_all, hoisted out of the loop) against
// tile_kind's (plus the short-tile test the softmax adds), over every visit of many masks.
int prove(dlm::SequenceMask m) {
  using namespace dlm::sm90;
  const dlm::TilePlans plans = m.fwd_tiles(128, 128);
  int bad = 0;
  for (int t = 0; t < plans.count(); ++t) {
    const dlm::TileRuns runs = plans.runs(t);
    const dlm::Intervals all = keys_seen_by_all(m, plans.tile(t));
    for (int r = 0; r < 2; ++r)
      for (int kt = runs.begin[r]; kt < runs.end[r]; ++kt) {
        const dlm::Visit v = plans.visit(t, kt);
        bad += visit_full<128>(r == 0 ? all.first : all.second, v.start, v.end) != (v.full && v.end - v.start == 128);
      }
  }
  return bad;
}

int prove_mode() {
  int bad = 0, masks = 0;
  for (int n : {128, 256, 384, 1024})
    for (int bs : {1, 2, 3, 4, 5, 8, 16, 24, 32, 48, 64, 96, 128, 300, 2048}) {
      bad += prove(dlm::block_diffusion(2 * n, bs));
      bad += prove(dlm::block_causal(2 * n, bs));
      bad += prove(dlm::SequenceMask{n, n + 128, bs});  // unequal halves
      masks += 3;
    }
  printf("FULL-test proofs over %d masks: %s (%d violations)\n", masks, bad ? "FAIL" : "PASS", bad);
  return bad != 0;
}

int main(int argc, char** argv) {
  setvbuf(stdout, nullptr, _IONBF, 0);
  using dlm::sm90::FwdConfig;
  using bf16 = cutlass::bfloat16_t;
  const std::string v = argc > 1 ? argv[1] : "plain2";
  if (v == "prove") return prove_mode();
  if (v == "varlen") {
    using namespace dlm::sm90;
    using half = cutlass::half_t;
    odd_checks<FwdConfig<bf16, 128, 128, 128, 2, true, kStartAny>,
               FwdConfig<bf16, 128, 128, 128, 2, true, kStartVarlen>>("bf16 D=128");
    odd_checks<FwdConfig<half, 64, 128, 128, 2, true, kStartAny>,
               FwdConfig<half, 64, 128, 128, 2, true, kStartVarlen>>("fp16 D=64");
    odd_checks<FwdConfig<bf16, 256, 128, 64, 2, true, kStartAny>,
               FwdConfig<bf16, 256, 128, 64, 2, true, kStartVarlen>>("bf16 D=256 (BN 64)");
    // Timing, bf16 D=128 H=16, 16K tokens: the shipped batched kernel, kStartAny on the same batch,
    // varlen with the same samples packed (equal lengths: the same work), then mixed lengths.
    using Ship = FwdConfig<bf16, 128>;
    using Any = FwdConfig<bf16, 128, 128, 128, 2, true, kStartAny>;
    using Var = FwdConfig<bf16, 128, 128, 128, 2, true, kStartVarlen>;
    printf("== timing, bf16 D=128 H=16 bs=16, 16K tokens\n");
    for (int n : {1024, 4096}) {  // one round: the inputs take seconds to draw (< 60 s in all)
      run<Ship>({16384 / (2 * n), n, 16, 16, 16}, false, 20);
      run<Any>({16384 / (2 * n), n, 16, 16, 16}, false, 20);
      run_varlen<Var>(std::vector<int>(16384 / (2 * n), n), 16, 16, 16, false, 20, "equal ");
    }
    run<Any>({8, 1000, 16, 16, 16}, false, 20);  // odd n, 16000 tokens
    std::mt19937 g(5);
    std::vector<int> mixed;  // halves in [1, 2048) until ~16K tokens (SDAR-style packing)
    for (int tok = 0;;) { const int m = 1 + (int)(g() % 2047); if (tok + 2 * m > 16384) break; mixed.push_back(m); tok += 2 * m; }
    run_varlen<Var>(mixed, 16, 16, 16, true, 20, "mixed ");
    printf("%s: %d check(s) failed\n", g_failed ? "FAILED" : "ALL PASSED", g_failed);
    return g_failed != 0;
  }
  if (v == "ab") {  // the shipped forward against its remaining knobs, same inputs, interleaved
    using Shipped = FwdConfig<bf16, 128>;
    using Stages3 = FwdConfig<bf16, 128, 128, 128, 3>;
    using NoPingPong = FwdConfig<bf16, 128, 128, 128, 2, false>;
    ab_checks<Shipped>("shipped");
    ab_checks<Stages3>("3 stages");
    ab_checks<NoPingPong>("no ping-pong");
    ab_checks<FwdConfig<cutlass::half_t, 128>>("fp16 shipped");
    static const char* names[] = {"shipped", "3 stages", "no ping-pong"};
    ab_timing<Variants<Shipped, Stages3, NoPingPong>>(names);
    printf("%s: %d check(s) failed\n", g_failed ? "FAILED" : "ALL PASSED", g_failed);
    return g_failed != 0;
  }
  if (v == "order") {  // WorkOrders against the plain entry-major order, on the shipped persistent grid
    using namespace dlm::sm90;
    using Shipped = FwdShipped<bf16, 128, kBatchedStart>;
    CK(cudaDeviceGetAttribute(&g_backend_grid, cudaDevAttrMultiProcessorCount, 0));
    struct { int chunk, block, ctas; const char* name; } orders[] = {
        {1, 1, 0, "chunk 1, block 1"}, {3, 2, 0, "chunk 3, block 2"}, {1, 4, g_backend_grid, "chunk 1, block 4, persistent"},
        {3, 5, g_backend_grid, "chunk 3, block 5, persistent"}, {0, 0, 0, "plain order"}};
    for (const auto& o : orders) {  // the order must not change a result
      g_order_chunk = o.chunk, g_order_block = o.block, g_max_ctas = o.ctas;
      ab_checks<Shipped>(o.name);
    }
    g_order_chunk = g_order_block = g_max_ctas = 0;
    printf("%s: %d check(s) failed\n", g_failed ? "FAILED" : "ALL PASSED", g_failed);
    if (g_failed) return 1;
    // Chunk -1: as many heads as fit in half the L2; 0: the plain order (shipped). Chunk 1: slot-major
    // (each slot's `block` consecutive entries together: concurrent CTAs share that slot's K / V).
    static const char* names[] = {"plain (shipped)", "slot-major, 2-entry blocks", "slot-major, 4-entry blocks",
                                  "L2 chunks, blocks of 4 waves", "plain again"};
    ab_timing<Variants<Persistent<Shipped>, Persistent<Ordered<Shipped, 1, 2>>, Persistent<Ordered<Shipped, 1, 4>>,
                       Persistent<Ordered<Shipped, -1, 0>>, Persistent<Shipped>>>(names);
    return 0;
  }
  if (v == "smem-o") {  // the TMA-store epilogue (and two Q buffers) against the register stores
    using namespace dlm::sm90;
    using Reg = FwdConfig<bf16, 128, 128, 128, 2, true, kStartAny, 1, false>;  // shipped until now
    using SmemO = FwdConfig<bf16, 128, 128, 128, 2, true, kStartAny, 1, true>;
    using SmemO2 = FwdConfig<bf16, 128, 128, 128, 2, true, kStartAny, 2, true>;
    CK(cudaDeviceGetAttribute(&g_backend_grid, cudaDevAttrMultiProcessorCount, 0));
    // Checks on grids of 3 CTAs and of one per SM (many items per CTA: every buffer and phase),
    // then one CTA per item; odd lengths and varlen (warpgroups cut by a half's or sample's end
    // take the register path) on 3 CTAs.
    for (int ctas : {3, g_backend_grid, 0}) {
      g_max_ctas = ctas;
      printf("== grid %d (0: one CTA per item)\n", ctas);
      ab_checks<SmemO>("TMA-store epilogue");
      ab_checks<SmemO2>("TMA-store epilogue, two Q buffers");
      ab_checks<FwdConfig<cutlass::half_t, 64, 128, 128, 2, true, kStartAny, 2, true>>("fp16 D=64, both");
    }
    g_max_ctas = 3;
    odd_checks<SmemO, FwdConfig<bf16, 128, 128, 128, 2, true, kStartVarlen, 1, true>>("TMA-store epilogue, 3 CTAs");
    odd_checks<SmemO2, FwdConfig<bf16, 128, 128, 128, 2, true, kStartVarlen, 2, true>>("both, 3 CTAs");
    g_max_ctas = 0;
    static const char* names[] = {"register stores (shipped)", "TMA-store epilogue", "TMA store + two Q",
                                  "TMA store + two Q, persistent everywhere", "register stores again"};
    ab_timing<Variants<Reg, SmemO, SmemO2, Persistent<SmemO2>, Reg>>(names);
    printf("%s: %d check(s) failed\n", g_failed ? "FAILED" : "ALL PASSED", g_failed);
    return g_failed != 0;
  }
  if (v == "snake") {  // persistent grids walk their items in a snake (common.cuh snake_item): checks, then
    using namespace dlm::sm90;   // the backend's grid rule (persistent for n <= 2048) against persistent everywhere
    using Ship = FwdShipped<bf16, 128, kBatchedStart>;
    CK(cudaDeviceGetAttribute(&g_backend_grid, cudaDevAttrMultiProcessorCount, 0));
    for (int ctas : {3, g_backend_grid, 0}) {
      g_max_ctas = ctas;
      printf("== grid %d (0: one CTA per item)\n", ctas);
      ab_checks<Ship>("shipped bf16 D=128");
      ab_checks<FwdShipped<cutlass::half_t, 64, kBatchedStart>>("shipped fp16 D=64");
    }
    g_max_ctas = 3;
    odd_checks<Ship, FwdShipped<bf16, 128, kStartVarlen>>("shipped, 3 CTAs");
    g_max_ctas = 0;
    printf("%s: %d check(s) failed\n", g_failed ? "FAILED" : "ALL PASSED", g_failed);
    if (g_failed) return 1;
    static const char* names[] = {"backend's grid", "persistent everywhere (snake)", "backend's grid again"};
    ab_timing<Variants<Ship, Persistent<Ship>, Ship>>(names);
    return 0;
  }
  if (v == "snake64" || v == "snake256") {  // the same A/B at D = 64 / 256 (bf16), after their checks
    using namespace dlm::sm90;
    CK(cudaDeviceGetAttribute(&g_backend_grid, cudaDevAttrMultiProcessorCount, 0));
    static const char* names[] = {"backend's grid", "persistent everywhere (snake)", "backend's grid again"};
    auto run_d = [&](auto d_tag) {
      constexpr int D = decltype(d_tag)::value;
      using Ship = FwdShipped<bf16, D, kBatchedStart>;
      for (int ctas : {3, g_backend_grid}) {
        g_max_ctas = ctas;
        ab_checks<Ship>(D == 64 ? "shipped bf16 D=64" : "shipped bf16 D=256");
      }
      g_max_ctas = 0;
      printf("%s: %d check(s) failed\n", g_failed ? "FAILED" : "ALL PASSED", g_failed);
      if (!g_failed) ab_timing<Variants<Ship, Persistent<Ship>, Ship>, D>(names);
    };
    if (v == "snake64") run_d(std::integral_constant<int, 64>{}); else run_d(std::integral_constant<int, 256>{});
    return g_failed != 0;
  }
  if (v == "softmax-ab") {  // the shipped softmax (FwdShipped: four chains + stale max, session 16)
    using namespace dlm::sm90;  // against session 15's one-chain softmax and four chains alone: checks
    // (batched, odd, varlen; D 64 / 128 / 256), then the A/B at each head dim
    CK(cudaDeviceGetAttribute(&g_backend_grid, cudaDevAttrMultiProcessorCount, 0));
    for (int ctas : {3, 0}) {
      g_max_ctas = ctas;
      ab_checks<FwdShipped<bf16, 128, kBatchedStart>>("shipped bf16 D=128");
      ab_checks<FwdShipped<cutlass::half_t, 64, kBatchedStart>>("shipped fp16 D=64");
      ab_checks<FwdShipped<bf16, 256, kBatchedStart>>("shipped bf16 D=256");
      ab_checks<FwdConfig<bf16, 128, kFwdBlockM, fwd_block_n(128), kFwdStages, true, kBatchedStart, 1, true, true>>(
          "four chains, bf16 D=128");
    }
    g_max_ctas = 3;
    odd_checks<FwdShipped<bf16, 128, kStartAny>, FwdShipped<bf16, 128, kStartVarlen>>("shipped, 3 CTAs");
    g_max_ctas = 0;
    printf("%s: %d check(s) failed\n", g_failed ? "FAILED" : "ALL PASSED", g_failed);
    if (g_failed) return 1;
    static const char* names[] = {"one chain (session 15)", "four chains", "shipped (+ stale max)", "one chain again"};
    auto run_d = [&](auto d_tag) {
      constexpr int D = decltype(d_tag)::value;
      constexpr int BN = fwd_block_n(D);
      constexpr bool kO = fwd_smem_o(D);
      using One = FwdConfig<bf16, D, kFwdBlockM, BN, kFwdStages, true, kBatchedStart, 1, kO>;
      using Four = FwdConfig<bf16, D, kFwdBlockM, BN, kFwdStages, true, kBatchedStart, 1, kO, true>;
      ab_timing<Variants<One, Four, FwdShipped<bf16, D, kBatchedStart>, One>, D>(names);
    };
    run_d(std::integral_constant<int, 128>{});
    run_d(std::integral_constant<int, 64>{});
    run_d(std::integral_constant<int, 256>{});
    return 0;
  }
  if (v == "bm192-64") {  // D = 64 with three consumer warpgroups (BM = 192: FlashAttention-3's
    using namespace dlm::sm90;  // tile there; session 40): checks, then the A/B against the shipped
    // two-consumer kernel. At 160 registers per consumer BN = 128 spills (ptxas: 212 bytes with the
    // four-chain softmax, 236 with one chain), BN = 112 20 bytes; BN = 96 and 64 fit.
    CK(cudaDeviceGetAttribute(&g_backend_grid, cudaDevAttrMultiProcessorCount, 0));
    using Ship = FwdShipped<bf16, 64, kBatchedStart>;
    using Three96 = FwdConfig<bf16, 64, 192, 96, kFwdStages, true, kBatchedStart, 1, true, true>;
    using Three64 = FwdConfig<bf16, 64, 192, 64, kFwdStages, true, kBatchedStart, 1, true, true>;
    using Three96NoPp = FwdConfig<bf16, 64, 192, 96, kFwdStages, false, kBatchedStart, 1, true, true>;  // no turns
    using Three96S3 = FwdConfig<bf16, 64, 192, 96, 3, true, kBatchedStart, 1, true, true>;  // 3 K / V stages
    static_assert(Three96::kConsumers == 3 && Three96::kConsumerRegs == 160, "three consumers at 160 registers");
    static const char* checked[] = {"three consumers, BN=96, bf16 D=64", "three consumers, BN=64, bf16 D=64",
                                    "three consumers, BN=96, no turns, bf16 D=64",
                                    "three consumers, BN=96, 3 stages, bf16 D=64"};
    ab_checks_on_grids<Three96, Three64, Three96NoPp, Three96S3>(checked);
    g_max_ctas = 3;
    odd_checks<FwdConfig<bf16, 64, 192, 96, kFwdStages, true, kStartAny, 1, true, true>,
               FwdConfig<bf16, 64, 192, 96, kFwdStages, true, kStartVarlen, 1, true, true>>(
        "three consumers, BN=96, 3 CTAs");
    g_max_ctas = 0;
    printf("%s: %d check(s) failed\n", g_failed ? "FAILED" : "ALL PASSED", g_failed);
    if (g_failed) return 1;
    static const char* names[] = {"shipped (BM=128)", "BM=192 BN=96", "BM=192 BN=64", "BN=96 no turns",
                                  "BN=96 3 stages", "shipped again"};
    static const char* grid_names[] = {"shipped (BM=128)", "BM=192 BN=96", "BN=96 no turns", "shipped again"};
    ab_timing<Variants<Ship, Three96, Three64, Three96NoPp, Three96S3, Ship>, 64>(names);
    // The same on the grid the backend launches (persistent at every length), then one CTA per
    // item everywhere (session 41: the first table has 4K / 8K on one CTA per item).
    g_persistent_all = true;
    ab_timing<Variants<Ship, Three96, Three96NoPp, Ship>, 64>(grid_names);
    g_persistent_all = false;
    g_backend_grid = 0;
    ab_timing<Variants<Ship, Three96, Three96NoPp, Ship>, 64>(grid_names);
    return 0;
  }
  if (v == "bn256-64") {  // D = 64 over 256-key tiles (S 64 x 256 per consumer: half the visits,
    using namespace dlm::sm90;  // twice the masked width at the diagonals): checks, then the A/B
    CK(cudaDeviceGetAttribute(&g_backend_grid, cudaDevAttrMultiProcessorCount, 0));
    using Ship = FwdShipped<bf16, 64, kBatchedStart>;
    using Wide = FwdConfig<bf16, 64, kFwdBlockM, 256, kFwdStages, true, kBatchedStart, 1, fwd_smem_o(64), true,
                           fwd_stale_max(64)>;
    for (int ctas : {3, 0}) {
      g_max_ctas = ctas;
      ab_checks<Wide>("bf16 D=64 BN=256");
    }
    g_max_ctas = 3;
    odd_checks<FwdConfig<bf16, 64, kFwdBlockM, 256, kFwdStages, true, kStartAny, 1, fwd_smem_o(64), true>,
               FwdConfig<bf16, 64, kFwdBlockM, 256, kFwdStages, true, kStartVarlen, 1, fwd_smem_o(64), true>>(
        "bf16 D=64 BN=256, 3 CTAs");
    g_max_ctas = 0;
    printf("%s: %d check(s) failed\n", g_failed ? "FAILED" : "ALL PASSED", g_failed);
    if (g_failed) return 1;
    static const char* names[] = {"shipped (BN=128)", "BN=256", "shipped again"};
    ab_timing<Variants<Ship, Wide, Ship>, 64>(names);
    return 0;
  }
  if (v == "ab64") {  // D = 64's remaining knobs: ring depth (3 / 4 stages), ping-pong off, two Q
    using namespace dlm::sm90;  // buffers; checks of each, then the A/B against the shipped config
    CK(cudaDeviceGetAttribute(&g_backend_grid, cudaDevAttrMultiProcessorCount, 0));
    using Ship = FwdShipped<bf16, 64, kBatchedStart>;
    constexpr bool kO = fwd_smem_o(64), kStale = fwd_stale_max(64);
    using S3 = FwdConfig<bf16, 64, kFwdBlockM, 128, 3, true, kBatchedStart, 1, kO, true, kStale>;
    using S4 = FwdConfig<bf16, 64, kFwdBlockM, 128, 4, true, kBatchedStart, 1, kO, true, kStale>;
    using NoPP = FwdConfig<bf16, 64, kFwdBlockM, 128, kFwdStages, false, kBatchedStart, 1, kO, true, kStale>;
    using Q2S3 = FwdConfig<bf16, 64, kFwdBlockM, 128, 3, true, kBatchedStart, 2, kO, true, kStale>;
    static const char* checked[] = {"bf16 D=64 3 stages", "bf16 D=64 4 stages", "bf16 D=64 no ping-pong",
                                    "bf16 D=64 two Q buffers, 3 stages"};
    ab_checks_on_grids<S3, S4, NoPP, Q2S3>(checked);
    printf("%s: %d check(s) failed\n", g_failed ? "FAILED" : "ALL PASSED", g_failed);
    if (g_failed) return 1;
    // Persistent<>: the shipped grid (one CTA per SM) at every length, as the backend runs it.
    static const char* names[] = {"shipped", "3 stages", "4 stages", "no ping-pong", "2 Q + 3 stages", "shipped again"};
    ab_timing<Variants<Persistent<Ship>, Persistent<S3>, Persistent<S4>, Persistent<NoPP>, Persistent<Q2S3>,
                       Persistent<Ship>>, 64>(names);
    return 0;
  }
  if (v == "sched") {  // persistent grids: the balanced schedule (dlm/geometry.h order_schedule)
    using namespace dlm::sm90;  // against the snake; checks on grids of 3 CTAs and of one per SM
    CK(cudaDeviceGetAttribute(&g_backend_grid, cudaDevAttrMultiProcessorCount, 0));
    g_schedule = true;
    for (int ctas : {3, g_backend_grid}) {
      g_max_ctas = ctas;
      ab_checks<FwdShipped<bf16, 128, kBatchedStart>>("scheduled bf16 D=128");
      ab_checks<FwdShipped<cutlass::half_t, 64, kBatchedStart>>("scheduled fp16 D=64");
      ab_checks<FwdShipped<bf16, 256, kBatchedStart>>("scheduled bf16 D=256");
    }
    g_schedule = false;
    g_max_ctas = 0;
    printf("%s: %d check(s) failed\n", g_failed ? "FAILED" : "ALL PASSED", g_failed);
    if (g_failed) return 1;
    static const char* names[] = {"snake (shipped)", "balanced schedule", "snake again"};
    using Ship = FwdShipped<bf16, 128, kBatchedStart>;
    ab_timing<Variants<Persistent<Ship>, Scheduled<Ship>, Persistent<Ship>>>(names);
    using Ship64 = FwdShipped<bf16, 64, kBatchedStart>;
    ab_timing<Variants<Persistent<Ship64>, Scheduled<Ship64>, Persistent<Ship64>>, 64>(names);
    return 0;
  }
  if (v == "trace" || v == "trace-sched") {  // trace-sched: the CTAs walk the balanced schedule
    g_schedule = v == "trace-sched";
    trace();
    return 0;
  }
  if (v == "trace-narrow") {
    trace_narrow();
    return 0;
  }
  if (v == "q2-narrow") {  // two Q buffers for the narrow-diagonal kernels at n = 1K (what the
    using namespace dlm::sm90;  // backend runs there): checks, then an A/B of 12 rounds with A/A arms
    CK(cudaDeviceGetAttribute(&g_backend_grid, cudaDevAttrMultiProcessorCount, 0));
    // One Q buffer, as the narrow kernels were until session 35, against two (FwdShipped's now).
    using Narrow = FwdConfig<bf16, 128, kFwdBlockM, fwd_block_n(128), kFwdStages, true, kBatchedStart, 1,
                             fwd_smem_o(128), true, fwd_stale_max(128), true>;
    using Narrow2Q = FwdShipped<bf16, 128, kBatchedStart, true>;
    using Narrow64 = FwdConfig<bf16, 64, kFwdBlockM, fwd_block_n(64), kFwdStages, true, kBatchedStart, 1,
                               fwd_smem_o(64), true, fwd_stale_max(64), true>;
    using Narrow64_2Q = FwdShipped<bf16, 64, kBatchedStart, true>;
    static_assert(Narrow2Q::QSTAGES == 2 && Narrow64_2Q::QSTAGES == 2, "the shipped narrow kernels' two Q buffers");
    for (int ctas : {3, 0}) {
      g_max_ctas = ctas;
      ab_checks<Narrow2Q>("narrow 2 Q bf16 D=128");
      ab_checks<Narrow64_2Q>("narrow 2 Q bf16 D=64");
    }
    g_max_ctas = 0;
    printf("%s: %d check(s) failed\n", g_failed ? "FAILED" : "ALL PASSED", g_failed);
    if (g_failed) return 1;
    g_rounds = 12;
    const std::vector<Run> n1k = {{8, 1024, 16, 16, 16}, {8, 1024, 16, 16, 4}, {8, 1024, 32, 8, 16}};
    static const char* names[] = {"narrow", "narrow 2 Q", "narrow again", "narrow 2 Q again"};
    ab_timing<Variants<Narrow, Narrow2Q, Narrow, Narrow2Q>>(names, n1k);
    ab_timing<Variants<Narrow64, Narrow64_2Q, Narrow64, Narrow64_2Q>, 64>(names, n1k);
    return 0;
  }
  if (v == "q2-plain") {  // the same for the plain kernels at n = 2K / 4K (the backend's there)
    using namespace dlm::sm90;
    CK(cudaDeviceGetAttribute(&g_backend_grid, cudaDevAttrMultiProcessorCount, 0));
    using Plain = FwdShipped<bf16, 128, kBatchedStart>;
    using Plain2Q = FwdConfig<bf16, 128, kFwdBlockM, fwd_block_n(128), kFwdStages, true, kBatchedStart, 2,
                              fwd_smem_o(128), true, fwd_stale_max(128)>;
    using Plain64 = FwdShipped<bf16, 64, kBatchedStart>;
    using Plain64_2Q = FwdConfig<bf16, 64, kFwdBlockM, fwd_block_n(64), kFwdStages, true, kBatchedStart, 2,
                                 fwd_smem_o(64), true, fwd_stale_max(64)>;
    g_rounds = 12;
    const std::vector<Run> shapes = {{4, 2048, 16, 16, 16}, {4, 2048, 16, 16, 4}, {2, 4096, 16, 16, 16},
                                     {4, 2048, 32, 8, 16}};
    static const char* names[] = {"plain", "plain 2 Q", "plain again", "plain 2 Q again"};
    ab_timing<Variants<Plain, Plain2Q, Plain, Plain2Q>>(names, shapes);
    ab_timing<Variants<Plain64, Plain64_2Q, Plain64, Plain64_2Q>, 64>(names, shapes);
    return 0;
  }
  if (v == "epi-ab") {  // the item's end (csrc/NOTES.md "Session 17"): two Q buffers, with the O /
    using namespace dlm::sm90;  // lse store knocked out (store_item honours it on the TMA path
    // since session 17): what removing the item's end could give. Checks of two Q buffers first.
    // (Session 17 also timed stmatrix for the O staging here: 0.99-1.02x; deleted.)
    CK(cudaDeviceGetAttribute(&g_backend_grid, cudaDevAttrMultiProcessorCount, 0));
    using Ship = FwdShipped<bf16, 128, kBatchedStart>;
    using Q2 = FwdConfig<bf16, 128, kFwdBlockM, fwd_block_n(128), kFwdStages, true, kBatchedStart, 2,
                         fwd_smem_o(128), true, fwd_stale_max(128)>;
    for (int ctas : {3, 0}) {
      g_max_ctas = ctas;
      ab_checks<Q2>("2 Q bf16 D=128");
    }
    g_max_ctas = 0;
    printf("%s: %d check(s) failed\n", g_failed ? "FAILED" : "ALL PASSED", g_failed);
    if (g_failed) return 1;
    static const char* names[] = {"shipped", "2 Q", "2 Q + no store", "shipped again"};
    ab_timing<Variants<Ship, Q2, Probe<Q2, kProbeNoStore>, Ship>>(names);
    return 0;
  }
  if (v == "probe") {  // what parts of the forward cost: knockouts (attn_common.cuh kProbe*), timing only
    using namespace dlm::sm90;
    using Full = FwdConfig<bf16, 128, 128, 128, 2, true, kStartAny>;  // the shipped batched config
    CK(cudaDeviceGetAttribute(&g_backend_grid, cudaDevAttrMultiProcessorCount, 0));
    static const char* names[] = {"whole kernel", "no O / lse store", "no mask", "no softmax", "whole again"};
    ab_timing<Variants<Full, Probe<Full, kProbeNoStore>, Probe<Full, kProbeNoMask>,
                       Probe<Full, kProbeNoSoftmax>, Full>>(names);
    return 0;
  }
  // One small problem per shipped head dim, e.g. under compute-sanitizer memcheck / racecheck.
  if (v == "small") {
    run<FwdConfig<bf16, 128>>({1, 256, 2, 1, 16}, true, 0);
    run<FwdConfig<cutlass::half_t, 64>>({1, 128, 2, 2, 5, true}, true, 0);
    run<FwdConfig<bf16, 256, 128, 64, 2>>({1, 256, 2, 2, 16}, true, 0);
    printf("%s: %d check(s) failed\n", g_failed ? "FAILED" : "ALL PASSED", g_failed);
    return g_failed != 0;
  }
  // The shipped instantiations (checks only, then bf16 D=128 timed): run this first after a change.
  if (v == "shipped") {
    all<FwdConfig<cutlass::half_t, 128>>("fp16 D=128", false);
    all<FwdConfig<bf16, 64>>("bf16 D=64", false);
    all<FwdConfig<cutlass::half_t, 64>>("fp16 D=64", false);
    all<FwdConfig<bf16, 128>>("bf16 D=128", true);
  }
  // Tile / stage variants (csrc/NOTES.md), bf16 D=128.
  if (v == "plain2") all<FwdConfig<bf16, 128, 128, 128, 2>>("plain, 2 stages", true);
  if (v == "plain3") all<FwdConfig<bf16, 128, 128, 128, 3>>("plain, 3 stages", true);
  if (v == "bn64") all<FwdConfig<bf16, 128, 128, 64, 3>>("plain, BN 64, 3 stages", true);
  if (v == "d256") {  // the shipped D = 256 tiles (csrc/hopper/diffusion_fwd.cuh: 128 x 64)
    all<FwdConfig<cutlass::half_t, 256, 128, 64, 2>>("fp16 D=256", false);
    all<FwdConfig<bf16, 256, 128, 64, 2>>("bf16 D=256", true);
  }
  if (v == "nopp") all<FwdConfig<bf16, 128, 128, 128, 2, false>>("overlap, no ping-pong", true);
  // Persistent grid (one CTA per SM walking work items): checks of all four, bf16 D=128 timed.
  if (v == "persist" || v == "persist2") {
    int sms = 0;
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    g_max_ctas = v == "persist" ? sms : 2 * sms;
    printf("persistent grid: %d CTAs\n", g_max_ctas);
    all<FwdConfig<cutlass::half_t, 64>>("fp16 D=64", false);
    all<FwdConfig<bf16, 128>>("bf16 D=128", true);
  }
  return 0;
}
