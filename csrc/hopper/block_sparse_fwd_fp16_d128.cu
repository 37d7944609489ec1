// One instantiation of the sm90 block-sparse forward (csrc/hopper/block_sparse_fwd.cuh).
#include "hopper/block_sparse_fwd.cuh"

template cudaError_t dlm::sm90::launch_block_sparse_fwd<cutlass::half_t, 128>(const dlm::sm90::SparseFwdArgs&);
