"""MLA attention microbenchmark: pagedkv's mla_attention (absorbed, DeepSeek's 512 + 64 latent).

Rows (bfloat16 queries and latent cache, block sizes 16 and 64):
  decode    8 sequences x 4096 cached tokens, 16 and 128 heads (DeepSeek-V3 at tp 8, and whole)
  mtp       the same with 2 query tokens per sequence (multi-token prediction, causal)
  prefill   2 sequences x 2048 new tokens over 2048 cached ones, 16 heads
FLOPs: 2 x 576 (S = Q K^T over the whole row) + 2 x 512 (O += P V over its first 512 elements)
per (head, visible key). On the CPU, every call is followed by the FMA peak probe
(pagedkv.ops.cpu_peak_gflops: 12 chains of the kernels' own FMA instruction on every thread) and
the fraction is the median over those pairs of the op's FLOP per CPU second over the probe's per
thread, so that other load on a shared machine weighs on both sides alike; with AVX512_BF16 the
rows are also given against the bf16 dot-product probe, run after every call as well. Two
copies of every row's cache are used in turn, so that each call reads its latent rows from
memory (2 x 38 MB for decode, past a 32 MiB L3). "GB/s" is the latent bytes a call reads
(each row once per head tile) per second.

    python -m bench.bench_attention_mla [--quick] [--device cpu|cuda]

prints the table and writes bench/results/attention_mla.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

import pagedkv
from bench.bench_attention import (
    median_seconds,
    of_peak,
    paired_with_peak,
    peak_gflops,
    sync,
)
from pagedkv.cache.paged_cache import zeros_kv

RANK, ROPE = 512, 64
WIDTH = RANK + ROPE
FLOPS_PER_PAIR = 2 * WIDTH + 2 * RANK
# (kind, sequences, new tokens, cached tokens before them, heads)
ROWS = [("decode", 8, 1, 4095, 16), ("decode", 8, 1, 4095, 128), ("mtp", 8, 2, 4094, 16),
        ("mtp", 8, 2, 4094, 128), ("prefill", 2, 2048, 2048, 16)]
BLOCK_SIZES = [16, 64]
RESULTS = Path(__file__).parent / "results" / "attention_mla.json"


def make_row(num_seqs: int, new: int, cached: int, heads: int, block_size: int, device,
             dtype: torch.dtype = torch.bfloat16) -> dict:
    seq_len = cached + new
    per_seq = -(-seq_len // block_size)
    num_blocks = num_seqs * per_seq + 1
    table = torch.randperm(num_blocks - 1, device=device)[:num_seqs * per_seq] + 1
    query = torch.randn(num_seqs * new, heads, WIDTH, device=device).to(dtype)
    decode = new == 1
    return dict(
        out=torch.empty(num_seqs * new, heads, RANK, device=device, dtype=dtype),
        query=query,
        kv_cache=zeros_kv((num_blocks, block_size, WIDTH), dtype, device).normal_(),
        block_tables=table.view(num_seqs, per_seq).int(),
        seq_lens=torch.full((num_seqs,), seq_len, dtype=torch.int32, device=device),
        query_start_loc=None if decode else torch.arange(
            0, num_seqs * new + 1, new, dtype=torch.int32, device=device),
        max_seq_len=seq_len, max_query_len=new, scale=(128 + ROPE) ** -0.5,
    )


def flops(num_seqs: int, new: int, cached: int, heads: int) -> float:
    """FLOPs per (head, visible key): query i of new sees cached + i + 1 keys."""
    visible = new * cached + new * (new + 1) // 2
    return float(FLOPS_PER_PAIR * heads * visible * num_seqs)


def latent_bytes(num_seqs: int, new: int, cached: int, heads: int) -> float:
    """Latent bytes one call reads: each row once per tile of at most 96 (head, query) rows."""
    head_tiles = -(-heads // 96)
    q_tiles = -(-new // max(1, 96 // -(-heads // head_tiles)))
    return float(num_seqs * (cached + new) * WIDTH * 2 * head_tiles * q_tiles)


def run(quick: bool = False, device: str = "cpu") -> list[dict]:
    dev = torch.device(device)
    cpu = dev.type == "cpu"
    threads = torch.get_num_threads()
    cpu_kernel = pagedkv.ops.cpu_attention_kernel(WIDTH) if cpu else None
    # with AVX512_BF16, the bf16 dot-product probe after every call too
    kinds = ("fp32", "bf16") if cpu and peak_gflops("bf16") is not None else ("fp32",)
    rows = [r for r in ROWS if r[0] != "prefill"] if quick else ROWS
    results = []
    for kind, num_seqs, new, cached, heads in rows:
        for block_size in BLOCK_SIZES[:1] if quick else BLOCK_SIZES:
            copies = [make_row(num_seqs, new, cached, heads, block_size, dev) for _ in range(2)]
            turn = [0]

            def call(copies=copies, turn=turn):
                row = copies[turn[0]]
                turn[0] ^= 1
                pagedkv.ops.mla_attention(**row)
                sync(dev)

            work = flops(num_seqs, new, cached, heads)
            reps = 1 if kind == "prefill" else (3 if quick else 7)
            if cpu:
                walls, cpus, peaks, per_thread = paired_with_peak(call, reps, 0.0, threads, kinds)
            else:
                walls, cpus, peaks, per_thread = [median_seconds(call, dev, reps, 0.5)], [], {}, {}
            wall = statistics.median(walls)
            fraction = of_peak(work, cpus, per_thread.get("fp32", []))
            peak = statistics.median(peaks["fp32"]) if peaks.get("fp32") else None
            bf16_peak = statistics.median(peaks["bf16"]) if peaks.get("bf16") else None
            results.append(dict(
                kind=kind, num_seqs=num_seqs, new_tokens=new, cached_tokens=cached,
                num_heads=heads, block_size=block_size, dtype="bfloat16", threads=threads,
                device=str(dev), cpu_kernel=cpu_kernel, ms=wall * 1e3,
                gflop=work / 1e9, gflops=work / wall / 1e9,
                gflops_per_cpu_s=work / statistics.median(cpus) / 1e9 if cpus else None,
                latent_gbps=latent_bytes(num_seqs, new, cached, heads) / wall / 1e9,
                peak_gflops=peak, peak_fraction=fraction, bf16_peak_gflops=bf16_peak,
                bf16_peak_fraction=of_peak(work, cpus, per_thread.get("bf16", [])),
            ))
            del copies
    return results


def print_table(results: list[dict]) -> None:
    r0 = results[0]
    kernel = f" ({r0['cpu_kernel']} kernels)" if r0["cpu_kernel"] else ""
    bf16 = r0["bf16_peak_gflops"] is not None
    print(f"mla_attention, bf16, {r0['threads']} threads, {r0['device']}{kernel}; peak: FMA "
          "probe after every call (median, all threads); of peak: median over those pairs, per "
          "CPU second" + ("; of bf16: the same against the bf16 dot-product probe, also after "
                          "every call" if bf16 else ""))
    print(f"{'kind':>8} {'seqs x new + cached':>20} {'heads':>5} {'bs':>3} {'ms':>9} "
          f"{'GFLOP/s':>8} {'/CPU s':>7} {'GB/s':>6} {'peak':>6} {'of peak':>8}"
          + (f" {'of bf16':>8}" if bf16 else ""))
    for r in results:
        frac = f"{r['peak_fraction']:8.0%}" if r["peak_fraction"] is not None else f"{'-':>8}"
        peak = f"{r['peak_gflops']:6.0f}" if r["peak_gflops"] else f"{'-':>6}"
        line = (f"{r['kind']:>8} {r['num_seqs']:>3} x {r['new_tokens']:>4} + "
                f"{r['cached_tokens']:<6} {r['num_heads']:>5} {r['block_size']:>3} "
                f"{r['ms']:9.1f} {r['gflops']:8.1f} {r['gflops_per_cpu_s'] or 0:7.1f} "
                f"{r['latent_gbps']:6.1f} {peak} {frac}")
        if bf16:
            bf = r["bf16_peak_fraction"]
            line += f" {bf:8.0%}" if bf is not None else f" {'-':>8}"
        print(line)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="no prefill row, fewer repetitions")
    parser.add_argument("--device", default="cpu")
    opts = parser.parse_args(argv)
    results = run(quick=opts.quick, device=opts.device)
    print_table(results)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=1))
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
