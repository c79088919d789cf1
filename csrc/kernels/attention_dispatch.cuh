// Runtime dispatch of the attention launchers (paged_attention: attention_tc_launch.h;
// mla_attention: attention_mla_launch.h; merge_attn_states: attention_launch.h) to the kernel and
// query dtype. The per-dtype kernel instantiations live in their own translation units
// (PAGEDKV_INSTANTIATE_ATTENTION, PAGEDKV_INSTANTIATE_ATTENTION_TC,
// PAGEDKV_INSTANTIATE_MLA_ATTENTION), so that two cores compile them in parallel; this file only
// declares them.
#pragma once
#include "kernels/compat.cuh"
#include "kernels/attention_launch.h"
#include "kernels/attention_mla_launch.h"
#include "kernels/attention_tc_launch.h"
#include "kernels/dtypes.cuh"

#include <type_traits>

namespace pagedkv {
namespace PAGEDKV_KERNEL_NS {
namespace attn {

template <typename T>
cudaError_t paged_attention_typed(const PagedAttentionParams& p, const AttentionPlan& plan,
                                  cudaStream_t stream);
template <typename T>
cudaError_t launch_merge_attn_states(const MergeAttnParams& p, cudaStream_t stream);
template <typename C>
cudaError_t paged_attention_row_scaled_typed(const PagedAttentionParams& p,
                                             const AttentionPlan& plan, cudaStream_t stream);

}  // namespace attn
namespace attn_tc {

template <typename T>
cudaError_t paged_attention_tc_typed(const PagedAttentionParams& p, const AttentionPlan& plan,
                                     cudaStream_t stream);
template <typename T>
cudaError_t paged_attention_tc_row_scaled_typed(const PagedAttentionParams& p,
                                                const AttentionPlan& plan, cudaStream_t stream);

}  // namespace attn_tc
namespace attn_mla {

template <typename T>
cudaError_t mla_attention_tc_typed(const PagedAttentionParams& p, const AttentionPlan& plan,
                                   cudaStream_t stream);

}  // namespace attn_mla

// The launch's kernel for query dtype T (float32 queries run on the CUDA-core kernel only; the
// tensor-core kernel's instantiations over caches quantized per (token, head) are
// csrc/*/attention_tc_scaled_*.*).
template <typename T>
cudaError_t paged_attention_of(const PagedAttentionParams& p, const AttentionLaunch& launch,
                               cudaStream_t stream) {
  if (launch.kernel == AttentionKernel::kCudaCore) {
    return attn::paged_attention_typed<T>(p, launch.plan, stream);
  }
  if constexpr (std::is_same_v<T, float>) {
    return cudaErrorInvalidValue;
  } else if (p.key_scales.data != nullptr) {
    return attn_tc::paged_attention_tc_row_scaled_typed<T>(p, launch.plan, stream);
  } else {
    return attn_tc::paged_attention_tc_typed<T>(p, launch.plan, stream);
  }
}

// Caches quantized per (token, head) on the CUDA-core kernel: its instantiations of
// csrc/*/attention_row_scaled.* (one per format, any query dtype); on the tensor-core kernel:
// per query dtype, as the other caches (paged_attention_of).
cudaError_t paged_attention(const PagedAttentionParams& p, const AttentionLaunch& launch,
                            cudaStream_t stream) {
  if (p.num_tokens == 0 || p.num_seqs == 0) return cudaSuccess;
  if (p.key_scales.data != nullptr && launch.kernel == AttentionKernel::kCudaCore) {
    return with_token_scaled_type(p.cache_dtype, [&]<typename C>() {
      return attn::paged_attention_row_scaled_typed<C>(p, launch.plan, stream);
    });
  }
  switch (p.dtype) {
    case DType::kFloat32: return paged_attention_of<float>(p, launch, stream);
    case DType::kFloat16: return paged_attention_of<__half>(p, launch, stream);
    case DType::kBFloat16: return paged_attention_of<__nv_bfloat16>(p, launch, stream);
    default: return cudaErrorInvalidValue;
  }
}

// The MLA kernel runs 16-bit queries only (the glue refuses the others first).
cudaError_t mla_attention(const PagedAttentionParams& p, const AttentionPlan& plan,
                          cudaStream_t stream) {
  if (p.num_tokens == 0 || p.num_seqs == 0) return cudaSuccess;
  switch (p.dtype) {
    case DType::kFloat16: return attn_mla::mla_attention_tc_typed<__half>(p, plan, stream);
    case DType::kBFloat16:
      return attn_mla::mla_attention_tc_typed<__nv_bfloat16>(p, plan, stream);
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
