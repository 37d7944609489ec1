// torch binding of the sm90 block-sparse forward (csrc/hopper/block_sparse_fwd.cuh), JIT-built by
// dlm_ops.backends.cutlass_sparse into its own extension (module: sparse_sm90.cpp). Host code: the
// kernels are instantiated in hopper/block_sparse_fwd_{bf16,fp16}_d{64,128}.cu; a .cu only because
// the kernel header pulls in CuTe. The checks are the kernel's preconditions, which the Python
// backend tests before choosing it, so a failure here is a bug.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include <cstdint>
#include <optional>

#include "bindings/sm90_common.h"
#include "hopper/block_sparse_fwd.cuh"

namespace {

struct LaunchSparseFwd {
  const dlm::sm90::SparseFwdArgs& args;
  template <class Elem, int D>
  cudaError_t run() const {
    return dlm::sm90::launch_block_sparse_fwd<Elem, D>(args);
  }
};

bool supports(int64_t block_q, int64_t block_k, int64_t d) {
  return dlm::sm90::block_sparse_fwd_supports(static_cast<int>(block_q), static_cast<int>(block_k),
                                              static_cast<int>(d));
}

// Writes out (B, Sq, H, D) and lse (B, H, Sq) fp32; q (B, Sq, H, D), k / v (B, Sk, Hkv, D);
// kv_block_indices (B, H, nQb, max_blocks), or (max_blocks): one list every item reads, and
// kv_block_counts (B, H, nQb), int32, contiguous; work_order: None or the (B * H * nQb) items
// (b * H + h) * nQb + qb, longest list first; key_len: None or (B, H) int32, the column form
// (the column-sparse forward's gathered keys, dlm_ops/backends/cutlass_sparse.py): the keys of
// (b, h) are [0, key_len[b, h]) (<= Sk), the list must be the shared arange 0 .. max_blocks - 1,
// which the kernel takes as given instead of reading it, and counts <= ceil(key_len / 128)
// (block_sparse_fwd.cuh, KeyLenConsumerSide); max_ctas: 0 one CTA per item, > 0 a
// persistent grid of at most that many CTAs; split_parts (with max_ctas > 0): > 0 splits the last
// round's items into up to that many parts over the grid (block_sparse_fwd.cuh tail_part), with
// the caller's scratch: split_partials (fp32, at least split_scratch_floats(d, max_ctas) floats)
// and split_counters (int32, at least 2 * max_ctas, zeroed). The Python backend allocates it, so
// that an out-of-memory error raises there: on one image a c10::Error thrown inside an
// extension ended the process (csrc/NOTES.md "Session 23").
void fwd(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor out, torch::Tensor lse,
         torch::Tensor kv_block_indices, torch::Tensor kv_block_counts,
         std::optional<torch::Tensor> work_order, int64_t block_q, int64_t block_k, double scale,
         std::optional<torch::Tensor> key_len, int64_t max_ctas, int64_t split_parts,
         std::optional<torch::Tensor> split_partials, std::optional<torch::Tensor> split_counters) {
  const auto& idx = kv_block_indices;
  const auto& counts = kv_block_counts;
  TORCH_CHECK(q.is_cuda(), "q must be a CUDA tensor");
  for (const auto& t : {k, v, out, lse, idx, counts})
    TORCH_CHECK(t.device() == q.device(), "all tensors on q's device");
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type() &&
                  out.scalar_type() == q.scalar_type(), "q, k, v, out: one dtype");
  TORCH_CHECK(lse.scalar_type() == torch::kFloat32, "lse must be float32");
  for (const auto& t : {q, k, v, out}) TORCH_CHECK(t.dim() == 4 && t.stride(3) == 1, "layout");
  const int64_t b = q.size(0), sq = q.size(1), h = q.size(2), d = q.size(3);
  const int64_t sk = k.size(1), hkv = k.size(2);
  TORCH_CHECK(k.size(0) == b && k.size(3) == d && v.sizes() == k.sizes() && out.sizes() == q.sizes(),
              "shapes: q / out (B, Sq, H, D), k / v (B, Sk, Hkv, D)");
  TORCH_CHECK(hkv >= 1 && h % hkv == 0, "heads must be a multiple of kv heads");
  TORCH_CHECK(supports(block_q, block_k, d), "no kernel for block sizes ", block_q, " x ", block_k,
              " at head dim ", d);
  const int64_t nqb = (sq + block_q - 1) / block_q;
  TORCH_CHECK(lse.dim() == 3 && lse.size(0) == b && lse.size(1) == h && lse.size(2) == sq &&
                  lse.stride(2) == 1, "lse (B, H, Sq), unit stride in Sq");
  TORCH_CHECK(idx.scalar_type() == torch::kInt32 && counts.scalar_type() == torch::kInt32 &&
                  idx.is_contiguous() && counts.is_contiguous(),
              "kv_block_indices / kv_block_counts: contiguous int32");
  const bool shared = idx.dim() == 1;
  TORCH_CHECK(counts.dim() == 3 && counts.size(0) == b && counts.size(1) == h && counts.size(2) == nqb &&
                  (shared || (idx.dim() == 4 && idx.sizes().slice(0, 3) == counts.sizes())),
              "index shapes (B, H, nQb[, max_blocks]), or a shared list (max_blocks)");
  // An empty list table would hand the kernel a pointer to nothing: the backend runs Triton then.
  TORCH_CHECK(idx.size(-1) >= 1, "max_blocks >= 1");
  if (key_len) {
    TORCH_CHECK(key_len->device() == q.device() && key_len->scalar_type() == torch::kInt32 &&
                    key_len->is_contiguous() && key_len->dim() == 2 && key_len->size(0) == b &&
                    key_len->size(1) == h, "key_len: (B, H) contiguous int32 on q's device");
    TORCH_CHECK(shared, "key_len (the column form) needs the shared list (max_blocks), the arange");
  }
  TORCH_CHECK(b * h * nqb <= INT32_MAX && idx.numel() <= INT32_MAX && sq <= INT32_MAX &&
                  sk <= INT32_MAX, "sizes must fit in int32");
  if (work_order) {
    TORCH_CHECK(work_order->device() == q.device() && work_order->scalar_type() == torch::kInt32 &&
                    work_order->is_contiguous() && work_order->numel() == b * h * nqb,
                "work_order: B * H * nQb contiguous int32 on q's device");
  }
  dlm_bindings::check_tma_aligned({q, k, v}, "q, k, v");
  dlm_bindings::check_o_pairs(out);
  if (b * h * nqb == 0) return;  // no query (Sq = 0) or no head: an empty grid, nothing to write

  const c10::cuda::CUDAGuard guard(q.device());
  dlm::sm90::SparseFwdArgs a{};
  dlm_bindings::set_fwd_tensors(a, q, k, v, out, lse);
  a.batch = static_cast<int>(b), a.seqlen_q = static_cast<int>(sq), a.seqlen_k = static_cast<int>(sk);
  a.heads = static_cast<int>(h), a.kv_heads = static_cast<int>(hkv);
  a.block_q = static_cast<int>(block_q), a.block_k = static_cast<int>(block_k);
  a.kv_block_indices = idx.data_ptr<int32_t>(), a.kv_block_counts = counts.data_ptr<int32_t>();
  a.num_q_blocks = static_cast<int>(nqb), a.max_blocks = static_cast<int>(idx.size(-1));
  a.shared_list = shared;
  a.key_len = key_len ? key_len->data_ptr<int32_t>() : nullptr;
  a.scale = static_cast<float>(scale);
  a.work_order = work_order ? work_order->data_ptr<int32_t>() : nullptr;
  TORCH_CHECK(max_ctas >= 0 && max_ctas <= INT32_MAX, "max_ctas must be >= 0");
  a.max_ctas = static_cast<int>(max_ctas);
  a.stream = c10::cuda::getCurrentCUDAStream();
  TORCH_CHECK(split_parts >= 0 && split_parts <= INT32_MAX, "split_parts must be >= 0");
  if (split_parts > 0 && max_ctas > 0) {
    TORCH_CHECK(split_partials && split_partials->device() == q.device() &&
                    split_partials->scalar_type() == torch::kFloat32 && split_partials->is_contiguous() &&
                    split_partials->numel() >= dlm::sm90::split_scratch_floats(static_cast<int>(d), a.max_ctas),
                "split_partials: contiguous fp32 on q's device, split_scratch_floats(d, max_ctas) floats");
    TORCH_CHECK(split_counters && split_counters->device() == q.device() &&
                    split_counters->scalar_type() == torch::kInt32 && split_counters->is_contiguous() &&
                    split_counters->numel() >= 2 * max_ctas,
                "split_counters: contiguous int32 on q's device, 2 * max_ctas of them (zeroed)");
    a.split_parts = static_cast<int>(split_parts);
    a.split_partials = split_partials->data_ptr<float>();
    a.split_counters = split_counters->data_ptr<int32_t>();
  }
  const cudaError_t err =
      dlm_bindings::dispatch<64, 128>(q.scalar_type(), static_cast<int>(d), LaunchSparseFwd{a});
  C10_CUDA_CHECK(err);
}

}  // namespace

namespace dlm_bindings {
void add_sparse_fwd(pybind11::module_& m) {  // the module: csrc/bindings/sparse_sm90.cpp
  m.def("supports", &supports, pybind11::arg("block_q"), pybind11::arg("block_k"), pybind11::arg("d"));
  m.def("fwd", &fwd, pybind11::arg("q"), pybind11::arg("k"), pybind11::arg("v"), pybind11::arg("out"),
        pybind11::arg("lse"), pybind11::arg("kv_block_indices"), pybind11::arg("kv_block_counts"),
        pybind11::arg("work_order"), pybind11::arg("block_q"), pybind11::arg("block_k"),
        pybind11::arg("scale"), pybind11::arg("key_len") = pybind11::none(),
        pybind11::arg("max_ctas") = 0, pybind11::arg("split_parts") = 0,
        pybind11::arg("split_partials") = pybind11::none(), pybind11::arg("split_counters") = pybind11::none());
  m.def("split_scratch_floats", [](int64_t d, int64_t ctas) {
    return dlm::sm90::split_scratch_floats(static_cast<int>(d), static_cast<int>(ctas));
  }, pybind11::arg("d"), pybind11::arg("ctas"));
}
}  // namespace dlm_bindings
