"""The ops under CUDA graph capture (docs/architecture.md promises it): one decode step,
reshape_and_cache then paged_attention, captured in a torch.cuda.CUDAGraph and replayed with new
inputs copied into its static tensors, against the same step run eagerly.

The capture runs only where a GPU is visible; CI has none (the simt backend runs the CUDA
kernels there, but graph capture needs the CUDA runtime). What a replay runs, the split-K plan of
the captured max_seq_len applied to longer sequences, is checked on simt too."""

from __future__ import annotations

import pytest
import torch
from attention_cases import Case, call, check, make_args

from pagedkv import ops

requires_gpu = [
    pytest.mark.skipif(
        not torch.cuda.is_available(),
        reason="CUDA graph capture needs an NVIDIA GPU (torch.cuda.is_available() is False)",
    ),
    pytest.mark.skipif(
        not torch._C._dispatch_has_kernel_for_dispatch_key("pagedkv::paged_attention", "CUDA"),
        reason="pagedkv._C was built without its CUDA kernels",
    ),
]

NUM_SEQS, NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE = 5, 8, 2, 128
BLOCK_SIZE, MAX_BLOCKS, NUM_BLOCKS = 16, 16, 96
MAX_SEQ_LEN = BLOCK_SIZE * MAX_BLOCKS  # the host int captured with the graph


def new_inputs(gen: torch.Generator, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """One decode step's inputs on the CPU: each sequence's new token K/V, its query, a block
    table of distinct blocks, a length up to MAX_SEQ_LEN and the slot of its last position."""
    seq_lens = torch.randint(1, MAX_SEQ_LEN + 1, (NUM_SEQS,), generator=gen, dtype=torch.int32)
    perm = torch.randperm(NUM_BLOCKS, generator=gen)[: NUM_SEQS * MAX_BLOCKS]
    tables = perm.view(NUM_SEQS, MAX_BLOCKS).to(torch.int32)
    last = (seq_lens - 1).long()
    slots = tables.long().gather(1, (last // BLOCK_SIZE)[:, None])[:, 0] * BLOCK_SIZE
    slots += last % BLOCK_SIZE

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(dtype)

    return dict(
        key=randn(NUM_SEQS, NUM_KV_HEADS, HEAD_SIZE),
        value=randn(NUM_SEQS, NUM_KV_HEADS, HEAD_SIZE),
        query=randn(NUM_SEQS, NUM_HEADS, HEAD_SIZE),
        block_tables=tables,
        seq_lens=seq_lens,
        slot_mapping=slots,
    )


def step(t: dict[str, torch.Tensor]) -> None:
    """One decode step over the tensors in t (the graph's static ones, or eager copies)."""
    ops.reshape_and_cache(t["key"], t["value"], t["key_cache"], t["value_cache"],
                          t["slot_mapping"])
    ops.paged_attention(t["out"], t["query"], t["key_cache"], t["value_cache"],
                        t["block_tables"], t["seq_lens"], None, max_seq_len=MAX_SEQ_LEN,
                        max_query_len=1, scale=HEAD_SIZE**-0.5, lse_out=t["lse_out"])


@requires_gpu[0]
@requires_gpu[1]
@pytest.mark.parametrize("kernel", ["auto", "tensor_core"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_decode_step_replays_like_eager(dtype, kernel, monkeypatch):
    """Under automatic dispatch (the CUDA-core kernel for this group of 4) and with the
    tensor-core kernel forced (PAGEDKV_ATTENTION_KERNEL, read at capture)."""
    monkeypatch.setenv("PAGEDKV_ATTENTION_KERNEL", kernel)
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    cache_shape = (NUM_BLOCKS, NUM_KV_HEADS, BLOCK_SIZE, HEAD_SIZE)
    static = {k: v.to(dev) for k, v in new_inputs(gen, dtype).items()}
    static.update(
        key_cache=torch.randn(cache_shape, generator=gen).to(dtype).to(dev),
        value_cache=torch.randn(cache_shape, generator=gen).to(dtype).to(dev),
        out=torch.empty(NUM_SEQS, NUM_HEADS, HEAD_SIZE, dtype=dtype, device=dev),
        lse_out=torch.empty(NUM_SEQS, NUM_HEADS, device=dev),
    )
    side = torch.cuda.Stream()  # warm up off the default stream, as capture requires
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step(static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(static)

    outs = []
    for _ in range(3):
        for name, value in new_inputs(gen, dtype).items():
            static[name].copy_(value)
        static["out"].fill_(float("nan"))  # the replay must write every output
        static["lse_out"].fill_(float("nan"))
        eager = {k: v.clone() for k, v in static.items()}  # caches as before the replay
        graph.replay()
        step(eager)
        torch.cuda.synchronize()
        assert not static["out"].isnan().any() and not static["lse_out"].isnan().any()
        for name in ("key_cache", "value_cache"):  # the new tokens were written in place
            assert torch.equal(static[name], eager[name]), name
            rows = static[name][static["slot_mapping"] // BLOCK_SIZE, :,
                                static["slot_mapping"] % BLOCK_SIZE]
            assert torch.equal(rows, static[name.split("_")[0]])
        torch.testing.assert_close(static["out"], eager["out"], rtol=0, atol=1e-3)
        torch.testing.assert_close(static["lse_out"], eager["lse_out"], rtol=0, atol=1e-5)
        outs.append(static["out"].clone())
    assert not torch.equal(outs[0], outs[1])  # new inputs, new results: nothing was baked in


@pytest.mark.parametrize("kernel", ["cuda_core", "tensor_core"])
@pytest.mark.parametrize("seq_lens", [(600, 300), (1000, 129), (513, 17)])
def test_a_replay_of_longer_sequences_reads_every_key(seq_lens, kernel, monkeypatch):
    """A graph captured with max_seq_len 256 keeps that split-K plan (the CUDA-core kernel: 2
    partitions of 128 keys) and replays it on longer sequences: the last partition runs to the end
    of each context, so no key is dropped. Run on simt with the plan of the capture, on both
    kernels (PAGEDKV_ATTENTION_KERNEL)."""
    monkeypatch.setenv("PAGEDKV_ATTENTION_KERNEL", kernel)
    simt = pytest.importorskip("pagedkv.ops.simt")
    if not simt.available():
        pytest.skip("pagedkv._simt is not built (no CUDA toolkit headers)")
    case = Case(seq_lens=seq_lens, num_heads=NUM_HEADS, num_kv_heads=NUM_KV_HEADS,
                head_size=HEAD_SIZE, dtype=torch.bfloat16)
    args = make_args(case)
    simt.set_plan_max_seq_len(256)
    try:
        with simt.profile() as prof:
            call(simt.ops.paged_attention, args)
    finally:
        simt.set_plan_max_seq_len(0)
    grid = prof.launches[0]["grid"]
    assert len(prof.launches) == 2  # split-K: the attention kernel, then the reduce kernel
    if kernel == "cuda_core":
        assert grid[0] == 2  # the plan of max_seq_len 256 split in two
    check(args)
