// PAGEDKV_ATTENTION_KERNEL, the switch between the attention kernels of the CUDA-source backends
// (cuda and simt); the rule it overrides and the plan are kernels/attention_tc_launch.h's
// plan_attention, from host integers only, so the choice is fixed at CUDA graph capture like the
// plan.
#pragma once
#include <ATen/ATen.h>

#include <cstdlib>
#include <cstring>

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

}  // namespace pagedkv
