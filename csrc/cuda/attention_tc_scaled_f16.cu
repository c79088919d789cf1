// nvcc translation unit of the tensor-core attention kernels with __half queries over caches
// quantized per (token, head): int8, int4 and fp8 e4m3 with row scales (torch-free).
#include "kernels/attention_tc.cuh"

PAGEDKV_INSTANTIATE_ATTENTION_TC_ROW_SCALED(__half)
