// Runtime dtype dispatch of the tensor-core attention launcher declared in attention_tc_launch.h;
// the kernels are instantiated per query dtype in their own translation units
// (PAGEDKV_INSTANTIATE_ATTENTION_TC).
#pragma once
#include "kernels/compat.cuh"
#include "kernels/attention_tc_launch.h"

namespace pagedkv {
namespace PAGEDKV_KERNEL_NS {
namespace attn_tc {

template <typename T>
cudaError_t paged_attention_tc_typed(const PagedAttentionParams& p, const AttentionPlan& plan,
                                     cudaStream_t stream);

}  // namespace attn_tc

cudaError_t paged_attention_tc(const PagedAttentionParams& p, const AttentionPlan& plan,
                               cudaStream_t stream) {
  if (p.num_tokens == 0 || p.num_seqs == 0) return cudaSuccess;
  switch (p.dtype) {
    case DType::kFloat16: return attn_tc::paged_attention_tc_typed<__half>(p, plan, stream);
    case DType::kBFloat16: return attn_tc::paged_attention_tc_typed<__nv_bfloat16>(p, plan, stream);
    default: return cudaErrorInvalidValue;  // float32 queries run on the CUDA-core kernel
  }
}

}  // namespace PAGEDKV_KERNEL_NS
}  // namespace pagedkv
