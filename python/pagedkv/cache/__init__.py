"""Layer 2, the cache: how rows are stored (``CacheFormat``: 16-bit, fp8, int8 / int4 / fp8 with
a scale per token and head), the shape of a paged KV cache (``KVCacheSpec``, with its KV cache
groups when layers have sliding windows) and its tensors (``PagedKVCache``: per-layer, or per page
slot, K/V block pools, block copies, swaps and NaN fills through the ops).

May import ``pagedkv.ops`` and the base modules (``pagedkv.errors``, ``pagedkv.checks``); never
block management, serving or tools.
"""

from pagedkv.cache.formats import FORMATS, CacheFormat, cache_format
from pagedkv.cache.paged_cache import PagedKVCache
from pagedkv.cache.spec import KVCacheGroup, KVCacheSpec

__all__ = ["FORMATS", "CacheFormat", "KVCacheGroup", "KVCacheSpec", "PagedKVCache",
           "cache_format"]
