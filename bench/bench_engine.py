"""Step times of the real engine on the CPU, to calibrate the simulator's cost model.

python -m bench.bench_engine [--quick] [--threads N] [--repeats N]

Two random Llama models (the demo's, and a bigger one) serve batches of chosen shapes: decode
batches of 1..64 sequences at contexts of 16..1024 tokens (with the prefills that start them),
lone and batched prefills of 16..1024 tokens, prefills that join a running decode batch (mixed
steps), and a decode batch that outgrows its blocks and swaps to a CPU pool. Every engine step
is a row: its ``StepShape`` (``engine.last_shape``) and wall time (``engine.last_seconds``).
``pagedkv.tools.costmodel.load_calibration(path, model)`` fits a ``LinearModel`` to one model's
rows; this script prints that fit per case. Writes bench/results/bench_engine.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from pagedkv.serving.engine import EngineConfig, LLMEngine, SamplingParams, StepShape
from pagedkv.serving.model import LlamaForCausalLM, ModelConfig
from pagedkv.tools.costmodel import SHAPE_FIELDS, LinearModel, load_calibration
from pagedkv.tools.demo import random_model

RESULTS = Path(__file__).parent / "results"
BLOCK = 16

MODELS = {
    # the model of ``pagedkv demo``, with room for 1024-token contexts
    "demo": ModelConfig(vocab_size=512, hidden_size=128, intermediate_size=256,
                        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                        max_position_embeddings=2048),
    "llama-h512": ModelConfig(vocab_size=32000, hidden_size=512, intermediate_size=1536,
                              num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
                              max_position_embeddings=2048),
}

# Most tokens a case may prefill (batch x context), per model: the bigger model prefills about
# 3 tokens/ms on 2 cores, so its decode batches stay small at long contexts.
TOKEN_BUDGET = {("demo", False): 65536, ("demo", True): 8192,
                ("llama-h512", False): 2048, ("llama-h512", True): 512}


@dataclasses.dataclass
class Case:
    """Requests that arrive at given steps: ``arrivals`` maps a step index to prompt lengths;
    each request generates ``max_tokens`` tokens."""

    name: str
    arrivals: dict[int, list[int]]
    max_tokens: int


def cases(model: str, quick: bool) -> list[Case]:
    """The batch shapes of one model, within its token budget."""
    budget = TOKEN_BUDGET[model, quick]
    steps = 3 if quick else 6
    out = []
    for batch in (1, 4, 16, 64):
        for context in (16, 128, 1024):
            if batch * context <= budget:
                out.append(Case(f"decode {batch} x {context}", {0: [context] * batch}, steps))
    for length in (16, 128, 512, 1024):
        if length <= budget:
            out.append(Case(f"prefill {length}", {0: [length]}, 1))
    for batch, length in ((4, 256), (8, 512)):
        if batch * length <= budget:
            out.append(Case(f"prefill {batch} x {length}", {0: [length] * batch}, 1))
    # mixed: prompts join a decode batch that is already running
    for batch, context, prompt in ((4, 16, 128), (8, 128, 512), (4, 1024, 128), (64, 16, 1024)):
        if batch * context + prompt <= budget:
            out.append(Case(f"decode {batch} x {context} + prefill {prompt}",
                            {0: [context] * batch, 2: [prompt]}, steps))
    return out


def _prompt(rng: random.Random, length: int, vocab: int) -> list[int]:
    return [rng.randrange(vocab) for _ in range(length)]


def run_case(engine: LLMEngine, case: Case, rng: random.Random) -> list[dict]:
    """Serve ``case`` to completion on ``engine``; one row per step."""
    vocab = engine.model.config.vocab_size
    params = SamplingParams(max_tokens=case.max_tokens, ignore_eos=True)
    rows, step = [], 0
    while step == 0 or engine.has_unfinished() or step <= max(case.arrivals):
        for length in case.arrivals.get(step, []):
            engine.add_request(_prompt(rng, length, vocab), params)
        if engine.has_unfinished():
            engine.step()
            shape = engine.last_shape
            rows.append({"case": case.name, **{f: getattr(shape, f) for f in SHAPE_FIELDS},
                         "seconds": engine.last_seconds})
        step += 1
    return rows


def median_of(repeats: int, serve: Callable[[], list[dict]]) -> list[dict]:
    """Serve a case ``repeats`` times; each step's row keeps the median time (``seconds``) and
    all of them (``samples``). The median, not the fastest: the fit should predict a typical
    run, which is what an engine (and bench/validate_sim.py) measures; the fastest repeat
    biased the predictions about 10% low. The scheduler is deterministic, so every repeat runs
    the same shapes."""
    runs = [serve() for _ in range(repeats)]
    rows = []
    for samples in zip(*runs, strict=True):
        shapes = {tuple(r[f] for f in SHAPE_FIELDS) for r in samples}
        if len(shapes) != 1:
            raise RuntimeError(f"{samples[0]['case']}: repeats ran different shapes {shapes}")
        times = [r["seconds"] for r in samples]
        rows.append({**samples[0], "seconds": statistics.median(times), "samples": times})
    return rows


def swap_engine(model: LlamaForCausalLM, max_tokens: int) -> tuple[LLMEngine, Case]:
    """Eight requests decode in a pool that holds only their prompts: once they outgrow their
    blocks the newest are swapped out to a CPU pool, and back in when the others finish (the
    steps with ``swap_blocks`` > 0)."""
    prompt, batch = 56, 8
    blocks_each = -(-(prompt + max_tokens) // BLOCK)
    engine = LLMEngine(model, EngineConfig(
        block_size=BLOCK, num_blocks=batch * -(-prompt // BLOCK) + 2,
        num_cpu_blocks=batch * blocks_each, max_num_seqs=batch, max_num_batched_tokens=4096,
        enable_prefix_caching=False))
    return engine, Case(f"decode {batch} x {prompt}, swapping", {0: [prompt] * batch}, max_tokens)


def bench_model(name: str, quick: bool, repeats: int) -> dict:
    """All cases of one model on one engine (sized for the largest), after a warm-up case."""
    config = MODELS[name]
    model = random_model(config)
    rng = random.Random(0)
    todo = cases(name, quick)
    most = max(sum(-(-(length + c.max_tokens) // BLOCK) for lens in c.arrivals.values()
                   for length in lens) for c in todo)
    engine = LLMEngine(model, EngineConfig(
        block_size=BLOCK, num_blocks=most + 8, max_num_seqs=64, max_num_batched_tokens=4096,
        enable_prefix_caching=False))
    run_case(engine, Case("warm-up", {0: [64] * 4, 1: [128]}, 4), rng)
    rows = []
    for case in todo:
        rows += median_of(repeats, lambda case=case: run_case(engine, case, rng))
    swapping, case = swap_engine(model, 16 if quick else 32)
    rows += median_of(repeats, lambda: run_case(swapping, case, rng))
    params = sum(p.numel() for p in model.parameters())
    return {"config": dataclasses.asdict(config), "params": params, "dtype": "float32",
            "block_size": BLOCK, "repeats": repeats, "rows": rows}


def run(quick: bool = False, repeats: int | None = None) -> dict:
    """The measured rows of every model, keyed by model name, with the machine's description."""
    repeats = repeats or 3
    start, load_before = time.perf_counter(), os.getloadavg()
    models = {name: bench_model(name, quick, repeats) for name in MODELS}
    machine = {"cpu": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
               "threads": torch.get_num_threads(), "torch": torch.__version__,
               "load_average_before": load_before, "load_average": os.getloadavg(),
               "seconds": round(time.perf_counter() - start, 1)}
    return {"machine": machine, "quick": quick, "models": models}


def print_table(result: dict, fits: dict[str, LinearModel]) -> None:
    """Per case: steps, mean shape, measured and fitted mean step time."""
    print(f"{'model':<12}{'case':<34}{'steps':>6}{'q tok':>7}{'kv_read':>9}{'swap':>6}"
          f"{'meas ms':>9}{'fit ms':>9}")
    for name, data in result["models"].items():
        fit = fits[name]
        by_case: dict[str, list[dict]] = {}
        for row in data["rows"]:
            by_case.setdefault(row["case"], []).append(row)
        for case, rows in by_case.items():
            mean = {f: statistics.fmean(r[f] for r in rows) for f in (*SHAPE_FIELDS, "seconds")}
            predicted = statistics.fmean(
                fit.step_seconds(StepShape(**{f: r[f] for f in SHAPE_FIELDS})) for r in rows)
            print(f"{name:<12}{case:<34}{len(rows):>6}{mean['query_tokens']:>7.0f}"
                  f"{mean['kv_read']:>9.0f}{mean['swap_blocks']:>6.1f}"
                  f"{mean['seconds'] * 1e3:>9.2f}{predicted * 1e3:>9.2f}")
    for name, fit in fits.items():
        print(f"{name}: c0 {fit.c0 * 1e3:.3f} ms, per seq {fit.c_seq * 1e6:.2f} us, per query "
              f"token {fit.c_query * 1e6:.2f} us, per 1k attended {fit.c_attended * 1e9:.2f} us, "
              f"per 1k kv_read {fit.c_kv * 1e9:.2f} us, per swap block {fit.c_swap * 1e6:.2f} us; "
              f"error median {fit.fit_error_median:.1%}, p90 {fit.fit_error_p90:.1%} "
              f"over {fit.num_rows} steps")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small batches, few steps")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    parser.add_argument("--repeats", type=int,
                        help="runs of each case, the fastest kept (default: 2)")
    parser.add_argument("--out", type=Path, default=RESULTS / "bench_engine.json")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    result = run(args.quick, args.repeats)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    fits = {name: load_calibration(args.out, name) for name in result["models"]}
    print_table(result, fits)
    machine = result["machine"]
    print(f"{machine['seconds']} s; {machine['threads']} threads on {machine['cpus']} CPUs, "
          f"load average {machine['load_average_before'][0]:.1f} before, "
          f"{machine['load_average'][0]:.1f} after (other work skews the times)")
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
