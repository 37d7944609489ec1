// The sm90 block-diffusion backward's launch (diffusion_bwd_sm90.cu), for the bindings that call it
// from C++: the autograd node of diffusion_autograd_sm90.cpp. The arguments are those of the Python
// module's `bwd` (documented there), which is this function.
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <optional>

namespace dlm_bindings {

void diffusion_bwd(torch::Tensor dout, torch::Tensor q, torch::Tensor k, torch::Tensor v,
                   torch::Tensor out, torch::Tensor lse, std::optional<torch::Tensor> dlse,
                   torch::Tensor dq, torch::Tensor dk, torch::Tensor dv, torch::Tensor lse2,
                   torch::Tensor delta, torch::Tensor dkdv_order, torch::Tensor dq_order,
                   int64_t n_noisy, int64_t block_size, double scale,
                   std::optional<torch::Tensor> dkdv_sample, std::optional<torch::Tensor> dq_sample,
                   std::optional<torch::Tensor> cu_seqlens, bool persistent_dkdv,
                   std::optional<torch::Tensor> ds_scratch, std::optional<torch::Tensor> ds_slots,
                   int64_t ds_visits, std::optional<torch::Tensor> dkdv_schedule,
                   int64_t dkdv_order_chunk, int64_t dkdv_order_block,
                   std::optional<torch::Tensor> ds_rows, int64_t ds_k_tiles,
                   std::optional<torch::Tensor> dq_schedule);

// Floats past B * H * S that lse2 / delta must hold (the kernels zero and read them).
int64_t bwd_scratch_pad();

}  // namespace dlm_bindings
