// What the sm90 bindings (diffusion_fwd_sm90.cu, diffusion_bwd_sm90.cu, sparse_fwd_sm90.cu) need
// besides their own checks: the TMA and O-store alignment checks, strides and pointers in the
// kernels' argument form, a CTA schedule as a tensor (batched, or the work entries of packed
// samples), and the choice of the (dtype, head dim) instantiation.
#pragma once

#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <vector>

#include <cutlass/numeric_types.h>

#include "dlm/geometry.h"

namespace dlm_bindings {

// Strides of dims 0..2 of a (B, S, H, D) tensor, in elements.
inline void strides3(const torch::Tensor& t, int64_t* out) {
  for (int i = 0; i < 3; ++i) out[i] = t.stride(i);
}

// TMA: 16-byte aligned base and strides of dims 0..2 (dlm_ops checks the same before choosing a
// cutlass backend, so a failure is a bug); `what` names the tensors in the message.
inline void check_tma_aligned(std::initializer_list<torch::Tensor> ts, const char* what) {
  for (const auto& t : ts) {
    TORCH_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0 &&
                    (t.stride(0) * t.element_size()) % 16 == 0 &&
                    (t.stride(1) * t.element_size()) % 16 == 0 &&
                    (t.stride(2) * t.element_size()) % 16 == 0, what, " must be 16-byte aligned (TMA)");
  }
}

// The forwards' epilogue stores O two elements (4 bytes) at a time.
inline void check_o_pairs(const torch::Tensor& out) {
  TORCH_CHECK(out.stride(0) % 2 == 0 && out.stride(1) % 2 == 0 && out.stride(2) % 2 == 0 &&
                  reinterpret_cast<uintptr_t>(out.data_ptr()) % 4 == 0, "out must be 4-byte aligned");
}

// The forwards' tensors into their kernel arguments (FwdArgs, SparseFwdArgs): q, k, v, out
// (B, S, H, D) and lse (B, H, S) fp32.
template <class Args>
void set_fwd_tensors(Args& a, const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                     const torch::Tensor& out, const torch::Tensor& lse) {
  a.q = q.data_ptr(), a.k = k.data_ptr(), a.v = v.data_ptr(), a.o = out.data_ptr();
  a.lse = lse.data_ptr<float>();
  strides3(q, a.q_stride), strides3(k, a.k_stride), strides3(v, a.v_stride), strides3(out, a.o_stride);
  a.lse_stride[0] = lse.stride(0), a.lse_stride[1] = lse.stride(1);
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

// The balanced schedule (dlm/geometry.h order_schedule) of a kernel's work over `plans` in
// tile_order_tensor's order, walked in `walk` (its slots per entry), each item weighing `weight`
// times its area, on `ctas` CTAs (the last tail_rounds rounds handed out most expensive first), as a
// CPU int32 tensor (ctas + 1 offsets, then the items).
inline torch::Tensor schedule_tensor(const dlm::TilePlans& plans, const dlm::WorkOrder& walk, int weight,
                                     int ctas, int tail_rounds = 0) {
  TORCH_CHECK(walk.slots >= 1 && weight >= 1 && ctas >= 1, "schedule: slots, weight and ctas >= 1");
  const torch::Tensor order = tile_order_tensor(plans);
  TORCH_CHECK(order.numel() * int64_t{walk.slots} < INT32_MAX, "schedule: fewer than 2^31 work items");
  const std::vector<int32_t> sched = dlm::order_schedule(
      plans, order.data_ptr<int32_t>(), static_cast<int>(order.numel()), walk, weight, ctas, tail_rounds);
  auto out = torch::empty({static_cast<int64_t>(sched.size())}, torch::dtype(torch::kInt32));
  std::copy(sched.begin(), sched.end(), out.data_ptr<int32_t>());
  return out;
}

// A launch's work_order arguments (hopper/common.cuh) from Python: chunk 0 (the plain order, block
// unused) or chunk >= 1 slots with blocks of block >= 1 entries, so that the launcher builds the
// walk without asking the device (and a schedule built for the same arguments matches it).
inline void check_work_order(int64_t chunk, int64_t block) {
  TORCH_CHECK(chunk >= 0 && block >= 0 && (chunk == 0 || block >= 1) && chunk < INT32_MAX &&
                  block < INT32_MAX,
              "work order: chunk 0 (plain), or chunk >= 1 with block >= 1; got ", chunk, ", ", block);
}

// A schedule handed to a launch: contiguous int32 on `dev` with the length of one built for `ctas`
// CTAs over `items` work items (its content is the builder's: tests/test_csrc_geometry.py).
inline void check_schedule(const torch::Tensor& schedule, const c10::Device& dev, int64_t ctas,
                           int64_t items) {
  TORCH_CHECK(schedule.device() == dev && schedule.scalar_type() == torch::kInt32 &&
                  schedule.is_contiguous() && schedule.numel() == ctas + 1 + items,
              "schedule: contiguous int32 on the inputs' device, built for ", ctas, " CTAs and ", items,
              " work items (", ctas + 1 + items, " entries), got ", schedule.numel());
}

// The work entries of packed samples (kStartVarlen): every sample's tiles (plans_of(mask) gives
// a sample's TilePlans), most expensive first over all samples, as two CPU int32 tensors: {tile
// within its sample, sample}. cu_seqlens: the host's copy of the offsets (num_samples + 1).
template <class PlansOf>
std::vector<torch::Tensor> varlen_entries(const std::vector<int64_t>& cu_seqlens, int64_t block_size,
                                          PlansOf plans_of) {
  TORCH_CHECK(!cu_seqlens.empty() && cu_seqlens.back() <= INT32_MAX, "cu_seqlens: 1 to 2^31 - 1 tokens");
  const std::vector<int32_t> cu(cu_seqlens.begin(), cu_seqlens.end());
  const dlm::VarlenMask mask{cu.data(), static_cast<int>(cu.size()) - 1, static_cast<int>(block_size)};
  TORCH_CHECK(dlm::varlen_valid(mask), "cu_seqlens must start at 0 and step by even lengths >= 0, "
              "block_size >= 1");
  std::vector<int64_t> area;
  std::vector<int32_t> tile, sample;
  for (int i = 0; i < mask.num_samples; ++i) {
    const dlm::TilePlans plans = plans_of(mask.sample(i));
    for (int t = 0; t < plans.count(); ++t)
      area.push_back(plans.area(t)), tile.push_back(t), sample.push_back(i);
  }
  const int count = static_cast<int>(area.size());
  std::vector<int32_t> order(count);
  dlm::most_expensive_first(area.data(), count, order.data());
  auto tiles = torch::empty({count}, torch::dtype(torch::kInt32));
  auto samples = torch::empty({count}, torch::dtype(torch::kInt32));
  for (int i = 0; i < count; ++i) {
    tiles.data_ptr<int32_t>()[i] = tile[order[i]];
    samples.data_ptr<int32_t>()[i] = sample[order[i]];
  }
  return {tiles, samples};
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
