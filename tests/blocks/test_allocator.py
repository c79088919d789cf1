import pytest

from pagedkv.blocks.allocator import NULL_BLOCK, BlockAllocator
from pagedkv.errors import DoubleFreeError, InvalidBlockError, OutOfBlocksError, PagedKVError


def snapshot(allocator: BlockAllocator):
    return (list(allocator.ref_counts), sorted(allocator.free_blocks()),
            list(allocator.evictable_blocks()), allocator.num_used_blocks)


def test_allocate_and_free_count_references():
    allocator = BlockAllocator(8)
    blocks = allocator.allocate(3)
    assert len(set(blocks)) == 3
    assert allocator.num_used_blocks == 3 and allocator.num_free_blocks == 5
    allocator.incref(blocks[0])
    assert allocator.free(blocks) == blocks[1:]
    assert allocator.ref_counts[blocks[0]] == 1
    assert allocator.free([blocks[0]]) == [blocks[0]]
    assert allocator.num_free_blocks == 8 and allocator.num_used_blocks == 0


def test_null_block_is_never_handed_out():
    allocator = BlockAllocator(4, reserve_null_block=True)
    assert allocator.null_block == NULL_BLOCK and allocator.num_usable_blocks == 3
    assert sorted(allocator.allocate(3)) == [1, 2, 3]
    for op in (allocator.incref, lambda b: allocator.free([b]), allocator.mark_cached):
        with pytest.raises(InvalidBlockError, match="not usable"):
            op(NULL_BLOCK)


def test_out_of_blocks_is_all_or_nothing():
    allocator = BlockAllocator(4)
    allocator.allocate(3)
    before = snapshot(allocator)
    with pytest.raises(OutOfBlocksError, match="asked for 2, 1 available") as info:
        allocator.allocate(2)
    assert isinstance(info.value, PagedKVError)
    assert (info.value.requested, info.value.available) == (2, 1)
    assert snapshot(allocator) == before


def test_reserve_raises_exactly_when_allocate_would():
    allocator = BlockAllocator(6, name="cpu")
    a, b = allocator.allocate(2)
    allocator.free([a])
    allocator.mark_cached(b)
    allocator.free([b])  # evictable: it counts as available
    before = snapshot(allocator)
    for n in range(7):
        allocator.reserve(n)
    with pytest.raises(OutOfBlocksError, match="out of cpu blocks: asked for 7, 6 available"):
        allocator.reserve(7)
    assert snapshot(allocator) == before


def test_double_free_changes_nothing():
    allocator = BlockAllocator(4)
    a, b = allocator.allocate(2)
    before = snapshot(allocator)
    with pytest.raises(DoubleFreeError, match=f"block {a} freed 2 time"):
        allocator.free([b, a, a])
    assert snapshot(allocator) == before
    allocator.free([a])
    with pytest.raises(DoubleFreeError):
        allocator.free([a])


def test_negative_count_is_rejected():
    with pytest.raises(ValueError, match="-1"):
        BlockAllocator(4).allocate(-1)


@pytest.mark.parametrize("block", [-1, 4])
def test_out_of_range_ids_raise(block):
    with pytest.raises(InvalidBlockError):
        BlockAllocator(4).incref(block)


def test_cached_blocks_become_evictable_in_lru_order():
    allocator = BlockAllocator(4)
    blocks = allocator.allocate(4)
    for block in blocks[:3]:
        allocator.mark_cached(block)
    allocator.free([blocks[1], blocks[0], blocks[2], blocks[3]])
    assert list(allocator.evictable_blocks()) == [blocks[1], blocks[0], blocks[2]]
    assert allocator.num_free_blocks == 1 and allocator.num_available_blocks == 4
    evicted = []
    allocator.on_evict = evicted.append
    assert allocator.allocate(2) == [blocks[3], blocks[1]]  # free first, then LRU
    assert evicted == [blocks[1]] and allocator.num_evictions == 1
    assert not allocator.is_cached(blocks[1])


def test_incref_revives_evictable_but_not_free_blocks():
    allocator = BlockAllocator(3)
    a, b = allocator.allocate(2)
    allocator.mark_cached(a)
    allocator.free([a, b])
    allocator.incref(a)
    assert allocator.ref_counts[a] == 1 and allocator.num_evictable_blocks == 0
    assert allocator.num_used_blocks == 1
    with pytest.raises(InvalidBlockError, match="free"):
        allocator.incref(b)
    with pytest.raises(InvalidBlockError, match="used block"):
        allocator.mark_cached(b)


def test_evict_moves_lru_blocks_to_free():
    allocator = BlockAllocator(4)
    blocks = allocator.allocate(3)
    for block in blocks:
        allocator.mark_cached(block)
    allocator.free(blocks)
    assert allocator.evict(2) == blocks[:2]
    assert allocator.num_evictable_blocks == 1 and allocator.num_free_blocks == 3
    assert allocator.evict() == blocks[2:]
    assert allocator.evict(5) == []


def test_allocation_is_constant_time_in_pool_size():
    allocator = BlockAllocator(1 << 20)
    blocks = allocator.allocate(1000)
    allocator.free(blocks)
    assert allocator.num_free_blocks == 1 << 20
