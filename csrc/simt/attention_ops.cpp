// simt glue of the attention ops: the CUDA glue (csrc/cuda/attention_ops.cpp) for CPU tensors run
// by the emulator. The split-K plan assumes a small device and partitions of at least
// PAGEDKV_SIMT_MIN_PART_TOKENS keys (default 32), so that the tests' short contexts exercise
// split-K and its reduce kernel as well as the single-partition path.
#include <torch/library.h>

#include <cstdlib>

#include "glue/attention_args.h"
#include "glue/attention_plan.h"
#include "kernels/attention_launch.h"

namespace pagedkv {
namespace {

constexpr int kSimtSmCount = 4;

int simt_min_part_tokens() {
  static const int tokens = [] {
    const char* v = std::getenv("PAGEDKV_SIMT_MIN_PART_TOKENS");
    const int n = v != nullptr ? std::atoi(v) : 0;
    return n > 0 ? n : 32;
  }();
  return tokens;
}

void check(cudaError_t err, const char* op) {
  TORCH_CHECK(err == cudaSuccess, op, ": simt launcher returned CUDA error ", int(err));
}

void paged_attention(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                     const at::Tensor& value_cache, const at::Tensor& block_tables,
                     const at::Tensor& seq_lens, const c10::optional<at::Tensor>& query_start_loc,
                     int64_t max_seq_len, int64_t max_query_len, double scale,
                     const c10::optional<at::Tensor>& alibi_slopes, int64_t sliding_window,
                     double soft_cap, const c10::optional<at::Tensor>& k_scale,
                     const c10::optional<at::Tensor>& v_scale,
                     const c10::optional<at::Tensor>& lse_out) {
  const PagedAttentionParams p = paged_attention_params(
      out, query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, max_seq_len,
      max_query_len, scale, alibi_slopes, sliding_window, soft_cap, k_scale, v_scale, lse_out);
  check_attention_kernel_exists(p, "simt");
  at::Tensor workspace;
  const AttentionPlan plan =
      attention_plan(p, query, kSimtSmCount, simt_min_part_tokens(), workspace);
  check(simt::paged_attention(p, plan, nullptr), "paged_attention");
}

void merge_attn_states(at::Tensor& out, const c10::optional<at::Tensor>& out_lse,
                       const at::Tensor& prefix_out, const at::Tensor& prefix_lse,
                       const at::Tensor& suffix_out, const at::Tensor& suffix_lse) {
  const MergeAttnParams p =
      merge_attn_states_params(out, out_lse, prefix_out, prefix_lse, suffix_out, suffix_lse);
  check(simt::merge_attn_states(p, nullptr), "merge_attn_states");
}

}  // namespace

TORCH_LIBRARY_IMPL(pagedkv_simt, CPU, m) {
  m.impl("paged_attention", &paged_attention);
  m.impl("merge_attn_states", &merge_attn_states);
}

}  // namespace pagedkv
