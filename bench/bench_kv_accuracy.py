"""End-to-end accuracy of the quantized KV cache formats on small random models.

python -m bench.bench_kv_accuracy [--quick] [--tokens N]

Each model (pagedkv.serving's Llama with seeded random weights, normal std 0.1 as
``transformers``' ``initializer_range=0.1``, float32) generates greedily from a batch of prompts
with a float32 cache: the reference tokens and logits. Then, for each cache format, the same model
runs twice over the same block manager, plans and paged ops:

- teacher-forced (fed the reference tokens): each step's logits against the reference's. The
  first step is the prefill, whose attention already reads the quantized cache.
  ``agreement``: the share of steps (of every sequence) whose argmax is the reference's token
  (greedy-token agreement); ``first_err`` / ``mean_err``: mean |logit error| of the first step /
  of every step, over the mean |reference logit|; ``max_err``: the largest |logit error| over
  the largest |reference logit|.
- free-running (its own argmax fed back): ``match``, the share of generated tokens equal to the
  reference's at the same position (sequences that diverge once rarely meet again).

Models: ``tiny``, the tests' ``tiny_hf_model`` (2 layers, hidden 64, 4 heads / 2 KV heads of
16); ``demo``, ``pagedkv demo``'s (4 layers, hidden 128, heads of 32, vocab 512); ``outliers``,
``tiny`` with two rotary channel pairs of every K head and two channels of every V head 20x
larger, divided back out of the queries and o_proj (the float model computes the same function;
its keys have outlier channels, as real models' do, which set their rows' absmax). Per-tensor fp8
runs at scale 1.0 (uncalibrated), as ``PagedKVCache`` starts.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch

from bench.harness import write_host_json
from pagedkv.blocks.manager import BlockManager
from pagedkv.blocks.plan import PlanExecutor
from pagedkv.cache import FORMATS, KVCacheSpec, PagedKVCache
from pagedkv.serving.model import LlamaForCausalLM, ModelConfig
from pagedkv.tools.demo import random_model

FORMAT_NAMES = ["int8", "fp8_e4m3_per_token_head", "fp8_e5m2_per_token_head", "int4",
                "float8_e4m3fn", "float8_e5m2"]
"""The formats measured, against the float32 cache."""
OUTLIER_FACTOR = 20.0


@dataclass(frozen=True)
class Run:
    tokens: list[list[int]]  # per sequence, the generated tokens
    logits: torch.Tensor  # [steps, sequences, vocab], float32


def tiny_config(max_len: int) -> ModelConfig:
    """The shapes of tests/helpers.py ``tiny_hf_model``."""
    return ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=max_len)


def demo_config(max_len: int) -> ModelConfig:
    """The shapes of ``pagedkv demo``'s model."""
    return ModelConfig(vocab_size=512, hidden_size=128, intermediate_size=256,
                       num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=max_len)


def with_outliers(model: LlamaForCausalLM, factor: float = OUTLIER_FACTOR) -> LlamaForCausalLM:
    """The same function with outlier channels in K and V: in every KV head, channels 1 and 5
    and their rotary partners (``+ head_dim / 2``) of K scaled by ``factor`` and the matching
    query channels of its query heads by ``1 / factor`` (a scale of one rotary plane commutes
    with the rotation); V channels 2 and 7 by ``factor``, o_proj's matching inputs by its
    inverse."""
    config = model.config
    d, group = config.head_dim, config.num_attention_heads // config.num_key_value_heads
    k_channels = [c + half for c in (1, 5) for half in (0, d // 2)]
    with torch.no_grad():
        for layer in model.model.layers:
            attn = layer.self_attn
            for h in range(config.num_key_value_heads):
                for c in k_channels:
                    attn.k_proj.weight[h * d + c] *= factor
                    for q in range(h * group, (h + 1) * group):
                        attn.q_proj.weight[q * d + c] /= factor
                for c in (2, 7):
                    attn.v_proj.weight[h * d + c] *= factor
                    for q in range(h * group, (h + 1) * group):
                        attn.o_proj.weight[:, q * d + c] /= factor
    return model


def make_prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    """Four prompts of 1 to 40 tokens, two of them sharing a 12-token prefix."""
    gen = torch.Generator().manual_seed(seed)
    shared = torch.randint(vocab, (12,), generator=gen).tolist()
    own = [torch.randint(vocab, (n,), generator=gen).tolist() for n in (1, 17, 40, 5)]
    return [own[0], shared + own[1], own[2], shared + own[3]]


def generate(model: LlamaForCausalLM, prompts: list[list[int]], steps: int,
             cache_dtype: torch.dtype | str | None, forced: list[list[int]] | None = None,
             block_size: int = 16) -> Run:
    """Greedy decoding of every prompt for ``steps`` tokens through the paged cache (blocks
    NaN-filled before use: a read of a slot no token wrote shows), one prefill then batched
    decode steps; with ``forced``, those tokens are fed instead of the argmax."""
    spec: KVCacheSpec = model.kv_cache_spec(block_size, torch.float32, cache_dtype)
    longest = max(map(len, prompts)) + steps
    num_blocks = 1 + len(prompts) * spec.blocks_for_tokens(longest)
    cache = PagedKVCache(spec, num_blocks)
    manager = BlockManager(num_blocks, block_size, enable_prefix_caching=False, debug_nan=True)
    executor = PlanExecutor(cache)
    ids = list(range(len(prompts)))
    for i, prompt in enumerate(prompts):
        manager.add_sequence(i, prompt)
    seqs, query_lens, logits = [list(p) for p in prompts], [len(p) for p in prompts], []
    for step in range(steps):
        batch = manager.build_batch(ids, query_lens)
        executor.run(manager)
        pairs = list(zip(seqs, query_lens, strict=True))
        input_ids = torch.tensor([t for seq, q in pairs for t in seq[-q:]])
        positions = torch.cat([torch.arange(len(seq) - q, len(seq)) for seq, q in pairs])
        with torch.inference_mode():
            out = model(input_ids, positions, cache, batch, batch.query_start_loc[1:].long() - 1)
        logits.append(out.float())
        chosen = out.argmax(-1).tolist() if forced is None else [f[step] for f in forced]
        for i, token in enumerate(chosen):
            seqs[i].append(token)
            manager.append_tokens(i, [token])
        query_lens = [1] * len(prompts)
    return Run([s[len(p):] for s, p in zip(seqs, prompts, strict=True)], torch.stack(logits))


def compare(reference: Run, forced: Run, free: Run) -> dict[str, float]:
    """The figures of one format (see the module docstring)."""
    err = (forced.logits - reference.logits).abs()
    ref = reference.logits.abs()
    wanted = torch.tensor(reference.tokens).T  # [steps, sequences]
    matches = [a == b for got, want in zip(free.tokens, reference.tokens, strict=True)
               for a, b in zip(got, want, strict=True)]
    return {
        "agreement": (forced.logits.argmax(-1) == wanted).float().mean().item(),
        "match": sum(matches) / len(matches),
        "first_err": (err[0].mean() / ref[0].mean()).item(),
        "mean_err": (err.mean() / ref.mean()).item(),
        "max_err": (err.max() / ref.max()).item(),
        "finite": bool(forced.logits.isfinite().all() and free.logits.isfinite().all()),
    }


def measure(model: LlamaForCausalLM, steps: int, formats: list[str] = FORMAT_NAMES,
            seed: int = 0) -> dict[str, dict[str, float]]:
    """Each format's figures on ``model`` over ``steps`` generated tokens per prompt."""
    prompts = make_prompts(model.config.vocab_size, seed)
    reference = generate(model, prompts, steps, None)
    return {name: compare(reference, generate(model, prompts, steps, name, reference.tokens),
                          generate(model, prompts, steps, name))
            for name in formats}


def models(max_len: int) -> dict[str, LlamaForCausalLM]:
    return {"tiny": random_model(tiny_config(max_len)),
            "demo": random_model(demo_config(max_len)),
            "outliers": with_outliers(random_model(tiny_config(max_len)))}


def table(results: dict[str, dict[str, dict[str, float]]], steps: int) -> list[str]:
    lines = [f"greedy decoding, 4 prompts x {steps} tokens, against the float32 cache",
             f"{'model':<9}{'format':<26}{'row B':>6}{'agree':>8}{'match':>8}{'first':>9}"
             f"{'mean':>9}{'max':>9}"]
    for model, rows in results.items():
        for name, r in rows.items():
            row = FORMATS[name].row_bytes(128)
            lines.append(f"{model:<9}{name:<26}{row:>6}{r['agreement']:>8.1%}{r['match']:>8.1%}"
                         f"{r['first_err']:>9.2e}{r['mean_err']:>9.2e}{r['max_err']:>9.2e}")
    lines.append("row B: bytes of one row of 128 elements, its scale included (bfloat16: 256)")
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.bench_kv_accuracy",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="64 tokens instead of 256")
    parser.add_argument("--tokens", type=int, help="generated tokens per prompt")
    args = parser.parse_args(argv)
    steps = args.tokens or (64 if args.quick else 256)
    results = {name: measure(model, steps) for name, model in models(steps + 64).items()}
    print("\n".join(table(results, steps)))
    rows = [{"model": model, "format": name, **r} for model, by_format in results.items()
            for name, r in by_format.items()]
    write_host_json("bench_kv_accuracy", rows, steps=steps, prompts=4)


if __name__ == "__main__":
    main()
