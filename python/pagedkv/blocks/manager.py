"""BlockManager: sequences -> block tables over a pool of block ids, and the batch tensors."""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import numpy as np
import torch

from pagedkv import checks
from pagedkv.blocks.allocator import BlockAllocator
from pagedkv.blocks.batch import BatchTensors, BlockTableRows
from pagedkv.blocks.cascade import CascadePolicy
from pagedkv.blocks.groups import check_group, check_groups
from pagedkv.blocks.plan import CachePlan, PendingPlan, Phase
from pagedkv.blocks.prefix import BlockKey, PrefixCache
from pagedkv.blocks.sequences import SeqState, SequenceRegistry

__all__ = ["BlockManager"]

_MAX_TOKEN_ID = checks.MAX_TOKEN_ID


class BlockManager:
    """Block tables of sequences over a device block pool, with an optional CPU pool for swaps.

    Args:
        num_blocks: blocks in the device pool (a PagedKVCache's ``num_blocks``).
        block_size: tokens per block (the cache spec's ``block_size``).
        num_cpu_blocks: size of the CPU pool for ``swap_out`` (0: no swapping).
        enable_prefix_caching: reuse cached full blocks of identical prefixes.
        reserve_null_block: keep block 0 out of circulation so that block-table padding (0) never
            names a live block.
        debug_nan: plans list freshly allocated, freed and evicted blocks (and the null block) for
            a NaN fill, so a read of stale or padding data shows up.
        groups: the KV cache groups' windows (None: full attention), e.g. ``spec.group_windows``;
            several groups or a window make a ``HybridBlockManager`` (``pagedkv.blocks.hybrid``).

    The cache work that calls imply is not done here: it is recorded in a ``PendingPlan``
    (``pagedkv.blocks.plan``; ``plan()`` is its snapshot), which a ``PlanExecutor`` applies before
    the step's kernels run. Nothing else reads or writes the cache, and ``build_batch`` only
    builds tensors.

    Contracts:

    - A block's K/V must be written (``reshape_and_cache`` with this manager's ``slot_mapping``)
      before another sequence reads it: full blocks are registered for prefix reuse as soon as
      their tokens are appended, and ``fork`` shares blocks as they are. Fork a sequence after
      the step that computed its tokens has run.
    - Every public method checks its arguments and either does all of its work or raises with
      the state exactly as before (tables, reference counts, LRU order, prefix entries, pending
      plan). Errors are ``pagedkv.errors`` types that name the argument.
    - Single-threaded by design, like the scheduler that owns it: one thread calls it (the
      scheduler's loop); share it across threads only under your own lock.

    Example (one request; the model writes K/V with ``batch.slot_mapping``)::

        manager = BlockManager(cache.num_blocks, cache.spec.block_size, num_cpu_blocks=1024)
        executor = PlanExecutor(cache, cpu_cache_for(cache, 1024))
        cached = manager.add_sequence("req-0", prompt)  # tokens whose K/V are already cached
        batch = manager.build_batch(["req-0"], len(prompt) - cached)  # prefill the rest
        executor.run(manager)  # before the kernels: copy-on-write copies, swaps
        manager.append_tokens("req-0", next_token)
        ...
        manager.free("req-0")
    """

    group_windows: tuple[int | None, ...] = (None,)  # each KV cache group's window: one, full

    def __new__(cls, *args: object, groups: Sequence[int | None] | None = None,
                **kwargs: object) -> BlockManager:
        if cls is BlockManager and groups is not None and check_groups(groups) != (None,):
            from pagedkv.blocks.hybrid import HybridBlockManager  # it subclasses this one
            cls = HybridBlockManager
        return super().__new__(cls)

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        num_cpu_blocks: int = 0,
        enable_prefix_caching: bool = True,
        reserve_null_block: bool = True,
        debug_nan: bool = False,
        groups: Sequence[int | None] | None = None,
    ) -> None:
        num_blocks = checks.positive(num_blocks, "num_blocks", checks.INT32_MAX)
        self.block_size = checks.positive(block_size, "block_size", checks.INT32_MAX)
        num_cpu_blocks = checks.count(num_cpu_blocks, "num_cpu_blocks", checks.INT32_MAX)
        self.allocator = BlockAllocator(num_blocks, reserve_null_block, "device")
        self._ref_counts = self.allocator.ref_counts  # the allocator updates this list in place
        self.prefix_cache = (PrefixCache(self.allocator, self.block_size)
                             if enable_prefix_caching else None)
        self.cpu_allocator = BlockAllocator(num_cpu_blocks, name="cpu") if num_cpu_blocks else None
        self._sequences = SequenceRegistry()
        self._seqs = self._sequences.by_id  # the registry updates this dict in place
        self.tables = BlockTableRows(self.block_size)
        self._plan = PendingPlan(self.allocator, self.cpu_allocator, debug_nan)

    def __len__(self) -> int:
        return len(self._seqs)

    def __contains__(self, seq_id: Hashable) -> bool:
        return seq_id in self._sequences

    @property
    def seq_ids(self) -> list[Hashable]:
        """Ids of the managed sequences (resident and swapped), in insertion order."""
        return list(self._seqs)

    @property
    def debug_nan(self) -> bool:
        """Whether plans NaN-fill stale blocks (``debug_nan`` of the constructor)."""
        return self._plan.debug_nan

    def num_tokens(self, seq_id: Hashable) -> int:
        """Tokens of the sequence."""
        return len(self._sequences.get(seq_id).token_ids)

    def block_table(self, seq_id: Hashable, group: int = 0) -> list[int]:
        """A copy of the sequence's block table (CPU pool block ids while swapped out)."""
        check_group(group, 1)
        return list(self._sequences.get(seq_id).block_table)

    def is_swapped(self, seq_id: Hashable) -> bool:
        """Whether the sequence lives in the CPU pool."""
        return self._sequences.get(seq_id).swapped

    def usage(self) -> dict[str, float]:
        """Counts for logs and dashboards: sequences, device blocks used / evictable (cached) /
        free, CPU blocks used, and the prefix-cache hit rate in tokens."""
        device, cpu, prefix = self.allocator, self.cpu_allocator, self.prefix_cache
        return {"sequences": len(self._seqs),
                "swapped": sum(seq.swapped for seq in self._seqs.values()),
                "used_blocks": device.num_used_blocks,
                "cached_blocks": device.num_evictable_blocks,
                "free_blocks": device.num_free_blocks,
                "cpu_used_blocks": cpu.num_used_blocks if cpu else 0,
                "prefix_hit_rate": prefix.stats.hit_rate if prefix else 0.0}

    # -- sequences ---------------------------------------------------------------------------

    def _hits(self, token_ids: list[int], extra: bytes,
              prompt: bool = True) -> tuple[list[int], list[BlockKey]]:
        """Cached blocks to reuse and their keys; in a prompt, within ``token_ids[:-1]`` so that
        at least one token is left to compute."""
        if self.prefix_cache is None:
            return [], []
        max_blocks = (len(token_ids) - 1) // self.block_size if prompt else None
        return self.prefix_cache.lookup(token_ids, extra, max_blocks)

    def _num_needed(self, hits: list[int], num_blocks: int) -> int:
        """Blocks the pool gives up for a table of ``num_blocks`` that starts with ``hits``."""
        return num_blocks - len(hits) + sum(1 for block in hits if self._ref_counts[block] == 0)

    def _take(self, hits: list[int], num_blocks: int, destination: bool = False) -> list[int]:
        """Reference ``hits`` and allocate the rest of a ``num_blocks`` table, all or nothing."""
        self.allocator.reserve(self._num_needed(hits, num_blocks))
        for block in hits:
            self.allocator.incref(block)
        return hits + self._plan.allocate(num_blocks - len(hits), destination)

    def can_allocate(self, token_ids: Sequence[int], extra_key: Hashable = None) -> bool:
        """Whether ``add_sequence(.., token_ids, extra_key)`` would find enough blocks."""
        token_ids = checks.token_ids(token_ids)
        hits, _ = self._hits(token_ids, checks.extra_key_bytes(extra_key))
        return self.allocator.can_allocate(self._num_needed(hits, self._blocks_for(len(token_ids))))

    def add_sequence(
        self, seq_id: Hashable, token_ids: Sequence[int], extra_key: Hashable = None
    ) -> int:
        """Add a sequence, reusing the longest run of cached prefix blocks.

        ``token_ids``: ints in [0, 2**63) (a list, an integer array or tensor). ``extra_key``
        (adapter id, cache salt: None, str, bytes, int or tuples of them) keeps prompts under
        different keys apart. Returns the number of cached tokens (a multiple of block_size, less
        than len(token_ids)): their K/V are already in the cache; the caller computes and writes
        the rest.
        """
        self._sequences.check_new(seq_id)
        token_ids = checks.token_ids(token_ids)
        extra = checks.extra_key_bytes(extra_key)
        hits, keys = self._hits(token_ids, extra)
        table = self._take(hits, self._blocks_for(len(token_ids)))
        seq = SeqState(token_ids, table, keys, extra_key, extra)
        self._register_full_blocks(seq)
        self._admit(seq_id, seq)
        num_cached = len(hits) * self.block_size
        if self.prefix_cache is not None:
            self.prefix_cache.record_query(len(token_ids), num_cached)
        return num_cached

    def can_append(self, seq_id: Hashable, num_tokens: int = 1) -> bool:
        """Whether ``append_tokens`` of ``num_tokens`` tokens would find enough blocks."""
        num_tokens = checks.count(num_tokens, "num_tokens", checks.INT32_MAX)
        return self.allocator.can_allocate(self._blocks_to_append(self._sequences.resident(seq_id),
                                                                  num_tokens))

    def _blocks_to_append(self, seq: SeqState, num_tokens: int) -> int:
        num_old = len(seq.token_ids)
        new = self._blocks_for(num_old + num_tokens) - len(seq.block_table)
        cow = num_tokens > 0 and num_old % self.block_size != 0 and self._last_block_shared(seq)
        return new + cow

    def _last_block_shared(self, seq: SeqState) -> bool:
        """Whether another sequence holds the last block (references held by pending copies do
        not count: a copy reads its source before the step's kernels write it)."""
        return self._plan.holders(seq.block_table[-1]) > 1

    def append_tokens(
        self, seq_id: Hashable, token_ids: int | Sequence[int]
    ) -> list[tuple[int, int]]:
        """Append tokens, taking a new block whenever the last is full.

        When the last block is partly filled and shared (after ``fork``), the sequence first gets
        its own copy of it (queued in the plan). Returns ``[(old block, new block)]`` when that
        happened, else ``[]``.
        """
        try:
            seq = self._seqs.get(seq_id)
        except TypeError:
            seq = None
        if seq is None or seq.swapped:
            seq = self._sequences.resident(seq_id)  # raises unless seq_id is a resident sequence
        num_old, size = len(seq.token_ids), self.block_size
        if type(token_ids) is int and 0 <= token_ids <= _MAX_TOKEN_ID:
            if num_old % size and self._ref_counts[seq.block_table[-1]] == 1:  # decode fast path
                seq.token_ids.append(token_ids)
                if (num_old + 1) % size == 0:
                    self._register_full_blocks(seq)
                return []
            tokens = [token_ids]
        else:
            tokens = checks.token_ids(token_ids)
        num_new = num_old + len(tokens)
        pairs = []
        if num_new > len(seq.block_table) * size or (
                num_old % size and tokens and self._last_block_shared(seq)):
            pairs = self._make_room(seq, len(tokens))
        seq.token_ids += tokens
        if num_new // size != num_old // size:
            self._register_full_blocks(seq)
        return pairs

    def _make_room(self, seq: SeqState, num_tokens: int) -> list[tuple[int, int]]:
        self.allocator.reserve(self._blocks_to_append(seq, num_tokens))
        pairs = []
        if len(seq.token_ids) % self.block_size and self._last_block_shared(seq):
            pairs.append(self._copy_on_write(seq))
        start = len(seq.block_table)
        num_blocks = self._blocks_for(len(seq.token_ids) + num_tokens)
        seq.block_table += self._plan.allocate(num_blocks - start)
        self.tables.write(seq.row, seq.block_table, start)
        return pairs

    def _copy_on_write(self, seq: SeqState) -> tuple[int, int]:
        """Give the sequence a private copy of its shared last block (queued in the plan)."""
        old = seq.block_table[-1]
        (new,) = self._plan.allocate(1, destination=True)
        self._plan.copy(old, new)
        self._plan.release([old])  # the sequence's reference; another sequence holds it
        seq.block_table[-1] = new
        self.tables.write(seq.row, seq.block_table, len(seq.block_table) - 1)
        return old, new

    def fork(self, parent_id: Hashable, child_id: Hashable) -> None:
        """Make ``child_id`` a copy of ``parent_id`` sharing all its blocks (copy-on-write).

        The parent's K/V must be written already (see the class contracts)."""
        parent = self._sequences.resident(parent_id)
        self._sequences.check_new(child_id, "child_id")
        for block in parent.block_table:
            self.allocator.incref(block)
        child = SeqState(list(parent.token_ids), list(parent.block_table),
                         list(parent.block_keys), parent.extra_key, parent.extra)
        self._admit(child_id, child)

    def free(self, seq_id: Hashable) -> None:
        """Release a sequence's blocks (cached full blocks stay cached, evictable)."""
        seq = self._sequences.to_free(seq_id)
        if seq.swapped:
            self.cpu_allocator.free(seq.block_table)
        else:
            self._release(seq)
        self._sequences.remove(seq_id)

    # -- swapping ------------------------------------------------------------------------------

    def swap_out(self, seq_id: Hashable) -> list[tuple[int, int]]:
        """Move a sequence to the CPU pool. Returns the (device block, CPU block) pairs queued.

        A block still waiting to be swapped in keeps its CPU block (nothing to copy)."""
        seq = self._sequences.resident(seq_id)
        cpu_table, pairs = self._plan.swap_out(seq.block_table)
        self._release(seq)
        seq.block_table, seq.swapped = cpu_table, True
        return pairs

    def can_swap_in(self, seq_id: Hashable) -> bool:
        """Whether the device pool has room for the swapped-out sequence."""
        seq = self._sequences.swapped(seq_id)
        hits, _ = self._hits(seq.token_ids, seq.extra, prompt=False)
        return self.allocator.can_allocate(self._num_needed(hits, len(seq.block_table)))

    def swap_in(self, seq_id: Hashable) -> list[tuple[int, int]]:
        """Bring a swapped-out sequence back to the device. Returns the (CPU, device) pairs queued.

        Blocks of its prefix that are still in the prefix cache are reused, not copied.
        """
        seq = self._sequences.swapped(seq_id)
        hits, keys = self._hits(seq.token_ids, seq.extra, prompt=False)
        table = self._take(hits, len(seq.block_table), destination=True)
        pairs = list(zip(seq.block_table[len(hits):], table[len(hits):], strict=True))
        self._plan.swap_in(pairs)  # the sequence's CPU references now belong to the plan
        self.cpu_allocator.free(seq.block_table[:len(hits)])
        seq.block_table, seq.swapped, seq.block_keys = table, False, keys
        self._register_full_blocks(seq)
        self._take_row(seq)
        return pairs

    # -- the plan ------------------------------------------------------------------------------

    @property
    def num_pending_swaps(self) -> int:
        """Blocks the pending plan moves between the device and the CPU pool (out and in)."""
        return self._plan.num_swaps

    def plan(self) -> CachePlan:
        """A snapshot of the pending cache work (see ``pagedkv.blocks.plan``); changes nothing."""
        return self._plan.snapshot()

    def complete(self, plan: CachePlan, phase: Phase | str) -> None:
        """Record that ``plan``'s ``phase`` was applied to the cache (the executor calls this).

        Raises, changing nothing, when the plan is not the pending one (the manager changed
        since ``plan()``) or the phase is unknown."""
        self._plan.complete(plan, phase)

    def evict_cached(self, num_blocks: int | None = None) -> list[int]:
        """Drop up to ``num_blocks`` (default all) unreferenced cached blocks, LRU first."""
        num_blocks = checks.optional_count(num_blocks, "num_blocks", checks.INT32_MAX)
        evicted = self.allocator.evict(num_blocks)
        self._plan.poison(evicted)
        return evicted

    # -- blocks --------------------------------------------------------------------------------

    def _release(self, seq: SeqState) -> None:
        """Drop a resident sequence's references and its block-table row."""
        self._plan.release(seq.block_table[::-1])  # the tail is evicted first
        self.tables.release(seq.row, len(seq.block_table))
        seq.row = -1

    def _register_full_blocks(self, seq: SeqState) -> None:
        if self.prefix_cache is not None:
            self.prefix_cache.register_blocks(seq.block_table, seq.token_ids, seq.extra,
                                              seq.block_keys)

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _admit(self, seq_id: Hashable, seq: SeqState) -> None:
        self._take_row(seq)
        self._sequences.add(seq_id, seq)

    def _take_row(self, seq: SeqState) -> None:
        seq.row = self.tables.take()
        self.tables.write(seq.row, seq.block_table)

    # -- batches -------------------------------------------------------------------------------

    def build_batch(
        self,
        seq_ids: Sequence[Hashable],
        num_query_tokens: int | Sequence[int] = 1,
        *,
        device: torch.device | str | None = None,
        max_blocks: int | None = None,
        pad_tokens_to: int | None = None,
        cascade: CascadePolicy | None = None,
    ) -> BatchTensors:
        """The batch tensors of distinct resident sequences. Builds tensors only: run the
        pending plan (``PlanExecutor.run``) before the kernels that use them.

        ``num_query_tokens``: this step's tokens per sequence (1 for decode; the last ones of each
        sequence), one int for all or one per sequence. ``max_blocks`` fixes the block-table width
        and ``pad_tokens_to`` the slot_mapping length (padded with -1), e.g. for CUDA graphs.
        ``cascade``: plan the shared-prefix attention of the sequences that share blocks
        (``batch.group_cascades``), grouping those that pay under the policy.
        """
        seqs = self._sequences.many(seq_ids)
        rows = self._sequences.rows(seq_ids, seqs)
        seq_lens = np.fromiter([len(seq.token_ids) for seq in seqs], np.int32, len(seqs))
        return self.tables.build(rows, seq_lens, num_query_tokens, device=device,
                                 max_blocks=max_blocks, pad_tokens_to=pad_tokens_to,
                                 cascade=cascade)
