// torch binding of the sm90 block-diffusion forward (csrc/hopper/diffusion_fwd.cuh), JIT-built by
// dlm_ops.backends.cutlass_diffusion with the backward into one extension (diffusion_sm90.cpp).
// The checks here are the kernel's own preconditions; the Python backend declines every call that
// would fail them, so a failure here is a bug. Batched calls and packed samples (varlen) share the
// entry point: the varlen tables make the difference.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include <cstdint>
#include <optional>
#include <vector>

#include "bindings/sm90_common.h"
#include "hopper/diffusion_fwd.cuh"

namespace {

using dlm_bindings::tile_order_tensor;

using dlm::sm90::kFwdBlockM;

// Query tiles of the forward for head dim d, most expensive first (the CTA schedule), as a CPU
// int32 tensor.
torch::Tensor tile_order(int64_t n_noisy, int64_t n_clean, int64_t block_size, int64_t d) {
  const dlm::SequenceMask mask{static_cast<int>(n_noisy), static_cast<int>(n_clean),
                               static_cast<int>(block_size)};
  return tile_order_tensor(
      mask.fwd_tiles(kFwdBlockM, dlm::sm90::fwd_block_n(static_cast<int>(d))));
}

// The forward's work entries of packed samples for head dim d: {tile, sample}, most expensive
// first over all samples (CPU int32 tensors; csrc/NOTES.md "Odd lengths and varlen").
std::vector<torch::Tensor> varlen_tile_order(std::vector<int64_t> cu_seqlens, int64_t block_size,
                                             int64_t d) {
  const int block_n = dlm::sm90::fwd_block_n(static_cast<int>(d));
  return dlm_bindings::varlen_entries(cu_seqlens, block_size, [block_n](const dlm::SequenceMask& m) {
    return m.fwd_tiles(kFwdBlockM, block_n);
  });
}

struct LaunchFwd {
  const dlm::sm90::FwdArgs& args;
  bool varlen;
  template <class Elem, int D>
  cudaError_t run() const {
    return varlen ? dlm::sm90::launch_fwd<Elem, D, dlm::sm90::kStartVarlen>(args)
                  : dlm::sm90::launch_fwd<Elem, D>(args);
  }
};

// Writes out (B, S, H, D) and lse (B, H, S) fp32; q (B, S, H, D), k/v (B, S, Hkv, D). Packed
// samples (varlen): B = 1, S = total tokens, `order` / `tile_sample` from varlen_tile_order and
// cu_seqlens the (num_samples + 1,) int32 offsets on the device; n_noisy is then unused (every
// sample is block_diffusion(its length, block_size)). order_chunk / order_block: the walk over the
// (tile, batch * head) work (hopper/common.cuh work_order; 0, 0: the plain entry-major order).
// narrow_diag: the kernel with the noisy diagonal's narrow visit, where one is built
// (fwd_narrow_built; elsewhere it is ignored).
void fwd(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor out, torch::Tensor lse,
         torch::Tensor order, int64_t n_noisy, int64_t block_size, double scale, int64_t max_ctas,
         std::optional<torch::Tensor> tile_sample, std::optional<torch::Tensor> cu_seqlens,
         int64_t order_chunk, int64_t order_block, bool narrow_diag) {
  const bool varlen = tile_sample.has_value();
  dlm_bindings::check_work_order(order_chunk, order_block);
  TORCH_CHECK(q.is_cuda() && k.device() == q.device() && v.device() == q.device() &&
                  out.device() == q.device() && lse.device() == q.device() &&
                  order.device() == q.device(), "all tensors on one CUDA device");
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type() &&
                  out.scalar_type() == q.scalar_type() && lse.scalar_type() == torch::kFloat32 &&
                  order.scalar_type() == torch::kInt32, "dtypes");
  TORCH_CHECK(n_noisy >= 0 && n_noisy <= q.size(1) && block_size >= 1, "bad mask");
  TORCH_CHECK(dlm::sm90::kBatchedStart != dlm::sm90::kStartTile || varlen ||
                  (n_noisy % kFwdBlockM == 0 && (q.size(1) - n_noisy) % kFwdBlockM == 0),
              "both halves must be multiples of ", kFwdBlockM, " long (kBatchedStart is kStartTile)");
  if (varlen) {
    TORCH_CHECK(cu_seqlens.has_value() && q.size(0) == 1, "varlen: batch 1 and cu_seqlens");
    for (const auto& t : {*tile_sample, *cu_seqlens})
      TORCH_CHECK(t.device() == q.device() && t.scalar_type() == torch::kInt32 && t.is_contiguous(),
                  "varlen tables: contiguous int32 on q's device");
    TORCH_CHECK(tile_sample->numel() == order.numel(), "one sample per work entry");
  }
  TORCH_CHECK(order.is_contiguous(), "contiguous tile order");
  for (const auto& t : {q, k, v, out}) TORCH_CHECK(t.dim() == 4 && t.stride(3) == 1, "layout");
  TORCH_CHECK(lse.dim() == 3 && lse.stride(2) == 1, "lse layout");
  dlm_bindings::check_tma_aligned({q, k, v}, "q, k, v");
  dlm_bindings::check_o_pairs(out);
  const c10::cuda::CUDAGuard guard(q.device());
  dlm::sm90::FwdArgs a{};
  dlm_bindings::set_fwd_tensors(a, q, k, v, out, lse);
  a.batch = q.size(0), a.seqlen = q.size(1), a.heads = q.size(2), a.kv_heads = k.size(2);
  a.n_noisy = varlen ? 0 : static_cast<int>(n_noisy), a.block_size = static_cast<int>(block_size);
  a.scale = static_cast<float>(scale);
  a.tile_order = order.data_ptr<int32_t>(), a.num_tiles = order.size(0);
  a.max_ctas = static_cast<int>(max_ctas);
  a.order_chunk = static_cast<int>(order_chunk), a.order_block = static_cast<int>(order_block);
  a.narrow_diag = narrow_diag;
  a.stream = c10::cuda::getCurrentCUDAStream();
  if (varlen) a.tile_sample = tile_sample->data_ptr<int32_t>(), a.cu_seqlens = cu_seqlens->data_ptr<int32_t>();
  // No launch with an empty grid (no tokens, no heads, or only zero-length samples).
  if (a.batch * a.heads == 0 || a.seqlen == 0 || a.num_tiles == 0) return;
  const cudaError_t err =
      dlm_bindings::dispatch<64, 128, 256>(q.scalar_type(), q.size(3), LaunchFwd{a, varlen});
  C10_CUDA_CHECK(err);
}

}  // namespace

namespace dlm_bindings {
void add_fwd(pybind11::module_& m) {  // the module: csrc/bindings/diffusion_sm90.cpp
  m.def("tile_order", &tile_order);
  m.def("varlen_tile_order", &varlen_tile_order);
  m.def("fwd", &fwd, pybind11::arg("q"), pybind11::arg("k"), pybind11::arg("v"), pybind11::arg("out"),
        pybind11::arg("lse"), pybind11::arg("order"), pybind11::arg("n_noisy"),
        pybind11::arg("block_size"), pybind11::arg("scale"), pybind11::arg("max_ctas"),
        pybind11::arg("tile_sample") = pybind11::none(), pybind11::arg("cu_seqlens") = pybind11::none(),
        pybind11::arg("order_chunk") = 0, pybind11::arg("order_block") = 0,
        pybind11::arg("narrow_diag") = false);
  // Whether batched calls take halves of any length (kBatchedStart is not kStartTile): dlm_ops
  // hands halves that are not multiples of 128 to Triton otherwise.
  m.attr("batched_any_length") = dlm::sm90::kBatchedStart != dlm::sm90::kStartTile;
}
}  // namespace dlm_bindings
