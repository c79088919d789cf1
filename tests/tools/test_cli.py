"""The ``pagedkv`` command, called as ``cli.main([...])``."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest

from pagedkv.tools import cli

SMALL_SIM = ["simulate", "--requests", "40", "--num-blocks", "96", "--max-len", "1024",
             "--no-progress"]


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def run_json(capsys, *argv: str) -> dict:
    code, out, _ = run(capsys, *argv, "--json")
    assert code == 0
    return json.loads(out)


def test_info(capsys):
    code, out, _ = run(capsys, "info")
    assert code == 0 and "pagedkv._C" in out and "CPU threads" in out
    data = run_json(capsys, "info")
    assert data["pagedkv._C"]["cpu"] is True and data["cpu_threads"] >= 1
    assert {"pagedkv", "torch", "pagedkv._simt", "gpu"} <= data.keys()


def test_size_preset_text_and_json(capsys):
    code, out, _ = run(capsys, "size", "--model", "llama-3-8b", "--memory", "80GiB")
    assert code == 0 and "128 KiB" in out and "655,360 tokens" in out
    data = run_json(capsys, "size", "--model", "Llama-3-8B", "--seq-len", "4096", "--batch", "8")
    assert data["bytes_per_token"] == 131072 and data["kv_cache_bytes"] == 4096 * 8 * 131072
    assert data["bytes_per_block"] == 16 * 131072 and data["cache_dtype"] == "bfloat16"


def test_size_flags_match_preset_and_fp8(capsys):
    flags = run_json(capsys, "size", "--layers", "28", "--kv-heads", "4", "--head-size", "128",
                     "--seq-len", "32768")
    preset = run_json(capsys, "size", "--model", "qwen2.5-7b")
    assert flags["kv_cache_bytes"] == preset["kv_cache_bytes"] == 2 * 28 * 4 * 128 * 32768 * 2
    fp8 = run_json(capsys, "size", "--model", "qwen2.5-7b", "--cache-dtype", "fp8")
    assert fp8["bytes_per_token"] == preset["bytes_per_token"] // 2
    assert len(run_json(capsys, "size", "--list-models")["models"]) >= 5


def test_size_errors(capsys):
    code, _, err = run(capsys, "size", "--layers", "2")
    assert code == 1 and "--kv-heads" in err
    code, _, err = run(capsys, "size", "--model", "nope")
    assert code == 1 and "presets" in err
    with pytest.raises(SystemExit):
        cli.main(["size", "--cache-dtype", "int3"])


def test_simulate_table_json_and_plot(capsys, tmp_path):
    code, out, _ = run(capsys, *SMALL_SIM, "--strategies", "contiguous-max,paged")
    assert code == 0 and "contiguous-max" in out and "paged / contiguous-max" in out
    png = tmp_path / "sim.png"
    data = run_json(capsys, *SMALL_SIM, "--trace", "alpaca", "--system-share", "0.9",
                    "--plot", str(png))
    assert set(data["strategies"]) == {"contiguous-max", "contiguous-oracle", "paged",
                                       "paged+prefix"}
    assert data["strategies"]["paged+prefix"]["prefix_hit_rate"] > 0
    assert data["config"]["num_blocks"] == 96 and data["trace"]["requests"] == 40
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_simulate_jsonl_and_memory_budget(capsys, tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps({"prompt_len": 30 + i, "output_len": 5 + i,
                                        "prefix_id": i % 2, "prefix_len": 16}) + "\n"
                            for i in range(12)))
    data = run_json(capsys, "simulate", "--trace", str(path), "--memory", "64MiB",
                    "--model", "llama-3-8b", "--max-len", "256", "--no-progress")
    assert data["config"]["num_blocks"] == 64 * 2**20 // (16 * 131072) == 32
    assert all(r["finished"] == 12 for r in data["strategies"].values())
    code, _, err = run(capsys, "simulate", "--trace", str(tmp_path / "missing.jsonl"))
    assert code == 1 and "missing.jsonl" in err
    code, _, err = run(capsys, "simulate", "--trace", str(path), "--memory", "64MiB")
    assert code == 1 and "contiguous-max reserves max_len = 2048" in err


def test_help_of_each_command(capsys):
    for command in ("info", "size", "simulate"):
        with pytest.raises(SystemExit) as exit_info:
            cli.main([command, "--help"])
        assert exit_info.value.code == 0 and "--json" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    out = capsys.readouterr().out
    assert all(name in out for name in ("info", "size", "simulate", "bench", "demo"))


def test_bench_found_in_source_tree(capsys):
    main = cli._bench_main()
    assert Path(sys.modules[main.__module__].__file__).parent.name == "bench"
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench", "--help"])
    assert exit_info.value.code == 0 and "--quick" in capsys.readouterr().out


def test_bench_outside_a_source_tree(capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(cli, "__file__", str(tmp_path / "site-packages" / "pagedkv" / "cli.py"))
    code, _, err = run(capsys, "bench")
    assert code == 1 and "source tree" in err


def test_demo_dispatch_and_missing(capsys, monkeypatch):
    seen = []
    monkeypatch.setitem(sys.modules, "pagedkv.tools.demo",
                        types.SimpleNamespace(main=lambda argv=None: seen.append(argv)))
    assert cli.main(["demo", "--steps", "3"]) == 0 and seen == [["--steps", "3"]]
    monkeypatch.setitem(sys.modules, "pagedkv.tools.demo", None)
    code, _, err = run(capsys, "demo")
    assert code == 1 and "demo" in err


def test_optional_dependencies_missing(capsys, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    monkeypatch.setitem(sys.modules, "tqdm", None)
    from pagedkv.tools import sim

    assert sim._progress_bar("paged", 10, enabled=True) is None
    code, _, err = run(capsys, *SMALL_SIM, "--strategies", "paged", "--plot",
                       str(tmp_path / "x.png"))
    assert code == 1 and "needs matplotlib" in err
