import pytest

from pagedkv.allocator import BlockAllocator
from pagedkv.prefix import PrefixCache, hash_block

BLOCK = 4


def cached_prompt(cache: PrefixCache, tokens: list[int], extra_key=None) -> list[int]:
    """Allocate and register the full blocks of ``tokens`` like the manager does."""
    blocks = cache.allocator.allocate(len(tokens) // BLOCK)
    parent = b""
    for i, block in enumerate(blocks):
        parent = cache.register(block, parent, tokens[i * BLOCK:(i + 1) * BLOCK], extra_key)
    return blocks


def test_hash_is_chained_stable_and_keyed():
    h0 = hash_block(b"", [1, 2, 3, 4])
    assert len(h0) == 32 and h0 == hash_block(None, (1, 2, 3, 4))
    assert hash_block(h0, [5, 6, 7, 8]) != hash_block(b"", [5, 6, 7, 8])
    assert hash_block(b"", [1, 2, 3, 4], "lora-1") != h0
    assert hash_block(b"", [1, 2, 3, 4], "lora-1") != hash_block(b"", [1, 2, 3, 4], "lora-2")
    assert h0.hex().startswith("87586ba4f18295f8ff03cf03c6d6e307")  # stable across processes


def test_match_returns_the_longest_cached_run():
    cache = PrefixCache(BlockAllocator(16), BLOCK)
    blocks = cached_prompt(cache, list(range(12)))
    assert cache.match(list(range(12)))[0] == blocks
    assert cache.match(list(range(11)))[0] == blocks[:2]
    assert cache.match([*range(8), 0, 0, 0, 0])[0] == blocks[:2]
    assert cache.match([9, *range(1, 12)])[0] == []
    assert cache.match(list(range(12)), max_blocks=1)[0] == blocks[:1]
    assert cache.match(list(range(12)), extra_key="salt")[0] == []


def test_extra_key_separates_prompts():
    cache = PrefixCache(BlockAllocator(16), BLOCK)
    a = cached_prompt(cache, list(range(8)), "a")
    b = cached_prompt(cache, list(range(8)), "b")
    assert cache.match(list(range(8)), "a")[0] == a
    assert cache.match(list(range(8)), "b")[0] == b


def test_a_hash_collision_is_caught_by_token_comparison(monkeypatch):
    cache = PrefixCache(BlockAllocator(16), BLOCK)
    monkeypatch.setattr("pagedkv.prefix._digest", lambda payload: b"x" * 32)
    (block,) = cached_prompt(cache, [1, 2, 3, 4])
    assert cache.match([1, 2, 3, 4])[0] == [block]
    assert cache.match([5, 6, 7, 8])[0] == []


def test_register_keeps_the_first_block_of_a_hash():
    cache = PrefixCache(BlockAllocator(16), BLOCK)
    first = cached_prompt(cache, [1, 2, 3, 4])
    second = cached_prompt(cache, [1, 2, 3, 4])
    assert len(cache) == 1 and cache.match([1, 2, 3, 4])[0] == first
    assert not cache.allocator.is_cached(second[0])


def test_freed_blocks_stay_cached_until_evicted_lru_first():
    allocator = BlockAllocator(4)
    cache = PrefixCache(allocator, BLOCK)
    a = cached_prompt(cache, [1, 1, 1, 1])
    b = cached_prompt(cache, [2, 2, 2, 2])
    allocator.free(a)
    allocator.free(b)
    assert cache.match([1, 1, 1, 1])[0] == a
    allocator.allocate(3)  # two free blocks, then evicts a (least recently freed)
    assert cache.match([1, 1, 1, 1])[0] == [] and cache.match([2, 2, 2, 2])[0] == b
    assert cache.stats.evictions == 1 and len(cache) == 1
    assert cache.evict() == b and len(cache) == 0 and cache.stats.evictions == 2


def test_stats_count_tokens():
    cache = PrefixCache(BlockAllocator(4), BLOCK)
    assert cache.stats.hit_rate == 0.0
    cache.record_query(10, 0)
    cache.record_query(10, 8)
    assert (cache.stats.queries, cache.stats.query_tokens, cache.stats.hit_tokens) == (2, 20, 8)
    assert cache.stats.hit_rate == pytest.approx(0.4)
