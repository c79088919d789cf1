// simt translation unit of the tensor-core attention launcher: runtime dtype dispatch.
#include "kernels/attention_tc_dispatch.cuh"
