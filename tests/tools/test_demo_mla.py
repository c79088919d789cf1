"""``pagedkv demo --model deepseek``: a tiny random DeepSeek-V3 served by ``LLMEngine`` on its
latent cache, paged and contiguous under one budget, and the report's KV memory figures held to
the formulas on the model's own config (and on DeepSeek-V3's published one)."""

from __future__ import annotations

import json
import sys
from itertools import accumulate

import pytest

from pagedkv.tools import cli, demo, demo_mla
from pagedkv.tools.presets_mla import DEEPSEEK_V3

from helpers import one_thread  # noqa: F401  (autouse)

SMALL = dict(num_requests=8, system_prompt_len=16, max_prompt=12, max_tokens=8,
             max_model_len=40, kv_budget_requests=2, block_size=4)
FORMS = ("latent", "mha", "gqa")


@pytest.fixture(scope="module")
def report() -> dict:
    pytest.importorskip("transformers")
    return demo_mla.run_demo(**SMALL)


@pytest.fixture(scope="module")
def hf_config():
    pytest.importorskip("transformers")
    return demo_mla.deepseek_model(SMALL["max_model_len"]).hf.config


def run(capsys, *argv: str) -> tuple[int, str, str]:
    try:
        code = cli.main(["demo", "--model", "deepseek", *argv])
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def per_token(config, layers: int, heads: int, element: int) -> dict[str, int]:
    """The three forms' bytes per token from a DeepSeek config's dims."""
    head = config["qk_nope_head_dim"] + config["qk_rope_head_dim"] + config["v_head_dim"]
    return {"latent": layers * (config["kv_lora_rank"] + config["qk_rope_head_dim"]) * element,
            "mha": layers * heads * head * element, "gqa": layers * 8 * head * element}


def test_paged_and_contiguous_give_the_same_tokens(report) -> None:
    paged, contiguous = report["paged"], report["contiguous"]
    assert report["outputs_match"] and report["model"]["name"] == "deepseek"
    assert len(report["outputs"]) == SMALL["num_requests"]
    assert paged["generated_tokens"] == contiguous["generated_tokens"] > 0
    assert paged["peak_concurrent_requests"] > contiguous["peak_concurrent_requests"] == 2
    assert paged["prefix_hit_rate"] > 0 == contiguous["prefix_hit_rate"]


def test_runs_on_the_latent_cache(report, hf_config) -> None:
    c = hf_config.to_dict()
    latent = per_token(c, c["num_hidden_layers"], c["num_attention_heads"], 4)["latent"]
    assert report["kv_budget_bytes"] == 2 * SMALL["max_model_len"] * latent
    assert report["paged"]["num_blocks"] == report["kv_budget_bytes"] // (4 * latent)
    assert report["contiguous"]["num_blocks"] == 2


def test_memory_matches_the_formulas(report, hf_config) -> None:
    c = hf_config.to_dict()
    expected = per_token(c, c["num_hidden_layers"], c["num_attention_heads"], 4)
    memory, budget = report["memory"], report["kv_budget_bytes"]
    ends = list(accumulate(-(-(len(p) + n) // 4) for p, n in demo.make_requests(
        8, 16, c["vocab_size"], 12, 8, 0)))
    assert memory["element_size"] == 4
    for form in FORMS:
        row = memory[form]
        assert row["bytes_per_token"] == expected[form]
        assert row["ratio"] == pytest.approx(expected[form] / expected["latent"])
        assert row["tokens_in_budget"] == budget // expected[form]
        blocks = budget // (4 * expected[form])
        assert row["requests_paged"] == sum(end <= blocks for end in ends)
        assert row["requests_contiguous"] == budget // (40 * expected[form])
    assert memory["latent"]["requests_contiguous"] == 2
    assert memory["mha"]["ratio"] > memory["gqa"]["ratio"] > 1  # 16 heads, 8 KV heads


def test_deepseek_v3_figures(report) -> None:
    v3 = report["memory"]["deepseek_v3"]
    expected = per_token(DEEPSEEK_V3, 61, 128, 2)
    assert expected["latent"] == 70272  # docs/mla.md: 61 x 576 x 2
    for form in FORMS:
        assert v3[form]["bytes_per_token"] == expected[form]
        assert v3[form]["ratio"] == pytest.approx(expected[form] / expected["latent"])


def test_text_and_json_reports(capsys, monkeypatch, report) -> None:
    monkeypatch.setattr(demo_mla, "run_demo", lambda *args: dict(report))
    code, out, _ = run(capsys, "--device", "cpu")
    assert code == 0 and "same greedy tokens in both runs: True" in out
    v3 = report["memory"]["deepseek_v3"]
    assert f"latent {v3['latent']['bytes_per_token']:,} B/token" in out
    assert f"= {report['memory']['mha']['bytes_per_token']:,}" in out
    code, out, _ = run(capsys, "--device", "cpu", "--json")
    data = json.loads(out)
    assert code == 0 and "outputs" not in data
    assert {"model", "memory", "paged", "contiguous", "outputs_match", "outputs_sha256",
            "kv_budget_bytes"} <= data.keys()
    for form in FORMS:
        assert {"bytes_per_token", "ratio", "tokens_in_budget", "requests_paged",
                "requests_contiguous"} <= data["memory"][form].keys()
    assert {"kv_lora_rank", "rope_dim", "qk_nope_head_dim", "v_head_dim"} <= data["model"].keys()
    monkeypatch.setattr(demo_mla, "run_demo", lambda *args: {**report, "outputs_match": False})
    assert run(capsys, "--device", "cpu")[0] == 1


def no_work(*args, **kwargs):
    raise AssertionError("work started before the options were checked")


def test_tp_is_refused(capsys, monkeypatch) -> None:
    monkeypatch.setattr(demo_mla, "run_demo", no_work)
    code, _, err = run(capsys, "--tp", "2")
    assert code == 2 and "argument --tp" in err and "one rank" in err


def test_without_transformers_names_the_extra(capsys, monkeypatch) -> None:
    monkeypatch.setattr(demo_mla, "run_demo", no_work)
    monkeypatch.setitem(sys.modules, "transformers", None)
    code, _, err = run(capsys)
    assert code == 2 and "needs transformers" in err and "pagedkv[hf]" in err


def test_llama_stays_the_default(monkeypatch, capsys) -> None:
    monkeypatch.setattr(demo_mla, "run_demo", no_work)
    monkeypatch.setattr(demo, "run_demo", lambda *args: {"outputs": [], "outputs_match": True})
    monkeypatch.setattr(demo, "format_report", lambda report: "llama report")
    assert cli.main(["demo", "--device", "cpu"]) == 0
    assert capsys.readouterr().out.strip() == "llama report"
