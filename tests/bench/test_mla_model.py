"""The tensor-core MLA kernel's key-tile loop in the SASS model: per warp and 32-key tile, S = Q
K^T over the 576-wide latent row for its 16 keys, O += P V for its 256 of the 512 columns over
all 32 keys and the rounded row sum (docs/cuda_attention.md, MLA kernel); the instructions per
HMMA of the common path stay within their budget, so that a change issuing more per MMA fails
here."""

from __future__ import annotations

import re

import pytest
from test_gpu_model import built_kernels

from bench.sass.tensor_core import boundary_cost, tile_cost

# Instructions per HMMA of one pass of the unmasked loop (tile_cost(k).per_hmma), bf16 queries,
# DeepSeek's rank 512: the figures as built plus 3%. (arch, cache, 16-row slices per tile).
# sm_80 has no fp8 conversion instruction (its dequantization is emulated in integer code) and
# its 16-row fp8 kernel's loop is not found by the loop model: only the 64-row one is held.
MLA_BUDGETS = {
    ("sm_80", "bf16", 1): 5.3,
    ("sm_80", "bf16", 4): 5.0,
    ("sm_80", "fp8_e4m3", 4): 22.8,
    ("sm_90", "bf16", 1): 5.4,
    ("sm_90", "bf16", 4): 5.1,
    ("sm_90", "fp8_e4m3", 1): 6.5,
    ("sm_90", "fp8_e4m3", 4): 6.0,
}
_NAME = re.compile(r"mla_attention_tc_kernel<__nv_bfloat16, (?:pagedkv::)?(\w+), 512, (\d)>")
_CACHE = {"__nv_bfloat16": "bf16", "fp8_e4m3": "fp8_e4m3"}


@pytest.fixture(scope="module")
def mla_kernels() -> dict:
    """(arch, cache, slices of 16 rows) -> the rank-512 kernel of bf16 queries."""
    found = {}
    for k in built_kernels("attention_mla_bf16"):
        m = _NAME.search(k.demangled or "")
        if m and m.group(1) in _CACHE:
            found[(k.arch, _CACHE[m.group(1)], int(m.group(2)))] = k
    return found


@pytest.mark.parametrize("key", sorted(MLA_BUDGETS), ids=lambda k: "-".join(map(str, k)))
def test_mla_loop_stays_within_its_budget(mla_kernels, key):
    budget = MLA_BUDGETS[key]
    kernel = mla_kernels.get(key)
    if kernel is None:
        pytest.skip(f"the module has no {key} rank-512 MLA kernel")
    cost = tile_cost(kernel)
    assert cost.hmma == 576 // 16 * 2 + 2 * (256 // 8) + 2
    assert cost.ldsm > 0 and (cost.ldgsts > 0) == (key[1] == "bf16")
    masked = boundary_cost(kernel)
    assert masked is not None and masked.hmma == cost.hmma
    assert cost.per_hmma <= budget, (
        f"{kernel.demangled}: {cost.per_hmma:.2f} instructions per HMMA on the common path, "
        f"over the budget of {budget}")
