"""pagedkv: paged KV cache kernels (CUDA and CPU) and block management for PyTorch.

The package is layered; a module imports only from its own layer and the layers below
(tests/test_layers.py holds it to that):

=====  =====================  =============================================================
layer  package                what
=====  =====================  =============================================================
0      ``pagedkv.errors``,    the error types; argument checks
       ``pagedkv.checks``
1      ``pagedkv.ops``        the kernels as Python functions; ``reference``; ``simt``
2      ``pagedkv.cache``      ``KVCacheSpec``, ``PagedKVCache``
3      ``pagedkv.blocks``     allocator, prefix cache, ``BlockManager``, batches, cache plans
4      ``pagedkv.serving``    the model, the scheduler, ``LLMEngine``
5      ``pagedkv.tools``      the ``pagedkv`` command, demo, simulator, presets
5      ``pagedkv.             pagedkv inside Hugging Face transformers (``integrations.hf``,
       integrations``         not imported here: transformers is optional)
=====  =====================  =============================================================

The names below are the public API.
"""

from pagedkv import ops
from pagedkv.blocks import (
    BatchTensors,
    BlockAllocator,
    BlockManager,
    CachePlan,
    PlanExecutor,
    PrefixCache,
    cpu_cache_for,
)
from pagedkv.cache import KVCacheSpec, PagedKVCache
from pagedkv.errors import *  # noqa: F403
from pagedkv.errors import __all__ as _error_names
from pagedkv.ops import (
    concat_and_cache_mla,
    copy_blocks,
    gather_cache,
    merge_attn_states,
    mla_attention,
    paged_attention,
    reference,
    reshape_and_cache,
    swap_blocks,
)

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
    "concat_and_cache_mla",
    "copy_blocks",
    "cpu_cache_for",
    "gather_cache",
    "merge_attn_states",
    "mla_attention",
    "ops",
    "paged_attention",
    "reference",
    "reshape_and_cache",
    "swap_blocks",
    *_error_names,
]
