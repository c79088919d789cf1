"""Model presets with published KV cache dimensions, and the memory accounting of ``pagedkv size``.

The dimensions are those of each model's Hugging Face ``config.json``: ``num_hidden_layers``,
``num_key_value_heads`` (GQA: fewer than ``num_attention_heads``), ``head_dim`` (or
``hidden_size / num_attention_heads``), ``max_position_embeddings`` and ``torch_dtype``; the
windowed layers those of ``sliding_window`` with ``layer_types`` as transformers derives it
(gpt-oss and Gemma 2: every other layer windowed, from the first; Gemma 3: five of every six,
``sliding_window_pattern`` 6; Mistral 7B v0.1: every layer). The multi-head latent attention
(MLA) presets come from their configs' own keys (``pagedkv.tools.presets_mla``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from pagedkv.cache.spec import KVCacheSpec
from pagedkv.errors import InvalidArgumentError
from pagedkv.serving.parallel import kv_heads_per_rank
from pagedkv.tools.presets_mla import DEEPSEEK_V2_LITE, DEEPSEEK_V3, KIMI_K2, MLAShape
from pagedkv.tools.presets_mla import mla_preset_fields as _mla

__all__ = ["DTYPES", "MODELS", "ModelPreset", "format_bytes", "get_model", "hybrid_report",
           "parse_bytes", "size_report"]

DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32, "float32": torch.float32,
    "fp16": torch.float16, "float16": torch.float16,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2,
}
"""Names accepted for ``--dtype``; ``fp8`` means e4m3. ``--cache-dtype`` takes these and the
quantized formats (``pagedkv.cache.formats``)."""


@dataclass(frozen=True, slots=True)
class ModelPreset:
    """The shape of a published model (from its ``config.json``): its KV cache, and the sizes the
    step cost model needs (parameters, weight bytes, FLOPs per token).

    ``hidden_size``, ``intermediate_size`` and ``vocab_size`` are 0 for a preset that only
    describes a KV cache; the parameter counts then raise ValueError. The counts cover the
    matrices (embeddings, attention q/k/v/o under GQA or MLA's projections, the MLP, lm_head
    unless tied, MoE routers); norms, biases and learned position embeddings (under 0.1% of every
    preset here) are left out. ``gated_mlp``: three MLP matrices (gate, up, down: SwiGLU/GeGLU)
    or two (up, down: OPT's ReLU MLP). Mixture-of-experts presets hold ``num_experts`` routed
    MLPs (of ``moe_intermediate_size``, default ``intermediate_size``) per layer, of which
    ``num_active_experts`` run for each token, plus ``num_shared_experts`` that every token runs;
    the first ``first_dense_layers`` layers hold one MLP of ``intermediate_size`` instead.
    ``weight_dtype``: the dtype the weights ship in, when not ``dtype`` (DeepSeek-V3's fp8).
    ``mla``: multi-head latent attention; the cache is then one latent row per token and layer,
    ``num_kv_heads`` 1 and ``head_size`` its width. ``sliding_window`` (0: none) is the window of
    the windowed layers: all of them when ``full_every`` is 0, else all but every
    ``full_every``-th (layers ``full_every - 1``, ``2 * full_every - 1``, ... attend in full).
    """

    name: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    max_len: int  # max_position_embeddings
    dtype: str = "bf16"
    note: str = ""
    hidden_size: int = 0
    intermediate_size: int = 0
    vocab_size: int = 0
    tied_embeddings: bool = False
    gated_mlp: bool = True
    num_experts: int = 1
    num_active_experts: int = 1
    sliding_window: int = 0
    full_every: int = 0
    moe_intermediate_size: int = 0
    num_shared_experts: int = 0
    first_dense_layers: int = 0
    weight_dtype: str | None = None
    mla: MLAShape | None = None

    def __post_init__(self) -> None:
        if self.mla is not None and (self.num_kv_heads, self.head_size) != (
                1, self.mla.latent_size):
            raise ValueError(f"preset {self.name}: an MLA cache is one head of "
                             f"{self.mla.latent_size}, got {self.num_kv_heads} x {self.head_size}")
        if not 0 <= self.first_dense_layers <= self.num_layers:
            raise ValueError(f"preset {self.name}: first_dense_layers must be in [0, "
                             f"{self.num_layers}], got {self.first_dense_layers}")

    @property
    def layer_windows(self) -> tuple[int | None, ...] | None:
        """Each layer's sliding window (None: full attention); None without windowed layers."""
        if not self.sliding_window:
            return None
        every = self.full_every
        return tuple(None if every and (i + 1) % every == 0 else self.sliding_window
                     for i in range(self.num_layers))

    def spec(self, block_size: int = 16, cache_dtype: str | None = None, tp: int = 1,
             hybrid: bool = False) -> KVCacheSpec:
        """The KVCacheSpec of this model's cache (of one of ``tp`` tensor-parallel ranks):
        every layer attending in full, or with ``hybrid`` its layers' windows (KV cache groups
        paged as the hybrid manager pages them). An MLA latent is the same on every rank.
        ``cache_dtype``: a format name (``pagedkv.cache.formats``; None: the model's dtype)."""
        return KVCacheSpec(self.num_layers, kv_heads_per_rank(self.num_kv_heads, tp),
                           self.head_size, block_size, DTYPES[self.dtype], cache_dtype or None,
                           self.layer_windows if hybrid else None, latent=self.mla is not None)

    def check_tp(self, tp: int) -> None:
        """Raises InvalidArgumentError unless the heads split over ``tp`` ranks."""
        if self.num_heads % tp:
            raise InvalidArgumentError(
                f"tensor parallel size {tp} does not divide the {self.num_heads} attention heads "
                f"of {self.name}")
        kv_heads_per_rank(self.num_kv_heads, tp)

    def _require_dims(self) -> None:
        if not (self.hidden_size and self.intermediate_size and self.vocab_size):
            raise ValueError(f"preset {self.name} has no hidden_size / intermediate_size / "
                             "vocab_size: only its KV cache is described")

    @property
    def embedding_params(self) -> int:
        """The token embedding table (the lm_head has as many, shared when tied)."""
        self._require_dims()
        return self.vocab_size * self.hidden_size

    @property
    def attention_params(self) -> int:
        """q, k, v and o projections of one layer; k and v have ``num_kv_heads`` heads (GQA).
        MLA: q_a and q_b (or q_proj), kv_a_proj_with_mqa, kv_b_proj and o_proj."""
        self._require_dims()
        if self.mla is not None:
            return self.mla.projection_params(self.hidden_size, self.num_heads)
        q_dim, kv_dim = self.num_heads * self.head_size, self.num_kv_heads * self.head_size
        return 2 * self.hidden_size * q_dim + 2 * self.hidden_size * kv_dim

    @property
    def attention_flops_per_key(self) -> int:
        """Attention FLOPs of one query-key pair over all layers: 4 x heads x head_size a layer
        (QK^T and PV); MLA's absorbed form: heads x (2 x 576 + 2 x 512) a layer
        (``MLAShape.absorbed_flops_per_key``)."""
        if self.mla is not None:
            return self.num_layers * self.mla.absorbed_flops_per_key(self.num_heads)
        return 4 * self.num_layers * self.num_heads * self.head_size

    @property
    def expert_params(self) -> int:
        """One MLP (one expert of a mixture) of one layer."""
        self._require_dims()
        width = self.moe_intermediate_size or self.intermediate_size
        return (3 if self.gated_mlp else 2) * self.hidden_size * width

    @property
    def moe_layers(self) -> int:
        """Layers holding a mixture of experts: all but the first dense ones (0 when dense)."""
        return self.num_layers - self.first_dense_layers if self.num_experts > 1 else 0

    @property
    def routed_expert_params(self) -> int:
        """Every routed expert of every layer: the weights a step reads only where routed."""
        return self.moe_layers * self.num_experts * self.expert_params

    def _matmul_params(self, experts: int) -> int:
        """All layers' matrices with ``experts`` routed experts in each mixture."""
        dense = (self.num_layers - self.moe_layers) * (3 if self.gated_mlp else 2) * (
            self.hidden_size * self.intermediate_size)
        moe = self.moe_layers * ((experts + self.num_shared_experts) * self.expert_params
                                 + self.hidden_size * self.num_experts)  # the router
        return self.num_layers * self.attention_params + dense + moe

    @property
    def num_params(self) -> int:
        """All parameters (every expert of a mixture): what the weights take in memory."""
        lm_head = 0 if self.tied_embeddings else self.embedding_params
        return self.embedding_params + lm_head + self._matmul_params(self.num_experts)

    @property
    def active_params(self) -> int:
        """The parameters one token uses: the active and shared experts only (= ``num_params``
        if dense)."""
        lm_head = 0 if self.tied_embeddings else self.embedding_params
        return self.embedding_params + lm_head + self._matmul_params(self.num_active_experts)

    @property
    def activation_size(self) -> int:
        """Bytes of one element of ``dtype`` (hidden states, what the all-reduces move)."""
        return torch.empty((), dtype=DTYPES[self.dtype]).element_size()

    def weight_bytes(self, dtype: str | None = None) -> int:
        """Bytes of all the weights in ``dtype`` (default: ``weight_dtype``, else ``dtype``)."""
        dtype = dtype or self.weight_dtype or self.dtype
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        return self.num_params * torch.empty((), dtype=DTYPES[dtype]).element_size()

    def flops_per_token(self, lm_head: bool = True) -> int:
        """2 x the matmul parameters one token goes through (a multiply and an add each):
        every layer's attention projections and active experts (with the router), plus the
        lm_head when ``lm_head``. The embedding lookup is not a matmul and the attention
        scores depend on the context (``attention_flops_per_key``), so neither is counted
        here. MLA's absorbed form applies kv_b_proj's halves to the query and the output, once
        a token: its parameters count like the others."""
        params = self._matmul_params(self.num_active_experts)
        return 2 * (params + (self.embedding_params if lm_head else 0))


_LLAMA3_8B = {"hidden_size": 4096, "intermediate_size": 14336, "vocab_size": 128256}
_MISTRAL_7B = {"hidden_size": 4096, "intermediate_size": 14336, "vocab_size": 32000}
_GPT_OSS = {"hidden_size": 2880, "intermediate_size": 2880, "vocab_size": 201088,
            "num_active_experts": 4, "sliding_window": 128, "full_every": 2}
_GPT_OSS_NOTE = "MoE weights ship in MXFP4 (sizes here count bf16); attention sinks"
_V3_NOTE = ("256 routed experts, 8 active, 1 shared; weights in fp8 (block scales); the MTP "
            "layer is not counted")

MODELS: dict[str, ModelPreset] = {m.name.lower(): m for m in [
    ModelPreset("Llama-3-8B", 32, 32, 8, 128, 8192, **_LLAMA3_8B),
    ModelPreset("Llama-3.1-8B", 32, 32, 8, 128, 131072, **_LLAMA3_8B),
    ModelPreset("Llama-3-70B", 80, 64, 8, 128, 8192, hidden_size=8192, intermediate_size=28672,
                vocab_size=128256),
    ModelPreset("Llama-3.1-405B", 126, 128, 8, 128, 131072, hidden_size=16384,
                intermediate_size=53248, vocab_size=128256),
    ModelPreset("Llama-2-7B", 32, 32, 32, 128, 4096, "fp16", "MHA: no GQA", hidden_size=4096,
                intermediate_size=11008, vocab_size=32000),
    ModelPreset("Mistral-7B", 32, 32, 8, 128, 32768,
                note="v0.3: no sliding window (v0.1: Mistral-7B-v0.1)", **_MISTRAL_7B),
    ModelPreset("Mistral-7B-v0.1", 32, 32, 8, 128, 32768,
                note="every layer attends a 4096-token sliding window", sliding_window=4096,
                **_MISTRAL_7B),
    ModelPreset("Mixtral-8x7B", 32, 32, 8, 128, 32768,
                note="8 experts, 2 active per token: weights count all 8, FLOPs the 2",
                num_experts=8, num_active_experts=2, **_MISTRAL_7B),
    ModelPreset("Qwen2.5-7B", 28, 28, 4, 128, 32768,
                note="config.json of the base model: 131072; Instruct: 32768 (131072 with YaRN)",
                hidden_size=3584, intermediate_size=18944, vocab_size=152064),
    ModelPreset("Gemma-2-9B", 42, 16, 8, 256, 8192,
                note="config.json: float32; every other layer attends a 4096-token window",
                hidden_size=3584, intermediate_size=14336, vocab_size=256000,
                tied_embeddings=True, sliding_window=4096, full_every=2),
    ModelPreset("Gemma-3-27B", 62, 32, 16, 128, 131072,
                note="text decoder; 5 of every 6 layers attend a 1024-token window",
                hidden_size=5376, intermediate_size=21504, vocab_size=262208,
                tied_embeddings=True, sliding_window=1024, full_every=6),
    ModelPreset("gpt-oss-20b", 24, 64, 8, 64, 131072, note=_GPT_OSS_NOTE, num_experts=32,
                **_GPT_OSS),
    ModelPreset("gpt-oss-120b", 36, 64, 8, 64, 131072, note=_GPT_OSS_NOTE, num_experts=128,
                **_GPT_OSS),
    ModelPreset("OPT-13B", 40, 40, 40, 128, 2048, "fp16",
                "the vLLM paper's model: 800 KB/token; ReLU MLP (2 matrices)", hidden_size=5120,
                intermediate_size=20480, vocab_size=50272, tied_embeddings=True,
                gated_mlp=False),
    ModelPreset("DeepSeek-V2-Lite", **_mla(DEEPSEEK_V2_LITE),
                note="q_proj (no q LoRA); 64 routed experts, 6 active, 2 shared"),
    ModelPreset("DeepSeek-V3", **_mla(DEEPSEEK_V3), weight_dtype="fp8", note=_V3_NOTE),
    ModelPreset("DeepSeek-R1", **_mla(DEEPSEEK_V3), weight_dtype="fp8",
                note="DeepSeek-V3's architecture and config"),
    ModelPreset("Kimi-K2", **_mla(KIMI_K2), weight_dtype="fp8",
                note="Kimi-K2-Instruct; 384 routed experts, 8 active, 1 shared; fp8 weights"),
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


def hybrid_report(spec: KVCacheSpec, seq_len: int, batch: int = 1,
                  memory: int | None = None) -> dict[str, object]:
    """What the hybrid manager holds for a spec with sliding windows (``spec.sliding_windows``):
    its groups, page and, at ``seq_len``, bytes per sequence and per token beside every layer
    attending in full, and the sequences of ``seq_len`` that fit in ``memory``."""
    held = spec.hybrid_kv_bytes(seq_len)
    report: dict[str, object] = {
        "groups": [{"window": g.window, "layers": len(g.layers),
                    "blocks_per_seq": g.blocks_held(seq_len, spec.block_size)}
                   for g in spec.kv_cache_groups],
        "page_layers": spec.page_layers,
        "bytes_per_page": spec.bytes_per_block,
        "hybrid_bytes_per_seq": held,
        "hybrid_bytes_per_token": held / seq_len,
        "full_bytes_per_token": spec.bytes_per_token,
        "batch": batch,
        "hybrid_kv_cache_bytes": held * batch,
    }
    if memory is not None:
        pages = sum(g.blocks_held(seq_len, spec.block_size) for g in spec.kv_cache_groups)
        report["hybrid_seqs_fit"] = spec.num_blocks_for(memory) // pages
    return report


def size_report(
    spec: KVCacheSpec, seq_len: int, batch: int = 1, memory: int | None = None
) -> dict[str, int | float]:
    """Byte counts of a KV cache: per token, per block, one sequence, the batch, and what fits in
    ``memory`` bytes (blocks, tokens, sequences of ``seq_len``); every layer attending in full
    (``hybrid_report``: what the hybrid manager holds with sliding windows)."""
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
