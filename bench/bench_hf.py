"""pagedkv inside Hugging Face transformers, against transformers' own sdpa path, in one process.

python -m bench.bench_hf [--device cpu|cuda] [--quick]

A random-init Llama (float32) and a batch of prompts of mixed lengths, half of them behind one
shared system prompt; greedy decoding. Each variant runs 3 times, the variants alternating, and
reports the median in generated tokens per second:

- generate: ``DynamicCache`` + "sdpa" (transformers' default) vs ``PagedCache`` + "pagedkv";
  also the KV bytes each cache holds at the end (``PagedCache.used_bytes``: blocks in use).
- generate_batch (continuous batching): its "sdpa" attention vs ``continuous_batching_attention``
  (``pagedkv.ops.paged_attention`` over the K/V its cache gathered).

Both pairs must produce the same tokens; the table says whether they did.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable

import torch

from bench.harness import write_host_json

try:
    import transformers
except ModuleNotFoundError:  # an optional dependency: pip install 'pagedkv[hf]'
    transformers = None

REPEATS = 3


def make_model(quick: bool, device: str) -> torch.nn.Module:
    layers = 2 if quick else 4
    config = transformers.LlamaConfig(
        vocab_size=4096, hidden_size=256, intermediate_size=768, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        max_position_embeddings=2048, bos_token_id=None, eos_token_id=None, pad_token_id=0,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval().to(device)


def make_prompts(num: int, max_len: int) -> list[list[int]]:
    rng = random.Random(0)
    system = [rng.randrange(1, 4096) for _ in range(64)]
    prompts = []
    for i in range(num):
        tail = [rng.randrange(1, 4096) for _ in range(rng.randrange(8, max_len))]
        prompts.append(system + tail if i % 2 else tail)
    return prompts


def left_padded(prompts: list[list[int]], device: str) -> dict[str, torch.Tensor]:
    width = max(map(len, prompts))
    ids = [[0] * (width - len(p)) + p for p in prompts]
    mask = [[0] * (width - len(p)) + [1] * len(p) for p in prompts]
    return {"input_ids": torch.tensor(ids, device=device),
            "attention_mask": torch.tensor(mask, device=device)}


def alternate(variants: dict[str, Callable[[], object]]) -> tuple[dict[str, list[float]], dict]:
    """Seconds of each variant in REPEATS rounds, the variants alternating; and the last result
    of each."""
    times = {name: [] for name in variants}
    results = {}
    for _ in range(REPEATS):
        for name, run in variants.items():
            start = time.perf_counter()
            results[name] = run()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            times[name].append(time.perf_counter() - start)
    return times, results


def row(bench: str, variant: str, runs: list[float], tokens: int, same: bool) -> dict:
    median = statistics.median(runs)
    return {"bench": bench, "variant": variant, "seconds": median, "runs_s": runs,
            "tokens_per_s": tokens / median, "same_tokens": same}


def bench_generate(model, prompts, new: int, device: str) -> list[dict]:
    from pagedkv.integrations.hf import PagedCache

    inputs = left_padded(prompts, device)
    width = inputs["input_ids"].shape[1]
    kwargs = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False,
                  return_dict_in_generate=True)
    num_blocks = sum(len(p) + new for p in prompts) // 16 + len(prompts) + 2
    caches = {}

    def run(attn: str, cache=None):
        model.set_attn_implementation(attn)
        with torch.no_grad():
            out = model.generate(**inputs, cache=cache, **kwargs)
        caches[attn] = out.cache
        return out.sequences[:, width:]

    seconds, tokens = alternate({
        "sdpa + DynamicCache": lambda: run("sdpa"),
        "pagedkv + PagedCache": lambda: run("pagedkv", PagedCache(model, num_blocks)),
    })
    dynamic = sum(layer.keys.nbytes + layer.values.nbytes for layer in caches["sdpa"].layers)
    same = torch.equal(*tokens.values())
    rows = [row("generate", name, runs, len(prompts) * new, same) for name, runs in seconds.items()]
    rows[0]["kv_bytes"], rows[1]["kv_bytes"] = dynamic, caches["pagedkv"].used_bytes
    return rows


def bench_generate_batch(model, prompts, new: int) -> list[dict]:
    from pagedkv.integrations.hf import continuous_batching_attention

    config = transformers.GenerationConfig(max_new_tokens=new, do_sample=False,
                                           eos_token_id=None, pad_token_id=0)
    batching = transformers.ContinuousBatchingConfig(
        page_size=16, num_blocks=sum(len(p) + new for p in prompts) // 16 + len(prompts) + 2,
        max_batch_tokens=512)

    def run():
        out = model.generate_batch(prompts, generation_config=config,
                                   continuous_batching_config=batching, progress_bar=False)
        return [out[key].generated_tokens for key in sorted(out)]

    def paged():
        with continuous_batching_attention(model):
            return run()

    model.set_attn_implementation("sdpa")
    seconds, tokens = alternate({"sdpa": run, "pagedkv": paged})
    same = tokens["sdpa"] == tokens["pagedkv"]
    return [row("generate_batch", name, runs, len(prompts) * new, same)
            for name, runs in seconds.items()]


def print_table(rows: list[dict]) -> None:
    print(f"{'bench':<16}{'variant':<24}{'median s':>10}{'tokens/s':>10}{'KV MiB':>9} same")
    for row in rows:
        kv = f"{row['kv_bytes'] / 2**20:.2f}" if "kv_bytes" in row else ""
        print(f"{row['bench']:<16}{row['variant']:<24}{row['seconds']:>10.3f}"
              f"{row['tokens_per_s']:>10.1f}{kv:>9} {row['same_tokens']}")


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="a smaller model and batch")
    args = parser.parse_args(argv)
    if transformers is None:
        print("bench_hf: skipped, transformers is not installed (pip install 'pagedkv[hf]')")
        return []
    model = make_model(args.quick, args.device)
    prompts = make_prompts(4 if args.quick else 8, 64 if args.quick else 384)
    new = 8 if args.quick else 48
    rows = bench_generate(model, prompts, new, args.device)
    rows += bench_generate_batch(model, prompts, new)
    print_table(rows)
    write_host_json("bench_hf", rows, transformers=transformers.__version__,
                    threads=torch.get_num_threads(), device=args.device,
                    prompt_lens=[len(p) for p in prompts], new_tokens=new)
    return rows


if __name__ == "__main__":
    main()
