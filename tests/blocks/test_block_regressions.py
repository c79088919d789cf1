"""One regression test per failure of the block layer found under adversarial use.

Cases 4 (a bad request stops the engine) and 5 (generate queues part of a bad batch) are engine
tests: test_engine.py::test_add_request_refuses_a_bad_prompt_and_the_others_finish and
::test_generate_checks_the_whole_batch_before_queueing; a failing swap or model mid-run is
::test_a_failing_step_is_retried_and_loses_nothing. Case 8's overlapping views of one storage are
test_swap_blocks.py::test_rejects_overlapping_views.
"""

import hashlib

import numpy as np
import pytest
import torch

from pagedkv.blocks.allocator import BlockAllocator
from pagedkv.blocks.manager import BlockManager
from pagedkv.blocks.plan import PlanExecutor, cpu_cache_for
from pagedkv.blocks.prefix import PrefixCache, hash_block
from pagedkv.cache.paged_cache import PagedKVCache
from pagedkv.cache.spec import KVCacheSpec
from pagedkv.errors import InvalidArgumentError, PagedKVError
from pagedkv.ops import reference

SPEC = KVCacheSpec(num_layers=2, num_kv_heads=2, head_size=8, block_size=4, dtype=torch.float32)


class Model:
    """A manager, its cache and executor, and a 'model' whose K/V at a position is a function of
    the sequence's whole prefix (so a block reused under another prefix reads back wrong)."""

    def __init__(self, num_blocks=16, num_cpu_blocks=8, **kwargs) -> None:
        self.cache = PagedKVCache(SPEC, num_blocks)
        self.cpu_cache = cpu_cache_for(self.cache, num_cpu_blocks)
        self.manager = BlockManager(num_blocks, SPEC.block_size, num_cpu_blocks=num_cpu_blocks,
                                    **kwargs)
        self.executor = PlanExecutor(self.cache, self.cpu_cache)
        self.tokens: dict[str, list[int]] = {}

    @staticmethod
    def kv(tokens: list[int], layer: int) -> torch.Tensor:
        code, codes = 7, []
        for token in tokens:
            code = (code * 31 + token + 1) % 65521
            codes.append(code)
        lanes = torch.arange(SPEC.num_kv_heads * SPEC.head_size).view(1, SPEC.num_kv_heads, -1)
        return (torch.tensor(codes)[:, None, None] * 64 + layer * 16 + lanes).float()

    def add(self, seq_id, tokens) -> int:
        self.tokens[seq_id] = list(tokens)
        return self.manager.add_sequence(seq_id, tokens)

    def fork(self, parent, child) -> None:
        self.manager.fork(parent, child)
        self.tokens[child] = list(self.tokens[parent])

    def append(self, seq_id, tokens) -> None:
        self.manager.append_tokens(seq_id, tokens)
        self.tokens[seq_id] += tokens

    def step(self, todo: dict[str, int]) -> None:
        """Build the batch, run the plan, write ``todo[seq]`` new tokens of each sequence."""
        batch = self.manager.build_batch(list(todo), list(todo.values()))
        self.executor.run(self.manager)
        assert not self.manager.plan()
        for layer in range(SPEC.num_layers):
            key = torch.cat([self.kv(self.tokens[s], layer)[-n:] for s, n in todo.items()])
            reference.reshape_and_cache(key, -key, *self.cache.layer(layer), batch.slot_mapping)

    def assert_reads_back(self, seq_id) -> None:
        tokens = self.tokens[seq_id]
        table = torch.tensor(self.manager.block_table(seq_id), dtype=torch.int32)
        for layer in range(SPEC.num_layers):
            key, value = reference.gather_kv(*self.cache.layer(layer), table, len(tokens))
            want = self.kv(tokens, layer)
            assert torch.equal(key, want) and torch.equal(value, -want), seq_id


def manager_state(manager: BlockManager):
    pools = [manager.allocator] + ([manager.cpu_allocator] if manager.cpu_allocator else [])
    return ([(list(p.ref_counts), sorted(p.free_blocks()), list(p.evictable_blocks()))
             for p in pools],
            {s: (manager.block_table(s), manager.num_tokens(s)) for s in manager.seq_ids},
            len(manager.prefix_cache or ()), manager.plan())


# -- 1. copy-on-write chains ------------------------------------------------------------------

def test_1_a_fork_of_a_fork_with_pending_copies_reads_back():
    """fork(A, B); append(A); fork(A, C); append(C): C's copy must read A's original last block
    (the pending copy's source), not A's new block, which is itself waiting for its copy."""
    model = Model()
    model.add("A", [1, 2, 3, 4, 5])
    model.step({"A": 5})
    model.fork("A", "B")
    model.append("A", [6])  # A copies its shared last block: pending
    model.fork("A", "C")
    model.append("C", [7])  # C copies A's new (pending) block: from A's source instead
    plan = model.manager.plan()
    assert {src for src, _ in plan.copies}.isdisjoint(dst for _, dst in plan.copies)
    model.step({"A": 1, "C": 2})  # C's table names a block it must write token 6 into too
    for seq_id in "ABC":
        model.assert_reads_back(seq_id)


def test_1_beam_search_forks_every_branch_and_frees_in_any_order():
    model = Model(num_blocks=32)
    model.add("root", [9, 8, 7, 6, 5, 4])
    model.step({"root": 6})
    beams = ["root"]
    for depth in range(3):
        new = []
        for beam in beams:
            for k in range(2):
                child = f"{beam}.{k}"
                model.fork(beam, child)
                model.append(child, [depth * 10 + k])
                new.append(child)
        for beam in beams:  # the parents are pruned before the step's plan runs
            model.manager.free(beam)
            del model.tokens[beam]
        model.step({beam: 1 for beam in new})
        beams = new
        for beam in beams:
            model.assert_reads_back(beam)
    for beam in reversed(beams):
        model.manager.free(beam)
    model.executor.run(model.manager)
    assert model.manager.allocator.num_used_blocks == 0


# -- 2. a failed plan run keeps its work ---------------------------------------------------------

@pytest.mark.parametrize("failing", ["copy_blocks", "fill_blocks"])
def test_2_a_failed_copy_leaves_the_work_pending_and_the_retry_does_it(failing):
    model = Model(debug_nan=True)
    model.add("A", [1, 2, 3, 4, 5, 6])
    model.step({"A": 6})
    model.fork("A", "B")
    model.append("B", [7, 8, 9])  # a copy of the shared block, and a fresh block to poison
    model.manager.build_batch(["B"], 3)  # builds tensors only: the copy is still pending
    pending = model.manager.plan()
    assert pending.copies and pending.poison

    def broken(*args):
        raise RuntimeError("injected")

    setattr(model.cache, failing, broken)
    with pytest.raises(RuntimeError, match="injected"):
        model.executor.run(model.manager)
    after = model.manager.plan()
    if failing == "copy_blocks":
        assert after.copies == pending.copies and after.poison == pending.poison
    else:
        assert not after.copies and set(pending.poison) <= set(after.poison)
    del model.cache.__dict__[failing]  # the kernel works again
    model.step({"B": 3})
    model.assert_reads_back("A")
    model.assert_reads_back("B")


def test_2_a_stale_plan_cannot_be_completed():
    model = Model()
    model.add("A", [1, 2, 3, 4, 5])
    model.step({"A": 5})
    model.fork("A", "B")
    model.append("B", [6])
    stale = model.manager.plan()
    model.fork("A", "C")
    model.append("C", [7])  # the plan changed since: a second copy
    before = manager_state(model.manager)
    with pytest.raises(InvalidArgumentError, match="not the pending plan"):
        model.manager.complete(stale, "copies")
    with pytest.raises(InvalidArgumentError, match="phase"):
        model.manager.complete(model.manager.plan(), "everything")
    assert manager_state(model.manager) == before


def test_2_an_executor_without_a_cpu_cache_refuses_a_swapping_plan():
    model = Model()
    model.add("A", [1, 2, 3])
    model.step({"A": 3})
    model.manager.swap_out("A")
    before = manager_state(model.manager)
    with pytest.raises(ValueError, match="cpu_cache"):
        PlanExecutor(model.cache).run(model.manager)
    assert manager_state(model.manager) == before


# -- 3. token ids are validated before anything changes ------------------------------------------

BAD_TOKENS = {
    "floats": [1.5, 2.5, 3.5, 4.5], "short floats": [1.5], "None": [None], "str": "abc",
    "negative": [1, -2], "too large": [2**63], "nested": [[1, 2]], "bools": [True, False],
    "float tensor": torch.tensor([1.0, 2.0]), "2-D array": np.ones((2, 2), dtype=np.int64),
    "float array": np.array([1.0]),
}


@pytest.mark.parametrize("case", list(BAD_TOKENS))
def test_3_bad_token_ids_raise_and_change_nothing(case):
    model = Model(num_blocks=8)
    model.add("a", [1, 2, 3, 4, 5])
    model.step({"a": 5})
    manager, bad = model.manager, BAD_TOKENS[case]
    before = manager_state(manager)
    for call in (lambda: manager.add_sequence("x", bad), lambda: manager.append_tokens("a", bad),
                 lambda: manager.can_allocate(bad)):
        with pytest.raises(InvalidArgumentError, match="token_ids"):
            call()
        assert manager_state(manager) == before and "x" not in manager
    with pytest.raises(InvalidArgumentError, match="token_ids"):
        manager.prefix_cache.match(bad)


# -- 6. every argument is checked ----------------------------------------------------------------

@pytest.mark.parametrize("kwargs, name", [
    (dict(num_blocks=8, block_size=0), "block_size"), (dict(num_blocks=8, block_size=-4),
                                                       "block_size"),
    (dict(num_blocks=8, block_size=2.5), "block_size"), (dict(num_blocks=0, block_size=4),
                                                         "num_blocks"),
    (dict(num_blocks=8, block_size=4, num_cpu_blocks=-1), "num_cpu_blocks"),
])
def test_6_bad_manager_sizes_raise_at_construction(kwargs, name):
    with pytest.raises(InvalidArgumentError, match=name):
        BlockManager(**kwargs)


def test_6_bad_counts_and_ids_raise_and_change_nothing():
    model = Model(num_blocks=8)
    model.add("a", [1, 2, 3, 4, 5])
    model.step({"a": 5})
    manager = model.manager
    before = manager_state(manager)
    calls = [
        (lambda: manager.can_append("a", -1), "num_tokens"),
        (lambda: manager.can_append("a", 1.5), "num_tokens"),
        (lambda: manager.evict_cached(-1), "num_blocks"),
        (lambda: manager.build_batch(["a"], 1.5), "num_query_tokens"),
        (lambda: manager.build_batch(["a"], [0]), "num_query_tokens"),
        (lambda: manager.build_batch(["a", "a"]), "more than once"),
        (lambda: manager.build_batch("a"), "seq_ids"),
        (lambda: manager.build_batch(["a"], max_blocks=-1), "max_blocks"),
        (lambda: manager.add_sequence(["unhashable"], [1]), "seq_id"),
        (lambda: manager.fork("a", {}), "child_id"),
        (lambda: manager.add_sequence("y", [1], extra_key=[1]), "extra_key"),
    ]
    for call, name in calls:
        with pytest.raises((InvalidArgumentError, PagedKVError), match=name):
            call()
        assert manager_state(manager) == before, name
    with pytest.raises(InvalidArgumentError, match="block_size"):
        PrefixCache(BlockAllocator(4), 0)


@pytest.mark.parametrize("block", [-1, 99, 1.0, True])
def test_6_allocator_ids_are_checked(block):
    allocator = BlockAllocator(8)
    with pytest.raises(ValueError, match="block id"):
        allocator.is_cached(block)
    with pytest.raises(ValueError, match="block id"):
        allocator.incref(block)
    with pytest.raises(ValueError, match="block id"):
        allocator.free([block])
    assert allocator.num_free_blocks == 8


# -- 7. a prefix hit is verified through its parent ----------------------------------------------

def test_7_a_parent_only_hash_collision_hands_out_no_foreign_kv(monkeypatch):
    """With a hash that depends on the parent hash alone (a worst-case collision), prompt Y =
    [10..13 | 30..33] must not reuse Z = [20..23 | 30..33]'s second block."""
    real = hashlib.sha256
    monkeypatch.setattr("pagedkv.blocks.prefix._digest",
                        lambda payload: real(payload[:32]).digest())
    model = Model()
    z, y = [20, 21, 22, 23, 30, 31, 32, 33], [10, 11, 12, 13, 30, 31, 32, 33]
    assert model.add("Z", [*z, 1]) == 0
    model.step({"Z": 9})
    cached = model.add("Y", [*y, 1])
    assert cached == 0, "Y reused a block computed after another first block"
    model.step({"Y": 9})
    model.assert_reads_back("Y")
    model.assert_reads_back("Z")
    assert model.add("Z2", [*z, 2]) == 8  # the real prefix still hits
    model.step({"Z2": 1})
    model.assert_reads_back("Z2")


# -- 8. extra keys compare by value, not by how they print ---------------------------------------

@pytest.mark.parametrize("a, b", [("1", 1), (b"x", "x"), ((1, 2), "(1, 2)"), (None, "None")])
def test_8_extra_keys_that_print_alike_do_not_share_blocks(a, b):
    manager = BlockManager(16, 4)
    tokens = list(range(9))
    manager.add_sequence("a", tokens, extra_key=a)
    assert manager.add_sequence("b", tokens, extra_key=b) == 0
    assert manager.add_sequence("a2", tokens, extra_key=a) == 8
    assert hash_block(None, tokens[:4], a) != hash_block(None, tokens[:4], b)
