// nvcc translation unit of the attention kernels with __nv_bfloat16 queries (torch-free).
#include "kernels/attention_kernels.cuh"

PAGEDKV_INSTANTIATE_ATTENTION(__nv_bfloat16)
