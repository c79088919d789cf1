"""Layer 2, the cache: the shape of a paged KV cache (``KVCacheSpec``) and its tensors
(``PagedKVCache``: per-layer K/V block pools, block copies, swaps and NaN fills through the ops).

May import ``pagedkv.ops`` and the base modules (``pagedkv.errors``, ``pagedkv.checks``); never
block management, serving or tools.
"""

from pagedkv.cache.paged_cache import PagedKVCache
from pagedkv.cache.spec import KVCacheSpec

__all__ = ["KVCacheSpec", "PagedKVCache"]
