"""The hybrid manager's contracts one by one: window blocks freed as a sequence grows, the
-1 table entries the attention kernels never read, prefix hits per group, swaps, errors."""

import pytest
import torch

from pagedkv import ops
from pagedkv.blocks.batch import PAD_WINDOW
from pagedkv.blocks.hybrid import HybridBlockManager
from pagedkv.blocks.manager import BlockManager
from pagedkv.blocks.plan import PlanExecutor, cpu_cache_for
from pagedkv.cache.paged_cache import PagedKVCache
from pagedkv.cache.spec import KVCacheSpec
from pagedkv.errors import InvalidArgumentError, OutOfBlocksError

HEADS, KV_HEADS, HEAD = 4, 2, 16


def test_a_32k_request_holds_a_window_and_a_block_in_128_token_layers():
    """The issue's check: 32k tokens, 128-token window layers, blocks of 16."""
    manager = BlockManager(4200, 16, groups=(None, 128))
    prompt = [i % 50_000 for i in range(32 * 1024)]
    assert manager.add_sequence("a", prompt) == 0
    assert manager.num_held_blocks("a", 1) == 2048  # the prefill reads all of them
    for token in range(40):  # decode: every step frees what fell behind the window
        manager.append_tokens("a", token)
        held = manager.num_held_blocks("a", 1) * 16
        assert held <= 128 + 16
        assert manager.num_held_blocks("a", 0) == -(-manager.num_tokens("a") // 16)
    table = manager.block_table("a", 1)
    assert table.count(PAD_WINDOW) == len(table) - manager.num_held_blocks("a", 1)
    assert manager.allocator.num_used_blocks == 2051 + 9
    # a second request with the same prompt hits in every group
    assert manager.add_sequence("b", prompt) == 32 * 1024 - 16
    full, window = manager.block_table("b", 0), manager.block_table("b", 1)
    assert full[:-1] == manager.block_table("a", 0)[:2047]
    assert window[:2047 - 8] == [PAD_WINDOW] * (2047 - 8)
    assert PAD_WINDOW not in window[2047 - 8:]
    assert manager.usage()["prefix_hit_rate"] == pytest.approx((32 * 1024 - 16) / 65536)


def test_freed_window_blocks_stay_cached_until_evicted():
    manager = BlockManager(64, 4, groups=(None, 6))
    manager.add_sequence("a", list(range(24)))
    window = manager.block_table("a", 1)
    manager.append_tokens("a", 1)  # the query at 24 reads from position 19 on: blocks 4, 5
    assert manager.block_table("a", 1)[:6] == [PAD_WINDOW] * 4 + window[4:]
    assert set(manager.allocator.evictable_blocks()) == set(window[:4])
    # the first token to compute, 20, reads from 15 on: block 3 (cached), block 4 (held)
    assert manager.add_sequence("b", list(range(24))) == 20
    assert manager.block_table("b", 1)[:5] == [PAD_WINDOW] * 3 + window[3:5]
    manager.free("b")
    manager.evict_cached()
    # block 3 is gone: no prefix has its window held any more (the full group still has all)
    assert manager.prefix_caches[0].match(list(range(24)), None, 5)[0] == \
        manager.block_table("a", 0)[:5]
    assert manager.add_sequence("c", list(range(24))) == 0


def run_attention(cache, layer, tables, seq_lens, query_start_loc, query, window):
    out = torch.full_like(query, float("nan"))
    q_lens = (query_start_loc[1:] - query_start_loc[:-1]).tolist()
    ops.paged_attention(out, query, *cache.layer(layer), tables, seq_lens, query_start_loc,
                        int(seq_lens.max()), max(q_lens), HEAD ** -0.5, sliding_window=window)
    return out


def dense_cache(spec, keys, values, layer):
    """The sequence's K/V in a fresh cache, blocks 0.. in order: the full table."""
    n = keys.shape[0]
    blocks = -(-n // spec.block_size)
    cache = PagedKVCache(spec, blocks)
    slots = torch.arange(n, dtype=torch.int64)
    ops.reshape_and_cache(keys, values, *cache.layer(layer), slots)
    return cache, torch.arange(blocks, dtype=torch.int32)[None]


@pytest.mark.parametrize("window, block_size", [(24, 8), (7, 4), (1, 4)])
def test_kernels_read_no_freed_entry(window, block_size):
    """paged_attention with sliding_window over a window group's table (-1 for the blocks the
    manager freed) gives what it gives over the sequence's full table."""
    torch.manual_seed(window)
    spec = KVCacheSpec(2, KV_HEADS, HEAD, block_size, torch.float32,
                       sliding_windows=(None, window))
    cache = PagedKVCache(spec, 96)
    manager = BlockManager(96, block_size, groups=spec.group_windows, debug_nan=True)
    executor = PlanExecutor(cache)
    n = 61
    keys, values = torch.randn(2, n + 9, KV_HEADS, HEAD).unbind(0)
    prompt = list(range(n))

    def step(seq_id, tokens, q_len):
        batch = manager.build_batch([seq_id], q_len)
        executor.run(manager)  # NaN-fills every freed block (debug_nan)
        lo = len(tokens) - q_len
        ops.reshape_and_cache(keys[lo:len(tokens)], values[lo:len(tokens)], *cache.layer(1),
                              batch.group_slot_mappings[1])
        return batch

    assert manager.add_sequence("a", prompt) == 0
    step("a", prompt, n)
    for t in range(9):  # decode steps
        prompt.append(t)
        manager.append_tokens("a", t)
        batch = step("a", prompt, 1)
        table = batch.group_block_tables[1]
        assert (table == PAD_WINDOW).any() or len(prompt) <= window + block_size
        query = torch.randn(1, HEADS, HEAD)
        got = run_attention(cache, 1, table, batch.seq_lens, batch.query_start_loc, query, window)
        full_cache, full_table = dense_cache(spec, keys[:len(prompt)], values[:len(prompt)], 1)
        want = run_attention(full_cache, 1, full_table, batch.seq_lens, batch.query_start_loc,
                             query, window)
        assert torch.equal(got, want)
    # prefill on top of a prefix hit: the window table starts at the first token's window
    cached = manager.add_sequence("b", prompt[:n])
    assert cached > window
    batch = step("b", prompt[:n], n - cached)
    table = batch.group_block_tables[1]
    assert table[0, :max(0, cached - window + 1) // block_size].eq(PAD_WINDOW).all()
    query = torch.randn(n - cached, HEADS, HEAD)
    got = run_attention(cache, 1, table, batch.seq_lens, batch.query_start_loc, query, window)
    full_cache, full_table = dense_cache(spec, keys[:n], values[:n], 1)
    want = run_attention(full_cache, 1, full_table, batch.seq_lens, batch.query_start_loc, query,
                         window)
    assert torch.equal(got, want)


def test_chunked_prefill_frees_only_behind_the_computed_tokens():
    manager = BlockManager(64, 4, groups=(None, 4))
    manager.add_sequence("a", list(range(8)))  # the first chunk
    manager.append_tokens("a", list(range(8)), num_computed=8)  # 8 ran: keys from 5 on
    assert manager.block_table("a", 1)[:2] == [PAD_WINDOW, manager.block_table("a", 1)[1]]
    assert PAD_WINDOW not in manager.block_table("a", 1)[1:]
    manager.append_tokens("a", list(range(8)), num_computed=10)  # only 10 of 16 ran
    assert manager.num_held_blocks("a", 1) == 5  # blocks 1-5: keys from position 7 on
    manager.append_tokens("a", [], num_computed=16)  # the rest ran: keys from 13 on
    assert manager.num_held_blocks("a", 1) == 3
    for bad in (15, 25, -1, 1.5):
        with pytest.raises(InvalidArgumentError, match="num_computed"):
            manager.append_tokens("a", [1], num_computed=bad)
        with pytest.raises(InvalidArgumentError, match="num_computed"):
            manager.can_append("a", 1, num_computed=bad)


def test_can_append_counts_the_blocks_a_window_releases():
    manager = BlockManager(5, 4, groups=(2,), enable_prefix_caching=False)  # 4 usable blocks
    manager.add_sequence("a", list(range(16)))  # 4 blocks: the pool is full
    assert manager.allocator.num_available_blocks == 0
    assert manager.can_append("a", 1)  # releases blocks 0-2, takes one
    manager.append_tokens("a", 1)
    assert manager.num_held_blocks("a", 0) == 2
    manager.fork("a", "b")  # shared blocks: releasing them frees nothing
    for t in range(3):
        manager.append_tokens("a", t)  # a copy of the shared last block
    assert manager.allocator.num_available_blocks == 1
    assert manager.can_append("b", 8)  # releases block 3 (a let it go), needs 2
    assert not manager.can_append("b", 12)
    before = manager.block_table("b"), list(manager.allocator.ref_counts), manager.plan()
    with pytest.raises(OutOfBlocksError):
        manager.append_tokens("b", list(range(12)))
    assert (manager.block_table("b"), list(manager.allocator.ref_counts), manager.plan()) == before


@pytest.mark.parametrize("evict", [True, False])
def test_swap_out_and_in_keep_every_group(evict):
    spec = KVCacheSpec(2, KV_HEADS, HEAD, 4, torch.float32, sliding_windows=(None, 6))
    cache = PagedKVCache(spec, 32)
    manager = BlockManager(32, 4, groups=spec.group_windows, num_cpu_blocks=32)
    executor = PlanExecutor(cache, cpu_cache_for(cache, 32))
    keys = torch.randn(20, KV_HEADS, HEAD)
    manager.add_sequence("a", list(range(18)))
    manager.append_tokens("a", [1, 2])
    batch = manager.build_batch(["a"], 20)
    executor.run(manager)
    for layer in (0, 1):
        ops.reshape_and_cache(keys, -keys, *cache.layer(layer), batch.group_slot_mappings[layer])
    before = [manager.block_table("a", g) for g in (0, 1)]
    pairs = manager.swap_out("a")
    assert len(pairs) == manager.num_held_blocks("a", 0) + manager.num_held_blocks("a", 1)
    assert manager.block_table("a", 1)[:3] == [PAD_WINDOW] * 3
    executor.run(manager)
    if evict:
        manager.evict_cached()
    copied = manager.swap_in("a")
    # cached blocks come back without a copy, in both groups (20 tokens: every block is full)
    assert len(copied) == (len(pairs) if evict else 0)
    executor.run(manager)
    after = [manager.block_table("a", g) for g in (0, 1)]
    assert [t.count(PAD_WINDOW) for t in after] == [t.count(PAD_WINDOW) for t in before]
    for layer in (0, 1):
        for i, block in enumerate(after[layer]):
            if block != PAD_WINDOW:
                got = cache.layer(layer)[0][block].transpose(0, 1)
                assert torch.equal(got[:len(keys[i * 4:i * 4 + 4])], keys[i * 4:i * 4 + 4])
    manager.free("a")
    assert manager.allocator.num_used_blocks == 0
    assert manager.cpu_allocator.num_used_blocks == 0


def test_one_full_group_is_the_plain_manager():
    assert type(BlockManager(8, 4, groups=[None])) is BlockManager
    assert isinstance(BlockManager(8, 4, groups=(None, None)), HybridBlockManager)
    manager = BlockManager(8, 4)
    manager.add_sequence("a", [1, 2, 3])
    assert manager.group_windows == (None,)
    assert manager.block_table("a", 0) == manager.block_table("a")
    with pytest.raises(InvalidArgumentError, match="group"):
        manager.block_table("a", 1)
    batch = manager.build_batch(["a"])
    assert batch.group_block_tables == (batch.block_tables,)


def test_bad_group_index_names_the_argument():
    manager = BlockManager(8, 4, groups=(None, 4))
    manager.add_sequence("a", [1, 2, 3])
    for bad in (2, -1, "0", True):
        with pytest.raises(InvalidArgumentError, match="group"):
            manager.block_table("a", bad)
        with pytest.raises(InvalidArgumentError, match="group"):
            manager.num_held_blocks("a", bad)


@pytest.mark.parametrize("windows, num_tokens", [
    ((128, None) * 3, 1000), ((7, 7, None), 64), ((7, 7, None), 65), ((5,), 33), ((None,), 9)])
def test_the_spec_counts_what_the_manager_holds(windows, num_tokens):
    """KVCacheSpec.hybrid_kv_bytes (pagedkv size's figure) against a manager's blocks."""
    spec = KVCacheSpec(len(windows), 2, 8, 16, sliding_windows=windows)
    manager = BlockManager(1000, 16, groups=spec.group_windows)
    manager.add_sequence("a", list(range(num_tokens - 1)))
    manager.append_tokens("a", 1)  # decoding: the prefill ran
    if isinstance(manager, HybridBlockManager):
        held = sum(manager.num_held_blocks("a", g) for g in range(len(spec.group_windows)))
    else:  # one full-attention group: the plain manager
        held = len(manager.block_table("a"))
    assert spec.hybrid_kv_bytes(num_tokens) == held * spec.bytes_per_block
