"""``pagedkv simulate``: its options, and the run that serves a trace under each strategy.

``run`` checks what argparse cannot check option by option (pairs of options, the trace against
the budget), builds the trace, the step cost and the KV budget, then simulates at one arrival
rate or sweeps a range of rates; it returns the JSON data and the text screen.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pagedkv.tools import argtypes, report, sim, traces
from pagedkv.tools.costmodel import DEVICES, CostModel, RooflineModel, load_calibration
from pagedkv.tools.presets import format_bytes
from pagedkv.tools.presets_mla import mla_report

__all__ = ["DESCRIPTION", "HELP", "add_arguments", "run"]

HELP = "serving simulation with time: contiguous vs paged vs paged + prefix sharing"
DESCRIPTION = """\
Serve a request trace with the engine's scheduler, priced by a step cost model (a device's
roofline, or steps measured here); report throughput and latency per strategy under one KV
budget, and whether that budget binds. The defaults are the vLLM paper's setting, OPT-13B on an
A100-40GB, where it does."""

EPILOG = """\
examples:
  pagedkv simulate                                   OPT-13B on an A100-40GB, all requests at once
  pagedkv simulate --rate 1 --json                   Poisson arrivals at 1 request/s
  pagedkv simulate --sweep-rate --plot rate.png      latency vs request rate, sustained rates
  pagedkv simulate --device h100 --model llama-3-8b  a budget that does not bind: the same rates
  pagedkv simulate --trace requests.jsonl --num-blocks 2048 --calibrate \\
      bench/results/bench_engine.json --calibrated-model demo     steps timed on this machine
The model behind the numbers (strategies, cost model, metrics): docs/simulator.md."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``pagedkv simulate`` (the command line adds ``--json``)."""
    p.epilog = EPILOG
    _trace_options(p.add_argument_group("trace"))
    _budget_options(p.add_argument_group("model, device and KV budget"))
    _scheduler_options(p.add_argument_group("scheduler"))
    _load_options(p.add_argument_group("load"))
    out = p.add_argument_group("output")
    out.add_argument("--strategies", type=argtypes.choices_list(sim.ALL_STRATEGIES),
                     help="comma-separated subset of " + ", ".join(sim.ALL_STRATEGIES)
                          + f" (default: all but {sim.CASCADE}; {sim.HYBRID} only for a model "
                            "with sliding-window layers)")
    out.add_argument("--plot", type=argtypes.output_file, metavar="PNG",
                     help="write a plot: memory over time, or latency vs rate with --sweep-rate")
    out.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(parser=p)


def _trace_options(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--trace", type=argtypes.trace, default="sharegpt",
                       help="sharegpt, alpaca, or a JSONL file (default sharegpt)")
    group.add_argument("--requests", "-n", type=argtypes.positive_int, default=1000,
                       help="requests of a synthetic trace (default 1000)")
    group.add_argument("--seed", type=argtypes.count, default=0,
                       help="seed of the trace and the arrivals (default 0)")
    group.add_argument("--system-share", type=argtypes.fraction, default=0.3,
                       help="share of requests behind a common system prompt (default 0.3)")
    group.add_argument("--system-prompts", type=argtypes.positive_int, default=4,
                       help="distinct system prompts (default 4)")
    group.add_argument("--system-len", type=argtypes.positive_int, default=200,
                       help="mean system prompt length, tokens (default 200)")
    group.add_argument("--max-len", type=argtypes.positive_int, default=2048,
                       help="max prompt + output tokens; contiguous reserves it (default 2048)")


def _budget_options(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--model", type=argtypes.model_preset, default="opt-13b",
                       help="model preset (default opt-13b; pagedkv size --list-models)")
    group.add_argument("--device", type=argtypes.device_preset, default="a100-40gb",
                       help="device preset: " + ", ".join(d.name for d in DEVICES.values())
                            + " (default A100-40GB)")
    group.add_argument("--calibrate", type=argtypes.existing_file, metavar="JSON",
                       help="price steps with a fit of steps measured here "
                            "(bench/bench_engine.py's JSON) instead of the device roofline")
    group.add_argument("--calibrated-model", metavar="NAME",
                       help="which model of the --calibrate file (when it holds several)")
    group.add_argument("--tp", type=argtypes.positive_int, default=1,
                       help="tensor parallel devices (default 1): each holds its share of the "
                            "weights and KV heads; --memory and the blocks are per device")
    group.add_argument("--memory", type=argtypes.byte_size,
                       help="KV budget in bytes, e.g. 8GiB (default: 90%% of the device's memory "
                            "minus the weights)")
    group.add_argument("--num-blocks", type=argtypes.positive_int,
                       help="KV budget in blocks (overrides --memory)")
    group.add_argument("--block-size", type=argtypes.positive_int, default=16,
                       help="tokens per block (default 16)")
    group.add_argument("--cache-dtype", type=argtypes.cache_dtype, metavar="FORMAT",
                       help="cache format (default: the model's dtype): bf16, fp8 (a scale per "
                            "layer), int8, int4, fp8_per_token_head (a scale per token and head)")


def _scheduler_options(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--max-num-seqs", type=argtypes.positive_int, default=256,
                       help="requests in a batch at most (default 256)")
    group.add_argument("--max-num-batched-tokens", type=argtypes.positive_int, default=4096,
                       help="prompt tokens admitted per step (default 4096)")
    group.add_argument("--cpu-blocks", type=argtypes.count, default=0,
                       help="CPU swap space in blocks; 0 preempts by recompute (default 0)")


def _load_options(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--rate", type=argtypes.rate,
                       help="Poisson arrivals, requests/s, seeded; inf: all at time 0 (default: "
                            "the trace's arrival_time if it has them, else inf)")
    group.add_argument("--sweep-rate", action="store_true",
                       help="run a range of rates (--rates) and report the sustained ones")
    group.add_argument("--rates", type=argtypes.rates,
                       help="rates of --sweep-rate, e.g. 1,2,4,8 (default: 10 rates from 0.1x "
                            "to 3x the best strategy's throughput with every request queued at "
                            "once)")
    group.add_argument("--latency-target", type=argtypes.positive_float, default=0.1,
                       help="mean normalized latency a sustained rate stays within, s/token "
                            "(default 0.1)")


@dataclass(slots=True)
class _Budget:
    """The KV budget of one device: blocks, and where their number comes from."""

    num_blocks: int
    block_size: int
    bytes_per_block: int
    source: str

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size


@dataclass(slots=True)
class _Job:
    """What every simulation of one command shares: the trace, the step cost, the budget."""

    requests: list[traces.Request]
    cost: CostModel
    budget: _Budget
    options: dict[str, Any]  # block_size, max_len, seed and the scheduler's limits
    stats: dict[str, float] = field(init=False)  # of the trace: lengths, prefix share

    def __post_init__(self) -> None:
        self.stats = traces.trace_stats(self.requests)

    def simulate(self, rate: float, strategies: list[str],
                 arrivals: list[float] | None = None) -> dict[str, sim.StrategyResult]:
        return sim.simulate(self.requests, self.cost, self.budget.num_slots, rate, strategies,
                            arrivals=arrivals, **self.options)


def run(args: argparse.Namespace) -> tuple[dict, str]:
    """Runs ``pagedkv simulate``; returns (JSON data, text). Bad combinations of options end in
    argparse's error (exit 2) before any simulation."""
    _check_option_pairs(args)
    _resolve_strategies(args)
    roofline = _roofline(args)
    job = _Job(_requests(args), _calibration(args) if args.calibrate else roofline,
               _budget(args, roofline), _options(args))
    _check_fits(args, job)
    head = _head(args, job)
    return (_sweep if args.sweep_rate else _once)(args, job, head)


def _check_option_pairs(args: argparse.Namespace) -> None:
    error = args.parser.error
    if args.rates and not args.sweep_rate:
        error("argument --rates: needs --sweep-rate")
    if args.sweep_rate and args.rate is not None:
        error("argument --rate: not with --sweep-rate (give --rates)")
    if args.calibrated_model and not args.calibrate:
        error("argument --calibrated-model: needs --calibrate")
    if args.calibrate and args.tp > 1:
        error("argument --tp: --calibrate prices steps measured on one device")


def _resolve_strategies(args: argparse.Namespace) -> None:
    """The default strategies (paged+hybrid with a windowed model), or a check of those given."""
    windowed = args.model.layer_windows is not None
    if args.strategies is None:
        args.strategies = list((*sim.STRATEGIES, sim.HYBRID) if windowed else sim.STRATEGIES)
        return
    if sim.HYBRID in args.strategies and not windowed:
        args.parser.error(f"argument --strategies: {sim.HYBRID} needs a model with "
                          f"sliding-window layers; {args.model.name} has none")


def _requests(args: argparse.Namespace) -> list[traces.Request]:
    if args.trace in traces.TRACES:
        return traces.synthetic_trace(args.trace, args.requests, args.seed, args.max_len,
                                      args.system_prompts, args.system_share, args.system_len)
    try:
        return traces.load_jsonl(args.trace)
    except ValueError as e:
        args.parser.error(f"argument --trace: {e}")


def _roofline(args: argparse.Namespace) -> RooflineModel:
    try:
        args.model.check_tp(args.tp)
        return RooflineModel(args.model, args.device, args.cache_dtype, args.block_size, args.tp)
    except ValueError as e:
        args.parser.error(f"argument --tp: {e}")


def _calibration(args: argparse.Namespace) -> CostModel:
    try:
        return load_calibration(args.calibrate, args.calibrated_model)
    except (ValueError, KeyError) as e:
        args.parser.error(f"argument --calibrate: {e}")


def _budget(args: argparse.Namespace, roofline: RooflineModel) -> _Budget:
    """--num-blocks, else --memory, else what the device leaves beside the weights."""
    spec = roofline.rank_spec
    if args.num_blocks:
        return _Budget(args.num_blocks, spec.block_size, spec.bytes_per_block, "--num-blocks")
    if args.memory:
        return _Budget(spec.num_blocks_for(args.memory), spec.block_size, spec.bytes_per_block,
                       format_bytes(args.memory))
    try:
        memory = roofline.kv_cache_bytes() // args.tp
    except ValueError as e:
        args.parser.error(f"argument --device: {e}")
    devices = f"{args.tp} x {args.device.name}" if args.tp > 1 else args.device.name
    return _Budget(spec.num_blocks_for(memory), spec.block_size, spec.bytes_per_block,
                   f"90% of {devices} minus {args.model.name}'s weights")


def _check_fits(args: argparse.Namespace, job: _Job) -> None:
    error, slots, budget = args.parser.error, job.budget.num_slots, job.budget
    longest = max(r.final_len for r in job.requests)
    if longest > args.max_len:
        error(f"argument --max-len: a request of the trace holds {longest} tokens, more than "
              f"--max-len {args.max_len}")
    if "contiguous" in args.strategies and args.max_len > slots:
        error(f"argument --max-len: contiguous reserves {args.max_len} slots per request, more "
              f"than the budget of {slots} ({budget.source})")
    if slots < longest:
        error(f"the KV budget of {slots} token slots ({budget.source}) holds no request of "
              f"{longest} tokens; raise --memory or --num-blocks")


def _options(args: argparse.Namespace) -> dict[str, Any]:
    hybrid = None
    if args.model.layer_windows is not None:
        hybrid = sim.Hybrid.of(args.model.spec(args.block_size, args.cache_dtype, args.tp,
                                               hybrid=True))
    return dict(block_size=args.block_size, max_len=args.max_len, seed=args.seed,
                max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                num_cpu_blocks=args.cpu_blocks, hybrid=hybrid)


def _priced(args: argparse.Namespace) -> str:
    if args.calibrate:
        return f"steps priced by {args.calibrate.name}"
    return f"{args.model.name} on {args.device.name} (roofline)"


def _budget_text(args: argparse.Namespace, job: _Job) -> str:
    budget = job.budget
    text = (f"{budget.num_blocks:,} blocks x {budget.block_size} = {budget.num_slots:,} token "
            f"slots ({budget.source})")
    hybrid = job.options["hybrid"]
    if sim.HYBRID in args.strategies and hybrid is not None:
        pages = int(budget.num_blocks * hybrid.pages_per_block)
        text += f"; {sim.HYBRID}: {pages:,} blocks of {len(hybrid.groups)} groups' pages"
    if args.tp > 1:
        per_device = budget.num_blocks * budget.bytes_per_block
        text += (f"; tp {args.tp}: {format_bytes(per_device)} of KV and {budget.num_blocks:,} "
                 "blocks on each device")
    return text


def _head(args: argparse.Namespace, job: _Job) -> list[str]:
    """The lines above the table: trace, cost, budget."""
    stats = job.stats
    return [f"trace    {Path(args.trace).name}: {stats['requests']} requests, prompt mean "
            f"{stats['prompt_mean']:.0f} (p99 {stats['prompt_p99']:.0f}), output mean "
            f"{stats['output_mean']:.0f} (p99 {stats['output_p99']:.0f}), "
            f"{stats['prefix_share']:.0%} with a shared prefix",
            f"cost     {_priced(args)}",
            f"budget   {_budget_text(args, job)}, max_len {args.max_len}",
            f"kv       {_kv_text(_kv_per_token(args))}"]


def _kv_per_token(args: argparse.Namespace) -> dict[str, object]:
    """KV bytes per token (one device's) with every layer attending in full, what the hybrid
    manager holds per token of a request of ``--max-len`` tokens (None: no windows), and an MLA
    latent beside its MHA form (None: not MLA)."""
    model, tp = args.model, args.tp
    full = model.spec(args.block_size, args.cache_dtype, tp)
    data: dict[str, object] = {"cache_format": full.format.name, "row_bytes": full.row_bytes,
                               "full_bytes_per_token": full.bytes_per_token, "mla": model.mla and
                               mla_report(model.num_layers, model.num_heads, model.mla,
                                          full.element_size, tp),
                               "hybrid_bytes_per_token": None, "at_tokens": args.max_len}
    if model.layer_windows is not None:
        hybrid = model.spec(args.block_size, args.cache_dtype, tp, hybrid=True)
        data["hybrid_bytes_per_token"] = hybrid.hybrid_kv_bytes(args.max_len) / args.max_len
    return data


def _kv_text(kv: dict[str, object]) -> str:
    return f"{_kv_bytes_text(kv)}; cache {kv['cache_format']}, rows of {kv['row_bytes']} B"


def _kv_bytes_text(kv: dict[str, object]) -> str:
    if mla := kv["mla"]:
        return (f"{format_bytes(kv['full_bytes_per_token'])} per token: one MLA latent row of "
                f"{mla['latent_size']} a layer, read once for all heads (the MHA form: "
                f"{format_bytes(mla['mha_bytes_per_token'])}, {mla['mha_ratio']:.1f}x)")
    full = f"{format_bytes(kv['full_bytes_per_token'])} per token with every layer in full"
    if kv["hybrid_bytes_per_token"] is None:
        return f"{full} (no sliding-window layers)"
    ratio = kv["hybrid_bytes_per_token"] / kv["full_bytes_per_token"]
    return (f"{full}; the hybrid manager holds {format_bytes(kv['hybrid_bytes_per_token'])} "
            f"per token of a {kv['at_tokens']:,}-token request ({ratio:.2f}x; {sim.HYBRID} "
            "runs it, the others page every layer)")


def _config(args: argparse.Namespace, job: _Job) -> dict[str, object]:
    """The options as JSON values, with the budget's blocks."""
    def plain(value: object) -> object:
        if isinstance(value, Path):
            return str(value)
        return value.name if hasattr(value, "name") and not isinstance(value, str) else value

    skip = ("run", "json", "no_progress", "parser")
    config = {k: plain(v) for k, v in vars(args).items() if k not in skip}
    return config | {"num_blocks": job.budget.num_blocks,
                     "rate": None if args.rate is None else str(args.rate)}


def _once(args: argparse.Namespace, job: _Job, head: list[str]) -> tuple[dict, str]:
    """One arrival rate (or the trace's times): the table per strategy."""
    timed = args.rate is None and job.requests[0].arrival_time is not None
    arrivals = [r.arrival_time for r in job.requests] if timed else None
    rate = math.inf if args.rate is None else args.rate
    results = job.simulate(rate, args.strategies, arrivals)
    if args.plot:
        report.plot(results, args.plot, job.budget.num_slots,
                    f"{head[0][9:]}\n{_budget_text(args, job)}")
    arrives = ("the trace's arrival times" if timed else "all at time 0" if math.isinf(rate)
               else f"Poisson, {rate:g} requests/s")
    binds = report.what_binds(results, job.budget.num_slots, args.max_len)
    data = report.to_json(results, config=_config(args, job),
                          trace=job.stats, binds=binds, kv=_kv_per_token(args))
    lines = [*head, f"arrivals {arrives}", "", report.format_table(results, legend=False), "",
             binds["text"], "", report.LEGEND, *_plotted(args)]
    return data, "\n".join(lines)


def _sweep(args: argparse.Namespace, job: _Job, head: list[str]) -> tuple[dict, str]:
    """A range of Poisson rates: latency and throughput per rate, and the sustained rates."""
    rates = args.rates or _default_rates(job, args.strategies)
    progress = _progress(not args.no_progress and sys.stderr.isatty())
    results = sim.sweep(job.requests, job.cost, job.budget.num_slots, rates, args.strategies,
                        progress, **job.options)
    if args.plot:
        report.plot_sweep(results, args.plot, args.latency_target,
                          f"{Path(args.trace).name}, {_priced(args)}")
    busiest = results[max(results)]
    binds = report.what_binds(busiest, job.budget.num_slots, args.max_len)
    data = report.sweep_json(results, args.latency_target, config=_config(args, job),
                             trace=job.stats, binds=binds, kv=_kv_per_token(args))
    lines = [*head, "", report.format_sweep(results, args.latency_target), "",
             f"at the highest rate swept, {max(results):g} requests/s:", binds["text"],
             *_plotted(args)]
    return data, "\n".join(lines)


def _default_rates(job: _Job, strategies: list[str]) -> list[float]:
    """10 rates from 0.1x to 3x the best throughput with every request queued at once."""
    best = max(r.throughput for r in job.simulate(math.inf, strategies).values())
    return [float(f"{best * 0.1 * 30 ** (i / 9):.3g}") for i in range(10)]


def _plotted(args: argparse.Namespace) -> list[str]:
    return [f"\nplot written to {args.plot}"] if args.plot else []


def _progress(enabled: bool) -> Callable[[int, int], None] | None:
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
