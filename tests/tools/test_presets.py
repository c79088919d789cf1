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
])
def test_preset_bytes_per_token(name, per_token):
    assert get_model(name).spec().bytes_per_token == per_token


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
