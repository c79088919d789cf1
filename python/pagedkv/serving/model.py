"""A Llama-architecture decoder whose attention reads and writes a paged KV cache.

It loads the state dict of a Hugging Face ``LlamaForCausalLM`` (the parameter names are the same)
and computes what that model computes: RMSNorm, rotary embeddings (default or llama3 scaling), GQA
attention, SwiGLU MLP, tied or untied lm_head. Inputs are flat: the query tokens of every sequence
of a batch one after another, ``[num_tokens]``, with their positions. Each layer writes the new
tokens' K/V with ``reshape_and_cache`` and attends with ``paged_attention`` over the blocks of the
``BlockManager`` batch (varlen causal when a sequence has several query tokens, decode otherwise).
``transformers`` is not needed to use it.

With a ``TensorParallel`` of several ranks, each rank's model holds its share of the heads and of
the MLP (``pagedkv.serving.parallel``): ``load_hf_state_dict`` takes the full state dict and keeps
this rank's slices, before any prepacking; o_proj and down_proj outputs are all-reduced.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedkv import ops
from pagedkv.blocks.batch import BatchTensors
from pagedkv.cache.paged_cache import PagedKVCache
from pagedkv.cache.spec import KVCacheSpec
from pagedkv.serving.config import ModelConfig
from pagedkv.serving.layers import RMSNorm, RotaryEmbedding
from pagedkv.serving.linear import LinearGroup, pack_groups
from pagedkv.serving.parallel import TensorParallel, kv_heads_per_rank, shard_range

__all__ = ["LlamaForCausalLM", "ModelConfig", "shard_state_dict"]


@dataclass(frozen=True, slots=True)
class Shard:
    """One rank's slices: query heads, KV heads, MLP columns ([start, end) each)."""

    heads: tuple[int, int]
    kv_heads: tuple[int, int]
    inter: tuple[int, int]
    first: bool

    @classmethod
    def of(cls, config: ModelConfig, tp: TensorParallel) -> Shard:
        config.check_tp(tp.size)
        per_rank = kv_heads_per_rank(config.num_key_value_heads, tp.size)
        kv_start = tp.rank * config.num_key_value_heads // tp.size
        return cls(shard_range(config.num_attention_heads, tp, "the attention heads"),
                   (kv_start, kv_start + per_rank),
                   shard_range(config.intermediate_size, tp, "intermediate_size"), tp.is_first)

    def slice(self, name: str, tensor: torch.Tensor, head_dim: int) -> torch.Tensor:
        """This rank's part of the full parameter ``name`` (a Hugging Face Llama name)."""
        heads = lambda r: slice(r[0] * head_dim, r[1] * head_dim)  # noqa: E731
        column = {"q_proj": heads(self.heads), "k_proj": heads(self.kv_heads),
                  "v_proj": heads(self.kv_heads), "gate_proj": slice(*self.inter),
                  "up_proj": slice(*self.inter)}
        row = {"o_proj": heads(self.heads), "down_proj": slice(*self.inter)}
        parts = name.split(".")
        if parts[-1] == "sinks":  # one per query head
            return tensor[slice(*self.heads)]
        if len(parts) < 2 or parts[-2] not in column | row:
            return tensor
        layer, kind = parts[-2], parts[-1]
        if layer in column:
            return tensor[column[layer]]
        if kind == "bias":  # a row-parallel bias is added once, by rank 0, before the all-reduce
            return tensor if self.first else torch.zeros_like(tensor)
        return tensor[:, row[layer]]


def shard_state_dict(state: Mapping[str, torch.Tensor], config: ModelConfig,
                     tp: TensorParallel) -> dict[str, torch.Tensor]:
    """Rank ``tp.rank``'s slices of a full Llama state dict (q/k/v, gate/up by output rows;
    o_proj, down_proj by input columns; everything else replicated)."""
    shard = Shard.of(config, tp)
    return {name: shard.slice(name, t, config.head_dim) for name, t in state.items()}


class Attention(nn.Module):
    """GQA self-attention over the paged cache of one layer: it writes and reads with its KV
    cache group's slot mapping and block tables (``batch.group_*[group]``), attends within its
    sliding window (``window``, None: full), with its sinks (float32 ``[num_heads]``, or None);
    over a shared-prefix plan (``batch.group_cascades[group]``) when the batch has one."""

    kernels: Any = ops  # pagedkv.ops, or a torch.ops namespace with the same schemas

    def __init__(self, config: ModelConfig, layer: int, tp: TensorParallel) -> None:
        super().__init__()
        self.layer, self.tp = layer, tp
        shard = Shard.of(config, tp)
        self.num_heads = shard.heads[1] - shard.heads[0]
        self.num_kv_heads = shard.kv_heads[1] - shard.kv_heads[0]
        self.head_dim = config.head_dim
        self.scale = self.head_dim**-0.5
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, q_size, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, kv_size, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, kv_size, bias=bias)
        self.o_proj = nn.Linear(q_size, config.hidden_size, bias=bias)
        self.qkv = LinearGroup(self.q_proj, self.k_proj, self.v_proj)
        self.out = LinearGroup(self.o_proj)
        self.window = config.window(layer)
        self.group = config.kv_cache_spec(1, tp_size=tp.size).page_slot(layer)[0]
        self.sinks = (nn.Parameter(torch.zeros(self.num_heads, dtype=torch.float32))
                      if config.attention_sinks else None)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding,
                cache: PagedKVCache, batch: BatchTensors) -> torch.Tensor:
        """x ``[T, hidden]`` -> ``[T, hidden]``; writes the T tokens' K/V to their slots."""
        n = x.shape[0]
        q, k, v = self.qkv(x)
        q = q.view(n, self.num_heads, self.head_dim)
        k = k.view(n, self.num_kv_heads, self.head_dim)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        q, k = rotary(positions, q, k)
        layer = cache.layer_args(self.layer)  # K/V caches and their scales, if any
        kernels = self.kernels
        kernels.reshape_and_cache(key=k, value=v,
                                  slot_mapping=batch.group_slot_mappings[self.group], **layer)
        out = torch.empty_like(q)
        cascade = batch.group_cascades[self.group] if batch.group_cascades else None
        if cascade is not None and self.window is None:  # shared blocks read once per group
            cascade.attention(out, q, scale=self.scale, sinks=self._sinks(), kernels=kernels,
                              **layer)
            return self.tp.all_reduce(self.out(out.view(n, -1))[0])
        kernels.paged_attention(
            out=out, query=q, block_tables=batch.group_block_tables[self.group],
            seq_lens=batch.seq_lens,
            query_start_loc=batch.query_start_loc if batch.max_query_len > 1 else None,
            max_seq_len=batch.max_seq_len, max_query_len=batch.max_query_len, scale=self.scale,
            alibi_slopes=None, sliding_window=-1 if self.window is None else self.window,
            soft_cap=0.0, lse_out=None, sinks=self._sinks(), **layer)
        return self.tp.all_reduce(self.out(out.view(n, -1))[0])

    def _sinks(self) -> torch.Tensor | None:
        """The sinks in float32, as the kernel takes them (the model may be in another dtype)."""
        return None if self.sinks is None else self.sinks.float()


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: ModelConfig, tp: TensorParallel) -> None:
        super().__init__()
        self.tp = tp
        hidden, bias = config.hidden_size, config.mlp_bias
        inter = config.intermediate_size // tp.size
        self.gate_proj = nn.Linear(hidden, inter, bias=bias)
        self.up_proj = nn.Linear(hidden, inter, bias=bias)
        self.down_proj = nn.Linear(inter, hidden, bias=bias)
        self.gate_up = LinearGroup(self.gate_proj, self.up_proj)
        self.down = LinearGroup(self.down_proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x)
        return self.tp.all_reduce(self.down(F.silu(gate) * up)[0])


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, tp: TensorParallel) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer, tp)
        self.mlp = MLP(config, tp)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding,
                cache: PagedKVCache, batch: BatchTensors) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), positions, rotary, cache, batch)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallel) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i, tp)
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: PagedKVCache,
                batch: BatchTensors) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x, positions, self.rotary_emb, cache, batch)
        return self.norm(x)


class LlamaForCausalLM(nn.Module):
    """Llama decoder over a paged KV cache, with Hugging Face's parameter names.

    Example
    -------
    >>> model = LlamaForCausalLM.from_hf(hf_model)      # a transformers LlamaForCausalLM
    >>> cache = PagedKVCache(model.config.kv_cache_spec(16), num_blocks=64)
    >>> manager = BlockManager(cache.num_blocks, cache.spec.block_size)
    >>> manager.add_sequence(0, prompt)
    >>> batch = manager.build_batch([0], len(prompt))  # no plan to run: nothing was copied
    >>> logits = model(torch.tensor(prompt), torch.arange(len(prompt)), cache, batch)

    ``tp``: this rank's place among tensor-parallel ranks (default: one rank, the whole model).
    Raises InvalidArgumentError when the heads or the MLP do not split over ``tp.size`` ranks.
    """

    def __init__(self, config: ModelConfig, tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.config = config
        self.tp = tp or TensorParallel()
        self.model = LlamaModel(config, self.tp)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.head = LinearGroup(self.lm_head)

    @classmethod
    def from_hf(cls, hf_model: nn.Module, dtype: torch.dtype | None = None,
                tp: TensorParallel | None = None) -> LlamaForCausalLM:
        """The same model as a ``transformers.LlamaForCausalLM``, with a copy of its weights
        (of this rank's share with ``tp``)."""
        model = cls(ModelConfig.from_hf(hf_model.config), tp)
        model.load_hf_state_dict(hf_model.state_dict())
        param = next(hf_model.parameters())
        return model.to(device=param.device, dtype=dtype or param.dtype).eval()

    def kv_cache_spec(self, block_size: int, dtype: torch.dtype,
                      cache_dtype: torch.dtype | str | None = None) -> KVCacheSpec:
        """The spec of this rank's KV cache (its KV heads)."""
        return self.config.kv_cache_spec(block_size, dtype, cache_dtype, self.tp.size)

    def use_kernels(self, kernels: Any) -> LlamaForCausalLM:
        """Run the cache ops from ``kernels``: ``pagedkv.ops`` (default) or a ``torch.ops``
        namespace with pagedkv's schemas, e.g. ``pagedkv.ops.simt.ops`` (the CUDA kernel source
        emulated on the CPU)."""
        for module in self.modules():
            if isinstance(module, Attention):
                module.kernels = kernels
        return self

    def linear_groups(self) -> list[LinearGroup]:
        """Every linear layer of the model, in the groups that share an input (q/k/v, o,
        gate/up, down per layer, then lm_head)."""
        groups = []
        for layer in self.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            groups += [attn.qkv, attn.out, mlp.gate_up, mlp.down]
        return groups + [self.head]

    def prepack(self, dtype: torch.dtype | None = None) -> LlamaForCausalLM:
        """Run the linear layers through oneDNN with prepacked weights (CPU only).

        Each group of layers that reads one input (q/k/v, gate/up) becomes one matmul over a
        copy of its concatenated weights, reordered once into oneDNN's blocked layout. ``dtype``
        (default: the weights') is the dtype the matmuls compute in: float32, or bfloat16 where
        the CPU has native bfloat16 arithmetic (``pagedkv.serving.linear.onednn_dtypes``).
        The parameters stay as they are (state dicts, ``.to``); a copy is packed again when its
        weights change. Costs one more copy of the weights in memory. Returns the model.

        Raises InvalidArgumentError, packing nothing, on another device or an unsupported dtype.
        """
        pack_groups(self.linear_groups(), dtype or next(self.parameters()).dtype)
        return self

    def unpack(self) -> LlamaForCausalLM:
        """Back to ``F.linear`` (drops the packed copies). Returns the model."""
        pack_groups(self.linear_groups(), None)
        return self

    @property
    def packed_dtype(self) -> torch.dtype | None:
        """The dtype of the prepacked linears (None: ``F.linear``)."""
        return self.head.dtype

    def load_hf_state_dict(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Load a Hugging Face ``LlamaForCausalLM`` state dict (``lm_head`` optional if tied),
        full-size: with several tensor-parallel ranks this rank keeps its slices."""
        state = {k: v for k, v in state_dict.items() if not k.endswith("rotary_emb.inv_freq")}
        if self.config.tie_word_embeddings:
            state["lm_head.weight"] = state["model.embed_tokens.weight"]
        if self.tp.size > 1:
            state = shard_state_dict(state, self.config, self.tp)
        self.load_state_dict(state, strict=True)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: PagedKVCache,
                batch: BatchTensors, logits_indices: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``[len(logits_indices) or T, vocab]`` of the query tokens.

        input_ids, positions: int64 ``[T]``, the query tokens of ``batch`` in its order.
        logits_indices: which of the T tokens need logits (e.g. the last of each sequence).
        """
        hidden = self.model(input_ids, positions, cache, batch)
        if logits_indices is not None:
            hidden = hidden[logits_indices]
        return self.head(hidden)[0]

