// merge_attn_states: its schema, its kernel parameters from tensors (the checks every backend
// shares) and the op every backend registers, merge_attn_states_op<Run>.
#pragma once
#include <ATen/ATen.h>

#include "glue/tensor_checks.h"
#include "kernels/attention_params.h"

namespace pagedkv {

// Combine two partial attentions over disjoint key sets by their log-sum-exp.
inline constexpr char kMergeAttnStatesSchema[] =
    "merge_attn_states(Tensor(a!) out, Tensor(b!)? out_lse, Tensor prefix_out, "
    "Tensor prefix_lse, Tensor suffix_out, Tensor suffix_lse) -> ()";

inline MergeAttnParams merge_attn_states_params(const at::Tensor& out,
                                                const c10::optional<at::Tensor>& out_lse,
                                                const at::Tensor& prefix_out,
                                                const at::Tensor& prefix_lse,
                                                const at::Tensor& suffix_out,
                                                const at::Tensor& suffix_lse) {
  constexpr const char* op = "merge_attn_states";
  const DType dtype = check_rows(out, op, "out");
  // The parts: out's dtype, or float32 (paged_attention's unrounded rows of a 16-bit query)
  const DType state_dtype = check_rows(prefix_out, op, "prefix_out");
  check_rows(suffix_out, op, "suffix_out");
  check_like(prefix_out, out, op, "prefix_out", "out", /*float_ok=*/true);
  check_like(suffix_out, out, op, "suffix_out", "out", /*float_ok=*/true);
  TORCH_CHECK(suffix_out.scalar_type() == prefix_out.scalar_type(), op,
              ": suffix_out must have prefix_out's dtype ", prefix_out.scalar_type(), ", got ",
              suffix_out.scalar_type());
  const int64_t num_tokens = out.size(0), num_heads = out.size(1);
  check_lse(prefix_lse, num_tokens, num_heads, out, op, "prefix_lse");
  check_lse(suffix_lse, num_tokens, num_heads, out, op, "suffix_lse");
  if (out_lse) check_lse(*out_lse, num_tokens, num_heads, out, op, "out_lse");
  const int64_t head_size = out.size(2);
  TORCH_CHECK(head_size >= 8 && head_size <= kMaxAttentionHeadSize && head_size % 8 == 0, op,
              ": head_size must be a multiple of 8 in [8, ", kMaxAttentionHeadSize, "], got ",
              head_size);
  MergeAttnParams p{};
  p.out = out.data_ptr();
  p.out_lse = out_lse ? out_lse->data_ptr<float>() : nullptr;
  p.prefix_out = prefix_out.data_ptr();
  p.prefix_lse = prefix_lse.data_ptr<float>();
  p.suffix_out = suffix_out.data_ptr();
  p.suffix_lse = suffix_lse.data_ptr<float>();
  p.out_token_stride = out.stride(0);
  p.out_head_stride = out.stride(1);
  p.prefix_token_stride = prefix_out.stride(0);
  p.prefix_head_stride = prefix_out.stride(1);
  p.suffix_token_stride = suffix_out.stride(0);
  p.suffix_head_stride = suffix_out.stride(1);
  p.out_lse_token_stride = out_lse ? out_lse->stride(0) : 0;
  p.out_lse_head_stride = out_lse ? out_lse->stride(1) : 0;
  p.prefix_lse_token_stride = prefix_lse.stride(0);
  p.prefix_lse_head_stride = prefix_lse.stride(1);
  p.suffix_lse_token_stride = suffix_lse.stride(0);
  p.suffix_lse_head_stride = suffix_lse.stride(1);
  p.num_tokens = num_tokens;
  p.num_heads = to_int32(num_heads, op, "num_heads");
  p.head_size = to_int32(out.size(2), op, "head_size");
  p.dtype = dtype;
  p.state_dtype = state_dtype;
  return p;
}

// The backend's part: Run(params, out) after the checks; out places the work (device).
using MergeAttnStatesRun = void (*)(const MergeAttnParams&, const at::Tensor& out);

// The op with the schema's signature; each backend registers merge_attn_states_op<its_run>.
template <MergeAttnStatesRun Run>
void merge_attn_states_op(at::Tensor& out, const c10::optional<at::Tensor>& out_lse,
                          const at::Tensor& prefix_out, const at::Tensor& prefix_lse,
                          const at::Tensor& suffix_out, const at::Tensor& suffix_lse) {
  Run(merge_attn_states_params(out, out_lse, prefix_out, prefix_lse, suffix_out, suffix_lse),
      out);
}

}  // namespace pagedkv
