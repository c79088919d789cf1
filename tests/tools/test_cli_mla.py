"""``pagedkv size`` and ``pagedkv simulate`` with the MLA presets: the latent cache's bytes, its
MHA form beside it, and the options that do not apply to a latent cache."""

from __future__ import annotations

import json

import pytest

from pagedkv.tools import cli
from pagedkv.tools.costmodel import RooflineModel, get_device
from pagedkv.tools.presets import get_model

SIM = ["simulate", "--requests", "20", "--max-len", "1024", "--no-progress", "--strategies",
       "paged"]


def run(capsys, *argv: str) -> tuple[int, str, str]:
    try:
        code = cli.main(list(argv))
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def run_json(capsys, *argv: str) -> dict:
    code, out, _ = run(capsys, *argv, "--json")
    assert code == 0
    return json.loads(out)


def test_size_deepseek_v3_text(capsys):
    code, out, _ = run(capsys, "size", "--model", "deepseek-v3", "--seq-len", "32768",
                       "--memory", "80GiB")
    assert code == 0
    assert ("DeepSeek-V3: 61 layers x one latent row of 576 (MLA: kv_lora_rank 512 + rope 64, "
            "shared by 128 heads), cache bfloat16 (2 B), blocks of 16") in out
    assert "68.6 KiB   61 x 576 x 2 B = 70,272 B" in out
    assert ("4.77 MiB   61 x 128 heads x (K 192 + V 128) x 2 B = 4,997,120 B: 71.1x the latent"
            in out)
    blocks = 80 * 2**30 // (16 * 70272)
    assert f"{blocks * 16:,} tokens = {blocks:,} blocks = {blocks // 2048} sequences" in out


@pytest.mark.parametrize("name, layers, heads", [
    ("DeepSeek-V2-Lite", 27, 16), ("DeepSeek-V3", 61, 128), ("DeepSeek-R1", 61, 128),
    ("Kimi-K2", 61, 64),
])
def test_size_json_of_every_mla_preset(capsys, name, layers, heads):
    data = run_json(capsys, "size", "--model", name, "--seq-len", "1000", "--batch", "3")
    assert data["latent"] is True and (data["num_kv_heads"], data["head_size"]) == (1, 576)
    assert data["bytes_per_token"] == layers * 576 * 2
    assert data["kv_cache_bytes"] == layers * 576 * 2 * 1000 * 3
    assert data["bytes_per_block"] == layers * 576 * 2 * 16
    mla = data["mla"]
    assert mla["latent_bytes_per_token"] == data["bytes_per_token"]
    assert mla["mha_bytes_per_token"] == layers * heads * (192 + 128) * 2
    assert mla["mha_ratio"] == pytest.approx(heads * 320 / 576)
    code, out, _ = run(capsys, "size", "--model", name, "--cache-dtype", "fp8")
    assert code == 0 and "fp8 caches also hold one float32 scale per layer" in out
    fp8 = run_json(capsys, "size", "--model", name, "--cache-dtype", "fp8")
    assert fp8["bytes_per_token"] == layers * 576
    assert fp8["mla"]["mha_bytes_per_token"] == layers * heads * 320


def test_size_mla_per_tensor_parallel_rank(capsys):
    one = run_json(capsys, "size", "--model", "deepseek-v3", "--memory", "40GiB")
    eight = run_json(capsys, "size", "--model", "deepseek-v3", "--memory", "40GiB", "--tp", "8")
    assert eight["bytes_per_token"] == one["bytes_per_token"] == 70272  # the whole latent
    assert eight["blocks_fit"] == one["blocks_fit"]
    assert eight["mla"]["heads_per_rank"] == 16
    assert eight["mla"]["mha_bytes_per_token"] == 61 * 16 * 320 * 2
    code, out, _ = run(capsys, "size", "--model", "deepseek-v3", "--tp", "8")
    assert code == 0 and "with the whole latent on every rank" in out
    assert "61 x 16 heads x (K 192 + V 128) x 2 B = 624,640 B: 8.9x the latent" in out


@pytest.mark.parametrize("option, value", [("--kv-heads", "8"), ("--head-size", "128"),
                                           ("--sliding-window", "4096")])
def test_size_refuses_heads_and_windows_for_a_latent_cache(capsys, option, value):
    code, _, err = run(capsys, "size", "--model", "deepseek-v3", option, value)
    assert code == 2
    assert (f"argument {option}: DeepSeek-V3 caches one latent row of 576 per token and layer "
            "(MLA)") in err
    code, _, err = run(capsys, "size", "--model", "kimi-k2", "--tp", "3")
    assert code == 2 and "argument --tp" in err and "64 attention heads" in err


def test_size_of_a_gqa_model_is_not_latent(capsys):
    data = run_json(capsys, "size", "--model", "llama-3-8b")
    assert data["latent"] is False and "mla" not in data
    assert data["bytes_per_token"] == 131072


def test_list_models_shows_the_latent_and_its_mha_form(capsys):
    rows = {r["name"]: r for r in run_json(capsys, "size", "--list-models")["models"]}
    v3, llama = rows["DeepSeek-V3"], rows["Llama-3-8B"]
    assert v3["latent"] and v3["bytes_per_token"] == 70272
    assert v3["mha_bytes_per_token"] == 4_997_120
    assert rows["Kimi-K2"]["mha_bytes_per_token"] == 61 * 64 * 320 * 2
    assert not llama["latent"] and llama["mha_bytes_per_token"] is None
    code, out, _ = run(capsys, "size", "--list-models")
    line = next(x for x in out.splitlines() if x.startswith("DeepSeek-V3 "))
    assert line.split()[:8] == ["DeepSeek-V3", "61", "128", "1", "576", "163840", "bf16", "68.6"]
    assert "MLA latent of 576; MHA form 4.77 MiB (71.1x)" in line


def test_simulate_deepseek_v3_on_eight_h200(capsys):
    sim = [*SIM, "--model", "deepseek-v3", "--device", "h200", "--tp", "8"]
    code, out, _ = run(capsys, *sim)
    assert code == 0
    assert ("kv       68.6 KiB per token: one MLA latent row of 576 a layer, read once for all "
            "heads (the MHA form: 610 KiB, 8.9x)") in out
    roofline = RooflineModel(get_model("deepseek-v3"), get_device("h200"), tp=8)
    blocks = (roofline.kv_cache_bytes() // 8) // (61 * 576 * 2 * 16)
    assert f"budget   {blocks:,} blocks x 16" in out
    data = run_json(capsys, *sim)
    assert data["kv"]["mla"]["latent_bytes_per_token"] == data["kv"]["full_bytes_per_token"]
    assert data["kv"]["mla"]["mha_bytes_per_token"] == 61 * 16 * 320 * 2
    assert data["strategies"]["paged"]["finished"] == 20
    code, _, err = run(capsys, *SIM, "--model", "deepseek-v3", "--device", "h100", "--tp", "8")
    assert code == 2 and "weights of DeepSeek-V3 (624.9 GiB) do not fit" in err  # fp8 weights
