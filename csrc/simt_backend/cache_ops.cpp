// simt backend of the cache ops (mirrors csrc/cuda/cache_ops.cpp): the emulated CUDA kernels on
// CPU tensors, after the ops' checks (csrc/ops/). Emulator errors raise RuntimeError.
#include <torch/library.h>

#include "kernels/cache_launch.h"
#include "ops/copy_blocks.h"
#include "ops/mla_cache.h"
#include "ops/reshape_and_cache.h"
#include "ops/swap_blocks.h"
#include "simt/runtime.h"

namespace pagedkv {
namespace {

void check(cudaError_t err, const char* op) {
  TORCH_CHECK(err == cudaSuccess, op, ": simt launcher returned CUDA error ", int(err), " (",
              ::simt::get_error_string(err), "): ", ::simt::last_error_message());
}

void reshape_and_cache(const ReshapeAndCacheParams& p, const at::Tensor&) {
  check(simt::reshape_and_cache(p, nullptr), "reshape_and_cache");
}

void copy_blocks(const CopyBlocksParams& p, const at::Tensor&) {
  check(simt::copy_blocks(p, nullptr), "copy_blocks");
}

void swap_blocks(const SwapBlocksParams& p, const at::Tensor&, const at::Tensor&) {
  check(simt::swap_blocks(p, cudaMemcpyHostToHost, nullptr), "swap_blocks");
}

void concat_and_cache_mla(const ConcatAndCacheMlaParams& p, const at::Tensor&) {
  check(simt::concat_and_cache_mla(p, nullptr), "concat_and_cache_mla");
}

void gather_cache(const GatherCacheParams& p, const at::Tensor&) {
  check(simt::gather_cache(p, nullptr), "gather_cache");
}

}  // namespace

TORCH_LIBRARY_IMPL(pagedkv_simt, CPU, m) {
  m.impl("reshape_and_cache", &reshape_and_cache_op<&reshape_and_cache>);
  m.impl("copy_blocks", &copy_blocks_op<&copy_blocks>);
  m.impl("swap_blocks", &swap_blocks_op<&swap_blocks>);
  m.impl("concat_and_cache_mla", &concat_and_cache_mla_op<&concat_and_cache_mla>);
  m.impl("gather_cache", &gather_cache_op<&gather_cache>);
}

}  // namespace pagedkv
