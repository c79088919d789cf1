"""Layer 2, the cache: the shape of a paged KV cache (``KVCacheSpec``, with its KV cache groups
when layers have sliding windows) and its tensors (``PagedKVCache``: per-layer, or per page
slot, K/V block pools, block copies, swaps and NaN fills through the ops).

May import ``pagedkv.ops`` and the base modules (``pagedkv.errors``, ``pagedkv.checks``); never
block management, serving or tools.
"""

from pagedkv.cache.paged_cache import PagedKVCache
from pagedkv.cache.spec import KVCacheGroup, KVCacheSpec

__all__ = ["KVCacheGroup", "KVCacheSpec", "PagedKVCache"]
