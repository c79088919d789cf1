// nvcc translation unit of the MLA tensor-core attention kernels with __nv_bfloat16 queries
// (torch-free).
#include "kernels/attention_mla.cuh"

PAGEDKV_INSTANTIATE_MLA_ATTENTION(__nv_bfloat16)
