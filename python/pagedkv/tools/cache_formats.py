"""Every cache format side by side for one cache shape (``pagedkv size --formats``): bytes per
row and per token, row scales included, and in a memory budget the sequences each holds against
a cache in the model's dtype."""

from __future__ import annotations

import dataclasses
from typing import Any

from pagedkv.cache.formats import FORMATS
from pagedkv.cache.spec import KVCacheSpec
from pagedkv.errors import InvalidArgumentError
from pagedkv.tools.presets import format_bytes

__all__ = ["formats_lines", "formats_report"]


def formats_report(spec: KVCacheSpec, seq_len: int, memory: int | None = None
                   ) -> list[dict[str, Any]]:
    """One row per format ``spec``'s shape can take (a latent cache: no token-scaled ones):
    its bytes per row and token, the ratio of the model dtype's bytes per token to its own, and
    with ``memory`` the blocks, sequences of ``seq_len`` and their ratio to the model dtype's."""
    base = dataclasses.replace(spec, cache_dtype=None)
    base_seqs = base.num_blocks_for(memory or 0) // base.blocks_for_tokens(seq_len)
    rows = []
    for name, fmt in FORMATS.items():
        try:
            s = dataclasses.replace(spec, cache_dtype=fmt)
        except InvalidArgumentError:  # what this cache cannot take (MLA and row scales)
            continue
        row: dict[str, Any] = {"format": name, "label": fmt.label, "row_bytes": s.row_bytes,
                               "bytes_per_token": s.bytes_per_token,
                               "tokens_ratio": base.bytes_per_token / s.bytes_per_token}
        if memory is not None:
            blocks = s.num_blocks_for(memory)
            seqs = blocks // s.blocks_for_tokens(seq_len)
            row |= {"blocks_fit": blocks, "tokens_fit": blocks * s.block_size, "seqs_fit": seqs,
                    "seqs_ratio": seqs / base_seqs if base_seqs else None}
        rows.append(row)
    return rows


def formats_lines(rows: list[dict[str, Any]], spec: KVCacheSpec, seq_len: int,
                  memory: int | None) -> list[str]:
    """The table of ``formats_report``'s rows."""
    base = str(spec.dtype).removeprefix("torch.")
    fit = f"{'sequences':>11}{'vs ' + base:>13}" if memory is not None else ""
    lines = [f"{'cache formats':<26}{'row':>8}{'per token':>11}{'tokens':>9}{fit}  format"]
    for r in rows:
        line = (f"  {r['format']:<24}{r['row_bytes']:>6} B{format_bytes(r['bytes_per_token']):>11}"
                f"{r['tokens_ratio']:>8.2f}x")
        if memory is not None:
            ratio = "-" if r["seqs_ratio"] is None else f"{r['seqs_ratio']:.2f}x"
            line += f"{r['seqs_fit']:>11,}{ratio:>13}"
        lines.append(f"{line}  {r['label']}")
    fit = f"; sequences of {seq_len:,} in {format_bytes(memory)}" if memory is not None else ""
    lines.append(f"  row: {spec.head_size} elements and their float32 scale; tokens: the tokens "
                 f"a byte holds against {base}{fit}")
    return lines
