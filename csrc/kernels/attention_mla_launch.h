// mla_attention on the CUDA-source backends, as the host sees it: which shapes the tensor-core
// MLA kernel (attention_mla.cuh) runs, its configuration and split-K plan from host integers
// (graph-capture safe, as plan_attention), and the launcher both backends define.
// docs/cuda_attention.md, "MLA kernel".
#pragma once
#include <driver_types.h>
#include <stdint.h>

#include <algorithm>

#include "kernels/attention_tc_launch.h"

namespace pagedkv {

// The kernel's padded latent rank (O's columns, a multiple of 32: two warps of 16-column
// ldmatrix pairs) for kv_lora_rank `rank` and row width `width`: 64 or 512, the smaller that
// holds the rank and whose padded row, kMlaPaddedRope more, holds the width; 0 when neither
// does. DeepSeek's (512, 576), the rank every MLA model deployed uses, runs unpadded; 64 serves
// small latents (tests, toy models). Other ranks run padded to 512 (a rank of 128 does 4x the
// MMAs it needs): each padded rank is 12 more kernels to compile.
constexpr int kMlaPaddedRope = 64;
inline int mla_padded_rank(int rank, int width) {
  for (const int dv : {64, 512}) {
    if (rank <= dv && width <= dv + kMlaPaddedRope) return dv;
  }
  return 0;
}

// Rows of a thread block: 16 (one row slice of two warps) up to 16 rows per sequence, else 64
// (four slices, eight warps) where its shared memory fits the device's per-block opt-in
// (`max_smem_bytes`; sm_86 / sm_89's 99 KiB do not hold a 64-row tile of rank 512).
constexpr int kMlaKeys = 32;  // keys per tile
// Dynamic shared memory of a block (MlaConfig::kBytes): Q, two latent tiles, P, row maxima.
constexpr size_t mla_smem_bytes(int dv, int block_rows) {
  const size_t stride = static_cast<size_t>(dv + kMlaPaddedRope + 8);  // elements, +16 bytes
  return (block_rows * stride + 2 * kMlaKeys * stride + block_rows * (kMlaKeys + 8)) * 2 +
         2 * block_rows * sizeof(float);
}
constexpr size_t kMlaStaticSmem = 2 * kMlaKeys * sizeof(uint64_t);  // the row offsets
inline int mla_block_rows(const PagedAttentionParams& p, size_t max_smem_bytes) {
  const int dv = mla_padded_rank(p.head_size_v, p.head_size);
  if (attention_tc_rows(p) <= kAttnTcDecodeRows) return kAttnTcDecodeRows;
  const size_t wide = mla_smem_bytes(dv, kAttnTcPrefillRows) + kMlaStaticSmem;
  return wide <= max_smem_bytes ? kAttnTcPrefillRows : kAttnTcDecodeRows;
}

// The split-K plan of a call: the tensor-core plan's (plan_paged_attention_tc, with its row
// tiles for block_rows), whose `vectorized` tells whether the cache rows are aligned for the
// kernel's loads (16 bytes, fp8 8).
inline AttentionPlan plan_mla_attention(const PagedAttentionParams& p, int block_rows,
                                        int sm_count, int min_part_tokens = kAttnMinPartTokens) {
  const AttentionPlan base = plan_paged_attention(p, sm_count, min_part_tokens);
  AttentionPlan plan = plan_paged_attention_tc(p, base, sm_count, min_part_tokens);
  plan.row_tiles = static_cast<int32_t>((attention_tc_rows(p) + block_rows - 1) / block_rows);
  return plan;
}

// Rows per block of a plan made by plan_mla_attention (its row tiles are of 16 or 64 rows).
inline int mla_plan_block_rows(const PagedAttentionParams& p, const AttentionPlan& plan) {
  const int64_t rows = attention_tc_rows(p);
  return (rows + plan.row_tiles - 1) / plan.row_tiles > kAttnTcDecodeRows ? kAttnTcPrefillRows
                                                                          : kAttnTcDecodeRows;
}

// Runs the call (then the split-K reduce when the plan splits); defined by each backend
// (attention_dispatch.cuh). cudaErrorInvalidValue for a shape or dtype the kernel lacks.
#define PAGEDKV_MLA_ATTENTION_LAUNCHER                                                      \
  cudaError_t mla_attention(const PagedAttentionParams& p, const AttentionPlan& plan,     \
                            cudaStream_t stream);

namespace cuda {
PAGEDKV_MLA_ATTENTION_LAUNCHER
}
namespace simt {
PAGEDKV_MLA_ATTENTION_LAUNCHER
}

#undef PAGEDKV_MLA_ATTENTION_LAUNCHER

}  // namespace pagedkv
