"""copy_blocks on every backend against pagedkv.ops.reference."""

from __future__ import annotations

import pytest
import torch

from pagedkv.ops import reference

from helpers import FLOAT_DTYPES, FP8_DTYPES, LAYOUTS, assert_same_bits, make_caches


def make_layers(backend, layout, dtype, num_layers=3, num_blocks=23, heads=2, block_size=16,
                head_size=64):
    pairs = [make_caches(layout, num_blocks, heads, block_size, head_size, dtype, backend.device)
             for _ in range(num_layers)]
    return [k for k, _ in pairs], [v for _, v in pairs]


def random_mapping(num_blocks: int, num_pairs: int, device) -> torch.Tensor:
    """(src, dst) pairs with distinct destinations that are never sources; sources may repeat."""
    perm = torch.randperm(num_blocks)
    dst = perm[:num_pairs]
    src_pool = perm[num_pairs:]
    src = src_pool[torch.randint(len(src_pool), (num_pairs,))]
    return torch.stack([src, dst], dim=1).to(device)


def check_copy(backend, keys, values, mapping) -> None:
    want_k = [k.clone() for k in keys]
    want_v = [v.clone() for v in values]
    reference.copy_blocks(want_k, want_v, mapping)
    backend.ops.copy_blocks(keys, values, mapping)
    for got, want in zip(keys + values, want_k + want_v, strict=True):
        assert_same_bits(got, want)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES + FP8_DTYPES, ids=str)
@pytest.mark.parametrize("block_size,head_size", [(16, 64), (1, 80), (5, 7)])
def test_matches_reference(backend, layout, dtype, block_size, head_size):
    keys, values = make_layers(backend, layout, dtype, block_size=block_size,
                               head_size=head_size)
    check_copy(backend, keys, values, random_mapping(23, 9, backend.device))


def test_many_layers_span_several_launches(backend):
    keys, values = make_layers(backend, "hnd", torch.float16, num_layers=130, num_blocks=6,
                               block_size=4, head_size=8)
    check_copy(backend, keys, values, random_mapping(6, 2, backend.device))


def test_empty_mapping_and_no_layers(backend):
    keys, values = make_layers(backend, "hnd", torch.float32)
    before = [t.clone() for t in keys + values]
    backend.ops.copy_blocks(keys, values, torch.empty(0, 2, dtype=torch.int64,
                                                      device=backend.device))
    backend.ops.copy_blocks([], [], torch.empty(0, 2, dtype=torch.int64, device=backend.device))
    for got, want in zip(keys + values, before, strict=True):
        assert_same_bits(got, want)


def test_opcheck(backend):
    keys, values = make_layers(backend, "combined", torch.bfloat16, num_layers=2)
    mapping = random_mapping(23, 4, backend.device)
    torch.library.opcheck(backend.ops.copy_blocks.default, (keys, values, mapping))


def _set_row(m: torch.Tensor, row: int, value: int) -> torch.Tensor:
    m = m.clone()
    m[row] = value
    return m


BAD_CASES = {
    "mapping dtype": (lambda k, v, m: (k, v, m.int()), "block_mapping must be Long"),
    "mapping shape": (lambda k, v, m: (k, v, m.reshape(-1)),
                      r"block_mapping must be \[num_pairs, 2\]"),
    "mapping range": (lambda k, v, m: (k, v, _set_row(m, 1, 23)), "expected 0 <= id < 23"),
    "negative id": (lambda k, v, m: (k, v, _set_row(m, 0, -1)), "expected 0 <= id < 23"),
    "layer count": (lambda k, v, m: (k, v[:-1], m), "one tensor per layer each"),
    "layer shape": (lambda k, v, m: (k[:-1] + [k[-1][:5]], v[:-1] + [v[-1][:5]], m),
                    "layer 2 differs"),
    "duplicate dst": (lambda k, v, m: (k, v, torch.cat([m, m[:1]])),
                      "names destination block .* twice"),
    "dst is a src": (lambda k, v, m: (k, v, torch.cat([m, m[:1, [1, 0]]])),
                     "both as a source and as a destination"),
}


@pytest.mark.parametrize("case", BAD_CASES)
def test_rejects_bad_input(backend, case):
    keys, values = make_layers(backend, "hnd", torch.float16)
    mapping = torch.tensor([[1, 2], [3, 4], [3, 5]], device=backend.device)
    mutate, message = BAD_CASES[case]
    args = mutate(keys, values, mapping)
    before = [t.clone() for t in keys + values]
    with pytest.raises(RuntimeError, match=message):
        backend.ops.copy_blocks(*args)
    for got, want in zip(keys + values, before, strict=True):
        assert_same_bits(got, want)
