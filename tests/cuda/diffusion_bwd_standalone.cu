// Standalone check + timing of csrc/hopper/diffusion_bwd.cuh without torch: random inputs, the
// forward of csrc/hopper/diffusion_fwd.cuh for O and lse, then the backward; an fp64 CPU reference
// of dQ / dK / dV (written from the mask's definition, not from geometry.h's tiles) on sampled rows
// and key columns; then CUDA-event timing at the benchmark shapes. Build (nvcc >= 12.3, CUTLASS
// headers from the nvidia-cutlass wheel) and run on an H100/H200:
//   nvcc -gencode=arch=compute_90a,code=sm_90a -std=c++17 -O3 --expt-relaxed-constexpr \
//     -I<cutlass_library/source/include> -Icsrc/include -Icsrc \
//     -o bwd_standalone tests/cuda/diffusion_bwd_standalone.cu
//   ./bwd_standalone            # = shipped: checks of the four instantiations, bf16 D=128 timed
//   ./bwd_standalone check      # checks only;  ./bwd_standalone time: timing only
//   ./bwd_standalone dkdv3      # checks + timing of dK/dV with a 3-stage ring (the shipped loop)
//   ./bwd_standalone dq64       # checks + timing of dQ over 64-key tiles
//   ./bwd_standalone d256       # the D = 256 kernels: checks (batched, odd, varlen), then timing;
//                               # d256-small: two small checks, for compute-sanitizer; d256-time:
//                               # the timing alone
//   ./bwd_standalone d256-handoff # an experiment: P^T handed from the dV to the dK warpgroup (checks,
//                               # then the A/B against the shipped role split); -small for sanitizers
//   ./bwd_standalone small      # two small checks, for compute-sanitizer (memcheck, racecheck)
//   ./bwd_standalone probe      # timing of each gradient kernel without its stores (what they cost)
//   ./bwd_standalone prof       # the shipped backward twice at n = 4K, for ncu (L2 left by dK/dV for dQ)
//   ./bwd_standalone fused-any  # the fused dK/dV/dQ kernel at kStartAny (the extension's batched
//                               # start): odd / varlen checks, then the A/B against two kernels
//   ./bwd_standalone tma-store  # the TMA-store epilogues (default off): checks, then the A/B
//   ./bwd_standalone persistent # the persistent dK/dV kernel (two K / V buffers): checks, then A/Bs
//   ./bwd_standalone persistent64 # its A/B at D = 64 (bf16)
//   ./bwd_standalone kernel-order # the whole backward with dQ before dK/dV (shipped and persistent)
//   ./bwd_standalone aa         # A/A controls of timing_ab (the shipped configs in both arms)
//   ./bwd_standalone varlen     # odd lengths (kStartAny) and varlen (kStartVarlen), forward and
//                               # backward: checks of every output element's poison and sampled
//                               # rows against fp64, then varlen vs batched timing at 16K tokens
//                               # (csrc/NOTES.md "Odd lengths and varlen"); exit 1 on a failure
//   ./bwd_standalone ds         # dS through HBM (dK/dV stores dS^T, dQ reads it: 5 matmuls): checks,
//                               # then the A/B against the shipped kernels; ds-small for sanitizers;
//                               # ds-dq: the dQ-from-dS kernel one CTA per item vs persistent;
//                               # ds256 (-small): the same at D = 256; ds64: at D = 64
//   ./bwd_standalone bm128-64   # D = 64 dK/dV over 128-query tiles: checks, then A/Bs
//   ./bwd_standalone ds-rule    # the dS backward: persistent dK/dV vs per key tile at long halves, GQA
//   ./bwd_standalone ds-prof    # the shipped dS backward twice at n = 1K, for ncu
//   ./bwd_standalone ds-orders  # the dS backward's dK/dV kernel under the L2-chunked work orders
//   ./bwd_standalone ds-dq-order # the dQ-from-dS kernel in L2 chunks: checks, then the A/B
//   ./bwd_standalone ds-dq-tma  # the dQ-from-dS kernel's TMA-store epilogue: checks, then the A/B
//   ./bwd_standalone ds-l2      # timing only: dS^T kept in L2, read by the dQ-from-dS kernel and
//                               # written by the dK/dV kernel (the bounds of a dQ that follows its
//                               # dK/dV closely enough to find it there, and of discarding it)
//   ./bwd_standalone sched      # the persistent dK/dV kernel's balanced schedule: checks, then the A/B
//   ./bwd_standalone sched-l2   # the same in L2-friendlier work orders: checks, then the A/B
//   ./bwd_standalone pdl        # dependent launches of the dK/dV and dQ kernels: checks, then the A/B
//   ./bwd_standalone dq-sched   # the dQ-from-dS kernel's balanced schedule: checks, then the A/B
//   ./bwd_standalone pre-bound  # what the preprocess adds to the shipped backwards (timing only)
//   ./bwd_standalone refdump F  # no GPU: writes inputs and the fp64 reference of one small problem
//                               # to F (tests the reference itself against torch autograd)
// A check passes when max |err| <= tol * max |ref| per gradient (tol 2e-2 bf16, 1e-2 fp16) and no
// element is NaN (outputs are NaN-poisoned before the kernels run).
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <cmath>
#include <memory>
#include <vector>
#include <algorithm>
#include <string>
#include <initializer_list>
#include <type_traits>
#include <utility>
#include <cuda_runtime.h>
#include "hopper/diffusion_fwd.cuh"
#include "hopper/diffusion_bwd.cuh"
#include "hopper/bwd_dq_from_ds.cuh"

#define CK(x) do { cudaError_t err_ = (x); if (err_ != cudaSuccess) { printf("CUDA error %s at %d\n", cudaGetErrorString(err_), __LINE__); exit(1); } } while (0)

using bf16 = cutlass::bfloat16_t;
using fp16 = cutlass::half_t;
template cudaError_t dlm::sm90::launch_fwd<bf16, 64>(const dlm::sm90::FwdArgs&);
template cudaError_t dlm::sm90::launch_fwd<bf16, 128>(const dlm::sm90::FwdArgs&);
template cudaError_t dlm::sm90::launch_fwd<fp16, 64>(const dlm::sm90::FwdArgs&);
template cudaError_t dlm::sm90::launch_fwd<fp16, 128>(const dlm::sm90::FwdArgs&);
template cudaError_t dlm::sm90::launch_fwd<bf16, 256>(const dlm::sm90::FwdArgs&);
template cudaError_t dlm::sm90::launch_fwd<fp16, 256>(const dlm::sm90::FwdArgs&);

struct Run {
  int B, n, H, Hkv, bs;
  bool causal = false;  // block-causal over 2n tokens (n_noisy = 0)
  int stride = 1;       // check every stride-th row and key column
};

static int g_failures = 0;
// work_order's arguments for every launch here (0, 0: the plain order, as the extension's); the
// `order` mode checks and times the orders.
static int g_order_chunk = 0, g_order_block = 0;
// The persistent dK/dV kernel walks a balanced schedule (dlm/geometry.h order_schedule)
// instead of the snake (mode `sched`).
static bool g_schedule = false;
// The dQ-from-dS kernel walks launch_bwd_ds's order whatever g_order_chunk says (mode `sched-l2`,
// whose arms differ in the dK/dV kernel's order alone).
static bool g_dq_shipped_order = false;
// The persistent dQ-from-dS kernel walks a balanced schedule of launch_bwd_ds's order with this many
// tail rounds (dlm/geometry.h balanced_schedule; the extension ships kDsDqScheduleTailRounds) where
// >= 0, the snake where -1 (mode `dq-sched`; set with g_dq_shipped_order).
static int g_dq_tail_rounds = -1;

// ------------------------------------------------------------------------------ fp64 reference
// Visibility straight from the definition (DESIGN.md 1), not from geometry.h.
struct RefMask {
  int n_noisy, S, bs;
  bool visible(int q, int k) const {
    const bool qc = q >= n_noisy, kc = k >= n_noisy;
    const int qb = (qc ? q - n_noisy : q) / bs, kb = (kc ? k - n_noisy : k) / bs;
    if (qc == kc && qb == kb) return true;
    if (!qc && kc) return kb < qb;
    if (qc && kc) return kb <= qb;
    return false;
  }
};

// Per (b, h): lse and delta of every row (needed by every key's dK / dV), then the gradients of
// the sampled rows / columns. Inputs as doubles, (B, S, H, D) / (B, S, Hkv, D).
struct Reference {
  int B, S, H, Hkv, D;
  RefMask mask;
  double scale;
  const std::vector<double>&q, &k, &v, &g;  // g = dO
  std::vector<double> lse, delta;           // (B, H, S)

  double at(const std::vector<double>& x, int heads, int b, int s, int h, int d) const {
    return x[(((size_t)b * S + s) * heads + h) * D + d];
  }
  double logit(int b, int h, int i, int j) const {
    const int kvh = h / (H / Hkv);
    double acc = 0;
    for (int d = 0; d < D; ++d) acc += at(q, H, b, i, h, d) * at(k, Hkv, b, j, kvh, d);
    return acc * scale;
  }
  double dp(int b, int h, int i, int j) const {  // dO_i . v_j
    const int kvh = h / (H / Hkv);
    double acc = 0;
    for (int d = 0; d < D; ++d) acc += at(g, H, b, i, h, d) * at(v, Hkv, b, j, kvh, d);
    return acc;
  }
  void row_stats() {
    lse.assign((size_t)B * H * S, 0);
    delta.assign((size_t)B * H * S, 0);
    std::vector<double> sc(S), o(D);
    for (int b = 0; b < B; ++b)
      for (int h = 0; h < H; ++h)
        for (int i = 0; i < S; ++i) {
          double mx = -1e300;
          for (int j = 0; j < S; ++j)
            if (mask.visible(i, j)) mx = std::max(mx, sc[j] = logit(b, h, i, j));
          double l = 0;
          for (int j = 0; j < S; ++j)
            if (mask.visible(i, j)) l += std::exp(sc[j] - mx);
          std::fill(o.begin(), o.end(), 0.0);
          const int kvh = h / (H / Hkv);
          for (int j = 0; j < S; ++j)
            if (mask.visible(i, j)) {
              const double pr = std::exp(sc[j] - mx) / l;
              for (int d = 0; d < D; ++d) o[d] += pr * at(v, Hkv, b, j, kvh, d);
            }
          double dl = 0;
          for (int d = 0; d < D; ++d) dl += o[d] * at(g, H, b, i, h, d);
          lse[((size_t)b * H + h) * S + i] = mx + std::log(l);
          delta[((size_t)b * H + h) * S + i] = dl;
        }
  }
  double p(int b, int h, int i, int j) const {
    return std::exp(logit(b, h, i, j) - lse[((size_t)b * H + h) * S + i]);
  }
  // dq of row i (D values).
  void dq_row(int b, int h, int i, double* out) const {
    const int kvh = h / (H / Hkv);
    for (int d = 0; d < D; ++d) out[d] = 0;
    const double dl = delta[((size_t)b * H + h) * S + i];
    for (int j = 0; j < S; ++j) {
      if (!mask.visible(i, j)) continue;
      const double ds = p(b, h, i, j) * (dp(b, h, i, j) - dl) * scale;
      for (int d = 0; d < D; ++d) out[d] += ds * at(k, Hkv, b, j, kvh, d);
    }
  }
  // dk and dv of key j of kv head kvh: sums over the group's query heads and the rows that see j.
  void dkv_col(int b, int kvh, int j, double* dk, double* dv) const {
    for (int d = 0; d < D; ++d) dk[d] = dv[d] = 0;
    const int group = H / Hkv;
    for (int h = kvh * group; h < (kvh + 1) * group; ++h)
      for (int i = 0; i < S; ++i) {
        if (!mask.visible(i, j)) continue;
        const double pr = p(b, h, i, j);
        const double ds = pr * (dp(b, h, i, j) - delta[((size_t)b * H + h) * S + i]) * scale;
        for (int d = 0; d < D; ++d) {
          dv[d] += pr * at(g, H, b, i, h, d);
          dk[d] += ds * at(q, H, b, i, h, d);
        }
      }
  }
};

// ------------------------------------------------------------------------------------ problems
template <class Elem>
struct Problem {
  Run r;
  int S, D;
  dlm::SequenceMask mask;
  size_t nq, nk;
  std::vector<Elem> hq, hk, hv, hg;
  Elem *q = nullptr, *k = nullptr, *v = nullptr, *o = nullptr, *g = nullptr, *dq = nullptr,
       *dk = nullptr, *dv = nullptr;
  float *lse = nullptr, *lse2 = nullptr, *delta = nullptr;

  Problem(Run r_, int D_) : r(r_), S(2 * r_.n), D(D_) {
    mask = r.causal ? dlm::block_causal(S, r.bs) : dlm::block_diffusion(S, r.bs);
    nq = (size_t)r.B * S * r.H * D;
    nk = (size_t)r.B * S * r.Hkv * D;
    hq.resize(nq), hk.resize(nk), hv.resize(nk), hg.resize(nq);
    // Near-normal values (sum of four uniforms, variance 1) from xorshift: std::normal_distribution
    // took seconds per timing shape (134M values), which the < 60 s default run cannot spare.
    uint64_t state = 0x9e3779b97f4a7c15ull;
    auto uniform = [&state] {
      state ^= state << 13, state ^= state >> 7, state ^= state << 17;
      return (float)(state >> 40) * (1.f / 16777216.f);
    };
    for (auto* x : {&hq, &hk, &hv, &hg})
      for (auto& e : *x) e = Elem((uniform() + uniform() + uniform() + uniform() - 2.f) * 1.7320508f);
  }
  void to_device() {
    for (Elem** p : {&q, &o, &g, &dq}) CK(cudaMalloc(p, nq * sizeof(Elem)));
    for (Elem** p : {&k, &v, &dk, &dv}) CK(cudaMalloc(p, nk * sizeof(Elem)));
    // lse2 / delta: the launchers' scratch, kVarlenScratchPad floats past B * H * S (the preprocess
    // zeroes them).
    for (float** p : {&lse, &lse2, &delta})
      CK(cudaMalloc(p, ((size_t)r.B * r.H * S + (p == &lse ? 0 : dlm::sm90::kVarlenScratchPad)) * 4));
    CK(cudaMemcpy(q, hq.data(), nq * sizeof(Elem), cudaMemcpyHostToDevice));
    CK(cudaMemcpy(k, hk.data(), nk * sizeof(Elem), cudaMemcpyHostToDevice));
    CK(cudaMemcpy(v, hv.data(), nk * sizeof(Elem), cudaMemcpyHostToDevice));
    CK(cudaMemcpy(g, hg.data(), nq * sizeof(Elem), cudaMemcpyHostToDevice));
    // NaN poison (0xffff is a NaN in bf16 and fp16): an element no kernel writes fails the check.
    CK(cudaMemset(dq, 0xff, nq * sizeof(Elem)));
    CK(cudaMemset(dk, 0xff, nk * sizeof(Elem)));
    CK(cudaMemset(dv, 0xff, nk * sizeof(Elem)));
  }
  ~Problem() {
    if (!q) return;
    for (void* p : {(void*)q, (void*)k, (void*)v, (void*)o, (void*)g, (void*)dq, (void*)dk,
                    (void*)dv, (void*)lse, (void*)lse2, (void*)delta})
      cudaFree(p);
  }
  std::vector<double> doubles(const std::vector<Elem>& x) const {
    std::vector<double> out(x.size());
    for (size_t i = 0; i < x.size(); ++i) out[i] = (double)(float)x[i];
    return out;
  }
  double scale() const { return 1.0 / std::sqrt((double)D); }
};

static std::vector<int32_t> order_of(const dlm::TilePlans& plans, int32_t** dev) {
  const int T = plans.count();
  std::vector<int64_t> area(T);
  for (int t = 0; t < T; ++t) area[t] = plans.area(t);
  std::vector<int32_t> ord(T);
  dlm::most_expensive_first(area.data(), T, ord.data());
  CK(cudaMalloc(dev, std::max(T, 1) * 4));
  CK(cudaMemcpy(*dev, ord.data(), T * 4, cudaMemcpyHostToDevice));
  return ord;
}

// The dS^T scratch's slot table (diffusion_bwd.cuh launch_bwd_ds; the Python backend builds the same
// from geometry.py: cutlass_diffusion._ds_slots): one block per visit of the dK/dV kernel, numbered
// key tile by key tile in its visit order, slots[qt * key tiles + kt], -1 where it does not visit.
// Returns the visits. key_tile: the dK/dV kernel's (bwd_block_n of the head dim).
static int ds_slot_table(const dlm::SequenceMask& mask, int key_tile, std::vector<int32_t>& slots) {
  const dlm::TilePlans plans = mask.bwd_tiles(dlm::sm90::kBwdBlockM, key_tile);
  const int k_tiles = plans.count(), q_tiles = plans.other.count();
  slots.assign(static_cast<size_t>(q_tiles) * k_tiles, -1);
  int visits = 0;
  for (int kt = 0; kt < k_tiles; ++kt) {
    const dlm::TileRuns runs = plans.runs(kt);
    for (int r = 0; r < 2; ++r)
      for (int qt = dlm::sm90::run_begin(runs, r); qt < dlm::sm90::run_end(runs, r); ++qt)
        slots[qt * k_tiles + kt] = visits++;
  }
  return visits;
}

// Forward (for O and lse), then launchers for the backward's three kernels.
template <class Elem, int D, class DkCfg, class DqCfg>
struct Bwd {
  Problem<Elem>& P;
  dlm::sm90::BwdArgs a{};
  int32_t *fwd_order = nullptr, *dkdv_order = nullptr, *dq_order = nullptr;

  explicit Bwd(Problem<Elem>& p) : P(p) {
    const Run& r = P.r;
    const int S = P.S;
    const int64_t sq[3] = {(int64_t)S * r.H * D, (int64_t)r.H * D, D};
    const int64_t sk[3] = {(int64_t)S * r.Hkv * D, (int64_t)r.Hkv * D, D};
    auto fwd_ord = order_of(P.mask.fwd_tiles(dlm::sm90::kFwdBlockM, dlm::sm90::fwd_block_n(D)), &fwd_order);
    dlm::sm90::FwdArgs f{};
    f.q = P.q, f.k = P.k, f.v = P.v, f.o = P.o, f.lse = P.lse;
    for (int i = 0; i < 3; ++i)
      f.q_stride[i] = f.o_stride[i] = sq[i], f.k_stride[i] = f.v_stride[i] = sk[i];
    f.lse_stride[0] = (int64_t)r.H * S, f.lse_stride[1] = S;
    f.batch = r.B, f.seqlen = S, f.heads = r.H, f.kv_heads = r.Hkv, f.n_noisy = P.mask.n_noisy;
    f.block_size = r.bs, f.scale = (float)P.scale(), f.tile_order = fwd_order;
    f.num_tiles = (int)fwd_ord.size(), f.stream = nullptr, f.order_chunk = g_order_chunk, f.order_block = g_order_block;
    CK((dlm::sm90::launch_fwd<Elem, D>(f)));
    CK(cudaDeviceSynchronize());

    a.q = P.q, a.k = P.k, a.v = P.v, a.o = P.o, a.dout = P.g, a.dq = P.dq, a.dk = P.dk, a.dv = P.dv;
    a.lse = P.lse, a.dlse = nullptr, a.lse2 = P.lse2, a.delta = P.delta;
    for (int i = 0; i < 3; ++i) {
      a.q_stride[i] = a.o_stride[i] = a.do_stride[i] = a.dq_stride[i] = sq[i];
      a.k_stride[i] = a.v_stride[i] = a.dk_stride[i] = a.dv_stride[i] = sk[i];
    }
    a.lse_stride[0] = (int64_t)r.H * S, a.lse_stride[1] = S;
    a.batch = r.B, a.seqlen = S, a.heads = r.H, a.kv_heads = r.Hkv, a.n_noisy = P.mask.n_noisy;
    a.block_size = r.bs, a.scale = (float)P.scale();
    const dlm::TilePlans dkdv_plans = P.mask.bwd_tiles(DkCfg::BM, DkCfg::BN);
    const std::vector<int32_t> dkdv_ord = order_of(dkdv_plans, &dkdv_order);
    a.dkdv_tiles = (int)dkdv_ord.size();
    const dlm::TilePlans dq_plans = P.mask.fwd_tiles(DqCfg::BM, DqCfg::BN);
    const std::vector<int32_t> dq_ord = order_of(dq_plans, &dq_order);
    a.dq_tiles = (int)dq_ord.size();
    a.dkdv_order = dkdv_order, a.dq_order = dq_order, a.stream = nullptr;
    a.order_chunk = g_order_chunk, a.order_block = g_order_block;
    if (DkCfg::kPersistent && g_schedule) {  // the balanced schedule of the dK/dV kernel's work order
      const int slots = r.B * r.Hkv, items = a.dkdv_tiles * slots;
      int ctas = 0;
      CK(cudaDeviceGetAttribute(&ctas, cudaDevAttrMultiProcessorCount, 0));
      if (ctas < items) {
        // Over launch_dkdv's walk (the plain order unless mode sched-l2 sets one): what the
        // extension's dkdv_schedule builds for the same order.
        const dlm::WorkOrder wo = dlm::sm90::work_order(
            slots, int64_t{2} * S * D * sizeof(Elem) * (r.H / r.Hkv), g_order_chunk, g_order_block);
        const std::vector<int32_t> sched =
            dlm::order_schedule(dkdv_plans, dkdv_ord.data(), a.dkdv_tiles, wo, r.H / r.Hkv, ctas);
        int32_t* d = nullptr;
        CK(cudaMalloc(&d, sched.size() * 4));
        CK(cudaMemcpy(d, sched.data(), sched.size() * 4, cudaMemcpyHostToDevice));
        a.dkdv_schedule = d;
      }
    }
    if constexpr (DkCfg::kStoreDs) {  // then DqCfg is a DqFromDsConfig
      if constexpr (DqCfg::kPersistent) {
        const int items = a.dq_tiles * r.B * r.H;
        int ctas = 0;
        CK(cudaDeviceGetAttribute(&ctas, cudaDevAttrMultiProcessorCount, 0));
        if (g_dq_tail_rounds >= 0 && ctas < items) {  // what the extension's ds_dq_schedule builds
          const dlm::WorkOrder wo = dlm::sm90::ds_dq_work_order(
              r.B, r.H, r.Hkv, S, D, sizeof(Elem), dlm::sm90::kDsDqOrderChunk, dlm::sm90::kDsDqOrderBlock);
          const std::vector<int32_t> sched =
              dlm::order_schedule(dq_plans, dq_ord.data(), a.dq_tiles, wo, 1, ctas, g_dq_tail_rounds);
          int32_t* d = nullptr;
          CK(cudaMalloc(&d, sched.size() * 4));
          CK(cudaMemcpy(d, sched.data(), sched.size() * 4, cudaMemcpyHostToDevice));
          a.dq_schedule = d;
        }
      }
    }
    if constexpr (DkCfg::kFusedDq) CK(cudaMalloc(&a.dq_accum, P.nq * sizeof(float)));
    if constexpr (DkCfg::kStoreDs) {  // the dS^T scratch and its slot table (bwd_dq_from_ds.cuh)
      std::vector<int32_t> slots;
      a.ds_visits = ds_slot_table(P.mask, DkCfg::BN, slots);
      int32_t* d_slots = nullptr;
      CK(cudaMalloc(&d_slots, slots.size() * 4));
      CK(cudaMemcpy(d_slots, slots.data(), slots.size() * 4, cudaMemcpyHostToDevice));
      a.ds_slots = d_slots;
      ds_bytes = (1 + (size_t)r.B * r.H * a.ds_visits) * dlm::sm90::ds_block_elems(D) * sizeof(Elem);
      CK(cudaMalloc(&a.ds_scratch, ds_bytes));
      CK(cudaMemset(a.ds_scratch, 0xff, ds_bytes));  // NaN poison: only block 0 is zeroed (all())
    }
  }
  size_t ds_bytes = 0;
  ~Bwd() {
    cudaFree(fwd_order), cudaFree(dkdv_order), cudaFree(dq_order), cudaFree(a.dq_accum);
    cudaFree((void*)a.dkdv_schedule), cudaFree((void*)a.dq_schedule);
    cudaFree(a.ds_scratch), cudaFree((void*)a.ds_slots);
    if (side) cudaStreamDestroy(side), cudaEventDestroy(pre_done), cudaEventDestroy(dq_done);
  }
  void pre() {  // as the launchers run it: the dS backward's block 0 zeroed by the preprocess too
    if constexpr (DkCfg::kStoreDs)
      CK((dlm::sm90::launch_preprocess<Elem, D>(a, a.ds_scratch, dlm::sm90::ds_block_elems(D) * sizeof(Elem))));
    else
      CK((dlm::sm90::launch_preprocess<Elem, D>(a)));
  }
  void dkdv() { CK(dlm::sm90::launch_dkdv<DkCfg>(a)); }
  void dq() {
    if constexpr (DkCfg::kStoreDs) {
      dlm::sm90::BwdArgs b = a;  // g_dq_shipped_order: the dQ kernel in launch_bwd_ds's order
      if (g_dq_shipped_order) b.order_chunk = dlm::sm90::kDsDqOrderChunk, b.order_block = dlm::sm90::kDsDqOrderBlock;
      CK(dlm::sm90::launch_dq_from_ds<DqCfg>(b));
    } else {
      CK(dlm::sm90::launch_dq<DqCfg>(a));
    }
  }
  // The fused backward (DkCfg::kFusedDq): dQ reduce-added by the dK/dV kernel, then converted.
  void all() {
    if constexpr (DkCfg::kFusedDq) {
      CK(cudaMemsetAsync(a.dq_accum, 0, P.nq * sizeof(float), a.stream));
      pre(), dkdv();
      CK((dlm::sm90::launch_convert_dq<Elem, D>(a)));
    } else {
      pre(), dkdv(), dq();
    }
  }
  // The same kernels with dQ before dK/dV (both need only the preprocess): csrc/NOTES.md session 9
  // saw the whole backward slow down at n >= 4K when the dK/dV kernel got faster.
  void all_dq_first() { pre(), dq(), dkdv(); }
  // An A/B for csrc/NOTES.md: dQ on a second stream beside dK/dV (both need only the
  // preprocess), so one kernel's tail of long CTAs overlaps the other's work.
  cudaStream_t side = nullptr;
  cudaEvent_t pre_done = nullptr, dq_done = nullptr;
  void all_two_streams() {
    if (!side) {
      CK(cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking));
      CK(cudaEventCreateWithFlags(&pre_done, cudaEventDisableTiming));
      CK(cudaEventCreateWithFlags(&dq_done, cudaEventDisableTiming));
    }
    pre();
    CK(cudaEventRecord(pre_done, nullptr));
    CK(cudaStreamWaitEvent(side, pre_done, 0));
    a.stream = side;
    dq();
    a.stream = nullptr;
    dkdv();
    CK(cudaEventRecord(dq_done, side));
    CK(cudaStreamWaitEvent(nullptr, dq_done, 0));
  }
};

struct Err {
  double max_err = 0, max_ref = 0;
  int nan = 0;
  void add(double got, double ref) {
    if (std::isnan(got)) { ++nan; return; }
    max_err = std::max(max_err, std::fabs(got - ref));
    max_ref = std::max(max_ref, std::fabs(ref));
  }
  bool ok(double tol) const { return nan == 0 && max_err <= tol * std::max(max_ref, 1e-6); }
};

template <class Elem, int D, class DkCfg, class DqCfg>
void check(const char* name, Run r) {
  Problem<Elem> P(r, D);
  P.to_device();
  Bwd<Elem, D, DkCfg, DqCfg> bwd(P);
  bwd.all();
  CK(cudaGetLastError());
  CK(cudaDeviceSynchronize());
  const int S = P.S;
  std::vector<Elem> gq(P.nq), gk(P.nk), gv(P.nk);
  CK(cudaMemcpy(gq.data(), P.dq, P.nq * sizeof(Elem), cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(gk.data(), P.dk, P.nk * sizeof(Elem), cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(gv.data(), P.dv, P.nk * sizeof(Elem), cudaMemcpyDeviceToHost));

  const auto q = P.doubles(P.hq), k = P.doubles(P.hk), v = P.doubles(P.hv), g = P.doubles(P.hg);
  Reference ref{r.B, S, r.H, r.Hkv, D, {P.mask.n_noisy, S, r.bs}, P.scale(), q, k, v, g, {}, {}};
  ref.row_stats();
  Err eq, ek, ev;
  std::vector<double> a(D), c(D);
  for (int b = 0; b < r.B; ++b) {
    for (int h = 0; h < r.H; ++h)
      for (int i = (b + h) % r.stride; i < S; i += r.stride) {
        ref.dq_row(b, h, i, a.data());
        for (int d = 0; d < D; ++d) eq.add((float)gq[(((size_t)b * S + i) * r.H + h) * D + d], a[d]);
      }
    for (int h = 0; h < r.Hkv; ++h)
      for (int j = (b + h + 1) % r.stride; j < S; j += r.stride) {
        ref.dkv_col(b, h, j, a.data(), c.data());
        for (int d = 0; d < D; ++d) {
          ek.add((float)gk[(((size_t)b * S + j) * r.Hkv + h) * D + d], a[d]);
          ev.add((float)gv[(((size_t)b * S + j) * r.Hkv + h) * D + d], c[d]);
        }
      }
  }
  const double tol = std::is_same<Elem, bf16>::value ? 2e-2 : 1e-2;
  const bool ok = eq.ok(tol) && ek.ok(tol) && ev.ok(tol);
  g_failures += !ok;
  printf("%s %s B=%d n=%d H=%d/%d bs=%d%s: dq %.4f/%.3f dk %.4f/%.3f dv %.4f/%.3f (max err / max ref)%s\n",
         ok ? "PASS" : "FAIL", name, r.B, r.n, r.H, r.Hkv, r.bs, r.causal ? " block-causal" : "",
         eq.max_err, eq.max_ref, ek.max_err, ek.max_ref, ev.max_err, ev.max_ref,
         eq.nan + ek.nan + ev.nan ? " NaN!" : "");
}

template <class Elem, int D, class DkCfg, class DqCfg>
void checks(const char* name, bool all) {
  check<Elem, D, DkCfg, DqCfg>(name, {1, 128, 2, 2, 16});
  check<Elem, D, DkCfg, DqCfg>(name, {2, 256, 4, 2, 16});
  check<Elem, D, DkCfg, DqCfg>(name, {1, 256, 2, 2, 1, true});  // causal
  check<Elem, D, DkCfg, DqCfg>(name, {1, 384, 2, 1, 300});
  if (!all) return;
  check<Elem, D, DkCfg, DqCfg>(name, {1, 256, 2, 1, 1});
  check<Elem, D, DkCfg, DqCfg>(name, {1, 256, 2, 2, 128});
  check<Elem, D, DkCfg, DqCfg>(name, {1, 384, 2, 2, 5});
  check<Elem, D, DkCfg, DqCfg>(name, {1, 256, 2, 2, 16, true});
  check<Elem, D, DkCfg, DqCfg>(name, {1, 256, 32, 8, 16, false, 3});  // GQA 32 / 8
  check<Elem, D, DkCfg, DqCfg>(name, {1, 1024, 2, 1, 16, false, 7});
}

// Milliseconds per call of f over `iters` calls (after 3 warm-up calls).
template <class F>
float time_ms(F f, int iters) {
  cudaEvent_t a, e;
  cudaEventCreate(&a), cudaEventCreate(&e);
  for (int i = 0; i < 3; ++i) f();
  cudaEventRecord(a);
  for (int i = 0; i < iters; ++i) f();
  cudaEventRecord(e);
  CK(cudaEventSynchronize(e));
  float ms = 0;
  cudaEventElapsedTime(&ms, a, e);
  cudaEventDestroy(a), cudaEventDestroy(e);
  return ms / iters;
}

// The timed shapes (bf16 D=128, 16K tokens): n = 1K..8K at bs 16, bs 4, GQA 32/8.
const Run kTimingRuns[] = {{8, 1024, 16, 16, 16}, {4, 2048, 16, 16, 16}, {2, 4096, 16, 16, 16},
                           {1, 8192, 16, 16, 16}, {8, 1024, 16, 16, 4},  {4, 2048, 32, 8, 16}};

// The timed shapes at D = 256 (the main preset's D = 256 case is n = 2K): block 16, 16K tokens.
const std::vector<Run> kTimingRuns256 = {{8, 1024, 16, 16, 16}, {4, 2048, 16, 16, 16},
                                         {1, 8192, 16, 16, 16}, {4, 2048, 32, 8, 16}};

// The whole backward and each kernel alone (bf16, D = DkCfg::D, 16K tokens; `runs`: the shapes).
// The dK/dV kernel runs 4 matmuls per tile pair, 5 at D = 256 (DkDvConfig kRoles), dQ 3.
template <class DkCfg, class DqCfg>
void timing(const char* name, const std::vector<Run>& runs = {std::begin(kTimingRuns), std::end(kTimingRuns)}) {
  constexpr int D = DkCfg::D, kDkDvMatmuls = DkCfg::kRoles ? 5 : 4;
  printf("== timing %s (bf16, D=%d, 16K tokens, TFLOPS = 2.5 * 4 * pairs * D * H / time)\n", name, D);
  for (const Run& r : runs) {
    Problem<bf16> P(r, D);
    P.to_device();
    Bwd<bf16, D, DkCfg, DqCfg> bwd(P);
    const float t_all = time_ms([&] { bwd.all(); }, 20);
    const float t_two = time_ms([&] { bwd.all_two_streams(); }, 20);
    const float t_pre = time_ms([&] { bwd.pre(); }, 20);
    const float t_dkdv = time_ms([&] { bwd.dkdv(); }, 20);
    const float t_dq = time_ms([&] { bwd.dq(); }, 20);
    CK(cudaGetLastError());
    // One matmul over the visible pairs: 2 * pairs * D * H flops. The backward counts 5 (2.5x the
    // forward's 2).
    const double matmul = 2.0 * (double)P.mask.num_pairs() * D * r.H * r.B / 1e9;
    printf("time B=%d n=%d H=%d/%d bs=%d: bwd %.3f ms = %.0f TFLOPS (preprocess %.3f ms; dK/dV %.3f ms, "
           "%.0f TFLOPS of its %d matmuls; dQ %.3f ms, %.0f TFLOPS of its 3; dQ on a second stream: "
           "%.3f ms = %.0f TFLOPS)\n",
           r.B, r.n, r.H, r.Hkv, r.bs, t_all, 5 * matmul / t_all, t_pre, t_dkdv,
           kDkDvMatmuls * matmul / t_dkdv, kDkDvMatmuls, t_dq, 3 * matmul / t_dq, t_two, 5 * matmul / t_two);
  }
}

// Mode `ds` (session 18): the backward with dS through HBM (DkDvConfig STORE_DS_ + the dQ-from-dS
// kernel, hopper/bwd_dq_from_ds.cuh) against the shipped kernels, on the same inputs: the whole
// backward of four arms (shipped with the one-CTA-per-tile and with the persistent dK/dV kernel; dS
// with the persistent dK/dV kernel staging dS^T before or behind its dV / dK matmuls) in 8 rounds,
// odd rounds in reverse order, medians; then each kernel alone. bf16, 16K tokens. arm1 names DkP
// (at D = 256, which has no persistent dK/dV kernel, the shipped one again: an A/A control).
template <class Dk, class DkP, class DkS1, class DkS2, class Dq, class DqS1, class DqS2 = DqS1>
void timing_ds(const char* arm1, const char* arm2, const char* arm3,
               const std::vector<Run>& runs = {std::begin(kTimingRuns), std::end(kTimingRuns)}) {
  constexpr int D = Dk::D;
  printf("== dS through HBM (bf16, D=%d, 16K tokens; ms, TFLOPS = 2.5 * 4 * pairs * D * H / time)\n", D);
  printf("| B | n | H/Hkv | bs | shipped | %s | dS (%s) | dS (%s) | dK/dV: shipped"
         " / %s / + dS (%s) / + dS (%s) | dQ: shipped / from dS (%s / %s) | dS scratch GB |\n", arm1, arm2,
         arm3, arm1, arm2, arm3, arm2, arm3);
  printf("|---|---|---|---|---|---|---|---|---|---|---|\n");
  for (const Run& r : runs) {
    Problem<bf16> P(r, D);
    P.to_device();
    Bwd<bf16, D, Dk, Dq> a0(P);
    Bwd<bf16, D, DkP, Dq> a1(P);
    Bwd<bf16, D, DkS1, DqS1> a2(P);
    Bwd<bf16, D, DkS2, DqS2> a3(P);
    std::vector<float> t[4];
    auto arm = [&](int i) {
      switch (i) {
        case 0: return time_ms([&] { a0.all(); }, 10);
        case 1: return time_ms([&] { a1.all(); }, 10);
        case 2: return time_ms([&] { a2.all(); }, 10);
        default: return time_ms([&] { a3.all(); }, 10);
      }
    };
    arm(0);  // warm-up
    for (int round = 0; round < 8; ++round)
      for (int j = 0; j < 4; ++j) {
        const int i = round & 1 ? 3 - j : j;
        t[i].push_back(arm(i));
      }
    float med[4];
    for (int i = 0; i < 4; ++i) {
      std::sort(t[i].begin(), t[i].end());
      med[i] = 0.5f * (t[i][3] + t[i][4]);
    }
    const float k0 = time_ms([&] { a0.dkdv(); }, 10), k1 = time_ms([&] { a1.dkdv(); }, 10);
    const float k2 = time_ms([&] { a2.dkdv(); }, 10), k3 = time_ms([&] { a3.dkdv(); }, 10);
    const float q0 = time_ms([&] { a0.dq(); }, 10), q2 = time_ms([&] { a2.dq(); }, 10);
    const float q3 = time_ms([&] { a3.dq(); }, 10);
    CK(cudaGetLastError());
    const double matmul = 2.0 * (double)P.mask.num_pairs() * D * r.H * r.B / 1e9;
    printf("| %d | %d | %d/%d | %d | %.3f (%.0f) | %.3f (%.2fx) | %.3f (%.2fx) | %.3f (%.2fx) | %.3f / %.3f / %.3f / "
           "%.3f | %.3f / %.3f / %.3f | %.2f |\n",
           r.B, r.n, r.H, r.Hkv, r.bs, med[0], 5 * matmul / med[0], med[1], med[0] / med[1], med[2],
           med[0] / med[2], med[3], med[0] / med[3], k0, k1, k2, k3, q0, q2, q3, a2.ds_bytes / 1e9);
  }
}

// Mode `sched`: the persistent dK/dV kernel walking the balanced schedule against the snake, both
// in the backward of Dk + Dq (the same inputs): the whole backward and the dK/dV kernel, 8 rounds
// in alternating order, medians; arm 2 is the snake again (an A/A control).
template <class Dk, class Dq>
void timing_schedule(const std::vector<Run>& runs = {std::begin(kTimingRuns), std::end(kTimingRuns)}) {
  constexpr int D = Dk::D;
  printf("== the dK/dV kernel's balanced schedule (bf16, D=%d, 16K tokens; ms, ratios to the snake)\n", D);
  printf("| B | n | H/Hkv | bs | snake | schedule | snake again | dK/dV: snake / schedule / again |\n");
  printf("|---|---|---|---|---|---|---|---|\n");
  for (const Run& r : runs) {
    Problem<bf16> P(r, D);
    P.to_device();
    Bwd<bf16, D, Dk, Dq> a0(P);
    g_schedule = true;
    Bwd<bf16, D, Dk, Dq> a1(P);
    g_schedule = false;
    Bwd<bf16, D, Dk, Dq> a2(P);
    Bwd<bf16, D, Dk, Dq>* arms[3] = {&a0, &a1, &a2};
    std::vector<float> t[3], k[3];
    for (int i = 0; i < 3; ++i) time_ms([&] { arms[i]->all(); }, 5);  // warm-up
    for (int round = 0; round < 8; ++round)
      for (int j = 0; j < 3; ++j) {
        const int i = round & 1 ? 2 - j : j;
        t[i].push_back(time_ms([&] { arms[i]->all(); }, 10));
        k[i].push_back(time_ms([&] { arms[i]->dkdv(); }, 10));
      }
    float med[3], kmed[3];
    for (int i = 0; i < 3; ++i) {
      std::sort(t[i].begin(), t[i].end()), std::sort(k[i].begin(), k[i].end());
      med[i] = 0.5f * (t[i][3] + t[i][4]), kmed[i] = 0.5f * (k[i][3] + k[i][4]);
    }
    CK(cudaGetLastError());
    printf("| %d | %d | %d/%d | %d | %.3f | %.3f (%.3fx) | %.3f (%.3fx) | %.3f / %.3f (%.3fx) / %.3f (%.3fx) |\n",
           r.B, r.n, r.H, r.Hkv, r.bs, med[0], med[1], med[0] / med[1], med[2], med[0] / med[2], kmed[0],
           kmed[1], kmed[0] / kmed[1], kmed[2], kmed[0] / kmed[2]);
  }
}

// Mode `pdl`: the backward's dK/dV and dQ kernels launched as programmatic dependents of the kernel
// before them (BwdArgs::dependent_launch, shipped) against plain launches, on the same inputs and
// binary: arm 0 plain, arm 1 dependent, arm 2 plain again (an A/A control). The whole backward
// (20 back to back per sample), 10 rounds in alternating order, medians, ratios to arm 0.
template <class Dk, class Dq>
void timing_dependent_launch(const char* what, const std::vector<Run>& runs) {
  constexpr int D = Dk::D;
  printf("== dependent launches, %s (bf16, D=%d, 16K tokens; whole backward ms: plain | dependent "
         "(speed) | plain again (speed))\n", what, D);
  g_schedule = Dk::kPersistent, g_dq_shipped_order = true;  // the shipped walks
  for (const Run& r : runs) {
    Problem<bf16> P(r, D);
    P.to_device();
    Bwd<bf16, D, Dk, Dq> b0(P), b1(P), b2(P);
    b0.a.dependent_launch = false, b2.a.dependent_launch = false;
    Bwd<bf16, D, Dk, Dq>* arms[3] = {&b0, &b1, &b2};
    std::vector<float> t[3];
    for (auto* b : arms) time_ms([&] { b->all(); }, 5);  // warm-up
    for (int round = 0; round < 10; ++round)
      for (int j = 0; j < 3; ++j) {
        const int i = round & 1 ? 2 - j : j;
        t[i].push_back(time_ms([&] { arms[i]->all(); }, 20));
      }
    CK(cudaGetLastError());
    float med[3];
    for (int i = 0; i < 3; ++i) {
      std::sort(t[i].begin(), t[i].end());
      med[i] = 0.5f * (t[i][4] + t[i][5]);
    }
    printf("B=%d n=%d H=%d/%d bs=%d: %.4f | %.4f (%.4fx) | %.4f (%.4fx)\n", r.B, r.n, r.H, r.Hkv, r.bs, med[0],
           med[1], med[0] / med[1], med[2], med[0] / med[2]);
  }
  g_schedule = false, g_dq_shipped_order = false;
}

// Mode `pre-bound` (session 48): what the preprocess (delta = rowsum(dO o O) - dlse, lse2) adds to
// the shipped backward's chain under dependent launches: the bound of computing delta inside the
// dK/dV kernel instead (csrc/NOTES.md Next). Arms: the whole backward | dK/dV + dQ only (delta and
// lse2 left from the warm-up's preprocess, so the results stay right) | the whole backward again
// (A/A); the preprocess alone beside them. 20 calls per sample, 10 rounds in alternating order,
// medians. Timing only.
template <class Dk, class Dq>
void timing_preprocess_bound(const std::vector<Run>& runs, int dq_tail_rounds) {
  constexpr int D = Dk::D;
  printf("== the preprocess's share (bf16, D=%d, 16K tokens; ms: whole | without the preprocess (speed) | "
         "whole again (speed) | the preprocess alone)\n", D);
  g_schedule = Dk::kPersistent, g_dq_shipped_order = true;  // the shipped walks and schedules
  g_dq_tail_rounds = dq_tail_rounds;  // the dQ-from-dS kernel's shipped schedule, or -1 (none)
  for (const Run& r : runs) {
    Problem<bf16> P(r, D);
    P.to_device();
    Bwd<bf16, D, Dk, Dq> b(P);
    auto whole = [&] { b.all(); };
    auto without = [&] { b.dkdv(), b.dq(); };
    std::vector<float> t[4];
    time_ms(whole, 5);  // warm-up; its preprocess leaves delta and lse2 for the `without` arm
    for (int round = 0; round < 10; ++round)
      for (int j = 0; j < 4; ++j) {
        const int i = round & 1 ? 3 - j : j;
        t[i].push_back(i == 1 ? time_ms(without, 20) : i == 3 ? time_ms([&] { b.pre(); }, 20)
                                                              : time_ms(whole, 20));
      }
    CK(cudaGetLastError());
    float med[4];
    for (int i = 0; i < 4; ++i) {
      std::sort(t[i].begin(), t[i].end());
      med[i] = 0.5f * (t[i][4] + t[i][5]);
    }
    printf("B=%d n=%d H=%d/%d bs=%d: %.4f | %.4f (%.4fx) | %.4f (%.4fx) | %.4f\n", r.B, r.n, r.H, r.Hkv, r.bs,
           med[0], med[1], med[0] / med[1], med[2], med[0] / med[2], med[3]);
  }
  g_schedule = false, g_dq_shipped_order = false, g_dq_tail_rounds = -1;
}

// Mode `dq-sched`: the persistent dQ-from-dS kernel walking the balanced schedule of launch_bwd_ds's
// order, handed out in walk order (tail 0) and with its last kDsDqScheduleTailRounds rounds most
// expensive first, against the snake, in the shipped backward (dK/dV on its balanced schedule):
// arms snake | tail 0 | tail rounds | snake again (A/A). Each arm's dq must equal the snake's
// bitwise (an item is one CTA's either way). The whole backward and the dQ kernel alone, 20 calls
// per sample, 10 rounds in alternating order, medians.
template <class Dk, class Dq>
void timing_dq_schedule(const std::vector<Run>& runs) {
  constexpr int D = Dk::D, tail = dlm::sm90::kDsDqScheduleTailRounds;
  printf("== the dQ-from-dS kernel's balanced schedule (bf16, D=%d, 16K tokens; ms, speed against the snake)\n", D);
  printf("| B | n | H/Hkv | bs | backward: snake | tail 0 | tail %d | snake again | dQ kernel: snake | tail 0 | "
         "tail %d | snake again |\n", tail, tail);
  printf("|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  g_schedule = Dk::kPersistent, g_dq_shipped_order = true;  // the shipped walks but the dQ kernel's
  for (const Run& r : runs) {
    Problem<bf16> P(r, D);
    P.to_device();
    const int rounds_of[4] = {-1, 0, tail, -1};
    std::vector<std::unique_ptr<Bwd<bf16, D, Dk, Dq>>> arms;
    for (int i = 0; i < 4; ++i) {
      g_dq_tail_rounds = rounds_of[i];
      arms.emplace_back(new Bwd<bf16, D, Dk, Dq>(P));
    }
    g_dq_tail_rounds = -1;
    std::vector<uint16_t> snake_dq(P.nq), dq(P.nq);
    for (int i = 0; i < 4; ++i) {
      arms[i]->all();
      CK(cudaMemcpy((i ? dq : snake_dq).data(), P.dq, P.nq * 2, cudaMemcpyDeviceToHost));
      if (i && dq != snake_dq) {
        printf("FAILED: arm %d's dq differs from the snake's (B=%d n=%d H=%d/%d)\n", i, r.B, r.n, r.H, r.Hkv);
        ++g_failures;
      }
    }
    std::vector<float> t[4], k[4];
    for (auto& b : arms) time_ms([&] { b->all(); }, 5);  // warm-up
    for (int round = 0; round < 10; ++round)
      for (int j = 0; j < 4; ++j) {
        const int i = round & 1 ? 3 - j : j;
        t[i].push_back(time_ms([&] { arms[i]->all(); }, 20));
        k[i].push_back(time_ms([&] { arms[i]->dq(); }, 20));
      }
    CK(cudaGetLastError());
    float med[4], kmed[4];
    for (int i = 0; i < 4; ++i) {
      std::sort(t[i].begin(), t[i].end()), std::sort(k[i].begin(), k[i].end());
      med[i] = 0.5f * (t[i][4] + t[i][5]), kmed[i] = 0.5f * (k[i][4] + k[i][5]);
    }
    printf("| %d | %d | %d/%d | %d | %.4f | %.4f (%.4fx) | %.4f (%.4fx) | %.4f (%.4fx) | %.4f | %.4f (%.4fx) | "
           "%.4f (%.4fx) | %.4f (%.4fx) |\n", r.B, r.n, r.H, r.Hkv, r.bs, med[0], med[1], med[0] / med[1], med[2],
           med[0] / med[2], med[3], med[0] / med[3], kmed[0], kmed[1], kmed[0] / kmed[1], kmed[2],
           kmed[0] / kmed[2], kmed[3], kmed[0] / kmed[3]);
  }
  g_schedule = false, g_dq_shipped_order = false;
}

// Mode `sched-l2`: the dS backward's dK/dV kernel in other work orders (WorkOrder chunk, block)
// walked by the balanced schedule, against the plain order's snake and schedule; the dQ kernel in
// launch_bwd_ds's order in every arm. The whole backward and the dK/dV kernel, 8 rounds in
// alternating order, medians, ratios to arm 0.
template <class Dk, class Dq>
void timing_schedule_orders() {
  constexpr int D = Dk::D;
  struct Arm { bool schedule; int chunk, block; const char* name; };
  const Arm arms[] = {{false, 0, 0, "plain, snake"}, {true, 0, 0, "plain, schedule (shipped)"},
                      {true, 1, 2, "slot-major in 2-entry blocks"}, {true, 1, 4, "slot-major in 4-entry blocks"},
                      {true, -1, 0, "L2 chunks, 4-wave blocks"}, {false, 0, 0, "plain, snake again"}};
  constexpr int kArms = sizeof(arms) / sizeof(arms[0]);
  printf("== the dK/dV kernel's order under the balanced schedule (bf16, D=%d, 16K tokens; whole backward "
         "ms and ratio to arm 0, then the dK/dV kernel's ratio)\n| B | n | H/Hkv | bs |", D);
  for (const Arm& a : arms) printf(" %s |", a.name);
  printf("\n|---|---|---|---|");
  for (int i = 0; i < kArms; ++i) printf("---|");
  printf("\n");
  g_dq_shipped_order = true;
  for (const Run& r : kTimingRuns) {
    Problem<bf16> P(r, D);
    P.to_device();
    std::vector<std::unique_ptr<Bwd<bf16, D, Dk, Dq>>> b;
    for (const Arm& a : arms) {
      g_schedule = a.schedule, g_order_chunk = a.chunk, g_order_block = a.block;
      b.emplace_back(new Bwd<bf16, D, Dk, Dq>(P));
    }
    g_schedule = false, g_order_chunk = g_order_block = 0;
    std::vector<float> t[kArms], k[kArms];
    for (int i = 0; i < kArms; ++i) time_ms([&] { b[i]->all(); }, 5);  // warm-up
    for (int round = 0; round < 8; ++round)
      for (int j = 0; j < kArms; ++j) {
        const int i = round & 1 ? kArms - 1 - j : j;
        t[i].push_back(time_ms([&] { b[i]->all(); }, 10));
        k[i].push_back(time_ms([&] { b[i]->dkdv(); }, 10));
      }
    CK(cudaGetLastError());
    float med[kArms], kmed[kArms];
    for (int i = 0; i < kArms; ++i) {
      std::sort(t[i].begin(), t[i].end()), std::sort(k[i].begin(), k[i].end());
      med[i] = 0.5f * (t[i][3] + t[i][4]), kmed[i] = 0.5f * (k[i][3] + k[i][4]);
    }
    printf("| %d | %d | %d/%d | %d |", r.B, r.n, r.H, r.Hkv, r.bs);
    for (int i = 0; i < kArms; ++i) printf(" %.3f (%.3fx; %.3fx) |", med[i], med[0] / med[i], kmed[0] / kmed[i]);
    printf("\n");
  }
  g_dq_shipped_order = false;
}

// The fused backward against the shipped two-kernel one on the same inputs, interleaved
// (shipped, fused, shipped, fused), bf16 D = 128, 16K tokens.
template <class Dk, class DkF, class Dq>
void timing_fused() {
  printf("== timing fused dQ vs shipped (bf16, D=128, 16K tokens, TFLOPS = 2.5 * 4 * pairs * D * H / time)\n");
  for (const Run& r : kTimingRuns) {
    Problem<bf16> P(r, 128);
    P.to_device();
    Bwd<bf16, 128, Dk, Dq> ship(P);
    Bwd<bf16, 128, DkF, Dq> fused(P);
    float ts = 1e9f, tf = 1e9f;
    for (int round = 0; round < 2; ++round) {
      ts = std::min(ts, time_ms([&] { ship.all(); }, 20));
      tf = std::min(tf, time_ms([&] { fused.all(); }, 20));
    }
    const float t_kernel = time_ms([&] { fused.dkdv(); }, 20);
    CK(cudaGetLastError());
    const double matmul = 2.0 * (double)P.mask.num_pairs() * 128 * r.H * r.B / 1e9;
    printf("time B=%d n=%d H=%d/%d bs=%d: shipped %.3f ms = %.0f TFLOPS; fused %.3f ms = %.0f TFLOPS "
           "(%.2fx; its dK/dV/dQ kernel %.3f ms, %.0f TFLOPS of its 5 matmuls)\n",
           r.B, r.n, r.H, r.Hkv, r.bs, ts, 5 * matmul / ts, tf, 5 * matmul / tf, ts / tf, t_kernel,
           5 * matmul / t_kernel);
  }
}

// WorkOrders (hopper/common.cuh) against the plain entry-major order on the same inputs,
// interleaved (odd rounds in reverse: a fixed order biased session 7's first A/B by up to 15 %),
// per kernel, bf16 D = 128, 16K tokens. Chunk 0: the plain order (shipped); -1: L2-sized chunks.
template <class Dk, class Dq>
void timing_orders() {
  struct { int chunk, block; const char* name; } orders[] = {
      {0, 0, "plain (shipped)"}, {-1, 1 << 30, "L2 chunk-major"}, {-1, 0, "L2 chunks, 4-wave blocks"},
      {0, 0, "plain again"}};
  constexpr int kOrders = sizeof(orders) / sizeof(orders[0]);
  printf("== timing, WorkOrders (bf16, D=128, 16K tokens; TFLOPS of the backward's 5 matmuls, of dK/dV's 4, "
         "of dQ's 3; ratios to the plain order)\n");
  for (const Run& r : kTimingRuns) {
    Problem<bf16> P(r, 128);
    P.to_device();
    Bwd<bf16, 128, Dk, Dq> bwd(P);
    float t[kOrders][3];
    for (auto& x : t) x[0] = x[1] = x[2] = 1e9f;
    for (int round = 0; round < 4; ++round)
      for (int j = 0; j < kOrders; ++j) {
        const int v = round & 1 ? kOrders - 1 - j : j;
        bwd.a.order_chunk = orders[v].chunk, bwd.a.order_block = orders[v].block;
        t[v][0] = std::min(t[v][0], time_ms([&] { bwd.all(); }, 20));
        t[v][1] = std::min(t[v][1], time_ms([&] { bwd.dkdv(); }, 20));
        t[v][2] = std::min(t[v][2], time_ms([&] { bwd.dq(); }, 20));
      }
    CK(cudaGetLastError());
    const double matmul = 2.0 * (double)P.mask.num_pairs() * 128 * r.H * r.B / 1e9;
    const auto odk = dlm::sm90::work_order(r.B * r.Hkv, int64_t{2} * P.S * 128 * 2 * (r.H / r.Hkv), -1);
    const auto odq = dlm::sm90::work_order(r.B * r.H, int64_t{2} * P.S * 128 * 2 * r.Hkv / r.H, -1);
    printf("B=%d n=%d H=%d/%d bs=%d: L2 chunks: dK/dV %d of %d slots (blocks of %d of %d entries), dQ %d of %d "
           "(blocks of %d of %d)\n", r.B, r.n, r.H, r.Hkv, r.bs, odk.chunk, odk.slots, odk.block,
           bwd.a.dkdv_tiles, odq.chunk, odq.slots, odq.block, bwd.a.dq_tiles);
    for (int v = 0; v < kOrders; ++v)
      printf("  %-18s bwd %4.0f (%.3fx)  dK/dV %4.0f (%.3fx)  dQ %4.0f (%.3fx)\n", orders[v].name,
             5 * matmul / t[v][0], t[0][0] / t[v][0], 4 * matmul / t[v][1], t[0][1] / t[v][1],
             3 * matmul / t[v][2], t[0][2] / t[v][2]);
  }
}

// The whole backward in its two kernel orders (dK/dV then dQ, as shipped; dQ then dK/dV),
// interleaved as timing_ab (bf16 D = 128, 16K tokens).
template <class Dk, class Dq>
void timing_kernel_order(const char* what) {
  printf("== timing, kernel order, %s (bf16, D=128, 16K tokens; TFLOPS of the backward's 5 matmuls: "
         "dK/dV then dQ -> dQ then dK/dV (ratio))\n", what);
  for (const Run& r : kTimingRuns) {
    Problem<bf16> P(r, 128);
    P.to_device();
    Bwd<bf16, 128, Dk, Dq> bwd(P);
    float t[2] = {1e9f, 1e9f};
    for (int round = 0; round < 6; ++round)
      for (int j = 0; j < 2; ++j) {
        if ((round & 1 ? 1 - j : j) == 0) t[0] = std::min(t[0], time_ms([&] { bwd.all(); }, 20));
        else t[1] = std::min(t[1], time_ms([&] { bwd.all_dq_first(); }, 20));
      }
    CK(cudaGetLastError());
    const double matmul = 2.0 * (double)P.mask.num_pairs() * 128 * r.H * r.B / 1e9;
    printf("B=%d n=%d H=%d/%d bs=%d: bwd %4.0f -> %4.0f (%.3fx)\n", r.B, r.n, r.H, r.Hkv, r.bs,
           5 * matmul / t[0], 5 * matmul / t[1], t[0] / t[1]);
  }
}

// Two backwards on the same inputs, alternating order (ABBA): the whole backward, the dK/dV kernel
// and the dQ kernel of each, at the configs' dtype and head dim (DkA's), 16K tokens (kTimingRuns);
// TFLOPS of the median times and the ratio of B to A. Each arm runs in two instances, allocated
// first in one phase and second in the other (3 rounds each), after one untimed round of both.
// Why: session 14's A/A controls (one instance per arm, A first, no warm-up, best of 6 rounds)
// read the second arm up to 13 % slower, identical kernels included; with both allocation orders
// (best of each arm's 6 rounds) the bias stayed in the first phase only (a/b 0.89-1.00 / 0.99-1.00).
// The likely cause: arm A's first round ran on a GPU that had idled while the host built the
// problem, before its clocks settled to the power limit, and the best-of took that sample. This
// version (warm-up, medians) compiled but did not run in session 14 (no device time left): run
// `aa` before trusting it. The two phases' ratios of the whole backward are printed (a/b: A
// allocated first / second).
template <class DkA, class DqA, class DkB, class DqB>
void timing_ab(const char* what, const char* a_name, const char* b_name,
               const std::vector<Run>& runs = {std::begin(kTimingRuns), std::end(kTimingRuns)}) {
  using Elem = typename DkA::Elem;
  constexpr int D = DkA::D;
  printf("== timing, %s (%s, D=%d, 16K tokens; TFLOPS of the backward's 5 matmuls, of dK/dV's 4 and of dQ's "
         "3: %s -> %s (ratio))\n", what, std::is_same_v<Elem, bf16> ? "bf16" : "fp16", D, a_name, b_name);
  auto median = [](std::vector<float> v) {
    std::sort(v.begin(), v.end());
    return v.size() % 2 ? v[v.size() / 2] : 0.5f * (v[v.size() / 2 - 1] + v[v.size() / 2]);
  };
  for (const Run& r : runs) {
    Problem<Elem> P(r, D);
    P.to_device();
    std::vector<float> t[2][3];                 // [A, B][bwd, dK/dV, dQ]: every round's time
    std::vector<float> phase_bwd[2][2];         // [phase][A, B]: the whole backward
    auto run = [&](auto& bwd, std::vector<float>* x, std::vector<float>* whole) {
      const float w = time_ms([&] { bwd.all(); }, 20);
      const float k = time_ms([&] { bwd.dkdv(); }, 20), q = time_ms([&] { bwd.dq(); }, 20);
      if (!whole) return;  // the warm-up round
      x[0].push_back(w), x[1].push_back(k), x[2].push_back(q), whole->push_back(w);
    };
    auto rounds = [&](auto& va, auto& vb, std::vector<float> (&whole)[2]) {
      for (int round = 0; round < 3; ++round)
        for (int j = 0; j < 2; ++j) {
          if ((round & 1 ? 1 - j : j) == 0) run(va, t[0], &whole[0]); else run(vb, t[1], &whole[1]);
        }
    };
    {
      Bwd<Elem, D, DkA, DqA> va(P);
      Bwd<Elem, D, DkB, DqB> vb(P);
      run(va, nullptr, nullptr), run(vb, nullptr, nullptr);
      rounds(va, vb, phase_bwd[0]);
    }
    {
      Bwd<Elem, D, DkB, DqB> vb(P);
      Bwd<Elem, D, DkA, DqA> va(P);
      rounds(va, vb, phase_bwd[1]);
    }
    CK(cudaGetLastError());
    float m[2][3];
    for (int arm = 0; arm < 2; ++arm)
      for (int i = 0; i < 3; ++i) m[arm][i] = median(t[arm][i]);
    const double matmul = 2.0 * (double)P.mask.num_pairs() * D * r.H * r.B / 1e9;
    printf("B=%d n=%d H=%d/%d bs=%d: bwd %4.0f -> %4.0f (%.3fx; a/b %.3f / %.3f); dK/dV %4.0f -> %4.0f (%.3fx); "
           "dQ %4.0f -> %4.0f (%.3fx)\n", r.B, r.n, r.H, r.Hkv, r.bs, 5 * matmul / m[0][0], 5 * matmul / m[1][0],
           m[0][0] / m[1][0], median(phase_bwd[0][0]) / median(phase_bwd[0][1]),
           median(phase_bwd[1][0]) / median(phase_bwd[1][1]), 4 * matmul / m[0][1], 4 * matmul / m[1][1],
           m[0][1] / m[1][1], 3 * matmul / m[0][2], 3 * matmul / m[1][2], m[0][2] / m[1][2]);
  }
}

// The reference alone on one small problem, written out for tests against torch autograd:
// header (B, S, H, Hkv, D, n_noisy, bs) as 7 int32, then q, k, v, dO, dq, dk, dv as float64.
void refdump(const char* path) {
  const Run r{1, 64, 4, 2, 8};
  const int D = 16, S = 2 * r.n;
  Problem<bf16> P(r, D);
  const auto q = P.doubles(P.hq), k = P.doubles(P.hk), v = P.doubles(P.hv), g = P.doubles(P.hg);
  Reference ref{r.B, S, r.H, r.Hkv, D, {P.mask.n_noisy, S, r.bs}, P.scale(), q, k, v, g, {}, {}};
  ref.row_stats();
  std::vector<double> dq(P.nq), dk(P.nk), dv(P.nk);
  for (int h = 0; h < r.H; ++h)
    for (int i = 0; i < S; ++i) {
      std::vector<double> row(D);
      ref.dq_row(0, h, i, row.data());
      for (int d = 0; d < D; ++d) dq[((size_t)i * r.H + h) * D + d] = row[d];
    }
  for (int h = 0; h < r.Hkv; ++h)
    for (int j = 0; j < S; ++j) {
      std::vector<double> a(D), c(D);
      ref.dkv_col(0, h, j, a.data(), c.data());
      for (int d = 0; d < D; ++d) dk[((size_t)j * r.Hkv + h) * D + d] = a[d], dv[((size_t)j * r.Hkv + h) * D + d] = c[d];
    }
  FILE* f = fopen(path, "wb");
  const int32_t hdr[7] = {r.B, S, r.H, r.Hkv, D, P.mask.n_noisy, r.bs};
  fwrite(hdr, 4, 7, f);
  const std::vector<double>* parts[] = {&q, &k, &v, &g, &dq, &dk, &dv};
  for (const std::vector<double>* x : parts) fwrite(x->data(), 8, x->size(), f);
  fclose(f);
  printf("wrote %s\n", path);
}

// ------------------------------------------------------------- odd lengths and varlen
// Sequences at packed rows [off[i], off[i] + 2 half[i]) of a (1, total, H, D) tensor (batched odd
// lengths: B equal sequences, the same memory as (B, S, H, D)). Batched (kStartAny): seqlen S,
// batch B, one mask; varlen (kStartVarlen): batch 1, one BD3 sample per sequence, work entries
// (sample, tile) from every sample, most expensive first.
struct VarSpec {
  bool varlen;
  std::vector<int> halves;  // varlen: per sample; batched: B copies of n
  int H, Hkv, bs;
  bool causal = false;      // batched only: block-causal over 2n
  int stride = 1;           // check every stride-th row / key
};

struct Entries {
  std::vector<int32_t> order, sample;
  int32_t *d_order = nullptr, *d_sample = nullptr;
  void upload() {
    const size_t n = std::max<size_t>(order.size(), 1) * 4;
    CK(cudaMalloc(&d_order, n)); CK(cudaMalloc(&d_sample, n));
    CK(cudaMemcpy(d_order, order.data(), order.size() * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(d_sample, sample.data(), sample.size() * 4, cudaMemcpyHostToDevice));
  }
  ~Entries() { cudaFree(d_order), cudaFree(d_sample); }
};

// Tiles of every sequence (plans_of(mask) gives its TilePlans), largest area first; batched: one
// sequence's tiles only (the kernels repeat them over the batch).
template <class F>
void make_entries(const std::vector<dlm::SequenceMask>& masks, bool varlen, F plans_of, Entries& e) {
  std::vector<int64_t> area; std::vector<int32_t> samp, tile;
  for (size_t i = 0; i < (varlen ? masks.size() : 1); ++i) {
    const dlm::TilePlans plans = plans_of(masks[i]);
    for (int t = 0; t < plans.count(); ++t) area.push_back(plans.area(t)), samp.push_back((int)i), tile.push_back(t);
  }
  std::vector<int32_t> ord(area.size());
  dlm::most_expensive_first(area.data(), (int)area.size(), ord.data());
  for (int32_t o : ord) e.order.push_back(tile[o]), e.sample.push_back(samp[o]);
  e.upload();
}

template <class Elem, int D, int START, bool FUSED = false, bool TMA_STORE = false, bool PERSISTENT = false,
          bool HANDOFF = false>
struct VarRun {
  using FwdCfg = dlm::sm90::FwdConfig<Elem, D, 128, dlm::sm90::fwd_block_n(D), 2, true, START>;
  using DkCfg = dlm::sm90::DkDvConfig<Elem, D, 64, dlm::sm90::bwd_block_n(D), 2, START, FUSED, TMA_STORE,
                                      PERSISTENT, HANDOFF>;
  using DqCfg = dlm::sm90::DqConfig<Elem, D, dlm::sm90::dq_block_m(D), dlm::sm90::dq_block_n(D), 2, START,
                                    TMA_STORE>;
  VarSpec v;
  std::vector<int32_t> off;                // sequence offsets (+ total)
  std::vector<dlm::SequenceMask> masks;
  int B, S, total;                          // device view: batch B of seqlen S
  size_t nq, nk;
  std::vector<Elem> hq, hk, hv, hg;
  Elem *q, *k, *v_, *o, *g, *dq, *dk, *dv;
  float *lse, *lse2, *delta;
  int32_t* d_cu = nullptr;
  Entries fwd_e, dkdv_e, dq_e;
  dlm::sm90::FwdArgs f{};
  dlm::sm90::BwdArgs a{};
  int64_t pairs = 0;

  explicit VarRun(const VarSpec& spec) : v(spec) {
    f.order_chunk = a.order_chunk = g_order_chunk;
    f.order_block = a.order_block = g_order_block;
    off.push_back(0);
    for (int h : v.halves) {
      masks.push_back(v.causal ? dlm::block_causal(2 * h, v.bs) : dlm::block_diffusion(2 * h, v.bs));
      pairs += masks.back().num_pairs();
      off.push_back(off.back() + 2 * h);
    }
    total = off.back();
    B = v.varlen ? 1 : (int)v.halves.size();
    S = v.varlen ? total : 2 * v.halves[0];
    nq = (size_t)total * v.H * D, nk = (size_t)total * v.Hkv * D;
    hq.resize(nq), hk.resize(nk), hv.resize(nk), hg.resize(nq);
    uint64_t state = 0x9e3779b97f4a7c15ull;
    auto uniform = [&state] {
      state ^= state << 13, state ^= state >> 7, state ^= state << 17;
      return (float)(state >> 40) * (1.f / 16777216.f);
    };
    for (auto* x : {&hq, &hk, &hv, &hg})
      for (auto& e : *x) e = Elem((uniform() + uniform() + uniform() + uniform() - 2.f) * 1.7320508f);
    for (Elem** p : {&q, &o, &g, &dq}) CK(cudaMalloc(p, nq * sizeof(Elem)));
    for (Elem** p : {&k, &v_, &dk, &dv}) CK(cudaMalloc(p, nk * sizeof(Elem)));
    const size_t rows = (size_t)total * v.H;
    CK(cudaMalloc(&lse, rows * 4));
    // The odd-length dK/dV kernel reads up to kVarlenScratchPad floats past the scratch, which the
    // preprocess zeroes: NaN-poisoned here, so that a pad left unzeroed fails the checks.
    for (float** p : {&lse2, &delta}) {
      CK(cudaMalloc(p, (rows + dlm::sm90::kVarlenScratchPad) * 4));
      CK(cudaMemset(*p, 0xff, (rows + dlm::sm90::kVarlenScratchPad) * 4));
    }
    CK(cudaMemcpy(q, hq.data(), nq * sizeof(Elem), cudaMemcpyHostToDevice));
    CK(cudaMemcpy(k, hk.data(), nk * sizeof(Elem), cudaMemcpyHostToDevice));
    CK(cudaMemcpy(v_, hv.data(), nk * sizeof(Elem), cudaMemcpyHostToDevice));
    CK(cudaMemcpy(g, hg.data(), nq * sizeof(Elem), cudaMemcpyHostToDevice));
    for (Elem* p : {o, dq}) CK(cudaMemset(p, 0xff, nq * sizeof(Elem)));   // NaN poison
    for (Elem* p : {dk, dv}) CK(cudaMemset(p, 0xff, nk * sizeof(Elem)));
    CK(cudaMemset(lse, 0xff, rows * 4));
    CK(cudaMalloc(&d_cu, off.size() * 4));
    CK(cudaMemcpy(d_cu, off.data(), off.size() * 4, cudaMemcpyHostToDevice));
    make_entries(masks, v.varlen, [](const dlm::SequenceMask& m) { return m.fwd_tiles(FwdCfg::BM, FwdCfg::BN); }, fwd_e);
    make_entries(masks, v.varlen, [](const dlm::SequenceMask& m) { return m.bwd_tiles(DkCfg::BM, DkCfg::BN); }, dkdv_e);
    make_entries(masks, v.varlen, [](const dlm::SequenceMask& m) { return m.fwd_tiles(DqCfg::BM, DqCfg::BN); }, dq_e);

    const int64_t sq[3] = {(int64_t)S * v.H * D, (int64_t)v.H * D, D};
    const int64_t sk[3] = {(int64_t)S * v.Hkv * D, (int64_t)v.Hkv * D, D};
    f.q = q, f.k = k, f.v = v_, f.o = o, f.lse = lse;
    for (int i = 0; i < 3; ++i) f.q_stride[i] = f.o_stride[i] = sq[i], f.k_stride[i] = f.v_stride[i] = sk[i];
    f.lse_stride[0] = (int64_t)v.H * S, f.lse_stride[1] = S;
    f.batch = B, f.seqlen = S, f.heads = v.H, f.kv_heads = v.Hkv;
    f.n_noisy = v.varlen ? 0 : masks[0].n_noisy, f.block_size = v.bs, f.scale = (float)(1.0 / std::sqrt((double)D));
    f.tile_order = fwd_e.d_order, f.num_tiles = (int)fwd_e.order.size(), f.stream = nullptr;
    f.tile_sample = fwd_e.d_sample, f.cu_seqlens = d_cu;
    a.q = q, a.k = k, a.v = v_, a.o = o, a.dout = g, a.dq = dq, a.dk = dk, a.dv = dv;
    a.lse = lse, a.dlse = nullptr, a.lse2 = lse2, a.delta = delta;
    for (int i = 0; i < 3; ++i) {
      a.q_stride[i] = a.o_stride[i] = a.do_stride[i] = a.dq_stride[i] = sq[i];
      a.k_stride[i] = a.v_stride[i] = a.dk_stride[i] = a.dv_stride[i] = sk[i];
    }
    a.lse_stride[0] = (int64_t)v.H * S, a.lse_stride[1] = S;
    a.batch = B, a.seqlen = S, a.heads = v.H, a.kv_heads = v.Hkv, a.n_noisy = f.n_noisy;
    a.block_size = v.bs, a.scale = f.scale;
    a.dkdv_order = dkdv_e.d_order, a.dkdv_tiles = (int)dkdv_e.order.size();
    a.dq_order = dq_e.d_order, a.dq_tiles = (int)dq_e.order.size();
    a.dkdv_sample = dkdv_e.d_sample, a.dq_sample = dq_e.d_sample, a.cu_seqlens = d_cu, a.stream = nullptr;
    if (FUSED) CK(cudaMalloc(&a.dq_accum, std::max<size_t>(nq, 1) * sizeof(float)));
  }
  ~VarRun() {
    for (void* p : {(void*)q, (void*)k, (void*)v_, (void*)o, (void*)g, (void*)dq, (void*)dk, (void*)dv,
                    (void*)lse, (void*)lse2, (void*)delta, (void*)d_cu, (void*)a.dq_accum})
      cudaFree(p);
  }
  void fwd() { if (f.num_tiles) CK(dlm::sm90::launch_fwd_cfg<FwdCfg>(f)); }
  void bwd() {
    if (FUSED) CK(cudaMemsetAsync(a.dq_accum, 0, std::max<size_t>(nq, 1) * sizeof(float), a.stream));
    CK((dlm::sm90::launch_preprocess<Elem, D>(a)));
    if (a.dkdv_tiles) CK(dlm::sm90::launch_dkdv<DkCfg>(a));
    if (FUSED) {
      CK((dlm::sm90::launch_convert_dq<Elem, D>(a)));
    } else if (a.dq_tiles) {
      CK(dlm::sm90::launch_dq<DqCfg>(a));
    }
  }

  // Forward (o, lse) and backward (dq, dk, dv) against the fp64 reference, sequence by sequence;
  // every element of every output is also scanned for the NaN poison.
  void check(const char* name) {
    if (total == 0) return;
    fwd(); bwd();
    CK(cudaGetLastError()); CK(cudaDeviceSynchronize());
    std::vector<Elem> go(nq), gq(nq), gk(nk), gv(nk);
    std::vector<float> gl((size_t)total * v.H);
    CK(cudaMemcpy(go.data(), o, nq * sizeof(Elem), cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(gq.data(), dq, nq * sizeof(Elem), cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(gk.data(), dk, nk * sizeof(Elem), cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(gv.data(), dv, nk * sizeof(Elem), cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(gl.data(), lse, gl.size() * 4, cudaMemcpyDeviceToHost));
    int unwritten = 0;
    for (auto* x : {&go, &gq}) for (size_t i = 0; i < nq; ++i) unwritten += std::isnan((float)(*x)[i]);
    for (auto* x : {&gk, &gv}) for (size_t i = 0; i < nk; ++i) unwritten += std::isnan((float)(*x)[i]);
    for (float x : gl) unwritten += std::isnan(x);
    Err eq, ek, ev, eo;
    std::vector<double> r1(D), r2(D);
    // lse in the device's (B, H, S) layout: sequence i, head h, position t.
    auto lse_at = [&](int i, int h, int t) {
      return v.varlen ? gl[(size_t)h * total + off[i] + t] : gl[((size_t)i * v.H + h) * S + t];
    };
    for (size_t i = 0; i < masks.size(); ++i) {
      const int len = 2 * v.halves[i];
      if (len == 0) continue;
      auto slice = [&](const std::vector<Elem>& x, int heads) {
        std::vector<double> out((size_t)len * heads * D);
        for (size_t e = 0; e < out.size(); ++e) out[e] = (double)(float)x[(size_t)off[i] * heads * D + e];
        return out;
      };
      const auto sq_ = slice(hq, v.H), sk_ = slice(hk, v.Hkv), sv_ = slice(hv, v.Hkv), sg_ = slice(hg, v.H);
      Reference ref{1, len, v.H, v.Hkv, D, {masks[i].n_noisy, len, v.bs}, 1.0 / std::sqrt((double)D),
                    sq_, sk_, sv_, sg_, {}, {}};
      ref.row_stats();
      for (int h = 0; h < v.H; ++h)
        for (int t = (int)(i + h) % v.stride; t < len; t += v.stride) {
          ref.dq_row(0, h, t, r1.data());
          // O_t = sum_j p_tj v_j (the forward's output), from the same reference.
          std::fill(r2.begin(), r2.end(), 0.0);
          for (int j = 0; j < len; ++j)
            if (ref.mask.visible(t, j)) {
              const double pr = ref.p(0, h, t, j);
              for (int d = 0; d < D; ++d) r2[d] += pr * ref.at(sv_, v.Hkv, 0, j, h / (v.H / v.Hkv), d);
            }
          const size_t row = ((size_t)off[i] + t) * v.H + h;
          for (int d = 0; d < D; ++d) {
            eq.add((float)gq[row * D + d], r1[d]);
            eo.add((float)go[row * D + d], r2[d]);
          }
          const double le = lse_at((int)i, h, t) - ref.lse[(size_t)h * len + t];
          if (!(std::fabs(le) <= 1e-3)) ++eo.nan;  // counted as a failure
        }
      for (int h = 0; h < v.Hkv; ++h)
        for (int j = (int)(i + h + 1) % v.stride; j < len; j += v.stride) {
          ref.dkv_col(0, h, j, r1.data(), r2.data());
          const size_t row = ((size_t)off[i] + j) * v.Hkv + h;
          for (int d = 0; d < D; ++d) ek.add((float)gk[row * D + d], r1[d]), ev.add((float)gv[row * D + d], r2[d]);
        }
    }
    const double tol = std::is_same<Elem, bf16>::value ? 2e-2 : 1e-2;
    const bool ok = unwritten == 0 && eo.ok(tol) && eq.ok(tol) && ek.ok(tol) && ev.ok(tol);
    g_failures += !ok;
    printf("%s %s %s H=%d/%d bs=%d%s, %zu seq (", ok ? "PASS" : "FAIL", name,
           v.varlen ? "varlen" : "batched", v.H, v.Hkv, v.bs, v.causal ? " block-causal" : "", masks.size());
    for (size_t i = 0; i < masks.size() && i < 10; ++i) printf("%s%d", i ? " " : "", v.halves[i]);
    printf("%s): o %.4f/%.3f dq %.4f/%.3f dk %.4f/%.3f dv %.4f/%.3f (max err / max ref), lse/o bad %d, unwritten %d\n",
           masks.size() > 10 ? " ..." : "", eo.max_err, eo.max_ref, eq.max_err, eq.max_ref,
           ek.max_err, ek.max_ref, ev.max_err, ev.max_ref, eo.nan, unwritten);
  }
};

template <class Elem, int D, bool FUSED = false, bool TMA_STORE = false, bool PERSISTENT = false,
          bool HANDOFF = false>
void odd_varlen_checks(const char* name) {
  using namespace dlm::sm90;
  auto batched = [](int B, int n, int H, int Hkv, int bs, bool causal = false, int stride = 1) {
    return VarSpec{false, std::vector<int>(B, n), H, Hkv, bs, causal, stride};
  };
  for (const VarSpec& s : {batched(1, 100, 2, 2, 16), batched(5, 300, 2, 1, 5, false, 5),
                           batched(1, 1000, 2, 2, 300, false, 9), batched(16, 37, 2, 1, 1),
                           batched(1, 77, 4, 2, 16, true), batched(2, 300, 2, 2, 1, true, 3),
                           batched(1, 256, 2, 2, 16),
                           // A short key tile that is FULL for a query tile (one block holds both)
                           // still needs the column mask (issue #7, n = 500 bs = 300, the forward's
                           // loop before v5); all but the last two fail fwd_mask_mirror's MODE 1.
                           batched(1, 500, 2, 1, 300, false, 5), batched(2, 180, 2, 1, 60, false, 2),
                           batched(3, 70, 2, 2, 100), batched(1, 250, 2, 1, 128, false, 2),
                           batched(4, 33, 2, 1, 40), batched(1, 200, 2, 1, 150, false, 2),
                           batched(1, 129, 2, 2, 100, false, 2)})
    VarRun<Elem, D, kStartAny, FUSED, TMA_STORE, PERSISTENT, HANDOFF>(s).check(name);
  std::vector<int> many(30);
  uint32_t st = 12345;
  for (auto& x : many) st = st * 1664525u + 1013904223u, x = (st >> 8) % 5 == 0 ? 0 : (int)((st >> 12) % 150);
  for (const VarSpec& s : {VarSpec{true, {0, 100, 37, 0, 256, 1, 300}, 4, 2, 16},
                           VarSpec{true, {5, 0, 0, 64, 129, 0}, 2, 2, 1},
                           VarSpec{true, {0, 0, 3}, 2, 1, 5},
                           VarSpec{true, {500}, 2, 1, 300, false, 5},
                           VarSpec{true, {200, 70, 0, 33, 160, 129, 250, 180, 1}, 2, 1, 100, false, 2},
                           VarSpec{true, many, 2, 1, 5, false, 2}})
    VarRun<Elem, D, kStartVarlen, FUSED, TMA_STORE, PERSISTENT, HANDOFF>(s).check(name);
}

// Forward and backward at 16K tokens (bf16 D=128 H=16 bs=16): the shipped batched kernels (Bwd),
// kStartAny on the same batch, varlen with the same samples packed (the same work), then mixed
// sample lengths (SDAR-style packing; TFLOPS on visible pairs).
void varlen_timing() {
  using namespace dlm::sm90;
  printf("== timing (bf16 D=128 H=16 bs=16, 16K tokens; fwd TFLOPS = 4 pairs D H / t, bwd 2.5x that)\n");
  auto report = [](const char* what, int64_t pairs, float tf, float tb) {
    const double mm = 2.0 * (double)pairs * 128 * 16 / 1e9;
    printf("time %-34s fwd %.3f ms = %.0f TFLOPS, bwd %.3f ms = %.0f TFLOPS\n", what, tf, 2 * mm / tf, tb, 5 * mm / tb);
  };
  for (int n : {1024, 4096}) {  // one round: the inputs take seconds to draw (< 60 s in all)
    {
      const int B = 16384 / (2 * n);
      char label[64];
      {
        Problem<bf16> P({B, n, 16, 16, 16}, 128);
        P.to_device();
        Bwd<bf16, 128, DkDvConfig<bf16, 128, kBwdBlockM, kBwdBlockN, kBwdStages>,
            DqConfig<bf16, 128, kDqBlockM, kDqBlockN, kDqStages>> bwd(P);
        FwdArgs f{};  // the shipped forward at D = 128 (what launch_fwd runs)
        const int S = P.S;
        const int64_t sq[3] = {(int64_t)S * 16 * 128, 16 * 128, 128};
        for (int i = 0; i < 3; ++i) f.q_stride[i] = f.o_stride[i] = f.k_stride[i] = f.v_stride[i] = sq[i];
        f.q = P.q, f.k = P.k, f.v = P.v, f.o = P.o, f.lse = P.lse;
        f.lse_stride[0] = (int64_t)16 * S, f.lse_stride[1] = S;
        f.batch = B, f.seqlen = S, f.heads = 16, f.kv_heads = 16, f.n_noisy = n, f.block_size = 16;
        f.scale = (float)P.scale(), f.tile_order = bwd.fwd_order, f.num_tiles = P.mask.fwd_tiles(128, 128).count();
        const float tf = time_ms([&] { CK((launch_fwd<bf16, 128>(f))); }, 20);
        const float tb = time_ms([&] { bwd.all(); }, 20);
        snprintf(label, sizeof label, "shipped B=%d n=%d:", B, n);
        report(label, P.mask.num_pairs() * B, tf, tb);
      }
      {
        VarRun<bf16, 128, kStartAny> r(VarSpec{false, std::vector<int>(B, n), 16, 16, 16});
        const float tf = time_ms([&] { r.fwd(); }, 20), tb = time_ms([&] { r.bwd(); }, 20);
        snprintf(label, sizeof label, "kStartAny B=%d n=%d:", B, n);
        report(label, r.pairs, tf, tb);
      }
      {
        VarRun<bf16, 128, kStartVarlen> r(VarSpec{true, std::vector<int>(B, n), 16, 16, 16});
        const float tf = time_ms([&] { r.fwd(); }, 20), tb = time_ms([&] { r.bwd(); }, 20);
        snprintf(label, sizeof label, "varlen %d x n=%d:", B, n);
        report(label, r.pairs, tf, tb);
      }
    }
  }
  {
    VarRun<bf16, 128, kStartAny> r(VarSpec{false, std::vector<int>(8, 1000), 16, 16, 16});
    const float tf = time_ms([&] { r.fwd(); }, 20), tb = time_ms([&] { r.bwd(); }, 20);
    report("kStartAny B=8 n=1000 (odd tiles):", r.pairs, tf, tb);
  }
  std::vector<int> mixed;  // halves in [1, 2048) until ~16K tokens
  uint32_t st = 777;
  for (int tok = 0;;) {
    st = st * 1664525u + 1013904223u;
    const int m = 1 + (int)((st >> 8) % 2047);
    if (tok + 2 * m > 16384) break;
    mixed.push_back(m), tok += 2 * m;
  }
  VarRun<bf16, 128, kStartVarlen> r(VarSpec{true, mixed, 16, 16, 16});
  const float tf = time_ms([&] { r.fwd(); }, 20), tb = time_ms([&] { r.bwd(); }, 20);
  char label[64];
  snprintf(label, sizeof label, "varlen mixed, %zu samples %d tok:", mixed.size(), r.total);
  report(label, r.pairs, tf, tb);
}

int main(int argc, char** argv) {
  setvbuf(stdout, nullptr, _IONBF, 0);
  using namespace dlm::sm90;
  const std::string mode = argc > 1 ? argv[1] : "shipped";
  if (mode == "refdump") {
    refdump(argc > 2 ? argv[2] : "bwd_reference.bin");
    return 0;
  }
  using Dk = DkDvConfig<bf16, 128, kBwdBlockM, kBwdBlockN, kBwdStages>;
  using Dq = DqConfig<bf16, 128, kDqBlockM, kDqBlockN, kDqStages>;
  if (mode == "prof") {  // the whole backward twice at n = 4K (B = 2, bs 16), for ncu: the second
    // pass sees the L2 the first left, as a training step's backward does
    Problem<bf16> P({2, 4096, 16, 16, 16}, 128);
    P.to_device();
    Bwd<bf16, 128, Dk, Dq> bwd(P);
    bwd.all(), bwd.all();
    CK(cudaDeviceSynchronize());
    return 0;
  }
  if (mode == "shipped" || mode == "check") {
    const bool all = mode == "check";
    checks<bf16, 128, Dk, Dq>("bf16 D=128", true);
    checks<fp16, 128, DkDvConfig<fp16, 128, kBwdBlockM, kBwdBlockN, kBwdStages>,
           DqConfig<fp16, 128, kDqBlockM, kDqBlockN, kDqStages>>("fp16 D=128", all);
    checks<bf16, 64, DkDvConfig<bf16, 64, kBwdBlockM, kBwdBlockN, kBwdStages>,
           DqConfig<bf16, 64, kDqBlockM, kDqBlockN, kDqStages>>("bf16 D=64", all);
    checks<fp16, 64, DkDvConfig<fp16, 64, kBwdBlockM, kBwdBlockN, kBwdStages>,
           DqConfig<fp16, 64, kDqBlockM, kDqBlockN, kDqStages>>("fp16 D=64", all);
    printf("%s: %d check(s) failed\n", g_failures ? "FAILED" : "ALL PASSED", g_failures);
  }
  if (mode == "small") {  // one small problem per head dim, e.g. under compute-sanitizer
    check<bf16, 128, Dk, Dq>("bf16 D=128", {1, 128, 2, 1, 16});
    check<fp16, 64, DkDvConfig<fp16, 64, kBwdBlockM, kBwdBlockN, kBwdStages>,
          DqConfig<fp16, 64, kDqBlockM, kDqBlockN, kDqStages>>("fp16 D=64", {1, 128, 2, 2, 5, true});
  }
  if (mode == "persistent-small") {  // the persistent dK/dV kernel with CTAs walking two items (256
    // items on an H200's 132 SMs: both K / V buffers, the release into the next item), e.g. under
    // compute-sanitizer; every 31st row and column checked
    check<bf16, 128, DkDvPersistent<bf16, 128, kStartTile>, Dq>("bf16 D=128 persistent dK/dV",
                                                                {2, 1024, 8, 8, 16, false, 31});
    check<fp16, 64, DkDvPersistent<fp16, 64, kStartTile>,
          DqConfig<fp16, 64, kDqBlockM, kDqBlockN, kDqStages>>("fp16 D=64 persistent dK/dV",
                                                                {2, 1024, 8, 8, 5, false, 31});
    printf("%s: %d check(s) failed\n", g_failures ? "FAILED" : "ALL PASSED", g_failures);
  }
  if (mode == "shipped" || mode == "time") timing<Dk, Dq>("shipped");
  if (mode == "ds" || mode == "ds-small") {  // dS through HBM (bwd_dq_from_ds.cuh): checks, then the A/B
    using DkS = DkDvStoreDs<bf16, 128, 1>;
    using DkSP = DkDvStoreDsPersistent<bf16, 128, 1>;
    using DkSP2 = DkDvStoreDsPersistent<bf16, 128, 2>;
    using DqS = DqFromDsConfig<bf16, 128>;
    if (mode == "ds-small") {  // e.g. under compute-sanitizer
      check<bf16, 128, DkS, DqS>("dS bf16 D=128", {1, 128, 2, 1, 16});
      check<bf16, 128, DkSP, DqS>("dS persistent bf16 D=128", {2, 1024, 8, 8, 16, false, 31});
      printf("%s: %d check(s) failed\n", g_failures ? "FAILED" : "ALL PASSED", g_failures);
      return g_failures != 0;
    }
    checks<bf16, 128, DkS, DqS>("dS bf16 D=128", true);
    checks<bf16, 128, DkSP, DqS>("dS persistent bf16 D=128", true);
    checks<bf16, 128, DkSP2, DqS>("dS behind, persistent bf16 D=128", true);
    checks<fp16, 128, DkDvStoreDs<fp16, 128, 2>, DqFromDsConfig<fp16, 128>>("dS behind fp16 D=128", false);
    printf("%s: %d check(s) failed\n", g_failures ? "FAILED" : "ALL PASSED", g_failures);
    if (g_failures) return 1;
    timing_ds<DkDvShipped<bf16, 128, kBatchedStart>, DkDvPersistent<bf16, 128, kBatchedStart>, DkSP, DkSP2,
              DqShipped<bf16, 128, kBatchedStart>, DqS>("persistent dK/dV", "store before", "store behind");
    return 0;
  }
  if (mode == "ds64") {  // the dS backward at D = 64 (64-query dS^T blocks, as at D = 128) against
    // the shipped D = 64 kernels (the persistent dK/dV kernel over 128-query tiles): checks, then
    // the A/B. Session 18 had it at 1.07 / 1.00 / 0.95 / 0.93x (n = 1K-8K) against that session's
    // kernels; both sides have changed since (session 41).
    using DkSP2 = DkDvStoreDsPersistent<bf16, 64, 2>;
    using DqS = DqFromDsPersistent<bf16, 64>;
    checks<bf16, 64, DkSP2, DqS>("dS behind, persistent bf16 D=64", true);
    checks<fp16, 64, DkDvStoreDsPersistent<fp16, 64, 2>, DqFromDsPersistent<fp16, 64>>("dS behind fp16 D=64", false);
    printf("%s: %d check(s) failed\n", g_failures ? "FAILED" : "ALL PASSED", g_failures);
    if (g_failures) return 1;
    timing_ds<DkDvShipped<bf16, 64, kBatchedStart>, DkDvPersistent<bf16, 64, kBatchedStart>, DkSP2, DkSP2,
              DqShipped<bf16, 64, kBatchedStart>, DqS>("persistent dK/dV (shipped)", "store behind", "store behind again");
    return 0;
  }
  if (mode == "ds-dq") {  // the dQ-from-dS kernel one CTA per item vs persistent (both after the
    // persistent dK/dV kernel storing dS behind its matmuls): checks, then the A/B
    using DkSP2 = DkDvStoreDsPersistent<bf16, 128, 2>;
    using DqP = DqFromDsConfig<bf16, 128, 3, true>;
    checks<bf16, 128, DkSP2, DqP>("dS, persistent dQ bf16 D=128", true);
    checks<fp16, 128, DkDvStoreDsPersistent<fp16, 128, 2>, DqFromDsConfig<fp16, 128, 3, true>>(
        "dS, persistent dQ fp16 D=128", false);
    check<bf16, 128, DkSP2, DqP>("dS, persistent dQ, 2 items per CTA", {2, 2048, 8, 8, 16, false, 61});
    printf("%s: %d check(s) failed\n", g_failures ? "FAILED" : "ALL PASSED", g_failures);
    if (g_failures) return 1;
    timing_ds<DkDvShipped<bf16, 128, kBatchedStart>, DkDvPersistent<bf16, 128, kBatchedStart>, DkSP2, DkSP2,
              DqShipped<bf16, 128, kBatchedStart>, DqFromDsConfig<bf16, 128>, DqP>(
        "persistent dK/dV", "dQ per item", "dQ persistent");
    return 0;
  }
  if (mode == "ds256" || mode == "ds256-small") {  // the dS backward at D = 256: the role-split
    // dK/dV kernel's dK warpgroup stores dS^T (64 x 64 blocks), the persistent dQ-from-dS kernel
    // reads it over 64-key tiles; checks, then the A/B against the shipped D = 256 kernels
    using DkS1 = DkDvStoreDs<bf16, 256, 1>;
    using DkS2 = DkDvStoreDs<bf16, 256, 2>;
    using DqS = DqFromDsPersistent<bf16, 256>;
    if (mode == "ds256-small") {  // e.g. under compute-sanitizer
      check<bf16, 256, DkS2, DqS>("dS bf16 D=256", {1, 128, 2, 1, 16});
      check<bf16, 256, DkS2, DqS>("dS bf16 D=256", {1, 256, 2, 2, 5, true});
      printf("%s: %d check(s) failed\n", g_failures ? "FAILED" : "ALL PASSED", g_failures);
      return g_failures != 0;
    }
    checks<bf16, 256, DkS2, DqS>("dS behind bf16 D=256", true);
    checks<bf16, 256, DkS1, DqS>("dS before bf16 D=256", false);
    checks<fp16, 256, DkDvStoreDs<fp16, 256, 2>, DqFromDsPersistent<fp16, 256>>("dS behind fp16 D=256", false);
    check<bf16, 256, DkS2, DqS>("dS D=256, 2 items per CTA", {2, 2048, 8, 8, 16, false, 61});
    printf("%s: %d check(s) failed\n", g_failures ? "FAILED" : "ALL PASSED", g_failures);
    if (g_failures) return 1;
    using Dk256 = DkDvShipped<bf16, 256, kBatchedStart>;
    timing_ds<Dk256, Dk256, DkS1, DkS2, DqShipped<bf16, 256, kBatchedStart>, DqS>(
        "shipped again (A/A)", "store before", "store behind", kTimingRuns256);
    return 0;
  }
  if (mode == "varlen") {
    odd_varlen_checks<bf16, 128>("bf16 D=128");
    odd_varlen_checks<fp16, 64>("fp16 D=64");
    varlen_timing();
    printf("%s: %d check(s) failed\n", g_failures ? "FAILED" : "ALL PASSED", g_failures);
    return g_failures != 0;
  }
  if (mode == "fused-any") {  // the fused A/B at the extension's batched start (kStartAny: the producer
    // of the kStartTile configs spills, session 13), after the fused checks at that start
    using DkA = DkDvConfig<bf16, 128, kBwdBlockM, kBwdBlockN, kBwdStages, kStartAny>;
    using DkFA = DkDvConfig<bf16, 128, kBwdBlockM, kBwdBlockN, kBwdStages, kStartAny, true>;
    using DqA = DqConfig<bf16, 128, kDqBlockM, kDqBlockN, kDqStages, kStartAny>;
    odd_varlen_checks<bf16, 128, true>("bf16 D=128 fused");
    printf("%s: %d check(s) failed\n", g_failures ? "FAILED" : "ALL PASSED", g_failures);
    if (g_failures) return 1;
    timing_fused<DkA, DkFA, DqA>();
    return 0;
  }
  if (mode == "fused" || mode == "fused-small" || mode == "fused-prof") {
    using DkF = DkDvConfig<bf16, 128, kBwdBlockM, kBwdBlockN, kBwdStages, kStartTile, true>;
    using DkF16 = DkDvConfig<fp16, 128, kBwdBlockM, kBwdBlockN, kBwdStages, kStartTile, true>;
    if (mode == "fused-prof") {  // one launch of each dK/dV kernel at n = 4K bs 16 B = 2, for ncu, at
      // the extension's batched start (kStartAny: the kStartTile producer spills, session 13)
      using DkA = DkDvConfig<bf16, 128, kBwdBlockM, kBwdBlockN, kBwdStages, kStartAny>;
      using DkFA = DkDvConfig<bf16, 128, kBwdBlockM, kBwdBlockN, kBwdStages, kStartAny, true>;
      using DqA = DqConfig<bf16, 128, kDqBlockM, kDqBlockN, kDqStages, kStartAny>;
      Problem<bf16> P({2, 4096, 16, 16, 16}, 128);
      P.to_device();
      Bwd<bf16, 128, DkA, DqA> ship(P);
      Bwd<bf16, 128, DkFA, DqA> fused(P);
      ship.dkdv(), fused.dkdv();
      CK(cudaDeviceSynchronize());
      return 0;
    }
    if (mode == "fused-small") {  // e.g. under compute-sanitizer
      check<bf16, 128, DkF, Dq>("bf16 D=128 fused", {1, 256, 4, 2, 16});
      VarRun<bf16, 128, kStartVarlen, true>(VarSpec{true, {0, 100, 37, 0, 130}, 2, 1, 16}).check("bf16 D=128 fused");
      return g_failures ? 1 : 0;
    }
    checks<bf16, 128, DkF, Dq>("bf16 D=128 fused", true);
    checks<fp16, 128, DkF16, DqConfig<fp16, 128, kDqBlockM, kDqBlockN, kDqStages>>("fp16 D=128 fused", true);
    odd_varlen_checks<bf16, 128, true>("bf16 D=128 fused");
    printf("%s: %d check(s) failed\n", g_failures ? "FAILED" : "ALL PASSED", g_failures);
    if (g_failures) return 1;
    timing_fused<Dk, DkF, Dq>();
  }
  if (mode == "order") {  // every order must give the same gradients; then the A/B
    for (auto [chunk, block] : {std::pair{1, 1}, std::pair{3, 2}, std::pair{0, 0}}) {
      g_order_chunk = chunk, g_order_block = block;
      printf("== order: chunk %d, block %d\n", chunk, block);
      checks<bf16, 128, Dk, Dq>("bf16 D=128", true);
      checks<fp16, 64, DkDvConfig<fp16, 64, kBwdBlockM, kBwdBlockN, kBwdStages>,
             DqConfig<fp16, 64, kDqBlockM, kDqBlockN, kDqStages>>("fp16 D=64", false);
      odd_varlen_checks<bf16, 128>("bf16 D=128");
    }
    g_order_chunk = g_order_block = 0;
    printf("%s: %d check(s) failed\n", g_failures ? "FAILED" : "ALL PASSED", g_failures);
    if (g_failures) return 1;
    timing_orders<Dk, Dq>();
  }
  if (mode == "order-time") timing_orders<Dk, Dq>();  // the A/B alone (`order` checks first)
  using DkShip = DkDvShipped<bf16, 128, kBatchedStart>;
  using DqShip = DqShipped<bf16, 128, kBatchedStart>;
  if (mode == "probe")  // what the dK / dV and dQ stores cost (timing only; the knockout's results are wrong)
    timing_ab<DkShip, DqShip, Probe<DkShip, kProbeNoStore>, Probe<DqShip, kProbeNoStore>>(
        "knockouts", "whole kernels", "no gradient stores");
  if (mode == "tma-store") {  // the TMA-store epilogues: checks (batched, odd, varlen), then the A/B
    using DkT = DkDvConfig<bf16, 128, kBwdBlockM, kBwdBlockN, kBwdStages, kStartTile, false, true>;
    using DqT = DqConfig<bf16, 128, kDqBlockM, kDqBlockN, kDqStages, kStartTile, true>;
    checks<bf16, 128, DkT, DqT>("bf16 D=128 TMA store", true);
    checks<fp16, 64, DkDvConfig<fp16, 64, kBwdBlockM, kBwdBlockN, kBwdStages, kStartTile, false, true>,
           DqConfig<fp16, 64, kDqBlockM, kDqBlockN, kDqStages, kStartTile, true>>("fp16 D=64 TMA store", true);
    odd_varlen_checks<bf16, 128, false, true>("bf16 D=128 TMA store");
    odd_varlen_checks<fp16, 64, false, true>("fp16 D=64 TMA store");
    printf("%s: %d check(s) failed\n", g_failures ? "FAILED" : "ALL PASSED", g_failures);
    if (g_failures) return 1;
    timing_ab<DkShip, DqShip, DkDvConfig<bf16, 128, kBwdBlockM, kBwdBlockN, kBwdStages, kBatchedStart, false, true>,
              DqConfig<bf16, 128, kDqBlockM, kDqBlockN, kDqStages, kBatchedStart, true>>(
        "TMA-store epilogues", "register stores (shipped)", "TMA stores");
  }
  if (mode == "persistent") {  // the persistent dK/dV kernel (TMA stores): checks, then two A/Bs
    using DkP = DkDvConfig<bf16, 128, kBwdBlockM, kBwdBlockN, kBwdStages, kStartTile, false, true, true>;
    checks<bf16, 128, DkP, Dq>("bf16 D=128 persistent dK/dV", true);
    checks<fp16, 64, DkDvConfig<fp16, 64, kBwdBlockM, kBwdBlockN, kBwdStages, kStartTile, false, true, true>,
           DqConfig<fp16, 64, kDqBlockM, kDqBlockN, kDqStages>>("fp16 D=64 persistent dK/dV", true);
    odd_varlen_checks<bf16, 128, false, true, true>("bf16 D=128 persistent dK/dV");
    odd_varlen_checks<fp16, 64, false, true, true>("fp16 D=64 persistent dK/dV");
    printf("%s: %d check(s) failed\n", g_failures ? "FAILED" : "ALL PASSED", g_failures);
    if (g_failures) return 1;
    using DkT = DkDvConfig<bf16, 128, kBwdBlockM, kBwdBlockN, kBwdStages, kBatchedStart, false, true>;
    using DkTP = DkDvConfig<bf16, 128, kBwdBlockM, kBwdBlockN, kBwdStages, kBatchedStart, false, true, true>;
    timing_ab<DkT, DqShip, DkTP, DqShip>("persistent dK/dV", "TMA-store dK/dV", "persistent TMA-store dK/dV");
    timing_ab<DkShip, DqShip, DkTP, DqShip>("persistent dK/dV", "shipped", "persistent TMA-store dK/dV");
  }
  if (mode == "aa") {  // A/A controls of timing_ab: the same configs in both arms (ratios should be 1)
    timing_ab<DkDvPersistent<bf16, 128, kBatchedStart>, DqShip, DkDvPersistent<bf16, 128, kBatchedStart>, DqShip>(
        "A/A control", "persistent dK/dV", "the same again");
    timing_ab<DkShip, DqShip, DkShip, DqShip>("A/A control", "dK/dV", "the same again");
  }
  if (mode == "kernel-order") {  // dQ before dK/dV: the shipped configs, then the persistent dK/dV
    timing_kernel_order<DkShip, DqShip>("shipped");
    timing_kernel_order<DkDvPersistent<bf16, 128, kBatchedStart>, DqShip>("persistent dK/dV");
  }
  if (mode == "persistent64") {  // the persistent dK/dV kernel at D = 64 (checked in `persistent`): A/B
    using Dk64 = DkDvShipped<bf16, 64, kBatchedStart>;
    using Dq64 = DqShipped<bf16, 64, kBatchedStart>;
    timing_ab<Dk64, Dq64, DkDvPersistent<bf16, 64, kBatchedStart>, Dq64>("persistent dK/dV", "shipped",
                                                                        "persistent TMA-store dK/dV");
  }
  if (mode == "ds-prof") {  // for ncu: the shipped dS backward (preprocess, persistent dK/dV + dS
    // store, persistent dQ from dS) twice at n = 1K (bf16, B = 8, H = 16, block 16), the second
    // pass with the L2 the first left; profile with -k regex:dq_from_ds / dkdv --launch-skip 1.
    // `ds-prof CHUNK BLOCK`: the dK/dV kernel in that WorkOrder under the balanced schedule (the
    // dQ kernel in launch_bwd_ds's order), as `sched-l2` times it.
    if (argc > 3) {
      g_order_chunk = std::atoi(argv[2]), g_order_block = std::atoi(argv[3]);
      g_schedule = g_dq_shipped_order = true;
    }
    Problem<bf16> P({8, 1024, 16, 16, 16}, 128);
    P.to_device();
    Bwd<bf16, 128, DkDvStoreDsPersistent<bf16, 128>, DqFromDsPersistent<bf16, 128>> b(P);
    b.all();
    b.all();
    CK(cudaDeviceSynchronize());
    printf("ds-prof: done\n");
    return 0;
  }
  if (mode == "ds-dq-order") {  // the dQ-from-dS kernel in L2 chunks of (batch, head) slots (its K
    // re-read from DRAM 3.5x at n = 1K, ncu session 19), the dK/dV kernel in the plain order:
    // checks with every kernel chunked, then the A/B (whole backward and the dQ kernel alone)
    using DkSP = DkDvStoreDsPersistent<bf16, 128>;
    using DqP = DqFromDsPersistent<bf16, 128>;
    g_order_chunk = -1;
    checks<bf16, 128, DkSP, DqP>("dS, L2-chunked orders, bf16 D=128", true);
    checks<bf16, 256, DkDvStoreDs<bf16, 256>, DqFromDsPersistent<bf16, 256>>("dS, L2-chunked orders, bf16 D=256",
                                                                              false);
    g_order_chunk = 0;
    printf("%s: %d check(s) failed\n", g_failures ? "FAILED" : "ALL PASSED", g_failures);
    if (g_failures) return 1;
    struct { int chunk, block; const char* name; } arms[] = {
        {0, 0, "plain (shipped)"}, {-1, 0, "dQ in L2 chunks, 4-wave blocks"}, {-1, 1 << 30, "dQ L2 chunk-major"},
        {0, 0, "plain again"}};
    constexpr int kArms = 4;
    printf("== the dQ-from-dS kernel's order (bf16 D=128, 16K tokens; ms, medians of 8 rounds, odd rounds reversed)\n");
    for (const Run& r : kTimingRuns) {
      Problem<bf16> P(r, 128);
      P.to_device();
      Bwd<bf16, 128, DkSP, DqP> bwd(P);
      std::vector<float> whole[kArms], dq[kArms];
      auto arm = [&](int i) {
        auto set = [&](int chunk, int block) { bwd.a.order_chunk = chunk, bwd.a.order_block = block; };
        whole[i].push_back(time_ms([&] {
          CK(cudaMemsetAsync(bwd.a.ds_scratch, 0, dlm::sm90::ds_block_elems(128) * 2, bwd.a.stream));
          set(0, 0), bwd.pre(), bwd.dkdv(), set(arms[i].chunk, arms[i].block), bwd.dq();
        }, 10));
        set(arms[i].chunk, arms[i].block);
        dq[i].push_back(time_ms([&] { bwd.dq(); }, 10));
        set(0, 0);
      };
      arm(0);
      whole[0].clear(), dq[0].clear();
      for (int round = 0; round < 8; ++round)
        for (int j = 0; j < kArms; ++j) arm(round & 1 ? kArms - 1 - j : j);
      CK(cudaGetLastError());
      auto med = [](std::vector<float> v) { std::sort(v.begin(), v.end()); return 0.5f * (v[3] + v[4]); };
      printf("B=%d n=%d H=%d/%d bs=%d:", r.B, r.n, r.H, r.Hkv, r.bs);
      for (int i = 0; i < kArms; ++i)
        printf("  %s: bwd %.3f (%.3fx) dQ %.3f (%.3fx);", arms[i].name, med(whole[i]), med(whole[0]) / med(whole[i]),
               med(dq[i]), med(dq[0]) / med(dq[i]));
      printf("\n");
    }
    return 0;
  }
  if (mode == "ds-l2") {  // session 45: the bound of dS^T kept in L2, both ends. Timing only (the
    // gradients are wrong). Reads: the dQ-from-dS kernel with the real slot table, and with every slot
    // v of a (batch, head) read from block v % 8 (8 x 16 KB per slot, 16 MB at 128 slots: L2-resident),
    // so its dS^T loads hit L2 where the real ones come from DRAM: what a dQ that found its dS^T in L2
    // (the switching persistent kernel of csrc/NOTES.md Next) could save at most, K loads unchanged.
    // Writes: the dK/dV kernel with every key tile's first slot 0, so its stores land in each slot's
    // first blocks (at most ~32 MB in all): what its dS^T stores' DRAM write-backs cost, the bound of
    // discarding the lines a dQ has read.
    using DkSP = DkDvStoreDsPersistent<bf16, 128>;
    using DqP = DqFromDsPersistent<bf16, 128>;
    g_dq_shipped_order = true;
    printf("== dS^T through DRAM (real slots) and kept in L2 (dq: slot %% 8; dK/dV: every first slot 0), bf16 D=128, "
           "16K tokens, us per launch, medians of 9 alternating rounds; the gradients are wrong\n");
    for (const Run& r : kTimingRuns) {
      Problem<bf16> P(r, 128);
      P.to_device();
      Bwd<bf16, 128, DkSP, DqP> bwd(P);
      bwd.all();
      CK(cudaDeviceSynchronize());
      std::vector<int32_t> slots;
      ds_slot_table(P.mask, DkSP::BN, slots);
      std::vector<int32_t> l2_read = slots, l2_write = slots;
      for (auto& v : l2_read) v = v < 0 ? v : v % 8;
      for (auto& v : l2_write) v = v < 0 ? v : 0;
      int32_t *d_read = nullptr, *d_write = nullptr;
      CK(cudaMalloc(&d_read, slots.size() * 4));
      CK(cudaMalloc(&d_write, slots.size() * 4));
      CK(cudaMemcpy(d_read, l2_read.data(), slots.size() * 4, cudaMemcpyHostToDevice));
      CK(cudaMemcpy(d_write, l2_write.data(), slots.size() * 4, cudaMemcpyHostToDevice));
      const int32_t* real = bwd.a.ds_slots;
      constexpr int kArms = 5;  // dQ real, dQ from L2, whole backward, dK/dV real, dK/dV writing into L2
      std::vector<float> t[kArms];
      for (int round = 0; round < 10; ++round)
        for (int j = 0; j < kArms; ++j) {
          const int i = round & 1 ? kArms - 1 - j : j;
          float ms;
          if (i == 2) {
            ms = time_ms([&] { bwd.all(); }, 10);
          } else if (i < 2) {
            bwd.a.ds_slots = i ? d_read : real;
            ms = time_ms([&] { bwd.dq(); }, 20);
          } else {
            bwd.a.ds_slots = i == 4 ? d_write : real;
            ms = time_ms([&] { bwd.dkdv(); }, 20);
          }
          bwd.a.ds_slots = real;
          if (round) t[i].push_back(ms);
        }
      CK(cudaGetLastError());
      for (auto& x : t) std::sort(x.begin(), x.end());
      float m[kArms];
      for (int i = 0; i < kArms; ++i) m[i] = 1e3f * t[i][4];
      printf("B=%d n=%d H=%d/%d bs=%d: dQ %.1f us from DRAM, %.1f us from L2 (%.3fx; %.1f us = %.1f %% of the "
             "backward's %.1f us); dK/dV %.1f us storing to DRAM, %.1f us into L2 (%.3fx; %.1f us = %.1f %%)\n",
             r.B, r.n, r.H, r.Hkv, r.bs, m[0], m[1], m[0] / m[1], m[0] - m[1], 100.f * (m[0] - m[1]) / m[2], m[2],
             m[3], m[4], m[3] / m[4], m[3] - m[4], 100.f * (m[3] - m[4]) / m[2]);
      cudaFree(d_read), cudaFree(d_write);
    }
    return 0;
  }
  if (mode == "ds-dq-tma" || mode == "ds-dq-tma256") {  // the dQ-from-dS kernel's TMA-store epilogue
    // (DqFromDsConfig TMA_STORE_; D = 128 measured in session 20 call 1, then shipped): checks (one
    // CTA per item and persistent, D = 128 / 256, fp16), then the A/B against the register stores,
    // both after the persistent dK/dV kernel (D = 256: after the role-split one)
    using DkSP = DkDvStoreDsPersistent<bf16, 128>;
    using DqP = DqFromDsConfig<bf16, 128, 3, true, false>;
    using DqT = DqFromDsConfig<bf16, 128, 3, true, true>;
    if (mode == "ds-dq-tma256") {
      using DkS2 = DkDvStoreDs<bf16, 256, 2>;
      checks<bf16, 256, DkS2, DqFromDsConfig<bf16, 256, 3, true, true>>("dS, dQ TMA store, bf16 D=256", true);
      printf("%s: %d check(s) failed\n", g_failures ? "FAILED" : "ALL PASSED", g_failures);
      if (g_failures) return 1;
      using Dk256 = DkDvShipped<bf16, 256, kBatchedStart>;
      timing_ds<Dk256, Dk256, DkS2, DkS2, DqShipped<bf16, 256, kBatchedStart>,
                DqFromDsConfig<bf16, 256, 3, true, false>, DqFromDsConfig<bf16, 256, 3, true, true>>(
          "shipped again (A/A)", "dQ register stores", "dQ TMA store", kTimingRuns256);
      return 0;
    }
    checks<bf16, 128, DkSP, DqT>("dS, dQ TMA store, bf16 D=128", true);
    checks<bf16, 128, DkSP, DqFromDsConfig<bf16, 128, 3, false, true>>("dS, dQ TMA store per item, bf16 D=128",
                                                                       false);
    check<bf16, 128, DkSP, DqT>("dS, dQ TMA store, 2 items per CTA", {2, 2048, 8, 8, 16, false, 61});
    checks<bf16, 256, DkDvStoreDs<bf16, 256>, DqFromDsConfig<bf16, 256, 3, true, true>>(
        "dS, dQ TMA store, bf16 D=256", false);
    checks<fp16, 128, DkDvStoreDsPersistent<fp16, 128>, DqFromDsConfig<fp16, 128, 3, true, true>>(
        "dS, dQ TMA store, fp16 D=128", false);
    printf("%s: %d check(s) failed\n", g_failures ? "FAILED" : "ALL PASSED", g_failures);
    if (g_failures) return 1;
    timing_ds<DkDvShipped<bf16, 128, kBatchedStart>, DkDvPersistent<bf16, 128, kBatchedStart>, DkSP, DkSP,
              DqShipped<bf16, 128, kBatchedStart>, DqP, DqT>("persistent dK/dV", "dQ register stores",
                                                             "dQ TMA store");
    return 0;
  }
  if (mode == "sched") {  // the persistent dK/dV kernel walking the balanced schedule: checks (the
    // dS backward at D = 128, the two-kernel one at D = 64 / 128), then the A/B against the snake
    using DkSP = DkDvStoreDsPersistent<bf16, 128>;
    using DqP = DqFromDsPersistent<bf16, 128>;
    g_schedule = true;
    checks<bf16, 128, DkSP, DqP>("dS, scheduled dK/dV, bf16 D=128", true);
    check<bf16, 128, DkSP, DqP>("dS, scheduled dK/dV, 2 items per CTA", {2, 2048, 8, 8, 16, false, 61});
    checks<bf16, 128, DkDvPersistent<bf16, 128, kBatchedStart>, DqShipped<bf16, 128, kBatchedStart>>(
        "scheduled persistent dK/dV, bf16 D=128", false);
    checks<fp16, 64, DkDvPersistent<fp16, 64, kBatchedStart>, DqShipped<fp16, 64, kBatchedStart>>(
        "scheduled persistent dK/dV, fp16 D=64", true);
    g_schedule = false;
    printf("%s: %d check(s) failed\n", g_failures ? "FAILED" : "ALL PASSED", g_failures);
    if (g_failures) return 1;
    timing_schedule<DkSP, DqP>();
    timing_schedule<DkDvPersistent<bf16, 64, kBatchedStart>, DqShipped<bf16, 64, kBatchedStart>>();
    return 0;
  }
  if (mode == "pdl") {  // dependent launches (shipped) against plain ones: checks, then the A/B
    using DkSP = DkDvStoreDsPersistent<bf16, 128>;
    using DqP = DqFromDsPersistent<bf16, 128>;
    using Dk64 = DkDvPersistent<bf16, 64, kBatchedStart>;
    using Dq64 = DqShipped<bf16, 64, kBatchedStart>;
    g_schedule = true;
    checks<bf16, 128, DkSP, DqP>("dS backward, dependent launches, bf16 D=128", true);
    checks<bf16, 64, Dk64, Dq64>("two-kernel backward, dependent launches, bf16 D=64", false);
    g_schedule = false;
    checks<bf16, 256, DkDvStoreDs<bf16, 256>, DqFromDsPersistent<bf16, 256>>(
        "dS backward, dependent launches, bf16 D=256", false);
    printf("%s: %d check(s) failed\n", g_failures ? "FAILED" : "ALL PASSED", g_failures);
    if (g_failures) return 1;
    timing_dependent_launch<DkSP, DqP>("dS backward (shipped at D = 128)", {std::begin(kTimingRuns),
                                                                            std::end(kTimingRuns)});
    timing_dependent_launch<Dk64, Dq64>("two-kernel backward (shipped at D = 64)",
                                        {{8, 1024, 16, 16, 16}, {4, 2048, 16, 16, 16}});
    timing_dependent_launch<DkDvStoreDs<bf16, 256>, DqFromDsPersistent<bf16, 256>>(
        "dS backward (shipped at D = 256)", {{4, 2048, 16, 16, 16}});
    return 0;
  }
  if (mode == "pre-bound") {  // the preprocess's share of the shipped backwards (timing only)
    timing_preprocess_bound<DkDvStoreDsPersistent<bf16, 128>, DqFromDsPersistent<bf16, 128>>(
        {std::begin(kTimingRuns), std::end(kTimingRuns)}, dlm::sm90::kDsDqScheduleTailRounds);
    timing_preprocess_bound<DkDvStoreDs<bf16, 256>, DqFromDsPersistent<bf16, 256>>(
        kTimingRuns256, dlm::sm90::kDsDqScheduleTailRounds);
    timing_preprocess_bound<DkDvPersistent<bf16, 64, kBatchedStart>, DqShipped<bf16, 64, kBatchedStart>>(
        {{8, 1024, 16, 16, 16}, {4, 2048, 16, 16, 16}}, -1);
    return 0;
  }
  if (mode == "dq-sched") {  // the dQ-from-dS kernel's balanced schedule: checks (items > SMs), then the A/B
    using DkSP = DkDvStoreDsPersistent<bf16, 128>;
    using DqP = DqFromDsPersistent<bf16, 128>;
    using Dk256 = DkDvStoreDs<bf16, 256>;
    using Dq256 = DqFromDsPersistent<bf16, 256>;
    g_schedule = true, g_dq_shipped_order = true;
    for (const int rounds : {0, dlm::sm90::kDsDqScheduleTailRounds}) {
      g_dq_tail_rounds = rounds;
      check<bf16, 128, DkSP, DqP>("dS backward, scheduled dQ, bf16 D=128", {2, 2048, 8, 8, 16, false, 61});
      check<bf16, 128, DkSP, DqP>("dS backward, scheduled dQ, GQA", {1, 1024, 16, 4, 5, false, 62});
      check<bf16, 256, Dk256, Dq256>("dS backward, scheduled dQ, bf16 D=256", {2, 1024, 8, 8, 16, false, 63});
    }
    g_dq_tail_rounds = -1, g_schedule = false, g_dq_shipped_order = false;
    printf("%s: %d check(s) failed\n", g_failures ? "FAILED" : "ALL PASSED", g_failures);
    if (g_failures) return 1;
    timing_dq_schedule<DkSP, DqP>({std::begin(kTimingRuns), std::end(kTimingRuns)});
    timing_dq_schedule<Dk256, Dq256>(kTimingRuns256);
    printf("%s: %d bitwise check(s) failed\n", g_failures ? "FAILED" : "ALL PASSED", g_failures);
    return g_failures ? 1 : 0;
  }
  if (mode == "sched-l2") {  // the dS backward's dK/dV kernel in L2-friendlier orders under the
    // balanced schedule: checks of each order, then the A/B
    using DkSP = DkDvStoreDsPersistent<bf16, 128>;
    using DqP = DqFromDsPersistent<bf16, 128>;
    g_schedule = true, g_dq_shipped_order = true;
    for (int block : {2, 4}) {
      g_order_chunk = 1, g_order_block = block;
      checks<bf16, 128, DkSP, DqP>("dS, scheduled dK/dV, slot-major blocks", false);
    }
    g_order_chunk = -1, g_order_block = 0;
    checks<bf16, 128, DkSP, DqP>("dS, scheduled dK/dV, L2 chunks", false);
    check<bf16, 128, DkSP, DqP>("dS, scheduled dK/dV, L2 chunks, 2 items per CTA", {2, 2048, 8, 8, 16, false, 61});
    g_schedule = false, g_dq_shipped_order = false, g_order_chunk = g_order_block = 0;
    printf("%s: %d check(s) failed\n", g_failures ? "FAILED" : "ALL PASSED", g_failures);
    if (g_failures) return 1;
    timing_schedule_orders<DkSP, DqP>();
    return 0;
  }
  if (mode == "ds-orders") {  // the dS backward's dK/dV kernel under the L2-chunked WorkOrders (ncu,
    // session 19: at n = 1K it runs at 68 % of DRAM bandwidth, L2 hit 38 %); the dQ-from-dS kernel
    // walks its own (entry-major) order, so its column only shows the L2 the dK/dV kernel left
    timing_orders<DkDvStoreDsPersistent<bf16, 128>, DqFromDsPersistent<bf16, 128>>();
    return 0;
  }
  if (mode == "ds-rule") {  // the dS backward with the persistent dK/dV kernel (shipped at every length)
    // against one CTA per key tile, at long halves and GQA (session 9's per-tile rule for the
    // kernels without the store: persistent up to 2048, 1024 with GQA); timing only (`ds` checks both)
    using DkS = DkDvStoreDs<bf16, 128, 2>;
    using DkSP = DkDvStoreDsPersistent<bf16, 128, 2>;
    const std::vector<Run> runs = {{2, 4096, 16, 16, 16}, {1, 8192, 16, 16, 16}, {4, 2048, 32, 8, 16},
                                   {2, 4096, 32, 8, 16}, {1, 8192, 32, 8, 16}};
    timing_ds<DkDvShipped<bf16, 128, kBatchedStart>, DkDvPersistent<bf16, 128, kBatchedStart>, DkS, DkSP,
              DqShipped<bf16, 128, kBatchedStart>, DqFromDsPersistent<bf16, 128>>(
        "persistent dK/dV", "dK/dV per key tile", "dK/dV persistent (shipped)", runs);
    return 0;
  }
  if (mode == "bm128-64") {  // D = 64: the dK/dV kernel over 128-query tiles (BM = 128: S^T / dP^T
    // 64 x 128, dK / dV 64 x 64, the same 192 accumulator registers as D = 128 at BM = 64):
    // checks, then A/Bs against the shipped BM = 64, one CTA per key tile and persistent
    using Dk64 = DkDvShipped<bf16, 64, kBatchedStart>;
    using Dq64 = DqShipped<bf16, 64, kBatchedStart>;
    using DkWide = DkDvConfig<bf16, 64, 128, kBwdBlockN, kBwdStages, kBatchedStart>;
    using DkWideP = DkDvConfig<bf16, 64, 128, kBwdBlockN, kBwdStages, kBatchedStart, false, true, true>;
    checks<bf16, 64, DkWide, Dq64>("bf16 D=64 dK/dV BM=128", true);
    checks<bf16, 64, DkWideP, Dq64>("bf16 D=64 persistent dK/dV BM=128", true);
    checks<fp16, 64, DkDvConfig<fp16, 64, 128, kBwdBlockN, kBwdStages, kBatchedStart>,
           DqShipped<fp16, 64, kBatchedStart>>("fp16 D=64 dK/dV BM=128", false);
    printf("%s: %d check(s) failed\n", g_failures ? "FAILED" : "ALL PASSED", g_failures);
    if (g_failures) return 1;
    timing_ab<Dk64, Dq64, DkWide, Dq64>("dK/dV over 128-query tiles", "shipped BM=64", "BM=128");
    timing_ab<DkDvPersistent<bf16, 64, kBatchedStart>, Dq64, DkWideP, Dq64>(
        "persistent dK/dV over 128-query tiles", "persistent BM=64", "persistent BM=128");
    return 0;
  }
  if (mode == "d256-time")  // the timing alone (`d256` checks first)
    timing<DkDvShipped<bf16, 256, kStartTile>, DqShipped<bf16, 256, kStartTile>>("D=256", kTimingRuns256);
  if (mode == "d256" || mode == "d256-small") {  // the D = 256 kernels (kRoles dK/dV, kSplitKeys dQ)
    using Dk256 = DkDvShipped<bf16, 256, kStartTile>;
    using Dq256 = DqShipped<bf16, 256, kStartTile>;
    if (mode == "d256-small") {  // e.g. under compute-sanitizer
      check<bf16, 256, Dk256, Dq256>("bf16 D=256", {1, 128, 2, 1, 16});
      VarRun<fp16, 256, kStartVarlen>(VarSpec{true, {0, 100, 37, 0, 130}, 2, 1, 16}).check("fp16 D=256");
      return g_failures ? 1 : 0;
    }
    checks<bf16, 256, Dk256, Dq256>("bf16 D=256", true);
    checks<fp16, 256, DkDvShipped<fp16, 256, kStartTile>, DqShipped<fp16, 256, kStartTile>>("fp16 D=256", false);
    odd_varlen_checks<bf16, 256>("bf16 D=256");
    printf("%s: %d check(s) failed\n", g_failures ? "FAILED" : "ALL PASSED", g_failures);
    if (g_failures) return 1;
    timing<Dk256, Dq256>("D=256", kTimingRuns256);
  }
  if (mode == "d256-handoff") {  // the role split with P^T handed to the dK warpgroup (4 matmuls, not 5)
    using Dk256 = DkDvShipped<bf16, 256, kStartTile>;
    using Dq256 = DqShipped<bf16, 256, kStartTile>;
    using DkH = DkDvConfig<bf16, 256, kBwdBlockM, 64, kBwdStages, kStartTile, false, false, false, true>;
    using DkH16 = DkDvConfig<fp16, 256, kBwdBlockM, 64, kBwdStages, kStartTile, false, false, false, true>;
    checks<bf16, 256, DkH, Dq256>("bf16 D=256 P^T hand-over", true);
    checks<fp16, 256, DkH16, DqShipped<fp16, 256, kStartTile>>("fp16 D=256 P^T hand-over", false);
    odd_varlen_checks<bf16, 256, false, false, false, true>("bf16 D=256 P^T hand-over");
    printf("%s: %d check(s) failed\n", g_failures ? "FAILED" : "ALL PASSED", g_failures);
    if (g_failures) return 1;
    timing_ab<Dk256, Dq256, DkH, Dq256>("P^T hand-over", "role split (shipped)", "P^T hand-over", kTimingRuns256);
  }
  if (mode == "d256-handoff-small") {  // e.g. under compute-sanitizer (racecheck: the hand-over buffers)
    using DkH = DkDvConfig<bf16, 256, kBwdBlockM, 64, kBwdStages, kStartTile, false, false, false, true>;
    check<bf16, 256, DkH, DqShipped<bf16, 256, kStartTile>>("bf16 D=256 P^T hand-over", {1, 256, 2, 1, 16});
    return g_failures ? 1 : 0;
  }
  if (mode == "dkdv3") {
    using Dk3 = DkDvConfig<bf16, 128, kBwdBlockM, kBwdBlockN, 3>;
    checks<bf16, 128, Dk3, Dq>("bf16 D=128, dK/dV 3 stages", false);
    timing<Dk3, Dq>("dK/dV 3 stages");
  }
  if (mode == "dq64") {
    using Dq64 = DqConfig<bf16, 128, kDqBlockM, 64, kDqStages>;
    checks<bf16, 128, Dk, Dq64>("bf16 D=128, dQ over 64-key tiles", false);
    timing<Dk, Dq64>("dQ over 64-key tiles");
  }
  return g_failures ? 1 : 0;
}
