// nvcc translation unit of the cache kernels (torch-free: fast to compile, and the one the
// ptxas resource report builds).
#include "kernels/cache_kernels.cuh"
