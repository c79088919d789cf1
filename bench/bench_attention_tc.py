"""CUDA paged attention, CUDA-core and tensor-core kernels side by side (PAGEDKV_ATTENTION_KERNEL
forced per row), timed with CUDA events (median):

- chunked prefill, 8 sequences x 2048 new query tokens over a 4096-token cached prefix, 32 q /
  8 kv heads, head 128, bf16: TFLOPS (causal: 4 * head_size FLOPs per attended (query head, key)
  pair) and its fraction of the device's dense bf16 tensor-core peak (--peak-tflops, or the table
  below by device name);
- decode, 32 sequences x 4096 keys, 64 q / 8 kv heads (GQA group 8), head 128, bf16: GB/s of the
  K/V, query and output bytes and the fraction of the copy bandwidth measured in the same run.

python -m bench.bench_attention_tc [--quick] [--device cuda|cpu] [--peak-tflops X]
(--device cpu: a smoke test of the script on small shapes; the CPU kernels ignore the switch).
"""

from __future__ import annotations

import argparse
import math
import os

import torch

import pagedkv
from bench.harness import measure_bandwidth, median_ms, write_host_json

# Dense (no sparsity) bf16 tensor-core peaks in TFLOPS, from the vendors' data sheets (SXM parts).
DENSE_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0}
KERNELS = ("cuda_core", "tensor_core")


def peak_tflops(device: torch.device, override: float | None) -> float | None:
    if override:
        return override
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in DENSE_BF16_TFLOPS.items() if k in name), None)


def make_args(num_seqs, prefix, q_len, num_heads, num_kv_heads, head_size, dev, block_size=16):
    seq_len = prefix + q_len
    blocks_per_seq = math.ceil(seq_len / block_size)
    num_blocks = num_seqs * blocks_per_seq + 1
    shape = (num_blocks, num_kv_heads, block_size, head_size)
    table = torch.randperm(num_blocks - 1, device=dev)[: num_seqs * blocks_per_seq] + 1
    num_tokens = num_seqs * q_len
    query = torch.randn(num_tokens, num_heads, head_size, device=dev, dtype=torch.bfloat16)
    qsl = None
    if q_len > 1:
        qsl = torch.arange(0, num_tokens + 1, q_len, dtype=torch.int32, device=dev)
    return dict(
        out=torch.empty_like(query), query=query,
        key_cache=torch.randn(shape, device=dev, dtype=torch.bfloat16),
        value_cache=torch.randn(shape, device=dev, dtype=torch.bfloat16),
        block_tables=table.view(num_seqs, blocks_per_seq).int(),
        seq_lens=torch.full((num_seqs,), seq_len, dtype=torch.int32, device=dev),
        query_start_loc=qsl, max_seq_len=seq_len, max_query_len=q_len,
        scale=head_size**-0.5, lse_out=None,
    )


def timed(args: dict, kernel: str, device: torch.device) -> float:
    old = os.environ.get("PAGEDKV_ATTENTION_KERNEL")
    os.environ["PAGEDKV_ATTENTION_KERNEL"] = kernel
    try:
        return median_ms(lambda: pagedkv.ops.paged_attention(**args), device, repeat=20)
    finally:
        if old is None:
            del os.environ["PAGEDKV_ATTENTION_KERNEL"]
        else:
            os.environ["PAGEDKV_ATTENTION_KERNEL"] = old


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="shapes scaled down 8x")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help="dense bf16 peak of the device (default: by device name)")
    opts = parser.parse_args(argv)
    device = torch.device(opts.device)
    div = 8 if opts.quick or device.type == "cpu" else 1
    peak = peak_tflops(device, opts.peak_tflops)
    bandwidth = measure_bandwidth(device, gib=1.0 / div)
    rows = []

    # Chunked prefill: query i of a sequence (position prefix + i) attends prefix + i + 1 keys.
    seqs, prefix, q_len, hq, hkv, hd = 8, 4096 // div, 2048 // div, 32, 8, 128
    args = make_args(seqs, prefix, q_len, hq, hkv, hd, device)
    pairs = seqs * hq * (q_len * (prefix + 1) + q_len * (q_len - 1) // 2)
    flops = 4 * hd * pairs
    for kernel in KERNELS:
        ms = timed(args, kernel, device)
        tflops = flops / (ms / 1e3) / 1e12
        rows.append(dict(case=f"prefill {seqs}x{q_len} over {prefix} {hq}/{hkv} h{hd} bf16",
                         kernel=kernel, ms=ms, tflops=tflops,
                         of_peak=tflops / peak if peak else None))
    del args

    # GQA decode, group 8.
    seqs, seq_len, hq, hkv = 32, 4096 // div, 64, 8
    args = make_args(seqs, seq_len - 1, 1, hq, hkv, hd, device)
    nbytes = 2 * seqs * seq_len * hkv * hd * 2 + 2 * args["query"].nbytes
    for kernel in KERNELS:
        ms = timed(args, kernel, device)
        gbps = nbytes / 1e9 / (ms / 1e3)
        rows.append(dict(case=f"decode {seqs}x{seq_len} {hq}/{hkv} h{hd} bf16", kernel=kernel,
                         ms=ms, gbps=gbps, of_copy_bw=gbps / bandwidth["copy"]))

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"\npaged_attention kernels on {name} (copy bandwidth now {bandwidth['copy']:.1f} GB/s,"
          f" dense bf16 peak {f'{peak:.0f} TFLOPS' if peak else 'unknown'})")
    print(f"{'case':<42}{'kernel':<13}{'ms':>9}{'TFLOPS':>9}{'of peak':>9}{'GB/s':>9}"
          f"{'of copy':>9}")

    def cell(r: dict, key: str, fmt: str) -> str:
        return format(r[key], fmt) if r.get(key) is not None else "-"

    for r in rows:
        print(f"{r['case']:<42}{r['kernel']:<13}{r['ms']:>9.3f}{cell(r, 'tflops', '.1f'):>9}"
              f"{cell(r, 'of_peak', '.0%'):>9}{cell(r, 'gbps', '.1f'):>9}"
              f"{cell(r, 'of_copy_bw', '.0%'):>9}")
    write_host_json("attention_tc", rows, device=name, bandwidth_gbps=bandwidth,
                    dense_bf16_tflops=peak)


if __name__ == "__main__":
    main()
