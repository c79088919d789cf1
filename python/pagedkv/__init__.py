"""pagedkv: paged KV cache kernels (CUDA and CPU) and block management for PyTorch."""

from pagedkv import ops, reference
from pagedkv.allocator import BlockAllocator
from pagedkv.batch import BatchTensors
from pagedkv.cache import PagedKVCache
from pagedkv.errors import *  # noqa: F403
from pagedkv.errors import __all__ as _error_names
from pagedkv.manager import BlockManager
from pagedkv.ops import (
    copy_blocks,
    merge_attn_states,
    paged_attention,
    reshape_and_cache,
    swap_blocks,
)
from pagedkv.plan import CachePlan, PlanExecutor, cpu_cache_for
from pagedkv.prefix import PrefixCache
from pagedkv.spec import KVCacheSpec

__version__ = "0.1.0"

__all__ = [
    "BatchTensors",
    "BlockAllocator",
    "BlockManager",
    "CachePlan",
    "KVCacheSpec",
    "PagedKVCache",
    "PlanExecutor",
    "PrefixCache",
    "copy_blocks",
    "cpu_cache_for",
    "merge_attn_states",
    "ops",
    "paged_attention",
    "reference",
    "reshape_and_cache",
    "swap_blocks",
    *_error_names,
]
