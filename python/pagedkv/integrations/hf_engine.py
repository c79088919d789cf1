"""A transformers causal LM as the model of ``LLMEngine``::

    from pagedkv.integrations.hf_engine import TransformersForCausalLM

    engine = LLMEngine(TransformersForCausalLM(hf_model), EngineConfig(num_blocks=1024))
    outputs = engine.generate(prompts, SamplingParams(max_tokens=32))

The model's own modules compute everything but attention: gpt-oss's mixture of experts and
attention biases, Gemma's norms, embedding scale, per-layer rotary bases and logit caps, and any
other decoder transformers implements. Its attention is the "pagedkv" attention over the
engine's cache: each layer writes its new K/V with ``reshape_and_cache`` and attends with
``paged_attention`` through the block tables of its KV cache group, with the layer's sliding
window, soft cap and sinks (``hf_step.LayerOptions``). The engine's batch is one flat row of
``[num_tokens]`` query tokens with their positions, so no mask is built.

The per-layer windows come from the config (``hf_sliding_windows``): they decide which blocks
the hybrid block manager frees, so a layer whose attention asks for another window than its
config says is refused at its first step rather than read through freed blocks.

A model with multi-head latent attention (``DeepseekV3ForCausalLM``: DeepSeek-V3/R1, Kimi-K2)
gets a latent cache, one ``kv_lora_rank + rope_dim`` row per token and layer, and its attention
modules' forward is taken over by ``hf_mla`` (absorbed MLA over the paged latents).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pagedkv import ops
from pagedkv.blocks.batch import BatchTensors
from pagedkv.cache.paged_cache import PagedKVCache
from pagedkv.cache.spec import KVCacheSpec
from pagedkv.errors import InvalidArgumentError
from pagedkv.integrations import hf_mla
from pagedkv.integrations.hf import ATTENTION, STEP_KWARG
from pagedkv.integrations.hf_step import LayerOptions
from pagedkv.serving.config import hf_sliding_windows
from pagedkv.serving.parallel import TensorParallel

__all__ = ["ServedConfig", "TransformersForCausalLM", "random_causal_lm"]


@dataclass(frozen=True, slots=True)
class ServedConfig:
    """What the engine reads of a model's config."""

    vocab_size: int
    max_position_embeddings: int | None
    eos_token_id: int | None


class TransformersForCausalLM(nn.Module):
    """A ``transformers`` causal LM (``...ForCausalLM``) over pagedkv's paged KV cache.

    Args:
        hf_model: the model; it is switched to ``attn_implementation="pagedkv"`` in place (a
            ``PagedCache`` can still drive it in ``generate``). Its first parameter gives the
            dtype and device of the cache.

    One rank only (``tp``: no tensor parallelism). The first of several ``eos_token_id``s is
    the engine's end of sequence, as in ``ModelConfig.from_hf``.

    Raises InvalidArgumentError for a model without a decoder config, with a bidirectional
    config, with layer types other than full and sliding attention, or with latent attention
    of another kind than ``hf_mla.LATENT_ATTENTION``.
    """

    kernels: Any = ops  # pagedkv.ops, or a torch.ops namespace with the same schemas

    def __init__(self, hf_model: nn.Module) -> None:
        super().__init__()
        config = getattr(hf_model, "config", None)
        if config is None or not hasattr(config, "get_text_config"):
            raise InvalidArgumentError(
                f"hf_model must be a transformers model, got {type(hf_model).__name__}")
        text = config.get_text_config(decoder=True)
        if not getattr(text, "is_causal", True) or getattr(
                text, "use_bidirectional_attention", False):
            raise InvalidArgumentError("hf_model attends bidirectionally; pagedkv's is causal")
        try:
            self.windows = hf_sliding_windows(text)
        except ValueError as error:
            raise InvalidArgumentError(f"hf_model: {error}") from None
        self.latent = hf_mla.is_latent(text)
        if self.latent:
            hf_mla.install_latent_attention(hf_model)
        self.hf = hf_model.eval()
        self.hf.set_attn_implementation(ATTENTION)
        self.tp = TensorParallel()
        eos = text.eos_token_id
        self.config = ServedConfig(text.vocab_size,
                                   getattr(text, "max_position_embeddings", None),
                                   eos[0] if isinstance(eos, list) else eos)
        self.num_layers = text.num_hidden_layers
        self.num_kv_heads = 1 if self.latent else (
            text.num_key_value_heads or text.num_attention_heads)
        self.head_size = hf_mla.latent_width(text) if self.latent else (
            getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads)

    def kv_cache_spec(self, block_size: int, dtype: torch.dtype,
                      cache_dtype: torch.dtype | str | None = None) -> KVCacheSpec:
        """The spec of the model's KV cache: one layer per decoder layer, its window from the
        config; a latent spec (one ``kv_lora_rank + rope_dim`` row a token) for MLA models."""
        return KVCacheSpec(self.num_layers, self.num_kv_heads, self.head_size, block_size, dtype,
                           cache_dtype, self.windows, latent=self.latent)

    def use_kernels(self, kernels: Any) -> TransformersForCausalLM:
        """Run the cache ops from ``kernels``: ``pagedkv.ops`` (default) or a ``torch.ops``
        namespace with pagedkv's schemas, e.g. ``pagedkv.ops.simt.ops``. Returns the model."""
        self.kernels = kernels
        return self

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: PagedKVCache,
                batch: BatchTensors, logits_indices: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``[len(logits_indices) or T, vocab]`` of the query tokens, as
        ``LlamaForCausalLM.forward`` (input_ids, positions: int64 ``[T]`` in batch order)."""
        step = EngineStep(self, cache, batch)
        out = self.hf(input_ids=input_ids[None], position_ids=positions[None], use_cache=False,
                      logits_to_keep=0 if logits_indices is None else logits_indices,
                      **{STEP_KWARG: step})
        return out.logits[0]


@dataclass(slots=True)
class EngineStep:
    """One engine step as the "pagedkv" attention reads it: the cache and the batch."""

    model: TransformersForCausalLM
    cache: PagedKVCache
    batch: BatchTensors

    def _attend(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                options: LayerOptions) -> torch.Tensor:
        """Write the step's K/V ``[1, kv_heads, T, head_size]`` of ``layer``, attend with
        ``query [1, heads, T, head_size]``; returns ``[1, T, heads, head_size]``."""
        window = self.model.windows[layer] if self.model.windows else None
        if options.sliding_window != (-1 if window is None else window):
            raise RuntimeError(
                f"layer {layer} attends with sliding_window {options.sliding_window}, but its "
                f"config gives {window} (the window the block manager frees blocks by)")
        spec, batch, kernels = self.cache.spec, self.batch, self.model.kernels
        group = spec.page_slot(layer)[0]
        q, k, v = (x[0].transpose(0, 1).contiguous() for x in (query, key, value))
        cache = self.cache.layer_args(layer)  # K/V caches and their scales, if any
        kernels.reshape_and_cache(key=k, value=v, slot_mapping=batch.group_slot_mappings[group],
                                  **cache)
        out = torch.empty_like(q)
        kernels.paged_attention(
            out=out, query=q, block_tables=batch.group_block_tables[group],
            seq_lens=batch.seq_lens,
            query_start_loc=batch.query_start_loc if batch.max_query_len > 1 else None,
            max_seq_len=batch.max_seq_len, max_query_len=batch.max_query_len,
            scale=options.scale, alibi_slopes=None, sliding_window=options.sliding_window,
            soft_cap=options.soft_cap, lse_out=None, sinks=options.sinks, **cache)
        return out[None]

    def _attend_latent(self, layer: int, query: torch.Tensor, kv_c: torch.Tensor,
                       k_pe: torch.Tensor, scale: float) -> torch.Tensor:
        """MLA (``hf_mla``): write ``layer``'s latents, attend with the latent query; returns
        ``[T, heads, kv_lora_rank]``."""
        return hf_mla.write_and_attend(self.cache, self.batch, layer, query, kv_c, k_pe,
                                       scale, self.model.kernels)


def random_causal_lm(config_class: str, seed: int = 0, **config: Any) -> TransformersForCausalLM:
    """A transformers causal LM of the config ``transformers.<config_class>(**config)`` with
    seeded random weights (transformers' own initialization), as an ``LLMEngine`` model: a
    model to serve with no download (``pagedkv demo --model deepseek``)."""
    import transformers

    torch.manual_seed(seed)
    hf_config = getattr(transformers, config_class)(**config)
    return TransformersForCausalLM(transformers.AutoModelForCausalLM.from_config(hf_config))
