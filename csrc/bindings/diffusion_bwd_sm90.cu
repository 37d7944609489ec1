// torch binding of the sm90 block-diffusion backward (csrc/hopper/diffusion_bwd.cuh), JIT-built
// with the forward into one extension by dlm_ops.backends.cutlass_diffusion (the module itself is
// csrc/bindings/diffusion_sm90.cpp). The checks here are the kernels' own preconditions; the Python
// backend declines every call that would fail them, so a failure here is a bug.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <tuple>
#include <vector>

#include "bindings/diffusion_bwd_sm90.h"
#include "bindings/sm90_common.h"
#include "hopper/diffusion_bwd.cuh"

namespace {

using dlm_bindings::strides3;
using dlm_bindings::tile_order_tensor;

using dlm::sm90::bwd_block_m;
using dlm::sm90::bwd_block_n;
using dlm::sm90::dq_block_m;
using dlm::sm90::dq_block_n;
using dlm::sm90::ds_backward_supports;
using dlm::sm90::ds_block_elems;
using dlm::sm90::ds_dq_block_n;
// The dQ-from-dS walk's bytes per element (ds_dq_work_order's L2 chunks): bf16 and fp16 alike.
constexpr int kDsElemBytes = 2;
using dlm::sm90::kBwdBlockM;
using dlm::sm90::kDsDqBlockM;

// The CTA schedules as CPU int32 tensors, most expensive first: key tiles of the dK/dV kernel, query
// tiles of the dQ kernel, query tiles of the dQ-from-dS kernel (their tiles depend on the head dim).
std::vector<torch::Tensor> bwd_tile_orders(int64_t n_noisy, int64_t n_clean, int64_t block_size,
                                           int64_t head_dim) {
  const dlm::SequenceMask mask{static_cast<int>(n_noisy), static_cast<int>(n_clean),
                               static_cast<int>(block_size)};
  const int d = static_cast<int>(head_dim);
  return {tile_order_tensor(mask.bwd_tiles(bwd_block_m(d), bwd_block_n(d))),
          tile_order_tensor(mask.fwd_tiles(dq_block_m(d), dq_block_n(d))),
          tile_order_tensor(mask.fwd_tiles(kDsDqBlockM, ds_dq_block_n(d)))};
}

// The balanced schedule of the persistent dK/dV kernel's batched work (bwd_tile_orders' first
// entries x `slots` = B * Hkv, each item walking `group` query heads) on `ctas` CTAs (the SM count,
// fewer than the items), walked in the work order (order_chunk, order_block) that bwd's
// dkdv_order_chunk / dkdv_order_block give the kernel, as a CPU int32 tensor.
torch::Tensor dkdv_schedule(int64_t n_noisy, int64_t n_clean, int64_t block_size, int64_t head_dim,
                            int64_t slots, int64_t group, int64_t ctas, int64_t order_chunk,
                            int64_t order_block) {
  dlm_bindings::check_work_order(order_chunk, order_block);
  TORCH_CHECK(slots >= 1 && slots < INT32_MAX, "dkdv_schedule: slots >= 1");
  const dlm::SequenceMask mask{static_cast<int>(n_noisy), static_cast<int>(n_clean),
                               static_cast<int>(block_size)};
  const int d = static_cast<int>(head_dim);
  const dlm::WorkOrder walk = dlm::sm90::work_order(static_cast<int>(slots), 0, static_cast<int>(order_chunk),
                                                    static_cast<int>(order_block));
  return dlm_bindings::schedule_tensor(mask.bwd_tiles(bwd_block_m(d), bwd_block_n(d)), walk,
                                       static_cast<int>(group), static_cast<int>(ctas));
}

// The balanced schedule of the persistent dK/dV kernel's packed work (varlen_bwd_tile_orders' first
// entries x `slots` = Hkv, each item walking `group` query heads; work index e * slots + slot, the
// plain order the kStartVarlen kernel decodes) on `ctas` CTAs (the SM count, fewer than the items),
// handed out in dlm/geometry.h varlen_walk's order of `order_block` entries per round (0: the plain
// order), costed as order_schedule costs the batched work. A CPU int32 tensor.
torch::Tensor varlen_dkdv_schedule(std::vector<int64_t> cu_seqlens, int64_t block_size, int64_t head_dim,
                                   int64_t slots, int64_t group, int64_t ctas, int64_t order_block) {
  TORCH_CHECK(slots >= 1 && group >= 1 && ctas >= 1 && order_block >= 0 && order_block < INT32_MAX,
              "varlen_dkdv_schedule: slots, group, ctas >= 1 and order_block >= 0");
  const int d = static_cast<int>(head_dim), bm = bwd_block_m(d), bn = bwd_block_n(d);
  const auto plans_of = [bm, bn](const dlm::SequenceMask& m) { return m.bwd_tiles(bm, bn); };
  const auto entries = dlm_bindings::varlen_entries(cu_seqlens, block_size, plans_of);
  const int count = static_cast<int>(entries[0].numel());
  TORCH_CHECK(count * slots < INT32_MAX, "varlen_dkdv_schedule: fewer than 2^31 work items");
  const std::vector<int32_t> cu(cu_seqlens.begin(), cu_seqlens.end());
  const dlm::VarlenMask mask{cu.data(), static_cast<int>(cu.size()) - 1, static_cast<int>(block_size)};
  const int32_t* tile = entries[0].data_ptr<int32_t>();
  const int32_t* sample = entries[1].data_ptr<int32_t>();
  const std::vector<int32_t> walk =
      dlm::varlen_walk(sample, count, mask.num_samples, static_cast<int>(slots), static_cast<int>(order_block));
  const int64_t fixed = int64_t{dlm::kScheduleItemHalfTiles} * bm * bn / 2;
  std::vector<int64_t> cost(walk.size());
  for (size_t i = 0; i < walk.size(); ++i) {
    const int e = walk[i] / static_cast<int>(slots);
    cost[i] = group * plans_of(mask.sample(sample[e])).area(tile[e]) + fixed;
  }
  const std::vector<int32_t> sched = dlm::walk_schedule(walk, cost.data(), static_cast<int>(ctas));
  auto out = torch::empty({static_cast<int64_t>(sched.size())}, torch::dtype(torch::kInt32));
  std::copy(sched.begin(), sched.end(), out.data_ptr<int32_t>());
  return out;
}

// The balanced schedule of the persistent dQ-from-dS kernel's batched work (bwd_tile_orders' third
// entries x B * H slots) on `ctas` CTAs (the SM count, fewer than the items), over the walk that
// launch_bwd_ds gives it (ds_dq_work_order: L2 chunks of slots sized by device `device`'s L2), its
// last kDsDqScheduleTailRounds rounds handed out most expensive first. A CPU int32 tensor.
torch::Tensor ds_dq_schedule(int64_t n_noisy, int64_t n_clean, int64_t block_size, int64_t head_dim, int64_t batch,
                             int64_t heads, int64_t kv_heads, int64_t ctas, int64_t device) {
  TORCH_CHECK(batch >= 1 && kv_heads >= 1 && heads % kv_heads == 0 && batch * heads < INT32_MAX && ctas >= 1,
              "ds_dq_schedule: batch, heads >= 1, heads a multiple of kv_heads");
  const dlm::SequenceMask mask{static_cast<int>(n_noisy), static_cast<int>(n_clean),
                               static_cast<int>(block_size)};
  const int d = static_cast<int>(head_dim);
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));  // work_order asks the current device
  const dlm::WorkOrder walk = dlm::sm90::ds_dq_work_order(
      static_cast<int>(batch), static_cast<int>(heads), static_cast<int>(kv_heads), mask.seqlen(), d,
      kDsElemBytes, dlm::sm90::kDsDqOrderChunk, dlm::sm90::kDsDqOrderBlock);
  return dlm_bindings::schedule_tensor(mask.fwd_tiles(kDsDqBlockM, ds_dq_block_n(d)), walk, 1,
                                       static_cast<int>(ctas), dlm::sm90::kDsDqScheduleTailRounds);
}

// The same for packed samples (varlen_bwd_tile_orders' fifth entries x H slots, batch 1 over the
// packing's tokens), each entry costed by its sample's tile as order_schedule costs the batched ones.
torch::Tensor varlen_ds_dq_schedule(std::vector<int64_t> cu_seqlens, int64_t block_size, int64_t head_dim,
                                    int64_t heads, int64_t kv_heads, int64_t ctas, int64_t device) {
  TORCH_CHECK(kv_heads >= 1 && heads % kv_heads == 0 && ctas >= 1,
              "varlen_ds_dq_schedule: heads a multiple of kv_heads >= 1, ctas >= 1");
  const int d = static_cast<int>(head_dim), bm = kDsDqBlockM, bn = ds_dq_block_n(d);
  const auto plans_of = [bm, bn](const dlm::SequenceMask& m) { return m.fwd_tiles(bm, bn); };
  const auto entries = dlm_bindings::varlen_entries(cu_seqlens, block_size, plans_of);
  const int count = static_cast<int>(entries[0].numel());
  TORCH_CHECK(int64_t{count} * heads < INT32_MAX, "varlen_ds_dq_schedule: fewer than 2^31 work items");
  const std::vector<int32_t> cu(cu_seqlens.begin(), cu_seqlens.end());
  const dlm::VarlenMask mask{cu.data(), static_cast<int>(cu.size()) - 1, static_cast<int>(block_size)};
  const int32_t* tile = entries[0].data_ptr<int32_t>();
  const int32_t* sample = entries[1].data_ptr<int32_t>();
  const int64_t fixed = int64_t{dlm::kScheduleItemHalfTiles} * bm * bn / 2;
  std::vector<int64_t> entry_cost(static_cast<size_t>(count));
  for (int e = 0; e < count; ++e) entry_cost[e] = plans_of(mask.sample(sample[e])).area(tile[e]) + fixed;
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  const dlm::WorkOrder walk = dlm::sm90::ds_dq_work_order(1, static_cast<int>(heads), static_cast<int>(kv_heads),
                                                          cu.back(), d, kDsElemBytes, dlm::sm90::kDsDqOrderChunk,
                                                          dlm::sm90::kDsDqOrderBlock);
  const std::vector<int32_t> sched = dlm::entry_schedule(entry_cost.data(), count, walk, static_cast<int>(ctas),
                                                         dlm::sm90::kDsDqScheduleTailRounds);
  auto out = torch::empty({static_cast<int64_t>(sched.size())}, torch::dtype(torch::kInt32));
  std::copy(sched.begin(), sched.end(), out.data_ptr<int32_t>());
  return out;
}

// Elements per dS^T block of the dS backward (64 queries x the dK/dV kernel's key tile), 0 for a head
// dim the path does not cover.
int64_t ds_block(int64_t head_dim) {
  const int d = static_cast<int>(head_dim);
  return ds_backward_supports(d) ? ds_block_elems(d) : 0;
}

// The work entries of packed samples: {dK/dV key tiles, their samples, dQ query tiles, their
// samples, dQ-from-dS query tiles, their samples}, each kernel's most expensive first over all
// samples (CPU int32 tensors).
std::vector<torch::Tensor> varlen_bwd_tile_orders(std::vector<int64_t> cu_seqlens, int64_t block_size,
                                                  int64_t head_dim) {
  const int d = static_cast<int>(head_dim);
  auto dkdv = dlm_bindings::varlen_entries(cu_seqlens, block_size, [d](const dlm::SequenceMask& m) {
    return m.bwd_tiles(bwd_block_m(d), bwd_block_n(d));
  });
  auto dq = dlm_bindings::varlen_entries(cu_seqlens, block_size, [d](const dlm::SequenceMask& m) {
    return m.fwd_tiles(dq_block_m(d), dq_block_n(d));
  });
  auto ds_dq = dlm_bindings::varlen_entries(cu_seqlens, block_size, [d](const dlm::SequenceMask& m) {
    return m.fwd_tiles(kDsDqBlockM, ds_dq_block_n(d));
  });
  return {dkdv[0], dkdv[1], dq[0], dq[1], ds_dq[0], ds_dq[1]};
}

// The dS backward's slot table of packed samples (head dims with ds_block): sample i owns rows
// [rows[i], rows[i] + its 64-query tiles) of a table `width` key tiles wide (the widest sample's);
// entry (row, kt) is the scratch block (less 1 + head * visits) of the dK/dV kernel's visit of that
// query tile by key tile kt, numbered over all samples key tile by key tile in the kernel's visit
// order (run 0, then run 1), -1 where it does not visit. Returns {slots, rows} (CPU int32), visits
// and width: cutlass_diffusion._ds_plan_varlen's arguments of bwd.
std::tuple<torch::Tensor, torch::Tensor, int64_t, int64_t> varlen_ds_slots(std::vector<int64_t> cu_seqlens,
                                                                         int64_t block_size, int64_t head_dim) {
  const int d = static_cast<int>(head_dim);
  TORCH_CHECK(ds_backward_supports(d), "the dS backward: D = 128 or 256");
  TORCH_CHECK(!cu_seqlens.empty() && cu_seqlens.back() <= INT32_MAX, "cu_seqlens: 1 to 2^31 - 1 tokens");
  const std::vector<int32_t> cu(cu_seqlens.begin(), cu_seqlens.end());
  const dlm::VarlenMask mask{cu.data(), static_cast<int>(cu.size()) - 1, static_cast<int>(block_size)};
  TORCH_CHECK(dlm::varlen_valid(mask), "cu_seqlens must start at 0 and step by even lengths >= 0, "
              "block_size >= 1");
  auto rows = torch::empty({mask.num_samples}, torch::dtype(torch::kInt32));
  int64_t total_rows = 0, width = 1;
  for (int i = 0; i < mask.num_samples; ++i) {
    const dlm::TilePlans plans = mask.sample(i).bwd_tiles(kBwdBlockM, ds_dq_block_n(d));
    rows.data_ptr<int32_t>()[i] = static_cast<int32_t>(total_rows);
    total_rows += plans.other.count();
    width = std::max<int64_t>(width, plans.count());
  }
  TORCH_CHECK(total_rows * width < INT32_MAX, "the dS slot table: fewer than 2^31 entries");
  auto slots = torch::full({total_rows * width}, -1, torch::dtype(torch::kInt32));
  int32_t* slot = slots.data_ptr<int32_t>();
  int64_t visits = 0;
  for (int i = 0; i < mask.num_samples; ++i) {
    const dlm::TilePlans plans = mask.sample(i).bwd_tiles(kBwdBlockM, ds_dq_block_n(d));
    const int64_t row0 = rows.data_ptr<int32_t>()[i];
    for (int kt = 0; kt < plans.count(); ++kt) {
      const dlm::TileRuns runs = plans.runs(kt);
      for (int r = 0; r < 2; ++r)
        for (int qt = runs.begin[r]; qt < runs.end[r]; ++qt) slot[(row0 + qt) * width + kt] = static_cast<int32_t>(visits++);
    }
  }
  TORCH_CHECK(visits < INT32_MAX, "the dS backward: fewer than 2^31 visits");
  return {slots, rows, visits, width};
}

struct LaunchBwd {
  const dlm::sm90::BwdArgs& args;
  bool varlen;
  template <class Elem, int D>
  cudaError_t run() const {
    return varlen ? dlm::sm90::launch_bwd<Elem, D, dlm::sm90::kStartVarlen>(args)
                  : dlm::sm90::launch_bwd<Elem, D>(args);
  }
};

// Writes dq (B, S, H, D), dk and dv (B, S, Hkv, D). lse2 and delta: 1-D fp32 scratch of at least
// B * H * S + kVarlenScratchPad floats, 16-byte aligned (the preprocess zeroes the floats past
// B * H * S that the odd-length / varlen dK/dV kernel reads; csrc/NOTES.md). Packed
// samples (varlen): B = 1, S = total tokens, the orders and samples from varlen_bwd_tile_orders and
// cu_seqlens the (num_samples + 1,) int32 offsets on the device; n_noisy is then unused.
// persistent_dkdv: the persistent dK/dV kernel (D = 64 / 128; other head dims run the one-CTA-per-tile
// kernel regardless). ds_scratch / ds_slots / ds_visits (D = 128 or 256; batched: both halves
// multiples of 128): the backward with dS through HBM (diffusion_bwd.cuh launch_bwd_ds), ds_scratch
// of q's dtype with at least (1 + B * H * ds_visits) * ds_block(D) elements; batched, ds_slots the
// (S / 64) x (S / key tile) int32 slot table and dq_order the third of bwd_tile_orders; packed
// samples, ds_slots / ds_rows / ds_visits / ds_k_tiles from varlen_ds_slots and dq_order / dq_sample
// its fifth and sixth of varlen_bwd_tile_orders. dkdv_schedule: dkdv_schedule's (batched) or
// varlen_dkdv_schedule's (packed samples) for this call's B * Hkv slots on min(SM count, items)
// CTAs, on the device, walked where the dK/dV kernel that runs is the persistent one (ignored
// otherwise); none: the snake.
// dkdv_order_chunk / dkdv_order_block (the dS backward's dK/dV kernel only; others walk the plain
// order): its work_order arguments, chunk 0 the plain order; a dkdv_schedule must be built for the
// same two. dq_schedule (the dS backward only): ds_dq_schedule's (batched) or varlen_ds_dq_schedule's
// (packed samples) for this call's B * H slots on min(SM count, items) CTAs of q's device, on that
// device; none: the dQ-from-dS kernel walks the snake.

// A persistent kernel's schedule for its `items` work items, checked against the grid it launches
// with (min(items, SM count) CTAs; a schedule is built only where there are more items).
const int32_t* persistent_schedule(const torch::Tensor& schedule, const c10::Device& dev, int64_t items,
                                   const char* name) {
  TORCH_CHECK(items < INT32_MAX, name, ": fewer than 2^31 work items");
  int ctas = static_cast<int>(items);
  C10_CUDA_CHECK(dlm::sm90::cap_at_sm_count(ctas));
  TORCH_CHECK(ctas < items, name, ": calls with more work items than SMs");
  dlm_bindings::check_schedule(schedule, dev, ctas, items);
  return schedule.data_ptr<int32_t>();
}
}  // namespace

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
                   std::optional<torch::Tensor> dq_schedule) {
  const bool varlen = cu_seqlens.has_value();
  dlm_bindings::check_work_order(dkdv_order_chunk, dkdv_order_block);
  TORCH_CHECK(ds_scratch.has_value() || dkdv_order_chunk == 0, "dkdv_order_chunk: the dS backward only");
  const auto dev = q.device();
  for (const auto& t : {dout, k, v, out, lse, dq, dk, dv, lse2, delta, dkdv_order, dq_order})
    TORCH_CHECK(t.device() == dev, "all tensors on one CUDA device");
  TORCH_CHECK(q.is_cuda(), "CUDA tensors");
  for (const auto& t : {dout, k, v, out, dq, dk, dv})
    TORCH_CHECK(t.scalar_type() == q.scalar_type(), "one dtype for q, k, v, out, dout and the grads");
  for (const auto& t : {lse, lse2, delta}) TORCH_CHECK(t.scalar_type() == torch::kFloat32, "fp32 lse");
  TORCH_CHECK(dkdv_order.scalar_type() == torch::kInt32 && dq_order.scalar_type() == torch::kInt32 &&
                  dkdv_order.is_contiguous() && dq_order.is_contiguous(),
              "contiguous int32 tile orders");
  TORCH_CHECK(n_noisy >= 0 && n_noisy <= q.size(1) && block_size >= 1, "bad mask");
  TORCH_CHECK(dlm::sm90::kBatchedStart != dlm::sm90::kStartTile || varlen ||
                  (n_noisy % 128 == 0 && (q.size(1) - n_noisy) % 128 == 0),
              "both halves must be multiples of 128 long (kBatchedStart is kStartTile)");
  if (varlen) {
    TORCH_CHECK(dkdv_sample.has_value() && dq_sample.has_value() && q.size(0) == 1,
                "varlen: batch 1, cu_seqlens and both sample tables");
    for (const auto& t : {*dkdv_sample, *dq_sample, *cu_seqlens})
      TORCH_CHECK(t.device() == dev && t.scalar_type() == torch::kInt32 && t.is_contiguous(),
                  "varlen tables: contiguous int32 on q's device");
    TORCH_CHECK(dkdv_sample->numel() == dkdv_order.numel() && dq_sample->numel() == dq_order.numel(),
                "one sample per work entry");
  }
  for (const auto& t : {dout, q, k, v, out, dq, dk, dv})
    TORCH_CHECK(t.dim() == 4 && t.stride(3) == 1, "(B, S, H, D) layout with unit stride in D");
  dlm_bindings::check_tma_aligned({dout, q, k, v}, "q, k, v and dout");
  TORCH_CHECK(lse.dim() == 3 && lse.stride(2) == 1, "lse layout");
  const int64_t rows = q.size(0) * q.size(1) * q.size(2);
  for (const auto& t : {lse2, delta}) {
    TORCH_CHECK(t.dim() == 1 && t.is_contiguous() && t.numel() >= rows + dlm::sm90::kVarlenScratchPad &&
                    reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0,
                "lse2 / delta: 16-byte aligned 1-D scratch of B * H * S + ", dlm::sm90::kVarlenScratchPad,
                " floats");
  }
  if (dlse) {
    TORCH_CHECK(dlse->device() == dev && dlse->scalar_type() == torch::kFloat32 && dlse->dim() == 3 &&
                    dlse->stride(2) == 1, "dlse: fp32 (B, H, S) with unit stride in S");
  }
  TORCH_CHECK(ds_scratch.has_value() == ds_slots.has_value(), "ds_scratch and ds_slots together");
  TORCH_CHECK(ds_rows.has_value() == (varlen && ds_scratch.has_value()),
              "ds_rows: with ds_scratch over packed samples, and only then");
  if (ds_scratch) {
    const int64_t s = q.size(1), d = q.size(3), block = ds_block(d);
    TORCH_CHECK(block && (varlen || (n_noisy % kDsDqBlockM == 0 && (s - n_noisy) % kDsDqBlockM == 0)),
                "the dS backward: D = 128 or 256; batched, both halves multiples of ", kDsDqBlockM);
    TORCH_CHECK(ds_scratch->device() == dev && ds_scratch->scalar_type() == q.scalar_type() &&
                    ds_scratch->is_contiguous() && reinterpret_cast<uintptr_t>(ds_scratch->data_ptr()) % 16 == 0 &&
                    ds_visits >= 0 && ds_scratch->numel() >= (1 + q.size(0) * q.size(2) * ds_visits) * block,
                "ds_scratch: contiguous, q's dtype, (1 + B * H * ds_visits) * ", block, " elements");
    TORCH_CHECK(ds_slots->device() == dev && ds_slots->scalar_type() == torch::kInt32 && ds_slots->is_contiguous(),
                "ds_slots: contiguous int32 on q's device");
    if (varlen) {  // varlen_ds_slots' table: the rows of every sample, ds_k_tiles wide
      TORCH_CHECK(ds_rows->device() == dev && ds_rows->scalar_type() == torch::kInt32 && ds_rows->is_contiguous() &&
                      ds_rows->numel() == cu_seqlens->numel() - 1,
                  "ds_rows: contiguous int32 on q's device, one per sample");
      TORCH_CHECK(ds_k_tiles > 0 && ds_slots->numel() % ds_k_tiles == 0,
                  "ds_slots: rows of ds_k_tiles entries (varlen_ds_slots)");
    } else {
      const int64_t key_tiles = s / ds_dq_block_n(static_cast<int>(d));
      TORCH_CHECK(ds_k_tiles == 0 && ds_slots->numel() == (s / kBwdBlockM) * key_tiles,
                  "ds_slots: (S / ", kBwdBlockM, ") * ", key_tiles, " entries, ds_k_tiles 0");
      TORCH_CHECK(dq_order.size(0) == s / kDsDqBlockM,
                  "dq_order: the dQ-from-dS kernel's query tiles (bwd_tile_orders()[2]), ", s / kDsDqBlockM);
    }
  }
  const c10::cuda::CUDAGuard guard(dev);
  dlm::sm90::BwdArgs a{};
  a.q = q.data_ptr(), a.k = k.data_ptr(), a.v = v.data_ptr(), a.o = out.data_ptr();
  a.dout = dout.data_ptr(), a.dq = dq.data_ptr(), a.dk = dk.data_ptr(), a.dv = dv.data_ptr();
  a.lse = lse.data_ptr<float>(), a.dlse = dlse ? dlse->data_ptr<float>() : nullptr;
  a.lse2 = lse2.data_ptr<float>(), a.delta = delta.data_ptr<float>();
  strides3(q, a.q_stride), strides3(k, a.k_stride), strides3(v, a.v_stride);
  strides3(out, a.o_stride), strides3(dout, a.do_stride);
  strides3(dq, a.dq_stride), strides3(dk, a.dk_stride), strides3(dv, a.dv_stride);
  a.lse_stride[0] = lse.stride(0), a.lse_stride[1] = lse.stride(1);
  if (dlse) a.dlse_stride[0] = dlse->stride(0), a.dlse_stride[1] = dlse->stride(1);
  a.batch = q.size(0), a.seqlen = q.size(1), a.heads = q.size(2), a.kv_heads = k.size(2);
  a.n_noisy = varlen ? 0 : static_cast<int>(n_noisy), a.block_size = static_cast<int>(block_size);
  a.scale = static_cast<float>(scale);
  a.dkdv_order = dkdv_order.data_ptr<int32_t>(), a.dkdv_tiles = dkdv_order.size(0);
  a.dq_order = dq_order.data_ptr<int32_t>(), a.dq_tiles = dq_order.size(0);
  a.stream = c10::cuda::getCurrentCUDAStream();
  a.persistent_dkdv = persistent_dkdv;  // honoured where the head dim has the kernel (D = 64 / 128)
  if (ds_scratch) {
    a.ds_scratch = ds_scratch->data_ptr(), a.ds_slots = ds_slots->data_ptr<int32_t>();
    a.ds_visits = static_cast<int>(ds_visits);
    a.ds_k_tiles = static_cast<int>(ds_k_tiles);
    if (ds_rows) a.ds_rows = ds_rows->data_ptr<int32_t>();
    a.dkdv_order_chunk = static_cast<int>(dkdv_order_chunk);
    a.dkdv_order_block = static_cast<int>(dkdv_order_block);
  }
  if (varlen) {
    a.dkdv_sample = dkdv_sample->data_ptr<int32_t>(), a.dq_sample = dq_sample->data_ptr<int32_t>();
    a.cu_seqlens = cu_seqlens->data_ptr<int32_t>();
  }
  if (dkdv_schedule)
    a.dkdv_schedule = persistent_schedule(*dkdv_schedule, dev, int64_t{a.batch} * a.kv_heads * a.dkdv_tiles,
                                          "dkdv_schedule");
  if (dq_schedule) {
    TORCH_CHECK(ds_scratch.has_value(), "dq_schedule: the dS backward's dQ kernel only");
    a.dq_schedule = persistent_schedule(*dq_schedule, dev, int64_t{a.batch} * a.heads * a.dq_tiles, "dq_schedule");
  }
  // launch_bwd skips empty problems and each gradient kernel whose grid would be empty.
  const cudaError_t err =
      dlm_bindings::dispatch<64, 128, 256>(q.scalar_type(), q.size(3), LaunchBwd{a, varlen});
  C10_CUDA_CHECK(err);
}

int64_t bwd_scratch_pad() { return dlm::sm90::kVarlenScratchPad; }

void add_bwd(pybind11::module_& m) {
  m.def("bwd_tile_orders", &bwd_tile_orders);
  m.def("varlen_bwd_tile_orders", &varlen_bwd_tile_orders);
  m.def("varlen_ds_slots", &varlen_ds_slots, pybind11::arg("cu_seqlens"), pybind11::arg("block_size"),
        pybind11::arg("head_dim"));
  m.def("dkdv_schedule", &dkdv_schedule, pybind11::arg("n_noisy"), pybind11::arg("n_clean"),
        pybind11::arg("block_size"), pybind11::arg("head_dim"), pybind11::arg("slots"),
        pybind11::arg("group"), pybind11::arg("ctas"), pybind11::arg("order_chunk") = 0,
        pybind11::arg("order_block") = 0);
  m.def("varlen_dkdv_schedule", &varlen_dkdv_schedule, pybind11::arg("cu_seqlens"), pybind11::arg("block_size"),
        pybind11::arg("head_dim"), pybind11::arg("slots"), pybind11::arg("group"), pybind11::arg("ctas"),
        pybind11::arg("order_block") = 0);
  m.def("ds_dq_schedule", &ds_dq_schedule, pybind11::arg("n_noisy"), pybind11::arg("n_clean"),
        pybind11::arg("block_size"), pybind11::arg("head_dim"), pybind11::arg("batch"), pybind11::arg("heads"),
        pybind11::arg("kv_heads"), pybind11::arg("ctas"), pybind11::arg("device"));
  m.def("varlen_ds_dq_schedule", &varlen_ds_dq_schedule, pybind11::arg("cu_seqlens"), pybind11::arg("block_size"),
        pybind11::arg("head_dim"), pybind11::arg("heads"), pybind11::arg("kv_heads"), pybind11::arg("ctas"),
        pybind11::arg("device"));
  m.def("bwd", &diffusion_bwd, pybind11::arg("dout"), pybind11::arg("q"), pybind11::arg("k"), pybind11::arg("v"),
        pybind11::arg("out"), pybind11::arg("lse"), pybind11::arg("dlse"), pybind11::arg("dq"),
        pybind11::arg("dk"), pybind11::arg("dv"), pybind11::arg("lse2"), pybind11::arg("delta"),
        pybind11::arg("dkdv_order"), pybind11::arg("dq_order"), pybind11::arg("n_noisy"),
        pybind11::arg("block_size"), pybind11::arg("scale"),
        pybind11::arg("dkdv_sample") = pybind11::none(), pybind11::arg("dq_sample") = pybind11::none(),
        pybind11::arg("cu_seqlens") = pybind11::none(), pybind11::arg("persistent_dkdv") = false,
        pybind11::arg("ds_scratch") = pybind11::none(), pybind11::arg("ds_slots") = pybind11::none(),
        pybind11::arg("ds_visits") = 0, pybind11::arg("dkdv_schedule") = pybind11::none(),
        pybind11::arg("dkdv_order_chunk") = 0, pybind11::arg("dkdv_order_block") = 0,
        pybind11::arg("ds_rows") = pybind11::none(), pybind11::arg("ds_k_tiles") = 0,
        pybind11::arg("dq_schedule") = pybind11::none());
  m.attr("scratch_pad") = bwd_scratch_pad();  // floats past lse2 / delta (the kernels zero them)
  m.def("ds_block", &ds_block, pybind11::arg("head_dim"));
}
}  // namespace dlm_bindings
