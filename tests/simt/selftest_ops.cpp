// torch.ops.pagedkv_simt_selftest: the emulator's self-test kernels (selftest.h) for CPU
// tensors, in a test-only library that tests/simt/selftest_build.py compiles against the
// emulator of pagedkv._simt. Emulator errors reach Python as RuntimeError with the simt message.
#include <torch/library.h>

#include <ATen/ATen.h>

#include "selftest.h"

namespace {

void check_input(const at::Tensor& t, const char* name, at::ScalarType dtype) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(t.scalar_type() == dtype, name, " must be ", dtype, ", got ", t.scalar_type());
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

// x [blocks, n] float32 -> [blocks]
at::Tensor block_sum(const at::Tensor& x, int64_t threads) {
  check_input(x, "x", at::kFloat);
  TORCH_CHECK(x.dim() == 2, "x must be [blocks, n]");
  auto out = at::empty({x.size(0)}, x.options());
  simt_selftest::block_sum(x.data_ptr<float>(), out.data_ptr<float>(), int(x.size(0)),
                           int(x.size(1)), int(threads));
  return out;
}

// x [nblocks, 32] float32 -> group_sums [nblocks, 4], max_sum [1]
std::tuple<at::Tensor, at::Tensor> warp_loop(const at::Tensor& x) {
  check_input(x, "x", at::kFloat);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == 32, "x must be [nblocks, 32]");
  auto group_sums = at::empty({x.size(0), 4}, x.options());
  auto max_sum = at::empty({1}, x.options());
  simt_selftest::warp_loop(x.data_ptr<float>(), group_sums.data_ptr<float>(),
                           max_sum.data_ptr<float>(), int(x.size(0)));
  return {group_sums, max_sum};
}

// x [rows, cols] float32 -> [cols, rows]
at::Tensor transpose(const at::Tensor& x) {
  check_input(x, "x", at::kFloat);
  TORCH_CHECK(x.dim() == 2, "x must be [rows, cols]");
  auto out = at::empty({x.size(1), x.size(0)}, x.options());
  simt_selftest::transpose(x.data_ptr<float>(), out.data_ptr<float>(), int(x.size(0)),
                           int(x.size(1)));
  return out;
}

// x [blocks, n] float32 -> each row reversed
at::Tensor reverse_blocks(const at::Tensor& x) {
  check_input(x, "x", at::kFloat);
  TORCH_CHECK(x.dim() == 2, "x must be [blocks, n]");
  auto out = at::empty_like(x);
  simt_selftest::reverse_blocks(x.data_ptr<float>(), out.data_ptr<float>(), int(x.size(0)),
                                int(x.size(1)));
  return out;
}

// -> [blocks, n] int32: the bits of dynamic shared memory before any write
at::Tensor read_poison(int64_t blocks, int64_t n) {
  auto out = at::empty({blocks, n}, at::kInt);
  simt_selftest::read_poison(reinterpret_cast<uint32_t*>(out.data_ptr<int32_t>()), int(blocks),
                             int(n));
  return out;
}

// x [n_vec * 8] float16 or bfloat16 -> y = x * x + x (same dtype), sums [n_vec] float32
std::tuple<at::Tensor, at::Tensor> vector_fma(const at::Tensor& x) {
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  check_input(x, "x", bf16 ? at::kBFloat16 : at::kHalf);
  TORCH_CHECK(x.numel() % 8 == 0, "x must hold a multiple of 8 values");
  auto y = at::empty_like(x);
  auto sums = at::empty({x.numel() / 8}, x.options().dtype(at::kFloat));
  simt_selftest::vector_fma(x.data_ptr(), y.data_ptr(), sums.data_ptr<float>(),
                            int(x.numel() / 8), bf16);
  return {y, sums};
}

// -> [gz, gy, gx, bz, by, bx, 4] int32 (see selftest.h)
at::Tensor grid3d(at::IntArrayRef grid, at::IntArrayRef block) {
  TORCH_CHECK(grid.size() == 3 && block.size() == 3, "grid and block must have 3 dims");
  const int g[3] = {int(grid[0]), int(grid[1]), int(grid[2])};
  const int b[3] = {int(block[0]), int(block[1]), int(block[2])};
  auto out = at::empty({g[2], g[1], g[0], b[2], b[1], b[0], 4}, at::kInt);
  simt_selftest::grid3d(out.data_ptr<int32_t>(), g, b);
  return out;
}

// pred [threads] int32 -> [threads, 6] int64 (see selftest.h)
at::Tensor votes(const at::Tensor& pred) {
  check_input(pred, "pred", at::kInt);
  std::vector<uint32_t> out(pred.numel() * 6);
  simt_selftest::votes(pred.data_ptr<int32_t>(), out.data(), int(pred.numel()));
  return at::tensor(std::vector<int64_t>(out.begin(), out.end()), at::kLong).view({-1, 6});
}

// -> [4] int32: count, max id, float count (as int), CAS count
at::Tensor atomics(int64_t blocks, int64_t threads) {
  auto counters = at::zeros({4}, at::kInt);
  simt_selftest::atomics(counters.data_ptr<int32_t>(), int(blocks), int(threads));
  const float fcount = reinterpret_cast<float*>(counters.data_ptr<int32_t>())[2];
  counters[2] = int(fcount);
  return counters;
}

// x [n] float32 -> [ceil(n / 32)] warp sums
at::Tensor partial_warp_sums(const at::Tensor& x) {
  check_input(x, "x", at::kFloat);
  auto out = at::empty({(x.numel() + 31) / 32}, x.options());
  simt_selftest::partial_warp_sums(x.data_ptr<float>(), out.data_ptr<float>(), int(x.numel()));
  return out;
}

// x [16] float32 -> [16]: lanes 0-14 read their neighbour, lane 15 an undefined value
at::Tensor shuffle_outside_mask(const at::Tensor& x) {
  check_input(x, "x", at::kFloat);
  TORCH_CHECK(x.numel() == 16, "x must hold 16 values");
  auto out = at::empty_like(x);
  simt_selftest::shuffle_outside_mask(x.data_ptr<float>(), out.data_ptr<float>());
  return out;
}

// x [n] float32 -> [n]: the racy neighbour read of missing_barrier_kernel
at::Tensor missing_barrier(const at::Tensor& x) {
  check_input(x, "x", at::kFloat);
  auto out = at::empty_like(x);
  simt_selftest::missing_barrier(x.data_ptr<float>(), out.data_ptr<float>(), int(x.numel()));
  return out;
}

// m [32, 8] int16 (raw 16-bit values) -> [32, num] int64: each lane's ldmatrix registers
at::Tensor ldmatrix_fragments(const at::Tensor& m, int64_t num, bool trans) {
  check_input(m, "m", at::kShort);
  TORCH_CHECK(m.numel() == 32 * 8, "m must be [32, 8]");
  TORCH_CHECK(num == 1 || num == 2 || num == 4, "num must be 1, 2 or 4, got ", num);
  std::vector<uint32_t> out(32 * 4, 0);
  simt_selftest::ldmatrix_fragments(reinterpret_cast<const uint16_t*>(m.data_ptr<int16_t>()),
                                    out.data(), int(num), trans);
  std::vector<int64_t> regs;
  for (int l = 0; l < 32; ++l) regs.insert(regs.end(), &out[l * 4], &out[l * 4 + num]);
  return at::tensor(regs, at::kLong).view({32, num});
}

// a [32, 4], b [32, 2] int32 (packed 16-bit pairs), c [32, 4] float32 -> d [32, 4] float32
at::Tensor mma_fragments(const at::Tensor& a, const at::Tensor& b, const at::Tensor& c,
                         bool bf16, int64_t permute) {
  check_input(a, "a", at::kInt);
  check_input(b, "b", at::kInt);
  check_input(c, "c", at::kFloat);
  TORCH_CHECK(a.numel() == 128 && b.numel() == 64 && c.numel() == 128,
              "a, b, c must be [32, 4], [32, 2], [32, 4]");
  auto d = at::empty({32, 4}, c.options());
  simt_selftest::mma_fragments(reinterpret_cast<const uint32_t*>(a.data_ptr<int32_t>()),
                               reinterpret_cast<const uint32_t*>(b.data_ptr<int32_t>()),
                               c.data_ptr<float>(), d.data_ptr<float>(), bf16, int(permute));
  return d;
}

// a [m, k] and b ([n, k], or [k, n] with b_kn) bfloat16 or float16 -> [m, n] float32
at::Tensor tile_matmul(const at::Tensor& a, const at::Tensor& b, bool b_kn, bool wait_after_use) {
  const bool bf16 = a.scalar_type() == at::kBFloat16;
  check_input(a, "a", bf16 ? at::kBFloat16 : at::kHalf);
  check_input(b, "b", a.scalar_type());
  TORCH_CHECK(a.dim() == 2 && b.dim() == 2, "a and b must be matrices");
  const int64_t m = a.size(0), k = a.size(1), n = b_kn ? b.size(1) : b.size(0);
  TORCH_CHECK((b_kn ? b.size(0) : b.size(1)) == k, "b must share k with a");
  auto c = at::empty({m, n}, a.options().dtype(at::kFloat));
  simt_selftest::tile_matmul(a.data_ptr(), b.data_ptr(), c.data_ptr<float>(), int(m), int(n),
                             int(k), bf16, b_kn, wait_after_use);
  return c;
}

// src [32, 16] int32 (4 chunks of 16 bytes a lane) -> [32, 7, 4] int32 snapshots (selftest.h)
at::Tensor cp_async_groups(const at::Tensor& src) {
  check_input(src, "src", at::kInt);
  TORCH_CHECK(src.numel() == 32 * 16, "src must be [32, 16]");
  auto out = at::empty({32, 7, 4}, src.options());
  simt_selftest::cp_async_groups(src.data_ptr(), out.data_ptr());
  return out;
}

// -> (error code, blocks that ran, the emulator's reason)
std::tuple<int64_t, int64_t, std::string> launch_config(at::IntArrayRef grid, at::IntArrayRef block,
                                                        int64_t smem, int64_t opt_in) {
  TORCH_CHECK(grid.size() == 3 && block.size() == 3, "grid and block must have 3 dims");
  const int g[3] = {int(grid[0]), int(grid[1]), int(grid[2])};
  const int b[3] = {int(block[0]), int(block[1]), int(block[2])};
  int32_t ran[2] = {0, 0};
  std::string message;
  const cudaError_t err =
      simt_selftest::launch_config(g, b, size_t(smem), int(opt_in), ran, &message);
  return {int64_t(err), ran[0], message};
}

// x [n] float32 -> y = x, copied by `blocks` blocks, coalesced or wastefully
at::Tensor copy(const at::Tensor& x, int64_t blocks, bool wasteful) {
  check_input(x, "x", at::kFloat);
  TORCH_CHECK(x.numel() % (32 * 128) == 0, "x must hold a multiple of 4096 values");
  auto y = at::empty_like(x);
  simt_selftest::copy(x.data_ptr<float>(), y.data_ptr<float>(), int(x.numel()), int(blocks),
                      wasteful);
  return y;
}

void run_fault(const std::string& name) { simt_selftest::run_fault(name); }
std::vector<std::string> fault_names() { return simt_selftest::fault_names(); }

// Memory faults only a sanitizer build reports ("read_past_end" or "misaligned"); without one
// the launch reads a value past a buffer (harmless on the host) and returns.
void memory_fault(const std::string& name) {
  std::vector<float> out(64);
  if (name == "read_past_end") {
    const std::vector<float> x(64, 1.0f);
    simt_selftest::read_past_end(x.data(), out.data(), 64);
  } else if (name == "misaligned") {
    alignas(16) const uint16_t x[16] = {};  // 16 halves
    simt_selftest::misaligned_vector_load(x, out.data());
  } else {
    TORCH_CHECK(false, "name must be read_past_end or misaligned, not '", name, "'");
  }
}

}  // namespace

TORCH_LIBRARY(pagedkv_simt_selftest, m) {
  m.def("block_sum(Tensor x, int threads) -> Tensor", &block_sum);
  m.def("warp_loop(Tensor x) -> (Tensor, Tensor)", &warp_loop);
  m.def("transpose(Tensor x) -> Tensor", &transpose);
  m.def("reverse_blocks(Tensor x) -> Tensor", &reverse_blocks);
  m.def("read_poison(int blocks, int n) -> Tensor", &read_poison);
  m.def("vector_fma(Tensor x) -> (Tensor, Tensor)", &vector_fma);
  m.def("grid3d(int[] grid, int[] block) -> Tensor", &grid3d);
  m.def("votes(Tensor pred) -> Tensor", &votes);
  m.def("atomics(int blocks, int threads) -> Tensor", &atomics);
  m.def("partial_warp_sums(Tensor x) -> Tensor", &partial_warp_sums);
  m.def("shuffle_outside_mask(Tensor x) -> Tensor", &shuffle_outside_mask);
  m.def("missing_barrier(Tensor x) -> Tensor", &missing_barrier);
  m.def("ldmatrix_fragments(Tensor m, int num, bool trans) -> Tensor", &ldmatrix_fragments);
  m.def("mma_fragments(Tensor a, Tensor b, Tensor c, bool bf16, int permute) -> Tensor",
        &mma_fragments);
  m.def("tile_matmul(Tensor a, Tensor b, bool b_kn, bool wait_after_use) -> Tensor",
        &tile_matmul);
  m.def("cp_async_groups(Tensor src) -> Tensor", &cp_async_groups);
  m.def("launch_config(int[] grid, int[] block, int smem, int opt_in) -> (int, int, str)",
        &launch_config);
  m.def("copy(Tensor x, int blocks, bool wasteful) -> Tensor", &copy);
  m.def("run_fault(str name) -> ()", &run_fault);
  m.def("fault_names() -> str[]", &fault_names);
  m.def("memory_fault(str name) -> ()", &memory_fault);
}
