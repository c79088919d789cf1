"""Tokens/s of the serving engine on the CPU, against Hugging Face ``generate``, and its time split.

python -m bench.bench_serve [--quick] [--repeats N] [--threads N] [--out PATH]

Each model of ``bench.bench_engine.MODELS`` (random weights, float32) serves the same requests
(48; every other one behind a shared 48-token system prompt, as in ``pagedkv demo``; every one
generates ``max_new`` tokens, greedy, EOS ignored) three ways, alternating, ``--repeats`` times:

- ``hf``: ``transformers`` ``generate`` on one left-padded batch of all requests;
- ``engine_flinear``: ``LLMEngine`` with the model's linear layers on ``F.linear``;
- ``engine_onednn``: the same engine after ``model.prepack()`` (oneDNN, prepacked weights).

Tokens/s is generated tokens over the wall time of the ``generate`` call (median of the
repeats; setup such as the engine's KV cache allocation is outside it). A warm-up run of each
way comes first (oneDNN builds a kernel per new batch shape). Each engine way then runs once
more with timing hooks for the split of its time: ``linears`` (forward hooks on every
``pagedkv.serving.linear.LinearGroup``), ``attention`` and ``cache_writes`` (the paged ops,
timed through ``use_kernels``), ``other_model_ops`` (the rest of the model's forward: embedding,
norms, rotary, activations, residuals) and ``engine_overhead`` (the rest of ``generate``:
scheduling, block tables, batch tensors, sampling, Python). The CPU runs ops synchronously, so
wall-clock hooks measure them. Writes bench/results/bench_serve.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import platform
import statistics
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path

import torch

from bench.bench_engine import MODELS
from pagedkv import ops
from pagedkv.serving.engine import EngineConfig, LLMEngine, SamplingParams
from pagedkv.serving.linear import LinearGroup, onednn_dtypes
from pagedkv.serving.model import LlamaForCausalLM, ModelConfig
from pagedkv.tools.demo import make_requests, random_model

RESULTS = Path(__file__).parent / "results"
BLOCK = 16
WAYS = ("hf", "engine_flinear", "engine_onednn")


def hf_model(model: LlamaForCausalLM):
    """A transformers LlamaForCausalLM with ``model``'s config and weights."""
    import transformers

    c: ModelConfig = model.config
    hf_config = transformers.LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size, num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
        head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps,
        max_position_embeddings=c.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": c.rope_theta},
        tie_word_embeddings=c.tie_word_embeddings, attention_bias=c.attention_bias,
        mlp_bias=c.mlp_bias, bos_token_id=None, eos_token_id=None, pad_token_id=0)
    hf = transformers.LlamaForCausalLM(hf_config)
    hf.load_state_dict(model.state_dict(), strict=True)
    return hf.eval()


def hf_generate(hf, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    """Greedy ``max_new`` tokens per prompt, all prompts in one left-padded batch."""
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.inference_mode():
        out = hf.generate(ids, attention_mask=mask, max_new_tokens=max_new,
                          min_new_tokens=max_new, do_sample=False, pad_token_id=0)
    return out[:, width:].tolist()


def engine_generate(model: LlamaForCausalLM, prompts: list[list[int]], max_new: int,
                    context: AbstractContextManager | None = None,
                    ) -> tuple[float, list[list[int]]]:
    """Greedy ``max_new`` tokens per prompt through an LLMEngine with room for all of them; the
    seconds of its ``generate`` call (inside ``context``) and the tokens."""
    blocks = sum(-(-(len(p) + max_new) // BLOCK) for p in prompts) + 8
    engine = LLMEngine(model, EngineConfig(block_size=BLOCK, num_blocks=blocks,
                                           max_num_seqs=len(prompts)))
    params = SamplingParams(max_tokens=max_new, ignore_eos=True)
    with context or nullcontext():
        start = time.perf_counter()
        out = engine.generate(prompts, params)
        return time.perf_counter() - start, out


class _TimedKernels:
    """The paged ops of ``kernels``, each call's wall time added to ``seconds``."""

    def __init__(self, kernels, seconds: dict[str, float]) -> None:
        self.kernels, self.seconds = kernels, seconds

    def reshape_and_cache(self, **kwargs) -> None:
        start = time.perf_counter()
        self.kernels.reshape_and_cache(**kwargs)
        self.seconds["cache_writes"] += time.perf_counter() - start

    def paged_attention(self, **kwargs) -> None:
        start = time.perf_counter()
        self.kernels.paged_attention(**kwargs)
        self.seconds["attention"] += time.perf_counter() - start


@contextmanager
def timing_hooks(model: LlamaForCausalLM, seconds: dict[str, float]) -> Iterator[None]:
    """Adds the wall time of the model's forward, its linear groups and its paged ops to
    ``seconds`` while inside."""
    starts: dict[int, float] = {}

    def pre(module, args) -> None:
        starts[id(module)] = time.perf_counter()

    def post(name: str):
        def hook(module, args, output) -> None:
            seconds[name] += time.perf_counter() - starts.pop(id(module))
        return hook

    handles = [model.register_forward_pre_hook(pre), model.register_forward_hook(post("model"))]
    for module in model.modules():
        if isinstance(module, LinearGroup):
            handles += [module.register_forward_pre_hook(pre),
                        module.register_forward_hook(post("linears"))]
    model.use_kernels(_TimedKernels(ops, seconds))
    try:
        yield
    finally:
        model.use_kernels(ops)
        for handle in handles:
            handle.remove()


def profile_split(model: LlamaForCausalLM, prompts: list[list[int]], max_new: int) -> dict:
    """Seconds and shares of one engine run: linears, attention, cache writes, other model ops,
    engine overhead."""
    seconds: dict[str, float] = defaultdict(float)
    total, _ = engine_generate(model, prompts, max_new, timing_hooks(model, seconds))
    parts = {"linears": seconds["linears"], "attention": seconds["attention"],
             "cache_writes": seconds["cache_writes"]}
    parts["other_model_ops"] = seconds["model"] - sum(parts.values())
    parts["engine_overhead"] = total - seconds["model"]
    return {"seconds": round(total, 4),
            "parts_seconds": {k: round(v, 4) for k, v in parts.items()},
            "parts_share": {k: round(v / total, 4) for k, v in parts.items()}}


def _use(model: LlamaForCausalLM, way: str) -> None:
    model.prepack() if way == "engine_onednn" else model.unpack()


def bench_model(name: str, num_requests: int, max_new: int, repeats: int) -> dict:
    """Tokens/s of the ways on one model, alternating; the engines' time split."""
    config = MODELS[name]
    model = random_model(config)
    hf = hf_model(model)
    requests = make_requests(num_requests, 48, config.vocab_size, 64, max_new, seed=0)
    prompts = [p for p, _ in requests]
    ways = [w for w in WAYS if w != "engine_onednn" or torch.float32 in onednn_dtypes()]

    def serve(way: str) -> tuple[float, list[list[int]]]:
        _use(model, way)
        if way != "hf":
            return engine_generate(model, prompts, max_new)
        start = time.perf_counter()
        out = hf_generate(hf, prompts, max_new)
        return time.perf_counter() - start, out

    outputs = {way: serve(way)[1] for way in ways}  # warm-up
    times: dict[str, list[float]] = {way: [] for way in ways}
    for _ in range(repeats):
        for way in ways:
            seconds, out = serve(way)
            times[way].append(seconds)
            if out != outputs[way]:
                raise RuntimeError(f"{name}: {way} generated other tokens than in its warm-up")
    result = {"config": dataclasses.asdict(config),
              "params": sum(p.numel() for p in model.parameters()),
              "requests": num_requests, "max_new_tokens": max_new,
              "prompt_tokens": sum(map(len, prompts)), "ways": {}}
    for way in ways:
        result["ways"][way] = {
            "tokens_per_s": round(num_requests * max_new / statistics.median(times[way]), 2),
            "seconds": [round(t, 4) for t in times[way]],
            "tokens_equal_hf": outputs[way] == outputs["hf"],
            "requests_equal_hf": sum(a == b for a, b in zip(outputs[way], outputs["hf"],
                                                            strict=True)),
        }
        if way != "hf":
            _use(model, way)
            result["ways"][way]["profile"] = profile_split(model, prompts, max_new)
    model.unpack()
    tps = {way: result["ways"][way]["tokens_per_s"] for way in ways}
    result["speedup"] = {f"{way}_vs_hf": round(tps[way] / tps["hf"], 3) for way in ways[1:]}
    if "engine_onednn" in tps:
        result["speedup"]["onednn_vs_flinear"] = round(
            tps["engine_onednn"] / tps["engine_flinear"], 3)
    return result


def run(models: list[str], num_requests: int, max_new: int, repeats: int) -> dict:
    """Every model's result, with the machine's description and load."""
    start, load_before = time.perf_counter(), os.getloadavg()
    results = {name: bench_model(name, num_requests, max_new, repeats) for name in models}
    machine = {"cpu": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
               "threads": torch.get_num_threads(), "torch": torch.__version__,
               "onednn_dtypes": [str(d).removeprefix("torch.") for d in onednn_dtypes()],
               "load_average_before": load_before, "load_average": os.getloadavg(),
               "seconds": round(time.perf_counter() - start, 1)}
    return {"machine": machine, "models": results}


def print_table(result: dict) -> None:
    parts = ("linears", "attention", "cache_writes", "other_model_ops", "engine_overhead")
    print(f"{'model':<12}{'way':<16}{'tok/s':>9}{'x hf':>7}{'same tokens':>13}"
          + "".join(f"{p:>17}" for p in parts))
    for name, data in result["models"].items():
        hf_tps = data["ways"]["hf"]["tokens_per_s"]
        for way, row in data["ways"].items():
            same = f"{row['requests_equal_hf']}/{data['requests']}"
            line = (f"{name:<12}{way:<16}{row['tokens_per_s']:>9.1f}"
                    f"{row['tokens_per_s'] / hf_tps:>7.2f}{same:>13}")
            if "profile" in row:
                line += "".join(f"{row['profile']['parts_share'][p]:>17.1%}" for p in parts)
            print(line)
        if "onednn_vs_flinear" in data["speedup"]:
            print(f"{name}: oneDNN vs F.linear engine {data['speedup']['onednn_vs_flinear']:.2f}x")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="the demo model only, 8 requests, 8 new tokens, 1 repeat")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    parser.add_argument("--repeats", type=int, help="timed runs of each way (default 3)")
    parser.add_argument("--requests", type=int, help="requests (default 48)")
    parser.add_argument("--max-new", type=int, help="tokens generated per request (default 32)")
    parser.add_argument("--models", nargs="+", choices=list(MODELS), help="default: all")
    parser.add_argument("--out", type=Path, default=RESULTS / "bench_serve.json")
    args = parser.parse_args(argv)
    if importlib.util.find_spec("transformers") is None:
        print("bench_serve: skipped, it compares with transformers (pip install -e .[test])")
        return {}
    if args.threads:
        torch.set_num_threads(args.threads)
    models = args.models or (["demo"] if args.quick else list(MODELS))
    quick = args.quick
    result = run(models, args.requests or (8 if quick else 48),
                 args.max_new or (8 if quick else 32), args.repeats or (1 if quick else 3))
    result["quick"] = args.quick
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print_table(result)
    machine = result["machine"]
    print(f"{machine['seconds']} s; {machine['threads']} threads on {machine['cpus']} CPUs, "
          f"load average {machine['load_average_before'][0]:.1f} before, "
          f"{machine['load_average'][0]:.1f} after (other work skews the times; compare ratios)")
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
