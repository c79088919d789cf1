"""pagedkv.integrations.hf inside transformers ``generate``, against transformers' own output.

Random-init tiny Llama models in float32: ``generate`` with ``PagedCache`` and the "pagedkv"
attention must give exactly the tokens of the default path (sdpa or eager with a DynamicCache):
greedy and beam search, left-padded batches of different lengths, prompts sharing a prefix,
continuation of a cache. The caches run with ``debug_nan``: fresh blocks hold NaN until written,
so a read of padding or of an unwritten slot would show up.
"""

from __future__ import annotations

import pytest
import torch

from pagedkv.errors import OutOfBlocksError

from helpers import one_thread, tiny_hf_model  # noqa: F401  (one_thread: autouse)

transformers = pytest.importorskip("transformers")
hf = pytest.importorskip("pagedkv.integrations.hf")

PAD = 0
SHARED = [7, 3, 99, 42, 17, 250, 8, 64, 5, 11, 200, 31]  # a 12-token "system prompt"
PROMPTS = [SHARED + [13, 14, 15], [9, 8, 7, 6, 5], list(range(30, 51)), SHARED + [77], [1]]
CONFIGS = {
    "gqa": {},
    "mha-bias": dict(num_key_value_heads=4, attention_bias=True),
    "mqa-head64": dict(num_attention_heads=2, num_key_value_heads=1, head_dim=64),
}


def tiny_model(seed: int = 0, **overrides) -> torch.nn.Module:
    """A random LlamaForCausalLM from a tiny config (no download), padding with PAD."""
    return tiny_hf_model(seed, pad_token_id=PAD, **overrides)


def left_padded(prompts: list[list[int]]) -> dict[str, torch.Tensor]:
    """input_ids and attention_mask as a tokenizer with padding_side="left" makes them."""
    width = max(map(len, prompts))
    ids = [[PAD] * (width - len(p)) + p for p in prompts]
    mask = [[0] * (width - len(p)) + [1] * len(p) for p in prompts]
    return {"input_ids": torch.tensor(ids), "attention_mask": torch.tensor(mask)}


def generate(model, inputs, attn: str, cache=None, **kwargs) -> torch.Tensor:
    """The new tokens of ``model.generate`` under attention ``attn``."""
    model.set_attn_implementation(attn)
    kwargs = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False) | kwargs
    with torch.no_grad():
        out = model.generate(**inputs, cache=cache, **kwargs)
    return out[:, inputs["input_ids"].shape[1]:]


def paged(model, num_blocks: int = 128, block_size: int = 4, **kwargs) -> hf.PagedCache:
    return hf.PagedCache(model, num_blocks, block_size, debug_nan=True, **kwargs)


@pytest.mark.parametrize("config", CONFIGS, ids=str)
@pytest.mark.parametrize("reference", ["sdpa", "eager"])
def test_greedy_batch_equals_transformers(config, reference):
    model = tiny_model(**CONFIGS[config])
    inputs = left_padded(PROMPTS)
    expected = generate(model, inputs, reference)
    assert torch.equal(generate(model, inputs, "pagedkv", paged(model)), expected)


@pytest.mark.parametrize("block_size", [1, 5, 16])
def test_greedy_block_sizes(block_size):
    model = tiny_model(seed=1)
    inputs = left_padded(PROMPTS[:4])
    expected = generate(model, inputs, "sdpa", max_new_tokens=20, min_new_tokens=20)
    got = generate(model, inputs, "pagedkv", paged(model, block_size=block_size),
                   max_new_tokens=20, min_new_tokens=20)
    assert torch.equal(got, expected)


def test_last_logits_match_sdpa():
    """One forward of a left-padded batch: the last column's logits (every row's last real
    token) agree with sdpa to float32 rounding. Without position_ids the model counts columns,
    so the two prompts that start with SHARED hold it at different positions: their rotary K
    differ, and the prefix cache must not share those blocks."""
    model = tiny_model(seed=2)
    inputs = left_padded(PROMPTS)
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        expected = model(**inputs).logits[:, -1]
        model.set_attn_implementation("pagedkv")
        got = model(**inputs, cache=paged(model)).logits[:, -1]
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("num_beams", [2, 4])
def test_beam_search_equals_transformers(num_beams):
    model = tiny_model(seed=3)
    inputs = left_padded(PROMPTS[:3])
    kwargs = dict(num_beams=num_beams, num_return_sequences=num_beams, max_new_tokens=10,
                  min_new_tokens=10)
    expected = generate(model, inputs, "sdpa", **kwargs)
    cache = paged(model)
    copies = []
    copy_blocks = cache.kv.copy_blocks
    cache.kv.copy_blocks = lambda pairs: (copies.append(len(pairs)), copy_blocks(pairs))
    assert torch.equal(generate(model, inputs, "pagedkv", cache, **kwargs), expected)
    rows = len(PROMPTS[:3]) * num_beams
    # Reordering forks block tables: a step copies at most the shared last block of each row
    # (copy-on-write), never a whole cache; beams that diverged did copy.
    assert copies and max(copies) <= rows
    assert sum(copies) < rows * 10


@pytest.mark.parametrize("cache_dtype", ["int8", "int4", "fp8_e4m3_per_token_head",
                                         torch.float8_e4m3fn])
def test_a_quantized_cache_serves_greedy_and_beam_search(cache_dtype):
    """Greedy tokens close to the float32 cache's; beam search forks block tables and copies
    shared last blocks (copy-on-write) with their scales: under debug_nan a copy without its
    scales would read the NaN of a fresh block."""
    model = tiny_model(seed=3)
    inputs = left_padded(PROMPTS[:4])
    expected = generate(model, inputs, "pagedkv", paged(model), max_new_tokens=16,
                        min_new_tokens=16)
    cache = paged(model, cache_dtype=cache_dtype)
    got = generate(model, inputs, "pagedkv", cache, max_new_tokens=16, min_new_tokens=16)
    assert cache.kv.spec.kv_dtype != torch.float32 and cache.used_bytes > 0
    least = 0.5 if cache_dtype == "int4" else 0.75  # first tokens, before errors compound
    assert (got[:, 0] == expected[:, 0]).float().mean() >= least
    beams = paged(model, cache_dtype=cache_dtype)
    copies = []
    copy_blocks = beams.kv.copy_blocks
    beams.kv.copy_blocks = lambda pairs: (copies.append(len(pairs)), copy_blocks(pairs))
    model.set_attn_implementation("pagedkv")
    with torch.no_grad():
        out = model.generate(**inputs, cache=beams, num_beams=3, max_new_tokens=10,
                             min_new_tokens=10, do_sample=False, output_scores=True,
                             return_dict_in_generate=True)
    assert sum(copies) > 0
    assert all(score.isfinite().any(-1).all() for score in out.scores)


def test_sampling_several_sequences_equals_transformers():
    """Sampling with num_return_sequences: the rows are copies of each prompt (sharing its full
    blocks); with one seed both paths draw the same tokens."""
    model = tiny_model(seed=8)
    inputs = left_padded(PROMPTS[:3])
    kwargs = dict(do_sample=True, num_return_sequences=3, top_k=0, max_new_tokens=10,
                  min_new_tokens=10)
    torch.manual_seed(1)
    expected = generate(model, inputs, "sdpa", **kwargs)
    torch.manual_seed(1)
    cache = paged(model)
    assert torch.equal(generate(model, inputs, "pagedkv", cache, **kwargs), expected)
    assert cache.manager.prefix_cache.stats.hit_tokens > 0


def test_beams_share_the_prompt_blocks():
    """The beams of one prompt are copies of it: they share its full blocks at the prefill, and
    after the first step every beam is a fork of the first one (one block table)."""
    model = tiny_model(seed=3)
    prompt = list(range(40, 61))  # 21 tokens: 5 full blocks of 4
    cache = paged(model)
    generate(model, left_padded([prompt]), "pagedkv", cache, num_beams=4, max_new_tokens=1,
             min_new_tokens=1)
    assert cache.manager.prefix_cache.stats.hit_tokens == 3 * 20  # beams 2-4 find 5 blocks
    tables = {tuple(cache.manager.block_table(seq)) for seq in cache._rows}
    assert len(tables) == 1 and len(next(iter(tables))) == 6
    assert cache.manager.allocator.num_used_blocks == 6


def test_shared_prefix_blocks_and_reset_reuse():
    """Prompts that share a prefix share its full blocks; after reset() the next batch finds
    them in the prefix cache, with the same tokens out."""
    model = tiny_model(seed=4)
    prompts = [SHARED + [13, 14, 15], SHARED + [77], SHARED + [1, 2, 3, 4, 5]]
    inputs = left_padded(prompts)
    expected = generate(model, inputs, "sdpa")
    cache = paged(model)
    assert torch.equal(generate(model, inputs, "pagedkv", cache), expected)
    shared_blocks = len(SHARED) // 4
    tables = [cache.manager.block_table(seq) for seq in cache._rows]
    assert {tuple(t[:shared_blocks]) for t in tables} == {tuple(tables[0][:shared_blocks])}
    separate = sum(-(-(len(p) + 7) // 4) for p in prompts)  # the last token is never run
    assert cache.manager.allocator.num_used_blocks == separate - 2 * shared_blocks
    cache.reset()
    assert cache.manager.allocator.num_used_blocks == 0 and cache.get_seq_length() == 0
    hits = cache.manager.prefix_cache.stats.hit_rate
    assert torch.equal(generate(model, inputs, "pagedkv", cache), expected)
    assert cache.manager.prefix_cache.stats.hit_rate > hits


def test_continuing_a_cache_equals_one_call():
    """generate again on the sequences and the cache of a first call (transformers' cache
    continuation): only the new columns run, and the tokens equal one longer call."""
    model = tiny_model(seed=5)
    inputs = left_padded(PROMPTS[:3])
    expected = generate(model, inputs, "sdpa", max_new_tokens=10, min_new_tokens=10)
    cache = paged(model)
    first = generate(model, inputs, "pagedkv", cache, max_new_tokens=4, min_new_tokens=4)
    assert cache.get_seq_length() == inputs["input_ids"].shape[1] + 3  # the last token not run
    longer = {"input_ids": torch.cat([inputs["input_ids"], first], 1),
              "attention_mask": torch.cat([inputs["attention_mask"], torch.ones_like(first)], 1)}
    second = generate(model, longer, "pagedkv", cache, max_new_tokens=6, min_new_tokens=6)
    assert torch.equal(torch.cat([first, second], 1), expected)


def test_holds_less_kv_memory_than_dynamic_cache():
    """A mixed-length batch: DynamicCache holds every row at the longest row's length, padding
    included; the paged cache holds the blocks of real tokens, shared prefix blocks once."""
    model = tiny_model(seed=6)
    prompts = [SHARED + list(range(100, 160)), [5, 6, 7], SHARED + [77], list(range(30, 41))]
    inputs = left_padded(prompts)
    new = 8
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        dynamic = model.generate(**inputs, max_new_tokens=new, min_new_tokens=new,
                                 do_sample=False, return_dict_in_generate=True).cache
    dynamic_bytes = sum(layer.keys.nbytes + layer.values.nbytes for layer in dynamic.layers)
    cache = paged(model, block_size=16)
    generate(model, inputs, "pagedkv", cache, max_new_tokens=new, min_new_tokens=new)
    stored = [len(p) + new - 1 for p in prompts]  # the last token is never run
    blocks = sum(-(-n // 16) for n in stored)  # SHARED is 12 tokens: no full block to share
    assert cache.used_bytes == blocks * cache.spec.bytes_per_block
    assert dynamic_bytes == len(prompts) * max(stored) * cache.spec.bytes_per_token
    ratio = cache.used_bytes / dynamic_bytes
    print(f"\nKV bytes, paged / DynamicCache: {cache.used_bytes} / {dynamic_bytes} = {ratio:.2f}")
    assert ratio < 0.6


def test_row_selection_forks_block_tables():
    model = tiny_model()
    cache = paged(model)
    model.set_attn_implementation("pagedkv")
    with torch.no_grad():
        model(**left_padded(PROMPTS[:2]), cache=cache)
    tables = [cache.manager.block_table(seq) for seq in cache._rows]
    used = cache.manager.allocator.num_used_blocks
    cache.batch_repeat_interleave(2)
    assert [cache.manager.block_table(seq) for seq in cache._rows] == [
        tables[0], tables[0], tables[1], tables[1]]
    cache.batch_select_indices(torch.tensor([3, 0]))
    assert [cache.manager.block_table(seq) for seq in cache._rows] == tables[::-1]
    assert cache.manager.allocator.num_used_blocks == used and len(cache.manager) == 2
    with pytest.raises(IndexError, match=r"in \[0, 2\)"):
        cache.reorder_cache(torch.tensor([0, 2]))


def test_a_failed_forward_is_not_built_upon():
    model = tiny_model()
    cache = paged(model)
    model.set_attn_implementation("pagedkv")
    layer = model.model.layers[1].self_attn
    handle = layer.register_forward_pre_hook(lambda *_: 1 / 0)
    with pytest.raises(ZeroDivisionError), torch.no_grad():
        model(**left_padded(PROMPTS[:2]), cache=cache)
    handle.remove()
    with pytest.raises(RuntimeError, match="reset"), torch.no_grad():
        model(**left_padded(PROMPTS[:2]), cache=cache)
    cache.reset()
    assert torch.equal(generate(model, left_padded(PROMPTS[:2]), "pagedkv", cache),
                       generate(model, left_padded(PROMPTS[:2]), "sdpa"))


def test_paged_cache_needs_the_pagedkv_attention():
    model = tiny_model()
    inputs = left_padded(PROMPTS[:2])
    with pytest.raises(ValueError, match='attn_implementation="pagedkv"'):
        generate(model, inputs, "sdpa", paged(model))


def test_pagedkv_attention_needs_a_paged_cache():
    model = tiny_model()
    with pytest.raises(ValueError, match="PagedCache"):
        generate(model, left_padded(PROMPTS[:2]), "pagedkv")


def test_batch_size_must_not_change_without_reset():
    model = tiny_model()
    cache = paged(model)
    generate(model, left_padded(PROMPTS[:2]), "pagedkv", cache, max_new_tokens=1,
             min_new_tokens=1)
    model.set_attn_implementation("pagedkv")
    with pytest.raises(ValueError, match="reset"), torch.no_grad():
        model(**left_padded(PROMPTS[:3]), cache=cache)


def test_out_of_blocks_names_the_pool_and_reset_recovers():
    model = tiny_model()
    cache = paged(model, num_blocks=4)
    with pytest.raises(OutOfBlocksError, match="out of device blocks"):
        generate(model, left_padded(PROMPTS), "pagedkv", cache)
    cache.reset()
    assert len(cache.manager) == 0 and cache.manager.allocator.num_used_blocks == 0
    inputs = left_padded([[5, 6, 7]])
    assert torch.equal(generate(model, inputs, "pagedkv", cache, max_new_tokens=4,
                                min_new_tokens=4),
                       generate(model, inputs, "sdpa", max_new_tokens=4, min_new_tokens=4))


def test_version_check(monkeypatch):
    hf.check_transformers_version()
    for version in ("4.57.1", "5.23.0", "6.0.0"):
        monkeypatch.setattr(transformers, "__version__", version)
        with pytest.raises(ImportError, match=f"{version} is installed"):
            hf.check_transformers_version()


# -- transformers' continuous batching -----------------------------------------------------------


def generate_batch(model, prompts: list[list[int]], new: int = 12) -> list[list[int]]:
    config = transformers.GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=None,
                                           pad_token_id=PAD)
    batching = transformers.ContinuousBatchingConfig(page_size=16, num_blocks=64,
                                                     max_batch_tokens=32)
    out = model.generate_batch(prompts, generation_config=config,
                               continuous_batching_config=batching, progress_bar=False)
    assert all(out[key].error is None for key in out)
    return [out[key].generated_tokens for key in sorted(out, key=lambda k: int(k.split("_")[-1]))]


def test_continuous_batching_runs_the_paged_kernel(monkeypatch):
    """generate_batch with pagedkv's attention gives the tokens of its sdpa attention (and of
    generate); the kernel ran (chunked prefills of 32 tokens, mixed with decodes)."""
    model = tiny_model(seed=7)
    model.set_attn_implementation("sdpa")
    expected = generate_batch(model, PROMPTS)
    assert expected[2] == generate(model, left_padded([PROMPTS[2]]), "sdpa", max_new_tokens=12,
                                   min_new_tokens=12)[0].tolist()
    calls = []
    kernel = hf.ops.paged_attention
    monkeypatch.setattr(hf.ops, "paged_attention",
                        lambda *a, **kw: (calls.append(a[9]), kernel(*a, **kw)))
    with hf.continuous_batching_attention(model):
        assert model.config._attn_implementation == "paged|eager"
        assert transformers.AttentionInterface()["paged|eager"] is hf.varlen_attention_forward
        assert generate_batch(model, PROMPTS) == expected
    assert calls and model.config._attn_implementation == "sdpa"
    assert transformers.AttentionInterface()["paged|eager"] is not hf.varlen_attention_forward


def test_continuous_batching_refuses_other_versions(monkeypatch):
    monkeypatch.setattr(transformers, "__version__", "5.25.0")
    with pytest.raises(RuntimeError, match="5.25.0 is installed"), \
            hf.continuous_batching_attention(tiny_model()):
        pass


def test_continuous_batching_rejects_the_pagedkv_name():
    """Why the context manager borrows "paged|eager": transformers refuses other names."""
    model = tiny_model()
    model.set_attn_implementation("pagedkv")
    with pytest.raises(ValueError, match="not supported for continuous batching"):
        generate_batch(model, PROMPTS[:1], new=1)
