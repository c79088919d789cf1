"""KV cache groups of the hybrid manager: what a sequence keeps per group, and the window rule.

A group is one attention kind over some layers: full attention (``None``) or a sliding window of
``W`` tokens. Every group has its own block table per sequence over the one block pool. A query
at position ``p`` of a window group attends the keys at positions ``p - W + 1 .. p``, so once
every query from position ``c`` on is the only kind still to come, the blocks whose tokens all
lie before ``c - W + 1`` are unreachable: ``first_live(W, c, block_size)`` is the first block
still needed. Those before it are released and their table entries hold ``PAD_WINDOW`` (-1).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pagedkv import checks
from pagedkv.blocks.batch import PAD_WINDOW
from pagedkv.blocks.prefix import BlockKey
from pagedkv.cache.spec import check_window
from pagedkv.errors import InvalidArgumentError

__all__ = ["GroupTables", "check_group", "check_groups", "first_live", "live_blocks"]


def check_groups(groups: object) -> tuple[int | None, ...]:
    """The groups argument of a BlockManager: a non-empty sequence of windows (None: full
    attention, else a positive int of tokens), one per group."""
    if isinstance(groups, (str, bytes)) or not isinstance(groups, Sequence) or not groups:
        raise InvalidArgumentError(
            "groups must be a non-empty sequence of windows (None for full attention, else a "
            f"positive number of tokens), got {groups!r}")
    return tuple(check_window(window, f"groups[{i}]") for i, window in enumerate(groups))


def check_group(group: object, num_groups: int) -> int:
    """A group index in [0, num_groups)."""
    index = checks.count(group, "group")
    if index >= num_groups:
        raise InvalidArgumentError(f"group must be in [0, {num_groups}), got {index}")
    return index


def first_live(window: int | None, num_computed: int, block_size: int) -> int:
    """The first block that queries from position ``num_computed`` on may read."""
    if window is None:
        return 0
    return max(0, num_computed - window + 1) // block_size


def live_blocks(table: list[int]) -> list[int]:
    """The blocks a table holds (its entries but the freed ones)."""
    return [block for block in table if block != PAD_WINDOW]


@dataclass(slots=True)
class GroupTables:
    """A sequence's state in every group.

    ``tables[g]``: group g's block table (device blocks, or CPU blocks while swapped), with
    ``PAD_WINDOW`` exactly in its first ``starts[g]`` entries; ``keys[g]``: the prefix keys of
    a full-attention group's full blocks (``PrefixCache.register_blocks``), empty for a window
    group; ``hashes``: the chained hash of every full block (window groups cache and find their
    blocks by it; empty without prefix caching); ``num_computed``: tokens whose queries have run
    (a lower bound): every later query is at that position or after.
    """

    tables: list[list[int]]
    keys: list[list[BlockKey]]
    hashes: list[bytes]
    num_computed: int
    starts: list[int]

    def copy(self) -> GroupTables:
        """A copy sharing nothing mutable (``fork``)."""
        return GroupTables([list(t) for t in self.tables], [list(k) for k in self.keys],
                           list(self.hashes), self.num_computed, list(self.starts))
