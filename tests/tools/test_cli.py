"""The ``pagedkv`` command, called as ``cli.main([...])``."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from pagedkv import ops
from pagedkv.tools import cli, cli_simulate
from pagedkv.tools.costmodel import RooflineModel, get_device
from pagedkv.tools.presets import get_model

from helpers import expected_cpu_kernel

SMALL_SIM = ["simulate", "--requests", "40", "--num-blocks", "96", "--max-len", "1024",
             "--no-progress"]


def run(capsys, *argv: str) -> tuple[int, str, str]:
    """Exit status (argparse's 2 included), stdout and stderr of ``pagedkv argv...``."""
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

def test_info(capsys):
    code, out, _ = run(capsys, "info")
    assert code == 0 and "pagedkv._C" in out and "CPU threads" in out
    data = run_json(capsys, "info")
    assert data["pagedkv._C"]["cpu"] is True and data["cpu_threads"] >= 1
    assert {"pagedkv", "torch", "pagedkv._simt", "gpu"} <= data.keys()


@pytest.mark.skipif(not Path("/proc/cpuinfo").exists() or platform.machine() != "x86_64",
                    reason="reads the x86-64 CPU flags from /proc/cpuinfo")
def test_info_names_the_cpu_kernel(capsys, monkeypatch):
    monkeypatch.delenv("PAGEDKV_CPU_ISA", raising=False)
    data = run_json(capsys, "info")
    assert data["cpu_attention_kernel"] in ("base", "avx2", "avx512", "avx512bf16")
    assert data["cpu_attention_kernel"] == expected_cpu_kernel(128)
    pairs = data["cpu_bf16_dot_products"]
    assert pairs == ops.cpu_bf16_dot_products() and (not pairs or data["cpu_attention_kernel"]
                                                     == "avx512bf16")
    if expected_cpu_kernel(128) == "avx512bf16":  # the dispatch's rule, where it is not close
        ratio = ops.cpu_peak_gflops("bf16", 0.02) / ops.cpu_peak_gflops("fp32", 0.02)
        if not 0.65 < ratio < 0.95:
            assert pairs == (ratio >= 0.8), ratio
        monkeypatch.setenv("PAGEDKV_CPU_ISA", "avx512bf16")  # naming the set runs its pairs
        assert ops.cpu_bf16_dot_products()
        monkeypatch.setenv("PAGEDKV_CPU_ISA", "avx512")
        assert not ops.cpu_bf16_dot_products()
        monkeypatch.delenv("PAGEDKV_CPU_ISA")
    code, out, _ = run(capsys, "info")
    assert code == 0 and f"CPU attention  {expected_cpu_kernel(128)} kernels" in out
    amx = data["cpu_amx_tiles"]
    assert amx == ops.cpu_amx_tiles() and ("AMX tiles (AMX-BF16)" in out) == amx
    assert ("bf16 dot products (AVX512_BF16)" in out) == (pairs and not amx)
    assert ops.cpu_attention_kernel(8) == expected_cpu_kernel(8)  # 8 lanes: never avx512
    monkeypatch.setenv("PAGEDKV_CPU_ISA", "base")  # read by the C++ dispatch at every call
    assert run_json(capsys, "info")["cpu_attention_kernel"] == "base"
    with pytest.raises(RuntimeError, match="head_size must be positive"):
        ops.cpu_attention_kernel(0)
    monkeypatch.setenv("PAGEDKV_CPU_ISA", "sse9")
    code, _, err = run(capsys, "info")
    assert code == 1 and "PAGEDKV_CPU_ISA must be one of base avx2 avx512 avx512bf16" in err


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


def test_size_and_simulate_per_tensor_parallel_rank(capsys):
    one = run_json(capsys, "size", "--model", "llama-3-70b", "--memory", "40GiB")
    two = run_json(capsys, "size", "--model", "llama-3-70b", "--memory", "40GiB", "--tp", "2")
    assert (two["num_kv_heads"], two["tp"]) == (4, 2)
    assert two["bytes_per_token"] * 2 == one["bytes_per_token"]
    assert two["blocks_fit"] == 2 * one["blocks_fit"]
    sixteen = run_json(capsys, "size", "--model", "llama-3-70b", "--tp", "16")
    assert sixteen["num_kv_heads"] == 1  # 8 KV heads over 16 ranks: one replicated head each
    flags = run_json(capsys, "size", "--layers", "2", "--kv-heads", "2", "--head-size", "8",
                     "--tp", "4")
    assert flags["num_kv_heads"] == 1
    sim = ["simulate", "--requests", "20", "--model", "llama-3-70b", "--device", "h100",
           "--max-len", "1024", "--no-progress", "--strategies", "paged"]
    code, out, _ = run(capsys, *sim, "--tp", "2")
    per_device = get_model("llama-3-70b").spec(16, tp=2).bytes_per_block
    assert code == 0 and "tp 2:" in out and "blocks on each device" in out
    budget = int(out.split("budget")[1].split("blocks")[0].replace(",", ""))
    roofline = RooflineModel(get_model("llama-3-70b"), get_device("h100"), tp=2)
    assert budget == (roofline.kv_cache_bytes() // 2) // per_device
    code, _, err = run(capsys, *sim)
    assert code == 2 and "do not fit" in err  # one H100 does not hold the weights
    code, _, err = run(capsys, *sim, "--tp", "2", "--calibrate", __file__)
    assert code == 2 and "argument --tp" in err


def test_size_reports_the_hybrid_manager_beside_full_attention(capsys):
    code, out, _ = run(capsys, "size", "--model", "gpt-oss-120b", "--seq-len", "32768",
                       "--memory", "80GiB")
    assert code == 0
    assert "hybrid manager 2 KV cache groups over one pool, a block = a page of 18 layers" in out
    assert "36.1 KiB   at 32,768 tokens, against 72 KiB with every layer in full (0.50x)" in out
    assert "70 sequences of 32,768 (every layer in full: 35)" in out
    data = run_json(capsys, "size", "--model", "gpt-oss-120b", "--seq-len", "32768")
    page = 2 * 18 * 8 * 64 * 2 * 16
    assert data["hybrid"]["bytes_per_page"] == page
    assert data["hybrid"]["hybrid_bytes_per_seq"] == (2048 + 8) * page  # 128 / 16 + 0 blocks
    assert data["hybrid"]["full_bytes_per_token"] == data["bytes_per_token"] == 73728
    assert [g["window"] for g in data["hybrid"]["groups"]] == [128, None]
    custom = run_json(capsys, "size", "--layers", "4", "--kv-heads", "2", "--head-size", "64",
                      "--sliding-window", "8", "--full-every", "2", "--seq-len", "100",
                      "--block-size", "4")
    assert custom["hybrid"]["hybrid_bytes_per_seq"] == (25 + 2) * 2 * 2 * 2 * 64 * 2 * 4
    assert "hybrid" not in run_json(capsys, "size", "--model", "llama-3-8b")
    assert "hybrid" not in run_json(capsys, "size", "--model", "gemma-2-9b",
                                    "--sliding-window", "0")
    code, _, err = run(capsys, "size", "--layers", "2", "--kv-heads", "2", "--head-size", "8",
                       "--full-every", "2")
    assert code == 2 and "argument --full-every: needs --sliding-window" in err


def test_simulate_reports_the_hybrid_kv_per_token(capsys):
    sim = ["simulate", "--requests", "20", "--model", "gpt-oss-20b", "--device", "h100",
           "--max-len", "1024", "--no-progress", "--strategies", "paged"]
    code, out, _ = run(capsys, *sim)
    assert code == 0
    assert ("kv       48 KiB per token with every layer in full; the hybrid manager holds "
            "27 KiB per token of a 1,024-token request (0.56x") in out  # (64 + 8) pages / 1024
    data = run_json(capsys, *sim)
    page = 2 * 12 * 8 * 64 * 2 * 16
    assert data["kv"]["hybrid_bytes_per_token"] == (64 + 8) * page / 1024
    code, out, _ = run(capsys, *SMALL_SIM, "--strategies", "paged")
    assert "no sliding-window layers" in out
    default = run_json(capsys, *sim[:-2], "--memory", "1GiB")
    assert list(default["strategies"]) == ["contiguous", "paged", "paged+prefix", "paged+hybrid"]
    assert default["strategies"]["paged+hybrid"]["finished"] == 20
    code, out, _ = run(capsys, *sim[:-2], "--memory", "1GiB", "--strategies", "paged+hybrid")
    pages = int(out.split("paged+hybrid: ")[1].split(" blocks")[0].replace(",", ""))
    blocks = int(out.split("budget   ")[1].split(" blocks")[0].replace(",", ""))
    assert code == 0 and pages == 2 * blocks  # pages of 12 of the 24 layers
    code, _, err = run(capsys, *SMALL_SIM, "--strategies", "paged+hybrid")
    assert code == 2 and "paged+hybrid needs a model with sliding-window layers" in err
    swap = run_json(capsys, *sim[:-2], "--memory", "1GiB", "--cpu-blocks", "8")
    assert swap["strategies"]["paged+hybrid"]["finished"] == 20


def test_size_errors(capsys):
    code, _, err = run(capsys, "size", "--layers", "2")
    assert code == 2 and "--kv-heads" in err
    code, _, err = run(capsys, "size", "--model", "nope")
    assert code == 2 and "argument --model" in err and "presets" in err
    code, _, err = run(capsys, "size", "--cache-dtype", "int3")
    assert code == 2 and "argument --cache-dtype" in err


def test_simulate_table_json_and_plot(capsys, tmp_path):
    code, out, _ = run(capsys, *SMALL_SIM, "--strategies", "contiguous,paged", "--rate", "2")
    assert code == 0 and "contiguous" in out and "Poisson, 2 requests/s" in out
    assert "paged+prefix" not in out
    png = tmp_path / "sim.png"
    data = run_json(capsys, *SMALL_SIM, "--trace", "alpaca", "--system-share", "0.9",
                    "--plot", str(png))
    assert set(data["strategies"]) == {"contiguous", "paged", "paged+prefix"}
    prefix = data["strategies"]["paged+prefix"]
    assert prefix["prefix_hit_rate"] > 0 and prefix["finished"] == 40
    assert prefix["normalized_latency"]["p50"] > 0 and prefix["ttft"]["p99"] > 0
    assert data["config"]["num_blocks"] == 96 and data["trace"]["requests"] == 40
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_simulate_defaults_are_where_memory_binds(capsys):
    """No flags: OPT-13B on an A100-40GB, where 7 contiguous reservations fit in the budget and
    paging serves more at once, faster; Llama-3-8B on an H100 is where it does not bind."""
    roofline = RooflineModel(get_model("opt-13b"), get_device("a100-40gb"))
    fits = roofline.spec.num_blocks_for(roofline.kv_cache_bytes()) * 16 // 2048
    data = run_json(capsys, "simulate", "--requests", "120", "--no-progress")
    binds, text = data["binds"], data["binds"]["text"]
    assert (data["config"]["model"], data["config"]["device"]) == ("OPT-13B", "A100-40GB")
    assert binds["contiguous_fits"] == fits == 7 and binds["peak_running"]["contiguous"] == fits
    assert min(binds["peak_running"][name] for name in ("paged", "paged+prefix")) > 2 * fits
    ratios = binds["throughput_over_contiguous"]
    assert binds["memory_binds"] and set(ratios) == {"paged", "paged+prefix"}
    assert min(ratios.values()) > 1.5 and f"paged {ratios['paged']:.2f}x" in text
    assert f"KV budget  {fits} contiguous reservations of 2,048 slots fit at once" in text
    assert text.endswith("memory binds")
    binds = run_json(capsys, "simulate", "--requests", "120", "--no-progress", "--device", "h100",
                     "--model", "llama-3-8b")["binds"]
    assert not binds["memory_binds"] and binds["contiguous_fits"] > 120
    assert max(binds["throughput_over_contiguous"].values()) < 1.1
    assert "memory does not bind" in binds["text"]
    alone = run_json(capsys, "simulate", "--requests", "30", "--no-progress", "--strategies",
                     "paged")["binds"]
    assert alone["memory_binds"] and alone["peak_running"]["paged"] > fits
    assert alone["throughput_over_contiguous"] == {}


# The sweeps are three tests, so that the suite's workers share them.
def test_simulate_sweep_rate(capsys, tmp_path):
    png = tmp_path / "rate.png"
    data = run_json(capsys, *SMALL_SIM, "--sweep-rate", "--rates", "0.5,4,64",
                    "--latency-target", "0.05", "--plot", str(png))
    assert [row["rate"] for row in data["rates"]] == [0.5, 4, 64]
    assert set(data["sustained_rate"]) == {"contiguous", "paged", "paged+prefix"}
    assert data["latency_target_s_per_token"] == 0.05
    lat = [row["strategies"]["paged"]["normalized_latency"]["mean"] for row in data["rates"]]
    assert lat == sorted(lat)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_simulate_sweep_rate_automatic(capsys):
    data = run_json(capsys, *SMALL_SIM, "--sweep-rate", "--strategies", "paged")
    assert len(data["rates"]) == 10  # automatic: up to 1.3x the saturated throughput
    assert data["binds"]["peak_running"].keys() == {"paged"}


def test_simulate_sweep_rate_text(capsys):
    code, out, _ = run(capsys, *SMALL_SIM, "--sweep-rate", "--rates", "0.5,64")
    assert code == 0 and "at the highest rate swept, 64 requests/s:" in out and "KV budget" in out


def test_simulate_jsonl_memory_budget_and_calibration(capsys, tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps({"prompt_len": 30 + i, "output_len": 5 + i,
                                        "prefix_id": i % 2, "prefix_len": 16}) + "\n"
                            for i in range(12)))
    data = run_json(capsys, "simulate", "--trace", str(path), "--memory", "64MiB",
                    "--model", "llama-3-8b", "--max-len", "256", "--no-progress")
    assert data["config"]["num_blocks"] == 64 * 2**20 // (16 * 131072) == 32
    assert all(r["finished"] == 12 for r in data["strategies"].values())
    calibration = tmp_path / "cal.json"
    rows = [{"num_seqs": n, "query_tokens": q, "prefill_tokens": q if q > 1 else 0,
             "attended": q * 40, "kv_read": n * 40, "swap_blocks": 0,
             "seconds": 0.002 + 0.001 * n + 0.0001 * q} for n, q in
            [(1, 1), (4, 4), (8, 8), (1, 64), (2, 128), (16, 16), (3, 200), (32, 32)]]
    calibration.write_text(json.dumps({"models": {"tiny": {"rows": rows}}}))
    data = run_json(capsys, "simulate", "--trace", str(path), "--memory", "64MiB",
                    "--model", "llama-3-8b", "--max-len", "256", "--calibrate", str(calibration),
                    "--no-progress")
    paged = data["strategies"]["paged"]
    assert paged["finished"] == 12 and paged["ttft"]["p50"] > 0.002
    code, _, err = run(capsys, "simulate", "--trace", str(path), "--memory", "64MiB")
    assert code == 2 and "contiguous reserves 2048" in err
    timed = tmp_path / "timed.jsonl"
    timed.write_text("".join(json.dumps({"prompt_len": 20, "output_len": 4,
                                         "arrival_time": 100.0 * i}) + "\n" for i in range(3)))
    code, out, _ = run(capsys, "simulate", "--trace", str(timed), "--memory", "64MiB",
                       "--max-len", "256", "--strategies", "paged")
    assert code == 0 and "the trace's arrival times" in out
    data = run_json(capsys, "simulate", "--trace", str(timed), "--memory", "64MiB",
                    "--max-len", "256", "--strategies", "paged")
    assert data["strategies"]["paged"]["duration"] > 200  # idle between the arrivals
    data = run_json(capsys, "simulate", "--trace", str(timed), "--memory", "64MiB",
                    "--max-len", "256", "--strategies", "paged", "--rate", "inf")
    assert data["strategies"]["paged"]["duration"] < 10


def _commands() -> dict:
    return cli._parser()._subparsers._group_actions[0].choices


def test_help_of_each_command(capsys):
    assert set(_commands()) == {"info", "size", "simulate", "demo"}
    for command in _commands():
        with pytest.raises(SystemExit) as exit_info:
            cli.main([command, "--help"])
        out = capsys.readouterr().out
        assert exit_info.value.code == 0 and f"pagedkv {command}" in out and "--json" in out
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    out = capsys.readouterr().out
    assert all(name in out for name in _commands()) and "bench" not in out.split("options:")[0]


def test_help_outside_the_checkout(tmp_path):
    """From another folder, with only the package on the path (as an installed one is): the
    commands need neither bench/ nor the tests."""
    script = ("import sys\nfrom pagedkv.tools import cli\n"
              "for argv in [['--help'], *([c, '--help'] for c in sys.argv[1:])]:\n"
              "    try:\n        cli.main(argv)\n    except SystemExit as e:\n"
              "        assert e.code == 0, (argv, e.code)\n    else:\n"
              "        raise AssertionError(argv)\n"
              "assert 'bench' not in sys.modules\n")
    env = {**os.environ, "PYTHONPATH": str(Path(cli.__file__).parents[2])}
    done = subprocess.run([sys.executable, "-c", script, *_commands()], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    for command in _commands():
        assert f"usage: pagedkv {command}" in done.stdout


def test_bench_is_not_a_command(capsys):
    code, _, err = run(capsys, "bench")
    assert code == 2 and "invalid choice: 'bench'" in err


def test_demo_is_a_subcommand(capsys, monkeypatch):
    from pagedkv.tools import demo

    seen = []

    def run_demo(*args):
        seen.append(args)
        return {"outputs": [], "outputs_match": False}

    monkeypatch.setattr(demo, "run_demo", run_demo)
    monkeypatch.setattr(demo, "format_report", lambda report: "report")
    code, out, _ = run(capsys, "demo", "--requests", "3", "--max-tokens", "5", "--device", "cpu")
    assert code == 1 and out.strip() == "report"  # outputs_match False: exit status 1
    assert seen[0][:5] == (3, 48, 64, 5, 192) and seen[0][7] == "cpu"
    code, _, err = run(capsys, "demo", "--max-prompt", "3")
    assert code == 2 and "argument --max-prompt" in err


def test_optional_dependencies_missing(capsys, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    monkeypatch.setitem(sys.modules, "tqdm", None)
    assert cli_simulate._progress(True) is None
    code, _, err = run(capsys, *SMALL_SIM, "--strategies", "paged", "--plot",
                       str(tmp_path / "x.png"))
    assert code == 1 and "needs matplotlib" in err


# Every option that takes a value, per command, with values it must refuse. An option missing
# here fails test_every_option_is_walked, so a new option comes with its checks.
MISSING = "/no/such/dir/file"
BAD_VALUES = {
    "size": {
        "--model": ["nope", ""], "--layers": ["0", "-5", "x", "1.5"],
        "--kv-heads": ["0", "-5", "x"], "--head-size": ["0", "-5", "x"],
        "--seq-len": ["0", "-5", "x"], "--batch": ["0", "-5", "x", "2.0"],
        "--dtype": ["int8", "0"], "--cache-dtype": ["int3", "-5", "uint8"],
        "--block-size": ["0", "-5", "x"], "--memory": ["0", "-5", "lots", "0GiB"],
        "--tp": ["0", "-5", "x", "3", "64"], "--sliding-window": ["-5", "x", "1.5"],
        "--full-every": ["-5", "x", "1.5"],
    },
    "simulate": {
        "--trace": ["nope", MISSING], "--requests": ["0", "-5", "x", "1.5"],
        "--seed": ["-5", "x", "1.5"], "--system-share": ["-0.1", "1.5", "x", "nan"],
        "--system-prompts": ["0", "-5", "x"], "--system-len": ["0", "-5", "x"],
        "--max-len": ["0", "-5", "x"], "--model": ["nope"], "--device": ["nope", "0"],
        "--calibrate": [MISSING, "/"], "--calibrated-model": ["tiny"],
        "--memory": ["0", "-5", "lots"], "--num-blocks": ["0", "-5", "x"],
        "--block-size": ["0", "-5", "x"], "--cache-dtype": ["int3", "int4_tensor"],
        "--max-num-seqs": ["0", "-5", "x"], "--max-num-batched-tokens": ["0", "-5", "x"],
        "--cpu-blocks": ["-5", "x", "1.5"], "--rate": ["0", "-5", "x", "nan"],
        "--rates": ["0", "-1,2", "x", "4,2", "1,1", ",", "inf"],
        "--latency-target": ["0", "-5", "x", "inf"],
        "--strategies": ["buddy", "", "paged,paged", "paged,x"],
        "--plot": [MISSING, "/"], "--tp": ["0", "-5", "x", "3", "64"],
    },
    "demo": {
        "--requests": ["0", "-5", "x"], "--system-prompt-len": ["-5", "x"],
        "--max-prompt": ["0", "-5", "x", "3"], "--max-tokens": ["0", "-5", "x", "1000"],
        "--max-model-len": ["0", "-5", "x", "10"], "--kv-budget-requests": ["0", "-5", "x"],
        "--block-size": ["0", "-5", "x"], "--device": ["tpu", "x", "cuda:x"],
        "--dtype": ["int8"], "--cache-dtype": ["int3", "uint8"], "--seed": ["-5", "x"],
        "--threads": ["0", "-5", "x"],
        "--tp": ["0", "-5", "x", "3", "2"], "--tp-timeout": ["0", "-5", "x", "inf"],
        "--model": ["nope", "", "gpt"],
    },
}


def _valued_options(command: str) -> set[str]:
    parser = _commands()[command]
    return {next(o for o in a.option_strings if o.startswith("--")) for a in parser._actions
            if a.option_strings and a.nargs != 0 and a.dest != "help"}


@pytest.mark.parametrize("command", list(BAD_VALUES))
def test_every_option_is_walked(command):
    assert _valued_options(command) == set(BAD_VALUES[command])


@pytest.mark.parametrize("command, option, value", [
    (command, option, value) for command, options in BAD_VALUES.items()
    for option, values in options.items() for value in values])
def test_a_bad_option_value_is_refused_before_any_work(capsys, monkeypatch, command, option,
                                                       value):
    """argparse's error naming the option (exit 2), and no work: the simulator, the demo's
    engine and the size report are never reached."""
    from pagedkv.tools import demo, sim

    def no_work(*args, **kwargs):
        raise AssertionError("work started before the options were checked")

    monkeypatch.setattr(sim, "simulate", no_work)
    monkeypatch.setattr(sim, "sweep", no_work)
    monkeypatch.setattr(demo, "run_demo", no_work)
    monkeypatch.setattr(cli, "size_report", no_work)
    base = {"size": ["size", "--model", "llama-3-8b"], "simulate": SMALL_SIM,
            "demo": ["demo"]}[command]
    code, _, err = run(capsys, *base, f"{option}={value}")
    assert code == 2, err
    message = err.strip().splitlines()[-1]  # argparse's "prog: error: argument --x: ..."
    assert "error: argument --" in message and option in message, err
