"""Memory accounting of ``pagedkv size``: model presets, byte counts, size parsing."""

from __future__ import annotations

import pytest
import torch

from pagedkv.tools.presets import MODELS, format_bytes, get_model, parse_bytes, size_report

GIB = 2**30


def test_size_llama3_8b_by_hand():
    spec = get_model("llama-3-8b").spec(block_size=16)
    assert spec.kv_dtype == torch.bfloat16
    assert spec.bytes_per_token == 2 * 32 * 8 * 128 * 2 == 131072
    r = size_report(spec, seq_len=8192, batch=4, memory=80 * GIB)
    assert r["bytes_per_block"] == 16 * 131072 == 2 * 2**20
    assert r["bytes_per_seq"] == 8192 * 131072 == GIB
    assert r["kv_cache_bytes"] == 4 * GIB
    assert r["blocks_fit"] == 80 * GIB // (2 * 2**20) == 40960
    assert r["tokens_fit"] == 655360 and r["seqs_fit"] == 80


def test_size_llama3_70b_and_fp8_by_hand():
    spec = get_model("Llama-3-70B").spec(block_size=32)
    assert spec.bytes_per_token == 2 * 80 * 8 * 128 * 2 == 327680
    r = size_report(spec, seq_len=1000, batch=3)
    assert r["kv_cache_bytes"] == 2 * 80 * 8 * 128 * 1000 * 3 * 2 == 983_040_000
    assert r["blocks_per_seq"] == 32 and r["paged_bytes"] == 32 * 3 * 32 * 327680
    assert get_model("llama-3-70b").spec(cache_dtype="fp8").bytes_per_token == 327680 // 2


@pytest.mark.parametrize("name, per_token", [
    ("Mistral-7B", 2 * 32 * 8 * 128 * 2), ("Qwen2.5-7B", 2 * 28 * 4 * 128 * 2),
    ("Gemma-2-9B", 2 * 42 * 8 * 256 * 2), ("OPT-13B", 819200),  # the vLLM paper's "800 KB"
    ("gpt-oss-20b", 2 * 24 * 8 * 64 * 2), ("Gemma-3-27B", 2 * 62 * 16 * 128 * 2),
])
def test_preset_bytes_per_token(name, per_token):
    assert get_model(name).spec().bytes_per_token == per_token


@pytest.mark.parametrize("name, config, kwargs", [
    ("gpt-oss-20b", "GptOssConfig", {}), ("gpt-oss-120b", "GptOssConfig", {}),
    ("Gemma-2-9B", "Gemma2Config", {}),
    ("Gemma-3-27B", "Gemma3TextConfig", {"sliding_window_pattern": 6}),
])
def test_windowed_layers_are_those_of_transformers_layer_types(name, config, kwargs):
    transformers = pytest.importorskip("transformers")
    preset = get_model(name)
    types = getattr(transformers, config)(num_hidden_layers=preset.num_layers,
                                          **kwargs).layer_types
    assert [w is not None for w in preset.layer_windows] == \
        [t == "sliding_attention" for t in types]
    assert {w for w in preset.layer_windows if w} == {preset.sliding_window}


def test_window_presets_by_hand():
    gpt = get_model("gpt-oss-120b").spec(hybrid=True)
    assert gpt.bytes_per_token == 2 * 36 * 8 * 64 * 2  # every layer in full: as before
    assert [(g.window, len(g.layers)) for g in gpt.kv_cache_groups] == [(128, 18), (None, 18)]
    page = 2 * 18 * 8 * 64 * 2 * 16
    assert gpt.bytes_per_block == page
    assert gpt.hybrid_kv_bytes(32768) == (2048 + 128 // 16) * page
    assert gpt.hybrid_kv_bytes(32769) == (2049 + 128 // 16 + 1) * page  # a window + one block
    gemma = get_model("Gemma-3-27B").spec(hybrid=True)
    assert [len(g.layers) for g in gemma.kv_cache_groups] == [10] * 5 + [2, 10]
    assert gemma.group_windows == (1024,) * 6 + (None,)
    assert gemma.hybrid_kv_bytes(32768) == (6 * 64 + 2048) * 2 * 10 * 16 * 128 * 2 * 16
    mistral = get_model("Mistral-7B-v0.1").spec(hybrid=True)
    assert mistral.group_windows == (4096,) and mistral.page_layers == 32
    assert mistral.hybrid_kv_bytes(32768) == 256 * mistral.bytes_per_block
    assert get_model("Mistral-7B").layer_windows is None
    assert get_model("gpt-oss-120b").spec().sliding_windows is None  # the default: all full


@pytest.mark.parametrize("name, published", [
    ("gpt-oss-20b", 20.9e9), ("gpt-oss-120b", 116.8e9), ("Gemma-3-27B", 27e9),
    ("Mistral-7B-v0.1", 7.24e9),
])
def test_window_presets_parameter_counts(name, published):
    assert get_model(name).num_params == pytest.approx(published, rel=0.02)


def test_presets_gqa_divides_heads():
    for m in MODELS.values():
        assert m.num_heads % m.num_kv_heads == 0, m.name


def test_parse_and_format_bytes():
    assert parse_bytes("80GiB") == 80 * GIB and parse_bytes("1.5 GB") == 1_500_000_000
    assert parse_bytes("512mib") == 512 * 2**20 and parse_bytes("4096") == 4096
    with pytest.raises(ValueError, match="cannot read"):
        parse_bytes("lots")
    assert format_bytes(131072) == "128 KiB" and format_bytes(1000) == "1000 B"
    assert format_bytes(1.5 * GIB) == "1.5 GiB"
    with pytest.raises(ValueError, match="presets"):
        get_model("gpt-5")
