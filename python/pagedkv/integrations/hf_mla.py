"""DeepSeek-V3's multi-head latent attention (MLA) over pagedkv's latent cache, for
``TransformersForCausalLM`` (``hf_engine``): DeepSeek-V3/R1, Kimi-K2 and any other
``DeepseekV3ForCausalLM``.

transformers' registered attention functions receive K and V already up-projected per head; a
latent cache holds the compressed row instead, so the attention module's forward is taken over
(``install_latent_attention``). With the module's own projections, norms and weights, and the
model's rotary embedding (the ``position_embeddings`` its decoder passes), each layer

1. projects the query (``q_a_proj`` -> ``q_a_layernorm`` -> ``q_b_proj``, or ``q_proj``) and the
   latent (``kv_a_proj_with_mqa`` -> ``kv_c``, ``k_pe``; ``kv_a_layernorm`` on ``kv_c``), and
   rotates ``q_pe`` and ``k_pe`` as the module does (``config.rope_interleave``);
2. writes ``[kv_c, k_pe]`` at the step's slots (``concat_and_cache_mla``);
3. absorbs ``W_UK`` (``kv_b_proj``'s first ``qk_nope_head_dim`` rows of each head) into
   ``q_nope``: the latent query ``[T, H, kv_lora_rank + rope_dim]``;
4. attends over the paged latents (decode and varlen causal prefill in one call) with the
   module's ``scaling`` (yarn's mscale included), then applies ``W_UV`` (the other
   ``v_head_dim`` rows) per head and ``o_proj``.

A forward without an engine step (``STEP_KWARG``) runs the module's own forward.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention

from pagedkv import ops
from pagedkv.blocks.batch import BatchTensors
from pagedkv.cache.paged_cache import PagedKVCache
from pagedkv.errors import InvalidArgumentError
from pagedkv.integrations.hf import STEP_KWARG

__all__ = ["LATENT_ATTENTION", "install_latent_attention", "is_latent", "latent_width",
           "write_and_attend"]

LATENT_ATTENTION = (DeepseekV3Attention,)
"""The attention modules whose forward ``install_latent_attention`` knows."""


def is_latent(config: Any) -> bool:
    """Whether a decoder config attends through a compressed latent (``kv_lora_rank`` set)."""
    return getattr(config, "kv_lora_rank", None) is not None


def latent_width(config: Any) -> int:
    """Elements of one cached latent row: ``kv_lora_rank + qk_rope_head_dim`` (576 in
    DeepSeek-V3)."""
    return config.kv_lora_rank + config.qk_rope_head_dim


def install_latent_attention(hf_model: nn.Module) -> None:
    """Make every latent attention module of ``hf_model`` attend over the engine's latent cache
    (in place; once per module). Raises InvalidArgumentError, before changing anything, for a
    model with no such module or with an MLA module of another kind."""
    modules = [m for m in hf_model.modules() if hasattr(m, "kv_a_proj_with_mqa")]
    served = [c.__name__ for c in LATENT_ATTENTION]
    others = sorted({type(m).__name__ for m in modules if not isinstance(m, LATENT_ATTENTION)})
    if others or not modules:
        raise InvalidArgumentError(
            f"hf_model: pagedkv serves the latent attention of {served}, the model has "
            f"{others or 'no latent attention module'}")
    for module in modules:
        if getattr(module.forward, "func", None) is not _latent_forward:
            module.forward = functools.partial(_latent_forward, module, module.forward)


def _latent_forward(module: nn.Module, own_forward: Callable, hidden_states: torch.Tensor,
                    position_embeddings: tuple[torch.Tensor, torch.Tensor],
                    attention_mask: torch.Tensor | None = None, **kwargs,
                    ) -> tuple[torch.Tensor, None]:
    """``module``'s attention of ``hidden_states [1, T, hidden]`` (the engine's flat batch) over
    the latent cache of the step in ``kwargs``; returns ``o_proj``'s ``[1, T, hidden]``."""
    step = kwargs.get(STEP_KWARG)
    if not hasattr(step, "_attend_latent"):
        return own_forward(hidden_states, position_embeddings, attention_mask, **kwargs)
    q_nope, q_pe, kv_c, k_pe = _project(module, hidden_states[0], position_embeddings)
    w_uk, w_uv = module.kv_b_proj.weight.view(module.num_heads, -1, module.kv_lora_rank).split(
        [module.qk_nope_head_dim, module.v_head_dim], dim=1)  # [H, nope or v, kv_lora_rank]
    query = torch.cat([torch.einsum("thn,hnr->thr", q_nope, w_uk), q_pe], dim=-1)
    out = step._attend_latent(module.layer_idx, query, kv_c, k_pe, module.scaling)
    out = torch.einsum("thr,hvr->thv", out, w_uv).flatten(1)
    return module.o_proj(out)[None], None


def _project(module: nn.Module, x: torch.Tensor,
             position_embeddings: tuple[torch.Tensor, torch.Tensor],
             ) -> tuple[torch.Tensor, ...]:
    """The module's query and latent of ``x [T, hidden]``: ``q_nope [T, H, qk_nope_head_dim]``,
    rotated ``q_pe [T, H, rope]``, normed ``kv_c [T, kv_lora_rank]``, rotated ``k_pe [T, rope]``."""
    rope = module.qk_rope_head_dim
    q = module.q_proj(x) if module.q_lora_rank is None else module.q_b_proj(
        module.q_a_layernorm(module.q_a_proj(x)))
    q_nope, q_pe = q.view(len(x), module.num_heads, -1).split([module.qk_nope_head_dim, rope],
                                                              dim=-1)
    kv_c, k_pe = module.kv_a_proj_with_mqa(x).split([module.kv_lora_rank, rope], dim=-1)
    q_pe, k_pe = _rotate(module, q_pe, k_pe, position_embeddings)
    return q_nope, q_pe, module.kv_a_layernorm(kv_c), k_pe


def _rotate(module: nn.Module, q_pe: torch.Tensor, k_pe: torch.Tensor,
            position_embeddings: tuple[torch.Tensor, torch.Tensor],
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """``q_pe [T, H, rope]`` and ``k_pe [T, rope]`` rotated by the module's own rotary function
    (its modeling file's, interleaved or not as ``config.rope_interleave`` says)."""
    modeling = sys.modules[type(module).__module__]
    rotate = (modeling.apply_rotary_pos_emb_interleave if module.config.rope_interleave
              else modeling.apply_rotary_pos_emb)
    cos, sin = position_embeddings  # [1, T, rope]
    q_pe, k_pe = rotate(q_pe[None], k_pe[None, :, None], cos, sin, unsqueeze_dim=2)
    return q_pe[0], k_pe[0, :, 0]


def write_and_attend(cache: PagedKVCache, batch: BatchTensors, layer: int, query: torch.Tensor,
                     kv_c: torch.Tensor, k_pe: torch.Tensor, scale: float, kernels: Any,
                     ) -> torch.Tensor:
    """Write the step's latents ``kv_c [T, kv_lora_rank]``, ``k_pe [T, rope_dim]`` of ``layer``
    at the batch's slots, then attend with the latent ``query [T, H, kv_lora_rank + rope_dim]``;
    returns ``[T, H, kv_lora_rank]``."""
    latent = cache.latent(layer)
    kv_scale = cache.k_scales[layer] if cache.k_scales else None
    kernels.concat_and_cache_mla(kv_c, k_pe, latent, batch.slot_mapping, kv_scale)
    out = query.new_empty(*query.shape[:2], kv_c.shape[-1])
    _latent_attention(out, query, latent, batch, scale, kv_scale, kernels)
    return out


def _latent_attention(out: torch.Tensor, query: torch.Tensor, latent: torch.Tensor,
                      batch: BatchTensors, scale: float, kv_scale: torch.Tensor | None,
                      kernels: Any) -> None:
    """The absorbed attention of ``query [T, H, width]`` over ``latent``'s rows into
    ``out [T, H, kv_lora_rank]``: decode, or varlen causal prefill over cached rows, by
    ``kernels``' mla_attention. The CUDA source's MLA kernel (cuda, simt) runs on tensor cores
    and takes 16-bit queries only: float32 CPU tensors attend on the CPU kernels
    (``pagedkv.ops``) whatever ``kernels`` is (a simt run of a float32 model), float32 on a GPU
    is refused by the kernel."""
    cpu_float32 = query.dtype == torch.float32 and query.device.type == "cpu"
    attend = ops if cpu_float32 else kernels
    attend.mla_attention(
        out, query, latent, batch.block_tables, batch.seq_lens,
        batch.query_start_loc if batch.max_query_len > 1 else None, batch.max_seq_len,
        batch.max_query_len, scale, kv_scale, None)
