"""Batch tensors of the cache ops: block tables, seq_lens, slot_mapping, query_start_loc."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from pagedkv import checks
from pagedkv.blocks.allocator import NULL_BLOCK
from pagedkv.blocks.cascade import CascadeBatch, CascadePolicy, plan_cascade
from pagedkv.errors import InvalidArgumentError

__all__ = ["PAD_BLOCK", "PAD_SLOT", "PAD_WINDOW", "BatchTensors", "BlockTableRows"]

PAD_BLOCK = NULL_BLOCK
"""Padding of block tables past a sequence's last block: block 0, the reserved null block."""
PAD_SLOT = -1
"""Padding of slot_mapping: reshape_and_cache skips negative slots."""
PAD_WINDOW = -1
"""A sliding-window group's table entry of a block freed behind the window: never read."""


@dataclass(slots=True)
class BatchTensors:
    """Inputs of the cache and attention ops for one step, in the order of the sequences asked for.

    ``block_tables`` int32 ``[num_seqs, max_blocks]``, padded with ``PAD_BLOCK`` (0);
    ``seq_lens`` int32 ``[num_seqs]`` (tokens including this step's);
    ``slot_mapping`` int64 ``[num_tokens]`` (the query tokens; ``PAD_SLOT`` -1 for padding);
    ``query_start_loc`` int32 ``[num_seqs + 1]``; ``max_seq_len``/``max_query_len`` host ints.
    ``group_block_tables`` / ``group_slot_mappings``: each KV cache group's block tables and
    slot mapping, in group order (the layers of group g write with ``group_slot_mappings[g]``
    and attend with ``group_block_tables[g]``); one group: ``(block_tables,)`` and
    ``(slot_mapping,)``. A sliding-window group's table keeps logical positions: the entries
    of blocks that no query of the sequence can reach any more hold ``PAD_WINDOW`` (-1).
    ``group_cascades``: each group's shared-prefix plan (``pagedkv.blocks.cascade``), or None
    where the batch was built without a cascade policy, no group of sequences qualified, or
    the group has a sliding window; its layers then attend with the plain call.
    """

    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    max_seq_len: int
    max_query_len: int
    group_block_tables: tuple[torch.Tensor, ...] = ()
    group_slot_mappings: tuple[torch.Tensor, ...] = ()
    group_cascades: tuple[CascadeBatch | None, ...] = ()


class BlockTableRows:
    """Block tables kept as rows of one padded int32 array, so a batch's tables are one gather.

    Rows and columns grow by doubling; a released row is reset to ``PAD_BLOCK``.
    """

    def __init__(self, block_size: int, rows: int = 64, columns: int = 16) -> None:
        self.block_size = block_size
        self.array = np.full((rows, columns), PAD_BLOCK, dtype=np.int32)
        self._free_rows = list(range(rows - 1, -1, -1))

    def take(self) -> int:
        """A free row."""
        if not self._free_rows:
            rows = len(self.array)
            self.array = np.concatenate([self.array, np.full_like(self.array, PAD_BLOCK)])
            self._free_rows = list(range(2 * rows - 1, rows - 1, -1))
        return self._free_rows.pop()

    def write(self, row: int, table: list[int], start: int = 0) -> None:
        """Copy ``table[start:]`` into the row."""
        if len(table) > self.array.shape[1]:
            self._grow_columns(len(table))
        self.array[row, start:len(table)] = table[start:]

    def release(self, row: int, num_blocks: int) -> None:
        """Reset the row's first ``num_blocks`` entries and return it to the free rows."""
        self.array[row, :num_blocks] = PAD_BLOCK
        self._free_rows.append(row)

    def _grow_columns(self, width: int) -> None:
        grown = np.full((len(self.array), max(width, 2 * self.array.shape[1])), PAD_BLOCK,
                        dtype=np.int32)
        grown[:, :self.array.shape[1]] = self.array
        self.array = grown

    def build(
        self,
        rows: np.ndarray,
        seq_lens: np.ndarray,
        num_query_tokens: int | Sequence[int] = 1,
        *,
        device: torch.device | str | None = None,
        max_blocks: int | None = None,
        pad_tokens_to: int | None = None,
        cascade: CascadePolicy | None = None,
    ) -> BatchTensors:
        """Batch tensors of the sequences in ``rows`` (intp) with ``seq_lens`` (int32) tokens; the
        other arguments as ``BlockManager.build_batch`` takes them (checked here)."""
        n = len(rows)
        if type(num_query_tokens) is not int or not 0 < num_query_tokens <= checks.INT32_MAX:
            num_query_tokens = checks.query_lens(num_query_tokens, n)
        if max_blocks is not None or pad_tokens_to is not None:
            max_blocks = checks.optional_count(max_blocks, "max_blocks", checks.INT32_MAX)
            pad_tokens_to = checks.optional_count(pad_tokens_to, "pad_tokens_to",
                                                  checks.INT32_MAX)
        if isinstance(num_query_tokens, int):  # one length for all: no broadcast
            query_lens = np.full(n, num_query_tokens, dtype=np.int32)
            if n and seq_lens.min() < num_query_tokens:
                raise InvalidArgumentError(
                    "num_query_tokens must be in [1, seq_len] for every sequence")
            query_start_loc = np.arange(0, (n + 1) * num_query_tokens, num_query_tokens,
                                        dtype=np.int32)
        else:
            query_lens = np.asarray(num_query_tokens, dtype=np.int32)
            if n and (query_lens > seq_lens).any():
                raise InvalidArgumentError(
                    "num_query_tokens must be in [1, seq_len] for every sequence")
            query_start_loc = np.zeros(n + 1, dtype=np.int32)
            np.cumsum(query_lens, out=query_start_loc[1:])
        max_seq_len = int(seq_lens.max()) if n else 0
        width = max(-(-max_seq_len // self.block_size), max_blocks or 0)
        if max_blocks is not None and max_blocks < width:
            raise InvalidArgumentError(f"max_blocks={max_blocks} < {width} blocks of a sequence")
        if width > self.array.shape[1]:
            self._grow_columns(width)
        slots = self._slot_mapping(rows, seq_lens, query_lens, query_start_loc, pad_tokens_to)
        arrays = (self.array[rows, :width], seq_lens, slots, query_start_loc)
        tensors = [torch.from_numpy(array) for array in arrays]
        if device is not None:
            tensors = [tensor.to(device) for tensor in tensors]
        max_query_len = int(query_lens.max()) if n else 0
        plan = None
        if cascade is not None:
            plan = plan_cascade(arrays[0], seq_lens, query_lens, self.block_size, cascade,
                                decode=max_query_len == 1, device=device)
        return BatchTensors(*tensors, max_seq_len=max_seq_len, max_query_len=max_query_len,
                            group_block_tables=(tensors[0],), group_slot_mappings=(tensors[2],),
                            group_cascades=(plan,))

    def _slot_mapping(self, rows: np.ndarray, seq_lens: np.ndarray, query_lens: np.ndarray,
                      query_start_loc: np.ndarray, pad_to: int | None) -> np.ndarray:
        num_tokens = int(query_start_loc[-1])
        if num_tokens == len(rows):  # decode: one token per sequence, the last
            positions = seq_lens.astype(np.int64) - 1
        else:
            token_seq = np.repeat(np.arange(len(rows)), query_lens)
            rows = rows[token_seq]
            first = (seq_lens - query_lens).astype(np.int64) - query_start_loc[:-1]
            positions = first[token_seq] + np.arange(num_tokens)
        blocks = self.array[rows, positions // self.block_size].astype(np.int64)
        slots = blocks * self.block_size + positions % self.block_size
        if pad_to is not None:
            if pad_to < num_tokens:
                raise InvalidArgumentError(f"pad_tokens_to={pad_to} < {num_tokens} query tokens")
            slots = np.concatenate([slots, np.full(pad_to - num_tokens, PAD_SLOT, np.int64)])
        return slots
