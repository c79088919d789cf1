// Global-memory traffic counters (traffic.h): per-worker request tables of the block being run,
// folded into the launch's totals when the block ends.
#include "simt/traffic.h"

#include <algorithm>
#include <bit>
#include <map>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <utility>
#include <vector>

#include "simt/runtime.h"

namespace simt::traffic {

std::atomic<Launch*> current{nullptr};
std::atomic<bool> detail::armed{false};

namespace {

constexpr uint64_t kSector = 32;

struct Counts {
  uint64_t requests = 0, bytes = 0, sectors = 0, ideal_sectors = 0, distinct_bytes = 0;
  std::unordered_map<uint64_t, uint32_t> touched;  // sector -> bytes read or written (bit mask)
};

// Bit mask of the bytes [begin, end) of `sector` (begin, end: absolute addresses).
uint32_t byte_mask(uint64_t sector, uint64_t begin, uint64_t end) {
  const uint64_t lo = std::max(begin, sector * kSector) - sector * kSector;
  const uint64_t hi = std::min(end, (sector + 1) * kSector) - sector * kSector;
  return uint32_t(((hi - lo == 32 ? 0ull : 1ull << (hi - lo)) - 1ull) << lo);
}

}  // namespace

struct Launch {
  uint64_t serial;
  std::string kernel;
  dim3 grid, block;
  size_t smem;
  std::mutex mutex;
  std::map<std::pair<std::string, bool>, Counts> totals;  // (tag, store)
};

namespace {

struct Session {
  std::mutex mutex;
  bool active = false;
  uint64_t serial = 0;
  std::vector<std::unique_ptr<Launch>> done;
  std::unique_ptr<Launch> running;
};

Session& session() {
  static Session* s = new Session;  // never destroyed: workers may outlive static destruction
  return *s;
}

struct Key {
  uint32_t warp, epoch, site, occurrence;
  const char* tag;
  bool store;
  bool operator==(const Key&) const = default;
};

struct KeyHash {
  size_t operator()(const Key& k) const {
    uint64_t h = (uint64_t(k.warp) << 32 | k.epoch) * 0x9e3779b97f4a7c15ull;
    h ^= (uint64_t(k.site) << 32 | k.occurrence) + 0x632be59bd9b4e019ull + (h << 6) + (h >> 2);
    h ^= reinterpret_cast<uintptr_t>(k.tag) + uint64_t(k.store);
    return size_t(h);
  }
};

// One worker's record of the block it runs.
struct BlockState {
  struct Lane {
    uint32_t epoch = ~0u;
    std::vector<std::pair<uint32_t, uint32_t>> sites;  // site -> accesses in this epoch
  };
  uint64_t serial = ~0ull;
  Launch* launch = nullptr;
  std::vector<Lane> lanes;
  std::unordered_map<Key, std::vector<std::pair<uint64_t, uint32_t>>, KeyHash> requests;

  void reset(Launch* l) {
    serial = l->serial;
    launch = l;
    lanes.clear();
    requests.clear();
  }
};

BlockState& block_state() {
  thread_local BlockState state;
  return state;
}

}  // namespace

void record(const void* address, size_t bytes, bool store, const char* tag, uint32_t site) {
  Launch* l = current.load(std::memory_order_acquire);
  const ::simt::detail::Thread* t = ::simt::detail::current_thread;
  if (l == nullptr || t == nullptr || bytes == 0) return;
  BlockState& b = block_state();
  if (b.serial != l->serial) b.reset(l);
  if (b.lanes.size() <= t->linear) b.lanes.resize(t->linear + 1);
  BlockState::Lane& lane = b.lanes[t->linear];
  if (lane.epoch != t->syncs) {
    lane.epoch = t->syncs;
    lane.sites.clear();
  }
  uint32_t occurrence = 0;
  auto it = std::find_if(lane.sites.begin(), lane.sites.end(),
                         [&](const auto& s) { return s.first == site; });
  if (it == lane.sites.end()) {
    lane.sites.emplace_back(site, 1);
  } else {
    occurrence = it->second++;
  }
  const Key key{t->linear / 32, lane.epoch, site, occurrence, tag, store};
  b.requests[key].emplace_back(reinterpret_cast<uintptr_t>(address), uint32_t(bytes));
}

namespace detail {

void block_end() {
  BlockState& b = block_state();
  Launch* l = current.load(std::memory_order_acquire);
  if (l == nullptr || b.serial != l->serial || b.requests.empty()) {
    if (l != nullptr && b.serial == l->serial) b.lanes.clear();
    return;
  }
  std::map<std::pair<std::string, bool>, Counts> local;
  std::vector<uint64_t> sectors;
  for (auto& [key, pieces] : b.requests) {
    Counts& c = local[{key.tag, key.store}];
    std::sort(pieces.begin(), pieces.end());
    uint64_t distinct = 0, covered = 0;  // covered: end of the union so far
    sectors.clear();
    for (const auto& [begin, size] : pieces) {
      const uint64_t end = begin + size;
      c.bytes += size;
      if (end > covered) {
        distinct += end - std::max(begin, covered);
        covered = end;
      }
      for (uint64_t s = begin / kSector; s <= (end - 1) / kSector; ++s) {
        sectors.push_back(s);
        c.touched[s] |= byte_mask(s, begin, end);
      }
    }
    std::sort(sectors.begin(), sectors.end());
    c.sectors += uint64_t(std::unique(sectors.begin(), sectors.end()) - sectors.begin());
    c.ideal_sectors += (distinct + kSector - 1) / kSector;
    ++c.requests;
  }
  b.requests.clear();
  b.lanes.clear();
  const std::lock_guard<std::mutex> lock(l->mutex);
  for (auto& [key, c] : local) {
    Counts& total = l->totals[key];
    total.requests += c.requests;
    total.bytes += c.bytes;
    total.sectors += c.sectors;
    total.ideal_sectors += c.ideal_sectors;
    if (total.touched.empty()) {
      total.touched = std::move(c.touched);
    } else {
      for (const auto& [s, mask] : c.touched) total.touched[s] |= mask;
    }
  }
}

void launch_begin(const std::string& kernel, dim3 grid, dim3 block, size_t smem) {
  Session& s = session();
  const std::lock_guard<std::mutex> lock(s.mutex);
  if (!s.active) return;
  s.running = std::make_unique<Launch>();
  s.running->serial = ++s.serial;
  s.running->kernel = kernel;
  s.running->grid = grid;
  s.running->block = block;
  s.running->smem = smem;
  current.store(s.running.get(), std::memory_order_release);
}

void launch_end() {
  Session& s = session();
  const std::lock_guard<std::mutex> lock(s.mutex);
  if (!s.running) return;
  current.store(nullptr, std::memory_order_release);
  for (auto& [key, c] : s.running->totals) {
    for (const auto& [sector, mask] : c.touched) c.distinct_bytes += uint64_t(std::popcount(mask));
    c.touched = {};
  }
  s.done.push_back(std::move(s.running));
}

}  // namespace detail

void start() {
  Session& s = session();
  const std::lock_guard<std::mutex> lock(s.mutex);
  if (s.active) throw Error("simt: traffic counters are already recording");
  s.active = true;
  s.done.clear();
  detail::armed = true;
}

namespace {

std::string quoted(const std::string& text) {
  std::string out = "\"";
  for (const char ch : text) {
    if (ch == '"' || ch == '\\') out += '\\';
    out += ch;
  }
  return out + "\"";
}

std::string triple(dim3 d) {
  return "[" + std::to_string(d.x) + ", " + std::to_string(d.y) + ", " + std::to_string(d.z) +
         "]";
}

}  // namespace

std::string stop() {
  Session& s = session();
  std::vector<std::unique_ptr<Launch>> done;
  {
    const std::lock_guard<std::mutex> lock(s.mutex);
    if (!s.active) throw Error("simt: traffic counters are not recording");
    s.active = false;
    detail::armed = false;
    done.swap(s.done);
  }
  std::string out = "{\"launches\": [";
  for (size_t i = 0; i < done.size(); ++i) {
    const Launch& l = *done[i];
    out += (i ? ", " : "") + std::string("{\"kernel\": ") + quoted(l.kernel) +
           ", \"grid\": " + triple(l.grid) + ", \"block\": " + triple(l.block) +
           ", \"smem\": " + std::to_string(l.smem) + ", \"traffic\": [";
    bool first = true;
    for (const auto& [key, c] : l.totals) {
      out += (first ? "" : ", ") + std::string("{\"tag\": ") + quoted(key.first) +
             ", \"op\": " + (key.second ? "\"store\"" : "\"load\"") +
             ", \"requests\": " + std::to_string(c.requests) +
             ", \"bytes\": " + std::to_string(c.bytes) +
             ", \"sectors\": " + std::to_string(c.sectors) +
             ", \"ideal_sectors\": " + std::to_string(c.ideal_sectors) +
             ", \"distinct_bytes\": " + std::to_string(c.distinct_bytes) + "}";
      first = false;
    }
    out += "]}";
  }
  return out + "]}";
}

}  // namespace simt::traffic
