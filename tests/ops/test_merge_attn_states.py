"""merge_attn_states on every backend: against pagedkv.ops.reference, and as the inverse of
splitting a context in two (attention over the halves, merged, equals attention over the whole)."""

from __future__ import annotations

import math

import pytest
import torch
from attention_cases import FLOAT_DTYPES, Case, call, check, make_args, max_err

from pagedkv.ops import reference

from helpers import CPU_ISAS, use_cpu_isa

TOLERANCE = {torch.float32: 2e-6, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def make_parts(num_tokens, num_heads, head_size, dtype, device, empty_fraction=0.2):
    """Two partial results with random lse, some of each -inf (empty parts), NaN-poisoned outs."""
    parts = [torch.randn(num_tokens, num_heads, head_size).to(dtype) for _ in range(2)]
    lses = [torch.randn(num_tokens, num_heads) * 3 for _ in range(2)]
    for lse in lses:
        lse[torch.rand(num_tokens, num_heads) < empty_fraction] = float("-inf")
    out = torch.full_like(parts[0], float("nan"))
    out_lse = torch.full((num_tokens, num_heads), float("nan"))
    args = [out, out_lse, parts[0], lses[0], parts[1], lses[1]]
    return [t.to(device) for t in args]


@pytest.mark.parametrize("head_size", [8, 64, 80, 128, 256])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_matches_reference(backend, dtype, head_size):
    args = make_parts(37, 5, head_size, dtype, backend.device)
    backend.ops.merge_attn_states(*args)
    want = [torch.empty_like(args[0].cpu()), torch.empty_like(args[1].cpu())]
    reference.merge_attn_states(*want, *[t.cpu() for t in args[2:]])
    assert max_err(args[0], want[0]) <= TOLERANCE[dtype]
    assert max_err(args[1], want[1]) <= 1e-5


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_float32_parts_into_a_16_bit_out(backend, dtype):
    """Parts in float32 (paged_attention's unrounded rows) merge into a 16-bit out, rounded once:
    the float32 merge rounded by torch, and the same lse. Bit for bit where both merges run the
    same arithmetic (the CPU's one function, simt); a CUDA build compiles one kernel per out
    dtype, and nvcc may fuse their multiply-adds differently: a last-place step, rarely."""
    args = make_parts(37, 5, 128, torch.float32, backend.device)
    args[0] = torch.full(args[0].shape, float("nan"), dtype=dtype, device=backend.device)
    backend.ops.merge_attn_states(*args)
    wide = [torch.empty_like(args[2]), torch.empty_like(args[1])]
    backend.ops.merge_attn_states(*wide, *args[2:])
    rounded = wide[0].to(dtype)
    if backend.device.type == "cpu":
        assert torch.equal(args[0], rounded)
    else:
        step = rounded.float().abs() * (2**-7 if dtype == torch.bfloat16 else 2**-10)
        assert ((args[0].float() - rounded.float()).abs() <= step + 1e-30).all()
        assert (args[0] != rounded).float().mean() < 0.01
    assert max_err(args[1], wide[1]) <= (0 if backend.device.type == "cpu" else 1e-6)


@pytest.mark.parametrize("isa", CPU_ISAS)
def test_cpu_instruction_sets(backend, isa, monkeypatch):
    """The CPU kernels of every instruction set this processor has (PAGEDKV_CPU_ISA)."""
    if backend.name != "cpu":
        pytest.skip("CPU kernels only")
    use_cpu_isa(monkeypatch, isa)
    for head_size, dtype in ((80, torch.bfloat16), (88, torch.float16), (256, torch.float32)):
        test_matches_reference(backend, dtype, head_size)


def test_both_empty_gives_zeros_and_minus_inf(backend):
    args = make_parts(4, 2, 16, torch.float32, backend.device, empty_fraction=0.0)
    args[3][1:3] = float("-inf")
    args[5][1:3] = float("-inf")
    args[2][1:3] = float("nan")  # rows of empty parts are never read
    backend.ops.merge_attn_states(*args)
    assert torch.equal(args[0][1:3].cpu(), torch.zeros(2, 2, 16))
    assert torch.isneginf(args[1][1:3]).all()
    assert not torch.isnan(args[0]).any()


# Every pairing of a finite lse and the two empty markers: -inf, and +inf (what FlashAttention-3
# and vLLM write for an empty split). Row i of the test below merges LSE_PAIRS[i].
INF = float("inf")
LSE_PAIRS = [(a, b) for a in (1.5, -INF, INF) for b in (-0.5, -INF, INF)]


@pytest.mark.parametrize("with_lse", [True, False], ids=["lse_out", "no_lse_out"])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_plus_inf_marks_an_empty_part(backend, dtype, with_lse):
    """+inf reads like -inf: the part gets weight 0 and its (NaN) rows are never read; one part
    empty gives the other exactly, both empty gives zeros and an lse of -inf."""
    n, heads, D = len(LSE_PAIRS), 3, 32
    args = make_parts(n, heads, D, dtype, "cpu", empty_fraction=0.0)
    for i, (lp, ls) in enumerate(LSE_PAIRS):
        args[3][i], args[5][i] = lp, ls
        for lse, rows in ((lp, args[2]), (ls, args[4])):
            if math.isinf(lse):
                rows[i] = float("nan")  # an empty part's rows may hold anything
    want = [torch.empty_like(args[0]), torch.empty_like(args[1])]
    reference.merge_attn_states(*want, *args[2:])
    got = [t.to(backend.device) for t in args]  # out and out_lse are NaN until the op writes
    if not with_lse:
        got[1] = None
    backend.ops.merge_attn_states(*got)
    out = got[0].cpu()
    assert not torch.isnan(out).any()
    for i, (lp, ls) in enumerate(LSE_PAIRS):
        if math.isinf(lp) and math.isinf(ls):
            assert torch.equal(out[i], torch.zeros(heads, D, dtype=dtype)), (lp, ls)
            assert torch.isneginf(want[1][i]).all()
        elif math.isinf(lp) or math.isinf(ls):
            kept, lse = (args[4], ls) if math.isinf(lp) else (args[2], lp)
            assert torch.equal(out[i], kept[i]), (lp, ls)
            assert torch.equal(want[1][i], torch.full((heads,), lse))
        else:
            assert torch.isfinite(want[1][i]).all()
    assert max_err(out, want[0]) <= TOLERANCE[dtype]  # the reference agrees, row by row
    if with_lse:
        assert max_err(got[1], want[1]) <= 1e-5


def test_random_mix_of_empty_markers(backend):
    """Parts empty at random, each marked -inf or +inf at random, against the reference."""
    args = make_parts(64, 4, 64, torch.float16, "cpu", empty_fraction=0.0)
    for i in (3, 5):
        empty = torch.rand(64, 4) < 0.3
        marker = torch.where(torch.rand(64, 4) < 0.5, -INF, INF)
        args[i] = torch.where(empty, marker, args[i])
        args[i - 1][empty] = float("nan")
    assert (args[3] == INF).any() and (args[5] == -INF).any()
    want = [torch.empty_like(args[0]), torch.empty_like(args[1])]
    reference.merge_attn_states(*want, *args[2:])
    got = [t.to(backend.device) for t in args]
    backend.ops.merge_attn_states(*got)
    assert not torch.isnan(got[0]).any() and not torch.isnan(got[1]).any()
    assert max_err(got[0], want[0]) <= TOLERANCE[torch.float16]
    assert max_err(got[1], want[1]) <= 1e-5
    assert not (got[1] == INF).any()  # +inf in, never +inf out


def test_without_out_lse_and_in_place(backend):
    args = make_parts(9, 4, 64, torch.bfloat16, backend.device)
    want = [torch.empty_like(args[0].cpu()), torch.empty_like(args[1].cpu())]
    reference.merge_attn_states(*want, *[t.cpu() for t in args[2:]])
    prefix = args[2]
    backend.ops.merge_attn_states(prefix, None, *args[2:])  # out is prefix_out
    assert max_err(prefix, want[0]) <= TOLERANCE[torch.bfloat16]


def test_strided_lse(backend):
    """lse tensors laid out [num_heads, num_tokens] and passed transposed."""
    args = make_parts(11, 3, 32, torch.float16, backend.device)
    for i in (1, 3, 5):
        args[i] = args[i].T.contiguous().T
    want = [torch.empty_like(args[0].cpu()), torch.empty(11, 3)]
    reference.merge_attn_states(*want, *[t.cpu() for t in args[2:]])
    backend.ops.merge_attn_states(*args)
    assert max_err(args[0], want[0]) <= TOLERANCE[torch.float16]
    assert max_err(args[1], want[1]) <= 1e-5


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("split", [16, 48, 112])
def test_merging_the_halves_of_a_context(attention_backend, dtype, split):
    """Decode over keys [0, split) and [split, L) as two sequences (split at a block boundary),
    merged, against decode over the whole context (each attention kernel: attention_backend)."""
    backend = attention_backend
    dev = backend.device
    whole = make_args(Case(seq_lens=(130, 130), num_heads=8, num_kv_heads=2, block_size=16,
                           dtype=dtype), dev)
    call(backend.ops.paged_attention, whole)
    check(whole)
    bs = 16
    table = whole["block_tables"]
    halves = []
    for lens, tab in (((split, split), table[:, : split // bs]),
                      ((130 - split,) * 2, table[:, split // bs:])):
        part = dict(whole)
        part["block_tables"] = tab.contiguous()
        part["seq_lens"] = torch.tensor(lens, dtype=torch.int32, device=dev)
        part["out"] = torch.full_like(whole["out"], float("nan"))
        part["lse_out"] = torch.full_like(whole["lse_out"], float("nan"))
        call(backend.ops.paged_attention, part)
        halves.append(part)
    out = torch.full_like(whole["out"], float("nan"))
    lse = torch.full_like(whole["lse_out"], float("nan"))
    backend.ops.merge_attn_states(out, lse, halves[0]["out"], halves[0]["lse_out"],
                                  halves[1]["out"], halves[1]["lse_out"])
    assert max_err(out, whole["out"]) <= 2 * TOLERANCE[dtype]
    assert max_err(lse, whole["lse_out"]) <= 1e-5


def test_opcheck(backend):
    args = make_parts(6, 4, 16, torch.bfloat16, backend.device)
    torch.library.opcheck(backend.ops.merge_attn_states.default, tuple(args))


BAD = {
    "out dtype": (lambda a: a.__setitem__(0, a[0].double()), "out must be float32"),
    "prefix dtype": (lambda a: a.__setitem__(2, a[2].half()), "prefix_out must have out's dtype"),
    "parts of two dtypes": (lambda a: [a.__setitem__(0, a[0].bfloat16()),
                                       a.__setitem__(4, a[4].bfloat16())],
                            "suffix_out must have prefix_out's dtype Float"),
    "16-bit parts of another dtype": (
        lambda a: [a.__setitem__(i, a[i].to(t)) for i, t in ((0, torch.bfloat16),
                                                                (2, torch.half), (4, torch.half))],
        "prefix_out must have out's dtype BFloat16 or be float32"),
    "suffix shape": (lambda a: a.__setitem__(4, a[4][:, :2]), "suffix_out must have out's shape"),
    "lse dtype": (lambda a: a.__setitem__(3, a[3].double()), "prefix_lse must be float32"),
    "lse shape": (lambda a: a.__setitem__(5, a[5][:3]), "suffix_lse must be \\[num_tokens"),
    "out_lse shape": (lambda a: a.__setitem__(1, a[1][:, :1]), "out_lse must be"),
    "last dim": (lambda a: a.__setitem__(0, a[0].transpose(0, 2).contiguous().transpose(0, 2)),
                 "out must have a contiguous last"),
    "head size": (lambda a: [a.__setitem__(i, a[i][..., :12]) for i in (0, 2, 4)],
                  "head_size must be a multiple of 8"),
}


@pytest.mark.parametrize("name", BAD)
def test_rejects_bad_input(backend, name):
    args = make_parts(6, 4, 16, torch.float32, "cpu")
    mutate, message = BAD[name]
    mutate(args)
    args = [t.to(backend.device) for t in args]
    out, out_lse = args[0], args[1]
    with pytest.raises(RuntimeError, match=message):
        backend.ops.merge_attn_states(*args)
    assert torch.isnan(out).all() and torch.isnan(out_lse).all()


def test_more_heads_than_the_grid_allows_is_a_clear_error(backend):
    """Heads are the CUDA kernel's grid y (at most 65535): the CUDA and simt glue refuse more."""
    if backend.name == "cpu":
        pytest.skip("the CPU kernel has no grid")
    heads, dev = 65536, backend.device
    out = torch.full((1, heads, 8), float("nan"), device=dev)
    states = [torch.randn(1, heads, 8, device=dev), torch.zeros(1, heads, device=dev)]
    with pytest.raises(RuntimeError, match="num_heads 65536 exceeds 65535, the kernel's grid"):
        backend.ops.merge_attn_states(out, None, *states, *states)
    assert torch.isnan(out).all()
