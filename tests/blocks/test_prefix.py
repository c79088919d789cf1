import pytest

from pagedkv.blocks.allocator import BlockAllocator
from pagedkv.blocks.prefix import NO_ENTRY, PrefixCache, encode_block, hash_block
from pagedkv.errors import InvalidArgumentError

BLOCK = 4


def cached_prompt(cache: PrefixCache, tokens: list[int], extra_key=None) -> list[int]:
    """Allocate and register the full blocks of ``tokens`` like the manager does."""
    blocks = cache.allocator.allocate(len(tokens) // BLOCK)
    parent = None
    for i, block in enumerate(blocks):
        parent = cache.register(block, parent, tokens[i * BLOCK:(i + 1) * BLOCK], extra_key)
    return blocks


def test_hash_is_chained_stable_and_keyed():
    h0 = hash_block(b"", [1, 2, 3, 4])
    assert len(h0) == 32 and h0 == hash_block(None, (1, 2, 3, 4))
    assert hash_block(h0, [5, 6, 7, 8]) != hash_block(b"", [5, 6, 7, 8])
    assert hash_block(b"", [1, 2, 3, 4], "lora-1") != h0
    assert hash_block(b"", [1, 2, 3, 4], "lora-1") != hash_block(b"", [1, 2, 3, 4], "lora-2")
    assert h0.hex().startswith("d0515b3289849546b6a6209296879af5")  # stable across processes


@pytest.mark.parametrize("a, b", [("1", 1), (b"1", "1"), ((1, 2), "(1, 2)"), (None, "None"),
                                  (("a", "b"), ("ab",)), ((1, (2, 3)), ((1, 2), 3))])
def test_extra_keys_that_print_alike_hash_apart(a, b):
    assert encode_block(None, [1, 2, 3, 4], a) != encode_block(None, [1, 2, 3, 4], b)
    assert hash_block(None, [1, 2, 3, 4], a) != hash_block(None, [1, 2, 3, 4], b)


@pytest.mark.parametrize("bad", [1.5, [1], {"a": 1}, object()])
def test_extra_keys_without_a_canonical_encoding_are_rejected(bad):
    with pytest.raises(InvalidArgumentError, match="extra_key"):
        hash_block(None, [1, 2, 3, 4], bad)


def test_match_returns_the_longest_cached_run():
    cache = PrefixCache(BlockAllocator(16), BLOCK)
    blocks = cached_prompt(cache, list(range(12)))
    assert cache.match(list(range(12)))[0] == blocks
    assert cache.match(list(range(11)))[0] == blocks[:2]
    assert cache.match([*range(8), 0, 0, 0, 0])[0] == blocks[:2]
    assert cache.match([9, *range(1, 12)])[0] == []
    assert cache.match(list(range(12)), max_blocks=1)[0] == blocks[:1]
    assert cache.match(list(range(12)), extra_key="salt")[0] == []
    _, keys = cache.match(list(range(12)))
    assert [h for h, _ in keys] == [hash_block(None, range(4)),
                                   hash_block(keys[0][0], range(4, 8)),
                                   hash_block(keys[1][0], range(8, 12))]


def test_extra_key_separates_prompts():
    cache = PrefixCache(BlockAllocator(16), BLOCK)
    a = cached_prompt(cache, list(range(8)), "a")
    b = cached_prompt(cache, list(range(8)), "b")
    assert cache.match(list(range(8)), "a")[0] == a
    assert cache.match(list(range(8)), "b")[0] == b


def test_a_hash_collision_is_caught_by_token_comparison(monkeypatch):
    cache = PrefixCache(BlockAllocator(16), BLOCK)
    monkeypatch.setattr("pagedkv.blocks.prefix._digest", lambda payload: b"x" * 32)
    (block,) = cached_prompt(cache, [1, 2, 3, 4])
    assert cache.match([1, 2, 3, 4])[0] == [block]
    assert cache.match([5, 6, 7, 8])[0] == []


def test_a_child_under_a_colliding_parent_is_not_reused(monkeypatch):
    """Two prompts whose first blocks collide but differ, with equal second blocks: the second
    prompt's second block must not hit the first prompt's (its K/V were computed after other
    tokens), and nothing registered under an unverified parent is reused."""
    cache = PrefixCache(BlockAllocator(16), BLOCK)
    real = hash_block.__globals__["_digest"]
    first_blocks = {encode_block(None, [1, 2, 3, 4]), encode_block(None, [9, 9, 9, 9])}
    monkeypatch.setattr("pagedkv.blocks.prefix._digest",
                        lambda payload: b"c" * 32 if payload in first_blocks else real(payload))
    a = cached_prompt(cache, [1, 2, 3, 4, 5, 6, 7, 8])
    assert cache.match([1, 2, 3, 4, 5, 6, 7, 8])[0] == a
    assert cache.match([9, 9, 9, 9, 5, 6, 7, 8])[0] == []
    b = cached_prompt(cache, [9, 9, 9, 9, 5, 6, 7, 8])  # its first key collides: NO_ENTRY
    assert len(cache) == 2 and not any(cache.allocator.is_cached(block) for block in b)
    _, keys = cache.match([9, 9, 9, 9])
    assert keys == []
    parent = cache.register(cache.allocator.allocate(1)[0], None, [9, 9, 9, 9])
    assert parent[1] == NO_ENTRY
    child = cache.register(cache.allocator.allocate(1)[0], parent, [5, 6, 7, 8])
    assert child[1] == NO_ENTRY and len(cache) == 2


def test_register_keeps_the_first_block_of_a_hash():
    cache = PrefixCache(BlockAllocator(16), BLOCK)
    first = cached_prompt(cache, [1, 2, 3, 4])
    second = cached_prompt(cache, [1, 2, 3, 4])
    assert len(cache) == 1 and cache.match([1, 2, 3, 4])[0] == first
    assert not cache.allocator.is_cached(second[0])


def test_register_checks_its_arguments_and_changes_nothing():
    cache = PrefixCache(BlockAllocator(4), BLOCK)
    (block,) = cache.allocator.allocate(1)
    for args, name in [((block, None, [1, 2, 3]), "token_ids"),
                       ((block, None, [1, 2, 3, -4]), "token_ids"),
                       ((block, b"parent", [1, 2, 3, 4]), "parent"),
                       ((block, None, [1, 2, 3, 4], 2.5), "extra_key"),
                       ((99, None, [1, 2, 3, 4]), "block id 99")]:
        with pytest.raises(ValueError, match=name):
            cache.register(*args)
        assert len(cache) == 0 and not cache.allocator.is_cached(block)
    with pytest.raises(InvalidArgumentError, match="allocator"):
        PrefixCache(object(), BLOCK)
    with pytest.raises(InvalidArgumentError, match="block_size"):
        PrefixCache(BlockAllocator(4), 0)
    with pytest.raises(InvalidArgumentError, match="max_blocks"):
        cache.match([1, 2, 3, 4], max_blocks=-1)


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


def test_an_evicted_parent_is_not_revived_under_a_stale_child():
    """After the parent's entry is evicted and re-registered in another block, the child entry
    registered under the old parent must not be matched behind the new one."""
    allocator = BlockAllocator(8)
    cache = PrefixCache(allocator, BLOCK)
    parent, child = cached_prompt(cache, list(range(8)))
    allocator.free([parent, child])
    assert allocator.evict(1) == [parent]  # the parent goes first
    (again,) = cached_prompt(cache, list(range(4)))
    assert cache.match(list(range(8)))[0] == [again]


def test_stats_count_tokens():
    cache = PrefixCache(BlockAllocator(4), BLOCK)
    assert cache.stats.hit_rate == 0.0
    cache.record_query(10, 0)
    cache.record_query(10, 8)
    assert (cache.stats.queries, cache.stats.query_tokens, cache.stats.hit_tokens) == (2, 20, 8)
    assert cache.stats.hit_rate == pytest.approx(0.4)
    with pytest.raises(InvalidArgumentError, match="hit_tokens"):
        cache.record_query(4, 8)
    assert cache.stats.queries == 2
