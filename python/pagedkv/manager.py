"""BlockManager: sequences -> block tables over a paged KV cache, and the batch tensors."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .allocator import NULL_BLOCK, BlockAllocator
from .batch import BatchTensors, BlockTableRows
from .cache import PagedKVCache
from .errors import (
    DoubleFreeError,
    DuplicateSequenceError,
    FreedSequenceError,
    OutOfBlocksError,
    SequenceStateError,
    UnknownSequenceError,
)
from .prefix import PrefixCache

__all__ = ["BlockManager"]

_FREED_IDS_REMEMBERED = 4096


def _token_list(token_ids: int | Sequence[int]) -> list[int]:
    """Token ids as a list of Python ints (from an int, a sequence, an array or a tensor)."""
    if isinstance(token_ids, int):
        return [token_ids]
    if hasattr(token_ids, "tolist"):  # numpy arrays and scalars, torch tensors
        token_ids = token_ids.tolist()
        return [token_ids] if isinstance(token_ids, int) else token_ids
    return list(token_ids)


@dataclass(slots=True)
class _Seq:
    token_ids: list[int]
    block_table: list[int]  # device blocks, or CPU blocks while swapped
    block_hashes: list[bytes]  # chained hash of each full block (prefix caching only)
    extra_key: Hashable
    row: int = -1  # row in BlockManager.tables while resident
    swapped: bool = False


class BlockManager:
    """Block tables of sequences over a device block pool, with an optional CPU pool for swaps.

    Args:
        cache: the device PagedKVCache; copy-on-write and swaps move its data. Without a cache the
            manager only does the bookkeeping (give ``num_blocks`` and ``block_size``).
        num_blocks, block_size: the pool when there is no cache.
        num_cpu_blocks: size of the CPU pool for ``swap_out`` (0: no swapping).
        enable_prefix_caching: reuse cached full blocks of identical prefixes.
        reserve_null_block: keep block 0 out of circulation so that block-table padding (0) never
            names a live block.
        debug_nan: fill freshly allocated and freed blocks (and the null block) with NaN, so a read
            of stale or padding data shows up; fp8 caches use the NaN bit pattern 0x7F.

    Block registration: a block is hashed into the prefix cache when it becomes full, so the
    caller must write its K/V (``reshape_and_cache`` with this manager's ``slot_mapping``) before
    another sequence reads it. Copy-on-write pairs are queued and applied with one ``copy_blocks``
    by ``flush_copies()``, which ``build_batch``, ``free`` and ``swap_out`` call first: build the
    batch before writing the step's K/V.

    Example (one request; the model writes K/V with ``batch.slot_mapping``)::

        manager = BlockManager(PagedKVCache(spec, num_blocks=4096), num_cpu_blocks=1024)
        cached = manager.add_sequence("req-0", prompt)  # tokens whose K/V are already cached
        batch = manager.build_batch(["req-0"], len(prompt) - cached)  # prefill the rest
        manager.append_tokens("req-0", next_token)
        batch = manager.build_batch(["req-0"])  # decode: one query token per sequence
        manager.free("req-0")
    """

    def __init__(
        self,
        cache: PagedKVCache | None = None,
        *,
        num_blocks: int | None = None,
        block_size: int | None = None,
        num_cpu_blocks: int = 0,
        enable_prefix_caching: bool = True,
        reserve_null_block: bool = True,
        debug_nan: bool = False,
    ) -> None:
        if cache is not None:
            num_blocks, block_size = cache.num_blocks, cache.spec.block_size
        if num_blocks is None or block_size is None:
            raise ValueError("BlockManager needs a cache or both num_blocks and block_size")
        self.cache, self.block_size = cache, block_size
        self.debug_nan = debug_nan and cache is not None
        self.allocator = BlockAllocator(num_blocks, reserve_null_block, "device")
        self._ref_counts = self.allocator.ref_counts  # the allocator updates this list in place
        self.prefix_cache = (PrefixCache(self.allocator, block_size)
                             if enable_prefix_caching else None)
        self.cpu_allocator = BlockAllocator(num_cpu_blocks, name="cpu") if num_cpu_blocks else None
        self.cpu_cache = None
        if cache is not None and num_cpu_blocks:
            pin = cache.device.type == "cuda"
            self.cpu_cache = PagedKVCache(cache.spec, num_cpu_blocks, "cpu", pin_memory=pin)
        self._seqs: dict[Hashable, _Seq] = {}
        self._freed: OrderedDict[Hashable, None] = OrderedDict()
        self._pending_copies: list[tuple[int, int]] = []
        self.tables = BlockTableRows(block_size)
        if self.debug_nan and reserve_null_block:
            cache.fill_blocks([NULL_BLOCK])

    def __len__(self) -> int:
        return len(self._seqs)

    def __contains__(self, seq_id: Hashable) -> bool:
        return seq_id in self._seqs

    @property
    def seq_ids(self) -> list[Hashable]:
        """Ids of the managed sequences (resident and swapped), in insertion order."""
        return list(self._seqs)

    def num_tokens(self, seq_id: Hashable) -> int:
        """Tokens of the sequence."""
        return len(self._get(seq_id).token_ids)

    def block_table(self, seq_id: Hashable) -> list[int]:
        """A copy of the sequence's block table (CPU pool block ids while swapped out)."""
        return list(self._get(seq_id).block_table)

    def is_swapped(self, seq_id: Hashable) -> bool:
        """Whether the sequence lives in the CPU pool."""
        return self._get(seq_id).swapped

    def usage(self) -> dict[str, float]:
        """Counts for logs and dashboards: sequences, device blocks used / evictable (cached) /
        free, CPU blocks used, and the prefix-cache hit rate in tokens."""
        device, cpu, prefix = self.allocator, self.cpu_allocator, self.prefix_cache
        return {"sequences": len(self._seqs),
                "swapped": sum(seq.swapped for seq in self._seqs.values()),
                "used_blocks": device.num_used_blocks,
                "cached_blocks": device.num_evictable_blocks,
                "free_blocks": device.num_free_blocks,
                "cpu_used_blocks": cpu.num_used_blocks if cpu else 0,
                "prefix_hit_rate": prefix.stats.hit_rate if prefix else 0.0}

    def _get(self, seq_id: Hashable) -> _Seq:
        seq = self._seqs.get(seq_id)
        if seq is not None:
            return seq
        if seq_id in self._freed:
            raise FreedSequenceError(f"sequence {seq_id!r} was freed")
        raise UnknownSequenceError(f"unknown sequence {seq_id!r} ({len(self._seqs)} managed)")

    def _resident(self, seq_id: Hashable) -> _Seq:
        seq = self._get(seq_id)
        if seq.swapped:
            raise SequenceStateError(f"sequence {seq_id!r} is swapped out; swap_in first")
        return seq

    def _check_new_id(self, seq_id: Hashable) -> None:
        if seq_id in self._seqs:
            raise DuplicateSequenceError(f"sequence {seq_id!r} already exists")

    def _prompt_hits(
        self, token_ids: list[int], extra_key: Hashable
    ) -> tuple[list[int], list[bytes]]:
        """Cached blocks to reuse and their hashes, looked up within ``token_ids[:-1]`` so that at
        least one token is left to compute."""
        if self.prefix_cache is None or not token_ids:
            return [], []
        max_blocks = (len(token_ids) - 1) // self.block_size
        return self.prefix_cache.match(token_ids, extra_key, max_blocks)

    def _num_needed(self, hits: list[int], num_blocks: int) -> int:
        """Blocks the pool gives up for a table of ``num_blocks`` that starts with ``hits``."""
        return num_blocks - len(hits) + sum(1 for block in hits if self._ref_counts[block] == 0)

    def _take(self, hits: list[int], num_blocks: int) -> list[int]:
        """Reference ``hits`` and allocate the rest of a ``num_blocks`` table, all or nothing."""
        needed = self._num_needed(hits, num_blocks)
        if not self.allocator.can_allocate(needed):
            raise OutOfBlocksError(needed, self.allocator.num_available_blocks)
        for block in hits:
            self.allocator.incref(block)
        return hits + self._allocate(num_blocks - len(hits))

    def can_allocate(self, token_ids: Sequence[int], extra_key: Hashable = None) -> bool:
        """Whether ``add_sequence(.., token_ids, extra_key)`` would find enough blocks."""
        token_ids = _token_list(token_ids)
        hits, _ = self._prompt_hits(token_ids, extra_key)
        return self.allocator.can_allocate(self._num_needed(hits, self._blocks_for(len(token_ids))))

    def add_sequence(
        self, seq_id: Hashable, token_ids: Sequence[int], extra_key: Hashable = None
    ) -> int:
        """Add a sequence, reusing the longest run of cached prefix blocks.

        ``extra_key`` (adapter id, cache salt) keeps prompts under different keys apart.
        Returns the number of cached tokens (a multiple of block_size, less than len(token_ids)):
        their K/V are already in the cache; the caller computes and writes the rest.
        """
        self._check_new_id(seq_id)
        token_ids = _token_list(token_ids)
        hits, hashes = self._prompt_hits(token_ids, extra_key)
        table = self._take(hits, self._blocks_for(len(token_ids)))
        seq = _Seq(token_ids, table, hashes, extra_key)
        self._register_full_blocks(seq)
        self._admit(seq_id, seq)
        num_cached = len(hits) * self.block_size
        if self.prefix_cache is not None:
            self.prefix_cache.record_query(len(token_ids), num_cached)
        return num_cached

    def can_append(self, seq_id: Hashable, num_tokens: int = 1) -> bool:
        """Whether ``append_tokens`` of ``num_tokens`` tokens would find enough blocks."""
        needed = self._blocks_to_append(self._resident(seq_id), num_tokens)
        return self.allocator.can_allocate(needed)

    def _blocks_to_append(self, seq: _Seq, num_tokens: int) -> int:
        num_old = len(seq.token_ids)
        new = self._blocks_for(num_old + num_tokens) - len(seq.block_table)
        cow = num_tokens > 0 and num_old % self.block_size != 0 and self._last_block_shared(seq)
        return new + cow

    def _last_block_shared(self, seq: _Seq) -> bool:
        return self._ref_counts[seq.block_table[-1]] > 1

    def append_tokens(
        self, seq_id: Hashable, token_ids: int | Sequence[int]
    ) -> list[tuple[int, int]]:
        """Append tokens, taking a new block whenever the last is full.

        When the last block is partly filled and shared (after ``fork``), the sequence first gets
        its own copy of it. Returns the (src, dst) copy-on-write pairs this call queued.
        """
        seq = self._seqs.get(seq_id)
        if seq is None or seq.swapped:
            seq = self._resident(seq_id)  # raises
        num_old, size = len(seq.token_ids), self.block_size
        if isinstance(token_ids, int):
            if num_old % size and self._ref_counts[seq.block_table[-1]] == 1:  # decode fast path
                seq.token_ids.append(token_ids)
                if (num_old + 1) % size == 0:
                    self._register_full_blocks(seq)
                return []
            token_ids = [token_ids]
        tokens = _token_list(token_ids)
        num_new = num_old + len(tokens)
        pairs = []
        if num_new > len(seq.block_table) * size or (
                num_old % size and tokens and self._last_block_shared(seq)):
            pairs = self._make_room(seq, len(tokens))
        seq.token_ids += tokens
        if num_new // size != num_old // size:
            self._register_full_blocks(seq)
        return pairs

    def _make_room(self, seq: _Seq, num_tokens: int) -> list[tuple[int, int]]:
        needed = self._blocks_to_append(seq, num_tokens)
        if not self.allocator.can_allocate(needed):
            raise OutOfBlocksError(needed, self.allocator.num_available_blocks)
        pairs = []
        if len(seq.token_ids) % self.block_size and self._last_block_shared(seq):
            pairs.append(self._copy_on_write(seq))
        start = len(seq.block_table)
        seq.block_table += self._allocate(self._blocks_for(len(seq.token_ids) + num_tokens) - start)
        self.tables.write(seq.row, seq.block_table, start)
        return pairs

    def _copy_on_write(self, seq: _Seq) -> tuple[int, int]:
        src = seq.block_table[-1]
        (dst,) = self._allocate(1)
        self.allocator.free([src])
        seq.block_table[-1] = dst
        self.tables.write(seq.row, seq.block_table, len(seq.block_table) - 1)
        self._pending_copies.append((src, dst))
        return src, dst

    def fork(self, parent_id: Hashable, child_id: Hashable) -> None:
        """Make ``child_id`` a copy of ``parent_id`` sharing all its blocks (copy-on-write)."""
        parent = self._resident(parent_id)
        self._check_new_id(child_id)
        for block in parent.block_table:
            self.allocator.incref(block)
        child = _Seq(list(parent.token_ids), list(parent.block_table),
                     list(parent.block_hashes), parent.extra_key)
        self._admit(child_id, child)

    def free(self, seq_id: Hashable) -> None:
        """Release a sequence's blocks (cached full blocks stay cached, evictable)."""
        if seq_id in self._freed and seq_id not in self._seqs:
            raise DoubleFreeError(f"sequence {seq_id!r} was already freed")
        seq = self._get(seq_id)
        self.flush_copies()
        if seq.swapped:
            self.cpu_allocator.free(seq.block_table)
        else:
            self._release(seq)
        del self._seqs[seq_id]
        self._freed[seq_id] = None
        if len(self._freed) > _FREED_IDS_REMEMBERED:
            self._freed.popitem(last=False)

    def swap_out(self, seq_id: Hashable) -> list[tuple[int, int]]:
        """Move a sequence to the CPU pool. Returns the (device block, CPU block) pairs copied."""
        seq = self._resident(seq_id)
        if self.cpu_allocator is None:
            raise OutOfBlocksError(len(seq.block_table), 0, "cpu")
        cpu_blocks = self.cpu_allocator.allocate(len(seq.block_table))
        self.flush_copies()
        pairs = list(zip(seq.block_table, cpu_blocks, strict=True))
        if self.cpu_cache is not None:
            self.cache.swap_to(self.cpu_cache, pairs)
        self._release(seq)
        seq.block_table, seq.swapped = cpu_blocks, True
        return pairs

    def can_swap_in(self, seq_id: Hashable) -> bool:
        """Whether the device pool has room for the swapped-out sequence."""
        seq = self._swapped(seq_id)
        needed = self._num_needed(self._swap_in_hits(seq), len(seq.block_table))
        return self.allocator.can_allocate(needed)

    def _swapped(self, seq_id: Hashable) -> _Seq:
        seq = self._get(seq_id)
        if not seq.swapped:
            raise SequenceStateError(f"sequence {seq_id!r} is not swapped out")
        return seq

    def _swap_in_hits(self, seq: _Seq) -> list[int]:
        if self.prefix_cache is None:
            return []
        return self.prefix_cache.match(seq.token_ids, seq.extra_key)[0]

    def swap_in(self, seq_id: Hashable) -> list[tuple[int, int]]:
        """Bring a swapped-out sequence back to the device. Returns the (CPU, device) pairs copied.

        Blocks of its prefix that are still in the prefix cache are reused, not copied.
        """
        seq = self._swapped(seq_id)
        hits = self._swap_in_hits(seq)
        table = self._take(hits, len(seq.block_table))
        pairs = list(zip(seq.block_table[len(hits):], table[len(hits):], strict=True))
        if self.cpu_cache is not None:
            self.cpu_cache.swap_to(self.cache, pairs)
        self.cpu_allocator.free(seq.block_table)
        seq.block_table, seq.swapped, seq.block_hashes = table, False, []
        self._register_full_blocks(seq)
        seq.row = self.tables.take()
        self.tables.write(seq.row, seq.block_table)
        return pairs

    def flush_copies(self) -> list[tuple[int, int]]:
        """Apply the queued copy-on-write pairs with one ``copy_blocks``; returns them."""
        pairs, self._pending_copies = self._pending_copies, []
        if pairs and self.cache is not None:
            self.cache.copy_blocks(pairs)
        return pairs

    def evict_cached(self, num_blocks: int | None = None) -> list[int]:
        """Drop up to ``num_blocks`` (default all) unreferenced cached blocks, LRU first."""
        evicted = self.allocator.evict(num_blocks)
        if self.debug_nan:
            self.cache.fill_blocks(evicted)
        return evicted

    def _allocate(self, num_blocks: int) -> list[int]:
        blocks = self.allocator.allocate(num_blocks) if num_blocks else []
        if self.debug_nan:
            self.cache.fill_blocks(blocks)
        return blocks

    def _release(self, seq: _Seq) -> None:
        """Drop a resident sequence's references and its block-table row."""
        released = self.allocator.free(reversed(seq.block_table))  # the tail is evicted first
        if self.debug_nan:
            self.cache.fill_blocks(released)
        self.tables.release(seq.row, len(seq.block_table))
        seq.row = -1

    def _register_full_blocks(self, seq: _Seq) -> None:
        if self.prefix_cache is None:
            return
        size, hashes = self.block_size, seq.block_hashes
        for i in range(len(hashes), len(seq.token_ids) // size):
            tokens = seq.token_ids[i * size:(i + 1) * size]
            parent = hashes[-1] if hashes else b""
            hashes.append(self.prefix_cache.register(seq.block_table[i], parent, tokens,
                                                     seq.extra_key))

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _admit(self, seq_id: Hashable, seq: _Seq) -> None:
        seq.row = self.tables.take()
        self.tables.write(seq.row, seq.block_table)
        self._seqs[seq_id] = seq
        self._freed.pop(seq_id, None)

    def build_batch(
        self,
        seq_ids: Sequence[Hashable],
        num_query_tokens: int | Sequence[int] = 1,
        *,
        device: torch.device | str | None = None,
        max_blocks: int | None = None,
        pad_tokens_to: int | None = None,
    ) -> BatchTensors:
        """The batch tensors of resident sequences, after applying queued copy-on-write copies.

        ``num_query_tokens``: this step's tokens per sequence (1 for decode; the last ones of each
        sequence). ``max_blocks`` fixes the block-table width and ``pad_tokens_to`` the
        slot_mapping length (padded with -1), e.g. for CUDA graphs.
        """
        self.flush_copies()
        try:
            seqs = [self._seqs[seq_id] for seq_id in seq_ids]
        except (KeyError, TypeError):
            seqs = [self._get(seq_id) for seq_id in seq_ids]
        rows = np.fromiter([seq.row for seq in seqs], np.intp, len(seqs))
        if len(seqs) and rows.min() < 0:
            seqs = [self._resident(seq_id) for seq_id in seq_ids]  # raises
        seq_lens = np.fromiter([len(seq.token_ids) for seq in seqs], np.int32, len(seqs))
        return self.tables.build(rows, seq_lens, num_query_tokens, device=device,
                                 max_blocks=max_blocks, pad_tokens_to=pad_tokens_to)
