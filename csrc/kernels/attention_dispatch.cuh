// Runtime dispatch of the attention launchers declared in attention_launch.h. The per-dtype kernel
// instantiations live in their own translation units (PAGEDKV_INSTANTIATE_ATTENTION), so that two
// cores compile them in parallel; this file only declares them.
#pragma once
#include "kernels/compat.cuh"
#include "kernels/attention_launch.h"
#include "kernels/dtypes.cuh"

namespace pagedkv {
namespace PAGEDKV_KERNEL_NS {
namespace attn {

template <typename T>
cudaError_t paged_attention_typed(const PagedAttentionParams& p, const AttentionPlan& plan,
                                  cudaStream_t stream);
template <typename T>
cudaError_t launch_merge_attn_states(const MergeAttnParams& p, cudaStream_t stream);

}  // namespace attn

cudaError_t paged_attention(const PagedAttentionParams& p, const AttentionPlan& plan,
                            cudaStream_t stream) {
  if (p.num_tokens == 0 || p.num_seqs == 0) return cudaSuccess;
  switch (p.dtype) {
    case DType::kFloat32: return attn::paged_attention_typed<float>(p, plan, stream);
    case DType::kFloat16: return attn::paged_attention_typed<__half>(p, plan, stream);
    case DType::kBFloat16: return attn::paged_attention_typed<__nv_bfloat16>(p, plan, stream);
    default: return cudaErrorInvalidValue;
  }
}

cudaError_t merge_attn_states(const MergeAttnParams& p, cudaStream_t stream) {
  if (p.num_tokens == 0 || p.num_heads == 0) return cudaSuccess;
  switch (p.dtype) {
    case DType::kFloat32: return attn::launch_merge_attn_states<float>(p, stream);
    case DType::kFloat16: return attn::launch_merge_attn_states<__half>(p, stream);
    case DType::kBFloat16: return attn::launch_merge_attn_states<__nv_bfloat16>(p, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace PAGEDKV_KERNEL_NS
}  // namespace pagedkv
