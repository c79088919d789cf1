// The frame both paged attention kernels share (attention_kernels.cuh on CUDA cores,
// attention_tc.cuh on tensor cores), written once: the block's tile of rows and its key range
// (FlashAttention-2's BlockInfo), the K/V row address through the block table, the epilogue that
// writes out / lse or the split-K workspace through the counted store(), and the launcher that
// runs a kernel and then, with several partitions, the reduce.
//
// Both kernels run on the grid (row_tiles * num_parts, num_seqs, num_kv_heads) of an
// AttentionPlan. A row is one (query token, query head) pair of the kv head's group, row r of a
// sequence being token r / group, head r % group.
#pragma once
#include "kernels/compat.cuh"
#include "kernels/attention_chunks.cuh"
#include "kernels/attention_launch.h"
#include "kernels/attention_merge.cuh"
#include "kernels/dtypes.cuh"
#include "kernels/memory.cuh"

#include <type_traits>

namespace pagedkv {
namespace PAGEDKV_KERNEL_NS {
namespace attn {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
constexpr unsigned kFullMask = 0xffffffffu;

// The base of an online softmax state's exponentials: its running max, 0 while it is -inf (no key
// seen), so that exp2(x - base) stays 0 for masked scores instead of NaN.
__device__ __forceinline__ float safe_max(float m) { return m == -INFINITY ? 0.f : m; }

// One thread block's tile: up to tile_rows rows of one (sequence, kv head, context partition),
// their query positions and the keys [part_begin, part_end) the block reads.
struct AttentionTile {
  int part, seq, kv_head, group;
  int q_begin, q_len, seq_len;
  int row0, rows;            // the tile's first row in its sequence; rows in it (<= 0: none)
  int first_pos, last_pos;   // query positions of its first and last rows
  int window;                // sliding window (> 0) or off
  int part_begin, part_end;  // its partition's keys

  __device__ __forceinline__ AttentionTile(const PagedAttentionParams& p, const AttentionPlan& plan,
                                           int tile_rows) {
    const int tile = blockIdx.x % plan.row_tiles;  // tiles of one partition run side by side
    part = blockIdx.x / plan.row_tiles;
    seq = blockIdx.y;
    kv_head = blockIdx.z;
    group = p.num_heads / p.num_kv_heads;
    q_begin = seq, q_len = 1;
    if (p.query_start_loc != nullptr) {
      q_begin = p.query_start_loc[seq];
      q_len = p.query_start_loc[seq + 1] - q_begin;
    }
    seq_len = p.seq_lens[seq];
    row0 = tile * tile_rows;
    rows = min(tile_rows, q_len * group - row0);
    first_pos = p.query_pos(seq_len, q_len, row0 / group);
    last_pos = p.query_pos(seq_len, q_len, (row0 + rows - 1) / group);
    window = p.sliding_window;
    const int kv_end = min(last_pos + 1, seq_len);
    const int window_begin = window > 0 ? max(0, first_pos - window + 1) : 0;
    part_begin = window_begin + part * plan.part_tokens;
    // The last partition runs to the end of the context, whatever the plan's max_seq_len was (a
    // CUDA graph replays a plan captured for shorter sequences: no key may be dropped).
    part_end = part == plan.num_parts - 1 ? kv_end : min(part_begin + plan.part_tokens, kv_end);
  }

  // Query token, query head and position of row r of the tile.
  __device__ __forceinline__ int token(int r) const { return q_begin + (row0 + r) / group; }
  __device__ __forceinline__ int head(int r) const { return kv_head * group + (row0 + r) % group; }
  // (Not causal, first_pos is the sequence's end and the max makes every row's position it.)
  __device__ __forceinline__ int pos(int r) const {
    return max(seq_len - q_len + (row0 + r) / group, first_pos);
  }

  // Keys [begin, end) that every row of the tile sees, whole: below the first row's causal
  // bound and the partition's end, at or after the last row's window start. Their scores need
  // no mask; empty (begin >= end) when no key qualifies.
  __device__ __forceinline__ int unmasked_begin() const {
    return window > 0 ? max(part_begin, last_pos + 1 - window) : part_begin;
  }
  __device__ __forceinline__ int unmasked_end() const { return min(part_end, first_pos + 1); }
};

// x / d and x % d for 0 <= x < 2^31 and a runtime 1 <= d <= 2^16, without branches: q =
// (umulhi(x, m) + x) >> s with s = ceil(log2 d), m = floor(2^32 (2^s - d) / d) + 1 (Granlund and
// Montgomery; the sum stays below 2^32 since umulhi(x, m) <= x < 2^31). Four instructions for any
// block size where FastDiv's power-of-two test puts a division beside its shifts.
struct MagicDiv {
  uint32_t d, m, s;
  __device__ __forceinline__ explicit MagicDiv(int divisor)
      : d(static_cast<uint32_t>(divisor)), s(0) {
    while ((1u << s) < d) ++s;
    m = static_cast<uint32_t>((uint64_t{1} << 32) * ((uint64_t{1} << s) - d) / d + 1);
  }
  __device__ __forceinline__ void divmod(int x, int& q, int& r) const {
    const uint32_t u = static_cast<uint32_t>(x);
    q = static_cast<int>((__umulhi(u, m) + u) >> s);
    r = x - q * static_cast<int>(d);
  }
};

// The rows of one kv head's K and V caches, from element `dim` of each row: key t lives in
// physical block table[t / block_size], token t % block_size of it. Offsets are in bytes, the
// block's a 32 x 32 -> 64-bit product, the token's in its block 32-bit (the glue checks that both
// strides allow it); K and V share them when their strides agree (HND, NHD, combined caches).
// Div: the block-size divider (FastDiv, or MagicDiv where a branch would cost more).
template <typename C, typename Div = FastDiv>
struct KVRows {
  const char* k;
  const char* v;
  const int* table;
  uint32_t k_block, k_token, v_block, v_token;
  Div div;

  __device__ __forceinline__ KVRows(const PagedAttentionParams& p, int seq, int kv_head, int dim)
      : k(reinterpret_cast<const char*>(
            p.key_cache.as<const C>().head(kv_head, dim / kUnitElems<C>).data)),
        v(reinterpret_cast<const char*>(
            p.value_cache.as<const C>().head(kv_head, dim / kUnitElems<C>).data)),
        table(p.block_tables + static_cast<int64_t>(seq) * p.block_table_stride),
        k_block(static_cast<uint32_t>(p.key_cache.strides.block * sizeof(C))),
        k_token(static_cast<uint32_t>(p.key_cache.strides.token * sizeof(C))),
        v_block(static_cast<uint32_t>(p.value_cache.strides.block * sizeof(C))),
        v_token(static_cast<uint32_t>(p.value_cache.strides.token * sizeof(C))),
        div(p.key_cache.block_size) {}

  __device__ __forceinline__ bool same_strides() const {
    return k_block == v_block && k_token == v_token;
  }
  // Key t's physical block (its block-table entry, read here) and token in that block.
  __device__ __forceinline__ void locate(int t, uint32_t& blk, uint32_t& off) const {
    int b, o;
    div.divmod(t, b, o);
    blk = static_cast<uint32_t>(load_ro(table + b, "table"));
    off = static_cast<uint32_t>(o);
  }
  __device__ __forceinline__ uint64_t k_offset(uint32_t blk, uint32_t off) const {
    return static_cast<uint64_t>(blk) * k_block + off * k_token;
  }
  __device__ __forceinline__ uint64_t v_offset(uint32_t blk, uint32_t off) const {
    return static_cast<uint64_t>(blk) * v_block + off * v_token;
  }
  __device__ __forceinline__ const C* k_row(uint64_t offset) const {
    return reinterpret_cast<const C*>(k + offset);
  }
  __device__ __forceinline__ const C* v_row(uint64_t offset) const {
    return reinterpret_cast<const C*>(v + offset);
  }
};

// The per-(token, head) scales of one kv head's K and V rows (PagedAttentionParams::key_scales,
// value_scales; quantized caches): key t's at its physical block and token, in the scales' own
// strides (floats). Null views (other caches) are never read.
struct RowScales {
  const float* k = nullptr;
  const float* v = nullptr;
  int64_t k_block, k_token, v_block, v_token;

  __device__ __forceinline__ RowScales(const PagedAttentionParams& p, int kv_head)
      : k_block(p.key_scales.strides.block), k_token(p.key_scales.strides.token),
        v_block(p.value_scales.strides.block), v_token(p.value_scales.strides.token) {
    if (p.key_scales.data != nullptr) {
      k = static_cast<const float*>(p.key_scales.data) + kv_head * p.key_scales.strides.head;
      v = static_cast<const float*>(p.value_scales.data) + kv_head * p.value_scales.strides.head;
    }
  }
  __device__ __forceinline__ float key(uint32_t blk, uint32_t off) const {
    return load_ro(k + blk * k_block + off * k_token, "kv_scales");
  }
  __device__ __forceinline__ float value(uint32_t blk, uint32_t off) const {
    return load_ro(v + blk * v_block + off * v_token, "kv_scales");
  }
};

// The query dtype as a kernel's template argument when it is read from p.dtype at run time
// instead: the row-scaled CUDA-core kernels are one instantiation for every query dtype (the
// dtype only touches the query's load and the output's store, outside the key loop).
struct AnyQuery {};

// Element d of query row (token, head), as float.
template <typename T>
__device__ __forceinline__ float query_elem(const PagedAttentionParams& p, int64_t token, int head,
                                            int d) {
  if constexpr (std::is_same_v<T, AnyQuery>) {
    switch (p.dtype) {
      case DType::kFloat32: return query_elem<float>(p, token, head, d);
      case DType::kFloat16: return query_elem<__half>(p, token, head, d);
      default: return query_elem<__nv_bfloat16>(p, token, head, d);
    }
  } else {
    const T* q = static_cast<const T*>(p.query) + token * p.q_token_stride +
                 static_cast<int64_t>(head) * p.q_head_stride;
    return to_float(load(q + d, "query"));
  }
}

// Where one row's result goes: its out row and lse (one partition), or its slot (token, head,
// part) of the split-K workspace, which the reduce merges (several). A final row takes its
// head's sink here (sink_row, kernels/attention_params.h); a partial one does not, the reduce
// adds the sink once. Every write is a store().
template <typename T>
struct OutRow {
  RowOf<T> out{nullptr, 0, false};  // one partition: the row of out (floats: p.float_out)
  float* partial = nullptr;          // several: the row's partial output in the workspace
  float* lse = nullptr;              // lse_out's element (or nullptr) / the workspace's lse
  float keep = 1.f;                  // the sink's factor of a final row's output
  float row_lse;                     // what put_lse writes: the row's lse, with the sink when final

  // lse: the row's log-sum-exp over its keys (natural log; -inf when it saw none).
  __device__ __forceinline__ OutRow(const PagedAttentionParams& p, const AttentionPlan& plan,
                                    int64_t token, int head, int part, float row_lse_)
      : row_lse(row_lse_) {
    if (plan.num_parts == 1) {
      out = RowOf<T>(p.out, token * p.out_token_stride + head * p.out_head_stride, p.float_out);
      if (p.lse_out != nullptr) {
        lse = p.lse_out + token * p.lse_token_stride + head * p.lse_head_stride;
      }
      if (p.sinks != nullptr) {
        const SinkedRow sunk = sink_row(row_lse, load(p.sinks + head, "sinks"));
        keep = sunk.keep;
        row_lse = sunk.lse;
      }
    } else {
      const int64_t slot = (token * p.num_heads + head) * plan.num_parts + part;
      partial = plan.tmp_out + slot * p.head_size_v;
      lse = plan.tmp_lse + slot;
    }
  }
  // Element d of the row, normalized (and scaled by v_scale for fp8).
  __device__ __forceinline__ void put(int d, float x) const {
    if (partial != nullptr) {
      store(partial + d, x, "workspace");
    } else {
      out.put(d, x * keep, "out");
    }
  }
  __device__ __forceinline__ void put_lse() const {
    if (lse != nullptr) store(lse, row_lse, partial != nullptr ? "workspace" : "lse");
  }
};

// Element d (x, normalized) of row (token, head)'s result and, with d == 0, its lse (OutRow).
template <typename T>
__device__ __forceinline__ void put_result(const PagedAttentionParams& p, const AttentionPlan& plan,
                                           int64_t token, int head, int part, float lse, int d,
                                           float x) {
  if constexpr (std::is_same_v<T, AnyQuery>) {
    switch (p.dtype) {
      case DType::kFloat32: return put_result<float>(p, plan, token, head, part, lse, d, x);
      case DType::kFloat16: return put_result<__half>(p, plan, token, head, part, lse, d, x);
      default: return put_result<__nv_bfloat16>(p, plan, token, head, part, lse, d, x);
    }
  } else {
    const OutRow<T> dst(p, plan, token, head, part, lse);
    dst.put(d, x);
    if (d == 0) dst.put_lse();
  }
}

// Runs `kernel` on the plan's grid with `threads` threads and `smem` bytes of dynamic shared
// memory, then, with several partitions, the split-K reduce that merges them into out / lse.
template <typename T, typename Kernel>
cudaError_t launch_attention(Kernel kernel, int threads, size_t smem, const PagedAttentionParams& p,
                             const AttentionPlan& plan, cudaStream_t stream) {
  if (smem > 48 * 1024) {
    const cudaError_t err = cudaFuncSetAttribute(
        kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
    if (err != cudaSuccess) return err;
  }
  const dim3 grid(static_cast<unsigned>(plan.row_tiles * plan.num_parts),
                  static_cast<unsigned>(p.num_seqs), static_cast<unsigned>(p.num_kv_heads));
  PAGEDKV_LAUNCH(kernel, grid, threads, smem, stream)(p, plan);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess || plan.num_parts == 1) return err;
  const dim3 reduce_grid(static_cast<unsigned>(p.num_tokens), static_cast<unsigned>(p.num_heads));
  auto reduce = paged_attention_reduce_kernel<T>;
  PAGEDKV_LAUNCH(reduce, reduce_grid, kMergeThreads, 0, stream)(p, plan);
  return cudaGetLastError();
}

}  // namespace attn
}  // namespace PAGEDKV_KERNEL_NS
}  // namespace pagedkv
