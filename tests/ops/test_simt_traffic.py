"""The traffic contract of the CUDA kernels, counted by the simt emulator (docs/simt.md,
Traffic): the CUDA-core decode kernel reads each K/V byte it needs exactly once per row tile (once
for groups of up to 4 query heads per kv head), the tensor-core kernel once (a decode group fits
its 16-row tile; its cp.async copies are counted where they are issued), both in full 32-byte
sectors (>= 90% of the ideal) when the caches are 16-byte aligned, in the HND and the NHD layout;
the cache writes are as lean.
An unaligned cache falls back to byte loads, which the counters report as wasteful."""

from __future__ import annotations

import math

import pytest
import torch
from attention_cases import Case, call, check, make_args

simt = pytest.importorskip("pagedkv.ops.simt")
if not simt.available():
    pytest.skip("pagedkv._simt is not built (no CUDA toolkit headers)", allow_module_level=True)

ELEMENT = {torch.bfloat16: 2, torch.float16: 2, torch.float32: 4, torch.float8_e4m3fn: 1,
           torch.float8_e5m2: 1}


def minimal_kv_bytes(case: Case) -> int:
    """K and V bytes the decode must read: each sequence's keys (those in the window)."""
    keys = sum(min(n, case.sliding_window) if case.sliding_window > 0 else n
               for n in case.seq_lens)
    element = ELEMENT[case.cache_dtype or case.dtype]
    return 2 * keys * case.num_kv_heads * case.head_size * element


KERNEL_NAMES = {"cuda_core": "paged_attention_kernel", "tensor_core": "paged_attention_tc_kernel"}


@pytest.fixture(params=list(KERNEL_NAMES))
def kernel(request, monkeypatch) -> str:
    """The attention kernel every call of the test runs (PAGEDKV_ATTENTION_KERNEL)."""
    monkeypatch.setenv("PAGEDKV_ATTENTION_KERNEL", request.param)
    return request.param


def run(case: Case, kernel: str = "cuda_core", **extra) -> tuple[dict, dict]:
    args = make_args(case.with_(extra=extra) if extra else case)
    with simt.profile() as prof:
        call(simt.ops.paged_attention, args)
    check(args)
    return prof.total(KERNEL_NAMES[kernel], "kv"), args


@pytest.mark.parametrize("layout", ["hnd", "nhd"])
@pytest.mark.parametrize("cache_dtype", [None, torch.float8_e4m3fn], ids=["bf16", "fp8"])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("head_size, block_size", [(128, 16), (64, 1), (128, 256), (256, 16)])
def test_decode_reads_each_kv_byte_once_in_full_sectors(layout, cache_dtype, group, head_size,
                                                         block_size, kernel):
    case = Case(seq_lens=(1, 37, 200, 64, 129), num_heads=2 * group, num_kv_heads=2,
                head_size=head_size, block_size=block_size, dtype=torch.bfloat16,
                cache_dtype=cache_dtype, layout=layout)
    kv, _ = run(case, kernel)
    # CUDA-core: row tiles of 4 query heads, each streams the K/V; tensor-core: one 16-row tile
    tiles = math.ceil(group / 4) if kernel == "cuda_core" else 1
    assert kv["distinct_bytes"] == minimal_kv_bytes(case)
    assert kv["bytes"] == tiles * minimal_kv_bytes(case)
    assert kv["sector_efficiency"] >= 0.9, kv


def test_a_window_reads_only_its_keys(kernel):
    case = Case(seq_lens=(300, 5, 97), num_heads=8, num_kv_heads=2, head_size=128,
                dtype=torch.bfloat16, sliding_window=40)
    kv, _ = run(case, kernel)
    assert kv["bytes"] == kv["distinct_bytes"] == minimal_kv_bytes(case)


def test_an_unaligned_cache_is_reported_as_wasteful():
    """Rows 2 bytes off 16-byte alignment: the kernel loads byte by byte. Still each byte once,
    but a warp's request now touches a sector per lane: the counters must say so."""
    case = Case(seq_lens=(33, 70), num_heads=8, num_kv_heads=2, head_size=64,
                dtype=torch.bfloat16)
    args = make_args(case)
    shifted = {}
    for name in ("key_cache", "value_cache"):
        c = args[name]
        wide = torch.empty(c.shape[:-1] + (c.shape[-1] + 1,), dtype=c.dtype)
        wide[..., 1:] = c
        shifted[name] = wide[..., 1:]
    kv, _ = run(case, **shifted)
    assert kv["bytes"] == kv["distinct_bytes"] == minimal_kv_bytes(case)
    assert kv["sector_efficiency"] < 0.2, kv


@pytest.mark.parametrize("layout", ["hnd", "nhd"])
def test_reshape_and_cache_writes_each_slot_once(layout):
    from pagedkv.ops.reference import reshape_and_cache as reference

    from helpers import make_caches

    num_tokens, kv_heads, head, bs = 37, 4, 128, 16
    kc, vc = make_caches(layout, 8, kv_heads, bs, head, torch.bfloat16, torch.device("cpu"))
    key = torch.randn(num_tokens, kv_heads, head).to(torch.bfloat16)
    value = torch.randn(num_tokens, kv_heads, head).to(torch.bfloat16)
    slots = torch.randperm(8 * bs)[:num_tokens]
    want_k, want_v = kc.clone(), vc.clone()
    reference(key, value, want_k, want_v, slots)
    with simt.profile() as prof:
        simt.ops.reshape_and_cache(key, value, kc, vc, slots)
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)
    written = prof.total("reshape_and_cache_kernel", "kv", "store")
    read = prof.total("reshape_and_cache_kernel", "src")
    expected = 2 * num_tokens * kv_heads * head * 2
    assert written["bytes"] == written["distinct_bytes"] == expected
    assert read["bytes"] == read["distinct_bytes"] == expected
    assert written["sector_efficiency"] == read["sector_efficiency"] == 1.0
