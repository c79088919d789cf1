"""Tensor-parallel serving over torch.distributed (gloo, 2 CPU processes).

The ranks are this file run as a script (``python test_tensor_parallel.py SCENARIO RANK ...``),
so the test needs no launcher and no importable test package. Each rank writes what it saw to a
JSON file; the test compares it with a one-process engine on the same model and requests.
"""

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import pagedkv
from pagedkv.errors import InvalidArgumentError
from pagedkv.serving.engine import EngineConfig, LLMEngine, SamplingParams
from pagedkv.serving.linear import onednn_dtypes
from pagedkv.serving.model import LlamaForCausalLM, ModelConfig, shard_state_dict
from pagedkv.serving.parallel import (
    TensorParallel,
    TensorParallelError,
    init_tensor_parallel,
    kv_heads_per_rank,
)
from pagedkv.tools.demo import make_requests, random_model

PACKAGE_PARENT = Path(pagedkv.__file__).resolve().parents[1]  # the pagedkv this test imports
BLOCK_SIZE, NUM_BLOCKS = 4, 24
KV_HEADS = (2, 1)  # split over the 2 ranks; replicated on both
PACKED = torch.float32 in onednn_dtypes()  # the replicated run packs each rank's slices


def tiny_config(kv_heads: int) -> ModelConfig:
    return ModelConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=kv_heads,
                       max_position_embeddings=64, attention_bias=True, mlp_bias=True)


def serve(model: LlamaForCausalLM, config: EngineConfig) -> dict:
    """Greedy outputs of a prefix-sharing workload that preempts under NUM_BLOCKS blocks."""
    if model.config.num_key_value_heads == 1 and PACKED:
        model.prepack()
    requests = make_requests(10, 12, model.config.vocab_size, 10, 12, seed=1)
    engine = LLMEngine(model, config)
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for _, n in requests]
    outputs = engine.generate([p for p, _ in requests], params)
    stats = engine.stats
    return {"outputs": outputs, "num_blocks": engine.cache.num_blocks,
            "kv_heads": engine.cache.spec.num_kv_heads,
            "prefix_hit_rate": engine.prefix_hit_rate, "swaps_out": stats.swaps_out,
            "recomputes": stats.recomputes, "steps": stats.steps,
            "packed": model.packed_dtype is not None,
            "q_rows": model.model.layers[0].self_attn.q_proj.weight.shape[0]}


def engine_config(**kwargs) -> EngineConfig:
    return EngineConfig(block_size=BLOCK_SIZE, num_cpu_blocks=6, max_num_seqs=10, **kwargs)


# the ranks ------------------------------------------------------------------------------------


def rank_main(scenario: str, out: str) -> None:
    torch.set_num_threads(1)
    tp = init_tensor_parallel(2, timeout_s=float(os.environ["TP_TIMEOUT"]))
    result: dict = {"rank": tp.rank}
    try:
        for kv_heads in KV_HEADS:
            model = random_model(tiny_config(kv_heads), seed=3, tp=tp)
            if scenario != "match" and tp.rank == 1:
                forward, calls = model.forward, []

                def failing(*args, _forward=forward, _calls=calls, **kwargs):
                    _calls.append(1)
                    if len(_calls) == 3:
                        if scenario == "exit":
                            os._exit(3)
                        time.sleep(600)
                    return _forward(*args, **kwargs)

                model.forward = failing
            # the ranks' budgets differ: each takes the smaller block count
            per_block = model.kv_cache_spec(BLOCK_SIZE, torch.float32).bytes_per_block
            blocks = NUM_BLOCKS + 5 if tp.rank == 0 else NUM_BLOCKS
            config = engine_config(num_blocks=None, kv_cache_bytes=blocks * per_block)
            result[str(kv_heads)] = serve(model, config)
    except TensorParallelError as e:
        result["error"] = str(e)
    Path(out).write_text(json.dumps(result))
    tp.close()


# the tests ------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(tmp_path: Path, scenario: str, timeout_s: float) -> list[subprocess.Popen]:
    port = free_port()
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TP_TIMEOUT=str(timeout_s),
                   OMP_NUM_THREADS="1",
                   PYTHONPATH=os.pathsep.join([str(PACKAGE_PARENT),
                                               os.environ.get("PYTHONPATH", "")]),
                   CUDA_VISIBLE_DEVICES="")
        procs.append(subprocess.Popen(
            [sys.executable, __file__, scenario, str(tmp_path / f"rank{rank}.json")], env=env,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    return procs


needs_gloo = pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()),
                                reason="torch.distributed with the gloo backend is not available")


@needs_gloo
def test_two_ranks_generate_the_tokens_of_one(tmp_path):
    procs = launch(tmp_path, "match", timeout_s=60)
    logs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], logs
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for kv_heads in KV_HEADS:
        one = serve(random_model(tiny_config(kv_heads), seed=3),
                    engine_config(num_blocks=NUM_BLOCKS))
        assert one["swaps_out"] + one["recomputes"] > 0 and one["prefix_hit_rate"] > 0
        assert one["kv_heads"] == kv_heads
        for rank in ranks:
            got = rank[str(kv_heads)]
            assert got["num_blocks"] == NUM_BLOCKS  # the smaller budget of the two
            assert got["kv_heads"] == kv_heads_per_rank(kv_heads, 2)
            assert got["outputs"] == one["outputs"]
            assert got["q_rows"] * 2 == one["q_rows"] and got["packed"] == one["packed"]
            for key in ("prefix_hit_rate", "swaps_out", "recomputes", "steps"):
                assert got[key] == one[key], key


@needs_gloo
@pytest.mark.parametrize("scenario, timeout_s", [("exit", 30), ("hang", 4)])
def test_a_failing_rank_makes_the_other_exit_with_an_error(tmp_path, scenario, timeout_s):
    """Rank 1 dies (or stalls) at its third step; rank 0 raises TensorParallelError, within the
    timeout, instead of waiting forever."""
    procs = launch(tmp_path, scenario, timeout_s)
    start = time.monotonic()
    try:
        log = procs[0].communicate(timeout=timeout_s + 30)[0]
        elapsed = time.monotonic() - start
    finally:
        for p in procs:
            p.kill()
            p.communicate()
    assert procs[0].returncode == 0, log
    result = json.loads((tmp_path / "rank0.json").read_text())
    assert "a collective failed or timed out" in result["error"], result
    assert "rank 0 of 2" in result["error"]
    assert elapsed < timeout_s + 25


def test_shards_and_their_errors(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    config = tiny_config(2)
    state = random_model(config, seed=0).state_dict()
    halves = [shard_state_dict(state, config, TensorParallel(r, 2)) for r in range(2)]
    q = "model.layers.0.self_attn.q_proj.weight"
    o = "model.layers.0.self_attn.o_proj.weight"
    down_bias = "model.layers.1.mlp.down_proj.bias"
    assert torch.equal(torch.cat([h[q] for h in halves]), state[q])
    assert torch.equal(torch.cat([h[o] for h in halves], dim=1), state[o])
    assert torch.equal(halves[0][down_bias], state[down_bias])
    assert not halves[1][down_bias].any()  # a row-parallel bias is added once
    assert torch.equal(halves[1]["lm_head.weight"], state["lm_head.weight"])
    one_kv = tiny_config(1)
    full = random_model(one_kv, seed=0).state_dict()
    k = "model.layers.0.self_attn.k_proj.weight"
    for r in range(4):  # one KV head, replicated on every rank
        assert torch.equal(shard_state_dict(full, one_kv, TensorParallel(r, 4))[k], full[k])
    with pytest.raises(InvalidArgumentError, match="does not divide the attention heads"):
        LlamaForCausalLM(config, TensorParallel(0, 3))
    with pytest.raises(InvalidArgumentError, match="one must divide the other"):
        kv_heads_per_rank(6, 4)
    with pytest.raises(InvalidArgumentError, match="WORLD_SIZE is 1"):
        init_tensor_parallel(2)
    with pytest.raises(InvalidArgumentError, match="rank"):
        TensorParallel(2, 2)


if __name__ == "__main__":
    rank_main(sys.argv[1], sys.argv[2])
