// nvcc translation unit of the attention kernels with float queries (torch-free).
#include "kernels/attention_kernels.cuh"

PAGEDKV_INSTANTIATE_ATTENTION(float)
