"""CUDA paged attention: decode and chunked prefill on a GPU, timed with CUDA events (median),
reported as GB/s of the K/V, query and output bytes and as a fraction of the device copy bandwidth
measured in the same run, with the pure-PyTorch reference and torch SDPA on a contiguous cache of
the same tokens as baselines.

python -m bench.bench_attention_cuda [--quick] [--device cuda|cpu]   (cpu: a smoke test)
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

import pagedkv
from bench.harness import Row, measure_bandwidth, median_ms, print_table, write_json
from pagedkv.ops import reference


@dataclass(frozen=True)
class Shape:
    num_seqs: int
    seq_len: int
    num_heads: int = 32
    num_kv_heads: int = 8
    head_size: int = 128
    dtype: torch.dtype = torch.bfloat16
    cache_dtype: torch.dtype | None = None
    block_size: int = 16
    query_len: int = 1  # > 1: chunked prefill, the last query_len positions of each sequence

    def __str__(self) -> str:
        kind = "decode" if self.query_len == 1 else f"prefill q{self.query_len}"
        cache = str(self.cache_dtype or self.dtype).removeprefix("torch.")
        return (f"{kind} {self.num_seqs}x{self.seq_len} {self.num_heads}/{self.num_kv_heads} "
                f"h{self.head_size} {cache} bs{self.block_size}")


SHAPES = [
    Shape(32, 4096),  # the headline row: 32 x 4096 GQA decode, bf16, head 128
    Shape(8, 2048),
    Shape(1, 32768),
    Shape(128, 1024),
    Shape(32, 2048, num_kv_heads=32, dtype=torch.float16),
    Shape(32, 4096, cache_dtype=torch.float8_e4m3fn),
    Shape(32, 4096, head_size=64, block_size=1),
    Shape(16, 4096, num_heads=16, num_kv_heads=4, head_size=256),
    Shape(4, 4096, query_len=512),
]


def make_args(s: Shape, dev: torch.device) -> dict:
    cache_dtype = s.cache_dtype or s.dtype
    blocks_per_seq = math.ceil(s.seq_len / s.block_size)
    num_blocks = s.num_seqs * blocks_per_seq + 1
    shape = (num_blocks, s.num_kv_heads, s.block_size, s.head_size)
    fp8 = cache_dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    scale = torch.tensor([0.02], device=dev) if fp8 else None
    table = torch.randperm(num_blocks - 1, device=dev)[: s.num_seqs * blocks_per_seq] + 1
    num_tokens = s.num_seqs * s.query_len
    query = torch.randn(num_tokens, s.num_heads, s.head_size, device=dev, dtype=s.dtype)
    qsl = None
    if s.query_len > 1:
        qsl = torch.arange(0, num_tokens + 1, s.query_len, dtype=torch.int32, device=dev)
    return dict(
        out=torch.empty_like(query), query=query,
        key_cache=torch.randn(shape, device=dev).to(cache_dtype),
        value_cache=torch.randn(shape, device=dev).to(cache_dtype),
        block_tables=table.view(s.num_seqs, blocks_per_seq).int(),
        seq_lens=torch.full((s.num_seqs,), s.seq_len, dtype=torch.int32, device=dev),
        query_start_loc=qsl, max_seq_len=s.seq_len, max_query_len=s.query_len,
        scale=s.head_size**-0.5, alibi_slopes=None, sliding_window=-1, soft_cap=0.0,
        k_scale=scale, v_scale=scale, lse_out=None,
    )


def contiguous_sdpa(s: Shape, args: dict):
    dev = args["query"].device
    k = torch.randn(s.num_seqs, s.num_kv_heads, s.seq_len, s.head_size, device=dev,
                    dtype=s.dtype)
    v = torch.randn_like(k)
    q = args["query"].view(s.num_seqs, s.query_len, s.num_heads, s.head_size).transpose(1, 2)
    mask = None
    if s.query_len > 1:  # the queries are the last positions: a bottom-right aligned causal mask
        pos = torch.arange(s.seq_len, device=dev)
        mask = pos[None, :] <= pos[-s.query_len:, None]
    return lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


def bench(s: Shape, device: torch.device, with_reference: bool) -> Row:
    args = make_args(s, device)
    kv = 2 * s.num_seqs * s.seq_len * s.num_kv_heads * s.head_size
    nbytes = kv * args["key_cache"].element_size() + 2 * args["query"].nbytes
    row = Row("paged_attention", str(s),
              median_ms(lambda: pagedkv.ops.paged_attention(**args), device, repeat=30),
              nbytes / 1e9, "copy")
    try:
        row.baselines_ms["sdpa contiguous"] = median_ms(contiguous_sdpa(s, args), device,
                                                        repeat=30)
    except (RuntimeError, torch.OutOfMemoryError) as e:
        print(f"  sdpa baseline of {s} skipped: {str(e).splitlines()[0]}")
    if with_reference and s.num_seqs * s.seq_len * s.query_len <= 1 << 18:
        ref_args = dict(args, out=torch.empty_like(args["out"]))
        row.baselines_ms["reference"] = median_ms(
            lambda: reference.paged_attention(**ref_args), device, warmup=1, repeat=3)
    return row


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the first two shapes")
    parser.add_argument("--no-reference", action="store_true")
    parser.add_argument("--device", default="cuda")
    opts = parser.parse_args(argv)
    device = torch.device(opts.device)
    bandwidth = measure_bandwidth(device)
    rows = []
    for s in SHAPES[:2] if opts.quick else SHAPES:
        rows.append(bench(s, device, not opts.no_reference).finish(bandwidth))
        if device.type == "cuda":
            torch.cuda.empty_cache()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print_table(f"paged_attention on {name}", rows, bandwidth)
    print(f"wrote {write_json('attention_cuda', rows, bandwidth, device)}")


if __name__ == "__main__":
    main()
