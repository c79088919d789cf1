// simt translation unit of the CUDA-core attention kernels over caches quantized per (token, head):
// the CUDA source compiled as host C++ against the emulator (which comes in through compat.cuh).
#include "kernels/attention_kernels.cuh"

PAGEDKV_INSTANTIATE_ATTENTION_ROW_SCALED(int8_t)
PAGEDKV_INSTANTIATE_ATTENTION_ROW_SCALED(pagedkv::int4x2)
PAGEDKV_INSTANTIATE_ATTENTION_ROW_SCALED(pagedkv::fp8_e4m3)
PAGEDKV_INSTANTIATE_ATTENTION_ROW_SCALED(pagedkv::fp8_e5m2)
