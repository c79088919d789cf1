// The launch plan of the CUDA-source attention kernels (cuda and simt backends): the head size
// check that names the unsupported value, the split-K plan from host integers, and its workspace
// from the caching allocator (capture-safe: no host read of device data, no host sync).
#pragma once
#include <ATen/ATen.h>

#include <utility>

#include "kernels/attention_launch.h"

namespace pagedkv {

// gridDim.y and gridDim.z of a CUDA launch are at most this.
constexpr int64_t kMaxGridYZ = 65535;

// That a kernel runs this call: a head size it was instantiated for, and a grid within the
// limits (sequences and kv heads are the attention kernel's grid y / z, query heads the
// reduce kernel's grid y).
inline void check_attention_kernel_exists(const PagedAttentionParams& p, const char* backend) {
  TORCH_CHECK(attention_padded_head(p.head_size) != 0, "paged_attention (", backend,
              "): no kernel for head_size ", p.head_size,
              "; the kernels take multiples of 8 up to ", kMaxCudaAttentionHeadSize);
  TORCH_CHECK(p.num_seqs <= kMaxGridYZ, "paged_attention (", backend, "): num_seqs ", p.num_seqs,
              " exceeds ", kMaxGridYZ, ", the kernel's grid limit; split the batch");
  TORCH_CHECK(p.num_kv_heads <= kMaxGridYZ, "paged_attention (", backend, "): num_kv_heads ",
              p.num_kv_heads, " exceeds ", kMaxGridYZ, ", the kernel's grid limit");
  TORCH_CHECK(p.num_heads <= kMaxGridYZ, "paged_attention (", backend, "): num_heads ",
              p.num_heads, " exceeds ", kMaxGridYZ, ", the reduce kernel's grid limit");
  // The kernel addresses a row as block x block stride (a 64-bit product of 32-bit values) plus
  // the token's offset in its block (32-bit), in bytes.
  for (const auto& [name, c] : {std::pair{"key_cache", &p.key_cache}, {"value_cache", &p.value_cache}}) {
    const CacheStrides& s = c->strides;
    const int64_t bytes = attention_element_size(p.cache_dtype);
    TORCH_CHECK(s.block * bytes < (int64_t{1} << 32) && s.token * c->block_size * bytes < (int64_t{1} << 32),
                "paged_attention (", backend, "): ", name, " strides (", s.block, ", ", s.head,
                ", ", s.token, ") exceed the kernel's 32-bit byte offsets in a block");
  }
}

// merge_attn_states' grid is (num_tokens, num_heads).
inline void check_merge_grid(const MergeAttnParams& p, const char* backend) {
  TORCH_CHECK(p.num_heads <= kMaxGridYZ, "merge_attn_states (", backend, "): num_heads ",
              p.num_heads, " exceeds ", kMaxGridYZ, ", the kernel's grid limit");
}

// The split-K buffers a plan needs (none for one partition), allocated beside `like` and
// attached to the plan; `workspace` keeps them alive until the launch is enqueued.
inline void allocate_workspace(const PagedAttentionParams& p, AttentionPlan& plan,
                               const at::Tensor& like, at::Tensor& workspace) {
  const int64_t floats = attention_workspace_floats(p, plan);
  if (floats > 0) {
    workspace = at::empty({floats}, like.options().dtype(at::kFloat));
    attach_workspace(p, plan, workspace.data_ptr<float>());
  }
}

}  // namespace pagedkv
