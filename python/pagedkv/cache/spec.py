"""KVCacheSpec: the shape and dtypes of a model's KV cache, and the sizes that follow from them."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedkv import checks

__all__ = ["CACHE_DTYPES", "FP8_DTYPES", "KVCacheSpec"]

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
CACHE_DTYPES = (torch.float32, torch.float16, torch.bfloat16, *FP8_DTYPES)


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    """Shape and dtypes of a paged KV cache.

    Per layer, K and V are each ``[num_blocks, num_kv_heads, block_size, head_size]``.

    Args:
        num_layers: attention layers that own a KV cache.
        num_kv_heads: key/value heads per layer (fewer than query heads under GQA/MQA).
        head_size: elements per head.
        block_size: tokens per block.
        dtype: the model's activation dtype (what ``reshape_and_cache`` receives).
        cache_dtype: the dtype stored in the cache; ``None`` means the same as ``dtype``.
            fp8 caches carry float32 ``k_scale``/``v_scale`` per layer.

    Example:
        >>> spec = KVCacheSpec(32, 8, 128, 16, torch.bfloat16)
        >>> spec.bytes_per_token  # 2 (K and V) x 32 x 8 x 128 x 2 bytes
        131072
    """

    num_layers: int
    num_kv_heads: int
    head_size: int
    block_size: int
    dtype: torch.dtype = torch.float16
    cache_dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_size", "block_size"):
            value = checks.positive(getattr(self, name), f"KVCacheSpec.{name}", checks.INT32_MAX)
            object.__setattr__(self, name, value)  # a numpy or 0-d tensor int as a Python int
        if self.kv_dtype not in CACHE_DTYPES:
            names = ", ".join(str(d) for d in CACHE_DTYPES)
            raise ValueError(f"KVCacheSpec cache dtype {self.kv_dtype} is not one of {names}")

    @property
    def kv_dtype(self) -> torch.dtype:
        """The dtype stored in the cache (``cache_dtype``, or ``dtype`` when that is None)."""
        return self.dtype if self.cache_dtype is None else self.cache_dtype

    @property
    def is_fp8(self) -> bool:
        """True when the cache stores fp8 and needs k/v scales."""
        return self.kv_dtype in FP8_DTYPES

    @property
    def element_size(self) -> int:
        """Bytes per cached element."""
        return torch.empty((), dtype=self.kv_dtype).element_size()

    @property
    def block_shape(self) -> tuple[int, int, int]:
        """``(num_kv_heads, block_size, head_size)``: one block of one layer's K (or V)."""
        return (self.num_kv_heads, self.block_size, self.head_size)

    @property
    def bytes_per_token(self) -> int:
        """Bytes of K and V for one token over all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_size * self.element_size

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block over all layers, K and V."""
        return self.bytes_per_token * self.block_size

    def kv_cache_bytes(self, seq_len: int, batch: int = 1) -> int:
        """Contiguous cache bytes: 2 x layers x kv_heads x head_size x seq_len x batch x bytes."""
        return self.bytes_per_token * seq_len * batch

    def blocks_for_tokens(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens of one sequence."""
        return -(-num_tokens // self.block_size)

    def num_blocks_for(self, memory_bytes: int) -> int:
        """How many whole blocks (all layers, K and V) fit in ``memory_bytes``."""
        return max(0, int(memory_bytes) // self.bytes_per_block)
