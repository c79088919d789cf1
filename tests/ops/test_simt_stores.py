"""Every global store of the attention kernels goes through the counted store() (docs/simt.md,
Traffic): the simt counters see each byte of out and lse written once, and, with split-K, each
byte of the workspace (a partial output and lse per token, head and partition) written once by
the attention kernel. A store that bypasses the counters leaves its bytes out of these totals."""

from __future__ import annotations

import math

import pytest
import torch
from attention_cases import Case, call, check, make_args

simt = pytest.importorskip("pagedkv.ops.simt")
if not simt.available():
    pytest.skip("pagedkv._simt is not built (no CUDA toolkit headers)", allow_module_level=True)

KERNEL_NAMES = {"cuda_core": "paged_attention_kernel", "tensor_core": "paged_attention_tc_kernel"}
CUDA_CORE_ROWS = 4  # rows per block of the CUDA-core kernel (kAttnRowsPerBlock)
TC_DECODE_ROWS, TC_PREFILL_ROWS = 16, 64  # of the tensor-core kernel's two configurations


@pytest.fixture(params=list(KERNEL_NAMES))
def kernel(request, monkeypatch) -> str:
    """The attention kernel every call of the test runs (PAGEDKV_ATTENTION_KERNEL)."""
    monkeypatch.setenv("PAGEDKV_ATTENTION_KERNEL", request.param)
    return request.param


def row_tiles(kernel: str, rows: int) -> int:
    """Row tiles per (sequence, kv head) of a call whose longest query has `rows` rows."""
    if kernel == "cuda_core":
        return math.ceil(rows / CUDA_CORE_ROWS)
    return math.ceil(rows / (TC_DECODE_ROWS if rows <= TC_DECODE_ROWS else TC_PREFILL_ROWS))


def stores(prof, kernel: str, tag: str) -> dict:
    return prof.total(kernel, tag, "store")


CASES = {  # few blocks where a split is wanted: the 4-SM simt plan splits them
    "decode": Case(seq_lens=(5, 17, 30), num_heads=16, num_kv_heads=2, head_size=72),
    "decode-split": Case(seq_lens=(200, 129), num_heads=8, num_kv_heads=1, head_size=72),
    "prefill": Case(seq_lens=(9, 31), q_lens=(9, 4), num_heads=8, num_kv_heads=2, head_size=64),
    "prefill-split": Case(seq_lens=(150,), q_lens=(12,), num_heads=2, num_kv_heads=1,
                          head_size=64),
}


@pytest.mark.parametrize("name", list(CASES))
def test_every_store_is_counted(name, kernel):
    case = CASES[name].with_(dtype=torch.bfloat16)
    args = make_args(case)
    with simt.profile() as prof:
        call(simt.ops.paged_attention, args)
    check(args)
    tokens, heads, head = args["query"].shape
    for tag, size in (("out", tokens * heads * head * 2), ("lse", tokens * heads * 4)):
        counted = stores(prof, None, tag)
        assert counted["bytes"] == counted["distinct_bytes"] == size, (tag, counted)
    launch = next(x for x in prof.launches if KERNEL_NAMES[kernel] in x["kernel"])
    group = case.num_heads // case.num_kv_heads
    parts = launch["grid"][0] // row_tiles(kernel, args["max_query_len"] * group)
    assert (parts > 1) == name.endswith("split"), parts
    written = stores(prof, KERNEL_NAMES[kernel], "workspace")
    expected = tokens * heads * parts * (head + 1) * 4 if parts > 1 else 0
    assert written["bytes"] == written["distinct_bytes"] == expected, written
    every = sum(stores(prof, None, tag)["bytes"] for tag in ("out", "lse", "workspace"))
    assert stores(prof, None, None)["bytes"] == every, prof.table()
