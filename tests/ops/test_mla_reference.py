"""The MLA reference ops: absorbed attention over a paged latent cache equals DeepSeek's
non-absorbed multi-head attention with random up-projections, and the latent cache's write and
gather round-trip (fp8 with its scale), on shuffled block tables and odd lengths."""

from __future__ import annotations

import pytest
import torch

from pagedkv.ops import reference

LORA, ROPE, NOPE, V_HEAD, HEADS = 40, 16, 24, 20, 4  # DeepSeek-V3: 512, 64, 128, 128, 128


def paged_latents(seq_lens: list[int], block_size: int, width: int, generator: torch.Generator,
                  dtype: torch.dtype = torch.float64):
    """Random latent rows per sequence, written into a NaN-filled cache through shuffled block
    tables: (rows per sequence, cache, block tables)."""
    per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(per_seq) + 3
    order = torch.randperm(num_blocks - 1, generator=generator)[:sum(per_seq)] + 1
    tables = torch.full((len(seq_lens), max(per_seq)), -1, dtype=torch.int32)
    cache = torch.full((num_blocks, block_size, width), float("nan"), dtype=dtype)
    rows, used = [], 0
    for seq, n in enumerate(seq_lens):
        tables[seq, :per_seq[seq]] = order[used:used + per_seq[seq]].int()
        used += per_seq[seq]
        latent = torch.randn(n, width, generator=generator, dtype=dtype)
        positions = torch.arange(n)
        slots = tables[seq].long()[positions // block_size] * block_size + positions % block_size
        reference.concat_and_cache_mla(latent[:, :LORA], latent[:, LORA:], cache, slots)
        rows.append(latent)
    return rows, cache, tables


def mha(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):
    """Causal attention of the last ``len(q)`` positions: ``[q, H, d]`` over ``[n, H, d]``."""
    n, q_len = k.shape[0], q.shape[0]
    logits = scale * torch.einsum("qhd,khd->hqk", q, k)
    causal = torch.arange(n)[None, :] > torch.arange(n - q_len, n)[:, None]
    logits = logits.masked_fill(causal, float("-inf"))
    lse = torch.logsumexp(logits, -1)
    return torch.einsum("hqk,khd->qhd", torch.exp(logits - lse[..., None]), v), lse.T


@pytest.mark.parametrize("block_size", [1, 5, 16])
@pytest.mark.parametrize("query_lens", [[1, 1, 1], [1, 4, 7]], ids=["decode", "varlen"])
def test_absorbed_attention_equals_the_non_absorbed_form(block_size, query_lens) -> None:
    """q_nope . (W_UK^T c) = (W_UK q_nope) . c, and attention's output times W_UV is the
    attention of the up-projected values: the absorbed op over the cache gives DeepSeek's MHA."""
    g = torch.Generator().manual_seed(block_size + len(query_lens) + sum(query_lens))
    seq_lens = [9, 13, 30]
    rows, cache, tables = paged_latents(seq_lens, block_size, LORA + ROPE, g)
    w_uk = torch.randn(HEADS, LORA, NOPE, generator=g, dtype=torch.float64) / LORA**0.5
    w_uv = torch.randn(HEADS, LORA, V_HEAD, generator=g, dtype=torch.float64) / LORA**0.5
    total = sum(query_lens)
    q_nope = torch.randn(total, HEADS, NOPE, generator=g, dtype=torch.float64)
    q_pe = torch.randn(total, HEADS, ROPE, generator=g, dtype=torch.float64)
    scale = (NOPE + ROPE) ** -0.5  # DeepSeek's softmax scale: the non-absorbed head size
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)

    query = torch.cat([torch.einsum("thn,hln->thl", q_nope, w_uk), q_pe], dim=-1)
    latent_out = torch.full((total, HEADS, LORA), float("nan"), dtype=torch.float64)
    lse = torch.full((total, HEADS), float("nan"))
    decode = max(query_lens) == 1
    reference.mla_attention(latent_out, query, cache, tables, torch.tensor(seq_lens).int(),
                            None if decode else starts, max(seq_lens), max(query_lens), scale,
                            lse_out=lse, compute_dtype=torch.float64)
    absorbed = torch.einsum("thl,hlv->thv", latent_out, w_uv)

    for seq, latent in enumerate(rows):
        kv_c, k_pe = latent[:, :LORA], latent[:, LORA:]
        k = torch.cat([torch.einsum("sl,hln->shn", kv_c, w_uk),
                       k_pe[:, None].expand(-1, HEADS, -1)], dim=-1)
        v = torch.einsum("sl,hlv->shv", kv_c, w_uv)
        rows_of = slice(int(starts[seq]), int(starts[seq + 1]))
        q = torch.cat([q_nope[rows_of], q_pe[rows_of]], dim=-1)
        expected, expected_lse = mha(q, k, v, scale)
        torch.testing.assert_close(absorbed[rows_of], expected, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(lse[rows_of], expected_lse.float(), rtol=1e-6, atol=1e-6)


def test_write_skips_negative_slots_and_gather_reads_back() -> None:
    g = torch.Generator().manual_seed(3)
    cache = torch.full((6, 4, LORA + ROPE), float("nan"), dtype=torch.bfloat16)
    kv_c = torch.randn(5, LORA, generator=g).bfloat16()
    k_pe = torch.randn(5, ROPE, generator=g).bfloat16()
    slots = torch.tensor([9, -1, 10, 3, 21])
    reference.concat_and_cache_mla(kv_c, k_pe, cache, slots)
    written = torch.cat([kv_c, k_pe], dim=-1)
    assert torch.equal(cache.view(-1, LORA + ROPE)[slots[slots >= 0]], written[slots >= 0])
    assert int(cache.view(-1, LORA + ROPE).isnan().all(-1).sum()) == 6 * 4 - 4

    # block 2 holds slots 8..11, block 0 slots 0..3, block 5 slots 20..23
    tables = torch.tensor([[2, 0], [5, 2]], dtype=torch.int32)
    out = torch.full((5, LORA + ROPE), float("nan"), dtype=torch.float32)
    reference.gather_cache(cache, tables, torch.tensor([0, 2, 5]), out,
                           seq_starts=torch.tensor([1, 1]))
    flat = cache.view(-1, LORA + ROPE).float()
    assert torch.equal(out[:2], flat[[9, 10]])  # sequence 0: positions 1, 2 of block 2
    assert torch.equal(out[2], flat[21])  # sequence 1: position 1 of block 5
    assert out[3:].isnan().all()  # its positions 2, 3 (slots 22, 23) were never written


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_rows_are_scaled_on_write_and_on_gather(dtype) -> None:
    g = torch.Generator().manual_seed(4)
    cache = torch.zeros(3, 8, LORA + ROPE, dtype=dtype)
    kv_c, k_pe = torch.randn(7, LORA, generator=g) * 20, torch.randn(7, ROPE, generator=g)
    scale = torch.tensor([0.25])
    reference.concat_and_cache_mla(kv_c, k_pe, cache, torch.arange(8, 15), scale)
    raw = torch.empty(7, LORA + ROPE, dtype=dtype)
    reference.gather_cache(cache, torch.tensor([[1, 0]], dtype=torch.int32),
                           torch.tensor([0, 7]), raw)  # fp8 out: the rows as stored
    stored = reference.quantize(torch.cat([kv_c, k_pe], dim=-1), dtype, scale)
    assert torch.equal(raw.view(torch.uint8), stored.view(torch.uint8))
    out = torch.empty(7, LORA + ROPE)
    reference.gather_cache(cache, torch.tensor([[1, 0]], dtype=torch.int32),
                           torch.tensor([0, 7]), out, scale)
    relative = 2.0 ** -(3 if dtype == torch.float8_e4m3fn else 2)
    torch.testing.assert_close(out, torch.cat([kv_c, k_pe], dim=-1), rtol=relative, atol=0.25)
