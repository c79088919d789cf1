"""Decode attention microbenchmark: pagedkv's paged_attention against two baselines.

Each row (sequences x context, 32 query heads / 8 kv heads, head size 128) reports the median
time, the K/V bytes read per second, that rate as a fraction of the machine's read bandwidth,
and the speedup over
  reference   gather each sequence's blocks (pagedkv.ops.reference.gather_kv) + torch SDPA
  contiguous  torch SDPA on a contiguous [seqs, kv_heads, context, head] cache of the same tokens
Every K/V tensor is allocated as pagedkv.PagedKVCache allocates its caches
(pagedkv.cache.paged_cache.zeros_kv:
on the CPU, backed by huge pages where Linux allows it).

    python bench/bench_attention.py [--quick] [--device cpu|cuda]

prints a table and writes bench/results/attention.json (each row names the CPU kernels in use,
base, avx2 or avx512, as cpu_kernel; null on a GPU).

The bandwidth is measured in the same loop as the op: every call of the op is followed by a
torch.sum over 256 MiB (8x a 32 MiB L3), and the fraction is the median over those pairs of
(K/V bytes / op time) / (probe bytes / probe time). Other load on a shared machine then weighs
on both sides of each ratio alike; the "bw" column is the median probe rate.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import pagedkv
from pagedkv.cache.paged_cache import zeros_kv
from pagedkv.ops import reference

ROWS = [(8, 2048), (32, 1024), (1, 16384), (64, 512)]
BLOCK_SIZES = [16, 32]
DTYPES = [torch.bfloat16, torch.float32]
NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE = 32, 8, 128
RESULTS = Path(__file__).parent / "results" / "attention.json"


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(fn, device: torch.device, min_reps: int, min_time: float) -> float:
    fn()
    sync(device)
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < min_reps or time.perf_counter() - start < min_time:
        t = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def paired_with_probe(fn, probe: torch.Tensor, min_reps: int, min_time: float):
    """Times fn and a torch.sum over probe alternately. Returns the median seconds of fn, the
    median bytes per second of the probe, and the median over the pairs of 1 / (fn seconds x
    probe bytes per second): fn's bytes over that, per pair, is its bandwidth fraction."""
    device = probe.device
    probe_bytes = probe.numel() * probe.element_size()
    fn()
    probe.sum()
    sync(device)
    ours, rates, per_pair = [], [], []
    start = time.perf_counter()
    while len(ours) < min_reps or time.perf_counter() - start < min_time:
        t0 = time.perf_counter()
        fn()
        sync(device)
        t1 = time.perf_counter()
        probe.sum()
        sync(device)
        t2 = time.perf_counter()
        ours.append(t1 - t0)
        rates.append(probe_bytes / (t2 - t1))
        per_pair.append(1.0 / ((t1 - t0) * rates[-1]))
    return statistics.median(ours), statistics.median(rates), statistics.median(per_pair)


def make_row(num_seqs: int, seq_len: int, block_size: int, dtype: torch.dtype, device):
    blocks_per_seq = seq_len // block_size
    num_blocks = num_seqs * blocks_per_seq + 1
    shape = (num_blocks, NUM_KV_HEADS, block_size, HEAD_SIZE)
    key_cache = zeros_kv(shape, dtype, device).normal_()  # allocated as PagedKVCache does
    value_cache = zeros_kv(shape, dtype, device).normal_()
    table = torch.randperm(num_blocks - 1, device=device)[: num_seqs * blocks_per_seq] + 1
    return dict(
        query=torch.randn(num_seqs, NUM_HEADS, HEAD_SIZE, device=device).to(dtype),
        key_cache=key_cache,
        value_cache=value_cache,
        block_tables=table.view(num_seqs, blocks_per_seq).int(),
        seq_lens=torch.full((num_seqs,), seq_len, dtype=torch.int32, device=device),
    )


def pagedkv_fn(row: dict, seq_len: int):
    out = torch.empty_like(row["query"])
    args = (row["query"], row["key_cache"], row["value_cache"], row["block_tables"],
            row["seq_lens"], None, seq_len, 1, HEAD_SIZE**-0.5)
    return lambda: pagedkv.ops.paged_attention(out, *args)


def reference_fn(row: dict, seq_len: int):
    """Per sequence: gather its blocks, then SDPA."""
    def run():
        for i in range(row["query"].shape[0]):
            k, v = reference.gather_kv(row["key_cache"], row["value_cache"],
                                       row["block_tables"][i], seq_len)
            F.scaled_dot_product_attention(row["query"][i, :, None], k.transpose(0, 1),
                                           v.transpose(0, 1), enable_gqa=True)
    return run


def contiguous_fn(row: dict, seq_len: int):
    num_seqs = row["query"].shape[0]
    shape = (num_seqs, NUM_KV_HEADS, seq_len, HEAD_SIZE)
    k = zeros_kv(shape, row["query"].dtype, row["query"].device).normal_()
    v = zeros_kv(shape, row["query"].dtype, row["query"].device).normal_()
    q = row["query"][:, :, None]
    return lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)


def run(quick: bool = False, device: str = "cpu") -> list[dict]:
    dev = torch.device(device)
    probe = torch.ones(2**26, device=dev)  # 256 MiB, summed after every call of the op
    rows = ROWS[:1] + ROWS[2:3] if quick else ROWS
    block_sizes = BLOCK_SIZES[:1] if quick else BLOCK_SIZES
    # The CPU kernels the op runs here (base, avx2, avx512), so results of machines compare.
    cpu_kernel = pagedkv.ops.cpu_attention_kernel(HEAD_SIZE) if dev.type == "cpu" else None
    results = []
    for dtype in DTYPES:
        for num_seqs, seq_len in rows:
            for block_size in block_sizes:
                row = make_row(num_seqs, seq_len, block_size, dtype, dev)
                kv_bytes = 2 * row["key_cache"].element_size() * num_seqs * seq_len * \
                    NUM_KV_HEADS * HEAD_SIZE
                ours, bandwidth, inverse = paired_with_probe(
                    pagedkv_fn(row, seq_len), probe, 5 if quick else 15, 0.3 if quick else 1.0)
                ref = median_seconds(reference_fn(row, seq_len), dev, 2, 0.0 if quick else 0.5)
                cont = median_seconds(contiguous_fn(row, seq_len), dev, 2, 0.0 if quick else 0.5)
                results.append(dict(
                    dtype=str(dtype).removeprefix("torch."), num_seqs=num_seqs, seq_len=seq_len,
                    block_size=block_size, threads=torch.get_num_threads(), device=device,
                    cpu_kernel=cpu_kernel,
                    ms=ours * 1e3, kv_bytes=kv_bytes, gbps=kv_bytes / ours / 1e9,
                    read_gbps=bandwidth / 1e9, bw_fraction=kv_bytes * inverse,
                    reference_ms=ref * 1e3, contiguous_sdpa_ms=cont * 1e3,
                    speedup_reference=ref / ours, speedup_contiguous=cont / ours,
                ))
                del row
    return results


def print_table(results: list[dict]) -> None:
    if not results:
        return
    kernel = f" ({results[0]['cpu_kernel']} kernels)" if results[0]["cpu_kernel"] else ""
    print(f"{results[0]['threads']} threads, {results[0]['device']}{kernel}; bw: torch.sum over "
          "256 MiB after every call (median); of bw: median over those pairs")
    head = (f"{'dtype':>9} {'seqs x ctx':>11} {'bs':>3} {'ms':>8} {'GB/s':>6} {'bw':>5} "
            f"{'of bw':>6} {'ref ms':>8} {'x ref':>6} {'sdpa ms':>8} {'x sdpa':>6}")
    print(head)
    for r in results:
        print(f"{r['dtype']:>9} {r['num_seqs']:>4} x {r['seq_len']:<5} {r['block_size']:>3} "
              f"{r['ms']:8.2f} {r['gbps']:6.1f} {r['read_gbps']:5.1f} {r['bw_fraction']:6.0%} "
              f"{r['reference_ms']:8.1f} {r['speedup_reference']:6.1f} "
              f"{r['contiguous_sdpa_ms']:8.1f} {r['speedup_contiguous']:6.1f}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rows and repetitions")
    parser.add_argument("--device", default="cpu")
    opts = parser.parse_args(argv)
    results = run(quick=opts.quick, device=opts.device)
    print_table(results)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=1))
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
