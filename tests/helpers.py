"""Shared test helpers: cache layouts, random data, bitwise comparison; the sanitized simt
module."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
# "address" in `make sanitize`: the simt suites run on the ASan + UBSan build of pagedkv._simt.
SIMT_SANITIZE = os.environ.get("PAGEDKV_SIMT_SANITIZE", "")

FLOAT_DTYPES = [torch.float32, torch.float16, torch.bfloat16]
FP8_DTYPES = [torch.float8_e4m3fn, torch.float8_e5m2]
LAYOUTS = ["hnd", "nhd", "combined"]

_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def make_caches(
    layout: str,
    num_blocks: int,
    num_kv_heads: int,
    block_size: int,
    head_size: int,
    dtype: torch.dtype,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V caches [num_blocks, num_kv_heads, block_size, head_size] in a storage layout:
    hnd (contiguous), nhd (a permuted view) or combined (views of one [num_blocks, 2, ...]
    tensor), filled with random values so that unwritten elements show."""
    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(shape, device=device).to(dtype)

    if layout == "hnd":
        shape = (num_blocks, num_kv_heads, block_size, head_size)
        return rand(*shape), rand(*shape)
    if layout == "nhd":
        shape = (num_blocks, block_size, num_kv_heads, head_size)
        return rand(*shape).permute(0, 2, 1, 3), rand(*shape).permute(0, 2, 1, 3)
    if layout == "combined":
        kv = rand(num_blocks, 2, num_kv_heads, block_size, head_size)
        return kv[:, 0], kv[:, 1]
    raise ValueError(layout)


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of a float tensor, so that comparisons are exact (NaN == NaN, fp8 works)."""
    return t.view(_INT_VIEW[t.element_size()])


def assert_same_bits(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    mismatch = bits(actual).cpu() != bits(expected).cpu()
    if mismatch.any():
        where = mismatch.nonzero()[:5].tolist()
        raise AssertionError(f"{int(mismatch.sum())} elements differ, first at {where}")


def unique_slots(num_tokens: int, num_slots: int, padding: int, device) -> torch.Tensor:
    """int64 [num_tokens]: distinct random slots, with ``padding`` entries set to -1."""
    slots = torch.randperm(num_slots)[:num_tokens]
    slots[torch.randperm(num_tokens)[:padding]] = -1
    return slots.to(device)


def use_sanitized_simt() -> None:
    """Under PAGEDKV_SIMT_SANITIZE, makes ``pagedkv._simt`` the sanitized build that setup.py
    wrote to build/simt-<mode>/pagedkv (the in-place module stays as it is). Must run before
    anything imports ``pagedkv._simt``."""
    if not SIMT_SANITIZE:
        return
    import pagedkv

    if "pagedkv._simt" in sys.modules:
        raise RuntimeError("pagedkv._simt was imported before the sanitized build could be")
    folder = ROOT / "build" / f"simt-{SIMT_SANITIZE}" / "pagedkv"
    found = sorted(folder.glob("_simt.*.so"))
    if not found:
        raise RuntimeError(f"PAGEDKV_SIMT_SANITIZE={SIMT_SANITIZE}: no {folder}/_simt.*.so; "
                           "`make sanitize` builds it")
    spec = importlib.util.spec_from_file_location("pagedkv._simt", found[0])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules["pagedkv._simt"] = module
    pagedkv._simt = module
