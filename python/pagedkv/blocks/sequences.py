"""The BlockManager's sequences: what it keeps of each, and their lookup by id with the errors
that a wrong id raises (unknown, freed, swapped out, named twice)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from pagedkv import checks
from pagedkv.blocks.prefix import BlockKey
from pagedkv.errors import (
    DoubleFreeError,
    DuplicateSequenceError,
    FreedSequenceError,
    InvalidArgumentError,
    SequenceStateError,
    UnknownSequenceError,
)

if TYPE_CHECKING:
    from pagedkv.blocks.groups import GroupTables

__all__ = ["SeqState", "SequenceRegistry"]

_FREED_IDS_REMEMBERED = 4096


@dataclass(slots=True)
class SeqState:
    """One sequence: its tokens, block table and prefix keys."""

    token_ids: list[int]
    block_table: list[int]  # device blocks, or CPU blocks while swapped
    block_keys: list[BlockKey]  # key of each full block (prefix caching only)
    extra_key: Hashable
    extra: bytes  # the canonical encoding of extra_key
    row: int = -1  # row in BlockManager.tables while resident
    swapped: bool = False
    groups: GroupTables | None = None  # every group's tables (a manager of several groups)


class SequenceRegistry:
    """Sequences by id in insertion order (``by_id``), and the ids freed last, so that a use after
    free says so. The lookups raise, changing nothing, when the id does not fit the call."""

    def __init__(self) -> None:
        self.by_id: dict[Hashable, SeqState] = {}
        self._freed: OrderedDict[Hashable, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self.by_id)

    def __contains__(self, seq_id: Hashable) -> bool:
        try:
            return seq_id in self.by_id
        except TypeError:
            return False

    def get(self, seq_id: Hashable) -> SeqState:
        """The sequence ``seq_id`` (resident or swapped)."""
        try:
            seq = self.by_id.get(seq_id)
        except TypeError:
            checks.hashable(seq_id, "seq_id")  # raises
        if seq is not None:
            return seq
        if seq_id in self._freed:
            raise FreedSequenceError(f"sequence {seq_id!r} was freed")
        raise UnknownSequenceError(f"unknown sequence {seq_id!r} ({len(self.by_id)} managed)")

    def resident(self, seq_id: Hashable) -> SeqState:
        """The sequence ``seq_id``, which must be on the device."""
        seq = self.get(seq_id)
        if seq.swapped:
            raise SequenceStateError(f"sequence {seq_id!r} is swapped out; swap_in first")
        return seq

    def swapped(self, seq_id: Hashable) -> SeqState:
        """The sequence ``seq_id``, which must be swapped out."""
        seq = self.get(seq_id)
        if not seq.swapped:
            raise SequenceStateError(f"sequence {seq_id!r} is not swapped out")
        return seq

    def to_free(self, seq_id: Hashable) -> SeqState:
        """The sequence ``seq_id`` for ``free``: a freed one raises DoubleFreeError."""
        checks.hashable(seq_id, "seq_id")
        if seq_id in self._freed and seq_id not in self.by_id:
            raise DoubleFreeError(f"sequence {seq_id!r} was already freed")
        return self.get(seq_id)

    def many(self, seq_ids: Sequence[Hashable]) -> list[SeqState]:
        """The sequences of a sequence of ids (resident or swapped)."""
        try:
            if isinstance(seq_ids, (str, bytes)):  # one id, not a sequence of ids
                raise TypeError
            return list(map(self.by_id.__getitem__, seq_ids))
        except (KeyError, TypeError):
            if isinstance(seq_ids, (str, bytes)) or not isinstance(seq_ids, Sequence):
                raise InvalidArgumentError(
                    f"seq_ids must be a sequence of sequence ids, got {type(seq_ids).__name__}"
                ) from None
            return [self.get(seq_id) for seq_id in seq_ids]

    def rows(self, seq_ids: Sequence[Hashable], seqs: list[SeqState]) -> np.ndarray:
        """The table rows (intp) of ``many(seq_ids)``, which must be distinct and resident."""
        n = len(seqs)
        rows = np.fromiter([seq.row for seq in seqs], np.intp, n)
        if n:
            if rows.min() < 0:
                for seq_id in seq_ids:
                    self.resident(seq_id)  # raises at the first swapped-out one
            if n > 1 and np.bincount(rows).max() > 1:
                counts = np.bincount(rows)
                dup = next(s for s, seq in zip(seq_ids, seqs, strict=True) if counts[seq.row] > 1)
                raise InvalidArgumentError(f"seq_ids names sequence {dup!r} more than once")
        return rows

    def check_new(self, seq_id: Hashable, name: str = "seq_id") -> None:
        """Raise unless ``seq_id`` can name a new sequence."""
        checks.hashable(seq_id, name)
        if seq_id in self.by_id:
            raise DuplicateSequenceError(f"sequence {seq_id!r} already exists")

    def add(self, seq_id: Hashable, seq: SeqState) -> None:
        """Manage ``seq`` under the new id ``seq_id``."""
        self.by_id[seq_id] = seq
        self._freed.pop(seq_id, None)

    def remove(self, seq_id: Hashable) -> None:
        """Forget ``seq_id``, remembering that it was freed."""
        del self.by_id[seq_id]
        self._freed[seq_id] = None
        if len(self._freed) > _FREED_IDS_REMEMBERED:
            self._freed.popitem(last=False)
