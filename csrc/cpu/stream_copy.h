// memcpy for data that will not be read again soon: non-temporal stores skip the read-for-
// ownership of each destination line, so a copy costs its bytes read plus written and no more.
// Used by the cache ops when a call moves more data than the caches hold.
#pragma once
#include <immintrin.h>

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace pagedkv::cpu {

// Calls moving at least this many bytes use streaming stores.
constexpr int64_t kStreamingBytes = 8 << 20;

namespace detail {

template <size_t kAlign>
inline size_t unaligned_head(const char* dst, size_t n) {
  const size_t misalign = reinterpret_cast<uintptr_t>(dst) % kAlign;
  return misalign == 0 ? 0 : std::min(n, kAlign - misalign);
}

__attribute__((target("avx512f"))) inline void stream_copy_avx512(char* dst, const char* src,
                                                                    size_t n) {
  size_t i = unaligned_head<64>(dst, n);
  std::memcpy(dst, src, i);
  for (; i + 64 <= n; i += 64) {
    _mm512_stream_si512(reinterpret_cast<__m512i*>(dst + i),
                        _mm512_loadu_si512(reinterpret_cast<const void*>(src + i)));
  }
  std::memcpy(dst + i, src + i, n - i);
}

__attribute__((target("avx2"))) inline void stream_copy_avx2(char* dst, const char* src,
                                                              size_t n) {
  size_t i = unaligned_head<32>(dst, n);
  std::memcpy(dst, src, i);
  for (; i + 32 <= n; i += 32) {
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i),
                        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i)));
  }
  std::memcpy(dst + i, src + i, n - i);
}

enum class Isa { kAvx512, kAvx2, kNone };

inline Isa isa() {
  static const Isa value = __builtin_cpu_supports("avx512f") ? Isa::kAvx512
                           : __builtin_cpu_supports("avx2")  ? Isa::kAvx2
                                                             : Isa::kNone;
  return value;
}

}  // namespace detail

// Copies n bytes; with `streaming`, through non-temporal stores where the CPU has them. Call
// stream_fence() before the data is handed to another thread.
inline void copy_bytes(void* dst, const void* src, size_t n, bool streaming) {
  char* d = static_cast<char*>(dst);
  const char* s = static_cast<const char*>(src);
  if (streaming && detail::isa() == detail::Isa::kAvx512) return detail::stream_copy_avx512(d, s, n);
  if (streaming && detail::isa() == detail::Isa::kAvx2) return detail::stream_copy_avx2(d, s, n);
  std::memcpy(d, s, n);
}

inline void stream_fence() { _mm_sfence(); }

}  // namespace pagedkv::cpu
