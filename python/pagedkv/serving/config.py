"""The hyperparameters of the serving model, read from a Hugging Face config."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from pagedkv.cache.spec import KVCacheSpec, check_window
from pagedkv.errors import InvalidArgumentError
from pagedkv.serving.parallel import TensorParallel, kv_heads_per_rank, shard_range

__all__ = ["ModelConfig", "hf_sliding_windows"]


@dataclass(slots=True)
class ModelConfig:
    """The hyperparameters of a Llama decoder (names as in ``transformers.LlamaConfig``).

    ``sliding_windows``: per layer, None (full attention) or the layer's window in tokens, as
    ``paged_attention``'s ``sliding_window`` (a query at p sees the keys after p - W); None
    (the default): every layer attends in full. ``attention_sinks``: every layer's attention
    has a learned sink logit per query head (``Attention.sinks``, gpt-oss).
    """

    vocab_size: int = 256
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # {"rope_type": "llama3", "factor": ..., ...}
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    eos_token_id: int | None = None
    sliding_windows: tuple[int | None, ...] | None = None
    attention_sinks: bool = False

    def __post_init__(self) -> None:
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.sliding_windows is not None:
            windows = self.sliding_windows
            if isinstance(windows, (str, bytes)) or not isinstance(windows, Sequence):
                raise InvalidArgumentError(
                    f"sliding_windows must be one window (None or tokens) per layer, got "
                    f"{windows!r}")
            self.sliding_windows = tuple(check_window(w, f"sliding_windows[{i}]")
                                         for i, w in enumerate(windows))
            if len(self.sliding_windows) != self.num_hidden_layers:
                raise InvalidArgumentError(
                    f"sliding_windows must hold one entry per layer ({self.num_hidden_layers}), "
                    f"got {len(self.sliding_windows)}")
            if all(w is None for w in self.sliding_windows):
                self.sliding_windows = None

    def window(self, layer: int) -> int | None:
        """The sliding window of ``layer`` (None: full attention)."""
        return None if self.sliding_windows is None else self.sliding_windows[layer]

    @classmethod
    def from_hf(cls, config: Any) -> ModelConfig:
        """From a ``transformers.LlamaConfig`` (v5 ``rope_parameters`` or older ``rope_theta``),
        or a config of a Llama with sliding windows (``hf_sliding_windows``): Mistral, Ministral,
        Qwen2-style ``layer_types``."""
        rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
        rope = dict(rope or {})
        theta = rope.pop("rope_theta", getattr(config, "rope_theta", 10000.0))
        scaling = rope if rope.get("rope_type", rope.get("type", "default")) != "default" else None
        eos = config.eos_token_id
        if (act := getattr(config, "hidden_act", "silu")) != "silu":
            raise ValueError(f"only hidden_act='silu' is supported, got {act!r}")
        return cls(
            vocab_size=config.vocab_size, hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_hidden_layers=config.num_hidden_layers,
            num_attention_heads=config.num_attention_heads,
            num_key_value_heads=config.num_key_value_heads or config.num_attention_heads,
            head_dim=getattr(config, "head_dim", None), rms_norm_eps=config.rms_norm_eps,
            rope_theta=float(theta), rope_scaling=scaling,
            max_position_embeddings=config.max_position_embeddings,
            tie_word_embeddings=bool(config.tie_word_embeddings),
            attention_bias=bool(getattr(config, "attention_bias", False)),
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
            eos_token_id=eos[0] if isinstance(eos, list) else eos,
            sliding_windows=hf_sliding_windows(config),
        )

    def kv_cache_spec(self, block_size: int, dtype: torch.dtype = torch.float32,
                      cache_dtype: torch.dtype | str | None = None, tp_size: int = 1
                      ) -> KVCacheSpec:
        """The spec of this model's KV cache (of one rank's heads among ``tp_size``)."""
        return KVCacheSpec(self.num_hidden_layers,
                           kv_heads_per_rank(self.num_key_value_heads, tp_size), self.head_dim,
                           block_size, dtype, cache_dtype, self.sliding_windows)

    def check_tp(self, tp_size: int) -> None:
        """Raises InvalidArgumentError unless the model splits over ``tp_size`` ranks."""
        tp = TensorParallel(0, tp_size)
        shard_range(self.num_attention_heads, tp, "the attention heads")
        shard_range(self.intermediate_size, tp, "intermediate_size")
        kv_heads_per_rank(self.num_key_value_heads, tp_size)


def hf_sliding_windows(config: Any) -> tuple[int | None, ...] | None:
    """Per-layer windows of a Hugging Face config, as its attention masks them: with
    ``layer_types``, ``config.sliding_window`` for the "sliding_attention" layers and None for
    "full_attention"; without, ``sliding_window`` for every layer (Mistral) or none. HF's
    sliding mask keeps ``kv_idx > q_idx - sliding_window`` (``masking_utils``), the kernel's
    window of the same W. None when no layer has a window."""
    window = getattr(config, "sliding_window", None)
    if window is None:
        return None
    kinds = getattr(config, "layer_types", None) or ["sliding_attention"] * config.num_hidden_layers
    unknown = set(kinds) - {"sliding_attention", "full_attention"}
    if unknown:
        raise ValueError(f"unsupported layer types {sorted(unknown)} (sliding or full attention)")
    windows = tuple(window if kind == "sliding_attention" else None for kind in kinds)
    return windows if any(w is not None for w in windows) else None
