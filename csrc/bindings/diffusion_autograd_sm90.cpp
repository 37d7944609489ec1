// The eager training step's backward as a C++ autograd node.
//
// Why: on CUDA the autograd engine runs a backward on its device thread. A Python node's body there
// cost the H200's host 0.2-0.4 ms per step at n = 1K (benchmarks.host_time --nodes, session 36,
// B 8, H 16, D 128, best burst: the step 0.437 ms; with autograd's multithreading off, i.e. the
// backward on the calling thread, 0.238; the backend's Python bwd alone on the main thread 0.075),
// and left the step waiting on the host. Here the Python backend plans the backward in the forward
// (dlm_ops/backends/cutlass_diffusion.py _plan_bwd: BwdCall, made a BwdPlan below), and the node
// runs that plan without Python: allocations, views and the kernels' launch (diffusion_bwd).
//
// run_bwd is the C++ executor of a plan and mirrors cutlass_diffusion._launch_bwd, the Python one
// (the backward op's body): the same views, the same allocations, the same launch. The GPU tests
// hold the two to bitwise equal gradients on every layout.
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/functions/basic_ops.h>
#include <torch/extension.h>

#include <cstdint>
#include <limits>
#include <optional>
#include <tuple>
#include <vector>

#include "bindings/diffusion_bwd_sm90.h"

namespace {

using torch::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// BwdCall.layout: how the kernels see the tensors.
enum Layout : int64_t {
  kAsGiven = 0,     // (B, S, H, D) as given
  kAsPacked = 1,    // a batched call as one packed batch: (1, B S, H, D), lse (1, H, B S)
  kAsOneBatch = 2,  // packed samples' (total, H, D) as (1, total, H, D)
};

// Everything a backward's launch needs besides the tensors autograd hands it: the keywords of
// the module's `bwd` after the tensors, the layout, the dS scratch's size, NaN-poisoned outputs.
struct BwdPlan : torch::CustomClassHolder {
  int64_t layout = kAsGiven, ds_elems = 0;
  bool poison = false;
  Tensor dkdv_order, dq_order;
  int64_t n_noisy = 0, block_size = 1;
  double scale = 1.0;
  std::optional<Tensor> dkdv_sample, dq_sample, cu_seqlens;
  bool persistent_dkdv = false;
  std::optional<Tensor> ds_slots;
  int64_t ds_visits = 0;
  std::optional<Tensor> dkdv_schedule;
  int64_t dkdv_order_chunk = 0, dkdv_order_block = 0;
  std::optional<Tensor> ds_rows;
  int64_t ds_k_tiles = 0;
  std::optional<Tensor> dq_schedule;
};

// cutlass.tma_ready: unit stride in D, 16-byte aligned base and strides of dims 0..2.
bool tma_ready(const Tensor& t) {
  const int64_t size = t.element_size();
  return t.stride(3) == 1 && reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0 &&
         (t.stride(0) * size) % 16 == 0 && (t.stride(1) * size) % 16 == 0 && (t.stride(2) * size) % 16 == 0;
}

// A batched (B, H, S) lse or dlse as the packed call's (1, H, B S).
Tensor as_rows(const Tensor& x, int64_t h) { return x.to(torch::kFloat32).transpose(0, 1).reshape({1, h, -1}); }

Tensor new_output(const Tensor& like, bool poison) {
  Tensor t = torch::empty(like.sizes(), like.options());
  return poison ? t.fill_(std::numeric_limits<double>::quiet_NaN()) : t;
}

std::vector<Tensor> run_bwd(const BwdPlan& p, Tensor dout, const Tensor& q0, const Tensor& k0, const Tensor& v0,
                            Tensor out, Tensor lse, std::optional<Tensor> dlse) {
  // dout comes from autograd in any layout (an expand, a transpose): one copy makes it TMA-ready.
  // An empty dout (no token) can keep an expand's zero strides through contiguous().
  if (!tma_ready(dout.dim() == 4 ? dout : dout.unsqueeze(0)))
    dout = dout.numel() ? dout.contiguous() : torch::empty(dout.sizes(), dout.options());
  Tensor q = q0, k = k0, v = v0;
  if (p.layout == kAsOneBatch) {
    dout = dout.unsqueeze(0), q = q.unsqueeze(0), k = k.unsqueeze(0), v = v.unsqueeze(0), out = out.unsqueeze(0);
    lse = lse.unsqueeze(0);
    if (dlse) dlse = dlse->unsqueeze(0);
  } else if (p.layout == kAsPacked) {
    const int64_t b = q.size(0), s = q.size(1), h = q.size(2);
    if (dout.stride(0) != s * dout.stride(1)) dout = dout.contiguous();
    if (out.stride(0) != s * out.stride(1)) out = out.contiguous();
    const auto packed = [b, s](const Tensor& t) { return t.view({1, b * s, t.size(2), t.size(3)}); };
    dout = packed(dout), q = packed(q), k = packed(k), v = packed(v), out = packed(out);
    lse = as_rows(lse, h);
    if (dlse) dlse = as_rows(*dlse, h);
  }
  const int64_t rows = q.size(0) * q.size(1) * q.size(2);
  if (rows == 0)  // no token: nothing to launch (an empty packing still gets its backward)
    return {torch::empty_like(q0), torch::empty_like(k0), torch::empty_like(v0)};
  lse = lse.to(torch::kFloat32).contiguous();
  if (dlse) dlse = dlse->to(torch::kFloat32).contiguous();
  Tensor dq = new_output(q, p.poison), dk = new_output(k, p.poison), dv = new_output(v, p.poison);
  // lse2 and delta in one allocation, each 16-byte aligned (cutlass_diffusion._scratch).
  const int64_t width = (rows + 3) / 4 * 4 + dlm_bindings::bwd_scratch_pad();
  const Tensor scratch = torch::empty({2, width}, q.options().dtype(torch::kFloat32));
  std::optional<Tensor> ds_scratch;
  if (p.ds_elems) ds_scratch = torch::empty({p.ds_elems}, q.options());
  dlm_bindings::diffusion_bwd(dout, q, k, v, out, lse, dlse, dq, dk, dv, scratch[0], scratch[1], p.dkdv_order,
                              p.dq_order, p.n_noisy, p.block_size, p.scale, p.dkdv_sample, p.dq_sample,
                              p.cu_seqlens, p.persistent_dkdv, ds_scratch, p.ds_slots, p.ds_visits,
                              p.dkdv_schedule, p.dkdv_order_chunk, p.dkdv_order_block, p.ds_rows,
                              p.ds_k_tiles, p.dq_schedule);
  return {dq.view(q0.sizes()), dk.view(k0.sizes()), dv.view(v0.sizes())};
}

// A forward's outputs, handed to the node's forward inside a struct so that autograd does not take
// them for inputs (it would return views of them).
struct Outputs {
  Tensor out, lse;
};

// The node: saves q, k, v, out and lse (saved-tensor hooks apply) and the plan; its backward is
// run_bwd. Gradients not asked for arrive undefined (set_materialize_grads(false), as the Python
// node): an unused lse costs no fill. As once_differentiable, a backward that builds a graph
// (create_graph) returns gradients whose own backward raises, not silently zero ones.
struct DiffusionAttnCutlassBackward : public torch::autograd::Function<DiffusionAttnCutlassBackward> {
  static variable_list forward(AutogradContext* ctx, const Tensor& q, const Tensor& k, const Tensor& v,
                               Outputs outputs, c10::intrusive_ptr<BwdPlan> plan) {
    ctx->set_materialize_grads(false);
    ctx->save_for_backward({q, k, v, outputs.out, outputs.lse});
    ctx->saved_data["plan"] = c10::IValue::make_capsule(std::move(plan));
    return {outputs.out, outputs.lse};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const auto plan = c10::static_intrusive_pointer_cast<BwdPlan>(ctx->saved_data["plan"].toCapsule());
    const Tensor& out = saved[3];
    const Tensor dout = grads[0].defined() ? grads[0] : torch::zeros_like(out);
    const std::optional<Tensor> dlse = grads[1].defined() ? std::optional<Tensor>(grads[1]) : std::nullopt;
    variable_list g = run_bwd(*plan, dout, saved[0], saved[1], saved[2], out, saved[4], dlse);
    if (at::GradMode::is_enabled()) {
      for (Tensor& t : g) t = t.detach().requires_grad_(true);
      g = torch::autograd::DelayedError(
              "trying to differentiate twice dlm_ops' block-diffusion attention backward, which is "
              "not differentiable",
              3)
              .apply(std::move(g));
    }
    return {g[0], g[1], g[2], Tensor(), Tensor()};  // one per forward argument
  }
};

std::tuple<Tensor, Tensor> attach_bwd(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                                      const Tensor& lse, c10::intrusive_ptr<BwdPlan> plan) {
  TORCH_CHECK(plan->layout >= kAsGiven && plan->layout <= kAsOneBatch, "BwdPlan: layout 0, 1 or 2");
  TORCH_CHECK(!out.requires_grad() && !lse.requires_grad(), "attach_bwd: out and lse of a forward without grad");
  variable_list r = DiffusionAttnCutlassBackward::apply(q, k, v, Outputs{out, lse}, std::move(plan));
  return {r[0], r[1]};
}

}  // namespace

namespace dlm_bindings {
void add_autograd(pybind11::module_& m) {  // the module: csrc/bindings/diffusion_sm90.cpp
  namespace py = pybind11;
  py::class_<BwdPlan, c10::intrusive_ptr<BwdPlan>>(m, "BwdPlan")
      .def(py::init([](int64_t layout, int64_t ds_elems, bool poison, Tensor dkdv_order, Tensor dq_order,
                       int64_t n_noisy, int64_t block_size, double scale, std::optional<Tensor> dkdv_sample,
                       std::optional<Tensor> dq_sample, std::optional<Tensor> cu_seqlens, bool persistent_dkdv,
                       std::optional<Tensor> ds_slots, int64_t ds_visits, std::optional<Tensor> dkdv_schedule,
                       int64_t dkdv_order_chunk, int64_t dkdv_order_block, std::optional<Tensor> ds_rows,
                       int64_t ds_k_tiles, std::optional<Tensor> dq_schedule) {
             auto p = c10::make_intrusive<BwdPlan>();
             p->layout = layout, p->ds_elems = ds_elems, p->poison = poison;
             p->dkdv_order = std::move(dkdv_order), p->dq_order = std::move(dq_order);
             p->n_noisy = n_noisy, p->block_size = block_size, p->scale = scale;
             p->dkdv_sample = std::move(dkdv_sample), p->dq_sample = std::move(dq_sample);
             p->cu_seqlens = std::move(cu_seqlens), p->persistent_dkdv = persistent_dkdv;
             p->ds_slots = std::move(ds_slots), p->ds_visits = ds_visits;
             p->dkdv_schedule = std::move(dkdv_schedule);
             p->dkdv_order_chunk = dkdv_order_chunk, p->dkdv_order_block = dkdv_order_block;
             p->ds_rows = std::move(ds_rows), p->ds_k_tiles = ds_k_tiles;
             p->dq_schedule = std::move(dq_schedule);
             return p;
           }),
           py::kw_only(), py::arg("layout"), py::arg("ds_elems"), py::arg("poison"), py::arg("dkdv_order"),
           py::arg("dq_order"), py::arg("n_noisy"), py::arg("block_size"), py::arg("scale"),
           py::arg("dkdv_sample") = py::none(), py::arg("dq_sample") = py::none(),
           py::arg("cu_seqlens") = py::none(), py::arg("persistent_dkdv") = false,
           py::arg("ds_slots") = py::none(), py::arg("ds_visits") = 0, py::arg("dkdv_schedule") = py::none(),
           py::arg("dkdv_order_chunk") = 0, py::arg("dkdv_order_block") = 0, py::arg("ds_rows") = py::none(),
           py::arg("ds_k_tiles") = 0, py::arg("dq_schedule") = py::none());
  m.def("run_bwd",
        [](const c10::intrusive_ptr<BwdPlan>& plan, Tensor dout, const Tensor& q, const Tensor& k, const Tensor& v,
           Tensor out, Tensor lse, std::optional<Tensor> dlse) {
          auto g = run_bwd(*plan, std::move(dout), q, k, v, std::move(out), std::move(lse), std::move(dlse));
          return std::make_tuple(g[0], g[1], g[2]);
        },
        py::arg("plan"), py::arg("dout"), py::arg("q"), py::arg("k"), py::arg("v"), py::arg("out"),
        py::arg("lse"), py::arg("dlse"));
  m.def("attach_bwd", &attach_bwd, py::arg("q"), py::arg("k"), py::arg("v"), py::arg("out"), py::arg("lse"),
        py::arg("plan"));
}
}  // namespace dlm_bindings
