// Validated kernel parameters of the cache ops, built from tensors. Every backend's glue calls
// these, so cpu, cuda and simt accept and reject exactly the same inputs.
#pragma once
#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <unordered_set>
#include <vector>

#include "glue/tensor_checks.h"
#include "kernels/cache_params.h"

namespace pagedkv {

inline ReshapeAndCacheParams reshape_and_cache_params(
    const at::Tensor& key, const at::Tensor& value, const at::Tensor& key_cache,
    const at::Tensor& value_cache, const at::Tensor& slot_mapping,
    const c10::optional<at::Tensor>& k_scale, const c10::optional<at::Tensor>& v_scale) {
  constexpr const char* op = "reshape_and_cache";
  check_cache_pair(key_cache, value_cache, op);
  check_dim(key, 3, op, "key", "[num_tokens, num_kv_heads, head_size]");
  TORCH_CHECK(key.sizes() == value.sizes(), op, ": value must have key's shape ", key.sizes(),
              ", got ", value.sizes());
  const int64_t num_tokens = key.size(0);
  TORCH_CHECK(key.size(1) == key_cache.size(1) && key.size(2) == key_cache.size(3), op,
              ": key must be [num_tokens, ", key_cache.size(1), ", ", key_cache.size(3),
              "] to match key_cache, got ", key.sizes());
  TORCH_CHECK(key.stride(2) == 1 && value.stride(2) == 1, op,
              ": key and value must have a contiguous last dim, got strides ", key.strides(),
              " and ", value.strides());
  const DType src = dtype_of(key, op, "key");
  TORCH_CHECK(value.scalar_type() == key.scalar_type(), op, ": value must have key's dtype ",
              key.scalar_type(), ", got ", value.scalar_type());
  if (is_fp8(key_cache.scalar_type())) {
    TORCH_CHECK(!is_fp8(key.scalar_type()), op,
                ": key must be float32, float16 or bfloat16 for an fp8 cache, got ",
                key.scalar_type());
  } else {
    TORCH_CHECK(key.scalar_type() == key_cache.scalar_type(), op,
                ": key must have the cache dtype ", key_cache.scalar_type(), ", got ",
                key.scalar_type());
  }
  check_device(key, key_cache, op, "key", "key_cache");
  check_device(value, key_cache, op, "value", "key_cache");
  check_device(slot_mapping, key_cache, op, "slot_mapping", "key_cache");
  check_index(slot_mapping, at::kLong, op, "slot_mapping");
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.size(0) == num_tokens, op,
              ": slot_mapping must be [num_tokens] = [", num_tokens, "], got ",
              slot_mapping.sizes());
  const float* k_scale_ptr = scale_ptr(k_scale, key_cache, op, "k_scale");
  const float* v_scale_ptr = scale_ptr(v_scale, key_cache, op, "v_scale");
  const int64_t num_slots = key_cache.size(0) * key_cache.size(2);
  if (index_checks_enabled(slot_mapping) && num_tokens > 0) {
    const int64_t max_slot = slot_mapping.max().item<int64_t>();
    TORCH_CHECK(max_slot < num_slots, op, ": slot_mapping holds slot ", max_slot,
                ", out of range for a cache of ", key_cache.size(0), " blocks of ",
                key_cache.size(2), " tokens (", num_slots, " slots)");
  }
  ReshapeAndCacheParams p{};
  p.key = key.data_ptr();
  p.value = value.data_ptr();
  p.key_token_stride = key.stride(0);
  p.key_head_stride = key.stride(1);
  p.value_token_stride = value.stride(0);
  p.value_head_stride = value.stride(1);
  p.key_cache = key_cache.data_ptr();
  p.value_cache = value_cache.data_ptr();
  p.k_strides = strides_of(key_cache);
  p.v_strides = strides_of(value_cache);
  p.slot_mapping = slot_mapping.data_ptr<int64_t>();
  p.k_scale = k_scale_ptr;
  p.v_scale = v_scale_ptr;
  p.num_tokens = num_tokens;
  p.num_kv_heads = static_cast<int32_t>(key_cache.size(1));
  p.head_size = static_cast<int32_t>(key_cache.size(3));
  p.block_size = static_cast<int32_t>(key_cache.size(2));
  p.src_dtype = src;
  p.cache_dtype = dtype_of(key_cache, op, "key_cache");
  return p;
}

// A [num_pairs, 2] int64 (src, dst) block mapping. When the indices are readable for free (see
// index_checks_enabled), ids are checked against the block counts and, since pairs are applied
// concurrently, a destination may appear once and, within one cache, never as a source.
inline void check_block_mapping(const at::Tensor& mapping, int64_t src_blocks, int64_t dst_blocks,
                                bool same_cache, const char* op) {
  check_index(mapping, at::kLong, op, "block_mapping");
  TORCH_CHECK(mapping.dim() == 2 && mapping.size(1) == 2, op,
              ": block_mapping must be [num_pairs, 2] (src, dst), got shape ", mapping.sizes());
  if (!index_checks_enabled(mapping) || mapping.size(0) == 0) return;
  const at::Tensor host = mapping.cpu();
  const int64_t* ids = host.data_ptr<int64_t>();
  const int64_t num_pairs = host.size(0);
  for (int64_t i = 0; i < num_pairs; ++i) {
    TORCH_CHECK(ids[2 * i] >= 0 && ids[2 * i] < src_blocks, op, ": block_mapping[", i,
                "] has source block ", ids[2 * i], ", expected 0 <= id < ", src_blocks);
    TORCH_CHECK(ids[2 * i + 1] >= 0 && ids[2 * i + 1] < dst_blocks, op, ": block_mapping[", i,
                "] has destination block ", ids[2 * i + 1], ", expected 0 <= id < ", dst_blocks);
  }
  std::unordered_set<int64_t> sources, destinations;
  for (int64_t i = 0; i < num_pairs; ++i) sources.insert(ids[2 * i]);
  for (int64_t i = 0; i < num_pairs; ++i) {
    const int64_t dst = ids[2 * i + 1];
    TORCH_CHECK(destinations.insert(dst).second, op, ": block_mapping names destination block ",
                dst, " twice");
    TORCH_CHECK(!same_cache || !sources.count(dst), op, ": block_mapping uses block ", dst,
                " both as a source and as a destination");
  }
}

// One parameter set per chunk of at most kMaxLayersPerLaunch layers (pointers travel by value).
inline std::vector<CopyBlocksParams> copy_blocks_params(at::TensorList key_caches,
                                                        at::TensorList value_caches,
                                                        const at::Tensor& block_mapping) {
  constexpr const char* op = "copy_blocks";
  TORCH_CHECK(key_caches.size() == value_caches.size(), op,
              ": key_caches and value_caches must have one tensor per layer each, got ",
              key_caches.size(), " and ", value_caches.size());
  std::vector<CopyBlocksParams> chunks;
  if (key_caches.empty()) return chunks;
  const at::Tensor& k0 = key_caches[0];
  const at::Tensor& v0 = value_caches[0];
  check_cache_pair(k0, v0, op);
  for (size_t l = 1; l < key_caches.size(); ++l) {
    check_cache_pair(key_caches[l], value_caches[l], op);
    TORCH_CHECK(key_caches[l].sizes() == k0.sizes() && key_caches[l].strides() == k0.strides() &&
                    value_caches[l].strides() == v0.strides() &&
                    key_caches[l].scalar_type() == k0.scalar_type() &&
                    key_caches[l].device() == k0.device(),
                op, ": every layer must have layer 0's shape, strides, dtype and device; layer ",
                l, " differs");
  }
  check_device(block_mapping, k0, op, "block_mapping", "the caches");
  check_block_mapping(block_mapping, k0.size(0), k0.size(0), /*same_cache=*/true, op);
  const int64_t elem = k0.element_size();
  for (size_t first = 0; first < key_caches.size(); first += kMaxLayersPerLaunch) {
    CopyBlocksParams p{};
    p.num_layers = static_cast<int32_t>(
        std::min<size_t>(kMaxLayersPerLaunch, key_caches.size() - first));
    for (int32_t l = 0; l < p.num_layers; ++l) {
      p.key_caches[l] = static_cast<char*>(key_caches[first + l].data_ptr());
      p.value_caches[l] = static_cast<char*>(value_caches[first + l].data_ptr());
    }
    p.k_strides_bytes = strides_of(k0, elem);
    p.v_strides_bytes = strides_of(v0, elem);
    p.block_mapping = block_mapping.data_ptr<int64_t>();
    p.num_pairs = block_mapping.size(0);
    p.num_kv_heads = static_cast<int32_t>(k0.size(1));
    p.block_size = static_cast<int32_t>(k0.size(2));
    p.row_bytes = static_cast<int32_t>(k0.size(3) * elem);
    chunks.push_back(p);
  }
  return chunks;
}

// True when the dims after the first hold each block densely: some order of them is contiguous.
inline bool blocks_are_dense(const at::Tensor& t) {
  std::vector<std::pair<int64_t, int64_t>> dims;  // (stride, size)
  for (int64_t d = 1; d < t.dim(); ++d) dims.emplace_back(t.stride(d), t.size(d));
  std::sort(dims.begin(), dims.end());
  int64_t expected = 1;
  for (const auto& [stride, size] : dims) {
    if (size != 1 && stride != expected) return false;
    expected *= size;
  }
  return true;
}

// Pairs run concurrently, so no destination block may share a byte with a source block or with
// another destination block. Ids alone cannot tell: dst may be another view of src's storage
// (src[1:], src[:], a reshape), and the K/V views kv[:, 0], kv[:, 1] of one combined cache share
// a storage without ever overlapping. Block i of a tensor t (dense, see blocks_are_dense) spans
// [t.data_ptr() + i * t.stride(0) * elem, + block_bytes), so compare those byte ranges: sort the
// destinations, check neighbours, then look each source up by binary search (O(n log n)).
// Expects a mapping already checked by check_block_mapping (ids in range, contiguous, on the CPU).
inline void check_block_overlap(const at::Tensor& src, const at::Tensor& dst,
                                const at::Tensor& mapping, int64_t block_bytes, const char* op) {
  const int64_t num_pairs = mapping.size(0);
  if (num_pairs == 0 || block_bytes == 0) return;
  const int64_t elem = src.element_size();
  const bool shared = src.device() == dst.device() && src.has_storage() && dst.has_storage() &&
                      src.storage().is_alias_of(dst.storage());
  const int64_t dst_stride = dst.stride(0) * elem;
  // Distinct storages never overlap, and distinct ids (checked already) of a tensor whose blocks
  // lie at least block_bytes apart never overlap either: nothing to do.
  if (!shared && (num_pairs == 1 || dst_stride >= block_bytes || dst_stride <= -block_bytes)) {
    return;
  }
  const int64_t* ids = mapping.data_ptr<int64_t>();
  const auto src_base = reinterpret_cast<uintptr_t>(src.data_ptr());
  const auto dst_base = reinterpret_cast<uintptr_t>(dst.data_ptr());
  const int64_t src_stride = src.stride(0) * elem;
  struct Span {
    uintptr_t begin, end;
    int64_t pair;
  };
  std::vector<Span> writes(num_pairs);
  for (int64_t i = 0; i < num_pairs; ++i) {
    const uintptr_t begin = dst_base + static_cast<uintptr_t>(ids[2 * i + 1] * dst_stride);
    writes[i] = {begin, begin + static_cast<uintptr_t>(block_bytes), i};
  }
  std::sort(writes.begin(), writes.end(),
            [](const Span& a, const Span& b) { return a.begin < b.begin; });
  // Sorted by start, two spans overlap only if some neighbouring pair does.
  for (int64_t k = 1; k < num_pairs; ++k) {
    const Span& a = writes[k - 1];
    const Span& b = writes[k];
    TORCH_CHECK(b.begin >= a.end, op, ": block_mapping[", a.pair, "] and block_mapping[", b.pair,
                "] write destination blocks ", ids[2 * a.pair + 1], " and ", ids[2 * b.pair + 1],
                ", which overlap in memory (pairs are applied concurrently)");
  }
  if (!shared) return;
  // The writes are now disjoint and sorted, so their ends are sorted too: the only write that can
  // overlap [begin, end) is the first one ending after begin.
  for (int64_t i = 0; i < num_pairs; ++i) {
    const uintptr_t begin = src_base + static_cast<uintptr_t>(ids[2 * i] * src_stride);
    const uintptr_t end = begin + static_cast<uintptr_t>(block_bytes);
    const auto it = std::upper_bound(writes.begin(), writes.end(), begin,
                                     [](uintptr_t v, const Span& w) { return v < w.end; });
    TORCH_CHECK(it == writes.end() || it->begin >= end, op, ": block_mapping[", it->pair,
                "] writes destination block ", ids[2 * it->pair + 1],
                ", which overlaps source block ", ids[2 * i], " of block_mapping[", i,
                "] in memory (src and dst share a storage; pairs are applied concurrently)");
  }
}

inline SwapBlocksParams swap_blocks_params(const at::Tensor& src, const at::Tensor& dst,
                                           const at::Tensor& block_mapping) {
  constexpr const char* op = "swap_blocks";
  dtype_of(src, op, "src");
  TORCH_CHECK(src.dim() >= 2, op, ": src must be [num_blocks, ...], got shape ", src.sizes());
  TORCH_CHECK(dst.scalar_type() == src.scalar_type(), op, ": dst must have src's dtype ",
              src.scalar_type(), ", got ", dst.scalar_type());
  TORCH_CHECK(dst.dim() == src.dim() && src.sizes().slice(1) == dst.sizes().slice(1), op,
              ": dst blocks must have src's block shape ", src.sizes().slice(1), ", got ",
              dst.sizes().slice(1));
  TORCH_CHECK(src.strides().slice(1) == dst.strides().slice(1), op,
              ": src and dst must lay out a block the same way, got strides ", src.strides(),
              " and ", dst.strides());
  TORCH_CHECK(blocks_are_dense(src), op,
              ": each block must be dense (HND, NHD or a K/V view of a combined cache), got "
              "strides ",
              src.strides());
  TORCH_CHECK(block_mapping.is_cpu(), op, ": block_mapping must be on the CPU, got ",
              block_mapping.device());
  check_block_mapping(block_mapping, src.size(0), dst.size(0), src.is_same(dst), op);
  const int64_t elem = src.element_size();
  const int64_t block_bytes = c10::multiply_integers(src.sizes().slice(1)) * elem;
  if (index_checks_enabled(block_mapping)) {
    check_block_overlap(src, dst, block_mapping, block_bytes, op);
  }
  SwapBlocksParams p{};
  p.src = static_cast<const char*>(src.data_ptr());
  p.dst = static_cast<char*>(dst.data_ptr());
  p.src_block_stride_bytes = src.stride(0) * elem;
  p.dst_block_stride_bytes = dst.stride(0) * elem;
  p.block_bytes = block_bytes;
  p.block_mapping = block_mapping.data_ptr<int64_t>();
  p.num_pairs = block_mapping.size(0);
  return p;
}

}  // namespace pagedkv
