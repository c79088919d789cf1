"""The serving simulator: the engine's scheduler priced by a cost model.

Its decisions are the engine's (the same scheduler and block manager, step by step); its clock
adds the cost model's step times; its metrics follow from the requests' times.
"""

from __future__ import annotations

import json
import math

import pytest

from pagedkv.serving.engine import LLMEngine
from pagedkv.serving.model import ModelConfig
from pagedkv.serving.scheduler import EngineConfig, SamplingParams, StepShape
from pagedkv.tools import sim
from pagedkv.tools.costmodel import RooflineModel, get_device
from pagedkv.tools.demo import random_model
from pagedkv.tools.presets import get_model
from pagedkv.tools.traces import Request, synthetic_trace


class LinearCost:
    """A step costs ``base`` plus per-token and per-K/V-token terms (seconds)."""

    def __init__(self, base=0.01, per_query=1e-4, per_kv=1e-6, per_swap=1e-4):
        self.base, self.per_query, self.per_kv, self.per_swap = base, per_query, per_kv, per_swap

    def step_seconds(self, shape: StepShape) -> float:
        return (self.base + self.per_query * shape.query_tokens + self.per_kv * shape.kv_read
                + self.per_swap * shape.swap_blocks)


def test_step_shape_counts_causal_pairs():
    shape = StepShape.of([10, 7, 5], [1, 7, 3], swap_blocks=2)
    assert (shape.num_seqs, shape.query_tokens, shape.prefill_tokens) == (3, 11, 10)
    assert shape.attended == 10 + sum(range(1, 8)) + (3 + 4 + 5)
    assert shape.kv_read == 22 and shape.swap_blocks == 2


@pytest.mark.parametrize("num_cpu_blocks", [0, 12], ids=["recompute", "swap"])
def test_the_simulator_decides_as_the_engine(num_cpu_blocks):
    """Same config, same requests, the engine's tokens fed to the simulator: every step schedules
    the same requests with the same query lengths, preempts the same way, finishes in the same
    order."""
    model = random_model(ModelConfig(vocab_size=97, hidden_size=32, intermediate_size=64,
                                     num_hidden_layers=1, num_attention_heads=2,
                                     num_key_value_heads=1, max_position_embeddings=128), seed=1)
    config = EngineConfig(block_size=4, num_blocks=14, num_cpu_blocks=num_cpu_blocks,
                          max_num_seqs=5, max_num_batched_tokens=24)
    system = [5, 9, 13, 17, 21, 25, 29, 33]
    prompts = [system + [1, 2], [3, 4, 5], system + [6], list(range(40, 51)), system + [7, 8, 9],
               [60, 61]]
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (9, 12, 7, 10, 11, 6)]

    def run(loop):
        requests = [loop.add_request(prompt, p) for prompt, p in zip(prompts, params, strict=True)]
        steps, order = [], []
        while loop.has_unfinished():
            order += [r.request_id for r in loop.step()]
            steps.append(loop.last_batch)
        return steps, order, requests

    engine = LLMEngine(model, config)
    engine_steps, engine_order, engine_requests = run(engine)
    preempted = engine.stats.swaps_out if num_cpu_blocks else engine.stats.recomputes
    assert preempted > 0, "the test must preempt"
    outputs = {r.request_id: r.output_token_ids for r in engine_requests}
    server = EngineReplay(config, outputs)
    sim_steps, sim_order, sim_requests = run(server)
    assert sim_steps == engine_steps
    assert sim_order == engine_order
    assert [r.output_token_ids for r in sim_requests] == [r.output_token_ids
                                                          for r in engine_requests]
    for name in ("steps", "prefill_tokens", "recompute_tokens", "swaps_out", "recomputes",
                 "swapped_blocks", "used_slots", "empty_slots", "generated_tokens"):
        assert getattr(server.stats, name) == getattr(engine.stats, name), name
    assert server.prefix_hit_rate == engine.prefix_hit_rate > 0


class EngineReplay(sim.SimulatedServer):
    """The simulator, generating the tokens the engine generated."""

    def __init__(self, config, outputs):
        super().__init__(config, LinearCost(), max_len=128)
        self.outputs = outputs

    def next_token(self, request):
        return self.outputs[request.request_id][len(request.output_token_ids)]


def test_one_request_alone_takes_the_cost_models_times():
    cost = LinearCost()
    (result,) = sim.simulate([Request(0, 30, 5)], cost, num_slots=256, rate=math.inf,
                             strategies=["paged"], block_size=16, max_len=64).values()
    prefill = cost.step_seconds(StepShape.of([30], [30]))
    decodes = [cost.step_seconds(StepShape.of([n], [1])) for n in range(31, 35)]
    assert result.ttft["p50"] == pytest.approx(prefill)
    assert result.duration == pytest.approx(prefill + sum(decodes))
    assert result.tpot["p50"] == pytest.approx(sum(decodes) / 4)
    assert result.normalized_latency["mean"] == pytest.approx(result.duration / 5)
    assert result.throughput == pytest.approx(1 / result.duration)
    assert result.preemptions == 0 and result.preemption_seconds == 0


def test_an_mla_request_takes_the_rooflines_times_of_its_latent_steps():
    v3 = get_model("DeepSeek-V3")
    cost = RooflineModel(v3, get_device("H200"), tp=8)
    (result,) = sim.simulate([Request(0, 3000, 3)], cost, num_slots=4096, strategies=["paged"],
                             max_len=4096).values()
    prefill = cost.breakdown(StepShape.of([3000], [3000]))
    assert prefill["compute_s"] > prefill["weights_s"] + prefill["kv_s"]
    causal = 3000 * 3001 // 2  # absorbed: 61 layers x 128 heads x (2 x 576 + 2 x 512) a pair
    lm_head = 2 * 129280 * 7168  # the last token only
    assert cost.flops(StepShape.of([3000], [3000])) == (
        3000 * v3.flops_per_token(lm_head=False) + lm_head + causal * 61 * 128 * 2176)
    decodes = [cost.step_seconds(StepShape.of([n], [1])) for n in (3001, 3002)]
    assert result.ttft["p50"] == pytest.approx(prefill["total_s"])
    assert result.duration == pytest.approx(prefill["total_s"] + sum(decodes))


def test_arrivals_wait_for_their_time_and_idle_gaps_are_skipped():
    cost = LinearCost(base=0.01, per_query=0, per_kv=0)
    requests = [Request(0, 4, 3), Request(1, 4, 3)]
    (result,) = sim.simulate(requests, cost, 256, arrivals=[0.0, 100.0],
                             strategies=["paged"], max_len=64).values()
    assert result.ttft["p50"] == pytest.approx(0.01)  # neither waits for the other
    assert result.duration == pytest.approx(100.03)
    assert result.steps == 6


def test_poisson_arrivals():
    times = sim.poisson_arrivals(20000, rate=4.0, seed=3)
    assert times == sorted(times) and times == sim.poisson_arrivals(20000, 4.0, 3)
    assert 1 / 4.0 * 0.97 < times[-1] / len(times) < 1 / 4.0 * 1.03
    assert sim.poisson_arrivals(3, math.inf) == [0.0, 0.0, 0.0]
    for bad in (0, -1, math.nan):
        with pytest.raises(ValueError, match="rate"):
            sim.poisson_arrivals(3, bad)


def _check(requests, results, num_slots):
    for r in results.values():
        assert r.finished == r.requests == len(requests), r.name
        assert max(r.series["reserved"]) <= num_slots, r.name
        if r.prefix_hit_rate is None:  # (shared blocks hold the tokens of several requests)
            assert all(s <= v for s, v in zip(r.series["stored"], r.series["reserved"],
                                              strict=True))
        assert r.series["time"] == sorted(r.series["time"])
        assert r.ttft["p50"] <= r.ttft["p99"] and r.normalized_latency["p50"] > 0


def test_paging_serves_more_requests_at_once_and_sustains_a_higher_rate():
    requests = synthetic_trace("sharegpt", 120, seed=0, max_len=1024, system_share=0.5)
    num_slots = 8 * 1024
    rates = [0.5, 2.0, 32.0]
    cost = LinearCost(base=0.02, per_query=2e-5, per_kv=2e-7)
    results = sim.sweep(requests, cost, num_slots, rates, max_len=1024, seed=1)
    for by_rate in results.values():
        _check(requests, by_rate, num_slots)
    slow, fast = results[0.5], results[32.0]
    for name in sim.STRATEGIES:  # queueing: latency grows with the rate
        assert fast[name].normalized_latency["mean"] > slow[name].normalized_latency["mean"]
    contiguous, paged, prefix = (fast[n] for n in sim.STRATEGIES)
    assert paged.mean_running > 1.5 * contiguous.mean_running
    assert paged.throughput > 1.5 * contiguous.throughput
    assert contiguous.kv_waste > 0.5 > 0.05 > paged.kv_waste
    assert prefix.prefix_hit_rate > 0.2 and paged.prefix_hit_rate is None
    target = 2 * slow["paged"].normalized_latency["mean"]
    paged_rate = sim.sustained_rate(results, "paged", target)
    contiguous_rate = sim.sustained_rate(results, "contiguous", target)
    assert 0.5 <= contiguous_rate < 2.0 <= paged_rate  # contiguous holds 8, paging ~15
    json.dumps({rate: {n: r.summary() for n, r in by.items()} for rate, by in results.items()})


def test_sustained_rate_is_where_the_latency_crosses_the_target():
    def result(latency):
        r = sim.StrategyResult("x", 1, 1, 1.0, 1.0, 1.0, {}, {}, {"mean": latency}, 1, 1, 1.0,
                               0.0, 0, 0, 0, 0.0, None)
        return {"x": r}

    results = {1.0: result(0.1), 2.0: result(0.2), 4.0: result(0.5), 8.0: result(0.3)}
    assert sim.sustained_rate(results, "x", 0.2) == 2.0
    assert sim.sustained_rate(results, "x", 0.35) == pytest.approx(3.0)  # halfway to 0.5 at 4
    assert sim.sustained_rate(results, "x", 0.05) is None
    assert sim.sustained_rate(results, "x", 1.0) == 8.0


def test_a_tight_budget_preempts_costs_time_and_still_finishes():
    requests = synthetic_trace("sharegpt", 40, seed=2, max_len=512)
    results = sim.simulate(requests, LinearCost(), num_slots=40 * 16, max_len=512,
                           strategies=["paged"], max_num_batched_tokens=512)
    _check(requests, results, 40 * 16)
    paged = results["paged"]
    assert paged.preemptions > 0 and paged.recomputed_tokens > 0
    assert 0 < paged.preemption_seconds < paged.duration
    swapping = sim.simulate(requests, LinearCost(), num_slots=40 * 16, max_len=512,
                            strategies=["paged"], max_num_batched_tokens=512,
                            num_cpu_blocks=256)["paged"]
    assert swapping.swapped_blocks > 0 and swapping.finished == len(requests)


def test_reproducible():
    requests = synthetic_trace("alpaca", 80, seed=5, system_share=0.3)
    kwargs = dict(num_slots=128 * 8, block_size=8, max_len=1024, rate=3.0, seed=4,
                  max_num_seqs=6)
    a, b = sim.simulate(requests, LinearCost(), **kwargs), sim.simulate(requests, LinearCost(),
                                                                          **kwargs)
    assert [r.summary() for r in a.values()] == [r.summary() for r in b.values()]
    assert all(r.peak_running <= 6 for r in a.values())


def test_simulation_errors():
    cost = LinearCost()
    with pytest.raises(sim.SimulationError, match="max_len"):
        sim.simulate([Request(0, 100, 100)], cost, num_slots=1600, max_len=150)
    with pytest.raises(sim.SimulationError, match="whole budget"):
        sim.simulate([Request(0, 1, 1)], cost, num_slots=64, max_len=128)
    with pytest.raises(ValueError, match="exceeds the cache"):
        sim.simulate([Request(0, 100, 100)], cost, num_slots=64, strategies=["paged"])
    with pytest.raises(ValueError, match="unknown strategy"):
        sim.simulate([Request(0, 1, 1)], cost, num_slots=64, strategies=["buddy"])
    with pytest.raises(ValueError, match="no request"):
        sim.simulate([], cost, num_slots=64)
    with pytest.raises(ValueError, match="arrivals"):
        sim.simulate([Request(0, 1, 1)], cost, num_slots=64, max_len=8, arrivals=[0.0, 1.0])
    assert sim.STRATEGIES == ("contiguous", "paged", "paged+prefix")


def test_the_hybrid_strategy_runs_the_hybrid_manager_on_more_pages():
    from pagedkv.blocks.hybrid import HybridBlockManager
    from pagedkv.tools.presets import get_model

    spec = get_model("gpt-oss-20b").spec(16, hybrid=True)
    hybrid = sim.Hybrid.of(spec)
    assert hybrid == sim.Hybrid((128, None), 2.0)
    requests = synthetic_trace("sharegpt", 60, seed=3, max_len=1024)
    arrivals = [0.0] * len(requests)
    results = {name: sim.run_strategy(name, requests, arrivals, LinearCost(), 6000, 16, 1024,
                                      hybrid=hybrid)
               for name in ("paged+prefix", sim.HYBRID)}
    prefix, hybrid_run = results["paged+prefix"], results[sim.HYBRID]
    assert hybrid_run.finished == prefix.finished == 60
    assert hybrid_run.peak_running > prefix.peak_running  # twice the pages, windows freed
    assert hybrid_run.preemptions < prefix.preemptions
    config = sim.strategy_config(sim.HYBRID, 12000, 16, 1024)
    server = sim.SimulatedServer(config, LinearCost(), 1024, hybrid.groups)
    assert isinstance(server.manager, HybridBlockManager)
    assert server.scheduler.manager is server.manager
    with pytest.raises(ValueError, match="needs the model's KV cache groups"):
        sim.run_strategy(sim.HYBRID, requests, arrivals, LinearCost(), 6000)
    swapped = sim.run_strategy(sim.HYBRID, requests, arrivals, LinearCost(), 6000, 16, 1024,
                               hybrid=hybrid, num_cpu_blocks=256)
    assert swapped.finished == 60 and swapped.swapped_blocks > 0


def _served(name: str, requests: list[Request], arrivals: list[float],
            cost: LinearCost) -> tuple[sim.SimulatedServer, list]:
    server = sim.SimulatedServer(sim.strategy_config(name, 4096, 16, 256), cost, 256)
    queued = sim.drive(server, arrivals, lambda i, t: server.add_trace_request(requests[i], t))
    return server, queued


def test_the_cascade_strategy_reads_shared_blocks_once():
    """Eleven requests behind one 80-token prompt (5 blocks), arriving after the first computed
    it: paged+cascade schedules them as paged+prefix does and generates the same tokens, and
    each step is cheaper by exactly the K/V rows its cascades did not read."""
    requests = [Request(i, 80 + 3 + 2 * i, 9 + i % 4, prefix_id=0, prefix_len=80)
                for i in range(12)]
    arrivals = [0.0] + [1.0] * 11
    cost = LinearCost(per_kv=1e-5)
    plain, plain_queued = _served("paged+prefix", requests, arrivals, cost)
    cascade, cascade_queued = _served(sim.CASCADE, requests, arrivals, cost)
    assert cascade.config.cascade_policy is not None and plain.config.cascade_policy is None
    assert [r.output_token_ids for r in cascade_queued] == [
        r.output_token_ids for r in plain_queued]
    assert cascade.stats.steps == plain.stats.steps and plain.stats.cascade_steps == 0
    saved = cascade.stats.cascade_saved_tokens
    assert cascade.stats.cascade_steps > 0 and saved > 0 and saved % 16 == 0
    assert cascade.kv_saved_tokens == saved and plain.kv_saved_tokens == 0
    assert cascade.kv_read_tokens == plain.kv_read_tokens
    assert plain.clock - cascade.clock == pytest.approx(cost.per_kv * saved)
    assert cascade.series["stored"] == plain.series["stored"]  # the batch's tokens, as stored
    first = sim.run_strategy(sim.CASCADE, requests, arrivals, cost, 4096, 16, 256)
    assert first.kv_read_saved == pytest.approx(saved / plain.kv_read_tokens)
    assert sim.run_strategy("paged+prefix", requests, arrivals, cost, 4096, 16, 256
                            ).kv_read_saved is None


def test_the_cascade_strategy_without_shared_prompts_changes_nothing():
    requests = [Request(i, 40 + i, 6) for i in range(8)]
    cost = LinearCost(per_kv=1e-5)
    plain, _ = _served("paged+prefix", requests, [0.0] * 8, cost)
    cascade, _ = _served(sim.CASCADE, requests, [0.0] * 8, cost)
    assert cascade.stats.cascade_steps == 0 and cascade.clock == plain.clock
