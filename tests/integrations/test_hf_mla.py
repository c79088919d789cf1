"""``LLMEngine`` serving a DeepSeek-V3-shaped model (multi-head latent attention) through
``TransformersForCausalLM`` on a latent cache, against transformers' own greedy generation.

Two random tiny ``DeepseekV3ForCausalLM``s: "v3" as DeepSeek-V3 is built (q LoRA, interleaved
rotary key, yarn rope scaling whose mscale enters the softmax scale, mixture-of-experts layers
after a dense one) and "q_proj" (no q LoRA, rotate-half rotary, default rope, dense layers,
eight heads). In float32 the absorbed attention over the paged latents gives transformers'
tokens for prompts of 3 to 43 tokens and 16 new ones, at block sizes 4, 5 and 16, with prefix
hits, preemption by recompute and by swap, and chunked prefill. bf16 is held to transformers'
own bf16 error; an fp8 latent cache runs and its agreement is reported.
"""

from __future__ import annotations

import pytest
import torch

from pagedkv.errors import InvalidArgumentError
from pagedkv.serving.engine import EngineConfig, LLMEngine, SamplingParams

from helpers import one_thread  # noqa: F401  (autouse)

transformers = pytest.importorskip("transformers")
hf_engine = pytest.importorskip("pagedkv.integrations.hf_engine")

TransformersForCausalLM = hf_engine.TransformersForCausalLM
MAX_TOKENS = 16
_tokens = torch.Generator().manual_seed(7)
LONG = torch.randint(1, 256, (40,), generator=_tokens).tolist()
PROMPTS = [torch.randint(1, 256, (n,), generator=_tokens).tolist() for n in (3, 13)]
PROMPTS += [LONG, LONG + [5, 6, 7]]  # the last extends the long prompt
TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
            n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, n_group=1,
            topk_group=1, max_position_embeddings=256, initializer_range=0.1,
            bos_token_id=None, eos_token_id=None, pad_token_id=None, tie_word_embeddings=False)
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 1.0,
        "mscale_all_dim": 1.0, "original_max_position_embeddings": 64, "beta_fast": 32.0,
        "beta_slow": 1.0}
VARIANTS = {
    "v3": dict(num_hidden_layers=3, first_k_dense_replace=1, num_attention_heads=4,
               q_lora_rank=32, kv_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8,
               v_head_dim=12, rope_interleave=True, rope_parameters=YARN),
    "q_proj": dict(num_hidden_layers=2, first_k_dense_replace=2, num_attention_heads=8,
                   q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=8, qk_rope_head_dim=8,
                   v_head_dim=8, rope_interleave=False,
                   rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
}


def deepseek(variant: str, seed: int = 1, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """A random tiny DeepseekV3ForCausalLM (config only, no download)."""
    torch.manual_seed(seed)
    config = transformers.DeepseekV3Config(**TINY | VARIANTS[variant])
    return transformers.DeepseekV3ForCausalLM(config).eval().to(dtype)


def greedy(hf: torch.nn.Module, prompt: list[int], max_new: int = MAX_TOKENS) -> list[int]:
    out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt)),
                      max_new_tokens=max_new, min_new_tokens=max_new, do_sample=False)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module", params=list(VARIANTS))
def case(request: pytest.FixtureRequest):
    """(a maker of fresh copies of the model, transformers' tokens for each prompt)."""
    expected = [greedy(deepseek(request.param), prompt) for prompt in PROMPTS]
    assert all(len(set(tokens)) >= 4 for tokens in expected)  # not one token repeated
    return (lambda: deepseek(request.param)), expected


def first_step_logits(model: TransformersForCausalLM, config: EngineConfig) -> torch.Tensor:
    """The engine's logits of each prompt's last token ``[len(PROMPTS), vocab]`` (float32): the
    first step prefills every prompt."""
    steps: list[torch.Tensor] = []
    hook = model.register_forward_hook(lambda module, args, out: steps.append(out.float()))
    LLMEngine(model, config).generate(PROMPTS, SamplingParams(max_tokens=1))
    hook.remove()
    assert steps[0].shape[0] == len(PROMPTS)
    return steps[0]


def transformers_logits(hf: torch.nn.Module) -> torch.Tensor:
    with torch.inference_mode():
        return torch.stack([hf(torch.tensor([p])).logits[0, -1].float() for p in PROMPTS])


def agreement(outputs: list[list[int]], expected: list[list[int]]) -> float:
    pairs = [(a, b) for out, exp in zip(outputs, expected, strict=True)
             for a, b in zip(out, exp, strict=True)]
    return sum(a == b for a, b in pairs) / len(pairs)


@pytest.mark.parametrize("block_size", [4, 5, 16])
def test_engine_matches_transformers(case, block_size: int) -> None:
    make, expected = case
    model = TransformersForCausalLM(make())
    engine = LLMEngine(model, EngineConfig(block_size=block_size, num_blocks=128))
    spec = engine.cache.spec
    text = model.hf.config
    assert spec.latent and spec.num_kv_heads == 1
    assert spec.head_size == text.kv_lora_rank + text.qk_rope_head_dim
    assert engine.cache.key_caches == [] and len(engine.cache.latent_caches) == spec.num_layers
    assert engine.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS)) == expected
    assert engine.prefix_hit_rate > 0
    assert engine.manager.allocator.num_used_blocks == 0


def test_an_extended_prompt_hits_the_prefix_cache(case) -> None:
    make, expected = case
    engine = LLMEngine(TransformersForCausalLM(make()), EngineConfig(block_size=4, num_blocks=96))
    params = SamplingParams(max_tokens=MAX_TOKENS)
    assert engine.generate([LONG], params) == [expected[2]]
    second = engine.add_request(PROMPTS[3], params)
    while engine.has_unfinished():
        engine.step()
    assert second.num_cached_tokens == len(LONG)
    assert second.output_token_ids == expected[3]


@pytest.mark.parametrize("num_cpu_blocks", [0, 64])
def test_preemption_matches_transformers(case, num_cpu_blocks: int) -> None:
    make, expected = case
    engine = LLMEngine(TransformersForCausalLM(make()),
                       EngineConfig(block_size=4, num_blocks=17, num_cpu_blocks=num_cpu_blocks))
    assert engine.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS)) == expected
    stats = engine.stats
    assert stats.swaps_out + stats.recomputes > 0
    assert (stats.swaps_out > 0) == bool(num_cpu_blocks)
    assert engine.manager.allocator.num_used_blocks == 0


def test_chunked_prefill_matches_transformers(case) -> None:
    make, expected = case
    engine = LLMEngine(TransformersForCausalLM(make()),
                       EngineConfig(block_size=4, num_blocks=96, max_num_batched_tokens=10,
                                    chunked_prefill=True))
    assert engine.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS)) == expected


def test_the_scale_and_the_rotary_layout_are_the_modules() -> None:
    """First-step logits within 1e-4 of transformers' (float32); the module's ``scaling`` (yarn's
    mscale in it) and ``rope_interleave`` are what the attention uses: changing either, for
    transformers and the engine alike, keeps them equal, while the engine alone moving to the
    unscaled ``qk_head_dim ** -0.5`` or to the other rotary layout moves them far more."""
    hf = deepseek("v3")
    config = EngineConfig(block_size=5, num_blocks=64)
    expected = transformers_logits(hf)
    assert (first_step_logits(TransformersForCausalLM(deepseek("v3")), config)
            - expected).abs().max() < 1e-4
    unscaled = TransformersForCausalLM(deepseek("v3"))
    for layer in unscaled.hf.model.layers:
        layer.self_attn.scaling = layer.self_attn.qk_head_dim ** -0.5
    assert (first_step_logits(unscaled, config) - expected).abs().max() > 1e-2
    flipped = TransformersForCausalLM(deepseek("v3"))
    flipped.hf.config.rope_interleave = False
    assert (first_step_logits(flipped, config) - expected).abs().max() > 1e-2
    hf.config.rope_interleave = False
    assert (first_step_logits(flipped, config) - transformers_logits(hf)).abs().max() < 1e-4


def test_bf16_is_within_transformers_own_bf16_error() -> None:
    """bf16 rounds the absorbed query, not the up-projected keys, so tokens may part from
    transformers' bf16 ones (as those part from float32's); the first-step logits' error against
    the float32 model is at most twice transformers' own bf16 error."""
    exact = transformers_logits(deepseek("v3"))
    theirs = (transformers_logits(deepseek("v3", dtype=torch.bfloat16)) - exact).abs().max()
    ours = (first_step_logits(TransformersForCausalLM(deepseek("v3", dtype=torch.bfloat16)),
                              EngineConfig(block_size=4, num_blocks=64)) - exact).abs().max()
    print(f"bf16 first-step logits, max error vs float32: pagedkv {ours:.4f}, "
          f"transformers {theirs:.4f}")
    assert 0 < ours < 2 * theirs


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_an_fp8_latent_cache_serves(case, cache_dtype: torch.dtype) -> None:
    """fp8 latents (scale 1): tokens reported as their agreement with float32 transformers."""
    make, expected = case
    engine = LLMEngine(TransformersForCausalLM(make()),
                       EngineConfig(block_size=4, num_blocks=96, cache_dtype=cache_dtype))
    assert engine.cache.latent(0).dtype == cache_dtype and len(engine.cache.k_scales) > 0
    outputs = engine.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS))
    assert [len(out) for out in outputs] == [MAX_TOKENS] * len(PROMPTS)
    rate = agreement(outputs, expected)
    print(f"fp8 ({cache_dtype}) latent cache: {rate:.0%} of tokens equal float32 transformers'")
    assert engine.manager.allocator.num_used_blocks == 0


def test_the_cache_write_under_simt_matches_transformers() -> None:
    """``concat_and_cache_mla`` from the CUDA kernels' source, emulated on the CPU (a float32
    model: its attention runs on the CPU kernels, the tensor-core MLA kernel takes 16-bit
    queries)."""
    from pagedkv.ops import simt

    if not simt.available():
        pytest.skip("pagedkv built without the simt emulator")
    prompts = [PROMPTS[1], LONG[:21]]
    expected = [greedy(deepseek("v3"), p, 6) for p in prompts]
    model = TransformersForCausalLM(deepseek("v3")).use_kernels(simt.ops)
    engine = LLMEngine(model, EngineConfig(block_size=4, num_blocks=64))
    assert engine.generate(prompts, SamplingParams(max_tokens=6)) == expected


def test_bf16_attention_under_simt_is_within_transformers_own_bf16_error() -> None:
    """The cache write and the tensor-core MLA kernel from the CUDA source, emulated: bf16
    first-step logits within twice transformers' own bf16 error of the float32 model's."""
    from pagedkv.ops import simt

    if not simt.available():
        pytest.skip("pagedkv built without the simt emulator")
    exact = transformers_logits(deepseek("v3"))
    theirs = (transformers_logits(deepseek("v3", dtype=torch.bfloat16)) - exact).abs().max()
    model = TransformersForCausalLM(deepseek("v3", dtype=torch.bfloat16)).use_kernels(simt.ops)
    with simt.profile() as prof:
        ours = (first_step_logits(model, EngineConfig(block_size=4, num_blocks=64))
                - exact).abs().max()
    print(f"bf16 first-step logits under simt, max error vs float32: pagedkv {ours:.4f}, "
          f"transformers {theirs:.4f}")
    assert any("mla_attention_tc_kernel" in launch["kernel"] for launch in prof.launches)
    assert 0 < ours < 2 * theirs


def test_the_wrapped_model_still_runs_transformers_attention() -> None:
    """Without an engine step the modules run their own forward: back on sdpa, ``generate``
    gives its tokens as before; wrapping twice takes over each forward once."""
    hf = deepseek("q_proj")
    expected = greedy(hf, PROMPTS[1])
    TransformersForCausalLM(hf)
    TransformersForCausalLM(hf)
    for layer in hf.model.layers:
        own = layer.self_attn.forward.args[1]  # the partial's (module, own forward)
        assert own.__self__ is layer.self_attn and own.__func__ is type(layer.self_attn).forward
    hf.set_attn_implementation("sdpa")
    assert greedy(hf, PROMPTS[1]) == expected


def test_other_latent_attention_is_refused() -> None:
    """A DeepSeek-V2 (complex rotary) is refused by name before its attention is switched."""
    torch.manual_seed(0)
    config = transformers.DeepseekV2Config(
        vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, kv_lora_rank=8, q_lora_rank=None, qk_nope_head_dim=4,
        qk_rope_head_dim=4, v_head_dim=4, first_k_dense_replace=1)
    v2 = transformers.DeepseekV2ForCausalLM(config).eval()
    with pytest.raises(InvalidArgumentError, match="DeepseekV2Attention"):
        TransformersForCausalLM(v2)
    assert v2.config._attn_implementation != "pagedkv"
