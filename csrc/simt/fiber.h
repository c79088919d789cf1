// Fibers: execution contexts on their own stacks, switched explicitly on one OS thread.
// x86-64: a small assembly switch (callee-saved registers, MXCSR, x87 control word);
// elsewhere, or with SIMT_UCONTEXT defined, glibc ucontext (a syscall per switch).
#pragma once

#include <cstddef>
#include <vector>

#if defined(SIMT_UCONTEXT) || !defined(__x86_64__)
#define SIMT_USE_UCONTEXT 1
#include <ucontext.h>
#endif

namespace simt::detail {

struct Context {
#ifdef SIMT_USE_UCONTEXT
  ucontext_t uc;
#else
  void* sp = nullptr;
#endif
  void* stack_bottom = nullptr;  // for sanitizer fiber annotations
  size_t stack_bytes = 0;
};

// Prepares `fiber` so that switching to it runs entry() on [stack, stack + bytes).
// entry must never return: it ends by switching away for good.
void make_context(Context* fiber, void* stack, size_t bytes, void (*entry)());
// Saves the running context into `from` and resumes `to`.
void switch_context(Context* from, Context* to);

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
