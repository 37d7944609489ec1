// What both sm90 bindings (diffusion_fwd_sm90.cu, diffusion_bwd_sm90.cu) need besides their own
// checks: strides in the kernels' argument form, a CTA schedule as a tensor, and the choice of the
// (dtype, head dim) instantiation.
#pragma once

#include <torch/extension.h>

#include <vector>

#include <cutlass/numeric_types.h>

#include "dlm/geometry.h"

namespace dlm_bindings {

// Strides of dims 0..2 of a (B, S, H, D) tensor, in elements.
inline void strides3(const torch::Tensor& t, int64_t* out) {
  for (int i = 0; i < 3; ++i) out[i] = t.stride(i);
}

// The tiles of `plans`, most expensive first (the CTA schedule), as a CPU int32 tensor.
inline torch::Tensor tile_order_tensor(const dlm::TilePlans& plans) {
  const int count = plans.count();
  std::vector<int64_t> area(count);
  for (int t = 0; t < count; ++t) area[t] = plans.area(t);
  auto order = torch::empty({count}, torch::dtype(torch::kInt32));
  dlm::most_expensive_first(area.data(), count, order.data_ptr<int32_t>());
  return order;
}

// launch.template run<Elem, D>() for the instantiation of `dtype` (bf16 or fp16) and head dim `d`,
// which must be one of Ds (the head dims built).
template <int... Ds, class Launch>
cudaError_t dispatch(torch::ScalarType dtype, int d, const Launch& launch) {
  const bool bf16 = dtype == torch::kBFloat16;
  TORCH_CHECK(bf16 || dtype == torch::kHalf, "bf16 or fp16, got ", dtype);
  TORCH_CHECK(((d == Ds) || ...), "no kernel built for head dim ", d);
  cudaError_t err = cudaSuccess;
  ((d == Ds ? void(err = bf16 ? launch.template run<cutlass::bfloat16_t, Ds>()
                              : launch.template run<cutlass::half_t, Ds>())
            : void()),
   ...);
  return err;
}

}  // namespace dlm_bindings
