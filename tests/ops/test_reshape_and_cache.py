"""reshape_and_cache on every backend against pagedkv.ops.reference."""

from __future__ import annotations

import pytest
import torch

from pagedkv.ops import reference

from helpers import (
    FLOAT_DTYPES,
    FP8_DTYPES,
    LAYOUTS,
    assert_same_bits,
    bits,
    make_caches,
    unique_slots,
)


def run_case(backend, *, dtype, cache_dtype, layout, block_size, head_size, num_kv_heads=3,
             num_tokens=37, num_blocks=11, strided_key=False):
    dev = backend.device
    num_blocks = max(num_blocks, -(-2 * num_tokens // block_size))
    kc, vc = make_caches(layout, num_blocks, num_kv_heads, block_size, head_size, cache_dtype, dev)
    if strided_key:  # key and value as slices of one fused [tokens, 3, heads, head] tensor
        qkv = torch.randn(num_tokens, 3, num_kv_heads, head_size, device=dev).to(dtype)
        key, value = qkv[:, 1], qkv[:, 2]
    else:
        key = torch.randn(num_tokens, num_kv_heads, head_size, device=dev).to(dtype)
        value = torch.randn(num_tokens, num_kv_heads, head_size, device=dev).to(dtype)
    slots = unique_slots(num_tokens, num_blocks * block_size, padding=3, device=dev)
    scales = {}
    if cache_dtype in FP8_DTYPES:
        scales = dict(k_scale=torch.tensor([0.037], device=dev),
                      v_scale=torch.tensor([0.21], device=dev))
    want_k, want_v = kc.clone(), vc.clone()
    reference.reshape_and_cache(key, value, want_k, want_v, slots, **scales)
    backend.ops.reshape_and_cache(key, value, kc, vc, slots, scales.get("k_scale"),
                                  scales.get("v_scale"))
    assert_same_bits(kc, want_k)
    assert_same_bits(vc, want_v)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("block_size,head_size", [(16, 128), (1, 64), (17, 80), (32, 7)])
def test_matches_reference(backend, layout, dtype, block_size, head_size):
    run_case(backend, dtype=dtype, cache_dtype=dtype, layout=layout, block_size=block_size,
             head_size=head_size)


@pytest.mark.parametrize("cache_dtype", FP8_DTYPES, ids=str)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("layout,head_size", [("hnd", 64), ("combined", 24), ("nhd", 13)])
def test_fp8_quantizes_like_reference(backend, cache_dtype, dtype, layout, head_size):
    run_case(backend, dtype=dtype, cache_dtype=cache_dtype, layout=layout, block_size=16,
             head_size=head_size)


def test_fp8_saturates_instead_of_overflowing(backend):
    dev = backend.device
    kc, vc = make_caches("hnd", 2, 1, 4, 16, torch.float8_e4m3fn, dev)
    key = torch.full((1, 1, 16), 1e6, device=dev)
    key[0, 0, 1::2] = -1e6
    scale = torch.tensor([1.0], device=dev)
    backend.ops.reshape_and_cache(key, key, kc, vc, torch.tensor([5], device=dev), scale, scale)
    written = kc[1, 0, 1].float().cpu()
    assert torch.equal(written.abs(), torch.full((16,), 448.0))


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_strided_key_and_value(backend, dtype):
    run_case(backend, dtype=dtype, cache_dtype=dtype, layout="nhd", block_size=16, head_size=64,
             strided_key=True)


def test_all_padding_and_empty(backend):
    for num_tokens in (0, 5):
        dev = backend.device
        kc, vc = make_caches("hnd", 4, 2, 8, 16, torch.float32, dev)
        before_k, before_v = kc.clone(), vc.clone()
        key = torch.randn(num_tokens, 2, 16, device=dev)
        slots = torch.full((num_tokens,), -1, dtype=torch.int64, device=dev)
        backend.ops.reshape_and_cache(key, key, kc, vc, slots, None, None)
        assert_same_bits(kc, before_k)
        assert_same_bits(vc, before_v)


def test_opcheck(backend):
    dev = backend.device
    kc, vc = make_caches("hnd", 4, 2, 8, 16, torch.bfloat16, dev)
    key = torch.randn(5, 2, 16, device=dev).bfloat16()
    slots = torch.tensor([0, 9, -1, 31, 4], device=dev)
    torch.library.opcheck(backend.ops.reshape_and_cache.default,
                          (key, key.clone(), kc, vc, slots, None, None))


# --- bad input: a clear error naming the argument, and nothing written -------------------------

def _good(dev):
    kc, vc = make_caches("hnd", 4, 2, 8, 16, torch.float16, dev)
    key = torch.randn(5, 2, 16, device=dev).half()
    return dict(key=key, value=key.clone(), key_cache=kc, value_cache=vc,
                slot_mapping=torch.tensor([0, 9, -1, 31, 4], device=dev), k_scale=None,
                v_scale=None)


BAD_CASES = {
    "key dtype": (lambda a: a.update(key=a["key"].float(), value=a["value"].float()),
                  "key must have the cache dtype"),
    "value shape": (lambda a: a.update(value=a["value"][:, :1]), "value must have key's shape"),
    "key heads": (lambda a: a.update(key=a["key"][:, :1], value=a["value"][:, :1]),
                  r"key must be \[num_tokens, 2, 16\]"),
    "key last dim": (lambda a: a.update(key=a["key"].transpose(1, 2).contiguous().transpose(1, 2)),
                     "contiguous last dim"),
    "cache rank": (lambda a: a.update(key_cache=a["key_cache"][0]), "key_cache must be 4-D"),
    "cache mismatch": (lambda a: a.update(value_cache=a["value_cache"][:2]),
                       "same shape"),
    "cache dtype": (lambda a: a.update(value_cache=a["value_cache"].float()), "same dtype"),
    "cache int": (lambda a: a.update(key_cache=a["key_cache"].int(),
                                     value_cache=a["value_cache"].int()),
                  "key_cache must be float32, float16, bfloat16"),
    "slot dtype": (lambda a: a.update(slot_mapping=a["slot_mapping"].int()),
                   "slot_mapping must be Long"),
    "slot count": (lambda a: a.update(slot_mapping=a["slot_mapping"][:4]),
                   r"slot_mapping must be \[num_tokens\]"),
    "slot range": (lambda a: a["slot_mapping"].__setitem__(3, 32), "slot 32, out of range"),
    "scale on non-fp8": (lambda a: a.update(k_scale=torch.ones(1, device=a["key"].device)),
                         "k_scale is only used with fp8 caches"),
}


@pytest.mark.parametrize("case", BAD_CASES)
def test_rejects_bad_input(backend, case):
    args = _good(backend.device)
    mutate, message = BAD_CASES[case]
    mutate(args)
    before = [args["key_cache"].clone(), args["value_cache"].clone()]
    with pytest.raises(RuntimeError, match=message):
        backend.ops.reshape_and_cache(*args.values())
    assert torch.equal(bits(args["key_cache"]), bits(before[0]))
    assert torch.equal(bits(args["value_cache"]), bits(before[1]))


def test_fp8_requires_float32_scales(backend):
    dev = backend.device
    kc, vc = make_caches("hnd", 4, 2, 8, 16, torch.float8_e5m2, dev)
    key = torch.randn(2, 2, 16, device=dev)
    slots = torch.tensor([1, 2], device=dev)
    with pytest.raises(RuntimeError, match="k_scale is required"):
        backend.ops.reshape_and_cache(key, key, kc, vc, slots, None, None)
    bad = torch.ones(2, device=dev)
    with pytest.raises(RuntimeError, match="k_scale must be a float32 tensor of one element"):
        backend.ops.reshape_and_cache(key, key, kc, vc, slots, bad, bad)
