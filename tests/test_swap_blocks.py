"""swap_blocks on every backend (and GPU <-> CPU on cuda) against pagedkv.reference."""

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
