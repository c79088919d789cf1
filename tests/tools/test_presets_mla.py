"""The MLA presets (DeepSeek-V2-Lite, DeepSeek-V3 / R1, Kimi-K2): their latent cache, parameter
counts against hand-computed expressions, transformers' modules and the published totals, and the
roofline's absorbed-MLA attention FLOPs and latent bytes."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pagedkv.serving.scheduler import StepShape
from pagedkv.tools.costmodel import DevicePreset, RooflineModel, get_device
from pagedkv.tools.presets import ModelPreset, get_model
from pagedkv.tools.presets_mla import DEEPSEEK_V3, MLAShape, mla_preset_fields, mla_report

GIB = 2**30
MLA_PRESETS = ("DeepSeek-V2-Lite", "DeepSeek-V3", "DeepSeek-R1", "Kimi-K2")
TINY = MLAShape(q_lora_rank=8, kv_lora_rank=16, qk_nope_head_dim=6, qk_rope_head_dim=4,
                v_head_dim=5)


def tiny_preset(**kwargs) -> ModelPreset:
    """2 layers of 4 heads over a 20-wide latent (16 + 4), hidden 32, a dense MLP of 48."""
    return ModelPreset("tiny-mla", 2, 4, 1, 20, 1024, hidden_size=32, intermediate_size=48,
                       vocab_size=64, mla=TINY, **kwargs)


def test_mla_shape_arithmetic_by_hand():
    assert (TINY.latent_size, TINY.qk_head_dim) == (20, 10)
    # q_a 32 -> 8, q_b 8 -> 4 x 10, kv_a 32 -> 20, kv_b 16 -> 4 x (6 + 5), o 4 x 5 -> 32
    assert TINY.projection_params(32, 4) == 32 * 8 + 8 * 40 + 32 * 20 + 16 * 44 + 20 * 32 == 2560
    no_q_lora = dataclasses.replace(TINY, q_lora_rank=0)  # q_proj 32 -> 4 x 10
    assert no_q_lora.projection_params(32, 4) == 32 * 40 + 32 * 20 + 16 * 44 + 20 * 32
    assert TINY.absorbed_flops_per_key(4) == 4 * (2 * 20 + 2 * 16) == 288
    assert TINY.mha_values_per_token(4) == 4 * (10 + 5)


@pytest.mark.parametrize("name", MLA_PRESETS)
def test_mla_presets_cache_one_576_row_per_token_and_layer(name):
    model = get_model(name)
    spec = model.spec(block_size=64)
    assert spec.latent and spec.tensors_per_layer == 1 and spec.num_kv_heads == 1
    assert spec.block_shape == (64, 576)
    assert spec.bytes_per_token == model.num_layers * 576 * 2
    assert spec.bytes_per_block == model.num_layers * 576 * 2 * 64
    assert model.spec(cache_dtype="fp8").bytes_per_token == model.num_layers * 576
    assert model.spec(tp=8).bytes_per_token == spec.bytes_per_token  # replicated, not split
    assert model.spec(hybrid=True).sliding_windows is None


def test_deepseek_v3_counts_by_hand():
    v3 = get_model("DeepSeek-V3")
    attention = (7168 * 1536 + 1536 * 128 * 192 + 7168 * 576 + 512 * 128 * 256
                 + 128 * 128 * 7168)
    assert v3.attention_params == attention == 187_105_280
    expert, dense = 3 * 7168 * 2048, 3 * 7168 * 18432
    router = 7168 * 256
    embeddings = 2 * 129280 * 7168  # untied: the table and the lm_head
    assert v3.num_params == (61 * attention + 3 * dense + 58 * (257 * expert + router)
                             + embeddings) == 671_025_397_760
    assert v3.active_params == 61 * attention + 3 * dense + 58 * (9 * expert + router) + embeddings
    assert v3.routed_expert_params == 58 * 256 * expert
    assert v3.flops_per_token() == 2 * (v3.active_params - 129280 * 7168)
    assert v3.attention_flops_per_key == 61 * 128 * (2 * 576 + 2 * 512)
    assert v3.weight_bytes() == v3.num_params  # fp8 weights
    assert v3.weight_bytes("bf16") == 2 * v3.num_params and v3.activation_size == 2
    lite = get_model("DeepSeek-V2-Lite")  # no q LoRA: q_proj 2048 -> 16 x 192
    assert lite.attention_params == (2048 * 16 * 192 + 2048 * 576 + 512 * 16 * 256
                                     + 16 * 128 * 2048)


@pytest.mark.parametrize("name, total, activated", [
    ("DeepSeek-V2-Lite", 15.7e9, 2.4e9), ("DeepSeek-V3", 671e9, 37e9),
    ("DeepSeek-R1", 671e9, 37e9), ("Kimi-K2", 1.04e12, 32e9),
])
def test_mla_presets_match_the_published_totals(name, total, activated):
    """Totals within 2% (Kimi-K2: 1.026T against the report's 1.04T). The published activated
    figures leave out the embedding lookup (V2-Lite: 2.45B without it, 2.66B with it): within
    3%, their rounding (2.4B, 37B, 32B)."""
    model = get_model(name)
    assert model.num_params == pytest.approx(total, rel=0.02)
    assert model.active_params - model.embedding_params == pytest.approx(activated, rel=0.03)


@pytest.mark.parametrize("config, q_lora_rank", [("DeepseekV3Config", 12),
                                                  ("DeepseekV2Config", None)])
def test_counts_equal_the_matrices_of_transformers_model(config, q_lora_rank):
    transformers = pytest.importorskip("transformers")
    cfg = getattr(transformers, config)(
        hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=q_lora_rank, kv_lora_rank=10,
        qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=5, n_routed_experts=5,
        n_shared_experts=2, num_experts_per_tok=2, first_k_dense_replace=1, vocab_size=50,
        max_position_embeddings=64, n_group=1, topk_group=1)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    matrices = {n: p.numel() for n, p in model.named_parameters() if p.ndim >= 2}
    preset = ModelPreset("tiny", **mla_preset_fields(cfg.to_dict()))
    assert preset.num_params == sum(matrices.values())
    attention = sum(v for n, v in matrices.items() if n.startswith("model.layers.0.self_attn."))
    assert preset.attention_params == attention
    assert preset.spec().head_size == 14 and preset.moe_layers == 2


def test_presets_and_fields_refuse_inconsistent_shapes():
    with pytest.raises(ValueError, match="one head of 20, got 8 x 20"):
        ModelPreset("bad", 2, 4, 8, 20, 1024, mla=TINY)
    with pytest.raises(ValueError, match="first_dense_layers"):
        tiny_preset(first_dense_layers=3)
    with pytest.raises(ValueError, match="moe_layer_freq must be 1, got 2"):
        mla_preset_fields(DEEPSEEK_V3 | {"moe_layer_freq": 2})


def test_mla_report_against_the_mha_form():
    v3 = get_model("DeepSeek-V3")
    r = mla_report(v3.num_layers, v3.num_heads, v3.mla, 2)
    assert r["latent_bytes_per_token"] == 61 * 576 * 2 == 70272
    assert r["mha_bytes_per_token"] == 61 * 128 * (192 + 128) * 2 == 4_997_120
    assert r["mha_ratio"] == pytest.approx(128 * 320 / 576)
    eight = mla_report(v3.num_layers, v3.num_heads, v3.mla, 1, tp=8)  # fp8, 16 heads a rank
    assert eight["latent_bytes_per_token"] == 61 * 576
    assert eight["mha_bytes_per_token"] == 61 * 16 * 320 and eight["heads_per_rank"] == 16


# the roofline ------------------------------------------------------------------------------

ROUND = DevicePreset("round", GIB, 1e12, 1e14, 1e10, bandwidth_efficiency=1, flops_efficiency=1,
                     pcie_efficiency=1, step_overhead=0)


@pytest.mark.parametrize("seq_lens, query_lens", [([100, 37], [1, 5]), ([64], [64]),
                                                  ([9, 300, 5], [1, 1, 1])])
def test_roofline_prices_absorbed_mla_by_its_formulas(seq_lens, query_lens):
    model = RooflineModel(tiny_preset(), ROUND)
    shape = StepShape.of(seq_lens, query_lens)
    layer_flops = 2 * 2 * (2560 + 3 * 32 * 48)  # 2 layers: MLA projections and the MLP
    attention = 2 * 4 * (2 * 20 + 2 * 16)  # per key: 2 layers x 4 heads x (S + P V)
    flops = (layer_flops * shape.query_tokens + 2 * 64 * 32 * shape.num_seqs
             + attention * shape.attended)
    parts = model.breakdown(shape)
    assert model.flops(shape) == flops
    assert parts["compute_s"] == pytest.approx(flops / 1e14)
    latent_bytes = 2 * 20 * 2  # one bf16 row of 20 per token and layer, read once for 4 heads
    assert parts["kv_s"] == pytest.approx((shape.kv_read + shape.query_tokens) * latent_bytes
                                          / 1e12)
    weights = 2 * (2 * 64 * 32 + 2 * (2560 + 3 * 32 * 48))
    assert parts["weights_s"] == pytest.approx(weights / 1e12)
    assert parts["total_s"] == pytest.approx(max(parts["weights_s"] + parts["kv_s"],
                                                 parts["compute_s"]))


def test_deepseek_v3_decode_follows_the_formulas_on_each_device():
    v3, h200 = get_model("DeepSeek-V3"), get_device("H200")
    shape = StepShape.of([4096] * 8, [1] * 8)
    parts = RooflineModel(v3, h200, tp=8).breakdown(shape)
    attention = 8 * 4096 * 61 * 128 * (2 * 576 + 2 * 512)
    flops = 8 * v3.flops_per_token() + attention  # 8 decode tokens, each sampled
    assert parts["compute_s"] == pytest.approx(flops / (8 * 989e12 * 0.6))
    # every device reads every latent row: the latent is replicated, its heads split
    assert parts["kv_s"] == pytest.approx((8 * 4096 + 8) * 61 * 576 * 2 / (4.8e12 * 0.8))
    routed = v3.routed_expert_params  # fp8: a byte each; 8 tokens reach 1 - (1 - 8/256)^8
    read = v3.num_params - routed + routed * (1 - (1 - 8 / 256) ** 8)
    assert parts["weights_s"] == pytest.approx(read / (8 * 4.8e12 * 0.8))
    ring = 2 * 61 * 8 * 7168 * 2 * 2 * 7 / 8  # bf16 hidden states, though the weights are fp8
    assert parts["allreduce_s"] == pytest.approx(ring / (450e9 * 0.8))


def test_absorbed_decode_at_128_heads_is_compute_bound_and_split_heads_are_not():
    """Per latent byte the absorbed form does heads x 2176 / 1152 FLOPs: 242 at 128 heads,
    above the H100's 221 FLOP/byte (989e12 x 0.6 / 3.35e12 x 0.8); 16 heads a device (tp 8) do
    30, and the replicated latent makes the attention memory-bound."""
    v3, h100 = get_model("DeepSeek-V3"), get_device("H100")
    shape = StepShape.of([32768] * 64, [1] * 64)
    for tp, bound in ((1, True), (8, False)):
        parts = RooflineModel(v3, h100, tp=tp).breakdown(shape)
        attention_s = shape.attended * v3.attention_flops_per_key / (tp * 989e12 * 0.6)
        assert (attention_s > parts["kv_s"]) is bound
    mha = 61 * 128 * 320 * 2 * shape.kv_read / (3.35e12 * 0.8)  # the MHA form's K/V read
    assert mha / RooflineModel(v3, h100).breakdown(shape)["kv_s"] == pytest.approx(
        128 * 320 / 576, rel=1e-3)
