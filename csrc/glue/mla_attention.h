// What the CUDA-source backends (cuda, simt) check before launching mla_attention's tensor-core
// kernel, beyond the op's own checks (ops/mla_attention.h): the query dtype, the (kv_lora_rank,
// rope_dim) shapes it has an instantiation for, the cache rows' alignment, the grid. Every error
// names the argument and comes before anything is written.
#pragma once
#include <ATen/ATen.h>

#include "glue/attention_plan.h"
#include "kernels/attention_mla_launch.h"

namespace pagedkv {

inline void check_mla_kernel(const PagedAttentionParams& p, const AttentionPlan& plan,
                             const char* backend) {
  TORCH_CHECK(p.dtype == DType::kFloat16 || p.dtype == DType::kBFloat16, "mla_attention (",
              backend, "): the tensor-core kernel takes float16 or bfloat16 query and out, got ",
              p.dtype == DType::kFloat32 ? "float32" : "another dtype",
              "; float32 MLA runs on the CPU kernels");
  TORCH_CHECK(mla_padded_rank(p.head_size_v, p.head_size) != 0, "mla_attention (", backend,
              "): no tensor-core kernel for kv_lora_rank ", p.head_size_v, " (out.size(2)) and "
              "rope_dim ", p.head_size - p.head_size_v, " (query width ", p.head_size,
              "): kv_lora_rank must be at most 512 and rope_dim at most 64 plus the rank's "
              "padding to 64, 128, 256 or 512");
  TORCH_CHECK(plan.vectorized, "mla_attention (", backend, "): kv_cache's rows must start on ",
              attention_element_size(p.cache_dtype) == 1 ? 8 : 16, " bytes (its data pointer "
              "and block and token strides), got strides (", p.key_cache.strides.block, ", ",
              p.key_cache.strides.token, ")");
  TORCH_CHECK(p.num_seqs <= kMaxGridYZ, "mla_attention (", backend, "): num_seqs ", p.num_seqs,
              " exceeds ", kMaxGridYZ, ", the kernel's grid limit; split the batch");
  TORCH_CHECK(p.num_heads <= kMaxGridYZ, "mla_attention (", backend, "): num_heads ",
              p.num_heads, " exceeds ", kMaxGridYZ, ", the reduce kernel's grid limit");
  const CacheStrides& s = p.key_cache.strides;
  const int64_t bytes = attention_element_size(p.cache_dtype);
  TORCH_CHECK(s.block * bytes < (int64_t{1} << 32) &&
                  s.token * p.key_cache.block_size * bytes < (int64_t{1} << 32),
              "mla_attention (", backend, "): kv_cache strides (", s.block, ", ", s.token,
              ") exceed the kernel's 32-bit byte offsets in a block");
}

}  // namespace pagedkv
