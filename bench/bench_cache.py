"""Microbenchmarks of the cache ops: reshape_and_cache, copy_blocks, swap_blocks, and the MLA
cache's concat_and_cache_mla and gather_cache (DeepSeek's 512 + 64 latent rows).

python -m bench.bench_cache [--device cpu|cuda] [--quick]
"""

from __future__ import annotations

import argparse

import torch

import pagedkv
from bench.harness import Row, measure_bandwidth, median_ms, print_table, write_json
from pagedkv.ops import reference

HEADS, HEAD_SIZE, BLOCK = 8, 128, 16


def bench_reshape_and_cache(device, dtype, num_tokens, with_reference) -> Row:
    num_blocks = 2 * num_tokens // BLOCK
    kc = torch.empty(num_blocks, HEADS, BLOCK, HEAD_SIZE, dtype=dtype, device=device)
    vc = torch.empty_like(kc)
    key = torch.randn(num_tokens, HEADS, HEAD_SIZE, device=device).to(dtype)
    value = torch.randn_like(key)
    slots = torch.randperm(num_blocks * BLOCK, device=device)[:num_tokens]
    nbytes = 2 * 2 * key.numel() * key.element_size() + slots.numel() * 8
    row = Row("reshape_and_cache", f"{num_tokens} tok {HEADS}x{HEAD_SIZE} {_name(dtype)}",
              median_ms(lambda: pagedkv.reshape_and_cache(key, value, kc, vc, slots), device),
              nbytes / 1e9, "copy")
    if with_reference:
        row.baselines_ms["reference"] = median_ms(
            lambda: reference.reshape_and_cache(key, value, kc, vc, slots), device, repeat=3)
    return row


MLA_LORA, MLA_ROPE = 512, 64


def bench_concat_and_cache_mla(device, dtype, cache_dtype, num_tokens, with_reference) -> Row:
    width = MLA_LORA + MLA_ROPE
    num_blocks = 2 * num_tokens // BLOCK
    cache = torch.empty(num_blocks, BLOCK, width, dtype=cache_dtype, device=device)
    kv_c = torch.randn(num_tokens, MLA_LORA, device=device).to(dtype)
    k_pe = torch.randn(num_tokens, MLA_ROPE, device=device).to(dtype)
    slots = torch.randperm(num_blocks * BLOCK, device=device)[:num_tokens]
    scale = torch.tensor([0.05], device=device) if cache_dtype != dtype else None
    cache_bytes = torch.empty((), dtype=cache_dtype).element_size()
    nbytes = num_tokens * width * (kv_c.element_size() + cache_bytes) + slots.numel() * 8
    row = Row("concat_and_cache_mla", f"{num_tokens} tok {width} {_name(dtype)}->"
              f"{_name(cache_dtype)}",
              median_ms(lambda: pagedkv.concat_and_cache_mla(kv_c, k_pe, cache, slots, scale),
                        device), nbytes / 1e9, "copy")
    if with_reference:
        row.baselines_ms["reference"] = median_ms(
            lambda: reference.concat_and_cache_mla(kv_c, k_pe, cache, slots, scale), device,
            repeat=3)
    return row


def bench_gather_cache(device, cache_dtype, out_dtype, batch, seq_len, with_reference) -> Row:
    """Each sequence's rows through a shuffled block table, as a prefill over a cached prefix
    reads them."""
    width = MLA_LORA + MLA_ROPE
    per_seq = seq_len // BLOCK
    cache = torch.zeros(batch * per_seq, BLOCK, width, dtype=cache_dtype, device=device)
    table = torch.randperm(batch * per_seq).view(batch, per_seq).int().to(device)
    cu = torch.arange(0, (batch + 1) * seq_len, seq_len, dtype=torch.int32, device=device)
    out = torch.empty(batch * seq_len, width, dtype=out_dtype, device=device)
    scale = torch.tensor([0.05], device=device) if out_dtype != cache_dtype else None
    nbytes = out.numel() * (out.element_size() + cache.element_size())
    row = Row("gather_cache", f"{batch} x {seq_len} tok {_name(cache_dtype)}->{_name(out_dtype)}",
              median_ms(lambda: pagedkv.gather_cache(cache, table, cu, out, scale), device),
              nbytes / 1e9, "copy")
    if with_reference:
        row.baselines_ms["reference"] = median_ms(
            lambda: reference.gather_cache(cache, table, cu, out, scale), device, repeat=3)
    return row


def bench_copy_blocks(device, dtype, num_layers, num_pairs, with_reference) -> Row:
    num_blocks = 4 * num_pairs
    shape = (num_blocks, HEADS, BLOCK, HEAD_SIZE)
    keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
    values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
    perm = torch.randperm(num_blocks)
    mapping = torch.stack([perm[:num_pairs], perm[num_pairs:2 * num_pairs]], 1).to(device)
    block_bytes = HEADS * BLOCK * HEAD_SIZE * keys[0].element_size()
    nbytes = 2 * 2 * num_layers * num_pairs * block_bytes
    row = Row("copy_blocks", f"{num_layers} layers x {num_pairs} pairs {_name(dtype)}",
              median_ms(lambda: pagedkv.copy_blocks(keys, values, mapping), device),
              nbytes / 1e9, "copy")
    if with_reference:
        row.baselines_ms["reference"] = median_ms(
            lambda: reference.copy_blocks(keys, values, mapping), device, repeat=3)
    return row


def bench_swap_blocks(device, dtype, num_pairs) -> Row:
    num_blocks = 2 * num_pairs
    src = torch.zeros(num_blocks, HEADS, BLOCK, HEAD_SIZE, dtype=dtype, device=device)
    pin = device.type == "cuda"
    dst = torch.zeros(num_blocks, HEADS, BLOCK, HEAD_SIZE, dtype=dtype, pin_memory=pin)
    mapping = torch.stack([torch.randperm(num_blocks)[:num_pairs],
                           torch.randperm(num_blocks)[:num_pairs]], 1)
    nbytes = 2 * num_pairs * src[0].numel() * src.element_size()
    direction = "gpu->cpu" if pin else "cpu->cpu"
    return Row("swap_blocks", f"{num_pairs} blocks {direction} {_name(dtype)}",
               median_ms(lambda: pagedkv.swap_blocks(src, dst, mapping), device),
               nbytes / 1e9, "copy")


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def run(device: torch.device, quick: bool = False) -> tuple[list[Row], dict[str, float]]:
    bandwidth = measure_bandwidth(device)
    scale = 1 if quick else 4
    rows = [
        bench_reshape_and_cache(device, torch.bfloat16, 8192 * scale, with_reference=True),
        bench_reshape_and_cache(device, torch.float32, 8192 * scale, with_reference=False),
        bench_copy_blocks(device, torch.bfloat16, 32, 64 * scale, with_reference=True),
        bench_copy_blocks(device, torch.float8_e4m3fn, 32, 64 * scale, with_reference=False),
        bench_swap_blocks(device, torch.bfloat16, 256 * scale),
        bench_concat_and_cache_mla(device, torch.bfloat16, torch.bfloat16, 8192 * scale,
                                   with_reference=True),
        bench_concat_and_cache_mla(device, torch.bfloat16, torch.float8_e4m3fn, 8192 * scale,
                                   with_reference=False),
        bench_gather_cache(device, torch.bfloat16, torch.bfloat16, 4, 2048 * scale,
                           with_reference=True),
        bench_gather_cache(device, torch.float8_e4m3fn, torch.bfloat16, 4, 2048 * scale,
                           with_reference=False),
    ]
    return [r.finish(bandwidth) for r in rows], bandwidth


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="smaller sizes")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    rows, bandwidth = run(device, args.quick)
    print_table(f"cache ops on {device} ({torch.get_num_threads()} threads)", rows, bandwidth)
    print(f"wrote {write_json('cache', rows, bandwidth, device)}")


if __name__ == "__main__":
    main()
