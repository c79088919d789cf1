"""pagedkv.serving.model against Hugging Face transformers on the same random weights.

The model runs through the block manager, its cache plans and the paged ops directly (no engine):
one varlen prefill of every prompt, then batched decode steps. float32 must give HF's greedy
tokens exactly; bfloat16 logits must be as close to HF's float32 logits as HF's own bfloat16
logits are (x2).
"""

from __future__ import annotations

import pytest
import torch

from pagedkv.blocks.allocator import NULL_BLOCK
from pagedkv.blocks.manager import BlockManager
from pagedkv.blocks.plan import PlanExecutor
from pagedkv.cache.paged_cache import PagedKVCache
from pagedkv.serving.model import LlamaForCausalLM, ModelConfig

from helpers import one_thread, tiny_hf_model  # noqa: F401  (one_thread: autouse)

transformers = pytest.importorskip("transformers")

SHARED = [7, 3, 99, 42, 17, 250, 8, 64, 5, 11, 200, 31]  # a 12-token "system prompt"
PROMPTS = [[1], [9, 8, 7, 6, 5], SHARED + [13, 14, 15], list(range(30, 51)), SHARED + [77]]
MAX_NEW = 8

CONFIGS = {
    "gqa": {},
    "tied-llama3-mha-bias": dict(
        num_key_value_heads=4, tie_word_embeddings=True, attention_bias=True,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 16}),
    "mqa-head64": dict(num_attention_heads=2, num_key_value_heads=1, head_dim=64),
}


def hf_greedy(hf: torch.nn.Module, prompt: list[int], max_new: int) -> list[int]:
    out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt)),
                      max_new_tokens=max_new, min_new_tokens=max_new, do_sample=False)
    return out[0, len(prompt):].tolist()


def paged_generate(model: LlamaForCausalLM, prompts: list[list[int]], max_new: int,
                   block_size: int = 4, forced: list[list[int]] | None = None,
                   cache_dtype: torch.dtype | None = None,
                   ) -> tuple[list[list[int]], torch.Tensor]:
    """Greedy tokens per prompt and logits ``[steps, num_prompts, vocab]``.

    With ``forced``, those tokens are fed instead of the argmax (teacher forcing). The manager
    runs with ``debug_nan``: its plans NaN-fill every fresh block (and the null block) before the
    model runs, so a read of a slot that no token wrote (padding, a stale block) shows up as NaN
    logits.
    """
    param = next(model.parameters())
    spec = model.config.kv_cache_spec(block_size, param.dtype, cache_dtype)
    cache = PagedKVCache(spec, num_blocks=128, device=param.device)
    manager = BlockManager(cache.num_blocks, cache.spec.block_size, enable_prefix_caching=False,
                           debug_nan=True)
    executor = PlanExecutor(cache)
    ids = list(range(len(prompts)))
    for i, prompt in enumerate(prompts):
        manager.add_sequence(i, prompt)
    tokens, query_lens, steps = [list(p) for p in prompts], [len(p) for p in prompts], []
    for step in range(max_new):
        batch = manager.build_batch(ids, query_lens, device=param.device)
        plan = executor.run(manager)  # NaN fills of the fresh blocks, before the kernels
        if step == 0:
            assert set(plan.poison) == {NULL_BLOCK, *(b for i in ids
                                                     for b in manager.block_table(i))}
        pairs = list(zip(tokens, query_lens, strict=True))
        input_ids = torch.tensor([t for seq, q in pairs for t in seq[-q:]])
        positions = torch.cat([torch.arange(len(seq) - q, len(seq)) for seq, q in pairs])
        with torch.no_grad():
            logits = model(input_ids.to(param.device), positions.to(param.device), cache, batch,
                           batch.query_start_loc[1:] - 1)
        steps.append(logits.float().cpu())
        chosen = logits.argmax(-1).tolist() if forced is None else [f[step] for f in forced]
        for i, token in enumerate(chosen):
            tokens[i].append(token)
            manager.append_tokens(i, token)
        query_lens = [1] * len(prompts)
    executor.run(manager)
    _assert_unwritten_slots_are_nan(cache, manager, [len(seq) - 1 for seq in tokens])
    return [seq[len(p):] for seq, p in zip(tokens, prompts, strict=True)], torch.stack(steps)


def _assert_unwritten_slots_are_nan(cache: PagedKVCache, manager: BlockManager,
                                    num_written: list[int]) -> None:
    """The slots of each sequence's blocks past its ``num_written`` tokens, and the null block,
    hold the plans' NaN fill (so the fill did run: a read of them would have shown)."""
    size = cache.spec.block_size
    key, value = (c.float() for c in cache.layer(0))
    assert key[NULL_BLOCK].isnan().all() and value[NULL_BLOCK].isnan().all()
    for seq_id, written in enumerate(num_written):
        table = manager.block_table(seq_id)
        for pos in range(written, len(table) * size):
            block, slot = table[pos // size], pos % size
            assert key[block, :, slot].isnan().all(), (seq_id, pos)
            assert value[block, :, slot].isnan().all(), (seq_id, pos)
        assert not key[table[(written - 1) // size], :, (written - 1) % size].isnan().any()


def hf_step_logits(hf: torch.nn.Module, prompt: list[int], new: list[int]) -> torch.Tensor:
    """HF logits ``[len(new), vocab]`` predicting each of ``new`` (teacher forced)."""
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + new[:-1]])).logits[0].float()
    return logits[len(prompt) - 1:]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_float32_matches_hf_generate(name: str) -> None:
    hf = tiny_hf_model(**CONFIGS[name])
    model = LlamaForCausalLM.from_hf(hf)
    ours, logits = paged_generate(model, PROMPTS, MAX_NEW)
    for i, prompt in enumerate(PROMPTS):
        assert ours[i] == hf_greedy(hf, prompt, MAX_NEW), f"prompt {i}"
        torch.testing.assert_close(logits[:, i], hf_step_logits(hf, prompt, ours[i]),
                                   atol=1e-4, rtol=1e-4)


def test_cuda_kernel_source_under_simt_matches_hf() -> None:
    """The CUDA kernels (reshape_and_cache, paged_attention), emulated on the CPU."""
    from pagedkv.ops import simt
    if not simt.available():
        pytest.skip("pagedkv built without the simt emulator")
    hf = tiny_hf_model(**CONFIGS["gqa"])
    model = LlamaForCausalLM.from_hf(hf).use_kernels(simt.ops)
    ours, _ = paged_generate(model, PROMPTS[1:4], 4)
    assert ours == [hf_greedy(hf, prompt, 4) for prompt in PROMPTS[1:4]]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_matches_hf_on_cpu() -> None:
    hf = tiny_hf_model(**CONFIGS["gqa"])
    model = LlamaForCausalLM.from_hf(hf).cuda()
    ours, logits = paged_generate(model, PROMPTS, MAX_NEW)
    for i, prompt in enumerate(PROMPTS):
        assert ours[i] == hf_greedy(hf, prompt, MAX_NEW), f"prompt {i}"
        torch.testing.assert_close(logits[:, i], hf_step_logits(hf, prompt, ours[i]),
                                   atol=1e-4, rtol=1e-4)


def test_prefill_on_prefix_hit_matches_hf() -> None:
    hf = tiny_hf_model(seed=1)
    model = LlamaForCausalLM.from_hf(hf)
    cache = PagedKVCache(model.config.kv_cache_spec(4), num_blocks=32)
    manager = BlockManager(cache.num_blocks, cache.spec.block_size)
    executor = PlanExecutor(cache)
    first, second = SHARED + [1, 2], SHARED + [3, 4, 5]
    for seq_id, prompt in enumerate((first, second)):
        cached = manager.add_sequence(seq_id, prompt)
        batch = manager.build_batch([seq_id], len(prompt) - cached)
        assert not executor.run(manager)  # nothing to copy, swap or fill here
        with torch.no_grad():
            logits = model(torch.tensor(prompt[cached:]), torch.arange(cached, len(prompt)),
                           cache, batch)
        with torch.no_grad():
            expected = hf(torch.tensor([prompt])).logits[0, cached:]
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
    assert cached == len(SHARED)


def assert_bf16_logits_close(hf: torch.nn.Module, ours: torch.Tensor,
                             greedy: list[list[int]]) -> None:
    """Stated tolerance: max |ours_bf16 - hf_fp32| <= 2 * max |hf_bf16 - hf_fp32| + 0.02 at every
    step of every prompt (``ours``: bf16 logits forced along the float32 greedy tokens)."""
    hf_bf16 = tiny_hf_model(**CONFIGS["gqa"]).to(torch.bfloat16)
    for i, prompt in enumerate(PROMPTS):
        exact = hf_step_logits(hf, prompt, greedy[i])
        ours_err = (ours[:, i] - exact).abs().max().item()
        hf_err = (hf_step_logits(hf_bf16, prompt, greedy[i]) - exact).abs().max().item()
        assert ours_err <= 2 * hf_err + 0.02, (i, ours_err, hf_err)


def test_bfloat16_logits_close_to_hf() -> None:
    """Stated tolerance: max |ours_bf16 - hf_fp32| <= 2 * max |hf_bf16 - hf_fp32| + 0.02."""
    hf = tiny_hf_model(**CONFIGS["gqa"])
    greedy, _ = paged_generate(LlamaForCausalLM.from_hf(hf), PROMPTS, MAX_NEW)
    model = LlamaForCausalLM.from_hf(hf, dtype=torch.bfloat16)
    _, ours = paged_generate(model, PROMPTS, MAX_NEW, forced=greedy)
    assert_bf16_logits_close(hf, ours, greedy)


@pytest.mark.parametrize("cache_dtype,tolerance", [(torch.float8_e4m3fn, 0.1),
                                                   (torch.float8_e5m2, 0.2)])
def test_fp8_kv_cache_logits_close(cache_dtype: torch.dtype, tolerance: float) -> None:
    """fp8 K/V (scale 1): max logit error within ``tolerance`` x the largest |logit|."""
    model = LlamaForCausalLM.from_hf(tiny_hf_model(**CONFIGS["gqa"]))
    greedy, exact = paged_generate(model, PROMPTS, MAX_NEW)
    _, ours = paged_generate(model, PROMPTS, MAX_NEW, forced=greedy, cache_dtype=cache_dtype)
    assert (ours - exact).abs().max() <= tolerance * exact.abs().max()


def test_config_from_hf_and_tied_state_dict() -> None:
    hf = tiny_hf_model(**CONFIGS["tied-llama3-mha-bias"])
    config = ModelConfig.from_hf(hf.config)
    assert config.rope_scaling["rope_type"] == "llama3" and config.rope_theta == 500000.0
    model = LlamaForCausalLM(config)
    state = {k: v for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    model.load_hf_state_dict(state)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    torch.testing.assert_close(model.model.rotary_emb.inv_freq, hf.model.rotary_emb.inv_freq)
