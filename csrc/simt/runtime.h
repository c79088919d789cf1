// simt runtime interface: the state a kernel sees (current thread and block), the launcher,
// dynamic shared memory, the controls (fiber order, workers) and the host runtime shims.
#pragma once

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <cuda_runtime_api.h>
#include <vector_types.h>

namespace simt {

// Every emulator diagnostic and every exception thrown by a kernel reaches the launching
// thread as this type; what() names the kernel, the block and where the threads stand.
struct Error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Order in which runnable fibers of a block are resumed, and blocks are taken.
enum class Order { forward, reverse, random };

void set_order(Order order, uint64_t seed);
void set_order(const std::string& order, uint64_t seed);  // "forward" | "reverse" | "random"
Order order();
uint64_t seed();
void set_workers(int workers);  // OS threads running blocks; 1 = deterministic run
int workers();

namespace detail {

// What a thread is doing when it is not running: the collective it waits in, or exited.
// The matrix ops (tensor_core.h) are warp collectives of the full warp, one per variant.
enum class Op : uint8_t {
  running, syncthreads, syncwarp, shfl, shfl_up, shfl_down, shfl_xor, ballot, any, all, exited,
  mma_f16, mma_bf16,
  ldmatrix_x1, ldmatrix_x2, ldmatrix_x4, ldmatrix_x1_trans, ldmatrix_x2_trans, ldmatrix_x4_trans
};

// A cp.async issued and not yet landed: `group` is the commit group it belongs to (equal to
// the thread's committed count while its group is still open).
struct AsyncCopy {
  unsigned char* dst;
  const unsigned char* src;
  uint32_t src_bytes;
  uint32_t group;
};

struct Thread {
  uint3 idx;          // threadIdx
  unsigned linear;    // x + y * dim.x + z * dim.x * dim.y
  Op op = Op::running;
  unsigned mask = 0;  // warp collective participants (lane bits)
  uint64_t value = 0; // operand (raw bits), matrix op lane record address, or predicate
  int arg = 0;        // source lane / delta / lane mask
  int width = 32;
  uint64_t result = 0;
  const unsigned char* stack_lo = nullptr;  // the fiber's stack [stack_lo, stack_hi)
  const unsigned char* stack_hi = nullptr;
  std::vector<AsyncCopy> async_copies;  // pending cp.async, oldest first
  uint32_t async_committed = 0;         // cp.async.commit_group count
  uint32_t syncs = 0;  // barriers and warp collectives passed (traffic.h groups requests by it)
};

struct Block {
  uint3 idx;  // blockIdx
  dim3 dim;   // blockDim
  dim3 grid;  // gridDim
  unsigned char* dynamic_smem = nullptr;
  size_t dynamic_smem_bytes = 0;
};

extern thread_local Thread* current_thread;
extern thread_local Block* current_block;

// Suspends the calling fiber in a barrier / warp collective; returns its result.
uint64_t sync_threads(int predicate);  // returns how many threads passed a nonzero predicate
uint64_t warp_collective(Op op, unsigned mask, uint64_t value, int arg, int width);
[[noreturn]] void fail(const std::string& message);  // raises simt::Error from a kernel
[[noreturn]] void assert_fail(const char* expression, const char* file, int line);

using Body = void (*)(const void* context);
// Runs body(context) as every thread of every block; throws simt::Error on any failure.
void launch(const void* kernel, dim3 grid, dim3 block, size_t smem, Body body, const void* context);

}  // namespace detail

// The current block's dynamic shared memory: exactly the launch's smem bytes, 16-byte
// aligned, filled with 0xff (NaN for floating types) before each block.
template <typename T>
T* dynamic_shared() {
  return reinterpret_cast<T*>(detail::current_block->dynamic_smem);
}

// Launcher(kernel, grid, block, smem, stream)(args...): runs the whole grid synchronously.
// The arguments convert to the kernel's parameter types as in a call; each CUDA thread gets
// its own copy of the parameters.
template <typename... Params>
class Launcher {
 public:
  using Kernel = void (*)(Params...);
  Launcher(Kernel kernel, dim3 grid, dim3 block, size_t smem, cudaStream_t /*stream*/)
      : kernel_(kernel), grid_(grid), block_(block), smem_(smem) {}

  template <typename... Args>
  void operator()(Args&&... args) const {
    const Call call{kernel_, std::tuple<Params...>(std::forward<Args>(args)...)};
    detail::launch(reinterpret_cast<const void*>(kernel_), grid_, block_, smem_, &run, &call);
  }

 private:
  struct Call {
    Kernel kernel;
    std::tuple<Params...> params;
  };
  static void run(const void* context) {
    const Call& call = *static_cast<const Call*>(context);
    std::apply(call.kernel, call.params);
  }
  Kernel kernel_;
  dim3 grid_, block_;
  size_t smem_;
};

// Host runtime shims (see simt.h): synchronous, any copy kind. The emulated device is one
// sm_90-like GPU: 132 SMs, 48 KiB dynamic shared memory per block unless the kernel's
// cudaFuncAttributeMaxDynamicSharedMemorySize allows more (227 KiB at most), 1024 threads per
// block. A launch with a bad configuration runs nothing and sets the error that
// get_last_error() returns (and clears) as cudaGetLastError does; last_error_message() says why.
cudaError_t get_last_error();
cudaError_t peek_at_last_error();
const std::string& last_error_message();
const char* get_error_string(cudaError_t err);
cudaError_t get_device(int* device);
cudaError_t device_get_attribute(int* value, cudaDeviceAttr attr, int device);
cudaError_t set_func_attribute(const void* kernel, cudaFuncAttribute attr, int value);
template <typename Kernel>
cudaError_t func_set_attribute(Kernel kernel, cudaFuncAttribute attr, int value) {
  return set_func_attribute(reinterpret_cast<const void*>(kernel), attr, value);
}
cudaError_t memcpy_async(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind,
                         cudaStream_t stream = nullptr);
cudaError_t memset_async(void* dst, int value, size_t bytes, cudaStream_t stream = nullptr);

}  // namespace simt
