"""Model presets with published KV cache dimensions, and the memory accounting of ``pagedkv size``.

The dimensions are those of each model's Hugging Face ``config.json``: ``num_hidden_layers``,
``num_key_value_heads`` (GQA: fewer than ``num_attention_heads``), ``head_dim`` (or
``hidden_size / num_attention_heads``), ``max_position_embeddings`` and ``torch_dtype``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from pagedkv.cache.spec import KVCacheSpec

__all__ = ["DTYPES", "MODELS", "ModelPreset", "format_bytes", "get_model", "parse_bytes",
           "size_report"]

DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32, "float32": torch.float32,
    "fp16": torch.float16, "float16": torch.float16,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2,
}
"""Names accepted for ``--dtype`` / ``--cache-dtype``; ``fp8`` means e4m3."""


@dataclass(frozen=True, slots=True)
class ModelPreset:
    """The KV-relevant shape of a published model (from its ``config.json``)."""

    name: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    max_len: int  # max_position_embeddings
    dtype: str = "bf16"
    note: str = ""

    def spec(self, block_size: int = 16, cache_dtype: str | None = None) -> KVCacheSpec:
        """The KVCacheSpec of this model's cache."""
        kv = DTYPES[cache_dtype] if cache_dtype else None
        return KVCacheSpec(self.num_layers, self.num_kv_heads, self.head_size, block_size,
                           DTYPES[self.dtype], kv)


MODELS: dict[str, ModelPreset] = {m.name.lower(): m for m in [
    ModelPreset("Llama-3-8B", 32, 32, 8, 128, 8192),
    ModelPreset("Llama-3.1-8B", 32, 32, 8, 128, 131072),
    ModelPreset("Llama-3-70B", 80, 64, 8, 128, 8192),
    ModelPreset("Llama-3.1-405B", 126, 128, 8, 128, 131072),
    ModelPreset("Llama-2-7B", 32, 32, 32, 128, 4096, "fp16", "MHA: no GQA"),
    ModelPreset("Mistral-7B", 32, 32, 8, 128, 32768,
                note="v0.1 attends a 4096-token sliding window; v0.3 does not"),
    ModelPreset("Mixtral-8x7B", 32, 32, 8, 128, 32768),
    ModelPreset("Qwen2.5-7B", 28, 28, 4, 128, 32768,
                note="config.json of the base model: 131072; Instruct: 32768 (131072 with YaRN)"),
    ModelPreset("Gemma-2-9B", 42, 16, 8, 256, 8192,
                note="config.json: float32; every other layer attends a 4096-token sliding "
                     "window, sizes assume full caches on all layers"),
    ModelPreset("OPT-13B", 40, 40, 40, 128, 2048, "fp16", "the vLLM paper's model: 800 KB/token"),
]}


def get_model(name: str) -> ModelPreset:
    """The preset named ``name`` (case-insensitive); ValueError listing the presets otherwise."""
    try:
        return MODELS[name.lower()]
    except KeyError:
        names = ", ".join(m.name for m in MODELS.values())
        raise ValueError(f"unknown model {name!r}; presets: {names}") from None


_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9,
          "gb": 10**9, "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30,
          "tib": 2**40}


def parse_bytes(text: str | int) -> int:
    """Bytes from ``"80GiB"``, ``"1.5 GB"``, ``"512MiB"`` or a number (GB = 10^9, GiB = 2^30)."""
    if isinstance(text, int):
        return text
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot read {text!r} as a size; try 80GiB, 16GB, 512MiB or bytes")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def format_bytes(num: float) -> str:
    """``131072`` -> ``"128 KiB"``: binary units, three significant digits."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(num) < 1024 or unit == "TiB":
            return f"{num:.0f} {unit}" if unit == "B" or num == int(num) else f"{num:.3g} {unit}"
        num /= 1024
    raise AssertionError


def size_report(
    spec: KVCacheSpec, seq_len: int, batch: int = 1, memory: int | None = None
) -> dict[str, int | float]:
    """Byte counts of a KV cache: per token, per block, one sequence, the batch, and what fits in
    ``memory`` bytes (blocks, tokens, sequences of ``seq_len``)."""
    blocks_per_seq = spec.blocks_for_tokens(seq_len)
    report: dict[str, int | float] = {
        "bytes_per_token": spec.bytes_per_token,
        "bytes_per_block": spec.bytes_per_block,
        "bytes_per_seq": spec.kv_cache_bytes(seq_len),
        "kv_cache_bytes": spec.kv_cache_bytes(seq_len, batch),
        "blocks_per_seq": blocks_per_seq,
        "paged_bytes": blocks_per_seq * batch * spec.bytes_per_block,
    }
    if memory is not None:
        blocks = spec.num_blocks_for(memory)
        report |= {"memory_bytes": memory, "blocks_fit": blocks,
                   "tokens_fit": blocks * spec.block_size,
                   "seqs_fit": blocks // blocks_per_seq}
    return report
