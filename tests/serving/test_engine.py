"""The engine against Hugging Face greedy generation: continuous batching, prefix hits, preemption
by swap and by recompute, contiguous max-length reservation."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
import torch

import pagedkv
from pagedkv.errors import InvalidArgumentError
from pagedkv.serving.engine import EngineConfig, LLMEngine, SamplingParams, Status
from pagedkv.serving.model import LlamaForCausalLM
from pagedkv.tools import demo

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


# -- bad requests and configs are refused at the boundary (issue 14) --------------------------

VOCAB = 64


@pytest.fixture(scope="module")
def hf64() -> torch.nn.Module:
    return tiny_hf_model(seed=5, vocab_size=VOCAB)


BAD_PROMPTS = {
    "out of vocabulary": [1, VOCAB],
    "negative": [3, -1],
    "float ids": [1.0, 2],
    "float tensor": torch.tensor([1.0, 2.0]),
    "bool": [True, 2],
    "None": None,
    "None id": [1, None],
    "str": "12",
    "nested": [[1, 2]],
    "empty": [],
    "too long": [1] * 50,  # + 16 new tokens > 15 usable blocks of 4
}


def test_add_request_refuses_a_bad_prompt_and_the_others_finish(hf64) -> None:
    engine = make_engine(hf64, block_size=4, num_blocks=16)
    prompts = [[5, 6, 7], [9, VOCAB - 1]]
    good = [engine.add_request(torch.tensor(prompts[0]), SamplingParams(max_tokens=16)),
            engine.add_request(prompts[1], SamplingParams(max_tokens=16))]
    assert good[0].prompt_token_ids == prompts[0]
    engine.step()
    for name, prompt in BAD_PROMPTS.items():
        with pytest.raises(InvalidArgumentError, match="prompt"):
            engine.add_request(prompt, SamplingParams(max_tokens=16))
        assert not engine.scheduler.waiting and not engine.scheduler.swapped, name
        assert engine.scheduler.running == good, name
        engine.step()  # the running requests carry on
    for bad_params in ("greedy", {"max_tokens": 4}):
        with pytest.raises(InvalidArgumentError, match="params"):
            engine.add_request([1, 2], bad_params)
    assert engine.scheduler.running == good and not engine.scheduler.waiting
    while engine.has_unfinished():
        engine.step()
    assert [r.output_token_ids for r in good] == [hf_greedy(hf64, p, 16) for p in prompts]
    assert engine.stats.generated_tokens == 32
    assert engine.manager.allocator.num_used_blocks == 0


GENERATE_CASES = {
    "too long": ([[1, 2, 3], [1] * 200], None, r"prompts\[1\]"),
    "params count": (PROMPTS, params()[:-1], "params"),
    "bad id": ([[1, 2, 3], [4, 256]], None, r"prompts\[1\] holds 256"),
    "bad params": ([[1, 2, 3], [4]], [SamplingParams(), "greedy"], "params"),
    "str": ("1 2 3", None, "prompts"),
    "generator": (([1, 2] for _ in range(2)), None, "prompts"),
}


@pytest.mark.parametrize("case", list(GENERATE_CASES))
def test_generate_checks_the_whole_batch_before_queueing(hf, expected, case: str) -> None:
    engine = make_engine(hf, block_size=4, num_blocks=16)
    prompts, sampling, message = GENERATE_CASES[case]
    with pytest.raises(InvalidArgumentError, match=message):
        engine.generate(prompts, sampling)
    assert not engine.has_unfinished()
    out = engine.generate(PROMPTS, params())
    assert [len(tokens) for tokens in out] == MAX_TOKENS
    assert out == expected
    assert engine.stats.generated_tokens == sum(MAX_TOKENS)


@pytest.mark.parametrize("kwargs", [
    dict(max_num_seqs=0), dict(block_size=0), dict(block_size=2.0), dict(block_size=True),
    dict(num_blocks=-1), dict(num_blocks=0), dict(num_blocks=None), dict(num_cpu_blocks=-1),
    dict(max_num_batched_tokens=0), dict(kv_cache_bytes=0), dict(seed=-1),
    dict(chunked_prefill=1),
], ids=lambda kwargs: ",".join(f"{k}={v}" for k, v in kwargs.items()))
def test_bad_engine_config_raises_at_construction(kwargs) -> None:
    with pytest.raises(InvalidArgumentError, match=next(iter(kwargs))):
        EngineConfig(**kwargs)


@pytest.mark.parametrize("kwargs", [
    dict(max_tokens=0), dict(max_tokens=-1), dict(max_tokens=1.5), dict(max_tokens=None),
    dict(temperature=-1), dict(temperature=float("nan")), dict(temperature=float("inf")),
    dict(temperature="0"), dict(temperature=True), dict(ignore_eos="yes"), dict(ignore_eos=1),
], ids=lambda kwargs: ",".join(f"{k}={v}" for k, v in kwargs.items()))
def test_bad_sampling_params_raise_at_construction(kwargs) -> None:
    with pytest.raises(InvalidArgumentError, match=next(iter(kwargs))):
        SamplingParams(**kwargs)


def test_a_cache_too_small_for_any_request_raises_at_construction(hf) -> None:
    with pytest.raises(InvalidArgumentError, match="holds no request"):
        make_engine(hf, block_size=4, num_blocks=1)


# -- a failing kernel mid-run loses nothing ------------------------------------------------------

SWAP_CONFIG = dict(block_size=4, num_blocks=16, num_cpu_blocks=64)  # preempts by swapping


class InjectedFault(RuntimeError):
    pass


class Fault:
    """Wraps ``fn``: call number ``fail_at`` (1-based; 0: none) raises InjectedFault, before
    doing its work or, with ``after``, once the work is done (a kernel that reports an error
    after writing)."""

    def __init__(self, fn, fail_at: int = 0, after: bool = False) -> None:
        self.fn, self.fail_at, self.after, self.calls = fn, fail_at, after, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        failing = self.calls == self.fail_at
        if failing and not self.after:
            raise InjectedFault(f"injected failure of call {self.calls}")
        out = self.fn(*args, **kwargs)
        if failing:
            raise InjectedFault(f"injected failure after call {self.calls}")
        return out


def run_with_fault(hf, target: str, fail_at: int = 0, after: bool = False):
    """Run PROMPTS on a swapping engine whose ``target`` fails once, retrying ``step()``."""
    engine = make_engine(hf, **SWAP_CONFIG)
    owner, name = {"swap_out": (engine.cache, "swap_to"),  # device -> CPU
                   "swap_in": (engine.cpu_cache, "swap_to"),  # CPU -> device
                   "model": (engine.model, "forward")}[target]
    fault = Fault(getattr(owner, name), fail_at, after)
    setattr(owner, name, fault)
    requests = [engine.add_request(p, s) for p, s in zip(PROMPTS, params(), strict=True)]
    failures = 0
    while engine.has_unfinished():
        try:
            engine.step()
        except InjectedFault:
            failures += 1
            assert engine._in_flight, "the failed step's batch stays in flight"
    return engine, [r.output_token_ids for r in requests], fault, failures


@pytest.mark.parametrize("after", [False, True], ids=["before-work", "after-work"])
@pytest.mark.parametrize("target", ["swap_out", "swap_in", "model"])
def test_a_failing_step_is_retried_and_loses_nothing(hf, expected, target: str,
                                                     after: bool) -> None:
    """Whichever call of the swap kernels (or the model) fails, the retried steps give the
    undisturbed engine's greedy tokens, generate each token once and release every block."""
    undisturbed, reference, counter, _ = run_with_fault(hf, target)
    assert reference == expected and undisturbed.stats.swaps_out > 0
    assert counter.calls > 0, f"the run never calls {target}: the test would prove nothing"
    for fail_at in range(1, counter.calls + 1):
        engine, out, fault, failures = run_with_fault(hf, target, fail_at, after)
        assert failures == 1 and fault.calls == counter.calls + 1, fail_at
        assert out == reference, fail_at
        assert engine.stats.generated_tokens == sum(MAX_TOKENS), fail_at
        assert engine.stats.steps == undisturbed.stats.steps, fail_at
        manager = engine.manager
        assert len(manager) == 0 and not manager.plan(), fail_at
        assert manager.allocator.num_used_blocks == 0, fail_at
        assert manager.cpu_allocator.num_used_blocks == 0, fail_at


# ---- cascade (shared-prefix) attention -----------------------------------------------------


@pytest.mark.parametrize("block_size", [4, 5])
def test_cascade_gives_the_same_greedy_tokens(hf, expected, block_size) -> None:
    """The shared system prompt's blocks read once per group: the same tokens as without."""
    on = make_engine(hf, block_size=block_size, num_blocks=64, cascade=True)
    assert on.generate(PROMPTS, params()) == expected
    assert on.stats.cascade_steps > 0 and on.stats.cascade_saved_tokens > 0
    off = make_engine(hf, block_size=block_size, num_blocks=64, cascade=False)
    assert off.generate(PROMPTS, params()) == expected
    assert off.stats.cascade_steps == 0
    assert on.manager.allocator.num_used_blocks == 0


def test_cascade_on_parallel_samples_of_one_long_prompt(hf) -> None:
    """n samples of one prompt (a prefix-cache hit for all but the first), decode and mixed
    steps: the same tokens with cascade forced, off and automatic."""
    prompt = [(7 * i + 3) % 250 for i in range(45)]
    prompts = [prompt + [i] for i in range(6)] + [prompt]
    sampling = [SamplingParams(max_tokens=6 + i % 3) for i in range(len(prompts))]
    runs = {}
    for cascade in (True, False, None):
        engine = make_engine(hf, block_size=4, num_blocks=128, cascade=cascade,
                             max_num_batched_tokens=64, chunked_prefill=True)
        runs[cascade] = engine.generate(prompts, sampling)
        if cascade:
            assert engine.stats.cascade_steps > 0
    assert runs[True] == runs[False] == runs[None]
    assert runs[False][0] == hf_greedy(hf, prompts[0], 6)


@pytest.mark.parametrize("value", [1, "yes", 0.5])
def test_cascade_config_is_checked(value) -> None:
    with pytest.raises(InvalidArgumentError, match="cascade must be None, a bool or a "
                                                   "CascadePolicy"):
        EngineConfig(cascade=value)
