"""Exceptions of pagedkv's block management. Every one is raised before any state changes."""

from __future__ import annotations

__all__ = [
    "DoubleFreeError",
    "DuplicateSequenceError",
    "FreedSequenceError",
    "InvalidArgumentError",
    "InvalidBlockError",
    "OutOfBlocksError",
    "PagedKVError",
    "SequenceStateError",
    "UnknownSequenceError",
]


class PagedKVError(Exception):
    """Base class of every error pagedkv raises on purpose."""


class InvalidArgumentError(PagedKVError, ValueError, TypeError):
    """An argument of the wrong type or out of its range (the message names it); nothing changed.

    Both a ValueError and a TypeError, so either ``except`` clause catches it.
    """


class OutOfBlocksError(PagedKVError):
    """More blocks were asked for than the pool can give; nothing was allocated.

    Attributes: ``requested`` and ``available`` block counts, ``pool`` the pool's name.
    """

    def __init__(self, requested: int, available: int, pool: str = "device") -> None:
        self.requested, self.available, self.pool = requested, available, pool
        super().__init__(
            f"out of {pool} blocks: asked for {requested}, {available} available "
            "(free + evictable cached)"
        )


class InvalidBlockError(PagedKVError, ValueError):
    """A block id out of range, the reserved null block, or a block in the wrong state."""


class DoubleFreeError(PagedKVError):
    """A block whose reference count is already 0, or a sequence already freed, was freed again."""


class UnknownSequenceError(PagedKVError, LookupError):
    """The sequence id is not managed (never added, or freed)."""


class FreedSequenceError(UnknownSequenceError):
    """The sequence id was freed; raised by any use of it other than a repeated ``free``."""


class DuplicateSequenceError(PagedKVError, ValueError):
    """A sequence id that is already managed was added or forked into again."""


class SequenceStateError(PagedKVError):
    """The operation needs the sequence resident on the device (or swapped out) and it is not."""
