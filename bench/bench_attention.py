"""Attention microbenchmark: pagedkv's paged_attention, decode and chunked prefill.

Decode rows (sequences x context, 32 query heads / 8 kv heads, head size 128) report the median
time, the K/V bytes read per second, that rate as a fraction of the machine's read bandwidth,
and the speedup over
  reference   gather each sequence's blocks (pagedkv.ops.reference.gather_kv) + torch SDPA
  contiguous  torch SDPA on a contiguous [seqs, kv_heads, context, head] cache of the same tokens
Prefill rows (sequences x new tokens over cached ones, causal, 32 query heads / 8 or 4 kv heads,
head size 128) report the median time, GFLOP/s (4 x head size per query head and visible key:
S = Q K^T and O += P V) and that rate as a fraction of the machine's measured peak.
Every K/V tensor is allocated as pagedkv.PagedKVCache allocates its caches
(pagedkv.cache.paged_cache.zeros_kv: on the CPU, backed by huge pages where Linux allows it).

    python bench/bench_attention.py [--quick] [--device cpu|cuda] [--only decode|prefill]

prints the tables and writes bench/results/attention.json (each row names the CPU kernels in
use, base, avx2, avx512 or avx512bf16, as cpu_kernel; null on a GPU).

Each ceiling is measured in the same loop as the op. Decode: every call of the op is followed by
a torch.sum over 256 MiB (8x a 32 MiB L3), and the fraction is the median over those pairs of
(K/V bytes / op time) / (probe bytes / probe time); the "bw" column is the median probe rate.
Prefill (CPU): every call is followed by pagedkv.ops.cpu_peak_gflops (12 independent chains of
the kernels' own FMA instruction on every thread), and the fraction is the median over the pairs
of the op's FLOP per CPU second (process time: all its threads) over the probe's per thread.
Other load on a shared machine then weighs on both sides of each ratio alike; the "GFLOP/s"
column is wall-clock, "peak" the median probe (all threads). With AVX512_BF16, bf16 rows are
also given as a fraction of the bf16 dot-product peak ("of bf16 peak").
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
# Chunked prefill: (sequences, new tokens, cached tokens before them), each with GQA 4 and 8.
PREFILL_ROWS = [(4, 512, 1024), (2, 2048, 2048)]
PREFILL_KV_HEADS = [8, 4]
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


def make_row(num_seqs: int, seq_len: int, block_size: int, dtype: torch.dtype, device,
             head_size: int = HEAD_SIZE):
    blocks_per_seq = seq_len // block_size
    num_blocks = num_seqs * blocks_per_seq + 1
    shape = (num_blocks, NUM_KV_HEADS, block_size, head_size)
    key_cache = zeros_kv(shape, dtype, device).normal_()  # allocated as PagedKVCache does
    value_cache = zeros_kv(shape, dtype, device).normal_()
    table = torch.randperm(num_blocks - 1, device=device)[: num_seqs * blocks_per_seq] + 1
    return dict(
        query=torch.randn(num_seqs, NUM_HEADS, head_size, device=device).to(dtype),
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


def peak_gflops(kind: str = "fp32", seconds: float = 0.02) -> float | None:
    """The CPU's measured peak of kind (pagedkv.ops.cpu_peak_gflops), None where this build or
    processor has none (an older build; "bf16" without AVX512_BF16)."""
    try:
        return pagedkv.ops.cpu_peak_gflops(kind, seconds)
    except (AttributeError, RuntimeError, ValueError):
        return None


def make_prefill_row(num_seqs: int, new: int, cached: int, kv_heads: int, dtype: torch.dtype,
                     device, block_size: int = 16, head_size: int = HEAD_SIZE) -> dict:
    seq_len = cached + new
    blocks_per_seq = -(-seq_len // block_size)
    num_blocks = num_seqs * blocks_per_seq + 1
    shape = (num_blocks, kv_heads, block_size, head_size)
    table = torch.randperm(num_blocks - 1, device=device)[: num_seqs * blocks_per_seq] + 1
    query = torch.randn(num_seqs * new, NUM_HEADS, head_size, device=device).to(dtype)
    return dict(
        out=torch.empty_like(query),
        query=query,
        key_cache=zeros_kv(shape, dtype, device).normal_(),
        value_cache=zeros_kv(shape, dtype, device).normal_(),
        block_tables=table.view(num_seqs, blocks_per_seq).int(),
        seq_lens=torch.full((num_seqs,), seq_len, dtype=torch.int32, device=device),
        query_start_loc=torch.arange(0, num_seqs * new + 1, new, dtype=torch.int32,
                                     device=device),
        max_seq_len=seq_len, max_query_len=new,
    )


def prefill_flops(num_seqs: int, new: int, cached: int, head_size: int = HEAD_SIZE) -> float:
    """4 x head size per (query head, visible key): query i (of new) sees cached + i + 1 keys."""
    visible = new * cached + new * (new + 1) // 2
    return 4.0 * head_size * NUM_HEADS * visible * num_seqs


def paired_with_peak(fn, min_reps: int, min_time: float, threads: int,
                     kinds: tuple[str, ...] = ("fp32",)):
    """Times fn (wall and process CPU time) and the peak probes of kinds (peak_gflops; FMA for
    "fp32") alternately. Returns fn's wall seconds and CPU seconds, and per kind the probe's
    GFLOP/s (all threads) and its GFLOP per CPU second of one thread, a list entry per pair (a
    kind this machine lacks: empty lists)."""
    fn()
    walls, cpus = [], []
    peaks = {kind: [] for kind in kinds}
    per_thread = {kind: [] for kind in kinds}
    start = time.perf_counter()
    while len(walls) < min_reps or time.perf_counter() - start < min_time:
        w0, c0 = time.perf_counter(), time.process_time()
        fn()
        walls.append(time.perf_counter() - w0)
        cpus.append(time.process_time() - c0)
        for kind in kinds:
            peak = peak_gflops(kind)
            if peak is not None:
                peaks[kind].append(peak)
                per_thread[kind].append(peak / threads)
    return walls, cpus, peaks, per_thread


def of_peak(work: float, cpus: list[float], per_thread: list[float]) -> float | None:
    """The median over the pairs of work (FLOP) per CPU second over one thread's probe."""
    fractions = [work / c / 1e9 / p for c, p in zip(cpus, per_thread, strict=False)]
    return statistics.median(fractions) if fractions else None


def run_prefill(quick: bool, dev: torch.device, cpu_kernel: str | None) -> list[dict]:
    threads = torch.get_num_threads()
    rows = PREFILL_ROWS[:1] if quick else PREFILL_ROWS
    cpu = dev.type == "cpu"
    has_bf16_dots = cpu and peak_gflops("bf16") is not None
    results = []
    for dtype in DTYPES:
        for num_seqs, new, cached in rows:
            for kv_heads in PREFILL_KV_HEADS:
                row = make_prefill_row(num_seqs, new, cached, kv_heads, dtype, dev)
                args = (row["query"], row["key_cache"], row["value_cache"], row["block_tables"],
                        row["seq_lens"], row["query_start_loc"], row["max_seq_len"],
                        row["max_query_len"], HEAD_SIZE**-0.5)

                def call(out=row["out"], args=args):
                    pagedkv.ops.paged_attention(out, *args)
                    sync(dev)

                flops = prefill_flops(num_seqs, new, cached)
                # the bf16 dot-product probe paired too, for bf16 on AVX512_BF16
                bf16_dots = has_bf16_dots and dtype == torch.bfloat16
                kinds = ("fp32", "bf16") if bf16_dots else ("fp32",)
                if cpu:
                    walls, cpus, peaks, per_thread = paired_with_peak(
                        call, 3 if quick else 5, 0.0 if quick else 2.0, threads, kinds)
                else:
                    walls = [median_seconds(call, dev, 3 if quick else 5, 0.0 if quick else 1.0)]
                    cpus, peaks, per_thread = [], {}, {}
                wall = statistics.median(walls)
                peak = statistics.median(peaks["fp32"]) if peaks.get("fp32") else None
                fraction = of_peak(flops, cpus, per_thread.get("fp32", []))
                bf16_peak = statistics.median(peaks["bf16"]) if peaks.get("bf16") else None
                results.append(dict(
                    kind="prefill", dtype=str(dtype).removeprefix("torch."), num_seqs=num_seqs,
                    new_tokens=new, cached_tokens=cached, num_heads=NUM_HEADS,
                    num_kv_heads=kv_heads, block_size=16, threads=threads, device=str(dev),
                    cpu_kernel=cpu_kernel, bf16_dot=cpu_kernel == "avx512bf16",
                    ms=wall * 1e3, cpu_ms=statistics.median(cpus) * 1e3 if cpus else None,
                    gflop=flops / 1e9, gflops=flops / wall / 1e9,
                    gflops_per_cpu_s=flops / statistics.median(cpus) / 1e9 if cpus else None,
                    peak_gflops=peak, peak_fraction=fraction,
                    bf16_peak_gflops=bf16_peak,
                    bf16_peak_fraction=of_peak(flops, cpus, per_thread.get("bf16", [])),
                ))
                del row
    return results


def run(quick: bool = False, device: str = "cpu", only: str | None = None) -> list[dict]:
    dev = torch.device(device)
    probe = torch.ones(2**26, device=dev)  # 256 MiB, summed after every call of the op
    rows = ROWS[:1] + ROWS[2:3] if quick else ROWS
    block_sizes = BLOCK_SIZES[:1] if quick else BLOCK_SIZES
    # The CPU kernels the op runs here (base, avx2, avx512), so results of machines compare.
    cpu_kernel = pagedkv.ops.cpu_attention_kernel(HEAD_SIZE) if dev.type == "cpu" else None
    results = []
    for dtype in DTYPES if only != "prefill" else []:
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
                    kind="decode",
                    dtype=str(dtype).removeprefix("torch."), num_seqs=num_seqs, seq_len=seq_len,
                    block_size=block_size, threads=torch.get_num_threads(), device=device,
                    cpu_kernel=cpu_kernel,
                    ms=ours * 1e3, kv_bytes=kv_bytes, gbps=kv_bytes / ours / 1e9,
                    read_gbps=bandwidth / 1e9, bw_fraction=kv_bytes * inverse,
                    reference_ms=ref * 1e3, contiguous_sdpa_ms=cont * 1e3,
                    speedup_reference=ref / ours, speedup_contiguous=cont / ours,
                ))
                del row
    if only != "decode":
        results += run_prefill(quick, dev, cpu_kernel)
    return results


def print_table(results: list[dict]) -> None:
    decode = [r for r in results if r["kind"] == "decode"]
    if decode:
        print_decode(decode)
    prefill = [r for r in results if r["kind"] == "prefill"]
    if prefill:
        print_prefill(prefill)


def print_prefill(results: list[dict]) -> None:
    r0 = results[0]
    kernel = f" ({r0['cpu_kernel']} kernels)" if r0["cpu_kernel"] else ""
    bf16 = any(r["bf16_peak_gflops"] for r in results)
    print(f"\nchunked prefill, {r0['threads']} threads, {r0['device']}{kernel}; peak: FMA probe "
          "after every call (median, all threads); of peak: median over those pairs, per CPU "
          "second" + ("; of bf16: the same against the bf16 dot-product probe, also after every "
                      "call (bf16 rows)" if bf16 else ""))
    print(f"{'dtype':>9} {'seqs x new + cached':>20} {'q/kv':>5} {'ms':>9} {'GFLOP/s':>8} "
          f"{'/CPU s':>7} {'peak':>6} {'of peak':>8}"
          + (f" {'of bf16':>8}" if bf16 else ""))
    for r in results:
        frac = f"{r['peak_fraction']:8.0%}" if r["peak_fraction"] is not None else f"{'-':>8}"
        peak = f"{r['peak_gflops']:6.0f}" if r["peak_gflops"] else f"{'-':>6}"
        line = (f"{r['dtype']:>9} {r['num_seqs']:>3} x {r['new_tokens']:>4} + "
                f"{r['cached_tokens']:<6} {r['num_heads']:>2}/{r['num_kv_heads']:<2} "
                f"{r['ms']:9.1f} {r['gflops']:8.1f} {r['gflops_per_cpu_s'] or 0:7.1f} {peak} "
                f"{frac}")
        if bf16:
            bf = r["bf16_peak_fraction"]
            line += f" {bf:8.0%}" if bf is not None else f" {'-':>8}"
        print(line)


def print_decode(results: list[dict]) -> None:
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
    parser.add_argument("--only", choices=["decode", "prefill"], help="one kind of rows")
    opts = parser.parse_args(argv)
    results = run(quick=opts.quick, device=opts.device, only=opts.only)
    print_table(results)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=1))
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
