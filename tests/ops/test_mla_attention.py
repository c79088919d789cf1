"""mla_attention against the float64 MLA reference on every backend with an MLA kernel
(`mla_backend`: the CPU kernels, the tensor-core MLA kernel on cuda and simt): decode,
multi-token decode (MTP) and varlen causal prefill over a cached latent prefix; 1 to 128 heads;
block sizes 1 to 256 through shuffled block tables; odd lengths; split-K (long sequences); fp8
latents; lse; NaN-poisoned outputs; merge_attn_states over a split context; bad arguments refused
before anything is written. The tensor-core kernel takes 16-bit queries: float32 cases check its
refusal there. simt runs shorter contexts (its split-K plan cuts them at 32 keys already).
The tolerance is attention_cases' rule: within twice the float32 reference's own error (both
against float64) plus a small floor; float32's floor is 1e-5, since the kernels add a
576-long dot product in one chain of a register tile (about 3x the pairwise sums' error)."""

from __future__ import annotations

import math

import attention_cases
import pytest
import torch

from pagedkv import ops
from pagedkv.ops import reference

from helpers import FLOAT_DTYPES, FP8_DTYPES

DEEPSEEK = (512, 64)  # (kv_lora_rank, rope_dim)
SMALL = (40, 8)
FP8_SCALE = 0.03
OP_ARGS = ops.arg_names("mla_attention")


def make_args(seq_lens, q_lens=None, *, heads=16, shape=SMALL, block_size=16,
              dtype=torch.float32, cache_dtype=None, lse=True, seed=0) -> dict:
    """The op's arguments: random latents in a NaN-filled cache through shuffled block tables
    (a padding column of -1 at least), out and lse_out poisoned with NaN."""
    g = torch.Generator().manual_seed(seed)
    lora, rope = shape
    width = lora + rope
    cache_dtype = cache_dtype or dtype
    blocks = [math.ceil(n / block_size) for n in seq_lens]
    num_blocks = sum(blocks) + 3
    perm = torch.randperm(num_blocks, generator=g).tolist()
    table = torch.full((len(seq_lens), max(blocks + [1]) + 1), -1, dtype=torch.int32)
    used = 0
    for i, n in enumerate(blocks):
        table[i, :n] = torch.tensor(perm[used:used + n], dtype=torch.int32)
        used += n
    latent = torch.randn(num_blocks, block_size, width, generator=g)
    kv_scale = None
    if cache_dtype in FP8_DTYPES:
        kv_scale = torch.tensor([FP8_SCALE])
        latent = latent * FP8_SCALE * 4  # values that use the fp8 range after / scale
    cache = reference.quantize(latent, cache_dtype, kv_scale)
    decode = q_lens is None
    q_lens = [1] * len(seq_lens) if decode else list(q_lens)
    tokens = sum(q_lens)
    query = torch.randn(tokens, heads, width, generator=g).to(dtype)
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    return dict(
        out=torch.full((tokens, heads, lora), float("nan"), dtype=dtype),
        query=query,
        kv_cache=cache,
        block_tables=table,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        query_start_loc=None if decode else starts,
        max_seq_len=max(seq_lens),
        max_query_len=max(q_lens),
        scale=(128 + rope) ** -0.5,  # DeepSeek's: the non-absorbed qk head size
        kv_scale=kv_scale,
        lse_out=torch.full((tokens, heads), float("nan")) if lse else None,
    )


def run(args: dict, backend=None) -> None:
    """The op on `backend` (None: pagedkv.ops); out and lse_out of `args` are written."""
    if backend is None:
        ops.mla_attention(**{name: args[name] for name in OP_ARGS})
        return
    dev = backend.device
    moved = {k: v.to(dev) if isinstance(v, torch.Tensor) else v for k, v in args.items()}
    backend.ops.mla_attention(*(moved[name] for name in OP_ARGS))
    if dev.type != "cpu":
        args["out"].copy_(moved["out"].cpu())
        if args["lse_out"] is not None:
            args["lse_out"].copy_(moved["lse_out"].cpu())


def tensor_core(backend) -> bool:
    """Whether `backend` runs the CUDA source (the tensor-core MLA kernel: 16-bit queries)."""
    return backend.device.type == "cuda" or backend.simt_order is not None


def run_or_refuse(args: dict, backend) -> bool:
    """Runs the op; float32 queries on the tensor-core kernel must be refused, naming the dtype,
    before anything is written. Returns whether it ran."""
    if tensor_core(backend) and args["query"].dtype == torch.float32:
        with pytest.raises(RuntimeError, match="float16 or bfloat16"):
            run(args, backend)
        assert args["out"].isnan().all()
        return False
    run(args, backend)
    return True


def kernel_dtype(backend, dtype: torch.dtype) -> torch.dtype:
    """`dtype`, or float16 in its place where the backend has no float32 kernel."""
    return torch.float16 if dtype == torch.float32 and tensor_core(backend) else dtype


def reference_outputs(args: dict, compute_dtype: torch.dtype):
    a = dict(args)
    out_dtype = torch.float64 if compute_dtype == torch.float64 else args["out"].dtype
    a["out"] = torch.empty(args["out"].shape, dtype=out_dtype)
    a["lse_out"] = torch.empty(args["query"].shape[:2])
    reference.mla_attention(**{name: a[name] for name in OP_ARGS}, compute_dtype=compute_dtype)
    return a["out"].double(), a["lse_out"].double()


def check(args: dict) -> None:
    attention_cases.check(args, reference_outputs, float32_floor=1e-5)


MODES = {
    "decode": ([1, 37, 300, 129], None),
    "mtp": ([2, 37, 300, 130], [2, 3, 4, 2]),
    "prefill": ([23, 300, 77], [23, 45, 1]),  # one without a cached prefix, one with a long one
}
SIMT_MODES = {
    "decode": ([1, 37, 70], None),
    "mtp": ([2, 37, 66], [2, 3, 4]),
    "prefill": ([23, 70], [23, 5]),
}


def mode_lens(backend, mode: str):
    return (SIMT_MODES if backend.simt_order is not None else MODES)[mode]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("heads", [1, 16, 128])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_deepseek_shapes(mla_backend, dtype, heads, mode):
    seq_lens, q_lens = mode_lens(mla_backend, mode)
    args = make_args(seq_lens, q_lens, heads=heads, shape=DEEPSEEK, dtype=dtype)
    if run_or_refuse(args, mla_backend):
        check(args)


@pytest.mark.parametrize("shape", [(64, 16), (80, 16), (128, 64), (256, 32), (120, 80)], ids=str)
def test_kernel_ranks(mla_backend, shape):
    """Ranks and rotary widths on each padded rank of the tensor-core kernel (120 + 80 runs in
    the rank-256 one: its rope is wider than 64)."""
    args = make_args([3, 40], [3, 2], heads=5, shape=shape, dtype=torch.bfloat16)
    run(args, mla_backend)
    check(args)


@pytest.mark.parametrize("block_size", [1, 5, 16, 64, 256])
@pytest.mark.parametrize("mode", MODES)
def test_block_sizes(mla_backend, block_size, mode):
    seq_lens, q_lens = mode_lens(mla_backend, mode)
    args = make_args(seq_lens, q_lens, heads=12, block_size=block_size, dtype=torch.bfloat16,
                     seed=block_size)
    run(args, mla_backend)
    check(args)


@pytest.mark.parametrize("cache_dtype", FP8_DTYPES, ids=str)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_fp8_latents(mla_backend, dtype, mode, cache_dtype):
    seq_lens, q_lens = mode_lens(mla_backend, mode)
    args = make_args(seq_lens, q_lens, heads=16, shape=DEEPSEEK, dtype=dtype,
                     cache_dtype=cache_dtype)
    if run_or_refuse(args, mla_backend):
        check(args)


@pytest.mark.parametrize("heads, shape", [(16, DEEPSEEK), (97, SMALL), (128, SMALL)])
def test_split_k_over_long_contexts(mla_backend, heads, shape):
    """Long sequences: the planner cuts their keys into partitions (256 keys at least; simt's
    32), merged by their lse; 97 heads also makes uneven head tiles (CPU: 49 and 48; tensor
    cores: 64 and 33 rows)."""
    simt = mla_backend.simt_order is not None
    args = make_args([400 if simt else 3001], heads=heads, shape=shape, dtype=torch.bfloat16,
                     seed=heads)
    run(args, mla_backend)
    check(args)
    args = make_args([300 if simt else 2500, 7], [3, 7], heads=heads, shape=shape,
                     dtype=kernel_dtype(mla_backend, torch.float32), seed=heads + 1)
    run(args, mla_backend)
    check(args)


def test_empty_sequences_and_no_lse(mla_backend):
    dtype = kernel_dtype(mla_backend, torch.float32)
    args = make_args([0, 9, 0], heads=4, dtype=dtype)
    run(args, mla_backend)
    check(args)
    assert torch.all(args["out"][0] == 0) and torch.all(args["out"][2] == 0)
    assert torch.all(args["lse_out"][0] == float("-inf"))
    args = make_args([5, 40], [2, 3], heads=4, dtype=dtype, lse=False)
    run(args, mla_backend)
    check(args)


def test_strided_out_and_query(mla_backend):
    """out and query as views with token and head strides of their own."""
    args = make_args([33, 70], [3, 5], heads=6, dtype=torch.float16)
    wide = torch.randn(8, 6, 2 * 48).half()
    args["query"] = wide[:, :, 48:]
    args["out"] = torch.full((8, 7, 40), float("nan")).half()[:, 1:]
    run(args, mla_backend)
    check(args)


def test_merge_attn_states_composes(mla_backend):
    """Decode over the first 32 keys and over the rest (a table shifted by two blocks of 16),
    merged by their lse, equals decode over all of them."""
    dtype = kernel_dtype(mla_backend, torch.float32)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    args = make_args([90], heads=16, shape=DEEPSEEK, dtype=dtype)
    whole = dict(args, out=args["out"].clone(), lse_out=args["lse_out"].clone())
    run(whole, mla_backend)
    prefix = dict(args, out=args["out"].clone(), lse_out=args["lse_out"].clone(),
                  seq_lens=torch.tensor([32], dtype=torch.int32))
    suffix = dict(args, out=args["out"].clone(), lse_out=args["lse_out"].clone(),
                  block_tables=args["block_tables"][:, 2:].contiguous(),
                  seq_lens=torch.tensor([58], dtype=torch.int32))
    run(prefix, mla_backend)
    run(suffix, mla_backend)
    merged, merged_lse = torch.empty_like(whole["out"]), torch.empty_like(whole["lse_out"])
    ops.merge_attn_states(merged, merged_lse, prefix["out"], prefix["lse_out"], suffix["out"],
                          suffix["lse_out"])
    torch.testing.assert_close(merged, whole["out"], rtol=tol, atol=tol)
    torch.testing.assert_close(merged_lse, whole["lse_out"], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("seq_lens, q_lens", [([9, 400], None), ([33, 70], [3, 5])],
                         ids=["decode-split", "prefill"])
def test_float32_out_is_the_rows_before_rounding(mla_backend, seq_lens, q_lens):
    """A float32 out under a bfloat16 query, rounded by torch, is the bfloat16 out bit for bit
    (the split-K reduce's rows and the unsplit kernels' alike), lse too."""
    rounded = make_args(seq_lens, q_lens, heads=16, shape=DEEPSEEK, dtype=torch.bfloat16)
    wide = dict(rounded, out=torch.full(rounded["out"].shape, float("nan")),
                lse_out=rounded["lse_out"].clone())
    run(rounded, mla_backend)
    check(rounded)
    run(wide, mla_backend)
    assert torch.equal(wide["out"].bfloat16(), rounded["out"])
    assert torch.equal(wide["lse_out"], rounded["lse_out"])


def test_opcheck(mla_backend):
    args = make_args([9, 20], [2, 3], heads=4, dtype=torch.bfloat16)
    dev = mla_backend.device
    torch.library.opcheck(mla_backend.ops.mla_attention.default,
                          tuple(args[name].to(dev) if isinstance(args[name], torch.Tensor)
                                else args[name] for name in OP_ARGS))


# --- bad input: a clear error naming the argument, and nothing written -------------------------

def _spoil(args: dict, **changes) -> dict:
    return dict(args, **changes)


def bad_cases():
    base = make_args([9, 20], [2, 3], heads=4, dtype=torch.bfloat16)
    q, out, cache = base["query"], base["out"], base["kv_cache"]
    fp8 = make_args([9, 20], [2, 3], heads=4, dtype=torch.bfloat16,
                    cache_dtype=torch.float8_e4m3fn)
    return {
        "cache not as wide as query": (_spoil(base, kv_cache=torch.zeros(
            cache.shape[0], cache.shape[1], 56).bfloat16()), "kv_cache must be as wide"),
        "query without a rope part": (_spoil(base, query=q[..., :40].contiguous()),
                                      "rope_dim"),
        "rank not a multiple of 8": (_spoil(base, out=out[..., :36]), "kv_lora_rank"),
        "out heads": (_spoil(base, out=out[:, :3]), "out must be"),
        "out dtype": (_spoil(base, out=out.half()), "out must have query's dtype .* or be "
                      "float32"),
        "cache dtype": (_spoil(base, kv_cache=cache.half()), "kv_cache must have query's dtype"),
        "cache rank": (_spoil(base, kv_cache=cache[None]), "kv_cache"),
        "cache not contiguous in its rows": (
            _spoil(base, kv_cache=torch.zeros(5, 48, 16).bfloat16().transpose(1, 2)),
            "contiguous last dim"),
        "fp8 without scale": (_spoil(fp8, kv_scale=None), "kv_scale is required"),
        "scale on a bf16 cache": (_spoil(base, kv_scale=torch.tensor([1.0])), "kv_scale"),
        "block table out of range": (
            _spoil(base, block_tables=torch.full_like(base["block_tables"], 99)),
            "block_tables"),
        "seq_lens over max_seq_len": (_spoil(base, max_seq_len=10), "max_seq_len"),
        "lse shape": (_spoil(base, lse_out=torch.zeros(5, 3)), "lse_out must be"),
        "query_start_loc end": (_spoil(base, query_start_loc=torch.tensor(
            [0, 2, 4], dtype=torch.int32)), "query_start_loc"),
    }


@pytest.mark.parametrize("case", list(bad_cases()))
def test_bad_arguments_are_refused_before_writing(mla_backend, case):
    args, message = bad_cases()[case]
    out_before = args["out"].clone()
    with pytest.raises((RuntimeError, ValueError), match=message):
        run(args, mla_backend)
    assert torch.equal(args["out"].isnan(), out_before.isnan())


def tensor_core_refusals():
    """What the tensor-core kernel cannot run, that the op (and the CPU kernels) take."""
    wide_rope = make_args([9, 20], [2, 3], heads=4, shape=(512, 72), dtype=torch.bfloat16)
    base = make_args([9, 20], [2, 3], heads=4, dtype=torch.bfloat16)
    cache = base["kv_cache"]
    padded = torch.zeros(*cache.shape[:2], cache.shape[2] + 4, dtype=cache.dtype)
    padded[..., :cache.shape[2]] = cache
    return {
        "rope wider than 64": (wide_rope, "rope_dim 72"),
        "rows off 16 bytes": (_spoil(base, kv_cache=padded[..., :cache.shape[2]]),
                              "kv_cache's rows must start on 16 bytes"),
    }


@pytest.mark.parametrize("case", list(tensor_core_refusals()))
def test_tensor_core_refusals(mla_backend, case):
    """Refused on cuda / simt before anything is written, naming the argument; the CPU kernels
    run them."""
    args, message = tensor_core_refusals()[case]
    if not tensor_core(mla_backend):
        run(args, mla_backend)
        check(args)
        return
    with pytest.raises(RuntimeError, match=message):
        run(args, mla_backend)
    assert args["out"].isnan().all()
