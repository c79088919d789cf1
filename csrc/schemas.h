// Every op schema of pagedkv, in one list. Each op's schema is written once, next to its checks
// and its op<Run> entry, in csrc/ops/<op>.h; torch.ops.pagedkv (csrc/bindings.cpp) and
// torch.ops.pagedkv_simt (csrc/simt_backend/module.cpp) both define their ops from this list.
// Mutated tensors are marked (a!); ops that mutate return nothing.
#pragma once
#include <torch/library.h>

#include "ops/copy_blocks.h"
#include "ops/merge_attn_states.h"
#include "ops/mla_attention.h"
#include "ops/mla_cache.h"
#include "ops/paged_attention.h"
#include "ops/reshape_and_cache.h"
#include "ops/swap_blocks.h"

namespace pagedkv {

inline void define_schemas(torch::Library& m) {
  m.def(kReshapeAndCacheSchema);
  m.def(kCopyBlocksSchema);
  m.def(kSwapBlocksSchema);
  m.def(kPagedAttentionSchema);
  m.def(kMergeAttnStatesSchema);
  m.def(kConcatAndCacheMlaSchema);
  m.def(kGatherCacheSchema);
  m.def(kMlaAttentionSchema);
}

}  // namespace pagedkv
