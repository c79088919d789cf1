// simt translation unit of the attention kernels with __nv_bfloat16 queries: the CUDA source compiled as
// host C++ against the emulator (which comes in through compat.cuh).
#include "kernels/attention_kernels.cuh"

PAGEDKV_INSTANTIATE_ATTENTION(__nv_bfloat16)
