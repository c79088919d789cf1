// The CPU attention's unit of work and the per-ISA kernel table. Torch-free.
//
// A work item is one (sequence, kv heads, query tile, key range): its rows are, for each of its
// kv heads, that head's query heads times the tile's query tokens, so every K/V element read
// serves all of them. Decode items take all kv heads, so that each cache block (all heads of
// its tokens, contiguous) is read as one piece. A long key range is split into several items (split-K); each writes a
// normalized partial output and its lse to a slot, and merge_partials combines the slots.
#pragma once
#include <stdint.h>

#include "kernels/attention_params.h"

namespace pagedkv::cpu {

struct WorkItem {
  int32_t seq;
  int32_t kv_head, kv_heads;   // kv heads [kv_head, kv_head + kv_heads)
  int32_t q_begin, q_count;    // query tokens [q_begin, q_begin + q_count) of the sequence
  int32_t key_begin, key_end;  // key positions [key_begin, key_end)
  int64_t slot;                // partial slot, or -1: write out / lse_out directly
};

// Partial results of split items: slot s holds rows_per_slot rows of head_size floats.
struct Partials {
  float* out;   // [num_slots, rows_per_slot, head_size]
  float* lse;   // [num_slots, rows_per_slot]
  int32_t rows_per_slot;
};

// A group of split items to merge: items [first, first + count) share seq, kv_head and queries.
struct SplitGroup {
  int64_t first;
  int32_t count;
};

constexpr int kKeysPerChunk = 32;  // keys gathered, converted and processed together

// Floats of per-thread scratch for items of at most max_rows rows.
inline int64_t scratch_floats(int64_t max_rows, int64_t head_size) {
  return max_rows * (2 * head_size + kKeysPerChunk + 2) + 64;
}

// The instruction sets the kernels are compiled for, narrowest first. Each is one translation
// unit of cpu/attention_isa.inc, which setup.py and CMakeLists.txt generate from this line.
#define PAGEDKV_CPU_ISAS(X) X(base) X(avx2) X(avx512)

// One instruction set's kernels (defined by its unit as kernels_<isa>).
struct AttentionKernels {
  const char* name;    // the instruction set, as in PAGEDKV_CPU_ISAS
  int lanes;           // floats per vector: head_size must be a multiple
  bool (*cpu_has)();   // whether this processor runs them: ask before calling the others
  void (*attend)(const PagedAttentionParams& p, const WorkItem& item, float* scratch,
                 const Partials& partials);
  void (*merge_partials)(const PagedAttentionParams& p, const WorkItem* items,
                         const SplitGroup& group, const Partials& partials);
  void (*merge_attn_states)(const MergeAttnParams& p, int64_t row_begin, int64_t row_end);
};

#define PAGEDKV_DECLARE_KERNELS(isa) extern const AttentionKernels kernels_##isa;
PAGEDKV_CPU_ISAS(PAGEDKV_DECLARE_KERNELS)
#undef PAGEDKV_DECLARE_KERNELS

// The name ("base", "avx2" or "avx512") of the kernels the attention ops run for this head size
// on this processor, PAGEDKV_CPU_ISA included (cpu/attention.cpp; `pagedkv info` shows it).
const char* attention_kernel_name(int32_t head_size);

}  // namespace pagedkv::cpu
