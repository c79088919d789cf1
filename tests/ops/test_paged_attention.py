"""paged_attention on every backend against pagedkv.ops.reference (float64 oracle, float32 as the
measure of torch's own error), on cuda and simt with automatic kernel dispatch and with the
tensor-core kernel forced (the -tc backends). The grids are module-level lists: trim them for slow
backends."""

from __future__ import annotations

import pytest
import torch
from attention_cases import (
    FLOAT_DTYPES,
    FP8_DTYPES,
    OP_ARGS,
    TC_TILES,
    Case,
    auto_picks_tensor_cores,
    call,
    check,
    make_args,
    max_err,
    reference_outputs,
    skip_what_auto_runs,
    to_device,
)

from pagedkv import ops
from pagedkv.ops import reference as ops_reference

from helpers import (
    AMX_FLAGS,
    CPU_ISAS,
    cpu_flags,
    cpu_has,
    expected_cpu_kernel,
    use_amx,
    use_cpu_isa,
)

HEAD_SIZES = [64, 80, 96, 112, 128, 192, 256, 8, 24]
BLOCK_SIZES = [1, 3, 16, 256]
GROUPS = [(4, 4), (8, 2), (16, 2), (8, 1)]  # (num_heads, num_kv_heads): ratios 1, 4, 8, MQA
FEATURES = {
    "plain": {},
    "alibi": dict(alibi=True),
    "window": dict(sliding_window=7),
    "window-long": dict(sliding_window=40),
    "softcap": dict(soft_cap=5.0),
    "all": dict(alibi=True, sliding_window=24, soft_cap=8.0),
    "sinks": dict(sinks=True),
    "window-sinks": dict(sliding_window=7, sinks=True),  # gpt-oss's window layers, in small
    "all-sinks": dict(alibi=True, sliding_window=24, soft_cap=8.0, sinks=True),
}
# (seq_lens, q_lens): decode rows (q 1), whole prefills (q = seq), chunks over a cached prefix.
VARLEN = ((1, 40, 97, 33, 64, 5), (1, 40, 9, 33, 1, 2))
DECODE = Case()


@pytest.fixture
def backend(attention_backend):
    """Every backend, cuda and simt also with the tensor-core kernel forced (conftest.py)."""
    return attention_backend


def run(backend, case: Case, **extra) -> dict:
    skip_what_auto_runs(backend, case)
    args = make_args(case.with_(extra=extra) if extra else case, backend.device)
    call(backend.ops.paged_attention, args)
    check(args)
    return args


def rerun(backend, args: dict, **changes) -> dict:
    """The op again on the same inputs with some arguments changed, into fresh outputs."""
    again = dict(args, **changes)
    again["out"] = torch.full_like(args["out"], float("nan"))
    if args["lse_out"] is not None:
        again["lse_out"] = torch.full_like(args["lse_out"], float("nan"))
    call(backend.ops.paged_attention, again)
    return again


@pytest.mark.parametrize("head_size", HEAD_SIZES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_decode_dtypes_and_head_sizes(backend, dtype, head_size):
    run(backend, DECODE.with_(dtype=dtype, head_size=head_size))


# Past the tensor-core kernel's 256 (the CUDA-core kernel's 512 instantiation runs them, two
# chunks a lane): Gemma 4's global layers (512), and sizes between.
LARGE_HEADS = [320, 384, 512]


@pytest.mark.parametrize("head_size", LARGE_HEADS)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_large_heads_decode(backend, dtype, head_size):
    run(backend, Case(dtype=dtype, head_size=head_size, seq_lens=(1, 77, 300, 16),
                      num_heads=16, num_kv_heads=2, sinks=True))


@pytest.mark.parametrize("head_size", LARGE_HEADS)
@pytest.mark.parametrize("cache_dtype", [None, torch.float8_e4m3fn], ids=["bf16", "e4m3"])
def test_large_heads_prefill(backend, cache_dtype, head_size):
    """The CPU prefill path (many rows per item) and split items at large heads."""
    run(backend, Case(dtype=torch.bfloat16, cache_dtype=cache_dtype, head_size=head_size,
                      seq_lens=(90, 700, 5), q_lens=(40, 2, 5), num_heads=8, num_kv_heads=1,
                      sliding_window=60, soft_cap=20.0, block_size=7))


def test_heads_past_512_are_refused(backend):
    args = make_args(Case(head_size=520, seq_lens=(5, 9)), backend.device)
    with pytest.raises(RuntimeError, match=r"head_size must be a multiple of 8 in \[8, 512\], "
                                           "got 520"):
        call(backend.ops.paged_attention, args)
    assert args["out"].isnan().all()


def test_large_heads_run_on_the_cuda_core_kernel(backend, monkeypatch):
    """The tensor-core kernel stops at 256: forced, it leaves a head of 512 to the CUDA-core
    kernel (docs/cuda_attention.md, "Dispatch"); the result is the same either way."""
    if backend.simt_order is None:
        pytest.skip("the CUDA-source backends' dispatch")
    case = Case(dtype=torch.bfloat16, head_size=512, num_heads=16, num_kv_heads=1,
                seq_lens=(40, 9), q_lens=(20, 9))
    monkeypatch.setenv("PAGEDKV_ATTENTION_KERNEL", "tensor_core")
    forced = make_args(case, backend.device)
    call(backend.ops.paged_attention, forced)
    check(forced)
    monkeypatch.setenv("PAGEDKV_ATTENTION_KERNEL", "cuda_core")
    core = rerun(backend, forced)
    assert max_err(core["out"], forced["out"]) == 0


@pytest.mark.parametrize("heads", GROUPS, ids=lambda g: f"{g[0]}q{g[1]}kv")
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_block_sizes_and_gqa(backend, block_size, heads):
    run(backend, Case(seq_lens=(1, 5, 260, 77), num_heads=heads[0], num_kv_heads=heads[1],
                      block_size=block_size, dtype=torch.bfloat16))


@pytest.mark.parametrize("varlen", [False, True], ids=["decode", "varlen"])
@pytest.mark.parametrize("feature", FEATURES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_features(backend, dtype, feature, varlen):
    case = Case(dtype=dtype, **FEATURES[feature])
    if varlen:
        case = case.with_(seq_lens=VARLEN[0], q_lens=VARLEN[1])
    run(backend, case)


@pytest.mark.parametrize("cache_dtype", FP8_DTYPES, ids=str)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_fp8_caches(backend, dtype, cache_dtype):
    run(backend, DECODE.with_(dtype=dtype, cache_dtype=cache_dtype, head_size=128))


@pytest.mark.parametrize("feature", ["all", "all-sinks"])
@pytest.mark.parametrize("cache_dtype", FP8_DTYPES, ids=str)
def test_fp8_varlen_with_features(backend, cache_dtype, feature):
    run(backend, Case(seq_lens=VARLEN[0], q_lens=VARLEN[1], dtype=torch.bfloat16,
                      cache_dtype=cache_dtype, **FEATURES[feature]))


@pytest.mark.parametrize("layout", ["nhd", "combined"])
@pytest.mark.parametrize("varlen", [False, True], ids=["decode", "varlen"])
def test_strided_cache_layouts(backend, layout, varlen):
    case = Case(layout=layout, dtype=torch.float16)
    if varlen:
        case = case.with_(seq_lens=VARLEN[0], q_lens=VARLEN[1])
    run(backend, case)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_varlen_long_prefill(backend, dtype):
    """Query tiles: many query tokens per sequence, GQA 8, with a window and soft cap."""
    run(backend, Case(seq_lens=(300, 150, 7), q_lens=(200, 150, 3), num_heads=16,
                      num_kv_heads=2, dtype=dtype, sliding_window=100, soft_cap=30.0))


@pytest.mark.parametrize("name", TC_TILES)
def test_tensor_core_tiles(backend, name):
    run(backend, TC_TILES[name])


@pytest.mark.parametrize("feature", ["plain", "all", "sinks"])
def test_long_context_one_sequence(backend, feature):
    """One long sequence and one kv head: the CPU splits the keys and merges the parts."""
    run(backend, Case(seq_lens=(3001,), num_heads=4, num_kv_heads=1, head_size=128,
                      dtype=torch.bfloat16, **FEATURES[feature]))
    run(backend, Case(seq_lens=(2999, 1500), q_lens=(5, 1), num_heads=4, num_kv_heads=1,
                      **FEATURES[feature]))


def test_empty_sequences_give_zeros_and_minus_inf(backend):
    args = run(backend, Case(seq_lens=(0, 9, 0, 1), alibi=True))
    for seq in (0, 2):
        assert torch.equal(args["out"][seq].cpu(), torch.zeros(8, 64))
        assert torch.equal(args["lse_out"][seq].cpu(), torch.full((8,), float("-inf")))


def test_empty_sequences_with_sinks_give_zeros_and_the_sink(backend):
    args = run(backend, Case(seq_lens=(0, 9, 0, 1), sinks=True))
    for seq in (0, 2):
        assert torch.equal(args["out"][seq].cpu(), torch.zeros(8, 64))
        assert torch.equal(args["lse_out"][seq].cpu(), args["sinks"].cpu())


@pytest.mark.parametrize("split", [40, 64], ids=["mid-block", "at-block"])
def test_sinks_enter_once_when_parts_are_merged(backend, split):
    """Keys [0, split) with the sinks and [split, n) without, merged by merge_attn_states, give
    the attention over all keys with the sinks: lse_out includes the sink, once."""
    n, bs = 200, 16
    whole = run(backend, Case(seq_lens=(n, n), num_heads=8, num_kv_heads=2, dtype=torch.float32,
                              block_size=bs, sinks=True))
    dev = backend.device
    # Part A: the same queries over the first `split` keys (table unchanged, shorter seq_lens).
    first = rerun(backend, whole, seq_lens=torch.full((2,), split, dtype=torch.int32,
                                                      device=dev))
    # Part B: keys [split, n) moved into a cache of their own, without the sinks.
    k, v = (torch.stack([ops_reference.gather_kv(whole["key_cache"].cpu(),
                                                 whole["value_cache"].cpu(),
                                                 whole["block_tables"][i].cpu(), n)[j][split:]
                         for i in range(2)]) for j in (0, 1))
    rest = n - split
    blocks = -(-rest // bs)
    kc = torch.zeros(2 * blocks, k.shape[2], bs, k.shape[3])
    vc = torch.zeros_like(kc)
    for i in range(2):
        for t in range(rest):
            kc[i * blocks + t // bs, :, t % bs] = k[i, t]
            vc[i * blocks + t // bs, :, t % bs] = v[i, t]
    table = torch.arange(2 * blocks, dtype=torch.int32).view(2, blocks)
    second = rerun(backend, whole, key_cache=kc.to(dev), value_cache=vc.to(dev),
                   block_tables=table.to(dev), sinks=None,
                   seq_lens=torch.full((2,), rest, dtype=torch.int32, device=dev))
    merged = torch.full_like(whole["out"], float("nan"))
    merged_lse = torch.full_like(whole["lse_out"], float("nan"))
    ops.merge_attn_states(merged, merged_lse, first["out"], first["lse_out"], second["out"],
                          second["lse_out"])
    assert max_err(merged, whole["out"]) < 1e-5
    assert max_err(merged_lse, whole["lse_out"]) < 1e-5
    # and the sinks did change the answer
    plain = rerun(backend, whole, sinks=None)
    assert max_err(plain["out"], whole["out"]) > 1e-3


@pytest.mark.parametrize("bad, message", [
    (lambda a: a["sinks"][:-1], r"sinks must be \[num_heads\] = \[8\]"),
    (lambda a: a["sinks"].view(2, 4), r"sinks must be \[num_heads\] = \[8\]"),
    (lambda a: a["sinks"].half(), "sinks must be Float"),
    (lambda a: a["sinks"].double(), "sinks must be Float"),
    (lambda a: a["sinks"].repeat(2)[::2], "sinks must be contiguous"),
], ids=["short", "2d", "half", "double", "strided"])
def test_bad_sinks_are_refused_before_anything_is_written(backend, bad, message):
    args = make_args(Case(seq_lens=(5, 30), sinks=True), backend.device)
    args["sinks"] = bad(args)
    with pytest.raises(RuntimeError, match=message):
        call(backend.ops.paged_attention, args)
    assert args["out"].isnan().all() and args["lse_out"].isnan().all()


def test_sinks_on_another_device_are_refused():
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU: CPU tensors are on one device")
    args = make_args(Case(seq_lens=(5, 30), sinks=True), "cuda")
    args["sinks"] = args["sinks"].cpu()
    with pytest.raises(RuntimeError, match="sinks"):
        call(torch.ops.pagedkv.paged_attention, args)


def test_varlen_sequence_without_queries(backend):
    run(backend, Case(seq_lens=(10, 20, 5), q_lens=(3, 0, 5)))


def test_window_longer_than_context_changes_nothing(backend):
    case = Case(seq_lens=(50, 3, 17), q_lens=(4, 3, 1), sliding_window=1000)
    windowed = run(backend, case)
    plain = rerun(backend, windowed, sliding_window=-1)
    assert max_err(windowed["out"], plain["out"]) == 0


def test_unread_block_table_entries_may_hold_anything(backend):
    """Entries past ceil(seq_len / block_size), and with a window those of blocks before the
    window, are never read: garbage there changes nothing."""
    case = Case(seq_lens=(100, 37), q_lens=(2, 1), sliding_window=20, block_size=8)
    clean = run(backend, case)
    table = clean["block_tables"].cpu()
    table[0, :9] = -7  # blocks 0..8 hold keys 0..71; the first query (98) sees keys 79..
    table[1, 5:] = 2**30
    garbage = rerun(backend, clean, block_tables=table.to(backend.device))
    assert max_err(garbage["out"], clean["out"]) == 0


def test_strided_query_out_and_lse(backend):
    dev = backend.device
    args = make_args(Case(seq_lens=(1, 17, 100, 33), q_lens=(1, 2, 3, 4)), dev)
    qkv = torch.randn(10, 3, 8, 64, device=dev)
    args["query"] = qkv[:, 0]
    args["out"] = torch.full((10, 3, 8, 64), float("nan"), device=dev)[:, 1]
    args["lse_out"] = torch.full((8, 10), float("nan"), device=dev).T
    call(backend.ops.paged_attention, args)
    check(args)


# A float32 out under a 16-bit query: the rows before their rounding, for a later merge. Decode,
# a long context (split into parts and merged: the CPU's partials, CUDA's split-K reduce), varlen
# with every feature, fp8, and tensor-core tiles (split, and two row tiles with a window).
FLOAT_OUT = {
    "decode": Case(dtype=torch.bfloat16, head_size=128),
    "long-sinks": Case(seq_lens=(3001,), num_heads=4, num_kv_heads=1, head_size=128,
                       dtype=torch.bfloat16, sinks=True),
    "varlen-all-sinks": Case(seq_lens=VARLEN[0], q_lens=VARLEN[1], dtype=torch.float16,
                             **FEATURES["all-sinks"]),
    "fp8": Case(dtype=torch.float16, cache_dtype=torch.float8_e4m3fn, head_size=80),
    "tc-split": TC_TILES["f16 h128 sinks decode group 8 split"],
    "tc-rows": TC_TILES["bf16 h64 sinks window 2 row tiles"],
}


@pytest.mark.parametrize("name", FLOAT_OUT)
def test_float32_out_is_the_rows_before_rounding(backend, name):
    """out in float32 under a 16-bit query holds what the kernel rounds into a 16-bit out: the
    same call into a float32 out (strided), rounded by torch, equals it bit for bit (lse too),
    and is closer to the float64 reference than the 16-bit out."""
    case = FLOAT_OUT[name]
    skip_what_auto_runs(backend, case)
    rounded = make_args(case, backend.device)
    call(backend.ops.paged_attention, rounded)
    check(rounded)
    tokens, heads, head_size = rounded["out"].shape
    out = torch.full((tokens, heads + 1, head_size), float("nan"), device=backend.device)
    wide = dict(rounded, out=out[:, 1:], lse_out=torch.full_like(rounded["lse_out"], float("nan")))
    call(backend.ops.paged_attention, wide)
    assert torch.equal(wide["out"].to(case.dtype), rounded["out"])
    assert torch.equal(wide["lse_out"], rounded["lse_out"])
    want, _ = reference_outputs(rounded, torch.float64)
    assert max_err(wide["out"], want) < max_err(rounded["out"], want)


def misalign_cache_rows(args: dict) -> None:
    """The caches of CPU args moved one element off their alignment (a slice of a wider row)."""
    for name in ("key_cache", "value_cache"):
        cache = args[name]
        wide = torch.zeros(*cache.shape[:3], cache.shape[3] + 1, dtype=cache.dtype)
        wide[..., 1:] = cache
        args[name] = wide[..., 1:]


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn],
                         ids=str)
def test_unaligned_cache_rows(backend, cache_dtype):
    """Cache rows off 16-byte alignment (a slice of a wider last dim): vector loads cannot be
    used and the CUDA kernels read element by element."""
    dtype = torch.bfloat16 if cache_dtype in FP8_DTYPES else cache_dtype
    args = make_args(Case(seq_lens=(1, 17, 100), q_lens=(1, 3, 2), dtype=dtype,
                          cache_dtype=cache_dtype, alibi=True))
    misalign_cache_rows(args)
    args = to_device(args, backend.device)
    call(backend.ops.paged_attention, args)
    check(args)


def test_no_tokens(backend):
    args = make_args(Case(seq_lens=(5, 7), q_lens=(0, 0)), backend.device)
    call(backend.ops.paged_attention, args)
    assert args["out"].numel() == 0


@pytest.mark.parametrize("isa", CPU_ISAS)
def test_cpu_instruction_sets(backend, isa, monkeypatch):
    """The CPU kernels of every instruction set this processor has (PAGEDKV_CPU_ISA)."""
    if backend.name != "cpu":
        pytest.skip("CPU kernels only")
    use_cpu_isa(monkeypatch, isa)
    for head_size in (80, 88):  # 88 is no multiple of avx512's 16 floats: avx2 runs it
        assert ops.cpu_attention_kernel(head_size) == expected_cpu_kernel(head_size, isa)
    assert ops.cpu_attention_kernel(80) == isa
    for dtype in (torch.float16, torch.bfloat16):
        run(backend, Case(dtype=dtype, head_size=80, num_kv_heads=1, **FEATURES["all"]))
    # bfloat16 V rows are accumulated in pair order (groups of 2 vectors); head sizes with a
    # single vector left over, and groups of 3 and 2 query heads per kv head (row tiles of 2, 1).
    for head_size, heads in ((88, (6, 2)), (120, (4, 2)), (72, (3, 1))):
        run(backend, Case(dtype=torch.bfloat16, head_size=head_size, num_heads=heads[0],
                          num_kv_heads=heads[1], seq_lens=(1, 33, 70, 129)))
    # Rows over 256 bytes are taken 16 keys per chunk, not 32: features across those chunks.
    run(backend, Case(dtype=torch.float32, head_size=96, seq_lens=VARLEN[0], q_lens=VARLEN[1],
                      **FEATURES["all"]))
    run(backend, Case(seq_lens=VARLEN[0], q_lens=VARLEN[1], cache_dtype=torch.float8_e4m3fn,
                      head_size=128, alibi=True, soft_cap=5.0))
    run(backend, Case(seq_lens=(700, 3), num_heads=2, num_kv_heads=2, head_size=32,
                      cache_dtype=torch.float8_e5m2))
    # The prefill path (varlen items of many rows): a head size of 2.5 vectors of 32 floats
    # (avx512: a column block of 1 vector left), rows padded, features, fp8.
    for dtype in (torch.float32, torch.bfloat16):
        run(backend, Case(seq_lens=(200, 77), q_lens=(61, 77), num_heads=16, num_kv_heads=2,
                          head_size=80, dtype=dtype, **FEATURES["all"]))
    run(backend, Case(seq_lens=(90, 41), q_lens=(50, 41), num_heads=8, num_kv_heads=1,
                      head_size=128, cache_dtype=torch.float8_e4m3fn, dtype=torch.bfloat16))


# Chunked prefill shapes: (seq_lens, q_lens) with odd lengths, a whole prefill, chunks over a
# cached prefix; on the CPU, query tiles of the prefill path (up to 96 rows, padded) and a
# leftover row (the decode-style path).
PREFILL = ((403, 131, 77), (203, 131, 9))


@pytest.mark.parametrize("heads", [(32, 8), (32, 4)], ids=["gqa4", "gqa8"])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_chunked_prefill(backend, dtype, heads):
    """Prefill-shaped batches (32 query heads, GQA 4 and 8, head size 128): many query tiles
    per sequence, key tiles cut by the causal diagonal, block tables shuffled."""
    if backend.name.startswith("simt"):
        pytest.skip("the emulator takes ~30 s a case at these sizes (its prefill shapes: "
                    "test_varlen_long_prefill, test_chunked_prefill_features)")
    run(backend, Case(seq_lens=PREFILL[0], q_lens=PREFILL[1], num_heads=heads[0],
                      num_kv_heads=heads[1], head_size=128, dtype=dtype))


@pytest.mark.parametrize("feature", ["window", "window-long", "alibi", "softcap", "all"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_chunked_prefill_features(backend, dtype, feature):
    if backend.name.startswith("simt") and feature != "all":
        pytest.skip("the emulator is slow: every feature at once only")
    run(backend, Case(seq_lens=(201, 90, 67), q_lens=(100, 90, 19), num_heads=16,
                      num_kv_heads=4, head_size=64, dtype=dtype, block_size=32,
                      **FEATURES[feature]))


@pytest.mark.parametrize("isa", CPU_ISAS)
def test_cpu_prefill_instruction_sets(backend, isa, monkeypatch):
    """The prefill path of every instruction set this processor has; avx512bf16 takes bfloat16
    dot products (vdpbf16ps) for bfloat16 caches, float FMAs for the others."""
    if backend.name != "cpu":
        pytest.skip("CPU kernels only")
    use_cpu_isa(monkeypatch, isa)
    assert ops.cpu_attention_kernel(128) == isa
    # GQA 4, 8 and 6 (6 x 16 rows); tiles of one query row (decode-style) and of 5 x 4 rows.
    for dtype, heads in ((torch.bfloat16, (32, 8)), (torch.bfloat16, (32, 4)),
                         (torch.float32, (6, 1)), (torch.float16, (32, 8))):
        run(backend, Case(seq_lens=(233, 64, 5), q_lens=(113, 64, 5), num_heads=heads[0],
                          num_kv_heads=heads[1], head_size=128, dtype=dtype, block_size=16))
    # Odd key counts in the last tile (bf16 pairs: a key pair of one key), windows, ALiBi, cap.
    run(backend, Case(seq_lens=(259, 31), q_lens=(77, 31), num_heads=16, num_kv_heads=4,
                      head_size=96, dtype=torch.bfloat16, **FEATURES["all"]))


AMX_CASES = {
    # GQA 4 and 8, odd lengths, tiles of 16 and 32 rows left over, block tables shuffled
    "gqa": dict(seq_lens=(233, 64, 129, 5), q_lens=(113, 64, 3, 5), num_heads=32,
                num_kv_heads=8, head_size=128),
    "gqa8": dict(seq_lens=(403, 131), q_lens=(131, 9), num_heads=32, num_kv_heads=4,
                 head_size=128),
    # key tiles of 128 keys cut anywhere by the causal diagonal and the block size
    "blocks": dict(seq_lens=(300, 161), q_lens=(77, 161), num_heads=16, num_kv_heads=2,
                   head_size=64, block_size=5),
    "features": dict(seq_lens=(259, 31, 200), q_lens=(77, 31, 200), num_heads=16,
                     num_kv_heads=4, head_size=96, **FEATURES["all"]),
    "sinks": dict(seq_lens=(180, 45), q_lens=(60, 45), num_heads=8, num_kv_heads=1,
                  head_size=64, **FEATURES["window-sinks"]),
    # 512-byte rows: 128-key tiles; wider: 64-key tiles
    "head256": dict(seq_lens=(150, 70), q_lens=(40, 70), num_heads=8, num_kv_heads=2,
                    head_size=256, block_size=32),
    "head512": dict(seq_lens=(150, 9), q_lens=(33, 9), num_heads=4, num_kv_heads=1,
                    head_size=512),
    # every query over all keys (the cascade's prefix level), a long key range split
    "non-causal": dict(seq_lens=(64, 1500), q_lens=(70, 33), num_heads=32, num_kv_heads=8,
                       head_size=128, extra=dict(causal=False)),
}


@pytest.mark.parametrize("case", AMX_CASES)
def test_cpu_amx_prefill(backend, case, monkeypatch):
    """bfloat16 prefill on AMX tiles (PAGEDKV_CPU_AMX=1) against the float64 reference; head
    sizes that are no multiple of 32 (80) take the vector path with the tiles asked for."""
    if backend.name != "cpu":
        pytest.skip("CPU kernels only")
    use_amx(monkeypatch)
    assert ops.cpu_amx_tiles(128) and ops.cpu_amx_tiles(64) and not ops.cpu_amx_tiles(80)
    run(backend, Case(dtype=torch.bfloat16, **AMX_CASES[case]))
    if case == "features":
        run(backend, Case(dtype=torch.bfloat16, **dict(AMX_CASES[case], head_size=80)))


def test_cpu_amx_switch(backend, monkeypatch):
    """PAGEDKV_CPU_AMX: unset or 0, the tiles are off (opt-in); a value other than 0 or 1 is
    refused; 1 on a processor without AMX-BF16 is an error naming it, and with a set named that
    has no tiles, off. Errors come before any write."""
    if backend.name != "cpu":
        pytest.skip("CPU kernels only")
    monkeypatch.delenv("PAGEDKV_CPU_ISA", raising=False)
    monkeypatch.delenv("PAGEDKV_CPU_AMX", raising=False)
    has = AMX_FLAGS | CPU_ISAS["avx512bf16"] <= cpu_flags()
    assert not ops.cpu_amx_tiles(128)
    if has:
        monkeypatch.setenv("PAGEDKV_CPU_AMX", "1")
        monkeypatch.setenv("PAGEDKV_CPU_ISA", "avx512")
        assert not ops.cpu_amx_tiles(128)
        monkeypatch.delenv("PAGEDKV_CPU_ISA")
    monkeypatch.setenv("PAGEDKV_CPU_AMX", "0")
    assert not ops.cpu_amx_tiles(128)
    args = make_args(Case(seq_lens=(5, 20), q_lens=(2, 3)), backend.device)
    args["out"].fill_(float("nan"))
    for value, want in (("yes", "PAGEDKV_CPU_AMX must be 0 or 1"),
                        ("1", "PAGEDKV_CPU_AMX=1: this processor has no AMX-BF16")):
        monkeypatch.setenv("PAGEDKV_CPU_AMX", value)
        if value == "1" and has:
            continue  # (test_cpu_amx_prefill runs them)
        with pytest.raises(ValueError, match=want):
            call(backend.ops.paged_attention, args)
        assert args["out"].isnan().all()


def test_cpu_peak_probe(backend, monkeypatch):
    """pagedkv.ops.cpu_peak_gflops: a positive rate of float FMAs; bf16 dot products only with
    AVX512_BF16 (a ValueError naming it elsewhere); a bad kind refused."""
    if backend.name != "cpu":
        pytest.skip("CPU kernels only")
    monkeypatch.delenv("PAGEDKV_CPU_ISA", raising=False)
    assert 0 < ops.cpu_peak_gflops("fp32", 0.001) < float("inf")
    if cpu_has("avx512bf16"):
        assert 0 < ops.cpu_peak_gflops("bf16", 0.001) < float("inf")
    else:
        with pytest.raises(ValueError, match="AVX512_BF16"):
            ops.cpu_peak_gflops("bf16", 0.001)
    with pytest.raises(ValueError, match="kind must be 'fp32' or 'bf16'"):
        ops.cpu_peak_gflops("int8", 0.001)
    with pytest.raises(ValueError, match="seconds must be in"):
        ops.cpu_peak_gflops("fp32", 0.0)
    monkeypatch.setenv("PAGEDKV_CPU_ISA", "base")
    assert ops.cpu_peak_gflops("fp32", 0.001) > 0


@pytest.mark.parametrize("isa", CPU_ISAS)
def test_cpu_bf16_dot_products(backend, isa, monkeypatch):
    """pagedkv.ops.cpu_bf16_dot_products: only the avx512bf16 kernels take bf16 dot products,
    always when PAGEDKV_CPU_ISA names them, never for a head size that is no multiple of 16
    (avx2 runs it); a bad head size refused. Unset, the measured rule (tests/tools/test_cli.py)."""
    if backend.name != "cpu":
        pytest.skip("CPU kernels only")
    use_cpu_isa(monkeypatch, isa)
    assert ops.cpu_bf16_dot_products(128) == (isa == "avx512bf16")
    assert not ops.cpu_bf16_dot_products(88)
    with pytest.raises(RuntimeError, match="head_size must be positive"):
        ops.cpu_bf16_dot_products(0)


@pytest.mark.parametrize("isa", ["sse9", "avx2", "avx512", "avx512bf16"])
def test_cpu_instruction_set_refused(backend, isa, monkeypatch):
    """PAGEDKV_CPU_ISA naming no instruction set, or one this processor lacks, is an error that
    names it, raised before anything is written."""
    if backend.name != "cpu":
        pytest.skip("CPU kernels only")
    if isa in CPU_ISAS and cpu_has(isa):
        pytest.skip(f"this processor has {isa}")
    monkeypatch.setenv("PAGEDKV_CPU_ISA", isa)
    want = "must be one of base avx2 avx512" if isa not in CPU_ISAS else f"has no {isa}"
    args = make_args(Case(seq_lens=(5, 20), q_lens=(2, 3)), backend.device)
    args["out"].fill_(float("nan"))
    with pytest.raises(ValueError, match=f"PAGEDKV_CPU_ISA.*{want}"):
        call(backend.ops.paged_attention, args)
    assert args["out"].isnan().all()
    with pytest.raises(ValueError, match=want):
        ops.cpu_attention_kernel(128)


def test_opcheck(backend):
    args = make_args(Case(seq_lens=(5, 20), q_lens=(2, 3), alibi=True, sliding_window=4,
                          soft_cap=3.0, dtype=torch.bfloat16), backend.device)
    op = backend.ops.paged_attention.default
    torch.library.opcheck(op, tuple(args[k] for k in OP_ARGS))


def test_compiles_fullgraph(backend):
    import pagedkv

    if backend.name != "cpu":
        pytest.skip("pagedkv.ops wraps torch.ops.pagedkv only")
    args = make_args(Case(seq_lens=(5, 20), q_lens=(2, 3)), backend.device)

    def step(query, out, lse):
        pagedkv.ops.paged_attention(out, query * 1, args["key_cache"], args["value_cache"],
                                    args["block_tables"], args["seq_lens"],
                                    args["query_start_loc"], 20, 3, 0.125, lse_out=lse)
        return out.sum()

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    compiled(args["query"], args["out"], args["lse_out"])
    check(args)


# --- kernel dispatch on cuda and simt: PAGEDKV_ATTENTION_KERNEL and the automatic rule ---------

# (case, kernel that automatic dispatch picks): the tensor-core kernel from 8 (query token, query
# head) rows per kv head on (fp8 caches: from 4), for 16-bit queries with a cache of their dtype
# or fp8, rows aligned.
DISPATCH = {
    "bf16 decode group 4": (Case(dtype=torch.bfloat16), "cuda_core"),
    "bf16 decode group 8": (Case(dtype=torch.bfloat16, num_heads=16), "tensor_core"),
    "f16 chunks group 4": (Case(dtype=torch.float16, seq_lens=(9, 40), q_lens=(2, 7)),
                           "tensor_core"),
    "bf16 head 256 prefill": (Case(dtype=torch.bfloat16, head_size=256, seq_lens=(40, 3),
                                   q_lens=(24, 1)), "tensor_core"),
    "f32 chunks": (Case(seq_lens=(9, 40), q_lens=(2, 7)), "cuda_core"),
    "fp8 cache chunks": (Case(dtype=torch.bfloat16, cache_dtype=torch.float8_e4m3fn,
                              seq_lens=(9, 40), q_lens=(2, 7)), "tensor_core"),
    "f16 fp8 e5m2 decode group 4": (Case(dtype=torch.float16, cache_dtype=torch.float8_e5m2),
                                    "tensor_core"),
    "bf16 fp8 e4m3 decode group 2": (Case(dtype=torch.bfloat16, cache_dtype=torch.float8_e4m3fn,
                                          num_heads=4), "cuda_core"),
    "bf16 unaligned rows": (Case(dtype=torch.bfloat16, seq_lens=(9, 40), q_lens=(2, 7)),
                            "cuda_core"),
}


def _with_kernel(backend, args, kernel, monkeypatch) -> dict:
    monkeypatch.setenv("PAGEDKV_ATTENTION_KERNEL", kernel)
    again = rerun(backend, args)
    check(again)
    return again


def _same(a: dict, b: dict) -> bool:
    return torch.equal(a["out"], b["out"]) and torch.equal(a["lse_out"], b["lse_out"])


@pytest.mark.parametrize("name", DISPATCH)
def test_kernel_dispatch(backend, name, monkeypatch):
    """Forced kernels differ in their rounding (the tensor-core one rounds P to the query dtype),
    so which kernel ran shows in the bits: auto must match the kernel the rule names, and forcing
    the tensor-core kernel on a call it does not support must run the CUDA-core one."""
    if backend.name == "cpu" or backend.attention_kernel is not None:
        pytest.skip("the CUDA-source backends, once each")
    case, want = DISPATCH[name]
    monkeypatch.setenv("PAGEDKV_ATTENTION_KERNEL", "auto")
    auto = make_args(case)
    if "unaligned" in name:
        misalign_cache_rows(auto)
    auto = to_device(auto, backend.device)
    call(backend.ops.paged_attention, auto)
    check(auto)
    cuda_core = _with_kernel(backend, auto, "cuda_core", monkeypatch)
    tensor_core = _with_kernel(backend, auto, "tensor_core", monkeypatch)
    supported = case.dtype != torch.float32 and "unaligned" not in name
    assert _same(cuda_core, tensor_core) != supported
    assert _same(auto, tensor_core if want == "tensor_core" else cuda_core)
    monkeypatch.delenv("PAGEDKV_ATTENTION_KERNEL")
    assert _same(rerun(backend, auto), auto)  # unset is auto
    if "unaligned" not in name:
        assert auto_picks_tensor_cores(case) == (want == "tensor_core")  # the -tc backends' skip


def test_kernel_switch_refuses_unknown_names(backend, monkeypatch):
    if backend.name == "cpu" or backend.attention_kernel is not None:
        pytest.skip("the CUDA-source backends, once each")
    args = make_args(Case(seq_lens=(5, 20), q_lens=(2, 3), dtype=torch.bfloat16), backend.device)
    monkeypatch.setenv("PAGEDKV_ATTENTION_KERNEL", "tensor_cores")
    with pytest.raises(ValueError, match="PAGEDKV_ATTENTION_KERNEL must be one of auto "
                                         "cuda_core tensor_core, got 'tensor_cores'"):
        call(backend.ops.paged_attention, args)
    assert args["out"].isnan().all() and args["lse_out"].isnan().all()


# --- bad input: a clear error naming the argument, before anything is written -----------------

def _set(name, fn):
    return lambda a: a.__setitem__(name, fn(a))


BAD = {
    "query dtype": (_set("query", lambda a: a["query"].double()), "query must be float32"),
    "query rank": (_set("query", lambda a: a["query"][0]), "query must be 3-D"),
    "query last dim": (_set("query", lambda a: a["query"].transpose(0, 2).contiguous()
                            .transpose(0, 2)), "query must have a contiguous last"),
    "out dtype": (_set("out", lambda a: a["out"].half()), "out must have query's dtype"),
    "out shape": (_set("out", lambda a: a["out"][:, :4]), "out must have query's shape"),
    "cache dtype": (_set("key_cache", lambda a: a["key_cache"].half()),
                    "same dtype|must have query's dtype"),
    "cache vs query dtype": (lambda a: a.update(key_cache=a["key_cache"].half(),
                                                value_cache=a["value_cache"].half()),
                             "key_cache must have query's dtype"),
    "cache head size": (lambda a: a.update(key_cache=a["key_cache"][..., :32],
                                           value_cache=a["value_cache"][..., :32]),
                        "head_size 32 must match"),
    "cache last dim": (lambda a: a.update(key_cache=a["key_cache"].transpose(2, 3),
                                          value_cache=a["value_cache"].transpose(2, 3)),
                       "contiguous last"),
    "head size": (lambda a: a.update(query=a["query"][..., :12], out=a["out"][..., :12],
                                     key_cache=a["key_cache"][..., :12],
                                     value_cache=a["value_cache"][..., :12]),
                  "head_size must be a multiple of 8"),
    "heads ratio": (lambda a: a.update(query=a["query"][:, :3], out=a["out"][:, :3],
                                       lse_out=None), "multiple of num_kv_heads"),
    "fp8 without scale": (lambda a: a.update(key_cache=a["key_cache"].to(torch.float8_e4m3fn),
                                             value_cache=a["value_cache"].to(
                                                 torch.float8_e4m3fn)),
                          "k_scale is required"),
    "scale without fp8": (_set("k_scale", lambda a: torch.ones(1)), "only used with fp8"),
    "block_tables dtype": (_set("block_tables", lambda a: a["block_tables"].long()),
                           "block_tables must be Int"),
    "block_tables rows": (_set("block_tables", lambda a: a["block_tables"][:2]),
                          "seq_lens must be \\[num_seqs\\]"),
    "seq_lens dtype": (_set("seq_lens", lambda a: a["seq_lens"].long()), "seq_lens must be Int"),
    "query_start_loc dtype": (_set("query_start_loc", lambda a: a["query_start_loc"].long()),
                              "query_start_loc must be Int"),
    "query_start_loc size": (_set("query_start_loc", lambda a: a["query_start_loc"][:-1]),
                             "query_start_loc must be \\[num_seqs \\+ 1\\]"),
    "query_start_loc first": (_set("query_start_loc", lambda a: a["query_start_loc"] + 1),
                              "query_start_loc\\[0\\] must be 0"),
    "query_start_loc last": (_set("query_start_loc", lambda a: torch.tensor(
        [0, 1, 2, 4, 5], dtype=torch.int32)), "query_start_loc\\[-1\\] must be num_tokens"),
    "query_start_loc order": (_set("query_start_loc", lambda a: torch.tensor(
        [0, 1, 0, 5, 10], dtype=torch.int32)), "must be non-decreasing"),
    "q_len > seq_len": (_set("seq_lens", lambda a: torch.tensor([1, 1, 100, 33],
                                                                dtype=torch.int32)),
                        "has 2 query tokens .* but seq_lens\\[1\\] = 1"),
    "q_len > max_query_len": (_set("max_query_len", lambda a: 3), "more than max_query_len"),
    "decode token count": (_set("query_start_loc", lambda a: None),
                           "one token per sequence"),
    "seq_len > max_seq_len": (_set("max_seq_len", lambda a: 99), "outside \\[0, max_seq_len"),
    "negative seq_len": (_set("seq_lens", lambda a: torch.tensor([-1, 17, 100, 33],
                                                                 dtype=torch.int32)),
                         "seq_lens\\[0\\] = -1"),
    "block id too large": (lambda a: a["block_tables"].__setitem__((2, 3), 10**6),
                           "block_tables\\[2, 3\\] = 1000000 is out of range"),
    "block id negative": (lambda a: a["block_tables"].__setitem__((1, 0), -1),
                          "block_tables\\[1, 0\\] = -1"),
    "too few table columns": (_set("block_tables", lambda a: a["block_tables"][:, :3].clone()),
                              "needs 7 blocks"),
    "sliding_window": (_set("sliding_window", lambda a: 0), "sliding_window must be -1"),
    "soft_cap": (_set("soft_cap", lambda a: -1.0), "soft_cap must be 0"),
    "alibi shape": (_set("alibi_slopes", lambda a: torch.ones(3)), "alibi_slopes must be"),
    "alibi dtype": (_set("alibi_slopes", lambda a: torch.ones(8).double()),
                    "alibi_slopes must be Float"),
    "lse dtype": (_set("lse_out", lambda a: a["lse_out"].double()), "lse_out must be float32"),
    "lse shape": (_set("lse_out", lambda a: a["lse_out"][:, :2]), "lse_out must be"),
}


# Checks of index contents: made on the host, so on GPUs only with PAGEDKV_CHECK_INDICES=1.
INDEX_CONTENTS = {
    "query_start_loc first", "query_start_loc last", "query_start_loc order", "q_len > seq_len",
    "q_len > max_query_len", "seq_len > max_seq_len", "negative seq_len", "block id too large",
    "block id negative", "too few table columns",
}


@pytest.mark.parametrize("name", BAD)
def test_rejects_bad_input(backend, name):
    if name in INDEX_CONTENTS and backend.device.type != "cpu":
        pytest.skip("index contents are checked on the host only for host tensors")
    args = make_args(Case(seq_lens=(1, 17, 100, 33), q_lens=(1, 2, 3, 4)), "cpu")
    mutate, message = BAD[name]
    mutate(args)
    args = {k: v.to(backend.device) if isinstance(v, torch.Tensor) else v
            for k, v in args.items()}
    out, lse = args["out"], args["lse_out"]
    with pytest.raises(RuntimeError, match=message):
        call(backend.ops.paged_attention, args)
    assert torch.isnan(out).all()
    if lse is not None:
        assert torch.isnan(lse).all()


@pytest.mark.parametrize("what", ["num_seqs", "num_kv_heads"])
def test_grid_limits_are_checked_with_a_clear_error(backend, what):
    """Sequences and kv heads are the CUDA kernel's grid y / z (at most 65535 each): the CUDA
    and simt glue refuse more with a message naming the argument, before anything is written;
    the CPU kernels have no such limit."""
    if backend.name == "cpu":
        pytest.skip("the CPU kernels have no grid")
    n = 65536
    if what == "num_seqs":
        case = Case(seq_lens=(0,) * n, num_heads=1, num_kv_heads=1, head_size=8, lse=False)
    else:
        case = Case(seq_lens=(1,), num_heads=n, num_kv_heads=n, head_size=8, block_size=1,
                    lse=False)
    args = make_args(case, backend.device)
    with pytest.raises(RuntimeError, match=f"{what} {n} exceeds 65535, the kernel's grid limit"):
        call(backend.ops.paged_attention, args)
    assert torch.isnan(args["out"]).all()
