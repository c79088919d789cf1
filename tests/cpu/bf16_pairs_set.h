// The entry points of one instruction set's kernels, float path and pair path, as
// tests/cpu/bf16_pairs_set.cpp exports them (one unit per set) to tests/cpu/bf16_pairs.cpp.
#pragma once

#include "cpu/attention_work.h"

namespace pagedkv::cpu {

using Attend = void (*)(const PagedAttentionParams&, const WorkItem&, float*, const Partials&);

struct PairSet {
  Attend float_path, pair_path;
  int lanes;  // float lanes of the set's vectors
  Attend int8_path, int4_path;  // the float path over int8 / int4 caches with row scales
  Attend int8_int_path, int4_int_path;  // the same with the integer dot products (kIntDots)
  Attend amx_path;  // avx512bf16: the AMX prefill on emulated tiles where it fits; else null
};

PairSet pairs_set_base();
PairSet pairs_set_avx2();
PairSet pairs_set_avx512();
PairSet pairs_set_avx512bf16();

}  // namespace pagedkv::cpu
