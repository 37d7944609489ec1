// One varlen instantiation of the sm90 forward (packed samples, kStartVarlen; its own translation
// unit so that ninja builds it in parallel with the batched ones).
#include "hopper/diffusion_fwd.cuh"

template cudaError_t dlm::sm90::launch_fwd<cutlass::bfloat16_t, 64, dlm::sm90::kStartVarlen>(
    const dlm::sm90::FwdArgs&);
