// The CPU attention's unit of work and the per-ISA kernel table. Torch-free.
//
// A work item is one (sequence, kv heads, query heads, query tile, key range): its rows are, for
// each of its kv heads, the item's query heads of that head's group times the tile's query
// tokens, so every K/V element read serves all of them. A group too large for one item (MLA's
// up to 128 heads over one latent) is cut into head tiles. Decode items take all kv heads, so that each cache block (all heads of
// its tokens, contiguous) is read as one piece. A long key range is split into several items (split-K); each writes a
// normalized partial output and its lse to a slot, and merge_partials combines the slots.
#pragma once
#include <stdint.h>

#include <algorithm>

#include "kernels/attention_params.h"

namespace pagedkv::cpu {

struct WorkItem {
  int32_t seq;
  int32_t kv_head, kv_heads;   // kv heads [kv_head, kv_head + kv_heads)
  int32_t q_head, q_heads;     // query heads [q_head, q_head + q_heads) of each kv head's group
  int32_t q_begin, q_count;    // query tokens [q_begin, q_begin + q_count) of the sequence
  int32_t key_begin, key_end;  // key positions [key_begin, key_end)
  int64_t slot;                // partial slot, or -1: write out / lse_out directly
  // The item the same thread runs next (set by the scheduler, or null): decode asks for its
  // first chunk's rows during this item's last (KeyTiles), as it asks for each next chunk's.
  const WorkItem* then = nullptr;
};

// Partial results of split items: slot s holds rows_per_slot rows of head_size_v floats.
struct Partials {
  float* out;   // [num_slots, rows_per_slot, head_size_v]
  float* lse;   // [num_slots, rows_per_slot]
  int32_t rows_per_slot;
};

// A group of split items to merge: items [first, first + count) share seq, heads and queries.
struct SplitGroup {
  int64_t first;
  int32_t count;
};

constexpr int kKeysPerChunk = 32;  // keys gathered, converted and processed together

// Varlen items of many rows (and every MLA item) take the prefill path (small GEMMs over tiles
// of query rows x keys), whose rows are padded to a multiple of the vector width (8 floats on
// AVX2, 16 on AVX-512), in blocks of 24 or 48 rows, which divide kPrefillRowAlign. The planner
// makes varlen items of up to kPrefillRows rows.
constexpr int kPrefillRowAlign = 48;
constexpr int kPrefillRows = 96;
constexpr int kPrefillKeys = 32;  // keys per tile of the prefill path (half past 256-byte rows)

// Keys per tile of the AMX prefill (cpu/attention_amx.inc): 128, or 64 for rows over 512 bytes.
constexpr int kAmxMaxKeys = 128;
constexpr int amx_keys(int64_t head_size) { return head_size <= 256 ? kAmxMaxKeys : 64; }

// Floats of per-thread scratch for items of at most max_rows rows (either path); head_size is
// the wider of K's and V's.
inline int64_t scratch_floats(int64_t max_rows, int64_t head_size) {
  const int64_t rows = (max_rows + kPrefillRowAlign - 1) / kPrefillRowAlign * kPrefillRowAlign;
  const int64_t keys = std::max(kKeysPerChunk, kPrefillKeys);
  // the decode path's int16 queries and probabilities (kIntDots): rows x (head_size + 64 +
  // keys) int16 (64: the padding of int4 rows' permuted queries, 4W) and two scales a row
  const int64_t int_queries = rows * ((head_size + 64 + keys) / 2 + 2) + 128;
  const int64_t vector_path =
      rows * (2 * head_size + 2 * keys + 6) + 2 * keys * head_size + 64 + int_queries;
  // the AMX prefill: Q^T pairs, O^T, S^T, P^T pairs, N K rows, V^T pairs and six row vectors
  const int64_t n = amx_keys(head_size);
  const int64_t amx = rows * (head_size / 2 + head_size + n + n / 2 + 6) + n * head_size + 64;
  return std::max(vector_path, amx);
}

// The instruction sets the kernels are compiled for, narrowest first. Each is one translation
// unit of cpu/attention_isa.inc, which setup.py and CMakeLists.txt generate from this line.
#define PAGEDKV_CPU_ISAS(X) X(base) X(avx2) X(avx512) X(avx512bf16)

// One instruction set's kernels (defined by its unit as kernels_<isa>).
struct AttentionKernels {
  const char* name;    // the instruction set, as in PAGEDKV_CPU_ISAS
  int lanes;           // floats per vector: head_size must be a multiple
  bool (*cpu_has)();   // whether this processor runs them: ask before calling the others
  void (*attend)(const PagedAttentionParams& p, const WorkItem& item, float* scratch,
                 const Partials& partials);
  // The same with bfloat16 prefill on float FMAs, also where bf16_dot (attend_floats).
  void (*attend_floats)(const PagedAttentionParams& p, const WorkItem& item, float* scratch,
                        const Partials& partials);
  void (*merge_partials)(const PagedAttentionParams& p, const WorkItem* items,
                         const SplitGroup& group, const Partials& partials);
  void (*merge_attn_states)(const MergeAttnParams& p, int64_t row_begin, int64_t row_end);
  // The peak probe: iters rounds of 12 independent chains of kind's instruction on one thread
  // (kPeakFma: float FMA; kPeakBf16Dot: bfloat16 pair dot products, where bf16_dot); returns
  // the floating-point operations done.
  int64_t (*peak_loop)(int kind, int64_t iters);
  bool bf16_dot;  // bfloat16 caches take vdpbf16ps (AVX512_BF16) in the prefill path
  // attend and attend_floats with bfloat16 prefill on AMX tiles (tdpbf16ps) where an item fits
  // (cpu/attention_amx.inc); null for the sets without them. Call only where amx_usable().
  void (*attend_amx)(const PagedAttentionParams& p, const WorkItem& item, float* scratch,
                     const Partials& partials);
  void (*attend_amx_floats)(const PagedAttentionParams& p, const WorkItem& item, float* scratch,
                            const Partials& partials);
};

constexpr int kPeakFma = 0, kPeakBf16Dot = 1;

#define PAGEDKV_DECLARE_KERNELS(isa) extern const AttentionKernels kernels_##isa;
PAGEDKV_CPU_ISAS(PAGEDKV_DECLARE_KERNELS)
#undef PAGEDKV_DECLARE_KERNELS

// The name ("base", "avx2", "avx512" or "avx512bf16") of the kernels the attention ops run for this head size
// on this processor, PAGEDKV_CPU_ISA included (cpu/attention.cpp; `pagedkv info` shows it).
const char* attention_kernel_name(int32_t head_size);

// Whether bfloat16 prefill takes vdpbf16ps (the avx512bf16 kernels) for this head size: where
// PAGEDKV_CPU_ISA names avx512bf16, or, unset, where this processor's bf16 dot products were
// measured (once per process) at no less than 0.8 of its float FMAs' FLOP rate.
bool bf16_dot_products(int32_t head_size);

// The measured rate in GFLOP/s of kind ("fp32": float FMAs, "bf16": bfloat16 dot products) on
// every thread of ATen's pool, with the widest kernels allowed (cpu/attention.cpp): the sum over
// the threads of each one's operations per second of its own CPU time (time slices taken by
// other processes do not count); seconds: about how long each thread runs.
double peak_gflops(const char* kind, double seconds);

// Whether bfloat16 prefill takes AMX tiles for this head size (a multiple of 32): the
// avx512bf16 kernels where PAGEDKV_CPU_AMX=1 asks (an error on a processor without AMX-BF16 or
// whose tile state Linux does not grant); unset or 0, never.
bool amx_tiles(int32_t head_size);

}  // namespace pagedkv::cpu
