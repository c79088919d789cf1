"""CUDA paged attention benchmark: median time by CUDA events, GB/s of K/V (+ q/out) traffic,
fraction of the measured device copy bandwidth, against the pure-PyTorch reference and torch SDPA
on a contiguous cache.

    python bench/bench_attention_cuda.py [--json out.json] [--quick]

Needs a GPU and the extension built with CUDA (pagedkv._C).
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

import pagedkv  # noqa: F401  (loads torch.ops.pagedkv)
from pagedkv import reference


@dataclass(frozen=True)
class Case:
    name: str
    num_seqs: int
    seq_len: int
    num_heads: int
    num_kv_heads: int
    head_size: int = 128
    dtype: torch.dtype = torch.bfloat16
    cache_dtype: torch.dtype | None = None
    block_size: int = 16
    query_len: int = 1  # > 1: varlen causal queries (the last query_len positions)


CASES = [
    Case("decode gqa 32x4096 bf16 h128", 32, 4096, 32, 8),
    Case("decode gqa 8x2048 bf16 h128", 8, 2048, 32, 8),
    Case("decode gqa 1x32768 bf16 h128 (split-K)", 1, 32768, 32, 8),
    Case("decode gqa 128x1024 bf16 h128", 128, 1024, 32, 8),
    Case("decode mha 32x2048 fp16 h128", 32, 2048, 32, 32, dtype=torch.float16),
    Case("decode gqa 32x4096 bf16 h128 fp8 cache", 32, 4096, 32, 8,
         cache_dtype=torch.float8_e4m3fn),
    Case("decode gqa 32x4096 bf16 h64 bs1", 32, 4096, 32, 8, head_size=64, block_size=1),
    Case("decode gqa 16x4096 bf16 h256", 16, 4096, 16, 4, head_size=256),
    Case("chunked prefill 4x4096 q512 bf16 h128", 4, 4096, 32, 8, query_len=512),
]


def median_ms(fn, iters: int) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


def copy_bandwidth_gbs() -> float:
    """Device-to-device copy of 1 GiB: bytes read + written per second."""
    src = torch.empty(1 << 28, dtype=torch.float32, device="cuda")
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), 20)
    return 2 * src.numel() * 4 / ms / 1e6


def make_inputs(c: Case) -> dict:
    dev = "cuda"
    cache_dtype = c.cache_dtype or c.dtype
    blocks_per_seq = math.ceil(c.seq_len / c.block_size)
    num_blocks = c.num_seqs * blocks_per_seq + 1
    shape = (num_blocks, c.num_kv_heads, c.block_size, c.head_size)
    k_scale = v_scale = None
    if cache_dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        k_scale = torch.tensor([0.02], device=dev)
        v_scale = torch.tensor([0.02], device=dev)
        key_cache = torch.randn(shape, device=dev).to(cache_dtype)
        value_cache = torch.randn(shape, device=dev).to(cache_dtype)
    else:
        key_cache = torch.randn(shape, device=dev, dtype=cache_dtype)
        value_cache = torch.randn(shape, device=dev, dtype=cache_dtype)
    perm = torch.randperm(num_blocks - 1, device=dev) + 1  # block 0: the null block
    block_tables = perm[: c.num_seqs * blocks_per_seq].view(c.num_seqs, -1).int()
    seq_lens = torch.full((c.num_seqs,), c.seq_len, dtype=torch.int32, device=dev)
    num_tokens = c.num_seqs * c.query_len
    query_start_loc = None
    if c.query_len > 1:
        query_start_loc = torch.arange(0, num_tokens + 1, c.query_len, dtype=torch.int32,
                                       device=dev)
    query = torch.randn(num_tokens, c.num_heads, c.head_size, device=dev, dtype=c.dtype)
    return dict(
        out=torch.empty_like(query), query=query, key_cache=key_cache, value_cache=value_cache,
        block_tables=block_tables, seq_lens=seq_lens, query_start_loc=query_start_loc,
        max_seq_len=c.seq_len, max_query_len=c.query_len, scale=c.head_size**-0.5,
        alibi_slopes=None, sliding_window=-1, soft_cap=0.0, k_scale=k_scale, v_scale=v_scale,
        lse_out=None,
    )


def traffic_bytes(c: Case, args: dict) -> int:
    kv = 2 * c.num_seqs * c.seq_len * c.num_kv_heads * c.head_size
    kv *= args["key_cache"].element_size()
    return kv + 2 * args["query"].numel() * args["query"].element_size()


def sdpa_fn(c: Case, args: dict):
    """torch SDPA on a contiguous [seqs, kv_heads, seq_len, head] cache (same bytes of K/V)."""
    dtype = c.dtype
    k = torch.randn(c.num_seqs, c.num_kv_heads, c.seq_len, c.head_size, device="cuda", dtype=dtype)
    v = torch.randn_like(k)
    q = args["query"].view(c.num_seqs, c.query_len, c.num_heads, c.head_size).transpose(1, 2)
    causal = c.query_len > 1
    if causal:  # the last query_len positions: SDPA's causal mask is top-left aligned
        pos = torch.arange(c.seq_len, device="cuda")
        qpos = pos[-c.query_len:]
        mask = pos[None, :] <= qpos[:, None]
        return lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    return lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)


def reference_fn(args: dict):
    fn = getattr(reference, "paged_attention", None)
    if fn is None:
        return None
    ref_args = dict(args)
    ref_args["out"] = torch.empty_like(args["out"])
    return lambda: fn(**ref_args)


def run(cases: list[Case], iters: int, with_reference: bool) -> dict:
    copy_gbs = copy_bandwidth_gbs()
    print(f"device: {torch.cuda.get_device_name(0)}; copy bandwidth {copy_gbs:.0f} GB/s")
    print(f"{'case':44} {'ms':>8} {'GB/s':>7} {'of copy':>7} {'sdpa ms':>8} {'ref ms':>8}")
    results = []
    for c in cases:
        args = make_inputs(c)
        ms = median_ms(lambda: torch.ops.pagedkv.paged_attention(**args), iters)
        gbs = traffic_bytes(c, args) / ms / 1e6
        row = dict(case=asdict(c) | {"dtype": str(c.dtype), "cache_dtype": str(c.cache_dtype)},
                   ms=ms, gbs=gbs, fraction_of_copy=gbs / copy_gbs)
        try:
            row["sdpa_ms"] = median_ms(sdpa_fn(c, args), iters)
        except (RuntimeError, torch.OutOfMemoryError) as e:
            row["sdpa_ms"] = None
            row["sdpa_error"] = str(e).splitlines()[0]
        ref = reference_fn(args) if with_reference and c.num_seqs * c.seq_len <= 1 << 17 else None
        row["reference_ms"] = median_ms(ref, 3) if ref is not None else None
        results.append(row)
        fmt = lambda x: f"{x:8.3f}" if x is not None else f"{'-':>8}"  # noqa: E731
        print(f"{c.name:44} {ms:8.3f} {gbs:7.0f} {gbs / copy_gbs:7.1%} {fmt(row['sdpa_ms'])} "
              f"{fmt(row['reference_ms'])}", flush=True)
        del args
        torch.cuda.empty_cache()
    return dict(device=torch.cuda.get_device_name(0), copy_gbs=copy_gbs, results=results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--quick", action="store_true", help="first two cases, 5 iterations")
    parser.add_argument("--no-reference", action="store_true")
    a = parser.parse_args()
    cases = CASES[:2] if a.quick else CASES
    out = run(cases, 5 if a.quick else 30, not a.no_reference)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
