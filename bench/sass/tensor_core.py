"""Tensor-core attention speed on a GPU, estimated from the SASS of the key-tile loop
(docs/gpu_model.md).

One pass of the main loop (``bench.sass.loop``, weighted on the common path) is one warp's share
of one key tile: ``hmma`` mma.sync m16n8k16 (4096 FLOP each), ``ldsm`` ldmatrix, ``ldgsts``
cp.async copies and ``instructions`` in all. An SM needs at least

    max(instructions / (schedulers_per_sm x issue_efficiency),    issue
        hmma / mma_per_sm_clock,                                  tensor pipe (mma.sync)
        shared_bytes / 128)                                       shared memory, 32 banks x 4 B

clocks per pass. A shape runs ``passes`` of them spread over every SM, and reads ``hbm_bytes``
at ``memory_bandwidth x bandwidth_efficiency``; the estimate is the slower of the two. Where the
kernel runs its boundary tiles (causal diagonal, partition end) in a masked body of a loop
around the unmasked one, those ``boundary_passes`` are priced at the masked pass's cost
(``tile_cost(kernel, boundary=True)``).

The mma.sync rate is a share of the device's dense bf16 peak (``DevicePreset.bf16_flops``):
all of it on sm_80, where mma.sync is the tensor cores' instruction (A100: 312 TFLOPS = 108
SMs x 1410 MHz x 2048 FLOP per SM and clock), and about 2/3 on sm_90, whose peak (989 TFLOPS)
needs the asynchronous wgmma: without it mma.sync reaches about 2/3 of the Hopper tensor cores'
peak (FlashAttention-3, Shah et al. 2024, arXiv:2407.08608, section 2.2, after the
microbenchmarks of Luo et al., arXiv:2402.13499).
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass

from bench.sass.disasm import Kernel
from bench.sass.loop import LoopProfile, profile_loop
from pagedkv.tools.costmodel import DevicePreset

__all__ = ["MMA_FLOP", "MMA_SYNC_SHARE", "Decode", "Prefill", "TcEstimate", "TileCost",
           "TileGeometry", "boundary_cost", "estimate", "geometry", "mla_kernels", "tc_kernels",
           "tile_cost"]

MMA_FLOP = 2 * 16 * 8 * 16  # one HMMA.16816: D[16][8] += A[16][16] B[16][8]
MMA_SYNC_SHARE = {"sm_80": 1.0, "sm_90": 2 / 3}  # of the dense bf16 peak, see above
SHARED_BYTES_PER_SM_CLOCK = 128  # 32 banks of 4 bytes (CUDA C++ Programming Guide)

_TYPES = {"__nv_bfloat16": "bf16", "__half": "f16", "pagedkv::fp8_e4m3": "fp8_e4m3",
          "pagedkv::fp8_e5m2": "fp8_e5m2", "pagedkv::RowScaled<signed char>": "int8",
          "pagedkv::RowScaled<pagedkv::int4x2>": "int4",
          "pagedkv::RowScaled<pagedkv::fp8_e4m3>": "fp8_e4m3/row"}
_TC = re.compile(r"paged_attention_tc_kernel<([^,]+), ([^,]+), (\d+), (\d+), (\d+), (\d+)>")
_MLA = re.compile(r"mla_attention_tc_kernel<([^,]+), ([^,]+), (\d+), (\d+)>")


@dataclass(frozen=True, slots=True)
class TileGeometry:
    """How a kernel cuts attention into blocks: ``rows`` query rows per block, ``keys`` per key
    tile, ``warps`` each running one pass of the main loop per key tile. ``packs_group``: a row
    is a (token, query head of the kv head's group) pair (pagedkv), else a token of one query
    head (FlashAttention-2)."""

    rows: int
    keys: int
    warps: int
    packs_group: bool = True


def geometry(kernel: Kernel) -> TileGeometry:
    """The geometry of ``paged_attention_tc_kernel<T, C, HEAD, WM, WN, BN>``: 16 x WM rows,
    BN keys, WM x WN warps."""
    m = _TC.search(kernel.demangled or "")
    if m is None:
        raise ValueError(f"not a tensor-core attention kernel: {kernel.demangled or kernel.name}")
    wm, wn, bn = int(m[4]), int(m[5]), int(m[6])
    return TileGeometry(16 * wm, bn, wm * wn)


def mla_kernels(kernels: list[Kernel]) -> dict[tuple[str, str, str, int, int], Kernel]:
    """``(arch, query, cache, padded rank, rows) -> kernel`` of the MLA kernel
    ``mla_attention_tc_kernel<T, C, DV, WM>``: tiles of 16 x WM rows over 32 keys, 2 x WM warps
    (docs/cuda_attention.md, MLA kernel)."""
    found = {}
    for k in kernels:
        if m := _MLA.search(k.demangled or ""):
            found[(k.arch, _TYPES.get(m[1], m[1]), _TYPES.get(m[2], m[2]), int(m[3]),
                   16 * int(m[4]))] = k
    return found


def tc_kernels(kernels: list[Kernel]) -> dict[tuple[str, str, str, int, str], Kernel]:
    """``(arch, query, cache, padded head, "prefill" | "decode") -> kernel``: "prefill" is the
    configuration of 4 warps along M (64 rows), "decode" of one 16-row tile."""
    found = {}
    for k in kernels:
        if m := _TC.search(k.demangled or ""):
            kind = "prefill" if int(m[5]) == 1 else "decode"
            found[(k.arch, _TYPES.get(m[1], m[1]), _TYPES.get(m[2], m[2]), int(m[3]), kind)] = k
    return found


@dataclass(frozen=True, slots=True)
class TileCost:
    """One pass of a tensor-core main loop (one warp, one key tile): the whole body as laid out
    (``static_*``) and the common path."""

    static_instructions: int
    static_hmma: int
    instructions: float
    hmma: float
    ldsm: float
    ldgsts: float
    shared_bytes: float  # ldmatrix, LDS and STS, and the shared side of cp.async, 32 lanes
    classes: dict[str, float]

    @property
    def per_hmma(self) -> float:
        return self.instructions / self.hmma

    @property
    def static_per_hmma(self) -> float:
        return self.static_instructions / self.static_hmma


def tile_cost(kernel: Kernel, boundary: bool = False) -> TileCost:
    """The cost of one pass of ``kernel``'s main loop, the unmasked interior tile (ValueError: no
    loop with HMMA); with ``boundary``, of a masked tile: a pass of the loop around it that does
    not enter it (ValueError: none)."""
    p = profile_loop(kernel, boundary=boundary)
    if p is None or not p.count("HMMA"):
        what = "masked boundary loop" if boundary else "tensor-core main loop"
        raise ValueError(f"{kernel.demangled or kernel.name} has no {what}")
    return TileCost(p.static_instructions, int(p.count("HMMA", static=True)), p.instructions,
                    p.count("HMMA"), p.count("LDSM"), p.count("LDGSTS"), _shared_bytes(p),
                    dict(p.classes))


def boundary_cost(kernel: Kernel) -> TileCost | None:
    """``tile_cost(kernel, boundary=True)``, None where the kernel has one key-tile loop."""
    try:
        return tile_cost(kernel, boundary=True)
    except ValueError:
        return None


def _shared_bytes(p: LoopProfile) -> float:
    """Shared-memory bytes one pass moves: ldmatrix .x1/.x2/.x4 (128 B per 8x8 matrix), LDS and
    STS (32 lanes x width), cp.async (32 lanes x width, written)."""
    total = 0.0
    for op, n in p.opcodes.items():
        base, *mods = op.split(".")
        if base == "LDSM":
            total += n * 128 * int(mods[-1])
        elif base in ("LDS", "STS", "LDGSTS"):
            width = next((int(m) // 8 for m in mods if m in ("64", "128")), 4)
            total += n * 32 * (2 if "U16" in mods or "S16" in mods else width)
    return total


@dataclass(frozen=True, slots=True)
class Prefill:
    """Chunked prefill: ``num_seqs`` chunks of ``query_len`` tokens after a cached prefix of
    ``prefix`` tokens, causal."""

    num_seqs: int = 8
    query_len: int = 2048
    prefix: int = 4096
    num_heads: int = 32
    num_kv_heads: int = 8
    head_size: int = 128
    cache_bytes: float = 2  # per element: 2 for 16-bit caches, 1 for fp8 and int8, 0.5 int4
    # (with a row's scale spread over its elements: + 4 / head_size)

    def passes(self, g: TileGeometry) -> int:
        """Passes of the key-tile loops (warps x key tiles over every block): each block runs
        its key tiles up to its last row's position (the causal diagonal)."""
        return sum(self._tiles(g)) * self._blocks_per_row_tile(g) * g.warps

    def boundary_passes(self, g: TileGeometry) -> int:
        """The passes over boundary tiles, masked: those past the first row's position (the
        diagonal's tiles; key tiles up to it every row of the block sees whole)."""
        return self._tiles(g)[1] * self._blocks_per_row_tile(g) * g.warps

    def _tiles(self, g: TileGeometry) -> tuple[int, int]:
        """(interior, boundary) key tiles summed over one (sequence, kv head)'s row tiles, as
        the kernel splits them (attention_tc.cuh: it_hi = first row's position + 1 over BN)."""
        per_token = self.num_heads // self.num_kv_heads if g.packs_group else 1
        rows = self.query_len * per_token
        interior = boundary = 0
        for r0 in range(0, rows, g.rows):
            first = self.prefix + r0 // per_token
            last = self.prefix + (min(r0 + g.rows, rows) - 1) // per_token
            tiles = math.ceil((last + 1) / g.keys)
            whole = min(tiles, (first + 1) // g.keys)
            interior, boundary = interior + whole, boundary + tiles - whole
        return interior, boundary

    def _blocks_per_row_tile(self, g: TileGeometry) -> int:
        return self.num_seqs * (self.num_kv_heads if g.packs_group else self.num_heads)

    @property
    def flops(self) -> float:
        """QK^T and PV of the keys each query sees (its prefix and the chunk up to itself)."""
        keys = self.query_len * self.prefix + self.query_len * (self.query_len + 1) // 2
        return 4.0 * self.head_size * self.num_heads * self.num_seqs * keys

    @property
    def hbm_bytes(self) -> float:
        """Q and out (bf16) once, K and V once per (sequence, kv head): the row tiles of a kv
        head run side by side and share K/V through L2."""
        q = self.num_seqs * self.query_len * self.num_heads * self.head_size * 2
        kv = 2 * self.num_seqs * (self.prefix + self.query_len) * self.num_kv_heads * (
            self.head_size * self.cache_bytes)
        return 2 * q + kv

    def __str__(self) -> str:
        return (f"prefill {self.num_seqs}x{self.query_len} over {self.prefix} "
                f"{self.num_heads}/{self.num_kv_heads} h{self.head_size}")


@dataclass(frozen=True, slots=True)
class Decode:
    """Decode: one query token per sequence over ``seq_len`` cached tokens."""

    num_seqs: int = 32
    seq_len: int = 4096
    num_heads: int = 64
    num_kv_heads: int = 8
    head_size: int = 128
    cache_bytes: float = 2

    def passes(self, g: TileGeometry) -> int:
        return self._blocks(g) * math.ceil(self.seq_len / g.keys) * g.warps

    def boundary_passes(self, g: TileGeometry) -> int:
        """The passes over the last, partial key tile (none when BN divides the length)."""
        tiles = math.ceil(self.seq_len / g.keys)
        return self._blocks(g) * (tiles - self.seq_len // g.keys) * g.warps

    def _blocks(self, g: TileGeometry) -> int:
        group = self.num_heads // self.num_kv_heads
        return self.num_seqs * self.num_kv_heads * math.ceil(group / g.rows)

    @property
    def flops(self) -> float:
        return 4.0 * self.head_size * self.num_heads * self.num_seqs * self.seq_len

    @property
    def hbm_bytes(self) -> float:
        """K and V once (the query and output are a few KB)."""
        return 2.0 * self.num_seqs * self.seq_len * self.num_kv_heads * (
            self.head_size * self.cache_bytes)

    def __str__(self) -> str:
        return (f"decode {self.num_seqs}x{self.seq_len} {self.num_heads}/{self.num_kv_heads} "
                f"h{self.head_size}")


@dataclass(frozen=True, slots=True)
class TcEstimate:
    device: str
    bound: str  # "issue", "tensor", "shared" or "hbm"
    clocks_per_pass: dict[str, float]  # per SM, under each limit, an interior (unmasked) pass
    boundary_share: float  # of the passes: boundary tiles priced at the masked cost
    seconds: float
    tflops: float
    fraction_of_peak: float  # of the dense bf16 peak
    bandwidth: float  # HBM bytes / seconds
    fraction_of_hbm: float

    def to_dict(self) -> dict:
        return asdict(self)


def estimate(cost: TileCost, device: DevicePreset, shape: Prefill | Decode, g: TileGeometry,
             boundary: TileCost | None = None) -> TcEstimate:
    """The estimated time of ``shape`` on ``device`` for a loop of ``cost`` cut as ``g``: its
    interior passes at ``cost``, its boundary passes at ``boundary`` (the masked tile; at
    ``cost`` when None: a kernel with one loop)."""
    if not device.sm_count or not device.sm_clock or device.sass_arch not in MMA_SYNC_SHARE:
        raise ValueError(f"device {device.name} has no SM figures or no mma.sync rate")
    clocks = _clocks(cost, device)
    bound = max(clocks, key=clocks.get)
    passes = shape.passes(g)
    masked = shape.boundary_passes(g) if boundary is not None else 0
    total = (passes - masked) * clocks[bound]
    if masked:
        total += masked * max(_clocks(boundary, device).values())
    compute = total / (device.sm_count * device.sm_clock)
    memory = shape.hbm_bytes / (device.memory_bandwidth * device.bandwidth_efficiency)
    if memory > compute:
        bound = "hbm"
    seconds = max(compute, memory)
    hbm = shape.hbm_bytes / seconds
    return TcEstimate(device.name, bound, clocks, masked / passes, seconds,
                      shape.flops / seconds / 1e12, shape.flops / seconds / device.bf16_flops,
                      hbm, hbm / device.memory_bandwidth)


def _clocks(cost: TileCost, device: DevicePreset) -> dict[str, float]:
    """SM clocks of one pass of ``cost`` under each limit."""
    mma_per_clock = device.bf16_flops * MMA_SYNC_SHARE[device.sass_arch] / (
        MMA_FLOP * device.sm_count * device.sm_clock)
    return {"issue": cost.instructions / (device.schedulers_per_sm * device.issue_efficiency),
            "tensor": cost.hmma / mma_per_clock,
            "shared": cost.shared_bytes / SHARED_BYTES_PER_SM_CLOCK}
