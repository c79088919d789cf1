"""Counts past int32 are bad counts: every public method of block management that takes one
raises an InvalidArgumentError naming the argument, with the state exactly as before, instead of
numpy's OverflowError where the count becomes an int32 tensor (or a silent clamp elsewhere)."""

import re
from dataclasses import astuple

import numpy as np
import pytest
import torch

from pagedkv.blocks.allocator import BlockAllocator
from pagedkv.blocks.batch import BlockTableRows
from pagedkv.blocks.manager import BlockManager
from pagedkv.blocks.prefix import PrefixCache
from pagedkv.checks import INT32_MAX
from pagedkv.errors import InvalidArgumentError, PagedKVError

PAST_INT32 = [INT32_MAX + 1, 2**40, np.int64(2**40), torch.tensor(2**40)]


def busy_manager() -> BlockManager:
    """A manager with something in every part of its state: tables, a prefix hit, evictable
    cached blocks, a pending copy-on-write, a swapped-out sequence and NaN fills."""
    manager = BlockManager(16, 4, num_cpu_blocks=8, debug_nan=True)
    manager.add_sequence("a", list(range(1, 10)))
    manager.add_sequence("b", [1, 2, 3, 4, 7, 7, 7, 7, 7])
    manager.add_sequence("gone", [5, 5, 5, 5, 5])
    manager.free("gone")
    manager.fork("a", "c")
    manager.append_tokens("c", 11)
    manager.add_sequence("s", [9, 9, 9])
    manager.swap_out("s")
    return manager


def manager_state(manager: BlockManager):
    pools = [manager.allocator] + ([manager.cpu_allocator] if manager.cpu_allocator else [])
    return ([(list(p.ref_counts), sorted(p.free_blocks()), list(p.evictable_blocks()))
             for p in pools],
            {s: (manager.block_table(s), manager.num_tokens(s), manager.is_swapped(s))
             for s in manager.seq_ids},
            len(manager.prefix_cache), astuple(manager.prefix_cache.stats), manager.plan(),
            manager.tables.array.tolist())


def allocator_state(allocator: BlockAllocator):
    return (list(allocator.ref_counts), list(allocator.free_blocks()),
            list(allocator.evictable_blocks()), allocator.num_used_blocks,
            allocator.num_evictions)


def refused(name: str):
    return pytest.raises(InvalidArgumentError, match=re.escape(name) + ".*<= 2147483647")


def test_the_reported_case():
    manager = BlockManager(16, 4)
    manager.add_sequence("a", list(range(1, 10)))
    before = manager_state(manager)
    with pytest.raises(PagedKVError, match="num_query_tokens"):
        manager.build_batch(["a"], 2**40)
    assert manager_state(manager) == before


@pytest.mark.parametrize("big", PAST_INT32, ids=repr)
@pytest.mark.parametrize("call, name", [
    (lambda m, big: m.build_batch(["a"], big), "num_query_tokens"),
    (lambda m, big: m.build_batch(["a", "c"], [1, big]), "num_query_tokens[1]"),
    (lambda m, big: m.build_batch(["a"], max_blocks=big), "max_blocks"),
    (lambda m, big: m.build_batch(["a"], pad_tokens_to=big), "pad_tokens_to"),
    (lambda m, big: m.can_append("a", big), "num_tokens"),
    (lambda m, big: m.evict_cached(big), "num_blocks"),
], ids=["build_batch", "build_batch-list", "build_batch-max_blocks",
        "build_batch-pad_tokens_to", "can_append", "evict_cached"])
def test_manager_methods_refuse_counts_past_int32(call, name, big):
    manager = busy_manager()
    before = manager_state(manager)
    with refused(name):
        call(manager, big)
    assert manager_state(manager) == before


@pytest.mark.parametrize("big", [INT32_MAX + 1, 2**40])
def test_manager_refuses_an_array_of_query_lengths_past_int32(big):
    manager = busy_manager()
    before = manager_state(manager)
    with refused("num_query_tokens[1]"):
        manager.build_batch(["a", "c"], np.array([1, big]))
    assert manager_state(manager) == before


@pytest.mark.parametrize("kwargs, name", [
    (dict(num_blocks=2**40, block_size=4), "num_blocks"),
    (dict(num_blocks=16, block_size=INT32_MAX + 1), "block_size"),
    (dict(num_blocks=16, block_size=4, num_cpu_blocks=2**40), "num_cpu_blocks"),
])
def test_manager_sizes_past_int32_raise_at_construction(kwargs, name):
    with refused(name):
        BlockManager(**kwargs)


def test_int32_max_itself_is_a_count():
    manager = busy_manager()
    assert not manager.can_append("a", INT32_MAX)
    evictable = list(manager.allocator.evictable_blocks())
    assert evictable and manager.evict_cached(INT32_MAX) == evictable
    assert manager.prefix_cache.match(list(range(1, 10)), max_blocks=INT32_MAX)[0] == \
        manager.block_table("a")[:2]
    with pytest.raises(InvalidArgumentError, match=r"\[1, seq_len\]"):  # a count, too long here
        manager.build_batch(["a"], INT32_MAX)


@pytest.mark.parametrize("big", PAST_INT32, ids=repr)
def test_allocator_refuses_counts_past_int32(big):
    allocator = BlockAllocator(8, reserve_null_block=True)
    held = allocator.allocate(3)
    allocator.mark_cached(held[0])
    allocator.free(held[:2])
    before = allocator_state(allocator)
    for call in (allocator.allocate, allocator.evict):
        with refused("num_blocks"):
            call(big)
        assert allocator_state(allocator) == before
    with refused("num_blocks"):
        BlockAllocator(big)


def test_allocator_short_of_int32_blocks_is_out_of_blocks_not_a_bad_count():
    allocator = BlockAllocator(8)
    with pytest.raises(PagedKVError, match="out of device blocks"):
        allocator.allocate(INT32_MAX)


@pytest.mark.parametrize("big", PAST_INT32, ids=repr)
def test_prefix_cache_refuses_counts_past_int32(big):
    manager = busy_manager()
    cache = manager.prefix_cache
    before = manager_state(manager)
    calls = [(lambda: cache.match(list(range(1, 10)), max_blocks=big), "max_blocks"),
             (lambda: cache.record_query(big, 0), "query_tokens"),
             (lambda: cache.record_query(10, big), "hit_tokens"),
             (lambda: cache.evict(big), "num_blocks")]
    for call, name in calls:
        with refused(name):
            call()
        assert manager_state(manager) == before, name
    with refused("block_size"):
        PrefixCache(BlockAllocator(8), big)


@pytest.mark.parametrize("big", PAST_INT32, ids=repr)
@pytest.mark.parametrize("kwargs, name", [
    (dict(num_query_tokens="big"), "num_query_tokens"),
    (dict(max_blocks="big"), "max_blocks"),
    (dict(pad_tokens_to="big"), "pad_tokens_to"),
])
def test_block_table_rows_refuse_counts_past_int32(kwargs, name, big):
    tables = BlockTableRows(4)
    row = tables.take()
    tables.write(row, [3, 5])
    before = tables.array.copy()
    kwargs = {key: big for key in kwargs}
    with refused(name):
        tables.build(np.array([row], np.intp), np.array([6], np.int32), **kwargs)
    assert np.array_equal(tables.array, before)
