// The MLA (latent) cache ops: concat_and_cache_mla writes each token's compressed latent and
// rotary key as one cache row; gather_cache reads sequences' rows back into one dense tensor
// (the non-absorbed prefill's input), dequantizing an fp8 cache. Their schemas, their kernel
// parameters from tensors (the checks every backend shares) and the ops every backend registers.
#pragma once
#include <ATen/ATen.h>

#include "glue/tensor_checks.h"
#include "kernels/cache_params.h"

namespace pagedkv {

// Write [kv_c[i], k_pe[i]] to the cache row of slot_mapping[i] (a negative slot is padding);
// fp8 caches quantize with the per-tensor scale.
inline constexpr char kConcatAndCacheMlaSchema[] =
    "concat_and_cache_mla(Tensor kv_c, Tensor k_pe, Tensor(a!) kv_cache, Tensor slot_mapping, "
    "Tensor? scale=None) -> ()";

// Copy sequence b's cache rows, from position seq_starts[b] (default 0), into out rows
// cu_seq_lens[b] .. cu_seq_lens[b + 1] - 1; an fp8 cache into a float out is dequantized.
inline constexpr char kGatherCacheSchema[] =
    "gather_cache(Tensor kv_cache, Tensor block_table, Tensor cu_seq_lens, Tensor(a!) out, "
    "Tensor? scale=None, Tensor? seq_starts=None) -> ()";

// An MLA cache [num_blocks, block_size, width], last dim contiguous, as a one-head PagedKVView.
inline PagedKVView check_mla_cache(const at::Tensor& cache, const char* op) {
  check_dim(cache, 3, op, "kv_cache", "[num_blocks, block_size, kv_lora_rank + rope_dim]");
  dtype_of(cache, op, "kv_cache");
  TORCH_CHECK(cache.stride(2) == 1, op,
              ": kv_cache must have a contiguous last dim, got strides ", cache.strides());
  return {cache.data_ptr(), {cache.stride(0), 0, cache.stride(1)},
          static_cast<int32_t>(cache.size(1))};
}

inline void check_latent_rows(const at::Tensor& t, int64_t num_tokens, const char* op,
                              const char* name, const char* shape) {
  check_dim(t, 2, op, name, shape);
  TORCH_CHECK(t.size(0) == num_tokens && t.size(1) >= 1, op, ": ", name, " must be ", shape,
              " with num_tokens = ", num_tokens, " and a non-empty last dim, got ", t.sizes());
  TORCH_CHECK(t.stride(1) == 1, op, ": ", name, " must have a contiguous last dim, got strides ",
              t.strides());
}

inline ConcatAndCacheMlaParams concat_and_cache_mla_params(
    const at::Tensor& kv_c, const at::Tensor& k_pe, const at::Tensor& kv_cache,
    const at::Tensor& slot_mapping, const c10::optional<at::Tensor>& scale) {
  constexpr const char* op = "concat_and_cache_mla";
  const PagedKVView cache = check_mla_cache(kv_cache, op);
  const int64_t num_tokens = kv_c.dim() > 0 ? kv_c.size(0) : 0;
  check_latent_rows(kv_c, num_tokens, op, "kv_c", "[num_tokens, kv_lora_rank]");
  check_latent_rows(k_pe, num_tokens, op, "k_pe", "[num_tokens, rope_dim]");
  TORCH_CHECK(kv_c.size(1) + k_pe.size(1) == kv_cache.size(2), op,
              ": kv_cache must be kv_lora_rank + rope_dim = ", kv_c.size(1), " + ", k_pe.size(1),
              " = ", kv_c.size(1) + k_pe.size(1), " wide, got ", kv_cache.size(2));
  const DType src = dtype_of(kv_c, op, "kv_c");
  TORCH_CHECK(!is_fp8(kv_c.scalar_type()), op, ": kv_c must be float32, float16 or bfloat16, got ",
              kv_c.scalar_type());
  TORCH_CHECK(k_pe.scalar_type() == kv_c.scalar_type(), op, ": k_pe must have kv_c's dtype ",
              kv_c.scalar_type(), ", got ", k_pe.scalar_type());
  TORCH_CHECK(is_fp8(kv_cache.scalar_type()) || kv_cache.scalar_type() == kv_c.scalar_type(), op,
              ": kv_cache must have kv_c's dtype ", kv_c.scalar_type(), " or be fp8, got ",
              kv_cache.scalar_type());
  check_device(kv_c, kv_cache, op, "kv_c", "kv_cache");
  check_device(k_pe, kv_cache, op, "k_pe", "kv_cache");
  const float* scale_data = scale_ptr(scale, kv_cache, op, "scale");
  check_slot_mapping(slot_mapping, num_tokens, kv_cache, kv_cache.size(0), kv_cache.size(1), op);
  ConcatAndCacheMlaParams p{};
  p.kv_c = kv_c.data_ptr();
  p.k_pe = k_pe.data_ptr();
  p.kv_c_stride = kv_c.stride(0);
  p.k_pe_stride = k_pe.stride(0);
  p.cache = cache;
  p.slot_mapping = slot_mapping.data_ptr<int64_t>();
  p.scale = scale_data;
  p.num_tokens = num_tokens;
  p.kv_lora_rank = to_int32(kv_c.size(1), op, "kv_lora_rank");
  p.rope_dim = to_int32(k_pe.size(1), op, "rope_dim");
  p.src_dtype = src;
  p.cache_dtype = dtype_of(kv_cache, op, "kv_cache");
  return p;
}

// On host-readable indices: cu_seq_lens counts up from 0 to out's rows, and every block a
// sequence reads is in its table row and in the cache.
inline void check_gather_indices(const at::Tensor& kv_cache, const at::Tensor& block_table,
                                 const at::Tensor& cu_seq_lens, const at::Tensor& out,
                                 const c10::optional<at::Tensor>& seq_starts, const char* op) {
  const at::Tensor cu = cu_seq_lens.cpu();
  const at::Tensor table = block_table.cpu();
  const int32_t* lens = cu.data_ptr<int32_t>();
  const int64_t batch = block_table.size(0), block_size = kv_cache.size(1);
  TORCH_CHECK(lens[0] == 0 && lens[batch] == out.size(0), op, ": cu_seq_lens must count from 0 "
              "to out's ", out.size(0), " rows, got ", lens[0], " .. ", lens[batch]);
  const at::Tensor starts = seq_starts.has_value() ? seq_starts->cpu() : at::Tensor();
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t len = lens[b + 1] - lens[b];
    const int64_t start = starts.defined() ? starts.data_ptr<int32_t>()[b] : 0;
    TORCH_CHECK(len >= 0, op, ": cu_seq_lens must not decrease, got ", lens[b], " then ",
                lens[b + 1], " at sequence ", b);
    TORCH_CHECK(start >= 0, op, ": seq_starts must be >= 0, got ", start, " at sequence ", b);
    if (len == 0) continue;
    const int64_t blocks = (start + len - 1) / block_size + 1;
    TORCH_CHECK(blocks <= block_table.size(1), op, ": sequence ", b, " reads positions ", start,
                " .. ", start + len - 1, ", past its block_table row of ", block_table.size(1),
                " blocks of ", block_size);
    for (int64_t i = start / block_size; i < blocks; ++i) {
      const int32_t block = table.data_ptr<int32_t>()[b * block_table.size(1) + i];
      TORCH_CHECK(block >= 0 && block < kv_cache.size(0), op, ": block_table[", b, "][", i,
                  "] = ", block, " is not a block of the cache's ", kv_cache.size(0));
    }
  }
}

inline GatherCacheParams gather_cache_params(const at::Tensor& kv_cache,
                                             const at::Tensor& block_table,
                                             const at::Tensor& cu_seq_lens, const at::Tensor& out,
                                             const c10::optional<at::Tensor>& scale,
                                             const c10::optional<at::Tensor>& seq_starts) {
  constexpr const char* op = "gather_cache";
  const PagedKVView cache = check_mla_cache(kv_cache, op);
  check_index(block_table, at::kInt, op, "block_table");
  check_dim(block_table, 2, op, "block_table", "[batch, max_blocks]");
  const int64_t batch = block_table.size(0);
  check_index(cu_seq_lens, at::kInt, op, "cu_seq_lens");
  TORCH_CHECK(cu_seq_lens.dim() == 1 && cu_seq_lens.size(0) == batch + 1, op,
              ": cu_seq_lens must be [batch + 1] = [", batch + 1, "], got ", cu_seq_lens.sizes());
  if (seq_starts.has_value()) {
    check_index(*seq_starts, at::kInt, op, "seq_starts");
    TORCH_CHECK(seq_starts->dim() == 1 && seq_starts->size(0) == batch, op,
                ": seq_starts must be [batch] = [", batch, "], got ", seq_starts->sizes());
    check_device(*seq_starts, kv_cache, op, "seq_starts", "kv_cache");
  }
  check_dim(out, 2, op, "out", "[total_tokens, width]");
  TORCH_CHECK(out.size(1) == kv_cache.size(2) && out.stride(1) == 1, op,
              ": out must be [total_tokens, ", kv_cache.size(2),
              "] with a contiguous last dim, got shape ", out.sizes(), " and strides ",
              out.strides());
  const DType out_dtype = dtype_of(out, op, "out");
  const float* scale_data = nullptr;
  if (out.scalar_type() == kv_cache.scalar_type()) {
    TORCH_CHECK(!scale.has_value(), op, ": scale dequantizes an fp8 kv_cache into a float out; "
                "out has the cache's dtype ", kv_cache.scalar_type(), ", so it takes the rows as "
                "stored and no scale");
  } else {
    TORCH_CHECK(is_fp8(kv_cache.scalar_type()) && !is_fp8(out.scalar_type()), op,
                ": out must have kv_cache's dtype ", kv_cache.scalar_type(),
                (is_fp8(kv_cache.scalar_type()) ? ", or be float32, float16 or bfloat16" : ""),
                ", got ", out.scalar_type());
    scale_data = scale_ptr(scale, kv_cache, op, "scale");
  }
  check_device(block_table, kv_cache, op, "block_table", "kv_cache");
  check_device(cu_seq_lens, kv_cache, op, "cu_seq_lens", "kv_cache");
  check_device(out, kv_cache, op, "out", "kv_cache");
  if (index_checks_enabled(cu_seq_lens)) {
    check_gather_indices(kv_cache, block_table, cu_seq_lens, out, seq_starts, op);
  }
  GatherCacheParams p{};
  p.cache = cache;
  p.out = out.data_ptr();
  p.out_stride = out.stride(0);
  p.block_table = block_table.data_ptr<int32_t>();
  p.block_table_stride = block_table.stride(0);
  p.max_blocks = to_int32(block_table.size(1), op, "max_blocks");
  p.cu_seq_lens = cu_seq_lens.data_ptr<int32_t>();
  p.seq_starts = seq_starts.has_value() ? seq_starts->data_ptr<int32_t>() : nullptr;
  p.scale = scale_data;
  p.batch = to_int32(batch, op, "batch");
  p.width = to_int32(kv_cache.size(2), op, "width");
  p.cache_dtype = dtype_of(kv_cache, op, "kv_cache");
  p.out_dtype = out_dtype;
  return p;
}

// The backends' parts: Run(params, kv_cache) after the checks; kv_cache places the work.
using ConcatAndCacheMlaRun = void (*)(const ConcatAndCacheMlaParams&, const at::Tensor&);
using GatherCacheRun = void (*)(const GatherCacheParams&, const at::Tensor&);

template <ConcatAndCacheMlaRun Run>
void concat_and_cache_mla_op(const at::Tensor& kv_c, const at::Tensor& k_pe, at::Tensor& kv_cache,
                             const at::Tensor& slot_mapping,
                             const c10::optional<at::Tensor>& scale) {
  Run(concat_and_cache_mla_params(kv_c, k_pe, kv_cache, slot_mapping, scale), kv_cache);
}

template <GatherCacheRun Run>
void gather_cache_op(const at::Tensor& kv_cache, const at::Tensor& block_table,
                     const at::Tensor& cu_seq_lens, at::Tensor& out,
                     const c10::optional<at::Tensor>& scale,
                     const c10::optional<at::Tensor>& seq_starts) {
  Run(gather_cache_params(kv_cache, block_table, cu_seq_lens, out, scale, seq_starts), kv_cache);
}

}  // namespace pagedkv
