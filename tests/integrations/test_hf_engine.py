"""``LLMEngine`` serving transformers models through ``TransformersForCausalLM``, against
transformers' own greedy generation.

Random tiny gpt-oss (mixture of experts, attention sinks, biases), Gemma 2 (soft caps) and
Gemma 3 (text; two window layers per full layer) whose window layers see 8 tokens: prompts of
up to 43 tokens and 16 new ones span seven windows, so the hybrid manager frees blocks of the
window groups as requests grow, and a prompt that extends another hits the prefix cache in
every group past the window. Preemption (recompute and swap) and chunked prefill on a pool too
small for the batch.
"""

from __future__ import annotations

import pytest
import torch

from pagedkv.blocks.hybrid import HybridBlockManager
from pagedkv.errors import InvalidArgumentError
from pagedkv.serving.engine import EngineConfig, LLMEngine, SamplingParams
from pagedkv.serving.model import LlamaForCausalLM

from helpers import generate_within_windows, one_thread, tiny_hf_model  # noqa: F401

transformers = pytest.importorskip("transformers")
hf_engine = pytest.importorskip("pagedkv.integrations.hf_engine")

from test_hf_hybrid import WINDOW, gemma2, gemma3, gpt_oss  # noqa: E402

TransformersForCausalLM = hf_engine.TransformersForCausalLM
MAX_TOKENS = 16
_tokens = torch.Generator().manual_seed(7)
LONG = torch.randint(1, 256, (40,), generator=_tokens).tolist()  # five windows
PROMPTS = [torch.randint(1, 256, (n,), generator=_tokens).tolist() for n in (3, 13)]
PROMPTS += [LONG, LONG + [5, 6, 7]]  # the last extends the long prompt
# Gemma with untied embeddings: tied ones make a tiny random Gemma repeat one token
FAMILIES = {"gpt-oss": (gpt_oss, "eager"),
            "gemma2": (lambda seed: gemma2(seed, tie_word_embeddings=False), "eager"),
            "gemma3": (lambda seed: gemma3(seed, tie_word_embeddings=False), "sdpa")}


def greedy(hf: torch.nn.Module, prompt: list[int], max_new: int = MAX_TOKENS) -> list[int]:
    out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt)),
                      max_new_tokens=max_new, min_new_tokens=max_new, do_sample=False)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module", params=list(FAMILIES))
def case(request: pytest.FixtureRequest):
    """(a maker of fresh copies of the model, transformers' tokens for each prompt)."""
    make, attention = FAMILIES[request.param]
    seed = 20 + list(FAMILIES).index(request.param)
    hf = make(seed)
    hf.set_attn_implementation(attention)
    expected = [greedy(hf, prompt) for prompt in PROMPTS]
    assert all(len(set(tokens)) >= 4 for tokens in expected)  # not one token repeated
    return (lambda: make(seed)), expected


def run(engine: LLMEngine) -> list[list[int]]:
    """Greedy outputs per prompt, the window groups' blocks checked after every step."""
    return generate_within_windows(engine, PROMPTS, MAX_TOKENS)


@pytest.mark.parametrize("block_size", [4, 5])
def test_engine_matches_transformers(case, block_size: int) -> None:
    make, expected = case
    model = TransformersForCausalLM(make())
    engine = LLMEngine(model, EngineConfig(block_size=block_size, num_blocks=128))
    assert isinstance(engine.manager, HybridBlockManager)
    assert set(engine.manager.group_windows) == {WINDOW, None}
    assert run(engine) == expected
    assert engine.prefix_hit_rate > 0
    assert engine.manager.allocator.num_used_blocks == 0


def test_an_extended_prompt_hits_in_every_group(case) -> None:
    make, expected = case
    engine = LLMEngine(TransformersForCausalLM(make()), EngineConfig(block_size=4, num_blocks=96))
    params = SamplingParams(max_tokens=MAX_TOKENS)
    assert engine.generate([LONG], params) == [expected[2]]
    second = engine.add_request(PROMPTS[3], params)
    while engine.has_unfinished():
        engine.step()
    assert second.num_cached_tokens == len(LONG) > 4 * WINDOW
    assert second.output_token_ids == expected[3]


@pytest.mark.parametrize("num_cpu_blocks", [0, 64])
def test_preemption_matches_transformers(case, num_cpu_blocks: int) -> None:
    make, expected = case
    model = TransformersForCausalLM(make())
    groups = len(model.kv_cache_spec(4, torch.float32).group_windows)
    engine = LLMEngine(model, EngineConfig(block_size=4, num_blocks=16 * groups + 1,
                                           num_cpu_blocks=num_cpu_blocks))
    assert run(engine) == expected
    stats = engine.stats
    assert stats.swaps_out + stats.recomputes > 0
    assert (stats.swaps_out > 0) == bool(num_cpu_blocks)
    assert engine.manager.allocator.num_used_blocks == 0


def test_chunked_prefill_matches_transformers(case) -> None:
    make, expected = case
    engine = LLMEngine(TransformersForCausalLM(make()),
                       EngineConfig(block_size=4, num_blocks=96, max_num_batched_tokens=10,
                                    chunked_prefill=True))
    assert run(engine) == expected


def test_cuda_kernel_source_under_simt_matches_transformers() -> None:
    """gpt-oss (sinks, windows) with the CUDA kernels' source, emulated on the CPU."""
    from pagedkv.ops import simt

    if not simt.available():
        pytest.skip("pagedkv built without the simt emulator")
    hf = gpt_oss(20)
    hf.set_attn_implementation("eager")
    prompts = [PROMPTS[1], LONG[:21]]
    expected = [greedy(hf, p, 6) for p in prompts]
    model = TransformersForCausalLM(hf).use_kernels(simt.ops)
    engine = LLMEngine(model, EngineConfig(block_size=4, num_blocks=64))
    assert engine.generate(prompts, SamplingParams(max_tokens=6)) == expected


@pytest.mark.parametrize("cache_dtype", [None, torch.float8_e4m3fn, "int8", "int4"])
def test_a_llama_serves_as_the_hand_written_model(cache_dtype) -> None:
    """Both serving models of one Llama give the same tokens (fp8 cache: the same scales;
    int8, int4: the same rows and row scales)."""
    hf = tiny_hf_model(seed=4)
    config = EngineConfig(block_size=4, num_blocks=64, cache_dtype=cache_dtype)
    ours = LLMEngine(LlamaForCausalLM.from_hf(hf), config).generate(
        PROMPTS, SamplingParams(max_tokens=8))
    theirs = LLMEngine(TransformersForCausalLM(hf), config).generate(
        PROMPTS, SamplingParams(max_tokens=8))
    assert theirs == ours
    if cache_dtype is None:
        assert theirs == [greedy(tiny_hf_model(seed=4), p, 8) for p in PROMPTS]


def test_a_layer_asking_for_another_window_is_refused() -> None:
    """The manager frees blocks by the config's windows: a layer that attends wider would read
    freed blocks, so the step raises (naming the layer) instead."""
    hf = gpt_oss(3)
    model = TransformersForCausalLM(hf)
    hf.model.layers[0].self_attn.sliding_window = 2 * WINDOW
    engine = LLMEngine(model, EngineConfig(block_size=4, num_blocks=64))
    with pytest.raises(RuntimeError, match="layer 0 attends with sliding_window 16"):
        engine.generate([PROMPTS[1]], SamplingParams(max_tokens=2))


def test_models_it_cannot_serve_are_refused() -> None:
    with pytest.raises(InvalidArgumentError, match="must be a transformers model"):
        TransformersForCausalLM(torch.nn.Linear(2, 2))
    bidirectional = gemma3(1, use_bidirectional_attention=True)
    with pytest.raises(InvalidArgumentError, match="bidirectionally"):
        TransformersForCausalLM(bidirectional)
    chunked = gemma3(1)
    chunked.config.layer_types = ["chunked_attention"] + chunked.config.layer_types[1:]
    with pytest.raises(InvalidArgumentError, match="unsupported layer types"):
        TransformersForCausalLM(chunked)
    assert chunked.config._attn_implementation != "pagedkv"  # refused before it was switched
