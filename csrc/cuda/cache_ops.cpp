// CUDA glue of the cache ops: checks, device guard, current stream, launch. No host sync and no
// host read of device data (index ranges are checked only in PAGEDKV_CHECK_INDICES=1 mode).
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "glue/cache_args.h"
#include "kernels/cache_launch.h"

namespace pagedkv {
namespace {

void reshape_and_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                       at::Tensor& value_cache, const at::Tensor& slot_mapping,
                       const c10::optional<at::Tensor>& k_scale,
                       const c10::optional<at::Tensor>& v_scale) {
  const ReshapeAndCacheParams p =
      reshape_and_cache_params(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale);
  const c10::cuda::CUDAGuard guard(key_cache.device());
  C10_CUDA_CHECK(cuda::reshape_and_cache(p, c10::cuda::getCurrentCUDAStream()));
}

void copy_blocks(at::TensorList key_caches, at::TensorList value_caches,
                 const at::Tensor& block_mapping) {
  const auto chunks = copy_blocks_params(key_caches, value_caches, block_mapping);
  if (chunks.empty()) return;
  const c10::cuda::CUDAGuard guard(key_caches[0].device());
  for (const CopyBlocksParams& p : chunks) {
    C10_CUDA_CHECK(cuda::copy_blocks(p, c10::cuda::getCurrentCUDAStream()));
  }
}

cudaMemcpyKind memcpy_kind(const at::Tensor& src, const at::Tensor& dst) {
  if (src.is_cuda() && dst.is_cuda()) {
    TORCH_CHECK(src.device() == dst.device(),
                "swap_blocks: src and dst must be on one GPU or on a GPU and the CPU, got ",
                src.device(), " and ", dst.device());
    return cudaMemcpyDeviceToDevice;
  }
  TORCH_CHECK(src.is_cpu() || dst.is_cpu(), "swap_blocks: unsupported devices ", src.device(),
              " -> ", dst.device());
  return src.is_cuda() ? cudaMemcpyDeviceToHost : cudaMemcpyHostToDevice;
}

void swap_blocks(const at::Tensor& src, at::Tensor& dst, const at::Tensor& block_mapping) {
  const cudaMemcpyKind kind = memcpy_kind(src, dst);
  const SwapBlocksParams p = swap_blocks_params(src, dst, block_mapping);
  const c10::cuda::CUDAGuard guard(src.is_cuda() ? src.device() : dst.device());
  C10_CUDA_CHECK(cuda::swap_blocks(p, kind, c10::cuda::getCurrentCUDAStream()));
}

}  // namespace

TORCH_LIBRARY_IMPL(pagedkv, CUDA, m) {
  m.impl("reshape_and_cache", &reshape_and_cache);
  m.impl("copy_blocks", &copy_blocks);
  m.impl("swap_blocks", &swap_blocks);
}

}  // namespace pagedkv
