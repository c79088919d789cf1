// simt translation unit of the MLA tensor-core attention kernels with __half queries: the
// CUDA source compiled as host C++ against the emulator (which comes in through compat.cuh).
#include "kernels/attention_mla.cuh"

PAGEDKV_INSTANTIATE_MLA_ATTENTION(__half)
