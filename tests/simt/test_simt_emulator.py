"""Self-tests of the simt emulator: small CUDA kernels (tests/simt/selftest_*.cpp, built by
selftest_lib.py against the emulator of pagedkv._simt) run as fibers on the CPU, in several
fiber orders and worker counts, each checked exactly; the emulator's controls; and, in the
sanitizer run (`make sanitize`), that ASan + UBSan report memory faults."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import ROOT, SIMT_SANITIZE

simt = pytest.importorskip("pagedkv.ops.simt")
if not simt.available():
    pytest.skip("pagedkv._simt is not built (no CUDA toolkit headers)", allow_module_level=True)


def integers(*shape, high=9):
    return torch.randint(0, high, shape, generator=torch.Generator().manual_seed(0)).float()


@pytest.mark.parametrize("threads", [32, 256, 1024])
def test_two_level_reduction(order, threads, ops):
    x = integers(5, 1000)
    assert torch.equal(ops.block_sum(x, threads), x.sum(1))


@pytest.mark.parametrize("nblocks", [1, 4, 7, 13])
def test_divergent_warp_loop(order, nblocks, ops):
    x = integers(nblocks, 32)
    group_sums, max_sum = ops.warp_loop(x)
    expected = x.view(nblocks, 4, 8).sum(2)
    assert torch.equal(group_sums, expected)
    assert max_sum.item() == expected.max().item()


def test_launches_that_follow_each_other(order, ops):
    for nblocks in [7, 13, 2, 5]:  # warps loop 2, 4, 1, 2 times: uneven across launches
        x = integers(nblocks, 32, high=100 + nblocks)
        assert torch.equal(ops.warp_loop(x)[0], x.view(nblocks, 4, 8).sum(2))
        y = integers(3, 333)
        assert torch.equal(ops.block_sum(y, 128), y.sum(1))


@pytest.mark.parametrize("shape", [(59, 97), (32, 32), (1, 5)])
def test_tiled_shared_memory_transpose(order, shape, ops):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    assert torch.equal(ops.transpose(x), x.t())


@pytest.mark.parametrize("n", [1, 33, 256])
def test_dynamic_shared_memory(order, n, ops):
    x = torch.randn(3, n, generator=torch.Generator().manual_seed(2))
    assert torch.equal(ops.reverse_blocks(x), x.flip(1))


def test_dynamic_shared_memory_is_poisoned_before_each_block(order, ops):
    assert torch.equal(ops.read_poison(3, 64), torch.full((3, 64), -1, dtype=torch.int32))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_vector_loads_16_bytes(order, dtype, ops):
    x = torch.randn(8 * 100, generator=torch.Generator().manual_seed(3)).to(dtype)
    y, sums = ops.vector_fma(x)
    xf = x.float()
    assert torch.equal(y, (xf * xf + xf).to(dtype))  # a*b is exact in float: one rounding
    pairs = xf.view(-1, 4, 2)
    expected = torch.zeros(100)
    for k in range(4):
        expected = expected + (pairs[:, k, 0] + pairs[:, k, 1])
    assert torch.equal(sums, expected)


@pytest.mark.parametrize(
    "grid,block", [((3, 2, 2), (4, 2, 3)), ((1, 1, 1), (1, 1, 1)), ((2, 1, 3), (32, 1, 2))]
)
def test_3d_grid_and_block(order, grid, block, ops):
    out = ops.grid3d(list(grid), list(block))

    def pack(x, y, z):
        return x + 16 * y + 256 * z

    gz, gy, gx, bz, by, bx = out.shape[:6]
    for bi in [(0, 0, 0), (gx - 1, gy - 1, gz - 1), (gx // 2, gy - 1, 0)]:
        for ti in [(0, 0, 0), (bx - 1, by - 1, bz - 1), (bx // 2, 0, bz - 1)]:
            got = out[bi[2], bi[1], bi[0], ti[2], ti[1], ti[0]].tolist()
            assert got == [pack(*bi), pack(*ti), pack(*grid), pack(*block)]
    assert len(set(tuple(v) for v in out[..., :2].reshape(-1, 2).tolist())) == out[..., 0].numel()


def test_votes(order, ops):
    pred = torch.tensor([(i % 3 == 0) or (i >= 32) for i in range(64)], dtype=torch.int32)
    out = ops.votes(pred)
    warp0 = sum(1 << i for i in range(32) if i % 3 == 0)
    count = int(pred.sum())
    for t in range(64):
        ballot = warp0 if t < 32 else 0xFFFFFFFF
        assert out[t].tolist() == [ballot, 1, int(t >= 32), count, 0, 1]


def test_atomics_across_blocks_and_workers(order, ops):
    assert ops.atomics(16, 128).tolist() == [2048, 2047, 2048, 2048]


@pytest.mark.parametrize("n", [48, 70, 96])
def test_partial_warps_shuffle_within_their_lanes(order, n, ops):
    x = integers(n)
    expected = torch.stack([chunk.sum() for chunk in x.split(32)])
    assert torch.equal(ops.partial_warp_sums(x), expected)


def test_shuffle_from_outside_the_mask_reads_all_ones(order, ops):
    x = integers(16)
    out = ops.shuffle_outside_mask(x)
    assert torch.equal(out[:15], x[1:])
    assert out[15:].view(torch.int32).item() == -1


def test_missing_barrier_is_caught_by_fiber_order(order, ops):
    n = 64
    x = torch.arange(1, n + 1, dtype=torch.float32)
    out = ops.missing_barrier(x)
    correct = x[torch.clamp(torch.arange(n) + 1, max=n - 1)]
    if order == "reverse":  # each neighbour wrote before the read: the race stays hidden
        assert torch.equal(out, correct)
    elif order == "forward":  # every read comes first and sees the poison
        assert out[:-1].isnan().all() and out[-1] == x[-1]
    else:
        assert out.isnan().any() and not torch.equal(out, correct)


K = "simt: kernel simt_selftest::{}_kernel(float*)"
MMA_BF16 = "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"
MMA_F16 = "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32"
FAULTS = {
    "barrier_after_exit": K + ", block (0,0,0): __syncthreads reached by some threads while"
    " others exited: t0-63: __syncthreads, t64-127: exited",
    "shuffle_exited_lane": K + ", block (0,0,0): __shfl_xor_sync(0xffffffff) in warp 0 waits"
    " for lane 16, which exited: t0-15: __shfl_xor_sync(0xffffffff), t16-31: exited",
    "absent_lane": K + ", block (0,0,0), thread ({t},0,0): __shfl_sync(0xffffffff) names lanes"
    " absent from warp 1, which has 16 lanes",
    "disagree_op": K + ", block (0,0,0): lanes in warp 0 disagree on a warp collective:"
    " t0-15: __shfl_xor_sync(0xffffffff), t16-31: __shfl_down_sync(0xffffffff)",
    "disagree_mask": K + ", block (0,0,0): lanes in warp 0 disagree on a warp collective:"
    " t0-15: __shfl_xor_sync(0xffffffff), t16-31: __shfl_xor_sync(0xffff0001)",
    "deadlock": K + ", block (0,0,0): deadlock: t0-15: __shfl_sync(0xffffffff),"
    " t16-31: __syncthreads",
    "mask_excludes_caller": K + ", block (0,0,0), thread ({t},0,0): __shfl_sync(0x00000001)"
    " in lane {t}: the mask must include the calling lane",
    "trap": K + ", block (1,0,0), thread (5,0,0): __trap() called",
    "assert": K + ", block (0,0,0), thread (7,0,0): assertion failed: threadIdx.x != 7"
    " (selftest_faults.cpp:{line})",
    "oversized_block": K + ": block has 2048 threads, more than 1024",
    "mma_partial_warp": K + ", block (0,0,0), thread ({t},0,0): " + MMA_BF16 + " needs all 32"
    " lanes of the warp; warp 1 has 16",
    "mma_divergent": K + ", block (0,0,0): " + MMA_F16 + "(0xffffffff) in warp 0 waits for lane"
    " 16, which exited: t0-15: " + MMA_F16 + "(0xffffffff), t16-31: exited",
    "mma_disagree": K + ", block (0,0,0): lanes in warp 0 disagree on a warp collective: t0-15: "
    + MMA_BF16 + "(0xffffffff), t16-31: " + MMA_F16 + "(0xffffffff)",
    "cp_async_pending_at_exit": K + ", block (0,0,0), thread ({t},0,0): exited with 2 cp.async"
    " copies pending (1 in committed groups, 1 never committed): a thread must retire its copies"
    " with cp.async.wait_group first",
    "cp_async_misaligned": K + ", block (0,0,0), thread ({t},0,0): cp.async.cg.shared.global 16:"
    " global address {addr} is not 16-byte aligned",
    "ldmatrix_misaligned": K + ", block (0,0,0), thread ({t},0,0): ldmatrix.sync.aligned.m8n8.x4"
    ".shared.b16: shared address {addr} is not 16-byte aligned",
    "ldmatrix_local": K + ", block (0,0,0), thread ({t},0,0): ldmatrix.sync.aligned.m8n8.x2.trans"
    ".shared.b16: address {addr} is on the thread's stack, not in shared memory",
    "ldmatrix_past_dynamic_smem": K + ", block (0,0,0), thread (15,0,0): ldmatrix.sync.aligned"
    ".m8n8.x2.shared.b16: 16 bytes at {addr} run past the dynamic shared memory (248 bytes)",
}
# The thread that detects a fault depends on the order: the first (or last) to arrive.
FIRST_THREAD = {
    "absent_lane": {"forward": 32, "reverse": 47},
    "mask_excludes_caller": {"forward": 1, "reverse": 31},
    "mma_partial_warp": {"forward": 32, "reverse": 47},
    **{name: {"forward": 0, "reverse": 31} for name in [
        "cp_async_pending_at_exit", "cp_async_misaligned", "ldmatrix_misaligned"]},
    "ldmatrix_local": {"forward": 0, "reverse": 15},  # x2: lanes 16-31 give no address
}


def expected_fault(name, order):
    """The exact message as a regex; an order-dependent thread, a line number or an address may
    vary."""
    parts = re.split(r"(\{t\}|\{line\}|\{addr\})", FAULTS[name].replace("{}", name))
    thread = FIRST_THREAD.get(name, {}).get(order)
    fills = {"{t}": str(thread) if thread is not None else r"\d+", "{line}": r"\d+",
             "{addr}": r"0x[0-9a-f]+"}
    return "".join(fills.get(part, re.escape(part)) for part in parts)


def test_every_fault_kernel_has_an_expectation(ops):
    assert sorted(ops.fault_names()) == sorted(FAULTS)


@pytest.mark.parametrize("name", sorted(FAULTS))
def test_fault_diagnostics(order, name, ops):
    with pytest.raises(RuntimeError) as info:
        ops.run_fault(name)
    assert re.fullmatch(expected_fault(name, order), str(info.value)), str(info.value)
    x = integers(2, 100)  # the next launch works
    assert torch.equal(ops.block_sum(x, 64), x.sum(1))


# cudaErrorInvalidValue, cudaErrorInvalidConfiguration (driver_types.h)
INVALID_VALUE, INVALID_CONFIGURATION = 1, 9
KIB = 1024


@pytest.mark.parametrize("grid, block, smem, opt_in, error, why", [
    ((2, 3, 1), (64, 2, 1), 48 * KIB, 0, 0, ""),
    ((1, 65535, 1), (1, 1, 1), 0, 0, 0, ""),
    ((1, 65536, 1), (32, 1, 1), 0, 0, INVALID_CONFIGURATION, r"y and z must be at most 65535"),
    ((1, 1, 65536), (32, 1, 1), 0, 0, INVALID_CONFIGURATION, r"y and z must be at most 65535"),
    ((0, 1, 1), (32, 1, 1), 0, 0, INVALID_CONFIGURATION, r"a grid or block dimension is 0"),
    ((1, 1, 1), (32, 0, 1), 0, 0, INVALID_CONFIGURATION, r"a grid or block dimension is 0"),
    ((1, 1, 1), (1025, 1, 1), 0, 0, INVALID_CONFIGURATION, r"1025 threads, more than 1024"),
    ((1, 1, 1), (1, 1, 65), 0, 0, INVALID_CONFIGURATION, r"blockDim.z 65 exceeds 64"),
    ((1, 1, 1), (128, 1, 1), 48 * KIB + 16, 0, INVALID_VALUE,
     r"49168 bytes exceeds 48 KiB without the kernel's "
     r"cudaFuncAttributeMaxDynamicSharedMemorySize"),
    ((2, 1, 1), (128, 1, 1), 100 * KIB, 100 * KIB, 0, ""),
    ((1, 1, 1), (128, 1, 1), 100 * KIB + 4, 100 * KIB, INVALID_VALUE,
     r"exceeds the kernel's cudaFuncAttributeMaxDynamicSharedMemorySize of 102400"),
])
def test_launch_errors_are_reported_as_a_gpu_reports_them(ops, grid, block, smem, opt_in, error,
                                                          why):
    """A bad configuration runs no block and sets the error cudaGetLastError returns (and
    clears); dynamic shared memory above 48 KiB needs the kernel's opt-in attribute."""
    code, ran, message = ops.launch_config(list(grid), list(block), smem, opt_in)
    assert code == error, message
    if error:
        assert ran == 0
        assert re.fullmatch(r"simt: kernel simt_selftest::smem_fill_kernel\(int\*\): .*" + why,
                            message), message
    else:
        assert ran == grid[0] * grid[1] * grid[2] and message == ""


def test_the_smem_opt_in_is_bounded_by_the_device(ops):
    code, _, message = ops.launch_config([1, 1, 1], [32, 1, 1], 0, 227 * KIB + 1)
    assert code == INVALID_VALUE and message == "cudaFuncSetAttribute failed"
    assert ops.launch_config([1, 1, 1], [32, 1, 1], 227 * KIB, 227 * KIB)[0] == 0


def test_traffic_counters_report_a_wasteful_kernel(ops):
    """The counters can fail: a copy that walks memory column-wise and re-reads it in every
    block is reported as 1/8 sector efficiency and a re-read factor of the block count; the
    coalesced copy of the same data as ideal. Exact counts: 128-thread blocks, 32-lane requests
    of 4 bytes each."""
    n, blocks = 8192, 3
    x = torch.randn(n)
    with simt.profile() as prof:
        y_lean = ops.copy(x, blocks, False)
        y_waste = ops.copy(x, blocks, True)
    assert torch.equal(y_lean, x) and torch.equal(y_waste, x)
    assert [launch["kernel"].split("(")[0] for launch in prof.launches] == [
        "simt_selftest::coalesced_copy_kernel", "simt_selftest::wasteful_copy_kernel"]
    requests = blocks * n // 32
    for kernel, sectors, efficiency in [("coalesced", 4, 1.0), ("wasteful", 32, 0.125)]:
        for op in ("load", "store"):
            t = prof.total(kernel, "data", op)
            assert t["requests"] == requests and t["bytes"] == blocks * n * 4
            assert t["sectors"] == sectors * requests and t["ideal_sectors"] == 4 * requests
            assert t["sector_efficiency"] == efficiency
            assert t["distinct_bytes"] == n * 4 and t["reread"] == blocks
    assert "wasteful_copy_kernel" in prof.table() and "12.5%" in prof.table()
    assert prof.to_dict()["rows"] == prof.rows()


def test_traffic_counters_are_off_outside_a_profile(ops):
    with simt.profile() as prof:
        pass
    assert prof.launches == []
    ops.copy(torch.randn(4096), 1, True)  # not recorded anywhere
    with simt.profile() as prof:
        ops.copy(torch.randn(4096), 1, False)
        with pytest.raises(RuntimeError, match="already recording"):
            with simt.profile():
                pass
    assert len(prof.launches) == 1


def test_controls_reject_bad_values():
    with pytest.raises(
        RuntimeError, match="order must be forward, reverse or random, not 'sideways'"
    ):
        simt.set_order("sideways", 0)
    with pytest.raises(RuntimeError, match="workers must be at least 1, got 0"):
        simt.set_workers(0)


def test_random_order_is_deterministic_per_seed(ops):
    saved = simt.config()
    try:
        simt.set_workers(1)
        x = torch.arange(1, 257, dtype=torch.float32)
        runs = {}
        for seed in [5, 5, 6]:
            simt.set_order("random", seed)
            runs.setdefault(seed, []).append(ops.missing_barrier(x))
        assert torch.equal(runs[5][0].nan_to_num(-1), runs[5][1].nan_to_num(-1))
        assert not torch.equal(runs[5][0].nan_to_num(-1), runs[6][0].nan_to_num(-1))
    finally:
        simt.set_order(saved[0], saved[1])
        simt.set_workers(saved[2])


def run_python(code: str, **env: str) -> subprocess.CompletedProcess:
    """Runs ``code`` in a fresh interpreter with the helpers and this run's pagedkv._simt."""
    path = os.pathsep.join([str(ROOT / "tests"), str(ROOT / "tests" / "simt"),
                            os.environ.get("PYTHONPATH", "")])
    prelude = "import helpers; helpers.use_sanitized_simt()\n"
    return subprocess.run([sys.executable, "-c", prelude + code], capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=path, **env))


def test_environment_sets_the_controls():
    out = run_python(
        "from pagedkv.ops import simt; print(simt.config())",
        PAGEDKV_SIMT_ORDER="reverse", PAGEDKV_SIMT_SEED="7", PAGEDKV_SIMT_WORKERS="3",
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "('reverse', 7, 3)"


def test_the_sanitizer_run_uses_the_sanitized_module():
    if not SIMT_SANITIZE:
        pytest.skip("runs in the sanitizer run (make sanitize)")
    import pagedkv._simt

    module = Path(pagedkv._simt.__file__)
    assert module.parent == ROOT / "build" / f"simt-{SIMT_SANITIZE}" / "pagedkv"
    assert b"__asan_report_load" in module.read_bytes()  # instrumented


# What the sanitizers print for the memory faults of selftest_faults.cpp.
MEMORY_FAULTS = {
    "read_past_end": r"ERROR: AddressSanitizer: heap-buffer-overflow.*read_past_end_kernel",
    "misaligned": r"runtime error: .*misaligned address .* 16 byte alignment"
    r".*misaligned_vector_load_kernel",
}


@pytest.mark.parametrize("name", sorted(MEMORY_FAULTS))
def test_the_sanitizers_catch_memory_faults(ops, name):
    """A kernel reading past its buffer, or a misaligned vector load, kills the process with
    the sanitizer's report (so a faulty kernel fails the sanitizer run)."""
    if not SIMT_SANITIZE:
        pytest.skip("needs the ASan + UBSan build of the emulator (make sanitize)")
    out = run_python(f"import selftest_lib; selftest_lib.load().memory_fault({name!r})")
    assert out.returncode != 0
    assert re.search(MEMORY_FAULTS[name], out.stderr, re.S), out.stderr[-3000:]
