// The CPU attention kernels compiled for AVX512 (cpu/attention_kernel.h), selected at run time
// by attention.cpp when the processor has it. Every header is included before the target pragma,
// so that no function outside namespace cpu::avx512 is compiled for avx512.
#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>

#include "cpu/attention_work.h"

// GCC 12 reports its own _mm512_undefined_* placeholders as uninitialized.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx2,fma,f16c")
#endif

#define PKV_ISA 2
namespace pagedkv::cpu::avx512 {
namespace {
#include "cpu/attention_kernel.h"
}  // namespace
}  // namespace pagedkv::cpu::avx512

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

namespace pagedkv::cpu {
const AttentionKernels& kernels_avx512() { return avx512::kernels("avx512"); }
}  // namespace pagedkv::cpu
#endif
