// Fibers: execution contexts on their own stacks, switched explicitly on one OS thread.
// x86-64: a small assembly switch (callee-saved registers, MXCSR, x87 control word);
// elsewhere, or with SIMT_UCONTEXT defined, glibc ucontext (a syscall per switch).
// Under ASan the switches are announced (__sanitizer_*_switch_fiber) and reused stacks
// unpoisoned; under TSan every fiber is a TSan fiber switched without synchronization, so
// only the happens-before edges the scheduler declares (race_release / race_acquire) order
// the memory accesses of different CUDA threads: a missing __syncthreads shows up as a race.
// The emulator's own bookkeeping runs under RaceIgnore.
#pragma once

#include <cstddef>
#include <vector>

#if defined(SIMT_UCONTEXT) || !defined(__x86_64__)
#define SIMT_USE_UCONTEXT 1
#include <ucontext.h>
#endif

#if defined(__SANITIZE_THREAD__)
#include <sanitizer/tsan_interface.h>
extern "C" void __tsan_ignore_thread_begin();
extern "C" void __tsan_ignore_thread_end();
#endif

namespace simt::detail {

struct Context {
#ifdef SIMT_USE_UCONTEXT
  ucontext_t uc;
#else
  void* sp = nullptr;
#endif
  const void* stack_bottom = nullptr;  // for ASan; the OS thread's stack is learnt on switch
  size_t stack_bytes = 0;
  void* tsan_fiber = nullptr;          // for TSan; created once per context, reused
};

// Prepares `fiber` so that switching to it runs entry() on [stack, stack + bytes).
// entry must call fiber_started() first and never return: it ends with exit_to().
void make_context(Context* fiber, void* stack, size_t bytes, void (*entry)());
void fiber_started();
// Saves the running context into `from` and resumes `to`.
void switch_context(Context* from, Context* to);
// Leaves the running fiber for good (its stack may be reused) and resumes `to`.
[[noreturn]] void exit_to(Context* from, Context* to);

// Happens-before edges for the race checker (no-ops unless built with TSan).
inline void race_release(void* sync) {
#if defined(__SANITIZE_THREAD__)
  __tsan_release(sync);
#endif
  (void)sync;
}
inline void race_acquire(void* sync) {
#if defined(__SANITIZE_THREAD__)
  __tsan_acquire(sync);
#endif
  (void)sync;
}

// Hides the emulator's own bookkeeping (shared by all fibers of a block) from the race
// checker for its lifetime; the kernel's accesses stay checked.
struct RaceIgnore {
#if defined(__SANITIZE_THREAD__)
  RaceIgnore() { __tsan_ignore_thread_begin(); }
  ~RaceIgnore() { __tsan_ignore_thread_end(); }
#else
  RaceIgnore() {}
#endif
  RaceIgnore(const RaceIgnore&) = delete;
  RaceIgnore& operator=(const RaceIgnore&) = delete;
};

// Fiber stacks of one OS thread, mmap'ed with a guard page below each, reused across blocks.
class StackPool {
 public:
  static constexpr size_t kStackBytes = 256 * 1024;
  StackPool() = default;
  StackPool(const StackPool&) = delete;
  StackPool& operator=(const StackPool&) = delete;
  ~StackPool();
  void* stack(size_t i);  // bottom of stack i (kStackBytes usable), allocated on first use

 private:
  std::vector<void*> mappings_;
};

}  // namespace simt::detail
