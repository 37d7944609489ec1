// One instantiation of the sm90 backward (csrc/hopper/diffusion_bwd.cuh; one per file so that
// ninja builds them in parallel).
#include "hopper/diffusion_bwd.cuh"

template cudaError_t dlm::sm90::launch_bwd<cutlass::bfloat16_t, 256>(const dlm::sm90::BwdArgs&);
