// Tensor-core instructions (see tensor_core.h): the per-lane entry points, which check the
// operands and wait in one warp collective, and the resolution of a whole warp's mma / ldmatrix
// by the last lane to arrive; cp.async queues per thread.
#include "simt/simt.h"

#include <cstring>
#include <string>

#include "simt/scheduler.h"

namespace simt::detail {
namespace {

constexpr unsigned kFullWarp = 0xffffffffu;

struct MmaLane {
  uint32_t a[4], b[2];
  float c[4], d[4];
};

struct LdmatrixLane {
  uint16_t row[8];  // the 16 bytes at this lane's address (lanes below 8 * num)
  uint32_t r[4];
};

std::string address(const void* p) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%p", p);
  return buf;
}

// mma and ldmatrix need every lane of the warp: a partial last warp of a block cannot run them.
void check_full_warp(Op op) {
  const Thread& t = *current_thread;
  const dim3 d = current_block->dim;
  const unsigned base = t.linear - t.linear % 32, lanes = d.x * d.y * d.z - base;
  if (lanes < 32) {
    fail(std::string(op_name(op)) + " needs all 32 lanes of the warp; warp " +
         std::to_string(base / 32) + " has " + std::to_string(lanes));
  }
}

// Whether [p, p + bytes) meets [lo, lo + lo_bytes) (as integers: p may be anything, even null).
bool overlaps(const void* p, size_t bytes, const void* lo, size_t lo_bytes) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p), l = reinterpret_cast<uintptr_t>(lo);
  return lo != nullptr && a < l + lo_bytes && a + bytes > l;
}

// Whether [p, p + bytes) lies inside [lo, lo + lo_bytes).
bool inside(const void* p, size_t bytes, const void* lo, size_t lo_bytes) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p), l = reinterpret_cast<uintptr_t>(lo);
  return a >= l && a + bytes <= l + lo_bytes;
}

// A shared-memory operand of `bytes` at p: 16-byte aligned, not on the thread's own stack (a
// local array), and either inside the dynamic shared memory or clear of it (static __shared__
// variables cannot be told from global memory here).
void check_shared(const char* what, const void* p, size_t bytes) {
  const Thread& t = *current_thread;
  const Block& b = *current_block;
  if (reinterpret_cast<uintptr_t>(p) % 16 != 0) {
    fail(what + std::string(": shared address ") + address(p) + " is not 16-byte aligned");
  }
  if (overlaps(p, bytes, t.stack_lo, size_t(t.stack_hi - t.stack_lo))) {
    fail(what + std::string(": address ") + address(p) +
         " is on the thread's stack, not in shared memory");
  }
  if (overlaps(p, bytes, b.dynamic_smem, b.dynamic_smem_bytes) &&
      !inside(p, bytes, b.dynamic_smem, b.dynamic_smem_bytes)) {
    fail(what + std::string(": ") + std::to_string(bytes) + " bytes at " + address(p) +
         " run past the dynamic shared memory (" + std::to_string(b.dynamic_smem_bytes) +
         " bytes)");
  }
}

float f16_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0) {  // zero or subnormal: man * 2^-24
    const float v = float(man) * 0x1p-24f;
    std::memcpy(&bits, &v, 4);
    bits |= sign;
  } else if (exp == 31) {  // inf or NaN
    bits = sign | 0x7f800000u | (man << 13);
  } else {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

float bf16_to_float(uint16_t h) {
  const uint32_t bits = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// The PTX ISA layouts of mma.m16n8k16 (f16 / bf16 operands, f32 accumulators): see tensor_core.h.
// The products of two 16-bit floats are exact in float; they are summed in float, k ascending,
// onto C (the hardware sums with its own internal order and precision: docs/simt.md). Rows of
// B, C and D are two vectors of 4 floats (the host's SIMD, element-wise the same arithmetic).
typedef float Float4 __attribute__((vector_size(16)));

template <bool kBf16>
void resolve_mma(void* const lanes[32]) {
  const auto cvt = kBf16 ? bf16_to_float : f16_to_float;
  float a[16][16];  // [m][k]
  Float4 b[16][2], d[16][2];  // B [k][n], C then D [m][n]: columns 0-3, 4-7
  for (unsigned l = 0; l < 32; ++l) {
    const MmaLane& x = *static_cast<const MmaLane*>(lanes[l]);
    const unsigned g = l / 4, t = l % 4;
    for (unsigned half = 0; half < 2; ++half) {
      const unsigned shift = 16 * half, n = 2 * t + half;
      a[g][2 * t + half] = cvt(uint16_t(x.a[0] >> shift));
      a[g + 8][2 * t + half] = cvt(uint16_t(x.a[1] >> shift));
      a[g][2 * t + 8 + half] = cvt(uint16_t(x.a[2] >> shift));
      a[g + 8][2 * t + 8 + half] = cvt(uint16_t(x.a[3] >> shift));
      b[2 * t + half][g / 4][g % 4] = cvt(uint16_t(x.b[0] >> shift));
      b[2 * t + 8 + half][g / 4][g % 4] = cvt(uint16_t(x.b[1] >> shift));
      d[g][n / 4][n % 4] = x.c[half];
      d[g + 8][n / 4][n % 4] = x.c[2 + half];
    }
  }
  for (unsigned m = 0; m < 16; ++m) {
    for (unsigned k = 0; k < 16; ++k) {
      d[m][0] += a[m][k] * b[k][0];
      d[m][1] += a[m][k] * b[k][1];
    }
  }
  for (unsigned l = 0; l < 32; ++l) {
    MmaLane& x = *static_cast<MmaLane*>(lanes[l]);
    const unsigned g = l / 4, t = l % 4;
    for (unsigned i = 0; i < 4; ++i) {
      const unsigned m = g + 8 * (i / 2), n = 2 * t + i % 2;
      x.d[i] = d[m][n / 4][n % 4];
    }
  }
}

// ldmatrix .m8n8 .b16: matrix i's rows are the records of lanes 8i .. 8i + 7.
void resolve_ldmatrix(int num, bool trans, void* const lanes[32]) {
  const auto rec = [&](unsigned l) -> const LdmatrixLane& {
    return *static_cast<const LdmatrixLane*>(lanes[l]);
  };
  for (unsigned l = 0; l < 32; ++l) {
    LdmatrixLane& out = *static_cast<LdmatrixLane*>(lanes[l]);
    const unsigned g = l / 4, t = l % 4;
    for (int i = 0; i < num; ++i) {
      const unsigned m = 8 * unsigned(i);
      const uint16_t lo = trans ? rec(m + 2 * t).row[g] : rec(m + g).row[2 * t];
      const uint16_t hi = trans ? rec(m + 2 * t + 1).row[g] : rec(m + g).row[2 * t + 1];
      out.r[i] = uint32_t(lo) | uint32_t(hi) << 16;
    }
  }
}

Op ldmatrix_op(int num, bool trans) {
  switch (num) {
    case 1: return trans ? Op::ldmatrix_x1_trans : Op::ldmatrix_x1;
    case 2: return trans ? Op::ldmatrix_x2_trans : Op::ldmatrix_x2;
    case 4: return trans ? Op::ldmatrix_x4_trans : Op::ldmatrix_x4;
  }
  fail("ldmatrix: the number of matrices must be 1, 2 or 4, got " + std::to_string(num));
}

void mma(Op op, float* d, const uint32_t* a, const uint32_t* b, const float* c) {
  check_full_warp(op);
  MmaLane lane;
  std::memcpy(lane.a, a, sizeof lane.a);
  std::memcpy(lane.b, b, sizeof lane.b);
  std::memcpy(lane.c, c, sizeof lane.c);
  warp_collective(op, kFullWarp, uint64_t(reinterpret_cast<uintptr_t>(&lane)), 0, 32);
  std::memcpy(d, lane.d, sizeof lane.d);
}

// Lands one copy: src_bytes from the source, zeros for the rest.
void land(const AsyncCopy& copy) {
  if (copy.src_bytes) std::memcpy(copy.dst, copy.src, copy.src_bytes);
  if (copy.src_bytes < 16) std::memset(copy.dst + copy.src_bytes, 0, 16 - copy.src_bytes);
}

}  // namespace

void resolve_matrix_op(Op op, void* const lanes[32]) {
  switch (op) {
    case Op::mma_f16: return resolve_mma<false>(lanes);
    case Op::mma_bf16: return resolve_mma<true>(lanes);
    case Op::ldmatrix_x1: return resolve_ldmatrix(1, false, lanes);
    case Op::ldmatrix_x2: return resolve_ldmatrix(2, false, lanes);
    case Op::ldmatrix_x4: return resolve_ldmatrix(4, false, lanes);
    case Op::ldmatrix_x1_trans: return resolve_ldmatrix(1, true, lanes);
    case Op::ldmatrix_x2_trans: return resolve_ldmatrix(2, true, lanes);
    case Op::ldmatrix_x4_trans: return resolve_ldmatrix(4, true, lanes);
    default: fail(std::string("not a matrix op: ") + op_name(op));
  }
}

void check_no_pending_copies(const Thread& t) {
  size_t open = 0;
  {
    const RaceIgnore ignore;
    if (t.async_copies.empty()) return;
    for (const AsyncCopy& c : t.async_copies) open += c.group == t.async_committed;
  }
  const size_t committed = t.async_copies.size() - open;
  fail("exited with " + std::to_string(t.async_copies.size()) + " cp.async copies pending (" +
       std::to_string(committed) + " in committed groups, " + std::to_string(open) +
       " never committed): a thread must retire its copies with cp.async.wait_group first");
}

}  // namespace simt::detail

namespace simt::ptx {

using detail::Op;

void mma_m16n8k16_f16(float* d, const uint32_t* a, const uint32_t* b, const float* c) {
  detail::mma(Op::mma_f16, d, a, b, c);
}

void mma_m16n8k16_bf16(float* d, const uint32_t* a, const uint32_t* b, const float* c) {
  detail::mma(Op::mma_bf16, d, a, b, c);
}

void ldmatrix(uint32_t* r, const void* smem_row, int num, bool trans) {
  const Op op = detail::ldmatrix_op(num, trans);
  detail::check_full_warp(op);
  detail::LdmatrixLane lane;
  const unsigned l = detail::current_thread->linear % 32;
  if (l < 8 * unsigned(num)) {  // this lane's row: read by this thread (the race checker sees it)
    detail::check_shared(detail::op_name(op), smem_row, 16);
    std::memcpy(lane.row, smem_row, 16);
  }
  detail::warp_collective(op, detail::kFullWarp, uint64_t(reinterpret_cast<uintptr_t>(&lane)),
                          0, 32);
  std::memcpy(r, lane.r, sizeof(uint32_t) * unsigned(num));
}

void cp_async_16(void* smem, const void* gmem, int src_bytes) {
  const char* what = "cp.async.cg.shared.global 16";
  if (src_bytes < 0 || src_bytes > 16) {
    detail::fail(what + std::string(": src_bytes must be in [0, 16], got ") +
                 std::to_string(src_bytes));
  }
  detail::check_shared(what, smem, 16);
  const detail::Block& b = *detail::current_block;
  detail::Thread& t = *detail::current_thread;
  if (reinterpret_cast<uintptr_t>(gmem) % 16 != 0) {
    detail::fail(what + std::string(": global address ") + detail::address(gmem) +
                 " is not 16-byte aligned");
  }
  // The bytes it reads: none when src_bytes is 0 (the zero-fill of a guarded copy: CUTLASS's
  // cp_async_zfill passes any address so), so its address may point anywhere.
  if (src_bytes > 0 &&
      (detail::overlaps(gmem, src_bytes, b.dynamic_smem, b.dynamic_smem_bytes) ||
       detail::overlaps(gmem, src_bytes, t.stack_lo, size_t(t.stack_hi - t.stack_lo)))) {
    detail::fail(what + std::string(": the source ") + detail::address(gmem) +
                 " is not global memory");
  }
  std::memset(smem, 0xff, 16);  // poison until the wait_group that lands the copy
  const detail::RaceIgnore ignore;  // the thread's queue is the emulator's bookkeeping
  t.async_copies.push_back(
      {static_cast<unsigned char*>(smem), static_cast<const unsigned char*>(gmem),
       uint32_t(src_bytes), t.async_committed});
}

void cp_async_commit() {
  const detail::RaceIgnore ignore;
  ++detail::current_thread->async_committed;
}

void cp_async_wait(int n) {
  if (n < 0) detail::fail("cp.async.wait_group: N must be >= 0, got " + std::to_string(n));
  detail::Thread& t = *detail::current_thread;
  size_t done = 0;
  for (;; ++done) {
    detail::AsyncCopy copy;
    {
      const detail::RaceIgnore ignore;
      // Groups older than the newest n committed ones land; an open group never does.
      if (done == t.async_copies.size() || t.async_copies[done].group + uint32_t(n) >=
                                               t.async_committed) {
        break;
      }
      copy = t.async_copies[done];
    }
    detail::land(copy);  // the thread's own write: the race checker sees it
  }
  const detail::RaceIgnore ignore;
  t.async_copies.erase(t.async_copies.begin(), t.async_copies.begin() + ptrdiff_t(done));
}

}  // namespace simt::ptx
