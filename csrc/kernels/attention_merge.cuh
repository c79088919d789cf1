// The merge of partial attention states by their log-sum-exps: the split-K reduce of
// paged_attention and the merge_attn_states op.
#pragma once
#include "kernels/compat.cuh"
#include "kernels/attention_launch.h"
#include "kernels/dtypes.cuh"
#include "kernels/memory.cuh"

#include <type_traits>

namespace pagedkv {
namespace PAGEDKV_KERNEL_NS {
namespace attn {

constexpr int kMergeThreads = 128;

// Whether a row sum or a merge weight x counts: positive, or NaN (a NaN logit: fmaxf skips it
// in the running max, exp2f and the sums carry it, and the row's output and lse must be NaN, as
// in the reference). 0 is a row that saw no key, or a part of weight 0, whose rows are not read.
__device__ __forceinline__ bool counts(float x) { return !(x <= 0.f); }

// Weights of n partial states with log-sum-exps lse[0..n): w_i = exp(lse_i - lse), where
// lse = log(sum_i exp(lse_i)); states with lse = -inf (no keys) get weight 0. An lse of NaN (a
// NaN logit in that state) makes the merged lse NaN (fmaxf alone would drop it).
__device__ __forceinline__ float merged_lse(const float* lse, int n, int stride) {
  float m = -INFINITY;
  bool nan = false;
  for (int i = 0; i < n; ++i) {
    m = fmaxf(m, lse[i * stride]);
    nan |= isnan(lse[i * stride]);
  }
  if (nan) return NAN;
  if (m == -INFINITY) return -INFINITY;
  float sum = 0.f;
  for (int i = 0; i < n; ++i) sum += expf(lse[i * stride] - m);
  return m + logf(sum);
}

// Element d of a row of T elements, or of floats where `wide` (T 16-bit: a float32 out, the
// rows unrounded; PagedAttentionParams::float_out, MergeAttnParams::state_dtype), as a float.
template <typename T>
struct RowOf {
  void* row;
  bool wide;
  __device__ __forceinline__ RowOf(void* base, int64_t offset, bool wide_)
      : row(wide_ ? static_cast<void*>(static_cast<float*>(base) + offset)
                  : static_cast<void*>(static_cast<T*>(base) + offset)),
        wide(wide_ && !std::is_same_v<T, float>) {}
  __device__ __forceinline__ void put(int d, float x, const char* tag) const {
    if (wide) {
      store(static_cast<float*>(row) + d, x, tag);
    } else {
      store(static_cast<T*>(row) + d, from_float<T>(x), tag);
    }
  }
  __device__ __forceinline__ float get(int d, const char* tag) const {
    return wide ? load(static_cast<const float*>(row) + d, tag)
                : to_float(load(static_cast<const T*>(row) + d, tag));
  }
};

// Split-K reduce: out = sum_p exp(lse_p - lse) * partial_p. The merged lse and the partitions'
// weights are computed once per block (warp 0, into shared memory), not by every thread.
// grid: (num_tokens, num_heads), block: kMergeThreads.
template <typename T>
__global__ void __launch_bounds__(kMergeThreads)
    paged_attention_reduce_kernel(const PagedAttentionParams p, const AttentionPlan plan) {
  __shared__ float weight[kAttnMaxParts];
  __shared__ float merged;
  const int64_t token = blockIdx.x;
  const int head = blockIdx.y;
  if (p.query_start_loc != nullptr && token >= p.query_start_loc[p.num_seqs]) return;
  const int64_t row = token * p.num_heads + head;
  const float* lse = plan.tmp_lse + row * plan.num_parts;
  const int n = plan.num_parts;
  if (threadIdx.x < 32) {  // warp 0: max and sum of exp over the partitions, by shuffles
    const int lane = threadIdx.x;
    float x[kAttnMaxParts / 32];
    float m = -INFINITY;
    int nan = 0;  // a partition's lse of NaN (a NaN logit) makes the merged row NaN
#pragma unroll
    for (int j = 0; j < kAttnMaxParts / 32; ++j) {
      const int i = lane + 32 * j;
      x[j] = i < n ? load(lse + i, "workspace") : -INFINITY;
      m = fmaxf(m, x[j]);
      nan |= isnan(x[j]);
    }
#pragma unroll
    for (int o = 16; o > 0; o /= 2) {
      m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
      nan |= __shfl_xor_sync(0xffffffffu, nan, o);
    }
    if (nan) m = NAN;  // every weight and the lse NaN (fmaxf dropped it)
    float sum = 0.f;
#pragma unroll
    for (int j = 0; j < kAttnMaxParts / 32; ++j) {
      x[j] = m == -INFINITY ? 0.f : expf(x[j] - m);
      sum += x[j];
    }
#pragma unroll
    for (int o = 16; o > 0; o /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    float total = m == -INFINITY ? -INFINITY : m + logf(sum);
    // The merged row is a finished one: its sink enters here, once (sink_row, as OutRow and the
    // CPU kernels apply it), scaling every partition's weight.
    float keep = 1.f;
    if (p.sinks != nullptr) {
      const SinkedRow sunk = sink_row(total, load(p.sinks + head, "sinks"));
      keep = sunk.keep;
      total = sunk.lse;
    }
#pragma unroll
    for (int j = 0; j < kAttnMaxParts / 32; ++j) {
      const int i = lane + 32 * j;
      if (i < n) weight[i] = m == -INFINITY ? 0.f : x[j] / sum * keep;
    }
    if (lane == 0) merged = total;
  }
  __syncthreads();
  const RowOf<T> out(p.out, token * p.out_token_stride + head * p.out_head_stride, p.float_out);
  const float* partial = plan.tmp_out + row * n * p.head_size_v;
  for (int d = threadIdx.x; d < p.head_size_v; d += kMergeThreads) {
    float o = 0.f;
    for (int i = 0; i < n; ++i) {
      const float w = weight[i];
      if (counts(w)) o += w * load(partial + i * p.head_size_v + d, "workspace");
    }
    out.put(d, o, "out");
  }
  if (threadIdx.x == 0 && p.lse_out != nullptr) {
    store(p.lse_out + token * p.lse_token_stride + head * p.lse_head_stride, merged, "lse");
  }
}

// merge_attn_states: the same merge over two states held in separate tensors.
// grid: (num_tokens, num_heads), block: kMergeThreads.
template <typename T>
__global__ void __launch_bounds__(kMergeThreads) merge_attn_states_kernel(const MergeAttnParams p) {
  const int64_t token = blockIdx.x;
  const int head = blockIdx.y;
  // An lse of +inf marks an empty part too (FlashAttention-3 and vLLM mark empty splits so):
  // it is read as -inf, so the part gets weight 0 and its rows are never read.
  float lse[2] = {p.prefix_lse[token * p.prefix_lse_token_stride + head * p.prefix_lse_head_stride],
                 p.suffix_lse[token * p.suffix_lse_token_stride + head * p.suffix_lse_head_stride]};
  for (float& x : lse) {
    if (x == INFINITY) x = -INFINITY;
  }
  const float total = merged_lse(lse, 2, 1);
  const float wp = total == -INFINITY ? 0.f : expf(lse[0] - total);
  const float ws = total == -INFINITY ? 0.f : expf(lse[1] - total);
  const bool wide = p.state_dtype == DType::kFloat32;
  const RowOf<T> prefix(const_cast<void*>(p.prefix_out),
                        token * p.prefix_token_stride + head * p.prefix_head_stride, wide);
  const RowOf<T> suffix(const_cast<void*>(p.suffix_out),
                        token * p.suffix_token_stride + head * p.suffix_head_stride, wide);
  T* out = static_cast<T*>(p.out) + token * p.out_token_stride + head * p.out_head_stride;
  for (int d = threadIdx.x; d < p.head_size; d += kMergeThreads) {
    // The rows of an empty part (weight 0) are never read: they may hold anything.
    const float o = (counts(wp) ? wp * prefix.get(d, "state") : 0.f) +
                    (counts(ws) ? ws * suffix.get(d, "state") : 0.f);
    store(out + d, from_float<T>(o), "out");
  }
  if (threadIdx.x == 0 && p.out_lse != nullptr) {
    store(p.out_lse + token * p.out_lse_token_stride + head * p.out_lse_head_stride, total, "lse");
  }
}

}  // namespace attn
}  // namespace PAGEDKV_KERNEL_NS
}  // namespace pagedkv
