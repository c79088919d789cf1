"""Stateful property test of BlockManager and PlanExecutor: random add / decode step / fork chains
/ free / swap / evict, plans run lazily or failing part-way, and bad calls in between.

Every sequence's K/V depend on its whole prefix and extra key (like a real model's), so reusing a
block of another prefix, a missed or misdirected copy-on-write, a lost swap or a plan applied in
the wrong order shows up in the read-back check. The read-back runs between rules *without*
applying the pending plan: it reads each block where the plan will take it from, so a plan that
would lose data fails even if a later step never reads the block.

PAGEDKV_STATEFUL_EXAMPLES scales the number of examples (default 1; 20 is a thorough local run).
"""

import os
from collections import Counter

import pytest
import torch
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pagedkv import ops
from pagedkv.blocks.batch import PAD_BLOCK
from pagedkv.blocks.manager import BlockManager
from pagedkv.blocks.plan import PHASES, PlanExecutor, cpu_cache_for
from pagedkv.cache.paged_cache import PagedKVCache
from pagedkv.cache.spec import KVCacheSpec
from pagedkv.errors import DoubleFreeError, FreedSequenceError, OutOfBlocksError, PagedKVError
from pagedkv.ops import reference

SPEC = KVCacheSpec(num_layers=2, num_kv_heads=2, head_size=8, block_size=4, dtype=torch.float32)
PREFIXES = ([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [1, 2, 3, 4, 9, 9, 9, 9, 5, 5, 5, 5],
            [7] * 12)
LANES = torch.arange(SPEC.num_kv_heads * SPEC.head_size).view(1, SPEC.num_kv_heads, -1)
SCALE = int(os.environ.get("PAGEDKV_STATEFUL_EXAMPLES", "1"))


def expected_kv(tokens: list[int], extra_key, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K/V of every position: an integer code of the prefix up to it (exact in float32)."""
    code, codes = 1 + (extra_key is not None), []
    for token in tokens:
        code = (code * 31 + token + 1) % 65521
        codes.append(code)
    key = (torch.tensor(codes)[:, None, None] * 64 + layer * 16 + LANES).float()
    return key, -key - 1


def snapshot(manager: BlockManager):
    """Everything a failed call must leave as it was."""
    pools = [manager.allocator, manager.cpu_allocator]
    return ([(list(p.ref_counts), sorted(p.free_blocks()), list(p.evictable_blocks()))
             for p in pools],
            {s: ([manager.block_table(s, g) for g in range(len(manager.group_windows))],
                 manager.num_tokens(s), manager.is_swapped(s))
             for s in manager.seq_ids},
            len(manager.prefix_cache or ()), manager.plan(),
            [t.tolist() for t in manager.build_batch(
                [s for s in manager.seq_ids if not manager.is_swapped(s)]).group_block_tables])


class InjectedFailure(RuntimeError):
    pass


class FailingExecutor(PlanExecutor):
    """An executor whose ``fail_on`` phase raises before touching the tensors."""

    fail_on: str | None = None

    def apply(self, phase, work):
        if phase == self.fail_on:
            raise InjectedFailure(phase)
        super().apply(phase, work)


class BlockManagerMachine(RuleBasedStateMachine):
    manager_options = dict(debug_nan=True)

    def __init__(self) -> None:
        super().__init__()
        self.cache = PagedKVCache(SPEC, 24)
        self.cpu_cache = cpu_cache_for(self.cache, 16)
        self.manager = BlockManager(24, SPEC.block_size, num_cpu_blocks=16, **self.manager_options)
        self.executor = FailingExecutor(self.cache, self.cpu_cache)
        self.seqs: dict[int, tuple[list[int], object]] = {}
        self.freed: list[int] = []
        self.next_id = 0

    def resident(self) -> list[int]:
        return [s for s in self.seqs if not self.manager.is_swapped(s)]

    def swapped(self) -> list[int]:
        return [s for s in self.seqs if self.manager.is_swapped(s)]

    def new_id(self) -> int:
        seq_id, self.next_id = self.next_id, self.next_id + 1
        return seq_id

    def num_held(self, seq_id: int) -> int:
        """Blocks the sequence holds (what a swap-out moves)."""
        return len(self.manager.block_table(seq_id))

    def added(self, seq_id: int, cached: int) -> None:
        """Hook: a sequence was added with ``cached`` tokens found in the cache."""

    def forked(self, parent: int, child: int) -> None:
        """Hook: ``child`` was forked from ``parent``."""

    def append_tokens(self, seq_id: int, tokens: list[int]) -> list:
        return self.manager.append_tokens(seq_id, tokens)

    def can_append(self, seq_id: int, num_tokens: int) -> bool:
        return self.manager.can_append(seq_id, num_tokens)

    def slot_mapping(self, batch, layer: int):
        """The slot mapping the layer writes with."""
        return batch.slot_mapping

    def expect_out_of_blocks(self, operation, *args) -> None:
        before = snapshot(self.manager)
        try:
            operation(*args)
        except OutOfBlocksError:
            assert snapshot(self.manager) == before
            event(f"{operation.__name__}: out of blocks")
        else:
            raise AssertionError(f"{operation.__name__} should have run out of blocks")

    def write(self, seq_ids: list[int], num_new: list[int], fail_on: str | None = None) -> None:
        """A step: the batch, the plan (failing once in ``fail_on`` first, then retried), then
        the kernel writing the new tokens' K/V."""
        batch = self.manager.build_batch(seq_ids, num_new)
        if fail_on is not None:
            self.run_plan(fail_on)
        self.executor.fail_on = None
        self.executor.run(self.manager)
        assert not self.manager.plan()
        for layer in range(SPEC.num_layers):
            kv = [expected_kv(*self.seqs[s], layer) for s in seq_ids]
            key = torch.cat([k[len(k) - n:] for (k, _), n in zip(kv, num_new, strict=True)])
            value = torch.cat([v[len(v) - n:] for (_, v), n in zip(kv, num_new, strict=True)])
            ops.reshape_and_cache(key, value, *self.cache.layer(layer),
                                  self.slot_mapping(batch, layer))

    @rule(prefix=st.sampled_from(PREFIXES), cut=st.integers(0, 12),
          suffix=st.lists(st.integers(0, 9), max_size=6), extra_key=st.sampled_from([None, "x"]))
    def add(self, prefix, cut, suffix, extra_key):
        tokens = prefix[:cut] + suffix
        if not tokens:
            return
        if not self.manager.can_allocate(tokens, extra_key):
            self.expect_out_of_blocks(self.manager.add_sequence, -1, tokens, extra_key)
            return
        seq_id = self.new_id()
        cached = self.manager.add_sequence(seq_id, tokens, extra_key)
        assert cached % SPEC.block_size == 0 and 0 <= cached < len(tokens)
        self.added(seq_id, cached)
        event(f"add: {'prefix hit' if cached else 'miss'}")
        self.seqs[seq_id] = (tokens, extra_key)
        self.write([seq_id], [len(tokens) - cached])

    def append(self, data, seq_id: int) -> int:
        """Append 1-5 tokens to a resident sequence unless it runs out of blocks; returns how
        many (the K/V are written by a later ``write``)."""
        tokens = data.draw(st.lists(st.integers(0, 9), min_size=1, max_size=5))
        if not self.can_append(seq_id, len(tokens)):
            self.expect_out_of_blocks(self.append_tokens, seq_id, tokens)
            return 0
        if self.append_tokens(seq_id, tokens):
            event("append: copy-on-write")
        self.seqs[seq_id][0].extend(tokens)
        return len(tokens)

    @precondition(lambda self: self.resident())
    @rule(data=st.data(), interfere=st.booleans(), fail_on=st.sampled_from([None, *PHASES]))
    def decode_step(self, data, interfere, fail_on):
        chosen = data.draw(st.lists(st.sampled_from(self.resident()), min_size=1, unique=True))
        self.step(data, chosen, interfere, fail_on)

    def step(self, data, chosen: list[int], interfere: bool, fail_on: str | None) -> None:
        """Append to ``chosen``; optionally free or swap out other sequences before the plan
        runs (the copy sources of pending copy-on-writes among them); then write."""
        appended = {seq_id: self.append(data, seq_id) for seq_id in chosen}
        appended = {seq_id: n for seq_id, n in appended.items() if n}
        others = [s for s in self.resident() if s not in appended]
        if interfere and others:
            for seq_id in data.draw(st.lists(st.sampled_from(others), unique=True, max_size=3)):
                if data.draw(st.booleans()) or not self.manager.cpu_allocator.can_allocate(
                        self.num_held(seq_id)):
                    self.free_seq(seq_id)
                    event("step: freed another sequence before the plan ran")
                else:
                    self.manager.swap_out(seq_id)
                    event("step: swapped out another sequence before the plan ran")
        if appended:
            self.write(list(appended), list(appended.values()), fail_on)

    @precondition(lambda self: self.resident())
    @rule(data=st.data(), depth=st.integers(1, 3), parent_appends=st.booleans(),
          fail_on=st.sampled_from([None, *PHASES]))
    def fork_chain(self, data, depth, parent_appends, fail_on):
        """Parallel sampling and beam search: fork, append (a pending copy-on-write), fork the
        child, append... all before the step's plan runs; then one step writes them all."""
        parent = data.draw(st.sampled_from(self.resident()))
        tokens, extra_key = self.seqs[parent]
        chain, current = [], parent
        for _ in range(depth):
            child = self.new_id()
            self.manager.fork(current, child)
            self.forked(current, child)
            self.seqs[child] = (list(self.seqs[current][0]), extra_key)
            chain.append(child)
            if not self.append(data, child):
                break
            current = child
        if depth > 1:
            event(f"fork_chain: depth {depth}")
        written = {s: 0 for s in chain}
        for child in chain:  # tokens appended to a child before its fork were written by no one
            written[child] = len(self.seqs[child][0]) - len(tokens)
        if parent_appends:
            written[parent] = self.append(data, parent)
        todo = {s: n for s, n in written.items() if n}
        assert all(n > 0 for n in todo.values())
        if todo:  # a member writes what it holds beyond the common prefix: what it inherited
            self.write(list(todo), list(todo.values()), fail_on)  # unwritten: its own to write

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def free(self, data):
        self.free_seq(data.draw(st.sampled_from(sorted(self.seqs))))

    def free_seq(self, seq_id: int) -> None:
        self.manager.free(seq_id)
        del self.seqs[seq_id]
        self.freed.append(seq_id)

    @precondition(lambda self: self.freed)
    @rule(data=st.data())
    def use_after_free_raises(self, data):
        seq_id = data.draw(st.sampled_from(self.freed))
        before = snapshot(self.manager)
        for operation, error in ((self.manager.free, DoubleFreeError),
                                 (lambda s: self.manager.append_tokens(s, 1), FreedSequenceError)):
            with pytest.raises(error):
                operation(seq_id)
        assert snapshot(self.manager) == before

    @rule(data=st.data())
    def bad_call_changes_nothing(self, data):
        """A call with a bad argument raises a pagedkv error naming it, before any change."""
        m = self.manager
        some = sorted(self.seqs)[0] if self.seqs else 0
        calls = {
            "negative token id": lambda: m.add_sequence(self.next_id, [1, 2, -3]),
            "float token ids": lambda: m.add_sequence(self.next_id, [1.0, 2.0]),
            "token id too large": lambda: m.add_sequence(self.next_id, [2**63]),
            "2-D token ids": lambda: m.add_sequence(self.next_id, torch.ones(2, 2, dtype=int)),
            "unhashable seq id": lambda: m.add_sequence([1], [1, 2]),
            "unencodable extra key": lambda: m.add_sequence(self.next_id, [1], 1.5),
            "append a bad token": lambda: m.append_tokens(some, [4, None]),
            "append a bool": lambda: m.append_tokens(some, True),
            "fork onto an existing id": lambda: m.fork(some, some),
            "negative num_tokens": lambda: m.can_append(some, -1),
            "duplicate batch ids": lambda: m.build_batch([some, some]),
            "batch of a string": lambda: m.build_batch("ab"),
            "negative eviction": lambda: m.evict_cached(-1),
            "unknown sequence": lambda: m.free(("nobody",)),
        }
        name = data.draw(st.sampled_from(sorted(calls)))
        before = snapshot(m)
        with pytest.raises((PagedKVError, ValueError, TypeError)):
            calls[name]()
        assert snapshot(m) == before, name

    @precondition(lambda self: self.resident())
    @rule(data=st.data())
    def swap_out(self, data):
        seq_id = data.draw(st.sampled_from(self.resident()))
        if self.manager.cpu_allocator.can_allocate(self.num_held(seq_id)):
            self.manager.swap_out(seq_id)
            event("swap_out")
        else:  # (blocks of a pending swap-in need no new CPU block: may still succeed)
            try:
                self.manager.swap_out(seq_id)
                event("swap_out: reused pending swap-in blocks")
            except OutOfBlocksError:
                event("swap_out: out of blocks")

    @precondition(lambda self: self.swapped())
    @rule(data=st.data())
    def swap_in(self, data):
        seq_id = data.draw(st.sampled_from(self.swapped()))
        if self.manager.can_swap_in(seq_id):
            num_blocks = len(self.manager.block_table(seq_id))
            copied = len(self.manager.swap_in(seq_id))
            event("swap_in: " + ("reused cached blocks" if copied < num_blocks else "copied all"))
        else:
            self.expect_out_of_blocks(self.manager.swap_in, seq_id)

    @rule(num_blocks=st.integers(0, 4))
    def evict(self, num_blocks):
        evictable = list(self.manager.allocator.evictable_blocks())
        assert self.manager.evict_cached(num_blocks) == evictable[:num_blocks]
        event(f"evict: {min(num_blocks, len(evictable))} evicted")

    @rule(fail_on=st.sampled_from([None, *PHASES]))
    def run_plan(self, fail_on):
        """Apply the pending plan, or fail in one phase: the phases before it stay done, it and
        the later ones stay pending, and the read-back invariant must still hold."""
        before = self.manager.plan()
        self.executor.fail_on = fail_on
        # completing the copies can free their sources: a second, poison-only pass fills them
        second_pass = fail_on == "poison" and before.copies and self.manager.debug_nan
        if fail_on is None or not (getattr(before, fail_on) or second_pass):
            self.executor.run(self.manager)
            assert not self.manager.plan()
            return
        try:
            self.executor.run(self.manager)
        except InjectedFailure:
            pass
        else:
            assert not getattr(before, fail_on), "the failing phase had work: run must raise"
            assert not self.manager.plan()
            return
        after = self.manager.plan()
        failed = PHASES.index(fail_on)
        for phase in PHASES[:failed]:
            if phase != "poison":
                assert not getattr(after, phase), phase
        for phase in PHASES[failed:]:
            if phase == "poison":
                assert set(before.poison) <= set(after.poison)
            else:
                assert getattr(after, phase) == getattr(before, phase), phase
        event(f"run_plan: failed in {fail_on}")

    def held_tables(self, seq_id: int) -> list[list[int]]:
        """The blocks the sequence holds, a list per block table (one here)."""
        return [self.manager.block_table(seq_id)]

    @invariant()
    def reference_counts_are_tables_plus_plan(self):
        plan = self.manager.plan()
        pins = {False: Counter(src for src, _ in plan.copies),
                True: Counter(cpu for cpu, _ in plan.swap_in)}
        for pool, swapped in ((self.manager.allocator, False), (self.manager.cpu_allocator, True)):
            tables = [t for s in self.seqs if self.manager.is_swapped(s) == swapped
                      for t in self.held_tables(s)]
            assert all(len(set(t)) == len(t) for t in tables)
            holders = Counter(b for t in tables for b in t) + pins[swapped]
            assert [pool.ref_counts[b] for b in range(pool.num_blocks)] == \
                [holders[b] for b in range(pool.num_blocks)]
            used = {b for b in range(pool.num_blocks) if pool.ref_counts[b]}
            free, evictable = set(pool.free_blocks()), set(pool.evictable_blocks())
            assert len(free) == pool.num_free_blocks and len(evictable) == pool.num_evictable_blocks
            assert not (used & free or used & evictable or free & evictable)
            assert len(free) + len(used) + len(evictable) == pool.num_usable_blocks
            assert pool.num_used_blocks == len(used) and pool.null_block not in used | free

    @invariant()
    def plan_phases_are_independent(self):
        plan = self.manager.plan()
        for pairs in (plan.swap_out, plan.copies, plan.swap_in):
            dsts = [d for _, d in pairs]
            assert len(set(dsts)) == len(dsts)
        copy_dsts = {d for _, d in plan.copies}
        assert not copy_dsts & {s for s, _ in plan.copies}
        assert not copy_dsts & {d for _, d in plan.swap_in}

    @invariant()
    def prefix_cache_names_only_live_or_evictable_blocks(self):
        allocator, cache = self.manager.allocator, self.manager.prefix_cache
        cached = [b for b in range(allocator.num_blocks)
                  if b != allocator.null_block and allocator.is_cached(b)]
        assert len(cached) == len(cache or ())
        assert set(allocator.evictable_blocks()) <= set(cached)
        assert not set(cached) & set(allocator.free_blocks())

    def plan_sources(self):
        """Where the pending plan takes each block from: a function (block, swapped) ->
        (cache, block) (phases run in order: a swap-in of a CPU block swapped out in the same
        plan reads the device block that the swap-out reads)."""
        plan = self.manager.plan()
        copies = {d: s for s, d in plan.copies}
        swap_ins = {d: s for s, d in plan.swap_in}
        swap_outs = {d: s for s, d in plan.swap_out}
        poison = set(plan.poison)

        def source(block: int, swapped: bool):
            if swapped:
                return ((self.cache, swap_outs[block]) if block in swap_outs
                        else (self.cpu_cache, block))
            assert block not in poison, "a live block would be NaN-filled"
            if block in swap_ins:  # from a CPU block, maybe swapped out in this plan
                cpu_block = swap_ins[block]
                return ((self.cache, swap_outs[cpu_block]) if cpu_block in swap_outs
                        else (self.cpu_cache, cpu_block))
            return self.cache, copies.get(block, block)

        return source

    @staticmethod
    def read_block(source, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        cache, block = source
        return reference.gather_kv(*cache.layer(layer), torch.tensor([block], dtype=torch.int32),
                                   SPEC.block_size)

    @invariant()
    def every_sequence_reads_back_its_own_kv(self):
        """Read each sequence's blocks where the pending plan will take them from."""
        source = self.plan_sources()
        for seq_id, (tokens, extra_key) in self.seqs.items():
            swapped = self.manager.is_swapped(seq_id)
            sources = [source(block, swapped) for block in self.manager.block_table(seq_id)]
            for layer in range(SPEC.num_layers):
                kv = [self.read_block(src, layer) for src in sources]
                want_key, want_value = expected_kv(tokens, extra_key, layer)
                n = len(tokens)
                assert torch.equal(torch.cat([k for k, _ in kv])[:n], want_key)
                assert torch.equal(torch.cat([v for _, v in kv])[:n], want_value)

    @invariant()
    def decode_batch_matches_block_tables(self):
        seq_ids = self.resident()
        batch = self.manager.build_batch(seq_ids)
        width = batch.block_tables.shape[1]
        for i, seq_id in enumerate(seq_ids):
            table, last = self.manager.block_table(seq_id), len(self.seqs[seq_id][0]) - 1
            assert batch.block_tables[i].tolist() == table + [PAD_BLOCK] * (width - len(table))
            assert batch.seq_lens[i] == last + 1
            block, offset = divmod(last, SPEC.block_size)
            assert batch.slot_mapping[i] == table[block] * SPEC.block_size + offset


class PlainBlockManagerMachine(BlockManagerMachine):
    """No prefix caching, no null block, no NaN fills."""

    manager_options = dict(enable_prefix_caching=False, reserve_null_block=False)


BlockManagerMachine.TestCase.settings = settings(max_examples=50 * SCALE, stateful_step_count=40,
                                                 deadline=None)
PlainBlockManagerMachine.TestCase.settings = settings(max_examples=20 * SCALE,
                                                      stateful_step_count=40, deadline=None)
test_block_manager = BlockManagerMachine.TestCase
test_block_manager_without_prefix_caching = PlainBlockManagerMachine.TestCase
