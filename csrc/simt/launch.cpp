// Grid launch: worker threads take block indices from an atomic counter and run each block
// on a BlockRunner of their own; the first failure stops the grid and is rethrown here.
// Also the controls (order, seed, workers; PAGEDKV_SIMT_* environment) and runtime shims.
#include <cxxabi.h>
#include <dlfcn.h>
#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <mutex>
#include <numeric>
#include <thread>
#include <unordered_map>
#include <utility>

#include "simt/scheduler.h"
#include "simt/traffic.h"

namespace simt {
namespace {

Order parse_order(const std::string& s) {
  if (s == "forward") return Order::forward;
  if (s == "reverse") return Order::reverse;
  if (s == "random") return Order::random;
  throw Error("simt: order must be forward, reverse or random, not '" + s + "'");
}

struct Settings {
  std::atomic<Order> order{Order::forward};
  std::atomic<uint64_t> seed{0};
  std::atomic<int> workers{1};
};

// Defaults, then PAGEDKV_SIMT_ORDER / PAGEDKV_SIMT_SEED / PAGEDKV_SIMT_WORKERS.
Settings& settings() {
  static Settings* s = [] {
    auto* s = new Settings;
    s->workers = int(std::clamp(std::thread::hardware_concurrency(), 1u, 8u));
    if (const char* v = std::getenv("PAGEDKV_SIMT_ORDER")) s->order = parse_order(v);
    if (const char* v = std::getenv("PAGEDKV_SIMT_SEED")) s->seed = std::strtoull(v, nullptr, 0);
    if (const char* v = std::getenv("PAGEDKV_SIMT_WORKERS")) s->workers = std::max(1, std::atoi(v));
    return s;
  }();
  return *s;
}

// Persistent worker threads; the launching thread is worker 0. Never destroyed: its threads
// sleep until process exit, so no static destructor has to join them. A forked child has
// none of them and starts a pool of its own.
class Pool {
 public:
  static Pool& get() {
    static const bool registered = [] {
      pthread_atfork(nullptr, nullptr, [] { instance = nullptr; });
      return true;
    }();
    (void)registered;
    if (!instance) instance = new Pool;
    return *instance;
  }

  void run(unsigned n, const std::function<void()>& job) {
    std::unique_lock<std::mutex> lock(mutex_);
    while (threads_.size() + 1 < n) {
      threads_.emplace_back([this, i = threads_.size() + 1] { loop(i); });
    }
    job_ = &job;
    active_ = n;
    remaining_ = n - 1;
    ++generation_;
    work_.notify_all();
    lock.unlock();
    job();
    lock.lock();
    done_.wait(lock, [this] { return remaining_ == 0; });
  }

 private:
  void loop(size_t index) {
    uint64_t seen = 0;
    std::unique_lock<std::mutex> lock(mutex_);
    for (;;) {
      work_.wait(lock, [&] { return generation_ != seen; });
      seen = generation_;
      if (index >= active_) continue;
      const auto* job = job_;
      lock.unlock();
      (*job)();
      lock.lock();
      if (--remaining_ == 0) done_.notify_all();
    }
  }

  static inline Pool* instance = nullptr;
  std::mutex mutex_;
  std::condition_variable work_, done_;
  std::vector<std::thread> threads_;
  const std::function<void()>* job_ = nullptr;
  size_t active_ = 0, remaining_ = 0;
  uint64_t generation_ = 0;
};

// Block visiting order: forward, reverse, or a seeded stride permutation of the grid.
struct BlockOrder {
  BlockOrder(Order order, uint64_t seed, uint64_t total) : order(order), total(total) {
    if (order != Order::random || total < 2) return;
    stride = (seed * 0x9e3779b97f4a7c15ull) % total | 1;
    while (std::gcd(stride, total) != 1) stride += 2;
    offset = (seed ^ 0x5851f42d4c957f2dull) % total;
  }
  uint64_t operator()(uint64_t i) const {
    if (order == Order::reverse) return total - 1 - i;
    if (order == Order::random) return (i * stride + offset) % total;
    return i;
  }
  Order order;
  uint64_t total, stride = 1, offset = 0;
};

// Kernels' cudaFuncAttributeMaxDynamicSharedMemorySize (cudaFuncSetAttribute): a launch may ask
// for more than 48 KiB of dynamic shared memory only up to it, as on a GPU.
struct SmemOptIns {
  std::mutex mutex;
  std::unordered_map<const void*, int> bytes;
};

SmemOptIns& smem_opt_ins() {
  static SmemOptIns* s = new SmemOptIns;
  return *s;
}

constexpr size_t kDefaultSmem = 48 * 1024, kOptInSmem = 227 * 1024;

// The launch error a GPU reports for this configuration (cudaSuccess: none), and why.
std::pair<cudaError_t, std::string> check_launch(const detail::LaunchInfo& l) {
  const dim3 g = l.grid, b = l.block;
  const uint64_t threads = uint64_t(b.x) * b.y * b.z;
  std::string bad;
  if (g.x == 0 || g.y == 0 || g.z == 0 || threads == 0) bad = "a grid or block dimension is 0";
  if (threads > 1024) bad = "block has " + std::to_string(threads) + " threads, more than 1024";
  if (b.z > 64) bad = "blockDim.z " + std::to_string(b.z) + " exceeds 64";
  if (g.y > 65535 || g.z > 65535) {
    bad = "gridDim (" + std::to_string(g.x) + "," + std::to_string(g.y) + "," +
          std::to_string(g.z) + "): y and z must be at most 65535";
  }
  if (g.x > 0x7fffffffu) bad = "gridDim.x exceeds 2^31 - 1";
  if (!bad.empty()) return {cudaErrorInvalidConfiguration, bad};
  if (l.smem > kDefaultSmem) {
    size_t allowed = kDefaultSmem;
    {
      SmemOptIns& o = smem_opt_ins();
      const std::lock_guard<std::mutex> lock(o.mutex);
      const auto it = o.bytes.find(l.kernel);
      if (it != o.bytes.end()) allowed = std::max(allowed, size_t(it->second));
    }
    if (l.smem > allowed) {
      return {cudaErrorInvalidValue,
              "dynamic shared memory of " + std::to_string(l.smem) + " bytes exceeds " +
                  (allowed == kDefaultSmem ? std::string("48 KiB without the kernel's "
                                                         "cudaFuncAttributeMaxDynamicSharedMemorySize")
                                           : "the kernel's cudaFuncAttributeMaxDynamicSharedMemorySize "
                                             "of " + std::to_string(allowed))};
    }
  }
  return {cudaSuccess, ""};
}

// cudaGetLastError's state: per host thread, like the CUDA runtime's.
thread_local cudaError_t last_error = cudaSuccess;
thread_local std::string last_message;

}  // namespace

void set_order(Order o, uint64_t s) {
  settings().order = o;
  settings().seed = s;
}
void set_order(const std::string& o, uint64_t s) { set_order(parse_order(o), s); }
Order order() { return settings().order; }
uint64_t seed() { return settings().seed; }
void set_workers(int n) {
  if (n < 1) throw Error("simt: workers must be at least 1, got " + std::to_string(n));
  settings().workers = n;
}
int workers() { return settings().workers; }

cudaError_t get_last_error() {
  const cudaError_t err = last_error;
  last_error = cudaSuccess;
  return err;
}
cudaError_t peek_at_last_error() { return last_error; }
const std::string& last_error_message() { return last_message; }
const char* get_error_string(cudaError_t err) {
  switch (err) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorInvalidConfiguration: return "invalid configuration argument";
    case cudaErrorInvalidDevice: return "invalid device ordinal";
    default: return "unrecognized error code";
  }
}
cudaError_t set_func_attribute(const void* kernel, cudaFuncAttribute attr, int value) {
  if (attr != cudaFuncAttributeMaxDynamicSharedMemorySize) return cudaSuccess;
  if (value < 0 || size_t(value) > kOptInSmem) return cudaErrorInvalidValue;
  SmemOptIns& o = smem_opt_ins();
  const std::lock_guard<std::mutex> lock(o.mutex);
  o.bytes[kernel] = value;
  return cudaSuccess;
}
cudaError_t get_device(int* device) {
  *device = 0;
  return cudaSuccess;
}
cudaError_t device_get_attribute(int* value, cudaDeviceAttr attr, int device) {
  if (device != 0) return cudaErrorInvalidDevice;
  switch (attr) {
    case cudaDevAttrMaxThreadsPerBlock: *value = 1024; break;
    case cudaDevAttrMaxSharedMemoryPerBlock: *value = 48 * 1024; break;
    case cudaDevAttrMaxSharedMemoryPerBlockOptin: *value = 227 * 1024; break;
    case cudaDevAttrMaxSharedMemoryPerMultiprocessor: *value = 228 * 1024; break;
    case cudaDevAttrWarpSize: *value = 32; break;
    case cudaDevAttrMultiProcessorCount: *value = 132; break;
    case cudaDevAttrComputeCapabilityMajor: *value = 9; break;
    case cudaDevAttrComputeCapabilityMinor: *value = 0; break;
    default: return cudaErrorInvalidValue;
  }
  return cudaSuccess;
}
cudaError_t memcpy_async(void* dst, const void* src, size_t bytes, cudaMemcpyKind, cudaStream_t) {
  if (bytes) std::memmove(dst, src, bytes);
  return cudaSuccess;
}
cudaError_t memset_async(void* dst, int value, size_t bytes, cudaStream_t) {
  if (bytes) std::memset(dst, value, bytes);
  return cudaSuccess;
}

namespace detail {

std::string kernel_name(const void* kernel) {
  Dl_info info{};
  if (!dladdr(kernel, &info) || !info.dli_sname) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%p", kernel);
    return buf;
  }
  int status = 0;
  char* demangled = abi::__cxa_demangle(info.dli_sname, nullptr, nullptr, &status);
  std::string name = status == 0 ? demangled : info.dli_sname;
  std::free(demangled);
  return name;
}

void launch(const void* kernel, dim3 grid, dim3 block, size_t smem, Body body,
            const void* context) {
  static std::mutex launch_mutex;  // one grid at a time; its blocks spread over the workers
  const LaunchInfo info{kernel, grid, block, smem, body, context, order(), seed()};
  // A bad configuration runs nothing and is reported by cudaGetLastError, as on a GPU.
  if (auto [err, why] = check_launch(info); err != cudaSuccess) {
    last_error = err;
    last_message = "simt: kernel " + kernel_name(kernel) + ": " + why;
    return;
  }
  const std::lock_guard<std::mutex> lock(launch_mutex);
  const uint64_t total = uint64_t(grid.x) * grid.y * grid.z;
  const BlockOrder block_order(info.order, info.seed, total);
  std::atomic<uint64_t> next{0};
  std::atomic<bool> failed{false};
  std::mutex error_mutex;
  std::string error;
  const std::function<void()> job = [&] {
    thread_local BlockRunner runner;
    for (uint64_t i; !failed && (i = next++) < total;) {
      const uint64_t b = block_order(i);
      const uint3 idx{unsigned(b % grid.x), unsigned(b / grid.x % grid.y),
                      unsigned(b / grid.x / grid.y)};
      try {
        runner.run(info, idx, b);
      } catch (const std::exception& e) {
        const std::lock_guard<std::mutex> error_lock(error_mutex);
        if (!failed.exchange(true)) error = e.what();
      }
    }
  };
  const bool traced = traffic::detail::armed.load(std::memory_order_relaxed);
  if (traced) traffic::detail::launch_begin(kernel_name(kernel), grid, block, smem);
  Pool::get().run(unsigned(std::min<uint64_t>(uint64_t(workers()), total)), job);
  if (traced) traffic::detail::launch_end();
  if (failed) throw Error(error);
}

}  // namespace detail
}  // namespace simt
