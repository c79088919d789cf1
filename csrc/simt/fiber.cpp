// Fiber context switch and stacks (see fiber.h).
#include "simt/fiber.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <new>

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#endif

namespace simt::detail {

namespace {

size_t page_bytes() {
  static const size_t bytes = size_t(sysconf(_SC_PAGESIZE));
  return bytes;
}

// A stack may be reused after a block was abandoned midway: clear stale ASan poison.
// (Only the OS thread's own context is never prepared: its TSan fiber is the thread.)
void prepare_stack(Context* fiber, void* stack, size_t bytes) {
#if defined(__SANITIZE_ADDRESS__)
  ASAN_UNPOISON_MEMORY_REGION(stack, bytes);
#endif
#if defined(__SANITIZE_THREAD__)
  // A fresh TSan fiber: the previous one left frames behind (fibers never return).
  if (fiber->tsan_fiber) __tsan_destroy_fiber(fiber->tsan_fiber);
  fiber->tsan_fiber = __tsan_create_fiber(0);
#endif
  fiber->stack_bottom = stack;
  fiber->stack_bytes = bytes;
}

#ifdef SIMT_USE_UCONTEXT

void init_frame(Context* fiber, void* stack, size_t bytes, void (*entry)()) {
  getcontext(&fiber->uc);
  fiber->uc.uc_stack.ss_sp = stack;
  fiber->uc.uc_stack.ss_size = bytes;
  fiber->uc.uc_link = nullptr;
  makecontext(&fiber->uc, entry, 0);
}

void raw_switch(Context* from, Context* to) { swapcontext(&from->uc, &to->uc); }

#else

// simt_switch(void** save_sp, void* new_sp): push callee-saved state, swap stacks, pop.
// Frame (low to high): MXCSR + x87 CW (8 bytes), r15, r14, r13, r12, rbx, rbp, return address.
// simt_trampoline: first code of a fiber; calls the entry held in r12 on a 16-byte aligned stack.
asm(R"(
  .text
  .p2align 4
  .globl simt_switch
  .hidden simt_switch
  .type simt_switch, @function
simt_switch:
  .cfi_startproc
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $8, %rsp
  stmxcsr (%rsp)
  fnstcw 4(%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  ldmxcsr (%rsp)
  fldcw 4(%rsp)
  addq $8, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .cfi_endproc
  .size simt_switch, .-simt_switch

  .p2align 4
  .hidden simt_trampoline
  .type simt_trampoline, @function
simt_trampoline:
  .cfi_startproc
  .cfi_undefined rip
  callq *%r12
  ud2
  .cfi_endproc
  .size simt_trampoline, .-simt_trampoline
)");

extern "C" void simt_switch(void** save_sp, void* new_sp);
extern "C" void simt_trampoline();

void init_frame(Context* fiber, void* stack, size_t bytes, void (*entry)()) {
  auto top = (reinterpret_cast<uintptr_t>(stack) + bytes) & ~uintptr_t(15);
  auto* frame = reinterpret_cast<uint64_t*>(top - 80);  // frame + 8 ends 16 bytes below top
  uint32_t mxcsr;
  uint16_t fpu_cw;
  asm volatile("stmxcsr %0" : "=m"(mxcsr));
  asm volatile("fnstcw %0" : "=m"(fpu_cw));
  frame[0] = uint64_t(mxcsr) | (uint64_t(fpu_cw) << 32);
  frame[1] = frame[2] = frame[3] = 0;                // r15, r14, r13
  frame[4] = reinterpret_cast<uint64_t>(entry);      // r12
  frame[5] = frame[6] = 0;                           // rbx, rbp
  frame[7] = reinterpret_cast<uint64_t>(&simt_trampoline);
  fiber->sp = frame;
}

void raw_switch(Context* from, Context* to) { simt_switch(&from->sp, to->sp); }

#endif

thread_local Context* switching_from = nullptr;  // ASan: whose stack bounds to learn

// Announces a switch to the sanitizers; `fake_stack` null means `from` never resumes. For
// TSan only a fiber's exit synchronizes: it happens before whatever its OS thread does next.
void before_switch(Context* from, Context* to, void** fake_stack) {
#if defined(__SANITIZE_ADDRESS__)
  __sanitizer_start_switch_fiber(fake_stack, to->stack_bottom, to->stack_bytes);
  switching_from = from;
#endif
#if defined(__SANITIZE_THREAD__)
  if (!from->tsan_fiber) from->tsan_fiber = __tsan_get_current_fiber();
  __tsan_switch_to_fiber(to->tsan_fiber, fake_stack ? __tsan_switch_to_fiber_no_sync : 0);
#endif
  (void)from, (void)to, (void)fake_stack;
}

// Runs on the destination stack right after a switch.
void after_switch(void* fake_stack) {
#if defined(__SANITIZE_ADDRESS__)
  Context* from = switching_from;
  __sanitizer_finish_switch_fiber(fake_stack, &from->stack_bottom, &from->stack_bytes);
#endif
  (void)fake_stack, (void)switching_from;
}

}  // namespace

void make_context(Context* fiber, void* stack, size_t bytes, void (*entry)()) {
  prepare_stack(fiber, stack, bytes);
  init_frame(fiber, stack, bytes, entry);
}

void fiber_started() { after_switch(nullptr); }

void switch_context(Context* from, Context* to) {
  void* fake_stack = nullptr;
  before_switch(from, to, &fake_stack);
  raw_switch(from, to);
  after_switch(fake_stack);
}

void exit_to(Context* from, Context* to) {
  before_switch(from, to, nullptr);
  raw_switch(from, to);
  __builtin_trap();  // an exited fiber is never resumed
}

StackPool::~StackPool() {
  for (void* m : mappings_) munmap(m, kStackBytes + page_bytes());
}

void* StackPool::stack(size_t i) {
  while (mappings_.size() <= i) {
    const size_t guard = page_bytes();
    void* m = mmap(nullptr, kStackBytes + guard, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (m == MAP_FAILED) throw std::bad_alloc();
    mprotect(m, guard, PROT_NONE);  // an overflow faults here instead of corrupting a neighbour
    mappings_.push_back(m);
  }
  return static_cast<char*>(mappings_[i]) + page_bytes();
}

}  // namespace simt::detail
