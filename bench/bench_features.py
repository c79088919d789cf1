"""What attention features cost: paged_attention with a feature against the same call without it.

Each row times the plain op (A) and the op with the feature (B) on the same inputs, alternately,
every call followed by a torch.sum over 256 MiB (8x a 32 MiB L3, so K/V come from DRAM and the
probe measures the read bandwidth of the moment). It reports both medians, the K/V bytes per
second of B (decode; GFLOP/s for prefill) and its fraction of the probe, and the median over the
pairs of B / A: the feature's cost in the same run, which the noise of a shared machine weighs
on alike.

Features (bf16, 32 query heads / 8 kv heads, decode and chunked prefill):
  sinks     gpt-oss's attention sinks, one float32 logit per query head, at head size 128;
  head512   head size 512 (Gemma 4's global layers) against 128 over the same tokens: B reads
            4x the bytes and does 4x the FLOPs, so its GB/s and GFLOP/s are the figures and
            x plain near 4 means the same rate.

    python bench/bench_features.py [--quick] [--device cpu|cuda]

prints the table and writes bench/results/features.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

import pagedkv
from bench.bench_attention import (
    HEAD_SIZE,
    NUM_HEADS,
    NUM_KV_HEADS,
    make_prefill_row,
    make_row,
    prefill_flops,
    sync,
)

RESULTS = Path(__file__).parent / "results" / "features.json"
DECODE_ROWS = [(8, 2048), (1, 16384)]
PREFILL_ROWS = [(4, 512, 1024)]


def paired(plain, featured, probe: torch.Tensor, min_reps: int, min_time: float) -> dict:
    """plain and featured alternately, each followed by the probe: their medians, the probe's
    median rate and the median of featured / plain and of featured's seconds x probe rate."""
    device = probe.device
    probe_bytes = probe.numel() * probe.element_size()

    def timed(fn) -> tuple[float, float]:
        t0 = time.perf_counter()
        fn()
        sync(device)
        t1 = time.perf_counter()
        probe.sum()
        sync(device)
        return t1 - t0, probe_bytes / (time.perf_counter() - t1)

    plain(), featured()
    a, b, ratios, rates, inverse = [], [], [], [], []
    start = time.perf_counter()
    while len(a) < min_reps or time.perf_counter() - start < min_time:
        ta, ra = timed(plain)
        tb, rb = timed(featured)
        a.append(ta)
        b.append(tb)
        ratios.append(tb / ta)
        rates += [ra, rb]
        inverse.append(1.0 / (tb * rb))
    return dict(plain_ms=statistics.median(a) * 1e3, ms=statistics.median(b) * 1e3,
                ratio=statistics.median(ratios), read_gbps=statistics.median(rates) / 1e9,
                inverse=statistics.median(inverse), pairs=len(a))


def decode_call(num_seqs: int, seq_len: int, dev, head_size: int = HEAD_SIZE, **kw):
    """A decode call (bf16, block size 16) and the K/V bytes it reads."""
    row = make_row(num_seqs, seq_len, 16, torch.bfloat16, dev, head_size)
    out = torch.empty_like(row["query"])
    args = (row["query"], row["key_cache"], row["value_cache"], row["block_tables"],
            row["seq_lens"], None, seq_len, 1, head_size**-0.5)
    kv_bytes = 2 * row["key_cache"].element_size() * num_seqs * seq_len * NUM_KV_HEADS * head_size
    return (lambda: pagedkv.ops.paged_attention(out, *args, **kw)), kv_bytes


def prefill_call(num_seqs: int, new: int, cached: int, dev, head_size: int = HEAD_SIZE, **kw):
    """A chunked prefill call (bf16, GQA 4) and its FLOPs."""
    row = make_prefill_row(num_seqs, new, cached, NUM_KV_HEADS, torch.bfloat16, dev,
                           head_size=head_size)
    args = (row["out"], row["query"], row["key_cache"], row["value_cache"], row["block_tables"],
            row["seq_lens"], row["query_start_loc"], row["max_seq_len"], row["max_query_len"],
            head_size**-0.5)
    flops = prefill_flops(num_seqs, new, cached, head_size)
    return (lambda: pagedkv.ops.paged_attention(*args, **kw)), flops


def feature_rows(quick: bool, dev: torch.device, probe: torch.Tensor) -> list[dict]:
    reps, seconds = (3, 0.0) if quick else (9, 1.0)
    sinks = torch.randn(NUM_HEADS, device=dev)
    # feature -> (plain kwargs, featured kwargs): head size and the op's keywords
    features = {"sinks": ({}, {"sinks": sinks}), "head512": ({}, {"head_size": 512})}
    results = []
    for feature, (plain_kw, kw) in features.items():
        for num_seqs, seq_len in DECODE_ROWS[:1] if quick else DECODE_ROWS:
            plain, _ = decode_call(num_seqs, seq_len, dev, **plain_kw)
            featured, kv_bytes = decode_call(num_seqs, seq_len, dev, **kw)
            r = paired(plain, featured, probe, reps, seconds)
            results.append(dict(feature=feature, kind="decode", shape=f"{num_seqs} x {seq_len}",
                                kv_bytes=kv_bytes, gbps=kv_bytes / r["ms"] * 1e3 / 1e9,
                                bw_fraction=kv_bytes * r.pop("inverse"), **r))
        for num_seqs, new, cached in PREFILL_ROWS:
            plain, _ = prefill_call(num_seqs, new, cached, dev, **plain_kw)
            featured, flops = prefill_call(num_seqs, new, cached, dev, **kw)
            r = paired(plain, featured, probe, max(reps // 3, 2), seconds)
            r.pop("inverse")  # compute-bound: GFLOP/s, not a fraction of the read bandwidth
            results.append(dict(feature=feature, kind="prefill",
                                shape=f"{num_seqs} x {new} + {cached}",
                                gflops=flops / r["ms"] * 1e3 / 1e9, **r))
    for r in results:
        r.update(dtype="bfloat16", device=str(dev), threads=torch.get_num_threads())
    return results


def print_table(results: list[dict]) -> None:
    print(f"\nfeature cost, {results[0]['threads']} threads, {results[0]['device']}: plain and "
          "featured calls alternate, each followed by torch.sum over 256 MiB (bw: its median); "
          "x plain: median over the pairs")
    print(f"{'feature':>8} {'kind':>8} {'shape':>16} {'plain ms':>9} {'ms':>9} {'rate':>13} "
          f"{'bw':>5} {'of bw':>6} {'x plain':>8}")
    for r in results:
        rate = (f"{r['gbps']:6.1f} GB/s" if "gbps" in r else f"{r['gflops']:5.1f} GFLOP/s")
        frac = f"{r['bw_fraction']:6.0%}" if "bw_fraction" in r else f"{'-':>6}"
        print(f"{r['feature']:>8} {r['kind']:>8} {r['shape']:>16} {r['plain_ms']:9.2f} "
              f"{r['ms']:9.2f} {rate:>13} {r['read_gbps']:5.1f} {frac} {r['ratio']:8.3f}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rows and repetitions")
    parser.add_argument("--device", default="cpu")
    opts = parser.parse_args(argv)
    dev = torch.device(opts.device)
    probe = torch.ones(2**26, device=dev)
    results = feature_rows(opts.quick, dev, probe)
    print_table(results)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=1))
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
