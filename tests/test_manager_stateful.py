"""Stateful property test of BlockManager: random add / decode step / fork / free / swap / evict.

Every sequence's K/V depend on its whole prefix and extra key (like a real model's), so reusing a
block of another prefix, a missed copy-on-write or a lost swap shows up in the read-back check.
"""

from collections import Counter

import torch
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pagedkv import ops, reference
from pagedkv.batch import PAD_BLOCK
from pagedkv.cache import PagedKVCache
from pagedkv.errors import DoubleFreeError, FreedSequenceError, OutOfBlocksError
from pagedkv.manager import BlockManager
from pagedkv.spec import KVCacheSpec

SPEC = KVCacheSpec(num_layers=2, num_kv_heads=2, head_size=8, block_size=4, dtype=torch.float32)
PREFIXES = ([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [1, 2, 3, 4, 9, 9, 9, 9, 5, 5, 5, 5],
            [7] * 12)
LANES = torch.arange(SPEC.num_kv_heads * SPEC.head_size).view(1, SPEC.num_kv_heads, -1)


def expected_kv(tokens: list[int], extra_key, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K/V of every position: an integer code of the prefix up to it (exact in float32)."""
    code, codes = 1 + (extra_key is not None), []
    for token in tokens:
        code = (code * 31 + token + 1) % 65521
        codes.append(code)
    key = (torch.tensor(codes)[:, None, None] * 64 + layer * 16 + LANES).float()
    return key, -key - 1


def snapshot(manager: BlockManager):
    pools = [manager.allocator, manager.cpu_allocator]
    return ([(list(p.ref_counts), sorted(p.free_blocks()), list(p.evictable_blocks()))
             for p in pools],
            {s: (manager.block_table(s), manager.num_tokens(s), manager.is_swapped(s))
             for s in manager.seq_ids},
            len(manager.prefix_cache or ()))


class BlockManagerMachine(RuleBasedStateMachine):
    manager_options = dict(debug_nan=True)

    def __init__(self) -> None:
        super().__init__()
        self.manager = BlockManager(PagedKVCache(SPEC, 24), num_cpu_blocks=16,
                                    **self.manager_options)
        self.seqs: dict[int, tuple[list[int], object]] = {}
        self.freed: list[int] = []
        self.next_id = 0

    def resident(self) -> list[int]:
        return [s for s in self.seqs if not self.manager.is_swapped(s)]

    def swapped(self) -> list[int]:
        return [s for s in self.seqs if self.manager.is_swapped(s)]

    def expect_out_of_blocks(self, operation, *args) -> None:
        before = snapshot(self.manager)
        try:
            operation(*args)
        except OutOfBlocksError:
            assert snapshot(self.manager) == before
            event(f"{operation.__name__}: out of blocks")
        else:
            raise AssertionError(f"{operation.__name__} should have run out of blocks")

    def write(self, seq_ids: list[int], num_new: list[int]) -> None:
        batch = self.manager.build_batch(seq_ids, num_new)
        for layer in range(SPEC.num_layers):
            kv = [expected_kv(*self.seqs[s], layer) for s in seq_ids]
            key = torch.cat([k[len(k) - n:] for (k, _), n in zip(kv, num_new, strict=True)])
            value = torch.cat([v[len(v) - n:] for (_, v), n in zip(kv, num_new, strict=True)])
            ops.reshape_and_cache(key, value, *self.manager.cache.layer(layer),
                                        batch.slot_mapping)

    @rule(prefix=st.sampled_from(PREFIXES), cut=st.integers(0, 12),
          suffix=st.lists(st.integers(0, 9), max_size=6), extra_key=st.sampled_from([None, "x"]))
    def add(self, prefix, cut, suffix, extra_key):
        tokens = prefix[:cut] + suffix
        if not tokens:
            return
        if not self.manager.can_allocate(tokens, extra_key):
            self.expect_out_of_blocks(self.manager.add_sequence, -1, tokens, extra_key)
            return
        seq_id, self.next_id = self.next_id, self.next_id + 1
        cached = self.manager.add_sequence(seq_id, tokens, extra_key)
        assert cached % SPEC.block_size == 0 and 0 <= cached < len(tokens)
        event(f"add: {'prefix hit' if cached else 'miss'}")
        self.seqs[seq_id] = (tokens, extra_key)
        self.write([seq_id], [len(tokens) - cached])

    @precondition(lambda self: self.resident())
    @rule(data=st.data())
    def decode_step(self, data):
        self.decode(data, data.draw(st.lists(st.sampled_from(self.resident()), min_size=1,
                                             unique=True)))

    def decode(self, data, chosen: list[int]) -> None:
        appended, num_new = [], []
        for seq_id in chosen:
            tokens = data.draw(st.lists(st.integers(0, 9), min_size=1, max_size=5))
            if not self.manager.can_append(seq_id, len(tokens)):
                self.expect_out_of_blocks(self.manager.append_tokens, seq_id, tokens)
                continue
            if self.manager.append_tokens(seq_id, tokens):
                event("decode_step: copy-on-write")
            self.seqs[seq_id][0].extend(tokens)
            appended.append(seq_id)
            num_new.append(len(tokens))
        if appended:
            self.write(appended, num_new)

    @precondition(lambda self: self.resident())
    @rule(data=st.data(), then_decode=st.booleans())
    def fork(self, data, then_decode):
        parent = data.draw(st.sampled_from(self.resident()))
        child, self.next_id = self.next_id, self.next_id + 1
        self.manager.fork(parent, child)
        tokens, extra_key = self.seqs[parent]
        self.seqs[child] = (list(tokens), extra_key)
        if then_decode:  # parallel sampling: both append, the first copies the shared last block
            self.decode(data, data.draw(st.permutations([parent, child])))

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def free(self, data):
        seq_id = data.draw(st.sampled_from(sorted(self.seqs)))
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
            try:
                operation(seq_id)
            except error:
                pass
            else:
                raise AssertionError("use after free did not raise")
        assert snapshot(self.manager) == before

    @precondition(lambda self: self.resident())
    @rule(data=st.data())
    def swap_out(self, data):
        seq_id = data.draw(st.sampled_from(self.resident()))
        needed = len(self.manager.block_table(seq_id))
        if self.manager.cpu_allocator.can_allocate(needed):
            self.manager.swap_out(seq_id)
            event("swap_out")
        else:
            self.expect_out_of_blocks(self.manager.swap_out, seq_id)

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

    @invariant()
    def reference_counts_match_block_tables(self):
        for pool, swapped in ((self.manager.allocator, False), (self.manager.cpu_allocator, True)):
            tables = [self.manager.block_table(s) for s in self.seqs
                      if self.manager.is_swapped(s) == swapped]
            assert all(len(set(t)) == len(t) for t in tables)
            holders = Counter(b for t in tables for b in t)
            assert [pool.ref_counts[b] for b in range(pool.num_blocks)] == \
                [holders[b] for b in range(pool.num_blocks)]
            used = {b for b in range(pool.num_blocks) if pool.ref_counts[b]}
            free, evictable = set(pool.free_blocks()), set(pool.evictable_blocks())
            assert len(free) == pool.num_free_blocks and len(evictable) == pool.num_evictable_blocks
            assert not (used & free or used & evictable or free & evictable)
            assert len(free) + len(used) + len(evictable) == pool.num_usable_blocks
            assert pool.num_used_blocks == len(used) and pool.null_block not in used | free

    @invariant()
    def prefix_cache_names_only_live_or_evictable_blocks(self):
        allocator, cache = self.manager.allocator, self.manager.prefix_cache
        cached = [b for b in range(allocator.num_blocks) if allocator.is_cached(b)]
        assert len(cached) == len(cache or ())
        assert set(allocator.evictable_blocks()) <= set(cached)
        assert not set(cached) & set(allocator.free_blocks())

    @invariant()
    def every_sequence_reads_back_its_own_kv(self):
        for seq_id, (tokens, extra_key) in self.seqs.items():
            swapped = self.manager.is_swapped(seq_id)
            cache = self.manager.cpu_cache if swapped else self.manager.cache
            table = torch.tensor(self.manager.block_table(seq_id), dtype=torch.int32)
            for layer in range(SPEC.num_layers):
                key, value = reference.gather_kv(*cache.layer(layer), table, len(tokens))
                want_key, want_value = expected_kv(tokens, extra_key, layer)
                assert torch.equal(key, want_key) and torch.equal(value, want_value)

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


BlockManagerMachine.TestCase.settings = settings(max_examples=50, stateful_step_count=40,
                                                 deadline=None)
PlainBlockManagerMachine.TestCase.settings = settings(max_examples=20, stateful_step_count=40,
                                                      deadline=None)
test_block_manager = BlockManagerMachine.TestCase
test_block_manager_without_prefix_caching = PlainBlockManagerMachine.TestCase
