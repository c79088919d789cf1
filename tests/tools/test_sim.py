"""Memory accounting (models, sizes) and the serving simulation: invariants on small traces."""

from __future__ import annotations

import json
import random

import pytest
import torch

from pagedkv.tools.presets import MODELS, format_bytes, get_model, parse_bytes, size_report
from pagedkv.tools.sim import STRATEGIES, SimulationError, _Contiguous, _Running, simulate
from pagedkv.tools.traces import Request, load_jsonl, synthetic_trace, trace_stats

GIB = 2**30


def test_size_llama3_8b_by_hand():
    spec = get_model("llama-3-8b").spec(block_size=16)
    assert spec.kv_dtype == torch.bfloat16
    assert spec.bytes_per_token == 2 * 32 * 8 * 128 * 2 == 131072
    r = size_report(spec, seq_len=8192, batch=4, memory=80 * GIB)
    assert r["bytes_per_block"] == 16 * 131072 == 2 * 2**20
    assert r["bytes_per_seq"] == 8192 * 131072 == GIB
    assert r["kv_cache_bytes"] == 4 * GIB
    assert r["blocks_fit"] == 80 * GIB // (2 * 2**20) == 40960
    assert r["tokens_fit"] == 655360 and r["seqs_fit"] == 80


def test_size_llama3_70b_and_fp8_by_hand():
    spec = get_model("Llama-3-70B").spec(block_size=32)
    assert spec.bytes_per_token == 2 * 80 * 8 * 128 * 2 == 327680
    r = size_report(spec, seq_len=1000, batch=3)
    assert r["kv_cache_bytes"] == 2 * 80 * 8 * 128 * 1000 * 3 * 2 == 983_040_000
    assert r["blocks_per_seq"] == 32 and r["paged_bytes"] == 32 * 3 * 32 * 327680
    assert get_model("llama-3-70b").spec(cache_dtype="fp8").bytes_per_token == 327680 // 2


@pytest.mark.parametrize("name, per_token", [
    ("Mistral-7B", 2 * 32 * 8 * 128 * 2), ("Qwen2.5-7B", 2 * 28 * 4 * 128 * 2),
    ("Gemma-2-9B", 2 * 42 * 8 * 256 * 2), ("OPT-13B", 819200),  # the vLLM paper's "800 KB"
])
def test_preset_bytes_per_token(name, per_token):
    assert get_model(name).spec().bytes_per_token == per_token


def test_presets_gqa_divides_heads():
    for m in MODELS.values():
        assert m.num_heads % m.num_kv_heads == 0, m.name


def test_parse_and_format_bytes():
    assert parse_bytes("80GiB") == 80 * GIB and parse_bytes("1.5 GB") == 1_500_000_000
    assert parse_bytes("512mib") == 512 * 2**20 and parse_bytes("4096") == 4096
    with pytest.raises(ValueError, match="cannot read"):
        parse_bytes("lots")
    assert format_bytes(131072) == "128 KiB" and format_bytes(1000) == "1000 B"
    assert format_bytes(1.5 * GIB) == "1.5 GiB"
    with pytest.raises(ValueError, match="presets"):
        get_model("gpt-5")


def test_request_tokens_share_only_the_prefix():
    a, b = Request(0, 40, 5, prefix_id=1, prefix_len=20), Request(1, 40, 5, 1, 30)
    assert a.tokens(0, 20) == b.tokens(0, 20)
    assert a.tokens(20, 21) != b.tokens(20, 21)
    assert a.tokens(0, 45)[40:] == [a.output_token(p) for p in range(40, 45)]
    c = Request(2, 3, 2, prompt=(7, 8, 9))
    assert c.tokens(1, 4) == [8, 9, c.output_token(3)]


def test_synthetic_trace_seeded_and_shaped():
    a = synthetic_trace("sharegpt", 400, seed=3, system_share=0.5)
    assert a == synthetic_trace("sharegpt", 400, seed=3, system_share=0.5)
    assert a != synthetic_trace("sharegpt", 400, seed=4, system_share=0.5)
    assert all(1 <= r.output_len and r.final_len <= 2048 for r in a)
    plain = trace_stats(synthetic_trace("sharegpt", 2000, seed=0))
    assert 130 < plain["prompt_mean"] < 200 and 270 < plain["output_mean"] < 400
    alpaca = trace_stats(synthetic_trace("alpaca", 2000, seed=0))
    assert alpaca["prompt_mean"] < 30 and alpaca["output_mean"] < 80
    assert 0.4 < trace_stats(a)["prefix_share"] < 0.6 and plain["prefix_share"] == 0


def _check_invariants(requests, results, budget):
    for r in results.values():
        assert r.finished == len(requests), r.name
        assert max(r.series["reserved"]) <= budget and r.peak_reserved <= budget, r.name
        assert all(s <= v for s, v in zip(r.series["stored"], r.series["reserved"], strict=True))
        assert r.steps >= max(q.output_len for q in requests)


def test_sharegpt_reproduces_the_published_shape():
    requests = synthetic_trace("sharegpt", 240, seed=0)
    results = simulate(requests, num_blocks=1024, block_size=16, max_len=2048)
    _check_invariants(requests, results, 1024 * 16)
    cmax, oracle, paged = (results[k] for k in ("contiguous-max", "contiguous-oracle", "paged"))
    assert 0.6 <= cmax.waste <= 0.8 and cmax.internal_waste == 0
    assert paged.waste < 0.04 and paged.reservation_waste == 0
    assert paged.waste < oracle.waste < cmax.waste
    assert paged.mean_running_queued >= 3 * cmax.mean_running_queued
    assert paged.steps < cmax.steps and results["paged+prefix"].prefix_hit_rate == 0.0
    assert cmax.prefix_hit_rate is None and cmax.preemptions == 0


def test_prefix_sharing_hits_with_system_prompts():
    requests = synthetic_trace("alpaca", 150, seed=1, system_share=0.8, system_len=64)
    results = simulate(requests, num_blocks=200, block_size=16, max_len=1024)
    _check_invariants(requests, results, 200 * 16)
    shared, paged = results["paged+prefix"], results["paged"]
    assert shared.prefix_hit_rate > 0.2 and paged.prefix_hit_rate is None
    assert shared.steps <= paged.steps


def test_tight_budget_preempts_and_still_finishes():
    requests = synthetic_trace("sharegpt", 40, seed=2, max_len=512)
    results = simulate(requests, num_blocks=40, block_size=16, max_len=512,
                       strategies=["paged", "paged+prefix"])
    _check_invariants(requests, results, 40 * 16)
    assert results["paged"].preemptions > 0


def test_simulation_reproducible_and_capped():
    requests = synthetic_trace("alpaca", 80, seed=5, system_share=0.3)
    kwargs = dict(num_blocks=128, block_size=8, max_len=1024, max_running=6, arrival_rate=0.5)
    a, b = simulate(requests, **kwargs), simulate(requests, **kwargs)
    assert [r.summary() for r in a.values()] == [r.summary() for r in b.values()]
    assert all(r.peak_running <= 6 for r in a.values())
    json.dumps({k: r.summary() for k, r in a.items()})


def test_simulation_errors():
    with pytest.raises(SimulationError, match="max_len"):
        simulate([Request(0, 100, 100)], num_blocks=100, max_len=150)
    with pytest.raises(SimulationError, match="whole budget"):
        simulate([Request(0, 1, 1)], num_blocks=4, block_size=16, max_len=128)
    with pytest.raises(SimulationError, match="paged: request 0 .* does not fit"):
        simulate([Request(0, 100, 100)], num_blocks=4, block_size=16, strategies=["paged"])
    with pytest.raises(ValueError, match="unique"):
        simulate([Request(0, 1, 1), Request(0, 2, 1)], num_blocks=4, strategies=["paged"])
    with pytest.raises(ValueError, match="unknown strategy"):
        simulate([Request(0, 1, 1)], num_blocks=4, strategies=["buddy"])
    assert set(STRATEGIES) == {"contiguous-max", "contiguous-oracle", "paged", "paged+prefix"}


def test_contiguous_first_fit_merges_holes():
    pool = _Contiguous(100, None)
    runs = [_Running(Request(i, 10 * (i + 1), 10)) for i in range(3)]  # 20, 30, 40 slots
    assert all(pool.admit(run) for run in runs) and pool.holes == [(90, 10)]
    pool.release(runs[1])
    assert pool.holes == [(20, 30), (90, 10)] and not pool.admit(_Running(Request(3, 31, 10)))
    pool.release(runs[0])
    pool.release(runs[2])
    assert pool.holes == [(0, 100)] and pool.reserved == 0


def test_jsonl_trace(tmp_path):
    path = tmp_path / "trace.jsonl"
    rows = [{"prompt_len": 70, "output_len": 5, "prefix_id": "sys", "prefix_len": 64},
            {"prompt_len": 90, "output_len": 7, "prefix_id": "sys", "prefix_len": 64},
            {"prompt": list(range(40)), "output_len": 3},
            {"prompt": list(range(40)) + [99], "output_len": 3}, {"prompt_len": 9, "output_len": 2}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    requests = load_jsonl(path)
    assert [r.prefix_id for r in requests] == [0, 0, None, None, None]
    results = simulate(requests, num_blocks=64, block_size=16, max_len=256,
                       strategies=["paged+prefix"], max_running=1)
    assert results["paged+prefix"].prefix_hit_rate == (64 + 32) / (70 + 90 + 40 + 41 + 9)
    path.write_text('{"prompt_len": 4, "output_len": 0}\n')
    with pytest.raises(ValueError, match="trace.jsonl:1"):
        load_jsonl(path)


def test_contiguous_pool_random_admit_release():
    rng = random.Random(0)
    pool, live, total = _Contiguous(1000, None), [], 1000
    for i in range(2000):
        if live and rng.random() < 0.5:
            pool.release(live.pop(rng.randrange(len(live))))
        else:
            run = _Running(Request(i, rng.randint(1, 60), rng.randint(1, 60)))
            if pool.admit(run):
                live.append(run)
        assert pool.reserved == sum(r.req.final_len for r in live)
        assert pool.reserved + sum(size for _, size in pool.holes) == total
        assert all(size > 0 for _, size in pool.holes)
        ends = [start + size for start, size in pool.holes]
        assert all(end < nxt for end, (nxt, _) in zip(ends, pool.holes[1:], strict=False))
