"""Pure PyTorch versions of every op: slow, obvious, and the oracle of the tests.

Each function has the semantics of the op of the same name in :mod:`pagedkv.ops`, works on any
device, and is written for clarity rather than speed.
"""

from __future__ import annotations

import torch

__all__ = [
    "copy_blocks",
    "dequantize",
    "gather_kv",
    "quantize",
    "reshape_and_cache",
    "swap_blocks",
]

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def quantize(x: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor | None) -> torch.Tensor:
    """Converts ``x`` to a cache dtype; fp8 divides by ``scale`` and saturates."""
    if dtype not in FP8_DTYPES:
        return x.to(dtype)
    limit = torch.finfo(dtype).max
    return (x.float() / scale.float()).clamp(-limit, limit).to(dtype)


def dequantize(x: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """Cache elements as float32; fp8 multiplies by ``scale``."""
    if x.dtype not in FP8_DTYPES:
        return x.float()
    return x.float() * scale.float()


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Writes ``key[i]``/``value[i]`` to slot ``slot_mapping[i]``; negative slots are skipped."""
    block_size = key_cache.shape[2]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    blocks, offsets = slots // block_size, slots % block_size
    key_cache[blocks, :, offsets] = quantize(key[keep], key_cache.dtype, k_scale)
    value_cache[blocks, :, offsets] = quantize(value[keep], value_cache.dtype, v_scale)


def copy_blocks(
    key_caches: list[torch.Tensor], value_caches: list[torch.Tensor], block_mapping: torch.Tensor
) -> None:
    """Copies block ``src`` to block ``dst`` for every (src, dst) row, in every layer."""
    for src, dst in block_mapping.tolist():
        for cache in (*key_caches, *value_caches):
            cache[dst] = cache[src]


def swap_blocks(src: torch.Tensor, dst: torch.Tensor, block_mapping: torch.Tensor) -> None:
    """Copies ``src[s]`` to ``dst[d]`` for every (s, d) row, across devices if needed."""
    for s, d in block_mapping.tolist():
        dst[d] = src[s].to(dst.device)


def gather_kv(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_len: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reads one sequence's K/V back through its block table.

    Returns two ``[seq_len, num_kv_heads, head_size]`` tensors in the cache dtype.
    """
    block_size = key_cache.shape[2]
    positions = torch.arange(seq_len, device=key_cache.device)
    blocks = block_table.to(key_cache.device).long()[positions // block_size]
    offsets = positions % block_size
    return key_cache[blocks, :, offsets], value_cache[blocks, :, offsets]
