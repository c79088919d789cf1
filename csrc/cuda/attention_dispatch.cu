// nvcc translation unit of the attention launchers: runtime dtype dispatch (torch-free).
#include "kernels/attention_dispatch.cuh"
