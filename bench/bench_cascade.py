"""Cascade (shared-prefix) attention against plain paged_attention, side by side.

G decode requests share a P-token prefix (whole blocks) and own S tokens each (bfloat16, 32
query heads / 8 kv heads, head size 128, block size 16). Each repetition times the plain call
and the cascade (``pagedkv.blocks.cascade``: the prefix level over the shared blocks once for
all G queries, the suffix level, the merge) in turn, each after a torch.sum over 256 MiB (8x a
32 MiB L3: K/V come from DRAM), and a probe (that sum, timed). Rows report each one's median
time, the plain call's K/V bytes per second as a fraction of the probe's, and the speedup: the
median over repetitions of plain / cascade. ``--sweep`` adds the (G, P) grid that sets
``CascadePolicy``'s defaults.

``--engine`` serves G parallel samples of one long prompt (the prompt's blocks a prefix-cache
hit for all of them) on ``LLMEngine`` with ``EngineConfig(cascade=True)`` and ``False`` in turn,
a random Llama whose attention has this bench's head size (2 layers, 8 q / 2 kv heads), in
float32 and in bfloat16, and reports the decode steps' tokens/s both ways (median over runs)
and the share of requests whose greedy tokens are the same both ways. In float32 that must be
all of them (the run fails otherwise); in bfloat16 the cascade adds in another order (and the
pair path's prefix level rounds P to bf16), so a few outputs land a last-place step apart, and
the random model's near-ties then flip a later token of some requests (docs/cascade.md).

    python -m bench.bench_cascade [--quick] [--sweep] [--engine] [--device cpu]

prints the tables and writes bench/results/cascade.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

import pagedkv  # noqa: F401  (loads torch.ops.pagedkv)
from pagedkv import ops
from pagedkv.blocks.cascade import CascadePolicy, plan_cascade
from pagedkv.serving.engine import EngineConfig, LLMEngine, SamplingParams
from pagedkv.serving.model import ModelConfig
from pagedkv.tools.demo import random_model

HEADS, KV_HEADS, HEAD_SIZE, BLOCK = 32, 8, 128, 16
RESULTS = Path(__file__).resolve().parent / "results"


def case(group: int, prefix: int, suffix: int, device: torch.device):
    """Caches, tables and queries of G requests sharing `prefix` tokens, `suffix` own each."""
    shared = prefix // BLOCK
    own = -(-suffix // BLOCK)
    num_blocks = 1 + shared + group * own
    shape = (num_blocks, KV_HEADS, BLOCK, HEAD_SIZE)
    kc = torch.randn(shape, dtype=torch.bfloat16, device=device)
    vc = torch.randn(shape, dtype=torch.bfloat16, device=device)
    ids = torch.randperm(num_blocks - 1)[:shared + group * own] + 1
    tables = torch.zeros(group, shared + own, dtype=torch.int32)
    tables[:, :shared] = ids[:shared]
    tables[:, shared:] = ids[shared:].view(group, own)
    lens = torch.full((group,), prefix + suffix, dtype=torch.int32)
    query = torch.randn(group, HEADS, HEAD_SIZE, dtype=torch.bfloat16, device=device)
    plan = plan_cascade(tables.numpy(), lens.numpy(), 1, BLOCK, CascadePolicy.always(),
                        decode=True, device=device)
    args = dict(key_cache=kc, value_cache=vc, block_tables=tables.to(device),
                seq_lens=lens.to(device), query_start_loc=None, max_seq_len=prefix + suffix,
                max_query_len=1, scale=HEAD_SIZE**-0.5, alibi_slopes=None, sliding_window=-1,
                soft_cap=0.0, k_scale=None, v_scale=None, lse_out=None)
    return query, args, plan


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, device) -> float:
    sync(device)
    t = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t


def run(group: int, prefix: int, suffix: int, device: torch.device, reps: int) -> dict:
    query, args, plan = case(group, prefix, suffix, device)
    flush = torch.ones(64 << 20, dtype=torch.float32, device=device)  # 256 MiB
    out_plain, out_cascade = torch.empty_like(query), torch.empty_like(query)
    plain = lambda: ops.paged_attention(out_plain, query, **args)  # noqa: E731
    cache = dict(key_cache=args["key_cache"], value_cache=args["value_cache"])
    cascade = lambda: plan.attention(out_cascade, query, scale=args["scale"], **cache)  # noqa
    times = {"plain": [], "cascade": [], "probe": []}
    for rep in range(reps + 1):
        for name, fn in (("plain", plain), ("cascade", cascade)):
            flush.sum()
            t = timed(fn, device)
            if rep:
                times[name].append(t)
        t = timed(lambda: flush.sum(), device)
        if rep:
            times["probe"].append(t)
    err = (out_plain.float() - out_cascade.float()).abs().max().item()
    kv_bytes = 2 * group * (prefix + suffix) * KV_HEADS * HEAD_SIZE * 2
    probe_gbs = statistics.median(flush.numel() * 4 / t for t in times["probe"]) / 1e9
    plain_gbs = kv_bytes / statistics.median(times["plain"]) / 1e9
    return dict(group=group, prefix=prefix, suffix=suffix,
                plain_ms=1e3 * statistics.median(times["plain"]),
                cascade_ms=1e3 * statistics.median(times["cascade"]),
                speedup=statistics.median(p / c for p, c in zip(times["plain"],
                                                                times["cascade"], strict=True)),
                plain_gbs=plain_gbs, plain_fraction=plain_gbs / probe_gbs, probe_gbs=probe_gbs,
                max_abs_diff=err)


ENGINE_MODEL = ModelConfig(vocab_size=512, hidden_size=1024, intermediate_size=512,
                           num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
                           max_position_embeddings=8192)


def serve(model, prompts: list[list[int]], new: int, cascade: bool,
          device: torch.device) -> tuple[list[list[int]], float, int]:
    """Greedy tokens of ``prompts``, the decode steps' seconds and tokens. The first prompt
    runs alone first, so the others find its blocks in the prefix cache."""
    blocks = sum(-(-(len(p) + new) // BLOCK) for p in prompts) + 8
    engine = LLMEngine(model, EngineConfig(
        block_size=BLOCK, num_blocks=blocks, max_num_seqs=len(prompts),
        max_num_batched_tokens=max(map(len, prompts)) + 64 * len(prompts),
        enable_prefix_caching=True, cascade=cascade))
    params = SamplingParams(max_tokens=new, ignore_eos=True)
    engine.generate(prompts[:1], params)
    for prompt in prompts:
        engine.add_request(prompt, params)
    seconds, tokens, done = 0.0, 0, []
    while engine.has_unfinished():
        sync(device)
        t = time.perf_counter()
        done += engine.step()
        sync(device)
        if engine.last_shape.prefill_tokens == 0:
            seconds += time.perf_counter() - t
            tokens += engine.last_shape.query_tokens
    if cascade and not engine.stats.cascade_steps:
        raise RuntimeError("the cascade engine planned no cascade")
    outputs = [r.output_token_ids for r in sorted(done, key=lambda r: r.request_id)]
    return outputs, seconds, tokens


def run_engine(group: int, prefix: int, suffix: int, new: int, device: torch.device,
               reps: int, dtype: torch.dtype) -> dict:
    model = random_model(ENGINE_MODEL).to(device=device, dtype=dtype)
    rng = torch.Generator().manual_seed(0)
    shared = torch.randint(0, ENGINE_MODEL.vocab_size, (prefix,), generator=rng).tolist()
    prompts = [shared + torch.randint(0, ENGINE_MODEL.vocab_size, (suffix,),
                                      generator=rng).tolist() for _ in range(group)]
    rates: dict[bool, list[float]] = {True: [], False: []}
    outputs = {}
    for _ in range(reps):
        for cascade in (False, True):
            outputs[cascade], seconds, tokens = serve(model, prompts, new, cascade, device)
            rates[cascade].append(tokens / seconds)
    same = sum(a == b for a, b in zip(outputs[True], outputs[False], strict=True)) / group
    if dtype == torch.float32 and same < 1:
        raise RuntimeError(f"float32: cascade on and off gave different greedy tokens for "
                           f"{1 - same:.0%} of the requests")
    return dict(group=group, prefix=prefix, suffix=suffix, new=new, same_tokens=same,
                dtype=str(dtype).removeprefix("torch."),
                plain_tokens_per_s=statistics.median(rates[False]),
                cascade_tokens_per_s=statistics.median(rates[True]),
                speedup=statistics.median(c / p for c, p in zip(rates[True], rates[False],
                                                                strict=True)))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.bench_cascade", description=__doc__)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="smaller sizes, fewer runs")
    parser.add_argument("--sweep", action="store_true", help="the (G, P) grid too")
    parser.add_argument("--engine", action="store_true",
                        help="LLMEngine's decode tokens/s with cascade on and off too")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    reps = 3 if args.quick else 7
    cases = [(16, 1024, 128), (4, 256, 128)] if args.quick else [(64, 4096, 128), (8, 512, 128)]
    if args.sweep:
        cases += [(g, p, 128) for g in (2, 4, 8, 16, 32) for p in (256, 512, 1024, 2048)]
    rows = [run(*c, device, reps) for c in cases]
    prefill = ""
    if device.type == "cpu":  # which arithmetic the prefix level (bf16 prefill items) took
        prefill = (", bf16 prefill on AMX tiles" if ops.cpu_amx_tiles(HEAD_SIZE)
                   else ", bf16 prefill on vdpbf16ps" if ops.cpu_bf16_dot_products(HEAD_SIZE)
                   else ", bf16 prefill on float FMAs")
    print(f"cascade vs plain paged_attention, decode, bf16 {HEADS}q/{KV_HEADS}kv head "
          f"{HEAD_SIZE} block {BLOCK}, {device}, median of {reps}{prefill}")
    print(f"{'G':>4} {'prefix':>7} {'own':>5} {'plain ms':>9} {'cascade ms':>10} "
          f"{'speedup':>8} {'plain GB/s':>10} {'of probe':>8} {'max|diff|':>9}")
    for r in rows:
        print(f"{r['group']:>4} {r['prefix']:>7} {r['suffix']:>5} {r['plain_ms']:>9.2f} "
              f"{r['cascade_ms']:>10.2f} {r['speedup']:>7.2f}x {r['plain_gbs']:>10.1f} "
              f"{r['plain_fraction']:>8.2f} {r['max_abs_diff']:>9.2g}")
    engine = []
    if args.engine:
        shapes = [(16, 2048, 16, 8)] if args.quick else [(64, 4096, 16, 16), (8, 512, 16, 16)]
        engine = [run_engine(*c, device, 3 if args.quick else 5, dtype)
                  for dtype in (torch.float32, torch.bfloat16) for c in shapes]
        print(f"\nLLMEngine decode steps, random Llama (2 layers, 8q/2kv head "
              f"{HEAD_SIZE}), parallel samples of one prompt")
        print(f"{'dtype':>8} {'G':>4} {'prefix':>7} {'own':>5} {'new':>4} {'plain tok/s':>11} "
              f"{'cascade tok/s':>13} {'speedup':>8} {'same tokens':>11}")
        for r in engine:
            print(f"{r['dtype']:>8} {r['group']:>4} {r['prefix']:>7} {r['suffix']:>5} "
                  f"{r['new']:>4} "
                  f"{r['plain_tokens_per_s']:>11.0f} {r['cascade_tokens_per_s']:>13.0f} "
                  f"{r['speedup']:>7.2f}x {r['same_tokens']:>11.0%}")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "cascade.json").write_text(json.dumps(
        dict(device=str(device), rows=rows, engine=engine), indent=1))


if __name__ == "__main__":
    main()
