// copy_blocks: its schema, its kernel parameters from tensors (the checks every backend shares)
// and the op every backend registers, copy_blocks_op<Run>.
#pragma once
#include <ATen/ATen.h>

#include <algorithm>
#include <vector>

#include "glue/tensor_checks.h"
#include "kernels/cache_params.h"

namespace pagedkv {

// Copy blocks (src, dst) in every layer with one launch: copy-on-write.
inline constexpr char kCopyBlocksSchema[] =
    "copy_blocks(Tensor(a!)[] key_caches, Tensor(b!)[] value_caches, Tensor block_mapping) -> ()";

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

// The backend's part: Run(params, key_caches[0]) per chunk of layers, after the checks of all
// of them; key_caches[0] places the work.
using CopyBlocksRun = void (*)(const CopyBlocksParams&, const at::Tensor& key_cache);

// The op with the schema's signature; each backend registers copy_blocks_op<its_run>.
template <CopyBlocksRun Run>
void copy_blocks_op(at::TensorList key_caches, at::TensorList value_caches,
                    const at::Tensor& block_mapping) {
  for (const CopyBlocksParams& p : copy_blocks_params(key_caches, value_caches, block_mapping)) {
    Run(p, key_caches[0]);
  }
}

}  // namespace pagedkv
