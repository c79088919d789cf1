// The cache kernels' CUDA source compiled as host C++ against the emulator: defines the
// launchers pagedkv::simt::{reshape_and_cache, copy_blocks, swap_blocks} (cache_launch.h).
#include "kernels/cache_kernels.cuh"
