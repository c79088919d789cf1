"""Pure PyTorch versions of every op: slow, obvious, and the oracle of the tests.

Each function has the semantics of the op of the same name in :mod:`pagedkv.ops`, works on any
device, and is written for clarity rather than speed.
"""

from __future__ import annotations

import torch

__all__ = [
    "attention_logits",
    "concat_and_cache_mla",
    "copy_blocks",
    "dequantize",
    "dequantize_rows",
    "gather_cache",
    "gather_kv",
    "merge_attn_states",
    "mla_attention",
    "paged_attention",
    "pack_int4",
    "quantize",
    "quantize_rows",
    "reshape_and_cache",
    "swap_blocks",
    "unpack_int4",
]

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def quantize(x: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor | None) -> torch.Tensor:
    """Converts ``x`` to a cache dtype; fp8 divides by ``scale`` and saturates."""
    if dtype not in FP8_DTYPES:
        return x.to(dtype)
    limit = torch.finfo(dtype).max
    return (x.float() / scale.float()).clamp(-limit, limit).to(dtype)


def dequantize(x: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """Cache elements as float32 (float64 stays float64); fp8 multiplies by ``scale``."""
    if x.dtype not in FP8_DTYPES:
        return x.to(torch.promote_types(x.dtype, torch.float32))
    return x.float() * scale.float()


def row_qmax(dtype: torch.dtype) -> float:
    """The largest magnitude a per-(token, head) quantized element of cache ``dtype`` stores:
    127 (int8), 7 (int4, stored as uint8), the largest finite fp8 value."""
    if dtype == torch.int8:
        return 127.0
    if dtype == torch.uint8:
        return 7.0
    return float(torch.finfo(dtype).max)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Integers in [-8, 7] (last dim even) as uint8, two a byte: element ``2i`` in the low
    nibble of byte ``i``, ``2i + 1`` in the high one (two's complement nibbles)."""
    nibbles = q.to(torch.int32) & 0xF
    return (nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)).to(torch.uint8)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`pack_int4`: int32 values in [-8, 7], twice the last dim."""
    b = packed.to(torch.int32)
    lo, hi = b & 0xF, b >> 4
    both = torch.stack([lo, hi], dim=-1).flatten(-2)
    return both - ((both & 0x8) << 1)


def quantize_rows(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-(token, head) quantization of rows ``[..., head_size]`` into cache ``dtype`` (int8;
    uint8 = int4 packed two a byte; fp8): ``(stored, scales)``. A row's scale is
    ``absmax / row_qmax(dtype)`` in float32 (0 for a row of zeros, which stores zeros), its
    elements ``round(x / scale)`` (half to even; fp8: the format's rounding, saturating)."""
    xf = x.float()
    scales = xf.abs().amax(dim=-1) / row_qmax(dtype)
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))[..., None]
    if dtype in FP8_DTYPES:
        limit = torch.finfo(dtype).max
        q = (xf / safe).clamp(-limit, limit)
        q = torch.where(scales[..., None] > 0, q, torch.zeros_like(q)).to(dtype)
        return q, scales
    limit = row_qmax(dtype)
    q = torch.round(xf / safe).clamp(-limit, limit)
    q = torch.where(scales[..., None] > 0, q, torch.zeros_like(q))
    return (pack_int4(q) if dtype == torch.uint8 else q.to(torch.int8)), scales


def dequantize_rows(stored: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Per-(token, head) quantized rows as float32: each element times its row's scale (uint8
    rows are int4 pairs, :func:`unpack_int4`)."""
    values = unpack_int4(stored) if stored.dtype == torch.uint8 else stored
    return values.float() * scales.float()[..., None]


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
    """Writes ``key[i]``/``value[i]`` to slot ``slot_mapping[i]``; negative slots are skipped.
    With ``key_cache_scales`` / ``value_cache_scales`` each row is quantized with a scale of
    its own (:func:`quantize_rows`), written beside it."""
    block_size = key_cache.shape[2]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    blocks, offsets = slots // block_size, slots % block_size
    if key_cache_scales is not None:
        for x, cache, scales in ((key, key_cache, key_cache_scales),
                                 (value, value_cache, value_cache_scales)):
            stored, row_scales = quantize_rows(x[keep], cache.dtype)
            cache[blocks, :, offsets] = stored
            scales[blocks, :, offsets] = row_scales
        return
    key_cache[blocks, :, offsets] = quantize(key[keep], key_cache.dtype, k_scale)
    value_cache[blocks, :, offsets] = quantize(value[keep], value_cache.dtype, v_scale)


def copy_blocks(
    key_caches: list[torch.Tensor], value_caches: list[torch.Tensor], block_mapping: torch.Tensor
) -> None:
    """Copies block ``src`` to block ``dst`` for every (src, dst) row, in every layer."""
    for src, dst in block_mapping.tolist():
        for cache in (*key_caches, *value_caches):
            cache[dst] = cache[src]


def swap_blocks(src: torch.Tensor, dst: torch.Tensor, block_mapping: torch.Tensor) -> None:
    """Copies ``src[s]`` to ``dst[d]`` for every (s, d) row, across devices if needed."""
    for s, d in block_mapping.tolist():
        dst[d] = src[s].to(dst.device)


def gather_kv(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_len: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reads one sequence's K/V back through its block table.

    Returns two ``[seq_len, num_kv_heads, head_size]`` tensors in the cache dtype.
    """
    block_size = key_cache.shape[2]
    positions = torch.arange(seq_len, device=key_cache.device)
    blocks = block_table.to(key_cache.device).long()[positions // block_size]
    offsets = positions % block_size
    return key_cache[blocks, :, offsets], value_cache[blocks, :, offsets]


def query_ranges(
    seq_lens: torch.Tensor, query_start_loc: torch.Tensor | None
) -> list[tuple[int, int, int]]:
    """(first token, q_len, seq_len) of every sequence: decode has one query token per sequence."""
    lens = seq_lens.tolist()
    if query_start_loc is None:
        return [(i, 1, n) for i, n in enumerate(lens)]
    starts = query_start_loc.tolist()
    return [(starts[i], starts[i + 1] - starts[i], n) for i, n in enumerate(lens)]


def attention_logits(
    q: torch.Tensor,
    k: torch.Tensor,
    seq_len: int,
    scale: float,
    alibi_slopes: torch.Tensor | None,
    sliding_window: int,
    soft_cap: float,
    causal: bool = True,
) -> torch.Tensor:
    """Logits ``[num_heads, q_len, seq_len]`` of a sequence's queries (its last positions; all
    at position ``seq_len - 1`` when not ``causal``).

    ``q`` is ``[q_len, num_heads, head_size]``, ``k`` ``[seq_len, num_heads, head_size]`` (kv
    heads already repeated for their query heads), both in the compute dtype. Masked entries
    are -inf: keys after the query (causal) and, with a window, keys ``window`` or more before.
    """
    q_len = q.shape[0]
    logits = scale * torch.einsum("qhd,khd->hqk", q, k)
    if soft_cap > 0:
        logits = soft_cap * torch.tanh(logits / soft_cap)
    q_pos = (torch.arange(seq_len - q_len, seq_len, device=q.device) if causal
             else torch.full((q_len,), seq_len - 1, device=q.device))[:, None]
    k_pos = torch.arange(seq_len, device=q.device)[None, :]
    if alibi_slopes is not None:
        slopes = alibi_slopes.to(q.device, logits.dtype)[:, None, None]
        logits = logits + slopes * (k_pos - q_pos).to(logits.dtype)
    masked = k_pos > q_pos
    if sliding_window > 0:
        masked |= q_pos - k_pos >= sliding_window
    return logits.masked_fill(masked, float("-inf"))


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
    alibi_slopes: torch.Tensor | None,
    sliding_window: int,
    soft_cap: float,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    lse_out: torch.Tensor | None,
    sinks: torch.Tensor | None = None,
    key_cache_scales: torch.Tensor | None = None,
    value_cache_scales: torch.Tensor | None = None,
    causal: bool = True,
    *,
    compute_dtype: torch.dtype = torch.float32,
) -> None:
    """Attention of each query token over its sequence's paged K/V, computed in ``compute_dtype``.

    Writes ``out`` (cast to its dtype) and ``lse_out`` (float32) in place. ``sinks[h]`` is the
    logit of one more key of head ``h`` whose value is zero: it joins the softmax's denominator
    and the lse. A sequence with seq_len 0 gets zeros and lse -inf (the sink's logit with
    sinks). With ``key_cache_scales`` / ``value_cache_scales`` the cache rows are dequantized
    by their own scales (:func:`dequantize_rows`). ``max_seq_len`` and ``max_query_len`` are
    unused here.
    """
    group = query.shape[1] // key_cache.shape[1]
    for seq, (first, q_len, seq_len) in enumerate(query_ranges(seq_lens, query_start_loc)):
        rows = slice(first, first + q_len)
        if seq_len == 0 or q_len == 0:
            out[rows] = 0
            if lse_out is not None:
                lse_out[rows] = float("-inf") if sinks is None else sinks.to(lse_out.device)
            continue
        k, v = gather_kv(key_cache, value_cache, block_tables[seq], seq_len)
        if key_cache_scales is not None:
            ks, vs = gather_kv(key_cache_scales[..., None], value_cache_scales[..., None],
                               block_tables[seq], seq_len)
            k, v = dequantize_rows(k, ks[..., 0]), dequantize_rows(v, vs[..., 0])
        else:
            k, v = dequantize(k, k_scale), dequantize(v, v_scale)
        k = k.to(compute_dtype).repeat_interleave(group, dim=1)
        v = v.to(compute_dtype).repeat_interleave(group, dim=1)
        q = query[rows].to(compute_dtype)
        logits = attention_logits(q, k, seq_len, scale, alibi_slopes, sliding_window, soft_cap,
                                  causal)
        if sinks is not None:  # the virtual key: a column of logits, no value row
            sink = sinks.to(logits.device, logits.dtype)[:, None, None].expand(-1, q_len, 1)
            lse = torch.logsumexp(torch.cat([logits, sink], dim=-1), dim=-1)
        else:
            lse = torch.logsumexp(logits, dim=-1)  # [num_heads, q_len]
        probs = torch.exp(logits - lse[..., None])
        out[rows] = torch.einsum("hqk,khd->qhd", probs, v).to(out.dtype)
        if lse_out is not None:
            lse_out[rows] = lse.T.float()


def merge_attn_states(
    out: torch.Tensor,
    out_lse: torch.Tensor | None,
    prefix_out: torch.Tensor,
    prefix_lse: torch.Tensor,
    suffix_out: torch.Tensor,
    suffix_lse: torch.Tensor,
) -> None:
    """Combines two attentions over disjoint key sets by their log-sum-exp, in float32.

    An lse of -inf or +inf marks an empty part; both empty gives zeros and -inf.
    """
    prefix_lse, suffix_lse = (
        torch.where(x == torch.inf, -torch.inf, x) for x in (prefix_lse, suffix_lse)
    )
    lse = torch.logaddexp(prefix_lse, suffix_lse)
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    wp = torch.exp(prefix_lse - safe)[..., None]
    ws = torch.exp(suffix_lse - safe)[..., None]
    merged = torch.where(wp > 0, wp * prefix_out.float(), 0.0) + torch.where(
        ws > 0, ws * suffix_out.float(), 0.0
    )
    out.copy_(merged.to(out.dtype))
    if out_lse is not None:
        out_lse.copy_(lse)


# -- MLA: one latent row per token ------------------------------------------------------------
# An MLA cache is ``[num_blocks, block_size, kv_lora_rank + rope_dim]`` (DeepSeek: 512 + 64): the
# compressed latent ``kv_c`` of each token, then its rotary key ``k_pe``, shared by every head.


def concat_and_cache_mla(
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    scale: torch.Tensor | None = None,
) -> None:
    """Writes ``[kv_c[i], k_pe[i]]`` (``[T, kv_lora_rank]``, ``[T, rope_dim]``) to the row of
    slot ``slot_mapping[i]``; negative slots are skipped. fp8 caches store ``x / scale``."""
    block_size = kv_cache.shape[1]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    rows = torch.cat([kv_c[keep], k_pe[keep]], dim=-1)
    kv_cache[slots // block_size, slots % block_size] = quantize(rows, kv_cache.dtype, scale)


def gather_cache(
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    cu_seq_lens: torch.Tensor,
    out: torch.Tensor,
    scale: torch.Tensor | None = None,
    seq_starts: torch.Tensor | None = None,
) -> None:
    """Copies each sequence's cache rows, in order, into ``out [total_tokens, width]``.

    Sequence ``b`` fills rows ``cu_seq_lens[b] .. cu_seq_lens[b + 1] - 1`` with its tokens
    from position ``seq_starts[b]`` (default 0) on, read through ``block_table[b]``. An
    ``out`` of the cache's dtype gets the rows as stored; another dtype gets them converted,
    fp8 rows dequantized (``x * scale``).
    """
    block_size = kv_cache.shape[1]
    cu = cu_seq_lens.tolist()
    starts = [0] * (len(cu) - 1) if seq_starts is None else seq_starts.tolist()
    for b, start in enumerate(starts):
        positions = torch.arange(start, start + cu[b + 1] - cu[b], device=kv_cache.device)
        blocks = block_table[b].to(kv_cache.device).long()[positions // block_size]
        rows = kv_cache[blocks, positions % block_size]
        out[cu[b]:cu[b + 1]] = rows if out.dtype == rows.dtype else dequantize(rows, scale)


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
    *,
    compute_dtype: torch.dtype = torch.float32,
) -> None:
    """Absorbed MLA: multi-query attention of ``query [T, H, kv_lora_rank + rope_dim]`` (the
    latent query, ``W_UK``-absorbed, then its rotary part) over the latent rows of each
    sequence. The key is the whole row, the value its first ``out.shape[-1]`` (kv_lora_rank)
    elements: ``out [T, H, kv_lora_rank]``, still to be multiplied by ``W_UV``. Causal, decode
    or varlen as :func:`paged_attention` (whose reference it is with one KV head)."""
    keys = kv_cache.unsqueeze(1)  # [num_blocks, 1 head, block_size, width]
    values = kv_cache[..., :out.shape[-1]].unsqueeze(1)
    paged_attention(out, query, keys, values, block_tables, seq_lens, query_start_loc,
                    max_seq_len, max_query_len, scale, None, -1, 0.0, kv_scale, kv_scale,
                    lse_out, compute_dtype=compute_dtype)
