// One instantiation of the sm90 forward (csrc/hopper/diffusion_fwd.cuh says why one per file).
#include "hopper/diffusion_fwd.cuh"

template cudaError_t dlm::sm90::launch_fwd<cutlass::half_t, 256>(const dlm::sm90::FwdArgs&);
