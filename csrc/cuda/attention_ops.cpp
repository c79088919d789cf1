// CUDA backend of the attention ops, mla_attention included (their checks: csrc/ops/): device guard, current stream,
// the kernel and its split-K plan from host integers and the device's SM count and compute
// capability (plan_attention, under PAGEDKV_ATTENTION_KERNEL), workspace from the caching
// allocator, launch. No host sync and no host read of device data, so both ops work under CUDA
// graph capture.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <array>
#include <atomic>

#include "glue/attention_kernel.h"
#include "glue/attention_plan.h"
#include "glue/mla_attention.h"
#include "kernels/attention_mla_launch.h"
#include "kernels/attention_tc_launch.h"
#include "ops/merge_attn_states.h"
#include "ops/mla_attention.h"
#include "ops/paged_attention.h"

namespace pagedkv {
namespace {

// A (nonzero) attribute of a device, asked once per device and attribute.
template <cudaDeviceAttr kAttr>
int device_attribute(c10::DeviceIndex device) {
  static std::array<std::atomic<int>, 64> cache{};
  std::atomic<int>& slot = cache.at(static_cast<size_t>(device));
  int n = slot.load();
  if (n == 0) {
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&n, kAttr, device));
    slot.store(n);
  }
  return n;
}

int sm_count(c10::DeviceIndex device) {  // multiprocessors
  return device_attribute<cudaDevAttrMultiProcessorCount>(device);
}
int sm_major(c10::DeviceIndex device) {  // compute capability major
  return device_attribute<cudaDevAttrComputeCapabilityMajor>(device);
}
size_t max_smem_optin(c10::DeviceIndex device) {  // shared memory a block may opt into, bytes
  return static_cast<size_t>(device_attribute<cudaDevAttrMaxSharedMemoryPerBlockOptin>(device));
}

void paged_attention(const PagedAttentionParams& p, const at::Tensor& query) {
  check_attention_kernel_exists(p, "cuda");
  const c10::cuda::CUDAGuard guard(query.device());
  const c10::DeviceIndex device = query.device().index();
  AttentionLaunch run =
      plan_attention(p, sm_count(device), sm_major(device), attention_kernel_choice());
  at::Tensor workspace;  // alive until the launch is enqueued
  allocate_workspace(p, run.plan, query, workspace);
  C10_CUDA_CHECK(cuda::paged_attention(p, run, c10::cuda::getCurrentCUDAStream()));
}

// mla_attention on the tensor-core MLA kernel (sm_80+, 16-bit queries; check_mla_kernel).
void mla_attention(const PagedAttentionParams& p, const at::Tensor& query) {
  const c10::cuda::CUDAGuard guard(query.device());
  const c10::DeviceIndex device = query.device().index();
  TORCH_CHECK(sm_major(device) >= 8, "mla_attention (cuda): the tensor-core kernel needs sm_80 or "
              "newer, the query's device is sm_", sm_major(device), "x");
  AttentionPlan plan =
      plan_mla_attention(p, mla_block_rows(p, max_smem_optin(device)), sm_count(device));
  check_mla_kernel(p, plan, "cuda");
  at::Tensor workspace;  // alive until the launch is enqueued
  allocate_workspace(p, plan, query, workspace);
  C10_CUDA_CHECK(cuda::mla_attention(p, plan, c10::cuda::getCurrentCUDAStream()));
}

void merge_attn_states(const MergeAttnParams& p, const at::Tensor& out) {
  check_merge_grid(p, "cuda");
  const c10::cuda::CUDAGuard guard(out.device());
  C10_CUDA_CHECK(cuda::merge_attn_states(p, c10::cuda::getCurrentCUDAStream()));
}

}  // namespace

TORCH_LIBRARY_IMPL(pagedkv, CUDA, m) {
  m.impl("paged_attention", &paged_attention_op<&paged_attention>);
  m.impl("merge_attn_states", &merge_attn_states_op<&merge_attn_states>);
  m.impl("mla_attention", &mla_attention_op<&mla_attention>);
}

}  // namespace pagedkv
