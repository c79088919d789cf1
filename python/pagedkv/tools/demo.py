"""``pagedkv demo``: a small random Llama served through the engine, paged vs contiguous.

The same requests (mixed lengths, half of them behind a shared system prompt) run twice under the
same KV memory budget: with the paged cache (small blocks, prefix caching) and with contiguous
max-length reservation (one ``max_model_len`` block per request, no sharing). Greedy decoding, so
both runs must produce the same tokens.

``--tp N`` under ``torchrun --nproc-per-node N`` serves the same requests with tensor parallelism:
each rank holds its share of the heads, the MLP and the KV cache (the budget is split evenly over
the ranks, so each holds as many blocks as one rank would), and rank 0 prints the report.

``--model deepseek`` serves the same requests with a tiny random DeepSeek-V3 model on its latent
cache instead (``pagedkv.tools.demo_mla``; it needs transformers, the ``hf`` extra).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import sys
from typing import Any

import torch

from pagedkv.errors import InvalidArgumentError
from pagedkv.serving.engine import EngineConfig, LLMEngine, SamplingParams
from pagedkv.serving.model import LlamaForCausalLM, ModelConfig
from pagedkv.serving.parallel import TensorParallel, TensorParallelError, init_tensor_parallel
from pagedkv.tools import argtypes

__all__ = ["add_arguments", "format_report", "main", "make_requests", "random_model", "run",
           "requests_line", "run_demo", "serve_both", "table_lines"]


def random_model(config: ModelConfig, seed: int = 0,
                 tp: TensorParallel | None = None) -> LlamaForCausalLM:
    """A model with seeded random weights (normal, std 0.1; norms at 1); with ``tp``, this
    rank's shard of the same weights."""
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    for name, param in model.named_parameters():
        if not name.endswith("norm.weight"):
            torch.nn.init.normal_(param, std=0.1)
    if tp is not None and tp.size > 1:
        shard = LlamaForCausalLM(config, tp)
        shard.load_hf_state_dict(model.state_dict())
        model = shard
    return model.eval()


def demo_config(max_model_len: int = 192) -> ModelConfig:
    """The demo's model: 4 layers, hidden 128, 4 heads / 2 KV heads, vocab 512."""
    return ModelConfig(vocab_size=512, hidden_size=128, intermediate_size=256,
                       num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=max_model_len)


def make_requests(num_requests: int, system_prompt_len: int, vocab_size: int, max_prompt: int,
                  max_tokens: int, seed: int) -> list[tuple[list[int], int]]:
    """(prompt, max_tokens) pairs of mixed lengths; every other one starts with a system prompt."""
    rng = random.Random(seed)
    system = [rng.randrange(vocab_size) for _ in range(system_prompt_len)]
    requests = []
    for i in range(num_requests):
        own = [rng.randrange(vocab_size) for _ in range(rng.randint(4, max_prompt))]
        prompt = system + own if i % 2 == 0 else own
        requests.append((prompt, rng.randint(max(1, max_tokens // 8), max_tokens)))
    return requests


def _serve(model: torch.nn.Module, requests: list[tuple[list[int], int]],
           config: EngineConfig) -> tuple[dict[str, Any], list[list[int]]]:
    engine = LLMEngine(model, config)
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for _, n in requests]
    outputs = engine.generate([p for p, _ in requests], params)
    stats = engine.stats
    return {
        "block_size": config.block_size,
        "num_blocks": engine.cache.num_blocks,
        "kv_cache_bytes_per_rank": engine.cache.nbytes,
        "tokens_per_s": round(stats.tokens_per_second, 1),
        "generated_tokens": stats.generated_tokens,
        "prefill_tokens": stats.prefill_tokens,
        "steps": stats.steps,
        "peak_concurrent_requests": stats.peak_running,
        "kv_waste": round(stats.kv_waste, 4),
        "prefix_hit_rate": round(engine.prefix_hit_rate, 4),
        "preemptions": stats.swaps_out + stats.recomputes,
        "seconds": round(stats.seconds, 3),
    }, outputs


def serve_both(model: torch.nn.Module, requests: list[tuple[list[int], int]], budget: int,
               block_bytes: int, block_size: int, max_model_len: int,
               cache_dtype: str | None = None) -> dict[str, Any]:
    """The requests served paged (blocks of ``block_size`` tokens, ``block_bytes`` each, prefix
    caching, swap space of 4 budgets) and contiguous (one ``max_model_len`` block a request, no
    sharing) in ``budget`` bytes of KV memory, both in the cache format ``cache_dtype`` (None:
    the model's dtype): both runs' reports and the tokens' agreement."""
    num_seqs = len(requests)
    paged, paged_out = _serve(model, requests, EngineConfig(
        block_size=block_size, num_blocks=None, kv_cache_bytes=budget,
        num_cpu_blocks=4 * budget // block_bytes, max_num_seqs=num_seqs,
        cache_dtype=cache_dtype))
    contiguous, contiguous_out = _serve(model, requests, EngineConfig(
        block_size=max_model_len, num_blocks=None, kv_cache_bytes=budget,
        enable_prefix_caching=False, reserve_null_block=False, max_num_seqs=num_seqs,
        cache_dtype=cache_dtype))
    return {
        "paged": paged,
        "contiguous": contiguous,
        "outputs_match": paged_out == contiguous_out,
        "outputs_sha256": hashlib.sha256(json.dumps(paged_out).encode()).hexdigest(),
        "outputs": paged_out,
    }


def run_demo(
    num_requests: int = 48,
    system_prompt_len: int = 48,
    max_prompt: int = 64,
    max_tokens: int = 64,
    max_model_len: int = 192,
    kv_budget_requests: int = 6,
    block_size: int = 16,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    tp: TensorParallel | None = None,
    cache_dtype: str | None = None,
) -> dict[str, Any]:
    """Serve the same requests paged and contiguous under one KV budget; returns both reports.

    The budget holds ``kv_budget_requests`` contiguous reservations of ``max_model_len`` tokens
    in the model's ``dtype``; with ``tp`` (this rank among several) each rank gets an equal share
    of it. ``cache_dtype``: the cache format both runs store K/V in (None: ``dtype``); a smaller
    one holds more requests in the same budget.
    """
    tp = tp or TensorParallel()
    if system_prompt_len + max_prompt + max_tokens > max_model_len:
        raise ValueError("system_prompt_len + max_prompt + max_tokens must be <= max_model_len")
    config = demo_config(max_model_len)
    model = random_model(config, seed, tp).to(device=device, dtype=dtype)
    requests = make_requests(num_requests, system_prompt_len, config.vocab_size, max_prompt,
                             max_tokens, seed)
    budget = config.kv_cache_spec(max_model_len, dtype).bytes_per_block * kv_budget_requests
    rank_budget = budget // tp.size
    rank_spec = config.kv_cache_spec(block_size, dtype, cache_dtype, tp_size=tp.size)
    runs = serve_both(model, requests, rank_budget, rank_spec.bytes_per_block, block_size,
                      max_model_len, cache_dtype)
    return {
        "model": {"name": "llama", "layers": config.num_hidden_layers, "hidden": config.hidden_size,
                  "heads": config.num_attention_heads, "kv_heads": config.num_key_value_heads,
                  "vocab": config.vocab_size, "dtype": str(dtype).removeprefix("torch."),
                  "cache_dtype": rank_spec.format.name,
                  "device": str(device),
                  "linears": "onednn" if model.packed_dtype is not None else "F.linear"},
        "requests": num_requests,
        "system_prompt_len": system_prompt_len,
        "max_model_len": max_model_len,
        "kv_budget_bytes": budget,
        "tp": tp.size,
        **runs,
    }


ROWS = [("tokens/s", "tokens_per_s"), ("peak concurrent requests", "peak_concurrent_requests"),
        ("KV memory waste", "kv_waste"), ("prefix hit rate", "prefix_hit_rate"),
        ("engine steps", "steps"), ("preemptions", "preemptions"),
        ("blocks x block size", "blocks")]


def format_report(report: dict[str, Any]) -> str:
    """The demo report as a small text table."""
    model = report["model"]
    lines = [
        f"model: {model['layers']} layers, hidden {model['hidden']}, {model['heads']} heads / "
        f"{model['kv_heads']} kv heads, vocab {model['vocab']}, {model['dtype']} on "
        f"{model['device']} (random weights), {model['cache_dtype']} KV cache",
        requests_line(report),
    ]
    if report["tp"] > 1:
        lines.append(f"tensor parallel over {report['tp']} ranks; KV cache per rank: "
                     f"{report['paged']['kv_cache_bytes_per_rank'] / 2**20:.2f} MiB paged, "
                     f"{report['contiguous']['kv_cache_bytes_per_rank'] / 2**20:.2f} MiB "
                     "contiguous")
    return "\n".join(lines + table_lines(report))


def requests_line(report: dict[str, Any]) -> str:
    """The report's line on the requests and the KV budget."""
    return (f"{report['requests']} requests, half behind a {report['system_prompt_len']}-token "
            f"system prompt; KV budget {report['kv_budget_bytes'] / 2**20:.2f} MiB "
            f"(max_model_len {report['max_model_len']})")


def table_lines(report: dict[str, Any]) -> list[str]:
    """The paged and contiguous runs side by side, and whether their tokens agree."""
    lines = [f"{'':26}{'paged':>14}{'contiguous':>14}"]
    for label, key in ROWS:
        cells = []
        for run in (report["paged"], report["contiguous"]):
            value = (f"{run['num_blocks']} x {run['block_size']}" if key == "blocks"
                     else f"{run[key]:.1%}" if key in ("kv_waste", "prefix_hit_rate")
                     else run[key])
            cells.append(f"{value:>14}")
        lines.append(f"{label:26}{''.join(cells)}")
    lines.append("KV memory waste: share of the allocated KV slots that held no token, "
                 "averaged over engine steps")
    lines.append(f"same greedy tokens in both runs: {report['outputs_match']} "
                 f"(sha256 of the tokens: {report['outputs_sha256'][:16]})")
    return lines


def _device(text: str) -> str:
    try:
        device = torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"expected cpu or cuda, got {text!r}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError("cuda: no GPU is available here")
    if device.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"expected cpu or cuda, got {text!r}")
    return text


HELP = "the end-to-end demo: a small random Llama (or DeepSeek-V3) served paged and contiguous"
DESCRIPTION = """\
Serve the same requests (mixed lengths, half behind a shared system prompt) with a small Llama
of random weights, twice under one KV memory budget: with the paged cache (small blocks, prefix
caching) and with contiguous max-length reservation. Greedy decoding, so both runs must produce
the same tokens (exit status 1 otherwise). With --tp N, run it under torchrun --nproc-per-node N.
With --model deepseek, a tiny random DeepSeek-V3 (multi-head latent attention) serves them on its
latent cache, and the report adds the cache's bytes per token beside the MHA and GQA-8 forms'."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``pagedkv demo`` (the command line adds ``--json``)."""
    parser.add_argument("--model", choices=["llama", "deepseek"], default="llama",
                        help="llama (default) or deepseek: a tiny random DeepSeek-V3 on its "
                             "latent (MLA) cache, with the cache's memory beside the MHA and "
                             "GQA forms' (needs transformers: pip install 'pagedkv[hf]')")
    parser.add_argument("--requests", type=argtypes.positive_int, default=48,
                        help="requests (default 48)")
    parser.add_argument("--system-prompt-len", type=argtypes.count, default=48,
                        help="tokens of the system prompt every other request opens with "
                             "(default 48)")
    parser.add_argument("--max-prompt", type=argtypes.positive_int, default=64,
                        help="longest own prompt, tokens (default 64; at least 4)")
    parser.add_argument("--max-tokens", type=argtypes.positive_int, default=64,
                        help="longest output, tokens (default 64)")
    parser.add_argument("--max-model-len", type=argtypes.positive_int, default=192,
                        help="the model's positions and the contiguous reservation (default 192)")
    parser.add_argument("--kv-budget-requests", type=argtypes.positive_int, default=6,
                        help="KV budget, in contiguous max_model_len reservations (default 6)")
    parser.add_argument("--block-size", type=argtypes.positive_int, default=16,
                        help="tokens per block of the paged run (default 16)")
    parser.add_argument("--device", type=_device, default="cuda" if torch.cuda.is_available()
                        else "cpu", help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default="float32")
    parser.add_argument("--cache-dtype", type=argtypes.cache_dtype, metavar="FORMAT",
                        help="KV cache format of both runs (default: --dtype): int8, int4, "
                             "fp8_per_token_head (a scale per token and head), fp8 (a scale "
                             "per layer); the budget stays --dtype's, so more requests fit")
    parser.add_argument("--seed", type=argtypes.count, default=0, help="seed (default 0)")
    parser.add_argument("--threads", type=argtypes.positive_int,
                        help="torch CPU threads (default: torch's)")
    parser.add_argument("--tp", type=argtypes.positive_int, default=1,
                        help="tensor parallel ranks (default 1); more than 1 needs torchrun "
                             "--nproc-per-node TP")
    parser.add_argument("--tp-timeout", type=argtypes.positive_float, default=60.0,
                        help="seconds a rank waits for the others in a collective before "
                             "exiting with an error (default 60)")
    parser.set_defaults(parser=parser)


def run(args: argparse.Namespace) -> int:
    """Runs ``pagedkv demo`` with the options of ``add_arguments`` (and ``--json``); rank 0
    prints the report. Exit status 1 when the two runs' tokens differ."""
    _check_lengths(args)
    if args.model == "deepseek":
        from pagedkv.tools import demo_mla

        if args.cache_dtype is not None:
            args.parser.error("argument --cache-dtype: the deepseek demo serves its latent "
                              "cache in --dtype")
        return demo_mla.run(args)
    _check_tp(args.parser, args.tp)
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        on_gpu = torch.device(args.device).type == "cuda"
        tp = init_tensor_parallel(args.tp, args.tp_timeout, "nccl" if on_gpu else "gloo")
        device = tp.device if on_gpu else args.device
        report = run_demo(args.requests, args.system_prompt_len, args.max_prompt,
                          args.max_tokens, args.max_model_len, args.kv_budget_requests,
                          args.block_size, device, getattr(torch, args.dtype), args.seed, tp,
                          args.cache_dtype)
    except TensorParallelError as e:
        print(f"pagedkv demo: error: {e}", file=sys.stderr)
        return 1
    tp.close()
    if tp.is_first:
        report.pop("outputs")
        print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0 if report["outputs_match"] else 1


def main(argv: list[str] | None = None) -> int:
    """``pagedkv demo`` with the arguments ``argv`` (default: the process's)."""
    from pagedkv.tools import cli

    return cli.main(["demo", *(sys.argv[1:] if argv is None else argv)])


def _check_lengths(args: argparse.Namespace) -> None:
    if args.max_prompt < 4:
        args.parser.error(f"argument --max-prompt: must be >= 4, got {args.max_prompt}")
    longest = args.system_prompt_len + args.max_prompt + args.max_tokens
    if longest > args.max_model_len:
        args.parser.error(f"argument --max-model-len: a request may hold {longest} tokens "
                          f"(--system-prompt-len + --max-prompt + --max-tokens), more than "
                          f"{args.max_model_len}")


def _check_tp(parser: argparse.ArgumentParser, tp: int) -> None:
    try:
        demo_config().check_tp(tp)
    except InvalidArgumentError as e:
        parser.error(f"argument --tp: {e}")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if tp != world:
        parser.error(f"argument --tp: {tp} ranks need torchrun --nproc-per-node {tp} "
                     f"(this is {world} process(es))")
