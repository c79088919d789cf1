// simt glue of the attention ops: the CUDA glue (csrc/cuda/attention_ops.cpp) for CPU tensors run
// by the emulator. The split-K plan assumes a small device and partitions of at least
// PAGEDKV_SIMT_MIN_PART_TOKENS keys (default 32), so that the tests' short contexts exercise
// split-K and its reduce kernel as well as the single-partition path.
#include <torch/library.h>

#include <cstdlib>

#include "glue/attention_kernel.h"
#include "kernels/attention_launch.h"
#include "ops/merge_attn_states.h"
#include "ops/paged_attention.h"

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

void paged_attention(const PagedAttentionParams& p, const at::Tensor& query) {
  check_attention_kernel_exists(p, "simt");
  at::Tensor workspace;
  const AttentionLaunch run =
      attention_launch(p, query, kSimtSmCount, -1, simt_min_part_tokens(), workspace);
  check(run.kernel == AttentionKernel::kTensorCore ? simt::paged_attention_tc(p, run.plan, nullptr)
                                                   : simt::paged_attention(p, run.plan, nullptr),
        "paged_attention");
}

void merge_attn_states(const MergeAttnParams& p, const at::Tensor&) {
  check(simt::merge_attn_states(p, nullptr), "merge_attn_states");
}

}  // namespace

TORCH_LIBRARY_IMPL(pagedkv_simt, CPU, m) {
  m.impl("paged_attention", &paged_attention_op<&paged_attention>);
  m.impl("merge_attn_states", &merge_attn_states_op<&merge_attn_states>);
}

}  // namespace pagedkv
