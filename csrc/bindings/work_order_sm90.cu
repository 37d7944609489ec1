// torch binding of the block-sparse forward's work order (csrc/hopper/work_order.cuh), in the
// dlm_sparse_sm90 extension (module: sparse_sm90.cpp; caller: dlm_ops/backends/cutlass_sparse.py
// work_order). Plain CUDA, instantiated here. The checks are the kernel's preconditions, which the
// Python backend tests before calling it, so a failure here is a bug.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include <cstdint>

#include "hopper/work_order.cuh"

namespace {

// counts: any shape, contiguous int32 (the (B, H, nQb) block counts), values in [0, max_count];
// order: (counts.numel()) contiguous int32, written with the items longest list first, ties in
// item order. One launch on the current stream, no host sync.
void work_order(torch::Tensor counts, torch::Tensor order, int64_t max_count) {
  TORCH_CHECK(counts.is_cuda() && counts.scalar_type() == torch::kInt32 && counts.is_contiguous(),
              "counts: contiguous int32 on a CUDA device");
  TORCH_CHECK(order.device() == counts.device() && order.scalar_type() == torch::kInt32 &&
                  order.is_contiguous() && order.dim() == 1 && order.numel() == counts.numel(),
              "order: (counts.numel()) contiguous int32 on counts' device");
  const int64_t n = counts.numel();
  TORCH_CHECK(n >= 1 && n <= dlm::sm90::kWorkOrderMaxItems, "work_order: 1 to ",
              dlm::sm90::kWorkOrderMaxItems, " items, got ", n);
  TORCH_CHECK(max_count >= 0 && max_count <= dlm::sm90::kWorkOrderMaxCount, "work_order: max_count in [0, ",
              dlm::sm90::kWorkOrderMaxCount, "], got ", max_count);
  const c10::cuda::CUDAGuard guard(counts.device());
  C10_CUDA_CHECK(dlm::sm90::launch_work_order(counts.data_ptr<int32_t>(), static_cast<int>(n),
                                              static_cast<int>(max_count), order.data_ptr<int32_t>(),
                                              c10::cuda::getCurrentCUDAStream()));
}

}  // namespace

namespace dlm_bindings {
void add_work_order(pybind11::module_& m) {  // the module: csrc/bindings/sparse_sm90.cpp
  m.def("work_order", &work_order, pybind11::arg("counts"), pybind11::arg("order"),
        pybind11::arg("max_count"));
  m.attr("work_order_max_items") = dlm::sm90::kWorkOrderMaxItems;
  m.attr("work_order_max_count") = dlm::sm90::kWorkOrderMaxCount;
}
}  // namespace dlm_bindings
