"""Serving simulation with time: the engine's own scheduler and block manager, priced by a
step cost model instead of running a model.

``SimulatedServer`` is the engine's ``ServingLoop`` whose batches are not computed: the cache plan
is marked done without tensors, each request's next token is the trace's, and the step takes the
time the cost model (``pagedkv.tools.costmodel``) gives its ``StepShape``: weights, K/V read,
prefill and recompute FLOPs, swap traffic. Admission, preemption and prefix hits are the engine's
decisions, made by the same code.

Strategies share one KV budget of token slots:

=================  ============================================================================
``contiguous``     one block of ``max_len`` slots per request (contiguous max-length reservation,
                   what a server that does not know the output length must do), no sharing;
``paged``          blocks of ``block_size`` taken as tokens arrive;
``paged+prefix``   the same with prefix caching: cached full prompt blocks are shared;
``paged+cascade``  paged+prefix whose attention reads a block that a step's requests share once
                   for all of them (``EngineConfig(cascade=True)``, planned by the block manager
                   each step): the step's ``kv_read`` loses the key rows the plan saves;
``paged+hybrid``   paged+prefix with the hybrid manager (a model with sliding-window layers):
                   blocks are pages of a KV cache group's layers, so the same bytes hold
                   ``Hybrid.pages_per_block`` times the blocks, and window groups free what
                   falls behind the window. Not among the defaults of a model without windows.
=================  ============================================================================

Requests arrive as a seeded Poisson process at a rate (requests per second) or at the trace's
times. Per strategy: throughput (requests/s, output tokens/s), TTFT, TPOT and normalized latency
(end-to-end latency / output tokens, the vLLM paper's metric) with p50/p90/p99, preemptions and
the time they cost (the marginal step time of recomputes and swaps), KV waste, concurrency, the
prefix hit rate and the share of K/V reads a cascade saved. ``sweep`` runs a range of rates;
docs/simulator.md explains the model and its validation against the real engine.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import numpy as np

from pagedkv import checks
from pagedkv.blocks.plan import PHASES
from pagedkv.cache.spec import KVCacheSpec
from pagedkv.serving.engine import ServingLoop
from pagedkv.serving.scheduler import EngineConfig, Request, SamplingParams, StepShape
from pagedkv.tools import traces

__all__ = ["ALL_STRATEGIES", "CASCADE", "HYBRID", "STRATEGIES", "Hybrid", "SimulatedServer",
           "SimulationError", "StrategyResult", "drive", "poisson_arrivals", "run_strategy",
           "simulate", "strategy_config", "sustained_rate", "sweep"]

STRATEGIES = ("contiguous", "paged", "paged+prefix")
CASCADE = "paged+cascade"
HYBRID = "paged+hybrid"
ALL_STRATEGIES = (*STRATEGIES, CASCADE, HYBRID)


@dataclass(frozen=True, slots=True)
class Hybrid:
    """What the ``paged+hybrid`` strategy needs of the model: its KV cache groups' windows
    (``KVCacheSpec.group_windows``) and how many of its pages one block of every layer's
    bytes holds (``num_layers / page_layers``)."""

    groups: tuple[int | None, ...]
    pages_per_block: float

    @classmethod
    def of(cls, spec: KVCacheSpec) -> Hybrid:
        """The setup of a spec with sliding windows."""
        return cls(spec.group_windows, spec.num_layers / spec.page_layers)


class SimulationError(ValueError):
    """The trace cannot run under the budget (a request larger than the whole budget)."""


class StepCost(Protocol):
    def step_seconds(self, shape: StepShape) -> float: ...


class SimulatedServer(ServingLoop):
    """A ServingLoop whose steps are priced by ``cost`` and whose tokens come from the trace.

    ``groups``: the hybrid manager's windows (None: the plain manager); its blocks are pages,
    ``pages_per_block`` of them in the bytes of a block of every layer, which is what ``cost``
    prices a swapped block at. With ``config.cascade`` each step's batch is planned as the
    engine plans it, and the key rows its cascades do not read come off ``shape.kv_read`` (a
    group's rows count for its share of the layers, ``1 / pages_per_block``); the merge and the
    second launch per layer are not priced."""

    def __init__(self, config: EngineConfig, cost: StepCost, max_len: int,
                 groups: tuple[int | None, ...] | None = None,
                 pages_per_block: float = 1.0) -> None:
        super().__init__(config, max_positions=max_len, groups=groups)
        self.cost = cost
        self.pages_per_block = pages_per_block
        self.trace: dict[int, traces.Request] = {}
        self.preemption_seconds = 0.0
        self.kv_read_tokens = self.kv_saved_tokens = 0  # K/V rows of every layer, all steps
        self.series: dict[str, list[float]] = {"time": [], "reserved": [], "stored": [],
                                               "running": []}

    def add_trace_request(self, request: traces.Request, arrival_time: float) -> Request:
        params = SamplingParams(max_tokens=request.output_len, ignore_eos=True)
        queued = self.add_request(request.tokens(0, request.prompt_len), params, arrival_time)
        self.trace[queued.request_id] = request
        return queued

    def run_batch(self, requests: list[Request], query_lens: list[int], shape: StepShape,
                  start: float) -> tuple[list[int], float]:
        plan = self.manager.plan()
        for phase in PHASES:  # nothing to copy: the simulation holds no K/V
            self.manager.complete(plan, phase)
        if shape.swap_blocks:  # the blocks of every layer whose bytes the swapped pages take
            shape = replace(
                shape, swap_blocks=math.ceil(shape.swap_blocks / self.pages_per_block))
        stored = shape.kv_read
        saved = self.cascade_saved_tokens(requests, query_lens)
        self.kv_read_tokens += stored
        if saved:
            self.kv_saved_tokens += saved
            shape = replace(shape, kv_read=shape.kv_read - saved)
        seconds = self.cost.step_seconds(shape)
        recomputing = [r.output_token_ids and q > 1 for r, q in zip(requests, query_lens,
                                                                     strict=True)]
        if shape.swap_blocks or any(recomputing):  # what the step would take without them
            kept = [(r.context_len, q) for r, q, redo in zip(requests, query_lens, recomputing,
                                                                 strict=True) if not redo]
            base = StepShape.of([n for n, _ in kept], [q for _, q in kept])
            self.preemption_seconds += seconds - self.cost.step_seconds(base)
        tokens = [self.next_token(r) for r in requests]
        series, size = self.series, self.config.block_size
        series["time"].append(self.clock + seconds)
        series["reserved"].append(self.manager.allocator.num_used_blocks * size)
        series["stored"].append(stored)  # the batch's tokens
        series["running"].append(len(requests))
        return tokens, seconds

    def cascade_saved_tokens(self, requests: list[Request], query_lens: list[int]) -> int:
        """Key rows of every layer that this step's cascades do not read (0 without cascade),
        counted in ``EngineStats`` as the engine counts them."""
        policy = self.config.cascade_policy
        if policy is None:
            return 0
        batch = self.manager.build_batch([r.request_id for r in requests], query_lens,
                                         cascade=policy)
        return round(self._count_cascades(batch) / self.pages_per_block)

    def _record(self, requests: list[Request]) -> None:
        super()._record(requests)
        groups = len(self.manager.group_windows)  # every group's last block holds the gap
        self.stats.empty_slots += (groups - 1) * sum(-r.context_len % self.config.block_size
                                                     for r in requests)

    def next_token(self, request: Request) -> int:
        """The token the request generates next: the trace's."""
        return self.trace[request.request_id].output_token(request.num_tokens)


@dataclass(slots=True)
class StrategyResult:
    """What one strategy did with the trace at one arrival rate."""

    name: str
    requests: int
    finished: int
    duration: float  # seconds from the first arrival to the last finish
    throughput: float  # requests / s
    output_tokens_per_s: float
    ttft: dict[str, float]  # p50 / p90 / p99 (and mean), seconds
    tpot: dict[str, float]
    normalized_latency: dict[str, float]  # seconds per output token
    steps: int
    peak_running: int
    mean_running: float
    kv_waste: float  # KV slots in use holding no token, averaged over steps
    preemptions: int
    recomputed_tokens: int
    swapped_blocks: int
    preemption_seconds: float  # marginal step time spent recomputing and swapping
    prefix_hit_rate: float | None
    kv_read_saved: float | None = None  # share of K/V reads cascades saved (None: no cascade)
    series: dict[str, list[float]] = field(default_factory=dict, repr=False)

    def summary(self) -> dict[str, object]:
        """The result without the per-step series (for JSON)."""
        return {k: getattr(self, k) for k in self.__slots__ if k != "series"}


def _percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": math.nan, "p50": math.nan, "p90": math.nan, "p99": math.nan}
    array = np.asarray(values, dtype=np.float64)
    p50, p90, p99 = np.percentile(array, [50, 90, 99])
    return {"mean": float(array.mean()), "p50": float(p50), "p90": float(p90),
            "p99": float(p99)}


def poisson_arrivals(num_requests: int, rate: float, seed: int = 0) -> list[float]:
    """Arrival times (seconds) of a Poisson process of ``rate`` requests/s (inf: all at 0)."""
    if checks.number(rate, "rate", above=0, at_most=math.inf) == math.inf:
        return [0.0] * num_requests
    gaps = np.random.default_rng(seed + 1).exponential(1.0 / rate, num_requests)
    return np.cumsum(gaps).tolist()


def strategy_config(name: str, num_slots: int, block_size: int, max_len: int,
                    **scheduler: Any) -> EngineConfig:
    """The engine configuration of a strategy over ``num_slots`` token slots."""
    if name == "contiguous":
        return EngineConfig.contiguous(max_len, num_slots, **scheduler)
    if name in ALL_STRATEGIES:
        return EngineConfig(block_size=block_size, num_blocks=max(1, num_slots // block_size),
                            enable_prefix_caching=name != "paged", cascade=name == CASCADE,
                            reserve_null_block=False, **scheduler)
    raise ValueError(f"unknown strategy {name!r}; strategies: {', '.join(ALL_STRATEGIES)}")


def run_strategy(name: str, requests: Sequence[traces.Request], arrivals: Sequence[float],
                 cost: StepCost, num_slots: int, block_size: int = 16, max_len: int = 2048,
                 hybrid: Hybrid | None = None, **scheduler: Any) -> StrategyResult:
    """Serve ``requests`` arriving at ``arrivals`` under one strategy (see the module doc);
    ``num_slots`` are token slots of blocks of every layer (``paged+hybrid``, which needs
    ``hybrid``, turns them and ``num_cpu_blocks`` into its pages)."""
    groups, pages_per_block = None, 1.0
    if name == HYBRID:
        if hybrid is None:
            raise ValueError(f"{HYBRID} needs the model's KV cache groups (hybrid=Hybrid.of(spec))")
        groups, pages_per_block = hybrid.groups, hybrid.pages_per_block
        num_slots = int(num_slots * pages_per_block)
        if scheduler.get("num_cpu_blocks"):  # the CPU pool's bytes hold pages too
            scheduler["num_cpu_blocks"] = int(scheduler["num_cpu_blocks"] * pages_per_block)
    config = strategy_config(name, num_slots, block_size, max_len, **scheduler)
    server = SimulatedServer(config, cost, max_len, groups, pages_per_block)
    try:
        queued = drive(server, arrivals, lambda i, t: server.add_trace_request(requests[i], t))
    except RuntimeError as e:
        raise SimulationError(f"{name}: {e}") from None
    return _result(name, server, queued)


def drive(loop: ServingLoop, arrivals: Sequence[float],
          add: Callable[[int, float], Request]) -> list[Request]:
    """Run ``loop`` until every request has arrived and finished: request ``i`` is added by
    ``add(i, arrival_time)`` once the loop's clock reaches ``arrivals[i]``; an idle loop jumps
    to the next arrival. Returns the requests in arrival order. The engine and the simulator are
    driven alike (bench/validate_sim.py runs both)."""
    order = sorted(range(len(arrivals)), key=arrivals.__getitem__)
    queued: list[Request] = []
    i = 0
    while i < len(order) or loop.has_unfinished():
        while i < len(order) and arrivals[order[i]] <= loop.clock:
            queued.append(add(order[i], arrivals[order[i]]))
            i += 1
        if not loop.has_unfinished():
            loop.clock = arrivals[order[i]]
            continue
        loop.step()
    return queued


def _result(name: str, server: SimulatedServer, queued: list[Request]) -> StrategyResult:
    stats = server.stats
    finished = [r for r in queued if r.finish_time is not None]
    start = min((r.arrival_time for r in queued), default=0.0)
    duration = max((r.finish_time for r in finished), default=start) - start
    prefix = server.manager.prefix_cache
    return StrategyResult(
        name=name,
        requests=len(queued),
        finished=len(finished),
        duration=duration,
        throughput=len(finished) / duration if duration else math.inf,
        output_tokens_per_s=stats.generated_tokens / duration if duration else math.inf,
        ttft=_percentiles([r.ttft for r in finished]),
        tpot=_percentiles([r.tpot for r in finished if r.tpot is not None]),
        normalized_latency=_percentiles([r.normalized_latency for r in finished]),
        steps=stats.steps,
        peak_running=stats.peak_running,
        mean_running=stats.mean_running,
        kv_waste=stats.kv_waste,
        preemptions=stats.swaps_out + stats.recomputes,
        recomputed_tokens=stats.recompute_tokens,
        swapped_blocks=stats.swapped_blocks,
        preemption_seconds=server.preemption_seconds,
        prefix_hit_rate=prefix.stats.hit_rate if prefix is not None else None,
        kv_read_saved=(server.kv_saved_tokens / max(server.kv_read_tokens, 1)
                       if server.config.cascade_policy is not None else None),
        series=server.series,
    )


def simulate(
    requests: Sequence[traces.Request],
    cost: StepCost,
    num_slots: int,
    rate: float = math.inf,
    strategies: Sequence[str] = STRATEGIES,
    block_size: int = 16,
    max_len: int = 2048,
    seed: int = 0,
    arrivals: Sequence[float] | None = None,
    hybrid: Hybrid | None = None,
    **scheduler: Any,
) -> dict[str, StrategyResult]:
    """Every strategy on the trace at one arrival ``rate`` (requests/s, Poisson, seeded; inf:
    all at once) or at the given ``arrivals`` times; results by strategy name.

    ``scheduler``: EngineConfig's scheduler settings (max_num_seqs, max_num_batched_tokens,
    num_cpu_blocks); ``hybrid``: the model's groups, for ``paged+hybrid``."""
    _check_trace(requests, num_slots, max_len, strategies)
    if arrivals is None:
        arrivals = poisson_arrivals(len(requests), rate, seed)
    elif len(arrivals) != len(requests):
        raise ValueError(f"arrivals has {len(arrivals)} times for {len(requests)} requests")
    return {name: run_strategy(name, requests, arrivals, cost, num_slots, block_size, max_len,
                               hybrid, **scheduler)
            for name in strategies}


def _check_trace(requests: Sequence[traces.Request], num_slots: int, max_len: int,
                 strategies: Sequence[str]) -> None:
    if not requests:
        raise ValueError("the trace holds no request")
    too_long = [r.id for r in requests if r.final_len > max_len]
    if too_long:
        raise SimulationError(f"{len(too_long)} request(s) (first: {too_long[0]}) exceed max_len "
                              f"{max_len} tokens (prompt + output); raise max_len")
    if "contiguous" in strategies and max_len > num_slots:
        raise SimulationError(f"contiguous reserves max_len = {max_len} token slots per request, "
                              f"more than the whole budget of {num_slots}")


def sweep(
    requests: Sequence[traces.Request],
    cost: StepCost,
    num_slots: int,
    rates: Sequence[float],
    strategies: Sequence[str] = STRATEGIES,
    progress: Callable[[int, int], None] | None = None,
    **kwargs: Any,
) -> dict[float, dict[str, StrategyResult]]:
    """``simulate`` at each rate (the same seed, so the arrival pattern only scales).
    ``progress(done, total)`` is called after each (rate, strategy) run."""
    _check_trace(requests, num_slots, kwargs.get("max_len", 2048), strategies)
    out: dict[float, dict[str, StrategyResult]] = {}
    total, done = len(rates) * len(strategies), 0
    for rate in rates:
        out[rate] = {}
        for name in strategies:
            out[rate] |= simulate(requests, cost, num_slots, rate, [name], **kwargs)
            done += 1
            if progress is not None:
                progress(done, total)
    return out


def sustained_rate(results: dict[float, dict[str, StrategyResult]], strategy: str,
                   target: float, metric: str = "mean") -> float | None:
    """The request rate at which ``strategy``'s normalized latency (``metric``: mean or a
    percentile) reaches ``target`` seconds/token: the last swept rate within the target (at it
    and every lower rate), moved toward the next by linear interpolation of the latency between
    the two. None: not even the lowest rate is within; the highest rate when all are."""
    best = None
    for rate in sorted(results):
        latency = results[rate][strategy].normalized_latency[metric]
        if latency > target:
            if best is None:
                return None
            below = results[best][strategy].normalized_latency[metric]
            return best + (target - below) * (rate - best) / (latency - below)
        best = rate
    return best
