// CPU backend of the attention ops (their checks: csrc/ops/): the instruction set, the work
// plan, and the threads. Work items (cpu/attention_work.h) are taken from a shared counter by
// every thread of ATen's pool, so uneven sequences balance; long key ranges are split so that
// one long sequence also keeps every thread busy, then merged by log-sum-exp.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <time.h>

#if defined(__x86_64__) && defined(__linux__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#define PAGEDKV_AMX_PROBE 1
#endif

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <numeric>
#include <cstring>
#include <iterator>
#include <vector>

#include "cpu/attention_work.h"
#include "ops/merge_attn_states.h"
#include "ops/mla_attention.h"
#include "ops/paged_attention.h"

namespace pagedkv::cpu {
namespace {

constexpr int kMaxRowsPerItem = kPrefillRows;  // varlen: query rows (heads x tokens) sharing
                                              // a K/V read
constexpr int kMinKeysPerItem = 256;  // split-K never makes items shorter than this
constexpr int kItemsPerThread = 4;    // split until the items are about this many per thread

// Every instruction set's kernels, narrowest first, and their names.
#define PAGEDKV_KERNELS_ADDRESS(isa) &kernels_##isa,
#define PAGEDKV_ISA_NAME(isa) " " #isa
constexpr const AttentionKernels* kIsas[] = {PAGEDKV_CPU_ISAS(PAGEDKV_KERNELS_ADDRESS)};
constexpr const char* kIsaNames = PAGEDKV_CPU_ISAS(PAGEDKV_ISA_NAME);
#undef PAGEDKV_KERNELS_ADDRESS
#undef PAGEDKV_ISA_NAME

// The index in kIsas of the instruction set PAGEDKV_CPU_ISA names, which the processor must
// have; without it, the widest.
// CPU seconds of the calling thread.
double thread_cpu_seconds() {
  timespec t;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + 1e-9 * static_cast<double>(t.tv_nsec);
}

// PAGEDKV_CPU_ISA, or nullptr where it is unset or empty.
const char* isa_wanted() {
  const char* want = std::getenv("PAGEDKV_CPU_ISA");
  return want != nullptr && *want != '\0' ? want : nullptr;
}

size_t widest_allowed() {
  const char* want = isa_wanted();
  if (want == nullptr) return std::size(kIsas) - 1;
  size_t i = 0;
  while (i < std::size(kIsas) && std::strcmp(kIsas[i]->name, want) != 0) ++i;
  TORCH_CHECK_VALUE(i < std::size(kIsas), "PAGEDKV_CPU_ISA must be one of", kIsaNames,
                    " (or unset), got '", want, "'");
  TORCH_CHECK_VALUE(kIsas[i]->cpu_has(), "PAGEDKV_CPU_ISA=", want, ": this processor has no ",
                    want, " (or the build is for another architecture)");
  return i;
}

// The kernels of the widest instruction set this processor has whose vectors divide head_size
// (K's and V's: pass their gcd), at most the one PAGEDKV_CPU_ISA names (tests, benchmarks).
const AttentionKernels& select_kernels(int32_t head_size) {
  for (size_t i = widest_allowed(); i > 0; --i) {
    if (kIsas[i]->cpu_has() && head_size % kIsas[i]->lanes == 0) return *kIsas[i];
  }
  return *kIsas[0];  // the baseline: any processor, any head size the glue accepts
}

// Rounds of kind's probe on k for about `seconds` of a thread's CPU time, from a calibration
// run on this thread.
int64_t probe_iters(const AttentionKernels& k, int kind, double seconds) {
  for (int64_t iters = 1 << 12;; iters *= 4) {
    const double t0 = thread_cpu_seconds();
    k.peak_loop(kind, iters);
    const double t = thread_cpu_seconds() - t0;
    if (t > 2e-3 || iters > (int64_t{1} << 40))
      return std::max<int64_t>(1, static_cast<int64_t>(iters * seconds / t));
  }
}

// This thread's rate of `iters` rounds of kind's probe on k, in FLOP per second of its own CPU
// time.
double probe_rate(const AttentionKernels& k, int kind, int64_t iters) {
  const double t0 = thread_cpu_seconds();
  const int64_t flops = k.peak_loop(kind, iters);
  return static_cast<double>(flops) / (thread_cpu_seconds() - t0);
}

// Whether k's bfloat16 pair arithmetic (vdpbf16ps) pays over converting to floats and FMAs,
// measured once per process on the calling thread (the best of three 2 ms runs of each probe,
// alternating: about 15 ms). Zen 4 issues vdpbf16ps at twice its FMAs' FLOP rate; a 2-core
// Sapphire Rapids KVM guest measured 0.59 of it, and there bf16 prefill ran 1.5x faster on
// floats (docs/cpu_attention.md). Pairs unless they reach less than 0.8 of the FMAs.
bool dot_pairs_pay(const AttentionKernels& k) {
  static const bool pay = [&k] {
    const int64_t dot_iters = probe_iters(k, kPeakBf16Dot, 2e-3);
    const int64_t fma_iters = probe_iters(k, kPeakFma, 2e-3);
    double dot = 0, fma = 0;
    for (int i = 0; i < 3; ++i) {
      dot = std::max(dot, probe_rate(k, kPeakBf16Dot, dot_iters));
      fma = std::max(fma, probe_rate(k, kPeakFma, fma_iters));
    }
    return dot >= 0.8 * fma;
  }();
  return pay;
}

// k's bfloat16 prefill: pairs where the set has them and they pay (or PAGEDKV_CPU_ISA asks).
bool uses_pairs(const AttentionKernels& k) {
  return k.bf16_dot && (isa_wanted() != nullptr || dot_pairs_pay(k));
}

// Whether this process may run AMX-BF16 tiles: CPUID's AMX-TILE and AMX-BF16 bits, and Linux's
// grant of the tile data state (arch_prctl ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA, once per
// process: it covers every thread, those made later included).
bool amx_usable() {
  static const bool usable = [] {
#ifdef PAGEDKV_AMX_PROBE
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    if (__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx) == 0) return false;
    const bool tile = (edx >> 24) & 1u, bf16 = (edx >> 22) & 1u;
    constexpr long kReqXcompPerm = 0x1023, kXtiledata = 18;
    return tile && bf16 && syscall(SYS_arch_prctl, kReqXcompPerm, kXtiledata) == 0;
#else
    return false;
#endif
  }();
  return usable;
}

// k's bfloat16 prefill on AMX tiles: where PAGEDKV_CPU_AMX=1 asks and k has them (a processor
// without them is an error); unset or 0, never. Opt-in until the kernel has run on a processor
// with AMX: it was written and checked on emulated tiles (tests/cpu/amx_emulation.h).
bool uses_amx(const AttentionKernels& k) {
  const char* want = std::getenv("PAGEDKV_CPU_AMX");
  const bool set = want != nullptr && *want != '\0';
  TORCH_CHECK_VALUE(!set || std::strcmp(want, "0") == 0 || std::strcmp(want, "1") == 0,
                    "PAGEDKV_CPU_AMX must be 0 or 1 (or unset), got '", want, "'");
  if (!set || *want == '0') return false;
  TORCH_CHECK_VALUE(amx_usable(), "PAGEDKV_CPU_AMX=1: this processor has no AMX-BF16 tiles "
                    "(amx_tile, amx_bf16), or Linux does not grant their state");
  return k.attend_amx != nullptr;
}

struct Plan {
  std::vector<WorkItem> items;
  std::vector<SplitGroup> splits;
  int64_t num_slots = 0;
  int32_t rows_per_item = 0;
};

struct QueryTile {
  int32_t q_begin, q_count, key_begin, key_end;
};

// Calls f(tile) for every query tile of sequence s (none if it has no query).
template <typename F>
void for_each_tile_of(const PagedAttentionParams& p, int32_t s, int32_t q_tile, F&& f) {
  const int32_t L = p.seq_lens[s];
  const int32_t q_len = p.query_start_loc ? p.query_start_loc[s + 1] - p.query_start_loc[s] : 1;
  for (int32_t q0 = 0; q0 < q_len; q0 += q_tile) {
    const int32_t count = std::min(q_tile, q_len - q0);
    // The tile's queries sit at first_pos .. last_pos (all at L - 1 when not causal).
    const int32_t first_pos = p.query_pos(L, q_len, q0);
    const int32_t last_pos = p.query_pos(L, q_len, q0 + count - 1);
    const int32_t key_begin =
        p.sliding_window > 0 ? std::max(0, first_pos - p.sliding_window + 1) : 0;
    f(QueryTile{q0, count, std::min(key_begin, L), std::max(0, last_pos + 1)});
  }
}

// MLA (V narrower than K: one kv head of up to 128 query heads) cuts a group into head tiles
// of at most kMaxRowsPerItem rows; other attention keeps whole groups.
bool is_mla(const PagedAttentionParams& p) { return p.head_size_v != p.head_size; }

Plan plan_work(const PagedAttentionParams& p, int threads) {
  const int32_t group = p.num_heads / p.num_kv_heads;
  const bool decode = p.query_start_loc == nullptr;
  const int32_t heads_per_item = decode && !is_mla(p) ? p.num_kv_heads : 1;
  const int32_t head_tiles = is_mla(p) ? (group + kMaxRowsPerItem - 1) / kMaxRowsPerItem : 1;
  const int32_t tile_heads = (group + head_tiles - 1) / head_tiles;
  const int32_t q_tile =
      decode ? 1 : std::max(1, std::min(kMaxRowsPerItem / tile_heads, p.max_query_len));
  Plan plan;
  plan.rows_per_item = heads_per_item * tile_heads * q_tile;
  const int32_t head_items = p.num_kv_heads / heads_per_item * head_tiles;
  int64_t total_keys = 0;
  for (int32_t s = 0; s < p.num_seqs; ++s) {
    for_each_tile_of(p, s, q_tile, [&](const QueryTile& t) {
      total_keys += int64_t{t.key_end - t.key_begin} * head_items;
    });
  }
  const int64_t target = std::max<int64_t>(1, int64_t{kItemsPerThread} * threads);
  int64_t part = std::max<int64_t>(kMinKeysPerItem, (total_keys + target - 1) / target);
  part = (part + kKeysPerChunk - 1) / kKeysPerChunk * kKeysPerChunk;
  // Items in the order (sequence, kv head, head tile, query tile): the threads, taking them in
  // turn, work on the tiles of one kv head together, so that its K/V rows (every tile reads a
  // prefix of them) are read from L3 rather than memory.
  for (int32_t s = 0; s < p.num_seqs; ++s) {
    for (int32_t item_head = 0; item_head < head_items; ++item_head) {
      const int32_t h = item_head / head_tiles * heads_per_item;
      const int32_t q_head = item_head % head_tiles * tile_heads;
      const int32_t q_heads = std::min(tile_heads, group - q_head);
      for_each_tile_of(p, s, q_tile, [&](const QueryTile& t) {
        const int64_t keys = t.key_end - t.key_begin;
        const int32_t parts =
            static_cast<int32_t>(std::max<int64_t>(1, (keys + part - 1) / part));
        if (parts > 1) plan.splits.push_back({static_cast<int64_t>(plan.items.size()), parts});
        for (int32_t j = 0; j < parts; ++j) {
          const int32_t begin = static_cast<int32_t>(t.key_begin + j * part);
          const int32_t end = static_cast<int32_t>(std::min<int64_t>(t.key_end, begin + part));
          const int64_t slot = parts > 1 ? plan.num_slots++ : -1;
          plan.items.push_back(
              {s, h, heads_per_item, q_head, q_heads, t.q_begin, t.q_count, begin, end, slot});
        }
      });
    }
  }
  return plan;
}

// Runs f(worker, index, then) for index in [0, n) on every thread, each taking the next index;
// a thread takes its next one (then; n: none) as it starts one, so that f knows what it runs
// after this index and can ask for its memory.
template <typename F>
void run_dynamic(int64_t workers, int64_t n, F&& f) {
  std::atomic<int64_t> next{0};
  at::parallel_for(0, workers, 1, [&](int64_t begin, int64_t end) {
    for (int64_t worker = begin; worker < end; ++worker) {
      for (int64_t i = next++, then; i < n; i = then) {
        then = std::min<int64_t>(next++, n);
        f(worker, i, then);
      }
    }
  });
}

void paged_attention(const PagedAttentionParams& p, const at::Tensor& query) {
  if (p.num_tokens == 0 || p.num_heads == 0) return;
  const AttentionKernels& k = select_kernels(std::gcd(p.head_size, p.head_size_v));
  const bool amx = uses_amx(k), pairs = uses_pairs(k) || !k.bf16_dot;
  const int threads = at::get_num_threads();
  const Plan plan = plan_work(p, threads);
  const int64_t n = static_cast<int64_t>(plan.items.size());
  const int64_t workers = std::min<int64_t>(threads, n);
  const int64_t per_worker = (scratch_floats(plan.rows_per_item, p.head_size) + 15) / 16 * 16;
  at::Tensor scratch = at::empty({workers * per_worker}, query.options().dtype(at::kFloat));
  at::Tensor partial_out, partial_lse;
  Partials partials{nullptr, nullptr, plan.rows_per_item};
  if (plan.num_slots > 0) {
    const int64_t rows = plan.num_slots * plan.rows_per_item;
    partial_out = at::empty({rows * p.head_size_v}, scratch.options());
    partial_lse = at::empty({rows}, scratch.options());
    partials.out = partial_out.data_ptr<float>();
    partials.lse = partial_lse.data_ptr<float>();
  }
  float* scratch_base = scratch.data_ptr<float>();
  const auto attend = amx ? (pairs ? k.attend_amx : k.attend_amx_floats)
                          : (pairs ? k.attend : k.attend_floats);
  run_dynamic(workers, n, [&](int64_t worker, int64_t i, int64_t then) {
    WorkItem item = plan.items[i];
    item.then = then < n ? &plan.items[then] : nullptr;
    attend(p, item, scratch_base + worker * per_worker, partials);
  });
  const int64_t splits = static_cast<int64_t>(plan.splits.size());
  if (splits == 0) return;
  run_dynamic(std::min<int64_t>(threads, splits), splits, [&](int64_t, int64_t i, int64_t) {
    k.merge_partials(p, plan.items.data(), plan.splits[i], partials);
  });
}

void merge_attn_states(const MergeAttnParams& p, const at::Tensor&) {
  const AttentionKernels& k = select_kernels(p.head_size);
  const int64_t rows = p.num_tokens * p.num_heads;
  const int64_t grain = std::max<int64_t>(1, 16384 / p.head_size);
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    k.merge_attn_states(p, begin, end);
  });
}

}  // namespace

const char* attention_kernel_name(int32_t head_size) { return select_kernels(head_size).name; }

bool bf16_dot_products(int32_t head_size) { return uses_pairs(select_kernels(head_size)); }

bool amx_tiles(int32_t head_size) {
  return head_size % 32 == 0 && uses_amx(select_kernels(head_size));
}

double peak_gflops(const char* kind_name, double seconds) {
  const bool fp32 = std::strcmp(kind_name, "fp32") == 0;
  TORCH_CHECK_VALUE(fp32 || std::strcmp(kind_name, "bf16") == 0,
                    "cpu_peak_gflops: kind must be 'fp32' or 'bf16', got '", kind_name, "'");
  TORCH_CHECK_VALUE(seconds > 0 && seconds <= 10,
                    "cpu_peak_gflops: seconds must be in (0, 10], got ", seconds);
  const int kind = fp32 ? kPeakFma : kPeakBf16Dot;
  const AttentionKernels* k = nullptr;  // the widest allowed set this processor has for kind
  for (size_t i = widest_allowed() + 1; i-- > 0 && k == nullptr;) {
    if (kIsas[i]->cpu_has() && (fp32 || kIsas[i]->bf16_dot)) k = kIsas[i];
  }
  TORCH_CHECK_VALUE(k != nullptr, "cpu_peak_gflops: bf16 dot products need AVX512_BF16, which "
                    "this processor lacks (or PAGEDKV_CPU_ISA excludes avx512bf16)");
  const int64_t iters = probe_iters(*k, kind, seconds);
  const int threads = at::get_num_threads();
  std::vector<double> rates(threads, 0.0);
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) rates[i] = probe_rate(*k, kind, iters) / 1e9;
  });
  double total = 0;
  for (double r : rates) total += r;
  return total;
}

TORCH_LIBRARY_IMPL(pagedkv, CPU, m) {
  m.impl("paged_attention", &paged_attention_op<&paged_attention>);
  m.impl("merge_attn_states", &merge_attn_states_op<&merge_attn_states>);
  m.impl("mla_attention", &mla_attention_op<&paged_attention>);
}

}  // namespace pagedkv::cpu
