"""Cache plans: what the KV cache tensors must undergo before a step's kernels, as data.

The BlockManager is integer bookkeeping. Whatever its calls imply for the cache contents
(copy-on-write copies, swaps to and from the CPU pool, debug NaN fills) it records in its
``PendingPlan``, whose snapshot is a ``CachePlan`` (``manager.plan()``);
``PlanExecutor.run(manager)`` applies that to the tensors, one phase at a time, with
one ``copy_blocks`` and one ``swap_blocks`` per layer and direction, and marks each phase done in
the manager as soon as it ran. Run the plan before the step's kernels read or write the cache::

    batch = manager.build_batch(seq_ids, query_lens)     # tensors only; no kernel runs
    executor.run(manager)                                # copies, swaps, NaN fills
    model(..., cache, batch)                             # reads and writes K/V

The phases (``Phase``) run in the order of ``PHASES``, and the pending plan stays executable in
that order whatever sequence of calls built it:

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
from enum import StrEnum

import torch

from pagedkv.blocks.allocator import BlockAllocator
from pagedkv.cache.paged_cache import PagedKVCache
from pagedkv.errors import InvalidArgumentError, OutOfBlocksError

__all__ = ["PHASES", "CachePlan", "PendingPlan", "Phase", "PlanExecutor", "cpu_cache_for"]


class Phase(StrEnum):
    """A phase of a plan, named after the ``CachePlan`` field that holds its work; members equal
    their names as strings (``Phase.COPIES == "copies"``)."""

    SWAP_OUT = "swap_out"
    COPIES = "copies"
    SWAP_IN = "swap_in"
    POISON = "poison"


PHASES = tuple(Phase)
"""The phases in the order they run."""

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


class PendingPlan:
    """A BlockManager's pending cache work, recorded as its calls imply it.

    Args:
        device: the device pool; the plan holds a reference on every pending copy source.
        cpu: the CPU pool behind swaps (None: the manager does not swap); the plan allocates
            swap-out destinations from it and holds a reference on every pending swap-in source.
        debug_nan: record stale blocks (and the null block) for a NaN fill.

    Work is keyed by destination: every destination is written once, and a source is never a
    destination (a read of a pending destination reads its source). ``version`` changes with
    every change, so a snapshot can be told from the pending plan. The manager checks the
    arguments it passes; ``complete`` checks its own (the executor calls it).
    """

    __slots__ = ("device", "cpu", "version", "_copies", "_swap_ins", "_swap_outs", "_pins",
                 "_poison")

    def __init__(self, device: BlockAllocator, cpu: BlockAllocator | None,
                 debug_nan: bool = False) -> None:
        self.device, self.cpu, self.version = device, cpu, 0
        self._copies: dict[int, int] = {}  # device dst -> device src
        self._swap_ins: dict[int, int] = {}  # device dst -> CPU src
        self._swap_outs: dict[int, int] = {}  # CPU dst -> device src
        self._pins: dict[int, int] = {}  # device block -> references held by pending copies
        self._poison: set[int] | None = set() if debug_nan else None
        if debug_nan and device.null_block is not None:
            self._poison.add(device.null_block)

    @property
    def debug_nan(self) -> bool:
        """Whether stale blocks are recorded for a NaN fill."""
        return self._poison is not None

    @property
    def num_swaps(self) -> int:
        """Blocks the plan moves between the device and the CPU pool (out and in)."""
        return len(self._swap_outs) + len(self._swap_ins)

    def holders(self, block: int) -> int:
        """References to a device block other than those of pending copies (a copy reads its
        source before the step's kernels write it, so these do not make a block shared)."""
        return self.device.ref_counts[block] - self._pins.get(block, 0)

    # -- recording -----------------------------------------------------------------------------

    def allocate(self, num_blocks: int, destination: bool = False) -> list[int]:
        """Allocate ``num_blocks`` device blocks, all or nothing. A pending write into one of them
        is dropped (its content is dead); unless the plan writes them (``destination``) they are
        stale."""
        if not num_blocks:
            return []
        blocks = self.device.allocate(num_blocks)
        if self._copies or self._swap_ins:
            for block in blocks:
                self._cancel_write(block)
        if self._poison is not None:
            if destination:
                self._poison.difference_update(blocks)
            else:
                self._poison.update(blocks)
            self.version += 1
        return blocks

    def release(self, blocks: list[int]) -> None:
        """Drop one device reference from each block; those freed are stale."""
        self.poison(self.device.free(blocks))

    def poison(self, blocks: list[int]) -> None:
        """Device blocks whose content is stale (freed or evicted): NaN-filled under debug_nan."""
        if self._poison is not None and blocks:
            self._poison.update(blocks)
            self.version += 1

    def copy(self, old: int, new: int) -> None:
        """Copy ``old``'s content into the fresh block ``new`` (copy-on-write). A block waiting
        for a swap-in is copied from its CPU block, one waiting for a copy from that copy's source
        (a fork chain); the plan holds a reference on the source until the copy ran."""
        cpu_src = self._swap_ins.get(old)
        if cpu_src is not None:
            self.cpu.incref(cpu_src)
            self._swap_ins[new] = cpu_src
        else:
            src = self._copies.get(old, old)
            self.device.incref(src)
            self._pins[src] = self._pins.get(src, 0) + 1
            self._copies[new] = src
        self.version += 1

    def swap_out(self, table: list[int]) -> tuple[list[int], list[tuple[int, int]]]:
        """Move a block table to the CPU pool, all or nothing: returns the CPU table and the
        (device block, CPU block) pairs queued. A block waiting for a swap-in keeps its CPU block
        (nothing to copy); one waiting for a copy is read from the copy's source."""
        cpu = self.cpu
        reused = [self._swap_ins.get(block) for block in table]
        needed = reused.count(None)
        if cpu is None:
            raise OutOfBlocksError(needed, 0, "cpu")
        cpu.reserve(needed)
        fresh = iter(self._allocate_cpu(needed))
        cpu_table, pairs = [], []
        for block, cpu_block in zip(table, reused, strict=True):
            if cpu_block is None:
                cpu_block = next(fresh)
                self._swap_outs[cpu_block] = self._copies.get(block, block)
                pairs.append((block, cpu_block))
            else:
                cpu.incref(cpu_block)
            cpu_table.append(cpu_block)
        self.version += 1
        return cpu_table, pairs

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """Queue (CPU block, fresh device block) copies; the plan takes over the CPU references."""
        for cpu_block, block in pairs:
            self._swap_ins[block] = cpu_block
        self.version += 1

    def _allocate_cpu(self, num_blocks: int) -> list[int]:
        blocks = self.cpu.allocate(num_blocks) if num_blocks else []
        if self._swap_outs:
            for block in blocks:  # a pending swap-out into a reallocated block is dead
                if self._swap_outs.pop(block, None) is not None:
                    self.version += 1
        return blocks

    def _cancel_write(self, block: int) -> None:
        src = self._copies.pop(block, None)
        if src is not None:
            self.version += 1
            self._unpin(src)
            self.release([src])
        cpu_src = self._swap_ins.pop(block, None)
        if cpu_src is not None:
            self.version += 1
            self.cpu.free([cpu_src])

    def _unpin(self, block: int) -> None:
        left = self._pins[block] - 1
        if left:
            self._pins[block] = left
        else:
            del self._pins[block]

    # -- the executor's side -------------------------------------------------------------------

    def snapshot(self) -> CachePlan:
        """The pending work as a ``CachePlan``; changes nothing."""
        return CachePlan(
            swap_out=tuple((src, dst) for dst, src in self._swap_outs.items()),
            copies=tuple((src, dst) for dst, src in self._copies.items()),
            swap_in=tuple((src, dst) for dst, src in self._swap_ins.items()),
            poison=tuple(sorted(self._poison)) if self._poison else (),
            version=self.version,
        )

    def complete(self, plan: CachePlan, phase: Phase | str) -> None:
        """Record that ``plan``'s ``phase`` was applied to the cache.

        Raises InvalidArgumentError, changing nothing, when the plan is not the pending one (the
        plan changed since ``snapshot()``) or the phase is unknown."""
        if not isinstance(plan, CachePlan) or plan.version != self.version:
            raise InvalidArgumentError("plan is not the pending plan: the manager changed since "
                                       "plan() took it; take a new one")
        try:
            phase = Phase(phase)
        except (ValueError, TypeError):
            raise InvalidArgumentError(
                f"phase must be one of {', '.join(PHASES)}, got {phase!r}") from None
        version = self.version  # completing a phase leaves the rest of the snapshot valid
        match phase:
            case Phase.SWAP_OUT:
                self._swap_outs.clear()
            case Phase.COPIES:
                self._complete_copies()
            case Phase.SWAP_IN:
                sources = list(self._swap_ins.values())
                self._swap_ins.clear()
                if sources:
                    self.cpu.free(sources)
            case Phase.POISON:
                if self._poison:
                    self._poison.difference_update(plan.poison)
        self.version = version

    def _complete_copies(self) -> None:
        sources = list(self._copies.values())
        self._copies.clear()
        for src in sources:
            self._unpin(src)
        self.release(sources)


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

    def apply(self, phase: Phase | str, work: Pairs | tuple[int, ...]) -> None:
        """Apply one phase's pairs (or blocks, for ``poison``) to the tensors."""
        match phase:
            case Phase.SWAP_OUT:
                self.cache.swap_to(self.cpu_cache, work)
            case Phase.COPIES:
                self.cache.copy_blocks(work)
            case Phase.SWAP_IN:
                self.cpu_cache.swap_to(self.cache, work)
            case Phase.POISON:
                self.cache.fill_blocks(work)
            case _:
                raise ValueError(f"unknown plan phase {phase!r}; phases: {', '.join(PHASES)}")


def cpu_cache_for(cache: PagedKVCache, num_cpu_blocks: int) -> PagedKVCache:
    """A CPU cache of ``num_cpu_blocks`` blocks shaped like ``cache`` (pinned when ``cache`` is on
    a GPU, so swaps are asynchronous copies)."""
    return PagedKVCache(cache.spec, num_cpu_blocks, "cpu",
                        pin_memory=cache.device.type == "cuda" and torch.cuda.is_available())
