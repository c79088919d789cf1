"""GPU speed without a GPU: the SASS of the built extension module, priced per device preset,
and the kernels' global-memory traffic counted by the simt emulator.

For every kernel instantiation in the module (sm_80 and sm_90): registers, warps per SM, the main
loop's instructions per byte it loads, by class. For the decode kernels: the estimated fraction of
HBM bandwidth and time of the standard decode shapes on A100 / H100 / H200 (docs/gpu_model.md).
Traffic (pagedkv._simt, skipped with --no-traffic): for the decode configurations (GQA 1/4/8,
block size 1/16/256, bf16 and fp8 caches, HND and NHD) and the cache ops, K/V bytes requested over
the minimal, sector efficiency and re-read factor, counted at a reduced size (see TRAFFIC_SIZES).
With ``--join attention_cuda.json`` (bench_attention_cuda's measured rows): the model's estimate
next to each measured row, the calibration of the model.

python -m bench.bench_gpu_model [--module PATH] [--devices a100-80gb,h100,h200] [--join FILE]
    [--no-traffic]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from bench.harness import RESULTS
from pagedkv.tools.costmodel import DEVICES, get_device
from pagedkv.tools.gpu_model import (
    attention_kernels,
    decode_cost,
    estimate,
    kernel_label,
    occupancy,
)
from pagedkv.tools.sass import CLASSES, disassemble, find_tool, resource_usage
from pagedkv.tools.sass_loop import profile_loop

SIZES = [(8, 2048), (32, 4096), (1, 32768)]  # (sequences, tokens each)
GROUPS = (1, 4, 8)  # query heads per kv head, 32 query heads
CACHES = ("bf16", "fp8_e4m3")
ELEMENT = {"bf16": 2, "f16": 2, "f32": 4, "fp8_e4m3": 1, "fp8_e5m2": 1}
TORCH_NAMES = {"bfloat16": "bf16", "float16": "f16", "float32": "f32",
               "float8_e4m3fn": "fp8_e4m3", "float8_e5m2": "fp8_e5m2"}


@dataclass(frozen=True)
class Decode:
    num_seqs: int
    seq_len: int
    num_heads: int = 32
    num_kv_heads: int = 8
    head_size: int = 128
    dtype: str = "bf16"
    cache: str = "bf16"

    @property
    def kv_bytes(self) -> int:
        return 2 * self.num_seqs * self.seq_len * self.num_kv_heads * self.head_size * (
            ELEMENT[self.cache])

    @property
    def padded_head(self) -> int:
        return 64 if self.head_size <= 64 else 128 if self.head_size <= 128 else 256


def module_path() -> Path:
    import pagedkv._C as ext

    return Path(ext.__file__)


def kernel_rows(kernels, usage) -> list[dict]:
    rows = []
    for k in kernels:
        regs = usage.get((k.arch, k.name), {}).get("REG", 0)
        row = {"arch": k.arch, "kernel": kernel_label(k), "name": k.name, "registers": regs,
               "warps_per_sm": occupancy(regs) if regs else None}
        p = profile_loop(k)
        if p is not None and p.kv_bytes > 0:  # a loop whose loads are all off the hot path: none
            row |= {"loop": [hex(p.first), hex(p.last)], "loop_static": p.static_instructions,
                    "loop_instructions": p.instructions, "loop_bytes": p.kv_bytes,
                    "load_width": p.load_width, "per_kib": round(p.per_byte * 1024, 1),
                    "classes_per_kib": {c: round(v, 1) for c, v in p.class_per_kib().items()},
                    "branches": [[hex(b.address), b.kind, b.taken] for b in p.branches]}
        rows.append(row)
    return rows


def decode_estimate(kernels, shape: Decode, device) -> dict | None:
    key = (device.sass_arch, shape.dtype, shape.cache, shape.padded_head)
    kernel = attention_kernels(kernels).get(key)
    if kernel is None or shape.num_heads % shape.num_kv_heads:
        return None
    cost = decode_cost(kernel, shape.num_heads // shape.num_kv_heads)
    est = estimate(cost, device)
    return {"device": device.name, "kernel": kernel_label(kernel), "arch": kernel.arch,
            "group": cost.group, "tiles": cost.tiles,
            "per_kib": round(cost.instructions * 1024, 1),
            "classes_per_kib": {c: round(v, 1) for c, v in cost.classes.items()},
            **est.to_dict(), "kv_bytes": shape.kv_bytes,
            "estimate_ms": est.seconds(shape.kv_bytes) * 1e3}


def standard_rows(kernels, devices) -> list[dict]:
    rows = []
    for device in devices:
        for cache in CACHES:
            for group in GROUPS:
                for seqs, tokens in SIZES:
                    shape = Decode(seqs, tokens, num_kv_heads=32 // group, cache=cache)
                    row = decode_estimate(kernels, shape, device)
                    if row is not None:
                        rows.append({"case": f"decode {seqs}x{tokens} gqa{group} {cache}"} | row)
    return rows


# Traffic is counted on the emulator, orders of magnitude slower than a GPU: each standard shape
# runs with at most this many sequences and tokens each, and one kv head (its query heads: the
# group). The ratios below are per byte: the full shapes repeat the same requests.
TRAFFIC_SIZES = {"seqs": 2, "tokens": 1024}
TRAFFIC_BLOCKS = (1, 16, 256)
TRAFFIC_LAYOUTS = ("hnd", "nhd")


def traffic_rows() -> list[dict]:
    """Counted traffic of the decode kernel per configuration, and of the cache ops."""
    import torch

    from pagedkv.ops import simt

    if not simt.available():
        return []
    dtypes = {"bf16": torch.bfloat16, "fp8_e4m3": torch.float8_e4m3fn}
    rows, counted = [], {}
    gen = torch.Generator().manual_seed(0)
    for seqs, tokens in SIZES:
        n, length = min(seqs, TRAFFIC_SIZES["seqs"]), min(tokens, TRAFFIC_SIZES["tokens"])
        for cache in CACHES:
            for group in GROUPS:
                for block in TRAFFIC_BLOCKS:
                    for layout in TRAFFIC_LAYOUTS:
                        key = (n, length, cache, group, block, layout)
                        if key not in counted:  # standard shapes reduced to the same size
                            counted[key] = _decode_traffic(simt, n, length, group, block,
                                                           layout, dtypes[cache], gen)
                        kv = counted[key]
                        minimal = 2 * n * length * 128 * ELEMENT[cache]
                        rows.append({"case": f"decode {seqs}x{tokens} gqa{group} {cache}",
                                     "counted": f"{n}x{length}", "block_size": block,
                                     "layout": layout, "tag": "kv", "op": "load",
                                     "requested_over_minimal": kv["bytes"] / minimal,
                                     "sector_efficiency": kv["sector_efficiency"],
                                     "reread": kv["reread"], "bytes": kv["bytes"],
                                     "minimal": minimal})
    rows += _cache_op_traffic(simt, gen)
    return rows


def _decode_traffic(simt, n, length, group, block, layout, cache_dtype, gen) -> dict:
    import torch

    blocks_per_seq = -(-length // block)
    num_blocks = n * blocks_per_seq
    shape = (num_blocks, 1, block, 128) if layout == "hnd" else (num_blocks, block, 1, 128)

    def cache():
        c = torch.randn(shape, generator=gen).mul(0.1).to(cache_dtype)
        return c if layout == "hnd" else c.permute(0, 2, 1, 3)

    query = torch.randn(n, group, 128, generator=gen).to(torch.bfloat16)
    table = torch.randperm(num_blocks, generator=gen).to(torch.int32).view(n, blocks_per_seq)
    lens = torch.full((n,), length, dtype=torch.int32)
    scales = (torch.tensor([1.0]), torch.tensor([1.0])) if cache_dtype != torch.bfloat16 else (
        None, None)
    # The model is of the CUDA-core decode kernel: run it, whatever the dispatch would choose
    # (a group of 8 goes to the tensor-core kernel by default).
    saved = os.environ.get("PAGEDKV_ATTENTION_KERNEL")
    os.environ["PAGEDKV_ATTENTION_KERNEL"] = "cuda_core"
    try:
        with simt.profile() as prof:
            simt.ops.paged_attention(torch.empty_like(query), query, cache(), cache(), table,
                                     lens, None, length, 1, 128**-0.5, None, -1, 0.0, *scales,
                                     None)
    finally:
        if saved is None:
            del os.environ["PAGEDKV_ATTENTION_KERNEL"]
        else:
            os.environ["PAGEDKV_ATTENTION_KERNEL"] = saved
    return prof.total("paged_attention_kernel", "kv")


def _cache_op_traffic(simt, gen) -> list[dict]:
    import torch

    rows = []
    tokens, heads, block = 256, 8, 16
    for cache, dtype in (("bf16", torch.bfloat16), ("fp8_e4m3", torch.float8_e4m3fn)):
        for layout in TRAFFIC_LAYOUTS:
            shape = (tokens // block, heads, block, 128)
            if layout == "nhd":
                shape = (tokens // block, block, heads, 128)
            kc, vc = (torch.zeros(shape, dtype=dtype) for _ in range(2))
            if layout == "nhd":
                kc, vc = kc.permute(0, 2, 1, 3), vc.permute(0, 2, 1, 3)
            key, value = (torch.randn(tokens, heads, 128, generator=gen).to(torch.bfloat16)
                          for _ in range(2))
            scales = (torch.tensor([1.0]), torch.tensor([1.0])) if cache != "bf16" else ()
            slots = torch.randperm(tokens, generator=gen)
            mapping = torch.tensor([[0, 1], [2, 3], [5, 4]], dtype=torch.int64)
            with simt.profile() as prof:
                simt.ops.reshape_and_cache(key, value, kc, vc, slots, *scales)
                simt.ops.copy_blocks([kc], [vc], mapping)
            for kernel, tag, op, minimal in [
                    ("reshape_and_cache_kernel", "src", "load", 2 * key.numel() * 2),
                    ("reshape_and_cache_kernel", "kv", "store", 2 * key.numel() * ELEMENT[cache]),
                    ("copy_blocks_kernel", "kv", "load", 2 * 3 * block * heads * 128 *
                     ELEMENT[cache]),
                    ("copy_blocks_kernel", "kv", "store", 2 * 3 * block * heads * 128 *
                     ELEMENT[cache])]:
                t = prof.total(kernel, tag, op)
                rows.append({"case": f"{kernel.removesuffix('_kernel')} {cache}",
                             "counted": f"{tokens} tokens", "block_size": block,
                             "layout": layout, "tag": tag, "op": op,
                             "requested_over_minimal": t["bytes"] / minimal,
                             "sector_efficiency": t["sector_efficiency"],
                             "reread": t["reread"], "bytes": t["bytes"], "minimal": minimal})
    return rows


def print_traffic(rows: list[dict]) -> None:
    print(f"\ntraffic counted on simt (decode: <= {TRAFFIC_SIZES['seqs']} sequences of <= "
          f"{TRAFFIC_SIZES['tokens']} tokens, 1 kv head, head 128)")
    print(f"{'case':<36}{'counted':>10}{'block':>6}{'layout':>7}{'tag':>5}{'op':>6}"
          f"{'req/min':>8}{'sector eff':>11}{'reread':>7}")
    for r in rows:
        print(f"{r['case']:<36}{r['counted']:>10}{r['block_size']:>6}{r['layout']:>7}"
              f"{r['tag']:>5}{r['op']:>6}{r['requested_over_minimal']:>8.2f}"
              f"{r['sector_efficiency']:>11.1%}{r['reread']:>7.2f}")


def print_kernels(rows: list[dict]) -> None:
    print(f"\n{'arch':<6}{'kernel':<34}{'regs':>5}{'warps':>6}{'loop':>6}{'per KiB':>8}  "
          "top classes per KiB (rows 4)")
    for r in rows:
        top = sorted(r.get("classes_per_kib", {}).items(), key=lambda kv: -kv[1])[:6]
        per_kib = f"{r['per_kib']:>8.0f}" if "per_kib" in r else f"{'-':>8}"
        print(f"{r['arch']:<6}{r['kernel']:<34}{r['registers']:>5}{r['warps_per_sm'] or 0:>6}"
              f"{r.get('loop_static', 0):>6}{per_kib}  " + " ".join(f"{c} {v:.0f}" for c, v in top))


def print_estimates(rows: list[dict]) -> None:
    print(f"\n{'device':<11}{'case':<34}{'inst/KiB':>9}{'bound':>7}{'B/clk/SM':>9}"
          f"{'GB/s':>8}{'of HBM':>8}{'ms':>9}")
    for r in rows:
        print(f"{r['device']:<11}{r['case']:<34}{r['per_kib']:>9.0f}{r['bound']:>7}"
              f"{r['bytes_per_clock_sm']:>9.1f}{r['bandwidth'] / 1e9:>8.0f}"
              f"{r['fraction_of_hbm']:>8.0%}{r['estimate_ms']:>9.3f}")


def join_rows(kernels, measured_path: Path, device_name: str | None) -> list[dict]:
    """The model's estimate next to each measured decode row of bench_attention_cuda."""
    from bench.bench_attention_cuda import SHAPES

    data = json.loads(measured_path.read_text())
    device = _preset_for(device_name or data.get("device", ""))
    shapes = {str(s): s for s in SHAPES}
    rows = []
    for row in data.get("rows", []):
        s = shapes.get(row.get("case"))
        if s is None or s.query_len != 1:
            continue
        cache = TORCH_NAMES[str(s.cache_dtype or s.dtype).removeprefix("torch.")]
        shape = Decode(s.num_seqs, s.seq_len, s.num_heads, s.num_kv_heads, s.head_size,
                       TORCH_NAMES[str(s.dtype).removeprefix("torch.")], cache)
        est = decode_estimate(kernels, shape, device)
        if est is not None:
            rows.append({"case": row["case"], "measured_ms": row["median_ms"],
                         "measured_over_model": row["median_ms"] / est["estimate_ms"]} | est)
    return rows


def _preset_for(name: str):
    """The preset of a GPU name ("NVIDIA H200", "NVIDIA A100-SXM4-80GB"): its model, then its
    memory size where presets differ by it."""
    name = name.lower()
    matches = [key for key in DEVICES if key.split("-")[0] in name]
    best = [key for key in matches if key.split("-")[-1] in name]
    if best or matches:
        return DEVICES[(best or matches)[0]]
    raise ValueError(f"no device preset matches {name!r}; pass --device-name "
                     f"({', '.join(d.name for d in DEVICES.values())})")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--module", type=Path, help="extension module or object (default: "
                        "the imported pagedkv._C)")
    parser.add_argument("--devices", default="a100-80gb,h100,h200")
    parser.add_argument("--join", type=Path, help="bench_attention_cuda's JSON to compare with")
    parser.add_argument("--device-name", help="the measured GPU (default: the JSON's device)")
    parser.add_argument("--quick", action="store_true", help="accepted for python -m bench")
    parser.add_argument("--no-traffic", action="store_true",
                        help="skip the traffic counted on the simt emulator")
    opts = parser.parse_args(argv)
    if find_tool("cuobjdump") is None:
        print("bench_gpu_model: skipped, cuobjdump not found (PATH, $CUDA_HOME/bin, triton)")
        return
    module = opts.module or module_path()
    start = time.perf_counter()
    kernels = disassemble(module)
    if not kernels:
        print(f"bench_gpu_model: skipped, {module} holds no CUDA kernels (a CPU-only build)")
        return
    usage = resource_usage(module)
    print(f"disassembled {len(kernels)} kernels of {module} in "
          f"{time.perf_counter() - start:.1f} s; classes: {', '.join(CLASSES)}")
    devices = [get_device(d) for d in opts.devices.split(",")]
    payload = {"device": "model (SASS, no GPU)", "module": str(module),
               "tools": {t: find_tool(t) for t in ("cuobjdump", "nvdisasm")},
               "devices": [{f: getattr(d, f) for f in d.__slots__} for d in devices],
               "kernels": kernel_rows(kernels, usage), "rows": standard_rows(kernels, devices)}
    print_kernels(payload["kernels"])
    print_estimates(payload["rows"])
    if not opts.no_traffic:
        start = time.perf_counter()
        payload["traffic"] = traffic_rows()
        if payload["traffic"]:
            print_traffic(payload["traffic"])
            print(f"(counted in {time.perf_counter() - start:.0f} s)")
    if opts.join:
        payload["join"] = join_rows(kernels, opts.join, opts.device_name)
        print(f"\nmeasured ({opts.join}) vs model")
        for r in payload["join"]:
            print(f"{r['case']:<46}{r['measured_ms']:>9.3f} ms measured {r['estimate_ms']:>9.3f}"
                  f" ms model ({r['bound']}-bound)  x{r['measured_over_model']:.2f}")
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / "bench_gpu_model.json"
    path.write_text(json.dumps(payload, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
