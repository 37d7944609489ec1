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
//   ./fwd_standalone d256          # head dim 256 (128 x 64 tiles): checks, then timing
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <random>
#include <algorithm>
#include <string>
#include <cuda_runtime.h>
#include "hopper/diffusion_fwd.cuh"

#define CK(x) do { cudaError_t err_ = (x); if (err_ != cudaSuccess) { printf("CUDA error %s at %d\n", cudaGetErrorString(err_), __LINE__); exit(1); } } while (0)

struct Run { int B, n, H, Hkv, bs; bool causal = false; };  // causal: block-causal over 2n
int g_max_ctas = 0;  // persistent grid of at most this many CTAs; 0: one CTA per work item

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
      (float)(1.4426950408889634 / std::sqrt((double)D)), order, T};
  auto kern = dlm::sm90::diffusion_fwd_kernel<Cfg>;
  int smem = sizeof(typename Cfg::SharedStorage);
  CK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  const int items = r.B * r.H * T;
  dim3 grid(g_max_ctas > 0 && g_max_ctas < items ? g_max_ctas : items);
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
      double le = std::fabs(hl[((size_t)b * r.H + h) * S + i] - (mx + std::log(l))); max_lse_err = std::max(max_lse_err, le);
    }
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

int main(int argc, char** argv) {
  setvbuf(stdout, nullptr, _IONBF, 0);
  using dlm::sm90::FwdConfig;
  using bf16 = cutlass::bfloat16_t;
  const std::string v = argc > 1 ? argv[1] : "plain2";
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
