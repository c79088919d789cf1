"""CacheFormat: how a KV cache stores a row (one token of one head), the one description that
``KVCacheSpec``, ``PagedKVCache`` and the size tools read.

Formats:

- ``float32``, ``float16``, ``bfloat16``: the row as is.
- ``float8_e4m3fn``, ``float8_e5m2``: fp8 with one float32 scale per layer for K and one for V
  (``k_scale`` / ``v_scale``, set by the caller).
- ``int8``, ``int4``, ``fp8_e4m3_per_token_head``, ``fp8_e5m2_per_token_head``: each row
  quantized as ``reshape_and_cache`` writes it, with its own float32 scale ``absmax(row) /
  qmax`` in the side tensors ``key_cache_scales`` / ``value_cache_scales`` ``[num_blocks,
  num_kv_heads, block_size]``. int4 is stored as uint8, two elements a byte (element ``2i`` in
  the low nibble), so a row is ``head_size / 2`` bytes.

``cache_format`` reads a format from a torch dtype (the plain and per-tensor fp8 formats, and
``torch.int8``), a name (aliases: ``fp32``, ``fp16``, ``bf16``, ``fp8`` = ``fp8_e4m3`` (per
tensor), ``fp8_per_token_head``, ``int8_per_token_head``, ``int4_per_token_head``) or a
``CacheFormat``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedkv.errors import InvalidArgumentError

__all__ = ["FORMATS", "CacheFormat", "cache_format", "format_names"]

SCALE_BYTES = 4
"""Bytes of one row's scale (float32)."""


@dataclass(frozen=True, slots=True)
class CacheFormat:
    """One way of storing K/V rows.

    Attributes:
        name: the canonical name (``cache_format`` accepts it).
        storage: the torch dtype of the cache tensors.
        bits: bits per element of a row (int4: 4, in a uint8 holding two).
        token_scaled: each row has its own float32 scale (``key_cache_scales``).
        qmax: the largest magnitude a token-scaled element stores (``scale = absmax / qmax``):
            127 (int8), 7 (int4), the fp8 format's largest finite value; None otherwise.
        label: a few words for tables.
    """

    name: str
    storage: torch.dtype
    bits: int
    token_scaled: bool = False
    qmax: float | None = None
    label: str = ""

    @property
    def tensor_scaled(self) -> bool:
        """fp8 with one scale per layer (``k_scale`` / ``v_scale``)."""
        return not self.token_scaled and self.storage in (torch.float8_e4m3fn,
                                                          torch.float8_e5m2)

    @property
    def quantized(self) -> bool:
        """Stored in fewer bits than a 16-bit float, with scales of either kind."""
        return self.token_scaled or self.tensor_scaled

    def stored_width(self, head_size: int) -> int:
        """Last dim of the cache tensors for rows of ``head_size`` elements (int4: half)."""
        if self.bits == 4 and head_size % 2:
            raise InvalidArgumentError(
                f"head_size must be even for an int4 cache (two elements a byte), got "
                f"{head_size}")
        return head_size * self.bits // (8 * torch.empty((), dtype=self.storage).element_size())

    def row_bytes(self, head_size: int) -> int:
        """Bytes of one row of ``head_size`` elements, its scale included."""
        return self.stored_width(head_size) * torch.empty((), dtype=self.storage).element_size() \
            + (SCALE_BYTES if self.token_scaled else 0)


def _fp8_max(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).max)


FORMATS: dict[str, CacheFormat] = {f.name: f for f in [
    CacheFormat("float32", torch.float32, 32, label="float32"),
    CacheFormat("float16", torch.float16, 16, label="float16"),
    CacheFormat("bfloat16", torch.bfloat16, 16, label="bfloat16"),
    CacheFormat("float8_e4m3fn", torch.float8_e4m3fn, 8, label="fp8 e4m3, a scale per layer"),
    CacheFormat("float8_e5m2", torch.float8_e5m2, 8, label="fp8 e5m2, a scale per layer"),
    CacheFormat("int8", torch.int8, 8, True, 127.0, "int8, a scale per (token, head)"),
    CacheFormat("int4", torch.uint8, 4, True, 7.0, "int4, a scale per (token, head)"),
    CacheFormat("fp8_e4m3_per_token_head", torch.float8_e4m3fn, 8, True,
                _fp8_max(torch.float8_e4m3fn), "fp8 e4m3, a scale per (token, head)"),
    CacheFormat("fp8_e5m2_per_token_head", torch.float8_e5m2, 8, True,
                _fp8_max(torch.float8_e5m2), "fp8 e5m2, a scale per (token, head)"),
]}
"""Every format by its canonical name."""

_ALIASES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16", "fp8": "float8_e4m3fn",
            "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2",
            "fp8_per_token_head": "fp8_e4m3_per_token_head",
            "int8_per_token_head": "int8", "int4_per_token_head": "int4"}
_BY_DTYPE = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16",
             torch.float8_e4m3fn: "float8_e4m3fn", torch.float8_e5m2: "float8_e5m2",
             torch.int8: "int8"}


def format_names() -> list[str]:
    """Every name ``cache_format`` accepts: the canonical ones, then the aliases."""
    return [*FORMATS, *_ALIASES]


def cache_format(value: torch.dtype | str | CacheFormat, name: str = "cache_dtype"
                 ) -> CacheFormat:
    """The format ``value`` names: a ``CacheFormat``, a name (case-insensitive) or a torch
    dtype (``torch.float8_*``: one scale per layer; ``torch.int8``: int8 per (token, head)).
    InvalidArgumentError naming ``name`` and the accepted values otherwise."""
    if isinstance(value, CacheFormat):
        return value
    if isinstance(value, torch.dtype):
        if value in _BY_DTYPE:
            return FORMATS[_BY_DTYPE[value]]
        hint = " (an int4 cache is stored as uint8: pass 'int4')" if value == torch.uint8 else ""
        raise InvalidArgumentError(
            f"{name} must be one of {', '.join(str(d) for d in _BY_DTYPE)} or a format name "
            f"({', '.join(FORMATS)}), got {value}{hint}")
    if isinstance(value, str):
        key = value.lower().removeprefix("torch.")
        key = _ALIASES.get(key, key)
        if key in FORMATS:
            return FORMATS[key]
    raise InvalidArgumentError(
        f"{name} must be a torch dtype or one of {', '.join(format_names())}, got {value!r}")
