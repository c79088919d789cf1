"""Cache formats on the command line: ``pagedkv size`` counts each format's rows with their
scales and tabulates what fits (``--formats``), ``simulate`` and ``demo`` run with one."""

from __future__ import annotations

import pytest
from test_cli import SMALL_SIM, run, run_json

from pagedkv.serving.scheduler import StepShape
from pagedkv.tools import demo
from pagedkv.tools.costmodel import RooflineModel, get_device
from pagedkv.tools.presets import get_model

LLAMA = ["size", "--model", "llama-3-8b", "--seq-len", "8192"]


@pytest.mark.parametrize("name, canonical, per_token", [
    ("int8", "int8", 2 * 32 * 8 * 132), ("int4", "int4", 2 * 32 * 8 * 68),
    ("fp8_per_token_head", "fp8_e4m3_per_token_head", 2 * 32 * 8 * 132),
    ("fp8", "float8_e4m3fn", 2 * 32 * 8 * 128), ("bf16", "bfloat16", 2 * 32 * 8 * 256)])
def test_size_counts_each_format_with_its_scales(capsys, name, canonical, per_token):
    data = run_json(capsys, *LLAMA, "--cache-dtype", name, "--memory", "80GiB")
    assert data["cache_dtype"] == canonical and data["bytes_per_token"] == per_token
    assert data["bytes_per_block"] == 16 * per_token
    assert data["token_scaled"] == (canonical in ("int8", "int4", "fp8_e4m3_per_token_head"))
    assert data["seqs_fit"] == 80 * 2**30 // (16 * per_token) // 512
    code, out, _ = run(capsys, *LLAMA, "--cache-dtype", name)
    assert code == 0 and f"= {per_token:,} B" in out
    assert ("4 B of each" in out) == data["token_scaled"]


def test_size_text_names_the_row_and_its_scale(capsys):
    code, out, _ = run(capsys, *LLAMA, "--cache-dtype", "int4")
    assert code == 0
    assert "cache int4 (0.5 B + a 4 B scale a row)" in out
    assert "2 x 32 x 8 x (128 x 0.5 B + 4 B) = 34,816 B" in out
    assert "int4 rows carry their float32 scale: 4 B of each 68 B row" in out


def test_formats_table_shows_the_requests_each_format_buys(capsys):
    """int8 holds about 2x bf16's sequences in one budget, int4 about 4x (3.76x: the scales)."""
    data = run_json(capsys, *LLAMA, "--memory", "80GiB", "--formats")
    rows = {r["format"]: r for r in data["formats"]}
    assert rows["bfloat16"]["seqs_fit"] == 80 and rows["bfloat16"]["seqs_ratio"] == 1
    assert rows["int8"]["seqs_fit"] == 155 and rows["int8"]["seqs_ratio"] == pytest.approx(1.94,
                                                                                          abs=0.01)
    assert rows["int4"]["seqs_fit"] == 301 and rows["int4"]["seqs_ratio"] == pytest.approx(3.76,
                                                                                          abs=0.01)
    assert rows["float8_e4m3fn"]["seqs_fit"] == 160
    assert rows["int8"]["tokens_ratio"] == pytest.approx(256 / 132)
    assert rows["int4"]["row_bytes"] == 68 and rows["float32"]["row_bytes"] == 512
    code, out, _ = run(capsys, *LLAMA, "--memory", "80GiB", "--formats")
    assert code == 0 and "cache formats" in out and "vs bfloat16" in out
    line = next(x for x in out.splitlines() if x.strip().startswith("int4 "))
    assert line.split()[:6] == ["int4", "68", "B", "34", "KiB", "3.76x"]
    assert "301" in line and "int4, a scale per (token, head)" in line


def test_formats_of_a_latent_cache_leave_out_the_row_scaled_ones(capsys):
    data = run_json(capsys, "size", "--model", "deepseek-v3", "--formats")
    assert {r["format"] for r in data["formats"]} == {
        "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2"}
    code, _, err = run(capsys, "size", "--model", "deepseek-v3", "--cache-dtype", "int8")
    assert code == 2 and "argument --cache-dtype" in err and "latent (MLA) ops do not read" in err


def test_simulate_fits_more_requests_in_a_smaller_format(capsys):
    """One GiB for Llama-3-8B: 8 contiguous reservations of 1,024 tokens in bf16, 15 in int8,
    30 in int4; the roofline reads fewer KV bytes per token, too."""
    base = [*SMALL_SIM[:3], "--memory", "1GiB", "--max-len", "1024", "--no-progress",
            "--model", "llama-3-8b", "--device", "h100", "--strategies", "contiguous,paged"]
    blocks, peaks = {}, {}
    for name in (None, "int8", "int4"):
        data = run_json(capsys, *base, *(["--cache-dtype", name] if name else []))
        assert data["kv"]["cache_format"] == (name or "bfloat16")
        blocks[name] = data["config"]["num_blocks"]
        peaks[name] = data["strategies"]["contiguous"]["peak_running"]
    assert peaks == {None: 8, "int8": 15, "int4": 30}
    assert blocks["int8"] == 2**30 // (16 * 67584) and blocks["int4"] == 2**30 // (16 * 34816)
    code, out, _ = run(capsys, *base, "--cache-dtype", "int8")
    assert code == 0 and "kv       66 KiB per token" in out and "cache int8, rows of 132 B" in out


def test_roofline_decode_reads_the_formats_bytes():
    model, device = get_model("llama-3-8b"), get_device("h100")
    shape = StepShape(num_seqs=64, query_tokens=64, attended=64 * 4096, kv_read=64 * 4096)
    times = {name: RooflineModel(model, device, name).breakdown(shape)
             for name in (None, "int8", "int4")}
    assert times[None]["kv_s"] == pytest.approx(times["int8"]["kv_s"] * 256 / 132)
    assert times["int4"]["kv_s"] < times["int8"]["kv_s"]
    with pytest.raises(ValueError, match="cache_dtype must be a torch dtype or one of"):
        RooflineModel(model, device, "int3")


def test_demo_serves_a_quantized_cache(capsys, monkeypatch):
    """The option reaches run_demo, and a small run in int8 holds more blocks in the same budget,
    paged and contiguous giving the same tokens."""
    seen = []
    real = demo.run_demo
    monkeypatch.setattr(demo, "run_demo", lambda *args: seen.append(args) or real(*args))
    code, out, _ = run(capsys, "demo", "--requests", "4", "--max-tokens", "6", "--device", "cpu",
                       "--cache-dtype", "int8", "--json")
    assert code == 0 and seen[0][-1] == "int8"
    report = demo.run_demo(4, 48, 64, 6, 192, 6, 16, "cpu")
    assert '"cache_dtype": "int8"' in out and '"outputs_match": true' in out
    assert report["model"]["cache_dtype"] == "float32"
    code, _, err = run(capsys, "demo", "--model", "deepseek", "--cache-dtype", "int8")
    assert code == 2 and "argument --cache-dtype" in err
