// nvcc translation unit of the tensor-core attention kernels with __nv_bfloat16 queries (torch-free).
#include "kernels/attention_tc.cuh"

PAGEDKV_INSTANTIATE_ATTENTION_TC(__nv_bfloat16)
