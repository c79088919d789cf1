"""The "pagedkv" attention with sliding windows, soft caps and attention sinks, inside
transformers ``generate``, against transformers' own output.

Random-init tiny gpt-oss, Gemma 2 and Gemma 3 (text) models in float32, whose layers alternate
8-token windows with full attention: ``generate`` with ``PagedCache`` gives the tokens and (to
float32 rounding) the logits of transformers' eager or sdpa attention over contexts up to five
windows long, and the logits tolerance is far below what a window off by one token, a missing
window, missing sinks or a missing cap would change.
"""

from __future__ import annotations

import pytest
import torch

from helpers import one_thread  # noqa: F401  (autouse)

transformers = pytest.importorskip("transformers")
hf = pytest.importorskip("pagedkv.integrations.hf")

from test_hf import PAD, PROMPTS, SHARED, generate, generate_batch, left_padded, paged  # noqa: E402

WINDOW = 8  # tokens: the longest prompt (25) plus 16 new tokens spans five windows
HYBRID_LAYERS = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
HYBRID_PROMPTS = [list(range(5, 30)), [9, 8, 7, 6, 5], list(range(40, 53)), [3] + SHARED]
TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=64, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
            initializer_range=0.1, pad_token_id=PAD, bos_token_id=None, eos_token_id=None,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            sliding_window=WINDOW)


def gpt_oss(seed: int, **overrides) -> torch.nn.Module:
    """A random GptOssForCausalLM whose layers alternate 8-token windows with full attention,
    its sinks drawn from N(0, 2^2) (they init near zero). Two experts, both taken by every
    token: top-k routing is discontinuous, and with 2 of 4 a float32 rounding difference of
    5e-7 in an attention output (continuous batching packs other shapes) picked another expert
    on some machines and flipped a greedy token; with every expert taken, routing is smooth."""
    torch.manual_seed(seed)
    config = transformers.GptOssConfig(**TINY | dict(
        num_hidden_layers=4, num_local_experts=2, num_experts_per_tok=2,
        layer_types=HYBRID_LAYERS) | overrides)
    model = transformers.GptOssForCausalLM(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.copy_(2 * torch.randn_like(layer.self_attn.sinks))
    return model


def gemma2(seed: int, **overrides) -> torch.nn.Module:
    """A random Gemma2ForCausalLM: 8-token windows alternating with full layers, attention
    logits capped at 2 (random q.k reach beyond it), final logits at 5."""
    torch.manual_seed(seed)
    config = transformers.Gemma2Config(**TINY | dict(
        num_hidden_layers=4, layer_types=HYBRID_LAYERS, query_pre_attn_scalar=24,
        attn_logit_softcapping=2.0, final_logit_softcapping=5.0) | overrides)
    return transformers.Gemma2ForCausalLM(config).eval()


def gemma3(seed: int, **overrides) -> torch.nn.Module:
    """A random text-only Gemma3ForCausalLM: two 8-token window layers per full layer (its
    published pattern is five), query_pre_attn_scalar 24 != head size 16."""
    torch.manual_seed(seed)
    config = transformers.Gemma3TextConfig(**TINY | dict(
        num_hidden_layers=3, query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        rope_parameters={kind: {"rope_type": "default", "rope_theta": 10000.0}
                         for kind in ("sliding_attention", "full_attention")}) | overrides)
    return transformers.Gemma3ForCausalLM(config).eval()


HYBRID = {"gpt-oss": (gpt_oss, "eager"), "gemma2": (gemma2, "eager"), "gemma3": (gemma3, "sdpa")}
NEW = dict(max_new_tokens=16, min_new_tokens=16)


@pytest.mark.parametrize("family", HYBRID)
@pytest.mark.parametrize("block_size", [4, 5])
def test_hybrid_models_greedy_equals_transformers(family, block_size):
    """Left-padded prompts of 5 to 25 tokens, 16 new tokens: contexts up to five windows long,
    windows that start inside a block (block size 5)."""
    make, reference = HYBRID[family]
    model = make(seed=10 + block_size)
    inputs = left_padded(HYBRID_PROMPTS)
    expected = generate(model, inputs, reference, **NEW)
    got = generate(model, inputs, "pagedkv", paged(model, block_size=block_size), **NEW)
    assert torch.equal(got, expected)


def test_hybrid_model_prefix_cache_hits_past_the_window():
    """The cache keeps every token of the window layers, so a second batch after reset() finds
    the first one's full blocks beyond the window too, with transformers' tokens."""
    model = gpt_oss(seed=12)
    inputs = left_padded(HYBRID_PROMPTS)
    expected = generate(model, inputs, "eager", **NEW)
    cache = paged(model)
    assert torch.equal(generate(model, inputs, "pagedkv", cache, **NEW), expected)
    assert cache.is_sliding == [False] * len(model.model.layers)  # every layer keeps every token
    stored = [len(p) + NEW["max_new_tokens"] - 1 for p in HYBRID_PROMPTS]  # the last is not run
    assert cache.manager.allocator.num_used_blocks == sum(-(-n // 4) for n in stored)
    cache.reset()
    assert torch.equal(generate(model, inputs, "pagedkv", cache, **NEW), expected)
    full_blocks = sum(len(p) // 4 * 4 for p in HYBRID_PROMPTS)  # row 0: 24 tokens, 3 windows
    assert cache.manager.prefix_cache.stats.hit_tokens == full_blocks


def generate_logits(model, inputs, attn: str, cache=None) -> torch.Tensor:
    """``[steps, rows, vocab]``: the logits of every step of a greedy ``generate`` (the first
    is the prefill's last column, the others decodes)."""
    model.set_attn_implementation(attn)
    with torch.no_grad():
        out = model.generate(**inputs, cache=cache, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, **NEW)
    return torch.stack(out.logits)


CHANGES = {"gpt-oss": ["window - 1", "window + 1", "no window", "no sinks"],
           "gemma2": ["window - 1", "window + 1", "no window", "no cap"],
           "gemma3": ["window - 1", "window + 1", "no window"]}


def change(model, what: str) -> None:
    """Change one thing the pagedkv attention must honour in every layer."""
    for layer in model.model.layers:
        attn = layer.self_attn
        if what == "no window":
            attn.sliding_window = None
        elif what.startswith("window") and attn.sliding_window is not None:
            attn.sliding_window += int(what.replace(" ", "")[len("window"):])
        elif what == "no sinks":
            attn.sinks.data.zero_()
        elif what == "no cap":
            attn.attn_logit_softcapping = None


@pytest.mark.parametrize("family", HYBRID)
def test_hybrid_models_logits_match_transformers(family):
    """Every step's logits within 2e-5 of transformers' (float32 sums in another order:
    measured at most 3e-6), while a window one token narrower or wider, no window, no sinks or
    no cap moves them by more than 0.1: the tolerance cannot hide an off-by-one or a missing
    feature."""
    make, reference = HYBRID[family]
    model = make(seed=20)
    inputs = left_padded(HYBRID_PROMPTS)
    expected = generate_logits(model, inputs, reference)
    got = generate_logits(model, inputs, "pagedkv", paged(model))
    print(f"\n{family}: max |logit difference| {(got - expected).abs().max().item():.2e}")
    torch.testing.assert_close(got, expected, rtol=0, atol=2e-5)
    for what in CHANGES[family]:
        model = make(seed=20)
        change(model, what)
        changed = generate_logits(model, inputs, "pagedkv", paged(model))
        print(f"{what}: {(changed[0] - expected[0]).abs().max().item():.2e}")
        assert (changed[0] - expected[0]).abs().max() > 0.1, what


@pytest.mark.parametrize("family", HYBRID)
def test_hybrid_models_continuous_batching(family, monkeypatch):
    """generate_batch with pagedkv's attention (chunked prefills of 32 tokens, mixed with
    decodes; transformers gathers a window layer's last 7 cached tokens and the new ones) gives
    each prompt's tokens of ``generate`` alone, and the kernel received each layer's window,
    sinks and cap."""
    make, reference = HYBRID[family]
    model = make(seed=30)
    expected = [generate(model, left_padded([p]), reference, **NEW)[0].tolist()
                for p in HYBRID_PROMPTS]
    seen = set()
    kernel = hf.ops.paged_attention
    monkeypatch.setattr(hf.ops, "paged_attention", lambda *a, **kw: (seen.add(
        (kw["sliding_window"], kw["soft_cap"], kw["sinks"] is not None)), kernel(*a, **kw)))
    with hf.continuous_batching_attention(model):
        assert generate_batch(model, HYBRID_PROMPTS, new=NEW["max_new_tokens"]) == expected
    cap, sinks = (2.0 if family == "gemma2" else 0.0), family == "gpt-oss"
    assert seen == {(WINDOW, cap, sinks), (-1, cap, sinks)}


def test_bidirectional_layers_are_refused():
    model = gemma3(seed=0, use_bidirectional_attention=True)
    with pytest.raises(NotImplementedError, match="bidirectional"):
        generate(model, left_padded(PROMPTS[:2]), "pagedkv", paged(model))


def test_bad_window_is_named():
    model = gpt_oss(seed=0)
    model.model.layers[0].self_attn.sliding_window = 0
    with pytest.raises(ValueError, match="sliding_window must be a positive int"):
        generate(model, left_padded(PROMPTS[:2]), "pagedkv", paged(model))
