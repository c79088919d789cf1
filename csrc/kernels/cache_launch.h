// Launchers of the cache kernels, as the torch glue sees them. Torch-free and CUDA-compiler-free:
// the definitions live in cache_kernels.cuh, compiled by nvcc (namespace cuda) and by g++ against
// the emulator (namespace simt).
#pragma once
#include <driver_types.h>

#include "kernels/cache_params.h"

namespace pagedkv {

#define PAGEDKV_CACHE_LAUNCHERS                                                        \
  cudaError_t reshape_and_cache(const ReshapeAndCacheParams& p, cudaStream_t stream); \
  cudaError_t copy_blocks(const CopyBlocksParams& p, cudaStream_t stream);            \
  cudaError_t swap_blocks(const SwapBlocksParams& p, cudaMemcpyKind kind, cudaStream_t stream); \
  cudaError_t concat_and_cache_mla(const ConcatAndCacheMlaParams& p, cudaStream_t stream);    \
  cudaError_t gather_cache(const GatherCacheParams& p, cudaStream_t stream);

namespace cuda {
PAGEDKV_CACHE_LAUNCHERS
}
namespace simt {
PAGEDKV_CACHE_LAUNCHERS
}

#undef PAGEDKV_CACHE_LAUNCHERS

}  // namespace pagedkv
