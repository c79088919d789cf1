"""One decode call of bench_attention_cuda's headline shape (32 x 4096, 32/8 heads, head 128,
bf16), for a profiler to measure: ``ncu ... python -m bench.ncu_decode`` (scripts/gpu_check.sh).
The third launch of the attention kernel is the one to profile (two warm-up calls come first)."""

from __future__ import annotations

import torch

import pagedkv
from bench.bench_attention_cuda import SHAPES, make_args


def main() -> None:
    args = make_args(SHAPES[0], torch.device("cuda"))
    for _ in range(3):
        pagedkv.ops.paged_attention(**args)
    torch.cuda.synchronize()
    print(f"ran 3 x paged_attention {SHAPES[0]}")


if __name__ == "__main__":
    main()
