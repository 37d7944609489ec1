// One varlen instantiation of the sm90 backward (packed samples, kStartVarlen; its own translation
// unit so that ninja builds it in parallel with the batched ones).
#include "hopper/diffusion_bwd.cuh"

template cudaError_t dlm::sm90::launch_bwd<cutlass::half_t, 256, dlm::sm90::kStartVarlen>(
    const dlm::sm90::BwdArgs&);
