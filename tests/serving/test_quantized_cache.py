"""The engine over caches quantized per token and head (int8, int4, fp8): budgets, preemption by
swap (rows and scales leave and come back), and the formats' end-to-end accuracy on the tiny
random model (bench/bench_kv_accuracy.py measures it; here, loose bounds that a format whose
scales were lost, or mixed up between rows, would break)."""

from __future__ import annotations

import sys

import pytest
import torch

from pagedkv.errors import InvalidArgumentError
from pagedkv.serving.engine import EngineConfig, LLMEngine, SamplingParams
from pagedkv.serving.model import LlamaForCausalLM

from helpers import ROOT, one_thread, tiny_hf_model  # noqa: F401  (one_thread: autouse)

pytest.importorskip("transformers")
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import bench_kv_accuracy as accuracy  # noqa: E402

TOKEN_SCALED = ["int8", "int4", "fp8_e4m3_per_token_head", "fp8_e5m2_per_token_head"]
SYSTEM = [7, 3, 99, 42, 17, 250, 8, 64, 5, 11, 200, 31, 90]
PROMPTS = [SYSTEM + [1, 2], [5, 6, 7], SYSTEM + [40, 41, 42, 43, 44, 45], list(range(60, 79)),
           [9], SYSTEM + [2]]
MAX_TOKENS = [10, 4, 12, 7, 9, 11]


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    return LlamaForCausalLM.from_hf(tiny_hf_model(seed=3))


def serve(model: LlamaForCausalLM, **config) -> LLMEngine:
    engine = LLMEngine(model, EngineConfig(**config))
    engine.outputs = engine.generate(PROMPTS, [SamplingParams(max_tokens=n) for n in MAX_TOKENS])
    return engine


@pytest.mark.parametrize("cache_dtype", TOKEN_SCALED)
def test_swapped_requests_come_back_with_their_scales(model, cache_dtype) -> None:
    """Preempted by swap on a pool too small for the batch, then swapped in: the same tokens as
    a pool that holds everything (prefix hits read the shared rows and their scales)."""
    roomy = serve(model, block_size=4, num_blocks=64, cache_dtype=cache_dtype)
    tight = serve(model, block_size=4, num_blocks=16, num_cpu_blocks=64, cache_dtype=cache_dtype)
    assert tight.stats.swaps_out > 0 and tight.stats.recomputes == 0
    assert roomy.prefix_hit_rate > 0.3
    assert tight.outputs == roomy.outputs
    assert tight.cache.spec.token_scaled and tight.cpu_cache.key_cache_scales


@pytest.mark.parametrize("cache_dtype, row_bytes", [
    (None, 64), ("int8", 20), ("int4", 12), ("fp8_e4m3_per_token_head", 20),
    (torch.float8_e4m3fn, 16)])
def test_a_byte_budget_holds_more_blocks_of_a_smaller_format(model, cache_dtype, row_bytes):
    """kv_cache_bytes buys blocks of the format's bytes: head_size 16, float32 rows of 64 B,
    int8 16 + a 4-byte scale, int4 8 + 4."""
    budget = 2**20
    engine = LLMEngine(model, EngineConfig(block_size=8, num_blocks=None, kv_cache_bytes=budget,
                                           cache_dtype=cache_dtype))
    spec = engine.cache.spec
    assert spec.row_bytes == row_bytes
    assert spec.bytes_per_block == 2 * 2 * 2 * 8 * row_bytes  # K/V x layers x heads x tokens
    assert engine.cache.num_blocks == budget // spec.bytes_per_block
    assert engine.cache.nbytes <= budget < engine.cache.nbytes + spec.bytes_per_block


def test_engine_config_refuses_an_unknown_cache_dtype() -> None:
    with pytest.raises(InvalidArgumentError, match="cache_dtype must be a torch dtype or one of"):
        EngineConfig(cache_dtype="int3")
    with pytest.raises(InvalidArgumentError, match="pass 'int4'"):
        EngineConfig(cache_dtype=torch.uint8)


@pytest.fixture(scope="module")
def measured() -> dict[str, dict[str, float]]:
    """bench_kv_accuracy's figures on the tests' tiny model, 48 tokens per prompt."""
    model = accuracy.random_model(accuracy.tiny_config(128))
    return accuracy.measure(model, 48, ["int8", "fp8_e4m3_per_token_head", "int4",
                                        "float8_e4m3fn"])


# (format, least teacher-forced greedy agreement, largest mean logit error), loose: measured here
# int8 99.5% / 0.0075, fp8 per token-head 95.3% / 0.036, int4 76.6% / 0.15, per-tensor fp8
# 93.2% / 0.042; every layer reading layer 0's scales gives int8 43% / 0.42.
BOUNDS = [("int8", 0.94, 0.02), ("fp8_e4m3_per_token_head", 0.85, 0.07), ("int4", 0.6, 0.3),
          ("float8_e4m3fn", 0.8, 0.08)]


@pytest.mark.parametrize("name, agreement, error", BOUNDS, ids=[b[0] for b in BOUNDS])
def test_end_to_end_error_is_within_the_formats_bounds(measured, name, agreement, error):
    r = measured[name]
    assert r["finite"]
    assert r["agreement"] >= agreement and r["mean_err"] <= error, r
    assert r["first_err"] <= 1.5 * error  # the prefill, already over the quantized cache
    assert 0 < r["mean_err"]  # a quantized cache is not the float32 one


def test_more_bits_give_less_error(measured) -> None:
    """int8 carries 16x the levels of int4: its error is several times smaller."""
    assert measured["int8"]["mean_err"] * 4 < measured["int4"]["mean_err"]
    assert measured["int8"]["agreement"] > measured["int4"]["agreement"]


def test_outlier_channels_cost_int4_most() -> None:
    """K/V with outlier channels (the same function): a row's absmax is its outlier, the int4
    step 1/7 of it, and most of the row rounds to 0; fp8's relative step does not care."""
    model = accuracy.with_outliers(accuracy.random_model(accuracy.tiny_config(64)))
    r = accuracy.measure(model, 16, ["int4", "fp8_e4m3_per_token_head"])
    assert r["int4"]["mean_err"] > 3 * r["fp8_e4m3_per_token_head"]["mean_err"]
    plain = accuracy.random_model(accuracy.tiny_config(64))
    prompts = accuracy.make_prompts(256)
    a, b = (accuracy.generate(m, prompts, 4, None) for m in (model, plain))
    torch.testing.assert_close(a.logits, b.logits, rtol=1e-4, atol=1e-4)  # the same function
