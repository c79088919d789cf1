"""Prefix caching: full blocks keyed by a chained hash, reused by sequences that share a prefix.

Block i of a sequence is keyed by ``sha256(parent hash, extra key, its block_size tokens)`` where
the parent hash is block i-1's key. A lookup walks a prompt's full blocks and stops at the first
miss. A hit is checked, not trusted to the hash: the cached block's stored encoding (parent hash,
extra key, tokens) must equal the asked one, and the block must have been registered as the child
of the very entry this lookup matched one step earlier (entries carry ids that are never reused).
So a hit at block i means that every block up to i was computed after exactly the asked tokens:
even a hash collision cannot hand one prompt another prompt's K/V. A block whose parent is not
itself a verified entry (its parent's hash collided, or was registered by another block with other
content) is not registered.

Blocks nobody references stay cached in the allocator's evictable queue and are evicted least
recently freed first.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from pagedkv import checks
from pagedkv.blocks.allocator import BlockAllocator
from pagedkv.errors import InvalidArgumentError

__all__ = ["BlockKey", "PrefixCache", "PrefixCacheStats", "chain", "encode_block", "hash_block"]

_ROOT = bytes(32)
ROOT_ENTRY = -1
"""The entry id of the (virtual) parent of every sequence's first block."""
NO_ENTRY = 0
"""The entry id of a block that is not verifiably cached (its chain cannot be reused)."""


BlockKey = tuple[bytes, int]
"""What a sequence remembers of one of its full blocks: ``(chained hash, entry id)``, the id of
the cache entry that holds the same content (``NO_ENTRY`` when none is verifiably cached). Plain
tuples: a sequence keeps one per full block, and they are made on the decode path."""


def encode_block(
    parent_hash: bytes | None, token_ids: Sequence[int], extra_key: Hashable = None
) -> bytes:
    """The stable byte encoding of a block that ``hash_block`` hashes.

    Parent hash (32 bytes, zeros for the first block), then the length and bytes of the extra
    key's canonical encoding (``checks.extra_key_bytes``: None, str, bytes, int and tuples of
    them, tagged by type), then the tokens as little-endian int64.
    """
    extra = checks.extra_key_bytes(extra_key)
    return _encode(parent_hash or _ROOT, token_ids, extra)


def _encode(parent_hash: bytes, token_ids: Sequence[int], extra: bytes) -> bytes:
    return struct.pack(f"<32sQ{len(extra)}s{len(token_ids)}q", parent_hash, len(extra), extra,
                       *token_ids)


def _digest(payload: bytes) -> bytes:
    return hashlib.sha256(payload).digest()


def chain(token_ids: list[int], extra: bytes, block_size: int, start: int, stop: int,
          parent_hash: bytes | None = None) -> list[tuple[bytes, bytes]]:
    """``(hash, encoding)`` of full blocks ``start`` to ``stop - 1`` of ``token_ids`` (checked
    tokens, the canonical extra key), chained to ``parent_hash``: the hash of block
    ``start - 1`` (None for a first block)."""
    out = []
    parent = parent_hash or _ROOT
    for i in range(start, stop):
        payload = _encode(parent, token_ids[i * block_size:(i + 1) * block_size], extra)
        parent = _digest(payload)
        out.append((parent, payload))
    return out


def hash_block(
    parent_hash: bytes | None, token_ids: Sequence[int], extra_key: Hashable = None
) -> bytes:
    """sha256 of ``encode_block(parent_hash, token_ids, extra_key)``: 32 bytes."""
    return _digest(encode_block(parent_hash, token_ids, extra_key))


@dataclass(slots=True)
class PrefixCacheStats:
    """Counters: ``queries`` lookups; ``query_tokens``/``hit_tokens`` tokens asked and found cached;
    ``evictions`` cached blocks reclaimed."""

    queries: int = 0
    query_tokens: int = 0
    hit_tokens: int = 0
    evictions: int = 0

    @property
    def hit_rate(self) -> float:
        """hit_tokens / query_tokens (0 before any query)."""
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0


# A cache entry: (block, hash, payload, parent entry id (ROOT_ENTRY for a first block), id);
# a plain tuple, made once per registered block.
_BLOCK, _HASH, _PAYLOAD, _PARENT, _ID = range(5)
_Entry = tuple[int, bytes, bytes, int, int]


class PrefixCache:
    """Maps chained block hashes to blocks of a BlockAllocator.

    The cache registers itself as the allocator's ``on_evict`` hook: when the allocator reclaims an
    evictable block, its entry is forgotten. Methods check their arguments and change nothing
    when they raise.
    """

    def __init__(self, allocator: BlockAllocator, block_size: int) -> None:
        if not isinstance(allocator, BlockAllocator):
            raise InvalidArgumentError(
                f"allocator must be a BlockAllocator, got {type(allocator).__name__}")
        self.block_size = checks.positive(block_size, "block_size", checks.INT32_MAX)
        self.allocator = allocator
        self.stats = PrefixCacheStats()
        self._by_hash: dict[bytes, _Entry] = {}
        self._by_block: dict[int, _Entry] = {}
        self._next_id = 1
        allocator.on_evict = self._forget

    def __len__(self) -> int:
        return len(self._by_hash)

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._by_hash

    def block_of(self, block_hash: bytes) -> int | None:
        """The block cached under ``block_hash``, or None."""
        entry = self._by_hash.get(block_hash)
        return entry[_BLOCK] if entry is not None else None

    def match(
        self, token_ids: Sequence[int], extra_key: Hashable = None, max_blocks: int | None = None
    ) -> tuple[list[int], list[BlockKey]]:
        """The longest run of cached blocks at the start of ``token_ids`` and their keys.

        Looks at most ``max_blocks`` full blocks. Changes nothing (no reference is taken).
        """
        token_ids = checks.token_ids(token_ids)
        max_blocks = checks.optional_count(max_blocks, "max_blocks", checks.INT32_MAX)
        return self.lookup(token_ids, checks.extra_key_bytes(extra_key), max_blocks)

    def lookup(self, token_ids: list[int], extra: bytes,
               max_blocks: int | None = None) -> tuple[list[int], list[BlockKey]]:
        """``match`` of arguments their owner checked already: ``token_ids`` as
        ``checks.token_ids`` returns them, ``extra`` the extra key as ``checks.extra_key_bytes``
        encodes it, ``max_blocks`` None or a count (the BlockManager's path: it checks a prompt
        once, where it enters)."""
        size = self.block_size
        limit = len(token_ids) // size
        if max_blocks is not None:
            limit = min(limit, max_blocks)
        blocks: list[int] = []
        keys: list[BlockKey] = []
        parent_hash, parent_id = _ROOT, ROOT_ENTRY
        for i in range(limit):
            payload = _encode(parent_hash, token_ids[i * size:(i + 1) * size], extra)
            block_hash = _digest(payload)
            entry = self._by_hash.get(block_hash)
            if entry is None or entry[_PAYLOAD] != payload or entry[_PARENT] != parent_id:
                break
            parent_hash, parent_id = block_hash, entry[_ID]
            blocks.append(entry[_BLOCK])
            keys.append((block_hash, parent_id))
        return blocks, keys

    def find(self, block_hash: bytes, payload: bytes) -> int | None:
        """The block cached under ``block_hash`` with exactly this encoding (``chain``), or None:
        the lookup of a sliding-window group, which holds no chain of parents to walk (the
        encoding holds the parent's hash, so the match covers the whole prefix)."""
        entry = self._by_hash.get(block_hash)
        return entry[_BLOCK] if entry is not None and entry[_PAYLOAD] == payload else None

    def add(self, block: int, block_hash: bytes, payload: bytes) -> None:
        """Cache a full, used block of a sliding-window group under its chained hash (``find``
        finds it); nothing when the hash or the block is cached already."""
        if block_hash in self._by_hash or block in self._by_block:
            return
        self.allocator.mark_cached(block)
        entry_id = self._next_id
        self._next_id = entry_id + 1
        self._by_hash[block_hash] = self._by_block[block] = (block, block_hash, payload,
                                                             NO_ENTRY, entry_id)

    def holds(self, block: int) -> bool:
        """Whether ``block`` holds one of this cache's entries."""
        return block in self._by_block

    def record_query(self, query_tokens: int, hit_tokens: int) -> None:
        """Count one lookup of ``query_tokens`` tokens of which ``hit_tokens`` were cached."""
        query_tokens = checks.count(query_tokens, "query_tokens", checks.INT32_MAX)
        hit_tokens = checks.count(hit_tokens, "hit_tokens", checks.INT32_MAX)
        if hit_tokens > query_tokens:
            raise InvalidArgumentError(f"hit_tokens ({hit_tokens}) > query_tokens ({query_tokens})")
        self.stats.queries += 1
        self.stats.query_tokens += query_tokens
        self.stats.hit_tokens += hit_tokens

    def register(
        self, block: int, parent: BlockKey | None, token_ids: Sequence[int],
        extra_key: Hashable = None,
    ) -> BlockKey:
        """Register a full, used block as the child of ``parent`` (None: a first block).

        Caches the block unless its content is cached already (then the key names that entry) or
        cannot be verified: a parent with ``NO_ENTRY``, or a hash held by other content. Returns
        the block's key.
        """
        token_ids = checks.token_ids(token_ids)
        if len(token_ids) != self.block_size:
            raise InvalidArgumentError(
                f"token_ids must hold one full block ({self.block_size} tokens), got "
                f"{len(token_ids)}")
        if parent is not None and not (
                isinstance(parent, tuple) and len(parent) == 2 and isinstance(parent[0], bytes)
                and type(parent[1]) is int):
            raise InvalidArgumentError(
                f"parent must be a (hash, entry id) key from match or register, or None; got "
                f"{parent!r}")
        return self._register(block, parent, token_ids, checks.extra_key_bytes(extra_key))

    def register_blocks(self, blocks: list[int], token_ids: list[int], extra: bytes,
                        keys: list[BlockKey]) -> None:
        """Register the full blocks of a sequence that ``keys`` does not cover yet, appending
        their keys to it: block i of ``blocks`` holds ``token_ids[i * block_size:]``'s first
        block_size tokens, and ``keys`` are the keys of the blocks before. Arguments as the
        owner checked them (see ``lookup``): the BlockManager calls this as blocks fill up."""
        size = self.block_size
        for i in range(len(keys), len(token_ids) // size):
            keys.append(self._register(blocks[i], keys[-1] if keys else None,
                                       token_ids[i * size:(i + 1) * size], extra))

    def _register(self, block: int, parent: BlockKey | None, token_ids: list[int],
                  extra: bytes) -> BlockKey:
        parent_hash, parent_id = parent if parent is not None else (_ROOT, ROOT_ENTRY)
        payload = _encode(parent_hash, token_ids, extra)
        block_hash = _digest(payload)
        if parent_id == NO_ENTRY:
            return block_hash, NO_ENTRY
        entry = self._by_hash.get(block_hash)
        if entry is not None:
            same = entry[_PAYLOAD] == payload and entry[_PARENT] == parent_id
            return block_hash, entry[_ID] if same else NO_ENTRY
        if block in self._by_block:  # the block already holds other content's entry
            return block_hash, NO_ENTRY
        self.allocator.mark_cached(block)  # checks the block first
        entry_id = self._next_id
        self._next_id = entry_id + 1
        self._by_hash[block_hash] = self._by_block[block] = (block, block_hash, payload,
                                                             parent_id, entry_id)
        return block_hash, entry_id

    def evict(self, num_blocks: int | None = None) -> list[int]:
        """Evict up to ``num_blocks`` (default all) unreferenced cached blocks, LRU first."""
        return self.allocator.evict(num_blocks)

    def _forget(self, block: int) -> None:
        entry = self._by_block.pop(block)
        del self._by_hash[entry[_HASH]]
        self.stats.evictions += 1
