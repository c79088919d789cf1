// The CPU attention kernels compiled for AVX2 (cpu/attention_kernel.h), selected at run time
// by attention.cpp when the processor has it. Every header is included before the target pragma,
// so that no function outside namespace cpu::avx2 is compiled for avx2.
#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>

#include "cpu/attention_work.h"

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#endif

#define PKV_ISA 1
namespace pagedkv::cpu::avx2 {
namespace {
#include "cpu/attention_kernel.h"
}  // namespace
}  // namespace pagedkv::cpu::avx2

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

namespace pagedkv::cpu {
const AttentionKernels& kernels_avx2() { return avx2::kernels("avx2"); }
}  // namespace pagedkv::cpu
#endif
