// Global-memory accesses the simt traffic counters see (csrc/simt/traffic.h, docs/simt.md):
//   load_ro(p, tag)   read-only data (__ldg under nvcc)
//   load(p, tag)      plain load
//   store(p, v, tag)  plain store
//   note_read(p, n, tag)  a read made by other means (cp.async): counted, not performed
// Under nvcc each is the access itself. Under simt it also records the access (address, size,
// call site) when the counters are on; off, that is one relaxed pointer load. `tag` names the
// data in the counters' report: "kv", "query", "table", "out", "workspace", "src", ...
#pragma once
#include "kernels/compat.cuh"

#if !defined(__CUDACC__)
#include <source_location>

#include "simt/traffic.h"
#endif

namespace pagedkv {
namespace PAGEDKV_KERNEL_NS {

#if defined(__CUDACC__)

template <typename T>
__device__ __forceinline__ T load_ro(const T* p, const char*) {
  return __ldg(p);
}
template <typename T>
__device__ __forceinline__ T load(const T* p, const char*) {
  return *p;
}
template <typename T>
__device__ __forceinline__ void store(T* p, const T& v, const char*) {
  *p = v;
}
// A read the kernel makes by other means (cp.async): nothing under nvcc.
__device__ __forceinline__ void note_read(const void*, int, const char*) {}

#else

namespace mem {
inline uint32_t site_id(const std::source_location& s) {
  return uint32_t(reinterpret_cast<uintptr_t>(s.file_name()) * 0x9e3779b1u) ^
         (s.line() << 10) ^ s.column();
}
template <typename T>
inline void note(const T* p, bool store, const char* tag, const std::source_location& s) {
  if (::simt::traffic::recording()) ::simt::traffic::record(p, sizeof(T), store, tag, site_id(s));
}
}  // namespace mem

template <typename T>
inline T load_ro(const T* p, const char* tag,
                 const std::source_location s = std::source_location::current()) {
  mem::note(p, false, tag, s);
  return __ldg(p);
}
template <typename T>
inline T load(const T* p, const char* tag,
              const std::source_location s = std::source_location::current()) {
  mem::note(p, false, tag, s);
  return *p;
}
template <typename T>
inline void store(T* p, const T& v, const char* tag,
                  const std::source_location s = std::source_location::current()) {
  mem::note(p, true, tag, s);
  *p = v;
}
// A read of `bytes` bytes the kernel makes by other means (cp.async, which copies at its
// wait_group): counted where it is issued, as a load of that size; 0 bytes (zfill) reads nothing.
inline void note_read(const void* p, int bytes, const char* tag,
                      const std::source_location s = std::source_location::current()) {
  if (bytes > 0 && ::simt::traffic::recording()) {
    ::simt::traffic::record(p, size_t(bytes), false, tag, mem::site_id(s));
  }
}

#endif

}  // namespace PAGEDKV_KERNEL_NS
}  // namespace pagedkv
