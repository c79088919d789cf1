"""Quantized KV caches side by side: paged_attention over the same K/V stored as bfloat16, fp8
with a per-tensor scale, and the per-(token, head) formats fp8 (e4m3), int8 and int4.

Decode rows (sequences x context, 32 query heads / 8 kv heads, head size 128, block size 16)
report each format's median time, the bytes it reads (its rows and, for the per-(token, head)
formats, their float32 scales) per second, that rate as a fraction of the machine's read
bandwidth, and its speedup over the bfloat16 cache. Prefill rows (sequences x new tokens over
cached ones, causal) report the time and the speedup. The formats are timed in turn within
every repetition (bf16, fp8, fp8/token, int8, int4, bf16, ...), each call followed by a
torch.sum over 256 MiB (8x a 32 MiB L3: K/V then come from DRAM), so that a noisy machine
weighs on every format alike; a fraction is the median over those pairs of
(bytes / op time) / (probe bytes / probe time), a speedup the median over repetitions of
bf16's time / the format's.

    python -m bench.bench_attention_quant [--quick] [--device cpu]

prints the table and writes bench/results/attention_quant.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

import pagedkv
from pagedkv.cache.paged_cache import zeros_kv
from pagedkv.ops import reference

DECODE_ROWS = [(8, 2048), (32, 1024)]
PREFILL_ROWS = [(2, 1024, 1024)]
NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE = 32, 8, 128, 16
# name: (stored dtype, per-(token, head) scales)
FORMATS = {
    "bf16": (torch.bfloat16, False),
    "fp8": (torch.float8_e4m3fn, False),
    "fp8/token": (torch.float8_e4m3fn, True),
    "int8": (torch.int8, True),
    "int4": (torch.uint8, True),
}
RESULTS = Path(__file__).parent / "results" / "attention_quant.json"


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def caches(shape: tuple[int, ...], name: str, device) -> dict:
    """K and V of one format from the same random numbers (a fixed seed), allocated as
    PagedKVCache allocates them, with their scales."""
    dtype, token_scaled = FORMATS[name]
    gen = torch.Generator().manual_seed(0)
    out = {}
    for which in ("key", "value"):
        x = torch.randn(shape, generator=gen)
        if token_scaled:
            stored, scales = reference.quantize_rows(x, dtype)
            cache = zeros_kv(stored.shape, dtype, device)
            cache.copy_(stored)
            out[f"{which}_cache_scales"] = zeros_kv(scales.shape, torch.float32, device)
            out[f"{which}_cache_scales"].copy_(scales)
        elif dtype == torch.bfloat16:
            cache = zeros_kv(shape, dtype, device)
            cache.copy_(x)
        else:  # per-tensor fp8: one scale that fits the values' range
            scale = torch.tensor([x.abs().max().item() / 448.0])
            cache = zeros_kv(shape, dtype, device)
            cache.copy_(reference.quantize(x, dtype, scale))
            out["k_scale" if which == "key" else "v_scale"] = scale.to(device)
        out[f"{which}_cache"] = cache
    return out


def bytes_read(args: dict, num_seqs: int, seq_len: int) -> int:
    """K/V bytes a call reads: every key's row of every kv head, and its scale."""
    per_key = 0
    for which in ("key", "value"):
        cache = args[f"{which}_cache"]
        per_key += cache.shape[-1] * cache.element_size()
        if f"{which}_cache_scales" in args:
            per_key += 4
    return per_key * NUM_KV_HEADS * num_seqs * seq_len


def table_for(num_seqs: int, seq_len: int, device) -> tuple[torch.Tensor, int]:
    blocks_per_seq = -(-seq_len // BLOCK_SIZE)
    num_blocks = num_seqs * blocks_per_seq + 1
    table = torch.randperm(num_blocks - 1)[: num_seqs * blocks_per_seq] + 1
    return table.view(num_seqs, blocks_per_seq).int().to(device), num_blocks


def op(args: dict, query: torch.Tensor, table, lens, qsl, max_seq_len: int, max_q: int):
    out = torch.empty_like(query)
    extra = {k: args[k] for k in ("k_scale", "v_scale", "key_cache_scales",
                                  "value_cache_scales") if k in args}
    return lambda: pagedkv.ops.paged_attention(
        out, query, args["key_cache"], args["value_cache"], table, lens, qsl, max_seq_len,
        max_q, HEAD_SIZE**-0.5, **extra)


def runnable(calls: dict) -> dict:
    """The calls whose format this device's kernels read (a backend without a format's kernel
    refuses it with a RuntimeError naming it), each run once; the others are reported."""
    kept = {}
    for name, fn in calls.items():
        try:
            fn()
        except RuntimeError as e:
            print(f"{name}: not run here: {str(e).splitlines()[0]}")
            continue
        kept[name] = fn
    return kept


def measure(calls: dict, probe: torch.Tensor, reps: int, device) -> dict:
    """Per format: op times and probe rates, taken in turn (see the module's docstring)."""
    probe_bytes = probe.numel() * probe.element_size()
    calls = runnable(calls)
    times = {name: [] for name in calls}
    rates = {name: [] for name in calls}
    for _ in range(reps):
        for name, fn in calls.items():
            sync(device)
            t0 = time.perf_counter()
            fn()
            sync(device)
            t1 = time.perf_counter()
            probe.sum()
            sync(device)
            times[name].append(t1 - t0)
            rates[name].append(probe_bytes / (time.perf_counter() - t1))
    return {"times": times, "rates": rates}


def summarize(kind: str, row: dict, m: dict, nbytes: dict) -> list[dict]:
    base = m["times"]["bf16"]
    out = []
    for name in m["times"]:
        times, rates = m["times"][name], m["rates"][name]
        out.append(dict(
            kind=kind, format=name, **row, threads=torch.get_num_threads(),
            ms=statistics.median(times) * 1e3, bytes=nbytes[name],
            gbps=nbytes[name] / statistics.median(times) / 1e9,
            read_gbps=statistics.median(rates) / 1e9,
            bw_fraction=statistics.median(
                nbytes[name] / t / r for t, r in zip(times, rates, strict=True)),
            speedup_bf16=statistics.median(b / t for b, t in zip(base, times, strict=True)),
        ))
    return out


def run(quick: bool = False, device: str = "cpu") -> list[dict]:
    dev = torch.device(device)
    probe = torch.ones(2**26, device=dev)
    reps = 5 if quick else 15
    results = []
    for num_seqs, seq_len in DECODE_ROWS[:1] if quick else DECODE_ROWS:
        table, num_blocks = table_for(num_seqs, seq_len, dev)
        shape = (num_blocks, NUM_KV_HEADS, BLOCK_SIZE, HEAD_SIZE)
        query = torch.randn(num_seqs, NUM_HEADS, HEAD_SIZE, device=dev).bfloat16()
        lens = torch.full((num_seqs,), seq_len, dtype=torch.int32, device=dev)
        calls, nbytes = {}, {}
        for name in FORMATS:
            args = caches(shape, name, dev)
            calls[name] = op(args, query, table, lens, None, seq_len, 1)
            nbytes[name] = bytes_read(args, num_seqs, seq_len)
        m = measure(calls, probe, reps, dev)
        results += summarize("decode", dict(num_seqs=num_seqs, seq_len=seq_len), m, nbytes)
        del calls
    for num_seqs, new, cached in [] if quick else PREFILL_ROWS:
        seq_len = new + cached
        table, num_blocks = table_for(num_seqs, seq_len, dev)
        shape = (num_blocks, NUM_KV_HEADS, BLOCK_SIZE, HEAD_SIZE)
        query = torch.randn(num_seqs * new, NUM_HEADS, HEAD_SIZE, device=dev).bfloat16()
        lens = torch.full((num_seqs,), seq_len, dtype=torch.int32, device=dev)
        qsl = torch.arange(0, num_seqs * new + 1, new, dtype=torch.int32, device=dev)
        calls, nbytes = {}, {}
        for name in FORMATS:
            args = caches(shape, name, dev)
            calls[name] = op(args, query, table, lens, qsl, seq_len, new)
            nbytes[name] = bytes_read(args, num_seqs, seq_len)
        m = measure(calls, probe, max(3, reps // 3), dev)
        results += summarize("prefill", dict(num_seqs=num_seqs, seq_len=seq_len, new=new), m,
                             nbytes)
        del calls
    return results


def print_table(results: list[dict]) -> None:
    r0 = results[0]
    kernel = pagedkv.ops.cpu_attention_kernel(HEAD_SIZE)
    print(f"{r0['threads']} threads ({kernel} kernels), {NUM_HEADS} q / {NUM_KV_HEADS} kv heads, "
          f"head {HEAD_SIZE}, block {BLOCK_SIZE}; bw: torch.sum over 256 MiB after every call "
          "(median); of bw and x bf16: medians over the pairs and repetitions")
    print(f"{'kind':>7} {'row':>16} {'format':>10} {'ms':>8} {'MB read':>8} {'GB/s':>6} "
          f"{'bw':>5} {'of bw':>6} {'x bf16':>7}")
    for r in results:
        row = (f"{r['num_seqs']} x {r['seq_len']}" if r["kind"] == "decode"
               else f"{r['num_seqs']} x {r['new']}+{r['seq_len'] - r['new']}")
        # prefill is bound by its arithmetic, not its bytes: no rates for it
        rates = (f"{r['bytes'] / 1e6:8.1f} {r['gbps']:6.1f} {r['read_gbps']:5.1f} "
                 f"{r['bw_fraction']:6.0%}" if r["kind"] == "decode"
                 else f"{r['bytes'] / 1e6:8.1f} {'-':>6} {'-':>5} {'-':>6}")
        print(f"{r['kind']:>7} {row:>16} {r['format']:>10} {r['ms']:8.2f} {rates} "
              f"{r['speedup_bf16']:7.2f}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one decode row, fewer repetitions")
    parser.add_argument("--device", default="cpu")
    opts = parser.parse_args(argv)
    results = run(quick=opts.quick, device=opts.device)
    print_table(results)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=1))
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
