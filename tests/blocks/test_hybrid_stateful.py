"""The stateful property test of test_manager_stateful.py over a hybrid manager: a full-attention
group and a sliding-window group (layer 0 and layer 1 of the cache), two window groups, or one
window group of both layers. The cache is paged as the manager pages it: with two groups both
layers share one K and one V tensor, each block holding the layer of the group that owns it.

On top of the single-group machine's checks (reference counts equal table holders plus the
plan's, no block free and used at once, every sequence's K/V read back through the pending plan,
failed calls change nothing), per group:

- every table has one entry per block of the sequence; a window group's entries are freed
  (-1) exactly before the block of position ``c - W + 1``, where c is what the manager was last
  told was computed (the tokens before the last append, or its ``num_computed``): the oldest
  key of the earliest query still to come; live after;
- so a window group holds at most ``(q + W - 2) // block_size + 2`` blocks, q the tokens
  after c (the bound the manager guarantees; one query token: ``ceil(W / block_size) + 1``);
- no block is in two groups' tables; every group's cached entries are live or evictable.
"""

import dataclasses

import pytest
import torch
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import invariant, precondition, rule
from test_manager_stateful import (
    SCALE,
    SPEC,
    BlockManagerMachine,
    FailingExecutor,
    expected_kv,
    snapshot,
)

from pagedkv.blocks.batch import PAD_BLOCK, PAD_WINDOW
from pagedkv.blocks.plan import cpu_cache_for
from pagedkv.cache.paged_cache import PagedKVCache
from pagedkv.errors import InvalidArgumentError


class HybridMachine(BlockManagerMachine):
    manager_options = dict(debug_nan=True, groups=(None, 6))

    def __init__(self) -> None:
        super().__init__()
        self.windows = self.manager.group_windows
        # the cache paged as the manager pages it: one tensor per page slot (with two groups one
        # for both layers: a block holds the layer of the group that owns it)
        windows = tuple(self.windows[self.group_of(layer)] for layer in range(SPEC.num_layers))
        spec = dataclasses.replace(SPEC, sliding_windows=windows)
        assert spec.group_windows == self.windows
        self.cache = PagedKVCache(spec, 24)
        self.cpu_cache = cpu_cache_for(self.cache, 16)
        self.executor = FailingExecutor(self.cache, self.cpu_cache)
        self.written: dict[int, int] = {}  # tokens whose K/V are written (their queries ran)
        self.told: dict[int, int] = {}  # the computed count the manager was last told

    def group_of(self, layer: int) -> int:
        return layer % len(self.windows)

    def slot_mapping(self, batch, layer: int):
        return batch.group_slot_mappings[self.group_of(layer)]

    def write(self, seq_ids, num_new, fail_on=None) -> None:
        super().write(seq_ids, num_new, fail_on)
        for seq_id in seq_ids:
            self.written[seq_id] = len(self.seqs[seq_id][0])

    def added(self, seq_id: int, cached: int) -> None:
        self.told[seq_id] = cached

    def forked(self, parent: int, child: int) -> None:
        self.told[child] = self.told[parent]
        self.written[child] = self.written[parent]

    def computed(self, seq_id: int) -> int | None:
        """What to pass as num_computed: None (the default) when every token is written."""
        done = self.written[seq_id]
        return None if done == len(self.seqs[seq_id][0]) else done

    def append_tokens(self, seq_id: int, tokens: list[int]) -> list:
        computed = self.computed(seq_id)
        one = len(tokens) == 1 and computed is None  # the decode fast path takes an int
        pairs = self.manager.append_tokens(seq_id, tokens[0] if one else tokens, computed)
        self.told[seq_id] = self.written[seq_id]
        return pairs

    def can_append(self, seq_id: int, num_tokens: int) -> bool:
        return self.manager.can_append(seq_id, num_tokens, self.computed(seq_id))

    def num_held(self, seq_id: int) -> int:
        return sum(self.manager.num_held_blocks(seq_id, g) for g in range(len(self.windows)))

    def tables(self, seq_id: int) -> list[list[int]]:
        return [self.manager.block_table(seq_id, g) for g in range(len(self.windows))]

    def held_tables(self, seq_id: int) -> list[list[int]]:
        return [[b for b in t if b != PAD_WINDOW] for t in self.tables(seq_id)]

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), case=st.sampled_from(["group", "num_computed", "negative"]))
    def bad_group_call_changes_nothing(self, data, case):
        seq_id = data.draw(st.sampled_from(sorted(self.seqs)))
        before = snapshot(self.manager)
        if case == "group":
            call, name = lambda: self.manager.block_table(seq_id, len(self.windows)), "group"
        elif case == "num_computed" or self.manager.is_swapped(seq_id):
            n = self.manager.num_tokens(seq_id)
            call, name = lambda: self.manager.append_tokens(seq_id, [1], n + 1), "num_computed"
        else:
            call, name = lambda: self.manager.can_append(seq_id, 1, -1), "num_computed"
        with pytest.raises(Exception) as info:  # a swapped sequence raises its state first
            call()
        assert name in str(info.value) or "swapped" in str(info.value)
        assert snapshot(self.manager) == before

    @invariant()
    def groups_hold_what_their_windows_need(self):
        size = SPEC.block_size
        owner: dict[tuple[bool, int], int] = {}
        for seq_id, (tokens, _) in self.seqs.items():
            n, told = len(tokens), self.told[seq_id]
            swapped = self.manager.is_swapped(seq_id)
            for g, (window, table) in enumerate(zip(self.windows, self.tables(seq_id),
                                                    strict=True)):
                assert len(table) == -(-n // size)
                # the first block holding a key of the query at position told (if any)
                start = 0 if window is None else min(max(0, told - window + 1) // size,
                                                     len(table))
                assert table[:start] == [PAD_WINDOW] * start
                assert PAD_WINDOW not in table[start:]
                assert self.manager.num_held_blocks(seq_id, g) == len(table) - start
                if window is not None:
                    assert len(table) - start <= (n - told + window - 2) // size + 2
                for block in table[start:]:
                    assert owner.setdefault((swapped, block), g) == g, "a block in two groups"

    @invariant()
    def prefix_cache_names_only_live_or_evictable_blocks(self):
        allocator, caches = self.manager.allocator, self.manager.prefix_caches
        cached = [b for b in range(allocator.num_blocks)
                  if b != allocator.null_block and allocator.is_cached(b)]
        assert len(cached) == sum(len(c) for c in caches or ())
        assert set(allocator.evictable_blocks()) <= set(cached)
        assert all(sum(c.holds(b) for c in caches) == 1 for b in cached)

    @invariant()
    def every_sequence_reads_back_its_own_kv(self):
        """Each group's held blocks, read through the pending plan, hold its layer's K/V."""
        source = self.plan_sources()
        size = SPEC.block_size
        for seq_id, (tokens, extra_key) in self.seqs.items():
            swapped = self.manager.is_swapped(seq_id)
            tables = self.tables(seq_id)
            for layer in range(SPEC.num_layers):
                want_key, want_value = expected_kv(tokens, extra_key, layer)
                for i, block in enumerate(tables[self.group_of(layer)]):
                    if block == PAD_WINDOW:
                        continue
                    key, value = self.read_block(source(block, swapped), layer)
                    end = min(len(tokens), (i + 1) * size) - i * size
                    assert torch.equal(key[:end], want_key[i * size:i * size + end])
                    assert torch.equal(value[:end], want_value[i * size:i * size + end])

    @invariant()
    def decode_batch_matches_block_tables(self):
        seq_ids = self.resident()
        batch = self.manager.build_batch(seq_ids)
        assert len(batch.group_block_tables) == len(self.windows)
        assert torch.equal(batch.block_tables, batch.group_block_tables[0])
        for g, (tables, slots) in enumerate(zip(batch.group_block_tables,
                                                batch.group_slot_mappings, strict=True)):
            width = tables.shape[1]
            for i, seq_id in enumerate(seq_ids):
                table, last = self.manager.block_table(seq_id, g), len(self.seqs[seq_id][0]) - 1
                assert tables[i].tolist() == table + [PAD_BLOCK] * (width - len(table))
                block, offset = divmod(last, SPEC.block_size)
                assert slots[i] == table[block] * SPEC.block_size + offset
        if seq_ids:
            freed = sum(PAD_WINDOW in t for t in batch.group_block_tables[-1].tolist())
            event(f"hybrid: {freed} table(s) with freed window blocks")


class PlainHybridMachine(HybridMachine):
    """Window groups only (Mistral-like, two windows), no prefix caching, no null block."""

    manager_options = dict(enable_prefix_caching=False, reserve_null_block=False, groups=(5, 9))


class WindowOnlyMachine(HybridMachine):
    """One window group over both layers (a page of two), with prefix caching."""

    manager_options = dict(debug_nan=True, groups=(7,))


HybridMachine.TestCase.settings = settings(max_examples=40 * SCALE, stateful_step_count=40,
                                           deadline=None)
PlainHybridMachine.TestCase.settings = settings(max_examples=15 * SCALE, stateful_step_count=40,
                                                deadline=None)
WindowOnlyMachine.TestCase.settings = settings(max_examples=15 * SCALE, stateful_step_count=40,
                                               deadline=None)
test_hybrid_manager = HybridMachine.TestCase
test_window_only_manager = WindowOnlyMachine.TestCase
test_hybrid_manager_without_prefix_caching = PlainHybridMachine.TestCase


def test_bad_groups_are_refused_naming_the_argument():
    from pagedkv.blocks.manager import BlockManager

    for groups, name in (([], "groups"), ((None, 0), "groups[1]"), ((None, 1.5), "groups[1]"),
                         ("ab", "groups"), ((None, True), "groups[1]")):
        with pytest.raises(InvalidArgumentError, match=name.replace("[", r"\[")):
            BlockManager(8, 4, groups=groups)
