"""Layer 1, the ops: pagedkv's kernels as typed Python functions over ``torch.ops.pagedkv``,
with ``reference`` (plain PyTorch versions of every op, the tests' oracle) and ``simt`` (the CUDA
kernel source run on the CPU by the emulator). May import only the base modules
(``pagedkv.errors``, ``pagedkv.checks``) and the extension modules.

Each op runs the CPU kernels for CPU tensors and the CUDA kernels for CUDA tensors, mutates its
output arguments in place and returns nothing. Fake implementations are registered so that the
ops trace under ``torch.compile(fullgraph=True)``.

Index ranges (slots, block ids) are validated on the host for CPU tensors. For CUDA tensors that
would need a device-to-host copy and a synchronization per call, so it is skipped unless the
environment variable ``PAGEDKV_CHECK_INDICES=1`` is set when the library loads.
"""

from __future__ import annotations

import torch

from pagedkv import _C  # noqa: F401  (registers torch.ops.pagedkv)

__all__ = [
    "OPS",
    "arg_names",
    "concat_and_cache_mla",
    "copy_blocks",
    "cpu_attention_kernel",
    "cpu_amx_tiles",
    "cpu_bf16_dot_products",
    "cpu_peak_gflops",
    "gather_cache",
    "merge_attn_states",
    "mla_attention",
    "paged_attention",
    "reshape_and_cache",
    "swap_blocks",
]


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    key_cache_scales: torch.Tensor | None = None,
    value_cache_scales: torch.Tensor | None = None,
) -> None:
    """Writes the K/V of new tokens into their cache slots.

    Parameters
    ----------
    key, value : Tensor
        ``[num_tokens, num_kv_heads, head_size]``, float32 / float16 / bfloat16, last dim
        contiguous (token and head strides are free, e.g. slices of a fused QKV tensor).
    key_cache, value_cache : Tensor
        ``[num_blocks, num_kv_heads, block_size, head_size]`` with a contiguous last dim (an NHD
        permutation or K/V views of one ``[num_blocks, 2, ...]`` tensor work as they are). Same
        dtype as ``key``, or fp8 (``float8_e4m3fn`` / ``float8_e5m2``) with scales, or a
        per-(token, head) quantized format: int8, or int4 as ``uint8`` of ``head_size / 2``
        (two elements a byte, element ``2i`` in the low nibble).
    slot_mapping : Tensor
        int64 ``[num_tokens]``: ``block_id * block_size + offset``; negative entries are padding.
    k_scale, v_scale : Tensor, optional
        float32, one element, for fp8 caches of per-tensor scales: stored = saturate(x / scale).
    key_cache_scales, value_cache_scales : Tensor, optional
        float32 ``[num_blocks, num_kv_heads, block_size]`` (any strides), written: each row's
        scale ``absmax(row) / qmax`` (qmax 127 for int8, 7 for int4, the format's largest
        finite value for fp8), the row stored as ``round(x / scale)`` (fp8: saturating). Required
        with int8 and int4 caches; with an fp8 cache, in place of ``k_scale`` / ``v_scale``.

    Example
    -------
    >>> kc = torch.zeros(4, 2, 16, 64); vc = torch.zeros_like(kc)
    >>> k = torch.randn(3, 2, 64); v = torch.randn(3, 2, 64)
    >>> reshape_and_cache(k, v, kc, vc, torch.tensor([17, 18, -1]))
    """
    torch.ops.pagedkv.reshape_and_cache(
        key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale, key_cache_scales,
        value_cache_scales,
    )


def copy_blocks(
    key_caches: list[torch.Tensor], value_caches: list[torch.Tensor], block_mapping: torch.Tensor
) -> None:
    """Copies blocks within each layer's caches, all layers at once (copy-on-write).

    Parameters
    ----------
    key_caches, value_caches : list of Tensor
        One cache per layer, all of one shape, strides, dtype and device.
    block_mapping : Tensor
        int64 ``[num_pairs, 2]`` rows of (src, dst) on the caches' device. Destinations must be
        distinct and must not also be sources (the pairs are copied concurrently).
    """
    torch.ops.pagedkv.copy_blocks(key_caches, value_caches, block_mapping)


def swap_blocks(src: torch.Tensor, dst: torch.Tensor, block_mapping: torch.Tensor) -> None:
    """Copies whole blocks from ``src`` to ``dst``: GPU <-> CPU, or within one device.

    Parameters
    ----------
    src, dst : Tensor
        ``[num_blocks, ...]`` caches of one dtype and one block layout; the block counts may
        differ. Each block must be stored densely. Use pinned CPU memory for asynchronous copies.
    block_mapping : Tensor
        int64 ``[num_pairs, 2]`` rows of (src block, dst block), on the CPU.
    """
    torch.ops.pagedkv.swap_blocks(src, dst, block_mapping)


def paged_attention(
    out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor | None,
    max_seq_len: int,
    max_query_len: int,
    scale: float,
    alibi_slopes: torch.Tensor | None = None,
    sliding_window: int = -1,
    soft_cap: float = 0.0,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    lse_out: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    key_cache_scales: torch.Tensor | None = None,
    value_cache_scales: torch.Tensor | None = None,
    causal: bool = True,
) -> None:
    """Attention of each query token over its sequence's paged K/V cache, written into ``out``.

    Sequence ``i`` has ``seq_lens[i]`` keys at positions ``0 .. seq_lens[i] - 1``; its query
    tokens are its last ``q_len_i`` positions and attend causally (with ``causal=False``, all
    of them sit at position ``seq_lens[i] - 1`` and see every key). logit = scale * q.k, then
    the soft cap ``soft_cap * tanh(logit / soft_cap)``, then ALiBi ``slope * (key_pos -
    query_pos)``; a query at position ``p`` sees keys ``p - sliding_window < key_pos <= p``.

    Parameters
    ----------
    out : Tensor
        ``[num_tokens, num_heads, head_size]``, query's dtype, or float32 under a 16-bit query:
        the rows unrounded, a part to merge with :func:`merge_attn_states` (a cascade's levels)
        that is then rounded once. Written; last dim contiguous.
    query : Tensor
        ``[num_tokens, num_heads, head_size]``, float32 / float16 / bfloat16, last dim
        contiguous. head_size a multiple of 8 up to 512.
    key_cache, value_cache : Tensor
        ``[num_blocks, num_kv_heads, block_size, head_size]``, last dim contiguous, any other
        strides (NHD views, K/V views of one combined tensor). query's dtype, or fp8
        (``float8_e4m3fn`` / ``float8_e5m2``) dequantized as ``x * k_scale`` / ``x * v_scale``,
        or a per-(token, head) format (int8; int4 as ``uint8`` ``[..., head_size / 2]``; fp8)
        dequantized as ``x * scale`` of the row's entry in ``key_cache_scales`` /
        ``value_cache_scales`` (see :func:`reshape_and_cache`; on CUDA the CUDA-core kernel
        reads them, not the tensor-core one).
        num_heads must be a multiple of num_kv_heads (GQA, MQA); block_size 1 to 256.
    block_tables : Tensor
        int32 ``[num_seqs, max_blocks_per_seq]``. Only the entries of blocks holding a key that
        some query attends are read (``ceil(seq_len / block_size)`` entries, fewer with a
        sliding window); the rest may hold anything (padding such as -1).
    seq_lens : Tensor
        int32 ``[num_seqs]``, the context length including the query tokens. In decode, 0 marks
        an empty sequence: its output is 0 and its lse -inf.
    query_start_loc : Tensor, optional
        int32 ``[num_seqs + 1]``, the cumulative query lengths (``[0] = 0``, ``[-1] =
        num_tokens``), for chunked prefill, prefill over a cached prefix or speculative
        verification. None: decode, token ``i`` is the single query of sequence ``i``.
    max_seq_len, max_query_len : int
        Upper bounds of ``seq_lens`` and of the query lengths (1 in decode), host ints.
    scale : float
        Multiplier of q.k, usually ``head_size ** -0.5``.
    alibi_slopes : Tensor, optional
        float32 ``[num_heads]``.
    sliding_window : int
        Keys within this many positions of the query (the query's own included); -1 = all.
    soft_cap : float
        Logit soft cap; 0 = off.
    k_scale, v_scale : Tensor, optional
        float32, one element each; required with fp8 caches, rejected otherwise.
    lse_out : Tensor, optional
        float32 ``[num_tokens, num_heads]``; written with the natural-log log-sum-exp of each
        row's logits (after soft cap and ALiBi, the sink's included), for
        :func:`merge_attn_states`.
    sinks : Tensor, optional
        float32 ``[num_heads]``, on query's device: attention sinks (gpt-oss; vLLM's
        ``s_aux``). ``sinks[h]`` is the logit of one more key of head ``h`` whose value is
        zero: ``out = sum_k e^l_k v_k / (e^s + sum_k e^l_k)`` and ``lse = log(e^s + sum_k
        e^l_k)``; not scaled, capped or biased. It enters once per row, however the keys are
        split: to merge partial results with :func:`merge_attn_states`, pass ``sinks`` to one
        part only. A row with no key gets zeros and lse ``sinks[h]``.
    key_cache_scales, value_cache_scales : Tensor, optional
        float32 ``[num_blocks, num_kv_heads, block_size]``, the rows' scales, as
        :func:`reshape_and_cache` writes them: required with int8 and int4 caches, and with an
        fp8 cache in place of ``k_scale`` / ``v_scale``.
    causal : bool
        False: every query of a sequence sees all of its keys, as the queries of a cascade's
        shared prefix do (every query comes after the prefix); ALiBi and the window then count
        from position ``seq_lens[i] - 1``. Decode is the same either way.

    Example
    -------
    >>> kc = torch.randn(8, 2, 16, 64); vc = torch.randn_like(kc)
    >>> q = torch.randn(2, 8, 64); out = torch.empty_like(q)
    >>> tables = torch.tensor([[3, 1], [5, -1]], dtype=torch.int32)
    >>> lens = torch.tensor([20, 7], dtype=torch.int32)
    >>> paged_attention(out, q, kc, vc, tables, lens, None, 20, 1, 64 ** -0.5)
    """
    torch.ops.pagedkv.paged_attention(
        out, query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
        max_seq_len, max_query_len, scale, alibi_slopes, sliding_window, soft_cap, k_scale,
        v_scale, lse_out, sinks, key_cache_scales, value_cache_scales, causal,
    )


def merge_attn_states(
    out: torch.Tensor,
    out_lse: torch.Tensor | None,
    prefix_out: torch.Tensor,
    prefix_lse: torch.Tensor,
    suffix_out: torch.Tensor,
    suffix_lse: torch.Tensor,
) -> None:
    """Combines two attentions over disjoint key sets (shared prefix / suffix, split-K).

    ``out = (e^lp * prefix_out + e^ls * suffix_out) / (e^lp + e^ls)`` and ``out_lse =
    log(e^lp + e^ls)``, computed stably in float32. An lse of -inf marks an empty part, whose
    output row is ignored (it may hold anything, NaN included); so does an lse of +inf, the marker
    FlashAttention-3 and vLLM write for an empty split. Both parts empty gives zeros and an
    ``out_lse`` of -inf. ``out`` may be one of the inputs.

    Parameters
    ----------
    out : Tensor
        ``[num_tokens, num_heads, head_size]``, float32 / float16 / bfloat16, last dim
        contiguous; written. head_size a multiple of 8 up to 512.
    out_lse : Tensor, optional
        float32 ``[num_tokens, num_heads]``, any strides; written.
    prefix_out, suffix_out : Tensor
        ``out``'s shape, one dtype: ``out``'s, or float32 (the parts unrounded, as
        :func:`paged_attention` writes them into a float32 ``out``), the two partial results.
    prefix_lse, suffix_lse : Tensor
        float32 ``[num_tokens, num_heads]``, any strides (a transposed ``[num_heads,
        num_tokens]`` tensor's ``.T`` works), as written by :func:`paged_attention`.
    """
    torch.ops.pagedkv.merge_attn_states(
        out, out_lse, prefix_out, prefix_lse, suffix_out, suffix_lse
    )


def concat_and_cache_mla(
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    scale: torch.Tensor | None = None,
) -> None:
    """Writes the MLA latent of new tokens into their cache rows: ``[kv_c[i], k_pe[i]]``.

    Parameters
    ----------
    kv_c : Tensor
        ``[num_tokens, kv_lora_rank]`` (DeepSeek: 512), the compressed latent; float32 /
        float16 / bfloat16, last dim contiguous.
    k_pe : Tensor
        ``[num_tokens, rope_dim]`` (DeepSeek: 64), the rotary key shared by the heads; kv_c's
        dtype, last dim contiguous.
    kv_cache : Tensor
        ``[num_blocks, block_size, kv_lora_rank + rope_dim]``, last dim contiguous (any other
        strides); kv_c's dtype, or fp8 (``float8_e4m3fn`` / ``float8_e5m2``) with ``scale``.
    slot_mapping : Tensor
        int64 ``[num_tokens]``: ``block_id * block_size + offset``; negative entries are padding.
    scale : Tensor, optional
        float32, one element, required with an fp8 cache: stored = saturate(x / scale).
    """
    torch.ops.pagedkv.concat_and_cache_mla(kv_c, k_pe, kv_cache, slot_mapping, scale)


def gather_cache(
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    cu_seq_lens: torch.Tensor,
    out: torch.Tensor,
    scale: torch.Tensor | None = None,
    seq_starts: torch.Tensor | None = None,
) -> None:
    """Reads sequences' MLA cache rows back into one dense tensor (the input of a
    non-absorbed prefill over a cached prefix).

    Sequence ``b`` fills rows ``cu_seq_lens[b] .. cu_seq_lens[b + 1] - 1`` of ``out`` with its
    positions ``seq_starts[b] ..`` (default from 0) in order, read through ``block_table[b]``.

    Parameters
    ----------
    kv_cache : Tensor
        ``[num_blocks, block_size, width]``, last dim contiguous, as written by
        :func:`concat_and_cache_mla`.
    block_table : Tensor
        int32 ``[batch, max_blocks]``; only the entries of the blocks read are read.
    cu_seq_lens : Tensor
        int32 ``[batch + 1]``, cumulative token counts from 0 to ``out.shape[0]``.
    out : Tensor
        ``[total_tokens, width]``, last dim contiguous; written. The cache's dtype (rows as
        stored), or float32 / float16 / bfloat16 for an fp8 cache (dequantized with ``scale``).
    scale : Tensor, optional
        float32, one element: required to dequantize an fp8 cache into a float ``out``,
        rejected otherwise.
    seq_starts : Tensor, optional
        int32 ``[batch]``, the first position of each sequence to read (chunked prefill over a
        long prefix reads it a chunk at a time).
    """
    torch.ops.pagedkv.gather_cache(kv_cache, block_table, cu_seq_lens, out, scale, seq_starts)


def mla_attention(
    out: torch.Tensor,
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor | None,
    max_seq_len: int,
    max_query_len: int,
    scale: float,
    kv_scale: torch.Tensor | None = None,
    lse_out: torch.Tensor | None = None,
) -> None:
    """Absorbed multi-head latent attention (DeepSeek-V2/V3, Kimi-K2) over a paged latent cache.

    With ``W_UK`` absorbed into the query, every head attends the same cached rows: the key is
    the whole ``[kv_c, k_pe]`` row, the value its first ``kv_lora_rank`` elements, read from the
    same row. Decode (one token per sequence), multi-token decode and varlen causal prefill over
    a cached prefix, as :func:`paged_attention` with one KV head; the output still needs
    ``W_UV``. Split-K partials are merged inside; ``lse_out`` composes with
    :func:`merge_attn_states`.

    Parameters
    ----------
    out : Tensor
        ``[num_tokens, num_heads, kv_lora_rank]``, query's dtype (or float32 under a 16-bit
        query: the rows unrounded, as in :func:`paged_attention`), last dim contiguous; written.
    query : Tensor
        ``[num_tokens, num_heads, kv_lora_rank + rope_dim]`` (the absorbed ``q_nope`` then the
        rotary ``q_pe``), float32, float16 or bfloat16, last dim contiguous. Its width, a
        multiple of 8 up to 1024, must be the cache's.
    kv_cache : Tensor
        ``[num_blocks, block_size, kv_lora_rank + rope_dim]`` as :func:`concat_and_cache_mla`
        writes it: query's dtype, or fp8 with ``kv_scale``; block size 1 to 256.
    block_tables : Tensor
        int32 ``[num_seqs, max_blocks_per_seq]``; only the entries of blocks holding keys are read.
    seq_lens : Tensor
        int32 ``[num_seqs]``: keys of each sequence, its query tokens being the last of them.
    query_start_loc : Tensor, optional
        int32 ``[num_seqs + 1]`` cumulative query counts (varlen); None for decode.
    max_seq_len, max_query_len : int
        Upper bounds of ``seq_lens`` and of the per-sequence query counts.
    scale : float
        Softmax scale (DeepSeek's ``softmax_scale``, mscale included).
    kv_scale : Tensor, optional
        float32, one element: the fp8 cache's scale (required for fp8, rejected otherwise).
    lse_out : Tensor, optional
        float32 ``[num_tokens, num_heads]``: each row's log-sum-exp of its logits; written.
    """
    torch.ops.pagedkv.mla_attention(out, query, kv_cache, block_tables, seq_lens,
                                    query_start_loc, max_seq_len, max_query_len, scale, kv_scale,
                                    lse_out)


def cpu_attention_kernel(head_size: int = 128) -> str:
    """The CPU attention kernels the ops run on this processor for ``head_size``: ``"base"``,
    ``"avx2"``, ``"avx512"`` or ``"avx512bf16"`` (AVX-512 with AVX512_BF16 and VNNI: bfloat16
    prefill on ``vdpbf16ps`` where :func:`cpu_bf16_dot_products` says so). int8 and int4 decode
    under 16-bit queries takes integer dot products in the avx512bf16 (``vpdpwssd``) and avx2
    (``vpmaddwd``) kernels, on queries rounded to int16 per row; their int4 decode at head sizes
    a multiple of 128 rounds the query rows of each kv head's whole groups of 4 to int8 instead
    (``vpdpbusd``, ``vpmaddubsw``; docs/cpu_attention.md).

    The answer of the extension's own run-time dispatch (csrc/cpu/attention.cpp): the widest
    instruction set the processor has (AVX2 needs FMA and F16C too; the AVX-512 sets are used only
    when ``head_size`` is a multiple of 16), capped by
    ``PAGEDKV_CPU_ISA=base|avx2|avx512|avx512bf16``, which must name a set this processor has
    (``ValueError`` otherwise).
    """
    return torch.ops.pagedkv.cpu_attention_kernel(head_size)


def cpu_bf16_dot_products(head_size: int = 128) -> bool:
    """Whether bfloat16 prefill on the CPU takes bfloat16 dot products (``vdpbf16ps``) for
    ``head_size``, or converts K and V rows to floats for FMAs.

    Only the avx512bf16 kernels have them (:func:`cpu_attention_kernel`), and they use them
    where ``PAGEDKV_CPU_ISA=avx512bf16`` asks, or, unset, where this processor's dot products
    reach at least 0.8 of its FMAs' FLOP rate, measured once per process on one thread (about
    15 ms, at the first attention call): Zen 4 issues them at twice the FMAs' rate; a Sapphire
    Rapids KVM guest measured 0.59 of it, and bf16 prefill ran 1.5x faster on floats there.
    """
    return torch.ops.pagedkv.cpu_bf16_dot_products(head_size)


def cpu_amx_tiles(head_size: int = 128) -> bool:
    """Whether bfloat16 prefill on the CPU (varlen items of many rows, MLA's items, the cascade's
    prefix level) runs on AMX tiles (``tdpbf16ps``) for ``head_size`` (a multiple of 32).

    Only the avx512bf16 kernels have them, on processors with AMX-BF16 (Sapphire Rapids and
    later) whose tile state Linux grants the process, and only where ``PAGEDKV_CPU_AMX=1`` asks
    (``ValueError`` on a processor without); unset or ``0``, never: the kernel is opt-in until
    it has run on such a processor (it was checked on emulated tiles, docs/cpu_attention.md).
    """
    return torch.ops.pagedkv.cpu_amx_tiles(head_size)


def cpu_peak_gflops(kind: str = "fp32", seconds: float = 0.05) -> float:
    """The CPU's measured peak rate in GFLOP/s: ``"fp32"``, float FMAs, or ``"bf16"``, bfloat16
    dot products (``vdpbf16ps``; ``ValueError`` on a processor without AVX512_BF16).

    12 independent chains of the instruction, as the attention kernels issue it (the widest
    instruction set allowed, see :func:`cpu_attention_kernel`), on every thread of torch's
    intra-op pool for about ``seconds`` each; the sum over the threads of each one's rate per
    second of its own CPU time, so that time slices taken by other processes do not count.
    The benchmark's ceiling for prefill (``bench/bench_attention.py``).
    """
    return torch.ops.pagedkv.cpu_peak_gflops(kind, seconds)


OPS = ("reshape_and_cache", "copy_blocks", "swap_blocks", "paged_attention", "merge_attn_states",
       "concat_and_cache_mla", "gather_cache", "mla_attention")
"""The tensor ops, whose schemas (csrc/schemas.h) are the one list of their arguments."""


def arg_names(op: str, namespace: str = "pagedkv") -> tuple[str, ...]:
    """The argument names of ``torch.ops.<namespace>.<op>``, in order, read from its registered
    schema: what callers that pass arguments by name (the tests, the reference) go by."""
    if op not in OPS:
        raise ValueError(f"unknown op {op!r}; ops: {', '.join(OPS)}")
    schema = getattr(getattr(torch.ops, namespace), op).default._schema
    return tuple(argument.name for argument in schema.arguments)


def register_fakes(namespace: str) -> None:
    """Registers the shape-only implementations of every op in ``torch.ops.<namespace>``."""

    def nothing(*args, **kwargs) -> None:
        return None

    for name in OPS:
        torch.library.register_fake(f"{namespace}::{name}")(nothing)


register_fakes("pagedkv")
