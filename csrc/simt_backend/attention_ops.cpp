// simt glue of the attention ops, mla_attention included: the CUDA glue
// (csrc/cuda/attention_ops.cpp) for CPU tensors run by the emulator. The split-K plan assumes a small device and partitions of at least
// PAGEDKV_SIMT_MIN_PART_TOKENS keys (default 32), so that the tests' short contexts exercise
// split-K and its reduce kernel as well as the single-partition path. The control
// pagedkv_simt_ctl.set_plan_max_seq_len plans calls as a CUDA graph captured for shorter
// sequences would replay them.
#include <torch/library.h>

#include <atomic>
#include <cstdlib>

#include "glue/attention_kernel.h"
#include "glue/attention_plan.h"
#include "glue/mla_attention.h"
#include "kernels/attention_mla_launch.h"
#include "kernels/attention_tc_launch.h"
#include "ops/merge_attn_states.h"
#include "ops/mla_attention.h"
#include "ops/paged_attention.h"
#include "simt/runtime.h"

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
  TORCH_CHECK(err == cudaSuccess, op, ": simt launcher returned CUDA error ", int(err), " (",
              ::simt::get_error_string(err), "): ", ::simt::last_error_message());
}

// > 0: plan every call as if max_seq_len were at most this (set_plan_max_seq_len): what a CUDA
// graph captured for shorter sequences replays with, so that tests can replay longer ones.
std::atomic<int64_t> plan_max_seq_len{0};

void paged_attention(const PagedAttentionParams& p, const at::Tensor& query) {
  check_attention_kernel_exists(p, "simt");
  PagedAttentionParams planned = p;
  if (const int64_t cap = plan_max_seq_len.load(); cap > 0 && cap < p.max_seq_len) {
    planned.max_seq_len = static_cast<int32_t>(cap);
  }
  AttentionLaunch run = plan_attention(planned, kSimtSmCount, -1, attention_kernel_choice(),
                                       simt_min_part_tokens());
  at::Tensor workspace;  // alive until the launch returns
  allocate_workspace(p, run.plan, query, workspace);
  check(simt::paged_attention(p, run, nullptr), "paged_attention");
}

// The emulator has no shared memory limit below sm_90's 227 KiB opt-in.
constexpr size_t kSimtMaxSmem = 227 * 1024;

void mla_attention(const PagedAttentionParams& p, const at::Tensor& query) {
  PagedAttentionParams planned = p;
  if (const int64_t cap = plan_max_seq_len.load(); cap > 0 && cap < p.max_seq_len) {
    planned.max_seq_len = static_cast<int32_t>(cap);
  }
  AttentionPlan plan = plan_mla_attention(planned, mla_block_rows(p, kSimtMaxSmem),
                                          kSimtSmCount, simt_min_part_tokens());
  check_mla_kernel(p, plan, "simt");
  at::Tensor workspace;  // alive until the launch returns
  allocate_workspace(p, plan, query, workspace);
  check(simt::mla_attention(p, plan, nullptr), "mla_attention");
}

void merge_attn_states(const MergeAttnParams& p, const at::Tensor&) {
  check_merge_grid(p, "simt");
  check(simt::merge_attn_states(p, nullptr), "merge_attn_states");
}

void set_plan_max_seq_len(int64_t n) {
  TORCH_CHECK(n >= 0, "set_plan_max_seq_len: n must be >= 0 (0: off), got ", n);
  plan_max_seq_len = n;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedkv_simt_ctl, m) {
  m.def("set_plan_max_seq_len(int n) -> ()", &set_plan_max_seq_len);
}

TORCH_LIBRARY_IMPL(pagedkv_simt, CPU, m) {
  m.impl("paged_attention", &paged_attention_op<&paged_attention>);
  m.impl("merge_attn_states", &merge_attn_states_op<&merge_attn_states>);
  m.impl("mla_attention", &mla_attention_op<&mla_attention>);
}

}  // namespace pagedkv
