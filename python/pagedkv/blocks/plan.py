"""Cache plans: what the KV cache tensors must undergo before a step's kernels, as data.

The BlockManager is integer bookkeeping. Whatever its calls imply for the cache contents
(copy-on-write copies, swaps to and from the CPU pool, debug NaN fills) accumulates in a pending
``CachePlan``; ``PlanExecutor.run(manager)`` applies it to the tensors, one phase at a time, with
one ``copy_blocks`` and one ``swap_blocks`` per layer and direction, and marks each phase done in
the manager as soon as it ran. Run the plan before the step's kernels read or write the cache::

    batch = manager.build_batch(seq_ids, query_lens)     # tensors only; no kernel runs
    executor.run(manager)                                # copies, swaps, NaN fills
    model(..., cache, batch)                             # reads and writes K/V

The phases run in the order of ``PHASES``, and the manager keeps the plan executable in that
order whatever sequence of calls built it:

1. ``swap_out`` (device -> CPU) reads device blocks before anything writes them;
2. ``copies`` (device -> device) read sources that the plan holds a reference to, so that nothing
   reallocates them, and that are never destinations (a copy of a block that is itself waiting
   to be copied reads the original source instead: fork chains);
3. ``swap_in`` (CPU -> device) reads CPU blocks the plan holds a reference to;
4. ``poison`` fills blocks whose content is stale with NaN (``BlockManager(debug_nan=True)``).

A destination whose block is reallocated before the plan runs is dropped from it. If a phase
raises, the phases before it stay done, it and the later ones stay pending, and the next run
applies them (with whatever the manager added since).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedkv.cache.paged_cache import PagedKVCache

__all__ = ["PHASES", "CachePlan", "PlanExecutor", "cpu_cache_for"]

PHASES = ("swap_out", "copies", "swap_in", "poison")

Pairs = tuple[tuple[int, int], ...]


@dataclass(frozen=True, slots=True)
class CachePlan:
    """A snapshot of a manager's pending cache work.

    ``swap_out``: (device block, CPU block) pairs; ``copies``: (src, dst) device block pairs;
    ``swap_in``: (CPU block, device block) pairs; ``poison``: device blocks to fill with NaN.
    Within a phase the pairs are independent (no block is both read and written, no destination
    twice), so each phase is one kernel call. ``version`` ties the snapshot to the manager state
    it was taken from.
    """

    swap_out: Pairs = ()
    copies: Pairs = ()
    swap_in: Pairs = ()
    poison: tuple[int, ...] = ()
    version: int = 0

    def __bool__(self) -> bool:
        return bool(self.swap_out or self.copies or self.swap_in or self.poison)

    def __len__(self) -> int:
        """Blocks written by the plan."""
        return len(self.swap_out) + len(self.copies) + len(self.swap_in) + len(self.poison)


class PlanExecutor:
    """Applies a BlockManager's plans to a device cache and, for swaps, a CPU cache.

    Args:
        cache: the device PagedKVCache, one block per manager block id.
        cpu_cache: the CPU PagedKVCache behind the manager's CPU pool (needed when the manager
            swaps; ``cpu_cache_for`` makes one).
    """

    def __init__(self, cache: PagedKVCache, cpu_cache: PagedKVCache | None = None) -> None:
        self.cache, self.cpu_cache = cache, cpu_cache

    def run(self, manager) -> CachePlan:
        """Apply the manager's pending plan; returns it. Each phase is marked done in the
        manager right after it ran, so a failure leaves exactly the unfinished phases pending.
        On return the manager's plan is empty (completing the copies can release their sources,
        which ``debug_nan`` then fills in a second, poison-only pass)."""
        plan = manager.plan()
        if (plan.swap_out or plan.swap_in) and self.cpu_cache is None:
            raise ValueError("the plan swaps blocks but the executor has no cpu_cache")
        self._run(manager, plan)
        rest = manager.plan()  # with debug_nan, copy sources the copies released are poisoned
        if rest:
            self._run(manager, rest)
        return plan

    def _run(self, manager, plan: CachePlan) -> None:
        for phase in PHASES:
            work = getattr(plan, phase)
            if work:
                self.apply(phase, work)
            manager.complete(plan, phase)

    def apply(self, phase: str, work: Pairs | tuple[int, ...]) -> None:
        """Apply one phase's pairs (or blocks, for ``poison``) to the tensors."""
        if phase == "swap_out":
            self.cache.swap_to(self.cpu_cache, work)
        elif phase == "copies":
            self.cache.copy_blocks(work)
        elif phase == "swap_in":
            self.cpu_cache.swap_to(self.cache, work)
        elif phase == "poison":
            self.cache.fill_blocks(work)
        else:
            raise ValueError(f"unknown plan phase {phase!r}; phases: {', '.join(PHASES)}")


def cpu_cache_for(cache: PagedKVCache, num_cpu_blocks: int) -> PagedKVCache:
    """A CPU cache of ``num_cpu_blocks`` blocks shaped like ``cache`` (pinned when ``cache`` is on
    a GPU, so swaps are asynchronous copies)."""
    return PagedKVCache(cache.spec, num_cpu_blocks, "cpu",
                        pin_memory=cache.device.type == "cuda" and torch.cuda.is_available())
