// Torch-free emulator self-test (ctest): the self-test kernels (selftest.h) on the emulator of
// csrc/simt, in several fiber orders and worker counts, checked against host references, and
// every fault diagnosed.
// `simt_selftest --env ORDER SEED WORKERS` instead checks that PAGEDKV_SIMT_* were read;
// `simt_selftest --race` runs a kernel with a missing __syncthreads and `--early-read` one that
// reads cp.async destinations before its wait (for the TSan build),
// `--oob` and `--misaligned` kernels with memory faults (for the ASan + UBSan build).
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "simt/runtime.h"
#include "selftest.h"

namespace {

int failures = 0;

void expect(bool ok, const std::string& what) {
  if (!ok) {
    ++failures;
    std::printf("FAIL: %s\n", what.c_str());
  }
}

std::vector<float> integers(size_t n, int high) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = float((i * 7919 + 13) % high);
  return v;
}

void check_kernels(const std::string& tag) {
  {
    const int blocks = 5, n = 1000;
    const auto x = integers(blocks * n, 9);
    for (int threads : {32, 256, 1024}) {
      std::vector<float> out(blocks);
      simt_selftest::block_sum(x.data(), out.data(), blocks, n, threads);
      for (int b = 0; b < blocks; ++b) {
        float s = 0;
        for (int i = 0; i < n; ++i) s += x[b * n + i];
        expect(out[b] == s, tag + " block_sum threads " + std::to_string(threads));
      }
    }
  }
  for (int nblocks : {1, 7, 13}) {
    const auto x = integers(nblocks * 32, 50);
    std::vector<float> sums(nblocks * 4), max_sum(1);
    simt_selftest::warp_loop(x.data(), sums.data(), max_sum.data(), nblocks);
    float m = -INFINITY;
    for (int g = 0; g < nblocks * 4; ++g) {
      float s = 0;
      for (int l = 0; l < 8; ++l) s += x[g * 8 + l];
      expect(sums[g] == s, tag + " warp_loop group sum");
      m = std::fmax(m, s);
    }
    expect(max_sum[0] == m, tag + " warp_loop max");
  }
  {
    const int rows = 59, cols = 97;
    const auto x = integers(rows * cols, 1000);
    std::vector<float> out(rows * cols);
    simt_selftest::transpose(x.data(), out.data(), rows, cols);
    bool ok = true;
    for (int r = 0; r < rows; ++r)
      for (int c = 0; c < cols; ++c) ok &= out[c * rows + r] == x[r * cols + c];
    expect(ok, tag + " transpose");
  }
  {
    const int blocks = 3, n = 33;
    const auto x = integers(blocks * n, 100);
    std::vector<float> out(blocks * n);
    simt_selftest::reverse_blocks(x.data(), out.data(), blocks, n);
    bool ok = true;
    for (int b = 0; b < blocks; ++b)
      for (int t = 0; t < n; ++t) ok &= out[b * n + t] == x[b * n + n - 1 - t];
    expect(ok, tag + " reverse_blocks");
    std::vector<uint32_t> poison(2 * 64, 0);
    simt_selftest::read_poison(poison.data(), 2, 64);
    bool all = true;
    for (uint32_t p : poison) all &= p == 0xffffffffu;
    expect(all, tag + " dynamic shared memory poisoned before each block");
  }
  {
    const int n_vec = 100;
    std::vector<__half> x(n_vec * 8), y(n_vec * 8);
    for (int i = 0; i < n_vec * 8; ++i) x[i] = __float2half(float(i % 17) * 0.25f - 2.0f);
    std::vector<float> sums(n_vec);
    simt_selftest::vector_fma(x.data(), y.data(), sums.data(), n_vec, false);
    bool ok = true;
    for (int i = 0; i < n_vec * 8; ++i) {
      const float v = __half2float(x[i]);
      ok &= __half2float(y[i]) == __half2float(__float2half(v * v + v));
    }
    expect(ok, tag + " vector_fma half");
  }
  {
    const int grid[3] = {3, 2, 2}, block[3] = {4, 2, 3};
    std::vector<int32_t> out(3 * 2 * 2 * 4 * 2 * 3 * 4);
    simt_selftest::grid3d(out.data(), grid, block);
    const int32_t* last = &out[out.size() - 4];
    expect(last[0] == 2 + 16 * 1 + 256 * 1 && last[1] == 3 + 16 * 1 + 256 * 2 &&
               last[2] == 3 + 16 * 2 + 256 * 2 && last[3] == 4 + 16 * 2 + 256 * 3,
           tag + " grid3d");
  }
  {
    std::vector<int32_t> pred(64);
    for (int i = 0; i < 64; ++i) pred[i] = i % 3 == 0 || i >= 32;
    std::vector<uint32_t> out(64 * 6);
    simt_selftest::votes(pred.data(), out.data(), 64);
    uint32_t warp0 = 0;
    for (int i = 0; i < 32; i += 3) warp0 |= 1u << i;
    expect(out[0] == warp0 && out[32 * 6] == 0xffffffffu && out[2] == 0 && out[32 * 6 + 2] == 1 &&
               out[3] == 43 && out[4] == 0 && out[5] == 1,
           tag + " votes");
  }
  for (int n : {48, 70, 96}) {
    const auto x = integers(n, 10);
    std::vector<float> out((n + 31) / 32);
    simt_selftest::partial_warp_sums(x.data(), out.data(), n);
    for (int w = 0; w < (n + 31) / 32; ++w) {
      float s = 0;
      for (int i = 32 * w; i < std::min(n, 32 * w + 32); ++i) s += x[i];
      expect(out[w] == s, tag + " partial_warp_sums n " + std::to_string(n));
    }
  }
  {
    const auto x = integers(16, 10);
    std::vector<float> out(16);
    simt_selftest::shuffle_outside_mask(x.data(), out.data());
    uint32_t bits;
    std::memcpy(&bits, &out[15], sizeof bits);
    expect(out[0] == x[1] && out[14] == x[15] && bits == 0xffffffffu, tag + " shuffle_outside_mask");
  }
  {
    std::vector<int32_t> counters(4, 0);
    simt_selftest::atomics(counters.data(), 16, 128);
    float fcount;
    std::memcpy(&fcount, &counters[2], sizeof fcount);
    expect(counters[0] == 2048 && counters[1] == 2047 && fcount == 2048.0f && counters[3] == 2048,
           tag + " atomics");
  }
}

// ---- tensor-core instructions, checked against the PTX ISA layouts written out here ----------

// Values k / 64 with |k| < 128: exact in bf16 and f16, and so are the products and the sums of
// the tests below in float, which makes every expected result exact.
float small_value(size_t i, uint32_t salt) {
  return float(int((i * 2654435761u + salt) >> 7 & 255) - 128) / 64.0f;
}

uint16_t bits16(float v, bool bf16) {
  uint16_t out;
  if (bf16) {
    const __nv_bfloat16 h = __float2bfloat16_rn(v);
    std::memcpy(&out, &h, 2);
  } else {
    const __half h = __float2half_rn(v);
    std::memcpy(&out, &h, 2);
  }
  return out;
}

void check_ldmatrix(const std::string& tag) {
  std::vector<uint16_t> m(32 * 8);
  for (size_t i = 0; i < m.size(); ++i) m[i] = uint16_t(i * 40503u + 7u);  // all distinct
  for (int num : {1, 2, 4}) {
    for (bool trans : {false, true}) {
      std::vector<uint32_t> out(32 * 4);
      simt_selftest::ldmatrix_fragments(m.data(), out.data(), num, trans);
      bool ok = true;
      for (int l = 0; l < 32; ++l) {
        for (int i = 0; i < num; ++i) {
          uint32_t want = 0;
          for (int h = 0; h < 2; ++h) {  // element (l / 4, 2 * (l % 4) + h) of matrix i (or M^T)
            const int row = l / 4, col = 2 * (l % 4) + h;
            const uint16_t e = trans ? m[(8 * i + col) * 8 + row] : m[(8 * i + row) * 8 + col];
            want |= uint32_t(e) << (16 * h);
          }
          ok &= out[l * 4 + i] == want;
        }
      }
      expect(ok, tag + " ldmatrix x" + std::to_string(num) + (trans ? ".trans" : ""));
    }
  }
}

// mma.m16n8k16 fragments as the PTX ISA states them, element by element:
//   A: a_i, i < 8: row g (i < 2 or 4 <= i < 6) else g + 8; col 2t + (i & 1) (+ 8 for i >= 4)
//   B: b_i, i < 4: row 2t + (i & 1) (+ 8 for i >= 2); col g
//   C/D: c_i, i < 4: row g (+ 8 for i >= 2); col 2t + (i & 1)
// register i / 2 holds elements i (low half) and i + 1 for A and B.
void check_mma(const std::string& tag) {
  for (bool bf16 : {false, true}) {
    float a[16][16], b[16][8], c[16][8];
    for (int i = 0; i < 256; ++i) a[i / 16][i % 16] = small_value(i, 1);
    for (int i = 0; i < 128; ++i) b[i / 8][i % 8] = small_value(i, 2);
    for (int i = 0; i < 128; ++i) c[i / 8][i % 8] = small_value(i, 3) * 8.0f;
    std::vector<uint32_t> ra(32 * 4, 0), rb(32 * 2, 0);
    std::vector<float> rc(32 * 4), rd(32 * 4);
    for (int l = 0; l < 32; ++l) {
      const int g = l >> 2, t = l % 4;
      for (int i = 0; i < 8; ++i) {
        const int row = (i < 2 || (i >= 4 && i < 6)) ? g : g + 8;
        const int col = 2 * t + (i & 1) + (i >= 4 ? 8 : 0);
        ra[l * 4 + i / 2] |= uint32_t(bits16(a[row][col], bf16)) << (16 * (i % 2));
      }
      for (int i = 0; i < 4; ++i) {
        const int row = 2 * t + (i & 1) + (i >= 2 ? 8 : 0);
        rb[l * 2 + i / 2] |= uint32_t(bits16(b[row][g], bf16)) << (16 * (i % 2));
      }
      for (int i = 0; i < 4; ++i) rc[l * 4 + i] = c[g + (i >= 2 ? 8 : 0)][2 * t + (i & 1)];
    }
    const std::string what = tag + (bf16 ? " mma bf16" : " mma f16");
    for (int permute : {0, 1, 2}) {
      simt_selftest::mma_fragments(ra.data(), rb.data(), rc.data(), rd.data(), bf16, permute);
      int wrong = 0;
      for (int l = 0; l < 32; ++l) {
        const int g = l >> 2, t = l % 4;
        for (int i = 0; i < 4; ++i) {
          const int row = g + (i >= 2 ? 8 : 0), col = 2 * t + (i & 1);
          double want = c[row][col];
          for (int k = 0; k < 16; ++k) want += double(a[row][k]) * b[k][col];
          wrong += rd[l * 4 + i] != float(want);
        }
      }
      if (permute == 0) {
        expect(wrong == 0, what + ": " + std::to_string(wrong) + " wrong elements");
      } else {  // a kernel with a wrong fragment mapping must fail the same check
        expect(wrong > 0, what + ": fragment permutation " + std::to_string(permute) + " passed");
      }
    }
  }
}

void check_tile_matmul(const std::string& tag) {
  for (bool bf16 : {false, true}) {
    for (bool b_kn : {false, true}) {
      const int m = 70, n = 32, k = 48;  // 70: a partial block tile, zero-filled rows
      std::vector<uint16_t> a(m * k), b(n * k);
      std::vector<float> af(m * k), bf(n * k);  // bf as [k][n]
      for (int i = 0; i < m * k; ++i) {
        af[i] = small_value(i, 4);
        a[i] = bits16(af[i], bf16);
      }
      for (int kk = 0; kk < k; ++kk) {
        for (int j = 0; j < n; ++j) {
          bf[kk * n + j] = small_value(kk * n + j, 5);
          b[b_kn ? kk * n + j : j * k + kk] = bits16(bf[kk * n + j], bf16);
        }
      }
      const std::string what = tag + " tile_matmul" + (bf16 ? " bf16" : " f16") +
                               (b_kn ? " [k, n] (ldmatrix.trans)" : " [n, k]");
      for (bool wait_after_use : {false, true}) {
#if defined(__SANITIZE_THREAD__)  // a race by design: see --early-read
        if (wait_after_use) continue;
#endif
        std::vector<float> c(m * n, -1.0f);
        simt_selftest::tile_matmul(a.data(), b.data(), c.data(), m, n, k, bf16, b_kn,
                                   wait_after_use);
        int wrong = 0, nan = 0;
        for (int i = 0; i < m; ++i) {
          for (int j = 0; j < n; ++j) {
            double want = 0;
            for (int kk = 0; kk < k; ++kk) want += double(af[i * k + kk]) * bf[kk * n + j];
            wrong += c[i * n + j] != float(want);
            nan += std::isnan(c[i * n + j]);
          }
        }
        if (!wait_after_use) {
          expect(wrong == 0, what + ": " + std::to_string(wrong) + " wrong elements");
        } else {  // computing before cp.async.wait_group reads the poison
          expect(nan > 0, what + ": reading before the wait went unnoticed");
        }
      }
    }
  }
}

void check_cp_async(const std::string& tag) {
  std::vector<uint32_t> src(32 * 4 * 4), out(32 * 7 * 4, 0);
  for (size_t i = 0; i < src.size(); ++i) src[i] = uint32_t(i * 2654435761u + 1);
  simt_selftest::cp_async_groups(src.data(), out.data());
  const auto chunk = [&](int l, int j) { return &src[(l * 4 + j) * 4]; };
  bool ok = true;
  for (int l = 0; l < 32; ++l) {
    const uint32_t* o = &out[l * 7 * 4];
    const uint32_t poison[4] = {~0u, ~0u, ~0u, ~0u}, zeros[4] = {0, 0, 0, 0};
    const uint32_t half[4] = {chunk(l, 3)[0], chunk(l, 3)[1], 0, 0};
    const uint32_t* want[7] = {poison, chunk(l, 0), poison, chunk(l, 1), zeros, poison, half};
    for (int s = 0; s < 7; ++s) ok &= std::memcmp(o + s * 4, want[s], 16) == 0;
  }
  expect(ok, tag + " cp.async groups, zfill and poison before the wait");
}

// What each fault's message must contain (pytest checks the whole text).
const std::map<std::string, std::string> kFaults = {
    {"absent_lane", "names lanes absent from warp 1, which has 16 lanes"},
    {"assert", "thread (7,0,0): assertion failed: threadIdx.x != 7"},
    {"barrier_after_exit", "__syncthreads reached by some threads while others exited: "
                           "t0-63: __syncthreads, t64-127: exited"},
    {"deadlock", "deadlock: t0-15: __shfl_sync(0xffffffff), t16-31: __syncthreads"},
    {"disagree_mask", "disagree on a warp collective: t0-15: __shfl_xor_sync(0xffffffff), "
                      "t16-31: __shfl_xor_sync(0xffff0001)"},
    {"disagree_op", "disagree on a warp collective: t0-15: __shfl_xor_sync(0xffffffff), "
                    "t16-31: __shfl_down_sync(0xffffffff)"},
    {"mask_excludes_caller", "the mask must include the calling lane"},
    {"oversized_block", "block has 2048 threads, more than 1024"},
    {"shuffle_exited_lane", "waits for lane 16, which exited: "
                            "t0-15: __shfl_xor_sync(0xffffffff), t16-31: exited"},
    {"trap", "block (1,0,0), thread (5,0,0): __trap() called"},
    {"mma_partial_warp", "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 needs all 32 "
                         "lanes of the warp; warp 1 has 16"},
    {"mma_divergent", "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32(0xffffffff) in warp 0 "
                      "waits for lane 16, which exited"},
    {"mma_disagree", "disagree on a warp collective: "
                     "t0-15: mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32(0xffffffff), "
                     "t16-31: mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32(0xffffffff)"},
    {"cp_async_pending_at_exit", "exited with 2 cp.async copies pending (1 in committed groups, "
                                 "1 never committed)"},
    {"cp_async_misaligned", "cp.async.cg.shared.global 16: global address"},
    {"ldmatrix_misaligned", "ldmatrix.sync.aligned.m8n8.x4.shared.b16: shared address"},
    {"ldmatrix_local", "is on the thread's stack, not in shared memory"},
    {"ldmatrix_past_dynamic_smem", "thread (15,0,0): ldmatrix.sync.aligned.m8n8.x2.shared.b16: "
                                   "16 bytes at"},
};

void check_faults(const std::string& tag) {
  expect(simt_selftest::fault_names().size() == kFaults.size(), tag + " fault list");
  for (const auto& [name, text] : kFaults) {
    std::string what = "(no exception)";
    try {
      simt_selftest::run_fault(name);
    } catch (const simt::Error& e) {
      what = e.what();
    }
    expect(what.find(text) != std::string::npos, tag + " fault " + name + ": got " + what);
  }
}

void check_missing_barrier(const std::string& order) {
  const int n = 64;
  std::vector<float> x(n), out(n);
  for (int i = 0; i < n; ++i) x[i] = float(i + 1);
  simt_selftest::missing_barrier(x.data(), out.data(), n);
  int wrong = 0;
  for (int t = 0; t < n; ++t) wrong += out[t] != x[t + 1 < n ? t + 1 : t];
  const int expected = order == "forward" ? n - 1 : 0;
  if (order != "random") {
    expect(wrong == expected, order + " missing_barrier wrong reads " + std::to_string(wrong));
  } else {
    expect(wrong > 0, "random missing_barrier caught");
  }
}

// A forked child (whose parent's worker threads do not exist there) launches normally.
void check_fork() {
  simt::set_workers(2);
  std::vector<float> x(4 * 100, 1.0f), out(4);
  simt_selftest::block_sum(x.data(), out.data(), 4, 100, 64);  // the parent's pool runs
  const pid_t pid = fork();
  if (pid == 0) {
    simt_selftest::block_sum(x.data(), out.data(), 4, 100, 64);
    _exit(out[3] == 100.0f ? 0 : 1);
  }
  int status = -1;
  waitpid(pid, &status, 0);
  expect(WIFEXITED(status) && WEXITSTATUS(status) == 0, "launch in a forked child");
}

int check_env(const char* order, const char* seed, const char* workers) {
  static const char* names[] = {"forward", "reverse", "random"};
  expect(names[int(simt::order())] == std::string(order), "PAGEDKV_SIMT_ORDER");
  expect(simt::seed() == std::strtoull(seed, nullptr, 0), "PAGEDKV_SIMT_SEED");
  expect(simt::workers() == std::atoi(workers), "PAGEDKV_SIMT_WORKERS");
  return failures != 0;
}

}  // namespace

// `--race`: the missing-barrier kernel once; a TSan build must report the data race.
int run_race() {
  std::vector<float> x(64, 1.0f), out(64);
  simt::set_order("forward", 0);
  simt_selftest::missing_barrier(x.data(), out.data(), 64);
  return 0;
}

// `--early-read`: a kernel computing on cp.async destinations before its wait_group; a TSan
// build must report the race between the landing copy and another thread's ldmatrix.
int run_early_read() {
  const int m = 64, n = 16, k = 32;
  std::vector<uint16_t> a(m * k, 0x3c00), b(n * k, 0x3c00);  // ones in f16
  std::vector<float> c(m * n);
  simt::set_order("forward", 0);
  simt_selftest::tile_matmul(a.data(), b.data(), c.data(), m, n, k, false, false, true);
  return 0;
}

// `--oob` / `--misaligned`: memory faults for the ASan + UBSan build to report.
int run_memory_fault(const std::string& which) {
  std::vector<float> out(64);
  if (which == "--oob") {
    std::vector<float> x(64, 1.0f);
    simt_selftest::read_past_end(x.data(), out.data(), 64);
  } else {
    alignas(16) __half x[16] = {};
    simt_selftest::misaligned_vector_load(x, out.data());
  }
  return 0;
}

int main(int argc, char** argv) {
  if (argc == 5 && std::string(argv[1]) == "--env") return check_env(argv[2], argv[3], argv[4]);
  if (argc == 2 && std::string(argv[1]) == "--race") return run_race();
  if (argc == 2 && std::string(argv[1]) == "--early-read") return run_early_read();
  if (argc == 2 && (std::string(argv[1]) == "--oob" || std::string(argv[1]) == "--misaligned")) {
    return run_memory_fault(argv[1]);
  }
  struct Config {
    const char* order;
    uint64_t seed;
    int workers;
  };
  for (const Config& c : {Config{"forward", 0, 1}, Config{"reverse", 0, 1},
                          Config{"random", 1, 1}, Config{"random", 2, 2}}) {
    simt::set_order(c.order, c.seed);
    simt::set_workers(c.workers);
    const std::string tag = std::string(c.order) + "/" + std::to_string(c.seed) + "/" +
                            std::to_string(c.workers);
    check_kernels(tag);
    check_ldmatrix(tag);
    check_mma(tag);
    check_tile_matmul(tag);
    check_cp_async(tag);
    check_faults(tag);
#if !defined(__SANITIZE_THREAD__)  // a race by design: see --race
    check_missing_barrier(c.order);
#endif
  }
#if !defined(__SANITIZE_THREAD__)  // TSan cannot start threads after a multi-threaded fork
  check_fork();
#endif
  std::printf("%s\n", failures ? "simt self-test FAILED" : "simt self-test passed");
  return failures != 0;
}
