"""pagedkv: paged KV cache kernels (CUDA and CPU) and block management for PyTorch."""

from pagedkv import ops, reference
from pagedkv.ops import copy_blocks, reshape_and_cache, swap_blocks

__version__ = "0.1.0"

__all__ = ["copy_blocks", "ops", "reference", "reshape_and_cache", "swap_blocks"]
