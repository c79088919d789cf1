// Which kernel runs a paged_attention call on the CUDA-source backends (cuda and simt): the
// dispatch rule of kernels/attention_tc_launch.h, PAGEDKV_ATTENTION_KERNEL, and the chosen
// kernel's plan with its split-K workspace. Host integers only: no host read of device data, no
// sync, so the choice is fixed at CUDA graph capture like the plan.
#pragma once
#include <ATen/ATen.h>

#include <cstdlib>
#include <cstring>

#include "glue/attention_plan.h"
#include "kernels/attention_tc_launch.h"

namespace pagedkv {

// PAGEDKV_ATTENTION_KERNEL = auto (default) | cuda_core | tensor_core, read at every call.
inline AttentionKernelChoice attention_kernel_choice() {
  const char* v = std::getenv("PAGEDKV_ATTENTION_KERNEL");
  if (v == nullptr || *v == '\0' || std::strcmp(v, "auto") == 0) return AttentionKernelChoice::kAuto;
  if (std::strcmp(v, "cuda_core") == 0) return AttentionKernelChoice::kCudaCore;
  if (std::strcmp(v, "tensor_core") == 0) return AttentionKernelChoice::kTensorCore;
  TORCH_CHECK_VALUE(false, "PAGEDKV_ATTENTION_KERNEL must be one of auto cuda_core tensor_core, got '",
                    v, "'");
}

struct AttentionLaunch {
  AttentionKernel kernel;
  AttentionPlan plan;
};

// The kernel and plan of a call; `workspace` keeps the split-K buffers alive until the launch is
// enqueued. sm_major: the device's compute capability major (-1: the simt emulator).
inline AttentionLaunch attention_launch(const PagedAttentionParams& p, const at::Tensor& like,
                                        int sm_count, int sm_major, int min_part_tokens,
                                        at::Tensor& workspace) {
  const AttentionKernelChoice choice = attention_kernel_choice();
  const AttentionPlan base = plan_paged_attention(p, sm_count, min_part_tokens);
  const AttentionKernel kernel = choose_attention_kernel(p, base.vectorized, sm_major, choice);
  AttentionPlan plan = kernel == AttentionKernel::kTensorCore
                           ? plan_paged_attention_tc(p, base, sm_count, min_part_tokens)
                           : base;
  allocate_workspace(p, plan, like, workspace);
  return {kernel, plan};
}

}  // namespace pagedkv
