"""The tensor-core side of the SASS model: the loop counter on synthetic tensor-core listings (the
MMA and cp.async side of a branch runs), the estimate's bounds, FlashAttention-2's reference
loop, and the instruction budgets of the tensor-core kernels of the built module (or of the
units compiled by nvcc), so that a change making them issue more per MMA fails here.
"""

from __future__ import annotations

import pytest
from test_gpu_model import assemble, built_kernels

from bench.sass.disasm import parse_listing
from bench.sass.loop import boundary_loop, main_loop, profile_loop
from bench.sass.reference import FA2_GEOMETRY, fa2_kernel
from bench.sass.tensor_core import (
    Decode,
    Prefill,
    TileGeometry,
    boundary_cost,
    estimate,
    geometry,
    tc_kernels,
    tile_cost,
)
from pagedkv.tools.costmodel import DEVICES

# Instructions per HMMA of one pass of the main loop (the unmasked interior-tile loop) on the
# common path (tile_cost(k).per_hmma), bf16 queries: today's figures plus 3%.
# (arch, cache, padded head) -> (prefill, decode).
# Lower a row in the commit that makes its kernel leaner (docs/gpu_model.md, Tensor cores).
TENSOR_CORE_BUDGETS = {
    ("sm_80", "bf16", 64): (6.5, 14.5),
    ("sm_80", "bf16", 128): (6.1, 10.4),
    ("sm_80", "bf16", 256): (4.8, 8.4),
    ("sm_80", "fp8_e4m3", 64): (41.6, 155.2),
    ("sm_80", "fp8_e4m3", 128): (42.3, 153.5),
    ("sm_80", "fp8_e4m3", 256): (41.5, 156.6),
    ("sm_90", "bf16", 64): (6.6, 15.0),
    ("sm_90", "bf16", 128): (6.2, 10.6),
    ("sm_90", "bf16", 256): (4.8, 8.5),
    ("sm_90", "fp8_e4m3", 64): (10.3, 29.8),
    ("sm_90", "fp8_e4m3", 128): (10.0, 24.7),
    ("sm_90", "fp8_e4m3", 256): (8.4, 24.1),
    # caches quantized per (token, head) (attention_tc_scaled_bf16; sm_80 head 256: the loop
    # model finds no main loop in them)
    ("sm_80", "int8", 64): (15.0, 40.1),
    ("sm_80", "int8", 128): (13.0, 30.9),
    ("sm_80", "int4", 64): (16.5, 46.2),
    ("sm_80", "int4", 128): (14.5, 36.4),
    ("sm_80", "fp8_e4m3/row", 64): (42.6, 171.0),
    ("sm_80", "fp8_e4m3/row", 128): (40.7, 161.7),
    ("sm_90", "int8", 64): (15.3, 40.7),
    ("sm_90", "int8", 128): (13.2, 31.1),
    ("sm_90", "int8", 256): (7.8, 12.8),
    ("sm_90", "int4", 64): (16.9, 46.7),
    ("sm_90", "int4", 128): (14.8, 36.6),
    ("sm_90", "int4", 256): (8.4, 14.0),
    ("sm_90", "fp8_e4m3/row", 64): (14.8, 38.6),
    ("sm_90", "fp8_e4m3/row", 128): (12.7, 28.7),
    ("sm_90", "fp8_e4m3/row", 256): (7.5, 12.1),
}
KINDS = ("prefill", "decode")
ROW_SCALED = ("int8", "int4", "fp8_e4m3/row")

# synthetic listings -----------------------------------------------------------------------------

TILE = """\
ULDC UR4, c[0x0][0x210]
ISETP.GT.AND P3, PT, RZ, UR4, PT
IMAD.MOV.U32 R40, RZ, RZ, c[0x0][0x218]
ISETP.GE.AND P4, PT, R40, 0x1, PT
head: ISETP.GE.AND P0, PT, R21, R8, PT
@!P0 BRA copy
DEPBAR.LE SB0, 0x0
BRA copied
copy: LDG.E R6, desc[UR6][R2.64]
LDGSTS.E.BYPASS.128 [R42+0x4400], desc[UR6][R108.64]
LDGSTS.E.BYPASS.128 [R42+0x8800], desc[UR6][R110.64]
copied: BAR.SYNC.DEFER_BLOCKING 0x0
LDSM.16.M88.4 R12, [R30]
HMMA.16816.F32.BF16 R60, R12, R16, R60
@!P4 BRA no_k1
LDSM.16.M88.4 R16, [R30+0x20]
HMMA.16816.F32.BF16 R64, R12, R16, R64
no_k1: @!P3 BRA no_cap
{cap}no_cap: FMUL R70, R60, R71
MUFU.EX2 R72, R70
{waste}IADD3 R21, R21, 0x1, RZ
ISETP.GE.AND P1, PT, R21, R9, PT
@!P1 BRA head
EXIT
"""


# The reworked kernel's shape: a key-tile loop whose passes run either the masked body (soft cap
# a config branch, a mask per score) or, for the interior tiles, an inner unmasked loop.
NESTED = """\
ULDC UR4, c[0x0][0x210]
ISETP.GT.AND P3, PT, RZ, UR4, PT
outer: ISETP.GE.AND P0, PT, R20, R7, PT
@P0 BRA unmasked
BAR.SYNC.DEFER_BLOCKING 0x0
LDSM.16.M88.4 R12, [R30]
HMMA.16816.F32.BF16 R60, R12, R16, R60
HMMA.16816.F32.BF16 R64, R12, R18, R64
@!P3 BRA no_cap
FMUL R70, R70, R73
FMUL R71, R71, R73
no_cap: ISETP.GT.AND P2, PT, R21, R22, PT
FSEL R60, R60, R74, P2
FSEL R61, R61, R74, P2
MUFU.EX2 R72, R70
LDGSTS.E.BYPASS.128 [R42+0x4400], desc[UR6][R108.64]
IADD3 R20, R20, 0x1, RZ
BRA next
unmasked: IMAD.MOV.U32 R23, RZ, RZ, R20
inner: BAR.SYNC.DEFER_BLOCKING 0x0
LDSM.16.M88.4 R12, [R30]
HMMA.16816.F32.BF16 R60, R12, R16, R60
HMMA.16816.F32.BF16 R64, R12, R18, R64
MUFU.EX2 R72, R70
LDGSTS.E.BYPASS.128 [R42+0x4400], desc[UR6][R108.64]
IADD3 R20, R20, 0x1, RZ
ISETP.GE.AND P1, PT, R20, R8, PT
@!P1 BRA inner
next: ISETP.GE.AND P4, PT, R20, R9, PT
@!P4 BRA outer
EXIT
"""


def tile_listing(waste: int = 0) -> str:
    """TILE as nvdisasm prints it, with ``waste`` integer instructions on the common path."""
    return as_nvdisasm(TILE.replace("{cap}", "FMUL R70, R70, R73\n" * 4).replace(
        "{waste}", "IMAD R30, R30, 0x3, RZ\n" * waste))


def as_nvdisasm(text: str) -> str:
    """A listing of ``label: instruction`` lines as nvdisasm prints it, 16 bytes each."""
    return assemble(text, ["\t.target\tsm_90", ".text._Z4tilev:"])


def test_the_tensor_core_work_runs_and_the_features_are_skipped():
    (k,) = parse_listing(tile_listing())
    p = profile_loop(k)
    assert (p.static_instructions, p.count("HMMA", static=True)) == (23, 2)
    # the copies of the next tile (the data branch's other side) and the second k16 step (a
    # config guard of the head size) run; the soft cap (config) and the last tile's wait do not
    kinds = {b.address: (b.kind, b.taken) for b in p.branches}
    assert kinds == {0x50: ("data", 1.0), 0xe0: ("config", 0.0), 0x110: ("config", 1.0)}
    assert p.count("HMMA") == 2 and p.count("LDGSTS") == 2 and p.count("LDSM") == 2
    assert p.count("DEPBAR") == 0 and p.instructions == 23 - 2 - 4
    cost = tile_cost(k)
    assert cost.per_hmma == pytest.approx(17 / 2)
    assert cost.shared_bytes == 2 * 512 + 2 * 512  # two ldmatrix.x4, two 16-byte cp.async


def test_the_innermost_tensor_core_loop_is_the_main_loop():
    (k,) = parse_listing(as_nvdisasm(NESTED))
    # the outer loop holds 4 HMMA, the inner 2: the inner, unmasked loop is the common path
    assert main_loop(k) == (19, 27) and boundary_loop(k) == (2, 29)
    p = profile_loop(k)
    assert (p.static_instructions, p.instructions, p.count("HMMA")) == (9, 9, 2)
    # a boundary pass: the masked body (cap skipped, masks run), not the inner loop's code
    b = profile_loop(k, boundary=True)
    assert b.static_instructions == 28 - 9 and b.count("HMMA", static=True) == 2
    assert b.instructions == 19 - 2 - 1  # no cap, not the unmasked loop's entry
    assert b.count("FSEL") == 2 and b.count("FMUL") == 0 and b.count("LDGSTS") == 1
    assert {(x.address, x.kind, x.taken) for x in b.branches} >= {(0x30, "boundary", 0.0),
                                                                   (0x80, "config", 1.0)}
    masked, interior = tile_cost(k, boundary=True), tile_cost(k)
    assert boundary_cost(k) == masked and masked.per_hmma == 16 / 2 > interior.per_hmma
    # a kernel of one key-tile loop has no boundary loop
    (single,) = parse_listing(tile_listing())
    assert boundary_loop(single) is None and boundary_cost(single) is None


def test_boundary_tiles_are_priced_at_the_masked_cost():
    interior, masked = (tile_cost(parse_listing(tile_listing(waste=n))[0]) for n in (60, 600))
    h100, g, shape = DEVICES["h100"], TileGeometry(rows=64, keys=32, warps=4), Prefill()
    flat, priced = estimate(interior, h100, shape, g), estimate(interior, h100, shape, g, masked)
    share = shape.boundary_passes(g) / shape.passes(g)
    assert flat.boundary_share == 0 and priced.boundary_share == pytest.approx(share)
    clocks = [max(estimate(c, h100, shape, g).clocks_per_pass.values()) for c in (interior, masked)]
    compute = (shape.passes(g) * (1 - share) * clocks[0] + shape.passes(g) * share * clocks[1]) / (
        h100.sm_count * h100.sm_clock)
    assert priced.bound == flat.bound == "issue" and priced.seconds == pytest.approx(compute)
    assert priced.seconds > flat.seconds


def test_the_estimate_takes_the_slowest_limit():
    cost = tile_cost(parse_listing(tile_listing())[0])
    h100, a100 = DEVICES["h100"], DEVICES["a100-80gb"]
    g = TileGeometry(rows=64, keys=32, warps=4)
    lean = estimate(cost, h100, Prefill(), g)
    assert lean.bound == "shared"  # 2 KiB of shared memory per pass: 16 clocks
    mma_per_clock = 989e12 * 2 / 3 / (4096 * 132 * 1.98e9)
    assert lean.clocks_per_pass == pytest.approx(
        {"issue": 17 / 3.2, "tensor": 2 / mma_per_clock, "shared": 16.0})
    a100_tensor = estimate(cost, a100, Prefill(), g).clocks_per_pass["tensor"]
    assert a100_tensor == pytest.approx(4.0, rel=1e-3)  # 312 TFLOPS: 0.5 HMMA per SM clock
    assert lean.tflops == pytest.approx(Prefill().flops / lean.seconds / 1e12)
    wasteful = tile_cost(parse_listing(tile_listing(waste=60))[0])
    assert wasteful.instructions == cost.instructions + 60
    slow = estimate(wasteful, h100, Prefill(), g)
    assert slow.bound == "issue" and slow.seconds > lean.seconds
    decode = estimate(cost, h100, Decode(), TileGeometry(rows=16, keys=64, warps=4))
    assert decode.bound == "hbm" and decode.fraction_of_hbm == pytest.approx(0.8)


def test_shapes_count_their_passes():
    g = TileGeometry(rows=64, keys=32, warps=4)
    # one chunk of 16 tokens x 4 heads after 16 cached tokens: one block of 32 keys
    assert Prefill(1, 16, 16, 4, 1).passes(g) == 4
    assert Prefill(1, 32, 0, 4, 1).passes(g) == 4 * (1 + 1)  # two blocks, keys 16 and 32
    assert Prefill(1, 128, 0, 4, 4).passes(FA2_GEOMETRY) == 4 * 4 * 4  # per q head, 4 tiles
    assert Prefill().flops == pytest.approx(4 * 128 * 32 * 8 * (2048 * 4096 + 2048 * 2049 / 2))
    assert Decode().passes(TileGeometry(16, 64, 4)) == 32 * 8 * 64 * 4
    assert Decode(num_heads=256).passes(TileGeometry(16, 64, 4)) == 32 * 8 * 2 * 64 * 4


def test_shapes_count_their_boundary_passes():
    g = TileGeometry(rows=64, keys=32, warps=4)
    # a block's key tiles past its first row's position are masked: here every one
    assert Prefill(1, 16, 16, 4, 1).boundary_passes(g) == 4
    assert Prefill(1, 32, 0, 4, 1).boundary_passes(g) == 4 * 2
    # one block of 64 tokens at positions 40..103: tile 0 whole, tiles 1..3 masked
    one = Prefill(1, 64, 40, 1, 1)
    assert one.passes(g) == 4 * 4 and one.boundary_passes(g) == 4 * 3
    # the standard chunked prefill: 128 blocks of 16 tokens per (sequence, kv head), block j
    # running 129 + j // 2 tiles, one of them at the diagonal
    assert Prefill().passes(g) == 8 * 8 * (128 * 129 + 2 * sum(range(64))) * 4
    assert Prefill().boundary_passes(g) == 8 * 8 * 128 * 4
    assert Decode().boundary_passes(TileGeometry(16, 64, 4)) == 0  # 64 divides 4096
    assert Decode(seq_len=4100).boundary_passes(TileGeometry(16, 64, 4)) == 32 * 8 * 4


# FlashAttention-2 and the built module ----------------------------------------------------------

def test_flash_attention_2_reference_loop():
    kernel, reason = fa2_kernel("sm_90")
    if kernel is None:
        pytest.skip(reason)
    cost = tile_cost(kernel)
    # 4 warps of 32 rows, key tiles of 32: 2 m16 tiles x (8 k16 x 4 n8 + 2 k16 x 16 n8) MMAs
    assert cost.static_hmma == cost.hmma == 2 * (8 * 4 + 2 * 16)
    assert cost.instructions == cost.static_instructions  # one path: no branch in the body
    assert cost.ldsm > 0 and cost.per_hmma < 8


@pytest.fixture(scope="module")
def tensor_core_kernels():
    """bf16 queries over 16-bit and fp8 caches, and over caches quantized per (token, head)
    (their own unit)."""
    return tc_kernels(built_kernels("attention_tc_bf16") +
                      built_kernels("attention_tc_scaled_bf16"))


@pytest.mark.parametrize("key", sorted(TENSOR_CORE_BUDGETS), ids=lambda k: "-".join(map(str, k)))
@pytest.mark.parametrize("kind", KINDS)
def test_tensor_core_loops_stay_within_their_budget(tensor_core_kernels, key, kind):
    arch, cache, head = key
    kernel = tensor_core_kernels.get((arch, "bf16", cache, head, kind))
    if kernel is None:
        pytest.skip(f"the module has no {arch} bf16/{cache} h{head} {kind} kernel")
    g, cost = geometry(kernel), tile_cost(kernel)
    keys = g.keys // (g.warps // (g.rows // 16))  # per warp and tile
    # S = Q K^T, O += P V, and the row sum of P by one MMA per k16 step of P V (not over
    # row-scaled caches, whose P holds the V scales: the fp32 sum normalizes)
    ones = 0 if cache in ROW_SCALED else keys // 16
    assert cost.hmma == (head // 16) * (keys // 8) + (keys // 16) * (head // 8) + ones
    assert cost.ldsm > 0 and (cost.ldgsts > 0) == (cache == "bf16")
    masked = boundary_cost(kernel)  # the boundary tiles' body: as many MMAs, more code
    assert masked is not None and masked.hmma == cost.hmma
    assert masked.instructions > cost.instructions
    budget = TENSOR_CORE_BUDGETS[key][KINDS.index(kind)]
    assert cost.per_hmma <= budget, (
        f"{kernel.demangled}: {cost.per_hmma:.1f} instructions per HMMA on the common path, "
        f"over the budget of {budget} (docs/gpu_model.md)")
