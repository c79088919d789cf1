"""Layer 3, block management: integer bookkeeping over a pool of block ids. The allocator
(reference counts, LRU of cached blocks), the prefix cache (verified chained hashes), the
manager (sequences -> block tables, copy-on-write, swaps, batch tensors) with its sequence
registry, the hybrid manager of several KV cache groups (sliding windows), the plans that
carry its cache work to a ``PlanExecutor``, and the cascade plans of a batch's shared blocks.

May import ``pagedkv.cache``, ``pagedkv.ops`` and the base modules; never serving or tools.
"""

from pagedkv.blocks.allocator import NULL_BLOCK, BlockAllocator
from pagedkv.blocks.batch import PAD_BLOCK, PAD_WINDOW, BatchTensors
from pagedkv.blocks.cascade import CascadeBatch, CascadePolicy, plan_cascade
from pagedkv.blocks.hybrid import HybridBlockManager
from pagedkv.blocks.manager import BlockManager
from pagedkv.blocks.plan import PHASES, CachePlan, Phase, PlanExecutor, cpu_cache_for
from pagedkv.blocks.prefix import PrefixCache

__all__ = ["NULL_BLOCK", "PAD_BLOCK", "PAD_WINDOW", "PHASES", "BatchTensors", "BlockAllocator",
           "BlockManager", "CachePlan", "CascadeBatch", "CascadePolicy", "HybridBlockManager",
           "Phase", "PlanExecutor", "PrefixCache", "cpu_cache_for", "plan_cascade"]
