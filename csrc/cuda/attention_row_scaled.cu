// nvcc translation unit of the CUDA-core attention kernels over caches quantized per (token, head):
// int8, int4 and fp8 with row scales, each instantiation for every query dtype (torch-free).
#include "kernels/attention_kernels.cuh"

PAGEDKV_INSTANTIATE_ATTENTION_ROW_SCALED(int8_t)
PAGEDKV_INSTANTIATE_ATTENTION_ROW_SCALED(pagedkv::int4x2)
PAGEDKV_INSTANTIATE_ATTENTION_ROW_SCALED(pagedkv::fp8_e4m3)
PAGEDKV_INSTANTIATE_ATTENTION_ROW_SCALED(pagedkv::fp8_e5m2)
