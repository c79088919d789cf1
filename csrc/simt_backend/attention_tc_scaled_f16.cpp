// simt translation unit of the tensor-core attention kernels with __half queries over caches
// quantized per (token, head): the CUDA source compiled as host C++ against the emulator (which
// comes in through compat.cuh).
#include "kernels/attention_tc.cuh"

PAGEDKV_INSTANTIATE_ATTENTION_TC_ROW_SCALED(__half)
