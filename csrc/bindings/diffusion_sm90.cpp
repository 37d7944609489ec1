// The one Python module of the sm90 block-diffusion kernels: the forward's functions
// (diffusion_fwd_sm90.cu), the backward's (diffusion_bwd_sm90.cu) and the backward's autograd node
// (diffusion_autograd_sm90.cpp), so that one JIT build, one message and one cache directory serve
// both directions.
#include <torch/extension.h>

namespace dlm_bindings {
void add_fwd(pybind11::module_& m);
void add_bwd(pybind11::module_& m);
void add_autograd(pybind11::module_& m);
}  // namespace dlm_bindings

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  dlm_bindings::add_fwd(m);
  dlm_bindings::add_bwd(m);
  dlm_bindings::add_autograd(m);
}
