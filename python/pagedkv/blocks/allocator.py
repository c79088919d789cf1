"""BlockAllocator: O(1) allocate and free of block ids with reference counts.

Every usable block is in exactly one of three places:

- free: reference count 0, no content worth keeping (a stack, so recently freed blocks are reused
  first);
- evictable: reference count 0 but holding cached content (prefix caching), in least recently
  freed first order (an OrderedDict); an allocation evicts from here only when the free stack is
  empty;
- used: reference count > 0.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator

from pagedkv import checks
from pagedkv.errors import DoubleFreeError, InvalidBlockError, OutOfBlocksError

__all__ = ["NULL_BLOCK", "BlockAllocator"]

NULL_BLOCK = 0
"""The block id reserved as the null block when ``reserve_null_block`` is set."""


class BlockAllocator:
    """Reference-counted block ids ``0 .. num_blocks - 1``.

    Args:
        num_blocks: size of the pool.
        reserve_null_block: keep block 0 out of circulation (a safe padding target for block
            tables); it is never allocated, freed or counted.
        name: the pool's name in error messages (``"device"``, ``"cpu"``).

    ``ref_counts[b]`` is block b's reference count (read it; change it through the methods).
    ``on_evict(block_id)`` is called when an evictable block is reclaimed (the prefix cache uses it
    to forget the block's hash).

    Every method checks its arguments and either does all of its work or raises (an
    InvalidArgumentError, InvalidBlockError, DoubleFreeError or OutOfBlocksError) with the pool
    exactly as it was. Not thread-safe: one owner calls it (see BlockManager).
    """

    def __init__(self, num_blocks: int, reserve_null_block: bool = False, name: str = "device"):
        num_blocks = checks.count(num_blocks, "num_blocks", checks.INT32_MAX)
        first = 1 if reserve_null_block else 0
        if num_blocks <= first:
            raise ValueError(f"BlockAllocator needs more than {first} blocks, got {num_blocks}")
        self.num_blocks, self.name = num_blocks, name
        self.null_block: int | None = NULL_BLOCK if reserve_null_block else None
        self.ref_counts = [0] * num_blocks
        self._free = list(range(num_blocks - 1, first - 1, -1))  # pop() hands out low ids first
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._cached = [False] * num_blocks
        self._num_used = 0
        self.num_evictions = 0
        self.on_evict: Callable[[int], None] | None = None

    @property
    def num_usable_blocks(self) -> int:
        """Blocks that can ever be handed out (all but the null block)."""
        return self.num_blocks - (self.null_block is not None)

    @property
    def num_free_blocks(self) -> int:
        """Blocks with no reference and no cached content."""
        return len(self._free)

    @property
    def num_evictable_blocks(self) -> int:
        """Blocks with no reference that still hold cached content."""
        return len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        """Blocks with a reference count above 0."""
        return self._num_used

    @property
    def num_available_blocks(self) -> int:
        """Blocks an allocation can take: free plus evictable."""
        return len(self._free) + len(self._evictable)

    def can_allocate(self, num_blocks: int) -> bool:
        """Whether ``allocate(num_blocks)`` would succeed."""
        return num_blocks <= len(self._free) + len(self._evictable)

    def reserve(self, num_blocks: int) -> None:
        """Raise OutOfBlocksError unless ``allocate(num_blocks)`` would succeed."""
        if not self.can_allocate(num_blocks):
            raise OutOfBlocksError(num_blocks, self.num_available_blocks, self.name)

    def allocate(self, num_blocks: int = 1) -> list[int]:
        """Take ``num_blocks`` blocks (reference count 1 each), all or nothing.

        Free blocks go first, then evictable ones, least recently freed first.
        Raises OutOfBlocksError, changing nothing, when fewer are available.
        """
        if type(num_blocks) is not int or num_blocks < 0:
            num_blocks = checks.count(num_blocks, "num_blocks")
        if num_blocks > len(self._free) + len(self._evictable):
            checks.count(num_blocks, "num_blocks", checks.INT32_MAX)  # past int32: bad, not short
            raise OutOfBlocksError(num_blocks, self.num_available_blocks, self.name)
        free = self._free
        if num_blocks <= len(free):  # the common case: no eviction
            blocks = free[len(free) - num_blocks:]
            del free[len(free) - num_blocks:]
            blocks.reverse()  # the order pop() would give
        else:
            blocks = [self._pop_free() for _ in range(num_blocks)]
        for block in blocks:
            self.ref_counts[block] = 1
        self._num_used += num_blocks
        return blocks

    def _pop_free(self) -> int:
        if self._free:
            return self._free.pop()
        block, _ = self._evictable.popitem(last=False)
        self._uncache(block)
        return block

    def _uncache(self, block: int) -> None:
        self._cached[block] = False
        self.num_evictions += 1
        if self.on_evict is not None:
            self.on_evict(block)

    def incref(self, block: int) -> None:
        """Add a reference to a used block, or revive an evictable one (reference count 0 -> 1)."""
        self._check_id(block)
        count = self.ref_counts[block]
        if count == 0:
            if block not in self._evictable:
                raise InvalidBlockError(f"{self.name} block {block} is free: allocate it instead")
            del self._evictable[block]
            self._num_used += 1
        self.ref_counts[block] = count + 1

    def free(self, blocks: Iterable[int]) -> list[int]:
        """Drop one reference from each block, all or nothing.

        A block reaching 0 goes to the evictable queue (most recent end) when it is cached, else to
        the free stack. Returns the blocks that became free (content no longer needed).
        Raises DoubleFreeError, changing nothing, when a block would go below 0.
        """
        blocks = list(blocks)
        self._check_releasable(blocks)
        released = []
        for block in blocks:
            count = self.ref_counts[block] - 1
            self.ref_counts[block] = count
            if count:
                continue
            self._num_used -= 1
            if self._cached[block]:
                self._evictable[block] = None
            else:
                self._free.append(block)
                released.append(block)
        return released

    def _check_releasable(self, blocks: list[int]) -> None:
        counts, size, null = self.ref_counts, self.num_blocks, self.null_block
        for block in blocks:
            if (type(block) is not int or not 0 <= block < size or block == null
                    or not counts[block]):
                break
        else:
            if len(blocks) < 2 or len(set(blocks)) == len(blocks):
                return
        drops: dict[int, int] = {}
        for block in blocks:
            self._check_id(block)
            drops[block] = drops.get(block, 0) + 1
            if drops[block] > counts[block]:
                raise DoubleFreeError(
                    f"{self.name} block {block} freed {drops[block]} time(s) with reference "
                    f"count {counts[block]}"
                )

    def _check_id(self, block: int) -> None:
        if type(block) is not int:
            raise InvalidBlockError(f"{self.name} block id must be an int, got "
                                    f"{type(block).__name__} {block!r}")
        if not 0 <= block < self.num_blocks or block == self.null_block:
            raise InvalidBlockError(
                f"{self.name} block id {block} is not usable (pool of {self.num_blocks}, "
                f"null block {self.null_block})"
            )

    def mark_cached(self, block: int) -> None:
        """Keep a used block's content when its references drop to 0 (evictable, not free)."""
        self._check_id(block)
        if self.ref_counts[block] == 0:
            raise InvalidBlockError(f"only a used block can be marked cached; {block} is not")
        self._cached[block] = True

    def is_cached(self, block: int) -> bool:
        """Whether the block holds cached content (used or evictable)."""
        self._check_id(block)
        return self._cached[block]

    def evict(self, num_blocks: int | None = None) -> list[int]:
        """Move up to ``num_blocks`` (default all) evictable blocks to the free stack, LRU first."""
        count = len(self._evictable)
        if num_blocks is not None:
            count = min(count, checks.count(num_blocks, "num_blocks", checks.INT32_MAX))
        evicted = [self._evictable.popitem(last=False)[0] for _ in range(count)]
        for block in evicted:
            self._uncache(block)
            self._free.append(block)
        return evicted

    def free_blocks(self) -> Iterator[int]:
        """The free blocks (no order promised)."""
        return iter(self._free)

    def evictable_blocks(self) -> Iterator[int]:
        """The evictable blocks, least recently freed first."""
        return iter(self._evictable)
