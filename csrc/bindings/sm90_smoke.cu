// torch binding of csrc/hopper/sm90_smoke.cuh, JIT-built by dlm_ops.backends.cutlass.build in the
// GPU test (tests/test_cutlass_build.py): it proves the build pipeline and the header on the H200.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include "hopper/sm90_smoke.cuh"

namespace {

dlm::SequenceMask make_mask(int64_t n_noisy, int64_t n_clean, int64_t block_size) {
  TORCH_CHECK(n_noisy >= 0 && n_clean >= 0 && block_size >= 1, "bad mask (", n_noisy, ", ", n_clean,
              ", ", block_size, ")");
  return {static_cast<int>(n_noisy), static_cast<int>(n_clean), static_cast<int>(block_size)};
}

// (runs (T, 4) int32, area (T,) int64, kinds (T, other tiles) int8) computed on the current GPU.
std::vector<torch::Tensor> tile_runs(int64_t n_noisy, int64_t n_clean, int64_t block_size,
                                     int64_t block_m, int64_t block_n, bool transpose) {
  TORCH_CHECK(block_m >= 1 && block_n >= 1, "tile sizes must be >= 1");
  const dlm::SequenceMask mask = make_mask(n_noisy, n_clean, block_size);
  const dlm::TilePlans plans = transpose ? mask.bwd_tiles(block_m, block_n)
                                         : mask.fwd_tiles(block_m, block_n);
  const int count = plans.count(), others = plans.other.count();
  auto opts = torch::TensorOptions().device(torch::kCUDA);
  auto runs = torch::full({count, 4}, -7, opts.dtype(torch::kInt32));
  auto area = torch::full({count}, -7, opts.dtype(torch::kInt64));
  auto kinds = torch::full({count, others}, -7, opts.dtype(torch::kInt8));
  if (count > 0) {
    dlm::smoke::tile_runs_kernel<<<(count + 127) / 128, 128, 0, c10::cuda::getCurrentCUDAStream()>>>(
        plans, runs.data_ptr<int32_t>(), area.data_ptr<int64_t>(), kinds.data_ptr<int8_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return {runs, area, kinds};
}

// One masked 64 x 64 score tile: q, k (seqlen, 64) bf16 contiguous on the GPU.
torch::Tensor masked_scores(torch::Tensor q, torch::Tensor k, int64_t n_noisy, int64_t n_clean,
                            int64_t block_size, int64_t row0, int64_t col0) {
  const dlm::SequenceMask mask = make_mask(n_noisy, n_clean, block_size);
  for (const auto& t : {q, k}) {
    TORCH_CHECK(t.is_cuda() && t.scalar_type() == torch::kBFloat16 && t.is_contiguous() &&
                    t.dim() == 2 && t.size(0) == mask.seqlen() && t.size(1) == dlm::smoke::kTile,
                "q and k must be contiguous CUDA bf16 (", mask.seqlen(), ", 64), got ", t.sizes());
  }
  TORCH_CHECK(row0 >= 0 && col0 >= 0 && row0 < mask.seqlen() && col0 < mask.seqlen(), "bad tile");
  const c10::cuda::CUDAGuard guard(q.device());
  auto s = torch::full({dlm::smoke::kTile, dlm::smoke::kTile}, std::nan(""),
                       q.options().dtype(torch::kFloat32));
  dlm::smoke::masked_scores_kernel<<<1, 128, 0, c10::cuda::getCurrentCUDAStream()>>>(
      reinterpret_cast<const dlm::smoke::Elem*>(q.data_ptr()),
      reinterpret_cast<const dlm::smoke::Elem*>(k.data_ptr()), mask, static_cast<int>(row0),
      static_cast<int>(col0), s.data_ptr<float>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return s;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("tile_runs", &tile_runs);
  m.def("masked_scores", &masked_scores);
}
