// torch binding of the column-sparse forward's gather (csrc/hopper/column_gather.cuh), in the
// dlm_sparse_sm90 extension (module: sparse_sm90.cpp; caller: dlm_ops/backends/cutlass_sparse.py
// column_inputs). The kernel is plain CUDA and instantiated here. The checks are the kernel's
// preconditions, which the Python backend meets by construction, so a failure here is a bug; the
// index VALUES are not checked (that needs a host sync: the op does it, check_indices).
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include <cstdint>
#include <optional>

#include "hopper/column_gather.cuh"

namespace {

void check_int32(const torch::Tensor& t, const torch::Tensor& like, c10::IntArrayRef shape,
                 const char* name) {
  TORCH_CHECK(t.device() == like.device() && t.scalar_type() == torch::kInt32 && t.is_contiguous() &&
                  t.sizes() == shape, name, ": contiguous int32 of shape ", shape, " on k's device, got ",
              t.scalar_type(), " ", t.sizes());
}

// k / v (B, Sk, Hkv, D), any strides with a unit stride in D; kv_indices (B, H, K) and kv_counts
// (B, H) int32 contiguous; writes kg / vg (B, K, H, D) contiguous (k's dtype), key_len (B, H),
// block_counts (B, H, nQb), shared_list (ceil(K / block_k)) and, unless None, work_order
// (B * H * nQb): see the header. One launch on the current stream, no host sync.
void column_gather(torch::Tensor k, torch::Tensor v, torch::Tensor kv_indices, torch::Tensor kv_counts,
                   torch::Tensor kg, torch::Tensor vg, torch::Tensor key_len, torch::Tensor block_counts,
                   torch::Tensor shared_list, std::optional<torch::Tensor> work_order, int64_t block_k) {
  TORCH_CHECK(k.is_cuda(), "k must be a CUDA tensor");
  TORCH_CHECK(k.dim() == 4 && v.sizes() == k.sizes() && k.stride(3) == 1 && v.stride(3) == 1,
              "k / v: (B, Sk, Hkv, D) of one shape, unit stride in D");
  TORCH_CHECK(v.device() == k.device() && v.scalar_type() == k.scalar_type(), "v: k's device and dtype");
  const int64_t b = k.size(0), sk = k.size(1), hkv = k.size(2), d = k.size(3);
  TORCH_CHECK(d >= 1, "k / v: head dim >= 1");
  TORCH_CHECK(kv_indices.dim() == 3 && kv_indices.size(0) == b, "kv_indices: (B, H, K)");
  const int64_t h = kv_indices.size(1), m = kv_indices.size(2);
  check_int32(kv_indices, k, {b, h, m}, "kv_indices");
  check_int32(kv_counts, k, {b, h}, "kv_counts");
  TORCH_CHECK(hkv >= 1 && h % hkv == 0, "heads (", h, ") must be a multiple of kv heads (", hkv, ")");
  TORCH_CHECK(m >= 1, "kv_indices: at least one list slot (K >= 1)");
  TORCH_CHECK(block_k >= 1, "block_k >= 1");
  for (const auto* t : {&kg, &vg}) {
    TORCH_CHECK(t->device() == k.device() && t->scalar_type() == k.scalar_type() && t->is_contiguous() &&
                    t->sizes() == c10::IntArrayRef({b, m, h, d}),
                "kg / vg: contiguous (B, K, H, D) in k's dtype on k's device");
  }
  TORCH_CHECK(block_counts.dim() == 3, "block_counts: (B, H, nQb)");
  const int64_t nqb = block_counts.size(2);
  check_int32(key_len, k, {b, h}, "key_len");
  check_int32(block_counts, k, {b, h, nqb}, "block_counts");
  check_int32(shared_list, k, {(m + block_k - 1) / block_k}, "shared_list");
  if (work_order) check_int32(*work_order, k, {b * h * nqb}, "work_order");
  TORCH_CHECK(b <= 65535 && h <= 65535, "B and H must be at most 65535 (grid dimensions)");
  TORCH_CHECK(b * h * nqb <= INT32_MAX && m <= INT32_MAX && sk <= INT32_MAX && block_k <= INT32_MAX,
              "sizes must fit in int32");

  const c10::cuda::CUDAGuard guard(k.device());
  dlm::sm90::ColumnGatherArgs a{};
  a.k = k.data_ptr(), a.v = v.data_ptr(), a.kg = kg.data_ptr(), a.vg = vg.data_ptr();
  const int64_t size = k.element_size();
  for (int i = 0; i < 3; ++i) a.k_stride[i] = k.stride(i) * size, a.v_stride[i] = v.stride(i) * size;
  a.kv_indices = kv_indices.data_ptr<int32_t>(), a.kv_counts = kv_counts.data_ptr<int32_t>();
  a.batch = static_cast<int>(b), a.heads = static_cast<int>(h), a.kv_heads = static_cast<int>(hkv);
  a.list_len = static_cast<int>(m), a.seqlen_k = static_cast<int>(sk);
  a.row_bytes = static_cast<int>(d * size);
  a.key_len = key_len.data_ptr<int32_t>(), a.block_counts = block_counts.data_ptr<int32_t>();
  a.shared_list = shared_list.data_ptr<int32_t>();
  a.work_order = work_order ? work_order->data_ptr<int32_t>() : nullptr;
  a.num_q_blocks = static_cast<int>(nqb), a.block_k = static_cast<int>(block_k);
  a.stream = c10::cuda::getCurrentCUDAStream();
  TORCH_CHECK(dlm::sm90::column_gather_vector_bytes(a) > 0,
              "k / v: rows of at most 1024 bytes, 2-byte aligned bases, strides and rows");
  if (b * h == 0) return;  // no head: nothing to gather, an empty plan
  C10_CUDA_CHECK(dlm::sm90::launch_column_gather(a));
}

}  // namespace

namespace dlm_bindings {
void add_column_gather(pybind11::module_& m) {  // the module: csrc/bindings/sparse_sm90.cpp
  m.def("column_gather", &column_gather, pybind11::arg("k"), pybind11::arg("v"),
        pybind11::arg("kv_indices"), pybind11::arg("kv_counts"), pybind11::arg("kg"), pybind11::arg("vg"),
        pybind11::arg("key_len"), pybind11::arg("block_counts"), pybind11::arg("shared_list"),
        pybind11::arg("work_order"), pybind11::arg("block_k"));
}
}  // namespace dlm_bindings
