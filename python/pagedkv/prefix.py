"""Prefix caching: full blocks keyed by a chained hash, reused by sequences that share a prefix.

Block i of a sequence is keyed by ``sha256(parent hash, extra key, its block_size tokens)`` where
the parent hash is block i-1's key. A lookup walks a prompt's full blocks and stops at the first
miss; a hit also compares the stored encoding of (parent hash, extra key, tokens) and the extra
key with the asked ones, so even a hash collision cannot hand one prompt another prompt's K/V.
Blocks nobody references stay cached in the allocator's evictable queue and are evicted least
recently freed first.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from .allocator import BlockAllocator

__all__ = ["PrefixCache", "PrefixCacheStats", "encode_block", "hash_block"]

_ROOT = bytes(32)


def encode_block(
    parent_hash: bytes | None, token_ids: Sequence[int], extra_key: Hashable = None
) -> bytes:
    """The stable byte encoding of a block that ``hash_block`` hashes.

    Parent hash (32 bytes, zeros for the first block), then the length and bytes of
    ``repr(extra_key)``, then the tokens as little-endian int64. ``extra_key`` (adapter id, cache
    salt, ...) should be built from str, int, bytes, tuples and None, whose repr is stable across
    processes.
    """
    extra = repr(extra_key).encode()
    return struct.pack(f"<32sQ{len(extra)}s{len(token_ids)}q", parent_hash or _ROOT,
                       len(extra), extra, *token_ids)


def _digest(payload: bytes) -> bytes:
    return hashlib.sha256(payload).digest()


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


class PrefixCache:
    """Maps chained block hashes to blocks of a BlockAllocator.

    The cache registers itself as the allocator's ``on_evict`` hook: when the allocator reclaims an
    evictable block, its hash is forgotten.
    """

    def __init__(self, allocator: BlockAllocator, block_size: int) -> None:
        self.allocator, self.block_size = allocator, block_size
        self.stats = PrefixCacheStats()
        self._block_of: dict[bytes, int] = {}
        self._key_of: dict[int, tuple[bytes, bytes, Hashable]] = {}  # hash, encoding, extra key
        allocator.on_evict = self._forget

    def __len__(self) -> int:
        return len(self._block_of)

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._block_of

    def block_of(self, block_hash: bytes) -> int | None:
        """The block cached under ``block_hash``, or None."""
        return self._block_of.get(block_hash)

    def match(
        self, token_ids: Sequence[int], extra_key: Hashable = None, max_blocks: int | None = None
    ) -> tuple[list[int], list[bytes]]:
        """The longest run of cached blocks at the start of ``token_ids`` and their hashes.

        Looks at most ``max_blocks`` full blocks. Changes nothing (no reference is taken).
        """
        full = len(token_ids) // self.block_size
        limit = full if max_blocks is None else min(full, max_blocks)
        blocks: list[int] = []
        hashes: list[bytes] = []
        parent = b""
        for i in range(limit):
            payload = encode_block(parent, token_ids[i * self.block_size:(i + 1) * self.block_size],
                                   extra_key)
            block_hash = _digest(payload)
            block = self._block_of.get(block_hash)
            if block is None or self._key_of[block][1:] != (payload, extra_key):
                break
            blocks.append(block)
            hashes.append(block_hash)
            parent = block_hash
        return blocks, hashes

    def record_query(self, query_tokens: int, hit_tokens: int) -> None:
        """Count one lookup of ``query_tokens`` tokens of which ``hit_tokens`` were cached."""
        self.stats.queries += 1
        self.stats.query_tokens += query_tokens
        self.stats.hit_tokens += hit_tokens

    def register(
        self, block: int, parent_hash: bytes, token_ids: Sequence[int], extra_key: Hashable = None
    ) -> bytes:
        """Hash a full, used block; cache it unless the hash is cached already. Returns the hash."""
        payload = encode_block(parent_hash, token_ids, extra_key)
        block_hash = _digest(payload)
        if block_hash not in self._block_of and block not in self._key_of:
            self._block_of[block_hash] = block
            self._key_of[block] = (block_hash, payload, extra_key)
            self.allocator.mark_cached(block)
        return block_hash

    def evict(self, num_blocks: int | None = None) -> list[int]:
        """Evict up to ``num_blocks`` (default all) unreferenced cached blocks, LRU first."""
        return self.allocator.evict(num_blocks)

    def _forget(self, block: int) -> None:
        block_hash, _, _ = self._key_of.pop(block)
        del self._block_of[block_hash]
        self.stats.evictions += 1
