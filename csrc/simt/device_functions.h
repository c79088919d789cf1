// Device functions nvcc provides and a host compiler lacks: barriers, warp collectives,
// atomics, __ldg, fence, fast-math, bit and conversion intrinsics, integer min/max.
// Included by simt.h after the CUDA headers; global namespace, like their CUDA originals.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "simt/runtime.h"

namespace simt::detail {

template <typename T>
T warp_op(Op op, unsigned mask, T var, int arg, int width) {
  static_assert(sizeof(T) <= 8, "warp collective on a type wider than 8 bytes");
  uint64_t bits = 0;
  std::memcpy(&bits, static_cast<const void*>(&var), sizeof(T));
  bits = warp_collective(op, mask, bits, arg, width);
  T out;
  std::memcpy(static_cast<void*>(&out), &bits, sizeof(T));
  return out;
}

template <typename To, typename From>
To bit_cast(From from) {
  static_assert(sizeof(To) == sizeof(From));
  To to;
  std::memcpy(&to, &from, sizeof(To));
  return to;
}

// Read-modify-write of *p with f(old) as one atomic step; returns the old value.
template <typename T, typename F>
T atomic_update(T* p, F f) {
  T old;
  __atomic_load(p, &old, __ATOMIC_RELAXED);
  T desired = f(old);
  while (!__atomic_compare_exchange(p, &old, &desired, true, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
    desired = f(old);
  }
  return old;
}

}  // namespace simt::detail

// ---- barriers and warp collectives ---------------------------------------------------------

inline void __syncthreads() { simt::detail::sync_threads(1); }
inline int __syncthreads_count(int p) {
  return int(simt::detail::sync_threads(p != 0));
}
inline int __syncthreads_and(int p) {
  const dim3 d = simt::detail::current_block->dim;
  return __syncthreads_count(p) == int(d.x * d.y * d.z);
}
inline int __syncthreads_or(int p) { return __syncthreads_count(p) != 0; }
inline void __syncwarp(unsigned mask = 0xffffffffu) {
  simt::detail::warp_collective(simt::detail::Op::syncwarp, mask, 0, 0, 32);
}

template <typename T>
T __shfl_sync(unsigned mask, T var, int src_lane, int width = 32) {
  return simt::detail::warp_op(simt::detail::Op::shfl, mask, var, src_lane, width);
}
template <typename T>
T __shfl_up_sync(unsigned mask, T var, unsigned delta, int width = 32) {
  return simt::detail::warp_op(simt::detail::Op::shfl_up, mask, var, int(delta), width);
}
template <typename T>
T __shfl_down_sync(unsigned mask, T var, unsigned delta, int width = 32) {
  return simt::detail::warp_op(simt::detail::Op::shfl_down, mask, var, int(delta), width);
}
template <typename T>
T __shfl_xor_sync(unsigned mask, T var, int lane_mask, int width = 32) {
  return simt::detail::warp_op(simt::detail::Op::shfl_xor, mask, var, lane_mask, width);
}
inline unsigned __ballot_sync(unsigned mask, int p) {
  return unsigned(simt::detail::warp_collective(simt::detail::Op::ballot, mask, p != 0, 0, 32));
}
inline int __any_sync(unsigned mask, int p) {
  return int(simt::detail::warp_collective(simt::detail::Op::any, mask, p != 0, 0, 32));
}
inline int __all_sync(unsigned mask, int p) {
  return int(simt::detail::warp_collective(simt::detail::Op::all, mask, p != 0, 0, 32));
}

// ---- memory --------------------------------------------------------------------------------

// Read-only and cache-hinted loads and stores: plain accesses on the host.
template <typename T>
T __ldg(const T* p) { return *p; }
template <typename T>
T __ldcg(const T* p) { return *p; }
template <typename T>
T __ldcs(const T* p) { return *p; }
template <typename T>
T __ldlu(const T* p) { return *p; }
template <typename T>
void __stcg(T* p, T v) { *p = v; }
template <typename T>
void __stcs(T* p, T v) { *p = v; }
template <typename T>
void __stwt(T* p, T v) { *p = v; }
inline void __threadfence() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
inline void __threadfence_block() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
[[noreturn]] inline void __trap() { simt::detail::fail("__trap() called"); }

#define SIMT_ATOMIC_INT(T)                                                                        \
  inline T atomicAdd(T* p, T v) { return __atomic_fetch_add(p, v, __ATOMIC_RELAXED); }            \
  inline T atomicSub(T* p, T v) { return __atomic_fetch_sub(p, v, __ATOMIC_RELAXED); }            \
  inline T atomicAnd(T* p, T v) { return __atomic_fetch_and(p, v, __ATOMIC_RELAXED); }            \
  inline T atomicOr(T* p, T v) { return __atomic_fetch_or(p, v, __ATOMIC_RELAXED); }              \
  inline T atomicXor(T* p, T v) { return __atomic_fetch_xor(p, v, __ATOMIC_RELAXED); }            \
  inline T atomicExch(T* p, T v) { return __atomic_exchange_n(p, v, __ATOMIC_RELAXED); }          \
  inline T atomicMax(T* p, T v) {                                                                \
    return simt::detail::atomic_update(p, [v](T o) { return o < v ? v : o; });                    \
  }                                                                                               \
  inline T atomicMin(T* p, T v) {                                                                \
    return simt::detail::atomic_update(p, [v](T o) { return v < o ? v : o; });                    \
  }                                                                                               \
  inline T atomicCAS(T* p, T compare, T v) {                                                      \
    __atomic_compare_exchange_n(p, &compare, v, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED);       \
    return compare;                                                                               \
  }
SIMT_ATOMIC_INT(int)
SIMT_ATOMIC_INT(unsigned)
SIMT_ATOMIC_INT(unsigned long long)
SIMT_ATOMIC_INT(long long)
#undef SIMT_ATOMIC_INT

#define SIMT_ATOMIC_FLOAT(T)                                                                      \
  inline T atomicAdd(T* p, T v) {                                                                \
    return simt::detail::atomic_update(p, [v](T o) { return o + v; });                            \
  }                                                                                               \
  inline T atomicMax(T* p, T v) {                                                                \
    return simt::detail::atomic_update(p, [v](T o) { return std::fmax(o, v); });                  \
  }                                                                                               \
  inline T atomicMin(T* p, T v) {                                                                \
    return simt::detail::atomic_update(p, [v](T o) { return std::fmin(o, v); });                  \
  }                                                                                               \
  inline T atomicExch(T* p, T v) {                                                               \
    T old;                                                                                        \
    __atomic_exchange(p, &v, &old, __ATOMIC_RELAXED);                                             \
    return old;                                                                                   \
  }
SIMT_ATOMIC_FLOAT(float)
SIMT_ATOMIC_FLOAT(double)
#undef SIMT_ATOMIC_FLOAT

inline unsigned atomicInc(unsigned* p, unsigned v) {
  return simt::detail::atomic_update(p, [v](unsigned o) { return o >= v ? 0u : o + 1; });
}
inline unsigned atomicDec(unsigned* p, unsigned v) {
  return simt::detail::atomic_update(p, [v](unsigned o) { return (o == 0 || o > v) ? v : o - 1; });
}

// ---- fast math (glibc declares the __expf family without defining it: map the names) -------

namespace simt::math {
inline float expf_(float x) { return std::exp(x); }
inline float logf_(float x) { return std::log(x); }
inline float log2f_(float x) { return std::log2(x); }
inline float log10f_(float x) { return std::log10(x); }
inline float exp10f_(float x) { return std::pow(10.0f, x); }
inline float powf_(float x, float y) { return std::pow(x, y); }
inline float sinf_(float x) { return std::sin(x); }
inline float cosf_(float x) { return std::cos(x); }
inline float tanf_(float x) { return std::tan(x); }
}  // namespace simt::math
#define __expf ::simt::math::expf_
#define __logf ::simt::math::logf_
#define __log2f ::simt::math::log2f_
#define __log10f ::simt::math::log10f_
#define __exp10f ::simt::math::exp10f_
#define __powf ::simt::math::powf_
#define __sinf ::simt::math::sinf_
#define __cosf ::simt::math::cosf_
#define __tanf ::simt::math::tanf_

inline float __fdividef(float a, float b) { return a / b; }
inline float __frcp_rn(float x) { return 1.0f / x; }
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline double rsqrt(double x) { return 1.0 / std::sqrt(x); }
inline float __frsqrt_rn(float x) { return 1.0f / std::sqrt(x); }
inline float __fsqrt_rn(float x) { return std::sqrt(x); }
inline float __saturatef(float x) { return x >= 1.0f ? 1.0f : (x > 0.0f ? x : 0.0f); }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fmaf_rn(float a, float b, float c) { return std::fma(a, b, c); }

inline float __int_as_float(int x) { return simt::detail::bit_cast<float>(x); }
inline int __float_as_int(float x) { return simt::detail::bit_cast<int>(x); }
inline float __uint_as_float(unsigned x) { return simt::detail::bit_cast<float>(x); }
inline unsigned __float_as_uint(float x) { return simt::detail::bit_cast<unsigned>(x); }
inline int __float2int_rn(float x) { return int(std::nearbyint(x)); }
inline int __float2int_rz(float x) { return int(x); }
inline unsigned __float2uint_rn(float x) { return unsigned(std::nearbyint(x)); }

// ---- bits and integer ----------------------------------------------------------------------

inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz(unsigned(x)); }
inline int __clzll(long long x) { return x == 0 ? 64 : __builtin_clzll((unsigned long long)x); }
inline int __ffs(int x) { return __builtin_ffs(x); }
inline int __ffsll(long long x) { return __builtin_ffsll(x); }
inline unsigned __brev(unsigned x) {
  unsigned r = 0;
  for (int i = 0; i < 32; ++i) r |= ((x >> i) & 1u) << (31 - i);
  return r;
}
// Byte i of the result is byte (s >> 4i) & 7 of the 8 bytes {y, x} (x the low four).
inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
  const uint64_t v = (uint64_t(y) << 32) | x;
  unsigned r = 0;
  for (int i = 0; i < 4; ++i) r |= unsigned((v >> (8 * ((s >> (4 * i)) & 7u))) & 0xffu) << (8 * i);
  return r;
}
inline unsigned __umulhi(unsigned a, unsigned b) { return unsigned((uint64_t(a) * b) >> 32); }
inline int __mulhi(int a, int b) { return int((int64_t(a) * b) >> 32); }
inline int __mul24(int a, int b) { return a * b; }
inline unsigned __umul24(unsigned a, unsigned b) { return a * b; }

// CUDA's host-and-device min/max overloads (nvcc provides them; the host library does not).
#define SIMT_MINMAX(A, B, R)                                   \
  inline R min(A a, B b) { return static_cast<R>(a) < static_cast<R>(b) ? a : b; } \
  inline R max(A a, B b) { return static_cast<R>(a) < static_cast<R>(b) ? b : a; }
SIMT_MINMAX(int, int, int)
SIMT_MINMAX(unsigned, unsigned, unsigned)
SIMT_MINMAX(int, unsigned, unsigned)
SIMT_MINMAX(unsigned, int, unsigned)
SIMT_MINMAX(long, long, long)
SIMT_MINMAX(unsigned long, unsigned long, unsigned long)
SIMT_MINMAX(long long, long long, long long)
SIMT_MINMAX(unsigned long long, unsigned long long, unsigned long long)
#undef SIMT_MINMAX
inline float min(float a, float b) { return std::fmin(a, b); }
inline float max(float a, float b) { return std::fmax(a, b); }
inline double min(double a, double b) { return std::fmin(a, b); }
inline double max(double a, double b) { return std::fmax(a, b); }
