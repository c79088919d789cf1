// Launchers of the attention kernels, as the torch glue sees them, and the host-side plan of a
// paged_attention launch (partitions, workspace). Torch-free and CUDA-compiler-free: the kernels
// live in attention_kernels.cuh, compiled by nvcc (namespace cuda) and by g++ against the emulator
// (namespace simt).
#pragma once
#include <driver_types.h>
#include <stdint.h>

#include <algorithm>

#include "kernels/attention_params.h"

namespace pagedkv {

// How one paged_attention call is cut into thread blocks. Computed on the host from host integers
// only (sizes, max_seq_len, max_query_len, SM count): nothing on the device is read.
struct AttentionPlan {
  int32_t row_tiles;    // tiles of kAttnRowsPerBlock (query token, query head) rows per sequence
  int32_t num_parts;    // context partitions (split-K); 1 = write the output directly
  int32_t part_tokens;  // keys per partition
  bool vectorized;      // caches aligned for 16-byte chunk loads (fp8, int8: 8; int4: 4)
  float* tmp_out;       // [num_tokens, num_heads, num_parts, head_size_v] when num_parts > 1
  float* tmp_lse;       // [num_tokens, num_heads, num_parts] when num_parts > 1
};

constexpr int kAttnRowsPerBlock = 4;    // attn::kRows
constexpr int kAttnMinPartTokens = 256;  // smallest partition worth a block of its own
constexpr int kAttnMaxParts = 64;
// Partitions are whole iterations of the decode kernel's loop: a multiple of the tokens per block
// iteration of every instantiation but fp8 at head size 64 (128; its partitions may end in a
// partial iteration).
constexpr int kAttnPartStep = 64;

// Blocks of the decode kernel resident per SM (its __launch_bounds__, every cache dtype); a wave
// is that times the SM count.
constexpr int kAttnResidentBlocks = 3;

// The largest head size of the CUDA-core kernel (every head size the op takes), and of the
// tensor-core one (past it, dispatch runs the CUDA-core kernel).
constexpr int kMaxCudaAttentionHeadSize = 512;
constexpr int kMaxTcAttentionHeadSize = 256;

// The kernel instantiation that runs a head size: 64, 128, 256 or 512 dims (a multiple of 8 up
// to that; the lanes of the missing dims idle), or 0 when none of those up to max_head does.
inline int attention_padded_head(int head_size, int max_head = kMaxCudaAttentionHeadSize) {
  if (head_size <= 0 || head_size % 8 != 0 || head_size > max_head) return 0;
  return head_size <= 64 ? 64 : (head_size <= 128 ? 128 : (head_size <= 256 ? 256 : 512));
}

// Returns f.template operator()<HEAD>() for the instantiation's head size (HEAD: 64, 128, 256,
// or 512 when kMaxHead allows), or cudaErrorInvalidValue when none runs head_size.
template <int kMaxHead = kMaxCudaAttentionHeadSize, typename F>
cudaError_t with_padded_head(int head_size, F&& f) {
  switch (attention_padded_head(head_size, kMaxHead)) {
    case 64: return f.template operator()<64>();
    case 128: return f.template operator()<128>();
    case 256: return f.template operator()<256>();
    case 512:
      if constexpr (kMaxHead >= 512) return f.template operator()<512>();
      [[fallthrough]];
    default: return cudaErrorInvalidValue;
  }
}

inline int64_t attention_element_size(DType t) {
  switch (t) {
    case DType::kFloat32: return 4;
    case DType::kFloat16: case DType::kBFloat16: return 2;
    default: return 1;
  }
}

// sm_count: multiprocessors of the device; min_part_tokens: the smallest partition (tests force
// small ones to cover split-K). Workspace pointers are left null for the caller to fill.
inline AttentionPlan plan_paged_attention(const PagedAttentionParams& p, int sm_count,
                                          int min_part_tokens = kAttnMinPartTokens) {
  AttentionPlan plan{};
  const int64_t group = p.num_heads / std::max(p.num_kv_heads, 1);
  const int64_t rows = static_cast<int64_t>(std::max(p.max_query_len, 1)) * group;
  plan.row_tiles = static_cast<int32_t>((rows + kAttnRowsPerBlock - 1) / kAttnRowsPerBlock);
  // Keys one tile can see: the whole context, or the window plus the tile's own query positions.
  int64_t span = std::max(p.max_seq_len, 1);
  if (p.sliding_window > 0) span = std::min<int64_t>(span, p.sliding_window + kAttnRowsPerBlock);
  const int64_t blocks = static_cast<int64_t>(plan.row_tiles) * p.num_seqs * p.num_kv_heads;
  // Partitions: as many as fill the resident slots of up to two waves best (the last wave's
  // empty slots are lost time), fewer on a tie; none when the grid fills a wave alone.
  const int64_t wave = static_cast<int64_t>(sm_count) * kAttnResidentBlocks;
  const int64_t by_len = (span + min_part_tokens - 1) / min_part_tokens;
  int64_t parts = 1;
  if (blocks > 0 && blocks < wave) {
    const int64_t most = std::clamp<int64_t>(std::min(2 * wave / blocks, by_len), 1, kAttnMaxParts);
    int64_t best_filled = 0, best_slots = 1;  // filled / slots of the best so far
    for (int64_t n = 1; n <= most; ++n) {
      const int64_t slots = (blocks * n + wave - 1) / wave * wave;
      if (blocks * n * best_slots > best_filled * slots) {
        best_filled = blocks * n, best_slots = slots, parts = n;
      }
    }
  }
  int64_t part_tokens = (span + parts - 1) / parts;
  part_tokens = (part_tokens + kAttnPartStep - 1) / kAttnPartStep * kAttnPartStep;
  parts = (span + part_tokens - 1) / part_tokens;
  plan.num_parts = static_cast<int32_t>(parts);
  // The kernel's last partition runs to the end of each context, even past a too-small
  // max_seq_len (a CUDA graph's replay of longer sequences); one partition covers everything.
  plan.part_tokens = parts == 1 ? (1 << 30) : static_cast<int32_t>(part_tokens);
  const int64_t elem = attention_element_size(p.cache_dtype);
  // A lane's chunk of 8 elements: 16 bytes, 8 for 1-byte elements, 4 for int4 (strides in bytes).
  const int64_t align = p.cache_dtype == DType::kInt4 ? 4 : std::min<int64_t>(16, 8 * elem);
  auto ok = [&](int64_t stride) { return stride * elem % align == 0; };
  auto ok_cache = [&](const PagedKVView& c) {
    return ok(c.strides.block) && ok(c.strides.head) && ok(c.strides.token) &&
           reinterpret_cast<uintptr_t>(c.data) % align == 0;
  };
  plan.vectorized = ok_cache(p.key_cache) && ok_cache(p.value_cache);
  return plan;
}

// Floats of split-K workspace the plan needs (0 when it does not split).
inline int64_t attention_workspace_floats(const PagedAttentionParams& p, const AttentionPlan& plan) {
  if (plan.num_parts == 1) return 0;
  return p.num_tokens * p.num_heads * plan.num_parts * (p.head_size_v + 1);
}

// Points the plan at a workspace of attention_workspace_floats() floats.
inline void attach_workspace(const PagedAttentionParams& p, AttentionPlan& plan, float* ws) {
  if (plan.num_parts == 1) return;
  plan.tmp_out = ws;
  plan.tmp_lse = ws + p.num_tokens * p.num_heads * plan.num_parts * p.head_size_v;
}

// merge_attn_states' launcher (paged_attention's: attention_tc_launch.h, with the kernel choice).
#define PAGEDKV_ATTENTION_LAUNCHERS \
  cudaError_t merge_attn_states(const MergeAttnParams& p, cudaStream_t stream);

namespace cuda {
PAGEDKV_ATTENTION_LAUNCHERS
}
namespace simt {
PAGEDKV_ATTENTION_LAUNCHERS
}

#undef PAGEDKV_ATTENTION_LAUNCHERS

}  // namespace pagedkv
