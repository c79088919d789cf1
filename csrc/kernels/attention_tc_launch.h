// Which attention kernel runs a paged_attention call and how, as the host sees it: the dispatch
// rule between the CUDA-core kernel (attention_kernels.cuh) and the tensor-core one
// (attention_tc.cuh), the tensor-core kernel's launch configuration and split-K plan,
// plan_attention (the one host function that returns the kernel and its plan) and the launcher
// both backends define. Torch-free and CUDA-compiler-free; everything here is computed from host
// integers, so the choice is graph-capture safe (docs/cuda_attention.md, "Dispatch").
#pragma once
#include <driver_types.h>
#include <stdint.h>

#include <algorithm>

#include "kernels/attention_launch.h"

namespace pagedkv {

// Which kernel runs paged_attention on the CUDA and simt backends.
enum class AttentionKernel { kCudaCore, kTensorCore };

// PAGEDKV_ATTENTION_KERNEL: auto (the rule below), cuda_core (always the CUDA-core kernel) or
// tensor_core (the tensor-core kernel wherever it supports the call, whatever its rows).
enum class AttentionKernelChoice { kAuto, kCudaCore, kTensorCore };

// (query token, query head) rows of one kv head of one sequence from which the tensor-core
// kernel is chosen: a GQA group of 8 in decode, two tokens of a group of 4, any prefill chunk.
// Below it the CUDA-core kernel's 4-row tiles waste nothing while an MMA tile of 16 rows would
// be mostly empty.
constexpr int kAttnTcMinRows = 8;
// The same from 4 rows for 8- and 4-bit caches (fp8 with per-tensor scales; int8, int4 and fp8
// e4m3 quantized per (token, head)): the CUDA-core kernel converts each element once per 4-row
// tile, and from 4 rows its loop issues more per K/V byte than the tensor-core kernel's staging
// does once per 16-row tile (SASS model, sm_90, head 128, GQA 4: int8 440 against about 240
// instructions per KiB, fp8 388; docs/cuda_attention.md, Dispatch).
constexpr int kAttnTcMinRowsQuantized = 4;

// The rows per kv head from which automatic dispatch takes the tensor-core kernel.
inline int attention_tc_min_rows(const PagedAttentionParams& p) {
  const bool quantized = p.key_scales.data != nullptr || p.cache_dtype == DType::kFp8E4M3 ||
                         p.cache_dtype == DType::kFp8E5M2;
  return quantized ? kAttnTcMinRowsQuantized : kAttnTcMinRows;
}
// Up to this many rows per kv head the "decode" configuration runs (one 16-row MMA tile, the
// warps splitting the keys); above it the "prefill" one (64-row tiles, one 16-row slice per warp).
constexpr int kAttnTcDecodeRows = 16;
constexpr int kAttnTcPrefillRows = 64;
// Split-K aims at this many blocks per SM: 2 resident (the shared memory of a 64-row tile)
// times 4 waves.
constexpr int kAttnTcTargetBlocksPerSm = 8;

// Rows per kv head per sequence the plan must cover.
inline int64_t attention_tc_rows(const PagedAttentionParams& p) {
  const int64_t group = p.num_heads / std::max(p.num_kv_heads, 1);
  return static_cast<int64_t>(std::max(p.max_query_len, 1)) * group;
}

// Whether the tensor-core kernel can run the call at all: 16-bit queries with a cache of the
// same dtype, fp8 of per-tensor scales, or int8, int4 or fp8 e4m3 quantized per (token, head);
// cache rows aligned for 16-byte cp.async (8-byte loads for fp8 and int8, 4-byte for int4:
// `vectorized`), a padded head size it has (up to 256), and a device with mma.sync m16n8k16 for
// the dtype (sm_80+; sm_major < 0: the simt emulator). Everything else (float32 queries,
// unaligned rows, fp8 e5m2 with key_scales) runs on the CUDA-core kernel, whatever
// PAGEDKV_ATTENTION_KERNEL asks.
inline bool attention_tc_supported(const PagedAttentionParams& p, bool vectorized, int sm_major) {
  const bool dtype = p.dtype == DType::kFloat16 || p.dtype == DType::kBFloat16;
  const bool cache = p.key_scales.data == nullptr
                         ? p.cache_dtype == p.dtype || p.cache_dtype == DType::kFp8E4M3 ||
                               p.cache_dtype == DType::kFp8E5M2
                         : p.cache_dtype == DType::kInt8 || p.cache_dtype == DType::kInt4 ||
                               p.cache_dtype == DType::kFp8E4M3;
  return dtype && cache && vectorized &&
         attention_padded_head(p.head_size, kMaxTcAttentionHeadSize) != 0 &&
         (sm_major < 0 || sm_major >= 8);
}

// The dispatch rule: host integers only.
inline AttentionKernel choose_attention_kernel(const PagedAttentionParams& p, bool vectorized,
                                               int sm_major, AttentionKernelChoice choice) {
  if (choice == AttentionKernelChoice::kCudaCore || !attention_tc_supported(p, vectorized, sm_major))
    return AttentionKernel::kCudaCore;
  if (choice == AttentionKernelChoice::kTensorCore ||
      attention_tc_rows(p) >= attention_tc_min_rows(p)) {
    return AttentionKernel::kTensorCore;
  }
  return AttentionKernel::kCudaCore;
}

// Rows per thread block of the configuration a call runs.
inline int attention_tc_block_rows(const PagedAttentionParams& p) {
  return attention_tc_rows(p) <= kAttnTcDecodeRows ? kAttnTcDecodeRows : kAttnTcPrefillRows;
}

// The tensor-core kernel's plan from the CUDA-core one (`base`, plan_paged_attention's for the
// same call: its alignment check), with its own row tiles and split-K (partitions of at least
// min_part_tokens keys, at most kAttnMaxParts).
inline AttentionPlan plan_paged_attention_tc(const PagedAttentionParams& p,
                                             const AttentionPlan& base, int sm_count,
                                             int min_part_tokens = kAttnMinPartTokens) {
  AttentionPlan plan = base;
  const int64_t group = p.num_heads / std::max(p.num_kv_heads, 1);
  const int block_rows = attention_tc_block_rows(p);
  plan.row_tiles = static_cast<int32_t>((attention_tc_rows(p) + block_rows - 1) / block_rows);
  int64_t span = std::max(p.max_seq_len, 1);
  if (p.sliding_window > 0) {
    span = std::min<int64_t>(span, p.sliding_window + (block_rows + group - 1) / group);
  }
  const int64_t blocks = static_cast<int64_t>(plan.row_tiles) * p.num_seqs * p.num_kv_heads;
  const int64_t wanted = (static_cast<int64_t>(sm_count) * kAttnTcTargetBlocksPerSm + blocks - 1) /
                         std::max<int64_t>(blocks, 1);
  const int64_t by_len = (span + min_part_tokens - 1) / min_part_tokens;
  int64_t parts = std::clamp<int64_t>(std::min(wanted, by_len), 1, kAttnMaxParts);
  int64_t part_tokens = (span + parts - 1) / parts;
  part_tokens = (part_tokens + 15) / 16 * 16;
  parts = (span + part_tokens - 1) / part_tokens;
  plan.num_parts = static_cast<int32_t>(parts);
  plan.part_tokens = parts == 1 ? (1 << 30) : static_cast<int32_t>(part_tokens);
  plan.tmp_out = plan.tmp_lse = nullptr;
  return plan;
}

// A call's kernel and its plan.
struct AttentionLaunch {
  AttentionKernel kernel;
  AttentionPlan plan;  // workspace pointers null until the caller attaches one
};

// The kernel that runs a call (the dispatch rule under `choice`, PAGEDKV_ATTENTION_KERNEL's
// value) and that kernel's split-K plan. sm_major: the device's compute capability major (-1:
// the simt emulator); sm_count and min_part_tokens as for plan_paged_attention.
inline AttentionLaunch plan_attention(const PagedAttentionParams& p, int sm_count, int sm_major,
                                      AttentionKernelChoice choice,
                                      int min_part_tokens = kAttnMinPartTokens) {
  const AttentionPlan base = plan_paged_attention(p, sm_count, min_part_tokens);
  const AttentionKernel kernel = choose_attention_kernel(p, base.vectorized, sm_major, choice);
  if (kernel == AttentionKernel::kCudaCore) return {kernel, base};
  return {kernel, plan_paged_attention_tc(p, base, sm_count, min_part_tokens)};
}

// Runs the call on the launch's kernel (then the split-K reduce when its plan splits); defined
// by each backend (attention_dispatch.cuh).
#define PAGEDKV_ATTENTION_LAUNCHER                                                             \
  cudaError_t paged_attention(const PagedAttentionParams& p, const AttentionLaunch& launch,   \
                              cudaStream_t stream);

namespace cuda {
PAGEDKV_ATTENTION_LAUNCHER
}
namespace simt {
PAGEDKV_ATTENTION_LAUNCHER
}

#undef PAGEDKV_ATTENTION_LAUNCHER

}  // namespace pagedkv
