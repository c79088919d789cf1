"""pagedkv inside Hugging Face transformers. In ``generate``: a ``Cache`` whose storage is a paged
KV cache, and the ``"pagedkv"`` attention that reads it with ``pagedkv.ops.paged_attention``::

    from pagedkv.integrations.hf import PagedCache

    model.set_attn_implementation("pagedkv")
    out = model.generate(**inputs, cache=PagedCache(model, num_blocks=1024), max_new_tokens=32)

Each row of the batch is a sequence of a ``BlockManager``: blocks are taken as tokens arrive,
prompts that share full blocks of a prefix share those blocks (prefix cache), and beam search
reorders rows by forking block tables (copy-on-write of a shared last block) instead of copying
caches. Padding columns (``attention_mask`` 0) are never written to the cache and never attended.
Each layer's sliding window, logit soft cap and attention sinks (gpt-oss, Gemma 2/3, Mistral)
go to the kernel; every layer keeps every token, the kernel masks the window.

``Cache.update`` receives only the K/V of one layer, so hooks on the model's forward read the
token ids, padding mask and positions of each forward, plan the step (blocks, slot mapping, block
tables) and pass the cache to the attention function as a model keyword argument, the way
transformers' continuous batching passes its batch to attention.

In continuous batching (``generate_batch``) transformers keeps its own cache; within
``continuous_batching_attention(model)`` its attention runs on ``paged_attention``. What works,
what transformers lacks for more, and measurements: docs/hf_integration.md.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import transformers
from transformers import AttentionInterface, Cache

from pagedkv import ops
from pagedkv.blocks.manager import BlockManager
from pagedkv.blocks.plan import PlanExecutor
from pagedkv.cache.paged_cache import PagedKVCache
from pagedkv.cache.spec import KVCacheSpec
from pagedkv.integrations.hf_step import LayerOptions, Step, query_index, real_tokens

__all__ = ["ATTENTION", "CONTINUOUS_BATCHING_TRANSFORMERS", "SUPPORTED_TRANSFORMERS", "PagedCache",
           "continuous_batching_attention", "paged_attention_forward", "varlen_attention_forward"]

ATTENTION = "pagedkv"
"""The name of the attention function in ``transformers.AttentionInterface``."""
SUPPORTED_TRANSFORMERS = ((5, 24), (6, 0))
"""Versions of transformers this module is written against: [5.24, 6.0)."""
CONTINUOUS_BATCHING_TRANSFORMERS = (5, 24)
"""The one (major, minor) whose continuous batching ``varlen_attention_forward`` was checked
against: it reads undocumented keyword arguments of that code (cu_seq_lens_q/k, max_length_q/k)."""
STEP_KWARG = "pagedkv_cache"
"""The model keyword argument that carries the step (a ``PagedCache``, or an engine step of
``hf_engine``) to the "pagedkv" attention."""


def transformers_version() -> tuple[int, int]:
    """(major, minor) of the installed transformers."""
    major, minor = transformers.__version__.split(".")[:2]
    return int(major), int("".join(itertools.takewhile(str.isdigit, minor)) or 0)


def check_transformers_version() -> None:
    """Raise ImportError unless the installed transformers is one this module is written for."""
    (low, low_minor), (high, high_minor) = SUPPORTED_TRANSFORMERS
    if not SUPPORTED_TRANSFORMERS[0] <= transformers_version() < SUPPORTED_TRANSFORMERS[1]:
        raise ImportError(
            f"pagedkv.integrations.hf needs transformers >= {low}.{low_minor}, < {high}."
            f"{high_minor} (it relies on Cache.update, AttentionInterface and the cache= keyword "
            f"of generate as they are there); transformers {transformers.__version__} is "
            "installed. pip install 'pagedkv[hf]' installs the tested version.")


class PagedCache(Cache):
    """A transformers ``Cache`` over a paged KV cache, for ``attn_implementation="pagedkv"``.

    Args:
        model: the causal LM it serves (its config gives the cache shape, its first parameter the
            dtype and device). Hooks are added to its forward once: they see each forward's
            ``input_ids``, ``attention_mask`` and ``position_ids`` and plan the step.
        num_blocks: blocks in the pool (block 0 is reserved); the batch's tokens must fit.
        block_size: tokens per block.
        enable_prefix_caching: share full blocks of identical prefixes, within a batch and, after
            ``reset()``, with the next batch.
        debug_nan: fill fresh blocks (and the null block) with NaN before a step writes them, so
            a read of padding or of a stale slot shows up in the logits.
        cache_dtype: how the cache stores K/V (``pagedkv.cache.formats``); None: the model's
            dtype. ``"int8"``, ``"int4"``, ``"fp8_e4m3_per_token_head"`` keep a scale per
            token and head (about 2x, 4x, 2x the tokens of a 16-bit cache in as many bytes);
            ``torch.float8_e4m3fn`` a scale per layer, 1.0 (``kv.k_scales``).

    One cache serves one ``generate`` call (or a continuation of it); ``reset()`` frees its
    sequences for the next batch and keeps their full blocks in the prefix cache.
    """

    def __init__(self, model: torch.nn.Module, num_blocks: int, block_size: int = 16, *,
                 enable_prefix_caching: bool = True, debug_nan: bool = False,
                 cache_dtype: torch.dtype | str | None = None) -> None:
        super().__init__(layers=[])
        config = model.config.get_text_config(decoder=True)
        head_size = getattr(config, "head_dim", None) or (
            config.hidden_size // config.num_attention_heads)
        param = next(model.parameters())
        self.spec = KVCacheSpec(config.num_hidden_layers, config.num_key_value_heads, head_size,
                                block_size, param.dtype, cache_dtype)
        self.kv = PagedKVCache(self.spec, num_blocks, param.device)
        self.manager = BlockManager(num_blocks, block_size,
                                    enable_prefix_caching=enable_prefix_caching,
                                    debug_nan=debug_nan)
        self._executor = PlanExecutor(self.kv)
        self._rows: list[int] = []  # the manager's sequence id of each batch row
        self._ids = itertools.count()
        self._columns = 0  # what transformers calls the sequence length: padding included
        self._step: Step | None = None  # the forward running now
        self._unfinished = False  # a forward began and has not ended (or raised)
        _hook(model)

    # -- what transformers asks of a Cache ---------------------------------------------------

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the step's K/V ``[rows, kv_heads, columns, head_size]`` of one layer into its
        blocks (padding and prefix-cache hits skipped). Returns the states unchanged: the
        "pagedkv" attention reads the cache."""
        step = self._current()
        ops.reshape_and_cache(step.tokens(key_states), step.tokens(value_states),
                              slot_mapping=step.batch.slot_mapping, **self.kv.layer_args(layer_idx))
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._columns

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self._columns + query_length, 0

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1

    def __len__(self) -> int:
        return self.spec.num_layers

    @property
    def is_croppable(self) -> bool:
        return False

    @property
    def is_linear(self) -> list[bool]:
        """False for every layer, and so are ``is_sliding`` and ``is_dummy``: each layer holds
        every token of its rows, a sliding-window layer too (the kernel masks the window), so
        its mask sizes are those of ``get_mask_sizes``, the whole sequence."""
        return [False] * self.spec.num_layers

    is_sliding = is_dummy = is_linear

    @property
    def batch_size(self) -> int:
        return len(self._rows)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Row ``i`` becomes old row ``beam_idx[i]``: a fork of its block table (beam search)."""
        self._select_rows(beam_idx.tolist())

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._select_rows(indices.tolist())

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._select_rows([row for row in range(len(self._rows)) for _ in range(repeats)])

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("PagedCache cannot drop tokens (assisted generation crops "
                                  "its cache); use a DynamicCache there")

    def reset(self) -> None:
        """Free every sequence (their full blocks stay in the prefix cache) for a new batch.
        After a forward that raised, the prefix cache is emptied too: that forward registered
        blocks it may not have written."""
        for seq_id in self._rows:
            self.manager.free(seq_id)
        if self._unfinished:
            self.manager.evict_cached()
        self._rows, self._columns, self._step, self._unfinished = [], 0, None, False

    # -- memory --------------------------------------------------------------------------------

    @property
    def used_bytes(self) -> int:
        """K/V bytes (row scales included) of the blocks the sequences hold (a block shared by
        prefix or beam counted once; the pool itself is ``kv.nbytes``)."""
        return self.manager.allocator.num_used_blocks * self.spec.bytes_per_block

    # -- one forward ---------------------------------------------------------------------------

    def _begin(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
               position_ids: torch.Tensor | None) -> None:
        """Plan a forward over ``input_ids [rows, columns]``: new rows on the first forward,
        appended tokens after it; ``attention_mask [rows, past + columns]`` marks real tokens."""
        if self._unfinished:
            raise RuntimeError("a forward with this PagedCache did not finish (it raised); its "
                               "sequences are incomplete: reset() the cache")
        real, tokens = real_tokens(input_ids, attention_mask)
        if self._rows and len(tokens) != len(self._rows):
            raise ValueError(f"the cache holds {len(self._rows)} rows, the input has "
                             f"{len(tokens)}; reset() it before a new batch")
        self._unfinished = True
        if self._rows:
            cached = self._append(tokens)
        else:
            cached = self._add(tokens, self._prefix_keys(position_ids, real))
        self._executor.run(self.manager)  # copy-on-write of shared last blocks; NaN fills
        query_lens = [len(t) - c for t, c in zip(tokens, cached, strict=True)]
        batch = self.manager.build_batch(self._rows, query_lens, device=self.kv.device)
        self._step = Step(batch, tuple(real.shape), query_index(real, cached, self.kv.device))

    def _prefix_keys(self, position_ids: torch.Tensor | None, real: torch.Tensor) -> list:
        """The prefix-cache key of each new row: the position of its first token when its
        positions count up from there (rotary K/V of equal tokens at equal positions are
        equal), else a key of its own."""
        rows, columns = real.shape
        if position_ids is None:  # the model counts the columns
            position_ids = torch.arange(columns)
        positions = position_ids.cpu().expand(rows, columns) if position_ids.dim() <= 2 else None
        keys = []
        for row in range(rows):
            own = positions is None or positions[row][real[row]].diff().ne(1).any()
            keys.append(("row", next(self._ids)) if own else int(positions[row][real[row]][0]))
        return keys

    def _add(self, tokens: list[list[int]], keys: list) -> list[int]:
        cached = []
        for t, key in zip(tokens, keys, strict=True):
            seq_id = next(self._ids)
            cached.append(self.manager.add_sequence(seq_id, t, key))
            self._rows.append(seq_id)  # only what the manager holds: reset() frees these
        return cached

    def _append(self, tokens: list[list[int]]) -> list[int]:
        for seq_id, t in zip(self._rows, tokens, strict=True):
            self.manager.append_tokens(seq_id, t)
        return [0] * len(tokens)

    def _end(self) -> None:
        self._columns += self._current().shape[1]
        self._step, self._unfinished = None, False

    def _current(self) -> Step:
        if self._step is None:
            raise RuntimeError("PagedCache plans each forward in a hook on the model it was made "
                               "for: call that model (not a submodule) with cache=this cache")
        return self._step

    def _select_rows(self, rows: list[int]) -> None:
        old = self._rows
        if any(not 0 <= row < len(old) for row in rows):
            raise IndexError(f"row indices must be in [0, {len(old)}), got {rows}")
        self._rows = [next(self._ids) for _ in rows]
        for seq_id, row in zip(self._rows, rows, strict=True):
            self.manager.fork(old[row], seq_id)
        for seq_id in old:
            self.manager.free(seq_id)

    def _attend(self, layer_idx: int, query: torch.Tensor, key: torch.Tensor,
                value: torch.Tensor, options: LayerOptions) -> torch.Tensor:
        """``query [rows, heads, columns, head_size]`` over the cache (``update`` wrote the
        key and value)."""
        step = self._current()
        batch = step.batch
        tokens = step.tokens(query)
        out = torch.empty_like(tokens)
        decode = batch.max_query_len == 1
        ops.paged_attention(out, tokens, block_tables=batch.block_tables,
                            seq_lens=batch.seq_lens,
                            query_start_loc=None if decode else batch.query_start_loc,
                            max_seq_len=batch.max_seq_len, max_query_len=batch.max_query_len,
                            scale=options.scale, sliding_window=options.sliding_window,
                            soft_cap=options.soft_cap, sinks=options.sinks,
                            **self.kv.layer_args(layer_idx))
        return step.scatter(out)


def paged_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                            value: torch.Tensor, attention_mask: torch.Tensor | None,
                            scaling: float | None = None, dropout: float = 0.0, **kwargs,
                            ) -> tuple[torch.Tensor, None]:
    """The "pagedkv" attention: ``query [rows, heads, columns, head_size]`` over the paged cache
    (decode, or causal varlen prefill over cached blocks). Returns ``[rows, columns, heads,
    head_size]`` and no weights. ``key``/``value`` are ignored: ``PagedCache.update`` wrote them.

    The layer's ``sliding_window``, ``softcap`` and ``s_aux`` (attention sinks), as transformers'
    attention modules pass them (gpt-oss, Gemma 2/3, Mistral, Qwen2), go to the kernel: see
    ``hf_step.LayerOptions``. A module with ``is_causal`` False (bidirectional) is refused."""
    step = kwargs.get(STEP_KWARG)
    if not hasattr(step, "_attend"):  # a PagedCache, or hf_engine's step
        raise ValueError('attn_implementation="pagedkv" reads a pagedkv.integrations.hf.PagedCache:'
                         " pass cache=PagedCache(model, num_blocks) to generate or forward")
    _refuse_bidirectional(module)
    options = LayerOptions.of(query, scaling, kwargs)
    return step._attend(module.layer_idx, query, key, value, options), None


def _refuse_bidirectional(module: torch.nn.Module) -> None:
    if not getattr(module, "is_causal", True):
        raise NotImplementedError("pagedkv's attention is causal; this layer is bidirectional")


def varlen_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                             value: torch.Tensor, attention_mask: torch.Tensor | None,
                             scaling: float | None = None, *, cu_seq_lens_q: torch.Tensor,
                             cu_seq_lens_k: torch.Tensor, max_length_q: int, max_length_k: int,
                             **kwargs) -> tuple[torch.Tensor, None]:
    """Attention of transformers' continuous batching (``generate_batch``) by
    ``pagedkv.ops.paged_attention``: packed ``query [1, heads, q_tokens, head_size]`` over the
    K/V ``[1, kv_heads, kv_tokens, head_size]`` that its cache gathered, read as a paged cache of
    one-token blocks (sequence i's block table counts up from ``cu_seq_lens_k[i]``); causal
    within each sequence, so the dense mask transformers built is not read. Windows, soft caps
    and sinks as in ``paged_attention_forward``: a window layer's gathered K/V are its last
    ``window - 1`` cached tokens and the new ones, in order, which the kernel masks the same."""
    _refuse_bidirectional(module)
    options = LayerOptions.of(query, scaling, kwargs)
    keys, values = (x[0].transpose(0, 1).unsqueeze(2) for x in (key, value))
    tokens = query[0].transpose(0, 1)  # [q_tokens, heads, head_size]
    starts = cu_seq_lens_k[:-1].to(torch.int32)
    tables = starts[:, None] + torch.arange(max(max_length_k, 1), dtype=torch.int32,
                                            device=starts.device)
    out = torch.zeros_like(tokens, memory_format=torch.contiguous_format)
    ops.paged_attention(out, tokens, keys, values, tables, cu_seq_lens_k.diff().to(torch.int32),
                        cu_seq_lens_q.to(torch.int32), max_length_k, max_length_q, options.scale,
                        sliding_window=options.sliding_window, soft_cap=options.soft_cap,
                        sinks=options.sinks)
    return out.unsqueeze(0), None


@contextmanager
def continuous_batching_attention(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """Within the block, transformers' continuous batching runs its attention with pagedkv::

        with continuous_batching_attention(model):
            outputs = model.generate_batch(prompts, generation_config)

    Continuous batching accepts only "sdpa", "paged|eager" or flash names (a flash name makes
    transformers fetch a kernel from the Hub), so ``varlen_attention_forward`` is registered as
    "paged|eager" for the block and the model switched to it; both are restored on exit. Raises
    RuntimeError unless transformers is the version this was checked against.
    """
    if transformers_version() != CONTINUOUS_BATCHING_TRANSFORMERS:
        major, minor = CONTINUOUS_BATCHING_TRANSFORMERS
        raise RuntimeError(
            f"pagedkv's continuous-batching attention reads keyword arguments that transformers "
            f"{major}.{minor} passes to attention functions (cu_seq_lens_q/k, max_length_q/k), "
            f"not a public API; transformers {transformers.__version__} is installed. Use "
            f"PagedCache with generate, or transformers=={major}.{minor}.*")
    name = "paged|eager"
    function, implementation = AttentionInterface()[name], model.config._attn_implementation
    try:
        AttentionInterface.register(name, varlen_attention_forward)
        model.set_attn_implementation(name)
        yield model
    finally:
        AttentionInterface.register(name, function)
        model.set_attn_implementation(implementation)


def _cache_of(kwargs: dict) -> PagedCache | None:
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    return cache if isinstance(cache, PagedCache) else None


def _before_forward(model: torch.nn.Module, args: tuple, kwargs: dict):
    cache = _cache_of(kwargs)
    if cache is None:
        return None
    if model.config._attn_implementation != ATTENTION:
        raise ValueError(f'PagedCache needs attn_implementation="{ATTENTION}" (model.'
                         f'set_attn_implementation("{ATTENTION}")); the model uses '
                         f'"{model.config._attn_implementation}"')
    input_ids = kwargs.get("input_ids", args[0] if args else None)
    if input_ids is None:
        raise ValueError("PagedCache needs input_ids: the prefix cache keys blocks by token ids")
    cache._begin(input_ids, kwargs.get("attention_mask"), kwargs.get("position_ids"))
    return args, {**kwargs, STEP_KWARG: cache}


def _after_forward(model: torch.nn.Module, args: tuple, kwargs: dict, output) -> None:
    cache = _cache_of(kwargs)
    if cache is not None:
        cache._end()


_hooked: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()


def _hook(model: torch.nn.Module) -> None:
    """Add the step hooks to ``model`` once."""
    if model not in _hooked:
        model.register_forward_pre_hook(_before_forward, with_kwargs=True)
        model.register_forward_hook(_after_forward, with_kwargs=True)
        _hooked.add(model)


check_transformers_version()
AttentionInterface.register(ATTENTION, paged_attention_forward)
