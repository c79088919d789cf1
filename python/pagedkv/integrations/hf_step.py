"""One forward of ``PagedCache`` (``pagedkv.integrations.hf``) in the paged ops' terms: which
columns of the batch are real tokens, where the computed query tokens sit in the flat rows x
columns, and each layer's attention options as the kernel takes them. Free of transformers."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedkv.blocks.batch import BatchTensors

__all__ = ["LayerOptions", "Step", "query_index", "real_tokens"]


def real_tokens(input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                ) -> tuple[torch.Tensor, list[list[int]]]:
    """Which columns of ``input_ids [rows, columns]`` are real (bool, CPU) and each row's real
    token ids, from ``attention_mask [rows, past + columns]`` (None: all real)."""
    rows, columns = input_ids.shape
    real = torch.ones(rows, columns, dtype=torch.bool)
    if attention_mask is not None:
        if attention_mask.dim() != 2 or attention_mask.shape[0] != rows:
            raise ValueError(f"PagedCache takes a 2D attention_mask [{rows}, past + {columns}], "
                             f"got shape {tuple(attention_mask.shape)}")
        real = attention_mask[:, -columns:].bool().cpu()
    ids = input_ids.cpu()
    tokens = [ids[row][real[row]].tolist() for row in range(rows)]
    if not all(tokens):
        empty = next(row for row, t in enumerate(tokens) if not t)
        raise ValueError(f"attention_mask gives row {empty} no token in this forward")
    return real, tokens


def query_index(real: torch.Tensor, cached: list[int], device: torch.device,
                ) -> torch.Tensor | None:
    """The flat positions (rows x columns) of the tokens to compute: real and not found in the
    prefix cache (a row's first ``cached[row]`` real tokens). None when that is all of them."""
    computed = real.clone()
    for row, num_cached in enumerate(cached):
        computed[row, real[row].nonzero()[:num_cached, 0]] = False
    return None if computed.all() else computed.flatten().nonzero()[:, 0].to(device)


@dataclass(slots=True)
class Step:
    """One forward's batch: the query tokens of every row, as the paged ops take them."""

    batch: BatchTensors
    shape: tuple[int, int]  # (rows, columns) of the forward's input
    index: torch.Tensor | None  # [num_query_tokens] into the flat rows x columns; None: all

    def tokens(self, states: torch.Tensor) -> torch.Tensor:
        """``[rows, heads, columns, head_size]`` -> ``[num_query_tokens, heads, head_size]``."""
        flat = states.transpose(1, 2).reshape(-1, states.shape[1], states.shape[-1])
        return flat if self.index is None else flat[self.index]

    def scatter(self, out: torch.Tensor) -> torch.Tensor:
        """``[num_query_tokens, heads, head_size]`` -> ``[rows, columns, heads, head_size]``;
        padding and prefix-cache hits (not computed) get zeros."""
        if self.index is not None:
            full = out.new_zeros(self.shape[0] * self.shape[1], *out.shape[1:])
            out = full.index_copy_(0, self.index, out)
        return out.view(*self.shape, *out.shape[1:])


@dataclass(frozen=True, slots=True)
class LayerOptions:
    """One layer's attention in the kernel's terms, from transformers' attention keywords.

    ``sliding_window`` W: transformers lets a query at column q see keys k with ``k > q - W``
    (``masking_utils.sliding_window_overlay``; ``DynamicSlidingWindowLayer`` keeps the last
    W - 1 keys besides the query's own), W keys with its own; the kernel's window counts the
    same way (``p - sliding_window < key_pos <= p``), so W passes unchanged. The kernel counts
    the row's stored (real) tokens, transformers its columns: the same distances under left
    padding; padding between real tokens would count in transformers' window only.
    ``softcap``: the kernel's ``soft_cap``, applied after the scale as in Gemma 2's eager
    attention. ``s_aux``: the sinks, ``[num_heads]`` logits of a zero-valued key (gpt-oss), in
    float32 for the kernel.
    """

    scale: float
    sliding_window: int = -1
    soft_cap: float = 0.0
    sinks: torch.Tensor | None = None

    @classmethod
    def of(cls, query: torch.Tensor, scaling: float | None, kwargs: dict) -> LayerOptions:
        window, cap, sinks = (kwargs.get(k) for k in ("sliding_window", "softcap", "s_aux"))
        if window is not None and (isinstance(window, bool) or not isinstance(window, int)
                                   or window < 1):
            raise ValueError(f"sliding_window must be a positive int or None, got {window!r}")
        if cap is not None and not cap > 0:
            raise ValueError(f"softcap must be positive or None, got {cap!r}")
        return cls(scaling if scaling is not None else query.shape[-1] ** -0.5,
                   -1 if window is None else window, 0.0 if cap is None else float(cap),
                   None if sinks is None else sinks.detach().to(torch.float32).contiguous())
