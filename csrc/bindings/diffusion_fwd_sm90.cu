// torch binding of the sm90 block-diffusion forward (csrc/hopper/diffusion_fwd.cuh), JIT-built by
// dlm_ops.backends.cutlass_diffusion with the backward into one extension (diffusion_sm90.cpp).
// The checks here are the kernel's own preconditions; the Python backend declines every call that
// would fail them, so a failure here is a bug.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include <vector>

#include "bindings/sm90_common.h"
#include "hopper/diffusion_fwd.cuh"

namespace {

using dlm_bindings::strides3;
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

struct LaunchFwd {
  const dlm::sm90::FwdArgs& args;
  template <class Elem, int D>
  cudaError_t run() const { return dlm::sm90::launch_fwd<Elem, D>(args); }
};

// Writes out (B, S, H, D) and lse (B, H, S) fp32; q (B, S, H, D), k/v (B, S, Hkv, D).
void fwd(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor out, torch::Tensor lse,
         torch::Tensor order, int64_t n_noisy, int64_t block_size, double scale, int64_t max_ctas) {
  TORCH_CHECK(q.is_cuda() && k.device() == q.device() && v.device() == q.device() &&
                  out.device() == q.device() && lse.device() == q.device() &&
                  order.device() == q.device(), "all tensors on one CUDA device");
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type() &&
                  out.scalar_type() == q.scalar_type() && lse.scalar_type() == torch::kFloat32 &&
                  order.scalar_type() == torch::kInt32, "dtypes");
  TORCH_CHECK(n_noisy % kFwdBlockM == 0 && (q.size(1) - n_noisy) % kFwdBlockM == 0 && n_noisy >= 0 &&
                  n_noisy <= q.size(1) && block_size >= 1,
              "both halves must be multiples of ", kFwdBlockM, " long");
  for (const auto& t : {q, k, v, out}) TORCH_CHECK(t.dim() == 4 && t.stride(3) == 1, "layout");
  TORCH_CHECK(lse.dim() == 3 && lse.stride(2) == 1, "lse layout");
  // The epilogue stores O two elements (4 bytes) at a time.
  TORCH_CHECK(out.stride(0) % 2 == 0 && out.stride(1) % 2 == 0 && out.stride(2) % 2 == 0 &&
                  reinterpret_cast<uintptr_t>(out.data_ptr()) % 4 == 0, "out must be 4-byte aligned");
  const c10::cuda::CUDAGuard guard(q.device());
  dlm::sm90::FwdArgs a{};
  a.q = q.data_ptr(), a.k = k.data_ptr(), a.v = v.data_ptr(), a.o = out.data_ptr();
  a.lse = lse.data_ptr<float>();
  strides3(q, a.q_stride), strides3(k, a.k_stride), strides3(v, a.v_stride), strides3(out, a.o_stride);
  a.lse_stride[0] = lse.stride(0), a.lse_stride[1] = lse.stride(1);
  a.batch = q.size(0), a.seqlen = q.size(1), a.heads = q.size(2), a.kv_heads = k.size(2);
  a.n_noisy = static_cast<int>(n_noisy), a.block_size = static_cast<int>(block_size);
  a.scale = static_cast<float>(scale);
  a.tile_order = order.data_ptr<int32_t>(), a.num_tiles = order.size(0);
  a.max_ctas = static_cast<int>(max_ctas);
  a.stream = c10::cuda::getCurrentCUDAStream();
  if (a.batch * a.heads == 0 || a.num_tiles == 0) return;
  const cudaError_t err =
      dlm_bindings::dispatch<64, 128, 256>(q.scalar_type(), q.size(3), LaunchFwd{a});
  C10_CUDA_CHECK(err);
}

}  // namespace

namespace dlm_bindings {
void add_fwd(pybind11::module_& m) {  // the module: csrc/bindings/diffusion_sm90.cpp
  m.def("tile_order", &tile_order);
  m.def("fwd", &fwd);
}
}  // namespace dlm_bindings
