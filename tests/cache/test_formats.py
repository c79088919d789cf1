"""Cache formats (pagedkv.cache.formats) as KVCacheSpec sizes them and PagedKVCache stores them:
the row scales of int8, int4 and fp8 per token-head are allocated with their rows, handed to the
ops by layer_args, and copied, swapped and poisoned with them, bit for bit."""

from __future__ import annotations

import pytest
import torch

from pagedkv import ops
from pagedkv.cache import FORMATS, CacheFormat, KVCacheSpec, PagedKVCache, cache_format
from pagedkv.errors import InvalidArgumentError
from pagedkv.ops import reference

from helpers import assert_same_bits

TOKEN_SCALED = ["int8", "int4", "fp8_e4m3_per_token_head", "fp8_e5m2_per_token_head"]


@pytest.mark.parametrize("name, storage, row", [
    ("bfloat16", torch.bfloat16, 256), ("float32", torch.float32, 512),
    ("float8_e4m3fn", torch.float8_e4m3fn, 128), ("int8", torch.int8, 132),
    ("int4", torch.uint8, 68), ("fp8_e4m3_per_token_head", torch.float8_e4m3fn, 132),
    ("fp8_e5m2_per_token_head", torch.float8_e5m2, 132)])
def test_a_format_counts_its_row_and_scale(name, storage, row):
    fmt = FORMATS[name]
    assert fmt.storage == storage and fmt.row_bytes(128) == row
    assert fmt.token_scaled == (name in TOKEN_SCALED)
    assert fmt.tensor_scaled == (name == "float8_e4m3fn")
    if fmt.token_scaled:
        assert fmt.qmax == reference.row_qmax(storage)
    assert fmt.stored_width(128) == (64 if name == "int4" else 128)


@pytest.mark.parametrize("value, name", [
    ("bf16", "bfloat16"), (torch.float16, "float16"), ("fp8", "float8_e4m3fn"),
    ("FP8_E5M2", "float8_e5m2"), (torch.float8_e5m2, "float8_e5m2"), (torch.int8, "int8"),
    ("int8_per_token_head", "int8"), ("fp8_per_token_head", "fp8_e4m3_per_token_head"),
    ("int4", "int4"), (FORMATS["int4"], "int4")])
def test_names_dtypes_and_aliases_name_one_format(value, name):
    assert cache_format(value) is FORMATS[name]


@pytest.mark.parametrize("value, match", [
    ("int3", "cache_dtype must be a torch dtype or one of float32, .*int4"),
    (torch.uint8, "pass 'int4'"), (torch.int32, "cache_dtype must be one of"), (8, "got 8")])
def test_unknown_formats_are_refused_by_name(value, match):
    with pytest.raises(InvalidArgumentError, match=match):
        cache_format(value)


@pytest.mark.parametrize("name", TOKEN_SCALED)
def test_spec_sizes_a_token_scaled_cache_with_its_scales(name):
    spec = KVCacheSpec(32, 8, 128, 16, torch.bfloat16, name)
    width = 64 if name == "int4" else 128
    assert spec.format is FORMATS[name] and spec.token_scaled and not spec.is_fp8
    assert spec.cache_dtype == name and spec.kv_dtype == FORMATS[name].storage
    assert spec.block_shape == (8, 16, width) and spec.scale_shape == (8, 16)
    assert spec.bytes_per_token == 2 * 32 * 8 * (width * 1 + 4)
    assert spec.bytes_per_block == 16 * spec.bytes_per_token
    bf16 = KVCacheSpec(32, 8, 128, 16, torch.bfloat16)
    budget = 80 * 2**30
    gain = spec.num_blocks_for(budget) / bf16.num_blocks_for(budget)
    assert gain == pytest.approx(256 / (width + 4), rel=1e-3)  # int8 1.94x, int4 3.76x
    assert KVCacheSpec(32, 8, 128, 16, torch.bfloat16, FORMATS[name]) == spec


def test_spec_keeps_dtypes_of_plain_formats_and_names_of_scaled_ones():
    assert KVCacheSpec(2, 2, 8, 4, torch.float16, "fp8").cache_dtype == torch.float8_e4m3fn
    assert KVCacheSpec(2, 2, 8, 4, torch.float16, torch.int8).cache_dtype == "int8"
    assert KVCacheSpec(2, 2, 8, 4, torch.float16).scale_shape is None


@pytest.mark.parametrize("kwargs, match", [
    (dict(cache_dtype="int8", latent=True, num_kv_heads=1), "latent \\(MLA\\) ops do not read"),
    (dict(cache_dtype="int4", head_size=7), "head_size must be even for an int4"),
    (dict(dtype=torch.int8), "dtype must be the model's float dtype"),
    (dict(cache_dtype=torch.uint8), "pass 'int4'")])
def test_spec_refuses_what_no_op_reads(kwargs, match):
    args = dict(num_layers=2, num_kv_heads=2, head_size=8, block_size=4) | kwargs
    with pytest.raises(InvalidArgumentError, match=match):
        KVCacheSpec(**args)


@pytest.mark.parametrize("combined", [False, True])
@pytest.mark.parametrize("name", TOKEN_SCALED)
def test_cache_allocates_row_scales_per_layer(name, combined):
    spec = KVCacheSpec(3, 2, 16, 5, torch.float32, name)
    cache = PagedKVCache(spec, 7, combined_kv=combined)
    assert cache.k_scales is None and cache.v_scales is None
    assert len(cache.key_cache_scales) == len(cache.value_cache_scales) == 3
    for layer in range(3):
        args = cache.layer_args(layer)
        assert args["key_cache"].dtype == spec.kv_dtype
        assert args["key_cache"].shape == (7, *spec.block_shape)
        for scales in (args["key_cache_scales"], args["value_cache_scales"]):
            assert scales.shape == (7, 2, 5) and scales.dtype == torch.float32
            assert not scales.any()
        assert args["k_scale"] is None and args["v_scale"] is None
    if combined:  # K and V scales are views of one tensor, strided like the rows
        ks, vs = cache.layer_scales(0)
        assert ks.untyped_storage().data_ptr() == vs.untyped_storage().data_ptr()
        assert ks.stride() == (2 * 2 * 5, 5, 1)
    assert cache.nbytes == 7 * spec.bytes_per_block == sum(t.nbytes for t in cache.tensors)


def test_layer_args_of_plain_and_fp8_caches():
    plain = PagedKVCache(KVCacheSpec(2, 2, 8, 4, torch.float32), 3)
    assert plain.layer_scales(1) == (None, None) and not plain.key_cache_scales
    fp8 = PagedKVCache(KVCacheSpec(2, 2, 8, 4, torch.float32, "fp8"), 3)
    args = fp8.layer_args(1)
    assert args["k_scale"] is fp8.k_scales[1] and args["key_cache_scales"] is None
    latent = PagedKVCache(KVCacheSpec(2, 1, 8, 4, torch.float32, latent=True), 3)
    with pytest.raises(InvalidArgumentError, match="latent"):
        latent.layer_args(0)


def windowed_spec(name: str, block_size: int) -> KVCacheSpec:
    """Four layers, two of them windowed: two groups sharing page slots."""
    return KVCacheSpec(4, 3, 32, block_size, torch.float32, name,
                       sliding_windows=(8, None, 8, None))


def write_random(cache: PagedKVCache, block_ids: list[int], seed: int) -> None:
    """Random K/V (an outlier row among them) written by reshape_and_cache into every slot of
    ``block_ids`` of every layer."""
    gen = torch.Generator().manual_seed(seed)
    bs = cache.spec.block_size
    slots = torch.tensor([b * bs + i for b in block_ids for i in range(bs)])
    shape = (len(slots), cache.spec.num_kv_heads, cache.spec.head_size)
    for layer in range(cache.spec.num_layers):
        k, v = (torch.randn(shape, generator=gen) * (1 + layer) for _ in range(2))
        k[0, 0, 3] = 50.0
        ops.reshape_and_cache(k, v, slot_mapping=slots, **cache.layer_args(layer))


@pytest.mark.parametrize("combined", [False, True])
@pytest.mark.parametrize("block_size", [1, 5, 16])
@pytest.mark.parametrize("name", TOKEN_SCALED)
def test_copy_on_write_moves_rows_and_scales(name, block_size, combined):
    spec = windowed_spec(name, block_size)
    cache = PagedKVCache(spec, 9, combined_kv=combined)
    write_random(cache, [1, 2, 4, 7], seed=block_size)
    before = [t.clone() for t in cache.tensors]
    cache.copy_blocks([(1, 3), (4, 0), (7, 8)])
    for old, new in zip(before, cache.tensors, strict=True):
        expected = old.clone()
        expected[3], expected[0], expected[8] = old[1], old[4], old[7]
        assert_same_bits(new, expected)
    assert len(before) == 4 * spec.page_layers  # K, V, K scales, V scales per page slot


@pytest.mark.parametrize("combined", [False, True])
@pytest.mark.parametrize("block_size", [1, 7])
@pytest.mark.parametrize("name", TOKEN_SCALED)
def test_swap_out_and_in_round_trips_rows_and_scales(name, block_size, combined):
    spec = windowed_spec(name, block_size)
    device = PagedKVCache(spec, 6, combined_kv=combined)
    host = PagedKVCache(spec, 4, combined_kv=combined)
    write_random(device, [0, 2, 5], seed=11)
    before = [t.clone() for t in device.tensors]
    device.swap_to(host, [(2, 3), (5, 0)])
    device.fill_blocks([2, 5])
    host.swap_to(device, [(3, 5), (0, 2)])  # back, into each other's places
    for old, new in zip(before, device.tensors, strict=True):
        expected = old.clone()
        expected[5], expected[2] = old[2], old[5]
        assert_same_bits(new, expected)


@pytest.mark.parametrize("name", TOKEN_SCALED)
def test_fill_poisons_rows_and_scales(name):
    spec = KVCacheSpec(2, 2, 16, 4, torch.float32, name)
    cache = PagedKVCache(spec, 5)
    write_random(cache, [0, 1, 2, 3, 4], seed=5)
    cache.fill_blocks([3])
    for layer in range(2):
        args = cache.layer_args(layer)
        for scales in (args["key_cache_scales"], args["value_cache_scales"]):
            assert scales.isnan().flatten(1).all(1).tolist() == [False, False, False, True, False]
        rows = reference.dequantize_rows(args["key_cache"], args["key_cache_scales"])
        assert rows[3].isnan().all() and not rows[[0, 1, 2, 4]].isnan().any()
    q = torch.randn(1, 4, 16)
    out = torch.zeros_like(q)
    tables = torch.tensor([[0, 3]], dtype=torch.int32)
    ops.paged_attention(out, q, block_tables=tables, seq_lens=torch.tensor([6], dtype=torch.int32),
                        query_start_loc=None, max_seq_len=6, max_query_len=1, scale=0.25,
                        **cache.layer_args(0))
    assert out.isnan().all()  # a poisoned block that is read shows


@pytest.mark.parametrize("name", TOKEN_SCALED)
def test_attention_over_copied_blocks_equals_the_originals(name):
    """Copy-on-write needs nothing of the caller: a table pointing at the copies reads what the
    original table read, bit for bit."""
    spec = KVCacheSpec(1, 2, 32, 5, torch.float32, name)
    cache = PagedKVCache(spec, 8)
    write_random(cache, [1, 2, 3], seed=2)
    cache.copy_blocks([(1, 6), (2, 4), (3, 7)])
    q = torch.randn(2, 4, 32)
    outs = []
    for table in ([1, 2, 3], [6, 4, 7]):
        out = torch.full_like(q, float("nan"))
        ops.paged_attention(out, q, block_tables=torch.tensor([table, table], dtype=torch.int32),
                            seq_lens=torch.tensor([13, 9], dtype=torch.int32),
                            query_start_loc=None, max_seq_len=13, max_query_len=1, scale=0.2,
                            **cache.layer_args(0))
        outs.append(out)
    assert not outs[0].isnan().any()
    assert_same_bits(outs[1], outs[0])


def test_cache_format_is_a_frozen_value():
    fmt = FORMATS["int8"]
    with pytest.raises(AttributeError):
        fmt.bits = 4  # type: ignore[misc]
    assert CacheFormat("int8", torch.int8, 8, True, 127.0, fmt.label) == fmt


@pytest.mark.parametrize("combined", [False, True])
def test_every_backend_copies_and_swaps_the_scales(backend, monkeypatch, combined):
    """PagedKVCache's copies and swaps run through ``backend``'s ops (the CUDA kernels under the
    emulator, or on a GPU): rows of one float32 scale, and int4 rows, move bit for bit."""
    from pagedkv.cache import paged_cache

    monkeypatch.setattr(paged_cache, "ops", backend.ops)
    spec = windowed_spec("int4", 5)
    cache = PagedKVCache(spec, 6, backend.device, combined_kv=combined)
    host = PagedKVCache(spec, 3, backend.device, combined_kv=combined)
    gen = torch.Generator().manual_seed(4)
    for t in cache.tensors:
        t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape, generator=gen,
                                                dtype=torch.uint8))
    before = [t.cpu().clone() for t in cache.tensors]
    cache.copy_blocks([(1, 4), (2, 0)])
    cache.swap_to(host, [(4, 2)])
    for old, new, out in zip(before, cache.tensors, host.tensors, strict=True):
        expected = old.clone()
        expected[4], expected[0] = old[1], old[2]
        assert_same_bits(new.cpu(), expected)
        assert_same_bits(out[2].cpu(), old[1])
