// Two versions of the CPU attention kernels (cpu/attention_kernels.inc) in one process, called
// alternately on the same batch, each call followed by a probe: on a shared machine whose speed
// drifts from minute to minute, the ratio of the two and each one's fraction of the probe stay
// comparable. Decode is followed by a read of 256 MiB (the bandwidth probe); prefill by 12
// independent chains of AVX2 FMAs on every thread for about 5 ms (the FMA probe). Built and run
// by bench/cpu_attention_ab.sh, which puts the two versions' kernel files in ab_a/ and ab_b/,
// each with a kernels.inc that includes the version's entry file.
//
//   cpu_attention_ab SEQS CONTEXT DTYPE(bf16|fp32) REPS THREADS [huge] [new=N] [kv=H]
//                    [rows=RA,RB]
//
// Batch: SEQS sequences of CONTEXT keys, 32 query heads / 8 kv heads (kv=H: H), head size 128,
// block size 16, blocks in shuffled order, random normal data; "huge" backs the caches with huge
// pages. Decode by default: one query per sequence, one item per sequence (all kv heads).
// new=N: chunked prefill, the last N positions of each sequence are its queries (causal), in
// items of one kv head and RA (version A) or RB (B) query rows, as each version's attention.cpp
// plans them (the script passes rows=), taken in the planner's order (sequence, kv head, query
// tile); with AB_A_TILE_ORDER set in the environment, version A's items are taken in the order
// planners before 6eb6b5d used, (sequence, query tile, kv head).
#include <immintrin.h>
#include <omp.h>
#include <sys/mman.h>
#include <time.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "cpu/attention_work.h"  // shared by both versions (WorkItem, Partials, scratch_floats)

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#define PKV_ISA 1
namespace pagedkv::cpu::version_a {
#include "ab_a/kernels.inc"
}
namespace pagedkv::cpu::version_b {
#include "ab_b/kernels.inc"
}
#pragma GCC pop_options

using namespace pagedkv;
using Clock = std::chrono::steady_clock;

namespace {

constexpr int kHeads = 32, kHeadSize = 128, kBlockSize = 16;

// Memory for a cache, 2 MiB aligned; with huge, advised to be backed by huge pages.
char* cache_memory(size_t bytes, bool huge) {
  const size_t page = size_t{2} << 20;
  char* p = static_cast<char*>(std::aligned_alloc(page, (bytes + page - 1) / page * page));
  if (huge) madvise(p, bytes, MADV_HUGEPAGE);
  return p;
}

// Random normal values as float32 or bfloat16 (round to nearest even).
void fill_normal(char* dst, size_t count, bool bf16, std::mt19937& rng) {
  std::normal_distribution<float> normal;
  for (size_t i = 0; i < count; ++i) {
    const float f = normal(rng);
    if (!bf16) {
      std::memcpy(dst + 4 * i, &f, 4);
      continue;
    }
    uint32_t u;
    std::memcpy(&u, &f, 4);
    const uint16_t h = static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1)) >> 16);
    std::memcpy(dst + 2 * i, &h, 2);
  }
}

float element(const std::vector<char>& out, size_t i, bool bf16) {
  float f;
  if (bf16) {
    const uint32_t u = uint32_t{reinterpret_cast<const uint16_t*>(out.data())[i]} << 16;
    std::memcpy(&f, &u, 4);
  } else {
    std::memcpy(&f, out.data() + 4 * i, 4);
  }
  return f;
}

// Sum of a 256 MiB buffer on every thread: the read bandwidth probe.
double probe(const std::vector<float>& buffer, int threads) {
  double total = 0;
#pragma omp parallel num_threads(threads) reduction(+ : total)
  {
    const size_t per = buffer.size() / threads;
    const float* b = buffer.data() + omp_get_thread_num() * per;
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (size_t i = 0; i < per; i += 32) {
      a0 = _mm256_add_ps(a0, _mm256_loadu_ps(b + i));
      a1 = _mm256_add_ps(a1, _mm256_loadu_ps(b + i + 8));
      a2 = _mm256_add_ps(a2, _mm256_loadu_ps(b + i + 16));
      a3 = _mm256_add_ps(a3, _mm256_loadu_ps(b + i + 24));
    }
    const __m256 s = _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3));
    total += s[0] + s[7];
  }
  return total;
}

// CPU seconds of this process (every thread) or of the calling thread.
double cpu_seconds(clockid_t clock = CLOCK_PROCESS_CPUTIME_ID) {
  timespec t;
  clock_gettime(clock, &t);
  return t.tv_sec + 1e-9 * t.tv_nsec;
}

// FMAs on every thread for about `seconds` (12 independent chains each): GFLOP per CPU second
// of a thread (so that time slices lost to other processes do not count), averaged.
double fma_probe(int threads, double seconds) {
  const int64_t iters = static_cast<int64_t>(seconds * 2.5e8);  // ~4 G rounds/s/thread at most
  double rate = 0;
#pragma omp parallel num_threads(threads) reduction(+ : rate)
  {
    const double t0 = cpu_seconds(CLOCK_THREAD_CPUTIME_ID);
    __m256 acc[12];
    for (int i = 0; i < 12; ++i) acc[i] = _mm256_set1_ps(0.01f * i);
    const __m256 a = _mm256_set1_ps(0.999f), b = _mm256_set1_ps(1e-3f);
    for (int64_t it = 0; it < iters; ++it) {
#pragma GCC unroll 12
      for (int i = 0; i < 12; ++i) acc[i] = _mm256_fmadd_ps(acc[i], a, b);
    }
    __m256 sum = acc[0];
    for (int i = 1; i < 12; ++i) sum = _mm256_add_ps(sum, acc[i]);
    volatile float sink = sum[0];
    (void)sink;
    rate += 12.0 * 8 * 2 * iters / (cpu_seconds(CLOCK_THREAD_CPUTIME_ID) - t0) / 1e9;
  }
  return rate / threads;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 6) {
    std::fprintf(stderr, "usage: %s SEQS CONTEXT bf16|fp32 REPS THREADS [huge]\n", argv[0]);
    return 2;
  }
  const int seqs = std::atoi(argv[1]), context = std::atoi(argv[2]);
  const bool bf16 = std::string(argv[3]) == "bf16";
  const int reps = std::atoi(argv[4]), threads = std::atoi(argv[5]);
  bool huge = false;
  int new_tokens = 0, kv_heads = 8, rows[2] = {64, 64};
  for (int i = 6; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "huge") huge = true;
    else if (arg.rfind("new=", 0) == 0) new_tokens = std::atoi(arg.c_str() + 4);
    else if (arg.rfind("kv=", 0) == 0) kv_heads = std::atoi(arg.c_str() + 3);
    else if (arg.rfind("rows=", 0) == 0)
      std::sscanf(arg.c_str() + 5, "%d,%d", &rows[0], &rows[1]);
    else { std::fprintf(stderr, "unknown argument %s\n", argv[i]); return 2; }
  }
  const bool prefill = new_tokens > 0;
  const int q_len = prefill ? new_tokens : 1;
  const int esz = bf16 ? 2 : 4;
  const int blocks_per_seq = (context + kBlockSize - 1) / kBlockSize;
  const int blocks = blocks_per_seq * seqs;
  const size_t cache_elems = size_t(blocks) * kv_heads * kBlockSize * kHeadSize;
  std::mt19937 rng(1);
  char* key_cache = cache_memory(cache_elems * esz, huge);
  char* value_cache = cache_memory(cache_elems * esz, huge);
  fill_normal(key_cache, cache_elems, bf16, rng);
  fill_normal(value_cache, cache_elems, bf16, rng);
  std::vector<int32_t> table(blocks), seq_lens(seqs, context);
  for (int i = 0; i < blocks; ++i) table[i] = i;
  std::shuffle(table.begin(), table.end(), rng);
  std::vector<char> query(size_t(seqs) * q_len * kHeads * kHeadSize * esz), out(query.size());
  std::vector<int32_t> query_start(seqs + 1);
  for (int s = 0; s <= seqs; ++s) query_start[s] = s * q_len;
  fill_normal(query.data(), query.size() / esz, bf16, rng);

  PagedAttentionParams p{};
  p.out = out.data();
  p.query = query.data();
  p.out_token_stride = p.q_token_stride = kHeads * kHeadSize;
  p.out_head_stride = p.q_head_stride = kHeadSize;
  const CacheStrides hnd{int64_t{kv_heads} * kBlockSize * kHeadSize, kBlockSize * kHeadSize,
                         kHeadSize};
  p.key_cache = PagedKVView{key_cache, hnd, kBlockSize};
  p.value_cache = PagedKVView{value_cache, hnd, kBlockSize};
  p.block_tables = table.data();
  p.block_table_stride = blocks_per_seq;
  p.seq_lens = seq_lens.data();
  p.num_seqs = seqs;
  p.num_tokens = seqs * q_len;
  if (prefill) p.query_start_loc = query_start.data();
  p.num_heads = kHeads;
  p.num_kv_heads = kv_heads;
  p.head_size = p.head_size_v = kHeadSize;
  p.num_blocks = blocks;
  p.max_blocks_per_seq = blocks_per_seq;
  p.max_seq_len = context;
  p.max_query_len = q_len;
  p.sliding_window = -1;
  p.scale = 1.f / std::sqrt(float(kHeadSize));
  p.dtype = p.cache_dtype = bf16 ? DType::kBFloat16 : DType::kFloat32;

  // Decode: one item per sequence (all kv heads). Prefill: per sequence, kv head and tile of
  // rows / group query tokens, keys up to the tile's last query. Taken by the threads in turn.
  const int group = kHeads / kv_heads;
  std::vector<cpu::WorkItem> items[2];
  for (int v = 0; v < 2; ++v) {
    const int tile = prefill ? std::max(1, rows[v] / group) : 1;
    for (int s = 0; s < seqs; ++s) {
      if (!prefill) {
        items[v].push_back({s, 0, kv_heads, 0, group, 0, 1, 0, context, -1});
        continue;
      }
      const auto push = [&](int h, int q0) {
        const int count = std::min(tile, q_len - q0);
        items[v].push_back({s, h, 1, 0, group, q0, count, 0, context - q_len + q0 + count, -1});
      };
      if (v == 0 && std::getenv("AB_A_TILE_ORDER") != nullptr) {
        for (int q0 = 0; q0 < q_len; q0 += tile)
          for (int h = 0; h < kv_heads; ++h) push(h, q0);
      } else {
        for (int h = 0; h < kv_heads; ++h)
          for (int q0 = 0; q0 < q_len; q0 += tile) push(h, q0);
      }
    }
  }
  const int64_t per_thread = cpu::scratch_floats(std::max({kHeads, rows[0], rows[1]}), kHeadSize);
  std::vector<float> scratch(per_thread * threads);
  const cpu::Partials partials{nullptr, nullptr, kHeads};
  const auto run = [&](int version) {
    const std::vector<cpu::WorkItem>& list = items[version];
    const int n = static_cast<int>(list.size());
#pragma omp parallel for num_threads(threads) schedule(dynamic)
    for (int i = 0; i < n; ++i) {
      float* sc = scratch.data() + omp_get_thread_num() * per_thread;
      if (version == 0) cpu::version_a::attend(p, list[i], sc, partials);
      else cpu::version_b::attend(p, list[i], sc, partials);
    }
  };
  std::vector<float> out_a(out.size() / esz);
  run(0);
  for (size_t i = 0; i < out_a.size(); ++i) out_a[i] = element(out, i, bf16);
  run(1);
  double max_diff = 0;
  for (size_t i = 0; i < out_a.size(); ++i)
    max_diff = std::max(max_diff, double(std::fabs(out_a[i] - element(out, i, bf16))));

  std::vector<float> probe_buffer(prefill ? 0 : size_t{64} << 20, 1.f);
  const double kv_bytes = 2.0 * seqs * context * kv_heads * kHeadSize * esz;
  const double probe_bytes = probe_buffer.size() * 4.0;
  double flops = 0;  // 4 D per (query head, visible key): S = Q K^T and O += P V
  for (int q = context - q_len; q < context; ++q) flops += 4.0 * kHeadSize * kHeads * (q + 1);
  flops *= seqs;
  std::vector<double> ms[2], cpu_ms[2], fraction[2], probe_rate;
  for (int r = 0; r < reps; ++r) {
    for (int i = 0; i < 2; ++i) {
      const int version = (r + i) % 2;  // alternating which one goes first
      const auto t0 = Clock::now();
      const double c0 = cpu_seconds();
      run(version);
      const double cpu = cpu_seconds() - c0;
      const auto t1 = Clock::now();
      const double op = std::chrono::duration<double>(t1 - t0).count();
      double rate;
      if (prefill) {  // per CPU second, both: the machine may be shared
        rate = fma_probe(threads, 5e-3);
        fraction[version].push_back(flops / cpu / 1e9 / rate);
      } else {
        volatile double sink = probe(probe_buffer, threads);
        (void)sink;
        const double pr = std::chrono::duration<double>(Clock::now() - t1).count();
        rate = probe_bytes / pr / 1e9;
        fraction[version].push_back((kv_bytes / op) / (probe_bytes / pr));
      }
      ms[version].push_back(op * 1e3);
      cpu_ms[version].push_back(cpu * 1e3);
      probe_rate.push_back(rate);
    }
  }
  if (prefill) {
    std::printf("%d x %d new over %d cached, %s, %d q / %d kv heads, %d threads%s, rows %d | %d, "
                "FMA probe %.1f GFLOP/s per CPU second (median of %d)\n", seqs, q_len,
                context - q_len, bf16 ? "bf16" : "fp32", kHeads, kv_heads, threads,
                huge ? ", huge pages" : "", rows[0], rows[1], median(probe_rate), reps * 2);
    for (int v = 0; v < 2; ++v)
      std::printf("  %s  %8.3f ms (%8.3f CPU ms)  %6.1f GFLOP/s  %6.1f per CPU second  %3.0f%% of "
                  "the FMA probe\n", v ? "B" : "A", median(ms[v]), median(cpu_ms[v]),
                  flops / median(ms[v]) / 1e6, flops / median(cpu_ms[v]) / 1e6,
                  100 * median(fraction[v]));
  } else {
    std::printf("%d x %d %s, %d threads%s, probe %.1f GB/s (median of %d)\n", seqs, context,
                bf16 ? "bf16" : "fp32", threads, huge ? ", huge pages" : "", median(probe_rate),
                reps * 2);
    for (int v = 0; v < 2; ++v)
      std::printf("  %s  %7.3f ms (%8.3f CPU ms)  %3.0f%% of the probe's bandwidth\n",
                  v ? "B" : "A", median(ms[v]), median(cpu_ms[v]), 100 * median(fraction[v]));
  }
  std::printf("  B / A %.3f (CPU time %.3f)   outputs differ by at most %.3g\n",
              median(ms[1]) / median(ms[0]), median(cpu_ms[1]) / median(cpu_ms[0]), max_diff);
  return 0;
}
