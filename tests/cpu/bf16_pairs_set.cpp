// One instruction set's CPU attention kernels for tests/cpu/bf16_pairs.cpp, twice: the float path
// (namespace <set>_float, PKV_DOT_PAIRS=0 and PKV_INT_DOTS=0) and the pair and integer paths
// (<set>_pairs, PKV_DOT_PAIRS=1 and PKV_INT_DOTS=1). Compiled once per set
// with PKV_PAIRS_SET defined to its name (CMakeLists.txt), so that the sets build in parallel; the
// unit exports pagedkv::cpu::pairs_set_<set>(), the set's two entry points.
#ifndef PKV_PAIRS_SET
#error "compiled once per instruction set, with PKV_PAIRS_SET defined (see CMakeLists.txt)"
#endif

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>

#include "bf16_pairs_set.h"

#pragma GCC diagnostic ignored "-Wpsabi"  // the base set's vectors are wider than its ABI's
#ifndef __clang__  // GCC 12 reports its own _mm512_undefined_* placeholders as uninitialized
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

#define PKV_CAT2(a, b) a##b
#define PKV_CAT(a, b) PKV_CAT2(a, b)
#define PKV_PAIRS_ISA_base 0
#define PKV_PAIRS_ISA_avx2 1
#define PKV_PAIRS_ISA_avx512 2
#define PKV_PAIRS_ISA_avx512bf16 3
#define PKV_ISA PKV_CAT(PKV_PAIRS_ISA_, PKV_PAIRS_SET)

#if PKV_ISA == 3
#include "amx_emulation.h"  // the AMX prefill on software tiles, in the pair-path namespace
#endif

#pragma GCC push_options
#if PKV_ISA == 1
#pragma GCC target("avx2,fma,f16c")
#elif PKV_ISA == 2
#pragma GCC target("avx512f,avx2,fma,f16c")
#elif PKV_ISA == 3
#pragma GCC target("avx512f,avx512bw,avx512bf16,avx512vnni,avx2,fma,f16c")
#endif

#define PKV_DOT_PAIRS 0
#define PKV_INT_DOTS 0
namespace pagedkv::cpu::PKV_CAT(PKV_PAIRS_SET, _float) {
#include "cpu/attention_kernels.inc"
}
#undef PKV_DOT_PAIRS
#undef PKV_INT_DOTS
#define PKV_DOT_PAIRS 1  // vdpbf16ps itself in avx512bf16, two FMAs a pair elsewhere
#define PKV_INT_DOTS 1   // vpdpwssd itself in avx512bf16, vpmaddwd in avx2, portable elsewhere
namespace pagedkv::cpu::PKV_CAT(PKV_PAIRS_SET, _pairs) {
#include "cpu/attention_kernels.inc"
}
#undef PKV_DOT_PAIRS
#undef PKV_INT_DOTS
#pragma GCC pop_options  // the export below runs before the processor is checked

namespace pagedkv::cpu {

#if PKV_ISA == 3
namespace {
// The AMX prefill (emulated tiles) for the items it takes, the pair path for the others.
void amx_path(const PagedAttentionParams& p, const WorkItem& w, float* scratch,
              const Partials& partials) {
  namespace q = PKV_CAT(PKV_PAIRS_SET, _pairs);
  if (q::amx_fits(p, w)) return q::attend_prefill_amx(p, w, scratch, partials);
  q::attend_item<q::bf16_t>(p, w, scratch, partials);
}
}  // namespace
#endif

// attend_item of the cache types the test runs, not attend: the others' instantiations would
// take most of the compile (setup.py compiles them all, -Wextra).
PairSet PKV_CAT(pairs_set_, PKV_PAIRS_SET)() {
  namespace f = PKV_CAT(PKV_PAIRS_SET, _float);
  namespace p = PKV_CAT(PKV_PAIRS_SET, _pairs);
  return {&f::attend_item<f::bf16_t>, &p::attend_item<p::bf16_t>, f::W,
          &f::attend_item<int8_t>, &f::attend_item<f::i4x2_t>,
          &p::attend_item<int8_t>, &p::attend_item<p::i4x2_t>,
#if PKV_ISA == 3
          &amx_path};
#else
          nullptr};
#endif
}

}  // namespace pagedkv::cpu
