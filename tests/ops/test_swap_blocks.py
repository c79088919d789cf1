"""swap_blocks on every backend (and GPU <-> CPU on cuda) against pagedkv.ops.reference."""

from __future__ import annotations

import pytest
import torch

from helpers import FLOAT_DTYPES, FP8_DTYPES, LAYOUTS, assert_same_bits, make_caches


def mapping(pairs: list[tuple[int, int]]) -> torch.Tensor:
    return torch.tensor(pairs, dtype=torch.int64)


def check_swap(backend, src, dst, block_mapping):
    want = dst.clone().cpu()
    for s, d in block_mapping.tolist():
        want[d] = src[s].cpu()
    backend.ops.swap_blocks(src, dst, block_mapping)
    if src.device.type == "cuda" or dst.device.type == "cuda":
        torch.cuda.synchronize()
    assert_same_bits(dst.cpu(), want)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES + FP8_DTYPES, ids=str)
def test_within_device(backend, layout, dtype):
    src, _ = make_caches(layout, 13, 2, 16, 24, dtype, backend.device)
    dst, _ = make_caches(layout, 7, 2, 16, 24, dtype, backend.device)
    perm = torch.randperm(13)[:5]
    check_swap(backend, src, dst, torch.stack([perm, torch.randperm(7)[:5]], dim=1))


@pytest.mark.parametrize("direction", ["out", "in"])
def test_between_gpu_and_cpu(backend, direction):
    if backend.device.type != "cuda":
        pytest.skip("needs a GPU")
    gpu, _ = make_caches("hnd", 9, 2, 16, 64, torch.bfloat16, backend.device)
    cpu = torch.randn(5, 2, 16, 64).bfloat16().pin_memory()
    if direction == "out":
        check_swap(backend, gpu, cpu, mapping([(8, 0), (3, 4), (0, 2)]))
    else:
        check_swap(backend, cpu, gpu, mapping([(0, 8), (4, 3), (2, 1)]))


def test_empty_mapping(backend):
    src, dst = make_caches("hnd", 3, 1, 4, 8, torch.float32, backend.device)
    before = dst.clone()
    backend.ops.swap_blocks(src, dst, torch.empty(0, 2, dtype=torch.int64))
    assert_same_bits(dst, before)


def test_opcheck(backend):
    src, dst = make_caches("hnd", 5, 2, 4, 8, torch.float16, backend.device)
    torch.library.opcheck(backend.ops.swap_blocks.default, (src, dst, mapping([(0, 1), (4, 2)])))


BAD_CASES = {
    "dtype": (lambda s, d, m: (s, d.float(), m), "dst must have src's dtype"),
    "block shape": (lambda s, d, m: (s, d[:, :1], m), "dst blocks must have src's block shape"),
    "block layout": (lambda s, d, m: (s, d.transpose(2, 3).contiguous().transpose(2, 3), m),
                     "lay out a block the same way"),
    "not dense": (lambda s, d, m: (s[:, :, ::2], d[:, :, ::2], m), "each block must be dense"),
    "mapping dtype": (lambda s, d, m: (s, d, m.int()), "block_mapping must be Long"),
    "src range": (lambda s, d, m: (s, d, mapping([(5, 0)])), "source block 5, expected"),
    "dst range": (lambda s, d, m: (s, d, mapping([(0, 4)])), "destination block 4, expected"),
    "duplicate dst": (lambda s, d, m: (s, d, mapping([(0, 1), (2, 1)])), "twice"),
}


@pytest.mark.parametrize("case", BAD_CASES)
def test_rejects_bad_input(backend, case):
    src, _ = make_caches("hnd", 5, 2, 4, 8, torch.float16, backend.device)
    dst, _ = make_caches("hnd", 4, 2, 4, 8, torch.float16, backend.device)
    mutate, message = BAD_CASES[case]
    args = mutate(src, dst, mapping([(0, 1), (4, 2)]))
    before = args[1].clone()
    with pytest.raises(RuntimeError, match=message):
        backend.ops.swap_blocks(*args)
    assert_same_bits(args[1], before)


# Views of one storage: pairs run concurrently, so overlap is judged on the bytes each block
# occupies, not on block ids. A [8, 2, 4, 8] cache holds 64 elements per block.
def _as_blocks(flat: torch.Tensor, offset: int, num_blocks: int, stride: int = 64) -> torch.Tensor:
    return flat.as_strided((num_blocks, 2, 4, 8), (stride, 32, 8, 1), offset)


OVERLAP_CASES = {
    "same tensor": (lambda c: (c, c, mapping([(0, 1), (1, 2)])),
                    "block_mapping uses block 1 both as a source and as a destination"),
    "full view": (lambda c: (c, c[:], mapping([(0, 1), (1, 2)])),
                  r"block_mapping\[0\] writes destination block 1, which overlaps source block 1"),
    "same block": (lambda c: (c, c.view(8, 2, 4, 8), mapping([(3, 3)])),
                   r"block_mapping\[0\] writes destination block 3, which overlaps source block 3"),
    "shifted dst": (lambda c: (c, c[1:], mapping([(0, 0), (1, 2)])),
                    r"block_mapping\[0\] writes destination block 0, which overlaps source block 1"
                    r" of block_mapping\[1\]"),
    "shifted src": (lambda c: (c[1:], c, mapping([(0, 0), (2, 3)])),
                    r"block_mapping\[1\] writes destination block 3, which overlaps source"
                    r" block 2"),
    "half-block offset": (lambda c: (c, _as_blocks(c.flatten(), 32, 7), mapping([(4, 6), (1, 0)])),
                          r"block_mapping\[1\] writes destination block 0, which overlaps source"
                          r" block 1"),
    "overlapping dsts": (lambda c: (c[:4], _as_blocks(torch.zeros_like(c).flatten(), 0, 4, 32),
                                    mapping([(0, 0), (1, 1)])),
                         r"block_mapping\[0\] and block_mapping\[1\] write destination blocks 0"
                         r" and 1, which overlap"),
}


@pytest.mark.parametrize("case", OVERLAP_CASES)
def test_rejects_overlapping_views(backend, case):
    cache, _ = make_caches("hnd", 8, 2, 4, 8, torch.float16, backend.device)
    mutate, message = OVERLAP_CASES[case]
    src, dst, block_mapping = mutate(cache)
    before = [cache.clone(), dst.clone()]
    with pytest.raises(RuntimeError, match=message):
        backend.ops.swap_blocks(src, dst, block_mapping)
    assert_same_bits(cache, before[0])
    assert_same_bits(dst, before[1])


@pytest.mark.parametrize("direction", ["k_to_v", "v_to_k"])
def test_kv_views_of_one_cache(backend, direction):
    k, v = make_caches("combined", 6, 2, 16, 24, torch.bfloat16, backend.device)
    src, dst = (k, v) if direction == "k_to_v" else (v, k)
    src_before = src.clone()
    # Block 0 of K and block 0 of V share a storage and an id but never a byte.
    check_swap(backend, src, dst, mapping([(0, 0), (1, 2), (5, 1), (2, 5)]))
    assert_same_bits(src, src_before)


DISJOINT_VIEWS = {
    "halves": (lambda c: (c[:4], c[4:]), [(0, 0), (3, 1), (1, 3)]),
    "full view": (lambda c: (c, c[:]), [(0, 1), (2, 3), (0, 4)]),
    "shifted dst": (lambda c: (c, c[1:]), [(0, 0), (6, 4), (7, 2)]),
}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", DISJOINT_VIEWS)
def test_disjoint_views_of_one_storage(backend, layout, case):
    cache, _ = make_caches(layout, 8, 2, 16, 24, torch.float16, backend.device)
    views, pairs = DISJOINT_VIEWS[case]
    src, dst = views(cache)
    check_swap(backend, src, dst, mapping(pairs))
