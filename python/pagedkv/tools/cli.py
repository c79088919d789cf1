"""The ``pagedkv`` command: info, size, simulate, bench, demo.

Examples::

    pagedkv info
    pagedkv size --model llama-3-8b --seq-len 8192 --batch 16 --memory 80GiB
    pagedkv size --layers 32 --kv-heads 8 --head-size 128 --cache-dtype fp8 --json
    pagedkv simulate --rate 4 --plot memory.png
    pagedkv simulate --sweep-rate --plot latency.png --json
    pagedkv simulate --trace requests.jsonl --calibrate bench/results/bench_engine.json \\
        --calibrated-model demo
    pagedkv bench --quick
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from pagedkv import __version__, ops
from pagedkv.cache.spec import KVCacheSpec
from pagedkv.errors import InvalidArgumentError
from pagedkv.serving.parallel import kv_heads_per_rank
from pagedkv.tools import argtypes
from pagedkv.tools.presets import DTYPES, MODELS, format_bytes, get_model, size_report

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
            # bfloat16 prefill on vdpbf16ps: the avx512bf16 kernels (csrc/cpu/attention_kernel.h)
            "cpu_bf16_dot_products": kernel == "avx512bf16"}


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
        + ("bf16 dot products (AVX512_BF16)" if d["cpu_bf16_dot_products"]
           else "float FMAs (no AVX512_BF16)"),
    ])
    return _print(args, d, text)


# size ---------------------------------------------------------------------------------------


def _add_size(sub: argparse._SubParsersAction) -> None:
    p = _command(sub, "size", _size, "KV cache size of a model preset or given dimensions",
                 "KV cache size: kv_cache_bytes = 2 (K and V) x layers x kv_heads x head_size\n"
                 "x seq_len x batch x bytes per element. Model presets: see --list-models.")
    p.add_argument("--model", type=_preset, help="a preset (case-insensitive); see --list-models")
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
    p.add_argument("--cache-dtype", choices=DTYPES, metavar="DTYPE",
                   help="cache dtype: fp16, bf16, fp32, fp8 (e4m3), fp8_e5m2 (default: --dtype)")
    p.add_argument("--block-size", type=argtypes.positive_int, default=16,
                   help="tokens per block (default 16)")
    p.add_argument("--memory", type=argtypes.byte_size,
                   help="a memory budget for the cache (per rank with --tp), e.g. 80GiB or 40GB")
    p.add_argument("--tp", type=argtypes.positive_int, default=1,
                   help="tensor parallel ranks: the figures are one rank's, holding its share of "
                        "the KV heads (default 1)")
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
    try:
        if preset is not None and args.kv_heads is None:
            preset.check_tp(args.tp)
        rank_kv_heads = kv_heads_per_rank(kv_heads, args.tp)
    except InvalidArgumentError as e:
        args.parser.error(f"argument --tp: {e}")
    spec = KVCacheSpec(layers, rank_kv_heads, head_size, args.block_size, DTYPES[dtype],
                       DTYPES[args.cache_dtype] if args.cache_dtype else None)
    name = preset.name if preset else "custom"
    return name, spec, args.seq_len or (preset.max_len if preset else 4096)


def _size(args: argparse.Namespace) -> int:
    if args.list_models:
        return _list_models(args)
    name, spec, seq_len = _size_spec(args)
    memory = args.memory
    r = size_report(spec, seq_len, args.batch, memory)
    dtype = str(spec.kv_dtype).removeprefix("torch.")
    data = {"model": name, "num_layers": spec.num_layers, "num_kv_heads": spec.num_kv_heads,
            "tp": args.tp,
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
    if args.tp > 1:
        lines.append(f"tensor parallel over {args.tp} ranks: the figures are each rank's, with "
                     f"{spec.num_kv_heads} KV head(s) per rank; blocks are per rank")
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


def _preset(text: str):
    try:
        return get_model(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _device(text: str):
    from pagedkv.tools.costmodel import get_device

    try:
        return get_device(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _trace(text: str) -> str:
    from pagedkv.tools.traces import TRACES

    if text in TRACES:
        return text
    try:
        return str(argtypes.existing_file(text))
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"expected {', '.join(TRACES)} or a JSONL file, got {text!r} (no such file)") from None


_SIMULATE_EPILOG = """\
examples:
  pagedkv simulate                                   ShareGPT-like, H100, Llama-3-8B, all at once
  pagedkv simulate --rate 4 --json                   Poisson arrivals at 4 requests/s
  pagedkv simulate --sweep-rate --plot rate.png      latency vs request rate, sustained rates
  pagedkv simulate --device a100-40gb --model opt-13b --sweep-rate   the vLLM paper's setting
  pagedkv simulate --trace requests.jsonl --num-blocks 2048 --calibrate \\
      bench/results/bench_engine.json --calibrated-model demo     steps timed on this machine
The model behind the numbers (strategies, cost model, metrics): docs/simulator.md."""


def _add_simulate(sub: argparse._SubParsersAction) -> None:
    from pagedkv.tools import sim

    p = _command(sub, "simulate", _simulate,
                 "serving simulation with time: contiguous vs paged vs paged + prefix sharing",
                 "Serve a request trace with the engine's scheduler, priced by a step cost model "
                 "(a device's roofline, or steps measured here); report throughput and latency "
                 "per strategy under one KV budget.")
    p.epilog = _SIMULATE_EPILOG
    trace = p.add_argument_group("trace")
    trace.add_argument("--trace", type=_trace, default="sharegpt",
                       help="sharegpt, alpaca, or a JSONL file (default sharegpt)")
    trace.add_argument("--requests", "-n", type=argtypes.positive_int, default=1000,
                       help="requests of a synthetic trace (default 1000)")
    trace.add_argument("--seed", type=argtypes.count, default=0,
                       help="seed of the trace and the arrivals (default 0)")
    trace.add_argument("--system-share", type=argtypes.fraction, default=0.3,
                       help="share of requests behind a common system prompt (default 0.3)")
    trace.add_argument("--system-prompts", type=argtypes.positive_int, default=4,
                       help="distinct system prompts (default 4)")
    trace.add_argument("--system-len", type=argtypes.positive_int, default=200,
                       help="mean system prompt length, tokens (default 200)")
    trace.add_argument("--max-len", type=argtypes.positive_int, default=2048,
                       help="max prompt + output tokens; contiguous reserves it (default 2048)")
    hw = p.add_argument_group("model, device and KV budget")
    hw.add_argument("--model", type=_preset, default="llama-3-8b",
                    help="model preset (default llama-3-8b; pagedkv size --list-models)")
    hw.add_argument("--device", type=_device, default="h100",
                    help="device preset: " + ", ".join(_device_names()) + " (default h100)")
    hw.add_argument("--calibrate", type=argtypes.existing_file, metavar="JSON",
                    help="price steps with a fit of steps measured here "
                         "(bench/bench_engine.py's JSON) instead of the device roofline")
    hw.add_argument("--calibrated-model", metavar="NAME",
                    help="which model of the --calibrate file (when it holds several)")
    hw.add_argument("--tp", type=argtypes.positive_int, default=1,
                    help="tensor parallel devices (default 1): each holds its share of the "
                         "weights and KV heads; --memory and the blocks are per device")
    hw.add_argument("--memory", type=argtypes.byte_size,
                    help="KV budget in bytes, e.g. 8GiB (default: 90%% of the device's memory "
                         "minus the weights)")
    hw.add_argument("--num-blocks", type=argtypes.positive_int,
                    help="KV budget in blocks (overrides --memory)")
    hw.add_argument("--block-size", type=argtypes.positive_int, default=16,
                    help="tokens per block (default 16)")
    hw.add_argument("--cache-dtype", choices=DTYPES, metavar="DTYPE",
                    help="cache dtype (default: the model's)")
    sched = p.add_argument_group("scheduler")
    sched.add_argument("--max-num-seqs", type=argtypes.positive_int, default=256,
                       help="requests in a batch at most (default 256)")
    sched.add_argument("--max-num-batched-tokens", type=argtypes.positive_int, default=4096,
                       help="prompt tokens admitted per step (default 4096)")
    sched.add_argument("--cpu-blocks", type=argtypes.count, default=0,
                       help="CPU swap space in blocks; 0 preempts by recompute (default 0)")
    load = p.add_argument_group("load")
    load.add_argument("--rate", type=argtypes.rate,
                      help="Poisson arrivals, requests/s, seeded; inf: all at time 0 (default: "
                           "the trace's arrival_time if it has them, else inf)")
    load.add_argument("--sweep-rate", action="store_true",
                      help="run a range of rates (--rates) and report the sustained ones")
    load.add_argument("--rates", type=argtypes.rates,
                      help="rates of --sweep-rate, e.g. 1,2,4,8 (default: 10 rates from 0.1x to "
                           "3x the best strategy's throughput with every request queued at once)")
    load.add_argument("--latency-target", type=argtypes.positive_float, default=0.1,
                      help="mean normalized latency a sustained rate stays within, s/token "
                           "(default 0.1)")
    out = p.add_argument_group("output")
    out.add_argument("--strategies", type=argtypes.choices_list(sim.STRATEGIES),
                     default=list(sim.STRATEGIES),
                     help="comma-separated subset of " + ", ".join(sim.STRATEGIES))
    out.add_argument("--plot", type=argtypes.output_file, metavar="PNG",
                     help="write a plot: memory over time, or latency vs rate with --sweep-rate")
    out.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(parser=p)


def _device_names() -> list[str]:
    from pagedkv.tools.costmodel import DEVICES

    return list(DEVICES)


def _simulate(args: argparse.Namespace) -> int:
    from pagedkv.tools import report, sim, traces
    from pagedkv.tools.costmodel import RooflineModel, load_calibration

    parser = args.parser
    if args.rates and not args.sweep_rate:
        parser.error("argument --rates: needs --sweep-rate")
    if args.sweep_rate and args.rate is not None:
        parser.error("argument --rate: not with --sweep-rate (give --rates)")
    if args.calibrated_model and not args.calibrate:
        parser.error("argument --calibrated-model: needs --calibrate")
    if args.trace in traces.TRACES:
        requests = traces.synthetic_trace(
            args.trace, args.requests, args.seed, args.max_len, args.system_prompts,
            args.system_share, args.system_len)
    else:
        try:
            requests = traces.load_jsonl(args.trace)
        except ValueError as e:
            parser.error(f"argument --trace: {e}")
    try:
        args.model.check_tp(args.tp)
        roofline = RooflineModel(args.model, args.device, args.cache_dtype, args.block_size,
                                 args.tp)
    except ValueError as e:
        parser.error(f"argument --tp: {e}")
    if args.calibrate and args.tp > 1:
        parser.error("argument --tp: --calibrate prices steps measured on one device")
    if args.calibrate:
        try:
            cost = load_calibration(args.calibrate, args.calibrated_model)
        except (ValueError, KeyError) as e:
            parser.error(f"argument --calibrate: {e}")
    else:
        cost = roofline
    spec = args.model.spec(args.block_size, args.cache_dtype, args.tp)  # one device's
    if args.num_blocks:
        num_blocks, source = args.num_blocks, "--num-blocks"
    elif args.memory:
        num_blocks, source = spec.num_blocks_for(args.memory), f"{format_bytes(args.memory)}"
    else:
        try:
            memory = roofline.kv_cache_bytes() // args.tp
        except ValueError as e:
            parser.error(f"argument --device: {e}")
        num_blocks = spec.num_blocks_for(memory)
        source = f"90% of {args.device.name} minus {args.model.name}'s weights"
        if args.tp > 1:
            source = f"90% of {args.tp} x {args.device.name} minus {args.model.name}'s weights"
    num_slots = num_blocks * args.block_size
    too_long = max(r.final_len for r in requests)
    if too_long > args.max_len:
        parser.error(f"argument --max-len: a request of the trace holds {too_long} tokens, more "
                     f"than --max-len {args.max_len}")
    if "contiguous" in args.strategies and args.max_len > num_slots:
        parser.error(f"argument --max-len: contiguous reserves {args.max_len} slots per request, "
                     f"more than the budget of {num_slots} ({source})")
    if num_slots < too_long:
        parser.error(f"the KV budget of {num_slots} token slots ({source}) holds no request of "
                     f"{too_long} tokens; raise --memory or --num-blocks")
    scheduler = dict(max_num_seqs=args.max_num_seqs,
                     max_num_batched_tokens=args.max_num_batched_tokens,
                     num_cpu_blocks=args.cpu_blocks)
    kwargs = dict(block_size=args.block_size, max_len=args.max_len, seed=args.seed, **scheduler)
    stats = traces.trace_stats(requests)
    priced = (f"steps priced by {args.calibrate.name}" if args.calibrate else
              f"{args.model.name} on {args.device.name} (roofline)")
    budget = f"{num_blocks:,} blocks x {args.block_size} = {num_slots:,} token slots ({source})"
    if args.tp > 1:
        budget += (f"; tp {args.tp}: {format_bytes(num_blocks * spec.bytes_per_block)} of KV "
                   f"and {num_blocks:,} blocks on each device")
    config = {k: (str(v) if isinstance(v, Path) else
                  v.name if hasattr(v, "name") and not isinstance(v, str) else v)
              for k, v in vars(args).items() if k not in ("run", "json", "no_progress", "parser")}
    config |= {"num_blocks": num_blocks, "rate": None if args.rate is None else str(args.rate)}
    head = [f"trace    {Path(args.trace).name}: {stats['requests']} requests, prompt mean "
            f"{stats['prompt_mean']:.0f} (p99 {stats['prompt_p99']:.0f}), output mean "
            f"{stats['output_mean']:.0f} (p99 {stats['output_p99']:.0f}), "
            f"{stats['prefix_share']:.0%} with a shared prefix",
            f"cost     {priced}", f"budget   {budget}, max_len {args.max_len}"]
    progress = _progress(not args.no_progress and sys.stderr.isatty())
    if not args.sweep_rate:
        timed = args.rate is None and requests[0].arrival_time is not None
        arrivals = [r.arrival_time for r in requests] if timed else None
        rate = math.inf if args.rate is None else args.rate
        results = sim.simulate(requests, cost, num_slots, rate, args.strategies,
                               arrivals=arrivals, **kwargs)
        if args.plot:
            report.plot(results, args.plot, num_slots, f"{head[0][9:]}\n{budget}")
        data = report.to_json(results, config=config, trace=stats)
        head.append("arrivals " + ("the trace's arrival times" if timed else "all at time 0"
                                   if math.isinf(rate) else f"Poisson, {rate:g} requests/s"))
        text = "\n".join([*head, "", report.format_table(results)]
                         + ([f"\nplot written to {args.plot}"] if args.plot else []))
        return _print(args, data, text)
    rates = args.rates
    if rates is None:  # 10 rates from 0.1x to 3x the best throughput with all queued at once
        saturated = sim.simulate(requests, cost, num_slots, math.inf, args.strategies, **kwargs)
        best = max(r.throughput for r in saturated.values())
        rates = [float(f"{best * 0.1 * 30 ** (i / 9):.3g}") for i in range(10)]
    results = sim.sweep(requests, cost, num_slots, rates, args.strategies, progress, **kwargs)
    if args.plot:
        report.plot_sweep(results, args.plot, args.latency_target,
                          f"{Path(args.trace).name}, {priced}")
    data = report.sweep_json(results, args.latency_target, config=config, trace=stats)
    text = "\n".join([*head, "", report.format_sweep(results, args.latency_target)]
                     + ([f"\nplot written to {args.plot}"] if args.plot else []))
    return _print(args, data, text)


def _progress(enabled: bool):
    """A progress callback (done, total) drawing a tqdm bar on stderr, or None."""
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    bar = None

    def update(done: int, total: int) -> None:
        nonlocal bar
        if bar is None:
            bar = tqdm(total=total, desc="sweep", unit="run", leave=False)
        bar.update(done - bar.n)
        if done == total:
            bar.close()

    return update


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
