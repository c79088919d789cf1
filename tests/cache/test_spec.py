import sys
from pathlib import Path

import pytest
import torch

from pagedkv.cache.paged_cache import PagedKVCache, _advise_huge_pages, zeros_kv
from pagedkv.cache.spec import KVCacheSpec


def test_sizes_follow_the_formula():
    spec = KVCacheSpec(num_layers=32, num_kv_heads=8, head_size=128, block_size=16,
                       dtype=torch.bfloat16)
    assert spec.kv_dtype == torch.bfloat16
    assert spec.bytes_per_token == 2 * 32 * 8 * 128 * 2
    assert spec.bytes_per_block == spec.bytes_per_token * 16
    assert spec.kv_cache_bytes(4096, batch=8) == 2 * 32 * 8 * 128 * 4096 * 8 * 2
    assert spec.blocks_for_tokens(17) == 2
    assert spec.num_blocks_for(10 * spec.bytes_per_block + 1) == 10
    assert spec.num_blocks_for(-5) == 0


@pytest.mark.parametrize("cache_dtype, size", [
    (None, 2), (torch.float32, 4), (torch.float8_e4m3fn, 1), (torch.float8_e5m2, 1)])
def test_cache_dtype_sets_element_size(cache_dtype, size):
    spec = KVCacheSpec(2, 2, 8, 4, torch.float16, cache_dtype)
    assert spec.element_size == size
    assert spec.is_fp8 == (size == 1)


@pytest.mark.parametrize("field", ["num_layers", "num_kv_heads", "head_size", "block_size"])
def test_rejects_non_positive_sizes(field):
    args = dict(num_layers=2, num_kv_heads=2, head_size=8, block_size=4)
    args[field] = 0
    with pytest.raises(ValueError, match=field):
        KVCacheSpec(**args)


@pytest.mark.parametrize("cache_dtype, match", [
    (torch.int16, "cache_dtype must be one of"), (torch.uint8, "pass 'int4'"),
    ("int3", "cache_dtype must be a torch dtype or one of")])
def test_rejects_unsupported_cache_dtype(cache_dtype, match):
    with pytest.raises(ValueError, match=match):
        KVCacheSpec(2, 2, 8, 4, torch.float16, cache_dtype)


@pytest.mark.parametrize("combined", [False, True])
def test_cache_tensors_have_the_documented_layout(combined):
    spec = KVCacheSpec(3, 2, 8, 4, torch.float16)
    cache = PagedKVCache(spec, 10, combined_kv=combined)
    assert len(cache.key_caches) == len(cache.value_caches) == 3
    for key, value in zip(cache.key_caches, cache.value_caches, strict=True):
        assert key.shape == value.shape == (10, 2, 4, 8)
        assert key.dtype == torch.float16 and key.stride(-1) == 1
    assert cache.nbytes == 10 * spec.bytes_per_block
    assert cache.k_scales is None


def test_from_memory_and_fp8_scales():
    spec = KVCacheSpec(2, 2, 8, 4, torch.float16, torch.float8_e4m3fn)
    cache = PagedKVCache.from_memory(spec, 5 * spec.bytes_per_block + 7)
    assert cache.num_blocks == 5
    assert [s.item() for s in cache.k_scales] == [1.0, 1.0]
    assert cache.v_scales[0].dtype == torch.float32 and cache.v_scales[0].shape == (1,)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn,
                                   torch.float8_e5m2])
@pytest.mark.parametrize("combined", [False, True])
def test_fill_blocks_writes_nan_only_there(dtype, combined):
    cache = PagedKVCache(KVCacheSpec(2, 2, 8, 4, torch.float32, dtype), 6, combined_kv=combined)
    cache.fill_blocks([1, 4])
    for tensor in (*cache.key_caches, *cache.value_caches):
        nan = tensor.float().isnan().flatten(1).all(dim=1)
        assert nan.tolist() == [False, True, False, False, True, False]


def test_copy_and_swap_blocks_move_every_layer():
    spec = KVCacheSpec(2, 2, 8, 4, torch.float32)
    device, host = PagedKVCache(spec, 6), PagedKVCache(spec, 4)
    for i, tensor in enumerate((*device.key_caches, *device.value_caches)):
        tensor.copy_(torch.randn(tensor.shape, generator=torch.Generator().manual_seed(i)))
    device.copy_blocks([(1, 5), (2, 3)])
    device.swap_to(host, [(5, 0)])
    for src, dst in zip(device.key_caches + device.value_caches,
                        host.key_caches + host.value_caches, strict=True):
        assert torch.equal(src[5], src[1]) and torch.equal(src[3], src[2])
        assert torch.equal(dst[0], src[1])


def test_zeros_kv_is_zeroed_and_backed_by_huge_pages_where_linux_allows():
    # Filled with garbage first, so that a fresh tensor at the same address shows any unzeroed
    # element.
    torch.full((4 << 20,), 7.0).sum()
    t = zeros_kv((33, 2, 16, 128), torch.bfloat16)  # 2.1 MB: at least one whole 2 MiB page
    assert t.shape == (33, 2, 16, 128) and t.dtype == torch.bfloat16 and not t.any()
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if sys.platform.startswith("linux") and thp.exists():
        big = torch.empty(8 << 20, dtype=torch.uint8)  # whole 2 MiB pages inside it
        assert _advise_huge_pages(big)
    assert not _advise_huge_pages(torch.empty(16))  # no whole huge page inside


def test_sliding_windows_are_checked_naming_the_argument():
    for windows, name in (((None,), "sliding_windows"), ((None, 0), r"sliding_windows\[1\]"),
                          ((None, 1.5), r"sliding_windows\[1\]"),
                          ((True, None), r"sliding_windows\[0\]")):
        with pytest.raises(ValueError, match=name):
            KVCacheSpec(2, 2, 8, 4, sliding_windows=windows)


@pytest.mark.parametrize("windows, size, groups", [
    ((None,) * 3, 3, [(None, (0, 1, 2))]),
    ((4, None, 4, None), 2, [(4, (0, 2)), (None, (1, 3))]),
    ((4,) * 12 + (None,) * 13, 13, [(4, tuple(range(12))), (None, tuple(range(12, 25)))]),
    ((4, 4, 4, None, 4, 4, 4, None), 2, [(4, (0, 1)), (4, (2, 4)), (4, (5, 6)), (None, (3, 7))]),
    ((8, 4, None), 1, [(8, (0,)), (4, (1,)), (None, (2,))]),
])
def test_layers_fall_into_groups_of_one_page_size(windows, size, groups):
    spec = KVCacheSpec(len(windows), 2, 8, 4, torch.float16, sliding_windows=windows)
    assert spec.page_layers == size
    assert [(g.window, g.layers) for g in spec.kv_cache_groups] == groups
    assert spec.bytes_per_block == 2 * size * 2 * 8 * 2 * 4
    assert spec.bytes_per_token == 2 * len(windows) * 2 * 8 * 2  # every layer in full
    for index, group in enumerate(spec.kv_cache_groups):
        for slot, layer in enumerate(group.layers):
            assert spec.page_slot(layer) == (index, slot)
    with pytest.raises(ValueError, match="layer"):
        spec.page_slot(len(windows))


def test_a_spec_without_windows_is_one_full_group():
    spec = KVCacheSpec(5, 2, 8, 4)
    assert spec.group_windows == (None,) and spec.page_layers == 5
    assert spec.hybrid_kv_bytes(10, batch=3) == 3 * 3 * spec.bytes_per_block
    assert spec.bytes_per_block == spec.bytes_per_token * 4


def test_a_windowed_spec_pages_its_cache_by_group():
    spec = KVCacheSpec(6, 2, 8, 4, torch.float16, sliding_windows=(4, None) * 3)
    cache = PagedKVCache(spec, 10)
    assert len(cache.key_caches) == len(cache.value_caches) == spec.page_layers == 3
    assert cache.nbytes == 10 * spec.bytes_per_block == sum(
        t.numel() * t.element_size() for t in cache.key_caches + cache.value_caches)
    for layer in range(6):
        group, slot = spec.page_slot(layer)
        assert cache.layer(layer)[0] is cache.key_caches[slot]
    assert cache.layer(0)[0] is cache.layer(1)[0]  # slot 0 of the window and the full group
    assert cache.layer(0)[0] is not cache.layer(2)[0]
    fp8 = PagedKVCache(KVCacheSpec(6, 2, 8, 4, torch.float16, torch.float8_e4m3fn,
                                   sliding_windows=(4, None) * 3), 2)
    assert len(fp8.k_scales) == 6  # one scale per layer, not per tensor


def test_latent_spec_counts_one_row_per_token_and_layer():
    spec = KVCacheSpec(61, 1, 576, 64, torch.bfloat16, latent=True)
    assert spec.bytes_per_token == 61 * 576 * 2
    assert spec.bytes_per_block == spec.bytes_per_token * 64
    assert spec.kv_cache_bytes(100, batch=3) == spec.bytes_per_token * 300
    assert spec.block_shape == (64, 576)
    gqa = KVCacheSpec(61, 1, 576, 64, torch.bfloat16)
    assert gqa.bytes_per_token == 2 * spec.bytes_per_token


@pytest.mark.parametrize("kwargs, match", [
    (dict(num_kv_heads=2), "num_kv_heads must be 1"),
    (dict(head_size=21), "head_size must be even"),
    (dict(sliding_windows=(None, 8)), "sliding_windows must be None"),
    (dict(latent=1), "latent must be a bool"),
])
def test_latent_spec_rejects(kwargs, match):
    args = dict(num_layers=2, num_kv_heads=1, head_size=20, block_size=4, latent=True) | kwargs
    with pytest.raises(ValueError, match=match):
        KVCacheSpec(**args)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_latent_cache_copies_fills_and_swaps_whole_rows(dtype):
    spec = KVCacheSpec(3, 1, 20, 4, torch.float32, dtype, latent=True)
    device, host = PagedKVCache(spec, 7), PagedKVCache(spec, 5)
    assert len(device.latent_caches) == 3 and not device.key_caches and not device.value_caches
    assert device.latent(2).shape == (7, 4, 20) and device.latent(2).dtype == dtype
    assert device.nbytes == 7 * spec.bytes_per_block
    assert (device.k_scales is not None) == spec.is_fp8 and device.v_scales is None
    gen = torch.Generator().manual_seed(3)
    for cache in device.latent_caches:
        cache.copy_(torch.randn(cache.shape, generator=gen).to(dtype))
    before = [c.clone() for c in device.latent_caches]
    device.copy_blocks([(1, 6), (2, 3)])
    for old, new in zip(before, device.latent_caches, strict=True):
        expected = old.clone()
        expected[6], expected[3] = old[1], old[2]
        assert torch.equal(new.view(torch.uint8), expected.view(torch.uint8))
    device.swap_to(host, [(6, 0), (0, 4)])
    for src, dst in zip(device.latent_caches, host.latent_caches, strict=True):
        assert torch.equal(dst[0].view(torch.uint8), src[6].view(torch.uint8))
        assert torch.equal(dst[4].view(torch.uint8), src[0].view(torch.uint8))
    device.fill_blocks([5])
    for cache in device.latent_caches:
        assert cache.float().isnan().flatten(1).all(dim=1).tolist() == [
            False, False, False, False, False, True, False]


def test_latent_cache_refuses_the_kv_accessors():
    latent = PagedKVCache(KVCacheSpec(2, 1, 20, 4, torch.float16, latent=True), 3)
    with pytest.raises(ValueError, match="latent"):
        latent.layer(0)
    with pytest.raises(ValueError, match="index must be <= 1"):
        latent.latent(2)
    with pytest.raises(ValueError, match="latent spec"):
        PagedKVCache(KVCacheSpec(2, 1, 20, 4, torch.float16), 3).latent(0)
    with pytest.raises(ValueError, match="combined_kv"):
        PagedKVCache(KVCacheSpec(2, 1, 20, 4, torch.float16, latent=True), 3, combined_kv=True)
