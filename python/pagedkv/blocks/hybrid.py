"""HybridBlockManager: the BlockManager of a model whose layers fall into several KV cache
groups (full attention, sliding windows) sharing one block pool.

``BlockManager(..., groups=(None, 128))`` makes one. Every group keeps its own block table per
sequence over the one pool; a window group releases the blocks behind the window of every
query still to come (``pagedkv.blocks.groups``), and its tables keep their logical positions
(freed entries hold ``PAD_WINDOW``, -1). With prefix caching each group has its own
``PrefixCache`` over the pool: a full-attention group reuses a verified chain of blocks from
the first, a window group only the blocks in the window of the first token to compute, found by
their chained hash; a prompt's hit is the longest prefix every group can serve.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence

import numpy as np
import torch

from pagedkv import checks
from pagedkv.blocks.batch import PAD_WINDOW, BatchTensors, BlockTableRows
from pagedkv.blocks.cascade import CascadePolicy
from pagedkv.blocks.groups import (
    GroupTables,
    Hits,
    check_computed,
    check_group,
    check_groups,
    first_live,
    live_blocks,
    prompt_hits,
)
from pagedkv.blocks.manager import BlockManager
from pagedkv.blocks.prefix import BlockKey, PrefixCache, chain
from pagedkv.blocks.sequences import SeqState

__all__ = ["HybridBlockManager"]

_MAX_TOKEN_ID = checks.MAX_TOKEN_ID


class HybridBlockManager(BlockManager):
    """A BlockManager over several KV cache groups; ``BlockManager(groups=...)`` returns one
    when ``groups`` names more than one group or a sliding window.

    Args as BlockManager's, and ``groups``: one window per group (None: full attention, else
    the window in tokens, as ``paged_attention``'s ``sliding_window``), e.g.
    ``spec.group_windows``. Group g's layers write with ``batch.group_slot_mappings[g]`` and
    attend with ``batch.group_block_tables[g]``.

    The window contract: ``append_tokens(.., num_computed=None)`` means that every token before
    the appended ones has had its query run (the serving loop's order: prefill, then one token
    per step); pass ``num_computed`` when fewer have (chunked prefill, a fork of a sequence with
    unwritten tokens). A window group frees the blocks wholly before ``num_computed - W + 1``.
    The class contracts of BlockManager hold per group: all or nothing, errors naming the
    argument, reference counts equal table holders plus the plan's.
    """

    def __init__(self, num_blocks: int, block_size: int, *, groups: Sequence[int | None],
                 num_cpu_blocks: int = 0, enable_prefix_caching: bool = True,
                 reserve_null_block: bool = True, debug_nan: bool = False) -> None:
        super().__init__(num_blocks, block_size, num_cpu_blocks=num_cpu_blocks,
                         enable_prefix_caching=False, reserve_null_block=reserve_null_block,
                         debug_nan=debug_nan)
        self.windows = check_groups(groups)
        self._rows = [self.tables, *(BlockTableRows(self.block_size) for _ in self.windows[1:])]
        self.prefix_caches: list[PrefixCache] | None = None
        self._forgets: list[Callable[[int], None]] = []
        if enable_prefix_caching:
            self.prefix_caches = []
            for _ in self.windows:  # each cache hooks itself on the allocator: collect the hooks
                self.prefix_caches.append(PrefixCache(self.allocator, self.block_size))
                self._forgets.append(self.allocator.on_evict)
            self.allocator.on_evict = self._forget
            full = [i for i, window in enumerate(self.windows) if window is None]
            self.prefix_cache = self.prefix_caches[full[0] if full else 0]

    def _forget(self, block: int) -> None:
        """The allocator reclaimed a cached block: the cache of its group forgets it."""
        for cache, forget in zip(self.prefix_caches, self._forgets, strict=True):
            if cache.holds(block):
                forget(block)
                return

    @property
    def group_windows(self) -> tuple[int | None, ...]:
        """Each group's window (None: full attention)."""
        return self.windows

    def block_table(self, seq_id: Hashable, group: int = 0) -> list[int]:
        """A copy of the sequence's block table in ``group`` (CPU blocks while swapped out;
        ``PAD_WINDOW`` for the blocks a window group freed)."""
        seq = self._sequences.get(seq_id)
        return list(seq.groups.tables[check_group(group, len(self.windows))])

    def num_held_blocks(self, seq_id: Hashable, group: int) -> int:
        """Blocks the sequence holds in ``group`` (its table's entries but the freed ones)."""
        seq = self._sequences.get(seq_id)
        group = check_group(group, len(self.windows))
        return len(seq.groups.tables[group]) - seq.groups.starts[group]

    # -- prefix hits ---------------------------------------------------------------------------

    def _prompt_hits(self, token_ids: list[int], extra: bytes) -> Hits:
        if self.prefix_caches is None:
            return 0, [[] for _ in self.windows], [[] for _ in self.windows], []
        return prompt_hits(self.prefix_caches, self.windows, token_ids, extra, self.block_size)

    def _needed(self, tables: list[list[int]], num_blocks: int) -> int:
        """Blocks the pool gives up for tables of ``num_blocks`` starting with ``tables``."""
        counts = self._ref_counts
        return sum(num_blocks - len(t) + sum(1 for b in t if b != PAD_WINDOW and not counts[b])
                   for t in tables)

    def _take_groups(self, tables: list[list[int]], num_blocks: int,
                     destination: bool = False) -> list[list[int]]:
        """Reference the blocks of ``tables`` and allocate the rest, all or nothing."""
        needed = self._needed(tables, num_blocks)
        self.allocator.reserve(needed)
        for table in tables:
            for block in live_blocks(table):
                self.allocator.incref(block)
        fresh = iter(self._plan.allocate(sum(num_blocks - len(t) for t in tables), destination))
        return [t + [next(fresh) for _ in range(num_blocks - len(t))] for t in tables]

    # -- sequences -----------------------------------------------------------------------------

    def can_allocate(self, token_ids: Sequence[int], extra_key: Hashable = None) -> bool:
        """Whether ``add_sequence(.., token_ids, extra_key)`` would find enough blocks."""
        token_ids = checks.token_ids(token_ids)
        _, tables, _, _ = self._prompt_hits(token_ids, checks.extra_key_bytes(extra_key))
        return self.allocator.can_allocate(self._needed(tables, self._blocks_for(len(token_ids))))

    def add_sequence(self, seq_id: Hashable, token_ids: Sequence[int],
                     extra_key: Hashable = None) -> int:
        """As ``BlockManager.add_sequence``: the cached tokens (the longest prefix every group
        can serve). A window group takes no block behind the window of the first token to
        compute; the blocks the prefill's queries read it frees at the next append."""
        self._sequences.check_new(seq_id)
        token_ids = checks.token_ids(token_ids)
        extra = checks.extra_key_bytes(extra_key)
        hit, tables, keys, links = self._prompt_hits(token_ids, extra)
        tables = self._take_groups(tables, self._blocks_for(len(token_ids)))
        starts = [first_live(w, hit * self.block_size, self.block_size) for w in self.windows]
        state = GroupTables(tables, keys, [h for h, _ in links], hit * self.block_size, starts)
        seq = SeqState(token_ids, tables[0], keys[0], extra_key, extra, groups=state)
        self._register_groups(seq, links)
        self._admit(seq_id, seq)
        if self.prefix_cache is not None:
            self.prefix_cache.record_query(len(token_ids), hit * self.block_size)
        return hit * self.block_size

    def _computed(self, seq: SeqState, num_computed: int | None) -> int:
        return check_computed(num_computed, seq.groups.num_computed, len(seq.token_ids))

    def _growth(self, seq: SeqState, num_tokens: int, computed: int
                ) -> tuple[list[list[int]], list[int], list[int], list[int], int]:
        """What appending ``num_tokens`` implies: per group the blocks to release (behind the
        window) and the new first live entry, the groups whose shared last block is copied, the
        new blocks per group, and the blocks the pool must give beyond those released."""
        state, size = seq.groups, self.block_size
        num_old = len(seq.token_ids)
        num_blocks = self._blocks_for(num_old + num_tokens)
        releases, starts, cows, news = [], [], [], []
        for g, window in enumerate(self.windows):
            table = state.tables[g]
            start = max(state.starts[g], min(first_live(window, computed, size), len(table)))
            releases.append(table[state.starts[g]:start])
            starts.append(start)
            if num_tokens and num_old % size and self._plan.holders(table[-1]) > 1:
                cows.append(g)
            news.append(num_blocks - len(table))
        freed = sum(1 for blocks in releases for b in blocks if self._ref_counts[b] == 1)
        return releases, starts, cows, news, len(cows) + sum(news) - freed

    def can_append(self, seq_id: Hashable, num_tokens: int = 1,
                   num_computed: int | None = None) -> bool:
        """Whether ``append_tokens`` of ``num_tokens`` tokens would find enough blocks (counting
        the window blocks it would release)."""
        num_tokens = checks.count(num_tokens, "num_tokens", checks.INT32_MAX)
        seq = self._sequences.resident(seq_id)
        *_, short = self._growth(seq, num_tokens, self._computed(seq, num_computed))
        return self.allocator.can_allocate(short)

    def append_tokens(self, seq_id: Hashable, token_ids: int | Sequence[int],
                      num_computed: int | None = None) -> list[tuple[int, int]]:
        """As ``BlockManager.append_tokens``, in every group; first, window groups release the
        blocks behind the window of position ``num_computed`` (default: the sequence's length
        before the append). Returns the copy-on-write ``(old, new)`` pairs of all groups."""
        if type(token_ids) is int and num_computed is None and 0 <= token_ids <= _MAX_TOKEN_ID:
            try:
                seq = self._seqs.get(seq_id)
            except TypeError:
                seq = None
            if seq is not None and not seq.swapped and self._append_one(seq, token_ids):
                return []
        seq = self._sequences.resident(seq_id)
        tokens = checks.token_ids([token_ids] if type(token_ids) is int else token_ids)
        computed = self._computed(seq, num_computed)
        releases, starts, cows, news, short = self._growth(seq, len(tokens), computed)
        self.allocator.reserve(short)
        state = seq.groups
        for g, blocks in enumerate(releases):
            if blocks:
                self._plan.release(blocks[::-1])
                state.tables[g][state.starts[g]:starts[g]] = [PAD_WINDOW] * len(blocks)
                self._rows[g].write(seq.row, state.tables[g], state.starts[g])
        state.starts, state.num_computed = starts, computed
        pairs = [self._copy_last(seq, g) for g in cows]
        for g, count in enumerate(news):
            if count:
                start = len(state.tables[g])
                state.tables[g] += self._plan.allocate(count)
                self._rows[g].write(seq.row, state.tables[g], start)
        seq.token_ids += tokens
        self._register_groups(seq)
        return pairs

    def _append_one(self, seq: SeqState, token: int) -> bool:
        """The decode fast path: append one token when no group takes, copies or releases a
        block (the last block has room and is private, no window moves past a block)."""
        state, size = seq.groups, self.block_size
        num_old = len(seq.token_ids)
        if not num_old % size:
            return False
        for g, window in enumerate(self.windows):
            if self._ref_counts[state.tables[g][-1]] != 1 or (
                    window is not None and first_live(window, num_old, size) > state.starts[g]):
                return False
        seq.token_ids.append(token)
        state.num_computed = num_old
        if (num_old + 1) % size == 0:
            self._register_groups(seq)
        return True

    def _copy_last(self, seq: SeqState, group: int) -> tuple[int, int]:
        """Give the sequence a private copy of its shared last block in ``group``."""
        table = seq.groups.tables[group]
        old = table[-1]
        (new,) = self._plan.allocate(1, destination=True)
        self._plan.copy(old, new)
        self._plan.release([old])
        table[-1] = new
        self._rows[group].write(seq.row, table, len(table) - 1)
        return old, new

    def fork(self, parent_id: Hashable, child_id: Hashable) -> None:
        """Make ``child_id`` a copy of ``parent_id`` sharing its blocks in every group."""
        parent = self._sequences.resident(parent_id)
        self._sequences.check_new(child_id, "child_id")
        for table in parent.groups.tables:
            for block in live_blocks(table):
                self.allocator.incref(block)
        state = parent.groups.copy()
        child = SeqState(list(parent.token_ids), state.tables[0], state.keys[0],
                         parent.extra_key, parent.extra, groups=state)
        self._admit(child_id, child)

    def free(self, seq_id: Hashable) -> None:
        """Release the sequence's blocks in every group (cached ones stay evictable)."""
        seq = self._sequences.to_free(seq_id)
        if seq.swapped:
            self.cpu_allocator.free([b for t in seq.groups.tables for b in live_blocks(t)])
        else:
            self._release(seq)
        self._sequences.remove(seq_id)

    # -- swapping ------------------------------------------------------------------------------

    def swap_out(self, seq_id: Hashable) -> list[tuple[int, int]]:
        """Move the sequence's held blocks, every group's, to the CPU pool (freed window entries
        stay ``PAD_WINDOW``). Returns the (device block, CPU block) pairs queued."""
        seq = self._sequences.resident(seq_id)
        tables = seq.groups.tables
        cpu_blocks, pairs = self._plan.swap_out([b for t in tables for b in live_blocks(t)])
        self._release(seq)
        blocks = iter(cpu_blocks)
        self._set_tables(seq, [[b if b == PAD_WINDOW else next(blocks) for b in t]
                               for t in tables])
        seq.swapped = True
        return pairs

    def _swap_in_hits(self, seq: SeqState) -> tuple[list[list[int]], list[list[BlockKey]]]:
        """Per group, the start of its device table that the prefix cache still holds: a
        full-attention group's cached prefix; a window group's cached blocks from its first
        held entry on (found by chained hash, up to the first miss)."""
        tables, keys, state, caches = [], [], seq.groups, self.prefix_caches
        for g, window in enumerate(self.windows):
            start, group_keys = state.starts[g], []
            table = [PAD_WINDOW] * start
            if caches is not None and window is None:
                blocks, group_keys = caches[g].lookup(seq.token_ids, seq.extra)
                table = blocks[:len(state.tables[g])]
                group_keys = group_keys[:len(table)]
            elif caches is not None:
                links = chain(seq.token_ids, seq.extra, self.block_size, start,
                              len(state.hashes), state.hashes[start - 1] if start else None)
                for link in links:
                    block = caches[g].find(*link)
                    if block is None:
                        break
                    table.append(block)
            tables.append(table)
            keys.append(group_keys)
        return tables, keys

    def can_swap_in(self, seq_id: Hashable) -> bool:
        """Whether the device pool has room for the swapped-out sequence."""
        seq = self._sequences.swapped(seq_id)
        hits, _ = self._swap_in_hits(seq)
        return self.allocator.can_allocate(self._needed(hits, len(seq.groups.tables[0])))

    def swap_in(self, seq_id: Hashable) -> list[tuple[int, int]]:
        """Bring a swapped-out sequence back, every group; a full-attention group reuses the
        blocks of its prefix still cached. Returns the (CPU, device) pairs queued."""
        seq = self._sequences.swapped(seq_id)
        hits, keys = self._swap_in_hits(seq)
        cpu_tables = seq.groups.tables
        tables = self._take_groups(hits, len(cpu_tables[0]), destination=True)
        pairs, reused = [], []
        for hit, cpu_table, table in zip(hits, cpu_tables, tables, strict=True):
            reused += live_blocks(cpu_table[:len(hit)])
            pairs += zip(cpu_table[len(hit):], table[len(hit):], strict=True)
        self._plan.swap_in(pairs)
        self.cpu_allocator.free(reused)
        for g, window in enumerate(self.windows):
            if window is None:
                seq.groups.keys[g] = keys[g]
        self._set_tables(seq, tables)
        seq.swapped = False
        self._register_groups(seq)
        self._take_row(seq)
        return pairs

    # -- blocks --------------------------------------------------------------------------------

    def _set_tables(self, seq: SeqState, tables: list[list[int]]) -> None:
        seq.groups.tables = tables
        seq.block_table = tables[0]
        seq.block_keys = seq.groups.keys[0]

    def _release(self, seq: SeqState) -> None:
        for g, table in enumerate(seq.groups.tables):
            self._plan.release(live_blocks(table)[::-1])
            self._rows[g].release(seq.row, len(table))
        seq.row = -1

    def _register_groups(self, seq: SeqState, links: list[tuple[bytes, bytes]] | None = None
                         ) -> None:
        """Cache the full blocks that no entry covers yet: a full group's by its chain of keys,
        a window group's held ones by their chained hash (``links``: the chain, when known)."""
        if self.prefix_caches is None:
            return
        state, size = seq.groups, self.block_size
        full = len(seq.token_ids) // size
        if links is None:
            links = chain(seq.token_ids, seq.extra, size, len(state.hashes), full,
                          state.hashes[-1] if state.hashes else None)
            first = len(state.hashes)
            state.hashes += [h for h, _ in links]
        else:
            first = 0
        for g, window in enumerate(self.windows):
            cache, table = self.prefix_caches[g], state.tables[g]
            if window is None:
                cache.register_blocks(table, seq.token_ids, seq.extra, state.keys[g])
                continue
            for i in range(max(first, state.starts[g]), full):
                cache.add(table[i], *links[i - first])

    def _take_row(self, seq: SeqState) -> None:
        seq.row = self._rows[0].take()
        for g, rows in enumerate(self._rows):
            if g and rows.take() != seq.row:
                raise AssertionError("group block-table rows out of step")
            rows.write(seq.row, seq.groups.tables[g])

    # -- batches -------------------------------------------------------------------------------

    def build_batch(self, seq_ids: Sequence[Hashable], num_query_tokens: int | Sequence[int] = 1,
                    *, device: torch.device | str | None = None, max_blocks: int | None = None,
                    pad_tokens_to: int | None = None,
                    cascade: CascadePolicy | None = None) -> BatchTensors:
        """As ``BlockManager.build_batch``, with every group's tables, slot mapping and
        cascade (``group_block_tables``, ``group_slot_mappings``, ``group_cascades``: None
        for window groups); ``block_tables`` and ``slot_mapping`` are group 0's."""
        seqs = self._sequences.many(seq_ids)
        rows = self._sequences.rows(seq_ids, seqs)
        seq_lens = np.fromiter([len(seq.token_ids) for seq in seqs], np.int32, len(seqs))
        batches = [r.build(rows, seq_lens, num_query_tokens, device=device,
                           max_blocks=max_blocks, pad_tokens_to=pad_tokens_to,
                           cascade=cascade if window is None else None)
                   for r, window in zip(self._rows, self.windows, strict=True)]
        batch = batches[0]
        batch.group_block_tables = tuple(b.block_tables for b in batches)
        batch.group_slot_mappings = tuple(b.slot_mapping for b in batches)
        batch.group_cascades = tuple(b.group_cascades[0] for b in batches)
        return batch
