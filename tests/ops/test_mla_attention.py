"""mla_attention against the float64 MLA reference: decode, multi-token decode (MTP) and varlen
causal prefill over a cached latent prefix; 1 to 128 heads; block sizes 1 to 256 through
shuffled block tables; odd lengths; split-K (long sequences); fp8 latents; lse; NaN-poisoned
outputs; merge_attn_states over a split context; bad arguments refused before anything is
written. The tolerance is attention_cases' rule: within twice the float32 reference's own error
(both against float64) plus a small floor; float32's floor is 1e-5, since the kernels add a
576-long dot product in one chain of a register tile (about 3x the pairwise sums' error)."""

from __future__ import annotations

import math

import pytest
import torch
from attention_cases import max_err

from pagedkv import ops
from pagedkv.ops import reference

from helpers import FLOAT_DTYPES, FP8_DTYPES

DEEPSEEK = (512, 64)  # (kv_lora_rank, rope_dim)
SMALL = (40, 8)
FP8_SCALE = 0.03
OP_ARGS = ops.arg_names("mla_attention")


def make_args(seq_lens, q_lens=None, *, heads=16, shape=SMALL, block_size=16,
              dtype=torch.float32, cache_dtype=None, lse=True, seed=0) -> dict:
    """The op's arguments: random latents in a NaN-filled cache through shuffled block tables
    (a padding column of -1 at least), out and lse_out poisoned with NaN."""
    g = torch.Generator().manual_seed(seed)
    lora, rope = shape
    width = lora + rope
    cache_dtype = cache_dtype or dtype
    blocks = [math.ceil(n / block_size) for n in seq_lens]
    num_blocks = sum(blocks) + 3
    perm = torch.randperm(num_blocks, generator=g).tolist()
    table = torch.full((len(seq_lens), max(blocks + [1]) + 1), -1, dtype=torch.int32)
    used = 0
    for i, n in enumerate(blocks):
        table[i, :n] = torch.tensor(perm[used:used + n], dtype=torch.int32)
        used += n
    latent = torch.randn(num_blocks, block_size, width, generator=g)
    kv_scale = None
    if cache_dtype in FP8_DTYPES:
        kv_scale = torch.tensor([FP8_SCALE])
        latent = latent * FP8_SCALE * 4  # values that use the fp8 range after / scale
    cache = reference.quantize(latent, cache_dtype, kv_scale)
    decode = q_lens is None
    q_lens = [1] * len(seq_lens) if decode else list(q_lens)
    tokens = sum(q_lens)
    query = torch.randn(tokens, heads, width, generator=g).to(dtype)
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    return dict(
        out=torch.full((tokens, heads, lora), float("nan"), dtype=dtype),
        query=query,
        kv_cache=cache,
        block_tables=table,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        query_start_loc=None if decode else starts,
        max_seq_len=max(seq_lens),
        max_query_len=max(q_lens),
        scale=(128 + rope) ** -0.5,  # DeepSeek's: the non-absorbed qk head size
        kv_scale=kv_scale,
        lse_out=torch.full((tokens, heads), float("nan")) if lse else None,
    )


def run(args: dict) -> None:
    ops.mla_attention(**{name: args[name] for name in OP_ARGS})


def reference_outputs(args: dict, compute_dtype: torch.dtype):
    a = dict(args)
    out_dtype = torch.float64 if compute_dtype == torch.float64 else args["out"].dtype
    a["out"] = torch.empty(args["out"].shape, dtype=out_dtype)
    a["lse_out"] = torch.empty(args["query"].shape[:2])
    reference.mla_attention(**{name: a[name] for name in OP_ARGS}, compute_dtype=compute_dtype)
    return a["out"].double(), a["lse_out"].double()


def check(args: dict) -> None:
    want, want_lse = reference_outputs(args, torch.float64)
    torch_out, torch_lse = reference_outputs(args, torch.float32)
    floor = {torch.float32: 1e-5, torch.float16: 1e-4, torch.bfloat16: 1e-3}[args["out"].dtype]
    err, torch_err = max_err(args["out"], want), max_err(torch_out, want)
    assert err <= 2 * torch_err + floor, f"out error {err:.3g}, float32 reference's {torch_err:.3g}"
    if args["lse_out"] is not None:
        err, torch_err = max_err(args["lse_out"], want_lse), max_err(torch_lse, want_lse)
        assert err <= 2 * torch_err + 2e-5, f"lse error {err:.3g}, reference's {torch_err:.3g}"


MODES = {
    "decode": ([1, 37, 300, 129], None),
    "mtp": ([2, 37, 300, 130], [2, 3, 4, 2]),
    "prefill": ([23, 300, 77], [23, 45, 1]),  # one without a cached prefix, one with a long one
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("heads", [1, 16, 128])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_deepseek_shapes(dtype, heads, mode):
    seq_lens, q_lens = MODES[mode]
    args = make_args(seq_lens, q_lens, heads=heads, shape=DEEPSEEK, dtype=dtype)
    run(args)
    check(args)


@pytest.mark.parametrize("block_size", [1, 5, 16, 64, 256])
@pytest.mark.parametrize("mode", MODES)
def test_block_sizes(block_size, mode):
    seq_lens, q_lens = MODES[mode]
    args = make_args(seq_lens, q_lens, heads=12, block_size=block_size, dtype=torch.bfloat16,
                     seed=block_size)
    run(args)
    check(args)


@pytest.mark.parametrize("cache_dtype", FP8_DTYPES, ids=str)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_fp8_latents(dtype, mode, cache_dtype):
    seq_lens, q_lens = MODES[mode]
    args = make_args(seq_lens, q_lens, heads=16, shape=DEEPSEEK, dtype=dtype,
                     cache_dtype=cache_dtype)
    run(args)
    check(args)


@pytest.mark.parametrize("heads, shape", [(16, DEEPSEEK), (97, SMALL), (128, SMALL)])
def test_split_k_over_long_contexts(heads, shape):
    """Long sequences: the planner cuts their keys into partitions (256 keys at least), merged
    by their lse; 97 heads also makes uneven head tiles (49 and 48)."""
    args = make_args([3001], heads=heads, shape=shape, dtype=torch.bfloat16, seed=heads)
    run(args)
    check(args)
    args = make_args([2500, 7], [3, 7], heads=heads, shape=shape, seed=heads + 1)
    run(args)
    check(args)


def test_empty_sequences_and_no_lse():
    args = make_args([0, 9, 0], heads=4, dtype=torch.float32)
    run(args)
    check(args)
    assert torch.all(args["out"][0] == 0) and torch.all(args["out"][2] == 0)
    assert torch.all(args["lse_out"][0] == float("-inf"))
    args = make_args([5, 40], [2, 3], heads=4, lse=False)
    run(args)
    check(args)


def test_strided_out_and_query():
    """out and query as views with token and head strides of their own."""
    args = make_args([33, 70], [3, 5], heads=6, dtype=torch.float16)
    wide = torch.randn(8, 6, 2 * 48).half()
    args["query"] = wide[:, :, 48:]
    args["out"] = torch.full((8, 7, 40), float("nan")).half()[:, 1:]
    run(args)
    check(args)


def test_merge_attn_states_composes():
    """Decode over the first 32 keys and over the rest (a table shifted by two blocks of 16),
    merged by their lse, equals decode over all of them."""
    args = make_args([90], heads=16, shape=DEEPSEEK, dtype=torch.float32)
    whole = dict(args, out=args["out"].clone(), lse_out=args["lse_out"].clone())
    run(whole)
    prefix = dict(args, out=args["out"].clone(), lse_out=args["lse_out"].clone(),
                  seq_lens=torch.tensor([32], dtype=torch.int32))
    suffix = dict(args, out=args["out"].clone(), lse_out=args["lse_out"].clone(),
                  block_tables=args["block_tables"][:, 2:].contiguous(),
                  seq_lens=torch.tensor([58], dtype=torch.int32))
    run(prefix)
    run(suffix)
    merged, merged_lse = torch.empty_like(whole["out"]), torch.empty_like(whole["lse_out"])
    ops.merge_attn_states(merged, merged_lse, prefix["out"], prefix["lse_out"], suffix["out"],
                          suffix["lse_out"])
    torch.testing.assert_close(merged, whole["out"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(merged_lse, whole["lse_out"], rtol=1e-5, atol=1e-5)


def test_opcheck():
    args = make_args([9, 20], [2, 3], heads=4, dtype=torch.bfloat16)
    torch.library.opcheck(torch.ops.pagedkv.mla_attention.default,
                          tuple(args[name] for name in OP_ARGS))


# --- bad input: a clear error naming the argument, and nothing written -------------------------

def _spoil(args: dict, **changes) -> dict:
    return dict(args, **changes)


def bad_cases():
    base = make_args([9, 20], [2, 3], heads=4, dtype=torch.bfloat16)
    q, out, cache = base["query"], base["out"], base["kv_cache"]
    fp8 = make_args([9, 20], [2, 3], heads=4, dtype=torch.bfloat16,
                    cache_dtype=torch.float8_e4m3fn)
    return {
        "cache not as wide as query": (_spoil(base, kv_cache=torch.zeros(
            cache.shape[0], cache.shape[1], 56).bfloat16()), "kv_cache must be as wide"),
        "query without a rope part": (_spoil(base, query=q[..., :40].contiguous()),
                                      "rope_dim"),
        "rank not a multiple of 8": (_spoil(base, out=out[..., :36]), "kv_lora_rank"),
        "out heads": (_spoil(base, out=out[:, :3]), "out must be"),
        "out dtype": (_spoil(base, out=out.float()), "out must have query's dtype"),
        "cache dtype": (_spoil(base, kv_cache=cache.half()), "kv_cache must have query's dtype"),
        "cache rank": (_spoil(base, kv_cache=cache[None]), "kv_cache"),
        "cache not contiguous in its rows": (
            _spoil(base, kv_cache=torch.zeros(5, 48, 16).bfloat16().transpose(1, 2)),
            "contiguous last dim"),
        "fp8 without scale": (_spoil(fp8, kv_scale=None), "kv_scale is required"),
        "scale on a bf16 cache": (_spoil(base, kv_scale=torch.tensor([1.0])), "kv_scale"),
        "block table out of range": (
            _spoil(base, block_tables=torch.full_like(base["block_tables"], 99)),
            "block_tables"),
        "seq_lens over max_seq_len": (_spoil(base, max_seq_len=10), "max_seq_len"),
        "lse shape": (_spoil(base, lse_out=torch.zeros(5, 3)), "lse_out must be"),
        "query_start_loc end": (_spoil(base, query_start_loc=torch.tensor(
            [0, 2, 4], dtype=torch.int32)), "query_start_loc"),
    }


@pytest.mark.parametrize("case", list(bad_cases()))
def test_bad_arguments_are_refused_before_writing(case):
    args, message = bad_cases()[case]
    out_before = args["out"].clone()
    with pytest.raises((RuntimeError, ValueError), match=message):
        run(args)
    assert torch.equal(args["out"].isnan(), out_before.isnan())
