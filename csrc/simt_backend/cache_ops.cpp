// simt glue of the cache ops (mirrors csrc/cuda/cache_ops.cpp): the shared argument checks,
// then the emulated CUDA kernels on CPU tensors. Emulator errors raise RuntimeError.
#include <torch/library.h>

#include "glue/cache_args.h"
#include "kernels/cache_launch.h"

namespace pagedkv {
namespace {

void check(cudaError_t err, const char* op) {
  TORCH_CHECK(err == cudaSuccess, op, ": simt launcher returned CUDA error ", int(err));
}

void reshape_and_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                       at::Tensor& value_cache, const at::Tensor& slot_mapping,
                       const c10::optional<at::Tensor>& k_scale,
                       const c10::optional<at::Tensor>& v_scale) {
  const ReshapeAndCacheParams p =
      reshape_and_cache_params(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale);
  check(simt::reshape_and_cache(p, nullptr), "reshape_and_cache");
}

void copy_blocks(at::TensorList key_caches, at::TensorList value_caches,
                 const at::Tensor& block_mapping) {
  for (const CopyBlocksParams& p : copy_blocks_params(key_caches, value_caches, block_mapping)) {
    check(simt::copy_blocks(p, nullptr), "copy_blocks");
  }
}

void swap_blocks(const at::Tensor& src, at::Tensor& dst, const at::Tensor& block_mapping) {
  const SwapBlocksParams p = swap_blocks_params(src, dst, block_mapping);
  check(simt::swap_blocks(p, cudaMemcpyHostToHost, nullptr), "swap_blocks");
}

}  // namespace

TORCH_LIBRARY_IMPL(pagedkv_simt, CPU, m) {
  m.impl("reshape_and_cache", &reshape_and_cache);
  m.impl("copy_blocks", &copy_blocks);
  m.impl("swap_blocks", &swap_blocks);
}

}  // namespace pagedkv
