// nvcc translation unit of the attention kernels with __half queries (torch-free).
#include "kernels/attention_kernels.cuh"

PAGEDKV_INSTANTIATE_ATTENTION(__half)
