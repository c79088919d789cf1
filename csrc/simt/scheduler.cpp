// Block scheduler: fibers, barrier by arrival counting, warp collectives resolved by the
// last lane of the mask to arrive, and the diagnostics of a block that cannot go on.
#include "simt/scheduler.h"

#include "simt/traffic.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <new>
#include <numeric>

namespace simt::detail {

thread_local Thread* current_thread = nullptr;
thread_local Block* current_block = nullptr;

namespace {

thread_local BlockRunner* active_runner = nullptr;

struct Abandon {};  // unwinds a fiber of a failed block

uint64_t splitmix64(uint64_t& state) {
  uint64_t z = (state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

}  // namespace

const char* op_name(Op op) {
  switch (op) {
    case Op::running: return "running";
    case Op::syncthreads: return "__syncthreads";
    case Op::syncwarp: return "__syncwarp";
    case Op::shfl: return "__shfl_sync";
    case Op::shfl_up: return "__shfl_up_sync";
    case Op::shfl_down: return "__shfl_down_sync";
    case Op::shfl_xor: return "__shfl_xor_sync";
    case Op::ballot: return "__ballot_sync";
    case Op::any: return "__any_sync";
    case Op::all: return "__all_sync";
    case Op::exited: return "exited";
    case Op::mma_f16: return "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32";
    case Op::mma_bf16: return "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32";
    case Op::ldmatrix_x1: return "ldmatrix.sync.aligned.m8n8.x1.shared.b16";
    case Op::ldmatrix_x2: return "ldmatrix.sync.aligned.m8n8.x2.shared.b16";
    case Op::ldmatrix_x4: return "ldmatrix.sync.aligned.m8n8.x4.shared.b16";
    case Op::ldmatrix_x1_trans: return "ldmatrix.sync.aligned.m8n8.x1.trans.shared.b16";
    case Op::ldmatrix_x2_trans: return "ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16";
    case Op::ldmatrix_x4_trans: return "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16";
  }
  return "?";
}

namespace {

bool is_warp_op(Op op) { return op != Op::running && op != Op::syncthreads && op != Op::exited; }
bool is_matrix_op(Op op) { return op >= Op::mma_f16; }

std::string hex(unsigned mask) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "0x%08x", mask);
  return buf;
}

std::string dims(uint3 d) {
  return "(" + std::to_string(d.x) + "," + std::to_string(d.y) + "," + std::to_string(d.z) + ")";
}

// Source lane of `lane` for a shuffle, or -1 for ops that do not read another lane.
int source_lane(const Thread& t, unsigned lane) {
  const int w = t.width, seg = int(lane) & ~(w - 1), in_seg = int(lane) - seg;
  switch (t.op) {
    case Op::shfl: return seg + (t.arg & (w - 1));
    case Op::shfl_up: return in_seg >= t.arg ? int(lane) - t.arg : int(lane);
    case Op::shfl_down: return in_seg + t.arg < w ? int(lane) + t.arg : int(lane);
    case Op::shfl_xor: {
      const int src = int(lane) ^ t.arg;
      return src < seg + w ? src : int(lane);
    }
    default: return -1;
  }
}

std::string describe(const std::exception_ptr& error) {
  try {
    std::rethrow_exception(error);
  } catch (const std::exception& e) {
    return e.what();
  } catch (...) {
    return "unknown exception";
  }
}

}  // namespace

void BlockRunner::AlignedFree::operator()(unsigned char* p) const {
  ::operator delete[](p, std::align_val_t(16));
}

void BlockRunner::run(const LaunchInfo& launch, uint3 idx, uint64_t block_linear) {
  const RaceIgnore ignore;
  launch_ = &launch;
  const dim3 d = launch.block;
  const unsigned n = d.x * d.y * d.z;
  if (smem_bytes_ != launch.smem) {
    smem_.reset(launch.smem ? static_cast<unsigned char*>(
                                  ::operator new[](launch.smem, std::align_val_t(16)))
                            : nullptr);
    smem_bytes_ = launch.smem;
  }
  if (smem_bytes_) std::memset(smem_.get(), 0xff, smem_bytes_);
  block_ = Block{idx, d, launch.grid, smem_.get(), smem_bytes_};
  threads_.resize(n);
  contexts_.resize(n);
  for (unsigned i = 0; i < n; ++i) {
    Thread& t = threads_[i];
    std::vector<AsyncCopy> copies = std::move(t.async_copies);  // keeps its capacity
    copies.clear();
    t = Thread{};
    t.async_copies = std::move(copies);
    t.idx = uint3{i % d.x, i / d.x % d.y, i / (d.x * d.y)};
    t.linear = i;
    auto* stack = static_cast<unsigned char*>(stacks_.stack(i));
    t.stack_lo = stack;
    t.stack_hi = stack + StackPool::kStackBytes;
    make_context(&contexts_[i], stack, StackPool::kStackBytes, &fiber_main);
  }
  warp_waiting_.assign((n + 31) / 32, 0);
  exited_ = at_barrier_ = 0;
  error_ = nullptr;
  ready_.clear();
  rng_ = launch.seed ^ (block_linear * 0xd1b54a32d192ed03ull);
  ids_.resize(n);
  std::iota(ids_.begin(), ids_.end(), 0u);
  make_ready(ids_);

  active_runner = this;
  current_block = &block_;
  race_release(&block_start_);  // the launch's inputs and the poisoned shared memory
  while (!ready_.empty() && !error_) {
    const unsigned i = ready_.front();
    ready_.pop_front();
    current_thread = &threads_[i];
    switch_context(&scheduler_, &contexts_[i]);
  }
  std::string failure;
  if (error_) {
    failure = where() + ", thread " + dims(threads_[error_thread_].idx) + ": " + describe(error_);
  } else if (exited_ != n) {
    failure = where() + ": " + stuck_message();
  }
  if (!failure.empty()) abandon_waiting_fibers();
  if (traffic::recording()) traffic::detail::block_end();
  current_thread = nullptr;
  current_block = nullptr;
  active_runner = nullptr;
  if (!failure.empty()) throw Error(failure);
}

void BlockRunner::fiber_main() {
  fiber_started();
  BlockRunner& r = *active_runner;
  Thread& t = *current_thread;
  race_acquire(&r.block_start_);
  try {
    if (!r.abandoning_) {
      r.launch_->body(r.launch_->context);
      check_no_pending_copies(t);
    }
  } catch (const Abandon&) {
  } catch (...) {
    r.error_ = std::current_exception();
    r.error_thread_ = t.linear;
  }
  // Outside the catch block: a fiber never switches while an exception is being handled.
  {
    const RaceIgnore ignore;
    t.op = Op::exited;
    ++r.exited_;
  }
  exit_to(&r.contexts_[t.linear], &r.scheduler_);
}

void BlockRunner::suspend() {
  Context& self = contexts_[current_thread->linear];
  switch_context(&self, &scheduler_);
  if (abandoning_) throw Abandon{};  // the block failed: unwind the kernel, end in fiber_main
}

// After a failure, resumes each fiber that has not exited once so that it ends at once (see
// suspend() and fiber_main()): its frames unwind, and the race checker orders its accesses
// before the launch returns.
void BlockRunner::abandon_waiting_fibers() {
  abandoning_ = true;
  for (Thread& t : threads_) {
    if (t.op == Op::exited) continue;
    current_thread = &t;
    switch_context(&scheduler_, &contexts_[t.linear]);
  }
  abandoning_ = false;
}

void BlockRunner::make_ready(std::vector<unsigned>& ids) {
  if (launch_->order == Order::reverse) std::reverse(ids.begin(), ids.end());
  if (launch_->order == Order::random) {
    for (size_t i = ids.size(); i > 1; --i) std::swap(ids[i - 1], ids[splitmix64(rng_) % i]);
  }
  for (unsigned id : ids) threads_[id].op = Op::running;
  ready_.insert(ready_.end(), ids.begin(), ids.end());
}

// Counts arrivals at any __syncthreads: like a GPU, and unlike source-level matching, it does
// not tell two barrier call sites apart (the compiler may duplicate one).
uint64_t BlockRunner::sync_threads(int predicate) {
  const RaceIgnore ignore;
  Thread& t = *current_thread;
  ++t.syncs;
  t.op = Op::syncthreads;
  t.value = uint64_t(predicate != 0);
  // Two sync objects alternate: a fast thread's next barrier cannot complete (and so cannot
  // publish) before this one's stragglers have acquired.
  void* sync = &barrier_sync_[barrier_generation_ & 1];
  race_release(sync);
  if (++at_barrier_ == num_threads()) {
    ++barrier_generation_;
    at_barrier_ = 0;
    uint64_t count = 0;
    for (const Thread& u : threads_) count += u.value;
    for (Thread& u : threads_) u.result = count;
    ids_.resize(num_threads());
    std::iota(ids_.begin(), ids_.end(), 0u);
    make_ready(ids_);
  }
  suspend();
  race_acquire(sync);
  return t.result;
}

uint64_t BlockRunner::warp_collective(Op op, unsigned mask, uint64_t value, int arg, int width) {
  const RaceIgnore ignore;
  Thread& t = *current_thread;
  const unsigned lane = t.linear % 32, base = t.linear - lane;
  const unsigned lanes = std::min(32u, num_threads() - base);
  const auto call = [&] { return std::string(op_name(op)) + "(" + hex(mask) + ")"; };
  if (!(mask >> lane & 1u)) {
    fail(call() + " in lane " + std::to_string(lane) + ": the mask must include the calling lane");
  }
  if (lanes < 32 && (mask >> lanes) != 0) {
    fail(call() + " names lanes absent from warp " + std::to_string(base / 32) + ", which has " +
         std::to_string(lanes) + " lanes");
  }
  if (width < 1 || width > 32 || (width & (width - 1))) {
    fail(call() + ": width " + std::to_string(width) + " is not a power of 2 in [1, 32]");
  }
  ++t.syncs;
  t.op = op;
  t.mask = mask;
  t.value = value;
  t.arg = arg;
  t.width = width;
  // Cheap test first: enough lanes of this warp wait in some collective to fill the mask.
  bool complete = ++warp_waiting_[base / 32] >= unsigned(__builtin_popcount(mask));
  for (unsigned l = 0; l < 32 && complete; ++l) {
    if (!(mask >> l & 1u)) continue;
    const Thread& u = threads_[base + l];  // lanes of the mask exist: checked above
    complete = u.op == op && u.mask == mask;
  }
  void* sync = &warp_waiting_[base / 32];
  race_release(sync);
  if (complete) resolve_warp(base, mask, op);
  suspend();
  race_acquire(sync);
  return t.result;
}

// A lane that reads a lane outside the mask gets an undefined value on a GPU; here all ones
// (NaN for floats), so that using it shows while the common read-then-discard pattern works.
void BlockRunner::resolve_warp(unsigned base, unsigned mask, Op op) {
  constexpr uint64_t kUndefined = ~uint64_t(0);
  uint64_t ballot = 0;
  ids_.clear();
  for (unsigned l = 0; l < 32; ++l) {
    if (!(mask >> l & 1u)) continue;
    ballot |= uint64_t(threads_[base + l].value != 0) << l;
    ids_.push_back(base + l);
  }
  warp_waiting_[base / 32] -= unsigned(ids_.size());
  if (is_matrix_op(op)) {  // the full warp (checked at the call): lane records by address
    void* lanes[32];
    for (unsigned l = 0; l < 32; ++l) {
      lanes[l] = reinterpret_cast<void*>(uintptr_t(threads_[base + l].value));
    }
    resolve_matrix_op(op, lanes);
  }
  for (unsigned id : ids_) {
    Thread& u = threads_[id];
    const int src = source_lane(u, id - base);
    switch (op) {
      case Op::ballot: u.result = ballot; break;
      case Op::any: u.result = ballot != 0; break;
      case Op::all: u.result = ballot == (uint64_t)mask; break;
      case Op::syncwarp: u.result = 0; break;
      default:
        if (is_matrix_op(op)) {
          u.result = 0;  // results went to the lane records
        } else {
          u.result = mask >> src & 1u ? threads_[base + unsigned(src)].value : kUndefined;
        }
    }
  }
  make_ready(ids_);
}

std::string BlockRunner::where() const {
  return "simt: kernel " + kernel_name(launch_->kernel) + ", block " + dims(block_.idx);
}

// Why a block with no runnable thread cannot finish, most specific reason first.
std::string BlockRunner::stuck_message() const {
  const bool barrier = at_barrier_ > 0;
  std::string why = "deadlock";
  if (barrier && exited_ > 0) {
    why = "__syncthreads reached by some threads while others exited";
  } else {
    for (const Thread& t : threads_) {
      if (!is_warp_op(t.op)) continue;
      const unsigned base = t.linear - t.linear % 32;
      for (unsigned l = 0; l < 32; ++l) {
        if (!(t.mask >> l & 1u)) continue;
        const Thread& u = threads_[base + l];
        const std::string w = " in warp " + std::to_string(base / 32);
        if (u.op == Op::exited) {
          return std::string(op_name(t.op)) + "(" + hex(t.mask) + ")" + w + " waits for lane " +
                 std::to_string(l) + ", which exited: " + thread_map();
        }
        if (is_warp_op(u.op) && (u.op != t.op || u.mask != t.mask)) {
          why = "lanes" + w + " disagree on a warp collective";
        }
      }
    }
  }
  return why + ": " + thread_map();
}

std::string BlockRunner::label(const Thread& t) const {
  if (is_warp_op(t.op)) return std::string(op_name(t.op)) + "(" + hex(t.mask) + ")";
  return op_name(t.op);
}

// "t0-63: __syncthreads, t64-127: exited" (threads numbered x + y * X + z * X * Y).
std::string BlockRunner::thread_map() const {
  constexpr int kMaxRanges = 24;
  std::string out;
  int ranges = 0;
  for (unsigned i = 0; i < num_threads();) {
    const std::string l = label(threads_[i]);
    unsigned j = i + 1;
    while (j < num_threads() && label(threads_[j]) == l) ++j;
    if (ranges++ == kMaxRanges) return out + ", ...";
    if (!out.empty()) out += ", ";
    out += "t" + std::to_string(i) + (j - i > 1 ? "-" + std::to_string(j - 1) : "") + ": " + l;
    i = j;
  }
  return out;
}

uint64_t sync_threads(int predicate) {
  return active_runner->sync_threads(predicate);
}

uint64_t warp_collective(Op op, unsigned mask, uint64_t value, int arg, int width) {
  return active_runner->warp_collective(op, mask, value, arg, width);
}

void fail(const std::string& message) { throw Error(message); }

void assert_fail(const char* expression, const char* file, int line) {
  const char* slash = std::strrchr(file, '/');
  fail(std::string("assertion failed: ") + expression + " (" + (slash ? slash + 1 : file) + ":" +
       std::to_string(line) + ")");
}

}  // namespace simt::detail
