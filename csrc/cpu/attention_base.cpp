// The CPU attention kernels compiled for the build's baseline instruction set
// (cpu/attention_kernel.h): the fallback on every processor.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>

#include "cpu/attention_work.h"

#pragma GCC diagnostic ignored "-Wpsabi"  // vectors wider than the baseline ABI stay internal

#define PKV_ISA 0
namespace pagedkv::cpu::base {
namespace {
#include "cpu/attention_kernel.h"
}  // namespace
}  // namespace pagedkv::cpu::base

namespace pagedkv::cpu {
const AttentionKernels& kernels_base() { return base::kernels("base"); }
}  // namespace pagedkv::cpu
