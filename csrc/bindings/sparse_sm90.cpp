// The Python module of the sm90 block-sparse forward (sparse_fwd_sm90.cu), its work order
// (work_order_sm90.cu) and the column-sparse forward's gather (column_gather_sm90.cu): its own JIT
// extension, dlm_sparse_sm90, so that a user of the sparse ops never compiles the block-diffusion kernels
// (diffusion_sm90.cpp), nor the reverse.
#include <torch/extension.h>

namespace dlm_bindings {
void add_sparse_fwd(pybind11::module_& m);
void add_column_gather(pybind11::module_& m);
void add_work_order(pybind11::module_& m);
}  // namespace dlm_bindings

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  dlm_bindings::add_sparse_fwd(m);
  dlm_bindings::add_column_gather(m);
  dlm_bindings::add_work_order(m);
}
