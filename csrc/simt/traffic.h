// Global-memory traffic counters (docs/simt.md, Traffic): off by default and free when off (one
// relaxed load of a pointer per access). Between start() and stop(), every launch records the
// accesses its kernel announces with record() (kernels do so through csrc/kernels/memory.cuh),
// grouped into warp-level requests as a GPU's load/store unit sees them:
//   the same call site, executed by lanes of one warp between the same two warp collectives or
//   barriers (each lane's count of them), for the same time since then (each lane's count of
//   that site) is one request.
// Per launch and per (tag, load/store): requests, bytes requested, 32-byte sectors the requests
// touch, the ideal sectors (a request's distinct bytes / 32, rounded up) and the distinct bytes
// of the whole launch. Torch-free.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>

#include <vector_types.h>

namespace simt::traffic {

struct Launch;  // one recording launch (traffic.cpp)

// The launch being recorded, or null: the whole cost of the counters when they are off.
extern std::atomic<Launch*> current;

inline bool recording() { return current.load(std::memory_order_relaxed) != nullptr; }

// One lane's access of `bytes` at `address`; `tag` names the data ("kv", "query": a string
// literal), `site` the call site (any value equal for the same instruction of the source).
void record(const void* address, size_t bytes, bool store, const char* tag, uint32_t site);

// Starts recording the launches that follow; throws simt::Error if already recording.
void start();
// Stops and returns what was recorded as JSON: {"launches": [{"kernel", "grid", "block",
// "smem", "traffic": [{"tag", "op" ("load" | "store"), "requests", "bytes", "sectors",
// "ideal_sectors", "distinct_bytes"}]}]}.
std::string stop();

namespace detail {
extern std::atomic<bool> armed;  // between start() and stop()
// Called by the emulator: around a launch (while launches are serialized) and after each
// block, on the worker that ran it.
void launch_begin(const std::string& kernel, dim3 grid, dim3 block, size_t smem);
void launch_end();
void block_end();
}  // namespace detail

}  // namespace simt::traffic
