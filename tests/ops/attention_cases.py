"""Attention test cases: random paged inputs, the reference at two precisions, the tolerance rule.

A case is built on the CPU (so that every backend sees the same numbers) and moved to the
backend's device. The kernel must be within twice the reference's own float32 error (both
measured against the float64 reference) plus a small floor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import pytest
import torch

from pagedkv import ops
from pagedkv.ops import reference

FLOAT_DTYPES = [torch.float32, torch.float16, torch.bfloat16]
FP8_DTYPES = [torch.float8_e4m3fn, torch.float8_e5m2]
OP_ARGS = ops.arg_names("paged_attention")  # from the registered schema, the one list


@dataclass(frozen=True)
class Case:
    seq_lens: tuple[int, ...] = (1, 17, 100, 33)
    q_lens: tuple[int, ...] | None = None  # None: decode
    num_heads: int = 8
    num_kv_heads: int = 2
    head_size: int = 64
    block_size: int = 16
    dtype: torch.dtype = torch.float32
    cache_dtype: torch.dtype | None = None  # None: dtype
    layout: str = "hnd"
    alibi: bool = False
    sliding_window: int = -1
    soft_cap: float = 0.0
    sinks: bool = False
    lse: bool = True
    extra: dict = field(default_factory=dict, compare=False)

    def with_(self, **kw) -> Case:
        return replace(self, **kw)


def make_caches(layout, num_blocks, num_kv_heads, block_size, head_size):
    """float32 K and V caches in a storage layout: hnd, nhd (permuted view) or combined."""
    if layout == "hnd":
        shape = (num_blocks, num_kv_heads, block_size, head_size)
        return torch.randn(shape), torch.randn(shape)
    if layout == "nhd":
        shape = (num_blocks, block_size, num_kv_heads, head_size)
        return torch.randn(shape).permute(0, 2, 1, 3), torch.randn(shape).permute(0, 2, 1, 3)
    if layout == "combined":
        kv = torch.randn(num_blocks, 2, num_kv_heads, block_size, head_size)
        return kv[:, 0], kv[:, 1]
    raise ValueError(layout)


def make_args(case: Case, device: torch.device | str = "cpu") -> dict:
    """The op's arguments for a case, out and lse_out poisoned with NaN."""
    bs = case.block_size
    cache_dtype = case.cache_dtype or case.dtype
    decode = case.q_lens is None
    q_lens = [1] * len(case.seq_lens) if decode else list(case.q_lens)
    blocks = [math.ceil(n / bs) for n in case.seq_lens]
    max_blocks = max(blocks + [1]) + 1  # one padding column at least
    num_blocks = sum(blocks) + 3
    perm = torch.randperm(num_blocks).tolist()
    table = torch.full((len(case.seq_lens), max_blocks), -1, dtype=torch.int32)
    used = 0
    for i, n in enumerate(blocks):
        table[i, :n] = torch.tensor(perm[used:used + n], dtype=torch.int32)
        used += n
    kc, vc = make_caches(case.layout, num_blocks, case.num_kv_heads, bs, case.head_size)
    k_scale = v_scale = None
    if cache_dtype in FP8_DTYPES:
        k_scale, v_scale = torch.tensor([0.05]), torch.tensor([0.02])
        kc, vc = kc * 0.05 * 4, vc * 0.02 * 4  # values that use the fp8 range after / scale
    kc = reference.quantize(kc, cache_dtype, k_scale)  # keeps the layout's strides
    vc = reference.quantize(vc, cache_dtype, v_scale)
    if case.layout == "combined":  # keep K and V views of one tensor
        kv = torch.stack([kc, vc], dim=1)
        kc, vc = kv[:, 0], kv[:, 1]
    num_tokens = sum(q_lens)
    query = torch.randn(num_tokens, case.num_heads, case.head_size).to(case.dtype)
    qsl = None
    if not decode:
        qsl = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32)
    args = dict(
        out=torch.full_like(query, float("nan")),
        query=query,
        key_cache=kc,
        value_cache=vc,
        block_tables=table,
        seq_lens=torch.tensor(case.seq_lens, dtype=torch.int32),
        query_start_loc=qsl,
        max_seq_len=max(case.seq_lens + (0,)),
        max_query_len=max(q_lens + [1]),
        scale=case.head_size**-0.5,
        alibi_slopes=torch.rand(case.num_heads) * 0.3 + 0.01 if case.alibi else None,
        sliding_window=case.sliding_window,
        soft_cap=case.soft_cap,
        k_scale=k_scale,
        v_scale=v_scale,
        lse_out=torch.full((num_tokens, case.num_heads), float("nan")) if case.lse else None,
        # logits about those of the keys (scale * q.k ~ N(0, 1)), some far above, some below
        sinks=torch.randn(case.num_heads) * 3 + 1 if case.sinks else None,
        key_cache_scales=None,  # per-(token, head) quantized caches: test_quantized_kv.py
        value_cache_scales=None,
        causal=True,  # causal=False (a cascade's prefix level): test_cascade_attention.py
    )
    args.update(case.extra)
    return to_device(args, device)


def to_device(args: dict, device) -> dict:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in args.items()}


# Shapes aimed at the tensor-core kernel's tiling (automatic dispatch runs them there): several
# 64-row tiles, head sizes below the padded one, odd block sizes, fp8 at head 256 (its loads at
# the tile start), a full 16-row decode tile, key tiles and split-K partitions cut mid-block.
TC_TILES = {
    "f16 h24 bs3 nhd 3 row tiles": Case(dtype=torch.float16, head_size=24, block_size=3,
                                        layout="nhd", seq_lens=(70, 33), q_lens=(40, 33)),
    "bf16 h80 bs5 combined group 8": Case(dtype=torch.bfloat16, head_size=80, block_size=5,
                                          layout="combined", seq_lens=(130, 7), q_lens=(1, 7),
                                          num_heads=16),
    "bf16 h256 e4m3 prefill": Case(dtype=torch.bfloat16, head_size=256,
                                   cache_dtype=torch.float8_e4m3fn, seq_lens=(90, 20),
                                   q_lens=(30, 2), alibi=True),
    "f16 h256 e5m2 decode group 8": Case(dtype=torch.float16, head_size=256,
                                         cache_dtype=torch.float8_e5m2, seq_lens=(1, 100, 37),
                                         num_heads=16),
    "bf16 h192 decode group 16": Case(dtype=torch.bfloat16, head_size=192, num_heads=16,
                                      num_kv_heads=1, seq_lens=(300, 1, 65), alibi=True,
                                      sliding_window=50, soft_cap=10.0),
    "bf16 h64 sinks window 2 row tiles": Case(dtype=torch.bfloat16, head_size=64,
                                              seq_lens=(150, 9), q_lens=(70, 9), sinks=True,
                                              sliding_window=33, num_heads=16, num_kv_heads=2),
    "bf16 h128 decode group 32": Case(dtype=torch.bfloat16, head_size=128, num_heads=32,
                                      num_kv_heads=1, seq_lens=(90, 1, 33)),
    "f16 h64 decode group 16 fp8": Case(dtype=torch.float16, head_size=64, num_heads=32,
                                        num_kv_heads=2, cache_dtype=torch.float8_e4m3fn,
                                        seq_lens=(45, 160)),
    "f16 h128 sinks decode group 8 split": Case(dtype=torch.float16, head_size=128,
                                                num_heads=8, num_kv_heads=1, sinks=True,
                                                seq_lens=(700, 3), block_size=7),
}


def auto_picks_tensor_cores(case: Case, row_scaled: bool = False) -> bool:
    """Whether automatic dispatch runs a case (aligned caches) on the tensor-core kernel: 16-bit
    queries and at least 8 (query token, query head) rows per kv head, 4 over an 8- or 4-bit
    cache (fp8 with per-tensor scales; `row_scaled`: int8, int4 or fp8 e4m3 the tensor-core
    kernel reads with a scale per (token, head)); docs/cuda_attention.md, Dispatch."""
    rows = max(case.q_lens or (1,)) * (case.num_heads // case.num_kv_heads)
    quantized = row_scaled or case.cache_dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    return case.dtype != torch.float32 and rows >= (4 if quantized else 8)


def skip_what_auto_runs(backend, case: Case, row_scaled: bool = False) -> None:
    """On a -tc backend (the tensor-core kernel forced), skip a case whose run would repeat the
    automatic backend's: float32 queries (the CUDA-core kernel either way) and cases that
    dispatch sends to the tensor-core kernel already."""
    if backend.attention_kernel != "tensor_core":
        return
    if case.dtype == torch.float32:
        pytest.skip("float32 queries run on the CUDA-core kernel: the automatic backend's run")
    if auto_picks_tensor_cores(case, row_scaled):
        pytest.skip("automatic dispatch runs this case on the tensor-core kernel already")


def call(op, args: dict) -> None:
    """The op on args by name; arguments with a default (the trailing optional ones) may be
    left out of args."""
    op(**{name: args[name] for name in OP_ARGS if name in args})


def reference_outputs(args: dict, compute_dtype: torch.dtype):
    """(out, lse) of the reference computed in compute_dtype, on the CPU, as float64. out is
    rounded to the op's out dtype, except for the float64 oracle."""
    a = to_device(args, "cpu")
    out_dtype = torch.float64 if compute_dtype == torch.float64 else a["out"].dtype
    a["out"] = torch.empty(a["out"].shape, dtype=out_dtype)
    a["lse_out"] = torch.empty(a["query"].shape[:2])
    reference.paged_attention(**{name: a[name] for name in OP_ARGS if name in a},
                              compute_dtype=compute_dtype)
    return a["out"].double(), a["lse_out"].double()


def abs_errors(actual: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    """|actual - expected| element by element (float64, on the CPU), where -inf == -inf counts
    as 0 and any NaN as inf."""
    a, e = actual.cpu().double(), expected.cpu().double()
    both_inf = torch.isinf(a) & torch.isinf(e) & (torch.sign(a) == torch.sign(e))
    diff = torch.where(both_inf, torch.zeros_like(a), (a - e).abs())
    return torch.where(torch.isnan(diff), torch.full_like(diff, math.inf), diff)


def max_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Largest of abs_errors."""
    diff = abs_errors(actual, expected)
    return diff.max().item() if diff.numel() else 0.0


def out_bound(out_dtype: torch.dtype, torch_err: float, float32_floor: float = 1e-6) -> float:
    """How far check lets an output stray from the float64 reference: twice torch's own
    float32 error (torch_err) plus a floor for the output's dtype."""
    floor = {torch.float32: float32_floor, torch.float16: 1e-4, torch.bfloat16: 1e-3}[out_dtype]
    return 2 * torch_err + floor


def lse_bound(torch_err: float, logit_error: float = 0.0) -> float:
    """The same for the lse: twice torch's error, 2e-5, and logit_error (see check)."""
    return 2 * torch_err + 2e-5 + logit_error


def check(args: dict, reference_of=None, float32_floor: float = 1e-6,
          logit_error: float = 0.0) -> None:
    """The kernel's out / lse_out (already computed in args) against the float64 reference:
    ``reference_of(args, compute_dtype) -> (out, lse)``, paged_attention's by default (the MLA
    suite passes its own, and a floor for its 576-long float32 dot products). logit_error: a
    bound on how far the kernel's arithmetic may move a logit beyond float32 rounding (the
    integer dot products of int8 caches), which moves the lse by as much."""
    reference_of = reference_of or reference_outputs
    want, want_lse = reference_of(args, torch.float64)
    torch_out, torch_lse = reference_of(args, torch.float32)
    err, torch_err = max_err(args["out"], want), max_err(torch_out, want)
    assert err <= out_bound(args["out"].dtype, torch_err, float32_floor), (
        f"out error {err:.3g}, torch's {torch_err:.3g}")
    if args["lse_out"] is not None:
        err, torch_err = max_err(args["lse_out"], want_lse), max_err(torch_lse, want_lse)
        assert err <= lse_bound(torch_err, logit_error), (
            f"lse error {err:.3g}, torch's {torch_err:.3g}")
