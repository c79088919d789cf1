from dataclasses import dataclass

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv.blocks.batch import PAD_BLOCK
from pagedkv.blocks.manager import BlockManager
from pagedkv.blocks.plan import PlanExecutor, cpu_cache_for
from pagedkv.cache.paged_cache import PagedKVCache
from pagedkv.cache.spec import KVCacheSpec
from pagedkv.errors import (
    DoubleFreeError,
    DuplicateSequenceError,
    FreedSequenceError,
    OutOfBlocksError,
    PagedKVError,
    SequenceStateError,
    UnknownSequenceError,
)
from pagedkv.ops import reference

SPEC = KVCacheSpec(num_layers=2, num_kv_heads=2, head_size=8, block_size=4, dtype=torch.float32)
DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]


@dataclass
class Rig:
    """A device cache, the manager of its blocks and the executor of the manager's plans."""

    cache: PagedKVCache
    manager: BlockManager
    executor: PlanExecutor

    def run(self):
        return self.executor.run(self.manager)


def make(num_blocks=16, combined_kv=False, device="cpu", num_cpu_blocks=8, spec=SPEC,
         **kwargs) -> Rig:
    cache = PagedKVCache(spec, num_blocks, device, combined_kv=combined_kv)
    manager = BlockManager(cache.num_blocks, cache.spec.block_size,
                           num_cpu_blocks=num_cpu_blocks, **kwargs)
    cpu_cache = cpu_cache_for(cache, num_cpu_blocks) if num_cpu_blocks else None
    return Rig(cache, manager, PlanExecutor(cache, cpu_cache))


def token_kv(seq_tokens: list[int], start: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K/V of positions start.. of a sequence; each depends on its token, position and layer."""
    pos = torch.arange(start, len(seq_tokens), dtype=torch.float32)
    tok = torch.tensor(seq_tokens[start:], dtype=torch.float32)
    base = (tok * 1000 + pos * 10 + layer)[:, None, None]
    lanes = torch.arange(SPEC.num_kv_heads * SPEC.head_size, dtype=torch.float32)
    key = base + lanes.view(1, SPEC.num_kv_heads, SPEC.head_size) / 64
    return key, -key


def write(rig: Rig, seq_id, tokens: list[int], num_new: int) -> None:
    """One step: the batch, then the pending plan, then the kernel writing the new K/V."""
    device = rig.cache.device
    batch = rig.manager.build_batch([seq_id], num_new, device=device)
    rig.run()
    assert not rig.manager.plan()
    for layer in range(SPEC.num_layers):
        key, value = token_kv(tokens, len(tokens) - num_new, layer)
        reference.reshape_and_cache(key.to(device), value.to(device),
                                    *rig.cache.layer(layer), batch.slot_mapping)


def assert_reads_back(rig: Rig, seq_id, tokens: list[int]) -> None:
    assert not rig.manager.plan(), "run the plan before reading the cache"
    table = torch.tensor(rig.manager.block_table(seq_id), dtype=torch.int32)
    for layer in range(SPEC.num_layers):
        key, value = reference.gather_kv(*rig.cache.layer(layer), table, len(tokens))
        want_key, want_value = token_kv(tokens, 0, layer)
        assert torch.equal(key.cpu(), want_key) and torch.equal(value.cpu(), want_value)


def add(rig: Rig, seq_id, tokens: list[int], extra_key=None) -> int:
    cached = rig.manager.add_sequence(seq_id, tokens, extra_key)
    write(rig, seq_id, tokens, len(tokens) - cached)
    return cached


def test_add_reuses_the_cached_prefix():
    rig = make()
    manager = rig.manager
    prompt = list(range(10))
    assert add(rig, "a", prompt) == 0
    assert add(rig, "b", [*prompt, 7, 7]) == 8
    assert manager.block_table("b")[:2] == manager.block_table("a")[:2]
    assert add(rig, "c", prompt, extra_key="other adapter") == 0
    for seq_id, tokens in (("a", prompt), ("b", [*prompt, 7, 7]), ("c", prompt)):
        assert_reads_back(rig, seq_id, tokens)
    stats = manager.prefix_cache.stats
    assert (stats.queries, stats.query_tokens, stats.hit_tokens) == (3, 32, 8)


def test_a_fully_cached_prompt_leaves_its_last_block_to_compute():
    rig = make()
    manager = rig.manager
    add(rig, "a", list(range(8)))
    assert manager.add_sequence("b", list(range(8))) == 4
    assert manager.block_table("b")[0] == manager.block_table("a")[0]
    assert manager.block_table("b")[1] != manager.block_table("a")[1]


def test_freed_prefix_is_revived_and_counted_against_the_pool():
    rig = make(num_blocks=5)  # 4 usable
    manager = rig.manager
    add(rig, "a", list(range(8)))
    manager.free("a")
    assert manager.allocator.num_evictable_blocks == 2
    assert manager.can_allocate(list(range(9)) + [0] * 7)  # 1 revived + 3 new = 4
    assert not manager.can_allocate(list(range(9)) + [0] * 8)
    assert add(rig, "b", list(range(9))) == 8
    assert_reads_back(rig, "b", list(range(9)))


def test_prefix_caching_can_be_disabled():
    rig = make(enable_prefix_caching=False)
    add(rig, "a", list(range(8)))
    assert add(rig, "b", list(range(8))) == 0
    assert rig.manager.prefix_cache is None


def test_the_manager_holds_no_cache():
    manager = make().manager
    for gone in ("cache", "cpu_cache", "flush_copies"):
        assert not hasattr(manager, gone)
    with pytest.raises(TypeError):
        BlockManager(PagedKVCache(SPEC, 16), num_cpu_blocks=8)  # the old signature


def test_add_errors_change_nothing():
    rig = make(num_blocks=4)
    manager = rig.manager
    add(rig, "a", [1, 2, 3])
    with pytest.raises(DuplicateSequenceError):
        manager.add_sequence("a", [1])
    tables = manager.block_table("a")
    with pytest.raises(OutOfBlocksError, match="asked for 3, 2 available") as info:
        manager.add_sequence("b", list(range(12)))
    assert isinstance(info.value, PagedKVError)
    assert manager.seq_ids == ["a"] and manager.block_table("a") == tables
    assert manager.allocator.num_free_blocks == 2
    assert not manager.plan()


def test_usage_counts():
    rig = make()
    manager = rig.manager
    add(rig, "a", list(range(10)))
    add(rig, "b", list(range(9)))
    manager.swap_out("b")
    assert manager.usage() == {"sequences": 2, "swapped": 1, "used_blocks": 3, "cached_blocks": 0,
                               "free_blocks": 12, "cpu_used_blocks": 3,
                               "prefix_hit_rate": 8 / 19}


def test_token_ids_may_be_tensors_or_numpy():
    manager = make().manager
    assert manager.add_sequence("a", torch.arange(9)) == 0
    manager.append_tokens("a", np.int64(9))
    manager.append_tokens("a", torch.tensor(10))
    manager.append_tokens("a", np.array([11, 12]))
    assert manager.add_sequence("b", list(range(13))) == 12
    assert manager.block_table("b")[:3] == manager.block_table("a")[:3]


def test_append_takes_a_block_when_the_last_is_full():
    rig = make()
    manager = rig.manager
    tokens = [5, 6, 7]
    add(rig, "a", tokens)
    for token in range(6):
        assert manager.can_append("a")
        assert manager.append_tokens("a", token) == []
        tokens.append(token)
        write(rig, "a", tokens, 1)
    assert len(manager.block_table("a")) == 3 and manager.num_tokens("a") == 9
    manager.append_tokens("a", [1, 2, 3, 4])
    tokens += [1, 2, 3, 4]
    write(rig, "a", tokens, 4)
    assert_reads_back(rig, "a", tokens)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("combined_kv", [False, True])
def test_fork_shares_blocks_and_copies_the_last_on_write(combined_kv, device):
    rig = make(combined_kv=combined_kv, device=device)
    manager = rig.manager
    tokens = list(range(6))
    add(rig, "parent", tokens)
    manager.fork("parent", "child")
    parent_table = manager.block_table("parent")
    assert manager.block_table("child") == parent_table
    assert [manager.allocator.ref_counts[b] for b in parent_table] == [2, 2]
    assert not manager.plan()  # sharing queues nothing
    (pair,) = manager.append_tokens("child", 100)
    assert pair[0] == parent_table[1] and manager.block_table("child") == [parent_table[0], pair[1]]
    assert manager.plan().copies == (pair,)  # queued, not run: the manager touches no tensor
    assert manager.append_tokens("parent", 200) == []  # no longer shared
    child, parent = [*tokens, 100], [*tokens, 200]
    write(rig, "child", child, 1)  # runs the queued copy before writing
    write(rig, "parent", parent, 1)
    assert_reads_back(rig, "child", child)
    assert_reads_back(rig, "parent", parent)


@pytest.mark.parametrize("then", ["free parent", "swap out child"])
def test_queued_copies_run_before_blocks_are_released_or_swapped(then):
    rig = make(debug_nan=True)
    manager = rig.manager
    tokens = list(range(6))
    add(rig, "parent", tokens)
    manager.fork("parent", "child")
    manager.append_tokens("child", [100])  # queues the copy of the shared last block
    if then == "free parent":
        manager.free("parent")  # would NaN-fill the copy's source if the copy had not run
    else:
        manager.swap_out("child")  # would swap out the copy's destination before the copy
        add(rig, "other", [7] * 8)  # takes the blocks the child released
        manager.swap_in("child")
        rig.run()
        assert_reads_back(rig, "other", [7] * 8)
    write(rig, "child", [*tokens, 100], 1)
    assert_reads_back(rig, "child", [*tokens, 100])


def test_fork_of_a_full_last_block_needs_no_copy():
    manager = make().manager
    add_tokens = list(range(8))
    manager.add_sequence("p", add_tokens)
    manager.fork("p", "c")
    assert manager.append_tokens("c", 1) == []
    assert not manager.plan().copies
    assert manager.block_table("c")[:2] == manager.block_table("p")


def test_sequence_id_errors():
    rig = make()
    manager = rig.manager
    add(rig, "a", [1, 2])
    with pytest.raises(UnknownSequenceError, match="unknown sequence 'zz'"):
        manager.append_tokens("zz", 1)
    manager.free("a")
    with pytest.raises(DoubleFreeError):
        manager.free("a")
    with pytest.raises(FreedSequenceError):
        manager.append_tokens("a", 1)
    with pytest.raises(UnknownSequenceError):  # FreedSequenceError is one
        manager.fork("a", "b")
    assert manager.allocator.num_used_blocks == 0
    add(rig, "a", [3])  # an id may be reused once freed
    assert manager.num_tokens("a") == 1


def test_append_out_of_blocks_changes_nothing():
    rig = make(num_blocks=3)
    manager = rig.manager
    add(rig, "a", [1, 2, 3, 4])
    manager.fork("a", "b")
    add(rig, "c", [1])
    assert not manager.can_append("a")
    with pytest.raises(OutOfBlocksError):
        manager.append_tokens("a", 5)
    assert manager.num_tokens("a") == 4 and manager.block_table("a") == manager.block_table("b")
    assert not manager.plan()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("combined_kv", [False, True])
def test_swap_out_and_in_round_trips_the_data(combined_kv, device):
    rig = make(combined_kv=combined_kv, device=device)
    manager = rig.manager
    tokens = list(range(10))
    add(rig, "a", tokens)
    device_table = manager.block_table("a")
    pairs = manager.swap_out("a")
    assert [d for d, _ in pairs] == device_table and manager.is_swapped("a")
    assert manager.plan().swap_out == tuple(pairs)
    assert manager.allocator.num_used_blocks == 0
    with pytest.raises(SequenceStateError, match="swapped out"):
        manager.append_tokens("a", 1)
    with pytest.raises(SequenceStateError):
        manager.build_batch(["a"])
    add(rig, "b", [1])  # runs the swap-out before writing b (maybe into a's old blocks)
    assert not manager.plan()
    with pytest.raises(SequenceStateError, match="not swapped"):
        manager.swap_in("b")
    add(rig, "filler", list(range(20, 30)))
    assert manager.can_swap_in("a")
    swap_in = manager.swap_in("a")
    assert manager.plan().swap_in == tuple(swap_in)
    assert not manager.is_swapped("a")
    rig.run()
    assert manager.cpu_allocator.num_used_blocks == 0
    assert_reads_back(rig, "a", tokens)


def test_swap_in_reuses_prefix_blocks_still_cached():
    rig = make()
    manager = rig.manager
    tokens = list(range(10))
    add(rig, "a", tokens)
    device_table = manager.block_table("a")
    cpu_table = [cpu for _, cpu in manager.swap_out("a")]
    assert manager.allocator.num_evictable_blocks == 2  # its two full blocks stay cached
    assert manager.swap_in("a") == [(cpu_table[2], manager.block_table("a")[2])]
    assert manager.block_table("a")[:2] == device_table[:2]
    rig.run()
    assert_reads_back(rig, "a", tokens)
    manager.swap_out("a")
    rig.run()
    manager.evict_cached()
    assert len(manager.swap_in("a")) == 3
    rig.run()
    assert_reads_back(rig, "a", tokens)


def test_swap_needs_room_in_the_cpu_pool():
    rig = make(num_cpu_blocks=2)
    manager = rig.manager
    add(rig, "a", list(range(12)))
    with pytest.raises(OutOfBlocksError, match="cpu blocks: asked for 3, 2 available"):
        manager.swap_out("a")
    assert not manager.is_swapped("a") and not manager.plan()
    no_cpu_pool = BlockManager(num_blocks=8, block_size=4)
    no_cpu_pool.add_sequence("x", [1])
    with pytest.raises(OutOfBlocksError, match="cpu blocks: asked for 1, 0 available"):
        no_cpu_pool.swap_out("x")


def test_free_of_a_swapped_sequence_releases_cpu_blocks():
    rig = make()
    manager = rig.manager
    add(rig, "a", list(range(5)))
    manager.swap_out("a")
    manager.free("a")
    assert manager.cpu_allocator.num_used_blocks == 0 and len(manager) == 0


def test_batch_tensors():
    rig = make()
    manager = rig.manager
    add(rig, "a", list(range(9)))
    add(rig, "b", [50, 51])
    batch = manager.build_batch(["b", "a"], [2, 3], pad_tokens_to=8, max_blocks=4)
    a, b = manager.block_table("a"), manager.block_table("b")
    assert batch.block_tables.dtype == torch.int32
    assert batch.block_tables.tolist() == [b + [PAD_BLOCK] * 3, [*a, PAD_BLOCK]]
    assert batch.seq_lens.tolist() == [2, 9] and batch.seq_lens.dtype == torch.int32
    assert batch.query_start_loc.tolist() == [0, 2, 5]
    assert batch.query_start_loc.dtype == torch.int32
    assert batch.slot_mapping.dtype == torch.int64
    want = [b[0] * 4, b[0] * 4 + 1, a[1] * 4 + 2, a[1] * 4 + 3, a[2] * 4, -1, -1, -1]
    assert batch.slot_mapping.tolist() == want
    assert (batch.max_seq_len, batch.max_query_len) == (9, 3)
    decode = manager.build_batch(["a", "b"])
    assert decode.slot_mapping.tolist() == [a[2] * 4, b[0] * 4 + 1]
    assert decode.block_tables.shape == (2, 3)
    empty = manager.build_batch([])
    assert empty.block_tables.shape == (0, 0) and empty.query_start_loc.tolist() == [0]


@given(lens=st.lists(st.integers(1, 40), min_size=1, max_size=6), data=st.data())
@settings(max_examples=50, deadline=None)
def test_batch_tensors_match_a_naive_computation(lens, data):
    manager = BlockManager(num_blocks=128, block_size=4)
    for seq_id, length in enumerate(lens):  # shared prefixes: tables share their first blocks
        manager.add_sequence(seq_id, list(range(length)))
        manager.add_sequence(("gap", seq_id), [99])  # interleave blocks of other sequences
    order = data.draw(st.permutations(range(len(lens))))
    query = [data.draw(st.integers(1, lens[i])) for i in order]
    pad = data.draw(st.integers(0, 3))
    batch = manager.build_batch(order, query, pad_tokens_to=sum(query) + pad)
    width = batch.block_tables.shape[1]
    assert width == max(-(-n // 4) for n in lens)
    slots, starts = [], [0]
    for i, q in zip(order, query, strict=True):
        table = manager.block_table(i)
        assert batch.block_tables[len(starts) - 1].tolist() == table + [0] * (width - len(table))
        slots += [table[pos // 4] * 4 + pos % 4 for pos in range(lens[i] - q, lens[i])]
        starts.append(starts[-1] + q)
    assert batch.slot_mapping.tolist() == slots + [-1] * pad
    assert batch.query_start_loc.tolist() == starts
    assert batch.seq_lens.tolist() == [lens[i] for i in order]
    assert (batch.max_seq_len, batch.max_query_len) == (max(lens), max(query))


@pytest.mark.parametrize("kwargs", [dict(num_query_tokens=3), dict(num_query_tokens=0),
                                    dict(max_blocks=1), dict(pad_tokens_to=0)])
def test_batch_argument_errors(kwargs):
    rig = make()
    add(rig, "a", list(range(6)))
    add(rig, "b", [1, 2])
    with pytest.raises(ValueError):
        rig.manager.build_batch(["a", "b"], **kwargs)


def test_many_sequences_grow_the_table_storage():
    manager = BlockManager(num_blocks=4096, block_size=4)
    for i in range(100):
        manager.add_sequence(i, list(range(i * 4)))
    batch = manager.build_batch(list(range(1, 100)))
    assert batch.block_tables.shape == (99, 99)
    assert batch.block_tables[98].tolist() == manager.block_table(99)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_debug_nan_fills_fresh_and_freed_blocks(cache_dtype):
    spec = KVCacheSpec(2, 2, 8, 4, torch.float32, cache_dtype)
    rig = make(spec=spec, num_cpu_blocks=0, debug_nan=True)
    manager, cache = rig.manager, rig.cache
    key_cache = cache.key_caches[1]

    def nan(block: int) -> torch.Tensor:
        return key_cache[block].float().isnan()

    assert manager.plan().poison == (PAD_BLOCK,)
    assert not nan(PAD_BLOCK).any()  # the manager only plans; the executor fills
    assert rig.run().poison == (PAD_BLOCK,)
    assert nan(PAD_BLOCK).all() and not manager.plan()
    manager.add_sequence("a", list(range(6)))
    assert set(manager.plan().poison) == set(manager.block_table("a"))
    batch = manager.build_batch(["a"], 6)
    rig.run()
    assert all(nan(b).all() for b in manager.block_table("a"))
    ones = torch.ones(6, 2, 8)
    scales = cache.k_scales or [None, None]
    for layer in range(2):
        reference.reshape_and_cache(ones, ones, *cache.layer(layer), batch.slot_mapping,
                                    scales[layer], scales[layer])
    full, partial = manager.block_table("a")
    assert not nan(full).any() and nan(partial)[:, 2:].all()
    manager.free("a")
    assert manager.plan().poison == (partial,)  # cached: kept for prefix hits
    rig.run()
    assert not nan(full).any()
    assert nan(partial).all()
    assert manager.evict_cached() == [full]
    assert manager.plan().poison == (full,)
    rig.run()
    assert nan(full).all()
