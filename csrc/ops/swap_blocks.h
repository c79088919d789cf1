// swap_blocks: its schema, its kernel parameters from tensors (the checks every backend shares)
// and the op every backend registers, swap_blocks_op<Run>.
#pragma once
#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "glue/tensor_checks.h"
#include "kernels/cache_params.h"

namespace pagedkv {

// Copy blocks (src, dst) between two caches, across devices or within one.
inline constexpr char kSwapBlocksSchema[] =
    "swap_blocks(Tensor src, Tensor(a!) dst, Tensor block_mapping) -> ()";

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
  const bool gpu_and_cpu = (src.is_cuda() && dst.is_cpu()) || (src.is_cpu() && dst.is_cuda());
  TORCH_CHECK(src.device() == dst.device() || gpu_and_cpu, op,
              ": src and dst must be on one device or on a GPU and the CPU, got ", src.device(),
              " and ", dst.device());
  cache_dtype_of(src, op, "src");
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

// The backend's part: Run(params, src, dst) after the checks; the devices of src and dst place
// the work and, on a GPU, choose the copy's direction.
using SwapBlocksRun = void (*)(const SwapBlocksParams&, const at::Tensor& src,
                               const at::Tensor& dst);

// The op with the schema's signature; each backend registers swap_blocks_op<its_run>.
template <SwapBlocksRun Run>
void swap_blocks_op(const at::Tensor& src, at::Tensor& dst, const at::Tensor& block_mapping) {
  Run(swap_blocks_params(src, dst, block_mapping), src, dst);
}

}  // namespace pagedkv
