// CUDA glue of the attention ops: shared checks, device guard, current stream, split-K plan from
// host integers and the device's SM count, workspace from the caching allocator, launch. No host
// sync and no host read of device data, so both ops work under CUDA graph capture.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <array>
#include <atomic>

#include "glue/attention_args.h"
#include "glue/attention_plan.h"
#include "kernels/attention_launch.h"

namespace pagedkv {
namespace {

// Multiprocessors of a device, asked once per device.
int sm_count(c10::DeviceIndex device) {
  static std::array<std::atomic<int>, 64> cache{};
  std::atomic<int>& slot = cache.at(static_cast<size_t>(device));
  int n = slot.load();
  if (n == 0) {
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device));
    slot.store(n);
  }
  return n;
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
  check_attention_kernel_exists(p, "cuda");
  const c10::cuda::CUDAGuard guard(query.device());
  at::Tensor workspace;
  const AttentionPlan plan =
      attention_plan(p, query, sm_count(query.device().index()), kAttnMinPartTokens, workspace);
  C10_CUDA_CHECK(cuda::paged_attention(p, plan, c10::cuda::getCurrentCUDAStream()));
}

void merge_attn_states(at::Tensor& out, const c10::optional<at::Tensor>& out_lse,
                       const at::Tensor& prefix_out, const at::Tensor& prefix_lse,
                       const at::Tensor& suffix_out, const at::Tensor& suffix_lse) {
  const MergeAttnParams p =
      merge_attn_states_params(out, out_lse, prefix_out, prefix_lse, suffix_out, suffix_lse);
  const c10::cuda::CUDAGuard guard(out.device());
  C10_CUDA_CHECK(cuda::merge_attn_states(p, c10::cuda::getCurrentCUDAStream()));
}

}  // namespace

TORCH_LIBRARY_IMPL(pagedkv, CUDA, m) {
  m.impl("paged_attention", &paged_attention);
  m.impl("merge_attn_states", &merge_attn_states);
}

}  // namespace pagedkv
