// simt translation unit of the attention kernels with __half queries: the CUDA source compiled as
// host C++ against the emulator (which comes in through compat.cuh).
#include "kernels/attention_kernels.cuh"

PAGEDKV_INSTANTIATE_ATTENTION(__half)
