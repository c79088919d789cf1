// CUDA backend of the cache ops: device guard, current stream, launch (the checks are the ops',
// csrc/ops/). No host sync and no host read of device data (index ranges are checked only in
// PAGEDKV_CHECK_INDICES=1 mode).
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "kernels/cache_launch.h"
#include "ops/copy_blocks.h"
#include "ops/mla_cache.h"
#include "ops/reshape_and_cache.h"
#include "ops/swap_blocks.h"

namespace pagedkv {
namespace {

void reshape_and_cache(const ReshapeAndCacheParams& p, const at::Tensor& key_cache) {
  const c10::cuda::CUDAGuard guard(key_cache.device());
  C10_CUDA_CHECK(cuda::reshape_and_cache(p, c10::cuda::getCurrentCUDAStream()));
}

void copy_blocks(const CopyBlocksParams& p, const at::Tensor& key_cache) {
  const c10::cuda::CUDAGuard guard(key_cache.device());
  C10_CUDA_CHECK(cuda::copy_blocks(p, c10::cuda::getCurrentCUDAStream()));
}

// The ops' checks leave one GPU, or a GPU and the CPU.
void swap_blocks(const SwapBlocksParams& p, const at::Tensor& src, const at::Tensor& dst) {
  const cudaMemcpyKind kind = !src.is_cuda() ? cudaMemcpyHostToDevice
                              : dst.is_cuda() ? cudaMemcpyDeviceToDevice
                                              : cudaMemcpyDeviceToHost;
  const c10::cuda::CUDAGuard guard(src.is_cuda() ? src.device() : dst.device());
  C10_CUDA_CHECK(cuda::swap_blocks(p, kind, c10::cuda::getCurrentCUDAStream()));
}

void concat_and_cache_mla(const ConcatAndCacheMlaParams& p, const at::Tensor& kv_cache) {
  const c10::cuda::CUDAGuard guard(kv_cache.device());
  C10_CUDA_CHECK(cuda::concat_and_cache_mla(p, c10::cuda::getCurrentCUDAStream()));
}

void gather_cache(const GatherCacheParams& p, const at::Tensor& kv_cache) {
  const c10::cuda::CUDAGuard guard(kv_cache.device());
  C10_CUDA_CHECK(cuda::gather_cache(p, c10::cuda::getCurrentCUDAStream()));
}

}  // namespace

TORCH_LIBRARY_IMPL(pagedkv, CUDA, m) {
  m.impl("reshape_and_cache", &reshape_and_cache_op<&reshape_and_cache>);
  m.impl("copy_blocks", &copy_blocks_op<&copy_blocks>);
  m.impl("swap_blocks", &swap_blocks_op<&swap_blocks>);
  m.impl("concat_and_cache_mla", &concat_and_cache_mla_op<&concat_and_cache_mla>);
  m.impl("gather_cache", &gather_cache_op<&gather_cache>);
}

}  // namespace pagedkv
