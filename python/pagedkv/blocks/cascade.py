"""Cascade (shared-prefix) attention: a batch's shared blocks read once per group, not once per
sequence.

Sequences whose block tables start with the same run of full blocks (forks, prefix-cache hits)
form a group. A step's attention then runs on two levels, each one ``paged_attention`` call:

- the **prefix level**: per group one "sequence" whose keys are the shared blocks and whose
  queries are all of its members' query tokens, gathered contiguously; none is masked
  (``causal=False``: every query comes after the prefix), so the shared K/V rows are read once
  for the whole group, as a multi-query tile;
- the **suffix level**: every sequence over its own blocks, the shared run cut from the front
  of its table (a sequence in no group keeps its whole table);

and ``merge_attn_states`` combines the two by their log-sum-exps, in the same order for every
token (prefix, then suffix), so the result does not depend on how a batch was grouped beyond
rounding. A token of no group has an empty prefix part (lse -inf), which the merge ignores.

A member's shared run never reaches past its first query: in decode the query may be the last
key of the run (its own suffix is then empty: seq_len 0, lse -inf), with several query tokens
the run ends before the first. ALiBi and sliding windows count positions from the sequence's
start, which the suffix level does not see: their layers attend without cascade.

``plan_cascade`` finds the groups (see :class:`CascadePolicy` for which ones pay);
``CascadeBatch.attention`` runs a layer's attention over them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from pagedkv import checks, ops
from pagedkv.errors import InvalidArgumentError

__all__ = ["CascadeBatch", "CascadeGroup", "CascadePolicy", "plan_cascade"]


@dataclass(frozen=True, slots=True)
class CascadePolicy:
    """Which groups run as a cascade: at least ``min_group`` members sharing at least
    ``min_prefix_tokens`` tokens of full blocks.

    The defaults come from ``python -m bench.bench_cascade``'s sweep on the CPU kernels (see
    docs/cascade.md): below them the extra call and the merge cost more than the shared reads
    save. ``CascadePolicy.always()`` groups any two sequences sharing a block (tests, forcing).
    """

    min_prefix_tokens: int = 2048
    min_group: int = 8

    def __post_init__(self) -> None:
        checks.positive(self.min_prefix_tokens, "min_prefix_tokens", checks.INT32_MAX)
        checks.positive(self.min_group, "min_group", checks.INT32_MAX)
        if self.min_group < 2:
            raise InvalidArgumentError(
                f"min_group must be >= 2 (a group of one shares nothing), got {self.min_group}")

    @classmethod
    def always(cls) -> CascadePolicy:
        """Every group of two or more sequences sharing at least one full block."""
        return cls(min_prefix_tokens=1, min_group=2)


@dataclass(frozen=True, slots=True)
class CascadeGroup:
    """Sequences (batch indices, ascending) whose tables start with ``shared_blocks`` common
    full blocks."""

    members: tuple[int, ...]
    shared_blocks: int


@dataclass(slots=True)
class CascadeBatch:
    """The two levels of one step's attention for one KV cache group (see the module doc).

    Prefix level, a varlen call with one "sequence" per group: ``prefix_tokens`` int64
    ``[P]`` the batch's query tokens of the groups' members, group by group (members in batch
    order, each one's tokens in order); ``prefix_block_tables`` int32 ``[num_groups, width]``,
    ``prefix_seq_lens`` (shared tokens), ``prefix_query_start_loc`` int32
    ``[num_groups + 1]``. Suffix level, the batch's own call: ``suffix_block_tables`` /
    ``suffix_seq_lens`` (the shared run cut), with the batch's ``query_start_loc`` (None in
    decode). All on the batch's device; the bounds are host ints.
    """

    block_size: int
    groups: tuple[CascadeGroup, ...]
    prefix_tokens: torch.Tensor
    prefix_block_tables: torch.Tensor
    prefix_seq_lens: torch.Tensor
    prefix_query_start_loc: torch.Tensor
    prefix_max_seq_len: int
    prefix_max_query_len: int
    suffix_block_tables: torch.Tensor
    suffix_seq_lens: torch.Tensor
    suffix_max_seq_len: int
    query_start_loc: torch.Tensor | None
    max_query_len: int

    @property
    def shared_tokens_saved(self) -> int:
        """Key rows (per layer and kv head) the plain call would read that this one does not."""
        return self.block_size * sum((len(g.members) - 1) * g.shared_blocks
                                     for g in self.groups)

    def attention(self, out: torch.Tensor, query: torch.Tensor, *, scale: float,
                  soft_cap: float = 0.0, sinks: torch.Tensor | None = None,
                  lse_out: torch.Tensor | None = None, kernels: Any = ops,
                  **cache: Any) -> None:
        """``paged_attention`` of the batch's ``query`` ``[T, H, D]`` into ``out``, in two levels.

        ``cache``: the layer's cache arguments (``key_cache``, ``value_cache``, ``k_scale``,
        ``v_scale``, ``key_cache_scales``, ``value_cache_scales``, as
        ``PagedKVCache.layer_args`` gives them). ``sinks`` enter once per row, at the suffix
        level; ``lse_out`` (float32 ``[T, H]``) receives the merged lse. ``kernels``: a
        namespace with the ops' schemas (``pagedkv.ops`` or ``torch.ops.pagedkv``).
        """
        num_tokens, num_heads = query.shape[:2]
        lse = lambda n: torch.empty(n, num_heads, dtype=torch.float32,  # noqa: E731
                                    device=query.device)
        # The two levels' rows in float32, rounded to out's dtype once, by the merge: then a
        # 16-bit output differs from the plain call's by float32 rounding alone, not by two
        # more roundings to 16 bits.
        prefix_q = query.index_select(0, self.prefix_tokens)
        prefix_out = torch.empty(prefix_q.shape, dtype=torch.float32, device=query.device)
        prefix_lse = lse(len(self.prefix_tokens))
        kernels.paged_attention(
            out=prefix_out, query=prefix_q, block_tables=self.prefix_block_tables,
            seq_lens=self.prefix_seq_lens, query_start_loc=self.prefix_query_start_loc,
            max_seq_len=self.prefix_max_seq_len, max_query_len=self.prefix_max_query_len,
            scale=scale, alibi_slopes=None, sliding_window=-1, soft_cap=soft_cap,
            lse_out=prefix_lse, sinks=None, causal=False, **cache)
        suffix_out = torch.empty(out.shape, dtype=torch.float32, device=out.device)
        suffix_lse = lse(num_tokens)
        kernels.paged_attention(
            out=suffix_out, query=query, block_tables=self.suffix_block_tables,
            seq_lens=self.suffix_seq_lens, query_start_loc=self.query_start_loc,
            max_seq_len=self.suffix_max_seq_len, max_query_len=self.max_query_len,
            scale=scale, alibi_slopes=None, sliding_window=-1, soft_cap=soft_cap,
            lse_out=suffix_lse, sinks=sinks, **cache)
        # The prefix level's rows back in batch order; tokens of no group: an empty part.
        full_out = torch.empty_like(suffix_out)
        full_out.index_copy_(0, self.prefix_tokens, prefix_out)
        full_lse = torch.full_like(suffix_lse, float("-inf"))
        full_lse.index_copy_(0, self.prefix_tokens, prefix_lse)
        kernels.merge_attn_states(out, lse_out, full_out, full_lse, suffix_out, suffix_lse)


def _partition(lcp: np.ndarray, min_blocks: int, min_group: int) -> list[tuple[int, int, int]]:
    """Groups of consecutive sorted sequences: ``(first, last + 1, shared blocks)``, chosen to
    save the most block reads, sum over groups of (members - 1) * shared.

    ``lcp[j]``: full blocks that sorted sequences j and j + 1 share; a range's shared run is
    the least of its ``lcp``. Dynamic programming over the range ends (O(n^2), numpy inside):
    ``best[j]``, the saving of the first j sequences, ends either with sequence j - 1 alone or
    with a qualifying range i .. j - 1 (at least ``min_group`` members, at least
    ``min_blocks`` shared)."""
    n = len(lcp) + 1
    best = np.zeros(n + 1, dtype=np.int64)
    choice = np.full(n + 1, -1, dtype=np.int64)  # the range's start, or -1: alone
    for j in range(min_group, n + 1):
        best[j] = best[j - 1]
        # ranges i .. j - 1 for i = j - min_group down to 0: shared = min(lcp[i : j - 1])
        shared = np.minimum.accumulate(lcp[j - 2::-1])[min_group - 2:]
        starts = np.arange(j - min_group, -1, -1)
        saving = np.where(shared >= min_blocks, best[starts] + (j - 1 - starts) * shared, -1)
        k = int(np.argmax(saving))
        if saving[k] > best[j]:
            best[j], choice[j] = saving[k], starts[k]
    groups, j = [], n
    while j > 0:
        if choice[j] < 0:
            j -= 1
            continue
        i = int(choice[j])
        groups.append((i, j, int(lcp[i:j - 1].min())))
        j = i
    return groups[::-1]


def plan_cascade(block_tables: np.ndarray, seq_lens: np.ndarray,
                 query_lens: Sequence[int] | np.ndarray, block_size: int,
                 policy: CascadePolicy = CascadePolicy(), *, decode: bool,
                 device: torch.device | str | None = None) -> CascadeBatch | None:
    """The cascade of a batch, or None when no group qualifies under ``policy``.

    ``block_tables`` int32 ``[num_seqs, width]``, ``seq_lens`` int32 ``[num_seqs]`` and
    ``query_lens`` (this step's tokens per sequence) as the batch holds them on the host;
    ``decode``: the batch's attention runs without query_start_loc (one token per sequence).

    Each sequence may share the full blocks before its first query (decode: the query's own
    too, when it fills a block). Sorted by those blocks, sequences with a common run are
    consecutive, and a group's shared run is the least of its neighbours' common runs; the
    groups are the ranges of that order that save the most block reads (``_partition``). A
    sequence is in at most one group.
    """
    tables = np.asarray(block_tables, dtype=np.int32)
    lens = np.asarray(seq_lens, dtype=np.int64)
    qlens = np.broadcast_to(np.asarray(query_lens, dtype=np.int64), lens.shape)
    if len(lens) < policy.min_group or tables.shape[1] == 0:
        return None
    caps = np.minimum((lens - qlens + (1 if decode else 0)) // block_size, tables.shape[1])
    min_blocks = -(-policy.min_prefix_tokens // block_size)
    eligible = np.flatnonzero((caps >= min_blocks) & (qlens > 0))
    if len(eligible) < policy.min_group:
        return None
    width = int(caps[eligible].max())
    # Each one's shareable blocks; past its cap an entry no other sequence has (ids are >= 0).
    keys = tables[eligible, :width].astype(np.int64)
    past = np.arange(width) >= caps[eligible, None]
    keys[past] = np.broadcast_to(-2 - eligible[:, None], keys.shape)[past]
    order = np.lexsort(keys.T[::-1])
    same = keys[order[1:]] == keys[order[:-1]]
    lcp = np.where(same.all(axis=1), width, np.argmin(same, axis=1))
    groups = [CascadeGroup(tuple(int(m) for m in np.sort(eligible[order[i:j]])), shared)
              for i, j, shared in _partition(lcp, min_blocks, policy.min_group)]
    if not groups:
        return None
    groups.sort(key=lambda g: g.members[0])
    return _build(tables, lens, qlens, block_size, groups, decode, device)


def _build(tables: np.ndarray, lens: np.ndarray, qlens: np.ndarray, block_size: int,
           groups: list[CascadeGroup], decode: bool,
           device: torch.device | str | None) -> CascadeBatch:
    n = len(lens)
    starts = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(qlens, out=starts[1:])
    shared = np.zeros(n, dtype=np.int64)  # blocks cut from each sequence's table
    tokens, group_qlens = [], []
    for g in groups:
        members = np.asarray(g.members)
        shared[members] = g.shared_blocks
        tokens += [np.arange(starts[m], starts[m + 1]) for m in members]
        group_qlens.append(int(qlens[members].sum()))
    widest = max(g.shared_blocks for g in groups)
    prefix_tables = np.zeros((len(groups), widest), dtype=np.int32)
    for i, g in enumerate(groups):
        prefix_tables[i, :g.shared_blocks] = tables[g.members[0], :g.shared_blocks]
    prefix_lens = np.array([g.shared_blocks * block_size for g in groups], dtype=np.int32)
    prefix_qsl = np.zeros(len(groups) + 1, dtype=np.int32)
    np.cumsum(group_qlens, out=prefix_qsl[1:])
    suffix_lens = (lens - shared * block_size).astype(np.int32)
    suffix_width = max(1, int(-(-suffix_lens.max() // block_size)) if n else 1)
    columns = np.minimum(shared[:, None] + np.arange(suffix_width), tables.shape[1] - 1)
    suffix_tables = np.take_along_axis(tables, columns, axis=1)
    put = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(device)  # noqa: E731
    return CascadeBatch(
        block_size=block_size, groups=tuple(groups), prefix_tokens=put(np.concatenate(tokens)),
        prefix_block_tables=put(prefix_tables), prefix_seq_lens=put(prefix_lens),
        prefix_query_start_loc=put(prefix_qsl), prefix_max_seq_len=int(prefix_lens.max()),
        prefix_max_query_len=max(group_qlens), suffix_block_tables=put(suffix_tables),
        suffix_seq_lens=put(suffix_lens), suffix_max_seq_len=int(suffix_lens.max()),
        query_start_loc=None if decode else put(starts.astype(np.int32)),
        max_query_len=int(qlens.max()))
