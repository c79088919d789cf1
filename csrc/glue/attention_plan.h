// The launch plan of the CUDA-source attention kernels (cuda and simt backends): the head size
// check that names the unsupported value, the split-K plan from host integers, and its workspace
// from the caching allocator (capture-safe: no host read of device data, no host sync).
#pragma once
#include <ATen/ATen.h>

#include "kernels/attention_launch.h"

namespace pagedkv {

inline void check_attention_kernel_exists(const PagedAttentionParams& p, const char* backend) {
  TORCH_CHECK(attention_padded_head(p.head_size) != 0, "paged_attention (", backend,
              "): no kernel for head_size ", p.head_size,
              "; the kernels take multiples of 8 up to 256");
}

// The plan; `workspace` keeps its split-K buffers alive until the launch is enqueued.
inline AttentionPlan attention_plan(const PagedAttentionParams& p, const at::Tensor& like,
                                    int sm_count, int min_part_tokens, at::Tensor& workspace) {
  AttentionPlan plan = plan_paged_attention(p, sm_count, min_part_tokens);
  const int64_t floats = attention_workspace_floats(p, plan);
  if (floats > 0) {
    workspace = at::empty({floats}, like.options().dtype(at::kFloat));
    attach_workspace(p, plan, workspace.data_ptr<float>());
  }
  return plan;
}

}  // namespace pagedkv
