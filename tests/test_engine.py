"""The engine against Hugging Face greedy generation: continuous batching, prefix hits, preemption
by swap and by recompute, contiguous max-length reservation."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
import torch

import pagedkv
from pagedkv import demo
from pagedkv.engine import EngineConfig, LLMEngine, SamplingParams, Status
from pagedkv.model import LlamaForCausalLM

pytest.importorskip("transformers")
from test_model_hf import hf_greedy, one_thread, tiny_hf_model  # noqa: E402, F401

SYSTEM = [7, 3, 99, 42, 17, 250, 8, 64, 5, 11, 200, 31, 90]
PROMPTS = [SYSTEM + [1, 2], [5, 6, 7], SYSTEM + [40, 41, 42, 43, 44, 45], list(range(60, 79)),
           [9], SYSTEM + [2]]
MAX_TOKENS = [10, 4, 12, 7, 9, 11]


@pytest.fixture(scope="module")
def hf() -> torch.nn.Module:
    return tiny_hf_model(seed=3)


@pytest.fixture(scope="module")
def expected(hf: torch.nn.Module) -> list[list[int]]:
    return [hf_greedy(hf, p, n) for p, n in zip(PROMPTS, MAX_TOKENS, strict=True)]


def make_engine(hf: torch.nn.Module, **config) -> LLMEngine:
    return LLMEngine(LlamaForCausalLM.from_hf(hf), EngineConfig(**config))


def params() -> list[SamplingParams]:
    return [SamplingParams(max_tokens=n) for n in MAX_TOKENS]


def test_batch_with_shared_prefix_matches_hf(hf, expected) -> None:
    engine = make_engine(hf, block_size=4, num_blocks=64)
    assert engine.generate(PROMPTS, params()) == expected
    assert engine.stats.peak_running == len(PROMPTS)
    assert engine.prefix_hit_rate > 0.3
    assert engine.stats.swaps_out == engine.stats.recomputes == 0
    assert engine.manager.allocator.num_used_blocks == 0


def test_requests_join_and_leave_between_steps(hf, expected) -> None:
    engine = make_engine(hf, block_size=4, num_blocks=64)
    first = [engine.add_request(p, s) for p, s in zip(PROMPTS[:2], params()[:2], strict=True)]
    for _ in range(3):
        engine.step()
    assert [r.status for r in first] == [Status.RUNNING, Status.RUNNING]
    later = [engine.add_request(p, s) for p, s in zip(PROMPTS[2:], params()[2:], strict=True)]
    finished = []
    while engine.has_unfinished():
        finished += engine.step()
    assert finished[0] is first[1]  # the 4-token request leaves first
    assert [r.output_token_ids for r in first + later] == expected
    assert later[0].num_cached_tokens == 12  # 3 full blocks of the system prompt


@pytest.mark.parametrize("num_cpu_blocks", [64, 0], ids=["swap", "recompute"])
def test_preemption_matches_hf(hf, expected, num_cpu_blocks: int) -> None:
    engine = make_engine(hf, block_size=4, num_blocks=16, num_cpu_blocks=num_cpu_blocks)
    assert engine.generate(PROMPTS, params()) == expected
    if num_cpu_blocks:
        assert engine.stats.swaps_out > 0 and engine.stats.recomputes == 0
    else:
        assert engine.stats.recomputes > 0 and engine.stats.swaps_out == 0


def test_contiguous_reservation_matches_hf(hf, expected) -> None:
    longest = max(len(p) + n for p, n in zip(PROMPTS, MAX_TOKENS, strict=True))
    engine = make_engine(hf, block_size=longest, num_blocks=3, enable_prefix_caching=False,
                         reserve_null_block=False)
    assert engine.generate(PROMPTS, params()) == expected
    assert engine.stats.peak_running == 3 and engine.stats.kv_waste > 0.3


def test_eos_stops_a_request(hf, expected) -> None:
    engine = make_engine(hf, block_size=4, num_blocks=64)
    eos = expected[3][2]
    engine.model.config.eos_token_id = eos
    out = engine.generate([PROMPTS[3]], SamplingParams(max_tokens=MAX_TOKENS[3]))[0]
    assert out == expected[3][:expected[3].index(eos) + 1]


def test_temperature_sampling_is_seeded(hf, expected) -> None:
    sampling = [SamplingParams(max_tokens=n, temperature=1.0) for n in MAX_TOKENS]
    runs = [make_engine(hf, block_size=4, num_blocks=64, seed=7).generate(PROMPTS, sampling)
            for _ in range(2)]
    assert runs[0] == runs[1] != expected
    assert [len(out) for out in runs[0]] == MAX_TOKENS


def test_rejects_a_request_larger_than_the_cache(hf) -> None:
    engine = make_engine(hf, block_size=4, num_blocks=4)
    with pytest.raises(ValueError, match="exceeds"):
        engine.add_request(list(range(10)), SamplingParams(max_tokens=8))


def test_core_package_does_not_import_transformers() -> None:
    package = Path(pagedkv.__file__).parent
    for path in package.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(n.split(".")[0] == "transformers" for n in names), path.name


def test_demo_paged_beats_contiguous_under_one_budget(capsys) -> None:
    args = ["--requests", "8", "--system-prompt-len", "16", "--max-prompt", "12",
            "--max-tokens", "8", "--max-model-len", "40", "--kv-budget-requests", "2",
            "--block-size", "4", "--device", "cpu", "--json"]
    assert demo.main(args) == 0
    report = json.loads(capsys.readouterr().out)
    assert "same greedy tokens in both runs: True" in demo.format_report(report)
    paged, contiguous = report["paged"], report["contiguous"]
    assert report["outputs_match"] and paged["generated_tokens"] == contiguous["generated_tokens"]
    assert paged["peak_concurrent_requests"] > contiguous["peak_concurrent_requests"] == 2
    assert paged["kv_waste"] < contiguous["kv_waste"]
    assert paged["prefix_hit_rate"] > 0 == contiguous["prefix_hit_rate"]
