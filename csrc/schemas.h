// Every op schema of pagedkv, written once. torch.ops.pagedkv (csrc/bindings.cpp) and
// torch.ops.pagedkv_simt (csrc/simt_backend/module.cpp) both define their ops from this list.
// Mutated tensors are marked (a!); ops that mutate return nothing.
#pragma once
#include <torch/library.h>

namespace pagedkv {

inline void define_schemas(torch::Library& m) {
  // Write new tokens' K/V into their cache slots (slot = block_id * block_size + offset;
  // a negative slot is padding). fp8 caches quantize with the per-tensor scales.
  m.def(
      "reshape_and_cache(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
      "Tensor slot_mapping, Tensor? k_scale=None, Tensor? v_scale=None) -> ()");
  // Copy blocks (src, dst) in every layer with one launch: copy-on-write.
  m.def(
      "copy_blocks(Tensor(a!)[] key_caches, Tensor(b!)[] value_caches, Tensor block_mapping) "
      "-> ()");
  // Copy blocks (src, dst) between two caches, across devices or within one.
  m.def("swap_blocks(Tensor src, Tensor(a!) dst, Tensor block_mapping) -> ()");
  // Attention of each query token over its sequence's paged K/V: decode, or varlen causal
  // queries with query_start_loc.
  m.def(
      "paged_attention(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, "
      "Tensor block_tables, Tensor seq_lens, Tensor? query_start_loc, int max_seq_len, "
      "int max_query_len, float scale, Tensor? alibi_slopes, int sliding_window, float soft_cap, "
      "Tensor? k_scale, Tensor? v_scale, Tensor(b!)? lse_out) -> ()");
  // Combine two partial attentions over disjoint key sets by their log-sum-exp.
  m.def(
      "merge_attn_states(Tensor(a!) out, Tensor(b!)? out_lse, Tensor prefix_out, "
      "Tensor prefix_lse, Tensor suffix_out, Tensor suffix_lse) -> ()");
}

}  // namespace pagedkv
