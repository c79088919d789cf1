// Two versions of the CPU attention kernel (cpu/attention_kernel.h) in one process, called
// alternately on the same decode batch, each call followed by a read of 256 MiB (the bandwidth
// probe): on a shared machine whose bandwidth drifts from minute to minute, the ratio of the two
// and each one's fraction of the probe's bandwidth stay comparable. Built and run by
// bench/cpu_attention_ab.sh, which puts the two versions' headers in ab_a/ and ab_b/.
//
//   cpu_attention_ab SEQS CONTEXT DTYPE(bf16|fp32) REPS THREADS [huge]
//
// Batch: SEQS sequences of CONTEXT keys, 32 query heads / 8 kv heads, head size 128, block size
// 16, blocks in shuffled order, random normal data; "huge" backs the caches with huge pages.
#include <immintrin.h>
#include <omp.h>
#include <sys/mman.h>

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
#include "ab_a/attention_kernel.h"
}
namespace pagedkv::cpu::version_b {
#include "ab_b/attention_kernel.h"
}
#pragma GCC pop_options

using namespace pagedkv;
using Clock = std::chrono::steady_clock;

namespace {

constexpr int kHeads = 32, kKvHeads = 8, kHeadSize = 128, kBlockSize = 16;

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
  const bool huge = argc > 6 && std::string(argv[6]) == "huge";
  const int esz = bf16 ? 2 : 4;
  const int blocks_per_seq = (context + kBlockSize - 1) / kBlockSize;
  const int blocks = blocks_per_seq * seqs;
  const size_t cache_elems = size_t(blocks) * kKvHeads * kBlockSize * kHeadSize;
  std::mt19937 rng(1);
  char* key_cache = cache_memory(cache_elems * esz, huge);
  char* value_cache = cache_memory(cache_elems * esz, huge);
  fill_normal(key_cache, cache_elems, bf16, rng);
  fill_normal(value_cache, cache_elems, bf16, rng);
  std::vector<int32_t> table(blocks), seq_lens(seqs, context);
  for (int i = 0; i < blocks; ++i) table[i] = i;
  std::shuffle(table.begin(), table.end(), rng);
  std::vector<char> query(size_t(seqs) * kHeads * kHeadSize * esz), out(query.size());
  fill_normal(query.data(), query.size() / esz, bf16, rng);

  PagedAttentionParams p{};
  p.out = out.data();
  p.query = query.data();
  p.out_token_stride = p.q_token_stride = kHeads * kHeadSize;
  p.out_head_stride = p.q_head_stride = kHeadSize;
  const CacheStrides hnd{int64_t{kKvHeads} * kBlockSize * kHeadSize, kBlockSize * kHeadSize,
                         kHeadSize};
  p.key_cache = PagedKVView{key_cache, hnd, kBlockSize};
  p.value_cache = PagedKVView{value_cache, hnd, kBlockSize};
  p.block_tables = table.data();
  p.block_table_stride = blocks_per_seq;
  p.seq_lens = seq_lens.data();
  p.num_tokens = p.num_seqs = seqs;
  p.num_heads = kHeads;
  p.num_kv_heads = kKvHeads;
  p.head_size = kHeadSize;
  p.num_blocks = blocks;
  p.max_blocks_per_seq = blocks_per_seq;
  p.max_seq_len = context;
  p.max_query_len = 1;
  p.sliding_window = -1;
  p.scale = 1.f / std::sqrt(float(kHeadSize));
  p.dtype = p.cache_dtype = bf16 ? DType::kBFloat16 : DType::kFloat32;

  // One decode item per sequence (all kv heads), taken by the threads in turn.
  const int64_t per_thread = cpu::scratch_floats(kHeads, kHeadSize);
  std::vector<float> scratch(per_thread * threads);
  const cpu::Partials partials{nullptr, nullptr, kHeads};
  const auto run = [&](int version) {
#pragma omp parallel for num_threads(threads) schedule(dynamic)
    for (int s = 0; s < seqs; ++s) {
      const cpu::WorkItem w{s, 0, kKvHeads, 0, 1, 0, context, -1};
      float* sc = scratch.data() + omp_get_thread_num() * per_thread;
      if (version == 0) cpu::version_a::attend(p, w, sc, partials);
      else cpu::version_b::attend(p, w, sc, partials);
    }
  };
  std::vector<float> out_a(out.size() / esz);
  run(0);
  for (size_t i = 0; i < out_a.size(); ++i) out_a[i] = element(out, i, bf16);
  run(1);
  double max_diff = 0;
  for (size_t i = 0; i < out_a.size(); ++i)
    max_diff = std::max(max_diff, double(std::fabs(out_a[i] - element(out, i, bf16))));

  std::vector<float> probe_buffer(size_t{64} << 20, 1.f);
  const double kv_bytes = 2.0 * seqs * context * kKvHeads * kHeadSize * esz;
  const double probe_bytes = probe_buffer.size() * 4.0;
  std::vector<double> ms[2], fraction[2], probe_gbps;
  for (int r = 0; r < reps; ++r) {
    for (int i = 0; i < 2; ++i) {
      const int version = (r + i) % 2;  // alternating which one goes first
      const auto t0 = Clock::now();
      run(version);
      const auto t1 = Clock::now();
      volatile double sink = probe(probe_buffer, threads);
      (void)sink;
      const auto t2 = Clock::now();
      const double op = std::chrono::duration<double>(t1 - t0).count();
      const double pr = std::chrono::duration<double>(t2 - t1).count();
      ms[version].push_back(op * 1e3);
      fraction[version].push_back((kv_bytes / op) / (probe_bytes / pr));
      probe_gbps.push_back(probe_bytes / pr / 1e9);
    }
  }
  std::printf("%d x %d %s, %d threads%s, probe %.1f GB/s (median of %d)\n", seqs, context,
              bf16 ? "bf16" : "fp32", threads, huge ? ", huge pages" : "", median(probe_gbps),
              reps * 2);
  for (int v = 0; v < 2; ++v)
    std::printf("  %s  %7.3f ms  %3.0f%% of the probe's bandwidth\n", v ? "B" : "A", median(ms[v]),
                100 * median(fraction[v]));
  std::printf("  B / A %.3f   outputs differ by at most %.3g\n", median(ms[1]) / median(ms[0]),
              max_diff);
  return 0;
}
