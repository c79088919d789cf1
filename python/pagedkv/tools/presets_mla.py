"""Multi-head latent attention (MLA) in the model presets: its dimensions, the parameters and
FLOPs of its projections and of its absorbed attention, the latent cache beside the MHA form, and
the published configs of the MLA presets (DeepSeek-V2-Lite, DeepSeek-V3 / R1, Kimi-K2).

An MLA layer (DeepSeek-V2's paper, section 2.1) projects the hidden state ``h`` to

- the query: ``q_a_proj`` (hidden -> ``q_lora_rank``) then ``q_b_proj`` (-> heads x
  ``qk_nope_head_dim + qk_rope_head_dim``), or one ``q_proj`` when ``q_lora_rank`` is null
  (DeepSeek-V2-Lite);
- the latent: ``kv_a_proj_with_mqa`` (hidden -> ``kv_lora_rank + qk_rope_head_dim``): the
  cached row, ``kv_c`` and the rotary key ``k_pe`` shared by all heads;
- ``kv_b_proj`` (``kv_lora_rank`` -> heads x ``qk_nope_head_dim + v_head_dim``): each head's
  non-rotary key and its value from ``kv_c``, and ``o_proj`` (heads x ``v_head_dim`` -> hidden).

Absorbed, ``kv_b_proj``'s key half multiplies the query (``q_nope -> W_UK^T q_nope``, 512 wide)
and its value half the attention output, once per query token: a token's matmul FLOPs stay
2 x the projections' parameters, and attention is multi-query over the 576-wide latent rows:
per head and key, 2 x 576 FLOPs for S = Q K^T and 2 x 512 for O = P V.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["DEEPSEEK_V2_LITE", "DEEPSEEK_V3", "KIMI_K2", "MLAShape", "mla_preset_fields",
           "mla_report"]


@dataclass(frozen=True, slots=True)
class MLAShape:
    """The attention dimensions of an MLA model, named as in its ``config.json``;
    ``q_lora_rank`` 0 stands for null (a plain ``q_proj``)."""

    q_lora_rank: int
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128

    @property
    def latent_size(self) -> int:
        """Elements of a cached row: ``kv_lora_rank + qk_rope_head_dim`` (576)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def qk_head_dim(self) -> int:
        """A head's query and key size in the MHA form: ``qk_nope + qk_rope`` (192)."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def projection_params(self, hidden_size: int, num_heads: int) -> int:
        """One layer's q (q_a and q_b, or q_proj), kv_a_proj_with_mqa, kv_b_proj and o_proj."""
        q_out = num_heads * self.qk_head_dim
        q = (hidden_size * self.q_lora_rank + self.q_lora_rank * q_out if self.q_lora_rank
             else hidden_size * q_out)
        kv_a = hidden_size * self.latent_size
        kv_b = self.kv_lora_rank * num_heads * (self.qk_nope_head_dim + self.v_head_dim)
        return q + kv_a + kv_b + num_heads * self.v_head_dim * hidden_size

    def absorbed_flops_per_key(self, num_heads: int) -> int:
        """One layer's attention FLOPs per query-key pair in the absorbed form:
        ``heads x (2 x latent_size + 2 x kv_lora_rank)`` (S over the whole row, P V over its
        first ``kv_lora_rank`` elements)."""
        return num_heads * (2 * self.latent_size + 2 * self.kv_lora_rank)

    def mha_values_per_token(self, num_heads: int) -> int:
        """Values a token and layer would cache in the MHA (non-absorbed) form: every head's K
        (``qk_head_dim``) and V (``v_head_dim``)."""
        return num_heads * (self.qk_head_dim + self.v_head_dim)


def mla_preset_fields(config: Mapping[str, Any]) -> dict[str, Any]:
    """``ModelPreset``'s keyword arguments (all but the name) from a DeepSeek-V2/V3-style
    ``config.json``: the latent cache as one KV head of ``latent_size``, the routed experts
    (``n_routed_experts``, ``num_experts_per_tok``), the shared ones and the leading dense
    layers (``first_k_dense_replace``; every later layer a mixture, ``moe_layer_freq`` 1)."""
    if (config.get("moe_layer_freq") or 1) != 1:
        raise ValueError(f"moe_layer_freq must be 1, got {config['moe_layer_freq']}")
    mla = MLAShape(config.get("q_lora_rank") or 0, config["kv_lora_rank"],
                   config["qk_nope_head_dim"], config["qk_rope_head_dim"], config["v_head_dim"])
    return {"num_layers": config["num_hidden_layers"], "num_heads": config["num_attention_heads"],
            "num_kv_heads": 1, "head_size": mla.latent_size,
            "max_len": config["max_position_embeddings"], "hidden_size": config["hidden_size"],
            "intermediate_size": config["intermediate_size"],
            "moe_intermediate_size": config["moe_intermediate_size"],
            "vocab_size": config["vocab_size"],
            "tied_embeddings": config.get("tie_word_embeddings", False),
            "num_experts": config["n_routed_experts"],
            "num_active_experts": config["num_experts_per_tok"],
            "num_shared_experts": config["n_shared_experts"],
            "first_dense_layers": config["first_k_dense_replace"], "mla": mla}


def mla_report(num_layers: int, num_heads: int, mla: MLAShape, element_size: int,
               tp: int = 1) -> dict[str, int | float]:
    """One rank's MLA cache per token beside the MHA form's: the latent (replicated on every
    one of ``tp`` ranks) against K and V of the rank's ``num_heads / tp`` heads."""
    latent = num_layers * mla.latent_size * element_size
    heads = num_heads // tp
    mha = num_layers * mla.mha_values_per_token(heads) * element_size
    return {"kv_lora_rank": mla.kv_lora_rank, "rope_dim": mla.qk_rope_head_dim,
            "latent_size": mla.latent_size, "num_heads": num_heads, "heads_per_rank": heads,
            "qk_head_dim": mla.qk_head_dim, "v_head_dim": mla.v_head_dim,
            "latent_bytes_per_token": latent, "mha_bytes_per_token": mha,
            "mha_ratio": mha / latent}


# The published config.json values (Hugging Face: deepseek-ai/DeepSeek-V2-Lite,
# deepseek-ai/DeepSeek-V3 (DeepSeek-R1's is the same), moonshotai/Kimi-K2-Instruct), the keys
# that mla_preset_fields reads.
_MLA = {"kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128}
_V3_SHAPE = {"hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
             "num_hidden_layers": 61, "q_lora_rank": 1536, "n_shared_experts": 1,
             "num_experts_per_tok": 8, "tie_word_embeddings": False, **_MLA}

DEEPSEEK_V2_LITE: dict[str, Any] = {
    "hidden_size": 2048, "intermediate_size": 10944, "moe_intermediate_size": 1408,
    "num_hidden_layers": 27, "num_attention_heads": 16, "q_lora_rank": None,
    "n_routed_experts": 64, "n_shared_experts": 2, "num_experts_per_tok": 6,
    "first_k_dense_replace": 1, "vocab_size": 102400, "max_position_embeddings": 163840,
    "tie_word_embeddings": False, **_MLA}
DEEPSEEK_V3: dict[str, Any] = {
    **_V3_SHAPE, "num_attention_heads": 128, "n_routed_experts": 256,
    "first_k_dense_replace": 3, "vocab_size": 129280, "max_position_embeddings": 163840}
KIMI_K2: dict[str, Any] = {
    **_V3_SHAPE, "num_attention_heads": 64, "n_routed_experts": 384,
    "first_k_dense_replace": 1, "vocab_size": 163840, "max_position_embeddings": 131072}
