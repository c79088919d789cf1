"""Caches quantized per (token, head): int8, int4 (uint8, two a byte) and fp8 with a scale per
row, written by reshape_and_cache and read by paged_attention.

Two claims, tested apart: the kernels are exact for the format (the written bits and scales are
pagedkv.reference.quantize_rows'; attention equals the float64 attention over the dequantized
cache within the suite's tolerance), and the format's own error is what its step allows.
Backends without these kernels yet must refuse them clearly (QUANTIZED_WRITE_BACKENDS for
reshape_and_cache, QUANTIZED_READ_BACKENDS for paged_attention).
"""

from __future__ import annotations

import pytest
import torch
from attention_cases import (
    TC_TILES,
    Case,
    abs_errors,
    call,
    check,
    lse_bound,
    make_args,
    max_err,
    out_bound,
    reference_outputs,
    skip_what_auto_runs,
    to_device,
)

from pagedkv import ops
from pagedkv.ops import reference

from helpers import (
    CPU_ISAS,
    FLOAT_DTYPES,
    LAYOUTS,
    assert_same_bits,
    make_caches,
    unique_slots,
    use_cpu_isa,
)

# int4 is stored as uint8 (head_size / 2 bytes a row).
FORMATS = [torch.int8, torch.uint8, torch.float8_e4m3fn, torch.float8_e5m2]
FORMAT_IDS = ["int8", "int4", "fp8e4m3", "fp8e5m2"]
# Backends whose kernels write / read these formats; the others refuse them, before writing
# anything.
QUANTIZED_WRITE_BACKENDS = {"cpu", "cuda", "simt-forward", "simt-random"}
QUANTIZED_READ_BACKENDS = {"cpu", "cuda", "simt-forward", "simt-random"}


def stored_width(fmt: torch.dtype, head_size: int) -> int:
    return head_size // 2 if fmt == torch.uint8 else head_size


def empty_cache(layout, num_blocks, num_kv_heads, block_size, head_size, fmt):
    """K and V caches of a format in a layout, random bytes so that unwritten rows show, and
    their scales [num_blocks, num_kv_heads, block_size] (NaN), strided as the layout is."""
    width = stored_width(fmt, head_size)
    kc, vc = make_caches(layout, num_blocks, num_kv_heads, block_size, width,
                         torch.float32, "cpu")
    kc, vc = ((c * 40).to(torch.int8).view(fmt) if fmt != torch.int8 else (c * 40).to(fmt)
              for c in (kc, vc))
    if layout == "nhd":  # scales stored [num_blocks, block_size, heads], seen in HND order
        ks, vs = (torch.full((num_blocks, block_size, num_kv_heads), float("nan"))
                  .permute(0, 2, 1) for _ in range(2))
    else:
        ks, vs = (torch.full((num_blocks, num_kv_heads, block_size), float("nan"))
                  for _ in range(2))
    return kc, vc, ks, vs


def refuses_write(backend) -> bool:
    return backend.name not in QUANTIZED_WRITE_BACKENDS


def refuses_read(backend) -> bool:
    return backend.name.removesuffix("-tc") not in QUANTIZED_READ_BACKENDS


# ---- the write ----------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("layout,block_size,head_size", [("hnd", 16, 128), ("nhd", 5, 64),
                                                          ("combined", 1, 40)])
def test_write_matches_reference(backend, fmt, dtype, layout, block_size, head_size):
    """Stored bits and scales equal the reference's; padding slots and other rows untouched."""
    num_tokens, heads = 29, 3
    num_blocks = -(-2 * num_tokens // block_size) + 1
    kc, vc, ks, vs = empty_cache(layout, num_blocks, heads, block_size, head_size, fmt)
    key = (torch.randn(num_tokens, heads, head_size) * 3).to(dtype)
    value = torch.randn(num_tokens, 3 * heads, head_size).to(dtype)[:, ::3]  # strided heads
    slots = unique_slots(num_tokens, num_blocks * block_size, padding=3, device="cpu")
    want = [t.clone() for t in (kc, vc, ks, vs)]
    reference.reshape_and_cache(key, value, want[0], want[1], slots, key_cache_scales=want[2],
                                value_cache_scales=want[3])
    dev = backend.device
    got = [t.to(dev) for t in (kc, vc, ks, vs)]
    args = (key.to(dev), value.to(dev), got[0], got[1], slots.to(dev), None, None, got[2],
            got[3])
    if refuses_write(backend):
        with pytest.raises(RuntimeError, match="no kernel writes int8, int4 or per-"):
            backend.ops.reshape_and_cache(*args)
        for g, t in zip(got, (kc, vc, ks, vs), strict=True):
            assert_same_bits(g.cpu(), t)
        return
    backend.ops.reshape_and_cache(*args)
    for g, w in zip(got, want, strict=True):
        assert_same_bits(g.cpu(), w)


@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
@pytest.mark.parametrize("head_size", [6, 10, 21])
def test_write_of_short_rows_zero_rows_and_ties(backend, fmt, head_size):
    """Rows shorter than a vector or with a tail past the last whole one (int4: even only), a
    row of zeros (scale 0, zeros stored), and elements exactly half a step between two values
    (rounded to even), as the reference writes them."""
    if fmt == torch.uint8 and head_size % 2:
        pytest.skip("an int4 row holds an even number of elements")
    kc, vc, ks, vs = empty_cache("hnd", 3, 2, 4, head_size, fmt)
    key = torch.randn(5, 2, head_size) * 4
    key[1, 0] = 0
    key[2, 1] = torch.arange(head_size) - head_size / 2 + 0.5  # ties after / scale, for ints
    key[2, 1, 0] = reference.row_qmax(fmt) if fmt in (torch.int8, torch.uint8) else 448.0
    value = -key.flip(0)
    slots = torch.tensor([0, 5, 7, -1, 11])
    want = [t.clone() for t in (kc, vc, ks, vs)]
    reference.reshape_and_cache(key, value, want[0], want[1], slots, key_cache_scales=want[2],
                                value_cache_scales=want[3])
    assert want[2][1, 0, 1] == 0  # slot 5, head 0: the zero row
    got = [t.to(backend.device) for t in (kc, vc, ks, vs)]
    if refuses_write(backend):
        pytest.skip("this backend refuses the formats (test_write_matches_reference)")
    backend.ops.reshape_and_cache(key.to(backend.device), value.to(backend.device), got[0],
                                  got[1], slots.to(backend.device), None, None, got[2], got[3])
    for g, w in zip(got, want, strict=True):
        assert_same_bits(g.cpu(), w)


@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
def test_quantization_error_is_within_half_a_step(fmt):
    """The format's own error (reference quantizer): ints round to the nearest step (half a
    scale at most), fp8 to its precision relative to each element; zero rows are zeros."""
    x = torch.randn(64, 4, 96, dtype=torch.float64).float() * torch.rand(64, 4, 1) * 10
    x[3, 1] = 0
    x[5, 2, 7] = 1e4  # an outlier sets its row's scale alone
    stored, scales = reference.quantize_rows(x, fmt)
    assert scales[3, 1] == 0
    back = reference.dequantize_rows(stored, scales)
    assert torch.equal(back[3, 1], torch.zeros(96))
    err = (back - x).abs()
    if fmt in (torch.int8, torch.uint8):
        assert (err <= scales[..., None] * 0.5 * (1 + 1e-5)).all()
    else:
        rel = torch.finfo(fmt).eps  # half an ulp of the format, relative, for normal numbers
        normal = x.abs() >= scales[..., None] * torch.finfo(fmt).tiny
        assert (err[normal] <= x.abs()[normal] * rel * (1 + 1e-5)).all()
    # each row's largest element is stored as the format's largest value: the whole range used
    top = back.abs().amax(-1)[scales > 0].double()
    want = x.abs().amax(-1)[scales > 0].double()
    assert torch.allclose(top, want, rtol=torch.finfo(fmt).eps if fmt.is_floating_point
                          else 1e-6)


def test_int4_packing_round_trips():
    q = torch.randint(-8, 8, (5, 3, 64))
    packed = reference.pack_int4(q)
    assert packed.dtype == torch.uint8 and packed.shape == (5, 3, 32)
    assert torch.equal(reference.unpack_int4(packed), q.int())
    assert reference.pack_int4(torch.tensor([1, -1]))[0] == 0xF1  # 2i low, 2i + 1 high


# ---- the read -----------------------------------------------------------------------------


def quantized_args(case: Case, fmt: torch.dtype, device, outliers: bool = False) -> tuple:
    """paged_attention arguments over a cache of the format: the float case's caches
    (random, shuffled tables, poisoned outputs), quantized by the reference with a scale per
    (token, head); with `outliers`, four channels of K (two of V) 20x larger, as real keys have.
    Returns (args on device, the unquantized float K and V caches)."""
    args = make_args(case)
    kf, vf = args["key_cache"].float(), args["value_cache"].float()
    if outliers:
        channels = torch.randperm(case.head_size)[:4]
        kf[..., channels] *= 20
        vf[..., channels[:2]] *= 20
    kq, ks = reference.quantize_rows(kf, fmt)
    vq, vs = reference.quantize_rows(vf, fmt)
    args.update(key_cache=kq, value_cache=vq, key_cache_scales=ks, value_cache_scales=vs,
                k_scale=None, v_scale=None)
    on_device = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in args.items()}
    return on_device, (kf, vf)


def run(backend, case: Case, fmt: torch.dtype) -> dict:
    args, _ = quantized_args(case, fmt, backend.device)
    return read(backend, args)


def read(backend, args: dict) -> dict:
    """paged_attention over quantized args (on the backend's device) against the reference,
    or its refusal where the backend has no kernel for them."""
    if refuses_read(backend):
        with pytest.raises(RuntimeError, match="no kernel reads int8, int4 or per-"):
            call(backend.ops.paged_attention, args)
        assert args["out"].isnan().all()
        return args
    call(backend.ops.paged_attention, args)
    if backend.name == "cpu" and may_round_the_query_to_int8(args):
        check_rows_either_query(args)
    else:
        check(args, logit_error=int_query_logit_error(args))
    return args


# The CPU's int4 decode on the avx512bf16 and avx2 kernels (head sizes a multiple of 128,
# 16-bit queries) rounds each query row of a whole group of 4 rows of a kv head to int8 for
# vpdpbusd / vpmaddubsw (docs/quantized_kv.md): the kernel is exact for the format with the
# query so rounded.
INT8_QUERY_ISAS = ("avx512bf16", "avx2")


def may_round_the_query_to_int8(args: dict) -> bool:
    """Whether the CPU may run rows of this call on int8 queries."""
    return (args["key_cache"].dtype == torch.uint8 and args["query"].dtype != torch.float32
            and args["query"].shape[-1] % 128 == 0
            and ops.cpu_attention_kernel(args["query"].shape[-1]) in INT8_QUERY_ISAS)


def int8_query(args: dict) -> torch.Tensor:
    """The query as the CPU's int4 decode rounds it (float64, in the query's units): each row
    times the scale in float32, in steps of its largest |element| / 127: q / step rounded once
    to the nearest integer, ties to even (the kernel's FMA; exact in float64). A row of zeros
    stays zeros."""
    q = args["query"].cpu().float() * torch.tensor(args["scale"], dtype=torch.float32)
    amax = q.abs().amax(-1, keepdim=True)
    inv, step = torch.tensor(127.0) / amax, amax / torch.tensor(127.0)
    rounded = torch.round(q.double() * inv.double()) * step.double() / args["scale"]
    return torch.where(amax > 0, rounded, torch.zeros_like(rounded))


def row_errors(actual: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    """abs_errors' largest in each row of an output [tokens, heads, head_size]; an lse's own."""
    diff = abs_errors(actual, expected)
    return diff.amax(-1) if diff.dim() == 3 else diff


def check_rows_either_query(args: dict) -> None:
    """check's bounds, row by row, against two float64 references: the query as given (plus
    int_query_logit_error for the lse) or as int8_query rounds it. Every row must meet one."""
    want, want_lse = reference_outputs(args, torch.float64)
    want8, want8_lse = reference_outputs({**args, "query": int8_query(args)}, torch.float64)
    torch_out, torch_lse = reference_outputs(args, torch.float32)
    bound = out_bound(args["out"].dtype, max_err(torch_out, want))
    err, err8 = row_errors(args["out"], want), row_errors(args["out"], want8)
    exact, rounded = err <= bound, err8 <= bound
    assert (exact | rounded).all(), (
        f"rows meeting neither reference: {(~(exact | rounded)).nonzero().tolist()[:8]}, "
        f"errors {err.max():.3g} / {err8.max():.3g} (bound {bound:.3g})")
    if args["lse_out"] is not None:
        torch_err = max_err(torch_lse, want_lse)
        lse_exact = (row_errors(args["lse_out"], want_lse)
                     <= lse_bound(torch_err, int_query_logit_error(args)))
        lse_rounded = row_errors(args["lse_out"], want8_lse) <= lse_bound(torch_err)
        assert ((lse_exact & exact) | (lse_rounded & rounded)).all(), "lse meets neither"


@pytest.mark.parametrize("isa", INT8_QUERY_ISAS)
@pytest.mark.parametrize("group", [4, 6, 8])
def test_cpu_int4_decode_rounds_whole_groups_of_4_queries_to_int8(backend, group, isa,
                                                                   monkeypatch):
    """On the avx512bf16 and avx2 kernels, decode over int4 rows at head size 128: the query
    rows of each kv head's whole groups of 4 (heads 0-3 of a group of 6, all of 4 or 8) are
    rounded to int8 (int8_query), the others to int16 as everywhere else; float16, where the
    int8 rounding is far beyond the tolerance of the query as given."""
    if backend.name != "cpu":
        pytest.skip("CPU kernels only")
    use_cpu_isa(monkeypatch, isa)
    case = Case(dtype=torch.float16, num_heads=2 * group, num_kv_heads=2, head_size=128,
                seq_lens=(1, 17, 100, 250, 33))
    args, _ = quantized_args(case, torch.uint8, backend.device)
    call(backend.ops.paged_attention, args)
    want8, _ = reference_outputs({**args, "query": int8_query(args)}, torch.float64)
    want, _ = reference_outputs(args, torch.float64)
    torch_out, _ = reference_outputs(args, torch.float32)
    bound = out_bound(torch.float16, max_err(torch_out, want))
    int8_heads = torch.arange(2 * group) % group < group // 4 * 4
    assert (row_errors(args["out"], want8)[:, int8_heads] <= bound).all()
    assert row_errors(args["out"], want)[:, int8_heads].max() > bound  # the rounding is there
    assert (row_errors(args["out"], want)[:, ~int8_heads] <= bound).all()
    check_rows_either_query(args)


def int_query_logit_error(args: dict) -> float:
    """How far the CPU's integer dot products over int8 and int4 caches (AVX512_VNNI, 16-bit
    queries; docs/cpu_attention.md) may move a logit: each query row is rounded to int16 in
    steps of its largest |element| / 32767, which moves q . k by at most half a step times
    |k|_1. 0 for other formats and for float32 queries."""
    query = args["query"]
    if args["key_cache"].dtype not in (torch.int8, torch.uint8) or query.dtype == torch.float32:
        return 0.0
    q_step = (query.float().abs().amax() * args["scale"]).item() / 32767
    kc = args["key_cache"].cpu()
    k = reference.unpack_int4(kc) if kc.dtype == torch.uint8 else kc
    k_l1 = (k.float().abs().sum(-1) * args["key_cache_scales"].cpu()).amax().item()
    return q_step / 2 * k_l1


VARLEN = dict(seq_lens=(1, 40, 97, 33, 64, 5), q_lens=(1, 40, 9, 33, 1, 2))
FEATURES = {
    "plain": {},
    "window": dict(sliding_window=19),
    "alibi+cap": dict(alibi=True, soft_cap=7.0),
    "sinks": dict(sinks=True),
}


@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_decode(backend, fmt, dtype):
    run(backend, Case(dtype=dtype, seq_lens=(1, 17, 100, 33, 250)), fmt)


@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
@pytest.mark.parametrize("feature", FEATURES)
@pytest.mark.parametrize("varlen", [False, True], ids=["decode", "varlen"])
def test_features(attention_backend, fmt, feature, varlen):
    """Every attention feature, decode (2 rows per kv head: the CUDA-core kernel, or the
    tensor-core one forced on -tc backends) and varlen (the tensor-core kernel; fp8 e5m2: the
    CUDA-core one)."""
    case = Case(dtype=torch.bfloat16, num_heads=4, **FEATURES[feature])
    case = case.with_(**VARLEN) if varlen else case
    skip_what_auto_runs(attention_backend, case, row_scaled=fmt in TC_FORMATS)
    if attention_backend.attention_kernel and fmt not in TC_FORMATS:
        pytest.skip("the tensor-core kernel does not read fp8 e5m2 per row: the CUDA-core "
                    "kernel's run (test_tensor_core_tiles checks the fallback)")
    run(attention_backend, case, fmt)


@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_a_nan_or_inf_in_a_query_leaves_the_other_rows_alone(backend, fmt, bad):
    """A NaN or an infinity in one query element: every other row's output is the clean
    query's, bit for bit (the CPU's integer path rounds each row to int16 by its own largest
    element, in decode in quads of 4 rows)."""
    case = Case(dtype=torch.bfloat16, num_heads=8, num_kv_heads=2, head_size=128,
                seq_lens=(37, 5))
    args, _ = quantized_args(case, fmt, backend.device)
    clean = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in args.items()}
    args["query"][1, 2, 77] = bad
    call(backend.ops.paged_attention, clean)
    call(backend.ops.paged_attention, args)
    spoiled = torch.zeros(args["out"].shape[:2], dtype=torch.bool)
    spoiled[1, 2] = True
    assert_same_bits(args["out"].cpu()[~spoiled], clean["out"].cpu()[~spoiled])


# A cache's NaN, by format: None the bf16 cache, "e4m3" the per-tensor fp8 one, else per row.
NAN_FORMATS = [None, "e4m3", *FORMATS]
NAN_FORMAT_IDS = ["bf16", "fp8e4m3-tensor", *FORMAT_IDS]


@pytest.mark.parametrize("fmt", NAN_FORMATS, ids=NAN_FORMAT_IDS)
@pytest.mark.parametrize("where", ["query", "key", "value"])
@pytest.mark.parametrize("q_lens", [None, (4, 1)], ids=["decode", "varlen"])
def test_a_nan_logit_makes_the_rows_it_reaches_nan(attention_backend, fmt, where, q_lens):
    """A NaN in a query element, or in a K row (its element, or its scale), makes NaN exactly
    the rows whose logits it reaches, out and lse, as in the reference, and no others: the
    softmax's exp of NaN is NaN (not a clamped e^-87: the CPU), a NaN row sum is not "saw no
    key" (0 and lse -inf: the CUDA kernels), and split-K merges keep an lse of NaN, also where
    every partition's is. 3001 keys split sequence 0 across partitions. A NaN in a V element
    makes NaN its column of the rows that see it (its scale: their whole rows), no lse (the
    CPU's decode reads the e4m3 rows of a step with no NaN without its NaN compare: the V rows'
    check, apart from K's)."""
    backend = attention_backend
    case = Case(dtype=torch.bfloat16, num_heads=8, num_kv_heads=2, head_size=128,
                seq_lens=(3001, 37), q_lens=q_lens)
    if fmt is None or fmt == "e4m3":
        args = make_args(case.with_(cache_dtype=None if fmt is None else torch.float8_e4m3fn))
    else:
        args, _ = quantized_args(case, fmt, "cpu")
    if where == "query":
        args["query"][0, 2, 77] = float("nan")  # sequence 0's first row, kv head 1
    else:  # key 3 of sequence 0, kv head 0: every row of heads 0-3 of sequence 0 sees it
        block = args["block_tables"][0, 0]
        if fmt is None:
            args[f"{where}_cache"][block, 0, 3, 5] = float("nan")
        elif fmt == "e4m3":
            args[f"{where}_cache"].view(torch.uint8)[block, 0, 3, 5] = 0x7F  # S.1111.111
        else:
            args[f"{where}_cache_scales"][block, 0, 3] = float("nan")
    ref_out, ref_lse = reference_outputs(args, torch.float64)
    args = to_device(args, backend.device)
    call(backend.ops.paged_attention, args)
    out, lse = args["out"].cpu().double(), args["lse_out"].cpu()
    nan_rows = ref_out.isnan().any(-1)
    assert nan_rows.any() and not nan_rows.all()
    assert torch.equal(out.isnan(), ref_out.isnan())  # (a V element: its column)
    assert torch.equal(lse.isnan(), ref_lse.isnan())
    torch.testing.assert_close(out[~nan_rows], ref_out[~nan_rows], atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
@pytest.mark.parametrize("group", [1, 4])
def test_negative_and_zero_scales(attention_backend, fmt, group):
    """Scales of either sign, and 0 over codes that are not (reshape_and_cache writes neither,
    a caller's tensor may): the rows read as codes x scale, K's and V's, against the
    reference. The CPU's integer P V rounds P times the V scales by their largest magnitude;
    the tensor-core kernel divides by the V scales (their rows of 0: zero codes staged)."""
    case = Case(dtype=torch.bfloat16, num_heads=2 * group, num_kv_heads=2, head_size=128,
                seq_lens=(1, 77, 250, 33))
    skip_what_auto_runs(attention_backend, case, row_scaled=fmt in TC_FORMATS)
    args, _ = quantized_args(case, fmt, "cpu")
    gen = torch.Generator().manual_seed(5)
    for name in ("key", "value"):
        scales = args[f"{name}_cache_scales"]
        scales[torch.rand(scales.shape, generator=gen) < 0.5] *= -1
        scales[torch.rand(scales.shape, generator=gen) < 0.1] = 0
    read(attention_backend, to_device(args, attention_backend.device))


@pytest.mark.parametrize("group", [1, 4])
def test_e4m3_zeros_and_subnormals_count(backend, group):
    """fp8 e4m3 rows of zeros and subnormals only (S.0000.MMM: m 2^-9), 3 a kv head in the last
    block of two sequences, with a scale per row of 64 (their numbers m / 8, as large as the
    other rows' elements), K and V: read as the float's subnormals (the CPU's multiply by
    2^120, docs/cpu_attention.md), against the reference; a subnormal read as a normal number
    (2^-7 (1 + m / 8)) moves the output far past the tolerance. Quads (group 4) and rows."""
    case = Case(dtype=torch.bfloat16, num_heads=2 * group, num_kv_heads=2, head_size=128,
                seq_lens=(1, 77, 250, 33, 170))
    args, _ = quantized_args(case, torch.float8_e4m3fn, "cpu")
    gen = torch.Generator().manual_seed(3)
    for name in ("key", "value"):
        bits = args[f"{name}_cache"].view(torch.uint8)  # [blocks, kv heads, block, head size]
        for seq in (2, 4):
            last = (case.seq_lens[seq] - 1) // case.block_size
            block = int(args["block_tables"][seq, last])
            valid = case.seq_lens[seq] - last * case.block_size  # its tokens
            tokens = torch.stack([torch.randperm(valid, generator=gen)[:3] for _ in range(2)])
            heads = torch.arange(2)[:, None]
            codes = torch.randint(0, 16, (2, 3, case.head_size), generator=gen).to(torch.uint8)
            bits[block, heads, tokens] = (codes & 7) | (codes & 8) << 4
            args[f"{name}_cache_scales"][block, heads, tokens] = 64.0
    read(backend, to_device(args, backend.device))


@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
# (24, 12): more kv heads than the CPU decode gathers scales for at once (8)
@pytest.mark.parametrize("block_size,heads,head_size", [(1, (4, 4), 64), (17, (12, 3), 80),
                                                        (64, (32, 8), 128), (16, (8, 1), 256),
                                                        (5, (24, 12), 64)])
def test_block_sizes_heads_and_head_sizes(backend, fmt, block_size, heads, head_size):
    run(backend, Case(dtype=torch.float16, block_size=block_size, num_heads=heads[0],
                      num_kv_heads=heads[1], head_size=head_size, seq_lens=(3, 130, 77)), fmt)


@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
@pytest.mark.parametrize("head_size", [384, 512])
def test_decode_head_sizes_past_256(backend, fmt, head_size):
    """Decode in whole groups of 4 query heads past 256 elements a row: the AVX2 int4 S sums
    256 elements at a time in int16 before widening them (384: a last block of 128)."""
    run(backend, Case(dtype=torch.bfloat16, num_heads=8, num_kv_heads=2, head_size=head_size,
                      seq_lens=(3, 130, 77)), fmt)


@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
@pytest.mark.parametrize("head_size", [80, 192])
def test_varlen_head_sizes(backend, fmt, head_size):
    """Varlen items (the CPU's prefill path) at head sizes whose rows it converts to bfloat16 in
    a tail alone (80) and in 128-element steps and a tail (192; int4 through a table of the
    values' codes)."""
    run(backend, Case(dtype=torch.bfloat16, head_size=head_size, num_heads=8, num_kv_heads=2)
        .with_(**VARLEN), fmt)


@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_strided_layouts(backend, fmt, layout):
    run(backend, Case(layout=layout, dtype=torch.bfloat16).with_(**VARLEN), fmt)


# Formats the tensor-core kernel reads (dequantized while staged); fp8 e5m2 per row runs on
# the CUDA-core kernel.
TC_FORMATS = (torch.int8, torch.uint8, torch.float8_e4m3fn)

@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
@pytest.mark.parametrize("group", [2, 4, 8])
def test_dispatch_takes_the_tensor_cores_from_4_rows(backend, fmt, group):
    """Automatic dispatch over a cache the tensor-core kernel reads (int8, int4, fp8 e4m3 per
    row): the tensor-core kernel from 4 rows per kv head (a decode group of 4), the CUDA-core
    kernel below, and for fp8 e5m2 rows always (the emulator's profile names the kernel)."""
    if not backend.name.startswith("simt"):
        pytest.skip("the emulator's profile tells which kernel ran")
    from pagedkv.ops import simt

    case = Case(dtype=torch.bfloat16, num_heads=2 * group, seq_lens=(1, 70, 33))
    with simt.profile() as prof:
        run(backend, case, fmt)
    tc = prof.total("paged_attention_tc_kernel", "kv")["bytes"]
    assert (tc > 0) == (fmt in TC_FORMATS and group >= 4), tc


@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
@pytest.mark.parametrize("name", TC_TILES)
def test_tensor_core_tiles(backend, fmt, name):
    """The suite's tensor-core tile shapes (attention_cases.TC_TILES; a shape's own fp8 cache
    dtype, where it names one, gives way to the format) over each format, against the
    reference; on simt, from the emulator's profile, int8, int4 and fp8 e4m3 rows ran on the
    tensor-core kernel and fp8 e5m2 rows on the CUDA-core one."""
    case = TC_TILES[name].with_(cache_dtype=None)
    if not backend.name.startswith("simt"):  # the emulator's profile tells which kernel ran
        run(backend, case, fmt)
        return
    from pagedkv.ops import simt

    with simt.profile() as prof:
        run(backend, case, fmt)
    tc = prof.total("paged_attention_tc_kernel", "kv")
    core = prof.total("paged_attention_kernel", "kv")
    if fmt not in TC_FORMATS:
        assert tc["bytes"] == 0 and core["bytes"] > 0, (tc, core)
        return
    assert tc["bytes"] > 0 and core["bytes"] == 0, (tc, core)
    if case.q_lens is None:  # one row tile a (sequence, kv head): rows and scales read once
        scales = prof.total("paged_attention_tc_kernel", "kv_scales")
        assert tc["reread"] == 1.0 and scales["reread"] == 1.0, (tc, scales)


@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
def test_prefill_tiles_and_split_keys(backend, fmt):
    """The CPU's prefill path (varlen items of many rows), and one long sequence whose keys are
    split across partitions (split-K, merged by lse)."""
    if backend.name.startswith("simt"):
        pytest.skip("the emulator is slow at these sizes; test_features covers varlen")
    run(backend, Case(seq_lens=(233, 64, 5), q_lens=(113, 64, 5), num_heads=32, num_kv_heads=8,
                      head_size=128, dtype=torch.bfloat16), fmt)
    run(backend, Case(seq_lens=(3001,), num_heads=8, num_kv_heads=2, dtype=torch.float32), fmt)


@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
def test_format_error_against_the_unquantized_attention(fmt):
    """The format's own error, measured (docs/quantized_kv.md has the table): attention over
    the quantized cache against the float64 attention over the unquantized one, relative to
    its output's size, on the suite's random data and with outlier channels."""
    bound = {torch.int8: (0.02, 0.25), torch.uint8: (0.3, 1.2),
             torch.float8_e4m3fn: (0.08, 0.15), torch.float8_e5m2: (0.15, 0.3)}[fmt]
    for outliers, limit in ((False, bound[0]), (True, bound[1])):
        case = Case(seq_lens=(512, 300), num_heads=8, num_kv_heads=2, head_size=128)
        args, (kf, vf) = quantized_args(case, fmt, "cpu", outliers)
        call(torch.ops.pagedkv.paged_attention, args)
        exact = {**args, "key_cache": kf.double(), "value_cache": vf.double(),
                 "key_cache_scales": None, "value_cache_scales": None,
                 "query": args["query"].double(), "out": torch.empty(args["out"].shape,
                                                                     dtype=torch.float64)}
        reference.paged_attention(**{k: exact[k] for k in exact if k in REF_ARGS},
                                  compute_dtype=torch.float64)
        rel = ((args["out"].double() - exact["out"]).norm() / exact["out"].norm()).item()
        assert rel < limit, f"relative error {rel:.3g} with outliers={outliers}"


REF_ARGS = ("out query key_cache value_cache block_tables seq_lens query_start_loc max_seq_len "
            "max_query_len scale alibi_slopes sliding_window soft_cap k_scale v_scale lse_out "
            "sinks key_cache_scales value_cache_scales").split()


# ---- refusals -----------------------------------------------------------------------------


def _refusal_cases():
    def drop(name):
        return lambda a: a.update({name: None})

    def put(name, fn):
        return lambda a: a.update({name: fn(a)})

    return {
        "int8 without scales": (drop("key_cache_scales"), "key_cache_scales is required"),
        "value scales missing": (drop("value_cache_scales"), "value_cache_scales is required"),
        "scales dtype": (put("key_cache_scales", lambda a: a["key_cache_scales"].double()),
                         "key_cache_scales must be float32"),
        "scales shape": (put("value_cache_scales", lambda a: a["value_cache_scales"][:, :, :3]),
                         "value_cache_scales must be \\[num_blocks, num_kv_heads, block_size\\]"),
        "per-tensor scale too": (put("k_scale", lambda a: torch.ones(1)),
                                 "k_scale is only used with fp8 caches of per-tensor"),
        "scales with a float cache": (
            lambda a: a.update(key_cache=torch.zeros(a["key_cache"].shape),
                               value_cache=torch.zeros(a["value_cache"].shape)),
            "key_cache_scales is only used with int8, int4"),
        "int4 width": (put("key_cache", lambda a: a["key_cache"].view(torch.uint8)),
                       "key_cache and value_cache must have the same|head_size"),
    }


@pytest.mark.parametrize("name", list(_refusal_cases()))
def test_bad_arguments_are_refused_before_anything_is_written(backend, name):
    change, message = _refusal_cases()[name]
    args, _ = quantized_args(Case(), torch.int8, "cpu")
    change(args)
    args = {k: v.to(backend.device) if isinstance(v, torch.Tensor) else v
            for k, v in args.items()}
    with pytest.raises((RuntimeError, ValueError), match=message):
        call(backend.ops.paged_attention, args)
    assert args["out"].isnan().all()


def test_write_refusals(backend):
    dev = backend.device
    kc, vc, ks, vs = (t.to(dev) for t in empty_cache("hnd", 4, 2, 8, 32, torch.int8))
    key = torch.randn(3, 2, 32, device=dev)
    slots = torch.tensor([0, 9, -1], device=dev)
    before = [t.clone() for t in (kc, vc, ks, vs)]
    bad = {
        "key_cache_scales is required": (key, key, kc, vc, slots, None, None, None, vs),
        "k_scale is only used with fp8 caches of per-tensor": (
            key, key, kc, vc, slots, torch.ones(1, device=dev), None, ks, vs),
        "key must be float32, float16 or bfloat16 for a quantized cache": (
            key.to(torch.float8_e4m3fn), key.to(torch.float8_e4m3fn), kc, vc, slots, None, None,
            ks, vs),
        "key must be \\[num_tokens, 2, 64\\]": (
            key, key, kc.view(torch.uint8), vc.view(torch.uint8), slots, None, None, ks, vs),
    }
    for message, args in bad.items():
        with pytest.raises(RuntimeError, match=message):
            backend.ops.reshape_and_cache(*args)
    for t, b in zip((kc, vc, ks, vs), before, strict=True):
        assert_same_bits(t.cpu(), b.cpu())


@pytest.mark.parametrize("isa", CPU_ISAS)
@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
def test_cpu_instruction_sets(backend, fmt, isa, monkeypatch):
    """Every instruction set this processor has (PAGEDKV_CPU_ISA), decode and prefill paths,
    head sizes of an odd number of vectors (int4: a half-step of unpacking left over)."""
    if backend.name != "cpu":
        pytest.skip("CPU kernels only")
    use_cpu_isa(monkeypatch, isa)
    assert ops.cpu_attention_kernel(80) == isa
    run(backend, Case(dtype=torch.bfloat16, head_size=80, num_heads=6, num_kv_heads=2,
                      seq_lens=(1, 33, 70, 129), sinks=True), fmt)
    run(backend, Case(seq_lens=(200, 77), q_lens=(61, 77), num_heads=16, num_kv_heads=2,
                      head_size=80, dtype=torch.float16, alibi=True, sliding_window=50), fmt)
