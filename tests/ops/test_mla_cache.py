"""The MLA cache ops on every backend against pagedkv.ops.reference: concat_and_cache_mla
(latent rows written, fp8 quantized, padding slots skipped) and gather_cache (rows read back
through shuffled block tables, from odd start positions, fp8 dequantized), bit for bit, into
NaN-poisoned outputs; bad arguments refused before anything is written."""

from __future__ import annotations

import pytest
import torch

from pagedkv.ops import reference

from helpers import FLOAT_DTYPES, FP8_DTYPES, assert_same_bits, bits, unique_slots

SHAPES = [(512, 64), (40, 8)]  # (kv_lora_rank, rope_dim): DeepSeek's and a small odd one


def poisoned_cache(num_blocks: int, block_size: int, width: int, dtype: torch.dtype, device,
                   row_pad: int = 0) -> torch.Tensor:
    """A NaN-filled cache (0x7f bytes for fp8: NaN in e4m3, a large finite in e5m2), its rows
    ``row_pad`` elements apart beyond their width when row_pad > 0 (a strided view)."""
    full = torch.empty(num_blocks, block_size, width + row_pad, device=device, dtype=dtype)
    if dtype in FP8_DTYPES:
        full.view(torch.uint8).fill_(0x7F)
    else:
        full.fill_(float("nan"))
    return full[..., :width]


def fp8_scale(cache_dtype: torch.dtype, device) -> torch.Tensor | None:
    return torch.tensor([0.043], device=device) if cache_dtype in FP8_DTYPES else None


def write(backend, *, dtype, cache_dtype, block_size, lora, rope, num_tokens=29,
          strided=False, row_pad=0):
    """Writes random latents with the backend and with the reference; returns both caches."""
    dev = backend.device
    num_blocks = -(-2 * num_tokens // block_size) + 1
    cache = poisoned_cache(num_blocks, block_size, lora + rope, cache_dtype, dev, row_pad)
    if strided:  # kv_c and k_pe as slices of one projection output, as DeepSeek's kv_a_proj
        fused = torch.randn(num_tokens, lora + rope + 24, device=dev).to(dtype)
        kv_c, k_pe = fused[:, :lora], fused[:, lora + 24:]
    else:
        kv_c = torch.randn(num_tokens, lora, device=dev).to(dtype)
        k_pe = torch.randn(num_tokens, rope, device=dev).to(dtype)
    slots = unique_slots(num_tokens, num_blocks * block_size, padding=4, device=dev)
    scale = fp8_scale(cache_dtype, dev)
    want = cache.clone()
    reference.concat_and_cache_mla(kv_c, k_pe, want, slots, scale)
    backend.ops.concat_and_cache_mla(kv_c, k_pe, cache, slots, scale)
    return cache, want


@pytest.mark.parametrize("lora,rope", SHAPES)
@pytest.mark.parametrize("block_size", [1, 16, 17])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_concat_matches_reference(backend, dtype, block_size, lora, rope):
    cache, want = write(backend, dtype=dtype, cache_dtype=dtype, block_size=block_size,
                        lora=lora, rope=rope)
    assert_same_bits(cache, want)


@pytest.mark.parametrize("cache_dtype", FP8_DTYPES, ids=str)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_concat_quantizes_fp8_like_reference(backend, dtype, cache_dtype):
    cache, want = write(backend, dtype=dtype, cache_dtype=cache_dtype, block_size=16, lora=40,
                        rope=8)
    assert_same_bits(cache, want)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_concat_with_strided_inputs_and_cache_rows(backend, dtype):
    cache, want = write(backend, dtype=dtype, cache_dtype=dtype, block_size=16, lora=512,
                        rope=64, strided=True, row_pad=8)
    assert cache.stride(1) == 584
    assert_same_bits(cache, want)


def gather_case(backend, cache_dtype, block_size, width=72):
    """A cache of random rows (the whole pool written), a shuffled block table per sequence,
    odd lengths, one empty sequence, start offsets that begin inside a block."""
    dev = backend.device
    g = torch.Generator().manual_seed(block_size + width)
    num_blocks = 40
    source = torch.randn(num_blocks, block_size, width, generator=g) * 3
    cache = poisoned_cache(num_blocks, block_size, width, cache_dtype, dev)
    scale = fp8_scale(cache_dtype, dev)
    slots = torch.arange(num_blocks * block_size, device=dev)
    reference.concat_and_cache_mla(source.view(-1, width)[:, :width - 8].to(dev),
                                   source.view(-1, width)[:, width - 8:].to(dev), cache, slots,
                                   scale)
    lens, starts = [13, 0, 1, 2 * block_size + 5], [3, 0, block_size - 1, 0]
    max_blocks = max(-(-(s + n) // block_size) for s, n in zip(starts, lens, strict=True)) + 1
    table = torch.randint(0, num_blocks, (len(lens), max_blocks), generator=g)  # shared too
    table = table.int().to(dev)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=dev)
    return cache, table, cu, torch.tensor(starts, dtype=torch.int32, device=dev), scale


@pytest.mark.parametrize("block_size", [1, 16, 64])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_gather_matches_reference(backend, dtype, block_size):
    cache, table, cu, starts, _ = gather_case(backend, dtype, block_size)
    for seq_starts in (None, starts):
        out = torch.full((int(cu[-1]), cache.shape[-1]), float("nan"), dtype=dtype,
                         device=backend.device)
        want = out.clone()
        reference.gather_cache(cache, table, cu, want, None, seq_starts)
        backend.ops.gather_cache(cache, table, cu, out, None, seq_starts)
        assert_same_bits(out, want)
        assert not out.isnan().any()


@pytest.mark.parametrize("out_dtype", [*FLOAT_DTYPES, "raw"], ids=str)
@pytest.mark.parametrize("cache_dtype", FP8_DTYPES, ids=str)
def test_gather_dequantizes_fp8(backend, cache_dtype, out_dtype):
    cache, table, cu, starts, scale = gather_case(backend, cache_dtype, 16)
    raw = out_dtype == "raw"
    out = torch.full((int(cu[-1]), cache.shape[-1]), 77.0, device=backend.device)
    out = out.to(cache_dtype if raw else out_dtype)
    want = out.clone()
    reference.gather_cache(cache, table, cu, want, None if raw else scale, starts)
    backend.ops.gather_cache(cache, table, cu, out, None if raw else scale, starts)
    assert_same_bits(out, want)


def test_empty_batches(backend):
    dev = backend.device
    cache = poisoned_cache(4, 8, 24, torch.bfloat16, dev)
    before = cache.clone()
    empty = torch.empty(0, 16, device=dev).bfloat16()
    backend.ops.concat_and_cache_mla(empty, empty[:, :8], cache, torch.empty(0, dtype=torch.long,
                                                                          device=dev), None)
    out = torch.empty(0, 24, device=dev).bfloat16()
    backend.ops.gather_cache(cache, torch.zeros(2, 3, dtype=torch.int32, device=dev),
                             torch.zeros(3, dtype=torch.int32, device=dev), out, None, None)
    assert_same_bits(cache, before)


def test_opcheck(backend):
    dev = backend.device
    cache = torch.zeros(4, 8, 24, device=dev).bfloat16()
    kv_c, k_pe = torch.randn(5, 16, device=dev).bfloat16(), torch.randn(5, 8, device=dev).bfloat16()
    slots = torch.tensor([0, 9, -1, 31, 4], device=dev)
    torch.library.opcheck(backend.ops.concat_and_cache_mla.default,
                          (kv_c, k_pe, cache, slots, None))
    table = torch.tensor([[1, 3], [0, 2]], dtype=torch.int32, device=dev)
    cu = torch.tensor([0, 9, 12], dtype=torch.int32, device=dev)
    torch.library.opcheck(backend.ops.gather_cache.default,
                          (cache, table, cu, torch.empty(12, 24, device=dev).bfloat16(), None,
                           None))


# --- bad input: a clear error naming the argument, and nothing written -------------------------

def _good_write(dev):
    return dict(kv_c=torch.randn(5, 16, device=dev).half(),
                k_pe=torch.randn(5, 8, device=dev).half(),
                kv_cache=torch.zeros(4, 8, 24, device=dev).half(),
                slot_mapping=torch.tensor([0, 9, -1, 31, 4], device=dev), scale=None)


BAD_WRITES = {
    "width": (lambda a: a.update(k_pe=a["k_pe"][:, :4]),
              r"kv_cache must be kv_lora_rank \+ rope_dim = 16 \+ 4 = 20 wide, got 24"),
    "cache rank": (lambda a: a.update(kv_cache=a["kv_cache"][0]), "kv_cache must be 3-D"),
    "cache last dim": (lambda a: a.update(kv_cache=a["kv_cache"].transpose(1, 2)),
                       "kv_cache must have a contiguous last dim"),
    "kv_c rank": (lambda a: a.update(kv_c=a["kv_c"][None]), "kv_c must be 2-D"),
    "k_pe tokens": (lambda a: a.update(k_pe=a["k_pe"][:4]), "k_pe must be .num_tokens, rope_dim"),
    "kv_c last dim": (lambda a: a.update(kv_c=a["kv_c"].t().contiguous().t()),
                      "kv_c must have a contiguous last dim"),
    "k_pe dtype": (lambda a: a.update(k_pe=a["k_pe"].float()), "k_pe must have kv_c's dtype"),
    "cache dtype": (lambda a: a.update(kv_cache=a["kv_cache"].bfloat16()),
                    "kv_cache must have kv_c's dtype"),
    "kv_c fp8": (lambda a: a.update(kv_c=a["kv_c"].to(torch.float8_e4m3fn)),
                 "kv_c must be float32, float16 or bfloat16"),
    "slot dtype": (lambda a: a.update(slot_mapping=a["slot_mapping"].int()),
                   "slot_mapping must be Long"),
    "slot count": (lambda a: a.update(slot_mapping=a["slot_mapping"][:4]),
                   r"slot_mapping must be \[num_tokens\]"),
    "slot range": (lambda a: a["slot_mapping"].__setitem__(3, 32), "slot 32, out of range"),
    "scale on non-fp8": (lambda a: a.update(scale=torch.ones(1, device=a["kv_c"].device)),
                         "scale is only used with fp8 caches"),
    "fp8 without scale": (lambda a: a.update(kv_cache=a["kv_cache"].to(torch.float8_e4m3fn)),
                          "scale is required"),
}


# Checks of index contents: made on the host, so on GPUs only with PAGEDKV_CHECK_INDICES=1.
INDEX_CONTENTS = {"slot range", "cu total", "cu order", "past the table", "block range"}


def skip_index_contents_on_devices(backend, case: str) -> None:
    if case in INDEX_CONTENTS and backend.device.type != "cpu":
        pytest.skip("index contents are checked on the host only for host tensors")


@pytest.mark.parametrize("case", BAD_WRITES)
def test_write_rejects_bad_input(backend, case):
    skip_index_contents_on_devices(backend, case)
    args = _good_write(backend.device)
    mutate, message = BAD_WRITES[case]
    mutate(args)
    before = args["kv_cache"].clone()
    with pytest.raises(RuntimeError, match=message):
        backend.ops.concat_and_cache_mla(*args.values())
    assert torch.equal(bits(args["kv_cache"]), bits(before))


def _good_gather(dev):
    return dict(kv_cache=torch.randn(4, 8, 24, device=dev).half(),
                block_table=torch.tensor([[1, 3], [0, 2]], dtype=torch.int32, device=dev),
                cu_seq_lens=torch.tensor([0, 9, 12], dtype=torch.int32, device=dev),
                out=torch.zeros(12, 24, device=dev).half(), scale=None, seq_starts=None)


BAD_GATHERS = {
    "out width": (lambda a: a.update(out=a["out"][:, :20]), r"out must be \[total_tokens, 24\]"),
    "out dtype": (lambda a: a.update(out=a["out"].float()), "out must have kv_cache's dtype"),
    "scale without fp8": (lambda a: a.update(scale=torch.ones(1, device=a["out"].device)),
                          "scale dequantizes an fp8 kv_cache"),
    "fp8 without scale": (lambda a: a.update(kv_cache=a["kv_cache"].to(torch.float8_e5m2)),
                          "scale is required"),
    "table dtype": (lambda a: a.update(block_table=a["block_table"].long()),
                    "block_table must be Int"),
    "cu size": (lambda a: a.update(cu_seq_lens=a["cu_seq_lens"][:2]),
                r"cu_seq_lens must be \[batch \+ 1\] = \[3\]"),
    "cu total": (lambda a: a["cu_seq_lens"].__setitem__(2, 13),
                 "cu_seq_lens must count from 0 to out's 12 rows"),
    "cu order": (lambda a: a["cu_seq_lens"].__setitem__(1, 13),
                 "cu_seq_lens must not decrease"),
    "past the table": (lambda a: a.update(seq_starts=torch.tensor([8, 0], dtype=torch.int32,
                                                                   device=a["out"].device)),
                       "sequence 0 reads positions 8 .. 16, past its block_table row"),
    "block range": (lambda a: a["block_table"].__setitem__((0, 1), 4),
                    r"block_table\[0\]\[1\] = 4 is not a block"),
    "starts size": (lambda a: a.update(seq_starts=torch.zeros(3, dtype=torch.int32,
                                                              device=a["out"].device)),
                    r"seq_starts must be \[batch\] = \[2\]"),
}


@pytest.mark.parametrize("case", BAD_GATHERS)
def test_gather_rejects_bad_input(backend, case):
    skip_index_contents_on_devices(backend, case)
    args = _good_gather(backend.device)
    mutate, message = BAD_GATHERS[case]
    mutate(args)
    before = args["out"].clone()
    with pytest.raises(RuntimeError, match=message):
        backend.ops.gather_cache(*args.values())
    assert torch.equal(bits(args["out"]), bits(before))
