"""The ``pagedkv`` command: info, size, simulate, bench, demo.

Examples::

    pagedkv info
    pagedkv size --model llama-3-8b --seq-len 8192 --batch 16 --memory 80GiB
    pagedkv size --layers 32 --kv-heads 8 --head-size 128 --cache-dtype fp8 --json
    pagedkv simulate --trace sharegpt --requests 1000 --memory 8GiB --plot sim.png
    pagedkv simulate --trace requests.jsonl --num-blocks 2048 --json
    pagedkv bench --quick
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from pagedkv import __version__
from pagedkv.cache.spec import KVCacheSpec
from pagedkv.tools.presets import DTYPES, MODELS, format_bytes, get_model, parse_bytes, size_report

__all__ = ["main"]

_FORWARDED = {"bench": "run the repository's microbenchmarks (python -m bench; needs a source "
                       "checkout); arguments go to bench, see pagedkv bench --help",
              "demo": "run the end-to-end demo (pagedkv.tools.demo); arguments go to the demo"}


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the ``pagedkv`` command line; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in _FORWARDED:
        return _forward(argv[0], argv[1:])
    args = _parser().parse_args(argv)
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
    for name, text in _FORWARDED.items():
        sub.add_parser(name, help=text, add_help=False)
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
    _command(sub, "info", _info, "version, torch, built backends, GPU, CPU threads")


def _info_data() -> dict[str, object]:
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    try:
        importlib.import_module("pagedkv._simt")
        simt: str | bool = True
    except ImportError as e:
        simt = f"not built ({e})" if not isinstance(e, ModuleNotFoundError) else False
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    gpu = f"{torch.cuda.get_device_name()} (x{gpus})" if gpus else None
    return {"pagedkv": __version__, "torch": torch.__version__, "torch_cuda": torch.version.cuda,
            "pagedkv._C": {"cpu": has("pagedkv::reshape_and_cache", "CPU"),
                           "cuda": has("pagedkv::reshape_and_cache", "CUDA")},
            "pagedkv._simt": simt, "gpu": gpu, "cuda_available": torch.cuda.is_available(),
            "cpu_threads": torch.get_num_threads(), "cpu_count": os.cpu_count()}


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
    ])
    return _print(args, d, text)


# size ---------------------------------------------------------------------------------------


def _add_size(sub: argparse._SubParsersAction) -> None:
    p = _command(sub, "size", _size, "KV cache size of a model preset or given dimensions",
                 "KV cache size: kv_cache_bytes = 2 (K and V) x layers x kv_heads x head_size\n"
                 "x seq_len x batch x bytes per element. Model presets: see --list-models.")
    p.add_argument("--model", help="a preset (case-insensitive); see --list-models")
    p.add_argument("--list-models", action="store_true", help="list the presets and exit")
    p.add_argument("--layers", type=int, help="attention layers (overrides the preset)")
    p.add_argument("--kv-heads", type=int, help="key/value heads per layer (GQA: < query heads)")
    p.add_argument("--head-size", type=int, help="elements per head")
    p.add_argument("--seq-len", type=int, help="tokens per sequence (default: the model's "
                   "max_position_embeddings, or 4096)")
    p.add_argument("--batch", type=int, default=1, help="sequences (default 1)")
    p.add_argument("--dtype", choices=DTYPES, metavar="DTYPE",
                   help="model dtype (default: the preset's, or bf16)")
    p.add_argument("--cache-dtype", choices=DTYPES, metavar="DTYPE",
                   help="cache dtype: fp16, bf16, fp32, fp8 (e4m3), fp8_e5m2 (default: --dtype)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per block (default 16)")
    p.add_argument("--memory", help="a memory budget for the cache, e.g. 80GiB or 40GB")


def _size_spec(args: argparse.Namespace) -> tuple[str, KVCacheSpec, int]:
    preset = get_model(args.model) if args.model else None
    dims = [args.layers, args.kv_heads, args.head_size]
    if preset is None and None in dims:
        raise ValueError("give --model NAME or all of --layers, --kv-heads and --head-size")
    defaults = (preset.num_layers, preset.num_kv_heads, preset.head_size) if preset else dims
    layers, kv_heads, head_size = (d if d is not None else p for d, p in
                                   zip(dims, defaults, strict=True))
    dtype = args.dtype or (preset.dtype if preset else "bf16")
    spec = KVCacheSpec(layers, kv_heads, head_size, args.block_size, DTYPES[dtype],
                       DTYPES[args.cache_dtype] if args.cache_dtype else None)
    name = preset.name if preset else "custom"
    return name, spec, args.seq_len or (preset.max_len if preset else 4096)


def _size(args: argparse.Namespace) -> int:
    if args.list_models:
        return _list_models(args)
    name, spec, seq_len = _size_spec(args)
    if seq_len <= 0 or args.batch <= 0:
        raise ValueError("--seq-len and --batch must be positive")
    memory = parse_bytes(args.memory) if args.memory else None
    r = size_report(spec, seq_len, args.batch, memory)
    dtype = str(spec.kv_dtype).removeprefix("torch.")
    data = {"model": name, "num_layers": spec.num_layers, "num_kv_heads": spec.num_kv_heads,
            "head_size": spec.head_size, "cache_dtype": dtype, "element_size": spec.element_size,
            "block_size": spec.block_size, "seq_len": seq_len, "batch": args.batch, **r}
    lines = [
        f"{name}: {spec.num_layers} layers x {spec.num_kv_heads} KV heads x head size "
        f"{spec.head_size}, cache {dtype} ({spec.element_size} B), blocks of {spec.block_size}",
        f"per token      {format_bytes(r['bytes_per_token']):>10}   2 x {spec.num_layers} x "
        f"{spec.num_kv_heads} x {spec.head_size} x {spec.element_size} B = "
        f"{r['bytes_per_token']:,} B",
        f"per block      {format_bytes(r['bytes_per_block']):>10}   {spec.block_size} tokens",
        f"per sequence   {format_bytes(r['bytes_per_seq']):>10}   {seq_len:,} tokens, "
        f"{r['blocks_per_seq']:,} blocks",
        f"total          {format_bytes(r['kv_cache_bytes']):>10}   batch {args.batch} "
        f"({r['kv_cache_bytes']:,} B; paged: {format_bytes(r['paged_bytes'])})",
    ]
    if memory is not None:
        lines.append(f"in {format_bytes(memory):<11} {r['tokens_fit']:>10,} tokens = "
                     f"{r['blocks_fit']:,} blocks = {r['seqs_fit']:,} sequences of {seq_len:,}")
    if spec.is_fp8:
        lines.append("fp8 caches also hold one float32 k_scale and v_scale per layer")
    return _print(args, data, "\n".join(lines))


def _list_models(args: argparse.Namespace) -> int:
    rows = [{"name": m.name, "num_layers": m.num_layers, "num_heads": m.num_heads,
             "num_kv_heads": m.num_kv_heads, "head_size": m.head_size, "max_len": m.max_len,
             "dtype": m.dtype, "bytes_per_token": m.spec().bytes_per_token, "note": m.note}
            for m in MODELS.values()]
    lines = [f"{'model':<16}{'layers':>7}{'heads':>6}{'kv':>4}{'head':>5}{'max_len':>9}"
             f"{'dtype':>6}{'per token':>11}"]
    lines += [f"{r['name']:<16}{r['num_layers']:>7}{r['num_heads']:>6}{r['num_kv_heads']:>4}"
              f"{r['head_size']:>5}{r['max_len']:>9}{r['dtype']:>6}"
              f"{format_bytes(r['bytes_per_token']):>11}  {r['note']}".rstrip() for r in rows]
    return _print(args, {"models": rows}, "\n".join(lines))


# simulate -----------------------------------------------------------------------------------


def _add_simulate(sub: argparse._SubParsersAction) -> None:
    from pagedkv.tools import sim, traces

    p = _command(sub, "simulate", _simulate,
                 "serving simulation: contiguous vs paged vs paged + prefix sharing",
                 (sim.__doc__ or "") + "\n" + (traces.__doc__ or ""))
    p.add_argument("--trace", default="sharegpt",
                   help="sharegpt, alpaca, or a JSONL file (default sharegpt)")
    p.add_argument("--requests", "-n", type=int, default=1000,
                   help="requests of a synthetic trace (default 1000)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    p.add_argument("--system-share", type=float, default=0.3, help="share of synthetic "
                   "requests that open with a common system prompt (default 0.3)")
    p.add_argument("--system-prompts", type=int, default=4,
                   help="distinct system prompts (default 4)")
    p.add_argument("--system-len", type=int, default=200,
                   help="mean system prompt length in tokens (default 200)")
    p.add_argument("--max-len", type=int, default=2048, help="max prompt + output tokens: "
                   "the reservation of contiguous-max (default 2048)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per block (default 16)")
    p.add_argument("--num-blocks", type=int, help="the KV budget in blocks (overrides --memory)")
    p.add_argument("--memory", default="8GiB",
                   help="the KV budget in bytes of --model's cache (default 8GiB)")
    p.add_argument("--model", default="llama-3-8b", help="model for --memory (default llama-3-8b)")
    p.add_argument("--cache-dtype", choices=DTYPES, metavar="DTYPE",
                   help="cache dtype for --memory (default: the model's)")
    p.add_argument("--max-running", type=int, default=0,
                   help="cap on running requests (default 0: none)")
    p.add_argument("--arrival-rate", type=float, default=0.0, help="Poisson arrivals, requests "
                   "per step (default 0: all requests queued at step 0)")
    p.add_argument("--strategies", default=",".join(sim.STRATEGIES),
                   help="comma-separated subset of " + ", ".join(sim.STRATEGIES))
    p.add_argument("--plot", metavar="PNG", help="write a plot of memory and concurrency")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _simulate(args: argparse.Namespace) -> int:
    from pagedkv.tools import report, sim, traces

    if args.trace in traces.TRACES:
        requests = traces.synthetic_trace(
            args.trace, args.requests, args.seed, args.max_len, args.system_prompts,
            args.system_share, args.system_len)
    else:
        requests = traces.load_jsonl(args.trace)
    spec = get_model(args.model).spec(args.block_size, args.cache_dtype)
    num_blocks = args.num_blocks or spec.num_blocks_for(parse_bytes(args.memory))
    if num_blocks < 2:
        raise ValueError(f"a budget of {num_blocks} block(s) is too small")
    strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    progress = not args.no_progress and sys.stderr.isatty()
    results = sim.simulate(requests, num_blocks, args.block_size, args.max_len, strategies,
                           args.max_running, args.arrival_rate, args.seed, progress)
    stats = traces.trace_stats(requests)
    slots = num_blocks * args.block_size
    budget = f"{num_blocks:,} blocks x {args.block_size} = {slots:,} token slots"
    if not args.num_blocks:
        budget += f" ({args.memory} of {get_model(args.model).name} KV cache)"
    if args.plot:
        report.plot(results, args.plot, slots, f"{args.trace}: {len(requests)} requests, "
                        f"{budget}")
    config = {k: v for k, v in vars(args).items() if k not in ("run", "json", "no_progress")}
    data = report.to_json(results, config=config | {"num_blocks": num_blocks}, trace=stats)
    text = "\n".join([
        f"trace    {args.trace}: {stats['requests']} requests, prompt mean "
        f"{stats['prompt_mean']:.0f} (p99 {stats['prompt_p99']:.0f}), output mean "
        f"{stats['output_mean']:.0f} (p99 {stats['output_p99']:.0f}), "
        f"{stats['prefix_share']:.0%} with a shared prefix",
        f"budget   {budget}, max_len {args.max_len}", "",
        report.format_table(results),
    ] + ([f"\nplot written to {args.plot}"] if args.plot else []))
    return _print(args, data, text)


# bench, demo --------------------------------------------------------------------------------


def _forward(command: str, argv: list[str]) -> int:
    try:
        run = _bench_main() if command == "bench" else _demo_main()
    except RuntimeError as e:
        print(f"pagedkv {command}: error: {e}", file=sys.stderr)
        return 1
    return run(argv) or 0


def _bench_main() -> Callable[[list[str]], int | None]:
    root = Path(__file__).resolve().parents[3]  # python/pagedkv/tools/cli.py -> the checkout
    if not (root / "bench" / "__main__.py").is_file():
        raise RuntimeError(f"no bench/ package next to this pagedkv ({root / 'bench'} not found): "
                           "the benchmarks ship with the source tree, not the installed package; "
                           "run them from a checkout (pip install -e . or python -m bench)")
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    module = importlib.import_module("bench.__main__")
    if Path(module.__file__).resolve().parent != root / "bench":
        raise RuntimeError(f"another 'bench' package shadows {root / 'bench'}: {module.__file__}")
    return module.main


def _demo_main() -> Callable[[list[str]], int | None]:
    try:
        module = importlib.import_module("pagedkv.tools.demo")
    except ModuleNotFoundError as e:
        if e.name != "pagedkv.tools.demo":
            raise
        raise RuntimeError("this pagedkv has no demo module (pagedkv/demo.py)") from None
    return module.main


if __name__ == "__main__":
    sys.exit(main())
