// Standalone check + timing of csrc/hopper/block_sparse_fwd.cuh (issue #5) without torch: random
// inputs, an fp64 CPU reference on sampled rows (random ascending lists incl. empty ones and all
// blocks, Sq / Sk not multiples of 128, GQA 32/8 and 4/4, bf16 and fp16, D 64 / 128, a work order,
// NaN-poisoned outputs; the column form: per-(batch, head) key lengths key_len incl. 0, 1, 127,
// 128, 129 and Sk over the shared arange list, as the column-sparse forward passes them), then
// CUDA-event timing at the benchmark's shapes (B = 1, H = 32/8, D = 128,
// S = 16K / 32K / 64K, densities 0.1 / 0.3 / 0.5 / 1.0; per (head, query block) a uniformly random
// ascending set of round(density * nKb) key blocks, as benchmarks/sparse.py builds them; the
// column-sparse form also with its gather, hopper/column_gather.cuh, alone and before it). Build
// (nvcc >= 12.3, CUTLASS headers from the nvidia-cutlass wheel) and run on an H100/H200:
//   nvcc -gencode=arch=compute_90a,code=sm_90a -std=c++17 -O3 --expt-relaxed-constexpr \
//     -I<cutlass_library/source/include> -Icsrc/include -Icsrc \
//     -o sparse_fwd tests/cuda/block_sparse_fwd_standalone.cu csrc/hopper/block_sparse_fwd_*.cu
//   ./sparse_fwd          # check + time; exit 1 on a failed check
//   ./sparse_fwd check    # the checks only
//   ./sparse_fwd time     # the timing table only
//   ./sparse_fwd small    # one small check per (dtype, head dim), for compute-sanitizer
//   ./sparse_fwd probe    # what the O / lse stores cost per item (knockout, timing only)
//   ./sparse_fwd stages-ab  # a third K / V stage in the O staging's shared memory: checks + A/B
//   ./sparse_fwd waves    # 16K / 10 % at H = 28..36: does time follow the persistent grid's waves?
//   ./sparse_fwd softmax-ab  # FwdConfig SOFTMAX_ILP_ / STALE_MAX_ (the softmax in four chains, the
//                         # O rescale skipped while the max is stale): checks + A/B
//   ./sparse_fwd end-ab   # the item's end: two Q buffers, the first S without a turn, the O store
//                         # knocked out (checks + A/B, then the trace; `epi-ab` until session 38)
//   ./sparse_fwd end-ab64 # the same at D = 64 (shipped: one Q, strict turns): checks + A/B
//   ./sparse_fwd split-ab # the split tail (the last round's items in parts): checks + A/B
//   ./sparse_fwd column-ab  # the column form's kernel against the block form's at equal tiles:
//                         # the masked last tile, key_len (timing only)
//   ./sparse_fwd trace    # where an item's time goes: clock64 stamps at fixed points of each item
//                         # (common.cuh Traced), per-phase means in microseconds at four shapes
//   ./sparse_fwd prof     # one persistent launch at 16K, density 0.1 and 0.5, for ncu: the kernel's
//                         # 6th and 12th launches (ncu --launch-skip 5 / 11 --launch-count 1)
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include <cuda_runtime.h>

#include "hopper/block_sparse_fwd.cuh"
#include "hopper/column_gather.cuh"
#include "trace_stats.h"

#define CK(...) do { cudaError_t err_ = (__VA_ARGS__); if (err_ != cudaSuccess) { printf("CUDA error %s at %s:%d\n", cudaGetErrorString(err_), __FILE__, __LINE__); exit(1); } } while (0)

using bf16 = cutlass::bfloat16_t;
using fp16 = cutlass::half_t;
constexpr int kBlock = 128;
int g_failed = 0;

// The config the checks and the `time` table's launches run: the shipped one, or (-DSPARSE_SMEM_O=0)
// the same with the register-store epilogue (hopper/attn_common.cuh FwdConfig), for an A/B of two
// builds.
#ifndef SPARSE_SMEM_O
#define SPARSE_SMEM_O 1
#endif
template <class Elem, int D>
using HarnessCfg = std::conditional_t<
    SPARSE_SMEM_O != 0, dlm::sm90::SparseFwdConfig<Elem, D>,
    dlm::sm90::FwdConfig<Elem, D, 128, 128, 2, true, dlm::sm90::kStartTile, 1, false, true, dlm::sm90::fwd_stale_max(D)>>;

// Dense cuDNN SDPA (non-causal) on the H200 at B = 1, H = 32/8, D = 128 (benchmarks/results/
// h200_sparse_quick.md): the denominator of the goal, time / (dense time x density) <= 1.15.
double dense_cudnn_ms(int s) { return s == 16384 ? 6.53 : s == 32768 ? 28.45 : s == 65536 ? 115.78 : 0; }

// Key block lists, (B, H, nQb, max_blocks) with counts (B, H, nQb); entries past a count are -1.
// With key lengths (lens, per (b, h)): the lists name blocks below ceil(len / 128) only, and
// `shared` is one list 0 .. nKb - 1 (max_blocks entries) that every item reads, its count
// ceil(len / 128): the column-sparse forward's form.
struct Pattern {
  int nqb, nkb, max_blocks;
  std::vector<int32_t> idx, cnt, lens;
  bool shared = false;
};

// kind "mix": per list empty (15 %), all blocks (15 %) or a random subset of random size;
// kind "density": round(density * nKb) random blocks everywhere. key_len: the column form, a
// length per (b, h) (cycling through 0, 1, 127, 128, 129, Sk and random ones), one shared list
// 0 .. nKb - 1 and every item's count ceil(len / 128) (kind and density unused).
Pattern make_pattern(int B, int H, int sq, int sk, const char* kind, double density, int pad, std::mt19937& g,
                     bool key_len = false) {
  Pattern p;
  p.nqb = (sq + kBlock - 1) / kBlock;
  p.nkb = (sk + kBlock - 1) / kBlock;
  p.max_blocks = p.nkb + pad;
  p.shared = key_len;
  const size_t lists = (size_t)B * H * p.nqb;
  if (key_len) {
    const int fixed[] = {0, 1, 127, 128, 129, sk};
    for (int bh = 0; bh < B * H; ++bh)
      p.lens.push_back(std::min(sk, bh < 6 ? fixed[bh] : (int)(g() % (sk + 1))));
  }
  p.idx.assign(p.shared ? p.max_blocks : lists * p.max_blocks, -1);
  p.cnt.assign(lists, 0);
  std::vector<int32_t> all(p.nkb);
  std::iota(all.begin(), all.end(), 0);
  if (p.shared) std::copy(all.begin(), all.end(), p.idx.begin());
  std::uniform_real_distribution<double> u;
  for (size_t l = 0; l < lists; ++l) {
    // blocks this list may name: all of them, or those below ceil(len / 128)
    const int avail = key_len ? (p.lens[l / p.nqb] + kBlock - 1) / kBlock : p.nkb;
    if (p.shared) {
      p.cnt[l] = avail;
      continue;
    }
    int n;
    if (!strcmp(kind, "density")) {
      n = (int)std::lround(density * avail);
    } else {
      const double r = u(g);
      n = r < 0.15 ? 0 : r < 0.3 ? avail : (int)(g() % (avail + 1));
    }
    for (int i = 0; i < n; ++i) std::swap(all[i], all[i + g() % (avail - i)]);  // partial shuffle
    std::sort(all.begin(), all.begin() + n);
    std::copy(all.begin(), all.begin() + n, p.idx.begin() + l * p.max_blocks);
    p.cnt[l] = n;
  }
  return p;
}

template <class Elem>
__global__ void fill_random(Elem* x, size_t n, uint32_t seed) {  // triangular, unit variance, cheap
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    uint32_t h = (uint32_t)i * 2654435761u ^ seed;
    h ^= h >> 15; h *= 2246822519u; h ^= h >> 13; h *= 3266489917u; h ^= h >> 16;
    x[i] = Elem((((h & 0xffff) + (h >> 16)) * (1.f / 65536.f) - 1.f) * 2.45f);
  }
}

struct Case {
  int B, sq, sk, H, Hkv;
  const char* kind;
  double density;
  int pad;          // max_blocks - nKb
  bool order;       // pass a work order (longest list first)
  int ctas = 0;     // > 0: a persistent grid of this many CTAs (the timing's A/B), else one per item
  bool key_len = false;  // the column form: a key length per (b, h), the shared arange list
  int split = 0;    // > 0 (with ctas > 0): the split tail, up to this many parts per item
};

// The split tail's scratch (SparseFwdArgs::split_*), sized for D <= 128 and up to 1024 CTAs, and
// set up as the binding does per call: the counters zeroed on the launch's stream first.
void use_split(dlm::sm90::SparseFwdArgs& a, int parts, int ctas) {
  static float* partials = nullptr;
  static int32_t* counters = nullptr;
  constexpr int kMaxCtas = 1024;
  if (!partials) {
    CK(cudaMalloc(&partials, dlm::sm90::split_scratch_floats(128, kMaxCtas) * sizeof(float)));
    CK(cudaMalloc(&counters, 2 * kMaxCtas * sizeof(int32_t)));
  }
  if (ctas > kMaxCtas) { printf("use_split: at most %d CTAs\n", kMaxCtas); exit(1); }
  a.split_parts = parts;
  a.split_partials = partials;
  a.split_counters = counters;
  if (parts > 0) CK(cudaMemsetAsync(counters, 0, 2 * ctas * sizeof(int32_t), a.stream));
}

template <class Elem, int D>
struct Bufs {
  Elem *q = nullptr, *k = nullptr, *v = nullptr, *o = nullptr;
  float* lse = nullptr;
  int32_t *idx = nullptr, *cnt = nullptr, *order = nullptr, *lens = nullptr;
  dlm::sm90::SparseFwdArgs args{};
  void alloc(const Case& c, const Pattern& p) {
    const size_t nq = (size_t)c.B * c.sq * c.H * D, nk = (size_t)c.B * c.sk * c.Hkv * D;
    CK(cudaMalloc(&q, nq * sizeof(Elem))); CK(cudaMalloc(&o, nq * sizeof(Elem)));
    CK(cudaMalloc(&k, std::max<size_t>(nk, 1) * sizeof(Elem))); CK(cudaMalloc(&v, std::max<size_t>(nk, 1) * sizeof(Elem)));
    CK(cudaMalloc(&lse, (size_t)c.B * c.H * c.sq * 4));
    CK(cudaMalloc(&idx, p.idx.size() * 4)); CK(cudaMalloc(&cnt, p.cnt.size() * 4)); CK(cudaMalloc(&order, p.cnt.size() * 4));
    CK(cudaMemcpy(idx, p.idx.data(), p.idx.size() * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(cnt, p.cnt.data(), p.cnt.size() * 4, cudaMemcpyHostToDevice));
    if (!p.lens.empty()) {
      CK(cudaMalloc(&lens, p.lens.size() * 4));
      CK(cudaMemcpy(lens, p.lens.data(), p.lens.size() * 4, cudaMemcpyHostToDevice));
    }
    std::vector<int32_t> ord(p.cnt.size());
    std::iota(ord.begin(), ord.end(), 0);
    std::stable_sort(ord.begin(), ord.end(), [&](int a, int b) { return p.cnt[a] > p.cnt[b]; });
    CK(cudaMemcpy(order, ord.data(), ord.size() * 4, cudaMemcpyHostToDevice));
    auto& a = args;
    a.q = q; a.k = k; a.v = v; a.o = o; a.lse = lse;
    const int64_t sq[3] = {(int64_t)c.sq * c.H * D, (int64_t)c.H * D, D};
    const int64_t sk[3] = {(int64_t)c.sk * c.Hkv * D, (int64_t)c.Hkv * D, D};
    std::copy(sq, sq + 3, a.q_stride); std::copy(sq, sq + 3, a.o_stride);
    std::copy(sk, sk + 3, a.k_stride); std::copy(sk, sk + 3, a.v_stride);
    a.lse_stride[0] = (int64_t)c.H * c.sq; a.lse_stride[1] = c.sq;
    a.batch = c.B; a.seqlen_q = c.sq; a.seqlen_k = c.sk; a.heads = c.H; a.kv_heads = c.Hkv;
    a.block_q = a.block_k = kBlock;
    a.kv_block_indices = idx; a.kv_block_counts = cnt; a.num_q_blocks = p.nqb; a.max_blocks = p.max_blocks;
    a.scale = (float)(1.0 / std::sqrt((double)D));
    a.work_order = c.order ? order : nullptr;
    a.stream = 0;
    a.shared_list = p.shared;
    a.key_len = lens;  // null without key lengths
  }
  void poison(const Case& c) {  // 0xff bytes: NaN in bf16, fp16 and fp32
    CK(cudaMemset(o, 0xff, (size_t)c.B * c.sq * c.H * D * sizeof(Elem)));
    CK(cudaMemset(lse, 0xff, (size_t)c.B * c.H * c.sq * 4));
  }
  ~Bufs() { cudaFree(q); cudaFree(k); cudaFree(v); cudaFree(o); cudaFree(lse); cudaFree(idx); cudaFree(cnt); cudaFree(order); cudaFree(lens); }
};

template <class Elem, int D, class Cfg = HarnessCfg<Elem, D>>
void check(const Case& c, const char* name) {
  std::mt19937 g(c.sq * 7919 + c.sk * 31 + c.H + D);
  const Pattern p = make_pattern(c.B, c.H, c.sq, c.sk, c.kind, c.density, c.pad, g, c.key_len);
  Bufs<Elem, D> b;
  b.alloc(c, p);
  const size_t nq = (size_t)c.B * c.sq * c.H * D, nk = (size_t)c.B * c.sk * c.Hkv * D;
  std::vector<Elem> hq(nq), hk(nk), hv(nk);
  std::normal_distribution<float> nd;
  for (auto& x : hq) x = Elem(nd(g));
  for (auto& x : hk) x = Elem(nd(g));
  for (auto& x : hv) x = Elem(nd(g));
  CK(cudaMemcpy(b.q, hq.data(), nq * sizeof(Elem), cudaMemcpyHostToDevice));
  if (nk) {
    CK(cudaMemcpy(b.k, hk.data(), nk * sizeof(Elem), cudaMemcpyHostToDevice));
    CK(cudaMemcpy(b.v, hv.data(), nk * sizeof(Elem), cudaMemcpyHostToDevice));
  }
  b.poison(c);
  if (c.split) use_split(b.args, c.split, c.ctas);
  if (c.ctas > 0 || !std::is_same_v<Cfg, HarnessCfg<Elem, D>>)
    CK(dlm::sm90::launch_block_sparse_fwd_cfg<Cfg>(b.args, c.ctas));
  else
    CK(dlm::sm90::launch_block_sparse_fwd<Elem, D>(b.args));
  CK(cudaDeviceSynchronize());
  std::vector<Elem> ho(nq);
  std::vector<float> hl((size_t)c.B * c.H * c.sq);
  CK(cudaMemcpy(ho.data(), b.o, nq * sizeof(Elem), cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(hl.data(), b.lse, hl.size() * 4, cudaMemcpyDeviceToHost));

  const double tol = std::is_same<Elem, bf16>::value ? 0.03 : 0.01;
  double max_err = 0, max_lse_err = 0;
  long bad = 0, rows = 0, empty_rows = 0;
  const int step = c.sq > 400 ? 7 : 1;
  std::vector<double> sc;
  std::vector<int> keys;
  for (int bb = 0; bb < c.B; ++bb)
    for (int h = 0; h < c.H; ++h) {
      const int kvh = h / (c.H / c.Hkv);
      for (int i = 0; i < c.sq; ++i) {
        const bool edge = i % kBlock == kBlock - 1 || i % kBlock == 0 || i == c.sq - 1;
        if (i % step && !edge) continue;
        ++rows;
        const size_t l = ((size_t)bb * c.H + h) * p.nqb + i / kBlock;
        const int len = p.lens.empty() ? c.sk : p.lens[(size_t)bb * c.H + h];  // keys [0, len)
        const int32_t* list = &p.idx[p.shared ? 0 : l * p.max_blocks];
        keys.clear();
        for (int t = 0; t < p.cnt[l]; ++t) {
          const int kb = list[t];
          for (int j = kb * kBlock; j < std::min(len, (kb + 1) * kBlock); ++j) keys.push_back(j);
        }
        const float got_lse = hl[((size_t)bb * c.H + h) * c.sq + i];
        const Elem* orow = &ho[(((size_t)bb * c.sq + i) * c.H + h) * D];
        if (keys.empty()) {  // out 0, lse -inf exactly
          ++empty_rows;
          bool ok = got_lse == -INFINITY;
          for (int d = 0; d < D; ++d) ok &= (float)orow[d] == 0.f;
          bad += !ok;
          if (!ok) max_err = std::max(max_err, 1e9);
          continue;
        }
        sc.resize(keys.size());
        double mx = -1e300;
        for (size_t t = 0; t < keys.size(); ++t) {
          double acc = 0;
          const Elem* qr = &hq[(((size_t)bb * c.sq + i) * c.H + h) * D];
          const Elem* kr = &hk[(((size_t)bb * c.sk + keys[t]) * c.Hkv + kvh) * D];
          for (int d = 0; d < D; ++d) acc += (double)(float)qr[d] * (double)(float)kr[d];
          sc[t] = acc / std::sqrt((double)D);
          mx = std::max(mx, sc[t]);
        }
        double sum = 0;
        for (auto& s : sc) sum += (s = std::exp(s - mx));
        for (int d = 0; d < D; ++d) {
          double acc = 0;
          for (size_t t = 0; t < keys.size(); ++t)
            acc += sc[t] * (double)(float)hv[(((size_t)bb * c.sk + keys[t]) * c.Hkv + kvh) * D + d];
          const double e = std::fabs((double)(float)orow[d] - acc / sum);
          if (!(e <= tol)) ++bad;
          max_err = std::max(max_err, std::isnan(e) ? 1e9 : e);
        }
        const double le = std::fabs(got_lse - (mx + std::log(sum)));
        max_lse_err = std::max(max_lse_err, std::isnan(le) ? 1e9 : le);
      }
    }
  long unwritten = 0;  // every element is written: no poison left anywhere
  for (auto& x : ho) unwritten += std::isnan((float)x);
  for (float x : hl) unwritten += std::isnan(x);
  const bool ok = bad == 0 && max_lse_err <= 1e-3 && unwritten == 0;
  g_failed += !ok;
  printf("%s %s D=%d B=%d Sq=%d Sk=%d H=%d/%d %s%s%s pad %d ctas %d split %d: %ld rows (%ld empty), max |out err| %.4f, max |lse err| %.5f, bad %ld, unwritten %ld\n",
         ok ? "PASS" : "FAIL", name, D, c.B, c.sq, c.sk, c.H, c.Hkv, c.kind, c.order ? " +order" : "",
         c.key_len ? " +key_len (column form)" : "", c.pad, c.ctas, c.split, rows,
         empty_rows, max_err, max_lse_err, bad, unwritten);
}

template <class Elem, int D, class Cfg = HarnessCfg<Elem, D>>
void checks(const char* name) {
  check<Elem, D, Cfg>({2, 1000, 1300, 32, 8, "mix", 0, 0, false}, name);    // GQA 32/8, both ends short
  check<Elem, D, Cfg>({1, 640, 389, 4, 4, "mix", 0, 3, true}, name);        // Sk < Sq, padding, work order
  check<Elem, D, Cfg>({1, 512, 512, 4, 4, "density", 1.0, 0, false}, name); // all blocks, multiples of 128
  check<Elem, D, Cfg>({2, 257, 1000, 4, 4, "density", 0.3, 1, false}, name);
  check<Elem, D, Cfg>({1, 129, 100, 8, 2, "mix", 0, 0, true}, name);        // one short key block only
  check<Elem, D, Cfg>({1, 1, 1, 2, 1, "density", 1.0, 0, false}, name);     // one query, one key
  check<Elem, D, Cfg>({1, 300, 700, 4, 4, "density", 0.0, 0, false}, name); // every list empty
  check<Elem, D, Cfg>({2, 700, 900, 8, 2, "mix", 0, 0, true, 7}, name);     // persistent: 7 CTAs, ring across items
  // the column form (key_len): lengths 0, 1, 127, 128, 129, Sk, then random, per (b, h)
  check<Elem, D, Cfg>({2, 300, 700, 8, 2, "mix", 0, 0, true, 0, true}, name);     // GQA
  check<Elem, D, Cfg>({1, 257, 1000, 16, 16, "mix", 0, 0, true, 0, true}, name);  // as the op runs it: Hkv = H
  check<Elem, D, Cfg>({2, 129, 256, 8, 8, "mix", 0, 0, false, 0, true}, name);    // Sk a multiple of 128
  check<Elem, D, Cfg>({2, 700, 900, 8, 8, "mix", 0, 0, true, 7, true}, name);     // persistent
  // The split tail: 96 items on 40 CTAs (16 split over 2-3 CTAs each, lists empty, full or not);
  // 32 items on 132 (all split, 4 CTAs each); 6 items on 100 (up to 8 parts of up to 24 tiles);
  // 96 on 7 (5 left, one CTA each: parts of one); key lengths, own and shared lists.
  check<Elem, D, Cfg>({2, 700, 900, 8, 2, "mix", 0, 0, true, 40, 0, 4}, name);
  check<Elem, D, Cfg>({1, 1000, 1300, 4, 4, "density", 0.3, 0, true, 132, 0, 8}, name);
  check<Elem, D, Cfg>({1, 257, 3000, 2, 1, "mix", 0, 0, true, 100, 0, 8}, name);
  check<Elem, D, Cfg>({2, 700, 900, 8, 2, "mix", 0, 0, false, 7, 0, 4}, name);
  check<Elem, D, Cfg>({2, 300, 700, 8, 8, "mix", 0, 0, true, 132, true, 6}, name);
  check<Elem, D, Cfg>({2, 700, 900, 8, 8, "mix", 0, 0, true, 40, true, 4}, name);
}

// ------------------------------------------------------------------------------------- timing
struct Timed { int s; double density, ms, tflops, ratio, ms_persistent; };

// Milliseconds per call of launch() over `iters` back-to-back calls, after 3 warm-up calls.
template <class Launch>
float time_loop(int iters, Launch launch) {
  for (int i = 0; i < 3; ++i) launch();
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0)); CK(cudaEventCreate(&e1));
  CK(cudaEventRecord(e0));
  for (int i = 0; i < iters; ++i) launch();
  CK(cudaEventRecord(e1)); CK(cudaEventSynchronize(e1)); CK(cudaGetLastError());
  float ms = 0;
  cudaEventElapsedTime(&ms, e0, e1);
  cudaEventDestroy(e0); cudaEventDestroy(e1);
  return ms / iters;
}

int sm_count() {
  int dev = 0, sms = 0;
  CK(cudaGetDevice(&dev));
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  return sms;
}

float median(std::vector<float> x) {  // of an even count: the mean of the middle two
  std::sort(x.begin(), x.end());
  return 0.5f * (x[(x.size() - 1) / 2] + x[x.size() / 2]);
}

template <class Elem, int D>
float time_launches(const dlm::sm90::SparseFwdArgs& a, int max_ctas, int iters) {
  using Cfg = HarnessCfg<Elem, D>;
  return time_loop(iters, [&] { CK(dlm::sm90::launch_block_sparse_fwd_cfg<Cfg>(a, max_ctas)); });
}

// Random inputs (kv_rows rows of K and V), one launch through the public entry point (its argument
// checks), then the shipped launch timed: what every timed shape does first.
template <class Elem, int D>
float fill_and_time(Bufs<Elem, D>& b, const Case& c, const Pattern& p, size_t kv_rows, int iters) {
  b.alloc(c, p);
  fill_random<<<1024, 256>>>(b.q, (size_t)c.sq * c.H * D, 1);
  fill_random<<<1024, 256>>>(b.k, kv_rows * c.Hkv * D, 2);
  fill_random<<<1024, 256>>>(b.v, kv_rows * c.Hkv * D, 3);
  CK(cudaGetLastError());
  CK(dlm::sm90::launch_block_sparse_fwd<Elem, D>(b.args));
  return time_launches<Elem, D>(b.args, 0, iters);
}

// One CTA per item (the shipped launch), then a persistent grid of one CTA per SM (the A/B).
template <class Elem, int D>
Timed time_one(int s, double density, int iters, int sms) {
  const Case c{1, s, s, 32, 8, "density", density, 0, false};
  std::mt19937 g(s + (int)(density * 1000));
  const Pattern p = make_pattern(c.B, c.H, c.sq, c.sk, c.kind, c.density, c.pad, g);
  Bufs<Elem, D> b;
  const float ms = fill_and_time(b, c, p, s, iters);
  const float ms_persistent = time_launches<Elem, D>(b.args, sms, iters);
  double visited = 0;  // (query, key) pairs of the listed blocks (all full: S is a multiple of 128)
  for (int n : p.cnt) visited += (double)n * kBlock * kBlock;
  const double real_density = visited / ((double)c.H * s * s);
  const double tflops = 4.0 * visited * D / (ms * 1e9);
  const double ratio = ms / (dense_cudnn_ms(s) * real_density);
  printf("time S=%d density %.2f (real %.4f): %.3f ms, %.0f TFLOPS (visited pairs), %.2f x density; persistent %.3f ms\n",
         s, density, real_density, ms, tflops, ratio, ms_persistent);
  fflush(stdout);
  return {s, density, ms, tflops, ratio, ms_persistent};
}

// The column-sparse forward at the same shapes, as dlm_ops runs it: the gather
// (hopper/column_gather.cuh: the listed rows of a (1, S, 8, 128) K / V for each of the 32 query
// heads, K = round(density * S) random ascending keys per head, and the kernel's plan, in one
// launch) writing this kernel's inputs (Hkv = 32, one shared list, key_len = K everywhere, a work
// order), then the kernel. Timed: the kernel alone (no work order, as before), the gather alone,
// and both back to back (benchmarks.sparse times the op through torch). Checked once per shape:
// the plan, and sampled gathered rows against the source, byte for byte.
struct ColumnTimed { Timed kernel; float gather_ms, both_ms; };


ColumnTimed time_column(int s, double density, int iters) {
  constexpr int D = 128, kHkv = 8;
  const int keys = (int)std::lround(density * s);
  const Case c{1, s, keys, 32, 32, "mix", 0, 0, false};
  Pattern p;
  p.nqb = (s + kBlock - 1) / kBlock;
  p.nkb = p.max_blocks = (keys + kBlock - 1) / kBlock;
  p.shared = true;
  p.idx.resize(p.nkb);
  std::iota(p.idx.begin(), p.idx.end(), 0);
  p.cnt.assign((size_t)c.H * p.nqb, p.nkb);
  p.lens.assign(c.H, keys);
  Bufs<bf16, D> b;
  const float ms = fill_and_time(b, c, p, keys, iters);
  const double real_density = (double)keys / s;
  const double tflops = 4.0 * (double)c.H * s * keys * D / (ms * 1e9);
  const double ratio = ms / (dense_cudnn_ms(s) * real_density);

  // The gather's source and lists.
  bf16 *ks, *vs;
  const size_t nsrc = (size_t)s * kHkv * D;
  CK(cudaMalloc(&ks, nsrc * sizeof(bf16))); CK(cudaMalloc(&vs, nsrc * sizeof(bf16)));
  fill_random<<<1024, 256>>>(ks, nsrc, 4);
  fill_random<<<1024, 256>>>(vs, nsrc, 5);
  std::mt19937 g(s + keys);
  std::vector<int32_t> lists((size_t)c.H * keys), perm(s), counts(c.H, keys);
  for (int h = 0; h < c.H; ++h) {
    std::iota(perm.begin(), perm.end(), 0);
    for (int i = 0; i < keys; ++i) std::swap(perm[i], perm[i + g() % (s - i)]);
    std::sort(perm.begin(), perm.begin() + keys);
    std::copy(perm.begin(), perm.begin() + keys, lists.begin() + (size_t)h * keys);
  }
  int32_t *dlists, *dcounts;
  CK(cudaMalloc(&dlists, lists.size() * 4)); CK(cudaMalloc(&dcounts, c.H * 4));
  CK(cudaMemcpy(dlists, lists.data(), lists.size() * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dcounts, counts.data(), c.H * 4, cudaMemcpyHostToDevice));
  dlm::sm90::ColumnGatherArgs ga{};
  ga.k = ks, ga.v = vs, ga.kg = b.k, ga.vg = b.v;
  const int64_t st[3] = {(int64_t)s * kHkv * D * 2, kHkv * D * 2, D * 2};  // bytes
  std::copy(st, st + 3, ga.k_stride); std::copy(st, st + 3, ga.v_stride);
  ga.kv_indices = dlists, ga.kv_counts = dcounts;
  ga.batch = 1, ga.heads = c.H, ga.kv_heads = kHkv, ga.list_len = keys, ga.seqlen_k = s;
  ga.row_bytes = D * 2;
  ga.key_len = b.lens, ga.block_counts = b.cnt, ga.shared_list = b.idx, ga.work_order = b.order;
  ga.num_q_blocks = p.nqb, ga.block_k = kBlock, ga.stream = 0;
  CK(cudaMemset(b.lens, 0xff, c.H * 4)); CK(cudaMemset(b.cnt, 0xff, p.cnt.size() * 4));
  CK(cudaMemset(b.idx, 0xff, p.nkb * 4)); CK(cudaMemset(b.order, 0xff, p.cnt.size() * 4));
  CK(cudaMemset(b.k, 0xff, (size_t)keys * c.H * D * 2)); CK(cudaMemset(b.v, 0xff, (size_t)keys * c.H * D * 2));
  CK(dlm::sm90::launch_column_gather(ga));
  CK(cudaDeviceSynchronize());
  // The plan: key_len K, ceil(K / 128) blocks per item, the shared list, the natural order.
  std::vector<int32_t> lens(c.H), cnt(p.cnt.size()), shared(p.nkb), order(p.cnt.size());
  CK(cudaMemcpy(lens.data(), b.lens, c.H * 4, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(cnt.data(), b.cnt, cnt.size() * 4, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(shared.data(), b.idx, shared.size() * 4, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(order.data(), b.order, order.size() * 4, cudaMemcpyDeviceToHost));
  int bad = 0;
  for (int h = 0; h < c.H; ++h) bad += lens[h] != keys;
  for (size_t i = 0; i < cnt.size(); ++i) bad += cnt[i] != p.nkb || order[i] != (int32_t)i;
  for (int i = 0; i < p.nkb; ++i) bad += shared[i] != i;
  // Sampled rows: 16 slots per head (the first, the last, random), k and v.
  std::vector<uint16_t> got(D), want(D);
  for (int h = 0; h < c.H; ++h)
    for (int t = 0; t < 16; ++t) {
      const int j = t == 0 ? 0 : t == 1 ? keys - 1 : (int)(g() % keys);
      const int row = lists[(size_t)h * keys + j];
      for (int w = 0; w < 2; ++w) {
        const bf16* src = (w ? vs : ks) + ((size_t)row * kHkv + h / (c.H / kHkv)) * D;
        const bf16* dst = (w ? b.v : b.k) + ((size_t)j * c.H + h) * D;
        CK(cudaMemcpy(want.data(), src, D * 2, cudaMemcpyDeviceToHost));
        CK(cudaMemcpy(got.data(), dst, D * 2, cudaMemcpyDeviceToHost));
        bad += got != want;
      }
    }
  if (bad) {
    printf("FAILED column gather S=%d K=%d: %d mismatches (plan entries or sampled rows)\n", s, keys, bad);
    ++g_failed;
  }
  const float gather_ms = time_loop(iters, [&] { CK(dlm::sm90::launch_column_gather(ga)); });
  dlm::sm90::SparseFwdArgs fa = b.args;
  fa.work_order = b.order;  // what the op passes: the gather's order
  const float both_ms = time_loop(iters, [&] {
    CK(dlm::sm90::launch_column_gather(ga));
    CK(dlm::sm90::launch_block_sparse_fwd<bf16, D>(fa));
  });
  CK(cudaFree(ks)); CK(cudaFree(vs)); CK(cudaFree(dlists)); CK(cudaFree(dcounts));
  const double gb = 4.0 * keys * c.H * D * 2 / 1e9;  // k and v rows, read and written
  printf("time column S=%d density %.2f (%d keys): kernel %.3f ms, %.0f TFLOPS, %.2f x density; gather %.3f ms "
         "(%.2f GB, %.2f TB/s); gather + kernel %.3f ms, %.2f x density\n", s, density, keys, ms, tflops, ratio,
         gather_ms, gb, gb / gather_ms, both_ms, both_ms / (dense_cudnn_ms(s) * real_density));
  fflush(stdout);
  return {{s, density, ms, tflops, ratio, 0}, gather_ms, both_ms};
}

void timing() {
  int dev = 0, sms = 0;
  CK(cudaGetDevice(&dev));
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  std::vector<Timed> t;
  for (int s : {16384, 32768, 65536})
    for (double d : {0.1, 0.3, 0.5, 1.0}) t.push_back(time_one<bf16, 128>(s, d, 20, sms));
  printf("\nbf16 D=128 B=1 H=32/8, 20 launches after 3 warm-ups; ratio = time / (dense cuDNN ms x density), goal <= 1.15;\n"
         "persistent: the same kernel on a grid of %d CTAs (A/B, not what launch_block_sparse_fwd runs)\n", sms);
  printf("| S | density | ms | TFLOPS | dense cuDNN ms | ratio | persistent ms | persistent ratio |\n|---|---|---|---|---|---|---|---|\n");
  for (auto& x : t)
    printf("| %dK | %.1f | %.3f | %.0f | %.2f | %.2f | %.3f | %.2f |\n", x.s / 1024, x.density, x.ms, x.tflops,
           dense_cudnn_ms(x.s), x.ratio, x.ms_persistent, x.ratio * x.ms_persistent / x.ms);
  std::vector<ColumnTimed> col;
  for (int s : {16384, 32768, 65536})
    for (double d : {0.1, 0.3, 0.5}) col.push_back(time_column(s, d, 20));
  printf("\nColumn-sparse form (gathered keys, Hkv = H = 32, shared list, key_len): the kernel alone, the gather\n"
         "(column_gather.cuh: K / V rows of 32 heads from Hkv = 8 and the plan, one launch) alone, both:\n"
         "| S | density | kernel ms | TFLOPS | ratio | gather ms | TB/s | gather + kernel ms | ratio |\n"
         "|---|---|---|---|---|---|---|---|---|\n");
  for (auto& x : col) {
    const double gb = 4.0 * std::lround(x.kernel.density * x.kernel.s) * 32 * 128 * 2 / 1e9;
    printf("| %dK | %.1f | %.3f | %.0f | %.2f | %.3f | %.2f | %.3f | %.2f |\n", x.kernel.s / 1024,
           x.kernel.density, x.kernel.ms, x.kernel.tflops, x.kernel.ratio, x.gather_ms, gb / x.gather_ms, x.both_ms,
           x.kernel.ratio * x.both_ms / x.kernel.ms);
  }
}

// The quick preset's shapes (bf16, D = 128 unless given, B = 1, H = 32/8, S = 16K / 32K / 64K,
// densities 0.1 / 0.3 / 0.5; with or without a work order), each with its inputs filled and one
// timed launch through the entry point: fn(s, density, bufs, pattern, that launch's ms).
template <int D = 128, class Fn>
void for_quick_shapes(bool work_order, Fn fn) {
  for (int s : {16384, 32768, 65536})
    for (double d : {0.1, 0.3, 0.5}) {
      const Case c{1, s, s, 32, 8, "density", d, 0, work_order};
      std::mt19937 g(s + (int)(d * 1000));
      const Pattern p = make_pattern(c.B, c.H, c.sq, c.sk, c.kind, c.density, c.pad, g);
      Bufs<bf16, D> b;
      const float first = fill_and_time(b, c, p, s, 3);
      fn(s, d, b, p, first);
    }
}

// Mode `probe`: the shipped kernel against its knockout without the O / lse stores (common.cuh
// kProbeNoStore; wrong results, timing only), both on the persistent grid, in rounds (median of
// 5), at the quick preset's shapes. Why: at density 0.1 an item visits 13 key tiles (16K) and costs
// ~2.5 tile-times more than them (csrc/NOTES.md "Session 10"); the carried pipeline, which hid the
// item's last P V and epilogue behind the next item's first S, lost 1-4 % (session 11). The
// knockout says how much of the per-item cost the epilogue is; the rest is the start (Q load,
// first S without a P V to overlap) and the last wave.
void timing_probe() {
  using Ship = HarnessCfg<bf16, 128>;
  using NoStore = dlm::sm90::Probe<Ship, dlm::sm90::kProbeNoStore>;
  int dev = 0, sms = 0;
  CK(cudaGetDevice(&dev));
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  printf("| S | density | items | key tiles / item | shipped ms | no O / lse store ms | store share | "
         "tile-times per item saved |\n|---|---|---|---|---|---|---|---|\n");
  for_quick_shapes(false, [&](int s, double d, Bufs<bf16, 128>& b, const Pattern& p, float) {
      std::vector<float> t[2];
      for (int r = 0; r < 5; ++r) {
        t[0].push_back(time_launches<bf16, 128>(b.args, sms, 10));
        t[1].push_back(time_loop(10, [&] { CK(dlm::sm90::launch_block_sparse_fwd_cfg<NoStore>(b.args, sms)); }));
      }
      for (auto& x : t) std::sort(x.begin(), x.end());
      double tiles = 0;
      for (int n : p.cnt) tiles += n;
      const double items = (double)p.cnt.size(), per_item = tiles / items;
      const double tile_ms = t[0][2] / tiles * sms;  // one CTA's time per key tile, all of it
      printf("| %dK | %.1f | %.0f | %.1f | %.3f | %.3f | %.3f | %.2f |\n", s / 1024, d, items, per_item,
             t[0][2], t[1][2], 1.0 - t[1][2] / t[0][2], (t[0][2] - t[1][2]) / tile_ms / (items / sms));
      fflush(stdout);
  });
}

// The A/B table of the config experiments below: N configs of the kernel (launch(v, args, sms)
// launches config v on the persistent grid, what the op runs) at the quick preset's shapes (bf16,
// D = 128 unless given, H = 32/8, a work order), per shape a warm-up, then 8 rounds with the
// configs in forward order in even rounds and reversed in odd ones (session 14: a fixed order read
// the first-timed arm up to 13 % slow), ~20 ms of back-to-back launches per measurement. Prints
// config 0's median ms and each other config's speed-up over it (>1: faster), overall and per order.
template <int D = 128, int N, class Launch>
void ab_table(const char* const (&names)[N], Launch launch) {
  const int sms = sm_count();
  printf("\n== bf16 D = %d\n| S | density | %s ms |", D, names[0]);
  for (int v = 1; v < N; ++v) printf(" %s (order a / b) |", names[v]);
  printf("\n|---|---|---|");
  for (int v = 1; v < N; ++v) printf("---|");
  printf("\n");
  for_quick_shapes<D>(true, [&](int s, double d, Bufs<bf16, D>& b, const Pattern&, float first) {
      const int iters = std::max(3, (int)(20.f / first));
      auto run = [&](int v) { return time_loop(iters, [&] { launch(v, b.args, sms); }); };
      run(0);  // warm-up: clocks settle before the first timed arm
      std::vector<float> t[N], order[2][N];
      for (int r = 0; r < 8; ++r)
        for (int i = 0; i < N; ++i) {
          const int v = r % 2 ? N - 1 - i : i;
          const float ms = run(v);
          t[v].push_back(ms);
          order[r % 2][v].push_back(ms);
        }
      const float m0 = median(t[0]);
      printf("| %dK | %.1f | %.3f |", s / 1024, d, m0);
      for (int v = 1; v < N; ++v)
        printf(" %.3f (%.3f / %.3f) |", m0 / median(t[v]), median(order[0][0]) / median(order[0][v]),
               median(order[1][0]) / median(order[1][v]));
      printf("\n");
      fflush(stdout);
  });
}

// Mode `softmax-ab`: FwdConfig SOFTMAX_ILP_ (online_softmax_tile_ilp, the softmax in four chains)
// and STALE_MAX_ (its maxima kept while they grow by <= 8 in log2 units, the O rescale skipped;
// both shipped since session 16) against session 15's one-chain softmax; checks first.
template <class Elem, int D, bool ILP, bool STALE = false>
using IlpCfg = dlm::sm90::FwdConfig<Elem, D, 128, 128, 2, true, dlm::sm90::kStartTile, 1, true, ILP, STALE>;

int softmax_ab() {
  checks<bf16, 128, IlpCfg<bf16, 128, true>>("bf16 four chains");
  checks<fp16, 128, IlpCfg<fp16, 128, true>>("fp16 four chains");
  checks<bf16, 64, IlpCfg<bf16, 64, true>>("bf16 D64 four chains");
  checks<bf16, 128, IlpCfg<bf16, 128, true, true>>("bf16 stale max");
  checks<fp16, 128, IlpCfg<fp16, 128, true, true>>("fp16 stale max");
  checks<fp16, 64, IlpCfg<fp16, 64, true, true>>("fp16 D64 stale max");
  checks<bf16, 64, IlpCfg<bf16, 64, true, true>>("bf16 D64 stale max");
  printf("%s: %d failed check(s)\n", g_failed ? "FAILED" : "OK", g_failed);
  if (g_failed) return 1;
  static const char* const names[3] = {"one chain (session 15)", "four chains", "four chains + stale max (shipped)"};
  ab_table(names, [](int v, const dlm::sm90::SparseFwdArgs& a, int sms) {
    using namespace dlm::sm90;
    if (v == 0) CK(launch_block_sparse_fwd_cfg<IlpCfg<bf16, 128, false>>(a, sms));
    if (v == 1) CK(launch_block_sparse_fwd_cfg<IlpCfg<bf16, 128, true>>(a, sms));
    if (v == 2) CK(launch_block_sparse_fwd_cfg<IlpCfg<bf16, 128, true, true>>(a, sms));
  });
  // D = 64 (the shipped config takes four chains without the stale max there, after the diffusion
  // forward's A/B: session 16)
  static const char* const names64[3] = {"one chain (session 15)", "four chains (shipped)", "four chains + stale max"};
  ab_table<64>(names64, [](int v, const dlm::sm90::SparseFwdArgs& a, int sms) {
    using namespace dlm::sm90;
    if (v == 0) CK(launch_block_sparse_fwd_cfg<IlpCfg<bf16, 64, false>>(a, sms));
    if (v == 1) CK(launch_block_sparse_fwd_cfg<IlpCfg<bf16, 64, true>>(a, sms));
    if (v == 2) CK(launch_block_sparse_fwd_cfg<IlpCfg<bf16, 64, true, true>>(a, sms));
  });
  return 0;
}

// Mode `stages-ab`: the shared memory cuDNN's forward takes (232 KB; ours 192), spent on a third
// K / V stage instead of the O staging: shipped (2 stages, O through smem), 2 stages with register
// stores (the staging's own share), 3 stages with register stores (224 KB); checks first.
template <int STAGES, bool SMEM_O>
using StageCfg = dlm::sm90::FwdConfig<bf16, 128, 128, 128, STAGES, true, dlm::sm90::kStartTile, 1, SMEM_O, true, true>;

int stages_ab() {
  checks<bf16, 128, StageCfg<2, false>>("bf16 2 stages, register stores");
  checks<bf16, 128, StageCfg<3, false>>("bf16 3 stages, register stores");
  printf("%s: %d failed check(s)\n", g_failed ? "FAILED" : "OK", g_failed);
  if (g_failed) return 1;
  static const char* const names[3] = {"shipped", "2 stages, register stores", "3 stages, register stores"};
  ab_table(names, [](int v, const dlm::sm90::SparseFwdArgs& a, int sms) {
    using namespace dlm::sm90;
    if (v == 0) CK(launch_block_sparse_fwd_cfg<StageCfg<2, true>>(a, sms));
    if (v == 1) CK(launch_block_sparse_fwd_cfg<StageCfg<2, false>>(a, sms));
    if (v == 2) CK(launch_block_sparse_fwd_cfg<StageCfg<3, false>>(a, sms));
  });
  return 0;
}

// One persistent launch at S = 16K, density 0.1 and 0.5 each (bf16, D = 128, H = 32/8, after the
// entry point's own launch), for ncu's stall profile: what an item's start and end cost at 10 %
// density that 50 % hides (csrc/NOTES.md "Next"; benchmarks/ncu_stalls.py reads the source page).
void prof() {
  int dev = 0, sms = 0;
  CK(cudaGetDevice(&dev));
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  for (double d : {0.1, 0.5}) {
    const Case c{1, 16384, 16384, 32, 8, "density", d, 0, false};
    std::mt19937 g(16384 + (int)(d * 1000));
    const Pattern p = make_pattern(c.B, c.H, c.sq, c.sk, c.kind, c.density, c.pad, g);
    Bufs<bf16, 128> b;
    fill_and_time(b, c, p, c.sk, 1);
    CK(dlm::sm90::launch_block_sparse_fwd_cfg<HarnessCfg<bf16, 128>>(b.args, sms));
    CK(cudaDeviceSynchronize());
  }
}

// Mode `waves`: is 16K / 10 % bound by its last wave? 128 query blocks x H heads of 13 listed
// blocks each on a persistent grid of one CTA per SM: at H = 32 that is 4096 items, 31.03 per CTA,
// so 4 CTAs run a 32nd item while the others idle. Timed for H = 28..36 (MHA, Hkv = H; interleaved
// rounds, medians): if the waves bind, time follows ceil(items / SMs) (H = 32 and 33 alike), if
// not, the item count (H = 33 3 % above 32).
void waves() {
  int dev = 0, sms = 0;
  CK(cudaGetDevice(&dev));
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  std::vector<int> heads;
  for (int h = 28; h <= 36; ++h) heads.push_back(h);
  std::vector<Bufs<bf16, 128>> bufs(heads.size());
  for (size_t i = 0; i < heads.size(); ++i) {
    const Case c{1, 16384, 16384, heads[i], heads[i], "density", 0.1, 0, true};
    std::mt19937 g(16384 + heads[i]);
    const Pattern p = make_pattern(c.B, c.H, c.sq, c.sk, c.kind, c.density, c.pad, g);
    fill_and_time(bufs[i], c, p, c.sk, 1);
  }
  std::vector<std::vector<float>> t(heads.size());
  for (int r = 0; r < 8; ++r)
    for (size_t j = 0; j < heads.size(); ++j) {
      const size_t i = r % 2 ? heads.size() - 1 - j : j;
      t[i].push_back(time_loop(20, [&] {
        CK(dlm::sm90::launch_block_sparse_fwd_cfg<HarnessCfg<bf16, 128>>(bufs[i].args, sms));
      }));
    }
  printf("| H | items | items / CTA | waves | ms | us per item | us per wave |\n|---|---|---|---|---|---|---|\n");
  for (size_t i = 0; i < heads.size(); ++i) {
    std::sort(t[i].begin(), t[i].end());
    const float ms = 0.5f * (t[i][3] + t[i][4]);
    const int items = heads[i] * 128, w = (items + sms - 1) / sms;
    printf("| %d | %d | %.2f | %d | %.4f | %.3f | %.2f |\n", heads[i], items, (double)items / sms, w, ms,
           1000.0 * ms / items, 1000.0 * ms / w);
  }
}

// Mode `trace`: where a work item's time goes (tests/cuda/trace_stats.h says what each column
// is). The config with kTrace (common.cuh Traced), one persistent launch after the shipped
// kernel's own, at 16K / 10 % (the goal's last miss), 16K / 50 %, 64K / 10 % and 64K / 50 %.
template <class Base>
void trace(const char* name) {
  using namespace dlm::sm90;
  using Cfg = Traced<Base>;
  printf("\n== %s\n", name);
  int dev = 0, sms = 0;
  CK(cudaGetDevice(&dev));
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  using u64 = unsigned long long;
  const size_t slots = (size_t)sms * kTraceItems * kTraceEvents;
  u64* dbuf = nullptr;
  CK(cudaMalloc(&dbuf, slots * sizeof(u64)));
  CK(cudaMemcpyToSymbol(g_trace<u64>, &dbuf, sizeof(dbuf)));
  std::vector<u64> h(slots);
  trace_stats::header();
  for (int s : {16384, 65536})
    for (double d : {0.1, 0.5}) {
      const Case c{1, s, s, 32, 8, "density", d, 0, true};
      std::mt19937 g(s + (int)(d * 1000));
      const Pattern p = make_pattern(c.B, c.H, c.sq, c.sk, c.kind, c.density, c.pad, g);
      Bufs<bf16, 128> b;
      fill_and_time(b, c, p, c.sk, 1);
      CK(cudaMemset(dbuf, 0, slots * sizeof(u64)));
      const float kernel_ms = time_loop(1, [&] { CK(launch_block_sparse_fwd_cfg<Cfg>(b.args, sms)); });
      CK(cudaMemcpy(h.data(), dbuf, slots * sizeof(u64), cudaMemcpyDeviceToHost));
      const int items = (int)p.cnt.size();
      char label[32];
      snprintf(label, sizeof(label), "%dK / %.1f", s / 1024, d);
      trace_stats::row(label, h, std::min(sms, items), items, 1000.0 * kernel_ms);
    }
  CK(cudaFree(dbuf));
}

// Mode `end-ab` (also `epi-ab`, its name until session 38): ways through the end of a work item.
// Session 17 (csrc/NOTES.md): the trace showed consumer 0's last P V + epilogue (~1.7 us) and the
// next item's Q load (issued when both consumers have finished their last S: ~1.5 us from issue to
// ready) covering each other; two Q buffers alone gained 0.3-1.1 %, the O / lse store knocked out
// alone (kProbeNoStore; store_item honours it since session 17) 3-4 %, both 4.5-5.3 % at 16K / 10 %.
// Session 38 read that as the path through consumer 1's last P V and epilogue (it ends half a tile
// after consumer 0's, and consumer 0's second S waited for consumer 1's first) and shipped the first
// S without a turn with two Q buffers at D = 128 (attn_common.cuh FreeFirstTurn). Configs: session
// 37's kernel (one Q, strict turns), two Q, the free turn with one and with two Q (shipped), and the
// knockouts with one and two Q (the bound); then the trace of the shipped kernel. Session 17 also
// timed the O staging written with stmatrix (deleted: 0.997-1.015x), session 38 the epilogue deferred
// under the next item's first S (deleted: 1.030x at 16K / 0.1 against the free turn's 1.033x) and Q
// released as soon as an item's last S is ready (1.018x). Checks first (the knockouts' results are
// wrong by design).
template <class Elem, int D, int QSTAGES>
using EpiCfg = dlm::sm90::FwdConfig<Elem, D, 128, 128, 2, true, dlm::sm90::kStartTile, QSTAGES, true, true,
                                    dlm::sm90::fwd_stale_max(D)>;
template <class Elem, int D, int QSTAGES>
using TurnCfg = dlm::sm90::FreeFirstTurn<EpiCfg<Elem, D, QSTAGES>>;
static_assert(std::is_same_v<TurnCfg<bf16, 128, 2>, dlm::sm90::SparseFwdConfig<bf16, 128>>, "the shipped arm");

int end_ab() {
  using namespace dlm::sm90;
  checks<bf16, 128, EpiCfg<bf16, 128, 2>>("bf16 2Q");
  checks<bf16, 128, TurnCfg<bf16, 128, 1>>("bf16 1Q free");
  checks<fp16, 64, TurnCfg<fp16, 64, 2>>("fp16 D64 2Q free");
  printf("%s: %d failed check(s)\n", g_failed ? "FAILED" : "OK", g_failed);
  if (g_failed) return 1;
  static const char* const names[6] = {"s37 (1Q)", "2Q", "1Q free", "2Q free (shipped)", "1Q no store",
                                       "2Q no store"};
  ab_table(names, [](int v, const SparseFwdArgs& a, int sms) {
    if (v == 0) CK(launch_block_sparse_fwd_cfg<EpiCfg<bf16, 128, 1>>(a, sms));
    if (v == 1) CK(launch_block_sparse_fwd_cfg<EpiCfg<bf16, 128, 2>>(a, sms));
    if (v == 2) CK(launch_block_sparse_fwd_cfg<TurnCfg<bf16, 128, 1>>(a, sms));
    if (v == 3) CK(launch_block_sparse_fwd_cfg<TurnCfg<bf16, 128, 2>>(a, sms));
    if (v == 4) CK(launch_block_sparse_fwd_cfg<Probe<EpiCfg<bf16, 128, 1>, kProbeNoStore>>(a, sms));
    if (v == 5) CK(launch_block_sparse_fwd_cfg<Probe<EpiCfg<bf16, 128, 2>, kProbeNoStore>>(a, sms));
  });
  trace<HarnessCfg<bf16, 128>>("trace: shipped");
  return 0;
}

// Mode `end-ab64`: session 38's free first turn and two Q buffers at D = 64, where session 38's
// SparseFwdConfig kept one Q buffer and strict turns (not measured with them then): that config, two
// Q, the free turn with one Q (shipped since session 39: 1.024-1.056x) and with two (0.97-0.99x,
// as two Q alone); checks first.
int end_ab64() {
  using namespace dlm::sm90;
  checks<bf16, 64, EpiCfg<bf16, 64, 2>>("bf16 D64 2Q");
  checks<bf16, 64, TurnCfg<bf16, 64, 2>>("bf16 D64 2Q free");
  printf("%s: %d failed check(s)\n", g_failed ? "FAILED" : "OK", g_failed);
  if (g_failed) return 1;
  static const char* const names[4] = {"s38 (1Q)", "2Q", "1Q free (shipped)", "2Q free"};
  ab_table<64>(names, [](int v, const SparseFwdArgs& a, int sms) {
    if (v == 0) CK(launch_block_sparse_fwd_cfg<EpiCfg<bf16, 64, 1>>(a, sms));
    if (v == 1) CK(launch_block_sparse_fwd_cfg<EpiCfg<bf16, 64, 2>>(a, sms));
    if (v == 2) CK(launch_block_sparse_fwd_cfg<TurnCfg<bf16, 64, 1>>(a, sms));
    if (v == 3) CK(launch_block_sparse_fwd_cfg<TurnCfg<bf16, 64, 2>>(a, sms));
  });
  return 0;
}
static_assert(std::is_same_v<TurnCfg<bf16, 64, 1>, dlm::sm90::SparseFwdConfig<bf16, 64>>, "the shipped D = 64 arm");

// Mode `split-ab`: the split tail (csrc/NOTES.md "Session 22"; block_sparse_fwd.cuh tail_part):
// the last round's items split into up to 2 / 4 / 8 parts over the CTAs it leaves idle, against
// the plain persistent launch; the counters' memset timed with each split launch, as the binding
// runs it. Checks first (the shipped config with the split at every `checks` shape).
int split_ab() {
  checks<bf16, 128>("bf16");
  checks<fp16, 64>("fp16");
  printf("%s: %d failed check(s)\n", g_failed ? "FAILED" : "OK", g_failed);
  if (g_failed) return 1;
  static const char* const names[4] = {"plain", "split 2", "split 4", "split 8"};
  ab_table(names, [](int v, const dlm::sm90::SparseFwdArgs& a, int sms) {
    static const int parts[4] = {0, 2, 4, 8};
    dlm::sm90::SparseFwdArgs s = a;
    use_split(s, parts[v], sms);
    CK(dlm::sm90::launch_block_sparse_fwd_cfg<HarnessCfg<bf16, 128>>(s, sms));
  });
  return 0;
}

// Mode `column-ab`: the column form's kernel against the block form's at the same key tiles (session
// 38, benchmarks.sparse at 16K / 10 %: 0.81 against 0.75 ms, both 13 tiles per item). Arms, all on
// the persistent grid with the split tail as the op launches them (bf16, D = 128, H = 32, a work
// order): the block form (Hkv = 8, random lists of round(d nKb) blocks); the column form as the op
// runs it (K = round(d S) gathered keys per head, (B, K, H, D), key_len K: the last tile masked);
// the same with K rounded up to whole tiles (the kKeyLen kernel, no tile masked); the same without
// key_len (the block-sparse kernel over the shared list). Session 39 (before its changes, csrc/NOTES.md
// "Session 39"): 0.954 / 0.983 / 1.005x the block form at 16K / 10 %; the gathered keys laid out
// (B, H, K, D) 0.959x and over Hkv = 8 0.954x, the block form over one shared list 1.001x (arms
// since deleted). Timing only: the kernels are `checks`'s; the K / V contents are random.
int column_ab() {
  using namespace dlm::sm90;
  constexpr int D = 128, H = 32;
  const int sms = sm_count();
  static const char* const names[] = {"block", "column (op)", "column whole tiles", "column no key_len"};
  constexpr int N = sizeof(names) / sizeof(names[0]);
  printf("\n== column-ab, bf16 D = 128, H = 32, persistent grid of %d CTAs, split tail 4\n| S | density | "
         "keys | tiles / item | %s ms |", sms, names[0]);
  for (int v = 1; v < N; ++v) printf(" %s ms (speed vs block) |", names[v]);
  printf("\n|---|---|---|---|---|");
  for (int v = 1; v < N; ++v) printf("---|");
  printf("\n");
  struct Shape { int s; double d; };
  for (const Shape sh : {Shape{16384, 0.1}, Shape{16384, 0.2}, Shape{16384, 0.5}, Shape{32768, 0.1}}) {
    const int s = sh.s, keys = (int)std::lround(sh.d * s), tiles = (keys + kBlock - 1) / kBlock;
    const int kpad = tiles * kBlock;
    // the block form
    const Case cb{1, s, s, H, 8, "density", sh.d, 0, true};
    std::mt19937 g(s + (int)(sh.d * 1000));
    const Pattern pb = make_pattern(cb.B, cb.H, cb.sq, cb.sk, cb.kind, cb.density, cb.pad, g);
    Bufs<bf16, D> bb;
    fill_and_time(bb, cb, pb, s, 3);
    // the column form: kpad gathered rows per head (those past `keys` masked by key_len)
    const Case cc{1, s, kpad, H, H, "mix", 0, 0, true};
    Pattern pc;
    pc.nqb = (s + kBlock - 1) / kBlock;
    pc.nkb = pc.max_blocks = tiles;
    pc.shared = true;
    pc.idx.resize(tiles);
    std::iota(pc.idx.begin(), pc.idx.end(), 0);
    pc.cnt.assign((size_t)H * pc.nqb, tiles);
    pc.lens.assign(H, keys);
    Bufs<bf16, D> bc;
    fill_and_time(bc, cc, pc, kpad, 3);
    int32_t* lens_pad;
    CK(cudaMalloc(&lens_pad, H * 4));
    const std::vector<int32_t> hl(H, kpad);
    CK(cudaMemcpy(lens_pad, hl.data(), H * 4, cudaMemcpyHostToDevice));
    SparseFwdArgs a[N];
    a[0] = bb.args;
    a[1] = bc.args; a[1].seqlen_k = keys;     // key_len = keys (bc.lens)
    a[2] = bc.args; a[2].key_len = lens_pad;  // Sk = key_len = kpad
    a[3] = bc.args; a[3].key_len = nullptr;   // Sk = kpad, the block-sparse kernel
    auto launch = [&](int v) {
      SparseFwdArgs x = a[v];
      use_split(x, 4, sms);
      CK(launch_block_sparse_fwd_cfg<HarnessCfg<bf16, D>>(x, sms));
    };
    const int iters = std::max(3, (int)(20.f / time_loop(3, [&] { launch(0); })));
    for (int v = 0; v < N; ++v) time_loop(iters, [&] { launch(v); });  // warm-up, every arm
    std::vector<float> t[N];
    for (int r = 0; r < 8; ++r)
      for (int i = 0; i < N; ++i) {
        const int v = r % 2 ? N - 1 - i : (i + r / 2) % N;  // rotated forward, reversed backward
        t[v].push_back(time_loop(iters, [&] { launch(v); }));
      }
    const float m0 = median(t[0]);
    printf("| %dK | %.1f | %d | %d / %d | %.3f |", s / 1024, sh.d, keys, tiles, pb.cnt[0], m0);
    for (int v = 1; v < N; ++v) printf(" %.3f (%.3f) |", median(t[v]), m0 / median(t[v]));
    printf("\n");
    fflush(stdout);
    CK(cudaFree(lens_pad));
  }
  return 0;
}

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "all";
  if (mode == "prof") {
    prof();
    return 0;
  }
  if (mode == "probe") {
    timing_probe();
    return 0;
  }
  if (mode == "stages-ab") return stages_ab();
  if (mode == "waves") {
    waves();
    return 0;
  }
  if (mode == "softmax-ab") return softmax_ab();
  if (mode == "trace") {
    trace<HarnessCfg<bf16, 128>>("trace: shipped");
    return 0;
  }
  if (mode == "end-ab" || mode == "epi-ab") return end_ab();
  if (mode == "end-ab64") return end_ab64();
  if (mode == "split-ab") return split_ab();
  if (mode == "column-ab") return column_ab();
  if (mode == "small") {
    check<bf16, 128>({1, 200, 300, 4, 2, "mix", 0, 1, true}, "bf16");
    check<fp16, 64>({1, 200, 300, 4, 2, "mix", 0, 1, false}, "fp16");
    check<bf16, 128>({1, 200, 300, 8, 8, "mix", 0, 0, true, 0, true}, "bf16");
    check<bf16, 128>({1, 700, 900, 8, 2, "mix", 0, 0, true, 3}, "bf16");  // persistent: 3 CTAs, 48 items
    check<bf16, 128>({1, 700, 900, 8, 2, "mix", 0, 0, true, 20, 0, 4}, "bf16");  // split tail: 48 on 20
  }
  if (mode == "all" || mode == "check") {
    checks<bf16, 128>("bf16");
    checks<fp16, 128>("fp16");
    checks<bf16, 64>("bf16");
    checks<fp16, 64>("fp16");
  }
  if (mode == "all" || mode == "time") timing();
  if (mode != "small" && mode != "all" && mode != "check" && mode != "time") {
    printf("unknown mode %s (check, time, small; none: check + time)\n", mode.c_str());
    return 2;
  }
  printf("%s: %d failed check(s)\n", g_failed ? "FAILED" : "OK", g_failed);
  return g_failed ? 1 : 0;
}
