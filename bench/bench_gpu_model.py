"""GPU speed without a GPU: the SASS of the built extension module, priced per device preset,
and the kernels' global-memory traffic counted by the simt emulator.

For every kernel instantiation in the module (sm_80 and sm_90): registers, warps per SM, the main
loop's instructions per byte it loads, by class. For the decode kernels: the estimated fraction of
HBM bandwidth and time of the standard decode shapes on A100 / H100 / H200 (docs/gpu_model.md).
For the tensor-core kernels (prefill and decode configurations, bf16 and fp8 caches, heads
64/128/256) and FlashAttention-2's loop from the installed torch: instructions per HMMA of the
unmasked loop's whole body and of its common path, HMMA / LDSM / LDGSTS per tile, the masked
boundary tile's common path, and the estimated TFLOPS of the standard chunked prefill and GB/s
of the GQA-8 decode (boundary tiles at the masked cost; "masked": their share of the passes).
Traffic (pagedkv._simt, skipped with --no-traffic): for the decode configurations (GQA 1/4/8,
block size 1/16/256, bf16 and fp8 caches, HND and NHD) and the cache ops, K/V bytes requested over
the minimal, sector efficiency and re-read factor, counted at a reduced size (bench.gpu_traffic).
With ``--join attention_cuda.json`` (bench_attention_cuda's measured rows): the model's estimate
next to each measured row, the calibration of the model. Without a CUDA build of the module, the
attention units are compiled by nvcc instead (bench.sass.build, cached under build/sass).

python -m bench.bench_gpu_model [--module PATH] [--devices a100-80gb,h100,h200] [--join FILE]
    [--no-traffic]
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from pathlib import Path

from bench.gpu_traffic import print_traffic, traffic_rows
from bench.harness import RESULTS
from bench.sass import tensor_core as tc
from bench.sass.build import ARCHS, cubin, find_nvcc
from bench.sass.disasm import CLASSES, disassemble, find_tool, resource_usage
from bench.sass.loop import profile_loop
from bench.sass.model import (
    attention_kernels,
    decode_cost,
    estimate,
    kernel_label,
    occupancy,
)
from bench.sass.reference import FA2_GEOMETRY, fa2_kernel
from pagedkv.tools.costmodel import DEVICES, get_device

SIZES = [(8, 2048), (32, 4096), (1, 32768)]  # (sequences, tokens each)
GROUPS = (1, 4, 8)  # query heads per kv head, 32 query heads
CACHES = ("bf16", "fp8_e4m3", "int8", "int4")
ELEMENT = {"bf16": 2, "f16": 2, "f32": 4, "fp8_e4m3": 1, "fp8_e5m2": 1, "int8": 1, "int4": 0.5,
           "fp8_e4m3/row": 1}
ROW_SCALED = ("int8", "int4", "fp8_e4m3/row")  # a float32 scale per row, any query dtype
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
        """K and V bytes read: every row, and its scale for the row-scaled caches."""
        row = self.head_size * ELEMENT[self.cache] + (4 if self.cache in ROW_SCALED else 0)
        return int(2 * self.num_seqs * self.seq_len * self.num_kv_heads * row)

    @property
    def padded_head(self) -> int:
        return 64 if self.head_size <= 64 else 128 if self.head_size <= 128 else 256


# compiled when the module has no CUDA code
UNITS = ("attention_bf16", "attention_tc_bf16", "attention_tc_scaled_bf16")


def module_path() -> Path:
    import pagedkv._C as ext

    return Path(ext.__file__)


def load_kernels(module: Path) -> tuple[list, dict, str]:
    """The kernels of ``module``, their resource usage and where they come from; UNITS
    compiled by nvcc when the module holds no CUDA code (a CPU-only build)."""
    kernels = disassemble(module)
    if kernels or find_nvcc() is None:
        return kernels, resource_usage(module) if kernels else {}, str(module)
    cubins = [(cubin(unit, arch), arch) for unit in UNITS for arch in ARCHS]
    usage = {}
    for path, arch in cubins:
        usage |= resource_usage(path, arch=arch)
    kernels = [k for path, _ in cubins for k in disassemble(path)]
    return kernels, usage, f"nvcc -cubin of {', '.join(UNITS)}"


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
    query = "any" if shape.cache in ROW_SCALED else shape.dtype
    key = (device.sass_arch, query, shape.cache, shape.padded_head)
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


def tensor_core_rows(kernels, usage) -> list[dict]:
    """Per tensor-core configuration (bf16 queries): one pass of the main loop (one warp, one
    key tile), its whole body and its common path; the MLA kernel's at DeepSeek's rank 512
    ("mla 16" and "mla 64": its tile rows; head: the 576-wide latent row);
    FlashAttention-2's loop per arch."""
    rows = []
    for (arch, query, cache, head, kind), k in sorted(tc.tc_kernels(kernels).items()):
        if query == "bf16" and cache in CACHES:
            row = {"arch": arch, "kind": kind, "cache": cache, "head": head,
                   "kernel": k.demangled}
            try:
                rows.append(row | _tile_row(k, usage))
            except ValueError as e:  # no main loop found (sm_80 int8 / int4, head 256)
                rows.append(row | {"skipped": str(e)})
    for (arch, query, cache, rank, tile_rows), k in sorted(tc.mla_kernels(kernels).items()):
        if query == "bf16" and cache in CACHES and rank == 512:
            row = {"arch": arch, "kind": f"mla {tile_rows}", "cache": cache, "head": rank + 64,
                   "kernel": k.demangled}
            try:
                rows.append(row | _tile_row(k, usage))
            except ValueError as e:  # the loop model finds no main loop (sm_80 fp8, 16 rows)
                rows.append(row | {"skipped": str(e)})
    for arch in ARCHS:
        k, reason = fa2_kernel(arch)
        row = {"arch": arch, "kind": "FA2 fwd", "cache": "bf16", "head": 128}
        rows.append(row | ({"kernel": k.demangled, **_tile_row(k, {})} if k else
                           {"kernel": "FlashAttention-2", "skipped": reason}))
    return rows


def _tile_row(kernel, usage) -> dict:
    """The unmasked main loop's pass and, where the kernel has one, the masked boundary pass."""
    c, m = tc.tile_cost(kernel), tc.boundary_cost(kernel)
    row = {"registers": usage.get((kernel.arch, kernel.name), {}).get("REG", 0),
           "body": c.static_instructions, "body_hmma": c.static_hmma,
           "body_per_hmma": c.static_per_hmma, "instructions": c.instructions, "hmma": c.hmma,
           "per_hmma": c.per_hmma, "ldsm": c.ldsm, "ldgsts": c.ldgsts,
           "shared_bytes": c.shared_bytes,
           "classes": {n: round(v, 1) for n, v in c.classes.items()}}
    if m is not None:
        row["masked"] = {"body": m.static_instructions, "instructions": m.instructions,
                         "hmma": m.hmma, "per_hmma": m.per_hmma}
    return row


def tensor_core_estimates(kernels, devices) -> list[dict]:
    """The standard chunked prefill and GQA-8, 16 and 32 decode (head 128, 64 query heads) per
    device, bf16, fp8, int8 and int4 caches (the last two with their row scales), and
    FlashAttention-2's loop on the prefill. A decode group of 32 has 32 rows per kv head:
    dispatch runs it on the prefill configuration (64-row tiles)."""
    found, rows = tc.tc_kernels(kernels), []
    for device in devices:
        for cache in CACHES:
            size = ELEMENT[cache] + (4 / 128 if cache in ROW_SCALED else 0)
            for kind, shape in (("prefill", tc.Prefill(cache_bytes=size)),
                                ("decode", tc.Decode(cache_bytes=size)),
                                ("decode", tc.Decode(num_kv_heads=4, cache_bytes=size)),
                                ("prefill", tc.Decode(num_kv_heads=2, cache_bytes=size))):
                k = found.get((device.sass_arch, "bf16", cache, 128, kind))
                if k is not None:
                    est = tc.estimate(tc.tile_cost(k), device, shape, tc.geometry(k),
                                      tc.boundary_cost(k))
                    rows.append({"case": f"{shape} {cache}", "kernel": f"pagedkv {kind}",
                                 **est.to_dict()})
        fa2, _ = fa2_kernel(device.sass_arch)
        if fa2 is not None:
            est = tc.estimate(tc.tile_cost(fa2), device, tc.Prefill(), FA2_GEOMETRY)
            rows.append({"case": f"{tc.Prefill()} bf16", "kernel": "FA2 fwd", **est.to_dict()})
    return rows


def print_tensor_core(rows: list[dict], estimates: list[dict]) -> None:
    print("\ntensor-core main loop, one pass = one warp x one key tile (body: every instruction "
          "of the loop as laid out; path: the common path; masked: the boundary tile's path)")
    print(f"{'arch':<6}{'kind':<9}{'cache':<10}{'head':>5}{'regs':>5}{'body':>6}{'HMMA':>5}"
          f"{'/HMMA':>6}{'path':>6}{'HMMA':>5}{'/HMMA':>6}{'LDSM':>5}{'LDGSTS':>7}{'shared B':>9}"
          f"{'masked':>7}{'/HMMA':>6}")
    for r in rows:
        head = f"{r['arch']:<6}{r['kind']:<9}{r['cache']:<10}{r['head']:>5}"
        if "skipped" in r:
            print(f"{head}  skipped: {r['skipped']}")
            continue
        print(f"{head}{r['registers'] or '-':>5}{r['body']:>6}{r['body_hmma']:>5}"
              f"{r['body_per_hmma']:>6.1f}{r['instructions']:>6.0f}{r['hmma']:>5.0f}"
              f"{r['per_hmma']:>6.1f}{r['ldsm']:>5.0f}{r['ldgsts']:>7.0f}{r['shared_bytes']:>9.0f}"
              + (f"{r['masked']['instructions']:>7.0f}{r['masked']['per_hmma']:>6.1f}"
                 if "masked" in r else f"{'-':>7}{'-':>6}"))
    print(f"\n{'device':<11}{'case':<46}{'kernel':<16}{'bound':>7}{'clk issue/tc/smem':>19}"
          f"{'TFLOPS':>7}{'of peak':>8}{'GB/s':>7}{'of HBM':>7}{'ms':>8}{'masked':>7}")
    for e in estimates:
        clk = "/".join(f"{v:.0f}" for v in e["clocks_per_pass"].values())
        print(f"{e['device']:<11}{e['case']:<46}{e['kernel']:<16}{e['bound']:>7}{clk:>19}"
              f"{e['tflops']:>7.0f}{e['fraction_of_peak']:>8.0%}{e['bandwidth'] / 1e9:>7.0f}"
              f"{e['fraction_of_hbm']:>7.0%}{e['seconds'] * 1e3:>8.3f}{e['boundary_share']:>7.1%}")


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
    start = time.perf_counter()
    kernels, usage, source = load_kernels(opts.module or module_path())
    if not kernels:
        print(f"bench_gpu_model: skipped, {source} holds no CUDA kernels (a CPU-only build) "
              "and nvcc is not found")
        return
    print(f"disassembled {len(kernels)} kernels of {source} in "
          f"{time.perf_counter() - start:.1f} s; classes: {', '.join(CLASSES)}")
    devices = [get_device(d) for d in opts.devices.split(",")]
    payload = {"device": "model (SASS, no GPU)", "module": source,
               "tools": {t: find_tool(t) for t in ("cuobjdump", "nvdisasm")},
               "devices": [{f: getattr(d, f) for f in d.__slots__} for d in devices],
               "kernels": kernel_rows(kernels, usage), "rows": standard_rows(kernels, devices),
               "tensor_core": tensor_core_rows(kernels, usage),
               "tensor_core_estimates": tensor_core_estimates(kernels, devices),
               "mma_sync_share": tc.MMA_SYNC_SHARE}
    print_kernels(payload["kernels"])
    print_estimates(payload["rows"])
    print_tensor_core(payload["tensor_core"], payload["tensor_core_estimates"])
    if not opts.no_traffic:
        start = time.perf_counter()
        payload["traffic"] = traffic_rows(SIZES, GROUPS, CACHES)
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
