"""The traffic contract of the tensor-core MLA kernel, counted by the simt emulator (docs/simt.md,
Traffic): each latent byte a row tile needs is read from global memory once by that tile (S and
P V share one staged copy), in full 32-byte sectors, for 16-bit and fp8 latents, any block
size; a decode of up to 16 heads is one row tile, more heads take ceil(rows / 64) of them."""

from __future__ import annotations

import math

import pytest
import torch
from test_mla_attention import DEEPSEEK, OP_ARGS, check, make_args

simt = pytest.importorskip("pagedkv.ops.simt")
if not simt.available():
    pytest.skip("pagedkv._simt is not built (no CUDA toolkit headers)", allow_module_level=True)

KERNEL = "mla_attention_tc_kernel"


def profiled(args: dict):
    """The op on simt under the traffic counters, its outputs checked; the profile."""
    with simt.profile() as prof:
        simt.ops.mla_attention(*(args[name] for name in OP_ARGS))
    check(args)
    return prof


def latent_traffic(args: dict) -> dict:
    return profiled(args).total(KERNEL, "kv")


@pytest.mark.parametrize("cache_dtype", [None, torch.float8_e4m3fn], ids=["bf16", "fp8"])
@pytest.mark.parametrize("heads, q_lens, tiles", [(16, None, 1), (128, None, 2),
                                                  (16, [2, 2, 2], 1), (8, [3, 1, 4], 1)])
@pytest.mark.parametrize("block_size", [1, 16, 64])
def test_each_latent_byte_is_read_once_per_row_tile(cache_dtype, heads, q_lens, tiles,
                                                    block_size):
    seq_lens = [37, 70, 5]
    args = make_args(seq_lens, q_lens, heads=heads, shape=DEEPSEEK, block_size=block_size,
                     dtype=torch.bfloat16, cache_dtype=cache_dtype, seed=block_size)
    kv = latent_traffic(args)
    element = 1 if cache_dtype is not None else 2
    latent_bytes = sum(seq_lens) * sum(DEEPSEEK) * element
    assert kv["distinct_bytes"] == latent_bytes
    assert kv["bytes"] == tiles * latent_bytes
    assert kv["sector_efficiency"] >= 0.9, kv


def test_the_rows_of_a_prefill_tile_read_their_causal_prefix_once():
    """A 64-row tile of 5 heads (12.8 tokens) reads the keys up to its last row's position, once:
    tile i of a 40-token chunk over 30 cached rows reads 30 + (64 i + 63) // 5 + 1 keys (the
    last one to the end)."""
    heads, cached, chunk = 5, 30, 40
    args = make_args([cached + chunk], [chunk], heads=heads, shape=(64, 16),
                     dtype=torch.float16)
    kv = latent_traffic(args)
    tiles = math.ceil(chunk * heads / 64)
    keys = sum(min(cached + (64 * i + 63) // heads + 1, cached + chunk) for i in range(tiles))
    assert kv["bytes"] == keys * 80 * 2
    assert kv["distinct_bytes"] == (cached + chunk) * 80 * 2


@pytest.mark.parametrize("seq_lens, q_lens, heads, split", [([5, 17, 30], None, 16, False),
                                                             ([200, 129], None, 8, True),
                                                             ([150, 9], [12, 9], 3, True)],
                         ids=["decode", "decode-split", "prefill-split"])
def test_every_store_is_counted(seq_lens, q_lens, heads, split):
    """Each byte of out and lse written once, through the counted store(); with split-K each byte
    of the workspace (a kv_lora_rank-wide partial and an lse per token, head and partition) once
    by the MLA kernel."""
    rank = 64
    args = make_args(seq_lens, q_lens, heads=heads, shape=(rank, 16), dtype=torch.bfloat16)
    prof = profiled(args)
    tokens = args["query"].shape[0]
    for tag, size in (("out", tokens * heads * rank * 2), ("lse", tokens * heads * 4)):
        counted = prof.total(None, tag, "store")
        assert counted["bytes"] == counted["distinct_bytes"] == size, (tag, counted)
    launch = next(x for x in prof.launches if KERNEL in x["kernel"])
    rows = args["max_query_len"] * heads
    parts = launch["grid"][0] // math.ceil(rows / (16 if rows <= 16 else 64))
    assert (parts > 1) == split, parts
    written = prof.total(KERNEL, "workspace", "store")
    expected = tokens * heads * parts * (rank + 1) * 4 if parts > 1 else 0
    assert written["bytes"] == written["distinct_bytes"] == expected, written


def test_a_plan_for_shorter_sequences_still_reads_every_key():
    """As a CUDA graph captured at max_seq_len 64 replays a 500-key decode: the plan's last
    partition runs to the end of the context, so every latent row is read once and the result
    is exact."""
    args = make_args([500, 20], heads=16, shape=DEEPSEEK, dtype=torch.bfloat16)
    simt.set_plan_max_seq_len(64)
    try:
        prof = profiled(args)
    finally:
        simt.set_plan_max_seq_len(0)
    kv = prof.total(KERNEL, "kv")
    assert kv["bytes"] == kv["distinct_bytes"] == 520 * sum(DEEPSEEK) * 2
    assert prof.launches[0]["grid"][0] == 2  # the plan of 64 keys, split in two
