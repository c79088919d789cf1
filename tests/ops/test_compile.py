"""The cache ops trace into one graph under torch.compile (fake implementations registered)."""

from __future__ import annotations

import pytest
import torch

import pagedkv
from pagedkv.ops import reference

from helpers import assert_same_bits, make_caches


@pytest.mark.parametrize("compiler", ["aot_eager", "inductor"])
def test_cache_ops_compile_fullgraph(compiler):
    kc, vc = make_caches("hnd", 8, 2, 4, 16, torch.float32, torch.device("cpu"))
    key = torch.randn(6, 2, 16)
    slots = torch.tensor([0, 5, 9, -1, 30, 17])
    pairs = torch.tensor([[1, 3], [2, 6]])

    def step(key, kc, vc, slots, pairs):
        pagedkv.reshape_and_cache(key * 2, key + 1, kc, vc, slots)
        pagedkv.copy_blocks([kc], [vc], pairs)
        return kc.sum() + vc.sum()

    want_k, want_v = kc.clone(), vc.clone()
    reference.reshape_and_cache(key * 2, key + 1, want_k, want_v, slots)
    reference.copy_blocks([want_k], [want_v], pairs)
    compiled = torch.compile(step, fullgraph=True, backend=compiler)
    total = compiled(key, kc, vc, slots, pairs)
    assert_same_bits(kc, want_k)
    assert_same_bits(vc, want_v)
    torch.testing.assert_close(total, want_k.sum() + want_v.sum())
