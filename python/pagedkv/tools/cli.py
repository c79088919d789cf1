"""The ``pagedkv`` command: info, size, simulate, demo.

Examples::

    pagedkv info
    pagedkv size --model llama-3-8b --seq-len 8192 --batch 16 --memory 80GiB
    pagedkv size --model gpt-oss-120b --seq-len 32768 --memory 80GiB
    pagedkv size --model deepseek-v3 --seq-len 32768 --memory 80GiB
    pagedkv size --layers 32 --kv-heads 8 --head-size 128 --cache-dtype fp8 --json
    pagedkv size --model llama-3-8b --seq-len 8192 --memory 80GiB --cache-dtype int8 --formats
    pagedkv simulate
    pagedkv simulate --sweep-rate --plot latency.png --json
    pagedkv simulate --trace requests.jsonl --calibrate bench/results/bench_engine.json \\
        --calibrated-model demo
    pagedkv demo --requests 16

The microbenchmarks are not a subcommand: they ship with the source tree, not the installed
package (``python -m bench`` in a checkout).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import sys
from collections.abc import Callable, Sequence

import torch

from pagedkv import __version__, ops
from pagedkv.cache.spec import KVCacheSpec
from pagedkv.errors import InvalidArgumentError
from pagedkv.serving.parallel import kv_heads_per_rank
from pagedkv.tools import argtypes, cli_simulate, demo
from pagedkv.tools.cache_formats import formats_lines, formats_report
from pagedkv.tools.presets import (
    DTYPES,
    MODELS,
    ModelPreset,
    format_bytes,
    hybrid_report,
    size_report,
)
from pagedkv.tools.presets_mla import mla_report

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the ``pagedkv`` command line; returns the exit status."""
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        return args.run(args)
    except (ValueError, OSError, ImportError) as e:  # bad input, unreadable files, no matplotlib
        print(f"pagedkv {args.command}: error: {e}", file=sys.stderr)
        return 1


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pagedkv", description="Paged KV cache kernels and block management for PyTorch.",
        epilog="Run 'pagedkv COMMAND --help' for the options of a command.")
    parser.add_argument("--version", action="version", version=f"pagedkv {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_info(sub)
    _add_size(sub)
    _add_simulate(sub)
    _add_demo(sub)
    return parser


def _command(sub: argparse._SubParsersAction, name: str, run: Callable, text: str,
             description: str | None = None) -> argparse.ArgumentParser:
    parser = sub.add_parser(name, help=text, description=description or text,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")
    parser.set_defaults(run=run)
    return parser


def _print(args: argparse.Namespace, data: dict, text: str) -> int:
    print(json.dumps(data, indent=2) if args.json else text)
    return 0


# info ---------------------------------------------------------------------------------------


def _add_info(sub: argparse._SubParsersAction) -> None:
    _command(sub, "info", _info, "version, torch, built backends, GPU, CPU threads and kernels")


def _info_data() -> dict[str, object]:
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    try:
        importlib.import_module("pagedkv._simt")
        simt: str | bool = True
    except ImportError as e:
        simt = f"not built ({e})" if not isinstance(e, ModuleNotFoundError) else False
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    gpu = f"{torch.cuda.get_device_name()} (x{gpus})" if gpus else None
    kernel = ops.cpu_attention_kernel()
    return {"pagedkv": __version__, "torch": torch.__version__, "torch_cuda": torch.version.cuda,
            "pagedkv._C": {"cpu": has("pagedkv::reshape_and_cache", "CPU"),
                           "cuda": has("pagedkv::reshape_and_cache", "CUDA")},
            "pagedkv._simt": simt, "gpu": gpu, "cuda_available": torch.cuda.is_available(),
            "cpu_threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
            "cpu_attention_kernel": kernel,
            # bfloat16 prefill on vdpbf16ps: the avx512bf16 kernels, where they pay (csrc/cpu)
            "cpu_bf16_dot_products": ops.cpu_bf16_dot_products(),
            # ... or on AMX tiles (tdpbf16ps), where PAGEDKV_CPU_AMX=1 asks (opt-in)
            "cpu_amx_tiles": ops.cpu_amx_tiles()}


def _info(args: argparse.Namespace) -> int:
    d = _info_data()
    yes = {True: "yes", False: "no"}
    simt = {True: "built", False: "not built"}.get(d["pagedkv._simt"], d["pagedkv._simt"])
    text = "\n".join([
        f"pagedkv        {d['pagedkv']}",
        f"torch          {d['torch']} (CUDA {d['torch_cuda'] or 'none'})",
        f"pagedkv._C     CPU kernels: {yes[d['pagedkv._C']['cpu']]}, "
        f"CUDA kernels: {yes[d['pagedkv._C']['cuda']]}",
        f"pagedkv._simt  {simt}",
        f"GPU            {d['gpu'] or 'none'}",
        f"CPU threads    {d['cpu_threads']} (torch) of {d['cpu_count']} CPUs",
        f"CPU attention  {d['cpu_attention_kernel']} kernels (head size 128); bf16 prefill: "
        + ("AMX tiles (AMX-BF16)" if d["cpu_amx_tiles"]
           else "bf16 dot products (AVX512_BF16)" if d["cpu_bf16_dot_products"]
           else "float FMAs (bf16 dot products measured slower)"
           if d["cpu_attention_kernel"] == "avx512bf16" else "float FMAs (no AVX512_BF16)"),
    ])
    return _print(args, d, text)


# size ---------------------------------------------------------------------------------------


def _add_size(sub: argparse._SubParsersAction) -> None:
    p = _command(sub, "size", _size, "KV cache size of a model preset or given dimensions",
                 "KV cache size: kv_cache_bytes = 2 (K and V) x layers x kv_heads x seq_len\n"
                 "x batch x bytes per row (head_size x bytes per element, plus a 4-byte scale\n"
                 "in the int8, int4 and per-token-head fp8 formats); an MLA preset's latent\n"
                 "cache: layers x 576 x seq_len x batch x bytes, beside its MHA form. Model\n"
                 "presets: see --list-models.")
    p.add_argument("--model", type=argtypes.model_preset,
                   help="a preset (case-insensitive); see --list-models")
    p.add_argument("--list-models", action="store_true", help="list the presets and exit")
    p.add_argument("--layers", type=argtypes.positive_int,
                   help="attention layers (overrides the preset)")
    p.add_argument("--kv-heads", type=argtypes.positive_int,
                   help="key/value heads per layer (GQA: < query heads)")
    p.add_argument("--head-size", type=argtypes.positive_int, help="elements per head")
    p.add_argument("--seq-len", type=argtypes.positive_int,
                   help="tokens per sequence (default: the model's max_position_embeddings, "
                        "or 4096)")
    p.add_argument("--batch", type=argtypes.positive_int, default=1, help="sequences (default 1)")
    p.add_argument("--dtype", choices=DTYPES, metavar="DTYPE",
                   help="model dtype (default: the preset's, or bf16)")
    p.add_argument("--cache-dtype", type=argtypes.cache_dtype, metavar="FORMAT",
                   help="cache format (default: --dtype): fp16, bf16, fp32, fp8 (e4m3), fp8_e5m2 "
                        "(a scale per layer), int8, int4, fp8_per_token_head, "
                        "fp8_e5m2_per_token_head (a float32 scale per token and head)")
    p.add_argument("--formats", action="store_true",
                   help="add a table of every cache format: bytes per token and, with "
                        "--memory, the sequences each holds against --dtype's")
    p.add_argument("--block-size", type=argtypes.positive_int, default=16,
                   help="tokens per block (default 16)")
    p.add_argument("--memory", type=argtypes.byte_size,
                   help="a memory budget for the cache (per rank with --tp), e.g. 80GiB or 40GB")
    p.add_argument("--tp", type=argtypes.positive_int, default=1,
                   help="tensor parallel ranks: the figures are one rank's, holding its share of "
                        "the KV heads (default 1)")
    p.add_argument("--sliding-window", type=argtypes.count, metavar="TOKENS",
                   help="the window of the windowed layers, 0 for none (default: the preset's): "
                        "adds the hybrid manager's figures")
    p.add_argument("--full-every", type=argtypes.count, metavar="N",
                   help="with --sliding-window: every N-th layer attends in full, 0 for none "
                        "(default: the preset's, else 0)")
    p.set_defaults(parser=p)


def _size_spec(args: argparse.Namespace) -> tuple[str, KVCacheSpec, int]:
    preset = args.model
    dims = [args.layers, args.kv_heads, args.head_size]
    if preset is None and None in dims:
        args.parser.error("give --model NAME or all of --layers, --kv-heads and --head-size")
    defaults = (preset.num_layers, preset.num_kv_heads, preset.head_size) if preset else dims
    layers, kv_heads, head_size = (d if d is not None else p for d, p in
                                   zip(dims, defaults, strict=True))
    dtype = args.dtype or (preset.dtype if preset else "bf16")
    latent = preset is not None and preset.mla is not None
    if latent:
        _check_latent_options(args, preset)
    try:
        if preset is not None and args.kv_heads is None:
            preset.check_tp(args.tp)
        rank_kv_heads = kv_heads_per_rank(kv_heads, args.tp)
    except InvalidArgumentError as e:
        args.parser.error(f"argument --tp: {e}")
    try:
        spec = KVCacheSpec(layers, rank_kv_heads, head_size, args.block_size, DTYPES[dtype],
                           args.cache_dtype, latent=latent)
    except InvalidArgumentError as e:
        args.parser.error(f"argument --cache-dtype: {e}")
    name = preset.name if preset else "custom"
    return name, spec, args.seq_len or (preset.max_len if preset else 4096)


def _check_latent_options(args: argparse.Namespace, preset: ModelPreset) -> None:
    """An MLA preset's cache is one latent row per token and layer: no heads, no windows."""
    given = [name for name, value in (("--kv-heads", args.kv_heads),
                                      ("--head-size", args.head_size),
                                      ("--sliding-window", args.sliding_window)) if value]
    if given:
        args.parser.error(f"argument {given[0]}: {preset.name} caches one latent row of "
                          f"{preset.head_size} per token and layer (MLA), shared by every head")


def _shape_lines(name: str, spec: KVCacheSpec, dtype: str, per_token: int,
                 mla: dict | None) -> list[str]:
    """The cache's shape and its bytes per token (an MLA latent: and its MHA form's)."""
    fmt = spec.format
    element = f"{fmt.bits / 8:g} B" + (" + a 4 B scale a row" if fmt.token_scaled else "")
    cache = f"cache {dtype} ({element}), blocks of {spec.block_size}"
    row = (f"({spec.head_size} x {fmt.bits / 8:g} B + 4 B)" if fmt.token_scaled
           else f"{spec.head_size} x {spec.element_size} B")
    if mla is None:
        return [f"{name}: {spec.num_layers} layers x {spec.num_kv_heads} KV heads x head size "
                f"{spec.head_size}, {cache}",
                f"per token      {format_bytes(per_token):>10}   2 x {spec.num_layers} x "
                f"{spec.num_kv_heads} x {row} = {per_token:,} B"]
    mha = mla["mha_bytes_per_token"]
    return [f"{name}: {spec.num_layers} layers x one latent row of {spec.head_size} (MLA: "
            f"kv_lora_rank {mla['kv_lora_rank']} + rope {mla['rope_dim']}, shared by "
            f"{mla['num_heads']} heads), {cache}",
            f"per token      {format_bytes(per_token):>10}   {spec.num_layers} x "
            f"{spec.head_size} x {spec.element_size} B = {per_token:,} B",
            f"MHA form       {format_bytes(mha):>10}   {spec.num_layers} x "
            f"{mla['heads_per_rank']} heads x (K {mla['qk_head_dim']} + V {mla['v_head_dim']})"
            f" x {spec.element_size} B = {mha:,} B: {mla['mha_ratio']:.1f}x the latent"]


def _layer_windows(args: argparse.Namespace, num_layers: int) -> tuple[int | None, ...] | None:
    """Each layer's window from --sliding-window / --full-every or the preset (None: none)."""
    preset = args.model
    window = args.sliding_window
    every = args.full_every
    if args.full_every is not None and window is None and preset is None:
        args.parser.error("argument --full-every: needs --sliding-window")
    if window is None:
        if preset is None or args.layers is not None:
            return None
        window = preset.sliding_window
    if every is None:
        every = preset.full_every if preset is not None else 0
    if not window:
        return None
    return tuple(None if every and (i + 1) % every == 0 else window for i in range(num_layers))


def _kinds(groups: list[dict]) -> list[str]:
    """The groups by attention kind: layers, groups, blocks per sequence of each group."""
    kinds: dict[int | None, list[dict]] = {}
    for group in groups:
        kinds.setdefault(group["window"], []).append(group)
    return [f"{sum(g['layers'] for g in same)} layers "
            + (f"window {window:,}" if window else "full attention")
            + f" ({len(same)} group{'s' * (len(same) > 1)}, {same[0]['blocks_per_seq']:,} blocks"
            + (" each)" if len(same) > 1 else ")")
            for window, same in kinds.items()]


def _hybrid_lines(spec: KVCacheSpec, h: dict, seq_len: int, full_fit: int | None) -> list[str]:
    ratio = h["hybrid_bytes_per_token"] / h["full_bytes_per_token"]
    lines = [f"hybrid manager {len(h['groups'])} KV cache groups over one pool, a block = a page "
             f"of {spec.page_layers} layers ({format_bytes(h['bytes_per_page'])})",
             "  groups       " + "; ".join(_kinds(h["groups"])),
             f"  per token    {format_bytes(h['hybrid_bytes_per_token']):>10}   at {seq_len:,} "
             f"tokens, against {format_bytes(h['full_bytes_per_token'])} with every layer in "
             f"full ({ratio:.2f}x)",
             f"  per sequence {format_bytes(h['hybrid_bytes_per_seq']):>10}   batch "
             f"{h['batch']}: "
             f"{format_bytes(h['hybrid_kv_cache_bytes'])}"]
    if "hybrid_seqs_fit" in h:
        lines.append(f"  in the budget {h['hybrid_seqs_fit']:>9,} sequences of {seq_len:,} "
                     f"(every layer in full: {full_fit:,})")
    return lines


def _size(args: argparse.Namespace) -> int:
    if args.list_models:
        return _list_models(args)
    name, spec, seq_len = _size_spec(args)
    windows = _layer_windows(args, spec.num_layers)
    memory = args.memory
    r = size_report(spec, seq_len, args.batch, memory)
    dtype = spec.format.name
    data = {"model": name, "num_layers": spec.num_layers, "num_kv_heads": spec.num_kv_heads,
            "tp": args.tp, "latent": spec.latent,
            "head_size": spec.head_size, "cache_dtype": dtype, "element_size": spec.element_size,
            "row_bytes": spec.row_bytes, "token_scaled": spec.token_scaled,
            "block_size": spec.block_size, "seq_len": seq_len, "batch": args.batch, **r}
    if spec.latent:
        data["mla"] = mla_report(spec.num_layers, args.model.num_heads, args.model.mla,
                                 spec.element_size, args.tp)
    lines = [
        *_shape_lines(name, spec, dtype, r["bytes_per_token"], data.get("mla")),
        f"per block      {format_bytes(r['bytes_per_block']):>10}   {spec.block_size} tokens",
        f"per sequence   {format_bytes(r['bytes_per_seq']):>10}   {seq_len:,} tokens, "
        f"{r['blocks_per_seq']:,} blocks",
        f"total          {format_bytes(r['kv_cache_bytes']):>10}   batch {args.batch} "
        f"({r['kv_cache_bytes']:,} B; paged: {format_bytes(r['paged_bytes'])})",
    ]
    if memory is not None:
        lines.append(f"in {format_bytes(memory):<11} {r['tokens_fit']:>10,} tokens = "
                     f"{r['blocks_fit']:,} blocks = {r['seqs_fit']:,} sequences of {seq_len:,}")
    if windows is not None:
        hybrid = dataclasses.replace(spec, sliding_windows=windows)
        data["hybrid"] = hybrid_report(hybrid, seq_len, args.batch, memory)
        lines += _hybrid_lines(hybrid, data["hybrid"], seq_len, r.get("seqs_fit"))
    if args.tp > 1:
        held = ("the whole latent on every rank" if spec.latent
                else f"{spec.num_kv_heads} KV head(s) per rank")
        lines.append(f"tensor parallel over {args.tp} ranks: the figures are each rank's, with "
                     f"{held}; blocks are per rank")
    if spec.is_fp8:
        lines.append("fp8 caches also hold one float32 "
                     + ("scale" if spec.latent else "k_scale and v_scale") + " per layer")
    if spec.token_scaled:
        lines.append(f"{dtype} rows carry their float32 scale: 4 B of each {spec.row_bytes} B "
                     "row, counted above")
    if args.formats:
        data["formats"] = formats_report(spec, seq_len, memory)
        lines += formats_lines(data["formats"], spec, seq_len, memory)
    return _print(args, data, "\n".join(lines))


def _window(row: dict) -> str:
    """``128 1:1`` (windowed : full layers), ``4096`` (every layer) or ``-``."""
    if not row["sliding_window"]:
        return "-"
    every = row["full_every"]
    return f"{row['sliding_window']} {every - 1}:1" if every else str(row["sliding_window"])


def _list_models(args: argparse.Namespace) -> int:
    rows = [{"name": m.name, "num_layers": m.num_layers, "num_heads": m.num_heads,
             "num_kv_heads": m.num_kv_heads, "head_size": m.head_size, "max_len": m.max_len,
             "dtype": m.dtype, "bytes_per_token": m.spec().bytes_per_token,
             "sliding_window": m.sliding_window, "full_every": m.full_every,
             "latent": m.mla is not None, "mha_bytes_per_token": _mha_bytes(m), "note": m.note}
            for m in MODELS.values()]
    lines = [f"{'model':<16}{'layers':>7}{'heads':>6}{'kv':>4}{'head':>5}{'max_len':>9}"
             f"{'dtype':>6}{'per token':>11}{'window':>11}"]
    lines += [f"{r['name']:<16}{r['num_layers']:>7}{r['num_heads']:>6}{r['num_kv_heads']:>4}"
              f"{r['head_size']:>5}{r['max_len']:>9}{r['dtype']:>6}"
              f"{format_bytes(r['bytes_per_token']):>11}{_window(r):>11}  {_note(r)}".rstrip()
              for r in rows]
    return _print(args, {"models": rows}, "\n".join(lines))


def _mha_bytes(model: ModelPreset) -> int | None:
    """An MLA preset's cache per token in the MHA form (None: not MLA)."""
    if model.mla is None:
        return None
    element = model.spec().element_size
    return mla_report(model.num_layers, model.num_heads, model.mla, element)["mha_bytes_per_token"]


def _note(row: dict) -> str:
    if not row["latent"]:
        return row["note"]
    mha = row["mha_bytes_per_token"]
    return (f"MLA latent of {row['head_size']}; MHA form {format_bytes(mha)} "
            f"({mha / row['bytes_per_token']:.1f}x); {row['note']}")


# simulate, demo -----------------------------------------------------------------------------


def _add_simulate(sub: argparse._SubParsersAction) -> None:
    p = _command(sub, "simulate", lambda args: _print(args, *cli_simulate.run(args)),
                 cli_simulate.HELP, cli_simulate.DESCRIPTION)
    cli_simulate.add_arguments(p)


def _add_demo(sub: argparse._SubParsersAction) -> None:
    p = _command(sub, "demo", demo.run, demo.HELP, demo.DESCRIPTION)
    demo.add_arguments(p)


if __name__ == "__main__":
    sys.exit(main())
