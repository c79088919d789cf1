"""Microbenchmark of the block manager's bookkeeping (host time only, no kernels).

python -m bench.bench_manager [--seqs 256] [--steps 200] [--quick]

- decode step: append one token to each running sequence and build the batch tensors
  (block_tables, seq_lens, slot_mapping, query_start_loc); median per step after a warm-up.
- parallel sampling: prompts forked into n samples that each append a token (copy-on-write of
  the shared last block), the batch, the plan taken and completed (no kernels), then freed.
- allocations per second: BlockAllocator.allocate(1) + free, and add_sequence + free of whole
  prompts with and without prefix-cache hits.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable

from bench.harness import write_host_json
from pagedkv.blocks.allocator import BlockAllocator
from pagedkv.blocks.manager import BlockManager
from pagedkv.blocks.plan import PHASES

BLOCK = 16


def _median_us(step: Callable[[], object], warmup: int, repeat: int) -> tuple[float, float]:
    """Median and minimum wall time of ``step`` in microseconds, after ``warmup`` calls.

    The minimum is the least disturbed run: on a machine busy with other work it is the better
    estimate of the cost itself; on an idle machine the two agree.
    """
    for _ in range(warmup):
        step()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6, min(times) * 1e6


def _running_batch(num_seqs: int, prefix_caching: bool) -> BlockManager:
    rng = random.Random(0)
    manager = BlockManager(num_blocks=num_seqs * 160, block_size=BLOCK,
                           enable_prefix_caching=prefix_caching)
    for seq_id in range(num_seqs):
        manager.add_sequence(seq_id, [rng.randrange(32000) for _ in range(rng.randrange(64, 1024))])
    return manager


def bench_decode_step(num_seqs: int, steps: int, prefix_caching: bool) -> list[dict]:
    """Median host time of one decode step over ``num_seqs`` sequences, and of its two parts."""
    manager = _running_batch(num_seqs, prefix_caching)
    seq_ids = list(range(num_seqs))
    token = iter(range(1 << 62))

    def append() -> None:
        for seq_id in seq_ids:
            manager.append_tokens(seq_id, next(token) % 32000)

    def step() -> None:
        append()
        manager.build_batch(seq_ids)

    case = f"{num_seqs} seqs, block {BLOCK}, prefix caching {'on' if prefix_caching else 'off'}"
    warmup = max(steps // 10, 5)
    return [
        _row("decode step", case, *_median_us(step, warmup, steps), "us/step"),
        _row("decode: append only", case, *_median_us(append, warmup, steps), "us/step"),
        _row("decode: build_batch only", case,
             *_median_us(lambda: manager.build_batch(seq_ids), warmup, steps), "us/step"),
    ]


def bench_parallel_sampling(num_prompts: int, n: int, repeat: int) -> list[dict]:
    """One step of parallel sampling: ``num_prompts`` prompts of 100 tokens, each forked into
    ``n`` samples that append a token; the plan holds one copy per forked sample."""
    rng = random.Random(1)
    prompts = [[rng.randrange(32000) for _ in range(100)] for _ in range(num_prompts)]
    manager = BlockManager(num_prompts * n * 8, BLOCK)

    def step() -> None:
        samples = []
        for p, prompt in enumerate(prompts):
            manager.add_sequence((p, 0), prompt)
            samples.append((p, 0))
            for k in range(1, n):
                manager.fork((p, 0), (p, k))
                samples.append((p, k))
        for sample in samples:
            manager.append_tokens(sample, 7)
        manager.build_batch(samples)
        plan = manager.plan()
        assert len(plan.copies) == num_prompts * (n - 1)
        for phase in PHASES:
            manager.complete(plan, phase)
        for sample in samples:
            manager.free(sample)

    case = f"{num_prompts} prompts x {n} samples, block {BLOCK}"
    return [_row("parallel sampling step", case, *_median_us(step, 3, repeat), "us/step")]


def bench_allocations(count: int) -> list[dict]:
    """Single-block allocate + free pairs per second, and whole-prompt add + free per second."""
    allocator = BlockAllocator(4096, reserve_null_block=True)

    def allocate_and_free() -> None:
        for _ in range(count):
            allocator.free(allocator.allocate(1))

    median, best = _median_us(allocate_and_free, 2, 5)
    rows = [_row("allocate(1) + free", "pool 4096", count * 1e6 / median, count * 1e6 / best,
                 "allocs/s")]
    prompt = list(range(512))
    for label, make_prompt in (("miss", lambda i: [i, *prompt[1:]]), ("hit", lambda i: prompt)):
        manager = BlockManager(num_blocks=4096, block_size=BLOCK)

        def add_and_free(make_prompt=make_prompt, manager=manager) -> None:
            for i in range(100):
                manager.add_sequence(i, make_prompt(i))
            for i in range(100):
                manager.free(i)

        median, best = _median_us(add_and_free, 2, 5)
        rows.append(_row(f"add_sequence + free ({label})", "512-token prompt, block 16",
                         100e6 / median, 100e6 / best, "seqs/s"))
    return rows


def _row(name: str, case: str, median: float, best: float, unit: str) -> dict:
    """``median`` from the median time over the repeats, ``best`` from the fastest repeat."""
    return {"bench": name, "case": case, "median": round(median, 2), "best": round(best, 2),
            "unit": unit}


def run(num_seqs: int = 256, steps: int = 200, quick: bool = False) -> list[dict]:
    """All manager benchmarks as rows ``{bench, case, value, unit}``."""
    steps = min(steps, 20) if quick else steps
    rows = bench_decode_step(num_seqs, steps, prefix_caching=True)
    rows += bench_decode_step(num_seqs, steps, prefix_caching=False)
    rows += bench_parallel_sampling(num_seqs // 4, 4, 5 if quick else 30)
    return rows + bench_allocations(2_000 if quick else 20_000)


def print_table(rows: list[dict]) -> None:
    print(f"{'bench':<30}{'case':<44}{'median':>12}{'best':>12} unit")
    for row in rows:
        print(f"{row['bench']:<30}{row['case']:<44}{row['median']:>12,.1f}{row['best']:>12,.1f} "
              f"{row['unit']}")


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, default=256)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--quick", action="store_true", help="few repeats (smoke test)")
    args = parser.parse_args(argv)
    rows = run(args.seqs, args.steps, args.quick)
    print_table(rows)
    write_host_json("bench_manager", rows)
    return rows


if __name__ == "__main__":
    main()
