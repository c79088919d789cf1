"""Decode attention speed on a GPU, estimated from the SASS of the built kernels
(docs/gpu_model.md).

A decode kernel streams K/V; per pass of its main loop a warp loads ``kv_bytes`` and issues
``instructions`` (``bench.sass.loop``). An SM issues at most ``schedulers_per_sm`` warp
instructions per clock, so the loop cannot stream faster than

    issue-bound bandwidth = sm_count x sm_clock x schedulers x issue_efficiency / (instructions
                            per byte)

nor faster than its busiest pipe allows (FP32: ``fp32_lanes_per_sm / 32`` warp instructions per
clock; MUFU 16 / 32; SHFL 32 / 32, per SM, from the CUDA C++ Programming Guide's arithmetic
throughput table), nor than HBM (``memory_bandwidth x bandwidth_efficiency``). The estimate is
the lowest of the three.

GQA: a kv head's query heads are tiled 4 rows per thread block (``kAttnRowsPerBlock``), and the
group size is a run-time value, not a template argument, so every group size runs the same
instantiation: a group of 1 runs one row (the other rows' code is branched over), a group of 8
runs two tiles of 4 rows, each streaming the same K/V (HBM reads it once, L2 serves the second).
Instructions per HBM byte: the sum over a kv head's tiles of the loop's instructions at that
tile's row count, over the K/V bytes read once.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass

from bench.sass.disasm import Kernel
from bench.sass.loop import LoopProfile, profile_loop
from pagedkv.tools.costmodel import DevicePreset

__all__ = ["ROWS_PER_TILE", "DecodeCost", "Estimate", "attention_kernels", "decode_cost",
           "estimate", "kernel_label", "occupancy"]

ROWS_PER_TILE = 4  # csrc/kernels/attention_launch.h: kAttnRowsPerBlock
MUFU_PER_SM_CLOCK = 16
SHFL_PER_SM_CLOCK = 32
REGISTERS_PER_SM = 65536  # both sm_80 and sm_90: 64K 32-bit registers, at most 64 warps
MAX_WARPS_PER_SM = 64

_TYPES = {"__nv_bfloat16": "bf16", "__half": "f16", "float": "f32",
          "pagedkv::fp8_e4m3": "fp8_e4m3", "pagedkv::fp8_e5m2": "fp8_e5m2",
          "signed char": "int8", "pagedkv::int4x2": "int4",
          "unsigned char": "u8", "unsigned short": "u16", "unsigned int": "u32"}
# The CUDA-core kernel: <query, cache, head> or, for caches quantized per (token, head),
# <AnyQuery, cache, head, true> (one instantiation for every query dtype: "any").
_ATTENTION = re.compile(r"paged_attention_kernel<([^,]+), ([^,]+), (\d+)(?:, (true|false))?>")


def _attention_types(m: re.Match) -> tuple[str, str, int]:
    """(query dtype, cache, padded head) of a CUDA-core kernel's template arguments; a cache
    with row scales is "int8", "int4" or "fp8_e4m3/row" ("any" query dtype)."""
    query = "any" if m[1].endswith("AnyQuery") else _TYPES.get(m[1], m[1])
    cache = _TYPES.get(m[2], m[2])
    if m[4] == "true" and cache.startswith("fp8"):
        cache += "/row"
    return query, cache, int(m[3])


def kernel_label(kernel: Kernel) -> str:
    """A short name: ``attention bf16/bf16 h128``, ``reduce bf16``, ``copy_blocks uint4``..."""
    name = kernel.demangled or kernel.name
    if m := _ATTENTION.search(name):
        query, cache, head = _attention_types(m)
        return f"attention {query}/{cache} h{head}"
    if m := re.search(r"(\w+)_kernel<([^>]*)>", name):
        args = "/".join(_TYPES.get(a.strip(), a.strip()) for a in m[2].split(","))
        base = m[1].removeprefix("paged_attention_")
        return f"{base} {args}"
    return name


def attention_kernels(kernels: list[Kernel]) -> dict[tuple[str, str, str, int], Kernel]:
    """``(arch, query dtype, cache dtype, padded head) -> kernel`` of the decode kernels."""
    found = {}
    for k in kernels:
        if m := _ATTENTION.search(k.demangled or ""):
            found[(k.arch, *_attention_types(m))] = k
    return found


def occupancy(registers: int) -> int:
    """Warps per SM the register file allows (allocation: 256 registers per warp at a time)."""
    per_warp = math.ceil(max(registers, 1) * 32 / 256) * 256
    return min(MAX_WARPS_PER_SM, REGISTERS_PER_SM // per_warp)


@dataclass(frozen=True, slots=True)
class DecodeCost:
    """What the decode loop issues per byte of K/V read from HBM, for one GQA group size."""

    group: int
    tiles: int
    instructions: float  # per HBM byte
    fp32: float
    mufu: float
    shfl: float
    classes: dict[str, float]  # instructions of each class per KiB of K/V


def decode_cost(kernel: Kernel, group: int) -> DecodeCost:
    """The loop's cost per K/V byte when ``group`` query heads share a kv head."""
    if group < 1:
        raise ValueError(f"group must be >= 1, got {group}")
    tiles = math.ceil(group / ROWS_PER_TILE)
    profiles: list[LoopProfile] = []
    for t in range(tiles):
        p = profile_loop(kernel, rows=min(ROWS_PER_TILE, group - t * ROWS_PER_TILE))
        if p is None:
            raise ValueError(f"{kernel_label(kernel)} has no main loop")
        profiles.append(p)
    kv = profiles[0].kv_bytes
    classes: dict[str, float] = {}
    for p in profiles:
        for c, n in p.classes.items():
            classes[c] = classes.get(c, 0.0) + n * 1024 / kv

    def per_byte(*names: str) -> float:
        return sum(classes.get(n, 0.0) for n in names) / 1024

    return DecodeCost(group, tiles, sum(p.instructions for p in profiles) / kv,
                      per_byte("ffma", "fadd", "fmul"), per_byte("mufu"), per_byte("shfl"),
                      classes)


@dataclass(frozen=True, slots=True)
class Estimate:
    device: str
    bound: str  # "issue", "fp32", "mufu", "shfl" or "hbm"
    bytes_per_clock_sm: float  # what the loop streams per SM clock at its bound (not HBM)
    issue_bandwidth: float  # B/s the kernel's busiest limit allows, all SMs
    hbm_bandwidth: float  # B/s: memory_bandwidth x bandwidth_efficiency
    bandwidth: float  # the lower of the two
    fraction_of_hbm: float  # bandwidth / memory_bandwidth (the peak)

    def seconds(self, kv_bytes: float) -> float:
        return kv_bytes / self.bandwidth

    def to_dict(self) -> dict:
        return asdict(self)


def estimate(cost: DecodeCost, device: DevicePreset) -> Estimate:
    """The estimated streaming rate of the decode loop on ``device``."""
    if not device.sm_count or not device.sm_clock:
        raise ValueError(f"device {device.name} has no SM figures (sm_count, sm_clock)")
    # Clocks per byte, per SM, under each limit.
    limits = {
        "issue": cost.instructions / (device.schedulers_per_sm * device.issue_efficiency),
        "fp32": cost.fp32 / (device.fp32_lanes_per_sm / 32),
        "mufu": cost.mufu / (MUFU_PER_SM_CLOCK / 32),
        "shfl": cost.shfl / (SHFL_PER_SM_CLOCK / 32),
    }
    bound = max(limits, key=limits.get)
    per_clock = 1 / limits[bound]
    issue_bw = per_clock * device.sm_clock * device.sm_count
    hbm_bw = device.memory_bandwidth * device.bandwidth_efficiency
    if hbm_bw < issue_bw:
        bound = "hbm"
    bandwidth = min(issue_bw, hbm_bw)
    return Estimate(device.name, bound, per_clock, issue_bw, hbm_bw, bandwidth,
                    bandwidth / device.memory_bandwidth)
