"""The kernels' global-memory traffic counted by the simt emulator, for bench_gpu_model: per
decode configuration (GQA 1/4/8, block size 1/16/256, bf16 and fp8 caches, HND and NHD) and for
the cache ops, the K/V bytes requested over the minimal, sector efficiency and re-read factor
(docs/gpu_model.md, Traffic).
"""

from __future__ import annotations

import os

ELEMENT = {"bf16": 2, "fp8_e4m3": 1}  # bytes per cache element


# Traffic is counted on the emulator, orders of magnitude slower than a GPU: each standard shape
# runs with at most this many sequences and tokens each, and one kv head (its query heads: the
# group). The ratios below are per byte: the full shapes repeat the same requests.
TRAFFIC_SIZES = {"seqs": 2, "tokens": 1024}
TRAFFIC_BLOCKS = (1, 16, 256)
TRAFFIC_LAYOUTS = ("hnd", "nhd")


def traffic_rows(sizes: list[tuple[int, int]], groups: tuple[int, ...],
                 caches: tuple[str, ...]) -> list[dict]:
    """Counted traffic of the decode kernel per configuration (the decode shapes ``sizes`` of
    (sequences, tokens), GQA ``groups``, ``caches`` "bf16" / "fp8_e4m3"), and of the cache ops."""
    import torch

    from pagedkv.ops import simt

    if not simt.available():
        return []
    dtypes = {"bf16": torch.bfloat16, "fp8_e4m3": torch.float8_e4m3fn}
    rows, counted = [], {}
    gen = torch.Generator().manual_seed(0)
    for seqs, tokens in sizes:
        n, length = min(seqs, TRAFFIC_SIZES["seqs"]), min(tokens, TRAFFIC_SIZES["tokens"])
        for cache in caches:
            for group in groups:
                for block in TRAFFIC_BLOCKS:
                    for layout in TRAFFIC_LAYOUTS:
                        key = (n, length, cache, group, block, layout)
                        if key not in counted:  # standard shapes reduced to the same size
                            counted[key] = _decode_traffic(simt, n, length, group, block,
                                                           layout, dtypes[cache], gen)
                        kv = counted[key]
                        minimal = 2 * n * length * 128 * ELEMENT[cache]
                        rows.append({"case": f"decode {seqs}x{tokens} gqa{group} {cache}",
                                     "counted": f"{n}x{length}", "block_size": block,
                                     "layout": layout, "tag": "kv", "op": "load",
                                     "requested_over_minimal": kv["bytes"] / minimal,
                                     "sector_efficiency": kv["sector_efficiency"],
                                     "reread": kv["reread"], "bytes": kv["bytes"],
                                     "minimal": minimal})
    rows += _cache_op_traffic(simt, gen)
    return rows


def _decode_traffic(simt, n, length, group, block, layout, cache_dtype, gen) -> dict:
    import torch

    blocks_per_seq = -(-length // block)
    num_blocks = n * blocks_per_seq
    shape = (num_blocks, 1, block, 128) if layout == "hnd" else (num_blocks, block, 1, 128)

    def cache():
        c = torch.randn(shape, generator=gen).mul(0.1).to(cache_dtype)
        return c if layout == "hnd" else c.permute(0, 2, 1, 3)

    query = torch.randn(n, group, 128, generator=gen).to(torch.bfloat16)
    table = torch.randperm(num_blocks, generator=gen).to(torch.int32).view(n, blocks_per_seq)
    lens = torch.full((n,), length, dtype=torch.int32)
    scales = (torch.tensor([1.0]), torch.tensor([1.0])) if cache_dtype != torch.bfloat16 else (
        None, None)
    # The model is of the CUDA-core decode kernel: run it, whatever the dispatch would choose
    # (a group of 8 goes to the tensor-core kernel by default).
    saved = os.environ.get("PAGEDKV_ATTENTION_KERNEL")
    os.environ["PAGEDKV_ATTENTION_KERNEL"] = "cuda_core"
    try:
        with simt.profile() as prof:
            simt.ops.paged_attention(torch.empty_like(query), query, cache(), cache(), table,
                                     lens, None, length, 1, 128**-0.5, None, -1, 0.0, *scales,
                                     None)
    finally:
        if saved is None:
            del os.environ["PAGEDKV_ATTENTION_KERNEL"]
        else:
            os.environ["PAGEDKV_ATTENTION_KERNEL"] = saved
    return prof.total("paged_attention_kernel", "kv")


def _cache_op_traffic(simt, gen) -> list[dict]:
    import torch

    rows = []
    tokens, heads, block = 256, 8, 16
    for cache, dtype in (("bf16", torch.bfloat16), ("fp8_e4m3", torch.float8_e4m3fn)):
        for layout in TRAFFIC_LAYOUTS:
            shape = (tokens // block, heads, block, 128)
            if layout == "nhd":
                shape = (tokens // block, block, heads, 128)
            kc, vc = (torch.zeros(shape, dtype=dtype) for _ in range(2))
            if layout == "nhd":
                kc, vc = kc.permute(0, 2, 1, 3), vc.permute(0, 2, 1, 3)
            key, value = (torch.randn(tokens, heads, 128, generator=gen).to(torch.bfloat16)
                          for _ in range(2))
            scales = (torch.tensor([1.0]), torch.tensor([1.0])) if cache != "bf16" else ()
            slots = torch.randperm(tokens, generator=gen)
            mapping = torch.tensor([[0, 1], [2, 3], [5, 4]], dtype=torch.int64)
            with simt.profile() as prof:
                simt.ops.reshape_and_cache(key, value, kc, vc, slots, *scales)
                simt.ops.copy_blocks([kc], [vc], mapping)
            for kernel, tag, op, minimal in [
                    ("reshape_and_cache_kernel", "src", "load", 2 * key.numel() * 2),
                    ("reshape_and_cache_kernel", "kv", "store", 2 * key.numel() * ELEMENT[cache]),
                    ("copy_blocks_kernel", "kv", "load", 2 * 3 * block * heads * 128 *
                     ELEMENT[cache]),
                    ("copy_blocks_kernel", "kv", "store", 2 * 3 * block * heads * 128 *
                     ELEMENT[cache])]:
                t = prof.total(kernel, tag, op)
                rows.append({"case": f"{kernel.removesuffix('_kernel')} {cache}",
                             "counted": f"{tokens} tokens", "block_size": block,
                             "layout": layout, "tag": tag, "op": op,
                             "requested_over_minimal": t["bytes"] / minimal,
                             "sector_efficiency": t["sector_efficiency"],
                             "reread": t["reread"], "bytes": t["bytes"], "minimal": minimal})
    return rows


def print_traffic(rows: list[dict]) -> None:
    print(f"\ntraffic counted on simt (decode: <= {TRAFFIC_SIZES['seqs']} sequences of <= "
          f"{TRAFFIC_SIZES['tokens']} tokens, 1 kv head, head 128)")
    print(f"{'case':<36}{'counted':>10}{'block':>6}{'layout':>7}{'tag':>5}{'op':>6}"
          f"{'req/min':>8}{'sector eff':>11}{'reread':>7}")
    for r in rows:
        print(f"{r['case']:<36}{r['counted']:>10}{r['block_size']:>6}{r['layout']:>7}"
              f"{r['tag']:>5}{r['op']:>6}{r['requested_over_minimal']:>8.2f}"
              f"{r['sector_efficiency']:>11.1%}{r['reread']:>7.2f}")
