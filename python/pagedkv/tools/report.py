"""Reports of ``pagedkv.tools.sim`` results: text tables, JSON-ready dicts and PNG plots."""

from __future__ import annotations

import math
from pathlib import Path

from pagedkv.tools.sim import StrategyResult, sustained_rate

__all__ = ["LEGEND", "format_sweep", "format_table", "plot", "plot_sweep", "sweep_json",
           "to_json", "what_binds"]


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def _s(x: float) -> str:
    if math.isnan(x):
        return "-"
    return f"{x * 1e3:.0f}ms" if x < 1 else f"{x:.1f}s"


_COLUMNS = [  # header, width, format of one result
    ("strategy", 14, lambda r: r.name),
    ("req/s", 7, lambda r: f"{r.throughput:.2f}"),
    ("tok/s", 8, lambda r: f"{r.output_tokens_per_s:.0f}"),
    ("TTFT p50", 9, lambda r: _s(r.ttft["p50"])),
    ("TTFT p99", 9, lambda r: _s(r.ttft["p99"])),
    ("TPOT p50", 9, lambda r: _s(r.tpot["p50"])),
    ("norm lat", 9, lambda r: _s(r.normalized_latency["mean"])),
    ("nl p90", 8, lambda r: _s(r.normalized_latency["p90"])),
    ("mean run", 9, lambda r: f"{r.mean_running:.1f}"),
    ("preempt", 8, lambda r: str(r.preemptions)),
    ("its cost", 9, lambda r: _s(r.preemption_seconds)),
    ("waste", 7, lambda r: f"{r.kv_waste:.1%}"),
    ("prefix hit", 11, lambda r: _pct(r.prefix_hit_rate)),
    ("kv saved", 9, lambda r: _pct(r.kv_read_saved)),
]

LEGEND = """\
req/s, tok/s  finished requests and output tokens per second, first arrival to last finish
TTFT          time to first token (arrival to the end of the step that produced it)
TPOT          time per output token after the first
norm lat      normalized latency: end-to-end latency / output tokens, mean over requests (nl p90)
mean run      requests in the batch, averaged over steps
preempt       preemptions (swap out or free and recompute); its cost: the step time they added
waste         KV slots in use that held no token, averaged over steps
prefix hit    prompt tokens found in the prefix cache
kv saved      K/V reads that cascade attention saved (paged+cascade: shared blocks read once)"""


def format_table(results: dict[str, StrategyResult], legend: bool = True) -> str:
    """One row per strategy, then (optionally) the legend."""
    lines = ["".join(f"{h:>{w}}" if i else f"{h:<{w}}" for i, (h, w, _) in enumerate(_COLUMNS))]
    for result in results.values():
        lines.append("".join(f"{f(result):>{w}}" if i else f"{f(result):<{w}}"
                             for i, (_, w, f) in enumerate(_COLUMNS)))
    if legend:
        lines += ["", LEGEND]
    return "\n".join(lines)


def to_json(results: dict[str, StrategyResult], **context: object) -> dict[str, object]:
    """``context`` (config, trace statistics) plus every strategy's summary."""
    return {**context, "strategies": {name: r.summary() for name, r in results.items()}}


def sustained(results: dict[float, dict[str, StrategyResult]], target: float) -> dict[str, object]:
    """Per strategy, the highest swept rate within ``target`` mean normalized latency, and each
    strategy's over the first's (the ratios the vLLM paper quotes)."""
    names = list(next(iter(results.values())))
    rates = {name: sustained_rate(results, name, target) for name in names}
    base = rates[names[0]]
    ratios = {f"{name} / {names[0]}": (rate / base if rate and base else None)
              for name, rate in rates.items() if name != names[0]}
    top = max(results)  # within the target at every swept rate: the rate is a lower bound
    return {"latency_target_s_per_token": target, "sustained_rate": rates,
            "sustained_beyond_sweep": {name: rate == top for name, rate in rates.items()},
            "ratio": ratios}


def sweep_json(results: dict[float, dict[str, StrategyResult]], target: float,
               **context: object) -> dict[str, object]:
    return {**context, **sustained(results, target),
            "rates": [{"rate": rate, "strategies": {n: r.summary() for n, r in by.items()}}
                      for rate, by in results.items()]}


def format_sweep(results: dict[float, dict[str, StrategyResult]], target: float) -> str:
    """Mean normalized latency and throughput per rate and strategy, and the sustained rates."""
    names = list(next(iter(results.values())))
    head = f"{'rate req/s':>10}" + "".join(f"{n:>26}" for n in names)
    lines = [head, f"{'':>10}" + "".join(f"{'norm lat / req/s':>26}" for _ in names)]
    for rate, by in results.items():
        lines.append(f"{rate:>10.3g}" + "".join(
            f"{_s(by[n].normalized_latency['mean']):>17} {by[n].throughput:>8.2f}" for n in names))
    data = sustained(results, target)
    lines.append("")
    beyond = data["sustained_beyond_sweep"]
    lines.append(f"sustained rate (mean normalized latency <= {_s(target)}/token): " + ", ".join(
        f"{n} {'>=' if beyond[n] else ''}{f'{r:.3g}' if r is not None else '-'}"
        for n, r in data["sustained_rate"].items()))
    if any(beyond.values()):
        lines.append("  >=: within the target at every swept rate; sweep higher (--rates)")
    lines += [f"  {k}: {v:.2f}x" for k, v in data["ratio"].items() if v is not None]
    return "\n".join(lines)


MEMORY_BINDS = 1.1
"""The paged / contiguous throughput ratio from which the screen says that memory binds."""


def what_binds(results: dict[str, StrategyResult], num_slots: int,
               max_len: int) -> dict[str, object]:
    """Whether the KV budget limits the throughput: how many requests contiguous reservation
    fits at once (``num_slots // max_len``), how many each strategy ran at once, and each paged
    strategy's throughput over contiguous's. Memory binds when one gets ``MEMORY_BINDS`` times
    contiguous's or more; without a contiguous run, when paging ran more requests at once than
    contiguous reservation fits (contiguous alone: when it ran as many). ``text`` says it."""
    fits = num_slots // max_len
    peaks = {name: r.peak_running for name, r in results.items()}
    paged = {name: r for name, r in results.items() if name != "contiguous"}
    base = results.get("contiguous")
    ratios = {name: r.throughput / base.throughput for name, r in paged.items()} if base else {}
    if ratios:
        binds = max(ratios.values()) >= MEMORY_BINDS
    else:
        binds = max(peaks.values()) > fits if paged else peaks["contiguous"] >= fits
    lines = [f"KV budget  {fits:,} contiguous reservations of {max_len:,} slots fit at once"
             + "".join(f"; {name} ran up to {peaks[name]:,}" for name in paged)]
    verdict = "memory binds" if binds else "memory does not bind"
    if ratios:
        verdict = "throughput over contiguous: " + ", ".join(
            f"{name} {ratio:.2f}x" for name, ratio in ratios.items()) + f": {verdict}"
    lines.append(f"           {verdict}")
    if not binds:
        lines += ["           (the step time or the arrivals limit every strategy alike; memory "
                  "binds with more KV",
                  "           per request: a longer --max-len, a model with more KV per token, "
                  "a smaller device)"]
    return {"contiguous_fits": fits, "peak_running": peaks,
            "throughput_over_contiguous": ratios, "memory_binds": binds, "text": "\n".join(lines)}


def _figure(figsize: tuple[float, float]):
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise ImportError("plotting needs matplotlib: pip install matplotlib") from None
    return Figure(figsize=figsize, layout="constrained")


def plot(results: dict[str, StrategyResult], path: str | Path, budget: int,
         title: str = "") -> None:
    """Writes a PNG: KV memory reserved (solid) and holding tokens (dashed) as a share of the
    ``budget`` (token slots), and running requests, per strategy over time."""
    fig = _figure((12, 7))
    memory, running = fig.subplots(2, 1, sharex=True)
    for i, result in enumerate(results.values()):
        color, time = f"C{i}", result.series["time"]
        memory.plot(time, [100 * x / budget for x in result.series["reserved"]], color=color,
                    lw=1.2, label=f"{result.name} reserved")
        memory.plot(time, [100 * x / budget for x in result.series["stored"]], color=color,
                    lw=1.0, ls="--", label=f"{result.name} tokens")
        running.plot(time, result.series["running"], color=color, lw=1.2, label=result.name)
    memory.set(ylabel="KV memory (% of budget)", ylim=(0, 105), title=title)
    running.set(xlabel="time (s)", ylabel="running requests")
    for ax in (memory, running):
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
        ax.grid(alpha=0.3)
    fig.savefig(path, dpi=110)


def plot_sweep(results: dict[float, dict[str, StrategyResult]], path: str | Path,
               target: float, title: str = "") -> None:
    """Writes a PNG of mean normalized latency against request rate, one line per strategy
    (the vLLM paper's figure), with the latency target."""
    fig = _figure((7, 4.5))
    ax = fig.subplots()
    rates = sorted(results)
    for i, name in enumerate(results[rates[0]]):
        latency = [results[r][name].normalized_latency["mean"] for r in rates]
        ax.plot(rates, latency, marker="o", ms=3, color=f"C{i}", label=name)
    ax.axhline(target, color="0.5", ls=":", lw=1, label=f"target {_s(target)}/token")
    top = max(3 * target, min(max(results[r][n].normalized_latency["mean"] for n in results[r])
                              for r in rates) * 1.2)
    ax.set(xlabel="request rate (req/s)", ylabel="normalized latency (s/token)",
           ylim=(0, top), title=title)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.savefig(path, dpi=110)
