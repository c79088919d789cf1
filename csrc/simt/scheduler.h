// Runs one block: its CUDA threads are fibers on the calling OS thread, resumed in the
// configured order; barriers and warp collectives suspend them (see scheduler.cpp).
#pragma once

#include <cstdint>
#include <deque>
#include <exception>
#include <memory>
#include <string>
#include <vector>

#include "simt/fiber.h"
#include "simt/runtime.h"

namespace simt::detail {

struct LaunchInfo {
  const void* kernel;  // for naming it in messages
  dim3 grid, block;
  size_t smem;
  Body body;
  const void* context;
  Order order;
  uint64_t seed;
};

std::string kernel_name(const void* kernel);
const char* op_name(Op op);  // "__syncthreads", "__shfl_sync", "ldmatrix.sync...", ...

// Computes a matrix op (Op::mma_*, Op::ldmatrix_*) of a full warp: lanes[l] is lane l's record,
// which the op reads its operands from and writes its results to (tensor_core.cpp).
void resolve_matrix_op(Op op, void* const lanes[32]);
// Raises simt::Error when thread `t` ends with cp.async copies pending (tensor_core.cpp).
void check_no_pending_copies(const Thread& t);

class BlockRunner {
 public:
  // Runs block `idx` of the launch to completion; throws simt::Error naming the block.
  void run(const LaunchInfo& launch, uint3 idx, uint64_t block_linear);

  uint64_t sync_threads(int predicate);
  uint64_t warp_collective(Op op, unsigned mask, uint64_t value, int arg, int width);

 private:
  static void fiber_main();
  void suspend();
  void abandon_waiting_fibers();
  void make_ready(std::vector<unsigned>& ids);  // ids ascending; queued in the run order
  void resolve_warp(unsigned base, unsigned mask, Op op);
  unsigned num_threads() const { return unsigned(threads_.size()); }
  std::string where() const;
  std::string stuck_message() const;
  std::string thread_map() const;
  std::string label(const Thread& t) const;

  const LaunchInfo* launch_ = nullptr;
  Block block_{};
  std::vector<Thread> threads_;
  std::vector<Context> contexts_;
  Context scheduler_;
  std::deque<unsigned> ready_;
  unsigned exited_ = 0;
  bool abandoning_ = false;
  unsigned at_barrier_ = 0;
  std::vector<unsigned> warp_waiting_;  // per warp: lanes waiting in a warp collective
  uint64_t barrier_generation_ = 0;
  char barrier_sync_[2] = {}, block_start_ = 0;  // race checker sync objects
  std::exception_ptr error_;
  unsigned error_thread_ = 0;
  uint64_t rng_ = 0;
  std::vector<unsigned> ids_;
  StackPool stacks_;
  struct AlignedFree {
    void operator()(unsigned char* p) const;
  };
  std::unique_ptr<unsigned char[], AlignedFree> smem_;
  size_t smem_bytes_ = 0;
};

}  // namespace simt::detail
