// nvcc translation unit of the tensor-core attention launcher: runtime dtype dispatch (torch-free).
#include "kernels/attention_tc_dispatch.cuh"
