"""Reports of ``pagedkv.tools.sim`` results: a text table, a JSON-ready dict and a PNG plot."""

from __future__ import annotations

from pathlib import Path

from pagedkv.tools.sim import StrategyResult

__all__ = ["comparison", "format_table", "plot", "to_json"]

def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


_COLUMNS = [  # header, width, format of one result
    ("strategy", 18, lambda r: r.name),
    ("waste", 7, lambda r: f"{r.waste:.1%}"),
    ("reserve", 8, lambda r: f"{r.reservation_waste:.1%}"),
    ("last blk", 9, lambda r: f"{r.internal_waste:.1%}"),
    ("KV util", 8, lambda r: _pct(r.kv_util)),
    ("peak run", 9, lambda r: str(r.peak_running)),
    ("mean run", 9, lambda r: f"{r.mean_running:.1f}"),
    ("run|queue", 10, lambda r: _num(r.mean_running_queued)),
    ("tok/step", 9, lambda r: f"{r.tokens_per_step:.1f}"),
    ("steps", 7, lambda r: str(r.steps)),
    ("preempt", 8, lambda r: str(r.preemptions)),
    ("prefix hit", 11, lambda r: _pct(r.prefix_hit_rate)),
]

LEGEND = """\
waste      KV memory reserved but holding no token, averaged over steps (= reserve + last blk)
reserve    ... reserved for tokens not generated yet (contiguous reservation)
last blk   ... in the partly filled last block of each request (paged)
KV util    tokens stored / budget, over the steps where requests were waiting (- : none did)
mean run   mean running requests over all steps (= tok/step: one token per request per step)
run|queue  mean running requests over the steps where requests were waiting (memory-bound)
prefix hit prompt tokens found in the prefix cache on first admission"""


def format_table(results: dict[str, StrategyResult], legend: bool = True) -> str:
    """One row per strategy, then the ratios of ``comparison`` and (optionally) a legend."""
    lines = ["".join(f"{h:>{w}}" if i else f"{h:<{w}}" for i, (h, w, _) in enumerate(_COLUMNS))]
    for result in results.values():
        lines.append("".join(f"{f(result):>{w}}" if i else f"{f(result):<{w}}"
                             for i, (_, w, f) in enumerate(_COLUMNS)))
    ratios = comparison(results)
    if ratios:
        lines.append("")
        lines += [f"{name}: {ratio:.1f}x" for name, ratio in ratios.items()]
    if legend:
        lines += ["", LEGEND]
    return "\n".join(lines)


def comparison(results: dict[str, StrategyResult]) -> dict[str, float]:
    """Paged over contiguous-max: running requests while requests wait, and tokens per step."""
    base, paged = results.get("contiguous-max"), results.get("paged")
    if base is None or paged is None:
        return {}
    ratios = {"paged / contiguous-max, tokens per step":
              paged.tokens_per_step / base.tokens_per_step}
    if base.mean_running_queued and paged.mean_running_queued:
        ratios["paged / contiguous-max, running requests while queued"] = (
            paged.mean_running_queued / base.mean_running_queued)
    return ratios


def to_json(results: dict[str, StrategyResult], **context: object) -> dict[str, object]:
    """``context`` (config, trace statistics) plus every strategy's summary and the ratios."""
    return {**context, "strategies": {name: r.summary() for name, r in results.items()},
            "comparison": comparison(results)}


def plot(
    results: dict[str, StrategyResult], path: str | Path, budget: int, title: str = ""
) -> None:
    """Writes a PNG: KV memory reserved (solid) and holding tokens (dashed) as a share of the
    ``budget`` (token slots), and running requests, per strategy over the steps."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise ImportError("plotting needs matplotlib: pip install matplotlib") from None
    fig = Figure(figsize=(12, 7), layout="constrained")
    memory, running = fig.subplots(2, 1, sharex=True)
    for i, result in enumerate(results.values()):
        color = f"C{i}"
        reserved = [100 * x / budget for x in result.series["reserved"]]
        stored = [100 * x / budget for x in result.series["stored"]]
        memory.plot(reserved, color=color, lw=1.2, label=f"{result.name} reserved")
        memory.plot(stored, color=color, lw=1.0, ls="--", label=f"{result.name} tokens")
        running.plot(result.series["running"], color=color, lw=1.2, label=result.name)
    memory.set(ylabel="KV memory (% of budget)", ylim=(0, 105), title=title)
    running.set(xlabel="step", ylabel="running requests")
    memory.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
    running.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
    for ax in (memory, running):
        ax.grid(alpha=0.3)
    fig.savefig(path, dpi=110)
