"""The ops of pagedkv, as typed Python functions over ``torch.ops.pagedkv``.

Each op runs the CPU kernels for CPU tensors and the CUDA kernels for CUDA tensors, mutates its
output arguments in place and returns nothing. Fake implementations are registered so that the
ops trace under ``torch.compile(fullgraph=True)``.

Index ranges (slots, block ids) are validated on the host for CPU tensors. For CUDA tensors that
would need a device-to-host copy and a synchronization per call, so it is skipped unless the
environment variable ``PAGEDKV_CHECK_INDICES=1`` is set when the library loads.
"""

from __future__ import annotations

import torch

from pagedkv import _C  # noqa: F401  (registers torch.ops.pagedkv)

__all__ = ["copy_blocks", "reshape_and_cache", "swap_blocks"]


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Writes the K/V of new tokens into their cache slots.

    Parameters
    ----------
    key, value : Tensor
        ``[num_tokens, num_kv_heads, head_size]``, float32 / float16 / bfloat16, last dim
        contiguous (token and head strides are free, e.g. slices of a fused QKV tensor).
    key_cache, value_cache : Tensor
        ``[num_blocks, num_kv_heads, block_size, head_size]`` with a contiguous last dim (an NHD
        permutation or K/V views of one ``[num_blocks, 2, ...]`` tensor work as they are). Same
        dtype as ``key``, or fp8 (``float8_e4m3fn`` / ``float8_e5m2``) with scales.
    slot_mapping : Tensor
        int64 ``[num_tokens]``: ``block_id * block_size + offset``; negative entries are padding.
    k_scale, v_scale : Tensor, optional
        float32, one element, required with fp8 caches: stored = saturate(x / scale).

    Example
    -------
    >>> kc = torch.zeros(4, 2, 16, 64); vc = torch.zeros_like(kc)
    >>> k = torch.randn(3, 2, 64); v = torch.randn(3, 2, 64)
    >>> reshape_and_cache(k, v, kc, vc, torch.tensor([17, 18, -1]))
    """
    torch.ops.pagedkv.reshape_and_cache(
        key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale
    )


def copy_blocks(
    key_caches: list[torch.Tensor], value_caches: list[torch.Tensor], block_mapping: torch.Tensor
) -> None:
    """Copies blocks within each layer's caches, all layers at once (copy-on-write).

    Parameters
    ----------
    key_caches, value_caches : list of Tensor
        One cache per layer, all of one shape, strides, dtype and device.
    block_mapping : Tensor
        int64 ``[num_pairs, 2]`` rows of (src, dst) on the caches' device. Destinations must be
        distinct and must not also be sources (the pairs are copied concurrently).
    """
    torch.ops.pagedkv.copy_blocks(key_caches, value_caches, block_mapping)


def swap_blocks(src: torch.Tensor, dst: torch.Tensor, block_mapping: torch.Tensor) -> None:
    """Copies whole blocks from ``src`` to ``dst``: GPU <-> CPU, or within one device.

    Parameters
    ----------
    src, dst : Tensor
        ``[num_blocks, ...]`` caches of one dtype and one block layout; the block counts may
        differ. Each block must be stored densely. Use pinned CPU memory for asynchronous copies.
    block_mapping : Tensor
        int64 ``[num_pairs, 2]`` rows of (src block, dst block), on the CPU.
    """
    torch.ops.pagedkv.swap_blocks(src, dst, block_mapping)


def register_fakes(namespace: str) -> None:
    """Registers the shape-only implementations of every op in ``torch.ops.<namespace>``."""

    def nothing(*args, **kwargs) -> None:
        return None

    for name in ("reshape_and_cache", "copy_blocks", "swap_blocks", "paged_attention",
                 "merge_attn_states"):
        torch.library.register_fake(f"{namespace}::{name}")(nothing)


register_fakes("pagedkv")
