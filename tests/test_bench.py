"""Smoke test of the benchmarks that serve a model: a tiny run of bench/bench_serve.py, its JSON
and its table (sizes only; speed is measured by the benchmark itself, never here)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
pytest.importorskip("transformers")
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import bench_serve  # noqa: E402
from bench.__main__ import SUITES  # noqa: E402


def test_bench_serve_tiny_run(tmp_path, capsys):
    threads = torch.get_num_threads()
    out = tmp_path / "serve.json"
    try:
        bench_serve.main(["--quick", "--requests", "3", "--max-new", "3", "--threads", "1",
                          "--out", str(out)])
    finally:
        torch.set_num_threads(threads)
    result = json.loads(out.read_text())
    assert result["quick"] and result["machine"]["threads"] == 1
    demo = result["models"]["demo"]
    assert set(result["models"]) == {"demo"} and demo["requests"] == 3
    ways = demo["ways"]
    assert {"hf", "engine_flinear"} <= set(ways)
    for way, row in ways.items():
        assert row["tokens_equal_hf"] and row["requests_equal_hf"] == 3, way
        assert row["tokens_per_s"] > 0 and len(row["seconds"]) == 1
        if way != "hf":
            shares = row["profile"]["parts_share"]
            assert set(shares) == {"linears", "attention", "cache_writes", "other_model_ops",
                                   "engine_overhead"}
            assert all(v >= 0 for v in shares.values()) and sum(shares.values()) == \
                pytest.approx(1, abs=0.01)
            assert shares["linears"] > 0 and shares["attention"] > 0
    printed = capsys.readouterr().out
    assert "engine_flinear" in printed and str(out) in printed
    assert "bench.bench_serve" in SUITES
