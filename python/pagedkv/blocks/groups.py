"""KV cache groups of the hybrid manager: what a sequence keeps per group, the window rule, and
a prompt's prefix hit over every group.

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
from pagedkv.blocks.prefix import BlockKey, PrefixCache, chain
from pagedkv.cache.spec import check_window
from pagedkv.errors import InvalidArgumentError

__all__ = ["GroupTables", "Hits", "check_computed", "check_group", "check_groups", "first_live",
           "live_blocks", "prompt_hits"]

Hits = tuple[int, list[list[int]], list[list[BlockKey]], list[tuple[bytes, bytes]]]
"""A prompt's prefix hit: (blocks hit, per group the start of its table and its keys, the
chain of the prompt's full blocks)."""


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


def check_computed(value: object, floor: int, num_tokens: int) -> int:
    """The ``num_computed`` of an append: None means ``num_tokens`` (every token before the
    appended ones has had its query run), else an int in [floor, num_tokens]: at least what an
    earlier call said (freed blocks do not come back), at most the sequence's tokens."""
    if value is None:
        return num_tokens
    value = checks.count(value, "num_computed")
    if not floor <= value <= num_tokens:
        raise InvalidArgumentError(
            f"num_computed must be in [{floor}, {num_tokens}] (at least what an earlier call "
            f"said, at most the sequence's tokens), got {value}")
    return value


def first_live(window: int | None, num_computed: int, block_size: int) -> int:
    """The first block that queries from position ``num_computed`` on may read."""
    if window is None:
        return 0
    return max(0, num_computed - window + 1) // block_size


def live_blocks(table: list[int]) -> list[int]:
    """The blocks a table holds (its entries but the freed ones)."""
    return [block for block in table if block != PAD_WINDOW]


def prompt_hits(caches: list[PrefixCache], windows: tuple[int | None, ...],
                token_ids: list[int], extra: bytes, block_size: int) -> Hits:
    """The longest prefix of a prompt (in blocks, one token left to compute) that every group's
    cache can serve: a full-attention group's verified chain from the first block, a window
    group's blocks in the window of the first token to compute (found by chained hash). Per
    group, the table it starts with: the hits, ``PAD_WINDOW`` before a window group's."""
    size = block_size
    links = chain(token_ids, extra, size, 0, len(token_ids) // size)
    limit = (len(token_ids) - 1) // size
    runs = {g: caches[g].lookup(token_ids, extra, limit)
            for g, window in enumerate(windows) if window is None}
    hit = min([limit, *(len(blocks) for blocks, _ in runs.values())])
    found = {g: [caches[g].find(*link) for link in links[:hit]]
             for g, window in enumerate(windows) if window is not None}
    while hit and not all(None not in blocks[first_live(windows[g], hit * size, size):hit]
                          for g, blocks in found.items()):
        hit -= 1
    tables: list[list[int]] = []
    keys: list[list[BlockKey]] = []
    for g, window in enumerate(windows):
        if window is None:
            tables.append(runs[g][0][:hit])
            keys.append(runs[g][1][:hit])
        else:
            start = first_live(window, hit * size, size)
            tables.append([PAD_WINDOW] * start + found[g][start:hit])
            keys.append([])
    return hit, tables, keys, links


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
