"""The engine on sliding-window models against Hugging Face greedy generation: Mistral (every
layer a 16-token window) and Ministral (window and full layers alternating) on the hybrid block
manager, with contexts past three windows, a prefix hit that crosses the window, and preemption
by recompute and by swap; attention sinks against the reference op."""

from __future__ import annotations

import pytest
import torch

from pagedkv.blocks.hybrid import HybridBlockManager
from pagedkv.blocks.manager import BlockManager
from pagedkv.blocks.plan import PlanExecutor
from pagedkv.cache.paged_cache import PagedKVCache
from pagedkv.ops import reference
from pagedkv.serving.engine import EngineConfig, LLMEngine, SamplingParams
from pagedkv.serving.model import LlamaForCausalLM, ModelConfig

transformers = pytest.importorskip("transformers")
from test_model_hf import hf_greedy, one_thread  # noqa: E402, F401

from helpers import generate_within_windows  # noqa: E402

WINDOW = 16
MAX_TOKENS = 24
_lengths = torch.Generator().manual_seed(5)
LONG = torch.randint(0, 256, (52,), generator=_lengths).tolist()  # over three windows
PROMPTS = [torch.randint(0, 256, (n,), generator=_lengths).tolist() for n in (5, 23)]
PROMPTS += [LONG, LONG + [3, 4, 5]]  # the last shares the long prompt's blocks
TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.1,
            bos_token_id=None, eos_token_id=None, pad_token_id=None, sliding_window=WINDOW,
            attn_implementation="eager")


def mistral() -> torch.nn.Module:
    torch.manual_seed(11)
    config = transformers.MistralConfig(num_hidden_layers=2, **TINY)
    return transformers.MistralForCausalLM(config).eval()


def ministral() -> torch.nn.Module:
    torch.manual_seed(12)
    kinds = ["sliding_attention", "full_attention"] * 2
    config = transformers.MinistralConfig(num_hidden_layers=4, layer_types=kinds, head_dim=16,
                                          **TINY)
    return transformers.MinistralForCausalLM(config).eval()


MODELS = {"mistral": mistral, "ministral": ministral}


@pytest.fixture(scope="module", params=list(MODELS))
def case(request: pytest.FixtureRequest) -> tuple[torch.nn.Module, list[list[int]]]:
    hf = MODELS[request.param]()
    return hf, [hf_greedy(hf, prompt, MAX_TOKENS) for prompt in PROMPTS]


def run(engine: LLMEngine) -> list[list[int]]:
    """Greedy outputs per prompt, the window groups' blocks checked after every step."""
    return generate_within_windows(engine, PROMPTS, MAX_TOKENS)


@pytest.mark.parametrize("block_size", [4, 8])
def test_windowed_model_matches_hf_with_a_prefix_hit_past_the_window(case, block_size) -> None:
    hf, expected = case
    model = LlamaForCausalLM.from_hf(hf)
    engine = LLMEngine(model, EngineConfig(block_size=block_size, num_blocks=96))
    assert isinstance(engine.manager, HybridBlockManager)
    assert engine.manager.group_windows == model.kv_cache_spec(block_size,
                                                              torch.float32).group_windows
    assert run(engine) == expected
    assert engine.prefix_hit_rate > 0
    assert engine.manager.allocator.num_used_blocks == 0


def test_the_shared_prompt_hits_across_the_window(case) -> None:
    hf, expected = case
    engine = LLMEngine(LlamaForCausalLM.from_hf(hf), EngineConfig(block_size=4, num_blocks=96))
    params = SamplingParams(max_tokens=MAX_TOKENS)
    assert engine.generate([LONG], params) == [expected[2]]
    second = engine.add_request(PROMPTS[3], params)
    while engine.has_unfinished():
        engine.step()
    assert second.num_cached_tokens == len(LONG) // 4 * 4 > 3 * WINDOW
    assert second.output_token_ids == expected[3]


@pytest.mark.parametrize("num_cpu_blocks", [0, 64])
def test_preemption_matches_hf(case, num_cpu_blocks: int) -> None:
    hf, expected = case
    windows = len(LlamaForCausalLM.from_hf(hf).kv_cache_spec(4, torch.float32).group_windows)
    engine = LLMEngine(LlamaForCausalLM.from_hf(hf),
                       EngineConfig(block_size=4, num_blocks=20 * windows + 1,
                                    num_cpu_blocks=num_cpu_blocks))
    assert run(engine) == expected
    stats = engine.stats
    assert stats.swaps_out + stats.recomputes > 0
    assert (stats.swaps_out > 0) == bool(num_cpu_blocks)
    assert engine.manager.allocator.num_used_blocks == 0


def test_blocks_behind_the_window_are_never_read(case) -> None:
    """The model over a ``debug_nan`` hybrid manager: every fresh and every released block is
    NaN-filled before the step's kernels, so a read of a block behind the window (a -1 entry
    or a released one) would turn the tokens into NaN's argmax."""
    hf, expected = case
    model = LlamaForCausalLM.from_hf(hf)
    spec = model.kv_cache_spec(4, torch.float32)
    cache = PagedKVCache(spec, num_blocks=128)
    manager = BlockManager(cache.num_blocks, 4, groups=spec.group_windows,
                           enable_prefix_caching=False, debug_nan=True)
    executor = PlanExecutor(cache)
    ids = list(range(len(PROMPTS)))
    for i, prompt in enumerate(PROMPTS):
        manager.add_sequence(i, prompt)
    tokens, query_lens, poisoned = [list(p) for p in PROMPTS], [len(p) for p in PROMPTS], set()
    for _ in range(MAX_TOKENS):
        batch = manager.build_batch(ids, query_lens)
        poisoned.update(executor.run(manager).poison)
        pairs = list(zip(tokens, query_lens, strict=True))
        with torch.no_grad():
            logits = model(torch.tensor([t for seq, q in pairs for t in seq[-q:]]),
                           torch.cat([torch.arange(len(seq) - q, len(seq)) for seq, q in pairs]),
                           cache, batch, batch.query_start_loc[1:].long() - 1)
        assert not logits.isnan().any()
        for i, token in enumerate(logits.argmax(-1).tolist()):
            tokens[i].append(token)
            manager.append_tokens(i, token)
        query_lens = [1] * len(PROMPTS)
    assert [seq[len(p):] for seq, p in zip(tokens, PROMPTS, strict=True)] == expected
    window_groups = [g for g, w in enumerate(manager.group_windows) if w is not None]
    held = {b for i in ids for g in range(len(manager.group_windows))
            for b in manager.block_table(i, g)}
    freed = [i for i in ids for g in window_groups if -1 in manager.block_table(i, g)]
    assert freed and poisoned - held  # blocks were released behind the window and filled


@pytest.mark.parametrize("num_cpu_blocks", [None, 0, 64])
def test_chunked_prefill_matches_hf(case, num_cpu_blocks: int | None) -> None:
    """Prompts in chunks of at most 12 tokens: a window group frees blocks as the chunks go
    (the 52-token prompt never holds its 13 blocks at once); with a small pool (an int
    ``num_cpu_blocks``), preemption by recompute or swap in the middle of chunked prefills."""
    hf, expected = case
    model = LlamaForCausalLM.from_hf(hf)
    groups = len(model.kv_cache_spec(4, torch.float32).group_windows)
    num_blocks = 96 if num_cpu_blocks is None else 20 * groups + 1
    engine = LLMEngine(model, EngineConfig(block_size=4, num_blocks=num_blocks,
                                           num_cpu_blocks=num_cpu_blocks or 0,
                                           max_num_batched_tokens=12, chunked_prefill=True))
    assert run(engine) == expected
    assert engine.peak_window_blocks < len(LONG) // 4
    if num_cpu_blocks is not None:
        assert engine.stats.swaps_out + engine.stats.recomputes > 0
    assert engine.manager.allocator.num_used_blocks == 0


def test_chunked_prefill_on_a_full_attention_model() -> None:
    from helpers import tiny_hf_model

    hf = tiny_hf_model(seed=3)
    expected = [hf_greedy(hf, prompt, 8) for prompt in PROMPTS]
    engine = LLMEngine(LlamaForCausalLM.from_hf(hf),
                       EngineConfig(block_size=4, num_blocks=64, max_num_batched_tokens=10,
                                    chunked_prefill=True))
    requests = [engine.add_request(p, SamplingParams(max_tokens=8)) for p in PROMPTS]
    sizes = []
    while engine.has_unfinished():
        engine.step()
        sizes.append(sum(q for _, q in engine.last_batch))
    assert [r.output_token_ids for r in requests] == expected
    assert max(sizes) <= 10


def test_sliding_windows_from_hf_configs() -> None:
    assert ModelConfig.from_hf(mistral().config).sliding_windows == (WINDOW, WINDOW)
    assert ModelConfig.from_hf(ministral().config).sliding_windows == (WINDOW, None) * 2
    qwen = transformers.Qwen2Config(num_hidden_layers=4, use_sliding_window=True,
                                    sliding_window=32, max_window_layers=2)
    assert ModelConfig.from_hf(qwen).sliding_windows == (None, None, 32, 32)
    assert ModelConfig.from_hf(transformers.Qwen2Config(num_hidden_layers=2)).sliding_windows \
        is None
    assert ModelConfig.from_hf(transformers.LlamaConfig(num_hidden_layers=2)).sliding_windows \
        is None


@pytest.mark.parametrize("windows", [(8,), (8, 0), "ab", (8, -1)])
def test_bad_sliding_windows_are_refused(windows) -> None:
    from pagedkv.errors import InvalidArgumentError
    with pytest.raises(InvalidArgumentError, match="sliding_windows"):
        ModelConfig(num_hidden_layers=2, sliding_windows=windows)


def test_sinks_match_the_reference_op() -> None:
    """Random sinks on window and full layers: the engine's tokens and last logits over the
    kernels equal those over ``pagedkv.ops.reference``, and differ from the model without
    sinks."""
    config = ModelConfig(num_hidden_layers=2, sliding_windows=(8, None), attention_sinks=True)
    torch.manual_seed(4)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0, 2)
    prompts = PROMPTS[:3]

    def outputs(kernels, sinks: bool = True) -> list[list[int]]:
        for layer in model.model.layers:
            layer.self_attn.kernels = kernels
        saved = [layer.self_attn.sinks.data.clone() for layer in model.model.layers]
        if not sinks:
            for layer in model.model.layers:
                layer.self_attn.sinks.data.zero_().sub_(1e9)
        engine = LLMEngine(model, EngineConfig(block_size=4, num_blocks=64))
        out = engine.generate(prompts, SamplingParams(max_tokens=12))
        for layer, data in zip(model.model.layers, saved, strict=True):
            layer.self_attn.sinks.data.copy_(data)
        return out

    from pagedkv import ops
    ours = outputs(ops)
    assert ours == outputs(reference)
    assert ours != outputs(ops, sinks=False)


def test_sinks_shard_by_query_heads() -> None:
    from pagedkv.serving.model import shard_state_dict
    from pagedkv.serving.parallel import TensorParallel

    config = ModelConfig(num_hidden_layers=2, sliding_windows=(8, None), attention_sinks=True)
    state = LlamaForCausalLM(config).state_dict()
    name = "model.layers.1.self_attn.sinks"
    state[name] = torch.randn(config.num_attention_heads)
    halves = [shard_state_dict(state, config, TensorParallel(r, 2)) for r in range(2)]
    assert torch.equal(torch.cat([h[name] for h in halves]), state[name])
    rank = LlamaForCausalLM(config, TensorParallel(1, 2))
    rank.load_hf_state_dict(state)  # strict: every rank's sinks have its heads' shape
    assert torch.equal(rank.model.layers[1].self_attn.sinks.data, halves[1][name])
    assert [layer.self_attn.window for layer in rank.model.layers] == [8, None]


def test_cuda_kernel_source_under_simt_matches_hf(case) -> None:
    """The CUDA kernels, emulated on the CPU, over window tables with freed (-1) entries."""
    from pagedkv.ops import simt
    if not simt.available():
        pytest.skip("pagedkv built without the simt emulator")
    hf, expected = case
    model = LlamaForCausalLM.from_hf(hf).use_kernels(simt.ops)
    engine = LLMEngine(model, EngineConfig(block_size=8, num_blocks=64))
    prompts, n = [PROMPTS[1], LONG[:30]], 6
    assert engine.generate(prompts, SamplingParams(max_tokens=n)) == [
        expected[1][:n], hf_greedy(hf, LONG[:30], n)]


def test_a_model_without_windows_keeps_the_plain_manager() -> None:
    engine = LLMEngine(LlamaForCausalLM(ModelConfig(num_hidden_layers=2)),
                       EngineConfig(block_size=4, num_blocks=33))
    assert type(engine.manager) is BlockManager and engine.max_request_tokens == 128
    hybrid = LLMEngine(LlamaForCausalLM(ModelConfig(num_hidden_layers=2,
                                                    sliding_windows=(8, None))),
                       EngineConfig(block_size=4, num_blocks=33))
    assert hybrid.manager.group_windows == (8, None) and hybrid.max_request_tokens == 64


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_matches_hf_on_cpu(case) -> None:
    hf, expected = case
    engine = LLMEngine(LlamaForCausalLM.from_hf(hf).cuda(),
                       EngineConfig(block_size=8, num_blocks=64))
    assert run(engine) == expected


@pytest.mark.parametrize("num_cpu_blocks", [0, 16])
def test_chunked_prefill_under_pressure_gives_the_roomy_engine_tokens(num_cpu_blocks) -> None:
    """Random prompts and lengths, budgets of 8 tokens, pools just large enough: every request
    finishes (no step without work) with the tokens of an engine with room and no chunks."""
    torch.manual_seed(6)
    model = LlamaForCausalLM(ModelConfig(num_hidden_layers=2, sliding_windows=(8, None)))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    lengths = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 256, (int(n),), generator=lengths).tolist()
               for n in torch.randint(1, 40, (10,), generator=lengths)]
    params = [SamplingParams(max_tokens=int(n))
              for n in torch.randint(1, 12, (10,), generator=lengths)]
    expected = LLMEngine(model, EngineConfig(block_size=4, num_blocks=256)).generate(prompts,
                                                                                   params)
    for num_blocks in (25, 27, 29):  # the smallest fits the longest request in both groups
        engine = LLMEngine(model, EngineConfig(block_size=4, num_blocks=num_blocks,
                                               num_cpu_blocks=num_cpu_blocks,
                                               max_num_batched_tokens=8, chunked_prefill=True))
        assert engine.generate(prompts, params) == expected, num_blocks
        assert engine.stats.swaps_out + engine.stats.recomputes > 0
        assert (engine.stats.swaps_out > 0) == bool(num_cpu_blocks)
        assert engine.manager.allocator.num_used_blocks == 0
